//! `camelot server --ops-per-sec-max`: a real server process, throttled, serves at about
//! the limit on both ports; an unthrottled one, measured the same way, is faster.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_testkit::{CamelotServer, CamelotServerOptions};

const OPS_PER_SEC_MAX: u64 = 1000;
const MEASURE: Duration = Duration::from_millis(1500);
/// The bucket's burst (a tenth of a second's worth) lets a 1.5 s window see up to ~7%
/// more than the limit; scheduling on a loaded machine may lose some.
const RATE_LOW: f64 = 0.75;
const RATE_HIGH: f64 = 1.15;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_camelot"))
}

fn server(throttle: Option<u64>) -> CamelotServer {
    let mut args = vec!["--memory".to_owned(), "64M".to_owned()];
    if let Some(n) = throttle {
        args.extend(["--ops-per-sec-max".to_owned(), n.to_string()]);
    }
    CamelotServer::start(bin(), &CamelotServerOptions { resp: true, args }).unwrap()
}

/// Sequential native GETs for [`MEASURE`]; ops per second.
fn native_rate(addr: SocketAddr) -> f64 {
    let client = Client::connect(ClusterMap::from_addrs(&[addr]), ClientConfig::default()).unwrap();
    client.put(b"k", vec![7u8; 16]).unwrap();
    let start = Instant::now();
    let mut ops = 0u64;
    while start.elapsed() < MEASURE {
        assert!(client.get(b"k").unwrap().is_some());
        ops += 1;
    }
    ops as f64 / start.elapsed().as_secs_f64()
}

/// Sequential Redis PINGs for [`MEASURE`]; commands per second.
fn resp_rate(addr: SocketAddr) -> f64 {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut reply = [0u8; 7];
    let start = Instant::now();
    let mut ops = 0u64;
    while start.elapsed() < MEASURE {
        s.write_all(b"*1\r\n$4\r\nPING\r\n").unwrap();
        s.read_exact(&mut reply).unwrap();
        assert_eq!(&reply, b"+PONG\r\n");
        ops += 1;
    }
    ops as f64 / start.elapsed().as_secs_f64()
}

fn assert_near_limit(what: &str, rate: f64) {
    let limit = OPS_PER_SEC_MAX as f64;
    assert!(
        (RATE_LOW * limit..=RATE_HIGH * limit).contains(&rate),
        "{what}: {rate:.0} ops/s, limit {limit}"
    );
}

#[test]
fn a_throttled_server_serves_at_its_limit_and_an_unthrottled_one_faster() {
    let slow = server(Some(OPS_PER_SEC_MAX));
    let native_slow = native_rate(slow.addr());
    assert_near_limit("native port", native_slow);
    let resp_slow = resp_rate(slow.resp_addr().unwrap());
    assert_near_limit("Redis port", resp_slow);

    let fast = server(None);
    let native_fast = native_rate(fast.addr());
    let resp_fast = resp_rate(fast.resp_addr().unwrap());
    eprintln!(
        "native {native_slow:.0} vs {native_fast:.0} ops/s, Redis {resp_slow:.0} vs {resp_fast:.0}"
    );
    assert!(
        native_fast > 2.0 * native_slow,
        "{native_fast} vs {native_slow}"
    );
    assert!(resp_fast > 2.0 * resp_slow, "{resp_fast} vs {resp_slow}");
}

#[test]
fn a_zero_limit_is_refused() {
    let out = std::process::Command::new(bin())
        .args(["server", "--ops-per-sec-max", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}
