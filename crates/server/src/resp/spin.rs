//! Keeps a Redis-port event loop polling for a short while after it last had work,
//! instead of going straight to sleep in `epoll_wait`, as long as nothing else wants
//! its CPU.
//!
//! Why: a client's request to a sleeping loop pays for waking it (in the client's own
//! `send`, `sock_def_readable` → `try_to_wake_up`: 7–11% of redis-benchmark's time in
//! `perf record` against redis-server, BENCHMARKS.md), and the answer waits for the
//! scheduler to run the loop again. While requests keep coming, a loop that is still
//! polling takes them without either cost. The spin stops `spin_idle` after the last
//! command, so an idle server sleeps as before.
//!
//! On a CPU other programs want, polling is a loss: the loop uses up its share on
//! nothing, then the client and the loop both wait behind those programs. The kernel
//! counts the time a thread sat runnable without a CPU (`run_delay`,
//! `/proc/thread-self/schedstat`): with redis-benchmark alone on the machine it is 1.5–4.5%
//! of the wall clock, next to three busy programs 35–45% (BENCHMARKS.md). The loop
//! reads it every `CHECK_PERIOD` and stops spinning after `CONTENDED_PERIODS` in a row
//! over `CONTENDED_PER_MILLE`; one quiet period starts it again.
//!
//! Only on the port's own event-loop threads (`--resp-threads` ≥ 1): on the shared
//! worker pool a spinning task would hold a worker the native port needs.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::future::poll_fn;
use std::os::unix::fs::FileExt;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// How long a loop keeps polling after its last command unless configured otherwise
/// (`ServerConfig::resp_poll`). Long enough to cover the gap between a reply and the
/// next request of a busy client over loopback (tens of µs), short enough that a lone
/// slow client costs little CPU.
pub const SPIN_IDLE_DEFAULT: Duration = Duration::from_micros(100);
/// The longest polling window accepted: past this a "poll" is a busy core.
pub const SPIN_IDLE_MAX: Duration = Duration::from_millis(10);
/// How often the loop re-reads its run delay: long enough to average over a few of
/// another program's time slices, short enough to stop spinning soon after they start.
const CHECK_PERIOD: Duration = Duration::from_millis(20);
/// Run delay, in thousandths of the wall clock, above which the loop does not spin:
/// far from both the quiet (15–45) and the contended (350–450) figures.
const CONTENDED_PER_MILLE: u128 = 150;
/// Contended periods in a row that stop the spin.
const CONTENDED_PERIODS: u32 = 2;
/// `/proc/thread-self/schedstat` is three numbers; anything longer is not that file.
const SCHEDSTAT_BYTES_MAX: usize = 128;

thread_local! {
    /// Commands this thread's loop has run; the spinner compares it across polls.
    static ACTIVITY: Cell<u64> = const { Cell::new(0) };
    /// The spinner, while it sleeps waiting for work.
    static IDLE: RefCell<Option<Waker>> = const { RefCell::new(None) };
}

/// Called by a connection after it ran commands: restarts this thread's spin window,
/// waking the spinner if it had gone to sleep. Costs two thread-local accesses where no
/// spinner runs (the worker-pool mode).
pub(crate) fn note_activity() {
    ACTIVITY.with(|a| a.set(a.get().wrapping_add(1)));
    if let Some(w) = IDLE.with(|i| i.borrow_mut().take()) {
        w.wake();
    }
}

/// The kernel's scheduling figures for the thread that opened it.
struct SchedStat {
    file: File,
    buf: [u8; SCHEDSTAT_BYTES_MAX],
}

impl SchedStat {
    fn open() -> Option<SchedStat> {
        let file = File::open("/proc/thread-self/schedstat").ok()?;
        Some(SchedStat {
            file,
            buf: [0; SCHEDSTAT_BYTES_MAX],
        })
    }

    /// Nanoseconds this thread has waited on a run queue: the second number.
    fn run_delay_ns(&mut self) -> Option<u128> {
        let n = self.file.read_at(&mut self.buf, 0).ok()?;
        let text = std::str::from_utf8(self.buf.get(..n)?).ok()?;
        text.split_ascii_whitespace().nth(1)?.parse().ok()
    }
}

/// Wall clock and run delay at the start of a check period.
struct Mark {
    wall: Instant,
    run_delay_ns: u128,
}

impl Mark {
    fn take(stat: &mut SchedStat) -> Option<Mark> {
        Some(Mark {
            run_delay_ns: stat.run_delay_ns()?,
            wall: Instant::now(),
        })
    }

    /// Whether the thread waited for a CPU for too much of the time since `self`.
    fn contended(&self, now: &Mark) -> bool {
        let wall_ns = now.wall.saturating_duration_since(self.wall).as_nanos();
        let waited_ns = now.run_delay_ns.saturating_sub(self.run_delay_ns);
        waited_ns * 1000 > wall_ns * CONTENDED_PER_MILLE
    }
}

/// Whether a check period has passed since `mark`; if so, moves it on and returns
/// whether the period was contended. `None` when the figures cannot be read.
fn check(stat: &mut SchedStat, mark: &mut Mark, wall: Instant) -> Option<Option<bool>> {
    if wall.saturating_duration_since(mark.wall) < CHECK_PERIOD {
        return Some(None);
    }
    let next = Mark::take(stat)?;
    let contended = mark.contended(&next);
    *mark = next;
    Some(Some(contended))
}

/// Counts contended periods in a row and says whether the loop may spin.
fn settle(contended_run: &mut u32, contended: bool) -> bool {
    *contended_run = if contended {
        contended_run.saturating_add(1)
    } else {
        0
    };
    *contended_run < CONTENDED_PERIODS
}

/// Runs for the life of one single-threaded event loop. Each `yield_now` hands the
/// thread back to tokio, which, with nothing else runnable, polls its I/O driver without
/// blocking before running this task again: that is the spin. Returns (and the loop
/// never spins) where the run delay cannot be read, since it could not tell when
/// spinning hurts.
pub(crate) async fn spin_loop(spin_idle: Duration) {
    if spin_idle.is_zero() {
        return;
    }
    let Some(mut stat) = SchedStat::open() else {
        return;
    };
    let Some(mut mark) = Mark::take(&mut stat) else {
        return;
    };
    let mut spin = true;
    // Contended check periods in a row; one alone (a compiler starting, the client
    // landing on this CPU for a moment) does not stop the spin.
    let mut contended_run = 0u32;
    let mut seen = ACTIVITY.with(Cell::get);
    loop {
        // Asleep until a connection reports work.
        poll_fn(|cx| {
            let now = ACTIVITY.with(Cell::get);
            if now != seen {
                seen = now;
                Poll::Ready(())
            } else {
                IDLE.with(|i| *i.borrow_mut() = Some(cx.waker().clone()));
                Poll::Pending
            }
        })
        .await;
        let mut last_work = Instant::now();
        // Checked here too, so a loop that stopped spinning starts again once the
        // machine is quiet.
        match check(&mut stat, &mut mark, last_work) {
            None => return,
            Some(Some(contended)) => spin = settle(&mut contended_run, contended),
            Some(None) => {}
        }
        while spin {
            tokio::task::yield_now().await;
            let wall = Instant::now();
            let now = ACTIVITY.with(Cell::get);
            if now != seen {
                seen = now;
                last_work = wall;
            } else if wall.saturating_duration_since(last_work) >= spin_idle {
                break;
            }
            match check(&mut stat, &mut mark, wall) {
                None => return,
                Some(Some(contended)) => spin = settle(&mut contended_run, contended),
                Some(None) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_threads_run_delay() {
        // The loop depends on this file on every Linux it runs on; if it stops parsing,
        // the port silently stops spinning, so say so here.
        let mut stat = SchedStat::open().expect("/proc/thread-self/schedstat opens");
        let first = stat.run_delay_ns().expect("run delay parses");
        let second = stat.run_delay_ns().expect("run delay parses again");
        assert!(
            second >= first,
            "run delay went back: {first} then {second}"
        );
    }

    #[test]
    fn contention_is_run_delay_over_wall_clock() {
        let start = Instant::now();
        let mark = Mark {
            wall: start,
            run_delay_ns: 1_000,
        };
        let after = |wall_ms: u64, waited_ns: u128| Mark {
            wall: start + Duration::from_millis(wall_ms),
            run_delay_ns: 1_000 + waited_ns,
        };
        // 20 ms with 3 ms waited (15%) is the threshold itself: still quiet.
        assert!(!mark.contended(&after(20, 3_000_000)));
        assert!(mark.contended(&after(20, 3_000_001)));
        // A quiet machine's figure and a contended one's.
        assert!(!mark.contended(&after(20, 600_000)));
        assert!(mark.contended(&after(20, 7_000_000)));
        // A clock that did not move is never contention (no division by zero).
        assert!(!mark.contended(&after(0, 0)));
    }

    #[test]
    fn one_contended_period_alone_does_not_stop_the_spin() {
        let mut run = 0;
        assert!(settle(&mut run, true), "a single period is tolerated");
        assert!(settle(&mut run, false));
        assert!(
            settle(&mut run, true),
            "the count restarted after a quiet period"
        );
        assert!(!settle(&mut run, true), "two in a row stop it");
        assert!(!settle(&mut run, true));
        assert!(settle(&mut run, false), "a quiet period starts it again");
    }

    #[test]
    fn a_period_is_checked_only_once_it_has_passed() {
        let mut stat = SchedStat::open().expect("schedstat opens");
        let mut mark = Mark::take(&mut stat).expect("mark");
        let start = mark.wall;
        assert_eq!(check(&mut stat, &mut mark, start), Some(None));
        assert_eq!(mark.wall, start, "an early check must not move the mark");
        let later = start + CHECK_PERIOD;
        assert!(matches!(check(&mut stat, &mut mark, later), Some(Some(_))));
        assert!(mark.wall > start, "a finished period starts a new one");
    }
}
