//! One client connection: handshake, then read → execute → answer, in order.

use crate::buffers::ConnBuffers;
use crate::exec::answer_deferred_reads;
use crate::exec::{exec_logged, WriteLog};
use crate::ownership::Ownership;
use crate::principals::PrincipalTokens;
use crate::replicate::{fail_answers, rewrite_answers, PushLink, Replicator, RewriteError};
use crate::state::{Refusal, ServerState};
use crate::store::Principal;
use crate::unacked::Cover;
use bytes::{Bytes, BytesMut};
use camelot_proto::{
    decode_frame, encode_frame, DecodeError, ErrorCode, ErrorReply, Frame, FrameDecoder, HelloOk,
    Op, ResponseBatchEncoder, HELLO_BODY_BYTES_MAX, PRINCIPAL_DEFAULT, PROTOCOL_VERSION,
};
use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Read};

use crate::protolog::{warn_limited, NATIVE_REFUSALS};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tracing::{debug, warn};

pub(crate) const READ_CHUNK_BYTES: usize = 64 << 10;
/// Responses are coalesced across pipelined frames, but past this much we write anyway:
/// a few small request frames can ask for very large READs.
const OUT_FLUSH_BYTES: usize = 1 << 20;
/// How long a batch routed at a newer epoch than this server's waits for the server to
/// install it, unless configured otherwise (then it is refused STALE_EPOCH, as before).
/// A map reaches every server's watch within a few ms; one that lags longer is cut off
/// from the map or overloaded. Only the sending connection's own batches wait.
pub const AHEAD_EPOCH_WAIT_DEFAULT: Duration = Duration::from_millis(100);
/// A buffer that grew past this for one big frame is replaced once empty, so an idle
/// connection does not keep pinning up to a frame's worth of memory.
const BUF_KEEP_BYTES: usize = 4 << 20;
/// The input buffer a connection starts with: a whole HELLO frame (proto's largest
/// HELLO body), nothing more, until it has authenticated.
const HELLO_FRAME_BYTES_MAX: usize = 4 + HELLO_BODY_BYTES_MAX;
/// The output buffer a connection starts with (HELLO_OK, or a FATAL); it grows, charged,
/// as answers need.
const OUT_START_BYTES: usize = 4 << 10;
/// How long, and how much, we keep reading (and discarding) after a FATAL before closing.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES_MAX: usize = 1 << 20;
/// At shutdown, bytes taken from the socket per pass before answering what they hold.
const DRAIN_PASS_BYTES_MAX: usize = 4 << 20;

/// Configuration every connection needs.
pub(crate) struct Shared {
    pub state: Arc<ServerState>,
    /// Connections waiting to authenticate, shared with the Redis port.
    pub waiting: Arc<Waiting>,
    pub token: Option<Vec<u8>>,
    pub principal_tokens: PrincipalTokens,
    pub handshake_timeout: Duration,
    pub idle_timeout: Option<Duration>,
    /// See [`AHEAD_EPOCH_WAIT_DEFAULT`].
    pub ahead_epoch_wait: Duration,
    /// Copies this server's writes to their partitions' backups before they are answered.
    pub replicator: Arc<Replicator>,
}

/// The connections still waiting to authenticate, oldest first, on both ports. When
/// their cap is reached a new connection takes the oldest one's place (that one is told
/// and closed), so sockets that never authenticate can delay a real client by one
/// handshake at most, instead of locking it out until they time out.
#[derive(Default)]
pub(crate) struct Waiting {
    queue: parking_lot::Mutex<WaitQueue>,
}

#[derive(Default)]
struct WaitQueue {
    slots: VecDeque<Arc<WaitSlot>>,
    /// Past this length, slots of connections that are done are swept out (kept at
    /// twice the live length after each sweep, so sweeping is amortised O(1)).
    sweep_len: usize,
}

/// One waiting connection's place in [`Waiting`].
pub(crate) struct WaitSlot {
    state: AtomicU8,
    evict: Notify,
}

const SLOT_WAITING: u8 = 0;
const SLOT_DONE: u8 = 1;
const SLOT_EVICTED: u8 = 2;
const WAIT_SWEEP_LEN_MIN: usize = 64;

impl WaitSlot {
    /// Leaves the queue as authenticated or closed; `false` if it was evicted first.
    fn finish(&self) -> bool {
        self.state
            .compare_exchange(SLOT_WAITING, SLOT_DONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

impl Waiting {
    fn push(&self) -> Arc<WaitSlot> {
        let slot = Arc::new(WaitSlot {
            state: AtomicU8::new(SLOT_WAITING),
            evict: Notify::new(),
        });
        let mut q = self.queue.lock();
        q.slots.push_back(Arc::clone(&slot));
        if q.slots.len() > q.sweep_len.max(WAIT_SWEEP_LEN_MIN) {
            q.slots
                .retain(|s| s.state.load(Ordering::Acquire) == SLOT_WAITING);
            q.sweep_len = 2 * q.slots.len();
        }
        slot
    }

    /// Tells the oldest waiting connection to close, and takes its place in the count
    /// of unauthenticated connections; `false` when none is waiting.
    fn evict_oldest(&self) -> bool {
        let mut q = self.queue.lock();
        while let Some(slot) = q.slots.pop_front() {
            if slot
                .state
                .compare_exchange(
                    SLOT_WAITING,
                    SLOT_EVICTED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                slot.evict.notify_one();
                return true;
            }
        }
        false
    }
}

/// Counts a connection as open (and, until it authenticates, as unauthenticated) from
/// accept until its task ends or is aborted.
pub(crate) struct OpenConnection {
    state: Arc<ServerState>,
    /// Its place among the connections waiting to authenticate, until it has.
    waiting: Option<Arc<WaitSlot>>,
}

impl OpenConnection {
    /// Counts a new connection in, or says which cap it would pass. A connection that
    /// still has to authenticate, arriving when `unauthenticated_max` are waiting, takes
    /// the oldest one's place.
    pub fn admit(
        state: &Arc<ServerState>,
        waiting: &Waiting,
        connections_max: usize,
        unauthenticated_max: usize,
        unauthenticated: bool,
    ) -> Result<Self, Refusal> {
        let stats = state.stats();
        match stats.try_admit(connections_max, unauthenticated_max, unauthenticated) {
            Ok(()) => {}
            Err(Refusal::TooManyUnauthenticated) => {
                // The evicted connection's unauthenticated slot is now this one's.
                if !waiting.evict_oldest() {
                    return Err(Refusal::TooManyUnauthenticated);
                }
                if let Err(refusal) = stats.try_admit(connections_max, usize::MAX, false) {
                    stats.unauthenticated_left();
                    return Err(refusal);
                }
            }
            Err(refusal) => return Err(refusal),
        }
        Ok(OpenConnection {
            state: Arc::clone(state),
            waiting: unauthenticated.then(|| waiting.push()),
        })
    }

    /// The connection authenticated: it no longer takes an unauthenticated slot.
    /// `false` if it had been evicted to make room for a newer one (it must close).
    pub fn authenticated(&mut self) -> bool {
        match self.waiting.take() {
            Some(slot) if slot.finish() => {
                self.state.stats().unauthenticated_left();
                true
            }
            Some(_) => false,
            None => true,
        }
    }

    /// Resolves when the connection has been evicted while waiting to authenticate.
    pub async fn evicted(&self) {
        match &self.waiting {
            Some(slot) => slot.evict.notified().await,
            None => std::future::pending().await,
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.authenticated();
        self.state.stats().connection_closed();
    }
}

/// What an evicted connection is told.
pub(crate) const EVICTED_MESSAGE: &str =
    "closed to make room: too many connections waiting to authenticate";

/// Resolves after `limit`, or never when there is none.
pub(crate) async fn sleep_or_never(limit: Option<Duration>) {
    match limit {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

/// Writes all of `buf`, giving up with `TimedOut` when no byte has been taken for
/// `idle` (a peer that stopped reading is then closed rather than held forever).
pub(crate) async fn write_all_idle(
    stream: &mut TcpStream,
    buf: &[u8],
    idle: Option<Duration>,
) -> io::Result<()> {
    let Some(idle) = idle else {
        return stream.write_all(buf).await;
    };
    let mut at = 0;
    while at < buf.len() {
        match tokio::time::timeout(idle, stream.write(&buf[at..])).await {
            Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => at += n,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the peer took nothing for {idle:?}"),
                ))
            }
        }
    }
    Ok(())
}

/// Words for a refused connection, native and Redis port alike.
pub(crate) fn refusal_message(refusal: Refusal) -> &'static str {
    match refusal {
        Refusal::Full => "too many connections",
        Refusal::TooManyUnauthenticated => "too many connections waiting to authenticate",
    }
}

/// Why a connection ended (for the debug log).
enum End {
    PeerClosed,
    PeerClosedMidFrame(usize),
    HandshakeTimeout,
    /// Made room for a newer connection while waiting to authenticate.
    Evicted,
    IdleTimeout,
    NotAClient,
    Fatal(ErrorCode),
    ShutdownRequested,
    Shutdown,
    Io(io::Error),
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::PeerClosed => f.write_str("peer closed"),
            End::PeerClosedMidFrame(n) => {
                write!(f, "peer closed with {n} bytes of an unfinished frame")
            }
            End::HandshakeTimeout => f.write_str("no HELLO in time"),
            End::IdleTimeout => f.write_str("idle timeout"),
            End::Evicted => f.write_str("made room for a newer unauthenticated connection"),
            End::NotAClient => f.write_str("not a Camelot client"),
            End::Fatal(code) => write!(f, "closed after FATAL {code}"),
            End::ShutdownRequested | End::Shutdown => f.write_str("server shutdown"),
            End::Io(e) => write!(f, "I/O error: {e}"),
        }
    }
}

pub(crate) struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
    bufs: ConnBuffers,
    /// Who this connection acts as, from its HELLO: owner of what it allocates.
    principal: Principal,
    /// The last batch's writes that must reach backups (kept for its allocation).
    log: WriteLog,
    /// A fenceable session's generation (see `Hello::fence`); `None` for the rest.
    fence: Option<u64>,
    /// Where this connection's pushed pages go (see `WriteLog::pushes`): one link, made
    /// on first use, to the last target named, and closed with the connection. A link of
    /// its own, so a mover walking on two connections has two pages in flight.
    push_link: Option<PushLink>,
}

/// Resolves once shutdown is requested, or the handle that could request it is gone.
pub(crate) async fn wait_shutdown(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|&stop| stop).await;
}

/// Compares every byte of `expected` whatever `given` holds, so the time taken does not
/// tell an attacker how much of a guess was right.
pub(crate) fn tokens_match(expected: &[u8], given: &[u8]) -> bool {
    let mut diff = u8::from(expected.len() != given.len());
    for (i, &e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(!e);
    }
    std::hint::black_box(diff) == 0
}

/// Errors a client causes by simply disappearing: not worth a warning.
pub(crate) fn peer_went_away(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
    )
}

fn decode_error_code(e: &DecodeError) -> ErrorCode {
    match e {
        DecodeError::FrameTooLarge { .. } | DecodeError::LimitExceeded { .. } => {
            ErrorCode::TooLarge
        }
        _ => ErrorCode::BadRequest,
    }
}

enum Drained {
    Empty,
    MoreWaiting,
    PeerClosed,
}

/// Reads what the kernel already holds for us without waiting for more. Done on a plain
/// socket, not through the reactor, whose cached readiness may not yet know about bytes
/// that have arrived. Stops (as if the socket were empty) when the buffer may not grow.
fn read_available(
    stream: &mut std::net::TcpStream,
    bufs: &mut ConnBuffers,
    state: &ServerState,
) -> io::Result<Drained> {
    let mut taken = 0;
    loop {
        if taken >= DRAIN_PASS_BYTES_MAX {
            return Ok(Drained::MoreWaiting);
        }
        if bufs.reserve_in(READ_CHUNK_BYTES).is_err() {
            return Ok(Drained::Empty);
        }
        let buf = &mut bufs.inbuf;
        let at = buf.len();
        buf.resize(at + READ_CHUNK_BYTES, 0);
        let r = stream.read(&mut buf[at..]);
        let n = *r.as_ref().unwrap_or(&0);
        buf.truncate(at + n);
        match r {
            Ok(0) => return Ok(Drained::PeerClosed),
            Ok(n) => {
                taken += n;
                state.stats().add_bytes_in(n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Drained::Empty),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Tells a connection that was not admitted why, then closes it.
pub(crate) async fn refuse(
    mut stream: TcpStream,
    peer: SocketAddr,
    state: Arc<ServerState>,
    code: ErrorCode,
    message: &str,
) {
    warn_limited!(NATIVE_REFUSALS, %peer, reason = message, "refusing connection");
    state.stats().connection_refused();
    let mut out = BytesMut::new();
    if encode_frame(&Frame::Fatal(ErrorReply::new(code, message)), &mut out).is_ok() {
        let _ = tokio::time::timeout(LINGER, stream.write_all(&out)).await;
    }
    linger_close(&mut stream, &mut BytesMut::new()).await;
}

/// Half-closes, then reads and drops what the peer still sends for a moment. Closing
/// with unread bytes queued makes the kernel send a RST, which can destroy our last
/// frame before the peer has read it. `scratch` is reused as the discard buffer.
pub(crate) async fn linger_close(stream: &mut TcpStream, scratch: &mut BytesMut) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let deadline = Instant::now() + LINGER;
    let mut discarded_bytes = 0;
    let mut chunk = [0u8; 4096];
    while discarded_bytes < LINGER_BYTES_MAX {
        scratch.clear();
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => discarded_bytes += n,
            _ => break,
        }
    }
}

impl Conn {
    /// A connection's task; `None` when its starting buffers do not fit the
    /// connection-buffer budget (it has then been told so and closed).
    pub async fn start(
        stream: TcpStream,
        peer: SocketAddr,
        shared: Arc<Shared>,
        shutdown: watch::Receiver<bool>,
    ) -> Option<Self> {
        if let Err(e) = stream.set_nodelay(true) {
            debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        let budget = shared.state.connection_buffers();
        let bufs = match ConnBuffers::new(budget, HELLO_FRAME_BYTES_MAX, OUT_START_BYTES) {
            Ok(b) => b,
            Err(e) => {
                let msg = format!("connection buffer memory exhausted: {e}");
                refuse(
                    stream,
                    peer,
                    Arc::clone(&shared.state),
                    ErrorCode::OutOfMemory,
                    &msg,
                )
                .await;
                return None;
            }
        };
        Some(Conn {
            stream,
            peer,
            shared,
            shutdown,
            bufs,
            principal: Principal::from(PRINCIPAL_DEFAULT),
            log: WriteLog::default(),
            fence: None,
            push_link: None,
        })
    }

    /// Serves the connection until the peer leaves, breaks the protocol, or the server
    /// shuts down. `open` keeps the connection counted until this returns.
    pub async fn serve(mut self, mut open: OpenConnection) {
        let peer = self.peer;
        debug!(%peer, "connection opened");
        let end = match self.handshake(&open).await {
            Err(End::Evicted) | Ok(()) if !open.authenticated() => {
                // Its place is the newcomer's now: stop counting it before lingering.
                drop(open);
                self.bufs.out.clear();
                self.fatal(ErrorCode::TooLarge, EVICTED_MESSAGE).await
            }
            Ok(()) => match self.serve_frames().await {
                End::ShutdownRequested => self.drain().await,
                end => end,
            },
            Err(end) => end,
        };
        match &end {
            End::Io(e) if !peer_went_away(e) => warn!(%peer, error = %e, "connection failed"),
            _ => debug!(%peer, reason = %end, "connection closed"),
        }
    }

    async fn handshake(&mut self, open: &OpenConnection) -> Result<(), End> {
        let hello = tokio::time::timeout(self.shared.handshake_timeout, self.read_hello());
        let body = tokio::select! {
            read = hello => match read {
                Ok(body) => body?,
                Err(_) => return Err(End::HandshakeTimeout),
            },
            _ = open.evicted() => return Err(End::Evicted),
        };
        let hello = match decode_frame(body) {
            Ok(Frame::Hello(h)) => h,
            Ok(_) => {
                warn_limited!(NATIVE_REFUSALS, peer = %self.peer, "first frame is not a HELLO; closing");
                return Err(self.fatal(ErrorCode::BadRequest, "expected HELLO").await);
            }
            Err(e) => {
                warn_limited!(NATIVE_REFUSALS, peer = %self.peer, error = %e, "bad HELLO; closing");
                return Err(End::NotAClient);
            }
        };
        if hello.version != PROTOCOL_VERSION {
            warn_limited!(
                NATIVE_REFUSALS,
                peer = %self.peer,
                version = hello.version,
                "unsupported protocol version"
            );
            let msg = format!(
                "this server speaks protocol version {PROTOCOL_VERSION}, not {}",
                hello.version
            );
            return Err(self.fatal(ErrorCode::VersionMismatch, msg).await);
        }
        let named = if hello.principal.is_empty() {
            PRINCIPAL_DEFAULT
        } else {
            hello.principal.as_str()
        };
        // A listed principal's own token replaces the cluster token; the reply does not
        // say which was expected, so it tells a prober nothing about who is listed.
        let expected = match self.shared.principal_tokens.token_of(named) {
            Some(own) => Some(own),
            None => self.shared.token.as_deref(),
        };
        if let Some(token) = expected {
            if !tokens_match(token, &hello.token) {
                warn_limited!(
                    NATIVE_REFUSALS,
                    peer = %self.peer,
                    principal = named,
                    "wrong or missing token"
                );
                return Err(self
                    .fatal(ErrorCode::AuthFailed, "wrong or missing token")
                    .await);
            }
        }
        if !hello.principal.is_empty() {
            self.principal = Principal::from(hello.principal);
        }
        let fence_generation = self.shared.state.fence_generation();
        if let Some(generation) = hello.fence {
            if generation != 0 && generation != fence_generation {
                self.shared.state.stats().session_fenced();
                let msg = format!(
                    "this session was fenced (its generation {generation}, the server's \
                     {fence_generation}): its clients went to the server directly"
                );
                return Err(self.fatal(ErrorCode::Fenced, msg).await);
            }
            // A fence between here and the first batch is caught by that batch's check.
            self.fence = Some(if generation == 0 {
                fence_generation
            } else {
                generation
            });
        }
        let ok = Frame::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            epoch: self.shared.state.epoch(),
            fence_generation,
        });
        // Sent with the answers to whatever the client pipelined behind its HELLO.
        encode_frame(&ok, &mut self.bufs.out)
            .map_err(|e| End::Io(io::Error::new(io::ErrorKind::InvalidData, e.to_string())))?;
        if let Err(e) = self.bufs.settle_out() {
            return Err(self.over_budget(e).await);
        }
        Ok(())
    }

    async fn read_hello(&mut self) -> Result<Bytes, End> {
        loop {
            if self.bufs.inbuf.len() >= 4 {
                let b = &self.bufs.inbuf;
                let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
                if len == 0 || len > HELLO_BODY_BYTES_MAX {
                    warn_limited!(
                        NATIVE_REFUSALS,
                        peer = %self.peer,
                        len,
                        "first frame length is no HELLO's; closing"
                    );
                    return Err(End::NotAClient);
                }
                match FrameDecoder::split_frame(&mut self.bufs.inbuf) {
                    Ok(Some(body)) => return Ok(body),
                    Ok(None) => {}
                    Err(_) => return Err(End::NotAClient),
                }
            }
            // Never more than one HELLO frame: what follows it waits in the socket.
            let room = HELLO_FRAME_BYTES_MAX.saturating_sub(self.bufs.inbuf.len());
            if room == 0 {
                return Err(End::NotAClient);
            }
            if let Err(e) = self.bufs.reserve_in(room) {
                return Err(self.over_budget(e).await);
            }
            let mut limited = (&mut self.stream).take(room as u64);
            let r = tokio::select! {
                biased;
                _ = wait_shutdown(&mut self.shutdown) => return Err(End::Shutdown),
                r = limited.read_buf(&mut self.bufs.inbuf) => r,
            };
            self.after_read(r)?;
        }
    }

    fn after_read(&mut self, r: io::Result<usize>) -> Result<(), End> {
        match r {
            Ok(0) if self.bufs.inbuf.is_empty() => Err(End::PeerClosed),
            Ok(0) => Err(End::PeerClosedMidFrame(self.bufs.inbuf.len())),
            Ok(n) => {
                self.shared.state.stats().add_bytes_in(n);
                Ok(())
            }
            Err(e) => Err(End::Io(e)),
        }
    }

    /// The steady state. Returns [`End::ShutdownRequested`] when the server stops.
    async fn serve_frames(&mut self) -> End {
        loop {
            if let Err(end) = self.answer_buffered().await {
                return end;
            }
            // Only once no complete frame is left: pipelined frames share one write.
            if let Err(end) = self.flush().await {
                return end;
            }
            if let Err(e) = self.reserve_for_input() {
                return self.over_budget(e).await;
            }
            tokio::select! {
                biased;
                _ = wait_shutdown(&mut self.shutdown) => return End::ShutdownRequested,
                r = self.stream.read_buf(&mut self.bufs.inbuf) => {
                    if let Err(end) = self.after_read(r) {
                        return end;
                    }
                }
                _ = sleep_or_never(self.shared.idle_timeout) => return End::IdleTimeout,
            }
        }
    }

    /// Room for the rest of a frame whose length is known, charged before the frame
    /// decoder would reserve it (then a no-op), so a big frame is never held uncharged.
    fn reserve_frame_rest(&mut self) -> Result<(), crate::budget::OverBudget> {
        let b = &self.bufs.inbuf;
        if b.len() < 4 {
            return Ok(());
        }
        let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        // An impossible length is refused by the decoder before anything is reserved.
        if FrameDecoder::check_len(len).is_err() || b.len() >= 4 + len {
            return Ok(());
        }
        let rest = 4 + len - b.len();
        self.bufs.reserve_in(rest)
    }

    /// Room for the next read: the rest of a frame, and at least a quarter chunk.
    fn reserve_for_input(&mut self) -> Result<(), crate::budget::OverBudget> {
        self.reserve_frame_rest()?;
        let b = &self.bufs.inbuf;
        if b.capacity() - b.len() < READ_CHUNK_BYTES / 4 {
            self.bufs.reserve_in(READ_CHUNK_BYTES)?;
        }
        Ok(())
    }

    /// Executes every complete frame in the input buffer, appending the answers.
    async fn answer_buffered(&mut self) -> Result<(), End> {
        loop {
            if let Err(e) = self.reserve_frame_rest() {
                return Err(self.over_budget(e).await);
            }
            let body = match FrameDecoder::split_frame(&mut self.bufs.inbuf) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => return Err(self.protocol_error(e).await),
            };
            let batch = match decode_frame(body) {
                Ok(Frame::Requests(batch)) => batch,
                Ok(_) => {
                    warn!(peer = %self.peer, "unexpected frame kind after handshake; closing");
                    return Err(self
                        .fatal(ErrorCode::BadRequest, "expected a REQUESTS frame")
                        .await);
                }
                Err(e) => return Err(self.protocol_error(e).await),
            };
            let wait = self.shared.state.throttle_wait(batch.requests.len() as u64);
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            // Routed at a map this server has not installed yet: its sender (a client, or
            // a primary copying to this backup) read it first. Waits for it, holding
            // nothing, rather than refusing at once: at every epoch change one server
            // installs the map before another, and a copy refused by a backup a moment
            // behind its primary fails its write if a move's switch comes before the
            // repair's next pass (`bench cluster expand --replication 2`).
            if batch.epoch > self.shared.state.epoch() {
                self.shared.state.stats().batch_ahead_of_epoch();
                self.flush().await?;
                self.shared
                    .state
                    .epoch_reached(batch.epoch, self.shared.ahead_epoch_wait)
                    .await;
            }
            // Waits here, holding nothing, for the sessions' running batches.
            if batch.requests.iter().any(|r| matches!(r.op, Op::Fence)) {
                self.shared.state.fence().await;
            }
            let session = match self.fence {
                None => None,
                Some(generation) => match self.shared.state.unfenced(generation).await {
                    Some(guard) => Some(guard),
                    None => {
                        self.shared.state.stats().session_fenced();
                        let msg = "this session was fenced: its clients went to the server \
                                   directly, so nothing more of it runs";
                        return Err(self.fatal(ErrorCode::Fenced, msg).await);
                    }
                },
            };
            let start = self.bufs.out.len();
            let mut enc = ResponseBatchEncoder::begin(&mut self.bufs.out);
            let res = exec_logged(
                &self.shared.state,
                &self.principal,
                &batch,
                &mut enc,
                Some(&mut self.log),
            )
            .and_then(|()| enc.finish());
            drop(session);
            drop(batch);
            if let Err(e) = res {
                self.bufs.out.truncate(start);
                warn!(peer = %self.peer, error = %e, "cannot encode a response frame; closing");
                return Err(self.fatal(ErrorCode::Internal, e.to_string()).await);
            }
            self.push_pages(start).await?;
            self.replicate(start).await?;
            if let Err(e) = self.bufs.settle_out() {
                return Err(self.over_budget(e).await);
            }
            if self.bufs.out.len() >= OUT_FLUSH_BYTES {
                self.flush().await?;
            }
        }
        // The empty buffer may still own a frame-sized allocation.
        self.bufs.shrink_in(BUF_KEEP_BYTES, READ_CHUNK_BYTES);
        Ok(())
    }

    /// Holds the answers of the batch just executed (at `start` in the output) until the
    /// pages it pushed are applied by their targets; a page that is not is answered
    /// REPLICA_UNAVAILABLE (its copies may be in part applied: APPLY is idempotent, and
    /// the mover walks again).
    async fn push_pages(&mut self, start: usize) -> Result<(), End> {
        if self.log.pushes.is_empty() {
            return Ok(());
        }
        let pushes = std::mem::take(&mut self.log.pushes);
        let mut failed = Vec::new();
        for page in pushes.iter().filter(|p| !p.copies.is_empty()) {
            let link = match self.push_link.take() {
                Some(l) if l.to() == page.to => l,
                _ => self.shared.replicator.push_link(page.to),
            };
            let link = self.push_link.insert(link);
            let pushed = link.push(page.epoch, &page.copies).await;
            let stats = self.shared.state.stats();
            stats.page_pushed(page.copies.len() as u64, pushed.is_ok());
            if let Err(e) = pushed {
                let reply = ErrorReply::new(
                    ErrorCode::ReplicaUnavailable,
                    format!("the page's copies were not all applied by {e}"),
                );
                failed.push((page.at, reply));
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        self.rewrite_out(start, fail_answers(&self.bufs.out[start..], &failed))
            .await
    }

    /// Holds the answers of the batch just executed (at `start` in the output) until its
    /// writes are on every backup; those that are not become REPLICA_UNAVAILABLE. Then
    /// answers its deferred reads (keys holding unacknowledged writes) once they settle.
    async fn replicate(&mut self, start: usize) -> Result<(), End> {
        let Some(own) = self.log.ownership.take() else {
            return Ok(());
        };
        let deferred = std::mem::take(&mut self.log.deferred_reads);
        if !self.log.writes.is_empty() {
            self.replicate_writes(start, &own).await?;
        }
        if !deferred.is_empty() {
            self.answer_deferred(start, own.epoch(), &deferred).await?;
        }
        Ok(())
    }

    async fn replicate_writes(&mut self, start: usize, own: &Arc<Ownership>) -> Result<(), End> {
        let claims = std::mem::take(&mut self.log.pending);
        let rep = &self.shared.replicator;
        if rep.acks_before_replication() {
            let (rep, own, writes) = (Arc::clone(rep), Arc::clone(own), self.log.writes.clone());
            self.log.writes.clear();
            tokio::spawn(async move {
                let failed = rep.replicate(&own, &writes).await.is_err();
                // Claims first: a repair pass skips keys still claimed, and one that ran
                // at once (the epoch already past) would find nothing and stop.
                drop(claims);
                if failed {
                    rep.repair_soon(own.epoch());
                }
            });
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + rep.timeout();
        let mut result = rep.replicate(own, &self.log.writes).await;
        if result.is_err() {
            let resent = rep
                .resend_at_next_epoch(own, &self.log.writes, deadline)
                .await;
            self.shared.state.stats().replica_copies_failed(resent);
            if resent {
                result = Ok(());
            }
        }
        let Err(e) = result else {
            // Settled only now: the copies are confirmed.
            drop(claims);
            self.log.writes.clear();
            return Ok(());
        };
        // A copy failed — most often refused by a backup already at the next epoch, which
        // this server reaches a moment later. The repair sends the keys again while this
        // server is their primary; each answer waits (until the replication deadline) for
        // a copy covering its write, and is acknowledged if one comes. The waits are
        // registered while the claims still hold the keys, so none can be let go unseen.
        let unacked = Arc::clone(self.shared.state.unacked());
        let covers: Vec<Option<Cover>> = claims
            .iter()
            .map(|c| c.ticket().map(|t| unacked.await_cover(c.key(), t)))
            .collect();
        drop(claims);
        Replicator::repair_soon(&self.shared.replicator, own.epoch());
        loop {
            let notice = unacked.settled_notice();
            if covers.iter().flatten().all(|c| c.outcome().is_some()) {
                break;
            }
            if tokio::time::timeout_at(deadline, notice).await.is_err() {
                break;
            }
        }
        // `pending` and `writes` are pushed together, one per write that took effect.
        // What each write not acknowledged is told: why its wait ended.
        let first = e.reply();
        let failed: Vec<(usize, ErrorReply)> = self
            .log
            .writes
            .drain(..)
            .zip(&covers)
            .filter_map(|((at, _), c)| {
                let why = match c.as_ref().and_then(Cover::outcome) {
                    Some(true) => return None,
                    Some(false) => "; then this server stopped being the key's primary",
                    None => "; no later copy reached every backup in time",
                };
                Some((
                    at,
                    ErrorReply::new(first.code, format!("{}{why}", first.message)),
                ))
            })
            .collect();
        drop(covers);
        if failed.is_empty() {
            debug!(peer = %self.peer, error = %e, "writes acknowledged after their copies were sent again");
            return Ok(());
        }
        debug!(peer = %self.peer, error = %e, writes = failed.len(), "writes not acknowledged");
        self.shared
            .state
            .stats()
            .replica_writes_failed(failed.len() as u64);
        self.rewrite_out(start, fail_answers(&self.bufs.out[start..], &failed))
            .await
    }

    /// Waits (at most the replication timeout) until the keys of `reads` have settled,
    /// then answers them again in place.
    async fn answer_deferred(
        &mut self,
        start: usize,
        epoch: u64,
        reads: &[(usize, Bytes)],
    ) -> Result<(), End> {
        let unacked = Arc::clone(self.shared.state.unacked());
        let deadline = tokio::time::Instant::now() + self.shared.replicator.timeout();
        loop {
            let notice = unacked.settled_notice();
            if reads.iter().all(|(_, k)| unacked.is_settled(k)) {
                break;
            }
            if tokio::time::timeout_at(deadline, notice).await.is_err() {
                break;
            }
        }
        let frame_len = self.bufs.out.len() - start;
        let answers = answer_deferred_reads(&self.shared.state, epoch, reads, frame_len);
        let rewritten = rewrite_answers(&self.bufs.out[start..], |i, _| {
            answers
                .iter()
                .find(|(at, _)| *at == i)
                .map(|(_, a)| a.clone())
        });
        self.rewrite_out(start, rewritten).await
    }

    /// Puts a rewritten answer frame in place of the one at `start`.
    async fn rewrite_out(
        &mut self,
        start: usize,
        frame: Result<BytesMut, RewriteError>,
    ) -> Result<(), End> {
        match frame {
            Ok(frame) => {
                self.bufs.out.truncate(start);
                self.bufs.out.extend_from_slice(&frame);
                Ok(())
            }
            Err(re) => {
                self.bufs.out.truncate(start);
                warn!(peer = %self.peer, error = %re, "cannot rewrite a response frame; closing");
                Err(self.fatal(ErrorCode::Internal, re.to_string()).await)
            }
        }
    }

    async fn flush(&mut self) -> Result<(), End> {
        if self.bufs.out.is_empty() {
            return Ok(());
        }
        write_all_idle(&mut self.stream, &self.bufs.out, self.shared.idle_timeout)
            .await
            .map_err(End::Io)?;
        self.shared.state.stats().add_bytes_out(self.bufs.out.len());
        self.bufs.clear_out(BUF_KEEP_BYTES, READ_CHUNK_BYTES);
        Ok(())
    }

    /// The connection's buffers would pass the connection-buffer budget: say so and close.
    async fn over_budget(&mut self, e: crate::budget::OverBudget) -> End {
        warn!(peer = %self.peer, error = %e, "connection buffer budget exhausted; closing");
        self.fatal(
            ErrorCode::OutOfMemory,
            format!("connection buffer memory exhausted: {e}"),
        )
        .await
    }

    async fn protocol_error(&mut self, e: DecodeError) -> End {
        warn!(peer = %self.peer, error = %e, "malformed frame; closing connection");
        self.fatal(decode_error_code(&e), e.to_string()).await
    }

    /// Sends whatever answers are pending, then FATAL, then closes.
    async fn fatal(&mut self, code: ErrorCode, message: impl Into<String>) -> End {
        let frame = Frame::Fatal(ErrorReply::new(code, message));
        if encode_frame(&frame, &mut self.bufs.out).is_ok() {
            if let Err(end) = self.flush().await {
                return end;
            }
        }
        linger_close(&mut self.stream, &mut self.bufs.inbuf).await;
        End::Fatal(code)
    }

    /// Answers every frame the peer had completely sent when shutdown came, then closes.
    async fn drain(mut self) -> End {
        loop {
            let mut std_stream = match self.stream.into_std() {
                Ok(s) => s,
                Err(e) => return End::Io(e),
            };
            let drained = read_available(&mut std_stream, &mut self.bufs, &self.shared.state);
            self.stream = match TcpStream::from_std(std_stream) {
                Ok(s) => s,
                Err(e) => return End::Io(e),
            };
            let drained = match drained {
                Ok(d) => d,
                Err(e) => return End::Io(e),
            };
            if let Err(end) = self.answer_buffered().await {
                return end;
            }
            if let Err(end) = self.flush().await {
                return end;
            }
            match drained {
                Drained::MoreWaiting => continue,
                Drained::Empty | Drained::PeerClosed => break,
            }
        }
        if !self.bufs.inbuf.is_empty() {
            debug!(peer = %self.peer, bytes = self.bufs.inbuf.len(), "dropping an unfinished frame at shutdown");
        }
        let _ = self.stream.shutdown().await;
        End::Shutdown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_exactly() {
        assert!(tokens_match(b"secret", b"secret"));
        assert!(!tokens_match(b"secret", b"secreT"));
        assert!(!tokens_match(b"secret", b"secret\0"));
        assert!(!tokens_match(b"secret", b"secre"));
        assert!(!tokens_match(b"secret", b""));
        assert!(!tokens_match(b"\0", b""));
        assert!(tokens_match(b"", b""));
    }

    #[test]
    fn the_oldest_waiting_connection_is_evicted_and_only_once() {
        let w = Waiting::default();
        let a = w.push();
        let b = w.push();
        let c = w.push();
        // b authenticated: it is skipped, and never evicted afterwards.
        assert!(b.finish());
        assert!(w.evict_oldest());
        assert_eq!(a.state.load(Ordering::Acquire), SLOT_EVICTED);
        // An evicted connection that authenticates after all is told it lost its place.
        assert!(!a.finish());
        assert!(w.evict_oldest());
        assert_eq!(c.state.load(Ordering::Acquire), SLOT_EVICTED);
        assert!(!w.evict_oldest());
        assert_eq!(b.state.load(Ordering::Acquire), SLOT_DONE);
    }

    #[test]
    fn finished_slots_are_swept_so_the_queue_stays_short() {
        let w = Waiting::default();
        let live = w.push();
        for _ in 0..10_000 {
            assert!(w.push().finish());
        }
        assert!(w.queue.lock().slots.len() <= 2 * WAIT_SWEEP_LEN_MIN + 2);
        assert!(w.evict_oldest());
        assert_eq!(live.state.load(Ordering::Acquire), SLOT_EVICTED);
    }

    #[test]
    fn oversized_frames_map_to_too_large() {
        assert_eq!(
            decode_error_code(&DecodeError::FrameTooLarge { len: 1, max: 0 }),
            ErrorCode::TooLarge
        );
        assert_eq!(
            decode_error_code(&DecodeError::BadMagic),
            ErrorCode::BadRequest
        );
    }
}
