//! `camelot bench cluster percentiles` and `expand`: the cluster benches on etcd (their
//! flags; the experiments are camelot-bench's).

use std::path::PathBuf;

use anyhow::Result;
use camelot_bench::cluster_expand::ExpandConfig;
use camelot_bench::cluster_percentiles::PercentilesConfig;
use camelot_bench::cluster_rebalance::RebalanceConfig;
use camelot_bench::QuickConfig;
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum EtcdBenchCommand {
    /// Response-time percentiles (p50/p90/p99/p99.9) per node class on a heterogeneous
    /// cluster on etcd (slow nodes throttled), YCSB-B with 1 KiB values, against the same
    /// cluster with every node fast (seed 004).
    Percentiles(PercentilesArgs),
    /// Grow a cluster on etcd 2 → 3 → 4 nodes under a steady YCSB-B load with `camelot
    /// cluster rebalance`: throughput and CPU per node per 1 s bucket, failed operations,
    /// partitions moved against P/N (seed 004).
    Expand(ExpandArgs),
    /// Automatic against manual rebalancing (seed 004): a cluster on etcd starts skewed
    /// (node 0 holds most partitions; every node throttled alike) under a closed-loop
    /// YCSB-B load; one run rebalances with `camelot cluster rebalance`, the other with a
    /// `cluster controller --auto-rebalance` started at the same second. Throughput per
    /// 1 s bucket; target: automatic within 10 % of manual after rebalancing.
    Rebalance(RebalanceArgs),
}

#[derive(Args)]
pub struct RebalanceArgs {
    /// Scaled down to finish in seconds (256 partitions, 4,000 records, 2 s skewed, 3 s
    /// after, per run).
    #[arg(long)]
    quick: bool,
    #[arg(long)]
    nodes: Option<u32>,
    /// Node 0's share of the partitions at the start.
    #[arg(long)]
    skew: Option<f64>,
    /// Every node's executed operations per second (`--ops-per-sec-max`).
    #[arg(long, value_name = "N")]
    node_ops_per_sec: Option<u64>,
    /// Client threads, one request in flight each.
    #[arg(long)]
    threads: Option<usize>,
    /// Directory for cluster-rebalance.json and its figure.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
pub struct PercentilesArgs {
    /// Scaled down to finish in seconds (10,000 records, 8 threads, 3 s per cluster).
    #[arg(long)]
    quick: bool,
    #[arg(long)]
    nodes: Option<u32>,
    /// How many of the nodes are slow.
    #[arg(long)]
    slow_nodes: Option<u32>,
    /// A slow node's executed operations per second (default: 0.39 of what one node
    /// served in the all-fast cluster, measured first).
    #[arg(long, value_name = "N")]
    slow_ops_per_sec: Option<u64>,
    /// Client threads, one request in flight each.
    #[arg(long)]
    threads: Option<usize>,
    /// Measured seconds per cluster.
    #[arg(long)]
    seconds: Option<f64>,
    /// Directory for cluster-percentiles.json and its figure.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
pub struct ExpandArgs {
    /// Scaled down to finish in seconds (10,000 records, 2 s between steps).
    #[arg(long)]
    quick: bool,
    /// Nodes at the start and at the end (one is added per step).
    #[arg(long)]
    start_nodes: Option<u32>,
    #[arg(long)]
    end_nodes: Option<u32>,
    #[arg(long)]
    records: Option<u64>,
    /// Client threads of the steady load.
    #[arg(long)]
    threads: Option<usize>,
    /// The steady load's rate as a share of what the starting cluster serves flat out.
    #[arg(long)]
    load_fraction: Option<f64>,
    /// Seconds of steady load before the first new node and after each rebalance.
    #[arg(long)]
    settle_seconds: Option<f64>,
    /// Replicas per partition (default 1). With R > 1 "partitions moved" counts replica
    /// slots gained, against P·R/N.
    #[arg(long)]
    replication: Option<u32>,
    /// Bytes of each record's value (default 1024).
    #[arg(long)]
    value_bytes: Option<usize>,
    /// Seconds of the iperf3 loopback stream, run after the cluster is stopped, that the
    /// moves' copy rate is set against (default 2; 0: none).
    #[arg(long)]
    iperf3_seconds: Option<u64>,
    /// Directory for cluster-expand.json and its figure.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

pub fn run(cmd: EtcdBenchCommand) -> Result<()> {
    let files = match cmd {
        EtcdBenchCommand::Percentiles(a) => {
            let mut cfg = PercentilesConfig::defaults(a.quick);
            if let Some(n) = a.nodes {
                cfg.nodes = n;
            }
            if let Some(n) = a.slow_nodes {
                cfg.slow_nodes = n;
            }
            cfg.slow_ops_per_sec = a.slow_ops_per_sec.or(cfg.slow_ops_per_sec);
            if let Some(t) = a.threads {
                cfg.threads = t;
            }
            if let Some(s) = a.seconds {
                cfg.seconds = s;
            }
            camelot_bench::cluster_percentiles::run(&cfg, &a.out)?
        }
        EtcdBenchCommand::Expand(a) => {
            let mut cfg = ExpandConfig::defaults(a.quick);
            if let Some(n) = a.start_nodes {
                cfg.start_nodes = n;
            }
            if let Some(n) = a.end_nodes {
                cfg.end_nodes = n;
            }
            if let Some(r) = a.records {
                cfg.records = r;
            }
            if let Some(t) = a.threads {
                cfg.threads = t;
            }
            if let Some(f) = a.load_fraction {
                cfg.load_fraction = f;
            }
            if let Some(s) = a.settle_seconds {
                cfg.settle_seconds = s;
            }
            if let Some(r) = a.replication {
                cfg.replication = r;
            }
            if let Some(b) = a.value_bytes {
                cfg.value_bytes = b;
            }
            if let Some(s) = a.iperf3_seconds {
                cfg.iperf3_seconds = s;
            }
            camelot_bench::cluster_expand::run(&cfg, &a.out)?
        }
        EtcdBenchCommand::Rebalance(a) => {
            let mut cfg = RebalanceConfig::defaults(a.quick);
            if let Some(n) = a.nodes {
                cfg.nodes = n;
            }
            if let Some(s) = a.skew {
                cfg.skew = s;
            }
            if let Some(n) = a.node_ops_per_sec {
                cfg.node_ops_per_sec = n;
            }
            if let Some(t) = a.threads {
                cfg.threads = t;
            }
            camelot_bench::cluster_rebalance::run(&cfg, &a.out)?
        }
    };
    for f in files {
        println!("wrote {}", f.display());
    }
    Ok(())
}
