//! RESP2 requests in, RESP2 replies out. Pure: no sockets.
//!
//! Requests are arrays of bulk strings (what every client library and `redis-cli` send)
//! or inline commands (space-separated words on one line, what a person types into
//! `nc`). Every length is checked against the limits below before anything is reserved,
//! and a request that is still arriving is only re-scanned header by header (bulk
//! contents are skipped by length), so a 16 MiB value in many reads costs no quadratic
//! work.

use bytes::{BufMut, BytesMut};
use camelot_proto::limits::VALUE_BYTES_MAX;

/// Most arguments in one command (MSET with this many keys is already a bulk load).
pub const ARGS_MAX: usize = 1 << 16;
/// Longest single argument by default: Redis's `proto-max-bulk-len` default (512 MiB),
/// so `redis-cli -x SET k < big` is read whole and answered rather than cut off
/// mid-send. The server flag `--proto-max-bulk-len` changes it. What may be *stored* is
/// still bounded by the value limit and the memory cap; those answer an error reply.
pub const PROTO_MAX_BULK_LEN_DEFAULT: usize = 512 << 20;
/// Smallest `--proto-max-bulk-len` accepted (Redis's own floor is 1 MiB).
pub const PROTO_MAX_BULK_LEN_MIN: usize = 1 << 20;
/// The old fixed argument cap, kept for callers that name it: the stored-value limit.
pub const ARG_BYTES_MAX: usize = VALUE_BYTES_MAX;
/// Longest inline command line, and longest `*`/`$` header line.
pub const INLINE_BYTES_MAX: usize = 64 << 10;
/// Most bytes one command may occupy in the input buffer beyond its longest argument, so
/// a connection can never pin more than `proto-max-bulk-len` plus this for a request.
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
    let mut at = from;
    loop {
        at += buf.get(at..)?.iter().position(|&b| b == b'\r')?;
        if buf.get(at + 1) == Some(&b'\n') {
            return Some(at);
        }
        at += 1;
    }
}

/// Reads the decimal integer on the line starting at `at` (after the type byte), as
/// Redis's `string2ll` does: an optional `-`, then digits, nothing else. `Ok(None)` when
/// the line is not complete yet. This runs for every header of every command, so it
/// neither validates UTF-8 nor goes through `str::parse`.
fn header_int(buf: &[u8], at: usize, what: &str) -> Result<Option<(i64, usize)>, RespError> {
    let Some(end) = find_crlf(buf, at) else {
        if buf.len() - at.min(buf.len()) > INLINE_BYTES_MAX {
            return Err(protocol(format!("too big {what} header")));
        }
        return Ok(None);
    };
    let bad = || protocol(format!("invalid {what} length"));
    let text = &buf[at..end];
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    // 18 digits cannot overflow an i64; every limit we check against is far smaller.
    if digits.is_empty() || digits.len() > 18 {
        return Err(bad());
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return Err(bad());
        }
        n = n * 10 + i64::from(d - b'0');
    }
    Ok(Some((if negative { -n } else { n }, end + 2)))
}

/// What [`parse_command`] found at the front of the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// One whole command, this many bytes long; its arguments were pushed. No arguments
    /// (an empty array or a blank inline line) is a command callers skip.
    Command(usize),
    /// The command is not all here; it will be at least this many bytes long, so the
    /// caller can make room for a big value before it arrives.
    Incomplete(usize),
}

/// Parses the command at the front of `buf`, pushing its arguments onto `args` (cleared
/// first) as slices of `buf`: nothing is copied or reference-counted, and `args` is the
/// caller's to reuse. `Err` when the stream cannot be trusted any more (the caller
/// replies with the error and closes, as Redis does). A command that is still arriving
/// is re-scanned header by header next time (bulk contents are skipped by length), so
/// a 16 MiB value in many reads costs no quadratic work.
pub fn parse_command<'a>(buf: &'a [u8], args: &mut Vec<&'a [u8]>) -> Result<Parsed, RespError> {
    parse_command_with(buf, args, PROTO_MAX_BULK_LEN_DEFAULT)
}

/// [`parse_command`] with a longest argument of `bulk_bytes_max` (`proto-max-bulk-len`).
pub fn parse_command_with<'a>(
    buf: &'a [u8],
    args: &mut Vec<&'a [u8]>,
    bulk_bytes_max: usize,
) -> Result<Parsed, RespError> {
    parse_command_resuming(buf, args, bulk_bytes_max, &mut Resume::default())
}

/// Where a multibulk command still arriving was left: its argument count, how many of
/// its arguments are complete, and the offset just past the last of them. A command
/// trickled in a few bytes per read would otherwise be re-scanned header by header on
/// every read (work quadratic in its argument count, up to [`ARGS_MAX`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    count: i64,
    args_done: i64,
    at: usize,
}

/// [`parse_command_with`] for a connection: `resume` carries the progress of the command
/// at the front of `buf` from one call to the next (the caller passes the same `buf`
/// start until a command completes, and a fresh `Resume` for a new connection). The
/// arguments already checked are skipped; when the command completes it is parsed once
/// more from its start, to hand out the slices — so every command costs linear work.
pub fn parse_command_resuming<'a>(
    buf: &'a [u8],
    args: &mut Vec<&'a [u8]>,
    bulk_bytes_max: usize,
    resume: &mut Resume,
) -> Result<Parsed, RespError> {
    let from = std::mem::take(resume);
    let parsed = parse_from(buf, args, bulk_bytes_max, from, resume);
    match parsed {
        // The arguments before `from` were skipped, so `args` lacks them: once more, whole.
        Ok(Parsed::Command(_)) if from.args_done > 0 => {
            parse_from(buf, args, bulk_bytes_max, Resume::default(), resume)
        }
        other => other,
    }
}

/// The multibulk parse, starting at `from` (nothing done: from the start), leaving in
/// `left` where an incomplete command stopped.
fn parse_from<'a>(
    buf: &'a [u8],
    args: &mut Vec<&'a [u8]>,
    bulk_bytes_max: usize,
    from: Resume,
    left: &mut Resume,
) -> Result<Parsed, RespError> {
    let command_bytes_max = bulk_bytes_max.saturating_add(COMMAND_BYTES_MAX);
    args.clear();
    match buf.first() {
        None => return Ok(Parsed::Incomplete(1)),
        Some(b'*') => {}
        Some(_) => return parse_inline(buf, args),
    }
    let (count, mut at) = if from.args_done > 0 {
        (from.count, from.at)
    } else {
        let Some((count, at)) = header_int(buf, 1, "multibulk")? else {
            return Ok(Parsed::Incomplete(buf.len() + 1));
        };
        (count, at)
    };
    if count <= 0 {
        return Ok(Parsed::Command(at));
    }
    if count as u64 > ARGS_MAX as u64 {
        return Err(protocol("invalid multibulk length"));
    }
    for done in from.args_done..count {
        *left = Resume {
            count,
            args_done: done,
            at,
        };
        let Some(&kind) = buf.get(at) else {
            return Ok(Parsed::Incomplete(at + 1));
        };
        if kind != b'$' {
            return Err(protocol(format!(
                "expected '$', got '{}'",
                char::from(kind).escape_default()
            )));
        }
        let Some((len, start)) = header_int(buf, at + 1, "bulk")? else {
            return Ok(Parsed::Incomplete(buf.len() + 1));
        };
        if len < 0 || len as u64 > bulk_bytes_max as u64 {
            return Err(protocol("invalid bulk length"));
        }
        let end = start + len as usize;
        if end + 2 > command_bytes_max {
            return Err(protocol("command too large"));
        }
        let Some(arg_and_crlf) = buf.get(start..end + 2) else {
            return Ok(Parsed::Incomplete(end + 2));
        };
        let (arg, crlf) = arg_and_crlf.split_at(len as usize);
        if crlf != b"\r\n" {
            return Err(protocol("bulk string not terminated by CRLF"));
        }
        args.push(arg);
        at = end + 2;
    }
    *left = Resume::default();
    Ok(Parsed::Command(at))
}

fn parse_inline<'a>(buf: &'a [u8], args: &mut Vec<&'a [u8]>) -> Result<Parsed, RespError> {
    // Redis's rule: the line ends at the first '\n', a '\r' before it dropped. Looking no
    // further than a line may be long keeps a buffer of many short lines linear (a search
    // for "\r\n" first scanned the whole rest of the buffer for every line ending in '\n').
    let window = &buf[..buf.len().min(INLINE_BYTES_MAX + 2)];
    let Some(newline) = window.iter().position(|&b| b == b'\n') else {
        if buf.len() > INLINE_BYTES_MAX {
            return Err(protocol("too big inline request"));
        }
        return Ok(Parsed::Incomplete(buf.len() + 1));
    };
    let end = if newline > 0 && buf[newline - 1] == b'\r' {
        newline - 1
    } else {
        newline
    };
    if end > INLINE_BYTES_MAX {
        return Err(protocol("too big inline request"));
    }
    args.extend(
        buf[..end]
            .split(u8::is_ascii_whitespace)
            .filter(|w| !w.is_empty()),
    );
    Ok(Parsed::Command(newline + 1))
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

/// [`error`] for a text holding bytes of the client's (an unknown command's arguments).
pub fn error_bytes(out: &mut BytesMut, msg: &[u8]) {
    out.put_u8(b'-');
    for &b in msg {
        out.put_u8(if b == b'\r' || b == b'\n' { b' ' } else { b });
    }
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

/// A double as Redis 7.0 prints it (`%.17g`: 17 significant digits, trailing zeros
/// dropped, exponent form below 1e-4 and from 1e17), so `1.1` is `1.1000000000000001`.
/// Client libraries parse it back to the same number either way; byte-for-byte
/// agreement is what the differential test checks.
pub fn format_double(x: f64) -> String {
    if x == f64::INFINITY {
        return "inf".into();
    }
    if x == f64::NEG_INFINITY {
        return "-inf".into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    const DIGITS: i32 = 17;
    // Rust's precision formatting rounds exactly, as glibc's printf does.
    let sci = format!("{:.*e}", (DIGITS - 1) as usize, x);
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..DIGITS).contains(&exp) {
        let mantissa = strip_fraction_zeros(mantissa);
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
    } else {
        let fixed = format!("{:.*}", (DIGITS - 1 - exp) as usize, x);
        strip_fraction_zeros(&fixed).to_owned()
    }
}

fn strip_fraction_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Parses the front of `buf` and takes the command off it, as the connection does.
    fn take(buf: &mut BytesMut) -> Result<Option<Vec<Vec<u8>>>, RespError> {
        let mut args = Vec::new();
        match parse_command(buf, &mut args)? {
            Parsed::Incomplete(needed) => {
                assert!(
                    needed > buf.len(),
                    "asked for {needed} with {} here",
                    buf.len()
                );
                Ok(None)
            }
            Parsed::Command(len) => {
                assert!(len > 0 && len <= buf.len());
                let owned = args.iter().map(|a| a.to_vec()).collect();
                let _ = buf.split_to(len);
                Ok(Some(owned))
            }
        }
    }

    fn encode(args: &[Vec<u8>]) -> Vec<u8> {
        let mut out = BytesMut::new();
        array_header(&mut out, args.len());
        for a in args {
            bulk(&mut out, a);
        }
        out.to_vec()
    }

    /// [`take`] through a connection's kept [`Resume`].
    fn take_resuming(
        buf: &mut BytesMut,
        resume: &mut Resume,
    ) -> Result<Option<Vec<Vec<u8>>>, RespError> {
        let mut args = Vec::new();
        match parse_command_resuming(buf, &mut args, PROTO_MAX_BULK_LEN_DEFAULT, resume)? {
            Parsed::Incomplete(needed) => {
                assert!(needed > buf.len());
                Ok(None)
            }
            Parsed::Command(len) => {
                let owned = args.iter().map(|a| a.to_vec()).collect();
                let _ = buf.split_to(len);
                Ok(Some(owned))
            }
        }
    }

    /// A command arriving a few bytes at a time is resumed after its last complete
    /// argument rather than re-scanned from its start, and comes out whole.
    #[test]
    fn a_trickled_command_resumes_where_it_stopped() {
        let args: Vec<Vec<u8>> = (0..1000).map(|i| format!("a{i}").into_bytes()).collect();
        let bytes = encode(&args);
        let mut buf = BytesMut::new();
        let mut resume = Resume::default();
        let mut got = None;
        for (i, b) in bytes.iter().enumerate() {
            buf.extend_from_slice(&[*b]);
            got = take_resuming(&mut buf, &mut resume).unwrap();
            if i == bytes.len() / 2 {
                assert!(
                    resume.args_done > 400,
                    "half-way, the parse did not keep its place: {resume:?}"
                );
            }
        }
        assert_eq!(got, Some(args));
        assert_eq!(resume, Resume::default());
        assert!(buf.is_empty());
    }

    /// As in Redis, an inline line ends at its first '\n' (a '\r' before it dropped), and
    /// many short lines parse one by one.
    #[test]
    fn an_inline_line_ends_at_its_first_newline() {
        let mut buf = BytesMut::from(&b"a\nb c\r\n"[..]);
        assert_eq!(take(&mut buf).unwrap(), Some(vec![b"a".to_vec()]));
        assert_eq!(
            take(&mut buf).unwrap(),
            Some(vec![b"b".to_vec(), b"c".to_vec()])
        );
        let mut many = BytesMut::from(&b"x\n".repeat(20_000)[..]);
        let mut lines = 0;
        while let Some(line) = take(&mut many).unwrap() {
            assert_eq!(line, vec![b"x".to_vec()]);
            lines += 1;
        }
        assert_eq!(lines, 20_000);
    }

    #[test]
    fn inline_commands_split_on_whitespace() {
        let mut buf = BytesMut::from(&b"SET  k   v\r\nPING\n"[..]);
        let a = take(&mut buf).unwrap().unwrap();
        assert_eq!(a, vec![b"SET".to_vec(), b"k".to_vec(), b"v".to_vec()]);
        let b = take(&mut buf).unwrap().unwrap();
        assert_eq!(b, vec![b"PING".to_vec()]);
        assert!(buf.is_empty());
    }

    #[test]
    fn headers_are_strict_decimal() {
        for good in [&b"*1\r\n$3\r\nabc\r\n"[..], b"*01\r\n$003\r\nabc\r\n"] {
            let mut buf = BytesMut::from(good);
            assert_eq!(take(&mut buf).unwrap(), Some(vec![b"abc".to_vec()]));
        }
        for empty in [&b"*0\r\n"[..], b"*-1\r\n"] {
            let mut buf = BytesMut::from(empty);
            assert_eq!(take(&mut buf).unwrap(), Some(vec![]));
            assert!(buf.is_empty());
        }
        for bad in [
            &b"*+1\r\n"[..],
            b"*\r\n",
            b"*1 \r\n",
            b"*-\r\n",
            b"*1\r\n$3x\r\nabc\r\n",
            b"*1\r\n$9999999999999999999\r\n",
        ] {
            let mut buf = BytesMut::from(bad);
            assert!(take(&mut buf).is_err(), "{bad:?}");
        }
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
            assert!(take(&mut buf).is_err(), "{bad:?}");
        }
        let mut long = BytesMut::from(&vec![b'a'; INLINE_BYTES_MAX + 10][..]);
        assert!(take(&mut long).is_err());
    }

    #[test]
    fn the_bulk_limit_is_redis_default_and_configurable() {
        // 100 MB announced: the old fixed 32 MiB cap refused it; Redis's default takes it.
        let header = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$100000000\r\n";
        let mut args = Vec::new();
        assert!(matches!(
            parse_command(header, &mut args),
            Ok(Parsed::Incomplete(n)) if n > 100_000_000
        ));
        let err = parse_command_with(header, &mut args, PROTO_MAX_BULK_LEN_MIN).unwrap_err();
        assert_eq!(err.to_string(), "Protocol error: invalid bulk length");
        let over = format!("*1\r\n${}\r\n", PROTO_MAX_BULK_LEN_DEFAULT + 1);
        assert!(parse_command(over.as_bytes(), &mut args).is_err());
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
        // What redis-server 7.0 answers to ZSCORE for these scores.
        assert_eq!(format_double(1.1), "1.1000000000000001");
        assert_eq!(format_double(1e20), "1e+20");
        assert_eq!(format_double(1.5e-7), "1.4999999999999999e-07");
        assert_eq!(format_double(0.0001), "0.0001");
        assert_eq!(
            format_double(123456789012345678.0),
            "1.2345678901234568e+17"
        );
        assert_eq!(format_double(-0.0), "-0");
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
                prop_assert_eq!(take(&mut buf).unwrap(), None);
                buf.extend_from_slice(&bytes[cut..]);
            }
            let parsed = take(&mut buf).unwrap().unwrap();
            prop_assert_eq!(parsed, args);
            prop_assert!(buf.is_empty());
        }

        /// Two commands fed in chunks of any sizes through one kept `Resume`, as a
        /// connection reads them: both come out whole, in order.
        #[test]
        fn commands_round_trip_trickled_through_a_resume(
            first in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 1..12),
            second in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 1..12),
            chunks in proptest::collection::vec(1usize..9, 1..200),
        ) {
            let mut bytes = encode(&first);
            bytes.extend_from_slice(&encode(&second));
            let mut buf = BytesMut::new();
            let mut resume = Resume::default();
            let mut out = Vec::new();
            let mut fed = 0;
            for n in chunks.iter().cycle() {
                if fed == bytes.len() {
                    break;
                }
                let to = (fed + n).min(bytes.len());
                buf.extend_from_slice(&bytes[fed..to]);
                fed = to;
                while let Some(cmd) = take_resuming(&mut buf, &mut resume).unwrap() {
                    out.push(cmd);
                }
            }
            prop_assert_eq!(out, vec![first, second]);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut buf = BytesMut::from(&data[..]);
            // Every Ok(Some) consumes bytes, so this loop ends.
            while let Ok(Some(_)) = take(&mut buf) {}
        }
    }
}
