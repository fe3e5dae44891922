//! A block volume's superblock as read back from a member region: decoding must never
//! panic, and a superblock that decodes must re-encode to the bytes it came from.
#![no_main]
use camelot_blocks::superblock::Superblock;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(sb) = Superblock::decode(data) {
        let again = sb.encode();
        assert_eq!(&data[..again.len()], &again[..]);
    }
});
