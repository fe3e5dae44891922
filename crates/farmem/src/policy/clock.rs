//! CLOCK (second chance): frames in a circle with a reference bit each; the hand clears
//! set bits as it passes and takes the first page whose bit is already clear. An LRU
//! approximation that costs a bit per page and no list update on a hit.

use super::Policy;
use crate::{PageId, PageMap};

#[derive(Debug, Clone, Copy)]
struct Frame {
    page: PageId,
    referenced: bool,
}

#[derive(Debug)]
pub struct Clock {
    frames: Vec<Option<Frame>>,
    slot_of: PageMap<usize>,
    free: Vec<usize>,
    hand: usize,
}

impl Clock {
    pub fn new(capacity_pages: usize) -> Self {
        Clock {
            frames: vec![None; capacity_pages],
            slot_of: PageMap::with_capacity_and_hasher(capacity_pages, Default::default()),
            free: (0..capacity_pages).rev().collect(),
            hand: 0,
        }
    }
}

impl Policy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }
    fn touch(&mut self, page: PageId) {
        if let Some(&slot) = self.slot_of.get(&page) {
            if let Some(frame) = self.frames[slot].as_mut() {
                frame.referenced = true;
            }
        }
    }
    fn insert(&mut self, page: PageId) {
        // The cache evicts before inserting when full; growing is only for a caller
        // that inserts past the capacity it gave, and keeps the policy consistent.
        let slot = self.free.pop().unwrap_or_else(|| {
            self.frames.push(None);
            self.frames.len() - 1
        });
        self.frames[slot] = Some(Frame {
            page,
            referenced: false,
        });
        self.slot_of.insert(page, slot);
    }
    fn evict(&mut self, _incoming: PageId, pinned: &dyn Fn(PageId) -> bool) -> Option<PageId> {
        let n = self.frames.len();
        // Two full turns clear every bit once and then find any unpinned page.
        for _ in 0..2 * n + 1 {
            let slot = self.hand;
            self.hand = (self.hand + 1) % n.max(1);
            let Some(frame) = self.frames.get_mut(slot).and_then(|f| f.as_mut()) else {
                continue;
            };
            if pinned(frame.page) {
                continue;
            }
            if frame.referenced {
                frame.referenced = false;
                continue;
            }
            let page = frame.page;
            self.frames[slot] = None;
            self.slot_of.remove(&page);
            self.free.push(slot);
            return Some(page);
        }
        None
    }
    /// A prefetched page would enter unreferenced; a page whose bit is set has been used
    /// since the hand last passed it, so it is hotter. From the hand, clearing nothing
    /// (at most `PREFETCH_VICTIM_SCAN_MAX` frames): the first unreferenced, unpinned
    /// page, or none.
    fn evict_for_prefetch(
        &mut self,
        _incoming: PageId,
        pinned: &dyn Fn(PageId) -> bool,
    ) -> Option<PageId> {
        let n = self.frames.len();
        for step in 0..n.min(super::PREFETCH_VICTIM_SCAN_MAX) {
            let slot = (self.hand + step) % n;
            let Some(frame) = self.frames[slot] else {
                continue;
            };
            if frame.referenced || pinned(frame.page) {
                continue;
            }
            self.hand = (slot + 1) % n;
            self.frames[slot] = None;
            self.slot_of.remove(&frame.page);
            self.free.push(slot);
            return Some(frame.page);
        }
        None
    }
    /// Its arrival, like a demand page's: the bit stays clear.
    fn first_use(&mut self, _page: PageId) {}
    fn remove(&mut self, page: PageId) {
        if let Some(slot) = self.slot_of.remove(&page) {
            self.frames[slot] = None;
            self.free.push(slot);
        }
    }
    fn len(&self) -> usize {
        self.slot_of.len()
    }
}
