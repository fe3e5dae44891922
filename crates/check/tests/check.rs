//! Known histories both ways, then generated ones: any history recorded from a sequential
//! execution with its intervals stretched around the linearization points must pass, and
//! the same history with one stale read injected must fail.

use camelot_check::{check, CheckError, History, Limits, Op, Outcome, Verdict};
use proptest::prelude::*;

fn read(v: u64) -> Outcome {
    Outcome::Read(v)
}
const W: Outcome = Outcome::Written;
fn cas(expected: u64, new: u64) -> Op {
    Op::Cas { expected, new }
}
fn swapped(s: bool) -> Outcome {
    Outcome::Cas { swapped: s }
}

fn verdict(h: &History<&'static str>) -> Verdict<&'static str> {
    check(h, &Limits::default()).verdict
}

fn assert_linearizable(h: &History<&'static str>) {
    let v = verdict(h);
    assert_eq!(v, Verdict::Linearizable, "{h:?}");
}

fn assert_violation(h: &History<&'static str>) -> camelot_check::Violation<&'static str> {
    match verdict(h) {
        Verdict::NotLinearizable(v) => v,
        other => panic!("expected a violation, got {other:?} for {h:?}"),
    }
}

#[test]
fn sequential_write_then_read_is_linearizable() {
    let mut h = History::new(0);
    h.push(0, "x", Op::Write(1), 0, Some((10, W))).unwrap();
    h.push(1, "x", Op::Read, 11, Some((20, read(1)))).unwrap();
    assert_linearizable(&h);
}

#[test]
fn a_read_after_a_completed_write_that_sees_the_old_value_fails() {
    let mut h = History::new(0);
    h.push(0, "x", Op::Write(1), 0, Some((10, W))).unwrap();
    h.push(1, "x", Op::Read, 11, Some((20, read(0)))).unwrap();
    let v = assert_violation(&h);
    assert_eq!(v.key, "x");
    assert_eq!(v.operations, 2);
}

#[test]
fn a_read_overlapping_a_write_may_see_either_value() {
    for seen in [0, 1] {
        let mut h = History::new(0);
        h.push(0, "x", Op::Write(1), 0, Some((10, W))).unwrap();
        h.push(1, "x", Op::Read, 5, Some((15, read(seen)))).unwrap();
        assert_linearizable(&h);
    }
}

#[test]
fn new_then_old_inversion_fails() {
    // Both reads overlap the write, but the second starts after the first ended: once a
    // reader has seen the new value, a later reader may not see the old one.
    let mut h = History::new(0);
    h.push(0, "x", Op::Write(1), 0, Some((100, W))).unwrap();
    h.push(1, "x", Op::Read, 10, Some((20, read(1)))).unwrap();
    h.push(2, "x", Op::Read, 30, Some((40, read(0)))).unwrap();
    assert_violation(&h);
    // The other order is fine.
    let mut h = History::new(0);
    h.push(0, "x", Op::Write(1), 0, Some((100, W))).unwrap();
    h.push(1, "x", Op::Read, 10, Some((20, read(0)))).unwrap();
    h.push(2, "x", Op::Read, 30, Some((40, read(1)))).unwrap();
    assert_linearizable(&h);
}

#[test]
fn two_cas_from_the_same_value_cannot_both_win() {
    let mut h = History::new(0);
    h.push(0, "x", cas(0, 1), 0, Some((10, swapped(true))))
        .unwrap();
    h.push(1, "x", cas(0, 2), 0, Some((10, swapped(true))))
        .unwrap();
    assert_violation(&h);
    // One winner, one loser, then a read of the winner's value: fine.
    let mut h = History::new(0);
    h.push(0, "x", cas(0, 1), 0, Some((10, swapped(false))))
        .unwrap();
    h.push(1, "x", cas(0, 2), 0, Some((10, swapped(true))))
        .unwrap();
    h.push(2, "x", Op::Read, 11, Some((12, read(2)))).unwrap();
    assert_linearizable(&h);
}

#[test]
fn a_failed_cas_needs_a_different_value() {
    let mut h = History::new(0);
    h.push(0, "x", cas(0, 1), 0, Some((10, swapped(false))))
        .unwrap();
    assert_violation(&h);
    // A concurrent write explains it.
    h.push(1, "x", Op::Write(7), 0, Some((10, W))).unwrap();
    assert_linearizable(&h);
}

#[test]
fn a_write_that_never_completed_may_or_may_not_have_taken_effect() {
    // Never observed: fine.
    let mut h = History::new(0);
    h.push(0, "x", Op::Write(1), 0, None).unwrap();
    h.push(1, "x", Op::Read, 10, Some((20, read(0)))).unwrap();
    assert_linearizable(&h);
    // Observed long after its client gave up: fine too.
    h.push(1, "x", Op::Read, 1_000, Some((1_010, read(1))))
        .unwrap();
    assert_linearizable(&h);
    // But once observed it cannot be undone.
    h.push(2, "x", Op::Read, 2_000, Some((2_010, read(0))))
        .unwrap();
    assert_violation(&h);
}

#[test]
fn a_pending_write_cannot_take_effect_before_it_is_invoked() {
    let mut h = History::new(0);
    h.push(1, "x", Op::Read, 0, Some((10, read(1)))).unwrap();
    h.push(0, "x", Op::Write(1), 20, None).unwrap();
    assert_violation(&h);
}

#[test]
fn a_pending_cas_applies_only_where_it_would_swap() {
    let mut h = History::new(0);
    h.push(0, "x", cas(5, 6), 0, None).unwrap();
    h.push(1, "x", Op::Read, 10, Some((20, read(6)))).unwrap();
    assert_violation(&h);
    let mut h = History::new(5);
    h.push(0, "x", cas(5, 6), 0, None).unwrap();
    h.push(1, "x", Op::Read, 10, Some((20, read(6)))).unwrap();
    assert_linearizable(&h);
}

#[test]
fn pending_reads_are_ignored() {
    let mut h = History::new(0);
    h.push(0, "x", Op::Read, 0, None).unwrap();
    h.push(1, "x", Op::Write(3), 5, Some((6, W))).unwrap();
    assert_linearizable(&h);
}

#[test]
fn keys_are_independent_and_the_violating_key_is_named() {
    let mut h = History::new(0);
    h.push(0, "a", Op::Write(1), 0, Some((10, W))).unwrap();
    h.push(1, "b", Op::Write(2), 0, Some((10, W))).unwrap();
    // Reading 1 on b is impossible even though a holds 1.
    h.push(2, "b", Op::Read, 20, Some((30, read(1)))).unwrap();
    h.push(2, "a", Op::Read, 20, Some((30, read(1)))).unwrap();
    let v = assert_violation(&h);
    assert_eq!(v.key, "b");
    assert_eq!(v.blocked, 2, "the read on b is where the search got stuck");
    let mut h2 = History::new(0);
    h2.set_initial("b", 1);
    h2.push(2, "b", Op::Read, 20, Some((30, read(1)))).unwrap();
    assert_linearizable(&h2);
}

#[test]
fn malformed_operations_are_refused() {
    let mut h: History<&str> = History::new(0);
    assert!(matches!(
        h.push(0, "x", Op::Read, 0, Some((1, W))),
        Err(CheckError::OutcomeMismatch { .. })
    ));
    assert!(matches!(
        h.push(0, "x", Op::Write(1), 10, Some((5, W))),
        Err(CheckError::CompletesBeforeInvoke { .. })
    ));
    assert!(h.is_empty());
}

#[test]
fn the_search_stops_at_its_limit_and_says_so() {
    // 40 writes all concurrent and a read that saw none of their values: every order of
    // the writes is a distinct state set, far past a tiny limit.
    let mut h = History::new(0);
    for c in 0..40 {
        h.push(c, "x", Op::Write(u64::from(c) + 1), 0, Some((100, W)))
            .unwrap();
    }
    h.push(99, "x", Op::Read, 50, Some((60, read(999))))
        .unwrap();
    let limits = Limits {
        states_explored_max: 1_000,
        ..Limits::default()
    };
    let report = check(&h, &limits);
    assert_eq!(
        report.verdict,
        Verdict::Inconclusive {
            key: "x",
            limit: "states_explored_max"
        }
    );
    assert!(report.states_explored <= 1_001);
    let limits = Limits {
        memo_bytes_max: 10_000,
        ..Limits::default()
    };
    assert_eq!(
        check(&h, &limits).verdict,
        Verdict::Inconclusive {
            key: "x",
            limit: "memo_bytes_max"
        }
    );
}

#[test]
fn many_concurrent_clients_are_decided_quickly() {
    // 32 clients, 20 rounds each, each round all overlapping: the memo keeps this small.
    let mut h = History::new(0);
    let mut value = 0;
    let mut t = 0;
    for _round in 0..20 {
        for c in 0..32u32 {
            if c % 4 == 0 {
                value += 1;
                h.push(c, "x", Op::Write(value), t, Some((t + 100, W)))
                    .unwrap();
            } else {
                h.push(c, "x", Op::Read, t + 1, Some((t + 99, read(value))))
                    .unwrap();
            }
        }
        t += 200;
    }
    let report = check(&h, &Limits::default());
    assert!(report.is_linearizable(), "{:?}", report.verdict);
}

// ---- generated histories ----

#[derive(Debug, Clone)]
enum Kind {
    Read,
    Write,
    /// CAS expecting the current value (true) or a stale one.
    Cas(bool),
}

#[derive(Debug, Clone)]
struct Planned {
    key: u8,
    kind: Kind,
    before: u64,
    after: u64,
    /// Its client never heard back.
    pending: bool,
}

fn planned() -> impl Strategy<Value = Planned> {
    (
        0u8..3,
        prop_oneof![
            3 => Just(Kind::Read),
            2 => Just(Kind::Write),
            1 => any::<bool>().prop_map(Kind::Cas),
        ],
        0u64..60,
        0u64..60,
        prop::bool::weighted(0.1),
    )
        .prop_map(|(key, kind, before, after, pending)| Planned {
            key,
            kind,
            before,
            after,
            pending,
        })
}

/// Runs the plan sequentially (operation i takes effect at 100·i + 100) and records each
/// operation with its interval stretched around that instant. Every value written is new.
fn record(plan: &[Planned]) -> History<u8> {
    let mut h = History::new(0);
    let mut state = [0u64; 3];
    let mut fresh = 1u64;
    for (i, p) in plan.iter().enumerate() {
        let at = 100 * i as u64 + 100;
        let (invoke, complete) = (at - p.before, at + p.after);
        let k = usize::from(p.key);
        let (op, outcome) = match p.kind {
            Kind::Read => (Op::Read, Outcome::Read(state[k])),
            Kind::Write => {
                fresh += 1;
                state[k] = fresh;
                (Op::Write(fresh), Outcome::Written)
            }
            Kind::Cas(current) => {
                fresh += 1;
                let expected = if current {
                    state[k]
                } else {
                    state[k] + 1_000_000
                };
                let swapped = expected == state[k];
                if swapped {
                    state[k] = fresh;
                }
                (
                    Op::Cas {
                        expected,
                        new: fresh,
                    },
                    Outcome::Cas { swapped },
                )
            }
        };
        let completion = (!p.pending).then_some((complete, outcome));
        h.push(i as u32, p.key, op, invoke, completion).unwrap();
    }
    h
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn recorded_sequential_executions_are_linearizable(plan in prop::collection::vec(planned(), 0..80)) {
        let h = record(&plan);
        let report = check(&h, &Limits::default());
        prop_assert!(report.is_linearizable(), "{:?}\n{:?}", report.verdict, h);
    }

    /// A write that never happened and never answered changes nothing either.
    #[test]
    fn an_extra_pending_write_keeps_it_linearizable(
        plan in prop::collection::vec(planned(), 1..60),
        at in 0usize..60,
    ) {
        let mut h = record(&plan);
        let invoke = 100 * (at % plan.len()) as u64;
        h.push(999, plan[at % plan.len()].key, Op::Write(u64::MAX), invoke, None).unwrap();
        prop_assert!(check(&h, &Limits::default()).is_linearizable());
    }

    #[test]
    fn a_stale_read_injected_fails(
        plan in prop::collection::vec(planned(), 0..80),
        gap in 1u64..50,
    ) {
        let mut h = record(&plan);
        // Two completed writes on one key, the first finished before the second began:
        // after the second completes, the first's value is gone for good (values are
        // never written twice), so reading it then is stale.
        let ops = h.operations().to_vec();
        let mut stale = None;
        'outer: for (i, a) in ops.iter().enumerate() {
            let (Op::Write(old), Some((a_done, _))) = (a.op, a.completion) else { continue };
            for b in &ops[i + 1..] {
                if b.key != a.key { continue }
                if let (Op::Write(_), Some((b_done, _))) = (b.op, b.completion) {
                    if a_done < b.invoke {
                        stale = Some((a.key, old, b_done));
                        break 'outer;
                    }
                }
            }
        }
        let end = 100 * plan.len() as u64 + 1_000;
        let (key, old, after) = match stale {
            Some(s) => s,
            None => {
                // No such pair: make one past the end.
                h.push(900, 0, Op::Write(u64::MAX - 1), end, Some((end + 1, Outcome::Written))).unwrap();
                h.push(901, 0, Op::Write(u64::MAX - 2), end + 2, Some((end + 3, Outcome::Written))).unwrap();
                (0, u64::MAX - 1, end + 3)
            }
        };
        h.push(1_000, key, Op::Read, after + gap, Some((after + gap + 5, Outcome::Read(old)))).unwrap();
        let report = check(&h, &Limits::default());
        match report.verdict {
            Verdict::NotLinearizable(v) => prop_assert_eq!(v.key, key),
            other => prop_assert!(false, "stale read of {} on key {} passed: {:?}\n{:?}", old, key, other, h),
        }
    }
}

/// Every order of the operations, each either placed (in real-time order) or, if it never
/// completed, possibly left out: the definition, for small histories.
fn brute_force(h: &History<u8>) -> bool {
    let ops: Vec<_> = h
        .operations()
        .iter()
        .filter(|o| !(o.op == Op::Read && o.completion.is_none()))
        .cloned()
        .collect();
    fn go(ops: &[camelot_check::Operation<u8>], placed: &mut Vec<bool>, state: u64) -> bool {
        if placed.iter().all(|p| *p) {
            return true;
        }
        // Operations nobody is waiting for may be left out altogether.
        if ops
            .iter()
            .zip(placed.iter())
            .all(|(o, p)| *p || o.completion.is_none())
        {
            return true;
        }
        for i in 0..ops.len() {
            if placed[i] {
                continue;
            }
            // Not before an unplaced operation that completed before i was invoked.
            let blocked = ops
                .iter()
                .zip(placed.iter())
                .any(|(o, p)| !*p && o.completion.is_some_and(|(done, _)| done < ops[i].invoke));
            if blocked {
                continue;
            }
            let outcome = ops[i].completion.map(|(_, o)| o);
            let next = match (ops[i].op, outcome) {
                (Op::Read, Some(Outcome::Read(v))) => (v == state).then_some(state),
                (Op::Write(v), _) => Some(v),
                (Op::Cas { expected, new }, Some(Outcome::Cas { swapped: true })) => {
                    (state == expected).then_some(new)
                }
                (Op::Cas { expected, .. }, Some(Outcome::Cas { swapped: false })) => {
                    (state != expected).then_some(state)
                }
                (Op::Cas { expected, new }, None) => {
                    Some(if state == expected { new } else { state })
                }
                _ => None,
            };
            if let Some(s) = next {
                placed[i] = true;
                if go(ops, placed, s) {
                    return true;
                }
                placed[i] = false;
            }
        }
        false
    }
    go(&ops, &mut vec![false; ops.len()], h.initial(&0))
}

fn small_op() -> impl Strategy<Value = (Op, u64, u64, Option<Outcome>)> {
    let value = 0u64..3;
    (
        prop_oneof![
            Just(Op::Read),
            value.clone().prop_map(Op::Write),
            (value.clone(), value.clone()).prop_map(|(expected, new)| Op::Cas { expected, new }),
        ],
        0u64..20,
        0u64..10,
        value,
        any::<bool>(),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(op, invoke, len, v, swapped, pending)| {
            let outcome = match op {
                Op::Read => Outcome::Read(v),
                Op::Write(_) => Outcome::Written,
                Op::Cas { .. } => Outcome::Cas { swapped },
            };
            (op, invoke, invoke + len, (!pending).then_some(outcome))
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Random small histories, most of them not linearizable: the search (with its memo
    /// and its eager placement of reads and failed CASes) agrees with trying every order.
    #[test]
    fn agrees_with_brute_force_on_small_histories(ops in prop::collection::vec(small_op(), 0..7)) {
        let mut h = History::new(0);
        for (i, (op, invoke, complete, outcome)) in ops.into_iter().enumerate() {
            h.push(i as u32, 0u8, op, invoke, outcome.map(|o| (complete, o))).unwrap();
        }
        let expected = brute_force(&h);
        let report = check(&h, &Limits::default());
        prop_assert_eq!(report.is_linearizable(), expected, "{:?}", h);
    }
}
