//! `camelot bench api`: the request API's performance targets, each measured beside the
//! peer it is judged against (iperf3, redis-benchmark, sockperf) in the same run, because
//! on a shared 2-core machine only a same-run ratio means anything.
//!
//! Like is compared with like: a 64 B region READ against a Redis GET of a 64 B value,
//! with the client's drivers × depth matching redis-benchmark's `-c` × `-P`; payload
//! counted in one direction (what the READs bring back) against one iperf3 stream in that
//! direction (`iperf3 -R`: the server sends). The Camelot server is a `camelot server`
//! process like redis-server (`--in-process` puts it in the bench, labelled), and both
//! servers' CPU seconds are metered over the small-request runs.

use crate::hw::limits::{Against, Limits};
use crate::peers::{self, StreamDirection};
use crate::progress::Progress;
use crate::side::{sides_json, CamelotSpec, ClientSide, CpuMeter, Side};
use crate::workload::{self, LoadSpec, Measured, Mix, Target};
use crate::BenchError;
use camelot_client::{Client, ClientConfig, Region};
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series, X};
use camelot_testkit::RedisServer;
use serde_json::json;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Seconds each peer measurement runs.
    pub peer_seconds: u64,
    /// Requests for each Camelot throughput point.
    pub requests: u64,
    /// Requests for the single-thread latency point.
    pub latency_requests: u64,
    /// Thread counts of the no-collapse sweep.
    pub sweep_threads: Vec<usize>,
    /// Requests per point of the sweep.
    pub sweep_requests: u64,
    /// Each peer/Camelot pair is measured this many times, alternating; the median
    /// ratio is reported, so one burst of noise from a neighbour does not decide a check.
    pub rounds: usize,
    pub quick: bool,
    /// This machine's limits: the stream and latency checks and the sweep's points then
    /// record their fraction of them, and the figure's references include them.
    pub limits: Option<Limits>,
    /// The Camelot server inside the bench process instead of a `camelot server`
    /// process (labelled; no server CPU seconds).
    pub in_process: bool,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            peer_seconds: 5,
            requests: 1_000_000,
            latency_requests: 100_000,
            sweep_threads: vec![1, 2, 4, 8, 16, 32, 64],
            sweep_requests: 400_000,
            rounds: 3,
            quick: false,
            limits: None,
            in_process: false,
        }
    }
}

impl ApiConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.peer_seconds = 1;
        self.requests = self.requests.min(60_000);
        self.latency_requests = self.latency_requests.min(5_000);
        self.sweep_threads = vec![1, 8, 64];
        self.sweep_requests = self.sweep_requests.min(20_000);
        self.rounds = 1;
    }
}

/// A peer's figure drawn as a line on the result's figure.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerLine {
    pub label: &'static str,
    /// `bytes_per_sec`, `ops_per_sec` or `latency_us.p50`.
    pub metric: &'static str,
    /// From the check's unit to the metric's (1e9 for GB/s → B/s).
    pub factor: f64,
}

/// One target: what Camelot reached, what the peer reached, and the rule between them.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub camelot: f64,
    pub peer: f64,
    pub unit: &'static str,
    pub ratio: f64,
    /// The ratio must be at least this (or at most, when `at_most`); `None`: reported
    /// beside the targets, judged by none.
    pub bound: Option<f64>,
    pub at_most: bool,
    /// Which peer, in a few words (`iperf3 -R`, `redis-server`).
    pub peer_label: &'static str,
    pub peer_command: String,
    /// The ratio of every round (the reported one is their median).
    pub round_ratios: Vec<f64>,
    /// The machine limit the Camelot figure is read against, and the factor from the
    /// check's unit to the limit's.
    pub against: Option<(Against, f64)>,
    /// The peer's figure as a line on the figure.
    pub reference: Option<PeerLine>,
}

impl Check {
    /// Whether the target is met; `None` without a target.
    pub fn met(&self) -> Option<bool> {
        let bound = self.bound?;
        Some(if self.at_most {
            self.ratio <= bound
        } else {
            self.ratio >= bound
        })
    }

    /// The check as the schema's comparison (ratio: the median of the rounds').
    pub fn comparison(&self) -> Comparison {
        let mut c = Comparison::new(
            self.name,
            self.camelot,
            self.peer,
            self.unit,
            self.peer_label,
        );
        c.ratio = self.ratio;
        match self.bound {
            Some(b) => c.with_target(b, self.at_most),
            None => c,
        }
    }
}

const REGION_BYTES: u64 = 64 << 20;
/// The small-request comparison's load: redis-benchmark's `-c` connections × `-P`
/// pipeline, and Camelot's drivers × depth, both 16 × 16 = 256 requests in flight.
const SMALL_BYTES: u32 = 64;
const SMALL_DRIVERS: usize = 16;
const SMALL_DEPTH: usize = 16;
/// The stream comparison's load: 4 KiB READs, 8 drivers × 16.
const BULK_BYTES: u32 = 4096;
const BULK_DRIVERS: usize = 8;
const BULK_DEPTH: usize = 16;
/// SETs of the one key redis-benchmark's GETs read, so each GET returns a 64 B value.
const REDIS_PRELOAD_REQUESTS: u64 = 1000;
/// Each point of the no-collapse sweep runs at least this long (see `threads`).
const SWEEP_POINT_DURATION_MIN: Duration = Duration::from_secs(1);

/// Runs every check; returns the files written and a printable table.
pub fn run(cfg: &ApiConfig, out: &Path) -> Result<(Vec<PathBuf>, String), BenchError> {
    if cfg.rounds == 0 || cfg.rounds > ROUNDS_MAX {
        return Err(BenchError::InvalidConfig(format!(
            "rounds must be 1..={ROUNDS_MAX}"
        )));
    }
    let started = now_rfc3339();
    let steps = 6 * cfg.rounds as u64 + 2 * cfg.sweep_threads.len() as u64;
    let progress = Progress::new(steps, "api");
    let target = Target::open(
        &[],
        &CamelotSpec::new(1, REGION_BYTES + (1 << 20)),
        cfg.in_process,
    )?;
    let batched = target.connect(true)?;
    let unbatched = target.connect(false)?;
    let regions = workload::regions_on_every_node(&batched, REGION_BYTES)?;
    // One redis-server for every round: idle, it sleeps in epoll and costs nothing.
    let redis = RedisServer::start()?;
    let redis_version = RedisServer::version()?;
    peers::redis_benchmark(
        redis.addr(),
        &[
            "-t",
            "set",
            "-d",
            &SMALL_BYTES.to_string(),
            "-n",
            &REDIS_PRELOAD_REQUESTS.to_string(),
        ],
    )?;
    let mut rounds = Vec::with_capacity(cfg.rounds);
    for round in 0..cfg.rounds {
        let env = Round {
            cfg,
            target: &target,
            batched: &batched,
            unbatched: &unbatched,
            regions: &regions,
            redis: &redis,
            progress: &progress,
            round,
        };
        rounds.push(env.run()?);
    }
    let mut checks = median_checks(rounds);

    let mut sweeps = Vec::new();
    for depth in [1usize, 16] {
        let mut s = Series::new(target.label(&format!("depth {depth}")));
        for &t in &cfg.sweep_threads {
            progress.set_message(&format!("sweep: {t} threads × {depth}"));
            let m = load(
                &target,
                &batched,
                &regions,
                Drivers::Threads(t),
                depth,
                cfg.sweep_requests,
                SWEEP_POINT_DURATION_MIN,
                BULK_BYTES,
            )?;
            progress.inc(1);
            let mut p = Point::new(t);
            p.ops_per_sec = Some(m.ops_per_sec());
            p.bytes_per_sec = Some(m.read_bytes_per_sec());
            p.latency_us = Some(m.latency.summary());
            for (k, v) in m.cpu_extra() {
                p.extra.insert(k.into(), v);
            }
            if let Some(l) = &cfg.limits {
                l.annotate_network_point(&mut p);
            }
            s.points.push(p);
        }
        let peak = s
            .points
            .iter()
            .filter_map(|p| p.ops_per_sec)
            .fold(0.0, f64::max);
        let last = s.points.last().and_then(|p| p.ops_per_sec).unwrap_or(0.0);
        let most = cfg.sweep_threads.last().copied().unwrap_or(0);
        let mut c = ratio_check(
            if depth == 1 {
                "no collapse: ops/s at the most threads vs peak, depth 1"
            } else {
                "no collapse: ops/s at the most threads vs peak, depth 16"
            },
            last / 1e3,
            peak / 1e3,
            "kops/s",
            Some(0.9),
            "camelot, its own peak",
            format!("peak over {:?} threads; last = {most}", cfg.sweep_threads),
        );
        c.ratio = last / peak.max(f64::MIN_POSITIVE);
        checks.push(c);
        sweeps.push(s);
    }
    progress.finish();
    workload::free_all(&batched, &regions)?;
    drop((batched, unbatched));
    let sides = sides(&target, &redis, redis_version)?;
    let servers = target.describe();
    drop(redis);
    target.close()?;

    let mut camelot = Series::new("camelot");
    let mut peer = Series::new("peer");
    for (i, c) in checks.iter().enumerate() {
        let mut p = Point::new(X::Label(c.name.to_owned()));
        p.extra.insert("value".into(), json!(c.camelot));
        p.extra.insert("unit".into(), json!(c.unit));
        p.extra.insert("ratio".into(), json!(c.ratio));
        if let (Some(bound), Some(met)) = (c.bound, c.met()) {
            p.extra.insert(
                "target".into(),
                json!(format!("{} {bound}", if c.at_most { "≤" } else { "≥" })),
            );
            p.extra.insert("met".into(), json!(met));
        }
        if !c.round_ratios.is_empty() {
            p.extra.insert("round_ratios".into(), json!(c.round_ratios));
        }
        p.extra.insert("index".into(), json!(i));
        if let (Some(l), Some((against, unit))) = (&cfg.limits, c.against) {
            l.annotate(&mut p.extra, against, c.camelot * unit);
        }
        camelot.points.push(p);
        let mut q = Point::new(X::Label(c.name.to_owned()));
        q.extra.insert("value".into(), json!(c.peer));
        q.extra.insert("unit".into(), json!(c.unit));
        q.extra.insert("command".into(), json!(c.peer_command));
        peer.points.push(q);
    }
    let mut series = vec![camelot, peer];
    series.extend(sweeps);
    let config = json!({
        "x": "check",
        "peer_seconds": cfg.peer_seconds,
        "requests": cfg.requests,
        "latency_requests": cfg.latency_requests,
        "sweep_threads": cfg.sweep_threads,
        "sweep_requests": cfg.sweep_requests,
        "rounds": cfg.rounds,
        "process": servers["process"],
        "servers": servers,
        "sides": sides_json(&sides),
        // Where each driver ran: OS threads pinned round-robin to cores; the event-loop
        // tasks on the calling thread, unpinned.
        "pinned": { "threads": true, "event_loop": false },
        "connections_per_node": ClientConfig::default().connections_per_node,
        "stream_direction": "server to client: READ payloads, against iperf3 -R",
        "sweep": format!("{BULK_BYTES} B READs, batched; bytes_per_sec is the payload read back"),
        "quick": cfg.quick,
        "limits": cfg.limits,
    });
    let mut result = BenchResult::new("api", started, config, series);
    result.comparisons = checks.iter().map(Check::comparison).collect();
    result.references = references(&checks, cfg.limits.as_ref());
    let written = output::write_result_with_figure(out, &result, &sweep_figure(&result))?;
    let mut printed = table(&checks);
    if let Some(l) = &cfg.limits {
        printed.push_str(&limits_lines(&checks, l));
    }
    Ok((written, printed))
}

/// Each side of the small-request and stream comparisons, for `config["sides"]`.
fn sides(target: &Target, redis: &RedisServer, version: String) -> Result<Vec<Side>, BenchError> {
    let nodes = target
        .nodes()
        .ok_or_else(|| BenchError::Setup("the api bench starts its own server".into()))?;
    let threads = "camelot-client, OS threads pinned round-robin";
    let event_loop = "camelot-client LoopClient, tasks on one unpinned event-loop thread";
    let small = format!("{SMALL_BYTES} B region READ");
    let mut sides = vec![
        nodes.side(
            &target.label(&format!("camelot, {SMALL_DRIVERS} threads × {SMALL_DEPTH}")),
            ClientSide {
                client: threads.into(),
                client_threads: SMALL_DRIVERS,
                depth: SMALL_DEPTH,
                data_model: small.clone(),
                resp_face: false,
            },
        ),
        nodes.side(
            &target.label(&format!(
                "camelot, event loop {SMALL_DRIVERS} tasks × {SMALL_DEPTH}"
            )),
            ClientSide {
                client: event_loop.into(),
                client_threads: 1,
                depth: SMALL_DRIVERS * SMALL_DEPTH,
                data_model: small,
                resp_face: false,
            },
        ),
        nodes.side(
            &target.label(&format!(
                "camelot, {BULK_DRIVERS} threads × {BULK_DEPTH}, {BULK_BYTES} B"
            )),
            ClientSide {
                client: threads.into(),
                client_threads: BULK_DRIVERS,
                depth: BULK_DEPTH,
                data_model: format!("{BULK_BYTES} B region READ"),
                resp_face: false,
            },
        ),
    ];
    sides.push(Side::peer(
        "redis",
        redis.process(),
        version,
        Some(1),
        Vec::new(),
        ClientSide {
            client: format!(
                "redis-benchmark -c {SMALL_DRIVERS} -P {SMALL_DEPTH}, one thread (all its \
                 connections on one event loop)"
            ),
            client_threads: 1,
            depth: SMALL_DRIVERS * SMALL_DEPTH,
            data_model: format!("{SMALL_BYTES} B string, GET of one key"),
            resp_face: true,
        },
    ));
    Ok(sides)
}

/// The peers' figures and the machine's limits as lines the figure draws (one per
/// label: the threaded and event-loop checks share their peer's figure).
fn references(checks: &[Check], limits: Option<&Limits>) -> Vec<Reference> {
    let mut refs: Vec<Reference> = Vec::new();
    for c in checks {
        let Some(line) = &c.reference else { continue };
        if refs.iter().any(|r| r.label == line.label) {
            continue;
        }
        refs.push(Reference {
            label: line.label.into(),
            metric: line.metric.into(),
            value: c.peer * line.factor,
        });
    }
    if let Some(l) = limits {
        refs.extend(crate::threads::limit_references(l));
    }
    refs
}

/// One line per check that has a machine limit to be read against.
fn limits_lines(checks: &[Check], limits: &Limits) -> String {
    let mut s = String::new();
    for c in checks {
        let Some((against, unit)) = c.against else {
            continue;
        };
        if let Some(read) = limits.describe(against, c.camelot * unit) {
            let _ = writeln!(s, "- {}: {:.2} {} = {read}", c.name, c.camelot, c.unit);
        }
    }
    s
}

/// What one round works with.
struct Round<'a> {
    cfg: &'a ApiConfig,
    target: &'a Target,
    batched: &'a Client,
    unbatched: &'a Client,
    regions: &'a [Region],
    redis: &'a RedisServer,
    progress: &'a Progress,
    round: usize,
}

impl Round<'_> {
    fn tag(&self, what: &str) -> String {
        format!("round {} · {what}", self.round + 1)
    }

    fn load(
        &self,
        client: &Client,
        drivers: Drivers,
        depth: usize,
        requests: u64,
        min_duration: Duration,
        size: u32,
    ) -> Result<Measured, BenchError> {
        load(
            self.target,
            client,
            self.regions,
            drivers,
            depth,
            requests,
            min_duration,
            size,
        )
    }

    /// One pass over the peer/Camelot pairs, each peer measured right before its Camelot
    /// counterpart.
    fn run(&self) -> Result<Vec<Check>, BenchError> {
        let cfg = self.cfg;
        let (progress, batched, unbatched) = (self.progress, self.batched, self.unbatched);
        let peer_time = Duration::from_secs(cfg.peer_seconds.max(1));
        let mut checks = Vec::new();

        progress.set_message(&self.tag("iperf3 -R vs 4 KiB READs × 8 threads × 16"));
        let stream = peers::iperf3_tcp_stream_in(peer_time, StreamDirection::ServerToClient)?;
        // At least as long as the stream it is set against.
        let bulk = |drivers| {
            self.load(
                batched,
                drivers,
                BULK_DEPTH,
                cfg.requests,
                peer_time,
                BULK_BYTES,
            )
        };
        let bulk_threads = bulk(Drivers::Threads(BULK_DRIVERS))?;
        progress.inc(1);
        checks.push(stream_check(
            "4 KiB READs, 8 thr × depth 16: bytes read back vs iperf3 -R, one stream",
            &bulk_threads,
            &stream,
        ));

        progress.set_message(&self.tag("redis-benchmark GET vs 64 B READs × 16 threads × 16"));
        let redis_requests = cfg.requests * 2;
        let meter = CpuMeter::start(vec![self.redis.process().pid()]);
        let get = peers::redis_benchmark(
            self.redis.addr(),
            &[
                "-t",
                "get",
                "-d",
                &SMALL_BYTES.to_string(),
                "-c",
                &SMALL_DRIVERS.to_string(),
                "-P",
                &SMALL_DEPTH.to_string(),
                "-n",
                &redis_requests.to_string(),
            ],
        )?;
        let redis_cpu = Efficiency::of(redis_requests, meter.seconds());
        // The same request count as redis-benchmark's -n, as it runs: no time floor.
        let small = |client, drivers, requests| {
            self.load(
                client,
                drivers,
                SMALL_DEPTH,
                requests,
                Duration::ZERO,
                SMALL_BYTES,
            )
        };
        let reads_batched = small(batched, Drivers::Threads(SMALL_DRIVERS), redis_requests)?;
        progress.inc(1);
        checks.push(redis_check(
            "64 B READs, 16 thr × depth 16, vs redis-benchmark GET of 64 B, -c 16 -P 16",
            &reads_batched,
            &get,
        ));
        checks.extend(efficiency_check(
            "64 B READs, 16 thr × depth 16: ops per server CPU-second vs redis-server GET",
            &reads_batched,
            redis_cpu,
            &get,
        ));
        progress.set_message(&self.tag("64 B READs × 16 threads × 16, unbatched"));
        let reads_unbatched = small(unbatched, Drivers::Threads(SMALL_DRIVERS), cfg.requests / 2)?;
        progress.inc(1);
        checks.push(batching_check(
            "64 B READs, 16 thr × depth 16, batched vs unbatched",
            &reads_batched,
            &reads_unbatched,
            "camelot, batching off",
        ));

        // The same loads from tasks on one event-loop thread: redis-benchmark drives its
        // 16 connections from one such thread, so this is the like-for-like client.
        progress.set_message(&self.tag("64 B READs × 16 tasks × 16 on one event loop"));
        let reads_loop = small(batched, Drivers::Tasks(SMALL_DRIVERS), redis_requests)?;
        let reads_loop_unbatched =
            small(unbatched, Drivers::Tasks(SMALL_DRIVERS), cfg.requests / 2)?;
        progress.inc(1);
        checks.push(redis_check(
            "event loop: 64 B READs, 16 tasks × depth 16, vs redis-benchmark GET of 64 B, -c 16 -P 16",
            &reads_loop,
            &get,
        ));
        checks.extend(efficiency_check(
            "event loop: 64 B READs, 16 tasks × depth 16: ops per server CPU-second vs redis-server GET",
            &reads_loop,
            redis_cpu,
            &get,
        ));
        checks.push(batching_check(
            "event loop: 64 B READs, 16 tasks × depth 16, batched vs unbatched",
            &reads_loop,
            &reads_loop_unbatched,
            "camelot event loop, batching off",
        ));
        progress.set_message(&self.tag("4 KiB READs × 8 tasks × 16 on one event loop"));
        let bulk_loop = bulk(Drivers::Tasks(BULK_DRIVERS))?;
        progress.inc(1);
        checks.push(stream_check(
            "event loop: 4 KiB READs, 8 tasks × depth 16: bytes read back vs iperf3 -R, one stream",
            &bulk_loop,
            &stream,
        ));

        progress.set_message(&self.tag("sockperf ping-pong vs 64 B × 1 thread × 1"));
        let pingpong = peers::sockperf_tcp_pingpong(peer_time, SMALL_BYTES)?;
        let one = self.load(
            unbatched,
            Drivers::Threads(1),
            1,
            cfg.latency_requests,
            peer_time,
            SMALL_BYTES,
        )?;
        progress.inc(1);
        let mut c = ratio_check(
            "64 B READs, 1 thr × depth 1, unbatched: p50 vs sockperf TCP ping-pong",
            one.latency.summary().p50,
            pingpong.latency_us.p50,
            "µs p50",
            Some(1.3),
            "sockperf",
            pingpong.command,
        );
        c.at_most = true;
        c.against = Some((Against::TcpPingpongP50, 1.0));
        c.reference = Some(PeerLine {
            label: "sockperf TCP ping-pong p50",
            metric: "latency_us.p50",
            factor: 1.0,
        });
        checks.push(c);
        Ok(checks)
    }
}

/// A load's payload read back against iperf3's stream in the same direction (target
/// ≥ 0.7), read against the limit.
fn stream_check(name: &'static str, m: &Measured, stream: &peers::PeerStream) -> Check {
    let mut c = ratio_check(
        name,
        m.read_bytes_per_sec() / 1e9,
        stream.bytes_per_sec / 1e9,
        "GB/s",
        Some(0.7),
        "iperf3 -R",
        stream.command.clone(),
    );
    c.against = Some((Against::TcpStream, 1e9));
    c.reference = Some(PeerLine {
        label: "iperf3 -R, one TCP stream",
        metric: "bytes_per_sec",
        factor: 1e9,
    });
    c
}

/// A load's request rate against redis-benchmark's GETs (target ≥ 2).
fn redis_check(name: &'static str, m: &Measured, get: &peers::PeerRate) -> Check {
    let mut c = ratio_check(
        name,
        m.ops_per_sec() / 1e3,
        get.ops_per_sec / 1e3,
        "kops/s",
        Some(2.0),
        "redis-server",
        get.command.clone(),
    );
    c.reference = Some(PeerLine {
        label: "redis-benchmark GET -c 16 -P 16 (redis-server)",
        metric: "ops_per_sec",
        factor: 1e3,
    });
    c
}

/// Requests served per server CPU-second, when the server was a process of its own and
/// spent enough CPU time for the figure to be set against another server's.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Efficiency(Option<f64>);

impl Efficiency {
    fn of(requests: u64, server_cpu_seconds: Option<f64>) -> Efficiency {
        Efficiency(
            server_cpu_seconds
                .filter(|&c| c >= workload::CPU_SECONDS_FOR_RATIO_MIN)
                .map(|c| requests as f64 / c),
        )
    }
}

/// Camelot's ops per server CPU-second against Redis's over the same kind of load; no
/// target (the issue sets none), but beside the throughput it says what the throughput
/// cost. Left out when either server could not be metered.
fn efficiency_check(
    name: &'static str,
    m: &Measured,
    redis: Efficiency,
    get: &peers::PeerRate,
) -> Option<Check> {
    let camelot = Efficiency::of(m.requests, m.server_cpu_seconds).0?;
    let redis = redis.0?;
    Some(ratio_check(
        name,
        camelot / 1e3,
        redis / 1e3,
        "kops/CPU-s",
        None,
        "redis-server",
        get.command.clone(),
    ))
}

/// Batching on against off (target ≥ 3).
fn batching_check(name: &'static str, on: &Measured, off: &Measured, peer: &'static str) -> Check {
    ratio_check(
        name,
        on.ops_per_sec() / 1e3,
        off.ops_per_sec() / 1e3,
        "kops/s",
        Some(3.0),
        peer,
        peer.into(),
    )
}

/// Most rounds one run may ask for.
pub const ROUNDS_MAX: usize = 20;

/// Folds the rounds into one check each, by name in the first round's order: the median
/// ratio, and the median values, over the rounds that have it.
fn median_checks(rounds: Vec<Vec<Check>>) -> Vec<Check> {
    let mut names: Vec<&'static str> = Vec::new();
    for c in rounds.iter().flatten() {
        if !names.contains(&c.name) {
            names.push(c.name);
        }
    }
    let median = |v: &[f64]| crate::hw::median(v).unwrap_or(f64::NAN);
    names
        .into_iter()
        .filter_map(|name| {
            let all: Vec<&Check> = rounds.iter().flatten().filter(|c| c.name == name).collect();
            let mut c = (*all.first()?).clone();
            c.round_ratios = all.iter().map(|r| r.ratio).collect();
            c.ratio = median(&c.round_ratios);
            c.camelot = median(&all.iter().map(|r| r.camelot).collect::<Vec<_>>());
            c.peer = median(&all.iter().map(|r| r.peer).collect::<Vec<_>>());
            Some(c)
        })
        .collect()
}

/// How a load is driven: OS threads on the threaded client, or tasks on one event-loop
/// thread through the client's `LoopClient` face.
#[derive(Clone, Copy, PartialEq)]
enum Drivers {
    Threads(usize),
    Tasks(usize),
}

/// READs only: every byte counted travels one way, server to client. At least
/// `requests`, and for at least `min_duration`.
#[allow(clippy::too_many_arguments)]
fn load(
    target: &Target,
    client: &Client,
    regions: &[Region],
    drivers: Drivers,
    depth: usize,
    requests: u64,
    min_duration: Duration,
    size: u32,
) -> Result<Measured, BenchError> {
    let (Drivers::Threads(threads) | Drivers::Tasks(threads)) = drivers;
    let spec = LoadSpec {
        threads,
        depth,
        requests,
        min_duration,
        mix: Mix {
            reads_percent: 100,
            fetch_add_percent: 0,
        },
        sizes_bytes: vec![size],
        pin: matches!(drivers, Drivers::Threads(_)),
        event_loop: matches!(drivers, Drivers::Tasks(_)),
        seed: (threads * 1000 + depth) as u64,
    };
    target.run_load(client, regions, &spec, None)
}

fn ratio_check(
    name: &'static str,
    camelot: f64,
    peer: f64,
    unit: &'static str,
    bound: Option<f64>,
    peer_label: &'static str,
    peer_command: String,
) -> Check {
    Check {
        name,
        camelot,
        peer,
        unit,
        ratio: camelot / peer.max(f64::MIN_POSITIVE),
        bound,
        at_most: false,
        peer_label,
        peer_command,
        round_ratios: Vec::new(),
        against: None,
        reference: None,
    }
}

/// The checks as a Markdown table (it goes into BENCHMARKS.md as printed).
pub fn table(checks: &[Check]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| check | camelot | peer | ratio (median) | ratio per round | target | met |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---|---:|---|");
    for c in checks {
        let (target, met) = match (c.bound, c.met()) {
            (Some(b), Some(met)) => (
                format!("{} {b}", if c.at_most { "≤" } else { "≥" }),
                if met { "yes" } else { "**no**" },
            ),
            _ => ("—".to_string(), "—"),
        };
        let _ = writeln!(
            s,
            "| {} | {:.2} {} | {:.2} {} | {:.2} | {} | {target} | {met} |",
            c.name,
            c.camelot,
            c.unit,
            c.peer,
            c.unit,
            c.ratio,
            c.round_ratios
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    let _ = writeln!(s);
    let mut listed: Vec<&str> = Vec::new();
    for c in checks {
        let is_program =
            !c.peer_command.starts_with("camelot") && !c.peer_command.starts_with("peak");
        if is_program && !listed.contains(&c.peer_command.as_str()) {
            listed.push(&c.peer_command);
            let _ = writeln!(s, "- {}: `{}`", c.peer_label, c.peer_command);
        }
    }
    s
}

/// Read throughput against threads at depth 1 and 16, the no-collapse checks.
fn sweep_figure(result: &BenchResult) -> Figure {
    let mut panel = Panel::new(
        "4 KiB READs, batched",
        "client threads",
        "payload read back (MB/s)",
    );
    for s in result
        .series
        .iter()
        .filter(|s| s.label.starts_with("depth"))
    {
        let pts = series_points(s, |p| p.bytes_per_sec.map(|b| b / 1e6));
        panel = panel.line(&s.label, pts);
    }
    let panel = panel.references_from(result, "bytes_per_sec", 1e-6);
    Figure::new("Request API: no collapse with threads").panel(panel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_with_a_limit_are_read_against_it() {
        let mut stream = ratio_check(
            "stream",
            0.5,
            1.0,
            "GB/s",
            Some(0.7),
            "iperf3 -R",
            "iperf3".into(),
        );
        stream.against = Some((Against::TcpStream, 1e9));
        let mut latency = ratio_check(
            "p50",
            30.0,
            25.0,
            "µs p50",
            Some(1.3),
            "sockperf",
            "sockperf".into(),
        );
        latency.against = Some((Against::TcpPingpongP50, 1.0));
        let other = ratio_check(
            "batching",
            9.0,
            3.0,
            "kops/s",
            Some(3.0),
            "camelot",
            "camelot".into(),
        );
        let limits = Limits {
            tcp_stream_bytes_per_sec: Some(2e9),
            tcp_pingpong_us_p50: Some(20.0),
            ..Limits::default()
        };
        let lines = limits_lines(&[stream.clone(), latency, other], &limits);
        assert_eq!(
            lines,
            "- stream: 0.50 GB/s = 25% of this machine's TCP stream limit\n\
             - p50: 30.00 µs p50 = 1.50× this machine's TCP ping-pong p50\n"
        );
        assert_eq!(
            limits_lines(&[stream], &Limits::default()),
            "",
            "unmeasured"
        );
    }

    fn measured(requests: u64, read_bytes: u64, cpu: Option<f64>) -> Measured {
        Measured {
            requests,
            reads: requests,
            writes: 0,
            fetch_adds: 0,
            bytes: read_bytes,
            read_bytes,
            write_bytes: 0,
            elapsed: Duration::from_secs(1),
            latency: crate::latency::LatencyRecorder::new(),
            server_cpu_seconds: cpu,
            driver_requests_min: requests,
            driver_requests_max: requests,
        }
    }

    #[test]
    fn checks_become_comparisons_and_peers_become_lines() {
        let stream = peers::PeerStream {
            bytes_per_sec: 4e9,
            command: "iperf3 -R".into(),
        };
        let get = peers::PeerRate {
            ops_per_sec: 500e3,
            command: "redis-benchmark -t get".into(),
        };
        let checks = vec![
            stream_check(
                "stream, threads",
                &measured(1000, 2e9 as u64, None),
                &stream,
            ),
            stream_check("stream, loop", &measured(1000, 3e9 as u64, None), &stream),
            redis_check("get", &measured(1_000_000, 0, None), &get),
            ratio_check(
                "info",
                1.0,
                2.0,
                "kops/CPU-s",
                None,
                "redis-server",
                "x".into(),
            ),
        ];
        let comparisons: Vec<Comparison> = checks.iter().map(Check::comparison).collect();
        assert_eq!(comparisons[0].unit, "GB/s");
        assert_eq!(comparisons[0].ratio, 0.5);
        assert_eq!(comparisons[0].target, Some(0.7));
        assert_eq!(comparisons[0].met(), Some(false));
        assert_eq!(comparisons[0].peer_label, "iperf3 -R");
        assert_eq!(comparisons[2].ratio, 2.0);
        assert_eq!(comparisons[2].met(), Some(true));
        assert_eq!(comparisons[3].target, None, "reported, not judged");
        let limits = Limits {
            tcp_stream_bytes_per_sec: Some(5e9),
            ..Limits::default()
        };
        let refs = references(&checks, Some(&limits));
        let by_label: Vec<(&str, &str, f64)> = refs
            .iter()
            .map(|r| (r.label.as_str(), r.metric.as_str(), r.value))
            .collect();
        assert_eq!(
            by_label,
            [
                ("iperf3 -R, one TCP stream", "bytes_per_sec", 4e9),
                (
                    "redis-benchmark GET -c 16 -P 16 (redis-server)",
                    "ops_per_sec",
                    500e3
                ),
                ("TCP stream limit (limits.json)", "bytes_per_sec", 5e9),
            ],
            "one line per peer, in the metric's own unit"
        );
        let t = table(&checks);
        assert!(t.contains("| — | — |"), "{t}");
    }

    #[test]
    fn efficiency_needs_both_servers_metered() {
        let get = peers::PeerRate {
            ops_per_sec: 1.0,
            command: "redis-benchmark".into(),
        };
        let redis = Efficiency::of(200_000, Some(0.5));
        assert_eq!(redis, Efficiency(Some(400_000.0)));
        let c = efficiency_check("e", &measured(100_000, 0, Some(0.1)), redis, &get)
            .expect("both metered");
        assert_eq!((c.camelot, c.peer, c.ratio), (1000.0, 400.0, 2.5));
        assert!(efficiency_check("e", &measured(100_000, 0, None), redis, &get).is_none());
        assert!(efficiency_check("e", &measured(100_000, 0, Some(0.05)), redis, &get).is_none());
        assert!(efficiency_check(
            "e",
            &measured(100_000, 0, Some(1.0)),
            Efficiency::of(1, None),
            &get
        )
        .is_none());
    }

    #[test]
    fn rounds_fold_by_name_even_when_one_lacks_a_check() {
        let c = |name, ratio| {
            let mut c = ratio_check(name, ratio, 1.0, "x", Some(1.0), "p", "p".into());
            c.ratio = ratio;
            c
        };
        let folded = median_checks(vec![
            vec![c("a", 1.0), c("b", 5.0)],
            vec![c("a", 3.0)],
            vec![c("a", 2.0), c("b", 7.0)],
        ]);
        assert_eq!(folded.len(), 2);
        assert_eq!(folded[0].name, "a");
        assert_eq!(folded[0].ratio, 2.0);
        assert_eq!(folded[0].round_ratios, [1.0, 3.0, 2.0]);
        assert_eq!(folded[1].ratio, 6.0);
        assert_eq!(folded[1].camelot, 6.0);
    }
}
