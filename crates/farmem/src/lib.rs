//! Far memory: a local page cache over remote pages, the eviction policies and prefetchers
//! that decide what it holds, and a trace simulator that runs the same policy code over a
//! trace without touching memory — so a policy can be chosen before anything runs, and
//! the simulator's answer is the real cache's answer for the same trace.
//!
//! Everything here so far is pure (no sockets, no memory servers): [`policy`],
//! [`prefetch`] and [`sim`]. The cache over a block volume builds on them.
#![forbid(unsafe_code)]

mod error;
mod list;
pub mod policy;
pub mod prefetch;
pub mod sim;

pub use error::Error;
pub use list::PageList;
pub use policy::{by_name as policy_by_name, Policy, POLICY_NAMES};
pub use prefetch::{prefetcher_by_name, Prefetcher, PREFETCHER_NAMES};

/// A page's number within a far-memory space (its byte offset ÷ the page size).
pub type PageId = u64;
