//! `camelot bench all`: every bench that exists, then the report, so one command
//! reproduces the whole evaluation. New benches join [`BENCHES`] and [`run`].

use crate::api::ApiConfig;
use crate::hw::{cpu::CpuConfig, disk::DiskConfig, mem::MemConfig, net::NetConfig};
use crate::rvm::RvmBenchConfig;
use crate::threads::ThreadsConfig;
use crate::ycsb::{Workload, YcsbConfig};
use crate::{BenchError, QuickConfig};
use camelot_results::report;
use camelot_testkit::process::{run_to_end, Program, ScratchDir};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The benches `all` runs, in order (the report comes last).
pub const BENCHES: [&str; 30] = [
    "cpu",
    "mem",
    "net",
    "disk",
    "threads",
    "api",
    "rvm-commit",
    "rvm-recovery",
    "ycsb",
    "resp",
    "paging",
    "sort",
    "prefetch",
    "raid-encode",
    "raid-compare",
    "raid-overhead",
    "raid-rebuild",
    "fault",
    "middlebox-cas",
    "middlebox-bandwidth",
    "middlebox-tail",
    "middlebox-full-system",
    "middlebox-memory",
    "cluster-throughput",
    "cluster-replication",
    "testbed",
    "cluster-percentiles",
    "cluster-expand",
    "cluster-rebalance",
    "cluster-failover",
];

/// The benches of [`BENCHES`] that need a cluster on etcd: a build without the `etcd`
/// feature leaves them out (and says so as it runs).
pub const NEED_ETCD: [&str; 4] = [
    "cluster-percentiles",
    "cluster-expand",
    "cluster-rebalance",
    "cluster-failover",
];

/// Runs every bench into `out` (each scaled down when `quick`), then writes
/// `out/index.html`. `log` hears one line as each bench starts and ends. `binary` is the
/// `camelot` program, for the benches that start servers and proxies as processes.
pub fn run(
    out: &Path,
    quick: bool,
    binary: &Path,
    mut log: impl FnMut(&str),
) -> Result<Vec<PathBuf>, BenchError> {
    let mut written = Vec::new();
    let mut timed = |name: &str, f: &dyn Fn() -> Result<Vec<PathBuf>, BenchError>| {
        // Keeps the published list honest: the bench-all test (a debug build) trips here.
        debug_assert!(BENCHES.contains(&name), "{name} is missing from BENCHES");
        log(&format!(
            "bench {name}: running{}",
            if quick { " (quick)" } else { "" }
        ));
        let t = Instant::now();
        let files = f()?;
        log(&format!(
            "bench {name}: done in {:.1} s",
            t.elapsed().as_secs_f64()
        ));
        // Each comparison as it finishes (camelot / peer / ratio / target / met), so the
        // console says what the report will.
        for json in files
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "json"))
        {
            if let Ok(result) = camelot_results::output::read_result(json) {
                let table = camelot_results::summary::comparison_table(&result);
                if !table.is_empty() {
                    log(&format!("{}:\n{}", result.bench, table.trim_end()));
                }
            }
        }
        Ok::<_, BenchError>(files)
    };
    // The machine's own limits first: the request API's figures are read against them.
    written.extend(timed("cpu", &|| {
        crate::hw::cpu::run(&CpuConfig::defaults(quick), out)
    })?);
    written.extend(timed("mem", &|| {
        crate::hw::mem::run(&MemConfig::defaults(quick), out)
    })?);
    written.extend(timed("net", &|| {
        crate::hw::net::run(&NetConfig::defaults(quick), out)
    })?);
    written.extend(timed("disk", &|| {
        crate::hw::disk::run(&DiskConfig::defaults(quick), out)
    })?);
    let limits = crate::hw::limits::Limits::from_results(out)?;
    let limits_path = out.join(crate::hw::limits::LIMITS_FILE_NAME);
    limits.save(&limits_path)?;
    written.push(limits_path);
    written.extend(timed("threads", &|| {
        let cfg = ThreadsConfig {
            modes: vec![true, false],
            limits: Some(limits.clone()),
            ..ThreadsConfig::defaults(quick)
        };
        crate::threads::run(&cfg, out)
    })?);
    written.extend(timed("api", &|| {
        let cfg = ApiConfig {
            limits: Some(limits.clone()),
            ..ApiConfig::defaults(quick)
        };
        crate::api::run(&cfg, out).map(|(files, _table)| files)
    })?);
    written.extend(timed("ycsb", &|| {
        // The comparison: A, B and C on every store, each started for the run.
        let cfg = YcsbConfig {
            workloads: vec![Workload::A, Workload::B, Workload::C],
            spawn: crate::ycsb::SPAWNABLE
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ..YcsbConfig::defaults(quick)
        };
        let report = crate::ycsb::run(&cfg, out, |_| {})?;
        if report.errors > 0 || report.mismatches > 0 {
            return Err(BenchError::Check(format!(
                "ycsb: {} errors and {} value mismatches",
                report.errors, report.mismatches
            )));
        }
        Ok(report.files)
    })?);
    written.extend(timed("rvm-commit", &|| {
        crate::rvm::run_commit(&RvmBenchConfig::defaults(quick), out)
    })?);
    written.extend(timed("rvm-recovery", &|| {
        crate::rvm::run_recovery(&RvmBenchConfig::defaults(quick), out)
    })?);
    written.extend(timed("resp", &|| {
        crate::resp::run(&crate::resp::RespBenchConfig::defaults(quick), out)
            .map(|(files, _)| files)
    })?);
    written.extend(timed("paging", &|| {
        crate::paging::run(&crate::paging::PagingConfig::defaults(quick), out)
    })?);
    written.extend(timed("sort", &|| {
        crate::sort::run(&crate::sort::SortConfig::defaults(quick), out)
    })?);
    written.extend(timed("prefetch", &|| {
        crate::prefetch::run(&crate::prefetch::PrefetchConfig::defaults(quick), out)
    })?);
    // Block volumes: the codecs alone, then every level over `camelot server` processes
    // (each bench starts and stops its own; iperf3 beside where the issue asks for it).
    written.extend(timed("raid-encode", &|| {
        crate::raid::run_encode(&crate::raid::EncodeConfig::defaults(quick), out)
    })?);
    written.extend(timed("raid-compare", &|| {
        crate::raid::run_compare(&crate::raid::CompareConfig::defaults(quick), out)
    })?);
    written.extend(timed("raid-overhead", &|| {
        crate::raid::run_overhead(&crate::raid::OverheadConfig::defaults(quick), out)
    })?);
    written.extend(timed("raid-rebuild", &|| {
        crate::raid::run_rebuild(&crate::raid::RebuildConfig::defaults(quick), out)
    })?);
    written.extend(timed("fault", &|| {
        crate::fault::run(&crate::fault::FaultConfig::defaults(quick), out)
    })?);
    // The middlebox (issue 20): Clover direct against Clover through `camelot proxy`,
    // each a server and proxies as processes of their own.
    written.extend(timed("middlebox-cas", &|| {
        crate::middlebox::run_cas(&crate::middlebox::CasConfig::defaults(quick), binary, out)
    })?);
    written.extend(timed("middlebox-bandwidth", &|| {
        crate::middlebox::run_bandwidth(
            &crate::middlebox::CloverLoadConfig::bandwidth(quick),
            binary,
            out,
        )
    })?);
    written.extend(timed("middlebox-tail", &|| {
        crate::middlebox::run_tail(
            &crate::middlebox::CloverLoadConfig::tail(quick),
            binary,
            out,
        )
    })?);
    written.extend(timed("middlebox-full-system", &|| {
        crate::middlebox::run_full_system(
            &crate::middlebox::CloverLoadConfig::full_system(quick),
            binary,
            out,
        )
    })?);
    written.extend(timed("middlebox-memory", &|| {
        crate::middlebox::run_memory(
            &crate::middlebox::CloverLoadConfig::full_system(quick),
            &crate::middlebox::memory_budgets(quick),
            binary,
            out,
        )
    })?);
    // The cluster (issue 19): one server against value size with iperf3 beside, then
    // R=2 against R=1 on the same servers.
    written.extend(timed("cluster-throughput", &|| {
        crate::cluster::run_throughput(&crate::cluster::ThroughputConfig::defaults(quick), out)
            .map(|p| vec![p])
    })?);
    written.extend(timed("cluster-replication", &|| {
        crate::cluster::run_replication(&crate::cluster::ReplicationConfig::defaults(quick), out)
            .map(|p| vec![p])
    })?);
    // The emulated network (issue 21): loopback against testbed links. It lives in the
    // binary (the testbed is the CLI's), so it runs as `camelot bench testbed`; network
    // namespaces need root, and as another user it is skipped (said at the end).
    let root = camelot_testbed::require_root();
    if root.is_ok() {
        written.extend(timed("testbed", &|| run_testbed(binary, out, quick))?);
    }
    // A cluster on etcd: percentiles on heterogeneous nodes, then expansion under load.
    if cfg!(feature = "etcd") {
        written.extend(timed("cluster-percentiles", &|| {
            crate::cluster_percentiles::run(
                &crate::cluster_percentiles::PercentilesConfig::defaults(quick),
                out,
            )
        })?);
        written.extend(timed("cluster-expand", &|| {
            crate::cluster_expand::run(&crate::cluster_expand::ExpandConfig::defaults(quick), out)
        })?);
        // Automatic against manual rebalancing of a skewed cluster.
        written.extend(timed("cluster-rebalance", &|| {
            crate::cluster_rebalance::run(
                &crate::cluster_rebalance::RebalanceConfig::defaults(quick),
                out,
            )
        })?);
        // The controller's failover: processes killed under load.
        #[cfg(feature = "etcd")]
        written.extend(timed("cluster-failover", &|| {
            crate::cluster_failover::run_failover(
                &crate::cluster_failover::FailoverConfig::defaults(quick),
                out,
            )
        })?);
    } else {
        for name in NEED_ETCD {
            log(&format!(
                "bench {name}: skipped ({})",
                crate::cluster::NO_ETCD
            ));
        }
    }
    if let Err(e) = &root {
        log(&format!("bench testbed: skipped ({e})"));
    }
    written.push(report::write_report(
        out,
        &[crate::hw::limits::LIMITS_FILE_NAME],
    )?);
    Ok(written)
}

/// A quick `bench testbed` is a few seconds per path; a full one ten per measurement, and
/// a hung one is killed past this.
const TESTBED_TIME_MAX: Duration = Duration::from_secs(1800);

/// `camelot bench testbed` as a process: 1 and 10 Gbit/s links and 50 µs per link beside
/// loopback, as BENCHMARKS.md quotes it.
fn run_testbed(binary: &Path, out: &Path, quick: bool) -> Result<Vec<PathBuf>, BenchError> {
    let program = Program {
        program: binary.to_string_lossy().into_owned().into(),
        package: "camelot (this build)".into(),
    };
    let mut args: Vec<OsString> = ["bench", "testbed", "--delay", "50us", "--out"]
        .iter()
        .map(OsString::from)
        .collect();
    args.push(out.as_os_str().to_owned());
    if quick {
        args.push("--quick".into());
    }
    let scratch = ScratchDir::new("bench-testbed")?;
    let done = run_to_end(&program, &args, &scratch, "bench-testbed", TESTBED_TIME_MAX)?;
    if !done.status.success() {
        return Err(done.failure(&program, "bench testbed failed").into());
    }
    Ok(["json", "png", "svg"]
        .iter()
        .map(|e| out.join(format!("testbed.{e}")))
        .collect())
}
