//! A cluster on etcd for the cluster benches: Debian's etcd on a free loopback port with a
//! temporary data directory (started through the testkit, never a shared instance), and
//! `camelot server --etcd … --node-id N` processes registered in it under leases, each
//! following the map; the benches publish the first map and then change it only the way
//! a user does (`camelot cluster rebalance`). Clients follow the map through etcd.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use camelot_client::{Client, ClientConfig, NodeId};
use camelot_cluster::etcd::EtcdCluster;
use camelot_cluster::follow::EtcdMapSource;
use camelot_cluster::{ClusterMap, PREFIX_DEFAULT};
use camelot_testkit::{CamelotServer, CamelotServerOptions, EtcdServer, ServerProcess};

use crate::side::{ClientSide, CpuMeter, Side};
use crate::BenchError;

/// How long the servers get to register (their leases appear in etcd) or to install a map.
pub const SETTLE_TIME_MAX: Duration = Duration::from_secs(20);
/// Between two looks while waiting for the cluster to settle.
const SETTLE_POLL: Duration = Duration::from_millis(10);
/// Most nodes a bench cluster has.
pub use crate::cluster::BENCH_CLUSTER_NODES_MAX as NODES_MAX;

/// How one node is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeSpec {
    /// `--ops-per-sec-max` (a slow node), or none.
    pub ops_per_sec_max: Option<u64>,
}

struct Member {
    id: NodeId,
    spec: NodeSpec,
    server: CamelotServer,
}

/// etcd and the servers of one bench cluster; dropping it kills them all.
pub struct EtcdNodes {
    members: Vec<Member>,
    binary: PathBuf,
    memory_bytes: u64,
    endpoint: String,
    rt: tokio::runtime::Runtime,
    etcd: EtcdCluster,
    // Last, so the servers die before etcd does.
    _etcd_server: EtcdServer,
}

impl EtcdNodes {
    /// etcd, a server per spec (node ids 0, 1, …), and a map of `partitions` over them
    /// with `replication` replicas each, published and installed by every server.
    pub fn start(
        binary: &Path,
        memory_bytes: u64,
        specs: &[NodeSpec],
        partitions: u32,
        replication: u32,
    ) -> Result<EtcdNodes, BenchError> {
        if specs.is_empty() || specs.len() > NODES_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "a bench cluster has 1 to {NODES_MAX} nodes"
            )));
        }
        let etcd_server = EtcdServer::start()?;
        let endpoint = etcd_server.endpoint();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| BenchError::Setup(format!("a runtime for etcd: {e}")))?;
        let etcd = rt
            .block_on(EtcdCluster::connect(
                std::slice::from_ref(&endpoint),
                PREFIX_DEFAULT,
            ))
            .map_err(|e| BenchError::Setup(format!("etcd at {endpoint}: {e}")))?;
        let mut nodes = EtcdNodes {
            members: Vec::new(),
            binary: binary.to_path_buf(),
            memory_bytes,
            endpoint,
            rt,
            etcd,
            _etcd_server: etcd_server,
        };
        for spec in specs {
            nodes.add(*spec)?;
        }
        let live = nodes.live()?;
        let first = ClusterMap::initial(live, partitions, replication)
            .map_err(|e| BenchError::Setup(format!("the first map: {e}")))?;
        let published = nodes
            .rt
            .block_on(nodes.etcd.update_map(3, move |_| Ok(first.clone())))
            .map_err(|e| BenchError::Setup(format!("publishing the map: {e}")))?;
        nodes.wait_installed(published.map.epoch)?;
        Ok(nodes)
    }

    /// Starts one more server (the next node id) and waits until its lease is in etcd.
    /// It is not in the map until someone puts it there (`camelot cluster rebalance`).
    pub fn add(&mut self, spec: NodeSpec) -> Result<NodeId, BenchError> {
        let id = self.members.len() as NodeId;
        let mut args: Vec<String> = self.flags(spec);
        args.extend([
            "--etcd".to_string(),
            self.endpoint.clone(),
            "--node-id".to_string(),
            id.to_string(),
        ]);
        let server =
            CamelotServer::start(&self.binary, &CamelotServerOptions { resp: false, args })?;
        self.members.push(Member { id, spec, server });
        let want = self.members.len();
        self.wait("the servers' leases in etcd", || {
            Ok(self.live()?.len() == want)
        })?;
        Ok(id)
    }

    /// The flags a node is started with beyond its address and its etcd membership.
    fn flags(&self, spec: NodeSpec) -> Vec<String> {
        let mut args = vec!["--memory".to_string(), self.memory_bytes.to_string()];
        if let Some(ops) = spec.ops_per_sec_max {
            args.extend(["--ops-per-sec-max".to_string(), ops.to_string()]);
        }
        args
    }

    fn wait(
        &self,
        what: &str,
        mut cond: impl FnMut() -> Result<bool, BenchError>,
    ) -> Result<(), BenchError> {
        let start = Instant::now();
        loop {
            if cond()? {
                return Ok(());
            }
            if start.elapsed() > SETTLE_TIME_MAX {
                return Err(BenchError::Setup(format!(
                    "{what}: not within {SETTLE_TIME_MAX:?}"
                )));
            }
            std::thread::sleep(SETTLE_POLL);
        }
    }

    fn live(&self) -> Result<Vec<camelot_cluster::Node>, BenchError> {
        self.rt
            .block_on(self.etcd.live_nodes())
            .map_err(|e| BenchError::Setup(format!("reading the live nodes: {e}")))
    }

    /// The map in etcd now.
    pub fn map(&self) -> Result<ClusterMap, BenchError> {
        self.rt
            .block_on(self.etcd.read_map())
            .map_err(|e| BenchError::Setup(format!("reading the map: {e}")))?
            .map(|v| v.map)
            .ok_or_else(|| BenchError::Setup("no map in etcd".into()))
    }

    /// Waits until every server in the map shows `epoch` or later (they install a map
    /// from their watch).
    pub fn wait_installed(&self, epoch: u64) -> Result<(), BenchError> {
        let probe = self.raw_client()?;
        let map = self.map()?;
        for n in &map.nodes {
            self.wait(&format!("node {} at epoch {epoch}", n.id), || {
                let stats = probe
                    .stats(n.id)
                    .map_err(|e| BenchError::Setup(format!("stats of node {}: {e}", n.id)))?;
                Ok(stats
                    .into_iter()
                    .find(|(k, _)| k == "epoch")
                    .is_some_and(|(_, v)| v >= epoch))
            })?;
        }
        Ok(())
    }

    /// A client at epoch 0 over every node (never redirected: for stats).
    pub(crate) fn raw_client(&self) -> Result<Client, BenchError> {
        Client::connect(
            camelot_client::ClusterMap::from_addrs(&self.addrs()),
            ClientConfig::default(),
        )
        .map_err(|e| BenchError::Setup(format!("cannot connect: {e}")))
    }

    /// A client on the current map that fetches the map from etcd when a server says it
    /// has moved on (MOVED, STALE_EPOCH).
    pub fn client(&self, config: ClientConfig) -> Result<Client, BenchError> {
        let client = Client::connect(
            camelot_client::ClusterMap::from_addrs(&self.addrs()),
            config,
        )
        .map_err(|e| BenchError::Setup(format!("cannot connect: {e}")))?;
        let source: Arc<EtcdMapSource> =
            EtcdMapSource::connect(std::slice::from_ref(&self.endpoint), PREFIX_DEFAULT)
                .map_err(|e| BenchError::Setup(format!("the map source: {e}")))?;
        client.set_map_source(source);
        client
            .refresh_map()
            .map_err(|e| BenchError::Setup(format!("the first map: {e}")))?;
        Ok(client)
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.members.iter().map(|m| m.server.addr()).collect()
    }

    /// Node ids with their server processes.
    pub fn processes(&self) -> Vec<(NodeId, &ServerProcess)> {
        self.members
            .iter()
            .map(|m| (m.id, m.server.process()))
            .collect()
    }

    /// A meter per node, in node order.
    pub fn cpu_meters(&self) -> Vec<(NodeId, CpuMeter)> {
        self.members
            .iter()
            .map(|m| (m.id, CpuMeter::start(vec![m.server.process().pid()])))
            .collect()
    }

    pub fn spec(&self, id: NodeId) -> Option<NodeSpec> {
        self.members.iter().find(|m| m.id == id).map(|m| m.spec)
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The record of the servers of class `spec` for `config["sides"]`.
    pub fn side(&self, label: &str, spec: NodeSpec, client: ClientSide) -> Side {
        let of_class: Vec<&Member> = self.members.iter().filter(|m| m.spec == spec).collect();
        let flags = self.flags(spec);
        Side {
            label: label.to_string(),
            server: "camelot".into(),
            process: "separate".into(),
            server_threads: Some(crate::side::cores()),
            nodes: of_class.len(),
            version: format!("camelot {}", env!("CARGO_PKG_VERSION")),
            command: of_class
                .first()
                .map_or_else(String::new, |m| m.server.process().command().to_string()),
            flags,
            client,
        }
    }

    /// Publishes `next` (at the epoch after the current map's) and waits until every
    /// server has installed it: a bench's starting layout (a skewed map).
    pub fn publish(&self, mut next: ClusterMap) -> Result<ClusterMap, BenchError> {
        let published = self
            .rt
            .block_on(self.etcd.update_map(3, move |current| {
                next.epoch = current.map_or(1, |m| m.epoch + 1);
                Ok(next.clone())
            }))
            .map_err(|e| BenchError::Setup(format!("publishing the map: {e}")))?;
        self.wait_installed(published.map.epoch)?;
        Ok(published.map)
    }

    /// Whether a move is recorded in etcd (one in progress).
    pub fn move_in_progress(&self) -> Result<bool, BenchError> {
        Ok(self
            .rt
            .block_on(self.etcd.read_move())
            .map_err(|e| BenchError::Setup(format!("reading the move record: {e}")))?
            .is_some())
    }

    /// Starts `camelot ARGS --etcd URL` in the background (a controller); it is killed
    /// when the returned guard is dropped.
    pub fn start_tool(&self, args: &[&str]) -> Result<Background, BenchError> {
        use camelot_testkit::process::{spawn, Program, ScratchDir};
        let scratch = ScratchDir::new("cluster-tool")?;
        let mut all: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        all.extend(["--etcd".into(), self.endpoint.clone().into()]);
        let program = Program {
            program: self.binary.to_string_lossy().into_owned().into(),
            package: "camelot".into(),
        };
        let guard = spawn(&program, &all, &scratch, "tool")?;
        Ok(Background {
            guard,
            _scratch: scratch,
        })
    }

    /// Runs `camelot ARGS` against this cluster's etcd (`--etcd URL` appended) to its
    /// end, within `limit`: its stdout, and the CPU seconds it used (read from
    /// `/proc/PID/stat` once it has exited and before it is reaped, so nothing is missed).
    pub fn run_tool(&self, args: &[&str], limit: Duration) -> Result<Tool, BenchError> {
        use camelot_testkit::process::{read_lossy, spawn, Program, ScratchDir};
        let scratch = ScratchDir::new("cluster-tool")?;
        let mut all: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        all.extend(["--etcd".into(), self.endpoint.clone().into()]);
        let program = Program {
            program: self.binary.to_string_lossy().into_owned().into(),
            package: "camelot".into(),
        };
        let mut guard = spawn(&program, &all, &scratch, "tool")?;
        let pid = guard.child.id();
        let started = Instant::now();
        let mut cpu_seconds = 0.0;
        let status =
            loop {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                if let Some(ticks) = camelot_testkit::process::parse_stat_cpu_ticks(&stat) {
                    cpu_seconds = ticks as f64 / USER_HZ;
                }
                if is_zombie(&stat) || stat.is_empty() {
                    if let Some(status) = guard.child.try_wait().map_err(|e| {
                        BenchError::Setup(format!("waiting for camelot {args:?}: {e}"))
                    })? {
                        break status;
                    }
                }
                if started.elapsed() > limit {
                    return Err(BenchError::Setup(format!(
                        "camelot {args:?} still running after {limit:?}: {}",
                        guard.output_excerpt()
                    )));
                }
                std::thread::sleep(TOOL_POLL);
            };
        let stdout = read_lossy(&guard.stdout_path);
        if !status.success() {
            return Err(BenchError::Setup(format!(
                "camelot {args:?}: {status}: {}",
                guard.output_excerpt()
            )));
        }
        Ok(Tool {
            stdout,
            cpu_seconds,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// A `camelot` tool running in the background ([`EtcdNodes::start_tool`]).
pub struct Background {
    guard: camelot_testkit::process::ChildGuard,
    _scratch: camelot_testkit::process::ScratchDir,
}

impl Background {
    pub fn pid(&self) -> u32 {
        self.guard.child.id()
    }

    /// Its CPU seconds so far (0 once it is gone).
    pub fn cpu_seconds(&self) -> f64 {
        camelot_testkit::cpu_seconds(self.pid()).unwrap_or(0.0)
    }

    /// What it has printed so far.
    pub fn stdout(&self) -> String {
        camelot_testkit::process::read_lossy(&self.guard.stdout_path)
    }
}

/// What a `camelot` tool run left.
#[derive(Debug, Clone)]
pub struct Tool {
    pub stdout: String,
    pub cpu_seconds: f64,
    pub seconds: f64,
}

/// Between two looks at a running tool.
const TOOL_POLL: Duration = Duration::from_millis(5);
/// The kernel's clock ticks per second in `/proc/PID/stat` (USER_HZ, 100 on Linux).
const USER_HZ: f64 = 100.0;

/// Whether a `/proc/PID/stat` line is a zombie's (exited, not yet reaped): the state is
/// the first field after the command name's closing parenthesis.
fn is_zombie(stat: &str) -> bool {
    stat.rfind(')')
        .and_then(|at| stat[at + 1..].split_whitespace().next())
        == Some("Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zombies_are_told_apart_whatever_the_command_name() {
        assert!(is_zombie("123 (camelot) Z 1 2 3"));
        assert!(is_zombie("123 (a) b) Z 1"));
        assert!(!is_zombie("123 (cam Z) S 1"));
        assert!(!is_zombie(""));
    }
}
