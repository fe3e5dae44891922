//! What the proxy knows about 8-byte words, for turning a CAS into a WRITE. Pure.
//!
//! The proxy may vouch for a word's value only because every request to its region
//! leaves on one upstream connection, in the order the proxy decided it, and every
//! decision that changes what the proxy knows is made and queued under one lock: the
//! value recorded here is then the value the server will hold when it reaches the next
//! request for that word. Requests are linearized in that queue order; a CAS whose
//! expected value matches becomes a WRITE (and succeeds), a CAS whose expected value
//! does not match is answered at once with the known value (it would have failed).
//!
//! The table is bounded by a byte budget (`--memory`): past it an entry is forgotten,
//! which only means the next CAS on that word passes through. Eviction is second chance
//! (CLOCK): an entry set again since it last came to the queue's front goes round once
//! more, so a word in use stays while updating it costs no queue slot.

use std::collections::{BTreeMap, VecDeque};

pub type RegionId = u64;

/// What one entry costs, as the budget counts it: the map's key and value, a share of
/// the tree's node, and the eviction queue's slot.
pub const ENTRY_BYTES: u64 = 96;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Word {
    Known(u64),
    /// A CAS passed through; its answer will tell the value if nothing came after it.
    Pending(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    word: Word,
    /// When it was inserted, to match the eviction queue.
    stamp: u64,
    /// Set again since it last came to the queue's front: spared once by eviction.
    referenced: bool,
    /// The number of the lane's mutation that taught it (see [`Words::deciding`]); 0
    /// when it came from the server's answer, so it is applied already.
    by: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasDecision {
    /// Unknown here: send the CAS; report its answer with `cas_answered(ticket, …)`.
    Forward { ticket: u64 },
    /// Known to match: send a WRITE of `new` instead and answer `expected`.
    Convert,
    /// Known not to match: answer `value` once mutation `taught_by` (0: none) is applied.
    Fail { value: u64, taught_by: u64 },
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WordStats {
    pub conversions: u64,
    pub failed_locally: u64,
    pub forwarded: u64,
    pub learned: u64,
    pub evictions: u64,
}

#[derive(Debug)]
pub struct Words {
    map: BTreeMap<(RegionId, u64), Entry>,
    /// Keys in insertion order (or of their second chance); slots of entries removed
    /// since are skipped by stamp.
    order: VecDeque<((RegionId, u64), u64)>,
    entries_max: usize,
    next_stamp: u64,
    /// The number the mutation decided next will carry (see [`Words::deciding`]).
    deciding: u64,
    pub stats: WordStats,
}

impl Words {
    /// A table of at most `bytes_max` as [`ENTRY_BYTES`] counts it.
    pub fn new(bytes_max: u64) -> Words {
        Words {
            map: BTreeMap::new(),
            order: VecDeque::new(),
            entries_max: usize::try_from(bytes_max / ENTRY_BYTES).unwrap_or(usize::MAX),
            next_stamp: 1,
            deciding: 0,
            stats: WordStats::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Bytes the table holds, as the budget counts them (the eviction queue may hold
    /// stale slots too, at most as many again as live entries: see `compact`).
    pub fn bytes(&self) -> u64 {
        self.map.len() as u64 * ENTRY_BYTES
    }

    /// The number of the mutation the next decisions send: what they teach is marked
    /// with it, so an answer given from it can wait for that mutation alone to be
    /// applied. 0 (the default): nothing to wait for.
    pub fn deciding(&mut self, number: u64) {
        self.deciding = number;
    }

    /// The mutation a known word's value waits on (0: applied; see [`Words::deciding`]).
    #[cfg(test)]
    fn taught_by(&self, region: RegionId, offset: u64) -> u64 {
        self.map.get(&(region, offset)).map_or(0, |e| e.by)
    }

    fn put(&mut self, key: (RegionId, u64), word: Word) {
        let by = self.deciding;
        self.put_by(key, word, by);
    }

    fn put_by(&mut self, key: (RegionId, u64), word: Word, by: u64) {
        if self.entries_max == 0 {
            return;
        }
        // Advanced on every put: a forwarded CAS's ticket is the stamp it would get.
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(e) = self.map.get_mut(&key) {
            // Its queue slot stays live (same stamp): no new slot, no compaction.
            e.word = word;
            e.referenced = true;
            e.by = by;
            return;
        }
        self.map.insert(
            key,
            Entry {
                word,
                stamp,
                referenced: false,
                by,
            },
        );
        while self.map.len() > self.entries_max {
            self.evict_one();
        }
        self.order.push_back((key, stamp));
        self.compact();
    }

    /// Removes the entry nearest the queue's front that was not set again since it got
    /// there; those that were go to the back once. Ends: each live slot is spared at
    /// most once per call, and the map is not empty when this is called.
    fn evict_one(&mut self) {
        while let Some((key, stamp)) = self.order.pop_front() {
            let Some(e) = self.map.get_mut(&key) else {
                continue;
            };
            if e.stamp != stamp {
                continue;
            }
            if e.referenced {
                e.referenced = false;
                self.order.push_back((key, stamp));
                continue;
            }
            self.map.remove(&key);
            self.stats.evictions += 1;
            return;
        }
    }

    /// Drops queue slots of replaced or removed entries once they outnumber live ones,
    /// so the queue stays within twice the table.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.map.len() + 16 {
            let map = &self.map;
            self.order
                .retain(|(k, s)| map.get(k).is_some_and(|e| e.stamp == *s));
        }
    }

    fn remove(&mut self, key: (RegionId, u64)) {
        self.map.remove(&key);
    }

    /// A CAS on an aligned word. `convert` off: always forward (but still learn from the
    /// answer).
    pub fn cas(
        &mut self,
        region: RegionId,
        offset: u64,
        expected: u64,
        new: u64,
        convert: bool,
    ) -> CasDecision {
        let key = (region, offset);
        if convert {
            if let Some(Entry {
                word: Word::Known(v),
                by,
                ..
            }) = self.map.get(&key).copied()
            {
                if v == expected {
                    self.stats.conversions += 1;
                    self.put(key, Word::Known(new));
                    return CasDecision::Convert;
                }
                self.stats.failed_locally += 1;
                return CasDecision::Fail {
                    value: v,
                    taught_by: by,
                };
            }
        }
        self.stats.forwarded += 1;
        let ticket = self.next_stamp;
        self.put(key, Word::Pending(ticket));
        CasDecision::Forward { ticket }
    }

    /// A forwarded CAS's answer (the word before it). Learned only if nothing about the
    /// word was decided since.
    pub fn cas_answered(
        &mut self,
        region: RegionId,
        offset: u64,
        ticket: u64,
        expected: u64,
        new: u64,
        before: u64,
    ) {
        let key = (region, offset);
        if let Some(e) = self.map.get_mut(&key) {
            if e.word == Word::Pending(ticket) {
                e.word = Word::Known(if before == expected { new } else { before });
                e.by = 0;
                self.stats.learned += 1;
            }
        }
    }

    /// A forwarded CAS failed: its effect is unknown.
    pub fn cas_failed(&mut self, region: RegionId, offset: u64, ticket: u64) {
        let key = (region, offset);
        if self
            .map
            .get(&key)
            .is_some_and(|e| e.word == Word::Pending(ticket))
        {
            self.remove(key);
        }
    }

    /// A WRITE is being sent: words it covers whole take its bytes; words it covers in
    /// part are forgotten. Its first word, when aligned, is learned even if it was not
    /// known: a chain's new version carries its next word there, which the next writer
    /// will CAS.
    pub fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) {
        let Some(end) = offset.checked_add(data.len() as u64) else {
            return;
        };
        let from = offset.saturating_sub(7);
        let touched: Vec<u64> = self
            .map
            .range((region, from)..(region, end))
            .map(|(&(_, o), _)| o)
            .collect();
        for o in touched {
            match word_at(offset, data, o) {
                Some(v) => self.put((region, o), Word::Known(v)),
                None => self.remove((region, o)),
            }
        }
        if offset.is_multiple_of(8) {
            if let Some(v) = word_at(offset, data, offset) {
                self.put((region, offset), Word::Known(v));
            }
        }
    }

    /// FETCH_ADD and anything else whose effect on these bytes the table does not model.
    pub fn forget(&mut self, region: RegionId, offset: u64, len: u64) {
        let end = offset.saturating_add(len);
        let from = offset.saturating_sub(7);
        let touched: Vec<u64> = self
            .map
            .range((region, from)..(region, end))
            .map(|(&(_, o), _)| o)
            .collect();
        for o in touched {
            self.remove((region, o));
        }
    }

    /// FREE: the whole region.
    pub fn forget_region(&mut self, region: RegionId) {
        let touched: Vec<u64> = self
            .map
            .range((region, 0)..=(region, u64::MAX))
            .map(|(&(_, o), _)| o)
            .collect();
        for o in touched {
            self.remove((region, o));
        }
    }
}

/// The little-endian word at `at` if `data` (written at `offset`) covers all 8 bytes.
fn word_at(offset: u64, data: &[u8], at: u64) -> Option<u64> {
    let start = usize::try_from(at.checked_sub(offset)?).ok()?;
    let bytes = data.get(start..start.checked_add(8)?)?;
    let mut w = [0u8; 8];
    w.copy_from_slice(bytes);
    Some(u64::from_le_bytes(w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn a_known_word_names_the_mutation_that_taught_it() {
        let mut w = Words::new(1 << 20);
        w.deciding(5);
        w.write(1, 0, &7u64.to_le_bytes());
        assert_eq!(w.taught_by(1, 0), 5);
        w.deciding(6);
        assert_eq!(w.cas(1, 0, 7, 8, true), CasDecision::Convert);
        assert_eq!(w.taught_by(1, 0), 6);
        assert_eq!(
            w.cas(1, 0, 7, 9, true),
            CasDecision::Fail {
                value: 8,
                taught_by: 6
            }
        );
        // What the server answered is applied already.
        w.deciding(7);
        let CasDecision::Forward { ticket } = w.cas(1, 64, 1, 2, true) else {
            panic!("an unknown word is forwarded");
        };
        w.cas_answered(1, 64, ticket, 1, 2, 1);
        assert_eq!(w.taught_by(1, 64), 0);
        assert_eq!(w.taught_by(2, 0), 0, "unknown words wait on nothing");
    }

    #[test]
    fn a_written_word_converts_the_next_cas() {
        let mut w = Words::new(1 << 20);
        assert_eq!(w.cas(1, 0, 5, 6, true), CasDecision::Forward { ticket: 1 });
        w.write(1, 64, &7u64.to_le_bytes());
        assert_eq!(w.cas(1, 64, 7, 8, true), CasDecision::Convert);
        assert_eq!(
            w.cas(1, 64, 7, 9, true),
            CasDecision::Fail {
                value: 8,
                taught_by: 0
            }
        );
        // Without conversion nothing is answered here.
        assert!(matches!(
            w.cas(1, 64, 8, 9, false),
            CasDecision::Forward { .. }
        ));
    }

    #[test]
    fn a_forwarded_answer_is_learned_only_if_nothing_came_after() {
        let mut w = Words::new(1 << 20);
        let CasDecision::Forward { ticket } = w.cas(1, 8, 0, 1, true) else {
            panic!()
        };
        w.cas_answered(1, 8, ticket, 0, 1, 0);
        assert_eq!(w.cas(1, 8, 1, 2, true), CasDecision::Convert);
        // A second forward, overtaken by a write before its answer.
        w.forget(1, 8, 8);
        let CasDecision::Forward { ticket } = w.cas(1, 8, 2, 3, true) else {
            panic!()
        };
        w.write(1, 8, &9u64.to_le_bytes());
        w.cas_answered(1, 8, ticket, 2, 3, 2);
        assert_eq!(w.cas(1, 8, 9, 10, true), CasDecision::Convert);
    }

    #[test]
    fn partial_writes_forget_and_free_forgets_the_region() {
        let mut w = Words::new(1 << 20);
        w.write(1, 0, &[0; 16]);
        w.write(1, 8, &[0; 8]);
        w.write(1, 4, &[1; 8]); // covers half of word 0 and half of word 8
        assert!(matches!(
            w.cas(1, 0, 0, 1, true),
            CasDecision::Forward { .. }
        ));
        assert!(matches!(
            w.cas(1, 8, 0, 1, true),
            CasDecision::Forward { .. }
        ));
        w.write(2, 0, &[0; 8]);
        w.forget_region(2);
        assert!(matches!(
            w.cas(2, 0, 0, 1, true),
            CasDecision::Forward { .. }
        ));
    }

    #[test]
    fn the_budget_is_never_exceeded_and_zero_means_no_table() {
        let mut w = Words::new(10 * ENTRY_BYTES);
        for i in 0..1_000u64 {
            w.write(i % 37, (i % 13) * 8, &i.to_le_bytes());
            assert!(w.bytes() <= 10 * ENTRY_BYTES);
            assert!(w.order.len() <= 2 * w.len() + 17);
        }
        assert!(w.stats.evictions > 0);
        let mut none = Words::new(ENTRY_BYTES - 1);
        none.write(1, 0, &[0; 8]);
        assert_eq!(none.len(), 0);
        assert!(matches!(
            none.cas(1, 0, 0, 1, true),
            CasDecision::Forward { .. }
        ));
    }

    #[test]
    fn a_word_set_again_gets_a_second_chance_and_takes_no_queue_slot() {
        let mut w = Words::new(2 * ENTRY_BYTES);
        w.write(1, 0, &1u64.to_le_bytes());
        w.write(1, 8, &2u64.to_le_bytes());
        for v in 0..1_000u64 {
            w.write(1, 0, &v.to_le_bytes());
        }
        assert_eq!(w.order.len(), 2, "updates of a present word queue nothing");
        // A third word evicts word 8, the one not set again, though word 0 is older.
        w.write(1, 16, &3u64.to_le_bytes());
        assert_eq!(w.stats.evictions, 1);
        assert_eq!(w.cas(1, 0, 999, 1_000, true), CasDecision::Convert);
        assert!(matches!(
            w.cas(1, 8, 2, 3, true),
            CasDecision::Forward { .. }
        ));
    }

    #[derive(Debug, Clone)]
    enum Act {
        Write(u8, u8),
        Cas(u8, u8, u8),
        FetchAdd(u8),
    }

    proptest! {
        /// Against a model memory applying each request in the order decided: a converted
        /// or locally failed CAS answers exactly what the CAS would have, whatever the
        /// budget and however answers of forwarded CASes interleave.
        #[test]
        fn decisions_match_a_memory_applying_requests_in_order(
            acts in prop::collection::vec(prop_oneof![
                (0u8..4, 0u8..4).prop_map(|(s, v)| Act::Write(s, v)),
                (0u8..4, 0u8..4, 0u8..4).prop_map(|(s, e, n)| Act::Cas(s, e, n)),
                (0u8..4).prop_map(Act::FetchAdd),
            ], 0..200),
            entries in 0u64..6,
            answer_late in prop::collection::vec(any::<bool>(), 200),
        ) {
            let mut w = Words::new(entries * ENTRY_BYTES);
            let mut mem: HashMap<u64, u64> = HashMap::new();
            let mut late: Vec<(u64, u64, u64, u64, u64)> = Vec::new();
            for (i, act) in acts.into_iter().enumerate() {
                match act {
                    Act::Write(s, v) => {
                        let o = u64::from(s) * 8;
                        w.write(1, o, &u64::from(v).to_le_bytes());
                        mem.insert(o, u64::from(v));
                    }
                    Act::FetchAdd(s) => {
                        let o = u64::from(s) * 8;
                        w.forget(1, o, 8);
                        *mem.entry(o).or_insert(0) += 1;
                    }
                    Act::Cas(s, e, n) => {
                        let (o, e, n) = (u64::from(s) * 8, u64::from(e), u64::from(n));
                        let cur = mem.get(&o).copied().unwrap_or(0);
                        match w.cas(1, o, e, n, true) {
                            CasDecision::Convert => {
                                prop_assert_eq!(cur, e);
                                mem.insert(o, n);
                            }
                            CasDecision::Fail { value: v, .. } => {
                                prop_assert_eq!(v, cur);
                                prop_assert_ne!(cur, e);
                            }
                            CasDecision::Forward { ticket } => {
                                if cur == e {
                                    mem.insert(o, n);
                                }
                                if answer_late[i] {
                                    late.push((o, ticket, e, n, cur));
                                } else {
                                    w.cas_answered(1, o, ticket, e, n, cur);
                                }
                            }
                        }
                    }
                }
                // Late answers arrive in order, at some later point.
                if !answer_late[i] {
                    for (o, t, e, n, before) in late.drain(..) {
                        w.cas_answered(1, o, t, e, n, before);
                    }
                }
            }
        }
    }
}
