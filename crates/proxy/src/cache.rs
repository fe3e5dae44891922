//! The proxy's read cache (`--read-cache`). Pure.
//!
//! It caches READ answers by (region, offset, length) and answers a later READ that
//! falls inside one, for the same reason the proxy may vouch for words (`words`): every
//! request to a region leaves on one lane in the order the proxy decided it, so each
//! decided WRITE is patched into the cached bytes it covers and anything whose effect the
//! cache does not know (a forwarded CAS, FETCH_ADD, FREE) evicts what it touches. An
//! answer is cached only if nothing that could change its bytes was decided between the
//! READ leaving and its answer arriving: each READ notes the generation of the slots its
//! bytes hash to, every change bumps its slots, and a changed slot turns the fill away.
//! Slots are a fixed table, so a collision costs a fill, never a wrong answer.
//!
//! Bounded by a byte budget (entries' bytes plus a fixed overhead each, and the slot
//! table, which takes at most a quarter of it: a few-KiB budget gets a small table, whose
//! collisions cost fills, never answers); past it the oldest entries go.

use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};

pub type RegionId = u64;

/// READs longer than this pass through uncached (and bound the search for an entry
/// holding a READ's bytes).
pub const CACHED_READ_BYTES_MAX: u64 = 4096;
/// What an entry costs beyond its bytes, as the budget counts it.
pub const ENTRY_OVERHEAD_BYTES: u64 = 128;
/// Most generation slots; each costs 8 bytes of the budget.
pub const SLOTS_MAX: usize = 4096;
/// Fewest generation slots a cache is made with.
pub const SLOTS_MIN: usize = 16;
/// The smallest budget a cache is made with: the smallest table and room for an entry.
pub const CACHE_BYTES_MIN: u64 = (SLOTS_MIN * 8) as u64 * 4;
/// Bytes one generation slot covers.
const SLOT_SPAN_BYTES: u64 = 256;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub fills: u64,
    pub fills_refused: u64,
    pub evictions: u64,
}

/// What a READ noted when it left: the generations its answer must still match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FillTicket {
    region: RegionId,
    offset: u64,
    gens: Vec<(usize, u64)>,
}

#[derive(Debug)]
struct Entry {
    data: Vec<u8>,
    stamp: u64,
    /// The newest lane mutation patched into it (see [`ReadCache::deciding`]); 0 while
    /// it holds only what the server answered.
    by: u64,
}

#[derive(Debug)]
pub struct ReadCache {
    map: BTreeMap<(RegionId, u64), Entry>,
    order: VecDeque<((RegionId, u64), u64)>,
    gens: Vec<u64>,
    bytes: u64,
    bytes_max: u64,
    next_stamp: u64,
    /// The number the mutation decided next will carry.
    deciding: u64,
    pub stats: CacheStats,
}

fn slot(region: RegionId, span: u64, slots: usize) -> usize {
    let h = (region ^ span.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (h >> 40) as usize % slots
}

/// The slot table for a budget: the largest power of two of at most [`SLOTS_MAX`] slots
/// whose bytes fit a quarter of it.
fn slots_for(bytes_max: u64) -> usize {
    let fit = usize::try_from(bytes_max / 4 / 8).unwrap_or(usize::MAX);
    let mut slots = SLOTS_MIN;
    while slots * 2 <= fit.min(SLOTS_MAX) {
        slots *= 2;
    }
    slots
}

fn spans(offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
    let last = offset.saturating_add(len.max(1) - 1);
    (offset / SLOT_SPAN_BYTES)..=(last / SLOT_SPAN_BYTES)
}

impl ReadCache {
    /// `None` below [`CACHE_BYTES_MIN`].
    pub fn new(bytes_max: u64) -> Option<ReadCache> {
        let slots = slots_for(bytes_max);
        let table = (slots * 8) as u64;
        (bytes_max >= CACHE_BYTES_MIN).then(|| ReadCache {
            map: BTreeMap::new(),
            order: VecDeque::new(),
            gens: vec![0; slots],
            bytes: table,
            bytes_max,
            next_stamp: 1,
            deciding: 0,
            stats: CacheStats::default(),
        })
    }

    /// Bytes held, as the budget counts them.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The number of the mutation the next decisions send (see `Words::deciding`).
    pub fn deciding(&mut self, number: u64) {
        self.deciding = number;
    }

    /// A READ's bytes if an entry holds them all.
    #[cfg(test)]
    pub fn get(&mut self, region: RegionId, offset: u64, len: u32) -> Option<Bytes> {
        self.get_taught(region, offset, len).map(|(b, _)| b)
    }

    /// [`ReadCache::get`], with the newest mutation patched into what it answers: the
    /// answer waits for it to be applied (0: nothing to wait for).
    pub fn get_taught(&mut self, region: RegionId, offset: u64, len: u32) -> Option<(Bytes, u64)> {
        let len = u64::from(len);
        if len > CACHED_READ_BYTES_MAX {
            return None;
        }
        let from = offset.saturating_sub(CACHED_READ_BYTES_MAX);
        let found = self
            .map
            .range((region, from)..=(region, offset))
            .rev()
            .find(|(&(_, o), e)| o + e.data.len() as u64 >= offset + len)
            .map(|(&(_, o), e)| {
                let at = (offset - o) as usize;
                (Bytes::copy_from_slice(&e.data[at..at + len as usize]), e.by)
            });
        match found {
            Some(b) => {
                self.stats.hits += 1;
                Some(b)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Notes a READ leaving (one that missed), if its answer may be cached.
    pub fn ticket(&self, region: RegionId, offset: u64, len: u32) -> Option<FillTicket> {
        let len = u64::from(len);
        if len == 0 || len > CACHED_READ_BYTES_MAX || offset.checked_add(len).is_none() {
            return None;
        }
        let gens = spans(offset, len)
            .map(|s| {
                let i = slot(region, s, self.gens.len());
                (i, self.gens[i])
            })
            .collect();
        Some(FillTicket {
            region,
            offset,
            gens,
        })
    }

    /// A READ's answer: kept if nothing touched its bytes since it left.
    pub fn fill(&mut self, ticket: FillTicket, data: &[u8]) {
        if ticket.gens.iter().any(|&(i, g)| self.gens[i] != g) {
            self.stats.fills_refused += 1;
            return;
        }
        let cost = data.len() as u64 + ENTRY_OVERHEAD_BYTES;
        if cost > self.bytes_max.saturating_sub(self.table_bytes()) {
            return;
        }
        let key = (ticket.region, ticket.offset);
        if let Some(old) = self.map.remove(&key) {
            self.bytes -= old.data.len() as u64 + ENTRY_OVERHEAD_BYTES;
        }
        while self.bytes + cost > self.bytes_max {
            if !self.evict_oldest() {
                return;
            }
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.map.insert(
            key,
            Entry {
                data: data.to_vec(),
                stamp,
                by: 0,
            },
        );
        self.bytes += cost;
        self.order.push_back((key, stamp));
        if self.order.len() > 2 * self.map.len() + 16 {
            let map = &self.map;
            self.order
                .retain(|(k, s)| map.get(k).is_some_and(|e| e.stamp == *s));
        }
        self.stats.fills += 1;
    }

    fn evict_oldest(&mut self) -> bool {
        while let Some((key, stamp)) = self.order.pop_front() {
            if self.map.get(&key).is_some_and(|e| e.stamp == stamp) {
                self.remove(key);
                self.stats.evictions += 1;
                return true;
            }
        }
        false
    }

    fn remove(&mut self, key: (RegionId, u64)) {
        if let Some(e) = self.map.remove(&key) {
            self.bytes -= e.data.len() as u64 + ENTRY_OVERHEAD_BYTES;
        }
    }

    fn table_bytes(&self) -> u64 {
        (self.gens.len() * 8) as u64
    }

    fn bump(&mut self, region: RegionId, offset: u64, len: u64) {
        for s in spans(offset, len) {
            let i = slot(region, s, self.gens.len());
            self.gens[i] = self.gens[i].wrapping_add(1);
        }
    }

    /// Entries overlapping `[offset, offset + len)`.
    fn overlapping(&self, region: RegionId, offset: u64, len: u64) -> Vec<u64> {
        let end = offset.saturating_add(len);
        let from = offset.saturating_sub(CACHED_READ_BYTES_MAX);
        self.map
            .range((region, from)..(region, end))
            .filter(|(&(_, o), e)| o + e.data.len() as u64 > offset)
            .map(|(&(_, o), _)| o)
            .collect()
    }

    /// A WRITE decided: its bytes go into every entry they overlap.
    pub fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) {
        let len = data.len() as u64;
        if offset.checked_add(len).is_none() {
            self.forget(region, offset, len);
            return;
        }
        self.bump(region, offset, len);
        for o in self.overlapping(region, offset, len) {
            if let Some(e) = self.map.get_mut(&(region, o)) {
                let e_end = o + e.data.len() as u64;
                let from = offset.max(o);
                let to = (offset + len).min(e_end);
                let dst = (from - o) as usize..(to - o) as usize;
                let src = (from - offset) as usize..(to - offset) as usize;
                e.data[dst].copy_from_slice(&data[src]);
                e.by = e.by.max(self.deciding);
            }
        }
    }

    /// Anything whose effect on these bytes is unknown here.
    pub fn forget(&mut self, region: RegionId, offset: u64, len: u64) {
        self.bump(region, offset, len);
        for o in self.overlapping(region, offset, len) {
            self.remove((region, o));
        }
    }

    /// FREE: the whole region, and every READ of it in flight.
    pub fn forget_region(&mut self, region: RegionId) {
        let keys: Vec<u64> = self
            .map
            .range((region, 0)..=(region, u64::MAX))
            .map(|(&(_, o), _)| o)
            .collect();
        for o in keys {
            self.remove((region, o));
        }
        // Every slot: a region's spans hash anywhere.
        for g in &mut self.gens {
            *g = g.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_answer_names_the_newest_mutation_patched_into_it() {
        let mut c = ReadCache::new(1 << 20).unwrap();
        let t = c.ticket(1, 0, 64).unwrap();
        c.fill(t, &[1; 64]);
        assert_eq!(c.get_taught(1, 0, 8).map(|(_, by)| by), Some(0));
        c.deciding(3);
        c.write(1, 8, &[2; 8]);
        c.deciding(4);
        c.write(1, 40, &[3; 8]);
        let (bytes, by) = c.get_taught(1, 0, 64).unwrap();
        assert_eq!(
            (&bytes[8..10], &bytes[40..42], by),
            (&[2, 2][..], &[3, 3][..], 4)
        );
        // Refilled from the server after a forget: nothing to wait for.
        c.forget(1, 0, 64);
        let t = c.ticket(1, 0, 64).unwrap();
        c.fill(t, &[5; 64]);
        assert_eq!(c.get_taught(1, 0, 8).map(|(_, by)| by), Some(0));
    }

    #[test]
    fn hits_inside_an_entry_and_writes_patch_it() {
        let mut c = ReadCache::new(1 << 20).unwrap();
        assert_eq!(c.get(1, 0, 8), None);
        let t = c.ticket(1, 0, 40).unwrap();
        c.fill(t, &[7; 40]);
        assert_eq!(c.get(1, 8, 8).as_deref(), Some(&[7u8; 8][..]));
        c.write(1, 4, &[9; 8]);
        let got = c.get(1, 0, 16).unwrap();
        assert_eq!(&got[..], &[7, 7, 7, 7, 9, 9, 9, 9, 9, 9, 9, 9, 7, 7, 7, 7]);
        c.forget(1, 32, 8);
        assert_eq!(c.get(1, 0, 8), None);
    }

    #[test]
    fn a_fill_overtaken_by_a_change_is_refused() {
        let mut c = ReadCache::new(1 << 20).unwrap();
        let t = c.ticket(1, 0, 40).unwrap();
        c.write(1, 16, &[1; 8]);
        c.fill(t, &[0; 40]);
        assert_eq!(c.get(1, 0, 8), None);
        assert_eq!(c.stats.fills_refused, 1);
    }

    #[test]
    fn the_budget_holds() {
        let max = (SLOTS_MAX * 8) as u64 + 10 * (40 + ENTRY_OVERHEAD_BYTES);
        let mut c = ReadCache::new(max).unwrap();
        for i in 0..1_000u64 {
            let t = c.ticket(i % 7, i * 64, 40).unwrap();
            c.fill(t, &[1; 40]);
            assert!(c.bytes() <= max);
        }
        assert!(c.stats.evictions > 0);
        assert!(ReadCache::new(CACHE_BYTES_MIN - 1).is_none());
        // A few KiB: a small table, and entries still fit.
        let mut small = ReadCache::new(4 << 10).unwrap();
        assert!(small.table_bytes() <= 1 << 10);
        for i in 0..100u64 {
            let t = small.ticket(1, i * 64, 40).unwrap();
            small.fill(t, &[1; 40]);
            assert!(small.bytes() <= 4 << 10);
        }
        assert!(small.stats.fills > 0 && small.get(1, 99 * 64, 8).is_some());
        assert_eq!(slots_for(1 << 30), SLOTS_MAX);
        assert_eq!(slots_for(CACHE_BYTES_MIN), SLOTS_MIN);
    }

    #[derive(Debug, Clone)]
    enum Act {
        Read(u8, u8, bool),
        Write(u8, u8, u8),
        Forget(u8),
        Answer,
    }

    proptest! {
        /// Against a memory applying requests in decided order, with READ answers arriving
        /// late and in order: every hit equals the memory's bytes at that point.
        #[test]
        fn hits_always_match_the_memory(
            acts in prop::collection::vec(prop_oneof![
                (0u8..60, 1u8..40, any::<bool>()).prop_map(|(o, l, b)| Act::Read(o, l, b)),
                (0u8..60, 1u8..20, any::<u8>()).prop_map(|(o, l, v)| Act::Write(o, l, v)),
                (0u8..60).prop_map(Act::Forget),
                Just(Act::Answer),
            ], 0..200),
            // From the floor up: small budgets mean small tables and many collisions.
            budget in CACHE_BYTES_MIN..40_000,
        ) {
            let mut c = ReadCache::new(budget).unwrap();
            let mut mem = [0u8; 128];
            let mut in_flight: VecDeque<(FillTicket, Vec<u8>)> = VecDeque::new();
            for act in acts {
                match act {
                    Act::Read(o, l, late) => {
                        let (o, l) = (usize::from(o), usize::from(l));
                        match c.get(1, o as u64, l as u32) {
                            Some(b) => prop_assert_eq!(&b[..], &mem[o..o + l]),
                            None => {
                                let t = c.ticket(1, o as u64, l as u32).unwrap();
                                // The server answers with the memory as of now.
                                in_flight.push_back((t, mem[o..o + l].to_vec()));
                                if !late {
                                    for (t, d) in in_flight.drain(..) {
                                        c.fill(t, &d);
                                    }
                                }
                            }
                        }
                    }
                    Act::Write(o, l, v) => {
                        let (o, l) = (usize::from(o), usize::from(l));
                        let data = vec![v; l];
                        c.write(1, o as u64, &data);
                        mem[o..o + l].copy_from_slice(&data);
                    }
                    Act::Forget(o) => {
                        let o = usize::from(o);
                        c.forget(1, o as u64, 8);
                        mem[o] = mem[o].wrapping_add(1);
                    }
                    Act::Answer => {
                        if let Some((t, d)) = in_flight.pop_front() {
                            c.fill(t, &d);
                        }
                    }
                }
            }
        }
    }
}
