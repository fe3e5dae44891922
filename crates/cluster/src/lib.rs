//! The cluster: a map of partitions to replicas at an epoch ([`map`]), the planner that
//! rebalances it ([`plan`]), what the controller decides on failures ([`failover`]), and
//! where a map comes from — a static file ([`source`]) or etcd (`etcd`, with the `etcd`
//! feature), which also holds the live nodes' leases and elects the `controller`.
#![forbid(unsafe_code)]

pub mod auto;
#[cfg(feature = "etcd")]
pub mod controller;
pub mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod failover;
#[cfg(feature = "etcd")]
pub mod follow;
pub mod map;
#[cfg(feature = "etcd")]
pub mod mover;
pub mod moves;
pub mod plan;
pub mod source;

pub use error::MapError;

/// Key prefix of a cluster in etcd unless told otherwise.
pub const PREFIX_DEFAULT: &str = "/camelot";
/// Lease TTL of a node registration unless told otherwise: a dead node leaves the member
/// list within this long (plus etcd's own expiry check, ~0.5 s).
pub const LEASE_TTL_DEFAULT: std::time::Duration = std::time::Duration::from_secs(2);
pub use map::{ClusterMap, Node, NodeId, PARTITIONS_DEFAULT};
pub use plan::{plan, Move, Plan, PlanError};
