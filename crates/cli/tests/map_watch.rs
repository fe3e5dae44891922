//! Clients that watch the map in etcd (`camelot_cluster::follow::watch_for_client`), with
//! real etcd, real `camelot server`s and the real `camelot cluster move`: after a move the
//! watching client already routes by the new epoch when it next sends, so no request of
//! it is answered MOVED or STALE_EPOCH. The checker (the client's redirect count) is shown
//! able to fail: the same run without the watch is redirected.
#![cfg(feature = "etcd")]

use std::process::Command;
use std::time::Duration;

use camelot_client::{Client, ClientConfig, ClusterMap as ClientMap};
use camelot_cluster::follow::{watch_for_client, EtcdMapSource};

mod support;
use support::{bin, wait_for, PREFIX};

const PARTITIONS: u32 = 64;
const KEYS: usize = 200;

/// Writes [`KEYS`] keys, moves every partition of node 0 to node 1 with `camelot cluster
/// move`, waits (when watching) for the client to show the new epoch without sending
/// anything, then reads every key back. Returns (the client's epoch before its first
/// request after the move, the map's epoch, redirects during the reads).
fn move_then_read(watch: bool) -> (u64, u64, u64) {
    let c = support::start(2, "64M", &[]);
    let before = c.publish_initial(PARTITIONS, 1);
    let client = Client::connect(ClientMap::from_addrs(&c.addrs), ClientConfig::default()).unwrap();
    client
        .set_map_source(EtcdMapSource::connect(std::slice::from_ref(&c.endpoint), PREFIX).unwrap());
    assert!(client.refresh_map().unwrap());
    let _watch = watch.then(|| {
        watch_for_client(client.clone(), std::slice::from_ref(&c.endpoint), PREFIX).unwrap()
    });
    for i in 0..KEYS {
        client
            .put(format!("k{i}").as_bytes(), format!("v{i}"))
            .unwrap();
    }
    assert_eq!(client.epoch(), before.epoch);
    let on_node_0: Vec<String> = (0..PARTITIONS)
        .filter(|&p| before.primary(p) == Some(0))
        .map(|p| p.to_string())
        .collect();
    let out = Command::new(bin())
        .args(["cluster", "move"])
        .args(&on_node_0)
        .args(["--to", "1", "--etcd", &c.endpoint])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cluster move: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let after = c.rt.block_on(c.etcd.read_map()).unwrap().unwrap().map;
    assert!(after.epoch > before.epoch);
    assert!((0..PARTITIONS).all(|p| after.primary(p) == Some(1)));
    if watch {
        wait_for(
            "the client learns the new epoch",
            Duration::from_secs(10),
            || client.epoch() == after.epoch,
        );
    }
    let learned = client.epoch();
    let redirects = client.redirects();
    for i in 0..KEYS {
        let got = client.get(format!("k{i}").as_bytes()).unwrap();
        assert_eq!(
            got.map(|v| v.value.to_vec()),
            Some(format!("v{i}").into_bytes()),
            "k{i}"
        );
    }
    (learned, after.epoch, client.redirects() - redirects)
}

#[test]
fn a_watching_client_learns_a_new_epoch_without_a_redirected_request() {
    let (learned, epoch, redirects) = move_then_read(true);
    assert_eq!(learned, epoch);
    assert_eq!(redirects, 0, "a watching client was redirected");
}

/// The checker can fail: without the watch the client still has the old epoch when it
/// next sends, and its requests for the moved partitions are redirected.
#[test]
fn without_the_watch_the_same_client_is_redirected() {
    let (learned, epoch, redirects) = move_then_read(false);
    assert!(learned < epoch);
    assert!(redirects > 0, "no redirect seen: the checker is blind");
}
