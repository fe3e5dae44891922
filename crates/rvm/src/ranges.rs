//! Range bookkeeping: which bytes of which segment each live transaction declared. Pure
//! code. Declared ranges of different live transactions must not overlap (that is how two
//! threads are kept from silently corrupting each other); one transaction's own ranges
//! may overlap and are merged.

use std::collections::BTreeMap;

pub type TxnId = u64;

/// Every declared range of every live transaction, as disjoint intervals per segment.
#[derive(Debug, Default)]
pub struct RangeTable {
    /// (segment, start) → (end, owner). Intervals never overlap, whoever owns them.
    by_start: BTreeMap<(u64, u64), (u64, TxnId)>,
}

/// A declared range that overlaps one another transaction holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conflict {
    pub owner: TxnId,
    pub start: u64,
    pub end: u64,
}

impl RangeTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares `start..end` of `seg` for `txn`, merging with the ranges `txn` already
    /// holds there. Fails, changing nothing, when another transaction holds any of it.
    pub fn declare(&mut self, seg: u64, start: u64, end: u64, txn: TxnId) -> Result<(), Conflict> {
        if start >= end {
            return Ok(());
        }
        let mut merged_start = start;
        let mut merged_end = end;
        let mut absorbed = Vec::new();
        // Intervals are disjoint and sorted, so those touching start..end are the ones
        // just before `end`, walking back while they still reach `start`.
        for (&(s, a), &(e, owner)) in self.by_start.range((seg, 0)..(seg, end)).rev() {
            debug_assert_eq!(s, seg);
            if e < start {
                break;
            }
            let overlaps = e > start;
            if owner != txn {
                if overlaps {
                    return Err(Conflict {
                        owner,
                        start: a,
                        end: e,
                    });
                }
                continue;
            }
            absorbed.push(a);
            merged_start = merged_start.min(a);
            merged_end = merged_end.max(e);
        }
        // An interval starting exactly at `end` and owned by txn is merged too.
        if let Some(&(e, owner)) = self.by_start.get(&(seg, end)) {
            if owner == txn {
                absorbed.push(end);
                merged_end = merged_end.max(e);
            }
        }
        for a in absorbed {
            self.by_start.remove(&(seg, a));
        }
        self.by_start.insert((seg, merged_start), (merged_end, txn));
        Ok(())
    }

    /// Forgets every range `txn` holds (it committed or aborted).
    pub fn release(&mut self, txn: TxnId, segs: impl IntoIterator<Item = u64>) {
        for seg in segs {
            let keys: Vec<(u64, u64)> = self
                .by_start
                .range((seg, 0)..=(seg, u64::MAX))
                .filter(|(_, &(_, o))| o == txn)
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                self.by_start.remove(&k);
            }
        }
    }

    /// Whether any transaction but `txn` holds part of `seg`.
    pub fn held_by_other(&self, seg: u64, txn: TxnId) -> bool {
        self.by_start
            .range((seg, 0)..=(seg, u64::MAX))
            .any(|(_, &(_, o))| o != txn)
    }

    /// The merged ranges `txn` holds in `seg`, in order.
    pub fn ranges_of(&self, seg: u64, txn: TxnId) -> Vec<(u64, u64)> {
        self.by_start
            .range((seg, 0)..=(seg, u64::MAX))
            .filter(|(_, &(_, o))| o == txn)
            .map(|(&(_, s), &(e, _))| (s, e))
            .collect()
    }

    /// Whether `start..end` of `seg` lies inside ranges `txn` declared.
    pub fn covers(&self, seg: u64, start: u64, end: u64, txn: TxnId) -> bool {
        if start >= end {
            return true;
        }
        // Own ranges are merged when they touch, so one interval must cover it all.
        match self.by_start.range((seg, 0)..=(seg, start)).next_back() {
            Some((_, &(e, o))) => o == txn && e >= end,
            None => false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_start.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn own_ranges_merge_and_others_conflict() {
        let mut t = RangeTable::new();
        t.declare(1, 10, 20, 1).expect("free");
        t.declare(1, 15, 30, 1).expect("own overlap merges");
        t.declare(1, 30, 40, 1).expect("adjacent merges");
        t.declare(1, 5, 10, 1).expect("adjacent below merges");
        assert_eq!(t.ranges_of(1, 1), vec![(5, 40)]);
        assert!(t.covers(1, 5, 40, 1));
        assert!(!t.covers(1, 4, 6, 1));
        assert_eq!(
            t.declare(1, 39, 41, 2),
            Err(Conflict {
                owner: 1,
                start: 5,
                end: 40
            })
        );
        t.declare(1, 40, 50, 2)
            .expect("touching is not overlapping");
        t.declare(2, 5, 40, 2).expect("other segment");
        assert!(t.held_by_other(1, 1));
        t.release(1, [1]);
        assert_eq!(t.ranges_of(1, 1), vec![]);
        t.declare(1, 0, 40, 3).expect("released");
        assert!(!t.covers(1, 0, 41, 3));
    }

    proptest! {
        /// Against a byte-map model: a declaration conflicts exactly when a byte it names
        /// is owned by another transaction, and coverage matches the model.
        #[test]
        fn matches_byte_model(ops in proptest::collection::vec((0u64..3, 0u64..64, 1u64..16, 1u64..4), 1..60)) {
            let mut t = RangeTable::new();
            let mut model = [[0u64; 80]; 1];
            for (txn, start, len, kind) in ops {
                let end = start + len;
                if kind == 3 {
                    t.release(txn, [0]);
                    for b in model[0].iter_mut() { if *b == txn + 1 { *b = 0; } }
                    continue;
                }
                let clash = (start..end).any(|i| model[0][i as usize] != 0 && model[0][i as usize] != txn + 1);
                let r = t.declare(0, start, end, txn);
                prop_assert_eq!(r.is_err(), clash);
                if !clash {
                    for i in start..end { model[0][i as usize] = txn + 1; }
                }
                for s in 0..70u64 {
                    let owned = model[0][s as usize] == txn + 1;
                    prop_assert_eq!(t.covers(0, s, s + 1, txn), owned);
                }
            }
        }
    }
}
