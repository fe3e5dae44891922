//! `camelot-proxy`: a middlebox between clients and one memory server, speaking the
//! native protocol on both sides (after SwordBox, which sits in front of Clover).
//!
//! - Pass-through (no flags): each client connection gets its own upstream connection.
//! - Connection mapping (`conn_map`): every client connection's requests ride N shared
//!   upstream connections, chosen by region, so all requests to one region leave in one
//!   order.
//! - CAS→WRITE (`cas_to_write`, needs mapping): with that order, the proxy knows the value
//!   of words it has seen written; a CAS it can vouch for becomes a WRITE (or, if it would
//!   fail, is answered at once). See `words`.
//! - Write cache (`write_cache`, needs mapping): per Clover key, the tail a writer must
//!   CAS; a writer's CAS aimed at an older tail is re-aimed at the real one by the proxy,
//!   so it wins at the first try. See `tails`.
//! - Read cache (`read_cache`, needs mapping): a READ of an old version of a Clover key
//!   whose newer tail the proxy knows goes to that tail instead (the reader skips its
//!   walk; see `tails`), and READ answers are kept and answered again while nothing
//!   changed their bytes (see `cache`).
//! - `memory_bytes`: the budget for what the proxy knows, split over the lanes (and a
//!   quarter for the chain table that both Clover caches use, when either is on).
//!
//! The proxy authenticates its clients with the cluster token before it allocates
//! anything for them (as the server's handshake does) and answers STATS with its own
//! counters. It acts towards the server as one principal of its own, so through it
//! clients reach shared regions, not each other's private ones.
//!
//! Answers from what the proxy knows (a CAS failed on a known word, a cached READ) wait
//! until every mutation sent before them on their lane is applied at the server
//! (`Lane::once_applied`): what the proxy knows includes writes it decided and sent that
//! a crash could still lose, and no client may see one of those before the server has it.
//! Likewise a link made by CAS→WRITE becomes the key's known tail only once applied.
//!
//! Fail-stop: with `cas_to_write` or `read_cache`, an upstream connection that fails
//! leaves the proxy unsure what its in-flight writes did, so it answers nothing more and
//! `serve` returns [`ProxyError::FailStop`] (the binary then exits); clients go to the
//! server directly. That holds for a connection that ends with nothing in flight too
//! (`LoopClient::connection_lost`): its server may have been killed and restarted
//! empty on its port, and the next request would reach the new one while the word
//! table and the read cache still describe the old one's bytes.
//!
//! Falling back: with `cas_to_write` the upstream connections are fenceable sessions
//! (`ClientConfig::fence_session`). A client that gives up on the proxy calls
//! `Client::fence` on the servers before its first direct request: a dead proxy's
//! converted WRITEs may still sit in a server's socket buffer, and run after a direct
//! CAS on the same word would break linearizability; after the fence none of them runs,
//! and a live proxy that was fenced stops (its lanes cannot reconnect).
#![forbid(unsafe_code)]

mod cache;
mod tails;
mod words;

use bytes::{Bytes, BytesMut};
use cache::ReadCache;
use camelot_client::{
    AnswerHook, ClientConfig, ClientError, ClusterMap, FenceSession, LoopClient, LoopPending,
};
use camelot_proto::budget::{MemoryBudget, OverBudget, Reservation};
use camelot_proto::limits::FRAME_BYTES_MAX;
use camelot_proto::{
    decode_frame, encode_frame, ErrorCode, ErrorReply, Frame, FrameDecoder, HelloOk, Op, Reply,
    ResponseBatchEncoder, ERROR_RESPONSE_BYTES_MAX, HELLO_BODY_BYTES_MAX, PROTOCOL_VERSION,
    RESPONSES_HEADER_BYTES, RESPONSE_OK_BUDGET_BYTES,
};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tails::{ChainCache, Redirect, Tail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Mutex, Notify};
use words::{CasDecision, Words};

/// Client connections served at once; more are closed at accept.
pub const CONNECTIONS_MAX: usize = 1024;
/// Of those, connections that have not passed their HELLO yet. One more takes the place
/// of the oldest (closed at once), so sockets that never say HELLO hold at most this
/// many slots, never lock a client out until they time out, and leave the rest to
/// authenticated clients.
pub const UNAUTHENTICATED_CONNECTIONS_MAX: usize = 64;
/// What one frame's answer is charged at most, length prefix included: the frame's
/// budget for successful replies and an error's room for every other request stay under
/// the frame limit (see [`ReplyPlan`]; proptested).
pub const FRAME_REPLY_BYTES_MAX: u64 = FRAME_BYTES_MAX as u64 - 4;
/// Bytes the proxy holds for its clients' frames unless configured otherwise: each frame
/// from when its length prefix is read until its answer is written, with room for that
/// answer (the replies gathered from upstream).
pub const CONNECTION_MEMORY_BYTES_DEFAULT: u64 = 256 << 20;
/// How long a client may take over a frame it announced or an answer, unless configured
/// otherwise (`ProxyConfig::client_timeout`).
pub const CLIENT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);
/// The least such budget: one frame of the largest size and its largest answer, so any
/// frame a client may send can be served when nothing else is held.
pub const CONNECTION_MEMORY_BYTES_MIN: u64 = FRAME_BYTES_MAX as u64 + 4 + FRAME_REPLY_BYTES_MAX;
/// Most upstream connections connection mapping may ask for.
pub const CONN_MAP_MAX: usize = 256;
/// Request frames a client may have in flight through the proxy before it stops reading
/// that client (back-pressure).
pub const FRAMES_IN_FLIGHT_MAX: usize = 16;
/// Time a client has to send its HELLO.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The least a lane's read cache share may be (its smallest slot table and an entry).
pub const READ_CACHE_BYTES_MIN: u64 = cache::CACHE_BYTES_MIN;
/// A lane of a proxy that answers from what it knows sends a PING this often: a server
/// gone without a word (its host down, the path cut) then fails the PING within the
/// upstream timeout, which ends the lane's connection and stops the proxy; and a server's
/// `--idle-timeout` never closes a quiet lane (that too would stop the proxy).
pub const LANE_KEEPALIVE: Duration = Duration::from_secs(1);
const READ_CHUNK_BYTES: usize = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("invalid proxy configuration: {0}")]
    InvalidConfig(String),
    #[error("cannot reach the upstream server {addr}: {source}")]
    Upstream {
        addr: SocketAddr,
        #[source]
        source: ClientError,
    },
    #[error("cannot listen: {0}")]
    Listen(#[source] std::io::Error),
    /// With CAS→WRITE or the read cache on, an upstream connection ended or a lane's
    /// mutation may not have reached the server: nothing the proxy knows can be trusted
    /// any more.
    #[error("stopped (fail-stop): {0}")]
    FailStop(String),
}

/// What the proxy does; every technique off is plain pass-through.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub upstream: SocketAddr,
    /// Clients must present it, and the proxy presents it upstream.
    pub token: Option<Vec<u8>>,
    /// Carry every client's requests on N shared upstream connections, by region.
    pub conn_map: Option<usize>,
    pub cas_to_write: bool,
    pub read_cache: bool,
    /// Re-aim Clover writers' CASes at the tail the proxy knows.
    pub write_cache: bool,
    /// Test-only: the write cache trusts its tail and answers a re-aimed CAS as won
    /// whatever the server said (a deliberately broken proxy, to show the checks fail).
    pub write_cache_fault: bool,
    /// One budget for what the proxy remembers, over all lanes.
    pub memory_bytes: u64,
    /// How long an upstream request may take before its connection is given up.
    pub upstream_timeout: Duration,
    /// Bytes all clients' frames in flight may hold together, answers included (see
    /// [`CONNECTION_MEMORY_BYTES_DEFAULT`]); a client whose frame finds it full waits
    /// (it is not read meanwhile) up to `client_timeout`, then is told OUT_OF_MEMORY and
    /// closed.
    pub connection_memory_bytes: u64,
    /// How long a client may take to send a frame whose length it announced, or to take
    /// an answer: past it the connection is closed and what it held let go, so a client
    /// that stops reading (or sending) cannot keep the connection memory.
    pub client_timeout: Duration,
}

impl ProxyConfig {
    pub fn validate(&self) -> Result<(), ProxyError> {
        if (self.cas_to_write || self.read_cache || self.write_cache) && self.conn_map.is_none() {
            return Err(ProxyError::InvalidConfig(
                "--cas-to-write, --read-cache and --write-cache need --conn-map: only mapped connections keep a region's requests in one order".into(),
            ));
        }
        if (self.write_cache || self.read_cache)
            && ChainCache::new(self.chain_cache_bytes()).is_none()
        {
            return Err(ProxyError::InvalidConfig(format!(
                "--memory leaves the chain table {} bytes, not room for two nodes and a tail",
                self.chain_cache_bytes()
            )));
        }
        if let Some(n) = self.conn_map {
            if n == 0 || n > CONN_MAP_MAX {
                return Err(ProxyError::InvalidConfig(format!(
                    "--conn-map takes 1 to {CONN_MAP_MAX} connections"
                )));
            }
        }
        if self.connection_memory_bytes < CONNECTION_MEMORY_BYTES_MIN {
            return Err(ProxyError::InvalidConfig(format!(
                "--connection-memory must be at least {CONNECTION_MEMORY_BYTES_MIN} bytes \
                 (the largest frame and its answer)"
            )));
        }
        if self.upstream_timeout.is_zero() {
            return Err(ProxyError::InvalidConfig(
                "the upstream timeout must be above 0".into(),
            ));
        }
        if self.client_timeout.is_zero() {
            return Err(ProxyError::InvalidConfig(
                "the client timeout must be above 0".into(),
            ));
        }
        if let Some((_, Some(cache_bytes))) = self.lane_budget() {
            if cache_bytes < READ_CACHE_BYTES_MIN {
                return Err(ProxyError::InvalidConfig(format!(
                    "--memory leaves each lane's read cache {cache_bytes} bytes, less than its {READ_CACHE_BYTES_MIN}-byte floor"
                )));
            }
        }
        Ok(())
    }

    /// The chain table's share of the budget (for the write cache and the read cache's
    /// redirects): a quarter, none when both are off.
    fn chain_cache_bytes(&self) -> u64 {
        if self.write_cache || self.read_cache {
            self.memory_bytes / 4
        } else {
            0
        }
    }

    /// Each lane's (word table, read cache) bytes, with mapping on.
    fn lane_budget(&self) -> Option<(u64, Option<u64>)> {
        let n = self.conn_map? as u64;
        // One budget: each lane a share; within a lane, with both on, the read cache
        // takes three quarters (it holds bytes, the word table only words).
        let per_lane = (self.memory_bytes - self.chain_cache_bytes()) / n.max(1);
        Some(match (self.cas_to_write, self.read_cache) {
            (true, true) => (per_lane / 4, Some(per_lane - per_lane / 4)),
            (false, true) => (0, Some(per_lane)),
            _ => (per_lane, None),
        })
    }
}

/// A proxy connected to its upstream, ready to serve clients.
pub struct ProxyServer {
    proxy: Arc<Proxy>,
}

impl ProxyServer {
    /// Checks the configuration and opens the mapped upstream connections.
    pub async fn connect(config: ProxyConfig) -> Result<ProxyServer, ProxyError> {
        config.validate()?;
        let upstream_config = ClientConfig {
            token: config.token.clone(),
            connections_per_node: 1,
            request_timeout: config.upstream_timeout,
            // A WRITE made of a CAS is right only while every request to its word passes
            // here: the lanes are fenceable, so clients that go to the server directly
            // (after a FENCE) are never overtaken by one of them still queued there.
            fence_session: config.cas_to_write.then(FenceSession::new),
            // Replies wait here for slow clients, charged by their own size: a slice
            // would keep its whole upstream frame (other clients' replies too) alive.
            own_replies: true,
            ..ClientConfig::default()
        };
        let mut proxy = Proxy {
            token: config.token.clone(),
            upstream: config.upstream,
            upstream_config,
            lanes: Vec::new(),
            cas_to_write: config.cas_to_write,
            read_cache: config.read_cache,
            chains: if config.write_cache || config.read_cache {
                ChainCache::new(config.chain_cache_bytes()).map(std::sync::Mutex::new)
            } else {
                None
            },
            write_cache: config.write_cache,
            write_cache_fault: config.write_cache_fault,
            memory_bytes_max: config.memory_bytes,
            connection_memory: MemoryBudget::new(config.connection_memory_bytes),
            memory_freed: Notify::new(),
            memory_waiters: AtomicUsize::new(0),
            client_timeout: config.client_timeout,
            counters: Counters::default(),
            connections: AtomicUsize::new(0),
            handshakes: std::sync::Mutex::new(Handshakes::default()),
            extents: std::sync::Mutex::new(Extents::default()),
            failed: AtomicBool::new(false),
            failed_why: std::sync::Mutex::new(None),
            failed_notify: Notify::new(),
        };
        if let (Some(n), Some((words_bytes, cache_bytes))) = (config.conn_map, config.lane_budget())
        {
            for _ in 0..n {
                let lane = proxy
                    .new_lane(words_bytes, cache_bytes)
                    .await
                    .map_err(|source| ProxyError::Upstream {
                        addr: config.upstream,
                        source,
                    })?;
                proxy.lanes.push(lane);
            }
        }
        Ok(ProxyServer {
            proxy: Arc::new(proxy),
        })
    }

    /// Serves clients from `listener` until `shutdown` completes (`Ok`) or, with
    /// CAS→WRITE or the read cache, an upstream connection ends or a lane breaks
    /// (`FailStop`).
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ProxyError> {
        let proxy = self.proxy;
        tokio::pin!(shutdown);
        // A lane's connection can end with nothing in flight on it (its server killed
        // while idle); the next request would connect anew, perhaps to a restarted and
        // empty server, and what the lane knows would be answered for bytes that are
        // gone. A lane can also break with no request left to tell (its mutation's
        // submit dropped). Either is a fail-stop as soon as it happens. The watchers are
        // aborted when this returns.
        let mut watchers = tokio::task::JoinSet::new();
        if proxy.answers_from_knowledge() {
            for lane in &proxy.lanes {
                let (proxy, lane) = (proxy.clone(), lane.clone());
                watchers.spawn(async move {
                    let mut keepalive = tokio::time::interval(LANE_KEEPALIVE);
                    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                    let why = loop {
                        tokio::select! {
                            biased;
                            e = lane.client.connection_lost() => {
                                break format!("an upstream connection ended: {e}");
                            }
                            () = lane.applied.until_broken() => {
                                break "a lane's mutation may not have reached the server".into();
                            }
                            _ = keepalive.tick() => {
                                // Nobody waits for the answer: one that does not come in
                                // time ends the connection (the client's watchdog).
                                if let Err(e) = lane.client.submit(0, Op::Ping).await {
                                    break format!("a keep-alive PING failed: {e}");
                                }
                            }
                        }
                    };
                    proxy.fail_stop(&why);
                });
            }
        }
        let stopped = |proxy: &Proxy| {
            let why = proxy
                .failed_why
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            Err(ProxyError::FailStop(
                why.unwrap_or_else(|| "an upstream request failed".into()),
            ))
        };
        loop {
            let failed = proxy.failed_notify.notified();
            if proxy.failed.load(Ordering::SeqCst) {
                return stopped(&proxy);
            }
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                _ = failed => return stopped(&proxy),
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed");
                            continue;
                        }
                    };
                    if proxy.connections.fetch_add(1, Ordering::SeqCst) >= CONNECTIONS_MAX {
                        proxy.connections.fetch_sub(1, Ordering::SeqCst);
                        drop(stream);
                        continue;
                    }
                    let (waiting, evicted) = proxy.handshakes().enter();
                    if evicted {
                        proxy
                            .counters
                            .evicted_unauthenticated
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    proxy.counters.connections_total.fetch_add(1, Ordering::Relaxed);
                    let proxy = proxy.clone();
                    tokio::spawn(async move {
                        serve(proxy.clone(), stream, peer, waiting).await;
                        proxy.connections.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            }
        }
    }
}

/// One upstream connection and what the proxy knows about the bytes behind it.
struct Lane {
    client: LoopClient,
    state: Mutex<LaneState>,
    /// Requests that may change bytes, numbered as they are sent (under `state`, so in
    /// the order decided, which is the order on the wire).
    mutations_sent: AtomicU64,
    /// Up to which number they are applied at the server.
    applied: Arc<AppliedMarks>,
    /// With answers from what the proxy knows: mutations are numbered, and their answers
    /// mark them applied as the connection's reader stores them. Not as their callers
    /// await them: a client's answers are awaited in its frames' order, behind answers
    /// that may wait for another client's mutation (which would then wait for the
    /// first: a cycle; seen as clients with no answer in 30 s).
    tracked: bool,
}

/// What the server has done of a lane's mutations: all those numbered up to `through`
/// are applied; `broken` once one may not have been. Kept by the answers of the lane's
/// numbered mutations, on the connection's reader: every answer moves it, and only a
/// few local answers wait on it, so moving it must cost next to nothing when nobody
/// waits (a `watch` channel woke eight `Notify`s on every send: 13 % of the proxy's
/// time with every CAS converted).
///
/// `through` moves only over numbers answered without a doubt, one after another. One
/// connection answers in order, so that is the common case; but after a connection
/// died, the next mutation goes out on a new one and may be answered before the dead
/// one's requests are failed — and an answer to it must not vouch for them.
#[derive(Default)]
struct AppliedMarks {
    /// `order.through`, for a look without the lock.
    through: AtomicU64,
    broken: AtomicBool,
    /// Held only to move the mark, never across an await.
    order: std::sync::Mutex<AnswerOrder>,
    /// Tasks in [`AppliedMarks::wait_for`]; nobody is woken while it is 0.
    waiters: AtomicUsize,
    changed: Notify,
    /// Woken once, when the lane breaks ([`AppliedMarks::until_broken`]).
    broke: Notify,
}

#[derive(Default)]
struct AnswerOrder {
    through: u64,
    /// Numbers answered past a gap, until the gap is filled.
    early: std::collections::BTreeSet<u64>,
}

/// Numbers a lane holds answered past a gap before it calls itself broken: more than
/// can be in flight on a connection, so only a number that will never be answered
/// gets there.
const EARLY_ANSWERS_MAX: usize =
    camelot_client::INFLIGHT_REQUESTS_MAX + camelot_client::QUEUE_REQUESTS_MAX_DEFAULT;

impl AnswerHook for AppliedMarks {
    fn answered(&self, number: u64, answer: &Result<Reply, ClientError>) {
        match answer {
            Ok(_) => self.advance(number),
            // Refused on its own, it changed nothing, and its caller forgets what it taught.
            Err(e) if !ends_connection(e) => self.advance(number),
            Err(_) => self.broke(),
        }
    }
}

impl AppliedMarks {
    fn advance(&self, number: u64) {
        // A panic elsewhere while it was held leaves the numbers as they were: usable.
        let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        if number != order.through + 1 {
            // A broken lane's gap may never fill: what is past it is not kept, or a lane
            // left in use after its break would collect every later answer here.
            if self.broken.load(Ordering::SeqCst) {
                order.early.clear();
                return;
            }
            if number > order.through {
                order.early.insert(number);
            }
            if order.early.len() > EARLY_ANSWERS_MAX {
                order.early.clear();
                drop(order);
                self.broke();
            }
            return;
        }
        order.through = number;
        while order.early.first() == Some(&(order.through + 1)) {
            order.early.pop_first();
            order.through += 1;
        }
        // SeqCst here and in `wait_for`: either the waiter's look sees the new mark, or
        // the load in `wake` sees the waiter.
        self.through.store(order.through, Ordering::SeqCst);
        drop(order);
        self.wake();
    }

    fn broke(&self) {
        if !self.broken.swap(true, Ordering::SeqCst) {
            self.wake();
            self.broke.notify_waiters();
        }
    }

    /// Returns once the lane has broken. A break nobody's request saw — a mutation
    /// whose submit was dropped before it was queued, its client gone — still leaves
    /// the lane's knowledge wrong (its decision is in the word table and the cache, its
    /// bytes never reached the server), so the proxy waits on this to stop.
    async fn until_broken(&self) {
        loop {
            // Made before the look, so a break between the look and the wait counts.
            let broke = self.broke.notified();
            if self.broken.load(Ordering::SeqCst) {
                return;
            }
            broke.await;
        }
    }

    fn wake(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.changed.notify_waiters();
        }
    }

    fn applied(&self, number: u64) -> bool {
        self.through.load(Ordering::SeqCst) >= number
    }

    /// Whether mutation `number` was applied: waits until it is, or the lane broke
    /// (then the number may never come: one before it may be lost).
    async fn wait_for(&self, number: u64) -> bool {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiters);
        loop {
            // Made before the look, so a wake between the look and the wait counts.
            let changed = self.changed.notified();
            if self.applied(number) {
                return true;
            }
            if self.broken.load(Ordering::SeqCst) {
                return false;
            }
            changed.await;
        }
    }
}

/// Requests whose effect on region bytes the word table and the caches must wait for.
fn mutates(op: &Op) -> bool {
    matches!(
        op,
        Op::Write { .. }
            | Op::Cas { .. }
            | Op::FetchAdd { .. }
            | Op::WriteIf { .. }
            | Op::Swap { .. }
            | Op::XorInto { .. }
            | Op::Free { .. }
    )
}

impl Lane {
    /// `answers_locally`: the proxy answers from what it knows, so mutations are numbered
    /// and their answers tracked.
    fn new(client: LoopClient, state: LaneState, answers_locally: bool) -> Lane {
        Lane {
            client,
            state: Mutex::new(state),
            mutations_sent: AtomicU64::new(0),
            applied: Arc::default(),
            tracked: answers_locally,
        }
    }

    /// Sends `op`. A tracked mutation gets the lane's next number, and its answer marks it
    /// (and every one before it) applied before its caller sees it. A mutation is sent
    /// under `state`, with its decision.
    async fn send(&self, op: Op) -> Result<LoopPending, ClientError> {
        let sent = if self.tracked && mutates(&op) {
            let number = self.mutations_sent.fetch_add(1, Ordering::SeqCst) + 1;
            self.client
                .submit_hooked(0, op, self.applied.clone(), number)
                .await
        } else {
            self.client.submit(0, op).await
        };
        if sent.is_err() {
            self.applied.broke();
        }
        sent
    }

    /// The number the next tracked mutation sent on this lane will carry (0 when none
    /// are tracked); ask under `state`, with the decision it goes with.
    fn next_number(&self) -> u64 {
        if self.tracked {
            self.mutations_sent.load(Ordering::SeqCst) + 1
        } else {
            0
        }
    }

    /// An answer the proxy gives from what it knows (a CAS failed on a known word, a
    /// cached READ), decided now under `state`: given once mutation `needed` — the newest
    /// that taught what it answers, 0 for none — is applied, and so every one before it
    /// on this lane. What the proxy knows includes what it decided and sent
    /// but the server has not applied yet; answering from that at once would let a
    /// client see a write that a proxy killed now never delivers (the fence drops it).
    fn once_applied(&self, answer: Result<Reply, ErrorReply>, needed: u64) -> Answer {
        if needed == 0 || self.applied.applied(needed) {
            return ready(answer);
        }
        let applied = self.applied.clone();
        Box::pin(async move {
            if applied.wait_for(needed).await {
                answer
            } else {
                Err(ErrorReply::new(
                    ErrorCode::Internal,
                    "the upstream connection failed before this answer's writes were applied",
                ))
            }
        })
    }
}

struct LaneState {
    words: Words,
    cache: Option<ReadCache>,
}

/// Regions the proxy keeps extents for; past it the table starts over (which only means
/// the next WRITE to each region teaches nothing).
const EXTENT_REGIONS_MAX: usize = 4096;

/// Per region, an end offset below which the server took a WRITE (or its size, from an
/// ALLOC answered through the proxy): the region is at least that large, so a WRITE below it cannot be refused for its bounds or for a
/// missing region (while everything goes through the proxy, and until a FREE). Only such
/// a WRITE teaches what it writes when it is decided; any other could be refused, and
/// requests decided from what it taught (a CAS made a WRITE, a cached READ) would answer
/// for bytes the server never held. Pure; bounded by [`EXTENT_REGIONS_MAX`].
#[derive(Default)]
struct Extents {
    ends: std::collections::HashMap<u64, u64>,
    /// FREEs decided: an answer decided before one may not widen after it.
    frees: u64,
}

impl Extents {
    fn covers(&self, region: u64, offset: u64, len: u64) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| self.ends.get(&region).is_some_and(|&e| end <= e))
    }

    /// A WRITE decided when `frees` FREEs had been was taken up to `end`.
    fn taken(&mut self, region: u64, end: u64, frees: u64) {
        if frees != self.frees {
            return;
        }
        if self.ends.len() >= EXTENT_REGIONS_MAX && !self.ends.contains_key(&region) {
            self.ends.clear();
        }
        let e = self.ends.entry(region).or_insert(0);
        *e = (*e).max(end);
    }

    fn freed(&mut self, region: u64) {
        self.ends.remove(&region);
        self.frees += 1;
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    bytes_from_clients: AtomicU64,
    bytes_to_clients: AtomicU64,
    /// Proxy ↔ server, each request and reply as encoded (frame headers, which
    /// batching shares among requests, not counted).
    bytes_to_upstream: AtomicU64,
    bytes_from_upstream: AtomicU64,
    connections_total: AtomicU64,
    refused_auth: AtomicU64,
    /// Connections closed in their handshake to make room for a newer one.
    evicted_unauthenticated: AtomicU64,
    /// Clients closed because their frame would pass the connection memory.
    refused_over_memory: AtomicU64,
    /// Requests answered TOO_LARGE: their frame's answer had no room left for them.
    refused_too_large: AtomicU64,
    /// Clients closed for taking longer than the client timeout over a frame or answer.
    closed_stalled: AtomicU64,
}

struct Proxy {
    token: Option<Vec<u8>>,
    upstream: SocketAddr,
    upstream_config: ClientConfig,
    /// Shared lanes (`--conn-map`); empty in pass-through.
    lanes: Vec<Arc<Lane>>,
    cas_to_write: bool,
    read_cache: bool,
    /// Shared by the lanes: a key's chain spans regions. A plain mutex, held only for
    /// a table look-up, never across an await.
    chains: Option<std::sync::Mutex<ChainCache>>,
    write_cache: bool,
    write_cache_fault: bool,
    memory_bytes_max: u64,
    /// What clients' frames in flight hold (`serve`).
    connection_memory: Arc<MemoryBudget>,
    /// Told whenever a frame lets go of what it held while clients wait for room.
    memory_freed: Notify,
    /// Clients waiting for room (`hold`): releases tell `memory_freed` only then.
    memory_waiters: AtomicUsize,
    client_timeout: Duration,
    counters: Counters,
    connections: AtomicUsize,
    /// What the server took: WRITEs below a region's extent teach (`write`). A plain
    /// mutex, held only for a look-up, never across an await.
    extents: std::sync::Mutex<Extents>,
    /// Connections still in their handshake (within `connections`), oldest first.
    handshakes: std::sync::Mutex<Handshakes>,
    /// Set once, on a fail-stop; from then on nothing is answered.
    failed: AtomicBool,
    /// Why, as the first to set `failed` said.
    failed_why: std::sync::Mutex<Option<String>>,
    failed_notify: Notify,
}

type Answer = Pin<Box<dyn Future<Output = Result<Reply, ErrorReply>> + Send>>;

fn ready(r: Result<Reply, ErrorReply>) -> Answer {
    Box::pin(std::future::ready(r))
}

fn region_of(op: &Op) -> Option<u64> {
    match op {
        Op::Read { region, .. }
        | Op::Write { region, .. }
        | Op::Cas { region, .. }
        | Op::FetchAdd { region, .. }
        | Op::WriteIf { region, .. }
        | Op::Swap { region, .. }
        | Op::XorInto { region, .. }
        | Op::Free { region } => Some(*region),
        _ => None,
    }
}

/// A successful reply's bytes in a RESPONSES frame: request id, status, kind, then the
/// payload (as the protocol lays it out; `Op::reply_len_max` is the bound with errors).
fn ok_reply_bytes(op: &Op) -> u64 {
    const OK_HEADER_BYTES: u64 = 8 + 2 + 1;
    OK_HEADER_BYTES
        + match op {
            Op::Read { len, .. } => 4 + u64::from(*len),
            Op::Swap { data, .. } => 4 + data.len() as u64,
            Op::Cas { .. } | Op::FetchAdd { .. } | Op::WriteIf { .. } => 8,
            Op::Write { .. } | Op::XorInto { .. } | Op::Free { .. } | Op::Ping => 0,
            other => (other.reply_len_max() as u64).saturating_sub(OK_HEADER_BYTES),
        }
}

fn lane_index(region: Option<u64>, lanes: usize) -> usize {
    match region {
        // Region ids are random, but a multiplicative hash costs nothing and keeps a
        // poorly chosen id space from landing on one lane.
        Some(r) => ((r.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % lanes as u64) as usize,
        None => 0,
    }
}

/// Whether an upstream error ended the connection, so requests in flight on it may not
/// have been applied (and those after it go on another one). A request the server
/// refused on its own (out of bounds, no such region, unaligned, forbidden, a conflict)
/// was executed and changed nothing; anything else — a FATAL frame (a fence, a shutdown,
/// an eviction, a buffer budget), a lost connection, a timeout — leaves it unknown.
fn ends_connection(e: &ClientError) -> bool {
    !matches!(e, ClientError::Server(_))
}

impl LaneState {
    /// What the decisions made next teach is marked with `number`, the mutation they send.
    fn deciding(&mut self, number: u64) {
        self.words.deciding(number);
        if let Some(c) = self.cache.as_mut() {
            c.deciding(number);
        }
    }

    /// Bytes whose value is now unknown here (a failed request, FETCH_ADD, …).
    fn forget(&mut self, region: u64, offset: u64, len: u64) {
        self.words.forget(region, offset, len);
        if let Some(c) = self.cache.as_mut() {
            c.forget(region, offset, len);
        }
    }
}

impl Proxy {
    fn upstream_error(&self, e: ClientError) -> ErrorReply {
        if !ends_connection(&e) {
            if let ClientError::Server(reply) = e {
                return reply;
            }
        }
        // A FENCED session ends its connection, and only `cas_to_write` lanes are
        // fenceable.
        if self.answers_from_knowledge() {
            self.fail_stop(&format!("an upstream request failed: {e}"));
            return ErrorReply::new(ErrorCode::Internal, "proxy stopped (fail-stop)");
        }
        ErrorReply::new(ErrorCode::Internal, format!("proxy upstream: {e}"))
    }

    /// CAS→WRITE and the read cache answer from what the proxy knows, some of it sent
    /// and maybe never applied, all of it about one server process's bytes.
    fn answers_from_knowledge(&self) -> bool {
        self.cas_to_write || self.read_cache
    }

    /// See the crate doc: nothing this proxy knows can be trusted any more.
    fn fail_stop(&self, why: &str) {
        let mut first = self
            .failed_why
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if first.is_none() {
            tracing::error!(reason = why, "stopping (fail-stop)");
            *first = Some(why.to_owned());
        }
        drop(first);
        // Set after the reason, so whoever sees the flag finds the reason too.
        self.failed.store(true, Ordering::SeqCst);
        self.failed_notify.notify_waiters();
    }

    async fn stats_list(&self) -> Vec<(String, u64)> {
        let c = &self.counters;
        let mut s = vec![
            (
                "proxy_requests".to_string(),
                c.requests.load(Ordering::Relaxed),
            ),
            (
                "proxy_bytes_from_clients".into(),
                c.bytes_from_clients.load(Ordering::Relaxed),
            ),
            (
                "proxy_bytes_to_clients".into(),
                c.bytes_to_clients.load(Ordering::Relaxed),
            ),
            (
                "proxy_bytes_to_upstream".into(),
                c.bytes_to_upstream.load(Ordering::Relaxed),
            ),
            (
                "proxy_bytes_from_upstream".into(),
                c.bytes_from_upstream.load(Ordering::Relaxed),
            ),
            (
                "proxy_connections_current".into(),
                self.connections.load(Ordering::Relaxed) as u64,
            ),
            (
                "proxy_connections_total".into(),
                c.connections_total.load(Ordering::Relaxed),
            ),
            (
                "proxy_refused_auth".into(),
                c.refused_auth.load(Ordering::Relaxed),
            ),
            (
                "proxy_evicted_unauthenticated".into(),
                c.evicted_unauthenticated.load(Ordering::Relaxed),
            ),
            (
                "proxy_refused_over_memory".into(),
                c.refused_over_memory.load(Ordering::Relaxed),
            ),
            (
                "proxy_refused_too_large".into(),
                c.refused_too_large.load(Ordering::Relaxed),
            ),
            (
                "proxy_closed_stalled".into(),
                c.closed_stalled.load(Ordering::Relaxed),
            ),
            (
                "proxy_connection_memory_used_bytes".into(),
                self.connection_memory.used(),
            ),
            (
                "proxy_connection_memory_cap_bytes".into(),
                self.connection_memory.cap(),
            ),
            ("proxy_lanes".into(), self.lanes.len() as u64),
            ("proxy_memory_bytes_max".into(), self.memory_bytes_max),
        ];
        let mut w = words::WordStats::default();
        let mut r = cache::CacheStats::default();
        let (mut words_n, mut words_bytes, mut cache_bytes) = (0, 0, 0);
        for lane in &self.lanes {
            let st = lane.state.lock().await;
            let ws = st.words.stats;
            w.conversions += ws.conversions;
            w.failed_locally += ws.failed_locally;
            w.forwarded += ws.forwarded;
            w.learned += ws.learned;
            w.evictions += ws.evictions;
            words_n += st.words.len() as u64;
            words_bytes += st.words.bytes();
            if let Some(c) = &st.cache {
                r.hits += c.stats.hits;
                r.misses += c.stats.misses;
                r.fills += c.stats.fills;
                r.fills_refused += c.stats.fills_refused;
                r.evictions += c.stats.evictions;
                cache_bytes += c.bytes();
            }
        }
        s.extend([
            ("proxy_cas_converted".to_string(), w.conversions),
            ("proxy_cas_failed_locally".into(), w.failed_locally),
            ("proxy_cas_forwarded".into(), w.forwarded),
            ("proxy_words".into(), words_n),
            ("proxy_words_learned".into(), w.learned),
            ("proxy_words_evicted".into(), w.evictions),
            ("proxy_words_bytes".into(), words_bytes),
            ("proxy_read_hits".into(), r.hits),
            ("proxy_read_misses".into(), r.misses),
            ("proxy_read_fills".into(), r.fills),
            ("proxy_read_fills_refused".into(), r.fills_refused),
            ("proxy_read_evictions".into(), r.evictions),
            ("proxy_read_cache_bytes".into(), cache_bytes),
        ]);
        let (t, tails_n, nodes_n, tails_bytes) = match self.chains.as_ref() {
            Some(m) => {
                let wc = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                (wc.stats, wc.tails() as u64, wc.nodes() as u64, wc.bytes())
            }
            None => Default::default(),
        };
        s.extend([
            // Each a CAS retry (walk, relink, CAS) the writer did not make.
            ("proxy_write_cache_hits".to_string(), t.redirected),
            ("proxy_write_cache_lost".into(), t.redirect_lost),
            ("proxy_write_cache_current".into(), t.current),
            // Each a walk the reader did not make.
            ("proxy_read_redirects".into(), t.reads_redirected),
            ("proxy_read_redirects_stale".into(), t.reads_redirect_stale),
            ("proxy_chain_tails".into(), tails_n),
            ("proxy_chain_nodes".into(), nodes_n),
            ("proxy_chain_tails_learned".into(), t.tails_learned),
            ("proxy_chain_nodes_learned".into(), t.nodes_learned),
            ("proxy_chain_nodes_evicted".into(), t.nodes_evicted),
            ("proxy_chain_resets".into(), t.resets),
            ("proxy_chain_bytes".into(), tails_bytes),
            (
                "proxy_state_bytes".into(),
                words_bytes + cache_bytes + tails_bytes,
            ),
        ]);
        s
    }

    /// Counts a request about to go upstream, and its reply as a success (for region
    /// operations its size is fixed by the request; an error reply differs).
    fn counted(&self, op: Op) -> Op {
        let c = &self.counters;
        c.bytes_to_upstream
            .fetch_add(op.encoded_len() as u64, Ordering::Relaxed);
        c.bytes_from_upstream
            .fetch_add(ok_reply_bytes(&op), Ordering::Relaxed);
        op
    }

    fn with_extents<T>(&self, f: impl FnOnce(&mut Extents) -> T) -> T {
        let mut e = self
            .extents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut e)
    }

    fn handshakes(&self) -> std::sync::MutexGuard<'_, Handshakes> {
        self.handshakes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn with_chains<T>(&self, f: impl FnOnce(&mut ChainCache) -> T) -> Option<T> {
        let m = self.chains.as_ref()?;
        let mut wc = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(f(&mut wc))
    }

    /// Decides one request and queues it upstream; the answer comes by awaiting what
    /// this returns. Requests are decided one at a time per client, in frame order, and
    /// every decision about a lane's bytes is made and queued under that lane's lock.
    async fn dispatch(self: &Arc<Self>, lanes: &[Arc<Lane>], op: Op) -> Answer {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        if self.failed.load(Ordering::SeqCst) {
            return ready(Err(ErrorReply::new(
                ErrorCode::Internal,
                "proxy stopped (fail-stop)",
            )));
        }
        if let Op::Stats = op {
            return ready(Ok(Reply::Stats(self.stats_list().await)));
        }
        if let Op::Fence = op {
            // Through a proxy it would fence the proxy's own lanes: a client falls back
            // by fencing the servers, which it reaches without this proxy.
            return ready(Err(ErrorReply::new(
                ErrorCode::BadRequest,
                "FENCE goes to the servers directly, not through a proxy",
            )));
        }
        let lane = lanes[lane_index(region_of(&op), lanes.len())].clone();
        if !(self.cas_to_write || self.read_cache || self.write_cache) {
            return self.forward(&lane, op).await;
        }
        match op {
            Op::Read {
                region,
                offset,
                len,
            } if self.read_cache => {
                if let Some(Some(tail)) = self.with_chains(|c| c.redirect_read(region, offset, len))
                {
                    return self
                        .redirected_read(lanes, tail, lane, region, offset, len)
                        .await;
                }
                self.cached_read(lane, region, offset, len).await
            }
            Op::Cas {
                region,
                offset,
                expected,
                new,
            } if offset.is_multiple_of(8) => {
                if self.write_cache {
                    if let Some(Some(r)) =
                        self.with_chains(|wc| wc.redirect_cas(region, offset, expected, new))
                    {
                        return self.redirect(r, region, offset, expected);
                    }
                }
                self.with_chains(|c| c.cas_seen(region, offset));
                self.cas(lane, region, offset, expected, new).await
            }
            Op::Write {
                region,
                offset,
                data,
            } => self.write(lane, region, offset, data).await,
            Op::FetchAdd { region, offset, .. } | Op::Cas { region, offset, .. } => {
                self.with_chains(|c| c.forget(region, offset, 8));
                let mut st = lane.state.lock().await;
                st.forget(region, offset, 8);
                let a = self.forward(&lane, op).await;
                drop(st);
                a
            }
            // Writes whose effect the proxy cannot know (WRITE_IF depends on a guard word,
            // XOR_INTO on bytes it may not hold; SWAP it could learn, but nothing here
            // needs that yet): what they touch is forgotten, never served stale.
            Op::WriteIf {
                region,
                offset,
                ref data,
                ..
            }
            | Op::Swap {
                region,
                offset,
                ref data,
            }
            | Op::XorInto {
                region,
                offset,
                ref data,
            } => {
                let len = data.len() as u64;
                self.with_chains(|c| c.forget(region, offset, len));
                let mut st = lane.state.lock().await;
                st.forget(region, offset, len);
                let a = self.forward(&lane, op).await;
                drop(st);
                a
            }
            Op::Free { region } => {
                let mut st = lane.state.lock().await;
                self.with_extents(|e| e.freed(region));
                st.words.forget_region(region);
                if let Some(c) = st.cache.as_mut() {
                    c.forget_region(region);
                }
                self.with_chains(|wc| wc.forget_region(region));
                let a = self.forward(&lane, op).await;
                drop(st);
                a
            }
            // Not LOOKUP: it rides lane 0, and a FREE of its region decided before it on
            // the region's lane may still reach the server after it.
            Op::Alloc { .. } => {
                let frees = self.with_extents(|e| e.frees);
                let a = self.forward(&lane, op).await;
                let proxy = self.clone();
                Box::pin(async move {
                    let r = a.await;
                    if let Ok(Reply::Region(info)) = &r {
                        proxy.with_extents(|e| e.taken(info.id, info.size, frees));
                    }
                    r
                })
            }
            other => self.forward(&lane, other).await,
        }
    }

    /// A CAS on an aligned word of `lane`, through the word table (CAS→WRITE).
    async fn cas(
        self: &Arc<Self>,
        lane: Arc<Lane>,
        region: u64,
        offset: u64,
        expected: u64,
        new: u64,
    ) -> Answer {
        let mut st = lane.state.lock().await;
        st.deciding(lane.next_number());
        match st
            .words
            .cas(region, offset, expected, new, self.cas_to_write)
        {
            CasDecision::Fail { value, taught_by } => {
                lane.once_applied(Ok(Reply::Word(value)), taught_by)
            }
            CasDecision::Convert => {
                // Won now: the WRITE is queued in order before anything after it on this
                // lane. Not yet on the others: the link is learned (and READs are sent to
                // the new tail as linked, on the tail's lane) only once the server has it,
                // or a redirected READ could overtake the WRITE and call an unlinked node
                // linked (seen: a stale read after a completed write, with CAS→WRITE and
                // the read cache on).
                let bytes = new.to_le_bytes();
                if let Some(c) = st.cache.as_mut() {
                    c.write(region, offset, &bytes);
                }
                let write = Op::Write {
                    region,
                    offset,
                    data: Bytes::copy_from_slice(&bytes),
                };
                let sent = lane.send(self.counted(write)).await;
                drop(st);
                let proxy = self.clone();
                Box::pin(async move {
                    let r = match sent {
                        Ok(p) => p.await,
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(Reply::Done) => {
                            proxy.with_chains(|wc| wc.cas_won(region, offset, expected, new));
                            Ok(Reply::Word(expected))
                        }
                        Ok(other) => Err(ErrorReply::new(
                            ErrorCode::Internal,
                            format!("upstream answered a WRITE with {other:?}"),
                        )),
                        Err(e) => {
                            lane.state.lock().await.forget(region, offset, 8);
                            Err(proxy.upstream_error(e))
                        }
                    }
                })
            }
            CasDecision::Forward { ticket } => {
                if let Some(c) = st.cache.as_mut() {
                    c.forget(region, offset, 8);
                }
                let op = Op::Cas {
                    region,
                    offset,
                    expected,
                    new,
                };
                let sent = lane.send(self.counted(op)).await;
                drop(st);
                let proxy = self.clone();
                Box::pin(async move {
                    let r = match sent {
                        Ok(p) => p.await,
                        Err(e) => Err(e),
                    };
                    let mut st = lane.state.lock().await;
                    match r {
                        Ok(Reply::Word(before)) => {
                            if before == expected {
                                proxy.with_chains(|wc| wc.cas_won(region, offset, expected, new));
                            }
                            st.words
                                .cas_answered(region, offset, ticket, expected, new, before);
                            Ok(Reply::Word(before))
                        }
                        Ok(other) => {
                            st.words.cas_failed(region, offset, ticket);
                            Ok(other)
                        }
                        Err(e) => {
                            st.words.cas_failed(region, offset, ticket);
                            drop(st);
                            Err(proxy.upstream_error(e))
                        }
                    }
                })
            }
        }
    }

    /// A WRITE through `lane`, teaching the word table and the caches its bytes.
    async fn write(
        self: &Arc<Self>,
        lane: Arc<Lane>,
        region: u64,
        offset: u64,
        data: Bytes,
    ) -> Answer {
        let len = data.len() as u64;
        let mut st = lane.state.lock().await;
        st.deciding(lane.next_number());
        let (within, frees) = self.with_extents(|e| (e.covers(region, offset, len), e.frees));
        if within {
            st.words.write(region, offset, &data);
            if let Some(c) = st.cache.as_mut() {
                c.write(region, offset, &data);
            }
            self.with_chains(|wc| wc.write(region, offset, &data));
        } else {
            // It may be refused: what it touches is unknown until it is answered.
            st.forget(region, offset, len);
            self.with_chains(|wc| wc.forget(region, offset, len));
        }
        let op = Op::Write {
            region,
            offset,
            data,
        };
        let sent = lane.send(self.counted(op)).await;
        drop(st);
        let proxy = self.clone();
        Box::pin(async move {
            let r = match sent {
                Ok(p) => p.await,
                Err(e) => Err(e),
            };
            match r {
                Ok(reply) => {
                    if !within {
                        proxy.with_extents(|e| e.taken(region, offset.saturating_add(len), frees));
                    }
                    Ok(reply)
                }
                Err(e) => {
                    lane.state.lock().await.forget(region, offset, len);
                    proxy.with_chains(|wc| wc.forget(region, offset, len));
                    Err(proxy.upstream_error(e))
                }
            }
        })
    }

    /// The write cache's re-aimed CAS: the node's header for the version after the known
    /// tail, then the CAS of that tail; both through the lanes like any request.
    ///
    /// If the re-aimed CAS loses (the tail moved on again), the writer's own CAS is sent
    /// as it came. It must fail too: it expects the marker of a version older than one
    /// the proxy saw linked, and a key's versions only grow. Its answer (the next word
    /// of the writer's tail) lets the writer follow on as without a proxy; the header
    /// rewritten here is rewritten again by the writer before its next CAS.
    fn redirect(
        self: &Arc<Self>,
        r: Redirect,
        region: u64,
        offset: u64,
        original_expected: u64,
    ) -> Answer {
        let proxy = self.clone();
        Box::pin(async move {
            let lanes = &proxy.lanes;
            let node_lane = lanes[lane_index(Some(r.node_region), lanes.len())].clone();
            let relink = camelot_clover::layout::encode_relink(r.key_id, r.seq());
            // The node is the waiting writer's and unlinked: nobody else writes it.
            match proxy
                .write(node_lane, r.node_region, r.node_offset, relink)
                .await
                .await
            {
                Ok(Reply::Done) => {}
                Ok(other) => {
                    return Err(ErrorReply::new(
                        ErrorCode::Internal,
                        format!("upstream answered a WRITE with {other:?}"),
                    ))
                }
                Err(e) => return Err(e),
            }
            let tail_lane = lanes[lane_index(Some(r.tail.region), lanes.len())].clone();
            let expected = r.expected();
            let won = proxy
                .cas(
                    tail_lane,
                    r.tail.region,
                    r.tail.offset,
                    expected,
                    r.node_word,
                )
                .await
                .await;
            match won {
                Ok(Reply::Word(before)) if before == expected || proxy.write_cache_fault => {
                    proxy.with_chains(|wc| wc.stats.redirected += 1);
                    Ok(Reply::Word(camelot_clover::layout::relinked_word(r.seq())))
                }
                Ok(Reply::Word(_)) => {
                    proxy.with_chains(|wc| wc.stats.redirect_lost += 1);
                    let lane = lanes[lane_index(Some(region), lanes.len())].clone();
                    proxy
                        .cas(lane, region, offset, original_expected, r.node_word)
                        .await
                        .await
                }
                other => other,
            }
        })
    }

    /// A READ through `lane`'s read cache: answered from it, or sent and (if nothing
    /// changed its bytes meanwhile) kept.
    async fn cached_read(
        self: &Arc<Self>,
        lane: Arc<Lane>,
        region: u64,
        offset: u64,
        len: u32,
    ) -> Answer {
        let op = Op::Read {
            region,
            offset,
            len,
        };
        let mut st = lane.state.lock().await;
        let Some(cache) = st.cache.as_mut() else {
            drop(st);
            return self.forward(&lane, op).await;
        };
        if let Some((hit, by)) = cache.get_taught(region, offset, len) {
            return lane.once_applied(Ok(Reply::Data(hit)), by);
        }
        let ticket = cache.ticket(region, offset, len);
        let sent = lane.send(self.counted(op)).await;
        drop(st);
        let proxy = self.clone();
        Box::pin(async move {
            let r = match sent {
                Ok(p) => p.await,
                Err(e) => Err(e),
            };
            match r {
                Ok(Reply::Data(d)) => {
                    if let Some(t) = ticket {
                        if let Some(c) = lane.state.lock().await.cache.as_mut() {
                            c.fill(t, &d);
                        }
                    }
                    Ok(Reply::Data(d))
                }
                Ok(other) => Ok(other),
                Err(e) => Err(proxy.upstream_error(e)),
            }
        })
    }

    /// A READ of an old version sent to the key's newer tail instead (see `tails`): the
    /// tail's bytes, marked, if they are still that version; else the READ as it came.
    async fn redirected_read(
        self: &Arc<Self>,
        lanes: &[Arc<Lane>],
        tail: Tail,
        lane: Arc<Lane>,
        region: u64,
        offset: u64,
        len: u32,
    ) -> Answer {
        let tail_lane = lanes[lane_index(Some(tail.region), lanes.len())].clone();
        let answer = self
            .cached_read(tail_lane, tail.region, tail.offset, len)
            .await;
        let proxy = self.clone();
        Box::pin(async move {
            if let Ok(Reply::Data(d)) = answer.await {
                if let Some(Some(marked)) = proxy.with_chains(|c| c.redirected_answer(&tail, &d)) {
                    return Ok(Reply::Data(Bytes::from(marked)));
                }
            } else {
                proxy.with_chains(|c| c.redirected_answer(&tail, &[]));
            }
            proxy.cached_read(lane, region, offset, len).await.await
        })
    }

    async fn forward(self: &Arc<Self>, lane: &Lane, op: Op) -> Answer {
        let sent = lane.send(self.counted(op)).await;
        let proxy = self.clone();
        Box::pin(async move {
            let r = match sent {
                Ok(p) => p.await,
                Err(e) => Err(e),
            };
            r.map_err(|e| proxy.upstream_error(e))
        })
    }

    async fn new_lane(
        &self,
        words_bytes: u64,
        cache_bytes: Option<u64>,
    ) -> Result<Arc<Lane>, ClientError> {
        let client = LoopClient::connect(
            ClusterMap::from_addrs(&[self.upstream]),
            self.upstream_config.clone(),
        )
        .await?;
        Ok(Arc::new(Lane::new(
            client,
            LaneState {
                words: Words::new(words_bytes),
                cache: cache_bytes.and_then(ReadCache::new),
            },
            self.cas_to_write || self.read_cache,
        )))
    }
}

fn tokens_match(expected: &[u8], given: &[u8]) -> bool {
    // Constant time in the token's bytes, as the server compares it.
    let mut diff = u8::from(expected.len() != given.len());
    for (i, &e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(!e);
    }
    std::hint::black_box(diff) == 0
}

async fn send_fatal(stream: &mut TcpStream, code: ErrorCode, message: &str) {
    let mut buf = BytesMut::new();
    if encode_frame(&Frame::Fatal(ErrorReply::new(code, message)), &mut buf).is_ok() {
        let _ = stream.write_all(&buf).await;
    }
}

/// Reads and checks the HELLO; nothing larger than a HELLO is read before it passes.
async fn handshake(proxy: &Proxy, stream: &mut TcpStream) -> Result<(), String> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .await
        .map_err(|e| e.to_string())?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > HELLO_BODY_BYTES_MAX {
        return Err(format!("first frame of {len} bytes is no HELLO"));
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    let hello = match decode_frame(Bytes::from(body)) {
        Ok(Frame::Hello(h)) => h,
        _ => {
            send_fatal(stream, ErrorCode::BadRequest, "expected HELLO").await;
            return Err("first frame is not a HELLO".into());
        }
    };
    if hello.version != PROTOCOL_VERSION {
        let msg = format!("this proxy speaks protocol version {PROTOCOL_VERSION}");
        send_fatal(stream, ErrorCode::VersionMismatch, &msg).await;
        return Err(msg);
    }
    if let Some(token) = &proxy.token {
        if !tokens_match(token, &hello.token) {
            proxy.counters.refused_auth.fetch_add(1, Ordering::Relaxed);
            send_fatal(
                stream,
                ErrorCode::AuthFailed,
                "wrong or missing cluster token",
            )
            .await;
            return Err("wrong or missing cluster token".into());
        }
    }
    let mut buf = BytesMut::new();
    encode_frame(
        &Frame::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            epoch: 0,
            // A proxy fences nothing: its clients' FENCEs go to the servers.
            fence_generation: 0,
        }),
        &mut buf,
    )
    .map_err(|e| e.to_string())?;
    stream.write_all(&buf).await.map_err(|e| e.to_string())
}

/// The connections still in their handshake, oldest first (at most
/// [`UNAUTHENTICATED_CONNECTIONS_MAX`]).
#[derive(Default)]
struct Handshakes {
    next_id: u64,
    waiting: std::collections::VecDeque<(u64, Arc<Notify>)>,
}

/// A connection's place among those in their handshake; `evict` is notified when a
/// newer one took it.
struct Waiting {
    id: u64,
    evict: Arc<Notify>,
}

impl Handshakes {
    /// Enters a new connection, evicting the oldest waiting one if the cap is full
    /// (the second value says so).
    fn enter(&mut self) -> (Waiting, bool) {
        let mut evicted = false;
        while self.waiting.len() >= UNAUTHENTICATED_CONNECTIONS_MAX {
            if let Some((_, evict)) = self.waiting.pop_front() {
                // A stored permit: the evicted task sees it even if not awaiting yet.
                evict.notify_one();
                evicted = true;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let evict = Arc::new(Notify::new());
        self.waiting.push_back((id, evict.clone()));
        (Waiting { id, evict }, evicted)
    }

    /// The connection's handshake ended (passed, refused or timed out).
    fn leave(&mut self, id: u64) {
        self.waiting.retain(|(w, _)| *w != id);
    }
}

/// What a frame's answer may need, decided before any of its requests is dispatched:
/// requests are admitted in order while their replies fit the frame's budget for
/// successful replies (as the client packs its frames, by `Op::reply_len_max`; the first
/// always), the rest answered TOO_LARGE without going upstream. Without it a frame of
/// 4,096 READs of 32 MiB would gather 128 GiB of replies here before its answer was
/// found too large.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReplyPlan {
    /// Per request, in order: whether it goes ahead.
    admitted: Vec<bool>,
    /// Most bytes the answer can take, length prefix included (≤ [`FRAME_REPLY_BYTES_MAX`]
    /// for a frame the decoder accepts).
    bytes_max: u64,
}

impl ReplyPlan {
    fn new<'a>(ops: impl IntoIterator<Item = &'a Op>) -> ReplyPlan {
        let mut ok_bytes = RESPONSES_HEADER_BYTES;
        let mut bytes_max = 4 + RESPONSES_HEADER_BYTES as u64;
        let mut admitted = Vec::new();
        for op in ops {
            let reply = op.reply_len_max();
            let fits = admitted.is_empty() || ok_bytes + reply <= RESPONSE_OK_BUDGET_BYTES;
            if fits {
                ok_bytes += reply;
                bytes_max += reply as u64;
            } else {
                bytes_max += ERROR_RESPONSE_BYTES_MAX as u64;
            }
            admitted.push(fits);
        }
        ReplyPlan {
            admitted,
            bytes_max,
        }
    }
}

/// The body length a buffer's length prefix announces, prefix included, once it is
/// there and within limits (an impossible one the frame decoder refuses).
fn announced_frame_bytes(buf: &[u8]) -> Option<u64> {
    let prefix: [u8; 4] = buf.get(..4)?.try_into().ok()?;
    let len = u32::from_le_bytes(prefix) as usize;
    FrameDecoder::check_len(len).ok()?;
    Some(4 + len as u64)
}

/// Part of the connection memory a frame holds; those waiting for room are told when it
/// is let go (however: written, dropped with a closing connection, a timeout).
struct Held {
    reservation: Option<Reservation>,
    proxy: Arc<Proxy>,
}

impl Drop for Held {
    fn drop(&mut self) {
        // Given back first: a waiter that counted itself in after the load below tries
        // the budget after this, and so finds the room.
        drop(self.reservation.take());
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.proxy.memory_waiters.load(Ordering::SeqCst) > 0 {
            self.proxy.memory_freed.notify_waiters();
        }
    }
}

impl Proxy {
    /// `bytes` of the connection memory, waiting for room until `deadline`.
    async fn hold(
        self: &Arc<Self>,
        bytes: u64,
        deadline: tokio::time::Instant,
    ) -> Result<Held, OverBudget> {
        if let Ok(r) = self.connection_memory.try_reserve(bytes) {
            return Ok(Held {
                reservation: Some(r),
                proxy: self.clone(),
            });
        }
        // Counted in before each try, so a release that sees no waiter came before the
        // try, which then finds its room.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.memory_waiters.fetch_add(1, Ordering::SeqCst);
        let _counted = Waiting(&self.memory_waiters);
        loop {
            let freed = self.memory_freed.notified();
            tokio::pin!(freed);
            // Registered before the try: a release between the two is not missed.
            freed.as_mut().enable();
            match self.connection_memory.try_reserve(bytes) {
                Ok(r) => {
                    return Ok(Held {
                        reservation: Some(r),
                        proxy: self.clone(),
                    })
                }
                Err(e) => {
                    if tokio::time::timeout_at(deadline, freed).await.is_err() {
                        return Err(e);
                    }
                }
            }
        }
    }
}

/// What the reader hands the writer, in the order frames arrived.
enum ToWriter {
    /// A frame's answers, and what it holds of the connection memory (its bytes and
    /// room for its answer) until the answer is written.
    Frame(Vec<(u64, Answer)>, [Held; 2]),
    /// Sent after every frame before it is answered; then the connection closes.
    Fatal(ErrorReply),
}

/// A buffer that held a frame or an answer larger than this is let go after it, so an
/// idle connection does not keep a big allocation outside the connection memory.
const BUFFER_KEEP_BYTES: usize = 4 * READ_CHUNK_BYTES;

async fn serve(proxy: Arc<Proxy>, mut stream: TcpStream, peer: SocketAddr, waiting: Waiting) {
    let handshake = tokio::select! {
        h = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&proxy, &mut stream)) => h,
        () = waiting.evict.notified() => {
            tracing::debug!(%peer, "closed to make room: too many connections waiting to authenticate");
            return;
        }
    };
    proxy.handshakes().leave(waiting.id);
    match handshake {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "handshake refused");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "no HELLO in time");
            return;
        }
    }
    // Only now, authenticated, does the client cost us anything.
    let lanes: Vec<Arc<Lane>> = if proxy.lanes.is_empty() {
        match proxy.new_lane(0, None).await {
            Ok(l) => vec![l],
            Err(e) => {
                send_fatal(
                    &mut stream,
                    ErrorCode::Internal,
                    &format!("proxy upstream: {e}"),
                )
                .await;
                return;
            }
        }
    } else {
        proxy.lanes.clone()
    };
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = mpsc::channel::<ToWriter>(FRAMES_IN_FLIGHT_MAX);
    let writer_proxy = proxy.clone();
    let client_timeout = proxy.client_timeout;
    let writer = tokio::spawn(async move {
        let mut buf = BytesMut::new();
        while let Some(message) = rx.recv().await {
            buf.clear();
            let (frame, held) = match message {
                ToWriter::Frame(frame, held) => (frame, held),
                ToWriter::Fatal(e) => {
                    if encode_frame(&Frame::Fatal(e), &mut buf).is_ok() {
                        let _ = tokio::time::timeout(client_timeout, wr.write_all(&buf)).await;
                    }
                    return;
                }
            };
            let mut enc = ResponseBatchEncoder::begin(&mut buf);
            for (id, answer) in frame {
                let pushed = match answer.await {
                    Ok(reply) => enc.push_ok(id, &reply),
                    Err(e) => enc.push_err(id, &e),
                };
                if pushed.is_err() {
                    let e = ErrorReply::new(ErrorCode::TooLarge, "reply does not fit a frame");
                    if enc.push_err(id, &e).is_err() {
                        return;
                    }
                }
            }
            if enc.finish().is_err() {
                return;
            }
            writer_proxy
                .counters
                .bytes_to_clients
                .fetch_add(buf.len() as u64, Ordering::Relaxed);
            match tokio::time::timeout(client_timeout, wr.write_all(&buf)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::debug!(%peer, "client took no answer in time; closing");
                    writer_proxy
                        .counters
                        .closed_stalled
                        .fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
            if buf.capacity() > BUFFER_KEEP_BYTES {
                buf = BytesMut::new();
            }
            drop(held);
        }
    });
    let over_memory = |e: OverBudget| {
        tracing::warn!(%peer, error = %e, "proxy connection memory full for too long; closing");
        proxy
            .counters
            .refused_over_memory
            .fetch_add(1, Ordering::Relaxed);
        ErrorReply::new(
            ErrorCode::OutOfMemory,
            format!("proxy connection memory exhausted: {e}"),
        )
    };
    let too_large = ErrorReply::new(
        ErrorCode::TooLarge,
        "the replies before this one fill the answer's frame; send it in a smaller batch",
    );
    let mut inbuf = BytesMut::with_capacity(READ_CHUNK_BYTES);
    // What the frame being received holds, charged as soon as its length is known and
    // before the decoder makes room for it, and by when the rest must have come.
    let mut receiving: Option<(Held, tokio::time::Instant)> = None;
    let mut fatal = None;
    'conn: loop {
        loop {
            if receiving.is_none() {
                if let Some(bytes) = announced_frame_bytes(&inbuf) {
                    let deadline = tokio::time::Instant::now() + proxy.client_timeout;
                    match proxy.hold(bytes, deadline).await {
                        Ok(h) => receiving = Some((h, deadline)),
                        Err(e) => {
                            fatal = Some(over_memory(e));
                            break 'conn;
                        }
                    }
                }
            }
            let body = match FrameDecoder::split_frame(&mut inbuf) {
                Ok(Some(b)) => b,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "bad frame; closing");
                    break 'conn;
                }
            };
            // A frame split off was announced, so it was charged above.
            let Some((input, _)) = receiving.take() else {
                break 'conn;
            };
            // Else the frame's allocation would outlive its charge.
            FrameDecoder::let_go_of_large(&mut inbuf, body.len(), BUFFER_KEEP_BYTES);
            let batch = match decode_frame(body) {
                Ok(Frame::Requests(b)) => b,
                _ => {
                    tracing::debug!(%peer, "not a REQUESTS frame; closing");
                    break 'conn;
                }
            };
            let plan = ReplyPlan::new(batch.requests.iter().map(|r| &r.op));
            let deadline = tokio::time::Instant::now() + proxy.client_timeout;
            let answer_room = match proxy.hold(plan.bytes_max, deadline).await {
                Ok(h) => h,
                Err(e) => {
                    fatal = Some(over_memory(e));
                    break 'conn;
                }
            };
            let mut frame = Vec::with_capacity(batch.requests.len());
            for (req, admitted) in batch.requests.into_iter().zip(plan.admitted) {
                let answer = if admitted {
                    proxy.dispatch(&lanes, req.op).await
                } else {
                    proxy
                        .counters
                        .refused_too_large
                        .fetch_add(1, Ordering::Relaxed);
                    ready(Err(too_large.clone()))
                };
                frame.push((req.id, answer));
            }
            if tx
                .send(ToWriter::Frame(frame, [input, answer_room]))
                .await
                .is_err()
            {
                break 'conn;
            }
        }
        // While a frame is being received the decoder has made room for exactly its
        // rest: a reserve of a read chunk on top could double the allocation.
        if receiving.is_none() {
            inbuf.reserve(READ_CHUNK_BYTES);
        }
        let deadline = receiving.as_ref().map(|(_, d)| *d);
        let read = async {
            match deadline {
                Some(d) => tokio::time::timeout_at(d, rd.read_buf(&mut inbuf))
                    .await
                    .ok(),
                None => Some(rd.read_buf(&mut inbuf).await),
            }
        };
        tokio::select! {
            r = read => match r {
                None => {
                    tracing::debug!(%peer, "client sent too little of its frame in time; closing");
                    proxy.counters.closed_stalled.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Some(Ok(0) | Err(_)) => break,
                Some(Ok(n)) => {
                    proxy
                        .counters
                        .bytes_from_clients
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
            },
            // The writer gave up (the client took no answer in time, or is gone).
            () = tx.closed() => break,
        }
    }
    if let Some(e) = fatal {
        let _ = tx.send(ToWriter::Fatal(e)).await;
    }
    drop(tx);
    let _ = writer.await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_proto::limits::{BATCH_OPS_MAX, IO_BYTES_MAX};
    use proptest::prelude::*;
    use std::time::Instant;

    fn read(len: usize) -> Op {
        Op::Read {
            region: 1,
            offset: 0,
            len: len as u32,
        }
    }

    #[test]
    fn a_frame_s_reads_past_its_reply_budget_are_refused_before_going_upstream() {
        let big = read(IO_BYTES_MAX);
        let plan = ReplyPlan::new([&big, &big, &Op::Ping, &big]);
        // Two 32 MiB replies do not fit one answer; a PING still does after the first.
        assert_eq!(plan.admitted, vec![true, false, true, false]);
        assert!(plan.bytes_max <= FRAME_REPLY_BYTES_MAX);
        assert!(plan.bytes_max >= (IO_BYTES_MAX + 2 * ERROR_RESPONSE_BYTES_MAX) as u64);
        // The first request always goes, as the client packs it alone.
        let scan = Op::Scan {
            start: Bytes::new(),
            limit: 1,
        };
        assert_eq!(
            ReplyPlan::new([&scan, &Op::Ping]).admitted,
            vec![true, false]
        );
    }

    #[test]
    fn a_connection_past_the_handshake_cap_evicts_the_oldest_waiting() {
        let mut h = Handshakes::default();
        let first: Vec<Waiting> = (0..UNAUTHENTICATED_CONNECTIONS_MAX)
            .map(|_| {
                let (w, evicted) = h.enter();
                assert!(!evicted);
                w
            })
            .collect();
        // One that passed its handshake no longer counts.
        h.leave(first[1].id);
        let (_, evicted) = h.enter();
        assert!(!evicted);
        let (newest, evicted) = h.enter();
        assert!(evicted);
        assert_eq!(h.waiting.len(), UNAUTHENTICATED_CONNECTIONS_MAX);
        assert_eq!(h.waiting.front().map(|(id, _)| *id), Some(first[2].id));
        assert_eq!(h.waiting.back().map(|(id, _)| *id), Some(newest.id));
        // The oldest was told, before it even waited (a stored permit).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), first[0].evict.notified())
                .await
                .expect("the oldest connection is told to close");
            assert!(
                tokio::time::timeout(Duration::from_millis(50), first[2].evict.notified())
                    .await
                    .is_err(),
                "only the oldest is evicted"
            );
        });
    }

    #[test]
    fn only_writes_below_what_the_server_took_are_covered() {
        let mut e = Extents::default();
        assert!(!e.covers(1, 0, 8), "nothing known of a region");
        e.taken(1, 64, e.frees);
        assert!(e.covers(1, 0, 64));
        assert!(e.covers(1, 56, 8));
        assert!(!e.covers(1, 60, 8), "past the end");
        assert!(!e.covers(1, u64::MAX, 2), "an overflowing span");
        assert!(!e.covers(2, 0, 8), "another region");
        e.taken(1, 32, e.frees);
        assert!(e.covers(1, 56, 8), "a smaller end never narrows");
        // An answer decided before a FREE does not widen after it.
        let before = e.frees;
        e.freed(1);
        assert!(!e.covers(1, 0, 8));
        e.taken(1, 64, before);
        assert!(!e.covers(1, 0, 8));
        // Bounded: past the cap the table starts over.
        for r in 0..EXTENT_REGIONS_MAX as u64 + 1 {
            e.taken(100 + r, 8, e.frees);
        }
        assert!(e.ends.len() <= EXTENT_REGIONS_MAX);
        assert!(e.covers(100 + EXTENT_REGIONS_MAX as u64, 0, 8));
    }

    #[test]
    fn a_length_prefix_is_charged_once_it_is_whole_and_possible() {
        assert_eq!(announced_frame_bytes(&[5, 0, 0]), None);
        assert_eq!(announced_frame_bytes(&[5, 0, 0, 0]), Some(9));
        assert_eq!(announced_frame_bytes(&[0, 0, 0, 0, 1]), None);
        let too_big = ((FRAME_BYTES_MAX + 1) as u32).to_le_bytes();
        assert_eq!(announced_frame_bytes(&too_big), None);
    }

    fn any_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..=IO_BYTES_MAX).prop_map(read),
            Just(Op::Ping),
            Just(Op::Stats),
            Just(Op::Get {
                key: Bytes::from_static(b"k")
            }),
            Just(Op::Scan {
                start: Bytes::new(),
                limit: 10
            }),
            any::<u64>().prop_map(|e| Op::Cas {
                region: 1,
                offset: 0,
                expected: e,
                new: e + 1,
            }),
        ]
    }

    proptest! {
        // The bound a frame is charged is its answer's worst case, never past the cap
        // the budget's floor is built on; what it admits fits the success budget.
        #[test]
        fn a_reply_plan_bounds_the_answer_within_the_cap(
            ops in prop::collection::vec(any_op(), 1..64),
            pings in 0..BATCH_OPS_MAX,
        ) {
            let pings = pings.saturating_sub(ops.len());
            let all: Vec<Op> = ops.into_iter().chain(std::iter::repeat_n(Op::Ping, pings)).collect();
            let plan = ReplyPlan::new(&all);
            prop_assert_eq!(plan.admitted.len(), all.len());
            prop_assert!(plan.admitted[0]);
            prop_assert!(plan.bytes_max <= FRAME_REPLY_BYTES_MAX);
            let admitted: Vec<&Op> = all
                .iter()
                .zip(&plan.admitted)
                .filter_map(|(op, a)| a.then_some(op))
                .collect();
            let ok_bytes: usize =
                RESPONSES_HEADER_BYTES + admitted.iter().map(|op| op.reply_len_max()).sum::<usize>();
            // Only a first request too big on its own goes past the budget, and alone.
            prop_assert!(ok_bytes <= RESPONSE_OK_BUDGET_BYTES || admitted.len() == 1);
            let worst: u64 = 4 + RESPONSES_HEADER_BYTES as u64 + all
                .iter()
                .zip(&plan.admitted)
                .map(|(op, a)| if *a { op.reply_len_max() } else { ERROR_RESPONSE_BYTES_MAX } as u64)
                .sum::<u64>();
            prop_assert_eq!(plan.bytes_max, worst);
        }
    }

    fn ok() -> Result<Reply, ClientError> {
        Ok(Reply::Done)
    }

    fn lost() -> Result<Reply, ClientError> {
        Err(ClientError::ConnectionLost {
            addr: SocketAddr::from(([127, 0, 0, 1], 1)),
        })
    }

    #[test]
    fn answers_in_order_mark_each_mutation_applied() {
        let marks = AppliedMarks::default();
        for n in 1..=3 {
            assert!(!marks.applied(n));
            marks.answered(n, &ok());
            assert!(marks.applied(n));
        }
        // A refusal changed nothing, and is an answer: it counts.
        marks.answered(
            4,
            &Err(ClientError::Server(ErrorReply::new(
                ErrorCode::OutOfBounds,
                "no",
            ))),
        );
        assert!(marks.applied(4));
        assert!(!marks.broken.load(Ordering::SeqCst));
    }

    #[test]
    fn an_answer_past_a_gap_vouches_for_nothing_until_the_gap_is_answered() {
        let marks = AppliedMarks::default();
        marks.answered(1, &ok());
        marks.answered(3, &ok());
        marks.answered(4, &ok());
        assert!(marks.applied(1));
        assert!(!marks.applied(2), "2 is not answered yet");
        assert!(!marks.applied(3), "3 may not vouch for 2");
        marks.answered(2, &ok());
        assert!(marks.applied(4), "the gap filled: 2, 3 and 4 are applied");
    }

    /// A connection died with 2 and 3 in flight; 4 went out on a new connection and was
    /// answered before the dead one's requests were failed. Nothing from 2 on may be
    /// called applied, and whoever waits on 2 hears the lane broke.
    #[test]
    fn an_answer_on_a_new_connection_does_not_vouch_for_the_dead_one_s_requests() {
        let marks = AppliedMarks::default();
        marks.answered(1, &ok());
        marks.answered(4, &ok());
        assert!(!marks.applied(2));
        marks.answered(2, &lost());
        marks.answered(3, &lost());
        marks.answered(5, &ok());
        for n in 2..=5 {
            assert!(!marks.applied(n), "{n} called applied after the break");
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        assert!(
            !rt.block_on(marks.wait_for(2)),
            "a wait on a lost mutation succeeded"
        );
        assert!(rt.block_on(marks.wait_for(1)));
    }

    /// A mutation whose submit was dropped before it was queued breaks the lane, and
    /// whoever waits for a break (the proxy, to stop) hears of it — also one that
    /// started waiting after it.
    #[test]
    fn a_cancelled_submit_breaks_the_lane_and_is_heard() {
        let marks = Arc::new(AppliedMarks::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let early = tokio::spawn({
                let marks = marks.clone();
                async move { marks.until_broken().await }
            });
            marks.answered(1, &ok());
            let quiet = tokio::time::timeout(Duration::ZERO, marks.until_broken()).await;
            assert!(quiet.is_err(), "a break heard while none happened");
            // The one thread runs the early waiter up to its wait.
            tokio::task::yield_now().await;
            marks.answered(2, &Err(ClientError::Cancelled));
            tokio::time::timeout(Duration::from_secs(10), early)
                .await
                .expect("a waiter from before the break hears it")
                .expect("waiter task");
            tokio::time::timeout(Duration::ZERO, marks.until_broken())
                .await
                .expect("a waiter from after the break hears it at once");
        });
        assert!(!marks.applied(2));
    }

    #[test]
    fn too_many_answers_past_a_gap_break_the_lane() {
        let marks = AppliedMarks::default();
        for n in 2..(EARLY_ANSWERS_MAX as u64 + 3) {
            marks.answered(n, &ok());
        }
        assert!(marks.broken.load(Ordering::SeqCst));
        assert!(!marks.applied(2));
        assert!(marks.order.lock().expect("lock").early.is_empty());
    }

    /// A lane left in use after it broke keeps nothing of the answers past its gap.
    #[test]
    fn a_broken_lane_keeps_no_answers_past_its_gap() {
        let marks = AppliedMarks::default();
        marks.answered(1, &ok());
        marks.answered(2, &lost());
        for n in 3..1000 {
            marks.answered(n, &ok());
        }
        assert!(marks.order.lock().expect("lock").early.is_empty());
        assert!(marks.applied(1) && !marks.applied(3));
    }

    #[test]
    fn a_waiter_is_woken_by_the_answer_it_waits_for() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let marks = Arc::new(AppliedMarks::default());
            for round in 0..200u64 {
                let waiting = tokio::spawn({
                    let marks = marks.clone();
                    async move { marks.wait_for(round + 1).await }
                });
                // Answered only once the waiter waits, so each round tests the wake.
                let deadline = Instant::now() + Duration::from_secs(10);
                while marks.waiters.load(Ordering::SeqCst) == 0 {
                    assert!(
                        Instant::now() < deadline,
                        "round {round}: the waiter never waited"
                    );
                    tokio::task::yield_now().await;
                }
                let marks = marks.clone();
                std::thread::spawn(move || marks.answered(round + 1, &ok()));
                let woke = tokio::time::timeout(Duration::from_secs(10), waiting).await;
                assert!(
                    matches!(woke, Ok(Ok(true))),
                    "round {round}: the waiter was not woken ({woke:?})"
                );
            }
        });
    }
}
