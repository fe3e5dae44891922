//! Splitting one read or write of the volume into per-stripe pieces of data chunks. Pure,
//! proptested: the pieces cover the caller's buffer exactly once, in order.

use crate::layout::Layout;
use crate::BlocksError;

/// Most bytes one `Volume::read`/`write` call may move: bounds the stripe buffers a call
/// holds (a call's parity and old data are in memory at once).
pub const CALL_BYTES_MAX: u64 = 64 << 20;

/// A contiguous part of the caller's buffer that lands in one data chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Data slot in the stripe (0..k).
    pub slot: usize,
    /// Offset inside the chunk.
    pub chunk_from: u64,
    pub len: u64,
    /// Offset inside the caller's buffer.
    pub buf_from: usize,
}

/// The pieces of one call that fall in one stripe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StripeSpan {
    pub stripe: u64,
    pub pieces: Vec<Piece>,
}

impl StripeSpan {
    /// Every data chunk of the stripe is written whole: parity needs no reads.
    pub fn is_full(&self, layout: &Layout) -> bool {
        self.pieces.len() == layout.data_slots()
            && self
                .pieces
                .iter()
                .all(|p| p.chunk_from == 0 && p.len == layout.chunk_bytes)
    }

    /// The in-chunk range covering every piece, widened to `align` (a power of two).
    pub fn range(&self, align: u64, chunk_bytes: u64) -> (u64, u64) {
        let lo = self.pieces.iter().map(|p| p.chunk_from).min().unwrap_or(0);
        let hi = self
            .pieces
            .iter()
            .map(|p| p.chunk_from + p.len)
            .max()
            .unwrap_or(0);
        let lo = lo & !(align - 1);
        let hi = (hi.div_ceil(align) * align).min(chunk_bytes);
        (lo, hi)
    }
}

/// The stripes and pieces `[offset, offset + len)` of the volume touches.
pub fn split(layout: &Layout, offset: u64, len: u64) -> Result<Vec<StripeSpan>, BlocksError> {
    let end = offset
        .checked_add(len)
        .filter(|&e| e <= layout.capacity_bytes())
        .ok_or(BlocksError::OutOfBounds {
            offset,
            len,
            capacity: layout.capacity_bytes(),
        })?;
    if len > CALL_BYTES_MAX {
        return Err(BlocksError::InvalidArgument(format!(
            "one call moves at most {CALL_BYTES_MAX} bytes, not {len}"
        )));
    }
    let chunk = layout.chunk_bytes;
    let k = layout.data_slots() as u64;
    let mut spans: Vec<StripeSpan> = Vec::new();
    let mut at = offset;
    while at < end {
        let chunk_index = at / chunk;
        let stripe = chunk_index / k;
        let slot = (chunk_index % k) as usize;
        let chunk_from = at % chunk;
        let piece_len = (chunk - chunk_from).min(end - at);
        let piece = Piece {
            slot,
            chunk_from,
            len: piece_len,
            buf_from: (at - offset) as usize,
        };
        match spans.last_mut() {
            Some(s) if s.stripe == stripe => s.pieces.push(piece),
            _ => spans.push(StripeSpan {
                stripe,
                pieces: vec![piece],
            }),
        }
        at += piece_len;
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Level;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pieces_cover_the_call_once_in_order(
            k in 1usize..6, chunk_shift in 12u32..15, stripes in 1u64..20,
            offset in 0u64..1 << 20, len in 0u64..1 << 19,
        ) {
            let layout = Layout {
                level: Level::Raid0,
                members: k,
                chunk_bytes: 1 << chunk_shift,
                stripes,
            };
            let cap = layout.capacity_bytes();
            let offset = offset % (cap + 1);
            let len = len % (cap - offset + 1);
            let spans = split(&layout, offset, len).unwrap();
            let mut next_buf = 0usize;
            let mut last_stripe = None;
            for s in &spans {
                prop_assert!(s.stripe < stripes);
                prop_assert!(last_stripe < Some(s.stripe));
                last_stripe = Some(s.stripe);
                for p in &s.pieces {
                    prop_assert_eq!(p.buf_from, next_buf);
                    prop_assert!(p.len > 0 && p.chunk_from + p.len <= layout.chunk_bytes);
                    // The piece's volume offset is where the buffer says it is.
                    let vol = (s.stripe * k as u64 + p.slot as u64) * layout.chunk_bytes
                        + p.chunk_from;
                    prop_assert_eq!(vol, offset + p.buf_from as u64);
                    next_buf += p.len as usize;
                }
                let (lo, hi) = s.range(64, layout.chunk_bytes);
                prop_assert!(s.pieces.iter().all(|p| lo <= p.chunk_from && p.chunk_from + p.len <= hi));
            }
            prop_assert_eq!(next_buf as u64, len);
        }

        #[test]
        fn past_the_end_is_refused(offset: u64, len: u64) {
            let layout = Layout { level: Level::Raid0, members: 2, chunk_bytes: 4096, stripes: 4 };
            let fits = offset.checked_add(len).is_some_and(|e| e <= layout.capacity_bytes());
            prop_assert_eq!(split(&layout, offset, len).is_ok(), fits);
        }
    }

    #[test]
    fn full_stripes_are_recognised() {
        let layout = Layout {
            level: Level::Raid5,
            members: 4,
            chunk_bytes: 4096,
            stripes: 4,
        };
        let spans = split(&layout, 3 * 4096, 3 * 4096 * 2).unwrap();
        assert_eq!(spans.len(), 2);
        assert!(spans.iter().all(|s| s.is_full(&layout)));
        let spans = split(&layout, 3 * 4096 + 1, 3 * 4096).unwrap();
        assert!(spans.iter().all(|s| !s.is_full(&layout)));
    }
}
