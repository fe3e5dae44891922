//! Regions: page-rounded spans of server memory, found by id or by name.
//!
//! The map from id to region sits behind one `RwLock` that only ALLOC, FREE, LOOKUP and
//! LIST hold for more than a hash probe. Each region's bytes have their own `RwLock`, so
//! READs of a region run in parallel while WRITE, CAS and FETCH_ADD take it exclusively:
//! that is what makes a CAS atomic against every other access to the same bytes.

use crate::budget::{MemoryBudget, Reservation};
use camelot_proto::limits::{
    LIST_ENTRIES_MAX, NAME_BYTES_MAX, REGION_BYTES_MAX, REGION_PAGE_BYTES,
};
use camelot_proto::{ErrorCode, ErrorReply, RegionId, RegionInfo};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

const WORD_BYTES: u64 = 8;

fn err(code: ErrorCode, message: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, message)
}

#[derive(Debug)]
pub struct Region {
    id: RegionId,
    name: Option<String>,
    bytes: RwLock<Box<[u8]>>,
    size_bytes: u64,
    // Held for the region's whole life, so the budget is given back only when the last
    // in-flight operation on a freed region lets go of it.
    _reservation: Reservation,
}

impl Region {
    pub fn id(&self) -> RegionId {
        self.id
    }

    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn info(&self) -> RegionInfo {
        RegionInfo {
            id: self.id,
            size: self.size_bytes,
            name: self.name.clone(),
        }
    }

    /// The byte range `[offset, offset + len)` if it lies inside the region.
    pub fn range(&self, offset: u64, len: u64) -> Result<Range<usize>, ErrorReply> {
        match offset.checked_add(len) {
            // `end <= size_bytes`, and the region's bytes exist, so both fit in usize.
            Some(end) if end <= self.size_bytes => Ok(offset as usize..end as usize),
            _ => Err(err(
                ErrorCode::OutOfBounds,
                format!(
                    "{len} bytes at offset {offset} fall outside region {} of {} bytes",
                    self.id, self.size_bytes
                ),
            )),
        }
    }

    /// Copies `range` into `dst`. Panics unless `range` came from [`Region::range`] and
    /// `dst` is as long: that split lets a caller check bounds before reserving room.
    pub fn read_range(&self, range: Range<usize>, dst: &mut [u8]) {
        dst.copy_from_slice(&self.bytes.read()[range]);
    }

    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ErrorReply> {
        let range = self.range(offset, dst.len() as u64)?;
        self.read_range(range, dst);
        Ok(())
    }

    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), ErrorReply> {
        let range = self.range(offset, src.len() as u64)?;
        self.bytes.write()[range].copy_from_slice(src);
        Ok(())
    }

    fn word_range(&self, offset: u64) -> Result<Range<usize>, ErrorReply> {
        if offset & (WORD_BYTES - 1) != 0 {
            return Err(err(
                ErrorCode::Unaligned,
                format!("offset {offset} is not a multiple of {WORD_BYTES}"),
            ));
        }
        self.range(offset, WORD_BYTES)
    }

    /// Writes `new` if the little-endian word at `offset` equals `expected`; returns the
    /// word as it was, so the swap happened exactly when the result equals `expected`.
    pub fn cas(&self, offset: u64, expected: u64, new: u64) -> Result<u64, ErrorReply> {
        self.update_word(offset, |old| (old == expected).then_some(new))
    }

    /// Adds `delta` (wrapping) to the little-endian word at `offset`; returns the old value.
    pub fn fetch_add(&self, offset: u64, delta: u64) -> Result<u64, ErrorReply> {
        self.update_word(offset, |old| Some(old.wrapping_add(delta)))
    }

    fn update_word(
        &self,
        offset: u64,
        f: impl FnOnce(u64) -> Option<u64>,
    ) -> Result<u64, ErrorReply> {
        let range = self.word_range(offset)?;
        let mut bytes = self.bytes.write();
        let word = &mut bytes[range];
        let mut old = [0u8; WORD_BYTES as usize];
        old.copy_from_slice(word);
        let old = u64::from_le_bytes(old);
        if let Some(new) = f(old) {
            word.copy_from_slice(&new.to_le_bytes());
        }
        Ok(old)
    }
}

#[derive(Default)]
struct Maps {
    by_id: HashMap<RegionId, Arc<Region>>,
    by_name: HashMap<String, RegionId>,
    // Ids are handed out under the map lock, so they are monotonic in insertion order and
    // never reused: a client holding a stale id gets NO_SUCH_REGION, never someone else's
    // memory.
    last_id: RegionId,
}

pub struct RegionStore {
    budget: Arc<MemoryBudget>,
    maps: RwLock<Maps>,
}

impl RegionStore {
    pub fn new(budget: Arc<MemoryBudget>) -> Self {
        RegionStore {
            budget,
            maps: RwLock::new(Maps::default()),
        }
    }

    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    /// Allocates a zeroed region of `size_bytes` rounded up to whole pages. On any error
    /// nothing stays allocated or reserved.
    pub fn alloc(&self, size_bytes: u64, name: Option<String>) -> Result<Arc<Region>, ErrorReply> {
        if size_bytes == 0 {
            return Err(err(ErrorCode::BadRequest, "region size must not be zero"));
        }
        if size_bytes > REGION_BYTES_MAX {
            return Err(err(
                ErrorCode::TooLarge,
                format!("region of {size_bytes} bytes exceeds the limit of {REGION_BYTES_MAX}"),
            ));
        }
        if let Some(n) = &name {
            if n.is_empty() {
                return Err(err(ErrorCode::BadRequest, "region name must not be empty"));
            }
            if n.len() > NAME_BYTES_MAX {
                return Err(err(
                    ErrorCode::TooLarge,
                    format!("region name of {} bytes exceeds {NAME_BYTES_MAX}", n.len()),
                ));
            }
            // Checked early so a duplicate name does not cost an allocation; checked
            // again at insertion because another ALLOC may race us.
            if self.maps.read().by_name.contains_key(n) {
                return Err(name_exists(n));
            }
        }
        let rounded_bytes = size_bytes.div_ceil(REGION_PAGE_BYTES) * REGION_PAGE_BYTES;
        let reservation = self.budget.try_reserve(rounded_bytes).map_err(|e| {
            err(
                ErrorCode::OutOfMemory,
                format!("region of {rounded_bytes} bytes: {e}"),
            )
        })?;
        let bytes = zeroed(rounded_bytes)?;

        let mut maps = self.maps.write();
        if let Some(n) = &name {
            if maps.by_name.contains_key(n) {
                return Err(name_exists(n));
            }
        }
        maps.last_id += 1;
        let id = maps.last_id;
        let region = Arc::new(Region {
            id,
            name,
            bytes: RwLock::new(bytes),
            size_bytes: rounded_bytes,
            _reservation: reservation,
        });
        if let Some(n) = &region.name {
            maps.by_name.insert(n.clone(), id);
        }
        maps.by_id.insert(id, Arc::clone(&region));
        Ok(region)
    }

    pub fn get(&self, id: RegionId) -> Result<Arc<Region>, ErrorReply> {
        match self.maps.read().by_id.get(&id) {
            Some(r) => Ok(Arc::clone(r)),
            None => Err(no_such_region(id)),
        }
    }

    pub fn lookup(&self, name: &str) -> Result<Arc<Region>, ErrorReply> {
        let maps = self.maps.read();
        match maps.by_name.get(name).and_then(|id| maps.by_id.get(id)) {
            Some(r) => Ok(Arc::clone(r)),
            None => Err(err(
                ErrorCode::NameNotFound,
                format!("no region named {name:?}"),
            )),
        }
    }

    /// Removes the region. Its memory goes back to the budget once operations already
    /// running on it finish.
    pub fn free(&self, id: RegionId) -> Result<(), ErrorReply> {
        let region = {
            let mut maps = self.maps.write();
            let region = maps.by_id.remove(&id).ok_or_else(|| no_such_region(id))?;
            if let Some(n) = &region.name {
                maps.by_name.remove(n);
            }
            region
        };
        // Dropped outside the lock: freeing gigabytes should not stall every lookup.
        drop(region);
        Ok(())
    }

    /// Regions in id order, at most [`LIST_ENTRIES_MAX`] of them (the oldest).
    pub fn list(&self) -> Vec<RegionInfo> {
        let maps = self.maps.read();
        let mut regions: Vec<&Arc<Region>> = maps.by_id.values().collect();
        if regions.len() > LIST_ENTRIES_MAX {
            regions.select_nth_unstable_by_key(LIST_ENTRIES_MAX, |r| r.id);
            regions.truncate(LIST_ENTRIES_MAX);
        }
        regions.sort_unstable_by_key(|r| r.id);
        regions.iter().map(|r| r.info()).collect()
    }

    pub fn len(&self) -> usize {
        self.maps.read().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn read(&self, id: RegionId, offset: u64, dst: &mut [u8]) -> Result<(), ErrorReply> {
        self.get(id)?.read(offset, dst)
    }

    pub fn write(&self, id: RegionId, offset: u64, src: &[u8]) -> Result<(), ErrorReply> {
        self.get(id)?.write(offset, src)
    }

    pub fn cas(
        &self,
        id: RegionId,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> Result<u64, ErrorReply> {
        self.get(id)?.cas(offset, expected, new)
    }

    pub fn fetch_add(&self, id: RegionId, offset: u64, delta: u64) -> Result<u64, ErrorReply> {
        self.get(id)?.fetch_add(offset, delta)
    }
}

/// Zeroed memory whose allocation failure is an error rather than an abort.
fn zeroed(len_bytes: u64) -> Result<Box<[u8]>, ErrorReply> {
    let oom = || {
        err(
            ErrorCode::OutOfMemory,
            format!("the system could not allocate {len_bytes} bytes"),
        )
    };
    let len = usize::try_from(len_bytes).map_err(|_| oom())?;
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(len).map_err(|_| oom())?;
    v.resize(len, 0);
    Ok(v.into_boxed_slice())
}

fn no_such_region(id: RegionId) -> ErrorReply {
    err(ErrorCode::NoSuchRegion, format!("no region {id}"))
}

fn name_exists(name: &str) -> ErrorReply {
    err(
        ErrorCode::NameExists,
        format!("a region named {name:?} already exists"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = REGION_PAGE_BYTES;

    fn store(cap_bytes: u64) -> RegionStore {
        RegionStore::new(MemoryBudget::new(cap_bytes))
    }

    fn code<T: std::fmt::Debug>(r: Result<T, ErrorReply>) -> ErrorCode {
        r.unwrap_err().code
    }

    #[test]
    fn sizes_round_up_to_pages_and_bad_sizes_are_refused() {
        let s = store(1 << 30);
        assert_eq!(s.alloc(1, None).unwrap().size_bytes(), PAGE);
        assert_eq!(s.alloc(PAGE, None).unwrap().size_bytes(), PAGE);
        assert_eq!(s.alloc(PAGE + 1, None).unwrap().size_bytes(), 2 * PAGE);
        assert_eq!(code(s.alloc(0, None)), ErrorCode::BadRequest);
        assert_eq!(
            code(s.alloc(REGION_BYTES_MAX + 1, None)),
            ErrorCode::TooLarge
        );
        assert_eq!(code(s.alloc(u64::MAX, None)), ErrorCode::TooLarge);
        assert_eq!(code(s.alloc(1, Some(String::new()))), ErrorCode::BadRequest);
        assert_eq!(
            code(s.alloc(1, Some("x".repeat(NAME_BYTES_MAX + 1)))),
            ErrorCode::TooLarge
        );
        assert_eq!(s.budget().used(), 4 * PAGE);
    }

    #[test]
    fn cap_is_enforced_and_earlier_data_survives_a_refusal() {
        let s = store(3 * PAGE);
        let a = s.alloc(2 * PAGE, Some("a".into())).unwrap();
        a.write(100, b"precious").unwrap();
        a.write(2 * PAGE - 8, &7u64.to_le_bytes()).unwrap();

        let e = s.alloc(2 * PAGE, Some("b".into())).unwrap_err();
        assert_eq!(e.code, ErrorCode::OutOfMemory);
        assert_eq!(
            s.budget().used(),
            2 * PAGE,
            "a refused alloc reserves nothing"
        );
        assert_eq!(s.len(), 1);
        assert_eq!(code(s.lookup("b")), ErrorCode::NameNotFound);

        let mut buf = [0u8; 8];
        s.read(a.id(), 100, &mut buf).unwrap();
        assert_eq!(&buf, b"precious");
        assert_eq!(s.fetch_add(a.id(), 2 * PAGE - 8, 0).unwrap(), 7);

        // Exactly the remainder still fits.
        s.alloc(PAGE, None).unwrap();
        assert_eq!(s.budget().used(), 3 * PAGE);
        assert_eq!(code(s.alloc(1, None)), ErrorCode::OutOfMemory);
    }

    #[test]
    fn free_releases_budget_and_ids_are_never_reused() {
        let s = store(2 * PAGE);
        let a = s.alloc(2 * PAGE, Some("x".into())).unwrap().id();
        assert_eq!(code(s.alloc(1, None)), ErrorCode::OutOfMemory);
        s.free(a).unwrap();
        assert_eq!(s.budget().used(), 0);
        assert_eq!(code(s.free(a)), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.get(a)), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.lookup("x")), ErrorCode::NameNotFound);

        let b = s.alloc(2 * PAGE, Some("x".into())).unwrap().id();
        assert!(b > a, "id {b} reuses or precedes freed id {a}");
        s.free(b).unwrap();
        let mut seen = vec![a, b];
        for _ in 0..50 {
            let id = s.alloc(1, None).unwrap().id();
            s.free(id).unwrap();
            assert!(!seen.contains(&id));
            seen.push(id);
        }
        assert_eq!(s.budget().used(), 0);
    }

    #[test]
    fn memory_of_a_freed_region_returns_when_its_last_user_lets_go() {
        let s = store(PAGE);
        let r = s.alloc(1, None).unwrap();
        s.free(r.id()).unwrap();
        assert_eq!(s.budget().used(), PAGE);
        r.write(0, b"still mine").unwrap();
        drop(r);
        assert_eq!(s.budget().used(), 0);
    }

    #[test]
    fn names_are_unique_and_found() {
        let s = store(1 << 20);
        let a = s.alloc(10, Some("ledger".into())).unwrap();
        assert_eq!(
            code(s.alloc(10, Some("ledger".into()))),
            ErrorCode::NameExists
        );
        assert_eq!(s.budget().used(), PAGE);
        let found = s.lookup("ledger").unwrap();
        assert_eq!(found.id(), a.id());
        assert_eq!(found.name(), Some("ledger"));
        assert_eq!(code(s.lookup("nope")), ErrorCode::NameNotFound);
    }

    #[test]
    fn list_is_in_id_order() {
        let s = store(1 << 20);
        let ids: Vec<_> = (0..5).map(|_| s.alloc(1, None).unwrap().id()).collect();
        s.free(ids[2]).unwrap();
        let listed: Vec<_> = s.list().into_iter().map(|r| r.id).collect();
        assert_eq!(listed, vec![ids[0], ids[1], ids[3], ids[4]]);
        assert_eq!(s.list()[0].size, PAGE);
    }

    #[test]
    fn out_of_bounds_and_overflowing_offsets_are_refused() {
        let s = store(1 << 20);
        let r = s.alloc(PAGE, None).unwrap();
        let id = r.id();
        let mut one = [0u8; 1];
        let mut empty = [0u8; 0];
        s.read(id, PAGE - 1, &mut one).unwrap();
        s.read(id, PAGE, &mut empty).unwrap();
        s.write(id, PAGE, &[]).unwrap();
        for offset in [PAGE, PAGE + 1, u64::MAX, u64::MAX - 7, 1 << 63] {
            assert_eq!(code(s.read(id, offset, &mut one)), ErrorCode::OutOfBounds);
            assert_eq!(code(s.write(id, offset, b"x")), ErrorCode::OutOfBounds);
        }
        assert_eq!(
            code(s.read(id, u64::MAX, &mut empty)),
            ErrorCode::OutOfBounds
        );
        assert_eq!(code(r.range(1, u64::MAX)), ErrorCode::OutOfBounds);
        assert_eq!(code(r.range(u64::MAX, 1)), ErrorCode::OutOfBounds);
        assert_eq!(code(s.write(id, PAGE - 1, b"xy")), ErrorCode::OutOfBounds);
        for offset in [PAGE, u64::MAX - 7, 1 << 63] {
            assert_eq!(code(s.cas(id, offset, 0, 1)), ErrorCode::OutOfBounds);
            assert_eq!(code(s.fetch_add(id, offset, 1)), ErrorCode::OutOfBounds);
        }
        assert_eq!(code(s.read(id + 1, 0, &mut one)), ErrorCode::NoSuchRegion);
        // Nothing was written by the refused calls.
        let mut all = vec![1u8; PAGE as usize];
        s.read(id, 0, &mut all).unwrap();
        assert!(all.iter().all(|&b| b == 0));
    }

    #[test]
    fn unaligned_word_ops_are_refused() {
        let s = store(1 << 20);
        let id = s.alloc(PAGE, None).unwrap().id();
        for offset in [1, 4, 7, 9, PAGE - 1, u64::MAX] {
            assert_eq!(code(s.cas(id, offset, 0, 1)), ErrorCode::Unaligned);
            assert_eq!(code(s.fetch_add(id, offset, 1)), ErrorCode::Unaligned);
        }
        assert_eq!(s.fetch_add(id, PAGE - 8, 1).unwrap(), 0);
    }

    #[test]
    fn cas_swaps_only_on_match_and_words_are_little_endian() {
        let s = store(1 << 20);
        let id = s.alloc(PAGE, None).unwrap().id();
        s.write(id, 8, &0x0102_0304_0506_0708u64.to_le_bytes())
            .unwrap();
        assert_eq!(s.cas(id, 8, 99, 5).unwrap(), 0x0102_0304_0506_0708);
        assert_eq!(s.fetch_add(id, 8, 0).unwrap(), 0x0102_0304_0506_0708);
        assert_eq!(
            s.cas(id, 8, 0x0102_0304_0506_0708, 5).unwrap(),
            0x0102_0304_0506_0708
        );
        let mut buf = [0u8; 8];
        s.read(id, 8, &mut buf).unwrap();
        assert_eq!(buf, [5, 0, 0, 0, 0, 0, 0, 0]);
        // Neighbouring words untouched.
        s.read(id, 0, &mut buf).unwrap();
        assert_eq!(buf, [0; 8]);
        s.read(id, 16, &mut buf).unwrap();
        assert_eq!(buf, [0; 8]);
    }

    #[test]
    fn fetch_add_wraps() {
        let s = store(1 << 20);
        let id = s.alloc(PAGE, None).unwrap().id();
        s.write(id, 0, &(u64::MAX - 1).to_le_bytes()).unwrap();
        assert_eq!(s.fetch_add(id, 0, 3).unwrap(), u64::MAX - 1);
        assert_eq!(s.fetch_add(id, 0, u64::MAX).unwrap(), 1);
        assert_eq!(s.fetch_add(id, 0, 0).unwrap(), 0);
    }

    #[test]
    fn concurrent_fetch_add_and_cas_loops_lose_no_update() {
        const THREADS: u64 = 8;
        const ROUNDS: u64 = 10_000;
        let s = store(1 << 20);
        let id = s.alloc(PAGE, None).unwrap().id();
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let s = &s;
                scope.spawn(move || {
                    for i in 0..ROUNDS {
                        s.fetch_add(id, 64, 1).unwrap();
                        let mut seen = 0;
                        loop {
                            let old = s.cas(id, 64, seen, seen + 1).unwrap();
                            if old == seen {
                                break;
                            }
                            seen = old;
                        }
                        // Writes to a neighbouring word must not disturb the counter.
                        s.write(id, 72, &(t * ROUNDS + i).to_le_bytes()).unwrap();
                    }
                });
            }
        });
        assert_eq!(s.fetch_add(id, 64, 0).unwrap(), 2 * THREADS * ROUNDS);
    }

    #[test]
    fn reads_never_see_a_torn_write() {
        let s = store(1 << 20);
        let id = s.alloc(PAGE, None).unwrap().id();
        std::thread::scope(|scope| {
            let s = &s;
            scope.spawn(move || {
                for i in 0..5_000u32 {
                    let b = (i % 251) as u8;
                    s.write(id, 0, &[b; 4096]).unwrap();
                }
            });
            scope.spawn(move || {
                let mut buf = vec![0u8; 4096];
                for _ in 0..5_000 {
                    s.read(id, 0, &mut buf).unwrap();
                    assert!(buf.iter().all(|&b| b == buf[0]), "torn read");
                }
            });
        });
    }
}
