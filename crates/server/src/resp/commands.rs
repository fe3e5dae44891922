//! The Redis commands the port understands, executed against the server's objects. Pure:
//! a command's arguments in, its reply appended to a buffer. Error texts are Redis 7's,
//! word for word, because client libraries match on them.

use super::codec::{array_header, bulk, error, format_double, integer, null_bulk, simple};
use crate::conn::tokens_match;
use crate::objects::{
    check_value_len, wrong_type, Change, Entry, Hash, ObjectStore, Value, ZSet,
    ENTRY_OVERHEAD_BYTES, FIELD_OVERHEAD_BYTES,
};
use crate::state::ServerState;
use bytes::{Bytes, BytesMut};
use camelot_proto::limits::SCAN_ITEMS_MAX;
use camelot_proto::{ErrorCode, ErrorReply};
use std::time::{Duration, Instant};

/// Longest expiry SET accepts (Redis refuses what overflows its millisecond clock; we
/// refuse well before `Instant` arithmetic could).
const EXPIRE_MS_MAX: i64 = 100 * 365 * 24 * 3600 * 1000;
/// Most bytes one CAMELOT.SCAN reply carries (the native protocol's frame budget).
const SCAN_REPLY_BYTES_MAX: usize = camelot_proto::RESPONSE_OK_BUDGET_BYTES;
/// Longest command name we know (`zrangebyscore`), with room to spare.
const COMMAND_NAME_BYTES_MAX: usize = 32;
/// Most keys KEYS returns.
const KEYS_MAX: usize = 1 << 20;

/// Per-connection state.
#[derive(Debug, Default)]
pub struct Session {
    pub authenticated: bool,
    /// Set by QUIT: reply, flush, close.
    pub quit: bool,
}

pub struct Ctx<'a> {
    pub state: &'a ServerState,
    pub token: Option<&'a [u8]>,
}

const WRONG_TYPE: &str = "WRONGTYPE Operation against a key holding the wrong kind of value";
const NOT_INTEGER: &str = "ERR value is not an integer or out of range";
const NOT_FLOAT: &str = "ERR value is not a valid float";
const SYNTAX: &str = "ERR syntax error";

fn arity(out: &mut BytesMut, name: &str) {
    error(
        out,
        &format!("ERR wrong number of arguments for '{name}' command"),
    );
}

/// Maps a store error to the reply Redis would give.
fn store_error(out: &mut BytesMut, e: &ErrorReply) {
    match e.code {
        ErrorCode::WrongType => error(out, WRONG_TYPE),
        ErrorCode::OutOfMemory => error(
            out,
            "OOM command not allowed when used memory > 'maxmemory'.",
        ),
        _ => error(out, &format!("ERR {}", e.message)),
    }
}

fn parse_i64(b: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(b).ok()?;
    if s.is_empty() || s.starts_with('+') || s.len() > 20 {
        return None;
    }
    s.parse().ok()
}

fn parse_f64(b: &[u8]) -> Option<f64> {
    let s = std::str::from_utf8(b).ok()?;
    let x = match s.to_ascii_lowercase().as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => f64::INFINITY,
        "-inf" | "-infinity" => f64::NEG_INFINITY,
        t => t.parse().ok()?,
    };
    (!x.is_nan()).then_some(x)
}

/// A ZRANGEBYSCORE bound: `(x` is exclusive.
fn parse_bound(b: &[u8]) -> Option<(f64, bool)> {
    match b.strip_prefix(b"(") {
        Some(rest) => parse_f64(rest).map(|x| (x, true)),
        None => parse_f64(b).map(|x| (x, false)),
    }
}

fn is(arg: &[u8], word: &str) -> bool {
    arg.eq_ignore_ascii_case(word.as_bytes())
}

/// Runs one command and appends its reply to `out`.
/// `now` is the time expiries are judged against.
pub fn execute(
    ctx: &Ctx<'_>,
    session: &mut Session,
    args: &[&[u8]],
    now: Instant,
    out: &mut BytesMut,
) {
    let Some(name) = args.first() else {
        return;
    };
    // Lower-cased on the stack: this runs for every command. Longer names are no
    // command of ours, and fall through to the unknown-command answer.
    let mut name_buf = [0u8; COMMAND_NAME_BYTES_MAX];
    let cmd = match name.get(..).filter(|n| n.len() <= COMMAND_NAME_BYTES_MAX) {
        Some(n) => {
            name_buf[..n.len()].copy_from_slice(n);
            name_buf[..n.len()].make_ascii_lowercase();
            std::str::from_utf8(&name_buf[..n.len()]).unwrap_or("")
        }
        None => "",
    };
    if ctx.token.is_some() && !session.authenticated && !matches!(cmd, "auth" | "quit") {
        error(out, "NOAUTH Authentication required.");
        return;
    }
    let objects = ctx.state.objects();
    let n = args.len();
    // Arity as Redis declares it: positive = exact, negative = at least.
    let need: i32 = match cmd {
        "ping" => -1,
        "echo" => 2,
        "select" => 2,
        "info" => -1,
        "dbsize" => 1,
        "flushall" | "flushdb" => -1,
        "command" => -1,
        "config" => -2,
        "quit" => -1,
        "auth" => -2,
        "get" | "strlen" | "incr" | "decr" | "type" | "ttl" | "pttl" | "hgetall" | "hlen"
        | "zcard" => 2,
        "set" => -3,
        "del" | "exists" | "mget" => -2,
        "mset" => -3,
        "incrby" | "decrby" | "append" | "hget" | "zscore" => 3,
        "hset" | "hmset" => -4,
        "hmget" | "hdel" | "zrem" => -3,
        "zadd" => -4,
        "zrangebyscore" => -4,
        "keys" => 2,
        "camelot.get" | "camelot.del" => 2,
        "camelot.put" | "camelot.scan" => 3,
        "camelot.cas" => 4,
        _ => {
            let mut shown = String::new();
            for a in args.iter().skip(1).take(8) {
                shown.push_str(&format!("'{}' ", String::from_utf8_lossy(a)));
            }
            error(
                out,
                &format!(
                    "ERR unknown command '{}', with args beginning with: {shown}",
                    String::from_utf8_lossy(name)
                ),
            );
            return;
        }
    };
    let arity_ok = if need > 0 {
        n == need as usize
    } else {
        n >= need.unsigned_abs() as usize
    };
    if !arity_ok {
        arity(out, cmd);
        return;
    }
    match cmd {
        "ping" => match n {
            1 => simple(out, "PONG"),
            2 => bulk(out, args[1]),
            _ => arity(out, cmd),
        },
        "echo" => bulk(out, args[1]),
        "select" => match parse_i64(args[1]) {
            Some(0) => simple(out, "OK"),
            Some(_) => error(out, "ERR DB index is out of range"),
            None => error(out, NOT_INTEGER),
        },
        "info" => info(ctx, out),
        "dbsize" => integer(out, objects.len() as i64),
        "flushall" | "flushdb" => {
            objects.clear();
            simple(out, "OK");
        }
        // Enough for redis-cli and redis-benchmark, which only want to know it answers.
        "command" => {
            if n >= 2 && is(args[1], "count") {
                integer(out, 0);
            } else {
                array_header(out, 0);
            }
        }
        "config" => {
            if is(args[1], "get") && n == 3 {
                config_get(ctx, args[2], out);
            } else if is(args[1], "get") {
                arity(out, "config|get");
            } else {
                error(out, "ERR CONFIG subcommand not supported by Camelot");
            }
        }
        "quit" => {
            simple(out, "OK");
            session.quit = true;
        }
        "auth" => auth(ctx, session, args, out),
        // Copied out under the read lock: cloning the value's handle would bounce its
        // reference count between cores on every GET of a hot key.
        "get" => objects.read(args[1], now, |e| match e.map(|e| &e.value) {
            None => null_bulk(out),
            Some(Value::Str(v)) => bulk(out, v),
            Some(_) => error(out, WRONG_TYPE),
        }),
        "set" => set(objects, args, now, out),
        "del" => {
            let removed = args[1..]
                .iter()
                .filter(|k| delete_any(objects, k, now))
                .count();
            integer(out, removed as i64);
        }
        "exists" => {
            let found = args[1..]
                .iter()
                .filter(|k| objects.read(k, now, |e| e.is_some()))
                .count();
            integer(out, found as i64);
        }
        "mget" => {
            array_header(out, n - 1);
            for k in &args[1..] {
                match objects.get(k, now) {
                    Ok((_, v)) => bulk(out, &v),
                    // MGET answers nil for keys of other types too.
                    Err(_) => null_bulk(out),
                }
            }
        }
        "mset" => {
            if n % 2 != 1 {
                arity(out, cmd);
                return;
            }
            for pair in args[1..].chunks_exact(2) {
                if let Err(e) = objects.put(pair[0], pair[1], now) {
                    store_error(out, &e);
                    return;
                }
            }
            simple(out, "OK");
        }
        "incr" => incr_by(objects, args[1], Some(1), out, now),
        "decr" => incr_by(objects, args[1], Some(-1), out, now),
        "incrby" => incr_by(objects, args[1], parse_i64(args[2]), out, now),
        "decrby" => incr_by(
            objects,
            args[1],
            parse_i64(args[2]).and_then(i64::checked_neg),
            out,
            now,
        ),
        "append" => append(objects, args[1], args[2], out, now),
        "strlen" => match objects.get(args[1], now) {
            Ok((_, v)) => integer(out, v.len() as i64),
            Err(e) if e.code == ErrorCode::NoSuchKey => integer(out, 0),
            Err(e) => store_error(out, &e),
        },
        "type" => {
            let t = objects.read(args[1], now, |e| e.map_or("none", |e| e.value.type_name()));
            simple(out, t);
        }
        "ttl" | "pttl" => {
            let ms = objects.read(args[1], now, |e| match e {
                None => -2,
                Some(Entry {
                    expires_at: None, ..
                }) => -1,
                Some(Entry {
                    expires_at: Some(t),
                    ..
                }) => t.saturating_duration_since(now).as_millis() as i64,
            });
            let v = if cmd == "ttl" && ms >= 0 {
                (ms + 500) / 1000
            } else {
                ms
            };
            integer(out, v);
        }
        "keys" => {
            if args[1] != b"*" {
                error(out, "ERR KEYS supports only the pattern '*' in Camelot");
                return;
            }
            let keys = objects.keys(KEYS_MAX, now);
            array_header(out, keys.len());
            for k in keys {
                bulk(out, &k);
            }
        }
        "hset" | "hmset" => hset(objects, cmd, args, out, now),
        "hget" => with_hash(objects, args[1], now, out, |h, out| match h {
            Some(h) => match h.get(args[2]) {
                Some(v) => bulk(out, v),
                None => null_bulk(out),
            },
            None => null_bulk(out),
        }),
        "hmget" => with_hash(objects, args[1], now, out, |h, out| {
            array_header(out, n - 2);
            for f in &args[2..] {
                match h.and_then(|h| h.get(f)) {
                    Some(v) => bulk(out, v),
                    None => null_bulk(out),
                }
            }
        }),
        "hgetall" => with_hash(objects, args[1], now, out, |h, out| match h {
            Some(h) => {
                array_header(out, 2 * h.len());
                for (f, v) in h.iter() {
                    bulk(out, f);
                    bulk(out, v);
                }
            }
            None => array_header(out, 0),
        }),
        "hlen" => with_hash(objects, args[1], now, out, |h, out| {
            integer(out, h.map_or(0, |h| h.len() as i64))
        }),
        "hdel" => remove_items(objects, args, out, now, |v, f| match v {
            Value::Hash(h) => Some(h.remove(f)),
            _ => None,
        }),
        "zadd" => zadd(objects, args, out, now),
        "zrem" => remove_items(objects, args, out, now, |v, m| match v {
            Value::ZSet(z) => Some(z.remove(m)),
            _ => None,
        }),
        "zscore" => with_zset(objects, args[1], now, out, |z, out| {
            match z.and_then(|z| z.score(args[2])) {
                Some(s) => bulk(out, format_double(s).as_bytes()),
                None => null_bulk(out),
            }
        }),
        "zcard" => with_zset(objects, args[1], now, out, |z, out| {
            integer(out, z.map_or(0, |z| z.len() as i64))
        }),
        "zrangebyscore" => zrangebyscore(objects, args, out, now),
        "camelot.get" | "camelot.put" | "camelot.cas" | "camelot.del" | "camelot.scan" => {
            versioned(objects, cmd, args, out, now)
        }
        _ => unreachable!("every command with an arity is dispatched"),
    }
}

fn auth(ctx: &Ctx<'_>, session: &mut Session, args: &[&[u8]], out: &mut BytesMut) {
    let Some(token) = ctx.token else {
        error(
            out,
            "ERR AUTH <password> called without any password configured for the default \
             user. Are you sure your configuration is correct?",
        );
        return;
    };
    // AUTH password, or AUTH default password.
    let password = match args.len() {
        2 => &args[1],
        3 if args[1] == b"default" => &args[2],
        3 => {
            error(
                out,
                "WRONGPASS invalid username-password pair or user is disabled.",
            );
            return;
        }
        _ => {
            error(out, SYNTAX);
            return;
        }
    };
    if tokens_match(token, password) {
        session.authenticated = true;
        simple(out, "OK");
    } else {
        error(
            out,
            "WRONGPASS invalid username-password pair or user is disabled.",
        );
    }
}

fn info(ctx: &Ctx<'_>, out: &mut BytesMut) {
    let stats = ctx.state.stats_snapshot();
    let get = |name: &str| stats.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
    let keys = ctx.state.objects().len();
    let text = format!(
        "# Server\r\nredis_version:7.0.0\r\ncamelot_version:{}\r\nredis_mode:standalone\r\n\
         \r\n# Clients\r\nconnected_clients:{}\r\n\
         \r\n# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\n\
         \r\n# Stats\r\ntotal_connections_received:{}\r\n\
         \r\n# Keyspace\r\n{}",
        env!("CARGO_PKG_VERSION"),
        get("connections_current"),
        get("memory_used_bytes"),
        get("memory_cap_bytes"),
        get("connections_total"),
        if keys > 0 {
            format!("db0:keys={keys},expires=0,avg_ttl=0\r\n")
        } else {
            String::new()
        },
    );
    bulk(out, text.as_bytes());
}

/// Camelot's versioned operations, for RESP clients that want what the native protocol
/// gives: `CAMELOT.GET key` → `[version, value]` or nil; `CAMELOT.PUT key value` →
/// version; `CAMELOT.CAS key expected value` → new version, or nil on a conflict (expected
/// 0: only if absent); `CAMELOT.DEL key` → the removed version or nil; `CAMELOT.SCAN start
/// count` → `[key, version, value, …]` in key order.
fn versioned(objects: &ObjectStore, cmd: &str, args: &[&[u8]], out: &mut BytesMut, now: Instant) {
    let result = match cmd {
        "camelot.get" => objects.get(args[1], now).map(|(version, value)| {
            array_header(out, 2);
            integer(out, version as i64);
            bulk(out, &value);
        }),
        "camelot.put" => objects
            .put(args[1], args[2], now)
            .map(|v| integer(out, v as i64)),
        "camelot.cas" => {
            let Some(expected) = parse_i64(args[2]).filter(|v| *v >= 0) else {
                error(out, NOT_INTEGER);
                return;
            };
            match objects.cas_put(args[1], expected as u64, args[3], now) {
                Err(e) if e.code == ErrorCode::VersionConflict => {
                    null_bulk(out);
                    Ok(())
                }
                r => r.map(|v| integer(out, v as i64)),
            }
        }
        "camelot.del" => objects.delete(args[1], now).map(|v| integer(out, v as i64)),
        _ => {
            let Some(count) =
                parse_i64(args[2]).filter(|c| (0..=SCAN_ITEMS_MAX as i64).contains(c))
            else {
                error(out, &format!("ERR count must be 0 to {SCAN_ITEMS_MAX}"));
                return;
            };
            objects
                .scan(args[1], count as usize, SCAN_REPLY_BYTES_MAX, now)
                .map(|items| {
                    array_header(out, 3 * items.len());
                    for it in items {
                        bulk(out, &it.key);
                        integer(out, it.version as i64);
                        bulk(out, &it.value);
                    }
                })
        }
    };
    match result {
        Ok(()) => {}
        Err(e) if e.code == ErrorCode::NoSuchKey => null_bulk(out),
        Err(e) => store_error(out, &e),
    }
}

/// The few settings tools ask about (redis-benchmark warns without `save` and
/// `appendonly`). Exact names or `*`; anything else is an empty answer, as Redis gives
/// for an unknown parameter.
fn config_get(ctx: &Ctx<'_>, pattern: &[u8], out: &mut BytesMut) {
    let maxmemory = ctx.state.budget().cap().to_string();
    let settings = [
        ("save", ""),
        ("appendonly", "no"),
        ("databases", "1"),
        ("maxmemory", maxmemory.as_str()),
    ];
    let matched: Vec<_> = settings
        .iter()
        .filter(|(name, _)| pattern == b"*" || pattern.eq_ignore_ascii_case(name.as_bytes()))
        .collect();
    array_header(out, 2 * matched.len());
    for (name, value) in matched {
        bulk(out, name.as_bytes());
        bulk(out, value.as_bytes());
    }
}

/// HDEL and ZREM: removes `args[2..]` from the collection at `args[1]` and answers how
/// many were there. `remove` answers `None` for a value of the wrong type (before
/// anything is removed, since every item is asked of the same value).
fn remove_items(
    objects: &ObjectStore,
    args: &[&[u8]],
    out: &mut BytesMut,
    now: Instant,
    remove: impl Fn(&mut Value, &[u8]) -> Option<bool>,
) {
    let r = objects.modify(
        args[1],
        |_| 0,
        now,
        |e, clock| match e {
            None => Ok((0, Change::Keep)),
            Some(e) => {
                let mut removed = 0;
                for item in &args[2..] {
                    match remove(&mut e.value, item) {
                        None => return Err(wrong_type()),
                        Some(found) => removed += i64::from(found),
                    }
                }
                if removed > 0 {
                    e.version = clock.next();
                }
                Ok((removed, Change::Keep))
            }
        },
    );
    match r {
        Ok((removed, _)) => integer(out, removed),
        Err(e) => store_error(out, &e),
    }
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

fn set(objects: &ObjectStore, args: &[&[u8]], now: Instant, out: &mut BytesMut) {
    let (key, value) = (&args[1], &args[2]);
    let mut expires_at = None;
    let mut only_if_absent = false;
    let mut only_if_present = false;
    let mut i = 3;
    while i < args.len() {
        let a = &args[i];
        if is(a, "nx") {
            only_if_absent = true;
        } else if is(a, "xx") {
            only_if_present = true;
        } else if (is(a, "ex") || is(a, "px")) && i + 1 < args.len() && expires_at.is_none() {
            let Some(t) = parse_i64(args[i + 1]) else {
                error(out, NOT_INTEGER);
                return;
            };
            let ms = if is(a, "ex") {
                t.checked_mul(1000)
            } else {
                Some(t)
            };
            match ms {
                Some(ms) if ms > 0 && ms <= EXPIRE_MS_MAX => {
                    expires_at = Some(now + Duration::from_millis(ms as u64));
                }
                _ => {
                    error(out, "ERR invalid expire time in 'set' command");
                    return;
                }
            }
            i += 1;
        } else {
            error(out, SYNTAX);
            return;
        }
        i += 1;
    }
    if only_if_absent && only_if_present {
        error(out, SYNTAX);
        return;
    }
    if let Err(e) = check_value_len(value.len()) {
        store_error(out, &e);
        return;
    }
    let value = Bytes::copy_from_slice(value);
    let cost = ENTRY_OVERHEAD_BYTES + (key.len() + value.len()) as u64;
    let r = objects.modify(
        key,
        |_| cost,
        now,
        |e, clock| match e {
            Some(_) if only_if_absent => Ok((false, Change::Keep)),
            None if only_if_present => Ok((false, Change::Keep)),
            // SET replaces a value of any type, as in Redis.
            Some(e) => {
                e.value = Value::Str(value);
                e.expires_at = expires_at;
                e.version = clock.next();
                Ok((true, Change::Keep))
            }
            None => Ok((
                true,
                Change::Insert {
                    value: Value::Str(value),
                    expires_at,
                },
            )),
        },
    );
    match r {
        Ok((true, _)) => simple(out, "OK"),
        Ok((false, _)) => null_bulk(out),
        Err(e) => store_error(out, &e),
    }
}

fn incr_by(
    objects: &ObjectStore,
    key: &[u8],
    delta: Option<i64>,
    out: &mut BytesMut,
    now: Instant,
) {
    let Some(delta) = delta else {
        error(out, NOT_INTEGER);
        return;
    };
    let cost = ENTRY_OVERHEAD_BYTES + key.len() as u64 + 20;
    let r = objects.modify(
        key,
        |_| cost,
        now,
        |e, clock| {
            let current = match e.as_deref() {
                None => 0,
                Some(Entry {
                    value: Value::Str(v),
                    ..
                }) => parse_i64(v)
                    .ok_or_else(|| ErrorReply::new(ErrorCode::BadRequest, NOT_INTEGER))?,
                Some(_) => return Err(wrong_type()),
            };
            let next = current.checked_add(delta).ok_or_else(|| {
                ErrorReply::new(
                    ErrorCode::BadRequest,
                    "ERR increment or decrement would overflow",
                )
            })?;
            let value = Value::Str(Bytes::from(next.to_string()));
            match e {
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
        Ok((n, _)) => integer(out, n),
        Err(e) if e.code == ErrorCode::BadRequest => error(out, &e.message),
        Err(e) => store_error(out, &e),
    }
}

fn append(objects: &ObjectStore, key: &[u8], tail: &[u8], out: &mut BytesMut, now: Instant) {
    let cost = ENTRY_OVERHEAD_BYTES + (key.len() + tail.len()) as u64;
    let r = objects.modify(
        key,
        |_| cost,
        now,
        |e, clock| match e {
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
                check_value_len(v.len() + tail.len())?;
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
        Ok((len, _)) => integer(out, len as i64),
        Err(e) => store_error(out, &e),
    }
}

fn with_hash(
    objects: &ObjectStore,
    key: &[u8],
    now: Instant,
    out: &mut BytesMut,
    f: impl FnOnce(Option<&Hash>, &mut BytesMut),
) {
    objects.read(key, now, |e| match e.map(|e| &e.value) {
        None => f(None, out),
        Some(Value::Hash(h)) => f(Some(h), out),
        Some(_) => error(out, WRONG_TYPE),
    })
}

fn with_zset(
    objects: &ObjectStore,
    key: &[u8],
    now: Instant,
    out: &mut BytesMut,
    f: impl FnOnce(Option<&ZSet>, &mut BytesMut),
) {
    objects.read(key, now, |e| match e.map(|e| &e.value) {
        None => f(None, out),
        Some(Value::ZSet(z)) => f(Some(z), out),
        Some(_) => error(out, WRONG_TYPE),
    })
}

fn hset(objects: &ObjectStore, cmd: &str, args: &[&[u8]], out: &mut BytesMut, now: Instant) {
    let pairs = &args[2..];
    if !pairs.len().is_multiple_of(2) {
        arity(out, cmd);
        return;
    }
    let growth: u64 = ENTRY_OVERHEAD_BYTES
        + args[1].len() as u64
        + pairs
            .chunks_exact(2)
            .map(|p| (p[0].len() + p[1].len()) as u64 + FIELD_OVERHEAD_BYTES)
            .sum::<u64>();
    // Copied out of the input buffer, which they would otherwise keep alive.
    let owned = || {
        pairs
            .chunks_exact(2)
            .map(|p| (Bytes::copy_from_slice(p[0]), Bytes::copy_from_slice(p[1])))
    };
    let r = objects.modify(
        args[1],
        |_| growth,
        now,
        |e, clock| match e {
            None => {
                let mut h = Hash::default();
                let mut added = 0;
                for (f, v) in owned() {
                    added += usize::from(h.set(f, v)?);
                }
                Ok((
                    added,
                    Change::Insert {
                        value: Value::Hash(h),
                        expires_at: None,
                    },
                ))
            }
            Some(e) => {
                let Value::Hash(h) = &mut e.value else {
                    return Err(wrong_type());
                };
                let mut added = 0;
                for (f, v) in owned() {
                    added += usize::from(h.set(f, v)?);
                }
                e.version = clock.next();
                Ok((added, Change::Keep))
            }
        },
    );
    match r {
        Ok((added, _)) if cmd == "hset" => integer(out, added as i64),
        Ok(_) => simple(out, "OK"),
        Err(e) => store_error(out, &e),
    }
}

fn zadd(objects: &ObjectStore, args: &[&[u8]], out: &mut BytesMut, now: Instant) {
    let mut i = 2;
    let (mut nx, mut xx, mut ch) = (false, false, false);
    while i < args.len() {
        if is(args[i], "nx") {
            nx = true;
        } else if is(args[i], "xx") {
            xx = true;
        } else if is(args[i], "ch") {
            ch = true;
        } else {
            break;
        }
        i += 1;
    }
    let rest = &args[i..];
    if rest.is_empty() || !rest.len().is_multiple_of(2) {
        error(out, SYNTAX);
        return;
    }
    if nx && xx {
        error(
            out,
            "ERR XX and NX options at the same time are not compatible",
        );
        return;
    }
    let mut members = Vec::with_capacity(rest.len() / 2);
    for p in rest.chunks_exact(2) {
        let Some(score) = parse_f64(p[0]) else {
            error(out, NOT_FLOAT);
            return;
        };
        members.push((score, Bytes::copy_from_slice(p[1])));
    }
    let growth: u64 = ENTRY_OVERHEAD_BYTES
        + args[1].len() as u64
        + members
            .iter()
            .map(|(_, m)| 2 * m.len() as u64 + 8 + FIELD_OVERHEAD_BYTES)
            .sum::<u64>();
    let apply = |z: &mut ZSet| -> Result<i64, ErrorReply> {
        let mut counted = 0;
        for (score, m) in &members {
            let old = z.score(m);
            if (nx && old.is_some()) || (xx && old.is_none()) {
                continue;
            }
            let added = z.insert(m.clone(), *score)?;
            if added || (ch && old != Some(*score)) {
                counted += 1;
            }
        }
        Ok(counted)
    };
    let r = objects.modify(
        args[1],
        |_| growth,
        now,
        |e, clock| match e {
            None => {
                let mut z = ZSet::default();
                let counted = apply(&mut z)?;
                Ok((
                    counted,
                    Change::Insert {
                        value: Value::ZSet(z),
                        expires_at: None,
                    },
                ))
            }
            Some(e) => {
                let Value::ZSet(z) = &mut e.value else {
                    return Err(wrong_type());
                };
                let counted = apply(z)?;
                e.version = clock.next();
                Ok((counted, Change::Keep))
            }
        },
    );
    match r {
        Ok((counted, _)) => integer(out, counted),
        Err(e) => store_error(out, &e),
    }
}

fn zrangebyscore(objects: &ObjectStore, args: &[&[u8]], out: &mut BytesMut, now: Instant) {
    let (Some(min), Some(max)) = (parse_bound(args[2]), parse_bound(args[3])) else {
        error(out, "ERR min or max is not a float");
        return;
    };
    let mut with_scores = false;
    let mut offset = 0usize;
    let mut count = usize::MAX;
    let mut i = 4;
    while i < args.len() {
        if is(args[i], "withscores") {
            with_scores = true;
            i += 1;
        } else if is(args[i], "limit") && i + 2 < args.len() {
            let (Some(o), Some(c)) = (parse_i64(args[i + 1]), parse_i64(args[i + 2])) else {
                error(out, NOT_INTEGER);
                return;
            };
            if o < 0 {
                // Redis answers an empty list for a negative offset.
                array_header(out, 0);
                return;
            }
            offset = o as usize;
            // A negative count means "all the rest".
            count = if c < 0 { usize::MAX } else { c as usize };
            i += 3;
        } else {
            error(out, SYNTAX);
            return;
        }
    }
    with_zset(objects, args[1], now, out, |z, out| {
        let found = z.map_or_else(Vec::new, |z| z.range_by_score(min, max, offset, count));
        array_header(out, found.len() * if with_scores { 2 } else { 1 });
        for (m, s) in found {
            bulk(out, &m);
            if with_scores {
                bulk(out, format_double(s).as_bytes());
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;

    struct Harness {
        state: ServerState,
        token: Option<Vec<u8>>,
        session: Session,
    }

    impl Harness {
        fn new(cap_bytes: u64, token: Option<&str>) -> Self {
            Harness {
                state: ServerState::new(MemoryBudget::new(cap_bytes), 0),
                token: token.map(|t| t.as_bytes().to_vec()),
                session: Session::default(),
            }
        }

        fn run(&mut self, line: &str) -> String {
            let args: Vec<&[u8]> = line.split_whitespace().map(str::as_bytes).collect();
            let ctx = Ctx {
                state: &self.state,
                token: self.token.as_deref(),
            };
            let mut out = BytesMut::new();
            execute(&ctx, &mut self.session, &args, Instant::now(), &mut out);
            String::from_utf8_lossy(&out).into_owned()
        }
    }

    #[test]
    fn strings_behave_like_redis() {
        let mut h = Harness::new(1 << 20, None);
        assert_eq!(h.run("PING"), "+PONG\r\n");
        assert_eq!(h.run("get k"), "$-1\r\n");
        assert_eq!(h.run("SET k hello"), "+OK\r\n");
        assert_eq!(h.run("set k x NX"), "$-1\r\n");
        assert_eq!(h.run("set other x XX"), "$-1\r\n");
        assert_eq!(h.run("GET k"), "$5\r\nhello\r\n");
        assert_eq!(h.run("APPEND k !!"), ":7\r\n");
        assert_eq!(h.run("STRLEN k"), ":7\r\n");
        assert_eq!(h.run("INCR n"), ":1\r\n");
        assert_eq!(h.run("INCRBY n 41"), ":42\r\n");
        assert_eq!(h.run("DECR n"), ":41\r\n");
        assert_eq!(
            h.run("INCR k"),
            "-ERR value is not an integer or out of range\r\n"
        );
        assert_eq!(h.run("MSET a 1 b 2"), "+OK\r\n");
        assert_eq!(
            h.run("MGET a nope b"),
            "*3\r\n$1\r\n1\r\n$-1\r\n$1\r\n2\r\n"
        );
        assert_eq!(h.run("EXISTS a b nope"), ":2\r\n");
        assert_eq!(h.run("DEL a nope"), ":1\r\n");
        assert_eq!(h.run("DBSIZE"), ":3\r\n");
        assert_eq!(h.run("SET e v EX 100"), "+OK\r\n");
        assert_eq!(h.run("TTL e"), ":100\r\n");
        assert_eq!(
            h.run("SET e v EX 0"),
            "-ERR invalid expire time in 'set' command\r\n"
        );
        assert_eq!(h.run("SET e v BOGUS"), "-ERR syntax error\r\n");
        assert_eq!(h.run("SELECT 0"), "+OK\r\n");
        assert_eq!(
            h.run("CONFIG GET appendonly"),
            "*2\r\n$10\r\nappendonly\r\n$2\r\nno\r\n"
        );
        assert_eq!(h.run("CONFIG GET nosuch"), "*0\r\n");
        assert_eq!(h.run("SELECT 1"), "-ERR DB index is out of range\r\n");
        assert_eq!(h.run("FLUSHALL"), "+OK\r\n");
        assert_eq!(h.run("DBSIZE"), ":0\r\n");
        assert_eq!(h.state.budget().used(), 0);
    }

    #[test]
    fn errors_have_redis_shapes() {
        let mut h = Harness::new(1 << 20, None);
        assert_eq!(
            h.run("GET"),
            "-ERR wrong number of arguments for 'get' command\r\n"
        );
        assert_eq!(
            h.run("FROB a b"),
            "-ERR unknown command 'FROB', with args beginning with: 'a' 'b' \r\n"
        );
        h.run("HSET h f v");
        assert_eq!(h.run("GET h"), format!("-{WRONG_TYPE}\r\n"));
        assert_eq!(h.run("ZADD h 1 m"), format!("-{WRONG_TYPE}\r\n"));
        assert_eq!(
            h.run("ZADD z notanumber m"),
            "-ERR value is not a valid float\r\n"
        );
        assert_eq!(
            h.run("HSET h f"),
            "-ERR wrong number of arguments for 'hset' command\r\n"
        );
    }

    #[test]
    fn hashes_and_sorted_sets() {
        let mut h = Harness::new(1 << 20, None);
        assert_eq!(h.run("HSET u f1 a f2 b"), ":2\r\n");
        assert_eq!(h.run("HSET u f1 c"), ":0\r\n");
        assert_eq!(h.run("HMSET u f3 d"), "+OK\r\n");
        assert_eq!(h.run("HGET u f1"), "$1\r\nc\r\n");
        assert_eq!(h.run("HMGET u f2 zz"), "*2\r\n$1\r\nb\r\n$-1\r\n");
        assert_eq!(h.run("HLEN u"), ":3\r\n");
        assert!(h.run("HGETALL u").starts_with("*6\r\n"));
        assert_eq!(h.run("HDEL u f1 f2 f3"), ":3\r\n");
        assert_eq!(h.run("EXISTS u"), ":0\r\n");
        assert_eq!(h.run("ZADD idx 3 c 1 a 2 b"), ":3\r\n");
        assert_eq!(h.run("ZADD idx 1.5 a"), ":0\r\n");
        assert_eq!(h.run("ZSCORE idx a"), "$3\r\n1.5\r\n");
        assert_eq!(h.run("ZCARD idx"), ":3\r\n");
        assert_eq!(
            h.run("ZRANGEBYSCORE idx (1.5 +inf LIMIT 0 1"),
            "*1\r\n$1\r\nb\r\n"
        );
        assert_eq!(
            h.run("ZRANGEBYSCORE idx -inf 2 WITHSCORES"),
            "*4\r\n$1\r\na\r\n$3\r\n1.5\r\n$1\r\nb\r\n$1\r\n2\r\n"
        );
        assert_eq!(h.run("ZREM idx a nope"), ":1\r\n");
        assert_eq!(h.run("TYPE idx"), "+zset\r\n");
    }

    #[test]
    fn versioned_commands_expose_versions_and_conflicts() {
        let mut h = Harness::new(1 << 20, None);
        assert_eq!(h.run("CAMELOT.GET k"), "$-1\r\n");
        let v1: i64 = h.run("CAMELOT.PUT k one")[1..].trim().parse().unwrap();
        assert_eq!(
            h.run("CAMELOT.GET k"),
            format!("*2\r\n:{v1}\r\n$3\r\none\r\n")
        );
        assert_eq!(h.run(&format!("CAMELOT.CAS k {} two", v1 + 100)), "$-1\r\n");
        assert_eq!(h.run("CAMELOT.CAS k 0 two"), "$-1\r\n");
        let v2: i64 = h.run(&format!("CAMELOT.CAS k {v1} two"))[1..]
            .trim()
            .parse()
            .unwrap();
        assert!(v2 > v1);
        h.run("CAMELOT.PUT j x");
        assert_eq!(
            h.run("CAMELOT.SCAN a 10"),
            format!(
                "*6\r\n$1\r\nj\r\n:{}\r\n$1\r\nx\r\n$1\r\nk\r\n:{v2}\r\n$3\r\ntwo\r\n",
                v2 + 1
            )
        );
        assert_eq!(h.run("CAMELOT.DEL k"), format!(":{v2}\r\n"));
        assert_eq!(h.run("CAMELOT.DEL k"), "$-1\r\n");
    }

    #[test]
    fn a_token_requires_auth() {
        let mut h = Harness::new(1 << 20, Some("s3cret"));
        assert_eq!(h.run("GET k"), "-NOAUTH Authentication required.\r\n");
        assert!(h.run("AUTH wrong").starts_with("-WRONGPASS"));
        assert_eq!(h.run("AUTH s3cret"), "+OK\r\n");
        assert_eq!(h.run("GET k"), "$-1\r\n");
    }

    #[test]
    fn a_full_server_answers_oom_and_keeps_its_data() {
        let mut h = Harness::new(4096, None);
        assert_eq!(h.run("SET keep v"), "+OK\r\n");
        let big = "x".repeat(5000);
        assert!(h.run(&format!("SET big {big}")).starts_with("-OOM"));
        assert!(h.run(&format!("HSET hh f {big}")).starts_with("-OOM"));
        assert_eq!(h.run("GET keep"), "$1\r\nv\r\n");
        assert!(h.state.budget().used() <= 4096);
    }
}
