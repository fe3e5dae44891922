//! `camelot bench resp`: `redis-benchmark` against Camelot's Redis-protocol port and
//! against a real redis-server, in the same run, alternating, so the ratio is the figure.
//!
//! Every server is a process of its own, started the same way (`side`), and every
//! redis-benchmark run meters the CPU seconds of the server it drives, so throughput is
//! read beside what it cost. Three rows: Camelot with its defaults (one Redis-port event
//! loop that keeps polling 100 µs after its last command), Camelot set up the way Redis
//! runs (`camelot parity`: the event loop sleeps at once, one native worker), and
//! redis-server. The parity row is the one whose efficiency is judged against Redis: the
//! default's polling buys latency with CPU, which its throughput shows and its ops per
//! CPU-second pay for.

use crate::hw::median;
use crate::peers::redis_benchmark;
use crate::progress::Progress;
use crate::side::{
    cpu_extra, sides_json, CamelotNodes, CamelotSpec, ClientSide, CpuMeter, Placement, Side,
    CPU_SECONDS_RESOLUTION,
};
use crate::workload::CPU_SECONDS_FOR_RATIO_MIN;
use crate::BenchError;
use camelot_results::output::write_result_with_figure;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Series};
use camelot_results::summary::comparison_table;
use camelot_testkit::RedisServer;
use serde_json::json;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const ROUNDS_MAX: usize = 20;
pub const REQUESTS_MAX: u64 = 100_000_000;
pub const CLIENTS_MAX: u32 = 10_000;
pub const PIPELINE_MAX: u32 = 1_000;
/// Memory cap of each Camelot server: a ceiling, not an allocation (one key's value is
/// all redis-benchmark's GET and SET touch).
const CAMELOT_MEMORY_BYTES: u64 = 2 << 30;
/// The ratio every comparison of this bench is judged by: at least Redis's figure.
const TARGET_RATIO: f64 = 1.0;

#[derive(Debug, Clone)]
pub struct RespBenchConfig {
    /// `-n`: requests per redis-benchmark run.
    pub requests: u64,
    /// `-c`: parallel connections.
    pub clients: u32,
    /// `-d`: value bytes.
    pub data_bytes: u32,
    /// `-P` values to run (1 = no pipelining).
    pub pipelines: Vec<u32>,
    /// Each case runs this many times on every server, rotating who goes first; the
    /// median counts.
    pub rounds: usize,
    pub quick: bool,
    /// Camelot inside the bench process instead of `camelot server` processes (labelled;
    /// no CPU seconds for it, and no parity row, whose flags need a process).
    pub in_process: bool,
}

impl Default for RespBenchConfig {
    fn default() -> Self {
        // The comparison: -t get,set -d 100 -c 50 -n 200000, and again with -P 16.
        RespBenchConfig {
            requests: 200_000,
            clients: 50,
            data_bytes: 100,
            pipelines: vec![1, 16],
            rounds: 3,
            quick: false,
            in_process: false,
        }
    }
}

impl RespBenchConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.requests = self.requests.min(20_000);
        self.rounds = 1;
    }

    fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        if self.rounds == 0 || self.rounds > ROUNDS_MAX {
            return bad(format!("rounds must be 1 to {ROUNDS_MAX}"));
        }
        if self.requests == 0 || self.requests > REQUESTS_MAX {
            return bad(format!("requests must be 1 to {REQUESTS_MAX}"));
        }
        if self.clients == 0 || self.clients > CLIENTS_MAX {
            return bad(format!("clients must be 1 to {CLIENTS_MAX}"));
        }
        if self.pipelines.is_empty() || self.pipelines.iter().any(|&p| p == 0 || p > PIPELINE_MAX) {
            return bad(format!("pipelines must be 1 to {PIPELINE_MAX}"));
        }
        Ok(())
    }
}

/// A server of the comparison: a row of the table and a series of the figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Row {
    /// Camelot as it ships: one Redis-port event loop polling 100 µs after each command.
    Camelot,
    /// Camelot run as Redis runs: the event loop sleeps at once, one native worker.
    Parity,
    /// redis-server, one thread (its default).
    Redis,
}

impl Row {
    pub fn label(self) -> &'static str {
        match self {
            Row::Camelot => "camelot",
            Row::Parity => "camelot parity",
            Row::Redis => "redis",
        }
    }

    /// How the Camelot server of this row is started (`None` for Redis).
    pub fn spec(self) -> Option<CamelotSpec> {
        let mut spec = CamelotSpec::new(1, CAMELOT_MEMORY_BYTES);
        spec.resp = true;
        match self {
            Row::Camelot => Some(spec),
            Row::Parity => {
                spec.resp_poll_us = Some(0);
                spec.threads = Some(1);
                Some(spec)
            }
            Row::Redis => None,
        }
    }
}

/// One redis-benchmark run: the rate it reported and what its server spent meanwhile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Run {
    pub ops_per_sec: f64,
    /// `None` when the server is not a process of its own (in process).
    pub server_cpu_seconds: Option<f64>,
}

/// One row's runs of a case, round by round.
#[derive(Debug, Clone, PartialEq)]
pub struct RowRuns {
    pub row: Row,
    /// The series label (marked when the server ran in process).
    pub label: String,
    pub runs: Vec<Run>,
}

/// One redis-benchmark case (`-t get -P 16`, …) and every row's runs of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub label: String,
    pub args: Vec<String>,
    pub rows: Vec<RowRuns>,
}

/// What a run produces from its cases: a series per row, the comparisons, a table.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub series: Vec<Series>,
    pub comparisons: Vec<Comparison>,
    pub table: String,
}

/// One row of one case, folded over its rounds.
struct Folded {
    ops_per_sec: f64,
    server_cpu_seconds: Option<f64>,
    ops_per_server_cpu_second: Option<f64>,
    /// `ops_per_server_cpu_second`, when enough CPU time was counted to set it against
    /// another server's.
    comparable_efficiency: Option<f64>,
    /// Against Redis's run of the same round, when this is not Redis.
    round_ratios: Vec<f64>,
}

fn fold(runs: &[Run], redis: &[Run], requests: u64, is_redis: bool) -> Folded {
    let ops_per_sec =
        median(&runs.iter().map(|r| r.ops_per_sec).collect::<Vec<_>>()).unwrap_or(f64::NAN);
    // A CPU figure only when every round has one: a median of some rounds is not the
    // rounds' median.
    let cpu: Option<Vec<f64>> = runs.iter().map(|r| r.server_cpu_seconds).collect();
    let server_cpu_seconds = cpu.and_then(|c| median(&c));
    let ops_per_server_cpu_second = server_cpu_seconds
        .filter(|&c| c >= CPU_SECONDS_RESOLUTION)
        .map(|c| requests as f64 / c);
    let comparable_efficiency = server_cpu_seconds
        .filter(|&c| c >= CPU_SECONDS_FOR_RATIO_MIN)
        .and(ops_per_server_cpu_second);
    let round_ratios = if is_redis {
        Vec::new()
    } else {
        runs.iter()
            .zip(redis)
            .map(|(c, r)| c.ops_per_sec / r.ops_per_sec)
            .collect()
    };
    Folded {
        ops_per_sec,
        server_cpu_seconds,
        ops_per_server_cpu_second,
        comparable_efficiency,
        round_ratios,
    }
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "—".into(), |v| format!("{v:.digits$}"))
}

/// Builds the series, the comparisons and the console table from the cases' runs.
/// `requests` is redis-benchmark's `-n` (ops per run); `redis_label` names the peer in
/// the comparisons (`redis-server 7.0.15`). Throughput ratios are the median of the
/// rounds' ratios, each round's runs having run back to back.
pub fn summarise(cases: &[Case], requests: u64, redis_label: &str) -> Summary {
    let mut series: Vec<Series> = Vec::new();
    let mut comparisons = Vec::new();
    let mut table = String::from(
        "| case | server | ops/s | ÷ redis (median of rounds) | server CPU s | ops per server CPU-s | ÷ redis |\n\
         |---|---|---:|---:|---:|---:|---:|\n",
    );
    for case in cases {
        let redis_runs: &[Run] = case
            .rows
            .iter()
            .find(|r| r.row == Row::Redis)
            .map_or(&[], |r| &r.runs);
        let redis = fold(redis_runs, redis_runs, requests, true);
        for rr in &case.rows {
            let is_redis = rr.row == Row::Redis;
            let f = fold(&rr.runs, redis_runs, requests, is_redis);
            let ratio = median(&f.round_ratios);
            let efficiency_ratio = f
                .comparable_efficiency
                .zip(redis.comparable_efficiency)
                .map(|(c, r)| c / r);
            let _ = writeln!(
                table,
                "| {} | {} | {:.0} | {} | {} | {} | {} |",
                case.label,
                rr.label,
                f.ops_per_sec,
                if is_redis {
                    "1".into()
                } else {
                    fmt_opt(ratio, 2)
                },
                fmt_opt(f.server_cpu_seconds, 2),
                fmt_opt(f.ops_per_server_cpu_second, 0),
                if is_redis {
                    "1".into()
                } else {
                    fmt_opt(efficiency_ratio, 2)
                },
            );

            let mut p = Point::new(case.label.as_str());
            p.ops_per_sec = Some(f.ops_per_sec);
            p.extra.insert(
                "rounds_ops_per_sec".into(),
                json!(rr.runs.iter().map(|r| r.ops_per_sec).collect::<Vec<_>>()),
            );
            let cpu_rounds: Vec<f64> = rr
                .runs
                .iter()
                .filter_map(|r| r.server_cpu_seconds)
                .collect();
            if !cpu_rounds.is_empty() {
                p.extra
                    .insert("rounds_server_cpu_seconds".into(), json!(cpu_rounds));
            }
            for (k, v) in cpu_extra(requests as f64, f.server_cpu_seconds) {
                p.extra.insert(k.into(), v);
            }
            if let Some(ratio) = ratio {
                p.extra.insert("ratio_to_redis".into(), json!(ratio));
                p.extra.insert("round_ratios".into(), json!(f.round_ratios));
            }
            match series.iter_mut().find(|s| s.label == rr.label) {
                Some(s) => s.points.push(p),
                None => {
                    let mut s = Series::new(rr.label.as_str());
                    s.points.push(p);
                    series.push(s);
                }
            }

            match rr.row {
                Row::Camelot => {
                    let mut c = Comparison::new(
                        format!("{}: throughput, {} ÷ redis", case.label, rr.label),
                        f.ops_per_sec,
                        redis.ops_per_sec,
                        "ops/s",
                        redis_label,
                    )
                    .with_target(TARGET_RATIO, false);
                    if let Some(r) = ratio {
                        c.ratio = r;
                    }
                    comparisons.push(c);
                }
                Row::Parity => {
                    if let (Some(c), Some(r)) =
                        (f.comparable_efficiency, redis.comparable_efficiency)
                    {
                        comparisons.push(
                            Comparison::new(
                                format!(
                                    "{}: ops per server CPU-second, {} ÷ redis",
                                    case.label, rr.label
                                ),
                                c,
                                r,
                                "ops/CPU-s",
                                redis_label,
                            )
                            .with_target(TARGET_RATIO, false),
                        );
                    }
                }
                Row::Redis => {}
            }
        }
    }
    let _ = writeln!(
        table,
        "\nops per server CPU-second are set against Redis's only where both servers \
         spent at least {CPU_SECONDS_FOR_RATIO_MIN} CPU-s (ten 10 ms ticks); below, \
         the ratio is —."
    );
    Summary {
        series,
        comparisons,
        table,
    }
}

/// `redis-server 7.0.15` from `redis-server --version`'s `Redis server v=7.0.15 sha=…`.
pub fn redis_label(version_line: &str) -> String {
    version_line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("v="))
        .map_or_else(|| "redis-server".into(), |v| format!("redis-server {v}"))
}

/// The row order of `round`: rotated each round, so no server always gets the machine
/// the one before it warmed (or heated).
fn order(rows: usize, round: usize) -> impl Iterator<Item = usize> {
    (0..rows).map(move |i| (i + round) % rows.max(1))
}

/// A started server of the run.
struct Endpoint {
    row: Row,
    label: String,
    addr: SocketAddr,
    pids: Vec<u32>,
}

/// Runs every case; returns the files written and a printable table.
pub fn run(cfg: &RespBenchConfig, out: &Path) -> Result<(Vec<PathBuf>, String), BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let placement = Placement::choose(cfg.in_process)?;
    let client = ClientSide {
        client: format!(
            "redis-benchmark (-c {} connections on one thread, -P per case)",
            cfg.clients
        ),
        client_threads: 1,
        depth: cfg.clients as usize,
        data_model: format!("{} B string (SET, GET of one key)", cfg.data_bytes),
        resp_face: true,
    };

    let mut camelots: Vec<(Row, CamelotNodes)> = Vec::new();
    for row in [Row::Camelot, Row::Parity] {
        // The parity flags exist only on the command line of a server process.
        if row == Row::Parity && placement.is_in_process() {
            continue;
        }
        if let Some(spec) = row.spec() {
            camelots.push((row, CamelotNodes::start(&spec, &placement)?));
        }
    }
    let redis = RedisServer::start()?;
    let redis_version = RedisServer::version()?;
    let mut sides: Vec<Side> = Vec::new();
    let mut endpoints: Vec<Endpoint> = Vec::new();
    for (row, nodes) in &camelots {
        let label = placement.label(row.label());
        let addr = *nodes
            .resp_addrs()
            .first()
            .ok_or_else(|| BenchError::Setup("the Camelot node has no RESP port".into()))?;
        sides.push(nodes.side(&label, client.clone()));
        endpoints.push(Endpoint {
            row: *row,
            label,
            addr,
            pids: nodes.processes().iter().map(|p| p.pid()).collect(),
        });
    }
    sides.push(Side::peer(
        Row::Redis.label(),
        redis.process(),
        redis_version.clone(),
        Some(1),
        Vec::new(),
        client.clone(),
    ));
    endpoints.push(Endpoint {
        row: Row::Redis,
        label: Row::Redis.label().into(),
        addr: redis.addr(),
        pids: vec![redis.process().pid()],
    });

    let mut cases: Vec<Case> = Vec::new();
    for &p in &cfg.pipelines {
        for test in ["set", "get"] {
            let suffix = if p > 1 {
                format!(" -P {p}")
            } else {
                String::new()
            };
            cases.push(Case {
                label: format!("{}{suffix}", test.to_uppercase()),
                args: vec![
                    "-t".into(),
                    test.into(),
                    "-d".into(),
                    cfg.data_bytes.to_string(),
                    "-c".into(),
                    cfg.clients.to_string(),
                    "-n".into(),
                    cfg.requests.to_string(),
                    "-P".into(),
                    p.to_string(),
                ],
                rows: endpoints
                    .iter()
                    .map(|e| RowRuns {
                        row: e.row,
                        label: e.label.clone(),
                        runs: Vec::new(),
                    })
                    .collect(),
            });
        }
    }
    let progress = Progress::new((cases.len() * cfg.rounds * endpoints.len()) as u64, "resp");
    let mut commands = Vec::new();
    for round in 0..cfg.rounds {
        for case in &mut cases {
            let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
            for i in order(endpoints.len(), round) {
                let e = &endpoints[i];
                progress.set_message(&format!("{} on {}", case.label, e.label));
                let meter = CpuMeter::start(e.pids.clone());
                let rate = redis_benchmark(e.addr, &args)?;
                let server_cpu_seconds = meter.seconds();
                if round == 0 && e.row == Row::Redis {
                    commands.push(rate.command.clone());
                }
                case.rows[i].runs.push(Run {
                    ops_per_sec: rate.ops_per_sec,
                    server_cpu_seconds,
                });
                progress.inc(1);
            }
        }
    }
    progress.finish();
    drop(redis);
    for (_, nodes) in camelots {
        nodes.stop()?;
    }

    let summary = summarise(&cases, cfg.requests, &redis_label(&redis_version));
    let mut table = summary.table.clone();
    for c in &commands {
        let _ = writeln!(table, "- `{c}` (and the same against Camelot's ports)");
    }
    let mut config = json!({
        "x": "case",
        "requests": cfg.requests,
        "clients": cfg.clients,
        "data_bytes": cfg.data_bytes,
        "pipelines": cfg.pipelines,
        "rounds": cfg.rounds,
        "quick": cfg.quick,
        "commands": commands,
        "process": placement.name(),
        "rows": endpoints.iter().map(|e| e.label.clone()).collect::<Vec<_>>(),
        "sides": sides_json(&sides),
    });
    if placement.is_in_process() {
        config["parity_row"] =
            json!("left out: its --resp-poll-us and --threads need a server process");
    }
    let mut result = BenchResult::new("resp", started, config, summary.series);
    result.comparisons = summary.comparisons;
    let _ = writeln!(table);
    table.push_str(&comparison_table(&result));
    let files = write_result_with_figure(out, &result, &figure(&result, &cases))?;
    Ok((files, table))
}

/// Throughput per case, and beside it what each server did with a CPU-second.
fn figure(result: &BenchResult, cases: &[Case]) -> Figure {
    let labels: Vec<String> = cases.iter().map(|c| c.label.clone()).collect();
    let mut rate = Panel::new("redis-benchmark", "case", "ops/s").bars(labels.clone());
    let mut efficiency =
        Panel::new("server efficiency", "case", "ops per server CPU-second").bars(labels);
    let mut any_efficiency = false;
    for s in &result.series {
        let points = |f: &dyn Fn(&Point) -> Option<f64>| -> Vec<(f64, f64)> {
            s.points
                .iter()
                .enumerate()
                .filter_map(|(i, p)| Some((i as f64, f(p)?)))
                .collect()
        };
        rate = rate.line(&s.label, points(&|p| p.ops_per_sec));
        let eff = points(&|p| p.extra.get("ops_per_server_cpu_second")?.as_f64());
        any_efficiency |= !eff.is_empty();
        efficiency = efficiency.line(&s.label, eff);
    }
    let figure = Figure::new("resp").panel(rate);
    if any_efficiency {
        figure.panel(efficiency)
    } else {
        figure
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ops_per_sec: f64, cpu: Option<f64>) -> Run {
        Run {
            ops_per_sec,
            server_cpu_seconds: cpu,
        }
    }

    fn case(camelot: Vec<Run>, parity: Vec<Run>, redis: Vec<Run>) -> Case {
        Case {
            label: "GET -P 16".into(),
            args: Vec::new(),
            rows: [
                (Row::Camelot, camelot),
                (Row::Parity, parity),
                (Row::Redis, redis),
            ]
            .into_iter()
            .map(|(row, runs)| RowRuns {
                row,
                label: row.label().into(),
                runs,
            })
            .collect(),
        }
    }

    #[test]
    fn parity_row_sleeps_at_once_on_one_worker() {
        let parity = Row::Parity.spec().expect("a camelot row");
        let flags = parity.flags();
        let at = flags
            .iter()
            .position(|f| f == "--resp-poll-us")
            .expect("--resp-poll-us passed");
        assert_eq!(flags[at + 1], "0");
        assert!(flags.windows(2).any(|w| w == ["--threads", "1"]));
        assert!(parity.resp);
        let camelot = Row::Camelot.spec().expect("a camelot row");
        assert!(!camelot.flags().iter().any(|f| f.starts_with("--resp-")));
        assert!(Row::Redis.spec().is_none());
    }

    #[test]
    fn comparisons_are_throughput_and_parity_efficiency_against_redis() {
        // Two rounds; requests = 1000 per run.
        let c = case(
            vec![run(300.0, Some(1.0)), run(200.0, Some(1.0))],
            vec![run(90.0, Some(0.5)), run(110.0, Some(0.5))],
            vec![run(100.0, Some(0.8)), run(100.0, Some(1.2))],
        );
        let s = summarise(&[c], 1000, "redis-server 7.0.15");
        assert_eq!(s.series.len(), 3);
        assert_eq!(s.comparisons.len(), 2, "{:?}", s.comparisons);
        let throughput = &s.comparisons[0];
        assert!(throughput.name.contains("throughput"));
        assert_eq!(throughput.peer_label, "redis-server 7.0.15");
        assert_eq!(throughput.ratio, 2.5, "median of the rounds' 3.0 and 2.0");
        assert_eq!(throughput.target, Some(1.0));
        let efficiency = &s.comparisons[1];
        assert_eq!(efficiency.unit, "ops/CPU-s");
        // Parity: 1000 ops / 0.5 s; redis: 1000 / median(0.8, 1.2) = 1000 / 1.0.
        assert_eq!(efficiency.camelot, 2000.0);
        assert_eq!(efficiency.peer, 1000.0);
        assert_eq!(efficiency.ratio, 2.0);
        assert_eq!(efficiency.met(), Some(true));
        let redis = &s.series[2].points[0];
        assert_eq!(redis.extra["server_cpu_seconds"], json!(1.0));
        assert_eq!(redis.extra["ops_per_server_cpu_second"], json!(1000.0));
        assert!(!redis.extra.contains_key("ratio_to_redis"));
        let lines: Vec<&str> = s.table.lines().filter(|l| l.starts_with('|')).collect();
        assert_eq!(lines.len(), 2 + 3, "{}", s.table);
        assert!(lines[3].contains("camelot parity") && lines[3].contains("2000"));
    }

    #[test]
    fn no_cpu_figures_means_no_efficiency_comparison() {
        let c = case(
            vec![run(300.0, None)],
            vec![run(90.0, Some(0.001))],
            vec![run(100.0, Some(0.5))],
        );
        let s = summarise(&[c], 1000, "redis-server");
        assert_eq!(s.comparisons.len(), 1, "below a clock tick is no figure");
        // Five ticks: a figure for the point, too coarse for a ratio.
        let coarse = case(
            vec![run(300.0, Some(0.5))],
            vec![run(90.0, Some(0.05))],
            vec![run(100.0, Some(0.5))],
        );
        let s2 = summarise(&[coarse], 1000, "redis-server");
        assert_eq!(s2.comparisons.len(), 1, "{:?}", s2.comparisons);
        assert_eq!(
            s2.series[1].points[0].extra["ops_per_server_cpu_second"],
            json!(20_000.0)
        );
        let camelot = &s.series[0].points[0];
        assert!(!camelot.extra.contains_key("server_cpu_seconds"));
        let parity = &s.series[1].points[0];
        assert_eq!(parity.extra["server_cpu_seconds"], json!(0.001));
        assert!(!parity.extra.contains_key("ops_per_server_cpu_second"));
        assert!(s.table.contains("| — |"), "{}", s.table);
    }

    #[test]
    fn redis_versions_are_shortened_and_rounds_rotate() {
        assert_eq!(
            redis_label("Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64"),
            "redis-server 7.0.15"
        );
        assert_eq!(redis_label("garbage"), "redis-server");
        assert_eq!(order(3, 0).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(order(3, 1).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(order(2, 3).collect::<Vec<_>>(), [1, 0]);
    }
}
