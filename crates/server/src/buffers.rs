//! A connection's input and output buffers, charged to the server's connection-buffer
//! budget (`ServerConfig::connection_buffers_bytes_max`), so the memory a server can be
//! made to hold is its caps plus a stated constant, whatever its clients do.
//!
//! Input is charged *before* it is allocated: every growth of the input buffer goes
//! through [`ConnBuffers::reserve_in`], which charges first and then allocates exactly
//! what it charged (a fresh buffer, the unread bytes copied over), so a refusal leaves
//! nothing allocated. Output is written by the executors into a plain `BytesMut`, so it
//! is charged right after each batch or command ([`ConnBuffers::settle_out`]); what may
//! exceed the budget is at most one reply per serving thread, for the moment between
//! appending it and settling (see ARCHITECTURE.md for the bound).

use crate::budget::{MemoryBudget, OverBudget};
use bytes::BytesMut;
use std::sync::Arc;

/// A connection's two buffers and what they hold of the budget.
#[derive(Debug)]
pub(crate) struct ConnBuffers {
    budget: Arc<MemoryBudget>,
    pub inbuf: BytesMut,
    /// Bytes of `inbuf`'s allocation. `BytesMut::capacity` counts only from the first
    /// unconsumed byte, so it shrinks as input is consumed while the allocation does not.
    in_alloc: usize,
    pub out: BytesMut,
    /// `out`'s capacity when it was last settled.
    out_alloc: usize,
    /// What this connection holds of the budget now.
    charged: u64,
}

impl ConnBuffers {
    /// Charges and allocates the starting buffers, or refuses without allocating.
    pub fn new(
        budget: &Arc<MemoryBudget>,
        in_bytes: usize,
        out_bytes: usize,
    ) -> Result<ConnBuffers, OverBudget> {
        let charged = (in_bytes + out_bytes) as u64;
        budget.try_charge(charged)?;
        Ok(ConnBuffers {
            budget: Arc::clone(budget),
            inbuf: BytesMut::with_capacity(in_bytes),
            in_alloc: in_bytes,
            out: BytesMut::with_capacity(out_bytes),
            out_alloc: out_bytes,
            charged,
        })
    }

    /// What this connection holds of the budget.
    #[cfg(test)]
    pub fn charged_bytes(&self) -> u64 {
        self.charged
    }

    /// Makes the charge `bytes`: more may be refused (then nothing changes), less never is.
    fn set_charge(&mut self, bytes: u64) -> Result<(), OverBudget> {
        // The usual case after a command: nothing grew. No atomic operation on the
        // budget's shared counter then, which every connection's core would fight over.
        if bytes == self.charged {
            return Ok(());
        }
        if bytes > self.charged {
            self.budget.try_charge(bytes - self.charged)?;
        } else {
            self.budget.uncharge(self.charged - bytes);
        }
        self.charged = bytes;
        Ok(())
    }

    fn settled_total(&self) -> u64 {
        (self.in_alloc + self.out_alloc) as u64
    }

    /// Makes room for `additional` more input bytes. When the buffer has to grow, the new
    /// allocation is charged first (with the old one, since both live while the unread
    /// bytes are copied), so a refusal allocates nothing.
    pub fn reserve_in(&mut self, additional: usize) -> Result<(), OverBudget> {
        if self.inbuf.capacity() - self.inbuf.len() >= additional {
            return Ok(());
        }
        // The frames read before are gone (their values were copied out): the unread
        // bytes move to the front of the same allocation, charged already. Without this,
        // every frame of megabytes (a pushed page's, a big PUT's) took a fresh allocation
        // and faulted all of its pages in.
        if self.inbuf.try_reclaim(additional) {
            return Ok(());
        }
        let new_cap = self.inbuf.len().saturating_add(additional);
        self.set_charge(self.charged.saturating_add(new_cap as u64))?;
        let mut fresh = BytesMut::with_capacity(new_cap);
        fresh.extend_from_slice(&self.inbuf);
        self.inbuf = fresh;
        self.in_alloc = new_cap;
        // Only less than what is charged now: cannot be refused.
        let _ = self.set_charge(self.settled_total());
        Ok(())
    }

    /// Charges what the output buffer grew to since it was last settled. On refusal the
    /// unsent replies are dropped (the caller answers with an error and closes), so the
    /// memory is given back at once rather than held past the cap.
    pub fn settle_out(&mut self) -> Result<(), OverBudget> {
        let out_alloc = self.out.capacity();
        let target = (self.in_alloc + out_alloc) as u64;
        match self.set_charge(target) {
            Ok(()) => {
                self.out_alloc = out_alloc;
                Ok(())
            }
            Err(e) => {
                self.out = BytesMut::new();
                self.out_alloc = 0;
                let _ = self.set_charge(self.settled_total());
                Err(e)
            }
        }
    }

    /// Replaces an input buffer with nothing unread whose allocation grew past `keep`
    /// with one of `fresh` bytes, so an idle connection does not pin a big command's room.
    pub fn shrink_in(&mut self, keep: usize, fresh: usize) {
        if self.inbuf.is_empty() && self.in_alloc > keep {
            self.inbuf = BytesMut::with_capacity(fresh);
            self.in_alloc = fresh;
            let _ = self.set_charge(self.settled_total());
        }
    }

    /// Empties the output buffer after it was sent, replacing it if it grew past `keep`.
    pub fn clear_out(&mut self, keep: usize, fresh: usize) {
        self.out.clear();
        if self.out.capacity() > keep {
            self.out = BytesMut::with_capacity(fresh);
        }
        self.out_alloc = self.out.capacity();
        let target = self.settled_total();
        if target <= self.charged {
            let _ = self.set_charge(target);
        }
    }
}

impl Drop for ConnBuffers {
    fn drop(&mut self) {
        self.budget.uncharge(self.charged);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{Buf, BufMut};
    use proptest::prelude::*;

    #[test]
    fn starting_buffers_are_charged_or_refused() {
        let budget = MemoryBudget::new(100);
        let b = ConnBuffers::new(&budget, 40, 40).unwrap();
        assert_eq!(budget.used(), 80);
        assert!(ConnBuffers::new(&budget, 20, 20).is_err());
        assert_eq!(budget.used(), 80);
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn input_growth_is_charged_before_it_is_allocated() {
        let budget = MemoryBudget::new(1000);
        let mut b = ConnBuffers::new(&budget, 100, 0).unwrap();
        b.inbuf.put_slice(&[7; 60]);
        b.inbuf.advance(50);
        // Room for 40 more is there already.
        b.reserve_in(40).unwrap();
        assert_eq!(budget.used(), 100);
        // 500 more needs a new buffer of 510: old and new are charged during the copy.
        b.reserve_in(500).unwrap();
        assert_eq!(budget.used(), 510);
        assert_eq!(&b.inbuf[..], &[7; 10]);
        assert!(b.inbuf.capacity() >= 510);
        // 990 more cannot be charged beside the 510: refused, nothing changed.
        assert!(b.reserve_in(990).is_err());
        assert_eq!(budget.used(), 510);
        assert_eq!(&b.inbuf[..], &[7; 10]);
    }

    /// Once the frames split off it are dropped, the input buffer's own allocation takes
    /// the next big frame: no new allocation, no new charge.
    #[test]
    fn input_room_is_reclaimed_once_earlier_frames_are_gone() {
        let budget = MemoryBudget::new(1 << 20);
        let mut b = ConnBuffers::new(&budget, 100, 0).unwrap();
        b.reserve_in(10_000).unwrap();
        let base = b.inbuf.as_ptr();
        b.inbuf.put_bytes(1, 9_000);
        let frame = b.inbuf.split_to(8_990).freeze();
        // Still held (a value not copied out): the room cannot be taken back, so the
        // unread bytes go to a fresh allocation (the old one is alive: not at `base`).
        b.reserve_in(9_000).unwrap();
        assert_ne!(b.inbuf.as_ptr(), base);
        assert_eq!(&b.inbuf[..], &[1; 10]);
        drop(frame);
        let charged = budget.used();
        let base2 = b.inbuf.as_ptr();
        b.inbuf.put_bytes(2, 9_000);
        drop(b.inbuf.split_to(9_000).freeze());
        b.reserve_in(9_000).unwrap();
        assert_eq!(budget.used(), charged);
        assert_eq!(b.inbuf.as_ptr(), base2, "the allocation was not reused");
        assert_eq!(&b.inbuf[..], &[2; 10]);
        assert_ne!(base, base2);
    }

    #[test]
    fn output_is_settled_and_dropped_when_refused() {
        let budget = MemoryBudget::new(10_000);
        let mut b = ConnBuffers::new(&budget, 100, 100).unwrap();
        b.out.put_slice(&[1; 3000]);
        b.settle_out().unwrap();
        assert_eq!(budget.used(), 100 + b.out.capacity() as u64);
        b.clear_out(1000, 100);
        assert_eq!(budget.used(), 200);
        b.out.put_slice(&[1; 20_000]);
        assert!(b.settle_out().is_err());
        assert!(b.out.is_empty());
        assert_eq!(budget.used(), 100);
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn shrinking_gives_memory_back() {
        let budget = MemoryBudget::new(1 << 20);
        let mut b = ConnBuffers::new(&budget, 100, 0).unwrap();
        b.reserve_in(50_000).unwrap();
        b.shrink_in(10_000, 100);
        assert_eq!(budget.used(), 100);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Fill(usize),
        Consume(usize),
        Reserve(usize),
        Reply(usize),
        Sent,
        Shrink,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0usize..5000).prop_map(Step::Fill),
            (0usize..5000).prop_map(Step::Consume),
            (0usize..20_000).prop_map(Step::Reserve),
            (0usize..20_000).prop_map(Step::Reply),
            Just(Step::Sent),
            Just(Step::Shrink),
        ]
    }

    proptest! {
        /// Whatever happens, the budget holds exactly what the buffer says it charged,
        /// never more than the cap, and everything is given back at the end.
        #[test]
        fn the_charge_stays_true_and_capped(steps in prop::collection::vec(step(), 0..40)) {
            let cap = 40_000;
            let budget = MemoryBudget::new(cap);
            let mut b = ConnBuffers::new(&budget, 1024, 1024).unwrap();
            for s in steps {
                match s {
                    Step::Fill(n) => {
                        let n = n.min(b.inbuf.capacity() - b.inbuf.len());
                        b.inbuf.put_bytes(0, n);
                    }
                    Step::Consume(n) => {
                        let n = n.min(b.inbuf.len());
                        b.inbuf.advance(n);
                    }
                    Step::Reserve(n) => {
                        let before = b.inbuf.clone();
                        if b.reserve_in(n).is_ok() {
                            prop_assert!(b.inbuf.capacity() - b.inbuf.len() >= n);
                        }
                        prop_assert_eq!(&before[..], &b.inbuf[..]);
                    }
                    Step::Reply(n) => {
                        b.out.put_bytes(1, n);
                        let _ = b.settle_out();
                        prop_assert!(b.out.capacity() as u64 <= b.charged_bytes());
                    }
                    Step::Sent => b.clear_out(4096, 1024),
                    Step::Shrink => b.shrink_in(4096, 1024),
                }
                prop_assert_eq!(budget.used(), b.charged_bytes());
                prop_assert!(budget.used() <= cap);
                prop_assert!(b.inbuf.capacity() as u64 <= b.charged_bytes());
            }
            drop(b);
            prop_assert_eq!(budget.used(), 0);
        }
    }
}
