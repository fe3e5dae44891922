//! The Camelot client: the request API over memory servers.
//!
//! Application threads share one (or a few) connections per node. Each request becomes a
//! [`Pending`]; a per-connection writer coalesces every request queued while the previous
//! frame was being written into one frame, so batching grows with load and costs nothing
//! when idle. Turn it off with [`ClientConfig::batching`] to measure what it buys.
//!
//! ```no_run
//! # use camelot_client::*;
//! let map = ClusterMap::from_addrs(&["127.0.0.1:7000".parse().unwrap()]);
//! let client = Client::connect(map, ClientConfig::default())?;
//! let region = client.alloc(1 << 20, Some("scratch"))?;
//! client.write(&region, 0, &b"hello"[..])?;
//! assert_eq!(&client.read(&region, 0, 5)?[..], b"hello");
//! # Ok::<(), ClientError>(())
//! ```
#![forbid(unsafe_code)]

mod affinity;
mod completion;
mod conn;
mod event_loop;
mod frame;
pub mod kv;
pub mod map;
mod pending;

pub use completion::AnswerHook;
pub use conn::INFLIGHT_REQUESTS_MAX;
pub use event_loop::{LoopClient, LoopPending};
pub use kv::{CasOutcome, ReplicaRead, Versioned};
pub use map::{partition_of, ClusterMap, NodeId, NodeInfo, PartitionTable, PARTITIONS};
pub use pending::Pending;

use bytes::Bytes;
pub use camelot_proto::AccessMode;
use camelot_proto::{ErrorCode, ErrorReply, Op, RegionId, RegionInfo, Reply};
use completion::Completion;
use conn::Conn;
use frame::Submission;
use parking_lot::{Mutex, RwLock};
use std::cell::Cell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use camelot_proto as proto;

/// Requests one connection may have queued (not yet written). Past this, submitting
/// blocks: back-pressure rather than unbounded memory.
pub const QUEUE_REQUESTS_MAX_DEFAULT: usize = 65_536;

#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Cluster token sent at handshake; required when servers have one.
    pub token: Option<Vec<u8>>,
    /// Who this client is to the servers: the owner of the regions it allocates, whose
    /// private regions only it can see, and whose quota they count against. `None`: the
    /// servers' default principal ("anonymous"), shared by every client that names none.
    /// At most [`camelot_proto::limits::PRINCIPAL_BYTES_MAX`] bytes.
    pub principal: Option<String>,
    /// Coalesce queued requests into one frame (default). Off: one request per frame.
    pub batching: bool,
    /// Most requests per frame (≤ the protocol's batch limit).
    pub batch_ops_max: usize,
    /// TCP connections per node; threads are spread over them (a thread always uses
    /// the same one, so its requests stay in order).
    pub connections_per_node: usize,
    pub connect_timeout: Duration,
    /// A request unanswered this long fails, and its connection is closed.
    pub request_timeout: Duration,
    pub queue_requests_max: usize,
    /// Frames in flight below which a submitting thread writes its request itself; at
    /// or above it, requests wait for the next answer frame to carry them out together.
    /// 2 (default) keeps the server busy on one frame while the next is on its way and
    /// batches hardest; more frames ahead trade batch size for fewer waits, which suits
    /// many threads each with one request outstanding (the YCSB driver uses 4; measured
    /// on YCSB C with 16 threads: about 1.5 instead of 1.9 context switches per operation
    /// in the driver-and-server process, and less CPU per operation).
    pub frames_ahead: usize,
    /// Threads pinned to one CPU share connections only with threads pinned to the same
    /// CPU, and a connection's reader thread is pinned where its pinned users are, so
    /// answering them wakes no other CPU (see `affinity.rs`). Unpinned threads are
    /// unaffected. Off: every thread is spread by arrival order, for comparison.
    pub cpu_local: bool,
    /// Makes every connection a *fenceable session* (see [`camelot_proto::Hello::fence`]):
    /// after a [`Client::fence`] at its server, none of its requests still queued there
    /// runs, and it cannot connect there again. For a proxy whose requests are only
    /// right while all traffic passes through it (CAS→WRITE). `None` (default): ordinary
    /// connections.
    pub fence_session: Option<FenceSession>,
    /// `LoopClient` only: copy each reply's bytes (READ, SWAP) out of its answer frame,
    /// so a reply held for long keeps only its own bytes alive, never the whole frame it
    /// came in (up to 64 MiB, shared with other requests' replies). Off (default): replies
    /// are zero-copy slices. A middlebox holding replies for slow peers turns it on.
    pub own_replies: bool,
}

/// The generations a fenceable session joined at, per server, shared by every connection
/// of the clients configured with it: a reconnection presents the generation the first
/// connection got, so a server that has been fenced since refuses it.
#[derive(Debug, Clone, Default)]
pub struct FenceSession {
    generations: Arc<Mutex<Vec<(SocketAddr, u64)>>>,
}

impl FenceSession {
    pub fn new() -> Self {
        Self::default()
    }

    /// What a HELLO to `addr` presents: 0 (join at the current generation) the first
    /// time, the generation joined at after that.
    pub fn generation(&self, addr: SocketAddr) -> u64 {
        self.generations
            .lock()
            .iter()
            .find(|(a, _)| *a == addr)
            .map_or(0, |(_, g)| *g)
    }

    /// Notes the generation `addr` accepted; the first one a server gives is kept.
    pub(crate) fn joined(&self, addr: SocketAddr, generation: u64) {
        let mut generations = self.generations.lock();
        if !generations.iter().any(|(a, _)| *a == addr) {
            generations.push((addr, generation));
        }
    }
}

/// Most frames a client may ask to keep in flight ahead of answers.
pub const FRAMES_AHEAD_MAX: usize = 64;

impl ClientConfig {
    /// The same checks for both client faces, so a setting one refuses the other does
    /// not silently clamp.
    pub(crate) fn validate(&self) -> Result<(), ClientError> {
        let invalid = |what: String| Err(ClientError::InvalidArgument(what));
        if self.frames_ahead == 0 || self.frames_ahead > FRAMES_AHEAD_MAX {
            return invalid(format!("frames_ahead must be 1 to {FRAMES_AHEAD_MAX}"));
        }
        if self.connections_per_node == 0 {
            return invalid("connections_per_node must be at least 1".into());
        }
        if self.batch_ops_max == 0 {
            return invalid("batch_ops_max must be at least 1".into());
        }
        if let Some(p) = &self.principal {
            let max = camelot_proto::limits::PRINCIPAL_BYTES_MAX;
            if p.is_empty() || p.len() > max {
                return invalid(format!("a principal is 1 to {max} bytes"));
            }
        }
        Ok(())
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            token: None,
            principal: None,
            batching: true,
            batch_ops_max: camelot_proto::limits::BATCH_OPS_MAX,
            // Measured on 2 cores, 64 B reads at depth 16: 1 → 4 connections took 16
            // threads from ~530k to ~680k ops/s and 64 threads from ~460k to ~830k,
            // since each connection has its own reader and its own server task.
            connections_per_node: 4,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            queue_requests_max: QUEUE_REQUESTS_MAX_DEFAULT,
            frames_ahead: 2,
            fence_session: None,
            own_replies: false,
            cpu_local: true,
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: Arc<std::io::Error>,
    },
    #[error("{addr} refused the cluster token: {message}")]
    Auth { addr: SocketAddr, message: String },
    #[error("handshake with {addr} failed: {reason}")]
    Handshake { addr: SocketAddr, reason: String },
    #[error("I/O error talking to {addr}: {source}")]
    Io {
        addr: SocketAddr,
        source: Arc<std::io::Error>,
    },
    #[error("protocol error from {addr}: {reason}")]
    Protocol { addr: SocketAddr, reason: String },
    #[error("no answer within {after:?}")]
    Timeout { after: Duration },
    #[error("connection to {addr} lost")]
    ConnectionLost { addr: SocketAddr },
    /// The server answered this request with an error; the connection goes on.
    #[error("server error {0}")]
    Server(ErrorReply),
    /// The server ended the connection with a FATAL frame (a fence, a shutdown, an
    /// eviction, a buffer budget): every request in flight on it gets this, applied or
    /// not, like a lost connection — unlike [`ClientError::Server`], which says the
    /// request was executed and refused on its own.
    #[error("server {addr} ended the connection: {reply}")]
    Fatal { addr: SocketAddr, reply: ErrorReply },
    #[error("node {0} is not in the cluster map")]
    UnknownNode(NodeId),
    #[error("the cluster map has no nodes")]
    EmptyMap,
    #[error("unexpected reply {got} to a {expected} request")]
    UnexpectedReply { expected: &'static str, got: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("this answer was already taken")]
    AlreadyTaken,
    /// The submitting future was dropped before its request was queued; it may not
    /// have been sent (told to an [`AnswerHook`], whose caller cannot otherwise know).
    #[error("the submit was dropped before its request was queued")]
    Cancelled,
    #[error("cannot fetch the cluster map: {0}")]
    MapSource(String),
}

impl ClientError {
    /// The server's error code, when the server answered with an error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server(e) | ClientError::Fatal { reply: e, .. } => Some(e.code),
            _ => None,
        }
    }

    /// The server this error came from, when the error names one; a caller that spoke
    /// to several uses it to blame the right one.
    pub fn addr(&self) -> Option<SocketAddr> {
        match self {
            ClientError::Connect { addr, .. }
            | ClientError::Auth { addr, .. }
            | ClientError::Handshake { addr, .. }
            | ClientError::Io { addr, .. }
            | ClientError::Protocol { addr, .. }
            | ClientError::ConnectionLost { addr }
            | ClientError::Fatal { addr, .. } => Some(*addr),
            _ => None,
        }
    }
}

/// A region on one node: what ALLOC or LOOKUP returned, plus where it lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub node: NodeId,
    pub id: RegionId,
    pub size: u64,
    pub name: Option<String>,
    pub mode: AccessMode,
}

impl Region {
    fn from_info(node: NodeId, r: RegionInfo) -> Region {
        Region {
            node,
            id: r.id,
            size: r.size,
            name: r.name,
            mode: r.mode,
        }
    }

    pub fn read_op(&self, offset: u64, len: u32) -> Op {
        Op::Read {
            region: self.id,
            offset,
            len,
        }
    }

    pub fn write_op(&self, offset: u64, data: Bytes) -> Op {
        Op::Write {
            region: self.id,
            offset,
            data,
        }
    }

    /// Writes `data` and is answered with the bytes it replaced ([`reply::data`]), both in
    /// one step at the server.
    pub fn swap_op(&self, offset: u64, data: Bytes) -> Op {
        Op::Swap {
            region: self.id,
            offset,
            data,
        }
    }

    /// XORs `data` into the bytes at `offset`, atomically at the server ([`reply::done`]).
    pub fn xor_into_op(&self, offset: u64, data: Bytes) -> Op {
        Op::XorInto {
            region: self.id,
            offset,
            data,
        }
    }

    /// A WRITE that lands only if the word at `guard_offset` of `guard` still equals
    /// `expected` (checked by the server atomically with the write); answered with the
    /// guard word as found ([`reply::word`]).
    pub fn write_if_op(
        &self,
        offset: u64,
        data: Bytes,
        guard: &Region,
        guard_offset: u64,
        expected: u64,
    ) -> Op {
        Op::WriteIf {
            region: self.id,
            offset,
            guard_region: guard.id,
            guard_offset,
            expected,
            data,
        }
    }

    pub fn cas_op(&self, offset: u64, expected: u64, new: u64) -> Op {
        Op::Cas {
            region: self.id,
            offset,
            expected,
            new,
        }
    }

    pub fn fetch_add_op(&self, offset: u64, delta: u64) -> Op {
        Op::FetchAdd {
            region: self.id,
            offset,
            delta,
        }
    }
}

/// Typed views of a [`Reply`].
pub mod reply {
    use super::*;

    fn unexpected(expected: &'static str, got: Reply) -> ClientError {
        let got = match got {
            Reply::Data(d) => format!("Data({} bytes)", d.len()),
            other => format!("{other:?}"),
        };
        ClientError::UnexpectedReply { expected, got }
    }

    pub fn data(r: Result<Reply, ClientError>) -> Result<Bytes, ClientError> {
        match r? {
            Reply::Data(d) => Ok(d),
            other => Err(unexpected("read", other)),
        }
    }

    pub fn done(r: Result<Reply, ClientError>) -> Result<(), ClientError> {
        match r? {
            Reply::Done => Ok(()),
            other => Err(unexpected("write/free", other)),
        }
    }

    pub fn word(r: Result<Reply, ClientError>) -> Result<u64, ClientError> {
        match r? {
            Reply::Word(w) => Ok(w),
            other => Err(unexpected("cas/fetch_add", other)),
        }
    }

    pub fn object(r: Result<Reply, ClientError>) -> Result<crate::kv::Versioned, ClientError> {
        match r? {
            Reply::Object { version, value } => Ok(crate::kv::Versioned { version, value }),
            other => Err(unexpected("get", other)),
        }
    }

    pub fn version(r: Result<Reply, ClientError>) -> Result<u64, ClientError> {
        match r? {
            Reply::Version(v) => Ok(v),
            other => Err(unexpected("put/cas_put/delete", other)),
        }
    }

    pub fn items(r: Result<Reply, ClientError>) -> Result<Vec<camelot_proto::Item>, ClientError> {
        match r? {
            Reply::Items(items) => Ok(items),
            other => Err(unexpected("scan", other)),
        }
    }

    pub fn page(r: Result<Reply, ClientError>) -> Result<camelot_proto::Page, ClientError> {
        match r? {
            Reply::Page(page) => Ok(page),
            other => Err(unexpected("scan_partitions", other)),
        }
    }

    pub fn region(node: NodeId, r: Result<Reply, ClientError>) -> Result<Region, ClientError> {
        match r? {
            Reply::Region(info) => Ok(Region::from_info(node, info)),
            other => Err(unexpected("alloc/lookup", other)),
        }
    }
}

struct Node {
    addr: SocketAddr,
    slots: Vec<Mutex<Option<Arc<Conn>>>>,
}

struct Inner {
    config: ClientConfig,
    cpus: affinity::CpuClasses,
    /// `cpu_local` is on and no connection serves two CPUs: a pinned thread's connection
    /// may pin its reader to that thread's CPU. Fixed for the client's life.
    readers_follow: bool,
    map: RwLock<Routing>,
    /// The map's epoch, read by every connection's writer as it encodes a frame.
    epoch: Arc<AtomicU64>,
    /// Where a newer map comes from when a server answers MOVED or STALE_EPOCH.
    source: RwLock<Option<Arc<dyn MapSource>>>,
    /// Requests answered MOVED or STALE_EPOCH and sent again.
    redirects: AtomicU64,
    nodes: RwLock<HashMap<NodeId, Arc<Node>>>,
    next_id: AtomicU64,
    next_alloc: AtomicUsize,
}

/// The map and, for a cluster map, its partition table: swapped together so no reader
/// pairs one map's nodes with another's placement.
#[derive(Clone)]
struct Routing {
    map: Arc<ClusterMap>,
    table: Option<Arc<PartitionTable>>,
}

/// Where the client gets the current cluster map when a server says its own is newer
/// (the cluster crate implements it over etcd). Called from the thread whose request was
/// redirected, so it must be safe to block in; it should bound its own wait.
pub trait MapSource: Send + Sync {
    fn fetch(&self) -> Result<(ClusterMap, PartitionTable), String>;
}

/// A handle to the cluster; cheap to clone and share across threads.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

thread_local! {
    // Which connection a thread uses is decided once, at its first request, so its
    // requests stay in order and the hot path asks the OS nothing.
    static THREAD_PLACE: Cell<Option<affinity::ThreadPlace>> = const { Cell::new(None) };
}

fn thread_place() -> affinity::ThreadPlace {
    THREAD_PLACE.with(|p| match p.get() {
        Some(place) => place,
        None => {
            let place = affinity::place_current_thread();
            p.set(Some(place));
            place
        }
    })
}

impl Client {
    /// Connects to every node of the map (so a wrong token or a dead node is reported now,
    /// not at the first request).
    pub fn connect(map: ClusterMap, config: ClientConfig) -> Result<Client, ClientError> {
        config.validate()?;
        let cpus = affinity::CpuClasses::of_this_machine();
        let readers_follow =
            config.cpu_local && affinity::reader_may_follow(config.connections_per_node, &cpus);
        let client = Client {
            inner: Arc::new(Inner {
                config,
                cpus,
                readers_follow,
                map: RwLock::new(Routing {
                    map: Arc::new(ClusterMap {
                        epoch: 0,
                        nodes: vec![],
                    }),
                    table: None,
                }),
                epoch: Arc::new(AtomicU64::new(0)),
                source: RwLock::new(None),
                redirects: AtomicU64::new(0),
                nodes: RwLock::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                next_alloc: AtomicUsize::new(0),
            }),
        };
        client.set_map(map);
        for id in client.map().node_ids().collect::<Vec<_>>() {
            client.conn(id)?;
        }
        Ok(client)
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    pub fn map(&self) -> Arc<ClusterMap> {
        self.inner.map.read().map.clone()
    }

    /// The partition table of the installed cluster map (`None` for a static map).
    pub fn partition_table(&self) -> Option<Arc<PartitionTable>> {
        self.inner.map.read().table.clone()
    }

    /// The epoch requests are routed with (0: a static map, never checked by servers).
    pub fn epoch(&self) -> u64 {
        self.inner.epoch.load(Ordering::Acquire)
    }

    /// Requests that were answered MOVED or STALE_EPOCH and sent again.
    pub fn redirects(&self) -> u64 {
        self.inner.redirects.load(Ordering::Relaxed)
    }

    /// Swaps the cluster map for a static one (keys placed by rendezvous hashing).
    /// Connections to nodes whose address is unchanged are kept; requests already in
    /// flight finish on their old connections.
    pub fn set_map(&self, map: ClusterMap) {
        self.install(map, None);
    }

    /// Installs a cluster map: keys go to their partition's primary in `table`, and
    /// requests carry `map.epoch` so servers can answer MOVED or STALE_EPOCH. A map not
    /// newer than the installed cluster map is ignored (false), so a slow refresh never
    /// rolls a newer map back. Every node `table` names must be in `map`.
    pub fn set_cluster(&self, map: ClusterMap, table: PartitionTable) -> Result<bool, ClientError> {
        if let Some(missing) = table.primaries().iter().find(|id| map.node(**id).is_none()) {
            return Err(ClientError::UnknownNode(*missing));
        }
        if map.epoch == 0 {
            return Err(ClientError::InvalidArgument(
                "a cluster map's epoch is at least 1 (0 means a static map)".into(),
            ));
        }
        {
            let current = self.inner.map.read();
            if current.table.is_some() && map.epoch <= current.map.epoch {
                return Ok(false);
            }
        }
        self.install(map, Some(Arc::new(table)));
        Ok(true)
    }

    /// Where to fetch a newer map when a server's is newer than ours.
    pub fn set_map_source(&self, source: Arc<dyn MapSource>) {
        *self.inner.source.write() = Some(source);
    }

    /// Fetches the source's map and installs it if it is newer; whether it was.
    pub fn refresh_map(&self) -> Result<bool, ClientError> {
        let Some(source) = self.inner.source.read().clone() else {
            return Ok(false);
        };
        let (map, table) = source.fetch().map_err(ClientError::MapSource)?;
        self.set_cluster(map, table)
    }

    fn install(&self, map: ClusterMap, table: Option<Arc<PartitionTable>>) {
        let mut nodes = self.inner.nodes.write();
        let mut next = HashMap::new();
        for n in &map.nodes {
            let node = match nodes.remove(&n.id) {
                Some(old) if old.addr == n.addr => old,
                _ => Arc::new(Node {
                    addr: n.addr,
                    slots: (0..self.inner.config.connections_per_node)
                        .map(|_| Mutex::new(None))
                        .collect(),
                }),
            };
            next.insert(n.id, node);
        }
        *nodes = next;
        let epoch = map.epoch;
        let mut routing = self.inner.map.write();
        *routing = Routing {
            map: Arc::new(map),
            table,
        };
        // Under the routing lock, so the epoch frames carry never belongs to another map
        // than the one requests were just routed with... as far as a writer that reads it
        // later can tell: a request routed before a swap may leave in a frame carrying the
        // new epoch, and then the server's ownership check (MOVED) catches it.
        self.inner.epoch.store(epoch, Ordering::Release);
    }

    /// A live connection to `node` for this thread, reconnecting if the last one died.
    fn conn(&self, node: NodeId) -> Result<Arc<Conn>, ClientError> {
        let n = self
            .inner
            .nodes
            .read()
            .get(&node)
            .cloned()
            .ok_or(ClientError::UnknownNode(node))?;
        let place = thread_place();
        let config = &self.inner.config;
        let index =
            affinity::connection_index(place, n.slots.len(), &self.inner.cpus, config.cpu_local);
        let mut guard = n.slots[index].lock();
        let conn = match guard.as_ref() {
            Some(c) if !c.is_dead() => c.clone(),
            _ => {
                let (conn, _server_epoch) =
                    Conn::connect(n.addr, config, self.inner.epoch.clone())?;
                let conn = Arc::new(conn);
                *guard = Some(conn.clone());
                conn
            }
        };
        drop(guard);
        if let Some(p) = place.pinned.filter(|_| self.inner.readers_follow) {
            conn.shared().prefer_reader_cpu(p.cpu);
        }
        Ok(conn)
    }

    /// Sends one request to `node` and returns at once; wait on or await the result.
    pub fn submit(&self, node: NodeId, op: Op) -> Result<Pending, ClientError> {
        let conn = self.conn(node)?;
        let slot = Completion::new();
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        conn.submit(Submission {
            id,
            op,
            slot: slot.clone(),
        })?;
        Ok(self.pending(slot, &conn))
    }

    fn pending(&self, slot: Arc<Completion>, conn: &Conn) -> Pending {
        Pending {
            slot,
            conn: conn.shared().clone(),
            // The connection's watchdog answers a late request with Timeout; this margin
            // only matters if the writer itself is stuck.
            timeout: self.inner.config.request_timeout * 2 + Duration::from_secs(1),
        }
    }

    /// Sends several requests at once and returns their answers' slots in the same order.
    /// Requests for one node are queued together and leave in as few frames as the limits
    /// allow, so a thread refilling its window pays one write (and later one wake-up) for
    /// the lot rather than one per request.
    pub fn submit_many(
        &self,
        ops: impl IntoIterator<Item = (NodeId, Op)>,
    ) -> Result<Vec<Pending>, ClientError> {
        let mut pendings = Vec::new();
        // Few nodes per burst in practice: a short list beats a map.
        let mut per_conn: Vec<(NodeId, Arc<Conn>, Vec<Submission>)> = Vec::new();
        for (node, op) in ops {
            let at = match per_conn.iter().position(|(n, _, _)| *n == node) {
                Some(i) => i,
                None => {
                    per_conn.push((node, self.conn(node)?, Vec::new()));
                    per_conn.len() - 1
                }
            };
            let (_, conn, subs) = &mut per_conn[at];
            let slot = Completion::new();
            subs.push(Submission {
                id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
                op,
                slot: slot.clone(),
            });
            pendings.push(self.pending(slot, conn));
        }
        for (_, conn, subs) in per_conn {
            conn.submit_many(subs)?;
        }
        Ok(pendings)
    }

    /// Sends one request and blocks for its answer.
    pub fn call(&self, node: NodeId, op: Op) -> Result<Reply, ClientError> {
        self.submit(node, op)?.wait()
    }

    /// Allocates a private region (only this client's principal can see it) on the node
    /// the map picks: by name when named (so a restarted client with the same principal
    /// finds it with [`Client::lookup`]), round-robin otherwise.
    pub fn alloc(&self, size: u64, name: Option<&str>) -> Result<Region, ClientError> {
        self.alloc_with(size, name, AccessMode::Private)
    }

    /// [`Client::alloc`] with an access mode: [`AccessMode::Shared`] lets every principal
    /// find, read and write the region (only its owner may free it).
    pub fn alloc_with(
        &self,
        size: u64,
        name: Option<&str>,
        mode: AccessMode,
    ) -> Result<Region, ClientError> {
        let map = self.map();
        let node = match name {
            Some(n) => map.node_for_name(n).ok_or(ClientError::EmptyMap)?,
            None => {
                if map.nodes.is_empty() {
                    return Err(ClientError::EmptyMap);
                }
                let i = self.inner.next_alloc.fetch_add(1, Ordering::Relaxed);
                map.nodes[i % map.nodes.len()].id
            }
        };
        self.alloc_on_with(node, size, name, mode)
    }

    /// A private region on `node`.
    pub fn alloc_on(
        &self,
        node: NodeId,
        size: u64,
        name: Option<&str>,
    ) -> Result<Region, ClientError> {
        self.alloc_on_with(node, size, name, AccessMode::Private)
    }

    pub fn alloc_on_with(
        &self,
        node: NodeId,
        size: u64,
        name: Option<&str>,
        mode: AccessMode,
    ) -> Result<Region, ClientError> {
        if name == Some("") {
            return Err(ClientError::InvalidArgument(
                "a region name may not be empty".into(),
            ));
        }
        let op = Op::Alloc {
            size,
            name: name.map(str::to_owned),
            mode,
        };
        reply::region(node, self.call(node, op))
    }

    /// Finds a named region: first on the node the map places the name on, then on every
    /// other node (the map may have changed since it was allocated).
    pub fn lookup(&self, name: &str) -> Result<Region, ClientError> {
        let map = self.map();
        let home = map.node_for_name(name).ok_or(ClientError::EmptyMap)?;
        let order = std::iter::once(home).chain(map.node_ids().filter(|n| *n != home));
        let mut last = None;
        for node in order {
            let op = Op::Lookup {
                name: name.to_owned(),
            };
            match reply::region(node, self.call(node, op)) {
                Ok(r) => return Ok(r),
                Err(e) if e.code() == Some(ErrorCode::NameNotFound) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(ClientError::EmptyMap))
    }

    pub fn free(&self, region: &Region) -> Result<(), ClientError> {
        reply::done(self.call(region.node, Op::Free { region: region.id }))
    }

    pub fn list(&self, node: NodeId) -> Result<Vec<Region>, ClientError> {
        match self.call(node, Op::List)? {
            Reply::List(rs) => Ok(rs.into_iter().map(|r| Region::from_info(node, r)).collect()),
            other => Err(ClientError::UnexpectedReply {
                expected: "list",
                got: format!("{other:?}"),
            }),
        }
    }

    pub fn read(&self, region: &Region, offset: u64, len: u32) -> Result<Bytes, ClientError> {
        reply::data(self.call(region.node, region.read_op(offset, len)))
    }

    pub fn write(
        &self,
        region: &Region,
        offset: u64,
        data: impl Into<Bytes>,
    ) -> Result<(), ClientError> {
        reply::done(self.call(region.node, region.write_op(offset, data.into())))
    }

    /// Compare-and-swap on an 8-byte aligned little-endian word. Returns the value before;
    /// the swap happened exactly when that equals `expected`.
    pub fn cas(
        &self,
        region: &Region,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> Result<u64, ClientError> {
        reply::word(self.call(region.node, region.cas_op(offset, expected, new)))
    }

    /// Atomically adds (wrapping) to an 8-byte aligned word; returns the value before.
    pub fn fetch_add(&self, region: &Region, offset: u64, delta: u64) -> Result<u64, ClientError> {
        reply::word(self.call(region.node, region.fetch_add_op(offset, delta)))
    }

    /// Round-trip time of one PING.
    pub fn ping(&self, node: NodeId) -> Result<Duration, ClientError> {
        let t = Instant::now();
        match self.call(node, Op::Ping)? {
            Reply::Pong => Ok(t.elapsed()),
            other => Err(ClientError::UnexpectedReply {
                expected: "ping",
                got: format!("{other:?}"),
            }),
        }
    }

    /// Fences every node of the map (see [`camelot_proto::Op::Fence`]): once this returns,
    /// no request of a fenceable session (a proxy's upstream connection) runs on any of
    /// them again, even one still queued in a server's socket when its proxy died. What
    /// a client does before it goes to the servers directly. Returns each node's fence
    /// generation after it.
    pub fn fence(&self) -> Result<Vec<(NodeId, u64)>, ClientError> {
        let map = self.map();
        map.node_ids()
            .map(|node| match self.call(node, Op::Fence)? {
                Reply::Word(generation) => Ok((node, generation)),
                other => Err(ClientError::UnexpectedReply {
                    expected: "fence",
                    got: format!("{other:?}"),
                }),
            })
            .collect()
    }

    pub fn stats(&self, node: NodeId) -> Result<Vec<(String, u64)>, ClientError> {
        match self.call(node, Op::Stats)? {
            Reply::Stats(s) => Ok(s),
            other => Err(ClientError::UnexpectedReply {
                expected: "stats",
                got: format!("{other:?}"),
            }),
        }
    }

    // The async face: same operations, awaiting instead of blocking. Submitting may block
    // briefly when the connection's queue is full or a reconnect is needed.

    pub async fn read_async(
        &self,
        region: &Region,
        offset: u64,
        len: u32,
    ) -> Result<Bytes, ClientError> {
        reply::data(self.submit(region.node, region.read_op(offset, len))?.await)
    }

    pub async fn write_async(
        &self,
        region: &Region,
        offset: u64,
        data: impl Into<Bytes>,
    ) -> Result<(), ClientError> {
        reply::done(
            self.submit(region.node, region.write_op(offset, data.into()))?
                .await,
        )
    }

    pub async fn cas_async(
        &self,
        region: &Region,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> Result<u64, ClientError> {
        reply::word(
            self.submit(region.node, region.cas_op(offset, expected, new))?
                .await,
        )
    }

    pub async fn fetch_add_async(
        &self,
        region: &Region,
        offset: u64,
        delta: u64,
    ) -> Result<u64, ClientError> {
        reply::word(
            self.submit(region.node, region.fetch_add_op(offset, delta))?
                .await,
        )
    }

    pub async fn call_async(&self, node: NodeId, op: Op) -> Result<Reply, ClientError> {
        self.submit(node, op)?.await
    }
}
