//! Random eviction: the baseline every policy should beat, and the one with no
//! pathological trace.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::Policy;
use crate::{PageId, PageMap};

/// Random picks tried before falling back to a scan, when pinned pages are drawn.
const RANDOM_TRIES_MAX: usize = 8;

#[derive(Debug)]
pub struct Random {
    pages: Vec<PageId>,
    index_of: PageMap<usize>,
    rng: SmallRng,
}

impl Random {
    pub fn new(seed: u64) -> Self {
        Random {
            pages: Vec::new(),
            index_of: PageMap::default(),
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    fn take(&mut self, index: usize) -> PageId {
        let page = self.pages.swap_remove(index);
        self.index_of.remove(&page);
        if let Some(&moved) = self.pages.get(index) {
            self.index_of.insert(moved, index);
        }
        page
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn touch(&mut self, _page: PageId) {}
    fn insert(&mut self, page: PageId) {
        self.index_of.insert(page, self.pages.len());
        self.pages.push(page);
    }
    fn evict(&mut self, _incoming: PageId, pinned: &dyn Fn(PageId) -> bool) -> Option<PageId> {
        let n = self.pages.len();
        if n == 0 {
            return None;
        }
        for _ in 0..RANDOM_TRIES_MAX {
            let i = self.rng.gen_range(0..n);
            if !pinned(self.pages[i]) {
                return Some(self.take(i));
            }
        }
        let start = self.rng.gen_range(0..n);
        let i = (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| !pinned(self.pages[i]))?;
        Some(self.take(i))
    }
    fn remove(&mut self, page: PageId) {
        if let Some(i) = self.index_of.get(&page).copied() {
            self.take(i);
        }
    }
    fn len(&self) -> usize {
        self.pages.len()
    }
}
