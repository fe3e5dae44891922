//! A volume over real servers: the pure modules put behind the client's request API.
//!
//! Each member holds one region named `camelot-vol.NAME.I`: the superblock, then the
//! 8-byte intent words, then the stripe chunks. One call's chunk I/O is grouped
//! by member and sent with `submit_many` to every member before any answer is awaited, so
//! it leaves as one batch per server, in parallel across servers.
//!
//! A member whose request fails with a connection error, a timeout or "no such region" (a
//! restarted, empty server) is marked missing — in memory and in the superblock of the
//! survivors — and the call is retried degraded: reads reconstruct from the survivors,
//! writes rewrite parity so the lost chunk stays recoverable. A degraded write whose
//! pieces all fall on present members costs what a healthy one does (full-stripe encode,
//! or SWAP + XOR_INTO) with the absent members left out; only a piece on an absent member
//! reads the stripe back to rebuild it.
//!
//! The write hole is closed the way md's write-intent bitmap closes it: stripes are grouped
//! in zones of `INTENT_ZONE_STRIPES`, each with an intent word on every member. Before the
//! first write into a zone, the word is set on every present member and acknowledged (it
//! rides with a degraded write's reads; before a partial write's SWAPs, which change data,
//! it is a round trip of its own, once per zone).
//!
//! A partial write on a parity level is SWAP (write the new bytes, get the old) on each
//! touched data member, then XOR_INTO enc(old ^ new) on each parity member: two requests
//! for a one-chunk write instead of four, and no parity is read. Deltas commute, so parity
//! ends as the code of the data whatever order writers' SWAPs and XORs land in. A SWAP that
//! landed always has its delta sent, even when another request of the call failed, so a
//! degraded retry rebuilds lost slots from parity that matches the data.
//! The mark then stays while the zone is written to, and is cleared lazily — only while
//! every stripe lock of the zone is held, so no write into it is in flight — when more
//! than `MARKED_ZONES_MAX` zones are marked, when a zone has been idle for
//! `MARK_IDLE`, or when the volume is dropped. `open` resyncs every stripe of every marked
//! zone (parity recomputed from data: an unacknowledged write may land either way, but
//! parity never silently disagrees).

use crate::layout::{Code, Layout, Level};
use crate::parity::{xor_into, Codec, RS_ALIGN};
use crate::plan::{self, StripeSpan};
use crate::superblock::{
    check_name, Member, MemberState, RebuildProgress, Superblock, PROGRESS_OFFSET, SUPERBLOCK_BYTES,
};
use crate::BlocksError;
use bytes::Bytes;
use camelot_client::{reply, Client, ClientConfig, ClientError, ClusterMap, NodeId, NodeInfo};
use camelot_proto::{ErrorCode, Op, Reply};
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Stripe locks, hashed by stripe: callers touching one stripe serialise (a partial write
/// is read-then-write), callers on different stripes rarely meet.
const STRIPE_LOCKS: usize = 4096;
/// Largest single READ the volume sends for metadata (the intent words).
const META_READ_BYTES_MAX: u64 = 4 << 20;
/// Stripes a scrub or resync round handles in one batch.
const STRIPES_PER_ROUND: u64 = 16;
/// Stripes a rebuild round handles in one batch. A round holds its stripes' locks across
/// its two round trips (read the survivors, write the member), so callers writing there
/// wait for all of it; a smaller round keeps that wait short under load.
pub const REBUILD_STRIPES_PER_ROUND: u64 = 4;
/// Bytes `check_members` reads from each member (the start of its superblock).
const PROBE_BYTES: u32 = 8;
/// Intent word byte size.
const INTENT_BYTES: u64 = 8;
/// Stripes one intent word covers: a crash costs a resync of this many stripes per zone
/// it left marked, and a write pays for a mark only on its zone's first write.
pub const INTENT_ZONE_STRIPES: u64 = 64;
/// Most zones kept marked at once; past it the least recently written are cleared.
const MARKED_ZONES_MAX: usize = 256;
/// A zone not written to for this long is cleared at the next write or drop.
const MARK_IDLE: Duration = Duration::from_secs(1);
/// A rebuild writes its progress record (one small WRITE to each present member) at most
/// this often, and once at its start: what another process's `status` sees is at most
/// this old while the rebuild runs.
pub const REBUILD_PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// How to reach the members.
#[derive(Debug, Clone)]
pub struct VolumeConfig {
    /// Token and timeouts. The request timeout bounds how long an unreachable member can
    /// stall a call before the volume goes degraded.
    pub client: ClientConfig,
    /// Mark stripes with intent words around writes (the write-hole fix). Off only to
    /// show, in tests, that the write-hole checker catches what it is there to catch.
    pub write_intent: bool,
}

impl Default for VolumeConfig {
    fn default() -> Self {
        VolumeConfig {
            client: ClientConfig {
                connect_timeout: Duration::from_secs(1),
                request_timeout: Duration::from_secs(2),
                connections_per_node: 2,
                ..ClientConfig::default()
            },
            write_intent: true,
        }
    }
}

/// What `status` reports.
#[derive(Debug, Clone)]
pub struct VolumeStatus {
    pub name: String,
    pub layout: Layout,
    pub generation: u64,
    pub members: Vec<Member>,
    /// Members whose data is not trusted (lost, or replaced and not yet rebuilt).
    pub missing: Vec<usize>,
    /// (member, stripes rebuilt, stripes in all) while a rebuild runs.
    pub rebuild: Option<(usize, u64, u64)>,
    /// When the rebuild runs in another process (seen by [`Volume::inspect`] in its
    /// progress record): how long ago that process last wrote its progress.
    pub rebuild_reported_ago: Option<Duration>,
    /// Members [`Volume::inspect`] could not reach just now (their superblock may still
    /// call them active: nobody has written to the volume since they went).
    pub unreachable: Vec<usize>,
}

impl VolumeStatus {
    pub fn degraded(&self) -> bool {
        !self.missing.is_empty()
    }
}

/// What a scrub or an intent resync found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrubReport {
    pub stripes_checked: u64,
    /// Stripes whose parity disagreed with their data.
    pub mismatches: u64,
    /// Of those, rewritten from data.
    pub repaired: u64,
    /// Stripes that could not be checked (too many members missing).
    pub skipped: u64,
}

#[derive(Debug, Clone)]
struct State {
    generation: u64,
    members: Vec<Member>,
    /// A member being rebuilt and the first stripe not yet rebuilt on it.
    rebuild: Option<(usize, u64)>,
}

impl State {
    fn present(&self, member: usize, stripe: u64) -> bool {
        match self.rebuild {
            Some((m, cursor)) if m == member => stripe < cursor,
            _ => self.members[member].state == MemberState::Active,
        }
    }
}

/// A stripe range read for reconstruction: (from, to) in the chunk and the slots read.
type Rebuilt = (u64, u64, Vec<Option<Vec<u8>>>);

/// Why one attempt of a call stopped.
enum Stop {
    /// These members failed: mark them missing and try again.
    Lost(Vec<usize>),
    Fatal(BlocksError),
}

impl From<BlocksError> for Stop {
    fn from(e: BlocksError) -> Stop {
        Stop::Fatal(e)
    }
}

/// What went wrong across the answers of one or more exchanges of an attempt.
#[derive(Default)]
struct Outcome {
    lost: Vec<usize>,
    fatal: Option<BlocksError>,
}

impl Outcome {
    /// The replies that came back (`None` where a request failed), noting the failures.
    fn sort(&mut self, answers: Vec<(usize, Result<Reply, ClientError>)>) -> Vec<Option<Reply>> {
        answers
            .into_iter()
            .map(|(m, r)| match r {
                Ok(reply) => Some(reply),
                Err(e) if is_member_failure(&e) => {
                    if !self.lost.contains(&m) {
                        self.lost.push(m);
                    }
                    None
                }
                Err(e) => {
                    self.fail(BlocksError::Member {
                        member: m,
                        source: e,
                    });
                    None
                }
            })
            .collect()
    }

    fn fail(&mut self, e: BlocksError) {
        self.fatal.get_or_insert(e);
    }

    fn ok(&self) -> bool {
        self.lost.is_empty() && self.fatal.is_none()
    }

    /// Lost members first: marking them missing and retrying may still succeed.
    fn into_result(self) -> Result<(), Stop> {
        if !self.lost.is_empty() {
            return Err(Stop::Lost(self.lost));
        }
        match self.fatal {
            Some(e) => Err(Stop::Fatal(e)),
            None => Ok(()),
        }
    }
}

fn is_member_failure(e: &ClientError) -> bool {
    match e {
        ClientError::Connect { .. }
        | ClientError::Io { .. }
        | ClientError::Timeout { .. }
        | ClientError::ConnectionLost { .. }
        | ClientError::Handshake { .. }
        | ClientError::Protocol { .. } => true,
        ClientError::Server(r) | ClientError::Fatal { reply: r, .. } => {
            matches!(r.code, ErrorCode::NoSuchRegion | ErrorCode::ShuttingDown)
        }
        _ => false,
    }
}

pub fn region_name(volume: &str, member: usize) -> String {
    format!("camelot-vol.{volume}.{member}")
}

/// Where the stripe chunks start in a member region.
fn data_base(layout: &Layout) -> u64 {
    (SUPERBLOCK_BYTES + layout.stripes * INTENT_BYTES).div_ceil(4096) * 4096
}

fn member_region_bytes(layout: &Layout) -> u64 {
    data_base(layout) + layout.member_data_bytes()
}

/// A block volume. Cheap to share across threads (`Arc<Volume>`); every method takes
/// `&self`.
pub struct Volume {
    client: Client,
    /// How `client` was configured: a rebuild connects a client of its own with it.
    client_config: ClientConfig,
    name: String,
    layout: Layout,
    codec: Codec,
    data_base: u64,
    write_intent: bool,
    state: RwLock<State>,
    locks: Vec<RwLock<()>>,
    /// Serialises superblock writes so generations go out in order.
    sb_lock: Mutex<()>,
    rebuild_running: AtomicBool,
    rebuild_done: AtomicU64,
    /// Zones whose intent word is set (and acknowledged) on every present member, with
    /// when they were last written.
    marked: Mutex<HashMap<u64, Instant>>,
}

fn map_of(members: &[Member]) -> ClusterMap {
    ClusterMap {
        epoch: 0,
        nodes: members
            .iter()
            .enumerate()
            .map(|(i, m)| NodeInfo {
                id: i as NodeId,
                addr: m.addr,
            })
            .collect(),
    }
}

/// A client that connects lazily, so an unreachable member does not stop `open`.
fn lazy_client(members: &[Member], config: &ClientConfig) -> Result<Client, BlocksError> {
    let client = Client::connect(
        ClusterMap {
            epoch: 0,
            nodes: vec![],
        },
        config.clone(),
    )?;
    client.set_map(map_of(members));
    Ok(client)
}

impl Volume {
    /// Allocates a member region on each server and writes the superblock on all of them.
    pub fn create(
        name: &str,
        level: Level,
        servers: &[SocketAddr],
        chunk_bytes: u64,
        size_bytes: u64,
        config: &VolumeConfig,
    ) -> Result<Volume, BlocksError> {
        check_name(name)?;
        let layout = Layout::new(level, servers.len(), chunk_bytes, size_bytes)?;
        for (i, a) in servers.iter().enumerate() {
            if servers[..i].contains(a) {
                return Err(BlocksError::InvalidArgument(format!(
                    "server {a} is listed twice: its members would fail together"
                )));
            }
        }
        if member_region_bytes(&layout) > camelot_proto::limits::REGION_BYTES_MAX {
            return Err(BlocksError::InvalidArgument(
                "a member region would exceed the server's region limit".into(),
            ));
        }
        let placeholder: Vec<Member> = servers
            .iter()
            .map(|&addr| Member {
                addr,
                region: 0,
                state: MemberState::Active,
            })
            .collect();
        let client = lazy_client(&placeholder, &config.client)?;
        let mut members = Vec::with_capacity(servers.len());
        for (i, &addr) in servers.iter().enumerate() {
            let region = client.alloc_on(
                i as NodeId,
                member_region_bytes(&layout),
                Some(&region_name(name, i)),
            );
            match region {
                Ok(r) => members.push(Member {
                    addr,
                    region: r.id,
                    state: MemberState::Active,
                }),
                Err(e) => {
                    for (j, m) in members.iter().enumerate() {
                        let _ = client.call(j as NodeId, Op::Free { region: m.region });
                    }
                    return Err(BlocksError::Member {
                        member: i,
                        source: e,
                    });
                }
            }
        }
        let volume = Volume::from_superblock(
            client,
            Superblock {
                name: name.to_string(),
                layout,
                generation: 1,
                members,
            },
            config,
        );
        volume.write_superblock(true)?;
        Ok(volume)
    }

    fn from_superblock(client: Client, sb: Superblock, config: &VolumeConfig) -> Volume {
        let layout = sb.layout;
        Volume {
            client,
            client_config: config.client.clone(),
            name: sb.name,
            codec: Codec {
                code: layout.code(),
                k: layout.data_slots(),
                m: layout.parity_slots(),
            },
            data_base: data_base(&layout),
            layout,
            write_intent: config.write_intent,
            state: RwLock::new(State {
                generation: sb.generation,
                members: sb.members,
                rebuild: None,
            }),
            locks: (0..STRIPE_LOCKS).map(|_| RwLock::new(())).collect(),
            sb_lock: Mutex::new(()),
            rebuild_running: AtomicBool::new(false),
            rebuild_done: AtomicU64::new(0),
            marked: Mutex::new(HashMap::new()),
        }
    }

    /// Opens a volume knowing one member's address: reads its superblock, then every
    /// other member's, trusts the highest generation, marks unreachable members missing
    /// and resyncs stripes a killed writer left marked.
    pub fn open(
        seed: SocketAddr,
        name: &str,
        config: &VolumeConfig,
    ) -> Result<(Volume, ScrubReport), BlocksError> {
        check_name(name)?;
        let first = read_superblock_at(seed, name, &config.client)?;
        let client = lazy_client(&first.members, &config.client)?;
        let mut best = first;
        let mut unreachable = Vec::new();
        for (i, m) in best.members.clone().iter().enumerate() {
            if m.addr == seed {
                continue;
            }
            match read_member_superblock(&client, i, m.region) {
                Ok(sb) if sb.name == best.name && sb.generation > best.generation => best = sb,
                Ok(_) => {}
                Err(_) => unreachable.push(i),
            }
        }
        client.set_map(map_of(&best.members));
        let volume = Volume::from_superblock(client, best, config);
        let newly_lost: Vec<usize> = unreachable
            .into_iter()
            .filter(|&i| volume.state.read().members[i].state == MemberState::Active)
            .collect();
        if !newly_lost.is_empty() {
            volume.mark_missing(&newly_lost);
        }
        let report = volume.resync_intents()?;
        Ok((volume, report))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.layout.capacity_bytes()
    }

    pub fn status(&self) -> VolumeStatus {
        let st = self.state.read().clone();
        let missing = (0..st.members.len())
            .filter(|&i| st.members[i].state != MemberState::Active)
            .collect();
        VolumeStatus {
            name: self.name.clone(),
            layout: self.layout,
            generation: st.generation,
            members: st.members.clone(),
            missing,
            rebuild: st.rebuild.map(|(m, _)| {
                (
                    m,
                    self.rebuild_done.load(Ordering::Relaxed),
                    self.layout.stripes,
                )
            }),
            rebuild_reported_ago: None,
            unreachable: Vec::new(),
        }
    }

    /// Sends every member the volume counts as present one small read of its region and
    /// marks missing those that fail the way a lost member fails (connection error,
    /// timeout, region gone). Reads and writes notice a lost member only when they touch
    /// it; this touches every member, in one round trip bounded by the request timeout.
    /// Returns the members it marked missing.
    pub fn check_members(&self) -> Vec<usize> {
        let st = self.state.read().clone();
        let ops: Vec<(usize, Op)> = (0..st.members.len())
            .filter(|&m| st.members[m].state == MemberState::Active)
            .map(|m| {
                (
                    m,
                    Op::Read {
                        region: st.members[m].region,
                        offset: 0,
                        len: PROBE_BYTES,
                    },
                )
            })
            .collect();
        let mut outcome = Outcome::default();
        outcome.sort(self.exchange(ops));
        if !outcome.lost.is_empty() {
            self.mark_missing(&outcome.lost);
        }
        outcome.lost
    }

    /// The status of a volume without opening it: reads every reachable member's
    /// superblock (the highest generation wins) and rebuild progress record, and writes
    /// nothing — no resync, no member marked missing — so it is safe to run while another
    /// process serves or rebuilds the volume. Needs one reachable member.
    pub fn inspect(
        seed: SocketAddr,
        name: &str,
        config: &VolumeConfig,
    ) -> Result<VolumeStatus, BlocksError> {
        check_name(name)?;
        let (first, first_progress) = read_superblock_and_progress_at(seed, name, &config.client)?;
        let client = lazy_client(&first.members, &config.client)?;
        let mut best = first;
        let mut progress = vec![first_progress];
        let mut unreachable = Vec::new();
        for (i, m) in best.members.clone().iter().enumerate() {
            if m.addr == seed {
                continue;
            }
            match read_member_block(&client, i, m.region) {
                Ok(bytes) => {
                    if let Ok(sb) = Superblock::decode(&bytes) {
                        if sb.name == best.name && sb.generation > best.generation {
                            best = sb;
                        }
                    }
                    progress.push(progress_of(&bytes));
                }
                Err(_) => unreachable.push(i),
            }
        }
        let now_ms = unix_ms();
        // The freshest record that describes a rebuild the superblock still has under way.
        let current = progress
            .into_iter()
            .flatten()
            .filter(|p| {
                best.members
                    .get(p.member)
                    .is_some_and(|m| m.state == MemberState::Missing && m.region == p.region)
            })
            .max_by_key(|p| p.updated_unix_ms);
        let missing: Vec<usize> = (0..best.members.len())
            .filter(|&i| best.members[i].state != MemberState::Active || unreachable.contains(&i))
            .collect();
        Ok(VolumeStatus {
            name: best.name.clone(),
            layout: best.layout,
            generation: best.generation,
            members: best.members.clone(),
            missing,
            rebuild: current.map(|p| (p.member, p.stripes_done, p.stripes_total)),
            rebuild_reported_ago: current
                .map(|p| Duration::from_millis(now_ms.saturating_sub(p.updated_unix_ms))),
            unreachable,
        })
    }

    /// Writes the rebuild progress record (`None`: clears it) to every present member.
    /// A member that fails is left to the rebuild's next round to notice.
    fn write_progress(&self, progress: Option<RebuildProgress>) {
        let bytes = Bytes::copy_from_slice(&match progress {
            Some(p) => p.encode(),
            None => [0u8; crate::superblock::PROGRESS_BYTES as usize],
        });
        let st = self.state.read().clone();
        let ops = (0..st.members.len())
            .filter(|&m| st.members[m].state == MemberState::Active)
            .map(|m| {
                (
                    m,
                    Op::Write {
                        region: st.members[m].region,
                        offset: PROGRESS_OFFSET,
                        data: bytes.clone(),
                    },
                )
            })
            .collect();
        let _ = self.exchange(ops);
    }

    /// Writes the superblock to every present member. `all` makes any failure an error
    /// (create); otherwise members that fail are ignored (they are being marked lost).
    fn write_superblock(&self, all: bool) -> Result<(), BlocksError> {
        let _order = self.sb_lock.lock();
        let st = self.state.read().clone();
        let bytes = Bytes::from(
            Superblock {
                name: self.name.clone(),
                layout: self.layout,
                generation: st.generation,
                members: st.members.clone(),
            }
            .encode(),
        );
        let ops: Vec<(usize, Op)> = (0..st.members.len())
            .filter(|&i| st.members[i].state == MemberState::Active || all)
            .map(|i| {
                (
                    i,
                    Op::Write {
                        region: st.members[i].region,
                        offset: 0,
                        data: bytes.clone(),
                    },
                )
            })
            .collect();
        for (i, r) in self.exchange(ops).into_iter() {
            if let Err(e) = reply::done(r) {
                if all {
                    return Err(BlocksError::Member {
                        member: i,
                        source: e,
                    });
                }
            }
        }
        Ok(())
    }

    fn mark_missing(&self, lost: &[usize]) {
        {
            let mut st = self.state.write();
            let mut changed = false;
            for &m in lost {
                if st.members[m].state == MemberState::Active {
                    st.members[m].state = MemberState::Missing;
                    changed = true;
                }
                if st.rebuild.is_some_and(|(r, _)| r == m) {
                    st.rebuild = None;
                    changed = true;
                }
            }
            if !changed {
                return;
            }
            st.generation += 1;
            tracing::warn!(volume = %self.name, ?lost, "volume degraded: members lost");
        }
        let _ = self.write_superblock(false);
    }

    /// Sends every op, grouped per member, all before awaiting any; answers in order.
    fn exchange(&self, ops: Vec<(usize, Op)>) -> Vec<(usize, Result<Reply, ClientError>)> {
        self.exchange_on(&self.client, ops)
    }

    /// [`Volume::exchange`] over `client` (the volume's, or a rebuild's own).
    fn exchange_on(
        &self,
        client: &Client,
        ops: Vec<(usize, Op)>,
    ) -> Vec<(usize, Result<Reply, ClientError>)> {
        let mut members: Vec<usize> = ops.iter().map(|(m, _)| *m).collect();
        members.sort_unstable();
        members.dedup();
        let mut slots: Vec<Option<Result<Reply, ClientError>>> = vec![None; ops.len()];
        let mut pendings = Vec::new();
        let mut who = Vec::with_capacity(ops.len());
        let mut grouped: Vec<Vec<(usize, Op)>> = vec![Vec::new(); members.len()];
        for (at, (m, op)) in ops.into_iter().enumerate() {
            who.push(m);
            let g = members.binary_search(&m).unwrap_or(0);
            grouped[g].push((at, op));
        }
        for (g, batch) in grouped.into_iter().enumerate() {
            let node = members[g] as NodeId;
            let (ats, ops): (Vec<usize>, Vec<Op>) = batch.into_iter().unzip();
            match client.submit_many(ops.into_iter().map(|op| (node, op))) {
                Ok(ps) => pendings.push((ats, ps)),
                Err(e) => {
                    for at in ats {
                        slots[at] = Some(Err(e.clone()));
                    }
                }
            }
        }
        for (ats, ps) in pendings {
            for (at, p) in ats.into_iter().zip(ps) {
                slots[at] = Some(p.wait());
            }
        }
        who.into_iter()
            .zip(slots)
            .map(|(m, r)| (m, r.unwrap_or(Err(ClientError::AlreadyTaken))))
            .collect()
    }

    /// Like `exchange`, but member failures stop the attempt and other errors are fatal.
    fn exchange_all(&self, ops: Vec<(usize, Op)>) -> Result<Vec<Reply>, Stop> {
        self.exchange_all_on(&self.client, ops)
    }

    fn exchange_all_on(&self, client: &Client, ops: Vec<(usize, Op)>) -> Result<Vec<Reply>, Stop> {
        let mut outcome = Outcome::default();
        let out = outcome
            .sort(self.exchange_on(client, ops))
            .into_iter()
            .map(|r| r.unwrap_or(Reply::Done))
            .collect();
        outcome.into_result()?;
        Ok(out)
    }

    /// Runs one attempt after another, marking members missing between them, until one
    /// succeeds or an error is not about a lost member.
    fn retrying<T>(&self, mut attempt: impl FnMut() -> Result<T, Stop>) -> Result<T, BlocksError> {
        for _ in 0..=self.layout.members {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(Stop::Fatal(e)) => return Err(e),
                Err(Stop::Lost(lost)) => self.mark_missing(&lost),
            }
        }
        Err(BlocksError::TooManyLost {
            lost: self.status().missing.len(),
            tolerated: self.layout.parity_slots(),
        })
    }

    fn lock_indices(spans: &[StripeSpan]) -> Vec<usize> {
        let mut idx: Vec<usize> = spans
            .iter()
            .map(|s| (s.stripe % STRIPE_LOCKS as u64) as usize)
            .collect();
        idx.sort_unstable();
        idx.dedup();
        idx
    }

    fn read_locks(&self, spans: &[StripeSpan]) -> Vec<RwLockReadGuard<'_, ()>> {
        Self::lock_indices(spans)
            .into_iter()
            .map(|i| self.locks[i].read())
            .collect()
    }

    fn write_locks(&self, spans: &[StripeSpan]) -> Vec<RwLockWriteGuard<'_, ()>> {
        Self::lock_indices(spans)
            .into_iter()
            .map(|i| self.locks[i].write())
            .collect()
    }

    fn chunk_at(&self, stripe: u64, from: u64) -> u64 {
        self.data_base + self.layout.chunk_offset(stripe) + from
    }

    fn read_op(&self, st: &State, member: usize, stripe: u64, from: u64, len: u64) -> Op {
        Op::Read {
            region: st.members[member].region,
            offset: self.chunk_at(stripe, from),
            len: len as u32,
        }
    }

    fn write_op(&self, st: &State, member: usize, stripe: u64, from: u64, data: Bytes) -> Op {
        Op::Write {
            region: st.members[member].region,
            offset: self.chunk_at(stripe, from),
            data,
        }
    }

    fn swap_op(&self, st: &State, member: usize, stripe: u64, from: u64, data: Bytes) -> Op {
        Op::Swap {
            region: st.members[member].region,
            offset: self.chunk_at(stripe, from),
            data,
        }
    }

    fn xor_op(&self, st: &State, member: usize, stripe: u64, from: u64, data: Bytes) -> Op {
        Op::XorInto {
            region: st.members[member].region,
            offset: self.chunk_at(stripe, from),
            data,
        }
    }

    fn mark_op(&self, st: &State, member: usize, zone: u64, value: u64) -> Op {
        Op::Write {
            region: st.members[member].region,
            offset: SUPERBLOCK_BYTES + zone * INTENT_BYTES,
            data: Bytes::copy_from_slice(&value.to_le_bytes()),
        }
    }

    /// Clears the marks of idle zones (all of them when `all`), or of the least recently
    /// written when too many are marked. Called with no stripe lock held.
    fn clear_marks(&self, all: bool) {
        let victims: Vec<u64> = {
            let marked = self.marked.lock();
            let mut by_age: Vec<(Instant, u64)> = marked.iter().map(|(z, t)| (*t, *z)).collect();
            by_age.sort_unstable();
            let excess = marked.len().saturating_sub(MARKED_ZONES_MAX);
            by_age
                .into_iter()
                .enumerate()
                .filter(|(i, (t, _))| all || *i < excess || t.elapsed() >= MARK_IDLE)
                .map(|(_, (_, z))| z)
                .collect()
        };
        for zone in victims {
            let first = zone * INTENT_ZONE_STRIPES;
            let last = (first + INTENT_ZONE_STRIPES).min(self.layout.stripes);
            let spans: Vec<StripeSpan> = (first..last)
                .map(|stripe| StripeSpan {
                    stripe,
                    pieces: vec![],
                })
                .collect();
            // Every stripe of the zone locked: no write into it is in flight.
            let _locks = self.write_locks(&spans);
            if self.marked.lock().remove(&zone).is_none() {
                continue;
            }
            let st = self.state.read().clone();
            let ops = (0..st.members.len())
                .filter(|&m| st.members[m].state == MemberState::Active)
                .map(|m| (m, self.mark_op(&st, m, zone, 0)))
                .collect();
            // A clear that fails leaves a mark: one needless resync at the next open.
            let _ = self.exchange(ops);
        }
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BlocksError> {
        let spans = plan::split(&self.layout, offset, buf.len() as u64)?;
        let _locks = self.read_locks(&spans);
        self.retrying(|| self.try_read(&spans, buf))
    }

    fn try_read(&self, spans: &[StripeSpan], buf: &mut [u8]) -> Result<(), Stop> {
        let st = self.state.read().clone();
        let k = self.layout.data_slots();
        let n = self.layout.members;
        enum Dest {
            Buf { at: usize, len: usize },
            Slot { span: usize, slot: usize },
        }
        let mut ops = Vec::new();
        let mut dests = Vec::new();
        // Per span needing reconstruction: its range and its slots.
        let mut rebuilt: Vec<Option<Rebuilt>> = vec![None; spans.len()];
        for (si, span) in spans.iter().enumerate() {
            let s = span.stripe;
            let direct = |slot: usize| -> Option<usize> {
                if self.layout.code() == Code::Mirror {
                    (0..n)
                        .map(|j| self.layout.member_of(s, j))
                        .find(|&m| st.present(m, s))
                } else {
                    let m = self.layout.member_of(s, slot);
                    st.present(m, s).then_some(m)
                }
            };
            if span.pieces.iter().all(|p| direct(p.slot).is_some()) {
                for p in &span.pieces {
                    let m = direct(p.slot).unwrap_or(0);
                    ops.push((m, self.read_op(&st, m, s, p.chunk_from, p.len)));
                    dests.push(Dest::Buf {
                        at: p.buf_from,
                        len: p.len as usize,
                    });
                }
                continue;
            }
            if self.layout.code() == Code::None {
                return Err(Stop::Fatal(BlocksError::TooManyLost {
                    lost: 1,
                    tolerated: 0,
                }));
            }
            let (lo, hi) = span.range(RS_ALIGN, self.layout.chunk_bytes);
            let present: Vec<usize> = (0..n)
                .filter(|&slot| st.present(self.layout.member_of(s, slot), s))
                .take(k)
                .collect();
            if present.len() < k {
                return Err(Stop::Fatal(BlocksError::TooManyLost {
                    lost: n - present.len(),
                    tolerated: n - k,
                }));
            }
            for slot in present {
                let m = self.layout.member_of(s, slot);
                ops.push((m, self.read_op(&st, m, s, lo, hi - lo)));
                dests.push(Dest::Slot { span: si, slot });
            }
            rebuilt[si] = Some((lo, hi, vec![None; n]));
        }
        let replies = self.exchange_all(ops)?;
        for (reply, dest) in replies.into_iter().zip(dests) {
            let data = reply::data(Ok(reply)).map_err(BlocksError::from)?;
            match dest {
                Dest::Buf { at, len } => {
                    if data.len() != len {
                        return Err(Stop::Fatal(BlocksError::Codec("short read".into())));
                    }
                    buf[at..at + len].copy_from_slice(&data);
                }
                Dest::Slot { span, slot } => {
                    if let Some((_, _, slots)) = rebuilt[span].as_mut() {
                        slots[slot] = Some(data.to_vec());
                    }
                }
            }
        }
        for (si, r) in rebuilt.iter_mut().enumerate() {
            let Some((lo, hi, slots)) = r.as_mut() else {
                continue;
            };
            // Fewer than n slots were read on purpose; pad the unread parity as missing.
            let mut full: Vec<Option<Vec<u8>>> = std::mem::take(slots);
            if full.iter().filter(|s| s.is_some()).count() < k {
                return Err(Stop::Fatal(BlocksError::Codec("too few slots read".into())));
            }
            self.codec.reconstruct(&mut full)?;
            for p in &spans[si].pieces {
                let from = (p.chunk_from - *lo) as usize;
                let src = full[p.slot].as_deref().unwrap_or(&[]);
                if from + p.len as usize > src.len() || *hi < p.chunk_from + p.len {
                    return Err(Stop::Fatal(BlocksError::Codec(
                        "reconstructed short".into(),
                    )));
                }
                buf[p.buf_from..p.buf_from + p.len as usize]
                    .copy_from_slice(&src[from..from + p.len as usize]);
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), BlocksError> {
        let spans = plan::split(&self.layout, offset, data.len() as u64)?;
        let result = {
            let _locks = self.write_locks(&spans);
            self.retrying(|| self.try_write(&spans, data))
        };
        if self.write_intent && self.layout.code() != Code::None {
            self.clear_marks(false);
        }
        result
    }

    fn try_write(&self, spans: &[StripeSpan], data: &[u8]) -> Result<(), Stop> {
        let st = self.state.read().clone();
        let k = self.layout.data_slots();
        let n = self.layout.members;
        let code = self.layout.code();
        let chunk = self.layout.chunk_bytes;

        #[derive(Clone, Copy, PartialEq)]
        enum Mode {
            /// No parity to keep (raid0) or parity is a copy (raid1): just write.
            Plain,
            /// Whole stripe: parity from the new data, nothing read; absent members are
            /// left out.
            Full,
            /// SWAP the pieces in (the server answers the old bytes), then XOR_INTO
            /// enc(old ^ new) into the parity: two requests for a one-chunk write, and
            /// deltas commute, so their order against other writers' does not matter.
            /// Also when degraded, as long as every piece's member is present: absent
            /// parity members are left out.
            Rmw,
            /// A piece falls on an absent member (or more are absent than parity covers):
            /// read every present slot over the range, rebuild the missing ones, apply
            /// the data, re-encode parity.
            Reconstruct,
        }
        let modes: Vec<Mode> = spans
            .iter()
            .map(|span| {
                let s = span.stripe;
                let absent = (0..n).filter(|&m| !st.present(m, s)).count();
                // Parity stays the code of the data when an absent member's slot is
                // simply left out: an absent data slot is whatever parity and the other
                // data say, which a full encode or a delta keeps; an absent parity slot
                // is rebuilt from data. Only a piece on an absent member needs the
                // stripe read back and rebuilt.
                let pieces_present = span
                    .pieces
                    .iter()
                    .all(|p| st.present(self.layout.member_of(s, p.slot), s));
                match code {
                    Code::None | Code::Mirror => Mode::Plain,
                    _ if absent > n - k => Mode::Reconstruct,
                    _ if span.is_full(&self.layout) => Mode::Full,
                    _ if pieces_present => Mode::Rmw,
                    _ => Mode::Reconstruct,
                }
            })
            .collect();

        // Phase 1: intents (and the reads a partial or degraded write needs).
        let mut ops = Vec::new();
        enum Got {
            Intent,
            OldPiece { span: usize, piece: usize },
            Slot { span: usize, slot: usize },
        }
        let mut gots = Vec::new();
        // Zones this call writes into that are not marked yet: mark them on every present
        // member before any data or parity goes out.
        let mut new_marks: Vec<u64> = Vec::new();
        if self.write_intent && code != Code::None {
            let now = Instant::now();
            let mut marked = self.marked.lock();
            for span in spans {
                let zone = span.stripe / INTENT_ZONE_STRIPES;
                match marked.get_mut(&zone) {
                    Some(t) => *t = now,
                    None if !new_marks.contains(&zone) => new_marks.push(zone),
                    None => {}
                }
            }
        }
        let mark_ops = |zones: &[u64]| -> Vec<(usize, Op)> {
            zones
                .iter()
                .flat_map(|&zone| {
                    (0..n)
                        .filter(|&m| st.members[m].state == MemberState::Active)
                        .map(move |m| (m, zone))
                })
                .map(|(m, zone)| (m, self.mark_op(&st, m, zone, 1)))
                .collect()
        };
        if !new_marks.is_empty() && modes.contains(&Mode::Rmw) {
            // A SWAP changes data, so unlike a read it cannot ride with the marks: they
            // are acknowledged on every member first (once per zone).
            for reply in self.exchange_all(mark_ops(&new_marks))? {
                reply::done(Ok(reply)).map_err(BlocksError::from)?;
            }
            let now = Instant::now();
            let mut marked = self.marked.lock();
            for zone in new_marks.drain(..) {
                marked.insert(zone, now);
            }
        }
        for op in mark_ops(&new_marks) {
            ops.push(op);
            gots.push(Got::Intent);
        }
        for (si, span) in spans.iter().enumerate() {
            let s = span.stripe;
            let (lo, hi) = span.range(RS_ALIGN, chunk);
            match modes[si] {
                Mode::Plain | Mode::Full => {}
                Mode::Rmw => {
                    for (pi, p) in span.pieces.iter().enumerate() {
                        let m = self.layout.member_of(s, p.slot);
                        let new = Bytes::copy_from_slice(&data[p.buf_from..][..p.len as usize]);
                        ops.push((m, self.swap_op(&st, m, s, p.chunk_from, new)));
                        gots.push(Got::OldPiece {
                            span: si,
                            piece: pi,
                        });
                    }
                }
                Mode::Reconstruct => {
                    for slot in 0..n {
                        let m = self.layout.member_of(s, slot);
                        if st.present(m, s) {
                            ops.push((m, self.read_op(&st, m, s, lo, hi - lo)));
                            gots.push(Got::Slot { span: si, slot });
                        }
                    }
                }
            }
        }
        let mut old_pieces: Vec<Vec<Option<Bytes>>> =
            spans.iter().map(|s| vec![None; s.pieces.len()]).collect();
        let mut slots: Vec<Vec<Option<Vec<u8>>>> = vec![vec![None; n]; spans.len()];
        // A SWAP that landed has changed data, so its parity delta must go out even when
        // the rest of this phase failed: a retry (degraded, once a member is marked
        // missing) rebuilds lost slots from parity, which must then match the data.
        let mut outcome = Outcome::default();
        let mut short_slot = false;
        if !ops.is_empty() {
            let replies = outcome.sort(self.exchange(ops));
            if outcome.ok() && !new_marks.is_empty() {
                let now = Instant::now();
                let mut marked = self.marked.lock();
                for &zone in &new_marks {
                    marked.insert(zone, now);
                }
            }
            for (reply, got) in replies.into_iter().zip(gots) {
                let Some(reply) = reply else { continue };
                let res = match got {
                    Got::Intent => reply::done(Ok(reply)),
                    Got::OldPiece { span, piece } => {
                        reply::data(Ok(reply)).map(|d| old_pieces[span][piece] = Some(d))
                    }
                    Got::Slot { span, slot } => reply::data(Ok(reply)).map(|d| {
                        // A reply of another length is the server's error, not a slot:
                        // the stripe is rebuilt from what every member said, sliced by
                        // the span's bounds.
                        let (lo, hi) = spans[span].range(RS_ALIGN, chunk);
                        if d.len() as u64 == hi - lo {
                            slots[span][slot] = Some(d.to_vec());
                        } else {
                            short_slot = true;
                        }
                    }),
                };
                if let Err(e) = res {
                    outcome.fail(e.into());
                }
            }
        }
        if short_slot {
            outcome.fail(BlocksError::Codec("short read of a stripe slot".into()));
        }
        // After a failed first phase only the deltas of SWAPs that landed go out.
        let deltas_only = !outcome.ok();

        // Phase 2: data and parity.
        let mut writes = Vec::new();
        for (si, span) in spans.iter().enumerate() {
            let s = span.stripe;
            let piece_bytes = |p: &plan::Piece| &data[p.buf_from..p.buf_from + p.len as usize];
            let (lo, hi) = span.range(RS_ALIGN, chunk);
            if deltas_only && modes[si] != Mode::Rmw {
                continue;
            }
            match modes[si] {
                Mode::Plain => {
                    for p in &span.pieces {
                        let bytes = Bytes::copy_from_slice(piece_bytes(p));
                        let copies: Vec<usize> = if code == Code::Mirror {
                            (0..n).map(|j| self.layout.member_of(s, j)).collect()
                        } else {
                            vec![self.layout.member_of(s, p.slot)]
                        };
                        let mut any = false;
                        for m in copies.into_iter().filter(|&m| st.present(m, s)) {
                            writes.push((m, self.write_op(&st, m, s, p.chunk_from, bytes.clone())));
                            any = true;
                        }
                        if !any {
                            return Err(Stop::Fatal(BlocksError::TooManyLost {
                                lost: n - self.layout.data_slots() + 1,
                                tolerated: n - self.layout.data_slots(),
                            }));
                        }
                    }
                }
                Mode::Full => {
                    let chunks: Vec<&[u8]> = span.pieces.iter().map(piece_bytes).collect();
                    let mut parity = vec![Vec::new(); n - k];
                    self.codec.encode(&chunks, &mut parity)?;
                    for p in &span.pieces {
                        let m = self.layout.member_of(s, p.slot);
                        if st.present(m, s) {
                            writes.push((
                                m,
                                self.write_op(&st, m, s, 0, Bytes::copy_from_slice(piece_bytes(p))),
                            ));
                        }
                    }
                    for (j, par) in parity.into_iter().enumerate() {
                        let m = self.layout.member_of(s, k + j);
                        if st.present(m, s) {
                            writes.push((m, self.write_op(&st, m, s, 0, Bytes::from(par))));
                        }
                    }
                }
                Mode::Rmw => {
                    let width = (hi - lo) as usize;
                    let mut deltas: Vec<Option<Vec<u8>>> = vec![None; k];
                    for (pi, p) in span.pieces.iter().enumerate() {
                        // A SWAP that failed changed nothing we know of: no delta.
                        let Some(old) = old_pieces[si][pi].as_deref() else {
                            continue;
                        };
                        let new = piece_bytes(p);
                        if old.len() != new.len() {
                            outcome.fail(BlocksError::Codec("short swap reply".into()));
                            continue;
                        }
                        let d = deltas[p.slot].get_or_insert_with(|| vec![0u8; width]);
                        let at = (p.chunk_from - lo) as usize;
                        let dst = &mut d[at..at + new.len()];
                        dst.copy_from_slice(old);
                        xor_into(dst, new);
                    }
                    if deltas.iter().all(Option::is_none) {
                        continue;
                    }
                    // enc(Δ) alone: the code is linear, so parity ^= enc(Δ) at the server.
                    let mut parity = vec![vec![0u8; width]; n - k];
                    let refs: Vec<Option<&[u8]>> = deltas.iter().map(|d| d.as_deref()).collect();
                    self.codec.apply_delta(&refs, &mut parity)?;
                    for (j, par) in parity.into_iter().enumerate() {
                        let m = self.layout.member_of(s, k + j);
                        if st.present(m, s) && !outcome.lost.contains(&m) {
                            writes.push((m, self.xor_op(&st, m, s, lo, Bytes::from(par))));
                        }
                    }
                }
                Mode::Reconstruct => {
                    let mut full = std::mem::take(&mut slots[si]);
                    self.codec.reconstruct(&mut full)?;
                    for p in &span.pieces {
                        let at = (p.chunk_from - lo) as usize;
                        if let Some(d) = full[p.slot].as_mut() {
                            d[at..at + p.len as usize].copy_from_slice(piece_bytes(p));
                        }
                        let m = self.layout.member_of(s, p.slot);
                        if st.present(m, s) {
                            writes.push((
                                m,
                                self.write_op(
                                    &st,
                                    m,
                                    s,
                                    p.chunk_from,
                                    Bytes::copy_from_slice(piece_bytes(p)),
                                ),
                            ));
                        }
                    }
                    let data_slots: Vec<&[u8]> = full[..k]
                        .iter()
                        .map(|d| d.as_deref().unwrap_or(&[]))
                        .collect();
                    let mut parity = vec![Vec::new(); n - k];
                    self.codec.encode(&data_slots, &mut parity)?;
                    for (j, par) in parity.into_iter().enumerate() {
                        let m = self.layout.member_of(s, k + j);
                        if st.present(m, s) {
                            writes.push((m, self.write_op(&st, m, s, lo, Bytes::from(par))));
                        }
                    }
                }
            }
        }
        if !writes.is_empty() {
            outcome.sort(self.exchange(writes));
        }
        outcome.into_result()
    }

    /// Reads every stripe in `stripes` whole, checks parity against data, and (when
    /// `repair`) rewrites parity from data where they disagree.
    fn check_stripes(
        &self,
        stripes: &[u64],
        repair: bool,
        report: &mut ScrubReport,
    ) -> Result<(), Stop> {
        let st = self.state.read().clone();
        let n = self.layout.members;
        let k = self.layout.data_slots();
        let chunk = self.layout.chunk_bytes;
        let mut ops = Vec::new();
        let mut at = Vec::new();
        let mut checkable = Vec::new();
        for (i, &s) in stripes.iter().enumerate() {
            if !(0..n).all(|m| st.present(m, s)) {
                report.skipped += 1;
                continue;
            }
            checkable.push(i);
            for slot in 0..n {
                let m = self.layout.member_of(s, slot);
                ops.push((m, self.read_op(&st, m, s, 0, chunk)));
                at.push((i, slot));
            }
        }
        let replies = self.exchange_all(ops)?;
        let mut slots: Vec<Vec<Vec<u8>>> = vec![vec![Vec::new(); n]; stripes.len()];
        for (reply, (i, slot)) in replies.into_iter().zip(at) {
            let data = reply::data(Ok(reply)).map_err(BlocksError::from)?;
            if data.len() as u64 != chunk {
                return Err(BlocksError::Codec("short read of a stripe slot".into()).into());
            }
            slots[i][slot] = data.to_vec();
        }
        let mut writes = Vec::new();
        for i in checkable {
            report.stripes_checked += 1;
            if self.codec.verify(&slots[i])? {
                continue;
            }
            report.mismatches += 1;
            if repair {
                let s = stripes[i];
                let data: Vec<&[u8]> = slots[i][..k].iter().map(|v| &v[..]).collect();
                let mut parity = vec![Vec::new(); n - k];
                self.codec.encode(&data, &mut parity)?;
                for (j, par) in parity.into_iter().enumerate() {
                    let m = self.layout.member_of(s, k + j);
                    writes.push((m, self.write_op(&st, m, s, 0, Bytes::from(par))));
                }
                report.repaired += 1;
            }
        }
        if !writes.is_empty() {
            self.exchange_all(writes)?;
        }
        Ok(())
    }

    /// Reads every stripe, checks parity, repairs mismatches from data.
    pub fn scrub(&self, repair: bool) -> Result<ScrubReport, BlocksError> {
        let mut report = ScrubReport::default();
        let mut s = 0;
        while s < self.layout.stripes {
            let batch: Vec<u64> = (s..(s + STRIPES_PER_ROUND).min(self.layout.stripes)).collect();
            let spans: Vec<StripeSpan> = batch
                .iter()
                .map(|&stripe| StripeSpan {
                    stripe,
                    pieces: vec![],
                })
                .collect();
            let _locks = self.write_locks(&spans);
            let mut round = ScrubReport::default();
            self.retrying(|| {
                round = ScrubReport::default();
                self.check_stripes(&batch, repair, &mut round)
            })?;
            report.stripes_checked += round.stripes_checked;
            report.mismatches += round.mismatches;
            report.repaired += round.repaired;
            report.skipped += round.skipped;
            s += STRIPES_PER_ROUND;
        }
        Ok(report)
    }

    /// Finds zones a writer left marked (killed, perhaps between data and parity) and makes
    /// the parity of their stripes agree with their data again, then clears the marks.
    pub fn resync_intents(&self) -> Result<ScrubReport, BlocksError> {
        let mut report = ScrubReport::default();
        if self.layout.code() == Code::None {
            return Ok(report);
        }
        let st = self.state.read().clone();
        let zones = self.layout.stripes.div_ceil(INTENT_ZONE_STRIPES);
        let words_bytes = zones * INTENT_BYTES;
        let mut dirty = vec![false; zones as usize];
        let mut clear = Vec::new();
        for (m, member) in st.members.iter().enumerate() {
            if member.state != MemberState::Active {
                continue;
            }
            let mut from = 0;
            while from < words_bytes {
                let len = (words_bytes - from).min(META_READ_BYTES_MAX);
                let got = self.client.call(
                    m as NodeId,
                    Op::Read {
                        region: member.region,
                        offset: SUPERBLOCK_BYTES + from,
                        len: len as u32,
                    },
                );
                let bytes = match reply::data(got) {
                    Ok(b) => b,
                    Err(e) if is_member_failure(&e) => {
                        self.mark_missing(&[m]);
                        break;
                    }
                    Err(e) => return Err(e.into()),
                };
                for (i, w) in bytes.chunks_exact(8).enumerate() {
                    if w != [0u8; 8] {
                        let s = (from / INTENT_BYTES) as usize + i;
                        if let Some(d) = dirty.get_mut(s) {
                            *d = true;
                        }
                        clear.push((m, s as u64));
                    }
                }
                from += len;
            }
        }
        let marked: Vec<u64> = (0..self.layout.stripes)
            .filter(|&s| dirty[(s / INTENT_ZONE_STRIPES) as usize])
            .collect();
        for batch in marked.chunks(STRIPES_PER_ROUND as usize) {
            let spans: Vec<StripeSpan> = batch
                .iter()
                .map(|&stripe| StripeSpan {
                    stripe,
                    pieces: vec![],
                })
                .collect();
            let _locks = self.write_locks(&spans);
            let mut round = ScrubReport::default();
            self.retrying(|| {
                round = ScrubReport::default();
                self.check_stripes(batch, true, &mut round)
            })?;
            report.stripes_checked += round.stripes_checked;
            report.mismatches += round.mismatches;
            report.repaired += round.repaired;
            report.skipped += round.skipped;
        }
        let st = self.state.read().clone();
        let zero = Bytes::from_static(&[0u8; 8]);
        let ops: Vec<(usize, Op)> = clear
            .into_iter()
            .filter(|&(m, _)| st.members[m].state == MemberState::Active)
            .map(|(m, s)| {
                (
                    m,
                    Op::Write {
                        region: st.members[m].region,
                        offset: SUPERBLOCK_BYTES + s * INTENT_BYTES,
                        data: zero.clone(),
                    },
                )
            })
            .collect();
        let _ = self.exchange(ops);
        Ok(report)
    }

    /// Rebuilds member `member` onto `replacement` (a new server, or the same one
    /// restarted empty): allocates its region there, then reconstructs stripe after
    /// stripe while the volume keeps serving, at most `rate_bytes_per_s` of rebuilt
    /// chunks a second (0: unlimited). Blocks until done; run it on a thread of its own
    /// to rebuild in the background and watch `status().rebuild`.
    pub fn rebuild(
        &self,
        member: usize,
        replacement: SocketAddr,
        rate_bytes_per_s: u64,
    ) -> Result<(), BlocksError> {
        if member >= self.layout.members {
            return Err(BlocksError::InvalidArgument(format!("no member {member}")));
        }
        if self.rebuild_running.swap(true, Ordering::SeqCst) {
            return Err(BlocksError::InvalidArgument(
                "a rebuild is already running".into(),
            ));
        }
        let result = self.rebuild_inner(member, replacement, rate_bytes_per_s);
        self.rebuild_running.store(false, Ordering::SeqCst);
        if result.is_err() {
            self.state.write().rebuild = None;
        }
        result
    }

    fn rebuild_inner(
        &self,
        member: usize,
        replacement: SocketAddr,
        rate_bytes_per_s: u64,
    ) -> Result<(), BlocksError> {
        // Take the member out of service before touching the replacement.
        {
            let mut st = self.state.write();
            st.members[member].state = MemberState::Missing;
            st.members[member].addr = replacement;
            st.generation += 1;
            let map = map_of(&st.members);
            drop(st);
            self.client.set_map(map);
        }
        let name = region_name(&self.name, member);
        let node = member as NodeId;
        // A region of that name may survive from an earlier attempt: start it afresh.
        let found = self.client.call(node, Op::Lookup { name: name.clone() });
        if let Ok(old) = reply::region(node, found) {
            let _ = self.client.free(&old);
        }
        let region = self
            .client
            .alloc_on(node, member_region_bytes(&self.layout), Some(&name))
            .map_err(|e| BlocksError::Member { member, source: e })?;
        {
            let mut st = self.state.write();
            st.members[member].region = region.id;
            st.rebuild = Some((member, 0));
            st.generation += 1;
        }
        self.write_superblock(false)?;
        self.rebuild_done.store(0, Ordering::Relaxed);
        let progress = |done: u64| RebuildProgress {
            member,
            region: region.id,
            stripes_done: done,
            stripes_total: self.layout.stripes,
            rate_bytes_per_s,
            updated_unix_ms: unix_ms(),
        };
        self.write_progress(Some(progress(0)));
        // The rebuild's bulk reads and writes go over connections of their own: on the
        // volume's connections a caller's 4 KiB request waited behind a round's MiBs
        // (each connection is answered in order), which halved the load's throughput.
        let rebuild_client = lazy_client(&self.state.read().members, &self.client_config)?;
        let mut progress_written = Instant::now();
        let started = Instant::now();
        let mut bytes_done = 0u64;
        let chunk = self.layout.chunk_bytes;
        let n = self.layout.members;
        let k = self.layout.data_slots();
        let mut first = 0;
        while first < self.layout.stripes {
            // A round of stripes: one batch of reads, one of writes, under their locks.
            let last = (first + REBUILD_STRIPES_PER_ROUND).min(self.layout.stripes);
            let spans: Vec<StripeSpan> = (first..last)
                .map(|stripe| StripeSpan {
                    stripe,
                    pieces: vec![],
                })
                .collect();
            let locks = self.write_locks(&spans);
            self.retrying(|| {
                let st = self.state.read().clone();
                if st.rebuild.map(|(m, _)| m) != Some(member) {
                    return Err(Stop::Fatal(BlocksError::Member {
                        member,
                        source: ClientError::ConnectionLost { addr: replacement },
                    }));
                }
                let mut ops = Vec::new();
                let mut wanted = Vec::new();
                for s in first..last {
                    let sources: Vec<usize> = (0..n)
                        .filter(|&slot| {
                            let m = self.layout.member_of(s, slot);
                            m != member && st.present(m, s)
                        })
                        .take(if self.layout.code() == Code::Mirror {
                            1
                        } else {
                            k
                        })
                        .collect();
                    for &slot in &sources {
                        let m = self.layout.member_of(s, slot);
                        ops.push((m, self.read_op(&st, m, s, 0, chunk)));
                        wanted.push((s, slot));
                    }
                }
                let replies = self.exchange_all_on(&rebuild_client, ops)?;
                // The replies are borrowed, not copied: the member's slot is built
                // straight from them (for XOR: one copy and k − 1 XORs a chunk).
                let mut slots: Vec<Vec<Option<Bytes>>> =
                    vec![vec![None; n]; (last - first) as usize];
                for ((s, slot), r) in wanted.into_iter().zip(replies) {
                    let data = reply::data(Ok(r)).map_err(BlocksError::from)?;
                    if data.len() as u64 != chunk {
                        return Err(Stop::Fatal(BlocksError::Codec("short read".into())));
                    }
                    slots[(s - first) as usize][slot] = Some(data);
                }
                let mut writes = Vec::new();
                for (i, stripe_slots) in slots.iter().enumerate() {
                    let s = first + i as u64;
                    let refs: Vec<Option<&[u8]>> =
                        stripe_slots.iter().map(|d| d.as_deref()).collect();
                    let mine = self.layout.slot_of(s, member);
                    let bytes = self.codec.rebuild_slot(&refs, mine)?;
                    writes.push((member, self.write_op(&st, member, s, 0, Bytes::from(bytes))));
                }
                self.exchange_all_on(&rebuild_client, writes)?;
                Ok(())
            })?;
            if let Some((_, cursor)) = self.state.write().rebuild.as_mut() {
                *cursor = last;
            }
            self.rebuild_done.store(last, Ordering::Relaxed);
            drop(locks);
            if progress_written.elapsed() >= REBUILD_PROGRESS_INTERVAL {
                self.write_progress(Some(progress(last)));
                progress_written = Instant::now();
            }
            bytes_done += chunk * (last - first);
            first = last;
            if rate_bytes_per_s > 0 {
                // Rate limit: sleeping until the budget allows the bytes done so far, in
                // steps no longer than the progress interval, so the record stays fresh
                // however slow the rate.
                let due = Duration::from_secs_f64(bytes_done as f64 / rate_bytes_per_s as f64);
                while let Some(wait) = due.checked_sub(started.elapsed()) {
                    if wait.is_zero() {
                        break;
                    }
                    std::thread::sleep(wait.min(REBUILD_PROGRESS_INTERVAL));
                    if progress_written.elapsed() >= REBUILD_PROGRESS_INTERVAL {
                        self.write_progress(Some(progress(last)));
                        progress_written = Instant::now();
                    }
                }
            }
        }
        {
            let mut st = self.state.write();
            st.members[member].state = MemberState::Active;
            st.rebuild = None;
            st.generation += 1;
        }
        self.write_superblock(false)?;
        self.write_progress(None);
        Ok(())
    }
}

impl Drop for Volume {
    /// Clears the marks of a volume closed cleanly, so the next open resyncs nothing.
    fn drop(&mut self) {
        if self.write_intent && self.layout.code() != Code::None {
            self.clear_marks(true);
        }
    }
}

/// A member's reserved block: its superblock, then (at its end) the rebuild progress.
fn read_member_block(client: &Client, member: usize, region: u64) -> Result<Bytes, BlocksError> {
    Ok(reply::data(client.call(
        member as NodeId,
        Op::Read {
            region,
            offset: 0,
            len: SUPERBLOCK_BYTES as u32,
        },
    ))?)
}

fn read_member_superblock(
    client: &Client,
    member: usize,
    region: u64,
) -> Result<Superblock, BlocksError> {
    Superblock::decode(&read_member_block(client, member, region)?)
}

/// The progress record at the end of a member's reserved block; a damaged one is
/// ignored (it only ever informs `status`).
fn progress_of(block: &[u8]) -> Option<RebuildProgress> {
    let at = PROGRESS_OFFSET as usize;
    block
        .get(at..)
        .and_then(|b| RebuildProgress::decode(b).ok())
        .flatten()
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Finds the volume's region on one server by its name and reads its superblock.
fn read_superblock_at(
    addr: SocketAddr,
    name: &str,
    config: &ClientConfig,
) -> Result<Superblock, BlocksError> {
    Ok(read_superblock_and_progress_at(addr, name, config)?.0)
}

/// [`read_superblock_at`], with the progress record the same read brought back.
fn read_superblock_and_progress_at(
    addr: SocketAddr,
    name: &str,
    config: &ClientConfig,
) -> Result<(Superblock, Option<RebuildProgress>), BlocksError> {
    let client = Client::connect(ClusterMap::from_addrs(&[addr]), config.clone())?;
    let prefix = format!("camelot-vol.{name}.");
    let region = client
        .list(0)?
        .into_iter()
        .find(|r| r.name.as_deref().is_some_and(|n| n.starts_with(&prefix)))
        .ok_or_else(|| BlocksError::NotFound(name.to_string()))?;
    let block = read_member_block(&client, 0, region.id)?;
    let sb = Superblock::decode(&block)?;
    if sb.name != name {
        return Err(BlocksError::BadSuperblock(format!(
            "region {prefix}… holds volume {:?}",
            sb.name
        )));
    }
    Ok((sb, progress_of(&block)))
}
