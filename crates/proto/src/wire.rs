//! Byte layout. All integers little-endian.
//!
//! ```text
//! frame     := len:u32 body                       (len = body bytes, 1..=FRAME_BYTES_MAX)
//! body      := kind:u8 payload
//! HELLO     := kind=1 magic:[4] version:u16 token_len:u8 token [principal_len:u8 principal]
//!              (a missing principal, as version 1 clients send, decodes as empty, so
//!              such a client is told VERSION_MISMATCH rather than "bad frame")
//! HELLO_OK  := kind=2 version:u16 epoch:u64
//! REQUESTS  := kind=3 epoch:u64 count:u16 request*
//! RESPONSES := kind=4 count:u16 response*
//! FATAL     := kind=5 code:u16 error
//! request   := id:u64 op:u8 fields            (fields per op, see `encode_op`)
//! response  := id:u64 status:u16 (status=0: tag:u8 reply | status>0: error)
//! error     := msg_len:u16 msg [epoch:u64]    (epoch only for STALE_EPOCH and MOVED:
//!              the epoch of the server's map; servers send these codes only to
//!              clients that routed with an epoch, never to epoch-0 clients)
//! ```

use crate::limits::*;
use crate::*;
use bytes::{Buf, BufMut, Bytes, BytesMut};

const KIND_HELLO: u8 = 1;
const KIND_HELLO_OK: u8 = 2;
const KIND_REQUESTS: u8 = 3;
const KIND_RESPONSES: u8 = 4;
const KIND_FATAL: u8 = 5;

const TAG_PONG: u8 = 1;
const TAG_STATS: u8 = 2;
const TAG_LIST: u8 = 3;
const TAG_REGION: u8 = 4;
const TAG_DONE: u8 = 5;
const TAG_DATA: u8 = 6;
const TAG_WORD: u8 = 7;
const TAG_OBJECT: u8 = 8;
const TAG_VERSION: u8 = 9;
const TAG_ITEMS: u8 = 10;
const TAG_PAGE: u8 = 11;

/// Bytes before the first request in a REQUESTS frame, including the length prefix.
pub const REQUESTS_HEADER_BYTES: usize = 4 + 1 + 8 + 2;
/// Bytes before the first response in a RESPONSES frame, including the length prefix.
pub const RESPONSES_HEADER_BYTES: usize = 4 + 1 + 2;
/// Largest encoded error response.
pub const ERROR_RESPONSE_BYTES_MAX: usize = 8 + 2 + 2 + MESSAGE_BYTES_MAX + 8;
/// Bytes of a response frame a server may fill with successful replies while still being
/// able to answer every remaining request of a full batch with an error.
pub const RESPONSE_OK_BUDGET_BYTES: usize =
    FRAME_BYTES_MAX - BATCH_OPS_MAX * ERROR_RESPONSE_BYTES_MAX;

const REGION_INFO_BYTES_MAX: usize = 8 + 8 + 1 + 1 + NAME_BYTES_MAX;
/// The largest HELLO body: what a server may accept before the handshake.
pub const HELLO_BODY_BYTES_MAX: usize =
    1 + 4 + 2 + 1 + TOKEN_BYTES_MAX + 1 + PRINCIPAL_BYTES_MAX + 8;
const STATS_REPLY_BYTES_MAX: usize = 2 + STATS_ENTRIES_MAX * (1 + STAT_NAME_BYTES_MAX + 8);
const LIST_REPLY_BYTES_MAX: usize = 4 + LIST_ENTRIES_MAX * REGION_INFO_BYTES_MAX;
/// A key on the wire: `len:u16 bytes`.
const KEY_HEADER_BYTES: usize = 2;
/// A value on the wire: `len:u32 bytes`.
const VALUE_HEADER_BYTES: usize = 4;
/// Bytes of one SCAN item besides its key and value bytes.
pub const ITEM_OVERHEAD_BYTES: usize = KEY_HEADER_BYTES + 8 + VALUE_HEADER_BYTES;

pub(crate) fn request_encoded_len(op: &Op) -> usize {
    8 + 1
        + match op {
            Op::Ping | Op::Stats | Op::List | Op::Fence => 0,
            Op::Alloc { name, .. } => 8 + 1 + name.as_ref().map_or(0, |n| n.len()) + 1,
            Op::Lookup { name } => 1 + name.len(),
            Op::Free { .. } => 8,
            Op::Read { .. } => 8 + 8 + 4,
            Op::Write { data, .. } | Op::Swap { data, .. } | Op::XorInto { data, .. } => {
                8 + 8 + 4 + data.len()
            }
            Op::WriteIf { data, .. } => 8 * 5 + 4 + data.len(),
            Op::Cas { .. } => 8 * 4,
            Op::FetchAdd { .. } => 8 * 3,
            Op::Get { key } | Op::Delete { key } => KEY_HEADER_BYTES + key.len(),
            Op::Put { key, value } => {
                KEY_HEADER_BYTES + key.len() + VALUE_HEADER_BYTES + value.len()
            }
            Op::CasPut { key, value, .. } => {
                KEY_HEADER_BYTES + key.len() + 8 + VALUE_HEADER_BYTES + value.len()
            }
            Op::Scan { start, .. } => KEY_HEADER_BYTES + start.len() + 4,
            Op::ScanPartitions { after, mask, .. } => {
                1 + after.as_ref().map_or(0, |k| KEY_HEADER_BYTES + k.len())
                    + 4
                    + 4
                    + mask.len()
                    + 8
                    + 1
                    + 1
                    + 4
            }
            Op::Apply { key, value, .. } => {
                KEY_HEADER_BYTES
                    + key.len()
                    + 8
                    + 1
                    + value.as_ref().map_or(0, |v| VALUE_HEADER_BYTES + v.len())
            }
        }
}

pub(crate) fn reply_len_max(op: &Op) -> usize {
    let ok = 8
        + 2
        + 1
        + match op {
            Op::Ping => 0,
            Op::Stats => STATS_REPLY_BYTES_MAX,
            Op::List => LIST_REPLY_BYTES_MAX,
            Op::Alloc { .. } | Op::Lookup { .. } => REGION_INFO_BYTES_MAX,
            Op::Free { .. } | Op::Write { .. } => 0,
            Op::Read { len, .. } => 4 + *len as usize,
            Op::Swap { data, .. } => 4 + data.len(),
            Op::XorInto { .. } => 0,
            Op::Cas { .. } | Op::FetchAdd { .. } | Op::WriteIf { .. } | Op::Fence => 8,
            Op::Get { .. } => 8 + VALUE_HEADER_BYTES + VALUE_BYTES_MAX,
            Op::Put { .. } | Op::CasPut { .. } | Op::Delete { .. } | Op::Apply { .. } => 8,
            // A scan fills at most what is left of the frame; the frame limit bounds it.
            Op::Scan { .. } | Op::ScanPartitions { .. } => RESPONSE_OK_BUDGET_BYTES,
        };
    ok.max(ERROR_RESPONSE_BYTES_MAX)
}

fn limit(what: &'static str, value: usize, max: usize) -> Result<(), EncodeError> {
    if value > max {
        return Err(EncodeError::LimitExceeded {
            what,
            value: value as u64,
            max: max as u64,
        });
    }
    Ok(())
}

fn put_short_str(buf: &mut BytesMut, s: &str, what: &'static str) -> Result<(), EncodeError> {
    limit(what, s.len(), 255)?;
    buf.put_u8(s.len() as u8);
    buf.put_slice(s.as_bytes());
    Ok(())
}

fn put_key(buf: &mut BytesMut, key: &[u8], what: &'static str) -> Result<(), EncodeError> {
    limit(what, key.len(), KEY_BYTES_MAX)?;
    buf.put_u16_le(key.len() as u16);
    buf.put_slice(key);
    Ok(())
}

/// `present:u8 [key]`.
fn put_opt_key(
    buf: &mut BytesMut,
    key: Option<&[u8]>,
    what: &'static str,
) -> Result<(), EncodeError> {
    match key {
        None => buf.put_u8(0),
        Some(k) => {
            limit(what, k.len(), KEY_BYTES_MAX)?;
            buf.put_u8(1);
            put_key(buf, k, what)?;
        }
    }
    Ok(())
}

/// Checked before writing anything, so a failure leaves no partial reply.
fn check_items(items: &[Item]) -> Result<(), EncodeError> {
    limit("scan items", items.len(), SCAN_ITEMS_MAX)?;
    for it in items {
        limit("key", it.key.len(), KEY_BYTES_MAX)?;
        limit("value", it.value.len(), VALUE_BYTES_MAX)?;
    }
    Ok(())
}

/// `count:u32 (key version:u64 value)*`; [`check_items`] first.
fn put_items(buf: &mut BytesMut, items: &[Item]) -> Result<(), EncodeError> {
    buf.put_u32_le(items.len() as u32);
    for it in items {
        put_key(buf, &it.key, "key")?;
        buf.put_u64_le(it.version);
        put_value(buf, &it.value)?;
    }
    Ok(())
}

fn put_value(buf: &mut BytesMut, value: &[u8]) -> Result<(), EncodeError> {
    limit("value", value.len(), VALUE_BYTES_MAX)?;
    buf.put_u32_le(value.len() as u32);
    buf.put_slice(value);
    Ok(())
}

/// Where a request's WRITE data or PUT value goes: copied into the frame buffer, or, when
/// it is at least `min_bytes` long and the caller collects them, left out of the buffer
/// and recorded as (offset in the buffer where it belongs, payload).
struct Payloads<'a> {
    deferred: Option<(&'a mut Vec<(usize, Bytes)>, usize)>,
}

impl Payloads<'_> {
    fn put(&mut self, buf: &mut BytesMut, data: &Bytes) {
        match &mut self.deferred {
            Some((out, min_bytes)) if data.len() >= *min_bytes => {
                out.push((buf.len(), data.clone()));
            }
            _ => buf.put_slice(data),
        }
    }
}

fn encode_op(buf: &mut BytesMut, op: &Op, payloads: &mut Payloads<'_>) -> Result<(), EncodeError> {
    buf.put_u8(op.kind() as u8);
    match op {
        Op::Ping | Op::Stats | Op::List | Op::Fence => {}
        Op::Alloc { size, name, mode } => {
            buf.put_u64_le(*size);
            match name {
                Some(n) => {
                    limit("region name", n.len(), NAME_BYTES_MAX)?;
                    if n.is_empty() {
                        return Err(EncodeError::LimitExceeded {
                            what: "empty region name",
                            value: 0,
                            max: 0,
                        });
                    }
                    put_short_str(buf, n, "region name")?;
                }
                None => buf.put_u8(0),
            }
            buf.put_u8(*mode as u8);
        }
        Op::Lookup { name } => {
            limit("region name", name.len(), NAME_BYTES_MAX)?;
            put_short_str(buf, name, "region name")?;
        }
        Op::Free { region } => buf.put_u64_le(*region),
        Op::Read {
            region,
            offset,
            len,
        } => {
            limit("read length", *len as usize, IO_BYTES_MAX)?;
            buf.put_u64_le(*region);
            buf.put_u64_le(*offset);
            buf.put_u32_le(*len);
        }
        Op::Write {
            region,
            offset,
            data,
        }
        | Op::Swap {
            region,
            offset,
            data,
        }
        | Op::XorInto {
            region,
            offset,
            data,
        } => {
            limit("write length", data.len(), IO_BYTES_MAX)?;
            buf.put_u64_le(*region);
            buf.put_u64_le(*offset);
            buf.put_u32_le(data.len() as u32);
            payloads.put(buf, data);
        }
        Op::WriteIf {
            region,
            offset,
            guard_region,
            guard_offset,
            expected,
            data,
        } => {
            limit("write length", data.len(), IO_BYTES_MAX)?;
            buf.put_u64_le(*region);
            buf.put_u64_le(*offset);
            buf.put_u64_le(*guard_region);
            buf.put_u64_le(*guard_offset);
            buf.put_u64_le(*expected);
            buf.put_u32_le(data.len() as u32);
            payloads.put(buf, data);
        }
        Op::Cas {
            region,
            offset,
            expected,
            new,
        } => {
            buf.put_u64_le(*region);
            buf.put_u64_le(*offset);
            buf.put_u64_le(*expected);
            buf.put_u64_le(*new);
        }
        Op::FetchAdd {
            region,
            offset,
            delta,
        } => {
            buf.put_u64_le(*region);
            buf.put_u64_le(*offset);
            buf.put_u64_le(*delta);
        }
        Op::Get { key } | Op::Delete { key } => put_key(buf, key, "key")?,
        Op::Put { key, value } => {
            put_key(buf, key, "key")?;
            limit("value", value.len(), VALUE_BYTES_MAX)?;
            buf.put_u32_le(value.len() as u32);
            payloads.put(buf, value);
        }
        Op::CasPut {
            key,
            expected_version,
            value,
        } => {
            put_key(buf, key, "key")?;
            buf.put_u64_le(*expected_version);
            limit("value", value.len(), VALUE_BYTES_MAX)?;
            buf.put_u32_le(value.len() as u32);
            payloads.put(buf, value);
        }
        Op::Scan { start, limit: n } => {
            limit("scan limit", *n as usize, SCAN_ITEMS_MAX)?;
            put_key(buf, start, "scan start key")?;
            buf.put_u32_le(*n);
        }
        Op::ScanPartitions {
            after,
            limit: n,
            partitions,
            mask,
            since_version,
            keys_only,
            push_to,
        } => {
            limit("scan limit", *n as usize, SCAN_ITEMS_MAX)?;
            limit(
                "scan partitions",
                *partitions as usize,
                SCAN_PARTITIONS_MAX as usize,
            )?;
            if mask.len() != partition_mask_len(*partitions) {
                return Err(EncodeError::LimitExceeded {
                    what: "scan mask bytes (must be a bit per partition)",
                    value: mask.len() as u64,
                    max: partition_mask_len(*partitions) as u64,
                });
            }
            put_opt_key(buf, after.as_deref(), "scan resume key")?;
            buf.put_u32_le(*n);
            buf.put_u32_le(*partitions);
            buf.put_slice(mask);
            buf.put_u64_le(*since_version);
            buf.put_u8(u8::from(*keys_only));
            // Fixed width, so `request_encoded_len` needs no case for it.
            buf.put_u8(u8::from(push_to.is_some()));
            buf.put_u32_le(push_to.unwrap_or(0));
        }
        Op::Apply {
            key,
            version,
            value,
        } => {
            put_key(buf, key, "key")?;
            buf.put_u64_le(*version);
            match value {
                None => buf.put_u8(0),
                Some(value) => {
                    buf.put_u8(1);
                    limit("value", value.len(), VALUE_BYTES_MAX)?;
                    buf.put_u32_le(value.len() as u32);
                    payloads.put(buf, value);
                }
            }
        }
    }
    Ok(())
}

fn encode_region_info(buf: &mut BytesMut, r: &RegionInfo) -> Result<(), EncodeError> {
    buf.put_u64_le(r.id);
    buf.put_u64_le(r.size);
    buf.put_u8(r.mode as u8);
    match &r.name {
        Some(n) => put_short_str(buf, n, "region name")?,
        None => buf.put_u8(0),
    }
    Ok(())
}

fn encode_reply(buf: &mut BytesMut, reply: &Reply) -> Result<(), EncodeError> {
    match reply {
        Reply::Pong => buf.put_u8(TAG_PONG),
        Reply::Stats(entries) => {
            limit("stats entries", entries.len(), STATS_ENTRIES_MAX)?;
            buf.put_u8(TAG_STATS);
            buf.put_u16_le(entries.len() as u16);
            for (name, value) in entries {
                limit("stat name", name.len(), STAT_NAME_BYTES_MAX)?;
                put_short_str(buf, name, "stat name")?;
                buf.put_u64_le(*value);
            }
        }
        Reply::List(regions) => {
            limit("list entries", regions.len(), LIST_ENTRIES_MAX)?;
            buf.put_u8(TAG_LIST);
            buf.put_u32_le(regions.len() as u32);
            for r in regions {
                encode_region_info(buf, r)?;
            }
        }
        Reply::Region(r) => {
            buf.put_u8(TAG_REGION);
            encode_region_info(buf, r)?;
        }
        Reply::Done => buf.put_u8(TAG_DONE),
        Reply::Data(d) => {
            limit("read data", d.len(), IO_BYTES_MAX)?;
            buf.put_u8(TAG_DATA);
            buf.put_u32_le(d.len() as u32);
            buf.put_slice(d);
        }
        Reply::Word(w) => {
            buf.put_u8(TAG_WORD);
            buf.put_u64_le(*w);
        }
        Reply::Object { version, value } => {
            limit("value", value.len(), VALUE_BYTES_MAX)?;
            buf.put_u8(TAG_OBJECT);
            buf.put_u64_le(*version);
            put_value(buf, value)?;
        }
        Reply::Version(v) => {
            buf.put_u8(TAG_VERSION);
            buf.put_u64_le(*v);
        }
        Reply::Items(items) => {
            check_items(items)?;
            buf.put_u8(TAG_ITEMS);
            put_items(buf, items)?;
        }
        Reply::Page(page) => {
            check_items(&page.items)?;
            if let Some(k) = &page.resume_after {
                limit("scan resume key", k.len(), KEY_BYTES_MAX)?;
            }
            buf.put_u8(TAG_PAGE);
            buf.put_u64_le(page.version_clock);
            buf.put_u64_le(page.pushed_bytes);
            put_opt_key(buf, page.resume_after.as_deref(), "scan resume key")?;
            put_items(buf, &page.items)?;
        }
    }
    Ok(())
}

fn encode_error(buf: &mut BytesMut, code: ErrorCode, e: &ErrorReply) {
    // ErrorReply::new already truncates; a hand-built one is cut here, on a char boundary.
    let mut cut = e.message.len().min(MESSAGE_BYTES_MAX);
    while !e.message.is_char_boundary(cut) {
        cut -= 1;
    }
    buf.put_u16_le(e.message[..cut].len() as u16);
    buf.put_slice(&e.message.as_bytes()[..cut]);
    if code.carries_epoch() {
        buf.put_u64_le(e.epoch);
    }
}

/// Starts a frame at the buffer's end; returns where its length prefix sits.
fn begin_frame(buf: &mut BytesMut, kind: u8) -> usize {
    let start = buf.len();
    buf.put_u32_le(0);
    buf.put_u8(kind);
    start
}

fn end_frame(buf: &mut BytesMut, start: usize) -> Result<(), EncodeError> {
    end_frame_with(buf, start, 0)
}

/// `outside_bytes`: payload bytes that belong to the frame but are sent from elsewhere.
fn end_frame_with(
    buf: &mut BytesMut,
    start: usize,
    outside_bytes: usize,
) -> Result<(), EncodeError> {
    let body = buf.len() - start - 4 + outside_bytes;
    if let Err(e) = limit("frame bytes", body, FRAME_BYTES_MAX) {
        buf.truncate(start);
        return Err(e);
    }
    buf[start..start + 4].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(())
}

/// Appends one whole frame (length prefix included) to `buf`. On error `buf` is left as
/// it was.
pub fn encode_frame(frame: &Frame, buf: &mut BytesMut) -> Result<(), EncodeError> {
    let start = buf.len();
    let res = (|| match frame {
        Frame::Hello(h) => {
            limit("token", h.token.len(), TOKEN_BYTES_MAX)?;
            limit("principal", h.principal.len(), PRINCIPAL_BYTES_MAX)?;
            begin_frame(buf, KIND_HELLO);
            buf.put_slice(&HELLO_MAGIC);
            buf.put_u16_le(h.version);
            buf.put_u8(h.token.len() as u8);
            buf.put_slice(&h.token);
            put_short_str(buf, &h.principal, "principal")?;
            if let Some(g) = h.fence {
                buf.put_u64_le(g);
            }
            end_frame(buf, start)
        }
        Frame::HelloOk(h) => {
            begin_frame(buf, KIND_HELLO_OK);
            buf.put_u16_le(h.version);
            buf.put_u64_le(h.epoch);
            buf.put_u64_le(h.fence_generation);
            end_frame(buf, start)
        }
        Frame::Requests(batch) => {
            let mut enc = RequestBatchEncoder::begin(buf, batch.epoch);
            for r in &batch.requests {
                enc.push(r.id, &r.op)?;
            }
            enc.finish()
        }
        Frame::Responses(batch) => {
            let mut enc = ResponseBatchEncoder::begin(buf);
            for r in &batch.responses {
                match &r.result {
                    Ok(reply) => enc.push_ok(r.id, reply)?,
                    Err(e) => enc.push_err(r.id, e)?,
                }
            }
            enc.finish()
        }
        Frame::Fatal(e) => {
            begin_frame(buf, KIND_FATAL);
            buf.put_u16_le(e.code.to_u16());
            encode_error(buf, e.code, e);
            end_frame(buf, start)
        }
    })();
    if res.is_err() {
        buf.truncate(start);
    }
    res
}

/// Builds a REQUESTS frame in place, one request at a time, so a batcher never holds a
/// `Vec<Request>` copy of what it sends.
pub struct RequestBatchEncoder<'a> {
    buf: &'a mut BytesMut,
    start: usize,
    count: usize,
    /// Payload bytes left out of `buf` by [`Self::push_deferring`].
    deferred_bytes: usize,
}

impl<'a> RequestBatchEncoder<'a> {
    pub fn begin(buf: &'a mut BytesMut, epoch: u64) -> Self {
        let start = begin_frame(buf, KIND_REQUESTS);
        buf.put_u64_le(epoch);
        buf.put_u16_le(0);
        RequestBatchEncoder {
            buf,
            start,
            count: 0,
            deferred_bytes: 0,
        }
    }

    /// Appends a request. On error nothing is appended.
    pub fn push(&mut self, id: u64, op: &Op) -> Result<(), EncodeError> {
        self.push_with(id, op, &mut Payloads { deferred: None })
    }

    /// Appends a request, except that a WRITE data or PUT/CAS_PUT value of at least
    /// `min_bytes` is not copied into the buffer: it is pushed onto `deferred` with the
    /// buffer offset where it belongs, and the frame's length counts it. The frame on the
    /// wire is then the buffer with each deferred payload inserted at its offset (in
    /// order), so a caller can send big payloads with a vectored write instead of copying
    /// them. On error nothing is appended to either.
    pub fn push_deferring(
        &mut self,
        id: u64,
        op: &Op,
        min_bytes: usize,
        deferred: &mut Vec<(usize, Bytes)>,
    ) -> Result<(), EncodeError> {
        let before = deferred.len();
        let res = self.push_with(
            id,
            op,
            &mut Payloads {
                deferred: Some((&mut *deferred, min_bytes)),
            },
        );
        match res {
            Ok(()) => {
                self.deferred_bytes += deferred[before..]
                    .iter()
                    .map(|(_, d)| d.len())
                    .sum::<usize>();
            }
            Err(_) => deferred.truncate(before),
        }
        res
    }

    fn push_with(
        &mut self,
        id: u64,
        op: &Op,
        payloads: &mut Payloads<'_>,
    ) -> Result<(), EncodeError> {
        limit("requests per batch", self.count + 1, BATCH_OPS_MAX)?;
        let at = self.buf.len();
        self.buf.put_u64_le(id);
        if let Err(e) = encode_op(self.buf, op, payloads) {
            self.buf.truncate(at);
            return Err(e);
        }
        self.count += 1;
        Ok(())
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// Frame bytes so far, length prefix and deferred payloads included.
    pub fn frame_len(&self) -> usize {
        self.buf.len() - self.start + self.deferred_bytes
    }

    /// Patches the length and count. On error the frame is removed from the buffer (the
    /// caller drops what it deferred).
    pub fn finish(self) -> Result<(), EncodeError> {
        let count_at = self.start + 4 + 1 + 8;
        self.buf[count_at..count_at + 2].copy_from_slice(&(self.count as u16).to_le_bytes());
        end_frame_with(self.buf, self.start, self.deferred_bytes)
    }
}

/// id, status, tag and length: what a READ reply carries before its bytes.
const DATA_REPLY_PREFIX_BYTES: usize = 8 + 2 + 1 + 4;

/// Builds a RESPONSES frame in place; READ data is copied straight from server memory into
/// the frame with [`ResponseBatchEncoder::push_data`] (or [`ResponseBatchEncoder::push_data_with`]
/// when the bytes are produced in place).
pub struct ResponseBatchEncoder<'a> {
    buf: &'a mut BytesMut,
    start: usize,
    count: usize,
}

impl<'a> ResponseBatchEncoder<'a> {
    pub fn begin(buf: &'a mut BytesMut) -> Self {
        let start = begin_frame(buf, KIND_RESPONSES);
        buf.put_u16_le(0);
        ResponseBatchEncoder {
            buf,
            start,
            count: 0,
        }
    }

    fn check_count(&self) -> Result<(), EncodeError> {
        limit("responses per batch", self.count + 1, BATCH_OPS_MAX)
    }

    pub fn push_ok(&mut self, id: u64, reply: &Reply) -> Result<(), EncodeError> {
        self.check_count()?;
        let at = self.buf.len();
        self.buf.put_u64_le(id);
        self.buf.put_u16_le(0);
        if let Err(e) = encode_reply(self.buf, reply) {
            self.buf.truncate(at);
            return Err(e);
        }
        self.count += 1;
        Ok(())
    }

    /// Appends a READ reply of `len` bytes, letting `fill` write the data in place.
    pub fn push_data_with(
        &mut self,
        id: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), EncodeError> {
        self.check_count()?;
        limit("read data", len, IO_BYTES_MAX)?;
        self.buf.put_u64_le(id);
        self.buf.put_u16_le(0);
        self.buf.put_u8(TAG_DATA);
        self.buf.put_u32_le(len as u32);
        let at = self.buf.len();
        self.buf.resize(at + len, 0);
        fill(&mut self.buf[at..at + len]);
        self.count += 1;
        Ok(())
    }

    /// Appends a READ reply whose bytes are `data`, copied once into the frame: unlike
    /// [`ResponseBatchEncoder::push_data_with`], the room is not zero-filled first (a
    /// memory server answering 1 GB/s of READs spent a pass over every byte on that).
    pub fn push_data(&mut self, id: u64, data: &[u8]) -> Result<(), EncodeError> {
        self.check_count()?;
        limit("read data", data.len(), IO_BYTES_MAX)?;
        self.buf.reserve(DATA_REPLY_PREFIX_BYTES + data.len());
        self.buf.put_u64_le(id);
        self.buf.put_u16_le(0);
        self.buf.put_u8(TAG_DATA);
        self.buf.put_u32_le(data.len() as u32);
        self.buf.put_slice(data);
        self.count += 1;
        Ok(())
    }

    /// Appends a GET reply straight from the stored bytes (no `Reply` built first).
    pub fn push_object(&mut self, id: u64, version: u64, value: &[u8]) -> Result<(), EncodeError> {
        self.check_count()?;
        limit("value", value.len(), VALUE_BYTES_MAX)?;
        self.buf.put_u64_le(id);
        self.buf.put_u16_le(0);
        self.buf.put_u8(TAG_OBJECT);
        self.buf.put_u64_le(version);
        self.buf.put_u32_le(value.len() as u32);
        self.buf.put_slice(value);
        self.count += 1;
        Ok(())
    }

    pub fn push_err(&mut self, id: u64, err: &ErrorReply) -> Result<(), EncodeError> {
        self.check_count()?;
        self.buf.put_u64_le(id);
        let code = match err.code.to_u16() {
            0 => ErrorCode::Internal.to_u16(),
            c => c,
        };
        self.buf.put_u16_le(code);
        encode_error(self.buf, ErrorCode::from_u16(code), err);
        self.count += 1;
        Ok(())
    }

    /// Frame bytes so far, length prefix included.
    pub fn frame_len(&self) -> usize {
        self.buf.len() - self.start
    }

    pub fn count(&self) -> usize {
        self.count
    }

    pub fn finish(self) -> Result<(), EncodeError> {
        let count_at = self.start + 4 + 1;
        self.buf[count_at..count_at + 2].copy_from_slice(&(self.count as u16).to_le_bytes());
        end_frame(self.buf, self.start)
    }
}

/// Splits complete frames off the front of a receive buffer.
pub struct FrameDecoder;

impl FrameDecoder {
    /// Returns the next complete frame body (without its length prefix), `None` when more
    /// bytes are needed, or an error when the length prefix is out of bounds. On `None` the
    /// buffer has reserved room for the rest of the frame.
    pub fn split_frame(buf: &mut BytesMut) -> Result<Option<Bytes>, DecodeError> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        Self::check_len(len)?;
        if buf.len() < 4 + len {
            buf.reserve(4 + len - buf.len());
            return Ok(None);
        }
        let mut frame = buf.split_to(4 + len);
        frame.advance(4);
        Ok(Some(frame.freeze()))
    }

    /// After a frame of `frame_bytes` was split off `buf`: if it was larger than
    /// `keep_bytes`, moves the rest to a fresh buffer. The rest still shares the frame's
    /// allocation (its view's capacity shows only the tail), and once the frame is gone
    /// a reserve would take the whole of it back, so a connection would keep its largest
    /// frame's size for as long as it lives.
    pub fn let_go_of_large(buf: &mut BytesMut, frame_bytes: usize, keep_bytes: usize) {
        if frame_bytes > keep_bytes {
            *buf = BytesMut::from(&buf[..]);
        }
    }

    /// Validates a body length read from a length prefix.
    pub fn check_len(len: usize) -> Result<(), DecodeError> {
        if len == 0 {
            return Err(DecodeError::EmptyFrame);
        }
        if len > FRAME_BYTES_MAX {
            return Err(DecodeError::FrameTooLarge {
                len,
                max: FRAME_BYTES_MAX,
            });
        }
        Ok(())
    }
}

struct Cursor {
    buf: Bytes,
}

impl Cursor {
    fn need(&self, n: usize) -> Result<(), DecodeError> {
        if self.buf.remaining() < n {
            return Err(DecodeError::Truncated {
                needed: n - self.buf.remaining(),
            });
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        self.need(1)?;
        Ok(self.buf.get_u8())
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.need(2)?;
        Ok(self.buf.get_u16_le())
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.need(4)?;
        Ok(self.buf.get_u32_le())
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.need(8)?;
        Ok(self.buf.get_u64_le())
    }
    fn bytes(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        self.need(n)?;
        Ok(self.buf.split_to(n))
    }
    fn string(&mut self, n: usize, what: &'static str) -> Result<String, DecodeError> {
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::BadUtf8(what))
    }
    fn opt_key(&mut self, what: &'static str) -> Result<Option<Bytes>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.key(what)?)),
            _ => Err(DecodeError::Invalid("key presence flag")),
        }
    }
    fn key(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        let n = self.u16()? as usize;
        check_limit(what, n as u64, KEY_BYTES_MAX as u64)?;
        self.bytes(n)
    }
    fn value(&mut self) -> Result<Bytes, DecodeError> {
        let n = self.u32()? as usize;
        check_limit("value", n as u64, VALUE_BYTES_MAX as u64)?;
        self.bytes(n)
    }
    fn mode(&mut self) -> Result<AccessMode, DecodeError> {
        AccessMode::from_u8(self.u8()?).ok_or(DecodeError::Invalid("access mode"))
    }
    fn short_str(&mut self, what: &'static str, max: usize) -> Result<String, DecodeError> {
        let n = self.u8()? as usize;
        check_limit(what, n as u64, max as u64)?;
        self.string(n, what)
    }
    fn count(
        &mut self,
        n: usize,
        what: &'static str,
        max: usize,
        min_item_bytes: usize,
    ) -> Result<usize, DecodeError> {
        check_limit(what, n as u64, max as u64)?;
        // A count the remaining bytes cannot possibly hold is caught before any allocation.
        self.need(n.saturating_mul(min_item_bytes))?;
        Ok(n)
    }
    fn finish(self) -> Result<(), DecodeError> {
        if self.buf.has_remaining() {
            return Err(DecodeError::TrailingBytes(self.buf.remaining()));
        }
        Ok(())
    }
}

fn check_limit(what: &'static str, value: u64, max: u64) -> Result<(), DecodeError> {
    if value > max {
        return Err(DecodeError::LimitExceeded { what, value, max });
    }
    Ok(())
}

fn decode_op(c: &mut Cursor) -> Result<Op, DecodeError> {
    let code = c.u8()?;
    let kind = OpKind::from_u8(code).ok_or(DecodeError::UnknownOp(code))?;
    Ok(match kind {
        OpKind::Ping => Op::Ping,
        OpKind::Fence => Op::Fence,
        OpKind::Stats => Op::Stats,
        OpKind::List => Op::List,
        OpKind::Alloc => {
            let size = c.u64()?;
            check_limit("region size", size, REGION_BYTES_MAX)?;
            let n = c.u8()? as usize;
            let name = if n == 0 {
                None
            } else {
                Some(c.string(n, "region name")?)
            };
            let mode = c.mode()?;
            Op::Alloc { size, name, mode }
        }
        OpKind::Lookup => {
            let name = c.short_str("region name", NAME_BYTES_MAX)?;
            if name.is_empty() {
                return Err(DecodeError::Invalid("empty region name"));
            }
            Op::Lookup { name }
        }
        OpKind::Free => Op::Free { region: c.u64()? },
        OpKind::Read => {
            let region = c.u64()?;
            let offset = c.u64()?;
            let len = c.u32()?;
            check_limit("read length", len as u64, IO_BYTES_MAX as u64)?;
            Op::Read {
                region,
                offset,
                len,
            }
        }
        OpKind::Write | OpKind::Swap | OpKind::XorInto => {
            let region = c.u64()?;
            let offset = c.u64()?;
            let len = c.u32()? as usize;
            check_limit("write length", len as u64, IO_BYTES_MAX as u64)?;
            let data = c.bytes(len)?;
            match kind {
                OpKind::Swap => Op::Swap {
                    region,
                    offset,
                    data,
                },
                OpKind::XorInto => Op::XorInto {
                    region,
                    offset,
                    data,
                },
                _ => Op::Write {
                    region,
                    offset,
                    data,
                },
            }
        }
        OpKind::WriteIf => {
            let region = c.u64()?;
            let offset = c.u64()?;
            let guard_region = c.u64()?;
            let guard_offset = c.u64()?;
            let expected = c.u64()?;
            let len = c.u32()? as usize;
            check_limit("write length", len as u64, IO_BYTES_MAX as u64)?;
            Op::WriteIf {
                region,
                offset,
                guard_region,
                guard_offset,
                expected,
                data: c.bytes(len)?,
            }
        }
        OpKind::Cas => Op::Cas {
            region: c.u64()?,
            offset: c.u64()?,
            expected: c.u64()?,
            new: c.u64()?,
        },
        OpKind::FetchAdd => Op::FetchAdd {
            region: c.u64()?,
            offset: c.u64()?,
            delta: c.u64()?,
        },
        OpKind::Get => Op::Get { key: c.key("key")? },
        OpKind::Delete => Op::Delete { key: c.key("key")? },
        OpKind::Put => Op::Put {
            key: c.key("key")?,
            value: c.value()?,
        },
        OpKind::CasPut => Op::CasPut {
            key: c.key("key")?,
            expected_version: c.u64()?,
            value: c.value()?,
        },
        OpKind::Scan => {
            let start = c.key("scan start key")?;
            let limit = c.u32()?;
            check_limit("scan limit", limit as u64, SCAN_ITEMS_MAX as u64)?;
            Op::Scan { start, limit }
        }
        OpKind::ScanPartitions => {
            let after = c.opt_key("scan resume key")?;
            let limit = c.u32()?;
            check_limit("scan limit", limit as u64, SCAN_ITEMS_MAX as u64)?;
            let partitions = c.u32()?;
            check_limit(
                "scan partitions",
                partitions as u64,
                SCAN_PARTITIONS_MAX as u64,
            )?;
            let mask = c.bytes(partition_mask_len(partitions))?;
            let since_version = c.u64()?;
            let keys_only = match c.u8()? {
                0 => false,
                1 => true,
                _ => return Err(DecodeError::Invalid("scan keys-only flag")),
            };
            let push_to = match (c.u8()?, c.u32()?) {
                (0, 0) => None,
                (1, node) => Some(node),
                _ => return Err(DecodeError::Invalid("scan push flag")),
            };
            Op::ScanPartitions {
                after,
                limit,
                partitions,
                mask,
                since_version,
                keys_only,
                push_to,
            }
        }
        OpKind::Apply => {
            let key = c.key("key")?;
            let version = c.u64()?;
            let value = match c.u8()? {
                0 => None,
                1 => Some(c.value()?),
                _ => return Err(DecodeError::Invalid("apply value flag")),
            };
            Op::Apply {
                key,
                version,
                value,
            }
        }
    })
}

fn decode_region_info(c: &mut Cursor) -> Result<RegionInfo, DecodeError> {
    let id = c.u64()?;
    let size = c.u64()?;
    let mode = c.mode()?;
    let n = c.u8()? as usize;
    let name = if n == 0 {
        None
    } else {
        Some(c.string(n, "region name")?)
    };
    Ok(RegionInfo {
        id,
        size,
        name,
        mode,
    })
}

fn decode_reply(c: &mut Cursor) -> Result<Reply, DecodeError> {
    let tag = c.u8()?;
    Ok(match tag {
        TAG_PONG => Reply::Pong,
        TAG_STATS => {
            let n = c.u16()? as usize;
            let n = c.count(n, "stats entries", STATS_ENTRIES_MAX, 1 + 8)?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                let name = c.short_str("stat name", STAT_NAME_BYTES_MAX)?;
                entries.push((name, c.u64()?));
            }
            Reply::Stats(entries)
        }
        TAG_LIST => {
            let n = c.u32()? as usize;
            let n = c.count(n, "list entries", LIST_ENTRIES_MAX, 8 + 8 + 1 + 1)?;
            let mut regions = Vec::with_capacity(n);
            for _ in 0..n {
                regions.push(decode_region_info(c)?);
            }
            Reply::List(regions)
        }
        TAG_REGION => Reply::Region(decode_region_info(c)?),
        TAG_DONE => Reply::Done,
        TAG_DATA => {
            let n = c.u32()? as usize;
            check_limit("read data", n as u64, IO_BYTES_MAX as u64)?;
            Reply::Data(c.bytes(n)?)
        }
        TAG_WORD => Reply::Word(c.u64()?),
        TAG_OBJECT => Reply::Object {
            version: c.u64()?,
            value: c.value()?,
        },
        TAG_VERSION => Reply::Version(c.u64()?),
        TAG_ITEMS => Reply::Items(decode_items(c)?),
        TAG_PAGE => {
            let version_clock = c.u64()?;
            let pushed_bytes = c.u64()?;
            let resume_after = c.opt_key("scan resume key")?;
            Reply::Page(Page {
                items: decode_items(c)?,
                resume_after,
                version_clock,
                pushed_bytes,
            })
        }
        t => return Err(DecodeError::UnknownReply(t)),
    })
}

fn decode_items(c: &mut Cursor) -> Result<Vec<Item>, DecodeError> {
    let n = c.u32()? as usize;
    let n = c.count(n, "scan items", SCAN_ITEMS_MAX, ITEM_OVERHEAD_BYTES)?;
    let mut items = Vec::with_capacity(n);
    for _ in 0..n {
        items.push(Item {
            key: c.key("key")?,
            version: c.u64()?,
            value: c.value()?,
        });
    }
    Ok(items)
}

fn decode_error_body(c: &mut Cursor, code: ErrorCode) -> Result<ErrorReply, DecodeError> {
    let n = c.u16()? as usize;
    check_limit("error message", n as u64, MESSAGE_BYTES_MAX as u64)?;
    let message = c.string(n, "error message")?;
    let epoch = if code.carries_epoch() { c.u64()? } else { 0 };
    Ok(ErrorReply {
        code,
        message,
        epoch,
    })
}

/// Decodes one frame body (the bytes after the length prefix). Payload bytes (WRITE data,
/// READ replies) are zero-copy slices of `body`.
pub fn decode_frame(body: Bytes) -> Result<Frame, DecodeError> {
    FrameDecoder::check_len(body.len())?;
    let mut c = Cursor { buf: body };
    let kind = c.u8()?;
    let frame = match kind {
        KIND_HELLO => {
            let magic = c.bytes(4)?;
            if magic[..] != HELLO_MAGIC {
                return Err(DecodeError::BadMagic);
            }
            let version = c.u16()?;
            let n = c.u8()? as usize;
            check_limit("token", n as u64, TOKEN_BYTES_MAX as u64)?;
            let token = c.bytes(n)?;
            let principal = if c.buf.has_remaining() {
                c.short_str("principal", PRINCIPAL_BYTES_MAX)?
            } else {
                String::new()
            };
            let fence = if c.buf.has_remaining() {
                Some(c.u64()?)
            } else {
                None
            };
            Frame::Hello(Hello {
                version,
                token,
                principal,
                fence,
            })
        }
        KIND_HELLO_OK => Frame::HelloOk(HelloOk {
            version: c.u16()?,
            epoch: c.u64()?,
            fence_generation: c.u64()?,
        }),
        KIND_REQUESTS => {
            let epoch = c.u64()?;
            let n = c.u16()? as usize;
            let n = c.count(n, "requests per batch", BATCH_OPS_MAX, 8 + 1)?;
            let mut requests = Vec::with_capacity(n);
            for _ in 0..n {
                let id = c.u64()?;
                requests.push(Request {
                    id,
                    op: decode_op(&mut c)?,
                });
            }
            Frame::Requests(RequestBatch { epoch, requests })
        }
        KIND_RESPONSES => {
            let n = c.u16()? as usize;
            let n = c.count(n, "responses per batch", BATCH_OPS_MAX, 8 + 2 + 1)?;
            let mut responses = Vec::with_capacity(n);
            for _ in 0..n {
                let id = c.u64()?;
                let status = c.u16()?;
                let result = if status == 0 {
                    Ok(decode_reply(&mut c)?)
                } else {
                    Err(decode_error_body(&mut c, ErrorCode::from_u16(status))?)
                };
                responses.push(Response { id, result });
            }
            Frame::Responses(ResponseBatch { responses })
        }
        KIND_FATAL => {
            let code = ErrorCode::from_u16(c.u16()?);
            Frame::Fatal(decode_error_body(&mut c, code)?)
        }
        k => return Err(DecodeError::UnknownFrameKind(k)),
    };
    c.finish()?;
    Ok(frame)
}
