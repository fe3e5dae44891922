//! Frames as the client builds and reads them, with no socket, thread or lock of a
//! connection: the HELLO and its answer, packing queued requests into REQUESTS frames
//! under the protocol's limits, decoding an answer frame and handing each answer to the
//! request it answers. The threaded connection (`conn`) and the event-loop face share it.

use crate::completion::Completion;
use crate::{ClientConfig, ClientError};
use bytes::{Bytes, BytesMut};
use camelot_proto::limits::{FRAME_BYTES_MAX, FRAME_BYTES_TARGET};
use camelot_proto::{
    decode_frame, encode_frame, ErrorCode, Frame, Hello, Op, RequestBatchEncoder, PROTOCOL_VERSION,
    RESPONSES_HEADER_BYTES, RESPONSE_OK_BUDGET_BYTES,
};
use std::net::SocketAddr;
use std::sync::Arc;

/// WRITE data and PUT values at least this long are not copied into the frame buffer but
/// handed to the kernel from where they are (one `writev` per frame). A mirrored RVM
/// commit of 40 MB copied its payload into a frame buffer once per mirror before the
/// socket copy; below this size the copy costs less than the extra iovec entries.
pub(crate) const VECTORED_PAYLOAD_BYTES_MIN: usize = 64 << 10;

/// A request waiting to go out: its id on the connection, the operation, and the slot its
/// answer goes to.
pub(crate) struct Submission {
    pub id: u64,
    pub op: Op,
    pub slot: Arc<Completion>,
}

/// A HELLO frame to `addr` for `config`'s token, principal and fence session.
pub(crate) fn hello_frame(
    config: &ClientConfig,
    addr: SocketAddr,
) -> Result<BytesMut, ClientError> {
    let mut buf = BytesMut::new();
    encode_frame(
        &Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: Bytes::from(config.token.clone().unwrap_or_default()),
            principal: config.principal.clone().unwrap_or_default(),
            fence: config.fence_session.as_ref().map(|s| s.generation(addr)),
        }),
        &mut buf,
    )
    .map_err(|e| ClientError::InvalidArgument(format!("HELLO: {e}")))?;
    Ok(buf)
}

/// A handshake answer is tiny; a bigger one is not from a Camelot server, and is refused
/// before anything is buffered for it.
pub(crate) const HELLO_ANSWER_BYTES_MAX: usize = 4096;

/// The cluster epoch from the server's answer to HELLO (its body, length removed); a
/// fence session notes the generation it joined at.
pub(crate) fn hello_answer(
    addr: SocketAddr,
    body: Bytes,
    config: &ClientConfig,
) -> Result<u64, ClientError> {
    match decode_frame(body) {
        Ok(Frame::HelloOk(ok)) => {
            if let Some(session) = &config.fence_session {
                session.joined(addr, ok.fence_generation);
            }
            Ok(ok.epoch)
        }
        Ok(Frame::Fatal(e)) if e.code == ErrorCode::AuthFailed => Err(ClientError::Auth {
            addr,
            message: e.message,
        }),
        Ok(Frame::Fatal(e)) => Err(ClientError::Handshake {
            addr,
            reason: e.to_string(),
        }),
        Ok(other) => Err(ClientError::Handshake {
            addr,
            reason: format!("unexpected frame {other:?}"),
        }),
        Err(e) => Err(ClientError::Handshake {
            addr,
            reason: e.to_string(),
        }),
    }
}

/// How requests are packed into frames; shared by the threaded and event-loop writers.
pub(crate) struct FrameLimits {
    pub batching: bool,
    pub batch_ops_max: usize,
    pub epoch: u64,
}

impl FrameLimits {
    /// Encodes into `out` (cleared first) one frame of as many of `pending`'s requests as
    /// the limits allow (one when not batching), moving their slots into `batch`. A
    /// request that cannot be encoded is failed on its slot. False when no request made
    /// it into the frame (nothing to send). With `deferred` (cleared first), payloads of
    /// at least [`VECTORED_PAYLOAD_BYTES_MIN`] are left out of `out` and listed there with
    /// their offsets (see [`write_frame`]).
    pub(crate) fn encode_next(
        &self,
        out: &mut BytesMut,
        mut deferred: Option<&mut Vec<(usize, Bytes)>>,
        pending: &mut std::iter::Peekable<impl Iterator<Item = Submission>>,
        batch: &mut Vec<(u64, Arc<Completion>)>,
    ) -> bool {
        out.clear();
        if let Some(d) = deferred.as_deref_mut() {
            d.clear();
        }
        let mut enc = RequestBatchEncoder::begin(out, self.epoch);
        let mut reply_bytes = RESPONSES_HEADER_BYTES;
        let mut bulk_bytes = 0;
        while let Some(sub) = pending.peek() {
            // Past the target a new frame starts: pipelined frames of a few MiB beat
            // one of tens of MiB (see FRAME_BYTES_TARGET); the hard limits still hold.
            let fits = enc.count() == 0
                || (self.batching
                    && enc.count() < self.batch_ops_max
                    && enc.frame_len() + sub.op.encoded_len() <= FRAME_BYTES_MAX + 4
                    && reply_bytes + sub.op.reply_len_max() <= RESPONSE_OK_BUDGET_BYTES
                    && bulk_bytes + sub.op.bulk_len() <= FRAME_BYTES_TARGET);
            if !fits {
                break;
            }
            let Some(sub) = pending.next() else { break };
            let pushed = match deferred.as_deref_mut() {
                Some(d) => enc.push_deferring(sub.id, &sub.op, VECTORED_PAYLOAD_BYTES_MIN, d),
                None => enc.push(sub.id, &sub.op),
            };
            match pushed {
                Ok(()) => {
                    reply_bytes += sub.op.reply_len_max();
                    bulk_bytes += sub.op.bulk_len();
                    batch.push((sub.id, sub.slot));
                }
                Err(e) => sub
                    .slot
                    .complete(Err(ClientError::InvalidArgument(e.to_string()))),
            }
        }
        if enc.count() == 0 {
            return false;
        }
        if let Err(e) = enc.finish() {
            for (_, slot) in batch.drain(..) {
                slot.complete(Err(ClientError::InvalidArgument(e.to_string())));
            }
            return false;
        }
        true
    }
}

/// Frame bodies at least this long are read from the socket straight into an allocation
/// of their own, which becomes the frame's `Bytes` as it is: no copy out of a read buffer
/// (a far-memory scan moved every byte of its 128 KiB READs twice in this process, and the
/// second copy was this one). Shorter frames go through the shared buffer, where many
/// small answers arrive in one read.
pub(crate) const DIRECT_FRAME_BYTES_MIN: usize = 64 << 10;

/// Most bytes one [`FrameReader::fill`] reads into a big frame (in as many reads as the
/// socket needs).
const DIRECT_READ_BYTES_MAX: usize = 1 << 20;

/// Big-frame buffers a connection keeps for its next big frames once their `Bytes` are
/// dropped: a fresh allocation of a few hundred KiB a frame was page-faulted in (and
/// zeroed by the kernel) every time.
const SPARE_BUFFERS_MAX: usize = 2;
/// Buffers larger than this are freed, not kept: what an idle connection holds stays at
/// most `SPARE_BUFFERS_MAX` of these.
const SPARE_BUFFER_BYTES_MAX: usize = FRAME_BYTES_TARGET + (64 << 10);

/// A connection's spare big-frame buffers, shared with the `Bytes` it handed out.
#[derive(Default)]
struct Spares(parking_lot::Mutex<Vec<Vec<u8>>>);

impl Spares {
    /// An empty buffer with room for `len` bytes, reused when one is kept.
    fn take(&self, len: usize) -> Vec<u8> {
        let mut body = self.0.lock().pop().unwrap_or_default();
        body.clear();
        body.reserve_exact(len);
        body
    }
}

/// A big frame's body: given back to its connection's spares when the last `Bytes`
/// sharing it is dropped.
struct SparedBody {
    body: Vec<u8>,
    spares: Arc<Spares>,
}

impl AsRef<[u8]> for SparedBody {
    fn as_ref(&self) -> &[u8] {
        &self.body
    }
}

impl Drop for SparedBody {
    fn drop(&mut self) {
        if self.body.capacity() > SPARE_BUFFER_BYTES_MAX {
            return;
        }
        let mut spares = self.spares.0.lock();
        if spares.len() < SPARE_BUFFERS_MAX {
            spares.push(std::mem::take(&mut self.body));
        }
    }
}

/// What one [`FrameReader::fill`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Filled {
    /// This many bytes arrived (0: a frame was already complete; nothing was read).
    Bytes(usize),
    /// The peer closed the stream.
    Closed,
}

/// Cuts a byte stream into frame bodies. Small frames are read in chunks into one buffer
/// and split off it; a big frame (header says at least [`DIRECT_FRAME_BYTES_MIN`]) gets
/// a buffer of exactly its length, read into without zeroing or copying. Its length is
/// checked against the frame limit before anything is allocated for it.
pub(crate) struct FrameReader {
    buf: BytesMut,
    /// Zeroed once: growing `buf` and zeroing the new room on every read cost more than
    /// copying out of here.
    scratch: Vec<u8>,
    /// A big frame's body so far, and its length.
    big: Option<(Vec<u8>, usize)>,
    spares: Arc<Spares>,
}

impl FrameReader {
    pub(crate) fn new(chunk_bytes: usize) -> FrameReader {
        FrameReader {
            buf: BytesMut::with_capacity(chunk_bytes),
            scratch: vec![0u8; chunk_bytes.max(1)],
            big: None,
            spares: Arc::default(),
        }
    }

    /// One read from `r` (a big frame's rest may take several reads, all into its own
    /// buffer). Errors are `r`'s: `WouldBlock`/`TimedOut` when nothing arrived in time.
    pub(crate) fn fill(&mut self, r: &mut impl std::io::Read) -> std::io::Result<Filled> {
        if let Some((body, len)) = &mut self.big {
            // At most this much a call, so a reader checks its deadline and the answers
            // it waits for between reads of a big frame as it did between chunks.
            let want = (*len - body.len()).min(DIRECT_READ_BYTES_MAX) as u64;
            if want == 0 {
                return Ok(Filled::Bytes(0));
            }
            let before = body.len();
            // `read_to_end` reads into the Vec's spare capacity (no zeroing), keeps what
            // it read when an error ends it, and stops at the frame's end (`take`).
            let res = std::io::Read::read_to_end(&mut std::io::Read::take(r.by_ref(), want), body);
            let got = body.len() - before;
            return match res {
                Ok(_) if got == 0 => Ok(Filled::Closed),
                // Short of `want` without an error: the stream ended mid-frame.
                Ok(_) if (got as u64) < want => Ok(Filled::Closed),
                Ok(_) => Ok(Filled::Bytes(got)),
                Err(_) if got > 0 => Ok(Filled::Bytes(got)),
                Err(e) => Err(e),
            };
        }
        let n = r.read(&mut self.scratch)?;
        if n == 0 {
            return Ok(Filled::Closed);
        }
        self.buf.extend_from_slice(&self.scratch[..n]);
        Ok(Filled::Bytes(n))
    }

    /// The next complete frame's body (length removed), if one is in.
    pub(crate) fn next_frame(&mut self) -> Result<Option<Bytes>, camelot_proto::DecodeError> {
        if let Some((body, len)) = &self.big {
            if body.len() < *len {
                return Ok(None);
            }
            let body = self.big.take().map(|(b, _)| b).unwrap_or_default();
            return Ok(Some(Bytes::from_owner(SparedBody {
                body,
                spares: Arc::clone(&self.spares),
            })));
        }
        if self.buf.len() >= 4 {
            let b = &self.buf;
            let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
            camelot_proto::FrameDecoder::check_len(len)?;
            // `buf` then holds only this frame's first bytes: they move to its buffer.
            if len >= DIRECT_FRAME_BYTES_MIN && self.buf.len() < 4 + len {
                let mut body = self.spares.take(len);
                body.extend_from_slice(&self.buf[4..]);
                self.buf.clear();
                self.big = Some((body, len));
                return Ok(None);
            }
        }
        camelot_proto::FrameDecoder::split_frame(&mut self.buf)
    }
}

/// An answer frame's responses; a FATAL from the server or any other frame is an error
/// that ends the connection.
pub(crate) fn decode_answer(
    addr: SocketAddr,
    body: Bytes,
) -> Result<camelot_proto::ResponseBatch, ClientError> {
    let protocol = |reason: String| ClientError::Protocol { addr, reason };
    match decode_frame(body).map_err(|e| protocol(e.to_string()))? {
        Frame::Responses(b) => Ok(b),
        Frame::Fatal(reply) => Err(ClientError::Fatal { addr, reply }),
        other => Err(protocol(format!("unexpected frame {other:?}"))),
    }
}

/// Hands each answer of `batch` to the request it answers, by position, checking ids.
/// Err (after failing every request of the frame) when the counts differ: the stream is
/// out of step and the connection must end.
pub(crate) fn complete_frame(
    addr: SocketAddr,
    requests: Vec<(u64, Arc<Completion>)>,
    batch: camelot_proto::ResponseBatch,
) -> Result<(), ClientError> {
    let protocol = |reason: String| ClientError::Protocol { addr, reason };
    if requests.len() != batch.responses.len() {
        let err = protocol(format!(
            "{} answers to {} requests",
            batch.responses.len(),
            requests.len()
        ));
        for (_, slot) in requests {
            slot.complete(Err(err.clone()));
        }
        return Err(err);
    }
    // Every answer is stored before anyone is woken (see `Completion::fill`).
    let mut wakers = Vec::new();
    for ((id, slot), resp) in requests.iter().zip(batch.responses) {
        let result = if resp.id == *id {
            resp.result.map_err(ClientError::Server)
        } else {
            Err(protocol(format!("answer id {} for request {id}", resp.id)))
        };
        // Only awaiting tasks leave a waker, so a frame of blocking threads' answers
        // allocates nothing here.
        wakers.extend(slot.fill(result));
    }
    for (_, slot) in &requests {
        slot.wake(None);
    }
    for w in wakers {
        w.wake();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FenceSession;
    use camelot_proto::{ErrorReply, FrameDecoder, HelloOk, Reply, Response, ResponseBatch};
    use proptest::prelude::*;

    fn addr() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 7070))
    }

    fn read(id: u64, len: u32) -> Submission {
        Submission {
            id,
            op: Op::Read {
                region: 1,
                offset: 0,
                len,
            },
            slot: Completion::new(),
        }
    }

    /// Packs every submission into frames and decodes each: (ids per frame).
    fn pack(limits: &FrameLimits, subs: Vec<Submission>) -> Vec<Vec<u64>> {
        let mut pending = subs.into_iter().peekable();
        let mut frames = Vec::new();
        let mut out = BytesMut::new();
        loop {
            let mut batch = Vec::new();
            if !limits.encode_next(&mut out, None, &mut pending, &mut batch) {
                break;
            }
            let body = FrameDecoder::split_frame(&mut out)
                .expect("length in bounds")
                .expect("a whole frame");
            let Ok(Frame::Requests(reqs)) = decode_frame(body) else {
                panic!("not a REQUESTS frame");
            };
            assert_eq!(reqs.epoch, limits.epoch);
            let ids: Vec<u64> = reqs.requests.iter().map(|r| r.id).collect();
            let slots: Vec<u64> = batch.iter().map(|(id, _)| *id).collect();
            assert_eq!(
                ids, slots,
                "the slots taken are the requests encoded, in order"
            );
            frames.push(ids);
        }
        frames
    }

    #[test]
    fn without_batching_every_request_is_its_own_frame() {
        let limits = FrameLimits {
            batching: false,
            batch_ops_max: 100,
            epoch: 3,
        };
        let frames = pack(&limits, (1..=3).map(|id| read(id, 8)).collect());
        assert_eq!(frames, vec![vec![1], vec![2], vec![3]]);
    }

    #[test]
    fn a_frame_stops_at_the_ops_limit_and_at_the_bulk_target() {
        let limits = FrameLimits {
            batching: true,
            batch_ops_max: 2,
            epoch: 0,
        };
        assert_eq!(
            pack(&limits, (1..=5).map(|id| read(id, 8)).collect()),
            vec![vec![1, 2], vec![3, 4], vec![5]]
        );
        // Reads asking for more than the frame target in all start a new frame.
        let limits = FrameLimits {
            batching: true,
            batch_ops_max: 100,
            epoch: 0,
        };
        let big = (FRAME_BYTES_TARGET / 2 + 1) as u32;
        assert_eq!(
            pack(&limits, (1..=3).map(|id| read(id, big)).collect()),
            vec![vec![1], vec![2], vec![3]]
        );
    }

    fn answers(ids: &[u64]) -> ResponseBatch {
        ResponseBatch {
            responses: ids
                .iter()
                .map(|&id| Response {
                    id,
                    result: Ok(Reply::Word(id)),
                })
                .collect(),
        }
    }

    fn slots(ids: &[u64]) -> Vec<(u64, Arc<Completion>)> {
        ids.iter().map(|&id| (id, Completion::new())).collect()
    }

    fn answer_of(slot: &Completion) -> Result<Reply, ClientError> {
        match slot.take_or_wait(false, std::time::Instant::now()) {
            crate::completion::Waited::Answer(r) => r,
            _ => panic!("no answer stored"),
        }
    }

    #[test]
    fn answers_go_to_their_requests_by_position_and_id() {
        let requests = slots(&[7, 8, 9]);
        complete_frame(addr(), requests.clone(), answers(&[7, 8, 9])).expect("in step");
        for (id, slot) in &requests {
            assert_eq!(answer_of(slot).expect("answered"), Reply::Word(*id));
        }
        // A wrong id fails that request only; the frame still lines up.
        let requests = slots(&[1, 2]);
        complete_frame(addr(), requests.clone(), answers(&[1, 5])).expect("counts match");
        assert!(answer_of(&requests[0].1).is_ok());
        assert!(matches!(
            answer_of(&requests[1].1),
            Err(ClientError::Protocol { .. })
        ));
        // A count mismatch means the stream is out of step: all fail, and it is an error.
        let requests = slots(&[1, 2, 3]);
        assert!(complete_frame(addr(), requests.clone(), answers(&[1, 2])).is_err());
        for (_, slot) in &requests {
            assert!(answer_of(slot).is_err());
        }
    }

    #[test]
    fn an_answer_frame_is_responses_or_an_error() {
        let mut buf = BytesMut::new();
        encode_frame(&Frame::Responses(answers(&[1])), &mut buf).expect("encode");
        let body = FrameDecoder::split_frame(&mut buf)
            .expect("ok")
            .expect("frame");
        assert_eq!(
            decode_answer(addr(), body)
                .expect("responses")
                .responses
                .len(),
            1
        );

        let mut buf = BytesMut::new();
        let fatal = ErrorReply::new(ErrorCode::TooLarge, "no");
        encode_frame(&Frame::Fatal(fatal), &mut buf).expect("encode");
        let body = FrameDecoder::split_frame(&mut buf)
            .expect("ok")
            .expect("frame");
        assert!(matches!(
            decode_answer(addr(), body),
            Err(ClientError::Fatal { reply, .. }) if reply.code == ErrorCode::TooLarge
        ));
        assert!(matches!(
            decode_answer(addr(), Bytes::from_static(b"\xffgarbage")),
            Err(ClientError::Protocol { .. })
        ));
    }

    #[test]
    fn a_fence_session_joins_once_per_server_and_presents_that_generation_after() {
        let session = FenceSession::new();
        let config = ClientConfig {
            fence_session: Some(session.clone()),
            ..ClientConfig::default()
        };
        let other: SocketAddr = "127.0.0.1:2".parse().expect("addr");
        let presented = |to: SocketAddr| {
            let mut hello = hello_frame(&config, to).expect("hello");
            let body = FrameDecoder::split_frame(&mut hello)
                .expect("ok")
                .expect("frame");
            match decode_frame(body) {
                Ok(Frame::Hello(h)) => h.fence,
                other => panic!("not a HELLO: {other:?}"),
            }
        };
        assert_eq!(
            presented(addr()),
            Some(0),
            "the first HELLO joins at the current"
        );
        let accepted = |generation: u64| {
            let mut buf = BytesMut::new();
            let ok = Frame::HelloOk(HelloOk {
                version: PROTOCOL_VERSION,
                epoch: 0,
                fence_generation: generation,
            });
            encode_frame(&ok, &mut buf).expect("encode");
            let body = FrameDecoder::split_frame(&mut buf)
                .expect("ok")
                .expect("frame");
            hello_answer(addr(), body, &config).expect("accepted");
        };
        accepted(5);
        assert_eq!(presented(addr()), Some(5));
        // A later answer (a reconnection's) does not move it: the server refuses a
        // generation a fence has passed, and that refusal is the point.
        accepted(9);
        assert_eq!(presented(addr()), Some(5));
        assert_eq!(presented(other), Some(0), "generations are per server");
    }

    #[test]
    fn the_handshake_round_trips_and_refusals_are_typed() {
        let config = ClientConfig {
            token: Some(b"s3cret".to_vec()),
            principal: Some("alice".into()),
            ..ClientConfig::default()
        };
        let mut hello = hello_frame(&config, addr()).expect("hello");
        let body = FrameDecoder::split_frame(&mut hello)
            .expect("ok")
            .expect("frame");
        let Ok(Frame::Hello(h)) = decode_frame(body) else {
            panic!("not a HELLO");
        };
        assert_eq!(
            (h.version, h.token.as_ref(), h.principal.as_str()),
            (PROTOCOL_VERSION, &b"s3cret"[..], "alice")
        );

        let answer = |frame: Frame| {
            let mut buf = BytesMut::new();
            encode_frame(&frame, &mut buf).expect("encode");
            let body = FrameDecoder::split_frame(&mut buf)
                .expect("ok")
                .expect("frame");
            hello_answer(addr(), body, &ClientConfig::default())
        };
        let ok = answer(Frame::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            epoch: 42,
            fence_generation: 1,
        }));
        assert_eq!(ok.expect("accepted"), 42);
        assert_eq!(h.fence, None, "an ordinary client is no fenceable session");
        let refused = answer(Frame::Fatal(ErrorReply::new(
            ErrorCode::AuthFailed,
            "bad token",
        )));
        assert!(matches!(refused, Err(ClientError::Auth { .. })));
        let other = answer(Frame::Responses(answers(&[])));
        assert!(matches!(other, Err(ClientError::Handshake { .. })));
        // A token longer than the protocol allows is refused before anything is sent.
        let long = ClientConfig {
            token: Some(vec![b'x'; 4096]),
            ..ClientConfig::default()
        };
        assert!(matches!(
            hello_frame(&long, addr()),
            Err(ClientError::InvalidArgument(_))
        ));
    }

    proptest! {
        #[test]
        fn packing_keeps_every_request_once_in_order_within_the_limits(
            lens in proptest::collection::vec(0u32..(FRAME_BYTES_TARGET as u32), 1..60),
            batch_ops_max in 1usize..16,
            batching in any::<bool>(),
        ) {
            let limits = FrameLimits { batching, batch_ops_max, epoch: 1 };
            let n = lens.len() as u64;
            let subs = lens.iter().zip(1..).map(|(&len, id)| read(id, len)).collect();
            let frames = pack(&limits, subs);
            let all: Vec<u64> = frames.iter().flatten().copied().collect();
            prop_assert_eq!(all, (1..=n).collect::<Vec<_>>());
            for f in &frames {
                prop_assert!(!f.is_empty());
                let ops_max = if batching { batch_ops_max } else { 1 };
                prop_assert!(f.len() <= ops_max);
                let bulk: u64 = f.iter().map(|id| u64::from(lens[(*id - 1) as usize])).sum();
                // The bulk target holds unless one request alone is over it.
                prop_assert!(f.len() == 1 || bulk <= FRAME_BYTES_TARGET as u64);
            }
        }
    }

    /// A stream that hands out its bytes in the given read sizes, answering `WouldBlock`
    /// where a size is 0 (a read timeout with nothing in), then end of stream.
    struct Trickle {
        data: Vec<u8>,
        at: usize,
        sizes: Vec<usize>,
        next: usize,
    }

    impl std::io::Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let size = self.sizes[self.next % self.sizes.len()];
            self.next += 1;
            if size == 0 && self.at < self.data.len() {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            let n = size.max(1).min(out.len()).min(self.data.len() - self.at);
            out[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    /// Every body `r` yields until the stream closes, or the decode error.
    fn read_all(r: &mut Trickle, chunk: usize) -> Result<Vec<Bytes>, camelot_proto::DecodeError> {
        let mut frames = FrameReader::new(chunk);
        let mut bodies = Vec::new();
        // Bounded: every cycle through the sizes moves at least one byte (each has a
        // non-zero size), so the stream ends within this many calls.
        for _ in 0..(r.data.len() + 1) * r.sizes.len() * 2 + 10 {
            while let Some(body) = frames.next_frame()? {
                bodies.push(body);
            }
            match frames.fill(r) {
                Ok(Filled::Closed) => break,
                Ok(Filled::Bytes(_)) => {}
                Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock),
            }
        }
        Ok(bodies)
    }

    fn framed(bodies: &[Vec<u8>]) -> Vec<u8> {
        let mut data = Vec::new();
        for b in bodies {
            data.extend_from_slice(&(b.len() as u32).to_le_bytes());
            data.extend_from_slice(b);
        }
        data
    }

    #[test]
    fn big_frame_buffers_are_reused_with_only_their_own_frame_s_bytes() {
        let bodies: Vec<Vec<u8>> = (0..6u8)
            .map(|i| vec![i + 1; DIRECT_FRAME_BYTES_MIN + 1000 * usize::from(5 - i)])
            .collect();
        let mut r = Trickle {
            data: framed(&bodies),
            at: 0,
            sizes: vec![50_000],
            next: 0,
        };
        let mut frames = FrameReader::new(4096);
        let mut seen = 0;
        for _ in 0..1000 {
            // Each body is checked and dropped before the next frame is read, so its
            // buffer goes back to the spares and carries the next one.
            while let Some(body) = frames.next_frame().expect("valid frames") {
                assert_eq!(&body[..], &bodies[seen][..], "frame {seen}");
                seen += 1;
            }
            assert!(frames.spares.0.lock().len() <= SPARE_BUFFERS_MAX);
            if frames.fill(&mut r).expect("no error") == Filled::Closed {
                break;
            }
        }
        assert_eq!(seen, bodies.len());
        assert_eq!(frames.spares.0.lock().len(), 1, "the last buffer came back");
    }

    #[test]
    fn a_big_frame_cut_off_mid_body_is_a_closed_stream_not_a_frame() {
        let body = vec![5u8; DIRECT_FRAME_BYTES_MIN * 2];
        let mut data = framed(&[body]);
        data.truncate(DIRECT_FRAME_BYTES_MIN);
        let mut r = Trickle {
            data,
            at: 0,
            sizes: vec![1000],
            next: 0,
        };
        assert!(read_all(&mut r, 4096).expect("no decode error").is_empty());
    }

    #[test]
    fn an_impossible_length_is_refused_before_anything_is_allocated_for_it() {
        let mut data = ((FRAME_BYTES_MAX + 1) as u32).to_le_bytes().to_vec();
        data.extend_from_slice(&[0; 64]);
        let mut r = Trickle {
            data,
            at: 0,
            sizes: vec![68],
            next: 0,
        };
        assert!(read_all(&mut r, 4096).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// However the bytes arrive, small and big frames come out whole, in order, and
        /// nothing else does.
        #[test]
        fn frames_come_out_as_they_went_in_however_the_reads_cut_them(
            lens in proptest::collection::vec(
                prop_oneof![1usize..300, DIRECT_FRAME_BYTES_MIN - 4..DIRECT_FRAME_BYTES_MIN * 3],
                1..8,
            ),
            sizes in proptest::collection::vec(
                prop_oneof![Just(0usize), 1usize..512, 1usize..70_000],
                1..12,
            ),
            chunk in prop_oneof![Just(7usize), Just(4096usize), Just(256usize << 10)],
        ) {
            let bodies: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| (i * 31 + j * 7) as u8).collect())
                .collect();
            let mut sizes = sizes;
            sizes.push(1);
            let mut r = Trickle { data: framed(&bodies), at: 0, sizes, next: 0 };
            let got = read_all(&mut r, chunk).expect("valid frames");
            prop_assert_eq!(got.len(), bodies.len());
            for (g, b) in got.iter().zip(&bodies) {
                prop_assert_eq!(&g[..], &b[..]);
            }
        }
    }
}
