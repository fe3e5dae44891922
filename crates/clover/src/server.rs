//! The metadata server: a [`Meta`] over the data servers' regions, reached by stores in
//! other processes through `wire` (`camelot clover meta` runs it).
//!
//! Each connection has a thread of its own, at most [`MetaServerConfig::connections_max`]
//! at once (more are closed at accept). A connection costs nothing else until its HELLO
//! (at most `wire::HELLO_BYTES_MAX` bytes, within `handshake_timeout`) carries the token;
//! blocks are made only when an authenticated store asks for a key or nodes. Requests are
//! at most `wire::REQUEST_BYTES_MAX` bytes, read only after their length was checked.
//! A collection thread runs a pass every `gc_interval`.

use crate::layout::NodeAddr;
use crate::memory::{Memory, RegionMemory};
use crate::meta::Meta;
use crate::wire::{self, Answer, ErrorKind, Info, Request};
use crate::CloverError;
use bytes::Bytes;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connections served at once by default.
pub const CONNECTIONS_MAX_DEFAULT: usize = 256;
/// A connection with no request for this long is closed (its store reconnects).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone)]
pub struct MetaServerConfig {
    /// Stores must present it.
    pub token: Option<Vec<u8>>,
    /// The data servers as stores should reach them, in the order of the service's map.
    pub servers: Vec<String>,
    pub connections_max: usize,
    pub handshake_timeout: Duration,
    /// Pause between collection passes.
    pub gc_interval: Duration,
}

impl MetaServerConfig {
    pub fn new(servers: Vec<String>, token: Option<Vec<u8>>) -> MetaServerConfig {
        MetaServerConfig {
            token,
            servers,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            handshake_timeout: Duration::from_secs(10),
            gc_interval: Duration::from_millis(10),
        }
    }
}

#[derive(Default)]
struct Counters {
    connections_total: AtomicU64,
    connections_refused_full: AtomicU64,
    refused_auth: AtomicU64,
    requests: AtomicU64,
    gc_errors: AtomicU64,
}

pub struct MetaServer {
    meta: Arc<Meta<RegionMemory>>,
    config: MetaServerConfig,
    counters: Counters,
    connections: AtomicUsize,
}

fn tokens_match(expected: &[u8], given: &[u8]) -> bool {
    // Constant time in the token's bytes, as the memory server compares it.
    let mut diff = u8::from(expected.len() != given.len());
    for (i, &e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(!e);
    }
    std::hint::black_box(diff) == 0
}

fn error_answer(e: &CloverError) -> Answer {
    let (kind, arg) = match e {
        CloverError::OutOfMemory { blocks_max } => (ErrorKind::OutOfMemory, u64::from(*blocks_max)),
        CloverError::TooManyKeys(n) => (ErrorKind::TooManyKeys, *n as u64),
        CloverError::UnknownKey(id) => (ErrorKind::UnknownKey, *id),
        _ => (ErrorKind::Other, 0),
    };
    Answer::Error {
        kind,
        arg,
        message: e.to_string(),
    }
}

impl MetaServer {
    pub fn new(
        meta: Arc<Meta<RegionMemory>>,
        config: MetaServerConfig,
    ) -> Result<MetaServer, CloverError> {
        if config.servers.is_empty() || config.servers.len() > wire::SERVERS_MAX {
            return Err(CloverError::InvalidArgument(format!(
                "1 to {} data servers",
                wire::SERVERS_MAX
            )));
        }
        if config.connections_max == 0 || config.gc_interval.is_zero() {
            return Err(CloverError::InvalidArgument(
                "connections and the collection interval must be above 0".into(),
            ));
        }
        Ok(MetaServer {
            meta,
            config,
            counters: Counters::default(),
            connections: AtomicUsize::new(0),
        })
    }

    /// Serves until `stop` is set (checked between connections and collection passes).
    pub fn serve(self, listener: TcpListener, stop: Arc<AtomicBool>) -> Result<(), CloverError> {
        let server = Arc::new(self);
        let collector = {
            let (server, stop) = (server.clone(), stop.clone());
            std::thread::Builder::new()
                .name("clover-gc".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Err(e) = server.meta.gc() {
                            server.counters.gc_errors.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(error = %e, "collection pass failed");
                        }
                        // Pacing, not synchronisation: a pass holds the service's lock.
                        std::thread::sleep(server.config.gc_interval);
                    }
                })
                .map_err(|e| CloverError::Meta(format!("cannot start the collector: {e}")))?
        };
        for stream in listener.incoming() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            };
            if server.connections.fetch_add(1, Ordering::SeqCst) >= server.config.connections_max {
                server.connections.fetch_sub(1, Ordering::SeqCst);
                server
                    .counters
                    .connections_refused_full
                    .fetch_add(1, Ordering::Relaxed);
                drop(stream);
                continue;
            }
            server
                .counters
                .connections_total
                .fetch_add(1, Ordering::Relaxed);
            let s = server.clone();
            let spawned = std::thread::Builder::new()
                .name("clover-meta-conn".into())
                .spawn(move || {
                    let peer = stream.peer_addr().ok();
                    if let Err(e) = s.connection(stream) {
                        tracing::debug!(?peer, error = %e, "metadata connection ended");
                    }
                    s.connections.fetch_sub(1, Ordering::SeqCst);
                });
            if spawned.is_err() {
                server.connections.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let _ = collector.join();
        Ok(())
    }

    fn send(stream: &mut TcpStream, a: &Answer) -> Result<(), String> {
        let frame = wire::encode_answer(a).map_err(|e| e.to_string())?;
        stream.write_all(&frame).map_err(|e| e.to_string())
    }

    fn read_body(stream: &mut TcpStream, max: usize) -> Result<Bytes, String> {
        let mut prefix = [0u8; 4];
        stream.read_exact(&mut prefix).map_err(|e| e.to_string())?;
        let len = wire::frame_len(prefix, max).map_err(|e| e.to_string())?;
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).map_err(|e| e.to_string())?;
        Ok(Bytes::from(body))
    }

    /// [`Self::read_body`] that must be over by `deadline` as a whole: with a timeout
    /// per read alone, a peer sending a byte a little faster than it could keep a
    /// connection slot through its whole HELLO for as long as it liked.
    fn read_body_by(
        stream: &mut TcpStream,
        max: usize,
        deadline: Instant,
    ) -> Result<Bytes, String> {
        let mut fill = |buf: &mut [u8]| -> Result<(), String> {
            let mut at = 0;
            while at < buf.len() {
                let left = deadline
                    .checked_duration_since(Instant::now())
                    .filter(|d| !d.is_zero())
                    .ok_or("no HELLO within the handshake timeout")?;
                stream
                    .set_read_timeout(Some(left))
                    .map_err(|e| e.to_string())?;
                match stream.read(&mut buf[at..]) {
                    Ok(0) => return Err("closed during the handshake".into()),
                    Ok(n) => at += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(())
        };
        let mut prefix = [0u8; 4];
        fill(&mut prefix)?;
        let len = wire::frame_len(prefix, max).map_err(|e| e.to_string())?;
        let mut body = vec![0u8; len];
        fill(&mut body)?;
        Ok(Bytes::from(body))
    }

    fn connection(&self, mut stream: TcpStream) -> Result<(), String> {
        let _ = stream.set_nodelay(true);
        let deadline = Instant::now() + self.config.handshake_timeout;
        let hello = Self::read_body_by(&mut stream, wire::HELLO_BYTES_MAX, deadline)
            .and_then(|b| wire::decode_hello(b).map_err(|e| e.to_string()))?;
        let refuse = |stream: &mut TcpStream, why: &str| {
            let _ = Self::send(
                stream,
                &Answer::Error {
                    kind: ErrorKind::Refused,
                    arg: 0,
                    message: why.to_string(),
                },
            );
            Err(why.to_string())
        };
        if hello.version != wire::VERSION {
            return refuse(
                &mut stream,
                &format!("this metadata server speaks version {}", wire::VERSION),
            );
        }
        if let Some(token) = &self.config.token {
            if !tokens_match(token, &hello.token) {
                self.counters.refused_auth.fetch_add(1, Ordering::Relaxed);
                return refuse(&mut stream, "wrong or missing cluster token");
            }
        }
        Self::send(&mut stream, &Answer::HelloOk)?;
        stream
            .set_read_timeout(Some(IDLE_TIMEOUT))
            .map_err(|e| e.to_string())?;
        loop {
            let body = Self::read_body(&mut stream, wire::REQUEST_BYTES_MAX)?;
            let req = match wire::decode_request(body) {
                Ok(r) => r,
                Err(e) => {
                    let _ = Self::send(
                        &mut stream,
                        &Answer::Error {
                            kind: ErrorKind::Other,
                            arg: 0,
                            message: format!("bad request: {e}"),
                        },
                    );
                    return Err(e.to_string());
                }
            };
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            let answer = self.answer(req).unwrap_or_else(|e| error_answer(&e));
            Self::send(&mut stream, &answer)?;
        }
    }

    fn answer(&self, req: Request) -> Result<Answer, CloverError> {
        let mem = self.meta.memory();
        Ok(match req {
            Request::Info => Answer::Info(Info {
                geometry: mem.geometry(),
                blocks_max: self.meta.config().blocks_max,
                servers: self.config.servers.clone(),
            }),
            Request::Key(k) => {
                let (id, head) = self.meta.key(&k)?;
                Answer::Key { id, head }
            }
            Request::Head(id) => Answer::Head(self.meta.head(id)?),
            Request::Grant(n) => Answer::Nodes(
                self.meta
                    .grant((n as usize).clamp(1, wire::NODES_PER_FRAME_MAX))?,
            ),
            Request::GiveBack(nodes) => {
                // Only nodes of blocks that exist: anything else would be handed out
                // later as an address no store can reach.
                let g = mem.geometry();
                let blocks = mem.blocks();
                let valid = |n: &NodeAddr| n.block < blocks && n.slot < g.nodes_per_block;
                if let Some(bad) = nodes.iter().find(|n| !valid(n)) {
                    return Err(CloverError::BadAddress(*bad));
                }
                self.meta.give_back(nodes);
                Answer::Done
            }
            Request::Blocks(from) => Answer::Blocks {
                from,
                blocks: mem.block_refs(from, wire::BLOCKS_PER_FRAME_MAX),
            },
            Request::Stats => Answer::Stats(self.stats()),
        })
    }

    pub fn stats(&self) -> Vec<(String, u64)> {
        let m = self.meta.stats();
        let c = &self.counters;
        vec![
            ("meta_blocks".into(), u64::from(m.blocks)),
            ("meta_keys".into(), m.keys as u64),
            ("meta_free_nodes".into(), m.free_nodes as u64),
            ("meta_limbo_nodes".into(), m.limbo_nodes as u64),
            ("meta_gc_passes".into(), m.gc_passes),
            ("meta_nodes_retired".into(), m.nodes_retired),
            ("meta_nodes_reclaimed".into(), m.nodes_reclaimed),
            ("meta_grants_waited".into(), m.grants_waited),
            ("meta_give_backs_refused".into(), m.give_backs_refused),
            ("meta_epoch".into(), m.epoch),
            (
                "meta_connections_current".into(),
                self.connections.load(Ordering::Relaxed) as u64,
            ),
            (
                "meta_connections_total".into(),
                c.connections_total.load(Ordering::Relaxed),
            ),
            (
                "meta_connections_refused_full".into(),
                c.connections_refused_full.load(Ordering::Relaxed),
            ),
            (
                "meta_refused_auth".into(),
                c.refused_auth.load(Ordering::Relaxed),
            ),
            ("meta_requests".into(), c.requests.load(Ordering::Relaxed)),
            ("meta_gc_errors".into(), c.gc_errors.load(Ordering::Relaxed)),
        ]
    }
}
