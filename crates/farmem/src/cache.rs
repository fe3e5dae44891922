//! The page cache: a byte budget of local frames over a [`PageStore`], with the policy
//! and prefetcher chosen by name. A miss fetches the page and whatever the prefetcher
//! asks for in one batch, after writing back the dirty pages evicted to make room in one
//! batch; pinned pages are never evicted.

use crate::policy::{self, Policy};
use crate::prefetch::{prefetcher_by_name, Prefetcher};
use crate::store::{PageStore, PendingRead};
use crate::{Error, PageId, PageMap, PageSet};

/// Most fault-handler threads a FarRegion may have.
pub const FAULT_HANDLERS_MAX: usize = 8;
/// Handlers a FarRegion gets unless its config says otherwise: enough to overlap a few
/// threads' remote reads without a herd of idle threads waking on every fault.
pub const FAULT_HANDLERS_DEFAULT: usize = 4;

/// How a cache is set up.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Local memory for page frames; the cache holds `local_bytes_max / page_bytes` pages.
    pub local_bytes_max: u64,
    /// An eviction policy by name (see [`crate::POLICY_NAMES`]).
    pub policy: String,
    /// A prefetcher by name (see [`crate::PREFETCHER_NAMES`]).
    pub prefetch: String,
    /// Most pages one access may prefetch.
    pub prefetch_window_pages: u64,
    /// Seed of the random policy.
    pub seed: u64,
    /// Threads serving a `FarRegion`'s page faults (1 to
    /// [`FAULT_HANDLERS_MAX`]); faults on different pages overlap their
    /// remote reads up to this many. The page cache (FarVec) ignores it.
    pub fault_handlers: usize,
}

impl CacheConfig {
    pub fn new(local_bytes_max: u64) -> Self {
        CacheConfig {
            local_bytes_max,
            policy: "lru".into(),
            prefetch: "none".into(),
            prefetch_window_pages: 32,
            seed: 1,
            fault_handlers: FAULT_HANDLERS_DEFAULT,
        }
    }
}

/// What the cache did, for benches and `stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Page accesses (one per page an access touches).
    pub accesses: u64,
    pub hits: u64,
    /// Accesses that had to wait for the store (prefetched pages count as hits).
    pub misses: u64,
    pub prefetched: u64,
    /// Prefetched pages that were used before being evicted.
    pub prefetch_used: u64,
    pub evictions: u64,
    /// Dirty pages written back (on eviction or flush).
    pub written_back: u64,
    /// Whole pages moved by the direct path ([`PageCache::read_direct`],
    /// [`PageCache::write_direct`]), not through frames (nor counted as accesses).
    pub direct_pages: u64,
}

impl CacheStats {
    pub fn miss_ratio(&self) -> f64 {
        if self.accesses == 0 {
            0.0
        } else {
            self.misses as f64 / self.accesses as f64
        }
    }
}

/// Most pages one read or write makes resident in one batch.
pub const FAULT_GROUP_PAGES_MAX: usize = 256;

/// The direct path takes a span only when it covers at least this many whole pages;
/// smaller ones go through the frames, where their neighbours may be used again.
pub const DIRECT_PAGES_MIN: u64 = 16;

struct Frame {
    data: Box<[u8]>,
    dirty: bool,
    pins: u32,
}

pub struct PageCache<S: PageStore> {
    store: S,
    /// The store's size in pages, read once: every access checks its bounds against it,
    /// and asking the store costs a lock (LocalStore) or a division (RegionStore).
    store_pages: u64,
    page_bytes: usize,
    capacity_pages: usize,
    frames: PageMap<Frame>,
    policy: Box<dyn Policy>,
    prefetcher: Box<dyn Prefetcher>,
    /// Prefetched and not yet used.
    unused_prefetch: PageSet,
    stats: CacheStats,
    /// Reused between faults.
    wanted: Vec<PageId>,
    /// Reused between reads and writes: the pages of one fault group.
    group: Vec<(PageId, bool)>,
    /// Prefetches under way, oldest first: a batch's pages and its read. They take no
    /// frame until they complete — when one of their pages is touched, or when newer
    /// prefetches need room under [`CacheConfig`]'s capacity.
    inflight: std::collections::VecDeque<(u64, Vec<PageId>, PendingRead)>,
    /// Page → the batch reading it.
    inflight_pages: PageMap<u64>,
    next_batch: u64,
    /// The page the last access ended in (see the fast path in `for_each_piece`).
    last_page: Option<PageId>,
    /// Set when an eviction's write-back failed: its dirty pages had left their frames,
    /// so their only copy is gone, and from then on every call fails with this reason
    /// (serving on would answer older bytes from the store as if they were the latest,
    /// and a later `flush` would say all is written).
    lost: Option<String>,
}

impl<S: PageStore> PageCache<S> {
    pub fn new(store: S, config: &CacheConfig) -> Result<Self, Error> {
        let page_bytes = store.page_bytes();
        let capacity_pages =
            usize::try_from(config.local_bytes_max / page_bytes as u64).map_err(|_| {
                Error::Invalid("local memory larger than this machine can address".into())
            })?;
        if capacity_pages == 0 {
            return Err(Error::Invalid(format!(
                "local memory of {} B holds no {page_bytes} B page",
                config.local_bytes_max
            )));
        }
        Ok(PageCache {
            policy: policy::by_name(&config.policy, capacity_pages, config.seed)?,
            prefetcher: prefetcher_by_name(&config.prefetch, config.prefetch_window_pages)?,
            store_pages: store.pages(),
            store,
            page_bytes,
            capacity_pages,
            frames: PageMap::with_capacity_and_hasher(capacity_pages, Default::default()),
            unused_prefetch: PageSet::default(),
            stats: CacheStats::default(),
            wanted: Vec::new(),
            group: Vec::new(),
            inflight: std::collections::VecDeque::new(),
            inflight_pages: PageMap::default(),
            next_batch: 0,
            last_page: None,
            lost: None,
        })
    }

    pub fn store(&self) -> &S {
        &self.store
    }
    pub fn stats(&self) -> CacheStats {
        self.stats
    }
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    pub fn capacity_pages(&self) -> usize {
        self.capacity_pages
    }
    /// Bytes the cache can address: the store's pages.
    pub fn len_bytes(&self) -> u64 {
        self.store_pages * self.page_bytes as u64
    }
    pub fn resident_pages(&self) -> usize {
        self.frames.len()
    }

    /// Fails once a write-back has lost pages (see `lost`).
    fn alive(&self) -> Result<(), Error> {
        match &self.lost {
            Some(why) => Err(Error::WriteBackLost(why.clone())),
            None => Ok(()),
        }
    }

    /// Writes evicted dirty pages back; a failure loses them, and so the cache.
    fn write_back(&mut self, dirty: &[(PageId, &[u8])]) -> Result<(), Error> {
        if let Err(e) = self.store.write_pages(dirty) {
            let why = format!("{} dirty pages could not be written back: {e}", dirty.len());
            self.lost.get_or_insert(why.clone());
            return Err(Error::WriteBackLost(why));
        }
        self.stats.written_back += dirty.len() as u64;
        Ok(())
    }

    /// Copies `buf.len()` bytes from `offset` into `buf`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.for_each_piece(offset, buf.len(), false, |frame, in_page, at, len| {
            buf[at..at + len].copy_from_slice(&frame.data[in_page..in_page + len]);
        })
    }

    /// Copies `data` to `offset`; the touched pages become dirty and are written back
    /// when evicted or flushed. Pages the write covers whole are not read first.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.for_each_piece(offset, data.len(), true, |frame, in_page, at, len| {
            frame.data[in_page..in_page + len].copy_from_slice(&data[at..at + len]);
            frame.dirty = true;
        })
    }

    /// Like [`PageCache::read`], but the whole pages of a large span (at least
    /// [`DIRECT_PAGES_MIN`]) come straight from the store into `buf` — one copy, no frame
    /// taken, nothing evicted — for sequential bulk reads such as a sort's runs. Resident
    /// pages, which may be newer than the store, are copied over them from their frames.
    pub fn read_direct(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.alive()?;
        let Some((first, pages, head)) = self.direct_span(offset, buf.len())? else {
            return self.read(offset, buf);
        };
        let page_bytes = self.page_bytes;
        let middle = pages as usize * page_bytes;
        let (head_buf, rest) = buf.split_at_mut(head);
        let (middle_buf, tail_buf) = rest.split_at_mut(middle);
        self.read(offset, head_buf)?;
        self.store.read_run(first, middle_buf)?;
        self.for_resident_in(first, pages, |frame, at| {
            middle_buf[at * page_bytes..(at + 1) * page_bytes].copy_from_slice(&frame.data);
        });
        self.stats.direct_pages += pages;
        self.read((first + pages) * page_bytes as u64, tail_buf)
    }

    /// Like [`PageCache::write`], but the whole pages of a large span go straight to
    /// the store; resident copies of them are updated and are clean after.
    pub fn write_direct(&mut self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.alive()?;
        let Some((first, pages, head)) = self.direct_span(offset, data.len())? else {
            return self.write(offset, data);
        };
        let page_bytes = self.page_bytes;
        let middle = pages as usize * page_bytes;
        let (head_data, rest) = data.split_at(head);
        let (middle_data, tail_data) = rest.split_at(middle);
        self.write(offset, head_data)?;
        // A prefetch under way for one of these pages would land stale bytes: take it in
        // first, so the copy below updates it.
        let waiting: Vec<u64> = (first..first + pages)
            .filter_map(|p| self.inflight_pages.get(&p).copied())
            .collect();
        for id in waiting {
            if self.inflight.iter().any(|(b, _, _)| *b == id) {
                self.complete(id, &[])?;
            }
        }
        self.store.write_run(first, middle_data)?;
        self.for_resident_in(first, pages, |frame, at| {
            frame
                .data
                .copy_from_slice(&middle_data[at * page_bytes..(at + 1) * page_bytes]);
            frame.dirty = false;
        });
        self.stats.direct_pages += pages;
        self.write((first + pages) * page_bytes as u64, tail_data)
    }

    /// For a span of `len` bytes at `offset`, checked: (first whole page, whole pages,
    /// bytes before the first), or `None` when it covers fewer than
    /// [`DIRECT_PAGES_MIN`] whole pages.
    fn direct_span(&self, offset: u64, len: usize) -> Result<Option<(PageId, u64, usize)>, Error> {
        let end = offset
            .checked_add(len as u64)
            .filter(|&e| e <= self.len_bytes())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{len} bytes at {offset} are past the end ({} B)",
                    self.len_bytes()
                ))
            })?;
        let page_bytes = self.page_bytes as u64;
        let first = offset.div_ceil(page_bytes);
        let until = end / page_bytes;
        if until < first + DIRECT_PAGES_MIN {
            return Ok(None);
        }
        Ok(Some((
            first,
            until - first,
            (first * page_bytes - offset) as usize,
        )))
    }

    /// Calls `f` with each resident frame among pages `first..first + pages` and its
    /// index in that span, walking whichever is shorter: the span or the frames.
    fn for_resident_in(&mut self, first: PageId, pages: u64, mut f: impl FnMut(&mut Frame, usize)) {
        if (self.frames.len() as u64) < pages {
            for (p, frame) in self.frames.iter_mut() {
                if (first..first + pages).contains(p) {
                    f(frame, (p - first) as usize);
                }
            }
        } else {
            for p in first..first + pages {
                if let Some(frame) = self.frames.get_mut(&p) {
                    f(frame, (p - first) as usize);
                }
            }
        }
    }

    /// Keeps `page` resident until [`PageCache::unpin`]; pins nest.
    pub fn pin(&mut self, page: PageId) -> Result<(), Error> {
        self.alive()?;
        if page >= self.store_pages {
            return Err(Error::Invalid(format!("page {page} is past the end")));
        }
        self.fault_group(&[(page, false)])?;
        if let Some(f) = self.frames.get_mut(&page) {
            f.pins += 1;
        }
        Ok(())
    }

    pub fn unpin(&mut self, page: PageId) {
        if let Some(f) = self.frames.get_mut(&page) {
            f.pins = f.pins.saturating_sub(1);
        }
    }

    /// Makes pages `first..first + count` resident and pins each (a fault group at a
    /// time, each one batch to the store), for views that borrow their frames. Fails —
    /// pinning nothing — when the range is past the end or more than the cache holds.
    pub fn pin_range(&mut self, first: PageId, count: u64) -> Result<(), Error> {
        self.alive()?;
        let end = first
            .checked_add(count)
            .filter(|&e| e <= self.store_pages)
            .ok_or_else(|| Error::Invalid(format!("pages {first}..+{count} are past the end")))?;
        if count > self.capacity_pages as u64 {
            return Err(Error::Invalid(format!(
                "{count} pages cannot all be pinned in a cache of {} pages",
                self.capacity_pages
            )));
        }
        let group_max = (self.capacity_pages / 2).clamp(1, FAULT_GROUP_PAGES_MAX) as u64;
        let mut page = first;
        while page < end {
            let until = (page + group_max).min(end);
            let group: Vec<(PageId, bool)> = (page..until).map(|p| (p, false)).collect();
            if let Err(e) = self.fault_group(&group) {
                self.unpin_range(first, page - first);
                return Err(e);
            }
            for p in page..until {
                if let Some(f) = self.frames.get_mut(&p) {
                    f.pins += 1;
                }
            }
            page = until;
        }
        Ok(())
    }

    /// Undoes [`PageCache::pin_range`].
    pub fn unpin_range(&mut self, first: PageId, count: u64) {
        for p in first..first.saturating_add(count) {
            self.unpin(p);
        }
    }

    /// A resident page's bytes (for views of pinned pages).
    pub fn frame(&self, page: PageId) -> Option<&[u8]> {
        self.frames.get(&page).map(|f| &f.data[..])
    }

    /// A resident page's bytes to change: the page becomes dirty.
    pub fn frame_mut(&mut self, page: PageId) -> Option<&mut [u8]> {
        self.frames.get_mut(&page).map(|f| {
            f.dirty = true;
            &mut f.data[..]
        })
    }

    /// Writes every dirty page back, in one batch.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.alive()?;
        let mut dirty: Vec<PageId> = self
            .frames
            .iter()
            .filter(|(_, f)| f.dirty)
            .map(|(p, _)| *p)
            .collect();
        dirty.sort_unstable();
        let batch: Vec<(PageId, &[u8])> = dirty
            .iter()
            .filter_map(|p| self.frames.get(p).map(|f| (*p, &f.data[..])))
            .collect();
        self.store.write_pages(&batch)?;
        for p in &dirty {
            if let Some(f) = self.frames.get_mut(p) {
                f.dirty = false;
            }
        }
        self.stats.written_back += dirty.len() as u64;
        Ok(())
    }

    /// Splits `[offset, offset + len)` at page boundaries and hands each piece's frame to
    /// `f` with (offset in page, offset in the caller's buffer, length). The pages are
    /// made resident a group at a time (at most half the cache, at most
    /// [`FAULT_GROUP_PAGES_MAX`]), each group one batch to the store.
    fn for_each_piece(
        &mut self,
        offset: u64,
        len: usize,
        writing: bool,
        mut f: impl FnMut(&mut Frame, usize, usize, usize),
    ) -> Result<(), Error> {
        self.alive()?;
        let end = offset
            .checked_add(len as u64)
            .filter(|&e| e <= self.len_bytes())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{len} bytes at {offset} are past the end ({} B)",
                    self.len_bytes()
                ))
            })?;
        if len == 0 {
            return Ok(());
        }
        let page_bytes = self.page_bytes as u64;
        // Another access within the page the last one touched, still resident: a hit
        // that tells the policy (and the prefetchers, which ignore re-reads) nothing new,
        // so it costs one lookup and the copy — the common case of a scan.
        let page = offset / page_bytes;
        if (end - 1) / page_bytes == page && self.last_page == Some(page) {
            if let Some(frame) = self.frames.get_mut(&page) {
                self.stats.accesses += 1;
                self.stats.hits += 1;
                let in_page = (offset - page * page_bytes) as usize;
                f(frame, in_page, 0, len);
                return Ok(());
            }
        }
        let group_max = (self.capacity_pages / 2).clamp(1, FAULT_GROUP_PAGES_MAX);
        let (first, last) = (offset / page_bytes, (end - 1) / page_bytes);
        // Reused between calls: most accesses touch one resident page and should cost no
        // allocation.
        let mut group = std::mem::take(&mut self.group);
        let mut result = Ok(());
        let mut page = first;
        'groups: while page <= last {
            group.clear();
            while page <= last && group.len() < group_max {
                let whole = offset <= page * page_bytes && (page + 1) * page_bytes <= end;
                group.push((page, writing && whole));
                page += 1;
            }
            if let Err(e) = self.fault_group(&group) {
                result = Err(e);
                break;
            }
            self.last_page = group.last().map(|(p, _)| *p);
            for &(p, _) in &group {
                let from = offset.max(p * page_bytes);
                let until = end.min((p + 1) * page_bytes);
                let Some(frame) = self.frames.get_mut(&p) else {
                    result = Err(Error::Invalid(format!("page {p} vanished after its fault")));
                    break 'groups;
                };
                f(
                    frame,
                    (from - p * page_bytes) as usize,
                    (from - offset) as usize,
                    (until - from) as usize,
                );
            }
        }
        self.group = group;
        result
    }

    /// Makes every page of `group` resident (each with whether it is about to be
    /// overwritten whole, so need not be read), counting one access each; their
    /// prefetches ride in the same batch.
    fn fault_group(&mut self, group: &[(PageId, bool)]) -> Result<(), Error> {
        let mut wanted = std::mem::take(&mut self.wanted);
        wanted.clear();
        // Demand pages not resident: (page, overwritten whole).
        // Allocated only on a miss (a Vec allocates on its first push).
        let mut fetch: Vec<(PageId, bool)> = Vec::new();
        // A page still being prefetched: wait for its batch and take it in first.
        for &(page, _) in group {
            if let Some(&id) = self.inflight_pages.get(&page) {
                self.complete(id, group)?;
            }
        }
        for &(page, whole) in group {
            self.stats.accesses += 1;
            let hit = self.frames.contains_key(&page);
            self.prefetcher.on_access(page, hit, &mut wanted);
            if hit {
                self.stats.hits += 1;
                if self.unused_prefetch.remove(&page) {
                    self.stats.prefetch_used += 1;
                    // The use a demand miss would have been, not a second one.
                    self.policy.first_use(page);
                } else {
                    self.policy.touch(page);
                }
            } else if !fetch.iter().any(|(p, _)| *p == page) {
                self.stats.misses += 1;
                fetch.push((page, whole));
            }
        }
        let pages = self.store_pages;
        let in_group = |p: PageId| group.iter().any(|(g, _)| *g == p);
        // Prefetches go out now and are waited for only when used: in range, not
        // resident, not already under way, not in this group, and no more pages under
        // way than half the cache.
        let room = (self.capacity_pages / 2).saturating_sub(self.inflight_pages.len());
        let prefetch: Vec<PageId> = wanted
            .iter()
            .copied()
            .filter(|&p| {
                p < pages
                    && !self.frames.contains_key(&p)
                    && !self.inflight_pages.contains_key(&p)
                    && !in_group(p)
            })
            .take(room)
            .collect();
        self.wanted = wanted;
        if !fetch.is_empty() {
            self.fetch_demand(fetch, group)?;
        }
        // After the demand read, so the pages waited for now do not queue behind them.
        if !prefetch.is_empty() {
            let id = self.next_batch;
            self.next_batch += 1;
            for &p in &prefetch {
                self.inflight_pages.insert(p, id);
            }
            let read = self.store.start_read(&prefetch);
            self.inflight.push_back((id, prefetch, read));
        }
        Ok(())
    }

    /// Reads the group's missing pages (each with whether it is about to be overwritten
    /// whole) into frames the policy frees, in one batch after one batch of write-backs.
    fn fetch_demand(
        &mut self,
        mut fetch: Vec<(PageId, bool)>,
        group: &[(PageId, bool)],
    ) -> Result<(), Error> {
        let in_group = |p: PageId| group.iter().any(|(g, _)| *g == p);
        // Room, through the policy: every page of the group must get a frame.
        let mut victims: Vec<(PageId, Frame)> = Vec::new();
        let mut admitted = 0;
        for &(incoming, _) in &fetch {
            if self.frames.len() + admitted >= self.capacity_pages {
                let frames = &self.frames;
                let is_pinned =
                    |p: PageId| in_group(p) || frames.get(&p).is_some_and(|f| f.pins > 0);
                let Some(victim) = self.policy.evict(incoming, &is_pinned) else {
                    return Err(Error::Invalid(format!(
                        "every one of the cache's {} pages is pinned or in use",
                        self.capacity_pages
                    )));
                };
                if let Some(frame) = self.frames.remove(&victim) {
                    victims.push((victim, frame));
                }
                self.frames_removed(victim);
            }
            admitted += 1;
        }
        fetch.truncate(admitted);
        let dirty: Vec<(PageId, &[u8])> = victims
            .iter()
            .filter(|(_, f)| f.dirty)
            .map(|(p, f)| (*p, &f.data[..]))
            .collect();
        if !dirty.is_empty() {
            self.write_back(&dirty)?;
        }
        self.stats.evictions += victims.len() as u64;
        // The victims' buffers are reused for the incoming pages.
        let mut buffers: Vec<Box<[u8]>> = victims.into_iter().map(|(_, f)| f.data).collect();
        buffers.resize_with(fetch.len(), || {
            vec![0u8; self.page_bytes].into_boxed_slice()
        });
        let (to_read, read_buffers): (Vec<PageId>, Vec<usize>) = fetch
            .iter()
            .enumerate()
            .filter(|(_, (_, whole))| !whole)
            .map(|(i, (p, _))| (*p, i))
            .unzip();
        if !to_read.is_empty() {
            let mut reading: Vec<Box<[u8]>> = read_buffers
                .iter()
                .map(|&i| std::mem::take(&mut buffers[i]))
                .collect();
            self.store.read_pages(&to_read, &mut reading)?;
            for (&i, data) in read_buffers.iter().zip(reading) {
                buffers[i] = data;
            }
        }
        for ((p, _), data) in fetch.iter().zip(buffers) {
            self.frames.insert(
                *p,
                Frame {
                    data,
                    dirty: false,
                    pins: 0,
                },
            );
            self.policy.insert(*p);
        }
        Ok(())
    }

    /// Waits for prefetch batch `id` (and any older one) and takes its pages in, each only
    /// where the policy finds a victim that is not pinned, not in `group`, and no hotter
    /// than the prefetched page would be ([`Policy::evict_for_prefetch`]); the rest are
    /// dropped. Dirty victims are written back in one batch.
    fn complete(&mut self, id: u64, group: &[(PageId, bool)]) -> Result<(), Error> {
        while let Some((batch, pages, read)) = self.inflight.pop_front() {
            for p in &pages {
                self.inflight_pages.remove(p);
            }
            let buffers = read.wait()?;
            let mut victims: Vec<(PageId, Frame)> = Vec::new();
            let mut incoming: Vec<(PageId, bytes::Bytes)> = Vec::new();
            for (page, data) in pages.into_iter().zip(buffers) {
                if self.frames.contains_key(&page) {
                    continue;
                }
                if self.frames.len() + incoming.len() >= self.capacity_pages {
                    let frames = &self.frames;
                    let is_pinned = |p: PageId| {
                        group.iter().any(|(g, _)| *g == p)
                            || frames.get(&p).is_some_and(|f| f.pins > 0)
                    };
                    let Some(victim) = self.policy.evict_for_prefetch(page, &is_pinned) else {
                        break;
                    };
                    if let Some(frame) = self.frames.remove(&victim) {
                        victims.push((victim, frame));
                    }
                    self.frames_removed(victim);
                }
                incoming.push((page, data));
            }
            let dirty: Vec<(PageId, &[u8])> = victims
                .iter()
                .filter(|(_, f)| f.dirty)
                .map(|(p, f)| (*p, &f.data[..]))
                .collect();
            if !dirty.is_empty() {
                self.write_back(&dirty)?;
            }
            self.stats.evictions += victims.len() as u64;
            // The victims' buffers take the incoming pages: no allocation (and no fresh
            // page of memory to fault in) per page of a scan.
            let mut spare: Vec<Box<[u8]>> = victims.into_iter().map(|(_, f)| f.data).collect();
            for (page, bytes) in incoming {
                let data = match spare.pop() {
                    Some(mut buf) if buf.len() == bytes.len() => {
                        buf.copy_from_slice(&bytes);
                        buf
                    }
                    _ => Box::from(&bytes[..]),
                };
                self.frames.insert(
                    page,
                    Frame {
                        data,
                        dirty: false,
                        pins: 0,
                    },
                );
                self.policy.insert_prefetched(page);
                self.unused_prefetch.insert(page);
                self.stats.prefetched += 1;
            }
            if batch == id {
                break;
            }
        }
        Ok(())
    }

    fn frames_removed(&mut self, page: PageId) {
        self.unused_prefetch.remove(&page);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{simulate, Workload};
    use crate::store::LocalStore;
    use proptest::prelude::*;

    const PAGE: usize = 4096;

    /// A store whose page writes fail while `fail_writes` is set.
    struct FlakyStore {
        inner: LocalStore,
        fail_writes: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl PageStore for FlakyStore {
        fn page_bytes(&self) -> usize {
            self.inner.page_bytes()
        }
        fn pages(&self) -> u64 {
            self.inner.pages()
        }
        fn read_pages(&self, pages: &[PageId], out: &mut [Box<[u8]>]) -> Result<(), Error> {
            self.inner.read_pages(pages, out)
        }
        fn write_pages(&self, pages: &[(PageId, &[u8])]) -> Result<(), Error> {
            if self.fail_writes.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Error::Remote("the test store refused a write".into()));
            }
            self.inner.write_pages(pages)
        }
        fn traffic_bytes(&self) -> (u64, u64) {
            self.inner.traffic_bytes()
        }
    }

    /// An eviction whose write-back fails has lost its dirty pages: the cache then fails
    /// every call — it never answers the store's older bytes for them, and `flush` never
    /// says all is written — even once the store works again.
    #[test]
    fn a_failed_write_back_fails_the_cache_for_good() {
        let fail_writes = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let store = FlakyStore {
            inner: LocalStore::new(PAGE, 8).expect("store"),
            fail_writes: fail_writes.clone(),
        };
        let mut c = PageCache::new(store, &CacheConfig::new(2 * PAGE as u64)).expect("cache");
        c.write(0, &[1u8; PAGE]).unwrap();
        c.write(PAGE as u64, &[2u8; PAGE]).unwrap();
        fail_writes.store(true, std::sync::atomic::Ordering::SeqCst);
        let evicting = c.write(2 * PAGE as u64, &[3u8; PAGE]);
        assert!(
            matches!(evicting, Err(Error::WriteBackLost(_))),
            "{evicting:?}"
        );
        fail_writes.store(false, std::sync::atomic::Ordering::SeqCst);
        let mut back = vec![0u8; PAGE];
        for page in 0..3u64 {
            let read = c.read(page * PAGE as u64, &mut back);
            assert!(
                matches!(read, Err(Error::WriteBackLost(_))),
                "page {page}: {read:?}"
            );
        }
        assert!(matches!(c.flush(), Err(Error::WriteBackLost(_))));
        assert!(matches!(c.pin(0), Err(Error::WriteBackLost(_))));
    }

    fn cache(pages: u64, frames: u64, policy: &str, prefetch: &str) -> PageCache<LocalStore> {
        let store = LocalStore::new(PAGE, pages).expect("store");
        let mut config = CacheConfig::new(frames * PAGE as u64);
        config.policy = policy.into();
        config.prefetch = prefetch.into();
        PageCache::new(store, &config).expect("cache")
    }

    proptest! {
        /// Whatever was written reads back, through evictions and write-backs, for every
        /// policy and prefetcher, against a plain byte array.
        #[test]
        fn reads_see_writes_through_eviction(
            ops in proptest::collection::vec((any::<bool>(), 0u64..(16 * 4096 - 64), 1usize..9000, any::<u8>()), 1..60),
            policy in proptest::sample::select(crate::POLICY_NAMES.to_vec()),
            prefetch in proptest::sample::select(crate::PREFETCHER_NAMES.to_vec()),
        ) {
            let mut c = cache(16, 3, policy, prefetch);
            let mut model = vec![0u8; 16 * PAGE];
            for (write, offset, len, byte) in ops {
                let len = len.min(model.len() - offset as usize);
                let at = offset as usize;
                if write {
                    let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                    c.write(offset, &data).expect("write");
                    model[at..at + len].copy_from_slice(&data);
                } else {
                    let mut buf = vec![0u8; len];
                    c.read(offset, &mut buf).expect("read");
                    prop_assert_eq!(&buf[..], &model[at..at + len]);
                }
                prop_assert!(c.resident_pages() <= 3);
            }
            c.flush().expect("flush");
            let mut fresh = vec![vec![0u8; PAGE].into_boxed_slice(); 16];
            let all: Vec<PageId> = (0..16).collect();
            c.store().read_pages(&all, &mut fresh).expect("store read");
            prop_assert_eq!(fresh.concat(), model);
        }
    }

    proptest! {
        /// The direct path (whole pages straight to and from the store) mixed with the
        /// cached one: reads see every write whichever path made it — a dirty frame is
        /// newer than the store, a direct write updates the frame — and the store ends
        /// equal to a plain byte array.
        #[test]
        fn direct_and_cached_paths_agree(
            ops in proptest::collection::vec((0u8..4, 0u64..(64 * 4096 - 64), 1usize..(30 * 4096), any::<u8>()), 1..40),
            policy in proptest::sample::select(crate::POLICY_NAMES.to_vec()),
            prefetch in proptest::sample::select(crate::PREFETCHER_NAMES.to_vec()),
        ) {
            let mut c = cache(64, 8, policy, prefetch);
            let mut model = vec![0u8; 64 * PAGE];
            for (kind, offset, len, byte) in ops {
                let len = len.min(model.len() - offset as usize);
                let at = offset as usize;
                if kind % 2 == 1 {
                    let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add((i / 7) as u8)).collect();
                    if kind == 3 { c.write_direct(offset, &data).expect("write_direct") } else { c.write(offset, &data).expect("write") }
                    model[at..at + len].copy_from_slice(&data);
                } else {
                    let mut buf = vec![0u8; len];
                    if kind == 2 { c.read_direct(offset, &mut buf).expect("read_direct") } else { c.read(offset, &mut buf).expect("read") }
                    prop_assert_eq!(&buf[..], &model[at..at + len]);
                }
                prop_assert!(c.resident_pages() <= 8);
            }
            c.flush().expect("flush");
            let mut fresh = vec![vec![0u8; PAGE].into_boxed_slice(); 64];
            let all: Vec<PageId> = (0..64).collect();
            c.store().read_pages(&all, &mut fresh).expect("store read");
            prop_assert_eq!(fresh.concat(), model);
        }
    }

    #[test]
    fn large_spans_bypass_the_frames() {
        let mut c = cache(64, 4, "lru", "none");
        let data = vec![7u8; 40 * PAGE + 100];
        c.write_direct(50, &data).expect("write");
        // 39 whole pages went direct; the partial first and last through frames.
        assert_eq!(c.stats().direct_pages, 39, "{:?}", c.stats());
        assert!(c.stats().evictions == 0, "{:?}", c.stats());
        let mut back = vec![0u8; data.len()];
        c.read_direct(50, &mut back).expect("read");
        assert_eq!(back, data);
        assert_eq!(c.stats().direct_pages, 78);
        let mut small = vec![0u8; 3 * PAGE];
        c.read_direct(0, &mut small).expect("small read");
        assert_eq!(c.stats().direct_pages, 78, "a small span went direct");
    }

    /// The promise: the simulator and the real cache agree on the miss ratio for
    /// the same trace (here exactly: no prefetch, nothing pinned).
    #[test]
    fn cache_misses_what_the_simulator_predicts() {
        let trace = Workload::Zipf { theta: 0.9 }
            .generate(400, 5000, 4)
            .expect("trace");
        for name in crate::POLICY_NAMES {
            let mut c = cache(400, 40, name, "none");
            let mut byte = [0u8; 1];
            for &p in &trace {
                c.read(p * PAGE as u64, &mut byte).expect("read");
            }
            let mut policy = crate::policy::by_name(name, 40, 1).expect("policy");
            let sim = simulate(policy.as_mut(), 40, trace.iter().copied());
            assert_eq!(c.stats().misses, sim.misses, "{name}");
        }
    }

    #[test]
    fn sequential_prefetch_turns_a_scan_into_batches() {
        let mut none = cache(256, 64, "lru", "none");
        let mut seq = cache(256, 64, "lru", "sequential");
        let mut byte = [0u8; 1];
        for p in 0..256u64 {
            none.read(p * PAGE as u64, &mut byte).expect("read");
            seq.read(p * PAGE as u64, &mut byte).expect("read");
        }
        assert_eq!(none.stats().misses, 256);
        assert!(seq.stats().misses < 32, "{:?}", seq.stats());
        assert!(seq.stats().prefetch_used > 200, "{:?}", seq.stats());
    }

    /// A sequential scan with prefetch through a cache that also holds a hot set: the
    /// prefetches take frames only from pages no hotter than they would be, so under the
    /// policies with a notion of hotness beyond recency every hot page stays resident and
    /// every later use of one hits. (With plain `evict` for prefetches, CLOCK's hand
    /// clears the hot pages' bits on one pass and takes them on the next, between two of
    /// their uses.)
    #[test]
    fn prefetches_do_not_push_out_a_hot_set() {
        const FRAMES: u64 = 32;
        const SCAN_PAGES: u64 = 960;
        /// Scan pages between two uses of the hot set: more than the cache holds, so the
        /// clock hand passes each hot page more than once in between.
        const HOT_PERIOD: u64 = 48;
        let hot: Vec<u64> = (1000..1008).collect();
        for policy in ["s3fifo", "arc", "clock"] {
            let mut c = cache(1024, FRAMES, policy, "sequential");
            let mut b = [0u8; 8];
            for _ in 0..3 {
                for &h in &hot {
                    c.read(h * PAGE as u64, &mut b).expect("warm");
                }
            }
            let mut hot_misses = 0;
            for p in 0..SCAN_PAGES {
                c.read(p * PAGE as u64, &mut b).expect("scan");
                if p % HOT_PERIOD == HOT_PERIOD - 1 {
                    for &h in &hot {
                        let before = c.stats().misses;
                        c.read(h * PAGE as u64 + 8, &mut b).expect("hot");
                        hot_misses += c.stats().misses - before;
                    }
                }
            }
            assert_eq!(hot_misses, 0, "{policy}: {:?}", c.stats());
            assert!(
                c.stats().prefetch_used > SCAN_PAGES / 2,
                "{policy}: the scan was not prefetched: {:?}",
                c.stats()
            );
        }
    }

    #[test]
    fn pinned_pages_stay_and_a_full_pin_is_an_error() {
        let mut c = cache(8, 2, "lru", "none");
        c.pin(0).expect("pin 0");
        let mut b = [0u8; 1];
        for p in 1..8u64 {
            c.read(p * PAGE as u64, &mut b).expect("read");
        }
        assert!(c.frames.contains_key(&0), "a pinned page was evicted");
        c.pin(7).expect("pin 7");
        assert!(c.pin(8).is_err(), "page 8 is past the end");
        let err = c.read(3 * PAGE as u64, &mut b).expect_err("all pinned");
        assert!(err.to_string().contains("pinned"), "{err}");
        c.unpin(7);
        c.read(3 * PAGE as u64, &mut b).expect("room again");
    }

    #[test]
    fn out_of_range_and_bad_sizes_are_errors() {
        let mut c = cache(4, 2, "lru", "none");
        let mut b = [0u8; 2];
        assert!(c.read(4 * PAGE as u64 - 1, &mut b).is_err());
        assert!(c.write(u64::MAX, &b).is_err());
        let store = LocalStore::new(PAGE, 4).expect("store");
        assert!(
            PageCache::new(store, &CacheConfig::new(100)).is_err(),
            "no room for a page"
        );
        assert!(LocalStore::new(1000, 4).is_err(), "not a power of two");
    }
}
