//! One request's answer slot, waited on by a blocking thread or awaited by a task.

use crate::ClientError;
use camelot_proto::Reply;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

enum State {
    Waiting(Option<Waker>),
    Done(Result<Reply, ClientError>),
    Taken,
}

/// Told of a request's answer as it is stored, before whoever awaits the request can see
/// it, on whichever thread stores it (the connection's reader, or whoever fails it).
/// For a caller that must act on answers in the order they come (one connection's
/// answers come in its requests' order) without a task awaiting each: the proxy marks
/// its mutations applied this way. Keep it short and never block in it.
pub trait AnswerHook: Send + Sync {
    /// `tag` is what the request was submitted with.
    fn answered(&self, tag: u64, answer: &Result<Reply, ClientError>);
}

pub(crate) struct Completion {
    state: Mutex<State>,
    hook: Option<(Arc<dyn AnswerHook>, u64)>,
    /// Set once an answer is stored, so "is it in yet?" — asked for every answer a
    /// waiter sweeps up, and in the reading loop — needs no lock.
    answered: AtomicBool,
    // parking_lot's notify does no syscall when nobody waits, which is the common case:
    // a batch of 256 answers completes 256 slots, and only the waiter's own slot blocks.
    ready: Condvar,
}

impl Completion {
    pub(crate) fn new() -> Arc<Completion> {
        Self::build(None)
    }

    /// A slot whose answer `hook` is told of, with `tag`, as it is stored.
    pub(crate) fn hooked(hook: Arc<dyn AnswerHook>, tag: u64) -> Arc<Completion> {
        Self::build(Some((hook, tag)))
    }

    fn build(hook: Option<(Arc<dyn AnswerHook>, u64)>) -> Arc<Completion> {
        Arc::new(Completion {
            state: Mutex::new(State::Waiting(None)),
            hook,
            answered: AtomicBool::new(false),
            ready: Condvar::new(),
        })
    }

    pub(crate) fn is_done(&self) -> bool {
        self.answered.load(Ordering::Acquire)
    }

    /// The answer if it is in; otherwise `cx`'s waker is kept to be woken with it.
    pub(crate) fn poll_answer(&self, cx: &mut Context<'_>) -> Poll<Result<Reply, ClientError>> {
        let mut st = self.state.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Done(r) => Poll::Ready(r),
            State::Taken => Poll::Ready(Err(ClientError::AlreadyTaken)),
            State::Waiting(w) => {
                // Keep the old waker when it would wake the same task: cloning one is not free.
                let waker = match w {
                    Some(w) if w.will_wake(cx.waker()) => w,
                    _ => cx.waker().clone(),
                };
                *st = State::Waiting(Some(waker));
                Poll::Pending
            }
        }
    }

    pub(crate) fn complete(&self, result: Result<Reply, ClientError>) {
        let waker = self.fill(result);
        self.wake(waker);
    }

    /// Stores the answer without waking anyone; the caller then calls [`Completion::wake`]
    /// with what this returns. Splitting the two lets a whole answer frame be stored
    /// before the first waiter runs, so a thread woken for its oldest answer finds the
    /// rest of that frame's answers already in and does not block again for each.
    pub(crate) fn fill(&self, result: Result<Reply, ClientError>) -> Option<Waker> {
        let mut st = self.state.lock();
        if let (State::Waiting(_), Some((hook, tag))) = (&*st, &self.hook) {
            // Under the slot's lock: nobody can take the answer before the hook saw it.
            hook.answered(*tag, &result);
        }
        match std::mem::replace(&mut *st, State::Done(result)) {
            State::Waiting(w) => {
                self.answered.store(true, Ordering::Release);
                w
            }
            // Completed twice (a failed submit's slot, by its error and again by the
            // submit's drop guard): keep the first answer.
            old => {
                *st = old;
                None
            }
        }
    }

    /// The answer if it is in. Otherwise, with `block`, sleeps until the answer is stored
    /// or `deadline` passes; without, returns at once so the caller can read the socket
    /// itself first.
    pub(crate) fn take_or_wait(&self, block: bool, deadline: Instant) -> Waited {
        let mut st = self.state.lock();
        match std::mem::replace(&mut *st, State::Taken) {
            State::Done(r) => Waited::Answer(r),
            State::Taken => Waited::Answer(Err(ClientError::AlreadyTaken)),
            waiting @ State::Waiting(_) => {
                *st = waiting;
                if !block {
                    return Waited::Pending;
                }
                let timed_out = self.ready.wait_until(&mut st, deadline).timed_out();
                if let State::Done(r) = std::mem::replace(&mut *st, State::Taken) {
                    return Waited::Answer(r);
                }
                *st = State::Waiting(None);
                if timed_out {
                    Waited::TimedOut
                } else {
                    Waited::Pending
                }
            }
        }
    }

    /// Wakes whoever waits on this slot (a blocked thread, and `waker`'s task if any).
    pub(crate) fn wake(&self, waker: Option<Waker>) {
        self.ready.notify_one();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// What a blocking waiter found in its slot.
pub(crate) enum Waited {
    Answer(Result<Reply, ClientError>),
    /// Not in yet (woken early, or asked not to block).
    Pending,
    TimedOut,
}
