//! Camelot's memory server: regions in a capped arena, served over the wire format of
//! `camelot-proto`.
//!
//! The pure parts ([`budget`], [`store`], [`exec`]) know nothing of sockets; [`ServerHandle`]
//! puts them behind a TCP listener on the current tokio runtime.
#![forbid(unsafe_code)]

pub use camelot_proto::budget;
mod buffers;
mod conn;
pub mod dev;
pub mod exec;
pub mod objects;
pub mod ownership;
pub mod principals;
mod protolog;
pub mod replicate;
pub mod resp;
pub mod state;
pub mod store;
pub mod throttle;
pub mod unacked;

pub use budget::{MemoryBudget, OverBudget, Reservation};
pub use exec::exec;
pub use state::{ServerState, Stats, STAT_EXPOSED_WITHOUT_TOKEN};
pub use store::{Principal, Quota, Region, RegionStore, Usage};

use camelot_proto::limits::TOKEN_BYTES_MAX;
use camelot_proto::ErrorCode;
pub use conn::AHEAD_EPOCH_WAIT_DEFAULT;
use conn::{Conn, OpenConnection, Shared};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tracing::{error, info, warn};

/// Pause after a failed accept (typically out of file descriptors) before trying again,
/// so the loop does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub memory_bytes_max: u64,
    /// Cluster token a client must present; `None` serves anyone who can connect.
    pub token: Option<Vec<u8>>,
    /// Connections beyond this are told FATAL TOO_LARGE (Redis port: `-ERR max number of
    /// clients reached`) and closed. At least 1.
    pub connections_max: usize,
    /// Of those, how many may be open without having authenticated yet (native: before
    /// HELLO; Redis port with a token: before AUTH), so idle sockets that never
    /// authenticate cannot lock real clients out. At least 1; a value above
    /// `connections_max` means `connections_max`.
    pub unauthenticated_connections_max: usize,
    /// Bytes all connections' input and output buffers may hold together, a budget of
    /// its own beside `memory_bytes_max` (shown by STATS as `connection_buffers_*`). A
    /// connection whose buffers would pass it is answered with an error and closed.
    pub connection_buffers_bytes_max: u64,
    /// Cluster-map epoch; batches routed with another (non-zero) epoch get STALE_EPOCH.
    pub epoch: u64,
    /// How long [`ServerHandle::shutdown`] waits for connections to finish their answers.
    pub shutdown_grace: Duration,
    /// How long a new connection may take to authenticate: send its HELLO (native), or
    /// AUTH successfully (Redis port, when there is a token); then it is closed.
    pub handshake_timeout: Duration,
    /// A connection on which nothing arrives, or which takes none of our answers, for
    /// this long is closed (`None`: never, like Redis's `timeout 0`).
    pub idle_timeout: Option<Duration>,
    /// Where to serve the Redis protocol over the same objects (`None`: not at all).
    pub resp_listen: Option<SocketAddr>,
    /// Threads serving the Redis port, each an event loop of its own (a single-threaded
    /// runtime) sharing the listening socket; 0 serves it on the caller's runtime, like
    /// the native port. Redis clients send small commands on many connections, where a
    /// work-stealing runtime spends more on waking its idle workers than the work is
    /// worth: measured with redis-benchmark on two cores, see BENCHMARKS.md.
    pub resp_threads: usize,
    /// How long each of those event loops keeps polling after its last command, while
    /// its CPU is not wanted by others (see `resp::spin`); zero: sleep at once, as
    /// Redis does. At most [`resp::SPIN_IDLE_MAX`].
    pub resp_poll: Duration,
    /// Longest argument the Redis port reads (`--proto-max-bulk-len`, Redis's name and
    /// default); at least [`resp::codec::PROTO_MAX_BULK_LEN_MIN`].
    pub proto_max_bulk_len: usize,
    /// What each principal may hold in regions (default: no limit but the memory cap).
    pub quota: Quota,
    /// Refuse to start without a token, instead of warning when serving beyond loopback.
    pub require_token: bool,
    /// Principals that must present their own token instead of the cluster token (native
    /// port; see [`principals`]). Empty: every name goes with the cluster token.
    pub principal_tokens: principals::PrincipalTokens,
    /// Executed operations per second, over both ports together (`--ops-per-sec-max`;
    /// `None`: no limit). A slow node's stand-in where cgroup v2 `cpu.max` is not
    /// available; see [`throttle`].
    pub ops_per_sec_max: Option<u64>,
    /// How long a write on a partition with backups waits for them before it is
    /// answered REPLICA_UNAVAILABLE (see [`replicate`]).
    pub replication_timeout: Duration,
    /// How long a native batch routed at an epoch this server has not installed yet waits
    /// for it before it is refused STALE_EPOCH (`AHEAD_EPOCH_WAIT_DEFAULT`).
    pub ahead_epoch_wait: Duration,
    /// Keep the partition-order key index (see [`objects`]): a cluster node's, so a
    /// partition move's scans read only the moving partitions. Costs every new key one
    /// more index insert; a lone server leaves it off.
    pub partition_index: bool,
    /// Deliberately broken: answer writes before their backups have them (the copies go
    /// out afterwards). Only for showing that a failover test's checker catches the
    /// writes this loses; never set it otherwise.
    pub unsafe_ack_before_replication: bool,
}

impl ServerConfig {
    pub fn new(listen: SocketAddr, memory_bytes_max: u64) -> Self {
        ServerConfig {
            listen,
            memory_bytes_max,
            token: None,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            unauthenticated_connections_max: UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT,
            connection_buffers_bytes_max: CONNECTION_BUFFERS_BYTES_DEFAULT,
            epoch: 0,
            shutdown_grace: Duration::from_secs(10),
            handshake_timeout: HANDSHAKE_TIMEOUT_DEFAULT,
            idle_timeout: None,
            resp_listen: None,
            resp_threads: RESP_THREADS_DEFAULT,
            resp_poll: resp::SPIN_IDLE_DEFAULT,
            proto_max_bulk_len: resp::codec::PROTO_MAX_BULK_LEN_DEFAULT,
            quota: Quota::UNLIMITED,
            require_token: false,
            principal_tokens: principals::PrincipalTokens::default(),
            ops_per_sec_max: None,
            ahead_epoch_wait: AHEAD_EPOCH_WAIT_DEFAULT,
            replication_timeout: replicate::REPLICATION_TIMEOUT_DEFAULT,
            partition_index: false,
            unsafe_ack_before_replication: false,
        }
    }
}

/// Concurrent connections unless configured otherwise.
pub const CONNECTIONS_MAX_DEFAULT: usize = 1024;
/// Connections that have not authenticated yet, unless configured otherwise: enough for
/// a burst of clients connecting at once, few enough to leave most slots to clients
/// that have authenticated.
pub const UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT: usize = 64;
/// The connection-buffer budget unless configured otherwise: 1024 connections' starting
/// buffers (64 KiB in and out once authenticated) plus room for a few 32 MiB values.
pub const CONNECTION_BUFFERS_BYTES_DEFAULT: u64 = 256 << 20;
/// The smallest connection-buffer budget: one authenticated connection's starting buffers.
pub const CONNECTION_BUFFERS_BYTES_MIN: u64 = 2 * conn::READ_CHUNK_BYTES as u64;
/// How long a connection may take to authenticate unless configured otherwise.
pub const HANDSHAKE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// The Redis port's event-loop threads unless configured otherwise.
pub const RESP_THREADS_DEFAULT: usize = 1;
/// Most event-loop threads the Redis port may be given.
pub const RESP_THREADS_MAX: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the listening address: {0}")]
    LocalAddr(#[source] std::io::Error),
    #[error(
        "{connections} connection(s) had not finished {grace:?} after shutdown began; \
         they were cut off"
    )]
    GraceExpired { connections: usize, grace: Duration },
    #[error("the accept loop failed: {0}")]
    AcceptLoop(#[source] JoinError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("a Redis-protocol thread ended without reporting (it panicked)")]
    RespThreadLost,
}

/// A running server. Dropping it without [`ServerHandle::shutdown`] also stops the server,
/// in the background.
pub struct ServerHandle {
    local_addr: SocketAddr,
    resp_addr: Option<SocketAddr>,
    state: Arc<ServerState>,
    stop: watch::Sender<bool>,
    accept: JoinHandle<Result<(), ServerError>>,
    /// One per accept loop of the Redis port.
    resp_accept: Vec<JoinHandle<Result<(), ServerError>>>,
}

/// Which protocol a listener speaks.
#[derive(Clone)]
enum Face {
    Native(Arc<Shared>),
    Resp(Arc<resp::RespShared>),
}

impl Face {
    fn state(&self) -> &Arc<ServerState> {
        match self {
            Face::Native(s) => &s.state,
            Face::Resp(s) => &s.state,
        }
    }

    fn waiting(&self) -> &conn::Waiting {
        match self {
            Face::Native(s) => &s.waiting,
            Face::Resp(s) => &s.waiting,
        }
    }
}

/// How often expired objects are swept (lazily expired ones are already invisible; this
/// gives their memory back).
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), ServerError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })?;
    let local = listener.local_addr().map_err(ServerError::LocalAddr)?;
    Ok((listener, local))
}

impl ServerHandle {
    /// Binds `config.listen` and starts accepting on the current tokio runtime.
    pub async fn start(config: ServerConfig) -> Result<ServerHandle, ServerError> {
        if let Some(token) = &config.token {
            if token.is_empty() {
                // A client without a token sends an empty one: this would let it in.
                return Err(ServerError::Config(
                    "the token must not be empty (leave it unset to serve without one)".into(),
                ));
            }
            if token.len() > TOKEN_BYTES_MAX {
                return Err(ServerError::Config(format!(
                    "the token is {} bytes; the protocol carries at most {TOKEN_BYTES_MAX}",
                    token.len()
                )));
            }
        }
        if config.require_token && config.token.is_none() {
            return Err(ServerError::Config(
                "a token is required (--require-token) but none was given: \
                 set --token or CAMELOT_TOKEN"
                    .into(),
            ));
        }
        if config.connections_max == 0 {
            return Err(ServerError::Config(
                "connections_max must be at least 1: no client could connect".into(),
            ));
        }
        if config.unauthenticated_connections_max == 0 {
            return Err(ServerError::Config(
                "unauthenticated_connections_max must be at least 1: no client could \
                 connect to authenticate"
                    .into(),
            ));
        }
        if config.memory_bytes_max == 0 {
            return Err(ServerError::Config(
                "the memory cap must be more than 0 bytes: nothing could be stored".into(),
            ));
        }
        if config.connection_buffers_bytes_max < CONNECTION_BUFFERS_BYTES_MIN {
            return Err(ServerError::Config(format!(
                "the connection-buffer budget must be at least {CONNECTION_BUFFERS_BYTES_MIN} \
                 bytes (one connection's starting buffers), not {}",
                config.connection_buffers_bytes_max
            )));
        }
        if config.handshake_timeout.is_zero() || config.idle_timeout.is_some_and(|d| d.is_zero()) {
            return Err(ServerError::Config(
                "the handshake and idle timeouts must be longer than zero".into(),
            ));
        }
        if config.resp_poll > resp::SPIN_IDLE_MAX {
            return Err(ServerError::Config(format!(
                "the Redis port polls at most {:?} after its last command, not {:?}",
                resp::SPIN_IDLE_MAX,
                config.resp_poll
            )));
        }
        if config.proto_max_bulk_len < resp::codec::PROTO_MAX_BULK_LEN_MIN {
            return Err(ServerError::Config(format!(
                "proto-max-bulk-len must be at least {} bytes, not {}",
                resp::codec::PROTO_MAX_BULK_LEN_MIN,
                config.proto_max_bulk_len
            )));
        }
        let (listener, local_addr) = bind(config.listen).await?;
        let resp = match config.resp_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let mut state = ServerState::with_limits(
            MemoryBudget::new(config.memory_bytes_max),
            MemoryBudget::new(config.connection_buffers_bytes_max),
            config.epoch,
            config.quota,
        );
        if config.partition_index {
            state.objects_mut().index_partitions();
        }
        let state = Arc::new(state);
        let limits = AcceptLimits {
            connections_max: config.connections_max,
            unauthenticated_max: config
                .unauthenticated_connections_max
                .min(config.connections_max),
            grace: config.shutdown_grace,
        };
        let exposed = state::exposed_without_token(
            config.token.is_some(),
            std::iter::once(local_addr).chain(resp.as_ref().map(|(_, a)| *a)),
        );
        if exposed {
            warn!(
                addr = %local_addr,
                "serving beyond loopback WITHOUT A TOKEN: anyone who can reach this port \
                 can read, write and free memory; set --token (or --require-token)"
            );
        }
        state.set_exposed_without_token(exposed);
        if let Some(ops) = config.ops_per_sec_max {
            state.set_ops_per_sec_max(ops);
            info!(ops_per_sec_max = ops, "throttling executed operations");
        }
        info!(
            addr = %local_addr,
            memory_cap_bytes = config.memory_bytes_max,
            token = if config.token.is_some() { "yes" } else { "no" },
            connections_max = config.connections_max,
            unauthenticated_connections_max = limits.unauthenticated_max,
            connection_buffers_cap_bytes = config.connection_buffers_bytes_max,
            "memory server listening"
        );
        let (stop, stop_rx) = watch::channel(false);
        let resp_addr = resp.as_ref().map(|(_, a)| *a);
        let waiting = Arc::new(conn::Waiting::default());
        let mut resp_accept = Vec::new();
        if let Some((listener, addr)) = resp {
            info!(%addr, threads = config.resp_threads, "Redis-protocol port listening");
            let face = Face::Resp(Arc::new(resp::RespShared {
                state: Arc::clone(&state),
                waiting: Arc::clone(&waiting),
                token: config.token.clone(),
                proto_max_bulk_len: config.proto_max_bulk_len,
                handshake_timeout: config.handshake_timeout,
                idle_timeout: config.idle_timeout,
            }));
            if config.resp_threads == 0 {
                resp_accept.push(tokio::spawn(accept_loop(
                    listener,
                    face,
                    stop_rx.clone(),
                    limits,
                )));
            } else {
                resp_accept = spawn_event_loops(
                    listener,
                    face,
                    &stop_rx,
                    limits,
                    config.resp_threads,
                    config.resp_poll,
                )?;
            }
        }
        tokio::spawn(sweep_loop(Arc::clone(&state), stop_rx.clone()));
        let face = Face::Native(Arc::new(Shared {
            state: Arc::clone(&state),
            waiting,
            token: config.token.clone(),
            principal_tokens: config.principal_tokens,
            handshake_timeout: config.handshake_timeout,
            idle_timeout: config.idle_timeout,
            ahead_epoch_wait: config.ahead_epoch_wait,
            replicator: Arc::new(
                replicate::Replicator::new(
                    Arc::clone(&state),
                    config.token.clone(),
                    config.replication_timeout,
                )
                .ack_before_replication(config.unsafe_ack_before_replication),
            ),
        }));
        let accept = tokio::spawn(accept_loop(listener, face, stop_rx, limits));
        Ok(ServerHandle {
            local_addr,
            resp_addr,
            state,
            stop,
            accept,
            resp_accept,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where the Redis-protocol port listens, when it was asked for.
    pub fn resp_addr(&self) -> Option<SocketAddr> {
        self.resp_addr
    }

    /// The counters STATS returns.
    pub fn stats(&self) -> Vec<(String, u64)> {
        self.state.stats_snapshot()
    }

    /// The server's store, counters and epoch (for embedding and tests).
    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }

    /// Changes the epoch batches are checked against; new handshakes report it too.
    pub fn set_epoch(&self, epoch: u64) {
        self.state.set_epoch(epoch);
    }

    /// Installs the partitions this server owns under a newer cluster map (see
    /// [`state::ServerState::set_ownership`]); false when it is not newer.
    pub fn set_ownership(&self, ownership: ownership::Ownership) -> bool {
        self.state.set_ownership(ownership)
    }

    /// Stops accepting; every connection answers the frames it has already received,
    /// flushes and closes. Connections still busy after `shutdown_grace` are cut off and
    /// reported as [`ServerError::GraceExpired`].
    pub async fn shutdown(self) -> Result<(), ServerError> {
        self.stop.send_replace(true);
        let native = self.accept.await.map_err(ServerError::AcceptLoop)?;
        let mut result = native;
        for h in self.resp_accept {
            let resp = h.await.map_err(ServerError::AcceptLoop)?;
            result = result.and(resp);
        }
        result
    }
}

async fn sweep_loop(state: Arc<ServerState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SWEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = conn::wait_shutdown(&mut stop) => return,
            _ = tick.tick() => {
                let removed = state.objects().sweep_expired(std::time::Instant::now());
                if removed > 0 {
                    tracing::debug!(removed, "swept expired objects");
                }
            }
        }
    }
}

/// Starts `threads` event loops for one listening socket, each a thread running a
/// single-threaded runtime with its own accept loop (the kernel hands each connection to
/// one of them). Each loop's outcome is reported through a task on the caller's runtime,
/// so shutdown awaits them like any other accept loop.
fn spawn_event_loops(
    listener: TcpListener,
    face: Face,
    stop: &watch::Receiver<bool>,
    limits: AcceptLimits,
    threads: usize,
    poll: Duration,
) -> Result<Vec<JoinHandle<Result<(), ServerError>>>, ServerError> {
    if threads > RESP_THREADS_MAX {
        return Err(ServerError::Config(format!(
            "the Redis port takes at most {RESP_THREADS_MAX} threads, not {threads}"
        )));
    }

    let listener = listener.into_std().map_err(ServerError::Runtime)?;
    let mut loops = Vec::with_capacity(threads);
    for i in 0..threads {
        let listener = listener.try_clone().map_err(ServerError::Runtime)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ServerError::Runtime)?;
        let (face, stop) = (face.clone(), stop.clone());
        let (done, outcome) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("camelot-resp-{i}"))
            .spawn(move || {
                let result = runtime.block_on(async move {
                    let listener = TcpListener::from_std(listener).map_err(ServerError::Runtime)?;
                    // Dropped with the runtime once the accept loop has drained.
                    tokio::spawn(resp::spin_loop(poll));
                    accept_loop(listener, face, stop, limits).await
                });
                // Nobody listening means the handle was dropped: nothing to report to.
                let _ = done.send(result);
            })
            .map_err(ServerError::Runtime)?;
        loops.push(tokio::spawn(async move {
            outcome.await.unwrap_or(Err(ServerError::RespThreadLost))
        }));
    }
    Ok(loops)
}

#[derive(Debug, Clone, Copy)]
struct AcceptLimits {
    connections_max: usize,
    unauthenticated_max: usize,
    grace: Duration,
}

async fn accept_loop(
    listener: TcpListener,
    face: Face,
    mut stop: watch::Receiver<bool>,
    limits: AcceptLimits,
) -> Result<(), ServerError> {
    let AcceptLimits {
        connections_max,
        unauthenticated_max,
        grace,
    } = limits;
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            _ = conn::wait_shutdown(&mut stop) => break,
            Some(joined) = conns.join_next(), if !conns.is_empty() => log_panic(joined),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let state = face.state();
                    // Without a token the Redis port has no handshake to wait for.
                    let unauthenticated = match &face {
                        Face::Native(_) => true,
                        Face::Resp(shared) => shared.token.is_some(),
                    };
                    // Counted here, not in the task, so a burst of accepts cannot overshoot.
                    let admitted = OpenConnection::admit(
                        state,
                        face.waiting(),
                        connections_max,
                        unauthenticated_max,
                        unauthenticated,
                    );
                    match (&face, admitted) {
                        (Face::Native(shared), Ok(open)) => {
                            let (shared, stop) = (Arc::clone(shared), stop.clone());
                            conns.spawn(async move {
                                if let Some(conn) = Conn::start(stream, peer, shared, stop).await {
                                    conn.serve(open).await;
                                }
                            });
                        }
                        (Face::Native(_), Err(refusal)) => {
                            conns.spawn(conn::refuse(
                                stream,
                                peer,
                                Arc::clone(state),
                                ErrorCode::TooLarge,
                                conn::refusal_message(refusal),
                            ));
                        }
                        (Face::Resp(shared), Ok(open)) => {
                            conns.spawn(resp::serve(stream, peer, Arc::clone(shared), stop.clone(), open));
                        }
                        (Face::Resp(_), Err(refusal)) => {
                            conns.spawn(resp::refuse(stream, peer, Arc::clone(state), refusal));
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::select! {
                        _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                        _ = conn::wait_shutdown(&mut stop) => break,
                    }
                }
            },
        }
    }
    drop(listener);
    info!(
        connections = conns.len(),
        "memory server stopping: answering in-flight requests"
    );
    let deadline = tokio::time::sleep(grace);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            joined = conns.join_next() => match joined {
                Some(joined) => log_panic(joined),
                None => break,
            },
            _ = &mut deadline => {
                let connections = conns.len();
                warn!(connections, ?grace, "shutdown grace expired; cutting connections off");
                conns.abort_all();
                while conns.join_next().await.is_some() {}
                return Err(ServerError::GraceExpired { connections, grace });
            }
        }
    }
    info!("memory server stopped");
    Ok(())
}

fn log_panic(joined: Result<(), JoinError>) {
    if let Err(e) = joined {
        if e.is_panic() {
            error!(error = %e, "a connection task panicked");
        }
    }
}
