//! Eviction policies: which resident page leaves the cache when a new one needs room.
//!
//! Each policy is pure bookkeeping over page numbers — no memory, no I/O — so the page
//! cache and the trace simulator drive the very same code, and every policy is tested
//! without a socket. The cache calls [`Policy::touch`] on a hit; on a miss it calls
//! [`Policy::evict`] while it is full (naming the page that is coming in, which ARC needs
//! to adapt) and then [`Policy::insert`]. Pages the cache has pinned are never chosen.
//! Uses of one page straight after one another reach the policy as one `touch` (a scan
//! reading a page in small pieces is not re-referencing it).

mod arc;
mod clock;
mod fifo;
mod lru;
mod random;
mod s3fifo;

pub use arc::AdaptiveReplacement;
pub use clock::Clock;
pub use fifo::Fifo;
pub use lru::Lru;
pub use random::Random;
pub use s3fifo::S3Fifo;

use crate::{Error, PageId};

/// What a policy must keep track of. `capacity_pages` is fixed at construction.
pub trait Policy: Send {
    fn name(&self) -> &'static str;
    /// A resident page was used.
    fn touch(&mut self, page: PageId);
    /// `page`, not resident, becomes resident. The cache holds at most the capacity, so
    /// it calls [`Policy::evict`] first when it is full.
    fn insert(&mut self, page: PageId);
    /// Chooses a resident page for which `pinned` is false, forgets it and returns it;
    /// `None` when every resident page is pinned (or none is resident). `incoming` is the
    /// page the room is for.
    fn evict(&mut self, incoming: PageId, pinned: &dyn Fn(PageId) -> bool) -> Option<PageId>;
    /// Forgets a resident page the cache dropped for its own reasons.
    fn remove(&mut self, page: PageId);
    /// Makes room for a page the prefetcher asked for, which nobody has used yet: like
    /// [`Policy::evict`], but the victim must be no hotter than `incoming` would be once
    /// [`Policy::insert_prefetched`] put it in. When every unpinned page is hotter it
    /// returns `None` and changes nothing, and the prefetched page is dropped: a guess
    /// never pushes out a page the policy has seen used. The default suits policies
    /// whose order places a new page above every page they would evict (LRU, FIFO:
    /// the newest; random: no order at all).
    fn evict_for_prefetch(
        &mut self,
        incoming: PageId,
        pinned: &dyn Fn(PageId) -> bool,
    ) -> Option<PageId> {
        self.evict(incoming, pinned)
    }
    /// `page`, not resident, becomes resident because the prefetcher asked for it, not
    /// because it was used: no policy takes its arrival as a sign of reuse.
    fn insert_prefetched(&mut self, page: PageId) {
        self.insert(page);
    }
    /// The first use of a prefetched page: the use a demand miss would have been, so it
    /// counts as the page's arrival, not as a re-reference (frequency-aware policies
    /// must not credit it twice). The default is a touch, right for recency alone.
    fn first_use(&mut self, page: PageId) {
        self.touch(page);
    }
    /// Resident pages the policy tracks.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Pages a policy looks at, from its eviction end, for a victim a prefetch may take:
/// past this many hotter ones it gives up and the prefetched page is dropped, so a
/// prefetch never walks a large cache of hot pages.
pub const PREFETCH_VICTIM_SCAN_MAX: usize = 64;

/// Every policy's name, in the order the simulator and the bench print them.
pub const POLICY_NAMES: [&str; 6] = ["lru", "clock", "fifo", "random", "s3fifo", "arc"];

/// A policy by name (see [`POLICY_NAMES`]), for a cache of `capacity_pages` pages;
/// `seed` feeds the one policy that draws at random.
pub fn by_name(name: &str, capacity_pages: usize, seed: u64) -> Result<Box<dyn Policy>, Error> {
    if capacity_pages == 0 {
        return Err(Error::Invalid(
            "a cache needs room for at least one page".into(),
        ));
    }
    Ok(match name {
        "lru" => Box::new(Lru::new()),
        "clock" => Box::new(Clock::new(capacity_pages)),
        "fifo" => Box::new(Fifo::new()),
        "random" => Box::new(Random::new(seed)),
        "s3fifo" => Box::new(S3Fifo::new(capacity_pages)),
        "arc" => Box::new(AdaptiveReplacement::new(capacity_pages)),
        other => {
            return Err(Error::Invalid(format!(
                "unknown policy {other:?}; one of {}",
                POLICY_NAMES.join(", ")
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// Runs `trace` through a cache of `capacity` pages driven exactly as the page cache
    /// drives a policy, checking the bookkeeping after every access.
    fn drive(policy: &mut dyn Policy, capacity: usize, trace: &[PageId], pinned: &HashSet<PageId>) {
        let mut resident: HashSet<PageId> = HashSet::new();
        for &page in trace {
            if resident.contains(&page) {
                policy.touch(page);
            } else {
                if resident.len() == capacity {
                    let is_pinned = |p: PageId| pinned.contains(&p);
                    match policy.evict(page, &is_pinned) {
                        Some(victim) => {
                            assert!(
                                resident.remove(&victim),
                                "{} evicted {victim}, not resident",
                                policy.name()
                            );
                            assert!(
                                !pinned.contains(&victim),
                                "{} evicted pinned {victim}",
                                policy.name()
                            );
                        }
                        None => {
                            assert!(
                                resident.iter().all(|p| pinned.contains(p)),
                                "{} found no victim among unpinned pages",
                                policy.name()
                            );
                            continue;
                        }
                    }
                }
                policy.insert(page);
                resident.insert(page);
            }
            assert_eq!(policy.len(), resident.len(), "{}", policy.name());
        }
    }

    proptest! {
        /// Every policy keeps exactly the cache's resident set, never evicts a page that
        /// is not resident, and never a pinned one.
        #[test]
        fn policies_track_the_resident_set(
            capacity in 1usize..12,
            trace in proptest::collection::vec(0u64..40, 0..400),
            pinned in proptest::collection::hash_set(0u64..40, 0..6),
        ) {
            for name in POLICY_NAMES {
                let mut p = by_name(name, capacity, 7).expect("policy");
                drive(p.as_mut(), capacity, &trace, &pinned);
            }
        }

        /// `remove` of a resident page leaves the policy consistent.
        #[test]
        fn remove_then_continue(capacity in 2usize..10, trace in proptest::collection::vec(0u64..30, 1..200)) {
            for name in POLICY_NAMES {
                let mut p = by_name(name, capacity, 3).expect("policy");
                let mut resident: Vec<PageId> = Vec::new();
                for (i, &page) in trace.iter().enumerate() {
                    if resident.contains(&page) {
                        if i % 5 == 0 {
                            p.remove(page);
                            resident.retain(|x| *x != page);
                        } else {
                            p.touch(page);
                        }
                        continue;
                    }
                    if resident.len() == capacity {
                        let v = p.evict(page, &|_| false).expect("a victim");
                        prop_assert!(resident.contains(&v));
                        resident.retain(|x| *x != v);
                    }
                    p.insert(page);
                    resident.push(page);
                    prop_assert_eq!(p.len(), resident.len());
                }
            }
        }
    }

    #[derive(Debug, Clone, Copy)]
    enum Step {
        /// A demand access.
        Use(PageId),
        /// The prefetcher brings a page in.
        Prefetch(PageId),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        proptest::collection::vec(
            prop_oneof![
                (0u64..30).prop_map(Step::Use),
                (0u64..30).prop_map(Step::Prefetch),
            ],
            0..300,
        )
    }

    proptest! {
        /// Prefetches driven as the cache drives them: a prefetch never takes a pinned or
        /// non-resident page, one that finds no victim changes nothing (the resident set
        /// stays the same size), and the bookkeeping matches the resident set throughout.
        #[test]
        fn prefetches_take_no_pinned_page_and_a_refusal_changes_nothing(
            capacity in 1usize..10,
            trace in steps(),
            pinned in proptest::collection::hash_set(0u64..30, 0..5),
        ) {
            for name in POLICY_NAMES {
                let mut p = by_name(name, capacity, 5).expect("policy");
                let mut resident: HashSet<PageId> = HashSet::new();
                let mut unused: HashSet<PageId> = HashSet::new();
                let is_pinned = |q: PageId| pinned.contains(&q);
                for &step in &trace {
                    match step {
                        Step::Use(page) if resident.contains(&page) => {
                            if unused.remove(&page) {
                                p.first_use(page);
                            } else {
                                p.touch(page);
                            }
                        }
                        Step::Use(page) => {
                            if resident.len() == capacity {
                                let Some(v) = p.evict(page, &is_pinned) else { continue };
                                prop_assert!(resident.remove(&v) && !pinned.contains(&v));
                                unused.remove(&v);
                            }
                            p.insert(page);
                            resident.insert(page);
                        }
                        Step::Prefetch(page) if resident.contains(&page) => {}
                        Step::Prefetch(page) => {
                            if resident.len() == capacity {
                                match p.evict_for_prefetch(page, &is_pinned) {
                                    Some(v) => {
                                        prop_assert!(resident.remove(&v), "{} took {} not resident", name, v);
                                        prop_assert!(!pinned.contains(&v), "{} took pinned {}", name, v);
                                        unused.remove(&v);
                                    }
                                    None => {
                                        prop_assert_eq!(p.len(), resident.len(), "{} changed on a refusal", name);
                                        continue;
                                    }
                                }
                            }
                            p.insert_prefetched(page);
                            resident.insert(page);
                            unused.insert(page);
                        }
                    }
                    prop_assert_eq!(p.len(), resident.len(), "{}", name);
                }
            }
        }
    }

    /// Fills a policy with `pages` by demand.
    fn filled(name: &str, capacity: usize, pages: std::ops::Range<PageId>) -> Box<dyn Policy> {
        let mut p = by_name(name, capacity, 1).expect("policy");
        for page in pages {
            p.insert(page);
        }
        p
    }

    const NOTHING_PINNED: &dyn Fn(PageId) -> bool = &|_| false;

    /// CLOCK: a page used since the hand passed (bit set) is hotter than a prefetched one
    /// would be (bit clear). A prefetch takes only unreferenced pages, clearing no bit;
    /// with every page referenced it takes none — where `evict` would clear the bits
    /// and take one. A prefetched page's first use is its arrival, not a reference.
    #[test]
    fn clock_prefetch_takes_only_unreferenced_pages() {
        let mut p = filled("clock", 4, 0..4);
        for page in [0, 1, 2] {
            p.touch(page);
        }
        assert_eq!(p.evict_for_prefetch(9, NOTHING_PINNED), Some(3));
        p.insert_prefetched(9);
        p.first_use(9);
        assert_eq!(
            p.evict_for_prefetch(10, NOTHING_PINNED),
            Some(9),
            "a prefetched page used once is no hotter than a new one"
        );
        p.insert_prefetched(10);
        p.first_use(10);
        p.touch(10);
        assert_eq!(p.evict_for_prefetch(11, NOTHING_PINNED), None);
        assert_eq!(p.len(), 4, "a refused prefetch evicted something");
        // Demand still gets room: the hand clears the bits it passes.
        assert!(p.evict(11, NOTHING_PINNED).is_some());
    }

    /// S3-FIFO: pages promoted to main, and small-queue pages used since they came, are
    /// hotter than a prefetched page (small queue, count zero).
    #[test]
    fn s3fifo_prefetch_takes_only_unused_small_queue_pages() {
        // Ten frames, a small-queue target of one.
        let mut p = filled("s3fifo", 10, 0..10);
        for page in 0..10 {
            p.touch(page);
        }
        // Demand: every used page moves to main; main's oldest (count reset) leaves.
        assert_eq!(p.evict(10, NOTHING_PINNED), Some(0));
        p.insert(10);
        // Small holds 10 (unused): the prefetch may take it.
        assert_eq!(p.evict_for_prefetch(20, NOTHING_PINNED), Some(10));
        p.insert_prefetched(20);
        p.first_use(20);
        assert_eq!(p.evict_for_prefetch(21, NOTHING_PINNED), Some(20));
        p.insert_prefetched(21);
        p.first_use(21);
        p.touch(21);
        // Small holds only a page used again, main only pages used before: all hotter.
        assert_eq!(p.evict_for_prefetch(22, NOTHING_PINNED), None);
        assert_eq!(p.len(), 10);
        assert!(
            p.evict(22, NOTHING_PINNED).is_some(),
            "demand still finds room"
        );
    }

    /// ARC: T2 (seen twice) is hotter than a prefetched page (T1, seen once).
    #[test]
    fn arc_prefetch_takes_only_pages_seen_once() {
        let mut p = filled("arc", 4, 0..4);
        for page in [0, 1] {
            p.touch(page);
        }
        assert_eq!(p.evict_for_prefetch(9, NOTHING_PINNED), Some(2));
        p.insert_prefetched(9);
        p.touch(3);
        p.first_use(9);
        assert_eq!(p.evict_for_prefetch(10, NOTHING_PINNED), Some(9));
        p.insert_prefetched(10);
        p.first_use(10);
        p.touch(10);
        assert_eq!(p.evict_for_prefetch(11, NOTHING_PINNED), None);
        assert_eq!(p.len(), 4);
        assert!(p.evict(11, NOTHING_PINNED).is_some());
    }

    /// LRU and FIFO put a new page at their newest end, above every page they would
    /// evict: a prefetch takes what a demand miss would, the oldest unpinned page.
    #[test]
    fn lru_and_fifo_prefetches_take_the_oldest_unpinned_page() {
        for (name, want) in [("lru", 2), ("fifo", 1)] {
            let mut p = filled(name, 4, 0..4);
            p.touch(0);
            p.touch(1);
            assert_eq!(p.evict_for_prefetch(9, &|q| q == 0), Some(want), "{name}");
        }
    }

    /// CLOCK gives a used page one second chance; FIFO gives none. Three frames, page 0
    /// used once after it came: CLOCK evicts 1, 2, then 0 (its bit cleared by the first
    /// pass); FIFO evicts 0, 1, 2. A CLOCK that ignored its bits would match FIFO.
    #[test]
    fn clock_gives_one_second_chance_and_fifo_none() {
        let order = |name: &str| -> Vec<PageId> {
            let mut p = filled(name, 3, 0..3);
            p.touch(0);
            (10..13)
                .map(|incoming| {
                    let v = p.evict(incoming, NOTHING_PINNED).expect("a victim");
                    p.insert(incoming);
                    v
                })
                .collect()
        };
        assert_eq!(order("clock"), vec![1, 2, 0]);
        assert_eq!(order("fifo"), vec![0, 1, 2]);
    }

    /// FIFO ignores use: a page used on every access still leaves when its turn comes.
    /// CLOCK keeps it as long as it is used between two passes of the hand.
    #[test]
    fn a_page_used_between_passes_stays_under_clock_but_not_fifo() {
        let kept = |name: &str| -> bool {
            let mut p = filled(name, 4, 0..4);
            let mut resident: HashSet<PageId> = (0..4).collect();
            for incoming in 100..120 {
                if resident.contains(&0) {
                    p.touch(0);
                }
                let v = p.evict(incoming, NOTHING_PINNED).expect("a victim");
                resident.remove(&v);
                p.insert(incoming);
                resident.insert(incoming);
            }
            resident.contains(&0)
        };
        assert!(kept("clock"), "clock evicted a page used on every access");
        assert!(!kept("fifo"), "fifo kept a page past its turn");
    }

    #[test]
    fn unknown_policy_and_zero_capacity_are_errors() {
        assert!(by_name("mru", 4, 0).is_err());
        assert!(by_name("lru", 0, 0).is_err());
    }
}
