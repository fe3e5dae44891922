//! The search on one key: Wing & Gong's backtracking over a doubly linked list of call and
//! return events, with Lowe's memo of (linearized set, state) so a configuration reached
//! twice is explored once.

use crate::{History, Limits, Op, Outcome, Value};
use std::collections::HashSet;
use std::hash::Hash;

const NIL: usize = usize::MAX;

/// Event 2i is operation i's call, 2i+1 its return.
fn is_call(event: usize) -> bool {
    event & 1 == 0
}

/// One key's operations, ready to search.
pub struct Partition {
    initial: Value,
    ops: Vec<PartOp>,
}

impl PartOp {
    /// Whether every placement this operation can have leaves the state unchanged.
    fn preserves_state(&self) -> bool {
        matches!(
            (self.op, self.outcome),
            (Op::Read, Some(_)) | (Op::Cas { .. }, Some(Outcome::Cas { swapped: false }))
        )
    }
}

#[derive(Debug, Clone, Copy)]
struct PartOp {
    /// Index into the whole history.
    index: usize,
    op: Op,
    invoke: u64,
    /// `u64::MAX` for an operation that never completed: it may take effect any time
    /// after its invocation, and taking effect last is the same as never.
    complete: u64,
    outcome: Option<Outcome>,
}

pub(crate) enum SearchOutcome {
    Linearizable,
    Violation {
        longest_prefix: usize,
        blocked: usize,
    },
    LimitReached(&'static str),
}

pub(crate) struct SearchResult {
    pub outcome: SearchOutcome,
    pub states_explored: u64,
}

/// The register's transition: the state after `op` with `outcome`, or `None` if the
/// outcome is impossible in `state`.
fn step(state: Value, op: Op, outcome: Option<Outcome>) -> Option<Value> {
    match (op, outcome) {
        (Op::Read, Some(Outcome::Read(v))) => (v == state).then_some(state),
        // A read that never answered constrains nothing; such reads are dropped before
        // the search, this arm only keeps `step` total.
        (Op::Read, _) => Some(state),
        (Op::Write(v), _) => Some(v),
        (Op::Cas { expected, new }, Some(Outcome::Cas { swapped: true })) => {
            (state == expected).then_some(new)
        }
        (Op::Cas { expected, .. }, Some(Outcome::Cas { swapped: false })) => {
            (state != expected).then_some(state)
        }
        (Op::Cas { expected, new }, _) => Some(if state == expected { new } else { state }),
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct BitSet(Vec<u64>);

impl BitSet {
    fn new(bits: usize) -> BitSet {
        BitSet(vec![0; bits.div_ceil(64)])
    }
    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn clear(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }
}

impl Partition {
    pub fn new<K: Clone + Eq + Hash + std::fmt::Debug>(
        history: &History<K>,
        key: &K,
        indices: &[usize],
    ) -> Partition {
        let all = history.operations();
        let ops = indices
            .iter()
            .filter_map(|&index| {
                let o = all.get(index)?;
                match (o.op, o.completion) {
                    (Op::Read, None) => None,
                    (op, Some((complete, outcome))) => Some(PartOp {
                        index,
                        op,
                        invoke: o.invoke,
                        complete,
                        outcome: Some(outcome),
                    }),
                    (op, None) => Some(PartOp {
                        index,
                        op,
                        invoke: o.invoke,
                        complete: u64::MAX,
                        outcome: None,
                    }),
                }
            })
            .collect();
        Partition {
            initial: history.initial(key),
            ops,
        }
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub(crate) fn search(&self, limits: &Limits) -> SearchResult {
        let n = self.ops.len();
        // Events 0..2n: event 2i is op i's call, 2i+1 its return. Node `head` (2n) is the
        // list's sentinel.
        let mut order: Vec<usize> = (0..2 * n).collect();
        let time = |e: usize| {
            let op = &self.ops[e / 2];
            if is_call(e) {
                op.invoke
            } else {
                op.complete
            }
        };
        // Calls before returns at the same instant: touching intervals count as
        // concurrent, the lenient reading when clocks have a coarse grain.
        order.sort_by_key(|&e| (time(e), !is_call(e), e));
        let head = 2 * n;
        let mut next = vec![NIL; 2 * n + 1];
        let mut prev = vec![NIL; 2 * n + 1];
        let mut last = head;
        for &e in &order {
            next[last] = e;
            prev[e] = last;
            last = e;
        }

        let words = n.div_ceil(64) as u64;
        // A memo entry: the bit set's words, the state, and the set's and vector's
        // overheads (an estimate, for the limit only).
        let entry_bytes = words * 8 + 8 + 48;
        let mut memo: HashSet<(BitSet, Value)> = HashSet::new();
        let mut linearized = BitSet::new(n);
        let mut calls: Vec<(usize, Value)> = Vec::new();
        let mut state = self.initial;
        let mut explored = 0u64;
        let mut longest_prefix = 0usize;
        let mut blocked = self.ops.first().map_or(0, |o| o.index);

        let over = |explored: u64| {
            if explored > limits.states_explored_max {
                Some("states_explored_max")
            } else if explored.saturating_mul(entry_bytes) > limits.memo_bytes_max {
                Some("memo_bytes_max")
            } else {
                None
            }
        };
        let limit_reached = |limit, explored| SearchResult {
            outcome: SearchOutcome::LimitReached(limit),
            states_explored: explored,
        };
        let unlink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, x: usize| {
            let (p, nx) = (prev[x], next[x]);
            next[p] = nx;
            if nx != NIL {
                prev[nx] = p;
            }
        };
        let relink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, x: usize| {
            let (p, nx) = (prev[x], next[x]);
            next[p] = x;
            if nx != NIL {
                prev[nx] = x;
            }
        };

        let mut entry = next[head];
        // Just arrived at a new configuration: look for an operation to take eagerly.
        let mut arrived = true;
        while next[head] != NIL {
            let mut backtrack = false;
            if arrived {
                arrived = false;
                // A completed read, or a CAS that answered "not swapped", leaves the state
                // as it is wherever it can be placed. If one can be placed now, placing it
                // now is never worse than later (nothing it could wait for changes the
                // state for it, and nothing must precede it that is not already placed),
                // so it is taken at once and no alternative at this configuration is
                // tried: without this, concurrent reads make the memo exponential.
                let mut e = next[head];
                while e != NIL && is_call(e) {
                    let op = &self.ops[e / 2];
                    if op.preserves_state() && step(state, op.op, op.outcome).is_some() {
                        break;
                    }
                    e = next[e];
                }
                if e != NIL && is_call(e) {
                    linearized.set(e / 2);
                    if memo.insert((linearized.clone(), state)) {
                        explored += 1;
                        if let Some(limit) = over(explored) {
                            return limit_reached(limit, explored);
                        }
                        calls.push((e, state));
                        unlink(&mut next, &mut prev, e);
                        unlink(&mut next, &mut prev, e + 1);
                        entry = next[head];
                        arrived = true;
                        continue;
                    }
                    // Explored before, and it failed; so does this configuration.
                    linearized.clear(e / 2);
                    backtrack = true;
                }
            }
            if !backtrack && entry != NIL && is_call(entry) {
                let i = entry / 2;
                let op = &self.ops[i];
                if let Some(new_state) = step(state, op.op, op.outcome) {
                    linearized.set(i);
                    if memo.insert((linearized.clone(), new_state)) {
                        explored += 1;
                        if let Some(limit) = over(explored) {
                            return limit_reached(limit, explored);
                        }
                        calls.push((entry, state));
                        state = new_state;
                        // Lift the call and its return out of the list.
                        unlink(&mut next, &mut prev, entry);
                        unlink(&mut next, &mut prev, entry + 1);
                        entry = next[head];
                        arrived = true;
                        continue;
                    }
                    linearized.clear(i);
                }
                entry = next[entry];
                continue;
            }
            // A return whose call is not linearized yet, or a configuration known to
            // fail: this order cannot go on.
            if !backtrack && entry != NIL && calls.len() >= longest_prefix {
                longest_prefix = calls.len();
                blocked = self.ops[entry / 2].index;
            }
            loop {
                let Some((call, before)) = calls.pop() else {
                    return SearchResult {
                        outcome: SearchOutcome::Violation {
                            longest_prefix,
                            blocked,
                        },
                        states_explored: explored,
                    };
                };
                state = before;
                linearized.clear(call / 2);
                relink(&mut next, &mut prev, call + 1);
                relink(&mut next, &mut prev, call);
                entry = next[call];
                // An operation taken eagerly stood for every alternative at its
                // configuration: its failure is the configuration's.
                if !self.ops[call / 2].preserves_state() {
                    break;
                }
            }
        }
        SearchResult {
            outcome: SearchOutcome::Linearizable,
            states_explored: explored,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_follows_the_register() {
        assert_eq!(step(3, Op::Read, Some(Outcome::Read(3))), Some(3));
        assert_eq!(step(3, Op::Read, Some(Outcome::Read(4))), None);
        assert_eq!(step(3, Op::Write(9), Some(Outcome::Written)), Some(9));
        let cas = Op::Cas {
            expected: 3,
            new: 5,
        };
        assert_eq!(step(3, cas, Some(Outcome::Cas { swapped: true })), Some(5));
        assert_eq!(step(4, cas, Some(Outcome::Cas { swapped: true })), None);
        assert_eq!(step(4, cas, Some(Outcome::Cas { swapped: false })), Some(4));
        assert_eq!(step(3, cas, Some(Outcome::Cas { swapped: false })), None);
        assert_eq!(step(3, cas, None), Some(5));
        assert_eq!(step(4, cas, None), Some(4));
    }
}
