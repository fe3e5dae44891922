//! `camelot bench rvm-commit` and `camelot bench rvm-recovery`: seed 001's micro-benchmarks
//! of recoverable virtual memory, per backend, beside the peers the targets are
//! stated against (iperf3, sockperf, redis-benchmark), all measured in the same run.
//!
//! Commit: allocate P pages, modify every page (one `set_range` per page), time `commit()`.
//! Recovery: allocate and commit P pages, drop the instance, time `Rvm::open` with recovery
//! until every segment is in memory. Each trial uses a fresh backend (new servers, a new
//! directory), as the seed restarted its server between trials.

use crate::latency::LatencyRecorder;
use crate::peers;
use crate::progress::Progress;
use crate::side::{
    camelot_side, sides_json, CamelotNodes, CamelotSpec, ClientSide, Placement, Side,
    IN_PROCESS_SUFFIX,
};
use crate::BenchError;
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series};
use camelot_rvm::{BackendConfig, Config, Rvm, RvmError};
use camelot_testkit::RedisServer;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const PAGE_BYTES: u64 = camelot_rvm::limits::PAGE_BYTES;
/// The seed's largest experiment; the targets are stated at it.
pub const TARGET_PAGES: u64 = 10_000;
pub const PAGES_MAX: u64 = 20_000;
pub const TRIALS_MAX: usize = 100;
/// Small commits are repeated within a trial up to this many modified bytes, so a
/// one-page point is a distribution, not one sample.
const COMMIT_BYTES_PER_TRIAL: u64 = 8 << 20;
const COMMITS_PER_TRIAL_MAX: u64 = 200;
/// Each dev node holds the log region, the catalogs and the segment's home.
const NODE_HEADROOM_BYTES: u64 = 64 << 20;
const SOCKPERF_MESSAGE_BYTES: u32 = 64;
/// `redis-benchmark -t set -d 4096 -P 64`: the per-request peer for Redis.
const REDIS_PEER_ARGS: [&str; 6] = ["-t", "set", "-d", "4096", "-P", "64"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RvmBackend {
    Pool,
    PoolMirrored,
    Redis,
    File,
}

impl RvmBackend {
    pub const ALL: [RvmBackend; 4] = [
        RvmBackend::Pool,
        RvmBackend::PoolMirrored,
        RvmBackend::Redis,
        RvmBackend::File,
    ];

    pub fn label(self) -> &'static str {
        match self {
            RvmBackend::Pool => "pool",
            RvmBackend::PoolMirrored => "pool-mirrored",
            RvmBackend::Redis => "redis",
            RvmBackend::File => "file",
        }
    }

    pub fn parse(s: &str) -> Result<RvmBackend, BenchError> {
        RvmBackend::ALL
            .into_iter()
            .find(|b| b.label() == s)
            .ok_or_else(|| {
                BenchError::InvalidConfig(format!(
                    "unknown RVM backend {s:?} (pool, pool-mirrored, redis, file)"
                ))
            })
    }
}

#[derive(Debug, Clone)]
pub struct RvmBenchConfig {
    pub backends: Vec<RvmBackend>,
    pub pages: Vec<u64>,
    pub trials: usize,
    /// Seconds iperf3 and sockperf run.
    pub peer_seconds: u64,
    /// Requests redis-benchmark sends.
    pub redis_peer_requests: u64,
    /// Run the pool's Camelot servers inside the bench process instead of as separate
    /// `camelot server` processes (labelled so in every output).
    pub in_process: bool,
    pub quick: bool,
}

impl Default for RvmBenchConfig {
    fn default() -> Self {
        RvmBenchConfig {
            backends: RvmBackend::ALL.to_vec(),
            pages: vec![1, 3, 10, 30, 100, 300, 1000, 3000, 10_000],
            trials: 3,
            peer_seconds: 3,
            redis_peer_requests: 200_000,
            in_process: false,
            quick: false,
        }
    }
}

impl RvmBenchConfig {
    /// Scales the run down to finish in under 30 s on a 2-core machine.
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.pages.retain(|p| *p <= 1000);
        if self.pages.len() > 3 {
            self.pages = vec![1, 100, 1000];
        }
        self.trials = 1;
        self.peer_seconds = 1;
        self.redis_peer_requests = self.redis_peer_requests.min(20_000);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        if self.backends.is_empty() {
            return bad("give at least one --backend".into());
        }
        if self.pages.is_empty() || self.pages.iter().any(|p| *p == 0 || *p > PAGES_MAX) {
            return bad(format!("--pages must be 1..={PAGES_MAX}"));
        }
        if self.trials == 0 || self.trials > TRIALS_MAX {
            return bad(format!("--trials must be 1..={TRIALS_MAX}"));
        }
        Ok(())
    }
}

/// A fresh backend for one trial; dropping it stops its servers or removes its directory.
enum Fresh {
    Pool(Vec<CamelotNodes>),
    Redis(RedisServer),
    File(PathBuf),
}

impl Fresh {
    fn start(kind: RvmBackend, pages: u64, placement: &Placement) -> Result<Fresh, BenchError> {
        let node = || CamelotNodes::start(&pool_spec(pages), placement);
        Ok(match kind {
            RvmBackend::Pool => Fresh::Pool(vec![node()?]),
            RvmBackend::PoolMirrored => Fresh::Pool(vec![node()?, node()?]),
            RvmBackend::Redis => Fresh::Redis(RedisServer::start()?),
            RvmBackend::File => {
                static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let dir = std::env::temp_dir().join(format!(
                    "camelot-bench-rvm-{}-{}",
                    std::process::id(),
                    SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                ));
                Fresh::File(dir)
            }
        })
    }

    fn backend(&self) -> BackendConfig {
        match self {
            Fresh::Pool(nodes) => BackendConfig::Pool {
                servers: nodes.iter().flat_map(|n| n.addrs()).collect(),
                token: None,
                log_bytes: camelot_rvm::limits::POOL_LOG_BYTES_DEFAULT,
            },
            Fresh::Redis(r) => BackendConfig::Redis {
                addr: r.addr(),
                wait_replicas: 0,
            },
            Fresh::File(dir) => BackendConfig::File { dir: dir.clone() },
        }
    }

    /// The server processes (a pool's, when they are separate; none otherwise).
    fn server_pids(&self) -> Vec<u32> {
        match self {
            Fresh::Pool(nodes) => nodes
                .iter()
                .flat_map(|n| n.processes().into_iter().map(|p| p.pid()))
                .collect(),
            _ => Vec::new(),
        }
    }

    fn close(self) -> Result<(), BenchError> {
        match self {
            Fresh::Pool(nodes) => {
                for n in nodes {
                    n.stop()?;
                }
            }
            Fresh::Redis(_) => {}
            Fresh::File(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        Ok(())
    }
}

/// One pool node: room for the log region, the catalogs and the segment's home, served by
/// one worker thread (redis-server, the peer, has one).
fn pool_spec(pages: u64) -> CamelotSpec {
    let mut spec = CamelotSpec::new(
        1,
        camelot_rvm::limits::POOL_LOG_BYTES_DEFAULT + 2 * pages * PAGE_BYTES + NODE_HEADROOM_BYTES,
    );
    spec.threads = Some(1);
    spec
}

fn rvm_err(e: RvmError) -> BenchError {
    BenchError::Setup(format!("rvm: {e}"))
}

/// Every page gets a different first word, so a recovery that loses or mixes pages fails
/// the check.
fn page_word(round: u64, page: u64) -> u64 {
    round.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ page
}

/// One modified-every-page transaction over `pages` pages; returns the commit time.
fn commit_all_pages(
    rvm: &Rvm,
    seg: &camelot_rvm::Segment,
    pages: u64,
    round: u64,
) -> Result<Duration, BenchError> {
    let mut t = rvm.begin();
    let mut page = vec![0u8; PAGE_BYTES as usize];
    for p in 0..pages {
        let off = p * PAGE_BYTES;
        t.set_range(seg, off, PAGE_BYTES).map_err(rvm_err)?;
        page[..8].copy_from_slice(&page_word(round, p).to_le_bytes());
        page[PAGE_BYTES as usize - 8..].copy_from_slice(&round.to_le_bytes());
        t.write(seg, off, &page).map_err(rvm_err)?;
    }
    let start = Instant::now();
    t.commit().map_err(rvm_err)?;
    Ok(start.elapsed())
}

fn check_pages(seg: &camelot_rvm::Segment, pages: u64, round: u64) -> Result<(), BenchError> {
    for p in 0..pages {
        let w = seg.read_u64(p * PAGE_BYTES).map_err(rvm_err)?;
        if w != page_word(round, p) {
            return Err(BenchError::Check(format!(
                "page {p} of {pages} came back wrong after recovery"
            )));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Experiment {
    Commit,
    Recovery,
}

fn measure(
    kind: RvmBackend,
    pages: u64,
    trials: usize,
    what: Experiment,
    progress: &Progress,
    placement: &Placement,
) -> Result<Point, BenchError> {
    let mut rec = LatencyRecorder::new();
    let mut samples = 0u64;
    // CPU of this process and the servers across the commit loops, in ns: `None` once a
    // reading failed (no /proc, or a server process gone).
    let mut commit_cpu_ns: Option<u64> = Some(0);
    for trial in 0..trials {
        let fresh = Fresh::start(kind, pages, placement)?;
        let mut cpu_pids = fresh.server_pids();
        cpu_pids.push(std::process::id());
        let mut cfg = Config::new(fresh.backend(), "bench");
        if what == Experiment::Recovery {
            // The log keeps the commit: recovery replays it, as right after a crash.
            cfg.background_truncation = false;
            cfg.truncate_log_bytes = u64::MAX;
        }
        let rvm = Rvm::open(cfg.clone()).map_err(rvm_err)?;
        let seg = rvm.alloc("pages", pages * PAGE_BYTES).map_err(rvm_err)?;
        match what {
            Experiment::Commit => {
                let commits =
                    (COMMIT_BYTES_PER_TRIAL / (pages * PAGE_BYTES)).clamp(1, COMMITS_PER_TRIAL_MAX);
                let cpu_before = cpu_ns(&cpu_pids);
                for round in 0..commits {
                    rec.record(commit_all_pages(&rvm, &seg, pages, round + 1)?);
                    samples += 1;
                }
                commit_cpu_ns = match (commit_cpu_ns, cpu_before, cpu_ns(&cpu_pids)) {
                    (Some(sum), Some(a), Some(b)) => Some(sum + b.saturating_sub(a)),
                    _ => None,
                };
                rvm.close().map_err(rvm_err)?;
            }
            Experiment::Recovery => {
                let round = trial as u64 + 1;
                commit_all_pages(&rvm, &seg, pages, round)?;
                drop(seg);
                rvm.close().map_err(rvm_err)?;
                let start = Instant::now();
                let rvm = Rvm::open(cfg.recover(true)).map_err(rvm_err)?;
                let elapsed = start.elapsed();
                let seg = rvm
                    .segment("pages")
                    .ok_or_else(|| BenchError::Check("the segment did not come back".into()))?;
                check_pages(&seg, pages, round)?;
                drop(seg);
                rvm.close().map_err(rvm_err)?;
                rec.record(elapsed);
                samples += 1;
            }
        }
        fresh.close()?;
        progress.inc(1);
    }
    let mut p = Point::new(pages);
    let summary = rec.summary();
    p.extra.insert("samples".into(), json!(samples));
    p.extra.insert("trials".into(), json!(trials));
    p.extra
        .insert("per_page_us_p50".into(), json!(summary.p50 / pages as f64));
    if let (Experiment::Commit, Some(ns), true) = (what, commit_cpu_ns, samples > 0) {
        // Client and servers together (every thread; separate servers only: in process
        // they are part of this process anyway). With one vCPU doing all of it, a
        // mirrored commit's extra cost is this figure's difference.
        p.extra.insert(
            "cpu_us_per_commit".into(),
            json!(ns as f64 / 1e3 / samples as f64),
        );
    }
    p.bytes_per_sec = Some((pages * PAGE_BYTES) as f64 / (summary.p50 / 1e6));
    p.latency_us = Some(summary);
    Ok(p)
}

/// CPU time of every thread of `pids` so far, in ns (`/proc/PID/task/*/schedstat`: the
/// scheduler's own nanosecond count, where `/proc/PID/stat` has 10 ms ticks — more than a
/// whole trial of one-page commits). `None` if any process cannot be read.
fn cpu_ns(pids: &[u32]) -> Option<u64> {
    let mut total = 0u64;
    for pid in pids {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        for task in tasks.flatten() {
            // A thread that exited between the listing and the read counts as nothing.
            let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
                continue;
            };
            total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(total)
}

/// The peers of the targets, measured in this run.
#[derive(Debug, Clone, Default)]
struct PeerFigures {
    iperf3_bytes_per_sec: Option<f64>,
    sockperf_p50_us: Option<f64>,
    redis_set_us_per_request: Option<f64>,
    commands: Vec<String>,
}

impl PeerFigures {
    fn time_40mb_us(&self) -> Option<f64> {
        self.iperf3_bytes_per_sec
            .map(|b| (TARGET_PAGES * PAGE_BYTES) as f64 / b * 1e6)
    }

    fn to_json(&self) -> Value {
        json!({
            "iperf3_bytes_per_sec": self.iperf3_bytes_per_sec,
            "iperf3_time_for_10000_pages_us": self.time_40mb_us(),
            "sockperf_tcp_pingpong_p50_us": self.sockperf_p50_us,
            "redis_benchmark_set_4k_p64_us_per_request": self.redis_set_us_per_request,
            "commands": self.commands,
        })
    }
}

fn measure_peers(cfg: &RvmBenchConfig, what: Experiment) -> Result<PeerFigures, BenchError> {
    let mut f = PeerFigures::default();
    let secs = Duration::from_secs(cfg.peer_seconds);
    let iperf = peers::iperf3_tcp_stream(secs)?;
    f.iperf3_bytes_per_sec = Some(iperf.bytes_per_sec);
    f.commands.push(iperf.command);
    if what == Experiment::Commit {
        let sp = peers::sockperf_tcp_pingpong(secs, SOCKPERF_MESSAGE_BYTES)?;
        f.sockperf_p50_us = Some(sp.latency_us.p50);
        f.commands.push(sp.command);
        if cfg.backends.contains(&RvmBackend::Redis) {
            let redis = RedisServer::start()?;
            let n = cfg.redis_peer_requests.to_string();
            let mut args: Vec<&str> = REDIS_PEER_ARGS.to_vec();
            args.extend(["-n", &n]);
            let rate = peers::redis_benchmark(redis.addr(), &args)?;
            f.redis_set_us_per_request = Some(1e6 / rate.ops_per_sec);
            f.commands.push(rate.command);
        }
    }
    Ok(f)
}

fn p50_at(series: &[Series], label: &str, pages: u64) -> Option<f64> {
    series
        .iter()
        .find(|s| s.label == label)?
        .points
        .iter()
        .find(|p| p.x.as_f64() == Some(pages as f64))?
        .latency_us
        .as_ref()
        .map(|l| l.p50)
}

/// The targets as ratios (measured / allowed base; a ratio ≤ its limit passes),
/// for `config["ratios"]`, and the same as comparisons with both figures behind each.
fn ratios(series: &[Series], peers: &PeerFigures, what: Experiment) -> (Value, Vec<Comparison>) {
    let mut out = serde_json::Map::new();
    let mut comparisons = Vec::new();
    let mut put = |name: &str,
                   camelot: Option<f64>,
                   peer: Option<f64>,
                   peer_label: &str,
                   limit: f64,
                   note: &str| {
        let (Some(camelot), Some(peer)) = (camelot, peer) else {
            return;
        };
        let c = Comparison::new(note, camelot, peer, "µs", peer_label).with_target(limit, true);
        out.insert(
            name.into(),
            json!({"ratio": c.ratio, "limit": limit, "met": c.met(), "what": note}),
        );
        comparisons.push(c);
    };
    let t40 = peers.time_40mb_us();
    let biggest = |label: &str| {
        series
            .iter()
            .find(|s| s.label == label)
            .and_then(|s| {
                s.points
                    .iter()
                    .filter_map(|p| p.x.as_f64())
                    .reduce(f64::max)
            })
            .map(|x| x as u64)
    };
    let pool = series_label(series, "pool");
    let pool = pool.as_str();
    let mirrored = series_label(series, "pool-mirrored");
    const IPERF3_40MB: &str = "iperf3 stream: time for 40 MB";
    match what {
        Experiment::Commit => {
            put(
                "pool_commit_10000_pages_vs_iperf3_40mb",
                p50_at(series, pool, TARGET_PAGES),
                t40,
                IPERF3_40MB,
                3.0,
                "pool commit of 10,000 pages / time for 40 MB at the iperf3 loopback rate",
            );
            put(
                "pool_commit_1_page_vs_sockperf_p50",
                p50_at(series, pool, 1),
                peers.sockperf_p50_us,
                "sockperf TCP ping-pong p50",
                3.0,
                "pool one-page commit p50 / sockperf TCP ping-pong p50",
            );
            if let Some(p) = biggest(&mirrored) {
                put(
                    &format!("mirrored_vs_pool_commit_{p}_pages"),
                    p50_at(series, &mirrored, p),
                    p50_at(series, pool, p),
                    "unmirrored pool",
                    1.5,
                    "mirrored pool commit / unmirrored, at the largest page count",
                );
            }
            put(
                "mirrored_vs_pool_commit_1_page",
                p50_at(series, &mirrored, 1),
                p50_at(series, pool, 1),
                "unmirrored pool",
                1.5,
                "mirrored pool one-page commit / unmirrored",
            );
            if let Some(p) = biggest("redis") {
                let per_page = p50_at(series, "redis", p).map(|us| us / p as f64);
                put(
                    &format!("redis_per_page_{p}_pages_vs_redis_benchmark"),
                    per_page,
                    peers.redis_set_us_per_request,
                    "redis-benchmark SET 4 KiB -P 64, per request",
                    1.5,
                    "redis commit time per page / redis-benchmark SET 4 KiB -P 64 per request",
                );
            }
        }
        Experiment::Recovery => {
            put(
                "pool_recovery_10000_pages_vs_iperf3_40mb",
                p50_at(series, pool, TARGET_PAGES),
                t40,
                IPERF3_40MB,
                3.0,
                "pool recovery of 10,000 pages / time for 40 MB at the iperf3 loopback rate",
            );
        }
    }
    (Value::Object(out), comparisons)
}

/// The label a backend's series ran under (an in-process pool carries a suffix).
fn series_label(series: &[Series], backend: &str) -> String {
    series
        .iter()
        .map(|s| s.label.as_str())
        .find(|l| *l == backend || l.strip_suffix(IN_PROCESS_SUFFIX) == Some(backend))
        .unwrap_or(backend)
        .to_string()
}

fn run(cfg: &RvmBenchConfig, out: &Path, what: Experiment) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let name = match what {
        Experiment::Commit => "rvm-commit",
        Experiment::Recovery => "rvm-recovery",
    };
    let placement = Placement::choose(cfg.in_process)?;
    let peers = measure_peers(cfg, what)?;
    let total = (cfg.backends.len() * cfg.pages.len() * cfg.trials) as u64;
    let progress = Progress::new(total, name);
    let mut series = Vec::new();
    for &b in &cfg.backends {
        let label = match b {
            RvmBackend::Pool | RvmBackend::PoolMirrored => placement.label(b.label()),
            RvmBackend::Redis | RvmBackend::File => b.label().to_string(),
        };
        let mut s = Series::new(label);
        for &pages in &cfg.pages {
            progress.set_message(&format!("{} · {pages} pages", b.label()));
            s.points
                .push(measure(b, pages, cfg.trials, what, &progress, &placement)?);
        }
        series.push(s);
    }
    progress.finish();
    let config = json!({
        "x": "pages",
        "page_bytes": PAGE_BYTES,
        "backends": cfg.backends.iter().map(|b| b.label()).collect::<Vec<_>>(),
        "pages": cfg.pages,
        "trials": cfg.trials,
        "fresh_backend_per_trial": true,
        "commits_per_trial": if what == Experiment::Commit {
            json!(format!("{} MiB of pages per trial, 1..={COMMITS_PER_TRIAL_MAX} commits", COMMIT_BYTES_PER_TRIAL >> 20))
        } else { json!(1) },
        "recovery_replays_log": what == Experiment::Recovery,
        "servers": "camelot server processes (or an in-process dev cluster, when labelled), redis-server and a temp dir, fresh per trial on this machine",
        "sides": sides_json(&sides(cfg, &placement)),
        "quick": cfg.quick,
        "peers": peers.to_json(),
    });
    let (ratio_json, comparisons) = ratios(&series, &peers, what);
    let mut config = config;
    config["ratios"] = ratio_json;
    let mut result = BenchResult::new(name, started, config, series);
    result.comparisons = comparisons;
    if let Some(p50) = peers.sockperf_p50_us {
        result.references.push(Reference {
            label: "TCP round trip (sockperf p50)".into(),
            metric: "latency_us.p50".into(),
            value: p50,
        });
    }
    Ok(output::write_result_with_figure(
        out,
        &result,
        &figure(&result, what),
    )?)
}

/// How each backend's servers ran, for `config["sides"]`.
fn sides(cfg: &RvmBenchConfig, placement: &Placement) -> Vec<Side> {
    let client = |data_model: &str| ClientSide {
        client: "camelot-rvm (one committing thread)".into(),
        client_threads: 1,
        depth: 1,
        data_model: data_model.into(),
        resp_face: false,
    };
    let spec = pool_spec(cfg.pages.iter().copied().max().unwrap_or(1));
    let mut sides = Vec::new();
    for &b in &cfg.backends {
        match b {
            RvmBackend::Pool | RvmBackend::PoolMirrored => {
                let mut spec = spec.clone();
                if b == RvmBackend::PoolMirrored {
                    spec.nodes = 2;
                }
                sides.push(camelot_side(
                    &spec,
                    placement,
                    &placement.label(b.label()),
                    client("log region + catalog + one home region per segment"),
                ));
            }
            RvmBackend::Redis => sides.push(Side {
                label: b.label().into(),
                server: "redis-server".into(),
                process: "separate".into(),
                server_threads: Some(1),
                nodes: 1,
                version: RedisServer::version().unwrap_or_else(|e| format!("unknown: {e}")),
                flags: ["--save", "", "--appendonly", "no"]
                    .map(String::from)
                    .to_vec(),
                command: "redis-server --port PORT --bind 127.0.0.1 --save \"\" --appendonly no"
                    .into(),
                client: client("one key per log record, one per page of a home (SETRANGE)"),
            }),
            RvmBackend::File => sides.push(Side {
                label: b.label().into(),
                server: "local file system".into(),
                process: "in-process".into(),
                server_threads: None,
                nodes: 1,
                version: "fdatasync per call".into(),
                flags: Vec::new(),
                command: "files in a temporary directory".into(),
                client: client("log, two catalogs, one file per segment home"),
            }),
        }
    }
    sides
}

fn figure(result: &BenchResult, what: Experiment) -> Figure {
    let (title, y) = match what {
        Experiment::Commit => ("RVM commit time vs pages modified", "commit time p50 (µs)"),
        Experiment::Recovery => ("RVM recovery time vs pages", "recovery time p50 (µs)"),
    };
    let mut time = Panel::new("time", "pages", y).log_x().log_y();
    let mut per_page = Panel::new("per page", "pages", "µs per page (p50)")
        .log_x()
        .log_y();
    for s in &result.series {
        time = time.line(
            &s.label,
            series_points(s, |p| p.latency_us.as_ref().map(|l| l.p50)),
        );
        per_page = per_page.line(
            &s.label,
            series_points(s, |p| {
                p.extra.get("per_page_us_p50").and_then(Value::as_f64)
            }),
        );
    }
    for r in result
        .references
        .iter()
        .filter(|r| r.metric == "latency_us.p50")
    {
        time = time.reference(&r.label, r.value);
    }
    Figure::new(title).panel(time).panel(per_page)
}

pub fn run_commit(cfg: &RvmBenchConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    run(cfg, out, Experiment::Commit)
}

pub fn run_recovery(cfg: &RvmBenchConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    run(cfg, out, Experiment::Recovery)
}

/// One line per ratio in a result's config: name, value, limit, met or not.
pub fn ratio_lines(result: &BenchResult) -> Vec<String> {
    let Some(Value::Object(r)) = result.config.get("ratios") else {
        return Vec::new();
    };
    r.iter()
        .map(|(name, v)| {
            let ratio = v.get("ratio").and_then(Value::as_f64).unwrap_or(f64::NAN);
            let limit = v.get("limit").and_then(Value::as_f64).unwrap_or(f64::NAN);
            let met = v.get("met").and_then(Value::as_bool).unwrap_or(false);
            format!(
                "{name}: {ratio:.2} (target ≤ {limit}) {}",
                if met { "met" } else { "NOT met" }
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(path: &Path, bench: &str, backends: &[RvmBackend], pages: &[u64]) -> BenchResult {
        let r = output::read_result(path).expect("result reads back");
        assert_eq!(r.bench, bench);
        assert_eq!(r.config["x"], "pages");
        let labels: Vec<&str> = r.series.iter().map(|s| s.label.as_str()).collect();
        // The unit tests run the pool in process (no camelot binary here), which every
        // label of a pool series must say.
        let want: Vec<String> = backends
            .iter()
            .map(|b| match b {
                RvmBackend::Pool | RvmBackend::PoolMirrored => {
                    Placement::InProcess.label(b.label())
                }
                _ => b.label().to_string(),
            })
            .collect();
        assert_eq!(labels, want);
        for b in backends {
            let side = &r.config["sides"][&want[backends.iter().position(|x| x == b).unwrap_or(0)]];
            assert!(side["process"].is_string(), "{side}");
        }
        for s in &r.series {
            let xs: Vec<f64> = s.points.iter().filter_map(|p| p.x.as_f64()).collect();
            assert_eq!(xs, pages.iter().map(|p| *p as f64).collect::<Vec<_>>());
            for p in &s.points {
                let l = p.latency_us.as_ref().expect("latency");
                assert!(l.p50 > 0.0 && l.max >= l.p50, "{}: {l:?}", s.label);
            }
        }
        assert!(
            r.config["peers"]["iperf3_bytes_per_sec"]
                .as_f64()
                .unwrap_or(0.0)
                > 0.0
        );
        r
    }

    #[test]
    fn quick_commit_and_recovery_write_their_results() {
        let dir = crate::scratch_dir("rvm");
        let mut cfg = RvmBenchConfig::default();
        cfg.apply_quick();
        cfg.pages = vec![1, 100];
        cfg.in_process = true;
        let files = run_commit(&cfg, &dir).expect("rvm-commit --quick");
        assert!(files.iter().all(|f| f.exists()));
        let r = check(&files[0], "rvm-commit", &cfg.backends, &cfg.pages);
        assert!(
            r.config["peers"]["sockperf_tcp_pingpong_p50_us"]
                .as_f64()
                .unwrap_or(0.0)
                > 0.0
        );
        assert!(r.config["ratios"]["pool_commit_1_page_vs_sockperf_p50"]["ratio"].is_number());
        assert_eq!(
            r.config["sides"]["pool (in-process)"]["process"],
            "in-process"
        );
        assert_eq!(r.config["sides"]["redis"]["process"], "separate");
        let c = r
            .comparisons
            .iter()
            .find(|c| c.peer_label == "sockperf TCP ping-pong p50")
            .expect("the one-page commit is compared with sockperf");
        assert!(c.camelot > 0.0 && c.peer > 0.0 && c.target == Some(3.0) && c.at_most);
        assert!(r.references.iter().any(|x| x.metric == "latency_us.p50"));
        assert!(!ratio_lines(&r).is_empty());
        cfg.backends = vec![RvmBackend::Pool, RvmBackend::File];
        let files = run_recovery(&cfg, &dir).expect("rvm-recovery --quick");
        check(&files[0], "rvm-recovery", &cfg.backends, &cfg.pages);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_configs_are_refused() {
        assert!(RvmBackend::parse("nfs").is_err());
        for c in [
            RvmBenchConfig {
                backends: vec![],
                ..Default::default()
            },
            RvmBenchConfig {
                pages: vec![0],
                ..Default::default()
            },
            RvmBenchConfig {
                pages: vec![PAGES_MAX + 1],
                ..Default::default()
            },
            RvmBenchConfig {
                trials: 0,
                ..Default::default()
            },
        ] {
            assert!(matches!(c.validate(), Err(BenchError::InvalidConfig(_))));
        }
    }
}
