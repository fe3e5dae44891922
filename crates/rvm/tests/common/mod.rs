//! Real servers for the RVM tests: Camelot dev clusters in process and redis-server as a
//! child process, all on loopback ports picked at run time.
#![allow(dead_code)]

use camelot_rvm::{BackendConfig, Config};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use camelot_testkit::RedisServer;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
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

/// A dev node on `addr`'s port again, empty: a memory server restarted after a crash.
pub fn dev_node_on(addr: SocketAddr) -> DevCluster {
    DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: NODE_MEMORY_BYTES,
        base_port: Some(addr.port()),
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster restarts on its port")
}

/// A real redis-server on a free loopback port: the benchmarks' own peer launcher, which
/// retries a port another process took and kills and reaps the server on drop.
pub struct Redis {
    _server: RedisServer,
    pub addr: SocketAddr,
}

impl Redis {
    pub fn start() -> Redis {
        let server =
            RedisServer::start().expect("redis-server starts (scripts/setup.sh installs it)");
        Redis {
            addr: server.addr(),
            _server: server,
        }
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
    /// The redis backend against Camelot's own Redis-protocol port (`--resp-listen`).
    Resp(DevCluster),
    File(PathBuf),
}

impl Fixture {
    pub fn start(kind: &str) -> Fixture {
        match kind {
            "pool" => Fixture::Pool(dev_node()),
            "pool-mirrored" => Fixture::Mirrored(dev_node(), dev_node()),
            "redis" => Fixture::Redis(Redis::start()),
            "camelot-resp" => Fixture::Resp(
                DevCluster::start(DevClusterConfig {
                    nodes: 1,
                    memory_bytes_per_node: NODE_MEMORY_BYTES,
                    worker_threads: 1,
                    resp: true,
                    ..DevClusterConfig::default()
                })
                .expect("dev cluster with a RESP port starts"),
            ),
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
            Fixture::Resp(c) => BackendConfig::Redis {
                addr: c.resp_addrs()[0],
                wait_replicas: 0,
            },
            Fixture::Redis(r) => BackendConfig::Redis {
                addr: r.addr,
                wait_replicas: 0,
            },
            Fixture::File(dir) => BackendConfig::File { dir: dir.clone() },
        }
    }

    /// The backend as `rvm-crash-writer` takes it.
    pub fn spec(&self) -> String {
        match self.backend() {
            BackendConfig::Pool { servers, .. } => {
                let s: Vec<String> = servers.iter().map(ToString::to_string).collect();
                format!("pool://{}", s.join(","))
            }
            BackendConfig::Redis { addr, .. } => format!("redis://{addr}"),
            BackendConfig::File { dir } => format!("file://{}", dir.display()),
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

/// How long a child process may stay silent before the test fails.
pub const CHILD_LINE_TIMEOUT: Duration = Duration::from_secs(30);

/// A child process whose stdout lines are read by a thread, to wait on with a timeout.
pub struct LineChild {
    pub child: Child,
    lines: mpsc::Receiver<String>,
}

impl LineChild {
    pub fn spawn(program: &str, args: &[String], envs: &[(&str, &str)]) -> LineChild {
        let mut child = Command::new(program)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{program} starts: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        LineChild { child, lines }
    }

    /// `rvm-crash-writer` with `args`.
    pub fn writer(args: &[String], envs: &[(&str, &str)]) -> LineChild {
        LineChild::spawn(env!("CARGO_BIN_EXE_rvm-crash-writer"), args, envs)
    }

    /// The next line; `None` once the child closed its stdout (exited).
    pub fn next_line(&mut self) -> Option<String> {
        match self.lines.recv_timeout(CHILD_LINE_TIMEOUT) {
            Ok(l) => Some(l),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(e) => {
                let status = self.child.try_wait();
                panic!("child said nothing within {CHILD_LINE_TIMEOUT:?} ({e}); status {status:?}")
            }
        }
    }

    /// The next line, failing the test if the child is silent too long or exits.
    pub fn line(&mut self) -> String {
        self.next_line().unwrap_or_else(|| {
            let status = self.child.wait();
            panic!("child exited ({status:?}) before the line the test waits for")
        })
    }

    /// SIGKILLs the child and returns the lines it wrote before dying (dropping a
    /// `LineChild` kills it too, so a failing test leaves no writer paused in a hook).
    pub fn kill(mut self) -> Vec<String> {
        let _ = self.child.kill();
        self.child.wait().expect("reaped");
        let mut rest = Vec::new();
        let deadline = Instant::now() + CHILD_LINE_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => rest.push(l),
                Err(mpsc::RecvTimeoutError::Disconnected) => return rest,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("child pipe never closed"),
            }
        }
    }
}

impl Drop for LineChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
