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
    /// Resident pages the policy tracks.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

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

    #[test]
    fn unknown_policy_and_zero_capacity_are_errors() {
        assert!(by_name("mru", 4, 0).is_err());
        assert!(by_name("lru", 0, 0).is_err());
    }
}
