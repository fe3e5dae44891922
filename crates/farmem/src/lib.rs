//! Far memory: a local page cache over remote pages, the eviction policies and prefetchers
//! that decide what it holds, and a trace simulator that runs the same policy code over a
//! trace without touching memory — so a policy can be chosen before anything runs, and
//! the simulator's answer is the real cache's answer for the same trace.
//!
//! [`policy`], [`prefetch`] and [`sim`] are pure; [`cache`] drives them over a
//! [`PageStore`] — pages in local memory ([`LocalStore`], the all-local reference) or in
//! a region on a memory server ([`RegionStore`]) — and [`FarVec`] is a vector over it.
// `uffd` alone holds unsafe code (the mapping and the userfaultfd), each use argued.
#![deny(unsafe_code)]

pub mod cache;
mod error;
pub mod farvec;
mod list;
pub mod policy;
pub mod prefetch;
pub mod region;
pub mod sim;
pub mod sort;
pub mod store;
mod uffd;

pub use cache::{CacheConfig, CacheStats, PageCache};
pub use error::Error;
pub use farvec::{FarSlice, FarSliceMut, FarVec};
pub use list::PageList;
pub use policy::{by_name as policy_by_name, Policy, POLICY_NAMES};
pub use prefetch::{prefetcher_by_name, Prefetcher, PREFETCHER_NAMES};
pub use region::{FarRegion, RegionStats};
pub use store::{LocalStore, PageStore, PendingRead, RegionStore, VolumeStore};

/// A page's number within a far-memory space (its byte offset ÷ the page size).
pub type PageId = u64;

/// Maps keyed by page number. Every cache access makes several lookups in them, and
/// page numbers come from our own code, not from a peer that could pick colliding keys,
/// so the fast Fx hash replaces SipHash (which cost ~20 ns a lookup on this path).
pub(crate) type PageMap<V> = std::collections::HashMap<PageId, V, rustc_hash::FxBuildHasher>;
pub(crate) type PageSet = std::collections::HashSet<PageId, rustc_hash::FxBuildHasher>;
