//! The metadata server's protocol: length-prefixed frames, one request and one answer at
//! a time per connection. Pure: encoding and decoding only, every size bounded, hostile
//! bytes an error and never a panic.
//!
//! A frame is `u32 LE body length | body`; a body is a one-byte kind and its fields
//! (integers little endian, byte strings as `u16 LE length | bytes`, lists as `u32 LE
//! count | items`). The first frame a client sends is a HELLO (magic, version, token),
//! read in at most [`HELLO_BYTES_MAX`] bytes; nothing else is read or made for a
//! connection before it passes.

use crate::chain::Hint;
use crate::layout::{Geometry, NodeAddr};
use bytes::{Buf, BufMut, Bytes, BytesMut};

pub const MAGIC: [u8; 4] = *b"CLMT";
pub const VERSION: u16 = 1;
/// A HELLO's body: kind, magic, version, token.
pub const HELLO_BYTES_MAX: usize = 1 + 4 + 2 + 2 + TOKEN_BYTES_MAX;
pub const TOKEN_BYTES_MAX: usize = 256;
/// Longest key the service accepts.
pub const KEY_BYTES_MAX: usize = 1024;
/// Most nodes a GRANT or GIVE_BACK carries.
pub const NODES_PER_FRAME_MAX: usize = 1024;
/// Most blocks a BLOCKS answer lists (a client asks again from where it ended).
pub const BLOCKS_PER_FRAME_MAX: usize = 1024;
/// Most data servers the service names.
pub const SERVERS_MAX: usize = 64;
pub const ADDR_BYTES_MAX: usize = 256;
pub const MESSAGE_BYTES_MAX: usize = 1024;
pub const STATS_MAX: usize = 64;
/// Largest request body (a GIVE_BACK of the most nodes).
pub const REQUEST_BYTES_MAX: usize = 16 << 10;
/// Largest answer body (the INFO naming the most servers).
pub const ANSWER_BYTES_MAX: usize = 64 << 10;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame of {len} bytes is over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("frame ends early")]
    Short,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("{what}: {len} is over the limit of {max}")]
    Limit {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{0} trailing bytes after the frame's fields")]
    Trailing(usize),
    #[error("not UTF-8: {0}")]
    Utf8(&'static str),
    #[error("not a metadata-service HELLO")]
    BadMagic,
}

/// Where a block is: the index of its server in the service's list, and its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    pub server: u32,
    pub region: u64,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub token: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The store's shape and its data servers.
    Info,
    Key(Vec<u8>),
    Head(u64),
    Grant(u32),
    GiveBack(Vec<NodeAddr>),
    /// Blocks from this index on.
    Blocks(u32),
    Stats,
}

/// Error kinds an answer may carry; the client turns them back into `CloverError`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    OutOfMemory = 1,
    TooManyKeys = 2,
    UnknownKey = 3,
    Refused = 4,
    Other = 5,
}

impl ErrorKind {
    fn from_u8(b: u8) -> Option<ErrorKind> {
        Some(match b {
            1 => ErrorKind::OutOfMemory,
            2 => ErrorKind::TooManyKeys,
            3 => ErrorKind::UnknownKey,
            4 => ErrorKind::Refused,
            5 => ErrorKind::Other,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    pub geometry: Geometry,
    pub blocks_max: u32,
    pub servers: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    HelloOk,
    Info(Info),
    Key {
        id: u64,
        head: Hint,
    },
    Head(Hint),
    Nodes(Vec<NodeAddr>),
    Done,
    Blocks {
        from: u32,
        blocks: Vec<BlockRef>,
    },
    Stats(Vec<(String, u64)>),
    Error {
        kind: ErrorKind,
        arg: u64,
        message: String,
    },
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const INFO: u8 = 2;
    pub const KEY: u8 = 3;
    pub const HEAD: u8 = 4;
    pub const GRANT: u8 = 5;
    pub const GIVE_BACK: u8 = 6;
    pub const BLOCKS: u8 = 7;
    pub const STATS: u8 = 8;
    pub const HELLO_OK: u8 = 64;
    pub const INFO_IS: u8 = 65;
    pub const KEY_IS: u8 = 66;
    pub const HEAD_IS: u8 = 67;
    pub const NODES: u8 = 68;
    pub const DONE: u8 = 69;
    pub const BLOCK_LIST: u8 = 70;
    pub const STATS_ARE: u8 = 71;
    pub const ERROR: u8 = 72;
}

/// A frame (length prefix and body) around `body`.
fn framed(body: BytesMut) -> Bytes {
    let mut out = BytesMut::with_capacity(4 + body.len());
    out.put_u32_le(body.len() as u32);
    out.put_slice(&body);
    out.freeze()
}

fn put_bytes(b: &mut BytesMut, s: &[u8], what: &'static str, max: usize) -> Result<(), WireError> {
    if s.len() > max {
        return Err(WireError::Limit {
            what,
            len: s.len(),
            max,
        });
    }
    b.put_u16_le(s.len() as u16);
    b.put_slice(s);
    Ok(())
}

fn put_count(b: &mut BytesMut, n: usize, what: &'static str, max: usize) -> Result<(), WireError> {
    if n > max {
        return Err(WireError::Limit { what, len: n, max });
    }
    b.put_u32_le(n as u32);
    Ok(())
}

fn put_hint(b: &mut BytesMut, h: Hint) {
    b.put_u32_le(h.addr.block);
    b.put_u32_le(h.addr.slot);
    b.put_u64_le(h.seq);
}

fn put_node(b: &mut BytesMut, n: NodeAddr) {
    b.put_u32_le(n.block);
    b.put_u32_le(n.slot);
}

pub fn encode_hello(token: &[u8]) -> Result<Bytes, WireError> {
    let mut b = BytesMut::new();
    b.put_u8(kind::HELLO);
    b.put_slice(&MAGIC);
    b.put_u16_le(VERSION);
    put_bytes(&mut b, token, "token", TOKEN_BYTES_MAX)?;
    Ok(framed(b))
}

pub fn encode_request(r: &Request) -> Result<Bytes, WireError> {
    let mut b = BytesMut::new();
    match r {
        Request::Info => b.put_u8(kind::INFO),
        Request::Key(k) => {
            b.put_u8(kind::KEY);
            put_bytes(&mut b, k, "key", KEY_BYTES_MAX)?;
        }
        Request::Head(id) => {
            b.put_u8(kind::HEAD);
            b.put_u64_le(*id);
        }
        Request::Grant(n) => {
            b.put_u8(kind::GRANT);
            b.put_u32_le(*n);
        }
        Request::GiveBack(nodes) => {
            b.put_u8(kind::GIVE_BACK);
            put_count(&mut b, nodes.len(), "nodes", NODES_PER_FRAME_MAX)?;
            for n in nodes {
                put_node(&mut b, *n);
            }
        }
        Request::Blocks(from) => {
            b.put_u8(kind::BLOCKS);
            b.put_u32_le(*from);
        }
        Request::Stats => b.put_u8(kind::STATS),
    }
    Ok(framed(b))
}

pub fn encode_answer(a: &Answer) -> Result<Bytes, WireError> {
    let mut b = BytesMut::new();
    match a {
        Answer::HelloOk => {
            b.put_u8(kind::HELLO_OK);
            b.put_u16_le(VERSION);
        }
        Answer::Info(i) => {
            b.put_u8(kind::INFO_IS);
            b.put_u32_le(i.geometry.value_bytes_max);
            b.put_u32_le(i.geometry.nodes_per_block);
            b.put_u32_le(i.blocks_max);
            put_count(&mut b, i.servers.len(), "servers", SERVERS_MAX)?;
            for s in &i.servers {
                put_bytes(&mut b, s.as_bytes(), "server address", ADDR_BYTES_MAX)?;
            }
        }
        Answer::Key { id, head } => {
            b.put_u8(kind::KEY_IS);
            b.put_u64_le(*id);
            put_hint(&mut b, *head);
        }
        Answer::Head(h) => {
            b.put_u8(kind::HEAD_IS);
            put_hint(&mut b, *h);
        }
        Answer::Nodes(nodes) => {
            b.put_u8(kind::NODES);
            put_count(&mut b, nodes.len(), "nodes", NODES_PER_FRAME_MAX)?;
            for n in nodes {
                put_node(&mut b, *n);
            }
        }
        Answer::Done => b.put_u8(kind::DONE),
        Answer::Blocks { from, blocks } => {
            b.put_u8(kind::BLOCK_LIST);
            b.put_u32_le(*from);
            put_count(&mut b, blocks.len(), "blocks", BLOCKS_PER_FRAME_MAX)?;
            for r in blocks {
                b.put_u32_le(r.server);
                b.put_u64_le(r.region);
                b.put_u64_le(r.size);
            }
        }
        Answer::Stats(list) => {
            b.put_u8(kind::STATS_ARE);
            put_count(&mut b, list.len(), "stats", STATS_MAX)?;
            for (name, v) in list {
                put_bytes(&mut b, name.as_bytes(), "stat name", ADDR_BYTES_MAX)?;
                b.put_u64_le(*v);
            }
        }
        Answer::Error {
            kind: k,
            arg,
            message,
        } => {
            b.put_u8(kind::ERROR);
            b.put_u8(*k as u8);
            b.put_u64_le(*arg);
            // Long messages are cut (on a character boundary), not refused.
            let mut end = message.len().min(MESSAGE_BYTES_MAX);
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            put_bytes(
                &mut b,
                &message.as_bytes()[..end],
                "message",
                MESSAGE_BYTES_MAX,
            )?;
        }
    }
    Ok(framed(b))
}

/// Reads fields from a body, every read checked.
struct Reader {
    b: Bytes,
}

impl Reader {
    fn need(&self, n: usize) -> Result<(), WireError> {
        if self.b.remaining() < n {
            Err(WireError::Short)
        } else {
            Ok(())
        }
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        self.need(1)?;
        Ok(self.b.get_u8())
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        self.need(2)?;
        Ok(self.b.get_u16_le())
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        self.need(4)?;
        Ok(self.b.get_u32_le())
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        self.need(8)?;
        Ok(self.b.get_u64_le())
    }
    fn bytes(&mut self, what: &'static str, max: usize) -> Result<Bytes, WireError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(WireError::Limit { what, len: n, max });
        }
        self.need(n)?;
        Ok(self.b.split_to(n))
    }
    fn string(&mut self, what: &'static str, max: usize) -> Result<String, WireError> {
        String::from_utf8(self.bytes(what, max)?.to_vec()).map_err(|_| WireError::Utf8(what))
    }
    /// A list's count, refused before anything is reserved for it if over `max` or
    /// longer than the bytes left could hold (`item` bytes each at least).
    fn count(&mut self, what: &'static str, max: usize, item: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(WireError::Limit { what, len: n, max });
        }
        self.need(n.saturating_mul(item))?;
        Ok(n)
    }
    fn hint(&mut self) -> Result<Hint, WireError> {
        Ok(Hint {
            addr: self.node()?,
            seq: self.u64()?,
        })
    }
    fn node(&mut self) -> Result<NodeAddr, WireError> {
        Ok(NodeAddr {
            block: self.u32()?,
            slot: self.u32()?,
        })
    }
    fn end(self) -> Result<(), WireError> {
        match self.b.remaining() {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

/// A HELLO's body (without its length prefix).
pub fn decode_hello(body: Bytes) -> Result<Hello, WireError> {
    let mut r = Reader { b: body };
    if r.u8()? != kind::HELLO {
        return Err(WireError::BadMagic);
    }
    r.need(4)?;
    if r.b.split_to(4)[..] != MAGIC {
        return Err(WireError::BadMagic);
    }
    let version = r.u16()?;
    let token = r.bytes("token", TOKEN_BYTES_MAX)?.to_vec();
    r.end()?;
    Ok(Hello { version, token })
}

pub fn decode_request(body: Bytes) -> Result<Request, WireError> {
    let mut r = Reader { b: body };
    let req = match r.u8()? {
        kind::INFO => Request::Info,
        kind::KEY => Request::Key(r.bytes("key", KEY_BYTES_MAX)?.to_vec()),
        kind::HEAD => Request::Head(r.u64()?),
        kind::GRANT => Request::Grant(r.u32()?),
        kind::GIVE_BACK => {
            let n = r.count("nodes", NODES_PER_FRAME_MAX, 8)?;
            Request::GiveBack((0..n).map(|_| r.node()).collect::<Result<_, _>>()?)
        }
        kind::BLOCKS => Request::Blocks(r.u32()?),
        kind::STATS => Request::Stats,
        k => return Err(WireError::UnknownKind(k)),
    };
    r.end()?;
    Ok(req)
}

pub fn decode_answer(body: Bytes) -> Result<Answer, WireError> {
    let mut r = Reader { b: body };
    let a = match r.u8()? {
        kind::HELLO_OK => {
            r.u16()?;
            Answer::HelloOk
        }
        kind::INFO_IS => {
            let value_bytes_max = r.u32()?;
            let nodes_per_block = r.u32()?;
            let blocks_max = r.u32()?;
            let n = r.count("servers", SERVERS_MAX, 2)?;
            let servers = (0..n)
                .map(|_| r.string("server address", ADDR_BYTES_MAX))
                .collect::<Result<_, _>>()?;
            Answer::Info(Info {
                // An impossible geometry is the peer's error, reported as a short frame
                // would be: the client refuses the store.
                geometry: Geometry::new(value_bytes_max, nodes_per_block).map_err(|_| {
                    WireError::Limit {
                        what: "geometry",
                        len: value_bytes_max as usize,
                        max: crate::layout::VALUE_BYTES_MAX as usize,
                    }
                })?,
                blocks_max,
                servers,
            })
        }
        kind::KEY_IS => Answer::Key {
            id: r.u64()?,
            head: r.hint()?,
        },
        kind::HEAD_IS => Answer::Head(r.hint()?),
        kind::NODES => {
            let n = r.count("nodes", NODES_PER_FRAME_MAX, 8)?;
            Answer::Nodes((0..n).map(|_| r.node()).collect::<Result<_, _>>()?)
        }
        kind::DONE => Answer::Done,
        kind::BLOCK_LIST => {
            let from = r.u32()?;
            let n = r.count("blocks", BLOCKS_PER_FRAME_MAX, 20)?;
            let blocks = (0..n)
                .map(|_| {
                    Ok(BlockRef {
                        server: r.u32()?,
                        region: r.u64()?,
                        size: r.u64()?,
                    })
                })
                .collect::<Result<_, WireError>>()?;
            Answer::Blocks { from, blocks }
        }
        kind::STATS_ARE => {
            let n = r.count("stats", STATS_MAX, 10)?;
            let list = (0..n)
                .map(|_| Ok((r.string("stat name", ADDR_BYTES_MAX)?, r.u64()?)))
                .collect::<Result<_, WireError>>()?;
            Answer::Stats(list)
        }
        kind::ERROR => {
            let k = r.u8()?;
            let kind = ErrorKind::from_u8(k).unwrap_or(ErrorKind::Other);
            let arg = r.u64()?;
            let message = r.string("message", MESSAGE_BYTES_MAX)?;
            Answer::Error { kind, arg, message }
        }
        k => return Err(WireError::UnknownKind(k)),
    };
    r.end()?;
    Ok(a)
}

/// Checks a frame's announced length against `max` before any of its body is read.
pub fn frame_len(prefix: [u8; 4], max: usize) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len == 0 {
        return Err(WireError::Short);
    }
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn body(frame: Bytes) -> Bytes {
        let len = frame_len(frame[..4].try_into().unwrap(), ANSWER_BYTES_MAX).unwrap();
        assert_eq!(len, frame.len() - 4);
        frame.slice(4..)
    }

    fn node() -> impl Strategy<Value = NodeAddr> {
        (any::<u32>(), any::<u32>()).prop_map(|(block, slot)| NodeAddr { block, slot })
    }

    fn hint() -> impl Strategy<Value = Hint> {
        (node(), any::<u64>()).prop_map(|(addr, seq)| Hint { addr, seq })
    }

    fn request() -> impl Strategy<Value = Request> {
        prop_oneof![
            Just(Request::Info),
            prop::collection::vec(any::<u8>(), 0..KEY_BYTES_MAX).prop_map(Request::Key),
            any::<u64>().prop_map(Request::Head),
            any::<u32>().prop_map(Request::Grant),
            prop::collection::vec(node(), 0..50).prop_map(Request::GiveBack),
            any::<u32>().prop_map(Request::Blocks),
            Just(Request::Stats),
        ]
    }

    fn answer() -> impl Strategy<Value = Answer> {
        prop_oneof![
            Just(Answer::HelloOk),
            (
                1u32..4096,
                1u32..1024,
                any::<u32>(),
                prop::collection::vec("[a-z0-9.:]{0,30}", 0..5)
            )
                .prop_map(|(v, n, blocks_max, servers)| Answer::Info(Info {
                    geometry: Geometry::new(v, n).unwrap(),
                    blocks_max,
                    servers,
                })),
            (any::<u64>(), hint()).prop_map(|(id, head)| Answer::Key { id, head }),
            hint().prop_map(Answer::Head),
            prop::collection::vec(node(), 0..50).prop_map(Answer::Nodes),
            Just(Answer::Done),
            (
                any::<u32>(),
                prop::collection::vec((any::<u32>(), any::<u64>(), any::<u64>()), 0..20)
            )
                .prop_map(|(from, b)| Answer::Blocks {
                    from,
                    blocks: b
                        .into_iter()
                        .map(|(server, region, size)| BlockRef {
                            server,
                            region,
                            size
                        })
                        .collect()
                }),
            prop::collection::vec(("[a-z_]{1,20}", any::<u64>()), 0..10).prop_map(Answer::Stats),
            (1u8..6, any::<u64>(), "[ -~]{0,100}").prop_map(|(k, arg, message)| Answer::Error {
                kind: ErrorKind::from_u8(k).unwrap(),
                arg,
                message
            }),
        ]
    }

    proptest! {
        #[test]
        fn requests_round_trip(r in request()) {
            let f = encode_request(&r).unwrap();
            prop_assert!(f.len() - 4 <= REQUEST_BYTES_MAX);
            prop_assert_eq!(decode_request(body(f)).unwrap(), r);
        }

        #[test]
        fn answers_round_trip(a in answer()) {
            let f = encode_answer(&a).unwrap();
            prop_assert_eq!(decode_answer(body(f)).unwrap(), a);
        }

        #[test]
        fn hellos_round_trip(token in prop::collection::vec(any::<u8>(), 0..TOKEN_BYTES_MAX)) {
            let f = encode_hello(&token).unwrap();
            prop_assert!(f.len() - 4 <= HELLO_BYTES_MAX);
            let h = decode_hello(body(f)).unwrap();
            prop_assert_eq!(h, Hello { version: VERSION, token });
        }

        /// Hostile bytes: an error or a value, never a panic; truncations of a valid
        /// frame are errors.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200), r in request(), cut in 0usize..100) {
            let _ = decode_request(Bytes::from(bytes.clone()));
            let _ = decode_answer(Bytes::from(bytes.clone()));
            let _ = decode_hello(Bytes::from(bytes));
            let full = body(encode_request(&r).unwrap());
            if cut < full.len() {
                prop_assert!(decode_request(full.slice(..cut)).is_err());
            }
        }
    }

    #[test]
    fn limits_are_enforced_both_ways() {
        assert!(encode_request(&Request::Key(vec![0; KEY_BYTES_MAX + 1])).is_err());
        assert!(encode_request(&Request::GiveBack(vec![
            NodeAddr { block: 0, slot: 0 };
            NODES_PER_FRAME_MAX + 1
        ]))
        .is_err());
        // A count claiming more items than the frame holds is refused before any is read.
        let mut b = BytesMut::new();
        b.put_u8(kind::GIVE_BACK);
        b.put_u32_le(1000);
        assert_eq!(decode_request(b.freeze()), Err(WireError::Short));
        assert!(frame_len((HELLO_BYTES_MAX as u32 + 1).to_le_bytes(), HELLO_BYTES_MAX).is_err());
        assert!(frame_len(0u32.to_le_bytes(), HELLO_BYTES_MAX).is_err());
        let mut b = BytesMut::new();
        b.put_u8(kind::HELLO);
        b.put_slice(b"HTTP");
        assert_eq!(decode_hello(b.freeze()), Err(WireError::BadMagic));
    }
}
