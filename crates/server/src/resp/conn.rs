//! One Redis-protocol connection: read what arrived, run every complete command in it,
//! write all the replies in one go (so pipelined clients get pipelined answers).
//!
//! Before AUTH (when the server has a token) a connection may send at most
//! [`UNAUTHENTICATED_INPUT_BYTES_MAX`] in all and must authenticate within the handshake
//! timeout; its buffers never grow past that allowance, so an unauthenticated peer cannot
//! make the server reserve a big command's room. Every buffer is charged to the
//! connection-buffer budget (`crate::buffers`); a connection that would pass it is told
//! so and closed. While its replies are unsent a connection reads nothing more
//! (backpressure), so what it holds is bounded by one read's commands' replies.

use super::codec::{self, parse_command_resuming, Parsed, Resume};
use super::commands::{execute, Ctx, Session};
use crate::budget::OverBudget;
use crate::buffers::ConnBuffers;
use crate::conn::{
    linger_close, peer_went_away, refusal_message, sleep_or_never, wait_shutdown, write_all_idle,
    OpenConnection, EVICTED_MESSAGE,
};
use crate::protolog::{warn_limited, RESP_REFUSALS};
use crate::state::{Refusal, ServerState};
use bytes::Buf;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::{debug, warn};

const READ_CHUNK_BYTES: usize = 64 << 10;
/// Replies are gathered across a pipeline, but past this much we write before running
/// more commands: a few small GETs can ask for very large values.
const OUT_FLUSH_BYTES: usize = 1 << 20;
/// A buffer that grew past this for one big command is replaced once empty.
const BUF_KEEP_BYTES: usize = 4 << 20;
/// Everything a connection may send before it has authenticated, when there is a token:
/// room for `AUTH` or `HELLO 3 AUTH … SETNAME …` with a 255-byte token, a `PING`, a
/// `QUIT`, and the start of whatever a client pipelines behind its AUTH. Past it:
/// `-NOAUTH` and close, as the native port closes on anything bigger than a HELLO.
pub const UNAUTHENTICATED_INPUT_BYTES_MAX: usize = 4 << 10;
/// The output buffer a connection starts with; it grows, charged, as replies need.
const OUT_START_BYTES: usize = 4 << 10;
const NOAUTH: &[u8] = b"-NOAUTH Authentication required.\r\n";

pub(crate) struct RespShared {
    pub state: Arc<ServerState>,
    /// Connections waiting to authenticate, shared with the native port.
    pub waiting: Arc<crate::conn::Waiting>,
    pub token: Option<Vec<u8>>,
    /// `proto-max-bulk-len`: the longest argument read.
    pub proto_max_bulk_len: usize,
    /// How long a connection may take to AUTH (when there is a token).
    pub handshake_timeout: Duration,
    pub idle_timeout: Option<Duration>,
}

enum End {
    PeerClosed,
    Quit,
    Shutdown,
    Protocol(codec::RespError),
    /// Sent more than [`UNAUTHENTICATED_INPUT_BYTES_MAX`] before authenticating.
    NoAuth,
    AuthTimeout,
    /// Still unauthenticated when a newer connection needed its place.
    Evicted,
    IdleTimeout,
    OverBudget(OverBudget),
    Io(io::Error),
}

/// Serves one connection until the client leaves, sends QUIT or garbage, or the server
/// shuts down (then every command already received is answered first).
pub(crate) async fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<RespShared>,
    mut stop: watch::Receiver<bool>,
    mut open: OpenConnection,
) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(%peer, error = %e, "cannot set TCP_NODELAY");
    }
    let mut session = Session::default();
    // The parse of a command still arriving, kept from read to read.
    let mut resume = Resume::default();
    let needs_auth = |session: &Session| shared.token.is_some() && !session.authenticated;
    let in_start = if needs_auth(&session) {
        UNAUTHENTICATED_INPUT_BYTES_MAX
    } else {
        READ_CHUNK_BYTES
    };
    let budget = shared.state.connection_buffers();
    let mut bufs = match ConnBuffers::new(budget, in_start, OUT_START_BYTES) {
        Ok(b) => b,
        Err(e) => {
            warn_limited!(
                RESP_REFUSALS,
                %peer,
                error = %e,
                "refusing RESP connection: connection buffer budget exhausted"
            );
            shared.state.stats().connection_refused();
            let _ = stream.write_all(&over_budget_reply(&e)).await;
            let _ = stream.shutdown().await;
            return;
        }
    };
    let ctx = Ctx {
        state: &shared.state,
        token: shared.token.as_deref(),
    };
    let auth_deadline = tokio::time::Instant::now() + shared.handshake_timeout;
    // Bytes taken from the socket before the connection authenticated.
    let mut unauthenticated_bytes = 0usize;
    let end = loop {
        let unauthenticated = needs_auth(&session);
        let allowance = if unauthenticated {
            let left = UNAUTHENTICATED_INPUT_BYTES_MAX.saturating_sub(unauthenticated_bytes);
            if left == 0 {
                break End::NoAuth;
            }
            left
        } else {
            usize::MAX
        };
        let spare = bufs.inbuf.capacity() - bufs.inbuf.len();
        if spare < READ_CHUNK_BYTES / 4 && spare < allowance {
            if let Err(e) = bufs.reserve_in(READ_CHUNK_BYTES.min(allowance)) {
                break End::OverBudget(e);
            }
        }
        let mut limited = (&mut stream).take(allowance as u64);
        let read = tokio::select! {
            biased;
            _ = wait_shutdown(&mut stop) => None,
            r = limited.read_buf(&mut bufs.inbuf) => Some(r),
            _ = tokio::time::sleep_until(auth_deadline), if unauthenticated => {
                break End::AuthTimeout
            }
            _ = open.evicted(), if unauthenticated => break End::Evicted,
            _ = sleep_or_never(shared.idle_timeout) => break End::IdleTimeout,
        };
        let stopping = read.is_none();
        match read {
            Some(Ok(0)) => break End::PeerClosed,
            Some(Ok(n)) => {
                shared.state.stats().add_bytes_in(n);
                if unauthenticated {
                    unauthenticated_bytes += n;
                }
            }
            Some(Err(e)) => break End::Io(e),
            None => {}
        }
        let run = run_buffered(
            &ctx,
            &mut session,
            &mut resume,
            &mut bufs,
            &mut stream,
            &shared,
        )
        .await;
        if !needs_auth(&session) && !open.authenticated() {
            bufs.out.clear();
            break End::Evicted;
        }
        match run {
            Ok(Some(end)) => break end,
            Ok(None) => {}
            Err(end) => break end,
        }
        if stopping {
            break End::Shutdown;
        }
        bufs.shrink_in(BUF_KEEP_BYTES, READ_CHUNK_BYTES);
    };
    // Counted no longer: a slot is not held while the reply goes out and we linger.
    drop(open);
    match &end {
        End::NoAuth => bufs.out.extend_from_slice(NOAUTH),
        End::Evicted => bufs
            .out
            .extend_from_slice(format!("-ERR {EVICTED_MESSAGE}\r\n").as_bytes()),
        End::OverBudget(e) => bufs.out.extend_from_slice(&over_budget_reply(e)),
        _ => {}
    }
    if !bufs.out.is_empty() && !matches!(end, End::Io(_)) {
        let _ = write_out(&mut stream, &mut bufs, &shared).await;
    }
    if matches!(
        end,
        End::NoAuth | End::OverBudget(_) | End::Protocol(_) | End::Evicted
    ) {
        // The client may still be sending: closing with its bytes unread would reset
        // the connection and could destroy the reply that says why.
        linger_close(&mut stream, &mut bufs.inbuf).await;
    } else {
        let _ = stream.shutdown().await;
    }
    match end {
        End::Io(e) if !peer_went_away(&e) => warn!(%peer, error = %e, "RESP connection failed"),
        End::Protocol(e) => crate::protolog::protocol_error(peer, &e),
        End::Shutdown => debug!(%peer, "RESP connection closed for shutdown"),
        End::NoAuth => {
            warn_limited!(RESP_REFUSALS, %peer, "RESP connection sent too much before AUTH; closed")
        }
        End::AuthTimeout => debug!(%peer, "RESP connection did not AUTH in time; closed"),
        End::Evicted => debug!(%peer, "unauthenticated RESP connection made room for a newer one"),
        End::IdleTimeout => debug!(%peer, "RESP connection idle; closed"),
        End::OverBudget(e) => {
            warn!(%peer, error = %e, "RESP connection over the connection buffer budget; closed")
        }
        _ => debug!(%peer, "RESP connection closed"),
    }
}

fn over_budget_reply(e: &OverBudget) -> Vec<u8> {
    format!("-ERR connection buffer memory exhausted: {e}\r\n").into_bytes()
}

/// Runs every complete command in the input buffer; `Ok(Some)` when the connection must
/// end after its replies are sent, `Err` when it must end at once.
async fn run_buffered(
    ctx: &Ctx<'_>,
    session: &mut Session,
    resume: &mut Resume,
    bufs: &mut ConnBuffers,
    stream: &mut TcpStream,
    shared: &RespShared,
) -> Result<Option<End>, End> {
    let mut commands = 0u64;
    // Bytes of the input already run; taken off once at the end, so every command's
    // arguments can be plain slices of it.
    let mut done = 0;
    let mut needed = 0;
    let mut args: Vec<&[u8]> = Vec::new();
    // One clock read for the commands of one read, as Redis reads its clock once per
    // command rather than per key: they arrived together and run within microseconds.
    // Re-read after every wait for the socket.
    let mut now = Instant::now();
    let inbuf = std::mem::take(&mut bufs.inbuf);
    let result = loop {
        match parse_command_resuming(&inbuf[done..], &mut args, shared.proto_max_bulk_len, resume) {
            Ok(Parsed::Command(len)) => {
                done += len;
                if args.is_empty() {
                    continue;
                }
                commands += 1;
                let wait = ctx.state.throttle_wait(1);
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                    now = Instant::now();
                }
                execute(ctx, session, &args, now, &mut bufs.out);
                if let Err(e) = bufs.settle_out() {
                    break Some(End::OverBudget(e));
                }
                if session.quit {
                    break Some(End::Quit);
                }
                if bufs.out.len() >= OUT_FLUSH_BYTES {
                    if let Err(e) = write_out(stream, bufs, shared).await {
                        bufs.inbuf = inbuf;
                        return Err(End::Io(e));
                    }
                    now = Instant::now();
                }
            }
            Ok(Parsed::Incomplete(len)) => {
                needed = len;
                break None;
            }
            Err(e) => {
                // As Redis does: say why, then close, since the stream is out of step.
                codec::error(&mut bufs.out, &format!("ERR {e}"));
                break Some(End::Protocol(e));
            }
        }
    };
    drop(args);
    bufs.inbuf = inbuf;
    bufs.inbuf.advance(done);
    ctx.state
        .stats()
        .add_resp_commands(commands, &session.take_ops());
    if commands > 0 {
        super::spin::note_activity();
    }
    // Make room for the rest of a command that is still arriving, so a big value comes
    // in without regrowths (the parser has checked it against the limits). Not before
    // AUTH: an unauthenticated connection never gets more room than its allowance.
    let authenticated = ctx.token.is_none() || session.authenticated;
    let mut result = result;
    if result.is_none() && authenticated && needed > bufs.inbuf.len() {
        if let Err(e) = bufs.reserve_in(needed - bufs.inbuf.len()) {
            result = Some(End::OverBudget(e));
        }
    }
    if result.is_none() && !bufs.out.is_empty() {
        write_out(stream, bufs, shared).await.map_err(End::Io)?;
    }
    Ok(result)
}

async fn write_out(
    stream: &mut TcpStream,
    bufs: &mut ConnBuffers,
    shared: &RespShared,
) -> io::Result<()> {
    write_all_idle(stream, &bufs.out, shared.idle_timeout).await?;
    shared.state.stats().add_bytes_out(bufs.out.len());
    bufs.clear_out(BUF_KEEP_BYTES, READ_CHUNK_BYTES);
    Ok(())
}

/// Tells a connection that was not admitted why it is being closed, in Redis's words
/// where Redis has them.
pub(crate) async fn refuse(
    mut stream: TcpStream,
    peer: SocketAddr,
    state: Arc<ServerState>,
    refusal: Refusal,
) {
    warn_limited!(
        RESP_REFUSALS,
        %peer,
        reason = refusal_message(refusal),
        "refusing RESP connection"
    );
    state.stats().connection_refused();
    let reply = match refusal {
        Refusal::Full => "-ERR max number of clients reached\r\n".to_owned(),
        other => format!("-ERR {}\r\n", refusal_message(other)),
    };
    let _ = tokio::time::timeout(
        Duration::from_millis(500),
        stream.write_all(reply.as_bytes()),
    )
    .await;
    let _ = stream.shutdown().await;
}
