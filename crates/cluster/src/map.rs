//! The cluster map: which node holds which replicas of which partition, at which epoch.
//! Pure data with validation; no I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::error::MapError;

pub type NodeId = u32;

/// Partitions of a new map unless told otherwise. Fixed for the map's life: rebalancing
/// moves whole partitions, so a key's partition must not depend on the cluster's size.
pub const PARTITIONS_DEFAULT: u32 = 1024;
/// More partitions than this makes a map (and every watcher's copy of it) large for no
/// gain in balance: 65,536 partitions over 1,024 nodes is already within 1.6 %.
pub const PARTITIONS_MAX: u32 = 65_536;
pub const NODES_MAX: usize = 1_024;
/// Replicas per partition (primary included).
pub const REPLICAS_MAX: usize = 8;
/// A node's weight is relative; the cap keeps `partitions × replicas × weight` sums far
/// inside u128 and rejects nonsense like `u64::MAX`.
pub const WEIGHT_MAX: u32 = 1_000_000;
/// A serialized map (file, etcd value) larger than this is refused before it is parsed:
/// 65,536 partitions × 8 replicas of 4-digit ids is ~3 MiB of JSON.
pub const MAP_BYTES_MAX: usize = 8 << 20;
/// Highest epoch a map may carry: every change publishes `epoch + 1`, which must not
/// overflow (a map from etcd could say anything). Far beyond any cluster's lifetime.
pub const EPOCH_MAX: u64 = 1 << 62;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub id: NodeId,
    pub addr: SocketAddr,
    /// Relative capacity: a node's share of replica slots is `weight / Σ weight`. 0 drains
    /// the node (it is planned out of every partition).
    #[serde(default = "weight_default")]
    pub weight: u32,
    /// The etcd lease of the registration this entry was taken from (0: not recorded).
    /// Servers keep their data in memory only, so a node that registers again under a
    /// new lease is a new, empty process: the controller treats the old one as dead
    /// (drops it from every replica set) before it counts the new one as anything —
    /// unless both name the same [`Node::incarnation`].
    #[serde(default, skip_serializing_if = "is_zero_i64")]
    pub lease: i64,
    /// A number the server process drew when it started (0: not recorded). A process
    /// whose lease expired while it ran (an etcd stall, a partition longer than the TTL)
    /// registers again under a new lease with the same incarnation: the same process,
    /// its data intact. A restart draws a new one.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub incarnation: u64,
}

impl Node {
    /// Whether the registration `live` is the process this map entry names: the same
    /// address and incarnation when both recorded one, else the same lease (when the
    /// entry recorded one).
    pub fn same_process(&self, live: &Node) -> bool {
        self.addr == live.addr
            && if self.incarnation != 0 && live.incarnation != 0 {
                self.incarnation == live.incarnation
            } else {
                self.lease == 0 || self.lease == live.lease
            }
    }
}

fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

fn weight_default() -> u32 {
    1
}

/// The map. `assignment[p]` lists partition `p`'s replicas, primary first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMap {
    /// Bumped on every change. 0 means "no cluster" to servers and clients (batches
    /// routed at epoch 0 are never checked), so a published map's epoch is ≥ 1.
    pub epoch: u64,
    /// Replicas per partition the planner aims for (primary included).
    pub replication: u32,
    pub nodes: Vec<Node>,
    pub assignment: Vec<Vec<NodeId>>,
    /// Partitions under a move's write fence, ascending: no node serves them (their
    /// primary answers MOVED) until a later epoch switches them to the move's target or
    /// lifts the fence. Absent in maps written before moves existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fenced: Vec<u32>,
    /// Replicas being filled by re-replication, `(partition, node)` ascending: the node is
    /// in the partition's replica set (never first), so the primary copies every write to
    /// it, but it is not promoted — it may lack older keys — until the controller has
    /// copied the partition to it and removed the pair. Absent in older maps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub syncing: Vec<(u32, NodeId)>,
}

impl ClusterMap {
    pub fn partitions(&self) -> u32 {
        // validate() bounds it by PARTITIONS_MAX, so the cast cannot truncate a valid map.
        self.assignment.len() as u32
    }

    /// The partition a key belongs to: the pinned `camelot_proto::partition_of`, the one
    /// function clients route by and servers check ownership by.
    pub fn partition_of(&self, key: &[u8]) -> u32 {
        camelot_proto::partition_of(key, self.partitions())
    }

    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }

    pub fn primary(&self, partition: u32) -> Option<NodeId> {
        self.assignment
            .get(partition as usize)
            .and_then(|r| r.first().copied())
    }

    pub fn replicas(&self, partition: u32) -> &[NodeId] {
        self.assignment
            .get(partition as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The partitions whose primary is `node`, as a bitmap indexed by partition.
    pub fn primaries_of(&self, node: NodeId) -> Vec<bool> {
        self.assignment
            .iter()
            .map(|r| r.first() == Some(&node))
            .collect()
    }

    /// The partitions `node` serves: those it is primary of, less the fenced ones. What a
    /// member installs as its ownership.
    pub fn serving_primaries_of(&self, node: NodeId) -> Vec<bool> {
        let mut owned = self.primaries_of(node);
        for p in &self.fenced {
            if let Some(o) = owned.get_mut(*p as usize) {
                *o = false;
            }
        }
        owned
    }

    pub fn is_fenced(&self, partition: u32) -> bool {
        self.fenced.binary_search(&partition).is_ok()
    }

    /// Whether `node` is in `partition`'s replica set only as a replica still being
    /// filled (see [`ClusterMap::syncing`]).
    pub fn is_syncing(&self, partition: u32, node: NodeId) -> bool {
        self.syncing.binary_search(&(partition, node)).is_ok()
    }

    /// Replica slots each node holds (nodes holding none included), by node id.
    pub fn slots_per_node(&self) -> BTreeMap<NodeId, usize> {
        let mut counts: BTreeMap<NodeId, usize> = self.nodes.iter().map(|n| (n.id, 0)).collect();
        for r in &self.assignment {
            for id in r {
                *counts.entry(*id).or_default() += 1;
            }
        }
        counts
    }

    /// Checks everything a peer could get wrong: limits, unique ids and addresses,
    /// every partition with 1..=replication distinct replicas on nodes of the map.
    pub fn validate(&self) -> Result<(), MapError> {
        if self.epoch == 0 {
            return Err(MapError::ZeroEpoch);
        }
        if self.epoch > EPOCH_MAX {
            return Err(MapError::TooMany {
                what: "epoch",
                value: self.epoch,
                max: EPOCH_MAX,
            });
        }
        check_partitions(self.assignment.len() as u64)?;
        self.check_nodes()?;
        let ids: BTreeSet<NodeId> = self.nodes.iter().map(|n| n.id).collect();
        for (p, replicas) in self.assignment.iter().enumerate() {
            let p = p as u32;
            if replicas.is_empty() {
                return Err(MapError::NoReplicas { partition: p });
            }
            // A replicated move's target joins as a syncing replica before the member it
            // replaces leaves, so syncing replicas may take a set above R.
            // (`syncing` is sorted, checked below; unsorted, the count is off and the map
            // is refused anyway.)
            let syncing = self
                .syncing
                .partition_point(|(q, _)| *q <= p)
                .saturating_sub(self.syncing.partition_point(|(q, _)| *q < p));
            let max = (self.replication as usize + syncing).min(REPLICAS_MAX);
            if replicas.len() > max {
                return Err(MapError::TooManyReplicas {
                    partition: p,
                    count: replicas.len(),
                    max,
                });
            }
            for (i, id) in replicas.iter().enumerate() {
                if !ids.contains(id) {
                    return Err(MapError::UnknownNode {
                        partition: p,
                        node: *id,
                    });
                }
                if replicas[..i].contains(id) {
                    return Err(MapError::DuplicateReplica {
                        partition: p,
                        node: *id,
                    });
                }
            }
        }
        if let Some(w) = self.fenced.windows(2).find(|w| w[0] >= w[1]) {
            return Err(MapError::Fenced(w[1]));
        }
        if let Some(p) = self.fenced.iter().find(|p| **p >= self.partitions()) {
            return Err(MapError::Fenced(*p));
        }
        if let Some(w) = self.syncing.windows(2).find(|w| w[0] >= w[1]) {
            return Err(MapError::Syncing {
                partition: w[1].0,
                node: w[1].1,
            });
        }
        for &(p, node) in &self.syncing {
            // A syncing replica is a backup: in the set, never the primary.
            if !self.replicas(p).iter().skip(1).any(|n| *n == node) {
                return Err(MapError::Syncing { partition: p, node });
            }
        }
        Ok(())
    }

    /// The node list and replication factor alone (a map being built has no assignment).
    pub(crate) fn check_nodes(&self) -> Result<(), MapError> {
        if self.nodes.is_empty() {
            return Err(MapError::NoNodes);
        }
        if self.nodes.len() > NODES_MAX {
            return Err(MapError::TooMany {
                what: "nodes",
                value: self.nodes.len() as u64,
                max: NODES_MAX as u64,
            });
        }
        if self.replication == 0 || self.replication as usize > REPLICAS_MAX {
            return Err(MapError::Replication {
                value: self.replication,
                max: REPLICAS_MAX as u32,
            });
        }
        let mut ids = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        for n in &self.nodes {
            if !ids.insert(n.id) {
                return Err(MapError::DuplicateNode(n.id));
            }
            if !addrs.insert(n.addr) {
                return Err(MapError::DuplicateAddr(n.addr));
            }
            if n.weight > WEIGHT_MAX {
                return Err(MapError::TooMany {
                    what: "weight",
                    value: u64::from(n.weight),
                    max: u64::from(WEIGHT_MAX),
                });
            }
        }
        let weighted = self.nodes.iter().filter(|n| n.weight > 0).count();
        if weighted < self.replication as usize {
            return Err(MapError::NotEnoughNodes {
                weighted,
                replication: self.replication,
            });
        }
        Ok(())
    }

    pub fn to_json(&self) -> String {
        // A map is plain data (numbers, strings, lists): serde_json cannot fail on it.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses and validates a map from JSON, refusing oversized input before parsing.
    pub fn from_json(bytes: &[u8]) -> Result<ClusterMap, MapError> {
        check_size(bytes.len())?;
        let map: ClusterMap =
            serde_json::from_slice(bytes).map_err(|e| MapError::Parse(e.to_string()))?;
        map.validate()?;
        Ok(map)
    }

    pub fn to_toml(&self) -> Result<String, MapError> {
        toml::to_string(self).map_err(|e| MapError::Parse(e.to_string()))
    }

    pub fn from_toml(text: &str) -> Result<ClusterMap, MapError> {
        check_size(text.len())?;
        let map: ClusterMap = toml::from_str(text).map_err(|e| MapError::Parse(e.to_string()))?;
        map.validate()?;
        Ok(map)
    }
}

fn check_size(len: usize) -> Result<(), MapError> {
    if len > MAP_BYTES_MAX {
        return Err(MapError::TooMany {
            what: "map bytes",
            value: len as u64,
            max: MAP_BYTES_MAX as u64,
        });
    }
    Ok(())
}

pub(crate) fn check_partitions(partitions: impl Into<u64>) -> Result<(), MapError> {
    let partitions = partitions.into();
    if partitions == 0 || partitions > u64::from(PARTITIONS_MAX) {
        return Err(MapError::Partitions {
            value: partitions,
            max: PARTITIONS_MAX,
        });
    }
    Ok(())
}

/// `n` nodes of weight 1 at 127.0.0.1:7000 + id, for the crate's pure tests.
#[cfg(test)]
pub(crate) fn test_nodes(n: u32) -> Vec<Node> {
    (0..n)
        .map(|i| Node {
            id: i,
            addr: SocketAddr::from(([127, 0, 0, 1], 7000 + i as u16)),
            weight: 1,
            lease: 0,
            incarnation: 0,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: u32) -> Vec<Node> {
        test_nodes(n)
    }

    #[test]
    fn initial_map_is_valid_and_even() {
        let m = ClusterMap::initial(nodes(3), 1024, 2).unwrap();
        assert_eq!(m.partitions(), 1024);
        assert_eq!(m.epoch, 1);
        for (_, slots) in m.slots_per_node() {
            // 2048 slots / 3 nodes = 682.67: within ±1.
            assert!((682..=683).contains(&slots), "{slots}");
        }
        m.validate().unwrap();
    }

    #[test]
    fn key_partition_is_the_pinned_one() {
        let m = ClusterMap::initial(nodes(2), 1024, 1).unwrap();
        assert_eq!(m.partition_of(b"user1"), 726);
        assert_eq!(
            m.partition_of(b"user1"),
            camelot_proto::partition_of(b"user1", 1024)
        );
    }

    #[test]
    fn json_and_toml_round_trip() {
        let m = ClusterMap::initial(nodes(3), 64, 2).unwrap();
        assert_eq!(ClusterMap::from_json(m.to_json().as_bytes()).unwrap(), m);
        assert_eq!(ClusterMap::from_toml(&m.to_toml().unwrap()).unwrap(), m);
    }

    #[test]
    fn hostile_maps_get_typed_errors() {
        let good = ClusterMap::initial(nodes(3), 16, 2).unwrap();
        let mut m = good.clone();
        m.assignment[3] = vec![0, 0];
        assert!(matches!(
            m.validate(),
            Err(MapError::DuplicateReplica {
                partition: 3,
                node: 0
            })
        ));
        let mut m = good.clone();
        m.assignment[5] = vec![9];
        assert!(matches!(
            m.validate(),
            Err(MapError::UnknownNode {
                partition: 5,
                node: 9
            })
        ));
        let mut m = good.clone();
        m.assignment[0].clear();
        assert!(matches!(
            m.validate(),
            Err(MapError::NoReplicas { partition: 0 })
        ));
        let mut m = good.clone();
        m.assignment[1] = vec![0, 1, 2];
        assert!(matches!(
            m.validate(),
            Err(MapError::TooManyReplicas { .. })
        ));
        let mut m = good.clone();
        m.nodes[1].id = 0;
        assert!(matches!(m.validate(), Err(MapError::DuplicateNode(0))));
        let mut m = good.clone();
        m.nodes[1].addr = m.nodes[0].addr;
        assert!(matches!(m.validate(), Err(MapError::DuplicateAddr(_))));
        let mut m = good.clone();
        m.epoch = 0;
        assert!(matches!(m.validate(), Err(MapError::ZeroEpoch)));
        let mut m = good.clone();
        m.epoch = u64::MAX;
        assert!(matches!(
            m.validate(),
            Err(MapError::TooMany { what: "epoch", .. })
        ));
        let mut m = good.clone();
        m.assignment = vec![vec![0]; PARTITIONS_MAX as usize + 1];
        assert!(matches!(m.validate(), Err(MapError::Partitions { .. })));
        let mut m = good.clone();
        m.replication = 9;
        assert!(matches!(m.validate(), Err(MapError::Replication { .. })));
        let mut m = good.clone();
        m.nodes[0].weight = WEIGHT_MAX + 1;
        assert!(matches!(
            m.validate(),
            Err(MapError::TooMany { what: "weight", .. })
        ));
        assert!(matches!(
            ClusterMap::initial(nodes(1), 16, 2),
            Err(MapError::NotEnoughNodes { .. })
        ));
        assert!(matches!(
            ClusterMap::initial(nodes(1), 0, 1),
            Err(MapError::Partitions { .. })
        ));
        let huge = vec![b' '; MAP_BYTES_MAX + 1];
        assert!(matches!(
            ClusterMap::from_json(&huge),
            Err(MapError::TooMany {
                what: "map bytes",
                ..
            })
        ));
        assert!(matches!(
            ClusterMap::from_json(br#"{"epoch": -1}"#),
            Err(MapError::Parse(_))
        ));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_json_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = ClusterMap::from_json(&bytes);
        }
    }
}
