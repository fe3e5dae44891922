//! `camelot bench cpu` and `camelot bench mem`: seed 003's machine benchmarks. They measure
//! the machine the cluster runs on, so the other benches' figures can be read against what
//! the hardware can do at best.
//!
//! Both take `REPEATS` short runs per point and report the best: on a shared, noisy VM a
//! neighbour can only ever slow a run down, so the fastest run is the closest to the
//! hardware. The median and every sample are kept in `extra` so the noise stays visible.

pub mod cpu;
pub mod disk;
pub mod limits;
pub mod mem;
pub mod net;
// The control protocol lives at the crate root (`crate::netctl`): the error type needs it,
// and nothing it holds depends on the experiments here.
pub use crate::netctl;
pub mod netserver;

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::BenchError;

/// Thread counts past this are a typo, not a machine.
pub const THREADS_MAX: usize = 256;
/// Every thread count is a point per experiment; more than this would not fit a figure.
pub const THREAD_COUNTS_MAX: usize = 16;
/// Below a millisecond a run is all clock reads and thread start-up.
pub const SECONDS_PER_POINT_MIN: f64 = 0.001;
/// Ten minutes per point is already an hour-long run for the memory bench.
pub const SECONDS_PER_POINT_MAX: f64 = 600.0;
/// Timed runs per point; the best one is reported.
pub const REPEATS: usize = 3;

/// One thread, and one per core the process may run on: seed 003's "1 and N threads".
pub fn default_threads() -> Vec<usize> {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, THREADS_MAX);
    if cores == 1 {
        vec![1]
    } else {
        vec![1, cores]
    }
}

/// The largest finite sample, or `None` without one.
pub fn best_of(samples: &[f64]) -> Option<f64> {
    samples
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(None, |best, v| Some(best.map_or(v, |b: f64| b.max(v))))
}

/// The median of the finite samples (the mean of the middle two for an even count).
pub fn median(samples: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() & 1 == 0 {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    })
}

/// The instruction sets this binary was compiled for. Without `unsafe` the benches cannot
/// pick wider vectors at run time, so their peak is the peak of these, recorded with the
/// result so a figure is never mistaken for the CPU's absolute limit.
pub fn compiled_simd() -> Vec<&'static str> {
    let mut v = Vec::new();
    if cfg!(target_feature = "sse2") {
        v.push("sse2");
    }
    if cfg!(target_feature = "avx") {
        v.push("avx");
    }
    if cfg!(target_feature = "avx2") {
        v.push("avx2");
    }
    if cfg!(target_feature = "fma") {
        v.push("fma");
    }
    if cfg!(target_feature = "avx512f") {
        v.push("avx512f");
    }
    if cfg!(target_feature = "neon") {
        v.push("neon");
    }
    v
}

pub(crate) fn validate_threads(threads: &[usize]) -> Result<(), BenchError> {
    if threads.is_empty() || threads.len() > THREAD_COUNTS_MAX {
        return Err(BenchError::InvalidConfig(format!(
            "give 1 to {THREAD_COUNTS_MAX} thread counts, not {}",
            threads.len()
        )));
    }
    if let Some(t) = threads.iter().find(|t| **t == 0 || **t > THREADS_MAX) {
        return Err(BenchError::InvalidConfig(format!(
            "thread count {t} is outside 1..={THREADS_MAX}"
        )));
    }
    Ok(())
}

pub(crate) fn validate_seconds(seconds: f64) -> Result<(), BenchError> {
    if !(SECONDS_PER_POINT_MIN..=SECONDS_PER_POINT_MAX).contains(&seconds) {
        return Err(BenchError::InvalidConfig(format!(
            "seconds per point must be {SECONDS_PER_POINT_MIN}..={SECONDS_PER_POINT_MAX}, \
             not {seconds}"
        )));
    }
    Ok(())
}

/// What the threads of one timed run returned, and how long the run took from the first
/// thread's start to the last thread's end.
pub(crate) struct Together<T> {
    pub outputs: Vec<T>,
    pub wall: Duration,
    /// Each thread's own time from its start to its end, in input order.
    pub busy: Vec<Duration>,
}

/// Runs `work` once per input, each on its own scoped thread, all released at once. `work`
/// gets its input and the instant its thread was released, which it measures its deadline
/// from.
pub(crate) fn run_together<I, T, F>(inputs: Vec<I>, work: F) -> Result<Together<T>, BenchError>
where
    I: Send,
    T: Send,
    F: Fn(I, Instant) -> T + Sync,
{
    let gate = StartGate::new(inputs.len());
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(inputs.len());
        let mut spawn_error = None;
        for (i, input) in inputs.into_iter().enumerate() {
            let (gate, work) = (&gate, &work);
            let spawned = std::thread::Builder::new()
                .name(format!("hw-bench-{i}"))
                .spawn_scoped(s, move || {
                    if !gate.wait() {
                        return None;
                    }
                    let start = Instant::now();
                    let out = work(input, start);
                    Some((start, Instant::now(), out))
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    gate.abort();
                    spawn_error = Some(e);
                    break;
                }
            }
        }
        let mut finished = Vec::with_capacity(handles.len());
        let mut panicked = false;
        for h in handles {
            match h.join() {
                Ok(Some(r)) => finished.push(r),
                Ok(None) => {}
                Err(_) => panicked = true,
            }
        }
        if let Some(e) = spawn_error {
            return Err(BenchError::Setup(format!(
                "cannot start a bench thread: {e}"
            )));
        }
        if panicked {
            return Err(BenchError::Setup("a bench thread panicked".into()));
        }
        let first = finished.iter().map(|r| r.0).min();
        let last = finished.iter().map(|r| r.1).max();
        let wall = match (first, last) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        let busy = finished
            .iter()
            .map(|r| r.1.saturating_duration_since(r.0))
            .collect();
        let outputs = finished.into_iter().map(|r| r.2).collect();
        Ok(Together {
            outputs,
            wall,
            busy,
        })
    })
}

/// A barrier that can be called off. With `std::sync::Barrier` a thread that fails to
/// spawn would leave the others waiting forever, and the scope waiting on them.
struct StartGate {
    parties: usize,
    state: Mutex<(usize, GateState)>,
    cv: Condvar,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum GateState {
    Waiting,
    Open,
    Aborted,
}

impl StartGate {
    fn new(parties: usize) -> StartGate {
        StartGate {
            parties,
            state: Mutex::new((0, GateState::Waiting)),
            cv: Condvar::new(),
        }
    }

    /// Blocks until every party arrived (`true`) or the gate was called off (`false`).
    fn wait(&self) -> bool {
        let mut g = self.state.lock();
        g.0 += 1;
        if g.0 >= self.parties && g.1 == GateState::Waiting {
            g.1 = GateState::Open;
            self.cv.notify_all();
        }
        while g.1 == GateState::Waiting {
            self.cv.wait(&mut g);
        }
        g.1 == GateState::Open
    }

    fn abort(&self) {
        let mut g = self.state.lock();
        if g.1 == GateState::Waiting {
            g.1 = GateState::Aborted;
        }
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_and_median_skip_non_finite() {
        assert_eq!(best_of(&[]), None);
        assert_eq!(best_of(&[f64::NAN]), None);
        assert_eq!(best_of(&[1.0, 3.0, f64::INFINITY, 2.0]), Some(3.0));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[5.0]), Some(5.0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0, f64::NAN]), Some(2.5));
    }

    #[test]
    fn default_threads_are_one_and_all_cores() {
        let t = default_threads();
        assert_eq!(t[0], 1);
        assert!(t.len() <= 2);
        assert!(validate_threads(&t).is_ok());
    }

    #[test]
    fn thread_and_seconds_limits() {
        assert!(validate_threads(&[]).is_err());
        assert!(validate_threads(&[0]).is_err());
        assert!(validate_threads(&[THREADS_MAX + 1]).is_err());
        assert!(validate_threads(&[1; THREAD_COUNTS_MAX + 1]).is_err());
        assert!(validate_threads(&[1, THREADS_MAX]).is_ok());
        assert!(validate_seconds(0.0).is_err());
        assert!(validate_seconds(f64::NAN).is_err());
        assert!(validate_seconds(SECONDS_PER_POINT_MAX * 2.0).is_err());
        assert!(validate_seconds(0.5).is_ok());
    }

    #[test]
    fn together_runs_every_input_and_times_the_run() -> Result<(), BenchError> {
        let run = run_together(vec![1u64, 2, 3], |x, _start| {
            std::thread::sleep(Duration::from_millis(5));
            x * 10
        })?;
        let mut outputs = run.outputs;
        outputs.sort_unstable();
        assert_eq!(outputs, [10, 20, 30]);
        assert_eq!(run.busy.len(), 3);
        assert!(run.wall >= Duration::from_millis(5));
        assert!(run.busy.iter().all(|b| *b <= run.wall));
        Ok(())
    }

    #[test]
    fn a_panicking_worker_is_an_error_not_a_hang() {
        let run = run_together(vec![0u8, 1], |x, _| {
            assert_eq!(x, 0, "deliberate test panic");
        });
        assert!(matches!(run, Err(BenchError::Setup(_))));
    }

    #[test]
    fn an_aborted_gate_releases_its_waiters() {
        let gate = StartGate::new(3);
        std::thread::scope(|s| {
            let h = s.spawn(|| gate.wait());
            std::thread::sleep(Duration::from_millis(5));
            gate.abort();
            assert_eq!(h.join().ok(), Some(false));
        });
    }
}
