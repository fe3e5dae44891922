//! Block volumes across memory servers: RAID-0/1/4/5 and Reed–Solomon k+m over regions
//! on several nodes.
//!
//! Pure modules (no sockets, proptested): `layout` (level, members, which member holds
//! which slot of a stripe), `parity` (XOR, copies and Reed–Solomon over byte ranges),
//! `plan` (one call split into per-stripe pieces) and `superblock` (the metadata codec,
//! a bounded decoder of outside bytes), `nbd_proto` (the NBD protocol's decoders and
//! answers). `volume` puts them over the client's request API; `nbd` exports a volume
//! over NBD.
#![forbid(unsafe_code)]

pub mod layout;
pub mod nbd;
pub mod nbd_proto;
pub mod parity;
pub mod plan;
pub mod superblock;
pub mod volume;

pub use layout::{Layout, Level};
pub use nbd::{NbdConfig, NbdError, NbdServer};
pub use volume::{ScrubReport, Volume, VolumeConfig, VolumeStatus};

use camelot_client::ClientError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum BlocksError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("[{offset}, +{len}) is outside the volume's {capacity} bytes")]
    OutOfBounds {
        offset: u64,
        len: u64,
        capacity: u64,
    },
    #[error("{lost} members lost but the level tolerates {tolerated}: data is unavailable")]
    TooManyLost { lost: usize, tolerated: usize },
    #[error("erasure code: {0}")]
    Codec(String),
    #[error("bad superblock: {0}")]
    BadSuperblock(String),
    #[error("no volume named {0:?} on any reachable member")]
    NotFound(String),
    #[error("member {member}: {source}")]
    Member { member: usize, source: ClientError },
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("nbd: {0}")]
    Nbd(#[from] NbdError),
}
