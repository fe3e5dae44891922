//! Runs the real peer programs briefly. They are installed by scripts/setup.sh.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use camelot_bench::peers::{
    iperf3_tcp_stream, iperf3_tcp_stream_in, redis_benchmark, sockperf_tcp_pingpong,
    StreamDirection,
};
use camelot_bench::BenchError;
use camelot_testkit::RedisServer;

#[test]
fn iperf3_streams_over_loopback() -> Result<(), BenchError> {
    let stream = iperf3_tcp_stream(Duration::from_secs(1))?;
    assert!(
        stream.bytes_per_sec.is_finite() && stream.bytes_per_sec > 0.0,
        "{stream:?}"
    );
    assert!(
        stream.command.starts_with("iperf3 -c 127.0.0.1 -p "),
        "{stream:?}"
    );
    assert!(stream.command.ends_with(" -t 1 -J"), "{stream:?}");
    Ok(())
}

#[test]
fn iperf3_streams_from_the_server_with_reverse() -> Result<(), BenchError> {
    let stream = iperf3_tcp_stream_in(Duration::from_secs(1), StreamDirection::ServerToClient)?;
    assert!(
        stream.bytes_per_sec.is_finite() && stream.bytes_per_sec > 0.0,
        "{stream:?}"
    );
    assert!(stream.command.ends_with(" -t 1 -J -R"), "{stream:?}");
    Ok(())
}

#[test]
fn sockperf_pingpong_over_loopback() -> Result<(), BenchError> {
    let peer = sockperf_tcp_pingpong(Duration::from_millis(500), 64)?;
    let l = &peer.latency_us;
    for v in [l.p50, l.p90, l.p99, l.p999, l.max] {
        assert!(v.is_finite() && v > 0.0, "{peer:?}");
    }
    assert!(
        l.p50 <= l.p90 && l.p90 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max,
        "{peer:?}"
    );
    assert!(peer.command.contains("-m 64 -t 1 --full-rtt"), "{peer:?}");
    Ok(())
}

#[test]
fn redis_benchmark_against_a_private_redis() -> Result<(), BenchError> {
    let server = RedisServer::start()?;
    let addr = server.addr();
    assert!(addr.ip().is_loopback());
    let rate = redis_benchmark(addr, &["-n", "20000", "-t", "set"])?;
    assert!(
        rate.ops_per_sec.is_finite() && rate.ops_per_sec > 0.0,
        "{rate:?}"
    );
    assert!(rate.command.contains("--csv -n 20000 -t set"), "{rate:?}");

    drop(server);
    // Drop has killed and reaped the server, so the port closes; allow the kernel a
    // bounded moment in case another test's process reuses nothing but timing.
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "redis on {addr} outlived its guard"
        );
        std::thread::yield_now();
    }
    Ok(())
}

#[test]
fn two_redis_servers_run_side_by_side() -> Result<(), BenchError> {
    let a = RedisServer::start()?;
    let b = RedisServer::start()?;
    assert_ne!(a.addr(), b.addr());
    Ok(())
}
