//! Moves with replication R = 2 on real processes (etcd, `camelot server --etcd` nodes,
//! `camelot cluster rebalance` / `cluster move` / `cluster controller`): a fourth node
//! joins a 3-node cluster under writes and the rebalance replaces members of replica sets
//! with it (primaries and backups); every acknowledged write is then read back through
//! the client *and* found on every replica the final map names. The old member of a move
//! SIGKILLed mid-move, and an auto-rebalancing controller SIGKILLed holding the fence,
//! lose nothing; a rebalance that skips the joining replica's fill
//! (`--unsafe-no-fill`) loses writes and the same checker sees it.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use camelot_client::{reply, Client, ClientConfig, ClusterMap as ClientMap, NodeInfo};
use camelot_cluster::ClusterMap;
use camelot_proto::Op;

mod support;
use support::{bin, etcd_client as client, wait_for, ControllerProc, EtcdServers, Writers};

const PARTITIONS: u32 = 64;
const REPLICATION: u32 = 2;
const WRITERS: usize = 2;
const KEYS_PER_WRITER: usize = 200;
/// Bound on any one wait for the cluster (or a tool) to reach a state.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// Items per SCAN page when a node's keys are listed.
const SCAN_PAGE: u32 = 256;

/// What this file checks of the writers' book.
trait Check {
    fn stop_and_check(self, c: &EtcdServers) -> Vec<String>;
}

impl Check for Writers {
    /// Stops the writers and checks every acknowledged key: read through the client, and
    /// present with its acknowledged value on every replica the final map names. Returns
    /// the failures (one line each).
    fn stop_and_check(mut self, c: &EtcdServers) -> Vec<String> {
        self.stop();
        let reader = client(&c.endpoint, &c.addrs);
        let acked = self.acked.lock().unwrap();
        assert!(
            acked.len() > WRITERS * KEYS_PER_WRITER / 2,
            "too few keys checked"
        );
        let m = c.map();
        let mut on_node: BTreeMap<u32, BTreeMap<Vec<u8>, Bytes>> = BTreeMap::new();
        let mut lost = Vec::new();
        for (k, v) in acked.iter() {
            let got = reader.get(k.as_bytes()).unwrap().map(|x| x.value.to_vec());
            if got.as_deref() != Some(v.as_bytes()) {
                lost.push(format!("{k}: read {got:?}, acked {v}"));
                continue;
            }
            for &node in m.replicas(m.partition_of(k.as_bytes())) {
                let held = on_node.entry(node).or_insert_with(|| node_keys(&m, node));
                let there = held.get(k.as_bytes());
                if there.map(|b| &b[..]) != Some(v.as_bytes()) {
                    lost.push(format!(
                        "{k}: replica on node {node} holds {there:?}, acked {v}"
                    ));
                }
            }
        }
        println!(
            "{} writes acknowledged, {} failed, {} lost or missing from a replica",
            self.acked_count.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            lost.len()
        );
        lost
    }
}

/// Every key `node` holds with its value, read by SCAN at epoch 0 (never redirected).
fn node_keys(m: &ClusterMap, node: u32) -> BTreeMap<Vec<u8>, Bytes> {
    let n = m.node(node).expect("a replica of the map");
    let raw = Client::connect(
        ClientMap {
            epoch: 0,
            nodes: vec![NodeInfo {
                id: node,
                addr: n.addr,
            }],
        },
        ClientConfig::default(),
    )
    .unwrap();
    let mut out = BTreeMap::new();
    let mut start = Bytes::new();
    loop {
        let items = reply::items(raw.call(
            node,
            Op::Scan {
                start: start.clone(),
                limit: SCAN_PAGE,
            },
        ))
        .unwrap();
        let Some(last) = items.last() else {
            return out;
        };
        let mut next = last.key.to_vec();
        next.push(0);
        for i in items {
            out.insert(i.key.to_vec(), i.value);
        }
        start = Bytes::from(next);
    }
}

/// Three servers with an R = 2 map of [`PARTITIONS`] over them.
fn three_nodes() -> (EtcdServers, ClusterMap) {
    let c = support::start(3, "64M", &[]);
    let before = c.publish_initial(PARTITIONS, REPLICATION);
    (c, before)
}

fn slots_of(m: &ClusterMap, node: u32) -> usize {
    m.slots_per_node().get(&node).copied().unwrap_or(0)
}

/// Starts node `id` and puts every live node in the map (no partition yet):
/// `cluster move` moves onto map nodes only (`rebalance` and controllers add joiners).
fn add_node_to_map(c: &mut EtcdServers, id: u32) {
    c.add_node(id);
    let live = c.rt.block_on(c.etcd.live_nodes()).unwrap();
    c.rt.block_on(c.etcd.update_map(3, move |cur| {
        let mut next = cur.cloned().unwrap();
        next.nodes = live.clone();
        Ok(next)
    }))
    .unwrap();
}

/// A `camelot cluster …` tool process whose output lines the test can wait for.
struct Tool {
    child: Child,
    rx: mpsc::Receiver<String>,
    seen: Vec<String>,
}

/// `camelot cluster move --from 0 --to 3 PARTITIONS`, holding after its fill for
/// `hold_ms`; returns once it says it holds.
fn held_move(c: &EtcdServers, partitions: &[String], hold_ms: &str) -> Tool {
    let mut args = vec!["move", "--from", "0", "--to", "3"];
    args.extend(partitions.iter().map(String::as_str));
    args.extend(["--hold-at", "copied", "--hold-ms", hold_ms]);
    let mut mover = Tool::start(c, &args);
    mover.wait_line("holding at copied");
    mover
}

impl Tool {
    fn start(c: &EtcdServers, args: &[&str]) -> Tool {
        let mut child = Command::new(bin())
            .arg("cluster")
            .args(args)
            .args(["--etcd", &c.endpoint])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Tool {
            child,
            rx,
            seen: Vec::new(),
        }
    }

    fn wait_line(&mut self, needle: &str) {
        let deadline = Instant::now() + WAIT_MAX;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) => {
                    let hit = l.contains(needle);
                    self.seen.push(l);
                    if hit {
                        return;
                    }
                }
                Err(e) => panic!(
                    "no line with {needle:?} ({e}); the tool said:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Waits for the process to end; its output.
    fn finish(mut self) -> (std::process::ExitStatus, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < WAIT_MAX, "the tool did not end");
            std::thread::sleep(Duration::from_millis(20));
        };
        self.seen.extend(self.rx.try_iter());
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        (status, format!("{}\n{err}", self.seen.join("\n")))
    }
}

impl Drop for Tool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The rebalance is done and the map settled: node 3 within one slot of its share, no
/// move recorded, nothing fenced or syncing, every set of R distinct nodes.
fn assert_rebalanced(c: &EtcdServers, before: &ClusterMap, said: &str) -> usize {
    let after = c.map();
    assert!(
        after.fenced.is_empty() && after.syncing.is_empty(),
        "{said}"
    );
    assert!(c.rt.block_on(c.etcd.read_move()).unwrap().is_none());
    let share = f64::from(PARTITIONS * REPLICATION) / 4.0;
    let onto = slots_of(&after, 3) as f64;
    assert!(
        (onto - share).abs() <= 1.0,
        "node 3 holds {onto} slots, share {share}:\n{said}"
    );
    for p in 0..PARTITIONS {
        assert_eq!(after.replicas(p).len(), REPLICATION as usize, "{said}");
    }
    let moved: usize = (0..PARTITIONS)
        .map(|p| {
            after
                .replicas(p)
                .iter()
                .filter(|n| !before.replicas(p).contains(n))
                .count()
        })
        .sum();
    let new_primaries = (0..PARTITIONS)
        .filter(|p| after.primary(*p) == Some(3))
        .count();
    println!("{moved} replicas moved onto node 3, {new_primaries} of them primaries");
    // With R > 1 the planner may move a replica between old nodes when a set's members
    // must stay distinct (`Plan::forced_extra`); a few, never many.
    assert!(
        moved as f64 >= onto && moved as f64 <= onto + 2.0,
        "{moved} replicas moved for {onto} onto the new node:\n{said}"
    );
    assert!(
        new_primaries > 0,
        "no primary moved: the fenced path was not run"
    );
    moved
}

fn assert_none_lost(lost: &[String], said: &str) {
    assert!(
        lost.is_empty(),
        "{} lost: {:?}\n{said}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}

#[test]
fn an_r2_rebalance_onto_a_joining_node_under_writes_loses_no_acknowledged_write() {
    let (mut c, before) = three_nodes();
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, WAIT_MAX);
    writers.progress(1_000);
    c.add_node(3);
    let (status, said) = Tool::start(&c, &["rebalance"]).finish();
    assert!(status.success(), "cluster rebalance: {status}\n{said}");
    writers.progress(1_000);
    assert_rebalanced(&c, &before, &said);
    assert!(said.contains("fenced at epoch"), "{said}");
    assert_none_lost(&writers.stop_and_check(&c), &said);
}

/// The old primary of a move is SIGKILLed while the mover holds after its fill: a
/// controller fails it over (its backups lead), the mover finds the map changed, fills
/// the joining node again from the new primaries and switches; nothing acknowledged is
/// lost, every replica holds every acknowledged write once re-replication is done.
#[test]
fn a_replicated_move_whose_old_primary_is_sigkilled_mid_move_loses_no_acknowledged_write() {
    let (mut c, _) = three_nodes();
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, WAIT_MAX);
    writers.progress(1_000);
    add_node_to_map(&mut c, 3);
    let m = c.map();
    let led: Vec<String> = (0..PARTITIONS)
        .filter(|p| m.primary(*p) == Some(0))
        .map(|p| p.to_string())
        .collect();
    assert!(!led.is_empty());
    let mover = held_move(&c, &led, "6000");
    c.servers[0].process_mut().kill().unwrap();
    // Clients start from the live nodes (they learn the map from etcd).
    c.addrs.remove(0);
    let ctl = ControllerProc::start(&c.endpoint, "ctl", &[]);
    ctl.wait_line("leader", WAIT_MAX);
    let (status, said) = mover.finish();
    assert!(status.success(), "cluster move: {status}\n{said}");
    println!("cluster move said:\n{said}");
    // Re-replication restores R for node 0's other partitions.
    wait_for("the map settled", WAIT_MAX, || {
        let m = c.map();
        m.syncing.is_empty()
            && m.node(0).is_none()
            && (0..PARTITIONS).all(|p| m.replicas(p).len() == REPLICATION as usize)
    });
    let after = c.map();
    for p in &led {
        let p: u32 = p.parse().unwrap();
        assert!(after.replicas(p).contains(&3), "partition {p}: {said}");
    }
    assert!(c.rt.block_on(c.etcd.read_move()).unwrap().is_none());
    writers.progress(500);
    let said = format!("{said}\ncontroller:\n{}", ctl.output());
    assert_none_lost(&writers.stop_and_check(&c), &said);
}

/// The leading controller of an auto-rebalance is SIGKILLed holding a replicated move's
/// fence; the standby rolls the fence back and finishes the rebalance; nothing lost.
#[test]
fn an_r2_auto_rebalance_whose_leader_is_sigkilled_holding_the_fence_is_finished_by_the_standby() {
    let (mut c, before) = three_nodes();
    let mut leader = ControllerProc::start(
        &c.endpoint,
        "leader",
        &["--auto-rebalance", "--hold-at", "fenced"],
    );
    leader.wait_line("leader (election", WAIT_MAX);
    let standby = ControllerProc::start(&c.endpoint, "standby", &["--auto-rebalance"]);
    standby.wait_line("campaigning", WAIT_MAX);
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, WAIT_MAX);
    writers.progress(1_000);
    c.add_node(3);
    leader.wait_line("holding at fenced", WAIT_MAX);
    let fenced = c.map();
    assert!(!fenced.fenced.is_empty(), "the fence is in the map");
    assert!(
        !fenced.syncing.is_empty(),
        "node 3 joins as a syncing replica"
    );
    leader.sigkill();
    standby.wait_line("leader (election", WAIT_MAX);
    wait_for("rebalanced", WAIT_MAX, || {
        let m = c.map();
        m.fenced.is_empty()
            && m.syncing.is_empty()
            && c.rt.block_on(c.etcd.read_move()).unwrap().is_none()
            && (slots_of(&m, 3) as f64 - f64::from(PARTITIONS * REPLICATION) / 4.0).abs() <= 1.0
    });
    assert_rebalanced(&c, &before, &standby.output());
    writers.progress(1_000);
    assert_none_lost(&writers.stop_and_check(&c), &standby.output());
}

/// The checker can fail: a rebalance whose joining replicas are never filled (they get
/// only the writes made after they joined — none here: the writers stop first) switches
/// them in, primaries included, and the keys written before are gone from them.
#[test]
fn an_r2_rebalance_without_the_fill_loses_writes_and_the_checker_sees_it() {
    let (mut c, _) = three_nodes();
    let mut writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, WAIT_MAX);
    writers.progress(1_000);
    c.add_node(3);
    writers.stop();
    // Without the fill and without the reconcile under the fence (which alone would copy
    // a primary's partitions whole to an empty `to`).
    let (status, said) = Tool::start(
        &c,
        &["rebalance", "--unsafe-no-fill", "--unsafe-no-final-copy"],
    )
    .finish();
    assert!(status.success(), "cluster rebalance: {status}\n{said}");
    let lost = writers.stop_and_check(&c);
    assert!(
        lost.iter().any(|l| l.contains(": read ")),
        "the broken rebalance lost no read: the checker is blind\n{said}"
    );
    assert!(
        lost.iter().any(|l| l.contains(": replica on node 3")),
        "no replica was found missing a write\n{said}"
    );
}

/// The final pass under the fence brings every member that stays in a moved partition's
/// set to the old primary's state — not only the new primary. A backup that refused a
/// copy as the fence began lacks that write, though the new primary has it (the issue
/// 19 expansion case); here the test makes the staying backup diverge by hand while the
/// mover holds (a key deleted there, a stray key added), and after the switch the backup
/// holds exactly the new primary's keys of the partition.
#[test]
fn the_final_pass_brings_the_staying_backups_to_the_old_primarys_state() {
    let (mut c, _) = three_nodes();
    let writer = client(&c.endpoint, &c.addrs);
    let m = c.map();
    // A partition node 0 leads, and its other member (which stays: the move replaces 0).
    let p = (0..PARTITIONS).find(|p| m.primary(*p) == Some(0)).unwrap();
    let backup = m.replicas(p)[1];
    let keys: Vec<String> = (0..)
        .map(|i| format!("fenced-{i}"))
        .filter(|k| m.partition_of(k.as_bytes()) == p)
        .take(3)
        .collect();
    for k in &keys[..2] {
        writer.put(k.as_bytes(), Bytes::from(k.clone())).unwrap();
    }
    add_node_to_map(&mut c, 3);
    let mover = held_move(&c, &[p.to_string()], "3000");
    let b = c.map().node(backup).unwrap().addr;
    let raw = Client::connect(
        ClientMap {
            epoch: 0,
            nodes: vec![NodeInfo {
                id: backup,
                addr: b,
            }],
        },
        ClientConfig::default(),
    )
    .unwrap();
    let far = 1u64 << 40;
    for (key, value) in [
        (&keys[0], None),
        (&keys[2], Some(Bytes::from_static(b"stray"))),
    ] {
        let op = Op::Apply {
            key: Bytes::from(key.clone()),
            version: far,
            value,
        };
        reply::version(raw.call(backup, op)).unwrap();
    }
    let (status, said) = mover.finish();
    assert!(status.success(), "cluster move: {status}\n{said}");
    assert!(said.contains("switched at epoch"), "{said}");
    let after = c.map();
    assert_eq!(after.primary(p), Some(3), "{said}");
    assert!(after.replicas(p).contains(&backup), "{said}");
    let of_p = |node| -> BTreeMap<Vec<u8>, Bytes> {
        node_keys(&after, node)
            .into_iter()
            .filter(|(k, _)| after.partition_of(k) == p)
            .collect()
    };
    let (on_primary, on_backup) = (of_p(3), of_p(backup));
    let written: Vec<&[u8]> = keys[..2].iter().map(|k| k.as_bytes()).collect();
    assert_eq!(
        on_primary.keys().map(Vec::as_slice).collect::<Vec<_>>(),
        written,
        "{said}"
    );
    assert_eq!(
        on_backup, on_primary,
        "the staying backup differs from the new primary\n{said}"
    );
}

/// A backup that stays in the moved partitions' sets is SIGKILLed while the mover holds
/// after its fill: the final pass under the fence cannot reach it, skips it (a dead
/// member is the failover's business, not a reason to undo the move) and the move
/// switches; a controller started afterwards fails the dead node over and re-replicates,
/// and no acknowledged write is lost.
#[test]
fn a_staying_backup_sigkilled_before_the_final_pass_is_skipped_and_nothing_is_lost() {
    let (mut c, _) = three_nodes();
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, WAIT_MAX);
    writers.progress(1_000);
    add_node_to_map(&mut c, 3);
    let m = c.map();
    // Partitions node 0 leads with node 1 as the backup that stays.
    let moved: Vec<String> = (0..PARTITIONS)
        .filter(|p| m.replicas(*p) == [0, 1])
        .map(|p| p.to_string())
        .collect();
    assert!(!moved.is_empty(), "no partition led by 0 and backed by 1");
    let mover = held_move(&c, &moved, "3000");
    c.servers[1].process_mut().kill().unwrap();
    c.addrs.remove(1);
    let (status, said) = mover.finish();
    assert!(status.success(), "cluster move: {status}\n{said}");
    assert!(said.contains("node 1: skipped"), "{said}");
    assert!(said.contains("switched at epoch"), "{said}");
    let after = c.map();
    for p in &moved {
        let p: u32 = p.parse().unwrap();
        assert_eq!(after.primary(p), Some(3), "partition {p}: {said}");
    }
    let ctl = ControllerProc::start(&c.endpoint, "ctl", &[]);
    ctl.wait_line("leader", WAIT_MAX);
    wait_for("node 1 failed over and R restored", WAIT_MAX, || {
        let m = c.map();
        m.syncing.is_empty()
            && m.node(1).is_none()
            && (0..PARTITIONS).all(|p| m.replicas(p).len() == REPLICATION as usize)
    });
    writers.progress(500);
    let said = format!("{said}\ncontroller:\n{}", ctl.output());
    assert_none_lost(&writers.stop_and_check(&c), &said);
}
