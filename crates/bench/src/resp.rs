//! `camelot bench resp`: `redis-benchmark` against Camelot's Redis-protocol port and
//! against a real redis-server, in the same run, alternating, so the ratio is the figure.

use crate::hw::median;
use crate::peers::redis_benchmark;
use crate::progress::Progress;
use crate::BenchError;
use camelot_results::output::write_result_with_figure;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Series};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use camelot_testkit::RedisServer;
use serde_json::json;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub const ROUNDS_MAX: usize = 20;
pub const REQUESTS_MAX: u64 = 100_000_000;
pub const CLIENTS_MAX: u32 = 10_000;
pub const PIPELINE_MAX: u32 = 1_000;

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
    /// Each pair runs this many times, alternating who goes first; the median counts.
    pub rounds: usize,
    pub quick: bool,
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

/// One redis-benchmark case and what both servers reached in every round.
struct Case {
    label: String,
    args: Vec<String>,
    camelot: Vec<f64>,
    redis: Vec<f64>,
}

/// Runs every case; returns the files written and a printable table.
pub fn run(cfg: &RespBenchConfig, out: &Path) -> Result<(Vec<PathBuf>, String), BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 2 << 30,
        resp: true,
        ..DevClusterConfig::default()
    })?;
    let camelot_addr = *cluster
        .resp_addrs()
        .first()
        .ok_or_else(|| BenchError::Setup("the Camelot node has no RESP port".into()))?;
    let redis = RedisServer::start()?;
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
                camelot: Vec::new(),
                redis: Vec::new(),
            });
        }
    }
    let progress = Progress::new((cases.len() * cfg.rounds * 2) as u64, "resp");
    let mut commands = Vec::new();
    for round in 0..cfg.rounds {
        for case in &mut cases {
            let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
            // Alternate who goes first, so neither always gets the warmer machine.
            let order = if round % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for camelot_turn in order {
                let addr = if camelot_turn {
                    camelot_addr
                } else {
                    redis.addr()
                };
                progress.set_message(&format!(
                    "{} on {}",
                    case.label,
                    if camelot_turn { "camelot" } else { "redis" }
                ));
                let rate = redis_benchmark(addr, &args)?;
                if round == 0 && !camelot_turn {
                    commands.push(rate.command.clone());
                }
                if camelot_turn {
                    case.camelot.push(rate.ops_per_sec);
                } else {
                    case.redis.push(rate.ops_per_sec);
                }
                progress.inc(1);
            }
        }
    }
    progress.finish();
    drop(redis);
    cluster.shutdown()?;

    let mut camelot_series = Series::new("camelot (RESP port)");
    let mut redis_series = Series::new("redis-server");
    let mut table = String::from(
        "| redis-benchmark case | camelot ops/s | redis ops/s | ratio (median of rounds) | rounds | ≥ 1.0 |\n|---|---|---|---|---|---|\n",
    );
    for case in &cases {
        let ratios: Vec<f64> = case
            .camelot
            .iter()
            .zip(&case.redis)
            .map(|(c, r)| c / r)
            .collect();
        let ratio = median(&ratios).unwrap_or(f64::NAN);
        let c = median(&case.camelot).unwrap_or(f64::NAN);
        let r = median(&case.redis).unwrap_or(f64::NAN);
        let _ = writeln!(
            table,
            "| {} | {c:.0} | {r:.0} | **{ratio:.2}** | {} | {} |",
            case.label,
            ratios
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" / "),
            if ratio >= 1.0 { "yes" } else { "**no**" }
        );
        let mut pc = Point::new(case.label.as_str());
        pc.ops_per_sec = Some(c);
        pc.extra
            .insert("rounds_ops_per_sec".into(), json!(case.camelot));
        pc.extra.insert("ratio_to_redis".into(), json!(ratio));
        pc.extra.insert("round_ratios".into(), json!(ratios));
        camelot_series.points.push(pc);
        let mut pr = Point::new(case.label.as_str());
        pr.ops_per_sec = Some(r);
        pr.extra
            .insert("rounds_ops_per_sec".into(), json!(case.redis));
        redis_series.points.push(pr);
    }
    for c in &commands {
        let _ = writeln!(table, "- `{c}` (and the same against Camelot's port)");
    }
    let config = json!({
        "x": "case",
        "requests": cfg.requests,
        "clients": cfg.clients,
        "data_bytes": cfg.data_bytes,
        "pipelines": cfg.pipelines,
        "rounds": cfg.rounds,
        "quick": cfg.quick,
        "commands": commands,
    });
    let result = BenchResult::new("resp", started, config, vec![camelot_series, redis_series]);
    let labels: Vec<String> = cases.iter().map(|c| c.label.clone()).collect();
    let mut panel = Panel::new("redis-benchmark", "case", "ops/s").bars(labels);
    for s in &result.series {
        let points = s
            .points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((i as f64, p.ops_per_sec?)))
            .collect();
        panel = panel.line(&s.label, points);
    }
    let files = write_result_with_figure(out, &result, &Figure::new("resp").panel(panel))?;
    Ok((files, table))
}
