//! The one error type of the RVM crate.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RvmError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("{what} of {got} exceeds the limit of {max}")]
    TooLarge {
        what: &'static str,
        got: u64,
        max: u64,
    },
    #[error("a segment tagged {0:?} already exists")]
    TagExists(String),
    #[error("no segment tagged {0:?}")]
    NoSuchTag(String),
    #[error("segment {tag:?} was freed")]
    SegmentFreed { tag: String },
    #[error("bytes {offset}..{end} lie outside segment {tag:?} of {len} bytes")]
    OutOfBounds {
        tag: String,
        offset: u64,
        end: u64,
        len: u64,
    },
    #[error(
        "bytes {offset}..{end} of segment {tag:?} overlap a range another live transaction \
         declared"
    )]
    RangeConflict { tag: String, offset: u64, end: u64 },
    #[error("bytes {offset}..{end} of segment {tag:?} were not declared with set_range")]
    NotDeclared { tag: String, offset: u64, end: u64 },
    #[error(
        "cannot map {len} bytes at the recorded address {addr:#x}: {reason} \
         (recovered segments must come back at the same address)"
    )]
    AddressTaken { addr: u64, len: u64, reason: String },
    #[error("cannot map {len} bytes of segment memory: {source}")]
    Map {
        len: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("backend data is corrupt: {0}")]
    Corrupt(String),
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pool error: {0}")]
    Pool(#[from] camelot_client::ClientError),
    #[error("redis at {addr}: {detail}")]
    Redis { addr: String, detail: String },
    /// The backend holds an instance created with different geometry than this open
    /// asks for; reopening with the stored value (or without recovery) works.
    #[error(
        "{what}: the instance was created with {stored}, this open asks for {requested} \
         (reopen with {stored}, or open without recovery to discard it and start over)"
    )]
    Geometry {
        what: &'static str,
        stored: u64,
        requested: u64,
    },
    /// Another process opened this instance after this one (it took a newer epoch or
    /// holds the lock): this one may no longer write.
    #[error("fenced: {0}")]
    Fenced(String),
    /// A pool server lacks the memory for one of the instance's regions.
    #[error(
        "no room for region {region:?}: it needs {needed_bytes} bytes and the server has \
         {free_bytes} bytes free (of {cap_bytes}); an instance needs its log, two catalogs \
         and a header page on every server, plus its segments' homes: give the server \
         more memory (--memory), free some regions, or open with a smaller log_bytes"
    )]
    NoRoom {
        region: String,
        needed_bytes: u64,
        free_bytes: String,
        cap_bytes: String,
    },
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// A commit failed after it may have reached the backend: the in-memory state can no
    /// longer be trusted to match it, so only recovery (a fresh `Rvm::open`) may continue.
    #[error("this Rvm failed earlier and must be reopened with recovery: {0}")]
    Failed(String),
}

pub type Result<T, E = RvmError> = std::result::Result<T, E>;
