//! First in, first out: the page resident longest leaves first, however hot it is.

use super::Policy;
use crate::list::PageList;
use crate::PageId;

#[derive(Debug, Default)]
pub struct Fifo {
    /// Newest = most recently loaded.
    pages: PageList,
}

impl Fifo {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn touch(&mut self, _page: PageId) {}
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
