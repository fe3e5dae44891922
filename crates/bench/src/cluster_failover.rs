//! `camelot bench cluster failover`: kill -9 a primary under a YCSB-A-like load with R=2
//! and measure what the controller's failover costs — each partition's unavailability
//! window (from its last successful operation before the kill to its first after), the
//! throughput in buckets through it, and the acknowledged writes lost, found by reading
//! back every key at the end (the targets: windows ≤ 2 × lease TTL + 100 ms, 0
//! lost).
//!
//! Everything runs as its own process: Debian's etcd, `camelot server --etcd` nodes, and
//! two `camelot cluster controller`s (a leader and a standby). The load is closed-loop
//! client threads (50 % GET, 50 % PUT, zipfian keys as YCSB's workload A), each thread the
//! only writer of its own keys, so it knows the last value acknowledged for each and the
//! check needs no cross-thread ordering: a read-back (or a GET during the run) older than
//! the last acknowledged PUT is a lost write.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use camelot_client::ClientConfig;
use camelot_results::output;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Series};
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::checks::{check_seconds, check_threads};
use crate::cluster_procs::ClusterProcs;
use crate::side::{CpuMeter, Placement};
use crate::ycsb::generators::{Distribution, KeyChooser};
use crate::BenchError;

/// Most client threads a run may ask for.
pub const THREADS_MAX: usize = 64;
/// Keys a run may load at most.
pub const KEYS_MAX: u64 = 1 << 22;
/// Longest the cluster may take, after the kill, to serve every partition again and to
/// restore R; past it the run fails rather than waits.
pub const RECOVERY_WAIT_MAX: Duration = Duration::from_secs(60);
/// Throughput buckets recorded at most (the run is bounded well within).
const BUCKETS_MAX: usize = 4096;
/// Keys per PUT_MANY while loading, and per GET_MANY while reading back.
const BATCH_KEYS: usize = 512;
/// The node killed: the primary of about a third of the partitions.
const VICTIM: u32 = 0;

#[derive(Debug, Clone)]
pub struct FailoverConfig {
    pub nodes: u32,
    pub replication: u32,
    pub partitions: u32,
    pub keys: u64,
    pub value_bytes: usize,
    /// Client threads, one request in flight each, sharing one client.
    pub threads: usize,
    /// Fraction of operations that are GETs (the rest PUTs): YCSB A is 0.5.
    pub read_fraction: f64,
    /// Load before the kill.
    pub warmup_secs: f64,
    /// Load after the cluster is whole again (every partition served, R restored).
    pub settle_secs: f64,
    /// Lease TTL of the servers' registrations and the controllers' candidacies.
    pub lease_ttl_secs: u64,
    pub bucket_ms: u64,
    pub quick: bool,
}

impl Default for FailoverConfig {
    fn default() -> Self {
        FailoverConfig {
            nodes: 3,
            replication: 2,
            partitions: 128,
            keys: 20_000,
            value_bytes: 1024,
            threads: 8,
            read_fraction: 0.5,
            warmup_secs: 3.0,
            settle_secs: 2.0,
            lease_ttl_secs: camelot_cluster::LEASE_TTL_DEFAULT.as_secs(),
            bucket_ms: 100,
            quick: false,
        }
    }
}

impl FailoverConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.partitions = 64;
        self.keys = 4_000;
        self.threads = 4;
        self.warmup_secs = 1.5;
        self.settle_secs = 1.0;
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if !(2..=16).contains(&self.nodes) {
            return Err(BenchError::InvalidConfig("nodes must be 2 to 16".into()));
        }
        if !(2..=self.nodes).contains(&self.replication) {
            return Err(BenchError::InvalidConfig(
                "replication must be 2 to the node count: a failover needs a backup".into(),
            ));
        }
        if !(1..=camelot_cluster::map::PARTITIONS_MAX).contains(&self.partitions) {
            return Err(BenchError::InvalidConfig("partitions out of range".into()));
        }
        check_threads(&[self.threads], THREADS_MAX)?;
        if self.keys < self.threads as u64 || self.keys > KEYS_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "keys must be the thread count to {KEYS_MAX}"
            )));
        }
        if !(32..=(1 << 20)).contains(&self.value_bytes) {
            return Err(BenchError::InvalidConfig(
                "value bytes must be 32 to 1 MiB".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.read_fraction) {
            return Err(BenchError::InvalidConfig(
                "read fraction must be 0 to 1".into(),
            ));
        }
        check_seconds("warmup seconds", self.warmup_secs)?;
        check_seconds("settle seconds", self.settle_secs)?;
        if !(1..=30).contains(&self.lease_ttl_secs) {
            return Err(BenchError::InvalidConfig(
                "lease TTL must be 1 to 30 s".into(),
            ));
        }
        if !(10..=1000).contains(&self.bucket_ms) {
            return Err(BenchError::InvalidConfig(
                "bucket must be 10 to 1000 ms".into(),
            ));
        }
        Ok(())
    }

    /// The ceiling on a partition's unavailability: 2 × lease TTL + 100 ms.
    pub fn target(&self) -> Duration {
        Duration::from_secs(2 * self.lease_ttl_secs) + Duration::from_millis(100)
    }
}

fn key_name(i: u64) -> String {
    format!("user{i}")
}

/// A value of `bytes` bytes that names its sequence number.
fn value(seq: u64, bytes: usize) -> Bytes {
    let mut v = format!("{seq}:").into_bytes();
    v.resize(bytes, b'x');
    Bytes::from(v)
}

fn seq_of(v: &[u8]) -> Option<u64> {
    let end = v.iter().position(|b| *b == b':')?;
    std::str::from_utf8(&v[..end]).ok()?.parse().ok()
}

/// Shared by the load threads: per partition the last success (µs since the start) and
/// the first success after the kill, and ops per bucket.
struct Clock {
    t0: Instant,
    last_ok_us: Vec<AtomicU64>,
    first_after_us: Vec<AtomicU64>,
    killed_us: AtomicU64,
    buckets: Vec<AtomicU64>,
    bucket_us: u64,
}

impl Clock {
    fn ok(&self, partition: usize) {
        let now = self.t0.elapsed().as_micros() as u64;
        if let Some(a) = self.last_ok_us.get(partition) {
            a.fetch_max(now, Ordering::Relaxed);
        }
        if now > self.killed_us.load(Ordering::Relaxed) {
            if let Some(a) = self.first_after_us.get(partition) {
                a.fetch_min(now, Ordering::Relaxed);
            }
        }
        let b = (now / self.bucket_us) as usize;
        if let Some(a) = self.buckets.get(b) {
            a.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What one load thread saw.
#[derive(Default)]
struct ThreadTally {
    gets: u64,
    puts_acked: u64,
    failed: u64,
    /// GETs that returned a value older than one this thread had seen acknowledged.
    stale_reads: u64,
    /// Per local key: (last acknowledged seq, highest seq attempted).
    book: Vec<(u64, u64)>,
}

pub fn run_failover(cfg: &FailoverConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let Placement::Separate { binary } = Placement::choose(false)? else {
        return Err(BenchError::InvalidConfig(
            "the failover bench kills server processes: it needs separate ones".into(),
        ));
    };
    let server_args =
        vec![vec!["--replication-timeout-ms".to_string(), "500".into()]; cfg.nodes as usize];
    let memory = format!(
        "{}M",
        ((cfg.keys * (cfg.value_bytes as u64 + 256) * 3) >> 20).max(64)
    );
    let mut procs = ClusterProcs::start(&binary, &memory, cfg.lease_ttl_secs, &server_args)?;
    let map = procs.publish_initial(cfg.partitions, cfg.replication)?;
    let commands = procs.server_commands();
    for name in ["a", "b"] {
        let i = procs.start_controller(&format!("bench-{name}"), cfg.lease_ttl_secs, &[])?;
        let needle = if i == 0 { "leader" } else { "campaigning" };
        procs.wait_controller_line(i, needle, Duration::from_secs(20))?;
    }
    let client = procs.client(ClientConfig {
        request_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    })?;

    // Load every key at sequence 0.
    let mut i = 0;
    while i < cfg.keys {
        let end = (i + BATCH_KEYS as u64).min(cfg.keys);
        let pairs: Vec<(String, Bytes)> = (i..end)
            .map(|k| (key_name(k), value(0, cfg.value_bytes)))
            .collect();
        client.put_many(&pairs)?;
        i = end;
    }

    let clock = Arc::new(Clock {
        t0: Instant::now(),
        last_ok_us: (0..cfg.partitions).map(|_| AtomicU64::new(0)).collect(),
        first_after_us: (0..cfg.partitions)
            .map(|_| AtomicU64::new(u64::MAX))
            .collect(),
        killed_us: AtomicU64::new(u64::MAX),
        buckets: (0..BUCKETS_MAX).map(|_| AtomicU64::new(0)).collect(),
        bucket_us: cfg.bucket_ms * 1000,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let threads = cfg.threads as u64;
    let keys_per_thread = cfg.keys / threads;
    let victim_parts: Vec<u32> = (0..cfg.partitions)
        .filter(|p| map.primary(*p) == Some(VICTIM))
        .collect();
    let cpu = CpuMeter::start(procs.server_pids());

    let (tallies, timeline) = std::thread::scope(|s| -> Result<_, BenchError> {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (client, clock, stop) = (&client, clock.clone(), stop.clone());
                let cfg = cfg.clone();
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(0xfa11_0000 + t);
                    let mut chooser = KeyChooser::new(Distribution::Zipfian, keys_per_thread, 0);
                    let mut tally = ThreadTally {
                        book: vec![(0, 0); keys_per_thread as usize],
                        ..ThreadTally::default()
                    };
                    let mut seq = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let local = chooser.next(&mut rng, keys_per_thread - 1);
                        let key = key_name(local * threads + t);
                        let p =
                            camelot_proto::partition_of(key.as_bytes(), cfg.partitions) as usize;
                        let slot = local as usize;
                        let ok = if rng.gen::<f64>() < cfg.read_fraction {
                            let acked = tally.book[slot].0;
                            match client.get(key.as_bytes()) {
                                Ok(got) => {
                                    tally.gets += 1;
                                    let v = got.and_then(|v| seq_of(&v.value));
                                    if v.is_none_or(|v| v < acked) {
                                        tally.stale_reads += 1;
                                    }
                                    true
                                }
                                Err(_) => false,
                            }
                        } else {
                            seq += 1;
                            tally.book[slot].1 = seq;
                            match client.put(key.as_bytes(), value(seq, cfg.value_bytes)) {
                                Ok(_) => {
                                    tally.book[slot].0 = seq;
                                    tally.puts_acked += 1;
                                    true
                                }
                                Err(_) => false,
                            }
                        };
                        if ok {
                            clock.ok(p);
                        } else {
                            tally.failed += 1;
                            // A dead node brings no MOVED: look for a newer map.
                            let _ = client.refresh_map();
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                    tally
                })
            })
            .collect();
        let timeline = drive_kill(cfg, &mut procs, &clock, &victim_parts);
        stop.store(true, Ordering::Relaxed);
        let tallies: Vec<ThreadTally> = workers
            .into_iter()
            .map(|w| {
                w.join()
                    .map_err(|_| BenchError::Setup("a load thread panicked".into()))
            })
            .collect::<Result<_, _>>()?;
        Ok((tallies, timeline?))
    })?;
    let server_cpu_seconds = cpu.seconds();

    // Read every key back: the last acknowledged PUT or a later attempt, never older.
    let mut lost = 0u64;
    let mut lost_examples = Vec::new();
    for (t, tally) in tallies.iter().enumerate() {
        let keys: Vec<String> = (0..keys_per_thread)
            .map(|l| key_name(l * threads + t as u64))
            .collect();
        for (chunk_no, chunk) in keys.chunks(BATCH_KEYS).enumerate() {
            let got = client.get_many(chunk)?;
            for (j, v) in got.iter().enumerate() {
                let (acked, attempted) = tally.book[chunk_no * BATCH_KEYS + j];
                let seq = v.as_ref().and_then(|v| seq_of(&v.value));
                if !seq.is_some_and(|s| s >= acked && s <= attempted.max(acked)) {
                    lost += 1;
                    if lost_examples.len() < 5 {
                        lost_examples.push(format!(
                            "{}: acked {acked}, attempted {attempted}, read {seq:?}",
                            chunk[j]
                        ));
                    }
                }
            }
        }
    }
    let puts_acked: u64 = tallies.iter().map(|t| t.puts_acked).sum();
    let gets: u64 = tallies.iter().map(|t| t.gets).sum();
    let failed: u64 = tallies.iter().map(|t| t.failed).sum();
    let stale_reads: u64 = tallies.iter().map(|t| t.stale_reads).sum();
    let controller_lines: Vec<String> = (0..2)
        .filter_map(|i| procs.controller(i))
        .flat_map(|c| c.lines())
        .filter(|l| l.contains("epoch") || l.contains("leader") || l.contains("copy"))
        .take(40)
        .collect();

    // Windows, per partition: last success before the kill → first after.
    let window_ms = |p: u32| -> f64 {
        let before = timeline.before_us[p as usize];
        let after = clock.first_after_us[p as usize].load(Ordering::Relaxed);
        after.saturating_sub(before) as f64 / 1e3
    };
    let mut promoted: Vec<f64> = victim_parts.iter().map(|p| window_ms(*p)).collect();
    promoted.sort_by(f64::total_cmp);
    let mut others: Vec<f64> = (0..cfg.partitions)
        .filter(|p| !victim_parts.contains(p))
        .map(window_ms)
        .collect();
    others.sort_by(f64::total_cmp);
    let pct = |v: &[f64], q: f64| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v[((v.len() - 1) as f64 * q).round() as usize]
    };
    let worst = promoted.last().copied().unwrap_or(0.0);
    let target_ms = cfg.target().as_secs_f64() * 1e3;

    let bucket_secs = cfg.bucket_ms as f64 / 1e3;
    let kill_bucket = (timeline.killed_us / (cfg.bucket_ms * 1000)) as usize;
    let end_bucket = (timeline.end_us / (cfg.bucket_ms * 1000)) as usize;
    let mut tput = Series::new("throughput (all partitions)");
    for b in 0..end_bucket.min(BUCKETS_MAX) {
        let mut p = Point::new((b as f64 - kill_bucket as f64) * bucket_secs);
        p.ops_per_sec = Some(clock.buckets[b].load(Ordering::Relaxed) as f64 / bucket_secs);
        tput.points.push(p);
    }
    let pre: Vec<f64> = (kill_bucket.saturating_sub((cfg.warmup_secs / bucket_secs) as usize / 2)
        ..kill_bucket)
        .map(|b| clock.buckets[b].load(Ordering::Relaxed) as f64 / bucket_secs)
        .collect();
    let pre_kill_ops_per_sec = pre.iter().sum::<f64>() / pre.len().max(1) as f64;
    let mut windows = Series::new("unavailability of the killed node's partitions");
    for (rank, w) in promoted.iter().enumerate() {
        let mut p = Point::new(rank as u64);
        p.extra.insert("window_ms".into(), json!(w));
        windows.points.push(p);
    }

    let config = json!({
        "x": "seconds since the kill",
        "nodes": cfg.nodes,
        "replication": cfg.replication,
        "partitions": cfg.partitions,
        "keys": cfg.keys,
        "value_bytes": cfg.value_bytes,
        "threads": cfg.threads,
        "read_fraction": cfg.read_fraction,
        "key_distribution": "zipfian (YCSB scrambled), each thread the only writer of its keys",
        "warmup_secs": cfg.warmup_secs,
        "settle_secs": cfg.settle_secs,
        "lease_ttl_secs": cfg.lease_ttl_secs,
        "bucket_ms": cfg.bucket_ms,
        "quick": cfg.quick,
        "killed": format!("node {VICTIM} (SIGKILL), primary of {} of {} partitions", victim_parts.len(), cfg.partitions),
        "controllers": "2 processes (a leader and a standby), tick 50 ms",
        "replication_timeout_ms": 500,
        "server_commands": commands,
        "client": "camelot-client (blocking), map from etcd, refreshed on MOVED/STALE_EPOCH and after any failed call",
        "lease_gone_after_kill_ms": timeline.lease_gone_ms,
        "failover_published_after_kill_ms": timeline.published_ms,
        "rereplicated_after_kill_ms": timeline.whole_ms,
        "promoted_window_ms": {"max": worst, "p50": pct(&promoted, 0.5), "p99": pct(&promoted, 0.99), "count": promoted.len()},
        "backup_lost_window_ms": {"max": others.last().copied().unwrap_or(0.0), "p50": pct(&others, 0.5), "count": others.len()},
        "target_window_ms": target_ms,
        "pre_kill_ops_per_sec": pre_kill_ops_per_sec,
        "gets": gets,
        "puts_acked": puts_acked,
        "failed_ops": failed,
        "stale_reads": stale_reads,
        "acknowledged_writes_lost": lost,
        "lost_examples": lost_examples,
        "server_cpu_seconds": server_cpu_seconds,
        "controller_log": controller_lines,
    });
    let mut result = BenchResult::new("cluster-failover", started, config, vec![tput, windows]);
    result.comparisons.push(
        Comparison::new(
            "worst unavailability of a promoted partition",
            worst,
            target_ms,
            "ms",
            format!("target: 2 × lease TTL ({} s) + 100 ms", cfg.lease_ttl_secs),
        )
        .with_target(1.0, true),
    );
    result.comparisons.push(
        Comparison::new(
            "acknowledged writes lost (read back)",
            lost as f64,
            puts_acked.max(1) as f64,
            "writes",
            "writes acknowledged",
        )
        .with_target(0.0, true),
    );
    let figure = Figure::new("cluster-failover")
        .panel(
            Panel::new(
                "throughput through the kill",
                "seconds since the kill",
                "ops/s",
            )
            .line("YCSB-A-like, R=2", tput_points(&result.series[0])),
        )
        .panel(
            Panel::new("unavailability per partition", "partition (sorted)", "ms")
                .line(
                    "killed node's partitions",
                    promoted
                        .iter()
                        .enumerate()
                        .map(|(i, w)| (i as f64, *w))
                        .collect(),
                )
                .reference("target", target_ms),
        );
    if lost > 0 || stale_reads > 0 {
        // Still written, so the run can be read; but the bench fails.
        output::write_result_with_figure(out, &result, &figure)?;
        return Err(BenchError::Check(format!(
            "{lost} acknowledged write(s) lost, {stale_reads} stale read(s): {lost_examples:?}"
        )));
    }
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}

fn tput_points(s: &Series) -> Vec<(f64, f64)> {
    s.points
        .iter()
        .filter_map(|p| Some((p.x.as_f64()?, p.ops_per_sec?)))
        .collect()
}

/// When things happened, in µs since the load's start (and ms after the kill).
struct Timeline {
    killed_us: u64,
    end_us: u64,
    before_us: Vec<u64>,
    lease_gone_ms: f64,
    published_ms: f64,
    whole_ms: f64,
}

/// Warm up, kill the victim, follow the failover to the end, settle.
fn drive_kill(
    cfg: &FailoverConfig,
    procs: &mut ClusterProcs,
    clock: &Clock,
    victim_parts: &[u32],
) -> Result<Timeline, BenchError> {
    std::thread::sleep(Duration::from_secs_f64(cfg.warmup_secs));
    let before_us: Vec<u64> = clock
        .last_ok_us
        .iter()
        .map(|a| a.load(Ordering::Relaxed))
        .collect();
    let killed_us = clock.t0.elapsed().as_micros() as u64;
    clock.killed_us.store(killed_us, Ordering::Relaxed);
    let killed = Instant::now();
    procs.kill_server(VICTIM)?;
    let ms = |t: Instant| t.duration_since(killed).as_secs_f64() * 1e3;
    let mut lease_gone = None;
    let mut published = None;
    let mut whole = None;
    procs.wait("the failover", RECOVERY_WAIT_MAX, || {
        if lease_gone.is_none() && !procs.live()?.iter().any(|n| n.id == VICTIM) {
            lease_gone = Some(Instant::now());
        }
        let m = procs.map()?;
        let names_victim = m.assignment.iter().any(|s| s.contains(&VICTIM));
        if published.is_none() && !names_victim {
            published = Some(Instant::now());
        }
        if whole.is_none()
            && !names_victim
            && m.syncing.is_empty()
            && m.assignment
                .iter()
                .all(|s| s.len() == cfg.replication as usize)
        {
            whole = Some(Instant::now());
        }
        let served = (0..cfg.partitions)
            .all(|p| clock.first_after_us[p as usize].load(Ordering::Relaxed) != u64::MAX);
        Ok(whole.is_some() && served)
    })?;
    let _ = victim_parts;
    std::thread::sleep(Duration::from_secs_f64(cfg.settle_secs));
    Ok(Timeline {
        killed_us,
        end_us: clock.t0.elapsed().as_micros() as u64,
        before_us,
        lease_gone_ms: lease_gone.map_or(f64::NAN, ms),
        published_ms: published.map_or(f64::NAN, ms),
        whole_ms: whole.map_or(f64::NAN, ms),
    })
}
