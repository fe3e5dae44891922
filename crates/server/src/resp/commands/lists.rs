//! List commands: LPUSH, RPUSH, LPOP, RPOP, LRANGE, LLEN.

use super::{Call, WRONG_TYPE};
use crate::objects::{
    upsert_collection, wrong_type, Change, List, Value, ENTRY_OVERHEAD_BYTES, FIELD_OVERHEAD_BYTES,
};
use bytes::Bytes;

fn push(c: &mut Call<'_>, front: bool) {
    let items = &c.args[2..];
    let growth = ENTRY_OVERHEAD_BYTES
        + c.args[1].len() as u64
        + items
            .iter()
            .map(|i| i.len() as u64 + FIELD_OVERHEAD_BYTES)
            .sum::<u64>();
    let fill = |l: &mut List| -> Result<usize, _> {
        for i in items {
            l.push(Bytes::copy_from_slice(i), front)?;
        }
        Ok(l.len())
    };
    let r = c.objects().modify(
        c.args[1],
        |_| growth,
        c.now,
        |e, clock| upsert_collection(e, clock, fill, |_| true),
    );
    match r {
        Ok((len, _)) => c.out.integer(len as i64),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn lpush(c: &mut Call<'_>) {
    push(c, true);
}

pub(super) fn rpush(c: &mut Call<'_>) {
    push(c, false);
}

/// `LPOP key [count]`: one value (or nil), or with a count an array (nil array when the
/// key is missing).
fn pop(c: &mut Call<'_>, name: &str, front: bool) {
    if c.args.len() > 3 {
        c.arity(name);
        return;
    }
    let count = match c.args.get(2) {
        None => None,
        Some(a) => match super::parse_int(a).filter(|n| *n >= 0) {
            Some(n) => Some(n as usize),
            None => {
                c.error("ERR value is out of range, must be positive");
                return;
            }
        },
    };
    let r = c.objects().modify(
        c.args[1],
        |_| 0,
        c.now,
        |e, clock| match e {
            None => Ok((None, Change::Keep)),
            Some(e) => {
                let Value::List(l) = &mut e.value else {
                    return Err(wrong_type());
                };
                let mut popped = Vec::new();
                while popped.len() < count.unwrap_or(1) {
                    match l.pop(front) {
                        Some(v) => popped.push(v),
                        None => break,
                    }
                }
                if !popped.is_empty() {
                    e.version = clock.next();
                }
                Ok((Some(popped), Change::Keep))
            }
        },
    );
    let out = &mut *c.out;
    match (r, count) {
        (Ok((None, _)), None) => out.null(),
        (Ok((None, _)), Some(_)) => out.null_array(),
        (Ok((Some(v), _)), None) => match v.first() {
            Some(v) => out.bulk(v),
            None => out.null(),
        },
        (Ok((Some(v), _)), Some(_)) => {
            out.array_header(v.len());
            for item in v {
                out.bulk(&item);
            }
        }
        (Err(e), _) => out.store_error(&e),
    }
}

pub(super) fn lpop(c: &mut Call<'_>) {
    pop(c, "lpop", true);
}

pub(super) fn rpop(c: &mut Call<'_>) {
    pop(c, "rpop", false);
}

/// Redis's index clamp for LRANGE and ZRANGE: negative counts from the end; `None` when
/// the range is empty.
pub(super) fn clamp_range(start: i64, end: i64, len: usize) -> Option<(usize, usize)> {
    let len = len as i64;
    let start = if start < 0 {
        (len + start).max(0)
    } else {
        start
    };
    let end = if end < 0 { len + end } else { end };
    if start > end || start >= len {
        return None;
    }
    Some((start as usize, end.min(len - 1) as usize))
}

pub(super) fn lrange(c: &mut Call<'_>) {
    let Some(start) = c.int_arg(2) else { return };
    let Some(end) = c.int_arg(3) else { return };
    let out = &mut *c.out;
    c.ctx
        .state
        .objects()
        .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
            None => out.array_header(0),
            Some(Value::List(l)) => match clamp_range(start, end, l.len()) {
                None => out.array_header(0),
                Some((from, to)) => {
                    out.array_header(to - from + 1);
                    for v in l.iter().skip(from).take(to - from + 1) {
                        out.bulk(v);
                    }
                }
            },
            Some(_) => out.error(WRONG_TYPE),
        })
}

pub(super) fn llen(c: &mut Call<'_>) {
    let out = &mut *c.out;
    c.ctx
        .state
        .objects()
        .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
            None => out.integer(0),
            Some(Value::List(l)) => out.integer(l.len() as i64),
            Some(_) => out.error(WRONG_TYPE),
        })
}
