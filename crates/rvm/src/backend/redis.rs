//! The Redis backend (the seed's RAMCloud backend): every log record is one key, every page
//! of a segment's home is one key, the two catalog slots are two keys. Everything a call
//! needs is pipelined on one connection: a commit is one round trip however many records
//! it flushes, a truncation is one round trip of SETRANGEs.
//!
//! "Committed" means Redis answered: the data is in the memory of that redis-server, and
//! whether it survives the server's power loss is Redis's own persistence setting
//! (`appendonly yes` with `appendfsync always` makes each answer follow an fsync). With
//! `wait_replicas` N > 0, every commit also waits (WAIT) until N replicas have it.
//!
//! Fencing, without Lua: every open takes a new epoch (INCR on `rvm:NS:epoch`), and every
//! pipeline that changes the instance ends with a GET of that key. Redis runs one
//! connection's commands in order, one at a time, so a pipeline whose GET still sees the
//! writer's epoch ran entirely before any newer open (which then reads it); one whose GET
//! sees a newer epoch fails with [`RvmError::Fenced`]. Log records are written with
//! `SET NX`: sequence numbers are never reused, so a fenced writer's next (and last)
//! batch cannot replace a record the newer owner appended; a key the newer owner finds
//! taken is that fenced batch's, and is replaced (`append_log`).

use super::resp::{Conn, Reply};
use super::{Backend, HomeWrite};
use crate::error::{Result, RvmError};
use crate::limits::{PAGE_BYTES, REDIS_KEYS_PER_COMMAND_MAX, REDIS_LOG_BYTES_MAX};
use crate::record::{decode_record, Record};
use bytes::Bytes;
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Log keys read per round trip during recovery.
const SCAN_WINDOW_KEYS: u64 = 64;
/// WAIT's timeout: replicas that have not acknowledged a commit by then fail it.
const WAIT_REPLICAS_TIMEOUT_MS: u64 = 5_000;
/// WAIT for more replicas than this is refused (a Redis primary rarely has more).
pub const WAIT_REPLICAS_MAX: u32 = 16;

pub struct RedisBackend {
    addr: SocketAddr,
    prefix: String,
    /// The epoch this open took (INCR of the epoch key).
    epoch: u64,
    wait_replicas: u32,
    conn: Mutex<Conn>,
    /// Sequence numbers of the records now in the log: first..next.
    log_seqs: Mutex<(u64, u64)>,
}

impl RedisBackend {
    pub fn open(addr: SocketAddr, ns: &str, wait_replicas: u32) -> Result<RedisBackend> {
        if wait_replicas > WAIT_REPLICAS_MAX {
            return Err(RvmError::TooLarge {
                what: "wait_replicas",
                got: u64::from(wait_replicas),
                max: u64::from(WAIT_REPLICAS_MAX),
            });
        }
        let conn = Conn::connect(addr, CONNECT_TIMEOUT).map_err(|e| RvmError::Redis {
            addr: addr.to_string(),
            detail: format!("cannot connect: {e}"),
        })?;
        let mut b = RedisBackend {
            addr,
            prefix: format!("rvm:{ns}"),
            epoch: 0,
            wait_replicas,
            conn: Mutex::new(conn),
            log_seqs: Mutex::new((1, 1)),
        };
        // Fail now, not at the first commit, when something else answers on that port.
        match b.run(&[vec![b"PING".to_vec()]])?.pop() {
            Some(Reply::Status(s)) if s == "PONG" => {}
            other => return Err(b.err(format!("PING answered {other:?}"))),
        }
        let incr = vec![b"INCR".to_vec(), b.epoch_key().into_bytes()];
        b.epoch = match b.run(&[incr])?.pop() {
            Some(Reply::Int(n)) if n > 0 => n as u64,
            other => return Err(b.err(format!("INCR of the epoch answered {other:?}"))),
        };
        Ok(b)
    }

    fn epoch_key(&self) -> String {
        format!("{}:epoch", self.prefix)
    }

    /// `run_borrowed` for commands that change the instance: followed by WAIT (with
    /// `wait_replicas`) and the fencing GET, checked before anything else.
    fn run_fenced(&self, commands: &[Vec<&[u8]>]) -> Result<Vec<Reply>> {
        let epoch_key = self.epoch_key();
        let wait_n = self.wait_replicas.to_string();
        let wait_ms = WAIT_REPLICAS_TIMEOUT_MS.to_string();
        let mut all: Vec<Vec<&[u8]>> = commands.to_vec();
        if self.wait_replicas > 0 {
            all.push(vec![b"WAIT", wait_n.as_bytes(), wait_ms.as_bytes()]);
        }
        all.push(vec![b"GET", epoch_key.as_bytes()]);
        let mut conn = self.conn.lock();
        let io = |e: std::io::Error| self.err(e.to_string());
        for c in &all {
            conn.command(c).map_err(io)?;
        }
        let mut replies = conn.finish(all.len()).map_err(io)?;
        drop(conn);
        let fence = replies.pop();
        let now = match &fence {
            Some(Reply::Bulk(Some(v))) => std::str::from_utf8(v).ok().and_then(|v| v.parse().ok()),
            _ => None,
        };
        if now != Some(self.epoch) {
            return Err(RvmError::Fenced(format!(
                "redis {} holds epoch {fence:?} for this instance; this writer opened with \
                 epoch {} and another open took over since",
                self.addr, self.epoch
            )));
        }
        if let Some(Reply::Error(e)) = replies.iter().find(|r| matches!(r, Reply::Error(_))) {
            return Err(self.err(e.clone()));
        }
        if self.wait_replicas > 0 {
            match replies.pop() {
                Some(Reply::Int(n)) if n >= i64::from(self.wait_replicas) => {}
                other => {
                    return Err(RvmError::Unavailable(format!(
                        "redis {}: WAIT {} answered {other:?} within {WAIT_REPLICAS_TIMEOUT_MS} \
                         ms",
                        self.addr, self.wait_replicas
                    )))
                }
            }
        }
        Ok(replies)
    }

    fn err(&self, detail: String) -> RvmError {
        RvmError::Redis {
            addr: self.addr.to_string(),
            detail,
        }
    }

    fn log_key(&self, seq: u64) -> String {
        format!("{}:log:{seq}", self.prefix)
    }

    fn page_key(&self, seg: u64, page: u64) -> String {
        format!("{}:seg:{seg}:{page}", self.prefix)
    }

    /// Sends the commands in one pipeline and returns their replies; a Redis error reply
    /// fails the call.
    fn run(&self, commands: &[Vec<Vec<u8>>]) -> Result<Vec<Reply>> {
        let mut conn = self.conn.lock();
        let io = |e: std::io::Error| self.err(e.to_string());
        for c in commands {
            let args: Vec<&[u8]> = c.iter().map(Vec::as_slice).collect();
            conn.command(&args).map_err(io)?;
        }
        let replies = conn.finish(commands.len()).map_err(io)?;
        if let Some(Reply::Error(e)) = replies.iter().find(|r| matches!(r, Reply::Error(_))) {
            return Err(self.err(e.clone()));
        }
        Ok(replies)
    }

    fn del_keys(&self, keys: Vec<String>) -> Result<()> {
        let commands: Vec<Vec<Vec<u8>>> = keys
            .chunks(REDIS_KEYS_PER_COMMAND_MAX)
            .map(|chunk| {
                std::iter::once(b"DEL".to_vec())
                    .chain(chunk.iter().map(|k| k.as_bytes().to_vec()))
                    .collect()
            })
            .collect();
        let borrowed: Vec<Vec<&[u8]>> = commands
            .iter()
            .map(|c| c.iter().map(Vec::as_slice).collect())
            .collect();
        if !borrowed.is_empty() {
            self.run_fenced(&borrowed)?;
        }
        Ok(())
    }
}

impl Backend for RedisBackend {
    fn describe(&self) -> String {
        format!("redis {}", self.addr)
    }

    fn append_log(&self, records: &[(u64, Bytes)]) -> Result<()> {
        let keys: Vec<String> = records.iter().map(|(seq, _)| self.log_key(*seq)).collect();
        let commands: Vec<Vec<&[u8]>> = records
            .iter()
            .zip(&keys)
            .map(|((_, b), k)| vec![&b"SET"[..], k.as_bytes(), &b[..], &b"NX"[..]])
            .collect();
        let replies = self.run_fenced(&commands)?;
        // A key that exists although this writer still holds the newest epoch was left by
        // a writer fenced by this open (its one last batch, which failed for it): ours
        // replaces it. That writer learnt of the fence from the same batch, so it sends
        // nothing more.
        let taken: Vec<Vec<&[u8]>> = replies
            .iter()
            .zip(&commands)
            .filter(|(r, _)| matches!(r, Reply::Bulk(None)))
            .map(|(_, c)| c[..3].to_vec())
            .collect();
        if !taken.is_empty() {
            tracing::warn!(
                "rvm: {} log records of a fenced writer replaced on redis {}",
                taken.len(),
                self.addr
            );
            self.run_fenced(&taken)?;
        }
        let mut seqs = self.log_seqs.lock();
        if let Some((last, _)) = records.last() {
            seqs.1 = last + 1;
        }
        Ok(())
    }

    fn scan_log(&self, first_seq: u64) -> Result<Vec<Record>> {
        let mut records = Vec::new();
        let mut seq = first_seq;
        'windows: loop {
            let commands: Vec<Vec<Vec<u8>>> = (seq..seq + SCAN_WINDOW_KEYS)
                .map(|s| vec![b"GET".to_vec(), self.log_key(s).into_bytes()])
                .collect();
            for reply in self.run(&commands)? {
                let Reply::Bulk(Some(value)) = reply else {
                    break 'windows;
                };
                match decode_record(&Bytes::from(value)) {
                    Ok((r, len)) if r.seq == seq && len > 0 => records.push(r),
                    _ => break 'windows,
                }
                seq += 1;
            }
        }
        *self.log_seqs.lock() = (first_seq, seq);
        Ok(records)
    }

    fn reset_log(&self, next_seq: u64) -> Result<()> {
        let (first, next) = *self.log_seqs.lock();
        self.del_keys((first..next).map(|s| self.log_key(s)).collect())?;
        *self.log_seqs.lock() = (next_seq, next_seq);
        Ok(())
    }

    fn log_capacity_bytes(&self) -> u64 {
        REDIS_LOG_BYTES_MAX
    }

    fn read_catalog_slots(&self) -> Result<[Option<Bytes>; 2]> {
        let commands: Vec<Vec<Vec<u8>>> = (0..2)
            .map(|i| {
                vec![
                    b"GET".to_vec(),
                    format!("{}:cat:{i}", self.prefix).into_bytes(),
                ]
            })
            .collect();
        let mut out = [None, None];
        for (slot, reply) in out.iter_mut().zip(self.run(&commands)?) {
            if let Reply::Bulk(Some(v)) = reply {
                *slot = Some(Bytes::from(v));
            }
        }
        Ok(out)
    }

    fn write_catalog_slot(&self, slot: usize, catalog: Bytes) -> Result<()> {
        let key = format!("{}:cat:{slot}", self.prefix);
        self.run_fenced(&[vec![&b"SET"[..], key.as_bytes(), &catalog[..]]])?;
        Ok(())
    }

    fn create_home(&self, _seg: u64, _len: u64) -> Result<()> {
        // A missing page key reads as zeros; pages are created by the first truncation
        // that writes them.
        Ok(())
    }

    fn write_home(&self, writes: &[HomeWrite]) -> Result<()> {
        // One SETRANGE per page a write touches.
        let mut keys = Vec::new();
        let mut pieces: Vec<(usize, u64, Bytes)> = Vec::new();
        for w in writes {
            let mut at = 0usize;
            while at < w.data.len() {
                let abs = w.offset + at as u64;
                let page = abs / PAGE_BYTES;
                let in_page = abs % PAGE_BYTES;
                let n = ((PAGE_BYTES - in_page) as usize).min(w.data.len() - at);
                keys.push(self.page_key(w.seg, page));
                pieces.push((keys.len() - 1, in_page, w.data.slice(at..at + n)));
                at += n;
            }
        }
        let offsets: Vec<String> = pieces.iter().map(|(_, o, _)| o.to_string()).collect();
        let commands: Vec<Vec<&[u8]>> = pieces
            .iter()
            .zip(&offsets)
            .map(|((k, _, d), o)| vec![&b"SETRANGE"[..], keys[*k].as_bytes(), o.as_bytes(), d])
            .collect();
        for chunk in commands.chunks(REDIS_KEYS_PER_COMMAND_MAX) {
            self.run_fenced(chunk)?;
        }
        Ok(())
    }

    fn read_home(&self, seg: u64, offset: u64, out: &mut [u8]) -> Result<()> {
        if !offset.is_multiple_of(PAGE_BYTES) {
            return Err(RvmError::InvalidArgument(format!(
                "home reads start on a page, not at {offset}"
            )));
        }
        let first = offset / PAGE_BYTES;
        let pages = (out.len() as u64).div_ceil(PAGE_BYTES);
        let mut page = 0u64;
        while page < pages {
            let end = (page + REDIS_KEYS_PER_COMMAND_MAX as u64).min(pages);
            let command: Vec<Vec<u8>> = std::iter::once(b"MGET".to_vec())
                .chain((page..end).map(|p| self.page_key(seg, first + p).into_bytes()))
                .collect();
            let reply = self.run(&[command])?.pop();
            let Some(Reply::Array(Some(values))) = reply else {
                return Err(self.err(format!("MGET answered {reply:?}")));
            };
            if values.len() as u64 != end - page {
                return Err(self.err("MGET answered the wrong number of values".into()));
            }
            for (p, v) in (page..end).zip(values) {
                let start = (p * PAGE_BYTES) as usize;
                let end = (start + PAGE_BYTES as usize).min(out.len());
                let dst = &mut out[start..end];
                match v {
                    Reply::Bulk(Some(bytes)) => {
                        let n = bytes.len().min(dst.len());
                        dst[..n].copy_from_slice(&bytes[..n]);
                        dst[n..].fill(0);
                    }
                    Reply::Bulk(None) => dst.fill(0),
                    other => return Err(self.err(format!("MGET value {other:?}"))),
                }
            }
            page = end;
        }
        Ok(())
    }

    fn drop_home(&self, seg: u64, len: u64) -> Result<()> {
        let pages = len.div_ceil(PAGE_BYTES);
        self.del_keys((0..pages).map(|p| self.page_key(seg, p)).collect())
    }
}
