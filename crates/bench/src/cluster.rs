//! `camelot bench cluster …`. `throughput` is seed 004's single-node throughput against
//! value size: one `camelot server`, the client's key-value API (GET and PUT, several
//! threads on one client), value sizes 1 KiB..1 MiB, with an iperf3 loopback stream in the
//! same run beside, since at 1 MiB the seed's server was bound by the network.

use crate::checks::{check_seconds, check_threads};
use crate::side::{cpu_extra, sides_json, CamelotNodes, CamelotSpec, ClientSide, Placement};
use crate::BenchError;
use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_results::output;
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The most servers a bench cluster starts (expand grows to it; etcd benches refuse more).
/// Here, not in the etcd module, so a build without etcd still validates its configs.
pub const BENCH_CLUSTER_NODES_MAX: usize = 16;

/// Why a cluster bench on etcd cannot run in this build, and how to get one that can.
pub const NO_ETCD: &str = "this camelot was built without etcd support, which the cluster \
     benches on etcd (percentiles, expand) need: rebuild with `cargo build --release -p \
     camelot --features etcd` (its build needs protoc, which scripts/setup.sh installs)";

/// Largest value size measured: the client's and server's value limit is far above, but
/// the seed stopped at 1 MB.
pub const VALUE_BYTES_MAX: u64 = 1 << 20;
/// Most client threads a run may ask for.
pub const THREADS_MAX: usize = 64;
/// Bytes of distinct values each size's key set holds (so 1 KiB values are not all one
/// hot key and 1 MiB ones fit the server's memory).
const KEY_SET_BYTES: u64 = 64 << 20;
/// Keys per size, at least and at most.
const KEYS_MIN: u64 = 16;
const KEYS_MAX: u64 = 4096;

#[derive(Debug, Clone)]
pub struct ThroughputConfig {
    pub value_bytes: Vec<u64>,
    /// Client threads issuing one request at a time each, sharing one client.
    pub threads: usize,
    pub seconds_per_point: f64,
    /// Seconds iperf3 streams beside (0: no iperf3).
    pub peer_seconds: u64,
    pub in_process: bool,
    pub quick: bool,
}

impl Default for ThroughputConfig {
    fn default() -> Self {
        ThroughputConfig {
            value_bytes: vec![1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20],
            threads: 4,
            seconds_per_point: 2.0,
            peer_seconds: 3,
            in_process: false,
            quick: false,
        }
    }
}

impl ThroughputConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.value_bytes = vec![1 << 10, 64 << 10, 1 << 20];
        self.seconds_per_point = 0.3;
        self.peer_seconds = self.peer_seconds.min(1);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if self.value_bytes.is_empty()
            || self
                .value_bytes
                .iter()
                .any(|&b| b == 0 || b > VALUE_BYTES_MAX)
        {
            return Err(BenchError::InvalidConfig(format!(
                "value sizes must be 1 to {VALUE_BYTES_MAX} bytes"
            )));
        }
        check_threads(&[self.threads], THREADS_MAX)?;
        check_seconds("seconds per point", self.seconds_per_point)?;
        Ok(())
    }
}

/// Keys used for values of `value_bytes`.
fn keys_for(value_bytes: u64) -> u64 {
    (KEY_SET_BYTES / value_bytes.max(1)).clamp(KEYS_MIN, KEYS_MAX)
}

fn key(size: u64, i: u64) -> Vec<u8> {
    format!("tp:{size}:{i}").into_bytes()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Get,
    Put,
}

/// `threads` threads running `op` over the size's keys for `seconds`; (ops/s, value
/// bytes/s). Every GET must find its value at full size: a short or missing one fails the
/// run rather than inflating it.
fn drive(
    client: &Client,
    op: Op,
    value_bytes: u64,
    threads: usize,
    seconds: f64,
) -> Result<(f64, f64), BenchError> {
    let keys = keys_for(value_bytes);
    let value = bytes::Bytes::from(vec![0x5au8; value_bytes as usize]);
    let run_for = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let counts = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let value = value.clone();
                s.spawn(move || -> Result<u64, String> {
                    let mut ops = 0u64;
                    let mut i = t as u64;
                    while start.elapsed() < run_for {
                        let k = key(value_bytes, i % keys);
                        match op {
                            Op::Get => match client.get(&k) {
                                Ok(Some(v)) if v.value.len() as u64 == value_bytes => {}
                                Ok(other) => {
                                    return Err(format!(
                                        "GET {}: {} bytes, expected {value_bytes}",
                                        String::from_utf8_lossy(&k),
                                        other.map_or(0, |v| v.value.len())
                                    ))
                                }
                                Err(e) => return Err(format!("GET: {e}")),
                            },
                            Op::Put => {
                                client
                                    .put(&k, value.clone())
                                    .map_err(|e| format!("PUT: {e}"))?;
                            }
                        }
                        ops += 1;
                        i += threads as u64;
                    }
                    Ok(ops)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err("a client thread panicked".into()))
            })
            .collect::<Result<Vec<u64>, String>>()
    })
    .map_err(BenchError::Setup)?;
    let secs = start.elapsed().as_secs_f64();
    let ops: u64 = counts.iter().sum();
    let ops_per_sec = ops as f64 / secs;
    Ok((ops_per_sec, ops_per_sec * value_bytes as f64))
}

/// Runs `bench cluster throughput`; writes `cluster-throughput.json`.
pub fn run_throughput(cfg: &ThroughputConfig, out: &Path) -> Result<PathBuf, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let placement = Placement::choose(cfg.in_process)?;
    let largest = cfg.value_bytes.iter().copied().max().unwrap_or(1);
    let memory = KEY_SET_BYTES.max(keys_for(largest) * largest) * 2 + (64 << 20);
    let spec = CamelotSpec::new(1, memory);
    let node = CamelotNodes::start(&spec, &placement)?;
    let client = Client::connect(
        ClusterMap::from_addrs(&node.addrs()),
        ClientConfig::default(),
    )
    .map_err(|e| BenchError::Setup(format!("cannot connect: {e}")))?;
    let mut gets = Series::new(placement.label("GET"));
    let mut puts = Series::new(placement.label("PUT"));
    let mut get_bytes_at_largest = 0.0;
    let mut put_bytes_at_largest = 0.0;
    for &size in &cfg.value_bytes {
        // The PUT pass also fills the keys the GET pass reads; a fill of its own first
        // so a short PUT pass cannot leave keys unwritten.
        let value = bytes::Bytes::from(vec![0x5au8; size as usize]);
        for i in 0..keys_for(size) {
            client
                .put(&key(size, i), value.clone())
                .map_err(|e| BenchError::Setup(format!("fill: {e}")))?;
        }
        // Server CPU seconds per phase, metered from /proc (none in process).
        let meter = node.cpu_meter();
        let (put_ops, put_bytes) =
            drive(&client, Op::Put, size, cfg.threads, cfg.seconds_per_point)?;
        let put_cpu = meter.seconds();
        let meter = node.cpu_meter();
        let (get_ops, get_bytes) =
            drive(&client, Op::Get, size, cfg.threads, cfg.seconds_per_point)?;
        let get_cpu = meter.seconds();
        for (series, ops, bytes, cpu) in [
            (&mut puts, put_ops, put_bytes, put_cpu),
            (&mut gets, get_ops, get_bytes, get_cpu),
        ] {
            let mut p = Point::new(size);
            p.ops_per_sec = Some(ops);
            p.bytes_per_sec = Some(bytes);
            // CPU seconds of the whole phase, so ops/CPU-s is ops_per_sec × seconds ÷ CPU.
            for (k, v) in cpu_extra(ops * cfg.seconds_per_point, cpu) {
                p.extra.insert(k.to_string(), v);
            }
            series.points.push(p);
        }
        if size == largest {
            get_bytes_at_largest = get_bytes;
            put_bytes_at_largest = put_bytes;
        }
        // Free this size's values before the next, so memory stays one key set.
        for i in 0..keys_for(size) {
            client
                .delete(&key(size, i))
                .map_err(|e| BenchError::Setup(format!("delete: {e}")))?;
        }
    }
    drop(client);
    let camelot = node.side(
        &placement.label("camelot"),
        ClientSide {
            client: "camelot-client KV API (get/put)".into(),
            client_threads: cfg.threads,
            depth: 1,
            data_model: "one value per key, value size = x".into(),
            resp_face: false,
        },
    );
    node.stop()?;
    let iperf = crate::peers::iperf3_tcp_stream_for(cfg.peer_seconds)?;
    let mut sides = vec![camelot];
    if let Some(i) = &iperf {
        sides.push(crate::side::iperf3_side(i)?);
    }
    let config = json!({
        "x": "value_bytes",
        "sides": sides_json(&sides),
        "value_bytes": cfg.value_bytes,
        "threads": cfg.threads,
        "client": "camelot-client KV API (get/put), one request in flight per thread",
        "keys_per_size": cfg.value_bytes.iter().map(|&b| keys_for(b)).collect::<Vec<_>>(),
        "server_memory_bytes": memory,
        "server_flags": spec.flags(),
        "seconds_per_point": cfg.seconds_per_point,
        "servers": placement.name(),
        "iperf3": iperf.as_ref().map(|i| i.command.clone()),
        "iperf3_seconds": cfg.peer_seconds,
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("cluster-throughput", started, config, vec![gets, puts]);
    if let Some(i) = &iperf {
        result.references.push(Reference {
            label: "iperf3 stream (loopback)".into(),
            metric: "bytes_per_sec".into(),
            value: i.bytes_per_sec,
        });
        for (what, bytes) in [("GET", get_bytes_at_largest), ("PUT", put_bytes_at_largest)] {
            result.comparisons.push(Comparison::new(
                format!("{what} value bytes/s at {largest}-byte values"),
                bytes,
                i.bytes_per_sec,
                "B/s",
                "iperf3",
            ));
        }
    }
    write_with_standard_figure(out, &result)
}

/// Writes `result` and its standard figure; the path of the JSON.
pub(crate) fn write_with_standard_figure(
    out: &Path,
    result: &BenchResult,
) -> Result<PathBuf, BenchError> {
    let figure = camelot_results::plot::standard_figure(result);
    let files = output::write_result_with_figure(out, result, &figure)?;
    files
        .into_iter()
        .find(|f| f.extension().is_some_and(|e| e == "json"))
        .ok_or_else(|| BenchError::Setup("no JSON written".into()))
}

/// `bench cluster replication`: PUT latency with every write copied to one backup (R=2)
/// against the same cluster with none (R=1), in the same run, rounds alternating which
/// goes first. The servers run in this process on a runtime of their own (labelled): the
/// replica sets are installed straight into their ownership, since a `camelot server`
/// process learns its map only from etcd, which this crate does not link.
#[derive(Debug, Clone)]
pub struct ReplicationConfig {
    pub nodes: u32,
    /// Client thread counts measured, each thread one request in flight.
    pub threads: Vec<usize>,
    pub value_bytes: u64,
    pub seconds_per_point: f64,
    /// Rounds per point; the round with the median R=2 ÷ R=1 p50 ratio is kept.
    pub rounds: usize,
    pub quick: bool,
}

/// Partitions of the bench's map (the client's fixed count).
const REPLICATION_PARTITIONS: u32 = camelot_client::PARTITIONS;
/// Keys each thread cycles through.
const REPLICATION_KEYS_PER_THREAD: u64 = 1024;
/// Rounds a run may ask for.
pub const ROUNDS_MAX: usize = 20;
/// The target: R=2 write p50 at most this many times R=1's.
pub const REPLICATION_P50_RATIO_TARGET: f64 = 1.6;

impl Default for ReplicationConfig {
    fn default() -> Self {
        ReplicationConfig {
            nodes: 3,
            threads: vec![1, 4, 16],
            value_bytes: 1 << 10,
            seconds_per_point: 2.0,
            rounds: 3,
            quick: false,
        }
    }
}

impl ReplicationConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.threads = vec![1, 8];
        self.seconds_per_point = 0.5;
        self.rounds = 3;
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if !(2..=16).contains(&self.nodes) {
            return Err(BenchError::InvalidConfig("nodes must be 2 to 16".into()));
        }
        check_threads(&self.threads, THREADS_MAX)?;
        if self.value_bytes == 0 || self.value_bytes > VALUE_BYTES_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "value size must be 1 to {VALUE_BYTES_MAX} bytes"
            )));
        }
        check_seconds("seconds per point", self.seconds_per_point)?;
        if self.rounds == 0 || self.rounds > ROUNDS_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "rounds must be 1 to {ROUNDS_MAX}"
            )));
        }
        Ok(())
    }
}

/// Partition `p`'s replicas, primary first: consecutive nodes from `p mod n`.
fn replica_set(p: u32, nodes: u32, replication: u32) -> Vec<u32> {
    (0..replication).map(|r| (p + r) % nodes).collect()
}

/// Node `id`'s ownership under the bench's map.
fn bench_ownership(
    id: u32,
    addrs: &[std::net::SocketAddr],
    replication: u32,
    epoch: u64,
) -> Result<camelot_server::ownership::Ownership, BenchError> {
    use camelot_server::ownership::{Ownership, Peer};
    let n = addrs.len() as u32;
    let sets: Vec<Vec<u32>> = (0..REPLICATION_PARTITIONS)
        .map(|p| replica_set(p, n, replication))
        .collect();
    let owned = sets.iter().map(|s| s[0] == id).collect();
    let backups = sets
        .iter()
        .map(|s| {
            if s[0] != id {
                return Vec::new();
            }
            s[1..]
                .iter()
                .map(|&b| Peer {
                    id: b,
                    addr: addrs[b as usize],
                })
                .collect()
        })
        .collect();
    let backup_of = sets.iter().map(|s| s[1..].contains(&id)).collect();
    Ownership::new(epoch, owned)
        .and_then(|o| o.with_replicas(backups, backup_of))
        .map_err(|e| BenchError::Setup(format!("ownership: {e}")))
}

/// PUT latency of `threads` threads, one request in flight each, for `seconds`.
fn drive_puts(
    client: &Client,
    threads: usize,
    value_bytes: u64,
    seconds: f64,
) -> Result<(f64, crate::latency::LatencyRecorder), BenchError> {
    let value = bytes::Bytes::from(vec![0xa5u8; value_bytes as usize]);
    let run_for = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let recorders = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let value = value.clone();
                s.spawn(move || -> Result<crate::latency::LatencyRecorder, String> {
                    let mut rec = crate::latency::LatencyRecorder::new();
                    let mut i = 0u64;
                    while start.elapsed() < run_for {
                        let k = format!("rp:{t}:{}", i % REPLICATION_KEYS_PER_THREAD);
                        let began = Instant::now();
                        client
                            .put(k.as_bytes(), value.clone())
                            .map_err(|e| format!("PUT: {e}"))?;
                        rec.record(began.elapsed());
                        i += 1;
                    }
                    Ok(rec)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err("a client thread panicked".into()))
            })
            .collect::<Result<Vec<_>, String>>()
    })
    .map_err(BenchError::Setup)?;
    let secs = start.elapsed().as_secs_f64();
    let mut all = crate::latency::LatencyRecorder::new();
    for r in &recorders {
        all.merge(r);
    }
    Ok((all.count() as f64 / secs, all))
}

/// Runs `bench cluster replication`; writes `cluster-replication.json`.
pub fn run_replication(cfg: &ReplicationConfig, out: &Path) -> Result<PathBuf, BenchError> {
    use camelot_client::{NodeInfo, PartitionTable};
    use camelot_server::{ServerConfig, ServerHandle};
    cfg.validate()?;
    let started = now_rfc3339();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| BenchError::Setup(format!("runtime: {e}")))?;
    let memory = 256u64 << 20;
    let servers = (0..cfg.nodes)
        .map(|_| {
            rt.block_on(ServerHandle::start(ServerConfig::new(
                std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                memory,
            )))
            .map_err(|e| BenchError::Setup(format!("server: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let addrs: Vec<_> = servers.iter().map(|s| s.local_addr()).collect();
    let mut epoch = 0u64;
    // (threads, replication) → each round's (ops/s, latency).
    let mut runs: Vec<Vec<[(f64, crate::latency::LatencyRecorder); 2]>> = Vec::new();
    for &threads in &cfg.threads {
        let mut rounds = Vec::new();
        for round in 0..cfg.rounds {
            let order: [u32; 2] = if round % 2 == 0 { [1, 2] } else { [2, 1] };
            let mut got: [Option<(f64, crate::latency::LatencyRecorder)>; 2] = [None, None];
            for replication in order {
                epoch += 1;
                for (id, s) in servers.iter().enumerate() {
                    let own = bench_ownership(id as u32, &addrs, replication, epoch)?;
                    if !s.state().set_ownership(own) {
                        return Err(BenchError::Setup("ownership not installed".into()));
                    }
                }
                let view = ClusterMap {
                    epoch,
                    nodes: addrs
                        .iter()
                        .enumerate()
                        .map(|(id, &addr)| NodeInfo {
                            id: id as u32,
                            addr,
                        })
                        .collect(),
                };
                let table = PartitionTable::new(
                    (0..REPLICATION_PARTITIONS)
                        .map(|p| replica_set(p, cfg.nodes, 1)[0])
                        .collect(),
                )
                .ok_or_else(|| BenchError::Setup("partition table".into()))?;
                let client =
                    Client::connect(ClusterMap::from_addrs(&addrs), ClientConfig::default())
                        .map_err(|e| BenchError::Setup(format!("cannot connect: {e}")))?;
                client
                    .set_cluster(view, table)
                    .map_err(|e| BenchError::Setup(format!("map: {e}")))?;
                // A short warm-up so connections (client and replication links) exist.
                drive_puts(&client, threads, cfg.value_bytes, 0.05)?;
                got[replication as usize - 1] = Some(drive_puts(
                    &client,
                    threads,
                    cfg.value_bytes,
                    cfg.seconds_per_point,
                )?);
            }
            let [Some(r1), Some(r2)] = got else {
                return Err(BenchError::Setup("a round missed a side".into()));
            };
            rounds.push([r1, r2]);
        }
        runs.push(rounds);
    }
    for s in servers {
        rt.block_on(s.shutdown())
            .map_err(|e| BenchError::Setup(format!("shutdown: {e}")))?;
    }
    let mut series = [
        Series::new("PUT, R=1 (in-process)"),
        Series::new("PUT, R=2: every write on one backup first (in-process)"),
    ];
    let mut comparisons = Vec::new();
    let mut per_round = Vec::new();
    for (&threads, rounds) in cfg.threads.iter().zip(&runs) {
        let ratio = |r: &[(f64, crate::latency::LatencyRecorder); 2]| {
            r[1].1.summary().p50 / r[0].1.summary().p50.max(f64::MIN_POSITIVE)
        };
        let mut order: Vec<usize> = (0..rounds.len()).collect();
        order.sort_by(|&a, &b| ratio(&rounds[a]).total_cmp(&ratio(&rounds[b])));
        let median = &rounds[order[order.len() / 2]];
        per_round.push(json!({
            "threads": threads,
            "p50_ratio_per_round": rounds.iter().map(ratio).collect::<Vec<_>>(),
        }));
        for (side, (ops, lat)) in median.iter().enumerate() {
            let mut p = Point::new(threads as u64);
            p.ops_per_sec = Some(*ops);
            p.latency_us = Some(lat.summary());
            series[side].points.push(p);
        }
        comparisons.push(
            Comparison::new(
                format!("PUT p50, R=2 ÷ R=1, {threads} thread(s) × 1 in flight"),
                median[1].1.summary().p50,
                median[0].1.summary().p50,
                "µs",
                "R=1, same run",
            )
            .with_target(REPLICATION_P50_RATIO_TARGET, true),
        );
    }
    let config = json!({
        "x": "client_threads",
        "nodes": cfg.nodes,
        "partitions": REPLICATION_PARTITIONS,
        "threads": cfg.threads,
        "value_bytes": cfg.value_bytes,
        "seconds_per_point": cfg.seconds_per_point,
        "rounds": cfg.rounds,
        "kept": "the round with the median R=2 ÷ R=1 p50 ratio; rounds alternate which side goes first",
        "servers": "in-process (one runtime, 2 worker threads, shared by all nodes)",
        "client": "camelot-client KV API (put), one request in flight per thread, cluster-routed",
        "per_round": per_round,
        "quick": cfg.quick,
    });
    let [s1, s2] = series;
    let mut result = BenchResult::new("cluster-replication", started, config, vec![s1, s2]);
    result.comparisons = comparisons;
    write_with_standard_figure(out, &result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_ownerships_give_every_partition_one_primary_and_its_backups() {
        let addrs: Vec<std::net::SocketAddr> = (0..3)
            .map(|i| std::net::SocketAddr::from(([127, 0, 0, 1], 7000 + i)))
            .collect();
        let owns: Vec<_> = (0..3)
            .map(|id| bench_ownership(id, &addrs, 2, 1).unwrap())
            .collect();
        use camelot_server::ownership::Role;
        for p in 0..REPLICATION_PARTITIONS {
            let roles: Vec<Role> = owns.iter().map(|o| o.role(p)).collect();
            assert_eq!(roles.iter().filter(|r| **r == Role::Primary).count(), 1);
            assert_eq!(roles.iter().filter(|r| **r == Role::Backup).count(), 1);
            let primary = roles.iter().position(|r| *r == Role::Primary).unwrap();
            let backup = roles.iter().position(|r| *r == Role::Backup).unwrap();
            let b: Vec<_> = owns[primary].backups(p).collect();
            assert_eq!(b.len(), 1);
            assert_eq!(b[0].addr, addrs[backup]);
        }
        let lone = bench_ownership(0, &addrs, 1, 1).unwrap();
        assert!(!lone.replicates());
    }

    #[test]
    fn key_sets_stay_within_their_bounds() {
        assert_eq!(keys_for(1 << 10), KEYS_MAX);
        assert_eq!(keys_for(1 << 20), 64);
        assert_eq!(keys_for(VALUE_BYTES_MAX), 64);
        assert_eq!(keys_for(u64::MAX), KEYS_MIN);
    }

    #[test]
    fn bad_configs_are_refused() {
        let ok = ThroughputConfig::default();
        assert!(ok.validate().is_ok());
        for bad in [
            ThroughputConfig {
                value_bytes: vec![],
                ..ok.clone()
            },
            ThroughputConfig {
                value_bytes: vec![VALUE_BYTES_MAX + 1],
                ..ok.clone()
            },
            ThroughputConfig {
                threads: 0,
                ..ok.clone()
            },
            ThroughputConfig {
                seconds_per_point: f64::NAN,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err());
        }
    }

    #[test]
    fn quick_is_a_subset_that_still_reaches_a_megabyte() {
        let mut q = ThroughputConfig::default();
        q.apply_quick();
        assert!(q.value_bytes.contains(&VALUE_BYTES_MAX));
        assert!(q.value_bytes.len() < ThroughputConfig::default().value_bytes.len());
        assert!(q.validate().is_ok());
    }
}
