//! MULTI, EXEC, DISCARD, WATCH, UNWATCH, with Redis's semantics and error texts.
//!
//! Between MULTI and EXEC a connection's commands are checked (name, arity, AUTH) and
//! queued, answering QUEUED; a command that fails those checks, or one past the queue's
//! limits, answers its error and makes EXEC answer EXECABORT. EXEC runs the queue under
//! [`ObjectStore::exclusive`](crate::objects::ObjectStore::exclusive): no other command of
//! any connection, on either port, runs in between. WATCH records each key's version (the
//! object store bumps it on every change, and a removed or expired key has none); EXEC
//! first compares them and answers a nil array, running nothing, if any moved.

use super::{Call, Reply};
use crate::budget::{MemoryBudget, Reservation};
use bytes::Bytes;
use camelot_proto::limits::KEY_BYTES_MAX;
use std::sync::Arc;
use std::time::Instant;

/// Most commands one MULTI may queue.
pub const QUEUED_COMMANDS_MAX: usize = 8_192;
/// Most bytes of arguments one MULTI may queue (an RVM truncation batch is at most
/// 1,024 page writes of 4 KiB).
pub const QUEUED_BYTES_MAX: usize = 32 << 20;
/// Most keys one connection may WATCH at once.
pub const WATCHED_KEYS_MAX: usize = 1_024;

/// What a connection has queued since MULTI.
#[derive(Debug, Default)]
pub struct Queue {
    commands: Vec<Vec<Bytes>>,
    bytes: usize,
    /// The queued arguments' bytes, charged to the server's connection-buffer budget
    /// (one reservation per command) until EXEC, DISCARD or the connection's end.
    held: Vec<Reservation>,
    /// A command was refused while queuing: EXEC answers EXECABORT.
    aborted: bool,
}

/// Per-connection transaction state.
#[derive(Debug, Default)]
pub struct TxState {
    /// Set between MULTI and EXEC/DISCARD.
    pub(super) queue: Option<Queue>,
    /// WATCHed keys with the version each had then (`None`: no such key).
    watched: Vec<(Bytes, Option<u64>)>,
}

impl TxState {
    pub(super) fn in_multi(&self) -> bool {
        self.queue.is_some()
    }

    /// A command refused while queuing (its error already answered).
    pub(super) fn flag_error(&mut self) {
        if let Some(q) = &mut self.queue {
            q.aborted = true;
        }
    }

    /// Queues a checked command; `Err` is the error to answer (the queue is then
    /// dropped, keeping only the abort).
    pub(super) fn enqueue(
        &mut self,
        args: &[&[u8]],
        budget: &Arc<MemoryBudget>,
    ) -> Result<(), String> {
        let Some(q) = &mut self.queue else {
            return Err("ERR queueing outside MULTI".into());
        };
        let bytes: usize = args.iter().map(|a| a.len()).sum();
        if q.aborted {
            // Nothing will run; keep no memory for it.
            return Ok(());
        }
        if q.commands.len() >= QUEUED_COMMANDS_MAX || q.bytes + bytes > QUEUED_BYTES_MAX {
            *q = Queue {
                aborted: true,
                ..Queue::default()
            };
            return Err(format!(
                "ERR transaction too large: at most {QUEUED_COMMANDS_MAX} commands and \
                 {QUEUED_BYTES_MAX} bytes of arguments may be queued"
            ));
        }
        let held = match budget.try_reserve(bytes as u64) {
            Ok(r) => r,
            Err(e) => {
                *q = Queue {
                    aborted: true,
                    ..Queue::default()
                };
                return Err(format!("ERR connection buffer memory exhausted: {e}"));
            }
        };
        q.held.push(held);
        q.bytes += bytes;
        q.commands
            .push(args.iter().map(|a| Bytes::copy_from_slice(a)).collect());
        Ok(())
    }
}

pub(super) fn multi(c: &mut Call<'_>) {
    if c.session.tx.in_multi() {
        c.error("ERR MULTI calls can not be nested");
        return;
    }
    c.session.tx.queue = Some(Queue::default());
    c.out.simple("OK");
}

pub(super) fn discard(c: &mut Call<'_>) {
    if c.session.tx.queue.take().is_none() {
        c.error("ERR DISCARD without MULTI");
        return;
    }
    c.session.tx.watched.clear();
    c.out.simple("OK");
}

pub(super) fn watch(c: &mut Call<'_>) {
    if c.session.tx.in_multi() {
        c.error("ERR WATCH inside MULTI is not allowed");
        return;
    }
    // A key longer than any key can be is never written, so watching it watches nothing:
    // it is not kept (kept, it would be memory per connection that no budget counts).
    let watchable = |k: &&&[u8]| k.len() <= KEY_BYTES_MAX;
    let new = c.args[1..]
        .iter()
        .filter(watchable)
        .filter(|k| !c.session.tx.watched.iter().any(|(w, _)| w == *k))
        .count();
    if c.session.tx.watched.len() + new > WATCHED_KEYS_MAX {
        c.error(&format!(
            "ERR too many watched keys: at most {WATCHED_KEYS_MAX} per connection"
        ));
        return;
    }
    for key in c.args[1..].iter().filter(watchable) {
        if c.session.tx.watched.iter().any(|(w, _)| w == key) {
            continue;
        }
        let version = c.objects().read(key, c.now, |e| e.map(|e| e.version));
        c.session
            .tx
            .watched
            .push((Bytes::copy_from_slice(key), version));
    }
    c.out.simple("OK");
}

pub(super) fn unwatch(c: &mut Call<'_>) {
    c.session.tx.watched.clear();
    c.out.simple("OK");
}

pub(super) fn exec(c: &mut Call<'_>) {
    let Some(queue) = c.session.tx.queue.take() else {
        c.error("ERR EXEC without MULTI");
        return;
    };
    let watched = std::mem::take(&mut c.session.tx.watched);
    if queue.aborted {
        c.error("EXECABORT Transaction discarded because of previous errors.");
        return;
    }
    let ctx = c.ctx;
    let now = c.now;
    let session = &mut *c.session;
    let out: &mut Reply<'_> = c.out;
    let objects = ctx.state.objects();
    objects.exclusive(|| {
        if watched_moved(objects, &watched, now) {
            out.null_array();
            return;
        }
        out.array_header(queue.commands.len());
        for command in &queue.commands {
            let args: Vec<&[u8]> = command.iter().map(|a| &a[..]).collect();
            super::run(ctx, session, &args, now, out);
        }
    });
}

fn watched_moved(
    objects: &crate::objects::ObjectStore,
    watched: &[(Bytes, Option<u64>)],
    now: Instant,
) -> bool {
    watched
        .iter()
        .any(|(key, version)| objects.read(key, now, |e| e.map(|e| e.version)) != *version)
}
