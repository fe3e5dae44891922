//! The mover: drives [`crate::moves`]' state machine over real servers (SCAN from the
//! old owner, APPLY into the new one, STATS for the epoch a server has installed) and
//! etcd (the map and the move record, changed together by transaction). Blocking: it
//! owns a small runtime for its etcd calls, and the client it copies with is the blocking
//! one; call it from a plain thread, not from inside a runtime.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use camelot_client::{reply, Client, ClientConfig, ClientError, NodeInfo, Pending};
use camelot_proto::limits::SCAN_ITEMS_MAX;
use camelot_proto::{Item, Op};

use crate::etcd::{EtcdCluster, EtcdError, Publish, Versioned, VersionedMove};
use crate::map::{ClusterMap, NodeId};
use crate::moves::{
    abort, begin, deletions, fence, final_copy, join, led_by_from, resume_step, switch, CopyLog,
    FinalCopy, KeyVersion, MoveError, MoveRecord, Step, CATCHUP_PASSES_MAX, CATCHUP_SETTLED_KEYS,
    FENCE_MAX, MOVE_KEYS_MAX,
};

/// How long a node may take to show an epoch before cleanup on it is given up (the keys
/// stay; `cluster move` run again retries) — a node that does not install maps is dead
/// or cut off from etcd.
pub const CLEANUP_WAIT_MAX: Duration = Duration::from_secs(10);
/// Between two looks at a node's epoch while waiting for it.
const EPOCH_POLL: Duration = Duration::from_millis(1);
/// Lost transactions (another writer changed the map or the record) retried per step.
const COMMIT_ATTEMPTS_MAX: u32 = 16;
/// Items asked per SCAN page.
const SCAN_PAGE_ITEMS: u32 = SCAN_ITEMS_MAX as u32;
/// A hold point (`--hold-at`, for kill tests) holds at most this long, then goes on.
const HOLD_MAX: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum MoverError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error(transparent)]
    Move(#[from] MoveError),
    #[error("node {node}: {source}")]
    Client { node: NodeId, source: ClientError },
    #[error("there is no cluster map in etcd")]
    NoMap,
    #[error("gave up after {0} lost races for the map or the move record")]
    Contended(u32),
    #[error("the final pass overran the fence limit")]
    FenceOverrun,
    #[error("a mover's worker thread panicked")]
    Worker,
    #[error("cannot start a runtime for etcd: {0}")]
    Runtime(std::io::Error),
}

/// Deliberate defects, only for showing that the tests' checkers can fail.
#[derive(Debug, Clone, Copy, Default)]
pub struct Defects {
    /// Switch without the final pass under the fence.
    pub no_final_copy: bool,
    /// Replicated moves: switch without filling the joining replica (it then holds only
    /// the writes made since it joined).
    pub no_fill: bool,
}

pub use crate::moves::{MoveReport, RebalanceReport};

pub struct Mover {
    rt: tokio::runtime::Runtime,
    etcd: EtcdCluster,
    progress: Box<dyn FnMut(&str) + Send>,
    /// Phase names (`copied`, `fenced`, `final-copied`, `switched`) at which to stop and
    /// wait (to be killed by a test).
    pub hold_at: Option<String>,
    /// How long a hold lasts (at most [`HOLD_MAX`]).
    pub hold_for: Duration,
    pub defects: Defects,
}

/// A blocking client over `nodes` at epoch 0: its SCAN, APPLY and STATS are never
/// redirected, whatever the map's epoch.
fn raw_client(map: &ClusterMap, nodes: &[NodeId]) -> Result<Client, MoverError> {
    routed_client(map, nodes, 0)
}

/// A blocking client over `nodes` whose requests carry `epoch` (0: never checked), with
/// no map source: a server at another epoch answers STALE_EPOCH and the call fails.
fn routed_client(map: &ClusterMap, nodes: &[NodeId], epoch: u64) -> Result<Client, MoverError> {
    let infos = nodes
        .iter()
        .filter_map(|id| map.node(*id))
        .map(|n| NodeInfo {
            id: n.id,
            addr: n.addr,
        })
        .collect();
    Client::connect(
        camelot_client::ClusterMap {
            epoch,
            nodes: infos,
        },
        ClientConfig::default(),
    )
    .map_err(|source| {
        // The node whose address the error names, so a rollback blames the right one.
        let named = source.addr().and_then(|a| {
            nodes
                .iter()
                .copied()
                .find(|id| map.node(*id).is_some_and(|n| n.addr == a))
        });
        MoverError::Client {
            node: named.or(nodes.first().copied()).unwrap_or_default(),
            source,
        }
    })
}

fn node_epoch(client: &Client, node: NodeId) -> Result<u64, MoverError> {
    let stats = client
        .stats(node)
        .map_err(|source| MoverError::Client { node, source })?;
    Ok(stats
        .into_iter()
        .find(|(k, _)| k == "epoch")
        .map_or(0, |(_, v)| v))
}

/// Waits until `node` shows `epoch` or later; false at `deadline`.
fn wait_epoch(
    client: &Client,
    node: NodeId,
    epoch: u64,
    deadline: Instant,
) -> Result<bool, MoverError> {
    loop {
        if node_epoch(client, node)? >= epoch {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(EPOCH_POLL);
    }
}

/// What a walk over a node's moving keys asks the node for.
#[derive(Clone, Copy)]
struct Walk<'a> {
    /// A flag per partition of the map: those moving.
    mask: &'a [bool],
    /// Only keys written at or after this version of the node's clock (0: all).
    since_version: u64,
    /// Keys and versions, no values.
    keys_only: bool,
    /// The node `from` copies each page to itself (SCAN_PARTITIONS' `push_to`); the
    /// pages then come back with keys and versions only.
    push_to: Option<NodeId>,
}

impl<'a> Walk<'a> {
    fn all(mask: &'a [bool]) -> Self {
        Walk {
            mask,
            since_version: 0,
            keys_only: false,
            push_to: None,
        }
    }

    fn keys(mask: &'a [bool]) -> Self {
        Walk {
            keys_only: true,
            ..Walk::all(mask)
        }
    }
}

/// Walks a [`push_pass`] makes side by side, each on a connection of its own: two, so
/// that the target applies one page while the source reads and sends the next (with one,
/// each end waits for the other).
const PUSH_WALKS: usize = 2;

/// A pushed walk: what it read, and the keys and versions `from` pushed.
type WalkedKeys = (Walked, Vec<(Bytes, u64)>);

/// What a walk read.
struct Walked {
    /// Key and value bytes the node sent (or pushed).
    bytes: u64,
    /// Value bytes the node pushed.
    pushed_bytes: u64,
    /// The node's version clock as the walk began: a walk `since` it sees every write the
    /// node took after this one began.
    version_clock: u64,
}

/// The keys of `node` in the partitions `walk` marks, page by page: `each` gets every
/// page's items. The node filters (SCAN_PARTITIONS), so only moving keys cross the wire.
fn scan_moving(
    client: &Client,
    node: NodeId,
    walk: Walk<'_>,
    deadline: Option<Instant>,
    mut each: impl FnMut(Vec<Item>) -> Result<(), MoverError>,
) -> Result<Walked, MoverError> {
    let partitions = walk.mask.len() as u32;
    let mask = camelot_proto::partition_mask(
        partitions,
        (0..partitions).filter(|p| walk.mask[*p as usize]),
    );
    let mut after: Option<Bytes> = None;
    let mut walked = Walked {
        bytes: 0,
        pushed_bytes: 0,
        version_clock: 0,
    };
    let mut first = true;
    loop {
        // Checked per page, so a fence overruns its limit by one page at most.
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(MoverError::FenceOverrun);
        }
        let page = reply::page(client.call(
            node,
            Op::ScanPartitions {
                after: after.take(),
                limit: SCAN_PAGE_ITEMS,
                partitions,
                mask: mask.clone(),
                since_version: walk.since_version,
                keys_only: walk.keys_only,
                push_to: walk.push_to,
            },
        ))
        .map_err(|source| MoverError::Client { node, source })?;
        if std::mem::take(&mut first) {
            walked.version_clock = page.version_clock;
        }
        walked.bytes += page
            .items
            .iter()
            .map(|i| (i.key.len() + i.value.len()) as u64)
            .sum::<u64>()
            + page.pushed_bytes;
        walked.pushed_bytes += page.pushed_bytes;
        if !page.items.is_empty() {
            each(page.items)?;
        }
        match page.resume_after {
            Some(k) => after = Some(k),
            None => return Ok(walked),
        }
    }
}

fn wait_applied(pending: Vec<Pending>, node: NodeId) -> Result<(), MoverError> {
    for p in pending {
        reply::version(p.wait()).map_err(|source| MoverError::Client { node, source })?;
    }
    Ok(())
}

#[derive(Default)]
struct Pass {
    keys: u64,
    bytes: u64,
    scanned: u64,
    /// `from`'s version clock as the pass began: the next pass needs only what is newer.
    version_clock: u64,
}

impl Pass {
    /// Counts a pass made after this one (over again, from version 0); its clock is the
    /// one the next pass starts from.
    fn then(&mut self, again: Pass) {
        self.keys += again.keys;
        self.bytes += again.bytes;
        self.scanned += again.scanned;
        self.version_clock = again.version_clock;
    }
}

/// One pass: every moving key of `from` written at or after `since_version` whose version
/// `log` has not sent is APPLYed to `to` from here; the applies of one page are in flight
/// while the next page is scanned. The fence's final pass, which sends only what `log`
/// lacks and checks its deadline per page; the passes before it are [`push_pass`]es.
fn copy_pass(
    client: &Client,
    (from, to): (NodeId, NodeId),
    mask: &[bool],
    since_version: u64,
    log: &mut CopyLog,
    deadline: Option<Instant>,
) -> Result<Pass, MoverError> {
    let mut pass = Pass {
        keys: 0,
        bytes: 0,
        scanned: 0,
        version_clock: 0,
    };
    let mut in_flight: Vec<Pending> = Vec::new();
    let walk = Walk {
        since_version,
        ..Walk::all(mask)
    };
    let walked = scan_moving(client, from, walk, deadline, |items| {
        let mut ops = Vec::new();
        for item in items {
            if log.must_send(&item.key, item.version)? {
                pass.keys += 1;
                pass.bytes += item.value.len() as u64;
                ops.push((
                    to,
                    Op::Apply {
                        key: item.key,
                        version: item.version,
                        value: Some(item.value),
                    },
                ));
            }
        }
        let sent = client
            .submit_many(ops)
            .map_err(|source| MoverError::Client { node: to, source })?;
        wait_applied(std::mem::replace(&mut in_flight, sent), to)
    })?;
    wait_applied(in_flight, to)?;
    pass.scanned = walked.bytes;
    pass.version_clock = walked.version_clock;
    if walked.version_clock < since_version {
        // `from`'s clock went back: it restarted since the last pass, and its versions
        // no longer say what is new. Everything, then.
        pass.then(copy_pass(client, (from, to), mask, 0, log, deadline)?);
    }
    Ok(pass)
}

/// One pass like [`copy_pass`]'s, but `from` pushes its pages to `to` itself
/// (SCAN_PARTITIONS' `push_to`), so the values cross loopback once instead of twice
/// through this process. It pushes all it finds — it does not know `log`, and an APPLY
/// already applied is a no-op — and answers keys and versions, which `log` records. The
/// moving partitions are shared out over `clients` (connections to `from`), one walk
/// each, so that `to` applies one page while `from` reads and sends another.
fn push_pass(
    clients: &[Client],
    (from, to): (NodeId, NodeId),
    mask: &[bool],
    since_version: u64,
    log: &mut CopyLog,
) -> Result<Pass, MoverError> {
    let moving: Vec<usize> = (0..mask.len()).filter(|p| mask[*p]).collect();
    let walks = clients.len().min(moving.len()).max(1);
    let shares: Vec<Vec<bool>> = (0..walks)
        .map(|w| {
            let mut share = vec![false; mask.len()];
            for p in moving.iter().skip(w).step_by(walks) {
                share[*p] = true;
            }
            share
        })
        .collect();
    let walked: Vec<Result<WalkedKeys, MoverError>> = std::thread::scope(|s| {
        let running: Vec<_> = shares
            .iter()
            .zip(clients)
            .map(|(share, client)| {
                s.spawn(move || {
                    let mut seen: Vec<(Bytes, u64)> = Vec::new();
                    let walk = Walk {
                        since_version,
                        push_to: Some(to),
                        ..Walk::all(share)
                    };
                    let walked = scan_moving(client, from, walk, None, |items| {
                        if seen.len() + items.len() > MOVE_KEYS_MAX {
                            return Err(MoveError::TooManyKeys.into());
                        }
                        seen.extend(items.into_iter().map(|i| (i.key, i.version)));
                        Ok(())
                    })?;
                    Ok((walked, seen))
                })
            })
            .collect();
        running
            .into_iter()
            .map(|w| w.join().unwrap_or(Err(MoverError::Worker)))
            .collect()
    });
    let mut pass = Pass {
        version_clock: u64::MAX,
        ..Pass::default()
    };
    for w in walked {
        let (walked, seen) = w?;
        for (key, version) in seen {
            if log.must_send(&key, version)? {
                pass.keys += 1;
            }
        }
        pass.bytes += walked.pushed_bytes;
        pass.scanned += walked.bytes;
        // The earliest walk's: the next pass then misses no write of any.
        pass.version_clock = pass.version_clock.min(walked.version_clock);
    }
    if pass.version_clock < since_version {
        // `from`'s clock went back: it restarted since the last pass (see `copy_pass`).
        pass.then(push_pass(clients, (from, to), mask, 0, log)?);
    }
    Ok(pass)
}

/// Deletes on `node` every key it holds in the partitions of `mask` (the old owner's
/// cleanup), each by an APPLY one version above the node's. Returns how many.
fn delete_all_moving(client: &Client, node: NodeId, mask: &[bool]) -> Result<u64, MoverError> {
    let present = scan_present(client, node, mask, None)?;
    let gone = deletions(&BTreeSet::new(), &present);
    apply_deletions(client, node, &gone, None)?;
    Ok(gone.len() as u64)
}

/// The keys (and versions) `node` holds in the partitions of `mask`.
fn scan_present(
    client: &Client,
    node: NodeId,
    mask: &[bool],
    deadline: Option<Instant>,
) -> Result<Vec<KeyVersion>, MoverError> {
    let mut present = Vec::new();
    scan_moving(client, node, Walk::keys(mask), deadline, |items| {
        if present.len() + items.len() > MOVE_KEYS_MAX {
            return Err(MoveError::TooManyKeys.into());
        }
        present.extend(items.into_iter().map(|i| KeyVersion {
            key: i.key.to_vec(),
            version: i.version,
        }));
        Ok(())
    })?;
    Ok(present)
}

/// Makes `node` hold the keys of `mask` exactly as `from` holds them (`source`: `from`'s
/// keys and versions there; `target`: `node`'s), both being still (under a fence: `from`
/// takes no client writes there, and `node` takes copies only from `from`). Keys and
/// versions are compared first (keys only: small), and only a walk that finds what differs
/// is made — from `since` (`from`'s clock as the last copy began) when everything that
/// differs is that recent. Returns the copy, the deletions and the plan.
fn reconcile(
    client: &Client,
    (from, node): (NodeId, NodeId),
    mask: &[bool],
    (source, target): (&[KeyVersion], Vec<KeyVersion>),
    since: u64,
    deadline: Instant,
) -> Result<(Pass, u64, FinalCopy), MoverError> {
    let plan = final_copy(source, &target, since);
    let pass = match plan.since() {
        None => Pass::default(),
        Some(since) => copy_pass(
            client,
            (from, node),
            mask,
            since,
            &mut CopyLog::seeded(&target)?,
            Some(deadline),
        )?,
    };
    let source_keys: BTreeSet<Vec<u8>> = source.iter().map(|kv| kv.key.clone()).collect();
    let gone = deletions(&source_keys, &target);
    apply_deletions(client, node, &gone, Some(deadline))?;
    Ok((pass, gone.len() as u64, plan))
}

/// The keys of `keys` in the partitions `mask` marks (a flag per partition of the map).
fn within(keys: &[KeyVersion], mask: &[bool]) -> Vec<KeyVersion> {
    let partitions = mask.len() as u32;
    keys.iter()
        .filter(|kv| mask[camelot_proto::partition_of(&kv.key, partitions) as usize])
        .cloned()
        .collect()
}

/// Deletes each of `gone` on `node` by an APPLY of nothing at its version; under a fence
/// (`deadline`), checked per batch like the walks, so a target holding many stale keys
/// cannot keep the fence up past its limit.
fn apply_deletions(
    client: &Client,
    node: NodeId,
    gone: &[KeyVersion],
    deadline: Option<Instant>,
) -> Result<(), MoverError> {
    for chunk in gone.chunks(SCAN_ITEMS_MAX) {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(MoverError::FenceOverrun);
        }
        let ops = chunk.iter().map(|d| {
            (
                node,
                Op::Apply {
                    key: Bytes::copy_from_slice(&d.key),
                    version: d.version,
                    value: None,
                },
            )
        });
        let sent = client
            .submit_many(ops)
            .map_err(|source| MoverError::Client { node, source })?;
        wait_applied(sent, node)?;
    }
    Ok(())
}

/// What filling a replica did.
#[derive(Debug, Clone, Default)]
pub struct FillReport {
    pub keys_copied: u64,
    pub bytes_copied: u64,
    /// Keys the target held that the primary no longer has, deleted there.
    pub keys_deleted: u64,
    pub secs: f64,
    /// The primary's version clock as the copy began: every write it took that the copy
    /// may have missed has a version at least this.
    pub version_clock: u64,
}

/// Times a move's cleanup starts again because its node installed a newer map while it
/// ran (its deletions are routed at the map they were chosen under).
const CLEANUP_AGAIN_MAX: u32 = 3;

/// How long [`fill_replica`] waits for the primary to show the epoch that made `to` a
/// replica (a primary that does not install maps is dead or cut off from etcd).
pub const FILL_EPOCH_WAIT_MAX: Duration = Duration::from_secs(10);

/// Re-replication's copy: makes `to` hold all of `partitions` as their primary `from`
/// has them, while `from` serves and copies every new write to `to` (the map at `epoch`
/// lists `to` as a syncing replica). Order matters, and is:
/// 1. wait until `from` shows `epoch`: from then on each of its writes to the partitions
///    reaches `to` before it is acknowledged (a server installs a map only between
///    batches), so what the snapshot misses, the live copies carry;
/// 2. copy `from`'s keys (SCAN, APPLY: kept only if newer than what `to` has);
/// 3. scan `to`, *then* scan `from`, and delete on `to` what it has and `from` does not —
///    a key deleted on `from` whose live copy (a deletion: nothing to keep) reached `to`
///    before step 2's older copy of it, which put it back. In this order a key on `to`
///    but not on `from` was deleted on `from` after `to` was scanned (its deletion's copy
///    removes it anyway) or was resurrected; never one `from` created since (that would be
///    in `from`'s scan). Each deletion carries `to`'s version + 1, so a newer write of the
///    key that reaches `to` first wins over it.
///
/// Every request of the copy is routed at `map.epoch`: once the map moves on, both nodes
/// refuse it (STALE_EPOCH) and the copy fails, to be made again under the new map — so a
/// copy by a controller that has since been replaced (paused, not dead) cannot put an
/// old key back after its successor's copy has finished.
///
/// Blocking; call it from a plain thread.
pub fn fill_replica(
    map: &ClusterMap,
    from: NodeId,
    to: NodeId,
    partitions: &[u32],
) -> Result<FillReport, MoverError> {
    let start = Instant::now();
    let epoch = map.epoch;
    let probe = raw_client(map, &[from, to])?;
    let deadline = Instant::now() + FILL_EPOCH_WAIT_MAX;
    for node in [from, to] {
        if !wait_epoch(&probe, node, epoch, deadline)? {
            return Err(MoverError::Client {
                node,
                source: ClientError::InvalidArgument(format!(
                    "node {node} did not reach epoch {epoch} within {FILL_EPOCH_WAIT_MAX:?}"
                )),
            });
        }
    }
    let clients = (0..PUSH_WALKS)
        .map(|_| routed_client(map, &[from, to], epoch))
        .collect::<Result<Vec<_>, _>>()?;
    let client = &clients[0];
    let mut mask = vec![false; map.partitions() as usize];
    for p in partitions {
        if let Some(m) = mask.get_mut(*p as usize) {
            *m = true;
        }
    }
    let mut log = CopyLog::default();
    let pass = push_pass(&clients, (from, to), &mask, 0, &mut log)?;
    let present = scan_present(client, to, &mask, None)?;
    let source_keys: BTreeSet<Vec<u8>> = scan_present(client, from, &mask, None)?
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    let gone = deletions(&source_keys, &present);
    apply_deletions(client, to, &gone, None)?;
    Ok(FillReport {
        keys_copied: pass.keys,
        bytes_copied: pass.bytes,
        keys_deleted: gone.len() as u64,
        secs: start.elapsed().as_secs_f64(),
        version_clock: pass.version_clock,
    })
}

impl Mover {
    pub fn connect(
        endpoints: &[String],
        prefix: &str,
        progress: Box<dyn FnMut(&str) + Send>,
    ) -> Result<Mover, MoverError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(MoverError::Runtime)?;
        let etcd = rt.block_on(EtcdCluster::connect(endpoints, prefix))?;
        Ok(Mover {
            rt,
            etcd,
            progress,
            hold_at: None,
            hold_for: HOLD_MAX,
            defects: Defects::default(),
        })
    }

    pub fn etcd(&self) -> &EtcdCluster {
        &self.etcd
    }

    fn say(&mut self, line: String) {
        (self.progress)(&line);
    }

    fn hold(&mut self, phase: &str) {
        if self.hold_at.as_deref() == Some(phase) {
            // Once: a step retried after the hold (the map changed under it, as a kill
            // test makes it) goes on.
            self.hold_at = None;
            self.say(format!("holding at {phase}"));
            std::thread::sleep(self.hold_for.min(HOLD_MAX));
        }
    }

    pub fn read_map(&self) -> Result<Versioned, MoverError> {
        self.rt
            .block_on(self.etcd.read_map())?
            .ok_or(MoverError::NoMap)
    }

    pub fn read_move(&self) -> Result<Option<VersionedMove>, MoverError> {
        Ok(self.rt.block_on(self.etcd.read_move())?)
    }

    pub fn live_nodes(&self) -> Result<Vec<crate::map::Node>, MoverError> {
        Ok(self.rt.block_on(self.etcd.live_nodes())?)
    }

    /// Publishes a map change not tied to a move (new nodes joining the map).
    pub fn update_map(
        &self,
        change: impl FnMut(Option<&ClusterMap>) -> Result<ClusterMap, EtcdError>,
    ) -> Result<Versioned, MoverError> {
        Ok(self
            .rt
            .block_on(self.etcd.update_map(COMMIT_ATTEMPTS_MAX, change))?)
    }

    /// A transition of the record (and the map with it); `None` when it lost a race.
    fn commit(
        &self,
        map: Option<(&Versioned, Option<&ClusterMap>)>,
        current: Option<i64>,
        record: Option<&MoveRecord>,
    ) -> Result<bool, MoverError> {
        let (cur, next) = match map {
            Some((cur, next)) => (Some(cur), next),
            None => (None, None),
        };
        let won = self
            .rt
            .block_on(self.etcd.commit_move(cur, next, current, record))?;
        Ok(matches!(won, Publish::Won(_)))
    }

    /// A replicated move's fill: `to` is made to hold every partition of `rec` as its
    /// primary has it, one [`fill_replica`] per primary (routed at `map`'s epoch).
    fn fill(&mut self, map: &ClusterMap, rec: &MoveRecord) -> Result<FillReport, MoverError> {
        let mut by_primary: std::collections::BTreeMap<NodeId, Vec<u32>> = Default::default();
        for &p in &rec.partitions {
            if let Some(primary) = map.primary(p) {
                by_primary.entry(primary).or_default().push(p);
            }
        }
        let mut all = FillReport::default();
        for (primary, parts) in by_primary {
            let r = fill_replica(map, primary, rec.to, &parts)?;
            all.keys_copied += r.keys_copied;
            all.bytes_copied += r.bytes_copied;
            all.keys_deleted += r.keys_deleted;
            all.secs += r.secs;
            // The final pass walks `from`'s partitions (those it leads): its clock, not
            // another primary's (clocks of two servers do not compare).
            if primary == rec.from {
                all.version_clock = r.version_clock;
            }
        }
        Ok(all)
    }

    /// Moves `partitions` (all with one primary) to `to`. A move already in progress is
    /// finished first (or rolled back, if it was fenced when found); then this one runs.
    pub fn run(&mut self, partitions: &[u32], to: NodeId) -> Result<MoveReport, MoverError> {
        self.run_from(partitions, None, to)
    }

    /// Moves `partitions`' replica on `from` (their primary when `None`) to `to`: with
    /// R = 1 the primary, with R > 1 any member of their sets (see [`crate::moves`]).
    pub fn run_from(
        &mut self,
        partitions: &[u32],
        from: Option<NodeId>,
        to: NodeId,
    ) -> Result<MoveReport, MoverError> {
        let mut resumed = None;
        if self.read_move()?.is_some() {
            self.say("a move is in progress: finishing it first".into());
            resumed = Some(self.drive(true, false)?);
        }
        for _ in 0..COMMIT_ATTEMPTS_MAX {
            let map = self.read_map()?;
            let rec = match begin(&map.map, partitions, from, to) {
                // The move found was this one, and it is done.
                Err(MoveError::AlreadyThere { .. })
                    if resumed.as_ref().is_some_and(|r| r.switched) =>
                {
                    return Ok(resumed.unwrap_or_default());
                }
                r => r?,
            };
            if self.commit(Some((&map, None)), None, Some(&rec))? {
                self.say(format!(
                    "move of {} partition(s) from node {} to node {}{}: copying",
                    rec.partitions.len(),
                    rec.from,
                    rec.to,
                    if rec.replicated {
                        format!(" (replicated, R = {})", map.map.replication)
                    } else {
                        String::new()
                    }
                ));
                let report = self.drive(false, false)?;
                if report.switched {
                    return Ok(report);
                }
                // Rolled back (the final pass overran the fence): start over.
                self.say("the move was rolled back; starting it again".into());
                continue;
            }
        }
        Err(MoverError::Contended(COMMIT_ATTEMPTS_MAX))
    }

    /// Finishes the move in progress (`rollback`: undoes it instead). `None` when there
    /// is none.
    pub fn resume(&mut self, rollback: bool) -> Result<Option<MoveReport>, MoverError> {
        if self.read_move()?.is_none() {
            return Ok(None);
        }
        self.drive(true, rollback).map(Some)
    }

    /// Runs the recorded move through its phases until its record is gone.
    fn drive(&mut self, mut resuming: bool, rollback: bool) -> Result<MoveReport, MoverError> {
        let mut report = MoveReport::default();
        let mut log = CopyLog::default();
        // `from`'s version clock as this mover's last copy pass began (0: none yet, or
        // resumed): the final pass copies only what was written since.
        let mut copied_since = 0u64;
        let mut fence_started: Option<Instant> = None;
        let mut lost = 0;
        let mut cleanups_again = 0;
        loop {
            if lost > COMMIT_ATTEMPTS_MAX {
                return Err(MoverError::Contended(lost));
            }
            let Some(VersionedMove {
                record: rec,
                mod_revision: rev,
            }) = self.read_move()?
            else {
                return Ok(report);
            };
            report.partitions = rec.partitions.len();
            report.from = rec.from;
            report.to = rec.to;
            let map = self.read_map()?;
            let mask = rec.mask(map.map.partitions());
            let step = resume_step(&rec, resuming, rollback);
            resuming = false;
            match step {
                Step::Copy => {
                    let clients = (0..PUSH_WALKS)
                        .map(|_| raw_client(&map.map, &[rec.from, rec.to]))
                        .collect::<Result<Vec<_>, _>>()?;
                    let start = Instant::now();
                    for pass_no in 1..=CATCHUP_PASSES_MAX {
                        let pass =
                            push_pass(&clients, (rec.from, rec.to), &mask, copied_since, &mut log)?;
                        copied_since = pass.version_clock;
                        report.keys_copied += pass.keys;
                        report.bytes_copied += pass.bytes;
                        report.bytes_scanned += pass.scanned;
                        self.say(format!(
                            "pass {pass_no}: {} key(s), {} value bytes copied ({} bytes scanned) at {:.3} s",
                            pass.keys,
                            pass.bytes,
                            pass.scanned,
                            start.elapsed().as_secs_f64()
                        ));
                        if pass.keys as usize <= CATCHUP_SETTLED_KEYS {
                            break;
                        }
                    }
                    report.copy_secs = start.elapsed().as_secs_f64();
                    self.hold("copied");
                    let (next, next_rec) = fence(&map.map, &rec)?;
                    if self.commit(Some((&map, Some(&next))), Some(rev), Some(&next_rec))? {
                        fence_started = Some(Instant::now());
                        self.say(format!("fenced at epoch {}", next.epoch));
                        self.hold("fenced");
                    } else {
                        lost += 1;
                    }
                }
                Step::Join => {
                    let (next, next_rec) = join(&map.map, &rec)?;
                    if self.commit(Some((&map, Some(&next))), Some(rev), Some(&next_rec))? {
                        self.say(format!(
                            "node {} joined the replica sets at epoch {} (syncing)",
                            rec.to, next.epoch
                        ));
                        self.hold("joined");
                    } else {
                        lost += 1;
                    }
                }
                Step::Fill => {
                    // A failover dropped `to` (dead) from some set: nothing to fill.
                    if let Some(&p) = rec
                        .partitions
                        .iter()
                        .find(|p| !map.map.replicas(**p).contains(&rec.to))
                    {
                        self.say(format!(
                            "node {} left partition {p}'s replica set: rolling back",
                            rec.to
                        ));
                        let (next, next_rec) = abort(&map.map, &rec)?;
                        if !self.commit(Some((&map, next.as_ref())), Some(rev), Some(&next_rec))? {
                            lost += 1;
                        }
                        continue;
                    }
                    let start = Instant::now();
                    if !self.defects.no_fill {
                        match self.fill(&map.map, &rec) {
                            Ok(r) => {
                                copied_since = r.version_clock;
                                report.keys_copied += r.keys_copied;
                                report.bytes_copied += r.bytes_copied;
                                self.say(format!(
                                    "filled node {}: {} key(s), {} value bytes copied, {} stale deleted, in {:.3} s",
                                    rec.to, r.keys_copied, r.bytes_copied, r.keys_deleted, r.secs
                                ));
                            }
                            // The map moved on (a failover, a finished sync) or a node
                            // is briefly out: read both again and fill again.
                            Err(e @ MoverError::Client { .. }) => {
                                self.say(format!("fill failed ({e}); again"));
                                lost += 1;
                                continue;
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    report.copy_secs = start.elapsed().as_secs_f64();
                    self.hold("copied");
                    let fencing = !led_by_from(&map.map, &rec).is_empty();
                    let (next, next_rec) = if fencing {
                        fence(&map.map, &rec)?
                    } else {
                        switch(&map.map, &rec)?
                    };
                    if self.commit(Some((&map, Some(&next))), Some(rev), Some(&next_rec))? {
                        if fencing {
                            fence_started = Some(Instant::now());
                            self.say(format!("fenced at epoch {}", next.epoch));
                            self.hold("fenced");
                        } else {
                            report.switched = true;
                            self.say(format!(
                                "switched at epoch {} (no fence: node {} leads none of them)",
                                next.epoch, rec.from
                            ));
                            self.hold("switched");
                        }
                    } else {
                        lost += 1;
                    }
                }
                Step::FinalCopy { fence_epoch } => {
                    let started = *fence_started.get_or_insert_with(Instant::now);
                    let deadline = started + FENCE_MAX;
                    let client = raw_client(&map.map, &[rec.from, rec.to])?;
                    let mut phases = Vec::new();
                    // `from` dead (SIGKILLed under the fence): roll back, lifting the fence
                    // at once; a failover then deals with its partitions.
                    let mut done = match wait_epoch(&client, rec.from, fence_epoch, deadline) {
                        Ok(d) => d,
                        Err(e @ MoverError::Client { .. }) => {
                            self.say(format!(
                                "node {} unreachable under the fence ({e})",
                                rec.from
                            ));
                            false
                        }
                        Err(e) => return Err(e),
                    };
                    phases.push(("epoch installed", started.elapsed()));
                    // A replicated move reconciles only the fenced partitions (`from`
                    // leads them), against what `to` holds: it has had every write since
                    // it joined, so only what differs is sent.
                    let mask = if rec.replicated {
                        let fenced = MoveRecord {
                            partitions: map
                                .map
                                .fenced
                                .iter()
                                .copied()
                                .filter(|p| rec.partitions.binary_search(p).is_ok())
                                .collect(),
                            ..rec.clone()
                        };
                        fenced.mask(map.map.partitions())
                    } else {
                        mask.clone()
                    };
                    if done && !self.defects.no_final_copy {
                        // Every member that stays in the fenced partitions' sets holds
                        // what `from` holds: `to`, and (replicated) the other backups — a
                        // copy one of them refused as the fence began reaches it now,
                        // whatever became of `from`'s own resend.
                        let mut members = vec![(rec.to, mask.clone())];
                        if rec.replicated {
                            for (p, _) in mask.iter().enumerate().filter(|(_, m)| **m) {
                                for &n in map.map.replicas(p as u32) {
                                    if n == rec.from || n == rec.to {
                                        continue;
                                    }
                                    let at = match members.iter().position(|(m, _)| *m == n) {
                                        Some(i) => i,
                                        None => {
                                            members.push((n, vec![false; mask.len()]));
                                            members.len() - 1
                                        }
                                    };
                                    members[at].1[p] = true;
                                }
                            }
                        }
                        // A client per member (each with `from`, to copy from it), made
                        // in the member's own worker: a member that cannot be reached
                        // fails only its own reconcile, never the whole pass.
                        let member_client = |node: NodeId| raw_client(&map.map, &[rec.from, node]);
                        let last = raw_client(&map.map, &[rec.from]).and_then(|client| {
                            // Every key scan at once — `from`'s and each member's — then
                            // the members reconciled side by side: the fence lasts the
                            // slowest scan and the slowest member, not their sum.
                            let (source, targets) = std::thread::scope(|s| {
                                let scans: Vec<_> = members
                                    .iter()
                                    .map(|(node, node_mask)| {
                                        let member_client = &member_client;
                                        s.spawn(move || {
                                            let client = member_client(*node)?;
                                            let target = scan_present(
                                                &client,
                                                *node,
                                                node_mask,
                                                Some(deadline),
                                            )?;
                                            Ok((client, target))
                                        })
                                    })
                                    .collect();
                                let source = scan_present(&client, rec.from, &mask, Some(deadline));
                                let targets: Vec<Result<_, MoverError>> = scans
                                    .into_iter()
                                    .map(|w| w.join().unwrap_or(Err(MoverError::Worker)))
                                    .collect();
                                (source, targets)
                            });
                            let source = source?;
                            phases.push(("keys scanned", started.elapsed()));
                            let outcomes = std::thread::scope(|s| {
                                let running: Vec<_> = members
                                    .iter()
                                    .zip(targets)
                                    .map(|((node, node_mask), scanned)| {
                                        let source = &source;
                                        let worker = s.spawn(move || {
                                            let (client, target) = scanned?;
                                            let source = within(source, node_mask);
                                            reconcile(
                                                &client,
                                                (rec.from, *node),
                                                node_mask,
                                                (&source, target),
                                                copied_since,
                                                deadline,
                                            )
                                        });
                                        (*node, worker)
                                    })
                                    .collect();
                                running
                                    .into_iter()
                                    .map(|(node, worker)| {
                                        (node, worker.join().unwrap_or(Err(MoverError::Worker)))
                                    })
                                    .collect::<Vec<_>>()
                            });
                            let mut total = (Pass::default(), 0u64, Vec::new());
                            for (node, done) in outcomes {
                                let (pass, deleted, plan) = match done {
                                    Ok(d) => d,
                                    // A backup other than `to` that cannot be reached is
                                    // dead or cut off: the failover's business, not a
                                    // reason to undo the move.
                                    Err(e @ MoverError::Client { .. }) if node != rec.to => {
                                        total.2.push(format!("node {node}: skipped ({e})"));
                                        continue;
                                    }
                                    Err(e) => return Err(e),
                                };
                                total.0.keys += pass.keys;
                                total.0.bytes += pass.bytes;
                                total.0.scanned += pass.scanned;
                                total.1 += deleted;
                                total.2.push(format!("node {node}: {plan}"));
                            }
                            Ok((total.0, total.1, total.2.join("; ")))
                        });
                        match last {
                            Ok((pass, deleted, plan)) => {
                                phases.push(("members reconciled", started.elapsed()));
                                let phases: Vec<String> = phases
                                    .iter()
                                    .map(|(what, at)| {
                                        format!("{what} at {:.1} ms", at.as_secs_f64() * 1e3)
                                    })
                                    .collect();
                                let plan = format!("{plan}; {}", phases.join(", "));
                                report.keys_copied += pass.keys;
                                report.bytes_copied += pass.bytes;
                                report.bytes_scanned += pass.scanned;
                                self.say(format!(
                                    "final pass: {} key(s) copied, {deleted} deleted ({plan})",
                                    pass.keys
                                ));
                                done = Instant::now() < deadline;
                                if !done {
                                    self.say(format!(
                                        "the final pass overran the fence limit ({} ms)",
                                        FENCE_MAX.as_millis()
                                    ));
                                }
                            }
                            // Overran, or `from` or `to` is unreachable: the fence goes,
                            // the move rolls back.
                            Err(e @ (MoverError::FenceOverrun | MoverError::Client { .. })) => {
                                self.say(format!("final pass failed: {e}"));
                                done = false
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    self.hold("final-copied");
                    let (next, next_rec, what) = if done {
                        let (m, r) = switch(&map.map, &rec)?;
                        (Some(m), r, "switched")
                    } else {
                        let (m, r) = abort(&map.map, &rec)?;
                        (m, r, "rolled back")
                    };
                    if self.commit(Some((&map, next.as_ref())), Some(rev), Some(&next_rec))? {
                        let fence_ms = started.elapsed().as_secs_f64() * 1e3;
                        report.fence_ms = Some(fence_ms);
                        report.switched = done;
                        self.say(format!(
                            "{what} at epoch {} (fence held {fence_ms:.1} ms)",
                            next.as_ref().map_or(map.map.epoch, |m| m.epoch)
                        ));
                        self.hold("switched");
                    } else {
                        lost += 1;
                    }
                }
                Step::Abort => {
                    let (next, next_rec) = abort(&map.map, &rec)?;
                    if self.commit(Some((&map, next.as_ref())), Some(rev), Some(&next_rec))? {
                        self.say("rolled back: the partitions stay where they were".into());
                    } else {
                        lost += 1;
                    }
                }
                Step::Cleanup { node, after_epoch } => {
                    report.switched = matches!(rec.phase, crate::moves::Phase::Switched { .. });
                    // A replicated `to` took live copies until it installed the rollback.
                    let after_epoch = if rec.replicated && after_epoch == 0 {
                        map.map.epoch
                    } else {
                        after_epoch
                    };
                    // Never a partition the node (still, or again) holds a replica of.
                    let mut mask = mask.clone();
                    for (p, m) in mask.iter_mut().enumerate() {
                        if map.map.replicas(p as u32).contains(&node) {
                            *m = false;
                        }
                    }
                    match raw_client(&map.map, &[node]) {
                        Ok(client) => {
                            let deadline = Instant::now() + CLEANUP_WAIT_MAX;
                            // The deletions are routed at the epoch the mask was taken
                            // under: a node that has installed a newer map (which may make
                            // it a replica of one of these partitions again, and fill it)
                            // refuses them, where unrouted they deleted the fill's copies.
                            let epoch = after_epoch.max(map.map.epoch);
                            // A node that dies now (SIGKILLed mid-move) holds nothing
                            // anyone can read: the move is done without its cleanup.
                            let cleaned =
                                wait_epoch(&client, node, epoch, deadline).and_then(|reached| {
                                    reached
                                        .then(|| {
                                            let routed =
                                                routed_client(&map.map, &[node], map.map.epoch)?;
                                            delete_all_moving(&routed, node, &mask)
                                        })
                                        .transpose()
                                });
                            match cleaned {
                                Ok(Some(n)) => {
                                    report.keys_deleted = n;
                                    self.say(format!("cleanup: {n} key(s) deleted on node {node}"));
                                }
                                Ok(None) => self.say(format!(
                                    "cleanup: node {node} did not reach epoch {epoch}; its copies stay"
                                )),
                                Err(e @ MoverError::Client { .. }) => {
                                    // Refused because the node has a newer map than this
                                    // one: again, with the mask of the map it has.
                                    let moved_on = node_epoch(&client, node)
                                        .is_ok_and(|now| now > map.map.epoch);
                                    if moved_on && cleanups_again < CLEANUP_AGAIN_MAX {
                                        cleanups_again += 1;
                                        self.say(format!(
                                            "cleanup: node {node} installed a map newer than \
                                             epoch {}; again under it",
                                            map.map.epoch
                                        ));
                                        continue;
                                    }
                                    self.say(format!(
                                        "cleanup: stopped on node {node} ({e}); its copies stay"
                                    ))
                                }
                                Err(e) => return Err(e),
                            }
                        }
                        // A node that cannot be reached holds nothing anyone can read.
                        Err(e) => self.say(format!("cleanup: node {node} unreachable ({e})")),
                    }
                    if self.commit(None, Some(rev), None)? {
                        self.say("done".into());
                    } else {
                        lost += 1;
                    }
                }
            }
        }
    }
}
