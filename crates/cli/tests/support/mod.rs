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

/// A server's map epoch from its STATS (0 while it has none or does not answer).
pub fn server_epoch(probe: &camelot_client::Client, node: u32) -> u64 {
    probe
        .stats(node)
        .ok()
        .and_then(|s| s.into_iter().find(|(k, _)| k == "epoch"))
        .map_or(0, |(_, v)| v)
}

/// Waits until each of `nodes` has installed epoch `epoch` (or a newer one): a server
/// follows the map on its own, some time after it is published.
pub fn wait_epoch(
    probe: &camelot_client::Client,
    nodes: impl IntoIterator<Item = u32>,
    epoch: u64,
) {
    for n in nodes {
        wait_for(
            &format!("server {n} at epoch {epoch}"),
            Duration::from_secs(10),
            || server_epoch(probe, n) >= epoch,
        );
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

impl EtcdServers {
    /// Publishes the first map: every registered node, `partitions` partitions, R =
    /// `replication`.
    pub fn publish_initial(
        &self,
        partitions: u32,
        replication: u32,
    ) -> camelot_cluster::ClusterMap {
        let live = self.rt.block_on(self.etcd.live_nodes()).unwrap();
        let first = camelot_cluster::ClusterMap::initial(live, partitions, replication).unwrap();
        self.rt
            .block_on(self.etcd.update_map(3, move |_| Ok(first.clone())))
            .unwrap()
            .map
    }

    /// The map in etcd now.
    pub fn map(&self) -> camelot_cluster::ClusterMap {
        self.rt.block_on(self.etcd.read_map()).unwrap().unwrap().map
    }

    /// Starts server `id` (registered, not yet in the map) and waits for its registration.
    pub fn add_node(&mut self, id: u32) {
        let id_arg = id.to_string();
        let args: Vec<String> = [
            "--memory",
            "64M",
            "--etcd",
            &self.endpoint,
            "--node-id",
            &id_arg,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let joined =
            CamelotServer::start(bin(), &CamelotServerOptions { resp: false, args }).unwrap();
        self.addrs.push(joined.addr());
        self.servers.push(joined);
        let want = self.servers.len();
        wait_for(
            &format!("node {id} registered"),
            Duration::from_secs(10),
            || self.rt.block_on(self.etcd.live_nodes()).unwrap().len() == want,
        );
    }
}

/// A client of the cluster whose map is in the etcd at `endpoint`, holding the current map.
pub fn etcd_client(endpoint: &str, addrs: &[SocketAddr]) -> camelot_client::Client {
    use camelot_client::{Client, ClientConfig, ClusterMap as ClientMap};
    let c = Client::connect(ClientMap::from_addrs(addrs), ClientConfig::default()).unwrap();
    c.set_map_source(
        camelot_cluster::follow::EtcdMapSource::connect(&[endpoint.to_string()], PREFIX).unwrap(),
    );
    assert!(c.refresh_map().unwrap());
    c
}

/// Writer threads putting `w{writer}-{key:04}` keys round after round, keeping a book of
/// each key's last acknowledged value (a failed write forgets its key: its outcome is
/// unknown). The test files check the book their own way.
pub struct Writers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub acked: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>,
    pub acked_count: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
    wait_max: Duration,
}

impl Writers {
    /// `writers` threads of `keys` keys each; [`Writers::progress`] waits at most `wait_max`.
    pub fn start(c: &EtcdServers, writers: usize, keys: usize, wait_max: Duration) -> Writers {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let stop = Arc::new(AtomicBool::new(false));
        let acked: Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>> =
            Arc::default();
        let acked_count = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let threads = (0..writers)
            .map(|w| {
                let writer = etcd_client(&c.endpoint, &c.addrs);
                let (stop, acked, acked_count, failed) = (
                    stop.clone(),
                    acked.clone(),
                    acked_count.clone(),
                    failed.clone(),
                );
                std::thread::spawn(move || {
                    let mut round = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        round += 1;
                        for i in 0..keys {
                            let k = format!("w{w}-{i:04}");
                            let v = format!("{k}-{round}");
                            if writer.put(k.as_bytes(), v.clone()).is_ok() {
                                acked.lock().unwrap().insert(k, v);
                                acked_count.fetch_add(1, Ordering::Relaxed);
                            } else {
                                acked.lock().unwrap().remove(&k);
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            })
            .collect();
        Writers {
            stop,
            acked,
            acked_count,
            failed,
            threads,
            wait_max,
        }
    }

    /// Waits until `n` more writes are acknowledged.
    pub fn progress(&self, n: u64) {
        use std::sync::atomic::Ordering;
        let from = self.acked_count.load(Ordering::Relaxed);
        wait_for("writes acknowledged", self.wait_max, || {
            self.acked_count.load(Ordering::Relaxed) >= from + n
        });
    }

    /// Reads every key of the book back through a fresh client: one line per key that
    /// does not hold its last acknowledged value.
    pub fn lost(&self, c: &EtcdServers) -> Vec<String> {
        let reader = etcd_client(&c.endpoint, &c.addrs);
        let acked = self.acked.lock().unwrap();
        acked
            .iter()
            .filter_map(|(k, v)| {
                let got = reader.get(k.as_bytes()).unwrap().map(|x| x.value.to_vec());
                (got.as_deref() != Some(v.as_bytes())).then(|| format!("{k}: {got:?}, acked {v}"))
            })
            .collect()
    }

    /// Tells the writers to stop after their current put, without waiting for them.
    pub fn signal_stop(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stops the writers (the book is then final).
    pub fn stop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}
