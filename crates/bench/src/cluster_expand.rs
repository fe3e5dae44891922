//! `camelot bench cluster expand`: seed 004's cluster expansion under load. A cluster on
//! etcd grows 2 → 3 → 4 nodes while a steady YCSB-B load (1 KiB values) runs: each new
//! `camelot server` registers, then `camelot cluster rebalance` — the command a user runs
//! — puts it in the map and moves the planner's partitions to it (copy, catch-up, a
//! bounded write fence, switch, cleanup). Recorded per 1 s bucket: operations finished,
//! failed, bad reads, the slowest operation, and each node's CPU; per step: partitions
//! moved against P/N, the rebalance's own time and CPU.
//!
//! The load is steady: paced at a share of what the starting cluster served flat out
//! (measured first, same run), each operation's latency counted from when it was due. The
//! issue's targets: no failed client operation, every 1 s bucket at least 0.8× the
//! throughput before the expansion, partitions moved within 10 % of P/N.

use std::path::{Path, PathBuf};

use crate::checks::check_seconds;
use crate::cluster_load::{KvLoad, YCSB_B_READ_FRACTION};
use crate::BenchError;

/// The targets.
pub const BUCKET_RATIO_TARGET: f64 = 0.8;
pub const MOVED_TOLERANCE: f64 = 0.1;
/// Moves copy at this share of an iperf3 loopback stream or better (issue 19).
pub const COPY_RATIO_TARGET: f64 = 0.3;
pub const THREADS_MAX: usize = 64;
/// Server counters the result sums over the nodes: copies a backup refused at another
/// epoch, how the writes behind them ended, and the moves' pages pushed by their sources.
#[cfg(feature = "etcd")]
const REPLICA_COUNTERS: [&str; 7] = [
    "batches_ahead_of_epoch",
    "replica_copies_failed",
    "replica_resends_acknowledged",
    "replica_writes_failed",
    "pages_pushed",
    "copies_pushed",
    "pages_push_failed",
];
/// Longest one `camelot cluster rebalance` may take before the run is abandoned.
pub const REBALANCE_TIME_MAX: std::time::Duration = std::time::Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct ExpandConfig {
    pub start_nodes: u32,
    pub end_nodes: u32,
    pub partitions: u32,
    /// Replicas per partition (primary-backup); with R > 1 a rebalance move replaces one
    /// member of a replica set.
    pub replication: u32,
    pub records: u64,
    pub value_bytes: usize,
    pub threads: usize,
    /// The steady load's rate as a share of the starting cluster's closed-loop rate.
    pub load_fraction: f64,
    /// Seconds of the closed-loop measurement that sets the rate.
    pub calibrate_seconds: f64,
    /// Seconds of steady load before the first new node and after each rebalance.
    pub settle_seconds: f64,
    pub memory_bytes_per_node: u64,
    /// Seconds of the iperf3 loopback stream the moves' copy rate is set against, run
    /// after the cluster is stopped (0: none, and no copy-rate comparison).
    pub iperf3_seconds: u64,
    pub quick: bool,
}

impl Default for ExpandConfig {
    fn default() -> Self {
        ExpandConfig {
            start_nodes: 2,
            end_nodes: 4,
            partitions: camelot_cluster::PARTITIONS_DEFAULT,
            replication: 1,
            records: 50_000,
            value_bytes: 1024,
            threads: 8,
            load_fraction: 0.5,
            calibrate_seconds: 3.0,
            settle_seconds: 5.0,
            memory_bytes_per_node: 256 << 20,
            iperf3_seconds: 2,
            quick: false,
        }
    }
}

impl ExpandConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.records = 10_000;
        self.calibrate_seconds = 1.0;
        self.settle_seconds = 2.0;
        self.iperf3_seconds = 1;
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if self.start_nodes == 0
            || self.end_nodes <= self.start_nodes
            || self.end_nodes as usize > crate::cluster::BENCH_CLUSTER_NODES_MAX
        {
            return Err(BenchError::InvalidConfig(format!(
                "the cluster must grow: 1 ≤ start nodes < end nodes ≤ {}",
                crate::cluster::BENCH_CLUSTER_NODES_MAX
            )));
        }
        if !(self.end_nodes..=camelot_cluster::map::PARTITIONS_MAX).contains(&self.partitions) {
            return Err(BenchError::InvalidConfig(format!(
                "partitions must be the end node count to {}",
                camelot_cluster::map::PARTITIONS_MAX
            )));
        }
        if self.replication == 0 || self.replication > self.start_nodes {
            return Err(BenchError::InvalidConfig(
                "replication must be 1 to the start node count".into(),
            ));
        }
        if !(self.load_fraction > 0.0 && self.load_fraction <= 1.0) {
            return Err(BenchError::InvalidConfig(
                "the load fraction must be above 0 and at most 1".into(),
            ));
        }
        check_seconds("calibrate seconds", self.calibrate_seconds)?;
        check_seconds("settle seconds", self.settle_seconds)?;
        // Values only: what the starting nodes must hold at the least, before any
        // per-record overhead; a load past it would fail half-way with OUT_OF_MEMORY.
        let values_bytes = self
            .records
            .saturating_mul(self.value_bytes as u64)
            .saturating_mul(u64::from(self.replication));
        let room_bytes = self
            .memory_bytes_per_node
            .saturating_mul(u64::from(self.start_nodes));
        if values_bytes > room_bytes {
            return Err(BenchError::InvalidConfig(format!(
                "{} records of {} bytes × R = {} need {values_bytes} bytes; the {} starting nodes have {room_bytes}",
                self.records, self.value_bytes, self.replication, self.start_nodes
            )));
        }
        self.load(None).validate(THREADS_MAX)
    }

    fn load(&self, rate: Option<f64>) -> KvLoad {
        KvLoad {
            records: self.records,
            value_bytes: self.value_bytes,
            threads: self.threads,
            read_fraction: YCSB_B_READ_FRACTION,
            target_ops_per_sec: rate,
            seed: 0x5eed_0e4d,
        }
    }
}

/// Replica slots gained between two maps: each node a partition's set names after and
/// not before (with R = 1, the partitions whose primary changed).
pub fn replicas_moved(
    before: &camelot_cluster::ClusterMap,
    after: &camelot_cluster::ClusterMap,
) -> u32 {
    (0..before.partitions().min(after.partitions()))
        .map(|p| {
            after
                .replicas(p)
                .iter()
                .filter(|n| !before.replicas(p).contains(n))
                .count() as u32
        })
        .sum()
}

/// Partitions whose primary differs between two maps.
pub fn partitions_moved(
    before: &camelot_cluster::ClusterMap,
    after: &camelot_cluster::ClusterMap,
) -> u32 {
    (0..before.partitions().min(after.partitions()))
        .filter(|&p| before.primary(p) != after.primary(p))
        .count() as u32
}

/// One finished move as `camelot cluster rebalance` reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoveCopy {
    pub bytes_copied: u64,
    pub copy_secs: f64,
}

/// The moves that switched, from the JSON line `camelot cluster rebalance --json` prints
/// last (rolled-back moves are skipped). An error when there is none: a rebalance whose
/// report cannot be read must not pass for one that moved nothing.
pub fn move_copies(output: &str) -> Result<Vec<MoveCopy>, BenchError> {
    let line = output
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| {
            BenchError::Setup("`cluster rebalance --json` printed no report line".into())
        })?;
    let report: camelot_cluster::moves::RebalanceReport = serde_json::from_str(line)
        .map_err(|e| BenchError::Setup(format!("`cluster rebalance --json`'s report: {e}")))?;
    Ok(report
        .moves
        .iter()
        .filter(|m| m.switched)
        .map(|m| MoveCopy {
            bytes_copied: m.bytes_copied,
            copy_secs: m.copy_secs,
        })
        .collect())
}

/// Value bytes copied per second over all `moves` (their copy times summed), or `None`
/// when they took no measurable time.
pub fn copy_rate_bytes_per_sec(moves: &[MoveCopy]) -> Option<f64> {
    let secs: f64 = moves.iter().map(|m| m.copy_secs).sum();
    let bytes: u64 = moves.iter().map(|m| m.bytes_copied).sum();
    (secs > 0.0).then(|| bytes as f64 / secs)
}

/// The throughput before the expansion: the mean of the complete buckets from the second
/// (the first holds the start-up) up to `first_change_secs`. `None` without one.
pub fn baseline(ops: &[u64], first_change_secs: f64) -> Option<f64> {
    let end = first_change_secs.floor() as usize;
    let before: Vec<u64> = ops.iter().take(end).skip(1).copied().collect();
    if before.is_empty() {
        return None;
    }
    Some(before.iter().sum::<u64>() as f64 / before.len() as f64)
}

/// The slowest complete bucket from `from_secs` on (the bucket it falls in included) to
/// `end_secs` (a bucket ending after it is partial and left out): (its index, its ops).
pub fn slowest_bucket(ops: &[u64], from_secs: f64, end_secs: f64) -> Option<(usize, u64)> {
    let first = from_secs.floor() as usize;
    let last_complete = end_secs.floor() as usize; // buckets [i, i+1) with i + 1 <= end
    (first..last_complete.min(ops.len()))
        .map(|i| (i, ops[i]))
        .min_by_key(|&(_, o)| o)
}

#[cfg(not(feature = "etcd"))]
pub fn run(_cfg: &ExpandConfig, _out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    Err(BenchError::InvalidConfig(crate::cluster::NO_ETCD.into()))
}

#[cfg(feature = "etcd")]
pub use with_etcd::run;

#[cfg(feature = "etcd")]
mod with_etcd {
    use super::*;
    use crate::cluster_etcd::{EtcdNodes, NodeSpec};
    use crate::cluster_load::{is_value_of, load_records, Until};
    use crate::side::{sides_json, ClientSide, Placement};
    use camelot_client::ClientConfig;
    use camelot_results::plot::{Figure, Panel};
    use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Series};
    use parking_lot::Mutex;
    use serde_json::json;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// One node added and rebalanced onto.
    struct Step {
        node: u32,
        nodes_after: u32,
        added_secs: f64,
        rebalance_started_secs: f64,
        rebalanced_secs: f64,
        moved: u32,
        epoch_before: u64,
        epoch_after: u64,
        tool: crate::cluster_etcd::Tool,
    }

    /// One sample: the second it was taken at, and (node, CPU seconds so far) of each.
    type CpuSample = (usize, Vec<(u32, f64)>);

    /// Every node's CPU seconds at each whole second since `t0`, sampled by a thread.
    struct CpuSamples {
        /// (node, pid) of every server so far.
        pids: Mutex<Vec<(u32, u32)>>,
        /// Per sample: second index, then (node, CPU seconds so far).
        samples: Mutex<Vec<CpuSample>>,
    }

    impl CpuSamples {
        fn sample(&self, second: usize) {
            let pids = self.pids.lock().clone();
            let row = pids
                .iter()
                .filter_map(|&(node, pid)| {
                    camelot_testkit::cpu_seconds(pid).ok().map(|c| (node, c))
                })
                .collect();
            let mut samples = self.samples.lock();
            if samples.len() < crate::cluster_load::BUCKETS_MAX {
                samples.push((second, row));
            }
        }

        /// Per node: CPU seconds used in each second (a node's first second is from its
        /// first sample).
        fn per_second(&self) -> std::collections::BTreeMap<u32, Vec<(usize, f64)>> {
            let samples = self.samples.lock();
            let mut out: std::collections::BTreeMap<u32, Vec<(usize, f64)>> = Default::default();
            for pair in samples.windows(2) {
                let (_, before) = &pair[0];
                let (second, after) = &pair[1];
                for &(node, now) in after {
                    if let Some(&(_, then)) = before.iter().find(|(n, _)| *n == node) {
                        out.entry(node)
                            .or_default()
                            .push((second - 1, (now - then).max(0.0)));
                    }
                }
            }
            out
        }
    }

    /// Runs `bench cluster expand`; writes `cluster-expand.json` and its figure.
    pub fn run(cfg: &ExpandConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
        cfg.validate()?;
        let started = now_rfc3339();
        let Placement::Separate { binary } = Placement::choose(false)? else {
            return Err(BenchError::InvalidConfig(
                "the cluster benches need `camelot server` processes".into(),
            ));
        };
        let fast = NodeSpec {
            ops_per_sec_max: None,
        };
        let specs: Vec<NodeSpec> = (0..cfg.start_nodes).map(|_| fast).collect();
        let mut nodes = EtcdNodes::start(
            &binary,
            cfg.memory_bytes_per_node,
            &specs,
            cfg.partitions,
            cfg.replication,
        )?;
        let closed = cfg.load(None);
        load_records(&nodes.client(ClientConfig::default())?, &closed)?;
        let clients = (0..cfg.threads)
            .map(|_| nodes.client(ClientConfig::default()))
            .collect::<Result<Vec<_>, _>>()?;
        let one_class = |_: u32| 0usize;
        // Closed loop first: what the starting cluster serves flat out sets the rate.
        let calibration = crate::cluster_load::run(
            &clients,
            &closed,
            1,
            &one_class,
            Instant::now(),
            Until::Elapsed(Duration::from_secs_f64(cfg.calibrate_seconds)),
        )?;
        if calibration.failed > 0 || calibration.bad_reads > 0 {
            return Err(BenchError::Check(format!(
                "calibration: {} failed, {} bad reads: {:?}",
                calibration.failed, calibration.bad_reads, calibration.problems
            )));
        }
        let flat_out = calibration.ops() as f64 / calibration.seconds;
        let rate = flat_out * cfg.load_fraction;
        let steady = cfg.load(Some(rate));

        let cpu = CpuSamples {
            pids: Mutex::new(
                nodes
                    .processes()
                    .iter()
                    .map(|(id, p)| (*id, p.pid()))
                    .collect(),
            ),
            samples: Mutex::new(Vec::new()),
        };
        let stop = AtomicBool::new(false);
        let t0 = Instant::now();
        let secs = || t0.elapsed().as_secs_f64();
        let mut steps: Vec<Step> = Vec::new();
        let (tally, end_secs) = std::thread::scope(|s| -> Result<_, BenchError> {
            let load = s.spawn(|| {
                crate::cluster_load::run(&clients, &steady, 1, &one_class, t0, Until::Flag(&stop))
            });
            let sampler = s.spawn(|| {
                let mut second = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    cpu.sample(second);
                    second += 1;
                    let next = t0 + Duration::from_secs(second as u64);
                    while Instant::now() < next && !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(
                            Duration::from_millis(10)
                                .min(next.saturating_duration_since(Instant::now())),
                        );
                    }
                }
            });
            let work = (|| -> Result<(), BenchError> {
                std::thread::sleep(Duration::from_secs_f64(cfg.settle_seconds));
                for _ in cfg.start_nodes..cfg.end_nodes {
                    let added_secs = secs();
                    let node = nodes.add(fast)?;
                    if let Some((_, p)) = nodes.processes().into_iter().find(|(id, _)| *id == node)
                    {
                        cpu.pids.lock().push((node, p.pid()));
                    }
                    let before = nodes.map()?;
                    let rebalance_started_secs = secs();
                    let tool =
                        nodes.run_tool(&["cluster", "rebalance", "--json"], REBALANCE_TIME_MAX)?;
                    let after = nodes.map()?;
                    nodes.wait_installed(after.epoch)?;
                    let rebalanced_secs = secs();
                    steps.push(Step {
                        node,
                        nodes_after: after.nodes.len() as u32,
                        added_secs,
                        rebalance_started_secs,
                        rebalanced_secs,
                        moved: if cfg.replication > 1 {
                            replicas_moved(&before, &after)
                        } else {
                            partitions_moved(&before, &after)
                        },
                        epoch_before: before.epoch,
                        epoch_after: after.epoch,
                        tool,
                    });
                    std::thread::sleep(Duration::from_secs_f64(cfg.settle_seconds));
                }
                Ok(())
            })();
            let end_secs = secs();
            stop.store(true, Ordering::Relaxed);
            let tally = load
                .join()
                .map_err(|_| BenchError::Setup("the load thread panicked".into()))?;
            sampler
                .join()
                .map_err(|_| BenchError::Setup("the CPU sampler panicked".into()))?;
            work?;
            Ok((tally?, end_secs))
        })?;

        // Every record read back through a fresh client on the final map.
        let reader = nodes.client(ClientConfig::default())?;
        let mut missing = 0u64;
        let keys: Vec<String> = (0..cfg.records)
            .map(crate::ycsb::generators::key_name)
            .collect();
        for chunk in keys.chunks(1024) {
            let got = reader
                .get_many(chunk)
                .map_err(|e| BenchError::Setup(format!("reading back: {e}")))?;
            for (k, v) in chunk.iter().zip(got) {
                if !v.is_some_and(|v| is_value_of(k, &v.value, cfg.value_bytes)) {
                    missing += 1;
                }
            }
        }
        let final_map = nodes.map()?;
        // How often a copy met a backup at another epoch, and how it ended: summed over
        // the nodes (a server without a counter adds nothing).
        let probe = nodes.raw_client()?;
        let mut replica_counters: std::collections::BTreeMap<String, u64> = Default::default();
        for n in &final_map.nodes {
            let stats = probe
                .stats(n.id)
                .map_err(|e| BenchError::Setup(format!("stats of node {}: {e}", n.id)))?;
            for (k, v) in stats {
                if REPLICA_COUNTERS.contains(&k.as_str()) {
                    *replica_counters.entry(k).or_default() += v;
                }
            }
        }
        let per_node_partitions: Vec<(u32, usize)> = final_map
            .nodes
            .iter()
            .map(|n| {
                (
                    n.id,
                    (0..final_map.partitions())
                        .filter(|&p| final_map.primary(p) == Some(n.id))
                        .count(),
                )
            })
            .collect();
        let node_cpu = cpu.per_second();
        drop(reader);
        drop(clients);
        drop(nodes);
        // After the cluster is gone, so the stream has the machine the moves had less of.
        let iperf = crate::peers::iperf3_tcp_stream_for(cfg.iperf3_seconds)?;
        let mut copies: Vec<MoveCopy> = Vec::new();
        for st in &steps {
            copies.extend(move_copies(&st.tool.stdout)?);
        }
        let copy_rate = copy_rate_bytes_per_sec(&copies);

        let ops: Vec<u64> = tally.buckets.iter().map(|b| b.ops).collect();
        let first_change = steps.first().map_or(end_secs, |s| s.added_secs);
        let base = baseline(&ops, first_change).ok_or_else(|| {
            BenchError::Setup("no complete second of load before the expansion".into())
        })?;
        let slowest = slowest_bucket(&ops, first_change, end_secs);

        let mut throughput = Series::new("operations per 1 s bucket");
        for (i, b) in tally.buckets.iter().enumerate() {
            let mut p = Point::new(i as u64);
            p.ops_per_sec = Some(b.ops as f64);
            p.extra.insert("failed".into(), json!(b.failed));
            p.extra.insert("bad_reads".into(), json!(b.bad_reads));
            p.extra.insert(
                "latency_us_max".into(),
                json!(b.latency_ns_max as f64 / 1e3),
            );
            p.extra.insert(
                "read_call_us_max".into(),
                json!(b.read_call_ns_max as f64 / 1e3),
            );
            p.extra.insert(
                "write_call_us_max".into(),
                json!(b.write_call_ns_max as f64 / 1e3),
            );
            p.extra
                .insert("complete".into(), json!((i + 1) as f64 <= end_secs));
            throughput.points.push(p);
        }
        let mut series = vec![throughput];
        for (node, per_sec) in &node_cpu {
            let mut s = Series::new(format!("node {node} CPU"));
            for &(second, cpu_s) in per_sec {
                let mut p = Point::new(second as u64);
                p.extra.insert("cpu_seconds".into(), json!(cpu_s));
                s.points.push(p);
            }
            series.push(s);
        }

        // Slots to spread: P with R = 1, P·R replicas otherwise (a move then gains a set
        // member rather than a primary).
        let p = f64::from(cfg.partitions) * f64::from(cfg.replication);
        let mut comparisons = Vec::new();
        if let Some((i, o)) = slowest {
            comparisons.push(
                Comparison::new(
                    format!("slowest 1 s bucket from the first new node on (second {i}) ÷ before"),
                    o as f64,
                    base,
                    "ops/s",
                    "mean 1 s bucket before the expansion",
                )
                .with_target(BUCKET_RATIO_TARGET, false),
            );
        }
        let (unit, per) = if cfg.replication > 1 {
            ("replicas", "P·R/N")
        } else {
            ("partitions", "P/N")
        };
        for st in &steps {
            let share = p / f64::from(st.nodes_after);
            let name = format!(
                "{unit} moved, {} → {} nodes, ÷ {per}",
                st.nodes_after - 1,
                st.nodes_after
            );
            comparisons.push(
                Comparison::new(name.clone(), f64::from(st.moved), share, unit, per)
                    .with_target(1.0 + MOVED_TOLERANCE, true),
            );
            comparisons.push(
                Comparison::new(name, f64::from(st.moved), share, unit, per)
                    .with_target(1.0 - MOVED_TOLERANCE, false),
            );
        }
        if let (Some(rate), Some(i)) = (copy_rate, &iperf) {
            comparisons.push(
                Comparison::new(
                    format!(
                        "moves' copy rate ({} moves, value bytes ÷ copy seconds) ÷ iperf3",
                        copies.len()
                    ),
                    rate,
                    i.bytes_per_sec,
                    "B/s",
                    "iperf3 stream (loopback), after the run",
                )
                .with_target(COPY_RATIO_TARGET, false),
            );
        }
        let ok_ops = tally.ops().saturating_sub(tally.failed + tally.bad_reads);
        comparisons.push(
            Comparison::new(
                "client operations answered right ÷ issued",
                ok_ops as f64,
                tally.ops() as f64,
                "ops",
                "operations issued",
            )
            .with_target(1.0, false),
        );
        comparisons.push(
            Comparison::new(
                "records read back right after the expansion ÷ loaded",
                (cfg.records - missing.min(cfg.records)) as f64,
                cfg.records as f64,
                "records",
                "records loaded",
            )
            .with_target(1.0, false),
        );

        let steps_json: Vec<serde_json::Value> = steps
            .iter()
            .map(|st| {
                json!({
                    "node_added": st.node,
                    "nodes_after": st.nodes_after,
                    "node_started_at_secs": st.added_secs,
                    "rebalance_started_at_secs": st.rebalance_started_secs,
                    "rebalanced_at_secs": st.rebalanced_secs,
                    "rebalance_seconds": st.tool.seconds,
                    "rebalance_cpu_seconds": st.tool.cpu_seconds,
                    "partitions_moved": st.moved,
                    "p_over_n": p / f64::from(st.nodes_after),
                    "epoch_before": st.epoch_before,
                    "epoch_after": st.epoch_after,
                    "rebalance_output": st.tool.stdout.lines().collect::<Vec<_>>(),
                })
            })
            .collect();
        let client = ClientSide {
            client: format!(
                "camelot-client KV API, one client per thread following the map in etcd; \
                 YCSB-B paced at {rate:.0} ops/s"
            ),
            client_threads: cfg.threads,
            depth: 1,
            data_model: format!("one {}-byte value per record", cfg.value_bytes),
            resp_face: false,
        };
        let side = crate::side::Side {
            label: "camelot".into(),
            server: "camelot".into(),
            process: "separate".into(),
            server_threads: Some(crate::side::cores()),
            nodes: cfg.end_nodes as usize,
            version: format!("camelot {}", env!("CARGO_PKG_VERSION")),
            flags: vec!["--memory".into(), cfg.memory_bytes_per_node.to_string()],
            command: format!(
                "{} server --listen 127.0.0.1:PORT --memory {} --etcd URL --node-id N",
                binary.display(),
                cfg.memory_bytes_per_node
            ),
            client,
        };
        let mut sides = vec![side];
        if let Some(i) = &iperf {
            sides.push(crate::side::iperf3_side(i)?);
        }
        let config = json!({
            "x": "second",
            "sides": sides_json(&sides),
            "start_nodes": cfg.start_nodes,
            "end_nodes": cfg.end_nodes,
            "partitions": cfg.partitions,
            "replication": cfg.replication,
            "records": cfg.records,
            "value_bytes": cfg.value_bytes,
            "workload": "YCSB-B: 95% GET, 5% PUT, scrambled zipfian (0.99)",
            "threads": cfg.threads,
            "closed_loop_ops_per_sec": flat_out,
            "load_fraction": cfg.load_fraction,
            "target_ops_per_sec": rate,
            "pacing": "each thread at its share of the rate; latency from when an operation was due",
            "calibrate_seconds": cfg.calibrate_seconds,
            "settle_seconds": cfg.settle_seconds,
            "rebalance": "camelot cluster rebalance --json --etcd URL (adds the live nodes to the map, then the planner's moves, one per (from, to) pair)",
            "steps": steps_json,
            "baseline_ops_per_sec": base,
            "run_seconds": end_secs,
            "operations": tally.ops(),
            "failed_client_operations": tally.failed,
            "bad_reads": tally.bad_reads,
            "problems": tally.problems,
            "records_missing_after": missing,
            "server_counters_summed": replica_counters,
            "primaries_per_node_after": per_node_partitions,
            "etcd": camelot_testkit::EtcdServer::version().ok(),
            "memory_bytes_per_node": cfg.memory_bytes_per_node,
            "move_copy_bytes_per_sec": copy_rate,
            "iperf3": iperf.as_ref().map(|i| i.command.clone()),
            "iperf3_bytes_per_sec": iperf.as_ref().map(|i| i.bytes_per_sec),
            "iperf3_seconds": cfg.iperf3_seconds,
            "quick": cfg.quick,
        });
        let mut result = BenchResult::new("cluster-expand", started, config, series);
        result.comparisons = comparisons;
        let figure = figure(&result, base, &steps);
        Ok(camelot_results::output::write_result_with_figure(
            out, &result, &figure,
        )?)
    }

    fn figure(result: &BenchResult, base: f64, steps: &[Step]) -> Figure {
        use camelot_results::plot::series_points;
        let mut rate = Panel::new("throughput per 1 s bucket", "second", "ops/s")
            .reference("before the expansion", base)
            .reference("0.8 × before (target)", base * BUCKET_RATIO_TARGET);
        let mut cpu = Panel::new("CPU per node", "second", "CPU-s per s");
        for s in &result.series {
            if s.label.ends_with(" CPU") {
                cpu = cpu.line(
                    &s.label,
                    series_points(s, |p| p.extra.get("cpu_seconds").and_then(|v| v.as_f64())),
                );
            } else {
                rate = rate.line(&s.label, series_points(s, |p| p.ops_per_sec));
            }
        }
        let marks: Vec<String> = steps
            .iter()
            .map(|st| {
                format!(
                    "node {} at {:.0} s, rebalanced {:.0}–{:.0} s",
                    st.node, st.added_secs, st.rebalance_started_secs, st.rebalanced_secs
                )
            })
            .collect();
        Figure::new(&format!(
            "Cluster expansion under YCSB-B ({})",
            marks.join("; ")
        ))
        .panel(rate)
        .panel(cpu)
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
    fn moved_partitions_are_those_whose_primary_changed() {
        let before = ClusterMap::initial(nodes(2), 64, 1).unwrap();
        assert_eq!(partitions_moved(&before, &before), 0);
        let mut grown = before.clone();
        grown.nodes = nodes(3);
        let plan = camelot_cluster::plan(&grown).unwrap();
        let after = ClusterMap {
            assignment: plan.target.clone(),
            ..grown
        };
        let moved = partitions_moved(&before, &after);
        assert_eq!(moved as usize, plan.moves.len());
        assert!(
            (20..=22).contains(&moved),
            "{moved} of 64 onto the third node"
        );
    }

    #[test]
    fn moves_are_read_from_the_rebalance_report() {
        use camelot_cluster::moves::{MoveReport, RebalanceReport};
        let made = |switched, bytes_copied, copy_secs| MoveReport {
            switched,
            bytes_copied,
            copy_secs,
            ..MoveReport::default()
        };
        let report = RebalanceReport {
            moves: vec![
                made(true, 16_977_920, 0.391),
                made(false, 999, 9.0),
                made(true, 8_518_656, 0.181),
            ],
        };
        let out = format!(
            "plan: 3 partition(s) to move in 3 move(s)\n\
             moved 341 partition(s) node 0 → 2: the lines for people\n{}\n",
            serde_json::to_string(&report).unwrap()
        );
        let moves = move_copies(&out).unwrap();
        assert_eq!(
            moves,
            vec![
                MoveCopy {
                    bytes_copied: 16_977_920,
                    copy_secs: 0.391
                },
                MoveCopy {
                    bytes_copied: 8_518_656,
                    copy_secs: 0.181
                }
            ]
        );
        let rate = copy_rate_bytes_per_sec(&moves).unwrap();
        assert!((rate - (16_977_920.0 + 8_518_656.0) / 0.572).abs() < 1.0);
        assert_eq!(copy_rate_bytes_per_sec(&[]), None);
        // No report, or a garbled one, is an error rather than "nothing moved".
        assert!(move_copies("moved 3 partition(s) node 0 → 2: …").is_err());
        assert!(move_copies("{\"moves\": [garbled").is_err());
    }

    #[test]
    fn buckets_before_and_after_are_read_as_documented() {
        let ops = [5, 100, 102, 98, 40, 101, 100, 7];
        // Buckets 1..=3 are before a change at 4.2 s (bucket 0 is start-up).
        assert_eq!(baseline(&ops, 4.2), Some(100.0));
        assert_eq!(baseline(&ops, 0.5), None);
        // From the change at 4.2 s to the end at 7.5 s: buckets 4, 5, 6 (7 is partial).
        assert_eq!(slowest_bucket(&ops, 4.2, 7.5), Some((4, 40)));
        assert_eq!(slowest_bucket(&ops, 5.0, 7.5), Some((6, 100)));
        assert_eq!(slowest_bucket(&ops, 7.2, 7.5), None);
    }

    #[test]
    fn configs_are_checked() {
        let ok = ExpandConfig::default();
        ok.validate().unwrap();
        let mut q = ok.clone();
        q.apply_quick();
        q.validate().unwrap();
        for bad in [
            ExpandConfig {
                end_nodes: 2,
                ..ok.clone()
            },
            ExpandConfig {
                start_nodes: 0,
                ..ok.clone()
            },
            ExpandConfig {
                end_nodes: 99,
                ..ok.clone()
            },
            ExpandConfig {
                load_fraction: 0.0,
                ..ok.clone()
            },
            ExpandConfig {
                value_bytes: 16 << 10,
                ..ok.clone()
            },
            ExpandConfig {
                partitions: 3,
                ..ok.clone()
            },
            ExpandConfig {
                settle_seconds: -1.0,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
