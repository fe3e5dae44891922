//! What the controller decides, pure (no I/O, no clock): from the map, the live
//! registrations and the backups' applied versions, the next map.
//!
//! - [`repair`]: every partition whose primary is dead is led by its most up-to-date live
//!   backup (the highest version it has applied for that partition, see [`Marks`]), and
//!   every dead node leaves every replica set, so primaries stop failing writes for want
//!   of it. A partition with no live backup that holds all of its data keeps its dead
//!   primary and is reported stranded: unavailable, never served empty.
//! - [`join`]: live registrations missing from the map (or under a new lease) join it.
//! - [`rereplicate`]: a partition with fewer than R replicas gains live nodes as
//!   *syncing* replicas (the least loaded for their weight first); the controller copies
//!   the partition to them and then [`finish_syncs`] makes them full replicas.
//!
//! Each returns `None` when nothing changes, so a controller that runs them on every tick
//! publishes only real changes, and a controller killed between two of them leaves a map
//! from which its successor computes the same next steps.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use crate::map::{ClusterMap, Node, NodeId};

/// The live registrations, by node id (each with the lease it is registered under).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Alive {
    members: BTreeMap<NodeId, Node>,
}

impl Alive {
    pub fn new(members: impl IntoIterator<Item = Node>) -> Alive {
        Alive {
            members: members.into_iter().map(|n| (n.id, n)).collect(),
        }
    }

    /// Whether the map's entry `entry` is a live process: registered under its id, and
    /// the same process ([`Node::same_process`]). A node that restarted (servers hold
    /// data in memory only) registers as a new incarnation and is, to the map's
    /// replicas, a dead one; one that only lost its lease and registered again is not.
    pub fn holds(&self, entry: &Node) -> bool {
        self.members
            .get(&entry.id)
            .is_some_and(|m| entry.same_process(m))
    }

    pub fn members(&self) -> impl Iterator<Item = &Node> {
        self.members.values()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// Highest version each node has applied, per partition (from the nodes' reports; a
/// node or partition not reported counts as 0). Versions are comparable between the
/// backups of one partition because every one of them came from the same primaries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Marks {
    by_node: BTreeMap<NodeId, BTreeMap<u32, u64>>,
}

impl Marks {
    pub fn get(&self, node: NodeId, partition: u32) -> u64 {
        self.by_node
            .get(&node)
            .and_then(|m| m.get(&partition))
            .copied()
            .unwrap_or(0)
    }

    pub fn set(&mut self, node: NodeId, partition: u32, version: u64) {
        self.by_node
            .entry(node)
            .or_default()
            .insert(partition, version);
    }

    /// Replaces everything known of `node`.
    pub fn set_node(&mut self, node: NodeId, marks: impl IntoIterator<Item = (u32, u64)>) {
        self.by_node.insert(node, marks.into_iter().collect());
    }

    pub fn has_node(&self, node: NodeId) -> bool {
        self.by_node.contains_key(&node)
    }
}

/// How a dead primary's successor is chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Promote {
    /// The live, fully filled backup with the highest applied version (the first in the
    /// replica list among equals).
    #[default]
    MostUpToDate,
    /// Deliberately wrong, only for showing that a kill test's checker catches lost
    /// writes: the live node with the least of the partition — one outside its replica
    /// set (it holds nothing) when there is one, else the lowest-marked replica, syncing
    /// ones included.
    UnsafeStalest,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Promotion {
    pub partition: u32,
    /// The dead primary.
    pub dead: NodeId,
    /// Its successor, and the version it had applied for the partition.
    pub to: NodeId,
    pub mark: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repair {
    /// The next map, one epoch above the one repaired.
    pub map: ClusterMap,
    pub promoted: Vec<Promotion>,
    /// Backup slots of dead nodes taken out of replica sets.
    pub backups_dropped: usize,
    /// Partitions with no live replica that holds all their data: left as they were
    /// (their writes and reads fail) rather than served empty.
    pub stranded: Vec<u32>,
    /// The map's nodes found dead (by id, ascending).
    pub dead: Vec<NodeId>,
}

/// The next map after the deaths `alive` reveals, or `None` if every node the map names
/// is alive (or nothing can be done for the dead ones' partitions).
pub fn repair(map: &ClusterMap, alive: &Alive, marks: &Marks, promote: Promote) -> Option<Repair> {
    let dead: BTreeSet<NodeId> = map
        .nodes
        .iter()
        .filter(|n| !alive.holds(n))
        .map(|n| n.id)
        .collect();
    if dead.is_empty() {
        return None;
    }
    let mut next = map.clone();
    next.epoch = map.epoch + 1;
    let mut promoted = Vec::new();
    let mut stranded = Vec::new();
    let mut backups_dropped = 0;
    let mut syncing: BTreeSet<(u32, NodeId)> = map.syncing.iter().copied().collect();
    for (p, replicas) in next.assignment.iter_mut().enumerate() {
        let p = p as u32;
        let Some(&primary) = replicas.first() else {
            continue;
        };
        let dead_backups = replicas[1..].iter().filter(|n| dead.contains(n)).count();
        if !dead.contains(&primary) {
            replicas.retain(|n| !dead.contains(n));
            backups_dropped += dead_backups;
            continue;
        }
        let chosen = match promote {
            Promote::MostUpToDate => most_up_to_date(map, p, &dead, marks),
            Promote::UnsafeStalest => stalest(map, p, alive, marks),
        };
        let Some(to) = chosen else {
            stranded.push(p);
            continue;
        };
        let mut set = vec![to];
        set.extend(
            replicas
                .iter()
                .copied()
                .filter(|n| !dead.contains(n) && *n != to),
        );
        // Only the unsafe policy can bring in an outsider and overflow the set.
        set.truncate(map.replication as usize);
        backups_dropped += dead_backups;
        syncing.remove(&(p, to));
        promoted.push(Promotion {
            partition: p,
            dead: primary,
            to,
            mark: marks.get(to, p),
        });
        *replicas = set;
    }
    next.syncing = syncing
        .into_iter()
        .filter(|(p, n)| {
            next.assignment
                .get(*p as usize)
                .is_some_and(|r| r.iter().skip(1).any(|x| x == n))
        })
        .collect();
    // Dead nodes no set names leave the node list, as long as enough weighted nodes stay
    // for the map to be valid (a dead entry left behind is harmless: it holds nothing).
    let referenced = referenced(&next);
    let gone = |n: &Node| dead.contains(&n.id) && !referenced.contains(&n.id);
    let weighted_left = next
        .nodes
        .iter()
        .filter(|n| n.weight > 0 && !gone(n))
        .count();
    if weighted_left >= map.replication as usize && next.nodes.iter().any(|n| !gone(n)) {
        next.nodes.retain(|n| !gone(n));
    }
    let unchanged = ClusterMap {
        epoch: map.epoch,
        ..next.clone()
    } == *map;
    if unchanged {
        return None;
    }
    Some(Repair {
        map: next,
        promoted,
        backups_dropped,
        stranded,
        dead: dead.into_iter().collect(),
    })
}

/// Why [`accept_loss`] changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AcceptLossError {
    #[error("node {0} is not in the map")]
    UnknownNode(NodeId),
    #[error("node {0} in the map is a live process: it holds its data, nothing is lost")]
    Alive(NodeId),
    #[error(
        "node {node} leads partition(s) {partitions:?} that a live backup holds: a controller \
         promotes it (run `camelot cluster controller`), after which only what no copy \
         survives can be given up"
    )]
    HasBackups { node: NodeId, partitions: Vec<u32> },
    #[error("node {node} leads partition(s) {partitions:?} under a move's fence: finish or roll back the move first")]
    Fenced { node: NodeId, partitions: Vec<u32> },
    #[error("no live node with a positive weight outside their replica sets can take node {0}'s partitions")]
    NoTaker(NodeId),
    #[error("node {0} leads no partition: nothing of it is stranded")]
    NothingLost(NodeId),
}

/// What [`accept_loss`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedLoss {
    pub map: ClusterMap,
    /// Partitions whose data is given up (they serve again, empty), ascending.
    pub lost: Vec<u32>,
    /// Each lost partition's new primary: the node restarted under the same id, or a live
    /// node that takes it when the id has no registration.
    pub new_primaries: Vec<(u32, NodeId)>,
}

/// Gives up the data of the partitions dead node `node` led with no copy left (R = 1, or
/// every backup dead or still syncing), so they serve again, empty, at a new epoch —
/// an operator's decision (`camelot cluster accept-loss`), never the controller's:
/// [`repair`] leaves such partitions stranded rather than serve them empty.
///
/// If `node` registered again as a new process (restarted empty), its map entry becomes
/// that registration and it leads them; otherwise each goes to the live weighted node
/// leading the fewest partitions. Either way `node`'s old process leaves every other
/// replica set (its copies died with it, and a restarted process must not look like a
/// backup holding them). Refused while a live backup of one of its partitions could still
/// be promoted, or one is under a move's fence.
pub fn accept_loss(
    map: &ClusterMap,
    alive: &Alive,
    node: NodeId,
) -> Result<AcceptedLoss, AcceptLossError> {
    let entry = map.node(node).ok_or(AcceptLossError::UnknownNode(node))?;
    if alive.holds(entry) {
        return Err(AcceptLossError::Alive(node));
    }
    let is_alive = |id: NodeId| map.node(id).is_some_and(|n| alive.holds(n));
    let led: Vec<u32> = (0..map.partitions())
        .filter(|&p| map.primary(p) == Some(node))
        .collect();
    let with_backups: Vec<u32> = led
        .iter()
        .copied()
        .filter(|&p| {
            map.replicas(p)[1..]
                .iter()
                .any(|&b| is_alive(b) && !map.is_syncing(p, b))
        })
        .collect();
    if !with_backups.is_empty() {
        return Err(AcceptLossError::HasBackups {
            node,
            partitions: with_backups,
        });
    }
    if led.is_empty() {
        return Err(AcceptLossError::NothingLost(node));
    }
    let fenced: Vec<u32> = led.iter().copied().filter(|&p| map.is_fenced(p)).collect();
    if !fenced.is_empty() {
        return Err(AcceptLossError::Fenced {
            node,
            partitions: fenced,
        });
    }
    let restarted = alive.members().find(|m| m.id == node).cloned();
    let mut next = map.clone();
    next.epoch = map.epoch + 1;
    // Primaries per live weighted node, to spread what a missing node led.
    let mut load: BTreeMap<NodeId, usize> = map
        .nodes
        .iter()
        .filter(|n| n.id != node && n.weight > 0 && alive.holds(n))
        .map(|n| (n.id, 0))
        .collect();
    for set in &map.assignment {
        if let Some(c) = set.first().and_then(|p| load.get_mut(p)) {
            *c += 1;
        }
    }
    let mut new_primaries = Vec::new();
    for (p, set) in next.assignment.iter_mut().enumerate() {
        let p = p as u32;
        if set.first() == Some(&node) {
            let to = match &restarted {
                Some(r) => r.id,
                None => {
                    // Not a member of the set (a syncing backup holds part of the data,
                    // and "empty" must mean empty).
                    let (&to, c) = load
                        .iter_mut()
                        .filter(|(id, _)| !set.contains(id))
                        .min_by_key(|(id, c)| (**c, **id))
                        .ok_or(AcceptLossError::NoTaker(node))?;
                    *c += 1;
                    to
                }
            };
            // What else the set names holds none of it: dead, or syncing from the primary.
            *set = vec![to];
            new_primaries.push((p, to));
        } else {
            set.retain(|&n| n != node);
        }
    }
    next.syncing.retain(|&(p, n)| {
        n != node
            && next
                .assignment
                .get(p as usize)
                .is_some_and(|set| set.iter().skip(1).any(|&x| x == n))
    });
    match restarted {
        Some(r) => {
            if let Some(e) = next.nodes.iter_mut().find(|n| n.id == node) {
                *e = r;
            }
        }
        None => next.nodes.retain(|n| n.id != node),
    }
    Ok(AcceptedLoss {
        map: next,
        lost: led,
        new_primaries,
    })
}

/// Node ids some replica set names.
fn referenced(map: &ClusterMap) -> BTreeSet<NodeId> {
    map.assignment.iter().flatten().copied().collect()
}

fn most_up_to_date(
    map: &ClusterMap,
    p: u32,
    dead: &BTreeSet<NodeId>,
    marks: &Marks,
) -> Option<NodeId> {
    map.replicas(p)
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, n)| !dead.contains(n) && !map.is_syncing(p, **n))
        // Highest mark; among equals the earliest in the list (max_by keeps the last of
        // equals, so the position is compared reversed).
        .max_by(|(i, a), (j, b)| marks.get(**a, p).cmp(&marks.get(**b, p)).then(j.cmp(i)))
        .map(|(_, n)| *n)
}

fn stalest(map: &ClusterMap, p: u32, alive: &Alive, marks: &Marks) -> Option<NodeId> {
    let replicas = map.replicas(p);
    let is_alive = |id: NodeId| map.node(id).is_some_and(|n| alive.holds(n));
    map.nodes
        .iter()
        .find(|n| !replicas.contains(&n.id) && alive.holds(n) && n.weight > 0)
        .map(|n| n.id)
        .or_else(|| {
            replicas
                .iter()
                .skip(1)
                .filter(|n| is_alive(**n))
                .min_by_key(|n| marks.get(**n, p))
                .copied()
        })
}

/// Live registrations the map lacks join it (a new id, or an id whose entry holds no
/// replica and is registered at a new address or under a new lease: a restarted node);
/// entries whose lease is unrecorded get their live one; weights follow registrations.
/// A registration that would make the node list invalid (a weight over the limit, an
/// address another node has, a weight of 0 that leaves fewer weighted nodes than R) is
/// left out, with a warning: one bad registration must not stop the controller from
/// publishing anything (failover, re-replication and rebalancing all wait on a map).
pub fn join(map: &ClusterMap, alive: &Alive) -> Option<ClusterMap> {
    let referenced = referenced(map);
    let mut next = map.clone();
    let mut changed = false;
    let mut refused = Vec::new();
    for m in alive.members() {
        match join_one(&mut next, &referenced, m) {
            Ok(c) => changed |= c,
            Err(_) => refused.push(m),
        }
    }
    // Those refused, all together: changes only valid beside each other (two entries
    // trading addresses) are taken as one; otherwise each stays out.
    if !refused.is_empty() {
        let kept = next.nodes.clone();
        let mut together = Ok(());
        for m in &refused {
            if let Some(updated) = joined_entry(&next, &referenced, m) {
                match next.nodes.iter().position(|n| n.id == m.id) {
                    Some(i) => next.nodes[i] = updated,
                    None => next.nodes.push(updated),
                }
            }
        }
        if next.nodes.len() > crate::map::NODES_MAX {
            together = Err("too many nodes".to_string());
        } else if let Err(e) = next.check_nodes() {
            together = Err(e.to_string());
        }
        match together {
            Ok(()) => changed = true,
            Err(e) => {
                next.nodes = kept;
                for m in refused {
                    tracing::warn!("node {} ({}) left out of the map: {e}", m.id, m.addr);
                }
            }
        }
    }
    if !changed {
        return None;
    }
    next.epoch = map.epoch + 1;
    Some(next)
}

/// The entry registration `m` makes in `next`'s node list, if it changes anything.
fn joined_entry(next: &ClusterMap, referenced: &BTreeSet<NodeId>, m: &Node) -> Option<Node> {
    match next.nodes.iter().find(|n| n.id == m.id) {
        None if next.nodes.len() >= crate::map::NODES_MAX => None,
        None => Some(m.clone()),
        Some(n) if n == m => None,
        Some(n) if n.same_process(m) || !referenced.contains(&n.id) => Some(m.clone()),
        Some(n) if n.weight != m.weight => Some(Node {
            weight: m.weight,
            ..n.clone()
        }),
        Some(_) => None,
    }
}

/// Puts registration `m` in `next`'s node list if it belongs there; whether that changed
/// it. A change that would make the list invalid is undone and returned as the error.
fn join_one(
    next: &mut ClusterMap,
    referenced: &BTreeSet<NodeId>,
    m: &Node,
) -> Result<bool, crate::error::MapError> {
    let Some(updated) = joined_entry(next, referenced, m) else {
        return Ok(false);
    };
    let at = next.nodes.iter().position(|n| n.id == m.id);
    let before = match at {
        Some(i) => Some(std::mem::replace(&mut next.nodes[i], updated)),
        None => {
            next.nodes.push(updated);
            None
        }
    };
    if let Err(e) = next.check_nodes() {
        match (at, before) {
            (Some(i), Some(n)) => next.nodes[i] = n,
            _ => {
                next.nodes.pop();
            }
        }
        return Err(e);
    }
    Ok(true)
}

/// Weighted load comparison: `a_slots / a_weight` against `b_slots / b_weight`.
fn load_cmp(a_slots: usize, a_weight: u32, b_slots: usize, b_weight: u32) -> Ordering {
    (a_slots as u128 * u128::from(b_weight)).cmp(&(b_slots as u128 * u128::from(a_weight)))
}

/// Adds a syncing replica to every partition with a live primary and fewer than R
/// replicas, while some live node with a positive weight holds none of it: the one with
/// the fewest replica slots for its weight (then the lowest id). Returns the next map
/// and the `(partition, node)` pairs added, or `None` when none can be.
pub fn rereplicate(map: &ClusterMap, alive: &Alive) -> Option<(ClusterMap, Vec<(u32, NodeId)>)> {
    let eligible: Vec<&Node> = map
        .nodes
        .iter()
        .filter(|n| n.weight > 0 && alive.holds(n))
        .collect();
    let mut slots = map.slots_per_node();
    let mut next = map.clone();
    let mut added = Vec::new();
    for (p, replicas) in next.assignment.iter_mut().enumerate() {
        let p = p as u32;
        let primary_alive = replicas
            .first()
            .and_then(|id| map.node(*id))
            .is_some_and(|n| alive.holds(n));
        if !primary_alive || map.is_fenced(p) {
            continue;
        }
        while replicas.len() < map.replication as usize {
            let best = eligible
                .iter()
                .filter(|n| !replicas.contains(&n.id))
                .min_by(|a, b| {
                    let (sa, sb) = (slots[&a.id], slots[&b.id]);
                    load_cmp(sa, a.weight, sb, b.weight).then(a.id.cmp(&b.id))
                });
            let Some(n) = best else { break };
            replicas.push(n.id);
            *slots.entry(n.id).or_default() += 1;
            added.push((p, n.id));
        }
    }
    if added.is_empty() {
        return None;
    }
    let mut syncing: BTreeSet<(u32, NodeId)> = next.syncing.iter().copied().collect();
    syncing.extend(added.iter().copied());
    next.syncing = syncing.into_iter().collect();
    next.epoch = map.epoch + 1;
    Some((next, added))
}

/// A finished copy: `node` now holds all of `partition` as `primary` had it. The leases
/// name the two processes (a node that restarted since holds nothing of the copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Synced {
    pub partition: u32,
    pub node: NodeId,
    pub node_lease: i64,
    pub primary: NodeId,
    pub primary_lease: i64,
}

impl Synced {
    /// The copy of `partition` from `primary` to `node` as `map` names them.
    pub fn of(map: &ClusterMap, partition: u32, primary: NodeId, node: NodeId) -> Synced {
        let lease = |id: NodeId| map.node(id).map_or(0, |n| n.lease);
        Synced {
            partition,
            node,
            node_lease: lease(node),
            primary,
            primary_lease: lease(primary),
        }
    }
}

/// The syncing replicas of `done` become full ones — each only if it is still syncing
/// in `map`, its partition's primary is still the one it was copied from (a copy from a
/// primary since replaced must be made again from the new one), and neither node has
/// restarted since (same lease).
pub fn finish_syncs(map: &ClusterMap, done: &[Synced]) -> Option<ClusterMap> {
    let still = |s: &Synced| {
        map.is_syncing(s.partition, s.node)
            && map.primary(s.partition) == Some(s.primary)
            && Synced::of(map, s.partition, s.primary, s.node) == *s
    };
    let finished: BTreeSet<(u32, NodeId)> = done
        .iter()
        .filter(|s| still(s))
        .map(|s| (s.partition, s.node))
        .collect();
    if finished.is_empty() {
        return None;
    }
    let mut next = map.clone();
    next.syncing.retain(|pair| !finished.contains(pair));
    next.epoch = map.epoch + 1;
    Some(next)
}

/// The syncing replicas to copy, grouped by (primary, target): one copy pass scans the
/// primary once for all of a group's partitions. Partitions whose primary is not alive
/// wait (their repair comes first).
pub fn sync_work(map: &ClusterMap, alive: &Alive) -> BTreeMap<(NodeId, NodeId), Vec<u32>> {
    let mut work: BTreeMap<(NodeId, NodeId), Vec<u32>> = BTreeMap::new();
    for &(p, node) in &map.syncing {
        let Some(primary) = map.primary(p) else {
            continue;
        };
        let live = |id: NodeId| map.node(id).is_some_and(|n| alive.holds(n));
        if live(primary) && live(node) {
            work.entry((primary, node)).or_default().push(p);
        }
    }
    work
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::SocketAddr;

    fn node(id: u32, weight: u32) -> Node {
        Node {
            id,
            addr: SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16)),
            weight,
            lease: 100 + i64::from(id),
            incarnation: 0,
        }
    }

    /// A registration the node list cannot take (a weight over the limit, an address
    /// another node has) is left out, and the others still join.
    #[test]
    fn a_bad_registration_is_left_out_and_the_rest_join() {
        let m = map(2, 16, 1);
        let mut too_heavy = node(2, 1);
        too_heavy.weight = crate::map::WEIGHT_MAX + 1;
        let mut same_addr = node(3, 1);
        same_addr.addr = m.nodes[0].addr;
        let good = node(4, 1);
        let alive = Alive::new(
            m.nodes
                .iter()
                .cloned()
                .chain([too_heavy, same_addr, good.clone()]),
        );
        let joined = join(&m, &alive).expect("the good node joins");
        joined.validate().expect("a valid map");
        let ids: Vec<NodeId> = joined.nodes.iter().map(|n| n.id).collect();
        assert_eq!(ids, vec![0, 1, 4]);
        // Two entries no replica set names, registered again with each other's addresses
        // (restarted, ports traded): each change is only valid beside the other.
        let mut spare = map(2, 16, 1);
        spare.nodes.push(node(5, 1));
        spare.nodes.push(node(6, 1));
        let (mut five, mut six) = (node(5, 1), node(6, 1));
        std::mem::swap(&mut five.addr, &mut six.addr);
        five.lease += 1000;
        six.lease += 1000;
        let alive = Alive::new(spare.nodes[..2].iter().cloned().chain([five, six]));
        let traded = join(&spare, &alive).expect("both take their new addresses");
        traded.validate().expect("a valid map");
        assert_eq!(traded.node(5).unwrap().addr, spare.node(6).unwrap().addr);
        // A known node re-registering with a weight over the limit keeps its old entry.
        let mut heavier = m.nodes[1].clone();
        heavier.weight = crate::map::WEIGHT_MAX + 1;
        let alive = Alive::new([m.nodes[0].clone(), heavier]);
        assert!(join(&m, &alive).is_none());
    }

    fn map(nodes: u32, partitions: u32, replication: u32) -> ClusterMap {
        ClusterMap::initial(
            (0..nodes).map(|i| node(i, 1)).collect(),
            partitions,
            replication,
        )
        .unwrap()
    }

    fn alive_but(map: &ClusterMap, dead: &[NodeId]) -> Alive {
        Alive::new(map.nodes.iter().filter(|n| !dead.contains(&n.id)).cloned())
    }

    #[test]
    fn a_loss_accepted_for_a_restarted_node_gives_it_its_partitions_empty() {
        let m = map(3, 12, 1);
        let led: Vec<u32> = (0..12).filter(|&p| m.primary(p) == Some(1)).collect();
        assert!(!led.is_empty());
        let mut restarted = m.node(1).unwrap().clone();
        restarted.incarnation = 77;
        restarted.lease += 1000;
        let alive = Alive::new([m.nodes[0].clone(), restarted.clone(), m.nodes[2].clone()]);
        // The controller leaves them stranded (no copy survives): it publishes nothing.
        assert_eq!(
            repair(&m, &alive, &Marks::default(), Promote::MostUpToDate),
            None
        );
        let a = accept_loss(&m, &alive, 1).unwrap();
        a.map.validate().unwrap();
        assert_eq!(a.map.epoch, m.epoch + 1);
        assert_eq!(a.lost, led);
        assert_eq!(
            a.map.node(1),
            Some(&restarted),
            "the new process is the entry"
        );
        assert!(a.new_primaries.iter().all(|&(_, n)| n == 1));
        for p in 0..12 {
            assert_eq!(a.map.replicas(p), m.replicas(p), "partition {p}");
        }
        // Now the map names live processes only: nothing is dead to the controller.
        assert!(a.map.nodes.iter().all(|n| alive.holds(n)));
        // Refusals: a live node, an unknown one, one that leads nothing.
        assert_eq!(accept_loss(&m, &alive, 0), Err(AcceptLossError::Alive(0)));
        assert_eq!(
            accept_loss(&m, &alive, 9),
            Err(AcceptLossError::UnknownNode(9))
        );
        let mut idle = m.clone();
        idle.nodes.push(node(5, 1));
        assert_eq!(
            accept_loss(&idle, &alive, 5),
            Err(AcceptLossError::NothingLost(5))
        );
        let mut fenced = m.clone();
        fenced.fenced = vec![led[0]];
        assert!(matches!(
            accept_loss(&fenced, &alive, 1),
            Err(AcceptLossError::Fenced { .. })
        ));
    }

    #[test]
    fn a_loss_accepted_for_a_gone_node_spreads_its_partitions_over_the_live_ones() {
        let m = map(3, 12, 1);
        let led: Vec<u32> = (0..12).filter(|&p| m.primary(p) == Some(2)).collect();
        let a = accept_loss(&m, &alive_but(&m, &[2]), 2).unwrap();
        a.map.validate().unwrap();
        assert!(a.map.node(2).is_none(), "the gone node leaves the map");
        assert_eq!(a.lost, led);
        let took: BTreeSet<NodeId> = a.new_primaries.iter().map(|&(_, n)| n).collect();
        assert_eq!(took, BTreeSet::from([0, 1]), "{:?}", a.new_primaries);
        let per_node = |id| (0..12).filter(|&p| a.map.primary(p) == Some(id)).count();
        assert!(per_node(0).abs_diff(per_node(1)) <= 1);
        // A live backup still syncing holds part of a partition: it never takes it.
        let mut m2 = map(3, 12, 2);
        let led2: Vec<u32> = (0..12).filter(|&p| m2.primary(p) == Some(2)).collect();
        m2.syncing = led2.iter().map(|&p| (p, m2.replicas(p)[1])).collect();
        m2.validate().unwrap();
        let p = led2[0];
        let backup = m2.replicas(p)[1];
        let a = accept_loss(&m2, &alive_but(&m2, &[2]), 2).unwrap();
        a.map.validate().unwrap();
        assert!(a.lost.contains(&p));
        assert_ne!(a.map.primary(p), Some(backup), "{:?}", a.new_primaries);
        assert!(!a.map.replicas(p).contains(&backup));
        // Nobody to take them.
        let lone = map(1, 4, 1);
        assert_eq!(
            accept_loss(&lone, &alive_but(&lone, &[0]), 0),
            Err(AcceptLossError::NoTaker(0))
        );
    }

    #[test]
    fn a_loss_is_refused_while_a_backup_can_be_promoted_and_drops_the_dead_backups() {
        let m = map(4, 16, 2);
        let dead = 1;
        assert!(matches!(
            accept_loss(&m, &alive_but(&m, &[dead]), dead),
            Err(AcceptLossError::HasBackups { node: 1, .. })
        ));
        // Its backup dead too: nothing is left to promote, and the loss is accepted for
        // the partitions node 1 leads; node 1 leaves every set (those led by the other
        // dead node too), and that one's own partitions are still its to give up.
        let both = m.replicas((0..16).find(|&p| m.primary(p) == Some(dead)).unwrap())[1];
        let alive = alive_but(&m, &[dead, both]);
        let repaired = repair(&m, &alive, &Marks::default(), Promote::MostUpToDate)
            .map_or_else(|| m.clone(), |r| r.map);
        let led: Vec<u32> = (0..16)
            .filter(|&p| repaired.primary(p) == Some(dead))
            .collect();
        let a = accept_loss(&repaired, &alive, dead).unwrap();
        a.map.validate().unwrap();
        assert_eq!(a.lost, led);
        assert!(a.map.assignment.iter().all(|set| !set.contains(&dead)));
        assert!(a.map.node(dead).is_none());
        let b = accept_loss(&a.map, &alive, both).unwrap();
        b.map.validate().unwrap();
        assert!(b.map.nodes.iter().all(|n| alive.holds(n)));
    }

    #[test]
    fn a_dead_primary_is_replaced_by_its_most_up_to_date_backup() {
        let m = map(4, 8, 3);
        let dead = m.primary(0).unwrap();
        let backups: Vec<NodeId> = m.replicas(0)[1..].to_vec();
        let mut marks = Marks::default();
        marks.set(backups[0], 0, 10);
        marks.set(backups[1], 0, 12);
        let r = repair(&m, &alive_but(&m, &[dead]), &marks, Promote::MostUpToDate).unwrap();
        r.map.validate().unwrap();
        assert_eq!(r.map.epoch, m.epoch + 1);
        assert_eq!(r.map.primary(0), Some(backups[1]), "the one at version 12");
        assert_eq!(r.map.replicas(0), &[backups[1], backups[0]]);
        assert!(r.map.node(dead).is_none(), "the dead node leaves the map");
        assert!(r.map.assignment.iter().all(|s| !s.contains(&dead)));
        assert!(r.stranded.is_empty());
        assert_eq!(r.dead, vec![dead]);
        // Equal marks: the first backup in the list.
        let r = repair(
            &m,
            &alive_but(&m, &[dead]),
            &Marks::default(),
            Promote::MostUpToDate,
        )
        .unwrap();
        assert_eq!(r.map.primary(0), Some(backups[0]));
        // Nobody dead: nothing to do.
        assert_eq!(
            repair(&m, &alive_but(&m, &[]), &marks, Promote::MostUpToDate),
            None
        );
    }

    #[test]
    fn a_syncing_backup_is_never_promoted_and_a_lone_primary_is_stranded() {
        let mut m = map(3, 4, 2);
        let primary = m.primary(1).unwrap();
        let backup = m.replicas(1)[1];
        m.syncing = vec![(1, backup)];
        m.validate().unwrap();
        let mut marks = Marks::default();
        marks.set(backup, 1, 99);
        let r = repair(
            &m,
            &alive_but(&m, &[primary]),
            &marks,
            Promote::MostUpToDate,
        )
        .unwrap();
        r.map.validate().unwrap();
        assert!(r.stranded.contains(&1));
        assert_eq!(r.map.primary(1), Some(primary), "left as it was");
        assert!(
            r.map.node(primary).is_some(),
            "still named, so still in the map"
        );
        // The broken policy promotes it (and the checker is what must notice).
        let r = repair(
            &m,
            &alive_but(&m, &[primary]),
            &marks,
            Promote::UnsafeStalest,
        )
        .unwrap();
        r.map.validate().unwrap();
        assert_ne!(r.map.primary(1), Some(primary));
    }

    #[test]
    fn a_restarted_node_is_a_dead_one_until_it_rejoins_empty() {
        let m = map(3, 6, 2);
        let mut members: Vec<Node> = m.nodes.clone();
        members[2].lease += 1000; // node 2 came back under a new lease
        let alive = Alive::new(members.clone());
        let r = repair(&m, &alive, &Marks::default(), Promote::MostUpToDate).unwrap();
        assert_eq!(r.dead, vec![2]);
        assert!(r.map.assignment.iter().all(|s| !s.contains(&2)));
        let joined = join(&r.map, &alive).unwrap();
        joined.validate().unwrap();
        assert_eq!(joined.node(2), Some(&members[2]));
        let (filled, added) = rereplicate(&joined, &alive).unwrap();
        filled.validate().unwrap();
        assert!(
            added.iter().all(|(_, n)| *n == 2),
            "only node 2 holds too little"
        );
        assert!(filled.assignment.iter().all(|s| s.len() == 2));
        assert_eq!(filled.syncing, added);
    }

    #[test]
    fn a_node_registered_again_as_the_same_incarnation_is_not_a_dead_one() {
        let mut m = map(3, 6, 2);
        for (i, n) in m.nodes.iter_mut().enumerate() {
            n.incarnation = 100 + i as u64;
        }
        // Node 2's lease expired while it ran and it registered again: new lease, same
        // incarnation. Nothing to repair; join records the new lease.
        let mut members: Vec<Node> = m.nodes.clone();
        members[2].lease += 1000;
        let alive = Alive::new(members.clone());
        assert!(alive.holds(m.node(2).unwrap()));
        assert!(repair(&m, &alive, &Marks::default(), Promote::MostUpToDate).is_none());
        let joined = join(&m, &alive).unwrap();
        assert_eq!(joined.node(2), Some(&members[2]));
        assert_eq!(joined.assignment, m.assignment, "no replica moved");
        // A restart is a new incarnation: dead, whatever the lease.
        members[2].incarnation += 1;
        let alive = Alive::new(members);
        assert!(!alive.holds(m.node(2).unwrap()));
        let r = repair(&m, &alive, &Marks::default(), Promote::MostUpToDate).unwrap();
        assert_eq!(r.dead, vec![2]);
    }

    #[test]
    fn finished_syncs_count_only_from_the_primary_they_were_copied_from() {
        let m = map(3, 4, 2);
        let alive = alive_but(&m, &[]);
        let dead = m.primary(0).unwrap();
        let r = repair(
            &m,
            &alive_but(&m, &[dead]),
            &Marks::default(),
            Promote::MostUpToDate,
        )
        .unwrap();
        // The node comes back (new lease) and takes the missing replicas.
        let mut back = m.node(dead).unwrap().clone();
        back.lease += 7;
        let members = m
            .nodes
            .iter()
            .filter(|n| n.id != dead)
            .cloned()
            .chain([back])
            .collect::<Vec<_>>();
        let alive2 = Alive::new(members);
        let joined = join(&r.map, &alive2).unwrap();
        let (filled, added) = rereplicate(&joined, &alive2).unwrap();
        let work = sync_work(&filled, &alive2);
        assert_eq!(work.values().map(Vec::len).sum::<usize>(), added.len());
        let done: Vec<Synced> = added
            .iter()
            .map(|&(p, node)| Synced::of(&filled, p, filled.primary(p).unwrap(), node))
            .collect();
        let wrong: Vec<Synced> = done.iter().map(|s| Synced { primary: 99, ..*s }).collect();
        assert_eq!(finish_syncs(&filled, &wrong), None);
        let full = finish_syncs(&filled, &done).unwrap();
        full.validate().unwrap();
        assert!(full.syncing.is_empty());
        assert_eq!(rereplicate(&full, &alive2), None);
        let _ = alive;
    }

    /// A random valid map: `initial`, then some syncing replicas.
    fn arb_case() -> impl Strategy<Value = (ClusterMap, Vec<NodeId>, Vec<u64>, Vec<bool>)> {
        (2u32..7, 1u32..24, 1u32..4)
            .prop_filter("R ≤ N", |(n, _, r)| r <= n)
            .prop_flat_map(|(n, p, r)| {
                (
                    Just((n, p, r)),
                    proptest::collection::vec(1u32..4, n as usize),
                    proptest::collection::vec(any::<bool>(), n as usize),
                    proptest::collection::vec(0u64..5, (n * p) as usize),
                    proptest::collection::vec(any::<bool>(), p as usize),
                )
            })
            .prop_map(|((n, p, r), weights, dead, marks, sync)| {
                let nodes = (0..n).map(|i| node(i, weights[i as usize])).collect();
                let mut m = ClusterMap::initial(nodes, p, r).unwrap();
                // Mark the last backup of some partitions as still syncing.
                for (part, s) in sync.iter().enumerate() {
                    let set = &m.assignment[part];
                    if *s && set.len() > 1 {
                        m.syncing.push((part as u32, *set.last().unwrap()));
                    }
                }
                m.syncing.sort_unstable();
                let dead: Vec<NodeId> = (0..n).filter(|i| dead[*i as usize]).collect();
                (m, dead, marks, sync)
            })
    }

    fn marks_of(m: &ClusterMap, raw: &[u64]) -> Marks {
        let mut marks = Marks::default();
        let p = m.partitions();
        for n in &m.nodes {
            for part in 0..p {
                marks.set(n.id, part, raw[(n.id * p + part) as usize]);
            }
        }
        marks
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn repairs_keep_every_live_full_replica_and_promote_the_best(
            (m, dead, raw, _) in arb_case()
        ) {
            prop_assume!(m.validate().is_ok());
            let alive = alive_but(&m, &dead);
            let marks = marks_of(&m, &raw);
            let Some(r) = repair(&m, &alive, &marks, Promote::MostUpToDate) else {
                // Nothing to do only when every set naming a dead node is stranded: its
                // primary dead, no live full backup, and no dead backup under a live one.
                for p in 0..m.partitions() {
                    let set = m.replicas(p);
                    if dead.contains(&set[0]) {
                        prop_assert!(set.iter().skip(1).all(|n| dead.contains(n) || m.is_syncing(p, *n)));
                    } else {
                        prop_assert!(set.iter().all(|n| !dead.contains(n)));
                    }
                }
                return Ok(());
            };
            r.map.validate().unwrap();
            prop_assert_eq!(r.map.epoch, m.epoch + 1);
            for p in 0..m.partitions() {
                let before = m.replicas(p);
                let after = r.map.replicas(p);
                if r.stranded.contains(&p) {
                    prop_assert_eq!(before, after);
                    // Stranded only when no live full backup exists.
                    prop_assert!(before.iter().skip(1).all(|n| dead.contains(n) || m.is_syncing(p, *n)));
                    continue;
                }
                // No dead node in a repaired set; every live replica kept, in order.
                prop_assert!(after.iter().all(|n| !dead.contains(n)));
                let live_before: Vec<NodeId> = before.iter().copied().filter(|n| !dead.contains(n)).collect();
                let mut sorted_after = after.to_vec();
                sorted_after.sort_unstable();
                let mut sorted_live = live_before.clone();
                sorted_live.sort_unstable();
                prop_assert_eq!(sorted_after, sorted_live);
                if !dead.contains(&before[0]) {
                    prop_assert_eq!(after[0], before[0], "a live primary stays");
                } else {
                    // The successor was a live full backup with the highest mark.
                    let to = after[0];
                    prop_assert!(!m.is_syncing(p, to));
                    let best = before.iter().skip(1)
                        .filter(|n| !dead.contains(n) && !m.is_syncing(p, **n))
                        .map(|n| marks.get(*n, p)).max().unwrap();
                    prop_assert_eq!(marks.get(to, p), best);
                    prop_assert!(r.promoted.iter().any(|x| x.partition == p && x.to == to));
                }
                // Syncing replicas stay syncing (a promoted one never was).
                for n in after.iter().skip(1) {
                    prop_assert_eq!(r.map.is_syncing(p, *n), m.is_syncing(p, *n));
                }
            }
            // Nothing but stranded partitions names a dead node.
            for d in &dead {
                let named = r.map.assignment.iter().enumerate()
                    .any(|(p, s)| s.contains(d) && !r.stranded.contains(&(p as u32)));
                prop_assert!(!named);
            }
        }

        #[test]
        fn rereplication_fills_every_live_partition_with_live_distinct_nodes(
            (m, dead, raw, _) in arb_case()
        ) {
            let alive = alive_but(&m, &dead);
            let marks = marks_of(&m, &raw);
            let repaired = repair(&m, &alive, &marks, Promote::MostUpToDate)
                .map_or(m.clone(), |r| r.map);
            let Some((next, added)) = rereplicate(&repaired, &alive) else {
                // Nothing added: every live-primaried partition is full or has no one to add.
                return Ok(());
            };
            next.validate().unwrap();
            prop_assert_eq!(next.epoch, repaired.epoch + 1);
            let eligible: BTreeSet<NodeId> = repaired.nodes.iter()
                .filter(|n| n.weight > 0 && alive.holds(n)).map(|n| n.id).collect();
            for &(p, n) in &added {
                prop_assert!(eligible.contains(&n));
                prop_assert!(!repaired.replicas(p).contains(&n));
                prop_assert!(next.is_syncing(p, n));
            }
            for p in 0..next.partitions() {
                let set = next.replicas(p);
                let primary_live = !dead.contains(&set[0]);
                if primary_live {
                    let want = (repaired.replication as usize)
                        .min(repaired.replicas(p).len() + eligible.iter().filter(|e| !repaired.replicas(p).contains(e)).count());
                    prop_assert_eq!(set.len(), want);
                }
                prop_assert_eq!(&set[..repaired.replicas(p).len()], repaired.replicas(p), "existing replicas keep their place");
            }
            // Each new replica went to a node no more loaded (slots for its weight) than
            // any other eligible one at that moment (replicas are added in list order).
            let mut slots = repaired.slots_per_node();
            let weight = |id: NodeId| repaired.node(id).unwrap().weight;
            for &(p, n) in &added {
                for e in &eligible {
                    if next.replicas(p).contains(e) { continue; }
                    prop_assert!(load_cmp(slots[&n], weight(n), slots[e], weight(*e)) != Ordering::Greater,
                        "partition {p} went to {n} though {e} was less loaded");
                }
                *slots.get_mut(&n).unwrap() += 1;
            }
            // Finishing every copy leaves no syncing replica and nothing more to add.
            let done: Vec<Synced> = next.syncing.iter()
                .map(|&(p, node)| Synced::of(&next, p, next.primary(p).unwrap(), node))
                .collect();
            let full = finish_syncs(&next, &done).unwrap();
            full.validate().unwrap();
            prop_assert!(full.syncing.is_empty());
            prop_assert_eq!(rereplicate(&full, &alive), None);
        }

        #[test]
        fn the_unsafe_policy_promotes_someone_who_holds_less(
            (m, dead, raw, _) in arb_case()
        ) {
            let alive = alive_but(&m, &dead);
            let marks = marks_of(&m, &raw);
            if let Some(r) = repair(&m, &alive, &marks, Promote::UnsafeStalest) {
                r.map.validate().unwrap();
            }
        }
    }
}
