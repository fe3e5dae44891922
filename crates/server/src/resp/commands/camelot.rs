//! Camelot's versioned operations, for RESP clients that want what the native protocol
//! gives: `CAMELOT.GET key` → `[version, value]` or nil; `CAMELOT.PUT key value` →
//! version; `CAMELOT.CAS key expected value` → new version, or nil on a conflict
//! (expected 0: only if absent); `CAMELOT.DEL key` → the removed version or nil;
//! `CAMELOT.SCAN start count` → `[key, version, value, …]` in key order.

use super::{parse_int, Call, NOT_INTEGER};
use camelot_proto::limits::SCAN_ITEMS_MAX;
use camelot_proto::{ErrorCode, ErrorReply};

/// Most bytes one CAMELOT.SCAN reply carries (the native protocol's frame budget).
const SCAN_REPLY_BYTES_MAX: usize = camelot_proto::RESPONSE_OK_BUDGET_BYTES;

fn finish(c: &mut Call<'_>, result: Result<(), ErrorReply>) {
    match result {
        Ok(()) => {}
        Err(e) if e.code == ErrorCode::NoSuchKey => c.out.null(),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn get(c: &mut Call<'_>) {
    let r = c.objects().get(c.args[1], c.now).map(|(version, value)| {
        c.out.array_header(2);
        c.out.integer(version as i64);
        c.out.bulk(&value);
    });
    finish(c, r);
}

pub(super) fn put(c: &mut Call<'_>) {
    let r = c
        .objects()
        .put(c.args[1], c.args[2], c.now)
        .map(|v| c.out.integer(v as i64));
    finish(c, r);
}

pub(super) fn cas(c: &mut Call<'_>) {
    let Some(expected) = parse_int(c.args[2]).filter(|v| *v >= 0) else {
        c.error(NOT_INTEGER);
        return;
    };
    let r = match c
        .objects()
        .cas_put(c.args[1], expected as u64, c.args[3], c.now)
    {
        Err(e) if e.code == ErrorCode::VersionConflict => {
            c.out.null();
            Ok(())
        }
        r => r.map(|v| c.out.integer(v as i64)),
    };
    finish(c, r);
}

pub(super) fn del(c: &mut Call<'_>) {
    let r = c
        .objects()
        .delete(c.args[1], c.now)
        .map(|v| c.out.integer(v as i64));
    finish(c, r);
}

pub(super) fn scan(c: &mut Call<'_>) {
    let Some(count) = parse_int(c.args[2]).filter(|n| (0..=SCAN_ITEMS_MAX as i64).contains(n))
    else {
        c.error(&format!("ERR count must be 0 to {SCAN_ITEMS_MAX}"));
        return;
    };
    let r = c
        .objects()
        .scan(c.args[1], count as usize, SCAN_REPLY_BYTES_MAX, c.now)
        .map(|items| {
            c.out.array_header(3 * items.len());
            for it in items {
                c.out.bulk(&it.key);
                c.out.integer(it.version as i64);
                c.out.bulk(&it.value);
            }
        });
    finish(c, r);
}
