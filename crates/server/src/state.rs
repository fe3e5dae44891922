//! What every connection of one server shares: the store, the counters, the epoch.

use crate::budget::MemoryBudget;
use crate::objects::ObjectStore;
use crate::store::{Quota, RegionStore};
use camelot_proto::OpKind;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) const OP_KINDS: usize = OpKind::ALL.len();

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
    batches: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    resp_commands: AtomicU64,
    ops: [AtomicU64; OP_KINDS],
}

impl Stats {
    pub fn connection_opened(&self) {
        self.connections_current.fetch_add(1, Ordering::Relaxed);
        self.connections_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connection_closed(&self) {
        self.connections_current.fetch_sub(1, Ordering::Relaxed);
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

    pub fn add_resp_commands(&self, n: u64) {
        if n > 0 {
            self.resp_commands.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn ops(&self, kind: OpKind) -> u64 {
        self.ops[kind_index(kind)].load(Ordering::Relaxed)
    }
}

pub struct ServerState {
    store: RegionStore,
    objects: ObjectStore,
    stats: Stats,
    epoch: AtomicU64,
    /// Listening beyond loopback with no token: anyone who can reach the port is served.
    /// Shown in STATS so `camelot stats` can warn long after the start-up log scrolled by.
    exposed_without_token: AtomicBool,
}

impl ServerState {
    pub fn new(budget: Arc<MemoryBudget>, epoch: u64) -> Self {
        Self::with_quota(budget, epoch, Quota::UNLIMITED)
    }

    /// A state whose regions are bounded per principal by `quota`.
    pub fn with_quota(budget: Arc<MemoryBudget>, epoch: u64, quota: Quota) -> Self {
        ServerState {
            objects: ObjectStore::new(Arc::clone(&budget)),
            store: RegionStore::with_quota(budget, quota),
            stats: Stats::default(),
            epoch: AtomicU64::new(epoch),
            exposed_without_token: AtomicBool::new(false),
        }
    }

    pub fn set_exposed_without_token(&self, exposed: bool) {
        self.exposed_without_token.store(exposed, Ordering::Relaxed);
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

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn budget(&self) -> &Arc<MemoryBudget> {
        self.store.budget()
    }

    /// The cluster-map epoch batches are checked against (0 in a batch skips the check).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Release);
    }

    /// The counters STATS returns, in a fixed order.
    pub fn stats_snapshot(&self) -> Vec<(String, u64)> {
        let s = &self.stats;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = Vec::with_capacity(10 + OP_KINDS);
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
        out.push(("batches".to_owned(), load(&s.batches)));
        out.push(("bytes_in".to_owned(), load(&s.bytes_in)));
        out.push(("bytes_out".to_owned(), load(&s.bytes_out)));
        out.push(("epoch".to_owned(), self.epoch()));
        out.push(("resp_commands".to_owned(), load(&s.resp_commands)));
        out.push((
            STAT_EXPOSED_WITHOUT_TOKEN.to_owned(),
            u64::from(self.exposed_without_token()),
        ));
        for kind in OpKind::ALL {
            out.push((format!("ops_{}", kind.name()), s.ops(kind)));
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
    }
}
