//! Camelot's wire format. Pure data in, pure data out: no sockets, no clocks.
//!
//! A connection carries length-prefixed frames: a little-endian `u32` body length, then the
//! body, whose first byte is the frame kind. The client opens with [`Hello`]; the server
//! answers [`HelloOk`] or a [`Frame::Fatal`] and closes. After that the client sends
//! [`Frame::Requests`] and the server answers each with one [`Frame::Responses`] holding one
//! response per request, in request order.
//!
//! Decoding is defensive: every count and length is checked against [`limits`] and against
//! the bytes actually present before anything is allocated.
#![forbid(unsafe_code)]

pub mod budget;
pub mod limits;
mod wire;

pub use wire::{
    FrameDecoder, RequestBatchEncoder, ResponseBatchEncoder, ERROR_RESPONSE_BYTES_MAX,
    HELLO_BODY_BYTES_MAX, ITEM_OVERHEAD_BYTES, REQUESTS_HEADER_BYTES, RESPONSES_HEADER_BYTES,
    RESPONSE_OK_BUDGET_BYTES,
};

use bytes::Bytes;
use std::fmt;

/// The version this build speaks. A server refuses any other at handshake.
/// 2: HELLO names a principal, ALLOC carries an access mode, region infos carry it back,
/// and errors QUOTA_EXCEEDED and FORBIDDEN exist.
/// 3: WRITE_IF (a WRITE guarded by an 8-byte word elsewhere, for fencing writers).
/// 4: SWAP (a WRITE answered with the bytes it replaced) and XOR_INTO (bytes XORed into a
/// span), so a parity update is two requests instead of four.
/// 5: APPLY (a cluster peer's copy of a key at its primary's version).
/// 6: SCAN_PARTITIONS (a mover's scan, filtered by partition and version on the server).
/// 7: fenceable sessions (HELLO's `fence`, HELLO_OK's `fence_generation`), FENCE, and the
/// error FENCED.
/// 8: SCAN_PARTITIONS's `push_to` (the source of a move copies a page to the target
/// itself, so the values cross loopback once instead of twice).
pub const PROTOCOL_VERSION: u16 = 8;
/// First bytes of a HELLO, so a stray client (HTTP, Redis) is told apart at once.
pub const HELLO_MAGIC: [u8; 4] = *b"CMLT";

pub type RegionId = u64;

/// The stable hash of an object key: 64-bit FNV-1a, then MurmurHash3's finaliser,
/// because FNV alone leaves the last bytes' changes in a few bits and keys like `user17`
/// and `user18` differ only there. Clients place keys in partitions by the high bits and
/// servers shard by the low ones, so it must never change between versions.
pub fn key_hash(key: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = key
        .iter()
        .fold(OFFSET_BASIS, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME));
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The partition of `partitions` a key belongs to: the high half of [`key_hash`] (servers
/// shard by the low bits and the two should not be correlated) modulo the count. Clients
/// route by it and cluster servers check ownership by it, so like `key_hash` it must never
/// change. `partitions` of 0 is treated as 1 (everything in partition 0) rather than a
/// division by zero; cluster maps never have 0.
pub fn partition_of(key: &[u8], partitions: u32) -> u32 {
    ((key_hash(key) >> 32) % u64::from(partitions.max(1))) as u32
}

/// Bytes of a SCAN_PARTITIONS mask over `partitions` partitions: a bit each.
pub fn partition_mask_len(partitions: u32) -> usize {
    partitions.div_ceil(8) as usize
}

/// A SCAN_PARTITIONS mask over `partitions` marking `marked` (those out of range ignored).
pub fn partition_mask(partitions: u32, marked: impl IntoIterator<Item = u32>) -> Bytes {
    let mut mask = vec![0u8; partition_mask_len(partitions)];
    for p in marked.into_iter().filter(|p| *p < partitions) {
        mask[(p / 8) as usize] |= 1 << (p % 8);
    }
    Bytes::from(mask)
}

/// Whether `mask` marks partition `p` (a bit beyond the mask is unmarked).
pub fn mask_marks(mask: &[u8], p: u32) -> bool {
    mask.get((p / 8) as usize)
        .is_some_and(|byte| byte & (1 << (p % 8)) != 0)
}

/// One frame, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    HelloOk(HelloOk),
    Requests(RequestBatch),
    Responses(ResponseBatch),
    /// A connection-level error; the sender closes the connection after it.
    Fatal(ErrorReply),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    /// Empty when the client has no token.
    pub token: Bytes,
    /// Who the client says it is: the owner of the regions it allocates. Empty means
    /// [`PRINCIPAL_DEFAULT`]. At most [`limits::PRINCIPAL_BYTES_MAX`] bytes.
    pub principal: String,
    /// `Some`: this connection is a *fenceable session* — one that sends requests whose
    /// meaning depends on all traffic to a word passing through its sender (a proxy's
    /// CAS→WRITE). A [`Op::Fence`] closes every such session, and none of its batches runs
    /// after the fence is answered. `Some(0)` joins at the server's current fence
    /// generation (given back in [`HelloOk::fence_generation`]); `Some(g)` is refused with
    /// [`ErrorCode::Fenced`] unless `g` is still current, so a fenced sender cannot come
    /// back by reconnecting.
    pub fence: Option<u64>,
}

/// The principal of a client that names none.
pub const PRINCIPAL_DEFAULT: &str = "anonymous";

/// Who may use a region besides its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum AccessMode {
    /// Only the owner sees it: to anyone else it does not exist.
    #[default]
    Private = 0,
    /// Any principal that got past the handshake may find, read and write it; only the
    /// owner may free it.
    Shared = 1,
}

impl AccessMode {
    pub fn from_u8(v: u8) -> Option<AccessMode> {
        match v {
            0 => Some(AccessMode::Private),
            1 => Some(AccessMode::Shared),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AccessMode::Private => "private",
            AccessMode::Shared => "shared",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloOk {
    pub version: u16,
    /// The cluster-map epoch the server believes in.
    pub epoch: u64,
    /// The server's fence generation (starts at 1; each [`Op::Fence`] adds one).
    pub fence_generation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestBatch {
    /// Cluster-map epoch the client routed with; 0 means "not checked".
    pub epoch: u64,
    pub requests: Vec<Request>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: u64,
    pub op: Op,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Ping,
    Stats,
    List,
    Alloc {
        size: u64,
        name: Option<String>,
        mode: AccessMode,
    },
    Lookup {
        name: String,
    },
    Free {
        region: RegionId,
    },
    Read {
        region: RegionId,
        offset: u64,
        len: u32,
    },
    Write {
        region: RegionId,
        offset: u64,
        data: Bytes,
    },
    Cas {
        region: RegionId,
        offset: u64,
        expected: u64,
        new: u64,
    },
    FetchAdd {
        region: RegionId,
        offset: u64,
        delta: u64,
    },
    /// Writes `data` at `offset` of `region` only if the little-endian word at
    /// `guard_offset` of `guard_region` (8-byte aligned; it may be `region` itself) equals
    /// `expected`, the check and the write being one atomic step against every CAS,
    /// FETCH_ADD and WRITE of the guard word: [`Reply::Word`], the guard word as found, so
    /// the data was written exactly when it equals `expected`. What fences a writer: a
    /// newer one bumps the guard (an epoch) and every older write fails at the server.
    WriteIf {
        region: RegionId,
        offset: u64,
        guard_region: RegionId,
        guard_offset: u64,
        expected: u64,
        data: Bytes,
    },
    /// Writes `data` at `offset` and answers the bytes it replaced ([`Reply::Data`]), in
    /// one step atomic against every other op on the region. At most
    /// [`limits::IO_BYTES_MAX`] bytes, like READ and WRITE.
    Swap {
        region: RegionId,
        offset: u64,
        data: Bytes,
    },
    /// XORs `data` into the bytes at `offset` ([`Reply::Done`]), in one step atomic against
    /// every other op on the region; two XOR_INTOs commute, so concurrent parity deltas
    /// need no ordering between writers. At most [`limits::IO_BYTES_MAX`] bytes.
    XorInto {
        region: RegionId,
        offset: u64,
        data: Bytes,
    },
    /// The object under `key`: [`Reply::Object`], or NO_SUCH_KEY.
    Get {
        key: Bytes,
    },
    /// Stores `value` under `key` whatever was there: [`Reply::Version`] (the new one).
    Put {
        key: Bytes,
        value: Bytes,
    },
    /// Removes `key`: [`Reply::Version`] (the one removed), or NO_SUCH_KEY.
    Delete {
        key: Bytes,
    },
    /// Stores `value` only if the object's version is `expected_version` (0: only if
    /// there is no object): [`Reply::Version`] (the new one), or VERSION_CONFLICT.
    CasPut {
        key: Bytes,
        expected_version: u64,
        value: Bytes,
    },
    /// Up to `limit` objects with keys `>= start`, in key order: [`Reply::Items`].
    Scan {
        start: Bytes,
        limit: u32,
    },
    /// A cluster mover's SCAN: up to `limit` objects, in an order of the server's own
    /// choosing (`after` names a place in it), that come after `after` (`None`: from the
    /// start), lie in a partition `mask` marks (bit `p % 8`
    /// of byte `p / 8` for partition `p` of `partitions`, as [`partition_of`] computes
    /// it), and whose version is at least `since_version` — without their values when
    /// `keys_only`. The server examines at most [`limits::SCAN_EXAMINE_MAX`] keys per
    /// call, and ends a page once its items pass [`limits::SCAN_PAGE_BYTES_TARGET`] bytes,
    /// so a page may be short or empty and not the last: [`Reply::Page`] says where to go on.
    ///
    /// With `push_to`, the server itself copies the page's objects (APPLY, at the versions
    /// it found) to that node of its cluster map, and answers once the node has applied
    /// them all, with the items' keys and versions only. Refused when the server has no
    /// map or the node is not in it (or is the server itself): a client cannot make a
    /// server connect anywhere else.
    ScanPartitions {
        after: Option<Bytes>,
        limit: u32,
        partitions: u32,
        mask: Bytes,
        since_version: u64,
        keys_only: bool,
        push_to: Option<u32>,
    },
    /// A cluster peer's copy of a key at the version its primary gave it (replication,
    /// partition moves): `Some(value)` stores it, `None` deletes the key. Applied only if
    /// `version` is above the key's current version, so a resent or reordered copy never
    /// overwrites a newer one; the server's version clock moves past `version`, so writes
    /// it takes later (after a promotion) still get larger versions. Answers the key's
    /// version after the call: `version` if applied, the newer one otherwise.
    Apply {
        key: Bytes,
        version: u64,
        value: Option<Bytes>,
    },
    /// Closes every fenceable session (see [`Hello::fence`]) of this server: answered
    /// ([`Reply::Word`], the server's fence generation after it) once no batch of theirs
    /// is running, and none of their batches runs after. What a client sends before it
    /// goes to the server directly, past a proxy that may be dead with requests still in
    /// the server's socket buffers.
    Fence,
}

/// Operation kinds, as counted in STATS and carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum OpKind {
    Ping = 1,
    Stats = 2,
    List = 3,
    Alloc = 4,
    Lookup = 5,
    Free = 6,
    Read = 7,
    Write = 8,
    Cas = 9,
    FetchAdd = 10,
    Get = 11,
    Put = 12,
    Delete = 13,
    CasPut = 14,
    Scan = 15,
    WriteIf = 16,
    Swap = 17,
    XorInto = 18,
    Apply = 19,
    ScanPartitions = 20,
    Fence = 21,
}

impl OpKind {
    pub const ALL: [OpKind; 21] = [
        OpKind::Ping,
        OpKind::Stats,
        OpKind::List,
        OpKind::Alloc,
        OpKind::Lookup,
        OpKind::Free,
        OpKind::Read,
        OpKind::Write,
        OpKind::Cas,
        OpKind::FetchAdd,
        OpKind::Get,
        OpKind::Put,
        OpKind::Delete,
        OpKind::CasPut,
        OpKind::Scan,
        OpKind::WriteIf,
        OpKind::Swap,
        OpKind::XorInto,
        OpKind::Apply,
        OpKind::ScanPartitions,
        OpKind::Fence,
    ];

    pub fn from_u8(v: u8) -> Option<OpKind> {
        OpKind::ALL.iter().copied().find(|k| *k as u8 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Ping => "ping",
            OpKind::Stats => "stats",
            OpKind::List => "list",
            OpKind::Alloc => "alloc",
            OpKind::Lookup => "lookup",
            OpKind::Free => "free",
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Cas => "cas",
            OpKind::FetchAdd => "fetch_add",
            OpKind::Get => "get",
            OpKind::Put => "put",
            OpKind::Delete => "delete",
            OpKind::CasPut => "cas_put",
            OpKind::Scan => "scan",
            OpKind::WriteIf => "write_if",
            OpKind::Swap => "swap",
            OpKind::XorInto => "xor_into",
            OpKind::Apply => "apply",
            OpKind::ScanPartitions => "scan_partitions",
            OpKind::Fence => "fence",
        }
    }
}

impl Op {
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Ping => OpKind::Ping,
            Op::Stats => OpKind::Stats,
            Op::List => OpKind::List,
            Op::Alloc { .. } => OpKind::Alloc,
            Op::Lookup { .. } => OpKind::Lookup,
            Op::Free { .. } => OpKind::Free,
            Op::Read { .. } => OpKind::Read,
            Op::Write { .. } => OpKind::Write,
            Op::Cas { .. } => OpKind::Cas,
            Op::FetchAdd { .. } => OpKind::FetchAdd,
            Op::Get { .. } => OpKind::Get,
            Op::Put { .. } => OpKind::Put,
            Op::Delete { .. } => OpKind::Delete,
            Op::CasPut { .. } => OpKind::CasPut,
            Op::Scan { .. } => OpKind::Scan,
            Op::WriteIf { .. } => OpKind::WriteIf,
            Op::Swap { .. } => OpKind::Swap,
            Op::XorInto { .. } => OpKind::XorInto,
            Op::Apply { .. } => OpKind::Apply,
            Op::ScanPartitions { .. } => OpKind::ScanPartitions,
            Op::Fence => OpKind::Fence,
        }
    }

    /// Bytes this request occupies on the wire (used by batchers to respect
    /// [`limits::FRAME_BYTES_MAX`] before encoding).
    pub fn encoded_len(&self) -> usize {
        wire::request_encoded_len(self)
    }

    /// Payload bytes the request moves: WRITE and PUT data it carries, READ data it asks
    /// for. What a batcher counts against [`limits::FRAME_BYTES_TARGET`]; replies of
    /// unknown size (GET, SCAN) count as nothing here and stay bounded by the hard limits.
    pub fn bulk_len(&self) -> usize {
        match self {
            Op::Write { data, .. } | Op::WriteIf { data, .. } | Op::XorInto { data, .. } => {
                data.len()
            }
            // Its data goes out and as much comes back.
            Op::Swap { data, .. } => 2 * data.len(),
            Op::Read { len, .. } => *len as usize,
            Op::Put { value, .. } | Op::CasPut { value, .. } => value.len(),
            Op::Apply { value, .. } => value.as_ref().map_or(0, |v| v.len()),
            _ => 0,
        }
    }

    /// Upper bound on the bytes the reply to this request occupies on the wire.
    pub fn reply_len_max(&self) -> usize {
        wire::reply_len_max(self)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseBatch {
    pub responses: Vec<Response>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub id: u64,
    pub result: Result<Reply, ErrorReply>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Pong,
    Stats(Vec<(String, u64)>),
    List(Vec<RegionInfo>),
    /// ALLOC and LOOKUP.
    Region(RegionInfo),
    /// FREE, WRITE and XOR_INTO.
    Done,
    /// READ, and SWAP (the bytes replaced).
    Data(Bytes),
    /// CAS and FETCH_ADD: the word's value before the operation. A CAS succeeded
    /// exactly when this equals the expected value.
    Word(u64),
    /// GET.
    Object {
        version: u64,
        value: Bytes,
    },
    /// PUT, CAS_PUT and DELETE.
    Version(u64),
    /// SCAN, in key order.
    Items(Vec<Item>),
    /// SCAN_PARTITIONS.
    Page(Page),
}

/// One page of a SCAN_PARTITIONS walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// The matching objects, in the walk's order (empty values when the scan was keys-only).
    pub items: Vec<Item>,
    /// The last key the server examined: the next page starts after it. `None` when no
    /// key is left.
    pub resume_after: Option<Bytes>,
    /// The version the server's next write will get at least, read as the page was:
    /// a later walk with `since_version` at this value sees every object written since.
    pub version_clock: u64,
    /// Value bytes this page copied to the `push_to` node (0 for a page not pushed): its
    /// items come without their values.
    pub pushed_bytes: u64,
}

/// One object as SCAN returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub key: Bytes,
    pub version: u64,
    pub value: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    pub id: RegionId,
    pub size: u64,
    pub name: Option<String>,
    pub mode: AccessMode,
}

/// A typed error the server reports for one request (or, as [`Frame::Fatal`], for the
/// whole connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
    /// For STALE_EPOCH and MOVED: the epoch of the answering server's cluster map, so the
    /// client knows whether to refresh its own (the server is newer) or wait for the
    /// server to catch up (it is older). 0 for every other code, and not on the wire.
    pub epoch: u64,
}

impl ErrorReply {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > limits::MESSAGE_BYTES_MAX {
            let mut cut = limits::MESSAGE_BYTES_MAX;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        ErrorReply {
            code,
            message,
            epoch: 0,
        }
    }

    /// A STALE_EPOCH or MOVED answer carrying the server's map epoch.
    pub fn with_epoch(code: ErrorCode, message: impl Into<String>, epoch: u64) -> Self {
        ErrorReply {
            epoch: if code.carries_epoch() { epoch } else { 0 },
            ..ErrorReply::new(code, message)
        }
    }
}

impl fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// Error codes. Unknown codes from a newer peer decode as [`ErrorCode::Unknown`] rather
/// than failing the whole frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The request was malformed or named an impossible argument.
    BadRequest,
    /// The server's memory cap would be exceeded.
    OutOfMemory,
    /// The access falls outside the region.
    OutOfBounds,
    /// No region with that id (or it was freed).
    NoSuchRegion,
    /// No region with that name.
    NameNotFound,
    /// A region with that name already exists.
    NameExists,
    /// CAS/FETCH_ADD offset not 8-byte aligned.
    Unaligned,
    /// A size or count limit was exceeded.
    TooLarge,
    /// The batch was routed with another cluster-map epoch than the server's (the error
    /// carries the server's): refresh the map if the server's is newer, else retry later.
    StaleEpoch,
    /// Missing or wrong cluster token.
    AuthFailed,
    /// Protocol version not spoken by this server.
    VersionMismatch,
    /// The server is shutting down and takes no new work.
    ShuttingDown,
    Internal,
    /// No object under that key.
    NoSuchKey,
    /// CAS_PUT's expected version is not the object's.
    VersionConflict,
    /// The key holds a value of another type (a Redis hash or sorted set).
    WrongType,
    /// The principal's quota (bytes or regions) would be exceeded; distinct from
    /// OUT_OF_MEMORY, which is the whole server's cap.
    QuotaExceeded,
    /// The principal may see the region but not do this to it (FREE of a shared region
    /// it does not own).
    Forbidden,
    /// This server does not own the key's partition at the epoch the client routed with
    /// (the error carries the server's epoch): refresh the map and retry elsewhere.
    Moved,
    /// A primary could not get a write onto every backup of its partition in time
    /// (unreachable, refusing, or at another epoch). The write may or may not have taken
    /// effect — it was applied on the primary but not acknowledged: retry it (a CAS_PUT
    /// by re-reading first). Which backups serve is the cluster controller's decision,
    /// never the primary's, so the primary fails the write rather than drop the copy.
    ReplicaUnavailable,
    /// A fenceable session (see [`Hello::fence`]) was closed by a FENCE, or asked to
    /// join at a generation a FENCE has passed.
    Fenced,
    Unknown(u16),
}

impl ErrorCode {
    /// Codes whose error carries the server's map epoch on the wire.
    pub fn carries_epoch(self) -> bool {
        matches!(self, ErrorCode::StaleEpoch | ErrorCode::Moved)
    }

    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 1,
            ErrorCode::OutOfMemory => 2,
            ErrorCode::OutOfBounds => 3,
            ErrorCode::NoSuchRegion => 4,
            ErrorCode::NameNotFound => 5,
            ErrorCode::NameExists => 6,
            ErrorCode::Unaligned => 7,
            ErrorCode::TooLarge => 8,
            ErrorCode::StaleEpoch => 9,
            ErrorCode::AuthFailed => 10,
            ErrorCode::VersionMismatch => 11,
            ErrorCode::ShuttingDown => 12,
            ErrorCode::Internal => 13,
            ErrorCode::NoSuchKey => 14,
            ErrorCode::VersionConflict => 15,
            ErrorCode::WrongType => 16,
            ErrorCode::QuotaExceeded => 17,
            ErrorCode::Forbidden => 18,
            ErrorCode::Moved => 19,
            ErrorCode::ReplicaUnavailable => 20,
            ErrorCode::Fenced => 21,
            ErrorCode::Unknown(c) => c,
        }
    }

    pub fn from_u16(v: u16) -> ErrorCode {
        match v {
            1 => ErrorCode::BadRequest,
            2 => ErrorCode::OutOfMemory,
            3 => ErrorCode::OutOfBounds,
            4 => ErrorCode::NoSuchRegion,
            5 => ErrorCode::NameNotFound,
            6 => ErrorCode::NameExists,
            7 => ErrorCode::Unaligned,
            8 => ErrorCode::TooLarge,
            9 => ErrorCode::StaleEpoch,
            10 => ErrorCode::AuthFailed,
            11 => ErrorCode::VersionMismatch,
            12 => ErrorCode::ShuttingDown,
            13 => ErrorCode::Internal,
            14 => ErrorCode::NoSuchKey,
            15 => ErrorCode::VersionConflict,
            16 => ErrorCode::WrongType,
            17 => ErrorCode::QuotaExceeded,
            18 => ErrorCode::Forbidden,
            19 => ErrorCode::Moved,
            20 => ErrorCode::ReplicaUnavailable,
            21 => ErrorCode::Fenced,
            c => ErrorCode::Unknown(c),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ErrorCode::BadRequest => "BAD_REQUEST",
            ErrorCode::OutOfMemory => "OUT_OF_MEMORY",
            ErrorCode::OutOfBounds => "OUT_OF_BOUNDS",
            ErrorCode::NoSuchRegion => "NO_SUCH_REGION",
            ErrorCode::NameNotFound => "NAME_NOT_FOUND",
            ErrorCode::NameExists => "NAME_EXISTS",
            ErrorCode::Unaligned => "UNALIGNED",
            ErrorCode::TooLarge => "TOO_LARGE",
            ErrorCode::StaleEpoch => "STALE_EPOCH",
            ErrorCode::AuthFailed => "AUTH_FAILED",
            ErrorCode::VersionMismatch => "VERSION_MISMATCH",
            ErrorCode::ShuttingDown => "SHUTTING_DOWN",
            ErrorCode::Internal => "INTERNAL",
            ErrorCode::NoSuchKey => "NO_SUCH_KEY",
            ErrorCode::VersionConflict => "VERSION_CONFLICT",
            ErrorCode::WrongType => "WRONG_TYPE",
            ErrorCode::QuotaExceeded => "QUOTA_EXCEEDED",
            ErrorCode::Forbidden => "FORBIDDEN",
            ErrorCode::Moved => "MOVED",
            ErrorCode::ReplicaUnavailable => "REPLICA_UNAVAILABLE",
            ErrorCode::Fenced => "FENCED",
            ErrorCode::Unknown(c) => return write!(f, "UNKNOWN_ERROR_{c}"),
        };
        f.write_str(s)
    }
}

/// Why a byte sequence is not a valid frame. Any of these means the stream can no longer
/// be trusted; the receiver closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("frame truncated: needed {needed} more bytes")]
    Truncated { needed: usize },
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge { len: usize, max: usize },
    #[error("empty frame")]
    EmptyFrame,
    #[error("unknown frame kind {0}")]
    UnknownFrameKind(u8),
    #[error("unknown operation code {0}")]
    UnknownOp(u8),
    #[error("unknown reply tag {0}")]
    UnknownReply(u8),
    #[error("bad handshake magic")]
    BadMagic,
    #[error("{what} of {value} exceeds the limit of {max}")]
    LimitExceeded {
        what: &'static str,
        value: u64,
        max: u64,
    },
    #[error("{0} is not valid UTF-8")]
    BadUtf8(&'static str),
    #[error("{0} trailing bytes after the frame's content")]
    TrailingBytes(usize),
    #[error("invalid field: {0}")]
    Invalid(&'static str),
}

/// Why a value cannot be encoded (it would break a limit the peer enforces).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("{what} of {value} exceeds the limit of {max}")]
    LimitExceeded {
        what: &'static str,
        value: u64,
        max: u64,
    },
}

pub use wire::{decode_frame, encode_frame};
