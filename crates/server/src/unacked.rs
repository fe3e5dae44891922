//! Which keys hold a write their backups have not acknowledged, so that a primary never
//! serves such a write to a reader.
//!
//! **Why.** A primary applies a write before it copies the key to its backups. If it
//! answered a GET from that state and then died before the copy landed — or the copy was
//! refused (a backup already at a newer map epoch answers STALE_EPOCH) — the promoted
//! backup would not have the value a reader has already seen: a value read, then gone.
//! So a read of a key with an unacknowledged write waits until the backups have it
//! (or fails, retryable), and a write whose copy failed is sent again while this server
//! is still the key's primary ([`crate::replicate::Replicator`] does both).
//!
//! **How.** Every write that takes effect draws a ticket from one counter that only
//! grows. Per key, while it has anything unacknowledged: `writing`, the writes begun and
//! not yet settled (counted *before* they are applied, so a reader that sees a write's
//! effect also sees it counted); `applied`, the newest ticket of a write that took effect;
//! `acked`, the newest ticket a copy was known to cover when every backup confirmed it. A
//! copy's ticket is read *before* the key's state is read for the copy, so the copy holds
//! every write up to it. A key is settled — its present state is on every backup — when
//! nothing is being written and `acked ≥ applied`; then its entry goes. Tickets, not
//! per-key counts, because an entry goes and comes back: a late confirmation of a copy
//! taken before it went must not pass for one covering writes made after. Pure: no
//! sockets; tested below.

use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Keys that may hold unacknowledged writes at once. Past it, new writes to other keys
/// are refused (retryable) before they are applied: a backup that stays away while
/// clients write to ever new keys must not grow this table without end.
pub const UNACKED_KEYS_MAX: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{UNACKED_KEYS_MAX} keys are waiting for their backups; retry")]
pub struct Full;

#[derive(Debug, Default, Clone, Copy)]
struct KeyState {
    writing: u32,
    applied: u64,
    acked: u64,
}

impl KeyState {
    fn settled(&self) -> bool {
        self.writing == 0 && self.acked >= self.applied
    }
}

/// See the module documentation. Shared by the connections (writes, reads) and the
/// replication links (copies).
#[derive(Debug)]
pub struct Unacked {
    inner: Mutex<Inner>,
    keys_max: usize,
    settled: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Inner {
    keys: HashMap<Bytes, KeyState>,
    /// The last ticket drawn.
    tickets: u64,
}

impl Default for Unacked {
    fn default() -> Self {
        Unacked::with_limit(UNACKED_KEYS_MAX)
    }
}

impl Unacked {
    pub fn with_limit(keys_max: usize) -> Self {
        Unacked {
            inner: Mutex::new(Inner::default()),
            keys_max,
            settled: tokio::sync::Notify::new(),
        }
    }

    /// Called before a write to `key` is applied; the returned guard is told whether it
    /// took effect and is dropped when its replication has been settled (acknowledged or
    /// given up on).
    pub fn begin(self: &Arc<Self>, key: &Bytes) -> Result<Writing, Full> {
        let mut inner = self.inner.lock();
        let keys = &mut inner.keys;
        let at_limit = keys.len() >= self.keys_max;
        match keys.get_mut(key) {
            Some(s) => s.writing += 1,
            None if at_limit => return Err(Full),
            None => {
                keys.insert(
                    key.clone(),
                    KeyState {
                        writing: 1,
                        ..KeyState::default()
                    },
                );
            }
        }
        Ok(Writing {
            table: Arc::clone(self),
            key: key.clone(),
        })
    }

    /// Whether `key`'s present state is on every backup (a key with no entry is).
    pub fn is_settled(&self, key: &[u8]) -> bool {
        self.inner
            .lock()
            .keys
            .get(key)
            .is_none_or(KeyState::settled)
    }

    /// The ticket a copy of `key` read after this call covers (0: nothing to cover).
    pub fn copy_covers(&self, key: &[u8]) -> u64 {
        self.inner.lock().keys.get(key).map_or(0, |s| s.applied)
    }

    /// Every backup confirmed a copy of `key` covering `covers` writes.
    pub fn acked(&self, key: &[u8], covers: u64) {
        let mut inner = self.inner.lock();
        let keys = &mut inner.keys;
        let Some(s) = keys.get_mut(key) else {
            return;
        };
        s.acked = s.acked.max(covers);
        if s.settled() {
            keys.remove(key);
            drop(inner);
            self.settled.notify_waiters();
        }
    }

    /// `key` needs no backup any more (this server is its primary and the partition has
    /// none at the present epoch): its state is acknowledged as it stands.
    pub fn settle(&self, key: &[u8]) {
        let mut inner = self.inner.lock();
        let keys = &mut inner.keys;
        if let Some(s) = keys.get_mut(key) {
            if s.writing == 0 {
                keys.remove(key);
                drop(inner);
                self.settled.notify_waiters();
            }
        }
    }

    /// Keys whose writes are all done but not all acknowledged — a copy failed — at most
    /// `max` of them: what must be sent again.
    pub fn stalled(&self, max: usize) -> Vec<Bytes> {
        self.inner
            .lock()
            .keys
            .iter()
            .filter(|(_, s)| s.writing == 0 && s.acked < s.applied)
            .take(max)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Keys with an entry (for stats and tests).
    pub fn len(&self) -> usize {
        self.inner.lock().keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves at the next time some key becomes settled. Create it *before* checking
    /// [`Unacked::is_settled`], so a settlement in between is not missed.
    pub fn settled_notice(&self) -> tokio::sync::futures::Notified<'_> {
        self.settled.notified()
    }
}

/// One write to a key of a replicated partition, from before it is applied until its
/// replication is settled. Dropping it — the normal end, or a connection that went away —
/// ends the write's claim on its key; the key stays unsettled if the write took effect
/// and no copy covering it was acknowledged.
#[derive(Debug)]
pub struct Writing {
    table: Arc<Unacked>,
    key: Bytes,
}

impl Writing {
    pub fn key(&self) -> &Bytes {
        &self.key
    }

    /// The write took effect (call once, right after applying it).
    pub fn applied(&self) {
        let mut inner = self.table.inner.lock();
        inner.tickets += 1;
        let ticket = inner.tickets;
        if let Some(s) = inner.keys.get_mut(&self.key) {
            s.applied = ticket;
        }
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        let mut inner = self.table.inner.lock();
        let keys = &mut inner.keys;
        let Some(s) = keys.get_mut(&self.key) else {
            return;
        };
        s.writing = s.writing.saturating_sub(1);
        if s.settled() {
            keys.remove(&self.key);
            drop(inner);
            self.table.settled.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(k: &str) -> Bytes {
        Bytes::copy_from_slice(k.as_bytes())
    }

    #[test]
    fn a_write_is_unsettled_from_before_it_applies_until_a_covering_copy_is_acked() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        assert!(t.is_settled(&k));
        let w = t.begin(&k).unwrap();
        assert!(!t.is_settled(&k), "counted before it is applied");
        w.applied();
        // A copy read before the write applied covers nothing of it.
        t.acked(&k, 0);
        assert!(!t.is_settled(&k));
        let covers = t.copy_covers(&k);
        assert_eq!(covers, 1);
        t.acked(&k, covers);
        assert!(!t.is_settled(&k), "the write is still in progress");
        drop(w);
        assert!(t.is_settled(&k));
        assert!(t.is_empty());
    }

    #[test]
    fn a_failed_copy_leaves_the_key_stalled_until_a_copy_covers_it() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        let w = t.begin(&k).unwrap();
        w.applied();
        drop(w); // its replication failed: nothing acked
        assert!(!t.is_settled(&k));
        assert_eq!(t.stalled(10), vec![k.clone()]);
        let covers = t.copy_covers(&k);
        t.acked(&k, covers);
        assert!(t.is_settled(&k));
        assert!(t.stalled(10).is_empty());
    }

    #[test]
    fn a_write_that_did_not_apply_leaves_nothing_unsettled() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        drop(t.begin(&k).unwrap());
        assert!(t.is_settled(&k));
        assert!(t.is_empty());
    }

    #[test]
    fn settle_gives_up_only_on_keys_nobody_is_writing() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        let w = t.begin(&k).unwrap();
        w.applied();
        t.settle(&k);
        assert!(!t.is_settled(&k));
        drop(w);
        t.settle(&k);
        assert!(t.is_settled(&k));
    }

    #[test]
    fn the_table_is_bounded_but_a_key_in_it_can_always_be_written_again() {
        let t = Arc::new(Unacked::with_limit(2));
        let (a, b, c) = (key("a"), key("b"), key("c"));
        let wa = t.begin(&a).unwrap();
        let _wb = t.begin(&b).unwrap();
        assert_eq!(t.begin(&c).unwrap_err(), Full);
        let _wa2 = t.begin(&a).unwrap();
        drop(wa);
    }

    #[tokio::test]
    async fn a_waiter_hears_of_a_settlement() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        let w = t.begin(&k).unwrap();
        w.applied();
        let notice = t.settled_notice();
        let covers = t.copy_covers(&k);
        t.acked(&k, covers);
        drop(w);
        tokio::time::timeout(std::time::Duration::from_secs(5), notice)
            .await
            .expect("notified");
    }

    #[derive(Debug, Clone)]
    enum Step {
        Begin(u8),
        Apply(u8),
        End(u8),
        /// A link reads the count for key `.0`, then (later) the key's state.
        Copy(u8),
        /// Every backup confirms the `.0`-th copy still unconfirmed.
        Ack(u8),
        Read(u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..3).prop_map(Step::Begin),
            (0u8..3).prop_map(Step::Apply),
            (0u8..3).prop_map(Step::End),
            (0u8..3).prop_map(Step::Copy),
            (0u8..4).prop_map(Step::Ack),
            (0u8..3).prop_map(Step::Read),
        ]
    }

    proptest! {
        /// The safety property, against a model that knows each key's true history:
        /// whenever a read finds a key settled, the state the read sees (every write
        /// applied so far) is within a copy every backup has confirmed.
        #[test]
        fn a_settled_key_is_never_ahead_of_its_backups(steps in prop::collection::vec(step(), 1..120)) {
            let t = Arc::new(Unacked::default());
            // Per key: writes in progress (begun, maybe applied), applied writes so far,
            // the writes the newest confirmed copy holds.
            let mut writing: Vec<Vec<(Writing, bool)>> = (0..3).map(|_| Vec::new()).collect();
            let mut applied = [0u64; 3];
            let mut on_backup = [0u64; 3];
            let mut copies: Vec<(usize, u64, u64)> = Vec::new(); // key, covers, truly holds
            for s in steps {
                match s {
                    Step::Begin(k) => {
                        let k = k as usize;
                        writing[k].push((t.begin(&key(&k.to_string())).unwrap(), false));
                    }
                    Step::Apply(k) => {
                        let k = k as usize;
                        if let Some((w, done)) = writing[k].iter_mut().find(|(_, d)| !*d) {
                            w.applied();
                            *done = true;
                            applied[k] += 1;
                        }
                    }
                    Step::End(k) => {
                        let k = k as usize;
                        if !writing[k].is_empty() {
                            writing[k].remove(0);
                        }
                    }
                    Step::Copy(k) => {
                        let k = k as usize;
                        let covers = t.copy_covers(&key(&k.to_string()));
                        // The state is read after the count: it holds every write
                        // applied by now.
                        copies.push((k, covers, applied[k]));
                    }
                    Step::Ack(i) => {
                        if !copies.is_empty() {
                            let (k, covers, holds) = copies.remove(i as usize % copies.len());
                            on_backup[k] = on_backup[k].max(holds);
                            t.acked(&key(&k.to_string()), covers);
                        }
                    }
                    Step::Read(k) => {
                        let k = k as usize;
                        if t.is_settled(&key(&k.to_string())) {
                            prop_assert!(
                                on_backup[k] >= applied[k],
                                "key {k} settled with {} applied but {} on the backup",
                                applied[k], on_backup[k]
                            );
                        }
                    }
                }
            }
        }
    }
}
