//! Where things are in memory: node addresses, the next word, a version node's bytes.
//! Pure; nothing here does I/O.
//!
//! A node is `next u64 | key_id u64 | seq u64 | len u32 | flags u32 | self u64 | value`,
//! all little endian, `node_bytes` apart in a block (a region), so every node's next word is 8-byte
//! aligned for CAS. The next word is either the address of the following version or, in
//! the chain's tail, a *tail marker* naming the node's own key and sequence number: a
//! writer's CAS expects the marker, not 0, so a CAS aimed at a node that has since been
//! reclaimed and reused (for another key, or for a later version) fails instead of
//! linking a version after a stranger.
//!
//! `self` is the node's own address word (what a predecessor's next word would hold) and
//! the `RELINKABLE` flag says its writer accepts any place at the tail (an unconditional
//! write). Neither matters to the chain logic; they let a middlebox on the path (the
//! proxy's write cache) re-aim a writer's CAS at the real tail: from the node's first
//! WRITE it learns where the node is, so it can rewrite its header itself. A CAS it
//! re-aimed is answered with a [`relinked_word`], which no memory word ever holds.

use bytes::{BufMut, Bytes, BytesMut};

/// Bytes before the value.
pub const HEADER_BYTES: u32 = 40;
/// The part of the header a retried write rewrites: next, key id, sequence number.
pub const RELINK_HEADER_BYTES: usize = 24;
/// Largest value a node can be configured to hold (nodes are fixed-size slots).
pub const VALUE_BYTES_MAX: u32 = 1 << 20;
/// Most nodes a block can hold (slots are 32-bit).
pub const NODES_PER_BLOCK_MAX: u32 = 1 << 24;
/// Most blocks: block indices are stored as index + 1 in the address's upper 31 bits.
pub const BLOCKS_MAX: u32 = (1 << 30) - 1;

const TAIL_BIT: u64 = 1 << 63;
const RELINKED_BIT: u64 = 1 << 62;
const FLAG_ABSENT: u32 = 1;
/// The writer's node may be linked after whatever the tail is (no condition on the value).
pub const FLAG_RELINKABLE: u32 = 2;
/// Set only in a middlebox's answer to a READ, never in memory: these bytes are the
/// linked version `seq` of the key, read at the node the header's own address word
/// names, in place of the node the READ asked for (the proxy's read cache sends a READ
/// of an old version to the newest it knows). A walk accepts it only for its own key at
/// a version newer than the one it asked for.
pub const FLAG_REDIRECTED: u32 = 4;

/// A node's place: which block, which slot in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddr {
    pub block: u32,
    pub slot: u32,
}

impl NodeAddr {
    /// The word stored in a predecessor's next field: never 0, top bit clear.
    pub fn encode(self) -> u64 {
        ((u64::from(self.block) + 1) << 32) | u64::from(self.slot)
    }
}

/// What a next word says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Node(NodeAddr),
    /// The node is a tail; the marker it carries.
    Tail(u64),
    /// Zero or a block index out of range: not something this crate writes.
    Invalid,
}

impl Next {
    pub fn decode(word: u64) -> Next {
        if word & TAIL_BIT != 0 {
            return Next::Tail(word);
        }
        let block = word >> 32;
        if block == 0 || block > u64::from(BLOCKS_MAX) {
            return Next::Invalid;
        }
        Next::Node(NodeAddr {
            block: (block - 1) as u32,
            slot: word as u32,
        })
    }
}

/// The tail marker of version `seq` of key `key_id`. Only the low 31 bits of the key id
/// and the low 32 of the sequence number fit: a stale CAS could succeed only against a
/// node reused for a key 2³¹ ids away at a sequence number 2³² versions away.
pub fn tail_marker(key_id: u64, seq: u64) -> u64 {
    TAIL_BIT | ((key_id & 0x7fff_ffff) << 32) | (seq & 0xffff_ffff)
}

/// The answer a middlebox gives to a CAS it re-aimed and won: the node is linked as
/// version `seq`. Bit 62 set, bit 63 clear: [`Next::decode`] calls it invalid (its block
/// index is past [`BLOCKS_MAX`]), so no chain word can be mistaken for it.
pub fn relinked_word(seq: u64) -> u64 {
    RELINKED_BIT | (seq & (RELINKED_BIT - 1))
}

/// The version a [`relinked_word`] names.
pub fn relinked_seq(word: u64) -> Option<u64> {
    (word & (TAIL_BIT | RELINKED_BIT) == RELINKED_BIT).then_some(word & (RELINKED_BIT - 1))
}

/// What a middlebox may learn from a WRITE of a whole fresh node: its key, version, own
/// address word and flags (`FLAG_RELINKABLE`: an unconditional writer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkableNode {
    pub key_id: u64,
    pub seq: u64,
    pub self_word: u64,
    pub flags: u32,
}

/// `Some` only for the bytes [`encode_node`] makes (a WRITE of a whole node, at its
/// start): the next word is the tail marker of the header's own key and version and the
/// own address word is an address. Anything else, including a relink header, is `None`.
pub fn decode_linkable_write(data: &[u8]) -> Option<LinkableNode> {
    if data.len() < HEADER_BYTES as usize {
        return None;
    }
    let key_id = u64_at(data, 8);
    let seq = u64_at(data, 16);
    let flags = u32_at(data, 28);
    let self_word = u64_at(data, 32);
    let fresh = u64_at(data, 0) == tail_marker(key_id, seq);
    (fresh && flags & FLAG_REDIRECTED == 0 && matches!(Next::decode(self_word), Next::Node(_)))
        .then_some(LinkableNode {
            key_id,
            seq,
            self_word,
            flags,
        })
}

/// The next word, key id and version of a node header's first 24 bytes (zeros for what
/// `data` does not hold).
pub fn node_header_fields(data: &[u8]) -> (u64, u64, u64) {
    let word = |at: usize| {
        data.get(at..at + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    (word(0), word(8), word(16))
}

/// The own-address word of a WRITE covering a whole node header, whatever its flags.
pub fn node_self_word(data: &[u8]) -> Option<u64> {
    (data.len() >= HEADER_BYTES as usize).then(|| u64_at(data, 32))
}

/// Node size and block shape, fixed for a store's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub value_bytes_max: u32,
    pub nodes_per_block: u32,
}

impl Geometry {
    pub fn new(value_bytes_max: u32, nodes_per_block: u32) -> Result<Geometry, LayoutError> {
        if value_bytes_max > VALUE_BYTES_MAX || nodes_per_block == 0 {
            return Err(LayoutError::Geometry(format!(
                "values up to {VALUE_BYTES_MAX} bytes and at least one node per block"
            )));
        }
        if nodes_per_block > NODES_PER_BLOCK_MAX {
            return Err(LayoutError::Geometry(format!(
                "at most {NODES_PER_BLOCK_MAX} nodes per block"
            )));
        }
        Ok(Geometry {
            value_bytes_max,
            nodes_per_block,
        })
    }

    /// A node's size: header plus value, rounded up to 8 so next words stay aligned.
    pub fn node_bytes(&self) -> u32 {
        (HEADER_BYTES + self.value_bytes_max).div_ceil(8) * 8
    }

    pub fn block_bytes(&self) -> u64 {
        u64::from(self.node_bytes()) * u64::from(self.nodes_per_block)
    }

    /// Byte offset of a node in its block, if the slot exists.
    pub fn offset(&self, addr: NodeAddr) -> Option<u64> {
        (addr.slot < self.nodes_per_block)
            .then(|| u64::from(addr.slot) * u64::from(self.node_bytes()))
    }
}

/// A node's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub next: u64,
    pub key_id: u64,
    pub seq: u64,
    pub len: u32,
    pub flags: u32,
    /// The node's own address word.
    pub self_word: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("a node read returned {0} bytes, fewer than its header")]
    Short(usize),
    #[error("a node claims a {len}-byte value but {room} bytes were read")]
    BadLength { len: u32, room: usize },
    #[error("a value of {len} bytes exceeds the store's {max}")]
    ValueTooLarge { len: usize, max: u32 },
    #[error("invalid geometry: {0}")]
    Geometry(String),
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// Decodes a node read from memory: its header and, if the read covered more than the
/// header, its value (`None` for a version that says the key is absent, and for a read
/// of the header alone).
pub fn decode_node(bytes: &Bytes) -> Result<(Header, Option<Bytes>), LayoutError> {
    let h = HEADER_BYTES as usize;
    if bytes.len() < h {
        return Err(LayoutError::Short(bytes.len()));
    }
    let header = Header {
        next: u64_at(bytes, 0),
        key_id: u64_at(bytes, 8),
        seq: u64_at(bytes, 16),
        len: u32_at(bytes, 24),
        flags: u32_at(bytes, 28),
        self_word: u64_at(bytes, 32),
    };
    if header.flags & FLAG_ABSENT != 0 || bytes.len() == h {
        return Ok((header, None));
    }
    let room = bytes.len() - h;
    let len = header.len as usize;
    if len > room {
        return Err(LayoutError::BadLength {
            len: header.len,
            room,
        });
    }
    Ok((header, Some(bytes.slice(h..h + len))))
}

/// A tail node at `addr` for version `seq` of `key_id` holding `value` (`None`: absent);
/// `relinkable` for an unconditional write (see the module doc).
pub fn encode_node(
    geometry: &Geometry,
    addr: NodeAddr,
    key_id: u64,
    seq: u64,
    value: Option<&[u8]>,
    relinkable: bool,
) -> Result<Bytes, LayoutError> {
    let len = value.map_or(0, <[u8]>::len);
    if len > geometry.value_bytes_max as usize {
        return Err(LayoutError::ValueTooLarge {
            len,
            max: geometry.value_bytes_max,
        });
    }
    let mut b = BytesMut::with_capacity(HEADER_BYTES as usize + len);
    b.put_u64_le(tail_marker(key_id, seq));
    b.put_u64_le(key_id);
    b.put_u64_le(seq);
    b.put_u32_le(len as u32);
    let mut flags = if value.is_none() { FLAG_ABSENT } else { 0 };
    if relinkable {
        flags |= FLAG_RELINKABLE;
    }
    b.put_u32_le(flags);
    b.put_u64_le(addr.encode());
    if let Some(v) = value {
        b.put_slice(v);
    }
    Ok(b.freeze())
}

/// The first [`RELINK_HEADER_BYTES`] of a node re-aimed at version `seq`: what a writer
/// rewrites when its CAS lost and the tail moved on (the value stays where it is).
pub fn encode_relink(key_id: u64, seq: u64) -> Bytes {
    let mut b = BytesMut::with_capacity(RELINK_HEADER_BYTES);
    b.put_u64_le(tail_marker(key_id, seq));
    b.put_u64_le(key_id);
    b.put_u64_le(seq);
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn addresses_round_trip(block in 0..BLOCKS_MAX, slot in any::<u32>()) {
            let a = NodeAddr { block, slot };
            let w = a.encode();
            prop_assert_ne!(w, 0);
            prop_assert_eq!(Next::decode(w), Next::Node(a));
        }

        #[test]
        fn markers_are_never_addresses(key in any::<u64>(), seq in any::<u64>()) {
            let m = tail_marker(key, seq);
            prop_assert_eq!(Next::decode(m), Next::Tail(m));
        }

        #[test]
        fn nodes_round_trip(key in any::<u64>(), seq in any::<u64>(),
                            value in prop::option::of(prop::collection::vec(any::<u8>(), 0..64))) {
            let g = Geometry::new(64, 4).unwrap();
            let addr = NodeAddr { block: 3, slot: 2 };
            let node = encode_node(&g, addr, key, seq, value.as_deref(), true).unwrap();
            // As a read of the whole slot returns it.
            let mut slot = node.to_vec();
            slot.resize(g.node_bytes() as usize, 0xAA);
            let (h, v) = decode_node(&Bytes::from(slot)).unwrap();
            prop_assert_eq!(h.key_id, key);
            prop_assert_eq!(h.seq, seq);
            prop_assert_eq!(h.next, tail_marker(key, seq));
            prop_assert_eq!(v.as_deref(), value.as_deref());
            let relink = encode_relink(key, seq + 1);
            prop_assert_eq!(&relink[..], &encode_node(&g, addr, key, seq + 1, None, false).unwrap()[..RELINK_HEADER_BYTES]);
            let flags = if value.is_none() { FLAG_ABSENT } else { 0 };
            prop_assert_eq!(decode_linkable_write(&node), Some(LinkableNode { key_id: key, seq, self_word: addr.encode(), flags: flags | FLAG_RELINKABLE }));
            prop_assert_eq!(decode_linkable_write(&relink), None);
            prop_assert_eq!(node_header_fields(&relink), (tail_marker(key, seq + 1), key, seq + 1));
            let fixed = encode_node(&g, addr, key, seq, value.as_deref(), false).unwrap();
            prop_assert_eq!(decode_linkable_write(&fixed).map(|n| n.flags), Some(flags));
            prop_assert_eq!(h.self_word, addr.encode());
        }

        #[test]
        fn relinked_words_are_never_chain_words(seq in 0..(1u64 << 62), word in any::<u64>()) {
            let w = relinked_word(seq);
            prop_assert_eq!(relinked_seq(w), Some(seq));
            prop_assert_eq!(Next::decode(w), Next::Invalid);
            if let Next::Node(_) | Next::Tail(_) = Next::decode(word) {
                prop_assert_eq!(relinked_seq(word), None);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
            let _ = decode_node(&Bytes::from(bytes));
        }
    }

    #[test]
    fn zero_is_not_an_address_and_geometry_aligns() {
        assert_eq!(Next::decode(0), Next::Invalid);
        let g = Geometry::new(13, 10).unwrap();
        assert_eq!(g.node_bytes() % 8, 0);
        assert_eq!(g.offset(NodeAddr { block: 0, slot: 10 }), None);
        assert_eq!(g.offset(NodeAddr { block: 0, slot: 2 }), Some(112));
        assert!(encode_node(
            &g,
            NodeAddr { block: 0, slot: 1 },
            1,
            1,
            Some(&[0; 14]),
            false
        )
        .is_err());
    }
}
