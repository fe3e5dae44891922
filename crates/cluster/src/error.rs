use std::net::SocketAddr;

type NodeId = u32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no node has a positive weight")]
    NoWeight,
    #[error("replication {replication} needs that many nodes with a positive weight, there are {weighted}")]
    NotEnoughNodes { weighted: usize, replication: u32 },
    #[error("no node can take a replica of partition {partition} (every candidate holds one)")]
    NoPlacement { partition: u32 },
}

/// Why a cluster map is not acceptable. Maps come from files and from etcd, where anyone
/// with access may have written anything, so every field is checked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("cannot parse the map: {0}")]
    Parse(String),
    #[error("{what} of {value} exceeds the limit of {max}")]
    TooMany {
        what: &'static str,
        value: u64,
        max: u64,
    },
    #[error("{value} partitions: must be 1..={max}")]
    Partitions { value: u64, max: u32 },
    #[error("replication {value}: must be 1..={max}")]
    Replication { value: u32, max: u32 },
    #[error("epoch 0 is reserved for \"no cluster\"")]
    ZeroEpoch,
    #[error("the map has no nodes")]
    NoNodes,
    #[error("node id {0} appears twice")]
    DuplicateNode(NodeId),
    #[error("address {0} appears twice")]
    DuplicateAddr(SocketAddr),
    #[error("replication {replication} needs that many nodes with a positive weight, there are {weighted}")]
    NotEnoughNodes { weighted: usize, replication: u32 },
    #[error("partition {partition} has no replica")]
    NoReplicas { partition: u32 },
    #[error("partition {partition} has {count} replicas, more than replication {max}")]
    TooManyReplicas {
        partition: u32,
        count: usize,
        max: usize,
    },
    #[error("partition {partition} names node {node}, which is not in the map")]
    UnknownNode { partition: u32, node: NodeId },
    #[error("partition {partition} names node {node} twice")]
    DuplicateReplica { partition: u32, node: NodeId },
    #[error("fenced partition {0} is out of range or out of order")]
    Fenced(u32),
    #[error("syncing replica (partition {partition}, node {node}) is out of order or not a backup of that partition")]
    Syncing { partition: u32, node: NodeId },
    #[error("cannot plan: {0}")]
    Plan(PlanError),
}

/// Why a map could not be read from or written to its source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Map { path: String, source: MapError },
}
