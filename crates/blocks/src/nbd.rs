//! A volume exported over NBD, so stock tools (`nbdinfo`, `nbdcopy`, qemu, the kernel's
//! `nbd-client`) can use it. `nbd_proto` decides every answer; this module moves bytes.
//!
//! One thread a connection, requests answered in order. The listener takes loopback
//! addresses only unless told otherwise (NBD has no authentication here), at most
//! `NbdConfig::connections_max` connections at once (one more is closed at once), and a
//! client gets `NbdConfig::handshake_timeout` to finish its handshake so an idle socket
//! cannot hold a slot before it has asked for anything.
//!
//! `serve_connection` is generic over the byte streams, so the fuzz target drives the very
//! code a socket does, against an in-memory device.

use crate::nbd_proto::{self as p, Action, ExportInfo, Next};
use crate::volume::Volume;
use crate::BlocksError;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Default ceiling on connections served at once.
pub const CONNECTIONS_MAX_DEFAULT: usize = 16;
/// Hard ceiling, whatever the caller asks: a connection is a thread.
pub const CONNECTIONS_MAX_LIMIT: usize = 1024;
/// Default time a client has to finish the handshake.
pub const HANDSHAKE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// Default longest a reply may wait for the client to take it: a client that asks and
/// never reads would otherwise hold its thread and its slot for ever.
pub const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// WRITE_ZEROES is carried out in pieces this big, from one zeroed buffer.
const ZERO_PIECE_BYTES: usize = 1 << 20;
/// Buffered reader size: a request header and small payloads in one syscall.
const READ_BUFFER_BYTES: usize = 256 << 10;

#[derive(Debug, Clone, thiserror::Error)]
pub enum NbdError {
    #[error("refusing to listen on {0}: NBD has no authentication; pass the non-loopback flag to allow it")]
    NotLoopback(SocketAddr),
    #[error("connections_max must be 1..={CONNECTIONS_MAX_LIMIT}, not {0}")]
    ConnectionsMax(usize),
    #[error("{0}")]
    Io(String),
    #[error(transparent)]
    Protocol(#[from] p::NbdDecodeError),
    #[error("the client sent more than {} options", p::OPTIONS_PER_HANDSHAKE_MAX)]
    TooManyOptions,
}

impl From<io::Error> for NbdError {
    fn from(e: io::Error) -> Self {
        NbdError::Io(e.to_string())
    }
}

/// What an export is served from. A `Volume` is one; the fuzz target uses memory.
pub trait BlockDevice: Send + Sync {
    fn size_bytes(&self) -> u64;
    /// Preferred I/O size, a power of two.
    fn preferred_block_bytes(&self) -> u32;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BlocksError>;
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BlocksError>;
}

impl BlockDevice for Volume {
    fn size_bytes(&self) -> u64 {
        self.capacity_bytes()
    }
    fn preferred_block_bytes(&self) -> u32 {
        self.layout().chunk_bytes.min(p::REQUEST_BYTES_MAX as u64) as u32
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BlocksError> {
        self.read(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BlocksError> {
        self.write(offset, data)
    }
}

/// How one connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionEnd {
    /// ABORT, an unknown EXPORT_NAME, or the client hung up during the handshake.
    Handshake,
    /// DISC, or the client hung up between requests.
    Disconnected,
}

/// Counters a server keeps (tests wait on them; `serve-nbd` could print them).
#[derive(Debug, Default)]
pub struct NbdStats {
    pub connections_active: AtomicUsize,
    pub connections_refused: AtomicU64,
    pub requests: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
}

/// The handshake: greeting, client flags, options until one starts transmission.
/// `Ok(false)` when the client left or was turned away without transmission.
pub fn handshake<R: Read, W: Write>(
    reader: &mut R,
    writer: &mut W,
    export: &ExportInfo,
) -> Result<bool, NbdError> {
    writer.write_all(&p::greeting())?;
    writer.flush()?;
    let mut flags = [0u8; 4];
    if !read_or_eof(reader, &mut flags)? {
        return Ok(false);
    }
    let flags = p::decode_client_flags(flags)?;
    let mut data = Vec::new();
    for _ in 0..p::OPTIONS_PER_HANDSHAKE_MAX {
        let mut header = [0u8; p::OPTION_HEADER_BYTES];
        if !read_or_eof(reader, &mut header)? {
            return Ok(false);
        }
        let header = p::decode_option_header(&header)?;
        // The length is checked against OPTION_DATA_BYTES_MAX by the decoder.
        data.resize(header.length as usize, 0);
        reader.read_exact(&mut data)?;
        let opt = p::decode_option(header.option, &data)?;
        let (answer, next) = p::answer_option(&opt, export, flags);
        writer.write_all(&answer)?;
        writer.flush()?;
        match next {
            Next::Option => {}
            Next::Transmit => return Ok(true),
            Next::Close => return Ok(false),
        }
    }
    Err(NbdError::TooManyOptions)
}

/// Reads exactly `buf.len()` bytes; `false` if the stream ended cleanly before the first.
fn read_or_eof<R: Read>(reader: &mut R, buf: &mut [u8]) -> Result<bool, NbdError> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// The transmission phase: requests answered in order until DISC or the client leaves.
/// A WRITE's payload is read whole before the device sees any of it, so a client that
/// dies mid-payload changes nothing.
pub fn transmit<R: Read, W: Write>(
    reader: &mut R,
    writer: &mut W,
    device: &dyn BlockDevice,
    export: &ExportInfo,
    stats: &NbdStats,
) -> Result<ConnectionEnd, NbdError> {
    let mut payload: Vec<u8> = Vec::new();
    let mut zeroes: Vec<u8> = Vec::new();
    loop {
        let mut header = [0u8; p::REQUEST_HEADER_BYTES];
        if !read_or_eof(reader, &mut header)? {
            return Ok(ConnectionEnd::Disconnected);
        }
        let h = p::decode_request_header(&header)?;
        stats.requests.fetch_add(1, Ordering::Relaxed);
        if h.command == p::CMD_WRITE {
            // At most REQUEST_BYTES_MAX (the decoder checked), and grown only as bytes
            // arrive: a header that promises 32 MiB and sends nothing costs nothing.
            payload.clear();
            let want = h.length as usize;
            reader
                .by_ref()
                .take(want as u64)
                .read_to_end(&mut payload)?;
            if payload.len() < want {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
            }
        }
        let error = match p::plan_request(&h, export) {
            Action::Disconnect => return Ok(ConnectionEnd::Disconnected),
            Action::Done => 0,
            Action::Fail(errno) => errno,
            Action::Read { offset, length } => {
                // Header and data leave in one write.
                payload.clear();
                payload.extend_from_slice(&p::simple_reply_header(0, h.handle));
                payload.resize(p::SIMPLE_REPLY_HEADER_BYTES + length as usize, 0);
                match device.read_at(offset, &mut payload[p::SIMPLE_REPLY_HEADER_BYTES..]) {
                    Ok(()) => {
                        stats.bytes_read.fetch_add(length as u64, Ordering::Relaxed);
                        writer.write_all(&payload)?;
                        writer.flush()?;
                        continue;
                    }
                    Err(e) => errno_of(&e),
                }
            }
            Action::Write { offset, .. } => match device.write_at(offset, &payload) {
                Ok(()) => {
                    stats
                        .bytes_written
                        .fetch_add(payload.len() as u64, Ordering::Relaxed);
                    0
                }
                Err(e) => errno_of(&e),
            },
            Action::WriteZeroes { offset, length } => {
                if zeroes.is_empty() {
                    zeroes.resize(ZERO_PIECE_BYTES, 0);
                }
                write_zeroes(device, offset, length as u64, &zeroes)
            }
        };
        writer.write_all(&p::simple_reply_header(error, h.handle))?;
        writer.flush()?;
    }
}

fn write_zeroes(device: &dyn BlockDevice, offset: u64, length: u64, zeroes: &[u8]) -> u32 {
    let mut done = 0;
    while done < length {
        let n = (length - done).min(zeroes.len() as u64);
        if let Err(e) = device.write_at(offset + done, &zeroes[..n as usize]) {
            return errno_of(&e);
        }
        done += n;
    }
    0
}

fn errno_of(e: &BlocksError) -> u32 {
    match e {
        BlocksError::OutOfBounds { .. } | BlocksError::InvalidArgument(_) => p::EINVAL,
        _ => p::EIO,
    }
}

/// Handshake then transmission over one pair of streams.
pub fn serve_connection<R: Read, W: Write>(
    reader: &mut R,
    writer: &mut W,
    device: &dyn BlockDevice,
    export: &ExportInfo,
    stats: &NbdStats,
) -> Result<ConnectionEnd, NbdError> {
    if handshake(reader, writer, export)? {
        transmit(reader, writer, device, export, stats)
    } else {
        Ok(ConnectionEnd::Handshake)
    }
}

/// How the listener behaves.
#[derive(Debug, Clone)]
pub struct NbdConfig {
    pub listen: SocketAddr,
    /// Listen on an address outside 127.0.0.0/8 (and ::1). Off by default: anyone who can
    /// reach the port can read and write the volume.
    pub allow_non_loopback: bool,
    pub connections_max: usize,
    pub read_only: bool,
    pub handshake_timeout: Duration,
    /// A client that takes none of a reply for this long is hung up on.
    pub reply_timeout: Duration,
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 10809)),
            allow_non_loopback: false,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            read_only: false,
            handshake_timeout: HANDSHAKE_TIMEOUT_DEFAULT,
            reply_timeout: REPLY_WRITE_TIMEOUT,
        }
    }
}

struct Shared {
    device: Arc<dyn BlockDevice>,
    export: ExportInfo,
    config: NbdConfig,
    stats: NbdStats,
    stopping: AtomicBool,
    /// Open connections, so `stop` can hang them up; at most `connections_max`.
    open: Mutex<HashMap<u64, TcpStream>>,
}

/// A running export: a listener thread and one thread a connection.
pub struct NbdServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl NbdServer {
    /// Binds and starts serving `device` as export `name` (the empty name works too).
    pub fn start(
        device: Arc<dyn BlockDevice>,
        name: &str,
        config: NbdConfig,
    ) -> Result<NbdServer, NbdError> {
        if !config.allow_non_loopback && !config.listen.ip().is_loopback() {
            return Err(NbdError::NotLoopback(config.listen));
        }
        if config.connections_max == 0 || config.connections_max > CONNECTIONS_MAX_LIMIT {
            return Err(NbdError::ConnectionsMax(config.connections_max));
        }
        let listener = TcpListener::bind(config.listen)?;
        let addr = listener.local_addr()?;
        let export = ExportInfo {
            name: name.to_string(),
            size_bytes: device.size_bytes(),
            read_only: config.read_only,
            preferred_block_bytes: device.preferred_block_bytes(),
        };
        let shared = Arc::new(Shared {
            device,
            export,
            config,
            stats: NbdStats::default(),
            stopping: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(NbdServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> &NbdStats {
        &self.shared.stats
    }

    /// Serves until the listener fails (the CLI's foreground mode).
    pub fn wait(mut self) {
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }

    /// Stops accepting and hangs up every connection.
    pub fn stop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wakes the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for s in self.shared.open.lock().values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: the next accept may do better.
                tracing::warn!("nbd accept: {e}");
                continue;
            }
        };
        let active = shared
            .stats
            .connections_active
            .fetch_add(1, Ordering::SeqCst);
        if active >= shared.config.connections_max {
            shared
                .stats
                .connections_active
                .fetch_sub(1, Ordering::SeqCst);
            shared
                .stats
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        }
        next_id += 1;
        let id = next_id;
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                if let Err(e) = connection(&s, id, stream) {
                    tracing::debug!("nbd connection {id}: {e}");
                }
                s.open.lock().remove(&id);
                s.stats.connections_active.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            tracing::warn!("nbd: no thread for a connection: {e}");
            shared
                .stats
                .connections_active
                .fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn connection(shared: &Shared, id: u64, stream: TcpStream) -> Result<ConnectionEnd, NbdError> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(shared.config.reply_timeout))?;
    shared.open.lock().insert(id, stream.try_clone()?);
    if shared.stopping.load(Ordering::SeqCst) {
        return Ok(ConnectionEnd::Handshake);
    }
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, stream.try_clone()?);
    let mut writer = BufWriter::new(stream.try_clone()?);
    stream.set_read_timeout(Some(shared.config.handshake_timeout))?;
    if !handshake(&mut reader, &mut writer, &shared.export)? {
        return Ok(ConnectionEnd::Handshake);
    }
    // A connected client may sit idle as long as it likes; it holds one slot.
    stream.set_read_timeout(None)?;
    transmit(
        &mut reader,
        &mut writer,
        shared.device.as_ref(),
        &shared.export,
        &shared.stats,
    )
}

#[cfg(test)]
mod tests {
    //! The session over in-memory streams: the logic between the decoder and the socket.
    use super::*;
    use crate::nbd_proto::RequestHeader;

    struct Memory(Mutex<Vec<u8>>);

    impl BlockDevice for Memory {
        fn size_bytes(&self) -> u64 {
            self.0.lock().len() as u64
        }
        fn preferred_block_bytes(&self) -> u32 {
            4096
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BlocksError> {
            let m = self.0.lock();
            buf.copy_from_slice(&m[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BlocksError> {
            self.0.lock()[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    fn export(size: u64) -> ExportInfo {
        ExportInfo {
            name: "v".into(),
            size_bytes: size,
            read_only: false,
            preferred_block_bytes: 4096,
        }
    }

    fn client_prefix() -> Vec<u8> {
        let mut c = 3u32.to_be_bytes().to_vec();
        c.extend_from_slice(&p::IHAVEOPT.to_be_bytes());
        c.extend_from_slice(&p::OPT_EXPORT_NAME.to_be_bytes());
        c.extend_from_slice(&1u32.to_be_bytes());
        c.push(b'v');
        c
    }

    fn request(command: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
        p::encode_request_header(&RequestHeader {
            flags: 0,
            command,
            handle,
            offset,
            length,
        })
        .to_vec()
    }

    #[test]
    fn a_write_then_a_read_round_trip_and_a_torn_payload_changes_nothing() {
        let dev = Memory(Mutex::new(vec![0u8; 8192]));
        let mut input = client_prefix();
        input.extend(request(p::CMD_WRITE, 1, 100, 5));
        input.extend_from_slice(b"hello");
        input.extend(request(p::CMD_READ, 2, 98, 9));
        input.extend(request(p::CMD_WRITE, 3, 0, 10));
        input.extend_from_slice(b"torn"); // the client died mid-payload
        let mut out = Vec::new();
        let stats = NbdStats::default();
        let end = serve_connection(&mut &input[..], &mut out, &dev, &export(8192), &stats);
        assert!(matches!(end, Err(NbdError::Io(_))), "{end:?}");
        let after_handshake = p::GREETING_BYTES + 10;
        let replies = &out[after_handshake..];
        assert_eq!(&replies[..16], &p::simple_reply_header(0, 1));
        assert_eq!(&replies[16..32], &p::simple_reply_header(0, 2));
        assert_eq!(&replies[32..41], b"\0\0hello\0\0");
        assert_eq!(replies.len(), 41, "no reply to the torn write");
        assert_eq!(
            &dev.0.lock()[..10],
            &[0u8; 10],
            "torn write reached the device"
        );
    }

    #[test]
    fn out_of_bounds_and_unknown_commands_get_errors_and_the_session_goes_on() {
        let dev = Memory(Mutex::new(vec![7u8; 4096]));
        let mut input = client_prefix();
        input.extend(request(p::CMD_READ, 1, 4095, 2));
        input.extend(request(p::CMD_WRITE, 2, 4095, 2));
        input.extend_from_slice(b"xy"); // consumed although refused
        input.extend(request(42, 3, 0, 0));
        input.extend(request(p::CMD_WRITE_ZEROES, 4, 10, 20));
        input.extend(request(p::CMD_FLUSH, 5, 0, 0));
        input.extend(request(p::CMD_DISC, 6, 0, 0));
        input.extend(request(p::CMD_READ, 7, 0, 1)); // after DISC: never read
        let mut out = Vec::new();
        let end = serve_connection(
            &mut &input[..],
            &mut out,
            &dev,
            &export(4096),
            &NbdStats::default(),
        );
        assert_eq!(end.unwrap(), ConnectionEnd::Disconnected);
        let replies = &out[p::GREETING_BYTES + 10..];
        let expect: Vec<u8> = [
            (p::EINVAL, 1),
            (p::ENOSPC, 2),
            (p::EINVAL, 3),
            (0, 4),
            (0, 5),
        ]
        .iter()
        .flat_map(|&(e, h)| p::simple_reply_header(e, h))
        .collect();
        assert_eq!(replies, &expect[..]);
        let m = dev.0.lock();
        assert_eq!(&m[10..30], &[0u8; 20]);
        assert_eq!((m[9], m[30], m[4095]), (7, 7, 7));
    }

    #[test]
    fn a_non_loopback_listen_address_is_refused_unless_allowed() {
        let dev: Arc<dyn BlockDevice> = Arc::new(Memory(Mutex::new(vec![0; 4096])));
        let r = NbdServer::start(
            dev,
            "v",
            NbdConfig {
                listen: "0.0.0.0:0".parse().unwrap(),
                ..NbdConfig::default()
            },
        );
        assert!(matches!(r, Err(NbdError::NotLoopback(_))));
    }
}
