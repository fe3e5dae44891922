//! The Redis backend (in the role RAMCloud plays for RVM over remote memory): every log record is one key, every page
//! of a segment's home is one key, the two catalog slots are two keys. Everything a call
//! needs is pipelined on one connection: a commit is one round trip however many records
//! it flushes, a truncation is one round trip of SETRANGEs.
//!
//! "Committed" means Redis answered: the data is in the memory of that redis-server, and
//! whether it survives the server's power loss is Redis's own persistence setting
//! (`appendonly yes` with `appendfsync always` makes each answer follow an fsync). With
//! `wait_replicas` N > 0, every commit also waits (WAIT) until N replicas have it.
//!
//! Fencing, without Lua: every open takes a new epoch, a random number it SETs into
//! `rvm:NS:epoch` (random, not a counter: a Redis that lost its keys — FLUSHALL, a
//! failover to a replica that had not caught up — would hand a counter's first values out
//! again, and a writer holding one of them would take the newcomer's epoch for its own).
//!
//! - Writes that can overwrite what a newer owner wrote (home pages in truncation, the
//!   catalog slots, the DELs of log records and homes) run as a guarded transaction:
//!   `WATCH epoch`, `GET epoch` (must be ours, else [`RvmError::Fenced`] and nothing is
//!   sent), then `MULTI`, the writes, `EXEC`. A newer open's SET between the GET and the
//!   EXEC touches the watched key, so Redis answers EXEC with nil and runs none of the
//!   writes: a writer paused (SIGSTOP) anywhere in there lands nothing when continued.
//!   Two round trips instead of one; truncation and catalog writes are rare.
//! - Log appends stay one round trip: `SET NX` of each record, then `GET epoch`. A fenced
//!   writer's last batch can land, but never over a record the newer owner appended
//!   (sequence numbers are never reused); a key the newer owner finds taken is that
//!   fenced batch's, and is replaced (`append_log`) in a guarded transaction.
//!
//!
//! Log records are keyed by the instance (`rvm:NS:log:ID:SEQ`, the id a random number kept
//! under `rvm:NS:instance`): a fenced writer's last batch, landing after Redis lost its
//! keys, is under the old instance's id, so the instance made afresh there never reads it
//! back as one of its own records when its sequence numbers reach that far.
//!
//! An open refuses a Redis whose `maxmemory-policy` may evict keys without a TTL
//! (`allkeys-*`): it would drop committed log records and home pages silently.
//!
//! A server without transactions (probed at open: MULTI then DISCARD; real Redis and
//! Camelot's own RESP port both have them, a Redis-protocol proxy may not) gets the
//! weaker form for guarded writes too: the writes, then the fencing GET in the same
//! pipeline. There, a writer paused across a takeover can land one batch of home or
//! catalog writes; the open logs a warning saying so.

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
/// The instance id of one created before ids: its log keys are `rvm:NS:log:SEQ`, and so
/// it keeps the old exposure to a fenced writer's record landing after Redis lost its
/// keys (new ids are random and never 0).
const LEGACY_INSTANCE: u64 = 0;

pub struct RedisBackend {
    addr: SocketAddr,
    prefix: String,
    /// The epoch this open took (a random number SET into the epoch key).
    epoch: u64,
    /// The instance's id (under the instance key), part of every log record's key.
    instance: u64,
    wait_replicas: u32,
    conn: Mutex<Conn>,
    /// The server runs WATCH/MULTI/EXEC (real Redis and Camelot's RESP port do).
    transactions: bool,
    hooks: crate::Hooks,
    /// Sequence numbers of the records now in the log: first..next.
    log_seqs: Mutex<(u64, u64)>,
    /// Where this open's end-of-log marker is, until a record of ours replaces it.
    log_end: Mutex<Option<u64>>,
}

/// What an open writes at the sequence number after the last record it read: no record
/// decodes from it, so a recovery's scan ends there. A fenced writer's last batch landing
/// after the open's scan cannot take that key (its `SET NX` fails), and anything it puts
/// past it is never read; the opener's first append replaces the marker.
const LOG_END_MARKER: &[u8] = b"RVM-LOG-END";

impl RedisBackend {
    pub fn open(
        addr: SocketAddr,
        ns: &str,
        wait_replicas: u32,
        hooks: crate::Hooks,
    ) -> Result<RedisBackend> {
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
            instance: 0,
            wait_replicas,
            conn: Mutex::new(conn),
            transactions: false,
            hooks,
            log_seqs: Mutex::new((1, 1)),
            log_end: Mutex::new(None),
        };
        // Fail now, not at the first commit, when something else answers on that port.
        match b.run(&[vec![b"PING".to_vec()]])?.pop() {
            Some(Reply::Status(s)) if s == "PONG" => {}
            other => return Err(b.err(format!("PING answered {other:?}"))),
        }
        b.transactions = b.probe_transactions()?;
        if !b.transactions {
            tracing::warn!(
                "rvm: redis {addr} has no MULTI/EXEC: a writer fenced by a newer open can \
                 still land one batch of home or catalog writes"
            );
        }
        b.refuse_evicting_policy()?;
        b.instance = b.agree_on_instance()?;
        b.epoch = random_nonzero();
        let set = vec![
            b"SET".to_vec(),
            b.epoch_key().into_bytes(),
            b.epoch.to_string().into_bytes(),
        ];
        match b.run(&[set])?.pop() {
            Some(Reply::Status(s)) if s == "OK" => {}
            other => return Err(b.err(format!("SET of the epoch answered {other:?}"))),
        }
        Ok(b)
    }

    /// The instance's id: the one stored, or a new one stored now (`SET NX` then `GET` in
    /// one pipeline, so two first opens racing agree on whichever landed). An instance
    /// written before ids (a catalog or an old-form record, no id) gets
    /// [`LEGACY_INSTANCE`], whose log keys keep
    /// the old form: a new id would hide its untruncated records from recovery.
    fn agree_on_instance(&self) -> Result<u64> {
        let key = format!("{}:instance", self.prefix).into_bytes();
        let look = [
            vec![b"GET".to_vec(), key.clone()],
            // A catalog, or (before its first truncation) the first record.
            vec![
                b"EXISTS".to_vec(),
                format!("{}:cat:0", self.prefix).into_bytes(),
                format!("{}:cat:1", self.prefix).into_bytes(),
                format!("{}:log:1", self.prefix).into_bytes(),
            ],
        ];
        let mut replies = self.run(&look)?;
        let catalogs = replies.pop();
        let stored = replies.pop();
        if let Some(id) = parse_epoch(&stored) {
            return Ok(id);
        }
        let id = match catalogs {
            Some(Reply::Int(n)) if n > 0 => LEGACY_INSTANCE,
            Some(Reply::Int(_)) => random_nonzero(),
            other => return Err(self.err(format!("EXISTS of the catalogs answered {other:?}"))),
        };
        let commands = [
            vec![
                b"SET".to_vec(),
                key.clone(),
                id.to_string().into_bytes(),
                b"NX".to_vec(),
            ],
            vec![b"GET".to_vec(), key],
        ];
        let reply = self.run(&commands)?.pop();
        parse_epoch(&reply)
            .ok_or_else(|| self.err(format!("GET of the instance id answered {reply:?}")))
    }

    /// Fails the open when Redis may evict keys without a TTL to stay under `maxmemory`.
    /// The policy is asked of `CONFIG GET`, or, where that is refused (renamed, an ACL,
    /// a managed Redis), of `INFO memory`; a server that answers neither (a
    /// Redis-protocol proxy; Camelot's own port, which never evicts) is let through.
    fn refuse_evicting_policy(&self) -> Result<()> {
        let config = vec![
            b"CONFIG".to_vec(),
            b"GET".to_vec(),
            b"maxmemory-policy".to_vec(),
        ];
        let from_config = match self.run(&[config]).ok().and_then(|mut r| r.pop()) {
            Some(Reply::Array(Some(pair))) => match &pair[..] {
                [_, Reply::Bulk(Some(policy))] => {
                    Some(String::from_utf8_lossy(policy).into_owned())
                }
                _ => None,
            },
            _ => None,
        };
        let policy = from_config.or_else(|| {
            let info = vec![b"INFO".to_vec(), b"memory".to_vec()];
            match self.run(&[info]).ok().and_then(|mut r| r.pop()) {
                Some(Reply::Bulk(Some(text))) => String::from_utf8_lossy(&text)
                    .lines()
                    .find_map(|l| l.strip_prefix("maxmemory_policy:"))
                    .map(|p| p.trim().to_string()),
                _ => None,
            }
        });
        match policy {
            Some(policy) if policy.starts_with("allkeys-") => Err(self.err(format!(
                "maxmemory-policy is {policy}: Redis may evict committed log records and home \
                 pages to stay under maxmemory; set it to noeviction (or a volatile-* policy, \
                 which never evicts RVM's keys: they have no TTL)"
            ))),
            _ => Ok(()),
        }
    }

    fn epoch_key(&self) -> String {
        format!("{}:epoch", self.prefix)
    }

    /// Whether the server runs transactions: MULTI then DISCARD both answer OK.
    fn probe_transactions(&self) -> Result<bool> {
        let mut conn = self.conn.lock();
        let io = |e: std::io::Error| self.err(e.to_string());
        conn.command(&[b"MULTI"]).map_err(io)?;
        conn.command(&[b"DISCARD"]).map_err(io)?;
        let replies = conn.finish(2).map_err(io)?;
        Ok(replies
            .iter()
            .all(|r| matches!(r, Reply::Status(s) if s == "OK")))
    }

    fn fenced(&self, seen: &dyn std::fmt::Debug) -> RvmError {
        RvmError::Fenced(format!(
            "redis {} holds epoch {seen:?} for this instance; this writer opened with epoch \
             {} and another open took over since",
            self.addr, self.epoch
        ))
    }

    /// Runs `commands` only while the epoch key still holds this writer's epoch, all or
    /// none: WATCH + GET, then MULTI, the commands, EXEC (and WAIT with `wait_replicas`).
    /// Returns the commands' replies. Without server transactions: [`Self::run_fenced`].
    /// `pause` (a test hook) runs once the epoch check passed, before the writes go out.
    fn run_guarded(
        &self,
        commands: &[Vec<&[u8]>],
        pause: Option<&(dyn Fn() + Send + Sync)>,
    ) -> Result<Vec<Reply>> {
        if !self.transactions {
            if let Some(pause) = pause {
                pause();
            }
            return self.run_fenced(commands);
        }
        let epoch_key = self.epoch_key();
        let mut conn = self.conn.lock();
        let io = |e: std::io::Error| self.err(e.to_string());
        conn.command(&[b"WATCH", epoch_key.as_bytes()])
            .map_err(io)?;
        conn.command(&[b"GET", epoch_key.as_bytes()]).map_err(io)?;
        let mut replies = conn.finish(2).map_err(io)?;
        let seen = replies.pop();
        if let Some(Reply::Error(e)) = replies.pop() {
            return Err(self.err(format!("WATCH: {e}")));
        }
        if parse_epoch(&seen) != Some(self.epoch) {
            // Best effort: a fenced writer sends nothing more that WATCH could affect.
            let _ = conn
                .command(&[b"UNWATCH"])
                .and_then(|()| conn.finish(1).map(drop));
            return Err(self.fenced(&seen));
        }
        if let Some(pause) = pause {
            pause();
        }
        let wait_n = self.wait_replicas.to_string();
        let wait_ms = WAIT_REPLICAS_TIMEOUT_MS.to_string();
        conn.command(&[b"MULTI"]).map_err(io)?;
        for c in commands {
            conn.command(c).map_err(io)?;
        }
        conn.command(&[b"EXEC"]).map_err(io)?;
        let mut sent = commands.len() + 2;
        if self.wait_replicas > 0 {
            conn.command(&[b"WAIT", wait_n.as_bytes(), wait_ms.as_bytes()])
                .map_err(io)?;
            sent += 1;
        }
        let mut replies = conn.finish(sent).map_err(io)?;
        drop(conn);
        let waited = if self.wait_replicas > 0 {
            replies.pop()
        } else {
            None
        };
        let exec = replies.pop();
        // MULTI's and each queued command's replies: an error there (a command Redis
        // refused to queue) makes EXEC answer EXECABORT; name the first cause.
        if let Some(Reply::Error(e)) = replies.iter().find(|r| matches!(r, Reply::Error(_))) {
            return Err(self.err(format!("transaction refused: {e}; EXEC answered {exec:?}")));
        }
        let results = match exec {
            Some(Reply::Array(Some(results))) if results.len() == commands.len() => results,
            // EXEC's nil: the watched epoch changed after our GET, nothing ran.
            Some(Reply::Array(None)) | Some(Reply::Bulk(None)) => {
                return Err(self.fenced(&"a newer epoch (EXEC aborted by WATCH)"))
            }
            other => return Err(self.err(format!("EXEC answered {other:?}"))),
        };
        if let Some(Reply::Error(e)) = results.iter().find(|r| matches!(r, Reply::Error(_))) {
            return Err(self.err(e.clone()));
        }
        if let Some(w) = waited {
            self.check_wait(w)?;
        }
        Ok(results)
    }

    fn check_wait(&self, reply: Reply) -> Result<()> {
        match reply {
            Reply::Int(n) if n >= i64::from(self.wait_replicas) => Ok(()),
            other => Err(RvmError::Unavailable(format!(
                "redis {}: WAIT {} answered {other:?} within {WAIT_REPLICAS_TIMEOUT_MS} ms",
                self.addr, self.wait_replicas
            ))),
        }
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
        if parse_epoch(&fence) != Some(self.epoch) {
            return Err(self.fenced(&fence));
        }
        if let Some(Reply::Error(e)) = replies.iter().find(|r| matches!(r, Reply::Error(_))) {
            return Err(self.err(e.clone()));
        }
        if self.wait_replicas > 0 {
            let w = replies.pop().unwrap_or(Reply::Bulk(None));
            self.check_wait(w)?;
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
        if self.instance == LEGACY_INSTANCE {
            return format!("{}:log:{seq}", self.prefix);
        }
        format!("{}:log:{:016x}:{seq}", self.prefix, self.instance)
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
            self.run_guarded(&borrowed, None)?;
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
        // A key that exists although this writer still holds the newest epoch is this
        // open's end-of-log marker, or was left by a writer fenced by this open (its one
        // last batch, which failed for it): ours replaces it. That writer learnt of the
        // fence from the same batch, so it sends nothing more.
        let log_end = *self.log_end.lock();
        let taken: Vec<(u64, Vec<&[u8]>)> = replies
            .iter()
            .zip(records.iter().zip(&commands))
            .filter(|(r, _)| matches!(r, Reply::Bulk(None)))
            .map(|(_, ((seq, _), c))| (*seq, c[..3].to_vec()))
            .collect();
        if !taken.is_empty() {
            let fenced_writers = taken
                .iter()
                .filter(|(seq, _)| Some(*seq) != log_end)
                .count();
            if fenced_writers > 0 {
                tracing::warn!(
                    "rvm: {fenced_writers} log records of a fenced writer replaced on redis {}",
                    self.addr
                );
            }
            let writes: Vec<Vec<&[u8]>> = taken.into_iter().map(|(_, c)| c).collect();
            self.run_guarded(&writes, None)?;
        }
        if let Some(end) = log_end {
            if records.iter().any(|(seq, _)| *seq == end) {
                *self.log_end.lock() = None;
            }
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
        // Claimed before this open returns, under our epoch: see `LOG_END_MARKER`.
        let end_key = self.log_key(seq);
        self.run_guarded(
            &[vec![&b"SET"[..], end_key.as_bytes(), LOG_END_MARKER]],
            None,
        )?;
        *self.log_end.lock() = Some(seq);
        *self.log_seqs.lock() = (first_seq, seq);
        Ok(records)
    }

    fn reset_log(&self, next_seq: u64) -> Result<()> {
        let (first, next) = *self.log_seqs.lock();
        let mut keys: Vec<String> = (first..next).map(|s| self.log_key(s)).collect();
        // A marker left where the log no longer ends would never be replaced.
        let mut log_end = self.log_end.lock();
        if let Some(end) = *log_end {
            if end != next_seq {
                keys.push(self.log_key(end));
                *log_end = None;
            }
        }
        drop(log_end);
        self.del_keys(keys)?;
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
        self.run_guarded(&[vec![&b"SET"[..], key.as_bytes(), &catalog[..]]], None)?;
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
            self.run_guarded(chunk, self.hooks.before_home_writes.as_deref())?;
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

/// A new epoch or instance id: random, never 0 (the id of an instance from before ids).
fn random_nonzero() -> u64 {
    loop {
        let n = rand::random::<u64>();
        if n != 0 {
            return n;
        }
    }
}

/// The number a GET of the epoch (or the instance) key answered, if it holds one.
fn parse_epoch(reply: &Option<Reply>) -> Option<u64> {
    match reply {
        Some(Reply::Bulk(Some(v))) => std::str::from_utf8(v).ok()?.parse().ok(),
        _ => None,
    }
}
