//! A Clover client: one per thread. Reads and writes go to memory servers as one-sided
//! READ, WRITE and CAS; only a key's first use, a walk that met a reclaimed node, and
//! running out of free nodes ask the metadata service.

use crate::chain::{Access, Answer, ChainLimits, Counters, Hint, ReadOp, Step, WriteDone, WriteOp};
use crate::layout::NodeAddr;
use crate::memory::Memory;
use crate::meta::MetaApi;
use crate::CloverError;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Keys whose id and newest known tail a store remembers; past it the cache starts over.
pub const CACHED_KEYS_MAX_DEFAULT: usize = 65_536;
/// Free nodes a store asks for at a time.
pub const GRANT_NODES_DEFAULT: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    pub limits: ChainLimits,
    pub cached_keys_max: usize,
    pub grant_nodes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            limits: ChainLimits::default(),
            cached_keys_max: CACHED_KEYS_MAX_DEFAULT,
            grant_nodes: GRANT_NODES_DEFAULT,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub reads: u64,
    pub writes: u64,
    /// Nodes followed past the cached hint.
    pub hops: u64,
    /// Walks a middlebox sent straight to a newer version.
    pub jumps: u64,
    /// CASes lost to another writer (each followed by a retry).
    pub cas_failures: u64,
    /// Walks restarted from the head after meeting a reclaimed node.
    pub restarts: u64,
    /// Writes a middlebox linked at the real tail for us (CAS retries saved).
    pub relinked: u64,
    pub meta_calls: u64,
}

impl StoreStats {
    fn add(&mut self, c: Counters) {
        self.hops += u64::from(c.hops);
        self.jumps += u64::from(c.jumps);
        self.cas_failures += u64::from(c.cas_failures);
        self.restarts += u64::from(c.restarts);
        self.relinked += u64::from(c.relinked);
    }
}

pub struct Store<M: Memory> {
    meta: Arc<dyn MetaApi>,
    mem: M,
    slot: Arc<AtomicU64>,
    config: StoreConfig,
    keys: HashMap<Vec<u8>, (u64, Hint)>,
    free: Vec<NodeAddr>,
    stats: StoreStats,
}

impl<M: Memory> Store<M> {
    /// A store using `mem` (its own connections) for data and `meta` for metadata.
    pub fn new<S: MetaApi + 'static>(meta: Arc<S>, mem: M, config: StoreConfig) -> Store<M> {
        let meta: Arc<dyn MetaApi> = meta;
        let slot = meta.register();
        Store {
            meta,
            mem,
            slot,
            config,
            keys: HashMap::new(),
            free: Vec::new(),
            stats: StoreStats::default(),
        }
    }

    pub fn stats(&self) -> StoreStats {
        self.stats
    }

    fn key(&mut self, key: &[u8]) -> Result<(u64, Hint), CloverError> {
        if let Some(&k) = self.keys.get(key) {
            return Ok(k);
        }
        self.stats.meta_calls += 1;
        let k = self.meta.key(key)?;
        if self.keys.len() >= self.config.cached_keys_max {
            self.keys.clear();
        }
        self.keys.insert(key.to_vec(), k);
        Ok(k)
    }

    fn remember(&mut self, key: &[u8], key_id: u64, tail: Hint) {
        if let Some(entry) = self.keys.get_mut(key) {
            *entry = (key_id, tail);
        }
    }

    /// Runs a machine's accesses until it finishes.
    fn drive<T>(
        &mut self,
        key_id: u64,
        first: Access,
        mut resume: impl FnMut(Answer) -> Result<Step<T>, crate::chain::ChainError>,
    ) -> Result<T, CloverError> {
        let mut access = first;
        loop {
            let answer = match access {
                Access::Read { addr, len } => Answer::Data(self.mem.read(addr, len)?),
                Access::Write { addr, data } => {
                    self.mem.write(addr, data)?;
                    Answer::Done
                }
                Access::Cas {
                    addr,
                    expected,
                    new,
                } => Answer::Word(self.mem.cas(addr, expected, new)?),
                Access::Head => {
                    self.stats.meta_calls += 1;
                    Answer::Head(self.meta.head(key_id)?)
                }
            };
            match resume(answer)? {
                Step::Issue(a) => access = a,
                Step::Finished(t) => return Ok(t),
            }
        }
    }

    /// The key's current value; `None` if it was never written or was deleted.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Bytes>, CloverError> {
        let (key_id, hint) = self.key(key)?;
        let slot = Arc::clone(&self.slot);
        let _pin = Announced::new(self.meta.as_ref(), &slot);
        let mut op = ReadOp::new(&self.mem.geometry(), key_id, hint, self.config.limits);
        let first = op.start();
        let done = self.drive(key_id, first, |a| op.resume(a))?;
        self.stats.reads += 1;
        self.stats.add(done.counters);
        self.remember(key, key_id, done.tail);
        Ok(done.value)
    }

    pub fn put(&mut self, key: &[u8], value: impl Into<Bytes>) -> Result<(), CloverError> {
        self.write(key, Some(value.into()), None).map(|_| ())
    }

    pub fn delete(&mut self, key: &[u8]) -> Result<(), CloverError> {
        self.write(key, None, None).map(|_| ())
    }

    /// Writes `new` only if the current value is `expected` (`None`: absent). Returns
    /// whether it did.
    pub fn compare_and_put(
        &mut self,
        key: &[u8],
        expected: Option<Bytes>,
        new: Option<Bytes>,
    ) -> Result<bool, CloverError> {
        self.write(key, new, Some(expected)).map(|d| d.applied)
    }

    fn write(
        &mut self,
        key: &[u8],
        value: Option<Bytes>,
        condition: Option<Option<Bytes>>,
    ) -> Result<WriteDone, CloverError> {
        let (key_id, hint) = self.key(key)?;
        if self.free.is_empty() {
            self.stats.meta_calls += 1;
            self.free = self.meta.grant(self.config.grant_nodes)?;
        }
        let node = self.free.pop().ok_or(CloverError::OutOfMemory {
            blocks_max: self.meta.blocks_max(),
        })?;
        let slot = Arc::clone(&self.slot);
        let _pin = Announced::new(self.meta.as_ref(), &slot);
        let mut op = WriteOp::new(
            &self.mem.geometry(),
            key_id,
            hint,
            node,
            value,
            condition,
            self.config.limits,
        )?;
        let first = op.start();
        match self.drive(key_id, first, |a| op.resume(a)) {
            Ok(done) => {
                self.stats.writes += 1;
                self.stats.add(done.counters);
                if !done.applied {
                    self.free.push(node);
                }
                self.remember(key, key_id, done.tail);
                Ok(done)
            }
            // A middlebox may have linked the node: never reused (see the next arm).
            Err(e @ CloverError::Chain(crate::chain::ChainError::Relinked(_))) => Err(e),
            // The machine gives up only while its node is unlinked (a won CAS finishes
            // it), so the node can be reused.
            Err(e @ CloverError::Chain(_)) => {
                self.free.push(node);
                Err(e)
            }
            // A failed access may have been a CAS that landed: the node may be linked,
            // so it is never reused (one node lost per such failure; see the crate doc).
            Err(e) => Err(e),
        }
    }
}

/// A store operation announced as running (see `meta`) until dropped.
struct Announced<'a> {
    slot: &'a AtomicU64,
}

impl<'a> Announced<'a> {
    fn new(meta: &dyn MetaApi, slot: &'a AtomicU64) -> Announced<'a> {
        meta.announce(slot);
        Announced { slot }
    }
}

impl Drop for Announced<'_> {
    fn drop(&mut self) {
        self.slot
            .store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
    }
}

impl<M: Memory> Drop for Store<M> {
    fn drop(&mut self) {
        self.meta.give_back(std::mem::take(&mut self.free));
    }
}
