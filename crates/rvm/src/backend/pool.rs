//! The pool backend: log, catalog and homes in regions on Camelot memory servers. A commit
//! is one pipelined batch of WRITEs (one round trip); with two servers every batch goes to
//! both at once and returns when both answered, so mirroring costs about one round trip
//! more of bandwidth, not a second round trip.
//!
//! Each replica holds a header region (`rvm/NS/hdr`) written when the instance is
//! created: the log's geometry, so a reopen never trusts the caller's `log_bytes`, and
//! the fencing epoch. Every open takes a new epoch (FETCH_ADD on the header word) before
//! it reads anything, and every WRITE that changes the instance — log appends, homes,
//! catalogs — is a WRITE_IF guarded by that word: the server writes only while the word
//! still holds the writer's own epoch, checking and writing in one step under the header
//! region's lock, which the FETCH_ADD needs too. So each of an older writer's WRITEs either
//! landed before the newer open took its epoch (and so before it read anything) or is
//! refused, whenever the older writer sends it — paused, slow or unaware it was fenced. A
//! refused WRITE answers the newer epoch and fails the call with [`RvmError::Fenced`].
//!
//! (Until protocol 3 a CAS ended each batch and the log moved to a region of the new
//! epoch, `rvm/NS/log.EPOCH`, at a new owner's first change; the header's log generation
//! still names the region an instance created then uses, and an open frees any other
//! `rvm/NS/log*` region such a move left behind when it crashed.)

use super::{Backend, HomeWrite};
use crate::error::{Result, RvmError};
use crate::limits::{
    CATALOG_BYTES_MAX, CATALOG_FIRST_READ_BYTES, IO_CHUNK_BYTES, MIRRORS_MAX, READ_WINDOW_BYTES,
};
use crate::record::{
    catalog_encoded_len, newest_catalog, scan_stream, scan_stream_placing, Placer, Record,
};
use bytes::Bytes;
use camelot_client::proto::{ErrorCode, Op};
use camelot_client::{reply, Client, ClientConfig, ClusterMap, Pending, Region};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

/// A replica that does not accept a connection within this is treated as down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A request unanswered this long fails the batch (a 40 MB commit takes milliseconds).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// The header region: one page, of which the first `HEADER_USED_BYTES` are used.
const HEADER_BYTES: u64 = crate::limits::PAGE_BYTES;
const HEADER_USED_BYTES: u32 = 48;
/// "RVMHDR01", little-endian: a header that was written (a new region reads as zeros).
const HEADER_MAGIC: u64 = u64::from_le_bytes(*b"RVMHDR01");
const HEADER_MAGIC_OFFSET: u64 = 0;
/// The log region's size in bytes, fixed when the instance was created.
const HEADER_LOG_BYTES_OFFSET: u64 = 8;
/// The fencing epoch (8-byte aligned: FETCH_ADD and CAS need it).
const HEADER_EPOCH_OFFSET: u64 = 16;
/// Who took the current epoch (process id and start time), for error messages.
const HEADER_OWNER_OFFSET: u64 = 24;
/// The epoch whose log region holds the log (0: `rvm/NS/log`, from before generations).
const HEADER_LOG_GEN_OFFSET: u64 = 32;
/// The instance's id, random, the same on every mirror: written when the instance is
/// created (with every mirror answering) or a mirror is rewritten from another. A memory
/// server restarted empty comes back without it, so it is never taken for the instance
/// (0: a header from before instance ids, which is not checked).
const HEADER_INSTANCE_OFFSET: u64 = 40;

struct Replica {
    addr: SocketAddr,
    client: Client,
    header: Region,
    /// Whether its header held the instance before this open (a mirror restarted empty
    /// does not, and is rewritten from one that does, never read from).
    held: bool,
    /// For a mirror that did not hold the instance, opened for recovery: the log size
    /// and instance id its header is to get once the recovery has rewritten it whole
    /// ([`Backend::resynced`]). Until then it has no header, and is never taken for
    /// the instance.
    header_after_resync: Option<(u64, u64)>,
    /// The epoch this open took on this replica.
    epoch: u64,
    /// The log region: `rvm/NS/log`, or `rvm/NS/log.GEN` for the generation the header
    /// names.
    log: Region,
    catalogs: [Region; 2],
    homes: Mutex<HashMap<u64, Region>>,
}

/// What recovery learned about each replica, to pick the most advanced one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Position {
    applied_seq: u64,
    last_seq: u64,
    end_bytes: u64,
}

pub struct PoolBackend {
    ns: String,
    hooks: crate::Hooks,
    /// `None` for a replica that was down when opened for recovery.
    replicas: Vec<Option<Replica>>,
    log_capacity_bytes: u64,
    tail_bytes: Mutex<u64>,
    /// Replica recovery reads from, and whether the others must be rewritten.
    source: usize,
    resync: bool,
    /// The source's log as `choose_source` scanned it (first sequence number, records,
    /// end), handed to the first `scan_log` asking for that sequence number: opening
    /// always scans right after, and reading a 40 MB log twice doubled recovery time.
    scanned: Mutex<Option<(u64, Vec<Record>, u64)>>,
}

impl PoolBackend {
    /// Connects to one server (or two, mirrored), creating the log and catalog regions of
    /// instance `ns` where missing. With `allow_down`, an unreachable replica is tolerated
    /// as long as one answers (recovery); commits then fail until it is back.
    pub fn open(
        servers: &[SocketAddr],
        ns: &str,
        token: Option<Vec<u8>>,
        log_capacity_bytes: u64,
        allow_down: bool,
        hooks: crate::Hooks,
    ) -> Result<PoolBackend> {
        if servers.is_empty() || servers.len() > MIRRORS_MAX {
            return Err(RvmError::InvalidArgument(format!(
                "the pool backend takes 1 to {MIRRORS_MAX} servers, not {}",
                servers.len()
            )));
        }
        // Recovery must agree with what the mirrors hold; an open without it discards
        // the instance, which starts again under a new id.
        let instance = match (servers.len() > 1, allow_down) {
            (false, _) => None,
            (true, true) => Some(agree_on_instance(servers, ns, &token, allow_down)?),
            (true, false) => Some(new_instance_id()),
        };
        let mut replicas = Vec::new();
        let mut last_err = None;
        for &addr in servers {
            match Replica::open(
                addr,
                ns,
                token.clone(),
                log_capacity_bytes,
                allow_down,
                instance,
            ) {
                Ok(r) => replicas.push(Some(r)),
                // A geometry mismatch is an answer, not an outage.
                Err(e)
                    if allow_down
                        && servers.len() > 1
                        && !matches!(e, RvmError::Geometry { .. }) =>
                {
                    tracing::warn!("rvm: replica {addr} is down: {e}");
                    last_err = Some(e);
                    replicas.push(None);
                }
                Err(e) => return Err(e),
            }
        }
        if replicas.iter().all(Option::is_none) {
            return Err(
                last_err.unwrap_or_else(|| RvmError::Unavailable("no replica answered".into()))
            );
        }
        let mut backend = PoolBackend {
            ns: ns.to_owned(),
            hooks,
            replicas,
            log_capacity_bytes,
            tail_bytes: Mutex::new(0),
            source: 0,
            resync: false,
            scanned: Mutex::new(None),
        };
        backend.choose_source(allow_down)?;
        Ok(backend)
    }

    /// Picks the replica whose log reaches furthest; the others need a resync when their
    /// position differs or they are down.
    fn choose_source(&mut self, recovering: bool) -> Result<()> {
        if self.replicas.len() == 1 {
            // Nothing to choose between: the scan is left to `scan_log[_placing]`, which
            // can then read big payloads straight into segment memory.
            return Ok(());
        }
        let mut positions = Vec::new();
        let mut scans = Vec::new();
        // Mirrors that held the instance before this open are the only sources when any
        // answered; one that did not (restarted empty) is only ever rewritten.
        // (An open without recovery discards the instance: nothing to choose from.)
        let any_held = recovering && self.replicas.iter().flatten().any(|r| r.held);
        let fresh = recovering && self.replicas.iter().flatten().any(|r| !r.held);
        for (i, r) in self.replicas.iter().enumerate() {
            let Some(r) = r else { continue };
            if any_held && !r.held {
                continue;
            }
            let slots = r.read_catalog_slots()?;
            let applied_seq = newest_catalog(&slots).map_or(0, |(_, c)| c.applied_seq);
            let (records, end_bytes) = r.scan(applied_seq + 1, self.log_capacity_bytes)?;
            let last_seq = records.last().map_or(applied_seq, |rec| rec.seq);
            scans.push((i, (applied_seq + 1, records, end_bytes)));
            positions.push((
                i,
                Position {
                    applied_seq,
                    last_seq,
                    end_bytes,
                },
            ));
        }
        let Some((source, best)) = positions
            .iter()
            .max_by_key(|(i, p)| (p.last_seq, std::cmp::Reverse(*i)))
            .cloned()
        else {
            return Err(RvmError::Unavailable("no replica answered".into()));
        };
        self.source = source;
        *self.scanned.lock() = scans
            .into_iter()
            .find_map(|(i, scan)| (i == source).then_some(scan));
        self.resync = fresh
            || positions.len() < self.replicas.len()
            || positions.iter().any(|(_, p)| *p != best);
        *self.tail_bytes.lock() = best.end_bytes;
        Ok(())
    }

    fn live(&self) -> Result<Vec<&Replica>> {
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.as_ref().ok_or_else(|| {
                    RvmError::Unavailable(format!(
                        "mirror {i} of rvm instance {:?} is down; reopen with recovery once \
                         it is back",
                        self.ns
                    ))
                })
            })
            .collect()
    }

    fn source(&self) -> Result<&Replica> {
        self.replicas
            .get(self.source)
            .and_then(Option::as_ref)
            .ok_or_else(|| RvmError::Unavailable("the recovery source is gone".into()))
    }

    /// Submits `ops(replica)` on every replica, then waits for every answer: one round
    /// trip for all of them. A batch of at least `MIRROR_THREAD_BYTES_MIN` is fed to each
    /// further mirror by a thread of its own: one thread writing both, the second
    /// mirror's queued frames waited until the whole first batch was written.
    fn on_all(
        &self,
        replicas: &[&Replica],
        ops: impl Fn(&Replica) -> Result<Vec<Op>>,
    ) -> Result<()> {
        let batches: Vec<Vec<Op>> = replicas.iter().map(|r| ops(r)).collect::<Result<_>>()?;
        let bulk_bytes: usize = batches
            .first()
            .map_or(0, |b| b.iter().map(Op::bulk_len).sum());
        if replicas.len() < 2 || bulk_bytes < MIRROR_THREAD_BYTES_MIN {
            let pending = replicas
                .iter()
                .zip(batches)
                .map(|(r, batch)| submit_all(r, batch).map(|p| (*r, p)))
                .collect::<Result<Vec<_>>>()?;
            let mut first_err = None;
            for (r, p) in pending {
                if let Err(e) = wait_all(r, p) {
                    first_err.get_or_insert(e);
                }
            }
            return first_err.map_or(Ok(()), Err);
        }
        std::thread::scope(|scope| {
            let mut helpers = Vec::new();
            let mut batches = batches.into_iter();
            let first = batches.next().unwrap_or_default();
            for (r, batch) in replicas[1..].iter().zip(batches) {
                let spawned = std::thread::Builder::new()
                    .name("rvm-mirror".into())
                    .spawn_scoped(scope, move || {
                        submit_all(r, batch).and_then(|p| wait_all(r, p))
                    });
                match spawned {
                    Ok(h) => helpers.push(Ok(h)),
                    // No thread to be had: this mirror is fed from here, after the first.
                    Err(_) => helpers.push(Err(*r)),
                }
            }
            let mut result = submit_all(replicas[0], first).and_then(|p| wait_all(replicas[0], p));
            for h in helpers {
                let r = match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(RvmError::Unavailable(
                            "a mirror's writer thread panicked".into(),
                        ))
                    }),
                    Err(r) => ops(r)
                        .and_then(|batch| submit_all(r, batch))
                        .and_then(|p| wait_all(r, p)),
                };
                if let (Ok(()), Err(e)) = (&result, r) {
                    result = Err(e);
                }
            }
            result
        })
    }
}

/// Bytes of WRITE payload per replica from which [`PoolBackend::on_all`] feeds each
/// further mirror from a thread of its own; below it a thread start costs more than a
/// transfer (a 4 MiB write takes milliseconds, starting a thread tens of microseconds).
const MIRROR_THREAD_BYTES_MIN: usize = 4 << 20;

/// Submits `batch`, every op of which is one of `r`'s guarded writes
/// ([`Replica::write_op`]), in order on `r`'s one connection.
fn submit_all(r: &Replica, batch: Vec<Op>) -> Result<Vec<Pending>> {
    batch
        .into_iter()
        .map(|op| r.client.submit(0, op).map_err(Into::into))
        .collect()
}

/// Waits for every answer (even after a failure, so nothing is left in flight) and
/// returns the first error; a guarded write that found a newer epoch is
/// [`RvmError::Fenced`], and wins over any other error of the batch.
fn wait_all(r: &Replica, pending: Vec<Pending>) -> Result<()> {
    let mut first_err: Option<RvmError> = None;
    let mut fenced = None;
    for p in pending {
        match reply::word(p.wait()) {
            Ok(epoch) if epoch == r.epoch => {}
            Ok(epoch) => {
                fenced.get_or_insert(epoch);
            }
            Err(e) => {
                first_err.get_or_insert(e.into());
            }
        }
    }
    if let Some(epoch) = fenced {
        return Err(r.fenced(epoch));
    }
    first_err.map_or(Ok(()), Err)
}

/// A region named `name` of at least `size` bytes: the existing one, or a new one. An
/// existing one that is smaller is an error, never freed: it may hold committed data.
fn lookup_or_alloc(client: &Client, name: &str, size: u64) -> Result<Region> {
    let rounded = size.div_ceil(crate::limits::PAGE_BYTES) * crate::limits::PAGE_BYTES;
    match client.lookup(name) {
        Ok(r) if r.size >= rounded => return Ok(r),
        Ok(r) => {
            return Err(RvmError::Corrupt(format!(
                "region {name:?} has {} bytes, fewer than the {rounded} its header records",
                r.size
            )))
        }
        Err(e) if e.code() == Some(ErrorCode::NameNotFound) => {}
        Err(e) => return Err(e.into()),
    }
    match alloc_named(client, name, rounded) {
        Ok(r) => Ok(r),
        // Another opener created it between our lookup and alloc.
        Err(RvmError::Pool(e)) if e.code() == Some(ErrorCode::NameExists) => {
            Ok(client.lookup(name)?)
        }
        Err(e) => Err(e),
    }
}

/// Allocates region `name` of `bytes`; a server without room for it is
/// [`RvmError::NoRoom`], naming what was asked for and what the server has free.
fn alloc_named(client: &Client, name: &str, bytes: u64) -> Result<Region> {
    match client.alloc_on(0, bytes, Some(name)) {
        Ok(r) => Ok(r),
        Err(e) if e.code() == Some(ErrorCode::OutOfMemory) => {
            let stats = client.stats(0).unwrap_or_default();
            let stat = |k: &str| stats.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
            let (used, cap) = (stat("memory_used_bytes"), stat("memory_cap_bytes"));
            Err(RvmError::NoRoom {
                region: name.to_owned(),
                needed_bytes: bytes,
                free_bytes: match (used, cap) {
                    (Some(used), Some(cap)) => cap.saturating_sub(used).to_string(),
                    _ => "an unknown number of".to_owned(),
                },
                cap_bytes: cap.map_or_else(|| "?".to_owned(), |c| c.to_string()),
            })
        }
        Err(e) => Err(e.into()),
    }
}

fn word_at(bytes: &[u8], offset: u64) -> u64 {
    let at = offset as usize;
    bytes
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// The header's magic and log size (not its epoch, which fences writers).
fn write_geometry(client: &Client, header: &Region, log_bytes: u64) -> Result<()> {
    let mut geometry = Vec::with_capacity(16);
    geometry.extend_from_slice(&HEADER_MAGIC.to_le_bytes());
    geometry.extend_from_slice(&log_bytes.to_le_bytes());
    client.write(header, HEADER_MAGIC_OFFSET, Bytes::from(geometry))?;
    Ok(())
}

fn write_instance_id(client: &Client, header: &Region, id: u64) -> Result<()> {
    client.write(
        header,
        HEADER_INSTANCE_OFFSET,
        Bytes::copy_from_slice(&id.to_le_bytes()),
    )?;
    Ok(())
}

/// A new instance's id: random, never 0 (which marks a header from before ids).
fn new_instance_id() -> u64 {
    loop {
        let id = rand::random::<u64>();
        if id != 0 {
            return id;
        }
    }
}

/// A client of one pool server.
fn connect_replica(addr: SocketAddr, token: Option<Vec<u8>>) -> Result<Client> {
    let cfg = ClientConfig {
        token,
        // One connection: a commit's ops stay in order on it and share frames.
        connections_per_node: 1,
        connect_timeout: CONNECT_TIMEOUT,
        request_timeout: REQUEST_TIMEOUT,
        ..ClientConfig::default()
    };
    Ok(Client::connect(ClusterMap::from_addrs(&[addr]), cfg)?)
}

/// The instance id of `ns` a mirror's header holds, read before anything is written:
/// `None` when it holds no instance (no header, as on a server restarted empty).
fn peek_instance(addr: SocketAddr, ns: &str, token: Option<Vec<u8>>) -> Result<Option<u64>> {
    let client = connect_replica(addr, token)?;
    let header = match client.lookup(&format!("rvm/{ns}/hdr")) {
        Ok(r) => r,
        Err(e) if e.code() == Some(ErrorCode::NameNotFound) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let head = client.read(&header, 0, HEADER_USED_BYTES)?;
    Ok((word_at(&head, HEADER_MAGIC_OFFSET) == HEADER_MAGIC)
        .then(|| word_at(&head, HEADER_INSTANCE_OFFSET)))
}

/// The instance id every mirror must hold, from what their headers say before this open
/// writes anything: the one they hold, or a new one when none holds any and every mirror
/// answered. When none that answered holds one and a mirror is down, recovery is refused:
/// a mirror restarted empty looks like a new instance, and taking it for one would
/// recover nothing — and, its log growing with each such open, later rewrite the mirror
/// that has the data.
fn agree_on_instance(
    servers: &[SocketAddr],
    ns: &str,
    token: &Option<Vec<u8>>,
    allow_down: bool,
) -> Result<u64> {
    let mut held = Vec::new();
    let mut down = None;
    for &addr in servers {
        match peek_instance(addr, ns, token.clone()) {
            Ok(Some(id)) => held.push(id),
            Ok(None) => {}
            Err(e) if allow_down => {
                down.get_or_insert((addr, e));
            }
            Err(e) => return Err(e),
        }
    }
    let mut ids: Vec<u64> = held.iter().copied().filter(|&id| id != 0).collect();
    ids.sort_unstable();
    ids.dedup();
    match ids[..] {
        [] if held.is_empty() => match down {
            Some((addr, e)) => Err(RvmError::Unavailable(format!(
                "no mirror that answered holds rvm instance {ns:?}, and the mirror at {addr} \
                 is down ({e}): a mirror restarted empty cannot be told from a new instance, \
                 so recovery waits until every mirror answers"
            ))),
            None => Ok(new_instance_id()),
        },
        // Headers from before instance ids: nothing to check.
        [] => Ok(0),
        [id] => Ok(id),
        _ => Err(RvmError::Corrupt(format!(
            "the mirrors of rvm instance {ns:?} hold different instances ({ids:#x?}): \
             each was created without the other; keep one and clear the other"
        ))),
    }
}

/// This process and the moment it opened, as the header's owner word.
fn owner_word() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (u64::from(std::process::id()) << 32) | u64::from(nanos)
}

/// `data` at `offset` of `region` as guarded writes of at most `IO_CHUNK_BYTES` each.
fn chunked_writes(r: &Replica, region: &Region, offset: u64, data: &Bytes, ops: &mut Vec<Op>) {
    let mut at = 0usize;
    while at < data.len() {
        let n = (data.len() - at).min(IO_CHUNK_BYTES);
        ops.push(r.write_op(region, offset + at as u64, data.slice(at..at + n)));
        at += n;
    }
}

fn get_or_alloc(client: &Client, name: &str, size: u64) -> Result<Region> {
    let rounded = size.div_ceil(crate::limits::PAGE_BYTES) * crate::limits::PAGE_BYTES;
    match client.lookup(name) {
        Ok(r) if r.size >= rounded => return Ok(r),
        Ok(r) => client.free(&r)?,
        Err(e) if e.code() == Some(ErrorCode::NameNotFound) => {}
        Err(e) => return Err(e.into()),
    }
    alloc_named(client, name, rounded)
}

impl Replica {
    /// Connects, checks the stored geometry against `log_bytes`, takes a new epoch and
    /// opens the regions. With `recover`, a different stored log size is refused; without,
    /// the instance is being discarded anyway and its log is re-created at the new size.
    /// `instance`: the id the mirrors agreed on (`agree_on_instance`); `None` for a
    /// single server, which keeps the id it has or gets a new one.
    fn open(
        addr: SocketAddr,
        ns: &str,
        token: Option<Vec<u8>>,
        log_bytes: u64,
        recover: bool,
        instance: Option<u64>,
    ) -> Result<Replica> {
        let client = connect_replica(addr, token)?;
        let header = lookup_or_alloc(&client, &format!("rvm/{ns}/hdr"), HEADER_BYTES)?;
        let head = client.read(&header, 0, HEADER_USED_BYTES)?;
        let held = word_at(&head, HEADER_MAGIC_OFFSET) == HEADER_MAGIC;
        let held_id = if held {
            word_at(&head, HEADER_INSTANCE_OFFSET)
        } else {
            0
        };
        let other = |id: u64| recover && id != 0 && held_id != 0 && held_id != id;
        if let Some(id) = instance.filter(|&id| other(id)) {
            // `agree_on_instance` read this header a moment ago: changed since.
            return Err(RvmError::Corrupt(format!(
                "the mirror at {addr} holds rvm instance {held_id:#x}, not {id:#x}"
            )));
        }
        let log_gen = if word_at(&head, HEADER_MAGIC_OFFSET) == HEADER_MAGIC {
            word_at(&head, HEADER_LOG_GEN_OFFSET)
        } else {
            0
        };
        let log_name = log_region_name(ns, log_gen);
        let requested = log_bytes.div_ceil(crate::limits::PAGE_BYTES) * crate::limits::PAGE_BYTES;
        let existing_log = match client.lookup(&log_name) {
            Ok(r) => Some(r),
            Err(e) if e.code() == Some(ErrorCode::NameNotFound) => None,
            Err(e) => return Err(e.into()),
        };
        // The header's value; without a header (created before headers existed, or a
        // crash between creating the log and writing the header), the log's own size.
        let stored = if word_at(&head, HEADER_MAGIC_OFFSET) == HEADER_MAGIC {
            Some(word_at(&head, HEADER_LOG_BYTES_OFFSET))
        } else {
            existing_log.as_ref().map(|r| r.size)
        };
        if let Some(stored) = stored.filter(|s| *s != requested) {
            if recover {
                return Err(RvmError::Geometry {
                    what: "pool log bytes",
                    stored,
                    requested,
                });
            }
        }
        // Fence any earlier opener before touching anything it may still write.
        let epoch = client
            .fetch_add(&header, HEADER_EPOCH_OFFSET, 1)?
            .wrapping_add(1);
        client.write(
            &header,
            HEADER_OWNER_OFFSET,
            Bytes::copy_from_slice(&owner_word().to_le_bytes()),
        )?;
        let log = match existing_log {
            Some(old) if old.size != requested => {
                // Only reached without recovery: the instance is discarded anyway.
                client.free(&old)?;
                lookup_or_alloc(&client, &log_name, requested)?
            }
            Some(old) => old,
            None => lookup_or_alloc(&client, &log_name, requested)?,
        };
        free_orphan_logs(&client, ns, &log_name)?;
        let id = match instance {
            Some(id) => id,
            None if held_id != 0 => held_id,
            None => new_instance_id(),
        };
        // A mirror that did not hold the instance gets its header only once a recovery
        // has rewritten it whole: given earlier, a rewrite cut short would leave an empty
        // mirror that passes for the instance. Creating (no recovery) writes it at once,
        // and so does a single server, which has no other copy to protect.
        let mut header_after_resync = None;
        if recover && instance.is_some() && !held {
            header_after_resync = Some((requested, id));
        } else {
            if stored != Some(requested) || !held {
                write_geometry(&client, &header, requested)?;
            }
            if id != held_id && id != 0 {
                write_instance_id(&client, &header, id)?;
            }
        }
        let cat = |i: usize| {
            get_or_alloc(
                &client,
                &format!("rvm/{ns}/cat{i}"),
                CATALOG_BYTES_MAX as u64,
            )
        };
        let catalogs = [cat(0)?, cat(1)?];
        Ok(Replica {
            addr,
            client: client.clone(),
            header,
            held,
            header_after_resync,
            epoch,
            log,
            catalogs,
            homes: Mutex::new(HashMap::new()),
        })
    }

    fn home_name(ns: &str, seg: u64) -> String {
        format!("rvm/{ns}/seg/{seg}")
    }

    fn home(&self, ns: &str, seg: u64) -> Result<Region> {
        if let Some(r) = self.homes.lock().get(&seg) {
            return Ok(r.clone());
        }
        let r = self.client.lookup(&Self::home_name(ns, seg)).map_err(|e| {
            if e.code() == Some(ErrorCode::NameNotFound) {
                RvmError::Corrupt(format!("segment {seg} has no home on {}", self.addr))
            } else {
                e.into()
            }
        })?;
        self.homes.lock().insert(seg, r.clone());
        Ok(r)
    }

    /// Both slots' first CATALOG_FIRST_READ_BYTES in one round trip, then the rest of a
    /// slot whose header says its catalog is longer (never past CATALOG_BYTES_MAX).
    fn read_catalog_slots(&self) -> Result<[Option<Bytes>; 2]> {
        let first = CATALOG_FIRST_READ_BYTES.min(CATALOG_BYTES_MAX);
        let p: Vec<Pending> = self
            .catalogs
            .iter()
            .map(|c| self.client.submit(0, c.read_op(0, first as u32)))
            .collect::<Result<_, _>>()?;
        let mut out = [None, None];
        for ((slot, p), region) in out.iter_mut().zip(p).zip(&self.catalogs) {
            let head = reply::data(p.wait())?;
            let whole = match catalog_encoded_len(&head) {
                Some(len) if len > head.len() && len <= CATALOG_BYTES_MAX => {
                    let mut buf = Vec::with_capacity(len);
                    buf.extend_from_slice(&head);
                    self.read_region_with(region, head.len() as u64, len - head.len(), |d| {
                        buf.extend_from_slice(d)
                    })?;
                    Bytes::from(buf)
                }
                // Whole already, or not a catalog (decoding rejects it).
                _ => head,
            };
            *slot = Some(whole);
        }
        Ok(out)
    }

    fn read_region(&self, region: &Region, offset: u64, out: &mut [u8]) -> Result<()> {
        let mut at = 0;
        self.read_region_with(region, offset, out.len(), |data| {
            out[at..at + data.len()].copy_from_slice(data);
            at += data.len();
        })
    }

    /// Reads `len` bytes at `offset` as pipelined READs of at most `IO_CHUNK_BYTES`, and
    /// hands each chunk, in order, to `sink` (which copies it where it belongs: one copy).
    /// At most `READ_WINDOW_BYTES` are asked for ahead of what `sink` has taken: with a
    /// 40 MB read all in flight at once, the client buffered all 40 MB in fresh memory
    /// before `sink` copied any of it.
    fn read_region_with(
        &self,
        region: &Region,
        offset: u64,
        len: usize,
        mut sink: impl FnMut(&[u8]),
    ) -> Result<()> {
        let window = (READ_WINDOW_BYTES / IO_CHUNK_BYTES).max(1);
        let mut pending = std::collections::VecDeque::with_capacity(window);
        let mut at = 0;
        loop {
            while at < len && pending.len() < window {
                let n = (len - at).min(IO_CHUNK_BYTES);
                let p = self
                    .client
                    .submit(0, region.read_op(offset + at as u64, n as u32))?;
                pending.push_back((n, p));
                at += n;
            }
            let Some((n, p)) = pending.pop_front() else {
                return Ok(());
            };
            let data = reply::data(p.wait())?;
            if data.len() != n {
                return Err(RvmError::Corrupt(format!(
                    "{} answered {} bytes for a {n}-byte read",
                    self.addr,
                    data.len(),
                )));
            }
            sink(&data);
        }
    }

    fn scan(&self, first_seq: u64, capacity: u64) -> Result<(Vec<Record>, u64)> {
        let log = self.log.clone();
        let capacity = capacity.min(log.size);
        scan_stream(capacity, first_seq, IO_CHUNK_BYTES, |off, len, buf| {
            self.read_region_with(&log, off, len, |data| buf.extend_from_slice(data))
        })
    }

    /// A WRITE of `data` at `offset` of `region` that the server carries out only while
    /// the header's epoch word is still this writer's (see the module comment).
    fn write_op(&self, region: &Region, offset: u64, data: Bytes) -> Op {
        region.write_if_op(offset, data, &self.header, HEADER_EPOCH_OFFSET, self.epoch)
    }

    fn fenced(&self, epoch: u64) -> RvmError {
        RvmError::Fenced(format!(
            "{} now has epoch {epoch}; this writer opened with epoch {} and another open \
             took over since",
            self.addr, self.epoch
        ))
    }
}

impl Backend for PoolBackend {
    fn describe(&self) -> String {
        let addrs: Vec<String> = self
            .replicas
            .iter()
            .map(|r| r.as_ref().map_or("(down)".into(), |r| r.addr.to_string()))
            .collect();
        format!("pool {}", addrs.join(" + "))
    }

    fn append_log(&self, records: &[(u64, Bytes)]) -> Result<()> {
        let replicas = self.live()?;
        let mut tail = self.tail_bytes.lock();
        let total: u64 = records.iter().map(|(_, b)| b.len() as u64).sum();
        if *tail + total > self.log_capacity_bytes {
            return Err(RvmError::TooLarge {
                what: "pool log bytes",
                got: *tail + total,
                max: self.log_capacity_bytes,
            });
        }
        let start = *tail;
        self.on_all(&replicas, |r| {
            let mut ops = Vec::new();
            let mut at = start;
            for (_, b) in records {
                chunked_writes(r, &r.log, at, b, &mut ops);
                at += b.len() as u64;
            }
            Ok(ops)
        })?;
        *tail = start + total;
        Ok(())
    }

    fn scan_log(&self, first_seq: u64) -> Result<Vec<Record>> {
        let cached = self.scanned.lock().take();
        let (records, end) = match cached {
            Some((first, records, end)) if first == first_seq => (records, end),
            _ => self.source()?.scan(first_seq, self.log_capacity_bytes)?,
        };
        *self.tail_bytes.lock() = end;
        Ok(records)
    }

    fn scan_log_placing(
        &self,
        first_seq: u64,
        placer: &mut dyn Placer,
    ) -> Result<Option<Vec<Record>>> {
        if self.replicas.len() != 1 {
            // Mirrors were scanned whole to choose the source (`choose_source`).
            return Ok(None);
        }
        let r = self.source()?;
        let log = r.log.clone();
        let capacity = self.log_capacity_bytes.min(log.size);
        let (records, end, clean) = scan_stream_placing(
            capacity,
            first_seq,
            IO_CHUNK_BYTES,
            |off, len, buf| r.read_region_with(&log, off, len, |data| buf.extend_from_slice(data)),
            |off, out, filled| {
                let mut at = 0;
                r.read_region_with(&log, off, out.len(), |data| {
                    let piece = &mut out[at..at + data.len()];
                    piece.copy_from_slice(data);
                    filled(piece);
                    at += data.len();
                })
            },
            placer,
        )?;
        if !clean {
            return Ok(None);
        }
        *self.tail_bytes.lock() = end;
        Ok(Some(records))
    }

    fn read_log(&self, offset: u64, len: u64) -> Result<Bytes> {
        let r = self.source()?;
        let log = r.log.clone();
        let len = usize::try_from(len)
            .ok()
            .filter(|_| offset.checked_add(len).is_some_and(|e| e <= log.size))
            .ok_or_else(|| {
                RvmError::Corrupt(format!("log range {offset}+{len} is outside the log"))
            })?;
        let mut buf = Vec::with_capacity(len);
        r.read_region_with(&log, offset, len, |d| buf.extend_from_slice(d))?;
        Ok(Bytes::from(buf))
    }

    fn reset_log(&self, _next_seq: u64) -> Result<()> {
        // Old records stay in the region; recovery only accepts the next sequence number,
        // which none of them carries.
        *self.tail_bytes.lock() = 0;
        Ok(())
    }

    fn log_capacity_bytes(&self) -> u64 {
        self.log_capacity_bytes
    }

    fn read_catalog_slots(&self) -> Result<[Option<Bytes>; 2]> {
        self.source()?.read_catalog_slots()
    }

    fn write_catalog_slot(&self, slot: usize, catalog: Bytes) -> Result<()> {
        if catalog.len() > CATALOG_BYTES_MAX || slot > 1 {
            return Err(RvmError::TooLarge {
                what: "catalog bytes",
                got: catalog.len() as u64,
                max: CATALOG_BYTES_MAX as u64,
            });
        }
        let replicas = self.live_or_alive();
        self.on_all(&replicas, |r| {
            Ok(vec![r.write_op(&r.catalogs[slot], 0, catalog.clone())])
        })
    }

    fn create_home(&self, seg: u64, len: u64) -> Result<()> {
        for r in self.live_or_alive() {
            let region = get_or_alloc(&r.client, &Replica::home_name(&self.ns, seg), len)?;
            r.homes.lock().insert(seg, region);
        }
        Ok(())
    }

    fn write_home(&self, writes: &[HomeWrite]) -> Result<()> {
        let replicas = self.live_or_alive();
        if let Some(hook) = &self.hooks.before_home_writes {
            hook();
        }
        self.on_all(&replicas, |r| {
            let mut ops = Vec::new();
            for w in writes {
                let home = r.home(&self.ns, w.seg)?;
                chunked_writes(r, &home, w.offset, &w.data, &mut ops);
            }
            Ok(ops)
        })
    }

    fn read_home(&self, seg: u64, offset: u64, out: &mut [u8]) -> Result<()> {
        let r = self.source()?;
        let home = r.home(&self.ns, seg)?;
        r.read_region(&home, offset, out)
    }

    fn drop_home(&self, seg: u64, _len: u64) -> Result<()> {
        for r in self.live_or_alive() {
            let region = r.homes.lock().remove(&seg);
            let region = match region {
                Some(region) => region,
                None => match r.client.lookup(&Replica::home_name(&self.ns, seg)) {
                    Ok(region) => region,
                    Err(e) if e.code() == Some(ErrorCode::NameNotFound) => continue,
                    Err(e) => return Err(e.into()),
                },
            };
            match r.client.free(&region) {
                Ok(()) => {}
                Err(e) if e.code() == Some(ErrorCode::NoSuchRegion) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn resynced(&self) -> Result<()> {
        for r in self.live_or_alive() {
            if let Some((log_bytes, id)) = r.header_after_resync {
                write_geometry(&r.client, &r.header, log_bytes)?;
                write_instance_id(&r.client, &r.header, id)?;
            }
        }
        Ok(())
    }

    fn needs_resync(&self) -> bool {
        self.resync
    }
}

impl PoolBackend {
    /// Home and catalog writes go to every replica that is up: after a recovery with one
    /// down, the survivor must still be brought up to date. Log appends use [`Self::live`],
    /// which refuses to commit without every mirror.
    fn live_or_alive(&self) -> Vec<&Replica> {
        self.replicas.iter().flatten().collect()
    }
}

/// Frees every log region of instance `ns` but `current` (the one the header names). A
/// protocol-2 writer moved the log to `rvm/NS/log.EPOCH` at a new owner's first change
/// (see the module comment); a crash during that move left the new region unnamed by the
/// header, or the old one not yet freed. Nothing moves logs any more, so whatever is
/// found here is such a leftover: its records are either copies of the current log's or
/// already superseded by it. Found with LIST (so among the server's lowest
/// `LIST_ENTRIES_MAX` region ids, which is every region but on a very full server).
fn free_orphan_logs(client: &Client, ns: &str, current: &str) -> Result<()> {
    let prefix = format!("rvm/{ns}/log");
    let is_log = |name: &str| {
        name.strip_prefix(&prefix).is_some_and(|rest| {
            rest.is_empty()
                || rest
                    .strip_prefix('.')
                    .is_some_and(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))
        })
    };
    for region in client.list(0)? {
        let Some(name) = region.name.as_deref() else {
            continue;
        };
        if name != current && is_log(name) {
            tracing::info!("rvm: freeing {name:?}, a log region an interrupted move left");
            match client.free(&region) {
                Ok(()) => {}
                Err(e) if e.code() == Some(ErrorCode::NoSuchRegion) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

fn log_region_name(ns: &str, gen: u64) -> String {
    if gen == 0 {
        format!("rvm/{ns}/log")
    } else {
        format!("rvm/{ns}/log.{gen}")
    }
}
