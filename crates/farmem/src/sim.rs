//! The trace simulator: a trace of page numbers through a policy of a given capacity,
//! counting hits and misses exactly as the page cache would (it drives the same
//! [`Policy`] the same way), plus the synthetic workloads the paging bench uses.

use std::io::BufRead;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

use crate::policy::Policy;
use crate::{Error, PageId};

/// A trace file holds at most this many accesses (8 bytes each in memory).
pub const TRACE_ACCESSES_MAX: usize = 64 << 20;
/// A trace line longer than this is not a trace.
pub const TRACE_LINE_BYTES_MAX: usize = 4096;

/// Hits and misses of one policy over one trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub accesses: u64,
    pub misses: u64,
    pub evictions: u64,
}

impl Counts {
    pub fn miss_ratio(&self) -> f64 {
        if self.accesses == 0 {
            return 0.0;
        }
        self.misses as f64 / self.accesses as f64
    }
}

/// Runs `trace` through `policy` as a cache of `capacity_pages` pages with nothing pinned.
pub fn simulate(
    policy: &mut dyn Policy,
    capacity_pages: usize,
    trace: impl IntoIterator<Item = PageId>,
) -> Counts {
    let mut resident = crate::PageSet::with_capacity_and_hasher(capacity_pages, Default::default());
    let mut counts = Counts::default();
    let nothing_pinned = |_| false;
    let mut last = None;
    for page in trace {
        counts.accesses += 1;
        if resident.contains(&page) {
            // Uses of a page straight after one another are one use to the policy (the
            // cache's fast path does the same), as correlated references should be.
            if last != Some(page) {
                policy.touch(page);
            }
            last = Some(page);
            continue;
        }
        last = Some(page);
        counts.misses += 1;
        if resident.len() >= capacity_pages {
            if let Some(victim) = policy.evict(page, &nothing_pinned) {
                resident.remove(&victim);
                counts.evictions += 1;
            }
        }
        policy.insert(page);
        resident.insert(page);
    }
    counts
}

/// One policy's answer, for printing.
#[derive(Debug, Clone)]
pub struct PolicyRun {
    pub policy: &'static str,
    pub counts: Counts,
    pub elapsed: Duration,
}

/// Every named policy over the same trace.
pub fn simulate_all(
    names: &[&str],
    capacity_pages: usize,
    trace: &[PageId],
    seed: u64,
) -> Result<Vec<PolicyRun>, Error> {
    names
        .iter()
        .map(|name| {
            let mut policy = crate::policy::by_name(name, capacity_pages, seed)?;
            let started = Instant::now();
            let counts = simulate(policy.as_mut(), capacity_pages, trace.iter().copied());
            Ok(PolicyRun {
                policy: policy.name(),
                counts,
                elapsed: started.elapsed(),
            })
        })
        .collect()
}

/// Reads a trace: page numbers in decimal, separated by white space or newlines; `#`
/// starts a comment to the end of its line. Bounded in line length and accesses.
pub fn read_trace(mut reader: impl BufRead) -> Result<Vec<PageId>, Error> {
    let mut trace = Vec::new();
    let mut line = Vec::new();
    let mut number = 0u64;
    loop {
        line.clear();
        let got = std::io::Read::take(reader.by_ref(), TRACE_LINE_BYTES_MAX as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if got == 0 {
            break;
        }
        number += 1;
        if line.len() > TRACE_LINE_BYTES_MAX {
            return Err(Error::Trace {
                line: number,
                reason: format!("longer than {TRACE_LINE_BYTES_MAX} bytes"),
            });
        }
        let text = std::str::from_utf8(&line).map_err(|_| Error::Trace {
            line: number,
            reason: "not UTF-8".into(),
        })?;
        let text = text.split('#').next().unwrap_or("");
        for word in text.split_whitespace() {
            let page = word.parse::<PageId>().map_err(|_| Error::Trace {
                line: number,
                reason: format!("{word:?} is not a page number"),
            })?;
            if trace.len() == TRACE_ACCESSES_MAX {
                return Err(Error::Trace {
                    line: number,
                    reason: format!("more than {TRACE_ACCESSES_MAX} accesses"),
                });
            }
            trace.push(page);
        }
    }
    Ok(trace)
}

/// A synthetic access pattern over `pages` distinct pages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Workload {
    /// 0, 1, 2, … pages−1, and again.
    Sequential,
    /// Every page equally likely.
    Uniform,
    /// Page k with probability ∝ 1/(k+1)^theta (page 0 hottest).
    Zipf { theta: f64 },
    /// A hot set of a twentieth of the pages used uniformly for four times its size,
    /// then a scan of a fifth of the pages through the cold rest, and again: the case
    /// scan-resistant policies are made for.
    HotScan,
    /// Like sequential; named for its use: a loop a little larger than the cache, where
    /// LRU misses every time.
    Loop,
}

impl Workload {
    pub const NAMES: [&'static str; 5] = ["sequential", "uniform", "zipf:THETA", "hotscan", "loop"];

    pub fn parse(text: &str) -> Result<Workload, Error> {
        Ok(match text {
            "sequential" | "seq" => Workload::Sequential,
            "uniform" => Workload::Uniform,
            "hotscan" => Workload::HotScan,
            "loop" => Workload::Loop,
            _ => match text.strip_prefix("zipf:").or(if text == "zipf" {
                Some("0.99")
            } else {
                None
            }) {
                Some(theta) => {
                    let theta: f64 = theta.parse().map_err(|_| {
                        Error::Invalid(format!("zipf exponent {theta:?} is not a number"))
                    })?;
                    if !(theta > 0.0 && theta <= 10.0) {
                        return Err(Error::Invalid(format!(
                            "zipf exponent {theta}: must be in (0, 10]"
                        )));
                    }
                    Workload::Zipf { theta }
                }
                None => {
                    return Err(Error::Invalid(format!(
                        "unknown workload {text:?}; one of {}",
                        Workload::NAMES.join(", ")
                    )))
                }
            },
        })
    }

    pub fn label(&self) -> String {
        match self {
            Workload::Sequential => "sequential".into(),
            Workload::Uniform => "uniform".into(),
            Workload::Zipf { theta } => format!("zipf:{theta}"),
            Workload::HotScan => "hotscan".into(),
            Workload::Loop => "loop".into(),
        }
    }

    /// `accesses` page numbers below `pages`, reproducible from `seed`.
    pub fn generate(&self, pages: u64, accesses: usize, seed: u64) -> Result<Vec<PageId>, Error> {
        if pages == 0 {
            return Err(Error::Invalid("a workload needs at least one page".into()));
        }
        if accesses > TRACE_ACCESSES_MAX {
            return Err(Error::Invalid(format!(
                "{accesses} accesses: at most {TRACE_ACCESSES_MAX}"
            )));
        }
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut out = Vec::with_capacity(accesses);
        match *self {
            Workload::Sequential | Workload::Loop => {
                out.extend((0..accesses as u64).map(|i| i % pages));
            }
            Workload::Uniform => out.extend((0..accesses).map(|_| rng.gen_range(0..pages))),
            Workload::Zipf { theta } => {
                let zipf = Zipf::new(pages, theta)
                    .map_err(|e| Error::Invalid(format!("zipf over {pages} pages: {e}")))?;
                // The sampler answers ranks 1..=pages as floats.
                out.extend(
                    (0..accesses).map(|_| (zipf.sample(&mut rng) as u64).clamp(1, pages) - 1),
                );
            }
            Workload::HotScan => {
                let hot = (pages / 20).max(1);
                let hot_run = 4 * hot as usize;
                let cold = pages - hot;
                let scan_run = (pages / 5).max(1) as usize;
                let mut scan_at = 0u64;
                'cycles: loop {
                    for _ in 0..hot_run {
                        if out.len() == accesses {
                            break 'cycles;
                        }
                        out.push(rng.gen_range(0..hot));
                    }
                    for _ in 0..scan_run {
                        if out.len() == accesses {
                            break 'cycles;
                        }
                        out.push(if cold == 0 { 0 } else { hot + scan_at % cold });
                        scan_at += 1;
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A cache size given as a share of the working set (`10%`) or a page count (`2500`).
pub fn parse_cache_pages(text: &str, working_set_pages: u64) -> Result<usize, Error> {
    let pages = if let Some(percent) = text.strip_suffix('%') {
        let p: f64 = percent
            .trim()
            .parse()
            .map_err(|_| Error::Invalid(format!("cache {text:?}: not a percentage")))?;
        if !(p > 0.0 && p <= 100.0) {
            return Err(Error::Invalid(format!(
                "cache {text}: must be in (0%, 100%]"
            )));
        }
        ((working_set_pages as f64) * p / 100.0).round() as u64
    } else {
        text.trim().parse::<u64>().map_err(|_| {
            Error::Invalid(format!(
                "cache {text:?}: a page count or a percentage like 10%"
            ))
        })?
    };
    if pages == 0 {
        return Err(Error::Invalid(format!(
            "cache {text}: rounds to no page at all"
        )));
    }
    usize::try_from(pages).map_err(|_| Error::Invalid(format!("cache {text}: too many pages")))
}

/// Distinct pages in a trace: the working set a percentage cache size is taken of.
pub fn distinct_pages(trace: &[PageId]) -> u64 {
    let set: std::collections::HashSet<&PageId> = trace.iter().collect();
    set.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{by_name, Lru, POLICY_NAMES};
    use proptest::prelude::*;

    /// Mattson et al.'s stack distance of every access (None for a first access): the
    /// number of distinct pages used since this page was last used, plus one.
    fn stack_distances(trace: &[PageId]) -> Vec<Option<usize>> {
        let mut stack: Vec<PageId> = Vec::new();
        trace
            .iter()
            .map(|&page| {
                let at = stack.iter().rposition(|&p| p == page);
                let distance = at.map(|i| stack.len() - i);
                if let Some(i) = at {
                    stack.remove(i);
                }
                stack.push(page);
                distance
            })
            .collect()
    }

    proptest! {
        /// LRU misses exactly the accesses whose stack distance exceeds the capacity, at
        /// every capacity — the inclusion property the simulator must reproduce.
        #[test]
        fn lru_matches_mattson_stack_distances(
            trace in proptest::collection::vec(0u64..50, 0..600),
            capacity in 1usize..40,
        ) {
            let want = stack_distances(&trace)
                .into_iter()
                .filter(|d| !matches!(d, Some(d) if *d <= capacity))
                .count() as u64;
            let got = simulate(&mut Lru::new(), capacity, trace.iter().copied());
            prop_assert_eq!(got.misses, want);
            prop_assert_eq!(got.accesses, trace.len() as u64);
        }

        /// Garbage never panics the trace reader; whatever it accepts it reads back.
        #[test]
        fn trace_reader_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let _ = read_trace(&bytes[..]);
        }

        #[test]
        fn trace_round_trips(trace in proptest::collection::vec(any::<u64>(), 0..300)) {
            let text: String = trace.iter().map(|p| format!("{p}\n")).collect();
            prop_assert_eq!(read_trace(text.as_bytes()).expect("a trace"), trace);
        }
    }

    #[test]
    fn trace_reader_names_the_bad_line_and_bounds_lines() {
        let err = read_trace(&b"1 2 3\n# comment\n4 x 5\n"[..]).expect_err("x");
        assert!(err.to_string().contains("line 3"), "{err}");
        let long = vec![b'1'; TRACE_LINE_BYTES_MAX + 10];
        assert!(read_trace(&long[..]).is_err());
        assert_eq!(read_trace(&b"7 # eight\n9"[..]).expect("ok"), vec![7, 9]);
    }

    #[test]
    fn workloads_parse_and_stay_in_range() {
        for text in [
            "sequential",
            "uniform",
            "zipf:0.99",
            "zipf",
            "hotscan",
            "loop",
        ] {
            let w = Workload::parse(text).expect(text);
            let trace = w.generate(1000, 20_000, 1).expect("trace");
            assert_eq!(trace.len(), 20_000);
            assert!(trace.iter().all(|&p| p < 1000), "{text}");
            assert_eq!(
                trace,
                w.generate(1000, 20_000, 1).expect("again"),
                "{text} not reproducible"
            );
        }
        assert!(Workload::parse("zipf:-1").is_err());
        assert!(Workload::parse("zipf:abc").is_err());
        assert!(Workload::parse("mystery").is_err());
        assert!(Workload::Uniform.generate(0, 10, 1).is_err());
    }

    #[test]
    fn zipf_is_skewed_towards_page_zero() {
        let trace = Workload::Zipf { theta: 0.99 }
            .generate(10_000, 100_000, 3)
            .expect("trace");
        let zeros = trace.iter().filter(|&&p| p == 0).count();
        let tail = trace.iter().filter(|&&p| p >= 5000).count();
        assert!(zeros > 5_000, "page 0 drawn {zeros} times");
        assert!(tail < 15_000, "upper half drawn {tail} times");
    }

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_cache_pages("10%", 1000).expect("10%"), 100);
        assert_eq!(parse_cache_pages("250", 1000).expect("250"), 250);
        for bad in ["0%", "101%", "0", "x", "0.01%"] {
            assert!(parse_cache_pages(bad, 1000).is_err(), "{bad}");
        }
    }

    /// The target for the scan-resistant policies, on the simulator (which the
    /// paging bench checks again on the real cache): on hot set + scan at a 10% cache,
    /// s3fifo or arc misses at least 10 points less than LRU.
    #[test]
    fn scan_resistant_policies_beat_lru_on_hot_set_and_scan() {
        let trace = Workload::HotScan
            .generate(20_000, 400_000, 9)
            .expect("trace");
        let capacity = parse_cache_pages("10%", 20_000).expect("10%");
        let runs = simulate_all(&POLICY_NAMES, capacity, &trace, 9).expect("runs");
        let ratio = |name: &str| {
            runs.iter()
                .find(|r| r.policy == name)
                .expect(name)
                .counts
                .miss_ratio()
        };
        let best = ratio("s3fifo").min(ratio("arc"));
        assert!(
            ratio("lru") - best >= 0.10,
            "lru {:.3}, s3fifo {:.3}, arc {:.3}",
            ratio("lru"),
            ratio("s3fifo"),
            ratio("arc")
        );
    }

    /// On a skewed trace CLOCK approximates LRU (its bits keep the hot pages) while FIFO
    /// evicts them in turn: CLOCK misses clearly less than FIFO and close to LRU. A CLOCK
    /// that behaved as FIFO would miss as often as FIFO and fail here.
    #[test]
    fn clock_tracks_lru_and_beats_fifo_on_a_skewed_trace() {
        let trace = Workload::Zipf { theta: 0.99 }
            .generate(10_000, 200_000, 11)
            .expect("trace");
        let capacity = parse_cache_pages("10%", 10_000).expect("10%");
        let runs = simulate_all(&["lru", "clock", "fifo"], capacity, &trace, 11).expect("runs");
        let ratio = |name: &str| {
            runs.iter()
                .find(|r| r.policy == name)
                .expect(name)
                .counts
                .miss_ratio()
        };
        let (lru, clock, fifo) = (ratio("lru"), ratio("clock"), ratio("fifo"));
        assert!(
            fifo - clock >= 0.02 && (clock - lru).abs() <= 0.02,
            "lru {lru:.3}, clock {clock:.3}, fifo {fifo:.3}"
        );
    }

    #[test]
    fn every_policy_misses_every_access_of_a_loop_one_larger_than_lru_can_hold() {
        let trace = Workload::Loop.generate(101, 10_100, 1).expect("loop");
        let lru = simulate(
            by_name("lru", 100, 0).expect("lru").as_mut(),
            100,
            trace.iter().copied(),
        );
        assert_eq!(
            lru.misses, lru.accesses,
            "LRU on a loop of capacity + 1 misses every time"
        );
        let random = simulate(
            by_name("random", 100, 0).expect("random").as_mut(),
            100,
            trace.iter().copied(),
        );
        assert!(
            random.misses < lru.misses / 2,
            "random should keep most of the loop: {random:?}"
        );
    }
}
