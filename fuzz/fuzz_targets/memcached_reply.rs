//! Any bytes a memcached server (or something pretending to be one) can answer a `get`
//! with: parsing must end in a value, nothing, or an error — never a panic or an
//! allocation past the value limit.
#![no_main]
use camelot_bench::ycsb::memcached::{read_get_reply, VALUE_BYTES_MAX};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r: &[u8] = data;
    if let Ok(Some(v)) = read_get_reply(&mut r) {
        assert!(v.len() <= VALUE_BYTES_MAX);
    }
});
