//! Sorted-set commands: ZADD, ZREM, ZSCORE, ZCARD, ZRANK, ZRANGE, ZREVRANGE,
//! ZRANGEBYSCORE.

use super::lists::clamp_range;
use super::{is, parse_float, Call, Reply, NOT_FLOAT, NOT_INTEGER, SYNTAX, WRONG_TYPE};
use crate::objects::{upsert_collection, Value, ZSet, ENTRY_OVERHEAD_BYTES, FIELD_OVERHEAD_BYTES};
use bytes::Bytes;
use camelot_proto::ErrorReply;

fn with_zset(c: &mut Call<'_>, f: impl FnOnce(Option<&ZSet>, &mut Reply<'_>)) {
    let out = &mut *c.out;
    c.ctx
        .state
        .objects()
        .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
            None => f(None, out),
            Some(Value::ZSet(z)) => f(Some(z), out),
            Some(_) => out.error(WRONG_TYPE),
        })
}

pub(super) fn zadd(c: &mut Call<'_>) {
    let args = c.args;
    let mut i = 2;
    let (mut nx, mut xx, mut ch, mut gt, mut lt, mut incr) =
        (false, false, false, false, false, false);
    while i < args.len() {
        let a = args[i];
        if is(a, "nx") {
            nx = true;
        } else if is(a, "xx") {
            xx = true;
        } else if is(a, "ch") {
            ch = true;
        } else if is(a, "gt") {
            gt = true;
        } else if is(a, "lt") {
            lt = true;
        } else if is(a, "incr") {
            incr = true;
        } else {
            break;
        }
        i += 1;
    }
    let rest = &args[i..];
    if rest.is_empty() || !rest.len().is_multiple_of(2) {
        c.error(SYNTAX);
        return;
    }
    if nx && xx {
        c.error("ERR XX and NX options at the same time are not compatible");
        return;
    }
    if (nx && (gt || lt)) || (gt && lt) {
        c.error("ERR GT, LT, and/or NX options at the same time are not compatible");
        return;
    }
    if incr {
        c.error("ERR ZADD INCR is not supported by Camelot");
        return;
    }
    let mut members = Vec::with_capacity(rest.len() / 2);
    for p in rest.chunks_exact(2) {
        let Some(score) = parse_float(p[0]) else {
            c.error(NOT_FLOAT);
            return;
        };
        // Redis keeps small sets as text, where -0 reads back as 0.
        members.push((score + 0.0, Bytes::copy_from_slice(p[1])));
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
            let skip = match old {
                Some(old) => nx || (gt && *score <= old) || (lt && *score >= old),
                None => xx,
            };
            if skip {
                continue;
            }
            let added = z.insert(m.clone(), *score)?;
            if added || (ch && old != Some(*score)) {
                counted += 1;
            }
        }
        Ok(counted)
    };
    let r = c.objects().modify(
        args[1],
        |_| growth,
        c.now,
        |e, clock| upsert_collection(e, clock, apply, |_| true),
    );
    match r {
        Ok((counted, _)) => c.out.integer(counted),
        Err(e) => c.store_error(&e),
    }
}

pub(super) fn zrem(c: &mut Call<'_>) {
    super::hashes::remove_items(c, |v, m| match v {
        Value::ZSet(z) => Some(z.remove(m)),
        _ => None,
    });
}

pub(super) fn zscore(c: &mut Call<'_>) {
    let member = c.args[2];
    with_zset(c, |z, out| match z.and_then(|z| z.score(member)) {
        Some(s) => out.double(s),
        None => out.null(),
    });
}

pub(super) fn zcard(c: &mut Call<'_>) {
    with_zset(c, |z, out| out.integer(z.map_or(0, |z| z.len() as i64)));
}

pub(super) fn zrank(c: &mut Call<'_>) {
    let member = c.args[2];
    with_zset(c, |z, out| match z.and_then(|z| z.rank(member)) {
        Some(r) => out.integer(r as i64),
        None => out.null(),
    });
}

/// A score range bound as `zslParseRange` reads it: `(x` is exclusive, the number is
/// whatever `strtod` makes of the rest (leading spaces allowed, the empty string is 0).
fn parse_bound(b: &[u8]) -> Option<(f64, bool)> {
    let (text, exclusive) = match b.strip_prefix(b"(") {
        Some(rest) => (rest, true),
        None => (b, false),
    };
    let text = std::str::from_utf8(text).ok()?.trim_start();
    if text.is_empty() {
        return Some((0.0, exclusive));
    }
    let x = match text.to_ascii_lowercase().as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => f64::INFINITY,
        "-inf" | "-infinity" => f64::NEG_INFINITY,
        t if t.contains("inf") || t.contains("nan") => return None,
        t => t.parse().ok()?,
    };
    (!x.is_nan()).then_some((x, exclusive))
}

#[derive(Clone, Copy, PartialEq)]
enum RangeKind {
    Auto,
    Rank,
    Score,
    Lex,
}

/// Redis's `zrangeGenericCommand`: ZRANGE (kind and direction from the options),
/// ZREVRANGE (rank, reversed) and ZRANGEBYSCORE (score, forward).
fn zrange_generic(c: &mut Call<'_>, mut kind: RangeKind, mut reverse: Option<bool>) {
    let args = c.args;
    let mut with_scores = false;
    let (mut offset, mut limit): (i64, i64) = (0, -1);
    let mut j = 4;
    while j < args.len() {
        let left = args.len() - j - 1;
        let a = args[j];
        if is(a, "withscores") {
            with_scores = true;
        } else if is(a, "limit") && left >= 2 {
            let (Some(o), Some(l)) = (super::parse_int(args[j + 1]), super::parse_int(args[j + 2]))
            else {
                c.error(NOT_INTEGER);
                return;
            };
            (offset, limit) = (o, l);
            j += 2;
        } else if reverse.is_none() && is(a, "rev") {
            reverse = Some(true);
        } else if kind == RangeKind::Auto && is(a, "bylex") {
            kind = RangeKind::Lex;
        } else if kind == RangeKind::Auto && is(a, "byscore") {
            kind = RangeKind::Score;
        } else {
            c.error(SYNTAX);
            return;
        }
        j += 1;
    }
    let kind = if kind == RangeKind::Auto {
        RangeKind::Rank
    } else {
        kind
    };
    let reverse = reverse.unwrap_or(false);
    if (offset != 0 || limit != -1) && kind == RangeKind::Rank {
        c.error(
            "ERR syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX",
        );
        return;
    }
    if with_scores && kind == RangeKind::Lex {
        c.error("ERR syntax error, WITHSCORES not supported in combination with BYLEX");
        return;
    }
    let found: Vec<(Bytes, f64)> = match kind {
        RangeKind::Lex => {
            c.error("ERR BYLEX is not supported by Camelot");
            return;
        }
        RangeKind::Rank | RangeKind::Auto => {
            let Some(start) = c.int_arg(2) else { return };
            let Some(end) = c.int_arg(3) else { return };
            let mut found = None;
            let out = &mut *c.out;
            let ok = c
                .ctx
                .state
                .objects()
                .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
                    None => true,
                    Some(Value::ZSet(z)) => {
                        found = clamp_range(start, end, z.len())
                            .map(|(from, to)| z.range_by_rank(from, to, reverse));
                        true
                    }
                    Some(_) => {
                        out.error(WRONG_TYPE);
                        false
                    }
                });
            if !ok {
                return;
            }
            found.unwrap_or_default()
        }
        RangeKind::Score => {
            // ZRANGE ... BYSCORE REV takes max first.
            let (lo, hi) = if reverse { (3, 2) } else { (2, 3) };
            let (Some(min), Some(max)) = (parse_bound(args[lo]), parse_bound(args[hi])) else {
                c.error("ERR min or max is not a float");
                return;
            };
            let count = usize::try_from(limit).unwrap_or(usize::MAX);
            let mut found = None;
            let out = &mut *c.out;
            let ok = c
                .ctx
                .state
                .objects()
                .read(c.args[1], c.now, |e| match e.map(|e| &e.value) {
                    None => true,
                    // Redis walks past every member for a negative offset.
                    Some(Value::ZSet(_)) if offset < 0 => true,
                    Some(Value::ZSet(z)) => {
                        found = Some(if reverse {
                            let mut all = z.range_by_score(min, max, 0, usize::MAX);
                            all.reverse();
                            all.into_iter().skip(offset as usize).take(count).collect()
                        } else {
                            z.range_by_score(min, max, offset as usize, count)
                        });
                        true
                    }
                    Some(_) => {
                        out.error(WRONG_TYPE);
                        false
                    }
                });
            if !ok {
                return;
            }
            found.unwrap_or_default()
        }
    };
    // RESP3 pairs each member with its score; RESP2 interleaves them.
    let nested = with_scores && c.out.is_resp3();
    let flat_len = found.len() * if with_scores && !nested { 2 } else { 1 };
    c.out.array_header(flat_len);
    for (m, s) in found {
        if nested {
            c.out.array_header(2);
        }
        c.out.bulk(&m);
        if with_scores {
            c.out.double(s);
        }
    }
}

pub(super) fn zrange(c: &mut Call<'_>) {
    zrange_generic(c, RangeKind::Auto, None);
}

pub(super) fn zrevrange(c: &mut Call<'_>) {
    zrange_generic(c, RangeKind::Rank, Some(true));
}

pub(super) fn zrangebyscore(c: &mut Call<'_>) {
    zrange_generic(c, RangeKind::Score, Some(false));
}
