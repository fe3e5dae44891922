//! Failover by the controller, with real processes: etcd, `camelot server --etcd` nodes and
//! `camelot cluster controller`s (a leader and a standby), each SIGKILLed by the tests.
//! Writers load the cluster (R=2) and keep a book of every write acknowledged; after the
//! kills every key is read back and checked against it. The broken variant (a controller
//! that promotes a node holding nothing) must make the same checker report lost writes.
#![cfg(feature = "etcd")]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use camelot_client::{Client, ClientConfig, ClusterMap as ClientMap, NodeInfo};
use camelot_cluster::etcd::EtcdCluster;
use camelot_cluster::follow::EtcdMapSource;
use camelot_cluster::ClusterMap;
use camelot_testkit::{CamelotServer, EtcdServer};

mod support;
use support::{wait_for, ControllerProc, PREFIX};

const PARTITIONS: u32 = 64;
const WRITERS: usize = 4;
/// The lease TTL of servers and controllers (the default).
const TTL: Duration = Duration::from_secs(2);
/// Bound on any one wait for the cluster to reach a state.
const WAIT_MAX: Duration = Duration::from_secs(40);

struct Cluster {
    _etcd_server: EtcdServer,
    endpoint: String,
    servers: Vec<CamelotServer>,
    addrs: Vec<std::net::SocketAddr>,
    killed: Vec<u32>,
    rt: tokio::runtime::Runtime,
    etcd: EtcdCluster,
}

impl Cluster {
    /// `n` servers in a fresh etcd and a map of [`PARTITIONS`] with `replication`.
    fn start(n: u32, replication: u32) -> Cluster {
        let support::EtcdServers {
            etcd_server,
            endpoint,
            servers,
            addrs,
            rt,
            etcd,
        } = support::start(n, "64M", &["--replication-timeout-ms", "500"]);
        let live = rt.block_on(etcd.live_nodes()).unwrap();
        let map = ClusterMap::initial(live, PARTITIONS, replication).unwrap();
        rt.block_on(etcd.update_map(3, move |_| Ok(map.clone())))
            .unwrap();
        Cluster {
            _etcd_server: etcd_server,
            endpoint,
            servers,
            addrs,
            killed: Vec::new(),
            rt,
            etcd,
        }
    }

    fn map(&self) -> ClusterMap {
        self.rt.block_on(self.etcd.read_map()).unwrap().unwrap().map
    }

    fn client(&self) -> Client {
        let nodes = (0..self.addrs.len() as u32)
            .filter(|n| !self.killed.contains(n))
            .map(|id| NodeInfo {
                id,
                addr: self.addrs[id as usize],
            })
            .collect();
        let client = Client::connect(
            ClientMap { epoch: 0, nodes },
            ClientConfig {
                request_timeout: Duration::from_secs(2),
                ..ClientConfig::default()
            },
        )
        .unwrap();
        client.set_map_source(
            EtcdMapSource::connect(std::slice::from_ref(&self.endpoint), PREFIX).unwrap(),
        );
        assert!(client.refresh_map().unwrap());
        client
    }

    fn sigkill(&mut self, node: u32) {
        self.servers[node as usize].process_mut().kill().unwrap();
        self.killed.push(node);
    }

    /// Waits until the map names none of the killed nodes and every partition has
    /// `replicas` full replicas (none syncing).
    fn wait_repaired(&self, replicas: usize, limit: Duration) -> ClusterMap {
        let mut last = None;
        let start = Instant::now();
        loop {
            let m = self.map();
            let clean = m
                .assignment
                .iter()
                .all(|s| s.len() == replicas && s.iter().all(|n| !self.killed.contains(n)))
                && m.syncing.is_empty();
            if clean {
                return m;
            }
            assert!(
                start.elapsed() < limit,
                "the map was not repaired within {limit:?}: {last:?}"
            );
            last = Some(m);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// What a writer knows of one of its keys.
#[derive(Clone, Copy, Debug)]
enum Acked {
    Put(u64),
    Deleted(u64),
}

/// A writer's keys: the last acknowledged state, and the highest seq attempted.
type Book = Arc<Mutex<HashMap<String, (Acked, u64)>>>;

/// Writers on every partition, until stopped; each success is timed per partition.
struct Load {
    stop: Arc<AtomicBool>,
    acked: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    books: Vec<Book>,
    t0: Instant,
    /// Per partition, µs since `t0` of the last success, and of the first success after
    /// `killed_us` (u64::MAX: none yet).
    last_ok_us: Arc<Vec<AtomicU64>>,
    first_after_us: Arc<Vec<AtomicU64>>,
    killed_us: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    fn start(c: &Cluster) -> Load {
        let t0 = Instant::now();
        let per_part = || -> Arc<Vec<AtomicU64>> {
            Arc::new((0..PARTITIONS).map(|_| AtomicU64::new(0)).collect())
        };
        let mut load = Load {
            stop: Arc::default(),
            acked: Arc::default(),
            failed: Arc::default(),
            books: (0..WRITERS).map(|_| Arc::default()).collect(),
            t0,
            last_ok_us: per_part(),
            first_after_us: Arc::new((0..PARTITIONS).map(|_| AtomicU64::new(u64::MAX)).collect()),
            killed_us: Arc::new(AtomicU64::new(u64::MAX)),
            threads: Vec::new(),
        };
        for w in 0..WRITERS {
            let client = c.client();
            let (stop, book, acked, failed) = (
                load.stop.clone(),
                load.books[w].clone(),
                load.acked.clone(),
                load.failed.clone(),
            );
            let (last_ok, first_after, killed) = (
                load.last_ok_us.clone(),
                load.first_after_us.clone(),
                load.killed_us.clone(),
            );
            load.threads.push(std::thread::spawn(move || {
                let mut seq = 0u64;
                let mut last_put: Option<String> = None;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    // Every 7th operation deletes the key last put; otherwise a fresh
                    // key, so a key written again later cannot hide an earlier loss.
                    let (key, delete) = match (seq.is_multiple_of(7), last_put.take()) {
                        (true, Some(k)) => (k, true),
                        _ => (format!("w{w}-{seq}"), false),
                    };
                    let r = if delete {
                        client.delete(key.as_bytes()).map(|_| ())
                    } else {
                        client.put(key.as_bytes(), seq.to_string()).map(|_| ())
                    };
                    if !delete {
                        last_put = Some(key.clone());
                    }
                    let mut b = book.lock().unwrap();
                    let entry = b.entry(key.clone()).or_insert((Acked::Deleted(0), 0));
                    entry.1 = seq;
                    match r {
                        Ok(()) => {
                            entry.0 = if delete {
                                Acked::Deleted(seq)
                            } else {
                                Acked::Put(seq)
                            };
                            drop(b);
                            acked.fetch_add(1, Ordering::Relaxed);
                            let p =
                                camelot_proto::partition_of(key.as_bytes(), PARTITIONS) as usize;
                            let now = t0.elapsed().as_micros() as u64;
                            last_ok[p].fetch_max(now, Ordering::Relaxed);
                            if now > killed.load(Ordering::Relaxed) {
                                first_after[p].fetch_min(now, Ordering::Relaxed);
                            }
                        }
                        Err(_) => {
                            drop(b);
                            failed.fetch_add(1, Ordering::Relaxed);
                            // The map may have moved on; a dead node brings no MOVED.
                            let _ = client.refresh_map();
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                }
            }));
        }
        load
    }

    fn wait_acked(&self, n: u64) {
        wait_for("writes under way", WAIT_MAX, || {
            self.acked.load(Ordering::Relaxed) >= n
        });
    }

    /// Marks the moment of a kill: the windows below are measured from the last success
    /// before it.
    fn mark_kill(&self) -> Vec<u64> {
        let before: Vec<u64> = self
            .last_ok_us
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        for f in self.first_after_us.iter() {
            f.store(u64::MAX, Ordering::Relaxed);
        }
        self.killed_us
            .store(self.t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        before
    }

    /// Per partition in `parts`, the time between its last write before the kill and its
    /// first after; waits (bounded) until every one of them has written again.
    fn windows(&self, before: &[u64], parts: &[u32]) -> Vec<Duration> {
        wait_for("every partition writable again", WAIT_MAX, || {
            parts
                .iter()
                .all(|p| self.first_after_us[*p as usize].load(Ordering::Relaxed) != u64::MAX)
        });
        parts
            .iter()
            .map(|p| {
                let after = self.first_after_us[*p as usize].load(Ordering::Relaxed);
                Duration::from_micros(after.saturating_sub(before[*p as usize]))
            })
            .collect()
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }

    /// Every key read back: the acknowledged state or that of a later attempt (not
    /// acknowledged, so either outcome is allowed), never an older one.
    fn lost(&self, c: &Cluster) -> Vec<String> {
        let reader = c.client();
        let mut lost = Vec::new();
        for book in &self.books {
            for (key, (acked, attempted)) in book.lock().unwrap().iter() {
                let got = reader.get(key.as_bytes()).unwrap().map(|v| {
                    String::from_utf8(v.value.to_vec())
                        .unwrap()
                        .parse::<u64>()
                        .unwrap()
                });
                let ok = match (acked, got) {
                    (Acked::Put(s), Some(v)) => v >= *s && v <= *attempted,
                    (Acked::Put(s), None) => *attempted > *s,
                    (Acked::Deleted(s), Some(v)) => v > *s && v <= *attempted,
                    (Acked::Deleted(_), None) => true,
                };
                if !ok {
                    lost.push(format!(
                        "{key}: acked {acked:?}, read {got:?}, attempted {attempted}"
                    ));
                }
            }
        }
        lost
    }
}

/// The partitions whose primary is `node`.
fn led_by(map: &ClusterMap, node: u32) -> Vec<u32> {
    (0..map.partitions())
        .filter(|p| map.primary(*p) == Some(node))
        .collect()
}

fn max(windows: &[Duration]) -> Duration {
    windows.iter().copied().max().unwrap_or_default()
}

#[test]
fn a_sigkilled_primary_is_replaced_by_its_backup_and_re_replicated_with_no_write_lost() {
    let mut c = Cluster::start(3, 2);
    let leader = ControllerProc::start(&c.endpoint, "a", &[]);
    leader.wait_line("leader", WAIT_MAX);
    let standby = ControllerProc::start(&c.endpoint, "b", &[]);
    standby.wait_line("campaigning", WAIT_MAX);
    let mut load = Load::start(&c);
    load.wait_acked(2000);

    // First failure: node 0, the primary of a third of the partitions.
    let map = c.map();
    let led = led_by(&map, 0);
    let all: Vec<u32> = (0..PARTITIONS).collect();
    let before = load.mark_kill();
    c.sigkill(0);
    let line = leader.wait_line("dead", WAIT_MAX);
    assert!(line.contains("node(s) [0] dead"), "{line}");
    let windows = load.windows(&before, &all);
    let promoted_windows: Vec<Duration> = led.iter().map(|p| windows[*p as usize]).collect();
    // Every partition is re-replicated onto the two survivors, copies made and checked.
    let repaired = c.wait_repaired(2, WAIT_MAX);
    leader.wait_line("replica(s) filled", WAIT_MAX);
    for p in &led {
        assert_ne!(repaired.primary(*p), Some(0));
    }
    println!(
        "kill of node 0: {} partition(s) promoted, unavailable at most {:?} (median {:?}) \
         — target 2×TTL+100 ms = {:?}; partitions that only lost a backup: at most {:?}",
        led.len(),
        max(&promoted_windows),
        {
            let mut w = promoted_windows.clone();
            w.sort();
            w[w.len() / 2]
        },
        TTL * 2 + Duration::from_millis(100),
        max(&windows)
    );
    // Bounded: detection takes a lease TTL; a missing controller would never repair.
    assert!(max(&windows) < Duration::from_secs(15), "{windows:?}");

    // Second failure: node 1. Its partitions now live on node 2 alone — half of them as
    // copies re-replication made — and every acknowledged write must be there.
    load.wait_acked(load.acked.load(Ordering::Relaxed) + 1000);
    c.sigkill(1);
    leader.wait_line("node(s) [1] dead", WAIT_MAX);
    c.wait_repaired(1, WAIT_MAX);
    load.wait_acked(load.acked.load(Ordering::Relaxed) + 500);
    load.stop();
    let lost = load.lost(&c);
    println!(
        "acked {} failed {} lost {}",
        load.acked.load(Ordering::Relaxed),
        load.failed.load(Ordering::Relaxed),
        lost.len()
    );
    assert!(
        lost.is_empty(),
        "acknowledged writes lost: {:#?}",
        &lost[..lost.len().min(20)]
    );
    assert!(
        !standby.said("leader"),
        "the standby took over though the leader lived"
    );
}

/// The controller is SIGKILLed at `hold` (after seeing node 0 dead, before publishing the
/// failover; or mid-copy of the re-replication): the standby must finish the job.
fn controller_killed_at(hold: &str) {
    let mut c = Cluster::start(3, 2);
    let mut first = ControllerProc::start(&c.endpoint, "a", &["--hold-at", hold]);
    first.wait_line("leader", WAIT_MAX);
    let standby = ControllerProc::start(&c.endpoint, "b", &[]);
    standby.wait_line("campaigning", WAIT_MAX);
    let mut load = Load::start(&c);
    load.wait_acked(2000);
    let before = load.mark_kill();
    c.sigkill(0);
    first.wait_line(&format!("holding at {hold}"), WAIT_MAX);
    let held_at = Instant::now();
    first.sigkill();
    standby.wait_line("leader", WAIT_MAX);
    println!(
        "standby elected {:?} after the leader's SIGKILL",
        held_at.elapsed()
    );
    if hold == "detected" {
        standby.wait_line("node(s) [0] dead", WAIT_MAX);
    }
    let all: Vec<u32> = (0..PARTITIONS).collect();
    let windows = load.windows(&before, &all);
    c.wait_repaired(2, WAIT_MAX);
    standby.wait_line("replica(s) filled", WAIT_MAX);
    println!(
        "unavailable at most {:?} (two lease TTLs and the hold included)",
        max(&windows)
    );
    // And the copies the standby made hold every write: lose their source too.
    load.wait_acked(load.acked.load(Ordering::Relaxed) + 1000);
    c.sigkill(1);
    standby.wait_line("node(s) [1] dead", WAIT_MAX);
    c.wait_repaired(1, WAIT_MAX);
    load.wait_acked(load.acked.load(Ordering::Relaxed) + 500);
    load.stop();
    let lost = load.lost(&c);
    println!(
        "acked {} failed {} lost {}",
        load.acked.load(Ordering::Relaxed),
        load.failed.load(Ordering::Relaxed),
        lost.len()
    );
    assert!(
        lost.is_empty(),
        "acknowledged writes lost: {:#?}",
        &lost[..lost.len().min(20)]
    );
}

#[test]
fn a_controller_sigkilled_mid_failover_is_replaced_by_the_standby() {
    controller_killed_at("detected");
}

#[test]
fn a_controller_sigkilled_mid_copy_is_replaced_by_the_standby() {
    controller_killed_at("copying");
}

/// The checker can fail: a controller that promotes a node holding nothing of the dead
/// primary's partitions (instead of its backup) loses writes, and the read-back says so.
#[test]
fn a_controller_promoting_a_stale_node_loses_writes_and_the_checker_sees_it() {
    let mut c = Cluster::start(3, 2);
    let leader = ControllerProc::start(&c.endpoint, "bad", &["--unsafe-promote-stale"]);
    leader.wait_line("leader", WAIT_MAX);
    let mut load = Load::start(&c);
    load.wait_acked(2000);
    let led = led_by(&c.map(), 0);
    c.sigkill(0);
    leader.wait_line("node(s) [0] dead", WAIT_MAX);
    let before = load.mark_kill();
    let _ = load.windows(&before, &led);
    load.stop();
    let lost = load.lost(&c);
    println!(
        "broken controller: acked {} lost {}: {:?}",
        load.acked.load(Ordering::Relaxed),
        lost.len(),
        &lost[..lost.len().min(3)]
    );
    assert!(!lost.is_empty(), "the checker found nothing to object to");
}
