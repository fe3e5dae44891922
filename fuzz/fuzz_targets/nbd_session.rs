//! libFuzzer's entry to the `nbd_session` body in `src/lib.rs` (what it checks is described there).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| camelot_fuzz::nbd_session(data));
