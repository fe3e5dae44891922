//! The key-value face: objects on the memory servers, keys hashed to partitions and
//! partitions to nodes through the [`ClusterMap`](crate::ClusterMap). Requests go through
//! the same batching connections as region operations, so many threads' GETs to one node
//! share frames, and `get_many`/`put_many` submit everything before waiting on anything.

use crate::map::partition_of;
use crate::{reply, Client, ClientError, NodeId, Pending};
use bytes::Bytes;
use camelot_proto::limits::{KEY_BYTES_MAX, SCAN_ITEMS_MAX, VALUE_BYTES_MAX};
use camelot_proto::{ErrorCode, Item, Op, Reply};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A value and the version the server gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub version: u64,
    pub value: Bytes,
}

/// A replica read's answer ([`Client::get_any_replica`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRead {
    pub value: Option<Versioned>,
    /// The node that answered.
    pub node: NodeId,
    /// A backup answered: the value **may be stale** (see [`Client::get_any_replica`]).
    pub may_be_stale: bool,
}

/// What a conditional put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasOutcome {
    /// Stored, at this new version.
    Stored(u64),
    /// The object was not at the expected version; nothing changed.
    Conflict,
}

/// Most keys one `get_many`/`put_many` call takes, so a caller cannot queue unbounded
/// memory in one call.
pub const MANY_KEYS_MAX: usize = 1 << 20;

fn check_key(key: &[u8]) -> Result<(), ClientError> {
    if key.len() > KEY_BYTES_MAX {
        return Err(ClientError::InvalidArgument(format!(
            "key of {} bytes exceeds the limit of {KEY_BYTES_MAX}",
            key.len()
        )));
    }
    Ok(())
}

fn check_value(value: &[u8]) -> Result<(), ClientError> {
    if value.len() > VALUE_BYTES_MAX {
        return Err(ClientError::InvalidArgument(format!(
            "value of {} bytes exceeds the limit of {VALUE_BYTES_MAX}",
            value.len()
        )));
    }
    Ok(())
}

fn check_many(n: usize) -> Result<(), ClientError> {
    if n > MANY_KEYS_MAX {
        return Err(ClientError::InvalidArgument(format!(
            "{n} keys in one call exceeds the limit of {MANY_KEYS_MAX}"
        )));
    }
    Ok(())
}

fn no_key_is_none<T>(r: Result<T, ClientError>) -> Result<Option<T>, ClientError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.code() == Some(ErrorCode::NoSuchKey) => Ok(None),
        Err(e) => Err(e),
    }
}

fn cas_outcome(r: Result<Reply, ClientError>) -> Result<CasOutcome, ClientError> {
    match reply::version(r) {
        Ok(v) => Ok(CasOutcome::Stored(v)),
        Err(e) if e.code() == Some(ErrorCode::VersionConflict) => Ok(CasOutcome::Conflict),
        Err(e) => Err(e),
    }
}

/// Times one key-value call is sent again after MOVED or STALE_EPOCH before the error
/// is the caller's: a map changes in one step, so two or three suffice unless the servers
/// are still catching up with it, or a move's fence holds the partition, which the
/// backoff waits out.
pub const REDIRECTS_MAX: u32 = 40;
/// First wait between redirected attempts when refreshing brought nothing newer; doubled
/// each time up to [`REDIRECT_BACKOFF_MAX`]. The attempts wait ~0.93 s in all (longer
/// than a move's fence may hold, `FENCE_MAX` = 400 ms). The cap is low so that a caller
/// held by a fence goes on at most 25 ms after it lifts: with a 200 ms cap, a 80 ms fence
/// held callers 155 ms, and the expansion bench's slowest second showed it.
pub const REDIRECT_BACKOFF_START: Duration = Duration::from_millis(2);
pub const REDIRECT_BACKOFF_MAX: Duration = Duration::from_millis(25);

fn is_redirect(e: &ClientError) -> Option<u64> {
    match e {
        ClientError::Server(reply) if reply.code.carries_epoch() => Some(reply.epoch),
        _ => None,
    }
}

impl Client {
    /// The node that holds `key` under the current map: its partition's primary for a
    /// cluster map, rendezvous hashing of its partition for a static one.
    pub fn node_for_key(&self, key: &[u8]) -> Result<NodeId, ClientError> {
        if let Some(table) = self.partition_table() {
            return Ok(table.node_for_key(key));
        }
        self.map()
            .node_for_partition(partition_of(key))
            .ok_or(ClientError::EmptyMap)
    }

    /// Runs `attempt` until it is not answered MOVED or STALE_EPOCH, at most
    /// [`REDIRECTS_MAX`] more times. Both answers mean the server did not execute the
    /// request, so sending it again (a PUT, a CAS) cannot apply it twice. Before each
    /// retry: when the server's epoch is newer than ours (or it says MOVED), fetch the
    /// map from the source; when that brings nothing newer (the server is behind, or the
    /// source has not caught up), back off.
    fn with_redirects<T>(
        &self,
        mut attempt: impl FnMut() -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let mut backoff = REDIRECT_BACKOFF_START;
        let mut redirects = 0;
        loop {
            let err = match attempt() {
                Err(e) => e,
                ok => return ok,
            };
            let Some(server_epoch) = is_redirect(&err) else {
                return Err(err);
            };
            if redirects == REDIRECTS_MAX {
                return Err(err);
            }
            redirects += 1;
            self.inner.redirects.fetch_add(1, Ordering::Relaxed);
            let moved = err.code() == Some(ErrorCode::Moved);
            let refreshed = if server_epoch > self.epoch() || moved {
                // A source that cannot answer now is one more reason to wait, not a
                // reason to fail a request the retry may still serve.
                self.refresh_map().unwrap_or(false)
            } else {
                false
            };
            if !refreshed {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(REDIRECT_BACKOFF_MAX);
            }
        }
    }

    fn submit_key(&self, key: &[u8], op: Op) -> Result<Pending, ClientError> {
        check_key(key)?;
        let node = self.node_for_key(key)?;
        self.submit(node, op)
    }

    fn submit_get(&self, key: &[u8]) -> Result<Pending, ClientError> {
        self.submit_key(
            key,
            Op::Get {
                key: Bytes::copy_from_slice(key),
            },
        )
    }

    fn submit_put(&self, key: &[u8], value: Bytes) -> Result<Pending, ClientError> {
        check_value(&value)?;
        self.submit_key(
            key,
            Op::Put {
                key: Bytes::copy_from_slice(key),
                value,
            },
        )
    }

    fn submit_cas(
        &self,
        key: &[u8],
        expected_version: u64,
        value: Bytes,
    ) -> Result<Pending, ClientError> {
        check_value(&value)?;
        self.submit_key(
            key,
            Op::CasPut {
                key: Bytes::copy_from_slice(key),
                expected_version,
                value,
            },
        )
    }

    fn submit_delete(&self, key: &[u8]) -> Result<Pending, ClientError> {
        self.submit_key(
            key,
            Op::Delete {
                key: Bytes::copy_from_slice(key),
            },
        )
    }

    /// The value under `key` and its version; `None` when there is no such object.
    pub fn get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        self.with_redirects(|| no_key_is_none(reply::object(self.submit_get(key)?.wait())))
    }

    /// Reads `key` from any replica of its partition — the primary or one of its full
    /// backups, taken in turn — to spread reads over the copies. **May be stale** when a
    /// backup answers (`may_be_stale`): a backup holds every write acknowledged before the
    /// read began (a write is acknowledged only once every replica applied it), but not
    /// writes still being copied, which the primary may already show; around a map change
    /// it may also miss writes acknowledged under a newer epoch its server has not yet
    /// installed. It never shows a write that was not made (copies come only from the
    /// primary), but two replica reads of one key may go to different backups and so see
    /// versions out of order. A backup that refuses (MOVED, STALE_EPOCH: the map moved on)
    /// or cannot be reached is skipped for the primary, read as [`Client::get`] reads.
    pub fn get_any_replica(&self, key: &[u8]) -> Result<ReplicaRead, ClientError> {
        check_key(key)?;
        let backups: Vec<NodeId> = self
            .partition_table()
            .map(|t| t.backups_for_key(key).to_vec())
            .unwrap_or_default();
        let pick = self.inner.next_id.load(Ordering::Relaxed) as usize % (backups.len() + 1);
        if let Some(&node) = pick.checked_sub(1).and_then(|i| backups.get(i)) {
            let op = Op::Get {
                key: Bytes::copy_from_slice(key),
            };
            if let Ok(value) = self
                .submit(node, op)
                .and_then(|p| no_key_is_none(reply::object(p.wait())))
            {
                return Ok(ReplicaRead {
                    value,
                    node,
                    may_be_stale: true,
                });
            }
        }
        let value = self.get(key)?;
        Ok(ReplicaRead {
            value,
            node: self.node_for_key(key)?,
            may_be_stale: false,
        })
    }

    /// Stores `value` under `key`, whatever was there; returns the new version.
    pub fn put(&self, key: &[u8], value: impl Into<Bytes>) -> Result<u64, ClientError> {
        let value = value.into();
        self.with_redirects(|| reply::version(self.submit_put(key, value.clone())?.wait()))
    }

    /// Stores `value` only if the object is at `expected_version` (0: only if there is no
    /// object under `key`).
    pub fn cas_put(
        &self,
        key: &[u8],
        expected_version: u64,
        value: impl Into<Bytes>,
    ) -> Result<CasOutcome, ClientError> {
        let value = value.into();
        self.with_redirects(|| {
            cas_outcome(
                self.submit_cas(key, expected_version, value.clone())?
                    .wait(),
            )
        })
    }

    /// Removes `key`; returns the version it had, or `None` when there was nothing.
    pub fn delete(&self, key: &[u8]) -> Result<Option<u64>, ClientError> {
        self.with_redirects(|| no_key_is_none(reply::version(self.submit_delete(key)?.wait())))
    }

    /// Many GETs at once: all are sent before any is waited for, so each node gets them
    /// in as few frames as the batcher makes. Answers are in the order of `keys`.
    pub fn get_many<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<Option<Versioned>>, ClientError> {
        check_many(keys.len())?;
        let pending = keys
            .iter()
            .map(|k| self.submit_get(k.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        pending
            .into_iter()
            .zip(keys)
            .map(|(p, k)| match no_key_is_none(reply::object(p.wait())) {
                Err(e) if is_redirect(&e).is_some() => self.get(k.as_ref()),
                other => other,
            })
            .collect()
    }

    /// Many PUTs at once; returns each new version, in the order of `pairs`.
    pub fn put_many<K: AsRef<[u8]>>(&self, pairs: &[(K, Bytes)]) -> Result<Vec<u64>, ClientError> {
        check_many(pairs.len())?;
        let pending = pairs
            .iter()
            .map(|(k, v)| self.submit_put(k.as_ref(), v.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        pending
            .into_iter()
            .zip(pairs)
            .map(|(p, (k, v))| match reply::version(p.wait()) {
                Err(e) if is_redirect(&e).is_some() => self.put(k.as_ref(), v.clone()),
                other => other,
            })
            .collect()
    }

    /// Many DELETEs at once; returns each key's last version (`None`: there was nothing),
    /// in the order of `keys`.
    pub fn delete_many<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<u64>>, ClientError> {
        check_many(keys.len())?;
        let pending = keys
            .iter()
            .map(|k| self.submit_delete(k.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        pending
            .into_iter()
            .zip(keys)
            .map(|(p, k)| match no_key_is_none(reply::version(p.wait())) {
                Err(e) if is_redirect(&e).is_some() => self.delete(k.as_ref()),
                other => other,
            })
            .collect()
    }

    /// Up to `limit` objects with keys `>= start`, in key order across every node.
    pub fn scan(&self, start: &[u8], limit: usize) -> Result<Vec<Item>, ClientError> {
        check_key(start)?;
        if limit > SCAN_ITEMS_MAX {
            return Err(ClientError::InvalidArgument(format!(
                "a scan returns at most {SCAN_ITEMS_MAX} items, not {limit}"
            )));
        }
        let map = self.map();
        // Every node holds some partitions, so each may hold any of the next `limit` keys.
        // All nodes are asked at once; only a node whose answer filled its frame is asked
        // again.
        let nodes: Vec<NodeId> = map.node_ids().collect();
        let first = Bytes::copy_from_slice(start);
        let pendings = self.submit_many(nodes.iter().map(|&node| {
            (
                node,
                Op::Scan {
                    start: first.clone(),
                    limit: limit as u32,
                },
            )
        }))?;
        let mut per_node = Vec::with_capacity(nodes.len());
        for (node, pending) in nodes.into_iter().zip(pendings) {
            let items = reply::items(pending.wait())?;
            per_node.push(self.scan_rest(node, items, limit)?);
        }
        Ok(merge_in_key_order(per_node, limit))
    }

    /// Continues one node's scan until it has `limit` items or none are left. A short
    /// reply either ran out of keys or filled its frame; only asking again tells which,
    /// and an empty answer ends it.
    fn scan_rest(
        &self,
        node: NodeId,
        mut items: Vec<Item>,
        limit: usize,
    ) -> Result<Vec<Item>, ClientError> {
        while items.len() < limit {
            let Some(last) = items.last() else {
                break;
            };
            // The smallest key after `last`.
            let mut next = last.key.to_vec();
            next.push(0);
            if next.len() > KEY_BYTES_MAX {
                break;
            }
            let got = reply::items(self.call(
                node,
                Op::Scan {
                    start: Bytes::from(next),
                    limit: (limit - items.len()) as u32,
                },
            ))?;
            if got.is_empty() {
                break;
            }
            items.extend(got);
        }
        Ok(items)
    }

    // The async face.

    pub async fn get_async(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        no_key_is_none(reply::object(self.submit_get(key)?.await))
    }

    pub async fn put_async(&self, key: &[u8], value: impl Into<Bytes>) -> Result<u64, ClientError> {
        reply::version(self.submit_put(key, value.into())?.await)
    }

    pub async fn cas_put_async(
        &self,
        key: &[u8],
        expected_version: u64,
        value: impl Into<Bytes>,
    ) -> Result<CasOutcome, ClientError> {
        cas_outcome(self.submit_cas(key, expected_version, value.into())?.await)
    }

    pub async fn delete_async(&self, key: &[u8]) -> Result<Option<u64>, ClientError> {
        no_key_is_none(reply::version(self.submit_delete(key)?.await))
    }
}

/// Merges per-node runs (each already in key order) and keeps the first `limit`.
pub fn merge_in_key_order(runs: Vec<Vec<Item>>, limit: usize) -> Vec<Item> {
    let mut iters: Vec<_> = runs.into_iter().map(Vec::into_iter).collect();
    let mut heads = BinaryHeap::new();
    let mut current: Vec<Option<Item>> = Vec::with_capacity(iters.len());
    for (i, it) in iters.iter_mut().enumerate() {
        let head = it.next();
        if let Some(item) = &head {
            heads.push(Reverse((item.key.clone(), i)));
        }
        current.push(head);
    }
    let mut out = Vec::with_capacity(limit.min(SCAN_ITEMS_MAX));
    while out.len() < limit {
        let Some(Reverse((_, i))) = heads.pop() else {
            break;
        };
        let Some(item) = current[i].take() else {
            break;
        };
        out.push(item);
        current[i] = iters[i].next();
        if let Some(next) = &current[i] {
            heads.push(Reverse((next.key.clone(), i)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn item(key: &str) -> Item {
        Item {
            key: Bytes::copy_from_slice(key.as_bytes()),
            version: 1,
            value: Bytes::new(),
        }
    }

    proptest! {
        #[test]
        fn merging_sorted_runs_gives_the_first_keys_in_order(
            keys in proptest::collection::btree_set("[a-z]{1,6}", 0..60),
            runs in 1usize..5,
            limit in 0usize..80,
        ) {
            let keys: Vec<String> = keys.into_iter().collect();
            let mut split: Vec<Vec<Item>> = vec![Vec::new(); runs];
            for (i, k) in keys.iter().enumerate() {
                split[i % runs].push(item(k));
            }
            let merged: Vec<String> = merge_in_key_order(split, limit)
                .into_iter()
                .map(|it| String::from_utf8(it.key.to_vec()).unwrap())
                .collect();
            let expected: Vec<String> = keys.into_iter().take(limit).collect();
            prop_assert_eq!(merged, expected);
        }
    }
}
