//! The superblock: a volume's metadata, written at the start of every member's region so
//! `open` needs only one reachable member. Bytes read back from a server are outside
//! input: the decoder is bounded, never panics and checks a CRC (proptested on garbage,
//! fuzzed as `decode_superblock`).
//!
//! Layout (little-endian): magic `CMLTVOL1` | version u16 | level u8 | k u8 | m u8 |
//! members u8 | name_len u8 | chunk_bytes u64 | stripes u64 | generation u64 | name |
//! per member: state u8, ip tag u8 (4 or 6), ip 16 bytes, port u16, region u64 | crc32.

use crate::layout::{Layout, Level, MEMBERS_MAX};
use crate::BlocksError;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const MAGIC: [u8; 8] = *b"CMLTVOL1";
pub const VERSION: u16 = 1;
/// Bytes reserved for the superblock at the start of each member region.
pub const SUPERBLOCK_BYTES: u64 = 4096;
/// Longest volume name (it becomes part of region names).
pub const NAME_BYTES_MAX: usize = 64;

const HEADER_BYTES: usize = 8 + 2 + 5 + 24;
const MEMBER_BYTES: usize = 1 + 1 + 16 + 2 + 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    /// Holds current data.
    Active,
    /// Unreachable or replaced and not yet rebuilt: nothing on it is trusted.
    Missing,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub addr: SocketAddr,
    pub region: u64,
    pub state: MemberState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub name: String,
    pub layout: Layout,
    /// Bumped on every membership or state change; `open` trusts the highest it reads.
    pub generation: u64,
    pub members: Vec<Member>,
}

fn level_code(level: Level) -> (u8, u8, u8) {
    match level {
        Level::Raid0 => (0, 0, 0),
        Level::Raid1 => (1, 0, 0),
        Level::Raid4 => (4, 0, 0),
        Level::Raid5 => (5, 0, 0),
        Level::Rs { k, m } => (6, k, m),
    }
}

/// Whether a name is usable: short, and plain (it is embedded in region names).
pub fn check_name(name: &str) -> Result<(), BlocksError> {
    let ok = !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(BlocksError::InvalidArgument(format!(
            "a volume name is 1 to {NAME_BYTES_MAX} of [A-Za-z0-9._-], not {name:?}"
        )))
    }
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let (code, k, m) = level_code(self.layout.level);
        let mut out = Vec::with_capacity(HEADER_BYTES + self.members.len() * MEMBER_BYTES + 80);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&[code, k, m, self.members.len() as u8, self.name.len() as u8]);
        out.extend_from_slice(&self.layout.chunk_bytes.to_le_bytes());
        out.extend_from_slice(&self.layout.stripes.to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        for mem in &self.members {
            out.push(match mem.state {
                MemberState::Active => 0,
                MemberState::Missing => 1,
            });
            let (tag, ip) = match mem.addr.ip() {
                IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
                IpAddr::V6(v6) => (6u8, v6.octets()),
            };
            out.push(tag);
            out.extend_from_slice(&ip);
            out.extend_from_slice(&mem.addr.port().to_le_bytes());
            out.extend_from_slice(&mem.region.to_le_bytes());
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes a superblock from the first bytes of a member region (trailing bytes are
    /// ignored). Never panics; every count is checked before it is used.
    pub fn decode(bytes: &[u8]) -> Result<Superblock, BlocksError> {
        let bad = |why: &str| BlocksError::BadSuperblock(why.to_string());
        let mut r = Reader { bytes, at: 0 };
        if r.take(8)? != MAGIC {
            return Err(bad("not a Camelot volume (bad magic)"));
        }
        let version = u16::from_le_bytes(r.array()?);
        if version != VERSION {
            return Err(bad(&format!("superblock version {version}, not {VERSION}")));
        }
        let [code, k, m, members, name_len] = r.array()?;
        let chunk_bytes = u64::from_le_bytes(r.array()?);
        let stripes = u64::from_le_bytes(r.array()?);
        let generation = u64::from_le_bytes(r.array()?);
        let (members, name_len) = (usize::from(members), usize::from(name_len));
        if members == 0 || members > MEMBERS_MAX {
            return Err(bad("member count out of range"));
        }
        if name_len > NAME_BYTES_MAX {
            return Err(bad("name too long"));
        }
        let name = std::str::from_utf8(r.take(name_len)?)
            .map_err(|_| bad("name is not UTF-8"))?
            .to_string();
        check_name(&name).map_err(|_| bad("name has characters a volume name may not"))?;
        let mut list = Vec::with_capacity(members);
        for _ in 0..members {
            let state = match r.array::<1>()?[0] {
                0 => MemberState::Active,
                1 => MemberState::Missing,
                _ => return Err(bad("unknown member state")),
            };
            let tag = r.array::<1>()?[0];
            let ip = Ipv6Addr::from(r.array::<16>()?);
            let ip = match tag {
                4 => IpAddr::V4(
                    ip.to_ipv4_mapped()
                        .ok_or_else(|| bad("IPv4 member is not v4-mapped"))?,
                ),
                6 => IpAddr::V6(ip),
                _ => return Err(bad("unknown address tag")),
            };
            let port = u16::from_le_bytes(r.array()?);
            let region = u64::from_le_bytes(r.array()?);
            list.push(Member {
                addr: SocketAddr::new(ip, port),
                region,
                state,
            });
        }
        let body = r.at;
        let crc = u32::from_le_bytes(r.array()?);
        if crc32fast::hash(&bytes[..body]) != crc {
            return Err(bad("checksum mismatch"));
        }
        let level = match code {
            0 => Level::Raid0,
            1 => Level::Raid1,
            4 => Level::Raid4,
            5 => Level::Raid5,
            6 => Level::Rs { k, m },
            _ => return Err(bad("unknown level")),
        };
        // Re-derive the layout through the same checks `create` uses, then pin stripes.
        let probe = Layout::new(level, members, chunk_bytes, 1)
            .map_err(|e| bad(&format!("impossible layout: {e}")))?;
        if stripes == 0 || stripes > crate::layout::STRIPES_MAX {
            return Err(bad("stripe count out of range"));
        }
        Ok(Superblock {
            name,
            layout: Layout { stripes, ..probe },
            generation,
            members: list,
        })
    }
}

/// Bytes of the rebuild progress record, kept in the last bytes of each member's reserved
/// superblock space (a superblock encodes to at most ~1 KiB: `fits_its_reserved_space`).
pub const PROGRESS_BYTES: u64 = 64;
/// Where the progress record starts in a member region.
pub const PROGRESS_OFFSET: u64 = SUPERBLOCK_BYTES - PROGRESS_BYTES;
pub const PROGRESS_MAGIC: [u8; 8] = *b"CMLTRBLD";
const PROGRESS_BODY_BYTES: usize = 8 + 8 * 6;
const _: () = assert!(PROGRESS_BODY_BYTES + 4 <= PROGRESS_BYTES as usize);

/// How far a rebuild has come, written by the rebuilding process to every present member
/// at a bounded rate, so another process (`camelot volume status`) can read it. It
/// describes the rebuild of `member` onto region `region`; it is current only while the
/// superblock still lists that member as missing on that region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RebuildProgress {
    pub member: usize,
    /// The replacement's region id: a record of an earlier, abandoned rebuild names
    /// another region.
    pub region: u64,
    pub stripes_done: u64,
    pub stripes_total: u64,
    /// The rebuild's rate limit (0: unlimited).
    pub rate_bytes_per_s: u64,
    /// When it was written (Unix time, milliseconds).
    pub updated_unix_ms: u64,
}

impl RebuildProgress {
    /// Layout (little-endian): magic | member u64 | region | done | total | rate |
    /// updated | crc32 of the preceding bytes | zero padding to `PROGRESS_BYTES`.
    pub fn encode(&self) -> [u8; PROGRESS_BYTES as usize] {
        let mut out = [0u8; PROGRESS_BYTES as usize];
        out[..8].copy_from_slice(&PROGRESS_MAGIC);
        let fields = [
            self.member as u64,
            self.region,
            self.stripes_done,
            self.stripes_total,
            self.rate_bytes_per_s,
            self.updated_unix_ms,
        ];
        for (i, f) in fields.iter().enumerate() {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        let crc = crc32fast::hash(&out[..PROGRESS_BODY_BYTES]);
        out[PROGRESS_BODY_BYTES..PROGRESS_BODY_BYTES + 4].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// `Ok(None)` for a cleared record (all zeros); an error for anything else that is not
    /// a well-formed record. Never panics (the bytes come from a server).
    pub fn decode(bytes: &[u8]) -> Result<Option<RebuildProgress>, BlocksError> {
        let bad = |why: &str| BlocksError::BadSuperblock(format!("rebuild progress: {why}"));
        let mut r = Reader { bytes, at: 0 };
        let magic: [u8; 8] = r.array()?;
        if magic == [0u8; 8] {
            return Ok(None);
        }
        if magic != PROGRESS_MAGIC {
            return Err(bad("bad magic"));
        }
        let mut f = [0u64; 6];
        for v in f.iter_mut() {
            *v = u64::from_le_bytes(r.array()?);
        }
        let crc = u32::from_le_bytes(r.array()?);
        if crc32fast::hash(&bytes[..PROGRESS_BODY_BYTES]) != crc {
            return Err(bad("checksum mismatch"));
        }
        let [member, region, stripes_done, stripes_total, rate_bytes_per_s, updated_unix_ms] = f;
        if member >= MEMBERS_MAX as u64 || stripes_done > stripes_total {
            return Err(bad("fields out of range"));
        }
        Ok(Some(RebuildProgress {
            member: member as usize,
            region,
            stripes_done,
            stripes_total,
            rate_bytes_per_s,
            updated_unix_ms,
        }))
    }
}

/// Reads fixed-size fields off a byte slice, failing (never panicking) past its end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BlocksError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| BlocksError::BadSuperblock("truncated".into()))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], BlocksError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

/// The v4 loopback address, for tests and defaults.
pub const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(members: usize) -> Superblock {
        Superblock {
            name: "vol-1".into(),
            layout: Layout::new(Level::Raid5, members, 65536, 10 << 20).unwrap(),
            generation: 7,
            members: (0..members)
                .map(|i| Member {
                    addr: SocketAddr::new(LOOPBACK, 7000 + i as u16),
                    region: 100 + i as u64,
                    state: if i == 1 {
                        MemberState::Missing
                    } else {
                        MemberState::Active
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn fits_its_reserved_space() {
        let sb = Superblock {
            name: "x".repeat(NAME_BYTES_MAX),
            ..sample(MEMBERS_MAX)
        };
        let mut sb = sb;
        sb.members.iter_mut().for_each(|m| {
            m.addr = "[::1]:1".parse().unwrap();
        });
        // The progress record lives in the reserved space's last bytes.
        assert!(sb.encode().len() as u64 <= PROGRESS_OFFSET);
    }

    #[test]
    fn a_flipped_byte_is_caught() {
        let bytes = sample(4).encode();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            assert!(Superblock::decode(&b).is_err(), "byte {i}");
        }
    }

    #[test]
    fn a_cleared_progress_record_is_none_and_a_flipped_byte_is_caught() {
        assert_eq!(RebuildProgress::decode(&[0u8; 64]).unwrap(), None);
        let p = RebuildProgress {
            member: 3,
            region: 77,
            stripes_done: 10,
            stripes_total: 20,
            rate_bytes_per_s: 1 << 20,
            updated_unix_ms: 1_700_000_000_000,
        };
        let bytes = p.encode();
        for i in 0..PROGRESS_BODY_BYTES + 4 {
            let mut b = bytes;
            b[i] ^= 0x10;
            assert!(RebuildProgress::decode(&b).is_err(), "byte {i}");
        }
        assert!(RebuildProgress::decode(&bytes[..40]).is_err(), "truncated");
    }

    proptest! {
        #[test]
        fn round_trips(members in 3usize..=MEMBERS_MAX, generation: u64, v6: bool,
                       region: u64, stripes in 1u64..1000) {
            let mut sb = sample(members);
            sb.generation = generation;
            sb.layout.stripes = stripes;
            if v6 {
                sb.members[0].addr = "[::1]:9".parse().unwrap();
            }
            sb.members[2].region = region;
            let mut bytes = sb.encode();
            bytes.extend_from_slice(&[0u8; 100]);
            prop_assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Superblock::decode(&bytes);
        }

        #[test]
        fn garbage_after_the_magic_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mut bytes = MAGIC.to_vec();
            bytes.extend_from_slice(&VERSION.to_le_bytes());
            bytes.extend_from_slice(&tail);
            let _ = Superblock::decode(&bytes);
        }

        #[test]
        fn progress_round_trips(member in 0usize..MEMBERS_MAX, region: u64, total: u64,
                                done_part in 0u64..=1000, rate: u64, updated: u64) {
            let p = RebuildProgress {
                member,
                region,
                stripes_done: (total as u128 * done_part as u128 / 1000) as u64,
                stripes_total: total,
                rate_bytes_per_s: rate,
                updated_unix_ms: updated,
            };
            prop_assert_eq!(RebuildProgress::decode(&p.encode()).unwrap(), Some(p));
        }

        #[test]
        fn progress_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = RebuildProgress::decode(&bytes);
            let mut b = PROGRESS_MAGIC.to_vec();
            b.extend_from_slice(&bytes);
            let _ = RebuildProgress::decode(&b);
        }

        #[test]
        fn truncation_is_an_error(cut in 0usize..200) {
            let bytes = sample(4).encode();
            let cut = cut % bytes.len();
            prop_assert!(Superblock::decode(&bytes[..cut]).is_err());
        }
    }
}
