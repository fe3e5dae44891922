//! Where a page cache's pages live when they are not local: a [`PageStore`] is read and
//! written a batch of whole pages at a time, so one fault (a demand page plus what the
//! prefetcher asked for) or one write-back costs one round trip, not one per page.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use camelot_blocks::Volume;
use camelot_client::proto::{Op, Reply};
use camelot_client::{Client, Region};
use parking_lot::Mutex;

use crate::{Error, PageId};

/// Smallest and largest page a cache may use (4 KiB to 2 MiB, powers of two).
pub const PAGE_BYTES_MIN: usize = 4 << 10;
pub const PAGE_BYTES_MAX: usize = 2 << 20;

/// Checks a page size: a power of two in [`PAGE_BYTES_MIN`]..=[`PAGE_BYTES_MAX`].
pub fn check_page_bytes(page_bytes: usize) -> Result<(), Error> {
    if !page_bytes.is_power_of_two() || !(PAGE_BYTES_MIN..=PAGE_BYTES_MAX).contains(&page_bytes) {
        return Err(Error::Invalid(format!(
            "page size {page_bytes} B: a power of two from {PAGE_BYTES_MIN} to {PAGE_BYTES_MAX}"
        )));
    }
    Ok(())
}

/// Pages of `page_bytes()` bytes, numbered `0..pages()`.
pub trait PageStore: Send + Sync {
    fn page_bytes(&self) -> usize;
    /// The store's size in pages: fixed for the store's life (a cache reads it once).
    fn pages(&self) -> u64;
    /// Reads every page in `pages` into the buffer at the same index (each exactly
    /// `page_bytes()` long), as one batch.
    fn read_pages(&self, pages: &[PageId], out: &mut [Box<[u8]>]) -> Result<(), Error>;
    /// Writes every (page, bytes) pair, as one batch.
    fn write_pages(&self, pages: &[(PageId, &[u8])]) -> Result<(), Error>;
    /// Bytes moved to and from the store so far: (read, written).
    fn traffic_bytes(&self) -> (u64, u64);
    /// Reads the consecutive pages from `first` into `out` (a whole number of pages),
    /// bypassing any frame: the direct path of large slices. The default goes through
    /// [`PageStore::read_pages`] and copies; stores override it to read in place.
    fn read_run(&self, first: PageId, out: &mut [u8]) -> Result<(), Error> {
        let page_bytes = self.page_bytes();
        let pages: Vec<PageId> = (first..).take(out.len() / page_bytes).collect();
        let mut bufs: Vec<Box<[u8]>> = pages
            .iter()
            .map(|_| vec![0u8; page_bytes].into_boxed_slice())
            .collect();
        self.read_pages(&pages, &mut bufs)?;
        for (chunk, buf) in out.chunks_mut(page_bytes).zip(&bufs) {
            chunk.copy_from_slice(buf);
        }
        Ok(())
    }
    /// Writes `data` (a whole number of pages) to the consecutive pages from `first`.
    fn write_run(&self, first: PageId, data: &[u8]) -> Result<(), Error> {
        let page_bytes = self.page_bytes();
        let batch: Vec<(PageId, &[u8])> = (first..).zip(data.chunks(page_bytes)).collect();
        self.write_pages(&batch)
    }
    /// Starts reading `pages` and returns at once; [`PendingRead::wait`] gives their
    /// bytes. Stores that cannot overlap a read with other work read here and now.
    fn start_read(&self, pages: &[PageId]) -> PendingRead {
        let mut out: Vec<Box<[u8]>> = pages
            .iter()
            .map(|_| vec![0u8; self.page_bytes()].into_boxed_slice())
            .collect();
        PendingRead(Pending::Ready(
            self.read_pages(pages, &mut out).map(|()| out),
        ))
    }
}

/// A batch read under way: the pages' bytes, in the order they were asked for, once
/// [`PendingRead::wait`] returns.
pub struct PendingRead(Pending);

enum Pending {
    Ready(Result<Vec<Box<[u8]>>, Error>),
    /// One answer per run of consecutive pages, `pages` pages in all.
    Remote {
        answers: Vec<(camelot_client::Pending, usize)>,
        page_bytes: usize,
        pages: usize,
    },
}

impl PendingRead {
    /// The pages' bytes, one `Bytes` a page: views of the answers as they arrived, not
    /// copies — the cache copies each once, into the frame it takes it in.
    pub fn wait(self) -> Result<Vec<Bytes>, Error> {
        match self.0 {
            Pending::Ready(r) => r.map(|pages| pages.into_iter().map(Bytes::from).collect()),
            Pending::Remote {
                answers,
                page_bytes,
                pages,
            } => {
                let mut out = Vec::with_capacity(pages);
                for (answer, n) in answers {
                    match answer.wait()? {
                        Reply::Data(d) if d.len() == n * page_bytes => {
                            out.extend(
                                (0..n).map(|i| d.slice(i * page_bytes..(i + 1) * page_bytes)),
                            );
                        }
                        other => {
                            return Err(Error::Remote(format!(
                                "a page read answered {}",
                                short(&other)
                            )))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

fn check_batch(
    store: &dyn PageStore,
    pages: impl Iterator<Item = (PageId, usize)>,
) -> Result<(), Error> {
    for (page, len) in pages {
        if page >= store.pages() {
            return Err(Error::Invalid(format!(
                "page {page} is past the store's {} pages",
                store.pages()
            )));
        }
        if len != store.page_bytes() {
            return Err(Error::Invalid(format!(
                "a page buffer of {len} B for {} B pages",
                store.page_bytes()
            )));
        }
    }
    Ok(())
}

/// Pages in this process's memory: the all-local reference every far-memory figure is
/// set against, and the store the cache's own logic is tested over.
pub struct LocalStore {
    page_bytes: usize,
    pages: Mutex<Vec<Box<[u8]>>>,
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
}

impl LocalStore {
    pub fn new(page_bytes: usize, pages: u64) -> Result<Self, Error> {
        check_page_bytes(page_bytes)?;
        let count = usize::try_from(pages)
            .map_err(|_| Error::Invalid(format!("{pages} pages do not fit in memory")))?;
        Ok(LocalStore {
            page_bytes,
            pages: Mutex::new(
                (0..count)
                    .map(|_| vec![0u8; page_bytes].into_boxed_slice())
                    .collect(),
            ),
            read_bytes: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
        })
    }
}

impl PageStore for LocalStore {
    fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    fn pages(&self) -> u64 {
        self.pages.lock().len() as u64
    }
    fn read_pages(&self, pages: &[PageId], out: &mut [Box<[u8]>]) -> Result<(), Error> {
        check_batch(
            self,
            pages.iter().zip(out.iter()).map(|(p, b)| (*p, b.len())),
        )?;
        let stored = self.pages.lock();
        for (page, buf) in pages.iter().zip(out.iter_mut()) {
            buf.copy_from_slice(&stored[*page as usize]);
        }
        self.read_bytes
            .fetch_add((pages.len() * self.page_bytes) as u64, Ordering::Relaxed);
        Ok(())
    }
    fn write_pages(&self, pages: &[(PageId, &[u8])]) -> Result<(), Error> {
        check_batch(self, pages.iter().map(|(p, b)| (*p, b.len())))?;
        let mut stored = self.pages.lock();
        for (page, data) in pages {
            stored[*page as usize].copy_from_slice(data);
        }
        self.written_bytes
            .fetch_add((pages.len() * self.page_bytes) as u64, Ordering::Relaxed);
        Ok(())
    }
    fn traffic_bytes(&self) -> (u64, u64) {
        (
            self.read_bytes.load(Ordering::Relaxed),
            self.written_bytes.load(Ordering::Relaxed),
        )
    }
}

/// Pages in one region on one memory server: the simplest far store (a block volume
/// across servers is the general one). Page `p` is the region's bytes
/// `[p × page_bytes, (p + 1) × page_bytes)`.
pub struct RegionStore {
    client: Client,
    region: Region,
    page_bytes: usize,
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
    /// Request buffers of direct writes, kept for the next run (at most a window's
    /// worth, [`RUN_WINDOW_BYTES`]: what one run had in flight anyway). Fresh 1 MiB
    /// buffers cost a page fault and a zeroed page per 4 KiB on every run — the profile
    /// of `bench sort` had that as a fifth of the sort's own time.
    write_buffers: Mutex<Vec<BytesMut>>,
}

impl RegionStore {
    /// Pages over an existing region (a whole number of pages of it is used).
    pub fn new(client: Client, region: Region, page_bytes: usize) -> Result<Self, Error> {
        check_page_bytes(page_bytes)?;
        if region.size < page_bytes as u64 {
            return Err(Error::Invalid(format!(
                "region of {} B is smaller than one {page_bytes} B page",
                region.size
            )));
        }
        Ok(RegionStore {
            client,
            region,
            page_bytes,
            read_bytes: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
            write_buffers: Mutex::new(Vec::new()),
        })
    }

    /// Allocates a region of `pages` pages (named, if given, so a restarted program can
    /// find it) and pages over it.
    pub fn alloc(
        client: Client,
        pages: u64,
        page_bytes: usize,
        name: Option<&str>,
    ) -> Result<Self, Error> {
        check_page_bytes(page_bytes)?;
        let bytes = pages
            .checked_mul(page_bytes as u64)
            .ok_or_else(|| Error::Invalid(format!("{pages} pages of {page_bytes} B overflow")))?;
        let region = client.alloc(bytes, name)?;
        Self::new(client, region, page_bytes)
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Frees the region on its server (its pages are gone).
    pub fn free(self) -> Result<(), Error> {
        self.client.free(&self.region)?;
        Ok(())
    }

    /// The byte offset of a run of `len` bytes from page `first`, checked: whole pages,
    /// inside the region.
    fn check_run(&self, first: PageId, len: usize) -> Result<u64, Error> {
        check_run(self, first, len)
    }

    /// Consecutive pages travel as one READ or WRITE of at most this many pages.
    fn run_pages_max(&self) -> usize {
        (RUN_BYTES_MAX / self.page_bytes).max(1)
    }
}

/// One request moves at most this much: a frame the client and server reuse buffers for.
const RUN_BYTES_MAX: usize = 1 << 20;
/// A direct run keeps at most this many bytes of requests in flight.
const RUN_WINDOW_BYTES: usize = 16 << 20;

/// The byte offset of a run of `len` bytes from page `first`: whole pages, inside the
/// store.
fn check_run(store: &dyn PageStore, first: PageId, len: usize) -> Result<u64, Error> {
    let page_bytes = store.page_bytes();
    let pages = (len / page_bytes) as u64;
    if !len.is_multiple_of(page_bytes) || first.checked_add(pages).is_none_or(|e| e > store.pages())
    {
        return Err(Error::Invalid(format!(
            "a run of {len} B from page {first}: not whole pages inside {} pages",
            store.pages()
        )));
    }
    Ok(first * page_bytes as u64)
}

/// `pages` cut into runs of consecutive numbers, each at most `run_max` long, as (index
/// of the run's first page in `pages`, length).
fn runs_of(pages: &[PageId], run_max: usize) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, &p) in pages.iter().enumerate() {
        match runs.last_mut() {
            Some((start, n)) if *n < run_max && pages[*start] + *n as u64 == p => *n += 1,
            _ => runs.push((i, 1)),
        }
    }
    runs
}

impl PageStore for RegionStore {
    fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    fn pages(&self) -> u64 {
        self.region.size / self.page_bytes as u64
    }
    fn read_pages(&self, pages: &[PageId], out: &mut [Box<[u8]>]) -> Result<(), Error> {
        check_batch(
            self,
            pages.iter().zip(out.iter()).map(|(p, b)| (*p, b.len())),
        )?;
        let runs = runs_of(pages, self.run_pages_max());
        let page_bytes = self.page_bytes as u64;
        let pending = self.client.submit_many(runs.iter().map(|&(start, n)| {
            let op = self
                .region
                .read_op(pages[start] * page_bytes, (n as u64 * page_bytes) as u32);
            (self.region.node, op)
        }))?;
        for (p, &(start, n)) in pending.into_iter().zip(&runs) {
            match p.wait()? {
                Reply::Data(d) if d.len() == n * self.page_bytes => {
                    for (buf, chunk) in out[start..start + n]
                        .iter_mut()
                        .zip(d.chunks(self.page_bytes))
                    {
                        buf.copy_from_slice(chunk);
                    }
                }
                other => {
                    return Err(Error::Remote(format!(
                        "a page read answered {}",
                        short(&other)
                    )))
                }
            }
        }
        self.read_bytes
            .fetch_add((pages.len() * self.page_bytes) as u64, Ordering::Relaxed);
        Ok(())
    }
    fn write_pages(&self, pages: &[(PageId, &[u8])]) -> Result<(), Error> {
        check_batch(self, pages.iter().map(|(p, b)| (*p, b.len())))?;
        let numbers: Vec<PageId> = pages.iter().map(|(p, _)| *p).collect();
        let runs = runs_of(&numbers, self.run_pages_max());
        let page_bytes = self.page_bytes as u64;
        let ops = runs.iter().map(|&(start, n)| {
            let mut data = Vec::with_capacity(n * self.page_bytes);
            for (_, bytes) in &pages[start..start + n] {
                data.extend_from_slice(bytes);
            }
            let op: Op = self
                .region
                .write_op(numbers[start] * page_bytes, Bytes::from(data));
            (self.region.node, op)
        });
        for p in self.client.submit_many(ops)? {
            match p.wait()? {
                Reply::Done => {}
                other => {
                    return Err(Error::Remote(format!(
                        "a page write answered {}",
                        short(&other)
                    )))
                }
            }
        }
        self.written_bytes
            .fetch_add((pages.len() * self.page_bytes) as u64, Ordering::Relaxed);
        Ok(())
    }
    fn read_run(&self, first: PageId, out: &mut [u8]) -> Result<(), Error> {
        let offset = self.check_run(first, out.len())?;
        // Requests of ≤ RUN_BYTES_MAX, up to RUN_WINDOW_BYTES of them in flight at once.
        for (w, window) in out.chunks_mut(RUN_WINDOW_BYTES).enumerate() {
            let base = offset + (w * RUN_WINDOW_BYTES) as u64;
            let pending = self
                .client
                .submit_many(window.chunks(RUN_BYTES_MAX).enumerate().map(|(i, c)| {
                    let op = self
                        .region
                        .read_op(base + (i * RUN_BYTES_MAX) as u64, c.len() as u32);
                    (self.region.node, op)
                }))?;
            for (p, chunk) in pending.into_iter().zip(window.chunks_mut(RUN_BYTES_MAX)) {
                match p.wait()? {
                    Reply::Data(d) if d.len() == chunk.len() => chunk.copy_from_slice(&d),
                    other => {
                        return Err(Error::Remote(format!(
                            "a run read answered {}",
                            short(&other)
                        )))
                    }
                }
            }
        }
        self.read_bytes
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn write_run(&self, first: PageId, data: &[u8]) -> Result<(), Error> {
        let offset = self.check_run(first, data.len())?;
        let mut sent: Vec<Bytes> = Vec::with_capacity(RUN_WINDOW_BYTES / RUN_BYTES_MAX);
        for (w, window) in data.chunks(RUN_WINDOW_BYTES).enumerate() {
            let base = offset + (w * RUN_WINDOW_BYTES) as u64;
            sent.clear();
            for c in window.chunks(RUN_BYTES_MAX) {
                let mut buf = self
                    .write_buffers
                    .lock()
                    .pop()
                    .unwrap_or_else(|| BytesMut::with_capacity(RUN_BYTES_MAX));
                buf.clear();
                buf.extend_from_slice(c);
                sent.push(buf.freeze());
            }
            let pending = self
                .client
                .submit_many(sent.iter().enumerate().map(|(i, b)| {
                    let op = self
                        .region
                        .write_op(base + (i * RUN_BYTES_MAX) as u64, b.clone());
                    (self.region.node, op)
                }))?;
            for p in pending {
                match p.wait()? {
                    Reply::Done => {}
                    other => {
                        return Err(Error::Remote(format!(
                            "a run write answered {}",
                            short(&other)
                        )))
                    }
                }
            }
            // The client lets go of a payload once it is on the wire, so ours is
            // normally the last handle and the buffer comes back without a copy.
            let mut pool = self.write_buffers.lock();
            for b in sent.drain(..) {
                if pool.len() * RUN_BYTES_MAX >= RUN_WINDOW_BYTES {
                    break;
                }
                if let Ok(buf) = b.try_into_mut() {
                    pool.push(buf);
                }
            }
        }
        self.written_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn start_read(&self, pages: &[PageId]) -> PendingRead {
        if let Err(e) = check_batch(self, pages.iter().map(|p| (*p, self.page_bytes))) {
            return PendingRead(Pending::Ready(Err(e)));
        }
        let runs = runs_of(pages, self.run_pages_max());
        let page_bytes = self.page_bytes as u64;
        let submitted = self.client.submit_many(runs.iter().map(|&(start, n)| {
            let op = self
                .region
                .read_op(pages[start] * page_bytes, (n as u64 * page_bytes) as u32);
            (self.region.node, op)
        }));
        match submitted {
            Ok(answers) => {
                self.read_bytes
                    .fetch_add(pages.len() as u64 * page_bytes, Ordering::Relaxed);
                PendingRead(Pending::Remote {
                    answers: answers
                        .into_iter()
                        .zip(runs.iter().map(|&(_, n)| n))
                        .collect(),
                    page_bytes: self.page_bytes,
                    pages: pages.len(),
                })
            }
            Err(e) => PendingRead(Pending::Ready(Err(e.into()))),
        }
    }
    fn traffic_bytes(&self) -> (u64, u64) {
        (
            self.read_bytes.load(Ordering::Relaxed),
            self.written_bytes.load(Ordering::Relaxed),
        )
    }
}

/// Pages on a block volume (`camelot-blocks`): striped, mirrored or erasure-coded
/// across member servers, so far memory can outlive a member (raid1/4/5, rs). Page `p`
/// is the volume's bytes `[p × page_bytes, (p + 1) × page_bytes)`. Each run of
/// consecutive pages in a batch is one volume call, which sends its chunk I/O to every
/// member before waiting for any.
pub struct VolumeStore {
    volume: Arc<Volume>,
    page_bytes: usize,
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
}

impl VolumeStore {
    /// Pages over the whole volume (a whole number of pages of it is used).
    pub fn new(volume: Arc<Volume>, page_bytes: usize) -> Result<Self, Error> {
        check_page_bytes(page_bytes)?;
        if volume.capacity_bytes() < page_bytes as u64 {
            return Err(Error::Invalid(format!(
                "volume of {} B is smaller than one {page_bytes} B page",
                volume.capacity_bytes()
            )));
        }
        Ok(VolumeStore {
            volume,
            page_bytes,
            read_bytes: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
        })
    }

    pub fn volume(&self) -> &Arc<Volume> {
        &self.volume
    }
}

impl PageStore for VolumeStore {
    fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    fn pages(&self) -> u64 {
        self.volume.capacity_bytes() / self.page_bytes as u64
    }
    fn read_pages(&self, pages: &[PageId], out: &mut [Box<[u8]>]) -> Result<(), Error> {
        check_batch(
            self,
            pages.iter().zip(out.iter()).map(|(p, b)| (*p, b.len())),
        )?;
        let mut run_buf = Vec::new();
        for (start, n) in runs_of(pages, (RUN_BYTES_MAX / self.page_bytes).max(1)) {
            run_buf.resize(n * self.page_bytes, 0);
            self.volume
                .read(pages[start] * self.page_bytes as u64, &mut run_buf)?;
            for (buf, chunk) in out[start..start + n]
                .iter_mut()
                .zip(run_buf.chunks(self.page_bytes))
            {
                buf.copy_from_slice(chunk);
            }
        }
        self.read_bytes
            .fetch_add((pages.len() * self.page_bytes) as u64, Ordering::Relaxed);
        Ok(())
    }
    fn read_run(&self, first: PageId, out: &mut [u8]) -> Result<(), Error> {
        let offset = check_run(self, first, out.len())?;
        // The volume sends each call's chunk I/O to every member at once.
        for (i, chunk) in out.chunks_mut(RUN_WINDOW_BYTES).enumerate() {
            self.volume
                .read(offset + (i * RUN_WINDOW_BYTES) as u64, chunk)?;
        }
        self.read_bytes
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn write_run(&self, first: PageId, data: &[u8]) -> Result<(), Error> {
        let offset = check_run(self, first, data.len())?;
        for (i, chunk) in data.chunks(RUN_WINDOW_BYTES).enumerate() {
            self.volume
                .write(offset + (i * RUN_WINDOW_BYTES) as u64, chunk)?;
        }
        self.written_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn write_pages(&self, pages: &[(PageId, &[u8])]) -> Result<(), Error> {
        check_batch(self, pages.iter().map(|(p, b)| (*p, b.len())))?;
        let numbers: Vec<PageId> = pages.iter().map(|(p, _)| *p).collect();
        let mut run_buf = Vec::new();
        for (start, n) in runs_of(&numbers, (RUN_BYTES_MAX / self.page_bytes).max(1)) {
            run_buf.clear();
            for (_, bytes) in &pages[start..start + n] {
                run_buf.extend_from_slice(bytes);
            }
            self.volume
                .write(numbers[start] * self.page_bytes as u64, &run_buf)?;
        }
        self.written_bytes
            .fetch_add((pages.len() * self.page_bytes) as u64, Ordering::Relaxed);
        Ok(())
    }
    fn traffic_bytes(&self) -> (u64, u64) {
        (
            self.read_bytes.load(Ordering::Relaxed),
            self.written_bytes.load(Ordering::Relaxed),
        )
    }
}

fn short(reply: &Reply) -> String {
    match reply {
        Reply::Data(d) => format!("{} bytes", d.len()),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::runs_of;

    #[test]
    fn runs_cut_at_gaps_and_at_the_maximum() {
        assert_eq!(runs_of(&[], 4), vec![]);
        assert_eq!(
            runs_of(&[5, 6, 7, 9, 10, 3], 4),
            vec![(0, 3), (3, 2), (5, 1)]
        );
        assert_eq!(runs_of(&[1, 2, 3, 4, 5], 2), vec![(0, 2), (2, 2), (4, 1)]);
        assert_eq!(
            runs_of(&[2, 2], 4),
            vec![(0, 1), (1, 1)],
            "a repeated page is not a run"
        );
    }
}
