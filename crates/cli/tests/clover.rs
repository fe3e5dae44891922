//! Clover over real `camelot server` processes: 32 concurrent clients on a few keys, with
//! collection running and memory small enough that nodes are reused, every operation
//! recorded and the history checked for linearizability.

use camelot_check::{check, Limits, Recorder, Verdict};
use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_clover::{Geometry, Meta, MetaConfig, RegionMemory, Store, StoreConfig};
use camelot_testkit::CamelotServer;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLIENTS: u32 = 32;
const OPS_PER_CLIENT: u32 = 120;
const DEADLINE: Duration = Duration::from_secs(120);

#[path = "support/clover.rs"]
mod workload;
use workload::{memory_server as server, Ops};

fn connect(addrs: &[SocketAddr]) -> Client {
    let config = ClientConfig {
        connections_per_node: 2,
        ..ClientConfig::default()
    };
    Client::connect(ClusterMap::from_addrs(addrs), config).expect("connect")
}

#[test]
fn concurrent_clients_on_real_servers_are_linearizable() {
    let servers = [server(None), server(None)];
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    // 8-byte values, 64 nodes a block, 12 blocks: 768 nodes for ~1,700 writes, so
    // collection must reclaim and stores must meet reused nodes.
    let geometry = Geometry::new(8, 64).unwrap();
    let mem = RegionMemory::new(connect(&addrs), geometry);
    let config = MetaConfig {
        blocks_max: 12,
        versions_kept: 2,
        ..MetaConfig::default()
    };
    let meta = Arc::new(Meta::new(mem.clone(), config).unwrap());
    let recorder: Arc<Recorder<u64>> = Arc::new(Recorder::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();

    let collector = {
        let (meta, stop) = (meta.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut passes = 0u64;
            while !stop.load(Ordering::Relaxed) && started.elapsed() < DEADLINE {
                meta.gc().expect("collection pass");
                passes += 1;
                // Pacing only: passes as fast as possible would hold the metadata lock
                // most of the time.
                std::thread::sleep(Duration::from_millis(2));
            }
            passes
        })
    };

    // Four client connections sets, eight threads on each.
    let clients: Vec<Client> = (0..4).map(|_| connect(&addrs)).collect();
    let workers: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let mem = mem.with_client(clients[c as usize % clients.len()].clone());
            let (meta, recorder) = (meta.clone(), recorder.clone());
            std::thread::spawn(move || {
                let mut store = Store::new(
                    meta,
                    mem,
                    // Small grants: 32 stores × 16 nodes would be the whole store.
                    StoreConfig {
                        grant_nodes: 4,
                        ..StoreConfig::default()
                    },
                );
                let mut ops = Ops::new(0x9E37_79B9_7F4A_7C15, c);
                let mut errors = 0u32;
                for i in 0..OPS_PER_CLIENT {
                    if started.elapsed() > DEADLINE {
                        break;
                    }
                    let (key, op) = ops.next(i);
                    let invoke = recorder.now();
                    let result = ops.apply(&mut store, key, op);
                    let outcome = match result {
                        Ok(o) => Some(o),
                        Err(e) => {
                            eprintln!("client {c}: {e}");
                            errors += 1;
                            None
                        }
                    };
                    recorder.finish(c, key, op, invoke, outcome).unwrap();
                }
                (errors, store.stats())
            })
        })
        .collect();
    let mut errors = 0;
    let mut cas_failures = 0;
    let mut restarts = 0;
    for w in workers {
        let (e, stats) = w.join().expect("worker");
        errors += e;
        cas_failures += stats.cas_failures;
        restarts += stats.restarts;
    }
    stop.store(true, Ordering::Relaxed);
    let passes = collector.join().expect("collector");
    let stats = meta.stats();
    eprintln!(
        "passes {passes}, meta {stats:?}, lost CASes {cas_failures}, restarts {restarts}, {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() < DEADLINE, "the load ran out of time");
    assert_eq!(errors, 0, "operations failed");
    assert!(stats.nodes_reclaimed > 0, "nothing was reused: {stats:?}");
    assert!(cas_failures > 0, "no writer ever raced another");

    let recorder = Arc::try_unwrap(recorder).expect("every worker is done");
    let history = recorder.into_history();
    assert_eq!(history.len(), (CLIENTS * OPS_PER_CLIENT) as usize);
    let report = check(&history, &Limits::default());
    match report.verdict {
        Verdict::Linearizable => {}
        other => panic!("{other:?} after {} states", report.states_explored),
    }
}
