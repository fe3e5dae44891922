//! `camelot proxy` as a real process in front of real `camelot server` processes: it
//! authenticates before it allocates, passes region operations through, and Clover's
//! histories through it — connection mapping and CAS→WRITE on, and with the proxies
//! SIGKILLed mid-run while clients fall back to the servers — are linearizable.

use bytes::Bytes;
use camelot_check::{check, Limits, Recorder, Verdict};
use camelot_client::{Client, ClientConfig, ClientError, ClusterMap};
use camelot_clover::{Geometry, Meta, MetaConfig, RegionMemory, Store, StoreConfig};
use camelot_testkit::process::{Program, Readiness, ServerProcess};
use camelot_testkit::CamelotServer;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");
const TOKEN: &str = "proxy-test-token";
const CLIENTS: u32 = 32;
const OPS_PER_CLIENT: u32 = 100;
const DEADLINE: Duration = Duration::from_secs(120);

#[path = "support/clover.rs"]
mod workload;
use workload::Ops;

fn server() -> CamelotServer {
    workload::memory_server(Some(TOKEN))
}

fn proxy(upstream: SocketAddr, flags: &[&str]) -> ServerProcess {
    workload::proxy_process(upstream, TOKEN, flags)
}

fn config(token: &str) -> ClientConfig {
    ClientConfig {
        token: Some(token.as_bytes().to_vec()),
        connections_per_node: 1,
        // Generous: the test machine is shared, and a timeout would be an unknown outcome.
        request_timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    }
}

fn stat(client: &Client, name: &str) -> u64 {
    client
        .stats(0)
        .expect("proxy stats")
        .into_iter()
        .find(|(n, _)| n == name)
        .map_or_else(|| panic!("no stat {name}"), |(_, v)| v)
}

#[test]
fn the_proxy_authenticates_before_it_allocates() {
    let s = server();
    let p = proxy(s.addr(), &["--conn-map", "1"]);
    let map = ClusterMap::from_addrs(&[p.addr()]);
    let refused = Client::connect(map.clone(), config("wrong")).and_then(|c| c.ping(0));
    assert!(
        matches!(refused, Err(ClientError::Auth { .. })),
        "{:?}",
        refused.err()
    );
    // A first frame claiming 64 MiB is not a HELLO: the connection is closed without
    // the proxy waiting for (or reserving) that much.
    let mut raw = TcpStream::connect(p.addr()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    raw.write_all(&(64u32 << 20).to_le_bytes()).unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        raw.read(&mut byte).unwrap_or(0),
        0,
        "the proxy kept the connection"
    );
    let client = Client::connect(map, config(TOKEN)).unwrap();
    client.ping(0).unwrap();
    assert_eq!(stat(&client, "proxy_refused_auth"), 1);
}

/// More sockets than the proxy takes connections, each sending nothing: a client that
/// comes after them still gets in (it takes the oldest silent one's place), long before
/// they would time out.
#[test]
fn sockets_that_never_say_hello_do_not_lock_clients_out() {
    let s = server();
    let p = proxy(s.addr(), &["--conn-map", "1"]);
    let silent: Vec<TcpStream> = (0..camelot_proxy::CONNECTIONS_MAX + 16)
        .map(|_| TcpStream::connect(p.addr()).expect("connect"))
        .collect();
    let started = Instant::now();
    let client = Client::connect(
        ClusterMap::from_addrs(&[p.addr()]),
        ClientConfig {
            // Well inside the proxy's 10 s handshake timeout: the silent sockets must not
            // be what lets this client in.
            request_timeout: Duration::from_secs(3),
            ..config(TOKEN)
        },
    )
    .and_then(|c| c.ping(0).map(|_| c))
    .unwrap_or_else(|e| panic!("a client behind {} silent sockets: {e}", silent.len()));
    assert!(started.elapsed() < camelot_proxy::HANDSHAKE_TIMEOUT);
    let evicted = stat(&client, "proxy_evicted_unauthenticated");
    assert!(
        evicted >= (silent.len() - camelot_proxy::UNAUTHENTICATED_CONNECTIONS_MAX) as u64,
        "{evicted} evicted"
    );
}

#[test]
fn region_operations_pass_through_and_cas_becomes_write() {
    let s = server();
    for flags in [
        &[][..],
        &["--conn-map", "2"],
        &["--conn-map", "2", "--cas-to-write"],
        &["--conn-map", "2", "--read-cache"],
        &["--conn-map", "2", "--cas-to-write", "--read-cache"],
    ] {
        let p = proxy(s.addr(), flags);
        let client = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
        let r = client
            .alloc_with(4096, None, camelot_client::AccessMode::Shared)
            .unwrap();
        client
            .write(&r, 0, Bytes::copy_from_slice(&7u64.to_le_bytes()))
            .unwrap();
        assert_eq!(client.cas(&r, 0, 7, 8).unwrap(), 7, "{flags:?}");
        assert_eq!(client.cas(&r, 0, 7, 9).unwrap(), 8, "{flags:?}");
        assert_eq!(&client.read(&r, 0, 8).unwrap()[..], &8u64.to_le_bytes()[..]);
        assert_eq!(client.fetch_add(&r, 0, 1).unwrap(), 8);
        assert_eq!(client.cas(&r, 0, 9, 10).unwrap(), 9, "{flags:?}");
        let direct = Client::connect(ClusterMap::from_addrs(&[s.addr()]), config(TOKEN)).unwrap();
        // Node 0 in both maps: the region as the server holds it.
        assert_eq!(
            &direct.read(&r, 0, 8).unwrap()[..],
            &10u64.to_le_bytes()[..]
        );
        let converted = stat(&client, "proxy_cas_converted");
        let local = stat(&client, "proxy_cas_failed_locally");
        if flags.contains(&"--cas-to-write") {
            // 7→8 after the write taught it the word; 7→9 failed on what it knew; after
            // FETCH_ADD it had to ask (9→10 forwarded).
            assert_eq!((converted, local), (1, 1), "{flags:?}");
        } else {
            assert_eq!((converted, local), (0, 0), "{flags:?}");
        }
        let hits = stat(&client, "proxy_read_hits");
        if flags.contains(&"--read-cache") {
            // Read twice more: the first may fill, the second is a hit.
            assert_eq!(
                &client.read(&r, 0, 8).unwrap()[..],
                &10u64.to_le_bytes()[..]
            );
            assert_eq!(
                &client.read(&r, 0, 8).unwrap()[..],
                &10u64.to_le_bytes()[..]
            );
            assert!(stat(&client, "proxy_read_hits") > hits, "{flags:?}");
        } else {
            assert_eq!(hits, 0, "{flags:?}");
        }
        client.free(&r).unwrap();
    }
}

/// A WRITE the server refuses (here past the region's end) changed nothing there, so it
/// may teach the proxy nothing: a CAS from the value it carried must fail as the server
/// would fail it, and a READ must see the bytes the server holds. On the code before,
/// the proxy taught the WRITE's words when it decided it and forgot them only when the
/// refusal came back, so the CAS behind it in the same frame was made a WRITE and
/// answered as won.
#[test]
fn a_write_the_server_refuses_teaches_the_proxy_nothing() {
    use camelot_client::proto::{Op, Reply};
    let s = server();
    let p = proxy(
        s.addr(),
        &["--conn-map", "1", "--cas-to-write", "--read-cache"],
    );
    let client = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
    let r = client
        .alloc_with(64, None, camelot_client::AccessMode::Shared)
        .unwrap();
    // The server may round a region up: the last word is the size it answers.
    let last = r.size - 8;
    let carried = 0x1111_u64;
    let mut past_the_end = carried.to_le_bytes().to_vec();
    past_the_end.extend_from_slice(&[0xEE; 8]);
    let answers = client
        .submit_many([
            (0, r.write_op(last, Bytes::from(past_the_end))),
            (0, r.cas_op(last, carried, 0x2222)),
            (
                0,
                Op::Read {
                    region: r.id,
                    offset: last,
                    len: 8,
                },
            ),
        ])
        .unwrap();
    let mut answers = answers.into_iter().map(|p| p.wait());
    let refused = answers.next().unwrap();
    assert!(
        matches!(&refused, Err(e) if e.code() == Some(camelot_client::proto::ErrorCode::OutOfBounds)),
        "{refused:?}"
    );
    match answers.next().unwrap() {
        Ok(Reply::Word(w)) => assert_eq!(w, 0, "the CAS must fail on the word the server holds"),
        other => panic!("CAS: {other:?}"),
    }
    match answers.next().unwrap() {
        Ok(Reply::Data(d)) => assert_eq!(&d[..], &[0u8; 8], "READ"),
        other => panic!("READ: {other:?}"),
    }
    let direct = Client::connect(ClusterMap::from_addrs(&[s.addr()]), config(TOKEN)).unwrap();
    assert_eq!(&direct.read(&r, last, 8).unwrap()[..], &[0u8; 8]);
    // A WRITE inside the region (its size known from the ALLOC) still teaches.
    client
        .write(&r, 0, Bytes::copy_from_slice(&7u64.to_le_bytes()))
        .unwrap();
    assert_eq!(client.cas(&r, 0, 7, 8).unwrap(), 7);
    assert_eq!(stat(&client, "proxy_cas_converted"), 1);
}

/// A CAS made a WRITE links its node only once the server has the WRITE: a READ decided
/// before that (here, in the same frame, behind an 8 MiB WRITE on the lane) is not sent
/// to the new node as the linked tail. On another lane such a READ can overtake the
/// WRITE, and a proxy killed before the WRITE leaves readers believing in a version that
/// never was linked (seen as stale reads after completed writes, with CAS→WRITE and the
/// read cache on).
#[test]
fn a_converted_link_is_not_read_as_linked_before_the_server_has_it() {
    use camelot_client::proto::{Op, Reply};
    use camelot_clover::layout::{encode_node, tail_marker, FLAG_REDIRECTED, HEADER_BYTES};
    use camelot_clover::NodeAddr;
    let s = server();
    let _p = proxy(
        s.addr(),
        &["--conn-map", "2", "--cas-to-write", "--read-cache"],
    );
    let client = Client::connect(ClusterMap::from_addrs(&[_p.addr()]), config(TOKEN)).unwrap();
    let r = client
        .alloc_with(16 << 20, None, camelot_client::AccessMode::Shared)
        .unwrap();
    let geometry = Geometry::new(64, 64).unwrap();
    let key = 0x5eed_0001;
    let (t_at, n_at) = (
        NodeAddr { block: 0, slot: 0 },
        NodeAddr { block: 0, slot: 1 },
    );
    let node = |at: NodeAddr, seq: u64, value: &[u8]| {
        encode_node(&geometry, at, key, seq, Some(value), true).unwrap()
    };
    client.write(&r, 0, node(t_at, 1, b"old")).unwrap();
    client.write(&r, 256, node(n_at, 2, b"new")).unwrap();
    let len = HEADER_BYTES + 8;
    let header = |reply: &Reply| match reply {
        Reply::Data(d) => {
            let seq = u64::from_le_bytes(d[16..24].try_into().unwrap());
            let flags = u32::from_le_bytes(d[28..32].try_into().unwrap());
            (seq, flags & FLAG_REDIRECTED != 0)
        }
        other => panic!("expected data, got {other:?}"),
    };
    let link = Op::Cas {
        region: r.id,
        offset: 0,
        expected: tail_marker(key, 1),
        new: n_at.encode(),
    };
    let slow = Op::Write {
        region: r.id,
        offset: 8 << 20,
        data: Bytes::from(vec![0u8; 8 << 20]),
    };
    let answers: Vec<Reply> = client
        .submit_many([(r.node, slow), (r.node, link), (r.node, r.read_op(0, len))])
        .unwrap()
        .into_iter()
        .map(|p| p.wait().unwrap())
        .collect();
    assert_eq!(answers[1], Reply::Word(tail_marker(key, 1)), "the link won");
    assert_eq!(stat(&client, "proxy_cas_converted"), 1);
    assert_eq!(
        header(&answers[2]),
        (1, false),
        "a READ decided before the server had the link was answered as the linked tail"
    );
    // Once the link is acknowledged the same READ goes to the new tail: the check above
    // is not vacuous.
    let after = client.call(r.node, r.read_op(0, len)).unwrap();
    assert_eq!(header(&after), (2, true));
}

/// A live proxy whose server was fenced (its clients went direct) stops rather than go
/// on converting CASes from a word table the direct clients are changing under it; a
/// FENCE sent through a proxy is refused, since it would fence the proxy's own lanes.
#[test]
fn a_fenced_proxy_stops_and_a_fence_goes_to_the_servers_only() {
    let s = server();
    let mut p = proxy(s.addr(), &["--conn-map", "2", "--cas-to-write"]);
    let client = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
    let r = client
        .alloc_with(4096, None, camelot_client::AccessMode::Shared)
        .unwrap();
    client
        .write(&r, 0, Bytes::copy_from_slice(&1u64.to_le_bytes()))
        .unwrap();
    assert_eq!(client.cas(&r, 0, 1, 2).unwrap(), 1);
    assert_eq!(stat(&client, "proxy_cas_converted"), 1);
    let through = client.fence();
    assert!(
        matches!(&through, Err(ClientError::Server(e)) if e.code == camelot_client::proto::ErrorCode::BadRequest),
        "{through:?}"
    );
    let direct = Client::connect(ClusterMap::from_addrs(&[s.addr()]), config(TOKEN)).unwrap();
    // As an operator would, by the CLI.
    let out = std::process::Command::new(CAMELOT)
        .args(["proxy", "fence", &s.addr().to_string(), "--token", TOKEN])
        .output()
        .expect("camelot proxy fence");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("fenced (generation 2)"), "{said}");
    // The word as the direct clients now change it; the proxy still believes 2.
    assert_eq!(direct.cas(&r, 0, 2, 3).unwrap(), 2);
    assert!(
        client.cas(&r, 0, 2, 4).is_err(),
        "the fenced proxy answered a CAS from its stale word table"
    );
    assert_eq!(&direct.read(&r, 0, 8).unwrap()[..], &3u64.to_le_bytes()[..]);
    let start = Instant::now();
    while p.is_running() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!p.is_running(), "the fenced proxy kept running");
    let sessions_fenced = stat(&direct, "sessions_fenced");
    assert!(sessions_fenced >= 1, "{sessions_fenced}");
}

#[test]
fn swap_xor_and_guarded_writes_through_the_proxy_are_never_served_stale() {
    let s = server();
    let p = proxy(
        s.addr(),
        &["--conn-map", "2", "--cas-to-write", "--read-cache"],
    );
    let client = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
    let r = client
        .alloc_with(4096, None, camelot_client::AccessMode::Shared)
        .unwrap();
    let word = |v: u64| Bytes::copy_from_slice(&v.to_le_bytes());
    let read = |c: &Client| u64::from_le_bytes(c.read(&r, 0, 8).unwrap()[..].try_into().unwrap());
    client.write(&r, 0, word(1)).unwrap();
    // Twice, so the second READ is answered from the cache if the proxy kept it.
    assert_eq!((read(&client), read(&client)), (1, 1));
    client.call(r.node, r.swap_op(0, word(2))).unwrap();
    assert_eq!(
        read(&client),
        2,
        "a SWAP's bytes must not be hidden by the read cache"
    );
    client.call(r.node, r.xor_into_op(0, word(1))).unwrap();
    assert_eq!(
        read(&client),
        3,
        "an XOR_INTO's bytes must not be hidden by the read cache"
    );
    client
        .call(r.node, r.write_if_op(0, word(7), &r, 8, 0))
        .unwrap();
    assert_eq!(
        read(&client),
        7,
        "a WRITE_IF's bytes must not be hidden by the read cache"
    );
    // And the word table: a CAS from the old value must fail, from the new one succeed.
    assert_eq!(client.cas(&r, 0, 3, 4).unwrap(), 7);
    assert_eq!(client.cas(&r, 0, 7, 8).unwrap(), 7);
    let direct = Client::connect(ClusterMap::from_addrs(&[s.addr()]), config(TOKEN)).unwrap();
    assert_eq!(read(&direct), 8);
    client.free(&r).unwrap();
}

/// Clients through the proxies until `kill_after` operations have finished (if given),
/// then the proxies are SIGKILLed and every client moves to the servers directly.
struct Run {
    history: camelot_check::History<u64>,
    unknown: u64,
    after_kill: u64,
    /// Operations completed through the restarted proxies.
    after_restart: u64,
}

/// After the kill, once this many operations have finished in all, new proxy processes
/// (these flags, empty caches) start and every client returns to them at once.
struct Restart<'a> {
    after: u64,
    flags: &'a [&'a str],
}

fn clover_load(
    servers: &[SocketAddr],
    proxies: &mut [ServerProcess],
    kill_after: Option<u64>,
) -> Run {
    clover_load_with(servers, proxies, kill_after, None, false)
}

/// `broken_proxy`: operations may fail without a kill (recorded as unknown outcomes).
fn clover_load_with(
    servers: &[SocketAddr],
    proxies: &mut [ServerProcess],
    kill_after: Option<u64>,
    restart: Option<Restart>,
    broken_proxy: bool,
) -> Run {
    let via: Vec<SocketAddr> = proxies.iter().map(ServerProcess::addr).collect();
    let direct = ClusterMap::from_addrs(servers);
    let clients: Vec<Client> = (0..5)
        .map(|_| Client::connect(ClusterMap::from_addrs(&via), config(TOKEN)).unwrap())
        .collect();
    // Every thread that fails waits until all clients point at the servers: a thread
    // that went on while the first was still switching would reconnect to a dead proxy
    // and fail again (seen under load: 100+ failures instead of ~30).
    let switched = Arc::new(std::sync::Once::new());
    // Fences the servers before any client goes to them: a killed proxy's converted
    // WRITEs can still be queued in a server's socket, and one run after a direct CAS on
    // its word breaks linearizability (seen once in CI: a violation on one key).
    let fencer = Client::connect(direct.clone(), config(TOKEN)).unwrap();
    let recorder: Arc<Recorder<u64>> = Arc::new(Recorder::new(0));
    let fall_back = {
        let (clients, direct, switched) = (clients.clone(), direct.clone(), switched.clone());
        let recorder = recorder.clone();
        move || {
            switched.call_once(|| {
                let asked = recorder.now();
                fencer.fence().expect("fence the servers");
                eprintln!("fenced: asked at {asked}, done at {}", recorder.now());
                for c in &clients {
                    c.set_map(direct.clone());
                }
            })
        }
    };
    // CAS→WRITE is safe only while all traffic to a word goes through one proxy: the
    // return to restarted proxies waits for every operation in flight (write side) and
    // moves every client before any operation goes on.
    let gate = Arc::new(std::sync::RwLock::new(()));
    let returned = Arc::new(AtomicBool::new(false));
    let geometry = Geometry::new(8, 64).unwrap();
    let mem = RegionMemory::new(clients[4].clone(), geometry);
    let meta_config = MetaConfig {
        blocks_max: 12,
        versions_kept: 2,
        ..MetaConfig::default()
    };
    let meta = Arc::new(Meta::new(mem.clone(), meta_config).unwrap());
    let done = Arc::new(AtomicU64::new(0));
    let after_restart = Arc::new(AtomicU64::new(0));
    let killed = Arc::new(AtomicBool::new(false));
    let after_kill = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let collector = {
        let (meta, stop, fall_back) = (meta.clone(), stop.clone(), fall_back.clone());
        let gate = gate.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) && started.elapsed() < DEADLINE {
                let pass = gate
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if meta.gc().is_err() {
                    fall_back();
                }
                drop(pass);
                // Pacing, not synchronisation.
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let workers: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let mem = mem.with_client(clients[c as usize % 4].clone());
            let (meta, recorder, fall_back) = (meta.clone(), recorder.clone(), fall_back.clone());
            let (done, killed, after_kill) = (done.clone(), killed.clone(), after_kill.clone());
            let (gate, returned, after_restart) =
                (gate.clone(), returned.clone(), after_restart.clone());
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
                let mut unknown = 0u64;
                let mut ops = Ops::new(0x2545_F491_4F6C_DD1D, c);
                for i in 0..OPS_PER_CLIENT {
                    if started.elapsed() > DEADLINE {
                        break;
                    }
                    let (key, op) = ops.next(i);
                    let pass = gate
                        .read()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let was_killed = killed.load(Ordering::SeqCst);
                    let was_returned = returned.load(Ordering::SeqCst);
                    let invoke = recorder.now();
                    let result = ops.apply(&mut store, key, op);
                    let outcome = match result {
                        Ok(o) => {
                            if was_killed {
                                after_kill.fetch_add(1, Ordering::SeqCst);
                            }
                            if was_returned {
                                after_restart.fetch_add(1, Ordering::SeqCst);
                            }
                            Some(o)
                        }
                        Err(e) if broken_proxy => {
                            if unknown == 0 {
                                eprintln!("client {c} through the broken proxy: {e}");
                            }
                            unknown += 1;
                            None
                        }
                        Err(e) => {
                            // Whether it took effect is unknown: the checker lets it have
                            // or not. Clients move to the servers.
                            assert!(killed.load(Ordering::SeqCst), "client {c}: {e}");
                            if unknown == 0 {
                                eprintln!("client {c} after the kill: {e}");
                            }
                            unknown += 1;
                            fall_back();
                            None
                        }
                    };
                    recorder.finish(c, key, op, invoke, outcome).unwrap();
                    drop(pass);
                    done.fetch_add(1, Ordering::SeqCst);
                }
                unknown
            })
        })
        .collect();
    if let Some(n) = kill_after {
        let wait_start = Instant::now();
        while done.load(Ordering::SeqCst) < n && wait_start.elapsed() < DEADLINE {
            std::thread::sleep(Duration::from_millis(1));
        }
        killed.store(true, Ordering::SeqCst);
        eprintln!("killing the proxies at {}", recorder.now());
        for p in proxies.iter_mut() {
            p.kill().expect("SIGKILL the proxy");
        }
        if let Some(r) = &restart {
            while done.load(Ordering::SeqCst) < r.after && wait_start.elapsed() < DEADLINE {
                std::thread::sleep(Duration::from_millis(1));
            }
            // Waits for every operation in flight; none starts until all are moved. Held
            // while the new proxies start, too: on a loaded machine their start took
            // longer than the rest of the run, every client finished directly and the
            // round had nothing through the restarted proxies to check.
            let all = gate
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (p, server) in proxies.iter_mut().zip(servers) {
                *p = proxy(*server, r.flags);
            }
            let via = ClusterMap::from_addrs(
                &proxies.iter().map(ServerProcess::addr).collect::<Vec<_>>(),
            );
            for c in &clients {
                c.set_map(via.clone());
            }
            returned.store(true, Ordering::SeqCst);
            eprintln!("returned to the new proxies at {}", recorder.now());
            drop(all);
        }
    }
    let unknown: u64 = workers.into_iter().map(|w| w.join().expect("worker")).sum();
    stop.store(true, Ordering::Relaxed);
    collector.join().expect("collector");
    assert!(started.elapsed() < DEADLINE, "the load ran out of time");
    // Its clone of the recorder goes with it.
    drop(fall_back);
    let recorder = Arc::try_unwrap(recorder).expect("workers are done");
    Run {
        history: recorder.into_history(),
        unknown,
        after_kill: after_kill.load(Ordering::SeqCst),
        after_restart: after_restart.load(Ordering::SeqCst),
    }
}

fn assert_linearizable(run: &Run) {
    assert_eq!(run.history.len(), (CLIENTS * OPS_PER_CLIENT) as usize);
    let report = check(&run.history, &Limits::default());
    match report.verdict {
        Verdict::Linearizable => {}
        other => {
            // The offending key's operations, by invocation, for whoever must explain it.
            if let Verdict::NotLinearizable(v) = &other {
                let mut ops: Vec<_> = run
                    .history
                    .operations()
                    .iter()
                    .enumerate()
                    .filter(|(_, o)| o.key == v.key)
                    .collect();
                ops.sort_by_key(|(_, o)| o.invoke);
                let text: String = ops
                    .iter()
                    .map(|(i, o)| {
                        let mark = if *i == v.blocked { "BLOCKED " } else { "" };
                        format!("{mark}{o:?}\n")
                    })
                    .collect();
                let path = std::env::temp_dir().join(format!(
                    "camelot-violation-{}-{}.txt",
                    std::process::id(),
                    run.history.len()
                ));
                if std::fs::write(&path, text).is_ok() {
                    eprintln!("key {} operations: {}", v.key, path.display());
                }
            }
            panic!("{other:?} after {} states", report.states_explored)
        }
    }
}

/// Histories per test: 1 unless `CAMELOT_HISTORY_ROUNDS` asks for more (the issue's
/// 100-history run sets it).
fn rounds() -> u32 {
    std::env::var("CAMELOT_HISTORY_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .clamp(1, 1_000)
}

#[test]
fn clover_through_proxies_with_every_technique_is_linearizable() {
    let servers = [server(), server()];
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    let flags = [
        "--conn-map",
        "2",
        "--cas-to-write",
        "--read-cache",
        "--write-cache",
        "--memory",
        "256K",
    ];
    for round in 0..rounds() {
        let mut proxies: Vec<ServerProcess> = addrs.iter().map(|a| proxy(*a, &flags)).collect();
        let run = clover_load(&addrs, &mut proxies, None);
        assert_eq!(run.unknown, 0);
        assert_linearizable(&run);
        let mut converted = 0;
        let mut failed_locally = 0;
        let mut hits = 0;
        let mut relinked = 0;
        let mut redirects = 0;
        for p in &proxies {
            let c = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
            converted += stat(&c, "proxy_cas_converted");
            failed_locally += stat(&c, "proxy_cas_failed_locally");
            assert!(stat(&c, "proxy_state_bytes") <= 256 << 10);
            hits += stat(&c, "proxy_read_hits");
            relinked += stat(&c, "proxy_write_cache_hits");
            redirects += stat(&c, "proxy_read_redirects");
        }
        eprintln!(
            "round {round}: CAS converted {converted}, failed locally {failed_locally}, read hits {hits}, READs sent to the tail {redirects}, CASes re-aimed {relinked}"
        );
        assert!(
            redirects > 0,
            "the read cache never sent a READ to a newer tail"
        );
        assert!(hits > 100, "the read cache never answered: {hits}");
        assert!(converted > 100, "CAS→WRITE never happened: {converted}");
        assert!(relinked > 0, "the write cache never re-aimed a CAS");
    }
}

#[test]
fn proxies_sigkilled_mid_run_leave_a_linearizable_history() {
    let servers = [server(), server()];
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    let flags = [
        "--conn-map",
        "2",
        "--cas-to-write",
        "--read-cache",
        "--write-cache",
    ];
    let total = u64::from(CLIENTS * OPS_PER_CLIENT);
    for round in 0..rounds() {
        let mut proxies: Vec<ServerProcess> = addrs.iter().map(|a| proxy(*a, &flags)).collect();
        // Killed at 1/5 … 4/5 of the run, by round.
        let at = total * u64::from(round % 4 + 1) / 5;
        let run = clover_load(&addrs, &mut proxies, Some(at));
        eprintln!(
            "round {round}: killed after {at}, unknown outcomes {}, completed after the kill {}",
            run.unknown, run.after_kill
        );
        assert!(
            run.after_kill > total / 10,
            "clients did not carry on directly"
        );
        assert_linearizable(&run);
    }
}

fn write_cache_stats(proxies: &[ServerProcess]) -> (u64, u64) {
    let mut hits = 0;
    let mut lost = 0;
    for p in proxies {
        let c = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
        hits += stat(&c, "proxy_write_cache_hits");
        lost += stat(&c, "proxy_write_cache_lost");
    }
    (hits, lost)
}

/// The proxies are SIGKILLed mid-run, clients go to the servers directly, then new proxy
/// processes (empty caches) start and all clients return to them at once: linearizable.
#[test]
fn proxies_killed_and_restarted_mid_run_leave_a_linearizable_history() {
    let servers = [server(), server()];
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    let flags = [
        "--conn-map",
        "2",
        "--cas-to-write",
        "--read-cache",
        "--write-cache",
    ];
    let total = u64::from(CLIENTS * OPS_PER_CLIENT);
    // `CAMELOT_HISTORY_FLAGS="--conn-map 2 --cas-to-write --read-cache"` runs it with
    // fewer techniques: how a violation is narrowed down to the ones it needs.
    let custom = std::env::var("CAMELOT_HISTORY_FLAGS").ok();
    let custom: Vec<&str> = custom
        .as_deref()
        .map(|s| s.split(' ').collect())
        .unwrap_or_default();
    let flags: &[&str] = if custom.is_empty() { &flags } else { &custom };
    for round in 0..rounds() {
        let mut proxies: Vec<ServerProcess> = addrs.iter().map(|a| proxy(*a, flags)).collect();
        // Killed at 1/5 or 2/5 of the run, back 1/5 later.
        let at = total * u64::from(round % 2 + 1) / 5;
        let restart = Restart {
            after: at + total / 5,
            flags,
        };
        let run = clover_load_with(&addrs, &mut proxies, Some(at), Some(restart), false);
        let mut requests = 0;
        for p in &proxies {
            let c = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
            requests += stat(&c, "proxy_requests");
        }
        eprintln!(
            "round {round}: killed after {at}, unknown outcomes {}, completed after the kill {}, through the restarted proxies {} (their requests {requests})",
            run.unknown, run.after_kill, run.after_restart
        );
        assert!(run.after_restart > total / 20, "clients did not return");
        assert!(requests > 1_000, "the restarted proxies carried nothing");
        assert_linearizable(&run);
    }
}

/// The write cache alone (with the mapping it needs): writers' CASes aimed at an old
/// tail are re-aimed and won, and the history stays linearizable.
#[test]
fn clover_through_the_write_cache_is_linearizable() {
    let servers = [server(), server()];
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    let flags = ["--conn-map", "2", "--write-cache", "--memory", "64K"];
    for round in 0..rounds() {
        let mut proxies: Vec<ServerProcess> = addrs.iter().map(|a| proxy(*a, &flags)).collect();
        let run = clover_load(&addrs, &mut proxies, None);
        assert_eq!(run.unknown, 0);
        assert_linearizable(&run);
        let (hits, lost) = write_cache_stats(&proxies);
        eprintln!("round {round}: CASes re-aimed and won {hits}, re-aimed and lost {lost}");
        assert!(hits > 0, "the write cache never re-aimed a CAS");
    }
}

/// The checks can fail: a proxy whose write cache trusts its tail (answers a re-aimed
/// CAS as won whatever the server said) loses writes, and the checker (or Clover's own
/// chain checks, failing operations) catches it.
#[test]
fn a_write_cache_trusting_a_stale_tail_is_caught() {
    let servers = [server(), server()];
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    let flags = ["--conn-map", "2", "--write-cache", "--write-cache-fault"];
    let mut caught = 0;
    let rounds = 3;
    for round in 0..rounds {
        let mut proxies: Vec<ServerProcess> = addrs.iter().map(|a| proxy(*a, &flags)).collect();
        let run = clover_load_with(&addrs, &mut proxies, None, None, true);
        let (hits, lost) = write_cache_stats(&proxies);
        let report = check(&run.history, &Limits::default());
        eprintln!(
            "round {round}: re-aimed {hits} (of which the server refused: lost {lost}), failed operations {}, verdict {:?}",
            run.unknown, report.verdict
        );
        if !matches!(report.verdict, Verdict::Linearizable) || run.unknown > 0 {
            caught += 1;
        }
    }
    assert_eq!(caught, rounds, "a broken write cache went unnoticed");
}

/// Every CAS the proxy answered as a success moved the word: a counter incremented by
/// CAS through the proxy (converted after the first) ends where the count says.
#[test]
fn increments_through_cas_to_write_are_never_lost() {
    let s = server();
    let p = proxy(s.addr(), &["--conn-map", "1", "--cas-to-write"]);
    let client = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
    let r = client
        .alloc_with(4096, None, camelot_client::AccessMode::Shared)
        .unwrap();
    let mut cur = 0u64;
    let mut wins = 0u64;
    for _ in 0..2_000 {
        let before = client.cas(&r, 0, cur, cur + 1).unwrap();
        if before == cur {
            wins += 1;
            cur += 1;
        } else {
            cur = before;
        }
    }
    let direct = Client::connect(ClusterMap::from_addrs(&[s.addr()]), config(TOKEN)).unwrap();
    let word = u64::from_le_bytes(direct.read(&r, 0, 8).unwrap()[..8].try_into().unwrap());
    assert_eq!(
        word,
        wins,
        "converted {}",
        stat(&client, "proxy_cas_converted")
    );
    assert_eq!(wins, 2_000);
}

/// A `camelot server` on `addr`'s port again (same token, empty), as a supervisor
/// restarts a killed one; killed when the guard drops.
fn restart_server_on(
    addr: SocketAddr,
    scratch: &camelot_testkit::process::ScratchDir,
) -> camelot_testkit::process::ChildGuard {
    let program = Program {
        program: CAMELOT.to_string().into(),
        package: "camelot".into(),
    };
    let args: Vec<OsString> = [
        "server",
        "--listen",
        &addr.to_string(),
        "--memory",
        "64M",
        "--token",
        TOKEN,
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let mut guard = camelot_testkit::process::spawn(&program, &args, scratch, "restarted")
        .expect("restart the memory server");
    if camelot_testkit::process::wait_ready(
        &mut guard.child,
        addr,
        Readiness::Accepting,
        Duration::from_secs(10),
    )
    .is_err()
    {
        panic!(
            "the restarted server did not accept on {addr}: {}",
            guard.output_excerpt()
        );
    }
    guard
}

/// A memory server SIGKILLed while the proxy in front of it is idle (nothing in flight),
/// then restarted empty on its port. A proxy that answers from what it knows — its read
/// cache, its word table — must stop once its upstream connection ends, even though no
/// request saw it end: left running, it would connect to the new, empty server and go on
/// answering reads of the killed server's region from its cache.
#[test]
fn a_memory_server_killed_under_an_idle_caching_proxy_stops_the_proxy() {
    for flags in [
        &["--conn-map", "1", "--read-cache"][..],
        &["--conn-map", "1", "--cas-to-write", "--read-cache"],
    ] {
        let mut s = server();
        let addr = s.addr();
        let mut p = proxy(addr, flags);
        let client = Client::connect(
            ClusterMap::from_addrs(&[p.addr()]),
            ClientConfig {
                request_timeout: Duration::from_secs(5),
                ..config(TOKEN)
            },
        )
        .unwrap();
        let r = client.alloc(4096, None).unwrap();
        let old = Bytes::from(vec![0xA5u8; 4096]);
        client.write(&r, 0, old.clone()).unwrap();
        for _ in 0..2 {
            assert_eq!(client.read(&r, 0, 4096).unwrap(), old, "{flags:?}");
        }
        assert!(
            stat(&client, "proxy_read_hits") >= 1,
            "{flags:?}: the region is not in the read cache, so the test shows nothing"
        );
        s.process_mut().kill().expect("SIGKILL the memory server");
        let scratch = camelot_testkit::process::ScratchDir::new("proxy-upstream-restart").unwrap();
        let _restarted = restart_server_on(addr, &scratch);
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.is_running() {
            if Instant::now() >= deadline {
                // What a client of it would be told now, for the failure message.
                let said = match client.read(&r, 0, 4096) {
                    Ok(b) if b == old => "the killed server's bytes, from its cache".to_owned(),
                    Ok(_) => "other bytes".to_owned(),
                    Err(e) => format!("an error: {e}"),
                };
                panic!(
                    "{flags:?}: the proxy ran on 10 s after its upstream server was killed \
                     and restarted; a read of the region through it answered {said}"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            p.output_excerpt().contains("fail-stop"),
            "{flags:?}: {}",
            p.output_excerpt()
        );
        // The region died with the server: nothing of it is answered any more.
        assert!(client.read(&r, 0, 4096).is_err(), "{flags:?}");
    }
}

/// Sends `sig` (`-STOP`, `-CONT`) to `pid` with kill(1).
fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill(1)");
    assert!(status.success(), "kill {sig} {pid}");
}

/// A memory server stopped (SIGSTOP: its connections stay open, nothing is answered)
/// while a caching proxy in front of it is idle. No request of a client notices; the
/// lane's keep-alive PING goes unanswered, the lane's watchdog ends its connection after
/// the upstream timeout, and the proxy stops — it would otherwise answer from its cache
/// for a server that may never come back.
#[test]
fn a_silent_memory_server_stops_an_idle_caching_proxy_within_its_upstream_timeout() {
    let mut s = server();
    let mut p = proxy(
        s.addr(),
        &["--conn-map", "1", "--read-cache", "--upstream-timeout", "1"],
    );
    let client = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
    let r = client.alloc(4096, None).unwrap();
    client.write(&r, 0, Bytes::from(vec![7u8; 64])).unwrap();
    client.read(&r, 0, 64).unwrap();
    let pid = s.process_mut().pid();
    // Resumed however this test ends, so the server can be killed and reaped.
    struct Resume(u32);
    impl Drop for Resume {
        fn drop(&mut self) {
            signal(self.0, "-CONT");
        }
    }
    signal(pid, "-STOP");
    let _resume = Resume(pid);
    let deadline = Instant::now() + Duration::from_secs(15);
    while p.is_running() {
        assert!(
            Instant::now() < deadline,
            "the proxy ran on 15 s after its server went silent (upstream timeout 1 s)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let said = p.output_excerpt();
    assert!(said.contains("fail-stop"), "{said}");
}

/// A server closing idle connections (`--idle-timeout 1`) does not stop a caching proxy
/// whose lanes are quiet: their keep-alive PINGs keep them in use. The test lets the
/// server's idle timeout pass twice over, then reads through the proxy.
#[test]
fn a_caching_proxy_outlives_its_server_s_idle_timeout() {
    let s = camelot_testkit::CamelotServer::start(
        Path::new(CAMELOT),
        &camelot_testkit::CamelotServerOptions {
            resp: false,
            args: ["--memory", "64M", "--token", TOKEN, "--idle-timeout", "1"]
                .map(String::from)
                .to_vec(),
        },
    )
    .expect("camelot server");
    let mut p = proxy(s.addr(), &["--conn-map", "1", "--read-cache"]);
    let client = Client::connect(ClusterMap::from_addrs(&[p.addr()]), config(TOKEN)).unwrap();
    let r = client.alloc(4096, None).unwrap();
    client.write(&r, 0, Bytes::from(vec![9u8; 64])).unwrap();
    // The scenario's own duration, not a wait for something to happen.
    std::thread::sleep(Duration::from_millis(2_500));
    assert!(p.is_running(), "{}", p.output_excerpt());
    assert_eq!(&client.read(&r, 0, 64).unwrap()[..], &[9u8; 64][..]);
}

/// `camelot bench middlebox cas` runs end to end (its own server and proxy processes),
/// checks every increment it counted against the word, and writes the standard JSON.
#[test]
fn the_cas_bench_writes_its_result() {
    let dir = camelot_testkit::process::ScratchDir::new("middlebox-bench").unwrap();
    let out = std::process::Command::new(CAMELOT)
        .args([
            "bench",
            "middlebox",
            "cas",
            "--quick",
            "--clients",
            "1,4",
            "--seconds",
            "0.3",
            "--batch",
            "8",
            "--batch-clients",
            "4",
        ])
        .arg("--out")
        .arg(&dir.path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dir.path.join("middlebox-cas.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["bench"], "middlebox-cas");
    assert_eq!(json["config"]["quick"], true);
    assert_eq!(json["config"]["batch_words"], 8);
    let series = json["series"].as_array().unwrap();
    assert_eq!(
        series.len(),
        6,
        "one word, shared words, own words: direct and proxy each"
    );
    for (i, s) in series.iter().enumerate() {
        let points = s["points"].as_array().unwrap();
        assert_eq!(points.len(), if i < 2 { 2 } else { 1 }, "{s}");
        for p in points {
            assert!(p["ops_per_sec"].as_f64().unwrap() > 0.0, "{p}");
            assert!(p["extra"]["server_cpu_s"].as_f64().is_some(), "{p}");
        }
    }
    // Through the proxy, every CAS was one of a frame of 8, and each was converted,
    // failed from the known value or forwarded.
    for at in [3, 5] {
        let p = &series[at]["points"][0];
        assert_eq!(p["x"].as_f64(), Some(4.0), "{p}");
        let e = &p["extra"];
        let attempts = e["cas_attempts"].as_u64().unwrap();
        assert_eq!(attempts % 8, 0, "{p}");
        let counted: u64 = [
            "proxy_cas_converted",
            "proxy_cas_failed_locally",
            "proxy_cas_forwarded",
        ]
        .iter()
        .map(|k| e[k].as_u64().unwrap())
        .sum();
        assert_eq!(counted, attempts, "{p}");
    }
    // Words of its own: every CAS wins, so none fails at the proxy.
    let own = &series[5]["points"][0]["extra"];
    assert_eq!(own["increments"], own["cas_attempts"], "{own}");
    assert_eq!(own["proxy_cas_failed_locally"], 0, "{own}");
    let comparisons = json["comparisons"].as_array().unwrap();
    for how in ["shared", "own"] {
        let name = format!("4 clients × 8 {how} words per frame (goal 1 M)");
        assert!(
            comparisons
                .iter()
                .any(|c| c["name"].as_str().unwrap().contains(&name)),
            "{name}: {comparisons:?}"
        );
    }
}

fn run_middlebox_bench(which: &str, dir: &Path) -> serde_json::Value {
    let out = std::process::Command::new(CAMELOT)
        .args([
            "bench",
            "middlebox",
            which,
            "--quick",
            "--clients",
            "8",
            "--seconds",
            "0.5",
        ])
        .arg("--out")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dir.join(format!("middlebox-{which}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `bench middlebox bandwidth`: direct and both sides of the proxy each carried bytes
/// both ways for every operation, and the comparison is against the same run's direct.
#[test]
fn the_bandwidth_bench_counts_both_sides_of_the_proxy() {
    let dir = camelot_testkit::process::ScratchDir::new("middlebox-bandwidth").unwrap();
    let json = run_middlebox_bench("bandwidth", &dir.path);
    assert_eq!(json["bench"], "middlebox-bandwidth");
    let series = json["series"].as_array().unwrap();
    assert_eq!(series.len(), 3);
    for s in series {
        let p = &s["points"][0];
        assert!(p["extra"]["ops"].as_u64().unwrap() > 0, "{p}");
        // A Clover operation is at least one request frame and one answer frame.
        assert!(
            p["extra"]["bytes_per_op_to_server"].as_f64().unwrap() > 8.0,
            "{p}"
        );
        assert!(
            p["extra"]["bytes_per_op_from_server"].as_f64().unwrap() > 8.0,
            "{p}"
        );
    }
    // The proxy's own count of its upstream side is beside the server's.
    let upstream = &series[1]["points"][0]["extra"];
    for way in ["to", "from"] {
        let counted = upstream[format!("proxy_counted_bytes_per_op_{way}_server")]
            .as_f64()
            .unwrap();
        assert!(counted > 8.0, "{upstream}");
    }
    let cmp = json["comparisons"].as_array().unwrap();
    assert!(cmp[0]["ratio"].as_f64().unwrap() > 0.0, "{cmp:?}");
}

/// `bench middlebox tail`: three sides, read and write latency each, and the
/// pass-through p50 comparison carries the 1.3× ceiling.
#[test]
fn the_tail_bench_reports_p99_for_every_side() {
    let dir = camelot_testkit::process::ScratchDir::new("middlebox-tail").unwrap();
    let json = run_middlebox_bench("tail", &dir.path);
    assert_eq!(json["bench"], "middlebox-tail");
    let series = json["series"].as_array().unwrap();
    assert_eq!(series.len(), 3);
    for s in series {
        for p in s["points"].as_array().unwrap() {
            let l = &p["latency_us"];
            assert!(
                l["p99"].as_f64().unwrap() >= l["p50"].as_f64().unwrap(),
                "{p}"
            );
            assert!(p["extra"]["count"].as_u64().unwrap() > 0, "{p}");
        }
    }
    let cmp = &json["comparisons"][0];
    assert_eq!(cmp["target"].as_f64(), Some(1.3), "{cmp}");
    assert_eq!(cmp["at_most"], true);
}

/// `bench middlebox full-system`: every workload has the baseline and the five bars, each
/// with its speed-up and both processes' CPU seconds, and one target comparison each.
#[test]
fn the_full_system_bench_reports_every_bar() {
    let dir = camelot_testkit::process::ScratchDir::new("middlebox-full").unwrap();
    let json = run_middlebox_bench("full-system", &dir.path);
    assert_eq!(json["bench"], "middlebox-full-system");
    let series = json["series"].as_array().unwrap();
    assert_eq!(series.len(), 3);
    for s in series {
        let points = s["points"].as_array().unwrap();
        assert_eq!(points.len(), 6, "{s}");
        for p in points {
            assert!(p["ops_per_sec"].as_f64().unwrap() > 0.0, "{p}");
            assert!(
                p["extra"]["speedup_vs_direct"].as_f64().unwrap() > 0.0,
                "{p}"
            );
            assert!(p["extra"]["server_cpu_s"].as_f64().unwrap() > 0.0, "{p}");
        }
        assert!(points[5]["extra"]["proxy_cpu_s"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(json["comparisons"].as_array().unwrap().len(), 3);
}

/// `bench middlebox memory`: Clover direct, then one proxy with every technique per
/// `--memory` budget from a few KiB up; the proxy never holds more than its budget.
#[test]
fn the_memory_bench_keeps_every_proxy_within_its_budget() {
    let dir = camelot_testkit::process::ScratchDir::new("middlebox-memory").unwrap();
    let json = run_middlebox_bench("memory", &dir.path);
    assert_eq!(json["bench"], "middlebox-memory");
    assert_eq!(json["config"]["quick"], true);
    let series = json["series"].as_array().unwrap();
    assert_eq!(series.len(), 2);
    assert!(series[0]["points"][0]["ops_per_sec"].as_f64().unwrap() > 0.0);
    let points = series[1]["points"].as_array().unwrap();
    assert_eq!(points.len(), 3, "{points:?}");
    let mut budgets = Vec::new();
    for p in points {
        let budget = p["extra"]["memory_bytes"].as_u64().unwrap();
        let held = p["extra"]["proxy_state_bytes"].as_u64().unwrap();
        assert!(held <= budget, "{held} B held under a {budget} B budget");
        assert!(p["ops_per_sec"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["extra"]["proxy_cpu_s"].as_f64().unwrap() > 0.0, "{p}");
        budgets.push(budget);
    }
    assert!(
        budgets[0] <= 8 << 10,
        "the smallest budget is a few KiB: {budgets:?}"
    );
    assert!(budgets.windows(2).all(|w| w[0] < w[1]), "{budgets:?}");
    assert!(json["comparisons"][0]["ratio"].as_f64().unwrap() > 0.0);
}
