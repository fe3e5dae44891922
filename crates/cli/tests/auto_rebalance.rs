//! `camelot cluster controller --auto-rebalance` with real processes: etcd, `camelot
//! server --etcd` nodes and controllers. A node joins a 2-node cluster under writes; the
//! controller alone (no `cluster rebalance`) moves about P/N partitions to it, and every
//! acknowledged write is read back. Without the flag the joined node gets nothing (and the
//! same cluster does rebalance once a controller with the flag takes over, so the "nothing"
//! is not a slow test). A leader SIGKILLed while its move holds the fence is replaced by a
//! standby that finishes the rebalance; a controller whose moves skip the final copy loses
//! writes, and the same checker sees it.
#![cfg(feature = "etcd")]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use camelot_cluster::ClusterMap;

mod support;
use camelot_testkit::{CamelotServer, CamelotServerOptions};
use support::{bin, wait_for, ControllerProc, EtcdServers, Writers};

const PARTITIONS: u32 = 64;
const WRITERS: usize = 2;
const KEYS_PER_WRITER: usize = 200;
/// Bound on any one wait for the cluster to reach a state.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// How long a controller without the flag is watched for moves it must not make: it
/// ticks every 50 ms and samples the load every second, so 3 s is 60 chances.
const NO_MOVE_WATCH: Duration = Duration::from_secs(3);

/// What this file checks of the writers' book.
trait Check {
    fn stop_and_check(self, c: &EtcdServers) -> Vec<String>;
}

impl Check for Writers {
    /// Stops the writers and reads every acknowledged key back: the lost ones.
    fn stop_and_check(mut self, c: &EtcdServers) -> Vec<String> {
        self.stop();
        assert!(
            self.acked.lock().unwrap().len() > WRITERS * KEYS_PER_WRITER / 2,
            "too few keys checked"
        );
        let lost = self.lost(c);
        println!(
            "{} writes acknowledged, {} failed, {} lost",
            self.acked_count.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            lost.len()
        );
        lost
    }
}

/// Two servers with a map of [`PARTITIONS`] (R = 1) over them.
fn two_nodes() -> (EtcdServers, ClusterMap) {
    let c = support::start(2, "64M", &[]);
    let before = c.publish_initial(PARTITIONS, 1);
    (c, before)
}

fn primaries_of(map: &ClusterMap, node: u32) -> usize {
    (0..map.partitions())
        .filter(|&p| map.primary(p) == Some(node))
        .count()
}

/// Waits until node 2 holds its share (P/3 ± 10 %), no move is recorded and nothing is
/// fenced; then checks that only moves onto node 2 were made.
fn wait_rebalanced(c: &EtcdServers, before: &ClusterMap, ctl: &ControllerProc) {
    let share = f64::from(PARTITIONS) / 3.0;
    let start = Instant::now();
    loop {
        let m = c.map();
        let onto = primaries_of(&m, 2) as f64;
        let idle = m.fenced.is_empty() && c.rt.block_on(c.etcd.read_move()).unwrap().is_none();
        if idle && (onto - share).abs() <= 0.1 * share {
            let moved = (0..PARTITIONS)
                .filter(|&p| before.primary(p) != m.primary(p))
                .count() as f64;
            assert_eq!(moved, onto, "only moves onto the new node");
            return;
        }
        assert!(
            start.elapsed() < WAIT_MAX,
            "not rebalanced within {WAIT_MAX:?}: node 2 holds {onto} of {PARTITIONS}; the controller said:\n{}",
            ctl.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn auto_rebalance_moves_about_p_over_n_to_a_joining_node_with_no_write_lost() {
    let (mut c, before) = two_nodes();
    let ctl = ControllerProc::start(&c.endpoint, "auto", &["--auto-rebalance"]);
    ctl.wait_line("leader", WAIT_MAX);
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, Duration::from_secs(30));
    writers.progress(1_000);
    c.add_node(2);
    ctl.wait_line("on membership", WAIT_MAX);
    wait_rebalanced(&c, &before, &ctl);
    writers.progress(1_000);
    let lost = writers.stop_and_check(&c);
    assert!(
        lost.is_empty(),
        "{} lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}

#[test]
fn without_auto_rebalance_a_joining_node_gets_nothing_until_a_controller_with_it_leads() {
    let (mut c, before) = two_nodes();
    let mut plain = ControllerProc::start(&c.endpoint, "plain", &[]);
    plain.wait_line("leader", WAIT_MAX);
    c.add_node(2);
    // The controller does put the node in the map (join), so it sees it…
    plain.wait_line("joined", WAIT_MAX);
    let joined_epoch = c.map().epoch;
    let watch_end = Instant::now() + NO_MOVE_WATCH;
    while Instant::now() < watch_end {
        let m = c.map();
        assert_eq!(
            primaries_of(&m, 2),
            0,
            "a controller without --auto-rebalance moved partitions:\n{}",
            plain.output()
        );
        assert_eq!(m.epoch, joined_epoch, "the map changed after the join");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(c.rt.block_on(c.etcd.read_move()).unwrap().is_none());
    assert!(!plain.output().contains("auto-rebalance"));
    // …and the same cluster does rebalance once a controller with the flag leads.
    plain.sigkill();
    let auto = ControllerProc::start(&c.endpoint, "auto", &["--auto-rebalance"]);
    auto.wait_line("on membership", WAIT_MAX);
    wait_rebalanced(&c, &before, &auto);
}

#[test]
fn an_auto_rebalance_whose_leader_is_sigkilled_holding_the_fence_is_finished_by_the_standby() {
    let (mut c, before) = two_nodes();
    let mut leader = ControllerProc::start(
        &c.endpoint,
        "leader",
        &["--auto-rebalance", "--hold-at", "fenced"],
    );
    leader.wait_line("leader (election", WAIT_MAX);
    let standby = ControllerProc::start(&c.endpoint, "standby", &["--auto-rebalance"]);
    standby.wait_line("campaigning", WAIT_MAX);
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, Duration::from_secs(30));
    writers.progress(1_000);
    c.add_node(2);
    leader.wait_line("holding at fenced", WAIT_MAX);
    assert!(
        !c.map().fenced.is_empty(),
        "the fence is in the map while the leader holds"
    );
    leader.sigkill();
    standby.wait_line("leader (election", WAIT_MAX);
    // Its move worker resumes the recorded move (rolls the fence back) before its plan.
    standby.wait_line("auto-rebalance: epoch", WAIT_MAX);
    wait_rebalanced(&c, &before, &standby);
    writers.progress(1_000);
    let lost = writers.stop_and_check(&c);
    assert!(
        lost.is_empty(),
        "{} lost: {:?}\nstandby said:\n{}",
        lost.len(),
        &lost[..lost.len().min(5)],
        standby.output()
    );
}

/// The same kill while another node is dead (R = 1: failover leaves a dead node's
/// partitions stranded, and the node in the map): the standby must still resume the
/// recorded move and lift its fence. Before, it planned nothing while any map node was
/// dead, and so never looked at the record: the fenced partitions of a live node stayed
/// unserved.
#[test]
fn a_fence_left_by_a_sigkilled_leader_is_lifted_while_another_node_is_dead() {
    let (mut c, _before) = two_nodes();
    let mut leader = ControllerProc::start(
        &c.endpoint,
        "leader",
        &["--auto-rebalance", "--hold-at", "fenced"],
    );
    leader.wait_line("leader (election", WAIT_MAX);
    let standby = ControllerProc::start(&c.endpoint, "standby", &["--auto-rebalance"]);
    standby.wait_line("campaigning", WAIT_MAX);
    c.add_node(2);
    leader.wait_line("holding at fenced", WAIT_MAX);
    let record =
        c.rt.block_on(c.etcd.read_move())
            .unwrap()
            .expect("the held move is recorded")
            .record;
    let bystander = (0..2u32)
        .find(|n| *n != record.from && *n != record.to)
        .expect("a node outside the move");
    c.servers[bystander as usize]
        .process_mut()
        .kill()
        .expect("SIGKILL the bystander");
    leader.sigkill();
    standby.wait_line("leader (election", WAIT_MAX);
    let start = Instant::now();
    while !c.map().fenced.is_empty() {
        assert!(
            start.elapsed() < WAIT_MAX,
            "the fence stayed with node {bystander} dead; the standby said:\n{}",
            standby.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The checker can fail: a controller whose moves switch without the final copy, with
/// writes made while it holds after its catch-up passes (and none after, so nothing
/// overwrites what it loses).
#[test]
fn an_auto_rebalance_without_the_final_copy_loses_writes_and_the_checker_sees_it() {
    let (mut c, before) = two_nodes();
    let ctl = ControllerProc::start(
        &c.endpoint,
        "broken",
        &[
            "--auto-rebalance",
            "--unsafe-no-final-copy",
            "--hold-at",
            "copied",
            "--hold-ms",
            "1000",
        ],
    );
    ctl.wait_line("leader", WAIT_MAX);
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, Duration::from_secs(30));
    writers.progress(1_000);
    c.add_node(2);
    ctl.wait_line("holding at copied", WAIT_MAX);
    writers.progress(200);
    writers.signal_stop();
    wait_rebalanced(&c, &before, &ctl);
    let lost = writers.stop_and_check(&c);
    assert!(
        !lost.is_empty(),
        "the broken auto-rebalance lost nothing: the checker is blind"
    );
}

/// The load trigger with real processes: node 0 throttled to 300 executed ops/s, node 1
/// not, an even map, writers in a closed loop. Node 0 waits in its throttle, node 1 has
/// time to spare; after 3 report periods the controller plans with measured weights and
/// moves partitions off node 0 — with no membership change at all — and loses no write.
#[test]
fn a_sustained_load_imbalance_moves_partitions_off_the_saturated_node() {
    let mut c = support::start(1, "64M", &["--ops-per-sec-max", "300"]);
    let args: Vec<String> = ["--memory", "64M", "--etcd", &c.endpoint, "--node-id", "1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let fast = CamelotServer::start(bin(), &CamelotServerOptions { resp: false, args }).unwrap();
    c.addrs.push(fast.addr());
    c.servers.push(fast);
    wait_for("node 1 registered", Duration::from_secs(10), || {
        c.rt.block_on(c.etcd.live_nodes()).unwrap().len() == 2
    });
    let before = c.publish_initial(PARTITIONS, 1);
    assert_eq!(primaries_of(&before, 0), PARTITIONS as usize / 2);
    let ctl = ControllerProc::start(&c.endpoint, "auto", &["--auto-rebalance"]);
    ctl.wait_line("leader", WAIT_MAX);
    let writers = Writers::start(&c, WRITERS, KEYS_PER_WRITER, Duration::from_secs(30));
    let line = ctl.wait_line("on load imbalance", WAIT_MAX);
    assert!(!ctl.output().contains("on membership"), "{}", ctl.output());
    ctl.wait_line("plan done", WAIT_MAX);
    let after = c.map();
    let left = primaries_of(&after, 0);
    assert!(
        left < PARTITIONS as usize / 2 - 4,
        "node 0 still primary of {left}: {line}\n{}",
        ctl.output()
    );
    writers.progress(300);
    let lost = writers.stop_and_check(&c);
    assert!(lost.is_empty(), "{} lost", lost.len());
    println!("{line}; node 0 keeps {left} of {PARTITIONS}");
}
