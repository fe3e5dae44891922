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

/// A HELLO frame for `config`'s token and principal.
pub(crate) fn hello_frame(config: &ClientConfig) -> Result<BytesMut, ClientError> {
    let mut buf = BytesMut::new();
    encode_frame(
        &Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: Bytes::from(config.token.clone().unwrap_or_default()),
            principal: config.principal.clone().unwrap_or_default(),
        }),
        &mut buf,
    )
    .map_err(|e| ClientError::InvalidArgument(format!("HELLO: {e}")))?;
    Ok(buf)
}

/// A handshake answer is tiny; a bigger one is not from a Camelot server, and is refused
/// before anything is buffered for it.
pub(crate) const HELLO_ANSWER_BYTES_MAX: usize = 4096;

/// The cluster epoch from the server's answer to HELLO (its body, length removed).
pub(crate) fn hello_answer(addr: SocketAddr, body: Bytes) -> Result<u64, ClientError> {
    match decode_frame(body) {
        Ok(Frame::HelloOk(ok)) => Ok(ok.epoch),
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

/// An answer frame's responses; a FATAL from the server or any other frame is an error
/// that ends the connection.
pub(crate) fn decode_answer(
    addr: SocketAddr,
    body: Bytes,
) -> Result<camelot_proto::ResponseBatch, ClientError> {
    let protocol = |reason: String| ClientError::Protocol { addr, reason };
    match decode_frame(body).map_err(|e| protocol(e.to_string()))? {
        Frame::Responses(b) => Ok(b),
        Frame::Fatal(e) => Err(ClientError::Server(e)),
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
            Err(ClientError::Server(_))
        ));
        assert!(matches!(
            decode_answer(addr(), Bytes::from_static(b"\xffgarbage")),
            Err(ClientError::Protocol { .. })
        ));
    }

    #[test]
    fn the_handshake_round_trips_and_refusals_are_typed() {
        let config = ClientConfig {
            token: Some(b"s3cret".to_vec()),
            principal: Some("alice".into()),
            ..ClientConfig::default()
        };
        let mut hello = hello_frame(&config).expect("hello");
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
            hello_answer(addr(), body)
        };
        let ok = answer(Frame::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            epoch: 42,
        }));
        assert_eq!(ok.expect("accepted"), 42);
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
            hello_frame(&long),
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
}
