//! Regions: page-rounded spans of server memory, found by id or by name.
//!
//! Every region has an owner (the principal of the connection that allocated it) and an
//! access mode. A private region is visible only to its owner: to anyone else every
//! operation on it answers exactly as for an id or name that does not exist, so probing
//! tells nothing. A shared region may be found, read and written by any principal, but
//! freed only by its owner (FORBIDDEN otherwise). Ids are random 64-bit numbers from a
//! CSPRNG, never 0 and never one in use, so an id cannot be guessed from another.
//! Each principal's regions and bytes are counted against a [`Quota`].
//!
//! The map from id to region sits behind one `RwLock` that only ALLOC, FREE, LOOKUP and
//! LIST hold for more than a hash probe. Each region's bytes have their own `RwLock`, so
//! READs of a region run in parallel while WRITE, CAS and FETCH_ADD take it exclusively:
//! that is what makes a CAS atomic against every other access to the same bytes.

use crate::budget::{MemoryBudget, Reservation};
use camelot_proto::limits::{
    LIST_ENTRIES_MAX, NAME_BYTES_MAX, REGION_BYTES_MAX, REGION_PAGE_BYTES,
};
use camelot_proto::{AccessMode, ErrorCode, ErrorReply, RegionId, RegionInfo};
use parking_lot::RwLock;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

const WORD_BYTES: u64 = 8;

fn err(code: ErrorCode, message: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, message)
}

/// Who a connection acts as: the name its client gave in HELLO (or the default). Shared
/// by every region it owns, so a name is stored once per principal, not per region.
pub type Principal = Arc<str>;

/// What one principal may hold at once. `u64::MAX` means no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub bytes_max: u64,
    pub regions_max: u64,
}

impl Quota {
    pub const UNLIMITED: Quota = Quota {
        bytes_max: u64::MAX,
        regions_max: u64::MAX,
    };
}

impl Default for Quota {
    fn default() -> Self {
        Quota::UNLIMITED
    }
}

/// What one principal holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes: u64,
    pub regions: u64,
}

#[derive(Debug)]
pub struct Region {
    id: RegionId,
    owner: Principal,
    mode: AccessMode,
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

    pub fn owner(&self) -> &str {
        &self.owner
    }

    pub fn mode(&self) -> AccessMode {
        self.mode
    }

    /// Whether `who` may find, read and write it.
    pub fn visible_to(&self, who: &str) -> bool {
        self.mode == AccessMode::Shared || &*self.owner == who
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn info(&self) -> RegionInfo {
        RegionInfo {
            id: self.id,
            size: self.size_bytes,
            name: self.name.clone(),
            mode: self.mode,
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

    /// Runs `f` on the bytes at `range` under the shared lock, so a reply can copy them
    /// straight into its frame. Panics unless `range` came from [`Region::range`].
    pub fn with_range<R>(&self, range: Range<usize>, f: impl FnOnce(&[u8]) -> R) -> R {
        f(&self.bytes.read()[range])
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

    /// Copies the bytes at `range` into `old` and writes `src` there, under the exclusive
    /// lock, so no other op sees or makes a change between the two. Panics unless `range`
    /// came from [`Region::range`] and `old` and `src` are as long (as `read_range`).
    pub fn swap_range(&self, range: Range<usize>, src: &[u8], old: &mut [u8]) {
        let mut bytes = self.bytes.write();
        let span = &mut bytes[range];
        old.copy_from_slice(span);
        span.copy_from_slice(src);
    }

    /// XORs `src` into the bytes at `offset`, under the exclusive lock: concurrent
    /// XOR_INTOs on one span all land, in whatever order, which is what lets writers
    /// of one stripe apply parity deltas without ordering among themselves.
    pub fn xor_into(&self, offset: u64, src: &[u8]) -> Result<(), ErrorReply> {
        let range = self.range(offset, src.len() as u64)?;
        let mut bytes = self.bytes.write();
        for (d, s) in bytes[range].iter_mut().zip(src) {
            *d ^= s;
        }
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

struct Maps {
    by_id: HashMap<RegionId, Arc<Region>>,
    by_name: HashMap<String, RegionId>,
    /// Principals holding at least one region; an entry goes when its last region does,
    /// so the map is bounded by the number of regions.
    usage: HashMap<Principal, Usage>,
    // Ids are drawn under the map lock from a CSPRNG seeded by the OS: not 0 (which
    // clients may use as "none"), not one in use. A freed id could only come back by a
    // 64-bit coincidence, so a client holding a stale id gets NO_SUCH_REGION, never
    // someone else's memory, in practice.
    ids: StdRng,
}

impl Maps {
    fn new_id(&mut self) -> RegionId {
        loop {
            let id = self.ids.next_u64();
            if id != 0 && !self.by_id.contains_key(&id) {
                return id;
            }
        }
    }

    fn check_quota(&self, who: &str, quota: &Quota, rounded_bytes: u64) -> Result<(), ErrorReply> {
        let used = self.usage.get(who).copied().unwrap_or_default();
        if used.regions >= quota.regions_max {
            return Err(err(
                ErrorCode::QuotaExceeded,
                format!(
                    "principal {who:?} holds {} regions, its quota",
                    used.regions
                ),
            ));
        }
        if used.bytes.saturating_add(rounded_bytes) > quota.bytes_max {
            return Err(err(
                ErrorCode::QuotaExceeded,
                format!(
                    "principal {who:?} holds {} bytes; {rounded_bytes} more exceed its quota of {}",
                    used.bytes, quota.bytes_max
                ),
            ));
        }
        Ok(())
    }
}

pub struct RegionStore {
    budget: Arc<MemoryBudget>,
    quota: Quota,
    maps: RwLock<Maps>,
}

impl RegionStore {
    pub fn new(budget: Arc<MemoryBudget>) -> Self {
        Self::with_quota(budget, Quota::UNLIMITED)
    }

    pub fn with_quota(budget: Arc<MemoryBudget>, quota: Quota) -> Self {
        RegionStore {
            budget,
            quota,
            maps: RwLock::new(Maps {
                by_id: HashMap::new(),
                by_name: HashMap::new(),
                usage: HashMap::new(),
                ids: StdRng::from_entropy(),
            }),
        }
    }

    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// What `who` holds now.
    pub fn usage(&self, who: &str) -> Usage {
        self.maps.read().usage.get(who).copied().unwrap_or_default()
    }

    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    /// Allocates a zeroed region of `size_bytes` rounded up to whole pages, owned by `who`.
    /// On any error nothing stays allocated or reserved.
    pub fn alloc(
        &self,
        who: &Principal,
        size_bytes: u64,
        name: Option<String>,
        mode: AccessMode,
    ) -> Result<Arc<Region>, ErrorReply> {
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
        // Checked before allocating so a principal at its quota costs nothing; checked
        // again at insertion, where it counts, because its other connections may race.
        self.maps
            .read()
            .check_quota(who, &self.quota, rounded_bytes)?;
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
        maps.check_quota(who, &self.quota, rounded_bytes)?;
        let id = maps.new_id();
        let usage = maps.usage.entry(Arc::clone(who)).or_default();
        usage.regions += 1;
        usage.bytes += rounded_bytes;
        let region = Arc::new(Region {
            id,
            owner: Arc::clone(who),
            mode,
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

    /// The region `id` if `who` may use it; someone else's private region is answered
    /// exactly like a missing one.
    pub fn get(&self, who: &str, id: RegionId) -> Result<Arc<Region>, ErrorReply> {
        match self.maps.read().by_id.get(&id) {
            Some(r) if r.visible_to(who) => Ok(Arc::clone(r)),
            _ => Err(no_such_region(id)),
        }
    }

    pub fn lookup(&self, who: &str, name: &str) -> Result<Arc<Region>, ErrorReply> {
        let maps = self.maps.read();
        match maps.by_name.get(name).and_then(|id| maps.by_id.get(id)) {
            Some(r) if r.visible_to(who) => Ok(Arc::clone(r)),
            _ => Err(err(
                ErrorCode::NameNotFound,
                format!("no region named {name:?}"),
            )),
        }
    }

    /// Removes the region, if `who` owns it. Its memory goes back to the budget once
    /// operations already running on it finish; the owner's quota is credited at once.
    pub fn free(&self, who: &str, id: RegionId) -> Result<(), ErrorReply> {
        let region = {
            let mut maps = self.maps.write();
            match maps.by_id.get(&id) {
                Some(r) if &*r.owner == who => {}
                Some(r) if r.visible_to(who) => {
                    return Err(err(
                        ErrorCode::Forbidden,
                        format!("region {id} is shared, but only its owner may free it"),
                    ))
                }
                _ => return Err(no_such_region(id)),
            }
            let region = maps.by_id.remove(&id).ok_or_else(|| no_such_region(id))?;
            if let Some(n) = &region.name {
                maps.by_name.remove(n);
            }
            if let Some(u) = maps.usage.get_mut(who) {
                u.regions = u.regions.saturating_sub(1);
                u.bytes = u.bytes.saturating_sub(region.size_bytes);
                if u.regions == 0 {
                    maps.usage.remove(who);
                }
            }
            region
        };
        // Dropped outside the lock: freeing gigabytes should not stall every lookup.
        drop(region);
        Ok(())
    }

    /// The regions `who` may use, in id order, at most [`LIST_ENTRIES_MAX`] of them (the
    /// lowest ids).
    pub fn list(&self, who: &str) -> Vec<RegionInfo> {
        let maps = self.maps.read();
        let mut regions: Vec<&Arc<Region>> =
            maps.by_id.values().filter(|r| r.visible_to(who)).collect();
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

    pub fn read(
        &self,
        who: &str,
        id: RegionId,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), ErrorReply> {
        self.get(who, id)?.read(offset, dst)
    }

    pub fn write(
        &self,
        who: &str,
        id: RegionId,
        offset: u64,
        src: &[u8],
    ) -> Result<(), ErrorReply> {
        self.get(who, id)?.write(offset, src)
    }

    pub fn xor_into(
        &self,
        who: &str,
        id: RegionId,
        offset: u64,
        src: &[u8],
    ) -> Result<(), ErrorReply> {
        self.get(who, id)?.xor_into(offset, src)
    }

    pub fn cas(
        &self,
        who: &str,
        id: RegionId,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> Result<u64, ErrorReply> {
        self.get(who, id)?.cas(offset, expected, new)
    }

    pub fn fetch_add(
        &self,
        who: &str,
        id: RegionId,
        offset: u64,
        delta: u64,
    ) -> Result<u64, ErrorReply> {
        self.get(who, id)?.fetch_add(offset, delta)
    }

    /// Writes `src` at `offset` of region `id` if the little-endian word at `guard_offset`
    /// of region `guard` equals `expected`; returns the guard word as it was, so the write
    /// happened exactly when the result equals `expected`. The guard's lock is held
    /// (shared) across the write, and CAS, FETCH_ADD and WRITE take it exclusively, so no
    /// change of the guard word falls between the check and the write.
    #[allow(clippy::too_many_arguments)]
    pub fn write_if(
        &self,
        who: &str,
        id: RegionId,
        offset: u64,
        src: &[u8],
        guard: RegionId,
        guard_offset: u64,
        expected: u64,
    ) -> Result<u64, ErrorReply> {
        let target = self.get(who, id)?;
        let range = target.range(offset, src.len() as u64)?;
        let word = |bytes: &[u8], at: &Range<usize>| {
            let mut w = [0u8; WORD_BYTES as usize];
            w.copy_from_slice(&bytes[at.clone()]);
            u64::from_le_bytes(w)
        };
        if guard == id {
            let at = target.word_range(guard_offset)?;
            let mut bytes = target.bytes.write();
            let old = word(&bytes, &at);
            if old == expected {
                bytes[range].copy_from_slice(src);
            }
            return Ok(old);
        }
        let guard = self.get(who, guard)?;
        let at = guard.word_range(guard_offset)?;
        // Two locks, always taken in region-id order: two WRITE_IFs each guarding the
        // other's target cannot then wait on each other.
        if guard.id < target.id {
            let g = guard.bytes.read();
            let old = word(&g, &at);
            if old == expected {
                target.bytes.write()[range].copy_from_slice(src);
            }
            Ok(old)
        } else {
            let mut t = target.bytes.write();
            let old = word(&guard.bytes.read(), &at);
            if old == expected {
                t[range].copy_from_slice(src);
            }
            Ok(old)
        }
    }
}

/// Zeroed memory whose allocation failure is an error rather than an abort. A zeroed
/// allocation, not one filled with zeros: a large one is fresh pages the kernel zeroes
/// as they are first touched, so an ALLOC of gigabytes costs its worker thread
/// microseconds instead of a memset of every byte (which held the thread, and with it
/// every connection it served, for a third of a second per GiB), and the server's
/// resident memory grows as regions are written.
fn zeroed(len_bytes: u64) -> Result<Box<[u8]>, ErrorReply> {
    let oom = || {
        err(
            ErrorCode::OutOfMemory,
            format!("the system could not allocate {len_bytes} bytes"),
        )
    };
    let len = usize::try_from(len_bytes).map_err(|_| oom())?;
    bytemuck::allocation::try_zeroed_slice_box::<u8>(len).map_err(|()| oom())
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
    const ME: &str = "me";

    /// The store as one principal sees it, with private regions: what every test below
    /// but the ownership ones needs.
    struct Mine(RegionStore);

    impl std::ops::Deref for Mine {
        type Target = RegionStore;
        fn deref(&self) -> &RegionStore {
            &self.0
        }
    }

    impl Mine {
        fn alloc(&self, size: u64, name: Option<String>) -> Result<Arc<Region>, ErrorReply> {
            self.0
                .alloc(&Principal::from(ME), size, name, AccessMode::Private)
        }
        fn free(&self, id: RegionId) -> Result<(), ErrorReply> {
            self.0.free(ME, id)
        }
        fn get(&self, id: RegionId) -> Result<Arc<Region>, ErrorReply> {
            self.0.get(ME, id)
        }
        fn lookup(&self, name: &str) -> Result<Arc<Region>, ErrorReply> {
            self.0.lookup(ME, name)
        }
        fn list(&self) -> Vec<RegionInfo> {
            self.0.list(ME)
        }
        fn read(&self, id: RegionId, offset: u64, dst: &mut [u8]) -> Result<(), ErrorReply> {
            self.0.read(ME, id, offset, dst)
        }
        fn write(&self, id: RegionId, offset: u64, src: &[u8]) -> Result<(), ErrorReply> {
            self.0.write(ME, id, offset, src)
        }
        fn cas(&self, id: RegionId, off: u64, expected: u64, new: u64) -> Result<u64, ErrorReply> {
            self.0.cas(ME, id, off, expected, new)
        }
        fn fetch_add(&self, id: RegionId, offset: u64, delta: u64) -> Result<u64, ErrorReply> {
            self.0.fetch_add(ME, id, offset, delta)
        }
        fn write_if(
            &self,
            (id, offset): (RegionId, u64),
            src: &[u8],
            (guard, guard_offset, expected): (RegionId, u64, u64),
        ) -> Result<u64, ErrorReply> {
            self.0
                .write_if(ME, id, offset, src, guard, guard_offset, expected)
        }
    }

    #[test]
    fn write_if_writes_exactly_when_the_guard_matches() {
        let s = store(1 << 20);
        let a = s.alloc(PAGE, None).unwrap().id();
        let b = s.alloc(PAGE, None).unwrap().id();
        s.write(b, 8, &5u64.to_le_bytes()).unwrap();
        let read = |id, off| {
            let mut buf = [0u8; 4];
            s.read(id, off, &mut buf).unwrap();
            buf
        };
        // Both lock orders: guard id below and above the target's.
        for (target, guard) in [(a, b), (b, a)] {
            let off = if target == b { 64 } else { 0 };
            s.write(guard, 8, &5u64.to_le_bytes()).unwrap();
            assert_eq!(
                s.write_if((target, off), b"nope", (guard, 8, 4)).unwrap(),
                5
            );
            assert_eq!(read(target, off), [0; 4], "a failed guard wrote");
            assert_eq!(
                s.write_if((target, off), b"yes!", (guard, 8, 5)).unwrap(),
                5
            );
            assert_eq!(&read(target, off), b"yes!");
        }
        // A guard inside the target region itself.
        assert_eq!(s.write_if((b, 100), b"self", (b, 8, 5)).unwrap(), 5);
        assert_eq!(&read(b, 100), b"self");
        assert_eq!(s.write_if((b, 200), b"self", (b, 8, 6)).unwrap(), 5);
        assert_eq!(read(b, 200), [0; 4]);
        // Bad guards and bad targets are errors, not silent no-ops.
        assert_eq!(
            code(s.write_if((a, 0), b"x", (b, 3, 5))),
            ErrorCode::Unaligned
        );
        assert_eq!(
            code(s.write_if((a, 0), b"x", (b, PAGE, 5))),
            ErrorCode::OutOfBounds
        );
        assert_eq!(
            code(s.write_if((a, 0), b"x", (999, 0, 0))),
            ErrorCode::NoSuchRegion
        );
        assert_eq!(
            code(s.write_if((a, PAGE), b"x", (b, 8, 5))),
            ErrorCode::OutOfBounds
        );
        let theirs =
            s.0.alloc(&Principal::from("them"), PAGE, None, AccessMode::Private)
                .unwrap()
                .id();
        assert_eq!(
            code(s.write_if((a, 0), b"x", (theirs, 0, 0))),
            ErrorCode::NoSuchRegion
        );
    }

    /// The fencing property: once FETCH_ADD has moved the guard, no WRITE_IF expecting the
    /// old value lands, however the threads interleave.
    #[test]
    fn no_guarded_write_lands_after_the_guard_moved() {
        for round in 0..20u64 {
            let s = Arc::new(store(1 << 20));
            let target = s.alloc(PAGE, None).unwrap().id();
            let guard = s.alloc(PAGE, None).unwrap().id();
            let writer = {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    let mut n = 1u64;
                    while s
                        .write_if((target, 0), &n.to_le_bytes(), (guard, 0, 0))
                        .unwrap()
                        == 0
                    {
                        n += 1;
                    }
                    n
                })
            };
            // Let a few writes land first (bounded: the writer never stops on its own).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while s.fetch_add(target, 0, 0).unwrap() < round + 1 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the writer never wrote"
                );
                std::thread::yield_now();
            }
            s.fetch_add(guard, 0, 1).unwrap();
            let seen = s.fetch_add(target, 0, 0).unwrap();
            let refused = writer.join().unwrap();
            assert_eq!(
                s.fetch_add(target, 0, 0).unwrap(),
                seen,
                "a write landed after"
            );
            assert_eq!(
                seen + 1,
                refused,
                "the first refused write was not the next one"
            );
        }
    }

    fn store(cap_bytes: u64) -> Mine {
        Mine(RegionStore::new(MemoryBudget::new(cap_bytes)))
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
        assert_ne!(b, a, "freed id {a} was reused");
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
        let mut ids: Vec<_> = (0..5).map(|_| s.alloc(1, None).unwrap().id()).collect();
        s.free(ids[2]).unwrap();
        ids.remove(2);
        ids.sort_unstable();
        let listed: Vec<_> = s.list().into_iter().map(|r| r.id).collect();
        assert_eq!(listed, ids);
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
        assert_eq!(
            code(s.read(id.wrapping_add(1), 0, &mut one)),
            ErrorCode::NoSuchRegion
        );
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
    fn swap_answers_the_old_bytes_and_xor_into_flips_them() {
        let s = store(1 << 20);
        let r = s.alloc(PAGE, None).unwrap();
        r.write(10, b"abcd").unwrap();
        let range = r.range(10, 4).unwrap();
        let mut old = [0u8; 4];
        r.swap_range(range, b"wxyz", &mut old);
        assert_eq!(&old, b"abcd");
        r.xor_into(11, &[0x20, 0x20]).unwrap();
        let mut now = [0u8; 4];
        r.read(10, &mut now).unwrap();
        assert_eq!(&now, b"wXYz");
        assert_eq!(
            code(s.xor_into(ME, r.id(), PAGE - 1, b"ab")),
            ErrorCode::OutOfBounds
        );
        assert_eq!(
            code(s.xor_into(ME, r.id(), u64::MAX, b"a")),
            ErrorCode::OutOfBounds
        );
    }

    /// What RAID parity by deltas relies on: writers that each SWAP their data in and
    /// XOR (old ^ new) into a parity span, concurrently and over overlapping bytes, leave
    /// parity equal to the XOR of the data. A SWAP that read and wrote under two lock
    /// acquisitions would let two writers take the same old bytes and fail this.
    #[test]
    fn concurrent_swaps_and_xor_deltas_keep_parity_the_xor_of_data() {
        const THREADS: usize = 6;
        const ROUNDS: usize = 4_000;
        const SPAN: usize = 64;
        let s = store(1 << 20);
        let data: Vec<RegionId> = (0..3).map(|_| s.alloc(PAGE, None).unwrap().id()).collect();
        let parity = s.alloc(PAGE, None).unwrap().id();
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (s, data) = (&s, &data);
                scope.spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                    for _ in 0..ROUNDS {
                        // xorshift: cheap, deterministic per thread.
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let member = data[(x % 3) as usize];
                        // Few distinct offsets, so writers collide on the same bytes.
                        let at = (x >> 8) % 4 * 16;
                        let new = [(x >> 16) as u8; SPAN];
                        let r = s.get(member).unwrap();
                        let mut old = [0u8; SPAN];
                        r.swap_range(r.range(at, SPAN as u64).unwrap(), &new, &mut old);
                        let delta: Vec<u8> = old.iter().zip(&new).map(|(a, b)| a ^ b).collect();
                        s.xor_into(ME, parity, at, &delta).unwrap();
                    }
                });
            }
        });
        let span = 3 * 16 + SPAN;
        let mut want = vec![0u8; span];
        for &d in &data {
            let mut buf = vec![0u8; span];
            s.read(d, 0, &mut buf).unwrap();
            want.iter_mut().zip(&buf).for_each(|(w, b)| *w ^= b);
        }
        let mut got = vec![0u8; span];
        s.read(parity, 0, &mut got).unwrap();
        assert_eq!(got, want, "parity is not the XOR of the data");
        assert!(want.iter().any(|&b| b != 0), "nothing was written");
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

    fn p(name: &str) -> Principal {
        Principal::from(name)
    }

    #[test]
    fn private_regions_are_invisible_to_other_principals() {
        let s = RegionStore::new(MemoryBudget::new(1 << 20));
        let (alice, bob) = (p("alice"), p("bob"));
        let id = s
            .alloc(&alice, PAGE, Some("diary".into()), AccessMode::Private)
            .unwrap()
            .id();
        s.write(&alice, id, 0, b"secret").unwrap();
        let mut buf = [0u8; 6];
        // To bob it answers exactly as a region that does not exist.
        assert_eq!(code(s.get(&bob, id)), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.read(&bob, id, 0, &mut buf)), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.write(&bob, id, 0, b"x")), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.cas(&bob, id, 0, 0, 1)), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.fetch_add(&bob, id, 0, 1)), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.free(&bob, id)), ErrorCode::NoSuchRegion);
        assert_eq!(code(s.lookup(&bob, "diary")), ErrorCode::NameNotFound);
        assert!(s.list(&bob).is_empty());
        // Nothing bob tried changed it, and alice still has it all.
        s.read(&alice, id, 0, &mut buf).unwrap();
        assert_eq!(&buf, b"secret");
        assert_eq!(s.lookup(&alice, "diary").unwrap().id(), id);
        assert_eq!(s.list(&alice).len(), 1);
        s.free(&alice, id).unwrap();
        assert_eq!(s.budget().used(), 0);
    }

    #[test]
    fn shared_regions_are_usable_by_all_but_freed_only_by_the_owner() {
        let s = RegionStore::new(MemoryBudget::new(1 << 20));
        let (alice, bob) = (p("alice"), p("bob"));
        let id = s
            .alloc(&alice, PAGE, Some("board".into()), AccessMode::Shared)
            .unwrap()
            .id();
        s.write(&bob, id, 0, b"hi").unwrap();
        assert_eq!(s.fetch_add(&bob, id, 8, 2).unwrap(), 0);
        let mut buf = [0u8; 2];
        s.read(&alice, id, 0, &mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        assert_eq!(s.lookup(&bob, "board").unwrap().mode(), AccessMode::Shared);
        assert_eq!(s.list(&bob)[0].mode, AccessMode::Shared);
        assert_eq!(code(s.free(&bob, id)), ErrorCode::Forbidden);
        assert!(s.get(&alice, id).is_ok(), "a refused FREE freed it");
        s.free(&alice, id).unwrap();
        assert_eq!(code(s.get(&bob, id)), ErrorCode::NoSuchRegion);
    }

    #[test]
    fn quotas_bound_each_principal_separately_and_are_credited_on_free() {
        // Each refusal is for one limit only: bytes while regions are left, regions
        // while bytes are left.
        let quota = Quota {
            bytes_max: 4 * PAGE,
            regions_max: 2,
        };
        let s = RegionStore::with_quota(MemoryBudget::new(1 << 30), quota);
        let (alice, bob) = (p("alice"), p("bob"));
        let a1 = s
            .alloc(&alice, 2 * PAGE, None, AccessMode::Private)
            .unwrap();
        // Bytes: 2 pages held, 3 more would make 5 > 4.
        let e = s
            .alloc(&alice, 3 * PAGE, None, AccessMode::Private)
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::QuotaExceeded);
        let a2 = s.alloc(&alice, PAGE, None, AccessMode::Shared).unwrap();
        // Regions: 2 held; one more page would still fit the bytes (4 <= 4).
        let e = s.alloc(&alice, 1, None, AccessMode::Private).unwrap_err();
        assert_eq!(e.code, ErrorCode::QuotaExceeded);
        assert_eq!(
            s.usage("alice"),
            Usage {
                bytes: 3 * PAGE,
                regions: 2
            }
        );
        // Refusals reserved nothing, and bob has a quota of his own.
        assert_eq!(s.budget().used(), 3 * PAGE);
        s.alloc(&bob, 3 * PAGE, None, AccessMode::Private).unwrap();
        // Bob cannot free alice's shared region to make room for anyone.
        assert_eq!(code(s.free(&bob, a2.id())), ErrorCode::Forbidden);
        s.free(&alice, a1.id()).unwrap();
        s.alloc(&alice, 2 * PAGE, None, AccessMode::Private)
            .unwrap();
        // The memory cap is a different error.
        let small = RegionStore::with_quota(MemoryBudget::new(PAGE), Quota::UNLIMITED);
        let e = small
            .alloc(&alice, 2 * PAGE, None, AccessMode::Private)
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::OutOfMemory);
    }

    #[test]
    fn ids_are_random_nonzero_and_unique() {
        let s = RegionStore::new(MemoryBudget::new(1 << 30));
        let me = p("me");
        let ids: Vec<RegionId> = (0..200)
            .map(|_| s.alloc(&me, 1, None, AccessMode::Private).unwrap().id())
            .collect();
        assert!(ids.iter().all(|&id| id != 0));
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len(), "an id was handed out twice");
        // Sequential ids (what the old store gave) would all be within 200 of each other.
        let consecutive = ids
            .windows(2)
            .filter(|w| w[1].abs_diff(w[0]) < 1 << 32)
            .count();
        assert_eq!(consecutive, 0, "ids look sequential: {:?}", &ids[..5]);
        // High bits are used: a counter never reaches them.
        assert!(ids.iter().any(|&id| id > 1 << 62));
        // Another store does not repeat the same sequence (it is seeded by the OS).
        let other = RegionStore::new(MemoryBudget::new(1 << 30));
        let first = other.alloc(&me, 1, None, AccessMode::Private).unwrap().id();
        assert!(!ids.contains(&first));
    }
}
