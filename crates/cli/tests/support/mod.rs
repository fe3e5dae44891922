//! What the cluster test files (cluster, replication, moves) share: a fresh etcd with `n`
//! `camelot server --etcd` processes registered in it, and waiting on a condition.
// Each test file is its own crate and uses only part of this.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use camelot_cluster::etcd::EtcdCluster;
use camelot_testkit::{CamelotServer, CamelotServerOptions, EtcdServer};

pub const PREFIX: &str = "/camelot";

pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_camelot"))
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Polls `cond` every 20 ms; fails the test if it is not true within `limit`.
pub fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh etcd and the servers registered in it (node ids 0..n, in order).
pub struct EtcdServers {
    pub etcd_server: EtcdServer,
    pub endpoint: String,
    pub servers: Vec<CamelotServer>,
    pub addrs: Vec<SocketAddr>,
    pub rt: tokio::runtime::Runtime,
    pub etcd: EtcdCluster,
}

/// Starts etcd and `n` servers (`--memory memory --etcd … --node-id i`, then `extra`),
/// and waits until every one holds its lease.
pub fn start(n: u32, memory: &str, extra: &[&str]) -> EtcdServers {
    let etcd_server = EtcdServer::start().unwrap();
    let endpoint = etcd_server.endpoint();
    let servers: Vec<CamelotServer> = (0..n)
        .map(|id| {
            let mut args: Vec<String> = ["--memory", memory, "--etcd", &endpoint, "--node-id"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            args.push(id.to_string());
            args.extend(extra.iter().map(|s| s.to_string()));
            let options = CamelotServerOptions { resp: false, args };
            CamelotServer::start(bin(), &options).unwrap()
        })
        .collect();
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    let rt = rt();
    let etcd = rt
        .block_on(EtcdCluster::connect(
            std::slice::from_ref(&endpoint),
            PREFIX,
        ))
        .unwrap();
    wait_for("servers registered", Duration::from_secs(10), || {
        rt.block_on(etcd.live_nodes()).unwrap().len() == n as usize
    });
    EtcdServers {
        etcd_server,
        endpoint,
        servers,
        addrs,
        rt,
        etcd,
    }
}

/// A `camelot cluster controller` process whose output lines the test can wait for.
pub struct ControllerProc {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    rx: std::sync::mpsc::Receiver<String>,
}

impl ControllerProc {
    pub fn start(endpoint: &str, name: &str, extra: &[&str]) -> ControllerProc {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new(bin())
            .args(["cluster", "controller", "--etcd", endpoint, "--name", name])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                log.lock().unwrap().push(line.clone());
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ControllerProc { child, lines, rx }
    }

    /// Waits for a line containing `needle`; fails the test after `limit`.
    pub fn wait_line(&self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => {}
                Err(e) => panic!(
                    "no line with {needle:?} within {limit:?} ({e}); the controller said: {:#?}",
                    self.lines.lock().unwrap()
                ),
            }
        }
    }

    /// Everything it has printed so far.
    pub fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    pub fn said(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    pub fn sigkill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for ControllerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
