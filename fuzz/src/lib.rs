//! The fuzz targets' bodies, one function each, so the same code runs under libFuzzer
//! (`fuzz_targets/*.rs`, nightly) and under the stable corpus runner (`tests/corpus.rs`,
//! which replays `corpus/<target>/` and then mutates it, see [`mutate`]).
#![forbid(unsafe_code)]

pub mod mutate;

use bytes::{Bytes, BytesMut};
use camelot_proto::{
    decode_frame as decode, encode_frame, Frame, FrameDecoder, Op, ResponseBatchEncoder,
};
use camelot_server::{MemoryBudget, Principal, Quota, ServerState};

/// A target's body: runs one input, panics on a defect.
pub type Body = fn(&[u8]);

/// Every target by name, as `corpus/<name>/` and `fuzz_targets/<name>.rs` are named.
pub const TARGETS: &[(&str, Body)] = &[
    ("decode_frame", decode_frame),
    ("frame_stream", frame_stream),
    ("exec_batch", exec_batch),
    ("resp_command", resp_command),
    ("memcached_reply", memcached_reply),
    ("decode_netctl", decode_netctl),
    ("rvm_record", rvm_record),
    ("decode_superblock", decode_superblock),
    ("nbd_session", nbd_session),
    ("clover_wire", clover_wire),
];

/// Any frame body a peer can send: HELLO, REQUESTS, RESPONSES, FATAL. Decoding must never
/// panic, and whatever decodes must re-encode to a frame that decodes to the same value.
pub fn decode_frame(data: &[u8]) {
    if let Ok(frame) = decode(Bytes::copy_from_slice(data)) {
        let mut buf = BytesMut::new();
        if encode_frame(&frame, &mut buf).is_ok() {
            let body = FrameDecoder::split_frame(&mut buf)
                .expect("own encoding has a valid length")
                .expect("own encoding is whole");
            assert_eq!(decode(body).expect("own encoding decodes"), frame);
        }
    }
}

/// A byte stream as it arrives on a socket: length prefixes and bodies, possibly split
/// or lying about their length.
pub fn frame_stream(data: &[u8]) {
    let mut buf = BytesMut::new();
    for chunk in data.chunks(7) {
        buf.extend_from_slice(chunk);
        loop {
            match FrameDecoder::split_frame(&mut buf) {
                Ok(Some(body)) => {
                    let _ = decode(body);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
}

const EXEC_CAP_BYTES: u64 = 1 << 20;
const EXEC_QUOTA: Quota = Quota {
    bytes_max: 256 << 10,
    regions_max: 16,
};

/// A stream of REQUESTS frames executed by a real server state, alternately as two
/// principals. Region ids in the input pick among the regions that exist (ids are
/// random, so the fuzzer could never guess one). Every batch must be answered with one
/// response per request in order, in a frame within the limits; the memory cap and both
/// quotas must hold; and no principal may ever reach another's private region.
pub fn exec_batch(data: &[u8]) {
    let state = ServerState::with_limits(
        MemoryBudget::new(EXEC_CAP_BYTES),
        MemoryBudget::new(u64::MAX),
        0,
        EXEC_QUOTA,
    );
    let principals = [Principal::from("a"), Principal::from("b")];
    let mut input = BytesMut::from(data);
    let mut turn = 0usize;
    while let Ok(Some(body)) = FrameDecoder::split_frame(&mut input) {
        let Ok(Frame::Requests(mut batch)) = decode(body) else {
            continue;
        };
        let mut ids: Vec<u64> = principals
            .iter()
            .flat_map(|p| state.store().list(p))
            .map(|r| r.id)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        for req in &mut batch.requests {
            if ids.is_empty() {
                continue;
            }
            if let Some(region) = region_of(&mut req.op) {
                *region = ids[(*region % ids.len() as u64) as usize];
            }
            if let Op::WriteIf { guard_region, .. } = &mut req.op {
                *guard_region = ids[(*guard_region % ids.len() as u64) as usize];
            }
        }
        let who = &principals[turn % 2];
        turn += 1;
        let mut out = BytesMut::new();
        let mut enc = ResponseBatchEncoder::begin(&mut out);
        if camelot_server::exec(&state, who, &batch, &mut enc).is_err() {
            continue;
        }
        enc.finish().expect("a response frame within the limits");
        let answer = FrameDecoder::split_frame(&mut out)
            .expect("a valid length")
            .expect("a whole frame");
        let Ok(Frame::Responses(r)) = decode(answer) else {
            panic!("the answer is not a RESPONSES frame");
        };
        assert_eq!(r.responses.len(), batch.requests.len());
        for (resp, req) in r.responses.iter().zip(&batch.requests) {
            assert_eq!(resp.id, req.id, "answers out of order");
        }
        assert!(state.budget().used() <= EXEC_CAP_BYTES);
        for p in &principals {
            let u = state.store().usage(p);
            assert!(u.bytes <= EXEC_QUOTA.bytes_max && u.regions <= EXEC_QUOTA.regions_max);
            for info in state.store().list(p) {
                let region = state.store().get(p, info.id).expect("listed, so visible");
                assert!(
                    region.owner() == &**p || info.mode == camelot_proto::AccessMode::Shared,
                    "{p} sees another's private region {}",
                    info.id
                );
            }
        }
    }
}

fn region_of(op: &mut Op) -> Option<&mut u64> {
    match op {
        Op::Free { region }
        | Op::Read { region, .. }
        | Op::Write { region, .. }
        | Op::WriteIf { region, .. }
        | Op::Swap { region, .. }
        | Op::XorInto { region, .. }
        | Op::Cas { region, .. }
        | Op::FetchAdd { region, .. } => Some(region),
        _ => None,
    }
}

/// Any bytes a Redis client can send to the RESP port: parsing must never panic or loop,
/// and every command that parses must run against a small, real store without panicking
/// (hostile arguments get error replies).
pub fn resp_command(data: &[u8]) {
    use camelot_server::resp::codec::{parse_command, Parsed};
    use camelot_server::resp::commands::{execute, Ctx, Session};
    use std::time::Instant;

    let state = ServerState::new(MemoryBudget::new(1 << 20), 0);
    let ctx = Ctx {
        state: &state,
        token: None,
    };
    let mut session = Session::default();
    let mut out = BytesMut::new();
    let mut args = Vec::new();
    let mut at = 0;
    while let Ok(Parsed::Command(len)) = parse_command(&data[at..], &mut args) {
        // Every command takes at least one byte, so this loop ends.
        assert!(len > 0 && at + len <= data.len());
        at += len;
        execute(&ctx, &mut session, &args, Instant::now(), &mut out);
        if session.quit {
            break;
        }
    }
    assert!(state.budget().used() <= state.budget().cap());
}

/// Any bytes a memcached server (or something pretending to be one) can answer a `get`
/// with: parsing must end in a value, nothing, or an error — never a panic or an
/// allocation past the value limit.
pub fn memcached_reply(data: &[u8]) {
    use camelot_bench::ycsb::memcached::{read_get_reply, VALUE_BYTES_MAX};
    let mut r: &[u8] = data;
    if let Ok(Some(v)) = read_get_reply(&mut r) {
        assert!(v.len() <= VALUE_BYTES_MAX);
    }
}

/// Any bytes a `bench hw net` peer can send the net-server (or the server its client):
/// decoding must never panic, never ask for bytes past the message limit, and whatever
/// decodes must re-encode to the same message.
pub fn decode_netctl(data: &[u8]) {
    use camelot_bench::hw::netctl::{decode, encode, Decoded, MESSAGE_BYTES_MAX};
    match decode(data) {
        Ok(Decoded::Message(m, used)) => {
            assert!(used <= data.len() && used <= MESSAGE_BYTES_MAX);
            assert_eq!(decode(&encode(&m)), Ok(Decoded::Message(m, used)));
        }
        Ok(Decoded::Incomplete { needed_bytes }) => {
            assert!(needed_bytes >= 1 && data.len() + needed_bytes <= MESSAGE_BYTES_MAX);
        }
        Err(_) => {}
    }
}

/// Bytes read back from an RVM backend: log records, log streams and catalogs. Decoding
/// must never panic, and a record that decodes must re-encode to the same bytes.
pub fn rvm_record(data: &[u8]) {
    use camelot_rvm::record::{decode_catalog, decode_record, encode_record, scan_stream};
    let bytes = Bytes::copy_from_slice(data);
    if let Ok((record, len)) = decode_record(&bytes) {
        assert_eq!(encode_record(&record), bytes.slice(..len));
    }
    let _ = decode_catalog(data);
    let first_seq = data.get(8..16).map_or(0, |s| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_le_bytes(a)
    });
    let _ = scan_stream::<()>(data.len() as u64, first_seq, 64, |off, n, buf| {
        let s = off as usize;
        buf.extend_from_slice(&bytes[s..(s + n).min(bytes.len())]);
        Ok(())
    });
}

/// A block volume's superblock as read back from a member region: decoding must never
/// panic, and a superblock that decodes must re-encode to the bytes it came from.
pub fn decode_superblock(data: &[u8]) {
    if let Ok(sb) = camelot_blocks::superblock::Superblock::decode(data) {
        let again = sb.encode();
        assert_eq!(&data[..again.len()], &again[..]);
    }
}

/// Bytes of the in-memory export `nbd_session` serves.
const NBD_EXPORT_BYTES: usize = 8192;

/// An export in memory whose slicing panics on any range the server should have refused.
struct NbdMemory(std::sync::Mutex<Vec<u8>>);

impl camelot_blocks::nbd::BlockDevice for NbdMemory {
    fn size_bytes(&self) -> u64 {
        NBD_EXPORT_BYTES as u64
    }
    fn preferred_block_bytes(&self) -> u32 {
        4096
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), camelot_blocks::BlocksError> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        buf.copy_from_slice(&m[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), camelot_blocks::BlocksError> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
}

/// What an NBD client sends, from its answer to the greeting on: the export's real
/// handshake and transmission code runs over it against a memory export. It must never
/// panic, hand the export a range outside it, or answer more than the input can ask for.
pub fn nbd_session(data: &[u8]) {
    use camelot_blocks::nbd::{serve_connection, NbdStats};
    use camelot_blocks::nbd_proto::{self as p, ExportInfo};
    let device = NbdMemory(std::sync::Mutex::new(vec![0; NBD_EXPORT_BYTES]));
    let export = ExportInfo {
        name: "v".into(),
        size_bytes: NBD_EXPORT_BYTES as u64,
        // Either way, without spending a client byte on it.
        read_only: data.len() % 2 == 1,
        preferred_block_bytes: 4096,
    };
    let mut out = Vec::new();
    let stats = NbdStats::default();
    let _ = serve_connection(&mut &data[..], &mut out, &device, &export, &stats);
    // Each request header (28 bytes) earns at most a reply header and one export's worth
    // of data; each option (16 bytes) at most a few hundred bytes of replies.
    let bound = p::GREETING_BYTES
        + (data.len() / p::OPTION_HEADER_BYTES + 1) * 512
        + (data.len() / p::REQUEST_HEADER_BYTES + 1)
            * (p::SIMPLE_REPLY_HEADER_BYTES + NBD_EXPORT_BYTES);
    assert!(
        out.len() <= bound,
        "{} bytes out for {} in",
        out.len(),
        data.len()
    );
}

/// What Clover reads from outside: the metadata server's frames (a HELLO, requests from
/// any client that connects, answers read by a store) and version nodes read back from
/// shared regions any client may have written. Decoding must never panic; a request or
/// an answer that decodes must re-encode to bytes that decode to the same value, and a
/// frame's announced length is never accepted past its limit.
pub fn clover_wire(data: &[u8]) {
    use camelot_clover::layout::{decode_node, node_header_fields};
    use camelot_clover::wire::{
        decode_answer, decode_hello, decode_request, encode_answer, encode_request, frame_len,
        REQUEST_BYTES_MAX,
    };
    let body = Bytes::copy_from_slice(data);
    let _ = decode_hello(body.clone());
    if let Ok(r) = decode_request(body.clone()) {
        let again = encode_request(&r).expect("a decoded request encodes");
        assert_eq!(decode_request(again[4..].to_vec().into()), Ok(r));
    }
    if let Ok(a) = decode_answer(body.clone()) {
        let again = encode_answer(&a).expect("a decoded answer encodes");
        assert_eq!(decode_answer(again[4..].to_vec().into()), Ok(a));
    }
    if let Some(prefix) = data.get(..4) {
        let mut p = [0u8; 4];
        p.copy_from_slice(prefix);
        if let Ok(len) = frame_len(p, REQUEST_BYTES_MAX) {
            assert!((1..=REQUEST_BYTES_MAX).contains(&len));
        }
    }
    let _ = node_header_fields(data);
    let _ = decode_node(&body);
}
