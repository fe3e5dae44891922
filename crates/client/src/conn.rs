//! One TCP connection to one memory server. Submitting threads combine: whoever finds the
//! socket free writes everything queued, by every thread, as one frame. Reading is
//! leader/follower: a thread about to block on its answer reads the socket itself when
//! nobody else is, and the connection's reader thread reads only while answers are owed
//! and no waiting thread is reading (for awaiting tasks, abandoned answers, timeouts).
//!
//! Why threads and not an async runtime: the main users are application threads that
//! block on answers (the request API, far memory, the benches). On loopback a thread
//! hand-off costs as much as the network round trip, so the hot path avoids them: the
//! submitting thread writes and the waiting thread reads. Async callers still get a
//! `Future` from [`crate::Pending`].

use crate::completion::Completion;
use crate::frame::{
    complete_frame, decode_answer, hello_answer, hello_frame, Filled, FrameLimits, FrameReader,
    Submission, HELLO_ANSWER_BYTES_MAX,
};
use crate::{ClientConfig, ClientError};
use bytes::{Bytes, BytesMut};
use camelot_proto::limits::BATCH_OPS_MAX;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests sent but not yet answered on one connection. Past this the writer waits, so a
/// server that stops answering cannot make us queue without bound.
pub const INFLIGHT_REQUESTS_MAX: usize = 16_384;
/// How often the reader wakes to check for a request that has waited too long.
const WATCHDOG_TICK: Duration = Duration::from_millis(100);
const READ_CHUNK_BYTES: usize = 256 << 10;
struct InflightFrame {
    sent_at: Instant,
    requests: Vec<(u64, Arc<Completion>)>,
}

struct Inflight {
    dead: Option<ClientError>,
    frames: VecDeque<InflightFrame>,
    requests: usize,
}

/// State the reader and writer threads share (the `Conn` handle is separate so that
/// dropping it closes the submission channel and lets the writer exit).
pub(crate) struct Shared {
    addr: SocketAddr,
    stream: TcpStream,
    inflight: Mutex<Inflight>,
    space: Condvar,
    dead: AtomicBool,
    /// Every `Conn` handle is gone: close once nothing is owed.
    closing: AtomicBool,
    queue: Mutex<Vec<Submission>>,
    queue_space: Condvar,
    /// Held by whichever thread is writing to the socket (the combiner).
    writer: Mutex<Writer>,
    queue_requests_max: usize,
    batching: bool,
    /// Frames in flight below which a submitting thread writes its request itself (see
    /// [`crate::ClientConfig::frames_ahead`]).
    frames_ahead: usize,
    /// Whoever holds this reads the socket: the reader thread, or a thread waiting for
    /// its own answer (see [`Shared::read_for`]).
    read_role: Mutex<ReadBuf>,
    /// Wakes the reader thread when nobody else is reading but answers are owed.
    poked: Mutex<bool>,
    poke: Condvar,
    request_timeout: Duration,
    /// The CPU the reader thread should run on (`NO_CPU`: anywhere): where the first
    /// pinned thread to use this connection runs (see `affinity.rs`).
    reader_cpu: AtomicUsize,
}

const NO_CPU: usize = usize::MAX;

pub(crate) struct ReadBuf {
    stream: TcpStream,
    frames: FrameReader,
}

impl Shared {
    /// Marks the connection dead and fails everything sent and unanswered.
    fn kill(&self, err: ClientError) {
        let frames = {
            let mut inf = self.inflight.lock();
            if inf.dead.is_none() {
                inf.dead = Some(err.clone());
            }
            inf.requests = 0;
            std::mem::take(&mut inf.frames)
        };
        self.dead.store(true, Ordering::Release);
        self.space.notify_all();
        // Wakes whichever of reader/writer is blocked on the socket.
        let _ = self.stream.shutdown(Shutdown::Both);
        for f in frames {
            for (_, slot) in f.requests {
                slot.complete(Err(err.clone()));
            }
        }
        // Fails what is queued but unsent (the writer checks `dead` per frame).
        self.flush(false);
        self.poke();
    }

    fn death(&self) -> ClientError {
        self.inflight
            .lock()
            .dead
            .clone()
            .unwrap_or(ClientError::ConnectionLost { addr: self.addr })
    }
}

pub(crate) struct Conn {
    shared: Arc<Shared>,
    request_timeout: Duration,
}

impl Conn {
    /// Connects and shakes hands; frames carry `epoch`'s value at the time each is
    /// written (the client's map epoch: 0, unchecked, for a static map).
    pub(crate) fn connect(
        addr: SocketAddr,
        config: &ClientConfig,
        epoch: Arc<AtomicU64>,
    ) -> Result<(Conn, u64), ClientError> {
        let stream = TcpStream::connect_timeout(&addr, config.connect_timeout).map_err(|e| {
            ClientError::Connect {
                addr,
                source: Arc::new(e),
            }
        })?;
        let io = |e: std::io::Error| ClientError::Io {
            addr,
            source: Arc::new(e),
        };
        stream.set_nodelay(true).map_err(io)?;
        let server_epoch = handshake(&stream, addr, config)?;
        stream.set_read_timeout(Some(WATCHDOG_TICK)).map_err(io)?;
        stream
            .set_write_timeout(Some(config.request_timeout))
            .map_err(io)?;
        let read_half = stream.try_clone().map_err(io)?;
        let writer = Writer {
            batching: config.batching,
            batch_ops_max: config.batch_ops_max.clamp(1, BATCH_OPS_MAX),
            epoch,
            request_timeout: config.request_timeout,
            out: BytesMut::with_capacity(64 << 10),
            deferred: Vec::new(),
            spare: Vec::new(),
        };
        let shared = Arc::new(Shared {
            addr,
            stream,
            inflight: Mutex::new(Inflight {
                dead: None,
                frames: VecDeque::new(),
                requests: 0,
            }),
            space: Condvar::new(),
            dead: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            queue: Mutex::new(Vec::new()),
            queue_space: Condvar::new(),
            writer: Mutex::new(writer),
            queue_requests_max: config.queue_requests_max.max(1),
            batching: config.batching,
            frames_ahead: config.frames_ahead.max(1),
            read_role: Mutex::new(ReadBuf {
                stream: read_half,
                frames: FrameReader::new(READ_CHUNK_BYTES),
            }),
            poked: Mutex::new(false),
            poke: Condvar::new(),
            request_timeout: config.request_timeout,
            reader_cpu: AtomicUsize::new(NO_CPU),
        });
        std::thread::Builder::new()
            .name(format!("camelot-r-{addr}"))
            .spawn({
                let shared = shared.clone();
                move || shared.reader_thread()
            })
            .map_err(io)?;
        Ok((
            Conn {
                shared,
                request_timeout: config.request_timeout,
            },
            server_epoch,
        ))
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.shared.dead.load(Ordering::Acquire)
    }

    /// Queues the request. It is written at once when few frames are in flight (the
    /// latency case); otherwise it waits for the reader, which writes everything queued
    /// each time an answer frame arrives. Under load this clocks requests from every
    /// thread into one frame per answer, instead of one small frame per request.
    pub(crate) fn submit(&self, sub: Submission) -> Result<(), ClientError> {
        self.submit_many(std::iter::once(sub))
    }

    /// Queues all of `subs` under one lock and flushes once, so a thread's burst goes out
    /// as one frame instead of one write for the first request and a frame for the rest.
    /// On error, the requests not yet queued are dropped (their slots never complete), so
    /// callers must not wait on them.
    pub(crate) fn submit_many(
        &self,
        subs: impl IntoIterator<Item = Submission>,
    ) -> Result<(), ClientError> {
        let shared = &*self.shared;
        if self.is_dead() {
            return Err(shared.death());
        }
        {
            let mut q = shared.queue.lock();
            let deadline = Instant::now() + self.request_timeout;
            for sub in subs {
                if q.len() >= shared.queue_requests_max {
                    // Our own burst may be what fills the queue: send it before waiting.
                    drop(q);
                    shared.flush(true);
                    q = shared.queue.lock();
                }
                while q.len() >= shared.queue_requests_max {
                    if shared.queue_space.wait_until(&mut q, deadline).timed_out() {
                        return Err(ClientError::Timeout {
                            after: self.request_timeout,
                        });
                    }
                }
                q.push(sub);
            }
        }
        // Checked after queueing: if the reader's last dispatch came before this check
        // saw frames in flight, its flush comes after our push and takes the request.
        if !shared.batching
            || shared.dead.load(Ordering::Acquire)
            || shared.inflight.lock().frames.len() < shared.frames_ahead
        {
            shared.flush(true);
        }
        Ok(())
    }
}

impl Shared {
    /// Writes everything queued unless another thread is writing, in which case that
    /// thread takes it along. `may_wait`: false on the reader, which must never wait for
    /// in-flight room it alone can free.
    fn flush(&self, may_wait: bool) {
        loop {
            let Some(mut w) = self.writer.try_lock() else {
                // The holder re-checks the queue after letting go, so nothing is stranded.
                return;
            };
            loop {
                let mut subs = std::mem::take(&mut w.spare);
                {
                    let mut q = self.queue.lock();
                    if q.is_empty() {
                        w.spare = subs;
                        break;
                    }
                    std::mem::swap(&mut *q, &mut subs);
                }
                self.queue_space.notify_all();
                w.write(self, &mut subs, may_wait);
                w.spare = subs;
            }
            drop(w);
            if self.queue.lock().is_empty() {
                return;
            }
        }
    }
}

impl Drop for Conn {
    /// The last handle is gone (replaced or client dropped): let the answers still owed
    /// arrive, then the reader closes the socket and exits.
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        if self.shared.inflight.lock().requests == 0 {
            let _ = self.shared.stream.shutdown(Shutdown::Both);
        }
        self.shared.poke();
    }
}

/// Why a peer that never answered HELLO is probably not ours.
pub(crate) fn silent_peer(waited: Duration) -> String {
    format!(
        "no answer to the handshake within {waited:?}: not a Camelot server \
         (is this its native port, not its Redis port?)"
    )
}

fn handshake(
    stream: &TcpStream,
    addr: SocketAddr,
    config: &ClientConfig,
) -> Result<u64, ClientError> {
    let io = |e: std::io::Error| ClientError::Io {
        addr,
        source: Arc::new(e),
    };
    let buf = hello_frame(config, addr)?;
    stream
        .set_write_timeout(Some(config.connect_timeout))
        .map_err(io)?;
    stream
        .set_read_timeout(Some(config.connect_timeout))
        .map_err(io)?;
    (&*stream).write_all(&buf).map_err(io)?;
    let mut len = [0u8; 4];
    (&*stream)
        .read_exact(&mut len)
        .map_err(|e| match e.kind() {
            ErrorKind::UnexpectedEof => ClientError::Handshake {
                addr,
                reason: "server closed the connection during the handshake".into(),
            },
            // The read timeout: a server of ours answers HELLO at once.
            ErrorKind::WouldBlock | ErrorKind::TimedOut => ClientError::Handshake {
                addr,
                reason: silent_peer(config.connect_timeout),
            },
            _ => io(e),
        })?;
    let n = u32::from_le_bytes(len) as usize;
    if n == 0 || n > HELLO_ANSWER_BYTES_MAX {
        return Err(ClientError::Handshake {
            addr,
            reason: format!("not a Camelot server (handshake frame of {n} bytes)"),
        });
    }
    let mut body = vec![0u8; n];
    (&*stream).read_exact(&mut body).map_err(io)?;
    hello_answer(addr, Bytes::from(body), config)
}

struct Writer {
    batching: bool,
    batch_ops_max: usize,
    epoch: Arc<AtomicU64>,
    request_timeout: Duration,
    out: BytesMut,
    /// Payloads of the frame in `out` that are sent from where they are (see
    /// [`VECTORED_PAYLOAD_BYTES_MIN`]), with their offsets in `out`.
    deferred: Vec<(usize, Bytes)>,
    /// The queue's previous buffer, swapped back in so draining does not allocate.
    spare: Vec<Submission>,
}

impl Writer {
    /// Writes `subs` (emptying it): as few frames as the limits allow when batching, one
    /// frame and one write per request when not.
    fn write(&mut self, shared: &Shared, subs: &mut Vec<Submission>, may_wait: bool) {
        let mut batch: Vec<(u64, Arc<Completion>)> = Vec::new();
        let mut pending = subs.drain(..).peekable();
        let limits = FrameLimits {
            batching: self.batching,
            batch_ops_max: self.batch_ops_max,
            epoch: self.epoch.load(Ordering::Acquire),
        };
        while pending.peek().is_some() {
            if shared.dead.load(Ordering::Acquire) {
                let err = shared.death();
                for sub in pending.by_ref() {
                    sub.slot.complete(Err(err.clone()));
                }
                return;
            }
            if !limits.encode_next(
                &mut self.out,
                Some(&mut self.deferred),
                &mut pending,
                &mut batch,
            ) {
                continue;
            }
            if !self.register(shared, &mut batch, may_wait) {
                continue;
            }
            let written = write_frame(&shared.stream, &self.out, &self.deferred);
            // The payloads are the caller's; do not keep them alive until the next frame.
            self.deferred.clear();
            if let Err(e) = written {
                let err = if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                    ClientError::Timeout {
                        after: self.request_timeout,
                    }
                } else {
                    ClientError::Io {
                        addr: shared.addr,
                        source: Arc::new(e),
                    }
                };
                shared.kill(err);
            }
        }
    }

    /// Hands the batch's answer slots to the reader before the bytes leave, so an answer
    /// can never arrive for a slot the reader does not know yet. False if the connection
    /// is dead (the slots are then failed).
    fn register(
        &self,
        shared: &Shared,
        batch: &mut Vec<(u64, Arc<Completion>)>,
        may_wait: bool,
    ) -> bool {
        let mut inf = shared.inflight.lock();
        let deadline = Instant::now() + self.request_timeout;
        while may_wait && inf.dead.is_none() && inf.requests + batch.len() > INFLIGHT_REQUESTS_MAX {
            if shared.space.wait_until(&mut inf, deadline).timed_out() {
                drop(inf);
                shared.kill(ClientError::Timeout {
                    after: self.request_timeout,
                });
                inf = shared.inflight.lock();
                break;
            }
        }
        if let Some(err) = inf.dead.clone() {
            drop(inf);
            for (_, slot) in batch.drain(..) {
                slot.complete(Err(err.clone()));
            }
            return false;
        }
        inf.requests += batch.len();
        inf.frames.push_back(InflightFrame {
            sent_at: Instant::now(),
            requests: std::mem::take(batch),
        });
        true
    }
}

/// Writes a whole frame: `head` with each of `deferred`'s payloads inserted at its offset
/// (offsets ascending, as the encoder records them), in as few `writev` calls as the
/// socket takes.
fn write_frame(
    mut stream: &TcpStream,
    head: &[u8],
    deferred: &[(usize, Bytes)],
) -> std::io::Result<()> {
    if deferred.is_empty() {
        return stream.write_all(head);
    }
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * deferred.len() + 1);
    let mut at = 0;
    for (offset, data) in deferred {
        if *offset > at {
            slices.push(IoSlice::new(&head[at..*offset]));
        }
        if !data.is_empty() {
            slices.push(IoSlice::new(data));
        }
        at = *offset;
    }
    if at < head.len() {
        slices.push(IoSlice::new(&head[at..]));
    }
    let mut bufs = &mut slices[..];
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    ErrorKind::WriteZero,
                    "the socket took no bytes of a frame",
                ))
            }
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Shared {
    pub(crate) fn poke(&self) {
        *self.poked.lock() = true;
        self.poke.notify_one();
    }

    /// Asks the reader thread to run on `cpu` from now on, unless an earlier pinned user
    /// already chose (one atomic load once chosen: this is on every request's path).
    pub(crate) fn prefer_reader_cpu(&self, cpu: usize) {
        if self.reader_cpu.load(Ordering::Relaxed) == NO_CPU
            && self
                .reader_cpu
                .compare_exchange(NO_CPU, cpu, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.poke();
        }
    }

    /// The connection's own reader: reads whenever answers are owed and no waiting
    /// thread is reading, and otherwise sleeps until poked or for one watchdog tick (so
    /// late answers are still timed out and unclaimed answers still collected).
    fn reader_thread(&self) {
        let mut pinned = false;
        loop {
            if !pinned {
                let cpu = self.reader_cpu.load(Ordering::Relaxed);
                if cpu != NO_CPU {
                    if !crate::affinity::pin_current(cpu) {
                        tracing::debug!(addr = %self.addr, cpu, "could not pin a reader thread");
                    }
                    pinned = true;
                }
            }
            if self.dead.load(Ordering::Acquire) {
                return;
            }
            let owed = self.inflight.lock().requests;
            if owed == 0 && self.closing.load(Ordering::Acquire) {
                return self.kill(ClientError::ConnectionLost { addr: self.addr });
            }
            if owed > 0 {
                if let Some(mut rb) = self.read_role.try_lock() {
                    if let Err(e) = self.read_once(&mut rb) {
                        drop(rb);
                        return self.kill(e);
                    }
                    continue;
                }
            }
            let mut poked = self.poked.lock();
            if !*poked {
                self.poke.wait_for(&mut poked, WATCHDOG_TICK);
            }
            *poked = false;
        }
    }

    /// Called by a thread about to block on `slot`: if nobody is reading, it reads the
    /// socket itself until its answer is in, instead of sleeping until the reader thread
    /// wakes it. On loopback that hand-off is a large share of a round trip. Returns
    /// false if someone else is reading (the caller then sleeps on its slot).
    pub(crate) fn read_for(&self, slot: &Completion, deadline: Instant) -> bool {
        if self.dead.load(Ordering::Acquire) {
            return false;
        }
        let Some(mut rb) = self.read_role.try_lock() else {
            return false;
        };
        while !slot.is_done() && Instant::now() < deadline {
            if let Err(e) = self.read_once(&mut rb) {
                drop(rb);
                self.kill(e);
                return true;
            }
        }
        drop(rb);
        // Answers still owed to others: hand reading back to the reader thread. (Waking
        // a thread blocked on the next answer instead saved wake-ups at depth 16 but
        // gave YCSB's 16 depth-1 threads a p99 of ~2 ms instead of ~0.5 ms:
        // BENCHMARKS.md.)
        if self.inflight.lock().requests > 0 {
            self.poke();
        }
        true
    }

    /// One read from the socket (blocking at most a watchdog tick), then every complete
    /// answer dispatched and whatever was queued meanwhile written. Err: the connection
    /// is finished, for the reason given.
    fn read_once(&self, rb: &mut ReadBuf) -> Result<(), ClientError> {
        let addr = self.addr;
        if self.dead.load(Ordering::Acquire) {
            return Err(self.death());
        }
        let ReadBuf { stream, frames } = rb;
        match frames.fill(stream) {
            Ok(Filled::Closed) => return Err(ClientError::ConnectionLost { addr }),
            Ok(Filled::Bytes(_)) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if self.dead.load(Ordering::Acquire) {
                    return Err(self.death());
                }
                let oldest = self.inflight.lock().frames.front().map(|f| f.sent_at);
                if oldest.is_some_and(|t| t.elapsed() > self.request_timeout) {
                    return Err(ClientError::Timeout {
                        after: self.request_timeout,
                    });
                }
                return Ok(());
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => return Ok(()),
            Err(e) => {
                return Err(ClientError::Io {
                    addr,
                    source: Arc::new(e),
                })
            }
        }
        let mut answered = false;
        loop {
            match frames.next_frame() {
                Ok(Some(body)) => {
                    self.dispatch(body)?;
                    answered = true;
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(ClientError::Protocol {
                        addr,
                        reason: e.to_string(),
                    })
                }
            }
        }
        if answered {
            self.flush(false);
        }
        Ok(())
    }

    fn dispatch(&self, body: Bytes) -> Result<(), ClientError> {
        let addr = self.addr;
        let protocol = |reason: String| ClientError::Protocol { addr, reason };
        let batch = decode_answer(addr, body)?;
        let frame = {
            let mut inf = self.inflight.lock();
            let f = inf
                .frames
                .pop_front()
                .ok_or_else(|| protocol("answer to a frame never sent".into()))?;
            inf.requests -= f.requests.len();
            f
        };
        self.space.notify_all();
        complete_frame(addr, frame.requests, batch)
    }
}
