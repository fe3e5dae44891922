//! Parity math over equal-length slices of a stripe's slots: XOR for raid4/5, copies for
//! raid1, Reed–Solomon (`reed-solomon-simd`) for rs:k+m. Pure; no I/O.
//!
//! Every code here is linear over GF(2^w) with XOR as addition, so the parity of new
//! data is the old parity XOR the parity of the change: a partial write reads and
//! writes only the touched ranges (`apply_delta`). For Reed–Solomon that holds for any
//! range aligned to [`RS_ALIGN`], because `reed-solomon-simd` works on 64-byte blocks
//! position by position; a proptest below pins it.

use crate::layout::Code;
use crate::BlocksError;
use reed_solomon_simd::engine::{tables, DefaultEngine, Engine, GfElement};
use reed_solomon_simd::{ReedSolomonDecoder, ReedSolomonEncoder};
use std::cell::RefCell;
use std::collections::HashMap;

/// Reed–Solomon ranges start and end on this many bytes within a chunk.
pub const RS_ALIGN: u64 = 64;

/// `dst ^= src`. Written over fixed 64-byte blocks so the compiler emits vector XORs
/// (SSE2 on any x86-64, wider with `target-cpu`); `bench raid encode` measures it.
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    let mut d = dst.chunks_exact_mut(64);
    let mut s = src.chunks_exact(64);
    for (db, sb) in (&mut d).zip(&mut s) {
        for (x, y) in db.iter_mut().zip(sb) {
            *x ^= *y;
        }
    }
    for (x, y) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *x ^= *y;
    }
}

thread_local! {
    // Building an encoder allocates its work space; one per thread, reset per use, keeps
    // the hot path allocation-light.
    static RS_ENCODER: RefCell<Option<ReedSolomonEncoder>> = const { RefCell::new(None) };
    // The same for decoding: building a decoder costs more than decoding a 4 KiB stripe.
    static RS_DECODER: RefCell<Option<ReedSolomonDecoder>> = const { RefCell::new(None) };
    // Decode matrices by erasure pattern, and the SIMD engine that applies them.
    static RS_MATRICES: RefCell<HashMap<Pattern, Matrix>> = RefCell::new(HashMap::new());
    static RS_ENGINE: DefaultEngine = DefaultEngine::new();
}

/// An erasure pattern: (k, m, bitmask of the k slots read).
type Pattern = (usize, usize, u64);
/// Per missing data slot: (slot, one GF(2^16) coefficient per slot read, in slot order).
type Matrix = Vec<(usize, Vec<GfElement>)>;
/// Most patterns a thread remembers (k + m ≤ 32 members, so in practice a handful).
const RS_MATRICES_MAX: usize = 64;

/// The coefficients that rebuild each missing data slot from the slots read. A
/// Reed–Solomon decode in `reed-solomon-simd` costs a fixed transform over all of GF(2^16)
/// (about a millisecond) whatever the shard size, which would make every degraded 4 KiB
/// read CPU-bound; but the code is linear and the same for every element position, so
/// decoding once per read slot with a unit element gives the map, and later stripes with
/// the same losses are one multiply-and-XOR per slot read.
fn decode_matrix(k: usize, m: usize, read: &[usize]) -> Result<Matrix, BlocksError> {
    let missing: Vec<usize> = (0..k).filter(|i| !read.contains(i)).collect();
    let mut columns: Vec<Vec<GfElement>> = vec![vec![0; read.len()]; missing.len()];
    let mut dec = ReedSolomonDecoder::new(k, m, 64).map_err(rs_error)?;
    for (col, _) in read.iter().enumerate() {
        dec.reset(k, m, 64).map_err(rs_error)?;
        for (j, &slot) in read.iter().enumerate() {
            let mut shard = [0u8; 64];
            // Element 0 of a 64-byte block: low byte at 0, high byte at 32.
            shard[0] = u8::from(j == col);
            if slot < k {
                dec.add_original_shard(slot, shard).map_err(rs_error)?;
            } else {
                dec.add_recovery_shard(slot - k, shard).map_err(rs_error)?;
            }
        }
        let result = dec.decode().map_err(rs_error)?;
        for (row, &slot) in missing.iter().enumerate() {
            let got = result
                .restored_original(slot)
                .ok_or_else(|| BlocksError::Codec(format!("slot {slot} not restored")))?;
            columns[row][col] = GfElement::from(got[0]) | (GfElement::from(got[32]) << 8);
        }
    }
    Ok(missing.into_iter().zip(columns).collect())
}

/// `dst ^= c · src` over GF(2^16), in the shard layout of `reed-solomon-simd`.
fn mul_xor_into(
    engine: &DefaultEngine,
    dst: &mut [u8],
    src: &[u8],
    c: GfElement,
    scratch: &mut Vec<[u8; 64]>,
) {
    if c == 0 {
        return;
    }
    if c == 1 {
        xor_into(dst, src);
        return;
    }
    scratch.clear();
    scratch.extend(src.chunks_exact(64).map(|b| {
        let mut a = [0u8; 64];
        a.copy_from_slice(b);
        a
    }));
    let log = tables::get_exp_log().log[usize::from(c)];
    engine.mul(scratch, log);
    for (d, s) in dst.chunks_exact_mut(64).zip(scratch.iter()) {
        xor_into(d, s);
    }
}

fn rs_error(e: reed_solomon_simd::Error) -> BlocksError {
    BlocksError::Codec(e.to_string())
}

/// The codec of one layout.
#[derive(Debug, Clone, Copy)]
pub struct Codec {
    pub code: Code,
    pub k: usize,
    pub m: usize,
}

impl Codec {
    /// Computes the `m` parity slices from the `k` data slices (all of one length; even
    /// for Reed–Solomon). `parity` must hold `m` buffers of that length.
    pub fn encode(&self, data: &[&[u8]], parity: &mut [Vec<u8>]) -> Result<(), BlocksError> {
        if data.len() != self.k || parity.len() != self.m {
            return Err(BlocksError::Codec(format!(
                "encode wants {} data and {} parity slices, got {} and {}",
                self.k,
                self.m,
                data.len(),
                parity.len()
            )));
        }
        let len = data.first().map_or(0, |d| d.len());
        match self.code {
            Code::None => {}
            Code::Mirror => {
                for p in parity.iter_mut() {
                    p.clear();
                    p.extend_from_slice(data[0]);
                }
            }
            Code::Xor => {
                let p = &mut parity[0];
                p.clear();
                p.extend_from_slice(data[0]);
                for d in &data[1..] {
                    xor_into(p, d);
                }
            }
            Code::Rs => {
                if len == 0 {
                    parity.iter_mut().for_each(Vec::clear);
                    return Ok(());
                }
                RS_ENCODER.with(|cell| -> Result<(), BlocksError> {
                    let mut slot = cell.borrow_mut();
                    let enc = match slot.as_mut() {
                        Some(enc) => {
                            enc.reset(self.k, self.m, len).map_err(rs_error)?;
                            enc
                        }
                        None => slot.insert(
                            ReedSolomonEncoder::new(self.k, self.m, len).map_err(rs_error)?,
                        ),
                    };
                    for d in data {
                        enc.add_original_shard(d).map_err(rs_error)?;
                    }
                    let result = enc.encode().map_err(rs_error)?;
                    for (p, r) in parity.iter_mut().zip(result.recovery_iter()) {
                        p.clear();
                        p.extend_from_slice(r);
                    }
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// `parity ^= encode(delta)`, where `deltas[i]` is `old ^ new` of data slot i (`None`:
    /// unchanged). Mirror parity is not a delta code: its copies are written directly.
    pub fn apply_delta(
        &self,
        deltas: &[Option<&[u8]>],
        parity: &mut [Vec<u8>],
    ) -> Result<(), BlocksError> {
        let len = parity.first().map_or(0, Vec::len);
        match self.code {
            Code::None | Code::Mirror => Ok(()),
            Code::Xor => {
                for d in deltas.iter().flatten() {
                    xor_into(&mut parity[0], d);
                }
                Ok(())
            }
            Code::Rs => {
                let zeros = vec![0u8; len];
                let data: Vec<&[u8]> = deltas.iter().map(|d| d.unwrap_or(&zeros)).collect();
                let mut encoded: Vec<Vec<u8>> = vec![Vec::new(); self.m];
                self.encode(&data, &mut encoded)?;
                for (p, e) in parity.iter_mut().zip(&encoded) {
                    xor_into(p, e);
                }
                Ok(())
            }
        }
    }

    /// Fills every `None` of a stripe's `k + m` slices (data then parity) from the others.
    /// Needs at least `k` present (raid1: one).
    pub fn reconstruct(&self, slots: &mut [Option<Vec<u8>>]) -> Result<(), BlocksError> {
        let n = self.k + self.m;
        if slots.len() != n {
            return Err(BlocksError::Codec(format!("{n} slots expected")));
        }
        let present = slots.iter().filter(|s| s.is_some()).count();
        // Slots come from servers: ones of unequal length are an error, never a slice
        // past an end.
        let mut lens = slots.iter().flatten().map(Vec::len);
        if let Some(first) = lens.next() {
            if lens.any(|l| l != first) {
                return Err(BlocksError::Codec("slots of unequal length".into()));
            }
        }
        if present == n {
            return Ok(());
        }
        let need = if self.code == Code::Mirror { 1 } else { self.k };
        if present < need || self.code == Code::None {
            return Err(BlocksError::TooManyLost {
                lost: n - present,
                tolerated: self.m,
            });
        }
        match self.code {
            // Refused just above: no parity, nothing to rebuild from.
            Code::None => {}
            Code::Mirror => {
                let copy = slots.iter().flatten().next().cloned().unwrap_or_default();
                for s in slots.iter_mut().filter(|s| s.is_none()) {
                    *s = Some(copy.clone());
                }
            }
            Code::Xor => {
                // One slot missing (k + 1 slots, k present): it is the XOR of the rest.
                let len = slots.iter().flatten().next().map_or(0, Vec::len);
                let mut acc = vec![0u8; len];
                for s in slots.iter().flatten() {
                    xor_into(&mut acc, s);
                }
                if let Some(missing) = slots.iter_mut().find(|s| s.is_none()) {
                    *missing = Some(acc);
                }
            }
            Code::Rs => {
                let len = slots.iter().flatten().next().map_or(0, Vec::len);
                let data_missing = slots[..self.k].iter().any(Option::is_none);
                if data_missing && len & 63 == 0 && self.k + self.m <= 64 {
                    let read: Vec<usize> = (0..self.k + self.m)
                        .filter(|&i| slots[i].is_some())
                        .take(self.k)
                        .collect();
                    let mask = read.iter().fold(0u64, |a, &i| a | 1 << i);
                    let key = (self.k, self.m, mask);
                    let matrix = RS_MATRICES.with(|cell| -> Result<Matrix, BlocksError> {
                        let mut cache = cell.borrow_mut();
                        if let Some(m) = cache.get(&key) {
                            return Ok(m.clone());
                        }
                        let m = decode_matrix(self.k, self.m, &read)?;
                        if cache.len() >= RS_MATRICES_MAX {
                            cache.clear();
                        }
                        cache.insert(key, m.clone());
                        Ok(m)
                    })?;
                    let mut scratch = Vec::new();
                    let mut restored = Vec::with_capacity(matrix.len());
                    RS_ENGINE.with(|engine| {
                        for (slot, coefficients) in &matrix {
                            let mut out = vec![0u8; len];
                            for (&j, &c) in read.iter().zip(coefficients) {
                                if let Some(src) = slots[j].as_deref() {
                                    mul_xor_into(engine, &mut out, src, c, &mut scratch);
                                }
                            }
                            restored.push((*slot, out));
                        }
                    });
                    for (slot, out) in restored {
                        slots[slot] = Some(out);
                    }
                } else if data_missing {
                    RS_DECODER.with(|cell| -> Result<(), BlocksError> {
                        let mut slot = cell.borrow_mut();
                        let dec = match slot.as_mut() {
                            Some(dec) => {
                                dec.reset(self.k, self.m, len).map_err(rs_error)?;
                                dec
                            }
                            None => slot.insert(
                                ReedSolomonDecoder::new(self.k, self.m, len).map_err(rs_error)?,
                            ),
                        };
                        for (i, s) in slots[..self.k].iter().enumerate() {
                            if let Some(s) = s {
                                dec.add_original_shard(i, s).map_err(rs_error)?;
                            }
                        }
                        for (j, s) in slots[self.k..].iter().enumerate() {
                            if let Some(s) = s {
                                dec.add_recovery_shard(j, s).map_err(rs_error)?;
                            }
                        }
                        let result = dec.decode().map_err(rs_error)?;
                        for (i, s) in slots[..self.k].iter_mut().enumerate() {
                            if s.is_none() {
                                let restored = result.restored_original(i).ok_or_else(|| {
                                    BlocksError::Codec(format!("data slot {i} not restored"))
                                })?;
                                *s = Some(restored.to_vec());
                            }
                        }
                        Ok(())
                    })?;
                }
                if slots[self.k..].iter().any(Option::is_none) {
                    let data: Vec<&[u8]> =
                        slots[..self.k].iter().flatten().map(|v| &v[..]).collect();
                    let mut parity = vec![Vec::new(); self.m];
                    self.encode(&data, &mut parity)?;
                    for (s, p) in slots[self.k..].iter_mut().zip(parity) {
                        if s.is_none() {
                            *s = Some(p);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Slot `want` of a stripe rebuilt from the slots read (`None`: not read), borrowing
    /// them rather than taking owned copies. XOR and mirror rebuild the one slot
    /// directly (one copy and k − 1 XORs); Reed–Solomon goes through `reconstruct`.
    pub fn rebuild_slot(
        &self,
        slots: &[Option<&[u8]>],
        want: usize,
    ) -> Result<Vec<u8>, BlocksError> {
        let n = self.k + self.m;
        if slots.len() != n || want >= n {
            return Err(BlocksError::Codec(format!(
                "{n} slots and a slot below it expected"
            )));
        }
        if let Some(s) = slots[want] {
            return Ok(s.to_vec());
        }
        let present: Vec<&[u8]> = slots.iter().flatten().copied().collect();
        let need = if self.code == Code::Mirror { 1 } else { self.k };
        if present.len() < need || self.code == Code::None {
            return Err(BlocksError::TooManyLost {
                lost: n - present.len(),
                tolerated: self.m,
            });
        }
        let len = present[0].len();
        if present.iter().any(|s| s.len() != len) {
            return Err(BlocksError::Codec("slots of different lengths".into()));
        }
        match self.code {
            Code::Mirror => Ok(present[0].to_vec()),
            Code::Xor => {
                // k + 1 slots, `want` absent and k present: it is the XOR of the rest.
                let mut acc = present[0].to_vec();
                for s in &present[1..] {
                    xor_into(&mut acc, s);
                }
                Ok(acc)
            }
            Code::None | Code::Rs => {
                let mut owned: Vec<Option<Vec<u8>>> =
                    slots.iter().map(|s| s.map(<[u8]>::to_vec)).collect();
                self.reconstruct(&mut owned)?;
                owned[want]
                    .take()
                    .ok_or_else(|| BlocksError::Codec(format!("slot {want} not rebuilt")))
            }
        }
    }

    /// Whether the parity slices agree with the data slices.
    pub fn verify(&self, slots: &[Vec<u8>]) -> Result<bool, BlocksError> {
        if self.code == Code::None {
            return Ok(true);
        }
        let data: Vec<&[u8]> = slots[..self.k].iter().map(|v| &v[..]).collect();
        let mut parity = vec![Vec::new(); self.m];
        self.encode(&data, &mut parity)?;
        Ok(parity.iter().zip(&slots[self.k..]).all(|(a, b)| a == b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn codec() -> impl Strategy<Value = Codec> {
        prop_oneof![
            (2usize..=5).prop_map(|n| Codec {
                code: Code::Mirror,
                k: 1,
                m: n - 1
            }),
            (2usize..=7).prop_map(|k| Codec {
                code: Code::Xor,
                k,
                m: 1
            }),
            (1usize..=6, 1usize..=3).prop_map(|(k, m)| Codec {
                code: Code::Rs,
                k,
                m
            }),
        ]
    }

    fn stripe(c: Codec, blocks: usize, seed: u64) -> Vec<Vec<u8>> {
        let len = blocks * 64;
        let mut x = seed | 1;
        let mut data: Vec<Vec<u8>> = (0..c.k)
            .map(|_| {
                (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect()
            })
            .collect();
        let refs: Vec<&[u8]> = data.iter().map(|v| &v[..]).collect();
        let mut parity = vec![Vec::new(); c.m];
        c.encode(&refs, &mut parity).unwrap();
        data.extend(parity);
        data
    }

    #[test]
    fn xor_into_handles_tails() {
        let mut a: Vec<u8> = (0..131).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..131).map(|i| (i * 7) as u8).collect();
        let want: Vec<u8> = a.iter().zip(&b).map(|(x, y)| x ^ y).collect();
        xor_into(&mut a, &b);
        assert_eq!(a, want);
    }

    /// Slots come from servers: a short one is an error for every code, not a panic
    /// or a stripe rebuilt from a shorter slot.
    #[test]
    fn slots_of_unequal_length_are_an_error() {
        for (code, k, m) in [(Code::Xor, 4, 1), (Code::Rs, 4, 2), (Code::Mirror, 1, 2)] {
            let c = Codec { code, k, m };
            let full = stripe(c, 2, 5);
            let mut slots: Vec<Option<Vec<u8>>> = full.into_iter().map(Some).collect();
            slots[0] = None;
            if let Some(s) = slots[1].as_mut() {
                s.truncate(s.len() - 1);
            }
            assert!(
                matches!(c.reconstruct(&mut slots), Err(BlocksError::Codec(_))),
                "{code:?}"
            );
        }
    }

    #[test]
    fn too_many_lost_is_an_error_not_a_guess() {
        let c = Codec {
            code: Code::Rs,
            k: 4,
            m: 2,
        };
        let full = stripe(c, 2, 9);
        let mut slots: Vec<Option<Vec<u8>>> = full.into_iter().map(Some).collect();
        slots[0] = None;
        slots[2] = None;
        slots[5] = None;
        assert!(matches!(
            c.reconstruct(&mut slots),
            Err(BlocksError::TooManyLost {
                lost: 3,
                tolerated: 2
            })
        ));
    }

    proptest! {
        #[test]
        fn any_m_lost_slots_reconstruct(c in codec(), blocks in 1usize..8, seed: u64,
                                        lost_seed: u64) {
            let full = stripe(c, blocks, seed);
            let n = c.k + c.m;
            // Choose m distinct slots to lose.
            let mut order: Vec<usize> = (0..n).collect();
            let mut x = lost_seed | 1;
            for i in (1..n).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let mut slots: Vec<Option<Vec<u8>>> = full.iter().cloned().map(Some).collect();
            for &i in &order[..c.m] {
                slots[i] = None;
            }
            c.reconstruct(&mut slots).unwrap();
            let got: Vec<Vec<u8>> = slots.into_iter().map(|s| s.unwrap()).collect();
            prop_assert_eq!(&got, &full);
            prop_assert!(c.verify(&got).unwrap());
        }

        #[test]
        fn rebuild_slot_gives_back_the_lost_slot(c in codec(), blocks in 1usize..8, seed: u64,
                                                 lost_seed: u64, want_seed: u64) {
            let full = stripe(c, blocks, seed);
            let n = c.k + c.m;
            let want = (want_seed % n as u64) as usize;
            // `want` and up to m - 1 other slots lost.
            let mut lost = vec![want];
            let mut x = lost_seed | 1;
            while lost.len() < c.m {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                let i = (x % n as u64) as usize;
                if !lost.contains(&i) {
                    lost.push(i);
                }
            }
            let slots: Vec<Option<&[u8]>> = (0..n)
                .map(|i| (!lost.contains(&i)).then(|| &full[i][..]))
                .collect();
            prop_assert_eq!(c.rebuild_slot(&slots, want).unwrap(), full[want].clone());
            // One more lost than the code tolerates: an error, not a guess.
            let mut fewer = slots.clone();
            if let Some(i) = (0..n).find(|i| fewer[*i].is_some()) {
                fewer[i] = None;
            }
            prop_assert!(c.rebuild_slot(&fewer, want).is_err());
        }

        #[test]
        fn a_delta_on_an_aligned_range_equals_reencoding(
            c in codec(), blocks in 1usize..8, seed: u64, seed2: u64,
            lo in 0usize..8, span in 1usize..8, touched in 1u32..64,
        ) {
            let old = stripe(c, blocks, seed);
            let newer = stripe(c, blocks, seed2);
            let lo = (lo % blocks) * 64;
            let hi = (lo + span * 64).min(blocks * 64);
            // New data: slots in `touched` take the newer bytes over [lo, hi).
            let mut want = old.clone();
            for i in 0..c.k {
                if touched & (1 << (i % 32)) != 0 {
                    want[i][lo..hi].copy_from_slice(&newer[i][lo..hi]);
                }
            }
            let refs: Vec<&[u8]> = want[..c.k].iter().map(|v| &v[..]).collect();
            let mut want_parity = vec![Vec::new(); c.m];
            c.encode(&refs, &mut want_parity).unwrap();

            let deltas: Vec<Option<Vec<u8>>> = (0..c.k).map(|i| {
                (touched & (1 << (i % 32)) != 0).then(|| {
                    let mut d = old[i][lo..hi].to_vec();
                    xor_into(&mut d, &want[i][lo..hi]);
                    d
                })
            }).collect();
            let delta_refs: Vec<Option<&[u8]>> = deltas.iter().map(|d| d.as_deref()).collect();
            let mut parity: Vec<Vec<u8>> = old[c.k..].iter().map(|p| p[lo..hi].to_vec()).collect();
            c.apply_delta(&delta_refs, &mut parity).unwrap();
            if c.code != Code::Mirror {
                for (p, w) in parity.iter().zip(&want_parity) {
                    prop_assert_eq!(&p[..], &w[lo..hi]);
                }
            }
        }

        /// The volume's partial write as the servers see it: each writer SWAPs its bytes
        /// into one data slot (getting the old ones), then XORs enc(old ^ new) into every
        /// parity slot. Writers interleave arbitrarily, on any slot and any 64-byte-aligned
        /// range, overlapping or not; in the end parity must be the code of the data,
        /// because the deltas commute and the code is linear.
        #[test]
        fn interleaved_swap_then_xor_deltas_leave_parity_the_code_of_the_data(
            c in codec().prop_filter("delta codes", |c| c.code != Code::Mirror),
            blocks in 1usize..6, seed: u64,
            writes in proptest::collection::vec(
                (0usize..8, 0usize..6, 1usize..6, any::<u8>()), 1..12),
            order_seed: u64,
        ) {
            let mut full = stripe(c, blocks, seed);
            let len = blocks * 64;
            // Each write's two steps, as (write, step); a write's XOR comes after its SWAP.
            let mut next_step = vec![0u8; writes.len()];
            let mut deltas: Vec<Option<(usize, Vec<Vec<u8>>)>> = vec![None; writes.len()];
            let mut x = order_seed | 1;
            let mut pending: Vec<usize> = (0..writes.len()).collect();
            while !pending.is_empty() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                let at = (x % pending.len() as u64) as usize;
                let w = pending[at];
                let (slot, lo, span, byte) = writes[w];
                let (slot, lo) = (slot % c.k, (lo % blocks) * 64);
                let hi = (lo + span * 64).min(len);
                if next_step[w] == 0 {
                    let new = vec![byte ^ (w as u8); hi - lo];
                    let mut delta = full[slot][lo..hi].to_vec();
                    full[slot][lo..hi].copy_from_slice(&new);
                    xor_into(&mut delta, &new);
                    let mut refs: Vec<Option<&[u8]>> = vec![None; c.k];
                    refs[slot] = Some(&delta);
                    let mut enc = vec![vec![0u8; hi - lo]; c.m];
                    c.apply_delta(&refs, &mut enc).unwrap();
                    deltas[w] = Some((lo, enc));
                    next_step[w] = 1;
                } else {
                    let (lo, enc) = deltas[w].take().unwrap();
                    for (j, e) in enc.iter().enumerate() {
                        xor_into(&mut full[c.k + j][lo..lo + e.len()], e);
                    }
                    pending.swap_remove(at);
                }
            }
            prop_assert!(c.verify(&full).unwrap());
        }

        #[test]
        fn verify_catches_a_flipped_byte(c in codec(), blocks in 1usize..4, seed: u64,
                                         slot in 0usize..16, at in 0usize..256) {
            let mut full = stripe(c, blocks, seed);
            let n = c.k + c.m;
            let slot = slot % n;
            let at = at % full[slot].len();
            full[slot][at] ^= 0x5a;
            prop_assert!(!c.verify(&full).unwrap());
        }
    }
}
