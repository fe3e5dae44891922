//! Just enough RESP2 to pipeline commands to a redis-server: write a batch of commands,
//! then read one reply per command. Replies are bounded before anything is allocated for
//! them, so a misbehaving server costs an error, not memory.

use crate::limits::{REDIS_ARRAY_ITEMS_MAX, REDIS_BULK_BYTES_MAX};
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

pub struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

/// Socket buffers: large enough that a multi-megabyte pipelined commit streams.
const SOCKET_BUFFER_BYTES: usize = 1 << 20;
/// Arguments this long are written straight to the socket rather than copied first.
const DIRECT_WRITE_BYTES_MIN: usize = 64 << 10;
/// Longest status, error or integer line.
const LINE_BYTES_MAX: usize = 64 << 10;

impl Conn {
    pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<Conn> {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout.max(Duration::from_secs(30))))?;
        stream.set_write_timeout(Some(timeout.max(Duration::from_secs(30))))?;
        let reader = BufReader::with_capacity(SOCKET_BUFFER_BYTES, stream.try_clone()?);
        let writer = BufWriter::with_capacity(SOCKET_BUFFER_BYTES, stream);
        Ok(Conn { reader, writer })
    }

    /// Queues one command (not sent until [`Conn::finish`]).
    pub fn command(&mut self, args: &[&[u8]]) -> io::Result<()> {
        write!(self.writer, "*{}\r\n", args.len())?;
        for a in args {
            write!(self.writer, "${}\r\n", a.len())?;
            if a.len() >= DIRECT_WRITE_BYTES_MIN {
                self.writer.flush()?;
                self.writer.get_mut().write_all(a)?;
            } else {
                self.writer.write_all(a)?;
            }
            self.writer.write_all(b"\r\n")?;
        }
        Ok(())
    }

    /// Sends every queued command and reads `n` replies.
    pub fn finish(&mut self, n: usize) -> io::Result<Vec<Reply>> {
        self.writer.flush()?;
        (0..n).map(|_| read_reply(&mut self.reader, 0)).collect()
    }
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_owned())
}

fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = Vec::new();
    let n = r
        .by_ref()
        .take(LINE_BYTES_MAX as u64)
        .read_until(b'\n', &mut line)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "redis closed the connection",
        ));
    }
    if !line.ends_with(b"\r\n") {
        return Err(bad("reply line too long or unterminated"));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| bad("reply line is not UTF-8"))
}

/// Nesting deeper than this is not something our commands produce.
const ARRAY_DEPTH_MAX: usize = 4;

pub fn read_reply(r: &mut impl BufRead, depth: usize) -> io::Result<Reply> {
    let line = read_line(r)?;
    let (kind, rest) = line
        .split_at_checked(1)
        .ok_or_else(|| bad("empty reply line"))?;
    let int = |s: &str| s.parse::<i64>().map_err(|_| bad("bad integer in reply"));
    match kind {
        "+" => Ok(Reply::Status(rest.to_owned())),
        "-" => Ok(Reply::Error(rest.to_owned())),
        ":" => Ok(Reply::Int(int(rest)?)),
        "$" => {
            let n = int(rest)?;
            if n < 0 {
                return Ok(Reply::Bulk(None));
            }
            let n = usize::try_from(n).map_err(|_| bad("bulk length"))?;
            if n > REDIS_BULK_BYTES_MAX {
                return Err(bad("bulk reply larger than the limit"));
            }
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(bad("bulk reply not terminated"));
            }
            buf.truncate(n);
            Ok(Reply::Bulk(Some(buf)))
        }
        "*" => {
            let n = int(rest)?;
            if n < 0 {
                return Ok(Reply::Array(None));
            }
            let n = usize::try_from(n).map_err(|_| bad("array length"))?;
            if n > REDIS_ARRAY_ITEMS_MAX || depth >= ARRAY_DEPTH_MAX {
                return Err(bad("array reply larger or deeper than the limit"));
            }
            let items = (0..n)
                .map(|_| read_reply(r, depth + 1))
                .collect::<io::Result<Vec<_>>>()?;
            Ok(Reply::Array(Some(items)))
        }
        _ => Err(bad("unknown reply type")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_each_kind() {
        let text = b"+OK\r\n-ERR no\r\n:42\r\n$3\r\nabc\r\n$-1\r\n*2\r\n$1\r\nx\r\n$-1\r\n";
        let mut r = &text[..];
        let got: Vec<Reply> = (0..6)
            .map(|_| read_reply(&mut r, 0).expect("parses"))
            .collect();
        assert_eq!(
            got,
            vec![
                Reply::Status("OK".into()),
                Reply::Error("ERR no".into()),
                Reply::Int(42),
                Reply::Bulk(Some(b"abc".to_vec())),
                Reply::Bulk(None),
                Reply::Array(Some(vec![
                    Reply::Bulk(Some(b"x".to_vec())),
                    Reply::Bulk(None)
                ])),
            ]
        );
        assert!(read_reply(&mut &b"$99999999999\r\n"[..], 0).is_err());
        assert!(read_reply(&mut &b"*3\r\n:1\r\n"[..], 0).is_err());
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut r = &bytes[..];
            let _ = read_reply(&mut r, 0);
        }
    }
}
