//! YCSB's request generators, as its core package defines them (`ZipfianGenerator`,
//! `ScrambledZipfianGenerator`, `SkewedLatestGenerator`, `HotspotIntegerGenerator`,
//! `UniformLongGenerator`, `AcknowledgedCounterGenerator`, `Utils.fnvhash64`), so key
//! popularity matches what YCSB numbers elsewhere mean. Pure: the caller brings the
//! random numbers.

use parking_lot::Mutex;
use rand::Rng;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

/// YCSB's zipfian constant.
pub const ZIPFIAN_CONSTANT: f64 = 0.99;
/// The item space `ScrambledZipfianGenerator` draws from before hashing into the key range.
const SCRAMBLED_ITEM_COUNT: u64 = 10_000_000_000;
/// zeta(SCRAMBLED_ITEM_COUNT, 0.99), precomputed by YCSB (summing 10^10 terms is not an
/// option at start-up).
const SCRAMBLED_ZETAN: f64 = 26.469_028_201_783_02;

/// YCSB's `Utils.fnvhash64`: FNV-1a over the 8 bytes of `v`, low byte first, made
/// non-negative as Java's `Math.abs` does.
pub fn fnvhash64(v: u64) -> u64 {
    const OFFSET_BASIS: u64 = 0xCBF2_9CE4_8422_2325;
    const PRIME: u64 = 1_099_511_628_211;
    let mut val = v;
    let mut h = OFFSET_BASIS;
    for _ in 0..8 {
        h ^= val & 0xff;
        val >>= 8;
        h = h.wrapping_mul(PRIME);
    }
    (h as i64).unsigned_abs()
}

/// `CoreWorkload.buildKeyName` with hashed (not ordered) inserts.
pub fn key_name(keynum: u64) -> String {
    format!("user{}", fnvhash64(keynum))
}

fn zeta(from: u64, to: u64, theta: f64, initial: f64) -> f64 {
    (from..to).fold(initial, |sum, i| sum + 1.0 / ((i + 1) as f64).powf(theta))
}

/// Zipfian over `[base, base + items)`: item `base` is the most popular.
#[derive(Debug, Clone)]
pub struct Zipfian {
    base: u64,
    items: u64,
    theta: f64,
    alpha: f64,
    zeta2theta: f64,
    zetan: f64,
    eta: f64,
    count_for_zeta: u64,
}

impl Zipfian {
    pub fn new(base: u64, items: u64) -> Zipfian {
        let zetan = zeta(0, items, ZIPFIAN_CONSTANT, 0.0);
        Zipfian::with_zetan(base, items, zetan)
    }

    fn with_zetan(base: u64, items: u64, zetan: f64) -> Zipfian {
        let theta = ZIPFIAN_CONSTANT;
        let zeta2theta = zeta(0, 2, theta, 0.0);
        let mut z = Zipfian {
            base,
            items,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zeta2theta,
            zetan,
            eta: 0.0,
            count_for_zeta: items,
        };
        z.eta = z.eta_for(items);
        z
    }

    fn eta_for(&self, items: u64) -> f64 {
        (1.0 - (2.0 / items as f64).powf(1.0 - self.theta)) / (1.0 - self.zeta2theta / self.zetan)
    }

    /// The next value over the first `items` items; the item count may grow between
    /// calls (as the latest distribution's does), and zeta is extended incrementally.
    pub fn next_over(&mut self, items: u64, u: f64) -> u64 {
        if items > self.count_for_zeta {
            self.zetan = zeta(self.count_for_zeta, items, self.theta, self.zetan);
            self.count_for_zeta = items;
            self.items = items;
            self.eta = self.eta_for(items);
        }
        let uz = u * self.zetan;
        if uz < 1.0 {
            return self.base;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return self.base + 1;
        }
        let v = (self.items as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        self.base + v.min(self.items.saturating_sub(1))
    }

    pub fn next(&mut self, u: f64) -> u64 {
        self.next_over(self.items, u)
    }
}

/// How a workload picks the keys it reads and updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distribution {
    Zipfian,
    Uniform,
    Latest,
    Hotspot,
}

impl Distribution {
    pub fn parse(s: &str) -> Option<Distribution> {
        Some(match s {
            "zipfian" => Distribution::Zipfian,
            "uniform" => Distribution::Uniform,
            "latest" => Distribution::Latest,
            "hotspot" => Distribution::Hotspot,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Distribution::Zipfian => "zipfian",
            Distribution::Uniform => "uniform",
            Distribution::Latest => "latest",
            Distribution::Hotspot => "hotspot",
        }
    }
}

/// YCSB's hotspot defaults: 20% of the keys get 80% of the operations.
const HOTSET_FRACTION: f64 = 0.2;
const HOT_OP_FRACTION: f64 = 0.8;

/// Picks key numbers for one client thread.
#[derive(Debug, Clone)]
pub enum KeyChooser {
    /// Scrambled zipfian over `[0, items)`.
    Zipfian {
        zipf: Zipfian,
        items: u64,
    },
    Uniform {
        items: u64,
    },
    /// Skewed towards the most recently inserted key.
    Latest {
        zipf: Zipfian,
    },
    Hotspot {
        items: u64,
    },
}

impl KeyChooser {
    /// `records` loaded, plus room for the inserts the run phase expects (YCSB sizes the
    /// zipfian key space the same way, so inserted keys get their share).
    pub fn new(d: Distribution, records: u64, expected_inserts: u64) -> KeyChooser {
        match d {
            Distribution::Zipfian => KeyChooser::Zipfian {
                zipf: Zipfian::with_zetan(0, SCRAMBLED_ITEM_COUNT, SCRAMBLED_ZETAN),
                items: records + expected_inserts,
            },
            Distribution::Uniform => KeyChooser::Uniform { items: records },
            Distribution::Latest => KeyChooser::Latest {
                zipf: Zipfian::new(0, records.max(1)),
            },
            Distribution::Hotspot => KeyChooser::Hotspot { items: records },
        }
    }

    /// The next key number, never past `last_inserted` (keys not acknowledged yet are
    /// not asked for, as in YCSB).
    pub fn next(&mut self, rng: &mut impl Rng, last_inserted: u64) -> u64 {
        match self {
            KeyChooser::Zipfian { zipf, items } => loop {
                let raw = zipf.next(rng.gen::<f64>());
                let k = fnvhash64(raw) % *items;
                if k <= last_inserted {
                    return k;
                }
            },
            KeyChooser::Uniform { items } => rng.gen_range(0..*items).min(last_inserted),
            KeyChooser::Latest { zipf } => {
                let max = last_inserted + 1;
                last_inserted - zipf.next_over(max, rng.gen::<f64>()).min(last_inserted)
            }
            KeyChooser::Hotspot { items } => {
                let hot = ((*items as f64 * HOTSET_FRACTION) as u64).max(1);
                let cold = items.saturating_sub(hot).max(1);
                let k = if rng.gen::<f64>() < HOT_OP_FRACTION {
                    rng.gen_range(0..hot)
                } else {
                    hot + rng.gen_range(0..cold)
                };
                k.min(last_inserted)
            }
        }
    }
}

/// Most inserts that may be in flight (handed out but not acknowledged) at once.
pub const INSERTS_IN_FLIGHT_MAX: usize = 1 << 16;

/// YCSB's `AcknowledgedCounterGenerator`: hands out insert key numbers and reports the
/// highest one below which every insert has finished, so readers never ask for a key
/// that may not exist yet.
#[derive(Debug)]
pub struct InsertCounter {
    next: AtomicU64,
    done: Mutex<(u64, BTreeSet<u64>)>,
}

impl InsertCounter {
    /// Keys `0..start` already exist.
    pub fn new(start: u64) -> InsertCounter {
        InsertCounter {
            next: AtomicU64::new(start),
            done: Mutex::new((start, BTreeSet::new())),
        }
    }

    pub fn next(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    pub fn acknowledge(&self, keynum: u64) {
        let mut g = self.done.lock();
        let (limit, pending) = &mut *g;
        if keynum == *limit {
            *limit += 1;
            while pending.remove(limit) {
                *limit += 1;
            }
        } else if pending.len() < INSERTS_IN_FLIGHT_MAX {
            pending.insert(keynum);
        }
    }

    /// The highest key number known to exist.
    pub fn last(&self) -> u64 {
        self.done.lock().0.saturating_sub(1)
    }

    /// Key numbers handed out so far (an upper bound on the keys that exist).
    pub fn issued(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn fnvhash64_matches_ycsb() {
        // Values from YCSB's Utils.fnvhash64 (Java), for keys people see in YCSB runs.
        assert_eq!(key_name(0), "user6284781860667377211");
        assert_eq!(key_name(1), "user8517097267634966620");
    }

    #[test]
    fn zipfian_is_skewed_towards_low_items() {
        let mut z = Zipfian::new(0, 1000);
        let mut rng = SmallRng::seed_from_u64(7);
        let mut counts = vec![0u32; 1000];
        for _ in 0..100_000 {
            counts[z.next(rng.gen()) as usize] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[10] && counts[10] > counts[500]);
        // With theta 0.99 over 1000 items the top item takes about 13% of draws.
        assert!((10_000..16_000).contains(&counts[0]), "{}", counts[0]);
    }

    #[test]
    fn every_chooser_stays_in_range() {
        let mut rng = SmallRng::seed_from_u64(3);
        for d in [
            Distribution::Zipfian,
            Distribution::Uniform,
            Distribution::Latest,
            Distribution::Hotspot,
        ] {
            let mut c = KeyChooser::new(d, 500, 100);
            for _ in 0..10_000 {
                assert!(c.next(&mut rng, 499) <= 499, "{d:?}");
            }
        }
    }

    #[test]
    fn latest_prefers_recent_keys_and_hotspot_its_hot_set() {
        let mut rng = SmallRng::seed_from_u64(5);
        let mut latest = KeyChooser::new(Distribution::Latest, 1000, 0);
        let recent = (0..10_000)
            .filter(|_| latest.next(&mut rng, 999) >= 990)
            .count();
        assert!(recent > 3_000, "{recent}");
        let mut hot = KeyChooser::new(Distribution::Hotspot, 1000, 0);
        let in_hot = (0..10_000)
            .filter(|_| hot.next(&mut rng, 999) < 200)
            .count();
        assert!((7_500..8_500).contains(&in_hot), "{in_hot}");
    }

    #[test]
    fn insert_counter_reports_only_contiguous_completions() {
        let c = InsertCounter::new(10);
        let (a, b, d) = (c.next(), c.next(), c.next());
        assert_eq!((a, b, d), (10, 11, 12));
        assert_eq!(c.last(), 9);
        c.acknowledge(11);
        assert_eq!(c.last(), 9);
        c.acknowledge(10);
        assert_eq!(c.last(), 11);
        c.acknowledge(12);
        assert_eq!(c.last(), 12);
    }
}
