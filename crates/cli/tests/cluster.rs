//! The cluster on a real etcd with real `camelot server` processes: stale-epoch redirects
//! end to end, and `camelot cluster up/status/plan`.
#![cfg(feature = "etcd")]

use std::io::{BufRead, BufReader};

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use camelot_client::{Client, ClientConfig, ClientError, ClusterMap as ClientMap};
use camelot_cluster::etcd::EtcdCluster;
use camelot_cluster::follow::{client_view, EtcdMapSource};
use camelot_cluster::ClusterMap;
use camelot_proto::ErrorCode;

const KEYS: usize = 200;

mod support;
use support::{bin, rt, wait_for, PREFIX};

/// A client that has fetched the current map from etcd and refreshes it on redirects.
fn cluster_client(endpoint: &str, addrs: &[std::net::SocketAddr]) -> Client {
    let client = Client::connect(ClientMap::from_addrs(addrs), ClientConfig::default()).unwrap();
    client.set_map_source(EtcdMapSource::connect(&[endpoint.to_owned()], PREFIX).unwrap());
    assert!(client.refresh_map().unwrap());
    client
}

/// Publishes `map` as the next epoch and waits until every server has installed it.
fn publish_and_wait(
    rt: &tokio::runtime::Runtime,
    etcd: &EtcdCluster,
    probe: &Client,
    map: ClusterMap,
) -> u64 {
    let v = rt
        .block_on(etcd.update_map(3, move |_| Ok(map.clone())))
        .unwrap();
    let epoch = v.map.epoch;
    support::wait_epoch(probe, 0..2, epoch);
    epoch
}

fn value(round: &str, i: usize) -> Vec<u8> {
    format!("{round}-{i}").into_bytes()
}

fn swapped(map: &ClusterMap) -> ClusterMap {
    let mut m = map.clone();
    for r in &mut m.assignment {
        r[0] = 1 - r[0];
    }
    m
}

#[test]
fn a_stale_client_is_redirected_and_never_reads_an_older_value() {
    let support::EtcdServers {
        etcd_server: _etcd_server,
        endpoint,
        mut servers,
        addrs,
        rt,
        etcd,
    } = support::start(2, "64M", &[]);
    let live = rt.block_on(etcd.live_nodes()).unwrap();
    assert_eq!(
        live.iter().map(|n| n.addr).collect::<Vec<_>>(),
        addrs,
        "each server registered its own address under its id"
    );
    // Epoch 0 routing is never checked: this client sees every server's counters.
    let probe = Client::connect(ClientMap::from_addrs(&addrs), ClientConfig::default()).unwrap();
    let first = ClusterMap::initial(live, 64, 1).unwrap();
    assert_eq!(publish_and_wait(&rt, &etcd, &probe, first.clone()), 1);

    let fresh = cluster_client(&endpoint, &addrs);
    let stale = cluster_client(&endpoint, &addrs);
    let no_source =
        Client::connect(ClientMap::from_addrs(&addrs), ClientConfig::default()).unwrap();
    let (view, table) = client_view(&first).unwrap();
    no_source.set_cluster(view, table).unwrap();
    assert_eq!((fresh.epoch(), stale.epoch()), (1, 1));
    for i in 0..KEYS {
        fresh
            .put(format!("k{i}").as_bytes(), value("v1", i))
            .unwrap();
    }

    // Every partition changes primary. The old primaries keep their (now old) values;
    // only the epoch and ownership checks keep a stale client from reading them.
    let second = swapped(&first);
    assert_eq!(publish_and_wait(&rt, &etcd, &probe, second.clone()), 2);
    // The fresh client follows the map (as a watcher would make it); the stale one
    // still routes with epoch 1.
    assert!(fresh.refresh_map().unwrap());
    assert_eq!((fresh.epoch(), stale.epoch()), (2, 1));
    for i in 0..KEYS {
        fresh
            .put(format!("k{i}").as_bytes(), value("v2", i))
            .unwrap();
    }
    for i in 0..KEYS {
        let got = stale.get(format!("k{i}").as_bytes()).unwrap();
        assert_eq!(
            got.map(|v| v.value.to_vec()),
            Some(value("v2", i)),
            "k{i}: the stale client read something else than the fresh map gives"
        );
    }
    assert_eq!(stale.epoch(), 2, "the stale client refreshed its map");
    assert!(stale.redirects() >= 1);

    // A stale writer lands where the fresh map says, too.
    let third = swapped(&second);
    assert_eq!(publish_and_wait(&rt, &etcd, &probe, third), 3);
    for i in 0..KEYS {
        stale
            .put(format!("k{i}").as_bytes(), value("v3", i))
            .unwrap();
    }
    assert_eq!(stale.epoch(), 3);
    for i in 0..KEYS {
        let got = fresh.get(format!("k{i}").as_bytes()).unwrap();
        assert_eq!(got.map(|v| v.value.to_vec()), Some(value("v3", i)));
    }
    assert_eq!(fresh.epoch(), 3);
    assert!(
        fresh.redirects() >= 1,
        "the fresh client, now stale, was redirected"
    );

    // With nowhere to refresh from, the redirect reaches the caller, typed, with the
    // servers' epoch, after the bounded retries.
    let err = no_source.get(b"k1").unwrap_err();
    match &err {
        ClientError::Server(e) => {
            assert_eq!(e.code, ErrorCode::StaleEpoch);
            assert_eq!(e.epoch, 3);
        }
        other => panic!("expected STALE_EPOCH, got {other:?}"),
    }
    assert_eq!(
        no_source.redirects(),
        u64::from(camelot_client::kv::REDIRECTS_MAX)
    );

    // A member SIGKILLed leaves the live list one lease TTL later (no goodbye), and
    // `cluster status` shows it without a lease.
    servers[1].process_mut().kill().unwrap();
    let killed = Instant::now();
    wait_for(
        "the killed member's lease to expire",
        Duration::from_secs(10),
        || rt.block_on(etcd.live_nodes()).unwrap().len() == 1,
    );
    let gone = killed.elapsed();
    assert!(
        gone <= Duration::from_millis(3500),
        "gone only after {gone:?}"
    );
    let out = Command::new(bin())
        .args(["cluster", "status", "--etcd", &endpoint])
        .output()
        .unwrap();
    let status = String::from_utf8(out.stdout).unwrap();
    assert!(status.contains("epoch 3: 64 partitions"), "{status}");
    assert_eq!(status.matches(", live").count(), 1, "{status}");
    assert_eq!(status.matches("NO LEASE").count(), 1, "{status}");
}

struct Up {
    child: std::process::Child,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `camelot cluster <args>` and reads its stdout until a line starting with
/// `until` (60 s at most), returning the running process and the lines read so far.
fn start_up(args: &[&str], until: &str) -> (Up, Vec<String>) {
    let mut child = Command::new(bin())
        .arg("cluster")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let up = Up { child };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !lines.iter().any(|l: &String| l.starts_with(until)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(e) => panic!("cluster up printed {lines:?} then {e}"),
        }
    }
    (up, lines)
}

#[test]
fn cluster_up_starts_etcd_servers_and_the_map() {
    let (up, lines) = start_up(&["up", "--nodes", "3", "--partitions", "96"], "map epoch");
    let endpoint = lines[0]
        .split_whitespace()
        .find(|w| w.starts_with("http://127.0.0.1:"))
        .unwrap_or_else(|| panic!("no etcd endpoint in {lines:?}"))
        .to_owned();
    assert!(
        lines
            .iter()
            .any(|l| l == "map epoch 1: 96 partitions, replication 1"),
        "{lines:?}"
    );

    let run = |args: &[&str]| {
        let out = Command::new(bin()).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let status = run(&["cluster", "status", "--etcd", &endpoint]);
    assert!(
        status.starts_with("epoch 1: 96 partitions, replication 1, 3 node(s)"),
        "{status}"
    );
    assert_eq!(
        status.matches(": 32 primaries, 32 replicas, live").count(),
        3,
        "{status}"
    );
    let plan = run(&["cluster", "plan", "--etcd", &endpoint]);
    assert!(
        plan.contains("plan: 0 replica move(s) of 96 slots"),
        "{plan}"
    );

    // The cluster serves: a client routed by the map reads back what it wrote.
    let rt = rt();
    let etcd = rt
        .block_on(EtcdCluster::connect(
            std::slice::from_ref(&endpoint),
            PREFIX,
        ))
        .unwrap();
    let map = rt.block_on(etcd.read_map()).unwrap().unwrap().map;
    let addrs: Vec<_> = map.nodes.iter().map(|n| n.addr).collect();
    let client = cluster_client(&endpoint, &addrs);
    // Members keep the partition index a move's scans walk. (STATS at epoch 0, which a
    // server checks against no map: one may not have installed the map yet.)
    let raw = Client::connect(
        ClientMap {
            epoch: 0,
            nodes: map
                .nodes
                .iter()
                .map(|n| camelot_client::NodeInfo {
                    id: n.id,
                    addr: n.addr,
                })
                .collect(),
        },
        ClientConfig::default(),
    )
    .unwrap();
    for n in &map.nodes {
        let stats = raw.stats(n.id).unwrap();
        let indexed = stats.iter().find(|(k, _)| k == "partition_index");
        assert_eq!(indexed.map(|(_, v)| *v), Some(1), "node {}", n.id);
    }
    for i in 0..50 {
        client
            .put(format!("up{i}").as_bytes(), value("x", i))
            .unwrap();
    }
    for i in 0..50 {
        let got = client.get(format!("up{i}").as_bytes()).unwrap();
        assert_eq!(got.map(|v| v.value.to_vec()), Some(value("x", i)));
    }
    drop(up);
}

/// A server restarted while its old lease is still alive (SIGKILL, then at once a new
/// process with the same node id) is refused registration — and must be refused before
/// it installs any map: with the map first, it served its partitions as an empty primary
/// (reads of acknowledged writes answered "no such key") until the refusal came back.
#[test]
fn a_node_restarted_while_its_old_lease_lives_is_refused_before_it_serves_anything() {
    let mut c = support::start(1, "64M", &["--lease-ttl", "30"]);
    let live = c.rt.block_on(c.etcd.live_nodes()).unwrap();
    let map = ClusterMap::initial(live, 16, 1).unwrap();
    let probe = Client::connect(ClientMap::from_addrs(&c.addrs), ClientConfig::default()).unwrap();
    let epoch =
        c.rt.block_on(c.etcd.update_map(3, move |_| Ok(map.clone())))
            .unwrap()
            .map
            .epoch;
    support::wait_epoch(&probe, [0], epoch);
    let pid = c.servers[0].process_mut().pid().to_string();
    assert!(Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap()
        .success());
    let endpoint = c.endpoint.clone();
    let mut again = Command::new(bin())
        .args(["server", "--listen", "127.0.0.1:0", "--memory", "64M"])
        .args(["--etcd", &endpoint, "--node-id", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = again.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = again.kill();
            panic!("the restarted node neither registered nor gave up within 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = again.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!status.success(), "{text}");
    assert!(text.contains("already registered"), "{text}");
    assert!(
        !text.contains("cluster map"),
        "the refused node installed a map first: {text}"
    );
}

/// A server SIGKILLed, and brought back on its address under its node id once its lease
/// has expired, is a new process with empty memory. With R = 1 and no controller the map
/// keeps the dead process as the partitions' primary; the new one must serve none of
/// them until the map records it. Before, it installed the map by node id and answered
/// a read of an acknowledged write with "no such key".
#[test]
fn a_node_restarted_empty_under_its_id_serves_none_of_the_dead_one_s_partitions() {
    let (c, mut again, map) = restart_node_0_empty();
    let _reap = KillOnDrop(vec![again.id()]);
    let probe = Client::connect(ClientMap::from_addrs(&c.addrs), ClientConfig::default()).unwrap();
    support::wait_epoch(&probe, [0], map.epoch);
    // A fresh client (the old one's connection died with the process), and a few reads:
    // none may be answered.
    let fresh = cluster_client(&c.endpoint, &c.addrs);
    for attempt in 0..3 {
        let got = fresh.get(b"k");
        assert!(
            got.is_err(),
            "read {attempt}: the restarted, empty process served the dead one's partition: {:?}",
            got.map(|v| v.map(|v| v.value))
        );
    }
    let _ = again.kill();
    let _ = again.wait();
}

/// R = 1, node 0 acknowledged a write, was SIGKILLed and restarted empty under its id;
/// returns the cluster, the new process, and the map it was published with.
fn restart_node_0_empty() -> (support::EtcdServers, std::process::Child, ClusterMap) {
    let mut c = support::start(1, "64M", &["--lease-ttl", "1"]);
    let map = c.publish_initial(16, 1);
    let client = cluster_client(&c.endpoint, &c.addrs);
    support::wait_epoch(&client, [0], map.epoch);
    client.put(b"k", "v").unwrap();
    assert_eq!(
        client.get(b"k").unwrap().map(|v| v.value.to_vec()),
        Some(b"v".to_vec())
    );
    let old = c.rt.block_on(c.etcd.live_nodes()).unwrap()[0].clone();
    c.servers[0].process_mut().kill().expect("SIGKILL node 0");
    wait_for(
        "the killed server's lease expired",
        Duration::from_secs(10),
        || c.rt.block_on(c.etcd.live_nodes()).unwrap().is_empty(),
    );
    let addr = c.addrs[0].to_string();
    let again = Command::new(bin())
        .args(["server", "--listen", &addr, "--memory", "64M"])
        .args(["--etcd", &c.endpoint, "--node-id", "0", "--lease-ttl", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut live = Vec::new();
    wait_for(
        "the new process registered",
        Duration::from_secs(20),
        || {
            live = c.rt.block_on(c.etcd.live_nodes()).unwrap();
            !live.is_empty()
        },
    );
    assert_ne!(live[0].incarnation, old.incarnation, "{live:?}");
    (c, again, map)
}

/// With R = 1 nothing holds a restarted node's partitions: the controller leaves them
/// unserved, and before `cluster accept-loss` nothing could make them serve again.
/// Without --confirm it changes nothing; with it the new process serves them, empty,
/// at a new epoch, and takes writes.
#[test]
fn accepting_the_loss_lets_a_restarted_node_serve_its_partitions_empty() {
    let (c, mut again, map) = restart_node_0_empty();
    let _reap = KillOnDrop(vec![again.id()]);
    let accept = |confirm: bool| {
        let mut cmd = Command::new(bin());
        cmd.args([
            "cluster",
            "accept-loss",
            "--etcd",
            &c.endpoint,
            "--node",
            "0",
        ]);
        if confirm {
            cmd.arg("--confirm");
        }
        cmd.output().unwrap()
    };
    let succeeds = |confirm: bool| {
        let out = accept(confirm);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let said = succeeds(false);
    assert!(said.contains("16 partition(s) with no copy left"), "{said}");
    assert_eq!(c.map().epoch, map.epoch, "a dry run changed the map");
    let said = succeeds(true);
    assert!(said.contains("given up at epoch"), "{said}");
    let after = c.map();
    assert_eq!(after.epoch, map.epoch + 1);
    let fresh = cluster_client(&c.endpoint, &c.addrs);
    support::wait_epoch(&fresh, [0], after.epoch);
    assert_eq!(
        fresh.get(b"k").unwrap().map(|v| v.value.to_vec()),
        None,
        "the lost key is gone, not half there"
    );
    fresh.put(b"k", "again").unwrap();
    assert_eq!(
        fresh.get(b"k").unwrap().map(|v| v.value.to_vec()),
        Some(b"again".to_vec())
    );
    // A live node has nothing to give up.
    let out = accept(true);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("live process"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = again.kill();
    let _ = again.wait();
}

/// A server whose lease expires while it runs (etcd stalled, or it was cut off longer
/// than the TTL; here the lease is revoked) registers again under a new lease as the same
/// incarnation: the map's entry still names a live process, so no failover is due, and it
/// serves its data on. Before, it stayed unregistered for good, and a stall that expired
/// both replicas' leases left their partitions unserved (chaos kv seeds 403 and 408).
#[test]
fn a_server_whose_lease_expired_registers_again_as_the_same_process() {
    let c = support::start(1, "64M", &[]);
    let map = c.publish_initial(16, 1);
    let client = cluster_client(&c.endpoint, &c.addrs);
    support::wait_epoch(&client, [0], map.epoch);
    client.put(b"k", "v").unwrap();
    let old = c.rt.block_on(c.etcd.live_nodes()).unwrap()[0].clone();
    assert_ne!(
        old.incarnation, 0,
        "a server registers with its incarnation"
    );
    c.rt.block_on(c.etcd.revoke_lease(old.lease)).unwrap();
    let mut live = Vec::new();
    wait_for("node 0 registered again", Duration::from_secs(10), || {
        live = c.rt.block_on(c.etcd.live_nodes()).unwrap();
        live.first().is_some_and(|n| n.lease != old.lease)
    });
    assert_eq!(live[0].incarnation, old.incarnation, "{live:?}");
    assert!(
        camelot_cluster::failover::Alive::new(live).holds(map.node(0).unwrap()),
        "the map's entry no longer names the process"
    );
    let got = client.get(b"k").unwrap().map(|v| v.value.to_vec());
    assert_eq!(got.as_deref(), Some(&b"v"[..]));
}

/// The same after SIGSTOP past the lease's TTL, then SIGCONT (a pause, as chaos makes
/// one): the server learns its lease is gone and registers again as the same process.
#[test]
fn a_server_paused_past_its_lease_registers_again_when_it_resumes() {
    let mut c = support::start(1, "64M", &["--lease-ttl", "1"]);
    let map = c.publish_initial(16, 1);
    let old = c.rt.block_on(c.etcd.live_nodes()).unwrap()[0].clone();
    let pid = c.servers[0].process_mut().pid().to_string();
    let signal = |sig: &str| {
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP");
    wait_for(
        "the paused server's lease expired",
        Duration::from_secs(10),
        || c.rt.block_on(c.etcd.live_nodes()).unwrap().is_empty(),
    );
    signal("-CONT");
    let mut live = Vec::new();
    wait_for("node 0 registered again", Duration::from_secs(10), || {
        live = c.rt.block_on(c.etcd.live_nodes()).unwrap();
        !live.is_empty()
    });
    assert_eq!(live[0].incarnation, old.incarnation, "{live:?}");
    assert_ne!(live[0].lease, old.lease, "{live:?}");
    assert!(camelot_cluster::failover::Alive::new(live).holds(map.node(0).unwrap()));
}

/// Whether process `pid` has ended (gone, or a zombie nobody has reaped yet).
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

/// SIGKILLs what a failed run left behind.
struct KillOnDrop(Vec<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

/// `cluster up` SIGKILLed runs no destructor: its etcd, servers and controller must still
/// go with it (the kernel's parent-death signal), not run on with nobody to stop them.
#[test]
fn cluster_up_sigkilled_takes_etcd_its_servers_and_its_controllers_with_it() {
    let (up, lines) = start_up(
        &[
            "up",
            "--nodes",
            "2",
            "--partitions",
            "16",
            "--controllers",
            "1",
        ],
        "Ctrl-C to stop",
    );
    // "…(prefix P, pid N)", "  node I: ADDR pid N (…", "  controller I: pid N".
    let pids: Vec<u32> = lines
        .iter()
        .filter_map(|l| {
            let (_, after) = l.split_once("pid ")?;
            after
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(pids.len(), 4, "etcd, two servers, a controller: {lines:?}");
    let leftovers = KillOnDrop(pids.clone());
    assert!(
        pids.iter().all(|p| !ended(*p)),
        "all running before the kill"
    );

    let mut up = up;
    let up_pid = up.child.id();
    let owned_by_up = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.starts_with("camelot-peer-") && n.contains(&format!("-{up_pid}-"))
                })
            })
            .collect()
    };
    // Its scratch directories: etcd's data, the servers' working directories.
    let owned = owned_by_up();
    assert_eq!(owned.len(), 3, "etcd's and two servers': {owned:?}");
    up.child.kill().unwrap();
    up.child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running: Vec<u32> = pids.iter().copied().filter(|p| !ended(*p)).collect();
        if running.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still running 10 s after `cluster up` was SIGKILLed: {running:?} of {lines:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(leftovers);

    // They outlive it; the next sweep, which every camelot process makes once (and
    // which another test's process may make first), removes them.
    camelot_testkit::process::remove_orphaned_scratch_dirs();
    let still = owned_by_up();
    assert!(still.is_empty(), "not swept: {still:?}");
}
