//! `camelot bench hw net`: seed 003's network experiments. TCP and UDP throughput against
//! buffer size with one and N streams, and TCP/UDP ping-pong latency, against a
//! `bench hw net-server` on another host (`--peer`) or, by default, one started in this
//! process on 127.0.0.1. These are the limits the request API is judged against.

use super::netserver::NetServer;
use super::run_together;
use crate::latency::LatencyRecorder;
use crate::netctl::{self, Message, Report, Test};
use crate::progress::Progress;
use crate::BenchError;
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Series};
use serde_json::json;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

// The protocol's limits bound the experiment too; they live with the protocol so that
// the server and the decoder need nothing from this module.
use crate::netctl::IO_TIMEOUT;
pub use crate::netctl::{BUFFER_BYTES_MAX, STREAMS_MAX, UDP_PAYLOAD_BYTES_MAX};
/// A UDP ping unanswered this long counts as lost.
const UDP_PING_TIMEOUT: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct NetConfig {
    pub buffer_sizes_bytes: Vec<usize>,
    pub streams: Vec<usize>,
    pub seconds_per_point: f64,
    /// Round trips per ping-pong stream.
    pub pingpong_round_trips: u64,
    pub message_bytes: usize,
    /// A `bench hw net-server` to measure against; `None` starts one here on 127.0.0.1.
    pub peer: Option<SocketAddr>,
    pub quick: bool,
}

impl Default for NetConfig {
    fn default() -> Self {
        let cores = thread::available_parallelism().map_or(2, |n| n.get());
        NetConfig {
            buffer_sizes_bytes: vec![64, 1024, 16 << 10, 64 << 10, 1 << 20],
            streams: vec![1, cores],
            seconds_per_point: 2.0,
            pingpong_round_trips: 50_000,
            message_bytes: 64,
            peer: None,
            quick: false,
        }
    }
}

impl NetConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.seconds_per_point = self.seconds_per_point.min(0.3);
        self.pingpong_round_trips = self.pingpong_round_trips.min(2_000);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        if self.buffer_sizes_bytes.is_empty()
            || self
                .buffer_sizes_bytes
                .iter()
                .any(|b| *b == 0 || *b > BUFFER_BYTES_MAX)
        {
            return bad(format!("buffer sizes must be 1..={BUFFER_BYTES_MAX} bytes"));
        }
        if self.streams.is_empty() || self.streams.iter().any(|s| *s == 0 || *s > STREAMS_MAX) {
            return bad(format!("streams must be 1..={STREAMS_MAX}"));
        }
        // The server gives a UDP session this long; past it the run would be cut off.
        super::validate_seconds(self.seconds_per_point)?;
        if self.message_bytes == 0 || self.message_bytes > UDP_PAYLOAD_BYTES_MAX {
            return bad(format!(
                "ping-pong messages must be 1..={UDP_PAYLOAD_BYTES_MAX} bytes"
            ));
        }
        if self.pingpong_round_trips == 0 {
            return bad("ping-pong needs at least one round trip".into());
        }
        Ok(())
    }
}

fn io_err(what: &str, e: std::io::Error) -> BenchError {
    BenchError::Setup(format!("{what}: {e}"))
}

/// Bytes that arrived at a sink and the span over which they arrived, on the sink's clock.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub bytes: u64,
    pub first: Duration,
    pub last: Duration,
}

impl Received {
    pub fn bytes_per_sec(&self) -> f64 {
        let secs = self.last.saturating_sub(self.first).as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs
        } else {
            0.0
        }
    }

    fn from_report(r: Report) -> Received {
        Received {
            bytes: r.bytes,
            first: Duration::from_nanos(r.first_ns),
            last: Duration::from_nanos(r.last_ns),
        }
    }
}

/// Folds per-stream results: total bytes over the union of their spans.
pub fn combine(parts: &[Received]) -> Option<Received> {
    let first = parts.iter().map(|p| p.first).min()?;
    let last = parts.iter().map(|p| p.last).max()?;
    Some(Received {
        bytes: parts.iter().map(|p| p.bytes).sum(),
        first,
        last,
    })
}

/// One test's connection to the net server, after it said Ready.
struct Session {
    control: TcpStream,
    /// The server's UDP socket for UDP tests.
    udp: Option<SocketAddr>,
}

impl Session {
    fn open(peer: SocketAddr, test: Test) -> Result<Session, BenchError> {
        let mut control =
            TcpStream::connect_timeout(&peer, IO_TIMEOUT).map_err(|e| io_err("connect", e))?;
        control
            .set_read_timeout(Some(IO_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
        control
            .set_write_timeout(Some(IO_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
        control
            .write_all(&netctl::encode(&Message::Start(test)))
            .map_err(|e| io_err("start a test", e))?;
        match netctl::read_message(&mut control)? {
            Message::Ready { udp_port } => Ok(Session {
                udp: (udp_port != 0).then(|| SocketAddr::new(peer.ip(), udp_port)),
                control,
            }),
            Message::Refused(why) => Err(BenchError::Setup(format!(
                "the net server at {peer} refused {test:?}: {why}"
            ))),
            other => Err(BenchError::Check(format!(
                "the net server at {peer} answered {other:?} to Start"
            ))),
        }
    }

    /// A UDP socket connected to the server's, for UDP tests.
    fn udp_socket(&self) -> Result<UdpSocket, BenchError> {
        let far = self
            .udp
            .ok_or_else(|| BenchError::Check("the net server named no UDP port".into()))?;
        let any = match far {
            SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
        };
        let s = UdpSocket::bind(any).map_err(|e| io_err("udp bind", e))?;
        s.connect(far).map_err(|e| io_err("udp connect", e))?;
        Ok(s)
    }

    fn report(&mut self) -> Result<Received, BenchError> {
        match netctl::read_message(&mut self.control)? {
            Message::Report(r) => Ok(Received::from_report(r)),
            other => Err(BenchError::Check(format!(
                "expected a report from the net server, got {other:?}"
            ))),
        }
    }
}

/// Opens `streams` sessions of `test`, then runs `work` on each on its own thread, all
/// released at once; returns what each returned and the time from first start to last end.
fn on_sessions<T: Send>(
    peer: SocketAddr,
    test: Test,
    streams: usize,
    work: impl Fn(Session) -> Result<T, BenchError> + Sync,
) -> Result<(Vec<T>, Duration), BenchError> {
    let sessions = (0..streams)
        .map(|_| Session::open(peer, test))
        .collect::<Result<Vec<_>, _>>()?;
    let together = run_together(sessions, |session, _start| work(session))?;
    let outputs = together.outputs.into_iter().collect::<Result<_, _>>()?;
    Ok((outputs, together.wall))
}

fn tcp_stream_throughput(
    peer: SocketAddr,
    streams: usize,
    buffer: usize,
    duration: Duration,
) -> Result<Received, BenchError> {
    let test = Test::TcpSink {
        buffer_bytes: size_u32(buffer)?,
    };
    let buf = vec![0x5Au8; buffer];
    let (parts, _) = on_sessions(peer, test, streams, |mut session| {
        let end = Instant::now() + duration;
        while Instant::now() < end {
            session
                .control
                .write_all(&buf)
                .map_err(|e| io_err("tcp write", e))?;
        }
        // EOF tells the sink the stream is over; it answers what arrived.
        session
            .control
            .shutdown(std::net::Shutdown::Write)
            .map_err(|e| io_err("tcp shutdown", e))?;
        session.report()
    })?;
    combine(&parts).ok_or_else(|| BenchError::Check("no TCP stream measured".into()))
}

/// UDP throughput as received (a busy receiver drops what it cannot take), and bytes sent.
fn udp_throughput(
    peer: SocketAddr,
    streams: usize,
    datagram: usize,
    duration: Duration,
) -> Result<(Received, u64), BenchError> {
    let test = Test::UdpSink {
        datagram_bytes: size_u32(datagram)?,
    };
    let buf = vec![0xA5u8; datagram];
    let (parts, _) = on_sessions(peer, test, streams, |mut session| {
        let tx = session.udp_socket()?;
        let end = Instant::now() + duration;
        let mut sent = 0u64;
        while Instant::now() < end {
            // A full socket buffer refuses a datagram; that is loss, not failure.
            if tx.send(&buf).is_ok() {
                sent += datagram as u64;
            }
        }
        session
            .control
            .write_all(&netctl::encode(&Message::Stop))
            .map_err(|e| io_err("udp stop", e))?;
        Ok((session.report()?, sent))
    })?;
    let received: Vec<Received> = parts.iter().map(|p| p.0).collect();
    let got =
        combine(&received).ok_or_else(|| BenchError::Check("no UDP stream measured".into()))?;
    Ok((got, parts.iter().map(|p| p.1).sum()))
}

/// TCP ping-pong over `streams` connections at once; latency of every round trip.
fn tcp_pingpong(
    peer: SocketAddr,
    streams: usize,
    message: usize,
    round_trips: u64,
) -> Result<(LatencyRecorder, Duration), BenchError> {
    let test = Test::TcpEcho {
        message_bytes: size_u32(message)?,
    };
    let (recorders, took) = on_sessions(peer, test, streams, |session| {
        let mut c = session.control;
        c.set_nodelay(true).map_err(|e| io_err("nodelay", e))?;
        let mut rec = LatencyRecorder::new();
        let out = vec![0x42u8; message];
        let mut back = vec![0u8; message];
        for _ in 0..round_trips {
            let t = Instant::now();
            c.write_all(&out).map_err(|e| io_err("ping", e))?;
            c.read_exact(&mut back).map_err(|e| io_err("pong", e))?;
            rec.record(t.elapsed());
        }
        if back != out {
            return Err(BenchError::Check("the echo changed the bytes".into()));
        }
        // Closing ends the server's echo.
        Ok(rec)
    })?;
    let mut all = LatencyRecorder::new();
    for r in &recorders {
        all.merge(r);
    }
    Ok((all, took))
}

/// UDP ping-pong; a ping unanswered within [`UDP_PING_TIMEOUT`] counts as lost.
fn udp_pingpong(
    peer: SocketAddr,
    streams: usize,
    message: usize,
    round_trips: u64,
) -> Result<(LatencyRecorder, Duration, u64), BenchError> {
    let test = Test::UdpEcho {
        message_bytes: size_u32(message)?,
    };
    let (results, took) = on_sessions(peer, test, streams, |session| {
        let c = session.udp_socket()?;
        c.set_read_timeout(Some(UDP_PING_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
        let mut rec = LatencyRecorder::new();
        let mut lost = 0u64;
        let out = vec![0x42u8; message];
        let mut back = vec![0u8; message];
        for _ in 0..round_trips {
            let t = Instant::now();
            c.send(&out).map_err(|e| io_err("udp ping", e))?;
            match c.recv(&mut back) {
                Ok(_) => rec.record(t.elapsed()),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    lost += 1
                }
                Err(e) => return Err(io_err("udp pong", e)),
            }
        }
        // Dropping the session's connection ends the server's echo.
        Ok((rec, lost))
    })?;
    let mut all = LatencyRecorder::new();
    let mut lost = 0;
    for (r, l) in &results {
        all.merge(r);
        lost += l;
    }
    Ok((all, took, lost))
}

fn size_u32(bytes: usize) -> Result<u32, BenchError> {
    u32::try_from(bytes).map_err(|_| BenchError::InvalidConfig(format!("{bytes} bytes")))
}

pub fn run(cfg: &NetConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let duration = Duration::from_secs_f64(cfg.seconds_per_point);
    let points = cfg.streams.len() * (2 * cfg.buffer_sizes_bytes.len() + 2);
    // The in-process server lives until the run ends.
    let local = match cfg.peer {
        Some(_) => None,
        None => Some(NetServer::start(SocketAddr::from((
            Ipv4Addr::LOCALHOST,
            0,
        )))?),
    };
    let peer = match (&local, cfg.peer) {
        (Some(server), _) => server.local_addr(),
        (None, Some(p)) => p,
        (None, None) => return Err(BenchError::Setup("no net server".into())),
    };
    let progress = Progress::new(points as u64, "net");
    let mut series = Vec::new();
    for &streams in &cfg.streams {
        let mut tcp = Series::new(format!("tcp ×{streams}"));
        let mut udp = Series::new(format!("udp ×{streams}"));
        for &b in &cfg.buffer_sizes_bytes {
            progress.set_message(&format!("tcp ×{streams}, {b} B"));
            let r = tcp_stream_throughput(peer, streams, b, duration)?;
            let mut p = Point::new(b);
            p.bytes_per_sec = Some(r.bytes_per_sec());
            tcp.points.push(p);
            progress.inc(1);
            if b <= UDP_PAYLOAD_BYTES_MAX {
                progress.set_message(&format!("udp ×{streams}, {b} B"));
                let (r, sent) = udp_throughput(peer, streams, b, duration)?;
                let mut p = Point::new(b);
                p.bytes_per_sec = Some(r.bytes_per_sec());
                let loss = if sent > 0 {
                    100.0 * (1.0 - r.bytes as f64 / sent as f64).max(0.0)
                } else {
                    0.0
                };
                p.extra.insert("loss_percent".into(), json!(loss));
                udp.points.push(p);
            }
            progress.inc(1);
        }
        series.push(tcp);
        series.push(udp);
    }
    let mut tcp_pp = Series::new("tcp ping-pong");
    let mut udp_pp = Series::new("udp ping-pong");
    for &streams in &cfg.streams {
        progress.set_message(&format!("tcp ping-pong ×{streams}"));
        let (lat, took) = tcp_pingpong(peer, streams, cfg.message_bytes, cfg.pingpong_round_trips)?;
        let mut p = Point::new(streams);
        p.ops_per_sec = Some(lat.count() as f64 / took.as_secs_f64().max(1e-9));
        p.latency_us = Some(lat.summary());
        tcp_pp.points.push(p);
        progress.inc(1);
        progress.set_message(&format!("udp ping-pong ×{streams}"));
        let (lat, took, lost) =
            udp_pingpong(peer, streams, cfg.message_bytes, cfg.pingpong_round_trips)?;
        if lat.count() == 0 {
            return Err(BenchError::Check("every UDP ping was lost".into()));
        }
        let mut p = Point::new(streams);
        p.ops_per_sec = Some(lat.count() as f64 / took.as_secs_f64().max(1e-9));
        p.latency_us = Some(lat.summary());
        p.extra.insert("lost".into(), json!(lost));
        udp_pp.points.push(p);
        progress.inc(1);
    }
    progress.finish();
    series.push(tcp_pp);
    series.push(udp_pp);

    let config = json!({
        "x": "buffer bytes (throughput) / streams (ping-pong)",
        "buffer_sizes_bytes": cfg.buffer_sizes_bytes,
        "streams": cfg.streams,
        "seconds_per_point": cfg.seconds_per_point,
        "pingpong_round_trips": cfg.pingpong_round_trips,
        "message_bytes": cfg.message_bytes,
        "peer": cfg.peer.map_or_else(|| "loopback (in-process net-server on 127.0.0.1)".to_owned(), |p| p.to_string()),
        "quick": cfg.quick,
    });
    let result = BenchResult::new("net", started, config, series);
    drop(local);
    let title = match cfg.peer {
        Some(p) => format!("Network to {p}"),
        None => "Network over loopback".to_owned(),
    };
    Ok(output::write_result_with_figure(
        out,
        &result,
        &figure(&result, &title),
    )?)
}

fn figure(result: &BenchResult, title: &str) -> Figure {
    let mut tcp = Panel::new("TCP throughput", "buffer (bytes)", "MB/s").log_x();
    let mut udp = Panel::new("UDP throughput (received)", "buffer (bytes)", "MB/s").log_x();
    let mut lat = Panel::new("ping-pong latency", "streams", "µs").log_y();
    for s in &result.series {
        if s.label.contains("ping-pong") {
            lat = lat.percentile_lines(s);
            continue;
        }
        let pts = series_points(s, |p| p.bytes_per_sec.map(|b| b / 1e6));
        if s.label.starts_with("tcp") {
            tcp = tcp.line(&s.label, pts);
        } else {
            udp = udp.line(&s.label, pts);
        }
    }
    Figure::new(title).panel(tcp).panel(udp).panel(lat)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configurations_are_refused() {
        let ok = NetConfig::default();
        assert!(ok.validate().is_ok());
        let cases = [
            NetConfig {
                buffer_sizes_bytes: vec![],
                ..ok.clone()
            },
            NetConfig {
                buffer_sizes_bytes: vec![0],
                ..ok.clone()
            },
            NetConfig {
                streams: vec![0],
                ..ok.clone()
            },
            NetConfig {
                seconds_per_point: f64::NAN,
                ..ok.clone()
            },
            NetConfig {
                message_bytes: UDP_PAYLOAD_BYTES_MAX + 1,
                ..ok.clone()
            },
        ];
        for c in cases {
            assert!(
                matches!(c.validate(), Err(BenchError::InvalidConfig(_))),
                "{c:?}"
            );
        }
    }

    #[test]
    fn combining_streams_sums_bytes_over_the_union_of_spans() {
        let a = Received {
            bytes: 100,
            first: Duration::ZERO,
            last: Duration::from_secs(1),
        };
        let b = Received {
            bytes: 300,
            first: Duration::from_millis(500),
            last: Duration::from_secs(2),
        };
        let c = combine(&[a, b]).expect("two parts");
        assert_eq!(c.bytes, 400);
        assert!((c.bytes_per_sec() - 200.0).abs() < 1e-6);
        assert!(combine(&[]).is_none());
    }

    #[test]
    fn a_tiny_run_measures_everything_it_claims() {
        let dir = crate::scratch_dir("net");
        let cfg = NetConfig {
            buffer_sizes_bytes: vec![1024, 128 << 10],
            streams: vec![1, 2],
            seconds_per_point: 0.05,
            pingpong_round_trips: 200,
            message_bytes: 64,
            peer: None,
            quick: true,
        };
        run(&cfg, &dir).expect("net bench");
        let r = output::read_result(&dir.join("net.json")).expect("read back");
        let labels: Vec<&str> = r.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "tcp ×1",
                "udp ×1",
                "tcp ×2",
                "udp ×2",
                "tcp ping-pong",
                "udp ping-pong"
            ]
        );
        // 128 KiB does not fit a UDP datagram: measured for TCP only, not faked for UDP.
        assert_eq!(r.series[0].points.len(), 2);
        assert_eq!(r.series[1].points.len(), 1);
        for s in &r.series {
            for p in &s.points {
                let v = p
                    .bytes_per_sec
                    .or(p.latency_us.as_ref().map(|l| l.p50))
                    .expect("a figure");
                assert!(v.is_finite() && v > 0.0, "{} {:?}: {v}", s.label, p.x);
            }
        }
        assert!(std::fs::metadata(dir.join("net.png"))
            .map(|m| m.len() > 0)
            .unwrap_or(false));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_hostile_peer_is_refused_and_others_are_still_served() {
        let server = NetServer::start(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("start");
        let addr = server.local_addr();
        let mut bad = TcpStream::connect_timeout(&addr, IO_TIMEOUT).expect("connect");
        bad.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        bad.write_all(b"GET / HTTP/1.1\r\n\r\n")
            .expect("send garbage");
        assert!(matches!(
            netctl::read_message(&mut bad),
            Ok(Message::Refused(why)) if why.contains("magic")
        ));
        // Then closed: EOF, or a reset since our garbage was left unread; not a timeout.
        let mut rest = Vec::new();
        match bad.read_to_end(&mut rest) {
            Ok(_) => assert!(rest.is_empty()),
            Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}"),
        }
        let too_big = Session::open(
            addr,
            Test::TcpSink {
                buffer_bytes: u32::MAX,
            },
        );
        assert!(matches!(too_big, Err(BenchError::Setup(why)) if why.contains("outside")));
        let got = tcp_stream_throughput(addr, 2, 4096, Duration::from_millis(20)).expect("served");
        assert!(got.bytes > 0 && got.bytes_per_sec() > 0.0);
    }
}
