//! A minimal memcached text-protocol client: `set`, `get`, `flush_all`. The reply parser
//! is pure and bounded (a hostile or broken server gets an error, not an allocation of
//! whatever size it claims), and has a fuzz target.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Largest value we accept back (memcached's item limit as we start it).
pub const VALUE_BYTES_MAX: usize = 32 << 20;
/// Longest reply line (`VALUE <key> <flags> <bytes>` with a 250-byte key fits easily).
pub const LINE_BYTES_MAX: usize = 1024;

/// One parsed `get` reply header line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GetLine {
    /// `VALUE <key> <flags> <bytes>`: that many bytes and CRLF follow.
    Value { bytes: usize },
    /// `END`: no (more) values.
    End,
}

/// Parses a line of a `get` reply (without its CRLF).
pub fn parse_get_line(line: &[u8]) -> Result<GetLine, String> {
    if line == b"END" {
        return Ok(GetLine::End);
    }
    let text = std::str::from_utf8(line).map_err(|_| "reply line is not UTF-8".to_string())?;
    let mut words = text.split(' ');
    match (
        words.next(),
        words.next(),
        words.next(),
        words.next(),
        words.next(),
    ) {
        (Some("VALUE"), Some(_key), Some(flags), Some(bytes), None | Some(_)) => {
            flags
                .parse::<u32>()
                .map_err(|_| format!("bad flags in {text:?}"))?;
            let bytes: usize = bytes
                .parse()
                .map_err(|_| format!("bad length in {text:?}"))?;
            if bytes > VALUE_BYTES_MAX {
                return Err(format!("value of {bytes} bytes exceeds {VALUE_BYTES_MAX}"));
            }
            Ok(GetLine::Value { bytes })
        }
        _ => Err(format!("unexpected reply {text:?}")),
    }
}

/// Reads one CRLF-terminated line, at most [`LINE_BYTES_MAX`] long.
pub fn read_line(r: &mut impl BufRead) -> Result<Vec<u8>, String> {
    let mut line = Vec::new();
    let n = r
        .take(LINE_BYTES_MAX as u64 + 2)
        .read_until(b'\n', &mut line)
        .map_err(|e| e.to_string())?;
    if n == 0 {
        return Err("connection closed".into());
    }
    if !line.ends_with(b"\r\n") {
        return Err("reply line too long or not CRLF-terminated".into());
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

/// Reads a whole `get` reply for one key.
pub fn read_get_reply(r: &mut impl BufRead) -> Result<Option<Vec<u8>>, String> {
    match parse_get_line(&read_line(r)?)? {
        GetLine::End => Ok(None),
        GetLine::Value { bytes } => {
            let mut value = vec![0u8; bytes + 2];
            r.read_exact(&mut value).map_err(|e| e.to_string())?;
            if !value.ends_with(b"\r\n") {
                return Err("value not followed by CRLF".into());
            }
            value.truncate(bytes);
            match parse_get_line(&read_line(r)?)? {
                GetLine::End => Ok(Some(value)),
                GetLine::Value { .. } => Err("more than one value for one key".into()),
            }
        }
    }
}

pub struct Memcached {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Memcached {
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Memcached, String> {
        let s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("{addr}: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        let writer = s.try_clone().map_err(|e| e.to_string())?;
        Ok(Memcached {
            reader: BufReader::with_capacity(64 << 10, s),
            writer,
        })
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), String> {
        let mut msg = Vec::with_capacity(key.len() + value.len() + 32);
        msg.extend_from_slice(format!("set {key} 0 0 {}\r\n", value.len()).as_bytes());
        msg.extend_from_slice(value);
        msg.extend_from_slice(b"\r\n");
        self.writer.write_all(&msg).map_err(|e| e.to_string())?;
        match read_line(&mut self.reader)?.as_slice() {
            b"STORED" => Ok(()),
            other => Err(format!("set: {}", String::from_utf8_lossy(other))),
        }
    }

    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, String> {
        self.writer
            .write_all(format!("get {key}\r\n").as_bytes())
            .map_err(|e| e.to_string())?;
        read_get_reply(&mut self.reader)
    }

    pub fn flush_all(&mut self) -> Result<(), String> {
        self.writer
            .write_all(b"flush_all\r\n")
            .map_err(|e| e.to_string())?;
        match read_line(&mut self.reader)?.as_slice() {
            b"OK" => Ok(()),
            other => Err(format!("flush_all: {}", String::from_utf8_lossy(other))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn replies_parse() {
        let mut r: &[u8] = b"VALUE k 0 5\r\nhello\r\nEND\r\n";
        assert_eq!(read_get_reply(&mut r).unwrap(), Some(b"hello".to_vec()));
        let mut r: &[u8] = b"END\r\n";
        assert_eq!(read_get_reply(&mut r).unwrap(), None);
        let mut r: &[u8] = b"VALUE k 0 99999999999\r\n";
        assert!(read_get_reply(&mut r).is_err());
        let mut r: &[u8] = b"SERVER_ERROR out of memory\r\n";
        assert!(read_get_reply(&mut r).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_replies_never_panic(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut r: &[u8] = &data;
            let _ = read_get_reply(&mut r);
        }
    }
}
