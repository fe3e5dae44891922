//! Where the log, the catalog and the segments' home copies live. One trait, three
//! backends; the transaction logic above it is the same for all.

pub mod file;
pub mod pool;
pub mod redis;
mod resp;

use crate::error::{Result, RvmError};
use crate::record::{Placer, Record};
use bytes::Bytes;

/// Bytes to copy into a segment's home copy when the log is truncated.
#[derive(Debug, Clone)]
pub struct HomeWrite {
    pub seg: u64,
    pub offset: u64,
    pub data: Bytes,
}

/// Storage for one RVM instance. Every method returns only when the backend holds what it
/// wrote (in every pool mirror's memory; acknowledged by Redis; fsync'd to the file),
/// because the caller builds ordering on that.
pub trait Backend: Send + Sync {
    /// A short description for errors and bench output.
    fn describe(&self) -> String;

    /// Appends encoded records (`seq`, bytes) after the last one, in order, in as few
    /// round trips as the backend allows. After a crash, a prefix of them may be present.
    fn append_log(&self, records: &[(u64, Bytes)]) -> Result<()>;

    /// The valid records numbered `first_seq`, `first_seq + 1`, … up to the first missing or
    /// invalid one; later appends go right after the last returned.
    fn scan_log(&self, first_seq: u64) -> Result<Vec<Record>>;

    /// [`Backend::scan_log`] for recovery, reading big Write payloads straight into the
    /// memory `placer` hands out (they come back as `LogOp::Placed`, and
    /// [`Backend::read_log`] must then be able to read them again until the log is reset).
    /// `None` when this backend does not place, or when a record with placed bytes was
    /// torn or corrupt: the caller discards what was placed and calls `scan_log`.
    fn scan_log_placing(
        &self,
        _first_seq: u64,
        _placer: &mut dyn Placer,
    ) -> Result<Option<Vec<Record>>> {
        Ok(None)
    }

    /// `len` bytes of the log at `offset`: the payload of a placed write, for truncation.
    fn read_log(&self, _offset: u64, _len: u64) -> Result<Bytes> {
        Err(RvmError::Corrupt(format!(
            "{} cannot read its log back, yet a placed write needs it",
            self.describe()
        )))
    }

    /// Discards every record (their effects are in the homes and the catalog now); the next
    /// record appended will be `next_seq`.
    fn reset_log(&self, next_seq: u64) -> Result<()>;

    /// Log bytes this backend can hold; a record larger than this can never be committed.
    fn log_capacity_bytes(&self) -> u64;

    /// Both catalog slots (absent or unreadable ones as `None`).
    fn read_catalog_slots(&self) -> Result<[Option<Bytes>; 2]>;
    fn write_catalog_slot(&self, slot: usize, catalog: Bytes) -> Result<()>;

    /// Makes sure a home of `len` zero-initialised bytes exists for `seg` (an existing
    /// one is kept: a crash can leave one behind that no committed record mentions).
    fn create_home(&self, seg: u64, len: u64) -> Result<()>;
    fn write_home(&self, writes: &[HomeWrite]) -> Result<()>;
    /// Copies `out.len()` bytes of the home of `seg`, from `offset`, into `out`. Recovery
    /// asks only for page-aligned ranges inside the segment.
    fn read_home(&self, seg: u64, offset: u64, out: &mut [u8]) -> Result<()>;
    fn drop_home(&self, seg: u64, len: u64) -> Result<()>;

    /// After a recovery: whether replicas disagreed or one was unreachable, so the
    /// recovered state must be written back in full to make them agree again.
    fn needs_resync(&self) -> bool {
        false
    }

    /// After a resync has written the recovered state to every replica: replicas that
    /// were rewritten from another may now be recovered from.
    fn resynced(&self) -> Result<()> {
        Ok(())
    }
}
