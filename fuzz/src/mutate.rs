//! A small mutator for the stable corpus runner: no coverage feedback (that needs
//! libFuzzer's instrumentation), but the mutations libFuzzer starts from — bit flips,
//! boundary integers over length and count fields, inserted, deleted, duplicated and
//! spliced ranges — applied to the checked-in seeds, which already get past the magic
//! numbers and headers a random byte string never would.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Longest input the runner builds; the decoders' own limits are far above, but hostile
/// length fields are what matters, not long inputs.
pub const INPUT_BYTES_MAX: usize = 64 << 10;
/// Most mutations stacked on one input.
const MUTATIONS_MAX: usize = 8;

/// Values that sit on the limits of one-, two-, four- and eight-byte fields.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    7,
    8,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xfff,
    0x1000,
    0x7fff,
    0xffff,
    0x1_0000,
    0x0200_0000,
    0x0400_0000,
    0x0400_0001,
    0x7fff_ffff,
    0xffff_ffff,
    0x1_0000_0000,
    u64::MAX / 2,
    u64::MAX - 7,
    u64::MAX,
];

pub struct Mutator {
    rng: SmallRng,
}

impl Mutator {
    pub fn new(seed: u64) -> Self {
        Mutator {
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// Fills `out` with a mutation of one of `seeds` (not empty).
    pub fn next(&mut self, seeds: &[Vec<u8>], out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&seeds[self.rng.gen_range(0..seeds.len())]);
        let n = self.rng.gen_range(1..=MUTATIONS_MAX);
        for _ in 0..n {
            self.mutate_once(seeds, out);
        }
        out.truncate(INPUT_BYTES_MAX);
    }

    fn at(&mut self, len: usize) -> usize {
        if len == 0 {
            0
        } else {
            self.rng.gen_range(0..len)
        }
    }

    fn mutate_once(&mut self, seeds: &[Vec<u8>], out: &mut Vec<u8>) {
        match self.rng.gen_range(0..9) {
            0 if !out.is_empty() => {
                let i = self.at(out.len());
                out[i] ^= 1 << self.rng.gen_range(0..8);
            }
            1 if !out.is_empty() => {
                let i = self.at(out.len());
                out[i] = self.rng.gen();
            }
            2 => {
                // A boundary value, little-endian like every field of ours, in 1-8 bytes.
                let v = INTERESTING[self.rng.gen_range(0..INTERESTING.len())];
                let width = [1usize, 2, 4, 8][self.rng.gen_range(0..4)];
                let i = self.at(out.len());
                let bytes = v.to_le_bytes();
                for (k, b) in bytes[..width].iter().enumerate() {
                    match out.get_mut(i + k) {
                        Some(slot) => *slot = *b,
                        None => out.push(*b),
                    }
                }
            }
            3 => {
                let i = self.at(out.len() + 1).min(out.len());
                let n = self.rng.gen_range(1..=16);
                let fresh: Vec<u8> = (0..n).map(|_| self.rng.gen()).collect();
                out.splice(i..i, fresh);
            }
            4 if !out.is_empty() => {
                let i = self.at(out.len());
                let n = self.rng.gen_range(1..=(out.len() - i).min(64));
                out.drain(i..i + n);
            }
            5 if !out.is_empty() => {
                let i = self.at(out.len());
                let n = self.rng.gen_range(1..=(out.len() - i).min(256));
                let piece = out[i..i + n].to_vec();
                let j = self.at(out.len() + 1).min(out.len());
                out.splice(j..j, piece);
            }
            6 => {
                // Splice in a piece of another seed, or the whole of it (streams).
                let other = &seeds[self.rng.gen_range(0..seeds.len())];
                if other.is_empty() {
                    return;
                }
                let i = self.at(other.len());
                let n = if self.rng.gen() {
                    other.len() - i
                } else {
                    self.rng.gen_range(1..=other.len() - i)
                };
                let j = self.at(out.len() + 1).min(out.len());
                out.splice(j..j, other[i..i + n].iter().copied());
            }
            7 if !out.is_empty() => {
                let n = self.at(out.len());
                out.truncate(n);
            }
            _ => {
                let other = &seeds[self.rng.gen_range(0..seeds.len())];
                out.extend_from_slice(other);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_stay_bounded_and_differ_from_the_seed() {
        let seeds = vec![b"hello world".to_vec(), vec![0u8; 100]];
        let mut m = Mutator::new(1);
        let mut out = Vec::new();
        let mut changed = 0;
        for _ in 0..10_000 {
            m.next(&seeds, &mut out);
            assert!(out.len() <= INPUT_BYTES_MAX);
            changed += usize::from(!seeds.contains(&out));
        }
        assert!(changed > 9_000, "only {changed} of 10,000 inputs were new");
    }
}
