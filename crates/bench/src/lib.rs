//! The experiments behind `camelot bench …`: workloads, the machine's limits, the peer
//! programs each comparison runs against, and the demo. What a run produces is a
//! `camelot_results::schema::BenchResult`; figures and the report live in that crate.
#![forbid(unsafe_code)]

pub mod error;
pub mod latency;
pub mod netctl;
pub mod peers;
pub mod progress;
pub mod side;

pub use error::BenchError;

/// A bench configuration with a `--quick` form: the same experiment scaled down.
pub trait QuickConfig: Default {
    fn apply_quick(&mut self);

    /// The default configuration, scaled down when `quick`.
    fn defaults(quick: bool) -> Self {
        let mut c = Self::default();
        if quick {
            c.apply_quick();
        }
        c
    }
}

macro_rules! quick_config {
    ($($t:ty),*) => {$(
        impl QuickConfig for $t {
            fn apply_quick(&mut self) {
                <$t>::apply_quick(self)
            }
        }
    )*};
}
quick_config!(
    hw::cpu::CpuConfig,
    hw::mem::MemConfig,
    hw::net::NetConfig,
    hw::disk::DiskConfig,
    threads::ThreadsConfig,
    api::ApiConfig,
    ycsb::YcsbConfig,
    resp::RespBenchConfig,
    rvm::RvmBenchConfig,
    paging::PagingConfig,
    sort::SortConfig,
    prefetch::PrefetchConfig,
    fault::FaultConfig,
    raid::EncodeConfig,
    raid::CompareConfig,
    raid::OverheadConfig,
    raid::RebuildConfig,
    cluster::ThroughputConfig,
    cluster::ReplicationConfig,
    cluster_percentiles::PercentilesConfig,
    cluster_expand::ExpandConfig,
    cluster_rebalance::RebalanceConfig
);
#[cfg(feature = "etcd")]
quick_config!(cluster_failover::FailoverConfig);

pub mod all;
pub mod api;
mod checks;
pub mod cluster;
#[cfg(feature = "etcd")]
pub mod cluster_etcd;
pub mod cluster_expand;
#[cfg(feature = "etcd")]
pub mod cluster_failover;
pub mod cluster_load;
pub mod cluster_percentiles;
#[cfg(feature = "etcd")]
pub mod cluster_procs;
pub mod cluster_rebalance;
pub mod demo;
pub mod fault;
pub mod hw;
pub mod middlebox;
pub mod paging;
pub mod prefetch;
pub mod raid;
pub mod resp;
pub mod rvm;
pub mod sort;
pub mod threads;
pub mod workload;
pub mod ycsb;

/// A fresh directory path under the temp dir for one test: unique per process, tag and
/// moment, so parallel tests and reruns never share files.
#[cfg(test)]
pub(crate) fn scratch_dir(tag: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "camelot-bench-{tag}-{}-{nanos}",
        std::process::id()
    ))
}
