//! Every YCSB workload on every target, scaled down, with real redis-server and
//! memcached started by the harness: zero errors and zero value mismatches, and a result
//! file in the schema.

use camelot_bench::ycsb::{run, Workload, YcsbConfig};
use camelot_results::output::read_result;

#[test]
fn every_workload_on_every_target_reads_back_what_it_wrote() {
    let out = std::env::temp_dir().join(format!("camelot-ycsb-test-{}", std::process::id()));
    let cfg = YcsbConfig {
        workloads: ["a", "b", "c", "d", "e", "f", "w"]
            .iter()
            .map(|w| Workload::parse(w).unwrap())
            .collect(),
        records: 2_000,
        operations: 2_000,
        threads: 4,
        spawn: ["camelot", "resp", "redis", "memcached"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        memory_bytes: 512 << 20,
        ..YcsbConfig::default()
    };
    let report = run(&cfg, &out, |line| eprintln!("{line}")).expect("ycsb runs");
    eprintln!("{}", report.table);
    assert_eq!(report.errors, 0);
    assert_eq!(report.mismatches, 0);

    let result = read_result(&out.join("ycsb.json")).expect("ycsb.json reads back");
    assert_eq!(result.bench, "ycsb");
    let labels: Vec<&str> = result.series.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["camelot", "resp", "redis", "memcached"]);
    for s in &result.series {
        assert_eq!(s.points.len(), 7, "{}", s.label);
        for p in &s.points {
            let skipped = p.extra.contains_key("skipped");
            // Only memcached skips, and only E (no scans).
            assert_eq!(
                skipped,
                s.label == "memcached" && p.x == "E".into(),
                "{} {:?}",
                s.label,
                p.x
            );
            if !skipped {
                let ops = p.ops_per_sec.expect("throughput");
                assert!(ops.is_finite() && ops > 0.0);
                let l = p.latency_us.as_ref().expect("latency");
                assert!(l.p50 > 0.0 && l.p50 <= l.p99 && l.p99 <= l.max);
                assert!(p.extra.contains_key("ops"));
            }
        }
    }
    assert!(out.join("ycsb.png").exists() && out.join("ycsb.svg").exists());
    assert!(report.table.contains("camelot ÷ it"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_target_rate_holds_the_rate_and_times_from_the_intended_start() {
    let out = std::env::temp_dir().join(format!("camelot-ycsb-rate-{}", std::process::id()));
    let cfg = YcsbConfig {
        workloads: vec![Workload::C],
        records: 500,
        operations: 1_000,
        threads: 4,
        target_ops: Some(2_000.0),
        spawn: vec!["camelot".into()],
        memory_bytes: 256 << 20,
        ..YcsbConfig::default()
    };
    let report = run(&cfg, &out, |_| {}).expect("ycsb runs");
    assert_eq!((report.errors, report.mismatches), (0, 0));
    let result = read_result(&out.join("ycsb.json")).expect("ycsb.json");
    let p = &result.series[0].points[0];
    let ops = p.ops_per_sec.expect("throughput");
    // 1,000 operations at 2,000/s take at least half a second: the rate cannot be beaten.
    assert!(
        ops <= 2_000.0 * 1.05,
        "{ops} ops/s against a 2,000 ops/s target"
    );
    assert!(ops >= 200.0, "{ops} ops/s: far below the target rate");
    assert_eq!(result.config["target_ops"], 2_000.0);
    let _ = std::fs::remove_dir_all(&out);
}
