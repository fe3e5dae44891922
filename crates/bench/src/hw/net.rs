//! `camelot bench hw net`: seed 003's network experiments over loopback. TCP and UDP
//! throughput against buffer size with one and N streams, and TCP/UDP ping-pong latency.
//! These are the limits the request API is judged against on this machine.

use crate::latency::LatencyRecorder;
use crate::plot::{series_points, Figure, Panel};
use crate::progress::Progress;
use crate::schema::{now_rfc3339, BenchResult, Point, Series};
use crate::{output, BenchError};
use serde_json::json;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

/// Largest buffer one write may carry.
pub const BUFFER_BYTES_MAX: usize = 16 << 20;
/// Largest UDP payload over IPv4; bigger buffers are not measured for UDP (not faked).
pub const UDP_PAYLOAD_BYTES_MAX: usize = 65_507;
pub const STREAMS_MAX: usize = 256;
/// How long any socket operation may block before the run is declared failed.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
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
        if !(self.seconds_per_point.is_finite() && self.seconds_per_point > 0.0) {
            return bad("seconds per point must be positive".into());
        }
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

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

/// Bytes received and the span over which they arrived, summed over streams.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub bytes: u64,
    pub first: Instant,
    pub last: Instant,
}

impl Received {
    pub fn bytes_per_sec(&self) -> f64 {
        let secs = self.last.duration_since(self.first).as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs
        } else {
            0.0
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

fn tcp_stream_throughput(
    streams: usize,
    buffer: usize,
    duration: Duration,
) -> Result<Received, BenchError> {
    let listener = TcpListener::bind(loopback()).map_err(|e| io_err("tcp bind", e))?;
    let addr = listener.local_addr().map_err(|e| io_err("tcp addr", e))?;
    let mut clients = Vec::with_capacity(streams);
    for _ in 0..streams {
        let c = TcpStream::connect_timeout(&addr, IO_TIMEOUT).map_err(|e| io_err("connect", e))?;
        c.set_write_timeout(Some(IO_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
        clients.push(c);
    }
    // Every client connected already, so each accept returns at once.
    let mut servers = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (s, _) = listener.accept().map_err(|e| io_err("accept", e))?;
        s.set_read_timeout(Some(IO_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
        servers.push(s);
    }
    let start = Barrier::new(2 * streams);
    let parts = thread::scope(|s| {
        let readers: Vec<_> = servers
            .into_iter()
            .map(|mut sock| {
                let start = &start;
                s.spawn(move || -> Result<Received, BenchError> {
                    let mut buf = vec![0u8; buffer.max(64 << 10)];
                    start.wait();
                    let mut got = 0u64;
                    let (mut first, mut last) = (None, Instant::now());
                    loop {
                        match sock.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => {
                                last = Instant::now();
                                first.get_or_insert(last);
                                got += n as u64;
                            }
                            Err(e) if e.kind() == ErrorKind::Interrupted => {}
                            Err(e) => return Err(io_err("tcp read", e)),
                        }
                    }
                    Ok(Received {
                        bytes: got,
                        first: first.unwrap_or(last),
                        last,
                    })
                })
            })
            .collect();
        for mut c in clients {
            let start = &start;
            s.spawn(move || {
                let buf = vec![0x5Au8; buffer];
                start.wait();
                let end = Instant::now() + duration;
                while Instant::now() < end {
                    if c.write_all(&buf).is_err() {
                        break;
                    }
                }
                // EOF tells the reader the stream is over.
                let _ = c.shutdown(std::net::Shutdown::Write);
            });
        }
        readers
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(BenchError::Check("a reader panicked".into())))
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    combine(&parts).ok_or_else(|| BenchError::Check("no TCP stream measured".into()))
}

/// UDP throughput as received (loopback drops what a busy receiver cannot take).
fn udp_throughput(
    streams: usize,
    datagram: usize,
    duration: Duration,
) -> Result<(Received, u64), BenchError> {
    let mut pairs = Vec::with_capacity(streams);
    for _ in 0..streams {
        let rx = UdpSocket::bind(loopback()).map_err(|e| io_err("udp bind", e))?;
        rx.set_read_timeout(Some(Duration::from_millis(50)))
            .map_err(|e| io_err("timeout", e))?;
        let tx = UdpSocket::bind(loopback()).map_err(|e| io_err("udp bind", e))?;
        tx.connect(rx.local_addr().map_err(|e| io_err("udp addr", e))?)
            .map_err(|e| io_err("udp connect", e))?;
        pairs.push((rx, tx));
    }
    let sending_done = AtomicBool::new(false);
    let start = Barrier::new(2 * streams);
    let (parts, sent) = thread::scope(|s| {
        let mut readers = Vec::new();
        let mut writers = Vec::new();
        for (rx, tx) in pairs {
            let (start, done) = (&start, &sending_done);
            readers.push(s.spawn(move || -> Result<Received, BenchError> {
                let mut buf = vec![0u8; UDP_PAYLOAD_BYTES_MAX];
                start.wait();
                let mut got = 0u64;
                let (mut first, mut last) = (None, Instant::now());
                loop {
                    match rx.recv(&mut buf) {
                        Ok(n) => {
                            last = Instant::now();
                            first.get_or_insert(last);
                            got += n as u64;
                        }
                        Err(e)
                            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                        {
                            if done.load(Ordering::Acquire) {
                                break;
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return Err(io_err("udp recv", e)),
                    }
                }
                Ok(Received {
                    bytes: got,
                    first: first.unwrap_or(last),
                    last,
                })
            }));
            writers.push(s.spawn(move || {
                let buf = vec![0xA5u8; datagram];
                start.wait();
                let end = Instant::now() + duration;
                let mut sent = 0u64;
                while Instant::now() < end {
                    if tx.send(&buf).is_ok() {
                        sent += datagram as u64;
                    }
                }
                sent
            }));
        }
        let sent: u64 = writers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
        sending_done.store(true, Ordering::Release);
        let parts = readers
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(BenchError::Check("a reader panicked".into())))
            })
            .collect::<Result<Vec<_>, _>>();
        (parts, sent)
    });
    let parts = parts?;
    let got = combine(&parts).ok_or_else(|| BenchError::Check("no UDP stream measured".into()))?;
    Ok((got, sent))
}

/// TCP ping-pong over `streams` connections at once; latency of every round trip.
fn tcp_pingpong(
    streams: usize,
    message: usize,
    round_trips: u64,
) -> Result<(LatencyRecorder, Duration), BenchError> {
    let listener = TcpListener::bind(loopback()).map_err(|e| io_err("tcp bind", e))?;
    let addr = listener.local_addr().map_err(|e| io_err("tcp addr", e))?;
    let mut pairs = Vec::with_capacity(streams);
    for _ in 0..streams {
        let c = TcpStream::connect_timeout(&addr, IO_TIMEOUT).map_err(|e| io_err("connect", e))?;
        let (s, _) = listener.accept().map_err(|e| io_err("accept", e))?;
        for sock in [&c, &s] {
            sock.set_nodelay(true).map_err(|e| io_err("nodelay", e))?;
            sock.set_read_timeout(Some(IO_TIMEOUT))
                .map_err(|e| io_err("timeout", e))?;
        }
        pairs.push((c, s));
    }
    let t0 = Instant::now();
    let recorders = thread::scope(|s| {
        let mut clients = Vec::new();
        for (mut c, mut srv) in pairs {
            s.spawn(move || {
                let mut buf = vec![0u8; message];
                while srv.read_exact(&mut buf).is_ok() {
                    if srv.write_all(&buf).is_err() {
                        break;
                    }
                }
            });
            clients.push(s.spawn(move || -> Result<LatencyRecorder, BenchError> {
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
                // Closing ends the echo thread.
                Ok(rec)
            }));
        }
        clients
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(BenchError::Check("a client panicked".into())))
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    let mut all = LatencyRecorder::new();
    for r in &recorders {
        all.merge(r);
    }
    Ok((all, t0.elapsed()))
}

/// UDP ping-pong; a ping unanswered within [`UDP_PING_TIMEOUT`] counts as lost.
fn udp_pingpong(
    streams: usize,
    message: usize,
    round_trips: u64,
) -> Result<(LatencyRecorder, Duration, u64), BenchError> {
    let mut pairs = Vec::with_capacity(streams);
    for _ in 0..streams {
        let echo = UdpSocket::bind(loopback()).map_err(|e| io_err("udp bind", e))?;
        echo.set_read_timeout(Some(Duration::from_millis(50)))
            .map_err(|e| io_err("timeout", e))?;
        let c = UdpSocket::bind(loopback()).map_err(|e| io_err("udp bind", e))?;
        c.connect(echo.local_addr().map_err(|e| io_err("udp addr", e))?)
            .map_err(|e| io_err("udp connect", e))?;
        c.set_read_timeout(Some(UDP_PING_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
        pairs.push((c, echo));
    }
    // One stop flag per stream, owned here so the echo threads can borrow it.
    let stops: Vec<AtomicBool> = (0..streams).map(|_| AtomicBool::new(false)).collect();
    let t0 = Instant::now();
    let results = thread::scope(|s| {
        let mut clients = Vec::new();
        for ((c, echo), done) in pairs.into_iter().zip(&stops) {
            s.spawn(move || {
                let mut buf = vec![0u8; UDP_PAYLOAD_BYTES_MAX];
                while !done.load(Ordering::Acquire) {
                    if let Ok((n, from)) = echo.recv_from(&mut buf) {
                        let _ = echo.send_to(&buf[..n], from);
                    }
                }
            });
            clients.push(
                s.spawn(move || -> Result<(LatencyRecorder, u64), BenchError> {
                    let mut rec = LatencyRecorder::new();
                    let mut lost = 0u64;
                    let out = vec![0x42u8; message];
                    let mut back = vec![0u8; message.max(1)];
                    for _ in 0..round_trips {
                        let t = Instant::now();
                        c.send(&out).map_err(|e| io_err("udp ping", e))?;
                        match c.recv(&mut back) {
                            Ok(_) => rec.record(t.elapsed()),
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    ErrorKind::WouldBlock | ErrorKind::TimedOut
                                ) =>
                            {
                                lost += 1
                            }
                            Err(e) => {
                                done.store(true, Ordering::Release);
                                return Err(io_err("udp pong", e));
                            }
                        }
                    }
                    done.store(true, Ordering::Release);
                    Ok((rec, lost))
                }),
            );
        }
        clients
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(BenchError::Check("a client panicked".into())))
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    let mut all = LatencyRecorder::new();
    let mut lost = 0;
    for (r, l) in &results {
        all.merge(r);
        lost += l;
    }
    Ok((all, t0.elapsed(), lost))
}

pub fn run(cfg: &NetConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let duration = Duration::from_secs_f64(cfg.seconds_per_point);
    let points = cfg.streams.len() * (2 * cfg.buffer_sizes_bytes.len() + 2);
    let progress = Progress::new(points as u64, "net");
    let mut series = Vec::new();
    for &streams in &cfg.streams {
        let mut tcp = Series::new(format!("tcp ×{streams}"));
        let mut udp = Series::new(format!("udp ×{streams}"));
        for &b in &cfg.buffer_sizes_bytes {
            progress.set_message(&format!("tcp ×{streams}, {b} B"));
            let r = tcp_stream_throughput(streams, b, duration)?;
            let mut p = Point::new(b);
            p.bytes_per_sec = Some(r.bytes_per_sec());
            tcp.points.push(p);
            progress.inc(1);
            if b <= UDP_PAYLOAD_BYTES_MAX {
                progress.set_message(&format!("udp ×{streams}, {b} B"));
                let (r, sent) = udp_throughput(streams, b, duration)?;
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
        let (lat, took) = tcp_pingpong(streams, cfg.message_bytes, cfg.pingpong_round_trips)?;
        let mut p = Point::new(streams);
        p.ops_per_sec = Some(lat.count() as f64 / took.as_secs_f64().max(1e-9));
        p.latency_us = Some(lat.summary());
        tcp_pp.points.push(p);
        progress.inc(1);
        progress.set_message(&format!("udp ping-pong ×{streams}"));
        let (lat, took, lost) = udp_pingpong(streams, cfg.message_bytes, cfg.pingpong_round_trips)?;
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
        "peer": "loopback",
        "quick": cfg.quick,
    });
    let result = BenchResult::new("net", started, config, series);
    output::write_result_with_figure(out, &result, &figure(&result))
}

fn figure(result: &BenchResult) -> Figure {
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
    Figure::new("Network over loopback")
        .panel(tcp)
        .panel(udp)
        .panel(lat)
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
        let t = Instant::now();
        let a = Received {
            bytes: 100,
            first: t,
            last: t + Duration::from_secs(1),
        };
        let b = Received {
            bytes: 300,
            first: t + Duration::from_millis(500),
            last: t + Duration::from_secs(2),
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
}
