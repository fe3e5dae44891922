//! The write cache: per Clover key, the tail a writer must CAS. Pure.
//!
//! A Clover writer walks to its key's tail, writes its new version node, then CASes the
//! tail's next word from the tail's marker to its node. Under contention another writer
//! often links first, the CAS fails, and the writer walks on, rewrites its header and
//! tries again (three more round trips). The proxy sees every node's first WRITE (which
//! says where the node is: Clover writes its own address word into the header) and every
//! CAS that linked one, so it knows the newest tail of each key it carries. When a CAS
//! arrives aimed at a tail older than that, the proxy re-aims it itself: it rewrites the
//! node's header for the version after the real tail and CASes the real tail. The server's
//! CAS stays the arbiter: only a CAS that the server (or CAS→WRITE, which may vouch for
//! the word) says won is answered as a success, with a `relinked_word` naming the version.
//!
//! What the proxy cannot vouch for passes through unchanged: nodes written with a
//! condition (not relinkable), nodes or tails it never saw, keys whose tail it knows no
//! newer than the writer does, sequence numbers too large for the 32 bits a marker keeps.
//! A tail learned here that has since moved on only makes a re-aimed CAS lose; the
//! writer's own CAS then goes to the server as it came (and fails there, as it would
//! have without the proxy).
//!
//! Bounded by a byte budget (`--memory`): when a table is full it starts over, which
//! only means the next CASes pass through.

use camelot_clover::layout::{decode_linkable_write, node_self_word, tail_marker};
use std::collections::HashMap;

pub type RegionId = u64;

/// What one entry costs as the budget counts it (key, value, hash map overhead).
pub const ENTRY_BYTES: u64 = 80;
/// Versions past this are never vouched for: a tail marker keeps only the low 32 bits of
/// a sequence number, and a writer's retries can add at most its retry limit to the
/// version it first wrote.
const SEQ_VOUCHED_MAX: u64 = 1 << 31;
const TAIL_BIT: u64 = 1 << 63;

/// A relinkable node's place, as its first WRITE showed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeLoc {
    pub region: RegionId,
    pub offset: u64,
    pub key_id: u64,
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

/// Re-aim a CAS: rewrite `node`'s header as version `tail.seq + 1`, then CAS `tail`'s
/// next word from [`Redirect::expected`] to `node_word`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redirect {
    pub node: NodeLoc,
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
    pub tails_learned: u64,
    pub nodes_learned: u64,
    pub resets: u64,
}

#[derive(Debug)]
pub struct WriteCache {
    nodes: HashMap<u64, NodeLoc>,
    tails: HashMap<u32, Tail>,
    entries_max: usize,
    pub stats: TailStats,
}

fn marker_parts(word: u64) -> Option<(u32, u64)> {
    (word & TAIL_BIT != 0).then_some((((word >> 32) & 0x7fff_ffff) as u32, word & 0xffff_ffff))
}

fn key31(key_id: u64) -> u32 {
    (key_id & 0x7fff_ffff) as u32
}

impl WriteCache {
    /// A cache of at most `bytes_max` as [`ENTRY_BYTES`] counts it; `None` if that is
    /// not even one node and one tail.
    pub fn new(bytes_max: u64) -> Option<WriteCache> {
        let entries_max = usize::try_from(bytes_max / ENTRY_BYTES).unwrap_or(usize::MAX);
        (entries_max >= 2).then(|| WriteCache {
            nodes: HashMap::new(),
            tails: HashMap::new(),
            entries_max,
            stats: TailStats::default(),
        })
    }

    pub fn bytes(&self) -> u64 {
        (self.nodes.len() + self.tails.len()) as u64 * ENTRY_BYTES
    }

    pub fn tails(&self) -> usize {
        self.tails.len()
    }

    fn make_room(&mut self) {
        if self.nodes.len() + self.tails.len() < self.entries_max {
            return;
        }
        // Nodes matter only between a write and its CAS; tails are worth more, but past
        // half the budget they go too.
        self.stats.resets += 1;
        self.nodes.clear();
        if self.tails.len() >= self.entries_max / 2 {
            self.tails.clear();
        }
    }

    /// A WRITE passed through (decided in order with the requests around it).
    pub fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) {
        let n = decode_linkable_write(data).filter(|n| n.seq < SEQ_VOUCHED_MAX);
        let Some(n) = n else {
            // A whole node written otherwise (say, by a conditional writer reusing a
            // node an unconditional one had): it is no longer relinkable. Shorter
            // writes (a writer's relink header) leave what the node is alone.
            if let Some(word) = node_self_word(data) {
                if self
                    .nodes
                    .get(&word)
                    .is_some_and(|l| (l.region, l.offset) == (region, offset))
                {
                    self.nodes.remove(&word);
                }
            }
            return;
        };
        self.make_room();
        self.stats.nodes_learned += 1;
        self.nodes.insert(
            n.self_word,
            NodeLoc {
                region,
                offset,
                key_id: n.key_id,
            },
        );
    }

    /// A CAS from `expected` to `new` won: if it linked a node seen written, that node is
    /// its key's tail (unless a newer one is already known).
    pub fn cas_won(&mut self, expected: u64, new: u64) {
        let Some((key, seq32)) = marker_parts(expected) else {
            return;
        };
        let Some(loc) = self.nodes.get(&new).copied() else {
            return;
        };
        if key31(loc.key_id) != key || seq32 + 1 >= SEQ_VOUCHED_MAX {
            return;
        }
        let seq = seq32 + 1;
        if self.tails.get(&key).is_some_and(|t| t.seq >= seq) {
            return;
        }
        self.make_room();
        self.stats.tails_learned += 1;
        self.tails.insert(
            key,
            Tail {
                region: loc.region,
                offset: loc.offset,
                key_id: loc.key_id,
                seq,
                self_word: new,
            },
        );
    }

    /// What to do with a CAS of the word at (`region`, `offset`) from `expected` to
    /// `new`: `Some` when it links a relinkable node after a tail older than the one known.
    pub fn redirect(
        &mut self,
        region: RegionId,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> Option<Redirect> {
        let (key, seq32) = marker_parts(expected)?;
        let node = *self.nodes.get(&new)?;
        let tail = *self.tails.get(&key)?;
        if key31(node.key_id) != key || tail.key_id != node.key_id || tail.self_word == new {
            return None;
        }
        if tail.seq <= seq32 || (tail.region, tail.offset) == (region, offset) {
            self.stats.current += 1;
            return None;
        }
        Some(Redirect {
            node,
            node_word: new,
            tail,
        })
    }

    pub fn forget_region(&mut self, region: RegionId) {
        self.nodes.retain(|_, n| n.region != region);
        self.tails.retain(|_, t| t.region != region);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_clover::layout::{encode_node, Geometry, NodeAddr};
    use proptest::prelude::*;

    fn node(slot: u32) -> NodeAddr {
        NodeAddr { block: 0, slot }
    }

    fn write(c: &mut WriteCache, g: &Geometry, slot: u32, key: u64, seq: u64, relinkable: bool) {
        let data = encode_node(g, node(slot), key, seq, Some(b"v"), relinkable).unwrap();
        c.write(7, g.offset(node(slot)).unwrap(), &data);
    }

    #[test]
    fn a_cas_aimed_at_an_old_tail_is_re_aimed_at_the_new_one() {
        let g = Geometry::new(8, 16).unwrap();
        let mut c = WriteCache::new(1 << 20).unwrap();
        // Writer A links slot 1 after the head (slot 0, version 0).
        write(&mut c, &g, 1, 5, 1, true);
        c.cas_won(tail_marker(5, 0), node(1).encode());
        // Writer B walked to the head too and wrote slot 2 as version 1.
        write(&mut c, &g, 2, 5, 1, true);
        // Rewritten by a conditional writer (slot reused): never re-aimed.
        write(&mut c, &g, 2, 5, 1, false);
        assert_eq!(c.redirect(7, 0, tail_marker(5, 0), node(2).encode()), None);
        write(&mut c, &g, 2, 5, 1, true);
        let r = c
            .redirect(7, 0, tail_marker(5, 0), node(2).encode())
            .unwrap();
        assert_eq!(r.tail.offset, g.offset(node(1)).unwrap());
        assert_eq!((r.seq(), r.expected()), (2, tail_marker(5, 1)));
        assert_eq!(r.node.offset, g.offset(node(2)).unwrap());
        // Aimed at the known tail: nothing to do.
        assert_eq!(
            c.redirect(7, r.tail.offset, tail_marker(5, 1), node(2).encode()),
            None
        );
        c.cas_won(r.expected(), r.node_word);
        assert_eq!(c.tails.get(&5).unwrap().seq, 2);
        // An older win reported late never moves the tail back.
        c.cas_won(tail_marker(5, 0), node(1).encode());
        assert_eq!(c.tails.get(&5).unwrap().seq, 2);
    }

    #[test]
    fn what_the_proxy_cannot_vouch_for_passes() {
        let g = Geometry::new(8, 16).unwrap();
        let mut c = WriteCache::new(1 << 20).unwrap();
        write(&mut c, &g, 1, 5, 1, true);
        c.cas_won(tail_marker(5, 0), node(1).encode());
        // A conditional writer's node: never re-aimed.
        write(&mut c, &g, 2, 5, 1, false);
        assert_eq!(c.redirect(7, 0, tail_marker(5, 0), node(2).encode()), None);
        // A node never seen written.
        assert_eq!(c.redirect(7, 0, tail_marker(5, 0), node(3).encode()), None);
        // Another key's tail.
        write(&mut c, &g, 4, 6, 1, true);
        assert_eq!(c.redirect(7, 0, tail_marker(6, 0), node(4).encode()), None);
        // Not a marker at all (a plain word CAS).
        assert_eq!(c.redirect(7, 0, 0, node(4).encode()), None);
        // Huge versions.
        write(&mut c, &g, 5, 5, SEQ_VOUCHED_MAX, true);
        assert_eq!(c.redirect(7, 0, tail_marker(5, 0), node(5).encode()), None);
    }

    proptest! {
        /// Whatever is fed in, the budget holds and a re-aim always targets a tail newer
        /// than the CAS expected, for the node's own key.
        #[test]
        fn bounded_and_only_ever_forward(ops in prop::collection::vec(
            (0u32..40, 0u64..4, 0u64..20, any::<bool>(), 0u8..3), 1..300)) {
            let g = Geometry::new(8, 64).unwrap();
            let mut c = WriteCache::new(ENTRY_BYTES * 10).unwrap();
            for (slot, key, seq, relinkable, kind) in ops {
                match kind {
                    0 => write(&mut c, &g, slot, key, seq, relinkable),
                    1 => c.cas_won(tail_marker(key, seq), node(slot).encode()),
                    _ => {
                        if let Some(r) = c.redirect(7, 0, tail_marker(key, seq), node(slot).encode()) {
                            prop_assert!(r.tail.seq > seq);
                            prop_assert_eq!(r.tail.key_id, key);
                            prop_assert_eq!(r.node.key_id, key);
                        }
                    }
                }
                prop_assert!(c.bytes() <= ENTRY_BYTES * 10);
            }
        }
    }
}
