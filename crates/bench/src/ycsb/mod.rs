//! `camelot bench ycsb`: the Yahoo! Cloud Serving Benchmark's core workloads (seeds 002
//! and 004), driven against Camelot, Camelot's Redis port, redis-server and memcached
//! under one harness, so their numbers compare.
//!
//! Faithful to YCSB where it matters for the figures: the core workloads' operation mixes
//! and request distributions (scrambled zipfian 0.99, latest, uniform, hotspot), keys
//! `user<fnvhash64(n)>`, E's scans of 1–100 records, a load phase then a closed-loop run
//! phase, and the same bindings YCSB uses (a Redis hash per record plus the `_indices`
//! sorted set). One deliberate difference: an update writes every field (YCSB's
//! `writeallfields=true`), so every store does the same work and every read can be
//! checked whole. Every read is checked (see [`record`]); mismatches and errors are
//! counted and fail the command.

pub mod generators;
pub mod memcached;
pub mod record;
pub mod targets;

use crate::latency::LatencyRecorder;
use crate::progress::Progress;
use crate::side::{
    cores, cpu_extra, sides_json, CamelotNodes, CamelotSpec, ClientSide, CpuMeter, Placement, Side,
};
use crate::BenchError;
use camelot_results::output::write_result_with_figure;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{
    now_rfc3339, BenchResult, Comparison, LatencySummary, Point, Series,
};
use camelot_testkit::{MemcachedServer, RedisServer};
use generators::{key_name, Distribution, InsertCounter, KeyChooser};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use record::FIELD_HEADER_BYTES;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use targets::{clear, Db, Shape, Target, TargetKind};

/// Largest run: the harness keeps 16 bytes per record and per possible insert.
pub const RECORDS_MAX: u64 = 50_000_000;
pub const OPERATIONS_MAX: u64 = 50_000_000;
pub const THREADS_MAX: usize = 1024;
pub const ROUNDS_MAX: usize = 20;
pub const FIELDS_MAX: usize = 1024;
/// A record must fit one Camelot value.
pub const RECORD_BYTES_MAX: usize = camelot_client::proto::limits::VALUE_BYTES_MAX;
/// YCSB's `maxscanlength`.
pub const SCAN_LENGTH_MAX: usize = 100;
/// Mismatch and error descriptions kept for the report (the counts are always exact).
const PROBLEMS_KEPT: usize = 8;
/// Progress is reported in steps of this many operations per thread.
const PROGRESS_STEP: u64 = 256;

/// One of YCSB's core workloads, or W (100% update, seed 002's write workload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    A,
    B,
    C,
    D,
    E,
    F,
    W,
}

/// Operation proportions: read, update, insert, scan, read-modify-write.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    pub read: f64,
    pub update: f64,
    pub insert: f64,
    pub scan: f64,
    pub rmw: f64,
}

impl Workload {
    pub fn parse(s: &str) -> Option<Workload> {
        Some(match s.to_ascii_lowercase().as_str() {
            "a" => Workload::A,
            "b" => Workload::B,
            "c" => Workload::C,
            "d" => Workload::D,
            "e" => Workload::E,
            "f" => Workload::F,
            "w" => Workload::W,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Workload::A => "A",
            Workload::B => "B",
            Workload::C => "C",
            Workload::D => "D",
            Workload::E => "E",
            Workload::F => "F",
            Workload::W => "W",
        }
    }

    /// As YCSB's `workloads/workloada` … `workloadf` define them.
    pub fn mix(self) -> Mix {
        let m = |read, update, insert, scan, rmw| Mix {
            read,
            update,
            insert,
            scan,
            rmw,
        };
        match self {
            Workload::A => m(0.5, 0.5, 0.0, 0.0, 0.0),
            Workload::B => m(0.95, 0.05, 0.0, 0.0, 0.0),
            Workload::C => m(1.0, 0.0, 0.0, 0.0, 0.0),
            Workload::D => m(0.95, 0.0, 0.05, 0.0, 0.0),
            Workload::E => m(0.0, 0.0, 0.05, 0.95, 0.0),
            Workload::F => m(0.5, 0.0, 0.0, 0.0, 0.5),
            Workload::W => m(0.0, 1.0, 0.0, 0.0, 0.0),
        }
    }

    pub fn default_distribution(self) -> Distribution {
        match self {
            Workload::D => Distribution::Latest,
            _ => Distribution::Zipfian,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpType {
    Read,
    Update,
    Insert,
    Scan,
    ReadModifyWrite,
}

const OP_TYPES: [OpType; 5] = [
    OpType::Read,
    OpType::Update,
    OpType::Insert,
    OpType::Scan,
    OpType::ReadModifyWrite,
];

impl OpType {
    fn name(self) -> &'static str {
        match self {
            OpType::Read => "READ",
            OpType::Update => "UPDATE",
            OpType::Insert => "INSERT",
            OpType::Scan => "SCAN",
            OpType::ReadModifyWrite => "READ-MODIFY-WRITE",
        }
    }

    fn choose(mix: &Mix, u: f64) -> OpType {
        let mut acc = 0.0;
        for (op, p) in [
            (OpType::Read, mix.read),
            (OpType::Update, mix.update),
            (OpType::Insert, mix.insert),
            (OpType::Scan, mix.scan),
            (OpType::ReadModifyWrite, mix.rmw),
        ] {
            acc += p;
            if u < acc {
                return op;
            }
        }
        // Rounding can leave u just above the sum: the last non-zero kind then.
        OP_TYPES
            .iter()
            .rev()
            .copied()
            .find(|op| op.proportion(mix) > 0.0)
            .unwrap_or(OpType::Read)
    }

    fn proportion(self, mix: &Mix) -> f64 {
        match self {
            OpType::Read => mix.read,
            OpType::Update => mix.update,
            OpType::Insert => mix.insert,
            OpType::Scan => mix.scan,
            OpType::ReadModifyWrite => mix.rmw,
        }
    }
}

/// The stores `--spawn` can start, each as its own server process:
/// - `camelot`: Camelot's native client, one value per record (a data model of its own);
/// - `resp`: Camelot's Redis port with the thread budget redis-server has (one native
///   worker, one Redis-port event loop), driven through YCSB's Redis binding;
/// - `resp-parity`: as `resp`, and the event loop sleeps at once after a command as
///   redis-server does (`--resp-poll-us 0`), so its CPU seconds compare like for like;
/// - `resp-cores`: the Redis port with one event loop per core (Camelot's default is one,
///   which would repeat the `resp` row);
/// - `redis`: redis-server (io-threads off: one thread), YCSB's Redis binding;
/// - `memcached`: memcached with `-t` = the machine's cores.
pub const SPAWNABLE: [&str; 6] = [
    "camelot",
    "resp",
    "resp-parity",
    "resp-cores",
    "redis",
    "memcached",
];
/// The spawned store every other is divided by.
const BASELINE: &str = "redis";

#[derive(Debug, Clone)]
pub struct YcsbConfig {
    pub workloads: Vec<Workload>,
    pub records: u64,
    pub operations: u64,
    pub threads: usize,
    /// Overrides every workload's own request distribution.
    pub distribution: Option<Distribution>,
    pub fields: usize,
    pub field_bytes: usize,
    /// A fixed total rate instead of a closed loop; latency then counts from each
    /// operation's intended start.
    pub target_ops: Option<f64>,
    /// Existing stores, as (label, target).
    pub targets: Vec<(String, TargetKind)>,
    /// Stores to start locally (names from [`SPAWNABLE`]) and stop afterwards.
    pub spawn: Vec<String>,
    /// Memory cap of a spawned Camelot node and of a spawned memcached.
    pub memory_bytes: u64,
    /// Spawned Camelot servers run inside the bench process instead of as separate
    /// processes (labelled "(in-process)" everywhere).
    pub in_process: bool,
    pub seed: u64,
    /// Each workload runs on every target this many times, interleaved; the median counts.
    pub rounds: usize,
    pub quick: bool,
}

impl Default for YcsbConfig {
    fn default() -> Self {
        YcsbConfig {
            workloads: vec![Workload::A],
            records: 100_000,
            operations: 200_000,
            threads: 16,
            distribution: None,
            fields: 10,
            field_bytes: 100,
            target_ops: None,
            targets: Vec::new(),
            spawn: Vec::new(),
            memory_bytes: 8 << 30,
            in_process: false,
            seed: 0x5943_5342,
            rounds: 1,
            quick: false,
        }
    }
}

impl YcsbConfig {
    /// The same experiment, scaled down to finish in seconds.
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.records = self.records.min(5_000);
        self.operations = self.operations.min(10_000);
        self.threads = self.threads.min(8);
        self.rounds = 1;
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        if self.workloads.is_empty() {
            return bad("no workload given".into());
        }
        if self.records == 0 || self.records > RECORDS_MAX {
            return bad(format!("--records must be 1 to {RECORDS_MAX}"));
        }
        if self.operations == 0 || self.operations > OPERATIONS_MAX {
            return bad(format!("--operations must be 1 to {OPERATIONS_MAX}"));
        }
        if self.rounds == 0 || self.rounds > ROUNDS_MAX {
            return bad(format!("--rounds must be 1 to {ROUNDS_MAX}"));
        }
        if self.threads == 0 || self.threads > THREADS_MAX {
            return bad(format!("--threads must be 1 to {THREADS_MAX}"));
        }
        if self.fields == 0 || self.fields > FIELDS_MAX {
            return bad(format!("--fields must be 1 to {FIELDS_MAX}"));
        }
        if self.field_bytes < FIELD_HEADER_BYTES {
            return bad(format!(
                "--field-bytes must be at least {FIELD_HEADER_BYTES}: each field starts with \
                 the version and key hash the harness checks reads against"
            ));
        }
        match self.fields.checked_mul(self.field_bytes) {
            Some(b) if b <= RECORD_BYTES_MAX => {}
            _ => return bad(format!("a record may be at most {RECORD_BYTES_MAX} bytes")),
        }
        if let Some(r) = self.target_ops {
            if !(r.is_finite() && r > 0.0) {
                return bad("--target-ops must be a positive rate".into());
            }
        }
        if self.targets.is_empty() && self.spawn.is_empty() {
            return bad("give --target URL, or --compare NAMES with --spawn".into());
        }
        for (i, s) in self.spawn.iter().enumerate() {
            if self.spawn[..i].contains(s) {
                return bad(format!("{s:?} is named twice in --compare"));
            }
            if !SPAWNABLE.contains(&s.as_str()) {
                return bad(format!("cannot spawn {s:?}: choose from {SPAWNABLE:?}"));
            }
        }
        Ok(())
    }

    fn record_bytes(&self) -> usize {
        self.fields * self.field_bytes
    }
}

/// Per-operation-type results of one run.
#[derive(Debug, Clone)]
pub struct OpResult {
    pub name: &'static str,
    pub count: u64,
    pub ops_per_sec: f64,
    pub latency_us: LatencySummary,
}

/// One target × workload.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum RunOutcome {
    Skipped(String),
    Done(RunResult),
}

#[derive(Debug, Clone)]
pub struct RunResult {
    /// Operations of the run phase (its throughput times its duration).
    pub operations: u64,
    pub load_ops_per_sec: f64,
    pub ops_per_sec: f64,
    pub bytes_per_sec: f64,
    pub latency_us: LatencySummary,
    pub ops: Vec<OpResult>,
    pub errors: u64,
    pub mismatches: u64,
    pub problems: Vec<String>,
    /// Server CPU seconds of the load and of the run phase, when the server is a process
    /// this bench started (not for `--target` stores or in-process servers).
    pub load_server_cpu_seconds: Option<f64>,
    pub server_cpu_seconds: Option<f64>,
    /// CPU seconds of this process (the client threads; with in-process servers, those
    /// too) during the run phase.
    pub client_cpu_seconds: Option<f64>,
}

/// A store one run drives: where it is, and the processes whose CPU it costs.
#[derive(Debug, Clone)]
pub struct RunTarget {
    pub label: String,
    pub kind: TargetKind,
    /// Server processes to meter (empty: nothing to meter).
    pub pids: Vec<u32>,
}

/// What the store holds of each key, as the harness knows it.
struct Book {
    /// The newest version certainly on the server (see [`Book::finish_write`]).
    floor: Vec<AtomicU64>,
    /// Per key, in one word so one atomic step reads and changes both: writes ever
    /// started (high 32 bits) and writes in flight (low 32 bits).
    writes: Vec<AtomicU64>,
    versions: AtomicU64,
}

const IN_FLIGHT_MASK: u64 = 0xffff_ffff;
const ONE_START: u64 = 1 << 32;

/// A write in progress, as [`Book::start_write`] registered it.
struct WriteTicket {
    version: u64,
    /// Nothing else was writing the key when this write started.
    first_in: bool,
    /// The key's start count including this write.
    starts_after: u64,
}

impl Book {
    fn new(keys: u64) -> Book {
        Book {
            floor: (0..keys).map(|_| AtomicU64::new(0)).collect(),
            writes: (0..keys).map(|_| AtomicU64::new(0)).collect(),
            versions: AtomicU64::new(1),
        }
    }

    /// Registers a write, then gives it a version: newer than any write that finished.
    fn start_write(&self, k: usize) -> WriteTicket {
        let before = self.writes[k].fetch_add(ONE_START | 1, Ordering::AcqRel);
        WriteTicket {
            first_in: before & IN_FLIGHT_MASK == 0,
            starts_after: (before >> 32) + 1,
            version: self.versions.fetch_add(1, Ordering::AcqRel),
        }
    }

    /// Raises the floor only for a write that overlapped no other write of the key:
    /// overlapping writes may land on the server in either order, so none of them is
    /// certain to be the one that stays. A write that starts after this one finished
    /// gets a newer version, so it can only raise the floor further.
    fn finish_write(&self, k: usize, ticket: &WriteTicket, ok: bool) {
        let before = self.writes[k].fetch_sub(1, Ordering::AcqRel);
        let alone = ticket.first_in && before >> 32 == ticket.starts_after;
        if ok && alone {
            self.floor[k].fetch_max(ticket.version, Ordering::AcqRel);
        }
    }

    fn floor(&self, k: usize) -> u64 {
        self.floor[k].load(Ordering::Acquire)
    }
}

#[derive(Default)]
struct ThreadTally {
    recorders: Vec<LatencyRecorder>,
    all: LatencyRecorder,
    errors: u64,
    mismatches: u64,
    problems: Vec<String>,
    records_moved: u64,
}

impl ThreadTally {
    fn new() -> ThreadTally {
        ThreadTally {
            recorders: OP_TYPES.iter().map(|_| LatencyRecorder::new()).collect(),
            all: LatencyRecorder::new(),
            ..ThreadTally::default()
        }
    }

    fn problem(&mut self, what: String) {
        if self.problems.len() < PROBLEMS_KEPT {
            self.problems.push(what);
        }
    }

    fn check(&mut self, key: &str, outcome: Result<u64, record::Mismatch>) {
        self.records_moved += 1;
        if let Err(m) = outcome {
            self.mismatches += 1;
            self.problem(format!("{key}: {m:?}"));
        }
    }
}

struct Shared<'a> {
    cfg: &'a YcsbConfig,
    workload: Workload,
    book: &'a Book,
    inserts: &'a InsertCounter,
    progress: &'a Progress,
}

fn run_thread(
    shared: &Shared<'_>,
    db: &mut dyn Db,
    thread: usize,
    ops: u64,
    start: Instant,
) -> ThreadTally {
    let cfg = shared.cfg;
    let mix = shared.workload.mix();
    let distribution = cfg
        .distribution
        .unwrap_or_else(|| shared.workload.default_distribution());
    let expected_inserts = (cfg.operations as f64 * mix.insert * 2.0) as u64;
    let mut chooser = KeyChooser::new(distribution, cfg.records, expected_inserts);
    let mut rng = SmallRng::seed_from_u64(cfg.seed ^ (thread as u64).wrapping_mul(0x9e37_79b9));
    let mut t = ThreadTally::new();
    let interval = cfg
        .target_ops
        .map(|r| Duration::from_secs_f64(cfg.threads as f64 / r));
    let mut unreported = 0;
    for i in 0..ops {
        let intended = match interval {
            Some(iv) => {
                let at = start + iv.mul_f64(i as f64);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                at
            }
            None => Instant::now(),
        };
        let op = OpType::choose(&mix, rng.gen::<f64>());
        let ok = match op {
            OpType::Insert => {
                let k = shared.inserts.next();
                let key = key_name(k);
                let ok = write(shared.book, db, &key, k as usize, true, &mut t);
                if ok {
                    shared.inserts.acknowledge(k);
                }
                ok
            }
            OpType::Scan => {
                let k = chooser.next(&mut rng, shared.inserts.last());
                let key = key_name(k);
                let len = rng.gen_range(1..=SCAN_LENGTH_MAX);
                match db.scan(&key, len) {
                    Ok(records) => {
                        for r in records {
                            t.check(&key, r);
                        }
                        true
                    }
                    Err(e) => {
                        t.errors += 1;
                        t.problem(format!("scan from {key}: {e}"));
                        false
                    }
                }
            }
            OpType::Read | OpType::Update | OpType::ReadModifyWrite => {
                let k = chooser.next(&mut rng, shared.inserts.last());
                let key = key_name(k);
                let mut ok = true;
                if op != OpType::Update {
                    ok = read(shared.book, db, &key, k as usize, &mut t);
                }
                if ok && op != OpType::Read {
                    ok = write(shared.book, db, &key, k as usize, false, &mut t);
                }
                ok
            }
        };
        if ok {
            let took = intended.elapsed();
            t.recorders[OP_TYPES.iter().position(|o| *o == op).unwrap_or(0)].record(took);
            t.all.record(took);
        }
        unreported += 1;
        if unreported == PROGRESS_STEP {
            shared.progress.inc(unreported);
            unreported = 0;
        }
    }
    shared.progress.inc(unreported);
    t
}

fn write(
    book: &Book,
    db: &mut dyn Db,
    key: &str,
    k: usize,
    insert: bool,
    t: &mut ThreadTally,
) -> bool {
    if k >= book.floor.len() {
        t.errors += 1;
        t.problem(format!("{key}: key number {k} is past the harness's book"));
        return false;
    }
    let ticket = book.start_write(k);
    let r = db.write(key, ticket.version, insert);
    book.finish_write(k, &ticket, r.is_ok());
    match r {
        Ok(()) => {
            t.records_moved += 1;
            true
        }
        Err(e) => {
            t.errors += 1;
            t.problem(format!("write {key}: {e}"));
            false
        }
    }
}

fn read(book: &Book, db: &mut dyn Db, key: &str, k: usize, t: &mut ThreadTally) -> bool {
    let floor = book.floor.get(k).map_or(0, |_| book.floor(k));
    match db.read(key, floor) {
        Ok(Some(outcome)) => {
            t.check(key, outcome);
            true
        }
        Ok(None) => {
            // Every key a read picks was loaded or acknowledged as inserted.
            t.mismatches += 1;
            t.problem(format!("{key}: missing"));
            true
        }
        Err(e) => {
            t.errors += 1;
            t.problem(format!("read {key}: {e}"));
            false
        }
    }
}

/// Runs `f(thread, db)` on `threads` threads, each with its own connection; all start
/// together, and the elapsed time is from that start to the last one's end.
fn on_threads<T: Send>(
    target: &Target,
    shape: Shape,
    threads: usize,
    f: impl Fn(usize, &mut dyn Db, Instant) -> T + Sync,
) -> Result<(Vec<T>, Duration), BenchError> {
    let mut dbs = (0..threads)
        .map(|_| target.connect(shape))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| BenchError::Setup(format!("cannot connect: {e}")))?;
    let start = Instant::now();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = dbs
            .iter_mut()
            .enumerate()
            .map(|(i, db)| {
                let f = &f;
                s.spawn(move || f(i, db.as_mut(), start))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| BenchError::Setup("a client thread panicked".into()))
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok((out, start.elapsed()))
}

/// Load, then run, one workload against one target.
pub fn run_one(
    target: &RunTarget,
    workload: Workload,
    cfg: &YcsbConfig,
) -> Result<RunOutcome, BenchError> {
    let (kind, label, pids) = (&target.kind, target.label.as_str(), &target.pids);
    let mix = workload.mix();
    if mix.scan > 0.0 && !kind.supports_scan() {
        return Ok(RunOutcome::Skipped(format!(
            "{label} has no scan, which workload {} needs",
            workload.name()
        )));
    }
    clear(kind).map_err(|e| BenchError::Setup(format!("cannot empty {label}: {e}")))?;
    let target = Target::open(kind)?;
    let shape = Shape {
        fields: cfg.fields,
        field_bytes: cfg.field_bytes,
    };
    // Inserts are drawn at random, so in the worst case every operation is one.
    let book_keys = cfg.records + if mix.insert > 0.0 { cfg.operations } else { 0 };
    let book = Book::new(book_keys);

    let progress = Progress::new(cfg.records, &format!("{label} {}: load", workload.name()));
    let load_meter = CpuMeter::start(pids.clone());
    let (loaded, load_time) = on_threads(&target, shape, cfg.threads, |thread, db, _| {
        let mut t = ThreadTally::new();
        let mut unreported = 0;
        for k in (thread as u64..cfg.records).step_by(cfg.threads) {
            write(&book, db, &key_name(k), k as usize, true, &mut t);
            unreported += 1;
            if unreported == PROGRESS_STEP {
                progress.inc(unreported);
                unreported = 0;
            }
        }
        progress.inc(unreported);
        t
    })?;
    progress.finish();
    let load_server_cpu_seconds = load_meter.seconds();
    let load_errors: u64 = loaded.iter().map(|t| t.errors).sum();
    if load_errors > 0 {
        let first = loaded.iter().flat_map(|t| &t.problems).next().cloned();
        return Err(BenchError::Check(format!(
            "{label}: {load_errors} records failed to load; first: {}",
            first.unwrap_or_default()
        )));
    }

    let inserts = InsertCounter::new(cfg.records);
    let progress = Progress::new(cfg.operations, &format!("{label} {}: run", workload.name()));
    let shared = Shared {
        cfg,
        workload,
        book: &book,
        inserts: &inserts,
        progress: &progress,
    };
    let per_thread = cfg.operations / cfg.threads as u64;
    let extra = cfg.operations % cfg.threads as u64;
    let run_meter = CpuMeter::start(pids.clone());
    // The harness's own CPU: on a small machine it says whether the client, not the
    // server, was what ran out.
    let client_meter = CpuMeter::start(vec![std::process::id()]);
    let (tallies, elapsed) = on_threads(&target, shape, cfg.threads, |thread, db, start| {
        let ops = per_thread + u64::from((thread as u64) < extra);
        run_thread(&shared, db, thread, ops, start)
    })?;
    let server_cpu_seconds = run_meter.seconds();
    let client_cpu_seconds = client_meter.seconds();
    progress.finish();

    let secs = elapsed.as_secs_f64().max(1e-9);
    let mut all = LatencyRecorder::new();
    let mut per_op: Vec<LatencyRecorder> =
        OP_TYPES.iter().map(|_| LatencyRecorder::new()).collect();
    let (mut errors, mut mismatches, mut moved) = (0, 0, 0);
    let mut problems = Vec::new();
    for t in &tallies {
        all.merge(&t.all);
        for (acc, r) in per_op.iter_mut().zip(&t.recorders) {
            acc.merge(r);
        }
        errors += t.errors;
        mismatches += t.mismatches;
        moved += t.records_moved;
        problems.extend(
            t.problems
                .iter()
                .take(PROBLEMS_KEPT.saturating_sub(problems.len()))
                .cloned(),
        );
    }
    let ops = OP_TYPES
        .iter()
        .zip(&per_op)
        .filter(|(_, r)| r.count() > 0)
        .map(|(op, r)| OpResult {
            name: op.name(),
            count: r.count(),
            ops_per_sec: r.count() as f64 / secs,
            latency_us: r.summary(),
        })
        .collect();
    Ok(RunOutcome::Done(RunResult {
        operations: all.count(),
        load_ops_per_sec: cfg.records as f64 / load_time.as_secs_f64().max(1e-9),
        ops_per_sec: all.count() as f64 / secs,
        bytes_per_sec: moved as f64 * cfg.record_bytes() as f64 / secs,
        latency_us: all.summary(),
        ops,
        errors,
        mismatches,
        problems,
        load_server_cpu_seconds,
        server_cpu_seconds,
        client_cpu_seconds,
    }))
}

/// Stores started for a `--spawn` run, each a server of its own; dropping stops them.
struct Spawned {
    camelot: Vec<CamelotNodes>,
    _redis: Vec<RedisServer>,
    _memcached: Vec<MemcachedServer>,
    targets: Vec<RunTarget>,
    sides: Vec<Side>,
}

/// The client side of a row: YCSB threads, each with one request in flight.
fn ycsb_client(cfg: &YcsbConfig, client: &str, data_model: String, resp_face: bool) -> ClientSide {
    ClientSide {
        client: client.into(),
        client_threads: cfg.threads,
        depth: 1,
        data_model,
        resp_face,
    }
}

fn spawn(cfg: &YcsbConfig) -> Result<Spawned, BenchError> {
    let placement = Placement::choose(cfg.in_process)?;
    let record = format!("{} fields × {} B", cfg.fields, cfg.field_bytes);
    let hash_model = format!("a hash per record (HMSET/HGETALL/HMGET) + `_indices` zset; {record}");
    let redis_binding = "redis crate, YCSB's Redis binding";
    let mut spawned = Spawned {
        camelot: Vec::new(),
        _redis: Vec::new(),
        _memcached: Vec::new(),
        targets: Vec::new(),
        sides: Vec::new(),
    };
    for name in &cfg.spawn {
        match name.as_str() {
            "camelot" | "resp" | "resp-parity" | "resp-cores" => {
                let mut spec = CamelotSpec::new(1, cfg.memory_bytes);
                let (label, client) = match name.as_str() {
                    "camelot" => (
                        "camelot-native".to_string(),
                        ycsb_client(
                            cfg,
                            "camelot-client (native)",
                            format!("one value per record; {record}"),
                            false,
                        ),
                    ),
                    "resp" => {
                        spec.resp = true;
                        // redis-server's budget: one thread serves every command.
                        spec.threads = Some(1);
                        if !placement.is_in_process() {
                            spec.resp_threads = Some(1);
                        }
                        (
                            "camelot-resp".to_string(),
                            ycsb_client(cfg, redis_binding, hash_model.clone(), true),
                        )
                    }
                    "resp-parity" => {
                        if placement.is_in_process() {
                            return Err(BenchError::InvalidConfig(
                                "resp-parity sets the Redis port's polling, which needs a \
                                 separate server process (drop --in-process)"
                                    .into(),
                            ));
                        }
                        spec.resp = true;
                        spec.threads = Some(1);
                        spec.resp_threads = Some(1);
                        spec.resp_poll_us = Some(0);
                        (
                            "camelot-resp-parity".to_string(),
                            ycsb_client(cfg, redis_binding, hash_model.clone(), true),
                        )
                    }
                    _ => {
                        spec.resp = true;
                        spec.resp_threads = Some(cores());
                        (
                            format!("camelot-resp-{}t", cores()),
                            ycsb_client(cfg, redis_binding, hash_model.clone(), true),
                        )
                    }
                };
                let label = placement.label(&label);
                let nodes = CamelotNodes::start(&spec, &placement)?;
                let kind = if spec.resp {
                    TargetKind::Resp(*nodes.resp_addrs().first().ok_or_else(|| {
                        BenchError::Setup("the Camelot node has no Redis port".into())
                    })?)
                } else {
                    TargetKind::Camelot {
                        addrs: nodes.addrs(),
                        token: None,
                    }
                };
                spawned.sides.push(nodes.side(&label, client));
                spawned.targets.push(RunTarget {
                    label,
                    kind,
                    pids: nodes.processes().iter().map(|p| p.pid()).collect(),
                });
                spawned.camelot.push(nodes);
            }
            "redis" => {
                let redis = RedisServer::start()?;
                let version = RedisServer::version()?;
                let client = ycsb_client(cfg, redis_binding, hash_model.clone(), true);
                spawned.sides.push(Side::peer(
                    BASELINE,
                    redis.process(),
                    version,
                    Some(1),
                    ["--save", "", "--appendonly", "no"]
                        .map(String::from)
                        .to_vec(),
                    client,
                ));
                spawned.targets.push(RunTarget {
                    label: BASELINE.into(),
                    kind: TargetKind::Redis(redis.addr()),
                    pids: vec![redis.process().pid()],
                });
                spawned._redis.push(redis);
            }
            _ => {
                // One worker thread per core, not more: more threads than cores would
                // only make memcached's own threads take turns.
                let threads = cores();
                let memory_mib = (cfg.memory_bytes >> 20).max(64);
                let memcached = MemcachedServer::start(threads as u32, memory_mib)?;
                let version = MemcachedServer::version()?;
                let client = ycsb_client(
                    cfg,
                    "memcached text protocol (bench's bounded client)",
                    format!("one value per record; {record}"),
                    false,
                );
                spawned.sides.push(Side::peer(
                    "memcached",
                    memcached.process(),
                    version,
                    Some(threads),
                    vec![
                        "-t".into(),
                        threads.to_string(),
                        "-m".into(),
                        memory_mib.to_string(),
                    ],
                    client,
                ));
                spawned.targets.push(RunTarget {
                    label: "memcached".into(),
                    kind: TargetKind::Memcached(memcached.addr()),
                    pids: vec![memcached.process().pid()],
                });
                spawned._memcached.push(memcached);
            }
        }
    }
    Ok(spawned)
}

/// Everything a run produced.
pub struct YcsbReport {
    pub files: Vec<PathBuf>,
    /// The comparison table, ready to print.
    pub table: String,
    pub errors: u64,
    pub mismatches: u64,
}

/// Runs every workload against every target, writes `ycsb.json` and its figure into
/// `out`, and returns the table. Mismatches and errors are in the report and the JSON;
/// the caller decides to fail on them.
pub fn run(
    cfg: &YcsbConfig,
    out: &Path,
    mut log: impl FnMut(&str),
) -> Result<YcsbReport, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let spawned = if cfg.spawn.is_empty() {
        None
    } else {
        Some(spawn(cfg)?)
    };
    let mut targets: Vec<RunTarget> = cfg
        .targets
        .iter()
        .map(|(label, kind)| RunTarget {
            label: label.clone(),
            kind: kind.clone(),
            pids: Vec::new(),
        })
        .collect();
    if let Some(s) = &spawned {
        targets.extend(s.targets.iter().cloned());
    }
    let mut series: Vec<Series> = targets
        .iter()
        .map(|t| Series::new(t.label.clone()))
        .collect();
    let (mut errors, mut mismatches) = (0, 0);
    for &w in &cfg.workloads {
        // Rounds interleave the targets (all of round 1, then all of round 2, …), and every
        // other round runs them in reverse order, so a burst of noise from a neighbour or
        // a warm cache does not always favour the same store; each point is the round
        // with the median throughput.
        let mut outcomes: Vec<Vec<RunOutcome>> = vec![Vec::new(); targets.len()];
        for round in 0..cfg.rounds {
            let order: Vec<usize> = if round % 2 == 0 {
                (0..targets.len()).collect()
            } else {
                (0..targets.len()).rev().collect()
            };
            for i in order {
                let t = &targets[i];
                log(&format!(
                    "ycsb: workload {} on {}, round {}/{}",
                    w.name(),
                    t.label,
                    round + 1,
                    cfg.rounds
                ));
                let outcome = run_one(t, w, cfg)?;
                if let RunOutcome::Done(r) = &outcome {
                    errors += r.errors;
                    mismatches += r.mismatches;
                }
                outcomes[i].push(outcome);
            }
        }
        for (runs, s) in outcomes.into_iter().zip(series.iter_mut()) {
            s.points.push(point_of(w, runs, &mut log));
        }
    }
    let sides = spawned
        .as_ref()
        .map(|s| s.sides.clone())
        .unwrap_or_default();
    if let Some(s) = spawned {
        for c in s.camelot {
            c.stop()?;
        }
    }
    let config = json!({
        "x": "workload",
        "workloads": cfg.workloads.iter().map(|w| w.name()).collect::<Vec<_>>(),
        "records": cfg.records,
        "operations": cfg.operations,
        "threads": cfg.threads,
        "distribution": cfg.distribution.map(|d| d.name()),
        "fields": cfg.fields,
        "field_bytes": cfg.field_bytes,
        "target_ops": cfg.target_ops,
        "targets": targets.iter().map(|t| json!({"label": t.label, "target": format!("{:?}", t.kind)})).collect::<Vec<_>>(),
        "spawned": cfg.spawn,
        "sides": sides_json(&sides),
        "in_process": cfg.in_process,
        "round_order": "interleaved; every other round reversed",
        "client_cpu": "client_cpu_seconds is the bench process during the run phase (its client threads; with --in-process, the servers too)",
        "write_all_fields": true,
        "rounds": cfg.rounds,
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("ycsb", started, config, series);
    result.comparisons = comparisons(&result);
    let files = write_result_with_figure(out, &result, &figure(&result))?;
    Ok(YcsbReport {
        files,
        table: table(&result),
        errors,
        mismatches,
    })
}

/// The point for one workload on one target: its median-throughput round, with every
/// round's throughput beside it.
fn point_of(w: Workload, runs: Vec<RunOutcome>, log: &mut impl FnMut(&str)) -> Point {
    let mut p = Point::new(w.name());
    let mut done: Vec<RunResult> = Vec::new();
    for r in runs {
        match r {
            RunOutcome::Skipped(why) => {
                log(&format!("ycsb: skipped: {why}"));
                p.extra.insert("skipped".into(), json!(why));
                return p;
            }
            RunOutcome::Done(r) => done.push(r),
        }
    }
    let rounds: Vec<f64> = done.iter().map(|r| r.ops_per_sec).collect();
    let errors: u64 = done.iter().map(|r| r.errors).sum();
    let mismatches: u64 = done.iter().map(|r| r.mismatches).sum();
    let problems: Vec<String> = done
        .iter()
        .flat_map(|r| r.problems.iter().cloned())
        .take(PROBLEMS_KEPT)
        .collect();
    done.sort_by(|a, b| a.ops_per_sec.total_cmp(&b.ops_per_sec));
    let Some(r) = done.get(done.len() / 2) else {
        return p;
    };
    p.ops_per_sec = Some(r.ops_per_sec);
    p.bytes_per_sec = Some(r.bytes_per_sec);
    p.latency_us = Some(r.latency_us.clone());
    p.extra.insert("rounds_ops_per_sec".into(), json!(rounds));
    p.extra
        .insert("load_ops_per_sec".into(), json!(r.load_ops_per_sec));
    for (k, v) in cpu_extra(r.operations as f64, r.server_cpu_seconds) {
        p.extra.insert(k.into(), v);
    }
    if let Some(cpu) = r.client_cpu_seconds {
        p.extra.insert("client_cpu_seconds".into(), json!(cpu));
    }
    if let Some(cpu) = r.load_server_cpu_seconds {
        p.extra.insert("load_server_cpu_seconds".into(), json!(cpu));
    }
    p.extra.insert("errors".into(), json!(errors));
    p.extra.insert("mismatches".into(), json!(mismatches));
    if !problems.is_empty() {
        p.extra.insert("problems".into(), json!(problems));
    }
    // One flat number per operation type, so a table shows them as numbers.
    for o in &r.ops {
        p.extra.insert(format!("{}_count", o.name), json!(o.count));
        p.extra
            .insert(format!("{}_ops_per_sec", o.name), json!(o.ops_per_sec));
        p.extra.insert(
            format!("{}_latency_us_p99", o.name),
            json!(o.latency_us.p99),
        );
    }
    p
}

/// Throughput bars per workload (one bar per target) and p99 latency bars.
pub fn figure(result: &BenchResult) -> Figure {
    let workloads: Vec<String> = result
        .series
        .first()
        .map(|s| s.points.iter().map(label_of).collect())
        .unwrap_or_default();
    let mut throughput = Panel::new("throughput", "workload", "ops/s").bars(workloads.clone());
    let mut p99 = Panel::new("p99 latency", "workload", "latency (µs)").bars(workloads);
    for s in &result.series {
        let pick = |f: &dyn Fn(&Point) -> Option<f64>| -> Vec<(f64, f64)> {
            s.points
                .iter()
                .enumerate()
                .filter_map(|(i, p)| Some((i as f64, f(p)?)))
                .collect()
        };
        throughput = throughput.line(&s.label, pick(&|p| p.ops_per_sec));
        p99 = p99.line(&s.label, pick(&|p| p.latency_us.as_ref().map(|l| l.p99)));
    }
    Figure::new("ycsb").panel(throughput).panel(p99)
}

fn label_of(p: &Point) -> String {
    match &p.x {
        camelot_results::schema::X::Label(l) => l.clone(),
        camelot_results::schema::X::Num(n) => format!("{n}"),
    }
}

/// A point's number from `extra`.
fn extra_f64(p: &Point, key: &str) -> Option<f64> {
    p.extra.get(key).and_then(|v| v.as_f64())
}

/// The series whose label is `label`, or `label` marked in-process.
fn series_named<'a>(result: &'a BenchResult, label: &str) -> Option<&'a Series> {
    result.series.iter().find(|s| {
        s.label == label || s.label.strip_suffix(crate::side::IN_PROCESS_SUFFIX) == Some(label)
    })
}

/// The YCSB targets, workload by workload, for the rows that ran: Camelot's Redis
/// port with redis-server's thread budget against redis-server (throughput, ops per
/// server CPU-second, p99), the port with a loop per core against redis-server, and the
/// other rows against their nearest peer, without a target.
pub fn comparisons(result: &BenchResult) -> Vec<Comparison> {
    let Some(redis) = series_named(result, BASELINE) else {
        return Vec::new();
    };
    // The version is in the sides; the comparison names the peer as a reader knows it.
    let peer_label = "redis-server, 1 thread".to_string();
    let resp_cores = format!("camelot-resp-{}t", cores());
    let mut out = Vec::new();
    for (i, peer) in redis.points.iter().enumerate() {
        let w = label_of(peer).to_uppercase();
        let at = |label: &str| series_named(result, label).and_then(|s| s.points.get(i));
        let mut push = |name: String,
                        camelot: Option<f64>,
                        peer: Option<f64>,
                        unit: &str,
                        target: Option<(f64, bool)>| {
            if let (Some(c), Some(p)) = (camelot, peer) {
                let mut cmp = Comparison::new(name, c, p, unit, peer_label.clone());
                if let Some((t, at_most)) = target {
                    cmp = cmp.with_target(t, at_most);
                }
                out.push(cmp);
            }
        };
        if let Some(resp) = at("camelot-resp") {
            push(
                format!("YCSB {w} throughput, 1 server thread each"),
                resp.ops_per_sec,
                peer.ops_per_sec,
                "ops/s",
                Some((1.0, false)),
            );
            push(
                format!("YCSB {w} ops per server CPU-second"),
                extra_f64(resp, "ops_per_server_cpu_second"),
                extra_f64(peer, "ops_per_server_cpu_second"),
                "ops/CPU-s",
                Some((1.0, false)),
            );
            push(
                format!("YCSB {w} p99 latency"),
                resp.latency_us.as_ref().map(|l| l.p99),
                peer.latency_us.as_ref().map(|l| l.p99),
                "µs",
                Some((1.0, true)),
            );
        }
        if let Some(parity) = at("camelot-resp-parity") {
            push(
                format!("YCSB {w} throughput, 1 thread, no polling (parity)"),
                parity.ops_per_sec,
                peer.ops_per_sec,
                "ops/s",
                Some((1.0, false)),
            );
            push(
                format!("YCSB {w} ops per server CPU-second, no polling (parity)"),
                extra_f64(parity, "ops_per_server_cpu_second"),
                extra_f64(peer, "ops_per_server_cpu_second"),
                "ops/CPU-s",
                Some((1.0, false)),
            );
            push(
                format!("YCSB {w} p99 latency, no polling (parity)"),
                parity.latency_us.as_ref().map(|l| l.p99),
                peer.latency_us.as_ref().map(|l| l.p99),
                "µs",
                Some((1.0, true)),
            );
        }
        if let Some(resp) = at(&resp_cores) {
            push(
                format!("YCSB {w} throughput, Redis port on {} loops", cores()),
                resp.ops_per_sec,
                peer.ops_per_sec,
                "ops/s",
                Some((1.3, false)),
            );
        }
        if let Some(native) = at("camelot-native") {
            push(
                format!("YCSB {w} throughput, native client (blob per record)"),
                native.ops_per_sec,
                peer.ops_per_sec,
                "ops/s",
                None,
            );
        }
    }
    out
}

/// One row per workload and store: throughput, its ratio to redis-server's, latency, and
/// what the server spent (CPU seconds of the run phase, operations per CPU-second).
pub fn table(result: &BenchResult) -> String {
    let mut out = format!(
        "{:<9} {:<26} {:>10} {:>8} {:>9} {:>9} {:>8} {:>11} {:>7} {:>8}\n",
        "workload",
        "store",
        "ops/s",
        "÷ redis",
        "p50 µs",
        "p99 µs",
        "CPU s",
        "ops/CPU-s",
        "errors",
        "mismatch"
    );
    let redis = series_named(result, BASELINE);
    for s in &result.series {
        for (i, p) in s.points.iter().enumerate() {
            let w = label_of(p);
            let Some(ops) = p.ops_per_sec else {
                let why = p
                    .extra
                    .get("skipped")
                    .and_then(|v| v.as_str())
                    .unwrap_or("no result");
                out.push_str(&format!("{w:<9} {:<26} skipped: {why}\n", s.label));
                continue;
            };
            let lat = p.latency_us.clone();
            let ratio = redis
                .and_then(|r| r.points.get(i))
                .and_then(|r| r.ops_per_sec)
                .map(|r| format!("{:.2}", ops / r))
                .unwrap_or_else(|| "-".into());
            let num = |k: &str, digits: usize| {
                extra_f64(p, k).map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
            };
            let count = |k: &str| p.extra.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
            out.push_str(&format!(
                "{w:<9} {:<26} {:>10.0} {:>8} {:>9.1} {:>9.1} {:>8} {:>11} {:>7} {:>8}\n",
                s.label,
                ops,
                ratio,
                lat.as_ref().map_or(f64::NAN, |l| l.p50),
                lat.as_ref().map_or(f64::NAN, |l| l.p99),
                num("server_cpu_seconds", 2),
                num("ops_per_server_cpu_second", 0),
                count("errors"),
                count("mismatches"),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_sum_to_one_and_choose_follows_them() {
        let mut rng = SmallRng::seed_from_u64(1);
        for w in ["a", "b", "c", "d", "e", "f", "w"] {
            let m = Workload::parse(w).unwrap().mix();
            let sum = m.read + m.update + m.insert + m.scan + m.rmw;
            assert!((sum - 1.0).abs() < 1e-9, "{w}");
            let n = 20_000;
            let reads = (0..n)
                .filter(|_| OpType::choose(&m, rng.gen()) == OpType::Read)
                .count() as f64
                / n as f64;
            assert!((reads - m.read).abs() < 0.02, "{w}: {reads}");
        }
        assert_eq!(
            OpType::choose(&Workload::C.mix(), 0.999_999_999_9),
            OpType::Read
        );
    }

    #[test]
    fn only_a_write_that_overlapped_none_raises_the_floor() {
        let b = Book::new(4);
        let t1 = b.start_write(0);
        b.finish_write(0, &t1, true);
        assert_eq!(b.floor(0), t1.version);
        // Two overlapping writes: whichever finishes last, neither is certain to stay.
        let t2 = b.start_write(0);
        let t3 = b.start_write(0);
        b.finish_write(0, &t2, true);
        b.finish_write(0, &t3, true);
        assert_eq!(b.floor(0), t1.version);
        let t4 = b.start_write(0);
        let t5 = b.start_write(0);
        b.finish_write(0, &t5, true);
        b.finish_write(0, &t4, true);
        assert_eq!(b.floor(0), t1.version);
        let t6 = b.start_write(0);
        b.finish_write(0, &t6, false);
        assert_eq!(b.floor(0), t1.version, "a failed write proves nothing");
        let t7 = b.start_write(0);
        b.finish_write(0, &t7, true);
        assert_eq!(b.floor(0), t7.version);
    }

    #[test]
    fn concurrent_writers_never_make_a_linearizable_store_look_stale() {
        // The store applies each write at one moment between its start and its finish,
        // in whatever order the threads race to; a read after that must never be below
        // the floor.
        let book = Book::new(1);
        let store = parking_lot::Mutex::new(0u64);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let writers: Vec<_> = (0..4u64)
                .map(|t| {
                    let (book, store) = (&book, &store);
                    s.spawn(move || {
                        let mut rng = SmallRng::seed_from_u64(t);
                        for _ in 0..5_000 {
                            let ticket = book.start_write(0);
                            for _ in 0..rng.gen_range(0..50) {
                                std::hint::spin_loop();
                            }
                            *store.lock() = ticket.version;
                            for _ in 0..rng.gen_range(0..50) {
                                std::hint::spin_loop();
                            }
                            book.finish_write(0, &ticket, true);
                        }
                    })
                })
                .collect();
            s.spawn(|| {
                let mut checks = 0u64;
                while !done.load(Ordering::Acquire) || checks == 0 {
                    let floor = book.floor(0);
                    let seen = *store.lock();
                    assert!(seen >= floor, "read {seen} below floor {floor}");
                    checks += 1;
                }
            });
            for w in writers {
                w.join().unwrap();
            }
            done.store(true, Ordering::Release);
        });
        assert!(book.floor(0) > 0, "some write ran alone at least once");
    }

    #[test]
    fn bad_configs_are_refused() {
        let ok = YcsbConfig {
            targets: vec![(
                "x".into(),
                TargetKind::Redis("127.0.0.1:1".parse().unwrap()),
            )],
            ..YcsbConfig::default()
        };
        assert!(ok.validate().is_ok());
        for bad in [
            YcsbConfig {
                field_bytes: 8,
                ..ok.clone()
            },
            YcsbConfig {
                threads: 0,
                ..ok.clone()
            },
            YcsbConfig {
                fields: 10,
                field_bytes: 8 << 20,
                ..ok.clone()
            },
            YcsbConfig {
                targets: vec![],
                ..ok.clone()
            },
            YcsbConfig {
                spawn: vec!["mysql".into()],
                ..ok.clone()
            },
            YcsbConfig {
                spawn: vec!["redis".into(), "redis".into()],
                ..ok.clone()
            },
            YcsbConfig {
                target_ops: Some(0.0),
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
