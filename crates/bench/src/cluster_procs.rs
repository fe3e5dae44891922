//! A cluster of real processes for the cluster benches that kill or rebalance: a fresh
//! etcd (Debian's, on a free loopback port), `camelot server --etcd` nodes and `camelot
//! cluster controller`s, each its own process, and clients that follow the map in etcd.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use camelot_client::{Client, ClientConfig, ClusterMap as ClientMap, NodeInfo};
use camelot_cluster::etcd::EtcdCluster;
use camelot_cluster::follow::EtcdMapSource;
use camelot_cluster::{ClusterMap, Node, PREFIX_DEFAULT};
use camelot_testkit::{CamelotServer, CamelotServerOptions, EtcdServer};

use crate::BenchError;

/// How long the servers may take to register.
const REGISTER_WAIT_MAX: Duration = Duration::from_secs(30);
/// How long a stopping controller may take to resign before it is killed.
const CONTROLLER_STOP_WAIT_MAX: Duration = Duration::from_secs(5);
/// Output lines kept per controller.
const CONTROLLER_LINES_MAX: usize = 10_000;

fn setup(e: impl std::fmt::Display) -> BenchError {
    BenchError::Setup(e.to_string())
}

/// A `camelot cluster controller` process and what it printed.
pub struct ControllerProc {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl ControllerProc {
    /// Lines printed so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().map(|l| l.clone()).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ControllerProc {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + CONTROLLER_STOP_WAIT_MAX;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct ClusterProcs {
    binary: PathBuf,
    endpoint: String,
    /// `None` once killed.
    servers: Vec<Option<CamelotServer>>,
    addrs: Vec<std::net::SocketAddr>,
    controllers: Vec<ControllerProc>,
    rt: tokio::runtime::Runtime,
    etcd: EtcdCluster,
    // Last: etcd outlives everything that talks to it.
    _etcd_server: EtcdServer,
}

impl ClusterProcs {
    /// etcd, then one server per entry of `server_args` (node ids 0.., each with
    /// `--memory memory --etcd … --node-id i --lease-ttl ttl` and its own extra flags),
    /// waiting until every one holds its lease.
    pub fn start(
        binary: &Path,
        memory: &str,
        lease_ttl_secs: u64,
        server_args: &[Vec<String>],
    ) -> Result<ClusterProcs, BenchError> {
        let etcd_server = EtcdServer::start()?;
        let endpoint = etcd_server.endpoint();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(setup)?;
        let etcd = rt
            .block_on(EtcdCluster::connect(
                std::slice::from_ref(&endpoint),
                PREFIX_DEFAULT,
            ))
            .map_err(setup)?;
        let mut servers = Vec::new();
        for (id, extra) in server_args.iter().enumerate() {
            let mut args: Vec<String> = vec![
                "--memory".into(),
                memory.into(),
                "--etcd".into(),
                endpoint.clone(),
                "--node-id".into(),
                id.to_string(),
                "--lease-ttl".into(),
                lease_ttl_secs.to_string(),
            ];
            args.extend(extra.iter().cloned());
            let options = CamelotServerOptions { resp: false, args };
            servers.push(Some(CamelotServer::start(binary, &options)?));
        }
        let addrs = servers.iter().flatten().map(CamelotServer::addr).collect();
        let c = ClusterProcs {
            binary: binary.to_path_buf(),
            endpoint,
            servers,
            addrs,
            controllers: Vec::new(),
            rt,
            etcd,
            _etcd_server: etcd_server,
        };
        let want = server_args.len();
        c.wait("every server registered", REGISTER_WAIT_MAX, || {
            Ok(c.live()?.len() >= want)
        })?;
        Ok(c)
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Polls `cond` every 5 ms until it holds; an error after `limit`.
    pub fn wait(
        &self,
        what: &str,
        limit: Duration,
        mut cond: impl FnMut() -> Result<bool, BenchError>,
    ) -> Result<(), BenchError> {
        let start = Instant::now();
        while !cond()? {
            if start.elapsed() >= limit {
                return Err(BenchError::Setup(format!("{what}: not within {limit:?}")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    pub fn live(&self) -> Result<Vec<Node>, BenchError> {
        self.rt.block_on(self.etcd.live_nodes()).map_err(setup)
    }

    pub fn map(&self) -> Result<ClusterMap, BenchError> {
        self.rt
            .block_on(self.etcd.read_map())
            .map_err(setup)?
            .map(|v| v.map)
            .ok_or_else(|| BenchError::Setup("no cluster map in etcd".into()))
    }

    /// Publishes `map` (its epoch is set one above the current).
    pub fn publish(&self, map: &ClusterMap) -> Result<ClusterMap, BenchError> {
        let map = map.clone();
        Ok(self
            .rt
            .block_on(self.etcd.update_map(8, move |_| Ok(map.clone())))
            .map_err(setup)?
            .map)
    }

    /// The planner's map over the registered servers, published and installed by
    /// every server.
    pub fn publish_initial(
        &self,
        partitions: u32,
        replication: u32,
    ) -> Result<ClusterMap, BenchError> {
        let map = ClusterMap::initial(self.live()?, partitions, replication).map_err(setup)?;
        let map = self.publish(&map)?;
        self.wait_installed(map.epoch)?;
        Ok(map)
    }

    /// Waits until every running server shows `epoch` or a later one in its STATS.
    pub fn wait_installed(&self, epoch: u64) -> Result<(), BenchError> {
        let nodes = self
            .servers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(id, _)| NodeInfo {
                id: id as u32,
                addr: self.addrs[id],
            })
            .collect::<Vec<_>>();
        let ids: Vec<u32> = nodes.iter().map(|n| n.id).collect();
        let probe = Client::connect(ClientMap { epoch: 0, nodes }, ClientConfig::default())?;
        self.wait(
            &format!("every server at epoch {epoch}"),
            REGISTER_WAIT_MAX,
            || {
                for id in &ids {
                    let shown = probe
                        .stats(*id)?
                        .into_iter()
                        .find(|(k, _)| k == "epoch")
                        .map_or(0, |(_, v)| v);
                    if shown < epoch {
                        return Ok(false);
                    }
                }
                Ok(true)
            },
        )
    }

    /// Starts a controller (`--name name`, the lease TTL, then `extra`) whose output is
    /// kept; returns its index.
    pub fn start_controller(
        &mut self,
        name: &str,
        lease_ttl_secs: u64,
        extra: &[String],
    ) -> Result<usize, BenchError> {
        let mut child = Command::new(&self.binary)
            .args([
                "cluster",
                "controller",
                "--etcd",
                &self.endpoint,
                "--name",
                name,
            ])
            .args(["--lease-ttl", &lease_ttl_secs.to_string()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| BenchError::Setup(format!("cannot start a controller: {e}")))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        if let Some(stdout) = child.stdout.take() {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if let Ok(mut l) = lines.lock() {
                        if l.len() < CONTROLLER_LINES_MAX {
                            l.push(line);
                        }
                    }
                }
            });
        }
        self.controllers.push(ControllerProc { child, lines });
        Ok(self.controllers.len() - 1)
    }

    pub fn controller(&self, i: usize) -> Option<&ControllerProc> {
        self.controllers.get(i)
    }

    /// Waits until controller `i` has printed a line containing `needle`.
    pub fn wait_controller_line(
        &self,
        i: usize,
        needle: &str,
        limit: Duration,
    ) -> Result<String, BenchError> {
        let mut found = None;
        self.wait(&format!("controller line {needle:?}"), limit, || {
            found = self
                .controllers
                .get(i)
                .and_then(|c| c.lines().into_iter().find(|l| l.contains(needle)));
            Ok(found.is_some())
        })?;
        Ok(found.unwrap_or_default())
    }

    /// A client of the live servers that follows the map in etcd.
    pub fn client(&self, config: ClientConfig) -> Result<Client, BenchError> {
        let nodes = self
            .servers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(id, _)| NodeInfo {
                id: id as u32,
                addr: self.addrs[id],
            })
            .collect();
        let client = Client::connect(ClientMap { epoch: 0, nodes }, config)?;
        client.set_map_source(
            EtcdMapSource::connect(std::slice::from_ref(&self.endpoint), PREFIX_DEFAULT)
                .map_err(setup)?,
        );
        client.refresh_map()?;
        Ok(client)
    }

    /// SIGKILLs server `id` (and reaps it).
    pub fn kill_server(&mut self, id: u32) -> Result<(), BenchError> {
        match self.servers.get_mut(id as usize).and_then(Option::take) {
            Some(mut s) => Ok(s.process_mut().kill()?),
            None => Err(BenchError::InvalidConfig(format!("no running server {id}"))),
        }
    }

    /// Pids of the running servers.
    pub fn server_pids(&self) -> Vec<u32> {
        self.servers
            .iter()
            .flatten()
            .map(|s| s.process().pid())
            .collect()
    }

    /// The command lines the servers were started with.
    pub fn server_commands(&self) -> Vec<String> {
        self.servers
            .iter()
            .flatten()
            .map(|s| s.process().command().to_string())
            .collect()
    }
}
