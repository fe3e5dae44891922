//! `camelot bench cluster rebalance`: seed 004's automatic against manual rebalancing. A
//! cluster on etcd starts **skewed** — node 0 holds a large share of the partitions — under
//! a closed-loop YCSB-B load (1 KiB values). Every node is throttled to the same executed
//! ops/s (`--ops-per-sec-max`), so each is a fixed-capacity machine, as separate hosts would
//! be; on one shared machine an unthrottled skew would cost nothing measurable, since every
//! server draws on the same cores. Two runs, the same in every other way:
//! - **manual**: at the trigger second the bench runs `camelot cluster rebalance` — what
//!   an operator would type;
//! - **automatic**: at the same second the bench starts `camelot cluster controller
//!   --auto-rebalance`, which notices the skew by itself and runs the planner's moves.
//!
//! Recorded per 1 s bucket for both: operations finished, failed, bad reads; per run: when
//! the map was balanced again, partitions moved, the tool's CPU. The target:
//! automatic within 10 % of manual's throughput — compared on the mean of the complete
//! buckets after each run's rebalance ended.

use std::path::{Path, PathBuf};

use crate::checks::check_seconds;
use crate::cluster_load::{KvLoad, YCSB_B_READ_FRACTION};
use crate::BenchError;

/// The target: automatic ÷ manual throughput after rebalancing.
pub const AUTO_RATIO_TARGET: f64 = 0.9;
pub const THREADS_MAX: usize = 64;
/// Longest either rebalance may take before the run is abandoned.
pub const REBALANCE_TIME_MAX: std::time::Duration = std::time::Duration::from_secs(300);

#[derive(Debug, Clone)]
pub struct RebalanceConfig {
    pub nodes: u32,
    pub partitions: u32,
    /// The share of the partitions node 0 holds at the start (the rest spread evenly).
    pub skew: f64,
    pub records: u64,
    pub value_bytes: usize,
    pub threads: usize,
    /// Every node's `--ops-per-sec-max`.
    pub node_ops_per_sec: u64,
    /// Seconds of load on the skewed map before the rebalance is triggered.
    pub skewed_seconds: f64,
    /// Seconds of load after the map is balanced again.
    pub after_seconds: f64,
    pub memory_bytes_per_node: u64,
    pub quick: bool,
}

impl Default for RebalanceConfig {
    fn default() -> Self {
        RebalanceConfig {
            nodes: 3,
            partitions: camelot_cluster::PARTITIONS_DEFAULT,
            skew: 0.6,
            records: 20_000,
            value_bytes: 1024,
            threads: 8,
            node_ops_per_sec: 2_000,
            skewed_seconds: 5.0,
            after_seconds: 8.0,
            memory_bytes_per_node: 256 << 20,
            quick: false,
        }
    }
}

impl RebalanceConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.partitions = 256;
        self.records = 4_000;
        self.skewed_seconds = 2.0;
        self.after_seconds = 3.0;
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if !(2..=crate::cluster::BENCH_CLUSTER_NODES_MAX as u32).contains(&self.nodes) {
            return Err(BenchError::InvalidConfig(format!(
                "2 to {} nodes",
                crate::cluster::BENCH_CLUSTER_NODES_MAX
            )));
        }
        if !(self.nodes..=camelot_cluster::map::PARTITIONS_MAX).contains(&self.partitions) {
            return Err(BenchError::InvalidConfig(format!(
                "partitions must be the node count to {}",
                camelot_cluster::map::PARTITIONS_MAX
            )));
        }
        let even = 1.0 / f64::from(self.nodes);
        if !(self.skew > even && self.skew < 1.0) {
            return Err(BenchError::InvalidConfig(format!(
                "the skew (node 0's share) must be above an even share ({even:.3}) and below 1"
            )));
        }
        if !(1..=camelot_server::throttle::OPS_PER_SEC_MAX).contains(&self.node_ops_per_sec) {
            return Err(BenchError::InvalidConfig(format!(
                "a node's ops/s limit must be 1 to {}",
                camelot_server::throttle::OPS_PER_SEC_MAX
            )));
        }
        check_seconds("skewed seconds", self.skewed_seconds)?;
        check_seconds("after seconds", self.after_seconds)?;
        self.load().validate(THREADS_MAX)
    }

    fn load(&self) -> KvLoad {
        KvLoad {
            records: self.records,
            value_bytes: self.value_bytes,
            threads: self.threads,
            read_fraction: YCSB_B_READ_FRACTION,
            target_ops_per_sec: None,
            seed: 0x5eed_7eba,
        }
    }
}

/// The skewed start: partitions `0..skew·P` on node 0, the rest dealt round-robin over
/// the other nodes (R = 1).
pub fn skewed(
    map: &camelot_cluster::ClusterMap,
    skew: f64,
) -> Result<camelot_cluster::ClusterMap, BenchError> {
    let n = map.nodes.len() as u32;
    let p = map.partitions();
    let on_first = ((f64::from(p) * skew).round() as u32).min(p);
    let ids: Vec<u32> = map.nodes.iter().map(|x| x.id).collect();
    let mut next = map.clone();
    for (i, a) in next.assignment.iter_mut().enumerate() {
        let i = i as u32;
        let node = if i < on_first || n < 2 {
            ids[0]
        } else {
            ids[1 + ((i - on_first) % (n - 1)) as usize]
        };
        *a = vec![node];
    }
    next.validate()
        .map_err(|e| BenchError::Setup(format!("the skewed map: {e}")))?;
    Ok(next)
}

/// The mean of the complete buckets from the one after `from_secs` up to `end_secs`
/// (a bucket ending after it is partial and left out). `None` without one.
pub fn mean_after(ops: &[u64], from_secs: f64, end_secs: f64) -> Option<f64> {
    let first = from_secs.ceil() as usize;
    let last = (end_secs.floor() as usize).min(ops.len());
    let xs: Vec<u64> = ops.get(first..last)?.to_vec();
    if xs.is_empty() {
        return None;
    }
    Some(xs.iter().sum::<u64>() as f64 / xs.len() as f64)
}

#[cfg(not(feature = "etcd"))]
pub fn run(_cfg: &RebalanceConfig, _out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    Err(BenchError::InvalidConfig(crate::cluster::NO_ETCD.into()))
}

#[cfg(feature = "etcd")]
pub use with_etcd::run;

#[cfg(feature = "etcd")]
mod with_etcd {
    use super::*;
    use crate::cluster_etcd::{EtcdNodes, NodeSpec};
    use crate::cluster_expand::partitions_moved;
    use crate::cluster_load::{load_records, Until};
    use crate::side::{sides_json, ClientSide, Placement};
    use camelot_client::ClientConfig;
    use camelot_results::plot::{Figure, Panel};
    use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Series};
    use serde_json::json;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Mode {
        Manual,
        Automatic,
    }

    impl Mode {
        fn label(self) -> &'static str {
            match self {
                Mode::Manual => "manual",
                Mode::Automatic => "automatic",
            }
        }
    }

    struct RunResult {
        mode: Mode,
        ops: Vec<u64>,
        failed: Vec<u64>,
        bad_reads_total: u64,
        failed_total: u64,
        problems: Vec<String>,
        triggered_secs: f64,
        balanced_secs: f64,
        end_secs: f64,
        moved: u32,
        skewed_mean: f64,
        after_mean: f64,
        tool_cpu_seconds: f64,
        tool_output: String,
        per_node_before: Vec<(u32, usize)>,
        per_node_after: Vec<(u32, usize)>,
    }

    fn per_node(map: &camelot_cluster::ClusterMap) -> Vec<(u32, usize)> {
        map.nodes
            .iter()
            .map(|n| {
                (
                    n.id,
                    (0..map.partitions())
                        .filter(|&p| map.primary(p) == Some(n.id))
                        .count(),
                )
            })
            .collect()
    }

    /// The map is balanced again: the planner has nothing to move, no move is recorded,
    /// nothing is fenced.
    fn balanced(nodes: &EtcdNodes) -> Result<Option<camelot_cluster::ClusterMap>, BenchError> {
        let map = nodes.map()?;
        let plan =
            camelot_cluster::plan(&map).map_err(|e| BenchError::Setup(format!("planning: {e}")))?;
        Ok(
            (plan.moves.is_empty() && map.fenced.is_empty() && !nodes.move_in_progress()?)
                .then_some(map),
        )
    }

    fn one_run(cfg: &RebalanceConfig, binary: &Path, mode: Mode) -> Result<RunResult, BenchError> {
        let spec = NodeSpec {
            ops_per_sec_max: Some(cfg.node_ops_per_sec),
        };
        let specs: Vec<NodeSpec> = (0..cfg.nodes).map(|_| spec).collect();
        let nodes = EtcdNodes::start(binary, cfg.memory_bytes_per_node, &specs, cfg.partitions, 1)?;
        let start_map = nodes.publish(skewed(&nodes.map()?, cfg.skew)?)?;
        let load = cfg.load();
        load_records(&nodes.client(ClientConfig::default())?, &load)?;
        let clients = (0..cfg.threads)
            .map(|_| nodes.client(ClientConfig::default()))
            .collect::<Result<Vec<_>, _>>()?;
        let one_class = |_: u32| 0usize;
        let stop = AtomicBool::new(false);
        let t0 = Instant::now();
        let secs = || t0.elapsed().as_secs_f64();
        let mut triggered_secs = 0.0;
        let mut balanced_secs = 0.0;
        let mut tool_cpu_seconds = 0.0;
        let mut tool_output = String::new();
        let mut final_map = None;
        let (tally, end_secs) = std::thread::scope(|s| -> Result<_, BenchError> {
            let running = s.spawn(|| {
                crate::cluster_load::run(&clients, &load, 1, &one_class, t0, Until::Flag(&stop))
            });
            let work = (|| -> Result<(), BenchError> {
                std::thread::sleep(Duration::from_secs_f64(cfg.skewed_seconds));
                triggered_secs = secs();
                match mode {
                    Mode::Manual => {
                        let tool = nodes.run_tool(&["cluster", "rebalance"], REBALANCE_TIME_MAX)?;
                        tool_cpu_seconds = tool.cpu_seconds;
                        tool_output = tool.stdout;
                        final_map = balanced(&nodes)?;
                        if final_map.is_none() {
                            return Err(BenchError::Check(format!(
                                "cluster rebalance ended with the map still unbalanced:\n{tool_output}"
                            )));
                        }
                    }
                    Mode::Automatic => {
                        let ctl =
                            nodes.start_tool(&["cluster", "controller", "--auto-rebalance"])?;
                        let deadline = Instant::now() + REBALANCE_TIME_MAX;
                        // The controller first has to lead and see the skew.
                        while final_map.is_none() || !ctl.stdout().contains("plan done") {
                            if Instant::now() > deadline {
                                return Err(BenchError::Setup(format!(
                                    "the controller did not rebalance within {REBALANCE_TIME_MAX:?}:\n{}",
                                    ctl.stdout()
                                )));
                            }
                            std::thread::sleep(Duration::from_millis(20));
                            final_map = balanced(&nodes)?;
                        }
                        tool_cpu_seconds = ctl.cpu_seconds();
                        tool_output = ctl.stdout();
                    }
                }
                if let Some(m) = &final_map {
                    nodes.wait_installed(m.epoch)?;
                }
                balanced_secs = secs();
                std::thread::sleep(Duration::from_secs_f64(cfg.after_seconds));
                Ok(())
            })();
            let end_secs = secs();
            stop.store(true, Ordering::Relaxed);
            let tally = running
                .join()
                .map_err(|_| BenchError::Setup("the load thread panicked".into()))?;
            work?;
            Ok((tally?, end_secs))
        })?;
        let final_map = final_map.ok_or_else(|| BenchError::Setup("no final map".into()))?;
        let ops: Vec<u64> = tally.buckets.iter().map(|b| b.ops).collect();
        let skewed_mean = mean_after(&ops, 1.0, triggered_secs).ok_or_else(|| {
            BenchError::Setup("no complete second of load on the skewed map".into())
        })?;
        let after_mean = mean_after(&ops, balanced_secs, end_secs).ok_or_else(|| {
            BenchError::Setup("no complete second of load after the rebalance".into())
        })?;
        Ok(RunResult {
            mode,
            failed: tally.buckets.iter().map(|b| b.failed).collect(),
            ops,
            bad_reads_total: tally.bad_reads,
            failed_total: tally.failed,
            problems: tally.problems.clone(),
            triggered_secs,
            balanced_secs,
            end_secs,
            moved: partitions_moved(&start_map, &final_map),
            skewed_mean,
            after_mean,
            tool_cpu_seconds,
            tool_output,
            per_node_before: per_node(&start_map),
            per_node_after: per_node(&final_map),
        })
    }

    /// Runs `bench cluster rebalance`; writes `cluster-rebalance.json` and its figure.
    pub fn run(cfg: &RebalanceConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
        cfg.validate()?;
        let started = now_rfc3339();
        let Placement::Separate { binary } = Placement::choose(false)? else {
            return Err(BenchError::InvalidConfig(
                "the cluster benches need `camelot server` processes".into(),
            ));
        };
        let manual = one_run(cfg, &binary, Mode::Manual)?;
        let auto = one_run(cfg, &binary, Mode::Automatic)?;

        let mut series = Vec::new();
        for r in [&manual, &auto] {
            let mut s = Series::new(format!("{} rebalancing", r.mode.label()));
            for (i, (&o, &f)) in r.ops.iter().zip(&r.failed).enumerate() {
                let mut p = Point::new(i as u64);
                p.ops_per_sec = Some(o as f64);
                p.extra.insert("failed".into(), json!(f));
                p.extra
                    .insert("complete".into(), json!((i + 1) as f64 <= r.end_secs));
                s.points.push(p);
            }
            series.push(s);
        }
        let mut comparisons = vec![Comparison::new(
            "throughput after rebalancing, automatic ÷ manual",
            auto.after_mean,
            manual.after_mean,
            "ops/s",
            "manual (cluster rebalance)",
        )
        .with_target(AUTO_RATIO_TARGET, false)];
        for r in [&manual, &auto] {
            comparisons.push(Comparison::new(
                format!(
                    "{} rebalancing: throughput after ÷ on the skewed map",
                    r.mode.label()
                ),
                r.after_mean,
                r.skewed_mean,
                "ops/s",
                "skewed start",
            ));
            let issued: u64 = r.ops.iter().sum();
            comparisons.push(
                Comparison::new(
                    format!(
                        "{} rebalancing: client operations answered right ÷ issued",
                        r.mode.label()
                    ),
                    issued.saturating_sub(r.failed_total + r.bad_reads_total) as f64,
                    issued as f64,
                    "ops",
                    "operations issued",
                )
                .with_target(1.0, false),
            );
        }
        let runs_json: Vec<serde_json::Value> = [&manual, &auto]
            .iter()
            .map(|r| {
                json!({
                    "mode": r.mode.label(),
                    "tool": match r.mode {
                        Mode::Manual => "camelot cluster rebalance --etcd URL",
                        Mode::Automatic => "camelot cluster controller --auto-rebalance --etcd URL (started at the trigger second)",
                    },
                    "triggered_at_secs": r.triggered_secs,
                    "balanced_at_secs": r.balanced_secs,
                    "rebalance_seconds": r.balanced_secs - r.triggered_secs,
                    "run_seconds": r.end_secs,
                    "partitions_moved": r.moved,
                    "skewed_ops_per_sec": r.skewed_mean,
                    "after_ops_per_sec": r.after_mean,
                    "failed_client_operations": r.failed_total,
                    "bad_reads": r.bad_reads_total,
                    "problems": r.problems,
                    "tool_cpu_seconds": r.tool_cpu_seconds,
                    "tool_output": r.tool_output.lines().take(200).collect::<Vec<_>>(),
                    "primaries_per_node_before": r.per_node_before,
                    "primaries_per_node_after": r.per_node_after,
                })
            })
            .collect();
        let client = ClientSide {
            client: "camelot-client KV API, one client per thread following the map in etcd; \
                     YCSB-B closed loop"
                .into(),
            client_threads: cfg.threads,
            depth: 1,
            data_model: format!("one {}-byte value per record", cfg.value_bytes),
            resp_face: false,
        };
        let flags = vec![
            "--memory".to_string(),
            cfg.memory_bytes_per_node.to_string(),
            "--ops-per-sec-max".to_string(),
            cfg.node_ops_per_sec.to_string(),
        ];
        let side = crate::side::Side {
            label: "camelot".into(),
            server: "camelot".into(),
            process: "separate".into(),
            server_threads: Some(crate::side::cores()),
            nodes: cfg.nodes as usize,
            version: format!("camelot {}", env!("CARGO_PKG_VERSION")),
            command: format!(
                "{} server --listen 127.0.0.1:PORT {} --etcd URL --node-id N",
                binary.display(),
                flags.join(" ")
            ),
            flags,
            client,
        };
        let config = json!({
            "x": "second",
            "sides": sides_json(&[side]),
            "nodes": cfg.nodes,
            "partitions": cfg.partitions,
            "replication": 1,
            "skew": format!("node 0 holds {:.0}% of the partitions at the start, the rest spread evenly", cfg.skew * 100.0),
            "node_ops_per_sec_max": cfg.node_ops_per_sec,
            "node_capacity_by": "every node throttled alike (--ops-per-sec-max): fixed-capacity nodes on one shared machine",
            "records": cfg.records,
            "value_bytes": cfg.value_bytes,
            "workload": "YCSB-B: 95% GET, 5% PUT, scrambled zipfian (0.99), closed loop",
            "threads": cfg.threads,
            "skewed_seconds": cfg.skewed_seconds,
            "after_seconds": cfg.after_seconds,
            "after_mean": "mean of the complete 1 s buckets after the map was balanced and installed",
            "runs": runs_json,
            "etcd": camelot_testkit::EtcdServer::version().ok(),
            "memory_bytes_per_node": cfg.memory_bytes_per_node,
            "quick": cfg.quick,
        });
        let mut result = BenchResult::new("cluster-rebalance", started, config, series);
        result.comparisons = comparisons;
        let mut panel = Panel::new("throughput per 1 s bucket", "second", "ops/s");
        for s in &result.series {
            panel = panel.line(
                &s.label,
                camelot_results::plot::series_points(s, |p| p.ops_per_sec),
            );
        }
        let figure = Figure::new(&format!(
            "Rebalancing a skewed cluster under YCSB-B: manual (balanced {:.1} s after the trigger) and automatic ({:.1} s)",
            manual.balanced_secs - manual.triggered_secs,
            auto.balanced_secs - auto.triggered_secs
        ))
        .panel(panel);
        Ok(camelot_results::output::write_result_with_figure(
            out, &result, &figure,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_cluster::{ClusterMap, Node};

    fn nodes(n: u32) -> Vec<Node> {
        (0..n)
            .map(|id| Node {
                id,
                addr: std::net::SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16)),
                weight: 1,
                lease: 0,
                incarnation: 0,
            })
            .collect()
    }

    #[test]
    fn the_skewed_start_is_skewed_and_the_plan_undoes_it() {
        let even = ClusterMap::initial(nodes(3), 256, 1).unwrap();
        let s = skewed(&even, 0.6).unwrap();
        let count = |n: u32| (0..256).filter(|&p| s.primary(p) == Some(n)).count();
        assert_eq!(count(0), 154);
        assert_eq!(count(1) + count(2), 102);
        assert!(count(1).abs_diff(count(2)) <= 1);
        let plan = camelot_cluster::plan(&s).unwrap();
        assert!(plan.moves.iter().all(|m| s.primary(m.partition) == Some(0)));
        assert!(
            (68..=70).contains(&plan.moves.len()),
            "{}",
            plan.moves.len()
        );
    }

    #[test]
    fn means_take_complete_buckets_after_the_mark() {
        let ops = [5, 100, 100, 40, 200, 210, 7];
        assert_eq!(mean_after(&ops, 1.0, 3.2), Some(100.0));
        assert_eq!(mean_after(&ops, 3.5, 6.5), Some(205.0));
        assert_eq!(mean_after(&ops, 6.1, 6.5), None);
    }

    #[test]
    fn configs_are_checked() {
        let ok = RebalanceConfig::default();
        ok.validate().unwrap();
        let mut q = ok.clone();
        q.apply_quick();
        q.validate().unwrap();
        for bad in [
            RebalanceConfig {
                nodes: 1,
                ..ok.clone()
            },
            RebalanceConfig {
                skew: 0.2,
                ..ok.clone()
            },
            RebalanceConfig {
                skew: 1.0,
                ..ok.clone()
            },
            RebalanceConfig {
                node_ops_per_sec: 0,
                ..ok.clone()
            },
            RebalanceConfig {
                after_seconds: -1.0,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
