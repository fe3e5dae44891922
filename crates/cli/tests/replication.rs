//! Primary-backup replication with real `camelot server` processes on a real etcd:
//! every acknowledged write is on the backup, and survives a SIGKILL of its primary once
//! a map promotes the backup (published here by hand — the controller is not built).
#![cfg(feature = "etcd")]

use std::collections::HashMap;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use camelot_client::{Client, ClientConfig, ClientError, ClusterMap as ClientMap, NodeInfo};
use camelot_cluster::etcd::EtcdCluster;
use camelot_cluster::follow::{client_view, EtcdMapSource};
use camelot_cluster::ClusterMap;
use camelot_proto::ErrorCode;
use camelot_testkit::{CamelotServer, EtcdServer};

const PARTITIONS: u32 = 64;

mod support;
use support::{wait_for, PREFIX};

struct Cluster {
    _etcd_server: EtcdServer,
    endpoint: String,
    servers: Vec<CamelotServer>,
    addrs: Vec<std::net::SocketAddr>,
    /// Nodes not killed (a client connects to every node it is given at once).
    alive: Vec<u32>,
    rt: tokio::runtime::Runtime,
    etcd: EtcdCluster,
}

impl Cluster {
    /// `n` servers registered in a fresh etcd, and a map with `replication` published.
    fn start(n: u32, replication: u32, extra: &[&str]) -> (Cluster, ClusterMap) {
        let mut args = vec!["--replication-timeout-ms", "500"];
        args.extend_from_slice(extra);
        let support::EtcdServers {
            etcd_server,
            endpoint,
            servers,
            addrs,
            rt,
            etcd,
        } = support::start(n, "64M", &args);
        let live = rt.block_on(etcd.live_nodes()).unwrap();
        let map = ClusterMap::initial(live, PARTITIONS, replication).unwrap();
        let c = Cluster {
            _etcd_server: etcd_server,
            endpoint,
            servers,
            addrs,
            alive: (0..n).collect(),
            rt,
            etcd,
        };
        let map = c.publish(map, &(0..n).collect::<Vec<_>>());
        (c, map)
    }

    /// Publishes `map` as the next epoch; waits until the servers `alive` have it.
    fn publish(&self, map: ClusterMap, alive: &[u32]) -> ClusterMap {
        let published = self
            .rt
            .block_on(self.etcd.update_map(3, move |_| Ok(map.clone())))
            .unwrap()
            .map;
        let probe = Client::connect(self.alive_map(), ClientConfig::default()).unwrap();
        support::wait_epoch(&probe, alive.iter().copied(), published.epoch);
        published
    }

    fn alive_map(&self) -> ClientMap {
        ClientMap {
            epoch: 0,
            nodes: self
                .alive
                .iter()
                .map(|&id| NodeInfo {
                    id,
                    addr: self.addrs[id as usize],
                })
                .collect(),
        }
    }

    fn client(&self, config: ClientConfig) -> Client {
        let client = Client::connect(self.alive_map(), config).unwrap();
        client.set_map_source(
            EtcdMapSource::connect(std::slice::from_ref(&self.endpoint), PREFIX).unwrap(),
        );
        assert!(client.refresh_map().unwrap());
        client
    }

    fn signal(&mut self, node: usize, sig: &str) {
        if sig == "-KILL" {
            self.alive.retain(|&n| n as usize != node);
        }
        let pid = self.servers[node].process_mut().pid().to_string();
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    }
}

/// Every partition's backup becomes its primary (the old primary its backup).
fn promoted(map: &ClusterMap) -> ClusterMap {
    let mut m = map.clone();
    for r in &mut m.assignment {
        r.rotate_left(1);
    }
    m
}

/// `dead` leaves the map: its partitions are served by what remains of their replica
/// set, the first survivor (the backup) promoted.
fn without(map: &ClusterMap, dead: u32) -> ClusterMap {
    let mut m = map.clone();
    m.nodes.retain(|n| n.id != dead);
    for r in &mut m.assignment {
        r.retain(|n| *n != dead);
    }
    m
}

/// Which partitions `map` gives node 0 as primary.
fn last_dead_parts(map: &ClusterMap) -> Vec<bool> {
    (0..PARTITIONS).map(|p| map.primary(p) == Some(0)).collect()
}

fn value(tag: &str, i: usize) -> Vec<u8> {
    format!("{tag}-{i}").into_bytes()
}

#[test]
fn acknowledged_writes_are_on_the_backup_and_backups_refuse_clients() {
    let (c, map) = Cluster::start(3, 2, &[]);
    let client = c.client(ClientConfig::default());
    const KEYS: usize = 300;
    for i in 0..KEYS {
        client
            .put(format!("k{i}").as_bytes(), value("a", i))
            .unwrap();
    }
    // Overwrites, deletes and re-creations, in one batch and one by one: the copies must
    // leave each backup with the last state, never resurrect a deleted key.
    let pairs: Vec<(String, bytes::Bytes)> = (0..KEYS)
        .step_by(2)
        .map(|i| (format!("k{i}"), bytes::Bytes::from(value("b", i))))
        .collect();
    client.put_many(&pairs).unwrap();
    let gone: Vec<String> = (0..KEYS).step_by(3).map(|i| format!("k{i}")).collect();
    client.delete_many(&gone).unwrap();
    for i in (0..KEYS).step_by(9) {
        client
            .put(format!("k{i}").as_bytes(), value("c", i))
            .unwrap();
    }
    let expected = |i: usize| -> Option<Vec<u8>> {
        if i.is_multiple_of(9) {
            Some(value("c", i))
        } else if i.is_multiple_of(3) {
            None
        } else if i.is_multiple_of(2) {
            Some(value("b", i))
        } else {
            Some(value("a", i))
        }
    };

    // A client routed to a backup (a map that names it primary, at the servers' epoch,
    // with nowhere to refresh from) is told MOVED for a write. A GET at the servers'
    // epoch to a full backup is a replica read (`Client::get_any_replica`: one map per
    // epoch, so only a client that chose the backup sends it one) and is answered from
    // the copy.
    let wrong = Client::connect(ClientMap::from_addrs(&c.addrs), ClientConfig::default()).unwrap();
    let (view, table) = client_view(&promoted(&map)).unwrap();
    wrong.set_cluster(view, table).unwrap();
    match wrong.put(b"k1", value("x", 1)).unwrap_err() {
        ClientError::Server(e) => assert_eq!((e.code, e.epoch), (ErrorCode::Moved, 1)),
        other => panic!("expected MOVED, got {other:?}"),
    }
    assert_eq!(
        wrong.get(b"k1").unwrap().map(|v| v.value.to_vec()),
        expected(1),
        "a replica read at the backup"
    );

    // Promote every backup: no client ever wrote to a backup (they answer MOVED), so
    // what clients read now is only what the copies put there.
    let promoted_map = c.publish(promoted(&map), &[0, 1, 2]);
    let reader = c.client(ClientConfig::default());
    assert_eq!(reader.epoch(), promoted_map.epoch);
    for i in 0..KEYS {
        let got = reader.get(format!("k{i}").as_bytes()).unwrap();
        assert_eq!(
            got.map(|v| v.value.to_vec()),
            expected(i),
            "k{i} on its promoted backup"
        );
    }
    // And the promoted backups take writes that supersede every copy.
    for i in 0..KEYS {
        reader
            .put(format!("k{i}").as_bytes(), value("d", i))
            .unwrap();
        let got = reader.get(format!("k{i}").as_bytes()).unwrap().unwrap();
        assert_eq!(got.value.to_vec(), value("d", i));
    }
}

/// What a writer thread knows of one of its keys.
#[derive(Clone, Copy, Debug)]
enum Acked {
    Put(u64),
    Deleted(u64),
}

/// A writer's keys: the last acknowledged state, and the highest seq attempted.
type Book = Arc<Mutex<HashMap<String, (Acked, u64)>>>;

struct KillReport {
    acked: u64,
    failed: u64,
    lost: Vec<String>,
    unavailable: Duration,
}

/// Writers load the cluster (R=2); the backups are paused for a moment (so the
/// primary's copies stall), node 0 is SIGKILLed, the backups resume, and a map without
/// node 0 is published. Then every key is read back and checked against the last
/// write each writer saw acknowledged.
fn kill_the_primary_under_load(extra: &[&str]) -> KillReport {
    const WRITERS: usize = 4;
    let (mut c, map) = Cluster::start(3, 2, extra);
    let stop = Arc::new(AtomicBool::new(false));
    let acked_total = Arc::new(AtomicU64::new(0));
    let failed_total = Arc::new(AtomicU64::new(0));
    // Last success on a partition node 0 was primary of, in µs since `t0`.
    let t0 = Instant::now();
    let last_ok_on_dead_us = Arc::new(AtomicU64::new(0));
    let dead_parts: Vec<bool> = (0..PARTITIONS).map(|p| map.primary(p) == Some(0)).collect();
    let books: Vec<Book> = (0..WRITERS).map(|_| Arc::default()).collect();
    let mut threads = Vec::new();
    for (w, book) in books.iter().enumerate() {
        let client = c.client(ClientConfig {
            request_timeout: Duration::from_secs(2),
            ..ClientConfig::default()
        });
        let (stop, book, acked_total, failed_total) = (
            stop.clone(),
            book.clone(),
            acked_total.clone(),
            failed_total.clone(),
        );
        let (last_ok, dead_parts) = (last_ok_on_dead_us.clone(), dead_parts.clone());
        // Only keys node 0 is primary of: writers blocked on the paused backups' own
        // partitions would write nothing to node 0 while they are paused.
        // Only keys node 0 is primary of (writers blocked on the paused backups' own
        // partitions would write nothing to node 0 meanwhile), and a fresh key for every
        // PUT: a key written again after the failover would hide a write lost before it.
        let mut fresh_keys = (0u64..).map(move |j| format!("w{w}-{j}")).filter(move |k| {
            dead_parts[camelot_proto::partition_of(k.as_bytes(), PARTITIONS) as usize]
        });
        let dead_parts = last_dead_parts(&map);
        threads.push(std::thread::spawn(move || {
            let mut seq = 0u64;
            let mut last_put: Option<String> = None;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                // Every 7th operation deletes the key last put.
                let (key, delete) = match (seq.is_multiple_of(7), last_put.take()) {
                    (true, Some(k)) => (k, true),
                    (_, prev) => {
                        let _ = prev;
                        (fresh_keys.next().unwrap(), false)
                    }
                };
                let r = if delete {
                    client.delete(key.as_bytes()).map(|_| ())
                } else {
                    client.put(key.as_bytes(), seq.to_string()).map(|_| ())
                };
                if !delete {
                    last_put = Some(key.clone());
                }
                // The highest seq attempted on the key, acknowledged or not.
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
                        acked_total.fetch_add(1, Ordering::Relaxed);
                        let p = camelot_proto::partition_of(key.as_bytes(), PARTITIONS);
                        if dead_parts[p as usize] {
                            last_ok.fetch_max(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        drop(b);
                        failed_total.fetch_add(1, Ordering::Relaxed);
                        // Maybe the map moved on; a dead connection brings no MOVED.
                        let _ = client.refresh_map();
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
        }));
    }
    wait_for("writes under way", Duration::from_secs(20), || {
        acked_total.load(Ordering::Relaxed) >= 2000
    });
    c.signal(1, "-STOP");
    c.signal(2, "-STOP");
    std::thread::sleep(Duration::from_millis(200)); // let writes pile up behind the pause
    c.signal(0, "-KILL");
    let killed_us = t0.elapsed().as_micros() as u64;
    c.signal(1, "-CONT");
    c.signal(2, "-CONT");
    let next = c.publish(without(&map, 0), &[1, 2]);
    assert_eq!(next.epoch, 2);
    wait_for(
        "writes to node 0's partitions again",
        Duration::from_secs(20),
        || last_ok_on_dead_us.load(Ordering::Relaxed) > killed_us,
    );
    let unavailable = Duration::from_micros(last_ok_on_dead_us.load(Ordering::Relaxed) - killed_us);
    std::thread::sleep(Duration::from_millis(300)); // keep writing on the new map
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }

    let reader = c.client(ClientConfig::default());
    let mut lost = Vec::new();
    for book in &books {
        for (key, (acked, attempted)) in book.lock().unwrap().iter() {
            let got = reader.get(key.as_bytes()).unwrap().map(|v| {
                String::from_utf8(v.value.to_vec())
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
            });
            // Acceptable: the acknowledged state, or that of a later (unacknowledged)
            // write; never an older one.
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
    KillReport {
        acked: acked_total.load(Ordering::Relaxed),
        failed: failed_total.load(Ordering::Relaxed),
        lost,
        unavailable,
    }
}

#[test]
fn sigkill_of_a_primary_under_load_loses_no_acknowledged_write() {
    let r = kill_the_primary_under_load(&[]);
    println!(
        "acked {} failed {} lost {} unavailable {:?} (backups paused 200 ms, map by hand)",
        r.acked,
        r.failed,
        r.lost.len(),
        r.unavailable
    );
    assert!(r.acked >= 2000);
    assert!(r.lost.is_empty(), "acknowledged writes lost: {:#?}", r.lost);
}

/// The checker can fail: servers that acknowledge before their backups have the copy
/// lose the writes acknowledged while the backups were paused. Runs in CI (about 2 s in
/// a debug build), so CI shows the check above is not blind.
#[test]
fn acking_before_the_copy_loses_writes_and_the_checker_sees_it() {
    let r = kill_the_primary_under_load(&["--unsafe-ack-before-replication"]);
    println!(
        "broken variant: acked {} failed {} lost {}: {:?}",
        r.acked,
        r.failed,
        r.lost.len(),
        r.lost.iter().take(5).collect::<Vec<_>>()
    );
    assert!(!r.lost.is_empty(), "the checker found nothing to object to");
}
