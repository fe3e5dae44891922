//! A linearizability checker for histories of single-key registers with read, write and
//! compare-and-swap: the Wing & Gong search with Lowe's memoisation of
//! (set of linearized operations, register state), as Porcupine and Knossos do it.
//!
//! A history is recorded by concurrent clients ([`Recorder`] does it for threads): each
//! operation's invocation and completion times and its outcome. An operation that never
//! completed (its client timed out, crashed or was cut off) may or may not have taken
//! effect; the checker lets it take effect at any point after its invocation, or not at
//! all. Keys are independent registers, so the history is split per key and each part is
//! searched alone (the P-compositionality of linearizability), which keeps the search
//! exponential only in the concurrency on one key.
//!
//! The search is bounded ([`Limits`]): past a number of explored states or bytes of
//! memo it stops and says [`Verdict::Inconclusive`], never hangs.
//!
//! ```
//! use camelot_check::{check, History, Limits, Op, Outcome, Verdict};
//! let mut h = History::new(0);
//! h.push(0, "x", Op::Write(1), 0, Some((10, Outcome::Written))).unwrap();
//! h.push(1, "x", Op::Read, 5, Some((20, Outcome::Read(1)))).unwrap();
//! h.push(2, "x", Op::Read, 21, Some((30, Outcome::Read(0)))).unwrap(); // stale
//! assert!(matches!(check(&h, &Limits::default()).verdict, Verdict::NotLinearizable(_)));
//! ```
#![forbid(unsafe_code)]

mod search;

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Instant;

pub use search::Partition;

/// A register's contents. Callers map their values onto words (a value's first 8 bytes,
/// an id per distinct value, …); the checker only compares them.
pub type Value = u64;

/// Most operations one history may hold: a bound on what recording may allocate, far
/// above what the search can decide in reasonable time on one key.
pub const HISTORY_OPS_MAX: usize = 4_000_000;

/// Default bound on states the search may explore, over all keys of one history.
pub const STATES_EXPLORED_MAX_DEFAULT: u64 = 4_000_000;

/// Default bound on the memo's size (its entries' bit sets and states, estimated).
pub const MEMO_BYTES_MAX_DEFAULT: u64 = 512 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Read,
    Write(Value),
    /// Replace the value with `new` if it equals `expected`.
    Cas {
        expected: Value,
        new: Value,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// What a read returned.
    Read(Value),
    Written,
    /// Whether a CAS swapped.
    Cas {
        swapped: bool,
    },
}

impl Outcome {
    fn fits(self, op: Op) -> bool {
        matches!(
            (op, self),
            (Op::Read, Outcome::Read(_))
                | (Op::Write(_), Outcome::Written)
                | (Op::Cas { .. }, Outcome::Cas { .. })
        )
    }
}

/// One operation as a client saw it. Times are in one clock for the whole history (any
/// unit; [`Recorder`] uses nanoseconds since it was made).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation<K> {
    pub client: u32,
    pub key: K,
    pub op: Op,
    pub invoke: u64,
    /// When it completed and what it returned; `None`: it never completed, so it may or
    /// may not have taken effect.
    pub completion: Option<(u64, Outcome)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("operation {index}: outcome {outcome:?} does not answer {op:?}")]
    OutcomeMismatch {
        index: usize,
        op: Op,
        outcome: Outcome,
    },
    #[error("operation {index} completes at {complete} before it is invoked at {invoke}")]
    CompletesBeforeInvoke {
        index: usize,
        invoke: u64,
        complete: u64,
    },
    #[error("a history holds at most {HISTORY_OPS_MAX} operations")]
    TooManyOperations,
}

/// Operations on independent keys, each key a register starting at the initial value.
#[derive(Debug, Clone)]
pub struct History<K> {
    ops: Vec<Operation<K>>,
    initial: Value,
    initial_per_key: HashMap<K, Value>,
}

impl<K: Clone + Eq + Hash + Debug> History<K> {
    /// An empty history whose registers all start at `initial`.
    pub fn new(initial: Value) -> History<K> {
        History {
            ops: Vec::new(),
            initial,
            initial_per_key: HashMap::new(),
        }
    }

    /// Gives one key a different starting value.
    pub fn set_initial(&mut self, key: K, value: Value) {
        self.initial_per_key.insert(key, value);
    }

    pub fn initial(&self, key: &K) -> Value {
        self.initial_per_key
            .get(key)
            .copied()
            .unwrap_or(self.initial)
    }

    /// Adds one operation; `completion` is `(time, outcome)` or `None` if it never
    /// completed.
    pub fn push(
        &mut self,
        client: u32,
        key: K,
        op: Op,
        invoke: u64,
        completion: Option<(u64, Outcome)>,
    ) -> Result<(), CheckError> {
        self.push_operation(Operation {
            client,
            key,
            op,
            invoke,
            completion,
        })
    }

    pub fn push_operation(&mut self, operation: Operation<K>) -> Result<(), CheckError> {
        let index = self.ops.len();
        if index >= HISTORY_OPS_MAX {
            return Err(CheckError::TooManyOperations);
        }
        if let Some((complete, outcome)) = operation.completion {
            if !outcome.fits(operation.op) {
                return Err(CheckError::OutcomeMismatch {
                    index,
                    op: operation.op,
                    outcome,
                });
            }
            if complete < operation.invoke {
                return Err(CheckError::CompletesBeforeInvoke {
                    index,
                    invoke: operation.invoke,
                    complete,
                });
            }
        }
        self.ops.push(operation);
        Ok(())
    }

    pub fn operations(&self) -> &[Operation<K>] {
        &self.ops
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Appends another history's operations (e.g. one per client thread, merged).
    pub fn extend(&mut self, other: History<K>) -> Result<(), CheckError> {
        for op in other.ops {
            self.push_operation(op)?;
        }
        Ok(())
    }

    /// The history split per key, each part with indices into this history, in order of
    /// first appearance.
    pub fn partitions(&self) -> Vec<(K, Vec<usize>)> {
        let mut order: Vec<K> = Vec::new();
        let mut parts: HashMap<K, Vec<usize>> = HashMap::new();
        for (i, op) in self.ops.iter().enumerate() {
            parts
                .entry(op.key.clone())
                .or_insert_with(|| {
                    order.push(op.key.clone());
                    Vec::new()
                })
                .push(i);
        }
        order
            .into_iter()
            .map(|k| {
                let idx = parts.remove(&k).unwrap_or_default();
                (k, idx)
            })
            .collect()
    }
}

/// How much the search may do before it gives up with [`Verdict::Inconclusive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// States (memo entries) explored, over all keys.
    pub states_explored_max: u64,
    /// Estimated bytes of memo held for one key at a time.
    pub memo_bytes_max: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            states_explored_max: STATES_EXPLORED_MAX_DEFAULT,
            memo_bytes_max: MEMO_BYTES_MAX_DEFAULT,
        }
    }
}

/// Why one key's history is not linearizable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation<K> {
    pub key: K,
    /// Operations on the key that the search considered (pending reads are dropped).
    pub operations: usize,
    /// The most operations any attempted order linearized.
    pub longest_prefix: usize,
    /// An operation (index into the history) that could not be placed at the deepest
    /// point the search reached: where to start looking.
    pub blocked: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<K> {
    Linearizable,
    NotLinearizable(Violation<K>),
    /// A limit was reached on this key before the search could decide.
    Inconclusive {
        key: K,
        limit: &'static str,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report<K> {
    pub verdict: Verdict<K>,
    pub keys: usize,
    pub operations: usize,
    pub states_explored: u64,
}

impl<K> Report<K> {
    pub fn is_linearizable(&self) -> bool {
        matches!(self.verdict, Verdict::Linearizable)
    }
}

/// Checks every key's part of the history; the first violation found wins, otherwise the
/// first key where a limit was reached, otherwise linearizable.
pub fn check<K: Clone + Eq + Hash + Debug>(history: &History<K>, limits: &Limits) -> Report<K> {
    let parts = history.partitions();
    let keys = parts.len();
    let mut explored = 0u64;
    let mut inconclusive = None;
    for (key, indices) in parts {
        let part = Partition::new(history, &key, &indices);
        let budget = Limits {
            states_explored_max: limits.states_explored_max.saturating_sub(explored),
            memo_bytes_max: limits.memo_bytes_max,
        };
        let result = part.search(&budget);
        explored += result.states_explored;
        match result.outcome {
            search::SearchOutcome::Linearizable => {}
            search::SearchOutcome::Violation {
                longest_prefix,
                blocked,
            } => {
                return Report {
                    verdict: Verdict::NotLinearizable(Violation {
                        key,
                        operations: part.len(),
                        longest_prefix,
                        blocked,
                    }),
                    keys,
                    operations: history.len(),
                    states_explored: explored,
                }
            }
            search::SearchOutcome::LimitReached(limit) => {
                if inconclusive.is_none() {
                    inconclusive = Some(Verdict::Inconclusive { key, limit });
                }
            }
        }
    }
    Report {
        verdict: inconclusive.unwrap_or(Verdict::Linearizable),
        keys,
        operations: history.len(),
        states_explored: explored,
    }
}

/// Records a history from many threads: one clock (nanoseconds since the recorder was
/// made), one lock taken once per finished operation.
#[derive(Debug)]
pub struct Recorder<K> {
    start: Instant,
    history: Mutex<History<K>>,
}

impl<K: Clone + Eq + Hash + Debug> Recorder<K> {
    pub fn new(initial: Value) -> Recorder<K> {
        Recorder {
            start: Instant::now(),
            history: Mutex::new(History::new(initial)),
        }
    }

    /// The recorder's clock; take it just before invoking an operation.
    pub fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Records an operation invoked at `invoke` (from [`Recorder::now`]) that completes
    /// now with `outcome`, or that failed in a way that leaves unknown whether it took
    /// effect (`None`).
    pub fn finish(
        &self,
        client: u32,
        key: K,
        op: Op,
        invoke: u64,
        outcome: Option<Outcome>,
    ) -> Result<(), CheckError> {
        let completion = outcome.map(|o| (self.now(), o));
        let mut h = self.history.lock().unwrap_or_else(|e| e.into_inner());
        h.push(client, key, op, invoke, completion)
    }

    pub fn into_history(self) -> History<K> {
        self.history.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.history.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
