//! The metadata service: makes blocks, hands out free nodes, keeps each key's head, and
//! collects old versions.
//!
//! Collection is epoch-based. A pass extends what it knows of each chain (reading only
//! nodes appended since the last pass), keeps the newest `versions_kept` versions, moves
//! the head past the rest and retires them in the current epoch, then advances the epoch.
//! A retired node returns to the free pool only once every store operation that was
//! running when it was retired has finished (each announces the epoch it started in), so
//! walks in flight keep intact nodes under their feet. Cached hints held between
//! operations are not protected; the walk's (key id, sequence number) check catches a
//! reused node and restarts from the head (see `chain`).
//!
//! Stores in other processes (through the metadata server, `server`) cannot announce
//! epochs without a round trip per operation, so for them a retired node also waits
//! `reuse_grace` before it is free: long enough for any walk in flight to end, so reuse
//! under a walker stays rare. Correctness never rests on either wait (see above).
//!
//! Key ids carry a random 32-bit salt in their upper half (the lower half numbers keys
//! from 1), so two stores behind one middlebox do not share key ids, which the proxy's
//! caches use to tell nodes of one key from another's.

use crate::chain::Hint;
use crate::layout::{encode_node, node_header_fields, Next, NodeAddr, RELINK_HEADER_BYTES};
use crate::memory::Memory;
use crate::CloverError;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Most keys a metadata service tracks by default.
pub const KEYS_MAX_DEFAULT: usize = 1 << 20;
/// Most nodes one collection pass reads along one chain; the rest wait for the next.
pub const GC_HOPS_PER_CHAIN_MAX: usize = 65_536;
/// Most nodes one grant hands out.
pub const GRANT_NODES_MAX: usize = 1024;
/// Most collection passes a grant waits out for a free node before it says the store is
/// full.
pub const PASSES_AWAITED_MAX: usize = 8;
/// How long a grant that finds nothing free, but retired nodes waiting out operations
/// in flight, waits for them before it says the store is full: one store descheduled in
/// the middle of a write holds every node retired since it began (a history test on a
/// loaded 2-vCPU machine had its grants fail so, with 751 nodes free at the end).
pub const LIMBO_WAIT_MAX: Duration = Duration::from_secs(2);
/// How often such a grant looks again.
const LIMBO_POLL: Duration = Duration::from_millis(1);

/// What a store needs of its metadata service: the in-process [`Meta`], or the metadata
/// server reached over the network (`remote::RemoteMeta`).
pub trait MetaApi: Send + Sync {
    /// The key's id and head, making the key if it is new.
    fn key(&self, key: &[u8]) -> Result<(u64, Hint), CloverError>;
    fn head(&self, key_id: u64) -> Result<Hint, CloverError>;
    /// Up to `n` free nodes (at least one) for a writer to own.
    fn grant(&self, n: usize) -> Result<Vec<NodeAddr>, CloverError>;
    /// Nodes a writer owned and never linked.
    fn give_back(&self, nodes: Vec<NodeAddr>);
    fn blocks_max(&self) -> u32;
    /// A new store's announcement slot.
    fn register(&self) -> Arc<AtomicU64>;
    /// Announces an operation starting on `slot` (until the slot is set to `u64::MAX`).
    fn announce(&self, slot: &AtomicU64);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaConfig {
    /// Blocks the service may make: with the geometry, the store's whole memory.
    pub blocks_max: u32,
    pub keys_max: usize,
    /// Versions of each key kept behind the head (at least 1: the current one).
    pub versions_kept: usize,
    /// How long a retired node waits before it is free, beyond the epochs of in-process
    /// stores (see the module doc); zero for a service whose stores all announce.
    pub reuse_grace: Duration,
    /// Test-only: a deliberately broken service that hands every granted node out a
    /// second time, to the next store that asks (the history tests show it is caught).
    pub fault_double_grant: bool,
}

impl Default for MetaConfig {
    fn default() -> Self {
        MetaConfig {
            blocks_max: 64,
            keys_max: KEYS_MAX_DEFAULT,
            versions_kept: 2,
            reuse_grace: Duration::ZERO,
            fault_double_grant: false,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaStats {
    pub blocks: u32,
    pub keys: usize,
    pub free_nodes: usize,
    pub limbo_nodes: usize,
    pub gc_passes: u64,
    pub nodes_retired: u64,
    pub nodes_reclaimed: u64,
    /// Grants (and new keys) that found nothing free and waited for retired nodes.
    pub grants_waited: u64,
    /// Nodes given back that were not out with a writer (never granted, given back
    /// already, or seen linked by a collection pass): kept out of the free pool.
    pub give_backs_refused: u64,
    pub epoch: u64,
}

struct Chain {
    /// Linked versions from the head on, as far as the last pass read.
    known: VecDeque<Hint>,
}

struct State {
    keys: HashMap<Vec<u8>, u64>,
    /// Index key id − 1.
    chains: Vec<Chain>,
    free: Vec<NodeAddr>,
    /// Nodes out with writers: granted, not given back, not yet seen linked. Only these
    /// may be given back — a node freed twice would be granted to two writers, and a
    /// linked one freed would be overwritten under its readers. At most every node of
    /// the store (its memory bound).
    granted: HashSet<NodeAddr>,
    /// Retired nodes, the epoch they were retired in and when, oldest first.
    limbo: VecDeque<(NodeAddr, u64, Instant)>,
    stats: MetaStats,
}

pub struct Meta<M: Memory> {
    mem: M,
    config: MetaConfig,
    /// The upper half of every key id this service makes.
    salt: u64,
    state: Mutex<State>,
    /// Held for a whole collection pass: passes never overlap, and the state lock is
    /// not held while a pass reads the chains (see [`Meta::gc`]).
    gc_pass: Mutex<()>,
    epoch: AtomicU64,
    /// Each store's announcement: the epoch its running operation started in, or
    /// `u64::MAX` between operations.
    slots: Mutex<Vec<Weak<AtomicU64>>>,
}

/// Marks a store operation as running from the epoch it read until dropped.
pub struct Pin<'a> {
    slot: &'a AtomicU64,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.slot.store(u64::MAX, Ordering::SeqCst);
    }
}

impl<M: Memory> Meta<M> {
    pub fn new(mem: M, config: MetaConfig) -> Result<Meta<M>, CloverError> {
        if config.versions_kept == 0 || config.blocks_max == 0 {
            return Err(CloverError::InvalidArgument(
                "versions_kept and blocks_max must be at least 1".into(),
            ));
        }
        Ok(Meta {
            mem,
            config,
            salt: random_salt(),
            state: Mutex::new(State {
                keys: HashMap::new(),
                chains: Vec::new(),
                free: Vec::new(),
                granted: HashSet::new(),
                limbo: VecDeque::new(),
                stats: MetaStats::default(),
            }),
            gc_pass: Mutex::new(()),
            epoch: AtomicU64::new(1),
            slots: Mutex::new(Vec::new()),
        })
    }

    pub fn memory(&self) -> &M {
        &self.mem
    }

    pub fn config(&self) -> &MetaConfig {
        &self.config
    }

    /// A new store's announcement slot.
    pub fn register(&self) -> Arc<AtomicU64> {
        let slot = Arc::new(AtomicU64::new(u64::MAX));
        let mut slots = self.slots.lock();
        slots.retain(|w| w.strong_count() > 0);
        slots.push(Arc::downgrade(&slot));
        slot
    }

    /// Announces an operation starting. The epoch is re-read after the announcement so a
    /// pass that advanced it in between cannot miss us.
    pub fn pin<'a>(&self, slot: &'a AtomicU64) -> Pin<'a> {
        self.announce_epoch(slot);
        Pin { slot }
    }

    fn announce_epoch(&self, slot: &AtomicU64) {
        loop {
            let e = self.epoch.load(Ordering::SeqCst);
            slot.store(e, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == e {
                return;
            }
        }
    }

    /// The key's id and head, making the key (absent, version 0) if it is new.
    pub fn key(&self, key: &[u8]) -> Result<(u64, Hint), CloverError> {
        let mut st = self.state.lock();
        if let Some(&id) = st.keys.get(key) {
            return Ok((id, head_of(&st, self.index(id)?, id)?));
        }
        if st.keys.len() >= self.config.keys_max {
            return Err(CloverError::TooManyKeys(self.config.keys_max));
        }
        let node = self.take_nodes_waiting(&mut st, 1)?[0];
        // Taking a node may have let the state lock go (waiting for a pass or for
        // retired nodes), and another caller may have made the key meanwhile: two
        // chains for one key would give its stores two ids, and one's writes would be
        // read by nobody.
        if let Some(&id) = st.keys.get(key) {
            st.free.push(node);
            return Ok((id, head_of(&st, self.index(id)?, id)?));
        }
        if st.keys.len() >= self.config.keys_max {
            st.free.push(node);
            return Err(CloverError::TooManyKeys(self.config.keys_max));
        }
        let id = self.salt << 32 | (st.chains.len() as u64 + 1);
        let data = encode_node(&self.mem.geometry(), node, id, 0, None, false)?;
        if let Err(e) = self.mem.write(node, data) {
            st.free.push(node);
            return Err(e);
        }
        let head = Hint { addr: node, seq: 0 };
        st.chains.push(Chain {
            known: VecDeque::from([head]),
        });
        st.keys.insert(key.to_vec(), id);
        st.stats.keys = st.keys.len();
        Ok((id, head))
    }

    pub fn head(&self, key_id: u64) -> Result<Hint, CloverError> {
        head_of(&self.state.lock(), self.index(key_id)?, key_id)
    }

    /// A key id's place in the chain table, if this service made it.
    fn index(&self, key_id: u64) -> Result<usize, CloverError> {
        let n = key_id & 0xffff_ffff;
        if key_id >> 32 != self.salt || n == 0 {
            return Err(CloverError::UnknownKey(key_id));
        }
        Ok((n - 1) as usize)
    }

    /// Up to `n` (at least one) free nodes for a writer to own. Reclaims, collects and
    /// makes blocks, in that order, when the pool runs short.
    pub fn grant(&self, n: usize) -> Result<Vec<NodeAddr>, CloverError> {
        let mut st = self.state.lock();
        let nodes = self.take_nodes_waiting(&mut st, n.clamp(1, GRANT_NODES_MAX))?;
        if self.config.fault_double_grant {
            st.free.extend(nodes.iter().copied());
        }
        st.granted.extend(nodes.iter().copied());
        Ok(nodes)
    }

    /// Nodes a writer owned and never linked. Any other is refused (counted), not freed.
    pub fn give_back(&self, nodes: Vec<NodeAddr>) {
        let mut st = self.state.lock();
        for node in nodes {
            if st.granted.remove(&node) {
                st.free.push(node);
            } else {
                st.stats.give_backs_refused += 1;
            }
        }
    }

    /// One collection pass. The chains are read without the state lock: a pass reads
    /// one header per key (and per version appended since the last pass), and holding
    /// the lock through those round trips stalled every grant and head lookup behind it
    /// (the bench's Clover side ran at ~1,300 ops/s with a pass every 2 ms).
    ///
    /// Reading unlocked is safe because only a pass extends or trims a chain (passes are
    /// serialised by `gc_pass`), a chain's linked versions are never reused while it
    /// knows them, and the epoch the pass retires into is read before its reads begin:
    /// an operation that starts meanwhile announces that epoch or an older one, so what
    /// it may walk into stays out of the free pool until it ends.
    pub fn gc(&self) -> Result<MetaStats, CloverError> {
        let _pass = self.gc_pass.lock();
        let (epoch, tails) = {
            let st = self.state.lock();
            let epoch = self.epoch.load(Ordering::SeqCst);
            let tails: Vec<Option<Hint>> =
                st.chains.iter().map(|c| c.known.back().copied()).collect();
            (epoch, tails)
        };
        let mut appended = Vec::with_capacity(tails.len());
        for (i, tail) in tails.iter().enumerate() {
            appended.push(match tail {
                Some(last) => self.read_appended(i, *last)?,
                None => Vec::new(),
            });
        }
        let mut st = self.state.lock();
        let now = Instant::now();
        let State {
            chains,
            limbo,
            stats,
            granted,
            ..
        } = &mut *st;
        for (chain, new) in chains.iter_mut().zip(appended) {
            for h in &new {
                granted.remove(&h.addr);
            }
            chain.known.extend(new);
            self.retire_excess(chain, epoch, now, limbo, stats);
        }
        self.end_pass(&mut st);
        Ok(self.stats_locked(&st))
    }

    pub fn stats(&self) -> MetaStats {
        self.stats_locked(&self.state.lock())
    }

    fn stats_locked(&self, st: &State) -> MetaStats {
        MetaStats {
            blocks: self.mem.blocks(),
            free_nodes: st.free.len(),
            limbo_nodes: st.limbo.len(),
            epoch: self.epoch.load(Ordering::SeqCst),
            ..st.stats
        }
    }

    /// [`Meta::take_nodes`], waiting out a running collection pass (a bounded number of
    /// times) when nothing is free until it ends, then retired nodes
    /// ([`Meta::wait_for_limbo`]). The state lock may be let go meanwhile.
    fn take_nodes_waiting(
        &self,
        st: &mut parking_lot::MutexGuard<'_, State>,
        n: usize,
    ) -> Result<Vec<NodeAddr>, CloverError> {
        for _ in 0..PASSES_AWAITED_MAX {
            match self.take_nodes(st, n) {
                Ok(Some(nodes)) => return Ok(nodes),
                // The state lock is released while waiting: the pass needs it.
                Ok(None) => parking_lot::MutexGuard::unlocked(st, || drop(self.gc_pass.lock())),
                Err(CloverError::OutOfMemory { .. }) => break,
                Err(e) => return Err(e),
            }
        }
        self.wait_for_limbo(st, n)
    }

    /// Nothing is free, but retired nodes come back by themselves once the stores'
    /// operations in flight end (and the reuse grace passes): while there are any the
    /// store is not full, and this waits for them (up to [`LIMBO_WAIT_MAX`], or twice
    /// the reuse grace if that is longer), looking again without another collection
    /// pass (one a look would hold the state lock most of the time).
    fn wait_for_limbo(
        &self,
        st: &mut parking_lot::MutexGuard<'_, State>,
        n: usize,
    ) -> Result<Vec<NodeAddr>, CloverError> {
        let full = CloverError::OutOfMemory {
            blocks_max: self.config.blocks_max,
        };
        if st.limbo.is_empty() {
            return Err(full);
        }
        st.stats.grants_waited += 1;
        let deadline = Instant::now() + LIMBO_WAIT_MAX.max(self.config.reuse_grace * 2);
        loop {
            parking_lot::MutexGuard::unlocked(st, || std::thread::sleep(LIMBO_POLL));
            self.reclaim(st);
            if !st.free.is_empty() {
                let keep = st.free.len().saturating_sub(n);
                return Ok(st.free.split_off(keep));
            }
            if st.limbo.is_empty() || Instant::now() >= deadline {
                return Err(full);
            }
        }
    }

    /// Up to `n` free nodes (at least one), or `None` when there are none and a
    /// collection pass running elsewhere may free some.
    fn take_nodes(&self, st: &mut State, n: usize) -> Result<Option<Vec<NodeAddr>>, CloverError> {
        if st.free.len() < n {
            self.reclaim(st);
        }
        let mut pass_elsewhere = false;
        if st.free.len() < n && !st.chains.is_empty() {
            // Lock order is `gc_pass` then `state`, so only a try here.
            match self.gc_pass.try_lock() {
                Some(_pass) => self.gc_locked(st)?,
                None => pass_elsewhere = true,
            }
        }
        while st.free.len() < n && self.mem.blocks() < self.config.blocks_max {
            let block = self.mem.add_block()?;
            let nodes = self.mem.geometry().nodes_per_block;
            // Highest slot first, so nodes are handed out in address order.
            st.free
                .extend((0..nodes).rev().map(|slot| NodeAddr { block, slot }));
        }
        if st.free.is_empty() {
            if pass_elsewhere {
                return Ok(None);
            }
            return Err(CloverError::OutOfMemory {
                blocks_max: self.config.blocks_max,
            });
        }
        let keep = st.free.len().saturating_sub(n);
        Ok(Some(st.free.split_off(keep)))
    }

    /// A whole pass under the state lock (the caller holds `gc_pass` too): when a grant
    /// finds fewer nodes free than it asks for (before any block is added), so every
    /// other metadata call waits for it.
    fn gc_locked(&self, st: &mut State) -> Result<(), CloverError> {
        let epoch = self.epoch.load(Ordering::SeqCst);
        let now = Instant::now();
        for i in 0..st.chains.len() {
            let Some(&last) = st.chains[i].known.back() else {
                continue;
            };
            let new = self.read_appended(i, last)?;
            let State {
                chains,
                limbo,
                stats,
                granted,
                ..
            } = &mut *st;
            for h in &new {
                granted.remove(&h.addr);
            }
            chains[i].known.extend(new);
            self.retire_excess(&mut chains[i], epoch, now, limbo, stats);
        }
        self.end_pass(st);
        Ok(())
    }

    /// The versions linked after `last` on chain `index`, as far as one pass reads.
    fn read_appended(&self, index: usize, mut last: Hint) -> Result<Vec<Hint>, CloverError> {
        let key_id = self.salt << 32 | (index as u64 + 1);
        let mut appended = Vec::new();
        for _ in 0..GC_HOPS_PER_CHAIN_MAX {
            // The first 24 bytes only: a middlebox redirects READs of whole headers
            // (see `layout::FLAG_REDIRECTED`), and collection must see this node.
            let bytes = self.mem.read(last.addr, RELINK_HEADER_BYTES as u32)?;
            let (next, h_key, h_seq) = node_header_fields(&bytes);
            if bytes.len() < RELINK_HEADER_BYTES || h_key != key_id || h_seq != last.seq {
                // A node the pass knows as linked is never reused.
                return Err(CloverError::Corrupt(format!(
                    "key {key_id}: node {:?} holds key {h_key} version {h_seq}, expected version {}",
                    last.addr, last.seq
                )));
            }
            match Next::decode(next) {
                Next::Node(a) => {
                    last = Hint {
                        addr: a,
                        seq: last.seq + 1,
                    };
                    appended.push(last);
                }
                _ => break,
            }
        }
        Ok(appended)
    }

    /// Keeps the newest `versions_kept` versions of `chain`, retiring the rest in `epoch`.
    fn retire_excess(
        &self,
        chain: &mut Chain,
        epoch: u64,
        now: Instant,
        limbo: &mut VecDeque<(NodeAddr, u64, Instant)>,
        stats: &mut MetaStats,
    ) {
        while chain.known.len() > self.config.versions_kept {
            if let Some(old) = chain.known.pop_front() {
                limbo.push_back((old.addr, epoch, now));
                stats.nodes_retired += 1;
            }
        }
    }

    fn end_pass(&self, st: &mut State) {
        st.stats.gc_passes += 1;
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.reclaim(st);
    }

    /// Frees retired nodes no running operation can still be walking.
    fn reclaim(&self, st: &mut State) {
        let oldest_running = {
            let mut slots = self.slots.lock();
            slots.retain(|w| w.strong_count() > 0);
            slots
                .iter()
                .filter_map(Weak::upgrade)
                .map(|s| s.load(Ordering::SeqCst))
                .min()
                .unwrap_or(u64::MAX)
        };
        let now = Instant::now();
        while let Some(&(addr, retired, at)) = st.limbo.front() {
            if retired >= oldest_running || now.duration_since(at) < self.config.reuse_grace {
                break;
            }
            st.limbo.pop_front();
            st.free.push(addr);
            st.stats.nodes_reclaimed += 1;
        }
    }
}

fn head_of(st: &State, index: usize, key_id: u64) -> Result<Hint, CloverError> {
    st.chains
        .get(index)
        .and_then(|c| c.known.front().copied())
        .ok_or(CloverError::UnknownKey(key_id))
}

/// A nonzero 31-bit salt from the standard library's per-process random hash keys (no
/// cryptographic need: it only has to differ between stores).
fn random_salt() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    (h.finish() & 0x7fff_ffff).max(1)
}

impl<M: Memory> MetaApi for Meta<M> {
    fn key(&self, key: &[u8]) -> Result<(u64, Hint), CloverError> {
        Meta::key(self, key)
    }
    fn head(&self, key_id: u64) -> Result<Hint, CloverError> {
        Meta::head(self, key_id)
    }
    fn grant(&self, n: usize) -> Result<Vec<NodeAddr>, CloverError> {
        Meta::grant(self, n)
    }
    fn give_back(&self, nodes: Vec<NodeAddr>) {
        Meta::give_back(self, nodes)
    }
    fn blocks_max(&self) -> u32 {
        self.config.blocks_max
    }
    fn register(&self) -> Arc<AtomicU64> {
        Meta::register(self)
    }
    fn announce(&self, slot: &AtomicU64) {
        self.announce_epoch(slot);
    }
}
