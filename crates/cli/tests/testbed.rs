//! `camelot testbed` as a user runs it: a SIGKILL of `up` halfway and the `down` after
//! it, the commands end to end, and the message a non-root user gets. The namespaces
//! and 10.213.0.0/24 addresses exist only inside namespaces these tests create.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_camelot");

fn run_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("camelot-cli-testbed-{}", std::process::id()))
}

fn camelot(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("CAMELOT_TESTBED_DIR", run_dir())
        .output()
        .unwrap()
}

fn is_root() -> bool {
    if camelot_testkit::process::euid_is_root() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI runs as root: the testbed tests must run there, not skip"
    );
    eprintln!("not root: the root-only checks are skipped here (never in CI)");
    false
}

fn namespaces(run: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("cmlt-tb-{run}-")))
        .map(str::to_string)
        .collect()
}

struct Down(String);
impl Drop for Down {
    fn drop(&mut self) {
        let _ = camelot(&["testbed", "down", "--name", &self.0]);
    }
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_non_root_user_is_told_what_is_missing() {
    if !is_root() {
        let out = camelot(&["testbed", "up", "--hosts", "1", "--name", "nr"]);
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("needs root"));
        return;
    }
    // As root, drop to nobody for the one command.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
        .args(["testbed", "up", "--hosts", "1", "--name", "nr"])
        .env("CAMELOT_TESTBED_DIR", run_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs root") && err.contains("effective uid 65534"),
        "{err}"
    );
    assert!(namespaces("nr").is_empty());
}

#[test]
fn down_after_up_is_sigkilled_halfway_leaves_nothing() {
    if !is_root() {
        return;
    }
    let run = format!("k{}", std::process::id() % 100_000);
    let _down = Down(run.clone());
    let mut up = Command::new(BIN)
        .args([
            "testbed",
            "up",
            "--hosts",
            "8",
            "--name",
            &run,
            "--step-pause-ms",
            "100",
        ])
        .env("CAMELOT_TESTBED_DIR", run_dir())
        .spawn()
        .unwrap();
    // Every namespace comes from one `ip -batch` child, which finishes on its own even
    // when `up` is killed; killing `up` before that batch is done would leave `down` to
    // race it. So kill once all 9 (8 hosts and the switch) exist: `up` is then in its
    // paused per-host steps, before the last host's address.
    let deadline = Instant::now() + Duration::from_secs(20);
    while namespaces(&run).len() < 9 {
        assert!(Instant::now() < deadline, "up made too few namespaces");
        std::thread::sleep(Duration::from_millis(5));
    }
    up.kill().unwrap();
    up.wait().unwrap();
    let left = namespaces(&run).len();
    // Halfway: the namespaces are made first, in one batch; the last host's address
    // comes near the end.
    let last = Command::new("ip")
        .args(["-n", &format!("cmlt-tb-{run}-h7"), "-o", "-4", "addr"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&last.stdout).contains("10.213.0.8"),
        "up was not killed halfway"
    );
    assert_eq!(left, 9, "{left} namespaces");
    let out = ok(&camelot(&["testbed", "down", "--name", &run]));
    assert!(out.contains(&format!("{left} namespaces removed")), "{out}");
    assert!(namespaces(&run).is_empty());
    assert!(!run_dir().join(&run).exists());
    // Twice is fine.
    ok(&camelot(&["testbed", "down", "--name", &run]));
}

#[test]
fn up_run_fault_down_from_the_command_line() {
    if !is_root() {
        return;
    }
    let run = format!("u{}", std::process::id() % 100_000);
    let _down = Down(run.clone());
    let out = ok(&camelot(&[
        "testbed", "up", "--hosts", "3", "--name", &run, "--rate", "1gbit",
    ]));
    assert!(out.contains("h2  10.213.0.3"), "{out}");
    let addr = ok(&camelot(&[
        "testbed", "run", "--name", &run, "h1", "--", "ip", "-o", "-4", "addr", "show", "dev",
        "eth0",
    ]));
    assert!(addr.contains("10.213.0.2/24"), "{addr}");
    // The command's exit status comes back.
    let out = camelot(&["testbed", "run", "--name", &run, "h0", "--", "false"]);
    assert!(!out.status.success());
    ok(&camelot(&[
        "testbed",
        "fault",
        "partition",
        "--name",
        &run,
        "h0",
    ]));
    let neigh = ok(&camelot(&[
        "testbed", "run", "--name", &run, "h0", "--", "ip", "neigh", "show",
    ]));
    assert!(
        neigh.contains("10.213.0.2") && neigh.contains("PERMANENT"),
        "{neigh}"
    );
    ok(&camelot(&[
        "testbed", "fault", "slow", "--name", &run, "--rate", "10mbit", "h1",
    ]));
    ok(&camelot(&["testbed", "fault", "heal", "--name", &run]));
    let neigh = ok(&camelot(&[
        "testbed", "run", "--name", &run, "h0", "--", "ip", "neigh", "show",
    ]));
    assert!(!neigh.contains("PERMANENT"), "{neigh}");
    let bad = camelot(&["testbed", "fault", "kill", "--name", &run, "h3"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no host \"h3\""));
    let listed = ok(&camelot(&["testbed", "list"]));
    assert!(listed.lines().any(|l| l == run), "{listed}");
    ok(&camelot(&["testbed", "down", "--name", &run]));
    assert!(namespaces(&run).is_empty());
}

#[test]
fn bench_testbed_writes_both_paths_in_the_result_schema() {
    if !is_root() {
        return;
    }
    let out_dir = run_dir().join("bench-out");
    let out = camelot(&[
        "bench",
        "testbed",
        "--seconds",
        "1",
        "--rate",
        "200mbit",
        "--threads",
        "1,4",
        "--delay",
        "1ms",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    ok(&out);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("testbed.json")).unwrap()).unwrap();
    assert_eq!(json["bench"], "testbed");
    let reads = &json["series"][0]["points"];
    assert_eq!(reads[0]["x"], "loopback");
    assert_eq!(reads[1]["x"], "testbed 200mbit");
    let testbed_bytes = reads[1]["bytes_per_sec"].as_f64().unwrap();
    // The link's tbf holds the reads under its rate (25 MB/s): payload can't beat it.
    assert!(
        testbed_bytes > 0.0 && testbed_bytes <= 25e6 * 1.05,
        "{testbed_bytes}"
    );
    let rtt = &json["series"][1]["points"];
    assert!(rtt[1]["latency_us"]["p99"].as_f64().unwrap() > 0.0);
    // The delayed path: four link ends of 1 ms each on every round trip.
    assert_eq!(reads[2]["x"], "testbed 200mbit + 1ms delay");
    let delayed_p50 = rtt[2]["latency_us"]["p50"].as_f64().unwrap();
    assert!(delayed_p50 >= 4_000.0, "{delayed_p50}");
    assert_eq!(json["comparisons"][0]["target"], 0.8);
    // The threads experiment: unbatched and batched, each thread count on both paths.
    for (i, depth) in [(2, "1 outstanding"), (3, "16 outstanding")] {
        let series = &json["series"][i];
        assert!(
            series["label"].as_str().unwrap().contains(depth),
            "{series}"
        );
        let labels: Vec<&str> = series["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["x"].as_str().unwrap())
            .collect();
        assert_eq!(
            labels,
            [
                "loopback, 1 threads",
                "loopback, 4 threads",
                "testbed 200mbit, 1 threads",
                "testbed 200mbit, 4 threads",
                "testbed 200mbit + 1ms delay, 1 threads",
                "testbed 200mbit + 1ms delay, 4 threads"
            ]
        );
        assert!(series["points"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["ops_per_sec"].as_f64().unwrap() > 0.0));
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// sockperf's TCP round trip from h0 to h1 of testbed `run`: (p50, p99) in µs, or the
/// error text when no round trip completes.
fn sockperf_rtt_us(run: &str) -> Result<(f64, f64), String> {
    let mut server = Command::new(BIN)
        .args(["testbed", "run", "--name", run, "h1", "--"])
        .args([
            "sockperf",
            "server",
            "--tcp",
            "-i",
            "10.213.0.2",
            "-p",
            "11111",
        ])
        .env("CAMELOT_TESTBED_DIR", run_dir())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // sockperf retries its connect for a while, so a server still starting is fine.
    let out = camelot(&[
        "testbed",
        "run",
        "--name",
        run,
        "h0",
        "--",
        "timeout",
        "20",
        "sockperf",
        "ping-pong",
        "--tcp",
        "-i",
        "10.213.0.2",
        "-p",
        "11111",
        "-m",
        "64",
        "-t",
        "2",
        "--full-rtt",
    ]);
    let _ = server.kill();
    let _ = server.wait();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let rtt =
        camelot_bench::peers::parse_sockperf_output(&text).map_err(|e| format!("{e}: {text}"))?;
    Ok((rtt.p50, rtt.p99))
}

#[test]
fn delay_and_loss_go_through_the_relay() {
    if !is_root() {
        return;
    }
    // 2 ms on every link: h0 → h1 crosses two links each way, so the round trip is
    // four delays (8 ms) plus the path's own tens of µs.
    let run = format!("d{}", std::process::id() % 100_000);
    let _down = Down(run.clone());
    ok(&camelot(&[
        "testbed", "up", "--hosts", "2", "--delay", "2ms", "--name", &run,
    ]));
    let (p50, p99) = sockperf_rtt_us(&run).unwrap();
    assert!(
        (8_000.0..40_000.0).contains(&p50),
        "RTT p50 {p50} µs with 2 ms a link (p99 {p99})"
    );
    ok(&camelot(&["testbed", "down", "--name", &run]));
    assert!(namespaces(&run).is_empty());
    // The same path without delay is well under one delay: the relay made the 8 ms.
    let plain = format!("n{}", std::process::id() % 100_000);
    let _plain_down = Down(plain.clone());
    ok(&camelot(&[
        "testbed", "up", "--hosts", "2", "--name", &plain,
    ]));
    let (p50, _) = sockperf_rtt_us(&plain).unwrap();
    assert!(p50 < 2_000.0, "RTT p50 {p50} µs without delay");
    ok(&camelot(&["testbed", "down", "--name", &plain]));
    // 100% loss: nothing gets through, and `down` still removes the relays.
    let lossy = format!("l{}", std::process::id() % 100_000);
    let _lossy_down = Down(lossy.clone());
    ok(&camelot(&[
        "testbed", "up", "--hosts", "2", "--loss", "100%", "--name", &lossy,
    ]));
    assert!(sockperf_rtt_us(&lossy).is_err());
    // One relay per host, in the switch namespace; `down` kills them with it.
    let pids = Command::new("ip")
        .args(["netns", "pids", &format!("cmlt-tb-{lossy}-sw")])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&pids.stdout).lines().count(), 2);
    ok(&camelot(&["testbed", "down", "--name", &lossy]));
    assert!(namespaces(&lossy).is_empty());
}
