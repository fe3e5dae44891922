//! ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST '03). Resident pages seen
//! once (T1) and seen at least twice (T2), and ghosts of each (B1, B2: page numbers of
//! recent evictions). A miss that hits a ghost list says which side was cut too short,
//! and moves the target size `p` of T1 towards it: recency and frequency are balanced
//! by the trace itself, and a scan (pages seen once) cannot flush T2.

use super::Policy;
use crate::list::PageList;
use crate::PageId;

#[derive(Debug)]
pub struct AdaptiveReplacement {
    capacity: usize,
    /// Target size of T1, in pages: 0..=capacity.
    p: usize,
    t1: PageList,
    t2: PageList,
    b1: PageList,
    b2: PageList,
}

impl AdaptiveReplacement {
    pub fn new(capacity_pages: usize) -> Self {
        AdaptiveReplacement {
            capacity: capacity_pages,
            p: 0,
            t1: PageList::new(),
            t2: PageList::new(),
            b1: PageList::new(),
            b2: PageList::new(),
        }
    }

    /// The paper's REPLACE: demote the oldest page of T1 or of T2 to its ghost list.
    fn replace(&mut self, incoming_in_b2: bool, pinned: &dyn Fn(PageId) -> bool) -> Option<PageId> {
        let t1_len = self.t1.len();
        let prefer_t1 = t1_len > 0 && (t1_len > self.p || (incoming_in_b2 && t1_len == self.p));
        for from_t1 in [prefer_t1, !prefer_t1] {
            let (list, ghost) = if from_t1 {
                (&mut self.t1, &mut self.b1)
            } else {
                (&mut self.t2, &mut self.b2)
            };
            if let Some(victim) = list.oldest_where(|p| !pinned(p)) {
                list.remove(victim);
                ghost.push_newest(victim);
                self.trim_ghosts();
                return Some(victim);
            }
        }
        None
    }

    /// Keeps the directory to its bounds: |T1| + |B1| ≤ c and everything ≤ 2c.
    fn trim_ghosts(&mut self) {
        while self.t1.len() + self.b1.len() > self.capacity && self.b1.pop_oldest().is_some() {}
        while self.t1.len() + self.t2.len() + self.b1.len() + self.b2.len() > 2 * self.capacity {
            if self.b2.pop_oldest().is_none() && self.b1.pop_oldest().is_none() {
                break;
            }
        }
    }
}

impl Policy for AdaptiveReplacement {
    fn name(&self) -> &'static str {
        "arc"
    }
    fn touch(&mut self, page: PageId) {
        if self.t1.remove(page) || self.t2.contains(page) {
            self.t2.push_newest(page);
        }
    }
    fn insert(&mut self, page: PageId) {
        if self.b1.remove(page) || self.b2.remove(page) {
            self.t2.push_newest(page);
        } else {
            self.t1.push_newest(page);
        }
        self.trim_ghosts();
    }
    fn evict(&mut self, incoming: PageId, pinned: &dyn Fn(PageId) -> bool) -> Option<PageId> {
        let (b1, b2) = (self.b1.len(), self.b2.len());
        if self.b1.contains(incoming) {
            let delta = (b2 / b1.max(1)).max(1);
            self.p = (self.p + delta).min(self.capacity);
            return self.replace(false, pinned);
        }
        if self.b2.contains(incoming) {
            let delta = (b1 / b2.max(1)).max(1);
            self.p = self.p.saturating_sub(delta);
            return self.replace(true, pinned);
        }
        if self.t1.len() + b1 >= self.capacity {
            if self.t1.len() < self.capacity {
                self.b1.pop_oldest();
            } else if let Some(victim) = self.t1.oldest_where(|p| !pinned(p)) {
                // T1 alone fills the cache: its oldest page leaves without a ghost.
                self.t1.remove(victim);
                return Some(victim);
            }
        } else if self.t1.len() + self.t2.len() + b1 + b2 >= 2 * self.capacity {
            self.b2.pop_oldest();
        }
        self.replace(false, pinned)
    }
    /// A prefetched page would enter T1 (seen once). T2 pages have been used at least
    /// twice: hotter. The victim is T1's oldest unpinned page, remembered in B1 as
    /// REPLACE does; `p` does not move (a prefetch is not a ghost hit).
    fn evict_for_prefetch(
        &mut self,
        _incoming: PageId,
        pinned: &dyn Fn(PageId) -> bool,
    ) -> Option<PageId> {
        let victim = self.t1.oldest_where(|p| !pinned(p))?;
        self.t1.remove(victim);
        self.b1.push_newest(victim);
        self.trim_ghosts();
        Some(victim)
    }
    /// Into T1, out of any ghost list, `p` untouched: arriving by prefetch says nothing
    /// about which side was cut too short.
    fn insert_prefetched(&mut self, page: PageId) {
        if !self.b1.remove(page) {
            self.b2.remove(page);
        }
        self.t1.push_newest(page);
        self.trim_ghosts();
    }
    /// Its arrival: T1's newest end, as a demand insert, not a second use.
    fn first_use(&mut self, page: PageId) {
        if self.t1.contains(page) {
            self.t1.push_newest(page);
        }
    }
    fn remove(&mut self, page: PageId) {
        if !self.t1.remove(page) {
            self.t2.remove(page);
        }
    }
    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }
}
