//! A byte budget that owners reserve from before they allocate, so going over a cap is an
//! error someone sees rather than an OOM kill. The server's memory (regions and objects)
//! and its connection buffers are each one; the proxy's connection memory is another.
//! Here, beside the wire's limits, because both ends of a hop keep one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A reservation would take the budget past its cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot reserve {requested_bytes} bytes: {used_bytes} of {cap_bytes} in use")]
pub struct OverBudget {
    pub requested_bytes: u64,
    pub used_bytes: u64,
    pub cap_bytes: u64,
}

#[derive(Debug)]
pub struct MemoryBudget {
    cap_bytes: u64,
    used_bytes: AtomicU64,
}

impl MemoryBudget {
    pub fn new(cap_bytes: u64) -> Arc<Self> {
        Arc::new(MemoryBudget {
            cap_bytes,
            used_bytes: AtomicU64::new(0),
        })
    }

    /// Reserves `bytes`, or refuses without changing anything. The reservation is held
    /// until the returned [`Reservation`] is dropped.
    pub fn try_reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, OverBudget> {
        self.try_charge(bytes)?;
        Ok(Reservation {
            budget: Arc::clone(self),
            bytes,
        })
    }

    /// Takes `bytes` with no guard object: for owners that keep their own tally of what
    /// they hold (the object store, whose entries grow and shrink in place) and give it
    /// back with [`MemoryBudget::uncharge`]. Refusal changes nothing.
    pub fn try_charge(&self, bytes: u64) -> Result<(), OverBudget> {
        let cap = self.cap_bytes;
        self.used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= cap)
            })
            .map_err(|used| OverBudget {
                requested_bytes: bytes,
                used_bytes: used,
                cap_bytes: cap,
            })?;
        Ok(())
    }

    /// Takes `bytes` even past the cap: only for keeping the tally true when an owner
    /// finds it holds more than it charged (a bug it also asserts on in debug builds).
    pub fn force_charge(&self, bytes: u64) {
        self.used_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// Gives back bytes taken with [`MemoryBudget::try_charge`].
    pub fn uncharge(&self, bytes: u64) {
        self.used_bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    pub fn used(&self) -> u64 {
        self.used_bytes.load(Ordering::Acquire)
    }

    pub fn cap(&self) -> u64 {
        self.cap_bytes
    }

    pub fn available(&self) -> u64 {
        self.cap_bytes.saturating_sub(self.used())
    }
}

/// Bytes taken from a [`MemoryBudget`]; given back on drop.
#[derive(Debug)]
#[must_use = "dropping a Reservation releases it at once"]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Gives the bytes back now (same as dropping it, but says so at the call site).
    pub fn release(self) {}
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.uncharge(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_is_enforced_and_refusal_changes_nothing() {
        let b = MemoryBudget::new(100);
        let r1 = b.try_reserve(60).unwrap();
        let err = b.try_reserve(41).unwrap_err();
        assert_eq!(
            err,
            OverBudget {
                requested_bytes: 41,
                used_bytes: 60,
                cap_bytes: 100
            }
        );
        assert_eq!(b.used(), 60);
        let r2 = b.try_reserve(40).unwrap();
        assert_eq!(b.used(), 100);
        assert_eq!(b.available(), 0);
        assert!(b.try_reserve(1).is_err());
        assert_eq!(r1.bytes() + r2.bytes(), 100);
    }

    #[test]
    fn drop_and_release_give_bytes_back() {
        let b = MemoryBudget::new(100);
        let r1 = b.try_reserve(70).unwrap();
        drop(r1);
        assert_eq!(b.used(), 0);
        let r2 = b.try_reserve(100).unwrap();
        r2.release();
        assert_eq!(b.used(), 0);
        assert_eq!(b.cap(), 100);
    }

    #[test]
    fn overflowing_request_is_refused() {
        let b = MemoryBudget::new(u64::MAX);
        let _r = b.try_reserve(10).unwrap();
        assert!(b.try_reserve(u64::MAX).is_err());
        assert_eq!(b.used(), 10);
    }

    #[test]
    fn zero_bytes_always_fit() {
        let b = MemoryBudget::new(0);
        let r = b.try_reserve(0).unwrap();
        assert_eq!(r.bytes(), 0);
        assert!(b.try_reserve(1).is_err());
    }

    #[test]
    fn concurrent_reservations_never_exceed_cap() {
        let b = MemoryBudget::new(1000);
        let held: Vec<Reservation> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    let b = &b;
                    s.spawn(move || {
                        (0..1000)
                            .filter_map(|_| b.try_reserve(7).ok())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let granted: u64 = held.iter().map(Reservation::bytes).sum();
        assert_eq!(granted, 1000 / 7 * 7);
        assert_eq!(b.used(), granted);
    }
}
