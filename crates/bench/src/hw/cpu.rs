//! `camelot bench cpu`: seed 003's CPU experiment. Peak floating-point (GFLOPS) and integer
//! (GIOPS) multiply-add throughput on 1 thread and on every core.
//!
//! Each thread runs `LANES` independent multiply-add chains. One chain alone would wait on
//! the latency of every multiply and add; with enough of them in flight the FP and integer
//! pipelines stay full, which is what "peak" means. The lanes are checked afterwards, so a
//! compiler that skipped or reordered work would fail the run instead of flattering it.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use super::{best_of, median, run_together, validate_seconds, validate_threads, REPEATS};
use crate::progress::Progress;
use crate::BenchError;
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Series};

/// Independent chains per thread. 24 f64 lanes are 12 SSE2 registers, leaving room for the
/// two constants in the 16 a baseline x86-64 build has, so nothing spills; 12 chains of a
/// multiply then an add cover the ~6-cycle chain latency on two FP pipes.
const LANES: usize = 24;
/// Each step of a lane is one multiply and one add.
const OPS_PER_LANE_STEP: u64 = 2;
/// Steps between clock reads: ~0.1-1 ms of work, so reading the clock costs nothing
/// measurable and a run still ends within a millisecond of its deadline.
const STEPS_PER_CHECK: u64 = 1 << 13;

/// `a = a * F_MUL + F_ADD` converges to exactly 1.0 (F_ADD / (1 - F_MUL)). Both constants
/// are powers of two apart from 1, so they are exact in binary and the values stay normal
/// numbers near 1: no denormal slow path, no overflow, however long the run.
const F_MUL: f64 = 1.0 - 1.0 / 1_048_576.0;
const F_ADD: f64 = 1.0 / 1_048_576.0;
/// Knuth's MMIX LCG: `a = a * I_MUL + I_ADD` (mod 2^64), so the final value of every lane can
/// be computed independently in O(log steps) and checked exactly.
const I_MUL: u64 = 6_364_136_223_846_793_005;
const I_ADD: u64 = 1_442_695_040_888_963_407;

#[derive(Debug, Clone)]
pub struct CpuConfig {
    pub threads: Vec<usize>,
    /// Measured time per point, split over `REPEATS` runs.
    pub seconds_per_point: f64,
    pub quick: bool,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            threads: super::default_threads(),
            seconds_per_point: 3.0,
            quick: false,
        }
    }
}

impl CpuConfig {
    /// Scales the run down to a few seconds.
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.seconds_per_point = self.seconds_per_point.min(0.6);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        validate_threads(&self.threads)?;
        validate_seconds(self.seconds_per_point)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Flops,
    Iops,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Flops => "gflops",
            Kind::Iops => "giops",
        }
    }
}

/// Runs the experiment and writes `cpu.json` and `cpu.png`.
pub fn run(cfg: &CpuConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let kinds = [Kind::Flops, Kind::Iops];
    let progress = Progress::new((kinds.len() * cfg.threads.len()) as u64, "cpu");
    let run_time = Duration::from_secs_f64(cfg.seconds_per_point / REPEATS as f64);
    let mut series = Vec::new();
    for kind in kinds {
        let mut s = Series::new(kind.label());
        for &threads in &cfg.threads {
            progress.set_message(&format!("cpu {} ×{threads}", kind.label()));
            let mut samples = Vec::with_capacity(REPEATS);
            let mut walls = Vec::with_capacity(REPEATS);
            for _ in 0..REPEATS {
                let (ops, wall) = timed_run(kind, threads, run_time)?;
                samples.push(ops as f64 / wall.as_secs_f64().max(f64::MIN_POSITIVE));
                walls.push(wall);
            }
            let rate = best_of(&samples).unwrap_or(0.0);
            let best = samples.iter().position(|s| *s == rate).unwrap_or(0);
            let wall = walls.get(best).copied().unwrap_or_default();
            let mut p = Point::new(threads);
            p.ops_per_sec = Some(rate);
            p.extra.insert(kind.label().into(), json!(rate / 1e9));
            p.extra.insert("seconds".into(), json!(wall.as_secs_f64()));
            p.extra
                .insert("median_ops_per_sec".into(), json!(median(&samples)));
            p.extra.insert("samples_ops_per_sec".into(), json!(samples));
            s.points.push(p);
            progress.inc(1);
        }
        add_speedup(&mut s);
        series.push(s);
    }
    progress.finish();

    let config = json!({
        "x": "threads",
        "threads": cfg.threads,
        "seconds_per_point": cfg.seconds_per_point,
        "repeats": REPEATS,
        "reported": "best of the repeats",
        "lanes_per_thread": LANES,
        "gflops_kernel": "f64 a = a * m + c, 2 flops per step (separate multiply and add)",
        "giops_kernel": "u64 a = a * m + c (wrapping), 2 integer ops per step",
        "compiled_simd": super::compiled_simd(),
        "quick": cfg.quick,
    });
    let result = BenchResult::new("cpu", started, config, series);
    Ok(output::write_result_with_figure(
        out,
        &result,
        &figure(&result),
    )?)
}

/// Seed 003 reads its CPU figure as "how close to N× on N threads": the ratio to the
/// 1-thread point says it directly.
fn add_speedup(s: &mut Series) {
    let one = s
        .points
        .iter()
        .find(|p| p.x.as_f64() == Some(1.0))
        .and_then(|p| p.ops_per_sec);
    if let Some(one) = one.filter(|v| *v > 0.0) {
        for p in &mut s.points {
            if let Some(v) = p.ops_per_sec {
                p.extra.insert("speedup_vs_1_thread".into(), json!(v / one));
            }
        }
    }
}

/// One timed run on `threads` threads: the operations done by all of them and the wall time.
fn timed_run(
    kind: Kind,
    threads: usize,
    run_time: Duration,
) -> Result<(u64, Duration), BenchError> {
    let inputs: Vec<usize> = (0..threads).collect();
    let together = run_together(inputs, |t, start| {
        let deadline = start + run_time;
        match kind {
            Kind::Flops => flops_worker(t, deadline),
            Kind::Iops => iops_worker(t, deadline),
        }
    })?;
    let mut ops: u64 = 0;
    for r in together.outputs {
        ops = ops.saturating_add(r.map_err(BenchError::Check)?);
    }
    Ok((ops, together.wall))
}

fn float_start(thread: usize) -> [f64; LANES] {
    // Spread over (0, 2) so lanes approach 1.0 from both sides and never share a value.
    std::array::from_fn(|i| 0.05 + ((thread * LANES + i) % 39) as f64 * 0.05)
}

fn int_start(thread: usize) -> [u64; LANES] {
    std::array::from_fn(|i| ((thread * LANES + i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
}

/// Steps every lane until the deadline, then checks them; returns the operations done.
fn flops_worker(thread: usize, deadline: Instant) -> Result<u64, String> {
    let start = float_start(thread);
    let mut lanes = start;
    let mut steps: u64 = 0;
    loop {
        // Opaque constants: the compiler cannot fold the recurrence into a closed form.
        let (m, c) = (black_box(F_MUL), black_box(F_ADD));
        for _ in 0..STEPS_PER_CHECK {
            for a in lanes.iter_mut() {
                *a = *a * m + c;
            }
        }
        lanes = black_box(lanes);
        steps += STEPS_PER_CHECK;
        if Instant::now() >= deadline {
            break;
        }
    }
    for (a0, a) in start.iter().zip(lanes) {
        if !float_lane_ok(*a0, a) {
            return Err(format!(
                "f64 lane started at {a0} ended at {a}, outside the range the recurrence allows"
            ));
        }
    }
    Ok(steps * LANES as u64 * OPS_PER_LANE_STEP)
}

fn iops_worker(thread: usize, deadline: Instant) -> Result<u64, String> {
    let start = int_start(thread);
    let mut lanes = start;
    let mut steps: u64 = 0;
    loop {
        let (m, c) = (black_box(I_MUL), black_box(I_ADD));
        for _ in 0..STEPS_PER_CHECK {
            for a in lanes.iter_mut() {
                *a = a.wrapping_mul(m).wrapping_add(c);
            }
        }
        lanes = black_box(lanes);
        steps += STEPS_PER_CHECK;
        if Instant::now() >= deadline {
            break;
        }
    }
    for (a0, a) in start.iter().zip(lanes) {
        let expected = lcg_advance(*a0, I_MUL, I_ADD, steps);
        if a != expected {
            return Err(format!(
                "u64 lane started at {a0} ended at {a} after {steps} steps, expected {expected}"
            ));
        }
    }
    Ok(steps * LANES as u64 * OPS_PER_LANE_STEP)
}

/// `a = a * F_MUL + F_ADD` moves monotonically from `a0` towards 1.0 and never past it;
/// rounding can only add a few ulps.
fn float_lane_ok(a0: f64, a: f64) -> bool {
    const SLACK: f64 = 1e-9;
    let (lo, hi) = if a0 < 1.0 { (a0, 1.0) } else { (1.0, a0) };
    a.is_finite() && a >= lo - SLACK && a <= hi + SLACK
}

/// The LCG `a = a * m + c (mod 2^64)` advanced `n` steps in O(log n), by squaring the
/// affine map (the jump-ahead of Brown, "Random number generation with arbitrary strides").
fn lcg_advance(a: u64, m: u64, c: u64, mut n: u64) -> u64 {
    let (mut acc_m, mut acc_c) = (1u64, 0u64);
    let (mut cur_m, mut cur_c) = (m, c);
    while n > 0 {
        if n & 1 == 1 {
            acc_m = acc_m.wrapping_mul(cur_m);
            acc_c = acc_c.wrapping_mul(cur_m).wrapping_add(cur_c);
        }
        cur_c = cur_m.wrapping_add(1).wrapping_mul(cur_c);
        cur_m = cur_m.wrapping_mul(cur_m);
        n >>= 1;
    }
    acc_m.wrapping_mul(a).wrapping_add(acc_c)
}

/// A panel per metric against threads, with the line perfect scaling from 1 thread would give.
fn figure(result: &BenchResult) -> Figure {
    let mut fig = Figure::new("CPU: peak multiply-add throughput");
    for s in &result.series {
        let key = s.label.as_str();
        let pts = series_points(s, |p| p.extra.get(key)?.as_f64());
        let title = key.to_uppercase();
        let mut panel = Panel::new(&title, "threads", &title);
        if let Some(&(_, one)) = pts.iter().find(|(x, _)| *x == 1.0) {
            let ideal = pts.iter().map(|(x, _)| (*x, one * x)).collect();
            panel = panel.line("linear from 1 thread", ideal);
        }
        fig = fig.panel(panel.line("measured", pts));
    }
    fig
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        crate::scratch_dir(&format!("hw-cpu-{tag}"))
    }

    #[test]
    fn bad_configs_are_refused() {
        let bad = |f: &dyn Fn(&mut CpuConfig)| {
            let mut c = CpuConfig::default();
            f(&mut c);
            matches!(c.validate(), Err(BenchError::InvalidConfig(_)))
        };
        assert!(bad(&|c| c.threads = vec![]));
        assert!(bad(&|c| c.threads = vec![0]));
        assert!(bad(&|c| c.threads = vec![1, super::super::THREADS_MAX + 1]));
        assert!(bad(&|c| c.seconds_per_point = 0.0));
        assert!(bad(&|c| c.seconds_per_point = f64::INFINITY));
        assert!(CpuConfig::default().validate().is_ok());
        let mut q = CpuConfig::default();
        q.apply_quick();
        assert!(q.quick && q.seconds_per_point <= 0.6 && q.validate().is_ok());
        let dir = scratch("bad");
        let cfg = CpuConfig {
            threads: vec![],
            ..CpuConfig::default()
        };
        assert!(matches!(run(&cfg, &dir), Err(BenchError::InvalidConfig(_))));
        assert!(!dir.exists());
    }

    #[test]
    fn lcg_advance_matches_stepping() {
        for (a0, n) in [
            (0u64, 0u64),
            (1, 1),
            (12345, 7),
            (u64::MAX, 1000),
            (42, 4097),
        ] {
            let mut a = a0;
            for _ in 0..n {
                a = a.wrapping_mul(I_MUL).wrapping_add(I_ADD);
            }
            assert_eq!(lcg_advance(a0, I_MUL, I_ADD, n), a, "a0 {a0} n {n}");
        }
    }

    #[test]
    fn float_lanes_stay_between_start_and_one() {
        for a0 in float_start(3) {
            assert!(a0 > 0.0 && a0 < 2.0);
            let mut a = a0;
            for _ in 0..10_000 {
                a = a * F_MUL + F_ADD;
            }
            assert!(float_lane_ok(a0, a), "{a0} -> {a}");
        }
        assert!(!float_lane_ok(0.5, 1.5));
        assert!(!float_lane_ok(1.5, 0.5));
        assert!(!float_lane_ok(0.5, f64::NAN));
    }

    #[test]
    fn workers_count_whole_batches_and_pass_their_checks() -> Result<(), String> {
        // A deadline already passed still runs one batch: no point is ever zero.
        let now = Instant::now();
        assert_eq!(
            flops_worker(0, now)?,
            STEPS_PER_CHECK * LANES as u64 * OPS_PER_LANE_STEP
        );
        assert_eq!(
            iops_worker(1, now)?,
            STEPS_PER_CHECK * LANES as u64 * OPS_PER_LANE_STEP
        );
        Ok(())
    }

    #[test]
    fn quick_run_writes_a_result_that_reads_back() -> Result<(), BenchError> {
        let dir = scratch("run");
        let cfg = CpuConfig {
            threads: vec![1, 2],
            seconds_per_point: 0.03,
            quick: true,
        };
        let files = run(&cfg, &dir)?;
        assert_eq!(
            files,
            vec![
                dir.join("cpu.json"),
                dir.join("cpu.png"),
                dir.join("cpu.svg")
            ]
        );
        assert!(std::fs::metadata(&files[1]).map(|m| m.len()).unwrap_or(0) > 0);
        let result = output::read_result(&files[0])?;
        assert_eq!(result.bench, "cpu");
        let labels: Vec<&str> = result.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["gflops", "giops"]);
        for s in &result.series {
            let xs: Vec<Option<f64>> = s.points.iter().map(|p| p.x.as_f64()).collect();
            assert_eq!(xs, [Some(1.0), Some(2.0)]);
            for p in &s.points {
                let ops = p.ops_per_sec.unwrap_or(0.0);
                let g = p
                    .extra
                    .get(&s.label)
                    .and_then(|v| v.as_f64())
                    .unwrap_or(0.0);
                assert!(ops.is_finite() && ops > 0.0, "{p:?}");
                assert!(g.is_finite() && g > 0.0, "{p:?}");
                assert!((g * 1e9 - ops).abs() <= ops * 1e-9, "{p:?}");
                for key in ["seconds", "median_ops_per_sec", "speedup_vs_1_thread"] {
                    let v = p.extra.get(key).and_then(|v| v.as_f64()).unwrap_or(0.0);
                    assert!(v.is_finite() && v > 0.0, "{key} in {p:?}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
