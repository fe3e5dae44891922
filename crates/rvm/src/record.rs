//! Log records and catalogs: their byte encoding, and decoding of whatever a backend hands
//! back. Pure code, no I/O.
//!
//! Decoding never panics and never allocates more than the input's own length: bytes read
//! back from a backend may be torn (a crash mid-commit), stale (an older record left past
//! the log's end) or plain garbage, and each of those must end the log cleanly.

use crate::limits::{RECORD_BYTES_MAX, RECORD_OPS_MAX, SEGMENTS_MAX, TAG_BYTES_MAX};
use bytes::Bytes;

const RECORD_MAGIC: u32 = 0x5256_4d31; // "RVM1"
const CATALOG_MAGIC: u32 = 0x5256_4d43; // "RVMC"
const FORMAT_VERSION: u16 = 1;
/// magic u32, version u16, reserved u16, seq u64, body_len u64, body_crc u32, header_crc u32.
pub const RECORD_HEADER_BYTES: usize = 32;
/// magic u32, version u16, reserved u16, body_len u32, body_crc u32.
pub const CATALOG_HEADER_BYTES: usize = 16;

const OP_WRITE: u8 = 1;
const OP_ALLOC: u8 = 2;
const OP_FREE: u8 = 3;
/// kind u8, seg u64, offset u64, len u32.
const WRITE_OP_HEADER_BYTES: usize = 21;

/// One change a committed transaction made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogOp {
    Write {
        seg: u64,
        offset: u64,
        data: Bytes,
    },
    Alloc(SegMeta),
    Free {
        seg: u64,
    },
    /// A Write whose `len` payload bytes recovery read straight into the segment's memory
    /// ([`scan_stream_placing`]); they stay in the backend's log at `log_offset` until the
    /// log is reset, which is where truncation takes them from. Decoding never yields it.
    Placed {
        seg: u64,
        offset: u64,
        len: u64,
        log_offset: u64,
    },
}

/// What the catalog and an Alloc op know of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegMeta {
    pub seg: u64,
    pub len: u64,
    /// Virtual address the segment was mapped at, so recovery can map it there again.
    pub addr: u64,
    pub tag: String,
}

/// One commit: the backend holds all of it or none of it ("held" is per backend what the
/// crate docs' "What committed means" says: server memory, Redis's acknowledgement, or
/// `fdatasync`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub ops: Vec<LogOp>,
}

/// Why bytes are not a record; the log ends at the first one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("need {0} more bytes")]
    Short(usize),
    #[error("{0}")]
    Invalid(&'static str),
}

/// Builds one record straight from segment memory: each declared range is copied once,
/// into the buffer that is shipped.
pub struct RecordBuilder {
    buf: Vec<u8>,
    ops: usize,
    /// Where each op's payload sits in `buf`, so `finish` can hand back the record with
    /// zero-copy slices instead of parsing (and checksumming) it a second time.
    shapes: Vec<Shape>,
}

enum Shape {
    Write {
        seg: u64,
        offset: u64,
        start: usize,
        len: usize,
    },
    Alloc(SegMeta),
    Free {
        seg: u64,
    },
}

impl Default for RecordBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl RecordBuilder {
    pub fn new() -> RecordBuilder {
        let buf = vec![0; RECORD_HEADER_BYTES + 4];
        RecordBuilder {
            buf,
            ops: 0,
            shapes: Vec::new(),
        }
    }

    /// Bytes the record would have if finished now.
    pub fn len_bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn reserve(&mut self, bytes: usize) {
        self.buf.reserve(bytes);
    }

    /// Appends a write of `len` bytes that `append` appends to the buffer it is given
    /// (straight from segment memory, without zero-filling the room first). Should it
    /// append a different number of bytes, the payload is cut or zero-padded to `len`, so
    /// the record stays well-formed.
    pub fn write_with(
        &mut self,
        seg: u64,
        offset: u64,
        len: u32,
        append: impl FnOnce(&mut Vec<u8>),
    ) {
        self.ops += 1;
        self.buf.push(OP_WRITE);
        self.buf.extend_from_slice(&seg.to_le_bytes());
        self.buf.extend_from_slice(&offset.to_le_bytes());
        self.buf.extend_from_slice(&len.to_le_bytes());
        let start = self.buf.len();
        append(&mut self.buf);
        self.buf.resize(start + len as usize, 0);
        self.shapes.push(Shape::Write {
            seg,
            offset,
            start,
            len: len as usize,
        });
    }

    pub fn write(&mut self, seg: u64, offset: u64, data: &[u8]) {
        let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        self.write_with(seg, offset, len, |b| {
            b.extend_from_slice(&data[..data.len().min(len as usize)])
        });
    }

    pub fn alloc(&mut self, meta: &SegMeta) {
        self.ops += 1;
        self.buf.push(OP_ALLOC);
        encode_meta(&mut self.buf, meta);
        self.shapes.push(Shape::Alloc(meta.clone()));
    }

    pub fn free(&mut self, seg: u64) {
        self.ops += 1;
        self.buf.push(OP_FREE);
        self.buf.extend_from_slice(&seg.to_le_bytes());
        self.shapes.push(Shape::Free { seg });
    }

    pub fn op_count(&self) -> usize {
        self.ops
    }

    /// The encoded record, and the record it decodes to (payloads slice the encoding).
    pub fn finish_with_record(self, seq: u64) -> (Bytes, Record) {
        let mut this = self;
        let shapes = std::mem::take(&mut this.shapes);
        let bytes = this.finish(seq);
        let ops = shapes
            .into_iter()
            .map(|s| match s {
                Shape::Write {
                    seg,
                    offset,
                    start,
                    len,
                } => LogOp::Write {
                    seg,
                    offset,
                    data: bytes.slice(start..start + len),
                },
                Shape::Alloc(m) => LogOp::Alloc(m),
                Shape::Free { seg } => LogOp::Free { seg },
            })
            .collect();
        (bytes, Record { seq, ops })
    }

    /// The encoded record with its sequence number and checksums filled in.
    pub fn finish(mut self, seq: u64) -> Bytes {
        let body_len = (self.buf.len() - RECORD_HEADER_BYTES) as u64;
        let ops = u32::try_from(self.ops).unwrap_or(u32::MAX);
        self.buf[RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + 4].copy_from_slice(&ops.to_le_bytes());
        let body_crc = crc32fast::hash(&self.buf[RECORD_HEADER_BYTES..]);
        let h = &mut self.buf[..RECORD_HEADER_BYTES];
        h[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&0u16.to_le_bytes());
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&body_len.to_le_bytes());
        h[24..28].copy_from_slice(&body_crc.to_le_bytes());
        let header_crc = crc32fast::hash(&h[..28]);
        h[28..32].copy_from_slice(&header_crc.to_le_bytes());
        Bytes::from(self.buf)
    }
}

/// Encodes a record (used by tests and by callers that already hold the ops).
pub fn encode_record(record: &Record) -> Bytes {
    let mut b = RecordBuilder::new();
    for op in &record.ops {
        match op {
            LogOp::Write { seg, offset, data } => b.write(*seg, *offset, data),
            LogOp::Alloc(meta) => b.alloc(meta),
            LogOp::Free { seg } => b.free(*seg),
            // Its bytes are in a segment, not here: encoded as zeros of the right length.
            LogOp::Placed {
                seg, offset, len, ..
            } => b.write_with(
                *seg,
                *offset,
                u32::try_from(*len).unwrap_or(u32::MAX),
                |_| {},
            ),
        }
    }
    b.finish(record.seq)
}

fn encode_meta(buf: &mut Vec<u8>, meta: &SegMeta) {
    buf.extend_from_slice(&meta.seg.to_le_bytes());
    buf.extend_from_slice(&meta.len.to_le_bytes());
    buf.extend_from_slice(&meta.addr.to_le_bytes());
    let tag = &meta.tag.as_bytes()[..meta.tag.len().min(TAG_BYTES_MAX)];
    buf.extend_from_slice(&(tag.len() as u16).to_le_bytes());
    buf.extend_from_slice(tag);
}

/// A record header that checked out: where the record claims to be and how long it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub seq: u64,
    pub body_len: u64,
    body_crc: u32,
}

impl RecordHeader {
    pub fn total_bytes(&self) -> u64 {
        RECORD_HEADER_BYTES as u64 + self.body_len
    }
}

pub fn decode_header(bytes: &[u8]) -> Result<RecordHeader, DecodeError> {
    if bytes.len() < RECORD_HEADER_BYTES {
        return Err(DecodeError::Short(RECORD_HEADER_BYTES - bytes.len()));
    }
    let mut r = Reader::new(&bytes[..RECORD_HEADER_BYTES]);
    let magic = r.u32()?;
    let version = r.u16()?;
    let reserved = r.u16()?;
    let seq = r.u64()?;
    let body_len = r.u64()?;
    let body_crc = r.u32()?;
    let header_crc = r.u32()?;
    if magic != RECORD_MAGIC {
        return Err(DecodeError::Invalid("not a record (bad magic)"));
    }
    if crc32fast::hash(&bytes[..28]) != header_crc {
        return Err(DecodeError::Invalid("record header checksum mismatch"));
    }
    if version != FORMAT_VERSION || reserved != 0 {
        return Err(DecodeError::Invalid("unknown record format version"));
    }
    if body_len < 4 || body_len > (RECORD_BYTES_MAX - RECORD_HEADER_BYTES) as u64 {
        return Err(DecodeError::Invalid("record length out of range"));
    }
    Ok(RecordHeader {
        seq,
        body_len,
        body_crc,
    })
}

/// Decodes one whole record from the front of `bytes`; returns it and its length.
/// Write payloads are slices of `bytes`, not copies.
pub fn decode_record(bytes: &Bytes) -> Result<(Record, usize), DecodeError> {
    let h = decode_header(bytes)?;
    let total = usize::try_from(h.total_bytes()).map_err(|_| DecodeError::Invalid("too long"))?;
    if bytes.len() < total {
        return Err(DecodeError::Short(total - bytes.len()));
    }
    let body = &bytes[RECORD_HEADER_BYTES..total];
    if crc32fast::hash(body) != h.body_crc {
        return Err(DecodeError::Invalid("record body checksum mismatch"));
    }
    let mut r = Reader::new(body);
    let count = r.u32()? as usize;
    if count > RECORD_OPS_MAX {
        return Err(DecodeError::Invalid("too many ops in a record"));
    }
    // Each op takes at least 9 bytes, so a count the body cannot hold is rejected before
    // anything is allocated for it.
    if count > body.len() / 9 {
        return Err(DecodeError::Invalid("op count exceeds the body"));
    }
    let mut ops = Vec::with_capacity(count);
    for _ in 0..count {
        match r.u8()? {
            OP_WRITE => {
                let seg = r.u64()?;
                let offset = r.u64()?;
                let len = r.u32()? as usize;
                let start = RECORD_HEADER_BYTES + r.pos;
                r.skip(len)?;
                offset
                    .checked_add(len as u64)
                    .ok_or(DecodeError::Invalid("write range overflows"))?;
                ops.push(LogOp::Write {
                    seg,
                    offset,
                    data: bytes.slice(start..start + len),
                });
            }
            OP_ALLOC => ops.push(LogOp::Alloc(decode_meta(&mut r)?)),
            OP_FREE => ops.push(LogOp::Free { seg: r.u64()? }),
            _ => return Err(DecodeError::Invalid("unknown op kind")),
        }
    }
    if r.pos != body.len() {
        return Err(DecodeError::Invalid("trailing bytes in a record"));
    }
    Ok((Record { seq: h.seq, ops }, total))
}

fn decode_meta(r: &mut Reader<'_>) -> Result<SegMeta, DecodeError> {
    let seg = r.u64()?;
    let len = r.u64()?;
    let addr = r.u64()?;
    let tag_len = r.u16()? as usize;
    if tag_len == 0 || tag_len > TAG_BYTES_MAX {
        return Err(DecodeError::Invalid("tag length out of range"));
    }
    let tag = std::str::from_utf8(r.take(tag_len)?)
        .map_err(|_| DecodeError::Invalid("tag is not UTF-8"))?
        .to_owned();
    Ok(SegMeta {
        seg,
        len,
        addr,
        tag,
    })
}

/// The committed table of segments as of `applied_seq`: what the homes hold once every
/// record up to it has been applied.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Catalog {
    pub applied_seq: u64,
    pub next_seg: u64,
    pub segs: Vec<SegMeta>,
}

pub fn encode_catalog(c: &Catalog) -> Bytes {
    let mut body = Vec::new();
    body.extend_from_slice(&c.applied_seq.to_le_bytes());
    body.extend_from_slice(&c.next_seg.to_le_bytes());
    body.extend_from_slice(&(c.segs.len() as u32).to_le_bytes());
    for m in &c.segs {
        encode_meta(&mut body, m);
    }
    let mut out = Vec::with_capacity(CATALOG_HEADER_BYTES + body.len());
    out.extend_from_slice(&CATALOG_MAGIC.to_le_bytes());
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Bytes::from(out)
}

/// The encoded length of the catalog whose header `prefix` starts with (header plus
/// body), or `None` when `prefix` does not start with a catalog header. Unchecked beyond
/// the magic: callers bound it, and [`decode_catalog`] verifies the rest.
pub fn catalog_encoded_len(prefix: &[u8]) -> Option<usize> {
    let mut r = Reader::new(prefix);
    if r.u32().ok()? != CATALOG_MAGIC {
        return None;
    }
    let _version = r.u16().ok()?;
    let _reserved = r.u16().ok()?;
    let body_len = r.u32().ok()? as usize;
    CATALOG_HEADER_BYTES.checked_add(body_len)
}

/// Decodes a catalog from the front of `bytes` (a fixed-size slot may hold more after it).
pub fn decode_catalog(bytes: &[u8]) -> Result<Catalog, DecodeError> {
    let mut r = Reader::new(bytes);
    if r.u32()? != CATALOG_MAGIC {
        return Err(DecodeError::Invalid("not a catalog (bad magic)"));
    }
    if r.u16()? != FORMAT_VERSION {
        return Err(DecodeError::Invalid("unknown catalog format version"));
    }
    let _reserved = r.u16()?;
    let body_len = r.u32()? as usize;
    let crc = r.u32()?;
    let body = r.take(body_len)?;
    if crc32fast::hash(body) != crc {
        return Err(DecodeError::Invalid("catalog checksum mismatch"));
    }
    let mut r = Reader::new(body);
    let applied_seq = r.u64()?;
    let next_seg = r.u64()?;
    let count = r.u32()? as usize;
    if count > SEGMENTS_MAX || count > body.len() / 27 {
        return Err(DecodeError::Invalid("catalog segment count out of range"));
    }
    let mut segs = Vec::with_capacity(count);
    for _ in 0..count {
        segs.push(decode_meta(&mut r)?);
    }
    if r.pos != body.len() {
        return Err(DecodeError::Invalid("trailing bytes in a catalog"));
    }
    Ok(Catalog {
        applied_seq,
        next_seg,
        segs,
    })
}

/// Of two catalog slots, the valid one with the higher `applied_seq` (slots are written
/// alternately, so a torn write leaves the other intact).
pub fn newest_catalog(slots: &[Option<Bytes>]) -> Option<(usize, Catalog)> {
    slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| Some((i, decode_catalog(s.as_ref()?).ok()?)))
        .max_by_key(|(_, c)| c.applied_seq)
}

/// The scan's read-ahead buffer over a byte-stream log.
struct Scan<R> {
    read_at: R,
    buf: bytes::BytesMut,
    /// The log offset of `buf[0]`.
    buf_start: u64,
    /// Grows from SCAN_FIRST_READ_BYTES to `chunk_max`: short logs cost short reads.
    chunk: usize,
    chunk_max: usize,
    capacity_bytes: u64,
}

impl<R, E> Scan<R>
where
    R: FnMut(u64, usize, &mut bytes::BytesMut) -> Result<(), E>,
{
    /// Reads until `buf` holds `need` bytes from `offset`; false when the log ends first.
    fn fill(&mut self, offset: u64, need: u64) -> Result<bool, E> {
        loop {
            let have = self.buf_start + self.buf.len() as u64;
            if have >= offset + need {
                return Ok(true);
            }
            if have >= self.capacity_bytes {
                return Ok(false);
            }
            let want = (offset + need - have).max(self.chunk as u64);
            self.chunk = self.chunk.saturating_mul(2).min(self.chunk_max);
            let want = want.min(self.capacity_bytes - have) as usize;
            let before = self.buf.len();
            (self.read_at)(have, want, &mut self.buf)?;
            // A reader that returned more than asked must not make us trust bytes past it.
            self.buf.truncate(before + want);
            if self.buf.len() == before {
                return Ok(false);
            }
        }
    }

    /// Forgets the bytes before `offset` (all of them, and the read-ahead, when `offset`
    /// lies past what is buffered).
    fn consume_to(&mut self, offset: u64) {
        let consumed = offset.saturating_sub(self.buf_start);
        if consumed == 0 {
            return;
        }
        if consumed >= self.buf.len() as u64 {
            self.buf.clear();
        } else {
            let _ = self.buf.split_to(consumed as usize);
        }
        self.buf_start = offset;
    }

    /// The `n` bytes at `offset` (split off the buffer, not copied); `None` when the log
    /// ends first.
    fn take(&mut self, offset: u64, n: u64) -> Result<Option<Bytes>, E> {
        self.consume_to(offset);
        if !self.fill(offset, n)? {
            return Ok(None);
        }
        let b = self.buf.split_to(n as usize).freeze();
        self.buf_start += n;
        Ok(Some(b))
    }
}

/// Scans a byte-stream log (pool region, file) from offset 0: the records numbered
/// `first_seq`, `first_seq + 1`, … up to the first that is missing, torn, stale or garbage.
/// `read_at(offset, len, buf)` appends up to `len` bytes read at `offset` to `buf` (fewer
/// at the end of the log, none past it): reading straight into the scan's buffer saves a
/// copy and a record-sized allocation per read.
/// Returns the records and the offset just past the last one. Each record's payloads are
/// zero-copy slices of the bytes read.
pub fn scan_stream<E>(
    capacity_bytes: u64,
    first_seq: u64,
    chunk_bytes: usize,
    read_at: impl FnMut(u64, usize, &mut bytes::BytesMut) -> Result<(), E>,
) -> Result<(Vec<Record>, u64), E> {
    let (records, end, _) = scan_inner(
        capacity_bytes,
        first_seq,
        chunk_bytes,
        read_at,
        None::<Placing<'_, E>>,
    )?;
    Ok((records, end))
}

/// Where recovery wants a Write payload to go instead of into the scanned record.
pub trait Placer {
    /// For a Write of `len` bytes at `offset` of `seg` in a record being scanned: the
    /// `len`-byte slice of memory its payload is to be read into, or `None` to keep it in
    /// the record. Nothing placed may be used before the scan says it was clean.
    fn place(&mut self, seg: u64, offset: u64, len: u64) -> Option<&mut [u8]>;
    /// `record` checked out and is part of the log (its Allocs and Frees now count).
    fn accepted(&mut self, record: &Record);
}

/// [`scan_stream`], except that in records of at least `PLACE_WRITE_BYTES_MIN` bytes each
/// Write payload that `placer` accepts is read with `read_into(offset, out, filled)` straight into
/// the memory it hands out, and comes back as [`LogOp::Placed`]. The body checksum covers
/// placed bytes too; the third value is false when a record with placed bytes turned out
/// torn or corrupt — placed memory then holds garbage and the caller must scan again
/// without placing (the records returned stop before that one either way).
pub fn scan_stream_placing<E>(
    capacity_bytes: u64,
    first_seq: u64,
    chunk_bytes: usize,
    read_at: impl FnMut(u64, usize, &mut bytes::BytesMut) -> Result<(), E>,
    mut read_into: impl FnMut(u64, &mut [u8], &mut dyn FnMut(&[u8])) -> Result<(), E>,
    placer: &mut dyn Placer,
) -> Result<(Vec<Record>, u64, bool), E> {
    scan_inner(
        capacity_bytes,
        first_seq,
        chunk_bytes,
        read_at,
        Some((placer, &mut read_into as &mut ReadInto<'_, E>)),
    )
}

/// Reads log bytes at an offset into a slice (a placed payload's destination).
/// `filled` sees each piece of the slice, in order, as soon as it holds its bytes: the
/// checksum is computed while the piece is still in cache, not in a second pass over
/// megabytes.
type ReadInto<'a, E> = dyn FnMut(u64, &mut [u8], &mut dyn FnMut(&[u8])) -> Result<(), E> + 'a;
type Placing<'a, E> = (&'a mut dyn Placer, &'a mut ReadInto<'a, E>);

fn scan_inner<E>(
    capacity_bytes: u64,
    first_seq: u64,
    chunk_bytes: usize,
    read_at: impl FnMut(u64, usize, &mut bytes::BytesMut) -> Result<(), E>,
    mut placing: Option<Placing<'_, E>>,
) -> Result<(Vec<Record>, u64, bool), E> {
    let mut records = Vec::new();
    let mut offset = 0u64;
    let mut scan = Scan {
        read_at,
        buf: bytes::BytesMut::new(),
        buf_start: 0,
        chunk: chunk_bytes.min(crate::limits::SCAN_FIRST_READ_BYTES),
        chunk_max: chunk_bytes,
        capacity_bytes,
    };
    let mut expected = first_seq;
    loop {
        // Drop what was consumed so the buffer holds about one chunk plus one record.
        scan.consume_to(offset);
        if !scan.fill(offset, RECORD_HEADER_BYTES as u64)? {
            break;
        }
        let header = match decode_header(&scan.buf[..RECORD_HEADER_BYTES]) {
            Ok(h) if h.seq == expected => h,
            _ => break,
        };
        if offset + header.total_bytes() > capacity_bytes {
            break;
        }
        let total = header.total_bytes() as usize;
        if let Some((placer, read_into)) = placing.as_mut() {
            if header.total_bytes() >= crate::limits::PLACE_WRITE_BYTES_MIN {
                match stream_record(&mut scan, &mut **read_into, &mut **placer, offset, &header)? {
                    Streamed::Record(record) => {
                        placer.accepted(&record);
                        records.push(record);
                        offset += total as u64;
                        expected += 1;
                        continue;
                    }
                    Streamed::Invalid { placed } => return Ok((records, offset, !placed)),
                }
            }
        }
        // Fits in `capacity_bytes` (checked above), so this allocates no more than the
        // input holds; reserving once avoids growing (and copying) a big record by halves.
        scan.buf.reserve(total.saturating_sub(scan.buf.len()));
        // A big record is read whole into this buffer: fault it in by huge pages.
        crate::mem::advise_huge_pages(scan.buf.spare_capacity_mut());
        if !scan.fill(offset, header.total_bytes())? {
            break;
        }
        // Split off, not copied: the record's payloads slice these bytes.
        let whole = scan.buf.split_to(total).freeze();
        scan.buf_start += total as u64;
        match decode_record(&whole) {
            Ok((record, len)) => {
                if let Some((placer, _)) = placing.as_mut() {
                    placer.accepted(&record);
                }
                records.push(record);
                offset += len as u64;
                expected += 1;
            }
            Err(_) => break,
        }
    }
    Ok((records, offset, true))
}

enum Streamed {
    Record(Record),
    /// Torn, corrupt or garbage; `placed` when some of its bytes went to placed memory.
    Invalid {
        placed: bool,
    },
}

/// The body bytes `[*pos, *pos + n)` of a record ending at `end`, hashed and consumed;
/// `None` when they would overrun the record or the log.
fn take_body<R, E>(
    scan: &mut Scan<R>,
    crc: &mut crc32fast::Hasher,
    pos: &mut u64,
    end: u64,
    n: u64,
) -> Result<Option<Bytes>, E>
where
    R: FnMut(u64, usize, &mut bytes::BytesMut) -> Result<(), E>,
{
    if pos.checked_add(n).is_none_or(|e| e > end) {
        return Ok(None);
    }
    let Some(b) = scan.take(*pos, n)? else {
        return Ok(None);
    };
    crc.update(&b);
    *pos += n;
    Ok(Some(b))
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Reads and checks the record at `offset` (header already checked) op by op, so that
/// a placed Write's payload goes from the network straight to the placer's memory. Checks
/// the same things as [`decode_record`].
fn stream_record<R, E>(
    scan: &mut Scan<R>,
    read_into: &mut ReadInto<'_, E>,
    placer: &mut dyn Placer,
    offset: u64,
    header: &RecordHeader,
) -> Result<Streamed, E>
where
    R: FnMut(u64, usize, &mut bytes::BytesMut) -> Result<(), E>,
{
    let end = offset + header.total_bytes();
    let mut pos = offset + RECORD_HEADER_BYTES as u64;
    let mut crc = crc32fast::Hasher::new();
    let mut placed = false;
    macro_rules! take {
        ($n:expr) => {
            match take_body(scan, &mut crc, &mut pos, end, $n)? {
                Some(b) => b,
                None => return Ok(Streamed::Invalid { placed }),
            }
        };
    }
    let count_bytes = take!(4);
    let count = u32::from_le_bytes([
        count_bytes[0],
        count_bytes[1],
        count_bytes[2],
        count_bytes[3],
    ]) as usize;
    if count > RECORD_OPS_MAX || count as u64 > header.body_len / 9 {
        return Ok(Streamed::Invalid { placed });
    }
    let mut ops = Vec::with_capacity(count);
    for _ in 0..count {
        let kind = take!(1)[0];
        match kind {
            OP_WRITE => {
                let f = take!(20);
                let seg = le_u64(&f[0..8]);
                let off = le_u64(&f[8..16]);
                let len = u32::from_le_bytes([f[16], f[17], f[18], f[19]]) as u64;
                if off.checked_add(len).is_none() || pos + len > end {
                    return Ok(Streamed::Invalid { placed });
                }
                let target = if len >= crate::limits::PLACE_WRITE_BYTES_MIN {
                    placer.place(seg, off, len)
                } else {
                    None
                };
                match target {
                    Some(dst) if dst.len() as u64 == len => {
                        placed = true;
                        // Part of the payload may already be in the read-ahead.
                        scan.consume_to(pos);
                        let buffered = scan.buf.len().min(len as usize);
                        dst[..buffered].copy_from_slice(&scan.buf[..buffered]);
                        crc.update(&dst[..buffered]);
                        scan.consume_to(pos + buffered as u64);
                        let mut seen = 0usize;
                        read_into(pos + buffered as u64, &mut dst[buffered..], &mut |piece| {
                            seen += piece.len();
                            crc.update(piece)
                        })?;
                        if seen != len as usize - buffered {
                            // A reader that skipped `filled` cannot have its bytes trusted.
                            return Ok(Streamed::Invalid { placed });
                        }
                        ops.push(LogOp::Placed {
                            seg,
                            offset: off,
                            len,
                            log_offset: pos,
                        });
                        pos += len;
                        scan.consume_to(pos);
                    }
                    _ => {
                        let data = take!(len);
                        ops.push(LogOp::Write {
                            seg,
                            offset: off,
                            data,
                        });
                    }
                }
            }
            OP_ALLOC => {
                let fixed = take!(26);
                let tag_len = u16::from_le_bytes([fixed[24], fixed[25]]) as u64;
                let tag = take!(tag_len);
                let mut meta = Vec::with_capacity(fixed.len() + tag.len());
                meta.extend_from_slice(&fixed);
                meta.extend_from_slice(&tag);
                match decode_meta(&mut Reader::new(&meta)) {
                    Ok(m) => ops.push(LogOp::Alloc(m)),
                    Err(_) => return Ok(Streamed::Invalid { placed }),
                }
            }
            OP_FREE => ops.push(LogOp::Free {
                seg: le_u64(&take!(8)),
            }),
            _ => return Ok(Streamed::Invalid { placed }),
        }
    }
    if pos != end || crc.finalize() != header.body_crc {
        return Ok(Streamed::Invalid { placed });
    }
    Ok(Streamed::Record(Record {
        seq: header.seq,
        ops,
    }))
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let left = self.bytes.len() - self.pos;
        if n > left {
            return Err(DecodeError::Short(n - left));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn skip(&mut self, n: usize) -> Result<(), DecodeError> {
        self.take(n).map(|_| ())
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

/// Bytes `record` takes encoded.
pub fn encoded_len(record: &Record) -> u64 {
    let ops: usize = record
        .ops
        .iter()
        .map(|op| match op {
            LogOp::Write { data, .. } => WRITE_OP_HEADER_BYTES + data.len(),
            LogOp::Placed { len, .. } => WRITE_OP_HEADER_BYTES + *len as usize,
            LogOp::Alloc(m) => 1 + 26 + m.tag.len().min(TAG_BYTES_MAX),
            LogOp::Free { .. } => 9,
        })
        .sum();
    (RECORD_HEADER_BYTES + 4 + ops) as u64
}

/// Bytes a write op of `len` payload bytes adds to a record.
pub fn write_op_bytes(len: usize) -> usize {
    WRITE_OP_HEADER_BYTES + len
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(seq: u64) -> Record {
        Record {
            seq,
            ops: vec![
                LogOp::Alloc(SegMeta {
                    seg: 3,
                    len: 8192,
                    addr: 0x7000_0000,
                    tag: "accounts".into(),
                }),
                LogOp::Write {
                    seg: 3,
                    offset: 100,
                    data: Bytes::from_static(b"hello"),
                },
                LogOp::Free { seg: 2 },
            ],
        }
    }

    #[test]
    fn record_round_trips() {
        let r = sample(7);
        let enc = encode_record(&r);
        let (dec, len) = decode_record(&enc).expect("decodes");
        assert_eq!(dec, r);
        assert_eq!(len, enc.len());
        assert_eq!(encoded_len(&r), enc.len() as u64);
        let mut b = RecordBuilder::new();
        for op in &r.ops {
            match op {
                LogOp::Write { seg, offset, data } => b.write(*seg, *offset, data),
                LogOp::Alloc(m) => b.alloc(m),
                LogOp::Free { seg } => b.free(*seg),
                LogOp::Placed { .. } => unreachable!("samples hold no placed writes"),
            }
        }
        let (bytes, rec) = b.finish_with_record(7);
        assert_eq!((bytes, rec), (enc, r));
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let enc = encode_record(&sample(1)).to_vec();
        for i in 0..enc.len() {
            for bit in 0..8 {
                let mut bad = enc.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    decode_record(&Bytes::from(bad)).is_err(),
                    "flip of bit {bit} of byte {i} went unnoticed"
                );
            }
        }
    }

    #[test]
    fn every_truncation_is_short_or_invalid() {
        let enc = encode_record(&sample(1));
        for n in 0..enc.len() {
            assert!(
                decode_record(&enc.slice(..n)).is_err(),
                "prefix of {n} bytes"
            );
        }
    }

    #[test]
    fn catalog_round_trips_and_newest_wins() {
        let a = Catalog {
            applied_seq: 4,
            next_seg: 9,
            segs: vec![SegMeta {
                seg: 1,
                len: 4096,
                addr: 0,
                tag: "t".into(),
            }],
        };
        let b = Catalog {
            applied_seq: 5,
            ..a.clone()
        };
        let ea = encode_catalog(&a);
        assert_eq!(decode_catalog(&ea).expect("decodes"), a);
        let mut padded = ea.to_vec();
        padded.extend_from_slice(&[0xAB; 100]);
        assert_eq!(decode_catalog(&padded).expect("padding ignored"), a);
        let eb = encode_catalog(&b);
        let mut torn = eb.to_vec();
        let last = torn.len() - 1;
        torn[last] ^= 1;
        let slots = [Some(ea.clone()), Some(eb.clone())];
        assert_eq!(newest_catalog(&slots).map(|(i, _)| i), Some(1));
        let slots = [Some(ea), Some(Bytes::from(torn))];
        assert_eq!(
            newest_catalog(&slots).map(|(i, c)| (i, c.applied_seq)),
            Some((0, 4))
        );
        assert_eq!(newest_catalog(&[None, None]), None);
    }

    #[test]
    fn catalog_length_comes_from_its_header() {
        let c = Catalog {
            applied_seq: 1,
            next_seg: 2,
            segs: Vec::new(),
        };
        let e = encode_catalog(&c);
        assert_eq!(catalog_encoded_len(&e), Some(e.len()));
        assert_eq!(
            catalog_encoded_len(&e[..CATALOG_HEADER_BYTES]),
            Some(e.len())
        );
        // magic, version, reserved and length are the header's first 12 bytes.
        assert_eq!(catalog_encoded_len(&e[..12]), Some(e.len()));
        assert_eq!(catalog_encoded_len(&e[..11]), None);
        assert_eq!(catalog_encoded_len(&[0u8; 64]), None, "a zeroed slot");
    }

    fn stream_of(records: &[Record]) -> Vec<u8> {
        records
            .iter()
            .flat_map(|r| encode_record(r).to_vec())
            .collect()
    }

    fn scan(log: &[u8], first: u64, chunk: usize) -> (Vec<u64>, u64) {
        let (recs, end) = scan_stream::<()>(log.len() as u64, first, chunk, |off, len, buf| {
            let s = off as usize;
            buf.extend_from_slice(&log[s..(s + len).min(log.len())]);
            Ok(())
        })
        .expect("in-memory reads cannot fail");
        (recs.iter().map(|r| r.seq).collect(), end)
    }

    #[test]
    fn scan_stops_at_torn_stale_and_garbage() {
        let recs: Vec<Record> = (5..9).map(sample).collect();
        let mut log = stream_of(&recs);
        let whole = log.len() as u64;
        log.extend_from_slice(&[0u8; 64]);
        assert_eq!(scan(&log, 5, 7), (vec![5, 6, 7, 8], whole));
        // A stale record (lower seq) after the end is not replayed.
        let mut stale = stream_of(&recs[..2]);
        stale.extend(stream_of(&[sample(3)]));
        assert_eq!(scan(&stale, 5, 64).0, vec![5, 6]);
        // A torn last record ends the log before it.
        let mut torn = stream_of(&recs);
        torn.truncate(torn.len() - 3);
        assert_eq!(scan(&torn, 5, 1 << 20).0, vec![5, 6, 7]);
        // Starting at the wrong seq finds nothing.
        assert_eq!(scan(&log, 6, 64), (vec![], 0));
    }

    /// Segment memory for `scan_stream_placing`: made when an Alloc is accepted.
    #[derive(Default)]
    struct TestPlacer {
        mem: std::collections::HashMap<u64, Vec<u8>>,
    }

    impl Placer for TestPlacer {
        fn place(&mut self, seg: u64, offset: u64, len: u64) -> Option<&mut [u8]> {
            self.mem
                .get_mut(&seg)?
                .get_mut(offset as usize..(offset + len) as usize)
        }
        fn accepted(&mut self, record: &Record) {
            for op in &record.ops {
                if let LogOp::Alloc(m) = op {
                    self.mem.insert(m.seg, vec![0; m.len as usize]);
                }
            }
        }
    }

    /// An Alloc of segment 1 (4 MiB), a record with a placeable 2 MiB write between
    /// small ones, and a small record after it.
    fn placing_log() -> (Vec<Record>, Vec<u8>) {
        let meta = SegMeta {
            seg: 1,
            len: 4 << 20,
            addr: 0,
            tag: "s".into(),
        };
        let big: Vec<u8> = (0..2u32 << 20).map(|i| (i % 251) as u8).collect();
        let recs = vec![
            Record {
                seq: 5,
                ops: vec![LogOp::Alloc(meta)],
            },
            Record {
                seq: 6,
                ops: vec![
                    LogOp::Write {
                        seg: 1,
                        offset: 3,
                        data: Bytes::from_static(b"before"),
                    },
                    LogOp::Write {
                        seg: 1,
                        offset: 1 << 20,
                        data: Bytes::from(big),
                    },
                    LogOp::Free { seg: 9 },
                    LogOp::Write {
                        seg: 1,
                        offset: 7,
                        data: Bytes::from_static(b"after"),
                    },
                ],
            },
            sample(7),
        ];
        let log = stream_of(&recs);
        (recs, log)
    }

    fn scan_placing(log: &[u8], chunk: usize) -> (Vec<Record>, u64, bool, TestPlacer) {
        let mut placer = TestPlacer::default();
        let (recs, end, clean) = scan_stream_placing::<()>(
            log.len() as u64,
            5,
            chunk,
            |off, len, buf| {
                let end = (off as usize + len).min(log.len());
                buf.extend_from_slice(&log[off as usize..end]);
                Ok(())
            },
            |off, out, filled| {
                // In two pieces, as a network reader hands them over.
                let half = out.len() / 2;
                for (at, piece) in [(0, half), (half, out.len())] {
                    let o = off as usize;
                    out[at..piece].copy_from_slice(&log[o + at..o + piece]);
                    filled(&out[at..piece]);
                }
                Ok(())
            },
            &mut placer,
        )
        .expect("in-memory reads cannot fail");
        (recs, end, clean, placer)
    }

    #[test]
    fn placing_scan_reads_big_writes_into_place_and_checks_them() {
        let (recs, log) = placing_log();
        for chunk in [64, 4096, 1 << 20] {
            let (got, end, clean, placer) = scan_placing(&log, chunk);
            assert!(clean);
            assert_eq!(end, log.len() as u64);
            assert_eq!(got.len(), 3);
            assert_eq!((&got[0], &got[2]), (&recs[0], &recs[2]));
            let LogOp::Write { data: big, .. } = &recs[1].ops[1] else {
                unreachable!()
            };
            let mut want = recs[1].ops.clone();
            want[1] = LogOp::Placed {
                seg: 1,
                offset: 1 << 20,
                len: big.len() as u64,
                // Record header, op count, the first write (21 + 6), the op header.
                log_offset: stream_of(&recs[..1]).len() as u64 + 32 + 4 + 27 + 21,
            };
            assert_eq!(got[1].ops, want, "chunk {chunk}");
            assert_eq!(encoded_len(&got[1]), encoded_len(&recs[1]));
            let LogOp::Placed { log_offset, .. } = want[1] else {
                unreachable!()
            };
            let at = log_offset as usize;
            assert_eq!(
                &log[at..at + big.len()],
                &big[..],
                "log_offset points at the payload"
            );
            assert_eq!(&placer.mem[&1][1 << 20..(1 << 20) + big.len()], &big[..]);
        }
    }

    #[test]
    fn placing_scan_reports_placed_bytes_of_a_corrupt_record() {
        let (_, log) = placing_log();
        let first = stream_of(&placing_log().0[..1]).len();
        // A flipped bit inside the placed payload: only the checksum can tell.
        let mut bad = log.clone();
        bad[first + 32 + 4 + 27 + 21 + 1000] ^= 1;
        let (got, end, clean, _) = scan_placing(&bad, 4096);
        assert!(!clean, "placed memory holds bytes of a corrupt record");
        assert_eq!((got.len(), end), (1, first as u64));
        // A bad op after the placed write, same verdict.
        let mut bad = log.clone();
        let free_at = first + 32 + 4 + 27 + 21 + (2 << 20);
        bad[free_at] = 0x7f;
        assert!(!scan_placing(&bad, 4096).2);
        // Torn before its end: never streamed, so nothing was placed.
        let (got, _, clean, placer) = scan_placing(&log[..log.len() - 100], 4096);
        assert!(clean);
        assert_eq!(got.len(), 2, "the torn last record is dropped");
        assert!(placer.mem[&1].iter().any(|b| *b != 0));
        let (got, _, clean, placer) = scan_placing(&log[..first + 5000], 4096);
        assert!(clean && got.len() == 1);
        assert!(placer.mem[&1].iter().all(|b| *b == 0));
    }

    fn arb_op() -> impl Strategy<Value = LogOp> {
        prop_oneof![
            (
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 0..64)
            )
                .prop_map(|(seg, offset, d)| LogOp::Write {
                    seg,
                    offset: offset >> 1,
                    data: Bytes::from(d)
                }),
            (any::<u64>(), any::<u64>(), any::<u64>(), "[a-z]{1,20}").prop_map(
                |(seg, len, addr, tag)| LogOp::Alloc(SegMeta {
                    seg,
                    len,
                    addr,
                    tag
                })
            ),
            any::<u64>().prop_map(|seg| LogOp::Free { seg }),
        ]
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let b = Bytes::from(bytes);
            let _ = decode_record(&b);
            let _ = decode_catalog(&b);
            let _ = scan(&b, 0, 16);
        }

        #[test]
        fn any_record_round_trips(seq in any::<u64>(), ops in proptest::collection::vec(arb_op(), 0..8)) {
            let r = Record { seq, ops };
            let enc = encode_record(&r);
            let (dec, len) = decode_record(&enc).expect("own encoding decodes");
            prop_assert_eq!(dec, r);
            prop_assert_eq!(len, enc.len());
        }

        #[test]
        fn corrupted_records_decode_or_fail_cleanly(
            ops in proptest::collection::vec(arb_op(), 1..6),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let mut enc = encode_record(&Record { seq: 1, ops }).to_vec();
            let i = at.index(enc.len());
            enc[i] = byte;
            let _ = decode_record(&Bytes::from(enc));
        }
    }
}
