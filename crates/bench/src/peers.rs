//! The peer programs from Debian that benchmarks compare against (iperf3, sockperf, Redis).
//!
//! Everything runs on 127.0.0.1. Every process started here is owned by a guard that kills
//! and reaps it when dropped, so an error or a panic never leaves a server behind, and every
//! process has a time limit, so a peer that hangs cannot hang a benchmark.

use std::ffi::OsString;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::BenchError;
use crate::schema::LatencySummary;

/// How long a server may take to accept its first connection.
const SERVER_START_DEADLINE: Duration = Duration::from_secs(10);
/// Picking a free port and binding it are two steps; another process can take the port in
/// between, so a server that exits at start is retried on a fresh port.
const SERVER_START_ATTEMPTS: u32 = 3;
const CONNECT_PROBE_TIMEOUT: Duration = Duration::from_millis(200);
/// Between two looks at a condition that has a deadline (a child exiting, a port opening).
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// Added to a timed client's own duration: start-up, warm-up, reporting, a loaded machine.
const CLIENT_TIME_MARGIN: Duration = Duration::from_secs(30);
/// redis-benchmark runs a request count, not a duration: it gets this much time plus
/// [`REDIS_BENCHMARK_US_PER_REQUEST`] per request asked for (a floor of 10k requests/s,
/// far below what loopback gives).
const REDIS_BENCHMARK_TIME_BASE: Duration = Duration::from_secs(30);
const REDIS_BENCHMARK_US_PER_REQUEST: u64 = 100;
/// redis-benchmark 7.0 can spin forever at start-up (100% CPU in `cliWriteConn`, no
/// system calls, no connection left) — seen once in CI against a healthy redis-server.
/// A run that hangs is killed and tried again this many times in all.
const REDIS_BENCHMARK_ATTEMPTS: u32 = 2;
/// redis-benchmark retries forever when nothing listens, so the address is checked first.
const REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const EXCERPT_BYTES_MAX: usize = 2048;
/// sockperf refuses other message sizes.
const SOCKPERF_MESSAGE_BYTES_MIN: u32 = 14;
const SOCKPERF_MESSAGE_BYTES_MAX: u32 = 1_048_575;

#[derive(Clone, Copy, Debug)]
struct Peer {
    program: &'static str,
    package: &'static str,
}

const IPERF3: Peer = Peer {
    program: "iperf3",
    package: "iperf3",
};
const SOCKPERF: Peer = Peer {
    program: "sockperf",
    package: "sockperf",
};
const REDIS_SERVER: Peer = Peer {
    program: "redis-server",
    package: "redis-server",
};
const MEMCACHED: Peer = Peer {
    program: "memcached",
    package: "memcached",
};
const REDIS_BENCHMARK: Peer = Peer {
    program: "redis-benchmark",
    package: "redis-tools",
};

/// Streaming throughput of a peer.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerStream {
    pub bytes_per_sec: f64,
    /// The client command line, for reports.
    pub command: String,
}

/// Round-trip latency of a peer.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerLatency {
    pub latency_us: LatencySummary,
    pub command: String,
}

/// Request rate of a peer.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerRate {
    pub ops_per_sec: f64,
    pub command: String,
}

/// TCP streaming throughput over loopback as iperf3 measures it (one stream, `duration`
/// rounded up to whole seconds, at least one).
pub fn iperf3_tcp_stream(duration: Duration) -> Result<PeerStream, BenchError> {
    let secs = whole_seconds(duration);
    let scratch = ScratchDir::new("iperf3")?;
    // A one-test server (`-1`) would take a connect probe for its test and exit, and a
    // long-lived one briefly stops listening after every test; so readiness is the socket
    // reaching LISTEN, seen without connecting.
    let (_server, addr) = start_server(IPERF3, &scratch, Readiness::Listening, |port| {
        os_args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
    })?;
    let args = os_args([
        "-c",
        "127.0.0.1",
        "-p",
        &addr.port().to_string(),
        "-t",
        &secs.to_string(),
        "-J",
    ]);
    let command = command_line(IPERF3.program, &args);
    let time_limit = Duration::from_secs(secs).saturating_add(CLIENT_TIME_MARGIN);
    let run = run_to_end(IPERF3, &args, &scratch, "client", time_limit)?;
    // iperf3 -J can exit 0 after a failure: the "error" member of its JSON is the verdict.
    match parse_iperf3_json(&run.stdout) {
        Ok(bytes_per_sec) if run.status.success() => Ok(PeerStream {
            bytes_per_sec,
            command,
        }),
        Ok(_) => Err(run.failure(IPERF3, "exited unsuccessfully")),
        Err(detail) => Err(run.failure(IPERF3, &detail)),
    }
}

/// TCP ping-pong round-trip latency over loopback as sockperf measures it.
pub fn sockperf_tcp_pingpong(
    duration: Duration,
    message_bytes: u32,
) -> Result<PeerLatency, BenchError> {
    if !(SOCKPERF_MESSAGE_BYTES_MIN..=SOCKPERF_MESSAGE_BYTES_MAX).contains(&message_bytes) {
        return Err(BenchError::InvalidConfig(format!(
            "sockperf messages must be {SOCKPERF_MESSAGE_BYTES_MIN}..={SOCKPERF_MESSAGE_BYTES_MAX} \
             bytes, not {message_bytes}"
        )));
    }
    let secs = whole_seconds(duration);
    let scratch = ScratchDir::new("sockperf")?;
    let (_server, addr) = start_server(SOCKPERF, &scratch, Readiness::Accepting, |port| {
        os_args([
            "server",
            "--tcp",
            "-i",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
    })?;
    let args = os_args([
        "ping-pong",
        "--tcp",
        "-i",
        "127.0.0.1",
        "-p",
        &addr.port().to_string(),
        "-m",
        &message_bytes.to_string(),
        "-t",
        &secs.to_string(),
        "--full-rtt",
    ]);
    let command = command_line(SOCKPERF.program, &args);
    let time_limit = Duration::from_secs(secs).saturating_add(CLIENT_TIME_MARGIN);
    let run = run_to_end(SOCKPERF, &args, &scratch, "client", time_limit)?;
    // sockperf exits 0 even when it cannot connect: its report is the only verdict.
    let report = format!("{}\n{}", run.stdout, run.stderr);
    match parse_sockperf_output(&report) {
        Ok(latency_us) if run.status.success() => Ok(PeerLatency {
            latency_us,
            command,
        }),
        Ok(_) => Err(run.failure(SOCKPERF, "exited unsuccessfully")),
        Err(detail) => Err(run.failure(SOCKPERF, &detail)),
    }
}

/// A real `redis-server` on a free loopback port, with persistence off and its working
/// directory in a private temporary directory. Dropping it kills and reaps the server.
#[derive(Debug)]
pub struct RedisServer {
    // Declared before the scratch directory: the server must be gone before its
    // directory is removed.
    _server: ChildGuard,
    addr: SocketAddr,
    _scratch: ScratchDir,
}

impl RedisServer {
    pub fn start() -> Result<RedisServer, BenchError> {
        let scratch = ScratchDir::new("redis")?;
        let dir = scratch.path.clone();
        let (server, addr) = start_server(REDIS_SERVER, &scratch, Readiness::Accepting, |port| {
            let mut args = os_args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
            ]);
            args.push(dir.clone().into_os_string());
            args
        })?;
        Ok(RedisServer {
            _server: server,
            addr,
            _scratch: scratch,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// A real `memcached` on a free loopback port (TCP only), killed and reaped on drop.
#[derive(Debug)]
pub struct MemcachedServer {
    _server: ChildGuard,
    addr: SocketAddr,
    _scratch: ScratchDir,
}

impl MemcachedServer {
    /// `threads` worker threads and a `memory_mib` cache, so a YCSB load is not evicted.
    pub fn start(threads: u32, memory_mib: u64) -> Result<MemcachedServer, BenchError> {
        let scratch = ScratchDir::new("memcached")?;
        let (server, addr) = start_server(MEMCACHED, &scratch, Readiness::Accepting, |port| {
            os_args([
                "-l",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-U",
                "0",
                "-t",
                &threads.to_string(),
                "-m",
                &memory_mib.to_string(),
                // Items up to 32 MiB, like Camelot's values (memcached's default is 1 MiB).
                "-I",
                "32m",
                // Refuses to run as root otherwise; ignored when we are not root.
                "-u",
                "nobody",
            ])
        })?;
        Ok(MemcachedServer {
            _server: server,
            addr,
            _scratch: scratch,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Runs `redis-benchmark -h IP -p PORT --csv <args>` against a loopback server and returns
/// the requests per second of the first test it reports.
pub fn redis_benchmark(addr: SocketAddr, args: &[&str]) -> Result<PeerRate, BenchError> {
    if !addr.ip().is_loopback() {
        return Err(BenchError::InvalidConfig(format!(
            "peer benchmarks run on loopback only, not against {addr}"
        )));
    }
    if let Err(e) = TcpStream::connect_timeout(&addr, REDIS_CONNECT_TIMEOUT) {
        return Err(BenchError::PeerFailed {
            program: REDIS_BENCHMARK.program,
            detail: format!("nothing accepts connections on {addr}: {e}"),
        });
    }
    let mut full_args = os_args([
        "-h",
        &addr.ip().to_string(),
        "-p",
        &addr.port().to_string(),
        "--csv",
    ]);
    full_args.extend(args.iter().map(OsString::from));
    let command = command_line(REDIS_BENCHMARK.program, &full_args);
    let requests = args
        .windows(2)
        .find(|w| w[0] == "-n")
        .and_then(|w| w[1].parse::<u64>().ok())
        .unwrap_or(100_000);
    let time_limit = REDIS_BENCHMARK_TIME_BASE
        + Duration::from_micros(requests.saturating_mul(REDIS_BENCHMARK_US_PER_REQUEST));
    let mut attempt = 1;
    let run = loop {
        let scratch = ScratchDir::new("redis-benchmark")?;
        match run_to_end(REDIS_BENCHMARK, &full_args, &scratch, "client", time_limit) {
            Err(BenchError::PeerTimedOut { detail, .. }) if attempt < REDIS_BENCHMARK_ATTEMPTS => {
                tracing::warn!(%detail, "redis-benchmark hung; trying once more");
                attempt += 1;
            }
            other => break other?,
        }
    };
    if !run.status.success() {
        return Err(run.failure(REDIS_BENCHMARK, "exited unsuccessfully"));
    }
    match parse_redis_benchmark_csv(&run.stdout) {
        Ok(ops_per_sec) => Ok(PeerRate {
            ops_per_sec,
            command,
        }),
        Err(detail) => Err(run.failure(REDIS_BENCHMARK, &detail)),
    }
}

/// Bytes per second from `iperf3 -J` output: `end.sum_received.bits_per_second / 8`.
pub fn parse_iperf3_json(json: &str) -> Result<f64, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("the output is not iperf3 JSON: {e}"))?;
    if let Some(error) = value.get("error").and_then(|e| e.as_str()) {
        return Err(format!("iperf3 reported: {error}"));
    }
    let bits_per_sec = value
        .pointer("/end/sum_received/bits_per_second")
        .and_then(|v| v.as_f64())
        .ok_or_else(|| "the JSON has no end.sum_received.bits_per_second".to_string())?;
    if bits_per_sec.is_finite() && bits_per_sec > 0.0 {
        Ok(bits_per_sec / 8.0)
    } else {
        Err(format!("iperf3 received at {bits_per_sec} bit/s"))
    }
}

/// Latency percentiles from a sockperf ping-pong report, in microseconds:
///
/// ```text
/// sockperf: Summary: Round trip is 14.476 usec
/// sockperf: ---> <MAX> observation = 4045.542
/// sockperf: ---> percentile 99.900 =   46.078
/// ```
///
/// The report's values carry the unit of its summary line, which must be `usec`.
pub fn parse_sockperf_output(text: &str) -> Result<LatencySummary, String> {
    let mut unit_seen = false;
    let (mut p50, mut p90, mut p99, mut p999, mut max) = (None, None, None, None, None);
    for raw in text.lines() {
        let line = strip_ansi(raw);
        if let Some((_, summary)) = line.split_once("Summary:") {
            let unit = summary.split_whitespace().last().unwrap_or("");
            if unit != "usec" {
                return Err(format!("sockperf reported in {unit:?}, not usec"));
            }
            unit_seen = true;
            continue;
        }
        let Some((_, item)) = line.split_once("---> ") else {
            continue;
        };
        let Some((key, value)) = item.split_once('=') else {
            continue;
        };
        let key = key.trim();
        let value: f64 = match value.trim().parse() {
            Ok(v) => v,
            Err(_) => continue,
        };
        if key == "<MAX> observation" {
            max = Some(value);
        } else if let Some(percentile) = key.strip_prefix("percentile ") {
            let slot = match percentile.trim() {
                "50.000" => &mut p50,
                "90.000" => &mut p90,
                "99.000" => &mut p99,
                "99.900" => &mut p999,
                _ => continue,
            };
            *slot = Some(value);
        }
    }
    if !unit_seen {
        return Err("the sockperf report has no `Summary: ... usec` line".to_string());
    }
    let need = |v: Option<f64>, what: &str| match v {
        Some(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Some(v) => Err(format!("sockperf reported {what} = {v}")),
        None => Err(format!("the sockperf report has no {what} line")),
    };
    Ok(LatencySummary {
        p50: need(p50, "percentile 50.000")?,
        p90: need(p90, "percentile 90.000")?,
        p99: need(p99, "percentile 99.000")?,
        p999: need(p999, "percentile 99.900")?,
        max: need(max, "<MAX> observation")?,
    })
}

/// Requests per second of the first test in `redis-benchmark --csv` output:
///
/// ```text
/// "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",...
/// "SET","39138.95","0.871","0.128","0.583",...
/// ```
///
/// Redis 6 and older print no header and put rps in the second column.
pub fn parse_redis_benchmark_csv(text: &str) -> Result<f64, String> {
    // Warnings can share stdout with the CSV; every CSV row starts with a quoted field.
    let mut rows = text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('"'))
        .map(csv_fields);
    let first = rows
        .next()
        .ok_or_else(|| "redis-benchmark printed no CSV rows".to_string())?;
    let (rps_column, row) = if first.first().map(String::as_str) == Some("test") {
        let column = first
            .iter()
            .position(|f| f == "rps")
            .ok_or_else(|| format!("the CSV header has no rps column: {first:?}"))?;
        let row = rows
            .next()
            .ok_or_else(|| "redis-benchmark printed a header but no test".to_string())?;
        (column, row)
    } else {
        (1, first)
    };
    let rps_text = row
        .get(rps_column)
        .ok_or_else(|| format!("the CSV row has no rps column: {row:?}"))?;
    let rps: f64 = rps_text
        .trim()
        .parse()
        .map_err(|_| format!("rps {rps_text:?} is not a number"))?;
    if rps.is_finite() && rps > 0.0 {
        Ok(rps)
    } else {
        Err(format!("redis-benchmark reported {rps} requests/s"))
    }
}

/// One CSV line into fields: quoted fields may hold commas and doubled quotes.
fn csv_fields(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut field)),
            (c, _) => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// Removes terminal colour sequences (`ESC [ ... letter`), which sockperf prints even
/// into a file.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn whole_seconds(duration: Duration) -> u64 {
    let secs = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    secs.max(1)
}

fn os_args<const N: usize>(args: [&str; N]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// The command as a person would type it, for reports.
fn command_line(program: &str, args: &[OsString]) -> String {
    let mut line = program.to_string();
    for arg in args {
        let arg = arg.to_string_lossy();
        line.push(' ');
        if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || c == '"') {
            line.push_str(&format!("{arg:?}"));
        } else {
            line.push_str(&arg);
        }
    }
    line
}

/// A private directory for one peer run: server working directories and the captured
/// output of every process. Removed on drop.
#[derive(Debug)]
struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    fn new(tag: &str) -> Result<ScratchDir, BenchError> {
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "camelot-peer-{tag}-{}-{}-{nanos}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        ));
        // create_dir, not create_dir_all: an existing directory would not be ours.
        std::fs::create_dir(&path).map_err(|source| BenchError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(ScratchDir { path })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Best effort: a leftover directory in /tmp is not worth failing a run over.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Owns a child process: dropping it kills and reaps the child.
#[derive(Debug)]
struct ChildGuard {
    child: Child,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
}

impl ChildGuard {
    fn output_excerpt(&self) -> String {
        output_excerpt(
            &read_lossy(&self.stdout_path),
            &read_lossy(&self.stderr_path),
        )
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // kill fails only when the child has already exited; wait then just reaps it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `peer` with its output going to files in `scratch` (a pipe nobody drains could
/// fill up and stall a long-running server).
fn spawn(
    peer: Peer,
    args: &[OsString],
    scratch: &ScratchDir,
    name: &str,
) -> Result<ChildGuard, BenchError> {
    let stdout_path = scratch.path.join(format!("{name}.stdout"));
    let stderr_path = scratch.path.join(format!("{name}.stderr"));
    let create = |path: &Path| {
        File::create(path).map_err(|source| BenchError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    let stdout = create(&stdout_path)?;
    let stderr = create(&stderr_path)?;
    let child = Command::new(peer.program)
        .args(args)
        .current_dir(&scratch.path)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => BenchError::PeerMissing {
                program: peer.program,
                package: peer.package,
            },
            _ => BenchError::PeerFailed {
                program: peer.program,
                detail: format!("cannot start it: {e}"),
            },
        })?;
    Ok(ChildGuard {
        child,
        stdout_path,
        stderr_path,
    })
}

/// What a finished client left behind.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    command: String,
}

impl Finished {
    fn failure(&self, peer: Peer, what: &str) -> BenchError {
        BenchError::PeerFailed {
            program: peer.program,
            detail: format!(
                "{what} ({}, `{}`): {}",
                self.status,
                self.command,
                output_excerpt(&self.stdout, &self.stderr)
            ),
        }
    }
}

/// Runs a client to completion, killing it once it has run for `time_limit`.
fn run_to_end(
    peer: Peer,
    args: &[OsString],
    scratch: &ScratchDir,
    name: &str,
    time_limit: Duration,
) -> Result<Finished, BenchError> {
    let mut guard = spawn(peer, args, scratch, name)?;
    let deadline = Instant::now() + time_limit;
    let status = loop {
        match guard.child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                return Err(BenchError::PeerTimedOut {
                    program: peer.program,
                    detail: format!(
                        "still running after {time_limit:?}, killed: {}",
                        guard.output_excerpt()
                    ),
                });
            }
            Ok(None) => std::thread::sleep(POLL_INTERVAL),
            Err(e) => {
                return Err(BenchError::PeerFailed {
                    program: peer.program,
                    detail: format!("cannot wait for it: {e}"),
                })
            }
        }
    };
    Ok(Finished {
        status,
        stdout: read_lossy(&guard.stdout_path),
        stderr: read_lossy(&guard.stderr_path),
        command: command_line(peer.program, args),
    })
}

/// How to tell that a server is ready for its client.
#[derive(Clone, Copy, Debug)]
enum Readiness {
    /// A TCP connection succeeds (and is closed at once).
    Accepting,
    /// Its socket is in LISTEN state in /proc/net/tcp: for servers that must not see a
    /// connection other than the measured one.
    Listening,
}

enum StartFailure {
    Exited(ExitStatus),
    Silent,
    Wait(std::io::Error),
}

/// Starts a server on a free loopback port and waits until it accepts connections.
fn start_server(
    peer: Peer,
    scratch: &ScratchDir,
    readiness: Readiness,
    args_for_port: impl Fn(u16) -> Vec<OsString>,
) -> Result<(ChildGuard, SocketAddr), BenchError> {
    let mut last_failure = String::new();
    for attempt in 1..=SERVER_START_ATTEMPTS {
        let addr = free_loopback_addr()?;
        let args = args_for_port(addr.port());
        let mut server = spawn(peer, &args, scratch, &format!("server-{attempt}"))?;
        match wait_ready(&mut server.child, addr, readiness, SERVER_START_DEADLINE) {
            Ok(()) => return Ok((server, addr)),
            Err(StartFailure::Exited(status)) => {
                last_failure = format!(
                    "`{}` exited ({status}) before accepting connections: {}",
                    command_line(peer.program, &args),
                    server.output_excerpt()
                );
            }
            Err(StartFailure::Silent) => {
                return Err(BenchError::PeerFailed {
                    program: peer.program,
                    detail: format!(
                        "`{}` was not ready on {addr} within {:?}: {}",
                        command_line(peer.program, &args),
                        SERVER_START_DEADLINE,
                        server.output_excerpt()
                    ),
                })
            }
            Err(StartFailure::Wait(e)) => {
                return Err(BenchError::PeerFailed {
                    program: peer.program,
                    detail: format!("cannot wait for the server: {e}"),
                })
            }
        }
    }
    Err(BenchError::PeerFailed {
        program: peer.program,
        detail: format!("the server failed {SERVER_START_ATTEMPTS} times; last: {last_failure}"),
    })
}

fn wait_ready(
    child: &mut Child,
    addr: SocketAddr,
    readiness: Readiness,
    deadline_after: Duration,
) -> Result<(), StartFailure> {
    let deadline = Instant::now() + deadline_after;
    loop {
        if let Some(status) = child.try_wait().map_err(StartFailure::Wait)? {
            return Err(StartFailure::Exited(status));
        }
        let ready = match readiness {
            Readiness::Accepting => {
                TcpStream::connect_timeout(&addr, CONNECT_PROBE_TIMEOUT).is_ok()
            }
            Readiness::Listening => std::fs::read_to_string("/proc/net/tcp")
                .map(|table| is_listening(&table, addr))
                .unwrap_or(false),
        };
        if ready {
            // Whoever answered, it must be our server: had it lost the port to another
            // process it would have exited by now or will shortly, so look once more.
            return match child.try_wait().map_err(StartFailure::Wait)? {
                Some(status) => Err(StartFailure::Exited(status)),
                None => Ok(()),
            };
        }
        if Instant::now() >= deadline {
            return Err(StartFailure::Silent);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Whether /proc/net/tcp shows an IPv4 socket listening on `addr`. Its rows read
/// `sl local_address rem_address st ...` with `local_address` as `%08X:%04X` of the address
/// in memory order and the port, and `st` 0A for LISTEN.
fn is_listening(proc_net_tcp: &str, addr: SocketAddr) -> bool {
    const TCP_LISTEN: &str = "0A";
    let SocketAddr::V4(addr) = addr else {
        return false;
    };
    let octets = addr.ip().octets();
    // The kernel prints the address's in-memory bytes as a host-order integer.
    let ip_hex = [
        format!("{:08X}", u32::from_le_bytes(octets)),
        format!("{:08X}", u32::from_be_bytes(octets)),
    ];
    let port_hex = format!("{:04X}", addr.port());
    proc_net_tcp.lines().skip(1).any(|row| {
        let mut columns = row.split_whitespace().skip(1);
        let (Some(local), Some(_remote), Some(state)) =
            (columns.next(), columns.next(), columns.next())
        else {
            return false;
        };
        let Some((ip, port)) = local.split_once(':') else {
            return false;
        };
        state == TCP_LISTEN && port == port_hex && ip_hex.iter().any(|h| h == ip)
    })
}

/// A loopback port that was free a moment ago: the kernel picks it for an ephemeral bind.
fn free_loopback_addr() -> Result<SocketAddr, BenchError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| BenchError::Setup(format!("cannot bind a loopback port: {e}")))?;
    listener
        .local_addr()
        .map_err(|e| BenchError::Setup(format!("cannot read a loopback port: {e}")))
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Stderr and stdout of a failed program, bounded to about EXCERPT_BYTES_MAX in all.
fn output_excerpt(stdout: &str, stderr: &str) -> String {
    let half = EXCERPT_BYTES_MAX / 2;
    let parts: Vec<String> = [("stderr", stderr), ("stdout", stdout)]
        .into_iter()
        .map(|(name, text)| (name, strip_ansi_all(text)))
        .filter(|(_, text)| !text.trim().is_empty())
        .map(|(name, text)| format!("{name}: {}", tail(text.trim(), half)))
        .collect();
    if parts.is_empty() {
        "no output".to_string()
    } else {
        parts.join(" | ")
    }
}

fn strip_ansi_all(text: &str) -> String {
    text.lines().map(strip_ansi).collect::<Vec<_>>().join("\n")
}

/// The last `bytes_max` bytes of `text` (the end of a log says why a program gave up).
fn tail(text: &str, bytes_max: usize) -> String {
    if text.len() <= bytes_max {
        return text.to_string();
    }
    let mut start = text.len() - bytes_max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Real output of `sockperf ping-pong --tcp -i 127.0.0.1 -p P -m 64 -t 1 --full-rtt`
    /// (sockperf 3.7, Debian), colour sequences included.
    const SOCKPERF_SAMPLE: &str = "\
sockperf: \u{1b}[2;35m== version #3.7-no.git == \u{1b}[0m
sockperf[CLIENT] send on:sockperf: using recvfrom() to block on socket(s)

[ 0] IP = 127.0.0.1       PORT = 23456 # TCP
sockperf: Warmup stage (sending a few dummy messages)...
sockperf: Starting test...
sockperf: Test end (interrupted by timer)
sockperf: Test ended
sockperf: [Total Run] RunTime=1.000 sec; Warm up time=400 msec; SentMessages=59731; ReceivedMessages=59730
sockperf: ========= Printing statistics for Server No: 0
sockperf: [Valid Duration] RunTime=0.550 sec; SentMessages=37942; ReceivedMessages=37942
sockperf: \u{1b}[2;35m====> avg-rtt=14.476 (std-dev=37.083)\u{1b}[0m
sockperf: # dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0
sockperf: Summary: Round trip is 14.476 usec
sockperf: \u{1b}[2;35mTotal 37942 observations\u{1b}[0m; each percentile contains 379.42 observations
sockperf: ---> <MAX> observation = 4045.542
sockperf: ---> percentile 99.999 = 4045.542
sockperf: ---> percentile 99.990 =  268.197
sockperf: ---> percentile 99.900 =   46.078
sockperf: ---> percentile 99.000 =   18.347
sockperf: ---> percentile 90.000 =   15.402
sockperf: ---> percentile 75.000 =   14.181
sockperf: ---> percentile 50.000 =   13.449
sockperf: ---> percentile 25.000 =   13.379
sockperf: ---> <MIN> observation =   13.239
";

    /// Real output of `redis-benchmark -h 127.0.0.1 -p P --csv -n 20000 -t set,get`
    /// (redis-benchmark 7.0.15).
    const REDIS_CSV_SAMPLE: &str = r#""test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
"SET","39138.95","0.871","0.128","0.583","2.871","5.543","9.375"
"GET","40000.00","0.877","0.096","0.311","4.487","7.215","12.287"
"#;

    /// Abridged real output of `iperf3 -c 127.0.0.1 -p P -t 1 -J` (iperf 3.12).
    const IPERF3_SAMPLE: &str = r#"{
	"start":	{"version":	"iperf 3.12", "test_start": {"protocol": "TCP", "num_streams": 1, "duration": 1}},
	"intervals":	[],
	"end":	{
		"sum_sent":	{"start": 0, "end": 1.000818, "seconds": 1.000818, "bytes": 2094792704, "bits_per_second": 16744644512.78854, "retransmits": 0, "sender": true},
		"sum_received":	{"start": 0, "end": 1.000818, "seconds": 1.000818, "bytes": 2094792704, "bits_per_second": 16744644512.78854, "sender": true}
	}
}"#;

    /// Real output of the iperf3 client when the server is gone.
    const IPERF3_ERROR_SAMPLE: &str = r#"{
	"start":	{"connected": [], "version": "iperf 3.12"},
	"intervals":	[],
	"end":	{},
	"error":	"unable to connect to server: Connection refused"
}"#;

    #[test]
    fn sockperf_sample_parses() -> Result<(), String> {
        let s = parse_sockperf_output(SOCKPERF_SAMPLE)?;
        assert_eq!(
            s,
            LatencySummary {
                p50: 13.449,
                p90: 15.402,
                p99: 18.347,
                p999: 46.078,
                max: 4045.542
            }
        );
        Ok(())
    }

    #[test]
    fn sockperf_failures_are_errors() {
        let refused = "sockperf: \u{1b}[2;35m== version #3.7-no.git == \u{1b}[0m\n\
                       sockperf: ERROR: Can`t connect socket (errno=111 Connection refused)\n";
        assert!(parse_sockperf_output(refused).is_err());
        let msec = SOCKPERF_SAMPLE.replace("14.476 usec", "14.476 msec");
        assert!(parse_sockperf_output(&msec).is_err());
        let truncated: String = SOCKPERF_SAMPLE
            .lines()
            .filter(|l| !l.contains("99.900"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(parse_sockperf_output(&truncated).is_err());
    }

    #[test]
    fn redis_csv_sample_parses() {
        assert_eq!(parse_redis_benchmark_csv(REDIS_CSV_SAMPLE), Ok(39138.95));
        let with_warning = format!("WARNING: Could not fetch server CONFIG\n{REDIS_CSV_SAMPLE}");
        assert_eq!(parse_redis_benchmark_csv(&with_warning), Ok(39138.95));
        // Redis 6: no header.
        assert_eq!(
            parse_redis_benchmark_csv("\"PING_INLINE\",\"86206.90\"\n\"SET\",\"1.0\"\n"),
            Ok(86206.90)
        );
    }

    #[test]
    fn redis_csv_failures_are_errors() {
        assert!(parse_redis_benchmark_csv("").is_err());
        let header_only = REDIS_CSV_SAMPLE.lines().next().unwrap_or_default();
        assert!(parse_redis_benchmark_csv(header_only).is_err());
        assert!(parse_redis_benchmark_csv("\"test\",\"x\"\n\"SET\",\"1\"\n").is_err());
        assert!(parse_redis_benchmark_csv("\"SET\",\"fast\"\n").is_err());
        assert!(parse_redis_benchmark_csv("\"SET\",\"0.00\"\n").is_err());
        assert!(parse_redis_benchmark_csv("\"SET\"\n").is_err());
    }

    #[test]
    fn csv_fields_handle_quotes() {
        assert_eq!(
            csv_fields(r#""a,b","c""d",e,"#),
            vec!["a,b".to_string(), "c\"d".into(), "e".into(), String::new()]
        );
    }

    #[test]
    fn iperf3_sample_parses() {
        assert_eq!(
            parse_iperf3_json(IPERF3_SAMPLE),
            Ok(16744644512.78854 / 8.0)
        );
        let err = parse_iperf3_json(IPERF3_ERROR_SAMPLE);
        assert!(
            matches!(&err, Err(e) if e.contains("Connection refused")),
            "{err:?}"
        );
        assert!(parse_iperf3_json("{}").is_err());
        assert!(parse_iperf3_json("not json").is_err());
        assert!(parse_iperf3_json(r#"{"end":{"sum_received":{"bits_per_second":0}}}"#).is_err());
    }

    #[test]
    fn listening_sockets_are_found_in_proc_net_tcp() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:5BA5 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 18947 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 1058 1 0 100 0 0 10 0
";
        let addr = |port| SocketAddr::from(([127, 0, 0, 1], port));
        assert!(is_listening(table, addr(0x5BA5)));
        // Established, not listening.
        assert!(!is_listening(table, addr(0x1F90)));
        assert!(!is_listening(table, addr(0x5BA6)));
        assert!(!is_listening(
            table,
            SocketAddr::from(([10, 0, 0, 1], 0x5BA5))
        ));
        assert!(!is_listening("", addr(1)));
    }

    #[test]
    fn a_real_listener_is_seen() -> Result<(), std::io::Error> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let table = std::fs::read_to_string("/proc/net/tcp")?;
        assert!(is_listening(&table, addr));
        drop(listener);
        Ok(())
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(whole_seconds(Duration::ZERO), 1);
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_millis(2001)), 3);
    }

    #[test]
    fn command_lines_quote_empty_arguments() {
        let args = os_args(["--save", "", "--dir", "/tmp/a b"]);
        assert_eq!(
            command_line("redis-server", &args),
            r#"redis-server --save "" --dir "/tmp/a b""#
        );
    }

    #[test]
    fn excerpts_are_bounded() {
        let long = "x".repeat(10_000) + "é the end";
        let excerpt = output_excerpt(&long, &long);
        assert!(excerpt.len() <= EXCERPT_BYTES_MAX + 64, "{}", excerpt.len());
        assert!(excerpt.ends_with("the end"));
        assert_eq!(output_excerpt("", " \n"), "no output");
        assert_eq!(tail("ééé", 3), "…é");
    }

    #[test]
    fn missing_program_is_peer_missing() -> Result<(), BenchError> {
        let scratch = ScratchDir::new("missing")?;
        let peer = Peer {
            program: "camelot-no-such-program",
            package: "camelot-no-such-package",
        };
        let result = run_to_end(peer, &[], &scratch, "c", Duration::from_secs(5));
        let err = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("apt install camelot-no-such-package"), "{err}");
        assert!(err.contains("scripts/setup.sh"), "{err}");
        Ok(())
    }

    #[test]
    fn clients_past_their_time_limit_are_killed() -> Result<(), BenchError> {
        let scratch = ScratchDir::new("slow")?;
        // Stands in for a peer that hangs: `tail -f` never exits on its own.
        let hanging = Peer {
            program: "tail",
            package: "coreutils",
        };
        let started = Instant::now();
        let result = run_to_end(
            hanging,
            &os_args(["-f", "/dev/null"]),
            &scratch,
            "t",
            Duration::from_millis(200),
        );
        assert!(
            matches!(&result, Err(BenchError::PeerTimedOut { detail, .. }) if detail.contains("killed")),
            "{:?}",
            result.err()
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        Ok(())
    }

    #[test]
    fn redis_benchmark_refuses_a_dead_or_remote_address() {
        let dead = free_loopback_addr();
        if let Ok(addr) = dead {
            assert!(matches!(
                redis_benchmark(addr, &["-n", "1"]),
                Err(BenchError::PeerFailed { .. })
            ));
        }
        let remote = SocketAddr::from(([192, 0, 2, 1], 6379));
        assert!(matches!(
            redis_benchmark(remote, &["-n", "1"]),
            Err(BenchError::InvalidConfig(_))
        ));
    }

    #[test]
    fn sockperf_message_size_is_checked() {
        assert!(matches!(
            sockperf_tcp_pingpong(Duration::from_secs(1), 1),
            Err(BenchError::InvalidConfig(_))
        ));
    }

    fn sockperf_like() -> impl Strategy<Value = String> {
        let line = prop_oneof![
            ".{0,40}",
            "(sockperf: )?---> (percentile [0-9.]{1,7}|<MAX> observation) = ?[-0-9.eE+a-z]{0,12}",
            "sockperf: Summary: [a-zA-Z ]{0,20}[-0-9.]{0,6} (usec|msec|)",
            "\u{1b}\\[[0-9;]{0,5}[a-z]?.{0,10}",
        ];
        proptest::collection::vec(line, 0..16).prop_map(|lines| lines.join("\n"))
    }

    fn csv_like() -> impl Strategy<Value = String> {
        let line = prop_oneof![
            ".{0,40}",
            "(\"[a-z0-9,.\"]{0,8}\",?){0,4}",
            Just("\"test\",\"rps\"".to_string()),
            "\"[A-Z]{1,4}\",\"[-0-9.eE+]{0,10}\"",
        ];
        proptest::collection::vec(line, 0..8).prop_map(|lines| lines.join("\n"))
    }

    proptest! {
        #[test]
        fn parsers_never_panic(text in ".{0,200}") {
            let _ = parse_iperf3_json(&text);
            let _ = parse_sockperf_output(&text);
            let _ = parse_redis_benchmark_csv(&text);
        }

        #[test]
        fn sockperf_parser_never_panics_on_near_misses(text in sockperf_like()) {
            if let Ok(s) = parse_sockperf_output(&text) {
                prop_assert!([s.p50, s.p90, s.p99, s.p999, s.max].iter().all(|v| v.is_finite() && *v >= 0.0));
            }
        }

        #[test]
        fn redis_parser_never_panics_on_near_misses(text in csv_like()) {
            if let Ok(rps) = parse_redis_benchmark_csv(&text) {
                prop_assert!(rps.is_finite() && rps > 0.0);
            }
        }

        #[test]
        fn iperf3_parser_never_panics_on_near_misses(
            bits in prop_oneof![any::<f64>().prop_map(|v| v.to_string()), ".{0,10}"],
            error in proptest::option::of(".{0,10}"),
        ) {
            let error = error.map(|e| format!(",\"error\":{}", serde_json::Value::from(e))).unwrap_or_default();
            let text = format!("{{\"end\":{{\"sum_received\":{{\"bits_per_second\":{bits}}}}}{error}}}");
            if let Ok(v) = parse_iperf3_json(&text) {
                prop_assert!(v.is_finite() && v > 0.0);
            }
        }
    }
}
