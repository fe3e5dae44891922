//! `camelot bench cluster …`. `throughput` is seed 004's single-node throughput against
//! value size: one `camelot server`, the client's key-value API (GET and PUT, several
//! threads on one client), value sizes 1 KiB..1 MiB, with an iperf3 loopback stream in the
//! same run beside, since at 1 MiB the seed's server was bound by the network.

use crate::side::{CamelotNodes, CamelotSpec, Placement};
use crate::BenchError;
use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_results::output;
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
        if self.threads == 0 || self.threads > THREADS_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "threads must be 1 to {THREADS_MAX}"
            )));
        }
        if !(self.seconds_per_point.is_finite() && self.seconds_per_point > 0.0) {
            return Err(BenchError::InvalidConfig(
                "seconds per point must be positive".into(),
            ));
        }
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
        let (put_ops, put_bytes) =
            drive(&client, Op::Put, size, cfg.threads, cfg.seconds_per_point)?;
        let (get_ops, get_bytes) =
            drive(&client, Op::Get, size, cfg.threads, cfg.seconds_per_point)?;
        for (series, ops, bytes) in [
            (&mut puts, put_ops, put_bytes),
            (&mut gets, get_ops, get_bytes),
        ] {
            let mut p = Point::new(size);
            p.ops_per_sec = Some(ops);
            p.bytes_per_sec = Some(bytes);
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
    node.stop()?;
    let iperf = if cfg.peer_seconds > 0 {
        Some(crate::peers::iperf3_tcp_stream(Duration::from_secs(
            cfg.peer_seconds,
        ))?)
    } else {
        None
    };
    let config = json!({
        "x": "value_bytes",
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
    Ok(output::write_result(out, &result)?)
}

#[cfg(test)]
mod tests {
    use super::*;

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
