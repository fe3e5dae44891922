//! The two sides of a comparison, started the same way and written down the same way.
//!
//! A ratio against a peer means something only when both servers ran alike: separate
//! processes, the same thread budget, the same data model, the same client. So a bench
//! starts Camelot here as a `camelot server` process exactly as it starts redis-server
//! or memcached (a free loopback port, a wait until it accepts, a kill at the end), meters
//! every server's CPU seconds from `/proc/PID/stat`, and records each side as a [`Side`]
//! in the result's `config["sides"]`, which the report prints under the figure.
//! `--in-process` (a `DevCluster` inside the bench) stays as an opt-in, and says so in
//! every label and config it produces.

use std::net::SocketAddr;
use std::path::PathBuf;

use camelot_server::dev::{DevCluster, DevClusterConfig};
use camelot_testkit::{CamelotServer, CamelotServerOptions, ServerProcess};
use serde::Serialize;

use crate::BenchError;

/// Environment variable naming the `camelot` binary, for callers that are not it (the
/// bench crate's own tests).
pub const CAMELOT_BIN_ENV: &str = "CAMELOT_BIN";
/// Label suffix of every series measured against an in-process server.
pub const IN_PROCESS_SUFFIX: &str = " (in-process)";

/// Where the Camelot servers of a run live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// `camelot server` processes started from this binary, like every peer.
    Separate { binary: PathBuf },
    /// A dev cluster on a runtime inside the bench process (shares its cores and CPU
    /// accounting with the client; labelled wherever it is used).
    InProcess,
}

impl Placement {
    /// Separate processes unless `in_process`; the binary is `$CAMELOT_BIN`, or this
    /// program when it is `camelot`.
    pub fn choose(in_process: bool) -> Result<Placement, BenchError> {
        if in_process {
            return Ok(Placement::InProcess);
        }
        if let Some(bin) = std::env::var_os(CAMELOT_BIN_ENV) {
            return Ok(Placement::Separate {
                binary: PathBuf::from(bin),
            });
        }
        let exe = std::env::current_exe()
            .map_err(|e| BenchError::Setup(format!("cannot tell where this program is: {e}")))?;
        if exe.file_stem().is_some_and(|s| s == "camelot") {
            Ok(Placement::Separate { binary: exe })
        } else {
            Err(BenchError::InvalidConfig(format!(
                "cannot start `camelot server` processes from {}: set {CAMELOT_BIN_ENV} to \
                 the camelot binary, or run the servers in process (--in-process)",
                exe.display()
            )))
        }
    }

    pub fn is_in_process(&self) -> bool {
        matches!(self, Placement::InProcess)
    }

    /// "separate" or "in-process", as the config records it.
    pub fn name(&self) -> &'static str {
        match self {
            Placement::Separate { .. } => "separate",
            Placement::InProcess => "in-process",
        }
    }

    /// `label`, marked when the servers were in process.
    pub fn label(&self, label: &str) -> String {
        match self {
            Placement::Separate { .. } => label.to_string(),
            Placement::InProcess => format!("{label}{IN_PROCESS_SUFFIX}"),
        }
    }
}

/// How to start the Camelot servers of one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CamelotSpec {
    pub nodes: usize,
    pub memory_bytes_per_node: u64,
    pub token: Option<Vec<u8>>,
    /// Also open each node's Redis-protocol port.
    pub resp: bool,
    /// Native-port worker threads (`camelot server --threads`); `None`: the default (one
    /// per core).
    pub threads: Option<usize>,
    /// `--resp-threads`; `None`: the default.
    pub resp_threads: Option<usize>,
    /// `--resp-poll-us`; `None`: the default.
    pub resp_poll_us: Option<u64>,
}

impl CamelotSpec {
    pub fn new(nodes: usize, memory_bytes_per_node: u64) -> CamelotSpec {
        CamelotSpec {
            nodes,
            memory_bytes_per_node,
            token: None,
            resp: false,
            threads: None,
            resp_threads: None,
            resp_poll_us: None,
        }
    }

    /// The `camelot server` flags beyond the listening addresses, as passed.
    pub fn flags(&self) -> Vec<String> {
        let mut flags = vec![
            "--memory".to_string(),
            self.memory_bytes_per_node.to_string(),
        ];
        if let Some(t) = self.threads {
            flags.extend(["--threads".to_string(), t.to_string()]);
        }
        if let Some(t) = self.resp_threads {
            flags.extend(["--resp-threads".to_string(), t.to_string()]);
        }
        if let Some(us) = self.resp_poll_us {
            flags.extend(["--resp-poll-us".to_string(), us.to_string()]);
        }
        flags
    }

    /// Threads that serve requests, per node, for the face a client uses: the Redis
    /// port's event loops, or the native port's workers.
    pub fn serving_threads(&self, resp_face: bool) -> usize {
        let cores = cores();
        if resp_face {
            match self
                .resp_threads
                .unwrap_or(camelot_server::RESP_THREADS_DEFAULT)
            {
                // 0 puts the Redis port on the native workers.
                0 => self.threads.unwrap_or(cores),
                n => n,
            }
        } else {
            self.threads.unwrap_or(cores)
        }
    }
}

/// The machine's cores as a thread budget (what the default thread counts follow).
pub fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Camelot servers started for a run, in separate processes or in this one. Dropping
/// it stops them.
pub struct CamelotNodes {
    spec: CamelotSpec,
    placement: Placement,
    inner: Inner,
}

enum Inner {
    Separate(Vec<CamelotServer>),
    InProcess(DevCluster),
}

impl CamelotNodes {
    pub fn start(spec: &CamelotSpec, placement: &Placement) -> Result<CamelotNodes, BenchError> {
        if spec.nodes == 0 {
            return Err(BenchError::InvalidConfig("at least one node".into()));
        }
        let inner = match placement {
            Placement::Separate { binary } => {
                let mut args = spec.flags();
                if let Some(token) = &spec.token {
                    let token = String::from_utf8(token.clone()).map_err(|_| {
                        BenchError::InvalidConfig("a spawned server's token must be UTF-8".into())
                    })?;
                    args.extend(["--token".to_string(), token]);
                }
                let options = CamelotServerOptions {
                    resp: spec.resp,
                    args,
                };
                let servers = (0..spec.nodes)
                    .map(|_| CamelotServer::start(binary, &options))
                    .collect::<Result<Vec<_>, _>>()?;
                Inner::Separate(servers)
            }
            Placement::InProcess => {
                if spec.resp_poll_us.is_some() || spec.resp_threads.is_some() {
                    return Err(BenchError::InvalidConfig(
                        "Redis-port thread and polling settings need separate server \
                         processes (drop --in-process)"
                            .into(),
                    ));
                }
                Inner::InProcess(DevCluster::start(DevClusterConfig {
                    nodes: spec.nodes,
                    memory_bytes_per_node: spec.memory_bytes_per_node,
                    token: spec.token.clone(),
                    worker_threads: spec.threads.unwrap_or(0),
                    resp: spec.resp,
                    ..DevClusterConfig::default()
                })?)
            }
        };
        Ok(CamelotNodes {
            spec: spec.clone(),
            placement: placement.clone(),
            inner,
        })
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        match &self.inner {
            Inner::Separate(s) => s.iter().map(CamelotServer::addr).collect(),
            Inner::InProcess(d) => d.addrs().to_vec(),
        }
    }

    pub fn resp_addrs(&self) -> Vec<SocketAddr> {
        match &self.inner {
            Inner::Separate(s) => s.iter().filter_map(CamelotServer::resp_addr).collect(),
            Inner::InProcess(d) => d.resp_addrs(),
        }
    }

    pub fn spec(&self) -> &CamelotSpec {
        &self.spec
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The server processes, when they are separate (empty in process).
    pub fn processes(&self) -> Vec<&ServerProcess> {
        match &self.inner {
            Inner::Separate(s) => s.iter().map(CamelotServer::process).collect(),
            Inner::InProcess(_) => Vec::new(),
        }
    }

    /// A meter over every server process; in process there is none to meter apart
    /// from the client, so it reads nothing.
    pub fn cpu_meter(&self) -> CpuMeter {
        CpuMeter::start(self.processes().iter().map(|p| p.pid()).collect())
    }

    /// Server counters node by node (in process only: a separate server is asked over
    /// the wire by whoever needs them).
    pub fn dev_stats(&self) -> Option<Vec<Vec<(String, u64)>>> {
        match &self.inner {
            Inner::Separate(_) => None,
            Inner::InProcess(d) => Some(d.stats()),
        }
    }

    /// The record of this side for `config["sides"]`, with the command as it ran.
    pub fn side(&self, label: &str, client: ClientSide) -> Side {
        let mut side = camelot_side(&self.spec, &self.placement, label, client);
        if let Some(p) = self.processes().first() {
            side.command = p.command().to_string();
        }
        side
    }

    /// Stops every server: separate ones are killed and reaped, an in-process cluster
    /// shuts down gracefully.
    pub fn stop(self) -> Result<(), BenchError> {
        match self.inner {
            Inner::Separate(servers) => {
                drop(servers);
                Ok(())
            }
            Inner::InProcess(d) => Ok(d.shutdown()?),
        }
    }
}

/// The record of a Camelot side that starts servers per trial (so no one process stands
/// for the run): the command is the one each trial runs, ports left out.
pub fn camelot_side(
    spec: &CamelotSpec,
    placement: &Placement,
    label: &str,
    client: ClientSide,
) -> Side {
    let command = match placement {
        Placement::Separate { binary } => format!(
            "{} server --listen 127.0.0.1:PORT{} {}",
            binary.display(),
            if spec.resp {
                " --resp-listen 127.0.0.1:PORT"
            } else {
                ""
            },
            spec.flags().join(" ")
        ),
        Placement::InProcess => "DevCluster (a runtime inside the bench process)".into(),
    };
    Side {
        label: label.to_string(),
        server: "camelot".into(),
        process: placement.name().into(),
        server_threads: Some(spec.serving_threads(client.resp_face)),
        nodes: spec.nodes,
        version: format!("camelot {}", env!("CARGO_PKG_VERSION")),
        flags: spec.flags(),
        command,
        client,
    }
}

/// The client of one side, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientSide {
    /// The client program or binding (`camelot-client`, `redis crate (YCSB Redis binding)`,
    /// `redis-benchmark`, …).
    pub client: String,
    pub client_threads: usize,
    /// Requests each client thread keeps in flight.
    pub depth: usize,
    /// How a record or value is stored (`hash per record (HMSET/HGETALL)`, `one value
    /// per record`, `64 B string`, `64 B region READ`).
    pub data_model: String,
    /// Whether the client speaks to a Redis-protocol port (decides which server threads
    /// count as serving).
    #[serde(skip)]
    pub resp_face: bool,
}

/// One side of a comparison: everything that shaped how its server ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Side {
    pub label: String,
    /// `camelot`, `redis-server`, `memcached`, `iperf3`, …
    pub server: String,
    /// `separate` or `in-process`.
    pub process: String,
    /// Threads serving requests, when the server has a knob for them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_threads: Option<usize>,
    pub nodes: usize,
    pub version: String,
    pub flags: Vec<String>,
    pub command: String,
    #[serde(flatten)]
    pub client: ClientSide,
}

impl Side {
    /// A peer server process started by the testkit (`flags` as they were passed).
    pub fn peer(
        label: &str,
        process: &ServerProcess,
        version: String,
        server_threads: Option<usize>,
        flags: Vec<String>,
        client: ClientSide,
    ) -> Side {
        Side {
            label: label.to_string(),
            server: process.program().program.to_string(),
            process: "separate".into(),
            server_threads,
            nodes: 1,
            version,
            flags,
            command: process.command().to_string(),
            client,
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        // A struct of strings, numbers and lists always serialises.
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// The sides of a run as `config["sides"]`: an object keyed by label.
pub fn sides_json(sides: &[Side]) -> serde_json::Value {
    serde_json::Value::Object(
        sides
            .iter()
            .map(|s| (s.label.clone(), s.to_json()))
            .collect(),
    )
}

/// CPU seconds a set of server processes spend between `start` and `seconds`.
#[derive(Debug, Clone)]
pub struct CpuMeter {
    pids: Vec<u32>,
    start: Option<f64>,
}

impl CpuMeter {
    pub fn start(pids: Vec<u32>) -> CpuMeter {
        let start = total_cpu_seconds(&pids);
        CpuMeter { pids, start }
    }

    /// CPU seconds used since `start`, or `None` when there is no process to meter (in
    /// process, or an external target) or its times cannot be read.
    pub fn seconds(&self) -> Option<f64> {
        let now = total_cpu_seconds(&self.pids)?;
        Some((now - self.start?).max(0.0))
    }
}

fn total_cpu_seconds(pids: &[u32]) -> Option<f64> {
    if pids.is_empty() {
        return None;
    }
    pids.iter()
        .map(|&pid| camelot_testkit::cpu_seconds(pid).ok())
        .sum()
}

/// The two efficiency figures recorded beside throughput: server CPU seconds the
/// measured phase cost, and operations per server CPU-second.
pub fn cpu_extra(
    ops: f64,
    server_cpu_seconds: Option<f64>,
) -> Vec<(&'static str, serde_json::Value)> {
    let Some(cpu) = server_cpu_seconds else {
        return Vec::new();
    };
    let mut extra = vec![("server_cpu_seconds", serde_json::json!(cpu))];
    // Below one clock tick the ratio is noise, not efficiency.
    if cpu >= CPU_SECONDS_RESOLUTION {
        extra.push(("ops_per_server_cpu_second", serde_json::json!(ops / cpu)));
    }
    extra
}

/// The kernel's process-time tick (10 ms).
pub const CPU_SECONDS_RESOLUTION: f64 = 0.01;

/// The iperf3 stream's record for `config["sides"]`: one stream over loopback, its
/// server started and stopped by the bench like every peer.
pub(crate) fn iperf3_side(stream: &crate::peers::PeerStream) -> Result<Side, BenchError> {
    let version = camelot_testkit::process::program_version(
        &camelot_testkit::servers::IPERF3,
        &["--version"],
    )?;
    Ok(Side {
        label: "iperf3".into(),
        server: "iperf3".into(),
        process: "separate".into(),
        server_threads: Some(1),
        nodes: 1,
        version,
        flags: vec!["-s".into(), "-1".into()],
        command: stream.command.clone(),
        client: ClientSide {
            client: "iperf3 -c (one TCP stream)".into(),
            client_threads: 1,
            depth: 1,
            data_model: "a byte stream".into(),
            resp_face: false,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_process_is_labelled_everywhere() {
        let p = Placement::InProcess;
        assert_eq!(p.label("camelot"), "camelot (in-process)");
        assert_eq!(p.name(), "in-process");
        let s = Placement::Separate {
            binary: PathBuf::from("/x/camelot"),
        };
        assert_eq!(s.label("camelot"), "camelot");
        assert_eq!(s.name(), "separate");
    }

    #[test]
    fn flags_say_what_was_passed() {
        let mut spec = CamelotSpec::new(1, 1 << 30);
        assert_eq!(spec.flags(), vec!["--memory", "1073741824"]);
        spec.threads = Some(1);
        spec.resp_threads = Some(1);
        spec.resp_poll_us = Some(0);
        assert_eq!(
            spec.flags(),
            vec![
                "--memory",
                "1073741824",
                "--threads",
                "1",
                "--resp-threads",
                "1",
                "--resp-poll-us",
                "0"
            ]
        );
        assert_eq!(spec.serving_threads(true), 1);
        spec.resp_threads = Some(0);
        assert_eq!(spec.serving_threads(true), 1);
        spec.threads = None;
        assert_eq!(spec.serving_threads(false), cores());
    }

    #[test]
    fn efficiency_is_left_out_without_a_process_or_below_a_tick() {
        assert!(cpu_extra(1000.0, None).is_empty());
        let tiny = cpu_extra(1000.0, Some(0.0));
        assert_eq!(tiny.len(), 1);
        let full = cpu_extra(1000.0, Some(0.5));
        assert_eq!(
            full[1],
            ("ops_per_server_cpu_second", serde_json::json!(2000.0))
        );
    }

    #[test]
    fn a_meter_without_processes_reads_nothing() {
        assert_eq!(CpuMeter::start(Vec::new()).seconds(), None);
        let own = CpuMeter::start(vec![std::process::id()]);
        assert!(own.seconds().is_some_and(|s| s >= 0.0));
    }

    #[test]
    fn sides_are_keyed_by_label() {
        let side = Side {
            label: "redis".into(),
            server: "redis-server".into(),
            process: "separate".into(),
            server_threads: Some(1),
            nodes: 1,
            version: "Redis server v=7.0.15".into(),
            flags: vec!["--save".into(), "".into()],
            command: "redis-server --port 1".into(),
            client: ClientSide {
                client: "redis-benchmark".into(),
                client_threads: 1,
                depth: 16,
                data_model: "64 B string".into(),
                resp_face: true,
            },
        };
        let json = sides_json(&[side]);
        assert_eq!(json["redis"]["process"], "separate");
        assert_eq!(json["redis"]["client_threads"], 1);
        assert_eq!(json["redis"]["data_model"], "64 B string");
        assert!(json["redis"].get("resp_face").is_none());
    }
}
