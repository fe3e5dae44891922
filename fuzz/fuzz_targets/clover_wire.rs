//! libFuzzer's entry to the `clover_wire` body in `src/lib.rs` (what it checks is described there).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| camelot_fuzz::clover_wire(data));
