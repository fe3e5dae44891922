//! Replies in the protocol the connection chose with HELLO: RESP2 by default, RESP3 after
//! `HELLO 3`. Most replies are the same in both; nulls, maps, sets and doubles differ,
//! and handlers say which of those they mean so each protocol gets its own form.

use crate::resp::codec;
use bytes::BytesMut;

pub struct Reply<'a> {
    buf: &'a mut BytesMut,
    resp3: bool,
}

impl<'a> Reply<'a> {
    pub fn new(buf: &'a mut BytesMut, resp3: bool) -> Self {
        Reply { buf, resp3 }
    }

    /// The same buffer and protocol, borrowed for a shorter time (one command's call).
    pub fn reborrow(&mut self) -> Reply<'_> {
        Reply {
            buf: &mut *self.buf,
            resp3: self.resp3,
        }
    }

    pub fn is_resp3(&self) -> bool {
        self.resp3
    }

    /// HELLO switches protocols, its own reply already in the new one.
    pub fn set_resp3(&mut self, resp3: bool) {
        self.resp3 = resp3;
    }

    pub fn simple(&mut self, s: &str) {
        codec::simple(self.buf, s);
    }

    pub fn error(&mut self, msg: &str) {
        codec::error(self.buf, msg);
    }

    pub fn error_bytes(&mut self, msg: &[u8]) {
        codec::error_bytes(self.buf, msg);
    }

    pub fn integer(&mut self, n: i64) {
        codec::integer(self.buf, n);
    }

    pub fn bulk(&mut self, b: &[u8]) {
        codec::bulk(self.buf, b);
    }

    pub fn array_header(&mut self, n: usize) {
        codec::array_header(self.buf, n);
    }

    /// A missing value: `$-1` in RESP2, `_` in RESP3.
    pub fn null(&mut self) {
        if self.resp3 {
            self.buf.extend_from_slice(b"_\r\n");
        } else {
            codec::null_bulk(self.buf);
        }
    }

    /// A missing array (LPOP with a count on no key): `*-1` in RESP2, `_` in RESP3.
    pub fn null_array(&mut self) {
        if self.resp3 {
            self.buf.extend_from_slice(b"_\r\n");
        } else {
            self.buf.extend_from_slice(b"*-1\r\n");
        }
    }

    /// A map of `pairs` key-value pairs: a flat array of twice that in RESP2.
    pub fn map_header(&mut self, pairs: usize) {
        if self.resp3 {
            self.header(b'%', pairs);
        } else {
            self.array_header(2 * pairs);
        }
    }

    /// A set of `n` members: an array in RESP2.
    pub fn set_header(&mut self, n: usize) {
        if self.resp3 {
            self.header(b'~', n);
        } else {
            self.array_header(n);
        }
    }

    /// A double, printed as Redis 7.0 prints it: a bulk string in RESP2.
    pub fn double(&mut self, x: f64) {
        let text = codec::format_double(x);
        if self.resp3 {
            self.buf.extend_from_slice(b",");
            self.buf.extend_from_slice(text.as_bytes());
            self.buf.extend_from_slice(b"\r\n");
        } else {
            self.bulk(text.as_bytes());
        }
    }

    fn header(&mut self, kind: u8, n: usize) {
        self.buf.extend_from_slice(&[kind]);
        self.buf.extend_from_slice(n.to_string().as_bytes());
        self.buf.extend_from_slice(b"\r\n");
    }
}
