//! An ordered set of page numbers with O(1) insert at either end, removal of any member
//! and membership tests: the queue every list-based policy (LRU, FIFO, ARC's four lists,
//! S3-FIFO's three queues) is made of.

use crate::{PageId, PageMap};

#[derive(Debug, Clone, Copy)]
struct Links {
    /// Towards the front (the newest end).
    newer: Option<PageId>,
    /// Towards the back (the oldest end).
    older: Option<PageId>,
}

/// Pages in order from newest (front) to oldest (back).
#[derive(Debug, Default, Clone)]
pub struct PageList {
    links: PageMap<Links>,
    newest: Option<PageId>,
    oldest: Option<PageId>,
}

impl PageList {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.links.len()
    }

    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    pub fn contains(&self, page: PageId) -> bool {
        self.links.contains_key(&page)
    }

    pub fn oldest(&self) -> Option<PageId> {
        self.oldest
    }

    /// Adds `page` at the newest end; a page already present is moved there.
    pub fn push_newest(&mut self, page: PageId) {
        self.remove(page);
        let links = Links {
            newer: None,
            older: self.newest,
        };
        if let Some(old_front) = self.newest {
            if let Some(l) = self.links.get_mut(&old_front) {
                l.newer = Some(page);
            }
        }
        self.newest = Some(page);
        if self.oldest.is_none() {
            self.oldest = Some(page);
        }
        self.links.insert(page, links);
    }

    /// Removes `page`; returns whether it was present.
    pub fn remove(&mut self, page: PageId) -> bool {
        let Some(links) = self.links.remove(&page) else {
            return false;
        };
        match links.newer {
            Some(n) => {
                if let Some(l) = self.links.get_mut(&n) {
                    l.older = links.older;
                }
            }
            None => self.newest = links.older,
        }
        match links.older {
            Some(o) => {
                if let Some(l) = self.links.get_mut(&o) {
                    l.newer = links.newer;
                }
            }
            None => self.oldest = links.newer,
        }
        true
    }

    pub fn pop_oldest(&mut self) -> Option<PageId> {
        let page = self.oldest?;
        self.remove(page);
        Some(page)
    }

    /// The page one step newer than `page` (towards the front).
    pub fn newer_than(&self, page: PageId) -> Option<PageId> {
        self.links.get(&page).and_then(|l| l.newer)
    }

    /// Pages from oldest to newest.
    pub fn iter_oldest_first(&self) -> impl Iterator<Item = PageId> + '_ {
        std::iter::successors(self.oldest, move |p| self.newer_than(*p))
    }

    /// The oldest page for which `evictable` holds, looking at no more than the whole
    /// list once.
    pub fn oldest_where(&self, mut evictable: impl FnMut(PageId) -> bool) -> Option<PageId> {
        self.iter_oldest_first().find(|p| evictable(*p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    #[derive(Debug, Clone)]
    enum Step {
        Push(u8),
        Remove(u8),
        Pop,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..16).prop_map(Step::Push),
            (0u8..16).prop_map(Step::Remove),
            Just(Step::Pop),
        ]
    }

    proptest! {
        /// Against a VecDeque model (front = newest), after every step.
        #[test]
        fn behaves_like_a_deque(steps in proptest::collection::vec(step(), 0..200)) {
            let mut list = PageList::new();
            let mut model: VecDeque<PageId> = VecDeque::new();
            for s in steps {
                match s {
                    Step::Push(p) => {
                        let p = p as PageId;
                        list.push_newest(p);
                        model.retain(|x| *x != p);
                        model.push_front(p);
                    }
                    Step::Remove(p) => {
                        let p = p as PageId;
                        let was = model.contains(&p);
                        model.retain(|x| *x != p);
                        prop_assert_eq!(list.remove(p), was);
                    }
                    Step::Pop => prop_assert_eq!(list.pop_oldest(), model.pop_back()),
                }
                prop_assert_eq!(list.len(), model.len());
                let got: Vec<PageId> = list.iter_oldest_first().collect();
                let want: Vec<PageId> = model.iter().rev().copied().collect();
                prop_assert_eq!(got, want);
            }
        }
    }
}
