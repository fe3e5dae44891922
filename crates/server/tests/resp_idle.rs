//! The Redis port's event loop polls for a while after each command instead of sleeping
//! (`resp::spin`); an idle server must still use no CPU. In a file of its own so no
//! other test's RESP traffic runs in this process while the thread is measured.

use camelot_server::{ServerConfig, ServerHandle};
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// Bound on every network wait; far above what loopback needs.
const WAIT: Duration = Duration::from_secs(10);
/// How long the idle loop is watched. The spin lasts 100 µs after the last command, so
/// a loop that kept spinning would use most of this.
const IDLE_WINDOW: Duration = Duration::from_millis(300);
/// CPU the loop may use in that window: timers and the like, nowhere near a spin.
const IDLE_CPU_MAX: Duration = Duration::from_millis(30);
const PINGS: usize = 2_000;

/// The `/proc/self/task` directories of this process's RESP event-loop threads.
fn resp_threads() -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").expect("/proc/self/task lists") {
        let dir = entry.expect("task entry").path();
        // A thread that ended between the listing and this read is not ours.
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end().starts_with("camelot-resp-") {
            found.push(dir);
        }
    }
    found
}

/// CPU time of those threads together (the first number of each `schedstat`).
fn cpu(threads: &[PathBuf]) -> Duration {
    threads
        .iter()
        .map(|dir| {
            let stat = std::fs::read_to_string(dir.join("schedstat")).expect("schedstat reads");
            let ns: u64 = stat
                .split_ascii_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .expect("schedstat starts with the CPU time in ns");
            Duration::from_nanos(ns)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_loop_stops_polling_once_idle() {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), 64 << 20);
    config.resp_listen = Some("127.0.0.1:0".parse().unwrap());
    let server = timeout(WAIT, ServerHandle::start(config))
        .await
        .expect("start timed out")
        .expect("start failed");
    let addr = server.resp_addr().expect("RESP port");
    let mut conn = timeout(WAIT, TcpStream::connect(addr))
        .await
        .expect("connect timed out")
        .expect("connect failed");
    let mut reply = [0u8; 7];
    for _ in 0..PINGS {
        conn.write_all(b"PING\r\n").await.expect("send PING");
        timeout(WAIT, conn.read_exact(&mut reply))
            .await
            .expect("PONG timed out")
            .expect("read PONG");
        assert_eq!(&reply, b"+PONG\r\n");
    }

    // Looked up only now: a new thread names itself once it runs, and it has answered.
    let threads = resp_threads();
    assert!(!threads.is_empty(), "no camelot-resp-* thread found");
    // The connection stays open: the loop must sleep because no command comes, not
    // because its client left. The sleep here is the measuring window, not a wait for
    // something to happen.
    let before = cpu(&threads);
    tokio::time::sleep(IDLE_WINDOW).await;
    let used = cpu(&threads).saturating_sub(before);
    assert!(
        used < IDLE_CPU_MAX,
        "the idle RESP loop used {used:?} of CPU in {IDLE_WINDOW:?}"
    );

    drop(conn);
    server.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_window_past_the_limit_is_refused_before_listening() {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), 64 << 20);
    config.resp_listen = Some("127.0.0.1:0".parse().unwrap());
    config.resp_poll = camelot_server::resp::SPIN_IDLE_MAX + Duration::from_micros(1);
    let refused = timeout(WAIT, ServerHandle::start(config))
        .await
        .expect("start timed out");
    match refused {
        Err(camelot_server::ServerError::Config(message)) => {
            assert!(message.contains("polls at most"), "{message}")
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a polling window past the limit was accepted"),
    }
}
