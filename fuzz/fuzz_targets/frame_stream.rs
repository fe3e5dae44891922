//! A byte stream as it arrives on a socket: length prefixes and bodies, possibly split
//! or lying about their length.
#![no_main]
use bytes::BytesMut;
use camelot_proto::{decode_frame, FrameDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::new();
    for chunk in data.chunks(7) {
        buf.extend_from_slice(chunk);
        loop {
            match FrameDecoder::split_frame(&mut buf) {
                Ok(Some(body)) => {
                    let _ = decode_frame(body);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
