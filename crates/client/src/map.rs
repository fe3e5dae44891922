//! The cluster map: the one thing routing depends on. Static for now; the cluster layer
//! will swap in maps it reads from etcd through [`crate::Client::set_map`].

use std::net::SocketAddr;

pub type NodeId = u32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: NodeId,
    pub addr: SocketAddr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterMap {
    /// Bumped on every change; 0 means "static, never checked by servers".
    pub epoch: u64,
    pub nodes: Vec<NodeInfo>,
}

impl ClusterMap {
    /// A static map over the given addresses, node ids 0..n in order.
    pub fn from_addrs(addrs: &[SocketAddr]) -> ClusterMap {
        ClusterMap {
            epoch: 0,
            nodes: addrs
                .iter()
                .enumerate()
                .map(|(i, a)| NodeInfo {
                    id: i as NodeId,
                    addr: *a,
                })
                .collect(),
        }
    }

    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.id == id)
    }

    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.iter().map(|n| n.id)
    }

    /// Where a named region is placed. Rendezvous hashing: adding or removing a node moves
    /// only the names that node wins or held, so a restarted client finds its regions again
    /// as long as the map is the same, and most of them even when it grew.
    pub fn node_for_name(&self, name: &str) -> Option<NodeId> {
        self.rendezvous(name.as_bytes())
    }

    /// The node that owns a key-value partition. Rendezvous hashing again, so a new node
    /// takes over only partitions it wins; key → partition itself never changes.
    pub fn node_for_partition(&self, partition: u32) -> Option<NodeId> {
        let mut tag = *b"partition:\0\0\0\0";
        tag[10..].copy_from_slice(&partition.to_le_bytes());
        self.rendezvous(&tag)
    }

    fn rendezvous(&self, name: &[u8]) -> Option<NodeId> {
        self.nodes
            .iter()
            .max_by_key(|n| (rendezvous_score(name, n.id), n.id))
            .map(|n| n.id)
    }
}

/// A cluster's explicit placement: each partition's primary, as the cluster map (in
/// etcd or a file) assigns it. With one installed ([`crate::Client::set_cluster`]), keys
/// are routed by it instead of by rendezvous hashing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionTable {
    primaries: Vec<NodeId>,
    /// `backups[p]`: partition `p`'s full backups, for replica reads; empty when not
    /// given ([`PartitionTable::with_backups`]).
    backups: Vec<Vec<NodeId>>,
}

/// Backups a partition may list (the cluster crate's R ≤ 8, less the primary).
pub const TABLE_BACKUPS_MAX: usize = 7;

/// Partitions a table may have (the cluster crate's limit).
pub const TABLE_PARTITIONS_MAX: usize = 65_536;

impl PartitionTable {
    /// `primaries[p]` is partition `p`'s primary. None for an empty or oversized table.
    pub fn new(primaries: Vec<NodeId>) -> Option<PartitionTable> {
        if primaries.is_empty() || primaries.len() > TABLE_PARTITIONS_MAX {
            return None;
        }
        Some(PartitionTable {
            primaries,
            backups: Vec::new(),
        })
    }

    /// Adds each partition's full backups (those a replica read may go to). None when
    /// the count is not the partition count or a partition lists too many.
    pub fn with_backups(mut self, backups: Vec<Vec<NodeId>>) -> Option<PartitionTable> {
        if backups.len() != self.primaries.len()
            || backups.iter().any(|b| b.len() > TABLE_BACKUPS_MAX)
        {
            return None;
        }
        self.backups = backups;
        Some(self)
    }

    /// The full backups of `key`'s partition (none when not given).
    pub fn backups_for_key(&self, key: &[u8]) -> &[NodeId] {
        let p = camelot_proto::partition_of(key, self.partitions());
        self.backups.get(p as usize).map_or(&[], Vec::as_slice)
    }

    pub fn partitions(&self) -> u32 {
        self.primaries.len() as u32
    }

    pub fn primaries(&self) -> &[NodeId] {
        &self.primaries
    }

    /// The node holding `key`'s partition (by the pinned `camelot_proto::partition_of`).
    pub fn node_for_key(&self, key: &[u8]) -> NodeId {
        let p = camelot_proto::partition_of(key, self.partitions());
        self.primaries[p as usize]
    }
}

/// Key-value partitions. Fixed forever: rebalancing moves whole partitions between nodes,
/// so a key's partition must not depend on the cluster's size.
pub const PARTITIONS: u32 = 1024;

/// The partition a key belongs to. The high half of the key hash, because servers shard
/// by the low bits and the two should not be correlated.
pub fn partition_of(key: &[u8]) -> u32 {
    camelot_proto::partition_of(key, PARTITIONS)
}

fn rendezvous_score(name: &[u8], node: NodeId) -> u64 {
    // FNV-1a, then a 64-bit finaliser so nearby node ids give unrelated scores. Stable
    // across builds and platforms, unlike std's randomly keyed hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.iter().chain(node.to_le_bytes().iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn map(n: usize) -> ClusterMap {
        let addrs: Vec<SocketAddr> = (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 7000 + i as u16)))
            .collect();
        ClusterMap::from_addrs(&addrs)
    }

    #[test]
    fn names_spread_over_nodes() {
        let m = map(3);
        let mut counts = [0usize; 3];
        for i in 0..3000 {
            counts[m.node_for_name(&format!("region-{i}")).unwrap() as usize] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "uneven spread {counts:?}");
        }
    }

    #[test]
    fn keys_spread_evenly_over_nodes() {
        let m = map(3);
        let mut counts = [0usize; 3];
        for i in 0..30_000 {
            let p = partition_of(format!("user{i}").as_bytes());
            counts[m.node_for_partition(p).unwrap() as usize] += 1;
        }
        for c in counts {
            assert!((8_500..11_500).contains(&c), "uneven spread {counts:?}");
        }
    }

    #[test]
    fn empty_map_places_nothing() {
        assert_eq!(map(0).node_for_name("x"), None);
    }

    proptest! {
        #[test]
        fn adding_a_node_moves_only_partitions_to_it(p in 0..PARTITIONS) {
            let a = map(4).node_for_partition(p).unwrap();
            let b = map(5).node_for_partition(p).unwrap();
            prop_assert!(a == b || b == 4);
        }

        #[test]
        fn adding_a_node_moves_only_names_to_it(names in proptest::collection::vec("[a-z0-9]{1,12}", 1..200)) {
            let before = map(4);
            let after = map(5);
            for n in &names {
                let a = before.node_for_name(n).unwrap();
                let b = after.node_for_name(n).unwrap();
                prop_assert!(a == b || b == 4, "{n} moved from {a} to {b}");
            }
        }
    }
}
