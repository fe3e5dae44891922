//! Where every byte of a volume lives: the level, the members, the chunk size, and the
//! mapping from a stripe's slots (data then parity) to members. Pure: no sockets, no
//! clocks, proptested.

use crate::BlocksError;

/// Most members a volume may have (the superblock lists each one).
pub const MEMBERS_MAX: usize = 32;
/// Smallest chunk: the unit a 4 KiB random write touches.
pub const CHUNK_BYTES_MIN: u64 = 4096;
/// Largest chunk: one READ/WRITE request must carry a whole chunk with room to spare.
pub const CHUNK_BYTES_MAX: u64 = 4 << 20;
/// The default chunk, as the issue asks.
pub const CHUNK_BYTES_DEFAULT: u64 = 64 << 10;
/// Most stripes a volume may have: bounds the intent words (8 bytes a stripe) on each
/// member and the work a resync or scrub can be asked to do.
pub const STRIPES_MAX: u64 = 1 << 24;

/// A redundancy level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// Striping, no redundancy: every member holds data.
    Raid0,
    /// An n-way mirror: every member holds every byte.
    Raid1,
    /// Striping with XOR parity on one dedicated member (the last).
    Raid4,
    /// Striping with XOR parity rotating over the members.
    Raid5,
    /// Reed–Solomon: `k` data and `m` parity chunks a stripe, parity rotating; any `m`
    /// members may be lost.
    Rs { k: u8, m: u8 },
}

impl Level {
    /// Parses `raid0`, `raid1`, `raid4`, `raid5`, `rs:K+M`.
    pub fn parse(text: &str) -> Result<Level, BlocksError> {
        let bad = || BlocksError::InvalidArgument(format!("unknown level {text:?}"));
        match text {
            "raid0" => Ok(Level::Raid0),
            "raid1" => Ok(Level::Raid1),
            "raid4" => Ok(Level::Raid4),
            "raid5" => Ok(Level::Raid5),
            _ => {
                let rest = text.strip_prefix("rs:").ok_or_else(bad)?;
                let (k, m) = rest.split_once('+').ok_or_else(bad)?;
                let k: u8 = k.parse().map_err(|_| bad())?;
                let m: u8 = m.parse().map_err(|_| bad())?;
                Ok(Level::Rs { k, m })
            }
        }
    }

    pub fn name(self) -> String {
        match self {
            Level::Raid0 => "raid0".into(),
            Level::Raid1 => "raid1".into(),
            Level::Raid4 => "raid4".into(),
            Level::Raid5 => "raid5".into(),
            Level::Rs { k, m } => format!("rs:{k}+{m}"),
        }
    }
}

/// How a stripe's parity slots are computed from its data slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// No parity (raid0).
    None,
    /// Every parity slot is a copy of the one data slot (raid1).
    Mirror,
    /// One parity slot, the XOR of the data slots (raid4, raid5).
    Xor,
    /// Reed–Solomon with `m` parity slots over `k` data slots.
    Rs,
}

/// The shape of a volume: pure arithmetic over level, members, chunk and stripes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub level: Level,
    pub members: usize,
    pub chunk_bytes: u64,
    pub stripes: u64,
}

impl Layout {
    /// The smallest layout holding `size_bytes` of data (rounded up to whole stripes).
    pub fn new(
        level: Level,
        members: usize,
        chunk_bytes: u64,
        size_bytes: u64,
    ) -> Result<Layout, BlocksError> {
        let invalid = |what: String| Err(BlocksError::InvalidArgument(what));
        let shape_ok =
            (2..=MEMBERS_MAX).contains(&members) || (members == 1 && level == Level::Raid0);
        if !shape_ok {
            return invalid(format!(
                "a volume has 2 to {MEMBERS_MAX} members, not {members}"
            ));
        }
        if !chunk_bytes.is_power_of_two()
            || !(CHUNK_BYTES_MIN..=CHUNK_BYTES_MAX).contains(&chunk_bytes)
        {
            return invalid(format!(
                "the chunk size must be a power of two from {CHUNK_BYTES_MIN} to \
                 {CHUNK_BYTES_MAX}, not {chunk_bytes}"
            ));
        }
        match level {
            Level::Raid4 | Level::Raid5 if members < 3 => {
                return invalid(format!("{} needs at least 3 members", level.name()));
            }
            Level::Rs { k, m }
                if k == 0 || m == 0 || usize::from(k) + usize::from(m) != members =>
            {
                return invalid(format!(
                    "rs:{k}+{m} needs k ≥ 1, m ≥ 1 and k + m = {members} members"
                ));
            }
            _ => {}
        }
        let mut layout = Layout {
            level,
            members,
            chunk_bytes,
            stripes: 0,
        };
        if size_bytes == 0 {
            return invalid("a volume must hold at least one byte".into());
        }
        let stripes = size_bytes.div_ceil(layout.stripe_data_bytes());
        if stripes > STRIPES_MAX {
            return invalid(format!(
                "{size_bytes} bytes need {stripes} stripes, more than {STRIPES_MAX}; use a \
                 larger chunk"
            ));
        }
        layout.stripes = stripes;
        Ok(layout)
    }

    /// Data slots a stripe (k).
    pub fn data_slots(&self) -> usize {
        match self.level {
            Level::Raid0 => self.members,
            Level::Raid1 => 1,
            Level::Raid4 | Level::Raid5 => self.members - 1,
            Level::Rs { k, .. } => usize::from(k),
        }
    }

    /// Parity (or copy) slots a stripe (m): how many members may be lost.
    pub fn parity_slots(&self) -> usize {
        self.members - self.data_slots()
    }

    pub fn code(&self) -> Code {
        match self.level {
            Level::Raid0 => Code::None,
            Level::Raid1 => Code::Mirror,
            Level::Raid4 | Level::Raid5 => Code::Xor,
            Level::Rs { .. } => Code::Rs,
        }
    }

    pub fn stripe_data_bytes(&self) -> u64 {
        self.chunk_bytes * self.data_slots() as u64
    }

    /// Bytes the volume holds for its user.
    pub fn capacity_bytes(&self) -> u64 {
        self.stripes * self.stripe_data_bytes()
    }

    /// Memory used per byte stored (n / k).
    pub fn memory_overhead(&self) -> f64 {
        self.members as f64 / self.data_slots() as f64
    }

    /// Which member holds `slot` (0..k data, k..n parity) of `stripe`. raid4 keeps parity
    /// on the last member; raid1, raid5 and rs rotate by one member a stripe, so parity
    /// (and raid1's preferred copy) spreads evenly.
    pub fn member_of(&self, stripe: u64, slot: usize) -> usize {
        let n = self.members;
        match self.level {
            Level::Raid0 | Level::Raid4 => slot,
            Level::Raid1 | Level::Raid5 | Level::Rs { .. } => {
                (slot + (stripe % n as u64) as usize) % n
            }
        }
    }

    /// The inverse of [`Layout::member_of`].
    pub fn slot_of(&self, stripe: u64, member: usize) -> usize {
        let n = self.members;
        match self.level {
            Level::Raid0 | Level::Raid4 => member,
            Level::Raid1 | Level::Raid5 | Level::Rs { .. } => {
                (member + n - (stripe % n as u64) as usize) % n
            }
        }
    }

    /// Where a stripe's chunk starts in a member's data area.
    pub fn chunk_offset(&self, stripe: u64) -> u64 {
        stripe * self.chunk_bytes
    }

    /// Bytes of data area on each member.
    pub fn member_data_bytes(&self) -> u64 {
        self.stripes * self.chunk_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn level() -> impl Strategy<Value = (Level, usize)> {
        prop_oneof![
            (1usize..=8).prop_map(|n| (Level::Raid0, n)),
            (2usize..=5).prop_map(|n| (Level::Raid1, n)),
            (3usize..=8).prop_map(|n| (Level::Raid4, n)),
            (3usize..=8).prop_map(|n| (Level::Raid5, n)),
            (1u8..=6, 1u8..=3).prop_map(|(k, m)| (Level::Rs { k, m }, usize::from(k + m))),
        ]
    }

    #[test]
    fn levels_parse_and_print() {
        for text in ["raid0", "raid1", "raid4", "raid5", "rs:4+2", "rs:10+4"] {
            assert_eq!(Level::parse(text).unwrap().name(), text);
        }
        for bad in ["raid6", "rs:4", "rs:a+b", "rs:4+2+1", ""] {
            assert!(Level::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(Layout::new(Level::Raid5, 2, 65536, 1).is_err());
        assert!(Layout::new(Level::Raid5, 3, 65535, 1).is_err());
        assert!(Layout::new(Level::Raid5, 3, 1024, 1).is_err());
        assert!(Layout::new(Level::Rs { k: 4, m: 2 }, 5, 65536, 1).is_err());
        assert!(Layout::new(Level::Raid0, 33, 65536, 1).is_err());
        assert!(Layout::new(Level::Raid0, 2, 65536, 0).is_err());
        assert!(Layout::new(Level::Raid0, 2, 4096, u64::MAX).is_err());
    }

    proptest! {
        #[test]
        fn slots_and_members_are_a_bijection((level, n) in level(), stripe in 0u64..10_000) {
            let l = Layout::new(level, n, 4096, 1 << 20).unwrap();
            let mut seen = vec![false; n];
            for slot in 0..n {
                let m = l.member_of(stripe, slot);
                prop_assert!(m < n);
                prop_assert!(!seen[m]);
                seen[m] = true;
                prop_assert_eq!(l.slot_of(stripe, m), slot);
            }
        }

        #[test]
        fn capacity_covers_the_request((level, n) in level(), size in 1u64..(64 << 20)) {
            let l = Layout::new(level, n, 4096, size).unwrap();
            prop_assert!(l.capacity_bytes() >= size);
            prop_assert!(l.capacity_bytes() - size < l.stripe_data_bytes());
            prop_assert_eq!(l.data_slots() + l.parity_slots(), n);
        }

        #[test]
        fn raid5_parity_rotates_evenly(n in 3usize..=8, stripes in 1u64..500) {
            let l = Layout {
                level: Level::Raid5,
                members: n,
                chunk_bytes: 4096,
                stripes,
            };
            let mut parity = vec![0u64; n];
            for s in 0..stripes {
                parity[l.member_of(s, n - 1)] += 1;
            }
            let bound = stripes.div_ceil(n as u64);
            prop_assert!(parity.iter().all(|&p| p <= bound), "{parity:?} > {bound}");
        }
    }
}
