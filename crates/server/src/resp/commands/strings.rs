//! String commands: GET, SET, MGET, MSET, INCR and friends, APPEND, STRLEN, GETRANGE,
//! SETRANGE.

use super::keys::{deadline_after_ms, deadline_at_unix_ms, unix_now_ms};
use super::{is, parse_int, redis_error, Call, NOT_INTEGER, SYNTAX, TOO_BIG, WRONG_TYPE};
use crate::objects::{check_value_len, wrong_type, Change, Entry, Value, ENTRY_OVERHEAD_BYTES};
use bytes::{Bytes, BytesMut};
use camelot_proto::limits::VALUE_BYTES_MAX;

pub(super) fn get(c: &mut Call<'_>) {
    // Copied out under the read lock: cloning the value's handle would bounce its
    // reference count between cores on every GET of a hot key.
    let (objects, out) = (c.ctx.state.objects(), &mut *c.out);
    objects.read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
        None => out.null(),
        Some(Value::Str(v)) => out.bulk(v),
        Some(_) => out.error(WRONG_TYPE),
    })
}

/// How SET's expiry option was given.
#[derive(Clone, Copy, PartialEq)]
enum ExpiryArg {
    Seconds,
    Millis,
    UnixSeconds,
    UnixMillis,
}

pub(super) fn set(c: &mut Call<'_>) {
    let args = c.args;
    let (mut nx, mut xx, mut get, mut keep_ttl) = (false, false, false, false);
    let mut expiry: Option<(ExpiryArg, &[u8])> = None;
    // Redis's `parseExtendedStringArgumentsOrReply`: an option may repeat (the last
    // expiry wins) but may not meet a conflicting one.
    let mut i = 3;
    while i < args.len() {
        let a = args[i];
        let next = args.get(i + 1).copied();
        let timed = |kind: ExpiryArg| keep_ttl || expiry.is_some_and(|(k, _)| k != kind);
        let kind = if is(a, "ex") {
            Some(ExpiryArg::Seconds)
        } else if is(a, "px") {
            Some(ExpiryArg::Millis)
        } else if is(a, "exat") {
            Some(ExpiryArg::UnixSeconds)
        } else if is(a, "pxat") {
            Some(ExpiryArg::UnixMillis)
        } else {
            None
        };
        if is(a, "nx") && !xx {
            nx = true;
        } else if is(a, "xx") && !nx {
            xx = true;
        } else if is(a, "get") {
            get = true;
        } else if is(a, "keepttl") && expiry.is_none() {
            keep_ttl = true;
        } else if let (Some(kind), Some(value)) = (kind, next) {
            if timed(kind) {
                c.error(SYNTAX);
                return;
            }
            expiry = Some((kind, value));
            i += 1;
        } else {
            c.error(SYNTAX);
            return;
        }
        i += 1;
    }
    let mut expires_at = None;
    if let Some((kind, text)) = expiry {
        let Some(t) = parse_int(text) else {
            c.error(NOT_INTEGER);
            return;
        };
        let seconds = matches!(kind, ExpiryArg::Seconds | ExpiryArg::UnixSeconds);
        let invalid = "ERR invalid expire time in 'set' command";
        if t <= 0 || (seconds && t > i64::MAX / 1000) {
            c.error(invalid);
            return;
        }
        let ms = if seconds { t * 1000 } else { t };
        expires_at = Some(match kind {
            ExpiryArg::Seconds | ExpiryArg::Millis => {
                if ms > i64::MAX - unix_now_ms() {
                    c.error(invalid);
                    return;
                }
                deadline_after_ms(c.now, ms)
            }
            ExpiryArg::UnixSeconds | ExpiryArg::UnixMillis => {
                deadline_at_unix_ms(c.now, unix_now_ms(), ms)
            }
        });
    }
    let (key, value) = (args[1], args[2]);
    if let Err(e) = check_value_len(value.len()) {
        c.store_error(&e);
        return;
    }
    let value = Bytes::copy_from_slice(value);
    let cost = ENTRY_OVERHEAD_BYTES + (key.len() + value.len()) as u64;
    // (set?, the old value when GET asked for it)
    let r = c.objects().modify(
        key,
        |_| cost,
        c.now,
        |e, clock| {
            let old = match (&e, get) {
                (
                    Some(Entry {
                        value: Value::Str(v),
                        ..
                    }),
                    true,
                ) => Some(v.clone()),
                (Some(_), true) => return Err(wrong_type()),
                _ => None,
            };
            match e {
                Some(_) if nx => Ok(((false, old), Change::Keep)),
                None if xx => Ok(((false, old), Change::Keep)),
                // SET replaces a value of any type, as in Redis.
                Some(e) => {
                    e.value = Value::Str(value);
                    if !keep_ttl {
                        e.expires_at = expires_at;
                    }
                    e.version = clock.next();
                    Ok(((true, old), Change::Keep))
                }
                None => Ok((
                    (true, old),
                    Change::Insert {
                        value: Value::Str(value),
                        expires_at,
                    },
                )),
            }
        },
    );
    match r {
        Ok(((_, Some(old)), _)) => c.out.bulk(&old),
        Ok(((_, None), _)) if get => c.out.null(),
        Ok(((true, None), _)) => c.out.simple("OK"),
        Ok(((false, None), _)) => c.out.null(),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn mget(c: &mut Call<'_>) {
    c.out.array_header(c.args.len() - 1);
    for k in &c.args[1..] {
        let out = &mut *c.out;
        c.ctx
            .state
            .objects()
            .read(k, c.now, |e| match e.map(|e| &e.value) {
                Some(Value::Str(v)) => out.bulk(v),
                // MGET answers nil for keys of other types too.
                _ => out.null(),
            });
    }
}

pub(super) fn mset(c: &mut Call<'_>) {
    if c.args.len() % 2 != 1 {
        c.arity("mset");
        return;
    }
    for pair in c.args[1..].chunks_exact(2) {
        if let Err(e) = c.ctx.state.objects().put(pair[0], pair[1], c.now) {
            c.store_error(&e);
            return;
        }
    }
    c.out.simple("OK");
}

pub(super) fn incr(c: &mut Call<'_>) {
    incr_by(c, 1);
}

pub(super) fn decr(c: &mut Call<'_>) {
    incr_by(c, -1);
}

pub(super) fn incrby(c: &mut Call<'_>) {
    if let Some(delta) = c.int_arg(2) {
        incr_by(c, delta);
    }
}

pub(super) fn decrby(c: &mut Call<'_>) {
    let Some(delta) = c.int_arg(2) else {
        return;
    };
    match delta.checked_neg() {
        Some(d) => incr_by(c, d),
        None => c.error("ERR decrement would overflow"),
    }
}

fn incr_by(c: &mut Call<'_>, delta: i64) {
    let key = c.args[1];
    let cost = ENTRY_OVERHEAD_BYTES + key.len() as u64 + 20;
    let r = c.objects().modify(
        key,
        |_| cost,
        c.now,
        |e, clock| {
            let current = match e.as_deref() {
                None => 0,
                Some(Entry {
                    value: Value::Str(v),
                    ..
                }) => parse_int(v).ok_or_else(|| redis_error(NOT_INTEGER))?,
                Some(_) => return Err(wrong_type()),
            };
            let next = current
                .checked_add(delta)
                .ok_or_else(|| redis_error("ERR increment or decrement would overflow"))?;
            let value = Value::Str(Bytes::from(next.to_string()));
            match e {
                // INCR keeps the key's expiry, as in Redis.
                Some(e) => {
                    e.value = value;
                    e.version = clock.next();
                    Ok((next, Change::Keep))
                }
                None => Ok((
                    next,
                    Change::Insert {
                        value,
                        expires_at: None,
                    },
                )),
            }
        },
    );
    match r {
        Ok((n, _)) => c.out.integer(n),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn strlen(c: &mut Call<'_>) {
    let out = &mut *c.out;
    c.ctx
        .state
        .objects()
        .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
            None => out.integer(0),
            Some(Value::Str(v)) => out.integer(v.len() as i64),
            Some(_) => out.error(WRONG_TYPE),
        })
}

/// Redis's `checkStringLength`, against the value limit rather than 512 MB.
fn too_big(len: u64) -> bool {
    len > VALUE_BYTES_MAX as u64
}

pub(super) fn append(c: &mut Call<'_>) {
    let (key, tail) = (c.args[1], c.args[2]);
    let cost = ENTRY_OVERHEAD_BYTES + (key.len() + tail.len()) as u64;
    let r = c.objects().modify(
        key,
        |_| cost,
        c.now,
        |e, clock| match e {
            // Arguments may be longer than a value may be (`proto-max-bulk-len`).
            None if too_big(tail.len() as u64) => Err(redis_error(TOO_BIG)),
            None => Ok((
                tail.len(),
                Change::Insert {
                    value: Value::Str(Bytes::copy_from_slice(tail)),
                    expires_at: None,
                },
            )),
            Some(e) => {
                let Value::Str(v) = &e.value else {
                    return Err(wrong_type());
                };
                if too_big((v.len() + tail.len()) as u64) {
                    return Err(redis_error(TOO_BIG));
                }
                let mut joined = BytesMut::with_capacity(v.len() + tail.len());
                joined.extend_from_slice(v);
                joined.extend_from_slice(tail);
                let len = joined.len();
                e.value = Value::Str(joined.freeze());
                e.version = clock.next();
                Ok((len, Change::Keep))
            }
        },
    );
    match r {
        Ok((len, _)) => c.out.integer(len as i64),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn getrange(c: &mut Call<'_>) {
    let Some(start) = c.int_arg(2) else { return };
    let Some(end) = c.int_arg(3) else { return };
    let out = &mut *c.out;
    c.ctx
        .state
        .objects()
        .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
            None => out.bulk(b""),
            Some(Value::Str(v)) => out.bulk(substring(v, start, end)),
            Some(_) => out.error(WRONG_TYPE),
        })
}

/// GETRANGE's index rules (`getrangeCommand`): negative counts from the end, both ends
/// inclusive, clamped to the string.
fn substring(v: &[u8], start: i64, end: i64) -> &[u8] {
    let len = v.len() as i64;
    if (start < 0 && end < 0 && start > end) || len == 0 {
        return b"";
    }
    let mut start = if start < 0 { len + start } else { start };
    let mut end = if end < 0 { len + end } else { end };
    start = start.max(0);
    end = end.max(0);
    if end >= len {
        end = len - 1;
    }
    if start > end {
        return b"";
    }
    &v[start as usize..=end as usize]
}

pub(super) fn setrange(c: &mut Call<'_>) {
    let Some(offset) = c.int_arg(2) else { return };
    if offset < 0 {
        c.error("ERR offset is out of range");
        return;
    }
    let (key, patch) = (c.args[1], c.args[3]);
    let needed = (offset as u64).saturating_add(patch.len() as u64);
    let now = c.now;
    let r = c.objects().modify(
        key,
        // The string can grow to `needed` bytes at most; an absent key costs its entry.
        // (Nothing when it would be refused as too big: that error comes first.)
        |e| match e {
            _ if too_big(needed) => 0,
            Some(Entry {
                value: Value::Str(v),
                ..
            }) => needed.saturating_sub(v.len() as u64),
            _ => ENTRY_OVERHEAD_BYTES + key.len() as u64 + needed,
        },
        now,
        |e, clock| match e {
            None => {
                if patch.is_empty() {
                    return Ok((0, Change::Keep));
                }
                if too_big(needed) {
                    return Err(redis_error(TOO_BIG));
                }
                let mut v = vec![0u8; needed as usize];
                v[offset as usize..].copy_from_slice(patch);
                Ok((
                    needed as i64,
                    Change::Insert {
                        value: Value::Str(Bytes::from(v)),
                        expires_at: None,
                    },
                ))
            }
            Some(e) => {
                let Value::Str(v) = &e.value else {
                    return Err(wrong_type());
                };
                if patch.is_empty() {
                    return Ok((v.len() as i64, Change::Keep));
                }
                if too_big(needed) {
                    return Err(redis_error(TOO_BIG));
                }
                let mut joined = v.to_vec();
                if joined.len() < needed as usize {
                    joined.resize(needed as usize, 0);
                }
                joined[offset as usize..needed as usize].copy_from_slice(patch);
                let len = joined.len() as i64;
                e.value = Value::Str(Bytes::from(joined));
                e.version = clock.next();
                Ok((len, Change::Keep))
            }
        },
    );
    match r {
        Ok((len, _)) => c.out.integer(len),
        Err(e) => c.store_error(&e),
    }
}
