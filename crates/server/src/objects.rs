//! Objects: key → versioned value, the key-value face of the server. They share the one
//! memory cap with regions: every byte an object holds is charged to the same
//! [`MemoryBudget`] before it is stored, so a full server refuses a PUT and keeps what it
//! has.
//!
//! Keys live in [`SHARDS`] ordered maps, picked by [`key_hash`], so writers to different
//! keys rarely meet on a lock while SCAN still sees every key in order (it merges the
//! shards lazily, touching only as many keys as it returns).
//!
//! Values are byte strings for the native protocol; the Redis port also keeps hashes,
//! lists, sets and sorted sets here, in the same key space and under the same cap. The native face sees
//! those as WRONG_TYPE and SCAN skips them.

use crate::budget::MemoryBudget;
use bytes::Bytes;
use camelot_proto::limits::{
    KEY_BYTES_MAX, SCAN_EXAMINE_MAX, SCAN_ITEMS_MAX, SCAN_PAGE_BYTES_TARGET, VALUE_BYTES_MAX,
};
use camelot_proto::{
    key_hash, mask_marks, partition_of, ErrorCode, ErrorReply, Item, Page, ITEM_OVERHEAD_BYTES,
};
use parking_lot::{RwLock, RwLockReadGuard};
use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Independent shards, each with its own lock. A power of two, few enough that a scan's
/// merge stays cheap.
pub const SHARDS: usize = 16;
/// What an object costs beyond its key and value bytes (its hash-map slot and entry
/// header, and its key's further handles and node shares in the shard's key order and,
/// on a cluster node, partition order), so a flood of tiny objects still runs into the
/// cap. One figure for both kinds of server, so a key costs the same wherever it moves.
pub const ENTRY_OVERHEAD_BYTES: u64 = 176;
/// What one hash field or sorted-set member costs beyond its own bytes.
pub const FIELD_OVERHEAD_BYTES: u64 = 48;
/// Most fields in one hash or members in one sorted set.
pub const COLLECTION_ITEMS_MAX: usize = 1 << 24;

fn err(code: ErrorCode, message: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, message)
}

pub fn no_such_key() -> ErrorReply {
    err(ErrorCode::NoSuchKey, "no such key")
}

pub fn wrong_type() -> ErrorReply {
    err(
        ErrorCode::WrongType,
        "WRONGTYPE Operation against a key holding the wrong kind of value",
    )
}

pub fn check_key(key: &[u8]) -> Result<(), ErrorReply> {
    if key.len() > KEY_BYTES_MAX {
        return Err(err(
            ErrorCode::TooLarge,
            format!(
                "key of {} bytes exceeds the limit of {KEY_BYTES_MAX}",
                key.len()
            ),
        ));
    }
    Ok(())
}

pub fn check_value_len(len: usize) -> Result<(), ErrorReply> {
    if len > VALUE_BYTES_MAX {
        return Err(err(
            ErrorCode::TooLarge,
            format!("value of {len} bytes exceeds the limit of {VALUE_BYTES_MAX}"),
        ));
    }
    Ok(())
}

/// A sorted-set score with the total order Redis uses (NaN is refused before it gets here).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score(pub f64);

impl Eq for Score {}
impl PartialOrd for Score {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Score {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug, Default)]
pub struct Hash {
    fields: HashMap<Bytes, Bytes>,
    content_bytes: u64,
}

fn field_cost(field: &[u8], value: &[u8]) -> u64 {
    (field.len() + value.len()) as u64 + FIELD_OVERHEAD_BYTES
}

impl Hash {
    pub fn len(&self) -> usize {
        self.fields.len()
    }
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }
    pub fn get(&self, field: &[u8]) -> Option<&Bytes> {
        self.fields.get(field)
    }
    pub fn iter(&self) -> impl Iterator<Item = (&Bytes, &Bytes)> {
        self.fields.iter()
    }
    /// Returns whether the field is new.
    pub fn set(&mut self, field: Bytes, value: Bytes) -> Result<bool, ErrorReply> {
        if !self.fields.contains_key(&field) && self.fields.len() >= COLLECTION_ITEMS_MAX {
            return Err(collection_full());
        }
        self.content_bytes += field_cost(&field, &value);
        let old = self.fields.insert(field.clone(), value);
        if let Some(old) = &old {
            self.content_bytes -= field_cost(&field, old);
        }
        Ok(old.is_none())
    }
    pub fn remove(&mut self, field: &[u8]) -> bool {
        match self.fields.remove_entry(field) {
            Some((f, v)) => {
                self.content_bytes -= field_cost(&f, &v);
                true
            }
            None => false,
        }
    }
}

#[derive(Debug, Default)]
pub struct ZSet {
    scores: HashMap<Bytes, Score>,
    ordered: BTreeSet<(Score, Bytes)>,
    content_bytes: u64,
}

fn member_cost(member: &[u8]) -> u64 {
    // The member is kept twice: in the score index and in the order.
    2 * member.len() as u64 + 8 + FIELD_OVERHEAD_BYTES
}

impl ZSet {
    pub fn len(&self) -> usize {
        self.scores.len()
    }
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }
    pub fn score(&self, member: &[u8]) -> Option<f64> {
        self.scores.get(member).map(|s| s.0)
    }
    /// Returns whether the member is new.
    pub fn insert(&mut self, member: Bytes, score: f64) -> Result<bool, ErrorReply> {
        let score = Score(score);
        match self.scores.get_mut(&member) {
            Some(old) => {
                if *old != score {
                    self.ordered.remove(&(*old, member.clone()));
                    self.ordered.insert((score, member));
                    *old = score;
                }
                Ok(false)
            }
            None => {
                if self.scores.len() >= COLLECTION_ITEMS_MAX {
                    return Err(collection_full());
                }
                self.content_bytes += member_cost(&member);
                self.scores.insert(member.clone(), score);
                self.ordered.insert((score, member));
                Ok(true)
            }
        }
    }
    pub fn remove(&mut self, member: &[u8]) -> bool {
        match self.scores.remove_entry(member) {
            Some((m, s)) => {
                self.content_bytes -= member_cost(&m);
                self.ordered.remove(&(s, m));
                true
            }
            None => false,
        }
    }
    /// Members with `min <= score <= max` (each end exclusive when flagged), in score
    /// order, skipping `offset` and returning at most `count`.
    pub fn range_by_score(
        &self,
        min: (f64, bool),
        max: (f64, bool),
        offset: usize,
        count: usize,
    ) -> Vec<(Bytes, f64)> {
        let (min_score, min_exclusive) = min;
        let (max_score, max_exclusive) = max;
        let from = Bound::Included((Score(min_score), Bytes::new()));
        self.ordered
            .range((from, Bound::Unbounded))
            .skip_while(|(s, _)| min_exclusive && s.0 == min_score)
            .take_while(|(s, _)| {
                if max_exclusive {
                    s.0 < max_score
                } else {
                    s.0 <= max_score
                }
            })
            .skip(offset)
            .take(count)
            .map(|(s, m)| (m.clone(), s.0))
            .collect()
    }
}

impl ZSet {
    /// Members at ranks `start..=end` (0-based, already clamped to the set) in score
    /// order, or from the highest score down when `reverse`.
    pub fn range_by_rank(&self, start: usize, end: usize, reverse: bool) -> Vec<(Bytes, f64)> {
        let take = end.saturating_sub(start).saturating_add(1);
        let pick = |(s, m): &(Score, Bytes)| (m.clone(), s.0);
        if reverse {
            self.ordered
                .iter()
                .rev()
                .skip(start)
                .take(take)
                .map(pick)
                .collect()
        } else {
            self.ordered
                .iter()
                .skip(start)
                .take(take)
                .map(pick)
                .collect()
        }
    }

    /// The member's 0-based position in score order (O(rank): the order is a B-tree
    /// without counts).
    pub fn rank(&self, member: &[u8]) -> Option<usize> {
        let score = *self.scores.get(member)?;
        let key = (score, Bytes::copy_from_slice(member));
        Some(self.ordered.range(..key).count())
    }
}

/// A Redis list: values pushed and popped at either end.
#[derive(Debug, Default)]
pub struct List {
    items: VecDeque<Bytes>,
    content_bytes: u64,
}

fn item_cost(item: &[u8]) -> u64 {
    item.len() as u64 + FIELD_OVERHEAD_BYTES
}

impl List {
    pub fn len(&self) -> usize {
        self.items.len()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    pub fn push(&mut self, item: Bytes, front: bool) -> Result<(), ErrorReply> {
        if self.items.len() >= COLLECTION_ITEMS_MAX {
            return Err(collection_full());
        }
        self.content_bytes += item_cost(&item);
        if front {
            self.items.push_front(item);
        } else {
            self.items.push_back(item);
        }
        Ok(())
    }
    pub fn pop(&mut self, front: bool) -> Option<Bytes> {
        let item = if front {
            self.items.pop_front()
        } else {
            self.items.pop_back()
        }?;
        self.content_bytes -= item_cost(&item);
        Some(item)
    }
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Bytes> {
        self.items.iter()
    }
}

/// A Redis set of byte strings.
#[derive(Debug, Default)]
pub struct Set {
    members: HashSet<Bytes>,
    content_bytes: u64,
}

impl Set {
    pub fn len(&self) -> usize {
        self.members.len()
    }
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
    pub fn contains(&self, member: &[u8]) -> bool {
        self.members.contains(member)
    }
    pub fn iter(&self) -> impl Iterator<Item = &Bytes> {
        self.members.iter()
    }
    /// Returns whether the member is new.
    pub fn insert(&mut self, member: Bytes) -> Result<bool, ErrorReply> {
        if self.members.contains(&member) {
            return Ok(false);
        }
        if self.members.len() >= COLLECTION_ITEMS_MAX {
            return Err(collection_full());
        }
        self.content_bytes += item_cost(&member);
        self.members.insert(member);
        Ok(true)
    }
    pub fn remove(&mut self, member: &[u8]) -> bool {
        match self.members.take(member) {
            Some(m) => {
                self.content_bytes -= item_cost(&m);
                true
            }
            None => false,
        }
    }
}

fn collection_full() -> ErrorReply {
    err(
        ErrorCode::TooLarge,
        format!("a hash, list, set or sorted set may hold at most {COLLECTION_ITEMS_MAX} items"),
    )
}

/// A collection type a key can hold (hash, list, set, sorted set): how to find it inside a
/// `Value`, and how to wrap a new one.
pub trait Collection: Default {
    fn of(value: &mut Value) -> Option<&mut Self>;
    fn into_value(self) -> Value;
}

macro_rules! collection {
    ($t:ident, $variant:ident) => {
        impl Collection for $t {
            fn of(value: &mut Value) -> Option<&mut Self> {
                match value {
                    Value::$variant(c) => Some(c),
                    _ => None,
                }
            }
            fn into_value(self) -> Value {
                Value::$variant(self)
            }
        }
    };
}
collection!(Hash, Hash);
collection!(ZSet, ZSet);
collection!(List, List);
collection!(Set, Set);

/// The write half of HSET, SADD, LPUSH, ZADD…: `apply` runs on the collection the entry
/// holds, or on a new empty one that is inserted when the key is missing. A key holding
/// another type is WRONGTYPE and left untouched. `changed` says whether `apply`'s outcome
/// altered an existing collection, which is what moves its version (WATCH and CAS see it).
pub fn upsert_collection<C: Collection, R>(
    entry: Option<&mut Entry>,
    clock: &VersionClock,
    apply: impl FnOnce(&mut C) -> Result<R, ErrorReply>,
    changed: impl FnOnce(&R) -> bool,
) -> Result<(R, Change), ErrorReply> {
    match entry {
        None => {
            let mut c = C::default();
            let outcome = apply(&mut c)?;
            let value = c.into_value();
            Ok((
                outcome,
                Change::Insert {
                    value,
                    expires_at: None,
                },
            ))
        }
        Some(e) => {
            let c = C::of(&mut e.value).ok_or_else(wrong_type)?;
            let outcome = apply(c)?;
            if changed(&outcome) {
                e.version = clock.next();
            }
            Ok((outcome, Change::Keep))
        }
    }
}

#[derive(Debug)]
pub enum Value {
    Str(Bytes),
    Hash(Hash),
    ZSet(ZSet),
    List(List),
    Set(Set),
}

impl Value {
    fn content_bytes(&self) -> u64 {
        match self {
            Value::Str(b) => b.len() as u64,
            Value::Hash(h) => h.content_bytes,
            Value::ZSet(z) => z.content_bytes,
            Value::List(l) => l.content_bytes,
            Value::Set(s) => s.content_bytes,
        }
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Str(_) => "string",
            Value::Hash(_) => "hash",
            Value::ZSet(_) => "zset",
            Value::List(_) => "list",
            Value::Set(_) => "set",
        }
    }

    /// True when a collection has lost its last item: Redis deletes such keys.
    fn is_empty_collection(&self) -> bool {
        match self {
            Value::Str(_) => false,
            Value::Hash(h) => h.is_empty(),
            Value::ZSet(z) => z.is_empty(),
            Value::List(l) => l.is_empty(),
            Value::Set(s) => s.is_empty(),
        }
    }
}

#[derive(Debug)]
pub struct Entry {
    pub version: u64,
    pub value: Value,
    pub expires_at: Option<Instant>,
    charge_bytes: u64,
}

impl Entry {
    fn is_live(&self, now: Instant) -> bool {
        match self.expires_at {
            None => true,
            Some(t) => t > now,
        }
    }
}

fn entry_cost(key: &[u8], value: &Value) -> u64 {
    ENTRY_OVERHEAD_BYTES + key.len() as u64 + value.content_bytes()
}

/// Hands out object versions: increasing across the whole server, so a deleted and
/// re-created key never gets a version an old CAS could match.
#[derive(Debug)]
pub struct VersionClock(AtomicU64);

impl VersionClock {
    pub fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }

    /// Moves the clock `gap` versions ahead (see [`ObjectStore::skip_versions`]).
    fn skip(&self, gap: u64) {
        self.0.fetch_add(gap, Ordering::Relaxed);
    }

    /// What the next [`VersionClock::next`] will answer at least.
    fn peek(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Makes every later [`VersionClock::next`] answer more than `version`.
    fn advance_past(&self, version: u64) {
        self.0
            .fetch_max(version.saturating_add(1), Ordering::Relaxed);
    }
}

/// Highest version an APPLY may carry. Versions come from a clock that counts writes and
/// jumps [`PROMOTION_VERSION_GAP`] at each promotion, so a real one is far below this
/// (2^30 promotions of one server); the bound keeps a hostile or corrupt APPLY from
/// pushing the clock to where later writes could run out of versions (2^62 remain).
pub const APPLY_VERSION_MAX: u64 = 1 << 62;
/// How far a server's version clock jumps when it becomes primary of a partition it was
/// not primary of (a promotion, a move's switch). Its clock is already past every copy it
/// applied; the jump puts its versions above every version its predecessor could have
/// given after the last copy this server received — copies that may sit on another
/// backup, or come late from a deposed primary still running — unless the predecessor
/// made 2^32 writes after that copy, which its one-second replication timeout rules out
/// by orders of magnitude. So the new primary's writes supersede anything on its
/// backups, and APPLY's "only if newer" never keeps a stale copy over an acknowledged
/// write.
pub const PROMOTION_VERSION_GAP: u64 = 1 << 32;

/// What a [`ObjectStore::modify`] closure decided about the slot.
pub enum Change {
    /// Leave the slot as the closure left it (an existing entry may have been edited).
    Keep,
    /// Create the object (only meaningful when the slot was empty).
    Insert {
        value: Value,
        expires_at: Option<Instant>,
    },
    /// Remove the object.
    Remove,
    /// Create the object at a version chosen by the caller (a copy from a peer), not the
    /// clock's next; the caller has moved the clock past it.
    InsertAt { value: Value, version: u64 },
}

/// One shard's objects: a hash map for point lookups, which every GET, PUT and HGETALL
/// is, and the keys again in order for SCAN and KEYS. An ordered map alone made each
/// lookup a dozen key comparisons (a third of the Redis port's own CPU under YCSB); the
/// second index shares the key's allocation (`Bytes` is reference-counted), and its cost
/// is in [`ENTRY_OVERHEAD_BYTES`].
///
/// On a cluster node a third index, `by_partition`, holds the keys in
/// [`partition_rank`] order, so a mover's SCAN_PARTITIONS walks only the partitions it
/// asks for instead of every key the server holds (a move's write fence lasts as long as
/// those walks). `None` elsewhere: it costs every new key a third insert (measured: a fifth
/// more server CPU loading YCSB records), which a lone server has no use for.
#[derive(Default)]
struct Shard {
    map: HashMap<Bytes, Entry>,
    order: BTreeSet<Bytes>,
    by_partition: Option<BTreeSet<(u32, Bytes)>>,
}

/// A key's place in the shards' partition order: the partition bits of its hash (the
/// ones [`partition_of`] reduces) reversed. For a power-of-two partition count `2^k` a
/// partition is the keys whose hash has its `k` low partition bits, which reversed are
/// the `k` high bits of the rank: every partition, at every such count, is one
/// contiguous range of ranks (see [`partition_ranks`]).
fn partition_rank(key: &[u8]) -> u32 {
    ((key_hash(key) >> 32) as u32).reverse_bits()
}

/// The ranks of partition `p` of `partitions` (a power of two): `[start, end)`, `end`
/// being `None` past the last rank.
fn partition_ranks(p: u32, partitions: u32) -> (u32, Option<u32>) {
    let width = 1u64 << (32 - partitions.trailing_zeros());
    let start = p.reverse_bits();
    (start, u32::try_from(u64::from(start) + width).ok())
}

impl Shard {
    fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.map.get(key)
    }

    fn get_mut(&mut self, key: &[u8]) -> Option<&mut Entry> {
        self.map.get_mut(key)
    }

    fn insert(&mut self, key: Bytes, entry: Entry) {
        if self.map.insert(key.clone(), entry).is_none() {
            self.order.insert(key.clone());
            if let Some(by_partition) = &mut self.by_partition {
                by_partition.insert((partition_rank(&key), key));
            }
        }
    }

    fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let (key, entry) = self.map.remove_entry(key)?;
        self.order.remove(&key);
        if let Some(by_partition) = &mut self.by_partition {
            by_partition.remove(&(partition_rank(&key), key));
        }
        Some(entry)
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn clear(&mut self) -> u64 {
        let freed = self.map.values().map(|e| e.charge_bytes).sum();
        self.map.clear();
        self.order.clear();
        if let Some(by_partition) = &mut self.by_partition {
            by_partition.clear();
        }
        freed
    }

    /// Keeps the entries `keep` approves of; returns (removed, bytes freed).
    fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) -> (usize, u64) {
        let (mut removed, mut freed) = (0, 0);
        let map = &mut self.map;
        let by_partition = &mut self.by_partition;
        self.order.retain(|k| {
            let stays = map.get(k).is_some_and(&mut keep);
            if !stays {
                if let Some(e) = map.remove(k) {
                    freed += e.charge_bytes;
                }
                if let Some(by_partition) = by_partition.as_mut() {
                    by_partition.remove(&(partition_rank(k), k.clone()));
                }
                removed += 1;
            }
            stays
        });
        (removed, freed)
    }

    /// Entries with keys after `after` (all of them for `None`), in key order.
    fn range_after<'a>(
        &'a self,
        after: Option<&[u8]>,
    ) -> impl Iterator<Item = (&'a Bytes, &'a Entry)> + 'a {
        let low = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.order
            .range::<[u8], _>((low, Bound::Unbounded))
            .filter_map(|k| Some((k, self.map.get(k)?)))
    }

    /// Entries with keys `>= start`, in key order.
    fn range_from<'a>(&'a self, start: &[u8]) -> impl Iterator<Item = (&'a Bytes, &'a Entry)> + 'a {
        self.order
            .range::<[u8], _>((Bound::Included(start), Bound::Unbounded))
            .filter_map(|k| Some((k, self.map.get(k)?)))
    }

    /// Entries whose rank lies in `ranges` (sorted, disjoint) and that come after `after`
    /// (a rank and key), in partition order. Nothing without the partition index.
    fn partition_range_after<'a>(
        &'a self,
        after: Option<&'a (u32, Bytes)>,
        ranges: &'a [RankRange],
    ) -> impl Iterator<Item = ((u32, &'a Bytes), &'a Entry)> + 'a {
        let index = self.by_partition.as_ref();
        // Ranges wholly before `after` give nothing: skipped without a lookup.
        let first = after.map_or(0, |(rank, _)| {
            ranges.partition_point(|(_, end)| end.is_some_and(|e| e <= *rank))
        });
        ranges[first..]
            .iter()
            .flat_map(move |&(start, end)| {
                let start = (start, Bytes::new());
                let low = match after {
                    Some(a) if *a >= start => Bound::Excluded(a.clone()),
                    _ => Bound::Included(start),
                };
                // `after` lies before `end` (the ranges before it were skipped), so the
                // bounds are in order.
                let high = end.map_or(Bound::Unbounded, |e| Bound::Excluded((e, Bytes::new())));
                index
                    .into_iter()
                    .flat_map(move |i| i.range((low.clone(), high.clone())))
            })
            .filter_map(|(rank, k)| Some(((*rank, k), self.map.get(k)?)))
    }
}

/// Ranks `[start, end)` (`end` `None`: to the last rank).
type RankRange = (u32, Option<u32>);

/// The rank ranges holding the partitions `filter` marks, sorted and with neighbours
/// joined: one range each for a power-of-two partition count, else every rank (the walk
/// then reads every key and the mask decides).
fn marked_rank_ranges(filter: &ScanFilter<'_>) -> Vec<RankRange> {
    if !filter.partitions.is_power_of_two() {
        return vec![(0, None)];
    }
    let mut ranges: Vec<RankRange> = (0..filter.partitions)
        .filter(|&p| mask_marks(filter.mask, p))
        .map(|p| partition_ranks(p, filter.partitions))
        .collect();
    ranges.sort_unstable();
    let mut joined: Vec<RankRange> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match joined.last_mut() {
            Some(last) if last.1 == Some(start) => last.1 = end,
            _ => joined.push((start, end)),
        }
    }
    joined
}

/// Shards' entries, each shard's already in order by `K` (a key, or a partition rank and
/// key), merged into one order. A key lives in exactly one shard, so (`K`, shard) orders
/// the heads totally.
struct KeyOrder<K: Ord + Copy, T, I: Iterator<Item = (K, T)>> {
    iters: Vec<I>,
    heads: BinaryHeap<Reverse<(K, usize)>>,
    current: Vec<Option<T>>,
}

impl<K: Ord + Copy, T, I: Iterator<Item = (K, T)>> KeyOrder<K, T, I> {
    fn merge(shards: impl IntoIterator<Item = I>) -> Self {
        let mut merged = KeyOrder {
            iters: shards.into_iter().collect(),
            heads: BinaryHeap::with_capacity(SHARDS),
            current: Vec::with_capacity(SHARDS),
        };
        for i in 0..merged.iters.len() {
            let head = merged.iters[i].next();
            let current = merged.advance(i, head);
            merged.current.push(current);
        }
        merged
    }

    /// Keeps `head` as shard `i`'s current entry (its key goes on the heap).
    fn advance(&mut self, i: usize, head: Option<(K, T)>) -> Option<T> {
        head.map(|(k, t)| {
            self.heads.push(Reverse((k, i)));
            t
        })
    }
}

impl<K: Ord + Copy, T, I: Iterator<Item = (K, T)>> Iterator for KeyOrder<K, T, I> {
    type Item = (K, T);

    fn next(&mut self) -> Option<Self::Item> {
        let Reverse((k, i)) = self.heads.pop()?;
        let head = self.iters[i].next();
        let next = self.advance(i, head);
        let t = std::mem::replace(&mut self.current[i], next)?;
        Some((k, t))
    }
}

/// Holds off EXEC's exclusive hold of the store while one operation runs (see
/// [`ObjectStore::exclusive`]). Only the outermost operation on a thread takes the gate:
/// a nested read of a fair lock could wait behind a queued EXEC that waits for it.
pub struct GateHold<'a> {
    _read: Option<RwLockReadGuard<'a, ()>>,
}

thread_local! {
    /// Store operations running on this thread (nesting depth), or 1 while this thread
    /// runs a transaction under [`ObjectStore::exclusive`].
    static GATE_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

impl Drop for GateHold<'_> {
    fn drop(&mut self) {
        GATE_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// What a SCAN_PARTITIONS page lets through (see `Op::ScanPartitions`).
#[derive(Debug, Clone, Copy)]
pub struct ScanFilter<'a> {
    pub partitions: u32,
    pub mask: &'a [u8],
    pub since_version: u64,
    pub keys_only: bool,
}

pub struct ObjectStore {
    shards: Box<[RwLock<Shard>]>,
    /// Shared by every operation, exclusive for a transaction (EXEC), so a transaction
    /// runs as one step with respect to every other command on every port.
    exec_gate: RwLock<()>,
    budget: Arc<MemoryBudget>,
    clock: VersionClock,
    /// Everything this store has charged to the budget, so dropping it gives all back.
    charged_bytes: AtomicU64,
    /// Objects with an expiry; the sweeper does nothing while this is zero.
    expiring: AtomicU64,
    /// Every shard keeps `by_partition` (set once, before the store is shared).
    partition_indexed: bool,
}

impl ObjectStore {
    pub fn new(budget: Arc<MemoryBudget>) -> Self {
        ObjectStore {
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            exec_gate: RwLock::new(()),
            budget,
            clock: VersionClock(AtomicU64::new(1)),
            charged_bytes: AtomicU64::new(0),
            expiring: AtomicU64::new(0),
            partition_indexed: false,
        }
    }

    /// The shared side of the gate, for one operation (none when nested, or inside
    /// [`ObjectStore::exclusive`] on this thread).
    ///
    /// A caller running several operations that must not be split by a transaction (a
    /// multi-key command) holds one for all of them.
    pub fn gate(&self) -> GateHold<'_> {
        let outermost = GATE_DEPTH.with(|d| {
            let depth = d.get();
            d.set(depth + 1);
            depth == 0
        });
        GateHold {
            _read: outermost.then(|| self.exec_gate.read()),
        }
    }

    /// Runs `f` with the store to itself: no operation of another thread runs meanwhile,
    /// and the store operations `f` makes on this thread go straight through. For EXEC.
    /// `f` must not wait for another thread's store operation.
    pub fn exclusive<R>(&self, f: impl FnOnce() -> R) -> R {
        let _write = self.exec_gate.write();
        let outer = GATE_DEPTH.with(|d| d.replace(1));
        struct Restore(u32);
        impl Drop for Restore {
            fn drop(&mut self) {
                GATE_DEPTH.with(|d| d.set(self.0));
            }
        }
        let _restore = Restore(outer);
        f()
    }

    /// Keeps the partition-order index from now on (built from the keys already here),
    /// for a server that follows a cluster map. Before the store is shared, so no walk
    /// ever sees the order change under it.
    pub fn index_partitions(&mut self) {
        for shard in self.shards.iter_mut() {
            let shard = shard.get_mut();
            if shard.by_partition.is_none() {
                shard.by_partition = Some(
                    shard
                        .order
                        .iter()
                        .map(|k| (partition_rank(k), k.clone()))
                        .collect(),
                );
            }
        }
        self.partition_indexed = true;
    }

    /// Whether the store keeps the partition-order index (see `index_partitions`).
    pub fn partition_indexed(&self) -> bool {
        self.partition_indexed
    }

    fn shard(&self, key: &[u8]) -> &RwLock<Shard> {
        &self.shards[(key_hash(key) as usize) & (SHARDS - 1)]
    }

    /// Objects stored (including expired ones the sweeper has not reached yet).
    pub fn len(&self) -> usize {
        let _gate = self.gate();
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A version above every one this store has given or taken so far: what a replica's
    /// copy of "this key is gone" carries, since a delete takes no version of its own.
    pub fn next_version(&self) -> u64 {
        self.clock.next()
    }

    /// Moves the version clock `gap` ahead: every later version is at least `gap` above
    /// every version given so far (see [`PROMOTION_VERSION_GAP`]).
    pub fn skip_versions(&self, gap: u64) {
        self.clock.skip(gap);
    }

    /// Runs `f` on the live entry under `key` (or `None`) under the shard's read lock.
    pub fn read<R>(&self, key: &[u8], now: Instant, f: impl FnOnce(Option<&Entry>) -> R) -> R {
        let _gate = self.gate();
        let shard = self.shard(key).read();
        f(shard.get(key).filter(|e| e.is_live(now)))
    }

    /// The string under `key` and its version.
    pub fn get(&self, key: &[u8], now: Instant) -> Result<(u64, Bytes), ErrorReply> {
        self.read(key, now, |e| match e {
            None => Err(no_such_key()),
            Some(Entry {
                version,
                value: Value::Str(b),
                ..
            }) => Ok((*version, b.clone())),
            Some(_) => Err(wrong_type()),
        })
    }

    pub fn put(&self, key: &[u8], value: &[u8], now: Instant) -> Result<u64, ErrorReply> {
        self.put_if(key, value, now, |_| Ok(()))
    }

    /// Stores `value` only if the object's version is `expected_version`, or, when that
    /// is 0, only if there is no object.
    pub fn cas_put(
        &self,
        key: &[u8],
        expected_version: u64,
        value: &[u8],
        now: Instant,
    ) -> Result<u64, ErrorReply> {
        self.put_if(key, value, now, |current| {
            let current_version = current.map_or(0, |e| e.version);
            if current_version != expected_version {
                return Err(err(
                    ErrorCode::VersionConflict,
                    format!(
                        "expected version {expected_version}, the object is at {current_version}"
                    ),
                ));
            }
            Ok(())
        })
    }

    fn put_if(
        &self,
        key: &[u8],
        value: &[u8],
        now: Instant,
        check: impl FnOnce(Option<&Entry>) -> Result<(), ErrorReply>,
    ) -> Result<u64, ErrorReply> {
        check_value_len(value.len())?;
        // Copied out of the request frame: a slice would pin the whole frame buffer, and
        // the budget would not see that memory.
        let value = Bytes::copy_from_slice(value);
        let cost = ENTRY_OVERHEAD_BYTES + (key.len() + value.len()) as u64;
        let growth = |e: Option<&Entry>| cost.saturating_sub(e.map_or(0, |e| e.charge_bytes));
        self.modify(key, growth, now, |slot, clock| {
            check(slot.as_deref())?;
            match slot {
                Some(e) => {
                    e.value = Value::Str(value);
                    e.expires_at = None;
                    e.version = clock.next();
                    Ok((e.version, Change::Keep))
                }
                None => Ok((
                    // The new entry takes the next version; `modify` reports it.
                    0,
                    Change::Insert {
                        value: Value::Str(value),
                        expires_at: None,
                    },
                )),
            }
        })
        .map(|(v, inserted)| inserted.unwrap_or(v))
    }

    /// A peer's copy of `key` at `version` (see `Op::Apply`): stored (or, for `None`,
    /// deleted) only if `version` is above the key's current one. Returns the key's version
    /// after the call. The clock moves past `version` either way, so this server's own
    /// later writes always supersede every copy it has taken.
    pub fn apply(
        &self,
        key: &[u8],
        version: u64,
        value: Option<&[u8]>,
        now: Instant,
    ) -> Result<u64, ErrorReply> {
        if version == 0 || version > APPLY_VERSION_MAX {
            return Err(err(
                ErrorCode::BadRequest,
                format!("an applied version is 1..={APPLY_VERSION_MAX}, not {version}"),
            ));
        }
        if let Some(v) = value {
            check_value_len(v.len())?;
        }
        let value = value.map(Bytes::copy_from_slice);
        let cost = value
            .as_ref()
            .map_or(0, |v| ENTRY_OVERHEAD_BYTES + (key.len() + v.len()) as u64);
        let growth = |e: Option<&Entry>| cost.saturating_sub(e.map_or(0, |e| e.charge_bytes));
        self.clock.advance_past(version);
        self.modify(key, growth, now, |slot, _| match (slot, value) {
            (Some(e), _) if e.version >= version => Ok((e.version, Change::Keep)),
            (Some(e), Some(value)) => {
                e.value = Value::Str(value);
                e.expires_at = None;
                e.version = version;
                Ok((version, Change::Keep))
            }
            (Some(_), None) => Ok((version, Change::Remove)),
            (None, Some(value)) => Ok((
                version,
                Change::InsertAt {
                    value: Value::Str(value),
                    version,
                },
            )),
            (None, None) => Ok((version, Change::Keep)),
        })
        .map(|(v, _)| v)
    }

    /// Removes the object; returns the version it had.
    pub fn delete(&self, key: &[u8], now: Instant) -> Result<u64, ErrorReply> {
        self.modify(
            key,
            |_| 0,
            now,
            |slot, _| match slot {
                Some(e) => Ok((e.version, Change::Remove)),
                None => Err(no_such_key()),
            },
        )
        .map(|(v, _)| v)
    }

    /// The one way objects change. Under the shard's write lock, `f` sees the live entry
    /// (an expired one is removed first) and may edit it in place or decide a
    /// [`Change`]. `growth_bytes_max`, given the entry, must bound how much the object can
    /// grow; that much is charged to the budget before `f` runs, so a full server refuses
    /// with OUT_OF_MEMORY and changes nothing. Returns `f`'s result and, when an object was
    /// created, its version.
    pub fn modify<R>(
        &self,
        key: &[u8],
        growth_bytes_max: impl FnOnce(Option<&Entry>) -> u64,
        now: Instant,
        f: impl FnOnce(Option<&mut Entry>, &VersionClock) -> Result<(R, Change), ErrorReply>,
    ) -> Result<(R, Option<u64>), ErrorReply> {
        check_key(key)?;
        let _gate = self.gate();
        let mut shard = self.shard(key).write();
        let expired = shard.get(key).is_some_and(|e| !e.is_live(now));
        let mut freed_bytes = 0;
        if expired {
            if let Some(e) = shard.remove(key) {
                freed_bytes += e.charge_bytes;
                self.expiring_sub(1);
            }
        }
        let charged_bytes = growth_bytes_max(shard.get(key));
        if let Err(e) = self.budget.try_charge(charged_bytes) {
            drop(shard);
            self.settle(0, 0, freed_bytes);
            return Err(err(
                ErrorCode::OutOfMemory,
                format!("object does not fit: {e}"),
            ));
        }
        let mut grown_bytes = 0;
        let result = match shard.get_mut(key) {
            Some(e) => {
                let had_expiry = e.expires_at.is_some();
                let outcome = f(Some(e), &self.clock);
                // Settled whether `f` succeeded or not: an error can come after part of
                // a change was made (HSET's second field over the item limit, its first
                // already grown), and those bytes must be counted as any others.
                let remove =
                    matches!(outcome, Ok((_, Change::Remove))) || e.value.is_empty_collection();
                if remove {
                    freed_bytes += e.charge_bytes;
                    if had_expiry {
                        self.expiring_sub(1);
                    }
                    shard.remove(key);
                } else {
                    let cost = entry_cost(key, &e.value);
                    // A half-made change is a change: it takes a new version, or a WATCH
                    // would not see it. (One that left the size as it was goes unseen: the
                    // changes that can fail half made are additions, which grow it.)
                    if outcome.is_err() && cost != e.charge_bytes {
                        e.version = self.clock.next();
                    }
                    if cost >= e.charge_bytes {
                        grown_bytes = cost - e.charge_bytes;
                    } else {
                        freed_bytes += e.charge_bytes - cost;
                    }
                    e.charge_bytes = cost;
                    match (had_expiry, e.expires_at.is_some()) {
                        (false, true) => {
                            self.expiring.fetch_add(1, Ordering::Relaxed);
                        }
                        (true, false) => {
                            self.expiring_sub(1);
                        }
                        _ => {}
                    }
                }
                outcome.map(|(r, _)| (r, None))
            }
            None => match f(None, &self.clock) {
                Err(x) => Err(x),
                Ok((r, change)) => {
                    // A collection created empty is no object (Redis deletes such keys).
                    let created = match change {
                        Change::Insert { value, expires_at } if !value.is_empty_collection() => {
                            Some((value, expires_at, self.clock.next()))
                        }
                        Change::InsertAt { value, version } => Some((value, None, version)),
                        _ => None,
                    };
                    match created {
                        None => Ok((r, None)),
                        Some((value, expires_at, version)) => {
                            let cost = entry_cost(key, &value);
                            grown_bytes = cost;
                            if expires_at.is_some() {
                                self.expiring.fetch_add(1, Ordering::Relaxed);
                            }
                            shard.insert(
                                Bytes::copy_from_slice(key),
                                Entry {
                                    version,
                                    value,
                                    expires_at,
                                    charge_bytes: cost,
                                },
                            );
                            Ok((r, Some(version)))
                        }
                    }
                }
            },
        };
        drop(shard);
        self.settle(charged_bytes, grown_bytes, freed_bytes);
        result
    }

    /// Turns the up-front charge into the real one.
    fn settle(&self, charged_bytes: u64, grown_bytes: u64, freed_bytes: u64) {
        debug_assert!(
            grown_bytes <= charged_bytes,
            "an object grew by {grown_bytes} bytes but only {charged_bytes} were charged"
        );
        if grown_bytes > charged_bytes {
            // A caller under-estimated its growth: keep the tally true even if it means
            // going past the cap for a moment, rather than losing track of the bytes.
            self.budget.force_charge(grown_bytes - charged_bytes);
            self.budget.uncharge(freed_bytes);
        } else {
            self.budget
                .uncharge(charged_bytes - grown_bytes + freed_bytes);
        }
        self.charged_bytes.fetch_add(grown_bytes, Ordering::Relaxed);
        self.charged_bytes.fetch_sub(freed_bytes, Ordering::Relaxed);
    }

    /// Up to `limit` string objects with keys `>= start`, in key order, whose encoded
    /// size stays within `reply_bytes_max`. TOO_LARGE if not even the first one fits, so
    /// an empty answer always means there are no more keys.
    pub fn scan(
        &self,
        start: &[u8],
        limit: usize,
        reply_bytes_max: usize,
        now: Instant,
    ) -> Result<Vec<Item>, ErrorReply> {
        let _gate = self.gate();
        let limit = limit.min(SCAN_ITEMS_MAX);
        // Read locks on every shard at once, always in shard order, so the view is one
        // moment and writers (which take one shard each) cannot deadlock with us.
        let guards: Vec<RwLockReadGuard<'_, Shard>> =
            self.shards.iter().map(|s| s.read()).collect();
        let merged = KeyOrder::merge(guards.iter().map(|g| {
            g.range_from(start).filter_map(|(k, e)| match &e.value {
                Value::Str(v) if e.is_live(now) => Some((k, (e.version, v))),
                _ => None,
            })
        }));
        let mut page = ReplyItems::new(reply_bytes_max);
        for (k, (version, v)) in merged.take(limit) {
            if !page.push(Item {
                key: k.clone(),
                version,
                value: v.clone(),
            })? {
                break;
            }
        }
        Ok(page.items)
    }

    /// One page of a cluster mover's walk (see `Op::ScanPartitions`): the string objects
    /// after `after` that `filter` lets through, at most `limit` of them within
    /// `reply_bytes_max` encoded bytes, having examined at most [`SCAN_EXAMINE_MAX`] keys.
    /// TOO_LARGE if not even the first match fits. With the partition index (a cluster
    /// node's) the walk is in partition order ([`partition_rank`], then key) and, at a
    /// power-of-two partition count, examines only the marked partitions' keys (looking
    /// into each marked range once per shard, which the examined bound does not count:
    /// at most 16 × the partition count); without it, in key order through every key.
    ///
    /// The page's version clock is read under every shard's read lock, when no write is
    /// half-done: every write after that moment gets a version at least the clock, so a
    /// later walk from that version misses none of them. (An APPLY may store an older
    /// version later; moves walk a primary, whose keys only it writes.)
    pub fn scan_partitions(
        &self,
        after: Option<&[u8]>,
        limit: usize,
        filter: &ScanFilter<'_>,
        reply_bytes_max: usize,
        now: Instant,
    ) -> Result<Page, ErrorReply> {
        let _gate = self.gate();
        // At least one, so a page that is not the last always moves the walk on.
        let limit = limit.clamp(1, SCAN_ITEMS_MAX);
        // Fixed for the store's life (see `index_partitions`), so every page of one walk
        // is in the same order.
        let indexed = self.partition_indexed;
        // Before the locks: writers wait while they are held.
        let (after_rank, ranges) = if indexed {
            (
                after.map(|a| (partition_rank(a), Bytes::copy_from_slice(a))),
                marked_rank_ranges(filter),
            )
        } else {
            (None, Vec::new())
        };
        let guards: Vec<RwLockReadGuard<'_, Shard>> =
            self.shards.iter().map(|s| s.read()).collect();
        let version_clock = self.clock.peek();
        let mut merged: Box<dyn Iterator<Item = (&Bytes, &Entry)>> = if indexed {
            Box::new(
                KeyOrder::merge(
                    guards
                        .iter()
                        .map(|g| g.partition_range_after(after_rank.as_ref(), &ranges)),
                )
                .map(|((_, k), e)| (k, e)),
            )
        } else {
            Box::new(KeyOrder::merge(guards.iter().map(|g| g.range_after(after))))
        };
        let mut page = ReplyItems::new(reply_bytes_max);
        let mut examined = 0usize;
        let mut last: Option<&Bytes> = None;
        let done = loop {
            if page.items.len() >= limit || examined >= SCAN_EXAMINE_MAX {
                break false;
            }
            let Some((k, e)) = merged.next() else {
                break true;
            };
            examined += 1;
            let matching = match &e.value {
                Value::Str(v)
                    if e.is_live(now)
                        && e.version >= filter.since_version
                        && mask_marks(filter.mask, partition_of(k, filter.partitions)) =>
                {
                    Some(v)
                }
                _ => None,
            };
            if let Some(v) = matching {
                let value = if filter.keys_only {
                    Bytes::new()
                } else {
                    v.clone()
                };
                if !page.push(Item {
                    key: k.clone(),
                    version: e.version,
                    value,
                })? {
                    break false;
                }
            }
            last = Some(k);
            if page.bytes >= SCAN_PAGE_BYTES_TARGET {
                break false;
            }
        };
        Ok(Page {
            items: page.items,
            // Past the end; or past the last key examined *whole* (not one cut off).
            resume_after: if done { None } else { last.cloned() },
            version_clock,
            pushed_bytes: 0,
        })
    }

    /// One step of a Redis SCAN: live keys whose [`key_hash`] is at least `cursor`, in
    /// hash order, about `count` of them (every key sharing the last one's hash comes
    /// too), and the cursor to go on from (0 when the walk is over). Hash order, not key
    /// order, because a cursor must be a number and must survive inserts and deletes: a
    /// key present for the whole walk is returned exactly once, whatever else changes.
    /// Each step reads every key's hash (O(keys), holding one shard's lock at a time),
    /// which is the price of not keeping a second, hash-ordered index.
    pub fn scan_by_hash(&self, cursor: u64, count: usize, now: Instant) -> (Vec<Bytes>, u64) {
        let _gate = self.gate();
        let count = count.clamp(1, SCAN_ITEMS_MAX);
        // The `count` smallest hashes seen so far, largest on top.
        let mut chosen: BinaryHeap<(u64, Bytes)> = BinaryHeap::with_capacity(count + 1);
        for s in self.shards.iter() {
            let shard = s.read();
            for (k, e) in shard.map.iter() {
                let h = key_hash(k);
                if h < cursor || !e.is_live(now) {
                    continue;
                }
                if chosen.len() < count {
                    chosen.push((h, k.clone()));
                } else if chosen.peek().is_some_and(|(top, _)| h < *top) {
                    chosen.pop();
                    chosen.push((h, k.clone()));
                }
            }
        }
        let full = chosen.len() >= count;
        let last = chosen.peek().map(|(h, _)| *h);
        let mut keys: Vec<(u64, Bytes)> = chosen.into_vec();
        if let (true, Some(last)) = (full, last) {
            // Keys sharing the boundary hash that did not fit come now, or never: the
            // next cursor starts past that hash.
            for s in self.shards.iter() {
                let shard = s.read();
                for (k, e) in shard.map.iter() {
                    if key_hash(k) == last && e.is_live(now) && !keys.iter().any(|(_, c)| c == k) {
                        keys.push((last, k.clone()));
                    }
                }
            }
        }
        keys.sort_unstable();
        let next = match last {
            Some(h) if full => h.checked_add(1).unwrap_or(0),
            _ => 0,
        };
        (keys.into_iter().map(|(_, k)| k).collect(), next)
    }

    /// Every key, in order (for KEYS-like tools and tests); bounded by `limit`.
    pub fn keys(&self, limit: usize, now: Instant) -> Vec<Bytes> {
        self.keys_matching(limit, now, |_| true)
    }

    /// The keys `keep` approves of, in order; bounded by `limit`.
    pub fn keys_matching(
        &self,
        limit: usize,
        now: Instant,
        keep: impl Fn(&[u8]) -> bool,
    ) -> Vec<Bytes> {
        let _gate = self.gate();
        // Merged in order so that only `limit` keys are ever held, whatever the store
        // holds; read locks as in `scan`.
        let guards: Vec<RwLockReadGuard<'_, Shard>> =
            self.shards.iter().map(|s| s.read()).collect();
        KeyOrder::merge(guards.iter().map(|g| {
            g.range_from(b"")
                .filter(|(k, e)| e.is_live(now) && keep(k))
                .map(|(k, _)| (k, ()))
        }))
        .take(limit)
        .map(|(k, ())| k.clone())
        .collect()
    }

    /// Removes every object.
    pub fn clear(&self) {
        let _gate = self.gate();
        for s in self.shards.iter() {
            let mut shard = s.write();
            let freed = shard.clear();
            drop(shard);
            self.settle(0, 0, freed);
        }
        self.expiring.store(0, Ordering::Relaxed);
    }

    /// Removes expired objects; cheap when none has an expiry. Returns how many went.
    pub fn sweep_expired(&self, now: Instant) -> usize {
        let _gate = self.gate();
        if self.expiring.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let mut removed = 0;
        for s in self.shards.iter() {
            let mut shard = s.write();
            let (gone, freed) = shard.retain(|e| e.is_live(now));
            removed += gone;
            drop(shard);
            self.settle(0, 0, freed);
        }
        self.expiring_sub(removed as u64);
        removed
    }

    // A hint for the sweeper only; `clear` racing an insert must not wrap it around.
    fn expiring_sub(&self, n: u64) {
        let _ = self
            .expiring
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
    }

    /// Bytes the objects hold against the budget.
    pub fn charged_bytes(&self) -> u64 {
        self.charged_bytes.load(Ordering::Relaxed)
    }
}

impl Drop for ObjectStore {
    fn drop(&mut self) {
        self.budget.uncharge(*self.charged_bytes.get_mut());
    }
}

/// The items of one SCAN or SCAN_PARTITIONS answer, kept within the bytes its frame has
/// room for.
struct ReplyItems {
    items: Vec<Item>,
    bytes: usize,
    bytes_max: usize,
}

impl ReplyItems {
    fn new(bytes_max: usize) -> Self {
        ReplyItems {
            items: Vec::new(),
            bytes: 0,
            bytes_max,
        }
    }

    /// Adds `item` if it fits: false when it does not (the answer is full), TOO_LARGE when
    /// not even the first item fits (no page could ever carry it).
    fn push(&mut self, item: Item) -> Result<bool, ErrorReply> {
        let item_bytes = ITEM_OVERHEAD_BYTES + item.key.len() + item.value.len();
        if self.bytes + item_bytes > self.bytes_max {
            if self.items.is_empty() {
                return Err(err(
                    ErrorCode::TooLarge,
                    "the next object does not fit in this batch's response frame; \
                     scan it in a smaller batch",
                ));
            }
            return Ok(false);
        }
        self.bytes += item_bytes;
        self.items.push(item);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn store(cap_bytes: u64) -> (ObjectStore, Arc<MemoryBudget>) {
        let budget = MemoryBudget::new(cap_bytes);
        (ObjectStore::new(Arc::clone(&budget)), budget)
    }

    /// A change that fails half made (an error after the entry was already grown) is
    /// still counted: before, the bytes it added stayed outside the memory budget.
    #[test]
    fn a_change_that_fails_half_made_is_still_counted() {
        let (s, budget) = store(1 << 20);
        let now = Instant::now();
        s.put(b"k", b"a", now).unwrap();
        let before = budget.used();
        let r = s.modify(
            b"k",
            |_| 2000,
            now,
            |e, _| -> Result<((), Change), ErrorReply> {
                if let Some(e) = e {
                    e.value = Value::Str(Bytes::from(vec![7u8; 1000]));
                }
                Err(err(ErrorCode::BadRequest, "the second half failed"))
            },
        );
        assert!(r.is_err());
        assert_eq!(
            budget.used(),
            before + 999,
            "a one-byte value grown to 1,000 bytes is not counted"
        );
        let version = |s: &ObjectStore| s.read(b"k", now, |e| e.map(|e| e.version));
        let v_before = version(&s);
        let _ = s.modify(
            b"k",
            |_| 2000,
            now,
            |e, _| -> Result<((), Change), ErrorReply> {
                if let Some(e) = e {
                    e.value = Value::Str(Bytes::from(vec![7u8; 1500]));
                }
                Err(err(ErrorCode::BadRequest, "half made again"))
            },
        );
        assert_ne!(version(&s), v_before, "a half-made change kept its version");
        s.delete(b"k", now).unwrap();
        assert_eq!(budget.used(), 0);
    }

    /// A cluster node's store: with the partition-order index.
    fn indexed_store(cap_bytes: u64) -> (ObjectStore, Arc<MemoryBudget>) {
        let (mut s, budget) = store(cap_bytes);
        s.index_partitions();
        (s, budget)
    }

    fn code<T: std::fmt::Debug>(r: Result<T, ErrorReply>) -> ErrorCode {
        r.expect_err("expected an error").code
    }

    #[test]
    fn apply_keeps_the_newest_copy_and_moves_the_clock_past_it() {
        let (s, _) = store(1 << 20);
        let now = Instant::now();
        assert_eq!(s.apply(b"k", 10, Some(b"ten"), now).unwrap(), 10);
        assert_eq!(s.get(b"k", now).unwrap(), (10, Bytes::from_static(b"ten")));
        // An older or repeated copy changes nothing and reports the newer version.
        assert_eq!(s.apply(b"k", 7, Some(b"seven"), now).unwrap(), 10);
        assert_eq!(s.apply(b"k", 10, Some(b"again"), now).unwrap(), 10);
        assert_eq!(s.get(b"k", now).unwrap(), (10, Bytes::from_static(b"ten")));
        // This server's own next write supersedes every copy it took.
        let own = s.put(b"other", b"x", now).unwrap();
        assert!(own > 10, "{own}");
        assert_eq!(s.apply(b"k", 12, None, now).unwrap(), 12);
        assert_eq!(code(s.get(b"k", now)), ErrorCode::NoSuchKey);
        assert_eq!(
            code(s.apply(b"k", 0, Some(b"x"), now)),
            ErrorCode::BadRequest
        );
        assert_eq!(
            code(s.apply(b"k", APPLY_VERSION_MAX + 1, Some(b"x"), now)),
            ErrorCode::BadRequest
        );
        // A CAS against the copied version works on the copy, as it did on the primary.
        s.apply(b"c", 20, Some(b"v"), now).unwrap();
        let next = s.cas_put(b"c", 20, b"w", now).unwrap();
        assert!(next > 20);
    }

    proptest::proptest! {
        /// Copies of one key's writes, each taken once or twice and in any order, leave
        /// the newest (puts only: a delete carries no tombstone, so a delete followed by
        /// an older put is the one order a replica must not see; primaries send in order).
        #[test]
        fn applies_in_any_order_converge_to_the_newest(
            order in proptest::strategy::Strategy::prop_shuffle(
                proptest::strategy::Just((0..12usize).collect::<Vec<_>>())
            ),
            twice in proptest::collection::vec(proptest::bool::ANY, 12),
        ) {
            let (s, _) = store(1 << 20);
            let now = Instant::now();
            for &i in &order {
                let v = (i as u64 + 1) * 3;
                let value = format!("v{v}");
                s.apply(b"k", v, Some(value.as_bytes()), now).unwrap();
                if twice[i] {
                    s.apply(b"k", v, Some(value.as_bytes()), now).unwrap();
                }
            }
            let (v, value) = s.get(b"k", now).unwrap();
            proptest::prop_assert_eq!(v, 36);
            proptest::prop_assert_eq!(&value[..], &b"v36"[..]);
        }
    }

    #[test]
    fn versions_increase_and_cas_checks_them() {
        let (s, _) = store(1 << 20);
        let now = Instant::now();
        assert_eq!(code(s.get(b"k", now)), ErrorCode::NoSuchKey);
        let v1 = s.put(b"k", b"one", now).unwrap();
        let v2 = s.put(b"k", b"two", now).unwrap();
        assert!(v2 > v1);
        assert_eq!(s.get(b"k", now).unwrap(), (v2, Bytes::from_static(b"two")));
        assert_eq!(
            code(s.cas_put(b"k", v1, b"x", now)),
            ErrorCode::VersionConflict
        );
        assert_eq!(
            code(s.cas_put(b"k", 0, b"x", now)),
            ErrorCode::VersionConflict
        );
        let v3 = s.cas_put(b"k", v2, b"three", now).unwrap();
        assert!(v3 > v2);
        assert_eq!(s.delete(b"k", now).unwrap(), v3);
        assert_eq!(code(s.delete(b"k", now)), ErrorCode::NoSuchKey);
        // Re-created, it must not reuse a version an old CAS could match.
        let v4 = s.cas_put(b"k", 0, b"four", now).unwrap();
        assert!(v4 > v3);
    }

    #[test]
    fn a_full_store_refuses_and_keeps_everything() {
        let (s, budget) = store(10_000);
        let now = Instant::now();
        let value = vec![7u8; 900];
        let mut stored = Vec::new();
        for i in 0..100 {
            let key = format!("key{i:03}");
            match s.put(key.as_bytes(), &value, now) {
                Ok(v) => stored.push((key, v)),
                Err(e) => {
                    assert_eq!(e.code, ErrorCode::OutOfMemory);
                    break;
                }
            }
        }
        assert!(!stored.is_empty() && stored.len() < 100);
        assert!(budget.used() <= budget.cap());
        for (k, v) in &stored {
            assert_eq!(s.get(k.as_bytes(), now).unwrap().0, *v);
        }
        // Overwriting with the same size needs no new memory, even when full.
        let (k, _) = &stored[0];
        s.put(k.as_bytes(), &value, now).unwrap();
        // Deleting gives memory back, and dropping the store gives back all of it.
        let before = budget.used();
        s.delete(stored[1].0.as_bytes(), now).unwrap();
        assert!(budget.used() < before);
        drop(s);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn keys_come_in_order_and_stop_at_the_limit() {
        let (s, _) = store(1 << 24);
        let now = Instant::now();
        for i in (0..300).rev() {
            s.put(format!("k{i:04}").as_bytes(), b"v", now).unwrap();
        }
        let name = |i: usize| Bytes::from(format!("k{i:04}"));
        assert_eq!(s.keys(7, now), (0..7).map(name).collect::<Vec<_>>());
        assert_eq!(
            s.keys(usize::MAX, now),
            (0..300).map(name).collect::<Vec<_>>()
        );
        assert!(s.keys(0, now).is_empty());
    }

    #[test]
    fn a_hash_order_walk_returns_each_lasting_key_once_whatever_changes() {
        let (s, _) = store(16 << 20);
        let now = Instant::now();
        for i in 0..300 {
            s.put(format!("stay{i}").as_bytes(), b"v", now).unwrap();
        }
        let mut seen: HashMap<Bytes, usize> = HashMap::new();
        let mut cursor = 0;
        for step in 0..10_000 {
            let (keys, next) = s.scan_by_hash(cursor, 7, now);
            for k in keys {
                *seen.entry(k).or_default() += 1;
            }
            // Churn between steps: keys come and go, which must not make the walk
            // skip or repeat the keys that stay.
            s.put(format!("new{step}").as_bytes(), b"v", now).unwrap();
            let _ = s.delete(format!("new{}", step / 2).as_bytes(), now);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        for i in 0..300 {
            let k = Bytes::from(format!("stay{i}"));
            assert_eq!(seen.get(&k), Some(&1), "{k:?}");
        }
        assert!(seen.values().all(|&n| n == 1), "a key came twice");
    }

    #[test]
    fn scan_merges_every_shard_in_key_order() {
        let (s, _) = store(1 << 24);
        let now = Instant::now();
        for i in (0..500).rev() {
            s.put(format!("k{i:04}").as_bytes(), b"v", now).unwrap();
        }
        let items = s.scan(b"k0100", 50, usize::MAX, now).unwrap();
        let keys: Vec<String> = items
            .iter()
            .map(|it| String::from_utf8(it.key.to_vec()).unwrap())
            .collect();
        let expected: Vec<String> = (100..150).map(|i| format!("k{i:04}")).collect();
        assert_eq!(keys, expected);
        assert!(s.scan(b"l", 10, usize::MAX, now).unwrap().is_empty());
        // A byte budget cuts the scan short, but never to nothing.
        let few = s.scan(b"", 50, 3 * (ITEM_OVERHEAD_BYTES + 6), now).unwrap();
        assert_eq!(few.len(), 3);
        assert_eq!(
            code(s.scan(b"", 50, ITEM_OVERHEAD_BYTES, now)),
            ErrorCode::TooLarge
        );
    }

    /// Every page of a SCAN_PARTITIONS walk from the start, as (key, version, value).
    fn walk(s: &ObjectStore, filter: &ScanFilter<'_>, limit: usize) -> (Vec<Item>, usize, u64) {
        let now = Instant::now();
        let (mut items, mut pages, mut after) = (Vec::new(), 0, None::<Bytes>);
        let mut clock = 0;
        loop {
            let page = s
                .scan_partitions(after.as_deref(), limit, filter, usize::MAX, now)
                .unwrap();
            pages += 1;
            if pages == 1 {
                clock = page.version_clock;
            }
            items.extend(page.items);
            match page.resume_after {
                Some(k) => after = Some(k),
                None => return (items, pages, clock),
            }
        }
    }

    #[test]
    fn partition_scans_filter_by_mask_and_version_and_page_past_misses() {
        let (s, _) = indexed_store(1 << 26);
        let now = Instant::now();
        let keys: Vec<String> = (0..(SCAN_EXAMINE_MAX + 3000))
            .map(|i| format!("k{i:06}"))
            .collect();
        for k in &keys {
            s.put(k.as_bytes(), b"value", now).unwrap();
        }
        let parts = 64;
        let in_mask = |k: &String| partition_of(k.as_bytes(), parts).is_multiple_of(5);
        let mask = camelot_proto::partition_mask(parts, (0..parts).filter(|p| p.is_multiple_of(5)));
        let filter = ScanFilter {
            partitions: parts,
            mask: &mask,
            since_version: 0,
            keys_only: false,
        };
        let (items, pages, clock) = walk(&s, &filter, SCAN_ITEMS_MAX);
        let want: BTreeSet<&String> = keys.iter().filter(|k| in_mask(k)).collect();
        let got: Vec<String> = items
            .iter()
            .map(|i| String::from_utf8(i.key.to_vec()).unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "each marked key once");
        assert_eq!(got.iter().collect::<BTreeSet<_>>(), want);
        assert!(items.iter().all(|i| &i.value[..] == b"value"));
        // Only the marked partitions' keys were examined: the fifth of the keys they hold
        // came in one page, though the store holds more than a page may examine.
        assert!(want.len() < SCAN_ITEMS_MAX && keys.len() > SCAN_EXAMINE_MAX);
        assert_eq!(pages, 1, "the walk examined unmarked partitions' keys");
        // Without the index (a lone server's store), the same keys through every key.
        let (plain, _) = store(1 << 26);
        for k in &keys {
            plain.put(k.as_bytes(), b"value", now).unwrap();
        }
        let (walked, plain_pages, _) = walk(&plain, &filter, SCAN_ITEMS_MAX);
        let walked: Vec<String> = walked
            .iter()
            .map(|i| String::from_utf8(i.key.to_vec()).unwrap())
            .collect();
        assert_eq!(
            walked.iter().collect::<Vec<_>>(),
            want.iter().copied().collect::<Vec<_>>(),
            "key order"
        );
        assert!(plain_pages >= 2, "{plain_pages} page(s)");
        // Every partition: more keys than one page may examine, so the walk went on.
        let all = camelot_proto::partition_mask(parts, 0..parts);
        let (every, all_pages, _) = walk(
            &s,
            &ScanFilter {
                mask: &all,
                keys_only: true,
                ..filter
            },
            SCAN_ITEMS_MAX,
        );
        assert_eq!(every.len(), keys.len());
        assert!(all_pages >= 2, "{all_pages} page(s)");

        // Since the first page's clock: exactly the keys written after it.
        let later: Vec<&String> = keys.iter().step_by(97).collect();
        for k in &later {
            s.put(k.as_bytes(), b"newer", now).unwrap();
        }
        let all = camelot_proto::partition_mask(parts, 0..parts);
        let since = ScanFilter {
            partitions: parts,
            mask: &all,
            since_version: clock,
            keys_only: true,
        };
        let (changed, _, _) = walk(&s, &since, 7);
        let got: Vec<String> = changed
            .iter()
            .map(|i| String::from_utf8(i.key.to_vec()).unwrap())
            .collect();
        assert_eq!(got.len(), later.len());
        assert_eq!(
            got.iter().collect::<BTreeSet<_>>(),
            later.iter().copied().collect::<BTreeSet<_>>()
        );
        assert!(changed.iter().all(|i| i.value.is_empty()), "keys only");

        // A byte budget cuts a page at a whole item and the walk resumes right after it.
        let page = s
            .scan_partitions(None, 50, &since, 2 * (ITEM_OVERHEAD_BYTES + 7), now)
            .unwrap();
        assert_eq!(page.items.len(), 2);
        assert_eq!(page.items[..], changed[..2]);
        let next = s
            .scan_partitions(page.resume_after.as_deref(), 1, &since, usize::MAX, now)
            .unwrap();
        assert_eq!(next.items[0], changed[2]);
    }

    #[test]
    fn a_partition_page_ends_once_its_values_pass_the_byte_target() {
        let (s, _) = indexed_store(1 << 28);
        let now = Instant::now();
        let value = vec![7u8; 1 << 20];
        let keys: Vec<String> = (0..9).map(|i| format!("big{i}")).collect();
        for k in &keys {
            s.put(k.as_bytes(), &value, now).unwrap();
        }
        let parts = 8;
        let all = camelot_proto::partition_mask(parts, 0..parts);
        let filter = ScanFilter {
            partitions: parts,
            mask: &all,
            since_version: 0,
            keys_only: false,
        };
        // Each page stops at the first item that takes it to the target, so no page
        // holds more than the target plus one item, though the budget would allow all.
        let per_page = SCAN_PAGE_BYTES_TARGET.div_ceil(value.len());
        let (items, pages, _) = walk(&s, &filter, SCAN_ITEMS_MAX);
        assert_eq!(items.len(), keys.len(), "every key once");
        assert_eq!(pages, keys.len().div_ceil(per_page), "{pages} page(s)");
        // Keys only, the same keys fit one page.
        let keys_only = ScanFilter {
            keys_only: true,
            ..filter
        };
        assert_eq!(walk(&s, &keys_only, SCAN_ITEMS_MAX).1, 1);
    }

    #[test]
    fn every_power_of_two_partition_is_one_range_of_ranks() {
        let keys: Vec<Vec<u8>> = (0..4000u32)
            .map(|i| format!("user{i}").into_bytes())
            .collect();
        for k in 0..=16 {
            let partitions = 1u32 << k;
            for key in &keys {
                let p = partition_of(key, partitions);
                let (start, end) = partition_ranks(p, partitions);
                let rank = partition_rank(key);
                assert!(
                    rank >= start && end.is_none_or(|e| rank < e),
                    "{key:?} of partition {p} / {partitions}: rank {rank} outside [{start}, {end:?})"
                );
            }
        }
    }

    proptest::proptest! {
        /// Whatever the partition count (a power of two or not), mask, page size and
        /// the inserts and deletes before it, a SCAN_PARTITIONS walk returns each marked
        /// key exactly once and nothing else.
        #[test]
        fn a_partition_walk_returns_exactly_the_marked_keys(
            keys in proptest::collection::btree_set("[a-z0-9]{1,12}", 0..300),
            deleted in proptest::collection::vec(proptest::bool::ANY, 300),
            partitions in proptest::prop_oneof![
                proptest::strategy::Strategy::prop_map(0u32..=10, |k| 1 << k),
                1u32..2000,
            ],
            marked in proptest::collection::vec(proptest::bool::ANY, 64),
            limit in 1usize..40,
            // Where the partition index starts (past the end: a lone server's store).
            indexed_from in 0usize..400,
        ) {
            let (mut s, _) = store(1 << 26);
            let now = Instant::now();
            let mut live = BTreeSet::new();
            for (i, k) in keys.iter().enumerate() {
                if i == indexed_from {
                    s.index_partitions();
                }
                s.put(k.as_bytes(), b"v", now).unwrap();
                if deleted[i] {
                    s.delete(k.as_bytes(), now).unwrap();
                } else {
                    live.insert(k.clone());
                }
            }
            let is_marked = |p: u32| marked[(p as usize) % marked.len()];
            let mask = camelot_proto::partition_mask(
                partitions,
                (0..partitions).filter(|&p| is_marked(p)),
            );
            let filter = ScanFilter { partitions, mask: &mask, since_version: 0, keys_only: true };
            let (items, _, _) = walk(&s, &filter, limit);
            let got: Vec<String> =
                items.iter().map(|i| String::from_utf8(i.key.to_vec()).unwrap()).collect();
            let want: BTreeSet<String> = live
                .into_iter()
                .filter(|k| is_marked(partition_of(k.as_bytes(), partitions)))
                .collect();
            proptest::prop_assert_eq!(got.len(), want.len());
            proptest::prop_assert_eq!(got.into_iter().collect::<BTreeSet<_>>(), want);
            // The orders hold exactly the stored keys: none left behind by a delete.
            for shard in s.shards.iter() {
                let shard = shard.read();
                proptest::prop_assert_eq!(shard.order.len(), shard.map.len());
                let indexed = shard.by_partition.as_ref().map(BTreeSet::len);
                proptest::prop_assert_eq!(
                    indexed,
                    (indexed_from < keys.len()).then_some(shard.map.len())
                );
            }
        }
    }

    #[test]
    fn expired_objects_vanish_and_give_memory_back() {
        let (s, budget) = indexed_store(1 << 20);
        let now = Instant::now();
        let later = now + Duration::from_secs(10);
        s.modify(
            b"t",
            |_| 1000,
            now,
            |_, _| {
                Ok((
                    (),
                    Change::Insert {
                        value: Value::Str(Bytes::from_static(b"v")),
                        expires_at: Some(now + Duration::from_secs(1)),
                    },
                ))
            },
        )
        .unwrap();
        assert!(s.get(b"t", now).is_ok());
        assert_eq!(code(s.get(b"t", later)), ErrorCode::NoSuchKey);
        assert!(s.scan(b"", 10, usize::MAX, later).unwrap().is_empty());
        assert_eq!(s.sweep_expired(later), 1);
        assert_eq!(budget.used(), 0);
        assert!(
            s.shards.iter().all(|sh| sh
                .read()
                .by_partition
                .as_ref()
                .is_some_and(BTreeSet::is_empty)),
            "the sweep left the key in the partition order"
        );
        assert_eq!(s.sweep_expired(later), 0);
    }

    #[test]
    fn upsert_creates_keeps_other_types_and_moves_the_version_only_on_change() {
        let clock = VersionClock(AtomicU64::new(7));
        let add = |m: &'static [u8]| move |s: &mut Set| s.insert(Bytes::from_static(m));
        let (added, change) = upsert_collection(None, &clock, add(b"a"), |a| *a).unwrap();
        let Change::Insert { value, .. } = change else {
            panic!("a missing key must be created");
        };
        assert!(added);
        let mut e = Entry {
            version: 1,
            value,
            expires_at: None,
            charge_bytes: 0,
        };
        let (added, _) = upsert_collection(Some(&mut e), &clock, add(b"a"), |a| *a).unwrap();
        assert!(!added);
        assert_eq!(e.version, 1, "adding a present member is no change");
        upsert_collection(Some(&mut e), &clock, add(b"b"), |a| *a).unwrap();
        assert_eq!(e.version, 7);
        let mut s = Entry {
            version: 3,
            value: Value::Str(Bytes::from_static(b"x")),
            expires_at: None,
            charge_bytes: 0,
        };
        let r = upsert_collection(Some(&mut s), &clock, add(b"a"), |_| true);
        assert_eq!(r.err().map(|e| e.code), Some(ErrorCode::WrongType));
        assert!(matches!(&s.value, Value::Str(b) if &b[..] == b"x") && s.version == 3);
    }

    #[test]
    fn collections_are_wrong_type_for_strings_and_vanish_when_empty() {
        let (s, budget) = store(1 << 20);
        let now = Instant::now();
        let mut h = Hash::default();
        h.set(Bytes::from_static(b"f"), Bytes::from_static(b"v"))
            .unwrap();
        s.modify(
            b"h",
            |_| 1000,
            now,
            |_, _| {
                Ok((
                    (),
                    Change::Insert {
                        value: Value::Hash(h),
                        expires_at: None,
                    },
                ))
            },
        )
        .unwrap();
        assert_eq!(code(s.get(b"h", now)), ErrorCode::WrongType);
        assert!(s.scan(b"", 10, usize::MAX, now).unwrap().is_empty());
        s.modify(
            b"h",
            |_| 0,
            now,
            |e, _| {
                if let Some(Entry {
                    value: Value::Hash(h),
                    ..
                }) = e
                {
                    assert!(h.remove(b"f"));
                }
                Ok(((), Change::Keep))
            },
        )
        .unwrap();
        assert!(s.is_empty());
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn zset_ranges_follow_redis_bounds() {
        let mut z = ZSet::default();
        for (m, sc) in [("a", 1.0), ("b", 2.0), ("c", 2.0), ("d", 3.0)] {
            assert!(z.insert(Bytes::from(m), sc).unwrap());
        }
        assert!(!z.insert(Bytes::from("a"), 0.5).unwrap());
        let names = |v: Vec<(Bytes, f64)>| -> Vec<String> {
            v.into_iter()
                .map(|(m, _)| String::from_utf8(m.to_vec()).unwrap())
                .collect()
        };
        assert_eq!(
            names(z.range_by_score((2.0, false), (3.0, false), 0, 10)),
            ["b", "c", "d"]
        );
        assert_eq!(
            names(z.range_by_score((2.0, true), (f64::INFINITY, false), 0, 10)),
            ["d"]
        );
        assert_eq!(
            names(z.range_by_score((f64::NEG_INFINITY, false), (3.0, true), 1, 2)),
            ["b", "c"]
        );
        assert!(z.remove(b"b"));
        assert_eq!(z.len(), 3);
        assert_eq!(z.score(b"a"), Some(0.5));
    }

    #[test]
    fn oversized_keys_and_values_are_refused() {
        let (s, _) = store(1 << 30);
        let now = Instant::now();
        let long_key = vec![b'k'; KEY_BYTES_MAX + 1];
        assert_eq!(code(s.put(&long_key, b"v", now)), ErrorCode::TooLarge);
        assert_eq!(
            code(s.put(b"k", &vec![0u8; VALUE_BYTES_MAX + 1], now)),
            ErrorCode::TooLarge
        );
    }

    #[test]
    fn concurrent_cas_increments_lose_nothing() {
        let (s, _) = store(1 << 24);
        let now = Instant::now();
        s.put(b"n", &0u64.to_le_bytes(), now).unwrap();
        let threads = 4;
        let per_thread = 500;
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    for _ in 0..per_thread {
                        loop {
                            let (v, b) = s.get(b"n", now).unwrap();
                            let n = u64::from_le_bytes(b[..8].try_into().unwrap());
                            if s.cas_put(b"n", v, &(n + 1).to_le_bytes(), now).is_ok() {
                                break;
                            }
                        }
                    }
                });
            }
        });
        let (_, b) = s.get(b"n", now).unwrap();
        assert_eq!(
            u64::from_le_bytes(b[..8].try_into().unwrap()),
            threads * per_thread
        );
    }
}
