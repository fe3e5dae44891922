//! RESP2 requests in, RESP2 replies out. Pure: no sockets.
//!
//! Requests are arrays of bulk strings (what every client library and `redis-cli` send)
//! or inline commands (space-separated words on one line, what a person types into
//! `nc`). Every length is checked against the limits below before anything is reserved,
//! and a request that is still arriving is only re-scanned header by header (bulk
//! contents are skipped by length), so a 16 MiB value in many reads costs no quadratic
//! work.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use camelot_proto::limits::VALUE_BYTES_MAX;

/// Most arguments in one command (MSET with this many keys is already a bulk load).
pub const ARGS_MAX: usize = 1 << 16;
/// Longest single argument: a value, plus room for nothing else.
pub const ARG_BYTES_MAX: usize = VALUE_BYTES_MAX;
/// Longest inline command line, and longest `*`/`$` header line.
pub const INLINE_BYTES_MAX: usize = 64 << 10;
/// Most bytes one command may occupy in the input buffer, so a connection can never pin
/// more than this much memory for a request.
pub const COMMAND_BYTES_MAX: usize = 64 << 20;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RespError {
    #[error("Protocol error: {0}")]
    Protocol(String),
}

fn protocol(msg: impl Into<String>) -> RespError {
    RespError::Protocol(msg.into())
}

/// Finds `\r\n` at or after `from`; returns the index of `\r`.
fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|i| from + i)
}

/// Reads the decimal integer on the line starting at `at` (after the type byte).
/// `Ok(None)` when the line is not complete yet.
fn header_int(buf: &[u8], at: usize, what: &str) -> Result<Option<(i64, usize)>, RespError> {
    let Some(end) = find_crlf(buf, at) else {
        if buf.len() - at > INLINE_BYTES_MAX {
            return Err(protocol(format!("too big {what} header")));
        }
        return Ok(None);
    };
    let text = std::str::from_utf8(&buf[at..end])
        .map_err(|_| protocol(format!("invalid {what} length")))?;
    let n: i64 = text
        .parse()
        .map_err(|_| protocol(format!("invalid {what} length")))?;
    Ok(Some((n, end + 2)))
}

/// Splits one complete command off the front of `buf`: `Ok(None)` when more bytes are
/// needed, `Err` when the stream cannot be trusted any more (the caller replies with the
/// error and closes, as Redis does). An empty array or blank inline line yields an
/// empty command, which callers skip.
pub fn parse_command(buf: &mut BytesMut) -> Result<Option<Vec<Bytes>>, RespError> {
    if buf.is_empty() {
        return Ok(None);
    }
    if buf[0] != b'*' {
        return parse_inline(buf);
    }
    let Some((count, mut at)) = header_int(buf, 1, "multibulk")? else {
        return Ok(None);
    };
    if count <= 0 {
        buf.advance(at);
        return Ok(Some(Vec::new()));
    }
    if count as u64 > ARGS_MAX as u64 {
        return Err(protocol("invalid multibulk length"));
    }
    let count = count as usize;
    // First pass: are all arguments here, and well-formed? Only headers are read.
    let first = at;
    for _ in 0..count {
        if at >= buf.len() {
            return Ok(None);
        }
        if buf[at] != b'$' {
            return Err(protocol(format!(
                "expected '$', got '{}'",
                char::from(buf[at]).escape_default()
            )));
        }
        let Some((len, start)) = header_int(buf, at + 1, "bulk")? else {
            return Ok(None);
        };
        if len < 0 || len as u64 > ARG_BYTES_MAX as u64 {
            return Err(protocol("invalid bulk length"));
        }
        let end = start + len as usize;
        if end + 2 > COMMAND_BYTES_MAX {
            return Err(protocol("command too large"));
        }
        if buf.len() < end + 2 {
            // Reserve for this argument now so a big value arrives without regrowths.
            buf.reserve(end + 2 - buf.len());
            return Ok(None);
        }
        if &buf[end..end + 2] != b"\r\n" {
            return Err(protocol("bulk string not terminated by CRLF"));
        }
        at = end + 2;
    }
    // Second pass over the same, now known-good headers: slices of one frozen buffer, so
    // arguments are not copied and no list of spans is allocated on the way.
    let frozen = buf.split_to(at).freeze();
    let mut args = Vec::with_capacity(count);
    let mut at = first;
    for _ in 0..count {
        let Some((len, start)) = header_int(&frozen, at + 1, "bulk")? else {
            return Err(protocol("bulk header changed under us"));
        };
        let end = start + len as usize;
        args.push(frozen.slice(start..end));
        at = end + 2;
    }
    Ok(Some(args))
}

fn parse_inline(buf: &mut BytesMut) -> Result<Option<Vec<Bytes>>, RespError> {
    let Some(end) = find_crlf(buf, 0).or_else(|| buf.iter().position(|&b| b == b'\n')) else {
        if buf.len() > INLINE_BYTES_MAX {
            return Err(protocol("too big inline request"));
        }
        return Ok(None);
    };
    let line_end = if buf.get(end) == Some(&b'\r') {
        end + 2
    } else {
        end + 1
    };
    let line = buf.split_to(line_end.min(buf.len())).freeze();
    let text = &line[..end];
    if text.len() > INLINE_BYTES_MAX {
        return Err(protocol("too big inline request"));
    }
    let mut args = Vec::new();
    let mut i = 0;
    while i < text.len() {
        while i < text.len() && text[i].is_ascii_whitespace() {
            i += 1;
        }
        let start = i;
        while i < text.len() && !text[i].is_ascii_whitespace() {
            i += 1;
        }
        if start < i {
            args.push(line.slice(start..i));
        }
    }
    Ok(Some(args))
}

/// Writes `n` in decimal without allocating (this runs for every reply).
fn put_decimal(out: &mut BytesMut, n: i64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut v = n.unsigned_abs();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    if n < 0 {
        out.put_u8(b'-');
    }
    out.put_slice(&digits[i..]);
}

/// Replies, written straight into the output buffer.
pub fn simple(out: &mut BytesMut, s: &str) {
    out.put_u8(b'+');
    out.put_slice(s.as_bytes());
    out.put_slice(b"\r\n");
}

/// An error reply. `msg` starts with its code word (ERR, WRONGTYPE, OOM…); CR and LF are
/// replaced so an echoed argument cannot break the framing.
pub fn error(out: &mut BytesMut, msg: &str) {
    out.put_u8(b'-');
    for b in msg.bytes() {
        out.put_u8(if b == b'\r' || b == b'\n' { b' ' } else { b });
    }
    out.put_slice(b"\r\n");
}

pub fn integer(out: &mut BytesMut, n: i64) {
    out.put_u8(b':');
    put_decimal(out, n);
    out.put_slice(b"\r\n");
}

pub fn bulk(out: &mut BytesMut, b: &[u8]) {
    out.put_u8(b'$');
    put_decimal(out, b.len() as i64);
    out.put_slice(b"\r\n");
    out.put_slice(b);
    out.put_slice(b"\r\n");
}

pub fn null_bulk(out: &mut BytesMut) {
    out.put_slice(b"$-1\r\n");
}

pub fn array_header(out: &mut BytesMut, n: usize) {
    out.put_u8(b'*');
    put_decimal(out, n as i64);
    out.put_slice(b"\r\n");
}

/// A double as Redis prints it: the shortest text that reads back as the same number.
pub fn format_double(x: f64) -> String {
    if x == f64::INFINITY {
        "inf".into()
    } else if x == f64::NEG_INFINITY {
        "-inf".into()
    } else {
        // Rust's Display for f64 is already the shortest round-tripping form.
        format!("{x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode(args: &[Vec<u8>]) -> Vec<u8> {
        let mut out = BytesMut::new();
        array_header(&mut out, args.len());
        for a in args {
            bulk(&mut out, a);
        }
        out.to_vec()
    }

    #[test]
    fn inline_commands_split_on_whitespace() {
        let mut buf = BytesMut::from(&b"SET  k   v\r\nPING\n"[..]);
        let a = parse_command(&mut buf).unwrap().unwrap();
        assert_eq!(
            a,
            vec![Bytes::from("SET"), Bytes::from("k"), Bytes::from("v")]
        );
        let b = parse_command(&mut buf).unwrap().unwrap();
        assert_eq!(b, vec![Bytes::from("PING")]);
        assert!(buf.is_empty());
    }

    #[test]
    fn hostile_headers_are_errors_not_allocations() {
        for bad in [
            &b"*99999999999\r\n"[..],
            b"*1\r\n$999999999999\r\n",
            b"*1\r\n$-5\r\n",
            b"*1\r\n:5\r\n",
            b"*x\r\n",
            b"*1\r\n$3\r\nabcXY",
        ] {
            let mut buf = BytesMut::from(bad);
            assert!(parse_command(&mut buf).is_err(), "{bad:?}");
        }
        let mut long = BytesMut::from(&vec![b'a'; INLINE_BYTES_MAX + 10][..]);
        assert!(parse_command(&mut long).is_err());
    }

    #[test]
    fn integers_print_in_decimal() {
        for n in [0i64, 7, -7, 10, 1_234_567, i64::MAX, i64::MIN] {
            let mut out = BytesMut::new();
            integer(&mut out, n);
            assert_eq!(out, format!(":{n}\r\n").as_bytes());
        }
    }

    #[test]
    fn doubles_print_like_redis() {
        assert_eq!(format_double(1.0), "1");
        assert_eq!(format_double(1.5), "1.5");
        assert_eq!(format_double(f64::INFINITY), "inf");
        assert_eq!(format_double(-0.25), "-0.25");
    }

    proptest! {
        #[test]
        fn commands_round_trip_in_any_split(
            args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..50), 1..8),
            cut in any::<usize>(),
        ) {
            let bytes = encode(&args);
            let cut = cut % (bytes.len() + 1);
            let mut buf = BytesMut::from(&bytes[..cut]);
            if cut < bytes.len() {
                prop_assert_eq!(parse_command(&mut buf).unwrap(), None);
                buf.extend_from_slice(&bytes[cut..]);
            }
            let parsed = parse_command(&mut buf).unwrap().unwrap();
            let parsed: Vec<Vec<u8>> = parsed.iter().map(|b| b.to_vec()).collect();
            prop_assert_eq!(parsed, args);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut buf = BytesMut::from(&data[..]);
            // Every Ok(Some) consumes bytes, so this loop ends.
            while let Ok(Some(_)) = parse_command(&mut buf) {}
        }
    }
}
