//! A store's side of the metadata server: [`RemoteMeta`] speaks `wire` over one TCP
//! connection (one request at a time; stores ask it rarely: a key's first use, a grant,
//! a walk that met a reclaimed node), and [`open`] puts a store's memory together from
//! what the service says.
//!
//! A failed connection fails the call in hand and is replaced at the next one, so a
//! metadata server that dies costs only the operations that needed it: reads and writes
//! of keys a store already knows, with nodes it already holds, go on (the data path is
//! one-sided and needs no metadata server).

use crate::chain::Hint;
use crate::layout::NodeAddr;
use crate::memory::{BlockSource, RegionMemory};
use crate::meta::MetaApi;
use crate::wire::{self, Answer, BlockRef, ErrorKind, Info, Request};
use crate::CloverError;
use bytes::Bytes;
use camelot_client::{Client, ClientConfig, ClusterMap};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct RemoteConfig {
    pub addr: SocketAddr,
    pub token: Option<Vec<u8>>,
    pub connect_timeout: Duration,
    /// A call unanswered this long fails (and its connection is dropped).
    pub call_timeout: Duration,
}

impl RemoteConfig {
    pub fn new(addr: SocketAddr, token: Option<Vec<u8>>) -> RemoteConfig {
        RemoteConfig {
            addr,
            token,
            connect_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(30),
        }
    }
}

pub struct RemoteMeta {
    config: RemoteConfig,
    conn: Mutex<Option<TcpStream>>,
    info: Info,
}

fn lost(addr: SocketAddr, e: impl std::fmt::Display) -> CloverError {
    CloverError::Meta(format!("metadata server {addr}: {e}"))
}

fn read_frame(s: &mut TcpStream, max: usize) -> Result<Bytes, CloverError> {
    let addr = s
        .peer_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let err = |e: &dyn std::fmt::Display| CloverError::Meta(format!("metadata server {addr}: {e}"));
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).map_err(|e| err(&e))?;
    let len = wire::frame_len(prefix, max).map_err(|e| err(&e))?;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(|e| err(&e))?;
    Ok(Bytes::from(body))
}

fn answer_error(kind: ErrorKind, arg: u64, message: String) -> CloverError {
    match kind {
        ErrorKind::OutOfMemory => CloverError::OutOfMemory {
            blocks_max: u32::try_from(arg).unwrap_or(u32::MAX),
        },
        ErrorKind::TooManyKeys => {
            CloverError::TooManyKeys(usize::try_from(arg).unwrap_or(usize::MAX))
        }
        ErrorKind::UnknownKey => CloverError::UnknownKey(arg),
        ErrorKind::Refused => CloverError::Refused(message),
        ErrorKind::Other => CloverError::Meta(message),
    }
}

impl RemoteMeta {
    /// Connects, authenticates and reads the store's shape.
    pub fn connect(config: RemoteConfig) -> Result<RemoteMeta, CloverError> {
        let stream = Self::dial(&config)?;
        let mut meta = RemoteMeta {
            config,
            conn: Mutex::new(Some(stream)),
            info: Info {
                geometry: crate::layout::Geometry::new(0, 1)?,
                blocks_max: 0,
                servers: Vec::new(),
            },
        };
        match meta.call(&Request::Info)? {
            Answer::Info(i) => meta.info = i,
            other => return Err(meta.unexpected(&other)),
        }
        Ok(meta)
    }

    fn dial(config: &RemoteConfig) -> Result<TcpStream, CloverError> {
        let addr = config.addr;
        let mut s =
            TcpStream::connect_timeout(&addr, config.connect_timeout).map_err(|e| lost(addr, e))?;
        let _ = s.set_nodelay(true);
        s.set_read_timeout(Some(config.call_timeout))
            .and_then(|_| s.set_write_timeout(Some(config.call_timeout)))
            .map_err(|e| lost(addr, e))?;
        let hello = wire::encode_hello(config.token.as_deref().unwrap_or_default())
            .map_err(|e| CloverError::InvalidArgument(e.to_string()))?;
        s.write_all(&hello).map_err(|e| lost(addr, e))?;
        let body = read_frame(&mut s, wire::ANSWER_BYTES_MAX)?;
        match wire::decode_answer(body).map_err(|e| lost(addr, e))? {
            Answer::HelloOk => Ok(s),
            Answer::Error { kind, arg, message } => Err(answer_error(kind, arg, message)),
            other => Err(lost(addr, format!("answered HELLO with {other:?}"))),
        }
    }

    /// The store's shape and data servers, as the service said at connect.
    pub fn info(&self) -> &Info {
        &self.info
    }

    fn unexpected(&self, a: &Answer) -> CloverError {
        lost(self.config.addr, format!("unexpected answer {a:?}"))
    }

    /// One request and its answer; an error answer becomes the matching `CloverError`.
    /// A connection that had been kept (the server closes idle ones after
    /// `server::IDLE_TIMEOUT`) and fails is replaced and the request sent once more —
    /// unless it gives nodes back, which done twice would hand a node out twice.
    fn call(&self, req: &Request) -> Result<Answer, CloverError> {
        let frame =
            wire::encode_request(req).map_err(|e| CloverError::InvalidArgument(e.to_string()))?;
        let mut conn = self.conn.lock();
        let kept = conn.is_some();
        let answer = match self.exchange(&mut conn, &frame) {
            Err(_) if kept && !matches!(req, Request::GiveBack(_)) => {
                self.exchange(&mut conn, &frame)
            }
            other => other,
        };
        match answer? {
            Answer::Error { kind, arg, message } => Err(answer_error(kind, arg, message)),
            a => Ok(a),
        }
    }

    /// Sends `frame` on the connection (dialled first if there is none) and reads the
    /// answer; on failure the connection is dropped (the stream may be mid-frame).
    fn exchange(&self, conn: &mut Option<TcpStream>, frame: &[u8]) -> Result<Answer, CloverError> {
        if conn.is_none() {
            *conn = Some(Self::dial(&self.config)?);
        }
        let Some(s) = conn.as_mut() else {
            return Err(lost(self.config.addr, "no connection"));
        };
        let answer = s
            .write_all(frame)
            .map_err(|e| lost(self.config.addr, e))
            .and_then(|_| read_frame(s, wire::ANSWER_BYTES_MAX))
            .and_then(|b| wire::decode_answer(b).map_err(|e| lost(self.config.addr, e)));
        if answer.is_err() {
            *conn = None;
        }
        answer
    }

    /// The service's counters.
    pub fn stats(&self) -> Result<Vec<(String, u64)>, CloverError> {
        match self.call(&Request::Stats)? {
            Answer::Stats(s) => Ok(s),
            other => Err(self.unexpected(&other)),
        }
    }
}

impl BlockSource for RemoteMeta {
    fn blocks_from(&self, from: u32) -> Result<Vec<BlockRef>, CloverError> {
        match self.call(&Request::Blocks(from))? {
            Answer::Blocks { from: f, blocks } if f == from => Ok(blocks),
            other => Err(self.unexpected(&other)),
        }
    }
}

impl MetaApi for RemoteMeta {
    fn key(&self, key: &[u8]) -> Result<(u64, Hint), CloverError> {
        if key.len() > wire::KEY_BYTES_MAX {
            return Err(CloverError::InvalidArgument(format!(
                "keys are at most {} bytes",
                wire::KEY_BYTES_MAX
            )));
        }
        match self.call(&Request::Key(key.to_vec()))? {
            Answer::Key { id, head } => Ok((id, head)),
            other => Err(self.unexpected(&other)),
        }
    }

    fn head(&self, key_id: u64) -> Result<Hint, CloverError> {
        match self.call(&Request::Head(key_id))? {
            Answer::Head(h) => Ok(h),
            other => Err(self.unexpected(&other)),
        }
    }

    fn grant(&self, n: usize) -> Result<Vec<NodeAddr>, CloverError> {
        let n = n.clamp(1, wire::NODES_PER_FRAME_MAX) as u32;
        match self.call(&Request::Grant(n))? {
            Answer::Nodes(nodes) if !nodes.is_empty() => Ok(nodes),
            other => Err(self.unexpected(&other)),
        }
    }

    fn give_back(&self, nodes: Vec<NodeAddr>) {
        // Best effort: nodes not given back are lost to the store, never reused twice.
        for chunk in nodes.chunks(wire::NODES_PER_FRAME_MAX) {
            if self.call(&Request::GiveBack(chunk.to_vec())).is_err() {
                return;
            }
        }
    }

    fn blocks_max(&self) -> u32 {
        self.info.blocks_max
    }

    /// Nothing here announces epochs to the service (that would cost a round trip per
    /// operation): it waits `reuse_grace` instead (see `meta`).
    fn register(&self) -> Arc<AtomicU64> {
        Arc::new(AtomicU64::new(u64::MAX))
    }

    fn announce(&self, _slot: &AtomicU64) {}
}

/// A store's pieces from a metadata server: the service, and memory over `client_config`
/// connections to its data servers (or, with `via`, to proxies in front of them, in the
/// same order). Each store thread then takes `memory.with_client(...)` or a clone.
pub fn open(
    meta: RemoteConfig,
    via: Option<&[SocketAddr]>,
    client_config: ClientConfig,
) -> Result<(Arc<RemoteMeta>, RegionMemory), CloverError> {
    let remote = Arc::new(RemoteMeta::connect(meta)?);
    let addrs: Vec<SocketAddr> = match via {
        Some(v) => {
            if v.len() != remote.info.servers.len() {
                return Err(CloverError::InvalidArgument(format!(
                    "{} proxies for {} data servers: one in front of each, in order",
                    v.len(),
                    remote.info.servers.len()
                )));
            }
            v.to_vec()
        }
        None => remote
            .info
            .servers
            .iter()
            .map(|s| {
                s.parse().map_err(|_| {
                    CloverError::InvalidArgument(format!(
                        "the metadata server names data server {s:?}, not an address"
                    ))
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let client = Client::connect(ClusterMap::from_addrs(&addrs), client_config)?;
    let source: Arc<dyn BlockSource> = remote.clone();
    let memory = RegionMemory::remote(client, remote.info.geometry, source);
    Ok((remote, memory))
}
