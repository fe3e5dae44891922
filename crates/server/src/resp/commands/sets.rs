//! Set commands: SADD, SREM, SMEMBERS, SISMEMBER, SCARD.

use super::{Call, Reply, WRONG_TYPE};
use crate::objects::{upsert_collection, Set, Value, ENTRY_OVERHEAD_BYTES, FIELD_OVERHEAD_BYTES};
use bytes::Bytes;

pub(super) fn sadd(c: &mut Call<'_>) {
    let members = &c.args[2..];
    let growth = ENTRY_OVERHEAD_BYTES
        + c.args[1].len() as u64
        + members
            .iter()
            .map(|m| m.len() as u64 + FIELD_OVERHEAD_BYTES)
            .sum::<u64>();
    let fill = |s: &mut Set| -> Result<i64, _> {
        let mut added = 0;
        for m in members {
            added += i64::from(s.insert(Bytes::copy_from_slice(m))?);
        }
        Ok(added)
    };
    let r = c.objects().modify(
        c.args[1],
        |_| growth,
        c.now,
        |e, clock| upsert_collection(e, clock, fill, |added| *added > 0),
    );
    match r {
        Ok((added, _)) => c.out.integer(added),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn srem(c: &mut Call<'_>) {
    super::hashes::remove_items(c, |v, m| match v {
        Value::Set(s) => Some(s.remove(m)),
        _ => None,
    });
}

fn with_set(c: &mut Call<'_>, f: impl FnOnce(Option<&Set>, &mut Reply<'_>)) {
    let out = &mut *c.out;
    c.ctx
        .state
        .objects()
        .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
            None => f(None, out),
            Some(Value::Set(s)) => f(Some(s), out),
            Some(_) => out.error(WRONG_TYPE),
        })
}

pub(super) fn smembers(c: &mut Call<'_>) {
    with_set(c, |s, out| match s {
        None => out.set_header(0),
        Some(s) => {
            out.set_header(s.len());
            for m in s.iter() {
                out.bulk(m);
            }
        }
    });
}

pub(super) fn sismember(c: &mut Call<'_>) {
    let member = c.args[2];
    with_set(c, |s, out| {
        out.integer(i64::from(s.is_some_and(|s| s.contains(member))))
    });
}

pub(super) fn scard(c: &mut Call<'_>) {
    with_set(c, |s, out| out.integer(s.map_or(0, |s| s.len() as i64)));
}
