//! Automatic rebalancing, the pure part: when the controller (with `--auto-rebalance`)
//! should run the planner's moves, and with which weights.
//!
//! Two triggers:
//! - **Membership**: the planner, with the weights in force, would move something — a
//!   node joined (it holds nothing), left, or the map started skewed. Runs at once.
//! - **Sustained load imbalance**: for [`AutoConfig::sustain`] report periods in a row,
//!   some node was saturated (its reports show it waiting in its throttle at least
//!   [`AutoConfig::saturated`] of the time) while some other was clearly not (below
//!   [`AutoConfig::unsaturated`]). Then the weights become **measured capacities**: a
//!   saturated node's capacity is the ops/s it sustained (that is all it can do); an
//!   unsaturated node's is its ops/s × [`AutoConfig::headroom`] (it did that much and had
//!   time to spare; how much is unknown, so the step is bounded and a later imbalance
//!   makes another). The plan under those weights runs only if it moves at least
//!   [`AutoConfig::moves_min`] partitions, so noise does not shuffle the map.
//!
//! Saturation is seen through the server's own throttle (`--ops-per-sec-max`, which is
//! how heterogeneous nodes are made here): a node that is slow because its CPU is busy,
//! with no throttle, reports no waiting and is not detected. Measured weights live in the
//! leading controller's memory only: a node joining or leaving drops them (the units of
//! a measured capacity and a registered weight do not mix), and a successor controller
//! starts from the registered weights — it may move partitions back until the imbalance
//! shows again. Both are documented limits, not bugs.

use std::collections::{BTreeMap, VecDeque};

use crate::map::{ClusterMap, NodeId, WEIGHT_MAX};
use crate::plan::{plan, Plan, PlanError};

#[derive(Debug, Clone, PartialEq)]
pub struct AutoConfig {
    /// Throttle waiting (seconds per second, summed over connections) at or above which
    /// a report says its node is saturated.
    pub saturated: f64,
    /// Throttle waiting below which a report says its node has time to spare.
    pub unsaturated: f64,
    /// Report periods in a row an imbalance must last.
    pub sustain: usize,
    /// What an unsaturated node is assumed able to do, as a multiple of what it did.
    pub headroom: f64,
    /// Cluster ops/s below which load says nothing (an idle cluster is not imbalanced).
    pub ops_per_sec_min: f64,
    /// Fewest partitions a load-triggered plan must move to be run.
    pub moves_min: usize,
}

impl Default for AutoConfig {
    fn default() -> Self {
        AutoConfig {
            saturated: 0.5,
            unsaturated: 0.05,
            sustain: 3,
            headroom: 2.0,
            ops_per_sec_min: 100.0,
            moves_min: 4,
        }
    }
}

/// The per-node report values the tracker keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSample {
    pub node: NodeId,
    pub ops_per_sec: f64,
    pub throttled: f64,
}

/// The last [`AutoConfig::sustain`] samples of every node, one per report period.
#[derive(Debug, Clone, Default)]
pub struct LoadTracker {
    window: BTreeMap<NodeId, VecDeque<LoadSample>>,
}

/// Most nodes a tracker follows (the map's own limit).
const TRACKED_NODES_MAX: usize = crate::map::NODES_MAX;

impl LoadTracker {
    /// One report period's samples; a node with no sample this period loses its history
    /// (its load is unknown, so it cannot show a sustained anything).
    pub fn observe(&mut self, samples: &[LoadSample], cfg: &AutoConfig) {
        let keep = cfg.sustain.max(1);
        self.window
            .retain(|n, _| samples.iter().any(|s| s.node == *n));
        for s in samples.iter().take(TRACKED_NODES_MAX) {
            if !(s.ops_per_sec.is_finite() && s.throttled.is_finite()) {
                self.window.remove(&s.node);
                continue;
            }
            let w = self.window.entry(s.node).or_default();
            w.push_back(*s);
            while w.len() > keep {
                w.pop_front();
            }
        }
    }

    pub fn clear(&mut self) {
        self.window.clear();
    }

    /// Measured capacities of the map's nodes when the load has been imbalanced for the
    /// whole window (see the module docs); `None` otherwise.
    pub fn capacity_weights(
        &self,
        map: &ClusterMap,
        cfg: &AutoConfig,
    ) -> Option<BTreeMap<NodeId, u32>> {
        let sustain = cfg.sustain.max(1);
        let mut saturated = false;
        let mut spare = false;
        let mut total = 0.0;
        let mut capacity: BTreeMap<NodeId, f64> = BTreeMap::new();
        for n in map.nodes.iter().filter(|n| n.weight > 0) {
            let w = self.window.get(&n.id)?;
            if w.len() < sustain {
                return None;
            }
            let mean = w.iter().map(|s| s.ops_per_sec.max(0.0)).sum::<f64>() / w.len() as f64;
            total += mean;
            let c = if w.iter().all(|s| s.throttled >= cfg.saturated) {
                saturated = true;
                mean
            } else if w.iter().all(|s| s.throttled < cfg.unsaturated) {
                spare = true;
                mean * cfg.headroom
            } else {
                // In between: neither evidence; keep what it did.
                mean
            };
            capacity.insert(n.id, c);
        }
        if !(saturated && spare) || total < cfg.ops_per_sec_min {
            return None;
        }
        let top = capacity.values().cloned().fold(0.0_f64, f64::max);
        if top.is_nan() || top <= 0.0 {
            return None;
        }
        // Scale into the map's weight range, keeping every node above 0 (a weight of 0
        // drains a node; a slow node is still a node).
        let scale = f64::from(WEIGHT_MAX) / top;
        Some(
            capacity
                .into_iter()
                .map(|(n, c)| (n, ((c * scale).round() as u32).clamp(1, WEIGHT_MAX)))
                .collect(),
        )
    }
}

/// `map` with its node weights replaced by `weights`, when they name exactly the map's
/// nodes with a positive weight (a drained node stays drained); `None` when the node set
/// differs (the measured weights are stale).
pub fn with_weights(map: &ClusterMap, weights: &BTreeMap<NodeId, u32>) -> Option<ClusterMap> {
    let positive: Vec<NodeId> = map
        .nodes
        .iter()
        .filter(|n| n.weight > 0)
        .map(|n| n.id)
        .collect();
    if positive.len() != weights.len() || positive.iter().any(|n| !weights.contains_key(n)) {
        return None;
    }
    let mut next = map.clone();
    for n in next.nodes.iter_mut().filter(|n| n.weight > 0) {
        n.weight = weights[&n.id];
    }
    Some(next)
}

/// The plan's moves grouped per (member leaving, member joining): one move each, since a
/// move scans its source once per pass whatever share of it it takes. With R = 1 the
/// member is the primary; with R > 1 any member, and a move that only adds a replica (a
/// set below R) is left to re-replication.
pub fn move_groups(map: &ClusterMap, plan: &Plan) -> BTreeMap<(NodeId, NodeId), Vec<u32>> {
    let mut groups: BTreeMap<(NodeId, NodeId), Vec<u32>> = BTreeMap::new();
    for mv in &plan.moves {
        let from = if map.replication > 1 {
            mv.from
        } else {
            mv.from.or_else(|| map.primary(mv.partition))
        };
        let Some(from) = from else {
            continue;
        };
        if from != mv.to {
            groups.entry((from, mv.to)).or_default().push(mv.partition);
        }
    }
    groups
}

/// What the controller should run now: the groups of moves, and whether they come from
/// measured load. `weights` are the measured ones in force (if any). `None`: nothing.
pub fn decide(
    map: &ClusterMap,
    weights: Option<&BTreeMap<NodeId, u32>>,
    measured: Option<&BTreeMap<NodeId, u32>>,
    cfg: &AutoConfig,
) -> Result<Option<Decision>, PlanError> {
    // Membership (or a skewed map): the weights in force, whatever moves.
    let in_force = weights.and_then(|w| with_weights(map, w));
    let base = in_force.as_ref().unwrap_or(map);
    let p = plan(base)?;
    if !p.moves.is_empty() {
        return Ok(Some(Decision {
            groups: move_groups(map, &p),
            weights: in_force.is_some().then(|| weights.cloned()).flatten(),
            load: false,
        }));
    }
    // Load: only a plan that moves enough.
    if let Some(m) = measured {
        if let Some(weighted) = with_weights(map, m) {
            let p = plan(&weighted)?;
            if p.moves.len() >= cfg.moves_min.max(1) {
                return Ok(Some(Decision {
                    groups: move_groups(map, &p),
                    weights: Some(m.clone()),
                    load: true,
                }));
            }
        }
    }
    Ok(None)
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub groups: BTreeMap<(NodeId, NodeId), Vec<u32>>,
    /// The measured weights these moves follow (kept in force after them); `None`: the
    /// registered ones.
    pub weights: Option<BTreeMap<NodeId, u32>>,
    /// Triggered by measured load (rather than membership).
    pub load: bool,
}

impl Decision {
    pub fn partitions(&self) -> usize {
        self.groups.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::Node;
    use proptest::prelude::*;

    fn nodes(n: u32) -> Vec<Node> {
        crate::map::test_nodes(n)
    }

    fn sample(node: NodeId, ops: f64, throttled: f64) -> LoadSample {
        LoadSample {
            node,
            ops_per_sec: ops,
            throttled,
        }
    }

    fn counts(map: &ClusterMap, groups: &BTreeMap<(NodeId, NodeId), Vec<u32>>) -> Vec<usize> {
        let mut c = vec![0usize; map.nodes.len()];
        for p in 0..map.partitions() {
            let mut owner = map.primary(p).unwrap();
            for ((_, to), parts) in groups {
                if parts.contains(&p) {
                    owner = *to;
                }
            }
            c[owner as usize] += 1;
        }
        c
    }

    #[test]
    fn a_balanced_map_with_even_load_is_left_alone() {
        let map = ClusterMap::initial(nodes(3), 64, 1).unwrap();
        let cfg = AutoConfig::default();
        let mut t = LoadTracker::default();
        for _ in 0..5 {
            t.observe(
                &[
                    sample(0, 1000.0, 0.0),
                    sample(1, 990.0, 0.0),
                    sample(2, 1010.0, 0.0),
                ],
                &cfg,
            );
        }
        assert_eq!(t.capacity_weights(&map, &cfg), None);
        assert_eq!(decide(&map, None, None, &cfg).unwrap(), None);
    }

    #[test]
    fn a_joined_node_gets_its_share_at_once() {
        let mut map = ClusterMap::initial(nodes(2), 64, 1).unwrap();
        map.nodes = nodes(3);
        let d = decide(&map, None, None, &AutoConfig::default())
            .unwrap()
            .expect("a plan");
        assert!(!d.load);
        assert!(d.groups.keys().all(|(_, to)| *to == 2));
        let c = counts(&map, &d.groups);
        assert!((21..=22).contains(&c[2]), "{c:?}");
    }

    #[test]
    fn a_saturated_node_sheds_partitions_once_the_imbalance_is_sustained() {
        let map = ClusterMap::initial(nodes(3), 64, 1).unwrap();
        let cfg = AutoConfig::default();
        let mut t = LoadTracker::default();
        let busy = [
            sample(0, 500.0, 0.9),
            sample(1, 520.0, 0.0),
            sample(2, 510.0, 0.0),
        ];
        for i in 0..cfg.sustain {
            assert_eq!(t.capacity_weights(&map, &cfg), None, "after {i} samples");
            t.observe(&busy, &cfg);
        }
        let w = t.capacity_weights(&map, &cfg).expect("imbalance");
        assert!(w[&0] < w[&1] && w[&0] < w[&2], "{w:?}");
        let d = decide(&map, None, Some(&w), &cfg).unwrap().expect("a plan");
        assert!(d.load);
        let c = counts(&map, &d.groups);
        assert!(c[0] < 22 && c[0] * 2 <= c[1] + 2, "{c:?}");
        // Once in force, the same weights plan nothing more.
        let mut after = map.clone();
        for ((_, to), parts) in &d.groups {
            for &p in parts {
                after.assignment[p as usize] = vec![*to];
            }
        }
        assert_eq!(
            decide(&after, d.weights.as_ref(), None, &cfg).unwrap(),
            None
        );
        // A break in the imbalance (node 0 not waiting for one period) resets it.
        t.observe(
            &[
                sample(0, 500.0, 0.2),
                sample(1, 520.0, 0.0),
                sample(2, 510.0, 0.0),
            ],
            &cfg,
        );
        assert_eq!(t.capacity_weights(&map, &cfg), None);
    }

    #[test]
    fn every_node_saturated_or_an_idle_cluster_is_not_an_imbalance() {
        let map = ClusterMap::initial(nodes(2), 64, 1).unwrap();
        let cfg = AutoConfig::default();
        let mut t = LoadTracker::default();
        for _ in 0..cfg.sustain {
            t.observe(&[sample(0, 500.0, 0.9), sample(1, 500.0, 0.8)], &cfg);
        }
        assert_eq!(t.capacity_weights(&map, &cfg), None);
        t.clear();
        for _ in 0..cfg.sustain {
            t.observe(&[sample(0, 10.0, 0.9), sample(1, 10.0, 0.0)], &cfg);
        }
        assert_eq!(t.capacity_weights(&map, &cfg), None, "idle");
        // A node missing from a period loses its history.
        t.clear();
        for _ in 0..cfg.sustain {
            t.observe(&[sample(0, 500.0, 0.9), sample(1, 500.0, 0.0)], &cfg);
        }
        assert!(t.capacity_weights(&map, &cfg).is_some());
        t.observe(&[sample(0, 500.0, 0.9)], &cfg);
        assert_eq!(t.capacity_weights(&map, &cfg), None);
    }

    #[test]
    fn measured_weights_for_another_node_set_are_not_used() {
        let mut map = ClusterMap::initial(nodes(2), 64, 1).unwrap();
        let w: BTreeMap<NodeId, u32> = [(0, 10), (1, 1000)].into();
        assert!(with_weights(&map, &w).is_some());
        map.nodes = nodes(3);
        assert!(with_weights(&map, &w).is_none());
        // Stale weights fall back to the registered ones: the join is planned.
        let d = decide(&map, Some(&w), None, &AutoConfig::default())
            .unwrap()
            .unwrap();
        assert_eq!(d.weights, None);
        assert!(d.groups.keys().all(|(_, to)| *to == 2));
    }

    proptest! {
        /// Whatever the reports say, a decision's groups move each partition once, from
        /// its primary to another node of the map, and weights stay in the map's range.
        #[test]
        fn decisions_are_well_formed(
            n in 2u32..6,
            reports in proptest::collection::vec(
                (0u32..6, 0.0f64..5000.0, 0.0f64..2.0), 0..40),
            skew in 0u32..6,
        ) {
            let cfg = AutoConfig::default();
            let mut map = ClusterMap::initial(nodes(n), 128, 1).unwrap();
            for (p, a) in map.assignment.iter_mut().enumerate() {
                if p % 3 == 0 {
                    *a = vec![skew % n];
                }
            }
            let mut t = LoadTracker::default();
            for chunk in reports.chunks(n as usize) {
                let s: Vec<LoadSample> = chunk
                    .iter()
                    .filter(|r| r.0 < n)
                    .map(|r| sample(r.0, r.1, r.2))
                    .collect();
                t.observe(&s, &cfg);
            }
            let measured = t.capacity_weights(&map, &cfg);
            if let Some(w) = &measured {
                prop_assert!(w.values().all(|&x| (1..=WEIGHT_MAX).contains(&x)));
            }
            if let Some(d) = decide(&map, None, measured.as_ref(), &cfg).unwrap() {
                let mut seen = std::collections::BTreeSet::new();
                for ((from, to), parts) in &d.groups {
                    prop_assert!(from != to);
                    prop_assert!(map.node(*to).is_some());
                    for p in parts {
                        prop_assert!(seen.insert(*p), "partition {} twice", p);
                        prop_assert_eq!(map.primary(*p), Some(*from));
                    }
                }
                prop_assert!(d.partitions() > 0);
            }
        }
    }
}
