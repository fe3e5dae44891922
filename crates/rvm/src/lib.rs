//! Recoverable virtual memory in the style of Lightweight RVM (Satyanarayanan et al.,
//! SOSP '93) over a pluggable backend: Camelot memory servers (optionally mirrored),
//! a redis-server, or a local file.
//!
//! ```no_run
//! # use camelot_rvm::*;
//! let rvm = Rvm::open(Config::new(BackendConfig::File { dir: "/tmp/rvm".into() }, "demo"))?;
//! let seg = rvm.alloc("counters", 4096)?;
//! let mut txn = rvm.begin();
//! txn.set_range(&seg, 0, 8)?;
//! txn.write(&seg, 0, &7u64.to_le_bytes())?;
//! txn.commit()?; // committed (fsync'd, for the file backend) when this returns
//! # Ok::<(), RvmError>(())
//! ```
//!
//! A transaction declares the bytes it will change (`set_range`, which keeps their old
//! values for `abort`), changes them, and commits: the declared ranges of every segment go
//! to the backend's redo log as one record, in one round trip where the backend allows.
//! The log is truncated — its records applied to the segments' home copies — past a size
//! threshold, in a background thread or inline, so it never grows without bound.
//!
//! # What "committed" means
//!
//! A returned [`Txn::commit`] means the record is held by the backend, which is not the
//! same promise everywhere:
//! - **pool**: in the memory of the server, or of both mirrors. It survives a crash of
//!   this process and, mirrored, the loss of either server; not a power loss of both.
//! - **redis**: acknowledged by redis-server, i.e. in its memory. Whether it survives a
//!   Redis crash or power loss is Redis's own persistence setting (`appendonly yes` with
//!   `appendfsync always` fsyncs before acknowledging). `wait_replicas=N` also waits
//!   (WAIT) until N replicas hold it.
//! - **file**: written and `fdatasync`'d to the local disk.
//!
//! One writer at a time: a second open of the same instance either fails (file: `flock`)
//! or fences the first (pool, redis: a newer epoch), whose next commit then fails with
//! [`RvmError::Fenced`].

pub mod backend;
mod error;
mod mem;
pub mod ranges;
pub mod record;

pub use error::{Result, RvmError};

use backend::{Backend, HomeWrite};
use bytes::Bytes;
use mem::Mapping;
use parking_lot::{Condvar, Mutex, RwLock};
use ranges::{RangeTable, TxnId};
use record::{Catalog, LogOp, Record, RecordBuilder, SegMeta};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Every size and count this crate accepts.
pub mod limits {
    /// Segments are whole pages.
    pub const PAGE_BYTES: u64 = 4096;
    pub const TAG_BYTES_MAX: usize = 128;
    /// Instance names become parts of region names and Redis keys.
    pub const NAME_BYTES_MAX: usize = 64;
    pub const SEGMENT_BYTES_MAX: u64 = 1 << 30;
    pub const SEGMENTS_MAX: usize = 4096;
    /// Largest commit record: 10,000 fully modified pages fit with room to spare.
    pub const RECORD_BYTES_MAX: usize = 128 << 20;
    pub const RECORD_OPS_MAX: usize = 1 << 20;
    /// A catalog of SEGMENTS_MAX segments with the longest tags fits.
    pub const CATALOG_BYTES_MAX: usize = 1 << 20;
    /// Network backends read this much of a catalog slot first, and the rest only when
    /// its header says the catalog is longer: a slot is CATALOG_BYTES_MAX, a catalog of
    /// a few segments is tens of bytes, and two 1 MiB reads were most of a one-page
    /// recovery.
    pub const CATALOG_FIRST_READ_BYTES: usize = 64 << 10;
    /// A log scan's first read; each later one doubles, up to IO_CHUNK_BYTES (a log of
    /// one small record should not cost a 1 MiB read).
    pub const SCAN_FIRST_READ_BYTES: usize = 64 << 10;
    /// The pool log region; a commit record must fit in it.
    pub const POOL_LOG_BYTES_DEFAULT: u64 = 160 << 20;
    pub const FILE_LOG_BYTES_MAX: u64 = 1 << 30;
    pub const REDIS_LOG_BYTES_MAX: u64 = 1 << 30;
    /// Truncate once this many log bytes are waiting.
    pub const TRUNCATE_LOG_BYTES_DEFAULT: u64 = 32 << 20;
    /// Reads and writes are split into pieces of this size (below the wire's per-op cap).
    pub const IO_CHUNK_BYTES: usize = 1 << 20;
    /// The pool backend keeps at most this many bytes of one long read in flight. With all
    /// of a 40 MB read asked for at once, the client buffered it whole in fresh memory
    /// before any was copied out; two 1 MiB reads ahead keep the wire busy and let the
    /// client reuse its buffers (10,000-page recovery harness: minor faults per open
    /// 1,290–2,610 → 390–500, median open 25–48 ms → 21–31 ms; 4 and 8 MiB windows sat in
    /// between, 1 MiB lost the pipelining).
    pub const READ_WINDOW_BYTES: usize = 2 << 20;
    /// Recovery reads a logged write of at least this many bytes (page-aligned) straight
    /// into the segment's memory instead of keeping a copy in the scanned record: for a
    /// 10,000-page commit that copy was a second fresh 40 MB to fault in and fill. Equal to
    /// the smallest home run recovery skips, so a placed write is never overwritten by a
    /// home read.
    pub const PLACE_WRITE_BYTES_MIN: u64 = IO_CHUNK_BYTES as u64;
    /// A mirrored pool backend writes to this many servers at most.
    pub const MIRRORS_MAX: usize = 2;
    pub const REDIS_BULK_BYTES_MAX: usize = 512 << 20;
    pub const REDIS_ARRAY_ITEMS_MAX: usize = 65_536;
    pub const REDIS_KEYS_PER_COMMAND_MAX: usize = 1024;
}

use limits::*;

/// Where an instance keeps its log, catalog and segment homes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendConfig {
    /// Camelot memory servers: one, or two for a mirrored backend.
    Pool {
        servers: Vec<SocketAddr>,
        token: Option<Vec<u8>>,
        log_bytes: u64,
    },
    Redis {
        addr: SocketAddr,
        /// With N > 0, a commit returns only once N Redis replicas acknowledged it (WAIT).
        wait_replicas: u32,
    },
    File {
        dir: PathBuf,
    },
}

impl BackendConfig {
    /// Parses `pool://[:TOKEN@]HOST:PORT[,HOST:PORT]`,
    /// `redis://HOST:PORT[?wait_replicas=N]` or `file:///dir`.
    pub fn parse(s: &str) -> Result<BackendConfig> {
        // Never echo the string whole: it may carry a token.
        let shown = match s.find('@') {
            Some(at) => format!(
                "{}(token hidden)@{}",
                &s[..s.find("//").map_or(0, |i| i + 2)],
                &s[at + 1..]
            ),
            None => s.to_owned(),
        };
        let bad = |why: &str| {
            RvmError::InvalidArgument(format!(
                "backend {shown:?}: {why} (expected pool://[:TOKEN@]HOST:PORT[,HOST:PORT], \
                 redis://HOST:PORT[?wait_replicas=N] or file:///DIR)"
            ))
        };
        let addr = |a: &str| {
            a.trim()
                .parse::<SocketAddr>()
                .map_err(|_| bad("bad address"))
        };
        if let Some(rest) = s.strip_prefix("pool://") {
            // The token is a URL's password with no user: `:TOKEN@`.
            let (token, hosts) = match rest.rsplit_once('@') {
                Some((cred, hosts)) => {
                    let token = cred
                        .strip_prefix(':')
                        .filter(|t| !t.is_empty())
                        .ok_or_else(|| bad("a token is written :TOKEN@ before the servers"))?;
                    (Some(token.as_bytes().to_vec()), hosts)
                }
                None => (None, rest),
            };
            let servers = hosts.split(',').map(addr).collect::<Result<Vec<_>>>()?;
            if servers.is_empty() || servers.len() > MIRRORS_MAX {
                return Err(bad("one or two servers"));
            }
            Ok(BackendConfig::Pool {
                servers,
                token,
                log_bytes: POOL_LOG_BYTES_DEFAULT,
            })
        } else if let Some(rest) = s.strip_prefix("redis://") {
            let (host, query) = rest.split_once('?').unwrap_or((rest, ""));
            let mut wait_replicas = 0;
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                match pair.split_once('=') {
                    Some(("wait_replicas", n)) => {
                        wait_replicas = n
                            .parse::<u32>()
                            .ok()
                            .filter(|n| *n <= backend::redis::WAIT_REPLICAS_MAX)
                            .ok_or_else(|| bad("wait_replicas is a small number"))?;
                    }
                    _ => return Err(bad("the only option is wait_replicas=N")),
                }
            }
            Ok(BackendConfig::Redis {
                addr: addr(host)?,
                wait_replicas,
            })
        } else if let Some(rest) = s.strip_prefix("file://") {
            if rest.is_empty() {
                return Err(bad("empty path"));
            }
            Ok(BackendConfig::File { dir: rest.into() })
        } else {
            Err(bad("unknown scheme"))
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub backend: BackendConfig,
    /// Names this instance on a shared backend (several can share one server).
    pub name: String,
    /// Bring back every segment as the last commit left it; without it, whatever the
    /// backend holds for `name` is discarded and the instance starts empty.
    pub recover: bool,
    pub truncate_log_bytes: u64,
    /// Truncate in a background thread (commits only wait for it when the log is full);
    /// off: the commit that crosses the threshold truncates before returning.
    pub background_truncation: bool,
    /// Map recovered segments at the addresses they had (pointers inside them stay
    /// valid); recovery fails when such a range is taken.
    pub fixed_addresses: bool,
    /// Called at fixed points of the backend's work; for tests that must stop a writer at
    /// an exact moment (see `tests/fencing.rs`). Empty by default.
    #[doc(hidden)]
    pub hooks: Hooks,
}

/// Test hooks: code run at named points, for tests that must stop a writer (SIGSTOP) at
/// an exact moment to show what another writer's takeover does to it.
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct Hooks {
    /// In truncation, just before the home writes are sent: the pool backend before its
    /// guarded WRITEs, the redis backend after its WATCH and epoch GET, before MULTI/EXEC.
    pub before_home_writes: Option<Arc<dyn Fn() + Send + Sync>>,
    /// In `open` with `recover`, once the log has been read and before the segments are
    /// restored (and the log possibly resynced or truncated): the crash test pauses a
    /// writer here so that its SIGKILL lands in recovery.
    pub during_recovery: Option<Arc<dyn Fn() + Send + Sync>>,
    /// In a truncation on any backend, once its home writes are built and before the
    /// first is sent: the crash test pauses a writer here so that its SIGKILL lands in
    /// a truncation.
    pub during_truncation: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before_home_writes", &self.before_home_writes.is_some())
            .field("during_recovery", &self.during_recovery.is_some())
            .field("during_truncation", &self.during_truncation.is_some())
            .finish()
    }
}

impl Config {
    pub fn new(backend: BackendConfig, name: &str) -> Config {
        Config {
            backend,
            name: name.to_owned(),
            recover: false,
            truncate_log_bytes: TRUNCATE_LOG_BYTES_DEFAULT,
            background_truncation: true,
            fixed_addresses: false,
            hooks: Hooks::default(),
        }
    }

    pub fn recover(mut self, recover: bool) -> Config {
        self.recover = recover;
        self
    }
}

struct SegInner {
    id: u64,
    tag: String,
    len: u64,
    mem: Mutex<Mapping>,
    freed: AtomicBool,
}

/// A tagged, page-aligned piece of recoverable memory. Cheap to clone.
#[derive(Clone)]
pub struct Segment(Arc<SegInner>);

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("tag", &self.0.tag)
            .field("len", &self.0.len)
            .finish()
    }
}

impl Segment {
    pub fn tag(&self) -> &str {
        &self.0.tag
    }

    /// Bytes, a whole number of pages.
    pub fn len(&self) -> u64 {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Virtual address of the first byte.
    pub fn addr(&self) -> u64 {
        self.0.mem.lock().addr()
    }

    /// The first byte, for C callers that write through it after `set_range`. Using it is
    /// only sound while the segment is alive and not freed, and never concurrently with
    /// another thread's access to the same bytes.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.0.mem.lock().as_mut_ptr()
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        if self.0.freed.load(Ordering::Acquire) {
            return Err(RvmError::SegmentFreed {
                tag: self.0.tag.clone(),
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len => Ok(()),
            _ => Err(RvmError::OutOfBounds {
                tag: self.0.tag.clone(),
                offset,
                end: offset.saturating_add(len),
                len: self.0.len,
            }),
        }
    }

    pub fn read_into(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len() as u64)?;
        self.0.mem.lock().read(offset as usize, out);
        Ok(())
    }

    pub fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        self.read_into(offset, &mut out)?;
        Ok(out)
    }

    pub fn read_u64(&self, offset: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read_into(offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

struct LogState {
    next_seq: u64,
    next_seg: u64,
    /// Segments as of the last record appended to (acknowledged by) the backend's log.
    logged: BTreeMap<u64, SegMeta>,
    /// Records in the backend's log, not yet applied to the homes.
    pending: Vec<Record>,
    pending_bytes: u64,
    /// Committed with `commit_lazy`, not yet appended.
    lazy: Vec<(u64, Bytes, Record)>,
    /// Homes of segments freed since the last truncation: dropped once the backend has
    /// acknowledged a catalog without them.
    freed_homes: Vec<(u64, u64)>,
    /// Catalog slot holding the newest catalog; the next goes to the other one.
    catalog_slot: usize,
}

impl LogState {
    /// `rec` is now in the backend's log (acknowledged, which per backend means what the
    /// crate docs' "What committed means" says): its allocations and frees hold, and it
    /// waits to be applied to the homes.
    fn note_appended(&mut self, rec: Record) {
        for op in &rec.ops {
            match op {
                LogOp::Alloc(m) => {
                    self.logged.insert(m.seg, m.clone());
                }
                LogOp::Free { seg } => {
                    if let Some(m) = self.logged.remove(seg) {
                        self.freed_homes.push((m.seg, m.len));
                    }
                }
                LogOp::Write { .. } | LogOp::Placed { .. } => {}
            }
        }
        self.pending.push(rec);
    }
}

struct Inner {
    backend: Box<dyn Backend>,
    truncate_log_bytes: u64,
    background_truncation: bool,
    fixed_addresses: bool,
    live: RwLock<HashMap<String, Segment>>,
    ranges: Mutex<RangeTable>,
    next_txn: AtomicU64,
    log: Mutex<LogState>,
    truncate_wanted: Condvar,
    stop: AtomicBool,
    failed: Mutex<Option<String>>,
    /// `Hooks::during_truncation`.
    truncation_hook: Option<Arc<dyn Fn() + Send + Sync>>,
}

/// One recoverable-memory instance. `Sync`: transactions may run on many threads.
pub struct Rvm {
    inner: Arc<Inner>,
    truncator: Option<JoinHandle<()>>,
}

fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(RvmError::InvalidArgument(format!(
            "instance name {name:?} must be 1 to {NAME_BYTES_MAX} of [A-Za-z0-9._-]"
        )))
    }
}

fn validate_tag(tag: &str) -> Result<()> {
    if tag.is_empty() || tag.len() > TAG_BYTES_MAX || tag.contains('\0') {
        return Err(RvmError::InvalidArgument(format!(
            "a tag is 1 to {TAG_BYTES_MAX} bytes without NUL, not {} bytes",
            tag.len()
        )));
    }
    Ok(())
}

fn open_backend(cfg: &Config) -> Result<Box<dyn Backend>> {
    Ok(match &cfg.backend {
        BackendConfig::Pool {
            servers,
            token,
            log_bytes,
        } => {
            if *log_bytes < (1 << 20) {
                return Err(RvmError::InvalidArgument(format!(
                    "a pool log of {log_bytes} bytes is too small (at least 1 MiB)"
                )));
            }
            Box::new(backend::pool::PoolBackend::open(
                servers,
                &cfg.name,
                token.clone(),
                *log_bytes,
                cfg.recover,
                cfg.hooks.clone(),
            )?)
        }
        BackendConfig::Redis {
            addr,
            wait_replicas,
        } => Box::new(backend::redis::RedisBackend::open(
            *addr,
            &cfg.name,
            *wait_replicas,
            cfg.hooks.clone(),
        )?),
        BackendConfig::File { dir } => Box::new(backend::file::FileBackend::open(dir)?),
    })
}

/// What replaying the catalog and log yields, before any data is read.
struct Replayed {
    catalog_slot: usize,
    next_seg: u64,
    last_seq: u64,
    segs: BTreeMap<u64, SegMeta>,
    freed: Vec<(u64, u64)>,
    records: Vec<Record>,
}

/// Replays the metadata of `records` over `catalog`: which segments exist after them.
/// Fails on records that name segments that do not exist or bytes outside them.
/// Covered runs shorter than this are read anyway: skipping them would split the home
/// read into many small ones, each a round trip on a network backend.
const HOME_SKIP_BYTES_MIN: u64 = IO_CHUNK_BYTES as u64;

/// The byte ranges of a segment's home (`len` bytes) that recovery must read, given the
/// ranges `writes` that replaying the log writes into it: every page is read except runs
/// of at least [`HOME_SKIP_BYTES_MIN`] of pages that replayed writes cover whole. Replay
/// overwrites those bytes, so whatever the home holds there cannot show; after a commit
/// of every page, recovery reads the log and not the home as well (half the bytes).
/// Ranges are page-aligned, sorted and disjoint.
fn home_reads(len: u64, mut writes: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    writes.sort_unstable();
    let mut covered: Vec<(u64, u64)> = Vec::new();
    for (start, end) in writes {
        match covered.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => covered.push((start, end)),
        }
    }
    let mut reads = Vec::new();
    let mut at = 0;
    for (start, end) in covered {
        let start = start.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let end = (end.min(len) / PAGE_BYTES) * PAGE_BYTES;
        if end <= start || end - start < HOME_SKIP_BYTES_MIN {
            continue;
        }
        if start > at {
            reads.push((at, start));
        }
        at = end;
    }
    if at < len {
        reads.push((at, len));
    }
    reads
}

/// The segment and byte range a Write or Placed op writes.
fn write_range(op: &LogOp) -> Option<(u64, u64, u64)> {
    match op {
        LogOp::Write { seg, offset, data } => {
            Some((*seg, *offset, offset.saturating_add(data.len() as u64)))
        }
        LogOp::Placed {
            seg, offset, len, ..
        } => Some((*seg, *offset, offset.saturating_add(*len))),
        LogOp::Alloc(_) | LogOp::Free { .. } => None,
    }
}

/// Mappings a recovery scan read log payloads into ([`record::Placer`]), made as the
/// scan meets the first placed write of each segment.
struct Placer {
    fixed_addresses: bool,
    /// Segments as of the records accepted so far.
    segs: BTreeMap<u64, SegMeta>,
    maps: BTreeMap<u64, Mapping>,
}

impl record::Placer for Placer {
    fn place(&mut self, seg: u64, offset: u64, len: u64) -> Option<&mut [u8]> {
        // Whole pages only: home reads skip whole covered pages, so nothing read later
        // overwrites placed bytes (see `home_reads`).
        if !offset.is_multiple_of(PAGE_BYTES)
            || !len.is_multiple_of(PAGE_BYTES)
            || len < PLACE_WRITE_BYTES_MIN
        {
            return None;
        }
        let meta = self.segs.get(&seg)?;
        if offset.checked_add(len)? > meta.len {
            return None;
        }
        if !self.maps.contains_key(&seg) {
            // A mapping that cannot be made now fails the same way in `restore`.
            let mut map = map_segment(self.fixed_addresses, meta).ok()?;
            map.advise_huge_pages();
            self.maps.insert(seg, map);
        }
        let map = self.maps.get_mut(&seg)?;
        map.as_mut_slice()
            .get_mut(offset as usize..(offset + len) as usize)
    }

    fn accepted(&mut self, record: &Record) {
        for op in &record.ops {
            match op {
                LogOp::Alloc(m) => {
                    self.segs.insert(m.seg, m.clone());
                }
                LogOp::Free { seg } => {
                    self.segs.remove(seg);
                    // Unmapped now: a later segment may be mapped at its address.
                    self.maps.remove(seg);
                }
                LogOp::Write { .. } | LogOp::Placed { .. } => {}
            }
        }
    }
}

fn map_segment(fixed_addresses: bool, meta: &SegMeta) -> Result<Mapping> {
    if fixed_addresses && meta.addr != 0 {
        Mapping::at(meta.addr, meta.len)
    } else {
        Mapping::anywhere(meta.len)
    }
}

/// The parts of `[start, end)` outside every range of `covered`, in order.
fn uncovered(start: u64, end: u64, mut covered: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    covered.sort_unstable();
    let mut out = Vec::new();
    let mut at = start;
    for (a, b) in covered {
        if b <= at || a >= end {
            continue;
        }
        if a > at {
            out.push((at, a));
        }
        at = at.max(b);
        if at >= end {
            break;
        }
    }
    if at < end {
        out.push((at, end));
    }
    out
}

fn replay_meta(catalog: Catalog, records: Vec<Record>, catalog_slot: usize) -> Result<Replayed> {
    let mut segs: BTreeMap<u64, SegMeta> = catalog.segs.into_iter().map(|m| (m.seg, m)).collect();
    let mut next_seg = catalog.next_seg;
    let mut freed = Vec::new();
    for r in &records {
        for op in &r.ops {
            match op {
                LogOp::Alloc(m) => {
                    if m.len == 0 || m.len > SEGMENT_BYTES_MAX || m.len & (PAGE_BYTES - 1) != 0 {
                        return Err(RvmError::Corrupt(format!(
                            "record {}: bad segment length",
                            r.seq
                        )));
                    }
                    next_seg = next_seg.max(m.seg + 1);
                    segs.insert(m.seg, m.clone());
                }
                LogOp::Free { seg } => {
                    let m = segs.remove(seg).ok_or_else(|| {
                        RvmError::Corrupt(format!("record {} frees unknown segment {seg}", r.seq))
                    })?;
                    freed.push((m.seg, m.len));
                }
                LogOp::Write { .. } | LogOp::Placed { .. } => {
                    let (seg, start, end) = write_range(op).unwrap_or_default();
                    let m = segs.get(&seg).ok_or_else(|| {
                        RvmError::Corrupt(format!("record {} writes unknown segment {seg}", r.seq))
                    })?;
                    if start > end || end > m.len {
                        return Err(RvmError::Corrupt(format!(
                            "record {} writes past the end of segment {seg}",
                            r.seq
                        )));
                    }
                }
            }
        }
    }
    let last_seq = records.last().map_or(catalog.applied_seq, |r| r.seq);
    Ok(Replayed {
        catalog_slot,
        next_seg,
        last_seq,
        segs,
        freed,
        records,
    })
}

impl Rvm {
    /// Connects to the backend; with `config.recover`, brings every segment back as the
    /// last committed transaction left it.
    pub fn open(config: Config) -> Result<Rvm> {
        validate_name(&config.name)?;
        if config.truncate_log_bytes == 0 {
            return Err(RvmError::InvalidArgument(
                "truncate_log_bytes must be positive".into(),
            ));
        }
        let backend = open_backend(&config)?;
        let slots = backend.read_catalog_slots()?;
        // With no catalog yet, pretend slot 1 holds one so the first goes to slot 0.
        let (slot, catalog) = record::newest_catalog(&slots).unwrap_or((1, Catalog::default()));
        let first_seq = catalog.applied_seq + 1;
        let mut placer = Placer {
            fixed_addresses: config.fixed_addresses,
            segs: catalog.segs.iter().map(|m| (m.seg, m.clone())).collect(),
            maps: BTreeMap::new(),
        };
        let placed = if config.recover {
            backend.scan_log_placing(first_seq, &mut placer)?
        } else {
            None
        };
        let (records, placed_maps) = match placed {
            Some(records) => (records, placer.maps),
            None => {
                // Nothing placed, or placed memory that must not be trusted: unmap it
                // before `restore` maps segments again (possibly at the same addresses).
                drop(placer);
                (backend.scan_log(first_seq)?, BTreeMap::new())
            }
        };
        let replayed = replay_meta(catalog, records, slot)?;

        let inner = Arc::new(Inner {
            backend,
            truncate_log_bytes: config.truncate_log_bytes,
            background_truncation: config.background_truncation,
            fixed_addresses: config.fixed_addresses,
            live: RwLock::new(HashMap::new()),
            ranges: Mutex::new(RangeTable::new()),
            next_txn: AtomicU64::new(1),
            log: Mutex::new(LogState {
                next_seq: replayed.last_seq + 1,
                next_seg: replayed.next_seg,
                logged: BTreeMap::new(),
                pending: Vec::new(),
                pending_bytes: 0,
                lazy: Vec::new(),
                freed_homes: replayed.freed.clone(),
                catalog_slot: replayed.catalog_slot,
            }),
            truncate_wanted: Condvar::new(),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
            truncation_hook: config.hooks.during_truncation.clone(),
        });
        if config.recover {
            if let Some(hook) = &config.hooks.during_recovery {
                hook();
            }
            inner.restore(replayed, placed_maps)?;
        } else {
            inner.discard(replayed)?;
        }
        let truncator = if config.background_truncation {
            let worker = inner.clone();
            Some(
                std::thread::Builder::new()
                    .name("rvm-truncate".into())
                    .spawn(move || worker.truncate_loop())
                    .map_err(|e| {
                        RvmError::Unavailable(format!("cannot start the truncator: {e}"))
                    })?,
            )
        } else {
            None
        };
        Ok(Rvm { inner, truncator })
    }

    pub fn describe_backend(&self) -> String {
        self.inner.backend.describe()
    }

    /// A new segment of `bytes` (rounded up to whole pages, zeroed), committed to the
    /// backend (see the crate docs) when this returns. Allocation is not part of any transaction.
    pub fn alloc(&self, tag: &str, bytes: u64) -> Result<Segment> {
        self.inner.alloc(tag, bytes)
    }

    /// The live segment tagged `tag` (after recovery, too).
    pub fn segment(&self, tag: &str) -> Option<Segment> {
        self.inner.live.read().get(tag).cloned()
    }

    /// The live segment whose memory contains `addr`, and the offset of `addr` in it.
    pub fn segment_at(&self, addr: u64) -> Option<(Segment, u64)> {
        self.inner.segment_at(addr)
    }

    /// Every live segment, by tag.
    pub fn segments(&self) -> Vec<Segment> {
        let mut v: Vec<Segment> = self.inner.live.read().values().cloned().collect();
        v.sort_by(|a, b| a.tag().cmp(b.tag()));
        v
    }

    pub fn begin(&self) -> Txn {
        Txn {
            inner: self.inner.clone(),
            id: self.inner.next_txn.fetch_add(1, Ordering::Relaxed),
            undo: Vec::new(),
            segs: Vec::new(),
            frees: Vec::new(),
            done: false,
        }
    }

    /// Commits every `commit_lazy` so far to the backend (see the crate docs for what
    /// that survives).
    pub fn flush(&self) -> Result<()> {
        let mut log = self.inner.log.lock();
        self.inner.check_failed()?;
        self.inner.append_locked(&mut log, None)
    }

    /// Applies the whole log to the homes now and empties it.
    pub fn truncate(&self) -> Result<()> {
        let mut log = self.inner.log.lock();
        self.inner.check_failed()?;
        self.inner.truncate_locked(&mut log)
    }

    /// Log bytes not yet applied to the homes.
    pub fn log_bytes(&self) -> u64 {
        self.inner.log.lock().pending_bytes
    }

    /// Flushes lazy commits and stops the truncator; errors that `drop` would swallow.
    pub fn close(mut self) -> Result<()> {
        let r = self.flush();
        self.stop_truncator();
        r
    }

    fn stop_truncator(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        {
            let _log = self.inner.log.lock();
            self.inner.truncate_wanted.notify_all();
        }
        if let Some(t) = self.truncator.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Rvm {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!("rvm: lazy commits lost at drop: {e}");
        }
        self.stop_truncator();
    }
}

impl Inner {
    fn segment_at(&self, addr: u64) -> Option<(Segment, u64)> {
        self.live.read().values().find_map(|s| {
            let base = s.addr();
            (addr >= base && addr - base < s.len()).then(|| (s.clone(), addr - base))
        })
    }

    fn check_failed(&self) -> Result<()> {
        match &*self.failed.lock() {
            Some(why) => Err(RvmError::Failed(why.clone())),
            None => Ok(()),
        }
    }

    /// Records why this instance can no longer be trusted and returns the error.
    fn fail(&self, e: RvmError) -> RvmError {
        let why = e.to_string();
        self.failed.lock().get_or_insert(why);
        e
    }

    fn map(&self, meta: &SegMeta) -> Result<Mapping> {
        map_segment(self.fixed_addresses, meta)
    }

    /// `placed` holds the mappings the log scan already read placed writes into.
    fn restore(&self, r: Replayed, mut placed: BTreeMap<u64, Mapping>) -> Result<()> {
        let mut maps: BTreeMap<u64, Mapping> = BTreeMap::new();
        let mut replayed: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
        // Per segment: the ranges placed writes filled, with the index of their record.
        let mut placed_ranges: HashMap<u64, Vec<(usize, u64, u64)>> = HashMap::new();
        for (i, rec) in r.records.iter().enumerate() {
            for op in &rec.ops {
                if let Some((seg, start, end)) = write_range(op) {
                    replayed.entry(seg).or_default().push((start, end));
                    if matches!(op, LogOp::Placed { .. }) {
                        placed_ranges.entry(seg).or_default().push((i, start, end));
                    }
                }
            }
        }
        placed.retain(|seg, _| r.segs.contains_key(seg));
        for m in r.segs.values() {
            let mut map = match placed.remove(&m.seg) {
                Some(map) => map,
                None => {
                    let mut map = self.map(m)?;
                    // Every page is written below (home reads plus replayed writes).
                    map.advise_huge_pages();
                    map
                }
            };
            let writes = replayed.remove(&m.seg).unwrap_or_default();
            // Placed ranges are whole pages in covered runs of at least
            // PLACE_WRITE_BYTES_MIN, which these reads skip.
            for (start, end) in home_reads(m.len, writes) {
                self.backend.read_home(
                    m.seg,
                    start,
                    &mut map.as_mut_slice()[start as usize..end as usize],
                )?;
            }
            maps.insert(m.seg, map);
        }
        let mut bytes = 0;
        for (i, rec) in r.records.iter().enumerate() {
            bytes += record::encoded_len(rec);
            for op in &rec.ops {
                if let LogOp::Write { seg, offset, data } = op {
                    // A segment freed later in the log is gone; its writes do not matter.
                    let Some(map) = maps.get_mut(seg) else {
                        continue;
                    };
                    // Bytes a later record's placed write already filled are newer.
                    let later: Vec<(u64, u64)> = placed_ranges
                        .get(seg)
                        .map(|v| {
                            v.iter()
                                .filter(|(j, _, _)| *j > i)
                                .map(|(_, a, b)| (*a, *b))
                                .collect()
                        })
                        .unwrap_or_default();
                    for (start, end) in uncovered(*offset, *offset + data.len() as u64, later) {
                        map.write(
                            start as usize,
                            &data[(start - offset) as usize..(end - offset) as usize],
                        );
                    }
                }
            }
        }
        let mut live = self.live.write();
        let mut log = self.log.lock();
        for (id, map) in maps {
            let Some(meta) = r.segs.get(&id) else {
                continue;
            };
            live.insert(
                meta.tag.clone(),
                Segment(Arc::new(SegInner {
                    id,
                    tag: meta.tag.clone(),
                    len: meta.len,
                    mem: Mutex::new(map),
                    freed: AtomicBool::new(false),
                })),
            );
        }
        log.logged = r.segs;
        log.pending = r.records;
        log.pending_bytes = bytes;
        drop(live);
        if self.backend.needs_resync() {
            self.resync_locked(&mut log)?;
        } else if log.pending_bytes >= self.truncate_log_bytes {
            self.truncate_locked(&mut log)?;
        }
        Ok(())
    }

    /// Writes the whole recovered state to every reachable replica, so that they agree
    /// again before the next commit.
    fn resync_locked(&self, log: &mut LogState) -> Result<()> {
        let live = self.live.read();
        let mut writes = Vec::new();
        for seg in live.values() {
            self.backend.create_home(seg.0.id, seg.0.len)?;
            let mut buf = vec![0u8; seg.0.len as usize];
            seg.0.mem.lock().read(0, &mut buf);
            writes.push(HomeWrite {
                seg: seg.0.id,
                offset: 0,
                data: Bytes::from(buf),
            });
        }
        drop(live);
        self.backend.write_home(&writes)?;
        log.pending.clear();
        log.pending_bytes = 0;
        self.write_catalog_and_reset(log)?;
        self.backend.resynced()
    }

    fn write_catalog_and_reset(&self, log: &mut LogState) -> Result<()> {
        // Every catalog takes a sequence number of its own, so the newer of the two slots
        // is always the one with the higher number, even when no record came between.
        let applied_seq = log.next_seq;
        log.next_seq += 1;
        let catalog = Catalog {
            applied_seq,
            next_seg: log.next_seg,
            segs: log.logged.values().cloned().collect(),
        };
        let slot = 1 - log.catalog_slot;
        self.backend
            .write_catalog_slot(slot, record::encode_catalog(&catalog))?;
        log.catalog_slot = slot;
        self.backend.reset_log(log.next_seq)?;
        for (seg, len) in std::mem::take(&mut log.freed_homes) {
            if let Err(e) = self.backend.drop_home(seg, len) {
                tracing::warn!("rvm: home of freed segment {seg} not dropped: {e}");
            }
        }
        Ok(())
    }

    /// Without recovery: forget every segment the backend holds for this name.
    fn discard(&self, r: Replayed) -> Result<()> {
        let mut log = self.log.lock();
        log.freed_homes
            .extend(r.segs.values().map(|m| (m.seg, m.len)));
        log.logged.clear();
        self.write_catalog_and_reset(&mut log)
    }

    fn alloc(&self, tag: &str, bytes: u64) -> Result<Segment> {
        validate_tag(tag)?;
        if bytes == 0 || bytes > SEGMENT_BYTES_MAX {
            return Err(RvmError::TooLarge {
                what: "segment bytes (1 or more)",
                got: bytes,
                max: SEGMENT_BYTES_MAX,
            });
        }
        let len = bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let mut log = self.log.lock();
        self.check_failed()?;
        let mut live = self.live.write();
        if live.contains_key(tag) {
            return Err(RvmError::TagExists(tag.to_owned()));
        }
        if live.len() >= SEGMENTS_MAX {
            return Err(RvmError::TooLarge {
                what: "segments",
                got: live.len() as u64 + 1,
                max: SEGMENTS_MAX as u64,
            });
        }
        let id = log.next_seg;
        log.next_seg += 1;
        let map = Mapping::anywhere(len)?;
        let meta = SegMeta {
            seg: id,
            len,
            addr: map.addr(),
            tag: tag.to_owned(),
        };
        self.backend.create_home(id, len)?;
        let mut b = RecordBuilder::new();
        b.alloc(&meta);
        let seq = log.next_seq;
        log.next_seq += 1;
        let (bytes, rec) = b.finish_with_record(seq);
        log.lazy.push((seq, bytes, rec));
        self.append_locked(&mut log, None)?;
        let seg = Segment(Arc::new(SegInner {
            id,
            tag: tag.to_owned(),
            len,
            mem: Mutex::new(map),
            freed: AtomicBool::new(false),
        }));
        live.insert(tag.to_owned(), seg.clone());
        Ok(seg)
    }

    /// Appends the lazy records and `own`, after truncating when they would not fit.
    /// Any failure leaves this instance failed: the records may or may not be in the
    /// backend's log.
    fn append_locked(&self, log: &mut LogState, own: Option<(u64, Bytes, Record)>) -> Result<()> {
        if let Some(o) = own {
            log.lazy.push(o);
        }
        if log.lazy.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut log.lazy);
        let bytes: u64 = batch.iter().map(|(_, b, _)| b.len() as u64).sum();
        if log.pending_bytes + bytes > self.backend.log_capacity_bytes() && !log.pending.is_empty()
        {
            if let Err(e) = self.truncate_locked(log) {
                return Err(self.fail(e));
            }
        }
        let shipped: Vec<(u64, Bytes)> = batch.iter().map(|(s, b, _)| (*s, b.clone())).collect();
        if let Err(e) = self.backend.append_log(&shipped) {
            return Err(self.fail(e));
        }
        for (_, _, rec) in batch {
            log.note_appended(rec);
        }
        log.pending_bytes += bytes;
        if log.pending_bytes >= self.truncate_log_bytes {
            if self.background_truncation {
                self.truncate_wanted.notify_one();
            } else {
                self.truncate_locked(log)?;
            }
        }
        Ok(())
    }

    fn truncate_locked(&self, log: &mut LogState) -> Result<()> {
        if !log.lazy.is_empty() {
            // Lazy records must reach the log first: truncation covers appended records.
            let batch = std::mem::take(&mut log.lazy);
            let shipped: Vec<(u64, Bytes)> =
                batch.iter().map(|(s, b, _)| (*s, b.clone())).collect();
            self.backend
                .append_log(&shipped)
                .map_err(|e| self.fail(e))?;
            for (_, b, rec) in batch {
                log.pending_bytes += b.len() as u64;
                log.note_appended(rec);
            }
        }
        if log.pending.is_empty() {
            return Ok(());
        }
        let mut writes = Vec::new();
        let mut placed_err = None;
        for rec in &log.pending {
            for op in &rec.ops {
                match op {
                    LogOp::Write { seg, offset, data } if log.logged.contains_key(seg) => {
                        writes.push(HomeWrite {
                            seg: *seg,
                            offset: *offset,
                            data: data.clone(),
                        });
                    }
                    // Recovery read these into segment memory, which transactions may
                    // have changed since (even uncommitted): the log still holds them.
                    LogOp::Placed {
                        seg,
                        offset,
                        len,
                        log_offset,
                    } if log.logged.contains_key(seg) => {
                        match self.backend.read_log(*log_offset, *len) {
                            Ok(data) => writes.push(HomeWrite {
                                seg: *seg,
                                offset: *offset,
                                data,
                            }),
                            Err(e) => {
                                placed_err.get_or_insert(e);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(e) = placed_err {
            return Err(self.fail(e));
        }
        if let Some(hook) = &self.truncation_hook {
            hook();
        }
        let r = self
            .backend
            .write_home(&writes)
            .and_then(|()| self.write_catalog_and_reset(log));
        if let Err(e) = r {
            return Err(self.fail(e));
        }
        log.pending.clear();
        log.pending_bytes = 0;
        Ok(())
    }

    fn truncate_loop(&self) {
        let mut log = self.log.lock();
        loop {
            while !self.stop.load(Ordering::Acquire) && log.pending_bytes < self.truncate_log_bytes
            {
                self.truncate_wanted.wait(&mut log);
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if self.failed.lock().is_some() {
                return;
            }
            if let Err(e) = self.truncate_locked(&mut log) {
                tracing::error!("rvm: background truncation failed: {e}");
                return;
            }
        }
    }
}

/// A transaction. Dropping it without committing aborts it. It holds the instance
/// alive (C callers keep it behind a pointer, with no Rust lifetime to tie it to).
pub struct Txn {
    inner: Arc<Inner>,
    id: TxnId,
    /// Old values of declared ranges, in declaration order.
    undo: Vec<(Segment, u64, Vec<u8>)>,
    segs: Vec<Segment>,
    frees: Vec<Segment>,
    done: bool,
}

impl Txn {
    /// Declares `len` bytes at `offset` of `seg` about to change; their current values
    /// are kept for `abort`. Fails when another live transaction declared any of them.
    pub fn set_range(&mut self, seg: &Segment, offset: u64, len: u64) -> Result<()> {
        self.inner.check_failed()?;
        if len == 0 {
            return Err(RvmError::InvalidArgument("set_range of zero bytes".into()));
        }
        seg.check(offset, len)?;
        if self.frees.iter().any(|f| Arc::ptr_eq(&f.0, &seg.0)) {
            return Err(RvmError::SegmentFreed {
                tag: seg.0.tag.clone(),
            });
        }
        let declared: u64 = self.undo.iter().map(|(_, _, v)| v.len() as u64).sum();
        if declared + len > RECORD_BYTES_MAX as u64 {
            return Err(RvmError::TooLarge {
                what: "bytes declared in one transaction",
                got: declared + len,
                max: RECORD_BYTES_MAX as u64,
            });
        }
        self.inner
            .ranges
            .lock()
            .declare(seg.0.id, offset, offset + len, self.id)
            .map_err(|_| RvmError::RangeConflict {
                tag: seg.0.tag.clone(),
                offset,
                end: offset + len,
            })?;
        let mut old = vec![0u8; len as usize];
        seg.0.mem.lock().read(offset as usize, &mut old);
        self.undo.push((seg.clone(), offset, old));
        if !self.segs.iter().any(|s| Arc::ptr_eq(&s.0, &seg.0)) {
            self.segs.push(seg.clone());
        }
        Ok(())
    }

    /// The live segment containing `addr` (for callers that hold addresses, like C).
    pub fn segment_at(&self, addr: u64) -> Option<(Segment, u64)> {
        self.inner.segment_at(addr)
    }

    /// Writes into a range this transaction declared.
    pub fn write(&mut self, seg: &Segment, offset: u64, data: &[u8]) -> Result<()> {
        seg.check(offset, data.len() as u64)?;
        if !self
            .inner
            .ranges
            .lock()
            .covers(seg.0.id, offset, offset + data.len() as u64, self.id)
        {
            return Err(RvmError::NotDeclared {
                tag: seg.0.tag.clone(),
                offset,
                end: offset + data.len() as u64,
            });
        }
        seg.0.mem.lock().write(offset as usize, data);
        Ok(())
    }

    pub fn write_u64(&mut self, seg: &Segment, offset: u64, v: u64) -> Result<()> {
        self.write(seg, offset, &v.to_le_bytes())
    }

    /// Frees the segment tagged `tag` when this transaction commits (not before: until
    /// then, and after an abort, it stays).
    pub fn free(&mut self, tag: &str) -> Result<()> {
        self.inner.check_failed()?;
        let seg = self
            .inner
            .live
            .read()
            .get(tag)
            .cloned()
            .ok_or_else(|| RvmError::NoSuchTag(tag.to_owned()))?;
        if self.inner.ranges.lock().held_by_other(seg.0.id, self.id) {
            return Err(RvmError::RangeConflict {
                tag: tag.to_owned(),
                offset: 0,
                end: seg.0.len,
            });
        }
        if !self.frees.iter().any(|f| Arc::ptr_eq(&f.0, &seg.0)) {
            self.frees.push(seg);
        }
        Ok(())
    }

    /// Returns once the backend holds the changes: in the memory of the pool server(s),
    /// acknowledged by Redis (and its `wait_replicas`), or fsync'd to the file; see the
    /// crate docs for what each survives.
    pub fn commit(mut self) -> Result<()> {
        self.finish(false)
    }

    /// Returns at once; the changes reach the backend at the next `flush`, `commit` or
    /// truncation (LRVM's no-flush commit).
    pub fn commit_lazy(mut self) -> Result<()> {
        self.finish(true)
    }

    /// Restores every declared range to its value before the transaction.
    pub fn abort(mut self) {
        self.rollback();
    }

    fn rollback(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        for (seg, offset, old) in self.undo.drain(..).rev() {
            seg.0.mem.lock().write(offset as usize, &old);
        }
        self.release();
    }

    fn release(&mut self) {
        let ids: Vec<u64> = self.segs.iter().map(|s| s.0.id).collect();
        self.inner.ranges.lock().release(self.id, ids);
    }

    fn finish(&mut self, lazy: bool) -> Result<()> {
        if let Err(e) = self.inner.check_failed() {
            self.rollback();
            return Err(e);
        }
        let mut b = RecordBuilder::new();
        {
            let ranges = self.inner.ranges.lock();
            let declared: Vec<(Segment, Vec<(u64, u64)>)> = self
                .segs
                .iter()
                .filter(|s| !self.frees.iter().any(|f| Arc::ptr_eq(&f.0, &s.0)))
                .map(|s| (s.clone(), ranges.ranges_of(s.0.id, self.id)))
                .collect();
            drop(ranges);
            let total: usize = declared
                .iter()
                .flat_map(|(_, rs)| {
                    rs.iter()
                        .map(|(a, e)| record::write_op_bytes((e - a) as usize))
                })
                .sum();
            b.reserve(total + self.frees.len() * 9);
            for (seg, rs) in declared {
                let mem = seg.0.mem.lock();
                for (start, end) in rs {
                    b.write_with(seg.0.id, start, (end - start) as u32, |buf| {
                        mem.append_to(start as usize, (end - start) as usize, buf)
                    });
                }
            }
        }
        for f in &self.frees {
            b.free(f.0.id);
        }
        if b.op_count() == 0 {
            self.done = true;
            self.release();
            return Ok(());
        }
        let capacity = self
            .inner
            .backend
            .log_capacity_bytes()
            .min(RECORD_BYTES_MAX as u64);
        if b.len_bytes() as u64 > capacity {
            let got = b.len_bytes() as u64;
            self.rollback();
            return Err(RvmError::TooLarge {
                what: "commit record bytes",
                got,
                max: capacity,
            });
        }
        let mut log = self.inner.log.lock();
        if let Err(e) = self.inner.check_failed() {
            drop(log);
            self.rollback();
            return Err(e);
        }
        let seq = log.next_seq;
        log.next_seq += 1;
        let (bytes, rec) = b.finish_with_record(seq);
        let r = if lazy {
            log.lazy.push((seq, bytes, rec));
            Ok(())
        } else {
            self.inner.append_locked(&mut log, Some((seq, bytes, rec)))
        };
        // The commit's record is queued or in the log: the frees take effect now, and the
        // ranges are free for other transactions. On an append error the instance has
        // failed; memory keeps the new values, and recovery decides.
        if !self.frees.is_empty() {
            let mut live = self.inner.live.write();
            for f in &self.frees {
                f.0.freed.store(true, Ordering::Release);
                live.remove(&f.0.tag);
            }
        }
        drop(log);
        self.done = true;
        self.undo.clear();
        self.release();
        r
    }
}

impl Drop for Txn {
    fn drop(&mut self) {
        self.rollback();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn backend_urls_keep_the_token_and_options() {
        let p = BackendConfig::parse("pool://:tok@127.0.0.1:1,127.0.0.1:2").expect("parse");
        assert_eq!(
            p,
            BackendConfig::Pool {
                servers: vec![
                    "127.0.0.1:1".parse().unwrap(),
                    "127.0.0.1:2".parse().unwrap()
                ],
                token: Some(b"tok".to_vec()),
                log_bytes: POOL_LOG_BYTES_DEFAULT,
            }
        );
        let p = BackendConfig::parse("pool://127.0.0.1:1").expect("parse");
        assert!(matches!(p, BackendConfig::Pool { token: None, .. }));
        assert_eq!(
            BackendConfig::parse("redis://127.0.0.1:6379?wait_replicas=2").expect("parse"),
            BackendConfig::Redis {
                addr: "127.0.0.1:6379".parse().unwrap(),
                wait_replicas: 2
            }
        );
        for bad in [
            "pool://@127.0.0.1:1",
            "pool://user:tok@127.0.0.1:1",
            "pool://:@127.0.0.1:1",
            "redis://127.0.0.1:1?wait_replicas=x",
            "redis://127.0.0.1:1?other=1",
            "redis://127.0.0.1:1?wait_replicas=99999",
        ] {
            assert!(BackendConfig::parse(bad).is_err(), "{bad} parsed");
        }
        // A bad tokened URL's error does not show the token.
        let e = BackendConfig::parse("pool://:sekrit@nowhere").unwrap_err();
        assert!(!e.to_string().contains("sekrit"), "{e}");
    }

    #[test]
    fn a_home_covered_whole_by_the_log_is_not_read() {
        // The bench's case: one record writes every page.
        let pages: Vec<(u64, u64)> = (0..2560).map(|p| (p * 4096, (p + 1) * 4096)).collect();
        assert_eq!(home_reads(10 * MIB, pages), vec![]);
        assert_eq!(home_reads(10 * MIB, vec![(0, 10 * MIB)]), vec![]);
    }

    #[test]
    fn only_whole_pages_in_long_runs_are_skipped() {
        // Nothing replayed: the whole home.
        assert_eq!(home_reads(8 * MIB, vec![]), vec![(0, 8 * MIB)]);
        // A run shorter than the minimum is read anyway.
        assert_eq!(
            home_reads(8 * MIB, vec![(4096, 8192), (MIB, MIB + 4096)]),
            vec![(0, 8 * MIB)]
        );
        // Partly covered pages at a run's edges are read; overlapping writes merge.
        assert_eq!(
            home_reads(
                8 * MIB,
                vec![(MIB + 1, 2 * MIB), (2 * MIB - 10, 4 * MIB + 5)]
            ),
            vec![(0, MIB + 4096), (4 * MIB, 8 * MIB)]
        );
        // Several runs, unsorted.
        assert_eq!(
            home_reads(8 * MIB, vec![(6 * MIB, 8 * MIB), (MIB, 3 * MIB)]),
            vec![(0, MIB), (3 * MIB, 6 * MIB)]
        );
    }
}
