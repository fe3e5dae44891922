//! Hostile and careless clients on both ports, over real loopback sockets: what a peer
//! may make the server hold before it authenticates, how long it may sit there, how many
//! such peers there may be, and the connection-buffer budget.

use bytes::{Bytes, BytesMut};
use camelot_proto::{
    decode_frame, encode_frame, ErrorCode, Frame, FrameDecoder, Hello, Op, Reply, Request,
    RequestBatch, PROTOCOL_VERSION,
};
use camelot_server::resp::UNAUTHENTICATED_INPUT_BYTES_MAX;
use camelot_server::{ServerConfig, ServerHandle};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};

/// Bound on every network wait; far above what loopback needs.
const WAIT: Duration = Duration::from_secs(10);
const TOKEN: &[u8] = b"sesame";

fn config() -> ServerConfig {
    let mut c = ServerConfig::new("127.0.0.1:0".parse().unwrap(), 64 << 20);
    c.resp_listen = Some("127.0.0.1:0".parse().unwrap());
    c
}

async fn start(config: ServerConfig) -> ServerHandle {
    timeout(WAIT, ServerHandle::start(config))
        .await
        .expect("start timed out")
        .expect("start failed")
}

async fn connect(addr: SocketAddr) -> TcpStream {
    timeout(WAIT, TcpStream::connect(addr))
        .await
        .expect("connect timed out")
        .expect("connect failed")
}

fn stat(server: &ServerHandle, name: &str) -> u64 {
    server
        .stats()
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no stat {name}"))
}

/// Waits (bounded) until `cond` holds.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "not within {WAIT:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Everything the peer sends until it closes (bounded by [`WAIT`]).
async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let r = timeout(WAIT, s.read_to_end(&mut got)).await;
    match r {
        Ok(Ok(_)) => {}
        // A reset after the last reply still counts as closed.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(Err(e)) => panic!("read: {e}"),
        Err(_) => panic!(
            "still open after {WAIT:?}; got {:?}",
            String::from_utf8_lossy(&got)
        ),
    }
    got
}

/// Reads until `want` bytes arrived (bounded).
async fn read_exactly(s: &mut TcpStream, want: usize) -> Vec<u8> {
    let mut got = vec![0u8; want];
    timeout(WAIT, s.read_exact(&mut got))
        .await
        .expect("reply timed out")
        .expect("reply");
    got
}

fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

async fn native_hello(s: &mut TcpStream, token: &[u8]) -> Frame {
    let mut buf = BytesMut::new();
    encode_frame(
        &Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: Bytes::copy_from_slice(token),
            principal: String::new(),
            fence: None,
        }),
        &mut buf,
    )
    .unwrap();
    s.write_all(&buf).await.unwrap();
    native_recv(s, &mut BytesMut::new())
        .await
        .expect("an answer to HELLO")
}

async fn native_recv(s: &mut TcpStream, buf: &mut BytesMut) -> Option<Frame> {
    loop {
        if let Some(body) = FrameDecoder::split_frame(buf).unwrap() {
            return Some(decode_frame(body).unwrap());
        }
        match timeout(WAIT, s.read_buf(buf)).await.expect("no frame") {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

async fn native_ping(s: &mut TcpStream) -> bool {
    let mut buf = BytesMut::new();
    encode_frame(
        &Frame::Requests(RequestBatch {
            epoch: 0,
            requests: vec![Request {
                id: 9,
                op: Op::Ping,
            }],
        }),
        &mut buf,
    )
    .unwrap();
    if s.write_all(&buf).await.is_err() {
        return false;
    }
    matches!(
        native_recv(s, &mut BytesMut::new()).await,
        Some(Frame::Responses(r)) if r.responses[0].result == Ok(Reply::Pong)
    )
}

// ---- 1. What a RESP peer may send before AUTH ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_before_auth_may_send_a_few_kib_then_noauth_and_close() {
    let mut cfg = config();
    cfg.token = Some(TOKEN.to_vec());
    let server = start(cfg).await;
    let mut s = connect(server.resp_addr().unwrap()).await;
    // A command announcing a 32 MiB argument: the codec would have the connection
    // reserve all of it. Before AUTH it gets no more room than its allowance.
    s.write_all(b"*2\r\n$3\r\nSET\r\n$33554432\r\n")
        .await
        .unwrap();
    let filler = vec![b'x'; 2 * UNAUTHENTICATED_INPUT_BYTES_MAX];
    // The server may close before it has read all of this; that is the point.
    let _ = s.write_all(&filler).await;
    let got = read_to_close(&mut s).await;
    assert_eq!(got, b"-NOAUTH Authentication required.\r\n");
    assert!(
        stat(&server, "connection_buffers_used_bytes") <= 64 << 10,
        "an unauthenticated connection held {} bytes of buffers",
        stat(&server, "connection_buffers_used_bytes")
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_commands_before_auth_count_against_the_allowance() {
    let mut cfg = config();
    cfg.token = Some(TOKEN.to_vec());
    let server = start(cfg).await;
    let mut s = connect(server.resp_addr().unwrap()).await;
    // Small commands, each answered -NOAUTH, until the allowance is spent.
    let ping = resp(&[b"PING"]);
    let n = UNAUTHENTICATED_INPUT_BYTES_MAX / ping.len() + 8;
    let _ = s.write_all(&ping.repeat(n)).await;
    let got = read_to_close(&mut s).await;
    let replies = got.split(|&b| b == b'\n').filter(|l| !l.is_empty()).count();
    assert!(
        replies <= UNAUTHENTICATED_INPUT_BYTES_MAX / ping.len() + 1,
        "{replies} replies for {n} PINGs"
    );
    assert!(got.ends_with(b"-NOAUTH Authentication required.\r\n"));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_auth_with_a_pipeline_behind_it_is_all_answered() {
    let mut cfg = config();
    cfg.token = Some(TOKEN.to_vec());
    let server = start(cfg).await;
    let mut s = connect(server.resp_addr().unwrap()).await;
    // What redis-benchmark -a does: AUTH first in the same write as the pipeline, which
    // is far bigger than the allowance.
    let mut burst = resp(&[b"AUTH", TOKEN]);
    let value = vec![b'v'; 1000];
    let sets = 64;
    for i in 0..sets {
        burst.extend(resp(&[b"SET", format!("k{i}").as_bytes(), &value]));
    }
    assert!(burst.len() > 8 * UNAUTHENTICATED_INPUT_BYTES_MAX);
    s.write_all(&burst).await.unwrap();
    let want = b"+OK\r\n".repeat(sets + 1);
    assert_eq!(read_exactly(&mut s, want.len()).await, want);
    server.shutdown().await.unwrap();
}

// ---- 2. Timeouts and the cap on unauthenticated connections ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_peer_that_never_authenticates_is_closed_at_the_handshake_timeout() {
    let mut cfg = config();
    cfg.token = Some(TOKEN.to_vec());
    cfg.handshake_timeout = Duration::from_millis(300);
    let server = start(cfg).await;
    let started = Instant::now();
    let mut silent = connect(server.resp_addr().unwrap()).await;
    let mut chatty = connect(server.resp_addr().unwrap()).await;
    chatty.write_all(&resp(&[b"PING"])).await.unwrap();
    assert_eq!(read_to_close(&mut silent).await, b"");
    assert_eq!(
        read_to_close(&mut chatty).await,
        b"-NOAUTH Authentication required.\r\n"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_on_both_ports_only_when_asked() {
    let mut cfg = config();
    cfg.idle_timeout = Some(Duration::from_millis(300));
    let server = start(cfg).await;
    let mut native = connect(server.local_addr()).await;
    assert!(matches!(
        native_hello(&mut native, b"").await,
        Frame::HelloOk(_)
    ));
    let mut redis = connect(server.resp_addr().unwrap()).await;
    redis.write_all(&resp(&[b"PING"])).await.unwrap();
    assert_eq!(read_exactly(&mut redis, 7).await, b"+PONG\r\n");
    let idle_since = Instant::now();
    assert!(read_to_close(&mut native).await.is_empty());
    assert!(read_to_close(&mut redis).await.is_empty());
    assert!(idle_since.elapsed() >= Duration::from_millis(250));
    server.shutdown().await.unwrap();

    // Default: no idle timeout. A connection quiet for longer than the one above stays.
    let server = start(config()).await;
    let mut redis = connect(server.resp_addr().unwrap()).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    redis.write_all(&resp(&[b"PING"])).await.unwrap();
    assert_eq!(read_exactly(&mut redis, 7).await, b"+PONG\r\n");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_unauthenticated_sockets_cannot_lock_authenticated_clients_out() {
    const UNAUTH_MAX: usize = 6;
    const CONNECTIONS_MAX: usize = 12;
    let mut cfg = config();
    cfg.token = Some(TOKEN.to_vec());
    cfg.connections_max = CONNECTIONS_MAX;
    cfg.unauthenticated_connections_max = UNAUTH_MAX;
    // Far longer than this test: nothing here waits for the idle sockets to time out.
    cfg.handshake_timeout = Duration::from_secs(60);
    let server = start(cfg).await;
    let (native_addr, resp_addr) = (server.local_addr(), server.resp_addr().unwrap());

    // A client that authenticated before the flood, on each port.
    let mut early = connect(native_addr).await;
    assert!(matches!(
        native_hello(&mut early, TOKEN).await,
        Frame::HelloOk(_)
    ));
    let mut early_redis = connect(resp_addr).await;
    early_redis
        .write_all(&resp(&[b"AUTH", TOKEN]))
        .await
        .unwrap();
    assert_eq!(read_exactly(&mut early_redis, 5).await, b"+OK\r\n");

    // The cap's worth of idle, unauthenticated sockets, on both ports.
    let mut idle = Vec::new();
    for i in 0..UNAUTH_MAX {
        idle.push(connect(if i % 2 == 0 { native_addr } else { resp_addr }).await);
    }
    let s = &server;
    eventually("the idle sockets are counted", || {
        stat(s, "connections_unauthenticated") == UNAUTH_MAX as u64
    })
    .await;

    // Clients that had authenticated are still served.
    assert!(native_ping(&mut early).await);
    early_redis.write_all(&resp(&[b"PING"])).await.unwrap();
    assert_eq!(read_exactly(&mut early_redis, 7).await, b"+PONG\r\n");

    // New clients get in at once on both ports: each takes the place of the oldest
    // idle socket, which is told why and closed.
    let mut late = connect(native_addr).await;
    assert!(matches!(
        native_hello(&mut late, TOKEN).await,
        Frame::HelloOk(_)
    ));
    assert!(native_ping(&mut late).await);
    // Fill the cap again, and do the same on the Redis port.
    idle.push(connect(native_addr).await);
    eventually("the cap is full again", || {
        stat(s, "connections_unauthenticated") == UNAUTH_MAX as u64
    })
    .await;
    let mut late_redis = connect(resp_addr).await;
    late_redis
        .write_all(&[resp(&[b"AUTH", TOKEN]), resp(&[b"PING"])].concat())
        .await
        .unwrap();
    assert_eq!(read_exactly(&mut late_redis, 12).await, b"+OK\r\n+PONG\r\n");

    eventually("two idle sockets made room and closed", || {
        stat(s, "connections_unauthenticated") == UNAUTH_MAX as u64 - 1
            && stat(s, "connections_current") == (4 + UNAUTH_MAX - 1) as u64
    })
    .await;
    // Which two depends on accept order across the ports: read them all at once, each
    // for at most a second; exactly two were closed with the reason.
    let reads = idle.into_iter().map(|mut s| async move {
        let mut got = Vec::new();
        match timeout(Duration::from_secs(1), s.read_to_end(&mut got)).await {
            Ok(_) => Some(got),
            Err(_) => None,
        }
    });
    let closed: Vec<Vec<u8>> = futures_join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(closed.len(), 2, "{closed:?}");
    for got in closed {
        let text = String::from_utf8_lossy(&got);
        assert!(
            text.contains("too many connections waiting to authenticate"),
            "{text:?}"
        );
    }
    assert!(stat(&server, "connections_current") < CONNECTIONS_MAX as u64);
    server.shutdown().await.unwrap();
}

/// Runs every future to its end concurrently (each on its own task).
async fn futures_join_all<F>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("task"));
    }
    out
}

// ---- 3. The connection-buffer budget ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_buffer_budget_get_an_error_not_memory() {
    let mut cfg = config();
    // Room for a few connections' starting buffers and little else.
    cfg.connection_buffers_bytes_max = 512 << 10;
    let server = start(cfg).await;
    let resp_addr = server.resp_addr().unwrap();

    // A 1 MiB value, stored, then asked for: the reply does not fit the budget.
    let value = vec![b'v'; 1 << 20];
    let mut writer = connect(resp_addr).await;
    // The server may close before it has read all of this: it answers, then closes.
    let _ = writer.write_all(&resp(&[b"SET", b"big", &value])).await;
    let got = read_to_close(&mut writer).await;
    assert!(
        got.starts_with(b"-ERR connection buffer memory exhausted"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    let s = &server;
    eventually("the closed connection gave its buffers back", || {
        stat(s, "connection_buffers_used_bytes") == 0
    })
    .await;
    // Small commands still work on a fresh connection.
    let mut small = connect(resp_addr).await;
    small.write_all(&resp(&[b"SET", b"k", b"v"])).await.unwrap();
    assert_eq!(read_exactly(&mut small, 5).await, b"+OK\r\n");
    assert!(stat(&server, "connection_buffers_used_bytes") <= 512 << 10);
    assert_eq!(stat(&server, "connection_buffers_cap_bytes"), 512 << 10);

    // Native: a frame announcing 4 MiB does not fit either: FATAL OUT_OF_MEMORY.
    let mut native = connect(server.local_addr()).await;
    assert!(matches!(
        native_hello(&mut native, b"").await,
        Frame::HelloOk(_)
    ));
    native.write_all(&(4u32 << 20).to_le_bytes()).await.unwrap();
    native.write_all(&[0u8; 1024]).await.unwrap();
    match native_recv(&mut native, &mut BytesMut::new()).await {
        Some(Frame::Fatal(e)) => assert_eq!(e.code, ErrorCode::OutOfMemory, "{e:?}"),
        other => panic!("expected FATAL, got {other:?}"),
    }
    server.shutdown().await.unwrap();
}
