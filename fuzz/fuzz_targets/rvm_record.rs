//! Bytes read back from an RVM backend: log records, log streams and catalogs. Decoding
//! must never panic, and a record that decodes must re-encode to the same bytes.
#![no_main]
use bytes::Bytes;
use camelot_rvm::record::{decode_catalog, decode_record, encode_record, scan_stream};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
});
