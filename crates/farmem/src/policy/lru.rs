//! Least recently used: the page untouched for longest leaves first.

use super::Policy;
use crate::list::PageList;
use crate::PageId;

#[derive(Debug, Default)]
pub struct Lru {
    /// Newest = most recently used.
    pages: PageList,
}

impl Lru {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn touch(&mut self, page: PageId) {
        self.pages.push_newest(page);
    }
    fn insert(&mut self, page: PageId) {
        self.pages.push_newest(page);
    }
    fn evict(&mut self, _incoming: PageId, pinned: &dyn Fn(PageId) -> bool) -> Option<PageId> {
        let victim = self.pages.oldest_where(|p| !pinned(p))?;
        self.pages.remove(victim);
        Some(victim)
    }
    fn remove(&mut self, page: PageId) {
        self.pages.remove(page);
    }
    fn len(&self) -> usize {
        self.pages.len()
    }
}
