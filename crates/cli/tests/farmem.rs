//! `camelot farmem simulate` as a user runs it: a trace file in, a table of miss ratios out.

use std::process::Command;

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");

fn camelot(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(CAMELOT)
        .args(args)
        .output()
        .expect("run camelot");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The miss ratio printed for `policy` at cache size `cache`.
fn miss_ratio(table: &str, cache: &str, policy: &str) -> f64 {
    table
        .lines()
        .find_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() == 6 && cols[0] == cache && cols[2] == policy).then(|| {
                cols[4]
                    .trim_end_matches('%')
                    .parse::<f64>()
                    .expect("a ratio")
            })
        })
        .unwrap_or_else(|| panic!("no {policy} row at {cache} in:\n{table}"))
}

#[test]
fn simulate_a_trace_file_gives_exact_miss_ratios() {
    let dir = std::env::temp_dir().join(format!("camelot-farmem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("loop.trace");
    // A loop over 5 pages, 20 times, with a comment: LRU with 4 pages misses every
    // access; with 5 pages only the first five.
    let mut text = String::from("# five-page loop\n");
    for _ in 0..20 {
        text.push_str("0 1 2 3 4\n");
    }
    std::fs::write(&path, text).expect("trace");
    let trace = path.to_str().expect("utf-8 path");
    let (ok, out, err) = camelot(&["farmem", "simulate", "--trace", trace, "--cache", "4,5"]);
    assert!(ok, "{err}");
    assert!(out.contains("100 accesses, 5 distinct pages"), "{out}");
    assert_eq!(miss_ratio(&out, "4", "lru"), 100.0);
    assert_eq!(miss_ratio(&out, "5", "lru"), 5.0);
    for policy in ["clock", "fifo", "random", "s3fifo", "arc"] {
        assert_eq!(
            miss_ratio(&out, "5", policy),
            5.0,
            "{policy}: a cache as large as the loop misses only the first pass"
        );
    }

    std::fs::write(&path, "1 2 three\n").expect("bad trace");
    let (ok, _, err) = camelot(&["farmem", "simulate", "--trace", trace]);
    assert!(!ok, "a bad trace was accepted");
    assert!(err.contains("line 1") && err.contains("three"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn simulate_refuses_nonsense_with_a_reason() {
    for (args, says) in [
        (
            &["farmem", "simulate", "--policy", "mru"][..],
            "unknown policy",
        ),
        (&["farmem", "simulate", "--cache", "0%"][..], "cache 0%"),
        (
            &["farmem", "simulate", "--workload", "zipf:-2"][..],
            "zipf exponent",
        ),
    ] {
        let (ok, _, err) = camelot(args);
        assert!(!ok, "{args:?} was accepted");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// `camelot bench fault --quick` writes the standard result: five paths, each with
/// latency percentiles and a fault rate, and the fault-latency check.
#[test]
fn bench_fault_quick_writes_its_result() {
    let dir = std::env::temp_dir().join(format!("camelot-fault-{}", std::process::id()));
    let d = dir.to_str().expect("utf-8 path");
    let (ok, out, err) = camelot(&["bench", "fault", "--quick", "--pages", "512", "--out", d]);
    assert!(ok, "{err}");
    assert!(out.contains("FarRegion fault, remote"), "{out}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("fault.json")).expect("fault.json"))
            .expect("valid JSON");
    assert_eq!(json["bench"], "fault");
    assert_eq!(json["config"]["quick"], true);
    let points = json["series"][0]["points"].as_array().expect("points");
    // The four one-thread paths, then the same remote faults from 4 threads at once
    // (the handler pool's case).
    assert_eq!(points.len(), 5, "{points:?}");
    assert_eq!(points[4]["x"], "FarRegion faults, remote, 4 threads");
    for p in points {
        let p50 = p["latency_us"]["p50"].as_f64().expect("p50");
        let p99 = p["latency_us"]["p99"].as_f64().expect("p99");
        assert!(p50 > 0.0 && p99 >= p50, "{p}");
        assert!(p["ops_per_sec"].as_f64().expect("rate") > 0.0, "{p}");
    }
    // Every touch was a fault: the handler counted one per page on both regions.
    assert_eq!(json["config"]["faults_counted"]["far_region_remote"], 512);
    assert_eq!(json["config"]["faults_counted"]["far_region_local"], 512);
    // Each side as it ran, and the server's CPU on every path that used it.
    let sides = &json["config"]["sides"];
    for label in ["camelot", "camelot, 4 threads", "remote read"] {
        let side = &sides[label];
        assert_eq!(side["process"], "separate", "{label}: {side}");
        assert!(side["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("camelot ")));
        assert!(side["command"]
            .as_str()
            .is_some_and(|c| c.contains(" server --listen ")));
        assert!(
            side["flags"].as_array().is_some_and(|f| !f.is_empty()),
            "{side}"
        );
        assert!(
            side["server_threads"].as_u64().is_some_and(|t| t > 0),
            "{side}"
        );
    }
    assert_eq!(sides["camelot, 4 threads"]["client_threads"], 4);
    assert_eq!(sides["bare"]["process"], "in-process");
    for (i, p) in points.iter().enumerate() {
        let cpu = &p["extra"]["server_cpu_seconds"];
        if p["x"] == "FarRegion fault, local store" {
            assert!(cpu.is_null(), "the local store has no server: {p}");
        } else {
            assert!(cpu.as_f64().is_some_and(|c| c >= 0.0), "point {i}: {p}");
        }
    }
    let checks = json["comparisons"].as_array().expect("comparisons");
    assert!(checks[0]["name"]
        .as_str()
        .is_some_and(|n| n.contains("remote read p50 + bare fault p50")));
    std::fs::remove_dir_all(&dir).ok();
}

/// `--local-memory BYTES` sets the page cache's byte budget (instead of `--local PCT`): the
/// result records exactly that budget, and the two flags together are refused.
#[test]
fn bench_fault_takes_local_memory_as_bytes() {
    let dir = std::env::temp_dir().join(format!("camelot-fault-lm-{}", std::process::id()));
    let d = dir.to_str().expect("utf-8 path");
    let (ok, _, err) = camelot(&[
        "bench",
        "fault",
        "--quick",
        "--pages",
        "512",
        "--local-memory",
        "256K",
        "--out",
        d,
    ]);
    assert!(ok, "{err}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("fault.json")).expect("fault.json"))
            .expect("valid JSON");
    assert_eq!(json["config"]["local_bytes"], 256 << 10);
    assert!(json["config"]["local_percent"].is_null());
    let (ok, _, err) = camelot(&[
        "bench",
        "fault",
        "--quick",
        "--local",
        "20",
        "--local-memory",
        "1M",
        "--out",
        d,
    ]);
    assert!(!ok && err.contains("cannot be used with"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
