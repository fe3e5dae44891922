//! `camelot bench hw net-server`: the far end of `bench hw net`. On another host it lets
//! `--peer` measure the network between two machines; in process on 127.0.0.1 it is the
//! far end of the default loopback run, so both take the same code path.
//!
//! One thread per connection, each running the test the connection's `Start` names (see
//! [`netctl`]). A peer that sends garbage, asks for too much or goes silent gets a refusal
//! or a closed connection; other sessions never notice.

use super::SECONDS_PER_POINT_MAX;
use crate::netctl::{self, Message, Report, Test, IO_TIMEOUT, STREAMS_MAX, UDP_PAYLOAD_BYTES_MAX};
use crate::BenchError;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Sessions at once: every stream of a run, plus as many again for a second client.
pub const SESSIONS_MAX: usize = 2 * STREAMS_MAX;
/// A UDP session waits this long for `Stop` or EOF: the longest point, plus slack.
const CONTROL_IDLE_MAX: Duration =
    Duration::from_secs(SECONDS_PER_POINT_MAX as u64 + IO_TIMEOUT.as_secs());
/// How often a UDP thread looks up from its socket to see whether the session ended.
const UDP_POLL: Duration = Duration::from_millis(50);
/// Pause after a failed accept (e.g. out of descriptors) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// After `Stop`, a sink counts what is still queued for at most this long.
const UDP_DRAIN_MAX: Duration = Duration::from_secs(1);

/// A running net server; stops (and stops accepting) when dropped.
pub struct NetServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl NetServer {
    pub fn start(listen: SocketAddr) -> Result<NetServer, BenchError> {
        let listener = TcpListener::bind(listen)
            .map_err(|e| BenchError::Setup(format!("cannot listen on {listen}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| BenchError::Setup(format!("listener address: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let epoch = Instant::now();
        let accept = {
            let stop = Arc::clone(&stop);
            thread::Builder::new()
                .name("net-server".into())
                .spawn(move || accept_loop(&listener, &stop, epoch))
                .map_err(|e| BenchError::Setup(format!("cannot start the net server: {e}")))?
        };
        Ok(NetServer {
            addr,
            stop,
            accept: Some(accept),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for NetServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // accept() has no timeout: a connection of our own wakes it to see the flag.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        let woke = TcpStream::connect_timeout(&wake, IO_TIMEOUT).is_ok();
        if let Some(h) = self.accept.take() {
            // Without the wake-up the thread stays blocked; leave it rather than hang.
            if woke {
                let _ = h.join();
            }
        }
    }
}

/// Counts a session while it lives.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop(listener: &TcpListener, stop: &AtomicBool, epoch: Instant) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let Ok(mut conn) = conn else {
            // Out of descriptors or an aborted handshake: back off briefly so a
            // persistent error cannot spin this thread.
            thread::sleep(ACCEPT_BACKOFF);
            continue;
        };
        if active.fetch_add(1, Ordering::AcqRel) >= SESSIONS_MAX {
            active.fetch_sub(1, Ordering::AcqRel);
            let _ = conn.set_write_timeout(Some(IO_TIMEOUT));
            let _ = conn.write_all(&netctl::encode(&Message::Refused(format!(
                "busy: {SESSIONS_MAX} sessions already"
            ))));
            continue;
        }
        let slot = Slot(Arc::clone(&active));
        let spawned = thread::Builder::new()
            .name("net-session".into())
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = session(conn, epoch) {
                    tracing::debug!("net-server session ended: {e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("net-server: cannot start a session thread: {e}");
        }
    }
}

fn setup(what: &str) -> impl FnOnce(std::io::Error) -> BenchError + '_ {
    move |e| BenchError::Setup(format!("{what}: {e}"))
}

fn since(epoch: Instant, t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

fn send(conn: &mut TcpStream, m: &Message) -> Result<(), BenchError> {
    conn.write_all(&netctl::encode(m)).map_err(setup("reply"))
}

/// What arrived, as a report; times on the server's clock.
struct Tally {
    epoch: Instant,
    bytes: u64,
    first: Option<Instant>,
    last: Instant,
}

impl Tally {
    fn new(epoch: Instant) -> Tally {
        Tally {
            epoch,
            bytes: 0,
            first: None,
            last: epoch,
        }
    }
    fn add(&mut self, n: usize) {
        self.last = Instant::now();
        self.first.get_or_insert(self.last);
        self.bytes += n as u64;
    }
    fn report(&self) -> Message {
        Message::Report(Report {
            bytes: self.bytes,
            first_ns: since(self.epoch, self.first.unwrap_or(self.last)),
            last_ns: since(self.epoch, self.last),
        })
    }
}

fn session(mut conn: TcpStream, epoch: Instant) -> Result<(), BenchError> {
    conn.set_read_timeout(Some(IO_TIMEOUT))
        .map_err(setup("timeout"))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(setup("timeout"))?;
    let test = match netctl::read_message(&mut conn) {
        Ok(Message::Start(t)) => t,
        Ok(other) => {
            let _ = send(
                &mut conn,
                &Message::Refused(format!("expected Start, got {other:?}")),
            );
            return Err(BenchError::Setup("no Start".into()));
        }
        Err(e) => {
            let _ = send(&mut conn, &Message::Refused(e.to_string()));
            return Err(e.into());
        }
    };
    match test {
        Test::TcpSink { buffer_bytes } => {
            send(&mut conn, &Message::Ready { udp_port: 0 })?;
            let mut buf = vec![0u8; (buffer_bytes as usize).max(64 << 10)];
            let mut tally = Tally::new(epoch);
            loop {
                match conn.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => tally.add(n),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(setup("tcp read")(e)),
                }
            }
            send(&mut conn, &tally.report())
        }
        Test::TcpEcho { message_bytes } => {
            conn.set_nodelay(true).map_err(setup("nodelay"))?;
            send(&mut conn, &Message::Ready { udp_port: 0 })?;
            let mut buf = vec![0u8; message_bytes as usize];
            // EOF (the client is done) and errors both end the echo.
            while conn.read_exact(&mut buf).is_ok() {
                conn.write_all(&buf).map_err(setup("echo"))?;
            }
            Ok(())
        }
        Test::UdpSink { .. } | Test::UdpEcho { .. } => udp_session(conn, test, epoch),
    }
}

/// UDP tests: a fresh socket on the address the client reached us at, served by a second
/// thread until the control connection says `Stop` or closes.
fn udp_session(mut conn: TcpStream, test: Test, epoch: Instant) -> Result<(), BenchError> {
    let ip = conn.local_addr().map_err(setup("local address"))?.ip();
    let sock = UdpSocket::bind(SocketAddr::new(ip, 0)).map_err(setup("udp bind"))?;
    sock.set_read_timeout(Some(UDP_POLL))
        .map_err(setup("timeout"))?;
    let udp_port = sock.local_addr().map_err(setup("udp address"))?.port();
    conn.set_read_timeout(Some(CONTROL_IDLE_MAX))
        .map_err(setup("timeout"))?;
    let echo = matches!(test, Test::UdpEcho { .. });
    let done = AtomicBool::new(false);
    let outcome = thread::scope(|s| -> Result<(Message, Tally), BenchError> {
        let worker = s.spawn(|| {
            let mut buf = vec![0u8; UDP_PAYLOAD_BYTES_MAX];
            let mut tally = Tally::new(epoch);
            let mut drain_until = None;
            loop {
                let got = sock.recv_from(&mut buf);
                if let Ok((n, from)) = got {
                    tally.add(n);
                    if echo {
                        let _ = sock.send_to(&buf[..n], from);
                    }
                }
                if done.load(Ordering::Acquire) {
                    // A sink drains what is still queued, but a flood cannot keep it.
                    if echo || got.is_err() {
                        break;
                    }
                    let until = *drain_until.get_or_insert_with(|| Instant::now() + UDP_DRAIN_MAX);
                    if Instant::now() >= until {
                        break;
                    }
                }
            }
            tally
        });
        let ended = send(&mut conn, &Message::Ready { udp_port })
            .and_then(|()| Ok(netctl::read_message(&mut conn)?));
        done.store(true, Ordering::Release);
        let tally = worker
            .join()
            .map_err(|_| BenchError::Setup("a UDP thread panicked".into()))?;
        Ok((ended?, tally))
    });
    match (echo, outcome) {
        // An echo ends when its client closes the connection.
        (true, _) => Ok(()),
        (false, Ok((Message::Stop, tally))) => send(&mut conn, &tally.report()),
        (false, Ok((m, _))) => Err(BenchError::Setup(format!("expected Stop, got {m:?}"))),
        (false, Err(e)) => Err(e),
    }
}
