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
//! taken before it went must not pass for one covering writes made after.
//!
//! **A write whose copy failed** (a backup at a newer epoch refused it) does not have to
//! fail: its answer waits, within the replication timeout, for the repair's copy to cover
//! its ticket — acknowledged then, since every backup of the map this server is still
//! primary under has it — or for the key to be given up (the server was deposed), when
//! it fails as before. Pure: no sockets; tested below.

use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Keys that may hold unacknowledged writes at once. Past it, new writes to other keys
/// are refused (retryable) before they are applied: a backup that stays away while
/// clients write to ever new keys must not grow this table without end.
pub const UNACKED_KEYS_MAX: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{UNACKED_KEYS_MAX} keys are waiting for their backups; retry")]
pub struct Full;

#[derive(Debug, Default)]
struct KeyState {
    writing: u32,
    applied: u64,
    acked: u64,
    /// Writes whose own copy failed and whose answers wait for a later one to cover them
    /// ([`Unacked::await_cover`]): each leaves when its outcome is known or it is dropped.
    waiters: Vec<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    ticket: u64,
    outcome: Arc<OnceLock<bool>>,
}

impl KeyState {
    fn settled(&self) -> bool {
        self.writing == 0 && self.acked >= self.applied
    }

    /// Tells the waiters a copy covering `acked` reached every backup; true if any heard.
    fn covered_through(&mut self, acked: u64) -> bool {
        let before = self.waiters.len();
        self.waiters.retain(|w| {
            if w.ticket <= acked {
                let _ = w.outcome.set(true);
                false
            } else {
                true
            }
        });
        self.waiters.len() != before
    }

    /// Tells every waiter how the key ended.
    fn end_waiters(&mut self, acknowledged: bool) {
        for w in self.waiters.drain(..) {
            let _ = w.outcome.set(acknowledged);
        }
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
    /// The last waiter id handed out.
    waiter_ids: u64,
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
            ticket: 0,
        })
    }

    /// A write to `key` that took effect with `ticket` and whose copy failed: the returned
    /// [`Cover`] learns whether a later copy covered it on every backup (it may then be
    /// acknowledged) or the key was let go without one ([`Unacked::give_up`]). Call it
    /// while the write's [`Writing`] is held, so the key cannot have been let go before.
    pub fn await_cover(self: &Arc<Self>, key: &Bytes, ticket: u64) -> Cover {
        let outcome = Arc::new(OnceLock::new());
        let mut inner = self.inner.lock();
        inner.waiter_ids += 1;
        let id = inner.waiter_ids;
        match inner.keys.get_mut(key) {
            Some(s) if s.acked < ticket => s.waiters.push(Waiter {
                id,
                ticket,
                outcome: Arc::clone(&outcome),
            }),
            // Settled since: a copy covering it was acknowledged.
            _ => {
                let _ = outcome.set(true);
            }
        }
        Cover {
            table: Arc::clone(self),
            key: key.clone(),
            id,
            outcome,
        }
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
        let heard = s.covered_through(s.acked);
        if s.settled() {
            keys.remove(key);
        } else if !heard {
            return;
        }
        drop(inner);
        self.settled.notify_waiters();
    }

    /// `key` needs no backup any more (this server is its primary and the partition has
    /// none at the present epoch): its state is acknowledged as it stands.
    pub fn settle(&self, key: &[u8]) {
        self.end(key, true);
    }

    /// `key` is no longer this server's (another is its primary, or there is no map):
    /// its claim goes, and the writes waiting for a copy are not acknowledged.
    pub fn give_up(&self, key: &[u8]) {
        self.end(key, false);
    }

    fn end(&self, key: &[u8], acknowledged: bool) {
        let mut inner = self.inner.lock();
        let keys = &mut inner.keys;
        if let Some(s) = keys.get_mut(key) {
            if s.writing == 0 {
                s.end_waiters(acknowledged);
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

    /// Resolves at the next time some key becomes settled or a [`Cover`] learns its
    /// outcome. Create it *before* checking
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
    /// The write's ticket once it took effect (0 before).
    ticket: u64,
}

impl Writing {
    pub fn key(&self) -> &Bytes {
        &self.key
    }

    /// The write's ticket, once it took effect.
    pub fn ticket(&self) -> Option<u64> {
        (self.ticket != 0).then_some(self.ticket)
    }

    /// The write took effect (call once, right after applying it).
    pub fn applied(&mut self) {
        let mut inner = self.table.inner.lock();
        inner.tickets += 1;
        let ticket = inner.tickets;
        if let Some(s) = inner.keys.get_mut(&self.key) {
            s.applied = ticket;
        }
        self.ticket = ticket;
    }
}

/// A failed write's wait for a later copy to cover it ([`Unacked::await_cover`]).
/// Dropping it withdraws the wait, so waits of answers given up on do not pile up on a
/// key that never settles.
#[derive(Debug)]
pub struct Cover {
    table: Arc<Unacked>,
    key: Bytes,
    id: u64,
    outcome: Arc<OnceLock<bool>>,
}

impl Cover {
    /// `Some(true)`: every backup has the write (acknowledge it); `Some(false)`: the key
    /// was let go without that; `None`: not known yet.
    pub fn outcome(&self) -> Option<bool> {
        self.outcome.get().copied()
    }
}

impl Drop for Cover {
    fn drop(&mut self) {
        if self.outcome.get().is_some() {
            return;
        }
        let mut inner = self.table.inner.lock();
        if let Some(s) = inner.keys.get_mut(&self.key) {
            s.waiters.retain(|w| w.id != self.id);
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
            // Every waiter's ticket is at most `applied`, which `acked` covers.
            let acked = s.acked;
            s.covered_through(acked);
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

    /// A write to `k` that took effect, its claim still held.
    fn applied(t: &Arc<Unacked>, k: &Bytes) -> Writing {
        let mut w = t.begin(k).unwrap();
        w.applied();
        w
    }

    /// A write to `k` that took effect and whose own copy failed: its answer's wait.
    fn failed(t: &Arc<Unacked>, k: &Bytes) -> Cover {
        let w = applied(t, k);
        t.await_cover(k, w.ticket().unwrap())
    }

    #[test]
    fn a_write_is_unsettled_from_before_it_applies_until_a_covering_copy_is_acked() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        assert!(t.is_settled(&k));
        let mut w = t.begin(&k).unwrap();
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
        let w = applied(&t, &k);
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
        let w = applied(&t, &k);
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

    #[test]
    fn a_failed_write_is_acknowledged_once_a_later_copy_covers_it() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        let cover = failed(&t, &k);
        assert_eq!(cover.outcome(), None);
        // A second write beside it: the key stays unsettled, but a copy that covers the
        // first write is enough for the first write's answer.
        let first = t.copy_covers(&k);
        let w2 = applied(&t, &k);
        t.acked(&k, first);
        assert_eq!(cover.outcome(), Some(true));
        assert!(!t.is_settled(&k));
        drop(w2);
    }

    #[test]
    fn a_failed_write_is_not_acknowledged_when_its_key_is_given_up() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        let w = applied(&t, &k);
        let cover = t.await_cover(&k, w.ticket().unwrap());
        // A copy taken before the write covers nothing of it.
        t.acked(&k, 0);
        assert_eq!(cover.outcome(), None);
        drop(w);
        t.give_up(&k);
        assert_eq!(cover.outcome(), Some(false));
        assert!(t.is_settled(&k), "a given-up key is no longer held");
        // The same with a partition that needs no backup any more: acknowledged.
        let cover = failed(&t, &k);
        t.settle(&k);
        assert_eq!(cover.outcome(), Some(true));
    }

    #[test]
    fn a_dropped_cover_leaves_no_waiter_behind() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        let w = applied(&t, &k);
        let ticket = w.ticket().unwrap();
        let covers: Vec<Cover> = (0..3).map(|_| t.await_cover(&k, ticket)).collect();
        drop(w);
        assert_eq!(t.inner.lock().keys[&k].waiters.len(), 3);
        drop(covers);
        assert_eq!(t.inner.lock().keys[&k].waiters.len(), 0);
        // Registered after a covering copy was confirmed: known at once.
        let covers_now = t.copy_covers(&k);
        let mut w = t.begin(&k).unwrap();
        t.acked(&k, covers_now);
        assert_eq!(t.await_cover(&k, ticket).outcome(), Some(true));
        w.applied();
        drop(w);
    }

    #[tokio::test]
    async fn a_waiter_hears_of_a_settlement() {
        let t = Arc::new(Unacked::default());
        let k = key("k");
        let w = applied(&t, &k);
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
        /// The key's first write in progress ends with its copy failed: its answer
        /// waits for a later copy ([`Unacked::await_cover`]).
        Fail(u8),
        /// The server is deposed for the key.
        GiveUp(u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..3).prop_map(Step::Begin),
            (0u8..3).prop_map(Step::Apply),
            (0u8..3).prop_map(Step::End),
            (0u8..3).prop_map(Step::Copy),
            (0u8..4).prop_map(Step::Ack),
            (0u8..3).prop_map(Step::Read),
            (0u8..3).prop_map(Step::Fail),
            (0u8..3).prop_map(Step::GiveUp),
        ]
    }

    proptest! {
        /// The safety property, against a model that knows each key's true history:
        /// whenever a read finds a key settled, the state the read sees (every write
        /// applied so far) is within a copy every backup has confirmed; and a failed
        /// write whose answer is told "acknowledged" is within one too.
        #[test]
        fn a_settled_key_is_never_ahead_of_its_backups(steps in prop::collection::vec(step(), 1..120)) {
            let t = Arc::new(Unacked::default());
            // Per key: writes in progress (begun, maybe applied), applied writes so far,
            // the writes the newest confirmed copy holds.
            // A write in progress: its claim and, once applied, its number on its key.
            let mut writing: Vec<Vec<(Writing, Option<u64>)>> = (0..3).map(|_| Vec::new()).collect();
            let mut waiting: Vec<(usize, u64, Cover)> = Vec::new();
            // Keys this server was deposed for: it neither reads nor writes them again.
            let mut deposed = [false; 3];
            let mut applied = [0u64; 3];
            let mut on_backup = [0u64; 3];
            let mut copies: Vec<(usize, u64, u64)> = Vec::new(); // key, covers, truly holds
            for s in steps {
                match s {
                    Step::Begin(k) if deposed[k as usize] => {}
                    Step::Begin(k) => {
                        let k = k as usize;
                        writing[k].push((t.begin(&key(&k.to_string())).unwrap(), None));
                    }
                    Step::Apply(k) => {
                        let k = k as usize;
                        if let Some((w, n)) = writing[k].iter_mut().find(|(_, n)| n.is_none()) {
                            w.applied();
                            applied[k] += 1;
                            *n = Some(applied[k]);
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
                        if !deposed[k] && t.is_settled(&key(&k.to_string())) {
                            prop_assert!(
                                on_backup[k] >= applied[k],
                                "key {k} settled with {} applied but {} on the backup",
                                applied[k], on_backup[k]
                            );
                        }
                    }
                    Step::Fail(k) => {
                        let k = k as usize;
                        if !writing[k].is_empty() {
                            let (w, n) = writing[k].remove(0);
                            if let (Some(n), Some(ticket)) = (n, w.ticket()) {
                                waiting.push((k, n, t.await_cover(&key(&k.to_string()), ticket)));
                            }
                        }
                    }
                    Step::GiveUp(k) => {
                        let k = k as usize;
                        // Deposal takes effect once no write is in progress.
                        if writing[k].is_empty() {
                            t.give_up(&key(&k.to_string()));
                            deposed[k] = true;
                        }
                    }
                }
                for (k, n, cover) in &waiting {
                    if cover.outcome() == Some(true) {
                        prop_assert!(
                            on_backup[*k] >= *n,
                            "write {n} of key {k} acknowledged with {} on the backup",
                            on_backup[*k]
                        );
                    }
                }
            }
        }
    }
}
