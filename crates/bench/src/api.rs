//! `camelot bench api`: the request API's performance targets, each measured beside the
//! peer it is judged against (iperf3, redis-benchmark, sockperf) in the same run, because
//! on a shared 2-core machine only a same-run ratio means anything.

use crate::hw::limits::{Against, Limits};
use crate::progress::Progress;
use crate::workload::{self, LoadSpec, Measured, Mix, Target};
use crate::{peers, BenchError};
use camelot_client::{Client, Region};
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Series, X};
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
    /// record their fraction of them.
    pub limits: Option<Limits>,
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

/// One target: what Camelot reached, what the peer reached, and the rule between them.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub camelot: f64,
    pub peer: f64,
    pub unit: &'static str,
    pub ratio: f64,
    /// The ratio must be at least this (or at most, when `at_most`).
    pub bound: f64,
    pub at_most: bool,
    pub peer_command: String,
    /// The ratio of every round (the reported one is their median).
    pub round_ratios: Vec<f64>,
    /// The machine limit the Camelot figure is read against, and the factor from the
    /// check's unit to the limit's.
    pub against: Option<(Against, f64)>,
}

impl Check {
    pub fn met(&self) -> bool {
        if self.at_most {
            self.ratio <= self.bound
        } else {
            self.ratio >= self.bound
        }
    }
}

const REGION_BYTES: u64 = 64 << 20;

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
        &crate::side::CamelotSpec::new(1, REGION_BYTES + (1 << 20)),
        false,
    )?;
    let batched = target.connect(true)?;
    let unbatched = target.connect(false)?;
    let regions = workload::regions_on_every_node(&batched, REGION_BYTES)?;
    let mut rounds = Vec::with_capacity(cfg.rounds);
    for round in 0..cfg.rounds {
        rounds.push(one_round(
            cfg, &batched, &unbatched, &regions, &progress, round,
        )?);
    }
    let mut checks = median_checks(rounds);

    let mut sweeps = Vec::new();
    for depth in [1usize, 16] {
        let mut s = Series::new(format!("depth {depth}"));
        for &t in &cfg.sweep_threads {
            progress.set_message(&format!("sweep: {t} threads × {depth}"));
            let m = load(
                &batched,
                &regions,
                Drivers::Threads(t),
                depth,
                cfg.sweep_requests,
                50,
                4096,
            )?;
            progress.inc(1);
            let mut p = Point::new(t);
            p.ops_per_sec = Some(m.ops_per_sec());
            p.bytes_per_sec = Some(m.bytes_per_sec());
            p.latency_us = Some(m.latency.summary());
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
        checks.push(Check {
            name: if depth == 1 {
                "no collapse: ops/s at the most threads vs peak, depth 1"
            } else {
                "no collapse: ops/s at the most threads vs peak, depth 16"
            },
            camelot: last / 1e3,
            peer: peak / 1e3,
            unit: "kops/s",
            ratio: last / peak.max(f64::MIN_POSITIVE),
            bound: 0.9,
            at_most: false,
            peer_command: format!("peak over {:?} threads; last = {most}", cfg.sweep_threads),
            round_ratios: Vec::new(),
            against: None,
        });
        sweeps.push(s);
    }
    progress.finish();
    workload::free_all(&batched, &regions)?;
    drop((batched, unbatched));
    target.close()?;

    let mut camelot = Series::new("camelot");
    let mut peer = Series::new("peer");
    for (i, c) in checks.iter().enumerate() {
        let mut p = Point::new(X::Label(c.name.to_owned()));
        p.extra.insert("value".into(), json!(c.camelot));
        p.extra.insert("unit".into(), json!(c.unit));
        p.extra.insert("ratio".into(), json!(c.ratio));
        p.extra.insert(
            "target".into(),
            json!(format!("{} {}", if c.at_most { "≤" } else { "≥" }, c.bound)),
        );
        p.extra.insert("met".into(), json!(c.met()));
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
        "servers": "dev cluster of 1 (in process)",
        "quick": cfg.quick,
        "limits": cfg.limits,
    });
    let result = BenchResult::new("api", started, config, series);
    let written = output::write_result_with_figure(out, &result, &sweep_figure(&result))?;
    let mut printed = table(&checks);
    if let Some(l) = &cfg.limits {
        printed.push_str(&limits_lines(&checks, l));
    }
    Ok((written, printed))
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

/// One pass over the peer/Camelot pairs, each peer measured right before its Camelot
/// counterpart.
fn one_round(
    cfg: &ApiConfig,
    batched: &Client,
    unbatched: &Client,
    regions: &[Region],
    progress: &Progress,
    round: usize,
) -> Result<Vec<Check>, BenchError> {
    let peer_time = Duration::from_secs(cfg.peer_seconds.max(1));
    let tag = |what: &str| format!("round {} · {what}", round + 1);
    let mut checks = Vec::new();

    progress.set_message(&tag("iperf3 vs 4 KiB × 8 threads × 16"));
    let stream = peers::iperf3_tcp_stream(peer_time)?;
    // 4 KiB, half reads, 8 drivers × 16: the iperf3 comparison's load.
    let bulk_load = |drivers| load(batched, regions, drivers, 16, cfg.requests, 50, 4096);
    let bulk = bulk_load(Drivers::Threads(8))?;
    progress.inc(1);
    checks.push(stream_check(
        "4 KiB 50% reads, 8 thr × depth 16, vs iperf3 TCP stream",
        &bulk,
        &stream,
    ));

    progress.set_message(&tag("redis-benchmark GET vs 64 B × 16 threads × 16"));
    let redis = camelot_testkit::RedisServer::start()?;
    // GET of a missing key answers nil: set the key first so GETs return 64 bytes.
    peers::redis_benchmark(redis.addr(), &["-t", "set", "-d", "64", "-n", "1000"])?;
    let n = (cfg.requests * 2).to_string();
    let get = peers::redis_benchmark(
        redis.addr(),
        &["-t", "get", "-d", "64", "-c", "16", "-P", "16", "-n", &n],
    )?;
    drop(redis);
    let small = |client, drivers, requests| load(client, regions, drivers, 16, requests, 100, 64);
    let reads_batched = small(batched, Drivers::Threads(16), cfg.requests * 2)?;
    progress.inc(1);
    checks.push(redis_check(
        "64 B reads, 16 thr × depth 16, vs redis-benchmark GET -P 16",
        &reads_batched,
        &get,
    ));
    progress.set_message(&tag("64 B × 16 threads × 16, unbatched"));
    let reads_unbatched = small(unbatched, Drivers::Threads(16), cfg.requests / 2)?;
    progress.inc(1);
    checks.push(batching_check(
        "64 B reads, 16 thr × depth 16, batched vs unbatched",
        &reads_batched,
        &reads_unbatched,
        "camelot, batching off",
    ));

    // The same three loads from tasks on one event-loop thread: redis-benchmark drives
    // its 16 connections from one such thread, so this is the like-for-like client.
    progress.set_message(&tag("64 B × 16 tasks × 16 on one event loop"));
    let reads_loop = small(batched, Drivers::Tasks(16), cfg.requests * 2)?;
    let reads_loop_unbatched = small(unbatched, Drivers::Tasks(16), cfg.requests / 2)?;
    progress.inc(1);
    checks.push(redis_check(
        "event loop: 64 B reads, 16 tasks × depth 16, vs redis-benchmark GET -P 16",
        &reads_loop,
        &get,
    ));
    checks.push(batching_check(
        "event loop: 64 B reads, 16 tasks × depth 16, batched vs unbatched",
        &reads_loop,
        &reads_loop_unbatched,
        "camelot event loop, batching off",
    ));
    progress.set_message(&tag("4 KiB × 8 tasks × 16 on one event loop"));
    let bulk_loop = bulk_load(Drivers::Tasks(8))?;
    progress.inc(1);
    checks.push(stream_check(
        "event loop: 4 KiB 50% reads, 8 tasks × depth 16, vs iperf3 TCP stream",
        &bulk_loop,
        &stream,
    ));

    progress.set_message(&tag("sockperf ping-pong vs 64 B × 1 thread × 1"));
    let pingpong = peers::sockperf_tcp_pingpong(peer_time, 64)?;
    let one = load(
        unbatched,
        regions,
        Drivers::Threads(1),
        1,
        cfg.latency_requests,
        100,
        64,
    )?;
    progress.inc(1);
    let mut c = ratio_check(
        "64 B reads, 1 thr × depth 1, unbatched: p50 vs sockperf TCP ping-pong",
        one.latency.summary().p50,
        pingpong.latency_us.p50,
        "µs p50",
        1.3,
        pingpong.command,
    );
    c.at_most = true;
    c.against = Some((Against::TcpPingpongP50, 1.0));
    checks.push(c);
    Ok(checks)
}

/// A load's payload rate against iperf3's stream (target ≥ 0.7), read against the limit.
fn stream_check(name: &'static str, m: &Measured, stream: &peers::PeerStream) -> Check {
    let mut c = ratio_check(
        name,
        m.bytes_per_sec() / 1e9,
        stream.bytes_per_sec / 1e9,
        "GB/s",
        0.7,
        stream.command.clone(),
    );
    c.against = Some((Against::TcpStream, 1e9));
    c
}

/// A load's request rate against redis-benchmark's GETs (target ≥ 2).
fn redis_check(name: &'static str, m: &Measured, get: &peers::PeerRate) -> Check {
    ratio_check(
        name,
        m.ops_per_sec() / 1e3,
        get.ops_per_sec / 1e3,
        "kops/s",
        2.0,
        get.command.clone(),
    )
}

/// Batching on against off (target ≥ 3).
fn batching_check(name: &'static str, on: &Measured, off: &Measured, peer: &str) -> Check {
    ratio_check(
        name,
        on.ops_per_sec() / 1e3,
        off.ops_per_sec() / 1e3,
        "kops/s",
        3.0,
        peer.into(),
    )
}

/// Most rounds one run may ask for.
pub const ROUNDS_MAX: usize = 20;

/// Folds the rounds into one check each: the median ratio, and the median values.
fn median_checks(rounds: Vec<Vec<Check>>) -> Vec<Check> {
    let Some(first) = rounds.first().cloned() else {
        return Vec::new();
    };
    first
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            // Rounds are never empty here (validated), so a median always exists.
            let median = |v: &[f64]| crate::hw::median(v).unwrap_or(f64::NAN);
            let of = |f: &dyn Fn(&Check) -> f64| {
                median(&rounds.iter().map(|r| f(&r[i])).collect::<Vec<_>>())
            };
            c.round_ratios = rounds.iter().map(|r| r[i].ratio).collect();
            c.ratio = median(&c.round_ratios);
            c.camelot = of(&|c| c.camelot);
            c.peer = of(&|c| c.peer);
            c
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

fn load(
    client: &Client,
    regions: &[Region],
    drivers: Drivers,
    depth: usize,
    requests: u64,
    reads_percent: u8,
    size: u32,
) -> Result<Measured, BenchError> {
    let (Drivers::Threads(threads) | Drivers::Tasks(threads)) = drivers;
    let spec = LoadSpec {
        threads,
        depth,
        requests,
        min_duration: Duration::ZERO,
        mix: Mix {
            reads_percent,
            fetch_add_percent: 0,
        },
        sizes_bytes: vec![size],
        pin: matches!(drivers, Drivers::Threads(_)),
        event_loop: matches!(drivers, Drivers::Tasks(_)),
        seed: (threads * 1000 + depth) as u64,
    };
    workload::run_load(client, regions, &spec, None)
}

fn ratio_check(
    name: &'static str,
    camelot: f64,
    peer: f64,
    unit: &'static str,
    bound: f64,
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
        peer_command,
        round_ratios: Vec::new(),
        against: None,
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
        let _ = writeln!(
            s,
            "| {} | {:.2} {} | {:.2} {} | {:.2} | {} | {} {} | {} |",
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
            if c.at_most { "≤" } else { "≥" },
            c.bound,
            if c.met() { "yes" } else { "**no**" }
        );
    }
    let _ = writeln!(s);
    for c in checks {
        if !c.peer_command.starts_with("camelot") && !c.peer_command.starts_with("peak") {
            let _ = writeln!(s, "- peer for \"{}\": `{}`", c.name, c.peer_command);
        }
    }
    s
}

/// Throughput against threads at depth 1 and 16, the no-collapse checks.
fn sweep_figure(result: &BenchResult) -> Figure {
    let mut panel = Panel::new(
        "4 KiB, 50% reads, batched",
        "client threads",
        "throughput (MB/s)",
    );
    for s in result
        .series
        .iter()
        .filter(|s| s.label.starts_with("depth"))
    {
        let pts = series_points(s, |p| p.bytes_per_sec.map(|b| b / 1e6));
        panel = panel.line(&s.label, pts);
    }
    Figure::new("Request API: no collapse with threads").panel(panel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_with_a_limit_are_read_against_it() {
        let mut stream = ratio_check("stream", 0.5, 1.0, "GB/s", 0.7, "iperf3".into());
        stream.against = Some((Against::TcpStream, 1e9));
        let mut latency = ratio_check("p50", 30.0, 25.0, "µs p50", 1.3, "sockperf".into());
        latency.against = Some((Against::TcpPingpongP50, 1.0));
        let other = ratio_check("batching", 9.0, 3.0, "kops/s", 3.0, "camelot".into());
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
}
