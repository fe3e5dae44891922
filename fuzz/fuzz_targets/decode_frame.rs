//! Any frame body a peer can send: HELLO, REQUESTS, RESPONSES, FATAL. Decoding must never
//! panic, and whatever decodes must re-encode to a frame that decodes to the same value.
#![no_main]
use bytes::{Bytes, BytesMut};
use camelot_proto::{decode_frame, encode_frame, FrameDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = decode_frame(Bytes::copy_from_slice(data)) {
        let mut buf = BytesMut::new();
        if encode_frame(&frame, &mut buf).is_ok() {
            let body = FrameDecoder::split_frame(&mut buf)
                .expect("own encoding has a valid length")
                .expect("own encoding is whole");
            assert_eq!(decode_frame(body).expect("own encoding decodes"), frame);
        }
    }
});
