//! `FarRegion`: a mapping whose pages live in a [`PageStore`], brought in by page faults
//! (userfaultfd) — so unmodified code, `slice::sort` or a C function, runs over far
//! memory. A small pool of handler threads serves the faults: for each, under the
//! region's lock, a handler picks room through the eviction policy and the pages to
//! bring (the faulting page and what the prefetcher asks for); then, without the lock,
//! it writes dirty victims back in one batch, drops them (`MADV_DONTNEED`), reads the
//! pages in one batch and installs them. So faults on different pages overlap their
//! remote reads, up to one per handler.
//!
//! Every page is owned by at most one handler while it moves: pages being brought in are
//! *arriving*, pages being evicted are *leaving*. A fault on a moving page is not served
//! twice: it is parked on the page and its thread woken (to retry) when the owner is
//! done, so each page is read and installed exactly once. A fault finding every frame
//! taken by moving pages is parked until some handler finishes.
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

use parking_lot::{Condvar, Mutex};

use crate::cache::CacheConfig;
use crate::policy::{self, Policy};
use crate::prefetch::{prefetcher_by_name, Prefetcher};
use crate::store::PageStore;
use crate::uffd::{self, Fault, Mapping, OpenFailure, Program, Stop, Userfault};
use crate::{Error, PageId, PageMap, PageSet};

/// Dirty pages written back per store call by [`FarRegion::flush`].
const FLUSH_BATCH_PAGES_MAX: usize = 256;
// Defined beside `CacheConfig::fault_handlers`, which they bound; named here too, where
// the handlers are.
pub use crate::cache::{FAULT_HANDLERS_DEFAULT, FAULT_HANDLERS_MAX};
/// Faults parked on one moving page (further ones are woken at once to fault again,
/// which costs a retry, not correctness).
const PARKED_PER_PAGE_MAX: usize = 64;
/// Faults parked waiting for a free frame.
const PARKED_FOR_ROOM_MAX: usize = 1024;
/// Longest `flush` waits for dirty pages a handler is writing back as it evicts them
/// (each write is one store round trip, itself bounded by the store's timeouts).
const FLUSH_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(300);

/// What the region's fault handlers did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionStats {
    /// Faults on a missing page that read it (each one store read, with its prefetches).
    pub missing_faults: u64,
    /// First writes to a present, clean page.
    pub write_faults: u64,
    /// Pages installed ahead of use by the prefetcher.
    pub prefetched: u64,
    pub evictions: u64,
    /// Dirty pages written back (on eviction or flush).
    pub written_back: u64,
    /// Faults that found their page already moving (arriving or leaving) and waited for
    /// the handler moving it, instead of reading it again.
    pub parked_faults: u64,
    /// Most store reads of faults in flight at once.
    pub reads_in_flight_max: u64,
}

/// The handlers' shared bookkeeping; the program's thread takes it for `flush` and
/// `stats`. Nothing here is held across a store round trip, except by `flush`.
struct Core {
    page_bytes: usize,
    pages: u64,
    capacity_pages: usize,
    /// Present pages → dirty.
    resident: PageMap<bool>,
    /// Pages a handler is bringing in → faults parked on them.
    arriving: PageMap<Vec<Fault>>,
    /// Pages a handler is evicting (no longer resident, not yet dropped) → faults parked.
    leaving: PageMap<Vec<Fault>>,
    /// The leaving pages that are dirty (their write-back is under way).
    leaving_dirty: PageSet,
    /// Faults that found every frame taken by moving pages.
    parked_for_room: Vec<Fault>,
    reads_in_flight: u64,
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

/// One missing fault's work, decided under the lock and carried out without it.
struct Plan {
    fault: Fault,
    /// The faulting page first, then its prefetches; all marked arriving.
    batch: Vec<PageId>,
    /// Evicted pages (marked leaving) and whether each is dirty.
    victims: Vec<(PageId, bool)>,
    /// One buffer per batch page, then one per dirty victim.
    buffers: Vec<Box<[u8]>>,
}

/// A far memory region: `len()` bytes of this process's address space whose pages live
/// in a [`PageStore`], at most `local_bytes_max` of them present at once.
pub struct FarRegion<S: PageStore + 'static> {
    program: Program,
    map: Arc<Mapping>,
    uffd: Arc<Userfault>,
    store: Arc<S>,
    core: Arc<Mutex<Core>>,
    /// Signalled whenever a handler finishes moving pages (for `flush`).
    settled: Arc<Condvar>,
    stop: Arc<Stop>,
    handlers: Vec<JoinHandle<()>>,
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
        if !(1..=FAULT_HANDLERS_MAX).contains(&config.fault_handlers) {
            return Err(Error::Invalid(format!(
                "{} fault handlers: 1 to {FAULT_HANDLERS_MAX}",
                config.fault_handlers
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
        let store = Arc::new(store);
        let core = Arc::new(Mutex::new(Core {
            page_bytes,
            pages,
            capacity_pages,
            resident: PageMap::default(),
            arriving: PageMap::default(),
            leaving: PageMap::default(),
            leaving_dirty: PageSet::default(),
            parked_for_room: Vec::new(),
            reads_in_flight: 0,
            policy,
            prefetcher,
            unused_prefetch: PageSet::default(),
            stats: RegionStats::default(),
            failed: None,
            spare: Vec::new(),
        }));
        let mut region = FarRegion {
            program,
            map,
            uffd,
            store,
            core,
            settled: Arc::new(Condvar::new()),
            stop,
            handlers: Vec::with_capacity(config.fault_handlers),
        };
        // One message per read when there are several handlers, so a burst of faults is
        // spread over them rather than served one after another by the first to wake.
        let per_read = if config.fault_handlers > 1 {
            1
        } else {
            uffd::FAULTS_PER_READ_MAX
        };
        let poll_turn = Arc::new(Mutex::new(()));
        for i in 0..config.fault_handlers {
            let shared = Handler {
                map: region.map.clone(),
                uffd: region.uffd.clone(),
                store: region.store.clone(),
                core: region.core.clone(),
                settled: region.settled.clone(),
                stop: region.stop.clone(),
                poll_turn: poll_turn.clone(),
                per_read,
            };
            let handler = std::thread::Builder::new()
                .name(format!("farmem-faults-{i}"))
                .spawn(move || shared.serve_faults())
                .map_err(|e| Error::Userfault(format!("starting a fault handler: {e}")))?;
            // On an error above, dropping `region` stops the handlers already started.
            region.handlers.push(handler);
        }
        Ok(region)
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

    /// Writes every dirty page back (each write-protected first, so it is clean after):
    /// every byte written before the call is in the store when it returns. Waits for the
    /// dirty pages handlers are evicting, then holds the region's lock while it writes
    /// the present ones, so faults wait for it.
    pub fn flush(&self) -> Result<(), Error> {
        let mut core = self.core.lock();
        let evicting: Vec<PageId> = core.leaving_dirty.iter().copied().collect();
        let deadline = std::time::Instant::now() + FLUSH_WAIT_MAX;
        while evicting.iter().any(|p| core.leaving_dirty.contains(p)) {
            if self.settled.wait_until(&mut core, deadline).timed_out() {
                return Err(Error::Userfault(format!(
                    "dirty pages being evicted were not written back within {FLUSH_WAIT_MAX:?}"
                )));
            }
        }
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
            let mut buffers: Vec<Box<[u8]>> = (0..batch.len()).map(|_| core.buffer()).collect();
            let written = write_back(
                &self.map,
                &self.uffd,
                &*self.store,
                core.page_bytes,
                batch,
                &mut buffers,
            );
            core.spare.extend(buffers);
            written?;
            core.stats.written_back += batch.len() as u64;
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
        self.store.traffic_bytes()
    }

    /// Why the region stopped serving faults, if it has.
    pub fn failure(&self) -> Option<String> {
        self.core.lock().failed.clone()
    }

    fn stop_handlers(&mut self) {
        // Without the signal the handlers would wait forever; if even the eventfd write
        // fails there is nothing safe left to do but leave the threads.
        if self.stop.signal().is_ok() {
            for handler in self.handlers.drain(..) {
                let _ = handler.join();
            }
        }
    }

    /// Flushes, stops the handlers and gives the store back (the mapping is unmapped).
    pub fn into_store(self) -> Result<S, Error> {
        self.flush()?;
        self.into_store_discarding()
    }

    /// Stops the handlers and gives the store back without writing dirty pages: for a
    /// region whose bytes are no longer wanted (its store is about to be freed), where a
    /// flush would only move bytes nobody reads. Fails only if a handler would not stop.
    pub fn into_store_discarding(self) -> Result<S, Error> {
        let store = self.store.clone();
        // Stops the handlers, whose clones go with their threads, and drops ours.
        drop(self);
        Arc::try_unwrap(store).map_err(|_| {
            Error::Userfault("a fault handler did not stop, so its store is still in use".into())
        })
    }
}

impl<S: PageStore + 'static> Drop for FarRegion<S> {
    /// Stops the handlers before the region's handles go. Dirty pages not flushed are
    /// lost, as with `FarVec`.
    fn drop(&mut self) {
        self.stop_handlers();
    }
}

/// What one handler thread holds.
struct Handler<S> {
    map: Arc<Mapping>,
    uffd: Arc<Userfault>,
    store: Arc<S>,
    core: Arc<Mutex<Core>>,
    settled: Arc<Condvar>,
    stop: Arc<Stop>,
    /// Held by the one handler waiting on the userfaultfd. Leader/followers: only the
    /// holder polls, and it lets go as soon as it has a fault to serve, so the next
    /// handler takes over the wait. Without it every fault would wake every idle handler
    /// (measured: a bare fault's p50 rose from ~12.5 µs to ~18 µs with four handlers).
    poll_turn: Arc<Mutex<()>>,
    /// Fault messages taken per read.
    per_read: usize,
}

impl<S: PageStore> Handler<S> {
    fn serve_faults(&self) {
        let mut faults: Vec<Fault> = Vec::with_capacity(self.per_read);
        loop {
            faults.clear();
            let turn = self.poll_turn.lock();
            match self.uffd.wait(&self.stop) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    // Nothing more can be served; later faults would hang, so fail loudly.
                    self.core
                        .lock()
                        .fail(format!("waiting for faults: {e}"), &[]);
                    return;
                }
            }
            let read = self.uffd.read_faults(&self.map, &mut faults, self.per_read);
            drop(turn);
            if let Err(e) = read {
                self.core.lock().fail(format!("reading faults: {e}"), &[]);
                return;
            }
            for fault in &faults {
                self.serve(fault);
            }
        }
    }

    /// Serves one fault: planned under the lock, moved without it, installed and
    /// recorded under it.
    fn serve(&self, fault: &Fault) {
        let (map, uffd) = (&*self.map, &*self.uffd);
        let mut plan = {
            let mut c = self.core.lock();
            if c.failed.is_some() {
                uffd::sigbus_thread(fault.thread_id);
                return;
            }
            match c.plan(map, uffd, fault) {
                Ok(Some(plan)) => plan,
                Ok(None) => return,
                Err(e) => {
                    c.fail(e.to_string(), &[*fault]);
                    return;
                }
            }
        };
        let moved = carry_out(map, uffd, &*self.store, &mut plan);
        self.core.lock().finish(map, uffd, plan, moved);
        self.settled.notify_all();
    }
}

/// Writes `pages` (present, owned by the caller) to the store in one batch, each
/// write-protected before its bytes are copied (so none changes during or after the copy
/// unnoticed), through `buffers` (one per page).
fn write_back<S: PageStore + ?Sized>(
    map: &Mapping,
    uffd: &Userfault,
    store: &S,
    page_bytes: usize,
    pages: &[PageId],
    buffers: &mut [Box<[u8]>],
) -> Result<(), Error> {
    if pages.is_empty() {
        return Ok(());
    }
    for (&p, buf) in pages.iter().zip(buffers.iter_mut()) {
        map.copy_out(uffd, p as usize * page_bytes, buf)
            .map_err(uffd_error("protecting a page to write it back"))?;
    }
    let batch: Vec<(PageId, &[u8])> = pages
        .iter()
        .zip(buffers.iter())
        .map(|(p, b)| (*p, &b[..]))
        .collect();
    store.write_pages(&batch)
}

/// A plan's moves that need no lock: dirty victims written back, victims dropped, the
/// batch read into the plan's buffers. Installing is left to [`Core::finish`], under the
/// lock, so that a page is present exactly when the bookkeeping says so (a `flush`
/// cannot miss a page that arrived dirty).
fn carry_out<S: PageStore>(
    map: &Mapping,
    uffd: &Userfault,
    store: &S,
    plan: &mut Plan,
) -> Result<(), Error> {
    let page_bytes = store.page_bytes();
    let dirty: Vec<PageId> = plan
        .victims
        .iter()
        .filter(|(_, d)| *d)
        .map(|(p, _)| *p)
        .collect();
    let (reads, writes) = plan.buffers.split_at_mut(plan.batch.len());
    write_back(map, uffd, store, page_bytes, &dirty, writes)?;
    for (v, _) in &plan.victims {
        map.discard(*v as usize * page_bytes, page_bytes)
            .map_err(uffd_error("dropping an evicted page"))?;
    }
    store.read_pages(&plan.batch, reads)
}

impl Core {
    fn buffer(&mut self) -> Box<[u8]> {
        self.spare
            .pop()
            .unwrap_or_else(|| vec![0u8; self.page_bytes].into_boxed_slice())
    }

    /// Frames taken: present pages and pages on the move.
    fn frames_taken(&self) -> usize {
        self.resident.len() + self.arriving.len() + self.leaving.len()
    }

    /// Parks `fault` on `page` if the page is moving; true if it did.
    fn park_on_moving(
        &mut self,
        page: PageId,
        fault: &Fault,
        uffd: &Userfault,
        map: &Mapping,
    ) -> bool {
        let parked = match self.arriving.get_mut(&page) {
            Some(list) => list,
            None => match self.leaving.get_mut(&page) {
                Some(list) => list,
                None => return false,
            },
        };
        self.stats.parked_faults += 1;
        if parked.len() < PARKED_PER_PAGE_MAX {
            parked.push(*fault);
        } else {
            // Too many to remember: this one retries now and faults again.
            let at = page as usize * self.page_bytes;
            if uffd.wake(map, at, self.page_bytes).is_err() {
                uffd::sigbus_thread(fault.thread_id);
            }
        }
        true
    }

    /// Decides what a fault needs. Write-protect faults and faults on present pages are
    /// served here (no round trip); faults on moving pages are parked; a missing fault
    /// gets a plan (its pages marked arriving, its victims leaving).
    fn plan(
        &mut self,
        map: &Mapping,
        uffd: &Userfault,
        fault: &Fault,
    ) -> Result<Option<Plan>, Error> {
        let page = (fault.offset / self.page_bytes) as PageId;
        let (at, len) = (page as usize * self.page_bytes, self.page_bytes);
        if self.park_on_moving(page, fault, uffd, map) {
            return Ok(None);
        }
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
            return Ok(None);
        }
        if self.resident.contains_key(&page) {
            // A second thread's fault on a page served meanwhile.
            uffd.wake(map, at, len)
                .map_err(uffd_error("waking a reader"))?;
            return Ok(None);
        }
        // Every present page can be evicted; if the moving ones leave no frame even then,
        // wait for a handler to finish.
        let moving = self.arriving.len() + self.leaving.len();
        if moving + 1 > self.capacity_pages {
            if self.parked_for_room.len() < PARKED_FOR_ROOM_MAX {
                self.parked_for_room.push(*fault);
            } else {
                uffd.wake(map, at, len)
                    .map_err(uffd_error("waking a thread to retry"))?;
            }
            return Ok(None);
        }
        self.stats.missing_faults += 1;
        self.note_prefetches_used(page);
        let mut wanted = Vec::new();
        self.prefetcher.on_access(page, false, &mut wanted);
        let batch_max = (self.capacity_pages - moving).min((self.capacity_pages / 2).max(1));
        let mut batch = vec![page];
        for p in wanted {
            if batch.len() >= batch_max {
                break;
            }
            if p < self.pages
                && !self.resident.contains_key(&p)
                && !self.arriving.contains_key(&p)
                && !self.leaving.contains_key(&p)
                && !batch.contains(&p)
            {
                batch.push(p);
            }
        }
        // Room: through the policy, never evicting a page of this batch. A victim moves
        // from resident to leaving, still taking its frame until this plan drops it,
        // which it does before its batch arrives. The faulting page's frame comes as
        // any demand page's; a prefetched page's only from a page no hotter than it
        // would be, or the page is dropped from the batch.
        let mut victims: Vec<(PageId, bool)> = Vec::new();
        while self.frames_taken() + batch.len() > self.capacity_pages + victims.len() {
            let in_batch = |q: PageId| batch.contains(&q);
            let for_demand = self.frames_taken() + 1 > self.capacity_pages + victims.len();
            let victim = match batch.last() {
                Some(&last) if !for_demand => self.policy.evict_for_prefetch(last, &in_batch),
                _ => self.policy.evict(page, &in_batch),
            };
            match victim {
                Some(v) => {
                    let dirty = self.resident.remove(&v).unwrap_or(false);
                    self.unused_prefetch.remove(&v);
                    self.leaving.insert(v, Vec::new());
                    if dirty {
                        self.leaving_dirty.insert(v);
                    }
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
        for &p in &batch {
            self.arriving.insert(p, Vec::new());
        }
        let dirty = victims.iter().filter(|(_, d)| *d).count();
        let buffers = (0..batch.len() + dirty).map(|_| self.buffer()).collect();
        self.reads_in_flight += 1;
        self.stats.reads_in_flight_max = self.stats.reads_in_flight_max.max(self.reads_in_flight);
        Ok(Some(Plan {
            fault: *fault,
            batch,
            victims,
            buffers,
        }))
    }

    /// Installs a plan's pages and records the outcome, then lets the faults parked on
    /// its pages (and those waiting for room) retry — or, if it failed, fails the region
    /// and them with it.
    fn finish(&mut self, map: &Mapping, uffd: &Userfault, plan: Plan, moved: Result<(), Error>) {
        self.reads_in_flight -= 1;
        let mut parked: Vec<Fault> = std::mem::take(&mut self.parked_for_room);
        for (v, dirty) in &plan.victims {
            parked.extend(self.leaving.remove(v).unwrap_or_default());
            self.leaving_dirty.remove(v);
            if moved.is_ok() {
                self.stats.evictions += 1;
                self.stats.written_back += u64::from(*dirty);
            }
        }
        for p in &plan.batch {
            parked.extend(self.arriving.remove(p).unwrap_or_default());
        }
        let installed = moved.and_then(|()| self.install(map, uffd, &plan));
        self.spare.extend(plan.buffers);
        if let Err(e) = installed {
            parked.push(plan.fault);
            self.fail(e.to_string(), &parked);
            return;
        }
        // The install woke the threads waiting on these pages; the parked ones are woken
        // again here to retry (a no-op for those already running), so none is left
        // waiting: one parked on a leaving page now faults it in afresh.
        for f in &parked {
            let at = (f.offset / self.page_bytes) * self.page_bytes;
            if uffd.wake(map, at, self.page_bytes).is_err() {
                uffd::sigbus_thread(f.thread_id);
            }
        }
    }

    /// Installs a plan's batch (read into its buffers) and records each page present.
    fn install(&mut self, map: &Mapping, uffd: &Userfault, plan: &Plan) -> Result<(), Error> {
        for (i, (&p, data)) in plan.batch.iter().zip(&plan.buffers).enumerate() {
            let demand = i == 0;
            // A write fault's page arrives writable and dirty: its write would fault
            // again at once otherwise.
            let writable = demand && plan.fault.write;
            let fresh = uffd
                .copy(map, p as usize * self.page_bytes, data, !writable)
                .map_err(uffd_error("installing a page"))?;
            if fresh || demand {
                self.resident.insert(p, writable);
                if demand {
                    self.policy.insert(p);
                } else {
                    self.policy.insert_prefetched(p);
                }
            }
            if !demand && fresh {
                self.unused_prefetch.insert(p);
                self.stats.prefetched += 1;
            }
        }
        Ok(())
    }

    /// Marks the region failed (the first reason stays) and sends SIGBUS to the threads
    /// of `faults` and to every fault still waiting for room.
    fn fail(&mut self, why: String, faults: &[Fault]) {
        if self.failed.is_none() {
            self.failed = Some(why);
        }
        for f in faults
            .iter()
            .chain(self.parked_for_room.drain(..).collect::<Vec<_>>().iter())
        {
            uffd::sigbus_thread(f.thread_id);
        }
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

    /// A store whose reads wait (on a condition, bounded by `gate`) until `meet` reads
    /// are under way at once, recording the most there ever were.
    struct GateStore {
        inner: LocalStore,
        meet: usize,
        gate: std::time::Duration,
        state: std::sync::Mutex<(usize, usize)>,
        arrived: std::sync::Condvar,
    }

    impl GateStore {
        fn new(pages: u64, meet: usize, gate: std::time::Duration) -> Self {
            GateStore {
                inner: LocalStore::new(PAGE, pages).expect("store"),
                meet,
                gate,
                state: std::sync::Mutex::new((0, 0)),
                arrived: std::sync::Condvar::new(),
            }
        }

        fn most_at_once(&self) -> usize {
            self.state.lock().expect("gate").1
        }
    }

    impl PageStore for GateStore {
        fn page_bytes(&self) -> usize {
            PAGE
        }
        fn pages(&self) -> u64 {
            self.inner.pages()
        }
        fn read_pages(&self, pages: &[PageId], out: &mut [Box<[u8]>]) -> Result<(), Error> {
            let mut st = self.state.lock().expect("gate");
            st.0 += 1;
            st.1 = st.1.max(st.0);
            self.arrived.notify_all();
            let (mut st, _) = self
                .arrived
                .wait_timeout_while(st, self.gate, |s| s.1 < self.meet)
                .expect("gate");
            st.0 -= 1;
            drop(st);
            self.inner.read_pages(pages, out)
        }
        fn write_pages(&self, pages: &[(PageId, &[u8])]) -> Result<(), Error> {
            self.inner.write_pages(pages)
        }
        fn traffic_bytes(&self) -> (u64, u64) {
            self.inner.traffic_bytes()
        }
    }

    /// Four threads faulting on four different pages at once: with a pool of handlers
    /// their store reads are under way together (the gate opens only when two are);
    /// with one handler — the old design — never more than one is.
    #[test]
    fn faults_on_different_pages_overlap_their_reads() {
        use std::time::Duration;
        for (handlers, gate, threads) in [
            (4, Duration::from_secs(20), 4),
            (1, Duration::from_millis(300), 2),
        ] {
            let store = GateStore::new(16, 2, gate);
            let mut config = CacheConfig::new(16 * PAGE as u64);
            config.fault_handlers = handlers;
            let r = FarRegion::new(store, &config).expect("far region");
            let bytes = r.bytes();
            let sum: u64 = std::thread::scope(|s| {
                let joins: Vec<_> = (0..threads)
                    .map(|t| s.spawn(move || bytes[t * 4 * PAGE] as u64))
                    .collect();
                joins.into_iter().map(|j| j.join().expect("reader")).sum()
            });
            assert_eq!(sum, 0);
            let stats = r.stats();
            assert_eq!(stats.missing_faults, threads as u64, "{stats:?}");
            let store = r.into_store().expect("store");
            if handlers > 1 {
                assert!(store.most_at_once() >= 2, "reads never overlapped");
                assert!(stats.reads_in_flight_max >= 2, "{stats:?}");
            } else {
                assert_eq!(store.most_at_once(), 1, "one handler overlapped reads");
                assert_eq!(stats.reads_in_flight_max, 1, "{stats:?}");
            }
        }
    }

    /// Eight threads reading every page of a region at once, in the same order: each
    /// page is read from the store and installed exactly once however many threads fault
    /// on it together, and every byte is right.
    #[test]
    fn a_page_faulted_by_many_threads_is_read_once() {
        let pages = 256u64;
        let store = LocalStore::new(PAGE, pages).expect("store");
        let data: Vec<u8> = (0..pages as usize * PAGE).map(pattern).collect();
        let batch: Vec<(PageId, &[u8])> = (0..pages).zip(data.chunks(PAGE)).collect();
        store.write_pages(&batch).expect("fill");
        let written = store.traffic_bytes().1;
        let mut config = CacheConfig::new(pages * PAGE as u64);
        config.fault_handlers = FAULT_HANDLERS_MAX;
        let r = FarRegion::new(store, &config).expect("far region");
        let bytes = r.bytes();
        let barrier = std::sync::Barrier::new(8);
        std::thread::scope(|s| {
            for _ in 0..8 {
                let (barrier, data) = (&barrier, &data);
                s.spawn(move || {
                    barrier.wait();
                    for p in 0..pages as usize {
                        let at = p * PAGE + 17;
                        assert_eq!(bytes[at], data[at], "page {p}");
                    }
                });
            }
        });
        let stats = r.stats();
        assert_eq!(stats.missing_faults, pages, "{stats:?}");
        assert_eq!(r.traffic_bytes(), (pages * PAGE as u64, written));
        assert!(bytes == &data[..], "a byte differs");
    }

    /// Writers and readers on many threads through a small pool of frames: pages leave
    /// (written back) and arrive concurrently, and nothing written is lost.
    #[test]
    fn many_threads_writing_through_evictions_lose_nothing() {
        for policy in ["clock", "s3fifo"] {
            let mut r = region(128, 12, policy, "sequential");
            let chunks: Vec<&mut [u8]> = r.bytes_mut().chunks_mut(16 * PAGE).collect();
            std::thread::scope(|s| {
                for (t, chunk) in chunks.into_iter().enumerate() {
                    s.spawn(move || {
                        for round in 0..3u8 {
                            for (i, x) in chunk.iter_mut().enumerate().step_by(256) {
                                *x = pattern(t * 16 * PAGE + i).wrapping_add(round);
                            }
                        }
                    });
                }
            });
            let bytes = r.bytes();
            for i in (0..bytes.len()).step_by(256) {
                assert_eq!(bytes[i], pattern(i).wrapping_add(2), "{policy}: byte {i}");
            }
            assert!(r.resident_pages() <= 12);
            assert!(r.stats().written_back > 0, "{:?}", r.stats());
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
        for handlers in [0, FAULT_HANDLERS_MAX + 1] {
            let store = LocalStore::new(PAGE, 4).expect("store");
            let mut config = CacheConfig::new(PAGE as u64);
            config.fault_handlers = handlers;
            assert!(
                FarRegion::new(store, &config).is_err(),
                "{handlers} handlers"
            );
        }
    }
}
