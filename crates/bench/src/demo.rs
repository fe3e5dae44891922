//! `camelot demo`: the main job on the embedded default. A 3-node cluster in this process,
//! a short mixed workload across all three nodes, a summary a person can read. It is a
//! tour, not a comparison, so its servers stay in process, and the summary says so.

use crate::hw::limits::{Against, Limits};
use crate::side::{CamelotSpec, Placement};
use crate::workload::{self, LoadSpec, Mix, Target};
use crate::BenchError;
use camelot_client::Client;
use std::fmt::Write as _;
use std::time::Instant;

pub const DEMO_NODES: usize = 3;
const REGION_BYTES: u64 = 16 << 20;
const DEPTH: usize = 8;
const SIZES_BYTES: [u32; 4] = [64, 1024, 4096, 16384];

pub struct DemoConfig {
    pub requests: u64,
    pub threads: usize,
    /// This machine's limits: the summary then reads throughput and latency against them.
    pub limits: Option<Limits>,
}

/// Runs the demo and returns its summary. Fails if any request fails or a check does not
/// hold (counters, read-back data).
pub fn run(cfg: &DemoConfig) -> Result<String, BenchError> {
    if cfg.requests == 0 {
        return Err(BenchError::InvalidConfig(
            "the demo needs at least one request".into(),
        ));
    }
    let t0 = Instant::now();
    let placement = Placement::InProcess;
    let spec = CamelotSpec::new(DEMO_NODES, REGION_BYTES + (1 << 20));
    let target = Target::start(&spec, &placement)?;
    let client = target.connect(true)?;
    let regions = workload::regions_on_every_node(&client, REGION_BYTES)?;
    let load = LoadSpec {
        threads: cfg.threads,
        depth: DEPTH,
        requests: cfg.requests,
        min_duration: std::time::Duration::ZERO,
        mix: Mix {
            reads_percent: 60,
            fetch_add_percent: 10,
        },
        sizes_bytes: SIZES_BYTES.to_vec(),
        pin: false,
        event_loop: false,
        seed: 2026,
    };
    let m = workload::run_load(&client, &regions, &load, None)?;

    // Checks: every FETCH_ADD counted exactly once, and data written to each node reads
    // back as written.
    let counted = workload::counters_total(&client, &regions)?;
    if counted != m.fetch_adds {
        return Err(BenchError::Check(format!(
            "the counters add up to {counted}, but {} FETCH_ADDs were answered",
            m.fetch_adds
        )));
    }
    check_read_back(&client, &regions)?;
    let per_node = target.dev_stats().unwrap_or_default();
    workload::free_all(&client, &regions)?;
    drop(client);
    target.close()?;

    let l = m.latency.summary();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {DEMO_NODES} memory servers on loopback in this process, {} client threads × \
         {DEPTH} requests in flight, batched",
        placement.label("camelot demo"),
        cfg.threads
    );
    let _ = writeln!(
        s,
        "  workload   {} requests: {} reads, {} writes ({}–{} B), {} FETCH_ADDs",
        m.requests,
        m.reads,
        m.writes,
        SIZES_BYTES[0],
        SIZES_BYTES[SIZES_BYTES.len() - 1],
        m.fetch_adds
    );
    let _ = writeln!(
        s,
        "  throughput {:.0} ops/s, {:.3} GB/s over {:.2} s",
        m.ops_per_sec(),
        m.bytes_per_sec() / 1e9,
        m.elapsed.as_secs_f64()
    );
    let _ = writeln!(
        s,
        "  latency    p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
        l.p50, l.p99, l.max
    );
    if let Some(limits) = &cfg.limits {
        let read = [
            ("throughput", Against::TcpStream, m.bytes_per_sec()),
            ("p50", Against::TcpPingpongP50, l.p50),
        ]
        .into_iter()
        .filter_map(|(what, a, v)| Some(format!("{what} = {}", limits.describe(a, v)?)))
        .collect::<Vec<_>>();
        if !read.is_empty() {
            let _ = writeln!(s, "  vs limits  {}", read.join("; "));
        }
    }
    for (i, stats) in per_node.iter().enumerate() {
        let get = |k: &str| stats.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
        let ops: u64 = stats
            .iter()
            .filter(|(n, _)| n.starts_with("ops_"))
            .map(|(_, v)| v)
            .sum();
        let _ = writeln!(
            s,
            "  node {i}     {ops} ops in {} batches ({:.1} ops per batch)",
            get("batches"),
            ops as f64 / get("batches").max(1) as f64
        );
    }
    let _ = writeln!(
        s,
        "  checks     counters match {counted} FETCH_ADDs; data reads back intact on all \
         {DEMO_NODES} nodes"
    );
    let _ = writeln!(s, "  done in {:.2} s", t0.elapsed().as_secs_f64());
    Ok(s)
}

fn check_read_back(client: &Client, regions: &[camelot_client::Region]) -> Result<(), BenchError> {
    for (i, r) in regions.iter().enumerate() {
        let data: Vec<u8> = (0..4096u32)
            .map(|j| (j as u8) ^ (i as u8).wrapping_mul(37))
            .collect();
        let offset = r.size - 4096;
        client.write(r, offset, data.clone())?;
        let back = client.read(r, offset, 4096)?;
        if back[..] != data[..] {
            return Err(BenchError::Check(format!(
                "node {} returned different bytes than were written",
                r.node
            )));
        }
    }
    Ok(())
}
