//! The cluster: a map of partitions to replicas at an epoch ([`map`]), the planner that
//! rebalances it ([`plan`]), and where a map comes from — a static file ([`source`]) or
//! etcd ([`etcd`]), which also holds the live nodes' leases.
#![forbid(unsafe_code)]

pub mod error;
pub mod etcd;
pub mod follow;
pub mod map;
pub mod plan;
pub mod source;

pub use error::MapError;
pub use map::{ClusterMap, Node, NodeId, PARTITIONS_DEFAULT};
pub use plan::{plan, Move, Plan, PlanError};
