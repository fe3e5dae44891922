//! The control protocol between `bench hw net` and `bench hw net-server`. No I/O here
//! except [`read_message`], which only pulls the bytes [`decode`] asks for.
//!
//! Every test is one TCP connection that opens with `Start(test)`; the server answers
//! `Ready` (naming a UDP port for UDP tests) or `Refused`. A TCP sink then reads until EOF
//! and answers `Report`; a UDP sink counts datagrams until the client sends `Stop`, then
//! answers `Report`; echoes run until the connection closes.
//!
//! A message is `magic "CMNB" | version u8 | tag u8 | body`, the body's length fixed by
//! the tag (REFUSED: `u8 len | UTF-8`). So the decoder always knows how many more bytes a
//! message needs, and never reads past it into the test's own data.

use std::io::Read;

/// Largest buffer one write may carry.
pub const BUFFER_BYTES_MAX: usize = 16 << 20;
/// Largest UDP payload over IPv4; bigger buffers are not measured for UDP (not faked).
pub const UDP_PAYLOAD_BYTES_MAX: usize = 65_507;
pub const STREAMS_MAX: usize = 256;
/// How long any socket operation may block before the run is declared failed.
pub(crate) const IO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub const MAGIC: [u8; 4] = *b"CMNB";
pub const VERSION: u8 = 1;
const HEADER_BYTES: usize = 6;
/// Longest reason a refusal carries (its length travels in one byte).
pub const REASON_BYTES_MAX: usize = 255;
/// Longest message: a refusal with the longest reason.
pub const MESSAGE_BYTES_MAX: usize = HEADER_BYTES + 1 + REASON_BYTES_MAX;

const TAG_START: u8 = 1;
const TAG_READY: u8 = 2;
const TAG_REFUSED: u8 = 3;
const TAG_STOP: u8 = 4;
const TAG_REPORT: u8 = 5;

const TEST_TCP_SINK: u8 = 1;
const TEST_TCP_ECHO: u8 = 2;
const TEST_UDP_SINK: u8 = 3;
const TEST_UDP_ECHO: u8 = 4;

/// What the server does for one connection. Sizes are what it allocates, so each is
/// bounded by the same limit the client's configuration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// Read the connection until EOF, then report what arrived.
    TcpSink { buffer_bytes: u32 },
    /// Echo `message_bytes`-byte messages until EOF.
    TcpEcho { message_bytes: u32 },
    /// Count datagrams on a fresh UDP port until `Stop`, then report.
    UdpSink { datagram_bytes: u32 },
    /// Echo datagrams on a fresh UDP port until the connection closes.
    UdpEcho { message_bytes: u32 },
}

impl Test {
    fn code_and_size(self) -> (u8, u32) {
        match self {
            Test::TcpSink { buffer_bytes } => (TEST_TCP_SINK, buffer_bytes),
            Test::TcpEcho { message_bytes } => (TEST_TCP_ECHO, message_bytes),
            Test::UdpSink { datagram_bytes } => (TEST_UDP_SINK, datagram_bytes),
            Test::UdpEcho { message_bytes } => (TEST_UDP_ECHO, message_bytes),
        }
    }

    /// The largest size this test may name.
    pub fn size_bytes_max(self) -> usize {
        match self {
            Test::TcpSink { .. } => BUFFER_BYTES_MAX,
            _ => UDP_PAYLOAD_BYTES_MAX,
        }
    }

    pub fn size_bytes(self) -> usize {
        self.code_and_size().1 as usize
    }
}

/// What arrived at a sink, on the server's clock (nanoseconds since it started), so the
/// spans of several streams to one server can be joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub bytes: u64,
    pub first_ns: u64,
    pub last_ns: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Start(Test),
    /// `udp_port` is 0 for TCP tests.
    Ready {
        udp_port: u16,
    },
    Refused(String),
    Stop,
    Report(Report),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("not a Camelot net-bench peer (bad magic)")]
    BadMagic,
    #[error("net-bench protocol version {0}, this build speaks {VERSION}")]
    BadVersion(u8),
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    #[error("unknown test kind {0}")]
    UnknownTest(u8),
    #[error("test size {size} bytes is outside 1..={max}")]
    SizeOutOfRange { size: u32, max: usize },
    #[error("a report whose span ends before it starts")]
    BadSpan,
    #[error("a refusal whose reason is not UTF-8")]
    ReasonNotUtf8,
    /// The stream failed or ended before a whole message arrived.
    #[error("net-bench control stream: {0}")]
    Stream(String),
}

/// The outcome of decoding a prefix of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// One message, and how many bytes of the input it took.
    Message(Message, usize),
    /// Give me this many more bytes (always at least one; never past [`MESSAGE_BYTES_MAX`]).
    Incomplete { needed_bytes: usize },
}

pub fn encode(m: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(MESSAGE_BYTES_MAX);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    match m {
        Message::Start(t) => {
            let (code, size) = t.code_and_size();
            out.push(TAG_START);
            out.push(code);
            out.extend_from_slice(&size.to_le_bytes());
        }
        Message::Ready { udp_port } => {
            out.push(TAG_READY);
            out.extend_from_slice(&udp_port.to_le_bytes());
        }
        Message::Refused(reason) => {
            let r = truncate_at_char(reason, REASON_BYTES_MAX);
            out.push(TAG_REFUSED);
            // `truncate_at_char` keeps it at most 255 bytes.
            out.push(r.len() as u8);
            out.extend_from_slice(r.as_bytes());
        }
        Message::Stop => out.push(TAG_STOP),
        Message::Report(r) => {
            out.push(TAG_REPORT);
            for v in [r.bytes, r.first_ns, r.last_ns] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    out
}

fn truncate_at_char(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Decodes the message at the start of `buf`. Garbage fails as soon as it shows: the
/// magic is checked on whatever prefix has arrived.
pub fn decode(buf: &[u8]) -> Result<Decoded, ControlError> {
    let have = buf.len();
    let m = have.min(MAGIC.len());
    if buf[..m] != MAGIC[..m] {
        return Err(ControlError::BadMagic);
    }
    let more = |total: usize| Decoded::Incomplete {
        needed_bytes: total - have,
    };
    if have < HEADER_BYTES {
        return Ok(more(HEADER_BYTES));
    }
    if buf[4] != VERSION {
        return Err(ControlError::BadVersion(buf[4]));
    }
    let tag = buf[5];
    let body_bytes = match tag {
        TAG_START => 5,
        TAG_READY => 2,
        TAG_REFUSED if have <= HEADER_BYTES => return Ok(more(HEADER_BYTES + 1)),
        TAG_REFUSED => 1 + buf[HEADER_BYTES] as usize,
        TAG_STOP => 0,
        TAG_REPORT => 24,
        t => return Err(ControlError::UnknownTag(t)),
    };
    let total = HEADER_BYTES + body_bytes;
    if have < total {
        return Ok(more(total));
    }
    let body = &buf[HEADER_BYTES..total];
    let msg = match tag {
        TAG_START => {
            let size = u32::from_le_bytes([body[1], body[2], body[3], body[4]]);
            let test = match body[0] {
                TEST_TCP_SINK => Test::TcpSink { buffer_bytes: size },
                TEST_TCP_ECHO => Test::TcpEcho {
                    message_bytes: size,
                },
                TEST_UDP_SINK => Test::UdpSink {
                    datagram_bytes: size,
                },
                TEST_UDP_ECHO => Test::UdpEcho {
                    message_bytes: size,
                },
                k => return Err(ControlError::UnknownTest(k)),
            };
            let max = test.size_bytes_max();
            if size == 0 || size as usize > max {
                return Err(ControlError::SizeOutOfRange { size, max });
            }
            Message::Start(test)
        }
        TAG_READY => Message::Ready {
            udp_port: u16::from_le_bytes([body[0], body[1]]),
        },
        TAG_REFUSED => Message::Refused(
            std::str::from_utf8(&body[1..])
                .map_err(|_| ControlError::ReasonNotUtf8)?
                .to_owned(),
        ),
        TAG_STOP => Message::Stop,
        _ => {
            let r = Report {
                bytes: u64_at(body, 0),
                first_ns: u64_at(body, 8),
                last_ns: u64_at(body, 16),
            };
            if r.last_ns < r.first_ns {
                return Err(ControlError::BadSpan);
            }
            Message::Report(r)
        }
    };
    Ok(Decoded::Message(msg, total))
}

/// Reads exactly one message from `r`, never a byte past it.
pub fn read_message(r: &mut impl Read) -> Result<Message, ControlError> {
    let mut buf = Vec::with_capacity(MESSAGE_BYTES_MAX);
    loop {
        match decode(&buf)? {
            Decoded::Message(m, _) => return Ok(m),
            Decoded::Incomplete { needed_bytes } => {
                let at = buf.len();
                buf.resize(at + needed_bytes, 0);
                r.read_exact(&mut buf[at..])
                    .map_err(|e| ControlError::Stream(e.to_string()))?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn test_kind() -> impl Strategy<Value = Test> {
        prop_oneof![
            (1..=BUFFER_BYTES_MAX as u32).prop_map(|b| Test::TcpSink { buffer_bytes: b }),
            (1..=UDP_PAYLOAD_BYTES_MAX as u32).prop_map(|b| Test::TcpEcho { message_bytes: b }),
            (1..=UDP_PAYLOAD_BYTES_MAX as u32).prop_map(|b| Test::UdpSink { datagram_bytes: b }),
            (1..=UDP_PAYLOAD_BYTES_MAX as u32).prop_map(|b| Test::UdpEcho { message_bytes: b }),
        ]
    }

    fn message() -> impl Strategy<Value = Message> {
        prop_oneof![
            test_kind().prop_map(Message::Start),
            any::<u16>().prop_map(|udp_port| Message::Ready { udp_port }),
            "\\PC{0,80}"
                .prop_map(|s| Message::Refused(truncate_at_char(&s, REASON_BYTES_MAX).to_owned())),
            Just(Message::Stop),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(bytes, a, b)| {
                Message::Report(Report {
                    bytes,
                    first_ns: a.min(b),
                    last_ns: a.max(b),
                })
            }),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips_and_takes_exactly_its_bytes(m in message(), tail in proptest::collection::vec(any::<u8>(), 0..16)) {
            let mut wire = encode(&m);
            let len = wire.len();
            prop_assert!(len <= MESSAGE_BYTES_MAX);
            wire.extend_from_slice(&tail);
            prop_assert_eq!(decode(&wire), Ok(Decoded::Message(m.clone(), len)));
            // Every proper prefix asks for exactly the bytes still missing, or fewer.
            for cut in 0..len {
                match decode(&wire[..cut]) {
                    Ok(Decoded::Incomplete { needed_bytes }) => {
                        prop_assert!(needed_bytes >= 1 && cut + needed_bytes <= len);
                    }
                    other => prop_assert!(false, "prefix {cut} of {len}: {other:?}"),
                }
            }
            let mut reader = &wire[..];
            prop_assert_eq!(read_message(&mut reader).ok(), Some(m));
            prop_assert_eq!(reader.len(), tail.len(), "read past the message");
        }

        #[test]
        fn arbitrary_bytes_are_an_error_or_a_bounded_answer(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            match decode(&bytes) {
                Ok(Decoded::Message(m, used)) => {
                    prop_assert!(used <= bytes.len());
                    prop_assert_eq!(decode(&encode(&m)), Ok(Decoded::Message(m, used)));
                }
                Ok(Decoded::Incomplete { needed_bytes }) => {
                    prop_assert!(needed_bytes >= 1);
                    prop_assert!(bytes.len() + needed_bytes <= MESSAGE_BYTES_MAX);
                }
                Err(_) => {}
            }
        }
    }

    #[test]
    fn hostile_messages_are_typed_errors() {
        let start = |code: u8, size: u32| {
            let mut w = MAGIC.to_vec();
            w.extend_from_slice(&[VERSION, TAG_START, code]);
            w.extend_from_slice(&size.to_le_bytes());
            decode(&w)
        };
        assert_eq!(decode(b"GET / HTTP/1.1"), Err(ControlError::BadMagic));
        assert_eq!(
            decode(b"CX"),
            Err(ControlError::BadMagic),
            "fails on a prefix"
        );
        assert_eq!(decode(b"CMNB\x09\x01"), Err(ControlError::BadVersion(9)));
        assert_eq!(decode(b"CMNB\x01\x77"), Err(ControlError::UnknownTag(0x77)));
        assert_eq!(start(9, 64), Err(ControlError::UnknownTest(9)));
        assert!(matches!(
            start(TEST_TCP_SINK, 0),
            Err(ControlError::SizeOutOfRange { .. })
        ));
        assert!(matches!(
            start(TEST_TCP_SINK, u32::MAX),
            Err(ControlError::SizeOutOfRange { .. })
        ));
        assert!(matches!(
            start(TEST_UDP_SINK, UDP_PAYLOAD_BYTES_MAX as u32 + 1),
            Err(ControlError::SizeOutOfRange { .. })
        ));
        let mut refused = MAGIC.to_vec();
        refused.extend_from_slice(&[VERSION, TAG_REFUSED, 2, 0xff, 0xfe]);
        assert_eq!(decode(&refused), Err(ControlError::ReasonNotUtf8));
        let mut report = encode(&Message::Report(Report {
            bytes: 1,
            first_ns: 0,
            last_ns: 0,
        }));
        report[HEADER_BYTES + 8] = 1; // first_ns = 1 > last_ns
        assert_eq!(decode(&report), Err(ControlError::BadSpan));
    }

    #[test]
    fn long_reasons_are_cut_at_a_character() {
        let long = "é".repeat(200); // 400 bytes
        let wire = encode(&Message::Refused(long));
        let Ok(Decoded::Message(Message::Refused(r), _)) = decode(&wire) else {
            panic!("a refusal decodes");
        };
        assert!(r.len() <= REASON_BYTES_MAX && r.chars().all(|c| c == 'é'));
        assert_eq!(r.len(), 254);
    }

    #[test]
    fn a_stream_that_ends_early_is_an_error() {
        let wire = encode(&Message::Stop);
        let mut short = &wire[..3];
        assert!(matches!(
            read_message(&mut short),
            Err(ControlError::Stream(_))
        ));
    }
}
