//! `--ops-per-sec-max`: a token bucket on executed operations, so one machine can play a
//! slow node beside fast ones (the heterogeneous cluster of seed 004) where cgroup v2's
//! `cpu.max` is not available. Pure: the caller passes the clock reading, and gets back
//! how long to wait before running its operations; it never sleeps itself.

use std::time::{Duration, Instant};

/// The smallest rate accepted: below it a single operation would wait longer than any
/// client's timeout.
pub const OPS_PER_SEC_MIN: u64 = 1;
/// The largest rate accepted; beyond it the bucket's float arithmetic is still exact
/// enough, but no server here executes that many operations anyway.
pub const OPS_PER_SEC_MAX: u64 = 1_000_000_000;
/// Longest debt the bucket lets callers run up: a batch asking for more than this many
/// seconds' worth of operations waits at most this long, so one huge pipeline cannot
/// stall every other connection for minutes.
pub const DEBT_SECONDS_MAX: f64 = 10.0;

/// Tokens accrue at `rate` per second up to `burst`; taking `n` operations always
/// succeeds but may leave the balance negative, and the wait returned is the time until
/// it is back to zero — so concurrent callers are served in the order they asked, each
/// at the configured rate overall.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate_per_sec: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A bucket full at `now`; `ops_per_sec` is clamped to
    /// [`OPS_PER_SEC_MIN`]..=[`OPS_PER_SEC_MAX`]. The burst is a tenth of a second's
    /// worth (at least one), so a throttled server's rate over any 1 s window stays within
    /// about 10% of the limit.
    pub fn new(ops_per_sec: u64, now: Instant) -> Self {
        let rate = ops_per_sec.clamp(OPS_PER_SEC_MIN, OPS_PER_SEC_MAX) as f64;
        let burst = (rate / 10.0).max(1.0);
        TokenBucket {
            rate_per_sec: rate,
            burst,
            tokens: burst,
            last: now,
        }
    }

    pub fn ops_per_sec(&self) -> u64 {
        self.rate_per_sec as u64
    }

    /// Takes `ops` operations at `now` and says how long the caller must wait before
    /// running them (zero when the bucket had them). A clock reading earlier than the
    /// last one (callers race to the lock) accrues nothing.
    pub fn take(&mut self, ops: u64, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        if now > self.last {
            self.last = now;
        }
        self.tokens = (self.tokens + elapsed * self.rate_per_sec).min(self.burst);
        self.tokens -= ops as f64;
        let floor = -DEBT_SECONDS_MAX * self.rate_per_sec;
        if self.tokens < floor {
            self.tokens = floor;
        }
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate_per_sec)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_full_bucket_serves_its_burst_at_once_then_waits() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, t0);
        assert_eq!(b.take(100, t0), Duration::ZERO);
        // The 101st op needs a millisecond's worth of tokens.
        let wait = b.take(1, t0);
        assert!((wait.as_secs_f64() - 0.001).abs() < 1e-9, "{wait:?}");
    }

    #[test]
    fn tokens_accrue_with_time_but_not_beyond_the_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, t0);
        assert_eq!(b.take(100, t0), Duration::ZERO);
        // An hour idle still only refills a tenth of a second's worth.
        let t1 = t0 + Duration::from_secs(3600);
        assert_eq!(b.take(100, t1), Duration::ZERO);
        assert!(b.take(1, t1) > Duration::ZERO);
    }

    #[test]
    fn a_huge_batch_waits_at_most_the_debt_cap() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10, t0);
        let wait = b.take(1_000_000, t0);
        assert!(
            wait <= Duration::from_secs_f64(DEBT_SECONDS_MAX),
            "{wait:?}"
        );
    }

    #[test]
    fn a_clock_going_backwards_accrues_nothing() {
        let t0 = Instant::now() + Duration::from_secs(1);
        let mut b = TokenBucket::new(1000, t0);
        assert_eq!(b.take(100, t0), Duration::ZERO);
        let earlier = t0 - Duration::from_millis(500);
        assert!(b.take(1, earlier) > Duration::ZERO);
    }

    proptest! {
        /// Callers that wait what they are told run at most `rate` ops per second plus the
        /// burst, over any schedule of requests.
        #[test]
        fn waiting_as_told_never_exceeds_the_rate(
            rate in 1u64..100_000,
            steps in proptest::collection::vec((1u64..500, 0u64..20_000), 1..200),
        ) {
            let t0 = Instant::now();
            let mut b = TokenBucket::new(rate, t0);
            let mut now = t0;
            let mut served = 0u64;
            for (ops, gap_us) in steps {
                now += Duration::from_micros(gap_us);
                let wait = b.take(ops, now);
                // Run when told; the batch counts as served at that instant.
                now += wait;
                served += ops;
                let secs = now.duration_since(t0).as_secs_f64();
                let burst = (rate as f64 / 10.0).max(1.0);
                // The debt cap forgives what lies beyond it; the bound holds up to then.
                if wait.as_secs_f64() >= DEBT_SECONDS_MAX - 1e-6 {
                    break;
                }
                prop_assert!(served as f64 <= burst + secs * rate as f64 + 1e-6 * rate as f64,
                    "served {served} in {secs}s at rate {rate}");
            }
        }
    }
}
