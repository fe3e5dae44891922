//! The request API for tasks on a tokio runtime, with every connection driven by two tasks
//! on that same runtime instead of by threads of its own.
//!
//! Why a second face: the threaded [`crate::Client`] wakes an application thread for each
//! answer frame that carries one of its requests; with more threads than cores every such
//! wake-up is a context switch, and on a 2-core VM those cost more than the requests
//! (see BENCHMARKS.md). Here submitters are tasks: an answer frame completes its requests'
//! slots and the tasks run on the reader's own thread, and everything they submit while
//! the writer task waits its turn leaves in one frame. Nothing blocks a thread but the
//! runtime's own poll for readiness.
//!
//! What it does not do that the threaded client does: it has no blocking wait (a thread
//! blocking on an answer would stop the loop that brings it) and no `set_map`; a dead
//! connection is replaced at the next submit to its node, as there.

use crate::completion::{AnswerHook, Completion};
use crate::conn::INFLIGHT_REQUESTS_MAX;
use crate::frame::{
    complete_frame, decode_answer, hello_answer, hello_frame, FrameLimits, Submission,
    HELLO_ANSWER_BYTES_MAX,
};
use crate::{reply, ClientConfig, ClientError, ClusterMap, NodeId, Region};
use bytes::{Bytes, BytesMut};
use camelot_proto::limits::BATCH_OPS_MAX;
use camelot_proto::{FrameDecoder, Op, Reply};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How often an idle reader looks for a request that has waited too long.
const WATCHDOG_TICK: Duration = Duration::from_millis(100);
/// A submitter that finds this many requests queued has them written at once (by a task
/// it spawns and awaits, so that dropping the submit cannot cut the flush short) instead
/// of leaving them to the writer task. The writer runs after every task woken by an answer frame, so
/// left alone a round of 16 tasks × 16 requests would leave as one frame, and the server
/// would idle while the tasks build it and the tasks idle while the server answers it;
/// frames of this size keep both busy. Measured on 2 cores (16 × 16 reads of 64 B): see
/// BENCHMARKS.md.
pub const EAGER_FLUSH_OPS: usize = 64;
const READ_CHUNK_BYTES: usize = 256 << 10;
/// A frame larger than this does not leave its allocation behind in the read buffer.
const BUFFER_KEEP_BYTES: usize = 4 * READ_CHUNK_BYTES;

/// A frame's requests, by id, in the order their answers will come.
type AnswerSlots = Vec<(u64, Arc<Completion>)>;

/// A handle to the cluster for tasks; cheap to clone. Create it inside the runtime that
/// will drive it (its connections' tasks are spawned there).
#[derive(Clone)]
pub struct LoopClient {
    inner: Arc<Inner>,
}

struct Inner {
    config: ClientConfig,
    map: ClusterMap,
    /// A short list: maps have few nodes, and this is looked up on every submit.
    nodes: Mutex<Vec<(NodeId, Arc<LoopConn>)>>,
    next_id: AtomicU64,
    losses: Arc<Losses>,
}

/// The first end of one of a client's connections that nobody asked for (the server went
/// away, a read or write failed, a request timed out, a frame made no sense); shared by
/// the client's connections. A connection this client closed itself is no loss.
#[derive(Default)]
struct Losses {
    first: Mutex<Option<ClientError>>,
    told: Notify,
}

impl Losses {
    fn lost(&self, err: &ClientError) {
        let mut first = self.first.lock();
        if first.is_none() {
            *first = Some(err.clone());
            drop(first);
            self.told.notify_waiters();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, conn) in self.nodes.get_mut().iter() {
            conn.close();
        }
    }
}

/// A submitted request's slot until it is queued; completed with
/// [`ClientError::Cancelled`] if dropped armed. A drop during `enqueue`'s own flush,
/// after the request was queued, completes it too: its hook then hears of a request
/// that may yet be answered (the real answer is ignored), which errs on the safe side.
struct Unqueued(Option<Arc<Completion>>);

impl Unqueued {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Unqueued {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.complete(Err(ClientError::Cancelled));
        }
    }
}

/// An answer to come; `.await` it.
pub struct LoopPending {
    slot: Arc<Completion>,
}

impl LoopPending {
    /// True once the answer has arrived (never waits).
    pub fn is_ready(&self) -> bool {
        self.slot.is_done()
    }
}

impl Future for LoopPending {
    type Output = Result<Reply, ClientError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.slot.poll_answer(cx)
    }
}

impl LoopClient {
    /// Connects to every node of the map (so a wrong token or a dead node shows now).
    /// Must run inside a tokio runtime with I/O and timers enabled.
    pub async fn connect(map: ClusterMap, config: ClientConfig) -> Result<LoopClient, ClientError> {
        config.validate()?;
        let client = LoopClient {
            inner: Arc::new(Inner {
                config,
                map,
                nodes: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(1),
                losses: Arc::default(),
            }),
        };
        for id in client.inner.map.node_ids().collect::<Vec<_>>() {
            client.conn(id).await?;
        }
        Ok(client)
    }

    pub fn map(&self) -> &ClusterMap {
        &self.inner.map
    }

    /// The error that ended one of this client's connections other than by the client
    /// closing it: at once if one already has, else when one does. A dead connection is
    /// replaced at the next submit, and the server behind the new one may not be the one
    /// that was there (a killed server restarted, empty, on its port): a caller whose
    /// knowledge of a server's bytes must not outlive the server waits on this.
    pub async fn connection_lost(&self) -> ClientError {
        let losses = &self.inner.losses;
        loop {
            // Made before the look, so a loss between the look and the wait counts.
            let told = losses.told.notified();
            if let Some(e) = losses.first.lock().clone() {
                return e;
            }
            told.await;
        }
    }

    /// The node's live connection, connecting anew if there is none or it died.
    async fn conn(&self, node: NodeId) -> Result<Arc<LoopConn>, ClientError> {
        if let Some((_, c)) = self.inner.nodes.lock().iter().find(|(n, _)| *n == node) {
            if !c.is_dead() {
                return Ok(c.clone());
            }
        }
        let addr = self
            .inner
            .map
            .node(node)
            .ok_or(ClientError::UnknownNode(node))?
            .addr;
        let conn = LoopConn::connect(addr, &self.inner.config, &self.inner.losses).await?;
        let mut nodes = self.inner.nodes.lock();
        match nodes.iter_mut().find(|(n, _)| *n == node) {
            // Another task reconnected while we did: use its connection, close ours
            // (nothing was queued on it yet).
            Some((_, live)) if !live.is_dead() => {
                let live = live.clone();
                drop(nodes);
                conn.close();
                Ok(live)
            }
            Some((_, dead)) => {
                *dead = conn.clone();
                Ok(conn)
            }
            None => {
                nodes.push((node, conn.clone()));
                Ok(conn)
            }
        }
    }

    /// Queues one request to `node`; the answer comes by awaiting what this returns.
    /// Waits only when the connection's queue is full (back-pressure) or to reconnect.
    pub async fn submit(&self, node: NodeId, op: Op) -> Result<LoopPending, ClientError> {
        self.submit_into(node, op, Completion::new()).await
    }

    /// [`LoopClient::submit`], with `hook` told of the answer (with `tag`) as it comes,
    /// before the returned future can yield it; also when the request fails, including
    /// when this call does (then before it returns).
    pub async fn submit_hooked(
        &self,
        node: NodeId,
        op: Op,
        hook: Arc<dyn AnswerHook>,
        tag: u64,
    ) -> Result<LoopPending, ClientError> {
        self.submit_into(node, op, Completion::hooked(hook, tag))
            .await
    }

    async fn submit_into(
        &self,
        node: NodeId,
        op: Op,
        slot: Arc<Completion>,
    ) -> Result<LoopPending, ClientError> {
        // Until the request is queued nobody else will complete its slot (and tell its
        // hook): this does if the submit fails, or if its future is dropped first.
        let unqueued = Unqueued(Some(slot.clone()));
        let conn = match self.conn(node).await {
            Ok(c) => c,
            Err(e) => {
                slot.complete(Err(e.clone()));
                return Err(e);
            }
        };
        let sub = Submission {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            op,
            slot: slot.clone(),
        };
        if let Err(e) = conn.enqueue(sub, self.inner.config.request_timeout).await {
            slot.complete(Err(e.clone()));
            return Err(e);
        }
        unqueued.disarm();
        Ok(LoopPending { slot })
    }

    pub async fn call(&self, node: NodeId, op: Op) -> Result<Reply, ClientError> {
        self.submit(node, op).await?.await
    }

    pub async fn read(&self, region: &Region, offset: u64, len: u32) -> Result<Bytes, ClientError> {
        reply::data(self.call(region.node, region.read_op(offset, len)).await)
    }

    pub async fn write(
        &self,
        region: &Region,
        offset: u64,
        data: impl Into<Bytes>,
    ) -> Result<(), ClientError> {
        reply::done(
            self.call(region.node, region.write_op(offset, data.into()))
                .await,
        )
    }

    pub async fn fetch_add(
        &self,
        region: &Region,
        offset: u64,
        delta: u64,
    ) -> Result<u64, ClientError> {
        reply::word(
            self.call(region.node, region.fetch_add_op(offset, delta))
                .await,
        )
    }
}

struct LoopConn {
    addr: SocketAddr,
    state: Mutex<State>,
    /// Mirrors `State::dead` for the per-submit check, without taking the lock.
    dead: AtomicBool,
    /// Whoever holds this writes everything queued: the writer task, or a submitter that
    /// found [`EAGER_FLUSH_OPS`] requests queued.
    write_side: tokio::sync::Mutex<WriteSide>,
    limits: FrameLimits,
    /// Wakes the writer task: requests are queued, or the connection is closing or dead.
    work: Notify,
    /// Wakes submitters waiting for queue room and a writer waiting for in-flight room.
    room: Notify,
    queue_requests_max: usize,
    losses: Arc<Losses>,
    /// `ClientConfig::own_replies`.
    own_replies: bool,
}

struct WriteSide {
    wr: OwnedWriteHalf,
    out: BytesMut,
    /// The queue's previous buffer, swapped back in so draining does not allocate.
    subs: Vec<Submission>,
    batch: AnswerSlots,
}

struct State {
    queue: Vec<Submission>,
    /// Frames written and not yet answered, oldest first: when each left, and its
    /// requests in the order the answers will come.
    inflight: VecDeque<(Instant, AnswerSlots)>,
    inflight_requests: usize,
    dead: Option<ClientError>,
    /// No more submissions; the writer ends once the queue is empty.
    closing: bool,
}

impl LoopConn {
    async fn connect(
        addr: SocketAddr,
        config: &ClientConfig,
        losses: &Arc<Losses>,
    ) -> Result<Arc<LoopConn>, ClientError> {
        let io = |e: std::io::Error| ClientError::Io {
            addr,
            source: Arc::new(e),
        };
        let handshake = async {
            let mut stream = TcpStream::connect(addr)
                .await
                .map_err(|e| ClientError::Connect {
                    addr,
                    source: Arc::new(e),
                })?;
            stream.set_nodelay(true).map_err(io)?;
            stream
                .write_all(&hello_frame(config, addr)?)
                .await
                .map_err(io)?;
            let n = stream.read_u32_le().await.map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    ClientError::Handshake {
                        addr,
                        reason: "server closed the connection during the handshake".into(),
                    }
                } else {
                    io(e)
                }
            })? as usize;
            if n == 0 || n > HELLO_ANSWER_BYTES_MAX {
                return Err(ClientError::Handshake {
                    addr,
                    reason: format!("not a Camelot server (handshake frame of {n} bytes)"),
                });
            }
            let mut body = vec![0u8; n];
            stream.read_exact(&mut body).await.map_err(io)?;
            hello_answer(addr, Bytes::from(body), config)?;
            Ok(stream)
        };
        let stream = tokio::time::timeout(config.connect_timeout, handshake)
            .await
            .map_err(|_| ClientError::Handshake {
                addr,
                reason: crate::conn::silent_peer(config.connect_timeout),
            })??;
        let (rd, wr) = stream.into_split();
        let conn = Arc::new(LoopConn {
            addr,
            dead: AtomicBool::new(false),
            write_side: tokio::sync::Mutex::new(WriteSide {
                wr,
                out: BytesMut::with_capacity(64 << 10),
                subs: Vec::new(),
                batch: Vec::new(),
            }),
            limits: FrameLimits {
                batching: config.batching,
                batch_ops_max: config.batch_ops_max.clamp(1, BATCH_OPS_MAX),
                // Static maps only on this face: servers do not check epoch 0.
                epoch: 0,
            },
            state: Mutex::new(State {
                queue: Vec::new(),
                inflight: VecDeque::new(),
                inflight_requests: 0,
                dead: None,
                closing: false,
            }),
            work: Notify::new(),
            room: Notify::new(),
            queue_requests_max: config.queue_requests_max.max(1),
            losses: losses.clone(),
            own_replies: config.own_replies,
        });
        tokio::spawn(conn.clone().write_loop());
        tokio::spawn(conn.clone().read_loop(rd, config.request_timeout));
        Ok(conn)
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    async fn enqueue(
        self: &Arc<Self>,
        sub: Submission,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let mut sub = Some(sub);
        // Set once the queue was found full; only then is a room notification armed (made
        // before looking, so a notification between the look and the wait counts) and the
        // clock read: the common case pays for neither.
        let mut waiting_since: Option<Instant> = None;
        let (queued_before, eager) = loop {
            let room = waiting_since.map(|_| self.room.notified());
            {
                let mut st = self.state.lock();
                if let Some(e) = &st.dead {
                    return Err(e.clone());
                }
                if st.closing {
                    return Err(ClientError::ConnectionLost { addr: self.addr });
                }
                if st.queue.len() < self.queue_requests_max {
                    let before = st.queue.len();
                    if let Some(s) = sub.take() {
                        st.queue.push(s);
                    }
                    break (before, st.queue.len() >= EAGER_FLUSH_OPS);
                }
            }
            if let (Some(since), Some(room)) = (waiting_since, room) {
                if tokio::time::timeout_at(since + timeout, room)
                    .await
                    .is_err()
                {
                    return Err(ClientError::Timeout { after: timeout });
                }
            } else {
                waiting_since = Some(Instant::now());
            }
        };
        if eager {
            // On a task of its own, awaited: a flush takes the whole queue (other tasks'
            // requests too) and may wait for in-flight room or the socket, and one
            // dropped there — a caller's timeout around its submit — would drop the
            // requests it took unanswered and could leave half a frame on the wire.
            // Dropping the handle leaves the task running.
            let conn = self.clone();
            let _ = tokio::spawn(async move { conn.flush().await }).await;
        } else if queued_before == 0 {
            // A non-empty queue already has the writer called: it takes the whole queue
            // at once, so one call per batch is enough.
            self.work.notify_one();
        }
        Ok(())
    }

    fn close(&self) {
        self.state.lock().closing = true;
        self.work.notify_one();
    }

    /// Marks the connection dead and fails everything queued or in flight on it.
    fn kill(&self, err: ClientError) {
        let (frames, queued) = {
            let mut st = self.state.lock();
            if st.dead.is_none() {
                st.dead = Some(err.clone());
                if !st.closing {
                    self.losses.lost(&err);
                }
            }
            self.dead.store(true, Ordering::Release);
            st.inflight_requests = 0;
            (
                std::mem::take(&mut st.inflight),
                std::mem::take(&mut st.queue),
            )
        };
        for (_, requests) in frames {
            for (_, slot) in requests {
                slot.complete(Err(err.clone()));
            }
        }
        for sub in queued {
            sub.slot.complete(Err(err.clone()));
        }
        self.work.notify_one();
        self.room.notify_waiters();
    }

    /// Writes what submitters leave queued: it runs after the tasks that were already
    /// woken, so what they submit meanwhile goes along in the same frames.
    async fn write_loop(self: Arc<Self>) {
        loop {
            let idle = {
                let st = self.state.lock();
                if st.dead.is_some() || (st.queue.is_empty() && st.closing) {
                    break;
                }
                st.queue.is_empty()
            };
            if idle {
                self.work.notified().await;
                continue;
            }
            self.flush().await;
        }
        // FIN: the server answers what it has and closes, which ends the reader.
        let _ = self.write_side.lock().await.wr.shutdown().await;
    }

    /// Writes everything queued, in as few frames as the limits allow.
    async fn flush(&self) {
        let mut side = self.write_side.lock().await;
        let WriteSide {
            wr,
            out,
            subs,
            batch,
        } = &mut *side;
        loop {
            {
                let mut st = self.state.lock();
                if st.dead.is_some() || st.queue.is_empty() {
                    return;
                }
                std::mem::swap(&mut st.queue, subs);
            }
            self.room.notify_waiters();
            let mut pending = subs.drain(..).peekable();
            while pending.peek().is_some() {
                if !self.limits.encode_next(out, None, &mut pending, batch) {
                    continue;
                }
                if let Err(err) = self.register(batch).await {
                    for sub in pending.by_ref() {
                        sub.slot.complete(Err(err.clone()));
                    }
                    break;
                }
                if let Err(e) = wr.write_all(out).await {
                    self.kill(ClientError::Io {
                        addr: self.addr,
                        source: Arc::new(e),
                    });
                }
            }
        }
    }

    /// Records the frame's requests as in flight before its bytes leave, so no answer can
    /// come for a request the reader does not know; waits while the in-flight bound is
    /// reached (the reader's watchdog ends that wait if the server stops answering).
    async fn register(&self, batch: &mut AnswerSlots) -> Result<(), ClientError> {
        loop {
            let room = self.room.notified();
            {
                let mut st = self.state.lock();
                if let Some(err) = st.dead.clone() {
                    drop(st);
                    for (_, slot) in batch.drain(..) {
                        slot.complete(Err(err.clone()));
                    }
                    return Err(err);
                }
                if st.inflight.is_empty()
                    || st.inflight_requests + batch.len() <= INFLIGHT_REQUESTS_MAX
                {
                    st.inflight_requests += batch.len();
                    st.inflight
                        .push_back((Instant::now(), std::mem::take(batch)));
                    return Ok(());
                }
            }
            room.await;
        }
    }

    async fn read_loop(self: Arc<Self>, mut rd: OwnedReadHalf, request_timeout: Duration) {
        let mut buf = BytesMut::with_capacity(READ_CHUNK_BYTES);
        loop {
            if buf.capacity() - buf.len() < READ_CHUNK_BYTES / 4 {
                buf.reserve(READ_CHUNK_BYTES);
            }
            match tokio::time::timeout(WATCHDOG_TICK, rd.read_buf(&mut buf)).await {
                Err(_) => {
                    let st = self.state.lock();
                    if st.dead.is_some() {
                        return;
                    }
                    let late = st
                        .inflight
                        .front()
                        .is_some_and(|(sent, _)| sent.elapsed() > request_timeout);
                    drop(st);
                    if late {
                        return self.kill(ClientError::Timeout {
                            after: request_timeout,
                        });
                    }
                    continue;
                }
                Ok(Ok(0)) => return self.kill(ClientError::ConnectionLost { addr: self.addr }),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    return self.kill(ClientError::Io {
                        addr: self.addr,
                        source: Arc::new(e),
                    })
                }
            }
            loop {
                match FrameDecoder::split_frame(&mut buf) {
                    Ok(Some(body)) => {
                        // An idle connection (a proxy's lane per client) kept its
                        // largest answer's size.
                        FrameDecoder::let_go_of_large(&mut buf, body.len(), BUFFER_KEEP_BYTES);
                        if let Err(e) = self.dispatch(body) {
                            return self.kill(e);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        return self.kill(ClientError::Protocol {
                            addr: self.addr,
                            reason: e.to_string(),
                        })
                    }
                }
            }
        }
    }

    fn dispatch(&self, body: Bytes) -> Result<(), ClientError> {
        let addr = self.addr;
        let protocol = |reason: String| ClientError::Protocol { addr, reason };
        let mut batch = decode_answer(addr, body)?;
        if self.own_replies {
            for r in &mut batch.responses {
                if let Ok(Reply::Data(d)) = &mut r.result {
                    *d = Bytes::copy_from_slice(d);
                }
            }
        }
        let requests = {
            let mut st = self.state.lock();
            let (_, requests) = st
                .inflight
                .pop_front()
                .ok_or_else(|| protocol("answer to a frame never sent".into()))?;
            st.inflight_requests -= requests.len();
            requests
        };
        self.room.notify_waiters();
        complete_frame(addr, requests, batch)
    }
}
