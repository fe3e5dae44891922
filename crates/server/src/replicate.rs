//! Primary-backup replication: a primary's writes are copied (APPLY) to every backup of
//! their partition before the client is answered.
//!
//! **What a copy carries.** Not the write as it was made, but the key's state on this
//! server *when the copy is sent*: its value and version, or — when it is gone — a
//! deletion at a version newer than any this server has given ([`ObjectStore::next_version`]).
//! Each backup has one link (one connection, one task) that reads a key's state and sends
//! it in the same order, so for every key the copies a backup receives are snapshots in
//! the order they were taken. A copy of an older state can therefore never arrive after a
//! newer one, and a put cannot resurrect a key deleted after it (the hole a copy of the
//! write itself would leave, since a delete has no version to keep as a tombstone). A
//! write is acknowledged once a snapshot taken after it has been applied by every backup:
//! the backup then holds that write or a later state of the key, which is what a promoted
//! backup must serve.
//!
//! **Failure.** A backup that does not answer within the timeout, refuses the copies (for
//! one, a backup at another map epoch answers STALE_EPOCH, which also fences a deposed
//! primary out of the new one) or cannot be reached fails the write with
//! REPLICA_UNAVAILABLE: it was applied here but not acknowledged. The primary never
//! drops a backup on its own — that is the controller's decision, published as a map.
//!
//! **Unacknowledged writes are not read.** Until a copy covering a write is confirmed by
//! every backup, GETs of its key wait ([`crate::unacked`]): a reader must never see a
//! value the promoted backup would not have. A write whose copy failed is first sent again
//! by its writer once this server has the next map ([`Replicator::resend_at_next_epoch`]);
//! failing that, a key whose copy failed is sent again by a repair task, at whatever
//! epoch this server is at by then, while it still leads the key with backups (as its
//! primary, or under a move's fence); when it no longer leads it the claim is dropped (it
//! serves the key to nobody), and when the partition has no backup left its state stands.
//!
//! The grouping and the rewriting of an answer frame are pure and tested without sockets.

use crate::objects::{Entry, Value};
use crate::ownership::{Lead, Ownership, Peer};
use crate::state::ServerState;
use bytes::{Bytes, BytesMut};
use camelot_proto::limits::{BATCH_OPS_MAX, FRAME_BYTES_TARGET};
use camelot_proto::{
    decode_frame, encode_frame, partition_of, DecodeError, EncodeError, ErrorCode, ErrorReply,
    Frame, FrameDecoder, Hello, Op, Reply, RequestBatchEncoder, ResponseBatchEncoder,
    PROTOCOL_VERSION, REQUESTS_HEADER_BYTES,
};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

/// How long a write may wait for its backups unless configured otherwise.
pub const REPLICATION_TIMEOUT_DEFAULT: Duration = Duration::from_secs(1);
/// Batches of copies queued for one backup before writers wait for room (each is one
/// client batch's keys for that backup, at most `BATCH_OPS_MAX`).
pub const LINK_JOBS_QUEUED_MAX: usize = 1024;
/// Copies one round of a link takes from its queue before sending (more wait for the
/// next round, which starts when this one is answered).
pub const LINK_ROUND_OPS_MAX: usize = 4 * BATCH_OPS_MAX;
/// Backup servers one primary keeps links to (a map has at most 1,024 nodes).
pub const LINKS_MAX: usize = 1024;
/// How long a link waits after failing to connect before it tries again; writes in
/// between fail at once rather than each paying a connect timeout.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(50);
/// The principal a link's HELLO names (regions are not touched; it only shows in logs).
const LINK_PRINCIPAL: &str = "camelot-replica";
const READ_CHUNK_BYTES: usize = 64 << 10;
/// How often the repair task looks for keys whose copies failed. Short enough that a
/// reader waiting on such a key (for at most the replication timeout) still gets it once
/// this server has the map its backup refused it for.
const REPAIR_INTERVAL: Duration = Duration::from_millis(25);
/// How long a pushed page may take to be applied (under the client's 10 s request
/// timeout, so the mover hears why): a page is about
/// `SCAN_PAGE_BYTES_TARGET` (4 MiB) plus one value, far more than a client batch's copies.
const PUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Keys one repair pass sends again.
const REPAIR_KEYS_MAX: usize = LINK_ROUND_OPS_MAX;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplicateError {
    #[error("backup node {node} ({addr}) did not apply the copies within {timeout:?}")]
    TimedOut {
        node: u32,
        addr: std::net::SocketAddr,
        timeout: Duration,
    },
    #[error("backup node {node} ({addr}): {reason}")]
    Failed {
        node: u32,
        addr: std::net::SocketAddr,
        reason: String,
    },
    #[error("more than {LINKS_MAX} backup servers")]
    TooManyLinks,
}

impl ReplicateError {
    /// What the client is told instead of its write's answer.
    pub fn reply(&self) -> ErrorReply {
        ErrorReply::new(
            ErrorCode::ReplicaUnavailable,
            format!("written here but not acknowledged, retry: {self}"),
        )
    }
}

/// Keys `writes` (request position, key) grouped by the backups they must reach, in the
/// order given (each backup's list keeps the writes' order).
pub fn by_backup(own: &Ownership, writes: &[(usize, Bytes)]) -> Vec<(Peer, Vec<Bytes>)> {
    let mut out: Vec<(Peer, Vec<Bytes>)> = Vec::new();
    for (_, key) in writes {
        let p = partition_of(key, own.partitions());
        for peer in own.backups(p) {
            match out.iter_mut().find(|(q, _)| *q == peer) {
                Some((_, keys)) => keys.push(key.clone()),
                None => out.push((peer, vec![key.clone()])),
            }
        }
    }
    out
}

/// Rewrites the response frame `frame` (length prefix included) so that each answer at a
/// position of `failed` that succeeded becomes that position's error; other answers stay
/// as they were.
pub fn fail_answers(
    frame: &[u8],
    failed: &[(usize, ErrorReply)],
) -> Result<BytesMut, RewriteError> {
    rewrite_answers(frame, |i, r| {
        let (_, err) = failed.iter().find(|(at, _)| *at == i)?;
        r.is_ok().then(|| Err(err.clone()))
    })
}

/// Rewrites the response frame `frame` (length prefix included): the answer at position
/// `i` becomes what `with` returns for it, or stays when it returns `None`.
pub fn rewrite_answers(
    frame: &[u8],
    mut with: impl FnMut(usize, &Result<Reply, ErrorReply>) -> Option<Result<Reply, ErrorReply>>,
) -> Result<BytesMut, RewriteError> {
    let body = frame.get(4..).ok_or(RewriteError::Short)?;
    let Frame::Responses(batch) = decode_frame(Bytes::copy_from_slice(body))? else {
        return Err(RewriteError::NotResponses);
    };
    let mut out = BytesMut::with_capacity(frame.len() + 64);
    let mut enc = ResponseBatchEncoder::begin(&mut out);
    for (i, r) in batch.responses.iter().enumerate() {
        let new = with(i, &r.result);
        match new.as_ref().unwrap_or(&r.result) {
            Ok(reply) => enc.push_ok(r.id, reply)?,
            Err(e) => enc.push_err(r.id, e)?,
        }
    }
    enc.finish()?;
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("frame shorter than its length prefix")]
    Short,
    #[error("not a RESPONSES frame")]
    NotResponses,
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// One client batch's keys for one backup, and who waits for them: on success, for each
/// key, the count of its writes the copy covered ([`crate::unacked::Unacked::copy_covers`]).
struct Job {
    epoch: u64,
    keys: Vec<Bytes>,
    done: oneshot::Sender<Result<Vec<u64>, String>>,
}

/// The links from this server to its backups, made on first use.
pub struct Replicator {
    state: Arc<ServerState>,
    token: Option<Vec<u8>>,
    timeout: Duration,
    links: parking_lot::Mutex<HashMap<Peer, mpsc::Sender<Job>>>,
    ack_early: bool,
    /// Whether a repair task is running (at most one).
    repairing: std::sync::atomic::AtomicBool,
}

impl Replicator {
    pub fn new(state: Arc<ServerState>, token: Option<Vec<u8>>, timeout: Duration) -> Self {
        Replicator {
            state,
            token,
            timeout,
            links: parking_lot::Mutex::new(HashMap::new()),
            ack_early: false,
            repairing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// How long a write (or a read of an unacknowledged write) waits for the backups.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The deliberately broken mode of `ServerConfig::unsafe_ack_before_replication`.
    pub fn ack_before_replication(mut self, yes: bool) -> Self {
        self.ack_early = yes;
        self
    }

    pub fn acks_before_replication(&self) -> bool {
        self.ack_early
    }

    fn link(&self, peer: Peer) -> Result<mpsc::Sender<Job>, ReplicateError> {
        let mut links = self.links.lock();
        if let Some(tx) = links.get(&peer) {
            if !tx.is_closed() {
                return Ok(tx.clone());
            }
        }
        links.retain(|_, tx| !tx.is_closed());
        if links.len() >= LINKS_MAX {
            return Err(ReplicateError::TooManyLinks);
        }
        let (tx, rx) = mpsc::channel(LINK_JOBS_QUEUED_MAX);
        let link = Link {
            peer,
            state: Arc::clone(&self.state),
            token: self.token.clone(),
            timeout: self.timeout,
            conn: None,
            retry_at: None,
        };
        tokio::spawn(link.run(rx));
        links.insert(peer, tx.clone());
        Ok(tx)
    }

    /// A link for a connection's pushed pages to `to` (see [`PushLink`]).
    pub fn push_link(&self, to: Peer) -> PushLink {
        PushLink(Link {
            peer: to,
            state: Arc::clone(&self.state),
            token: self.token.clone(),
            timeout: PUSH_TIMEOUT.max(self.timeout),
            conn: None,
            retry_at: None,
        })
    }

    /// Copies the keys `writes` names to every backup of their partitions (per `own`),
    /// returning once all have applied them, or the first failure. Bounded by the
    /// replication timeout.
    pub async fn replicate(
        &self,
        own: &Ownership,
        writes: &[(usize, Bytes)],
    ) -> Result<(), ReplicateError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut waits = Vec::new();
        for (peer, keys) in by_backup(own, writes) {
            let (done, answer) = oneshot::channel();
            let keys_sent = keys.clone();
            let job = Job {
                epoch: own.epoch(),
                keys,
                done,
            };
            let tx = self.link(peer)?;
            let timed_out = || ReplicateError::TimedOut {
                node: peer.id,
                addr: peer.addr,
                timeout: self.timeout,
            };
            match tokio::time::timeout_at(deadline, tx.send(job)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    return Err(ReplicateError::Failed {
                        node: peer.id,
                        addr: peer.addr,
                        reason: "its link has stopped".into(),
                    })
                }
                Err(_) => return Err(timed_out()),
            }
            waits.push((peer, keys_sent, answer));
        }
        // Per key, the fewest writes a confirmed copy covered over the backups (on each
        // backup, the last of its copies holds the most).
        let mut covered: HashMap<Bytes, u64> = HashMap::new();
        for (peer, keys, answer) in waits {
            let failed = |reason: String| ReplicateError::Failed {
                node: peer.id,
                addr: peer.addr,
                reason,
            };
            match tokio::time::timeout_at(deadline, answer).await {
                Ok(Ok(Ok(covers))) => {
                    let mut mine: HashMap<&Bytes, u64> = HashMap::new();
                    for (k, c) in keys.iter().zip(covers) {
                        let e = mine.entry(k).or_insert(0);
                        *e = (*e).max(c);
                    }
                    for (k, c) in mine {
                        covered
                            .entry(k.clone())
                            .and_modify(|v| *v = (*v).min(c))
                            .or_insert(c);
                    }
                }
                Ok(Ok(Err(reason))) => return Err(failed(reason)),
                Ok(Err(_)) => return Err(failed("its link has stopped".into())),
                Err(_) => {
                    return Err(ReplicateError::TimedOut {
                        node: peer.id,
                        addr: peer.addr,
                        timeout: self.timeout,
                    })
                }
            }
        }
        let unacked = self.state.unacked();
        for (k, c) in covered {
            unacked.acked(&k, c);
        }
        Ok(())
    }

    /// After `writes`' copies under `own` failed: waits (at most [`REPAIR_INTERVAL`], and
    /// not past `deadline`) for this server to leave `own`'s epoch, then sends them again
    /// under the new map — if this server still leads every key there (as primary, or
    /// under a move's fence) and each has a backup. True if the copies then reached every
    /// backup; false otherwise, and the caller falls back to the repair task. Hold the
    /// writes' claims while this runs, so the repair task leaves these keys to it.
    ///
    /// Why the writer sends again itself: most failed copies were refused by a backup
    /// already at the next epoch, which this server installs a moment later. Left to the
    /// shared repair task, such a write could miss a move's short fence: a task that had
    /// just made a pass at the fence's epoch (for other keys) waited for the *next* epoch,
    /// the switch, before looking again, found the partition led elsewhere and failed a
    /// write the final pass had already handed over (`bench cluster expand --replication
    /// 2`: "then this server stopped being the key's primary"). Waking that task on every
    /// failure instead made the load fall behind at the first move, so it was dropped.
    pub async fn resend_at_next_epoch(
        &self,
        own: &Ownership,
        writes: &[(usize, Bytes)],
        deadline: tokio::time::Instant,
    ) -> bool {
        let wait = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .min(REPAIR_INTERVAL);
        self.state.epoch_moved_on(own.epoch(), wait).await;
        let Some(now) = self.state.ownership() else {
            return false;
        };
        let all_led = writes
            .iter()
            .all(|(_, key)| now.lead_of(key) == Lead::WithBackups);
        if now.epoch() == own.epoch() || !all_led {
            return false;
        }
        matches!(
            tokio::time::timeout_at(deadline, self.replicate(&now, writes)).await,
            Ok(Ok(()))
        )
    }

    /// Starts the repair task unless one runs: it sends again the keys whose copies
    /// failed (see the module documentation), until none is left. `routed_epoch`: the
    /// epoch the failed copies went out at. Most are refused by a backup already at the
    /// next epoch, so each pass runs as soon as this server's epoch is past the one
    /// the last attempt used (at the latest after [`REPAIR_INTERVAL`]): under a move's
    /// short fence, a pass that waited the whole interval could find the move switched
    /// and the write's partition led elsewhere, and the write would fail.
    pub fn repair_soon(self: &Arc<Self>, routed_epoch: u64) {
        use std::sync::atomic::Ordering;
        if self.repairing.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let mut tried_epoch = routed_epoch;
            loop {
                me.state.epoch_moved_on(tried_epoch, REPAIR_INTERVAL).await;
                tried_epoch = me.state.epoch();
                if me.repair_pass().await == 0 {
                    me.repairing.store(false, Ordering::Release);
                    // A failure noted after the pass found none, but before the flag
                    // fell, found the flag still up and started nothing.
                    if me.state.unacked().stalled(1).is_empty()
                        || me.repairing.swap(true, Ordering::AcqRel)
                    {
                        return;
                    }
                }
            }
        });
    }

    /// One repair pass; returns how many keys were still stalled when it began.
    async fn repair_pass(&self) -> usize {
        let unacked = Arc::clone(self.state.unacked());
        let keys = unacked.stalled(REPAIR_KEYS_MAX);
        if keys.is_empty() {
            return 0;
        }
        let own = self.state.ownership();
        let mut resend = Vec::new();
        let mut claims = Vec::new();
        for key in &keys {
            let Some(own) = own.as_deref() else {
                unacked.give_up(key);
                continue;
            };
            // Under a move's fence this server still leads the key: its copy goes on, so
            // the write settles (the backups are at the fence's epoch too) instead of
            // failing, and no backup is left without a write the new primary will have.
            match own.lead_of(key) {
                Lead::Elsewhere => {
                    unacked.give_up(key);
                    continue;
                }
                Lead::WithoutBackups => {
                    unacked.settle(key);
                    continue;
                }
                Lead::WithBackups => {}
            }
            // Held while the copy is out, so a write beside it is not taken as settled
            // by this copy alone, and the next pass leaves the key to this one.
            match unacked.begin(key) {
                Ok(claim) => {
                    resend.push((resend.len(), key.clone()));
                    claims.push(claim);
                }
                Err(_) => continue,
            }
        }
        if let (Some(own), false) = (own, resend.is_empty()) {
            if let Err(e) = self.replicate(&own, &resend).await {
                debug!(error = %e, keys = resend.len(), "repair of unacknowledged writes failed; retrying");
            }
        }
        drop(claims);
        keys.len()
    }
}

/// One connection's link to the target of its pushed pages: apart from the backups'
/// links, so that a page of megabytes never queues client writes' copies behind it, and
/// owned by the connection that pushes (it connects on first use and closes with it).
pub struct PushLink(Link);

impl PushLink {
    pub fn to(&self) -> Peer {
        self.0.peer
    }

    /// Sends a mover's pushed page (`copies`, APPLYs) routed at `epoch`, the page's own
    /// (0 for a move's: its target does not own the partitions yet, and an APPLY is not
    /// placed), and waits until the target has applied them all. The error says which
    /// node failed and why.
    pub async fn push(&mut self, epoch: u64, copies: &[Op]) -> Result<(), String> {
        let to = self.0.peer;
        let failed = |reason: String| format!("node {} ({}): {reason}", to.id, to.addr);
        let frames = frames_of(epoch, copies).map_err(|e| failed(format!("cannot encode: {e}")))?;
        let mut results = self
            .0
            .exchange_round(&frames, &vec![0; copies.len()], 1)
            .await;
        results.pop().unwrap_or(Ok(())).map_err(failed)
    }
}

/// One backup's connection and the task that feeds it, round by round: take what is
/// queued, read each key's state, send, wait for every answer, tell the writers.
struct Link {
    peer: Peer,
    state: Arc<ServerState>,
    token: Option<Vec<u8>>,
    timeout: Duration,
    conn: Option<(TcpStream, BytesMut)>,
    retry_at: Option<Instant>,
}

impl Link {
    async fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        // A job of another epoch than the round's waits here for the next round.
        let mut held: VecDeque<Job> = VecDeque::new();
        loop {
            let first = match held.pop_front() {
                Some(j) => j,
                None => match rx.recv().await {
                    Some(j) => j,
                    None => return, // the replicator is gone
                },
            };
            let epoch = first.epoch;
            let mut ops = first.keys.len();
            let mut round = vec![first];
            while ops < LINK_ROUND_OPS_MAX {
                let next = match held.pop_front() {
                    Some(j) => j,
                    None => match rx.try_recv() {
                        Ok(j) => j,
                        Err(_) => break,
                    },
                };
                if next.epoch != epoch {
                    held.push_front(next);
                    break;
                }
                ops += next.keys.len();
                round.push(next);
            }
            let (results, covers) = self.send_round(epoch, &round).await;
            for ((job, result), covers) in round.into_iter().zip(results).zip(covers) {
                let _ = job.done.send(result.map(|()| covers));
            }
        }
    }

    /// One result per job. Retries once on a fresh connection when a reused one turns
    /// out to be broken (the backup may have closed it while idle).
    /// Also, per job, the counts its copies covered (see [`Job`]).
    async fn send_round(
        &mut self,
        epoch: u64,
        round: &[Job],
    ) -> (Vec<Result<(), String>>, Vec<Vec<u64>>) {
        let (frames, job_of, covers) = match self.encode_round(epoch, round) {
            Ok(f) => f,
            Err(e) => {
                let e = format!("cannot encode copies: {e}");
                return (vec![Err(e); round.len()], vec![Vec::new(); round.len()]);
            }
        };
        (
            self.exchange_round(&frames, &job_of, round.len()).await,
            covers,
        )
    }

    async fn exchange_round(
        &mut self,
        frames: &[(BytesMut, usize)],
        job_of: &[usize],
        jobs: usize,
    ) -> Vec<Result<(), String>> {
        let all = |e: String| vec![Err(e); jobs];
        let deadline = tokio::time::Instant::now() + self.timeout;
        for attempt in 0..2 {
            let reused = self.conn.is_some();
            if !reused {
                if let Some(at) = self.retry_at {
                    if Instant::now() < at {
                        return all("unreachable (retrying shortly)".into());
                    }
                }
                match tokio::time::timeout_at(deadline, self.connect()).await {
                    Ok(Ok(c)) => {
                        self.conn = Some(c);
                        self.retry_at = None;
                    }
                    Ok(Err(e)) => {
                        self.retry_at = Some(Instant::now() + RECONNECT_BACKOFF);
                        return all(format!("cannot connect: {e}"));
                    }
                    Err(_) => {
                        self.retry_at = Some(Instant::now() + RECONNECT_BACKOFF);
                        return all(format!("no connection within {:?}", self.timeout));
                    }
                }
            }
            match tokio::time::timeout_at(deadline, self.exchange(frames, job_of, jobs)).await {
                Ok(Ok(results)) => return results,
                Ok(Err(e)) => {
                    self.conn = None;
                    if reused && attempt == 0 {
                        debug!(peer = %self.peer.addr, error = %e, "replication link broken; reconnecting");
                        continue;
                    }
                    warn!(peer = %self.peer.addr, error = %e, "replication link failed");
                    return all(e.to_string());
                }
                Err(_) => {
                    // Answers may still come; a fresh connection must not be read as them.
                    self.conn = None;
                    return all(format!("no answer within {:?}", self.timeout));
                }
            }
        }
        all("replication link broken twice".into())
    }

    /// The round's copies, in frames of at most `BATCH_OPS_MAX` ops and about
    /// `FRAME_BYTES_TARGET` bytes; each copy is the key's state as of now. Also, for each
    /// copy, the index of its job, and per job, the write count each key's copy covers.
    #[allow(clippy::type_complexity)]
    fn encode_round(
        &self,
        epoch: u64,
        round: &[Job],
    ) -> Result<(Vec<(BytesMut, usize)>, Vec<usize>, Vec<Vec<u64>>), EncodeError> {
        let objects = self.state.objects();
        let unacked = self.state.unacked();
        let now = Instant::now();
        let mut ops = Vec::new();
        let mut job_of = Vec::new();
        let mut covers: Vec<Vec<u64>> = round
            .iter()
            .map(|j| Vec::with_capacity(j.keys.len()))
            .collect();
        let keyed = round
            .iter()
            .enumerate()
            .flat_map(|(j, job)| job.keys.iter().map(move |k| (j, k)));
        for (job, key) in keyed {
            // Read before the state: the copy then holds at least this many writes.
            covers[job].push(unacked.copy_covers(key));
            let state = objects.read(key, now, |e| match e {
                Some(Entry {
                    version,
                    value: Value::Str(v),
                    ..
                }) => Some(Some((*version, v.clone()))),
                // Another type (made on the Redis port, which is not replicated).
                Some(_) => None,
                None => Some(None),
            });
            ops.push(match state {
                None => continue,
                Some(Some((version, value))) => Op::Apply {
                    key: key.clone(),
                    version,
                    value: Some(value),
                },
                Some(None) => Op::Apply {
                    key: key.clone(),
                    version: objects.next_version(),
                    value: None,
                },
            });
            job_of.push(job);
        }
        Ok((frames_of(epoch, &ops)?, job_of, covers))
    }

    async fn connect(&self) -> std::io::Result<(TcpStream, BytesMut)> {
        let mut stream = TcpStream::connect(self.peer.addr).await?;
        stream.set_nodelay(true)?;
        let mut out = BytesMut::new();
        let hello = Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: Bytes::from(self.token.clone().unwrap_or_default()),
            principal: LINK_PRINCIPAL.to_owned(),
            fence: None,
        });
        encode_frame(&hello, &mut out).map_err(invalid)?;
        stream.write_all(&out).await?;
        let mut inbuf = BytesMut::with_capacity(READ_CHUNK_BYTES);
        match read_frame(&mut stream, &mut inbuf).await? {
            Frame::HelloOk(_) => Ok((stream, inbuf)),
            Frame::Fatal(e) => Err(invalid(format!("refused: {} {}", e.code, e.message))),
            _ => Err(invalid("expected HELLO_OK")),
        }
    }

    /// Writes every frame, then reads one answer frame per frame; a job fails if any of
    /// its copies was refused. `job_of[i]`: the job the i-th copy sent belongs to.
    async fn exchange(
        &mut self,
        frames: &[(BytesMut, usize)],
        job_of: &[usize],
        jobs: usize,
    ) -> std::io::Result<Vec<Result<(), String>>> {
        let Some((stream, inbuf)) = self.conn.as_mut() else {
            return Err(invalid("not connected"));
        };
        for (f, _) in frames {
            stream.write_all(f).await?;
        }
        let mut refused: Vec<Option<String>> = Vec::new();
        for (_, count) in frames {
            let Frame::Responses(batch) = read_frame(stream, inbuf).await? else {
                return Err(invalid("expected a RESPONSES frame"));
            };
            if batch.responses.len() != *count {
                return Err(invalid("answer count differs from the copies sent"));
            }
            for r in batch.responses {
                refused.push(match r.result {
                    Ok(Reply::Version(_)) => None,
                    Ok(other) => Some(format!("unexpected answer {other:?}")),
                    Err(e) => Some(format!("{} {}", e.code, e.message)),
                });
            }
        }
        let mut results = vec![Ok(()); jobs];
        for (job, refusal) in job_of.iter().zip(refused) {
            if let (Some(e), Some(slot)) = (refusal, results.get_mut(*job)) {
                *slot = Err(e);
            }
        }
        Ok(results)
    }
}

/// `ops` as request frames routed at `epoch`, of at most `BATCH_OPS_MAX` ops and about
/// `FRAME_BYTES_TARGET` bytes each, with the count of ops in each. Each frame's buffer is
/// sized before it is filled: grown while encoding, a page's 2 MiB frames were copied
/// about once more by their reallocations.
fn frames_of(epoch: u64, ops: &[Op]) -> Result<Vec<(BytesMut, usize)>, EncodeError> {
    let mut frames = Vec::new();
    let mut rest = ops;
    let mut id = 0u64;
    while !rest.is_empty() {
        let (mut n, mut len) = (0, REQUESTS_HEADER_BYTES);
        for op in rest {
            let op_len = op.encoded_len();
            if n > 0 && (n >= BATCH_OPS_MAX || len + op_len > FRAME_BYTES_TARGET) {
                break;
            }
            (n, len) = (n + 1, len + op_len);
        }
        let mut buf = BytesMut::with_capacity(len);
        let mut enc = RequestBatchEncoder::begin(&mut buf, epoch);
        for op in &rest[..n] {
            enc.push(id, op)?;
            id += 1;
        }
        enc.finish()?;
        rest = &rest[n..];
        frames.push((buf, n));
    }
    Ok(frames)
}

fn invalid(e: impl ToString) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

async fn read_frame(stream: &mut TcpStream, inbuf: &mut BytesMut) -> std::io::Result<Frame> {
    loop {
        if let Some(body) = FrameDecoder::split_frame(inbuf).map_err(invalid)? {
            return decode_frame(body).map_err(invalid);
        }
        if inbuf.capacity() - inbuf.len() < READ_CHUNK_BYTES / 4 {
            inbuf.reserve(READ_CHUNK_BYTES);
        }
        if stream.read_buf(inbuf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_proto::{Response, ResponseBatch};
    use std::net::SocketAddr;

    fn peer(id: u32) -> Peer {
        Peer {
            id,
            addr: SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16)),
        }
    }

    #[test]
    fn writes_are_grouped_by_backup_in_order() {
        // Two partitions: 0 backed up on 1 and 2, 1 on 2 only.
        let own = Ownership::new(3, vec![true, true])
            .unwrap()
            .with_replicas(vec![vec![peer(1), peer(2)], vec![peer(2)]], vec![false; 2])
            .unwrap();
        let key_in = |p: u32, n: usize| {
            (0..)
                .map(|i| Bytes::from(format!("k{i}")))
                .filter(|k| partition_of(k, 2) == p)
                .nth(n)
                .unwrap()
        };
        let (a, b, c) = (key_in(0, 0), key_in(1, 0), key_in(0, 1));
        let writes = vec![(0, a.clone()), (1, b.clone()), (2, c.clone())];
        let groups = by_backup(&own, &writes);
        assert_eq!(
            groups,
            vec![
                (peer(1), vec![a.clone(), c.clone()]),
                (peer(2), vec![a, b, c]),
            ]
        );
        let lone = Ownership::new(3, vec![true, true]).unwrap();
        assert!(by_backup(&lone, &writes).is_empty());
    }

    #[test]
    fn failed_answers_are_rewritten_and_the_rest_kept() {
        let responses = vec![
            Response {
                id: 10,
                result: Ok(Reply::Version(4)),
            },
            Response {
                id: 11,
                result: Ok(Reply::Object {
                    version: 2,
                    value: Bytes::from_static(b"v"),
                }),
            },
            Response {
                id: 12,
                result: Err(ErrorReply::new(ErrorCode::NoSuchKey, "gone")),
            },
            Response {
                id: 13,
                result: Ok(Reply::Version(5)),
            },
        ];
        let mut frame = BytesMut::new();
        encode_frame(
            &Frame::Responses(ResponseBatch {
                responses: responses.clone(),
            }),
            &mut frame,
        )
        .unwrap();
        let err = ErrorReply::new(ErrorCode::ReplicaUnavailable, "no backup");
        // Position 2 already failed: it keeps its own error.
        let out = fail_answers(&frame, &[(0, err.clone()), (2, err.clone())]).unwrap();
        let Frame::Responses(got) = decode_frame(out.freeze().slice(4..)).unwrap() else {
            panic!()
        };
        assert_eq!(got.responses[0].result, Err(err));
        assert_eq!(got.responses[1..], responses[1..]);
        assert!(matches!(
            fail_answers(b"\x01", &[(0, ErrorReply::new(ErrorCode::Internal, "x"))]),
            Err(RewriteError::Short)
        ));
    }

    /// Frames hold every op once, in order, with ids from 0; each is within the frame
    /// target (or one op alone), and its buffer was sized exactly, so never regrown.
    #[test]
    fn frames_split_in_order_and_are_sized_before_they_are_filled() {
        let ops: Vec<Op> = (0..3000u32)
            .map(|i| Op::Apply {
                key: Bytes::from(format!("key-{i}")),
                version: u64::from(i) + 1,
                value: (i % 7 != 0).then(|| Bytes::from(vec![b'v'; (i as usize * 37) % 20_000])),
            })
            .chain(std::iter::once(Op::Apply {
                key: Bytes::from_static(b"big"),
                version: 1,
                value: Some(Bytes::from(vec![b'b'; FRAME_BYTES_TARGET + 1])),
            }))
            .collect();
        let frames = frames_of(9, &ops).unwrap();
        assert!(frames.len() > 2, "{} frames", frames.len());
        let mut next = 0usize;
        for (buf, n) in frames {
            let sized: usize = REQUESTS_HEADER_BYTES
                + ops[next..next + n]
                    .iter()
                    .map(Op::encoded_len)
                    .sum::<usize>();
            assert_eq!(buf.len(), sized, "frame of ops {next}..{}", next + n);
            assert!(n == 1 || buf.len() <= FRAME_BYTES_TARGET);
            let Frame::Requests(batch) = decode_frame(buf.freeze().slice(4..)).unwrap() else {
                panic!("not a request frame");
            };
            assert_eq!(batch.epoch, 9);
            for (r, op) in batch.requests.iter().zip(&ops[next..next + n]) {
                assert_eq!((r.id as usize, &r.op), (next, op));
                next += 1;
            }
        }
        assert_eq!(next, ops.len());
    }
}
