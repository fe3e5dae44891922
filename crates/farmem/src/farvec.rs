//! `FarVec<T>`: a vector whose elements live in far memory, behind a page cache. Reads
//! and writes go through the cache, so a program touching a working set larger than
//! local memory pays a remote round trip only on a miss.

use std::marker::PhantomData;

use bytemuck::Pod;
use parking_lot::Mutex;

use crate::cache::{CacheStats, PageCache};
use crate::store::PageStore;
use crate::Error;

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

    #[test]
    fn a_vector_larger_than_its_store_is_refused() {
        let store = LocalStore::new(4096, 1).expect("store");
        let cache = PageCache::new(store, &CacheConfig::new(4096)).expect("cache");
        assert!(FarVec::<u64, _>::new(cache, 513).is_err());
    }
}
