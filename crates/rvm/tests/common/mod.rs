//! Real servers for the RVM tests: Camelot dev clusters in process and redis-server as a
//! child process, all on loopback ports picked at run time.
#![allow(dead_code)]

use camelot_rvm::{BackendConfig, Config};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a child server may take to answer PING.
const REDIS_START_DEADLINE: Duration = Duration::from_secs(10);
const POLL_INTERVAL: Duration = Duration::from_millis(10);
pub const NODE_MEMORY_BYTES: u64 = 128 << 20;
/// Small enough that several instances share a dev node, large enough for every test.
pub const POOL_LOG_BYTES: u64 = 8 << 20;

pub fn dev_node() -> DevCluster {
    DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: NODE_MEMORY_BYTES,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster starts")
}

pub struct Redis {
    child: Child,
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Redis {
    pub fn start() -> Redis {
        let dir = scratch("redis");
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir"])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/setup.sh installs it)");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut r = Redis { child, addr, dir };
        let deadline = Instant::now() + REDIS_START_DEADLINE;
        loop {
            if ping(addr) {
                return r;
            }
            if let Ok(Some(status)) = r.child.try_wait() {
                panic!("redis-server exited at start: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING in time"
            );
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

fn ping(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).is_ok() && line.starts_with("+PONG")
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn scratch(tag: &str) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "camelot-rvm-{tag}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}

/// One backend of the shared suite, with whatever servers it needs kept alive.
pub enum Fixture {
    Pool(DevCluster),
    Mirrored(DevCluster, DevCluster),
    Redis(Redis),
    File(PathBuf),
}

impl Fixture {
    pub fn start(kind: &str) -> Fixture {
        match kind {
            "pool" => Fixture::Pool(dev_node()),
            "pool-mirrored" => Fixture::Mirrored(dev_node(), dev_node()),
            "redis" => Fixture::Redis(Redis::start()),
            "file" => Fixture::File(scratch("file")),
            other => panic!("unknown backend {other}"),
        }
    }

    pub fn backend(&self) -> BackendConfig {
        match self {
            Fixture::Pool(c) => BackendConfig::Pool {
                servers: c.addrs().to_vec(),
                token: None,
                log_bytes: POOL_LOG_BYTES,
            },
            Fixture::Mirrored(a, b) => BackendConfig::Pool {
                servers: vec![a.addrs()[0], b.addrs()[0]],
                token: None,
                log_bytes: POOL_LOG_BYTES,
            },
            Fixture::Redis(r) => BackendConfig::Redis { addr: r.addr },
            Fixture::File(dir) => BackendConfig::File { dir: dir.clone() },
        }
    }

    pub fn config(&self, name: &str, recover: bool) -> Config {
        Config::new(self.backend(), name).recover(recover)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Fixture::File(dir) = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
