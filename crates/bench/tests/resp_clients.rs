//! The Redis-protocol port, driven by clients that were not written here: redis-cli,
//! redis-benchmark and the `redis` crate. Real server listeners on loopback ports the OS
//! picks.

use camelot_server::dev::{DevCluster, DevClusterConfig};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

fn node(token: Option<&str>) -> (DevCluster, SocketAddr) {
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 256 << 20,
        worker_threads: 2,
        resp: true,
        token: token.map(|t| t.as_bytes().to_vec()),
        ..DevClusterConfig::default()
    })
    .expect("node starts");
    let addr = cluster.resp_addrs()[0];
    assert!(addr.ip().is_loopback());
    (cluster, addr)
}

/// Runs a program under coreutils `timeout`, so a hung client fails the test instead
/// of hanging it.
fn run(program: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new("timeout")
        .arg("60")
        .arg(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (run scripts/setup.sh): {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn cli(addr: SocketAddr, args: &[&str]) -> String {
    let port = addr.port().to_string();
    let mut all = vec!["-h", "127.0.0.1", "-p", &port];
    all.extend_from_slice(args);
    let (ok, text) = run("redis-cli", &all);
    assert!(ok, "redis-cli {args:?} failed: {text}");
    text.trim_end().to_owned()
}

#[test]
fn redis_cli_works_unchanged() {
    let (cluster, addr) = node(None);
    assert_eq!(cli(addr, &["PING"]), "PONG");
    assert_eq!(cli(addr, &["SET", "greeting", "hello world"]), "OK");
    assert_eq!(cli(addr, &["GET", "greeting"]), "hello world");
    assert_eq!(cli(addr, &["INCRBY", "n", "5"]), "5");
    assert_eq!(cli(addr, &["HSET", "h", "a", "1", "b", "2"]), "2");
    assert_eq!(cli(addr, &["HGET", "h", "b"]), "2");
    assert_eq!(cli(addr, &["ZADD", "z", "1", "one", "2", "two"]), "2");
    assert_eq!(cli(addr, &["ZRANGEBYSCORE", "z", "(1", "+inf"]), "two");
    assert_eq!(cli(addr, &["DBSIZE"]), "4");
    assert!(cli(addr, &["INFO"]).contains("redis_version:"));
    assert!(cli(addr, &["NOSUCHCMD", "x"]).starts_with("ERR unknown command 'NOSUCHCMD'"));
    assert!(cli(addr, &["GET"]).contains("wrong number of arguments"));
    assert!(cli(addr, &["GET", "h"]).starts_with("WRONGTYPE"));
    cluster.shutdown().unwrap();
}

#[test]
fn a_token_means_auth_first() {
    let (cluster, addr) = node(Some("sesame"));
    assert!(cli(addr, &["GET", "k"]).contains("NOAUTH"));
    assert!(cli(addr, &["-a", "wrong", "--no-auth-warning", "GET", "k"]).contains("WRONGPASS"));
    assert_eq!(
        cli(
            addr,
            &["-a", "sesame", "--no-auth-warning", "SET", "k", "v"]
        ),
        "OK"
    );
    cluster.shutdown().unwrap();
}

#[test]
fn redis_crate_pipelines() {
    let (cluster, addr) = node(None);
    let client = redis::Client::open(format!("redis://{addr}/")).unwrap();
    let mut con = client
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap();
    let n = 2000;
    let mut pipe = redis::pipe();
    for i in 0..n {
        pipe.cmd("SET")
            .arg(format!("k{i}"))
            .arg(format!("v{i}"))
            .ignore();
    }
    pipe.query::<()>(&mut con).unwrap();
    let mut pipe = redis::pipe();
    for i in 0..n {
        pipe.cmd("GET").arg(format!("k{i}"));
    }
    let values: Vec<String> = pipe.query(&mut con).unwrap();
    assert_eq!(values.len(), n);
    for (i, v) in values.iter().enumerate() {
        assert_eq!(v, &format!("v{i}"));
    }
    let (a, b): (i64, Option<String>) = redis::pipe()
        .cmd("DEL")
        .arg("k0")
        .arg("k1")
        .arg("nope")
        .cmd("GET")
        .arg("k0")
        .query(&mut con)
        .unwrap();
    assert_eq!((a, b), (2, None));
    cluster.shutdown().unwrap();
}

#[test]
fn redis_benchmark_runs_without_errors() {
    let (cluster, addr) = node(None);
    let port = addr.port().to_string();
    let (ok, text) = run(
        "redis-benchmark",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "set,get",
            "-n",
            "10000",
            "-q",
        ],
    );
    assert!(ok, "redis-benchmark failed: {text}");
    assert!(!text.contains("ERR") && !text.contains("WARNING"), "{text}");
    assert!(text.contains("SET:") && text.contains("GET:"), "{text}");
    let stats = &cluster.stats()[0];
    let commands = stats.iter().find(|(n, _)| n == "resp_commands").unwrap().1;
    assert!(commands >= 20_000, "{commands} commands served");
    cluster.shutdown().unwrap();
}

#[test]
fn garbage_closes_only_that_connection() {
    let (cluster, addr) = node(None);
    let client = redis::Client::open(format!("redis://{addr}/")).unwrap();
    let mut good = client
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap();
    redis::cmd("SET")
        .arg("a")
        .arg("1")
        .query::<()>(&mut good)
        .unwrap();

    let mut bad = TcpStream::connect(addr).unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    bad.write_all(b"*1\r\n$99999999999\r\n").unwrap();
    let mut reply = Vec::new();
    // The server answers and closes, so reading to the end terminates.
    bad.read_to_end(&mut reply).unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("-ERR Protocol error"), "{reply}");

    let v: String = redis::cmd("GET").arg("a").query(&mut good).unwrap();
    assert_eq!(v, "1");
    cluster.shutdown().unwrap();
}
