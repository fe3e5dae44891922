//! `camelot bench raid …`: block volumes (seed 000's RAID figures, issue 17).
//!
//! - `encode`: GB/s of parity and Reed–Solomon encode and decode on one core, no network.
//!   Every decode is checked against the data it must restore, so neither the compiler
//!   nor a broken codec can flatter the figure.
//! - `compare` (seed 000's *RaidComparison*): raid0, raid1, raid4, raid5 and rs:4+2 over
//!   real servers — full-stripe write, 4 KiB random write, 4 KiB random read, the same
//!   read with one member's server killed, and memory overhead — with the target
//!   ratios against raid0 (and against the normal read) in `comparisons`. Every member is
//!   a server of its own, so one can be killed; every read is checked.

use crate::checks::{check_seconds, check_threads};
use crate::hw::{best_of, compiled_simd};
use crate::side::{
    camelot_side, cpu_extra, CamelotNodes, CamelotSpec, ClientSide, CpuMeter, Placement,
};
use crate::BenchError;
use camelot_blocks::layout::Code;
use camelot_blocks::parity::Codec;
use camelot_blocks::{Level, Volume, VolumeConfig};
use camelot_results::output;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Series};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most threads a raid bench drives.
pub const THREADS_MAX: usize = 64;
/// Repeats per encode point; the best is reported (the machine is shared).
const ENCODE_REPEATS: usize = 3;

#[derive(Debug, Clone)]
pub struct EncodeConfig {
    /// Chunk sizes (bytes) to encode at.
    pub chunk_bytes: Vec<u64>,
    pub seconds_per_point: f64,
    pub quick: bool,
}

impl Default for EncodeConfig {
    fn default() -> Self {
        EncodeConfig {
            chunk_bytes: vec![4 << 10, 64 << 10, 1 << 20],
            seconds_per_point: 1.0,
            quick: false,
        }
    }
}

impl EncodeConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.seconds_per_point = self.seconds_per_point.min(0.15);
        self.chunk_bytes = vec![64 << 10];
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if self.chunk_bytes.is_empty()
            || self
                .chunk_bytes
                .iter()
                .any(|&c| !c.is_power_of_two() || !(64..=(16 << 20)).contains(&c))
        {
            return Err(BenchError::InvalidConfig(
                "chunk sizes are powers of two from 64 B to 16 MiB".into(),
            ));
        }
        check_seconds("seconds per point", self.seconds_per_point)?;
        Ok(())
    }
}

/// A volume of fewer than four stripes (of up to four data chunks) leaves a random load
/// nothing to spread over.
fn check_holds_stripes(volume_bytes: u64, chunk_bytes: u64) -> Result<(), BenchError> {
    if volume_bytes < 4 * chunk_bytes * 4 {
        return Err(BenchError::InvalidConfig(
            "the volume must hold a few stripes".into(),
        ));
    }
    Ok(())
}

/// The codecs `encode` measures: (label, codec, slots lost for the decode).
fn encode_codecs() -> Vec<(&'static str, Codec, usize)> {
    vec![
        (
            "xor (raid5 4+1)",
            Codec {
                code: Code::Xor,
                k: 4,
                m: 1,
            },
            1,
        ),
        (
            "rs:4+2",
            Codec {
                code: Code::Rs,
                k: 4,
                m: 2,
            },
            2,
        ),
        (
            "rs:8+3",
            Codec {
                code: Code::Rs,
                k: 8,
                m: 3,
            },
            3,
        ),
    ]
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

/// Data bytes encoded (or restored from) per second over `seconds`.
fn encode_rate(codec: Codec, chunk: usize, seconds: f64) -> Result<f64, BenchError> {
    let data: Vec<Vec<u8>> = (0..codec.k)
        .map(|i| pseudo_random(chunk, i as u64))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    let mut parity = vec![Vec::new(); codec.m];
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut stripes = 0u64;
    while Instant::now() < deadline {
        for _ in 0..8 {
            codec
                .encode(&refs, &mut parity)
                .map_err(|e| BenchError::Check(e.to_string()))?;
            stripes += 1;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    // The parity must rebuild the data: a codec that skipped work fails here.
    let mut slots: Vec<Option<Vec<u8>>> = data
        .iter()
        .cloned()
        .chain(parity.iter().cloned())
        .map(Some)
        .collect();
    slots[0] = None;
    codec
        .reconstruct(&mut slots)
        .map_err(|e| BenchError::Check(e.to_string()))?;
    if slots[0].as_deref() != Some(&data[0][..]) {
        return Err(BenchError::Check(
            "encoded parity does not restore the data".into(),
        ));
    }
    Ok((stripes * (codec.k * chunk) as u64) as f64 / elapsed)
}

/// Data bytes of stripes reconstructed per second, with `lost` data slots missing.
fn decode_rate(codec: Codec, chunk: usize, lost: usize, seconds: f64) -> Result<f64, BenchError> {
    let data: Vec<Vec<u8>> = (0..codec.k)
        .map(|i| pseudo_random(chunk, 100 + i as u64))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    let mut parity = vec![Vec::new(); codec.m];
    codec
        .encode(&refs, &mut parity)
        .map_err(|e| BenchError::Check(e.to_string()))?;
    let mut slots: Vec<Option<Vec<u8>>> = data
        .iter()
        .cloned()
        .chain(parity.iter().cloned())
        .map(Some)
        .collect();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut stripes = 0u64;
    while Instant::now() < deadline {
        // Lose the first `lost` data slots; the survivors stay where they are, as a
        // degraded read holds them.
        for s in slots.iter_mut().take(lost.min(codec.k)) {
            *s = None;
        }
        codec
            .reconstruct(&mut slots)
            .map_err(|e| BenchError::Check(e.to_string()))?;
        if slots[0].as_deref() != Some(&data[0][..]) {
            return Err(BenchError::Check("decode restored wrong bytes".into()));
        }
        stripes += 1;
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok((stripes * (codec.k * chunk) as u64) as f64 / elapsed)
}

/// Runs `bench raid encode`: writes `raid-encode.json` and its figure.
pub fn run_encode(cfg: &EncodeConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let per = cfg.seconds_per_point / ENCODE_REPEATS as f64;
    let mut series = Vec::new();
    let mut rs42_encode_best = None;
    for (label, codec, lost) in encode_codecs() {
        let mut enc = Series::new(format!("{label} encode"));
        let mut dec = Series::new(format!("{label} decode ({lost} lost)"));
        for &chunk in &cfg.chunk_bytes {
            let chunk = chunk as usize;
            let e: Vec<f64> = (0..ENCODE_REPEATS)
                .map(|_| encode_rate(codec, chunk, per))
                .collect::<Result<_, _>>()?;
            let d: Vec<f64> = (0..ENCODE_REPEATS)
                .map(|_| decode_rate(codec, chunk, lost, per))
                .collect::<Result<_, _>>()?;
            let (e, d) = (best_of(&e).unwrap_or(0.0), best_of(&d).unwrap_or(0.0));
            if label == "rs:4+2" && chunk == 64 << 10 {
                rs42_encode_best = Some(e);
            }
            let mut p = Point::new(chunk as u64 / 1024);
            p.bytes_per_sec = Some(e);
            p.extra.insert("gb_per_s".into(), json!(e / 1e9));
            enc.points.push(p);
            let mut p = Point::new(chunk as u64 / 1024);
            p.bytes_per_sec = Some(d);
            p.extra.insert("gb_per_s".into(), json!(d / 1e9));
            dec.points.push(p);
        }
        series.push(enc);
        series.push(dec);
    }
    let config = json!({
        "x": "chunk (KiB)",
        "chunk_bytes": cfg.chunk_bytes,
        "seconds_per_point": cfg.seconds_per_point,
        "repeats": ENCODE_REPEATS,
        "reported": "best of the repeats, one thread, data bytes per second",
        "rs_crate": "reed-solomon-simd 3 (SIMD picked at run time)",
        "xor": "64-byte blocks the compiler vectorises",
        "compiled_simd": compiled_simd(),
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("raid-encode", started, config, series);
    if let Some(rate) = rs42_encode_best {
        result.comparisons.push(
            Comparison::new(
                "rs:4+2 encode, 64 KiB chunks, one core",
                rate,
                RS42_ENCODE_TARGET_BYTES_PER_S,
                "B/s",
                "issue 17's floor (5 GB/s per core)",
            )
            .with_target(1.0, false),
        );
    }
    let fig = Figure::new("RAID parity and Reed–Solomon: encode and decode, one core").panel(
        result.series.iter().fold(
            Panel::new("encode / decode", "chunk (KiB)", "GB/s").log_x(),
            |panel, s| {
                panel.line(
                    &s.label,
                    camelot_results::plot::series_points(s, |p| p.bytes_per_sec.map(|v| v / 1e9)),
                )
            },
        ),
    );
    Ok(output::write_result_with_figure(out, &result, &fig)?)
}

/// The floor for RS(4+2) encode on one core.
pub const RS42_ENCODE_TARGET_BYTES_PER_S: f64 = 5e9;

#[derive(Debug, Clone)]
pub struct CompareConfig {
    pub threads: usize,
    pub chunk_bytes: u64,
    /// Volume size (data bytes).
    pub volume_bytes: u64,
    pub seconds_per_point: f64,
    /// Seconds iperf3 streams beside the volumes (0: no iperf3).
    pub peer_seconds: u64,
    pub in_process: bool,
    pub quick: bool,
}

impl Default for CompareConfig {
    fn default() -> Self {
        CompareConfig {
            threads: 4,
            chunk_bytes: 64 << 10,
            volume_bytes: 256 << 20,
            seconds_per_point: 2.0,
            peer_seconds: 2,
            in_process: false,
            quick: false,
        }
    }
}

impl CompareConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.volume_bytes = 16 << 20;
        self.seconds_per_point = 0.3;
        self.threads = self.threads.min(2);
        self.peer_seconds = self.peer_seconds.min(1);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        check_threads(&[self.threads], THREADS_MAX)?;
        check_seconds("seconds per point", self.seconds_per_point)?;
        check_holds_stripes(self.volume_bytes, self.chunk_bytes)
    }
}

/// The levels `compare` measures, each with four data chunks a stripe (raid1: a 2-way
/// mirror), so a full stripe moves the same data everywhere.
fn compare_levels() -> Vec<(Level, usize)> {
    vec![
        (Level::Raid0, 4),
        (Level::Raid1, 2),
        (Level::Raid4, 5),
        (Level::Raid5, 5),
        (Level::Rs { k: 4, m: 2 }, 6),
    ]
}

#[derive(Clone, Copy, PartialEq)]
enum Load {
    FullStripeWrite,
    RandomWrite4k,
    RandomRead4k,
    /// Each thread writes whole stripes in order from its own starting point.
    SeqWrite,
    /// Each thread reads 1 MiB at a time in order from its own starting point.
    SeqRead,
    /// Half 4 KiB random reads, half 4 KiB random writes (YCSB A's mix on blocks).
    Mixed4k,
}

impl Load {
    fn label(self) -> &'static str {
        match self {
            Load::FullStripeWrite => "full-stripe write",
            Load::RandomWrite4k => "4 KiB random write",
            Load::RandomRead4k => "4 KiB random read",
            Load::SeqWrite => "sequential write",
            Load::SeqRead => "sequential read",
            Load::Mixed4k => "4 KiB 50/50 read/write",
        }
    }
}

/// Bytes a sequential read asks for at a time.
const SEQ_READ_BYTES: u64 = 1 << 20;

/// Runs `threads` closed-loop threads of `load` for `seconds`; returns (ops/s, B/s).
/// Reads are checked against the pattern `fill` wrote.
fn drive(
    vol: &Arc<Volume>,
    load: Load,
    threads: usize,
    seconds: f64,
) -> Result<(f64, f64), BenchError> {
    drive_while(vol, load, threads, &|elapsed| elapsed < seconds)
}

/// [`drive`] for as long as `keep_going(seconds elapsed)` says.
fn drive_while(
    vol: &Arc<Volume>,
    load: Load,
    threads: usize,
    keep_going: &dyn Fn(f64) -> bool,
) -> Result<(f64, f64), BenchError> {
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (vol, stop, ops, bytes) = (vol.clone(), stop.clone(), ops.clone(), bytes.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut rng = SmallRng::seed_from_u64(t as u64 + 1);
                let stripe = vol.layout().stripe_data_bytes();
                let stripes = vol.layout().stripes;
                let blocks = vol.capacity_bytes() / 4096;
                let mut full = vec![0u8; stripe as usize];
                let mut buf = vec![0u8; 4096];
                let mut big = vec![0u8; SEQ_READ_BYTES.min(vol.capacity_bytes()) as usize];
                let mut next_stripe = stripes * t as u64 / threads as u64;
                let mut next_read = (vol.capacity_bytes() * t as u64 / threads as u64)
                    / SEQ_READ_BYTES
                    * SEQ_READ_BYTES;
                while !stop.load(Ordering::Relaxed) {
                    match load {
                        Load::SeqWrite => {
                            let s = next_stripe % stripes;
                            next_stripe += 1;
                            for (i, block) in full.chunks_mut(4096).enumerate() {
                                block.fill(pattern(s * stripe / 4096 + i as u64));
                            }
                            vol.write(s * stripe, &full).map_err(|e| e.to_string())?;
                            bytes.fetch_add(stripe, Ordering::Relaxed);
                        }
                        Load::SeqRead => {
                            if next_read + big.len() as u64 > vol.capacity_bytes() {
                                next_read = 0;
                            }
                            vol.read(next_read, &mut big).map_err(|e| e.to_string())?;
                            for (i, block) in big.chunks(4096).enumerate() {
                                let b = next_read / 4096 + i as u64;
                                if block.iter().any(|&x| x != pattern(b)) {
                                    return Err(format!("block {b} read back wrong"));
                                }
                            }
                            bytes.fetch_add(big.len() as u64, Ordering::Relaxed);
                            next_read += big.len() as u64;
                        }
                        Load::FullStripeWrite => {
                            let s = rng.gen_range(0..stripes);
                            // The same pattern `fill` wrote, so later reads can check it.
                            for (i, block) in full.chunks_mut(4096).enumerate() {
                                block.fill(pattern(s * stripe / 4096 + i as u64));
                            }
                            vol.write(s * stripe, &full).map_err(|e| e.to_string())?;
                            bytes.fetch_add(stripe, Ordering::Relaxed);
                        }
                        Load::RandomWrite4k => {
                            let b = rng.gen_range(0..blocks);
                            buf.iter_mut().for_each(|x| *x = pattern(b));
                            vol.write(b * 4096, &buf).map_err(|e| e.to_string())?;
                            bytes.fetch_add(4096, Ordering::Relaxed);
                        }
                        Load::Mixed4k if rng.gen_bool(0.5) => {
                            let b = rng.gen_range(0..blocks);
                            buf.iter_mut().for_each(|x| *x = pattern(b));
                            vol.write(b * 4096, &buf).map_err(|e| e.to_string())?;
                            bytes.fetch_add(4096, Ordering::Relaxed);
                        }
                        Load::RandomRead4k | Load::Mixed4k => {
                            let b = rng.gen_range(0..blocks);
                            vol.read(b * 4096, &mut buf).map_err(|e| e.to_string())?;
                            if buf.iter().any(|&x| x != pattern(b)) {
                                return Err(format!("block {b} read back wrong"));
                            }
                            bytes.fetch_add(4096, Ordering::Relaxed);
                        }
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    while keep_going(started.elapsed().as_secs_f64()) && !workers.iter().any(|w| w.is_finished()) {
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join()
            .map_err(|_| BenchError::Check("a raid worker panicked".into()))?
            .map_err(BenchError::Check)?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok((
        ops.load(Ordering::Relaxed) as f64 / elapsed,
        bytes.load(Ordering::Relaxed) as f64 / elapsed,
    ))
}

/// The byte every 4 KiB block holds after `fill` and the random writes.
fn pattern(block: u64) -> u8 {
    (block.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn fill(vol: &Volume) -> Result<(), BenchError> {
    let step = (vol.layout().stripe_data_bytes() * 16).min(16 << 20);
    let mut at = 0;
    while at < vol.capacity_bytes() {
        let len = step.min(vol.capacity_bytes() - at);
        let data: Vec<u8> = (0..len).map(|i| pattern((at + i) / 4096)).collect();
        vol.write(at, &data)
            .map_err(|e| BenchError::Check(format!("fill: {e}")))?;
        at += len;
    }
    Ok(())
}

/// The volume's client for benches: a long request timeout, because on a shared machine a
/// multi-megabyte fill can wait seconds for CPU; a killed member is still noticed at once
/// (its connection is reset).
fn bench_volume_config() -> VolumeConfig {
    let mut cfg = VolumeConfig::default();
    cfg.client.request_timeout = Duration::from_secs(20);
    cfg
}

/// Longest a bench waits for a volume to notice a killed member: above the bench client's
/// request timeout, so one probe of a silent member can run out.
const DEGRADE_NOTICE_TIMEOUT: Duration = Duration::from_secs(45);

/// Probes the members of `vol` until it reports itself degraded, at most
/// `DEGRADE_NOTICE_TIMEOUT`; an error if it never does.
fn wait_degraded(vol: &Volume, what: &str) -> Result<(), BenchError> {
    let deadline = Instant::now() + DEGRADE_NOTICE_TIMEOUT;
    while !vol.status().degraded() {
        if Instant::now() >= deadline {
            return Err(BenchError::Check(format!(
                "{what}: a member was killed but the volume is not degraded after {DEGRADE_NOTICE_TIMEOUT:?}"
            )));
        }
        vol.check_members();
    }
    Ok(())
}

/// Runs `bench raid compare`: writes `raid-compare.json` and its figure.
pub fn run_compare(cfg: &CompareConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let placement = Placement::choose(cfg.in_process)?;
    let levels = compare_levels();
    let names: Vec<String> = levels.iter().map(|(l, _)| l.name()).collect();
    let metrics = [
        ("full-stripe write", "bytes_per_sec"),
        ("4 KiB random write", "ops_per_sec"),
        ("4 KiB random read", "ops_per_sec"),
        ("4 KiB degraded read", "ops_per_sec"),
    ];
    let mut series: Vec<Series> = metrics.iter().map(|(m, _)| Series::new(*m)).collect();
    let mut overhead = Series::new("memory overhead ×");
    let mut figures: std::collections::BTreeMap<(String, usize), f64> = Default::default();
    let mut sides = serde_json::Map::new();
    for (level, n) in &levels {
        // A server per member, each its own process, so one can be killed.
        let memory = cfg.volume_bytes * 2 / (*n as u64).max(1) + (64 << 20);
        let spec = CamelotSpec::new(1, memory);
        let mut nodes: Vec<Option<CamelotNodes>> = (0..*n)
            .map(|_| CamelotNodes::start(&spec, &placement).map(Some))
            .collect::<Result<_, _>>()?;
        let mut side = camelot_side(
            &spec,
            &placement,
            &level.name(),
            ClientSide {
                client: "camelot-blocks Volume over camelot-client, in the bench process".into(),
                client_threads: cfg.threads,
                depth: 1,
                data_model: format!(
                    "{} over {n} servers, {} B chunks; closed loop, one call in flight a thread",
                    level.name(),
                    cfg.chunk_bytes
                ),
                resp_face: false,
            },
        );
        side.nodes = *n;
        sides.insert(level.name(), side.to_json());
        // Every member's server process, for the CPU they spend on each load.
        let pids = |nodes: &[Option<CamelotNodes>]| -> Vec<u32> {
            nodes
                .iter()
                .flatten()
                .flat_map(|c| c.processes().into_iter().map(|p| p.pid()))
                .collect()
        };
        let addrs: Vec<_> = nodes.iter().flatten().map(|c| c.addrs()[0]).collect();
        let vol = Arc::new(
            Volume::create(
                "bench",
                *level,
                &addrs,
                cfg.chunk_bytes,
                cfg.volume_bytes,
                &bench_volume_config(),
            )
            .map_err(|e| BenchError::Setup(e.to_string()))?,
        );
        fill(&vol)?;
        let x = names.iter().position(|nm| *nm == level.name()).unwrap_or(0);
        let loads = [
            Load::FullStripeWrite,
            Load::RandomWrite4k,
            Load::RandomRead4k,
        ];
        for (i, load) in loads.into_iter().enumerate() {
            let meter = CpuMeter::start(pids(&nodes));
            let t = Instant::now();
            let (ops, bytes) = drive(&vol, load, cfg.threads, cfg.seconds_per_point)?;
            let ops_done = ops * t.elapsed().as_secs_f64();
            let mut p = Point::new(x);
            p.ops_per_sec = Some(ops);
            p.bytes_per_sec = Some(bytes);
            p.extra.insert("level".into(), json!(level.name()));
            for (k, v) in cpu_extra(ops_done, meter.seconds()) {
                p.extra.insert(k.into(), v);
            }
            series[i].points.push(p);
            figures.insert((level.name(), i), if i == 0 { bytes } else { ops });
        }
        if *level != Level::Raid0 {
            // Kill member 1's server; reads must go on, reconstructed.
            if let Some(node) = nodes[1].take() {
                node.stop()?;
            }
            // A read notices the loss only if it touches member 1, and a short point on a
            // loaded machine may never do so: wait (bounded) until the volume has noticed,
            // so the point measures degraded reads only.
            wait_degraded(&vol, &level.name())?;
            let meter = CpuMeter::start(pids(&nodes));
            let t = Instant::now();
            let (ops, bytes) = drive(&vol, Load::RandomRead4k, cfg.threads, cfg.seconds_per_point)?;
            let ops_done = ops * t.elapsed().as_secs_f64();
            let mut p = Point::new(x);
            p.ops_per_sec = Some(ops);
            p.bytes_per_sec = Some(bytes);
            p.extra.insert("level".into(), json!(level.name()));
            for (k, v) in cpu_extra(ops_done, meter.seconds()) {
                p.extra.insert(k.into(), v);
            }
            series[3].points.push(p);
            figures.insert((level.name(), 3), ops);
        }
        let mut p = Point::new(x);
        p.extra.insert(
            "memory_overhead".into(),
            json!(vol.layout().memory_overhead()),
        );
        p.extra.insert("level".into(), json!(level.name()));
        overhead.points.push(p);
        drop(vol);
        for node in nodes.into_iter().flatten() {
            node.stop()?;
        }
    }
    series.push(overhead);
    // After the volumes, so the stream has the machine to itself, as each level had.
    let iperf = crate::peers::iperf3_tcp_stream_for(cfg.peer_seconds)?;
    if let Some(i) = &iperf {
        sides.insert(
            "iperf3".into(),
            json!({
                "label": "iperf3",
                "server": "iperf3",
                "process": "separate",
                "nodes": 1,
                "command": i.command,
                "client": "iperf3 -c (one TCP stream, client sends)",
                "client_threads": 1,
                "data_model": "a byte stream: the wire's ceiling for what a write moves",
            }),
        );
    }
    let config = json!({
        "x": "level",
        "levels": levels.iter().map(|(l, n)| json!({"level": l.name(), "members": n})).collect::<Vec<_>>(),
        "threads": cfg.threads,
        "chunk_bytes": cfg.chunk_bytes,
        "volume_bytes": cfg.volume_bytes,
        "seconds_per_point": cfg.seconds_per_point,
        "servers": placement.name(),
        "server_per_member": true,
        "degraded": "member 1's server stopped (killed when separate), reads reconstruct",
        "server_cpu_seconds": "per point: every member server's CPU seconds during it (separate processes only)",
        "sides": serde_json::Value::Object(sides),
        "iperf3": iperf.as_ref().map(|i| i.command.clone()),
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("raid-compare", started, config, series);
    if let Some(i) = &iperf {
        result.references.push(camelot_results::schema::Reference {
            label: "iperf3 stream (loopback)".into(),
            metric: "bytes_per_sec".into(),
            value: i.bytes_per_sec,
        });
    }
    let get = |l: &str, i: usize| figures.get(&(l.to_string(), i)).copied();
    let mut compare =
        |name: &str, a: Option<f64>, b: Option<f64>, unit: &str, peer: &str, target: f64| {
            if let (Some(a), Some(b)) = (a, b) {
                result
                    .comparisons
                    .push(Comparison::new(name, a, b, unit, peer).with_target(target, false));
            }
        };
    compare(
        "raid5 full-stripe write",
        get("raid5", 0),
        get("raid0", 0),
        "B/s",
        "raid0",
        0.8,
    );
    compare(
        "rs:4+2 full-stripe write",
        get("rs:4+2", 0),
        get("raid0", 0),
        "B/s",
        "raid0",
        0.7,
    );
    compare(
        "raid5 4 KiB random write",
        get("raid5", 1),
        get("raid0", 1),
        "ops/s",
        "raid0",
        0.4,
    );
    compare(
        "raid5 degraded read",
        get("raid5", 3),
        get("raid5", 2),
        "ops/s",
        "raid5 normal read",
        0.6,
    );
    compare(
        "rs:4+2 degraded read",
        get("rs:4+2", 3),
        get("rs:4+2", 2),
        "ops/s",
        "rs:4+2 normal read",
        0.6,
    );
    if let (Some(i), Some(raid0)) = (&iperf, get("raid0", 0)) {
        // Context, no target: how close a raid0 full-stripe write comes to the wire.
        result.comparisons.push(Comparison::new(
            "raid0 full-stripe write",
            raid0,
            i.bytes_per_sec,
            "B/s",
            "iperf3 stream (loopback)",
        ));
    }
    let fig = compare_figure(&result, &names);
    Ok(output::write_result_with_figure(out, &result, &fig)?)
}

#[derive(Debug, Clone)]
pub struct OverheadConfig {
    pub threads: Vec<usize>,
    pub chunk_bytes: u64,
    pub volume_bytes: u64,
    pub seconds_per_point: f64,
    /// Seconds iperf3 streams beside the volumes (0: no iperf3).
    pub peer_seconds: u64,
    pub in_process: bool,
    pub quick: bool,
}

impl Default for OverheadConfig {
    fn default() -> Self {
        OverheadConfig {
            threads: vec![1, 2, 4, 8],
            chunk_bytes: 64 << 10,
            volume_bytes: 256 << 20,
            seconds_per_point: 1.0,
            peer_seconds: 2,
            in_process: false,
            quick: false,
        }
    }
}

impl OverheadConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.threads = vec![1, 2];
        self.volume_bytes = 16 << 20;
        self.seconds_per_point = 0.2;
        self.peer_seconds = self.peer_seconds.min(1);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        check_threads(&self.threads, THREADS_MAX)?;
        check_seconds("seconds per point", self.seconds_per_point)?;
        check_holds_stripes(self.volume_bytes, self.chunk_bytes)
    }
}

/// Runs `bench raid overhead` (seed 000's Raid4Overhead): sequential and 4 KiB random
/// reads and writes on raid4 (5 servers) and raid0 (4) against threads, with an iperf3
/// stream beside. Writes `raid-overhead.json` and its figure.
pub fn run_overhead(cfg: &OverheadConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let placement = Placement::choose(cfg.in_process)?;
    let loads = [
        Load::SeqWrite,
        Load::SeqRead,
        Load::RandomWrite4k,
        Load::RandomRead4k,
    ];
    let mut series = Vec::new();
    let mut at_most_threads: std::collections::BTreeMap<(String, &str), f64> = Default::default();
    for (level, n) in [(Level::Raid0, 4), (Level::Raid4, 5)] {
        let memory = cfg.volume_bytes * 2 / n as u64 + (64 << 20);
        let nodes: Vec<CamelotNodes> = (0..n)
            .map(|_| CamelotNodes::start(&CamelotSpec::new(1, memory), &placement))
            .collect::<Result<_, _>>()?;
        let addrs: Vec<_> = nodes.iter().map(|c| c.addrs()[0]).collect();
        let vol = Arc::new(
            Volume::create(
                "overhead",
                level,
                &addrs,
                cfg.chunk_bytes,
                cfg.volume_bytes,
                &bench_volume_config(),
            )
            .map_err(|e| BenchError::Setup(e.to_string()))?,
        );
        fill(&vol)?;
        for load in loads {
            let mut s = Series::new(format!("{} {}", level.name(), load.label()));
            for &threads in &cfg.threads {
                let (ops, bytes) = drive(&vol, load, threads, cfg.seconds_per_point)?;
                let mut p = Point::new(threads);
                p.ops_per_sec = Some(ops);
                p.bytes_per_sec = Some(bytes);
                s.points.push(p);
                let key = (level.name(), load.label());
                let figure = if matches!(load, Load::SeqWrite | Load::SeqRead) {
                    bytes
                } else {
                    ops
                };
                at_most_threads.insert(key, figure);
            }
            series.push(s);
        }
        drop(vol);
        for node in nodes {
            node.stop()?;
        }
    }
    let iperf = crate::peers::iperf3_tcp_stream_for(cfg.peer_seconds)?;
    let most = cfg.threads.iter().max().copied().unwrap_or(1);
    let config = json!({
        "x": "threads",
        "threads": cfg.threads,
        "levels": [{"level": "raid0", "members": 4}, {"level": "raid4", "members": 5}],
        "chunk_bytes": cfg.chunk_bytes,
        "volume_bytes": cfg.volume_bytes,
        "seconds_per_point": cfg.seconds_per_point,
        "servers": placement.name(),
        "iperf3": iperf.as_ref().map(|i| i.command.clone()),
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("raid-overhead", started, config, series);
    if let Some(i) = &iperf {
        result.references.push(camelot_results::schema::Reference {
            label: "iperf3 stream (loopback)".into(),
            metric: "bytes_per_sec".into(),
            value: i.bytes_per_sec,
        });
    }
    for load in loads {
        let label = load.label();
        if let (Some(a), Some(b)) = (
            at_most_threads.get(&("raid4".to_string(), label)),
            at_most_threads.get(&("raid0".to_string(), label)),
        ) {
            let unit = if matches!(load, Load::SeqWrite | Load::SeqRead) {
                "B/s"
            } else {
                "ops/s"
            };
            result.comparisons.push(Comparison::new(
                format!("raid4 {label}, {most} threads"),
                *a,
                *b,
                unit,
                "raid0",
            ));
        }
    }
    let fig = Figure::new("RAID-4 against RAID-0 (seed 000's Raid4Overhead)")
        .panel(
            result
                .series
                .iter()
                .filter(|s| s.label.contains("sequential"))
                .fold(Panel::new("sequential", "threads", "GB/s"), |p, s| {
                    p.line(
                        &s.label,
                        camelot_results::plot::series_points(s, |pt| {
                            pt.bytes_per_sec.map(|v| v / 1e9)
                        }),
                    )
                })
                .references_from(&result, "bytes_per_sec", 1e-9),
        )
        .panel(
            result
                .series
                .iter()
                .filter(|s| s.label.contains("4 KiB"))
                .fold(Panel::new("4 KiB random", "threads", "ops/s"), |p, s| {
                    p.line(
                        &s.label,
                        camelot_results::plot::series_points(s, |pt| pt.ops_per_sec),
                    )
                }),
        );
    Ok(output::write_result_with_figure(out, &result, &fig)?)
}

#[derive(Debug, Clone)]
pub struct RebuildConfig {
    pub threads: usize,
    pub chunk_bytes: u64,
    pub volume_bytes: u64,
    /// Seconds of load measured before the member is lost.
    pub baseline_seconds: f64,
    /// Rebuild rate limit in bytes a second (0: unlimited).
    pub rate_bytes_per_s: u64,
    pub peer_seconds: u64,
    pub in_process: bool,
    pub quick: bool,
}

impl Default for RebuildConfig {
    fn default() -> Self {
        RebuildConfig {
            threads: 4,
            chunk_bytes: 64 << 10,
            volume_bytes: 256 << 20,
            baseline_seconds: 2.0,
            rate_bytes_per_s: 0,
            peer_seconds: 2,
            in_process: false,
            quick: false,
        }
    }
}

impl RebuildConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.threads = self.threads.min(2);
        self.volume_bytes = 16 << 20;
        self.baseline_seconds = 0.2;
        self.peer_seconds = self.peer_seconds.min(1);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        check_threads(&[self.threads], THREADS_MAX)?;
        check_seconds("baseline seconds", self.baseline_seconds)?;
        check_holds_stripes(self.volume_bytes, self.chunk_bytes)
    }
}

/// Runs `bench raid rebuild`: raid5 over 5 servers under a 4 KiB 50/50 load; one member's
/// server is killed, the load goes on degraded, then the member is rebuilt onto a fresh
/// server while the load keeps running. Reports the rebuild rate (against an iperf3
/// stream) and the load's throughput before and during the rebuild.
pub fn run_rebuild(cfg: &RebuildConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let placement = Placement::choose(cfg.in_process)?;
    let n = 5;
    let memory = cfg.volume_bytes * 2 / n as u64 + (64 << 20);
    let mut nodes: Vec<Option<CamelotNodes>> = (0..n)
        .map(|_| CamelotNodes::start(&CamelotSpec::new(1, memory), &placement).map(Some))
        .collect::<Result<_, _>>()?;
    let addrs: Vec<_> = nodes.iter().flatten().map(|c| c.addrs()[0]).collect();
    let vol = Arc::new(
        Volume::create(
            "rebuild",
            Level::Raid5,
            &addrs,
            cfg.chunk_bytes,
            cfg.volume_bytes,
            &bench_volume_config(),
        )
        .map_err(|e| BenchError::Setup(e.to_string()))?,
    );
    fill(&vol)?;
    let (before_ops, _) = drive(&vol, Load::Mixed4k, cfg.threads, cfg.baseline_seconds)?;
    if let Some(node) = nodes[1].take() {
        node.stop()?;
    }
    wait_degraded(&vol, "raid5")?;
    let (degraded_ops, _) = drive(&vol, Load::Mixed4k, cfg.threads, cfg.baseline_seconds)?;
    let fresh = CamelotNodes::start(&CamelotSpec::new(1, memory), &placement)?;
    let target = fresh.addrs()[0];
    let rebuilder = {
        let vol = vol.clone();
        let rate = cfg.rate_bytes_per_s;
        std::thread::spawn(move || {
            let t = Instant::now();
            vol.rebuild(1, target, rate).map(|()| t.elapsed())
        })
    };
    let (during_ops, _) = drive_while(&vol, Load::Mixed4k, cfg.threads, &|_| {
        !rebuilder.is_finished()
    })?;
    let took = rebuilder
        .join()
        .map_err(|_| BenchError::Check("the rebuild thread panicked".into()))?
        .map_err(|e| BenchError::Check(format!("rebuild: {e}")))?;
    let rebuilt_bytes = vol.layout().member_data_bytes();
    let rebuild_rate = rebuilt_bytes as f64 / took.as_secs_f64().max(f64::MIN_POSITIVE);
    let scrub = vol
        .scrub(false)
        .map_err(|e| BenchError::Check(format!("scrub after rebuild: {e}")))?;
    if scrub.mismatches > 0 || vol.status().degraded() {
        return Err(BenchError::Check(format!(
            "after the rebuild: {scrub:?}, degraded {}",
            vol.status().degraded()
        )));
    }
    drop(vol);
    drop(fresh);
    for node in nodes.into_iter().flatten() {
        node.stop()?;
    }
    let iperf = crate::peers::iperf3_tcp_stream_for(cfg.peer_seconds)?;
    let mut load = Series::new("4 KiB 50/50 load");
    for (x, ops) in [
        ("before", before_ops),
        ("degraded", degraded_ops),
        ("during rebuild", during_ops),
    ] {
        let mut p = Point::new(x);
        p.ops_per_sec = Some(ops);
        load.points.push(p);
    }
    let mut rebuild = Series::new("rebuild");
    let mut p = Point::new("during rebuild");
    p.bytes_per_sec = Some(rebuild_rate);
    p.extra.insert("rebuilt_bytes".into(), json!(rebuilt_bytes));
    p.extra.insert("seconds".into(), json!(took.as_secs_f64()));
    rebuild.points.push(p);
    let config = json!({
        "x": "phase",
        "level": "raid5",
        "members": n,
        "threads": cfg.threads,
        "chunk_bytes": cfg.chunk_bytes,
        "volume_bytes": cfg.volume_bytes,
        "baseline_seconds": cfg.baseline_seconds,
        "rate_bytes_per_s": cfg.rate_bytes_per_s,
        "servers": placement.name(),
        "iperf3": iperf.as_ref().map(|i| i.command.clone()),
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("raid-rebuild", started, config, vec![load, rebuild]);
    result.comparisons.push(
        Comparison::new(
            "load during rebuild ÷ before",
            during_ops,
            before_ops,
            "ops/s",
            "the same load before the loss",
        )
        .with_target(0.7, false),
    );
    if let Some(i) = &iperf {
        result.references.push(camelot_results::schema::Reference {
            label: "iperf3 stream (loopback)".into(),
            metric: "bytes_per_sec".into(),
            value: i.bytes_per_sec,
        });
        result.comparisons.push(
            Comparison::new(
                "rebuild rate",
                rebuild_rate,
                i.bytes_per_sec,
                "B/s",
                "iperf3 stream (loopback)",
            )
            .with_target(0.5, false),
        );
    }
    let names: Vec<String> = ["before", "degraded", "during rebuild"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let fig = Figure::new("RAID-5 rebuild while serving")
        .panel(
            Panel::new("load", "phase", "ops/s")
                .bars(names.clone())
                .line(
                    "4 KiB 50/50 load",
                    [before_ops, degraded_ops, during_ops]
                        .iter()
                        .enumerate()
                        .map(|(i, v)| (i as f64, *v))
                        .collect(),
                ),
        )
        .panel(
            Panel::new("rebuild", "phase", "GB/s")
                .bars(vec!["rebuild".into()])
                .line("rebuild rate", vec![(0.0, rebuild_rate / 1e9)])
                .references_from(&result, "bytes_per_sec", 1e-9),
        );
    Ok(output::write_result_with_figure(out, &result, &fig)?)
}

fn compare_figure(result: &BenchResult, names: &[String]) -> Figure {
    let bars = |title: &str, y: &str, pick: &dyn Fn(&Point) -> Option<f64>, which: &[usize]| {
        which.iter().fold(
            Panel::new(title, "level", y).bars(names.to_vec()),
            |panel, &i| {
                let s = &result.series[i];
                panel.line(&s.label, camelot_results::plot::series_points(s, pick))
            },
        )
    };
    Figure::new("Block volumes: RAID levels and Reed–Solomon (seed 000's RaidComparison)")
        .panel(
            bars(
                "full-stripe write",
                "GB/s",
                &|p| p.bytes_per_sec.map(|v| v / 1e9),
                &[0],
            )
            .references_from(result, "bytes_per_sec", 1e-9),
        )
        .panel(bars(
            "4 KiB random I/O",
            "ops/s",
            &|p| p.ops_per_sec,
            &[1, 2, 3],
        ))
        .panel(bars(
            "memory overhead",
            "× data",
            &|p| p.extra.get("memory_overhead")?.as_f64(),
            &[4],
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_encode_writes_a_result_whose_figures_are_positive() -> Result<(), BenchError> {
        let dir = crate::scratch_dir("raid-encode");
        let files = run_encode(&EncodeConfig::defaults_quick(), &dir)?;
        let result = output::read_result(&files[0])?;
        assert_eq!(result.bench, "raid-encode");
        assert_eq!(result.series.len(), 6);
        for s in &result.series {
            assert!(s
                .points
                .iter()
                .all(|p| p.bytes_per_sec.is_some_and(|b| b > 0.0)));
        }
        assert_eq!(result.comparisons.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn quick_compare_in_process_has_every_level_and_ratio() -> Result<(), BenchError> {
        let dir = crate::scratch_dir("raid-compare");
        let cfg = CompareConfig {
            in_process: true,
            seconds_per_point: 0.1,
            peer_seconds: 0,
            ..CompareConfig::defaults_quick()
        };
        let files = run_compare(&cfg, &dir)?;
        let result = output::read_result(&files[0])?;
        assert_eq!(result.series[0].points.len(), 5);
        assert_eq!(
            result.series[3].points.len(),
            4,
            "every level but raid0 degrades"
        );
        assert_eq!(result.comparisons.len(), 5);
        assert!(result
            .comparisons
            .iter()
            .all(|c| c.ratio.is_finite() && c.ratio > 0.0));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn quick_overhead_in_process_has_both_levels() -> Result<(), BenchError> {
        let dir = crate::scratch_dir("raid-overhead");
        let cfg = OverheadConfig {
            in_process: true,
            peer_seconds: 0,
            seconds_per_point: 0.05,
            ..<OverheadConfig as crate::QuickConfig>::defaults(true)
        };
        let files = run_overhead(&cfg, &dir)?;
        let result = output::read_result(&files[0])?;
        assert_eq!(result.series.len(), 8);
        assert!(result.series.iter().all(|s| s.points.len() == 2
            && s.points
                .iter()
                .all(|p| p.ops_per_sec.is_some_and(|o| o > 0.0))));
        assert_eq!(result.comparisons.len(), 4);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn quick_rebuild_in_process_rebuilds_and_reports() -> Result<(), BenchError> {
        let dir = crate::scratch_dir("raid-rebuild");
        let cfg = RebuildConfig {
            in_process: true,
            peer_seconds: 0,
            baseline_seconds: 0.05,
            ..<RebuildConfig as crate::QuickConfig>::defaults(true)
        };
        let files = run_rebuild(&cfg, &dir)?;
        let result = output::read_result(&files[0])?;
        assert_eq!(result.series[0].points.len(), 3);
        assert!(result.series[1].points[0]
            .bytes_per_sec
            .is_some_and(|b| b > 0.0));
        assert_eq!(result.comparisons.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn bad_configs_are_refused() {
        let e = EncodeConfig {
            chunk_bytes: vec![1000],
            ..EncodeConfig::default()
        };
        assert!(e.validate().is_err());
        let c = CompareConfig {
            threads: 0,
            ..CompareConfig::default()
        };
        assert!(c.validate().is_err());
    }

    impl EncodeConfig {
        fn defaults_quick() -> EncodeConfig {
            <EncodeConfig as crate::QuickConfig>::defaults(true)
        }
    }

    impl CompareConfig {
        fn defaults_quick() -> CompareConfig {
            <CompareConfig as crate::QuickConfig>::defaults(true)
        }
    }
}
