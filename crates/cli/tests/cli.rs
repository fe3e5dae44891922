//! The `camelot` binary as a user runs it: real processes, loopback ports, signals.

use bytes::{Bytes, BytesMut};
use camelot_proto::{
    decode_frame, encode_frame, Frame, FrameDecoder, Hello, Op, Reply, Request, RequestBatch,
    PROTOCOL_VERSION,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");

/// A running `camelot` whose stdout lines arrive on a channel, killed if the test fails.
struct Proc {
    child: Child,
    lines: Receiver<String>,
}

impl Proc {
    fn spawn(args: &[&str]) -> Proc {
        let mut child = Command::new(CAMELOT)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn camelot");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines }
    }

    /// The first stdout line containing `needle`, within `timeout`.
    fn line_with(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => {}
                Err(e) => panic!("no line with {needle:?} within {timeout:?}: {e}"),
            }
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill {sig} failed");
    }

    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {timeout:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr(&mut self) -> String {
        let mut s = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut s);
        }
        s
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(args: &[&str], timeout: Duration) -> (ExitStatus, String, String) {
    let mut p = Proc::spawn(args);
    let status = p.wait(timeout);
    let out: Vec<String> = p.lines.try_iter().collect();
    // The reader thread may lag the exit by a moment; drain what is left.
    let mut out = out.join("\n");
    while let Ok(l) = p.lines.recv_timeout(Duration::from_secs(2)) {
        out.push('\n');
        out.push_str(&l);
    }
    let err = p.stderr();
    (status, out, err)
}

fn start_server(extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec!["server", "--listen", "127.0.0.1:0", "--memory", "64M"];
    args.extend_from_slice(extra);
    let p = Proc::spawn(&args);
    let line = p.line_with("listening on", Duration::from_secs(30));
    let addr = line
        .split_whitespace()
        .find_map(|w| w.parse::<SocketAddr>().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    (p, addr)
}

fn send(stream: &mut TcpStream, frame: &Frame) {
    let mut buf = BytesMut::new();
    encode_frame(frame, &mut buf).expect("encode");
    stream.write_all(&buf).expect("send");
}

fn recv(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<Frame> {
    loop {
        if let Some(body) = FrameDecoder::split_frame(buf).expect("sane frame") {
            return Some(decode_frame(body).expect("decodable frame"));
        }
        let mut chunk = [0u8; 65536];
        match stream.read(&mut chunk) {
            Ok(0) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => panic!("read: {e}"),
        }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("camelot-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

#[test]
fn sigterm_answers_in_flight_requests_and_exits_zero() {
    let (mut server, addr) = start_server(&[]);
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut buf = BytesMut::new();
    send(
        &mut s,
        &Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: Bytes::new(),
            principal: String::new(),
            fence: None,
        }),
    );
    assert!(matches!(recv(&mut s, &mut buf), Some(Frame::HelloOk(_))));
    send(
        &mut s,
        &Frame::Requests(RequestBatch {
            epoch: 0,
            requests: vec![Request {
                id: 1,
                op: Op::Alloc {
                    size: 32 << 20,
                    name: None,
                    mode: camelot_proto::AccessMode::Private,
                },
            }],
        }),
    );
    let region = match recv(&mut s, &mut buf) {
        Some(Frame::Responses(r)) => match &r.responses[0].result {
            Ok(Reply::Region(info)) => info.id,
            other => panic!("alloc: {other:?}"),
        },
        other => panic!("alloc: {other:?}"),
    };

    // 16 frames of 64 writes of 16 KiB each: 16 MiB the server has to work through after
    // the signal. All of it is handed to the kernel before SIGTERM is sent.
    const FRAMES: u64 = 16;
    const OPS: u64 = 64;
    let data = Bytes::from(vec![0xA5u8; 16 << 10]);
    let mut out = BytesMut::new();
    for f in 0..FRAMES {
        let requests = (0..OPS)
            .map(|i| Request {
                id: 100 + f * OPS + i,
                op: Op::Write {
                    region,
                    offset: (f * OPS + i) * (16 << 10),
                    data: data.clone(),
                },
            })
            .collect();
        encode_frame(
            &Frame::Requests(RequestBatch { epoch: 0, requests }),
            &mut out,
        )
        .expect("encode");
    }
    // Writing 16 MiB blocks until the server reads most of it, so write from a thread
    // and signal as soon as it is all handed over.
    let mut writer = s.try_clone().expect("clone");
    let sent = std::thread::spawn(move || writer.write_all(&out).map(|_| ()));
    sent.join().expect("writer").expect("send requests");
    server.signal("-TERM");

    let mut answered = 0;
    while let Some(frame) = recv(&mut s, &mut buf) {
        match frame {
            Frame::Responses(r) => {
                for resp in r.responses {
                    assert!(
                        matches!(resp.result, Ok(Reply::Done)),
                        "request {} failed: {:?}",
                        resp.id,
                        resp.result
                    );
                    answered += 1;
                }
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
    assert_eq!(
        answered,
        FRAMES * OPS,
        "not every in-flight request was answered"
    );
    let status = server.wait(Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}: {}", server.stderr());
}

#[test]
fn stats_reports_memory_regions_connections_and_ops() {
    let (mut server, addr) = start_server(&["--token", "tok"]);
    let a = addr.to_string();
    let (status, out, err) = run(&["stats", &a, "--token", "tok"], Duration::from_secs(30));
    assert!(status.success(), "{err}");
    for needle in [
        "memory",
        "64.0 MiB",
        "buffers",
        "256.0 MiB (connection input and output)",
        "total cap   320.0 MiB",
        "regions",
        "connections",
        "ops served",
        "read",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
    // The wrong token is a clear error, said once, with the way to give the right one.
    let (status, _, err) = run(&["stats", &a, "--token", "nope"], Duration::from_secs(30));
    assert!(!status.success());
    assert_eq!(
        err.trim_end(),
        format!(
            "error: {a} refused the cluster token (wrong or missing): give the server's \
             token with --token or in the CAMELOT_TOKEN environment variable"
        )
    );
    server.signal("-TERM");
    assert!(server.wait(Duration::from_secs(30)).success());
}

#[test]
fn bad_arguments_are_clear_errors() {
    let (status, _, err) = run(&["server", "--memory", "lots"], Duration::from_secs(30));
    assert!(!status.success());
    assert!(err.contains("lots"), "{err}");
    let (status, _, err) = run(
        &["server", "--listen", "not-an-address"],
        Duration::from_secs(30),
    );
    assert!(!status.success());
    assert!(err.contains("not-an-address"), "{err}");
    let (status, _, err) = run(&["dev", "--nodes", "0"], Duration::from_secs(30));
    assert!(!status.success());
    assert!(err.contains("nodes"), "{err}");
    let (status, _, err) = run(
        &[
            "bench",
            "threads",
            "--threads",
            "0",
            "--out",
            "/nonexistent",
        ],
        Duration::from_secs(30),
    );
    assert!(!status.success());
    assert!(err.contains("thread"), "{err}");
}

#[test]
fn dev_prints_its_nodes_and_stops_on_ctrl_c() {
    let mut dev = Proc::spawn(&["dev", "--nodes", "2", "--memory", "8M"]);
    let line = dev.line_with("servers:", Duration::from_secs(30));
    let addrs: Vec<SocketAddr> = line
        .trim_start_matches("servers:")
        .trim()
        .split(',')
        .map(|a| a.parse().expect("address"))
        .collect();
    assert_eq!(addrs.len(), 2);
    for a in &addrs {
        TcpStream::connect(a).expect("node accepts");
    }
    dev.signal("-INT");
    let status = dev.wait(Duration::from_secs(30));
    assert!(status.success(), "{status:?}: {}", dev.stderr());
}

#[test]
fn demo_runs_across_three_nodes_and_summarises() {
    let dir = temp_dir("demo-limits");
    let limits = dir.join("limits.json");
    std::fs::write(
        &limits,
        r#"{"tcp_stream_bytes_per_sec": 4e9, "tcp_pingpong_us_p50": 50.0}"#,
    )
    .expect("write limits");
    let (status, out, err) = run(
        &[
            "demo",
            "--requests",
            "20000",
            "--threads",
            "4",
            "--limits",
            limits.to_str().expect("utf-8 path"),
        ],
        Duration::from_secs(120),
    );
    assert!(status.success(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    for needle in [
        "reading results against the limits in",
        "of this machine's TCP stream limit",
        "× this machine's TCP ping-pong p50",
        "3 memory servers",
        "ops/s",
        "GB/s",
        "p50",
        "p99",
        "node 2",
        "checks",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
}

fn finite_positive(v: &serde_json::Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    x
}

#[test]
fn bench_threads_quick_writes_schema_json_and_figure() {
    let dir = temp_dir("threads");
    let d = dir.to_str().expect("utf-8 path");
    let t = Instant::now();
    let (status, out, err) = run(
        &[
            "bench",
            "threads",
            "--quick",
            "--compare-batching",
            "--out",
            d,
        ],
        Duration::from_secs(180),
    );
    assert!(status.success(), "{err}");
    assert!(out.contains("threads.json"), "{out}");
    eprintln!("bench threads --quick took {:?}", t.elapsed());
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("threads.json")).expect("threads.json"))
            .expect("valid JSON");
    assert_eq!(json["bench"], "threads");
    assert_eq!(json["config"]["x"], "threads");
    // The servers are `camelot server` processes, and a point lasts at least a second.
    assert_eq!(json["config"]["process"], "separate");
    let command = json["config"]["servers"]["command"]
        .as_str()
        .expect("command");
    assert!(command.contains(" server --listen 127.0.0.1:"), "{command}");
    assert_eq!(json["config"]["min_point_seconds"], 1.0);
    // The side as it ran: process, threads, version, flags.
    let side = &json["config"]["sides"]["camelot"];
    assert_eq!(side["process"], "separate", "{side}");
    assert!(side["version"]
        .as_str()
        .is_some_and(|v| v.starts_with("camelot ")));
    assert!(
        side["flags"].as_array().is_some_and(|f| !f.is_empty()),
        "{side}"
    );
    finite_positive(&side["server_threads"], "server threads");
    assert_eq!(side["client_threads"], 64, "{side}");
    finite_positive(&json["machine"]["cores"], "cores");
    let series = json["series"].as_array().expect("series");
    let labels: Vec<&str> = series.iter().filter_map(|s| s["label"].as_str()).collect();
    assert_eq!(labels, ["batched", "unbatched"]);
    for s in series {
        let points = s["points"].as_array().expect("points");
        assert_eq!(points.len(), 4, "quick runs 1, 4, 16, 64 threads");
        for p in points {
            finite_positive(&p["x"], "x");
            let e = &p["extra"];
            assert!(finite_positive(&e["seconds"], "seconds") >= 0.9, "{e}");
            assert!(
                finite_positive(&e["requests"], "requests") >= 20_000.0,
                "{e}"
            );
            let least = finite_positive(&e["driver_requests_min"], "fewest per thread");
            assert!(least <= finite_positive(&e["driver_requests_max"], "most per thread"));
            finite_positive(&e["server_cpu_seconds"], "server CPU seconds");
            finite_positive(&p["ops_per_sec"], "ops_per_sec");
            finite_positive(&p["bytes_per_sec"], "bytes_per_sec");
            let l = &p["latency_us"];
            let p50 = finite_positive(&l["p50"], "p50");
            let max = finite_positive(&l["max"], "max");
            assert!(p50 <= max);
        }
    }
    let png = std::fs::read(dir.join("threads.png")).expect("threads.png");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_api_quick_measures_every_target_beside_its_peer() {
    let dir = temp_dir("api");
    let d = dir.to_str().expect("utf-8 path");
    let (status, out, err) = run(
        &["bench", "api", "--quick", "--out", d],
        Duration::from_secs(240),
    );
    assert!(status.success(), "{err}");
    for needle in [
        "iperf3",
        "redis-benchmark",
        "sockperf",
        "batched vs unbatched",
        "event loop",
        "collapse",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("api.json")).expect("api.json"))
            .expect("valid JSON");
    let series = json["series"].as_array().expect("series");
    let camelot = &series[0]["points"];
    let peer = &series[1]["points"];
    // Three threaded checks, the same three on the event-loop face, latency, and two
    // no-collapse checks; and the two ops-per-server-CPU-second ones when both servers
    // spent enough CPU time to be compared (a quick run may be too short for it).
    let checks = camelot.as_array().map_or(0, Vec::len);
    assert!((9..=11).contains(&checks), "{checks} checks");
    for i in 0..checks {
        finite_positive(&camelot[i]["extra"]["value"], "camelot value");
        finite_positive(&camelot[i]["extra"]["ratio"], "ratio");
        finite_positive(&peer[i]["extra"]["value"], "peer value");
    }
    // Every check is a comparison; all but the CPU ones carry their target.
    let comparisons = json["comparisons"].as_array().expect("comparisons");
    assert_eq!(comparisons.len(), checks);
    let with_target = comparisons
        .iter()
        .filter(|c| c["target"].is_number())
        .count();
    assert_eq!(with_target, 9);
    // Like with like: one direction against iperf3 -R, and both servers as processes.
    let stream = &comparisons[0];
    assert!(
        stream["name"].as_str().is_some_and(|n| n.contains("READs")),
        "{stream}"
    );
    assert_eq!(stream["peer_label"], "iperf3 -R");
    let config = &json["config"];
    assert_eq!(config["process"], "separate");
    assert_eq!(config["sides"]["redis"]["process"], "separate");
    assert_eq!(config["sides"]["redis"]["depth"], 256);
    let loop_side = &config["sides"]["camelot, event loop 16 tasks × 16"];
    assert_eq!(loop_side["process"], "separate");
    assert_eq!(loop_side["depth"], 256);
    assert_eq!(config["pinned"]["threads"], true);
    let references = json["references"].as_array().expect("references");
    for metric in ["bytes_per_sec", "ops_per_sec", "latency_us.p50"] {
        let r = references
            .iter()
            .find(|r| r["metric"] == metric)
            .unwrap_or_else(|| panic!("no {metric} reference in {references:?}"));
        finite_positive(&r["value"], metric);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_resp_quick_runs_every_server_as_a_process_and_meters_it() {
    let dir = temp_dir("resp");
    let d = dir.to_str().expect("utf-8 path");
    let (status, out, err) = run(
        &["bench", "resp", "--quick", "--out", d],
        Duration::from_secs(240),
    );
    assert!(status.success(), "{err}");
    for needle in [
        "camelot parity",
        "server CPU s",
        "ops per server CPU-s",
        "resp.json",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("resp.json")).expect("resp.json"))
            .expect("valid JSON");
    let sides = &json["config"]["sides"];
    for side in ["camelot", "camelot parity", "redis"] {
        assert_eq!(sides[side]["process"], "separate", "{side}: {sides}");
        assert_eq!(sides[side]["server_threads"], 1, "{side}: {sides}");
    }
    assert_eq!(sides["redis"]["server"], "redis-server");
    let parity: Vec<&str> = sides["camelot parity"]["flags"]
        .as_array()
        .expect("flags")
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    let at = parity
        .iter()
        .position(|f| *f == "--resp-poll-us")
        .unwrap_or_else(|| panic!("no --resp-poll-us in {parity:?}"));
    assert_eq!(parity.get(at + 1), Some(&"0"));
    assert!(
        parity.windows(2).any(|w| w == ["--threads", "1"]),
        "{parity:?}"
    );
    let series = json["series"].as_array().expect("series");
    let labels: Vec<&str> = series.iter().filter_map(|s| s["label"].as_str()).collect();
    assert_eq!(labels, ["camelot", "camelot parity", "redis"]);
    for s in series {
        let points = s["points"].as_array().expect("points");
        assert_eq!(points.len(), 4, "GET and SET at -P 1 and -P 16");
        for p in points {
            finite_positive(&p["ops_per_sec"], "ops/s");
            let cpu = &p["extra"]["server_cpu_seconds"];
            assert!(cpu.as_f64().is_some_and(|c| c >= 0.0), "{p}");
            // 20,000 unpipelined requests keep a server busy for many clock ticks.
            if !p["x"].as_str().is_some_and(|x| x.contains("-P")) {
                finite_positive(&p["extra"]["ops_per_server_cpu_second"], "ops per CPU-s");
            }
        }
    }
    let comparisons = json["comparisons"].as_array().expect("comparisons");
    let throughput = comparisons
        .iter()
        .filter(|c| c["unit"] == "ops/s" && c["target"] == 1.0)
        .count();
    assert_eq!(
        throughput, 4,
        "camelot ÷ redis for every case: {comparisons:?}"
    );
    assert!(
        comparisons.iter().any(|c| c["unit"] == "ops/CPU-s"
            && c["name"].as_str().is_some_and(|n| n.contains("parity"))),
        "parity ÷ redis ops per CPU-second for the unpipelined cases: {comparisons:?}"
    );
    let png = std::fs::read(dir.join("resp.png")).expect("resp.png");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_all_quick_runs_every_bench_then_the_report() {
    let dir = temp_dir("all");
    let d = dir.to_str().expect("utf-8 path");
    let (status, out, err) = run(
        &["bench", "all", "--quick", "--out", d],
        // The five middlebox benches take about three minutes of it in a debug build.
        Duration::from_secs(720),
    );
    assert!(status.success(), "{err}");
    for bench in [
        "cpu",
        "mem",
        "net",
        "disk",
        "threads",
        "api",
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
        #[cfg(feature = "etcd")]
        "cluster-percentiles",
        #[cfg(feature = "etcd")]
        "cluster-expand",
        #[cfg(feature = "etcd")]
        "cluster-rebalance",
    ] {
        assert!(err.contains(&format!("bench {bench}: done")), "{err}");
        let json: serde_json::Value = serde_json::from_slice(
            &std::fs::read(dir.join(format!("{bench}.json"))).expect("result file"),
        )
        .expect("valid JSON");
        assert_eq!(json["bench"], bench);
        assert!(
            json["config"]["quick"].as_bool().unwrap_or(false),
            "{bench} not quick"
        );
    }
    // The emulated network needs root (CI is root): its result and figure, or a skip
    // that says why.
    if camelot_testkit::process::euid_is_root() {
        assert!(err.contains("bench testbed: done"), "{err}");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("testbed.json")).expect("testbed.json"))
                .expect("valid JSON");
        assert_eq!(json["config"]["quick"], true);
        assert!(
            json["comparisons"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["target"] == 0.8)),
            "the link-rate comparison: {json}"
        );
        let png = std::fs::read(dir.join("testbed.png")).expect("testbed.png");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    } else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs as root: bench all must run the testbed bench there"
        );
        assert!(err.contains("bench testbed: skipped"), "{err}");
    }
    // Every store of the YCSB comparison ran as a server process of its own, metered.
    let ycsb: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ycsb.json")).expect("ycsb.json"))
            .expect("valid JSON");
    for side in ["camelot-native", "camelot-resp", "redis", "memcached"] {
        assert_eq!(
            ycsb["config"]["sides"][side]["process"], "separate",
            "{side}"
        );
    }
    for s in ycsb["series"].as_array().expect("series") {
        for p in s["points"].as_array().expect("points") {
            finite_positive(&p["extra"]["server_cpu_seconds"], "server CPU seconds");
        }
    }
    // bench all prints each bench's comparisons as it finishes.
    assert!(
        err.contains("YCSB A throughput, 1 server thread each"),
        "{err}"
    );
    // The hw benches' limits are saved and the request API's points are read against them.
    let limits: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("limits.json")).expect("limits.json"))
            .expect("valid JSON");
    finite_positive(&limits["tcp_stream_bytes_per_sec"], "tcp stream limit");
    let threads: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("threads.json")).expect("threads.json"))
            .expect("valid JSON");
    for p in threads["series"][0]["points"].as_array().expect("points") {
        finite_positive(
            &p["extra"]["fraction_of_tcp_stream"],
            "fraction of the limit",
        );
    }
    let api: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("api.json")).expect("api.json"))
            .expect("valid JSON");
    let checks = api["series"][0]["points"].as_array().expect("checks");
    let read: Vec<&serde_json::Value> = checks
        .iter()
        .flat_map(|c| {
            ["fraction_of_tcp_stream", "p50_over_tcp_pingpong_p50"]
                .into_iter()
                .filter_map(|k| c["extra"].get(k))
        })
        .collect();
    assert_eq!(
        read.len(),
        3,
        "the two stream checks (threads, event loop) and the latency check read against limits"
    );
    for v in read {
        finite_positive(v, "api check against a limit");
    }
    let html = std::fs::read_to_string(dir.join("index.html")).expect("index.html");
    assert!(out.contains("index.html"), "{out}");
    for needle in [
        "cpu.png",
        "mem.png",
        "net.png",
        "disk.png",
        "threads.png",
        "api.png",
        "ycsb.png",
        "resp.png",
    ] {
        assert!(html.contains(needle), "{needle} missing from the report");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_hw_net_quick_measures_against_a_net_server_process() {
    let mut server = Proc::spawn(&["bench", "hw", "net-server", "--listen", "127.0.0.1:0"]);
    let line = server.line_with("listening on", Duration::from_secs(30));
    let addr = line
        .split_whitespace()
        .find_map(|w| w.parse::<SocketAddr>().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    let dir = temp_dir("hw-net-peer");
    let d = dir.to_str().expect("utf-8 path");
    let peer = addr.to_string();
    let (status, out, err) = run(
        &[
            "bench", "hw", "net", "--quick", "--peer", &peer, "--out", d, "--save",
        ],
        Duration::from_secs(120),
    );
    assert!(status.success(), "{err}");
    assert!(out.contains("limits.json"), "{out}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("net.json")).expect("net.json"))
            .expect("valid JSON");
    assert_eq!(json["bench"], "net");
    assert_eq!(json["config"]["peer"], peer.as_str());
    let series = json["series"].as_array().expect("series");
    let labels: Vec<&str> = series.iter().filter_map(|s| s["label"].as_str()).collect();
    for want in ["tcp ×1", "udp ×1", "tcp ping-pong", "udp ping-pong"] {
        assert!(labels.contains(&want), "{want} missing from {labels:?}");
    }
    for s in series {
        let points = s["points"].as_array().expect("points");
        assert!(!points.is_empty(), "{}", s["label"]);
        for p in points {
            if s["label"].as_str().is_some_and(|l| l.contains("ping-pong")) {
                let p50 = finite_positive(&p["latency_us"]["p50"], "p50");
                assert!(p50 <= finite_positive(&p["latency_us"]["max"], "max"));
                finite_positive(&p["ops_per_sec"], "round trips/s");
            } else {
                finite_positive(&p["bytes_per_sec"], "bytes_per_sec");
            }
        }
    }
    let limits: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("limits.json")).expect("limits.json"))
            .expect("valid JSON");
    finite_positive(&limits["tcp_stream_bytes_per_sec"], "tcp stream limit");
    finite_positive(&limits["tcp_pingpong_us_p50"], "tcp ping-pong limit");
    // The server outlives the run and stops cleanly on SIGTERM.
    server.signal("-TERM");
    assert!(server.wait(Duration::from_secs(10)).success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Lines of `text` containing `needle`, for checking a message is said exactly once.
fn occurrences(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

#[test]
fn nonsense_limits_are_refused_or_warned_about() {
    let refused = [
        (&["server", "--memory", "0"][..], "--memory 0"),
        (&["server", "--memory", "-5G"][..], "'-5G' is negative"),
        (
            &["server", "--connections-max", "0"][..],
            "--connections-max 0",
        ),
        (
            &["server", "--unauth-connections-max", "0"][..],
            "--unauth-connections-max 0",
        ),
        (
            &[
                "server",
                "--connections-max",
                "8",
                "--unauth-connections-max",
                "9",
            ][..],
            "more than --connections-max 8",
        ),
        (&["server", "--auth-timeout", "0"][..], "--auth-timeout 0"),
        (&["server", "--idle-timeout", "-1"][..], "--idle-timeout"),
        (
            &["server", "--connection-memory", "1K"][..],
            "--connection-memory 1.0 KiB is too small",
        ),
    ];
    for (args, needle) in refused {
        let mut args = args.to_vec();
        args.extend(["--listen", "127.0.0.1:0"]);
        let (status, out, err) = run(&args, Duration::from_secs(30));
        assert!(!status.success(), "{args:?} was accepted: {out}");
        assert!(
            err.contains(needle),
            "{args:?}: {needle:?} missing from {err}"
        );
        assert!(!out.contains("listening"), "{args:?} started a server");
    }
    // More than this machine has: a warning, naming the machine's RAM, and it still runs.
    let mut p = Proc::spawn(&["server", "--listen", "127.0.0.1:0", "--memory", "100000T"]);
    p.line_with("listening on", Duration::from_secs(30));
    p.signal("-TERM");
    assert!(p.wait(Duration::from_secs(30)).success());
    let err = p.stderr();
    assert_eq!(occurrences(&err, "warning: --memory 100000.0 TiB plus --connection-memory 256.0 MiB is more than this machine's"), 1, "{err}");
}

#[test]
fn errors_say_each_thing_once() {
    let (mut first, addr) = start_server(&[]);
    let port = addr.to_string();
    let (status, _, err) = run(&["server", "--listen", &port], Duration::from_secs(30));
    assert!(!status.success());
    assert_eq!(occurrences(&err, "Address already in use"), 1, "{err}");
    assert!(
        err.starts_with(&format!("error: cannot start a server on {port}")),
        "{err}"
    );
    first.signal("-TERM");
    assert!(first.wait(Duration::from_secs(30)).success());
}

#[test]
fn stats_against_something_else_says_it_is_not_a_camelot_server() {
    // A port that accepts and never answers (as a Redis port does to our HELLO).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_addr = silent.local_addr().expect("addr").to_string();
    let holder = std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().take(1).collect();
        std::thread::sleep(Duration::from_secs(5));
        drop(held);
    });
    let started = Instant::now();
    let (status, _, err) = run(
        &["stats", &silent_addr, "--timeout", "1"],
        Duration::from_secs(30),
    );
    assert!(!status.success());
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "took {:?}",
        started.elapsed()
    );
    assert!(err.contains("not a Camelot server"), "{err}");
    assert!(!err.contains("os error 11"), "{err}");
    assert_eq!(occurrences(&err, &silent_addr), 1, "{err}");
    holder.join().expect("holder thread");

    // Camelot's own Redis port is not the native one either.
    let mut p = Proc::spawn(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--memory",
        "64M",
        "--resp-listen",
        "127.0.0.1:0",
    ]);
    let line = p.line_with("Redis protocol on", Duration::from_secs(30));
    let resp = line.split_whitespace().last().expect("address").to_string();
    let (status, _, err) = run(&["stats", &resp], Duration::from_secs(30));
    assert!(!status.success());
    assert!(err.contains("not a Camelot server"), "{err}");
    p.signal("-TERM");
    assert!(p.wait(Duration::from_secs(30)).success());
}

#[test]
fn readme_says_where_the_binary_is() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    let quick_start = readme
        .split("## Quick start")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a Quick start section");
    assert!(
        quick_start.contains("cargo install --path crates/cli"),
        "{quick_start}"
    );
    assert!(
        quick_start.contains("target/release/camelot"),
        "{quick_start}"
    );
    for flag in [
        "--connection-memory",
        "--unauth-connections-max",
        "--auth-timeout",
        "--idle-timeout",
    ] {
        assert!(readme.contains(flag), "README does not explain {flag}");
    }
}

#[test]
fn require_token_refuses_to_start_without_one() {
    let (status, _, err) = run(
        &["server", "--listen", "127.0.0.1:0", "--require-token"],
        Duration::from_secs(30),
    );
    assert!(!status.success(), "started without a token");
    assert!(err.contains("--require-token"), "{err}");
    // With a token it starts, and on loopback `stats` has nothing to warn about.
    let (mut server, addr) = start_server(&["--require-token", "--token", "tok"]);
    let (status, out, err) = run(
        &["stats", &addr.to_string(), "--token", "tok"],
        Duration::from_secs(30),
    );
    assert!(status.success(), "{err}");
    assert!(out.contains("exposed_without_token 0"), "{out}");
    assert!(!out.contains("WARNING"), "{out}");
    server.signal("-TERM");
    assert!(server.wait(Duration::from_secs(30)).success());
}

#[test]
fn principal_tokens_file_must_be_private_and_locks_its_principals() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("principal-tokens");
    let file = dir.join("tokens");
    std::fs::write(&file, "# who may be whom\nanonymous n0\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let file_s = file.to_string_lossy().to_string();
    let (status, _, err) = run(
        &[
            "server",
            "--listen",
            "127.0.0.1:0",
            "--principal-tokens",
            &file_s,
        ],
        Duration::from_secs(30),
    );
    assert!(
        !status.success(),
        "started with a world-readable tokens file"
    );
    assert!(err.contains("chmod 600"), "{err}");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (mut server, addr) = start_server(&["--principal-tokens", &file_s]);
    // No cluster token, but `anonymous` (who `stats` connects as) is listed.
    let (status, _, err) = run(&["stats", &addr.to_string()], Duration::from_secs(30));
    assert!(!status.success(), "anonymous got in without its token");
    assert!(err.contains("token"), "{err}");
    let (status, out, err) = run(
        &["stats", &addr.to_string(), "--token", "n0"],
        Duration::from_secs(30),
    );
    assert!(status.success(), "{err}");
    assert!(out.contains("regions"), "{out}");
    server.signal("-TERM");
    assert!(server.wait(Duration::from_secs(30)).success());
}

#[test]
fn bench_ycsb_reaches_a_tokened_server_by_url_or_flag() {
    let (mut server, addr) = start_server(&["--token", "zq9secret", "--quota-regions", "4"]);
    let out = temp_dir("ycsb-token");
    let out_s = out.to_string_lossy().to_string();
    let by_url = format!("camelot://:zq9secret@{addr}");
    let plain = format!("camelot://{addr}");
    let common = [
        "bench",
        "ycsb",
        "--workload",
        "c",
        "--records",
        "200",
        "--operations",
        "200",
        "--threads",
        "2",
        "--out",
        &out_s,
    ];
    for extra in [
        vec!["--target", &by_url],
        vec!["--target", &plain, "--token", "zq9secret"],
    ] {
        let args: Vec<&str> = common.iter().copied().chain(extra).collect();
        let (status, _, err) = run(&args, Duration::from_secs(120));
        assert!(status.success(), "{args:?}: {err}");
        let json = std::fs::read_to_string(out.join("ycsb.json")).expect("ycsb.json");
        assert!(
            !json.contains("zq9secret"),
            "the token leaked into ycsb.json"
        );
    }
    // Without a token the server refuses the bench, and says why.
    let args: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--target", plain.as_str()])
        .collect();
    let (status, _, err) = run(&args, Duration::from_secs(120));
    assert!(!status.success());
    assert!(err.contains("token"), "{err}");
    server.signal("-TERM");
    assert!(server.wait(Duration::from_secs(30)).success());
    let _ = std::fs::remove_dir_all(&out);
}

/// A server started with `args` (no token), then `camelot stats` through 127.0.0.1 and
/// SIGTERM: (stats output, the server's stderr). The server may listen on 0.0.0.0, but
/// this test only ever connects to loopback.
fn stats_and_stderr_of_a_tokenless_server(args: &[&str]) -> (String, String) {
    let mut server = Proc::spawn(args);
    let line = server.line_with("listening on", Duration::from_secs(30));
    let port = line
        .split_whitespace()
        .find_map(|w| w.parse::<SocketAddr>().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .port();
    let via_loopback = SocketAddr::from(([127, 0, 0, 1], port)).to_string();
    let (status, out, err) = run(&["stats", &via_loopback], Duration::from_secs(30));
    assert!(status.success(), "{err}");
    server.signal("-TERM");
    assert!(server.wait(Duration::from_secs(30)).success());
    (out, server.stderr())
}

#[test]
fn a_tokenless_server_beyond_loopback_warns_at_start_and_in_stats() {
    const START_WARNING: &str = "WARNING: listening beyond loopback without a token";
    const STATS_WARNING: &str = "WARNING     serving beyond loopback without a token";
    // Every interface (0.0.0.0) on the native port, and on the Redis port alone.
    for args in [
        &["server", "--listen", "0.0.0.0:0", "--memory", "64M"][..],
        &[
            "server",
            "--listen",
            "127.0.0.1:0",
            "--resp-listen",
            "0.0.0.0:0",
            "--memory",
            "64M",
        ][..],
    ] {
        let (out, err) = stats_and_stderr_of_a_tokenless_server(args);
        assert_eq!(occurrences(&err, START_WARNING), 1, "{args:?}:\n{err}");
        assert!(out.contains(STATS_WARNING), "{args:?}:\n{out}");
        assert!(out.contains("exposed_without_token 1"), "{args:?}:\n{out}");
    }
    // The control: loopback only, no token — nothing to warn about.
    let (out, err) = stats_and_stderr_of_a_tokenless_server(&["server", "--listen", "127.0.0.1:0"]);
    assert!(!err.contains("WARNING"), "{err}");
    assert!(!out.contains("WARNING"), "{out}");
    assert!(out.contains("exposed_without_token 0"), "{out}");
}

#[test]
fn protocol_errors_are_logged_with_the_peer_address_at_most_ten_a_window() {
    const LOGGED: &str = "RESP connection closed after a protocol error";
    let mut server = Proc::spawn(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--resp-listen",
        "127.0.0.1:0",
        "--memory",
        "64M",
    ]);
    let line = server.line_with("speaking the Redis protocol on", Duration::from_secs(30));
    let resp: SocketAddr = line
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    // 15 clients each send a malformed multibulk header, well inside one 10 s window.
    let mut peers = Vec::new();
    for _ in 0..15 {
        let mut s = TcpStream::connect(resp).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        peers.push(s.local_addr().expect("local addr").to_string());
        s.write_all(b"*abc\r\n").expect("send");
        let mut reply = String::new();
        s.read_to_string(&mut reply)
            .expect("the server answers, then closes");
        assert_eq!(reply, "-ERR Protocol error: invalid multibulk length\r\n");
    }
    server.signal("-TERM");
    assert!(server.wait(Duration::from_secs(30)).success());
    let err = server.stderr();
    let logged: Vec<&str> = err.lines().filter(|l| l.contains(LOGGED)).collect();
    assert_eq!(
        logged.len(),
        10,
        "the rate limit lets 10 lines a window:\n{err}"
    );
    for (line, peer) in logged.iter().zip(&peers) {
        assert!(line.contains(peer.as_str()), "{peer} not named in {line:?}");
        assert!(line.contains("invalid multibulk length"), "{line:?}");
    }
}
