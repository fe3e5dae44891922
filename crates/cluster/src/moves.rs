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
//! **With replication R > 1** (a *replicated* move: the map's R > 1 when it began) a move
//! replaces one member `from` of the partitions' replica sets — the primary or a backup —
//! by `to`, and the copy is made by replication itself rather than by catch-up passes:
//!
//! 1. **Copying** — nothing done yet (no map change).
//! 2. **Joining** at epoch J — the map at J appends `to` to each set as a *syncing*
//!    replica (the set holds R + 1 for the move's duration, so redundancy never drops
//!    below R): the primary copies every write to it before acknowledging. The mover then
//!    fills it from the primary exactly as re-replication does (snapshot, then delete
//!    what the primary no longer has; [`crate::mover::fill_replica`]).
//! 3. If `from` is a backup of every partition, **Switched** at S directly: the map at S
//!    drops `from` and makes `to` a full replica in its place. No fence: the primary does
//!    not change, and `to` already has every acknowledged write.
//!    If `from` is the primary of some, **Fenced** at F first (those partitions only):
//!    `from` stops serving them; once it shows F the mover reconciles `to` with `from`
//!    (copies what differs — a write applied on `from` whose copy `to` refused — and
//!    deletes what `from` lacks), then switches: `to` takes `from`'s place, primary.
//! 4. Cleanup on `from` after it shows S; a rollback removes `to` from the sets at a new
//!    epoch and cleans `to` after it shows that epoch.
//!
//! A replicated move found Joining is filled again (the fill is idempotent); found Fenced
//! it is rolled back, as above. Either node or the mover may die anywhere: every map
//! change goes with its record change in one transaction, and a set never holds fewer
//! full replicas than before the move.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::map::{ClusterMap, NodeId, REPLICAS_MAX};

/// Partitions one move takes at once: the fence covers them all, so this bounds how many
/// partitions' writes one fence holds up, and the per-pass key list.
pub const MOVE_PARTITIONS_MAX: usize = 1_024;
/// Longest the partitions may stay fenced: a final pass not done within it aborts the move
/// (the fence is lifted, writes go back to `from`). Clients retry MOVED for ~0.93 s
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
    #[error("node {node} is not a replica of partition {partition}")]
    NotAReplica { partition: u32, node: NodeId },
    #[error("partition {0} has a replica still being filled: move it once re-replication is done")]
    Syncing(u32),
    #[error("partition {0} cannot take one more replica during a move (at most {REPLICAS_MAX})")]
    FullSet(u32),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    Copying,
    /// Replicated moves only: `to` is a syncing replica since `epoch`.
    Joining {
        epoch: u64,
    },
    Fenced {
        epoch: u64,
    },
    Switched {
        epoch: u64,
    },
    RollingBack,
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Copying => "copying",
            Phase::Joining { .. } => "joining",
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
    /// Began on a map with R > 1: `to` joins the replica sets and `from` leaves them (see
    /// the module's text). Absent (false) in records written before such moves existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replicated: bool,
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
/// `from`: the member the partitions leave — their primary when `None` (and it must be
/// the primary with R = 1, whose moves are of primaries only).
pub fn begin(
    map: &ClusterMap,
    partitions: &[u32],
    from: Option<NodeId>,
    to: NodeId,
) -> Result<MoveRecord, MoveError> {
    let set: BTreeSet<u32> = partitions.iter().copied().collect();
    if set.is_empty() || set.len() > MOVE_PARTITIONS_MAX {
        return Err(MoveError::Partitions(set.len()));
    }
    if map.node(to).is_none() {
        return Err(MoveError::UnknownNode(to));
    }
    let replicated = map.replication > 1;
    let mut leaving: Option<(u32, NodeId)> = None;
    for &p in &set {
        let primary = map.primary(p).ok_or(MoveError::NoSuchPartition {
            partition: p,
            partitions: map.partitions(),
        })?;
        if map.is_fenced(p) {
            return Err(MoveError::AlreadyFenced(p));
        }
        let replicas = map.replicas(p);
        if replicas.contains(&to) {
            return Err(MoveError::AlreadyThere {
                partition: p,
                node: to,
            });
        }
        let node = from.unwrap_or(primary);
        if !replicas.contains(&node) || (!replicated && node != primary) {
            return Err(MoveError::NotAReplica { partition: p, node });
        }
        if replicated {
            // A set being refilled is re-replication's; and the move adds one member.
            if map.syncing.iter().any(|(q, _)| *q == p) {
                return Err(MoveError::Syncing(p));
            }
            if replicas.len() >= REPLICAS_MAX {
                return Err(MoveError::FullSet(p));
            }
        }
        match leaving {
            None => leaving = Some((p, node)),
            Some((a, pa)) if pa != node => {
                return Err(MoveError::MixedSources {
                    a,
                    pa,
                    b: p,
                    pb: node,
                })
            }
            Some(_) => {}
        }
    }
    let (_, from) = leaving.ok_or(MoveError::Partitions(0))?;
    Ok(MoveRecord {
        partitions: set.into_iter().collect(),
        from,
        to,
        replicated,
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

/// Copying → Fenced (R = 1), or Joining → Fenced (replicated: only the partitions whose
/// primary `from` is are fenced; there must be some): the next map fences them.
pub fn fence(map: &ClusterMap, rec: &MoveRecord) -> Result<(ClusterMap, MoveRecord), MoveError> {
    let fenced_now: Vec<u32> = if rec.replicated {
        if !matches!(rec.phase, Phase::Joining { .. }) {
            return Err(wrong(rec, "fence"));
        }
        check_members(map, rec)?;
        let led = led_by_from(map, rec);
        if led.is_empty() {
            return Err(wrong(rec, "fence (no partition has it as primary)"));
        }
        led
    } else {
        if rec.phase != Phase::Copying {
            return Err(wrong(rec, "fence"));
        }
        check_primaries(map, rec, rec.from)?;
        rec.partitions.clone()
    };
    let mut next = next_epoch(map);
    let mut fenced: BTreeSet<u32> = next.fenced.iter().copied().collect();
    fenced.extend(fenced_now);
    next.fenced = fenced.into_iter().collect();
    let rec = MoveRecord {
        phase: Phase::Fenced { epoch: next.epoch },
        ..rec.clone()
    };
    Ok((next, rec))
}

/// The move's partitions whose primary is `from` in `map`: those a replicated move must
/// fence before `to` takes over.
pub fn led_by_from(map: &ClusterMap, rec: &MoveRecord) -> Vec<u32> {
    rec.partitions
        .iter()
        .copied()
        .filter(|p| map.primary(*p) == Some(rec.from))
        .collect()
}

/// Copying → Joining (replicated moves): the next map appends `to` to every set as a
/// syncing replica.
pub fn join(map: &ClusterMap, rec: &MoveRecord) -> Result<(ClusterMap, MoveRecord), MoveError> {
    if !rec.replicated || rec.phase != Phase::Copying {
        return Err(wrong(rec, "join"));
    }
    let mut next = next_epoch(map);
    let mut syncing: BTreeSet<(u32, NodeId)> = next.syncing.iter().copied().collect();
    for &p in &rec.partitions {
        let replicas = next
            .assignment
            .get_mut(p as usize)
            .ok_or(MoveError::NoSuchPartition {
                partition: p,
                partitions: map.partitions(),
            })?;
        if !replicas.contains(&rec.from) {
            return Err(MoveError::NotAReplica {
                partition: p,
                node: rec.from,
            });
        }
        if replicas.contains(&rec.to) {
            return Err(MoveError::AlreadyThere {
                partition: p,
                node: rec.to,
            });
        }
        if replicas.len() >= REPLICAS_MAX {
            return Err(MoveError::FullSet(p));
        }
        replicas.push(rec.to);
        syncing.insert((p, rec.to));
    }
    next.syncing = syncing.into_iter().collect();
    let rec = MoveRecord {
        phase: Phase::Joining { epoch: next.epoch },
        ..rec.clone()
    };
    Ok((next, rec))
}

/// A replicated move's `to` must still be in every set (a failover may have dropped it,
/// dead): the switch has nothing to switch to otherwise.
fn check_members(map: &ClusterMap, rec: &MoveRecord) -> Result<(), MoveError> {
    for &p in &rec.partitions {
        if !map.replicas(p).contains(&rec.to) {
            return Err(MoveError::NotAReplica {
                partition: p,
                node: rec.to,
            });
        }
    }
    Ok(())
}

/// Fenced → Switched: the next map makes `to` the partitions' primary (in `from`'s place
/// in the replica list, moved to the front) and lifts their fence. A replicated move
/// switches from Fenced or (when `from` leads none of them) from Joining: `to` takes
/// `from`'s place in each set — primary where `from` was — and is a full replica.
pub fn switch(map: &ClusterMap, rec: &MoveRecord) -> Result<(ClusterMap, MoveRecord), MoveError> {
    if rec.replicated {
        return switch_replicated(map, rec);
    }
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
    Ok(switched(next, rec))
}

/// The switch's map with the move's fence lifted, and the record at Switched.
fn switched(mut next: ClusterMap, rec: &MoveRecord) -> (ClusterMap, MoveRecord) {
    next.fenced
        .retain(|p| rec.partitions.binary_search(p).is_err());
    let rec = MoveRecord {
        phase: Phase::Switched { epoch: next.epoch },
        ..rec.clone()
    };
    (next, rec)
}

fn switch_replicated(
    map: &ClusterMap,
    rec: &MoveRecord,
) -> Result<(ClusterMap, MoveRecord), MoveError> {
    match rec.phase {
        Phase::Joining { .. } => {
            // Unfenced, `from` must lead none: a new primary needs the fence first.
            if !led_by_from(map, rec).is_empty() {
                return Err(wrong(rec, "switch unfenced while `from` leads a partition"));
            }
        }
        Phase::Fenced { .. } => {
            // The fenced partitions are still `from`'s: a failover that replaced it
            // while fenced leaves the move to be rolled back.
            for &p in &map.fenced {
                if rec.partitions.binary_search(&p).is_ok() && map.primary(p) != Some(rec.from) {
                    return Err(MoveError::PrimaryChanged {
                        partition: p,
                        from: rec.from,
                        now: map.primary(p).unwrap_or_default(),
                    });
                }
            }
        }
        _ => return Err(wrong(rec, "switch")),
    }
    check_members(map, rec)?;
    let mut next = next_epoch(map);
    for &p in &rec.partitions {
        let replicas = &mut next.assignment[p as usize];
        replicas.retain(|n| *n != rec.to);
        match replicas.iter().position(|n| *n == rec.from) {
            Some(i) => replicas[i] = rec.to,
            // `from` already left (dead, dropped by a failover): `to` stays a backup.
            None => replicas.push(rec.to),
        }
    }
    next.syncing
        .retain(|(p, n)| !(*n == rec.to && rec.partitions.binary_search(p).is_ok()));
    Ok(switched(next, rec))
}

/// Copying, Joining or Fenced → RollingBack: the partitions stay with `from`; a fence is
/// lifted and a joining `to` leaves the sets (a new map then), otherwise the map is
/// unchanged (`None`).
pub fn abort(
    map: &ClusterMap,
    rec: &MoveRecord,
) -> Result<(Option<ClusterMap>, MoveRecord), MoveError> {
    let next = match rec.phase {
        Phase::Copying => None,
        Phase::Joining { .. } | Phase::Fenced { .. } => {
            let mut next = next_epoch(map);
            next.fenced
                .retain(|p| rec.partitions.binary_search(p).is_err());
            if rec.replicated {
                for &p in &rec.partitions {
                    if let Some(replicas) = next.assignment.get_mut(p as usize) {
                        // Never the last member nor the primary (which `to` can only be
                        // if something else made it so: then it stays).
                        if replicas.len() > 1 && replicas.first() != Some(&rec.to) {
                            replicas.retain(|n| *n != rec.to);
                        }
                    }
                }
                let assignment = &next.assignment;
                next.syncing.retain(|(p, n)| {
                    assignment
                        .get(*p as usize)
                        .is_some_and(|r| r.iter().skip(1).any(|x| x == n))
                });
            }
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
    /// Replicated: [`join`].
    Join,
    /// Replicated: fill `to` from each partition's primary, then [`fence`] (when `from`
    /// leads some of them) or [`switch`].
    Fill,
    /// Wait for `from` to show the fence epoch, make the final pass, then [`switch`]; or
    /// [`abort`] if that takes longer than [`FENCE_MAX`].
    FinalCopy { fence_epoch: u64 },
    /// [`abort`].
    Abort,
    /// Delete the partitions' keys on `node` (once it shows `after_epoch`; 0 for a
    /// replicated rollback: the epoch of the map the mover reads then, at least the
    /// rollback's), then delete the record.
    Cleanup { node: NodeId, after_epoch: u64 },
}

/// The next step for `rec`. `resuming`: the record was found, not just written by this
/// mover (a Fenced record found is a fence of unknown age: it is rolled back).
/// `rollback`: the user asked to undo the move.
pub fn resume_step(rec: &MoveRecord, resuming: bool, rollback: bool) -> Step {
    match rec.phase {
        Phase::Copying | Phase::Joining { .. } if rollback => Step::Abort,
        Phase::Copying if rec.replicated => Step::Join,
        Phase::Copying => Step::Copy,
        // Unfenced, so a fill found half made is made again rather than undone.
        Phase::Joining { .. } => Step::Fill,
        Phase::Fenced { .. } if rollback || resuming => Step::Abort,
        Phase::Fenced { epoch } => Step::FinalCopy { fence_epoch: epoch },
        Phase::Switched { epoch } => Step::Cleanup {
            node: rec.from,
            after_epoch: epoch,
        },
        // The map did not give `to` the partitions at any epoch the rollback published,
        // so its copies can go at once (R = 1; a replicated `to` received live copies
        // until it installed the rollback's map).
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

    /// A log that takes `present` (what the target holds) as sent: a pass then sends only
    /// keys whose version differs there.
    pub fn seeded(present: &[KeyVersion]) -> Result<CopyLog, MoveError> {
        if present.len() > MOVE_KEYS_MAX {
            return Err(MoveError::TooManyKeys);
        }
        Ok(CopyLog {
            sent: present
                .iter()
                .map(|kv| (kv.key.clone(), kv.version))
                .collect(),
        })
    }

    pub fn len(&self) -> usize {
        self.sent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sent.is_empty()
    }
}

/// What the final pass under the fence must copy (see [`final_copy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalCopy {
    /// Source and target agree.
    Nothing,
    /// `differing` keys differ, all written at or after `since`: a walk from it finds them.
    Since { since: u64, differing: usize },
    /// A key older than the last clock differs (`oldest`: its source version, and what
    /// the target holds of it; the target lost something, e.g. it restarted), or no
    /// clock is known: everything is walked.
    Everything {
        differing: usize,
        oldest: u64,
        target_has: Option<u64>,
    },
}

impl FinalCopy {
    /// The version a walk must start from; `None` when no walk is needed.
    pub fn since(&self) -> Option<u64> {
        match self {
            FinalCopy::Nothing => None,
            FinalCopy::Since { since, .. } => Some(*since),
            FinalCopy::Everything { .. } => Some(0),
        }
    }
}

impl std::fmt::Display for FinalCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FinalCopy::Nothing => write!(f, "no key differed"),
            FinalCopy::Since { since, differing } => {
                write!(
                    f,
                    "{differing} key(s) differed, walked from version {since}"
                )
            }
            FinalCopy::Everything {
                differing,
                oldest,
                target_has,
            } => write!(
                f,
                "{differing} key(s) differed, the oldest at version {oldest} (the target's: {}): walked everything",
                target_has.map_or("none".to_string(), |v| v.to_string())
            ),
        }
    }
}

/// What the final pass under the fence must copy, from the source's and the target's
/// moving keys and versions, `since` being the source's clock as the last copy began (0:
/// unknown). A key only the target has is a deletion, not a copy.
pub fn final_copy(source: &[KeyVersion], target: &[KeyVersion], since: u64) -> FinalCopy {
    let held: std::collections::HashMap<&[u8], u64> = target
        .iter()
        .map(|kv| (kv.key.as_slice(), kv.version))
        .collect();
    let mut differing = 0;
    let mut oldest: Option<&KeyVersion> = None;
    for kv in source {
        if held.get(kv.key.as_slice()) != Some(&kv.version) {
            differing += 1;
            if oldest.is_none_or(|o| kv.version < o.version) {
                oldest = Some(kv);
            }
        }
    }
    match oldest {
        None => FinalCopy::Nothing,
        Some(o) if since > 0 && o.version >= since => FinalCopy::Since { since, differing },
        Some(o) => FinalCopy::Everything {
            differing,
            oldest: o.version,
            target_has: held.get(o.key.as_slice()).copied(),
        },
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

/// What one move did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoveReport {
    pub partitions: usize,
    pub from: NodeId,
    pub to: NodeId,
    /// Completed (switched) or rolled back.
    pub switched: bool,
    /// Keys and value bytes copied (APPLY) to the target over every pass.
    pub keys_copied: u64,
    pub bytes_copied: u64,
    /// Key and value bytes the source's copy passes sent (the source filters by partition,
    /// and after the first pass by version).
    pub bytes_scanned: u64,
    /// From the first scan to the fence.
    pub copy_secs: f64,
    /// From the fence's commit to the switch's (or the rollback's).
    pub fence_ms: Option<f64>,
    pub keys_deleted: u64,
}

/// What `camelot cluster rebalance --json` prints last, on one line: every move it made
/// or finished, in order (for scripts and the expansion bench, instead of its prose).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RebalanceReport {
    pub moves: Vec<MoveReport>,
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    fn map(nodes: u32, partitions: u32) -> ClusterMap {
        ClusterMap::initial(crate::map::test_nodes(nodes), partitions, 1).unwrap()
    }

    fn kv(key: &str, version: u64) -> KeyVersion {
        KeyVersion {
            key: key.as_bytes().to_vec(),
            version,
        }
    }

    #[test]
    fn the_final_pass_walks_from_the_last_clock_only_when_nothing_older_differs() {
        let target = [kv("a", 3), kv("b", 5), kv("gone", 4)];
        let since = |s: &[KeyVersion], clock| final_copy(s, &target, clock).since();
        // Agreeing (a key only the target has is a deletion, not a copy): nothing.
        assert_eq!(since(&[kv("a", 3), kv("b", 5)], 10), None);
        // Differences all written since the clock: walk from it.
        let newer = [kv("a", 3), kv("b", 12), kv("new", 10)];
        assert_eq!(
            final_copy(&newer, &target, 10),
            FinalCopy::Since {
                since: 10,
                differing: 2
            }
        );
        // The target lacks an old key (it restarted): walk everything.
        assert_eq!(
            final_copy(&[kv("a", 3), kv("b", 5), kv("old", 2)], &target, 10),
            FinalCopy::Everything {
                differing: 1,
                oldest: 2,
                target_has: None
            }
        );
        // The target holds an old key at another version: everything too.
        assert_eq!(since(&[kv("a", 2), kv("b", 5)], 10), Some(0));
        // No clock known (a resumed mover): everything.
        assert_eq!(since(&[kv("b", 12)], 0), Some(0));
    }

    #[test]
    fn phases_change_the_map_as_described() {
        let m = map(2, 8);
        let from = m.primary(3).unwrap();
        let to = 1 - from;
        let rec = begin(&m, &[3], None, to).unwrap();
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
            begin(&m, &[0], None, p0),
            Err(MoveError::AlreadyThere {
                partition: 0,
                node: p0
            })
        );
        assert_eq!(begin(&m, &[], None, 0), Err(MoveError::Partitions(0)));
        assert!(matches!(
            begin(&m, &[99], None, 0),
            Err(MoveError::NoSuchPartition { .. })
        ));
        assert_eq!(begin(&m, &[0], None, 7), Err(MoveError::UnknownNode(7)));
        let other = (1..16).find(|p| m.primary(*p) != Some(p0)).unwrap();
        let to = (0..3)
            .find(|n| *n != p0 && Some(*n) != m.primary(other))
            .unwrap();
        assert!(matches!(
            begin(&m, &[0, other], None, to),
            Err(MoveError::MixedSources { .. })
        ));
        let rec = begin(&m, &[0], None, to).unwrap();
        let (fm, _) = fence(&m, &rec).unwrap();
        assert_eq!(begin(&fm, &[0], None, to), Err(MoveError::AlreadyFenced(0)));
    }

    #[test]
    fn records_round_trip_as_json() {
        let rec = MoveRecord {
            partitions: vec![1, 5],
            from: 0,
            to: 2,
            replicated: false,
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

/// Replicated moves (R > 1), pure: the phases' maps, and a proptest driving them with
/// kills (the mover starting over from the record) and rollbacks at random points.
#[cfg(test)]
mod replicated_tests {
    use super::*;
    use crate::map::Node;
    use proptest::prelude::*;
    use std::net::SocketAddr;

    fn map(nodes: u32, partitions: u32, r: u32) -> ClusterMap {
        ClusterMap::initial(crate::map::test_nodes(nodes), partitions, r).unwrap()
    }

    #[test]
    fn a_backup_is_replaced_without_a_fence_and_a_primary_behind_one() {
        let m = map(3, 8, 2);
        // Node 2 joins; take a partition whose backup is node 0, one whose primary is.
        let mut m = m;
        m.nodes.push(Node {
            id: 3,
            addr: SocketAddr::from(([127, 0, 0, 1], 7003)),
            weight: 1,
            lease: 0,
            incarnation: 0,
        });
        let backup_p = (0..8).find(|p| m.replicas(*p)[1] == 0).unwrap();
        let rec = begin(&m, &[backup_p], Some(0), 3).unwrap();
        assert!(rec.replicated);
        assert_eq!(resume_step(&rec, false, false), Step::Join);
        let (jm, jrec) = join(&m, &rec).unwrap();
        jm.validate().unwrap();
        assert_eq!(jm.replicas(backup_p).len(), 3, "R + 1 while joining");
        assert!(jm.is_syncing(backup_p, 3));
        assert_eq!(resume_step(&jrec, true, false), Step::Fill);
        assert!(led_by_from(&jm, &jrec).is_empty());
        assert!(fence(&jm, &jrec).is_err(), "nothing to fence");
        let (sm, srec) = switch(&jm, &jrec).unwrap();
        sm.validate().unwrap();
        assert_eq!(sm.replicas(backup_p)[1], 3, "in node 0's place");
        assert_eq!(sm.primary(backup_p), m.primary(backup_p));
        assert!(sm.syncing.is_empty() && sm.fenced.is_empty());
        assert_eq!(
            resume_step(&srec, true, false),
            Step::Cleanup {
                node: 0,
                after_epoch: sm.epoch
            }
        );

        let primary_p = (0..8).find(|p| m.primary(*p) == Some(0)).unwrap();
        let rec = begin(&m, &[primary_p], None, 3).unwrap();
        assert_eq!(rec.from, 0);
        let (jm, jrec) = join(&m, &rec).unwrap();
        assert!(switch(&jm, &jrec).is_err(), "a new primary needs the fence");
        let (fm, frec) = fence(&jm, &jrec).unwrap();
        fm.validate().unwrap();
        assert_eq!(fm.fenced, vec![primary_p]);
        assert_eq!(resume_step(&frec, true, false), Step::Abort);
        let (sm, _) = switch(&fm, &frec).unwrap();
        sm.validate().unwrap();
        assert_eq!(sm.primary(primary_p), Some(3));
        assert_eq!(&sm.replicas(primary_p)[1..], &m.replicas(primary_p)[1..]);
        // Rolled back from the fence: node 3 leaves, the fence is lifted.
        let (rm, rrec) = abort(&fm, &frec).unwrap();
        let rm = rm.unwrap();
        rm.validate().unwrap();
        assert_eq!(rm.replicas(primary_p), m.replicas(primary_p));
        assert!(rm.fenced.is_empty() && rm.syncing.is_empty());
        assert_eq!(
            resume_step(&rrec, true, false),
            Step::Cleanup {
                node: 3,
                after_epoch: 0
            }
        );
    }

    #[test]
    fn replicated_moves_refuse_what_they_cannot_do() {
        let m = map(3, 8, 2);
        let p = 0;
        let outsider = (0..3).find(|n| !m.replicas(p).contains(n)).unwrap();
        let member = m.replicas(p)[1];
        assert_eq!(
            begin(&m, &[p], Some(outsider), member),
            Err(MoveError::AlreadyThere {
                partition: p,
                node: member
            })
        );
        assert_eq!(
            begin(&m, &[p], Some(outsider), 7),
            Err(MoveError::UnknownNode(7))
        );
        let mut s = m.clone();
        s.assignment[p as usize].truncate(1);
        s.assignment[p as usize].push(outsider);
        s.syncing = vec![(p, outsider)];
        s.validate().unwrap();
        let third = (0..3).find(|n| !s.replicas(p).contains(n)).unwrap();
        assert_eq!(begin(&s, &[p], None, third), Err(MoveError::Syncing(p)));
        // R = 1: only the primary moves.
        let one = map(2, 4, 1);
        let primary = one.primary(0).unwrap();
        assert!(begin(&one, &[0], Some(primary), 1 - primary).is_ok());
        assert!(!begin(&one, &[0], None, 1 - primary).unwrap().replicated);
    }

    #[derive(Debug, Clone, Copy)]
    enum Act {
        Step,
        Crash,
        Rollback,
        Overrun,
    }

    fn act() -> impl Strategy<Value = Act> {
        prop_oneof![
            6 => Just(Act::Step),
            2 => Just(Act::Crash),
            1 => Just(Act::Rollback),
            1 => Just(Act::Overrun),
        ]
    }

    proptest! {
        /// Whatever kills and rollbacks hit it, a replicated move: publishes only valid
        /// maps; changes a partition's primary only out of a map that fences it; never
        /// leaves a partition with fewer full (non-syncing) replicas than it had; touches
        /// no other partition; and ends either switched (`to` in `from`'s place) or rolled
        /// back (the sets as before), with no fence and nothing syncing.
        #[test]
        fn a_replicated_move_is_never_half_applied(
            nodes in 3u32..6,
            r in 2u32..4,
            parts in 4u32..24,
            pick in any::<u64>(),
            from_i in 0u32..6,
            to_i in 0u32..6,
            acts in proptest::collection::vec(act(), 1..40),
        ) {
            prop_assume!(r < nodes);
            let m0 = map(nodes, parts, r);
            let (from, to) = (from_i % nodes, to_i % nodes);
            let chosen: Vec<u32> = (0..parts)
                .filter(|p| pick >> (p % 64) & 1 == 1)
                .filter(|p| m0.replicas(*p).contains(&from) && !m0.replicas(*p).contains(&to))
                .collect();
            prop_assume!(!chosen.is_empty());
            let rec0 = begin(&m0, &chosen, Some(from), to).unwrap();
            prop_assert!(rec0.replicated);
            let mut m = m0.clone();
            let mut rec = Some(rec0);
            let (mut resuming, mut rollback) = (false, false);
            let mut switched = false;
            let full = |m: &ClusterMap, p: u32| {
                m.replicas(p).iter().filter(|n| !m.is_syncing(p, **n)).count()
            };
            let mut acts = acts.into_iter().chain(std::iter::repeat(Act::Step));
            for _ in 0..200 {
                let Some(r) = rec.clone() else { break };
                let a = acts.next().unwrap_or(Act::Step);
                match a {
                    Act::Crash => { resuming = true; continue; }
                    Act::Rollback => { rollback = true; continue; }
                    _ => {}
                }
                let step = resume_step(&r, resuming, rollback);
                resuming = false;
                let (next, next_rec): (Option<ClusterMap>, Option<MoveRecord>) = match step {
                    Step::Copy | Step::FinalCopy { .. } if matches!(a, Act::Overrun) => {
                        let (n, nr) = abort(&m, &r).unwrap();
                        (n, Some(nr))
                    }
                    Step::Copy => unreachable!("a replicated move never copies by passes"),
                    Step::Join => {
                        let (n, nr) = join(&m, &r).unwrap();
                        (Some(n), Some(nr))
                    }
                    Step::Fill => {
                        let (n, nr) = if led_by_from(&m, &r).is_empty() {
                            switch(&m, &r).unwrap()
                        } else {
                            fence(&m, &r).unwrap()
                        };
                        (Some(n), Some(nr))
                    }
                    Step::FinalCopy { .. } => {
                        let (n, nr) = switch(&m, &r).unwrap();
                        (Some(n), Some(nr))
                    }
                    Step::Abort => {
                        let (n, nr) = abort(&m, &r).unwrap();
                        (n, Some(nr))
                    }
                    Step::Cleanup { .. } => {
                        switched = matches!(r.phase, Phase::Switched { .. });
                        (None, None)
                    }
                };
                if let Some(n) = next {
                    prop_assert!(n.validate().is_ok(), "{:?}", n.validate());
                    prop_assert_eq!(n.epoch, m.epoch + 1);
                    for p in 0..parts {
                        if m.primary(p) != n.primary(p) {
                            prop_assert!(m.is_fenced(p), "partition {} changed primary unfenced", p);
                        }
                        prop_assert!(full(&n, p) >= full(&m0, p), "partition {} below its full replicas", p);
                        if !chosen.contains(&p) {
                            prop_assert_eq!(n.replicas(p), m0.replicas(p));
                        }
                    }
                    for p in &n.fenced {
                        prop_assert_eq!(n.primary(*p), Some(from));
                    }
                    m = n;
                }
                rec = next_rec;
            }
            prop_assert!(rec.is_none(), "the move ended");
            prop_assert!(m.fenced.is_empty() && m.syncing.is_empty());
            for p in 0..parts {
                if chosen.contains(&p) && switched {
                    let want: Vec<NodeId> = m0
                        .replicas(p)
                        .iter()
                        .map(|n| if *n == from { to } else { *n })
                        .collect();
                    prop_assert_eq!(m.replicas(p), &want[..]);
                } else {
                    prop_assert_eq!(m.replicas(p), m0.replicas(p));
                }
            }
        }
    }
}
