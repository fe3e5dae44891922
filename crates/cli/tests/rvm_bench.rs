//! `camelot bench rvm-commit` through the real binary: the pool's servers are separate
//! `camelot server` processes by default, like redis-server, and the result says so.

use std::process::Command;
use std::time::{Duration, Instant};

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");
const RUN_TIME_LIMIT: Duration = Duration::from_secs(240);

fn scratch(tag: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("camelot-cli-{tag}-{}-{nanos}", std::process::id()))
}

/// Runs camelot to completion, killing it past the time limit.
fn camelot(args: &[&str]) -> std::process::Output {
    let mut child = Command::new(CAMELOT)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn camelot");
    let deadline = Instant::now() + RUN_TIME_LIMIT;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("camelot {args:?} ran past {RUN_TIME_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn rvm_commit_runs_the_pool_and_redis_as_separate_processes() {
    let dir = scratch("rvm-bench");
    let out = dir.to_string_lossy().to_string();
    let run = camelot(&[
        "bench",
        "rvm-commit",
        "--quick",
        "--backend",
        "pool,redis",
        "--pages",
        "1,10",
        "--out",
        &out,
    ]);
    assert!(
        run.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let text = std::fs::read_to_string(dir.join("rvm-commit.json")).expect("rvm-commit.json");
    let r: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let labels: Vec<&str> = r["series"]
        .as_array()
        .expect("series")
        .iter()
        .filter_map(|s| s["label"].as_str())
        .collect();
    assert_eq!(labels, ["pool", "redis"]);
    for side in ["pool", "redis"] {
        assert_eq!(
            r["config"]["sides"][side]["process"], "separate",
            "{side}: {text}"
        );
    }
    assert_eq!(r["config"]["sides"]["pool"]["server_threads"], 1);
    assert!(r["config"]["sides"]["pool"]["command"]
        .as_str()
        .is_some_and(|c| c.contains(" server --listen 127.0.0.1:")));
    assert!(r["config"]["sides"]["redis"]["version"]
        .as_str()
        .is_some_and(|v| v.contains("Redis server")));
    assert!(
        r["comparisons"].as_array().is_some_and(|c| !c.is_empty()),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
