use bytes::{Bytes, BytesMut};
use camelot_proto::limits::*;
use camelot_proto::*;
use proptest::prelude::*;

fn name() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9/_.-]{1,40}"
}

fn blob(max: usize) -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn mode() -> impl Strategy<Value = AccessMode> {
    prop_oneof![Just(AccessMode::Private), Just(AccessMode::Shared)]
}

fn object_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        blob(40).prop_map(|key| Op::Get { key }),
        blob(40).prop_map(|key| Op::Delete { key }),
        (blob(40), blob(300)).prop_map(|(key, value)| Op::Put { key, value }),
        (blob(40), any::<u64>(), blob(300)).prop_map(|(key, expected_version, value)| {
            Op::CasPut {
                key,
                expected_version,
                value,
            }
        }),
        (blob(40), 0..=SCAN_ITEMS_MAX as u32).prop_map(|(start, limit)| Op::Scan { start, limit }),
        (
            proptest::option::of(blob(40)),
            0..=SCAN_ITEMS_MAX as u32,
            0u32..3000,
            any::<u64>(),
            any::<bool>(),
            any::<u64>(),
            proptest::option::of(any::<u32>()),
        )
            .prop_map(
                |(after, limit, partitions, since_version, keys_only, seed, push_to)| {
                    // Marks every partition whose bit in the seed's 64-bit cycle is set.
                    let marked = (0..partitions).filter(|p| seed >> (p % 64) & 1 == 1);
                    Op::ScanPartitions {
                        after,
                        limit,
                        partitions,
                        mask: partition_mask(partitions, marked),
                        since_version,
                        keys_only,
                        push_to,
                    }
                }
            ),
        (blob(40), any::<u64>(), proptest::option::of(blob(300))).prop_map(
            |(key, version, value)| Op::Apply {
                key,
                version,
                value
            }
        ),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        object_op(),
        Just(Op::Ping),
        Just(Op::Fence),
        Just(Op::Stats),
        Just(Op::List),
        (0..REGION_BYTES_MAX, proptest::option::of(name()), mode())
            .prop_map(|(size, name, mode)| Op::Alloc { size, name, mode }),
        name().prop_map(|name| Op::Lookup { name }),
        any::<u64>().prop_map(|region| Op::Free { region }),
        (any::<u64>(), any::<u64>(), 0..=IO_BYTES_MAX as u32).prop_map(|(region, offset, len)| {
            Op::Read {
                region,
                offset,
                len,
            }
        }),
        (
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(region, offset, data)| Op::Write {
                region,
                offset,
                data: Bytes::from(data)
            }),
        (
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>()
            ),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(
                |((region, offset, guard_region, guard_offset, expected), data)| Op::WriteIf {
                    region,
                    offset,
                    guard_region,
                    guard_offset,
                    expected,
                    data: Bytes::from(data)
                }
            ),
        (
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(region, offset, data)| Op::Swap {
                region,
                offset,
                data: Bytes::from(data)
            }),
        (
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(region, offset, data)| Op::XorInto {
                region,
                offset,
                data: Bytes::from(data)
            }),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
            |(region, offset, expected, new)| Op::Cas {
                region,
                offset,
                expected,
                new
            }
        ),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(region, offset, delta)| {
            Op::FetchAdd {
                region,
                offset,
                delta,
            }
        }),
    ]
}

fn region_info() -> impl Strategy<Value = RegionInfo> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::option::of(name()),
        mode(),
    )
        .prop_map(|(id, size, name, mode)| RegionInfo {
            id,
            size,
            name,
            mode,
        })
}

/// Up to ten scanned items, as SCAN and SCAN_PARTITIONS answer them.
fn items() -> impl Strategy<Value = Vec<Item>> {
    proptest::collection::vec(
        (blob(40), any::<u64>(), blob(100)).prop_map(|(key, version, value)| Item {
            key,
            version,
            value,
        }),
        0..10,
    )
}

fn error_reply() -> impl Strategy<Value = ErrorReply> {
    (1u16..40, ".{0,60}", any::<u64>())
        .prop_map(|(c, m, e)| ErrorReply::with_epoch(ErrorCode::from_u16(c), m, e))
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        Just(Reply::Pong),
        Just(Reply::Done),
        any::<u64>().prop_map(Reply::Word),
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(|d| Reply::Data(Bytes::from(d))),
        region_info().prop_map(Reply::Region),
        proptest::collection::vec(region_info(), 0..10).prop_map(Reply::List),
        proptest::collection::vec(("[a-z_]{1,20}", any::<u64>()), 0..10).prop_map(Reply::Stats),
        (any::<u64>(), blob(300)).prop_map(|(version, value)| Reply::Object { version, value }),
        any::<u64>().prop_map(Reply::Version),
        items().prop_map(Reply::Items),
        (
            items(),
            proptest::option::of(blob(40)),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(
                |(items, resume_after, version_clock, pushed_bytes)| Reply::Page(Page {
                    items,
                    resume_after,
                    version_clock,
                    pushed_bytes,
                })
            ),
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (
            any::<u16>(),
            proptest::collection::vec(any::<u8>(), 0..=TOKEN_BYTES_MAX),
            "[a-z0-9._-]{0,64}",
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(version, token, principal, fence)| Frame::Hello(Hello {
                version,
                token: Bytes::from(token),
                principal,
                fence,
            })),
        (any::<u16>(), any::<u64>(), any::<u64>()).prop_map(
            |(version, epoch, fence_generation)| Frame::HelloOk(HelloOk {
                version,
                epoch,
                fence_generation
            })
        ),
        (
            any::<u64>(),
            proptest::collection::vec((any::<u64>(), op()), 0..20)
        )
            .prop_map(|(epoch, reqs)| Frame::Requests(RequestBatch {
                epoch,
                requests: reqs
                    .into_iter()
                    .map(|(id, op)| Request { id, op })
                    .collect()
            })),
        proptest::collection::vec(
            (
                any::<u64>(),
                prop_oneof![reply().prop_map(Ok), error_reply().prop_map(Err)]
            ),
            0..20
        )
        .prop_map(|rs| Frame::Responses(ResponseBatch {
            responses: rs
                .into_iter()
                .map(|(id, result)| Response { id, result })
                .collect()
        })),
        error_reply().prop_map(Frame::Fatal),
    ]
}

fn split_one(buf: &mut BytesMut) -> Bytes {
    FrameDecoder::split_frame(buf)
        .unwrap()
        .expect("a whole frame")
}

proptest! {
    #[test]
    fn frames_round_trip(f in frame()) {
        let mut buf = BytesMut::new();
        encode_frame(&f, &mut buf).unwrap();
        let body = split_one(&mut buf);
        prop_assert!(buf.is_empty());
        prop_assert_eq!(decode_frame(body).unwrap(), f);
    }

    #[test]
    fn encoded_len_is_exact(id in any::<u64>(), o in op()) {
        let mut buf = BytesMut::new();
        let mut enc = RequestBatchEncoder::begin(&mut buf, 0);
        let before = enc.frame_len();
        enc.push(id, &o).unwrap();
        prop_assert_eq!(enc.frame_len() - before, o.encoded_len());
    }

    #[test]
    fn deferred_payloads_reassemble_to_the_copied_frame(
        ops in proptest::collection::vec(op(), 1..12),
        min_bytes in 0usize..200,
    ) {
        let mut copied = BytesMut::new();
        let mut enc = RequestBatchEncoder::begin(&mut copied, 7);
        for (id, o) in ops.iter().enumerate() {
            enc.push(id as u64, o).unwrap();
        }
        let copied_len = enc.frame_len();
        enc.finish().unwrap();

        let mut head = BytesMut::new();
        let mut deferred = Vec::new();
        let mut enc = RequestBatchEncoder::begin(&mut head, 7);
        for (id, o) in ops.iter().enumerate() {
            enc.push_deferring(id as u64, o, min_bytes, &mut deferred).unwrap();
        }
        prop_assert_eq!(enc.frame_len(), copied_len);
        enc.finish().unwrap();
        prop_assert!(deferred.iter().all(|(_, d)| d.len() >= min_bytes));
        let mut wire = Vec::new();
        let mut at = 0;
        for (offset, data) in &deferred {
            prop_assert!(*offset >= at);
            wire.extend_from_slice(&head[at..*offset]);
            wire.extend_from_slice(data);
            at = *offset;
        }
        wire.extend_from_slice(&head[at..]);
        prop_assert_eq!(&wire[..], &copied[..]);
    }

    #[test]
    fn reply_len_max_bounds_the_reply(id in any::<u64>(), r in reply()) {
        // For the ops whose reply size is fixed by the request, the bound must hold.
        let op = match &r {
            Reply::Data(d) => Op::Read { region: 0, offset: 0, len: d.len() as u32 },
            Reply::Word(_) => Op::FetchAdd { region: 0, offset: 0, delta: 0 },
            Reply::Region(_) => Op::Lookup { name: "x".into() },
            Reply::List(_) => Op::List,
            Reply::Stats(_) => Op::Stats,
            Reply::Pong => Op::Ping,
            Reply::Done => Op::Free { region: 0 },
            Reply::Object { .. } => Op::Get { key: Bytes::new() },
            Reply::Version(_) => Op::Put { key: Bytes::new(), value: Bytes::new() },
            Reply::Items(_) => Op::Scan { start: Bytes::new(), limit: 10 },
            Reply::Page(_) => Op::ScanPartitions {
                after: None,
                limit: 10,
                partitions: 8,
                mask: Bytes::from_static(&[0xff]),
                since_version: 0,
                keys_only: false,
                push_to: None,
            },
        };
        let mut buf = BytesMut::new();
        let mut enc = ResponseBatchEncoder::begin(&mut buf);
        let before = enc.frame_len();
        enc.push_ok(id, &r).unwrap();
        prop_assert!(enc.frame_len() - before <= op.reply_len_max());
    }

    #[test]
    fn push_object_encodes_exactly_as_an_object_reply(id in any::<u64>(), version in any::<u64>(), value in blob(300)) {
        let mut direct = BytesMut::new();
        let mut enc = ResponseBatchEncoder::begin(&mut direct);
        enc.push_object(id, version, &value).unwrap();
        enc.finish().unwrap();
        let mut built = BytesMut::new();
        let mut enc = ResponseBatchEncoder::begin(&mut built);
        enc.push_ok(id, &Reply::Object { version, value }).unwrap();
        enc.finish().unwrap();
        prop_assert_eq!(direct, built);
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = decode_frame(Bytes::from(body.clone()));
        let mut buf = BytesMut::from(&body[..]);
        while let Ok(Some(f)) = FrameDecoder::split_frame(&mut buf) {
            let _ = decode_frame(f);
        }
    }

    #[test]
    fn mutated_frames_never_panic(f in frame(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut buf = BytesMut::new();
        encode_frame(&f, &mut buf).unwrap();
        let mut body = split_one(&mut buf).to_vec();
        for (i, v) in flips {
            let n = body.len();
            body[i % n] = v;
        }
        let _ = decode_frame(Bytes::from(body));
    }

    #[test]
    fn truncated_frames_are_errors(f in frame(), cut in any::<usize>()) {
        let mut buf = BytesMut::new();
        encode_frame(&f, &mut buf).unwrap();
        let body = split_one(&mut buf);
        let cut = 1 + cut % body.len();
        // A HELLO ending after its token is version 1's layout, which decodes (with no
        // principal) so that an old client is told VERSION_MISMATCH.
        let v1_hello_len = match &f {
            Frame::Hello(h) => Some(1 + 4 + 2 + 1 + h.token.len()),
            _ => None,
        };
        if cut < body.len() && Some(cut) != v1_hello_len {
            prop_assert!(decode_frame(body.slice(..cut)).is_err());
        }
    }
}

fn hello_v1(token: &[u8]) -> Bytes {
    let mut body = vec![1u8];
    body.extend_from_slice(&HELLO_MAGIC);
    body.extend_from_slice(&1u16.to_le_bytes());
    body.push(token.len() as u8);
    body.extend_from_slice(token);
    Bytes::from(body)
}

#[test]
fn a_version_1_hello_decodes_with_no_principal() {
    assert_eq!(
        decode_frame(hello_v1(b"tok")).unwrap(),
        Frame::Hello(Hello {
            version: 1,
            token: Bytes::from_static(b"tok"),
            principal: String::new(),
            fence: None,
        })
    );
}

#[test]
fn principals_and_modes_are_bounded_and_checked() {
    let mut buf = BytesMut::new();
    let long = Hello {
        version: PROTOCOL_VERSION,
        token: Bytes::new(),
        principal: "p".repeat(PRINCIPAL_BYTES_MAX + 1),
        fence: None,
    };
    assert!(encode_frame(&Frame::Hello(long), &mut buf).is_err());
    assert!(buf.is_empty());
    // The same, hand-built: a decoder must refuse it too.
    let mut body = hello_v1(b"").to_vec();
    body.push((PRINCIPAL_BYTES_MAX + 1) as u8);
    body.extend_from_slice(&[b'p'; PRINCIPAL_BYTES_MAX + 1]);
    assert!(matches!(
        decode_frame(Bytes::from(body)),
        Err(DecodeError::LimitExceeded { .. })
    ));
    // The biggest legal HELLO is exactly what a server accepts before the handshake.
    let biggest = Hello {
        version: PROTOCOL_VERSION,
        token: Bytes::from(vec![7u8; TOKEN_BYTES_MAX]),
        principal: "p".repeat(PRINCIPAL_BYTES_MAX),
        fence: Some(u64::MAX),
    };
    encode_frame(&Frame::Hello(biggest), &mut buf).unwrap();
    assert_eq!(buf.len(), 4 + HELLO_BODY_BYTES_MAX);
    // An ALLOC with an access mode no version defines is a bad frame.
    let mut buf = BytesMut::new();
    let mut enc = RequestBatchEncoder::begin(&mut buf, 0);
    let alloc = Op::Alloc {
        size: 1,
        name: None,
        mode: AccessMode::Shared,
    };
    enc.push(1, &alloc).unwrap();
    enc.finish().unwrap();
    let mut body = split_one(&mut buf).to_vec();
    let last = body.len() - 1;
    assert_eq!(body[last], AccessMode::Shared as u8);
    body[last] = 2;
    assert_eq!(
        decode_frame(Bytes::from(body)),
        Err(DecodeError::Invalid("access mode"))
    );
}

#[test]
fn new_error_codes_round_trip_and_are_distinct() {
    for code in [ErrorCode::QuotaExceeded, ErrorCode::Forbidden] {
        assert_eq!(ErrorCode::from_u16(code.to_u16()), code);
        assert_ne!(code, ErrorCode::OutOfMemory);
    }
    assert_eq!(ErrorCode::QuotaExceeded.to_string(), "QUOTA_EXCEEDED");
    assert_ne!(
        ErrorCode::QuotaExceeded.to_u16(),
        ErrorCode::OutOfMemory.to_u16()
    );
}

#[test]
fn oversized_length_prefix_is_refused_before_buffering() {
    let mut buf = BytesMut::new();
    buf.extend_from_slice(&((FRAME_BYTES_MAX as u32) + 1).to_le_bytes());
    assert!(matches!(
        FrameDecoder::split_frame(&mut buf),
        Err(DecodeError::FrameTooLarge { .. })
    ));
    let mut zero = BytesMut::from(&[0u8, 0, 0, 0][..]);
    assert_eq!(
        FrameDecoder::split_frame(&mut zero),
        Err(DecodeError::EmptyFrame)
    );
}

#[test]
fn huge_counts_are_refused_without_allocating() {
    // REQUESTS frame claiming 4096 requests but carrying none.
    let mut body = vec![3u8];
    body.extend_from_slice(&0u64.to_le_bytes());
    body.extend_from_slice(&4096u16.to_le_bytes());
    assert!(matches!(
        decode_frame(Bytes::from(body)),
        Err(DecodeError::Truncated { .. })
    ));
    // More than the batch limit.
    let mut body = vec![3u8];
    body.extend_from_slice(&0u64.to_le_bytes());
    body.extend_from_slice(&5000u16.to_le_bytes());
    assert!(matches!(
        decode_frame(Bytes::from(body)),
        Err(DecodeError::LimitExceeded { .. })
    ));
}

#[test]
fn a_refused_request_defers_nothing() {
    let mut buf = BytesMut::new();
    let mut deferred = Vec::new();
    let mut enc = RequestBatchEncoder::begin(&mut buf, 0);
    let before = enc.frame_len();
    let too_long_key = Op::Put {
        key: Bytes::from(vec![0u8; KEY_BYTES_MAX + 1]),
        value: Bytes::from(vec![1u8; 4096]),
    };
    assert!(enc
        .push_deferring(1, &too_long_key, 1, &mut deferred)
        .is_err());
    let too_long_value = Op::Write {
        region: 1,
        offset: 0,
        data: Bytes::from(vec![1u8; IO_BYTES_MAX + 1]),
    };
    assert!(enc
        .push_deferring(2, &too_long_value, 1, &mut deferred)
        .is_err());
    assert!(deferred.is_empty());
    assert_eq!(enc.frame_len(), before);
    assert_eq!(enc.count(), 0);
}

#[test]
fn partition_masks_mark_exactly_what_they_were_given() {
    let mask = partition_mask(20, [0, 7, 8, 19, 20, 400]);
    assert_eq!(mask.len(), 3);
    let marked: Vec<u32> = (0..40).filter(|p| mask_marks(&mask, *p)).collect();
    assert_eq!(marked, vec![0, 7, 8, 19]);
}

#[test]
fn a_scan_mask_of_the_wrong_size_is_refused_both_ways() {
    let mut buf = BytesMut::new();
    let mut enc = RequestBatchEncoder::begin(&mut buf, 0);
    let op = Op::ScanPartitions {
        after: None,
        limit: 1,
        partitions: 1024,
        mask: Bytes::from_static(&[0xff]),
        since_version: 0,
        keys_only: true,
        push_to: None,
    };
    assert!(enc.push(1, &op).is_err());
    // Hand-made: a mask claiming more partitions than the limit is refused on decode.
    let good = Op::ScanPartitions {
        after: Some(Bytes::from_static(b"k")),
        limit: 1,
        partitions: 8,
        mask: Bytes::from_static(&[0x01]),
        since_version: 5,
        keys_only: false,
        push_to: Some(3),
    };
    let mut buf = BytesMut::new();
    let mut enc = RequestBatchEncoder::begin(&mut buf, 0);
    enc.push(1, &good).unwrap();
    enc.finish().unwrap();
    let body = split_one(&mut buf);
    let Frame::Requests(batch) = decode_frame(body.clone()).unwrap() else {
        panic!("not a request batch");
    };
    assert_eq!(batch.requests[0].op, good);
    // The partition count sits after kind, epoch, count, id, op, flag, key, limit.
    let at = 1 + 8 + 2 + 8 + 1 + 1 + 2 + 1 + 4;
    let mut bad = body.to_vec();
    bad[at..at + 4].copy_from_slice(&(SCAN_PARTITIONS_MAX + 1).to_le_bytes());
    assert!(decode_frame(Bytes::from(bad)).is_err());
    // The push flag and node end the op (and the batch): a flag other than 0 or 1, or a
    // node beside a flag of 0, is refused rather than read as some push.
    let flag_at = body.len() - 5;
    for (flag, node) in [(2u8, 3u32), (0, 3)] {
        let mut bad = body.to_vec();
        bad[flag_at] = flag;
        bad[flag_at + 1..].copy_from_slice(&node.to_le_bytes());
        assert!(
            decode_frame(Bytes::from(bad)).is_err(),
            "flag {flag} node {node}"
        );
    }
}

#[test]
fn batch_limit_is_enforced_by_encoder() {
    let mut buf = BytesMut::new();
    let mut enc = RequestBatchEncoder::begin(&mut buf, 0);
    for i in 0..BATCH_OPS_MAX {
        enc.push(i as u64, &Op::Ping).unwrap();
    }
    assert!(enc.push(0, &Op::Ping).is_err());
    enc.finish().unwrap();
    let body = FrameDecoder::split_frame(&mut buf).unwrap().unwrap();
    match decode_frame(body).unwrap() {
        Frame::Requests(b) => assert_eq!(b.requests.len(), BATCH_OPS_MAX),
        other => panic!("unexpected {other:?}"),
    }
}

proptest! {
    /// A READ reply appended from a slice is byte for byte the one filled in place,
    /// whatever precedes it in the frame.
    #[test]
    fn push_data_encodes_like_push_data_with(
        data in proptest::collection::vec(any::<u8>(), 0..5000),
        before in 0usize..3,
        id in any::<u64>(),
    ) {
        let encode = |from_slice: bool| {
            let mut buf = BytesMut::new();
            let mut enc = ResponseBatchEncoder::begin(&mut buf);
            for i in 0..before {
                enc.push_ok(i as u64, &Reply::Word(i as u64)).unwrap();
            }
            if from_slice {
                enc.push_data(id, &data).unwrap();
            } else {
                enc.push_data_with(id, data.len(), |d| d.copy_from_slice(&data)).unwrap();
            }
            enc.finish().unwrap();
            buf
        };
        let (sliced, filled) = (encode(true), encode(false));
        prop_assert_eq!(&sliced[..], &filled[..]);
        let mut buf = sliced;
        let body = FrameDecoder::split_frame(&mut buf).unwrap().unwrap();
        let Frame::Responses(b) = decode_frame(body).unwrap() else {
            panic!("not responses")
        };
        prop_assert_eq!(
            b.responses[before].result.clone(),
            Ok(Reply::Data(Bytes::from(data.clone())))
        );
    }
}

#[test]
fn push_data_refuses_more_than_a_read_may_carry() {
    let mut buf = BytesMut::new();
    let mut enc = ResponseBatchEncoder::begin(&mut buf);
    let big = vec![0u8; camelot_proto::limits::IO_BYTES_MAX + 1];
    assert!(enc.push_data(1, &big).is_err());
    enc.push_data(2, &big[..16]).unwrap();
    enc.finish().unwrap();
}

#[test]
fn push_data_with_fills_in_place() {
    let mut buf = BytesMut::new();
    let mut enc = ResponseBatchEncoder::begin(&mut buf);
    enc.push_data_with(7, 5, |d| d.copy_from_slice(b"hello"))
        .unwrap();
    enc.push_err(8, &ErrorReply::new(ErrorCode::OutOfBounds, "past the end"))
        .unwrap();
    enc.finish().unwrap();
    let body = FrameDecoder::split_frame(&mut buf).unwrap().unwrap();
    let Frame::Responses(b) = decode_frame(body).unwrap() else {
        panic!("not responses")
    };
    assert_eq!(
        b.responses[0].result,
        Ok(Reply::Data(Bytes::from_static(b"hello")))
    );
    assert_eq!(
        b.responses[1].result.as_ref().unwrap_err().code,
        ErrorCode::OutOfBounds
    );
}

#[test]
fn long_messages_are_cut_on_char_boundaries() {
    let e = ErrorReply::new(ErrorCode::Internal, "é".repeat(MESSAGE_BYTES_MAX));
    assert!(e.message.len() <= MESSAGE_BYTES_MAX);
    let mut buf = BytesMut::new();
    encode_frame(&Frame::Fatal(e.clone()), &mut buf).unwrap();
    let body = FrameDecoder::split_frame(&mut buf).unwrap().unwrap();
    assert_eq!(decode_frame(body).unwrap(), Frame::Fatal(e));
}

#[test]
fn key_hash_never_changes() {
    // Placement of every stored key depends on these; a change would strand data.
    assert_eq!(key_hash(b""), 0xefd0_1f60_ba99_2926);
    assert_eq!(key_hash(b"user1"), 0xcaf6_72d6_3552_cd57);
    assert_eq!(key_hash(b"user2"), 0x8cdf_f66b_0700_78b9);
}

#[test]
fn partition_of_never_changes() {
    // The high half of key_hash modulo the count; clients and cluster servers must agree.
    assert_eq!(camelot_proto::partition_of(b"", 1024), 864);
    assert_eq!(camelot_proto::partition_of(b"user1", 1024), 726);
    assert_eq!(camelot_proto::partition_of(b"user2", 1024), 619);
    assert_eq!(camelot_proto::partition_of(b"user1", 7), 6);
    assert_eq!(camelot_proto::partition_of(b"user2", 7), 4);
    assert_eq!(camelot_proto::partition_of(b"user2", 0), 0);
}

#[test]
fn moved_and_stale_epoch_errors_carry_the_server_epoch() {
    for code in [ErrorCode::Moved, ErrorCode::StaleEpoch] {
        let mut buf = BytesMut::new();
        let mut enc = ResponseBatchEncoder::begin(&mut buf);
        enc.push_err(3, &ErrorReply::with_epoch(code, "elsewhere", 42))
            .unwrap();
        enc.push_err(4, &ErrorReply::new(ErrorCode::NoSuchKey, "none"))
            .unwrap();
        enc.finish().unwrap();
        let body = FrameDecoder::split_frame(&mut buf).unwrap().unwrap();
        let Frame::Responses(r) = decode_frame(body.clone()).unwrap() else {
            panic!("not responses");
        };
        assert_eq!(r.responses[0].result.as_ref().unwrap_err().epoch, 42);
        assert_eq!(r.responses[1].result.as_ref().unwrap_err().epoch, 0);
        // Cut inside the first error's epoch: truncated, never a wrong epoch.
        let cut = body.len() - (8 + 2 + 2 + 4) - 4;
        assert!(decode_frame(body.slice(..cut)).is_err());
    }
    assert_eq!(ErrorCode::from_u16(19), ErrorCode::Moved);
    assert_eq!(ErrorCode::Moved.to_string(), "MOVED");
    // Codes that carry no epoch drop one given to them.
    assert_eq!(ErrorReply::with_epoch(ErrorCode::Internal, "x", 9).epoch, 0);
}
