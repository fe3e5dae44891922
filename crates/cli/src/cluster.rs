//! `camelot cluster …` and the cluster flags of `camelot server`: glue between the
//! cluster crate (map, planner, etcd) and the server; no logic a library could hold.

use std::path::PathBuf;
#[cfg(feature = "etcd")]
use std::time::Duration;

#[cfg(feature = "etcd")]
use anyhow::Context;
use anyhow::{bail, Result};
#[cfg(feature = "etcd")]
use camelot_cluster::etcd::{EtcdCluster, Registration};
use camelot_cluster::{
    ClusterMap, Node, NodeId, LEASE_TTL_DEFAULT, PARTITIONS_DEFAULT, PREFIX_DEFAULT,
};
use camelot_server::ServerHandle;
use clap::{Args, Subcommand};

use crate::units::parse_bytes;
#[cfg(feature = "etcd")]
use crate::{format_bytes, Signals};

/// `camelot server` as a cluster member: registers under a lease and follows the map.
#[derive(Args, Clone)]
pub struct MemberArgs {
    /// etcd endpoint (http://host:port); with it this server registers itself as a
    /// cluster node and answers key-value requests only for the partitions the map in
    /// etcd gives it (others get MOVED; requests from another epoch STALE_EPOCH).
    #[arg(long, value_name = "URL", requires = "node_id")]
    pub etcd: Option<String>,
    /// This server's node id in the cluster map.
    #[arg(long, value_name = "ID")]
    pub node_id: Option<u32>,
    /// Key prefix of this cluster in etcd.
    #[arg(long, default_value = PREFIX_DEFAULT)]
    pub etcd_prefix: String,
    /// Relative capacity the planner gives this node (0 drains it; at most 1,000,000).
    #[arg(long, default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(0..=i64::from(camelot_cluster::map::WEIGHT_MAX)))]
    pub weight: u32,
    /// Seconds the registration outlives this process (whole seconds, ≥ 1).
    #[arg(long, value_name = "SECONDS", default_value_t = LEASE_TTL_DEFAULT.as_secs())]
    pub lease_ttl: u64,
    /// Milliseconds a write on a partition with backups waits for all of them before it
    /// is answered REPLICA_UNAVAILABLE (applied here, not acknowledged: retry it).
    #[arg(long, value_name = "MS", default_value_t = camelot_server::replicate::REPLICATION_TIMEOUT_DEFAULT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub replication_timeout_ms: u64,
    /// Deliberately broken: acknowledge writes before the backups have them (copies go
    /// out afterwards). Exists only so the failover test can show its checker catches
    /// the writes this loses; never use it.
    #[arg(long, hide = true)]
    pub unsafe_ack_before_replication: bool,
}

/// The member flags that shape the server itself (set before it starts).
pub fn configure(args: &MemberArgs, cfg: &mut camelot_server::ServerConfig) {
    cfg.replication_timeout = std::time::Duration::from_millis(args.replication_timeout_ms);
    cfg.unsafe_ack_before_replication = args.unsafe_ack_before_replication;
    // A member of an etcd cluster is where partitions move from and to.
    cfg.partition_index = args.etcd.is_some();
}

/// What node `id`, this process being its `incarnation`, serves under `map`: the
/// partitions it is primary of, their backups (every replica after the first, with its
/// address), and the partitions it backs up. Nothing at all while the map's entry for
/// `id` records another incarnation: that is a process which died with its memory, and
/// this one, restarted under its id, holds none of its data — serving its partitions
/// would answer acknowledged writes with "no such key", and taking copies as its backup
/// would count it a full replica. It serves once the map records it (the controller's
/// join, after failover has taken the dead one's partitions away).
/// Only servers that follow a map in etcd need it.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub fn ownership_of(
    map: &ClusterMap,
    id: u32,
    incarnation: u64,
) -> Result<camelot_server::ownership::Ownership, camelot_server::ownership::OwnershipError> {
    use camelot_server::ownership::{Ownership, Peer};
    let recorded = map.node(id).map_or(0, |n| n.incarnation);
    if recorded != 0 && recorded != incarnation {
        let none = vec![false; map.assignment.len()];
        return Ownership::new(map.epoch, none.clone())?
            .with_replicas(vec![Vec::new(); none.len()], none);
    }
    let mut backups = Vec::with_capacity(map.assignment.len());
    let mut backup_of = Vec::with_capacity(map.assignment.len());
    let mut stale_reads = Vec::with_capacity(map.assignment.len());
    let mut fenced = Vec::with_capacity(map.assignment.len());
    for (p, replicas) in map.assignment.iter().enumerate() {
        let first = replicas.first() == Some(&id);
        // Under a move's fence the listed primary serves no client, but keeps its backups:
        // it still sends them the writes it took before the fence that they have not
        // acknowledged (see camelot_server::replicate).
        fenced.push(first && map.is_fenced(p as u32));
        backups.push(if first {
            replicas[1..]
                .iter()
                .filter_map(|n| {
                    map.node(*n).map(|node| Peer {
                        id: *n,
                        addr: node.addr,
                    })
                })
                .collect()
        } else {
            Vec::new()
        });
        let backup = !first && replicas.contains(&id);
        backup_of.push(backup);
        // Replica reads only from full backups: one still being filled may lack keys.
        stale_reads.push(backup && !map.is_syncing(p as u32, id));
    }
    // Where a mover may ask this server to push its pages: the map's other servers.
    let peers = map
        .nodes
        .iter()
        .filter(|n| n.id != id)
        .map(|n| Peer {
            id: n.id,
            addr: n.addr,
        })
        .collect();
    // A fenced partition (a move's fence) is served by nobody until the switch.
    Ownership::new(map.epoch, map.serving_primaries_of(id))?
        .with_fenced(fenced)?
        .with_replicas(backups, backup_of)?
        .with_stale_reads(stale_reads)?
        .with_peers(peers)
}

/// Why this build cannot reach etcd, and how to get one that can.
#[cfg(not(feature = "etcd"))]
const NO_ETCD: &str = "this camelot was built without etcd support: rebuild with \
     `cargo build --release -p camelot --features etcd` (its build needs protoc, which \
     scripts/setup.sh installs), or use a static map (--map FILE)";

/// What keeps a member in the cluster: its lease renewals and its map follower.
#[cfg(not(feature = "etcd"))]
pub struct Member;

/// Without etcd support, `--etcd` is refused rather than ignored.
#[cfg(not(feature = "etcd"))]
pub async fn join(_handle: &ServerHandle, args: &MemberArgs) -> Result<Option<Member>> {
    match &args.etcd {
        None => Ok(None),
        Some(_) => bail!("--etcd: {NO_ETCD}"),
    }
}

/// What keeps a member in the cluster: its lease renewals and its map follower.
#[cfg(feature = "etcd")]
pub struct Member {
    keeper: tokio::task::JoinHandle<()>,
    follower: tokio::task::JoinHandle<()>,
    reporter: tokio::task::JoinHandle<()>,
}

#[cfg(feature = "etcd")]
impl Drop for Member {
    fn drop(&mut self) {
        self.keeper.abort();
        self.follower.abort();
        self.reporter.abort();
    }
}

/// How often the keeper looks whether the registration is still renewed.
#[cfg(feature = "etcd")]
const REGISTRATION_CHECK: Duration = Duration::from_millis(100);
/// Between attempts to register again after the lease expired.
#[cfg(feature = "etcd")]
const REREGISTER_BACKOFF: Duration = Duration::from_millis(200);

/// Keeps this process registered. Its lease can expire while it runs — etcd stalled, or
/// this host was cut off longer than the TTL — and it then registers again under a new
/// lease as the same incarnation, so the controller knows it for the same process with
/// its data (not a restart); without this, a stall that expired every replica's lease
/// left their partitions unserved for good. If another process holds the id by then (a
/// restarted one), this one exits: it has been replaced. Runs until aborted.
#[cfg(feature = "etcd")]
async fn keep_registered(
    etcd: EtcdCluster,
    node: Node,
    ttl: Duration,
    mut registration: Registration,
    lease: tokio::sync::watch::Sender<i64>,
) {
    use camelot_cluster::etcd::EtcdError;
    loop {
        while registration.is_alive() {
            tokio::time::sleep(REGISTRATION_CHECK).await;
        }
        tracing::warn!(
            node = node.id,
            lease = registration.lease_id(),
            "the registration's lease expired while this server ran; registering again"
        );
        registration = loop {
            match etcd.register(&node, ttl).await {
                Ok(r) => break r,
                Err(EtcdError::NodeTaken(id)) => {
                    tracing::error!(
                        "node id {id} is now registered by another process: this one exits"
                    );
                    std::process::exit(1);
                }
                Err(e) => {
                    tracing::warn!("registering again: {e}; retrying");
                    tokio::time::sleep(REREGISTER_BACKOFF).await;
                }
            }
        };
        tracing::info!(
            node = node.id,
            lease = registration.lease_id(),
            "registered again (same incarnation)"
        );
        let _ = lease.send(registration.lease_id());
    }
}

/// Key-value operations a server has executed (what its report's rate counts).
#[cfg(feature = "etcd")]
fn kv_ops(state: &camelot_server::ServerState) -> u64 {
    use camelot_proto::OpKind;
    [OpKind::Get, OpKind::Put, OpKind::Delete, OpKind::CasPut]
        .iter()
        .map(|k| state.stats().ops(*k))
        .sum()
}

/// Publishes this member's report (see `camelot_cluster::etcd::Report`) every report
/// period and whenever the controller asks, under the registration's lease. Runs until
/// aborted; etcd errors are logged and retried.
#[cfg(feature = "etcd")]
async fn report_loop(
    etcd: EtcdCluster,
    state: std::sync::Arc<camelot_server::ServerState>,
    node: u32,
    lease: tokio::sync::watch::Receiver<i64>,
) {
    use camelot_cluster::etcd::{Report, REPORT_PERIOD};
    let mut last = (
        std::time::Instant::now(),
        kv_ops(&state),
        state.throttled_ns(),
    );
    let mut answers = 0i64;
    let mut requests = None;
    let mut tick = tokio::time::interval(REPORT_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if requests.is_none() {
            match etcd.watch_report_requests().await {
                Ok(w) => requests = Some(w),
                Err(e) => tracing::warn!("watching report requests: {e}"),
            }
        }
        let asked = async {
            match requests.as_mut() {
                Some(w) => w.message().await,
                None => std::future::pending().await,
            }
        };
        let asked = tokio::select! {
            _ = tick.tick() => None,
            msg = asked => Some(msg),
        };
        match asked {
            None => {}
            Some(Ok(Some(resp))) => {
                let rev = resp
                    .events()
                    .iter()
                    .filter_map(|e| e.kv())
                    .map(|kv| kv.mod_revision())
                    .max();
                answers = answers.max(rev.unwrap_or_default());
            }
            // The watch broke: take a new one next time round.
            Some(_) => requests = None,
        }
        let now = (
            std::time::Instant::now(),
            kv_ops(&state),
            state.throttled_ns(),
        );
        let secs = now.0.duration_since(last.0).as_secs_f64().max(1e-3);
        let report = Report {
            node,
            epoch: state.epoch(),
            answers,
            ops_per_sec: now.1.saturating_sub(last.1) as f64 / secs,
            throttled: now.2.saturating_sub(last.2) as f64 / 1e9 / secs,
            ops_per_sec_max: state.ops_per_sec_max(),
            applied: state.applied_marks(),
        };
        // A request answered at once measures no period: keep the rate's window open.
        if secs >= REPORT_PERIOD.as_secs_f64() / 2.0 {
            last = now;
        }
        let lease_id = *lease.borrow();
        if let Err(e) = etcd.put_report(&report, lease_id).await {
            tracing::warn!("publishing this node's report: {e}");
        }
    }
}

/// Joins the cluster when `--etcd` is given: registers, then follows the map (installing
/// this node's partitions in the server at each new epoch). Registration comes first: a
/// node restarted while its old lease is still alive is refused ("already registered by
/// a live process") before it has installed any map — installed first, it would serve
/// its partitions as an empty primary until the refusal came back. Must run on the
/// server's runtime.
#[cfg(feature = "etcd")]
pub async fn join(handle: &ServerHandle, args: &MemberArgs) -> Result<Option<Member>> {
    let (Some(endpoint), Some(id)) = (&args.etcd, args.node_id) else {
        return Ok(None);
    };
    let etcd = EtcdCluster::connect(std::slice::from_ref(endpoint), &args.etcd_prefix)
        .await
        .with_context(|| format!("cannot reach etcd at {endpoint}"))?;
    // Never 0 (which means "not recorded").
    let incarnation = rand::random::<u64>().max(1);
    let node = Node {
        id,
        addr: handle.local_addr(),
        weight: args.weight,
        lease: 0,
        incarnation,
    };
    let ttl = Duration::from_secs(args.lease_ttl);
    let registration = etcd
        .register(&node, ttl)
        .await
        .with_context(|| format!("cannot register node {id} in etcd"))?;
    let (lease_tx, lease_rx) = tokio::sync::watch::channel(registration.lease_id());
    let state = handle.state().clone();
    let follower =
        tokio::spawn(camelot_cluster::follow::follow(
            etcd.clone(),
            move |map| match ownership_of(map, id, incarnation) {
                Ok(own)
                    if map
                        .node(id)
                        .is_some_and(|n| n.incarnation != 0 && n.incarnation != incarnation) =>
                {
                    tracing::warn!(
                        epoch = map.epoch,
                        "the map's node {id} is an earlier process under this id, which died \
                         with its data: serving none of its partitions until the controller \
                         records this one"
                    );
                    state.set_ownership(own);
                }
                Ok(own) => {
                    let count = own.owned_count();
                    if state.set_ownership(own) {
                        tracing::info!(epoch = map.epoch, partitions = count, "cluster map");
                    }
                }
                Err(e) => tracing::warn!("cluster map epoch {}: {e}", map.epoch),
            },
        ));
    let reporter = tokio::spawn(report_loop(
        etcd.clone(),
        handle.state().clone(),
        id,
        lease_rx,
    ));
    let keeper = tokio::spawn(keep_registered(etcd, node, ttl, registration, lease_tx));
    Ok(Some(Member {
        keeper,
        follower,
        reporter,
    }))
}

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Start a cluster here: etcd (unless --etcd names one), N `camelot server` processes
    /// registered under leases, the map, and controller processes (one leads, the others
    /// stand by); runs until Ctrl-C.
    Up(UpArgs),
    /// Print the map's epoch, its nodes (live or not) and partitions per node.
    Status(SourceArgs),
    /// Print the plan that would rebalance the map over the live nodes (weights from
    /// their registrations); changes nothing.
    Plan(SourceArgs),
    /// Move partitions (all with one primary) to another node while they serve: copy,
    /// catch up, fence writes briefly (bounded, measured), final copy, switch the map to
    /// the new owner at a new epoch, delete the old owner's copies. A move already in
    /// progress (a mover was killed) is finished first; `--rollback` undoes it instead.
    /// Every phase is recorded in etcd with the map change it makes, so a killed move is
    /// resumed or rolled back, never half-applied.
    Move(MoveArgs),
    /// Add the live nodes missing from the map, then run `cluster plan`'s plan: one move
    /// per (old primary, new primary) pair, in turn, with progress.
    Rebalance(RebalanceArgs),
    /// Run a controller: campaigns in etcd's election (one leads, others stand by and
    /// take over when it dies); the leader promotes the most up-to-date backup of a dead
    /// node's partitions at a new epoch, drops the dead node from every replica set, and
    /// restores the replication factor by copying partitions to live nodes. Runs until
    /// Ctrl-C or SIGTERM.
    Controller(ControllerArgs),
    /// Give up the data of the partitions a dead node led with no copy left (replication
    /// 1, or every backup dead too), so they serve again, empty: the controller leaves
    /// them unserved rather than lose data by itself. If the node restarted under its id
    /// (an empty process), it serves them; if it is gone, the live nodes leading the
    /// fewest partitions take them. Without --confirm it only says what would be lost.
    AcceptLoss(AcceptLossArgs),
}

#[derive(Args)]
pub struct AcceptLossArgs {
    /// etcd endpoint of the cluster.
    #[arg(long, value_name = "URL")]
    etcd: String,
    #[arg(long, default_value = PREFIX_DEFAULT)]
    etcd_prefix: String,
    /// The dead node whose partitions are given up.
    #[arg(long, value_name = "NODE")]
    node: NodeId,
    /// Publish the change: the data of those partitions is gone for good.
    #[arg(long)]
    confirm: bool,
}

#[derive(Args)]
pub struct ControllerArgs {
    /// etcd endpoint of the cluster.
    #[arg(long, value_name = "URL")]
    etcd: String,
    #[arg(long, default_value = PREFIX_DEFAULT)]
    etcd_prefix: String,
    /// The name it campaigns under (default: controller-<pid>).
    #[arg(long)]
    name: Option<String>,
    /// Seconds a dead leader's post outlives it (whole seconds, ≥ 1): a standby takes
    /// over this long after the leader's last lease renewal.
    #[arg(long, value_name = "SECONDS", default_value_t = LEASE_TTL_DEFAULT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    lease_ttl: u64,
    /// Milliseconds between two looks at the registrations and the map.
    #[arg(long, value_name = "MS", default_value_t = 50,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    tick_ms: u64,
    /// Test hook: stop at this point (detected, copying) and wait to be killed.
    #[arg(long, hide = true, value_name = "POINT")]
    hold_at: Option<String>,
    /// Test hook: how long `--hold-at` holds (milliseconds; default: until killed).
    #[arg(long, hide = true, value_name = "MS")]
    hold_ms: Option<u64>,
    /// Test hook, deliberately unsafe: promote the live node holding the least of a dead
    /// primary's partition (one outside its replica set) instead of its most up-to-date
    /// backup — loses writes, to show the kill tests' checker can fail.
    #[arg(long, hide = true)]
    unsafe_promote_stale: bool,
    /// Rebalance by itself while leading: run the planner's moves when a node joins or
    /// leaves (or the map is skewed), and when the load stays imbalanced — some node
    /// saturated (waiting in its --ops-per-sec-max throttle at least half the time) while
    /// another has time to spare, for 3 report periods — with weights from the nodes'
    /// measured ops/s. With replication R > 1 a move replaces one member of the
    /// partitions' replica sets (see ARCHITECTURE.md, camelot-cluster).
    #[arg(long)]
    auto_rebalance: bool,
    /// Test hook, deliberately unsafe: auto-rebalance moves switch without their final
    /// copy under the fence (loses writes; shows the tests' checker can fail).
    #[arg(long, hide = true, requires = "auto_rebalance")]
    unsafe_no_final_copy: bool,
}

#[derive(Args)]
pub struct MoveArgs {
    /// Partitions to move (their replica on the `--from` node, by default their primary,
    /// which must then be the same node for all).
    #[arg(value_name = "PART", required_unless_present = "rollback")]
    partitions: Vec<u32>,
    /// The node to move them to.
    #[arg(long, value_name = "NODE", required_unless_present = "rollback")]
    to: Option<u32>,
    /// The member of their replica sets they leave (replication R > 1; default: the
    /// primary). It is replaced by `--to` in each set, primary role included.
    #[arg(long, value_name = "NODE")]
    from: Option<u32>,
    /// Undo the move in progress (found in etcd) instead of finishing it; no new move.
    #[arg(long, conflicts_with_all = ["partitions", "to", "from"])]
    rollback: bool,
    #[command(flatten)]
    mover: MoverArgs,
}

#[derive(Args)]
pub struct RebalanceArgs {
    #[command(flatten)]
    mover: MoverArgs,
    /// After the lines for people, one line of JSON with every move's report (keys and
    /// bytes copied, copy seconds, fence milliseconds, switched or rolled back).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct MoverArgs {
    /// etcd endpoint of the cluster.
    #[arg(long, value_name = "URL")]
    etcd: String,
    #[arg(long, default_value = PREFIX_DEFAULT)]
    etcd_prefix: String,
    /// Test hook: stop at this phase (joined, copied, fenced, final-copied, switched) and
    /// wait to be killed.
    #[arg(long, hide = true, value_name = "PHASE")]
    hold_at: Option<String>,
    /// Test hook: how long `--hold-at` holds (milliseconds; default: until killed).
    #[arg(long, hide = true, value_name = "MS")]
    hold_ms: Option<u64>,
    /// Test hook, deliberately unsafe: switch without the final copy under the fence
    /// (loses writes; shows the tests' checker can fail).
    #[arg(long, hide = true)]
    unsafe_no_final_copy: bool,
    /// Test hook, deliberately unsafe: a replicated move (R > 1) switches without filling
    /// the joining replica (loses the keys written before it joined).
    #[arg(long, hide = true)]
    unsafe_no_fill: bool,
}

#[derive(Args)]
pub struct UpArgs {
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// etcd endpoint; without it an etcd is started on loopback with a temporary data
    /// directory, and stopped with the cluster.
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    #[arg(long, default_value = PREFIX_DEFAULT)]
    etcd_prefix: String,
    #[arg(long, default_value_t = PARTITIONS_DEFAULT)]
    partitions: u32,
    #[arg(long, default_value_t = 1)]
    replication: u32,
    /// Memory cap per server.
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    memory: u64,
    /// How many of the nodes (the highest ids) are slow ones, for a heterogeneous cluster.
    #[arg(long, default_value_t = 0)]
    slow_nodes: u32,
    /// A slow node's executed operations per second (its `--ops-per-sec-max`).
    #[arg(long, value_name = "N", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(1..=camelot_server::throttle::OPS_PER_SEC_MAX))]
    slow_ops_per_sec: u64,
    /// Controller processes: one leads, the others stand by to take over when it dies.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=8))]
    controllers: u32,
    /// Lease TTL of the servers' registrations and of the controllers' candidacies
    /// (whole seconds): a dead node is noticed about this long after it died.
    #[arg(long, value_name = "SECONDS", default_value_t = LEASE_TTL_DEFAULT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    lease_ttl: u64,
    /// The controllers rebalance by themselves (see `cluster controller --auto-rebalance`).
    #[arg(long)]
    auto_rebalance: bool,
}

/// How the slow nodes are slowed: the server's own throttle. cgroup v2 `cpu.max` would
/// need a writable cgroup hierarchy (root, or a delegated subtree), which a plain
/// `cluster up` cannot count on; the throttle works anywhere.
#[cfg(feature = "etcd")]
fn slow_mechanism() -> String {
    let cgroup2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    format!(
        "throttle (--ops-per-sec-max, a token bucket on executed ops; cgroup v2 cpu.max {})",
        if cgroup2 {
            "is mounted but not used"
        } else {
            "is not mounted here"
        }
    )
}

#[derive(Args)]
pub struct SourceArgs {
    /// etcd endpoint of the cluster.
    #[arg(long, value_name = "URL", conflicts_with = "map")]
    etcd: Option<String>,
    #[arg(long, default_value = PREFIX_DEFAULT)]
    etcd_prefix: String,
    /// A static map file instead (TOML if it ends in .toml, JSON otherwise).
    #[arg(long, value_name = "FILE")]
    map: Option<PathBuf>,
}

pub fn run(cmd: ClusterCommand) -> Result<()> {
    let rt = crate::runtime()?;
    match cmd {
        ClusterCommand::Up(a) => rt.block_on(up(a)),
        ClusterCommand::Status(a) => rt.block_on(status(a)),
        ClusterCommand::Plan(a) => rt.block_on(plan(a)),
        // The mover blocks (its own small runtime for etcd): run off this runtime.
        ClusterCommand::Move(a) => {
            drop(rt);
            move_partitions(a)
        }
        ClusterCommand::Rebalance(a) => {
            drop(rt);
            rebalance(a)
        }
        ClusterCommand::Controller(a) => controller(rt, a),
        ClusterCommand::AcceptLoss(a) => rt.block_on(accept_loss(a)),
    }
}

#[cfg(not(feature = "etcd"))]
async fn accept_loss(_a: AcceptLossArgs) -> Result<()> {
    bail!("cluster accept-loss: {NO_ETCD}")
}

/// Publishes `failover::accept_loss`'s map (re-read and decided again if another writer
/// got in first), or prints what it would lose without `--confirm`.
#[cfg(feature = "etcd")]
async fn accept_loss(a: AcceptLossArgs) -> Result<()> {
    use camelot_cluster::etcd::Publish;
    use camelot_cluster::failover::{accept_loss, Alive};
    const ATTEMPTS_MAX: u32 = 5;
    let etcd = EtcdCluster::connect(std::slice::from_ref(&a.etcd), &a.etcd_prefix)
        .await
        .with_context(|| format!("cannot reach etcd at {}", a.etcd))?;
    for _ in 0..ATTEMPTS_MAX {
        // Checked on every attempt, so a move recorded since the last one is seen.
        if let Some(m) = etcd.read_move().await? {
            bail!(
                "a move of partition(s) {:?} (node {} → {}) is recorded: finish it \
                 (`camelot cluster move`) or undo it (`camelot cluster move --rollback`) first",
                m.record.partitions,
                m.record.from,
                m.record.to
            );
        }
        let current = etcd
            .read_map()
            .await?
            .with_context(|| format!("no cluster map under {} in etcd", a.etcd_prefix))?;
        let alive = Alive::new(etcd.live_nodes().await?);
        let decided = accept_loss(&current.map, &alive, a.node)?;
        decided
            .map
            .validate()
            .context("the map after giving those partitions up would not be valid")?;
        let takers: std::collections::BTreeSet<NodeId> =
            decided.new_primaries.iter().map(|&(_, n)| n).collect();
        println!(
            "node {} leads {} partition(s) with no copy left: {:?}",
            a.node,
            decided.lost.len(),
            decided.lost
        );
        if !a.confirm {
            println!(
                "they would serve again, empty, from node(s) {takers:?}; nothing was changed \
                 (add --confirm to give their data up)"
            );
            return Ok(());
        }
        if let Publish::Won(_) = etcd.publish(&decided.map, Some(&current)).await? {
            println!(
                "given up at epoch {}: node(s) {takers:?} serve them, empty",
                decided.map.epoch
            );
            return Ok(());
        }
    }
    bail!("the map kept changing under {ATTEMPTS_MAX} attempts; try again")
}

#[cfg(not(feature = "etcd"))]
fn controller(_rt: tokio::runtime::Runtime, _a: ControllerArgs) -> Result<()> {
    bail!("cluster controller: {NO_ETCD}")
}

/// Runs the controller on a thread of its own (it blocks) until a signal.
#[cfg(feature = "etcd")]
fn controller(rt: tokio::runtime::Runtime, a: ControllerArgs) -> Result<()> {
    use camelot_cluster::controller::{Controller, ControllerConfig};
    use camelot_cluster::failover::Promote;
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut signals = rt.block_on(async { Signals::install() })?;
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| format!("controller-{}", std::process::id()));
    let mut cfg = ControllerConfig::new(name);
    cfg.lease_ttl = Duration::from_secs(a.lease_ttl);
    cfg.tick = Duration::from_millis(a.tick_ms);
    cfg.hold_at = a.hold_at.clone();
    if let Some(ms) = a.hold_ms {
        cfg.hold_for = Duration::from_millis(ms);
    }
    if a.unsafe_promote_stale {
        cfg.promote = Promote::UnsafeStalest;
    }
    if a.auto_rebalance {
        cfg.auto_rebalance = Some(camelot_cluster::auto::AutoConfig::default());
    }
    cfg.unsafe_no_final_copy = a.unsafe_no_final_copy;
    let start = std::time::Instant::now();
    let progress = Arc::new(move |line: &str| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "[{:8.3} s] {line}", start.elapsed().as_secs_f64());
        let _ = out.flush();
    });
    let mut c = Controller::connect(std::slice::from_ref(&a.etcd), &a.etcd_prefix, cfg, progress)
        .with_context(|| format!("cannot reach etcd at {}", a.etcd))?;
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("camelot-controller".into())
            .spawn(move || c.run(&stop))
            .context("cannot start the controller thread")?
    };
    rt.block_on(async {
        tokio::select! {
            _ = signals.wait() => {}
            // The controller ends by itself only on an error.
            _ = async {
                while !worker.is_finished() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            } => {}
        }
    });
    stop.store(true, Ordering::Relaxed);
    match worker.join() {
        Ok(r) => r.context("the controller failed"),
        Err(_) => bail!("the controller thread panicked"),
    }
}

#[cfg(not(feature = "etcd"))]
fn move_partitions(_a: MoveArgs) -> Result<()> {
    bail!("cluster move: {NO_ETCD}")
}

#[cfg(not(feature = "etcd"))]
fn rebalance(_a: RebalanceArgs) -> Result<()> {
    bail!("cluster rebalance: {NO_ETCD}")
}

#[cfg(feature = "etcd")]
fn mover(a: &MoverArgs) -> Result<camelot_cluster::mover::Mover> {
    use std::io::Write;
    let start = std::time::Instant::now();
    let progress = Box::new(move |line: &str| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "[{:8.3} s] {line}", start.elapsed().as_secs_f64());
        let _ = out.flush();
    });
    let mut m = camelot_cluster::mover::Mover::connect(
        std::slice::from_ref(&a.etcd),
        &a.etcd_prefix,
        progress,
    )
    .with_context(|| format!("cannot reach etcd at {}", a.etcd))?;
    m.hold_at = a.hold_at.clone();
    if let Some(ms) = a.hold_ms {
        m.hold_for = Duration::from_millis(ms);
    }
    m.defects.no_final_copy = a.unsafe_no_final_copy;
    m.defects.no_fill = a.unsafe_no_fill;
    Ok(m)
}

#[cfg(feature = "etcd")]
fn print_report(r: &camelot_cluster::mover::MoveReport) {
    let mb_s = if r.copy_secs > 0.0 {
        r.bytes_copied as f64 / r.copy_secs / 1e6
    } else {
        0.0
    };
    println!(
        "{} {} partition(s) node {} → {}: {} key(s) / {} value bytes copied ({} scanned) in {:.3} s ({mb_s:.1} MB/s), fence {}, {} key(s) cleaned up",
        if r.switched { "moved" } else { "rolled back" },
        r.partitions,
        r.from,
        r.to,
        r.keys_copied,
        r.bytes_copied,
        r.bytes_scanned,
        r.copy_secs,
        r.fence_ms.map_or("none".to_string(), |f| format!("{f:.1} ms")),
        r.keys_deleted
    );
}

#[cfg(feature = "etcd")]
fn move_partitions(a: MoveArgs) -> Result<()> {
    let mut m = mover(&a.mover)?;
    if a.rollback {
        match m.resume(true)? {
            Some(r) => print_report(&r),
            None => println!("no move in progress"),
        }
        return Ok(());
    }
    let Some(to) = a.to else {
        bail!("--to NODE is required");
    };
    let report = m.run_from(&a.partitions, a.from, to)?;
    print_report(&report);
    Ok(())
}

#[cfg(feature = "etcd")]
fn rebalance(a: RebalanceArgs) -> Result<()> {
    let mut m = mover(&a.mover)?;
    let mut report = camelot_cluster::mover::RebalanceReport::default();
    if let Some(r) = m.resume(false)? {
        print_report(&r);
        report.moves.push(r);
    }
    let live = m.live_nodes()?;
    let map = m.read_map()?.map;
    let missing: Vec<Node> = live
        .iter()
        .filter(|n| map.node(n.id).is_none())
        .cloned()
        .collect();
    if !missing.is_empty() {
        let joined = m.update_map(|current| {
            let mut next = current
                .cloned()
                .ok_or_else(|| camelot_cluster::etcd::EtcdError::BadMove("no map".into()))?;
            for n in &missing {
                if next.node(n.id).is_none() {
                    next.nodes.push(n.clone());
                }
            }
            Ok(next)
        })?;
        println!(
            "epoch {}: node(s) {:?} joined the map",
            joined.map.epoch,
            missing.iter().map(|n| n.id).collect::<Vec<_>>()
        );
    }
    let map = m.read_map()?.map;
    let plan = camelot_cluster::plan(&map)?;
    // One move per (from, to) pair: each move scans its source once per pass, whatever
    // share of the source's keys it takes.
    let groups = camelot_cluster::auto::move_groups(&map, &plan);
    let total: usize = groups.values().map(Vec::len).sum();
    println!(
        "plan: {total} partition(s) to move in {} move(s)",
        groups.len()
    );
    let mut done = 0;
    for ((from, to), parts) in groups {
        for chunk in parts.chunks(camelot_cluster::moves::MOVE_PARTITIONS_MAX) {
            let r = m.run_from(chunk, Some(from), to)?;
            done += chunk.len();
            print_report(&r);
            println!("progress: {done}/{total} partition(s) moved ({from} → {to})");
            report.moves.push(r);
        }
    }
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

#[cfg(not(feature = "etcd"))]
async fn up(_a: UpArgs) -> Result<()> {
    bail!("cluster up: {NO_ETCD}")
}

/// How long `cluster up` waits for its servers to register.
#[cfg(feature = "etcd")]
const UP_REGISTER_WAIT_MAX: Duration = Duration::from_secs(30);
/// How long a stopping controller may take to resign before it is killed.
#[cfg(feature = "etcd")]
const CONTROLLER_STOP_WAIT_MAX: Duration = Duration::from_secs(10);

/// A child process `cluster up` started (a controller); SIGTERM and a bounded wait when
/// dropped, then SIGKILL.
#[cfg(feature = "etcd")]
struct UpChild(std::process::Child);

#[cfg(feature = "etcd")]
impl Drop for UpChild {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + CONTROLLER_STOP_WAIT_MAX;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(feature = "etcd")]
async fn up(a: UpArgs) -> Result<()> {
    use camelot_testkit::{CamelotServer, CamelotServerOptions};
    if a.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    if a.slow_nodes > a.nodes {
        bail!(
            "--slow-nodes {} is more than --nodes {}",
            a.slow_nodes,
            a.nodes
        );
    }
    if a.replication == 0 || a.replication > a.nodes {
        bail!(
            "--replication {} needs 1..={} (--nodes)",
            a.replication,
            a.nodes
        );
    }
    let slow_from = a.nodes - a.slow_nodes;
    let mut signals = Signals::install()?;
    // Every child is started from this, the main, thread and dies with this process:
    // stopped by a signal it stops them in order; SIGKILLed, the kernel kills them.
    camelot_testkit::lifeline::children_die_with_this_process();
    // Started here, stopped (killed, its temporary directory removed) when this returns.
    let (own_etcd, endpoint) = match &a.etcd {
        Some(url) => (None, url.clone()),
        None => {
            let etcd = camelot_testkit::EtcdServer::start()
                .context("cannot start etcd (is Debian's etcd-server installed?)")?;
            let url = etcd.endpoint();
            (Some(etcd), url)
        }
    };
    let etcd = EtcdCluster::connect(std::slice::from_ref(&endpoint), &a.etcd_prefix)
        .await
        .with_context(|| format!("cannot reach etcd at {endpoint}"))?;
    let binary = std::env::current_exe().context("cannot tell where this program is")?;
    // Each server its own process, so that a kill is a real node failure.
    let mut servers: Vec<CamelotServer> = Vec::new();
    for id in 0..a.nodes {
        let mut args: Vec<String> = vec![
            "--memory".into(),
            a.memory.to_string(),
            "--etcd".into(),
            endpoint.clone(),
            "--etcd-prefix".into(),
            a.etcd_prefix.clone(),
            "--node-id".into(),
            id.to_string(),
            "--lease-ttl".into(),
            a.lease_ttl.to_string(),
        ];
        if id >= slow_from {
            args.push("--ops-per-sec-max".into());
            args.push(a.slow_ops_per_sec.to_string());
        }
        let options = CamelotServerOptions { resp: false, args };
        // Here, not on a blocking-pool thread: see `children_die_with_this_process`.
        let server = CamelotServer::start(&binary, &options)
            .with_context(|| format!("cannot start server {id}"))?;
        servers.push(server);
    }
    let deadline = std::time::Instant::now() + UP_REGISTER_WAIT_MAX;
    let live = loop {
        let live = etcd.live_nodes().await?;
        if live.len() >= a.nodes as usize {
            break live;
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "{} of {} servers registered within {UP_REGISTER_WAIT_MAX:?}",
                live.len(),
                a.nodes
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (partitions, replication) = (a.partitions, a.replication);
    let published = etcd
        .update_map(10, move |current| {
            // A map already there (a cluster restarted on the same etcd) is re-planned
            // over the new servers, keeping its partition count.
            let p = current.map_or(partitions, |m| m.partitions());
            Ok(ClusterMap::initial(live.clone(), p, replication)?)
        })
        .await
        .context("cannot write the cluster map")?;
    let etcd_pid = own_etcd
        .as_ref()
        .map(|e| format!(", pid {}", e.process().pid()))
        .unwrap_or_default();
    println!(
        "camelot cluster up: etcd {endpoint} (prefix {}{etcd_pid})",
        a.etcd_prefix
    );
    for (id, s) in servers.iter().enumerate() {
        let class = if id as u32 >= slow_from {
            format!("slow, {} ops/s", a.slow_ops_per_sec)
        } else {
            "fast".to_string()
        };
        println!(
            "  node {id}: {} pid {} ({} memory, {class}; log in {})",
            s.addr(),
            s.process().pid(),
            format_bytes(a.memory),
            s.process().dir().display()
        );
    }
    if a.slow_nodes > 0 {
        println!("slow nodes by: {}", slow_mechanism());
    }
    println!(
        "map epoch {}: {} partitions, replication {}",
        published.map.epoch,
        published.map.partitions(),
        published.map.replication
    );
    let mut controllers = Vec::new();
    for i in 0..a.controllers {
        let mut cmd = std::process::Command::new(&binary);
        cmd.args(["cluster", "controller", "--etcd", &endpoint])
            .args(["--etcd-prefix", &a.etcd_prefix])
            .args(["--name", &format!("controller-{i}")])
            .args(["--lease-ttl", &a.lease_ttl.to_string()])
            .stdin(std::process::Stdio::null());
        if a.auto_rebalance {
            cmd.arg("--auto-rebalance");
        }
        camelot_testkit::lifeline::tie_to_this_thread(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start controller {i}"))?;
        println!("  controller {i}: pid {}", child.id());
        controllers.push(UpChild(child));
    }
    println!("Ctrl-C to stop.");
    signals.wait().await;
    println!("stopping…");
    // Controllers first (they resign), then the servers, then etcd.
    tokio::task::spawn_blocking(move || drop(controllers))
        .await
        .context("stopping the controllers")?;
    drop(servers);
    drop(own_etcd);
    Ok(())
}

/// The map and the live nodes (none for a static file).
async fn load(a: &SourceArgs) -> Result<(ClusterMap, Option<Vec<Node>>)> {
    if let Some(path) = &a.map {
        return Ok((camelot_cluster::source::load(path)?, None));
    }
    let Some(endpoint) = &a.etcd else {
        bail!("give --etcd URL or --map FILE");
    };
    load_etcd(endpoint, &a.etcd_prefix).await
}

#[cfg(not(feature = "etcd"))]
async fn load_etcd(endpoint: &str, _prefix: &str) -> Result<(ClusterMap, Option<Vec<Node>>)> {
    bail!("--etcd {endpoint}: {NO_ETCD}")
}

#[cfg(feature = "etcd")]
async fn load_etcd(endpoint: &str, prefix: &str) -> Result<(ClusterMap, Option<Vec<Node>>)> {
    let etcd = EtcdCluster::connect(&[endpoint.to_owned()], prefix)
        .await
        .with_context(|| format!("cannot reach etcd at {endpoint}"))?;
    let map = etcd
        .read_map()
        .await?
        .with_context(|| format!("no cluster map under {prefix} in etcd"))?
        .map;
    Ok((map, Some(etcd.live_nodes().await?)))
}

async fn status(a: SourceArgs) -> Result<()> {
    let (map, live) = load(&a).await?;
    println!(
        "epoch {}: {} partitions, replication {}, {} node(s)",
        map.epoch,
        map.partitions(),
        map.replication,
        map.nodes.len()
    );
    let slots = map.slots_per_node();
    for n in &map.nodes {
        let primaries = map.primaries_of(n.id).iter().filter(|p| **p).count();
        let state = match &live {
            None => "static",
            Some(l) if l.iter().any(|x| x.id == n.id && x.addr == n.addr) => "live",
            Some(_) => "NO LEASE",
        };
        println!(
            "  node {} {} weight {}: {} primaries, {} replicas, {state}",
            n.id,
            n.addr,
            n.weight,
            primaries,
            slots.get(&n.id).copied().unwrap_or(0)
        );
    }
    for n in live.iter().flatten() {
        if map.node(n.id).is_none() {
            println!("  node {} {}: live, not in the map", n.id, n.addr);
        }
    }
    if !map.fenced.is_empty() {
        println!("fenced (no node serves them): {:?}", map.fenced);
    }
    if let Some(endpoint) = &a.etcd {
        print_move(endpoint, &a.etcd_prefix).await?;
    }
    Ok(())
}

#[cfg(not(feature = "etcd"))]
async fn print_move(_endpoint: &str, _prefix: &str) -> Result<()> {
    Ok(())
}

#[cfg(feature = "etcd")]
async fn print_move(endpoint: &str, prefix: &str) -> Result<()> {
    let etcd = EtcdCluster::connect(&[endpoint.to_owned()], prefix).await?;
    match etcd.read_move().await? {
        None => println!("moves in progress: none"),
        Some(v) => println!(
            "move in progress: {} partition(s) {:?} node {} → {}, phase {}",
            v.record.partitions.len(),
            v.record.partitions,
            v.record.from,
            v.record.to,
            v.record.phase.name()
        ),
    }
    Ok(())
}

async fn plan(a: SourceArgs) -> Result<()> {
    let (map, live) = load(&a).await?;
    let mut target = map.clone();
    if let Some(live) = live {
        target.nodes = live;
    }
    let plan = camelot_cluster::plan(&target)?;
    let planned = ClusterMap {
        assignment: plan.target.clone(),
        ..target.clone()
    };
    println!(
        "epoch {} → plan: {} replica move(s) of {} slots",
        map.epoch,
        plan.moves.len(),
        u64::from(map.partitions()) * u64::from(map.replication)
    );
    let before = map.slots_per_node();
    let after = planned.slots_per_node();
    let leads = |m: &ClusterMap, id: NodeId| m.primaries_of(id).iter().filter(|p| **p).count();
    for (id, count) in &after {
        println!(
            "  node {id}: {} → {count} replicas, leading {} → {}",
            before.get(id).copied().unwrap_or(0),
            leads(&map, *id),
            leads(&planned, *id)
        );
    }
    for (id, count) in &before {
        if !after.contains_key(id) {
            println!(
                "  node {id}: {count} → 0 replicas, leading {} → 0 (gone)",
                leads(&map, *id)
            );
        }
    }
    Ok(())
}

/// `camelot bench cluster …`.
#[derive(Subcommand)]
pub enum ClusterBenchCommand {
    /// One `camelot server`'s GET and PUT throughput against value size (1 KiB..1 MiB)
    /// through the client's KV API, an iperf3 loopback stream beside (seed 004).
    Throughput(ThroughputArgs),
    /// PUT latency with every write copied to a backup first (R=2) against none (R=1),
    /// same run, rounds alternating; servers in this process (labelled).
    Replication(ReplicationArgs),
    #[command(flatten)]
    OnEtcd(crate::cluster_bench::EtcdBenchCommand),
    /// kill -9 a primary under a YCSB-A-like load with R=2 (etcd, servers and two
    /// controllers as processes): each partition's unavailability window against the
    /// target 2 × lease TTL + 100 ms, throughput through the kill, and every key read back
    /// for acknowledged writes lost.
    Failover(FailoverArgs),
}

#[derive(Args)]
pub struct FailoverArgs {
    /// Scaled down to finish in seconds (64 partitions, 4,000 keys, 4 threads).
    #[arg(long)]
    quick: bool,
    /// Client threads (one request in flight each).
    #[arg(long)]
    threads: Option<usize>,
    /// Keys loaded (each thread the only writer of its share).
    #[arg(long)]
    keys: Option<u64>,
    /// Partitions of the map.
    #[arg(long)]
    partitions: Option<u32>,
    /// Lease TTL of registrations and controllers, in seconds.
    #[arg(long)]
    lease_ttl: Option<u64>,
    /// Directory for cluster-failover.json.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
pub struct ReplicationArgs {
    /// Scaled down to finish in seconds (1 and 8 threads, 0.5 s a point, 3 rounds).
    #[arg(long)]
    quick: bool,
    /// Client thread counts, comma-separated (each one request in flight).
    #[arg(long, value_delimiter = ',')]
    threads: Option<Vec<usize>>,
    /// Directory for cluster-replication.json.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
pub struct ThroughputArgs {
    /// Scaled down to finish in seconds (1 KiB, 64 KiB, 1 MiB; 0.3 s a point).
    #[arg(long)]
    quick: bool,
    /// Client threads, one request in flight each.
    #[arg(long)]
    threads: Option<usize>,
    /// Run the server inside this process (labelled) instead of as a `camelot server`.
    #[arg(long)]
    in_process: bool,
    /// Directory for cluster-throughput.json.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

pub fn bench(cmd: ClusterBenchCommand) -> Result<()> {
    use camelot_bench::cluster::ThroughputConfig;
    use camelot_bench::QuickConfig;
    match cmd {
        ClusterBenchCommand::Failover(a) => bench_failover(a)?,
        ClusterBenchCommand::Throughput(a) => {
            let mut cfg = ThroughputConfig {
                in_process: a.in_process,
                ..ThroughputConfig::defaults(a.quick)
            };
            if let Some(t) = a.threads {
                cfg.threads = t;
            }
            let path = camelot_bench::cluster::run_throughput(&cfg, &a.out)?;
            println!("wrote {}", path.display());
        }
        ClusterBenchCommand::Replication(a) => {
            let mut cfg = camelot_bench::cluster::ReplicationConfig::default();
            if a.quick {
                cfg.apply_quick();
            }
            if let Some(t) = a.threads {
                cfg.threads = t;
            }
            let path = camelot_bench::cluster::run_replication(&cfg, &a.out)?;
            println!("wrote {}", path.display());
        }
        ClusterBenchCommand::OnEtcd(c) => crate::cluster_bench::run(c)?,
    }
    Ok(())
}

#[cfg(not(feature = "etcd"))]
fn bench_failover(_a: FailoverArgs) -> Result<()> {
    bail!("bench cluster failover: {NO_ETCD}")
}

#[cfg(feature = "etcd")]
fn bench_failover(a: FailoverArgs) -> Result<()> {
    use camelot_bench::cluster_failover::{run_failover, FailoverConfig};
    use camelot_bench::QuickConfig;
    let mut cfg = FailoverConfig::defaults(a.quick);
    if let Some(t) = a.threads {
        cfg.threads = t;
    }
    if let Some(k) = a.keys {
        cfg.keys = k;
    }
    if let Some(p) = a.partitions {
        cfg.partitions = p;
    }
    if let Some(t) = a.lease_ttl {
        cfg.lease_ttl_secs = t;
    }
    for path in run_failover(&cfg, &a.out)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::ownership_of;
    use camelot_cluster::map::Node;
    use camelot_cluster::ClusterMap;
    use camelot_server::ownership::Role;

    fn node(id: u32, incarnation: u64) -> Node {
        Node {
            id,
            addr: format!("127.0.0.1:{}", 7000 + id).parse().unwrap(),
            weight: 1,
            lease: 0,
            incarnation,
        }
    }

    fn roles(own: &camelot_server::ownership::Ownership, partitions: u32) -> Vec<Role> {
        (0..partitions).map(|p| own.role(p)).collect()
    }

    /// A process restarted under an id the map records with another incarnation holds
    /// none of that node's data: it is neither primary nor backup of anything until the
    /// map records it; the recorded process, and an entry with none recorded, serve.
    #[test]
    fn a_restarted_incarnation_serves_nothing_of_the_map_s_node() {
        let map = ClusterMap::initial(vec![node(0, 11), node(1, 22)], 8, 2).unwrap();
        let as_recorded = ownership_of(&map, 0, 11).unwrap();
        assert!(as_recorded.owned_count() > 0);
        assert!(roles(&as_recorded, 8).contains(&Role::Backup));

        let restarted = ownership_of(&map, 0, 12).unwrap();
        assert_eq!(restarted.owned_count(), 0);
        assert!(roles(&restarted, 8).iter().all(|r| *r == Role::None));
        assert_eq!(restarted.epoch(), map.epoch);

        let unrecorded = ClusterMap::initial(vec![node(0, 0), node(1, 0)], 8, 2).unwrap();
        assert_eq!(
            ownership_of(&unrecorded, 0, 12).unwrap().owned_count(),
            as_recorded.owned_count()
        );
    }
}
