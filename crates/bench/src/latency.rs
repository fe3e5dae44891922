//! Latency recording: an HdrHistogram in nanoseconds, summarised in microseconds.

use std::time::Duration;

use hdrhistogram::Histogram;

use camelot_results::schema::LatencySummary;

const LATENCY_NS_LOW: u64 = 1;
/// 100 s: no single operation of a benchmark may legitimately take longer.
const LATENCY_NS_HIGH: u64 = 100_000_000_000;
const SIGNIFICANT_FIGURES: u8 = 3;

/// Records latencies. Values above 100 s are clamped to 100 s: an outlier must not abort
/// a run, and the maximum still shows it.
#[derive(Clone, Debug)]
pub struct LatencyRecorder {
    hist: Histogram<u64>,
}

impl LatencyRecorder {
    pub fn new() -> Self {
        // The bounds are constants that satisfy every precondition of new_with_bounds
        // (low >= 1, high >= 2 * low, sigfig <= 5), so this cannot fail.
        let hist = Histogram::new_with_bounds(LATENCY_NS_LOW, LATENCY_NS_HIGH, SIGNIFICANT_FIGURES)
            .expect("constant histogram bounds are valid");
        LatencyRecorder { hist }
    }

    pub fn record(&mut self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    pub fn record_ns(&mut self, ns: u64) {
        self.hist.saturating_record(ns);
    }

    pub fn merge(&mut self, other: &LatencyRecorder) {
        if self.hist.add(&other.hist).is_err() {
            // Both sides share the same bounds, so add cannot overflow the range; should
            // it ever refuse, fold the values in one by one with the same clamping.
            for v in other.hist.iter_recorded() {
                let count = v.count_at_value();
                let value = v.value_iterated_to();
                if self.hist.record_n(value, count).is_err() {
                    for _ in 0..count {
                        self.hist.saturating_record(value);
                    }
                }
            }
        }
    }

    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// Percentiles in microseconds; all zero when nothing was recorded.
    pub fn summary(&self) -> LatencySummary {
        if self.hist.is_empty() {
            return LatencySummary {
                p50: 0.0,
                p90: 0.0,
                p99: 0.0,
                p999: 0.0,
                max: 0.0,
            };
        }
        let us = |ns: u64| ns as f64 / 1_000.0;
        LatencySummary {
            p50: us(self.hist.value_at_quantile(0.50)),
            p90: us(self.hist.value_at_quantile(0.90)),
            p99: us(self.hist.value_at_quantile(0.99)),
            p999: us(self.hist.value_at_quantile(0.999)),
            max: us(self.hist.max()),
        }
    }
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(actual: f64, expected: f64) -> bool {
        // 3 significant figures: buckets are at most 0.1% wide.
        (actual - expected).abs() <= expected * 0.002
    }

    #[test]
    fn empty_summary_is_zero() {
        let r = LatencyRecorder::default();
        assert_eq!(r.count(), 0);
        let s = r.summary();
        assert_eq!(
            (s.p50, s.p90, s.p99, s.p999, s.max),
            (0.0, 0.0, 0.0, 0.0, 0.0)
        );
    }

    #[test]
    fn uniform_distribution_percentiles() {
        let mut r = LatencyRecorder::new();
        // 1 µs .. 10 000 µs, once each.
        for us in 1..=10_000u64 {
            r.record(Duration::from_micros(us));
        }
        assert_eq!(r.count(), 10_000);
        let s = r.summary();
        assert!(close(s.p50, 5_000.0), "{s:?}");
        assert!(close(s.p90, 9_000.0), "{s:?}");
        assert!(close(s.p99, 9_900.0), "{s:?}");
        assert!(close(s.p999, 9_990.0), "{s:?}");
        assert!(close(s.max, 10_000.0), "{s:?}");
    }

    #[test]
    fn values_beyond_the_range_are_clamped() {
        let mut r = LatencyRecorder::new();
        r.record_ns(u64::MAX);
        r.record(Duration::MAX);
        r.record_ns(0);
        assert_eq!(r.count(), 3);
        let s = r.summary();
        assert!(close(s.max, 100_000_000.0), "{s:?}");
    }

    #[test]
    fn merge_adds_counts() {
        let mut a = LatencyRecorder::new();
        let mut b = LatencyRecorder::new();
        for ns in 0..1_000 {
            a.record_ns(1_000 + ns);
            b.record_ns(1_000_000 + ns);
        }
        a.merge(&b);
        assert_eq!(a.count(), 2_000);
        let s = a.summary();
        assert!(s.p50 < 2.0 && s.p90 > 999.0, "{s:?}");
    }

    proptest! {
        #[test]
        fn percentiles_are_ordered(values in proptest::collection::vec(any::<u64>(), 1..200)) {
            let mut r = LatencyRecorder::new();
            for v in &values {
                r.record_ns(*v);
            }
            let s = r.summary();
            prop_assert!(s.p50 <= s.p90 && s.p90 <= s.p99 && s.p99 <= s.p999 && s.p999 <= s.max, "{:?}", s);
            prop_assert!(s.p50 >= 0.0);
        }
    }
}
