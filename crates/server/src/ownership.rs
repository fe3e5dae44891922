//! Which key-value partitions this server answers for, at which cluster-map epoch. Set by
//! whatever follows the cluster map (the CLI's etcd watcher); checked per request by
//! `exec` for batches routed with a non-zero epoch. Pure: no I/O.

/// Partitions a map may have (the cluster crate's limit; the bitmap is sized by it).
pub const OWNERSHIP_PARTITIONS_MAX: u32 = 65_536;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    epoch: u64,
    partitions: u32,
    owned: Vec<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OwnershipError {
    #[error("epoch 0 means \"no cluster\"; an ownership needs an epoch ≥ 1")]
    ZeroEpoch,
    #[error("{0} partitions: must be 1..={OWNERSHIP_PARTITIONS_MAX}")]
    Partitions(usize),
}

impl Ownership {
    /// `owned[p]`: whether this server is partition `p`'s primary at `epoch`.
    pub fn new(epoch: u64, owned: Vec<bool>) -> Result<Ownership, OwnershipError> {
        if epoch == 0 {
            return Err(OwnershipError::ZeroEpoch);
        }
        if owned.is_empty() || owned.len() > OWNERSHIP_PARTITIONS_MAX as usize {
            return Err(OwnershipError::Partitions(owned.len()));
        }
        Ok(Ownership {
            epoch,
            partitions: owned.len() as u32,
            owned,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// Whether `key`'s partition (by the pinned `partition_of`) is this server's.
    pub fn owns_key(&self, key: &[u8]) -> bool {
        let p = camelot_proto::partition_of(key, self.partitions);
        self.owned.get(p as usize).copied().unwrap_or(false)
    }

    pub fn owned_count(&self) -> usize {
        self.owned.iter().filter(|o| **o).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_owned_by_their_pinned_partition() {
        let mut owned = vec![false; 1024];
        owned[726] = true; // partition_of("user1", 1024), pinned in proto's tests
        let o = Ownership::new(3, owned).unwrap();
        assert!(o.owns_key(b"user1"));
        assert!(!o.owns_key(b"user2"));
        assert_eq!(o.owned_count(), 1);
        assert_eq!(
            Ownership::new(0, vec![true]),
            Err(OwnershipError::ZeroEpoch)
        );
        assert_eq!(
            Ownership::new(1, vec![]),
            Err(OwnershipError::Partitions(0))
        );
    }
}
