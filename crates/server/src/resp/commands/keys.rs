//! Key-space commands: DEL, EXISTS, TYPE, KEYS, SCAN, and the expiry commands (EXPIRE,
//! PEXPIRE, EXPIREAT, PEXPIREAT, TTL, PTTL, PERSIST).

use super::{glob_match, is, Call, SYNTAX};
use crate::objects::{Change, Entry, ObjectStore};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Most keys KEYS returns.
const KEYS_MAX: usize = 1 << 20;
/// SCAN's COUNT when none is given (Redis's default).
const SCAN_COUNT_DEFAULT: usize = 10;
/// Fallback for a deadline `Instant` cannot hold (it holds ~292 billion years on Linux,
/// beyond any i64 of milliseconds, so this is for other platforms): about 30 000 years.
const DEADLINE_FALLBACK: Duration = Duration::from_secs(1 << 40);

/// The wall clock in Unix milliseconds, for the commands that take or give absolute times.
pub(super) fn unix_now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The deadline `ms` (> 0) milliseconds after `now`.
pub(super) fn deadline_after_ms(now: Instant, ms: i64) -> Instant {
    now.checked_add(Duration::from_millis(ms.max(0) as u64))
        .or_else(|| now.checked_add(DEADLINE_FALLBACK))
        .unwrap_or(now)
}

/// The deadline at Unix time `at_ms`, given that `now` is `unix_now_ms` on the wall clock.
/// A time already past is `now`, which no entry survives.
pub(super) fn deadline_at_unix_ms(now: Instant, unix_now_ms: i64, at_ms: i64) -> Instant {
    deadline_after_ms(now, at_ms.saturating_sub(unix_now_ms))
}

/// A deadline back in Unix milliseconds (for EXPIRE's GT and LT).
fn unix_ms_of(now: Instant, unix_now_ms: i64, deadline: Instant) -> i64 {
    unix_now_ms.saturating_add(deadline.saturating_duration_since(now).as_millis() as i64)
}

/// Deletes a key of any type; true when something was there.
fn delete_any(objects: &ObjectStore, key: &[u8], now: Instant) -> bool {
    objects
        .modify(
            key,
            |_| 0,
            now,
            |e, _| match e {
                Some(_) => Ok((true, Change::Remove)),
                None => Ok((false, Change::Keep)),
            },
        )
        .map(|(found, _)| found)
        .unwrap_or(false)
}

pub(super) fn del(c: &mut Call<'_>) {
    let removed = c.args[1..]
        .iter()
        .filter(|k| delete_any(c.ctx.state.objects(), k, c.now))
        .count();
    c.out.integer(removed as i64);
}

pub(super) fn exists(c: &mut Call<'_>) {
    // A key named twice counts twice, as in Redis.
    let found = c.args[1..]
        .iter()
        .filter(|k| c.ctx.state.objects().read(k, c.now, |e| e.is_some()))
        .count();
    c.out.integer(found as i64);
}

pub(super) fn type_(c: &mut Call<'_>) {
    let t = c.objects().read(c.args[1], c.now, |e| {
        e.map_or("none", |e| e.value.type_name())
    });
    c.out.simple(t);
}

pub(super) fn keys(c: &mut Call<'_>) {
    let pattern = c.args[1];
    let keys = if pattern == b"*" {
        c.objects().keys(KEYS_MAX, c.now)
    } else {
        c.objects()
            .keys_matching(KEYS_MAX, c.now, |k| glob_match(pattern, k))
    };
    c.out.array_header(keys.len());
    for k in keys {
        c.out.bulk(&k);
    }
}

/// A SCAN cursor as Redis reads one (`strtoul`): optional sign (a minus wraps), decimal
/// digits, nothing else; the empty string is 0.
fn parse_cursor(b: &[u8]) -> Option<u64> {
    if b.is_empty() {
        return Some(0);
    }
    let (negative, digits) = match b[0] {
        b'-' => (true, &b[1..]),
        b'+' => (false, &b[1..]),
        _ => (false, b),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut v: u64 = 0;
    for &d in digits {
        v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    Some(if negative { v.wrapping_neg() } else { v })
}

/// `SCAN cursor [MATCH pattern] [COUNT n] [TYPE type]`. The cursor is a position in
/// key-hash order (see `ObjectStore::scan_by_hash`); MATCH and TYPE filter what a step
/// found, so a step may return fewer keys than COUNT, or none, before the walk ends.
pub(super) fn scan(c: &mut Call<'_>) {
    let Some(cursor) = parse_cursor(c.args[1]) else {
        c.error("ERR invalid cursor");
        return;
    };
    let mut count = SCAN_COUNT_DEFAULT;
    let mut pattern: Option<&[u8]> = None;
    let mut type_name: Option<&[u8]> = None;
    let mut i = 2;
    while i < c.args.len() {
        let left = c.args.len() - i;
        let a = c.args[i];
        if is(a, "count") && left >= 2 {
            let Some(n) = c.int_arg(i + 1) else { return };
            if n < 1 {
                c.error(SYNTAX);
                return;
            }
            count = usize::try_from(n).unwrap_or(usize::MAX);
        } else if is(a, "match") && left >= 2 {
            let p = c.args[i + 1];
            pattern = (p != b"*").then_some(p);
        } else if is(a, "type") && left >= 2 {
            type_name = Some(c.args[i + 1]);
        } else {
            c.error(SYNTAX);
            return;
        }
        i += 2;
    }
    let (found, next) = c.objects().scan_by_hash(cursor, count, c.now);
    let keep: Vec<_> = found
        .into_iter()
        .filter(|k| pattern.map(|p| glob_match(p, k)) != Some(false))
        .filter(|k| {
            let Some(t) = type_name else { return true };
            c.objects().read(k, c.now, |e| {
                e.is_some_and(|e| t.eq_ignore_ascii_case(e.value.type_name().as_bytes()))
            })
        })
        .collect();
    c.out.array_header(2);
    c.out.bulk(next.to_string().as_bytes());
    c.out.array_header(keep.len());
    for k in keep {
        c.out.bulk(&k);
    }
}

/// EXPIRE's NX/XX/GT/LT.
#[derive(Default)]
struct ExpireIf {
    nx: bool,
    xx: bool,
    gt: bool,
    lt: bool,
}

/// Redis's `expireGenericCommand`: `base_ms` is the Unix time the argument counts from
/// (now, or 0 for the -AT forms); `millis` whether it is in milliseconds.
fn expire_generic(c: &mut Call<'_>, name: &str, relative: bool, millis: bool) {
    let mut cond = ExpireIf::default();
    for a in &c.args[3..] {
        if is(a, "nx") {
            cond.nx = true;
        } else if is(a, "xx") {
            cond.xx = true;
        } else if is(a, "gt") {
            cond.gt = true;
        } else if is(a, "lt") {
            cond.lt = true;
        } else {
            let msg = format!("ERR Unsupported option {}", String::from_utf8_lossy(a));
            c.error(&msg);
            return;
        }
    }
    if cond.nx && (cond.xx || cond.gt || cond.lt) {
        c.error("ERR NX and XX, GT or LT options at the same time are not compatible");
        return;
    }
    if cond.gt && cond.lt {
        c.error("ERR GT and LT options at the same time are not compatible");
        return;
    }
    let Some(mut when) = c.int_arg(2) else { return };
    let invalid = format!("ERR invalid expire time in '{name}' command");
    if !millis {
        if !(i64::MIN / 1000..=i64::MAX / 1000).contains(&when) {
            c.error(&invalid);
            return;
        }
        when *= 1000;
    }
    let unix_now = unix_now_ms();
    let base = if relative { unix_now } else { 0 };
    if when > i64::MAX - base {
        c.error(&invalid);
        return;
    }
    let when = when + base;
    let now = c.now;
    let r = c.objects().modify(
        c.args[1],
        |_| 0,
        now,
        |e, clock| {
            let Some(e) = e else {
                return Ok((0, Change::Keep));
            };
            let current = e.expires_at.map(|t| unix_ms_of(now, unix_now, t));
            let refused = (cond.nx && current.is_some())
                || (cond.xx && current.is_none())
                || (cond.gt && current.map(|cur| when <= cur) != Some(false))
                || (cond.lt && current.is_some_and(|cur| when >= cur));
            if refused {
                return Ok((0, Change::Keep));
            }
            if when <= unix_now {
                return Ok((1, Change::Remove));
            }
            e.expires_at = Some(deadline_at_unix_ms(now, unix_now, when));
            e.version = clock.next();
            Ok((1, Change::Keep))
        },
    );
    match r {
        Ok((n, _)) => c.out.integer(n),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn expire(c: &mut Call<'_>) {
    expire_generic(c, "expire", true, false);
}

pub(super) fn pexpire(c: &mut Call<'_>) {
    expire_generic(c, "pexpire", true, true);
}

pub(super) fn expireat(c: &mut Call<'_>) {
    expire_generic(c, "expireat", false, false);
}

pub(super) fn pexpireat(c: &mut Call<'_>) {
    expire_generic(c, "pexpireat", false, true);
}

fn ttl_ms(c: &Call<'_>) -> i64 {
    c.objects().read(c.args[1], c.now, |e| match e {
        None => -2,
        Some(Entry {
            expires_at: None, ..
        }) => -1,
        Some(Entry {
            expires_at: Some(t),
            ..
        }) => t.saturating_duration_since(c.now).as_millis() as i64,
    })
}

pub(super) fn ttl(c: &mut Call<'_>) {
    let ms = ttl_ms(c);
    c.out.integer(if ms >= 0 { (ms + 500) / 1000 } else { ms });
}

pub(super) fn pttl(c: &mut Call<'_>) {
    let ms = ttl_ms(c);
    c.out.integer(ms);
}

pub(super) fn persist(c: &mut Call<'_>) {
    let r = c.objects().modify(
        c.args[1],
        |_| 0,
        c.now,
        |e, clock| match e {
            Some(e) if e.expires_at.is_some() => {
                e.expires_at = None;
                e.version = clock.next();
                Ok((1, Change::Keep))
            }
            _ => Ok((0, Change::Keep)),
        },
    );
    match r {
        Ok((n, _)) => c.out.integer(n),
        Err(e) => c.store_error(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_read_like_strtoul() {
        assert_eq!(parse_cursor(b"0"), Some(0));
        assert_eq!(parse_cursor(b""), Some(0));
        assert_eq!(parse_cursor(b"+7"), Some(7));
        assert_eq!(parse_cursor(b"007"), Some(7));
        assert_eq!(parse_cursor(b"-1"), Some(u64::MAX));
        assert_eq!(parse_cursor(b"18446744073709551615"), Some(u64::MAX));
        for bad in [&b"x"[..], b" 1", b"1 ", b"+", b"18446744073709551616"] {
            assert_eq!(parse_cursor(bad), None, "{bad:?}");
        }
    }
}
