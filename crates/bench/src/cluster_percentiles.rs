//! `camelot bench cluster percentiles`: seed 004's response-time percentiles on
//! heterogeneous nodes. A cluster on etcd where some nodes are slow, under YCSB-B with
//! 1 KiB values; p50/p90/p99/p99.9 of the operations each class of node served. The peer
//! is the same cluster with every node fast, measured first in the same run: the slow
//! nodes' limit is set from it (by default 0.39 of what a fast node served there, the
//! seed's Core 2 Duo against its i7: 17,000 against 44,000 requests/s).
//!
//! Slow nodes are `camelot server --ops-per-sec-max N` (a token bucket on executed
//! operations). cgroup v2's `cpu.max` would slow a node's CPU instead; it is not used (see
//! [`slow_mechanism`], which the result records).

use std::path::{Path, PathBuf};
#[cfg(feature = "etcd")]
use std::time::Duration;

#[cfg(feature = "etcd")]
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Series};

use crate::checks::check_seconds;
use crate::cluster_load::{KvLoad, YCSB_B_READ_FRACTION};
use crate::BenchError;

/// The seed's slowest node against its fastest (17,000 ÷ 44,000 requests/s).
pub const SLOW_FRACTION_DEFAULT: f64 = 17_000.0 / 44_000.0;
/// Most client threads.
pub const THREADS_MAX: usize = 64;

#[derive(Debug, Clone)]
pub struct PercentilesConfig {
    pub nodes: u32,
    /// How many of the nodes (the highest ids) are slow.
    pub slow_nodes: u32,
    /// A slow node's `--ops-per-sec-max`; `None`: [`Self::slow_fraction`] of the
    /// operations per second one node served in the all-fast cluster.
    pub slow_ops_per_sec: Option<u64>,
    pub slow_fraction: f64,
    pub partitions: u32,
    pub records: u64,
    pub value_bytes: usize,
    /// Client threads, one request in flight each (YCSB's closed loop).
    pub threads: usize,
    /// Measured seconds per cluster (after a warm-up of a quarter of it, at most 1 s).
    pub seconds: f64,
    pub memory_bytes_per_node: u64,
    pub quick: bool,
}

impl Default for PercentilesConfig {
    fn default() -> Self {
        PercentilesConfig {
            nodes: 3,
            slow_nodes: 1,
            slow_ops_per_sec: None,
            slow_fraction: SLOW_FRACTION_DEFAULT,
            partitions: camelot_cluster::PARTITIONS_DEFAULT,
            records: 100_000,
            value_bytes: 1024,
            threads: 16,
            seconds: 10.0,
            memory_bytes_per_node: 256 << 20,
            quick: false,
        }
    }
}

impl PercentilesConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.records = 10_000;
        self.threads = 8;
        self.seconds = 3.0;
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if !(2..=crate::cluster_load::CLASSES_MAX as u32).contains(&self.nodes) {
            return Err(BenchError::InvalidConfig(format!(
                "nodes must be 2 to {}",
                crate::cluster_load::CLASSES_MAX
            )));
        }
        if self.slow_nodes == 0 || self.slow_nodes >= self.nodes {
            return Err(BenchError::InvalidConfig(
                "slow nodes must be at least 1 and fewer than the nodes (both classes are measured)"
                    .into(),
            ));
        }
        if let Some(ops) = self.slow_ops_per_sec {
            if !(1..=camelot_server::throttle::OPS_PER_SEC_MAX).contains(&ops) {
                return Err(BenchError::InvalidConfig(format!(
                    "a slow node's ops/s must be 1 to {}",
                    camelot_server::throttle::OPS_PER_SEC_MAX
                )));
            }
        }
        if !(self.slow_fraction > 0.0 && self.slow_fraction < 1.0) {
            return Err(BenchError::InvalidConfig(
                "the slow fraction must be between 0 and 1".into(),
            ));
        }
        if !(1..=camelot_cluster::map::PARTITIONS_MAX).contains(&self.partitions) {
            return Err(BenchError::InvalidConfig(format!(
                "partitions must be 1 to {}",
                camelot_cluster::map::PARTITIONS_MAX
            )));
        }
        check_seconds("seconds", self.seconds)?;
        self.load(None).validate(THREADS_MAX)
    }

    fn load(&self, seed: Option<u64>) -> KvLoad {
        KvLoad {
            records: self.records,
            value_bytes: self.value_bytes,
            threads: self.threads,
            read_fraction: YCSB_B_READ_FRACTION,
            target_ops_per_sec: None,
            seed: seed.unwrap_or(0x5eed_0004),
        }
    }
}

/// How the slow nodes are slowed, and why not by cgroup v2 `cpu.max`, for the record.
pub fn slow_mechanism() -> String {
    let controllers = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers");
    let cgroup = match controllers {
        Ok(c) if c.split_whitespace().any(|w| w == "cpu") => {
            "cgroup v2 with the cpu controller is mounted here, but the bench does not \
             create cgroups"
        }
        Ok(_) => "cgroup v2 is mounted here without the cpu controller",
        Err(_) => "no cgroup v2 hierarchy at /sys/fs/cgroup (cgroup v1 or none)",
    };
    format!(
        "throttle: camelot server --ops-per-sec-max (a token bucket on executed \
         operations, burst 0.1 s); not cgroup v2 cpu.max: {cgroup}"
    )
}

#[cfg(not(feature = "etcd"))]
pub fn run(_cfg: &PercentilesConfig, _out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    Err(BenchError::InvalidConfig(crate::cluster::NO_ETCD.into()))
}

/// What one cluster's run measured, per node.
#[cfg(feature = "etcd")]
struct Measured {
    per_node: Vec<crate::latency::LatencyRecorder>,
    node_cpu_seconds: Vec<Option<f64>>,
    seconds: f64,
    ops: u64,
    failed: u64,
    bad_reads: u64,
    problems: Vec<String>,
}

#[cfg(feature = "etcd")]
fn measure(
    cfg: &PercentilesConfig,
    binary: &Path,
    specs: &[crate::cluster_etcd::NodeSpec],
) -> Result<Measured, BenchError> {
    use crate::cluster_etcd::EtcdNodes;
    use crate::cluster_load::{load_records, run, Until};
    use camelot_client::ClientConfig;
    use std::time::Instant;
    let nodes = EtcdNodes::start(binary, cfg.memory_bytes_per_node, specs, cfg.partitions, 1)?;
    let load = cfg.load(None);
    load_records(&nodes.client(ClientConfig::default())?, &load)?;
    let clients = (0..cfg.threads)
        .map(|_| nodes.client(ClientConfig::default()))
        .collect::<Result<Vec<_>, _>>()?;
    let classes = specs.len();
    let by_node = |n: u32| n as usize;
    // Warm-up: connections made, the servers' hot paths touched; not measured.
    let warm = Duration::from_secs_f64((cfg.seconds / 4.0).min(1.0));
    run(
        &clients,
        &load,
        classes,
        &by_node,
        Instant::now(),
        Until::Elapsed(warm),
    )?;
    let meters = nodes.cpu_meters();
    let measured_load = KvLoad {
        seed: load.seed + 1_000,
        ..load
    };
    let tally = run(
        &clients,
        &measured_load,
        classes,
        &by_node,
        Instant::now(),
        Until::Elapsed(Duration::from_secs_f64(cfg.seconds)),
    )?;
    let node_cpu_seconds = meters.iter().map(|(_, m)| m.seconds()).collect();
    Ok(Measured {
        ops: tally.ops(),
        per_node: tally.per_class,
        node_cpu_seconds,
        seconds: tally.seconds,
        failed: tally.failed,
        bad_reads: tally.bad_reads,
        problems: tally.problems,
    })
}

/// Runs `bench cluster percentiles`; writes `cluster-percentiles.json` and its figure.
#[cfg(feature = "etcd")]
pub fn run(cfg: &PercentilesConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    use crate::cluster_etcd::NodeSpec;
    use crate::latency::LatencyRecorder;
    use crate::side::{sides_json, ClientSide, Placement};
    use serde_json::json;
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
    let all_fast: Vec<NodeSpec> = (0..cfg.nodes).map(|_| fast).collect();
    let homogeneous = measure(cfg, &binary, &all_fast)?;
    let per_fast_node_ops = homogeneous.ops as f64 / homogeneous.seconds / f64::from(cfg.nodes);
    let slow_ops = cfg
        .slow_ops_per_sec
        .unwrap_or(((per_fast_node_ops * cfg.slow_fraction) as u64).max(1));
    let slow = NodeSpec {
        ops_per_sec_max: Some(slow_ops),
    };
    let slow_from = cfg.nodes - cfg.slow_nodes;
    let mixed_specs: Vec<NodeSpec> = (0..cfg.nodes)
        .map(|id| if id >= slow_from { slow } else { fast })
        .collect();
    let mixed = measure(cfg, &binary, &mixed_specs)?;

    for (what, m) in [("all-fast", &homogeneous), ("heterogeneous", &mixed)] {
        if m.failed > 0 || m.bad_reads > 0 {
            return Err(BenchError::Check(format!(
                "{what} cluster: {} failed operations, {} bad reads: {:?}",
                m.failed, m.bad_reads, m.problems
            )));
        }
    }
    // Classes: (label, measured run, node ids).
    let fast_ids: Vec<usize> = (0..slow_from as usize).collect();
    let slow_ids: Vec<usize> = (slow_from as usize..cfg.nodes as usize).collect();
    let all_ids: Vec<usize> = (0..cfg.nodes as usize).collect();
    let classes = [
        ("fast nodes, heterogeneous cluster", &mixed, &fast_ids),
        (
            "slow nodes (throttled), heterogeneous cluster",
            &mixed,
            &slow_ids,
        ),
        ("every node, all-fast cluster", &homogeneous, &all_ids),
    ];
    let mut series = Vec::new();
    let mut summaries = Vec::new();
    for (label, m, ids) in classes {
        let mut rec = LatencyRecorder::new();
        for &i in ids {
            rec.merge(&m.per_node[i]);
        }
        let cpu: Option<f64> = ids.iter().map(|&i| m.node_cpu_seconds[i]).sum();
        let mut p = Point::new(camelot_results::schema::X::Label(label.to_string()));
        p.ops_per_sec = Some(rec.count() as f64 / m.seconds);
        p.latency_us = Some(rec.summary());
        for (k, v) in crate::side::cpu_extra(rec.count() as f64, cpu) {
            p.extra.insert(k.to_string(), v);
        }
        p.extra.insert("nodes".into(), json!(ids.len()));
        p.extra.insert("operations".into(), json!(rec.count()));
        summaries.push(rec.summary());
        let mut s = Series::new(label);
        s.points.push(p);
        series.push(s);
    }
    let per_node = |m: &Measured, specs: &[NodeSpec]| -> Vec<serde_json::Value> {
        m.per_node
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let l = r.summary();
                json!({
                    "node": i,
                    "ops_per_sec_max": specs[i].ops_per_sec_max,
                    "ops_per_sec": r.count() as f64 / m.seconds,
                    "latency_us": {"p50": l.p50, "p90": l.p90, "p99": l.p99, "p999": l.p999, "max": l.max},
                    "server_cpu_seconds": m.node_cpu_seconds[i],
                })
            })
            .collect()
    };
    let (fast_l, slow_l, homo_l) = (&summaries[0], &summaries[1], &summaries[2]);
    let peer = "fast nodes of the same cluster";
    let comparisons = vec![
        Comparison::new("p90, slow ÷ fast nodes", slow_l.p90, fast_l.p90, "µs", peer),
        Comparison::new(
            "p99.9, slow ÷ fast nodes",
            slow_l.p999,
            fast_l.p999,
            "µs",
            peer,
        ),
        Comparison::new(
            "fast nodes' p99 beside slow ones ÷ in an all-fast cluster",
            fast_l.p99,
            homo_l.p99,
            "µs",
            "all-fast cluster, same run",
        ),
        Comparison::new(
            "throughput, heterogeneous ÷ all-fast cluster",
            mixed.ops as f64 / mixed.seconds,
            homogeneous.ops as f64 / homogeneous.seconds,
            "ops/s",
            "all-fast cluster, same run",
        ),
    ];
    let client = ClientSide {
        client: format!(
            "camelot-client KV API, one client per thread following the map in etcd; \
             YCSB-B ({}% reads, zipfian over {} records)",
            (YCSB_B_READ_FRACTION * 100.0).round(),
            cfg.records
        ),
        client_threads: cfg.threads,
        depth: 1,
        data_model: format!("one {}-byte value per record", cfg.value_bytes),
        resp_face: false,
    };
    let sides = sides_for(cfg, &binary, fast, slow, client);
    let config = json!({
        "x": "node class",
        "sides": sides_json(&sides),
        "nodes": cfg.nodes,
        "slow_nodes": cfg.slow_nodes,
        "slow_node_ids": slow_ids,
        "slow_mechanism": slow_mechanism(),
        "slow_ops_per_sec_max": slow_ops,
        "slow_ops_per_sec_from": if cfg.slow_ops_per_sec.is_some() {
            "given".to_string()
        } else {
            format!("{:.3} × the {per_fast_node_ops:.0} ops/s one node served in the all-fast cluster", cfg.slow_fraction)
        },
        "partitions": cfg.partitions,
        "replication": 1,
        "records": cfg.records,
        "value_bytes": cfg.value_bytes,
        "workload": "YCSB-B: 95% GET, 5% PUT, scrambled zipfian (0.99)",
        "threads": cfg.threads,
        "seconds": cfg.seconds,
        "warm_up_seconds": (cfg.seconds / 4.0).min(1.0),
        "order": "all-fast cluster first (it sets the slow nodes' limit), then the heterogeneous one; each a fresh etcd and fresh servers",
        "latency": "per operation, client-side, attributed to the node the client routed it to",
        "per_node": {
            "all_fast": per_node(&homogeneous, &all_fast),
            "heterogeneous": per_node(&mixed, &mixed_specs),
        },
        "etcd": camelot_testkit::EtcdServer::version().ok(),
        "memory_bytes_per_node": cfg.memory_bytes_per_node,
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("cluster-percentiles", started, config, series);
    result.comparisons = comparisons;
    let figure = figure(&result);
    Ok(camelot_results::output::write_result_with_figure(
        out, &result, &figure,
    )?)
}

#[cfg(feature = "etcd")]
fn sides_for(
    cfg: &PercentilesConfig,
    binary: &Path,
    fast: crate::cluster_etcd::NodeSpec,
    slow: crate::cluster_etcd::NodeSpec,
    client: crate::side::ClientSide,
) -> Vec<crate::side::Side> {
    let flags = |spec: crate::cluster_etcd::NodeSpec| {
        let mut f = vec![
            "--memory".to_string(),
            cfg.memory_bytes_per_node.to_string(),
        ];
        if let Some(ops) = spec.ops_per_sec_max {
            f.extend(["--ops-per-sec-max".to_string(), ops.to_string()]);
        }
        f
    };
    let side = |label: &str, nodes: u32, spec| crate::side::Side {
        label: label.to_string(),
        server: "camelot".into(),
        process: "separate".into(),
        server_threads: Some(crate::side::cores()),
        nodes: nodes as usize,
        version: format!("camelot {}", env!("CARGO_PKG_VERSION")),
        command: format!(
            "{} server --listen 127.0.0.1:PORT {} --etcd URL --node-id N",
            binary.display(),
            flags(spec).join(" ")
        ),
        flags: flags(spec),
        client: client.clone(),
    };
    vec![
        side("fast nodes", cfg.nodes - cfg.slow_nodes, fast),
        side("slow nodes", cfg.slow_nodes, slow),
        side("all-fast cluster", cfg.nodes, fast),
    ]
}

/// Bars: one group per percentile, one bar per node class.
#[cfg(feature = "etcd")]
fn figure(result: &BenchResult) -> camelot_results::plot::Figure {
    use camelot_results::plot::{Figure, Panel};
    let categories = ["p50", "p90", "p99", "p99.9"];
    let mut panel = Panel::new("latency per node class (YCSB-B)", "percentile", "µs")
        .bars(categories.iter().map(|c| c.to_string()).collect());
    for s in &result.series {
        let Some(l) = s.points.first().and_then(|p| p.latency_us.as_ref()) else {
            continue;
        };
        let values = [l.p50, l.p90, l.p99, l.p999];
        panel = panel.line(
            &s.label,
            values
                .iter()
                .enumerate()
                .map(|(i, v)| (i as f64, *v))
                .collect(),
        );
    }
    Figure::new("Response-time percentiles on heterogeneous nodes (seed 004)").panel(panel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_checked() {
        let ok = PercentilesConfig::default();
        ok.validate().unwrap();
        let mut q = ok.clone();
        q.apply_quick();
        q.validate().unwrap();
        for bad in [
            PercentilesConfig {
                slow_nodes: 0,
                ..ok.clone()
            },
            PercentilesConfig {
                slow_nodes: 3,
                ..ok.clone()
            },
            PercentilesConfig {
                slow_fraction: 1.0,
                ..ok.clone()
            },
            PercentilesConfig {
                slow_ops_per_sec: Some(0),
                ..ok.clone()
            },
            PercentilesConfig {
                partitions: 0,
                ..ok.clone()
            },
            PercentilesConfig {
                value_bytes: 4,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_mechanism_is_named() {
        assert!(slow_mechanism().starts_with("throttle: "));
    }
}
