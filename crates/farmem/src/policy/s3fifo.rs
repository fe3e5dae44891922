//! S3-FIFO (Yang et al., SOSP '23): three FIFO queues. New pages enter a small queue
//! (a tenth of the cache); one that is used again while there moves to the main queue,
//! one that is not leaves at once and is remembered in a ghost queue, so that if it
//! comes back soon it goes straight to main. Main is a FIFO with reinsertion (a page
//! with a non-zero use count goes round again, its count decremented). One-hit pages —
//! a scan — pass through the small queue without disturbing the hot pages in main.

use super::Policy;
use crate::list::PageList;
use crate::{PageId, PageMap};

/// Use counts saturate here (two bits, as in the paper).
const FREQ_MAX: u8 = 3;

#[derive(Debug)]
pub struct S3Fifo {
    small: PageList,
    main: PageList,
    /// Pages evicted from `small` without a second use; page numbers only.
    ghost: PageList,
    freq: PageMap<u8>,
    small_target: usize,
    ghost_max: usize,
}

impl S3Fifo {
    pub fn new(capacity_pages: usize) -> Self {
        let small_target = (capacity_pages / 10).max(1);
        S3Fifo {
            small: PageList::new(),
            main: PageList::new(),
            ghost: PageList::new(),
            freq: PageMap::with_capacity_and_hasher(capacity_pages, Default::default()),
            small_target,
            ghost_max: capacity_pages.saturating_sub(small_target).max(1),
        }
    }

    fn remember_ghost(&mut self, page: PageId) {
        self.ghost.push_newest(page);
        while self.ghost.len() > self.ghost_max {
            self.ghost.pop_oldest();
        }
    }
}

impl Policy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }
    fn touch(&mut self, page: PageId) {
        if let Some(f) = self.freq.get_mut(&page) {
            *f = (*f + 1).min(FREQ_MAX);
        }
    }
    fn insert(&mut self, page: PageId) {
        if self.ghost.remove(page) {
            self.main.push_newest(page);
        } else {
            self.small.push_newest(page);
        }
        self.freq.insert(page, 0);
    }
    fn evict(&mut self, _incoming: PageId, pinned: &dyn Fn(PageId) -> bool) -> Option<PageId> {
        // Each round either evicts, moves a page from small to main, or moves a page to
        // the new end of its queue with its count lowered; a page goes round at most
        // FREQ_MAX + 1 times before it is taken, so this bound is never reached unless
        // every page is pinned.
        // Each round either evicts, moves a page from small to main, or moves a page to
        // the new end of its queue (pinned, or with its count lowered); a page goes round
        // at most FREQ_MAX + 1 times before it is taken, so this bound is reached only
        // when every page is pinned.
        let rounds_max = (self.small.len() + self.main.len()) * (FREQ_MAX as usize + 2) + 2;
        // Pinned pages met in a row in each queue: a whole queue of them sends the
        // search to the other one.
        let (mut small_pinned, mut main_pinned) = (0usize, 0usize);
        for _ in 0..rounds_max {
            let small_stuck = small_pinned >= self.small.len();
            let main_stuck = main_pinned >= self.main.len();
            if small_stuck && main_stuck {
                return None;
            }
            let from_small = !small_stuck
                && (self.small.len() >= self.small_target || self.main.is_empty() || main_stuck);
            if from_small {
                let page = self.small.oldest()?;
                if pinned(page) {
                    small_pinned += 1;
                    self.small.push_newest(page);
                    continue;
                }
                small_pinned = 0;
                let used = self.freq.get(&page).copied().unwrap_or(0);
                self.small.remove(page);
                if used > 0 {
                    self.freq.insert(page, 0);
                    self.main.push_newest(page);
                    main_pinned = 0;
                    continue;
                }
                self.freq.remove(&page);
                self.remember_ghost(page);
                return Some(page);
            }
            let page = self.main.oldest()?;
            if pinned(page) {
                main_pinned += 1;
                self.main.push_newest(page);
                continue;
            }
            main_pinned = 0;
            let used = self.freq.get(&page).copied().unwrap_or(0);
            if used > 0 {
                self.freq.insert(page, used - 1);
                self.main.push_newest(page);
                continue;
            }
            self.main.remove(page);
            self.freq.remove(&page);
            return Some(page);
        }
        None
    }
    /// A prefetched page would sit in the small queue with a count of zero. Pages in
    /// main (used again in small, or back from the ghost list) and small pages used
    /// since they came are hotter; the victim is the oldest small page never used, which
    /// leaves for the ghost list as in [`Policy::evict`]. Nothing is moved otherwise.
    fn evict_for_prefetch(
        &mut self,
        _incoming: PageId,
        pinned: &dyn Fn(PageId) -> bool,
    ) -> Option<PageId> {
        let victim = self
            .small
            .iter_oldest_first()
            .take(super::PREFETCH_VICTIM_SCAN_MAX)
            .find(|&p| self.freq.get(&p).copied().unwrap_or(0) == 0 && !pinned(p))?;
        self.small.remove(victim);
        self.freq.remove(&victim);
        self.remember_ghost(victim);
        Some(victim)
    }
    /// Into the small queue whatever the ghost list says: a prefetch is no sign that an
    /// evicted page is wanted again.
    fn insert_prefetched(&mut self, page: PageId) {
        self.ghost.remove(page);
        self.small.push_newest(page);
        self.freq.insert(page, 0);
    }
    /// The use a demand miss would have been: the count stays where insertion left it.
    fn first_use(&mut self, _page: PageId) {}
    fn remove(&mut self, page: PageId) {
        if self.small.remove(page) || self.main.remove(page) {
            self.freq.remove(&page);
        }
    }
    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }
}
