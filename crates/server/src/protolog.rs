//! Lines a peer can cause — protocol errors on the Redis port, refused handshakes on the
//! native one — go to the log with the peer's address, but at most
//! [`PROTOCOL_ERRORS_LOGGED_PER_WINDOW`] per [`WINDOW`] for each kind: a client that sends
//! garbage, or connects with a wrong token, in a loop must not be able to fill the disk.
//! What was held back is counted and said with the next line that gets through.

use crate::resp::codec::RespError;
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing::warn;

pub const WINDOW: Duration = Duration::from_secs(10);
pub const PROTOCOL_ERRORS_LOGGED_PER_WINDOW: u32 = 10;

/// The limiter's state: pure, so it is tested without a clock of its own.
#[derive(Debug)]
pub struct RateLimit {
    window_start: Option<Instant>,
    logged_in_window: u32,
    suppressed: u64,
}

impl RateLimit {
    pub const fn new() -> Self {
        RateLimit {
            window_start: None,
            logged_in_window: 0,
            suppressed: 0,
        }
    }

    /// `Some(held back since the last line)` when a line may be written at `now`.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        let fresh = match self.window_start {
            Some(start) => now.saturating_duration_since(start) >= WINDOW,
            None => true,
        };
        if fresh {
            self.window_start = Some(now);
            self.logged_in_window = 0;
        }
        if self.logged_in_window >= PROTOCOL_ERRORS_LOGGED_PER_WINDOW {
            self.suppressed += 1;
            return None;
        }
        self.logged_in_window += 1;
        Some(std::mem::take(&mut self.suppressed))
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new()
    }
}

/// One kind of line's limiter, shared by every connection.
pub(crate) struct LogLimit(Mutex<RateLimit>);

impl LogLimit {
    pub(crate) const fn new() -> Self {
        LogLimit(Mutex::new(RateLimit::new()))
    }

    /// `Some(held back since the last line)` when a line may be written now.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.0.lock().admit(Instant::now())
    }
}

/// Redis-port connections closed after a protocol error.
static RESP_PROTOCOL: LogLimit = LogLimit::new();
/// Native-port connections refused before or at their handshake (limits, bad HELLOs,
/// wrong tokens): nothing there is authenticated.
pub(crate) static NATIVE_REFUSALS: LogLimit = LogLimit::new();
/// Redis-port connections refused or closed before AUTH (limits, too much unauthenticated
/// input).
pub(crate) static RESP_REFUSALS: LogLimit = LogLimit::new();

/// A `tracing::warn!` that goes through `$limit` (a [`LogLimit`]) and says how many lines
/// it held back since the last one.
macro_rules! warn_limited {
    ($limit:expr, $($rest:tt)+) => {
        if let Some(suppressed) = $limit.admit() {
            tracing::warn!(suppressed_since_last = suppressed, $($rest)+);
        }
    };
}
pub(crate) use warn_limited;

/// Logs that `peer` was disconnected for `error` (the client was told the same text).
pub(crate) fn protocol_error(peer: SocketAddr, error: &RespError) {
    let Some(suppressed) = RESP_PROTOCOL.admit() else {
        return;
    };
    warn!(
        %peer,
        %error,
        suppressed_since_last = suppressed,
        "RESP connection closed after a protocol error"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_cut_to_the_budget_and_counted() {
        let mut limit = RateLimit::new();
        let t0 = Instant::now();
        for _ in 0..PROTOCOL_ERRORS_LOGGED_PER_WINDOW {
            assert_eq!(limit.admit(t0), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(limit.admit(t0 + Duration::from_secs(1)), None);
        }
        // A new window: the first line says how many were held back.
        assert_eq!(limit.admit(t0 + WINDOW), Some(5));
        assert_eq!(limit.admit(t0 + WINDOW), Some(0));
    }
}
