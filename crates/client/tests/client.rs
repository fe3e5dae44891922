//! The client against real memory servers on loopback ports the OS picks.

use bytes::Bytes;
use camelot_client::proto::{ErrorCode, Op, Reply};
use camelot_client::{
    AccessMode, Client, ClientConfig, ClientError, ClusterMap, LoopClient, Region,
};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use camelot_server::Quota;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

fn cluster(nodes: usize, memory: u64, token: Option<&str>) -> DevCluster {
    DevCluster::start(DevClusterConfig {
        nodes,
        memory_bytes_per_node: memory,
        token: token.map(|t| t.as_bytes().to_vec()),
        worker_threads: 2,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster starts")
}

fn client(c: &DevCluster, config: ClientConfig) -> Result<Client, ClientError> {
    Client::connect(ClusterMap::from_addrs(c.addrs()), config)
}

/// A client whose requests to a node all share one connection, so frame counts and
/// frame contents can be reasoned about.
fn one_connection_client(c: &DevCluster) -> Client {
    client(
        c,
        ClientConfig {
            connections_per_node: 1,
            ..ClientConfig::default()
        },
    )
    .expect("connect")
}

/// A ping to a silent server, sent at `sent` by a client whose request timeout is
/// 500 ms, must fail with Timeout close to that time: not at once, not hanging.
fn assert_timed_out<T: std::fmt::Debug>(result: Result<T, ClientError>, sent: Instant) {
    match result {
        Err(ClientError::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

fn stat(stats: &[(String, u64)], name: &str) -> u64 {
    stats
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no stat {name} in {stats:?}"))
}

/// A one-node dev cluster on `addr`'s port, as after a server restart.
fn restart_on(addr: std::net::SocketAddr) -> DevCluster {
    DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 1 << 20,
        base_port: Some(addr.port()),
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("restart on the same port")
}

/// What a request may meet between a server's restart and the client's reconnect.
fn is_reconnect_error(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::ConnectionLost { .. } | ClientError::Io { .. } | ClientError::Connect { .. }
    )
}

/// Deterministic bytes that differ by position and seed, so misplaced data shows.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn wrong_or_missing_token_is_refused_and_nothing_is_served() {
    let c = cluster(1, 1 << 20, Some("right-token"));
    for token in [Some(b"wrong-token".to_vec()), None] {
        let config = ClientConfig {
            token,
            ..ClientConfig::default()
        };
        match client(&c, config) {
            Err(ClientError::Auth { .. }) => {}
            Err(e) => panic!("expected an auth error, got {e}"),
            Ok(_) => panic!("connected without the right token"),
        }
    }
    let stats = &c.stats()[0];
    let served: u64 = stats
        .iter()
        .filter(|(n, _)| n.starts_with("ops_"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(served, 0, "ops were served to a refused client: {stats:?}");
    assert_eq!(stat(stats, "regions"), 0);

    let ok = client(
        &c,
        ClientConfig {
            token: Some(b"right-token".to_vec()),
            ..ClientConfig::default()
        },
    )
    .expect("the right token is accepted");
    ok.ping(0).expect("ping");
    c.shutdown().expect("shutdown");
}

#[test]
fn allocation_beyond_the_cap_is_refused_and_earlier_data_stays() {
    let cap = 1 << 20;
    let c = cluster(1, cap, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    let first = cl.alloc(cap / 2, Some("first")).expect("half the cap fits");
    let data = pattern(1, (cap / 2) as usize);
    cl.write(&first, 0, data.clone()).expect("write");

    for size in [cap, cap / 2 + 4096, u64::MAX] {
        let e = cl
            .alloc(size, None)
            .expect_err("allocation past the cap must fail");
        assert!(
            matches!(
                e.code(),
                Some(ErrorCode::OutOfMemory) | Some(ErrorCode::TooLarge)
            ),
            "size {size}: {e}"
        );
    }
    let back = cl.read(&first, 0, data.len() as u32).expect("read back");
    assert_eq!(&back[..], &data[..], "earlier data changed");
    assert_eq!(cl.list(0).expect("list").len(), 1);
    let stats = &c.stats()[0];
    assert!(stat(stats, "memory_used_bytes") <= cap);

    // Freeing gives the room back.
    cl.free(&first).expect("free");
    cl.alloc(cap, None).expect("the whole cap after free");
    c.shutdown().expect("shutdown");
}

#[test]
fn out_of_bounds_and_unaligned_accesses_are_refused() {
    let c = cluster(1, 1 << 20, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    let r = cl.alloc(4096, None).expect("alloc");
    cl.write(&r, 0, vec![7u8; 4096]).expect("in-bounds write");

    let cases: Vec<(Op, ErrorCode)> = vec![
        (r.read_op(4090, 8), ErrorCode::OutOfBounds),
        (r.read_op(u64::MAX - 2, 8), ErrorCode::OutOfBounds),
        (
            r.write_op(4095, Bytes::from_static(b"ab")),
            ErrorCode::OutOfBounds,
        ),
        (
            r.write_op(u64::MAX, Bytes::from_static(b"a")),
            ErrorCode::OutOfBounds,
        ),
        (r.cas_op(4096, 0, 1), ErrorCode::OutOfBounds),
        (r.fetch_add_op(3, 1), ErrorCode::Unaligned),
        (r.cas_op(12, 0, 1), ErrorCode::Unaligned),
    ];
    for (op, want) in cases {
        let desc = format!("{op:?}");
        let e = cl.call(0, op).expect_err(&desc);
        assert_eq!(e.code(), Some(want), "{desc}: {e}");
    }
    let e = cl
        .call(
            0,
            Op::Read {
                region: r.id + 1000,
                offset: 0,
                len: 1,
            },
        )
        .expect_err("no such region");
    assert_eq!(e.code(), Some(ErrorCode::NoSuchRegion));
    // Nothing partial was written.
    assert_eq!(&cl.read(&r, 0, 4096).expect("read")[..], &[7u8; 4096][..]);
    c.shutdown().expect("shutdown");
}

#[test]
fn concurrent_cas_loops_and_fetch_adds_reach_the_exact_sum() {
    cas_loops_and_fetch_adds_race(Pinning::None);
}

/// The same race with threads pinned round-robin over the CPUs (so connections are
/// shared only by threads of one CPU and their readers are pinned there), and with
/// pinned and free threads mixed on the same connections.
#[test]
fn pinned_threads_reach_the_exact_sum_alone_and_mixed_with_free_ones() {
    cas_loops_and_fetch_adds_race(Pinning::All);
    cas_loops_and_fetch_adds_race(Pinning::Half);
}

#[derive(Clone, Copy)]
enum Pinning {
    None,
    All,
    Half,
}

fn cas_loops_and_fetch_adds_race(pinning: Pinning) {
    const THREADS: u64 = 8;
    const PER_THREAD: u64 = 10_000;
    let c = cluster(1, 1 << 20, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    let r = cl.alloc(4096, None).expect("alloc");
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    if !matches!(pinning, Pinning::None) {
        assert!(!cores.is_empty(), "this machine's CPUs could not be listed");
    }
    let handles: Vec<_> = (0..THREADS as usize)
        .map(|t| {
            let (cl, r, barrier) = (cl.clone(), r.clone(), barrier.clone());
            let core = match pinning {
                Pinning::All => Some(cores[t % cores.len()]),
                Pinning::Half if t % 2 == 0 => Some(cores[(t / 2) % cores.len()]),
                _ => None,
            };
            thread::spawn(move || {
                if let Some(core) = core {
                    assert!(core_affinity::set_for_current(core), "pin to {core:?}");
                }
                barrier.wait();
                let mut retries = 0u64;
                for _ in 0..PER_THREAD {
                    // Word 0: CAS loop; word 8: FETCH_ADD. Both see the same contention.
                    let mut seen = cl.read_word(&r, 0);
                    loop {
                        let before = cl.cas(&r, 0, seen, seen + 1).expect("cas");
                        if before == seen {
                            break;
                        }
                        retries += 1;
                        seen = before;
                    }
                    cl.fetch_add(&r, 8, 3).expect("fetch_add");
                }
                retries
            })
        })
        .collect();
    let retries: u64 = handles.into_iter().map(|h| h.join().expect("thread")).sum();
    assert_eq!(cl.read_word(&r, 0), THREADS * PER_THREAD);
    assert_eq!(cl.read_word(&r, 8), 3 * THREADS * PER_THREAD);
    // The loop must actually have raced, or the test proves nothing about atomicity.
    assert!(retries > 0, "no CAS ever failed: threads did not contend");
    c.shutdown().expect("shutdown");
}

trait ReadWord {
    fn read_word(&self, r: &Region, offset: u64) -> u64;
}

impl ReadWord for Client {
    fn read_word(&self, r: &Region, offset: u64) -> u64 {
        let b = self.read(r, offset, 8).expect("read word");
        u64::from_le_bytes(b[..].try_into().expect("8 bytes"))
    }
}

/// Writes `pattern(i)` into chunk `i` of `r` for every index, pipelined, then waits.
fn write_chunks(cl: &Client, r: &Region, indices: impl Iterator<Item = usize>, chunk: usize) {
    let pending: Vec<_> = indices
        .map(|i| {
            let data = pattern(i as u64, chunk);
            cl.submit(r.node, r.write_op((i * chunk) as u64, data.into()))
                .expect("submit write")
        })
        .collect();
    for p in pending {
        assert!(matches!(p.wait().expect("write"), Reply::Done));
    }
}

/// Writes through one client and reads through another, many threads each, pipelined.
fn write_then_read(writer: &Client, reader: &Client, r: &Region, chunk: usize) -> Vec<Bytes> {
    let chunks = (r.size as usize) / chunk;
    let threads = 4;
    let write = |cl: &Client| {
        thread::scope(|s| {
            for t in 0..threads {
                let cl = cl.clone();
                s.spawn(move || write_chunks(&cl, r, (t..chunks).step_by(threads), chunk));
            }
        })
    };
    write(writer);
    let pending: Vec<_> = (0..chunks)
        .map(|i| {
            reader
                .submit(r.node, r.read_op((i * chunk) as u64, chunk as u32))
                .expect("submit read")
        })
        .collect();
    pending
        .into_iter()
        .map(|p| camelot_client::reply::data(p.wait()).expect("read"))
        .collect()
}

#[test]
fn batched_and_unbatched_paths_are_byte_identical() {
    let c = cluster(1, 8 << 20, None);
    let batched = client(&c, ClientConfig::default()).expect("connect");
    let unbatched = client(
        &c,
        ClientConfig {
            batching: false,
            ..ClientConfig::default()
        },
    )
    .expect("connect");
    for chunk in [64usize, 4096, 65_536] {
        let a = batched.alloc(1 << 20, None).expect("alloc");
        let b = batched.alloc(1 << 20, None).expect("alloc");
        // Both directions: batched writes read unbatched, and the reverse.
        let via_batched = write_then_read(&batched, &unbatched, &a, chunk);
        let via_unbatched = write_then_read(&unbatched, &batched, &b, chunk);
        assert_eq!(via_batched.len(), (1 << 20) / chunk);
        for (i, (x, y)) in via_batched.iter().zip(&via_unbatched).enumerate() {
            assert_eq!(x, y, "chunk {i} of {chunk} bytes differs");
            assert_eq!(&x[..], &pattern(i as u64, chunk)[..]);
        }
        batched.free(&a).expect("free");
        batched.free(&b).expect("free");
    }
    // Batching must have coalesced: far fewer frames than requests on that path.
    let stats = &c.stats()[0];
    let frames = stat(stats, "batches");
    let ops: u64 = stats
        .iter()
        .filter(|(n, _)| n.starts_with("ops_"))
        .map(|(_, v)| v)
        .sum();
    assert!(frames < ops, "frames {frames} vs ops {ops}");
    c.shutdown().expect("shutdown");
}

#[test]
fn frames_mixing_small_and_big_payloads_arrive_intact() {
    // Big payloads leave the client by vectored write, small ones are copied into the
    // frame: a pipelined burst of both kinds puts both in the same frames.
    const SLOT: usize = 128 << 10;
    let sizes = [100usize, 70_000, 1, SLOT, 65_535, 65_536, 4096, 100_000];
    let c = cluster(1, 8 << 20, None);
    let cl = one_connection_client(&c);
    let r = cl
        .alloc((SLOT * sizes.len() * 4) as u64, None)
        .expect("alloc");
    let slots: Vec<(usize, usize)> = (0..sizes.len() * 4)
        .map(|i| (i, sizes[i % sizes.len()]))
        .collect();
    let pending: Vec<_> = slots
        .iter()
        .map(|&(i, len)| {
            let op = r.write_op((i * SLOT) as u64, pattern(i as u64, len).into());
            cl.submit(r.node, op).expect("submit write")
        })
        .collect();
    for p in pending {
        assert!(matches!(p.wait().expect("write"), Reply::Done));
    }
    for &(i, len) in &slots {
        let data = cl.read(&r, (i * SLOT) as u64, len as u32).expect("read");
        assert_eq!(
            &data[..],
            &pattern(i as u64, len)[..],
            "slot {i}, {len} bytes"
        );
    }
    for (i, len) in sizes.iter().enumerate() {
        let key = format!("k{i}");
        cl.put(key.as_bytes(), pattern(100 + i as u64, *len))
            .expect("put");
        let got = cl.get(key.as_bytes()).expect("get").expect("present");
        assert_eq!(
            &got.value[..],
            &pattern(100 + i as u64, *len)[..],
            "{len}-byte value"
        );
    }
    c.shutdown().expect("shutdown");
}

#[test]
fn big_pipelined_transfers_travel_in_frames_near_the_target_size() {
    use camelot_client::proto::limits::FRAME_BYTES_TARGET;
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 12;
    let c = cluster(1, 16 << 20, None);
    let cl = one_connection_client(&c);
    let r = cl.alloc((CHUNK * CHUNKS) as u64, None).expect("alloc");
    let batches = || stat(&c.stats()[0], "batches");
    // No frame may carry more than the target's worth of payload, so 12 MiB each way
    // needs at least this many (one 12 MiB frame each way before the target existed).
    let frames_min = (CHUNK * CHUNKS / FRAME_BYTES_TARGET) as u64;

    let before = batches();
    write_chunks(&cl, &r, 0..CHUNKS, CHUNK);
    let write_frames = batches() - before;
    assert!(
        write_frames >= frames_min,
        "{CHUNKS} MiB of writes went in {write_frames} frames"
    );

    let before = batches();
    let reads: Vec<_> = (0..CHUNKS)
        .map(|i| {
            cl.submit(r.node, r.read_op((i * CHUNK) as u64, CHUNK as u32))
                .expect("submit read")
        })
        .collect();
    for (i, p) in reads.into_iter().enumerate() {
        let data = camelot_client::reply::data(p.wait()).expect("read");
        assert_eq!(&data[..], &pattern(i as u64, CHUNK)[..], "chunk {i}");
    }
    let read_frames = batches() - before;
    assert!(
        read_frames >= frames_min,
        "{CHUNKS} MiB of reads went in {read_frames} frames"
    );
    c.shutdown().expect("shutdown");
}

#[test]
fn named_regions_are_placed_by_the_map_and_found_again() {
    let c = cluster(3, 4 << 20, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    let map = cl.map();
    for i in 0..12 {
        let name = format!("region-{i}");
        let r = cl.alloc(4096, Some(&name)).expect("alloc");
        assert_eq!(Some(r.node), map.node_for_name(&name));
        cl.write(&r, 0, name.clone().into_bytes()).expect("write");
    }
    let other = client(&c, ClientConfig::default()).expect("second client");
    for i in 0..12 {
        let name = format!("region-{i}");
        let r = other.lookup(&name).expect("lookup");
        let back = other.read(&r, 0, name.len() as u32).expect("read");
        assert_eq!(&back[..], name.as_bytes());
    }
    let e = cl
        .alloc(4096, Some("region-0"))
        .expect_err("duplicate name");
    assert_eq!(e.code(), Some(ErrorCode::NameExists));
    let e = other.lookup("absent").expect_err("absent name");
    assert_eq!(e.code(), Some(ErrorCode::NameNotFound));
    c.shutdown().expect("shutdown");
}

#[test]
fn the_client_reconnects_after_a_server_restart() {
    let c = cluster(1, 1 << 20, None);
    let addr = c.addrs()[0];
    let cl = client(&c, ClientConfig::default()).expect("connect");
    cl.ping(0).expect("ping");
    c.shutdown().expect("shutdown");

    // The first request after the restart may fail on the dead connection; a later one
    // must succeed on a new connection without rebuilding the client.
    let restarted = restart_on(addr);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match cl.ping(0) {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => {
                assert!(
                    is_reconnect_error(&e),
                    "unexpected error while reconnecting: {e}"
                );
            }
            Err(e) => panic!("no reconnect within 10 s: {e}"),
        }
    }
    restarted.shutdown().expect("shutdown");
}

#[test]
fn a_dead_node_fails_requests_instead_of_hanging() {
    let c = cluster(1, 1 << 20, None);
    let cl = client(
        &c,
        ClientConfig {
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(2),
            ..ClientConfig::default()
        },
    )
    .expect("connect");
    c.shutdown().expect("shutdown");
    let t = Instant::now();
    for _ in 0..3 {
        assert!(cl.ping(0).is_err(), "ping to a stopped server succeeded");
    }
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(matches!(cl.ping(7), Err(ClientError::UnknownNode(7))));
}

#[test]
fn the_async_face_gives_the_same_answers() {
    let c = cluster(2, 1 << 20, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let r = cl.alloc(4096, Some("async")).expect("alloc");
        cl.write_async(&r, 16, &b"hello, far memory"[..])
            .await
            .expect("write");
        let back = cl.read_async(&r, 16, 17).await.expect("read");
        assert_eq!(&back[..], b"hello, far memory");
        assert_eq!(cl.fetch_add_async(&r, 64, 5).await.expect("faa"), 0);
        assert_eq!(cl.cas_async(&r, 64, 5, 9).await.expect("cas"), 5);
        assert_eq!(cl.cas_async(&r, 64, 5, 1).await.expect("cas"), 9);
        let futures: Vec<_> = (0..100u64)
            .map(|i| cl.fetch_add_async(&r, 128, i))
            .collect();
        for f in futures {
            f.await.expect("faa");
        }
        assert_eq!(
            cl.fetch_add(&r, 128, 0).expect("read"),
            (0..100).sum::<u64>()
        );
    });
    c.shutdown().expect("shutdown");
}

/// A peer that completes the handshake and then never answers.
fn silent_server() -> (std::net::SocketAddr, thread::JoinHandle<()>) {
    use camelot_client::proto::{encode_frame, Frame, HelloOk, PROTOCOL_VERSION};
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let handle = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 4096];
        // The HELLO is small and arrives first; its exact bytes do not matter here.
        let _ = s.read(&mut buf);
        let mut out = bytes::BytesMut::new();
        encode_frame(
            &Frame::HelloOk(HelloOk {
                version: PROTOCOL_VERSION,
                epoch: 0,
                fence_generation: 1,
            }),
            &mut out,
        )
        .expect("encode");
        s.write_all(&out).expect("hello ok");
        // Swallow requests until the client gives up and closes.
        while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
    });
    (addr, handle)
}

#[test]
fn an_unanswered_request_times_out() {
    let (addr, server) = silent_server();
    let cl = Client::connect(
        ClusterMap::from_addrs(&[addr]),
        ClientConfig {
            request_timeout: Duration::from_millis(500),
            ..ClientConfig::default()
        },
    )
    .expect("handshake");
    let t = Instant::now();
    assert_timed_out(cl.ping(0), t);
    drop(cl);
    server.join().expect("silent server");
}

/// Blocking waiters read the socket themselves when nobody else is; awaiting tasks and
/// answers nobody waits for must still be collected by the connection's reader thread.
#[test]
fn blocking_async_and_abandoned_requests_share_a_connection() {
    let c = cluster(1, 1 << 20, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    let r = cl.alloc(4096, None).expect("alloc");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (cl, r) = (cl.clone(), r.clone());
            rt.spawn(async move {
                for _ in 0..500 {
                    cl.fetch_add_async(&r, 0, 1).await.expect("async faa");
                }
            })
        })
        .collect();
    thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for i in 0..500 {
                    let p = cl.submit(r.node, r.fetch_add_op(8, 1)).expect("submit");
                    // Every third answer is abandoned: nobody waits for it.
                    if i % 3 != 0 {
                        p.wait().expect("blocking faa");
                    }
                }
            });
        }
    });
    rt.block_on(async {
        for t in tasks {
            t.await.expect("task");
        }
    });
    assert_eq!(cl.fetch_add(&r, 0, 0).expect("read"), 4 * 500);
    // Abandoned requests were still executed and their answers drained: the same
    // connection keeps serving, and the counter shows all of them.
    assert_eq!(cl.fetch_add(&r, 8, 0).expect("read"), 4 * 500);
    c.shutdown().expect("shutdown");
}

#[test]
fn a_burst_over_two_nodes_answers_in_order_even_past_the_queue_limit() {
    let c = cluster(2, 4 << 20, None);
    // A queue of 8 while the burst holds 600: the burst must send part of itself to
    // make room rather than wait for room only it could free.
    let config = ClientConfig {
        queue_requests_max: 8,
        ..ClientConfig::default()
    };
    let cl = client(&c, config).expect("connect");
    let ids: Vec<_> = cl.map().node_ids().collect();
    let regions: Vec<Region> = ids
        .iter()
        .map(|&n| cl.alloc_on(n, 1 << 20, None).expect("alloc"))
        .collect();
    assert_ne!(regions[0].node, regions[1].node);
    let writes = (0..300u64).map(|i| {
        let r = &regions[(i % 2) as usize];
        (r.node, r.write_op(i * 64, Bytes::from(pattern(i, 64))))
    });
    for p in cl.submit_many(writes).expect("submit writes") {
        assert!(matches!(p.wait().expect("write"), Reply::Done));
    }
    // Reads and counter bumps interleaved across both nodes; each answer must be the
    // one for its own request.
    let ops = (0..600u64).map(|i| {
        let r = &regions[(i % 2) as usize];
        if i % 3 == 0 {
            (r.node, r.fetch_add_op(1 << 19, 1))
        } else {
            let k = i % 300;
            let r = &regions[(k % 2) as usize];
            (r.node, r.read_op(k * 64, 64))
        }
    });
    let pendings = cl.submit_many(ops).expect("submit burst");
    assert_eq!(pendings.len(), 600);
    let mut bumps = [0u64; 2];
    for (i, p) in (0..600u64).zip(pendings) {
        match p.wait().expect("answer") {
            Reply::Word(before) => {
                assert_eq!(i % 3, 0, "request {i} got a counter answer");
                let n = (i % 2) as usize;
                assert_eq!(before, bumps[n], "counter on node {n} out of order");
                bumps[n] += 1;
            }
            Reply::Data(d) => {
                assert_ne!(i % 3, 0, "request {i} got data");
                assert_eq!(&d[..], &pattern(i % 300, 64)[..], "read {i}");
            }
            other => panic!("request {i}: unexpected {other:?}"),
        }
    }
    assert_eq!(bumps, [100, 100]);
    c.shutdown().expect("shutdown");
}

#[test]
fn a_scan_longer_than_one_answer_frame_is_continued() {
    let c = cluster(2, 256 << 20, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    // 36 values of 4 MiB on 2 nodes: one node holds at least 18, more than fit in one
    // answer frame (64 MiB), so the scan must ask that node again.
    let value = Bytes::from(vec![0x5a; 4 << 20]);
    for i in 0..36u32 {
        cl.put(format!("big{i:02}").as_bytes(), value.clone())
            .expect("put");
    }
    let got = cl.scan(b"big", 40).expect("scan");
    let keys: Vec<String> = got
        .iter()
        .map(|it| String::from_utf8_lossy(&it.key).into_owned())
        .collect();
    let expected: Vec<String> = (0..36).map(|i| format!("big{i:02}")).collect();
    assert_eq!(keys, expected);
    assert!(got.iter().all(|it| it.value == value));
    let first_ten = cl.scan(b"big", 10).expect("scan");
    assert_eq!(first_ten.len(), 10);
    c.shutdown().expect("shutdown");
}

fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// `connection_lost` tells of a connection that ended with nothing in flight on it (its
/// server gone): nothing before, the end's error after, and at once to a later caller.
#[test]
fn the_event_loop_face_tells_of_a_connection_lost_while_idle() {
    let c = cluster(1, 1 << 20, None);
    let rt = current_thread_runtime();
    rt.block_on(async {
        let lc = LoopClient::connect(ClusterMap::from_addrs(c.addrs()), ClientConfig::default())
            .await
            .expect("connect");
        assert!(matches!(lc.call(0, Op::Ping).await, Ok(Reply::Pong)));
        let lost = lc.connection_lost();
        tokio::pin!(lost);
        // A timeout polls what it wraps first: pending now, as nothing was lost.
        assert!(
            tokio::time::timeout(Duration::ZERO, &mut lost)
                .await
                .is_err(),
            "a loss told while the server runs"
        );
        // Off the runtime's thread: the cluster's shutdown blocks on a runtime of its own.
        thread::spawn(move || c.shutdown())
            .join()
            .expect("shutdown thread")
            .expect("shutdown");
        let e = tokio::time::timeout(Duration::from_secs(10), lost)
            .await
            .expect("the loss told within 10 s");
        assert!(
            matches!(
                e,
                ClientError::ConnectionLost { .. } | ClientError::Io { .. }
            ),
            "{e}"
        );
        let again = tokio::time::timeout(Duration::ZERO, lc.connection_lost()).await;
        assert!(
            again.is_ok(),
            "a later caller waits for a loss already told"
        );
    });
}

/// The event-loop face on a one-thread runtime: many tasks' requests share frames, every
/// answer is the right one, and atomics from tasks and threads add up exactly.
#[test]
fn the_event_loop_face_answers_many_tasks_correctly() {
    let c = cluster(2, 8 << 20, None);
    let threaded = client(&c, ClientConfig::default()).expect("connect");
    let ids: Vec<_> = threaded.map().node_ids().collect();
    let regions: Vec<Region> = ids
        .iter()
        .map(|&n| threaded.alloc_on(n, 1 << 20, None).expect("alloc"))
        .collect();
    let rt = current_thread_runtime();
    rt.block_on(async {
        let lc = LoopClient::connect(ClusterMap::from_addrs(c.addrs()), ClientConfig::default())
            .await
            .expect("connect");
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..16u64 {
            let (lc, regions) = (lc.clone(), regions.clone());
            tasks.spawn(async move {
                let r = &regions[(t % 2) as usize];
                // Each task owns its own 1 KiB slice of the region: write, then read back
                // with 16 requests in flight at a time.
                let base = 4096 + t * 1024;
                for round in 0..20u64 {
                    let mut pending = Vec::new();
                    for k in 0..16u64 {
                        let data = Bytes::from(pattern(t * 1000 + round * 16 + k, 64));
                        let p = lc
                            .submit(r.node, r.write_op(base + k * 64, data))
                            .await
                            .expect("submit");
                        pending.push(p);
                    }
                    for p in pending {
                        assert!(matches!(p.await.expect("write"), Reply::Done));
                    }
                    let mut reads = Vec::new();
                    for k in 0..16u64 {
                        reads.push(
                            lc.submit(r.node, r.read_op(base + k * 64, 64))
                                .await
                                .expect("submit"),
                        );
                    }
                    for (k, p) in (0..16u64).zip(reads) {
                        match p.await.expect("read") {
                            Reply::Data(d) => {
                                assert_eq!(&d[..], &pattern(t * 1000 + round * 16 + k, 64)[..])
                            }
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                    lc.fetch_add(r, 0, 1).await.expect("fetch_add");
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("task");
        }
    });
    let total: u64 = regions
        .iter()
        .map(|r| threaded.fetch_add(r, 0, 0).expect("read counter"))
        .sum();
    assert_eq!(total, 16 * 20);
    c.shutdown().expect("shutdown");
}

/// What a hook was told: each tag, and whether its answer was an answer from the
/// server (a reply or the server's own refusal) rather than a lost request.
#[derive(Default)]
struct Told(parking_lot::Mutex<Vec<(u64, bool)>>);

impl camelot_client::AnswerHook for Told {
    fn answered(&self, tag: u64, answer: &Result<Reply, ClientError>) {
        let from_server = matches!(answer, Ok(_) | Err(ClientError::Server(_)));
        self.0.lock().push((tag, from_server));
    }
}

impl Told {
    fn tags(&self) -> Vec<u64> {
        self.0.lock().iter().map(|(t, _)| *t).collect()
    }
}

/// A hooked request's hook hears its answer — in the connection's order, before its
/// waiter has it — and hears a failure too, however the request fails: refused by the
/// server, timed out, or not sent at all.
#[test]
fn the_event_loop_face_tells_a_hook_of_every_answer_before_its_waiter() {
    let c = cluster(1, 1 << 20, None);
    let threaded = client(&c, ClientConfig::default()).expect("connect");
    let r = threaded.alloc_on(0, 64 << 10, None).expect("alloc");
    let rt = current_thread_runtime();
    rt.block_on(async {
        let lc = LoopClient::connect(ClusterMap::from_addrs(c.addrs()), ClientConfig::default())
            .await
            .expect("connect");
        let told = Arc::new(Told::default());
        let mut pending = Vec::new();
        for tag in 1..=64u64 {
            // Every eighth one out of the region's bounds: the server refuses it.
            let offset = if tag % 8 == 0 { 1 << 20 } else { tag * 8 };
            let op = r.write_op(offset, Bytes::from(tag.to_le_bytes().to_vec()));
            let p = lc
                .submit_hooked(r.node, op, told.clone(), tag)
                .await
                .expect("submit");
            pending.push((tag, p));
        }
        for (tag, p) in pending {
            let answer = p.await;
            assert_eq!(answer.is_ok(), tag % 8 != 0, "tag {tag}: {answer:?}");
            assert!(
                told.tags().contains(&tag),
                "answer {tag} was awaited before its hook heard of it"
            );
        }
        assert_eq!(
            told.tags(),
            (1..=64).collect::<Vec<_>>(),
            "not in the wire's order"
        );
        assert!(told.0.lock().iter().all(|(_, from_server)| *from_server));
    });
    c.shutdown().expect("shutdown");
    let (addr, server) = silent_server();
    rt.block_on(async {
        let lc = LoopClient::connect(
            ClusterMap::from_addrs(&[addr]),
            ClientConfig {
                request_timeout: Duration::from_millis(500),
                ..ClientConfig::default()
            },
        )
        .await
        .expect("handshake");
        let told = Arc::new(Told::default());
        let t = Instant::now();
        let p = lc
            .submit_hooked(0, Op::Ping, told.clone(), 7)
            .await
            .expect("submit");
        assert_timed_out(p.await, t);
        assert_eq!(
            *told.0.lock(),
            vec![(7, false)],
            "a timed-out request's hook"
        );
        // The timeout killed the connection; a submit to a node not in the map fails
        // before anything is queued, and still tells the hook.
        let e = lc.submit_hooked(9, Op::Ping, told.clone(), 8).await;
        assert!(e.is_err(), "a submit to an unknown node went through");
        assert_eq!(
            *told.0.lock(),
            vec![(7, false), (8, false)],
            "an unsent request's hook"
        );
    });
    server.join().expect("silent server");
}

/// Submits PINGs to a server that answers none until a submit waits longer than `wait`
/// (the in-flight bound reached, then the queue full), dropping that one; returns the
/// pending answers of the others. Panics if no submit ever waits.
async fn pings_until_a_submit_waits(
    lc: &LoopClient,
    wait: Duration,
) -> Vec<camelot_client::LoopPending> {
    let mut sent = Vec::new();
    for _ in 0..camelot_client::INFLIGHT_REQUESTS_MAX + 4096 {
        match tokio::time::timeout(wait, lc.submit(0, Op::Ping)).await {
            Ok(Ok(p)) => sent.push(p),
            Ok(Err(e)) => panic!("submit failed before the in-flight bound: {e}"),
            Err(_) => return sent,
        }
    }
    panic!("no submit ever waited");
}

/// A hooked submit whose future is dropped before its request is queued (here: the
/// queue is full behind a connection whose in-flight bound is reached) still tells its
/// hook, so a caller numbering its requests never waits for one that was never sent.
#[test]
fn a_hooked_submit_dropped_before_it_is_queued_tells_its_hook() {
    let (addr, server) = silent_server();
    let rt = current_thread_runtime();
    rt.block_on(async {
        let lc = LoopClient::connect(
            ClusterMap::from_addrs(&[addr]),
            ClientConfig {
                // The watchdog must not end the connection during the test.
                request_timeout: Duration::from_secs(60),
                queue_requests_max: 4,
                ..ClientConfig::default()
            },
        )
        .await
        .expect("handshake");
        // The silent server answers nothing: once INFLIGHT_REQUESTS_MAX are in flight
        // the writer waits, and then the queue stays full.
        let sent = pings_until_a_submit_waits(&lc, Duration::from_secs(2)).await;
        let told = Arc::new(Told::default());
        let dropped = tokio::time::timeout(
            Duration::from_millis(100),
            lc.submit_hooked(0, Op::Ping, told.clone(), 42),
        )
        .await;
        assert!(dropped.is_err(), "the submit went through");
        assert_eq!(*told.0.lock(), vec![(42, false)], "a dropped submit's hook");
        drop(sent);
    });
    // The runtime's end closes the connection, which lets the silent server go.
    drop(rt);
    server.join().expect("silent server");
}

/// A submit that finds EAGER_FLUSH_OPS queued writes them itself. Dropped while that
/// flush waits (here for in-flight room, behind a server that answers nothing), it must
/// not strand the other tasks' requests the flush took: every one still ends — here
/// failed, once the watchdog ends the connection.
#[test]
fn a_submit_dropped_during_its_own_flush_strands_no_other_request() {
    let (addr, server) = silent_server();
    let rt = current_thread_runtime();
    rt.block_on(async {
        let lc = LoopClient::connect(
            ClusterMap::from_addrs(&[addr]),
            ClientConfig {
                request_timeout: Duration::from_secs(2),
                ..ClientConfig::default()
            },
        )
        .await
        .expect("handshake");
        let queued = pings_until_a_submit_waits(&lc, Duration::from_millis(200)).await;
        let deadline = Duration::from_secs(20);
        for (i, p) in queued.into_iter().enumerate() {
            match tokio::time::timeout(deadline, p).await {
                Ok(_) => {}
                Err(_) => panic!("request {i} never ended: stranded by the dropped flush"),
            }
        }
    });
    drop(rt);
    server.join().expect("silent server");
}

#[test]
fn the_event_loop_face_times_out_and_fails_on_a_dead_node() {
    let (addr, server) = silent_server();
    let rt = current_thread_runtime();
    rt.block_on(async {
        let lc = LoopClient::connect(
            ClusterMap::from_addrs(&[addr]),
            ClientConfig {
                request_timeout: Duration::from_millis(500),
                ..ClientConfig::default()
            },
        )
        .await
        .expect("handshake");
        let t = Instant::now();
        assert_timed_out(lc.call(0, Op::Ping).await, t);
    });
    server.join().expect("silent server");

    // A node that goes away: requests fail with an error instead of hanging, and a wrong
    // token is refused at connect.
    let c = cluster(1, 1 << 20, Some("sesame"));
    let map = ClusterMap::from_addrs(c.addrs());
    let lc = rt.block_on(async {
        match LoopClient::connect(map.clone(), ClientConfig::default()).await {
            Err(ClientError::Auth { .. }) => {}
            other => panic!("expected an auth error, got {:?}", other.err()),
        }
        let lc = LoopClient::connect(
            map,
            ClientConfig {
                token: Some(b"sesame".to_vec()),
                ..ClientConfig::default()
            },
        )
        .await
        .expect("connect");
        assert!(matches!(lc.call(0, Op::Ping).await, Ok(Reply::Pong)));
        lc
    });
    c.shutdown().expect("shutdown");
    rt.block_on(async {
        let t = Instant::now();
        assert!(lc.call(0, Op::Ping).await.is_err());
        assert!(t.elapsed() < Duration::from_secs(5));
    });
}

/// After a restart, many tasks find the connection dead at once and reconnect together;
/// each must end up served, and all on one connection (the others' are closed).
#[test]
fn the_event_loop_face_reconnects_after_a_server_restart() {
    let c = cluster(1, 1 << 20, None);
    let addr = c.addrs()[0];
    let rt = current_thread_runtime();
    let lc = rt.block_on(async {
        let lc = LoopClient::connect(ClusterMap::from_addrs(&[addr]), ClientConfig::default())
            .await
            .expect("connect");
        assert!(matches!(lc.call(0, Op::Ping).await, Ok(Reply::Pong)));
        lc
    });
    c.shutdown().expect("shutdown");
    let restarted = restart_on(addr);
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..16 {
            let lc = lc.clone();
            tasks.spawn(async move {
                loop {
                    match lc.call(0, Op::Ping).await {
                        Ok(Reply::Pong) => return,
                        Ok(other) => panic!("unexpected {other:?}"),
                        Err(e) if Instant::now() < deadline => assert!(
                            is_reconnect_error(&e),
                            "unexpected error while reconnecting: {e}"
                        ),
                        Err(e) => panic!("no reconnect within 10 s: {e}"),
                    }
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("task");
        }
    });
    // The race's losers close theirs; the server sees those closes a moment later.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let open = stat(&restarted.stats()[0], "connections_current");
        if open == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} connections still open after the reconnect race"
        );
        thread::sleep(Duration::from_millis(10));
    }
    drop(lc);
    restarted.shutdown().expect("shutdown");
}

#[test]
fn both_faces_refuse_the_same_impossible_settings() {
    let map = ClusterMap {
        epoch: 0,
        nodes: vec![],
    };
    let bad = [
        ClientConfig {
            frames_ahead: 0,
            ..ClientConfig::default()
        },
        ClientConfig {
            frames_ahead: camelot_client::FRAMES_AHEAD_MAX + 1,
            ..ClientConfig::default()
        },
        ClientConfig {
            connections_per_node: 0,
            ..ClientConfig::default()
        },
        ClientConfig {
            batch_ops_max: 0,
            ..ClientConfig::default()
        },
    ];
    let rt = current_thread_runtime();
    for config in bad {
        let threads = Client::connect(map.clone(), config.clone()).err();
        let tasks = rt.block_on(LoopClient::connect(map.clone(), config)).err();
        for refused in [threads, tasks] {
            assert!(
                matches!(refused, Some(ClientError::InvalidArgument(_))),
                "{refused:?}"
            );
        }
    }
}

fn client_as(c: &DevCluster, principal: &str) -> Client {
    client(
        c,
        ClientConfig {
            principal: Some(principal.into()),
            ..ClientConfig::default()
        },
    )
    .expect("connect")
}

#[test]
fn private_regions_are_their_owners_and_shared_ones_are_freed_only_by_them() {
    let c = cluster(2, 1 << 20, None);
    let alice = client_as(&c, "alice");
    let bob = client_as(&c, "bob");
    let private = alice.alloc(4096, Some("alice-private")).expect("alloc");
    assert_eq!(private.mode, AccessMode::Private, "alloc's default");
    let shared = alice
        .alloc_with(4096, Some("alice-shared"), AccessMode::Shared)
        .expect("alloc shared");
    assert_eq!(shared.mode, AccessMode::Shared);
    alice.write(&private, 0, &b"mine"[..]).expect("write");
    alice.write(&shared, 0, &b"ours"[..]).expect("write");

    // Bob holding alice's private region's id (say, guessed) changes nothing.
    let code = |e: ClientError| e.code();
    assert_eq!(
        bob.read(&private, 0, 4).map_err(code).unwrap_err(),
        Some(ErrorCode::NoSuchRegion)
    );
    assert_eq!(
        bob.write(&private, 0, &b"evil"[..])
            .map_err(code)
            .unwrap_err(),
        Some(ErrorCode::NoSuchRegion)
    );
    assert_eq!(
        bob.free(&private).map_err(code).unwrap_err(),
        Some(ErrorCode::NoSuchRegion)
    );
    assert_eq!(
        bob.lookup("alice-private").map_err(code).unwrap_err(),
        Some(ErrorCode::NameNotFound)
    );
    // The shared one he finds, reads and writes, but cannot free.
    let found = bob.lookup("alice-shared").expect("lookup shared");
    assert_eq!(found.id, shared.id);
    assert_eq!(&bob.read(&found, 0, 4).expect("read")[..], b"ours");
    bob.write(&found, 4, &b"+bob"[..]).expect("write shared");
    assert_eq!(
        bob.free(&found).map_err(code).unwrap_err(),
        Some(ErrorCode::Forbidden)
    );
    let bobs_view: Vec<u64> = c
        .addrs()
        .iter()
        .enumerate()
        .flat_map(|(n, _)| bob.list(n as u32).expect("list"))
        .map(|r| r.id)
        .collect();
    assert_eq!(bobs_view, vec![shared.id]);

    assert_eq!(&alice.read(&private, 0, 4).expect("read")[..], b"mine");
    assert_eq!(&alice.read(&shared, 0, 8).expect("read")[..], b"ours+bob");
    alice.free(&private).expect("free own private");
    alice.free(&shared).expect("free own shared");

    // A second client with alice's principal (a restart) finds what the first left.
    let kept = alice.alloc(4096, Some("kept")).expect("alloc");
    drop(alice);
    let again = client_as(&c, "alice");
    assert_eq!(again.lookup("kept").expect("found again").id, kept.id);
    again.free(&kept).expect("free");
    c.shutdown().expect("shutdown");
}

#[test]
fn quota_exceeded_is_its_own_error() {
    let c = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 1 << 20,
        worker_threads: 2,
        quota: Quota {
            bytes_max: 64 << 10,
            regions_max: 3,
        },
        ..DevClusterConfig::default()
    })
    .expect("dev cluster starts");
    let alice = client_as(&c, "alice");
    let e = alice
        .alloc(128 << 10, None)
        .expect_err("past the byte quota");
    assert_eq!(e.code(), Some(ErrorCode::QuotaExceeded), "{e}");
    let held: Vec<Region> = (0..3)
        .map(|_| alice.alloc(4096, None).expect("within quota"))
        .collect();
    let e = alice.alloc(4096, None).expect_err("past the region quota");
    assert_eq!(e.code(), Some(ErrorCode::QuotaExceeded), "{e}");
    // Another principal is not affected, and the whole memory cap is a different error.
    let bob = client_as(&c, "bob");
    bob.alloc(4096, None).expect("bob's own quota");
    alice.free(&held[0]).expect("free");
    alice.alloc(4096, None).expect("room again after free");
    c.shutdown().expect("shutdown");
}

#[test]
fn region_ids_cannot_be_guessed_from_each_other() {
    let c = cluster(1, 1 << 20, None);
    let cl = client(&c, ClientConfig::default()).expect("connect");
    let ids: Vec<u64> = (0..16)
        .map(|_| cl.alloc(1, None).expect("alloc").id)
        .collect();
    for w in ids.windows(2) {
        assert!(w[0].abs_diff(w[1]) > 1 << 32, "ids {} then {}", w[0], w[1]);
    }
    c.shutdown().expect("shutdown");
}

#[test]
fn an_overlong_principal_is_refused_before_connecting() {
    let c = cluster(1, 1 << 20, None);
    let r = client(
        &c,
        ClientConfig {
            principal: Some("p".repeat(65)),
            ..ClientConfig::default()
        },
    );
    assert!(matches!(r, Err(ClientError::InvalidArgument(_))));
    c.shutdown().expect("shutdown");
}
