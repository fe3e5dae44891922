//! Where things are in memory: node addresses, the next word, a version node's bytes.
//! Pure; nothing here does I/O.
//!
//! A node is `next u64 | key_id u64 | seq u64 | len u32 | flags u32 | value`, all little
//! endian, `node_bytes` apart in a block (a region), so every node's next word is 8-byte
//! aligned for CAS. The next word is either the address of the following version or, in
//! the chain's tail, a *tail marker* naming the node's own key and sequence number: a
//! writer's CAS expects the marker, not 0, so a CAS aimed at a node that has since been
//! reclaimed and reused (for another key, or for a later version) fails instead of
//! linking a version after a stranger.

use bytes::{BufMut, Bytes, BytesMut};

/// Bytes before the value.
pub const HEADER_BYTES: u32 = 32;
/// The part of the header a retried write rewrites: next, key id, sequence number.
pub const RELINK_HEADER_BYTES: usize = 24;
/// Largest value a node can be configured to hold (nodes are fixed-size slots).
pub const VALUE_BYTES_MAX: u32 = 1 << 20;
/// Most nodes a block can hold (slots are 32-bit).
pub const NODES_PER_BLOCK_MAX: u32 = 1 << 24;
/// Most blocks: block indices are stored as index + 1 in the address's upper 31 bits.
pub const BLOCKS_MAX: u32 = (1 << 30) - 1;

const TAIL_BIT: u64 = 1 << 63;
const FLAG_ABSENT: u32 = 1;

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

/// A tail node for version `seq` of `key_id` holding `value` (`None`: absent).
pub fn encode_node(
    geometry: &Geometry,
    key_id: u64,
    seq: u64,
    value: Option<&[u8]>,
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
    b.put_u32_le(if value.is_none() { FLAG_ABSENT } else { 0 });
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
            let node = encode_node(&g, key, seq, value.as_deref()).unwrap();
            // As a read of the whole slot returns it.
            let mut slot = node.to_vec();
            slot.resize(g.node_bytes() as usize, 0xAA);
            let (h, v) = decode_node(&Bytes::from(slot)).unwrap();
            prop_assert_eq!(h.key_id, key);
            prop_assert_eq!(h.seq, seq);
            prop_assert_eq!(h.next, tail_marker(key, seq));
            prop_assert_eq!(v.as_deref(), value.as_deref());
            let relink = encode_relink(key, seq + 1);
            prop_assert_eq!(&relink[..], &encode_node(&g, key, seq + 1, None).unwrap()[..RELINK_HEADER_BYTES]);
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
        assert_eq!(g.offset(NodeAddr { block: 0, slot: 2 }), Some(96));
        assert!(encode_node(&g, 1, 1, Some(&[0; 14])).is_err());
    }
}
