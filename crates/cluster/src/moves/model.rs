//! A model of a move among servers that install maps late, a client that writes and reads
//! with whatever epoch it has, and a mover that is killed at random points: proptested
//! to lose no acknowledged write and never let a read see an older value than the last
//! acknowledged write. The servers here behave as `camelot-server`'s exec does: a batch
//! at an epoch other than the server's is refused, a key of a partition it does not serve
//! is refused, APPLY keeps only newer versions and moves the clock past them.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

const NODES: u32 = 3;
const PARTITIONS: u32 = 4;
const KEYS: u8 = 16;
const CATCHUP_PASSES: u32 = 2;

#[derive(Default, Clone)]
struct Server {
    clock: u64,
    installed: u64,
    data: BTreeMap<Vec<u8>, (u64, u64)>,
}

impl Server {
    fn apply(&mut self, key: &[u8], version: u64, value: Option<u64>) {
        self.clock = self.clock.max(version);
        let current = self.data.get(key).map_or(0, |(v, _)| *v);
        if version <= current && self.data.contains_key(key) {
            return;
        }
        match value {
            Some(val) => {
                self.data.insert(key.to_vec(), (version, val));
            }
            None => {
                self.data.remove(key);
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Write(u8),
    Delete(u8),
    Read(u8),
    Refresh,
    Install(u8, bool),
    Mover,
    Crash(bool),
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        3 => (0..KEYS).prop_map(Ev::Write),
        1 => (0..KEYS).prop_map(Ev::Delete),
        2 => (0..KEYS).prop_map(Ev::Read),
        1 => Just(Ev::Refresh),
        2 => ((0..NODES as u8), any::<bool>()).prop_map(|(n, j)| Ev::Install(n, j)),
        8 => Just(Ev::Mover),
        1 => any::<bool>().prop_map(Ev::Crash),
    ]
}

/// Where the mover is within a step; lost when it is killed.
#[derive(Debug, Clone)]
enum Pc {
    Start {
        resuming: bool,
    },
    Copy {
        pass: u32,
        cursor: usize,
        changed: usize,
    },
    FinalCopy {
        fence_epoch: u64,
        cursor: usize,
    },
    FinalDelete,
    Cleanup {
        node: NodeId,
        after_epoch: u64,
    },
    Done,
}

/// Deliberate defects, to show the checks can fail.
#[derive(Debug, Clone, Copy, Default)]
struct Broken {
    no_final_copy: bool,
    no_fence_wait: bool,
}

struct World {
    maps: BTreeMap<u64, ClusterMap>,
    record: Option<MoveRecord>,
    servers: Vec<Server>,
    client_epoch: u64,
    acked: BTreeMap<Vec<u8>, Option<u64>>,
    next_value: u64,
    pc: Pc,
    log: CopyLog,
    rollback: bool,
    want: (Vec<u32>, NodeId),
    broken: Broken,
    violations: Vec<String>,
}

fn key(k: u8) -> Vec<u8> {
    vec![b'k', k]
}

fn partition(key: &[u8]) -> u32 {
    camelot_proto::partition_of(key, PARTITIONS)
}

impl World {
    fn new(move_partition: u32, to_offset: u32, broken: Broken) -> World {
        let map = ClusterMap::initial(crate::map::test_nodes(NODES), PARTITIONS, 1).unwrap();
        let from = map.primary(move_partition).unwrap();
        let to = (from + 1 + to_offset % (NODES - 1)) % NODES;
        let servers = vec![
            Server {
                installed: 1,
                ..Server::default()
            };
            NODES as usize
        ];
        World {
            maps: [(1, map)].into(),
            record: None,
            servers,
            client_epoch: 1,
            acked: BTreeMap::new(),
            next_value: 1,
            pc: Pc::Start { resuming: false },
            log: CopyLog::default(),
            rollback: false,
            want: (vec![move_partition], to),
            broken,
            violations: Vec::new(),
        }
    }

    fn latest(&self) -> &ClusterMap {
        self.maps.values().next_back().unwrap()
    }

    fn publish(&mut self, map: ClusterMap) {
        map.validate().unwrap();
        assert_eq!(map.epoch, self.latest().epoch + 1);
        self.maps.insert(map.epoch, map);
    }

    /// The node serving `key` for a request at `epoch`, if the request would be executed.
    fn route(&self, epoch: u64, key: &[u8]) -> Option<usize> {
        let map = &self.maps[&epoch];
        let node = map.primary(partition(key))? as usize;
        let s = &self.servers[node];
        let served = s.installed == epoch
            && self.maps[&s.installed].serving_primaries_of(node as u32)[partition(key) as usize];
        served.then_some(node)
    }

    fn client(&mut self, e: Ev) {
        match e {
            Ev::Write(k) | Ev::Delete(k) => {
                let key = key(k);
                let Some(n) = self.route(self.client_epoch, &key) else {
                    self.client_epoch = self.latest().epoch;
                    return;
                };
                let s = &mut self.servers[n];
                s.clock += 1;
                let v = s.clock;
                if matches!(e, Ev::Write(_)) {
                    let value = self.next_value;
                    self.next_value += 1;
                    s.data.insert(key.clone(), (v, value));
                    self.acked.insert(key, Some(value));
                } else {
                    s.data.remove(&key);
                    self.acked.insert(key, None);
                }
            }
            Ev::Read(k) => {
                let key = key(k);
                let Some(n) = self.route(self.client_epoch, &key) else {
                    self.client_epoch = self.latest().epoch;
                    return;
                };
                let got = self.servers[n].data.get(&key).map(|(_, v)| *v);
                let want = self.acked.get(&key).copied().flatten();
                if got != want {
                    self.violations.push(format!(
                        "read of {key:?} at node {n} epoch {}: {got:?}, last acknowledged {want:?}",
                        self.client_epoch
                    ));
                }
            }
            _ => {}
        }
    }

    fn check_single_server(&mut self) {
        for p in 0..PARTITIONS as usize {
            let serving = (0..NODES as usize)
                .filter(|n| {
                    let s = &self.servers[*n];
                    self.maps[&s.installed].serving_primaries_of(*n as u32)[p]
                })
                .count();
            if serving > 1 {
                self.violations
                    .push(format!("partition {p} served by {serving} nodes"));
            }
        }
    }

    fn moving_keys(&self, node: usize, rec: &MoveRecord) -> Vec<(Vec<u8>, u64, u64)> {
        self.servers[node]
            .data
            .iter()
            .filter(|(k, _)| rec.partitions.contains(&partition(k)))
            .map(|(k, (v, val))| (k.clone(), *v, *val))
            .collect()
    }

    /// One atomic action of the mover.
    fn mover(&mut self) {
        let pc = self.pc.clone();
        match pc {
            Pc::Done => {}
            Pc::Start { resuming } => {
                let rec = match &self.record {
                    Some(r) => r.clone(),
                    None => {
                        let (parts, to) = self.want.clone();
                        if self.rollback {
                            self.pc = Pc::Done;
                            return;
                        }
                        match begin(self.latest(), &parts, None, to) {
                            Ok(r) => {
                                self.record = Some(r.clone());
                                r
                            }
                            Err(MoveError::AlreadyThere { .. }) => {
                                self.pc = Pc::Done;
                                return;
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                };
                self.log = CopyLog::default();
                self.pc = match resume_step(&rec, resuming, self.rollback) {
                    Step::Copy => Pc::Copy {
                        pass: 0,
                        cursor: 0,
                        changed: 0,
                    },
                    Step::FinalCopy { fence_epoch } => Pc::FinalCopy {
                        fence_epoch,
                        cursor: 0,
                    },
                    Step::Abort => {
                        let (map, rec) = abort(self.latest(), &rec).unwrap();
                        if let Some(m) = map {
                            self.publish(m);
                        }
                        self.record = Some(rec);
                        Pc::Start { resuming: false }
                    }
                    Step::Cleanup { node, after_epoch } => Pc::Cleanup { node, after_epoch },
                    Step::Join | Step::Fill => unreachable!("the model's maps have R = 1"),
                };
            }
            Pc::Copy {
                pass,
                cursor,
                changed,
            } => {
                let rec = self.record.clone().unwrap();
                let keys = self.moving_keys(rec.from as usize, &rec);
                if let Some((k, v, val)) = keys.get(cursor).cloned() {
                    let mut changed = changed;
                    if self.log.must_send(&k, v).unwrap() {
                        self.servers[rec.to as usize].apply(&k, v, Some(val));
                        changed += 1;
                    }
                    self.pc = Pc::Copy {
                        pass,
                        cursor: cursor + 1,
                        changed,
                    };
                } else if pass + 1 < CATCHUP_PASSES && changed > 0 {
                    self.pc = Pc::Copy {
                        pass: pass + 1,
                        cursor: 0,
                        changed: 0,
                    };
                } else {
                    let (map, rec) = fence(self.latest(), &rec).unwrap();
                    let fence_epoch = map.epoch;
                    self.publish(map);
                    self.record = Some(rec);
                    self.pc = Pc::FinalCopy {
                        fence_epoch,
                        cursor: 0,
                    };
                }
            }
            Pc::FinalCopy {
                fence_epoch,
                cursor,
            } => {
                let rec = self.record.clone().unwrap();
                if !self.broken.no_fence_wait
                    && self.servers[rec.from as usize].installed < fence_epoch
                {
                    return;
                }
                let keys = self.moving_keys(rec.from as usize, &rec);
                match keys.get(cursor).cloned() {
                    Some((k, v, val)) if !self.broken.no_final_copy => {
                        if self.log.must_send(&k, v).unwrap() {
                            self.servers[rec.to as usize].apply(&k, v, Some(val));
                        }
                        self.pc = Pc::FinalCopy {
                            fence_epoch,
                            cursor: cursor + 1,
                        };
                    }
                    _ => self.pc = Pc::FinalDelete,
                }
            }
            Pc::FinalDelete => {
                let rec = self.record.clone().unwrap();
                let source: BTreeSet<Vec<u8>> = self
                    .moving_keys(rec.from as usize, &rec)
                    .into_iter()
                    .map(|(k, _, _)| k)
                    .collect();
                let target: Vec<KeyVersion> = self
                    .moving_keys(rec.to as usize, &rec)
                    .into_iter()
                    .map(|(key, version, _)| KeyVersion { key, version })
                    .collect();
                if !self.broken.no_final_copy {
                    for d in deletions(&source, &target) {
                        self.servers[rec.to as usize].apply(&d.key, d.version, None);
                    }
                }
                let (map, rec) = switch(self.latest(), &rec).unwrap();
                let epoch = map.epoch;
                self.publish(map);
                self.record = Some(rec.clone());
                self.pc = Pc::Cleanup {
                    node: rec.from,
                    after_epoch: epoch,
                };
            }
            Pc::Cleanup { node, after_epoch } => {
                if self.servers[node as usize].installed < after_epoch {
                    return;
                }
                let rec = self.record.clone().unwrap();
                for (k, v, _) in self.moving_keys(node as usize, &rec) {
                    self.servers[node as usize].apply(&k, v + 1, None);
                }
                self.record = None;
                self.pc = Pc::Start { resuming: false };
            }
        }
    }

    fn run(&mut self, events: &[Ev]) {
        for e in events {
            match *e {
                Ev::Mover => self.mover(),
                Ev::Crash(rollback) => {
                    self.rollback = rollback;
                    self.pc = Pc::Start { resuming: true };
                }
                Ev::Install(n, jump) => {
                    let s = &mut self.servers[n as usize];
                    let latest = *self.maps.keys().next_back().unwrap();
                    s.installed = if jump {
                        latest
                    } else {
                        (s.installed + 1).min(latest)
                    };
                }
                Ev::Refresh => self.client_epoch = self.latest().epoch,
                e => self.client(e),
            }
            self.check_single_server();
        }
        // Drain: every server catches up, the mover finishes.
        for _ in 0..10_000 {
            if matches!(self.pc, Pc::Done) {
                break;
            }
            let latest = self.latest().epoch;
            for s in &mut self.servers {
                s.installed = latest;
            }
            self.mover();
        }
        assert!(matches!(self.pc, Pc::Done), "the mover did not finish");
        assert!(self.record.is_none());
        self.client_epoch = self.latest().epoch;
        for k in 0..KEYS {
            self.client(Ev::Read(k));
        }
        let latest = self.latest().clone();
        for (n, s) in self.servers.iter().enumerate() {
            for k in s.data.keys() {
                if latest.primary(partition(k)) != Some(n as u32) {
                    self.violations
                        .push(format!("node {n} still holds {k:?} after the move"));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn moves_lose_no_acknowledged_write_whatever_is_killed_when(
        p in 0..PARTITIONS,
        to in 0..NODES,
        events in proptest::collection::vec(ev(), 0..400),
    ) {
        let mut w = World::new(p, to, Broken::default());
        w.run(&events);
        prop_assert!(w.violations.is_empty(), "{:?}", w.violations);
        if !w.rollback {
            prop_assert_eq!(w.latest().primary(p), Some(w.want.1), "the move completed");
        }
        prop_assert!(w.latest().fenced.is_empty());
    }
}

/// The checker catches a mover without the final copy, or one that copies before the old
/// owner has installed the fence: some interleaving loses an acknowledged write.
#[test]
fn the_model_catches_a_mover_without_fence_or_final_copy() {
    for broken in [
        Broken {
            no_final_copy: true,
            ..Broken::default()
        },
        Broken {
            no_fence_wait: true,
            ..Broken::default()
        },
    ] {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let strategy = (
            0..PARTITIONS,
            0..NODES,
            proptest::collection::vec(ev(), 0..400),
        );
        let result = runner.run(&strategy, |(p, to, events)| {
            let mut w = World::new(p, to, broken);
            w.run(&events);
            prop_assert!(w.violations.is_empty(), "{:?}", w.violations);
            Ok(())
        });
        assert!(result.is_err(), "{broken:?} went unnoticed");
    }
}
