//! The etcd source against a real `etcd` (Debian's etcd-server), started on free loopback
//! ports with a private data directory by camelot-testkit.
#![cfg(feature = "etcd")]

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use camelot_cluster::etcd::{EtcdCluster, EtcdError, Publish, LEASE_TTL_DEFAULT};
use camelot_cluster::{ClusterMap, Node};
use camelot_testkit::EtcdServer;

const CHILD_ENV: &str = "CAMELOT_CLUSTER_MEMBER_CHILD";

fn node(id: u32) -> Node {
    Node {
        id,
        addr: SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16)),
        weight: 1,
        lease: 0,
        incarnation: 0,
    }
}

async fn cluster(etcd: &EtcdServer, prefix: &str) -> EtcdCluster {
    EtcdCluster::connect(&[etcd.endpoint()], prefix)
        .await
        .unwrap()
}

/// Polls `cond` every 50 ms until it holds or `limit` passes; the time it took.
async fn wait_until<F, Fut>(limit: Duration, mut cond: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_exactly_one_wins() {
    let etcd = EtcdServer::start().unwrap();
    let a = cluster(&etcd, "/race").await;
    let b = cluster(&etcd, "/race").await;
    let first = ClusterMap::initial((0..3).map(node).collect(), 64, 1).unwrap();
    assert_eq!(a.publish(&first, None).await.unwrap(), Publish::Won(2));
    // Creating again from "nothing there" loses: the key exists.
    assert_eq!(a.publish(&first, None).await.unwrap(), Publish::Lost);

    for round in 0..20u32 {
        let seen_a = a.read_map().await.unwrap().unwrap();
        let seen_b = b.read_map().await.unwrap().unwrap();
        assert_eq!(seen_a, seen_b);
        let mut next_a = seen_a.map.clone();
        next_a.epoch += 1;
        next_a.nodes[0].weight = 100 + round;
        let mut next_b = seen_b.map.clone();
        next_b.epoch += 1;
        next_b.nodes[1].weight = 200 + round;
        let (ra, rb) = tokio::join!(
            a.publish(&next_a, Some(&seen_a)),
            b.publish(&next_b, Some(&seen_b))
        );
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        let winner = match (&ra, &rb) {
            (Publish::Won(_), Publish::Lost) => &next_a,
            (Publish::Lost, Publish::Won(_)) => &next_b,
            other => panic!("round {round}: {other:?}: not exactly one winner"),
        };
        assert_eq!(&a.read_map().await.unwrap().unwrap().map, winner);
    }

    // Read-change-write from 6 tasks at once: every change lands (none lost to a race).
    let mut tasks = Vec::new();
    for i in 0..6u32 {
        let c = cluster(&etcd, "/race").await;
        tasks.push(tokio::spawn(async move {
            c.update_map(50, |cur| {
                let mut m = cur.cloned().unwrap();
                m.nodes[2].weight += 1;
                let _ = i;
                Ok(m)
            })
            .await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let end = a.read_map().await.unwrap().unwrap().map;
    assert_eq!(end.nodes[2].weight, 1 + 6);
    assert_eq!(end.epoch, 1 + 20 + 6);

    // An epoch that does not advance is refused before anything is sent.
    let cur = a.read_map().await.unwrap().unwrap();
    assert!(matches!(
        a.publish(&cur.map, Some(&cur)).await,
        Err(EtcdError::EpochNotAdvanced { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_sees_each_new_epoch() {
    let etcd = EtcdServer::start().unwrap();
    let writer = cluster(&etcd, "/watch").await;
    let reader = cluster(&etcd, "/watch").await;
    let first = writer
        .update_map(3, |_| {
            Ok(ClusterMap::initial((0..2).map(node).collect(), 32, 1).unwrap())
        })
        .await
        .unwrap();
    assert_eq!(first.map.epoch, 1);
    let current = reader.read_map().await.unwrap().unwrap();
    let mut watch = reader.watch_map(Some(&current)).await.unwrap();
    for expected in 2..=4u64 {
        writer
            .update_map(3, |cur| {
                let mut m = cur.cloned().unwrap();
                m.nodes.push(node(expected as u32 + 10));
                Ok(m)
            })
            .await
            .unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("the watcher saw nothing within 5 s")
            .unwrap();
        assert_eq!(seen.map.epoch, expected);
        assert_eq!(seen.map.nodes.len(), 2 + expected as usize - 1);
    }
    // A garbage map is an error for the watcher, not silently skipped.
    let mut kv = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    kv.put(writer.map_key(), "not a map", None).await.unwrap();
    let bad = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .unwrap();
    assert!(matches!(bad, Err(EtcdError::Map(_))), "{bad:?}");
}

/// A watch that starts in the past gets the maps written since in one response; each
/// must be yielded. Dropping all but the first left a node restarted mid-failover at the
/// first of two epochs for good (chaos kv, seed 7: "node 2 did not reach epoch 4").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_started_in_the_past_yields_every_map_written_since() {
    let etcd = EtcdServer::start().unwrap();
    let writer = cluster(&etcd, "/replay").await;
    let reader = cluster(&etcd, "/replay").await;
    writer
        .update_map(3, |_| {
            Ok(ClusterMap::initial((0..2).map(node).collect(), 32, 1).unwrap())
        })
        .await
        .unwrap();
    let first = reader.read_map().await.unwrap().unwrap();
    for extra in 0..3u32 {
        writer
            .update_map(3, |cur| {
                let mut m = cur.cloned().unwrap();
                m.nodes.push(node(20 + extra));
                Ok(m)
            })
            .await
            .unwrap();
    }
    let mut watch = reader.watch_map(Some(&first)).await.unwrap();
    for expected in 2..=4u64 {
        let seen = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .unwrap_or_else(|_| panic!("epoch {expected} was not yielded within 5 s"))
            .unwrap();
        assert_eq!(seen.map.epoch, expected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_hold_while_renewed_and_ids_are_exclusive() {
    let etcd = EtcdServer::start().unwrap();
    let c = cluster(&etcd, "/reg").await;
    let reg = c.register(&node(1), LEASE_TTL_DEFAULT).await.unwrap();
    assert!(matches!(
        c.register(&node(1), LEASE_TTL_DEFAULT).await,
        Err(EtcdError::NodeTaken(1))
    ));
    // Renewed: still there after twice the TTL.
    tokio::time::sleep(LEASE_TTL_DEFAULT * 2 + Duration::from_millis(500)).await;
    assert!(reg.is_alive());
    assert_eq!(live_without_leases(&c).await, vec![node(1)]);
    reg.revoke().await.unwrap();
    assert!(c.live_nodes().await.unwrap().is_empty());
    // Dropped without revoking: gone one TTL later, as a crashed node would be.
    let reg = c.register(&node(2), LEASE_TTL_DEFAULT).await.unwrap();
    drop(reg);
    let gone = wait_until(Duration::from_secs(10), || async {
        c.live_nodes().await.unwrap().is_empty()
    })
    .await;
    assert!(gone.is_some(), "an unrenewed lease outlived 10 s");
    assert!(matches!(
        c.register(&node(3), Duration::from_millis(1500)).await,
        Err(EtcdError::BadTtl(_))
    ));
}

/// The live registrations with their leases set aside: each carries the lease it was
/// registered under (the controller tells a restarted node by it), which must be set.
async fn live_without_leases(c: &EtcdCluster) -> Vec<Node> {
    let mut nodes = c.live_nodes().await.unwrap();
    for n in &mut nodes {
        assert_ne!(n.lease, 0, "a registration without its lease: {n:?}");
        n.lease = 0;
    }
    nodes
}

/// The child side of the kill test: registers node 7 and waits to be killed.
#[tokio::test]
async fn member_child() {
    let Ok(endpoint) = std::env::var(CHILD_ENV) else {
        return;
    };
    let c = EtcdCluster::connect(&[endpoint], "/kill").await.unwrap();
    let _reg = c.register(&node(7), LEASE_TTL_DEFAULT).await.unwrap();
    println!("REGISTERED");
    // Bounded: the parent kills us long before this.
    tokio::time::sleep(Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_member_disappears_after_its_lease_ttl() {
    let etcd = EtcdServer::start().unwrap();
    let c = cluster(&etcd, "/kill").await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["member_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, etcd.endpoint())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let up = wait_until(Duration::from_secs(20), || async {
        live_without_leases(&c).await == vec![node(7)]
    })
    .await;
    assert!(up.is_some(), "the child never registered");
    // Alive and renewing: present across twice the TTL.
    let held_until = Instant::now() + LEASE_TTL_DEFAULT * 2 + Duration::from_millis(500);
    while Instant::now() < held_until {
        assert_eq!(live_without_leases(&c).await, vec![node(7)]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    child.kill().unwrap(); // SIGKILL: no revoke, no goodbye.
    child.wait().unwrap();
    let gone = wait_until(Duration::from_secs(10), || async {
        c.live_nodes().await.unwrap().is_empty()
    })
    .await
    .expect("the killed member was still registered 10 s later");
    // Its last renewal was at most a third of the TTL before the kill, and etcd checks
    // expiry every ~0.5 s: gone after about the TTL, neither at once nor much later.
    assert!(
        gone >= Duration::from_millis(500),
        "gone after {gone:?}: too soon for a lease"
    );
    assert!(
        gone <= LEASE_TTL_DEFAULT + Duration::from_millis(1500),
        "gone only after {gone:?}"
    );
    eprintln!("killed member gone after {gone:?} (TTL {LEASE_TTL_DEFAULT:?})");
}

/// What etcd holds is not trusted: a registration that cannot be read is left out of the
/// live nodes (the others are still there, so failover goes on), and a move record whose
/// partitions are out of order is refused (movers binary-search them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_registrations_and_move_records_are_not_taken() {
    let etcd = EtcdServer::start().unwrap();
    let c = cluster(&etcd, "/bad-entries").await;
    let _reg = c.register(&node(1), LEASE_TTL_DEFAULT).await.unwrap();
    let mut kv = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    kv.put(format!("{}7", c.nodes_prefix()), "not a node", None)
        .await
        .unwrap();
    let live = c.live_nodes().await.expect("the readable registrations");
    assert_eq!(live.iter().map(|n| n.id).collect::<Vec<_>>(), vec![1]);

    let unsorted = r#"{"partitions":[5,3],"from":0,"to":1,"phase":"copying"}"#;
    kv.put(c.move_key(), unsorted, None).await.unwrap();
    let read = c.read_move().await;
    assert!(
        matches!(&read, Err(EtcdError::BadMove(why)) if why.contains("out of order")),
        "{read:?}"
    );
}
