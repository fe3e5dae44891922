//! `camelot bench cluster …` run the way a user runs them (`--quick`), each result read
//! back: the schema, the record of both sides, and the figures the targets are
//! read from.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");
/// A quick bench finishes in well under a minute; a loaded CI machine gets slack.
const BENCH_TIME_LIMIT: Duration = Duration::from_secs(240);

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "camelot-cluster-bench-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Runs `camelot ARGS` to its end within [`BENCH_TIME_LIMIT`]; its stdout and stderr
/// (stderr to a file, so a chatty run cannot fill a pipe and stall).
fn run(args: &[&str], dir: &Path) -> (String, String) {
    let err_path = dir.join("stderr.txt");
    let out_path = dir.join("stdout.txt");
    let mut child = Command::new(CAMELOT)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn camelot");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if start.elapsed() > BENCH_TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "camelot {args:?} still running after {BENCH_TIME_LIMIT:?}:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(status.success(), "camelot {args:?}: {status}\n{out}\n{err}");
    (out, err)
}

fn result(dir: &Path, bench: &str) -> serde_json::Value {
    let path = dir.join(format!("{bench}.json"));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("result file")).expect("JSON");
    assert_eq!(json["bench"], bench);
    assert_eq!(json["config"]["quick"], true, "{bench} not quick");
    let png = std::fs::read(dir.join(format!("{bench}.png"))).expect("figure");
    assert!(png.starts_with(b"\x89PNG"), "{bench}.png is not a PNG");
    json
}

fn positive(v: &serde_json::Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    x
}

#[test]
fn cluster_throughput_quick_records_both_sides_and_server_cpu() {
    let dir = temp_dir("throughput");
    let d = dir.to_str().expect("utf-8");
    run(
        &["bench", "cluster", "throughput", "--quick", "--out", d],
        &dir,
    );
    let json = result(&dir, "cluster-throughput");
    let sides = &json["config"]["sides"];
    let camelot = &sides["camelot"];
    assert_eq!(camelot["process"], "separate", "{sides}");
    assert_eq!(camelot["server"], "camelot");
    assert!(camelot["version"]
        .as_str()
        .is_some_and(|v| v.starts_with("camelot ")));
    assert!(camelot["command"]
        .as_str()
        .is_some_and(|c| c.contains(" server ") && c.contains("--memory")));
    assert_eq!(camelot["client_threads"], json["config"]["threads"]);
    let iperf = &sides["iperf3"];
    assert!(
        iperf["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("iperf ")),
        "{iperf}"
    );
    assert!(iperf["command"]
        .as_str()
        .is_some_and(|c| c.contains("iperf3") && c.contains("-c 127.0.0.1")));
    let series = json["series"].as_array().expect("series");
    assert_eq!(series.len(), 2, "GET and PUT");
    for s in series {
        let points = s["points"].as_array().expect("points");
        assert_eq!(points.len(), 3, "1 KiB, 64 KiB, 1 MiB");
        for p in points {
            positive(&p["ops_per_sec"], "ops/s");
            positive(&p["bytes_per_sec"], "B/s");
            // Server CPU seconds beside throughput, read from the server process.
            let cpu = positive(&p["extra"]["server_cpu_seconds"], "server CPU seconds");
            assert!(cpu < 60.0, "{cpu} CPU-s in a 0.3 s point");
        }
    }
    let comparisons = json["comparisons"].as_array().expect("comparisons");
    assert_eq!(comparisons.len(), 2, "GET and PUT at 1 MiB against iperf3");
    for c in comparisons {
        assert_eq!(c["peer_label"], "iperf3");
        positive(&c["ratio"], "ratio");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cluster_replication_quick_sets_r2_against_r1_with_the_target() {
    let dir = temp_dir("replication");
    let d = dir.to_str().expect("utf-8");
    run(
        &["bench", "cluster", "replication", "--quick", "--out", d],
        &dir,
    );
    let json = result(&dir, "cluster-replication");
    let series = json["series"].as_array().expect("series");
    assert_eq!(series.len(), 2, "R=1 and R=2");
    for s in series {
        for p in s["points"].as_array().expect("points") {
            positive(&p["latency_us"]["p50"], "p50");
            positive(&p["ops_per_sec"], "ops/s");
        }
    }
    let comparisons = json["comparisons"].as_array().expect("comparisons");
    assert_eq!(comparisons.len(), 2, "one per thread count (1 and 8)");
    for c in comparisons {
        assert_eq!(c["target"], 1.6);
        assert_eq!(c["at_most"], true);
        // R=2 waits for a backup's copy on top of everything R=1 does.
        assert!(positive(&c["ratio"], "ratio") > 0.5, "{c}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "etcd")]
#[test]
fn cluster_percentiles_quick_measures_each_node_class_on_etcd() {
    let dir = temp_dir("percentiles");
    let d = dir.to_str().expect("utf-8");
    run(
        &["bench", "cluster", "percentiles", "--quick", "--out", d],
        &dir,
    );
    let json = result(&dir, "cluster-percentiles");
    let config = &json["config"];
    assert!(config["slow_mechanism"]
        .as_str()
        .is_some_and(|m| m.starts_with("throttle: ")));
    let limit = positive(&config["slow_ops_per_sec_max"], "slow limit");
    let series = json["series"].as_array().expect("series");
    assert_eq!(series.len(), 3, "fast, slow, all-fast");
    for s in series {
        let p = &s["points"][0];
        for q in ["p50", "p90", "p99", "p999"] {
            positive(&p["latency_us"][q], q);
        }
        positive(&p["extra"]["server_cpu_seconds"], "server CPU seconds");
    }
    // The slow nodes really are slow: each served at most its limit (the bucket's
    // 0.1 s burst and a 3 s window allow a few percent over).
    for n in config["per_node"]["heterogeneous"]
        .as_array()
        .expect("per node")
    {
        if n["ops_per_sec_max"].is_null() {
            continue;
        }
        let served = positive(&n["ops_per_sec"], "slow node ops/s");
        assert!(
            served <= limit * 1.1,
            "slow node served {served} ops/s, limit {limit}"
        );
    }
    let slow_p50 = positive(&series[1]["points"][0]["latency_us"]["p50"], "slow p50");
    let fast_p50 = positive(&series[0]["points"][0]["latency_us"]["p50"], "fast p50");
    assert!(
        slow_p50 > fast_p50,
        "slow nodes answer faster than fast ones: {slow_p50} vs {fast_p50} µs"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "etcd")]
/// With two replicas a partition, the primaries (which serve every read) stay spread:
/// the new map leads half on each node, and the planner hands the new nodes their share of
/// leaders through the moves themselves (a moved primary's slot is led by its new node).
#[test]
fn cluster_expand_quick_at_two_replicas_spreads_the_primaries() {
    let dir = temp_dir("expand-r2");
    let d = dir.to_str().expect("utf-8");
    run(
        &[
            "bench",
            "cluster",
            "expand",
            "--quick",
            "--replication",
            "2",
            "--iperf3-seconds",
            "0",
            "--out",
            d,
        ],
        &dir,
    );
    let json = result(&dir, "cluster-expand");
    let config = &json["config"];
    assert_eq!(config["replication"], 2);
    assert_eq!(config["bad_reads"], 0, "{}", config["problems"]);
    assert_eq!(config["records_missing_after"], 0);
    let partitions = positive(&config["partitions"], "partitions");
    let per_node = config["primaries_per_node_after"]
        .as_array()
        .expect("after");
    assert_eq!(per_node.len(), 4);
    for entry in per_node {
        let led = entry[1].as_f64().expect("a count");
        assert!(
            (led - partitions / 4.0).abs() <= 1.0,
            "primaries per node {per_node:?} for {partitions} partitions"
        );
    }
}

#[test]
fn cluster_expand_quick_grows_to_four_nodes_and_loses_nothing() {
    let dir = temp_dir("expand");
    let d = dir.to_str().expect("utf-8");
    run(&["bench", "cluster", "expand", "--quick", "--out", d], &dir);
    let json = result(&dir, "cluster-expand");
    let config = &json["config"];
    let steps = config["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 2, "2 → 3 → 4");
    let partitions = positive(&config["partitions"], "partitions");
    for (i, st) in steps.iter().enumerate() {
        assert_eq!(st["nodes_after"], 3 + i);
        let moved = positive(&st["partitions_moved"], "moved");
        let share = partitions / (3 + i) as f64;
        assert!(
            (moved - share).abs() <= 0.1 * share,
            "step {i}: {moved} moved, P/N = {share}"
        );
        positive(&st["rebalance_seconds"], "rebalance seconds");
    }
    let per_node = config["primaries_per_node_after"]
        .as_array()
        .expect("after");
    assert_eq!(per_node.len(), 4);
    // Correctness, whatever the machine's load: every read found its record, and every
    // record is there afterwards.
    assert_eq!(config["bad_reads"], 0, "{}", config["problems"]);
    assert_eq!(config["records_missing_after"], 0);
    // The moves' bulk went from source to target directly, every page applied.
    let counters = &config["server_counters_summed"];
    positive(&counters["pages_pushed"], "pages pushed");
    assert_eq!(counters["pages_push_failed"], 0);
    let buckets = json["series"][0]["points"].as_array().expect("buckets");
    assert!(buckets.len() >= 5, "{} buckets", buckets.len());
    let cpu_series = json["series"]
        .as_array()
        .expect("series")
        .iter()
        .filter(|s| s["label"].as_str().is_some_and(|l| l.ends_with(" CPU")))
        .count();
    assert_eq!(cpu_series, 4, "CPU per node, new nodes included");
    let comparisons = json["comparisons"].as_array().expect("comparisons");
    assert!(comparisons
        .iter()
        .any(|c| c["target"] == 0.8 && c["name"].as_str().is_some_and(|n| n.contains("bucket"))));
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "etcd")]
#[test]
fn cluster_rebalance_quick_compares_automatic_with_manual_rebalancing() {
    let dir = temp_dir("rebalance");
    let d = dir.to_str().expect("utf-8");
    let started = std::time::Instant::now();
    run(
        &["bench", "cluster", "rebalance", "--quick", "--out", d],
        &dir,
    );
    let took = started.elapsed();
    let json = result(&dir, "cluster-rebalance");
    let config = &json["config"];
    let runs = config["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "manual and automatic");
    let partitions = positive(&config["partitions"], "partitions") as usize;
    let mut moved = Vec::new();
    for (r, mode) in runs.iter().zip(["manual", "automatic"]) {
        assert_eq!(r["mode"], mode);
        // Skewed before, balanced after (3 nodes: each within one of P/3).
        let before = r["primaries_per_node_before"].as_array().expect("before");
        let after = r["primaries_per_node_after"].as_array().expect("after");
        assert!(
            before[0][1].as_u64().unwrap() as usize > partitions / 2,
            "{before:?}"
        );
        for n in after {
            let c = n[1].as_u64().unwrap() as usize;
            assert!(c.abs_diff(partitions / 3) <= 1, "{mode}: {after:?}");
        }
        moved.push(positive(&r["partitions_moved"], "moved"));
        assert!(r["rebalance_seconds"].as_f64().unwrap() > 0.0);
        // Correctness, whatever the machine's load.
        assert_eq!(r["bad_reads"], 0, "{mode}: {}", r["problems"]);
        positive(&r["after_ops_per_sec"], "after");
        positive(&r["skewed_ops_per_sec"], "skewed");
    }
    // The controller runs the planner's plan: the same moves as `cluster rebalance`.
    assert_eq!(moved[0], moved[1]);
    assert!(runs[1]["tool_output"]
        .as_array()
        .expect("output")
        .iter()
        .any(|l| l.as_str().is_some_and(|l| l.contains("on membership"))));
    let series = json["series"].as_array().expect("series");
    assert_eq!(series.len(), 2);
    let comparisons = json["comparisons"].as_array().expect("comparisons");
    assert!(comparisons.iter().any(|c| c["target"] == 0.9
        && c["name"]
            .as_str()
            .is_some_and(|n| n.contains("automatic ÷ manual"))));
    assert!(
        took < std::time::Duration::from_secs(60),
        "quick took {took:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
