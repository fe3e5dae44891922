//! The peer programs from Debian that benchmarks compare against, driven as clients:
//! iperf3, sockperf and redis-benchmark, with parsers of their output that are pure
//! functions. Starting and stopping the servers is `camelot_testkit`'s.
//!
//! Everything runs on 127.0.0.1, and every client has a time limit, so a peer that hangs
//! cannot hang a benchmark.

use std::ffi::OsString;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use camelot_testkit::process::{
    command_line, os_args, run_to_end, strip_ansi, whole_seconds, Program, Readiness, ScratchDir,
};
use camelot_testkit::servers::IPERF3;
use camelot_testkit::{Iperf3Server, ServerProcess, TestkitError};

use crate::error::BenchError;
use camelot_results::schema::LatencySummary;

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
/// sockperf refuses other message sizes.
const SOCKPERF_MESSAGE_BYTES_MIN: u32 = 14;
const SOCKPERF_MESSAGE_BYTES_MAX: u32 = 1_048_575;

const SOCKPERF: Program = Program::debian("sockperf", "sockperf");
const REDIS_BENCHMARK: Program = Program::debian("redis-benchmark", "redis-tools");

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

/// Which way an iperf3 stream's bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamDirection {
    /// The client sends (iperf3's default): compares with WRITE payloads.
    ClientToServer,
    /// The server sends (`iperf3 -R`): compares with what READs bring back.
    ServerToClient,
}

/// TCP streaming throughput over loopback as iperf3 measures it (one stream, client to
/// server, `duration` rounded up to whole seconds, at least one).
pub fn iperf3_tcp_stream(duration: Duration) -> Result<PeerStream, BenchError> {
    iperf3_tcp_stream_in(duration, StreamDirection::ClientToServer)
}

/// [`iperf3_tcp_stream`] for `seconds`, or nothing when a bench was told 0 (no peer).
pub fn iperf3_tcp_stream_for(seconds: u64) -> Result<Option<PeerStream>, BenchError> {
    if seconds == 0 {
        return Ok(None);
    }
    iperf3_tcp_stream(Duration::from_secs(seconds)).map(Some)
}

/// [`iperf3_tcp_stream`] in the given direction. Either way the figure is what the
/// receiving end counted (`end.sum_received`).
pub fn iperf3_tcp_stream_in(
    duration: Duration,
    direction: StreamDirection,
) -> Result<PeerStream, BenchError> {
    let secs = whole_seconds(duration);
    let scratch = ScratchDir::new("iperf3")?;
    let server = Iperf3Server::start()?;
    let addr = server.addr();
    let mut args = os_args([
        "-c",
        "127.0.0.1",
        "-p",
        &addr.port().to_string(),
        "-t",
        &secs.to_string(),
        "-J",
    ]);
    if direction == StreamDirection::ServerToClient {
        args.push("-R".into());
    }
    let command = command_line(&IPERF3.program, &args);
    let time_limit = Duration::from_secs(secs).saturating_add(CLIENT_TIME_MARGIN);
    let run = run_to_end(&IPERF3, &args, &scratch, "client", time_limit)?;
    // iperf3 -J can exit 0 after a failure: the "error" member of its JSON is the verdict.
    match parse_iperf3_json(&run.stdout) {
        Ok(bytes_per_sec) if run.status.success() => Ok(PeerStream {
            bytes_per_sec,
            command,
        }),
        Ok(_) => Err(run.failure(&IPERF3, "exited unsuccessfully").into()),
        Err(detail) => Err(run.failure(&IPERF3, &detail).into()),
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
    let server = ServerProcess::start(SOCKPERF, "sockperf", Readiness::Accepting, |port| {
        os_args([
            "server",
            "--tcp",
            "-i",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
    })?;
    let addr = server.addr();
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
    let command = command_line(&SOCKPERF.program, &args);
    let time_limit = Duration::from_secs(secs).saturating_add(CLIENT_TIME_MARGIN);
    let run = run_to_end(&SOCKPERF, &args, &scratch, "client", time_limit)?;
    // sockperf exits 0 even when it cannot connect: its report is the only verdict.
    let report = format!("{}\n{}", run.stdout, run.stderr);
    match parse_sockperf_output(&report) {
        Ok(latency_us) if run.status.success() => Ok(PeerLatency {
            latency_us,
            command,
        }),
        Ok(_) => Err(run.failure(&SOCKPERF, "exited unsuccessfully").into()),
        Err(detail) => Err(run.failure(&SOCKPERF, &detail).into()),
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
        return Err(TestkitError::Failed {
            program: REDIS_BENCHMARK.program.to_string(),
            detail: format!("nothing accepts connections on {addr}: {e}"),
        }
        .into());
    }
    let mut full_args = os_args([
        "-h",
        &addr.ip().to_string(),
        "-p",
        &addr.port().to_string(),
        "--csv",
    ]);
    full_args.extend(args.iter().map(OsString::from));
    let command = command_line(&REDIS_BENCHMARK.program, &full_args);
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
        match run_to_end(&REDIS_BENCHMARK, &full_args, &scratch, "client", time_limit) {
            Err(TestkitError::TimedOut { detail, .. }) if attempt < REDIS_BENCHMARK_ATTEMPTS => {
                tracing::warn!(%detail, "redis-benchmark hung; trying once more");
                attempt += 1;
            }
            other => break other?,
        }
    };
    if !run.status.success() {
        return Err(run
            .failure(&REDIS_BENCHMARK, "exited unsuccessfully")
            .into());
    }
    match parse_redis_benchmark_csv(&run.stdout) {
        Ok(ops_per_sec) => Ok(PeerRate {
            ops_per_sec,
            command,
        }),
        Err(detail) => Err(run.failure(&REDIS_BENCHMARK, &detail).into()),
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
    fn redis_benchmark_refuses_a_dead_or_remote_address() {
        let dead = camelot_testkit::process::free_loopback_addr();
        if let Ok(addr) = dead {
            assert!(matches!(
                redis_benchmark(addr, &["-n", "1"]),
                Err(BenchError::Peer(TestkitError::Failed { .. }))
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
