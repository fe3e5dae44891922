//! `FarRegion`: a mapping whose pages live in a [`PageStore`], brought in by page faults
//! (userfaultfd) — so unmodified code, `slice::sort` or a C function, runs over far
//! memory. A handler thread serves each fault: it picks room through the eviction policy,
//! writes dirty victims back in one batch and drops them (`MADV_DONTNEED`), then reads
//! the faulting page and what the prefetcher asks for in one batch and installs them.
//!
//! Dirtiness is tracked exactly, by write protection: a page arrives write-protected
//! (unless the fault that brought it was a write), its first write faults once and marks
//! it dirty, and only dirty pages are written back. A page is write-protected again just
//! before its bytes are copied out, so a write racing an eviction waits for it and then
//! faults the page back in. Clean pages cost no write on eviction.
//!
//! The policy sees what faults show: a page's arrival (`insert`) and its first write
//! (`touch`). Reads of a present page do not fault, so recency-based policies rank pages
//! by arrival and first write only — LRU behaves close to FIFO here, as in any
//! fault-driven pager without access bits.
//!
//! A fault that cannot be served (the store failed) cannot be returned to the code that
//! made it: the region is marked failed with the error, and the faulting thread — and
//! every later one — gets SIGBUS, as a failed swap-in would deliver. [`FarRegion::failure`]
//! and [`FarRegion::flush`] report the error to code that can take it.

use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::cache::CacheConfig;
use crate::policy::{self, Policy};
use crate::prefetch::{prefetcher_by_name, Prefetcher};
use crate::store::PageStore;
use crate::uffd::{self, Fault, Mapping, OpenFailure, Program, Stop, Userfault};
use crate::{Error, PageId, PageMap, PageSet};

/// Dirty pages written back per store call by [`FarRegion::flush`].
const FLUSH_BATCH_PAGES_MAX: usize = 256;

/// What the region's fault handler did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionStats {
    /// Faults on a missing page (each one store read, with its prefetches).
    pub missing_faults: u64,
    /// First writes to a present, clean page.
    pub write_faults: u64,
    /// Pages installed ahead of use by the prefetcher.
    pub prefetched: u64,
    pub evictions: u64,
    /// Dirty pages written back (on eviction or flush).
    pub written_back: u64,
}

/// The handler's state; the program's thread takes it for `flush` and `stats`.
struct Core<S> {
    store: S,
    page_bytes: usize,
    pages: u64,
    capacity_pages: usize,
    /// Present pages → dirty.
    resident: PageMap<bool>,
    policy: Box<dyn Policy>,
    prefetcher: Box<dyn Prefetcher>,
    /// Prefetched pages not known to be used yet.
    unused_prefetch: PageSet,
    stats: RegionStats,
    /// Why the region stopped serving faults, once it has.
    failed: Option<String>,
    /// Page buffers kept between faults.
    spare: Vec<Box<[u8]>>,
}

/// A far memory region: `len()` bytes of this process's address space whose pages live
/// in a [`PageStore`], at most `local_bytes_max` of them present at once.
pub struct FarRegion<S: PageStore + 'static> {
    program: Program,
    map: Arc<Mapping>,
    uffd: Arc<Userfault>,
    core: Arc<Mutex<Core<S>>>,
    stop: Arc<Stop>,
    handler: Option<JoinHandle<()>>,
}

/// Turns a failed userfaultfd open into the error a user can act on.
fn open_error(failure: OpenFailure) -> Error {
    let device = match &failure.device {
        Some(e) => format!("/dev/userfaultfd: {e}"),
        None => "/dev/userfaultfd: not tried".into(),
    };
    let errno = failure.syscall.raw_os_error();
    if errno == Some(libc::EPERM) || errno == Some(libc::EACCES) {
        Error::UserfaultNotPermitted(format!(
            "{device}; userfaultfd(2): {}. Run as root (or with CAP_SYS_PTRACE), give this \
             user read-write access to /dev/userfaultfd (Linux 6.1+), or set \
             `sysctl vm.unprivileged_userfaultfd=1`; FarVec needs none of this",
            failure.syscall
        ))
    } else if errno == Some(libc::ENOSYS) {
        Error::Userfault(format!(
            "{device}; userfaultfd(2): {}: this kernel is built without \
             CONFIG_USERFAULTFD; use FarVec",
            failure.syscall
        ))
    } else {
        Error::Userfault(format!("{device}; userfaultfd(2): {}", failure.syscall))
    }
}

fn uffd_error(what: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::Userfault(format!("{what}: {e}"))
}

impl<S: PageStore + 'static> FarRegion<S> {
    /// A region over every page of `store`, with `config`'s local memory, policy and
    /// prefetcher. Its bytes are the store's (zeros for a new store) until written.
    pub fn new(store: S, config: &CacheConfig) -> Result<Self, Error> {
        let page_bytes = store.page_bytes();
        let pages = store.pages();
        let len = pages
            .checked_mul(page_bytes as u64)
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l > 0)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{pages} pages of {page_bytes} B: not a mappable region"
                ))
            })?;
        let capacity_pages = usize::try_from(config.local_bytes_max / page_bytes as u64)
            .map_err(|_| Error::Invalid("local memory larger than this machine".into()))?;
        if capacity_pages == 0 {
            return Err(Error::Invalid(format!(
                "local memory of {} B holds no {page_bytes} B page",
                config.local_bytes_max
            )));
        }
        let policy = policy::by_name(&config.policy, capacity_pages, config.seed)?;
        let prefetcher = prefetcher_by_name(&config.prefetch, config.prefetch_window_pages)?;

        let uffd = Userfault::open().map_err(open_error)?;
        uffd.handshake().map_err(|e| {
            Error::Userfault(format!(
                "the userfaultfd API handshake asking for write-protect faults and thread \
                 ids failed ({e}): Linux 5.7 or later is needed"
            ))
        })?;
        let (map, program) = Mapping::new(len).map_err(uffd_error("mapping the region"))?;
        uffd.register(&map).map_err(uffd_error(
            "registering the region for missing and write-protect faults",
        ))?;
        let stop = Arc::new(Stop::new().map_err(uffd_error("the handler's stop event"))?);
        let uffd = Arc::new(uffd);
        let core = Arc::new(Mutex::new(Core {
            store,
            page_bytes,
            pages,
            capacity_pages,
            resident: PageMap::default(),
            policy,
            prefetcher,
            unused_prefetch: PageSet::default(),
            stats: RegionStats::default(),
            failed: None,
            spare: Vec::new(),
        }));
        let handler = {
            let (map, uffd, core, stop) = (map.clone(), uffd.clone(), core.clone(), stop.clone());
            std::thread::Builder::new()
                .name("farmem-faults".into())
                .spawn(move || serve_faults(&map, &uffd, &core, &stop))
                .map_err(|e| Error::Userfault(format!("starting the fault handler: {e}")))?
        };
        Ok(FarRegion {
            program,
            map,
            uffd,
            core,
            stop,
            handler: Some(handler),
        })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The region's bytes: reading one that is not present faults it in.
    pub fn bytes(&self) -> &[u8] {
        self.program.bytes()
    }

    /// The region's bytes, writable: the first write to a present page marks it dirty.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.program.bytes_mut()
    }

    /// Writes every dirty page back (each write-protected first, so it is clean after).
    pub fn flush(&self) -> Result<(), Error> {
        let mut core = self.core.lock();
        if let Some(why) = &core.failed {
            return Err(Error::RegionFailed(why.clone()));
        }
        let mut dirty: Vec<PageId> = core
            .resident
            .iter()
            .filter(|(_, d)| **d)
            .map(|(p, _)| *p)
            .collect();
        dirty.sort_unstable();
        for batch in dirty.chunks(FLUSH_BATCH_PAGES_MAX) {
            core.write_back(&self.map, &self.uffd, batch)?;
            for p in batch {
                core.resident.insert(*p, false);
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> RegionStats {
        self.core.lock().stats
    }

    pub fn resident_pages(&self) -> usize {
        self.core.lock().resident.len()
    }

    pub fn capacity_pages(&self) -> usize {
        self.core.lock().capacity_pages
    }

    pub fn page_bytes(&self) -> usize {
        self.core.lock().page_bytes
    }

    /// Bytes the store has moved so far: (read, written).
    pub fn traffic_bytes(&self) -> (u64, u64) {
        self.core.lock().store.traffic_bytes()
    }

    /// Why the region stopped serving faults, if it has.
    pub fn failure(&self) -> Option<String> {
        self.core.lock().failed.clone()
    }

    fn stop_handler(&mut self) {
        if let Some(handler) = self.handler.take() {
            // Without the signal the handler would wait forever; if even the eventfd
            // write fails there is nothing safe left to do but leave the thread.
            if self.stop.signal().is_ok() {
                let _ = handler.join();
            }
        }
    }

    /// Flushes, stops the handler and gives the store back (the mapping is unmapped).
    pub fn into_store(self) -> Result<S, Error> {
        self.flush()?;
        self.into_store_discarding()
    }

    /// Stops the handler and gives the store back without writing dirty pages: for a
    /// region whose bytes are no longer wanted (its store is about to be freed), where a
    /// flush would only move bytes nobody reads. Fails only if the handler would not stop.
    pub fn into_store_discarding(self) -> Result<S, Error> {
        let core = self.core.clone();
        // Stops the handler, whose clones go with its thread, and drops ours.
        drop(self);
        match Arc::try_unwrap(core) {
            Ok(core) => Ok(core.into_inner().store),
            Err(_) => Err(Error::Userfault(
                "the fault handler did not stop, so its store is still in use".into(),
            )),
        }
    }
}

impl<S: PageStore + 'static> Drop for FarRegion<S> {
    /// Stops the handler before the region's handles go. Dirty pages not flushed are
    /// lost, as with `FarVec`.
    fn drop(&mut self) {
        self.stop_handler();
    }
}

fn serve_faults<S: PageStore>(map: &Mapping, uffd: &Userfault, core: &Mutex<Core<S>>, stop: &Stop) {
    let mut faults: Vec<Fault> = Vec::with_capacity(uffd::FAULTS_PER_READ_MAX);
    loop {
        match uffd.wait(stop) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                // Nothing more can be served; later faults would hang, so fail loudly.
                core.lock().failed = Some(format!("waiting for faults: {e}"));
                return;
            }
        }
        faults.clear();
        if let Err(e) = uffd.read_faults(map, &mut faults) {
            core.lock().failed = Some(format!("reading faults: {e}"));
            return;
        }
        let mut core = core.lock();
        for fault in &faults {
            if core.failed.is_some() {
                uffd::sigbus_thread(fault.thread_id);
                continue;
            }
            if let Err(e) = core.serve(map, uffd, fault) {
                core.failed = Some(e.to_string());
                uffd::sigbus_thread(fault.thread_id);
            }
        }
    }
}

impl<S: PageStore> Core<S> {
    fn offset(&self, page: PageId) -> usize {
        page as usize * self.page_bytes
    }

    fn buffer(&mut self) -> Box<[u8]> {
        self.spare
            .pop()
            .unwrap_or_else(|| vec![0u8; self.page_bytes].into_boxed_slice())
    }

    fn serve(&mut self, map: &Mapping, uffd: &Userfault, fault: &Fault) -> Result<(), Error> {
        let page = (fault.offset / self.page_bytes) as PageId;
        let (at, len) = (self.offset(page), self.page_bytes);
        if fault.write_protect {
            match self.resident.get_mut(&page) {
                Some(dirty) => {
                    *dirty = true;
                    self.stats.write_faults += 1;
                    self.policy.touch(page);
                    uffd.write_protect(map, at, len, false)
                        .map_err(uffd_error("lifting write protection"))?;
                }
                // Evicted while the writer waited: it retries and faults the page in.
                None => uffd
                    .wake(map, at, len)
                    .map_err(uffd_error("waking a writer"))?,
            }
            return Ok(());
        }
        if self.resident.contains_key(&page) {
            // A second thread's fault on a page served meanwhile.
            return uffd
                .wake(map, at, len)
                .map_err(uffd_error("waking a reader"));
        }
        self.stats.missing_faults += 1;
        self.note_prefetches_used(page);
        let mut wanted = Vec::new();
        self.prefetcher.on_access(page, false, &mut wanted);
        let prefetch_max = (self.capacity_pages - 1).min(self.capacity_pages / 2);
        let mut batch = vec![page];
        for p in wanted {
            if batch.len() > prefetch_max {
                break;
            }
            if p < self.pages && !self.resident.contains_key(&p) && !batch.contains(&p) {
                batch.push(p);
            }
        }
        // Room: through the policy, never evicting a page of this batch.
        let mut victims: Vec<(PageId, bool)> = Vec::new();
        while self.resident.len() + batch.len() > self.capacity_pages {
            let in_batch = |q: PageId| batch.contains(&q);
            match self.policy.evict(page, &in_batch) {
                Some(v) => {
                    let dirty = self.resident.remove(&v).unwrap_or(false);
                    self.unused_prefetch.remove(&v);
                    victims.push((v, dirty));
                }
                None if batch.len() > 1 => {
                    batch.pop();
                }
                None => {
                    return Err(Error::Invalid(format!(
                        "no page of the region's {} can be evicted",
                        self.capacity_pages
                    )))
                }
            }
        }
        let dirty: Vec<PageId> = victims
            .iter()
            .filter(|(_, d)| *d)
            .map(|(p, _)| *p)
            .collect();
        self.write_back(map, uffd, &dirty)?;
        for (v, _) in &victims {
            map.discard(self.offset(*v), self.page_bytes)
                .map_err(uffd_error("dropping an evicted page"))?;
        }
        self.stats.evictions += victims.len() as u64;
        let mut buffers: Vec<Box<[u8]>> = (0..batch.len()).map(|_| self.buffer()).collect();
        self.store.read_pages(&batch, &mut buffers)?;
        for (i, (&p, data)) in batch.iter().zip(&buffers).enumerate() {
            let demand = i == 0;
            // A write fault's page arrives writable and dirty: its write would fault
            // again at once otherwise.
            let writable = demand && fault.write;
            let installed = uffd
                .copy(map, self.offset(p), data, !writable)
                .map_err(uffd_error("installing a page"))?;
            if installed || demand {
                self.resident.insert(p, writable);
                self.policy.insert(p);
            }
            if !demand && installed {
                self.unused_prefetch.insert(p);
                self.stats.prefetched += 1;
            }
        }
        self.spare.extend(buffers);
        Ok(())
    }

    /// A reader going through prefetched pages makes no fault there, so the prefetcher
    /// would see a sequential scan as jumps. Before a fault, the prefetched pages just
    /// below it are told to it as the hits they were (oldest first).
    fn note_prefetches_used(&mut self, page: PageId) {
        let mut first = page;
        while first > 0 && self.unused_prefetch.contains(&(first - 1)) {
            first -= 1;
        }
        let mut ignored = Vec::new();
        for p in first..page {
            self.unused_prefetch.remove(&p);
            self.prefetcher.on_access(p, true, &mut ignored);
        }
    }

    /// Writes the named present pages to the store in one batch, each write-protected
    /// before its bytes are copied (so none changes during or after the copy unnoticed).
    fn write_back(
        &mut self,
        map: &Mapping,
        uffd: &Userfault,
        pages: &[PageId],
    ) -> Result<(), Error> {
        if pages.is_empty() {
            return Ok(());
        }
        let mut buffers: Vec<Box<[u8]>> = (0..pages.len()).map(|_| self.buffer()).collect();
        for (&p, buf) in pages.iter().zip(buffers.iter_mut()) {
            map.copy_out(uffd, self.offset(p), buf)
                .map_err(uffd_error("protecting a page to write it back"))?;
        }
        let batch: Vec<(PageId, &[u8])> = pages
            .iter()
            .zip(&buffers)
            .map(|(p, b)| (*p, &b[..]))
            .collect();
        self.store.write_pages(&batch)?;
        self.stats.written_back += pages.len() as u64;
        self.spare.extend(buffers);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LocalStore;

    const PAGE: usize = 4096;

    fn region(pages: u64, frames: u64, policy: &str, prefetch: &str) -> FarRegion<LocalStore> {
        let store = LocalStore::new(PAGE, pages).expect("store");
        let mut config = CacheConfig::new(frames * PAGE as u64);
        config.policy = policy.into();
        config.prefetch = prefetch.into();
        FarRegion::new(store, &config).expect("a far region (userfaultfd needs root here)")
    }

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(2654435761) >> 7) as u8
    }

    /// Plain stores and loads through a region four times its local memory, for every
    /// policy: every byte reads back, at most the budget is ever present, dirty pages are
    /// written back on eviction, and after `into_store` the store holds every byte.
    #[test]
    fn loads_and_stores_round_trip_through_a_region_larger_than_local_memory() {
        for policy in crate::POLICY_NAMES {
            let mut r = region(64, 16, policy, "sequential");
            let len = r.len();
            for (i, b) in r.bytes_mut().iter_mut().enumerate() {
                *b = pattern(i);
            }
            assert!(r.resident_pages() <= 16, "{policy}: {}", r.resident_pages());
            let bad = r
                .bytes()
                .iter()
                .enumerate()
                .rev()
                .find(|(i, b)| **b != pattern(*i));
            assert_eq!(bad, None, "{policy}: a byte did not read back");
            let stats = r.stats();
            assert!(stats.evictions >= 48, "{policy}: {stats:?}");
            assert!(stats.written_back >= 48, "{policy}: {stats:?}");
            let store = r.into_store().expect("into_store");
            let all: Vec<PageId> = (0..64).collect();
            let mut pages = vec![vec![0u8; PAGE].into_boxed_slice(); 64];
            store.read_pages(&all, &mut pages).expect("read");
            let flat = pages.concat();
            assert_eq!(flat.len(), len);
            assert!(
                flat.iter().enumerate().all(|(i, b)| *b == pattern(i)),
                "{policy}: the store lacks a written byte"
            );
        }
    }

    /// Dirtiness is exact: a read-only pass over a region writes nothing back; one write
    /// to one page writes that page back and no other.
    #[test]
    fn clean_pages_are_not_written_back() {
        let mut r = region(32, 4, "lru", "none");
        let sum: u64 = r.bytes().iter().map(|b| *b as u64).sum();
        assert_eq!(sum, 0);
        assert_eq!(r.stats().written_back, 0, "{:?}", r.stats());
        assert_eq!(r.stats().missing_faults, 32);
        r.bytes_mut()[5 * PAGE + 7] = 9;
        r.flush().expect("flush");
        assert_eq!(r.stats().written_back, 1, "{:?}", r.stats());
        assert_eq!(r.traffic_bytes().1, PAGE as u64);
        // The page is clean (write-protected) again: a second write faults once more.
        let before = r.stats().write_faults;
        r.bytes_mut()[5 * PAGE + 8] = 10;
        assert_eq!(r.stats().write_faults, before + 1, "{:?}", r.stats());
    }

    /// Unmodified `sort_unstable` over the mapped bytes, with a quarter of them local.
    #[test]
    fn slice_sort_runs_unmodified_over_a_region() {
        let mut r = region(64, 16, "clock", "sequential");
        let keys: &mut [u64] = bytemuck::cast_slice_mut(r.bytes_mut());
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for k in keys.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *k = x;
        }
        let mut expected = keys.to_vec();
        expected.sort_unstable();
        keys.sort_unstable();
        assert!(
            keys == &expected[..],
            "the far sort differs from the local one"
        );
        assert!(r.stats().evictions > 0, "{:?}", r.stats());
    }

    /// Threads writing and reading their own halves at once, through 8 frames: the races
    /// between one thread's write and the other's eviction of that page lose nothing.
    #[test]
    fn concurrent_writers_lose_nothing() {
        let mut r = region(64, 8, "fifo", "none");
        let (a, b) = r.bytes_mut().split_at_mut(32 * PAGE);
        std::thread::scope(|s| {
            for (half, base) in [(a, 0usize), (b, 32 * PAGE)] {
                s.spawn(move || {
                    for round in 0..3u8 {
                        for (i, x) in half.iter_mut().enumerate().step_by(512) {
                            *x = pattern(base + i).wrapping_add(round);
                        }
                    }
                });
            }
        });
        let bytes = r.bytes();
        for i in (0..bytes.len()).step_by(512) {
            assert_eq!(bytes[i], pattern(i).wrapping_add(2), "byte {i}");
        }
    }

    #[test]
    fn a_refused_userfaultfd_says_what_to_change() {
        let err = open_error(OpenFailure {
            device: Some(std::io::Error::from_raw_os_error(libc::EACCES)),
            syscall: std::io::Error::from_raw_os_error(libc::EPERM),
        });
        assert!(matches!(err, Error::UserfaultNotPermitted(_)), "{err:?}");
        let text = err.to_string();
        for says in [
            "not permitted",
            "vm.unprivileged_userfaultfd=1",
            "/dev/userfaultfd",
            "CAP_SYS_PTRACE",
        ] {
            assert!(text.contains(says), "{text}");
        }
        let err = open_error(OpenFailure {
            device: None,
            syscall: std::io::Error::from_raw_os_error(libc::ENOSYS),
        });
        assert!(err.to_string().contains("CONFIG_USERFAULTFD"), "{err}");
    }

    #[test]
    fn settings_out_of_range_are_errors() {
        let store = LocalStore::new(PAGE, 4).expect("store");
        assert!(FarRegion::new(store, &CacheConfig::new(100)).is_err());
        let store = LocalStore::new(PAGE, 4).expect("store");
        let mut config = CacheConfig::new(PAGE as u64);
        config.policy = "mru".into();
        assert!(FarRegion::new(store, &config).is_err());
    }
}
