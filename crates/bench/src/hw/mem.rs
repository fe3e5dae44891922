//! `camelot bench mem`: seed 003's memory experiment. Sequential read, sequential write,
//! random read and memcpy throughput at 1 B, 1 KiB and 1 MiB blocks, on 1 thread and on
//! every core.
//!
//! The buffer is far larger than the last-level cache, so the figures are the memory's, not
//! the cache's. With several threads each works on its own equal share of it, so the memory
//! touched does not grow with threads.
//! Every byte a timed loop reads or writes is checked afterwards against what it must be:
//! a loop the compiler dropped or a torn copy fails the run rather than flattering it.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use serde_json::json;

use super::{best_of, median, run_together, validate_seconds, validate_threads, REPEATS};
use crate::latency::LatencyRecorder;
use crate::progress::Progress;
use crate::BenchError;
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Series};

/// 4 GiB is far past any last-level cache; more would only risk pushing a shared machine
/// into swap.
pub const BUFFER_BYTES_MAX: usize = 4 << 30;
/// The largest block a single operation moves.
pub const BLOCK_BYTES_MAX: usize = 256 << 20;
/// Block sizes are points on one axis; more would not fit a figure.
pub const BLOCK_SIZES_MAX: usize = 32;
/// Four times the 32 MiB L3 of the EPYC VMs this runs on: at 64 MiB part of a pass still
/// came from L3 (31 GB/s sequential read against 26 GB/s at 256 MiB).
pub const QUICK_BUFFER_BYTES: usize = 128 << 20;

/// A chase cell holds the index of the next cell, as a little-endian u64.
const POINTER_BYTES: usize = 8;
/// Bytes between clock reads in the sequential loops: a fraction of a millisecond of work,
/// so the clock costs nothing measurable and runs end close to their deadline.
const CHUNK_BYTES: usize = 256 << 10;
/// Random reads are timed per window of dependent accesses: a clock read per access would
/// cost as much as the access. Windows are at most this many accesses...
const LATENCY_WINDOW_ACCESSES_MAX: usize = 256;
/// ...and at most about this many bytes, so large blocks still give many windows.
const LATENCY_WINDOW_BYTES: usize = 64 << 10;

#[derive(Debug, Clone)]
pub struct MemConfig {
    pub block_sizes_bytes: Vec<usize>,
    pub threads: Vec<usize>,
    /// The memory all threads together work on.
    pub buffer_bytes: usize,
    /// Measured time per point, split over `REPEATS` runs.
    pub seconds_per_point: f64,
    pub quick: bool,
}

impl Default for MemConfig {
    fn default() -> Self {
        MemConfig {
            block_sizes_bytes: vec![1, 1 << 10, 1 << 20],
            threads: super::default_threads(),
            buffer_bytes: 256 << 20,
            seconds_per_point: 1.5,
            quick: false,
        }
    }
}

impl MemConfig {
    /// Scales the run down to well under 20 s on a 2-core machine.
    pub fn apply_quick(&mut self) {
        self.quick = true;
        // Never below what the configured blocks and threads need, or quick would turn a
        // valid configuration into an invalid one.
        self.buffer_bytes = self
            .buffer_bytes
            .min(QUICK_BUFFER_BYTES.max(self.min_buffer_bytes()));
        self.seconds_per_point = self.seconds_per_point.min(0.25);
    }

    /// memcpy gives every thread a source and a destination of at least one block, and
    /// random read a cycle of at least two cells.
    fn min_buffer_bytes(&self) -> usize {
        let block = self.block_sizes_bytes.iter().copied().max().unwrap_or(1);
        let block = cell_bytes(block);
        let threads = self.threads.iter().copied().max().unwrap_or(1);
        block.saturating_mul(2).saturating_mul(threads)
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        validate_threads(&self.threads)?;
        validate_seconds(self.seconds_per_point)?;
        if self.block_sizes_bytes.is_empty() || self.block_sizes_bytes.len() > BLOCK_SIZES_MAX {
            return bad(format!("give 1 to {BLOCK_SIZES_MAX} block sizes"));
        }
        if let Some(b) = self
            .block_sizes_bytes
            .iter()
            .find(|b| **b == 0 || **b > BLOCK_BYTES_MAX)
        {
            return bad(format!("block size {b} is outside 1..={BLOCK_BYTES_MAX}"));
        }
        if self.buffer_bytes == 0 || self.buffer_bytes > BUFFER_BYTES_MAX {
            return bad(format!(
                "buffer size {} is outside 1..={BUFFER_BYTES_MAX}",
                self.buffer_bytes
            ));
        }
        if self.min_buffer_bytes() > self.buffer_bytes {
            return bad(format!(
                "a {}-byte buffer cannot give each of {} threads two blocks of {} bytes \
                 (at least 8): it needs {} bytes",
                self.buffer_bytes,
                self.threads.iter().max().unwrap_or(&1),
                self.block_sizes_bytes.iter().max().unwrap_or(&1),
                self.min_buffer_bytes()
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    SeqRead,
    SeqWrite,
    RandomRead,
    Memcpy,
}

impl Op {
    /// The order of the series in the result.
    const ALL: [Op; 4] = [Op::SeqRead, Op::SeqWrite, Op::RandomRead, Op::Memcpy];
    /// The order they run in: each leaves the buffer as the next one wants it. Reads and
    /// copies see the random fill; the chase only rewrites the first word of each cell;
    /// writing flattens the buffer to one byte, so it goes last.
    const RUN_ORDER: [Op; 4] = [Op::SeqRead, Op::Memcpy, Op::RandomRead, Op::SeqWrite];

    fn label(self) -> &'static str {
        match self {
            Op::SeqRead => "seq read",
            Op::SeqWrite => "seq write",
            Op::RandomRead => "random read",
            Op::Memcpy => "memcpy",
        }
    }
}

/// What one thread did in one timed run.
struct Work {
    ops: u64,
    bytes: u64,
    latency: Option<LatencyRecorder>,
    /// Time the thread spent, after its release, preparing and checking rather than
    /// doing the measured work; taken out of its busy time. Checking a 128 MiB write
    /// inside the timing cost a 0.25 s quick point about a fifth of its rate.
    untimed: Duration,
}

/// Runs the experiment and writes `mem.json` and `mem.png`.
pub fn run(cfg: &MemConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let mut buf = allocate(cfg.buffer_bytes)?;
    // Random bytes: a pattern the hardware or the compiler could shortcut (zero pages,
    // repeated words) would not be a measurement of memory.
    SmallRng::seed_from_u64(0x003).fill_bytes(&mut buf);

    let points = Op::ALL.len() * cfg.block_sizes_bytes.len() * cfg.threads.len();
    let progress = Progress::new(points as u64, "mem");
    let run_time = Duration::from_secs_f64(cfg.seconds_per_point / REPEATS as f64);
    // series[op][thread count], in Op::ALL order.
    let mut series: Vec<Vec<Series>> = Op::ALL
        .iter()
        .map(|op| {
            cfg.threads
                .iter()
                .map(|t| Series::new(format!("{} ×{t}", op.label())))
                .collect()
        })
        .collect();

    for op in Op::RUN_ORDER {
        let op_index = Op::ALL.iter().position(|o| *o == op).unwrap_or(0);
        for &block in &cfg.block_sizes_bytes {
            for (t_index, &threads) in cfg.threads.iter().enumerate() {
                if op == Op::RandomRead {
                    let cell = cell_bytes(block);
                    for region in split_regions(&mut buf, threads, cell) {
                        build_chain(region, cell, block as u64);
                    }
                }
                progress.set_message(&format!(
                    "{} {} ×{threads}",
                    op.label(),
                    format_bytes(block)
                ));
                let p = measure(op, &mut buf, block, threads, run_time)?;
                series[op_index][t_index].points.push(p);
                progress.inc(1);
            }
        }
    }
    progress.finish();
    drop(buf);

    let config = json!({
        "x": "block size (bytes)",
        "block_sizes_bytes": cfg.block_sizes_bytes,
        "threads": cfg.threads,
        "buffer_bytes": cfg.buffer_bytes,
        "seconds_per_point": cfg.seconds_per_point,
        "repeats": REPEATS,
        "reported": "best of the repeats",
        "split": "each thread works on its own 1/threads of the buffer",
        "memcpy_bytes": "bytes copied (each is read once and written once)",
        "random_read": "dependent pointer chase through one random cycle over the \
                        max(block, 8)-byte cells of each thread's region, so neither \
                        prefetching nor overlapping misses help",
        "latency_us": "random read: time per access, averaged over windows of up to 256 \
                       dependent accesses",
        "ns_per_access": "each thread's busy time over its block operations",
        "quick": cfg.quick,
    });
    let result = BenchResult::new("mem", started, config, series.concat());
    Ok(output::write_result_with_figure(
        out,
        &result,
        &figure(&result),
    )?)
}

fn allocate(bytes: usize) -> Result<Vec<u8>, BenchError> {
    let mut buf = Vec::new();
    // The OS refusing is an error to report, not an abort.
    buf.try_reserve_exact(bytes)
        .map_err(|e| BenchError::Setup(format!("cannot allocate a {bytes}-byte buffer: {e}")))?;
    buf.resize(bytes, 0);
    Ok(buf)
}

/// One point: `REPEATS` timed runs, the best reported.
fn measure(
    op: Op,
    buf: &mut [u8],
    block: usize,
    threads: usize,
    run_time: Duration,
) -> Result<Point, BenchError> {
    let mut samples = Vec::with_capacity(REPEATS);
    let mut runs = Vec::with_capacity(REPEATS);
    let mut latency = LatencyRecorder::new();
    for _ in 0..REPEATS {
        let (works, wall, busy) = timed_run(op, buf, block, threads, run_time)?;
        let (ops, bytes) = works
            .iter()
            .fold((0u64, 0u64), |(o, b), w| (o + w.ops, b + w.bytes));
        for w in &works {
            if let Some(l) = &w.latency {
                latency.merge(l);
            }
        }
        samples.push(bytes as f64 / wall.as_secs_f64().max(f64::MIN_POSITIVE));
        runs.push((ops, wall, busy));
    }
    let rate = best_of(&samples).unwrap_or(0.0);
    let best = samples.iter().position(|s| *s == rate).unwrap_or(0);
    let (ops, wall, busy) = runs.get(best).copied().unwrap_or_default();
    let mut p = Point::new(block);
    p.bytes_per_sec = Some(rate);
    p.ops_per_sec = Some(ops as f64 / wall.as_secs_f64().max(f64::MIN_POSITIVE));
    if op == Op::RandomRead {
        p.latency_us = Some(latency.summary());
    }
    let ns_per_access = busy.as_secs_f64() * 1e9 / ops.max(1) as f64;
    p.extra.insert("ns_per_access".into(), json!(ns_per_access));
    p.extra.insert("mb_per_sec".into(), json!(rate / 1e6));
    p.extra.insert("threads".into(), json!(threads));
    p.extra.insert("seconds".into(), json!(wall.as_secs_f64()));
    p.extra
        .insert("median_bytes_per_sec".into(), json!(median(&samples)));
    p.extra
        .insert("samples_bytes_per_sec".into(), json!(samples));
    Ok(p)
}

/// One timed run: what each thread did, the wall time, and the threads' summed busy time.
fn timed_run(
    op: Op,
    buf: &mut [u8],
    block: usize,
    threads: usize,
    run_time: Duration,
) -> Result<(Vec<Work>, Duration, Duration), BenchError> {
    let together = match op {
        // Each thread chases the cycle through its own region. Sharing one cycle would let
        // a thread that trails another closely read what the other just pulled into the
        // shared L3, which at 1 MiB blocks made random beat sequential.
        Op::RandomRead => run_together(
            split_regions(buf, threads, cell_bytes(block)),
            |region, start| random_read(region, block, start + run_time),
        )?,
        Op::SeqRead => {
            // The expected sum of every chunk, taken untimed, checks every byte read.
            let per = region_bytes(buf.len(), threads, block);
            let inputs: Vec<(&[u8], Vec<u64>)> = buf
                .chunks(per)
                .take(threads)
                .map(|r| (&r[..per], chunk_sums(&r[..per], block)))
                .collect();
            run_together(inputs, |(region, sums), start| {
                seq_read(region, block, &sums, start + run_time)
            })?
        }
        Op::SeqWrite => run_together(split_regions(buf, threads, block), |region, start| {
            seq_write(region, block, start + run_time)
        })?,
        Op::Memcpy => run_together(split_regions(buf, threads, block * 2), |region, start| {
            memcpy(region, block, start + run_time)
        })?,
    };
    let works = together
        .outputs
        .into_iter()
        .collect::<Result<Vec<Work>, String>>()
        .map_err(|e| BenchError::Check(format!("{} {block} B: {e}", op.label())))?;
    // Threads are released together, so the measured wall time is the longest thread's
    // own time without its checks.
    let measured: Vec<Duration> = together
        .busy
        .iter()
        .zip(&works)
        .map(|(b, w)| b.saturating_sub(w.untimed))
        .collect();
    let wall = measured.iter().max().copied().unwrap_or(together.wall);
    Ok((works, wall, measured.iter().sum()))
}

/// `threads` equal, disjoint regions, each a whole number of `unit`s. Validation ensures
/// every region holds at least one unit.
fn split_regions(buf: &mut [u8], threads: usize, unit: usize) -> Vec<&mut [u8]> {
    let per = region_bytes(buf.len(), threads, unit);
    buf.chunks_mut(per)
        .take(threads)
        .map(|r| &mut r[..per])
        .collect()
}

/// Never 0, so it can size `chunks`; validation makes it at least one unit anyway.
fn region_bytes(len: usize, threads: usize, unit: usize) -> usize {
    (len / threads.max(1) / unit.max(1) * unit).max(1)
}

/// Blocks per chunk between clock reads: at least one, so a run always does some work.
fn chunk_len(block: usize) -> usize {
    (CHUNK_BYTES / block).max(1) * block
}

/// The checksum of one block: its bytes as little-endian words, summed. The word loop
/// compiles to wide loads, so a large block reads at the speed of memory.
fn read_block(b: &[u8]) -> u64 {
    let mut words = b.chunks_exact(8);
    let mut sum = 0u64;
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        sum = sum.wrapping_add(u64::from_le_bytes(word));
    }
    for &byte in words.remainder() {
        sum = sum.wrapping_add(u64::from(byte));
    }
    sum
}

fn chunk_sums(region: &[u8], block: usize) -> Vec<u64> {
    region
        .chunks(chunk_len(block))
        .map(|c| {
            c.chunks_exact(block)
                .fold(0u64, |s, b| s.wrapping_add(read_block(b)))
        })
        .collect()
}

fn seq_read(region: &[u8], block: usize, sums: &[u64], deadline: Instant) -> Result<Work, String> {
    let mut ops = 0u64;
    loop {
        for (i, (chunk, expected)) in region.chunks(chunk_len(block)).zip(sums).enumerate() {
            let mut sum = 0u64;
            for b in chunk.chunks_exact(block) {
                // Opaque per block: the blocks stay separate operations of `block` bytes
                // instead of being fused into one long read.
                sum = sum.wrapping_add(read_block(black_box(b)));
            }
            ops += (chunk.len() / block) as u64;
            if sum != *expected {
                return Err(format!("chunk {i} summed to {sum:#x}, not {expected:#x}"));
            }
            if Instant::now() >= deadline {
                return Ok(Work {
                    ops,
                    bytes: ops * block as u64,
                    latency: None,
                    untimed: Duration::ZERO,
                });
            }
        }
    }
}

/// Never 0 (the fill after allocation) and different from the previous pass's, so the
/// check can tell each pass's bytes apart.
fn write_pattern(pass: u64) -> u8 {
    (pass % 255) as u8 + 1
}

fn seq_write(region: &mut [u8], block: usize, deadline: Instant) -> Result<Work, String> {
    let mut ops = 0u64;
    let mut pass = 0u64;
    let chunk = chunk_len(block);
    let end = 'passes: loop {
        let pattern = write_pattern(pass);
        let mut done = 0usize;
        for c in region.chunks_mut(chunk) {
            for b in c.chunks_exact_mut(block) {
                black_box(b).fill(pattern);
            }
            done += c.len();
            ops += (c.len() / block) as u64;
            if Instant::now() >= deadline {
                break 'passes done;
            }
        }
        pass += 1;
    };
    let checking = Instant::now();
    check_written(region, pass, end)?;
    Ok(Work {
        ops,
        bytes: ops * block as u64,
        latency: None,
        untimed: checking.elapsed(),
    })
}

/// After writing passes 0..=`last_pass`, the last one stopping at `end`: bytes before `end`
/// hold the last pass's pattern, bytes after it the previous pass's.
fn check_written(region: &[u8], last_pass: u64, end: usize) -> Result<(), String> {
    let (done, rest) = region.split_at(end.min(region.len()));
    let want = write_pattern(last_pass);
    if let Some(i) = done.iter().position(|&b| b != want) {
        return Err(format!("byte {i} is {}, not {want}", done[i]));
    }
    if last_pass > 0 {
        let want = write_pattern(last_pass - 1);
        if let Some(i) = rest.iter().position(|&b| b != want) {
            return Err(format!("byte {} is {}, not {want}", end + i, rest[i]));
        }
    }
    Ok(())
}

/// Copies the region's first half into its second, block by block.
fn memcpy(region: &mut [u8], block: usize, deadline: Instant) -> Result<Work, String> {
    let half = region.len() / 2;
    let (src, dst) = region.split_at_mut(half);
    // Untimed: a destination that already matched would prove nothing.
    let preparing = Instant::now();
    dst.fill(0);
    let mut untimed = preparing.elapsed();
    let chunk = chunk_len(block);
    let mut ops = 0u64;
    let mut copied = 0usize;
    'passes: loop {
        for (s, d) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
            for (sb, db) in s.chunks_exact(block).zip(d.chunks_exact_mut(block)) {
                black_box(db).copy_from_slice(black_box(sb));
            }
            ops += (s.len() / block) as u64;
            copied = (copied + s.len()).min(half);
            if Instant::now() >= deadline {
                break 'passes;
            }
        }
    }
    let checking = Instant::now();
    if src[..copied] != dst[..copied] {
        let i = src
            .iter()
            .zip(dst.iter())
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        return Err(format!("copy differs from its source at byte {i}"));
    }
    untimed += checking.elapsed();
    Ok(Work {
        ops,
        bytes: ops * block as u64,
        latency: None,
        untimed,
    })
}

/// A cell holds a block and, in its first 8 bytes, the next cell's index. Blocks under 8
/// bytes still load the whole pointer, but from the same cache line, so the access costs
/// the same as reading the block alone.
fn cell_bytes(block: usize) -> usize {
    block.max(POINTER_BYTES)
}

fn next_cell(cell: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&cell[..POINTER_BYTES]);
    u64::from_le_bytes(word)
}

fn set_next_cell(cell: &mut [u8], next: u64) {
    cell[..POINTER_BYTES].copy_from_slice(&next.to_le_bytes());
}

/// Links the cells of `buf` into one random cycle (Sattolo's algorithm), so a walk from any
/// cell visits every cell before it repeats and each address depends on the load before.
fn build_chain(buf: &mut [u8], cell: usize, seed: u64) {
    let cells = buf.len() / cell;
    for (i, c) in buf.chunks_exact_mut(cell).enumerate() {
        set_next_cell(c, i as u64);
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    for i in (1..cells).rev() {
        let j = rng.gen_range(0..i);
        let a = next_cell(&buf[i * cell..]);
        let b = next_cell(&buf[j * cell..]);
        set_next_cell(&mut buf[i * cell..], b);
        set_next_cell(&mut buf[j * cell..], a);
    }
}

/// Accesses per latency window for `block`-byte reads.
fn window_accesses(block: usize) -> usize {
    (LATENCY_WINDOW_BYTES / block).clamp(1, LATENCY_WINDOW_ACCESSES_MAX)
}

fn random_read(buf: &[u8], block: usize, deadline: Instant) -> Result<Work, String> {
    let cell = cell_bytes(block);
    let cells = buf.len() / cell;
    let window = window_accesses(block);
    let mut latency = LatencyRecorder::new();
    let mut at = 0usize;
    let mut sum = 0u64;
    let mut ops = 0u64;
    let mut window_start = Instant::now();
    loop {
        for _ in 0..window {
            let c = buf
                .get(at * cell..at * cell + cell)
                .ok_or_else(|| format!("the chain left the buffer at cell {at}"))?;
            if block >= POINTER_BYTES {
                sum = sum.wrapping_add(read_block(black_box(&c[..block])));
            }
            // The next address is the value just loaded: the accesses cannot overlap.
            let next = next_cell(c);
            at = usize::try_from(next)
                .ok()
                .filter(|n| *n < cells)
                .ok_or_else(|| format!("cell {at} points outside the buffer: {next}"))?;
        }
        ops += window as u64;
        let now = Instant::now();
        let ns = now.saturating_duration_since(window_start).as_nanos() / window as u128;
        latency.record_ns(u64::try_from(ns).unwrap_or(u64::MAX).max(1));
        window_start = now;
        if now >= deadline {
            break;
        }
    }
    black_box((sum, at));
    Ok(Work {
        ops,
        bytes: ops * block as u64,
        latency: Some(latency),
        untimed: Duration::ZERO,
    })
}

/// 1 B, 1 KiB, 1 MiB; any other size in bytes.
fn format_bytes(n: usize) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift && n & ((1 << shift) - 1) == 0 {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} B")
}

/// Seed 003's memory figure: a panel per operation, MB/s against block size, one line per
/// thread count; and the random read's time per access.
fn figure(result: &BenchResult) -> Figure {
    let mut fig = Figure::new("Memory: throughput by block size");
    for op in Op::ALL {
        let mut panel = Panel::new(op.label(), "block size (bytes)", "MB/s")
            .log_x()
            .log_y();
        for s in result
            .series
            .iter()
            .filter(|s| s.label.starts_with(op.label()))
        {
            let pts = series_points(s, |p| p.bytes_per_sec.map(|b| b / 1e6));
            panel = panel.line(&s.label, pts);
        }
        fig = fig.panel(panel);
    }
    let mut latency = Panel::new("random read latency", "block size (bytes)", "ns per access")
        .log_x()
        .log_y();
    for s in result
        .series
        .iter()
        .filter(|s| s.label.starts_with(Op::RandomRead.label()))
    {
        let pts = series_points(s, |p| p.extra.get("ns_per_access")?.as_f64());
        latency = latency.line(&s.label, pts);
    }
    fig.panel(latency)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        crate::scratch_dir(&format!("hw-mem-{tag}"))
    }

    fn invalid(f: &dyn Fn(&mut MemConfig)) -> bool {
        let mut c = MemConfig::default();
        f(&mut c);
        matches!(c.validate(), Err(BenchError::InvalidConfig(_)))
    }

    #[test]
    fn bad_configs_are_refused() {
        assert!(invalid(&|c| c.threads = vec![]));
        assert!(invalid(&|c| c.threads = vec![0, 1]));
        assert!(invalid(&|c| c.block_sizes_bytes = vec![]));
        assert!(invalid(&|c| c.block_sizes_bytes = vec![0]));
        assert!(invalid(&|c| c.block_sizes_bytes = vec![BLOCK_BYTES_MAX + 1]));
        assert!(invalid(
            &|c| c.block_sizes_bytes = vec![1; BLOCK_SIZES_MAX + 1]
        ));
        assert!(invalid(&|c| c.buffer_bytes = 0));
        assert!(invalid(&|c| c.buffer_bytes = BUFFER_BYTES_MAX + 1));
        assert!(invalid(&|c| c.seconds_per_point = -1.0));
        // A block larger than the buffer, and one that fits but not twice per thread.
        assert!(invalid(&|c| {
            c.buffer_bytes = 1 << 20;
            c.block_sizes_bytes = vec![2 << 20];
        }));
        assert!(invalid(&|c| {
            c.buffer_bytes = 4 << 20;
            c.threads = vec![1, 4];
            c.block_sizes_bytes = vec![1 << 20];
        }));
        // Two 8-byte chase cells per thread at the least, even for 1-byte blocks.
        assert!(invalid(&|c| {
            c.buffer_bytes = 31;
            c.threads = vec![2];
            c.block_sizes_bytes = vec![1];
        }));
        assert!(MemConfig::default().validate().is_ok());
        let dir = scratch("bad");
        let cfg = MemConfig {
            block_sizes_bytes: vec![0],
            ..MemConfig::default()
        };
        assert!(matches!(run(&cfg, &dir), Err(BenchError::InvalidConfig(_))));
        assert!(!dir.exists());
    }

    #[test]
    fn quick_shrinks_but_stays_valid() {
        let mut c = MemConfig::default();
        c.apply_quick();
        assert!(c.quick && c.buffer_bytes == QUICK_BUFFER_BYTES && c.seconds_per_point <= 0.25);
        assert!(c.validate().is_ok());
        let mut big = MemConfig {
            block_sizes_bytes: vec![128 << 20],
            threads: vec![1],
            buffer_bytes: 1 << 30,
            ..MemConfig::default()
        };
        big.apply_quick();
        assert_eq!(big.buffer_bytes, 256 << 20);
        assert!(big.validate().is_ok());
    }

    #[test]
    fn bytes_are_named_in_binary_units() {
        assert_eq!(format_bytes(1), "1 B");
        assert_eq!(format_bytes(1000), "1000 B");
        assert_eq!(format_bytes(1024), "1 KiB");
        assert_eq!(format_bytes(3 << 20), "3 MiB");
        assert_eq!(format_bytes(1 << 30), "1 GiB");
    }

    #[test]
    fn regions_are_equal_disjoint_and_whole_blocks() {
        let mut buf = vec![0u8; 1000];
        let regions = split_regions(&mut buf, 3, 16);
        assert_eq!(regions.len(), 3);
        assert!(regions.iter().all(|r| r.len() == 320));
        let mut buf = vec![0u8; 64];
        assert_eq!(split_regions(&mut buf, 2, 32).len(), 2);
    }

    #[test]
    fn block_checksums_sum_words_and_tails() {
        assert_eq!(read_block(&[]), 0);
        assert_eq!(read_block(&[7]), 7);
        let mut b = [0u8; 10];
        b[0] = 1;
        b[7] = 1;
        b[9] = 5;
        assert_eq!(read_block(&b), 1 + (1 << 56) + 5);
        let region: Vec<u8> = (0..=255u8).cycle().take(3 * CHUNK_BYTES).collect();
        let sums = chunk_sums(&region, 1024);
        assert_eq!(sums.len(), 3);
        let total = region
            .chunks_exact(1024)
            .fold(0u64, |s, b| s.wrapping_add(read_block(b)));
        assert_eq!(sums.iter().fold(0u64, |s, v| s.wrapping_add(*v)), total);
    }

    #[test]
    fn the_chain_is_one_cycle_through_every_cell() {
        for (len, cell) in [(16usize, 8usize), (8 * 1000, 8), (1024 * 37 + 5, 1024)] {
            let mut buf = vec![0u8; len];
            build_chain(&mut buf, cell, 7);
            let cells = len / cell;
            let mut seen = vec![false; cells];
            let mut at = 0usize;
            for _ in 0..cells {
                assert!(!seen[at], "cell {at} visited twice");
                seen[at] = true;
                at = usize::try_from(next_cell(&buf[at * cell..])).unwrap_or(usize::MAX);
                assert!(at < cells);
            }
            assert_eq!(at, 0, "the walk must close after every cell");
            assert!(seen.iter().all(|s| *s));
        }
    }

    #[test]
    fn writes_and_copies_are_checked() {
        assert_ne!(write_pattern(0), 0);
        assert_ne!(write_pattern(254), write_pattern(255));
        let mut r = vec![write_pattern(3); 100];
        r[..40].fill(write_pattern(4));
        assert!(check_written(&r, 4, 40).is_ok());
        assert!(check_written(&r, 4, 50).is_err());
        assert!(check_written(&r, 3, 0).is_err());
        r[70] = 0;
        assert!(check_written(&r, 4, 40).is_err());
        assert!(check_written(&[9, 9, 0], 0, 0).is_ok());

        let deadline = Instant::now();
        let mut region: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8 + 1).collect();
        let w = memcpy(&mut region, 256, deadline).map_err(|e| e.to_string());
        assert!(matches!(w, Ok(ref w) if w.ops == 8 && w.bytes == 2048));
        assert_eq!(region[..2048], region[2048..]);
        let w = seq_write(&mut region, 1, deadline);
        assert!(matches!(w, Ok(ref w) if w.ops == 4096));
        let w = seq_read(&region, 8, &chunk_sums(&region, 8), deadline);
        assert!(matches!(w, Ok(ref w) if w.bytes == 4096));
        // A read whose expected sum disagrees is a failed check.
        assert!(seq_read(&region, 8, &[1], deadline).is_err());
    }

    #[test]
    fn random_read_follows_the_chain_and_records_latency() {
        let mut buf = vec![0u8; 64 << 10];
        build_chain(&mut buf, 8, 1);
        let w = random_read(&buf, 1, Instant::now());
        let w = w.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(w.ops, window_accesses(1) as u64);
        assert_eq!(w.latency.map(|l| l.count()), Some(1));
        // A pointer out of the buffer is a failed check, not a panic.
        let mut broken = vec![0u8; 64];
        set_next_cell(&mut broken, 1_000);
        assert!(random_read(&broken, 8, Instant::now()).is_err());
    }

    #[test]
    fn quick_run_writes_a_result_that_reads_back() -> Result<(), BenchError> {
        let dir = scratch("run");
        let cfg = MemConfig {
            block_sizes_bytes: vec![1, 1024, 16 << 10],
            threads: vec![1, 2],
            buffer_bytes: 256 << 10,
            seconds_per_point: 0.006,
            quick: true,
        };
        let files = run(&cfg, &dir)?;
        assert_eq!(
            files,
            vec![
                dir.join("mem.json"),
                dir.join("mem.png"),
                dir.join("mem.svg")
            ]
        );
        assert!(std::fs::metadata(&files[1]).map(|m| m.len()).unwrap_or(0) > 0);
        let result = output::read_result(&files[0])?;
        assert_eq!(result.bench, "mem");
        let labels: Vec<&str> = result.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "seq read ×1",
                "seq read ×2",
                "seq write ×1",
                "seq write ×2",
                "random read ×1",
                "random read ×2",
                "memcpy ×1",
                "memcpy ×2"
            ]
        );
        let positive = |v: Option<f64>| v.is_some_and(|v| v.is_finite() && v > 0.0);
        for s in &result.series {
            let xs: Vec<Option<f64>> = s.points.iter().map(|p| p.x.as_f64()).collect();
            assert_eq!(xs, [Some(1.0), Some(1024.0), Some(16384.0)], "{}", s.label);
            for p in &s.points {
                assert!(positive(p.bytes_per_sec), "{} {p:?}", s.label);
                assert!(positive(p.ops_per_sec), "{} {p:?}", s.label);
                for key in [
                    "ns_per_access",
                    "mb_per_sec",
                    "seconds",
                    "median_bytes_per_sec",
                ] {
                    assert!(
                        positive(p.extra.get(key).and_then(|v| v.as_f64())),
                        "{key} in {} {p:?}",
                        s.label
                    );
                }
                let random = s.label.starts_with("random read");
                assert_eq!(p.latency_us.is_some(), random, "{}", s.label);
                if let Some(l) = &p.latency_us {
                    for v in [l.p50, l.p90, l.p99, l.p999, l.max] {
                        assert!(positive(Some(v)), "{} {l:?}", s.label);
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
