//! Clover over Camelot: a key-value store whose clients touch data only with one-sided
//! READ, WRITE and CAS on memory servers, after Tsai et al., "Disaggregating Persistent
//! Memory and Controlling Them Remotely" (ATC '20).
//!
//! Each key is a chain of immutable version nodes in blocks (shared regions) on ordinary
//! memory servers. A write writes a new node, then CASes it onto the tail's next word; a
//! read starts at the last tail it knew and follows next words to the tail. The metadata
//! service ([`Meta`]) makes blocks, hands out free nodes, keeps each key's head and
//! collects old versions, epoch-based, so the store's memory is bounded by
//! `blocks_max` blocks.
//!
//! The chain logic is a set of pure state machines (`chain`), run against the network
//! by [`Store`] and against [`SimMemory`] by tests that interleave them at will.
//!
//! The metadata service runs in the stores' process ([`Meta`], shared by its threads) or
//! as a server of its own ([`server::MetaServer`], `camelot clover meta`) that stores in
//! any process reach through [`remote::RemoteMeta`] (`remote::open`).
//!
//! ```no_run
//! # use camelot_clover::*;
//! # use camelot_client::{Client, ClientConfig, ClusterMap};
//! # use std::sync::Arc;
//! let map = ClusterMap::from_addrs(&["127.0.0.1:7000".parse().unwrap()]);
//! let client = Client::connect(map, ClientConfig::default())?;
//! let mem = RegionMemory::new(client, Geometry::new(64, 1024)?);
//! let meta = Arc::new(Meta::new(mem.clone(), MetaConfig::default())?);
//! let mut store = Store::new(meta, mem, StoreConfig::default());
//! store.put(b"k", &b"v"[..])?;
//! assert_eq!(store.get(b"k")?.as_deref(), Some(&b"v"[..]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

pub mod chain;
pub mod layout;
pub mod memory;
pub mod meta;
pub mod remote;
pub mod server;
pub mod store;
pub mod wire;

pub use chain::{ChainError, ChainLimits, Hint};
pub use layout::{Geometry, LayoutError, NodeAddr};
pub use memory::{BlockSource, Memory, RegionMemory, SimMemory};
pub use meta::{Meta, MetaApi, MetaConfig, MetaStats};
pub use remote::{RemoteConfig, RemoteMeta};
pub use server::{MetaServer, MetaServerConfig};
pub use store::{Store, StoreConfig, StoreStats};

#[derive(Debug, Clone, thiserror::Error)]
pub enum CloverError {
    #[error(transparent)]
    Client(#[from] camelot_client::ClientError),
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("no free node and all {blocks_max} blocks made: the store is full")]
    OutOfMemory { blocks_max: u32 },
    #[error("the metadata service tracks at most {0} keys")]
    TooManyKeys(usize),
    #[error("no key has id {0}")]
    UnknownKey(u64),
    #[error("node address {0:?} is outside every block")]
    BadAddress(NodeAddr),
    #[error("chain corrupt: {0}")]
    Corrupt(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The metadata server could not be reached or answered out of protocol.
    #[error("{0}")]
    Meta(String),
    /// The metadata server refused the connection (token, version).
    #[error("metadata server refused: {0}")]
    Refused(String),
}
