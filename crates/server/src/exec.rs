//! Executes one decoded batch against the store, straight into a response frame.

use crate::objects::{no_such_key, wrong_type, Entry, ObjectStore, ScanFilter, Value};
use crate::ownership::{Ownership, Peer};
use crate::state::{kind_index, ServerState, OP_KINDS};
use crate::store::{Principal, RegionStore};
use camelot_proto::limits::IO_BYTES_MAX;
use camelot_proto::{
    EncodeError, ErrorCode, ErrorReply, Op, RegionId, Reply, RequestBatch, ResponseBatchEncoder,
    ITEM_OVERHEAD_BYTES, RESPONSE_OK_BUDGET_BYTES,
};
use std::cell::OnceCell;
use std::sync::Arc;
use std::time::Instant;

/// id, status and reply tag: what every successful response carries before its payload.
const OK_HEADER_BYTES: usize = 8 + 2 + 1;
const WORD_REPLY_BYTES: usize = OK_HEADER_BYTES + 8;
const DATA_REPLY_HEADER_BYTES: usize = OK_HEADER_BYTES + 4;
const OBJECT_REPLY_HEADER_BYTES: usize = OK_HEADER_BYTES + 8 + 4;

fn region_info_bytes(name: Option<&str>) -> usize {
    8 + 8 + 1 + 1 + name.map_or(0, str::len)
}

/// Encoded size of a list of SCAN items, with its count.
fn items_bytes(items: &[camelot_proto::Item]) -> usize {
    4 + items
        .iter()
        .map(|it| ITEM_OVERHEAD_BYTES + it.key.len() + it.value.len())
        .sum::<usize>()
}

/// The most a SCAN_PARTITIONS reply carries besides its items: the OK header, the tag's
/// clock and pushed bytes, the resume key (flag, length, bytes) and the item count.
const PAGE_REPLY_HEADER_BYTES: usize =
    OK_HEADER_BYTES + 8 + 8 + 1 + 2 + camelot_proto::limits::KEY_BYTES_MAX + 4;

/// Exact encoded size of a successful response carrying `reply`.
pub fn reply_bytes(reply: &Reply) -> usize {
    OK_HEADER_BYTES
        + match reply {
            Reply::Pong | Reply::Done => 0,
            Reply::Word(_) | Reply::Version(_) => 8,
            Reply::Object { value, .. } => 8 + 4 + value.len(),
            Reply::Items(items) => items_bytes(items),
            Reply::Page(page) => {
                8 + 8
                    + 1
                    + page.resume_after.as_ref().map_or(0, |k| 2 + k.len())
                    + items_bytes(&page.items)
            }
            Reply::Data(d) => 4 + d.len(),
            Reply::Region(r) => region_info_bytes(r.name.as_deref()),
            Reply::Stats(entries) => {
                2 + entries
                    .iter()
                    .map(|(name, _)| 1 + name.len() + 8)
                    .sum::<usize>()
            }
            Reply::List(regions) => {
                4 + regions
                    .iter()
                    .map(|r| region_info_bytes(r.name.as_deref()))
                    .sum::<usize>()
            }
        }
}

/// Appends one response per request of `batch`, in request order, to `enc`. Region
/// operations act as `who`, the principal the connection's HELLO named.
///
/// Successful replies may fill the frame only up to [`RESPONSE_OK_BUDGET_BYTES`]; a reply
/// that would go past it is answered TOO_LARGE instead (and, for an operation with side
/// effects, not executed), which keeps room for an error for every remaining request, so
/// the frame never exceeds the frame limit. An `Err` means the batch itself could not be
/// encoded (more requests than a frame may answer); the connection cannot continue.
pub fn exec(
    state: &ServerState,
    who: &Principal,
    batch: &RequestBatch,
    enc: &mut ResponseBatchEncoder<'_>,
) -> Result<(), EncodeError> {
    exec_logged(state, who, batch, enc, None)
}

/// The writes of one batch that must reach backups before they are acknowledged: each
/// successful PUT, CAS_PUT and DELETE on a partition that has backups at the ownership
/// the batch ran under (whatever epoch the batch was routed with).
#[derive(Debug, Default)]
pub struct WriteLog {
    pub ownership: Option<Arc<Ownership>>,
    /// (the answer's position in the response frame, the key written)
    pub writes: Vec<(usize, bytes::Bytes)>,
    /// The writes' claims on their keys (see [`crate::unacked`]), held until their
    /// replication is settled.
    pub pending: Vec<crate::unacked::Writing>,
    /// GETs that found their key holding a write its backups have not acknowledged:
    /// (the answer's position, the key). Each was answered REPLICA_UNAVAILABLE for now;
    /// the connection waits for the key to settle and answers it again.
    pub deferred_reads: Vec<(usize, bytes::Bytes)>,
    /// SCAN_PARTITIONS pages with `push_to`: each is answered only once `to` has applied
    /// its copies. Filled for every batch of a connection, replicating or not.
    pub pushes: Vec<PushPage>,
}

impl WriteLog {
    fn clear(&mut self) {
        self.writes.clear();
        self.pending.clear();
        self.deferred_reads.clear();
        self.pushes.clear();
    }
}

/// A page of a mover's walk that this server copies to another server itself.
#[derive(Debug)]
pub struct PushPage {
    /// The answer's position in the response frame.
    pub at: usize,
    pub to: Peer,
    /// The epoch the page's batch was routed at (0: none), which its copies carry too: a
    /// target that has moved on to another map refuses them, as it would the mover's.
    pub epoch: u64,
    /// The page's objects as APPLYs, at the versions the walk found.
    pub copies: Vec<Op>,
}

/// The placeholder answer of a deferred read, and the final one when its key does not
/// settle in time.
pub fn not_yet_replicated() -> ErrorReply {
    ErrorReply::new(
        ErrorCode::ReplicaUnavailable,
        "the key's latest write is not yet on every backup; retry",
    )
}

/// The final answers of a batch's deferred reads (see [`WriteLog::deferred_reads`]),
/// by position, once their keys have settled or the wait ran out. `epoch`: the ownership
/// epoch the batch ran under — if the server's has moved on, the reader is sent to the
/// new map. `frame_len`: the answer frame's length so far, so that the values replacing
/// the placeholders keep it within the frame budget.
pub fn answer_deferred_reads(
    state: &ServerState,
    epoch: u64,
    reads: &[(usize, bytes::Bytes)],
    frame_len: usize,
) -> Vec<(usize, Result<Reply, ErrorReply>)> {
    let now_epoch = state.ownership().map_or(0, |o| o.epoch());
    let mut room = RESPONSE_OK_BUDGET_BYTES.saturating_sub(frame_len);
    reads
        .iter()
        .map(|(at, key)| {
            if now_epoch != epoch {
                let e = ErrorReply::with_epoch(
                    ErrorCode::StaleEpoch,
                    format!(
                        "the map moved from epoch {epoch} to {now_epoch} while the read \
                         waited for the key's backups"
                    ),
                    now_epoch,
                );
                return (*at, Err(e));
            }
            let answer = match get_settled(state, key) {
                Ok(Reply::Object { version, value }) => {
                    let bytes = OBJECT_REPLY_HEADER_BYTES + value.len();
                    if bytes > room {
                        Err(ErrorReply::new(
                            ErrorCode::TooLarge,
                            "the reply does not fit in this batch's response frame; \
                             send it in a smaller batch",
                        ))
                    } else {
                        room -= bytes;
                        Ok(Reply::Object { version, value })
                    }
                }
                other => other,
            };
            (*at, answer)
        })
        .collect()
}

/// A GET as a deferred read is answered once its key has settled: the object, or
/// NO_SUCH_KEY, or — when the key holds an unacknowledged write again — not yet.
pub fn get_settled(state: &ServerState, key: &[u8]) -> Result<Reply, ErrorReply> {
    let now = Instant::now();
    let read = state.objects().read(key, now, |e| match e {
        None => Err(no_such_key()),
        Some(Entry {
            version,
            value: Value::Str(v),
            ..
        }) => Ok(Reply::Object {
            version: *version,
            value: v.clone(),
        }),
        Some(_) => Err(wrong_type()),
    });
    // Checked after the read: a write counted only after it would have been applied
    // after the read too.
    if !state.unacked().is_settled(key) {
        return Err(not_yet_replicated());
    }
    read
}

/// [`exec`], noting in `log` (when given) the writes that must be replicated.
pub fn exec_logged(
    state: &ServerState,
    who: &Principal,
    batch: &RequestBatch,
    enc: &mut ResponseBatchEncoder<'_>,
    mut log: Option<&mut WriteLog>,
) -> Result<(), EncodeError> {
    // One snapshot per batch: the ownership carries its own epoch, so a map installed
    // mid-batch cannot pair one epoch with another map's partitions.
    // Held to the end of a routed batch (see `ServerState::ownership_held`): a new
    // ownership is installed only between batches, so a fence is complete when its
    // epoch shows.
    let held = (batch.epoch != 0).then(|| state.ownership_held());
    let snapshot = match &held {
        Some(h) => (**h).clone(),
        None if log.is_some() => state.ownership(),
        None => None,
    };
    if let Some(log) = log.as_deref_mut() {
        log.clear();
        log.ownership = snapshot.clone().filter(|o| o.replicates());
    }
    // Only a connection, which can wait for the copies before answering, takes pushes.
    let mut pushes = log.is_some().then(Vec::new);
    let ownership = snapshot.as_ref().filter(|_| batch.epoch != 0);
    let epoch = ownership
        .as_ref()
        .map_or_else(|| state.epoch(), |o| o.epoch());
    if batch.epoch != 0 && batch.epoch != epoch {
        let stale = ErrorReply::with_epoch(
            ErrorCode::StaleEpoch,
            format!(
                "batch routed with epoch {} but this server is at epoch {epoch}",
                batch.epoch
            ),
            epoch,
        );
        for req in &batch.requests {
            enc.push_err(req.id, &stale)?;
        }
        state.stats().add_batch(&[0; OP_KINDS]);
        return Ok(());
    }
    let mut ops = [0u64; OP_KINDS];
    let mut ex = Exec {
        state,
        who,
        enc,
        too_large: OnceCell::new(),
        now: OnceCell::new(),
        routed: batch.epoch != 0,
        // A SCAN_PARTITIONS push names its target in this snapshot: taking the ownership
        // again while `held` is would deadlock behind a waiting `set_ownership` (the
        // lock is fair).
        map: snapshot.clone(),
        log: log.as_deref_mut().filter(|l| l.ownership.is_some()),
        pushes: pushes.as_mut(),
    };
    let res = batch.requests.iter().try_for_each(|req| {
        ops[kind_index(req.op.kind())] += 1;
        ex.one(req.id, &req.op)
    });
    state.stats().add_batch(&ops);
    if let (Some(log), Some(pushes)) = (log, pushes) {
        log.pushes = pushes;
    }
    res
}

/// The key a key-value op is placed by. SCAN is not checked: it walks whatever keys this
/// server holds from a start key, and the cluster client merges every node's answer.
/// APPLY is not placed either: a peer sends its copies to servers that are not (or not
/// yet) the key's primary — backups, a move's target.
fn op_key(op: &Op) -> Option<&[u8]> {
    match op {
        Op::Get { key } | Op::Put { key, .. } | Op::CasPut { key, .. } | Op::Delete { key } => {
            Some(key)
        }
        _ => None,
    }
}

struct Exec<'s, 'e, 'b> {
    state: &'s ServerState,
    who: &'s Principal,
    enc: &'e mut ResponseBatchEncoder<'b>,
    // Built on first use: a batch of 4096 oversized reads should not format 4096 messages.
    too_large: OnceCell<ErrorReply>,
    // Expiry is judged at one moment per batch; a clock read per object op is waste.
    now: OnceCell<Instant>,
    // The batch was routed with a non-zero epoch (equal to the server's, or it would not
    // run): then a key op on a partition this server does not own is answered MOVED,
    // unexecuted (see `Exec::routed_map`).
    routed: bool,
    // The batch's snapshot of the server's map, whatever the batch's epoch (taken on a
    // connection, which is where pushes are allowed).
    map: Option<Arc<Ownership>>,
    // Set when some partition this server is primary of has backups.
    log: Option<&'e mut WriteLog>,
    // Set when the batch came on a connection (see `WriteLog::pushes`).
    pushes: Option<&'e mut Vec<PushPage>>,
}

impl Exec<'_, '_, '_> {
    fn fits(&self, reply_bytes: usize) -> bool {
        self.enc.frame_len().saturating_add(reply_bytes) <= RESPONSE_OK_BUDGET_BYTES
    }

    fn too_large(&mut self, id: u64) -> Result<(), EncodeError> {
        let e = self.too_large.get_or_init(|| {
            ErrorReply::new(
                ErrorCode::TooLarge,
                "the reply does not fit in this batch's response frame; \
                 send it in a smaller batch",
            )
        });
        self.enc.push_err(id, e)
    }

    fn respond(&mut self, id: u64, result: Result<Reply, ErrorReply>) -> Result<(), EncodeError> {
        match result {
            Ok(reply) => match self.enc.push_ok(id, &reply) {
                Ok(()) => Ok(()),
                // Our own reply broke a wire limit: report it rather than drop the answer.
                Err(e) => self
                    .enc
                    .push_err(id, &ErrorReply::new(ErrorCode::Internal, e.to_string())),
            },
            Err(e) => self.enc.push_err(id, &e),
        }
    }

    /// The map a routed batch runs under (`None` for an unrouted one).
    fn routed_map(&self) -> Option<&Arc<Ownership>> {
        self.map.as_ref().filter(|_| self.routed)
    }

    /// The server a SCAN_PARTITIONS may push to: another server of this one's map, and
    /// only on a connection (which waits for the copies before it answers).
    fn push_target(&self, node: u32) -> Result<Peer, ErrorReply> {
        if self.pushes.is_none() {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                "a SCAN_PARTITIONS with push_to is taken only on a connection",
            ));
        }
        // Never `self.state.ownership()`: a routed batch holds the ownership lock.
        let Some(own) = self.map.as_ref() else {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                "this server follows no cluster map, so it pushes to no server",
            ));
        };
        own.peer(node).ok_or_else(|| {
            ErrorReply::new(
                ErrorCode::BadRequest,
                format!(
                    "node {node} is not another server of this server's map (epoch {})",
                    own.epoch()
                ),
            )
        })
    }

    /// For replies built before their size is known; they have no side effects to undo.
    fn respond_if_fits(&mut self, id: u64, reply: Reply) -> Result<(), EncodeError> {
        if !self.fits(reply_bytes(&reply)) {
            return self.too_large(id);
        }
        self.respond(id, Ok(reply))
    }

    /// Runs `op` only if a reply of `reply_bytes` fits, so nothing happens that the client
    /// is then told did not.
    fn guarded(
        &mut self,
        id: u64,
        reply_bytes: usize,
        op: impl FnOnce(&RegionStore, &Principal) -> Result<Reply, ErrorReply>,
    ) -> Result<(), EncodeError> {
        if !self.fits(reply_bytes) {
            return self.too_large(id);
        }
        let result = op(self.state.store(), self.who);
        self.respond(id, result)
    }

    fn now(&self) -> Instant {
        *self.now.get_or_init(Instant::now)
    }

    /// Like [`Exec::guarded`], for object operations.
    fn guarded_object(
        &mut self,
        id: u64,
        reply_bytes: usize,
        op: impl FnOnce(&ObjectStore, Instant) -> Result<Reply, ErrorReply>,
    ) -> Result<(), EncodeError> {
        if !self.fits(reply_bytes) {
            return self.too_large(id);
        }
        let now = self.now();
        let result = op(self.state.objects(), now);
        self.respond(id, result)
    }

    /// A PUT, CAS_PUT or DELETE: like [`Exec::guarded_object`], and noted for the backups
    /// when it changed something on a partition that has them.
    fn write_object(
        &mut self,
        id: u64,
        key: &bytes::Bytes,
        op: impl FnOnce(&ObjectStore, Instant) -> Result<u64, ErrorReply>,
    ) -> Result<(), EncodeError> {
        if !self.fits(WORD_REPLY_BYTES) {
            return self.too_large(id);
        }
        let replicated = self.log.as_deref().is_some_and(|log| {
            log.ownership.as_ref().is_some_and(|own| {
                let p = camelot_proto::partition_of(key, own.partitions());
                own.backups(p).next().is_some()
            })
        });
        // Claimed before it is applied, so no reader can see it unclaimed.
        let claim = if replicated {
            match self.state.unacked().begin(key) {
                Ok(w) => Some(w),
                Err(full) => {
                    let e = ErrorReply::new(ErrorCode::ReplicaUnavailable, full.to_string());
                    return self.enc.push_err(id, &e);
                }
            }
        } else {
            None
        };
        let result = op(self.state.objects(), self.now());
        if let (Some(mut claim), Some(log)) = (claim, self.log.as_deref_mut()) {
            if result.is_ok() {
                claim.applied();
                log.writes.push((self.enc.count(), key.clone()));
                log.pending.push(claim);
            }
        }
        self.respond(id, result.map(Reply::Version))
    }

    fn one(&mut self, id: u64, op: &Op) -> Result<(), EncodeError> {
        if let (Some(own), Some(key)) = (self.routed_map(), op_key(op)) {
            // A GET routed at this server's epoch to a partition it is a full backup of
            // was sent here on purpose (the client's map names this server a backup):
            // a replica read, answered from the copy, which may lag the primary.
            let replica_read = matches!(op, Op::Get { .. }) && own.serves_stale_read(key);
            if !own.owns_key(key) && !replica_read {
                let moved = ErrorReply::with_epoch(
                    ErrorCode::Moved,
                    format!(
                        "partition {} is not on this server at epoch {}",
                        camelot_proto::partition_of(key, own.partitions()),
                        own.epoch()
                    ),
                    own.epoch(),
                );
                return self.enc.push_err(id, &moved);
            }
        }
        match op {
            Op::Get { key } => self.get(id, key),
            Op::Put { key, value } => self.write_object(id, key, |o, now| o.put(key, value, now)),
            Op::CasPut {
                key,
                expected_version,
                value,
            } => self.write_object(id, key, |o, now| {
                o.cas_put(key, *expected_version, value, now)
            }),
            Op::Delete { key } => self.write_object(id, key, |o, now| o.delete(key, now)),
            Op::Apply {
                key,
                version,
                value,
            } => {
                let state = self.state;
                self.guarded_object(id, WORD_REPLY_BYTES, |o, now| {
                    let applied = o.apply(key, *version, value.as_deref(), now);
                    if applied.is_ok() {
                        state.note_applied(key, *version);
                    }
                    applied.map(Reply::Version)
                })
            }
            Op::Scan { start, limit } => {
                let budget = RESPONSE_OK_BUDGET_BYTES
                    .saturating_sub(self.enc.frame_len())
                    .saturating_sub(OK_HEADER_BYTES + 4);
                let now = self.now();
                match self
                    .state
                    .objects()
                    .scan(start, *limit as usize, budget, now)
                {
                    Ok(items) => self.respond_if_fits(id, Reply::Items(items)),
                    Err(e) => self.enc.push_err(id, &e),
                }
            }
            Op::ScanPartitions {
                after,
                limit,
                partitions,
                mask,
                since_version,
                keys_only,
                push_to,
            } => {
                let to = match push_to.map(|node| self.push_target(node)).transpose() {
                    Ok(to) => to,
                    Err(e) => return self.enc.push_err(id, &e),
                };
                let budget = RESPONSE_OK_BUDGET_BYTES
                    .saturating_sub(self.enc.frame_len())
                    .saturating_sub(PAGE_REPLY_HEADER_BYTES);
                let filter = ScanFilter {
                    partitions: *partitions,
                    mask,
                    since_version: *since_version,
                    // A pushed page needs its values, though its answer carries none.
                    keys_only: *keys_only && to.is_none(),
                };
                let now = self.now();
                match self.state.objects().scan_partitions(
                    after.as_deref(),
                    *limit as usize,
                    &filter,
                    budget,
                    now,
                ) {
                    Ok(mut page) => {
                        let push = to.filter(|_| self.pushes.is_some()).map(|to| {
                            let copies = page
                                .items
                                .iter_mut()
                                .map(|i| {
                                    page.pushed_bytes += i.value.len() as u64;
                                    Op::Apply {
                                        key: i.key.clone(),
                                        version: i.version,
                                        value: Some(std::mem::take(&mut i.value)),
                                    }
                                })
                                .collect();
                            PushPage {
                                at: self.enc.count(),
                                to,
                                epoch: self.routed_map().map_or(0, |o| o.epoch()),
                                copies,
                            }
                        });
                        let reply = Reply::Page(page);
                        // An answer that does not fit is TOO_LARGE, and a page the asker
                        // never gets must not be pushed either.
                        if !self.fits(reply_bytes(&reply)) {
                            return self.too_large(id);
                        }
                        if let (Some(push), Some(pushes)) = (push, self.pushes.as_deref_mut()) {
                            pushes.push(push);
                        }
                        self.respond(id, Ok(reply))
                    }
                    Err(e) => self.enc.push_err(id, &e),
                }
            }
            Op::Read {
                region,
                offset,
                len,
            } => self.read(id, *region, *offset, *len as usize),
            Op::Ping => self.guarded(id, OK_HEADER_BYTES, |_, _| Ok(Reply::Pong)),
            // The connection ran the fence before the batch (it must wait, and this may
            // not); the answer is the generation it left.
            Op::Fence => {
                let generation = self.state.fence_generation();
                self.guarded(id, WORD_REPLY_BYTES, |_, _| Ok(Reply::Word(generation)))
            }
            Op::Stats => {
                let reply = Reply::Stats(self.state.stats_snapshot());
                self.respond_if_fits(id, reply)
            }
            Op::List => {
                let reply = Reply::List(self.state.store().list(self.who));
                self.respond_if_fits(id, reply)
            }
            Op::Alloc { size, name, mode } => self.guarded(
                id,
                OK_HEADER_BYTES + region_info_bytes(name.as_deref()),
                |s, who| {
                    s.alloc(who, *size, name.clone(), *mode)
                        .map(|r| Reply::Region(r.info()))
                },
            ),
            Op::Lookup { name } => self.guarded(
                id,
                OK_HEADER_BYTES + region_info_bytes(Some(name)),
                |s, who| s.lookup(who, name).map(|r| Reply::Region(r.info())),
            ),
            Op::Free { region } => self.guarded(id, OK_HEADER_BYTES, |s, who| {
                s.free(who, *region).map(|()| Reply::Done)
            }),
            Op::Write {
                region,
                offset,
                data,
            } => self.guarded(id, OK_HEADER_BYTES, |s, who| {
                s.write(who, *region, *offset, data).map(|()| Reply::Done)
            }),
            Op::Swap {
                region,
                offset,
                data,
            } => self.swap(id, *region, *offset, data),
            Op::XorInto {
                region,
                offset,
                data,
            } => self.guarded(id, OK_HEADER_BYTES, |s, who| {
                s.xor_into(who, *region, *offset, data)
                    .map(|()| Reply::Done)
            }),
            Op::WriteIf {
                region,
                offset,
                guard_region,
                guard_offset,
                expected,
                data,
            } => self.guarded(id, WORD_REPLY_BYTES, |s, who| {
                s.write_if(
                    who,
                    *region,
                    *offset,
                    data,
                    *guard_region,
                    *guard_offset,
                    *expected,
                )
                .map(Reply::Word)
            }),
            Op::Cas {
                region,
                offset,
                expected,
                new,
            } => self.guarded(id, WORD_REPLY_BYTES, |s, who| {
                s.cas(who, *region, *offset, *expected, *new)
                    .map(Reply::Word)
            }),
            Op::FetchAdd {
                region,
                offset,
                delta,
            } => self.guarded(id, WORD_REPLY_BYTES, |s, who| {
                s.fetch_add(who, *region, *offset, *delta).map(Reply::Word)
            }),
        }
    }

    /// Copies the value into the frame under the shard's read lock: cloning its handle
    /// instead would bounce the reference count between cores on every GET of a hot key.
    fn get(&mut self, id: u64, key: &[u8]) -> Result<(), EncodeError> {
        if self.log.is_some() {
            return self.get_on_primary(id, key);
        }
        let now = self.now();
        let state = self.state;
        state.objects().read(key, now, |e| match e {
            None => self.enc.push_err(id, &no_such_key()),
            Some(Entry {
                version,
                value: Value::Str(v),
                ..
            }) => {
                if !self.fits(OBJECT_REPLY_HEADER_BYTES + v.len()) {
                    return self.too_large(id);
                }
                self.enc.push_object(id, *version, v)
            }
            Some(_) => self.enc.push_err(id, &wrong_type()),
        })
    }

    /// A GET on a server whose writes are replicated: answered only from a state every
    /// backup has; otherwise deferred (see [`WriteLog::deferred_reads`]).
    fn get_on_primary(&mut self, id: u64, key: &[u8]) -> Result<(), EncodeError> {
        let result = get_settled(self.state, key);
        if let (Err(e), Some(log)) = (&result, self.log.as_deref_mut()) {
            if e.code == ErrorCode::ReplicaUnavailable {
                log.deferred_reads
                    .push((self.enc.count(), bytes::Bytes::copy_from_slice(key)));
                return self.enc.push_err(id, e);
            }
        }
        match result {
            Ok(Reply::Object { version, value }) => {
                if !self.fits(OBJECT_REPLY_HEADER_BYTES + value.len()) {
                    return self.too_large(id);
                }
                self.enc.push_object(id, version, &value)
            }
            Ok(other) => self.respond(id, Ok(other)),
            Err(e) => self.enc.push_err(id, &e),
        }
    }

    fn read(
        &mut self,
        id: u64,
        region: RegionId,
        offset: u64,
        len: usize,
    ) -> Result<(), EncodeError> {
        if len > IO_BYTES_MAX {
            let e = ErrorReply::new(
                ErrorCode::TooLarge,
                format!("read of {len} bytes exceeds the limit of {IO_BYTES_MAX}"),
            );
            return self.enc.push_err(id, &e);
        }
        let checked = self.state.store().get(self.who, region).and_then(|r| {
            let range = r.range(offset, len as u64)?;
            Ok((r, range))
        });
        let (r, range) = match checked {
            Ok(x) => x,
            Err(e) => return self.enc.push_err(id, &e),
        };
        if !self.fits(DATA_REPLY_HEADER_BYTES + len) {
            return self.too_large(id);
        }
        // Straight from the region into the frame: one copy, no zero-filled room first.
        r.with_range(range, |src| self.enc.push_data(id, src))
    }

    /// Like `read`, but the bytes are replaced by `data` in the same step; nothing is
    /// written unless the old bytes' reply fits.
    fn swap(
        &mut self,
        id: u64,
        region: RegionId,
        offset: u64,
        data: &[u8],
    ) -> Result<(), EncodeError> {
        if data.len() > IO_BYTES_MAX {
            let e = ErrorReply::new(
                ErrorCode::TooLarge,
                format!(
                    "swap of {} bytes exceeds the limit of {IO_BYTES_MAX}",
                    data.len()
                ),
            );
            return self.enc.push_err(id, &e);
        }
        let checked = self.state.store().get(self.who, region).and_then(|r| {
            let range = r.range(offset, data.len() as u64)?;
            Ok((r, range))
        });
        let (r, range) = match checked {
            Ok(x) => x,
            Err(e) => return self.enc.push_err(id, &e),
        };
        if !self.fits(DATA_REPLY_HEADER_BYTES + data.len()) {
            return self.too_large(id);
        }
        self.enc
            .push_data_with(id, data.len(), |dst| r.swap_range(range, data, dst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;
    use bytes::{Bytes, BytesMut};
    use camelot_proto::limits::{BATCH_OPS_MAX, FRAME_BYTES_MAX, REGION_PAGE_BYTES};
    use camelot_proto::{
        decode_frame, AccessMode, Frame, FrameDecoder, OpKind, RegionInfo, Request, Response,
        RESPONSES_HEADER_BYTES,
    };

    const ME: &str = "me";

    fn state(cap_bytes: u64) -> ServerState {
        ServerState::new(MemoryBudget::new(cap_bytes), 0)
    }

    /// Runs `batch` as [`ME`] and decodes the frame a client would receive.
    fn run(st: &ServerState, epoch: u64, ops: Vec<Op>) -> Vec<Response> {
        run_as(st, ME, epoch, ops)
    }

    fn run_as(st: &ServerState, who: &str, epoch: u64, ops: Vec<Op>) -> Vec<Response> {
        let batch = RequestBatch {
            epoch,
            requests: ops
                .into_iter()
                .enumerate()
                .map(|(i, op)| Request {
                    id: 1000 + i as u64,
                    op,
                })
                .collect(),
        };
        let mut buf = BytesMut::new();
        let mut enc = ResponseBatchEncoder::begin(&mut buf);
        exec(st, &Principal::from(who), &batch, &mut enc).unwrap();
        enc.finish().unwrap();
        assert!(
            buf.len() <= 4 + FRAME_BYTES_MAX,
            "frame of {} bytes",
            buf.len()
        );
        let body = FrameDecoder::split_frame(&mut buf).unwrap().unwrap();
        assert!(buf.is_empty());
        let Frame::Responses(r) = decode_frame(body).unwrap() else {
            panic!("not a RESPONSES frame")
        };
        assert_eq!(r.responses.len(), batch.requests.len());
        for (resp, req) in r.responses.iter().zip(&batch.requests) {
            assert_eq!(resp.id, req.id, "responses out of order");
        }
        r.responses
    }

    fn code(r: &Response) -> ErrorCode {
        r.result.as_ref().unwrap_err().code
    }

    fn alloc(st: &ServerState, size: u64) -> RegionId {
        let r = run(
            st,
            0,
            vec![Op::Alloc {
                size,
                name: None,
                mode: AccessMode::Private,
            }],
        );
        match &r[0].result {
            Ok(Reply::Region(info)) => info.id,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reply_bytes_matches_the_encoder() {
        let replies = [
            Reply::Pong,
            Reply::Done,
            Reply::Word(5),
            Reply::Data(Bytes::from_static(b"hello")),
            Reply::Region(RegionInfo {
                id: 1,
                size: 2,
                name: Some("abc".into()),
                mode: AccessMode::Shared,
            }),
            Reply::Region(RegionInfo {
                id: 1,
                size: 2,
                name: None,
                mode: AccessMode::Private,
            }),
            Reply::Stats(vec![("a".into(), 1), ("bcd".into(), 2)]),
            Reply::List(vec![
                RegionInfo {
                    id: 1,
                    size: 2,
                    name: Some("xy".into()),
                    mode: AccessMode::Private,
                },
                RegionInfo {
                    id: 3,
                    size: 4,
                    name: None,
                    mode: AccessMode::Private,
                },
            ]),
            Reply::Page(camelot_proto::Page {
                items: vec![camelot_proto::Item {
                    key: Bytes::from_static(b"key"),
                    version: 9,
                    value: Bytes::from_static(b"value"),
                }],
                resume_after: Some(Bytes::from_static(b"key")),
                version_clock: 12,
                pushed_bytes: 0,
            }),
            Reply::Page(camelot_proto::Page {
                items: vec![],
                resume_after: None,
                version_clock: 0,
                pushed_bytes: 8,
            }),
        ];
        for reply in replies {
            let mut buf = BytesMut::new();
            let mut enc = ResponseBatchEncoder::begin(&mut buf);
            let before = enc.frame_len();
            enc.push_ok(7, &reply).unwrap();
            assert_eq!(enc.frame_len() - before, reply_bytes(&reply), "{reply:?}");
        }
    }

    #[test]
    fn every_op_answers_in_order() {
        let st = state(1 << 20);
        let r = run(
            &st,
            0,
            vec![
                Op::Ping,
                Op::Alloc {
                    size: 100,
                    name: Some("t".into()),
                    mode: AccessMode::Private,
                },
            ],
        );
        let Ok(Reply::Region(info)) = &r[1].result else {
            panic!("{:?}", r[1])
        };
        let id = info.id;
        let r = [
            r.to_vec(),
            run(
                &st,
                0,
                vec![
                    Op::Lookup { name: "t".into() },
                    Op::Write {
                        region: id,
                        offset: 8,
                        data: Bytes::from_static(&[9, 0, 0, 0, 0, 0, 0, 0]),
                    },
                    Op::Read {
                        region: id,
                        offset: 8,
                        len: 8,
                    },
                    Op::Cas {
                        region: id,
                        offset: 8,
                        expected: 9,
                        new: 10,
                    },
                    Op::FetchAdd {
                        region: id,
                        offset: 8,
                        delta: 5,
                    },
                    Op::List,
                    Op::Free { region: id },
                    Op::Read {
                        region: id,
                        offset: 0,
                        len: 1,
                    },
                    Op::Stats,
                ],
            ),
        ]
        .concat();
        let info = RegionInfo {
            id,
            size: REGION_PAGE_BYTES,
            name: Some("t".into()),
            mode: AccessMode::Private,
        };
        assert_eq!(r[0].result, Ok(Reply::Pong));
        assert_eq!(r[1].result, Ok(Reply::Region(info.clone())));
        assert_eq!(r[2].result, Ok(Reply::Region(info.clone())));
        assert_eq!(r[3].result, Ok(Reply::Done));
        assert_eq!(
            r[4].result,
            Ok(Reply::Data(Bytes::from_static(&[9, 0, 0, 0, 0, 0, 0, 0])))
        );
        assert_eq!(r[5].result, Ok(Reply::Word(9)));
        assert_eq!(r[6].result, Ok(Reply::Word(10)));
        assert_eq!(r[7].result, Ok(Reply::List(vec![info])));
        assert_eq!(r[8].result, Ok(Reply::Done));
        assert_eq!(code(&r[9]), ErrorCode::NoSuchRegion);
        let Ok(Reply::Stats(stats)) = &r[10].result else {
            panic!("{:?}", r[10])
        };
        let get = |k: &str| stats.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        for kind in OpKind::ALL {
            assert!(get(&format!("ops_{}", kind.name())).is_some(), "{kind:?}");
        }
        for k in [
            "memory_used_bytes",
            "memory_cap_bytes",
            "regions",
            "connections_current",
            "connections_total",
            "batches",
            "bytes_in",
            "bytes_out",
        ] {
            assert!(get(k).is_some(), "{k}");
        }
        assert_eq!(get("memory_used_bytes"), Some(0));
        assert_eq!(get("regions"), Some(0));
        // Counted once the batch is done.
        assert_eq!(st.stats().ops(OpKind::Read), 2);
        assert_eq!(st.stats().ops(OpKind::Stats), 1);
    }

    #[test]
    fn swap_answers_the_replaced_bytes_and_xor_into_applies_in_batch_order() {
        let st = state(1 << 20);
        let id = alloc(&st, 4096);
        let op = |kind: fn(RegionId, u64, Bytes) -> Op, at: u64, d: &'static [u8]| {
            kind(id, at, Bytes::from_static(d))
        };
        let swap = |region, offset, data| Op::Swap {
            region,
            offset,
            data,
        };
        let xor = |region, offset, data| Op::XorInto {
            region,
            offset,
            data,
        };
        let r = run(
            &st,
            0,
            vec![
                op(swap, 0, b"abc"),
                op(swap, 0, b"def"),
                op(xor, 1, b"\x01\x01"),
                op(swap, 0, b"ghi"),
                op(swap, 4094, b"xyz"),
                op(xor, 4095, b"xy"),
            ],
        );
        assert_eq!(r[0].result, Ok(Reply::Data(Bytes::from_static(&[0; 3]))));
        assert_eq!(r[1].result, Ok(Reply::Data(Bytes::from_static(b"abc"))));
        assert_eq!(r[2].result, Ok(Reply::Done));
        assert_eq!(r[3].result, Ok(Reply::Data(Bytes::from_static(b"ddg"))));
        assert_eq!(code(&r[4]), ErrorCode::OutOfBounds);
        assert_eq!(code(&r[5]), ErrorCode::OutOfBounds);
        assert_eq!(st.stats().ops(OpKind::Swap), 4);
        assert_eq!(st.stats().ops(OpKind::XorInto), 2);
    }

    #[test]
    fn reads_past_the_frame_budget_get_too_large() {
        let big = IO_BYTES_MAX as u32;
        let st = state(1 << 30);
        let id = alloc(&st, big as u64);
        let read = |len| Op::Read {
            region: id,
            offset: 0,
            len,
        };
        let r = run(
            &st,
            0,
            vec![read(big), read(big), read(big), read(8), Op::Ping],
        );
        assert!(matches!(&r[0].result, Ok(Reply::Data(d)) if d.len() == big as usize));
        assert_eq!(code(&r[1]), ErrorCode::TooLarge);
        assert_eq!(code(&r[2]), ErrorCode::TooLarge);
        assert!(matches!(&r[3].result, Ok(Reply::Data(d)) if d.len() == 8));
        assert_eq!(r[4].result, Ok(Reply::Pong));
    }

    #[test]
    fn a_full_batch_of_reads_never_overflows_the_frame() {
        // 4096 reads of 16 KiB ask for 64 MiB of data: more than a frame holds.
        let len = 16 << 10;
        let st = state(1 << 20);
        let id = alloc(&st, len as u64);
        st.store().write(ME, id, 0, &[0xAB; 16 << 10]).unwrap();
        let ops = (0..BATCH_OPS_MAX)
            .map(|_| Op::Read {
                region: id,
                offset: 0,
                len,
            })
            .collect();
        let r = run(&st, 0, ops);
        let ok = r.iter().filter(|x| x.result.is_ok()).count();
        let refused = r.iter().filter(|x| code_is(x, ErrorCode::TooLarge)).count();
        assert!(ok > 3000, "only {ok} reads fit");
        assert_eq!(ok + refused, BATCH_OPS_MAX);
        // The successful ones come first and carry the right bytes.
        assert!(r[..ok].iter().all(
            |x| matches!(&x.result, Ok(Reply::Data(d)) if d.len() == len as usize && d.iter().all(|&b| b == 0xAB))
        ));
    }

    fn code_is(r: &Response, c: ErrorCode) -> bool {
        matches!(&r.result, Err(e) if e.code == c)
    }

    #[test]
    fn side_effects_are_skipped_when_the_reply_cannot_fit() {
        let st = state(1 << 30);
        let id = alloc(&st, IO_BYTES_MAX as u64);
        let read = |len: usize| Op::Read {
            region: id,
            offset: 0,
            len: len as u32,
        };
        // Two reads that fill the ok-budget to the last byte.
        let first = IO_BYTES_MAX;
        let second =
            RESPONSE_OK_BUDGET_BYTES - RESPONSES_HEADER_BYTES - 2 * DATA_REPLY_HEADER_BYTES - first;
        let r = run(
            &st,
            0,
            vec![
                read(first),
                read(second),
                Op::FetchAdd {
                    region: id,
                    offset: 0,
                    delta: 1,
                },
                Op::Write {
                    region: id,
                    offset: 8,
                    data: Bytes::from_static(b"x"),
                },
                Op::Swap {
                    region: id,
                    offset: 9,
                    data: Bytes::from_static(b"y"),
                },
                Op::XorInto {
                    region: id,
                    offset: 10,
                    data: Bytes::from_static(b"z"),
                },
                Op::Alloc {
                    size: 1,
                    name: None,
                    mode: AccessMode::Private,
                },
                Op::Free { region: id },
                Op::Ping,
                read(0),
            ],
        );
        assert!(r[0].result.is_ok() && r[1].result.is_ok());
        assert!(
            r[2..].iter().all(|x| code_is(x, ErrorCode::TooLarge)),
            "{:?}",
            &r[2..]
        );
        assert_eq!(st.store().fetch_add(ME, id, 0, 0).unwrap(), 0);
        let mut b = [0u8; 3];
        st.store().read(ME, id, 8, &mut b).unwrap();
        assert_eq!(b, [0; 3]);
        assert_eq!(st.store().len(), 1);

        // Leave exactly a word reply's room: the FETCH_ADD runs, the PING after it cannot.
        let r = run(
            &st,
            0,
            vec![
                read(first),
                read(second - WORD_REPLY_BYTES),
                Op::FetchAdd {
                    region: id,
                    offset: 0,
                    delta: 1,
                },
                Op::Ping,
            ],
        );
        assert_eq!(r[2].result, Ok(Reply::Word(0)));
        assert!(code_is(&r[3], ErrorCode::TooLarge));
        assert_eq!(st.store().fetch_add(ME, id, 0, 0).unwrap(), 1);
    }

    #[test]
    fn stale_epoch_refuses_the_whole_batch() {
        let st = ServerState::new(MemoryBudget::new(1 << 20), 5);
        let r = run(
            &st,
            4,
            vec![
                Op::Ping,
                Op::Alloc {
                    size: 1,
                    name: None,
                    mode: AccessMode::Private,
                },
            ],
        );
        assert!(r.iter().all(|x| code_is(x, ErrorCode::StaleEpoch)));
        assert_eq!(st.store().len(), 0, "a stale ALLOC must not run");
        assert_eq!(run(&st, 5, vec![Op::Ping])[0].result, Ok(Reply::Pong));
        assert_eq!(run(&st, 0, vec![Op::Ping])[0].result, Ok(Reply::Pong));
        st.set_epoch(6);
        assert!(code_is(
            &run(&st, 5, vec![Op::Ping])[0],
            ErrorCode::StaleEpoch
        ));
    }

    fn err_of(r: &Response) -> &ErrorReply {
        r.result.as_ref().expect_err("an error")
    }

    #[test]
    fn key_ops_on_partitions_not_owned_are_moved_unexecuted() {
        let st = ServerState::new(MemoryBudget::new(1 << 20), 0);
        // "user1" is partition 726 of 1024 (pinned in proto's tests); own only that one.
        let mut owned = vec![false; 1024];
        owned[726] = true;
        assert!(st.set_ownership(Ownership::new(7, owned.clone()).unwrap()));
        assert_eq!(st.epoch(), 7);
        let put = |k: &str| Op::Put {
            key: Bytes::copy_from_slice(k.as_bytes()),
            value: Bytes::from_static(b"v"),
        };
        let r = run(&st, 7, vec![put("user1"), put("user2"), Op::Ping]);
        assert!(r[0].result.is_ok(), "{:?}", r[0]);
        assert_eq!(err_of(&r[1]).code, ErrorCode::Moved);
        assert_eq!(err_of(&r[1]).epoch, 7);
        assert_eq!(r[2].result, Ok(Reply::Pong), "non-key ops are not placed");
        assert!(
            st.objects().get(b"user2", Instant::now()).is_err(),
            "a MOVED put must not run"
        );
        // Another epoch: the whole batch is STALE_EPOCH, carrying the server's epoch.
        let r = run(&st, 6, vec![put("user1")]);
        assert_eq!(err_of(&r[0]).code, ErrorCode::StaleEpoch);
        assert_eq!(err_of(&r[0]).epoch, 7);
        let r = run(&st, 8, vec![put("user1")]);
        assert_eq!(err_of(&r[0]).epoch, 7);
        // Epoch 0 is "no cluster": served as before, ownership unchecked.
        assert!(run(&st, 0, vec![put("user2")])[0].result.is_ok());
        // An older map never replaces a newer one.
        assert!(!st.set_ownership(Ownership::new(6, owned).unwrap()));
        assert_eq!(st.epoch(), 7);
    }

    #[test]
    fn writes_on_partitions_with_backups_are_logged_and_backups_answer_moved() {
        use crate::ownership::Role;
        let st = ServerState::new(MemoryBudget::new(1 << 20), 0);
        // Primary of 726 ("user1") with one backup; backup of "user2"'s partition.
        let p2 = camelot_proto::partition_of(b"user2", 1024) as usize;
        let mut owned = vec![false; 1024];
        owned[726] = true;
        let mut backups = vec![vec![]; 1024];
        backups[726] = vec![Peer {
            id: 9,
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], 9)),
        }];
        let mut backup_of = vec![false; 1024];
        backup_of[p2] = true;
        let own = Ownership::new(4, owned)
            .unwrap()
            .with_replicas(backups, backup_of)
            .unwrap();
        assert_eq!(own.role(p2 as u32), Role::Backup);
        assert!(st.set_ownership(own));
        let key = |k: &'static str| Bytes::from_static(k.as_bytes());
        let ops = [
            Op::Put {
                key: key("user1"),
                value: key("v"),
            },
            Op::Get { key: key("user1") },
            Op::Put {
                key: key("user2"),
                value: key("v"),
            },
            Op::Delete {
                key: key("nothing"),
            },
            Op::CasPut {
                key: key("user1"),
                expected_version: 999,
                value: key("w"),
            },
            Op::Delete { key: key("user1") },
        ];
        for epoch in [4, 0] {
            let batch = RequestBatch {
                epoch,
                requests: ops
                    .iter()
                    .enumerate()
                    .map(|(i, op)| Request {
                        id: i as u64,
                        op: op.clone(),
                    })
                    .collect(),
            };
            let mut buf = BytesMut::new();
            let mut enc = ResponseBatchEncoder::begin(&mut buf);
            let mut log = WriteLog::default();
            exec_logged(&st, &Principal::from(ME), &batch, &mut enc, Some(&mut log)).unwrap();
            enc.finish().unwrap();
            let Frame::Responses(r) = decode_frame(buf.freeze().slice(4..)).unwrap() else {
                panic!()
            };
            let positions: Vec<usize> = log.writes.iter().map(|(at, _)| *at).collect();
            if epoch == 4 {
                // The backup's partition is MOVED (unexecuted, unlogged); the miss and the
                // CAS conflict changed nothing; the PUT and the DELETE on 726 are logged.
                assert_eq!(err_of(&r.responses[2]).code, ErrorCode::Moved);
                assert_eq!(positions, [0, 5]);
            } else {
                // Unrouted: not MOVED, but the write on the replicated partition is
                // still logged (it must reach the backup all the same).
                assert!(r.responses[2].result.is_ok());
                assert_eq!(positions, [0, 5]);
            }
            assert!(log.ownership.is_some());
        }
        // Without backups nothing is logged.
        let lone = Ownership::new(5, vec![true; 1024]).unwrap();
        assert!(st.set_ownership(lone));
        let batch = RequestBatch {
            epoch: 5,
            requests: vec![Request {
                id: 1,
                op: ops[0].clone(),
            }],
        };
        let mut buf = BytesMut::new();
        let mut enc = ResponseBatchEncoder::begin(&mut buf);
        let mut log = WriteLog::default();
        exec_logged(&st, &Principal::from(ME), &batch, &mut enc, Some(&mut log)).unwrap();
        assert!(log.writes.is_empty() && log.ownership.is_none());
    }

    #[test]
    fn errors_carry_their_codes() {
        let st = state(REGION_PAGE_BYTES);
        let id = alloc(&st, 1);
        let r = run(
            &st,
            0,
            vec![
                Op::Alloc {
                    size: 1,
                    name: None,
                    mode: AccessMode::Private,
                },
                Op::Alloc {
                    size: 0,
                    name: None,
                    mode: AccessMode::Private,
                },
                Op::Cas {
                    region: id,
                    offset: 3,
                    expected: 0,
                    new: 1,
                },
                Op::Read {
                    region: id,
                    offset: u64::MAX,
                    len: 2,
                },
                Op::Lookup {
                    name: "missing".into(),
                },
                Op::Free { region: 999 },
                Op::Read {
                    region: id,
                    offset: 0,
                    len: IO_BYTES_MAX as u32 + 1,
                },
            ],
        );
        let codes: Vec<_> = r.iter().map(code).collect();
        assert_eq!(
            codes,
            vec![
                ErrorCode::OutOfMemory,
                ErrorCode::BadRequest,
                ErrorCode::Unaligned,
                ErrorCode::OutOfBounds,
                ErrorCode::NameNotFound,
                ErrorCode::NoSuchRegion,
                ErrorCode::TooLarge,
            ]
        );
    }
}
