//! One TCP connection to one memory server: a writer thread that coalesces every queued
//! request into one frame, and a reader thread that hands each answer to its waiter.
//!
//! Why threads and not an async runtime: the main users are application threads that
//! block on answers (the request API, far memory, the benches). Two plain threads per
//! connection keep the hot path free of executor hand-offs; async callers still get a
//! `Future` from [`crate::Pending`].

use crate::completion::Completion;
use crate::{ClientConfig, ClientError};
use bytes::{Bytes, BytesMut};
use camelot_proto::limits::{BATCH_OPS_MAX, FRAME_BYTES_MAX};
use camelot_proto::{
    decode_frame, encode_frame, ErrorCode, Frame, FrameDecoder, Hello, Op, RequestBatchEncoder,
    PROTOCOL_VERSION, RESPONSES_HEADER_BYTES, RESPONSE_OK_BUDGET_BYTES,
};
use crossbeam_channel::{Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests sent but not yet answered on one connection. Past this the writer waits, so a
/// server that stops answering cannot make us queue without bound.
pub const INFLIGHT_REQUESTS_MAX: usize = 16_384;
/// How often the reader wakes to check for a request that has waited too long.
const WATCHDOG_TICK: Duration = Duration::from_millis(100);
const READ_CHUNK_BYTES: usize = 256 << 10;

pub(crate) struct Submission {
    pub id: u64,
    pub op: Op,
    pub slot: Arc<Completion>,
}

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
struct Shared {
    addr: SocketAddr,
    stream: TcpStream,
    inflight: Mutex<Inflight>,
    space: Condvar,
    dead: AtomicBool,
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
    tx: Sender<Submission>,
    shared: Arc<Shared>,
}

impl Conn {
    pub(crate) fn connect(
        addr: SocketAddr,
        config: &ClientConfig,
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
        let epoch = handshake(&stream, addr, config)?;
        stream.set_read_timeout(Some(WATCHDOG_TICK)).map_err(io)?;
        stream
            .set_write_timeout(Some(config.request_timeout))
            .map_err(io)?;
        let read_half = stream.try_clone().map_err(io)?;
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
        });
        let (tx, rx) = crossbeam_channel::bounded(config.queue_requests_max);
        let w = Writer {
            shared: shared.clone(),
            rx,
            batching: config.batching,
            batch_ops_max: config.batch_ops_max.clamp(1, BATCH_OPS_MAX),
            epoch,
            carry: None,
            request_timeout: config.request_timeout,
        };
        let name = format!("camelot-w-{addr}");
        std::thread::Builder::new()
            .name(name)
            .spawn(move || w.run())
            .map_err(io)?;
        let r = Reader {
            shared: shared.clone(),
            stream: read_half,
            request_timeout: config.request_timeout,
        };
        std::thread::Builder::new()
            .name(format!("camelot-r-{addr}"))
            .spawn(move || r.run())
            .map_err(io)?;
        Ok((Conn { tx, shared }, epoch))
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.shared.dead.load(Ordering::Acquire)
    }

    pub(crate) fn submit(&self, sub: Submission) -> Result<(), ClientError> {
        if self.is_dead() {
            return Err(self.shared.death());
        }
        // The writer drains and fails submissions even after the connection died, so a
        // request that races with the death still gets an answer.
        self.tx.send(sub).map_err(|_| ClientError::ConnectionLost {
            addr: self.shared.addr,
        })
    }
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
    let mut buf = BytesMut::new();
    encode_frame(
        &Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: Bytes::from(config.token.clone().unwrap_or_default()),
        }),
        &mut buf,
    )
    .map_err(|e| ClientError::InvalidArgument(format!("token: {e}")))?;
    stream
        .set_write_timeout(Some(config.connect_timeout))
        .map_err(io)?;
    stream
        .set_read_timeout(Some(config.connect_timeout))
        .map_err(io)?;
    (&*stream).write_all(&buf).map_err(io)?;
    let mut len = [0u8; 4];
    (&*stream).read_exact(&mut len).map_err(|e| {
        if e.kind() == ErrorKind::UnexpectedEof {
            ClientError::Handshake {
                addr,
                reason: "server closed the connection during the handshake".into(),
            }
        } else {
            io(e)
        }
    })?;
    let n = u32::from_le_bytes(len) as usize;
    // A handshake answer is tiny; refuse to buffer a big one from something that is not
    // a Camelot server.
    if n == 0 || n > 4096 {
        return Err(ClientError::Handshake {
            addr,
            reason: format!("not a Camelot server (handshake frame of {n} bytes)"),
        });
    }
    let mut body = vec![0u8; n];
    (&*stream).read_exact(&mut body).map_err(io)?;
    match decode_frame(Bytes::from(body)) {
        Ok(Frame::HelloOk(ok)) => Ok(ok.epoch),
        Ok(Frame::Fatal(e)) if e.code == ErrorCode::AuthFailed => Err(ClientError::Auth {
            addr,
            message: e.message,
        }),
        Ok(Frame::Fatal(e)) => Err(ClientError::Handshake {
            addr,
            reason: e.to_string(),
        }),
        Ok(other) => Err(ClientError::Handshake {
            addr,
            reason: format!("unexpected frame {other:?}"),
        }),
        Err(e) => Err(ClientError::Handshake {
            addr,
            reason: e.to_string(),
        }),
    }
}

struct Writer {
    shared: Arc<Shared>,
    rx: Receiver<Submission>,
    batching: bool,
    batch_ops_max: usize,
    epoch: u64,
    carry: Option<Submission>,
    request_timeout: Duration,
}

impl Writer {
    fn run(mut self) {
        let mut out = BytesMut::with_capacity(64 << 10);
        let mut batch: Vec<(u64, Arc<Completion>)> = Vec::new();
        loop {
            let first = match self.carry.take() {
                Some(s) => s,
                None => match self.rx.recv() {
                    Ok(s) => s,
                    Err(_) => return self.close_when_answered(),
                },
            };
            if self.shared.dead.load(Ordering::Acquire) {
                first.slot.complete(Err(self.shared.death()));
                continue;
            }
            out.clear();
            batch.clear();
            let mut enc = RequestBatchEncoder::begin(&mut out, self.epoch);
            let mut reply_bytes = RESPONSES_HEADER_BYTES;
            let mut next = Some(first);
            while let Some(sub) = next.take() {
                let fits = enc.count() == 0
                    || (enc.count() < self.batch_ops_max
                        && enc.frame_len() + sub.op.encoded_len() <= FRAME_BYTES_MAX + 4
                        && reply_bytes + sub.op.reply_len_max() <= RESPONSE_OK_BUDGET_BYTES);
                if !fits {
                    self.carry = Some(sub);
                    break;
                }
                match enc.push(sub.id, &sub.op) {
                    Ok(()) => {
                        reply_bytes += sub.op.reply_len_max();
                        batch.push((sub.id, sub.slot));
                    }
                    Err(e) => sub
                        .slot
                        .complete(Err(ClientError::InvalidArgument(e.to_string()))),
                }
                if !self.batching {
                    break;
                }
                next = match self.rx.try_recv() {
                    Ok(s) => Some(s),
                    Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => None,
                };
            }
            if enc.count() == 0 {
                continue;
            }
            if let Err(e) = enc.finish() {
                for (_, slot) in batch.drain(..) {
                    slot.complete(Err(ClientError::InvalidArgument(e.to_string())));
                }
                continue;
            }
            if !self.register(&mut batch) {
                continue;
            }
            if let Err(e) = (&self.shared.stream).write_all(&out) {
                let err = if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                    ClientError::Timeout {
                        after: self.request_timeout,
                    }
                } else {
                    ClientError::Io {
                        addr: self.shared.addr,
                        source: Arc::new(e),
                    }
                };
                self.shared.kill(err);
            }
        }
    }

    /// Every `Conn` handle is gone (replaced or client dropped): let the answers still
    /// owed arrive, then close so the reader exits too.
    fn close_when_answered(&self) {
        let deadline = Instant::now() + self.request_timeout;
        let mut inf = self.shared.inflight.lock();
        while inf.dead.is_none() && inf.requests > 0 {
            if self.shared.space.wait_until(&mut inf, deadline).timed_out() {
                break;
            }
        }
        drop(inf);
        let _ = self.shared.stream.shutdown(Shutdown::Both);
    }

    /// Hands the batch's answer slots to the reader before the bytes leave, so an answer
    /// can never arrive for a slot the reader does not know yet. False if the connection
    /// is dead (the slots are then failed).
    fn register(&self, batch: &mut Vec<(u64, Arc<Completion>)>) -> bool {
        let mut inf = self.shared.inflight.lock();
        let deadline = Instant::now() + self.request_timeout;
        while inf.dead.is_none() && inf.requests + batch.len() > INFLIGHT_REQUESTS_MAX {
            if self.shared.space.wait_until(&mut inf, deadline).timed_out() {
                drop(inf);
                self.shared.kill(ClientError::Timeout {
                    after: self.request_timeout,
                });
                inf = self.shared.inflight.lock();
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

struct Reader {
    shared: Arc<Shared>,
    stream: TcpStream,
    request_timeout: Duration,
}

impl Reader {
    fn run(mut self) {
        let err = self.serve();
        self.shared.kill(err);
    }

    /// Returns why the connection ended.
    fn serve(&mut self) -> ClientError {
        let addr = self.shared.addr;
        let mut buf = BytesMut::with_capacity(READ_CHUNK_BYTES);
        loop {
            loop {
                match FrameDecoder::split_frame(&mut buf) {
                    Ok(Some(body)) => {
                        if let Err(e) = self.dispatch(body) {
                            return e;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        return ClientError::Protocol {
                            addr,
                            reason: e.to_string(),
                        }
                    }
                }
            }
            let len = buf.len();
            let want = READ_CHUNK_BYTES.max(buf.capacity() - len);
            buf.resize(len + want, 0);
            match self.stream.read(&mut buf[len..]) {
                Ok(0) => {
                    buf.truncate(len);
                    return ClientError::ConnectionLost { addr };
                }
                Ok(n) => buf.truncate(len + n),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    buf.truncate(len);
                    if self.shared.dead.load(Ordering::Acquire) {
                        return self.shared.death();
                    }
                    let oldest = self
                        .shared
                        .inflight
                        .lock()
                        .frames
                        .front()
                        .map(|f| f.sent_at);
                    if oldest.is_some_and(|t| t.elapsed() > self.request_timeout) {
                        return ClientError::Timeout {
                            after: self.request_timeout,
                        };
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => buf.truncate(len),
                Err(e) => {
                    return ClientError::Io {
                        addr,
                        source: Arc::new(e),
                    }
                }
            }
        }
    }

    fn dispatch(&self, body: Bytes) -> Result<(), ClientError> {
        let addr = self.shared.addr;
        let protocol = |reason: String| ClientError::Protocol { addr, reason };
        let batch = match decode_frame(body).map_err(|e| protocol(e.to_string()))? {
            Frame::Responses(b) => b,
            Frame::Fatal(e) => return Err(ClientError::Server(e)),
            other => return Err(protocol(format!("unexpected frame {other:?}"))),
        };
        let frame = {
            let mut inf = self.shared.inflight.lock();
            let f = inf
                .frames
                .pop_front()
                .ok_or_else(|| protocol("answer to a frame never sent".into()))?;
            inf.requests -= f.requests.len();
            f
        };
        self.shared.space.notify_all();
        if frame.requests.len() != batch.responses.len() {
            let n = batch.responses.len();
            let err = protocol(format!(
                "{} answers to {} requests",
                n,
                frame.requests.len()
            ));
            for (_, slot) in frame.requests {
                slot.complete(Err(err.clone()));
            }
            return Err(err);
        }
        for ((id, slot), resp) in frame.requests.into_iter().zip(batch.responses) {
            if resp.id != id {
                slot.complete(Err(protocol(format!(
                    "answer id {} for request {id}",
                    resp.id
                ))));
                continue;
            }
            slot.complete(resp.result.map_err(ClientError::Server));
        }
        Ok(())
    }
}
