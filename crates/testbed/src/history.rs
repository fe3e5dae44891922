//! A chaos run's history — every write's invocation and return — and the checker that
//! judges the state found after healing: acknowledged writes present. Pure.
//!
//! The model is a set of registers (a RAID block, the RVM counter), each starting at 0
//! and written with values unique to their write. A write that returned an error may or
//! may not have taken effect, at any moment before it returned; one that returned Ok
//! took effect before it returned. So the value found in a register after the run may
//! be that of any write *not superseded*: a write is superseded when an acknowledged
//! write of the same register was invoked after it returned (real time orders them, so
//! the later one must win). The single-key linearizability checker (the KV R=2 face)
//! will judge reads as well; this one judges the final state only.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Most operations one history may hold (a bound on what a worker reports).
pub const HISTORY_OPS_MAX: usize = 4_000_000;

/// One write: register `key` set to `value` (never 0), invoked and returned at these
/// times (µs from the run's start), acknowledged or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteOp {
    pub key: u64,
    pub value: u64,
    pub invoked_us: u64,
    pub returned_us: u64,
    pub acked: bool,
}

/// What was found in a register after the run.
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
/// at) against `history`. Returns every violation; empty means the check passed.
pub fn check_acked_writes_present(
    history: &[WriteOp],
    found: &BTreeMap<u64, Found>,
) -> Vec<Violation> {
    let mut by_key: BTreeMap<u64, Vec<&WriteOp>> = BTreeMap::new();
    for op in history {
        by_key.entry(op.key).or_default().push(op);
    }
    let mut violations = Vec::new();
    for (&key, ops) in &by_key {
        let last_acked = ops
            .iter()
            .filter(|o| o.acked)
            .max_by_key(|o| o.invoked_us)
            .map(|o| o.value);
        let f = found.get(&key).copied().unwrap_or(Found::Unreadable);
        let why = match f {
            Found::Unreadable => Some("could not be read after healing".to_string()),
            Found::Garbage => Some("holds bytes no write wrote".to_string()),
            Found::Value(0) if last_acked.is_some() => {
                Some("is empty although a write to it was acknowledged".to_string())
            }
            Found::Value(0) => None,
            Found::Value(v) => match ops.iter().find(|o| o.value == v) {
                None => Some(format!("holds value {v}, which no write of it wrote")),
                Some(w) => ops
                    .iter()
                    .find(|o| o.acked && o.invoked_us > w.returned_us)
                    .map(|later| {
                        format!(
                            "holds value {v} (returned at {} µs), but the write of {} \
                             invoked later, at {} µs, was acknowledged",
                            w.returned_us, later.value, later.invoked_us
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn w(key: u64, value: u64, t: u64, acked: bool) -> WriteOp {
        WriteOp {
            key,
            value,
            invoked_us: t,
            returned_us: t + 5,
            acked,
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

    #[test]
    fn overlapping_writes_may_land_either_way() {
        // Two acked writes whose spans overlap: neither supersedes the other.
        let h = [
            WriteOp {
                key: 1,
                value: 1,
                invoked_us: 0,
                returned_us: 100,
                acked: true,
            },
            WriteOp {
                key: 1,
                value: 2,
                invoked_us: 50,
                returned_us: 60,
                acked: true,
            },
        ];
        for v in [1, 2] {
            let found = BTreeMap::from([(1, Found::Value(v))]);
            assert!(check_acked_writes_present(&h, &found).is_empty());
        }
    }

    /// A sequential history over a few keys; failed writes take effect or not at random.
    fn run_model(ops: &[(u64, bool, bool)]) -> (Vec<WriteOp>, BTreeMap<u64, Found>) {
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
        }

        /// The checker can fail: rolling any key whose last acknowledged write is its
        /// final value back to what it held before that write is always caught.
        #[test]
        fn losing_an_acked_write_is_caught(ops in proptest::collection::vec((0u64..4, any::<bool>(), any::<bool>()), 1..60), pick: proptest::sample::Index) {
            let (h, mut found) = run_model(&ops);
            let candidates: Vec<&WriteOp> = h.iter().filter(|o| o.acked && found.get(&o.key) == Some(&Found::Value(o.value))).collect();
            prop_assume!(!candidates.is_empty());
            let victim = *pick.get(&candidates);
            let before = h.iter().filter(|o| o.key == victim.key && o.invoked_us < victim.invoked_us).map(|o| o.value).next_back().unwrap_or(0);
            found.insert(victim.key, Found::Value(before));
            prop_assert!(!check_acked_writes_present(&h, &found).is_empty());
        }
    }
}
