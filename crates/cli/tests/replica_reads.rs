//! Reads from any replica ("may be stale", `Client::get_any_replica`) on real etcd and
//! real `camelot server`s with R = 2: backups answer GETs for partitions they fully back
//! up, labelled may-be-stale, with every acknowledged write; a server that is not a
//! replica of the partition still answers MOVED, so the option cannot read from a node
//! that holds nothing of it.
#![cfg(feature = "etcd")]

use camelot_client::proto::{ErrorCode, Op};
use camelot_client::{Client, ClientConfig, ClusterMap as ClientMap};
use camelot_cluster::follow::EtcdMapSource;
use camelot_cluster::ClusterMap;

mod support;
use support::PREFIX;

const PARTITIONS: u32 = 64;
const KEYS: usize = 300;

fn cluster(n: u32) -> (support::EtcdServers, ClusterMap, Client) {
    let c = support::start(n, "64M", &[]);
    let map = c.publish_initial(PARTITIONS, 2);
    let client = Client::connect(ClientMap::from_addrs(&c.addrs), ClientConfig::default()).unwrap();
    client
        .set_map_source(EtcdMapSource::connect(std::slice::from_ref(&c.endpoint), PREFIX).unwrap());
    assert!(client.refresh_map().unwrap());
    // Every server on the map's epoch before the reads: one still at the old epoch answers
    // STALE_EPOCH where the test means to see MOVED.
    support::wait_epoch(&client, 0..n, map.epoch);
    (c, map, client)
}

#[test]
fn backups_answer_replica_reads_labelled_may_be_stale_with_every_acknowledged_write() {
    let (_c, map, client) = cluster(2);
    for i in 0..KEYS {
        client
            .put(format!("k{i}").as_bytes(), format!("v{i}"))
            .unwrap();
    }
    let (mut from_backup, mut from_primary) = (0, 0);
    for round in 0..2 {
        for i in 0..KEYS {
            let key = format!("k{i}");
            let r = client.get_any_replica(key.as_bytes()).unwrap();
            assert_eq!(
                r.value.map(|v| v.value.to_vec()),
                Some(format!("v{i}").into_bytes()),
                "{key} (round {round}) from node {}",
                r.node
            );
            let p = camelot_client::proto::partition_of(key.as_bytes(), PARTITIONS);
            if r.may_be_stale {
                assert_eq!(map.assignment[p as usize].get(1), Some(&r.node), "{key}");
                from_backup += 1;
            } else {
                assert_eq!(map.primary(p), Some(r.node), "{key}");
                from_primary += 1;
            }
        }
    }
    println!("{from_backup} reads from backups, {from_primary} from primaries");
    // Taken in turn: about half each; at least a third each whatever the interleaving.
    assert!(from_backup >= 2 * KEYS / 3, "{from_backup} from backups");
    assert!(
        from_primary >= 2 * KEYS / 3,
        "{from_primary} from primaries"
    );
    assert_eq!(client.redirects(), 0, "a replica read was refused");
}

/// The server side's limit, shown directly: a routed GET to a node that is neither
/// primary nor backup of the key's partition is MOVED (with R = 2 of 3 nodes, each
/// partition has one such node), while the same GET to its backup is answered.
#[test]
fn a_node_outside_the_replica_set_refuses_the_read() {
    let (_c, map, client) = cluster(3);
    let mut checked = 0;
    for i in 0..KEYS {
        let key = format!("k{i}");
        client.put(key.as_bytes(), format!("v{i}")).unwrap();
        let p = camelot_client::proto::partition_of(key.as_bytes(), PARTITIONS) as usize;
        let set = &map.assignment[p];
        let outsider = (0..3).find(|n| !set.contains(n)).unwrap();
        let get = || Op::Get {
            key: key.clone().into_bytes().into(),
        };
        let refused = client.submit(outsider, get()).unwrap().wait();
        let code = refused.err().and_then(|e| e.code());
        assert_eq!(code, Some(ErrorCode::Moved), "{key} at node {outsider}");
        let served = client.submit(set[1], get()).unwrap().wait();
        assert!(served.is_ok(), "{key} at its backup {}: {served:?}", set[1]);
        checked += 1;
    }
    assert_eq!(checked, KEYS);
}

/// A backup SIGKILLed (and the map not yet changed: no controller runs here): replica
/// reads that pick it fall back to the primary, so every read still answers, right and
/// labelled fresh.
#[test]
fn replica_reads_survive_a_sigkilled_backup_by_reading_the_primary() {
    let (mut c, map, client) = cluster(2);
    for i in 0..KEYS {
        client
            .put(format!("k{i}").as_bytes(), format!("v{i}"))
            .unwrap();
    }
    c.servers[1].process_mut().kill().unwrap();
    let mut fell_back = 0;
    for i in 0..KEYS {
        let key = format!("k{i}");
        let p = camelot_client::proto::partition_of(key.as_bytes(), PARTITIONS) as usize;
        if map.assignment[p][0] != 0 {
            continue; // its primary is the dead node: nothing to read it from
        }
        let r = client.get_any_replica(key.as_bytes()).unwrap();
        assert_eq!(
            r.value.map(|v| v.value.to_vec()),
            Some(format!("v{i}").into_bytes()),
            "{key}"
        );
        assert!(!r.may_be_stale, "{key}: the dead backup answered?");
        assert_eq!(r.node, 0);
        fell_back += 1;
    }
    assert!(fell_back > KEYS / 4, "{fell_back} keys read");
}
