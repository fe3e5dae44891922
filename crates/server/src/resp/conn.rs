//! One Redis-protocol connection: read what arrived, run every complete command in it,
//! write all the replies in one go (so pipelined clients get pipelined answers).

use super::codec::{self, parse_command_with, Parsed};
use super::commands::{execute, Ctx, Session};
use crate::conn::{peer_went_away, wait_shutdown, OpenConnection};
use crate::state::ServerState;
use bytes::{Buf, BytesMut};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
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

pub(crate) struct RespShared {
    pub state: Arc<ServerState>,
    pub token: Option<Vec<u8>>,
    /// `proto-max-bulk-len`: the longest argument read.
    pub proto_max_bulk_len: usize,
}

enum End {
    PeerClosed,
    Quit,
    Shutdown,
    Protocol(codec::RespError),
    Io(io::Error),
}

/// Serves one connection until the client leaves, sends QUIT or garbage, or the server
/// shuts down (then every command already received is answered first).
pub(crate) async fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<RespShared>,
    mut stop: watch::Receiver<bool>,
    _open: OpenConnection,
) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(%peer, error = %e, "cannot set TCP_NODELAY");
    }
    let mut session = Session::default();
    let mut inbuf = BytesMut::with_capacity(READ_CHUNK_BYTES);
    let mut out = BytesMut::with_capacity(READ_CHUNK_BYTES);
    let ctx = Ctx {
        state: &shared.state,
        token: shared.token.as_deref(),
    };
    let end = loop {
        if inbuf.capacity() - inbuf.len() < READ_CHUNK_BYTES / 4 {
            inbuf.reserve(READ_CHUNK_BYTES);
        }
        let read = tokio::select! {
            biased;
            _ = wait_shutdown(&mut stop) => None,
            r = stream.read_buf(&mut inbuf) => Some(r),
        };
        let stopping = read.is_none();
        match read {
            Some(Ok(0)) => break End::PeerClosed,
            Some(Ok(n)) => shared.state.stats().add_bytes_in(n),
            Some(Err(e)) => break End::Io(e),
            None => {}
        }
        let bulk_max = shared.proto_max_bulk_len;
        match run_buffered(
            &ctx,
            &mut session,
            &mut inbuf,
            &mut out,
            &mut stream,
            bulk_max,
        )
        .await
        {
            Ok(Some(end)) => break end,
            Ok(None) => {}
            Err(e) => break End::Io(e),
        }
        if stopping {
            break End::Shutdown;
        }
        if inbuf.is_empty() && inbuf.capacity() > BUF_KEEP_BYTES {
            inbuf = BytesMut::with_capacity(READ_CHUNK_BYTES);
        }
    };
    if !out.is_empty() {
        let _ = write_out(&mut stream, &mut out, &shared.state).await;
    }
    let _ = stream.shutdown().await;
    match end {
        End::Io(e) if !peer_went_away(&e) => warn!(%peer, error = %e, "RESP connection failed"),
        End::Protocol(e) => super::protolog::protocol_error(peer, &e),
        End::Shutdown => debug!(%peer, "RESP connection closed for shutdown"),
        _ => debug!(%peer, "RESP connection closed"),
    }
}

/// Runs every complete command in `inbuf`; `Some` when the connection must end.
async fn run_buffered(
    ctx: &Ctx<'_>,
    session: &mut Session,
    inbuf: &mut BytesMut,
    out: &mut BytesMut,
    stream: &mut TcpStream,
    bulk_bytes_max: usize,
) -> io::Result<Option<End>> {
    let mut commands = 0u64;
    // Bytes of `inbuf` already run; taken off once at the end, so every command's
    // arguments can be plain slices of it.
    let mut done = 0;
    let mut needed = 0;
    let mut args: Vec<&[u8]> = Vec::new();
    // One clock read for the commands of one read, as Redis reads its clock once per
    // command rather than per key: they arrived together and run within microseconds.
    // Re-read after every wait for the socket.
    let mut now = Instant::now();
    let result = loop {
        match parse_command_with(&inbuf[done..], &mut args, bulk_bytes_max) {
            Ok(Parsed::Command(len)) => {
                done += len;
                if args.is_empty() {
                    continue;
                }
                commands += 1;
                execute(ctx, session, &args, now, out);
                if session.quit {
                    break Some(End::Quit);
                }
                if out.len() >= OUT_FLUSH_BYTES {
                    write_out(stream, out, ctx.state).await?;
                    now = Instant::now();
                }
            }
            Ok(Parsed::Incomplete(len)) => {
                needed = len;
                break None;
            }
            Err(e) => {
                // As Redis does: say why, then close, since the stream is out of step.
                codec::error(out, &format!("ERR {e}"));
                break Some(End::Protocol(e));
            }
        }
    };
    drop(args);
    inbuf.advance(done);
    // Make room for the rest of a command that is still arriving, so a big value comes
    // in without regrowths (the parser has checked it against the limits).
    if result.is_none() && needed > inbuf.len() {
        inbuf.reserve(needed - inbuf.len());
    }
    ctx.state
        .stats()
        .add_resp_commands(commands, &session.take_ops());
    if commands > 0 {
        super::spin::note_activity();
    }
    if !out.is_empty() {
        write_out(stream, out, ctx.state).await?;
    }
    Ok(result)
}

async fn write_out(
    stream: &mut TcpStream,
    out: &mut BytesMut,
    state: &ServerState,
) -> io::Result<()> {
    stream.write_all(out).await?;
    state.stats().add_bytes_out(out.len());
    out.clear();
    if out.capacity() > BUF_KEEP_BYTES {
        *out = BytesMut::with_capacity(READ_CHUNK_BYTES);
    }
    Ok(())
}

/// Tells a connection over `connections_max` why it is being closed, in Redis's words.
pub(crate) async fn refuse(mut stream: TcpStream, state: Arc<ServerState>) {
    warn!("refusing RESP connection: connections_max reached");
    state.stats().connection_refused();
    let _ = stream
        .write_all(b"-ERR max number of clients reached\r\n")
        .await;
    let _ = stream.shutdown().await;
}
