//! `FarVec<T>`: a vector whose elements live in far memory, behind a page cache. Reads
//! and writes go through the cache, so a program touching a working set larger than
//! local memory pays a remote round trip only on a miss.
//!
//! Besides copies (`get`, `read_slice`, `chunks`), a range can be borrowed in place
//! through a guard ([`FarVec::slice`], [`FarVec::slice_mut`]): its pages are made
//! resident and pinned, and the guard hands out `&[T]` / `&mut [T]` views of the page
//! frames themselves — one per page the range touches, since consecutive pages are not
//! consecutive in local memory. The guard holds the vector's lock, so other threads'
//! calls on the vector wait until it is dropped, and a range must fit in the cache.

use std::marker::PhantomData;
use std::ops::Range;

use bytemuck::Pod;
use parking_lot::{Mutex, MutexGuard};

use crate::cache::{CacheStats, PageCache};
use crate::store::PageStore;
use crate::{Error, PageId};

/// Elements of type `T` (plain old data: any bit pattern is a valid `T`, so bytes from
/// far memory are one) at `index × size_of::<T>()` in the cache's address space.
pub struct FarVec<T: Pod, S: PageStore> {
    cache: Mutex<PageCache<S>>,
    len: u64,
    _element: PhantomData<T>,
}

impl<T: Pod, S: PageStore> FarVec<T, S> {
    /// A vector of `len` elements over `cache`, which must address at least that many.
    /// Its elements are whatever the store holds (zeros for a new store).
    pub fn new(cache: PageCache<S>, len: u64) -> Result<Self, Error> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>() as u64)
            .ok_or_else(|| Error::Invalid(format!("{len} elements overflow")))?;
        if bytes > cache.len_bytes() {
            return Err(Error::Invalid(format!(
                "{len} elements of {} B need {bytes} B; the store has {} B",
                std::mem::size_of::<T>(),
                cache.len_bytes()
            )));
        }
        Ok(FarVec {
            cache: Mutex::new(cache),
            len,
            _element: PhantomData,
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn offset(&self, index: u64, count: u64) -> Result<u64, Error> {
        match index.checked_add(count) {
            Some(end) if end <= self.len => Ok(index * std::mem::size_of::<T>() as u64),
            _ => Err(Error::Invalid(format!(
                "elements {index}..+{count} out of range for length {}",
                self.len
            ))),
        }
    }

    pub fn get(&self, index: u64) -> Result<T, Error> {
        let mut value = T::zeroed();
        let offset = self.offset(index, 1)?;
        self.cache
            .lock()
            .read(offset, bytemuck::bytes_of_mut(&mut value))?;
        Ok(value)
    }

    pub fn set(&self, index: u64, value: T) -> Result<(), Error> {
        let offset = self.offset(index, 1)?;
        self.cache.lock().write(offset, bytemuck::bytes_of(&value))
    }

    /// Copies `out.len()` elements from `index` into `out`: one cache call for the lot.
    /// A slice spanning many pages bypasses the frames (`PageCache::read_direct`): its
    /// pages come straight from the store into `out`.
    pub fn read_slice(&self, index: u64, out: &mut [T]) -> Result<(), Error> {
        let offset = self.offset(index, out.len() as u64)?;
        self.cache
            .lock()
            .read_direct(offset, bytemuck::cast_slice_mut(out))
    }

    /// Copies `values` to the elements from `index` on; a slice spanning many pages goes
    /// straight to the store (`PageCache::write_direct`).
    pub fn write_slice(&self, index: u64, values: &[T]) -> Result<(), Error> {
        let offset = self.offset(index, values.len() as u64)?;
        self.cache
            .lock()
            .write_direct(offset, bytemuck::cast_slice(values))
    }

    /// The elements in order, `chunk` at a time (each chunk one cache call).
    pub fn chunks(&self, chunk: usize) -> impl Iterator<Item = Result<Vec<T>, Error>> + '_ {
        let chunk = chunk.max(1) as u64;
        (0..self.len.div_ceil(chunk)).map(move |i| {
            let start = i * chunk;
            let mut out = vec![T::zeroed(); (chunk.min(self.len - start)) as usize];
            self.read_slice(start, &mut out).map(|_| out)
        })
    }

    /// Every element in order.
    pub fn iter(&self) -> impl Iterator<Item = Result<T, Error>> + '_ {
        // One page's worth at a time, so iteration costs one cache call per page.
        let per_chunk = (self.cache.lock().page_bytes() / std::mem::size_of::<T>().max(1)).max(1);
        self.chunks(per_chunk)
            .flat_map(|chunk| -> Box<dyn Iterator<Item = Result<T, Error>>> {
                match chunk {
                    Ok(values) => Box::new(values.into_iter().map(Ok)),
                    Err(e) => Box::new(std::iter::once(Err(e))),
                }
            })
    }

    /// Borrows elements `range` in place: their pages are made resident (a fault group
    /// at a time, each one batch) and pinned until the guard is dropped. Needs
    /// `size_of::<T>()` to divide the page size (no element straddles two frames) and the
    /// range's pages to fit in the cache.
    pub fn slice(&self, range: Range<u64>) -> Result<FarSlice<'_, T, S>, Error> {
        Ok(FarSlice {
            view: self.view(range)?,
        })
    }

    /// [`FarVec::slice`] for changing elements in place: every page a mutable view is
    /// taken of becomes dirty, and is written back when evicted or flushed.
    pub fn slice_mut(&self, range: Range<u64>) -> Result<FarSliceMut<'_, T, S>, Error> {
        Ok(FarSliceMut {
            view: self.view(range)?,
        })
    }

    fn view(&self, range: Range<u64>) -> Result<View<'_, T, S>, Error> {
        let size = std::mem::size_of::<T>() as u64;
        let count = range.end.checked_sub(range.start).ok_or_else(|| {
            Error::Invalid(format!(
                "range {}..{} runs backwards",
                range.start, range.end
            ))
        })?;
        let start_byte = self.offset(range.start, count)?;
        let mut cache = self.cache.lock();
        let page_bytes = cache.page_bytes() as u64;
        if size == 0 || !page_bytes.is_multiple_of(size) {
            return Err(Error::Invalid(format!(
                "views need elements that tile a page: {size} B does not divide {page_bytes} B"
            )));
        }
        let end_byte = start_byte + count * size;
        let first_page = start_byte / page_bytes;
        let pages = if count == 0 {
            0
        } else {
            (end_byte - 1) / page_bytes + 1 - first_page
        };
        cache.pin_range(first_page, pages)?;
        let view = View {
            cache,
            first_page,
            pages,
            start_byte,
            end_byte,
            _element: PhantomData,
        };
        // Frames are heap blocks of a page or more (16-byte aligned by the allocator);
        // an element type wanting more is refused rather than misread.
        for i in 0..pages as usize {
            let (page, from, to) = view.piece_bounds(i);
            let bytes = view.cache.frame(page).and_then(|f| f.get(from..to));
            if bytes.is_none_or(|b| bytemuck::try_cast_slice::<u8, T>(b).is_err()) {
                return Err(Error::Invalid(format!(
                    "page {page}'s frame cannot be viewed as elements of {size} B \
                     (alignment {})",
                    std::mem::align_of::<T>()
                )));
            }
        }
        Ok(view)
    }

    /// Writes every dirty page back to the store.
    pub fn flush(&self) -> Result<(), Error> {
        self.cache.lock().flush()
    }

    /// Bytes this vector's store has moved so far: (read, written).
    pub fn traffic(&self) -> (u64, u64) {
        self.cache.lock().store().traffic_bytes()
    }

    pub fn stats(&self) -> CacheStats {
        self.cache.lock().stats()
    }

    pub fn into_cache(self) -> PageCache<S> {
        self.cache.into_inner()
    }
}

/// Pinned pages of a [`FarVec`] borrowed in place, with the vector's lock held.
struct View<'a, T: Pod, S: PageStore> {
    cache: MutexGuard<'a, PageCache<S>>,
    first_page: PageId,
    pages: u64,
    start_byte: u64,
    end_byte: u64,
    _element: PhantomData<T>,
}

impl<T: Pod, S: PageStore> View<'_, T, S> {
    /// Piece `i`'s page and the byte range of the view inside its frame.
    fn piece_bounds(&self, i: usize) -> (PageId, usize, usize) {
        let page_bytes = self.cache.page_bytes() as u64;
        let page = self.first_page + i as u64;
        let page_start = page * page_bytes;
        let from = self.start_byte.max(page_start) - page_start;
        let to = self.end_byte.min(page_start + page_bytes) - page_start;
        (page, from as usize, to as usize)
    }

    fn len(&self) -> usize {
        ((self.end_byte - self.start_byte) / std::mem::size_of::<T>() as u64) as usize
    }

    fn piece(&self, i: usize) -> Option<&[T]> {
        if i as u64 >= self.pages {
            return None;
        }
        let (page, from, to) = self.piece_bounds(i);
        let bytes = self.cache.frame(page)?.get(from..to)?;
        bytemuck::try_cast_slice(bytes).ok()
    }

    fn piece_mut(&mut self, i: usize) -> Option<&mut [T]> {
        if i as u64 >= self.pages {
            return None;
        }
        let (page, from, to) = self.piece_bounds(i);
        let bytes = self.cache.frame_mut(page)?.get_mut(from..to)?;
        bytemuck::try_cast_slice_mut(bytes).ok()
    }
}

impl<T: Pod, S: PageStore> Drop for View<'_, T, S> {
    fn drop(&mut self) {
        let (first, pages) = (self.first_page, self.pages);
        self.cache.unpin_range(first, pages);
    }
}

/// A range of a [`FarVec`] borrowed in place ([`FarVec::slice`]): one `&[T]` per page
/// the range touches, in order, each a view of the pinned page frame. Dropping it unpins
/// the pages and releases the vector.
pub struct FarSlice<'a, T: Pod, S: PageStore> {
    view: View<'a, T, S>,
}

impl<T: Pod, S: PageStore> FarSlice<'_, T, S> {
    /// Elements in the range.
    pub fn len(&self) -> usize {
        self.view.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pages the range touches: the number of pieces.
    pub fn piece_count(&self) -> usize {
        self.view.pages as usize
    }

    /// The range's elements in page `i` of it (`0..piece_count()`), borrowed in place.
    pub fn piece(&self, i: usize) -> Option<&[T]> {
        self.view.piece(i)
    }

    /// Every piece, in order: together they are the range.
    pub fn pieces(&self) -> impl Iterator<Item = &[T]> + '_ {
        (0..self.piece_count()).filter_map(|i| self.view.piece(i))
    }

    /// Element `i` of the range.
    pub fn get(&self, i: usize) -> Option<T> {
        // The first piece may start part-way into its page; the others start at theirs.
        let first = self.view.piece(0)?;
        if i < first.len() {
            return first.get(i).copied();
        }
        let per_page = self.view.cache.page_bytes() / std::mem::size_of::<T>();
        let j = i - first.len();
        self.view
            .piece(1 + j / per_page)?
            .get(j % per_page)
            .copied()
    }
}

/// [`FarSlice`] that may also change elements in place: each page a mutable piece is
/// taken of becomes dirty.
pub struct FarSliceMut<'a, T: Pod, S: PageStore> {
    view: View<'a, T, S>,
}

impl<T: Pod, S: PageStore> FarSliceMut<'_, T, S> {
    pub fn len(&self) -> usize {
        self.view.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn piece_count(&self) -> usize {
        self.view.pages as usize
    }

    pub fn piece(&self, i: usize) -> Option<&[T]> {
        self.view.piece(i)
    }

    /// The range's elements in page `i` of it, to change in place (the page is dirty
    /// from now on).
    pub fn piece_mut(&mut self, i: usize) -> Option<&mut [T]> {
        self.view.piece_mut(i)
    }

    /// Calls `f` with every piece in order, mutably.
    pub fn for_each_piece_mut(&mut self, mut f: impl FnMut(&mut [T])) {
        for i in 0..self.piece_count() {
            if let Some(piece) = self.view.piece_mut(i) {
                f(piece);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CacheConfig;
    use crate::store::LocalStore;

    fn farvec(len: u64, frames: u64) -> FarVec<u64, LocalStore> {
        let pages = (len * 8).div_ceil(4096);
        let store = LocalStore::new(4096, pages).expect("store");
        let cache = PageCache::new(store, &CacheConfig::new(frames * 4096)).expect("cache");
        FarVec::new(cache, len).expect("farvec")
    }

    #[test]
    fn get_set_iter_chunks() {
        let v = farvec(10_000, 4);
        for i in 0..10_000u64 {
            v.set(i, i * 3).expect("set");
        }
        assert_eq!(v.get(9_999).expect("get"), 29_997);
        let all: Vec<u64> = v.iter().collect::<Result<_, _>>().expect("iter");
        assert_eq!(all.len(), 10_000);
        assert!(all.iter().enumerate().all(|(i, x)| *x == i as u64 * 3));
        let chunks: Vec<Vec<u64>> = v.chunks(3000).collect::<Result<_, _>>().expect("chunks");
        assert_eq!(
            chunks.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![3000, 3000, 3000, 1000]
        );
        assert!(v.get(10_000).is_err());
        assert!(v.set(10_000, 1).is_err());
        let mut out = [0u64; 2];
        assert!(v.read_slice(9_999, &mut out).is_err());
        assert!(v.stats().evictions > 0, "4 frames held 20 pages?");
    }

    /// Views borrow the pinned frames: pieces cover the range in order (starting
    /// part-way into a page), match `get`, and changes made through a mutable view are
    /// seen by `get`, survive eviction (the pages were dirty) and reach the store.
    #[test]
    fn slices_through_guards_view_and_change_pinned_pages_in_place() {
        let v = farvec(10_000, 6);
        for i in 0..10_000u64 {
            v.set(i, i).expect("set");
        }
        // 512 u64 a page: 700..2100 touches pages 1, 2, 3 and 4.
        {
            let s = v.slice(700..2100).expect("slice");
            assert_eq!(s.len(), 1400);
            assert_eq!(s.piece_count(), 4);
            let lens: Vec<usize> = s.pieces().map(<[u64]>::len).collect();
            assert_eq!(lens, vec![324, 512, 512, 52]);
            let all: Vec<u64> = s.pieces().flatten().copied().collect();
            assert_eq!(all, (700..2100).collect::<Vec<u64>>());
            assert_eq!(s.get(0), Some(700));
            assert_eq!(s.get(324), Some(1024));
            assert_eq!(s.get(1399), Some(2099));
            assert_eq!(s.get(1400), None);
        }
        {
            let mut s = v.slice_mut(1000..1030).expect("slice_mut");
            s.for_each_piece_mut(|piece| piece.iter_mut().for_each(|x| *x += 1_000_000));
            if let Some(piece) = s.piece_mut(1) {
                piece[0] = 7;
            }
        }
        assert_eq!(v.get(1000).expect("get"), 1_001_000);
        assert_eq!(v.get(1024).expect("get"), 7);
        assert_eq!(v.get(1029).expect("get"), 1_001_029);
        // Through every other page: the changed pages leave the six frames and come back.
        let evictions = v.stats().evictions;
        assert!(v.iter().all(|x| x.is_ok()));
        assert!(v.stats().evictions > evictions + 6);
        assert_eq!(v.get(1001).expect("get"), 1_001_001);
        assert_eq!(v.get(1024).expect("get"), 7);
        // An empty range is a guard over nothing.
        assert_eq!(v.slice(5..5).expect("empty").piece_count(), 0);
    }

    /// While a guard lives its pages are pinned; a range the cache cannot hold, past the
    /// end, backwards, or of elements that straddle pages is refused.
    #[test]
    fn slice_guards_pin_and_refuse_what_they_cannot_view() {
        let v = farvec(10_000, 4);
        {
            let s = v.slice(0..1024).expect("two pages");
            assert_eq!(s.piece_count(), 2);
        }
        let store = LocalStore::new(4096, 8).expect("store");
        let mut cache = PageCache::new(store, &CacheConfig::new(4 * 4096)).expect("cache");
        assert!(cache.pin_range(0, 5).is_err(), "five pins in four frames");
        cache.pin_range(0, 4).expect("pin every frame");
        let mut b = [0u8; 8];
        assert!(
            cache.read(4 * 4096, &mut b).is_err(),
            "evicted a pinned page"
        );
        cache.unpin_range(0, 4);
        cache.read(4 * 4096, &mut b).expect("room again");

        assert!(v.slice(0..3000).is_err(), "6 pages in a 4-page cache");
        assert!(v.slice(9_990..10_010).is_err(), "past the end");
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 10..5;
        assert!(v.slice(backwards).is_err());
        let store = LocalStore::new(4096, 4).expect("store");
        let cache = PageCache::new(store, &CacheConfig::new(4 * 4096)).expect("cache");
        let odd: FarVec<[u8; 3], _> = FarVec::new(cache, 100).expect("farvec");
        assert!(odd.slice(0..10).is_err(), "3-byte elements straddle pages");
    }

    #[test]
    fn a_vector_larger_than_its_store_is_refused() {
        let store = LocalStore::new(4096, 1).expect("store");
        let cache = PageCache::new(store, &CacheConfig::new(4096)).expect("cache");
        assert!(FarVec::<u64, _>::new(cache, 513).is_err());
    }
}
