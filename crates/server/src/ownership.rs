//! Which key-value partitions this server answers for, at which cluster-map epoch. Set by
//! whatever follows the cluster map (the CLI's etcd watcher); checked per request by
//! `exec` for batches routed with a non-zero epoch. Pure: no I/O.

use std::net::SocketAddr;

/// Partitions a map may have (the cluster crate's limit; the bitmap is sized by it).
pub const OWNERSHIP_PARTITIONS_MAX: u32 = 65_536;
/// Backups one partition may have (the cluster crate's R ≤ 8, less the primary).
pub const BACKUPS_PER_PARTITION_MAX: usize = 7;
/// Other servers one ownership may name as push targets (the cluster crate's node limit).
pub const PEERS_MAX: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    epoch: u64,
    partitions: u32,
    owned: Vec<bool>,
    /// `fenced[p]`: this server leads partition `p` but serves no client of it (a move's
    /// fence): it answers MOVED, yet still sends its backups the copies of writes it took
    /// before the fence that they have not acknowledged, so those writes settle rather
    /// than fail. Empty unless set by [`Ownership::with_fenced`].
    fenced: Vec<bool>,
    /// Empty unless set by [`Ownership::with_replicas`]: no partition has backups.
    replicas: Replicas,
    /// The other servers of the map, which a mover may ask this one to copy a page of
    /// its partitions to (`SCAN_PARTITIONS` with `push_to`). Empty unless set by
    /// [`Ownership::with_peers`]: then it pushes nowhere.
    peers: Vec<Peer>,
    /// `stale_reads[p]`: this server answers GETs on partition `p`, which it holds a
    /// full backup of, from clients that chose a replica read ("may be stale"). Empty
    /// unless set by [`Ownership::with_stale_reads`].
    stale_reads: Vec<bool>,
}

/// A server this one sends its partitions' copies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Peer {
    pub id: u32,
    pub addr: SocketAddr,
}

/// What this server is for one partition at the ownership's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Serves clients; every write is copied to the partition's backups before it is
    /// acknowledged.
    Primary,
    /// Takes the primary's copies (APPLY); clients routed here are told MOVED.
    Backup,
    /// Holds nothing of it.
    None,
}

/// See [`Ownership::lead_of`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lead {
    /// Another server leads the key (or none does, under no map of this server's).
    Elsewhere,
    /// This server leads it, and its writes there need no copy.
    WithoutBackups,
    /// This server leads it, and its writes there are copied to backups.
    WithBackups,
}

/// The replica sets as seen from this server: the backups of the partitions it is
/// primary for (indices into `peers`), and the partitions it is a backup of.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Replicas {
    peers: Vec<Peer>,
    backups: Vec<Vec<u16>>,
    backup_of: Vec<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OwnershipError {
    #[error("epoch 0 means \"no cluster\"; an ownership needs an epoch ≥ 1")]
    ZeroEpoch,
    #[error("{0} partitions: must be 1..={OWNERSHIP_PARTITIONS_MAX}")]
    Partitions(usize),
    #[error("replica lists for {given} partitions, but the ownership has {partitions}")]
    ReplicaPartitions { given: usize, partitions: u32 },
    #[error("the map's servers: {0}")]
    Peers(&'static str),
    #[error("partition {partition}: {reason}")]
    Replicas {
        partition: u32,
        reason: &'static str,
    },
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
            fenced: Vec::new(),
            replicas: Replicas::default(),
            peers: Vec::new(),
            stale_reads: Vec::new(),
        })
    }

    /// Sets the map's other servers (see [`Ownership::peer`]): at most [`PEERS_MAX`],
    /// each id once.
    pub fn with_peers(mut self, peers: Vec<Peer>) -> Result<Ownership, OwnershipError> {
        if peers.len() > PEERS_MAX {
            return Err(OwnershipError::Peers("more servers than a map may have"));
        }
        let mut ids: Vec<u32> = peers.iter().map(|p| p.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(OwnershipError::Peers("the same server id twice"));
        }
        self.peers = peers;
        Ok(self)
    }

    /// Server `id` of the map, when it is one and not this server.
    pub fn peer(&self, id: u32) -> Option<Peer> {
        self.peers.iter().copied().find(|p| p.id == id)
    }

    /// Sets the partitions this server leads under a fence (see [`Ownership::fenced`]):
    /// never one it serves. Call before [`Ownership::with_replicas`], which then accepts
    /// backups for them.
    pub fn with_fenced(mut self, fenced: Vec<bool>) -> Result<Ownership, OwnershipError> {
        if fenced.len() != self.owned.len() {
            return Err(OwnershipError::ReplicaPartitions {
                given: fenced.len(),
                partitions: self.partitions,
            });
        }
        if let Some(p) = (0..self.owned.len()).find(|&p| fenced[p] && self.owned[p]) {
            return Err(OwnershipError::Replicas {
                partition: p as u32,
                reason: "a partition cannot be both served and fenced",
            });
        }
        self.fenced = fenced;
        Ok(self)
    }

    fn leads(&self, p: usize) -> bool {
        self.owned.get(p).copied().unwrap_or(false) || self.fenced.get(p).copied().unwrap_or(false)
    }

    /// Adds the replica sets: `backups[p]`, the servers partition `p`'s writes are copied
    /// to (only for partitions this server owns; at most [`BACKUPS_PER_PARTITION_MAX`],
    /// distinct), and `backup_of[p]`, whether this server holds a backup of `p` (never
    /// one it owns).
    pub fn with_replicas(
        mut self,
        backups: Vec<Vec<Peer>>,
        backup_of: Vec<bool>,
    ) -> Result<Ownership, OwnershipError> {
        for given in [backups.len(), backup_of.len()] {
            if given != self.owned.len() {
                return Err(OwnershipError::ReplicaPartitions {
                    given,
                    partitions: self.partitions,
                });
            }
        }
        let mut peers: Vec<Peer> = Vec::new();
        let mut indexed = Vec::with_capacity(backups.len());
        for (p, set) in backups.into_iter().enumerate() {
            let bad = |reason| OwnershipError::Replicas {
                partition: p as u32,
                reason,
            };
            if set.len() > BACKUPS_PER_PARTITION_MAX {
                return Err(bad("too many backups"));
            }
            if !set.is_empty() && !self.leads(p) {
                return Err(bad(
                    "backups given for a partition this server is not primary of",
                ));
            }
            if backup_of[p] && self.leads(p) {
                return Err(bad(
                    "a server cannot be primary and backup of one partition",
                ));
            }
            let mut idx = Vec::with_capacity(set.len());
            for peer in set {
                let i = match peers.iter().position(|q| *q == peer) {
                    Some(i) => i,
                    None => {
                        peers.push(peer);
                        peers.len() - 1
                    }
                };
                let i = i as u16; // ≤ partitions × 7 distinct peers, far below u16 in practice
                if idx.contains(&i) {
                    return Err(bad("the same backup twice"));
                }
                idx.push(i);
            }
            indexed.push(idx);
        }
        if peers.len() > usize::from(u16::MAX) {
            return Err(OwnershipError::Replicas {
                partition: 0,
                reason: "more distinct backup servers than a map may have",
            });
        }
        self.replicas = Replicas {
            peers,
            backups: indexed,
            backup_of,
        };
        Ok(self)
    }

    /// This server's role for partition `p` (`None` past the partition count).
    pub fn role(&self, p: u32) -> Role {
        if self.owned.get(p as usize).copied().unwrap_or(false) {
            Role::Primary
        } else if self
            .replicas
            .backup_of
            .get(p as usize)
            .copied()
            .unwrap_or(false)
        {
            Role::Backup
        } else {
            Role::None
        }
    }

    /// The servers partition `p`'s writes must reach before they are acknowledged
    /// (empty when this server is not its primary, or it has no backups).
    pub fn backups(&self, p: u32) -> impl Iterator<Item = Peer> + '_ {
        self.replicas
            .backups
            .get(p as usize)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(|&i| self.replicas.peers[usize::from(i)])
    }

    /// Whether any partition this server is primary of has a backup.
    pub fn replicates(&self) -> bool {
        !self.replicas.peers.is_empty()
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// Whether `key`'s partition (by the pinned `partition_of`) is this server's.
    /// Sets the partitions this server serves replica reads of: each must be one it is
    /// a backup of (call after [`Ownership::with_replicas`]). A backup still being filled
    /// should not be among them: it may lack keys, not merely lag.
    pub fn with_stale_reads(mut self, stale_reads: Vec<bool>) -> Result<Ownership, OwnershipError> {
        if stale_reads.len() != self.owned.len() {
            return Err(OwnershipError::ReplicaPartitions {
                given: stale_reads.len(),
                partitions: self.partitions,
            });
        }
        if let Some(p) =
            (0..self.partitions).find(|&p| stale_reads[p as usize] && self.role(p) != Role::Backup)
        {
            return Err(OwnershipError::Replicas {
                partition: p,
                reason: "replica reads of a partition this server is not a backup of",
            });
        }
        self.stale_reads = stale_reads;
        Ok(self)
    }

    /// Whether a GET for `key` may be answered here as a replica read.
    pub fn serves_stale_read(&self, key: &[u8]) -> bool {
        let p = camelot_proto::partition_of(key, self.partitions);
        self.stale_reads.get(p as usize).copied().unwrap_or(false)
    }

    pub fn owns_key(&self, key: &[u8]) -> bool {
        let p = camelot_proto::partition_of(key, self.partitions);
        self.owned.get(p as usize).copied().unwrap_or(false)
    }

    /// What this server is to `key`'s writes: whether it leads the key's partition (serves
    /// it, or holds it under a fence: its unacknowledged writes there are still to be sent
    /// to the backups), and whether that partition has backups its writes must reach.
    pub fn lead_of(&self, key: &[u8]) -> Lead {
        let p = camelot_proto::partition_of(key, self.partitions);
        if !self.leads(p as usize) {
            Lead::Elsewhere
        } else if self.backups(p).next().is_none() {
            Lead::WithoutBackups
        } else {
            Lead::WithBackups
        }
    }

    /// Whether this ownership makes the server primary of a partition `before` did not
    /// (`None`: it had none) — a promotion or a move's switch.
    pub fn gains_primaries_over(&self, before: Option<&Ownership>) -> bool {
        match before {
            None => self.owned.iter().any(|o| *o),
            Some(b) => self
                .owned
                .iter()
                .enumerate()
                .any(|(p, o)| *o && !b.owned.get(p).copied().unwrap_or(false)),
        }
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

    fn peer(id: u32) -> Peer {
        Peer {
            id,
            addr: SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16)),
        }
    }

    #[test]
    fn roles_and_backups_follow_the_replica_sets() {
        // Four partitions: primary of 0 (backups 1, 2) and 1 (backup 2), backup of 2.
        let o = Ownership::new(5, vec![true, true, false, false])
            .unwrap()
            .with_replicas(
                vec![vec![peer(1), peer(2)], vec![peer(2)], vec![], vec![]],
                vec![false, false, true, false],
            )
            .unwrap();
        assert_eq!(
            (0..4).map(|p| o.role(p)).collect::<Vec<_>>(),
            [Role::Primary, Role::Primary, Role::Backup, Role::None]
        );
        assert_eq!(o.backups(0).collect::<Vec<_>>(), [peer(1), peer(2)]);
        assert_eq!(o.backups(1).collect::<Vec<_>>(), [peer(2)]);
        assert_eq!(o.backups(2).count(), 0);
        assert_eq!(o.backups(99).count(), 0);
        assert!(o.replicates());
        assert!(!Ownership::new(5, vec![true]).unwrap().replicates());
    }

    #[test]
    fn a_fenced_partition_keeps_its_backups_but_serves_no_client() {
        // Partition 0 served, 1 fenced (both with a backup), 2 neither.
        let fenced = || {
            Ownership::new(5, vec![true, false, false])
                .unwrap()
                .with_fenced(vec![false, true, false])
                .unwrap()
        };
        let o = fenced()
            .with_replicas(
                vec![vec![peer(1)], vec![peer(1)], vec![]],
                vec![false, false, false],
            )
            .unwrap();
        let key_of = |p: u32| {
            (0u32..)
                .map(|i| format!("k{i}"))
                .find(|k| camelot_proto::partition_of(k.as_bytes(), 3) == p)
                .unwrap()
        };
        let (k0, k1, k2) = (key_of(0), key_of(1), key_of(2));
        assert!(o.owns_key(k0.as_bytes()) && o.lead_of(k0.as_bytes()) == Lead::WithBackups);
        assert!(!o.owns_key(k1.as_bytes()) && o.lead_of(k1.as_bytes()) == Lead::WithBackups);
        assert!(!o.owns_key(k2.as_bytes()) && o.lead_of(k2.as_bytes()) == Lead::Elsewhere);
        let unreplicated = fenced()
            .with_replicas(vec![vec![]; 3], vec![false; 3])
            .unwrap();
        assert_eq!(unreplicated.lead_of(k1.as_bytes()), Lead::WithoutBackups);
        assert_eq!(o.backups(1).collect::<Vec<_>>(), [peer(1)]);
        // Not fenced and not served: backups for it are refused; nor fenced and backup.
        assert!(fenced()
            .with_replicas(vec![vec![], vec![], vec![peer(1)]], vec![false; 3])
            .is_err());
        assert!(fenced()
            .with_replicas(vec![vec![]; 3], vec![false, true, false])
            .is_err());
        // Served and fenced at once is refused.
        assert!(Ownership::new(5, vec![true, false])
            .unwrap()
            .with_fenced(vec![true, false])
            .is_err());
    }

    #[test]
    fn inconsistent_replica_sets_are_refused() {
        let base = || Ownership::new(5, vec![true, false]).unwrap();
        assert!(matches!(
            base().with_replicas(vec![vec![]], vec![false, false]),
            Err(OwnershipError::ReplicaPartitions { given: 1, .. })
        ));
        assert!(matches!(
            base().with_replicas(vec![vec![], vec![peer(1)]], vec![false, false]),
            Err(OwnershipError::Replicas { partition: 1, .. })
        ));
        assert!(matches!(
            base().with_replicas(vec![vec![peer(1), peer(1)], vec![]], vec![false, false]),
            Err(OwnershipError::Replicas { partition: 0, .. })
        ));
        assert!(matches!(
            base().with_replicas(vec![vec![], vec![]], vec![true, false]),
            Err(OwnershipError::Replicas { partition: 0, .. })
        ));
        assert!(matches!(
            base().with_replicas(vec![(1..9).map(peer).collect(), vec![]], vec![false, false]),
            Err(OwnershipError::Replicas { partition: 0, .. })
        ));
    }

    #[test]
    fn push_targets_are_the_map_s_other_servers_only() {
        let o = Ownership::new(2, vec![true]).unwrap();
        assert_eq!(o.peer(1), None, "no peers set: pushes go nowhere");
        let o = o.with_peers(vec![peer(1), peer(3)]).unwrap();
        assert_eq!(o.peer(3), Some(peer(3)));
        assert_eq!(o.peer(2), None);
        let twice = Ownership::new(2, vec![true])
            .unwrap()
            .with_peers(vec![peer(1), peer(1)]);
        assert!(matches!(twice, Err(OwnershipError::Peers(_))));
        let too_many = Ownership::new(2, vec![true])
            .unwrap()
            .with_peers((0..=PEERS_MAX as u32).map(peer).collect());
        assert!(matches!(too_many, Err(OwnershipError::Peers(_))));
    }
}
