//! A chaos run's history — every operation's invocation and return — and the checkers
//! that judge it: acknowledged-writes-present (the state found after healing) and
//! single-key linearizability (every read as well, by `camelot-check`). Pure.
//!
//! The model is a set of registers (a RAID block, an RVM counter), each starting at 0
//! and written with values unique to their write. A write that returned Ok took effect
//! before it returned. Acknowledged-writes-present takes a write that returned an error
//! to have taken effect or not before it returned, so the value found in a register
//! after the run may be that of any write *not superseded*: a write is superseded when
//! an acknowledged write of the same register was invoked after it returned (real time
//! orders them, so the later one must win). Linearizability asks the same of every read
//! during the run, not only of the final state — each must return what some order of
//! the operations, consistent with real time, would have left there — and is more
//! lenient with failed writes: one may take effect at any time after its invocation.

use std::collections::BTreeMap;

use camelot_check::{History, Limits, Outcome, Verdict};
use serde::{Deserialize, Serialize};

/// Most operations one history may hold (a bound on what a worker reports).
pub const HISTORY_OPS_MAX: usize = 4_000_000;

/// What a read that found bytes no write wrote returned, as a register value: no write
/// writes it (values count up from 1), so a history holding it is not linearizable.
pub const GARBAGE_VALUE: u64 = u64::MAX;

/// The linearizability search may explore this many states per operation of the
/// history (at least `camelot_check`'s default): a history of one client is nearly
/// sequential, so it needs about one state per operation plus one per operation after
/// each unacknowledged write.
pub const STATES_PER_OP: u64 = 16;

/// What an operation did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Set the register to this value (never 0).
    Write(u64),
    /// Read the register: what was found (`Unreadable` when the read failed).
    Read(Found),
}

/// One operation of client `client` on register `key`, invoked and returned at these
/// times (µs from the run's start), acknowledged (Ok) or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Op {
    #[serde(default)]
    pub client: u32,
    pub key: u64,
    pub action: Action,
    pub invoked_us: u64,
    pub returned_us: u64,
    pub acked: bool,
}

impl Op {
    pub fn write_value(&self) -> Option<u64> {
        match self.action {
            Action::Write(v) => Some(v),
            Action::Read(_) => None,
        }
    }
}

/// What was found in a register (after the run, or by a read).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Found {
    Value(u64),
    /// Bytes that are no write's (torn, corrupt).
    Garbage,
    /// Could not be read at all.
    Unreadable,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    pub key: u64,
    pub found: Found,
    /// The acknowledged write that should have been there, or a later one.
    pub last_acked_value: Option<u64>,
    pub why: String,
}

/// Judges `found` (every register the history wrote, and any other the reader looked
/// at) against the history's writes (its reads are not looked at). Returns every
/// violation; empty means the check passed.
pub fn check_acked_writes_present(history: &[Op], found: &BTreeMap<u64, Found>) -> Vec<Violation> {
    // (value, invoked, returned, acked) of each write, per key.
    let mut by_key: BTreeMap<u64, Vec<(u64, u64, u64, bool)>> = BTreeMap::new();
    for op in history {
        if let Some(v) = op.write_value() {
            by_key
                .entry(op.key)
                .or_default()
                .push((v, op.invoked_us, op.returned_us, op.acked));
        }
    }
    let mut violations = Vec::new();
    for (&key, ops) in &by_key {
        let last_acked = ops.iter().filter(|o| o.3).max_by_key(|o| o.1).map(|o| o.0);
        let f = found.get(&key).copied().unwrap_or(Found::Unreadable);
        let why = match f {
            Found::Unreadable => Some("could not be read after healing".to_string()),
            Found::Garbage => Some("holds bytes no write wrote".to_string()),
            Found::Value(0) if last_acked.is_some() => {
                Some("is empty although a write to it was acknowledged".to_string())
            }
            Found::Value(0) => None,
            Found::Value(v) => match ops.iter().find(|o| o.0 == v) {
                None => Some(format!("holds value {v}, which no write of it wrote")),
                // A write that was not acknowledged (a timeout, a lost connection) may
                // land at any time after it was invoked — a request can sit in a paused
                // server's socket, or in TCP's retransmission queue across a partition,
                // long after its client gave up — so it may follow any later write.
                Some(w) if !w.3 => None,
                Some(w) => ops.iter().find(|o| o.3 && o.1 > w.2).map(|later| {
                    format!(
                        "holds value {v} (returned at {} µs), but the write of {} \
                         invoked later, at {} µs, was acknowledged",
                        w.2, later.0, later.1
                    )
                }),
            },
        };
        if let Some(why) = why {
            violations.push(Violation {
                key,
                found: f,
                last_acked_value: last_acked,
                why,
            });
        }
    }
    for (&key, &f) in found {
        if !by_key.contains_key(&key) && f != Found::Value(0) {
            violations.push(Violation {
                key,
                found: f,
                last_acked_value: None,
                why: "was never written but is not empty".into(),
            });
        }
    }
    violations
}

/// What the linearizability checker said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Linearizability {
    /// Every key's operations, final reads included, have a legal order.
    Linearizable { keys: usize, operations: usize },
    /// One key's have none: `why` names the key and the operation the search could not
    /// place at the deepest point it reached.
    NotLinearizable { key: u64, why: String },
    /// The search hit a limit before deciding: nothing was checked on that key.
    Inconclusive { key: u64, limit: &'static str },
}

impl Linearizability {
    pub fn passed(&self) -> bool {
        matches!(self, Linearizability::Linearizable { .. })
    }
}

fn register_value(f: Found) -> Option<u64> {
    match f {
        Found::Value(v) => Some(v),
        Found::Garbage => Some(GARBAGE_VALUE),
        Found::Unreadable => None,
    }
}

/// Checks `history` for single-key linearizability with `camelot-check`, the state
/// `found` after healing counting as one more read of each register, after every
/// operation. An unacknowledged write may take effect at any point after its invocation
/// or never; a read that failed constrains nothing.
pub fn check_linearizable(history: &[Op], found: &BTreeMap<u64, Found>) -> Linearizability {
    let mut h: History<u64> = History::new(0);
    let end_us = history.iter().map(|o| o.returned_us).max().unwrap_or(0) + 1;
    let reads_after = found.iter().map(|(&key, &f)| Op {
        client: u32::MAX,
        key,
        action: Action::Read(f),
        invoked_us: end_us,
        returned_us: end_us,
        acked: f != Found::Unreadable,
    });
    for (i, op) in history.iter().copied().chain(reads_after).enumerate() {
        let (check_op, outcome) = match op.action {
            Action::Write(v) => (camelot_check::Op::Write(v), Outcome::Written),
            Action::Read(f) => match register_value(f) {
                Some(v) => (camelot_check::Op::Read, Outcome::Read(v)),
                None => (camelot_check::Op::Read, Outcome::Read(0)),
            },
        };
        let answered = op.acked && !matches!(op.action, Action::Read(Found::Unreadable));
        let completion = answered.then_some((op.returned_us.max(op.invoked_us), outcome));
        if let Err(e) = h.push(op.client, op.key, check_op, op.invoked_us, completion) {
            return Linearizability::NotLinearizable {
                key: op.key,
                why: format!("operation {i} cannot be checked: {e}"),
            };
        }
    }
    let ops = h.len() as u64;
    let limits = Limits {
        states_explored_max: (ops.saturating_mul(STATES_PER_OP))
            .max(camelot_check::STATES_EXPLORED_MAX_DEFAULT),
        ..Limits::default()
    };
    let report = camelot_check::check(&h, &limits);
    match report.verdict {
        Verdict::Linearizable => Linearizability::Linearizable {
            keys: report.keys,
            operations: report.operations,
        },
        Verdict::NotLinearizable(v) => {
            let blocked = match h.operations().get(v.blocked) {
                Some(o) => {
                    let answer = match o.completion {
                        Some((at, outcome)) => format!("answered {outcome:?} at {at} µs"),
                        None => "never answered".to_string(),
                    };
                    format!("{:?} invoked at {} µs, {answer}", o.op, o.invoke)
                }
                None => format!("operation {}", v.blocked),
            };
            Linearizability::NotLinearizable {
                key: v.key,
                why: format!(
                    "key {}: no order of its {} operations is legal; the longest legal \
                     prefix has {}, and the {blocked} could not be placed after it",
                    v.key, v.operations, v.longest_prefix
                ),
            }
        }
        Verdict::Inconclusive { key, limit } => Linearizability::Inconclusive { key, limit },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn w(key: u64, value: u64, t: u64, acked: bool) -> Op {
        Op {
            client: 0,
            key,
            action: Action::Write(value),
            invoked_us: t,
            returned_us: t + 5,
            acked,
        }
    }

    fn r(key: u64, found: Found, t: u64) -> Op {
        Op {
            client: 0,
            key,
            action: Action::Read(found),
            invoked_us: t,
            returned_us: t + 5,
            acked: found != Found::Unreadable,
        }
    }

    #[test]
    fn the_last_acked_write_or_a_later_one_passes() {
        let h = [w(1, 1, 0, true), w(1, 2, 10, false), w(1, 3, 20, false)];
        for v in [1, 2, 3] {
            let found = BTreeMap::from([(1, Found::Value(v))]);
            assert!(check_acked_writes_present(&h, &found).is_empty(), "{v}");
        }
    }

    #[test]
    fn a_lost_acked_write_fails() {
        let h = [w(1, 1, 0, true), w(1, 2, 10, true)];
        let v = check_acked_writes_present(&h, &BTreeMap::from([(1, Found::Value(1))]));
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].last_acked_value, Some(2));
        let v = check_acked_writes_present(&h, &BTreeMap::from([(1, Found::Value(0))]));
        assert_eq!(v.len(), 1);
        for f in [Found::Garbage, Found::Unreadable, Found::Value(99)] {
            assert_eq!(
                check_acked_writes_present(&h, &BTreeMap::from([(1, f)])).len(),
                1
            );
        }
        // Never written but found non-empty.
        let v = check_acked_writes_present(&[], &BTreeMap::from([(7, Found::Value(3))]));
        assert_eq!(v.len(), 1);
    }

    /// Seed 215 of the kv face: a PUT sent while its primary was cut off timed out at the
    /// client, sat in TCP's retransmission queue, and landed after another client's
    /// acknowledged write — the final value is the unacknowledged one. Not a lost write.
    #[test]
    fn an_unacknowledged_write_may_land_after_a_later_acknowledged_one() {
        let h = [w(1, 1, 0, true), w(1, 2, 10, false), w(1, 3, 20, true)];
        let found = BTreeMap::from([(1, Found::Value(2))]);
        assert!(check_acked_writes_present(&h, &found).is_empty());
        assert!(check_linearizable(&h, &found).passed());
        // But an acknowledged write is bounded by its answer.
        let found = BTreeMap::from([(1, Found::Value(1))]);
        assert_eq!(check_acked_writes_present(&h, &found).len(), 1);
    }

    #[test]
    fn overlapping_writes_may_land_either_way() {
        // Two acked writes whose spans overlap: neither supersedes the other.
        let h = [
            Op {
                client: 0,
                key: 1,
                action: Action::Write(1),
                invoked_us: 0,
                returned_us: 100,
                acked: true,
            },
            Op {
                client: 1,
                key: 1,
                action: Action::Write(2),
                invoked_us: 50,
                returned_us: 60,
                acked: true,
            },
        ];
        for v in [1, 2] {
            let found = BTreeMap::from([(1, Found::Value(v))]);
            assert!(check_acked_writes_present(&h, &found).is_empty());
            assert!(check_linearizable(&h, &found).passed());
        }
    }

    #[test]
    fn reads_of_the_last_write_or_a_pending_one_are_linearizable() {
        let h = [
            w(1, 1, 0, true),
            r(1, Found::Value(1), 10),
            w(1, 2, 20, false),
            r(1, Found::Value(1), 30),
            r(1, Found::Value(2), 40),
            r(1, Found::Unreadable, 50),
            r(2, Found::Value(0), 60),
        ];
        let found = BTreeMap::from([(1, Found::Value(2)), (2, Found::Value(0))]);
        assert!(check_linearizable(&h, &found).passed());
    }

    #[test]
    fn a_stale_read_a_garbage_read_and_a_lost_write_are_not_linearizable() {
        let base = [w(1, 1, 0, true), w(1, 2, 10, true)];
        let found = BTreeMap::from([(1, Found::Value(2))]);
        assert!(check_linearizable(&base, &found).passed());
        // A read after the second write returned, answering the first's value.
        let mut stale = base.to_vec();
        stale.push(r(1, Found::Value(1), 20));
        assert!(matches!(
            check_linearizable(&stale, &found),
            Linearizability::NotLinearizable { key: 1, .. }
        ));
        let mut garbage = base.to_vec();
        garbage.push(r(1, Found::Garbage, 20));
        assert!(!check_linearizable(&garbage, &found).passed());
        // The final state counts as a read: an acknowledged write lost.
        let lost = BTreeMap::from([(1, Found::Value(1))]);
        assert!(!check_linearizable(&base, &lost).passed());
        // A read that flips back: new, then old, with the old write acknowledged before.
        let flip = [
            w(1, 1, 0, true),
            w(1, 2, 10, false),
            r(1, Found::Value(2), 20),
            r(1, Found::Value(1), 30),
        ];
        assert!(!check_linearizable(&flip, &BTreeMap::new()).passed());
    }

    /// A sequential history over a few keys; failed writes take effect or not at random.
    fn run_model(ops: &[(u64, bool, bool)]) -> (Vec<Op>, BTreeMap<u64, Found>) {
        let mut state = BTreeMap::new();
        let mut history = Vec::new();
        for (i, &(key, acked, lands_anyway)) in ops.iter().enumerate() {
            let value = i as u64 + 1;
            history.push(w(key, value, i as u64 * 10, acked));
            if acked || lands_anyway {
                state.insert(key, Found::Value(value));
            }
        }
        for op in &history {
            state.entry(op.key).or_insert(Found::Value(0));
        }
        (history, state)
    }

    proptest! {
        #[test]
        fn a_correct_store_passes(ops in proptest::collection::vec((0u64..4, any::<bool>(), any::<bool>()), 0..60)) {
            let (h, found) = run_model(&ops);
            prop_assert!(check_acked_writes_present(&h, &found).is_empty());
            prop_assert!(check_linearizable(&h, &found).passed());
        }

        /// The checker can fail: rolling any key whose last acknowledged write is its
        /// final value back to what it held before that write is always caught.
        #[test]
        fn losing_an_acked_write_is_caught(ops in proptest::collection::vec((0u64..4, any::<bool>(), any::<bool>()), 1..60), pick: proptest::sample::Index) {
            let (h, mut found) = run_model(&ops);
            let candidates: Vec<&Op> = h.iter().filter(|o| o.acked && o.write_value().is_some_and(|v| found.get(&o.key) == Some(&Found::Value(v)))).collect();
            prop_assume!(!candidates.is_empty());
            let victim = *pick.get(&candidates);
            let earlier = h.iter().filter(|o| o.key == victim.key && o.invoked_us < victim.invoked_us).rfind(|o| o.write_value().is_some());
            let before = earlier.and_then(|o| o.write_value()).unwrap_or(0);
            found.insert(victim.key, Found::Value(before));
            // An unacknowledged write may land at any time after its invocation (a
            // request may sit in a paused server's socket), so only a rollback to an
            // acknowledged write or to the initial 0 is sure to fail either checker.
            if earlier.is_none_or(|o| o.acked) {
                prop_assert!(!check_acked_writes_present(&h, &found).is_empty());
                prop_assert!(!check_linearizable(&h, &found).passed());
            }
        }
    }
}
