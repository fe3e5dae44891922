//! Hash commands: HSET, HMSET, HGET, HMGET, HGETALL, HLEN, HDEL.

use super::{Call, Reply, WRONG_TYPE};
use crate::objects::{
    upsert_collection, wrong_type, Change, Hash, Value, ENTRY_OVERHEAD_BYTES, FIELD_OVERHEAD_BYTES,
};
use bytes::Bytes;

fn with_hash(c: &mut Call<'_>, f: impl FnOnce(Option<&Hash>, &mut Reply<'_>)) {
    let out = &mut *c.out;
    c.ctx
        .state
        .objects()
        .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
            None => f(None, out),
            Some(Value::Hash(h)) => f(Some(h), out),
            Some(_) => out.error(WRONG_TYPE),
        })
}

pub(super) fn hget(c: &mut Call<'_>) {
    let field = c.args[2];
    with_hash(c, |h, out| match h.and_then(|h| h.get(field)) {
        Some(v) => out.bulk(v),
        None => out.null(),
    });
}

pub(super) fn hmget(c: &mut Call<'_>) {
    let fields = &c.args[2..];
    with_hash(c, |h, out| {
        out.array_header(fields.len());
        for f in fields {
            match h.and_then(|h| h.get(f)) {
                Some(v) => out.bulk(v),
                None => out.null(),
            }
        }
    });
}

pub(super) fn hgetall(c: &mut Call<'_>) {
    with_hash(c, |h, out| match h {
        Some(h) => {
            out.map_header(h.len());
            for (f, v) in h.iter() {
                out.bulk(f);
                out.bulk(v);
            }
        }
        None => out.map_header(0),
    });
}

pub(super) fn hlen(c: &mut Call<'_>) {
    with_hash(c, |h, out| out.integer(h.map_or(0, |h| h.len() as i64)));
}

pub(super) fn hdel(c: &mut Call<'_>) {
    remove_items(c, |v, f| match v {
        Value::Hash(h) => Some(h.remove(f)),
        _ => None,
    });
}

pub(super) fn hset(c: &mut Call<'_>) {
    hset_generic(c, "hset");
}

pub(super) fn hmset(c: &mut Call<'_>) {
    hset_generic(c, "hmset");
}

fn hset_generic(c: &mut Call<'_>, name: &str) {
    let pairs = &c.args[2..];
    if !pairs.len().is_multiple_of(2) {
        c.arity(name);
        return;
    }
    let growth: u64 = ENTRY_OVERHEAD_BYTES
        + c.args[1].len() as u64
        + pairs
            .chunks_exact(2)
            .map(|p| (p[0].len() + p[1].len()) as u64 + FIELD_OVERHEAD_BYTES)
            .sum::<u64>();
    // Copied out of the input buffer, which they would otherwise keep alive.
    let fill = |h: &mut Hash| -> Result<usize, _> {
        let mut added = 0;
        for p in pairs.chunks_exact(2) {
            let (f, v) = (Bytes::copy_from_slice(p[0]), Bytes::copy_from_slice(p[1]));
            added += usize::from(h.set(f, v)?);
        }
        Ok(added)
    };
    let r = c.objects().modify(
        c.args[1],
        |_| growth,
        c.now,
        |e, clock| upsert_collection(e, clock, fill, |_| true),
    );
    match r {
        Ok((added, _)) if name == "hset" => c.out.integer(added as i64),
        Ok(_) => c.out.simple("OK"),
        Err(e) => c.store_error(&e),
    }
}

/// HDEL, SREM and ZREM: removes `args[2..]` from the collection at `args[1]` and answers
/// how many were there. `remove` answers `None` for a value of the wrong type (before
/// anything is removed, since every item is asked of the same value).
pub(super) fn remove_items(c: &mut Call<'_>, remove: impl Fn(&mut Value, &[u8]) -> Option<bool>) {
    let items = &c.args[2..];
    let r = c.objects().modify(
        c.args[1],
        |_| 0,
        c.now,
        |e, clock| match e {
            None => Ok((0, Change::Keep)),
            Some(e) => {
                let mut removed = 0;
                for item in items {
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
        Ok((removed, _)) => c.out.integer(removed),
        Err(e) => c.store_error(&e),
    }
}
