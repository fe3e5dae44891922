//! One client connection: handshake, then read → execute → answer, in order.

use crate::exec::exec;
use crate::state::ServerState;
use crate::store::Principal;
use bytes::{Bytes, BytesMut};
use camelot_proto::{
    decode_frame, encode_frame, DecodeError, ErrorCode, ErrorReply, Frame, FrameDecoder, HelloOk,
    ResponseBatchEncoder, HELLO_BODY_BYTES_MAX, PRINCIPAL_DEFAULT, PROTOCOL_VERSION,
};
use std::fmt;
use std::io::{self, Read};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, warn};

const READ_CHUNK_BYTES: usize = 64 << 10;
/// Responses are coalesced across pipelined frames, but past this much we write anyway:
/// a few small request frames can ask for very large READs.
const OUT_FLUSH_BYTES: usize = 1 << 20;
/// A buffer that grew past this for one big frame is replaced once empty, so an idle
/// connection does not keep pinning up to a frame's worth of memory.
const BUF_KEEP_BYTES: usize = 4 << 20;
/// How long, and how much, we keep reading (and discarding) after a FATAL before closing.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES_MAX: usize = 1 << 20;
/// At shutdown, bytes taken from the socket per pass before answering what they hold.
const DRAIN_PASS_BYTES_MAX: usize = 4 << 20;

/// Configuration every connection needs.
pub(crate) struct Shared {
    pub state: Arc<ServerState>,
    pub token: Option<Vec<u8>>,
    pub handshake_timeout: Duration,
}

/// Counts a connection as open from accept until its task ends (or is aborted).
pub(crate) struct OpenConnection(Arc<ServerState>);

impl OpenConnection {
    pub fn new(state: Arc<ServerState>) -> Self {
        state.stats().connection_opened();
        OpenConnection(state)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.stats().connection_closed();
    }
}

/// Why a connection ended (for the debug log).
enum End {
    PeerClosed,
    PeerClosedMidFrame(usize),
    HandshakeTimeout,
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
    inbuf: BytesMut,
    outbuf: BytesMut,
    big_frame_seen: bool,
    /// Who this connection acts as, from its HELLO: owner of what it allocates.
    principal: Principal,
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
/// that have arrived.
fn read_available(
    stream: &mut std::net::TcpStream,
    buf: &mut BytesMut,
    state: &ServerState,
) -> io::Result<Drained> {
    let mut taken = 0;
    loop {
        if taken >= DRAIN_PASS_BYTES_MAX {
            return Ok(Drained::MoreWaiting);
        }
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

impl Conn {
    pub fn new(
        stream: TcpStream,
        peer: SocketAddr,
        shared: Arc<Shared>,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        if let Err(e) = stream.set_nodelay(true) {
            debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        Conn {
            stream,
            peer,
            shared,
            shutdown,
            inbuf: BytesMut::with_capacity(READ_CHUNK_BYTES),
            outbuf: BytesMut::with_capacity(READ_CHUNK_BYTES),
            big_frame_seen: false,
            principal: Principal::from(PRINCIPAL_DEFAULT),
        }
    }

    /// Serves the connection until the peer leaves, breaks the protocol, or the server
    /// shuts down. `_open` keeps the connection counted until this returns.
    pub async fn serve(mut self, _open: OpenConnection) {
        let peer = self.peer;
        debug!(%peer, "connection opened");
        let end = match self.handshake().await {
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

    /// Tells a connection over `connections_max` why it is being closed.
    pub async fn refuse(mut self) {
        warn!(peer = %self.peer, "refusing connection: connections_max reached");
        self.shared.state.stats().connection_refused();
        self.fatal(ErrorCode::TooLarge, "too many connections")
            .await;
    }

    async fn handshake(&mut self) -> Result<(), End> {
        let body =
            match tokio::time::timeout(self.shared.handshake_timeout, self.read_hello()).await {
                Ok(body) => body?,
                Err(_) => return Err(End::HandshakeTimeout),
            };
        let hello = match decode_frame(body) {
            Ok(Frame::Hello(h)) => h,
            Ok(_) => {
                warn!(peer = %self.peer, "first frame is not a HELLO; closing");
                return Err(self.fatal(ErrorCode::BadRequest, "expected HELLO").await);
            }
            Err(e) => {
                warn!(peer = %self.peer, error = %e, "bad HELLO; closing");
                return Err(End::NotAClient);
            }
        };
        if hello.version != PROTOCOL_VERSION {
            warn!(peer = %self.peer, version = hello.version, "unsupported protocol version");
            let msg = format!(
                "this server speaks protocol version {PROTOCOL_VERSION}, not {}",
                hello.version
            );
            return Err(self.fatal(ErrorCode::VersionMismatch, msg).await);
        }
        if let Some(token) = &self.shared.token {
            if !tokens_match(token, &hello.token) {
                warn!(peer = %self.peer, "wrong or missing cluster token");
                return Err(self
                    .fatal(ErrorCode::AuthFailed, "wrong or missing cluster token")
                    .await);
            }
        }
        if !hello.principal.is_empty() {
            self.principal = Principal::from(hello.principal);
        }
        let ok = Frame::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            epoch: self.shared.state.epoch(),
        });
        // Sent with the answers to whatever the client pipelined behind its HELLO.
        encode_frame(&ok, &mut self.outbuf)
            .map_err(|e| End::Io(io::Error::new(io::ErrorKind::InvalidData, e.to_string())))?;
        Ok(())
    }

    async fn read_hello(&mut self) -> Result<Bytes, End> {
        loop {
            if self.inbuf.len() >= 4 {
                let b = &self.inbuf;
                let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
                if len == 0 || len > HELLO_BODY_BYTES_MAX {
                    warn!(peer = %self.peer, len, "first frame length is no HELLO's; closing");
                    return Err(End::NotAClient);
                }
                match FrameDecoder::split_frame(&mut self.inbuf) {
                    Ok(Some(body)) => return Ok(body),
                    Ok(None) => {}
                    Err(_) => return Err(End::NotAClient),
                }
            }
            self.inbuf.reserve(READ_CHUNK_BYTES);
            tokio::select! {
                biased;
                _ = wait_shutdown(&mut self.shutdown) => return Err(End::Shutdown),
                r = self.stream.read_buf(&mut self.inbuf) => self.after_read(r)?,
            }
        }
    }

    fn after_read(&mut self, r: io::Result<usize>) -> Result<(), End> {
        match r {
            Ok(0) if self.inbuf.is_empty() => Err(End::PeerClosed),
            Ok(0) => Err(End::PeerClosedMidFrame(self.inbuf.len())),
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
            self.inbuf.reserve(READ_CHUNK_BYTES);
            tokio::select! {
                biased;
                _ = wait_shutdown(&mut self.shutdown) => return End::ShutdownRequested,
                r = self.stream.read_buf(&mut self.inbuf) => {
                    if let Err(end) = self.after_read(r) {
                        return end;
                    }
                }
            }
        }
    }

    /// Executes every complete frame in the input buffer, appending the answers.
    async fn answer_buffered(&mut self) -> Result<(), End> {
        loop {
            let body = match FrameDecoder::split_frame(&mut self.inbuf) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => return Err(self.protocol_error(e).await),
            };
            self.big_frame_seen |= body.len() >= BUF_KEEP_BYTES;
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
            let start = self.outbuf.len();
            let mut enc = ResponseBatchEncoder::begin(&mut self.outbuf);
            let res = exec(&self.shared.state, &self.principal, &batch, &mut enc)
                .and_then(|()| enc.finish());
            drop(batch);
            if let Err(e) = res {
                self.outbuf.truncate(start);
                warn!(peer = %self.peer, error = %e, "cannot encode a response frame; closing");
                return Err(self.fatal(ErrorCode::Internal, e.to_string()).await);
            }
            if self.outbuf.len() >= OUT_FLUSH_BYTES {
                self.flush().await?;
            }
        }
        if self.big_frame_seen && self.inbuf.is_empty() {
            // The empty buffer may still own a frame-sized allocation.
            self.inbuf = BytesMut::with_capacity(READ_CHUNK_BYTES);
            self.big_frame_seen = false;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), End> {
        if self.outbuf.is_empty() {
            return Ok(());
        }
        self.stream.write_all(&self.outbuf).await.map_err(End::Io)?;
        self.shared.state.stats().add_bytes_out(self.outbuf.len());
        self.outbuf.clear();
        if self.outbuf.capacity() > BUF_KEEP_BYTES {
            self.outbuf = BytesMut::with_capacity(READ_CHUNK_BYTES);
        }
        Ok(())
    }

    async fn protocol_error(&mut self, e: DecodeError) -> End {
        warn!(peer = %self.peer, error = %e, "malformed frame; closing connection");
        self.fatal(decode_error_code(&e), e.to_string()).await
    }

    /// Sends whatever answers are pending, then FATAL, then closes.
    async fn fatal(&mut self, code: ErrorCode, message: impl Into<String>) -> End {
        let frame = Frame::Fatal(ErrorReply::new(code, message));
        if encode_frame(&frame, &mut self.outbuf).is_ok() {
            if let Err(end) = self.flush().await {
                return end;
            }
        }
        self.linger_close().await;
        End::Fatal(code)
    }

    /// Half-closes, then reads and drops what the peer still sends for a moment. Closing
    /// with unread bytes queued makes the kernel send a RST, which can destroy our last
    /// frame before the peer has read it.
    async fn linger_close(&mut self) {
        if self.stream.shutdown().await.is_err() {
            return;
        }
        let deadline = Instant::now() + LINGER;
        let mut discarded_bytes = 0;
        while discarded_bytes < LINGER_BYTES_MAX {
            self.inbuf.clear();
            self.inbuf.reserve(READ_CHUNK_BYTES);
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.inbuf)).await {
                Ok(Ok(n)) if n > 0 => discarded_bytes += n,
                _ => break,
            }
        }
    }

    /// Answers every frame the peer had completely sent when shutdown came, then closes.
    async fn drain(mut self) -> End {
        loop {
            let mut std_stream = match self.stream.into_std() {
                Ok(s) => s,
                Err(e) => return End::Io(e),
            };
            let drained = read_available(&mut std_stream, &mut self.inbuf, &self.shared.state);
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
        if !self.inbuf.is_empty() {
            debug!(peer = %self.peer, bytes = self.inbuf.len(), "dropping an unfinished frame at shutdown");
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
