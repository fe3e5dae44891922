//! The controller: one per cluster, elected through etcd's election API (a campaign under
//! a lease it keeps alive), so a second controller process waits as a standby and takes
//! over one lease TTL after the first dies. While it leads it reconciles, every tick, the
//! map with the live registrations ([`crate::failover`]'s pure decisions):
//!
//! 1. **Failover** — a node whose registration is gone (or is a new incarnation) is dead:
//!    its partitions are led by their most up-to-date live backup and it leaves every
//!    replica set, in one map transaction at a new epoch. "Most up to date" is the
//!    highest version applied for the partition, from the members' reports, asked for
//!    afresh (bounded wait) when a partition has more than one candidate.
//! 2. **Join** — live registrations missing from the map join it.
//! 3. **Re-replication** — partitions below R gain syncing replicas; worker threads copy
//!    the partition from its primary ([`crate::mover::fill_replica`]); once every copy of a
//!    round is done the replicas are made full ones in one transaction.
//! 4. **Auto-rebalance** (only with [`ControllerConfig::auto_rebalance`]) — when the map
//!    is otherwise settled (no fence, nothing syncing), [`crate::auto::decide`]: a
//!    plan on membership (a node joined or left, a skewed map) or on sustained load
//!    imbalance (weights from the members' measured ops/s); a worker thread runs its moves
//!    with the [`crate::mover::Mover`], one per (from, to) pair (with R > 1 a move replaces
//!    the member `from` by `to` in the partitions' replica sets). Every phase of a move is
//!    recorded in etcd with its map change, so a controller killed mid-move leaves a
//!    record its successor's worker resumes (or rolls back) first.
//!
//! Every map it writes is guarded by its leadership (the election key's revision) as well
//! as the map's revision, so a deposed controller that wakes up writes nothing. Its state
//! is the map: a successor reads it and computes the same next steps, so a controller
//! killed mid-failover or mid-copy leaves nothing half-applied (a copy interrupted is
//! made again; its APPLYs are routed at the map's epoch, so a paused old controller's
//! copies are refused once the map moves on).
//!
//! Blocking: it owns a small runtime for etcd; call [`Controller::run`] from a plain thread.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auto::{AutoConfig, LoadSample, LoadTracker};
use crate::etcd::{EtcdCluster, EtcdError, Leader, Publish, Registration, Versioned};
use crate::failover::{
    finish_syncs, join, repair, rereplicate, sync_work, Alive, Marks, Promote, Synced,
};
use crate::map::{ClusterMap, NodeId};
use crate::mover::{fill_replica, FillReport, MoveReport, Mover, MoverError};

/// How often a leading controller looks at the registrations and the map.
pub const TICK_DEFAULT: Duration = Duration::from_millis(50);
/// How long a failover waits for fresh reports from the candidates before deciding on
/// the ones it has (the periodic ones, at most a report period old).
pub const REPORT_WAIT_MAX: Duration = Duration::from_millis(300);
/// A campaign call waits this long before it is renewed (the candidacy is kept: the
/// election key lives on the lease).
const CAMPAIGN_PATIENCE: Duration = Duration::from_secs(1);
/// Copy workers at once (one per (primary, target) pair).
pub const COPIES_MAX: usize = 64;
/// A hold point holds at most this long.
pub const HOLD_MAX: Duration = Duration::from_secs(120);
/// After a failed copy, the next round waits this long.
const COPY_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// After an etcd error, wait this long before the next tick.
const ERROR_BACKOFF: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("cannot start a runtime for etcd: {0}")]
    Runtime(std::io::Error),
    #[error("cannot start a copy worker: {0}")]
    Thread(std::io::Error),
}

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// What this controller campaigns with (shown as the leader's name).
    pub name: String,
    /// TTL of the lease the candidacy lives on: a dead leader is replaced this long
    /// after its last renewal.
    pub lease_ttl: Duration,
    pub tick: Duration,
    pub promote: Promote,
    /// Test hook: a point (`detected`: a dead node seen, before the failover is
    /// published; `copying`: a copy worker about to copy) at which to stop and wait to be
    /// killed, for `hold_for` (at most [`HOLD_MAX`]).
    pub hold_at: Option<String>,
    pub hold_for: Duration,
    /// Plan and run moves by itself (`--auto-rebalance`); `None`: never moves.
    pub auto_rebalance: Option<AutoConfig>,
    /// Test hook, deliberately unsafe: its moves switch without the final copy.
    pub unsafe_no_final_copy: bool,
}

impl ControllerConfig {
    pub fn new(name: impl Into<String>) -> ControllerConfig {
        ControllerConfig {
            name: name.into(),
            lease_ttl: crate::LEASE_TTL_DEFAULT,
            tick: TICK_DEFAULT,
            promote: Promote::MostUpToDate,
            hold_at: None,
            hold_for: HOLD_MAX,
            auto_rebalance: None,
            unsafe_no_final_copy: false,
        }
    }
}

type Progress = Arc<dyn Fn(&str) + Send + Sync>;

pub struct Controller {
    rt: tokio::runtime::Runtime,
    etcd: EtcdCluster,
    endpoints: Vec<String>,
    prefix: String,
    cfg: ControllerConfig,
    progress: Progress,
}

/// What a copy worker sends back.
struct CopyDone {
    from: NodeId,
    to: NodeId,
    /// What finishing each partition's copy will claim, as of the map copied under.
    synced: Vec<Synced>,
    result: Result<FillReport, MoverError>,
}

/// What the move worker sends back: one line per move, then its end.
enum MoveNews {
    Moved(MoveReport),
    Done(Result<(), MoverError>),
}

/// One term of office: the copies it started.
struct Term {
    leader: Leader,
    _lease: Registration,
    copying: BTreeMap<(NodeId, NodeId), Vec<u32>>,
    done: Vec<Synced>,
    /// After a failed copy, no new round before this.
    retry_at: Option<Instant>,
    tx: mpsc::Sender<CopyDone>,
    rx: mpsc::Receiver<CopyDone>,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// Auto-rebalance: the running move worker's news and its stop flag.
    moving: Option<(mpsc::Receiver<MoveNews>, Arc<AtomicBool>)>,
    load: LoadTracker,
    /// When the load was last sampled (once a report period).
    sampled_at: Option<Instant>,
    /// Measured weights in force (see [`crate::auto`]).
    weights: Option<BTreeMap<NodeId, u32>>,
    /// After a failed rebalance, none before this.
    rebalance_retry_at: Option<Instant>,
}

impl Controller {
    pub fn connect(
        endpoints: &[String],
        prefix: &str,
        cfg: ControllerConfig,
        progress: Progress,
    ) -> Result<Controller, ControllerError> {
        // Multi-threaded (one worker) so the lease keep-alive task runs while the loop
        // sleeps between ticks.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(ControllerError::Runtime)?;
        let etcd = rt.block_on(EtcdCluster::connect(endpoints, prefix))?;
        Ok(Controller {
            rt,
            etcd,
            endpoints: endpoints.to_vec(),
            prefix: prefix.to_string(),
            cfg,
            progress,
        })
    }

    fn say(&self, line: &str) {
        (self.progress)(line);
    }

    fn hold(&self, point: &str) {
        if self.cfg.hold_at.as_deref() == Some(point) {
            self.say(&format!("holding at {point}"));
            std::thread::sleep(self.cfg.hold_for.min(HOLD_MAX));
        }
    }

    /// Campaigns, leads while elected, campaigns again when deposed; returns when `stop`
    /// is set (resigning the post if it holds it).
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), ControllerError> {
        while !stop.load(Ordering::Relaxed) {
            let lease = match self.rt.block_on(self.etcd.keep_lease(self.cfg.lease_ttl)) {
                Ok(l) => l,
                Err(e) => {
                    self.say(&format!("cannot take a lease: {e}; again shortly"));
                    std::thread::sleep(ERROR_BACKOFF);
                    continue;
                }
            };
            self.say(&format!("controller {}: campaigning", self.cfg.name));
            let leader = loop {
                if stop.load(Ordering::Relaxed) || !lease.is_alive() {
                    break None;
                }
                match self.rt.block_on(self.etcd.campaign(
                    lease.lease_id(),
                    &self.cfg.name,
                    CAMPAIGN_PATIENCE,
                )) {
                    Ok(Some(l)) => break Some(l),
                    Ok(None) => {}
                    Err(e) => {
                        self.say(&format!("campaign: {e}; again shortly"));
                        std::thread::sleep(ERROR_BACKOFF);
                    }
                }
            };
            let Some(leader) = leader else { continue };
            self.say(&format!(
                "controller {}: leader (election revision {})",
                self.cfg.name,
                leader.revision()
            ));
            let (tx, rx) = mpsc::channel();
            let mut term = Term {
                leader,
                _lease: lease,
                copying: BTreeMap::new(),
                done: Vec::new(),
                retry_at: None,
                tx,
                rx,
                workers: Vec::new(),
                moving: None,
                load: LoadTracker::default(),
                sampled_at: None,
                weights: None,
                rebalance_retry_at: None,
            };
            self.lead(&mut term, stop);
            if stop.load(Ordering::Relaxed) {
                let _ = self.rt.block_on(self.etcd.resign(term.leader.clone()));
                self.say("resigned");
            } else {
                self.say("deposed: campaigning again once this term's copies end");
            }
            // A worker of this term must not copy on into the next one's round; the move
            // worker stops after the move it is in (whose record a successor would resume).
            if let Some((_, stop_moves)) = &term.moving {
                stop_moves.store(true, Ordering::Relaxed);
            }
            for w in term.workers.drain(..) {
                let _ = w.join();
            }
        }
        Ok(())
    }

    /// Leads until deposed (or `stop`).
    fn lead(&self, term: &mut Term, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            if !term._lease.is_alive() {
                return;
            }
            match self.tick(term) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    self.say(&format!("tick: {e}"));
                    std::thread::sleep(ERROR_BACKOFF);
                    match self.rt.block_on(self.etcd.still_leads(&term.leader)) {
                        Ok(false) => return,
                        _ => continue,
                    }
                }
            }
            std::thread::sleep(self.cfg.tick);
        }
    }

    /// Publishes `next` over `current`; Ok(false) when no longer the leader. A lost race
    /// for the map (someone else wrote it) is Ok(true) with nothing written: the next
    /// tick reads again.
    fn publish(
        &self,
        term: &Term,
        next: &ClusterMap,
        current: &Versioned,
    ) -> Result<Option<bool>, ControllerError> {
        match self
            .rt
            .block_on(self.etcd.publish_as(&term.leader, next, current))?
        {
            Publish::Won(_) => Ok(Some(true)),
            Publish::Lost => {
                if self.rt.block_on(self.etcd.still_leads(&term.leader))? {
                    Ok(Some(false))
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// One look at the cluster; false when deposed.
    fn tick(&self, term: &mut Term) -> Result<bool, ControllerError> {
        self.collect(term);
        let Some(current) = self.rt.block_on(self.etcd.read_map())? else {
            return Ok(true);
        };
        let alive = Alive::new(self.rt.block_on(self.etcd.live_nodes())?);
        let map = &current.map;

        // 1. Failover first: nothing else is worth a map while writes fail.
        if let Some(r) = repair(map, &alive, &Marks::default(), self.cfg.promote) {
            let marks = self.marks_for(map, &alive, &r.dead)?;
            let Some(r) = repair(map, &alive, &marks, self.cfg.promote) else {
                return Ok(true);
            };
            self.hold("detected");
            return Ok(match self.publish(term, &r.map, &current)? {
                None => false,
                Some(false) => true,
                Some(true) => {
                    let promoted: Vec<String> = r
                        .promoted
                        .iter()
                        .take(8)
                        .map(|p| format!("{}:{}→{}", p.partition, p.dead, p.to))
                        .collect();
                    self.say(&format!(
                        "epoch {}: node(s) {:?} dead; {} partition(s) promoted [{}{}], {} backup slot(s) dropped, stranded {:?}",
                        r.map.epoch,
                        r.dead,
                        r.promoted.len(),
                        promoted.join(" "),
                        if r.promoted.len() > 8 { " …" } else { "" },
                        r.backups_dropped,
                        r.stranded
                    ));
                    true
                }
            });
        }

        // 2. New members join.
        if let Some(next) = join(map, &alive) {
            return Ok(match self.publish(term, &next, &current)? {
                None => false,
                Some(false) => true,
                Some(true) => {
                    let old: BTreeSet<_> =
                        map.nodes.iter().map(|n| (n.id, n.addr, n.lease)).collect();
                    let joined: Vec<NodeId> = next
                        .nodes
                        .iter()
                        .filter(|n| !old.contains(&(n.id, n.addr, n.lease)))
                        .map(|n| n.id)
                        .collect();
                    self.say(&format!("epoch {}: node(s) {joined:?} joined", next.epoch));
                    true
                }
            });
        }

        // 3. Finished copies become full replicas, once the round's copies are all in.
        if term.copying.is_empty() && !term.done.is_empty() {
            let done = std::mem::take(&mut term.done);
            if let Some(next) = finish_syncs(map, &done) {
                return Ok(match self.publish(term, &next, &current)? {
                    None => false,
                    Some(false) => {
                        term.done = done;
                        true
                    }
                    Some(true) => {
                        self.say(&format!(
                            "epoch {}: {} replica(s) filled; {} still syncing",
                            next.epoch,
                            map.syncing.len() - next.syncing.len(),
                            next.syncing.len()
                        ));
                        true
                    }
                });
            }
        }

        // 4. Under-replicated partitions gain syncing replicas.
        if let Some((next, added)) = rereplicate(map, &alive) {
            return Ok(match self.publish(term, &next, &current)? {
                None => false,
                Some(false) => true,
                Some(true) => {
                    let mut per_node: BTreeMap<NodeId, usize> = BTreeMap::new();
                    for (_, n) in &added {
                        *per_node.entry(*n).or_default() += 1;
                    }
                    self.say(&format!(
                        "epoch {}: re-replicating {} partition(s) to node(s) {per_node:?}",
                        next.epoch,
                        added.len()
                    ));
                    true
                }
            });
        }

        // 5. Copies for the syncing replicas, a round at a time.
        // A failed copy (the map moved on under it, a node died) is made again, after a
        // pause so that a copy failing for good does not spin.
        let paused = term.retry_at.is_some_and(|t| Instant::now() < t);
        if term.copying.is_empty() && term.done.is_empty() && !paused {
            term.retry_at = None;
            let mut work = sync_work(map, &alive);
            if !work.is_empty() {
                // A replicated move's joining replica is its mover's to fill, and its to
                // end (full at the switch, gone at a rollback). Copied here as well, a
                // copy finishing after a rollback had emptied `to` and the move had begun
                // again would mark `to` full without the data.
                if let Some(m) = self.rt.block_on(self.etcd.read_move())? {
                    let r = &m.record;
                    for ((_, to), parts) in work.iter_mut() {
                        if *to == r.to {
                            parts.retain(|p| r.partitions.binary_search(p).is_err());
                        }
                    }
                    work.retain(|_, parts| !parts.is_empty());
                }
            }
            for ((from, to), partitions) in work.into_iter().take(COPIES_MAX) {
                self.start_copy(term, map, from, to, partitions)?;
            }
        }

        // 6. Auto-rebalance, once the map is settled.
        if self.cfg.auto_rebalance.is_some() {
            self.auto_rebalance(term, map, &alive)?;
        }
        Ok(true)
    }

    /// Step 6: follows the move worker, samples the load once a report period, and
    /// starts a worker for [`crate::auto::decide`]'s moves when there are some.
    fn auto_rebalance(
        &self,
        term: &mut Term,
        map: &ClusterMap,
        alive: &Alive,
    ) -> Result<(), ControllerError> {
        let Some(cfg) = self.cfg.auto_rebalance.as_ref() else {
            return Ok(());
        };
        if let Some((rx, _)) = &term.moving {
            let mut ended = None;
            while let Ok(news) = rx.try_recv() {
                match news {
                    MoveNews::Moved(r) => self.say(&format!(
                        "auto-rebalance: {} {} partition(s) node {} → {}: {} key(s) copied in {:.3} s, fence {}",
                        if r.switched { "moved" } else { "rolled back" },
                        r.partitions,
                        r.from,
                        r.to,
                        r.keys_copied,
                        r.copy_secs,
                        r.fence_ms.map_or("none".to_string(), |f| format!("{f:.1} ms"))
                    )),
                    MoveNews::Done(r) => ended = Some(r),
                }
            }
            match ended {
                None => return Ok(()),
                Some(Ok(())) => self.say("auto-rebalance: plan done"),
                Some(Err(e)) => {
                    self.say(&format!("auto-rebalance: {e}; planning again shortly"));
                    term.rebalance_retry_at = Some(Instant::now() + COPY_RETRY_PAUSE);
                }
            }
            term.moving = None;
            // The load measured before the moves says nothing about after them.
            term.load.clear();
        }
        let period = crate::etcd::REPORT_PERIOD;
        if term.sampled_at.is_none_or(|t| t.elapsed() >= period) {
            term.sampled_at = Some(Instant::now());
            // Unreadable reports make no sample (observing none would clear every node's
            // sustained history); moves are planned on.
            match self.rt.block_on(self.etcd.reports()) {
                Ok(reports) => {
                    let samples: Vec<LoadSample> = reports
                        .iter()
                        .filter(|r| map.node(r.node).is_some_and(|n| alive.holds(n)))
                        .map(|r| LoadSample {
                            node: r.node,
                            ops_per_sec: r.ops_per_sec,
                            throttled: r.throttled,
                        })
                        .collect();
                    term.load.observe(&samples, cfg);
                }
                Err(e) => self.say(&format!("auto-rebalance: reports unreadable ({e})")),
            }
        }
        let paused = term.rebalance_retry_at.is_some_and(|t| Instant::now() < t);
        if paused {
            return Ok(());
        }
        // A move recorded by a predecessor (killed mid-move: maybe holding a fence) is
        // resumed first, whatever else the map shows.
        let in_progress = self.rt.block_on(self.etcd.read_move())?.is_some();
        // Only live nodes take partitions: a plan onto a dead one would fail its move.
        // (With R = 1 a dead node's partitions are stranded, not movable: failover keeps
        // it in the map, and auto-rebalance plans nothing until it comes back — a restart
        // is a new, empty process, which the map does not record while its id is
        // referenced, so that takes an operator.) A recorded move is
        // still resumed — it may hold a fence over partitions of live nodes, which no one
        // else lifts (its mover rolls back what it cannot finish).
        let every_node_live = map.nodes.iter().all(|n| alive.holds(n));
        if !every_node_live {
            if in_progress {
                self.say("auto-rebalance: a move is in progress; resuming it (a node is dead: nothing new is planned)");
                return self.start_moves(term, BTreeMap::new());
            }
            return Ok(());
        }
        let settled = map.fenced.is_empty()
            && map.syncing.is_empty()
            && term.copying.is_empty()
            && term.done.is_empty();
        if !settled && !in_progress {
            return Ok(());
        }
        let measured = term.load.capacity_weights(map, cfg);
        let decision = match crate::auto::decide(map, term.weights.as_ref(), measured.as_ref(), cfg)
        {
            Ok(d) => d,
            Err(e) => {
                self.say(&format!("auto-rebalance: cannot plan: {e}"));
                term.rebalance_retry_at = Some(Instant::now() + COPY_RETRY_PAUSE);
                return Ok(());
            }
        };
        if decision.is_none() && !in_progress {
            return Ok(());
        }
        let groups = match decision {
            Some(d) => {
                self.say(&format!(
                    "auto-rebalance: epoch {}: {} partition(s) to move in {} move(s), on {}{}",
                    map.epoch,
                    d.partitions(),
                    d.groups.len(),
                    if d.load {
                        "load imbalance"
                    } else {
                        "membership"
                    },
                    d.weights
                        .as_ref()
                        .map_or(String::new(), |w| format!(", measured weights {w:?}"))
                ));
                term.weights = d.weights;
                d.groups
            }
            None => {
                self.say("auto-rebalance: a move is in progress; resuming it");
                BTreeMap::new()
            }
        };
        self.start_moves(term, groups)
    }

    fn start_moves(
        &self,
        term: &mut Term,
        groups: BTreeMap<(NodeId, NodeId), Vec<u32>>,
    ) -> Result<(), ControllerError> {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        term.moving = Some((rx, Arc::clone(&stop)));
        let endpoints = self.endpoints.clone();
        let prefix = self.prefix.clone();
        let progress = Arc::clone(&self.progress);
        let mover_hold = self.cfg.hold_at.clone().filter(|h| {
            ["joined", "copied", "fenced", "final-copied", "switched"].contains(&h.as_str())
        });
        let hold_for = self.cfg.hold_for.min(HOLD_MAX);
        let no_final_copy = self.cfg.unsafe_no_final_copy;
        let worker = std::thread::Builder::new()
            .name("camelot-auto-move".into())
            .spawn(move || {
                let say = Arc::clone(&progress);
                let result = (|| -> Result<(), MoverError> {
                    let mut m = Mover::connect(
                        &endpoints,
                        &prefix,
                        Box::new(move |l: &str| say(&format!("mover: {l}"))),
                    )?;
                    m.hold_at = mover_hold;
                    m.hold_for = hold_for;
                    m.defects.no_final_copy = no_final_copy;
                    if let Some(r) = m.resume(false)? {
                        let _ = tx.send(MoveNews::Moved(r));
                    }
                    for ((from, to), parts) in groups {
                        for chunk in parts.chunks(crate::moves::MOVE_PARTITIONS_MAX) {
                            if stop.load(Ordering::Relaxed) {
                                return Ok(());
                            }
                            let r = m.run_from(chunk, Some(from), to)?;
                            let _ = tx.send(MoveNews::Moved(r));
                        }
                    }
                    Ok(())
                })();
                let _ = tx.send(MoveNews::Done(result));
            })
            .map_err(ControllerError::Thread)?;
        term.workers.push(worker);
        Ok(())
    }

    /// Copy results that came in since the last tick.
    fn collect(&self, term: &mut Term) {
        while let Ok(d) = term.rx.try_recv() {
            term.copying.remove(&(d.from, d.to));
            match d.result {
                Ok(r) => {
                    self.say(&format!(
                        "copy node {} → node {}: {} partition(s), {} key(s), {} value bytes, {} stale key(s) deleted, in {:.3} s",
                        d.from,
                        d.to,
                        d.synced.len(),
                        r.keys_copied,
                        r.bytes_copied,
                        r.keys_deleted,
                        r.secs
                    ));
                    term.done.extend(d.synced);
                }
                Err(e) => {
                    term.retry_at = Some(Instant::now() + COPY_RETRY_PAUSE);
                    self.say(&format!(
                        "copy node {} → node {} failed: {e}; it will be made again",
                        d.from, d.to
                    ));
                }
            }
        }
        term.workers.retain(|w| !w.is_finished());
    }

    fn start_copy(
        &self,
        term: &mut Term,
        map: &ClusterMap,
        from: NodeId,
        to: NodeId,
        partitions: Vec<u32>,
    ) -> Result<(), ControllerError> {
        term.copying.insert((from, to), partitions.clone());
        let tx = term.tx.clone();
        let map = map.clone();
        let hold = (self.cfg.hold_at.as_deref() == Some("copying"))
            .then(|| self.cfg.hold_for.min(HOLD_MAX));
        let progress = Arc::clone(&self.progress);
        let synced: Vec<Synced> = partitions
            .iter()
            .map(|&p| Synced::of(&map, p, from, to))
            .collect();
        let worker = std::thread::Builder::new()
            .name(format!("camelot-copy-{from}-{to}"))
            .spawn(move || {
                if let Some(h) = hold {
                    progress("holding at copying");
                    std::thread::sleep(h);
                }
                let result = fill_replica(&map, from, to, &partitions);
                let _ = tx.send(CopyDone {
                    from,
                    to,
                    synced,
                    result,
                });
            })
            .map_err(ControllerError::Thread)?;
        term.workers.push(worker);
        Ok(())
    }

    /// The applied versions of the live replicas of the dead nodes' partitions: when some
    /// partition has two or more candidates, fresh reports are asked for and awaited
    /// (bounded); otherwise the choice needs none.
    fn marks_for(
        &self,
        map: &ClusterMap,
        alive: &Alive,
        dead: &[NodeId],
    ) -> Result<Marks, ControllerError> {
        let mut candidates: BTreeSet<NodeId> = BTreeSet::new();
        let mut contested = false;
        for (p, set) in map.assignment.iter().enumerate() {
            if !set.first().is_some_and(|n| dead.contains(n)) {
                continue;
            }
            let live: Vec<NodeId> = set[1..]
                .iter()
                .copied()
                .filter(|n| {
                    map.node(*n).is_some_and(|x| alive.holds(x)) && !map.is_syncing(p as u32, *n)
                })
                .collect();
            contested |= live.len() > 1;
            candidates.extend(live);
        }
        let mut marks = Marks::default();
        if !contested {
            return Ok(marks);
        }
        // Marks only rank the full backups, each of which holds every acknowledged write
        // (a primary acknowledges once all have applied it): when the reports cannot be
        // had (etcd refusing, or all of them past the client's message limit), failover
        // goes on with any full backup rather than stop.
        let unread = |e: &dyn std::fmt::Display| {
            self.say(&format!(
                "reports unreadable ({e}); promoting a full backup without ranking them"
            ));
        };
        let asked = match self.rt.block_on(self.etcd.request_reports()) {
            Ok(asked) => asked,
            Err(e) => {
                unread(&e);
                return Ok(marks);
            }
        };
        let deadline = Instant::now() + REPORT_WAIT_MAX;
        loop {
            let reports = match self.rt.block_on(self.etcd.reports()) {
                Ok(reports) => reports,
                Err(e) => {
                    unread(&e);
                    return Ok(marks);
                }
            };
            let fresh: BTreeSet<NodeId> = reports
                .iter()
                .filter(|r| r.answers >= asked)
                .map(|r| r.node)
                .collect();
            if candidates.is_subset(&fresh) || Instant::now() >= deadline {
                for r in reports.iter().filter(|r| candidates.contains(&r.node)) {
                    marks.set_node(r.node, r.applied.iter().copied());
                }
                if !candidates.is_subset(&fresh) {
                    self.say(&format!(
                        "fresh reports from {:?} of {candidates:?} within {REPORT_WAIT_MAX:?}; deciding on the latest ones",
                        fresh.intersection(&candidates).collect::<Vec<_>>()
                    ));
                }
                return Ok(marks);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
