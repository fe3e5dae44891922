//! Moving partitions between nodes while they serve: the state machine, pure (no I/O).
//!
//! A move takes a set of partitions whose primary is one node (`from`) to another
//! (`to`). Its phases, each recorded (in etcd, by the mover, in the same transaction as
//! the map change that goes with it) before the work that depends on it starts:
//!
//! 1. **Copying** — the map is unchanged; the mover copies the partitions' keys from
//!    `from` to `to` (APPLY: a copy at its source version, kept only if newer), then
//!    repeats passes that copy only what changed (catch-up). `to`'s copies are scratch.
//! 2. **Fenced** at epoch F — the map at F lists the partitions as fenced: `from` stops
//!    serving them (MOVED) once it installs F, and no node serves them. The mover waits
//!    until `from` shows epoch ≥ F (its server installs a map only between batches, so no
//!    write routed by the old map is still running), makes the final pass (copies what
//!    changed and deletes on `to` the keys `from` no longer has), and switches. The fence
//!    is bounded by [`FENCE_MAX`]: a final pass that would overrun it aborts the move.
//! 3. **Switched** at epoch S — the map at S gives the partitions to `to`, unfenced. `from`
//!    still holds its copies until cleanup deletes them, after `from` shows epoch ≥ S
//!    (from then on any request for them there is MOVED or STALE_EPOCH).
//! 4. **RollingBack** — the map gives the partitions to `from`, unfenced; `to`'s scratch
//!    copies are deleted, then the record.
//!
//! A mover killed anywhere finds the record when it starts again and calls
//! [`resume_step`]: Copying is copied again (APPLY is idempotent) or rolled back, Fenced
//! is rolled back (lifting the fence is one transaction, the quickest way to let writes
//! in again; a move wanted still then starts over), Switched and RollingBack finish their
//! cleanup. No phase is half-applied: the map and the record change in one transaction.
//!
//! With replication R > 1 the same phases apply to the primary; the switch then replaces
//! `from` by `to` in the replica list, primary first (see [`switch`]), and backups keep
//! receiving the primary's writes throughout. This module is written for R = 1 and
//! refuses a `to` that already holds a replica.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::map::{ClusterMap, NodeId};

/// Partitions one move takes at once: the fence covers them all, so this bounds how many
/// partitions' writes one fence holds up, and the per-pass key list.
pub const MOVE_PARTITIONS_MAX: usize = 1_024;
/// Longest the partitions may stay fenced: a final pass not done within it aborts the move
/// (the fence is lifted, writes go back to `from`). Clients retry MOVED for ~0.7 s
/// (`camelot_client::kv::REDIRECTS_MAX` backoffs), so a fence within this costs no
/// client an error.
pub const FENCE_MAX: Duration = Duration::from_millis(400);
/// Catch-up passes before the fence at most; they stop earlier once a pass changed no
/// more than [`CATCHUP_SETTLED_KEYS`] keys.
pub const CATCHUP_PASSES_MAX: u32 = 4;
pub const CATCHUP_SETTLED_KEYS: usize = 64;
/// Keys of the moving partitions one pass keeps track of (key and version each).
pub const MOVE_KEYS_MAX: usize = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoveError {
    #[error("a move needs 1..={MOVE_PARTITIONS_MAX} partitions, not {0}")]
    Partitions(usize),
    #[error("partition {partition} is not in the map ({partitions} partitions)")]
    NoSuchPartition { partition: u32, partitions: u32 },
    #[error("node {0} is not in the map")]
    UnknownNode(NodeId),
    #[error("partitions {a} and {b} have different primaries ({pa} and {pb}): one move takes partitions of one node")]
    MixedSources {
        a: u32,
        pa: NodeId,
        b: u32,
        pb: NodeId,
    },
    #[error("partition {partition} is already on node {node}")]
    AlreadyThere { partition: u32, node: NodeId },
    #[error("partition {0} is fenced by another move")]
    AlreadyFenced(u32),
    #[error("the move is in phase {phase}, which cannot {what}")]
    WrongPhase {
        phase: &'static str,
        what: &'static str,
    },
    #[error("partition {partition}'s primary changed to {now} while it moved from {from}")]
    PrimaryChanged {
        partition: u32,
        from: NodeId,
        now: NodeId,
    },
    #[error("the moving partitions hold more than {MOVE_KEYS_MAX} keys")]
    TooManyKeys,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    Copying,
    Fenced { epoch: u64 },
    Switched { epoch: u64 },
    RollingBack,
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Copying => "copying",
            Phase::Fenced { .. } => "fenced",
            Phase::Switched { .. } => "switched",
            Phase::RollingBack => "rolling back",
        }
    }
}

/// The durable record of a move in progress (at most one per cluster).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveRecord {
    /// Ascending, distinct.
    pub partitions: Vec<u32>,
    pub from: NodeId,
    pub to: NodeId,
    #[serde(flatten)]
    pub phase: Phase,
}

impl MoveRecord {
    /// A bitmap over the map's partitions: which ones this move takes.
    pub fn mask(&self, partitions: u32) -> Vec<bool> {
        let mut m = vec![false; partitions as usize];
        for p in &self.partitions {
            if let Some(b) = m.get_mut(*p as usize) {
                *b = true;
            }
        }
        m
    }
}

/// Checks a move of `partitions` to `to` against `map` and returns its first record.
pub fn begin(map: &ClusterMap, partitions: &[u32], to: NodeId) -> Result<MoveRecord, MoveError> {
    let set: BTreeSet<u32> = partitions.iter().copied().collect();
    if set.is_empty() || set.len() > MOVE_PARTITIONS_MAX {
        return Err(MoveError::Partitions(set.len()));
    }
    if map.node(to).is_none() {
        return Err(MoveError::UnknownNode(to));
    }
    let mut from: Option<(u32, NodeId)> = None;
    for &p in &set {
        let primary = map.primary(p).ok_or(MoveError::NoSuchPartition {
            partition: p,
            partitions: map.partitions(),
        })?;
        if map.is_fenced(p) {
            return Err(MoveError::AlreadyFenced(p));
        }
        if map.replicas(p).contains(&to) {
            return Err(MoveError::AlreadyThere {
                partition: p,
                node: to,
            });
        }
        match from {
            None => from = Some((p, primary)),
            Some((a, pa)) if pa != primary => {
                return Err(MoveError::MixedSources {
                    a,
                    pa,
                    b: p,
                    pb: primary,
                })
            }
            Some(_) => {}
        }
    }
    let (_, from) = from.ok_or(MoveError::Partitions(0))?;
    Ok(MoveRecord {
        partitions: set.into_iter().collect(),
        from,
        to,
        phase: Phase::Copying,
    })
}

fn check_primaries(map: &ClusterMap, rec: &MoveRecord, owner: NodeId) -> Result<(), MoveError> {
    for &p in &rec.partitions {
        let now = map.primary(p).ok_or(MoveError::NoSuchPartition {
            partition: p,
            partitions: map.partitions(),
        })?;
        if now != owner {
            return Err(MoveError::PrimaryChanged {
                partition: p,
                from: owner,
                now,
            });
        }
    }
    Ok(())
}

fn next_epoch(map: &ClusterMap) -> ClusterMap {
    let mut next = map.clone();
    next.epoch = map.epoch + 1;
    next
}

/// Copying → Fenced: the next map fences the partitions.
pub fn fence(map: &ClusterMap, rec: &MoveRecord) -> Result<(ClusterMap, MoveRecord), MoveError> {
    if rec.phase != Phase::Copying {
        return Err(wrong(rec, "fence"));
    }
    check_primaries(map, rec, rec.from)?;
    let mut next = next_epoch(map);
    let mut fenced: BTreeSet<u32> = next.fenced.iter().copied().collect();
    fenced.extend(rec.partitions.iter().copied());
    next.fenced = fenced.into_iter().collect();
    let rec = MoveRecord {
        phase: Phase::Fenced { epoch: next.epoch },
        ..rec.clone()
    };
    Ok((next, rec))
}

/// Fenced → Switched: the next map makes `to` the partitions' primary (in `from`'s place
/// in the replica list, moved to the front) and lifts their fence.
pub fn switch(map: &ClusterMap, rec: &MoveRecord) -> Result<(ClusterMap, MoveRecord), MoveError> {
    if !matches!(rec.phase, Phase::Fenced { .. }) {
        return Err(wrong(rec, "switch"));
    }
    check_primaries(map, rec, rec.from)?;
    let mut next = next_epoch(map);
    for &p in &rec.partitions {
        let replicas = &mut next.assignment[p as usize];
        replicas.retain(|n| *n != rec.from && *n != rec.to);
        replicas.insert(0, rec.to);
    }
    next.fenced
        .retain(|p| rec.partitions.binary_search(p).is_err());
    let rec = MoveRecord {
        phase: Phase::Switched { epoch: next.epoch },
        ..rec.clone()
    };
    Ok((next, rec))
}

/// Copying or Fenced → RollingBack: the partitions stay with `from`; a fence is lifted
/// (a new map then), otherwise the map is unchanged (`None`).
pub fn abort(
    map: &ClusterMap,
    rec: &MoveRecord,
) -> Result<(Option<ClusterMap>, MoveRecord), MoveError> {
    let next = match rec.phase {
        Phase::Copying => None,
        Phase::Fenced { .. } => {
            let mut next = next_epoch(map);
            next.fenced
                .retain(|p| rec.partitions.binary_search(p).is_err());
            Some(next)
        }
        _ => return Err(wrong(rec, "roll back")),
    };
    let rec = MoveRecord {
        phase: Phase::RollingBack,
        ..rec.clone()
    };
    Ok((next, rec))
}

fn wrong(rec: &MoveRecord, what: &'static str) -> MoveError {
    MoveError::WrongPhase {
        phase: rec.phase.name(),
        what,
    }
}

/// What a mover does next with a record it found (at start, or after each step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Copy and catch up, then [`fence`].
    Copy,
    /// Wait for `from` to show the fence epoch, make the final pass, then [`switch`]; or
    /// [`abort`] if that takes longer than [`FENCE_MAX`].
    FinalCopy { fence_epoch: u64 },
    /// [`abort`].
    Abort,
    /// Delete the partitions' keys on `node` (once it shows `after_epoch`), then delete
    /// the record.
    Cleanup { node: NodeId, after_epoch: u64 },
}

/// The next step for `rec`. `resuming`: the record was found, not just written by this
/// mover (a Fenced record found is a fence of unknown age: it is rolled back).
/// `rollback`: the user asked to undo the move.
pub fn resume_step(rec: &MoveRecord, resuming: bool, rollback: bool) -> Step {
    match rec.phase {
        Phase::Copying if rollback => Step::Abort,
        Phase::Copying => Step::Copy,
        Phase::Fenced { .. } if rollback || resuming => Step::Abort,
        Phase::Fenced { epoch } => Step::FinalCopy { fence_epoch: epoch },
        Phase::Switched { epoch } => Step::Cleanup {
            node: rec.from,
            after_epoch: epoch,
        },
        // The map did not give `to` the partitions at any epoch the rollback published,
        // so its copies can go at once.
        Phase::RollingBack => Step::Cleanup {
            node: rec.to,
            after_epoch: 0,
        },
    }
}

/// One key as a scan returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyVersion {
    pub key: Vec<u8>,
    pub version: u64,
}

/// Tracks what a move has copied, pass by pass: the version of each moving key last
/// sent to the target, so a catch-up pass sends only what changed.
#[derive(Debug, Default, Clone)]
pub struct CopyLog {
    sent: BTreeMap<Vec<u8>, u64>,
}

impl CopyLog {
    /// Whether `key` at `version` must be sent (it was not, at that version); records it.
    pub fn must_send(&mut self, key: &[u8], version: u64) -> Result<bool, MoveError> {
        match self.sent.get_mut(key) {
            Some(v) if *v == version => Ok(false),
            Some(v) => {
                *v = version;
                Ok(true)
            }
            None => {
                if self.sent.len() >= MOVE_KEYS_MAX {
                    return Err(MoveError::TooManyKeys);
                }
                self.sent.insert(key.to_vec(), version);
                Ok(true)
            }
        }
    }

    pub fn len(&self) -> usize {
        self.sent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sent.is_empty()
    }
}

/// The target's moving keys that the source no longer has, with the version an APPLY
/// deleting each must carry (one above the target's: APPLY keeps only newer).
pub fn deletions(source_keys: &BTreeSet<Vec<u8>>, target: &[KeyVersion]) -> Vec<KeyVersion> {
    target
        .iter()
        .filter(|kv| !source_keys.contains(&kv.key))
        .map(|kv| KeyVersion {
            key: kv.key.clone(),
            version: kv.version.saturating_add(1),
        })
        .collect()
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::Node;
    use std::net::SocketAddr;

    fn map(nodes: u32, partitions: u32) -> ClusterMap {
        let nodes = (0..nodes)
            .map(|i| Node {
                id: i,
                addr: SocketAddr::from(([127, 0, 0, 1], 7000 + i as u16)),
                weight: 1,
                lease: 0,
            })
            .collect();
        ClusterMap::initial(nodes, partitions, 1).unwrap()
    }

    #[test]
    fn phases_change_the_map_as_described() {
        let m = map(2, 8);
        let from = m.primary(3).unwrap();
        let to = 1 - from;
        let rec = begin(&m, &[3], to).unwrap();
        assert_eq!(rec.from, from);
        let (fm, frec) = fence(&m, &rec).unwrap();
        fm.validate().unwrap();
        assert_eq!(fm.epoch, m.epoch + 1);
        assert_eq!(fm.fenced, vec![3]);
        assert!(!fm.serving_primaries_of(from)[3]);
        assert_eq!(
            fm.primary(3),
            Some(from),
            "routing is unchanged under the fence"
        );
        let (sm, srec) = switch(&fm, &frec).unwrap();
        sm.validate().unwrap();
        assert_eq!(sm.primary(3), Some(to));
        assert!(sm.fenced.is_empty());
        assert!(sm.serving_primaries_of(to)[3]);
        assert_eq!(srec.phase, Phase::Switched { epoch: m.epoch + 2 });
        assert_eq!(
            resume_step(&srec, true, false),
            Step::Cleanup {
                node: from,
                after_epoch: m.epoch + 2
            }
        );
        // Rolled back from the fence: the fence is lifted, the owner unchanged.
        let (rm, rrec) = abort(&fm, &frec).unwrap();
        let rm = rm.unwrap();
        assert!(rm.fenced.is_empty());
        assert_eq!(rm.primary(3), Some(from));
        assert_eq!(
            resume_step(&rrec, true, false),
            Step::Cleanup {
                node: to,
                after_epoch: 0
            }
        );
        // A record found fenced is rolled back, one just fenced goes on.
        assert_eq!(resume_step(&frec, true, false), Step::Abort);
        assert_eq!(
            resume_step(&frec, false, false),
            Step::FinalCopy {
                fence_epoch: m.epoch + 1
            }
        );
        assert!(matches!(
            switch(&m, &rec),
            Err(MoveError::WrongPhase { .. })
        ));
        assert!(matches!(
            abort(&sm, &srec),
            Err(MoveError::WrongPhase { .. })
        ));
    }

    #[test]
    fn bad_moves_are_refused() {
        let m = map(3, 16);
        let p0 = m.primary(0).unwrap();
        assert_eq!(
            begin(&m, &[0], p0),
            Err(MoveError::AlreadyThere {
                partition: 0,
                node: p0
            })
        );
        assert_eq!(begin(&m, &[], 0), Err(MoveError::Partitions(0)));
        assert!(matches!(
            begin(&m, &[99], 0),
            Err(MoveError::NoSuchPartition { .. })
        ));
        assert_eq!(begin(&m, &[0], 7), Err(MoveError::UnknownNode(7)));
        let other = (1..16).find(|p| m.primary(*p) != Some(p0)).unwrap();
        let to = (0..3)
            .find(|n| *n != p0 && Some(*n) != m.primary(other))
            .unwrap();
        assert!(matches!(
            begin(&m, &[0, other], to),
            Err(MoveError::MixedSources { .. })
        ));
        let rec = begin(&m, &[0], to).unwrap();
        let (fm, _) = fence(&m, &rec).unwrap();
        assert_eq!(begin(&fm, &[0], to), Err(MoveError::AlreadyFenced(0)));
    }

    #[test]
    fn records_round_trip_as_json() {
        let rec = MoveRecord {
            partitions: vec![1, 5],
            from: 0,
            to: 2,
            phase: Phase::Fenced { epoch: 9 },
        };
        let json = serde_json::to_string(&rec).unwrap();
        assert!(json.contains("\"phase\":\"fenced\""), "{json}");
        assert_eq!(serde_json::from_str::<MoveRecord>(&json).unwrap(), rec);
    }

    #[test]
    fn a_map_without_fences_reads_as_before() {
        let m = map(2, 4);
        let json = m.to_json();
        assert!(
            !json.contains("fenced"),
            "an unfenced map is written as before"
        );
        let mut bad = m.clone();
        bad.fenced = vec![2, 1];
        assert!(bad.validate().is_err());
        bad.fenced = vec![4];
        assert!(bad.validate().is_err());
    }

    #[test]
    fn copy_log_sends_only_changes_and_deletions_carry_a_higher_version() {
        let mut log = CopyLog::default();
        assert!(log.must_send(b"a", 3).unwrap());
        assert!(!log.must_send(b"a", 3).unwrap());
        assert!(log.must_send(b"a", 5).unwrap());
        let source: BTreeSet<Vec<u8>> = [b"a".to_vec()].into();
        let target = vec![
            KeyVersion {
                key: b"a".to_vec(),
                version: 5,
            },
            KeyVersion {
                key: b"b".to_vec(),
                version: 4,
            },
        ];
        assert_eq!(
            deletions(&source, &target),
            vec![KeyVersion {
                key: b"b".to_vec(),
                version: 5
            }]
        );
    }
}
