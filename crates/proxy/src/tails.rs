//! What the proxy knows of Clover's chains: where each node it saw written is and which
//! version of which key it holds, and each key's newest tail it saw linked. Pure.
//!
//! A Clover node's first WRITE is the whole fresh node: its next word is the tail
//! marker of its own (key, version) and its header carries its own address word, a
//! 64-bit self-consistency no other data has by chance. A relink rewrites the first 24
//! bytes (marker, key, version). A won CAS from a node's marker to another node's
//! address word links that node as the next version: the key's tail, when it is newer
//! than the one known. Every decision here is made in the order the proxy decided the
//! requests (see `words`), and the server's answers stay the arbiter:
//!
//! - **Write cache** (`--write-cache`, [`ChainCache::redirect_cas`]): a writer's CAS aimed
//!   at a tail older than the known one is re-aimed by the proxy: it rewrites the
//!   writer's node header as the version after the known tail and CASes that tail. Only
//!   a CAS the server (or CAS→WRITE) says won is answered as a success, with a
//!   `relinked_word`. Only relinkable nodes (unconditional writes) are re-aimed.
//! - **Read cache** (`--read-cache`, [`ChainCache::redirect_read`]): a READ of a node of
//!   a key whose newer tail is known is sent to that tail instead, so the reader skips the
//!   walk. The answer is checked ([`ChainCache::redirected_answer`]): it must hold the
//!   tail's key, version and own address word, which proves it is still that linked
//!   version (a reused node holds another key or a higher version: a key's versions only
//!   grow). Only then is it returned, marked `FLAG_REDIRECTED`, which no node in memory
//!   carries and which a reader accepts only for its own key at a newer version.
//!
//! What the proxy cannot vouch for passes through unchanged: nodes or tails it never
//! saw, CASes aimed at nodes it does not know, keys whose tail it knows no newer than the
//! request, versions too large for the 32 bits a marker keeps. Key ids carry the store's
//! random salt (see `camelot_clover::meta`), and every match is on the full key id, so
//! two stores behind one proxy do not mistake each other's nodes.
//!
//! Bounded by a byte budget (`--memory`): nodes are forgotten oldest first; tails, worth
//! more, are kept within half the budget by starting over.

use camelot_clover::layout::{
    decode_linkable_write, node_header_fields, tail_marker, FLAG_REDIRECTED, FLAG_RELINKABLE,
    HEADER_BYTES, RELINK_HEADER_BYTES,
};
use std::collections::{BTreeMap, HashMap, VecDeque};

pub type RegionId = u64;

/// What a node entry costs as the budget counts it (the location map, the address-word
/// map and the eviction queue).
pub const NODE_ENTRY_BYTES: u64 = 128;
/// What a tail entry costs.
pub const TAIL_ENTRY_BYTES: u64 = 80;
/// Versions past this are never vouched for: a tail marker keeps only the low 32 bits of
/// a sequence number.
const SEQ_VOUCHED_MAX: u64 = 1 << 31;

/// A node the proxy saw written: which version of which key it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Known {
    pub key_id: u64,
    pub seq: u64,
    pub self_word: u64,
    /// Written by an unconditional writer: may be linked after any tail.
    pub relinkable: bool,
    stamp: u64,
}

/// A key's newest tail the proxy saw linked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tail {
    pub region: RegionId,
    /// The node's start, which is its next word.
    pub offset: u64,
    pub key_id: u64,
    pub seq: u64,
    pub self_word: u64,
}

/// Re-aim a CAS: rewrite the node at (`node_region`, `node_offset`) as version
/// `tail.seq + 1`, then CAS `tail`'s next word from [`Redirect::expected`] to `node_word`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redirect {
    pub node_region: RegionId,
    pub node_offset: u64,
    pub key_id: u64,
    pub node_word: u64,
    pub tail: Tail,
}

impl Redirect {
    pub fn expected(&self) -> u64 {
        tail_marker(self.tail.key_id, self.tail.seq)
    }
    pub fn seq(&self) -> u64 {
        self.tail.seq + 1
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TailStats {
    /// Re-aimed CASes that won: a writer's retry saved each.
    pub redirected: u64,
    /// Re-aimed CASes that lost (the tail had moved on again).
    pub redirect_lost: u64,
    /// CASes aimed at the tail the proxy knew (nothing to do).
    pub current: u64,
    /// READs sent to the newer tail, answered as it.
    pub reads_redirected: u64,
    /// READs sent to a tail that turned out reused (the READ was then sent as it came).
    pub reads_redirect_stale: u64,
    pub tails_learned: u64,
    pub nodes_learned: u64,
    pub nodes_evicted: u64,
    pub resets: u64,
}

#[derive(Debug)]
pub struct ChainCache {
    locs: BTreeMap<(RegionId, u64), Known>,
    /// Address word → location, for the nodes in `locs`.
    by_word: HashMap<u64, (RegionId, u64)>,
    /// Locations in insertion order; entries replaced since are skipped by stamp.
    order: VecDeque<((RegionId, u64), u64)>,
    tails: HashMap<u64, Tail>,
    nodes_max: usize,
    tails_max: usize,
    next_stamp: u64,
    pub stats: TailStats,
}

impl ChainCache {
    /// A cache of at most `bytes_max` as the entry costs count it; `None` if that is not
    /// room for two nodes and a tail.
    pub fn new(bytes_max: u64) -> Option<ChainCache> {
        let tails_max = usize::try_from(bytes_max / 2 / TAIL_ENTRY_BYTES).unwrap_or(usize::MAX);
        let nodes_max = usize::try_from(
            bytes_max.saturating_sub(tails_max as u64 * TAIL_ENTRY_BYTES) / NODE_ENTRY_BYTES,
        )
        .unwrap_or(usize::MAX);
        (nodes_max >= 2 && tails_max >= 1).then(|| ChainCache {
            locs: BTreeMap::new(),
            by_word: HashMap::new(),
            order: VecDeque::new(),
            tails: HashMap::new(),
            nodes_max,
            tails_max,
            next_stamp: 1,
            stats: TailStats::default(),
        })
    }

    pub fn bytes(&self) -> u64 {
        self.locs.len() as u64 * NODE_ENTRY_BYTES + self.tails.len() as u64 * TAIL_ENTRY_BYTES
    }

    pub fn tails(&self) -> usize {
        self.tails.len()
    }

    pub fn nodes(&self) -> usize {
        self.locs.len()
    }

    fn remove_loc(&mut self, at: (RegionId, u64)) {
        if let Some(k) = self.locs.remove(&at) {
            if self.by_word.get(&k.self_word) == Some(&at) {
                self.by_word.remove(&k.self_word);
            }
        }
    }

    fn insert_loc(&mut self, at: (RegionId, u64), known: Known) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let known = Known { stamp, ..known };
        if let Some(old) = self.locs.insert(at, known) {
            if old.self_word != known.self_word && self.by_word.get(&old.self_word) == Some(&at) {
                self.by_word.remove(&old.self_word);
            }
        }
        // A word's newest writer wins; an older location keeps its entry but is no
        // longer found by word (its node was written elsewhere since).
        self.by_word.insert(known.self_word, at);
        self.order.push_back((at, stamp));
        while self.locs.len() > self.nodes_max {
            let Some((old, s)) = self.order.pop_front() else {
                break;
            };
            if self.locs.get(&old).is_some_and(|k| k.stamp == s) {
                self.remove_loc(old);
                self.stats.nodes_evicted += 1;
            }
        }
        if self.order.len() > 2 * self.locs.len() + 16 {
            let locs = &self.locs;
            self.order
                .retain(|(k, s)| locs.get(k).is_some_and(|e| e.stamp == *s));
        }
    }

    /// Known nodes whose header `[offset, offset + HEADER_BYTES)` overlaps the range.
    fn overlapping(&self, region: RegionId, offset: u64, len: u64) -> Vec<(RegionId, u64)> {
        let end = offset.saturating_add(len);
        let from = offset.saturating_sub(u64::from(HEADER_BYTES) - 1);
        self.locs
            .range((region, from)..(region, end))
            .map(|(&at, _)| at)
            .collect()
    }

    /// A WRITE decided (in order with the requests around it).
    pub fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) {
        let at = (region, offset);
        if let Some(n) = decode_linkable_write(data).filter(|n| n.seq < SEQ_VOUCHED_MAX) {
            // A whole fresh node: its key, version and own address.
            for o in self.overlapping(region, offset, data.len() as u64) {
                if o != at {
                    self.remove_loc(o);
                }
            }
            self.stats.nodes_learned += 1;
            self.insert_loc(
                at,
                Known {
                    key_id: n.key_id,
                    seq: n.seq,
                    self_word: n.self_word,
                    relinkable: n.flags & FLAG_RELINKABLE != 0,
                    stamp: 0,
                },
            );
            return;
        }
        if data.len() == RELINK_HEADER_BYTES {
            // A writer's relink of its own node: same node, a later version.
            let (next, key_id, seq) = node_header_fields(data);
            if let Some(k) = self.locs.get_mut(&at) {
                if k.key_id == key_id && next == tail_marker(key_id, seq) && seq < SEQ_VOUCHED_MAX {
                    k.seq = seq;
                    return;
                }
            }
        }
        // Anything else over a known header: that node is no longer known.
        self.forget(region, offset, data.len() as u64);
    }

    /// Bytes changed in a way not known here (FETCH_ADD, SWAP, XOR_INTO, WRITE_IF, a
    /// CAS that is not a next word's).
    pub fn forget(&mut self, region: RegionId, offset: u64, len: u64) {
        for o in self.overlapping(region, offset, len) {
            self.remove_loc(o);
        }
    }

    /// A CAS decided on the word at (`region`, `offset`): a known node's next word only
    /// changes its link; any other word over a known header makes that node unknown.
    pub fn cas_seen(&mut self, region: RegionId, offset: u64) {
        if !self.locs.contains_key(&(region, offset)) {
            self.forget(region, offset, 8);
        }
    }

    /// The known node at a node start whose next word a CAS expecting `expected` aims at.
    fn aimed(&self, region: RegionId, offset: u64, expected: u64) -> Option<Known> {
        self.locs
            .get(&(region, offset))
            .copied()
            .filter(|t| tail_marker(t.key_id, t.seq) == expected)
    }

    /// The known node whose address word is `word`, at its location.
    fn by_word(&self, word: u64) -> Option<((RegionId, u64), Known)> {
        let at = *self.by_word.get(&word)?;
        let k = *self.locs.get(&at)?;
        (k.self_word == word).then_some((at, k))
    }

    /// A CAS of the next word at (`region`, `offset`) from `expected` to `new` won: if it
    /// linked a known node of the same key as the next version, that node is its key's
    /// tail (unless a newer one is known).
    pub fn cas_won(&mut self, region: RegionId, offset: u64, expected: u64, new: u64) {
        let Some(t) = self.aimed(region, offset, expected) else {
            return;
        };
        let Some(((nr, no), n)) = self.by_word(new) else {
            return;
        };
        if n.key_id != t.key_id || n.seq != t.seq + 1 {
            return;
        }
        if self.tails.get(&n.key_id).is_some_and(|x| x.seq >= n.seq) {
            return;
        }
        if !self.tails.contains_key(&n.key_id) && self.tails.len() >= self.tails_max {
            self.stats.resets += 1;
            self.tails.clear();
        }
        self.stats.tails_learned += 1;
        self.tails.insert(
            n.key_id,
            Tail {
                region: nr,
                offset: no,
                key_id: n.key_id,
                seq: n.seq,
                self_word: new,
            },
        );
    }

    /// What to do with a CAS of the word at (`region`, `offset`) from `expected` to
    /// `new`: `Some` when it links a relinkable node of the aimed node's key after a
    /// version older than the known tail.
    pub fn redirect_cas(
        &mut self,
        region: RegionId,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> Option<Redirect> {
        let t = self.aimed(region, offset, expected)?;
        let ((nr, no), n) = self.by_word(new)?;
        if !n.relinkable || n.key_id != t.key_id {
            return None;
        }
        let tail = *self.tails.get(&t.key_id)?;
        if tail.self_word == new {
            return None;
        }
        if tail.seq <= t.seq || (tail.region, tail.offset) == (region, offset) {
            self.stats.current += 1;
            return None;
        }
        Some(Redirect {
            node_region: nr,
            node_offset: no,
            key_id: t.key_id,
            node_word: new,
            tail,
        })
    }

    /// A READ of at least a header at a known node of a key whose known tail is newer:
    /// the tail to read instead.
    pub fn redirect_read(&self, region: RegionId, offset: u64, len: u32) -> Option<Tail> {
        if len < HEADER_BYTES {
            return None;
        }
        let k = self.locs.get(&(region, offset))?;
        let tail = *self.tails.get(&k.key_id)?;
        (tail.seq > k.seq && (tail.region, tail.offset) != (region, offset)).then_some(tail)
    }

    /// The answer of a READ sent to `tail`: `Some` (the bytes marked redirected) if they
    /// are still that linked version; otherwise the tail is forgotten and `None`.
    pub fn redirected_answer(&mut self, tail: &Tail, data: &[u8]) -> Option<Vec<u8>> {
        let still = data.len() >= HEADER_BYTES as usize && {
            let (_, key_id, seq) = node_header_fields(data);
            key_id == tail.key_id
                && seq == tail.seq
                && u64::from_le_bytes(data[32..40].try_into().unwrap_or_default()) == tail.self_word
        };
        if !still {
            self.stats.reads_redirect_stale += 1;
            if self.tails.get(&tail.key_id) == Some(tail) {
                self.tails.remove(&tail.key_id);
            }
            return None;
        }
        self.stats.reads_redirected += 1;
        let mut out = data.to_vec();
        let flags = u32::from_le_bytes(out[28..32].try_into().unwrap_or_default());
        out[28..32].copy_from_slice(&(flags | FLAG_REDIRECTED).to_le_bytes());
        Some(out)
    }

    pub fn forget_region(&mut self, region: RegionId) {
        let at: Vec<(RegionId, u64)> = self
            .locs
            .range((region, 0)..=(region, u64::MAX))
            .map(|(&a, _)| a)
            .collect();
        for a in at {
            self.remove_loc(a);
        }
        self.tails.retain(|_, t| t.region != region);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_clover::layout::{encode_node, encode_relink, Geometry, NodeAddr};
    use proptest::prelude::*;

    const KEY: u64 = 0x1234_5678 << 32 | 5;

    fn node(slot: u32) -> NodeAddr {
        NodeAddr { block: 0, slot }
    }

    fn off(g: &Geometry, slot: u32) -> u64 {
        g.offset(node(slot)).unwrap()
    }

    fn write(c: &mut ChainCache, g: &Geometry, slot: u32, key: u64, seq: u64, relinkable: bool) {
        let data = encode_node(g, node(slot), key, seq, Some(b"v"), relinkable).unwrap();
        c.write(7, off(g, slot), &data);
    }

    fn link(c: &mut ChainCache, g: &Geometry, from: u32, key: u64, seq: u64, to: u32) {
        c.cas_won(7, off(g, from), tail_marker(key, seq), node(to).encode());
    }

    #[test]
    fn a_cas_aimed_at_an_old_tail_is_re_aimed_at_the_new_one() {
        let g = Geometry::new(8, 16).unwrap();
        let mut c = ChainCache::new(1 << 20).unwrap();
        // The head (slot 0, version 0); writer A links slot 1 after it.
        write(&mut c, &g, 0, KEY, 0, false);
        write(&mut c, &g, 1, KEY, 1, true);
        link(&mut c, &g, 0, KEY, 0, 1);
        assert_eq!(c.tails[&KEY].seq, 1);
        // Writer B walked to the head too and wrote slot 2 as version 1.
        write(&mut c, &g, 2, KEY, 1, true);
        // Rewritten by a conditional writer (slot reused): never re-aimed.
        write(&mut c, &g, 2, KEY, 1, false);
        assert_eq!(
            c.redirect_cas(7, 0, tail_marker(KEY, 0), node(2).encode()),
            None
        );
        write(&mut c, &g, 2, KEY, 1, true);
        let r = c
            .redirect_cas(7, 0, tail_marker(KEY, 0), node(2).encode())
            .unwrap();
        assert_eq!(r.tail.offset, off(&g, 1));
        assert_eq!((r.seq(), r.expected()), (2, tail_marker(KEY, 1)));
        assert_eq!(r.node_offset, off(&g, 2));
        // Aimed at the known tail: nothing to do.
        assert_eq!(
            c.redirect_cas(7, r.tail.offset, tail_marker(KEY, 1), node(2).encode()),
            None
        );
        // The proxy's relink, then its CAS won: slot 2 is version 2, the tail.
        c.write(7, off(&g, 2), &encode_relink(KEY, 2));
        c.cas_won(7, r.tail.offset, r.expected(), r.node_word);
        assert_eq!(c.tails[&KEY].seq, 2);
        // An older win reported late never moves the tail back.
        link(&mut c, &g, 0, KEY, 0, 1);
        assert_eq!(c.tails[&KEY].seq, 2);
    }

    #[test]
    fn what_the_proxy_cannot_vouch_for_passes() {
        let g = Geometry::new(8, 16).unwrap();
        let mut c = ChainCache::new(1 << 20).unwrap();
        write(&mut c, &g, 0, KEY, 0, false);
        write(&mut c, &g, 1, KEY, 1, true);
        link(&mut c, &g, 0, KEY, 0, 1);
        // A node never seen written.
        assert_eq!(
            c.redirect_cas(7, 0, tail_marker(KEY, 0), node(3).encode()),
            None
        );
        // Another store's key with the same low bits (another salt): never matched.
        let other = 0x0bad_0000 << 32 | 5;
        write(&mut c, &g, 4, other, 1, true);
        assert_eq!(
            c.redirect_cas(7, 0, tail_marker(KEY, 0), node(4).encode()),
            None
        );
        link(&mut c, &g, 0, KEY, 0, 4);
        assert_eq!(c.tails[&KEY].self_word, node(1).encode());
        // Aimed at a node the proxy does not know.
        write(&mut c, &g, 5, KEY, 1, true);
        assert_eq!(
            c.redirect_cas(7, off(&g, 9), tail_marker(KEY, 0), node(5).encode()),
            None
        );
        // Not a marker at all (a plain word CAS).
        assert_eq!(c.redirect_cas(7, 0, 0, node(5).encode()), None);
        // A FETCH_ADD over the head's key field: the head is no longer known.
        c.forget(7, 8, 8);
        assert_eq!(
            c.redirect_cas(7, 0, tail_marker(KEY, 0), node(5).encode()),
            None
        );
    }

    #[test]
    fn a_read_goes_to_the_tail_and_a_reused_tail_is_caught() {
        let g = Geometry::new(8, 16).unwrap();
        let mut c = ChainCache::new(1 << 20).unwrap();
        write(&mut c, &g, 0, KEY, 0, false);
        write(&mut c, &g, 1, KEY, 1, true);
        link(&mut c, &g, 0, KEY, 0, 1);
        let len = g.node_bytes();
        assert_eq!(
            c.redirect_read(7, off(&g, 1), len),
            None,
            "already the tail"
        );
        assert_eq!(c.redirect_read(7, 0, 8), None, "shorter than a header");
        let tail = c.redirect_read(7, 0, len).unwrap();
        assert_eq!((tail.offset, tail.seq), (off(&g, 1), 1));
        // The tail as the server holds it: answered, marked.
        let mut bytes = encode_node(&g, node(1), KEY, 1, Some(b"v"), true)
            .unwrap()
            .to_vec();
        bytes.resize(len as usize, 0);
        let out = c.redirected_answer(&tail, &bytes).unwrap();
        let flags = u32::from_le_bytes(out[28..32].try_into().unwrap());
        assert_ne!(flags & FLAG_REDIRECTED, 0);
        assert_eq!(&out[..28], &bytes[..28]);
        // Reused since for another version: refused, and the tail forgotten.
        let reused = encode_node(&g, node(1), KEY, 9, Some(b"w"), true).unwrap();
        assert_eq!(c.redirected_answer(&tail, &reused), None);
        assert_eq!(c.redirect_read(7, 0, len), None);
    }

    proptest! {
        /// Whatever is fed in, the budget holds, a re-aim always targets a tail newer than
        /// the CAS expected for the node's own key, and a READ is only ever sent to a
        /// newer version of the same key.
        #[test]
        fn bounded_and_only_ever_forward(ops in prop::collection::vec(
            (0u32..40, 0u64..4, 0u64..20, any::<bool>(), 0u8..5, 0u32..40), 1..300)) {
            let g = Geometry::new(8, 64).unwrap();
            let budget = NODE_ENTRY_BYTES * 10 + TAIL_ENTRY_BYTES * 3;
            let mut c = ChainCache::new(budget).unwrap();
            for (slot, key, seq, relinkable, kind, other) in ops {
                let key = 0x77 << 32 | key;
                match kind {
                    0 => write(&mut c, &g, slot, key, seq, relinkable),
                    1 => link(&mut c, &g, other, key, seq, slot),
                    2 => c.forget(7, off(&g, slot), 8),
                    3 => {
                        if let Some(t) = c.redirect_read(7, off(&g, slot), g.node_bytes()) {
                            let k = c.locs[&(7, off(&g, slot))];
                            prop_assert_eq!(t.key_id, k.key_id);
                            prop_assert!(t.seq > k.seq);
                        }
                    }
                    _ => {
                        if let Some(r) = c.redirect_cas(7, off(&g, other), tail_marker(key, seq), node(slot).encode()) {
                            prop_assert!(r.tail.seq > seq);
                            prop_assert_eq!(r.tail.key_id, key);
                            prop_assert_eq!(r.key_id, key);
                        }
                    }
                }
                prop_assert!(c.bytes() <= budget);
                prop_assert!(c.order.len() <= 2 * c.locs.len() + 17);
            }
        }
    }
}
