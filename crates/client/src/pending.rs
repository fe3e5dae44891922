//! The handle a submitter holds for one request: block on it, or `.await` it. A blocking
//! waiter may read its connection itself (leader/follower), so this sits above both the
//! answer slot and the connection.

use crate::completion::{Completion, Waited};
use crate::conn::Shared;
use crate::ClientError;
use camelot_proto::Reply;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A request in flight. Either block on it with [`Pending::wait`] or `.await` it.
pub struct Pending {
    pub(crate) slot: Arc<Completion>,
    /// Backstop for the blocking wait; the connection's own watchdog normally fires first.
    pub(crate) timeout: Duration,
    /// The connection the request went out on: a blocking waiter may read it itself.
    pub(crate) conn: Arc<Shared>,
}

impl Pending {
    /// Blocks until the answer arrives or the request times out.
    pub fn wait(self) -> Result<Reply, ClientError> {
        let deadline = Instant::now() + self.timeout;
        // Read the answer ourselves if nobody else is reading; else sleep until woken.
        // A reader that finishes while others still wait hands over to the connection's
        // reader thread, so sleeping here never waits on nobody.
        let mut tried_reading = false;
        loop {
            match self.slot.take_or_wait(tried_reading, deadline) {
                Waited::Answer(r) => return r,
                Waited::TimedOut => {
                    return Err(ClientError::Timeout {
                        after: self.timeout,
                    })
                }
                Waited::Pending if tried_reading => continue,
                Waited::Pending => {}
            }
            tried_reading = !self.conn.read_for(&self.slot, deadline);
            if Instant::now() >= deadline {
                tried_reading = true;
            }
        }
    }

    /// True once the answer has arrived (never blocks).
    pub fn is_ready(&self) -> bool {
        self.slot.is_done()
    }
}

impl Future for Pending {
    type Output = Result<Reply, ClientError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let polled = self.slot.poll_answer(cx);
        if polled.is_pending() {
            // An awaiting task never reads the socket itself: make sure someone does.
            self.conn.poke();
        }
        polled
    }
}
