//! Any bytes a `bench hw net` peer can send the net-server (or the server its client):
//! decoding must never panic, never ask for bytes past the message limit, and whatever
//! decodes must re-encode to the same message.
#![no_main]
use camelot_bench::hw::netctl::{decode, encode, Decoded, MESSAGE_BYTES_MAX};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
});
