//! What every connection of one server shares: the store, the counters, the epoch.

use crate::budget::MemoryBudget;
use crate::objects::ObjectStore;
use crate::ownership::Ownership;
use crate::store::{Quota, RegionStore};
use camelot_proto::OpKind;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) const OP_KINDS: usize = OpKind::ALL.len();

/// The Redis port's command groups (`resp::commands::Group`, in that order): each has an
/// `ops_resp_<group>` counter next to the native `ops_<kind>` ones, so "ops served"
/// shows Redis-port traffic too.
pub const RESP_GROUPS: [&str; 8] = [
    "strings", "hashes", "lists", "sets", "zsets", "keys", "server", "camelot",
];

/// Whether a server with (`token_set`) or without a token, listening on `listen`, serves
/// anyone beyond this machine: no token and any address that is not loopback (an
/// unspecified address such as 0.0.0.0 listens on every interface).
pub fn exposed_without_token(
    token_set: bool,
    listen: impl IntoIterator<Item = std::net::SocketAddr>,
) -> bool {
    !token_set && listen.into_iter().any(|a| !a.ip().is_loopback())
}

/// The STATS counter that is 1 when the server listens beyond loopback with no token.
pub const STAT_EXPOSED_WITHOUT_TOKEN: &str = "exposed_without_token";

/// Position of `kind` in [`OpKind::ALL`] (wire codes are 1-based and dense).
pub(crate) fn kind_index(kind: OpKind) -> usize {
    kind as usize - 1
}

/// Counters STATS reports. Updated once per batch or per socket read/write, never per
/// request, so connections on different cores do not fight over these cache lines.
#[derive(Debug, Default)]
pub struct Stats {
    connections_current: AtomicU64,
    connections_total: AtomicU64,
    connections_refused: AtomicU64,
    /// Fenceable sessions closed (or refused at HELLO) because a FENCE passed them.
    sessions_fenced: AtomicU64,
    /// Batches routed at an epoch this server had not installed yet, which waited for it.
    batches_ahead_of_epoch: AtomicU64,
    /// Client batches (of a primary) whose copies to a backup failed at first.
    replica_copies_failed: AtomicU64,
    /// Of those, the batches acknowledged by the writer's own resend at the next map.
    replica_resends_acknowledged: AtomicU64,
    /// Writes answered REPLICA_UNAVAILABLE: applied here, never acknowledged.
    replica_writes_failed: AtomicU64,
    /// Movers' pages this server pushed to their target (SCAN_PARTITIONS' `push_to`)
    /// and the target applied, the copies in them, and the pages it did not.
    pages_pushed: AtomicU64,
    copies_pushed: AtomicU64,
    pages_push_failed: AtomicU64,
    /// Connections that have not yet authenticated (native: no HELLO yet; Redis port with
    /// a token: no successful AUTH yet). Kept apart so they cannot crowd out real clients.
    connections_unauthenticated: AtomicU64,
    batches: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    resp_commands: AtomicU64,
    ops: [AtomicU64; OP_KINDS],
    resp_ops: [AtomicU64; RESP_GROUPS.len()],
}

/// Why [`Stats::try_admit`] turned a connection away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `connections_max` connections are open.
    Full,
    /// `unauthenticated_connections_max` connections have not authenticated yet.
    TooManyUnauthenticated,
}

impl Stats {
    /// Counts a new connection in, unless that would pass `connections_max` or (for one
    /// that still has to authenticate) `unauthenticated_max`. Both checks and increments
    /// are atomic, so accept loops on several threads cannot overshoot together.
    pub fn try_admit(
        &self,
        connections_max: usize,
        unauthenticated_max: usize,
        unauthenticated: bool,
    ) -> Result<(), Refusal> {
        let bounded_inc = |counter: &AtomicU64, max: usize| {
            counter
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max as u64).then_some(n + 1)
                })
                .is_ok()
        };
        if unauthenticated && !bounded_inc(&self.connections_unauthenticated, unauthenticated_max) {
            return Err(Refusal::TooManyUnauthenticated);
        }
        if !bounded_inc(&self.connections_current, connections_max) {
            if unauthenticated {
                self.connections_unauthenticated
                    .fetch_sub(1, Ordering::AcqRel);
            }
            return Err(Refusal::Full);
        }
        self.connections_total.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    pub fn connection_opened(&self) {
        self.connections_current.fetch_add(1, Ordering::Relaxed);
        self.connections_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connection_closed(&self) {
        self.connections_current.fetch_sub(1, Ordering::Relaxed);
    }

    /// An admitted unauthenticated connection authenticated or closed.
    pub fn unauthenticated_left(&self) {
        self.connections_unauthenticated
            .fetch_sub(1, Ordering::AcqRel);
    }

    pub fn connections_unauthenticated(&self) -> u64 {
        self.connections_unauthenticated.load(Ordering::Acquire)
    }

    pub fn session_fenced(&self) {
        self.sessions_fenced.fetch_add(1, Ordering::Relaxed);
    }

    pub fn batch_ahead_of_epoch(&self) {
        self.batches_ahead_of_epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// A batch's copies failed; `resent`: the writer's resend then acknowledged them.
    pub fn replica_copies_failed(&self, resent: bool) {
        self.replica_copies_failed.fetch_add(1, Ordering::Relaxed);
        if resent {
            self.replica_resends_acknowledged
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn replica_writes_failed(&self, writes: u64) {
        self.replica_writes_failed
            .fetch_add(writes, Ordering::Relaxed);
    }

    /// A pushed page of `copies` copies: applied by its target, or not.
    pub fn page_pushed(&self, copies: u64, applied: bool) {
        if applied {
            self.pages_pushed.fetch_add(1, Ordering::Relaxed);
            self.copies_pushed.fetch_add(copies, Ordering::Relaxed);
        } else {
            self.pages_push_failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn connection_refused(&self) {
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connections_current(&self) -> u64 {
        self.connections_current.load(Ordering::Relaxed)
    }

    pub fn add_bytes_in(&self, bytes: usize) {
        self.bytes_in.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn add_bytes_out(&self, bytes: usize) {
        self.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts one batch whose requests, by kind, are `ops` (indexed like [`OpKind::ALL`]).
    pub fn add_batch(&self, ops: &[u64; OP_KINDS]) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        for (counter, &n) in self.ops.iter().zip(ops) {
            if n != 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Counts `n` Redis-port commands, `by_group` of them per [`RESP_GROUPS`] entry.
    pub fn add_resp_commands(&self, n: u64, by_group: &[u64; RESP_GROUPS.len()]) {
        if n > 0 {
            self.resp_commands.fetch_add(n, Ordering::Relaxed);
        }
        for (counter, &k) in self.resp_ops.iter().zip(by_group) {
            if k != 0 {
                counter.fetch_add(k, Ordering::Relaxed);
            }
        }
    }

    pub fn ops(&self, kind: OpKind) -> u64 {
        self.ops[kind_index(kind)].load(Ordering::Relaxed)
    }
}

/// A server's first fence generation; 0 in a HELLO means "whatever it is now".
pub const FENCE_GENERATION_FIRST: u64 = 1;

pub struct ServerState {
    /// What connections' input and output buffers may hold together: a budget of its
    /// own beside the data's, so heavy traffic never makes an ALLOC fail and a full store
    /// never leaves a connection without room to answer.
    connection_buffers: Arc<MemoryBudget>,
    store: RegionStore,
    objects: ObjectStore,
    stats: Stats,
    epoch: AtomicU64,
    /// The partitions this server owns, when it is a member of a cluster whose map it
    /// follows; its epoch is the server's epoch while it is set.
    ownership: parking_lot::RwLock<Option<Arc<Ownership>>>,
    /// Woken each time a newer ownership is installed (the replication repair waits on
    /// it: a copy refused for a stale epoch goes again as soon as this server has caught
    /// up, not a whole repair interval later).
    ownership_changed: tokio::sync::Notify,
    /// Listening beyond loopback with no token: anyone who can reach the port is served.
    /// Shown in STATS so `camelot stats` can warn long after the start-up log scrolled by.
    exposed_without_token: AtomicBool,
    /// `--ops-per-sec-max`, set once at start; unset costs one atomic load per batch.
    throttle: std::sync::OnceLock<parking_lot::Mutex<crate::throttle::TokenBucket>>,
    /// Per partition of the installed map, the highest version of a copy (APPLY) this
    /// server has received: what tells the controller which backup of a dead primary is
    /// the most up to date. Sized by the first ownership installed (empty before).
    applied: parking_lot::RwLock<Arc<[AtomicU64]>>,
    /// Nanoseconds batches spent waiting on the `--ops-per-sec-max` throttle: how close a
    /// throttled node is to its limit, for the controller's load weights.
    throttled_ns: AtomicU64,
    /// Keys with a write its backups have not acknowledged: never served to a reader
    /// while so (see [`crate::unacked`]).
    unacked: Arc<crate::unacked::Unacked>,
    /// Fenceable sessions (`Hello::fence`): each of their batches runs holding a read
    /// guard of this lock and only if it still holds the session's generation; a FENCE
    /// takes it for writing (so it waits for the batches running) and moves the
    /// generation on (so no later batch of theirs runs). Tokio's lock is fair: sessions
    /// arriving behind a waiting fence cannot starve it.
    fences: Arc<tokio::sync::RwLock<u64>>,
    /// The generation in `fences`, for readers that must not wait on the lock.
    fence_generation: AtomicU64,
}

impl ServerState {
    /// A state whose connection buffers are not capped (embedding and tests; the server
    /// uses [`ServerState::with_limits`]).
    pub fn new(budget: Arc<MemoryBudget>, epoch: u64) -> Self {
        Self::with_limits(budget, MemoryBudget::new(u64::MAX), epoch, Quota::UNLIMITED)
    }

    /// A state with a connection-buffer budget of its own and regions bounded per
    /// principal by `quota`.
    pub fn with_limits(
        budget: Arc<MemoryBudget>,
        connection_buffers: Arc<MemoryBudget>,
        epoch: u64,
        quota: Quota,
    ) -> Self {
        ServerState {
            connection_buffers,
            objects: ObjectStore::new(Arc::clone(&budget)),
            store: RegionStore::with_quota(budget, quota),
            stats: Stats::default(),
            epoch: AtomicU64::new(epoch),
            ownership: parking_lot::RwLock::new(None),
            ownership_changed: tokio::sync::Notify::new(),
            exposed_without_token: AtomicBool::new(false),
            throttle: std::sync::OnceLock::new(),
            applied: parking_lot::RwLock::new(Arc::new([])),
            throttled_ns: AtomicU64::new(0),
            unacked: Arc::new(crate::unacked::Unacked::default()),
            fences: Arc::new(tokio::sync::RwLock::new(FENCE_GENERATION_FIRST)),
            fence_generation: AtomicU64::new(FENCE_GENERATION_FIRST),
        }
    }

    /// The fence generation now: what a session joining with `Hello::fence == Some(0)`
    /// is given.
    pub fn fence_generation(&self) -> u64 {
        self.fence_generation.load(Ordering::Acquire)
    }

    /// Ends every fenceable session: returns once no batch of theirs is running, with
    /// the new generation, under which none of theirs will run again.
    pub async fn fence(&self) -> u64 {
        let mut generation = self.fences.write().await;
        *generation += 1;
        self.fence_generation.store(*generation, Ordering::Release);
        *generation
    }

    /// For a session of `generation`: a guard to hold while its batch runs, or `None`
    /// once a fence has passed it.
    pub async fn unfenced(
        &self,
        generation: u64,
    ) -> Option<tokio::sync::OwnedRwLockReadGuard<u64>> {
        let now = Arc::clone(&self.fences).read_owned().await;
        (*now == generation).then_some(now)
    }

    /// See [`crate::unacked`].
    pub fn unacked(&self) -> &Arc<crate::unacked::Unacked> {
        &self.unacked
    }

    pub fn set_exposed_without_token(&self, exposed: bool) {
        self.exposed_without_token.store(exposed, Ordering::Relaxed);
    }

    /// Limits executed operations to `ops_per_sec` from now on; a second call is ignored
    /// (the limit is a start-up setting).
    pub fn set_ops_per_sec_max(&self, ops_per_sec: u64) {
        let bucket = crate::throttle::TokenBucket::new(ops_per_sec, std::time::Instant::now());
        let _ = self.throttle.set(parking_lot::Mutex::new(bucket));
    }

    /// How long to wait before executing `ops` operations (zero when unthrottled); the
    /// wait is counted in [`ServerState::throttled_ns`].
    pub fn throttle_wait(&self, ops: u64) -> std::time::Duration {
        let wait = match self.throttle.get() {
            None => std::time::Duration::ZERO,
            Some(bucket) => bucket.lock().take(ops, std::time::Instant::now()),
        };
        if !wait.is_zero() {
            let ns = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
            self.throttled_ns.fetch_add(ns, Ordering::Relaxed);
        }
        wait
    }

    /// Nanoseconds batches have waited on the throttle since start (summed over
    /// connections, so it can grow faster than the clock when several wait at once).
    pub fn throttled_ns(&self) -> u64 {
        self.throttled_ns.load(Ordering::Relaxed)
    }

    /// The configured `--ops-per-sec-max`, if any.
    pub fn ops_per_sec_max(&self) -> Option<u64> {
        self.throttle.get().map(|b| b.lock().ops_per_sec())
    }

    /// Records that a copy of `key` at `version` was applied (see `applied`).
    pub fn note_applied(&self, key: &[u8], version: u64) {
        let marks = self.applied.read();
        if marks.is_empty() {
            return;
        }
        let p = camelot_proto::partition_of(key, marks.len() as u32) as usize;
        if let Some(m) = marks.get(p) {
            m.fetch_max(version, Ordering::Relaxed);
        }
    }

    /// The partitions this server has received copies for, with the highest version of
    /// each, ascending by partition.
    pub fn applied_marks(&self) -> Vec<(u32, u64)> {
        self.applied
            .read()
            .iter()
            .enumerate()
            .filter_map(|(p, m)| {
                let v = m.load(Ordering::Relaxed);
                (v > 0).then_some((p as u32, v))
            })
            .collect()
    }

    pub fn exposed_without_token(&self) -> bool {
        self.exposed_without_token.load(Ordering::Relaxed)
    }

    pub fn store(&self) -> &RegionStore {
        &self.store
    }

    pub fn objects(&self) -> &ObjectStore {
        &self.objects
    }

    /// The objects before the state is shared (to set up the store's indexes).
    pub fn objects_mut(&mut self) -> &mut ObjectStore {
        &mut self.objects
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn budget(&self) -> &Arc<MemoryBudget> {
        self.store.budget()
    }

    /// The budget every connection's I/O buffers are charged to.
    pub fn connection_buffers(&self) -> &Arc<MemoryBudget> {
        &self.connection_buffers
    }

    /// The cluster-map epoch batches are checked against (0 in a batch skips the check).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Release);
        // Batches routed at this epoch may be waiting for it (`epoch_reached`).
        self.ownership_changed.notify_waiters();
    }

    /// The partitions this server owns, if it follows a cluster map.
    pub fn ownership(&self) -> Option<Arc<Ownership>> {
        self.ownership.read().clone()
    }

    /// The ownership, held: [`ServerState::set_ownership`] waits until every guard taken
    /// before it is dropped. `exec` holds one for a whole batch, so once a new ownership
    /// is installed (and STATS shows its epoch) no batch routed by the old one is still
    /// running — what lets a partition move fence the old owner and then copy, knowing
    /// no acknowledged write can land behind the copy. Never take a second one on the same
    /// thread while holding one (a waiting writer would deadlock it).
    pub fn ownership_held(&self) -> parking_lot::RwLockReadGuard<'_, Option<Arc<Ownership>>> {
        self.ownership.read()
    }

    /// Installs the ownership of a newer map (and its epoch). One of an epoch not above
    /// the current one is ignored (a late or repeated watch event must not roll the
    /// server back); false then.
    pub fn set_ownership(&self, ownership: Ownership) -> bool {
        let mut slot = self.ownership.write();
        let current = slot.as_ref().map_or(self.epoch(), |o| o.epoch());
        if ownership.epoch() <= current && slot.is_some() {
            return false;
        }
        if self.applied.read().len() != ownership.partitions() as usize {
            let fresh: Vec<AtomicU64> = (0..ownership.partitions())
                .map(|_| AtomicU64::new(0))
                .collect();
            *self.applied.write() = fresh.into();
        }
        // Before any batch can run under it (the write lock is held): a new primary's
        // first write already supersedes whatever its predecessor left on its backups.
        if ownership.gains_primaries_over(slot.as_deref()) {
            self.objects
                .skip_versions(crate::objects::PROMOTION_VERSION_GAP);
        }
        self.epoch.store(ownership.epoch(), Ordering::Release);
        *slot = Some(Arc::new(ownership));
        drop(slot);
        self.ownership_changed.notify_waiters();
        true
    }

    /// Returns true once the server's epoch is at least `epoch`, false if it is not
    /// after `wait_max`.
    pub async fn epoch_reached(&self, epoch: u64, wait_max: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + wait_max;
        loop {
            let now = self.epoch();
            if now >= epoch {
                return true;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            self.epoch_moved_on(now, left).await;
        }
    }

    /// Returns once the server's epoch is not `epoch`, or after `wait_max`.
    pub async fn epoch_moved_on(&self, epoch: u64, wait_max: std::time::Duration) {
        let deadline = tokio::time::sleep(wait_max);
        tokio::pin!(deadline);
        loop {
            let changed = self.ownership_changed.notified();
            tokio::pin!(changed);
            // Registered before the epoch is read, so an install between the two still
            // wakes this wait.
            changed.as_mut().enable();
            if self.epoch() != epoch {
                return;
            }
            tokio::select! {
                _ = &mut deadline => return,
                _ = changed => {}
            }
        }
    }

    /// The counters STATS returns, in a fixed order.
    pub fn stats_snapshot(&self) -> Vec<(String, u64)> {
        let s = &self.stats;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = Vec::with_capacity(16 + OP_KINDS + RESP_GROUPS.len());
        out.push(("memory_used_bytes".to_owned(), self.budget().used()));
        out.push(("memory_cap_bytes".to_owned(), self.budget().cap()));
        out.push(("regions".to_owned(), self.store.len() as u64));
        out.push(("objects".to_owned(), self.objects.len() as u64));
        out.push((
            "connections_current".to_owned(),
            load(&s.connections_current),
        ));
        out.push(("connections_total".to_owned(), load(&s.connections_total)));
        out.push((
            "connections_refused".to_owned(),
            load(&s.connections_refused),
        ));
        out.push(("sessions_fenced".to_owned(), load(&s.sessions_fenced)));
        out.push((
            "batches_ahead_of_epoch".to_owned(),
            load(&s.batches_ahead_of_epoch),
        ));
        out.push((
            "replica_copies_failed".to_owned(),
            load(&s.replica_copies_failed),
        ));
        out.push((
            "replica_resends_acknowledged".to_owned(),
            load(&s.replica_resends_acknowledged),
        ));
        out.push((
            "replica_writes_failed".to_owned(),
            load(&s.replica_writes_failed),
        ));
        out.push(("pages_pushed".to_owned(), load(&s.pages_pushed)));
        out.push(("copies_pushed".to_owned(), load(&s.copies_pushed)));
        out.push(("pages_push_failed".to_owned(), load(&s.pages_push_failed)));
        out.push(("fence_generation".to_owned(), self.fence_generation()));
        out.push((
            "connections_unauthenticated".to_owned(),
            load(&s.connections_unauthenticated),
        ));
        out.push((
            "connection_buffers_used_bytes".to_owned(),
            self.connection_buffers.used(),
        ));
        out.push((
            "connection_buffers_cap_bytes".to_owned(),
            self.connection_buffers.cap(),
        ));
        out.push(("batches".to_owned(), load(&s.batches)));
        out.push(("bytes_in".to_owned(), load(&s.bytes_in)));
        out.push(("bytes_out".to_owned(), load(&s.bytes_out)));
        out.push(("epoch".to_owned(), self.epoch()));
        // Keys whose latest write is not yet on every backup (reads of them wait).
        out.push(("unacked_keys".to_owned(), self.unacked.len() as u64));
        // 1 on a cluster member: its SCAN_PARTITIONS reads only the partitions asked for.
        out.push((
            "partition_index".to_owned(),
            u64::from(self.objects.partition_indexed()),
        ));
        out.push(("resp_commands".to_owned(), load(&s.resp_commands)));
        out.push((
            STAT_EXPOSED_WITHOUT_TOKEN.to_owned(),
            u64::from(self.exposed_without_token()),
        ));
        for kind in OpKind::ALL {
            out.push((format!("ops_{}", kind.name()), s.ops(kind)));
        }
        for (name, counter) in RESP_GROUPS.iter().zip(&s.resp_ops) {
            out.push((format!("ops_resp_{name}"), load(counter)));
        }
        out
    }
}

#[cfg(test)]
mod exposure_tests {
    use super::exposed_without_token;
    use std::net::SocketAddr;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    // Pure: no socket is bound to any of these addresses.
    #[test]
    fn only_a_tokenless_server_beyond_loopback_is_exposed() {
        assert!(!exposed_without_token(false, [a("127.0.0.1:7070")]));
        assert!(!exposed_without_token(false, [a("127.8.9.10:1")]));
        assert!(!exposed_without_token(false, [a("[::1]:7070")]));
        assert!(exposed_without_token(false, [a("0.0.0.0:7070")]));
        assert!(exposed_without_token(false, [a("[::]:7070")]));
        assert!(exposed_without_token(false, [a("10.0.0.5:7070")]));
        // The Redis port counts too.
        assert!(exposed_without_token(
            false,
            [a("127.0.0.1:7070"), a("0.0.0.0:6380")]
        ));
        assert!(!exposed_without_token(
            true,
            [a("0.0.0.0:7070"), a("0.0.0.0:6380")]
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_proto::limits::{STATS_ENTRIES_MAX, STAT_NAME_BYTES_MAX};

    #[tokio::test]
    async fn an_epoch_wait_ends_at_the_next_install_or_at_its_limit() {
        use std::time::Duration;
        let st = Arc::new(ServerState::new(MemoryBudget::new(1 << 20), 0));
        let own = |epoch| Ownership::new(epoch, vec![true; 4]).unwrap();
        assert!(st.set_ownership(own(10)));
        let bound = Duration::from_secs(10);
        let hour = Duration::from_secs(3600);
        // Already past the epoch asked about: no wait.
        tokio::time::timeout(bound, st.epoch_moved_on(9, hour))
            .await
            .expect("the epoch had already moved on");
        // Woken by the install, not by its hour-long limit.
        let waiting = tokio::spawn({
            let st = Arc::clone(&st);
            async move { st.epoch_moved_on(10, hour).await }
        });
        // On this one-thread runtime, the waiter runs up to its wait meanwhile.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished());
        assert!(st.set_ownership(own(11)));
        tokio::time::timeout(bound, waiting)
            .await
            .expect("the install woke the wait")
            .unwrap();
        // Nothing installed: the limit ends it.
        tokio::time::timeout(bound, st.epoch_moved_on(11, Duration::from_millis(5)))
            .await
            .expect("the limit ended the wait");
    }

    #[test]
    fn kind_index_matches_all() {
        for (i, kind) in OpKind::ALL.iter().enumerate() {
            assert_eq!(kind_index(*kind), i);
        }
    }

    #[test]
    fn snapshot_names_fit_the_wire_limits() {
        let st = ServerState::new(MemoryBudget::new(1 << 20), 3);
        let snap = st.stats_snapshot();
        assert!(snap.len() <= STATS_ENTRIES_MAX);
        assert!(snap.iter().all(|(n, _)| n.len() <= STAT_NAME_BYTES_MAX));
        let get = |k: &str| snap.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        assert_eq!(get("memory_cap_bytes"), Some(1 << 20));
        assert_eq!(get("epoch"), Some(3));
        assert_eq!(get("ops_fetch_add"), Some(0));
        assert_eq!(get("ops_resp_strings"), Some(0));
        // A lone server's store keeps no partition index.
        assert_eq!(get("partition_index"), Some(0));
        let mut by_group = [0; RESP_GROUPS.len()];
        by_group[0] = 2;
        by_group[4] = 1;
        st.stats().add_resp_commands(3, &by_group);
        let snap = st.stats_snapshot();
        let get = |k: &str| snap.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        assert_eq!(get("ops_resp_strings"), Some(2));
        assert_eq!(get("ops_resp_zsets"), Some(1));
        assert_eq!(get("resp_commands"), Some(3));
        assert_eq!(get("connection_buffers_used_bytes"), Some(0));
    }

    #[test]
    fn admission_keeps_both_caps() {
        let s = Stats::default();
        assert_eq!(s.try_admit(3, 2, true), Ok(()));
        assert_eq!(s.try_admit(3, 2, true), Ok(()));
        assert_eq!(
            s.try_admit(3, 2, true),
            Err(Refusal::TooManyUnauthenticated)
        );
        // The unauthenticated cap leaves room for a client that needs no handshake.
        assert_eq!(s.try_admit(3, 2, false), Ok(()));
        assert_eq!(s.try_admit(3, 2, false), Err(Refusal::Full));
        s.unauthenticated_left();
        // Room among the unauthenticated, but none in total: nothing is left counted.
        assert_eq!(s.try_admit(3, 2, true), Err(Refusal::Full));
        assert_eq!(s.connections_unauthenticated(), 1);
        assert_eq!(s.connections_current(), 3);
    }
}
