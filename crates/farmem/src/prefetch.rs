//! Prefetchers: given each access and whether it hit, which pages to fetch ahead of use.
//! Pure, like the policies: the cache sends what they name as one batch and inserts each
//! page only where the policy finds a victim that is neither pinned nor hotter than the
//! prefetched page would be (`Policy::evict_for_prefetch`); otherwise the page is
//! dropped. That rule is the cache's and the policy's, not the prefetcher's.

use std::collections::VecDeque;

use crate::{Error, PageId};

/// No prefetcher asks for more pages than this after one access.
pub const PREFETCH_WINDOW_PAGES_MAX: u64 = 256;

pub trait Prefetcher: Send {
    fn name(&self) -> &'static str;
    /// Called for every access; appends to `out` the pages to fetch now (at most
    /// [`PREFETCH_WINDOW_PAGES_MAX`]; possibly already resident — the cache skips those).
    fn on_access(&mut self, page: PageId, hit: bool, out: &mut Vec<PageId>);
}

pub const PREFETCHER_NAMES: [&str; 3] = ["none", "sequential", "trend"];

pub fn prefetcher_by_name(name: &str, window_pages_max: u64) -> Result<Box<dyn Prefetcher>, Error> {
    if window_pages_max == 0 || window_pages_max > PREFETCH_WINDOW_PAGES_MAX {
        return Err(Error::Invalid(format!(
            "prefetch window {window_pages_max} pages: must be 1..={PREFETCH_WINDOW_PAGES_MAX}"
        )));
    }
    Ok(match name {
        "none" => Box::new(NoPrefetch),
        "sequential" => Box::new(Sequential::new(window_pages_max)),
        "trend" => Box::new(Trend::new(window_pages_max)),
        other => {
            return Err(Error::Invalid(format!(
                "unknown prefetcher {other:?}; one of {}",
                PREFETCHER_NAMES.join(", ")
            )))
        }
    })
}

pub struct NoPrefetch;

impl Prefetcher for NoPrefetch {
    fn name(&self) -> &'static str {
        "none"
    }
    fn on_access(&mut self, _page: PageId, _hit: bool, _out: &mut Vec<PageId>) {}
}

/// Readahead: while accesses go page after page, keep a window ahead of the reader that
/// doubles each time the reader reaches into it, up to the maximum; a jump resets it.
pub struct Sequential {
    window_max: u64,
    window: u64,
    last: Option<PageId>,
    /// Pages below this were already asked for.
    issued_until: PageId,
}

impl Sequential {
    pub fn new(window_pages_max: u64) -> Self {
        Sequential {
            window_max: window_pages_max,
            window: 0,
            last: None,
            issued_until: 0,
        }
    }
}

impl Prefetcher for Sequential {
    fn name(&self) -> &'static str {
        "sequential"
    }
    fn on_access(&mut self, page: PageId, _hit: bool, out: &mut Vec<PageId>) {
        // More reads within the same page say nothing about the direction.
        if self.last == Some(page) {
            return;
        }
        let sequential = self.last.is_some_and(|l| page == l.wrapping_add(1));
        self.last = Some(page);
        if !sequential {
            self.window = 0;
            self.issued_until = page.saturating_add(1);
            return;
        }
        // Like the kernel's asynchronous readahead: ask for the next window only once the
        // reader is within half a window of the pages already asked for, so each
        // request carries half a window or more instead of one page per access.
        let ahead = self.issued_until.saturating_sub(page.saturating_add(1));
        if self.window > 0 && ahead > self.window / 2 {
            return;
        }
        self.window = (self.window * 2).clamp(2, self.window_max);
        let from = self.issued_until.max(page.saturating_add(1));
        let until = page.saturating_add(1).saturating_add(self.window);
        out.extend(from..until);
        self.issued_until = self.issued_until.max(until);
    }
}

/// Leap's trend detection (Al Maruf & Chowdhury, ATC '20): the majority stride among the
/// recent accesses (Boyer–Moore vote over a window that widens until one is found) is
/// the trend; fetch along it, more pages while it holds, none when there is no majority.
pub struct Trend {
    window_max: u64,
    deltas: VecDeque<i64>,
    last: Option<PageId>,
    amount: u64,
    /// The stride pages were last asked along, and how far along it they reach.
    frontier: Option<(i64, PageId)>,
}

/// Strides remembered (Leap's access history).
const TREND_HISTORY: usize = 32;
/// The narrowest window a majority is looked for in.
const TREND_WINDOW_MIN: usize = 4;

impl Trend {
    pub fn new(window_pages_max: u64) -> Self {
        Trend {
            window_max: window_pages_max,
            deltas: VecDeque::with_capacity(TREND_HISTORY),
            last: None,
            amount: 0,
            frontier: None,
        }
    }

    /// The stride held by more than half of the newest `w` deltas, widening `w` from
    /// [`TREND_WINDOW_MIN`] to the whole history.
    fn majority(&self) -> Option<i64> {
        let mut w = TREND_WINDOW_MIN;
        while w <= self.deltas.len() {
            let recent = self.deltas.iter().rev().take(w);
            let (mut candidate, mut votes) = (0i64, 0usize);
            for &d in recent.clone() {
                if votes == 0 {
                    candidate = d;
                }
                votes = if d == candidate { votes + 1 } else { votes - 1 };
            }
            if recent.filter(|&&d| d == candidate).count() * 2 > w {
                return Some(candidate);
            }
            w *= 2;
        }
        None
    }
}

impl Prefetcher for Trend {
    fn name(&self) -> &'static str {
        "trend"
    }
    fn on_access(&mut self, page: PageId, hit: bool, out: &mut Vec<PageId>) {
        if self.last == Some(page) {
            return;
        }
        if let Some(last) = self.last {
            let delta = page.wrapping_sub(last) as i64;
            if self.deltas.len() == TREND_HISTORY {
                self.deltas.pop_front();
            }
            self.deltas.push_back(delta);
        }
        self.last = Some(page);
        let Some(stride) = self.majority().filter(|&d| d != 0) else {
            self.amount = 0;
            return;
        };
        // Leap grows the amount while prefetched pages are being used (hits) and
        // starts small again after a miss.
        self.amount = if hit {
            (self.amount * 2).clamp(1, self.window_max)
        } else {
            (self.amount / 2).max(1)
        };
        // Pages already asked for along this stride, ahead of the reader: ask again
        // only when fewer than half the amount remain (as the sequential readahead does).
        let ahead = match self.frontier {
            Some((s, edge)) if s == stride => {
                let steps = (edge.wrapping_sub(page) as i64) / stride;
                steps.clamp(0, self.amount as i64) as u64
            }
            _ => 0,
        };
        if ahead > self.amount / 2 {
            return;
        }
        let mut next = page.wrapping_add((stride as u64).wrapping_mul(ahead));
        for _ in ahead..self.amount {
            next = next.wrapping_add(stride as u64);
            out.push(next);
        }
        self.frontier = Some((stride, next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &mut dyn Prefetcher, trace: &[PageId]) -> Vec<Vec<PageId>> {
        trace
            .iter()
            .map(|&page| {
                let mut out = Vec::new();
                p.on_access(page, true, &mut out);
                out
            })
            .collect()
    }

    #[test]
    fn sequential_window_grows_and_never_repeats_a_page() {
        let mut p = Sequential::new(16);
        let asked = run(&mut p, &(100..140).collect::<Vec<_>>());
        assert!(asked[0].is_empty(), "one access is not a sequence");
        assert_eq!(asked[1], vec![102, 103], "window starts at 2");
        let all: Vec<PageId> = asked.concat();
        let mut dedup = all.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(all.len(), dedup.len(), "a page asked for twice");
        assert!(asked.iter().all(|a| a.len() as u64 <= 16));
        // Readahead stays at least half a window ahead, in requests of half a window
        // or more once it has grown.
        assert!(all.iter().max().is_some_and(|&m| m >= 139 + 8), "{asked:?}");
        assert!(asked.iter().any(|a| a.len() >= 8), "{asked:?}");
        assert!(
            asked.iter().filter(|a| !a.is_empty()).count() < 20,
            "one request per access: {asked:?}"
        );
    }

    #[test]
    fn rereading_a_page_keeps_the_stream() {
        for name in ["sequential", "trend"] {
            let mut p = prefetcher_by_name(name, 16).expect("known");
            let mut asked = 0;
            for page in 0..64u64 {
                for _ in 0..8 {
                    let mut out = Vec::new();
                    p.on_access(page, true, &mut out);
                    asked += out.len();
                }
            }
            assert!(
                asked > 32,
                "{name}: eight reads per page broke the stream ({asked} pages asked)"
            );
        }
    }

    #[test]
    fn sequential_resets_on_a_jump() {
        let mut p = Sequential::new(64);
        run(&mut p, &[1, 2, 3, 4, 5]);
        let mut out = Vec::new();
        p.on_access(1000, false, &mut out);
        assert!(out.is_empty());
        p.on_access(1001, false, &mut out);
        assert_eq!(out, vec![1002, 1003]);
    }

    #[test]
    fn trend_follows_a_stride_through_noise() {
        let mut p = Trend::new(8);
        // Stride 3 with one outlier in every eight accesses (two odd strides each): still a
        // majority.
        let mut trace = Vec::new();
        let mut page = 1000u64;
        for i in 0..40 {
            page += 3;
            trace.push(if i % 8 == 5 { 7 } else { page });
        }
        let asked = run(&mut p, &trace);
        let last = asked.last().expect("asked");
        assert!(!last.is_empty(), "no prefetch on a clear trend");
        assert!(last.windows(2).all(|w| w[1] == w[0] + 3), "{last:?}");
    }

    #[test]
    fn trend_is_quiet_without_a_majority() {
        let mut p = Trend::new(8);
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        let trace: Vec<PageId> = (0..64).map(|_| rng.gen_range(0..1_000_000)).collect();
        let asked = run(&mut p, &trace);
        assert!(asked.iter().skip(8).all(|a| a.is_empty()), "{asked:?}");
    }

    #[test]
    fn names_and_windows_are_checked() {
        assert!(prefetcher_by_name("sequential", 0).is_err());
        assert!(prefetcher_by_name("sequential", PREFETCH_WINDOW_PAGES_MAX + 1).is_err());
        assert!(prefetcher_by_name("psychic", 8).is_err());
        for n in PREFETCHER_NAMES {
            assert_eq!(prefetcher_by_name(n, 8).expect("known").name(), n);
        }
    }
}
