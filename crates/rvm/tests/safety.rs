//! What must never happen silently: a reopen with other geometry dropping commits, two
//! writers both having commits acknowledged, a token lost on the way to the server.

mod common;

use camelot_rvm::{BackendConfig, Config, Rvm, RvmError, Segment};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use common::{Fixture, NODE_MEMORY_BYTES};

const MIB: u64 = 1 << 20;

fn commit_u64(rvm: &Rvm, s: &Segment, off: u64, v: u64) -> Result<(), RvmError> {
    let mut t = rvm.begin();
    t.set_range(s, off, 8)?;
    t.write_u64(s, off, v)?;
    t.commit()
}

fn pool_with_log(f: &Fixture, log_bytes: u64) -> BackendConfig {
    match f.backend() {
        BackendConfig::Pool { servers, token, .. } => BackendConfig::Pool {
            servers,
            token,
            log_bytes,
        },
        other => other,
    }
}

/// Commits spread over more than 4 MiB of log, reopened with a smaller and a larger
/// `log_bytes`: either every commit is there or the open fails naming both sizes. (The
/// old code freed a log smaller than asked for, and scanned only the asked-for bytes of a
/// larger one: both reopens "succeeded" without the commits.)
fn reopen_with_other_log_bytes(kind: &str) {
    let f = Fixture::start(kind);
    let cfg = |log_bytes, recover| {
        let mut c = Config::new(pool_with_log(&f, log_bytes), "geom").recover(recover);
        c.truncate_log_bytes = 64 * MIB; // everything stays in the log
        c.background_truncation = false;
        c
    };
    let rvm = Rvm::open(cfg(8 * MIB, false)).expect("create with 8 MiB");
    let s = rvm.alloc("s", 2 * MIB).expect("alloc");
    for n in 0..3u64 {
        let mut t = rvm.begin();
        t.set_range(&s, 0, 2 * MIB).expect("declare");
        t.write(&s, 0, &vec![n as u8 + 1; 2 * MIB as usize])
            .expect("write");
        t.commit().expect("commit");
    }
    commit_u64(&rvm, &s, 8, 4242).expect("commit");
    drop(s);
    drop(rvm);
    for other in [4 * MIB, 16 * MIB] {
        match Rvm::open(cfg(other, true)) {
            Err(RvmError::Geometry {
                stored, requested, ..
            }) => {
                assert_eq!((stored, requested), (8 * MIB, other));
                let msg = Rvm::open(cfg(other, true)).err().map(|e| e.to_string());
                let msg = msg.unwrap_or_default();
                assert!(
                    msg.contains(&(8 * MIB).to_string()) && msg.contains(&other.to_string()),
                    "the error names both sizes: {msg}"
                );
            }
            Ok(rvm) => {
                let s = rvm.segment("s").expect("segment kept");
                assert_eq!(s.read_u64(8).expect("read"), 4242, "commit lost");
                panic!("reopening with {other} bytes succeeded: must fail loudly");
            }
            Err(e) => panic!("reopening with {other} bytes: unexpected {e}"),
        }
    }
    // The stored size still works and has everything.
    let rvm = Rvm::open(cfg(8 * MIB, true)).expect("reopen with the stored size");
    let s = rvm.segment("s").expect("recovered");
    assert_eq!(s.read_u64(8).expect("read"), 4242);
    assert_eq!(s.read(MIB, 1).expect("read"), vec![3]);
    drop(s);
    drop(rvm);
    // Without recovery the instance is discarded, so another size is fine, and it sticks.
    let rvm = Rvm::open(cfg(16 * MIB, false)).expect("start over with 16 MiB");
    let s = rvm.alloc("t", 4096).expect("alloc");
    commit_u64(&rvm, &s, 0, 7).expect("commit");
    drop(s);
    drop(rvm);
    assert!(matches!(
        Rvm::open(cfg(8 * MIB, true)),
        Err(RvmError::Geometry { stored, .. }) if stored == 16 * MIB
    ));
    let rvm = Rvm::open(cfg(16 * MIB, true)).expect("reopen with 16 MiB");
    assert_eq!(rvm.segment("t").expect("t").read_u64(0).expect("read"), 7);
}

#[test]
fn pool_reopen_with_other_log_bytes_fails_loudly() {
    reopen_with_other_log_bytes("pool");
}

#[test]
fn mirrored_pool_reopen_with_other_log_bytes_fails_loudly() {
    reopen_with_other_log_bytes("pool-mirrored");
}

/// Two openers of one name, the first still alive: the second either fails to open or
/// fences the first, whose next commit then fails; the survivor's commits are all there,
/// and never both writers' commits succeed after the second open. Covers both orders:
/// the fenced writer committing before and after the new owner's first commit.
fn second_opener_fences_the_first(kind: &str) {
    let f = Fixture::start(kind);
    let cfg = |recover| {
        let mut c = f.config("fence", recover);
        c.background_truncation = false;
        c.truncate_log_bytes = 64 << 10;
        c
    };
    let a = Rvm::open(cfg(false)).expect("first open");
    let sa = a.alloc("s", 8192).expect("alloc");
    commit_u64(&a, &sa, 0, 1).expect("first writer commits alone");
    let b = match Rvm::open(cfg(true)) {
        Err(RvmError::Fenced(why)) => {
            // Refused while the first is open (the file backend's lock): the first keeps
            // writing, and a second open works once it is gone.
            commit_u64(&a, &sa, 0, 2).expect("the first writer keeps its instance");
            drop(sa);
            drop(a);
            let b = Rvm::open(cfg(true)).unwrap_or_else(|e| panic!("after close ({why}): {e}"));
            let sb = b.segment("s").expect("recovered");
            assert_eq!(sb.read_u64(0).expect("read"), 2);
            return;
        }
        Err(e) => panic!("second open: unexpected {e}"),
        Ok(b) => b,
    };
    let sb = b
        .segment("s")
        .expect("the second opener recovers the first's commit");
    assert_eq!(sb.read_u64(0).expect("read"), 1);
    // The old writer commits first, then the new one, then the old one again.
    let old_first = commit_u64(&a, &sa, 8, 100);
    commit_u64(&b, &sb, 16, 200).expect("the new owner commits");
    let old_again = commit_u64(&a, &sa, 24, 300);
    assert!(
        matches!(
            old_first,
            Err(RvmError::Fenced(_)) | Err(RvmError::Failed(_))
        ),
        "the fenced writer's commit returned {old_first:?}"
    );
    assert!(old_again.is_err(), "a fenced writer committed again");
    // Enough commits by the new owner to truncate: its home writes must hold too.
    for n in 0..200u64 {
        commit_u64(&b, &sb, 4096 + (n % 64) * 8, n).expect("the new owner keeps committing");
    }
    drop(sa);
    drop(a);
    drop(sb);
    drop(b);
    let c = Rvm::open(cfg(true)).expect("recover");
    let s = c.segment("s").expect("recovered");
    assert_eq!(
        s.read_u64(16).expect("read"),
        200,
        "the new owner's commit was lost"
    );
    assert_eq!(
        s.read_u64(24).expect("read"),
        0,
        "a fenced commit reached the log"
    );
    for n in 136..200u64 {
        assert_eq!(s.read_u64(4096 + (n % 64) * 8).expect("read"), n);
    }
}

#[test]
fn pool_second_opener_fences_the_first() {
    second_opener_fences_the_first("pool");
}

#[test]
fn mirrored_pool_second_opener_fences_the_first() {
    second_opener_fences_the_first("pool-mirrored");
}

#[test]
fn redis_second_opener_fences_the_first() {
    second_opener_fences_the_first("redis");
}

#[test]
fn file_second_opener_is_refused_while_the_first_is_open() {
    second_opener_fences_the_first("file");
}

/// `pool://:TOKEN@…` reaches a server that demands the token (issue 15): parsed, the
/// token is kept, and an open with it works where one without it is refused.
#[test]
fn pool_url_token_reaches_a_tokened_server() {
    let node = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: NODE_MEMORY_BYTES,
        worker_threads: 1,
        token: Some(b"s3cret".to_vec()),
        ..DevClusterConfig::default()
    })
    .expect("dev cluster starts");
    let addr = node.addrs()[0];
    let with = BackendConfig::parse(&format!("pool://:s3cret@{addr}")).expect("parse");
    let BackendConfig::Pool { token, .. } = &with else {
        panic!("not a pool: {with:?}")
    };
    assert_eq!(token.as_deref(), Some(&b"s3cret"[..]));
    let mut cfg = Config::new(with, "tok");
    if let BackendConfig::Pool { log_bytes, .. } = &mut cfg.backend {
        *log_bytes = common::POOL_LOG_BYTES;
    }
    let rvm = Rvm::open(cfg).expect("open with the token");
    let s = rvm.alloc("s", 4096).expect("alloc");
    commit_u64(&rvm, &s, 0, 5).expect("commit");
    let mut without = Config::new(
        BackendConfig::parse(&format!("pool://{addr}")).expect("parse"),
        "tok2",
    );
    if let BackendConfig::Pool { log_bytes, .. } = &mut without.backend {
        *log_bytes = common::POOL_LOG_BYTES;
    }
    assert!(
        Rvm::open(without).is_err(),
        "a tokened server let us in without it"
    );
}

/// `wait_replicas=1` against a Redis without replicas: the commit fails (WAIT answers 0)
/// instead of returning as if a replica had it.
#[test]
fn redis_wait_replicas_fails_without_replicas() {
    let r = common::Redis::start();
    let backend =
        BackendConfig::parse(&format!("redis://{}?wait_replicas=1", r.addr)).expect("parse");
    assert_eq!(
        backend,
        BackendConfig::Redis {
            addr: r.addr,
            wait_replicas: 1
        }
    );
    // Opening writes a catalog, so it is the first change to wait and fail.
    match Rvm::open(Config::new(backend, "wait")).and_then(|rvm| rvm.alloc("s", 4096)) {
        Err(RvmError::Unavailable(why)) => assert!(why.contains("WAIT"), "{why}"),
        other => panic!("a commit without the replica it waits for: {other:?}"),
    }
}

/// One inline command to a redis-server and its reply's text: a status, integer or error
/// line, or a bulk string's body (what INFO answers). Bounded by a 5 s read timeout.
fn redis_line(addr: std::net::SocketAddr, command: &str) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to redis");
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .expect("timeout");
    s.write_all(format!("{command}\r\n").as_bytes())
        .expect("send");
    let mut r = BufReader::new(s);
    let mut head = String::new();
    r.read_line(&mut head).expect("reply");
    let Some(len) = head.strip_prefix('$') else {
        return head.trim_end().to_string();
    };
    let len: usize = len.trim().parse().expect("bulk length");
    let mut body = vec![0; len];
    r.read_exact(&mut body).expect("bulk body");
    String::from_utf8_lossy(&body).into_owned()
}

/// `wait_replicas=1` with a real replica (a second redis-server started with
/// `--replicaof`): every commit returns, and once the primary is SIGKILLed and the replica
/// promoted, recovery from the replica alone finds every one of them — what WAIT promised.
#[test]
fn redis_wait_replicas_commits_reach_a_real_replica() {
    use camelot_testkit::RedisServer;
    use std::time::{Duration, Instant};
    // Diskless full sync without its default 5 s wait for more replicas.
    let mut primary =
        RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]).expect("redis-server starts");
    let port = primary.addr().port().to_string();
    let replica =
        RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]).expect("a replica starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !redis_line(replica.addr(), "INFO replication").contains("master_link_status:up") {
        assert!(Instant::now() < deadline, "the replica never synced");
        std::thread::sleep(Duration::from_millis(20));
    }

    let backend = BackendConfig::parse(&format!("redis://{}?wait_replicas=1", primary.addr()))
        .expect("parse");
    let rvm = Rvm::open(Config::new(backend, "waited").recover(true)).expect("open");
    let seg = rvm.alloc("s", 4096).expect("alloc");
    for i in 0..20u64 {
        let mut t = rvm.begin();
        t.set_range(&seg, i * 8, 8).expect("range");
        t.write_u64(&seg, i * 8, 1000 + i).expect("write");
        t.commit().expect("a commit WAIT confirmed");
    }
    rvm.truncate().expect("truncation waits too");
    // The commit really waits for the replica: stopped (SIGSTOP), the replica holds it
    // back; continued, it lets it return. A commit that skipped WAIT returns at once.
    let signal = |sig: &str| {
        let pid = replica.process().pid().to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status();
        assert!(ok.is_ok_and(|s| s.success()), "kill {sig} {pid}");
    };
    signal("-STOP");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut t = rvm.begin();
            let done = t
                .set_range(&seg, 20 * 8, 8)
                .and_then(|()| t.write_u64(&seg, 20 * 8, 7))
                .and_then(|()| t.commit());
            let _ = tx.send(done);
        });
        let early = rx.recv_timeout(Duration::from_millis(500));
        signal("-CONT");
        assert!(
            early.is_err(),
            "the commit returned while its only replica was stopped: {early:?}"
        );
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the commit returns once the replica runs")
            .expect("and succeeds");
    });
    std::mem::forget(rvm); // no goodbye writes: only what the commits sent counts

    primary.process_mut().kill().expect("SIGKILL the primary");
    assert_eq!(redis_line(replica.addr(), "REPLICAOF NO ONE"), "+OK");
    let backend = BackendConfig::parse(&format!("redis://{}", replica.addr())).expect("parse");
    let rvm = Rvm::open(Config::new(backend, "waited").recover(true)).expect("recover");
    let seg = rvm.segment("s").expect("the segment is on the replica");
    for i in 0..20u64 {
        assert_eq!(seg.read_u64(i * 8).expect("read"), 1000 + i, "commit {i}");
    }
    assert_eq!(seg.read_u64(20 * 8).expect("read"), 7, "the last commit");
}

/// A pool server without room for an instance's log: the open fails naming the region,
/// the bytes it needs and the bytes the server has free, not a bare OUT_OF_MEMORY.
#[test]
fn pool_open_without_room_names_bytes_needed_and_free() {
    let node = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 4 * MIB,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster starts");
    let backend = BackendConfig::Pool {
        servers: node.addrs().to_vec(),
        token: None,
        log_bytes: 8 * MIB,
    };
    match Rvm::open(Config::new(backend, "tight")) {
        Err(e @ RvmError::NoRoom { .. }) => {
            let RvmError::NoRoom {
                region,
                needed_bytes,
                free_bytes,
                cap_bytes,
            } = &e
            else {
                unreachable!()
            };
            assert_eq!(region, "rvm/tight/log");
            assert_eq!(*needed_bytes, 8 * MIB);
            assert_eq!(cap_bytes, &(4 * MIB).to_string());
            // Only the header page is allocated before the log.
            assert_eq!(free_bytes, &(4 * MIB - 4096).to_string());
            let msg = e.to_string();
            for part in [&(8 * MIB).to_string(), free_bytes, "rvm/tight/log"] {
                assert!(msg.contains(part), "{msg:?} does not name {part}");
            }
        }
        Err(e) => panic!("wrong error for a full server: {e}"),
        Ok(_) => panic!("an 8 MiB log fitted in a 4 MiB server"),
    }
}

/// Protocol-2 writers moved the log to `rvm/NAME/log.EPOCH` at a new owner's first change;
/// a crash mid-move left either the new region (not yet named by the header) or the old one
/// (not yet freed). Both leftovers are built here exactly as such a crash leaves them, and
/// an open must free them while recovering every commit from the log the header names.
#[test]
fn pool_open_frees_log_regions_an_interrupted_move_left() {
    use camelot_client::{Client, ClientConfig, ClusterMap};
    let f = Fixture::start("pool");
    let Fixture::Pool(node) = &f else {
        unreachable!()
    };
    let client = Client::connect(
        ClusterMap::from_addrs(node.addrs()),
        ClientConfig::default(),
    )
    .expect("connect");
    let rvm = Rvm::open(f.config("orph", false)).expect("create");
    let s = rvm.alloc("s", 4096).expect("alloc");
    commit_u64(&rvm, &s, 0, 7).expect("commit");
    drop(s);
    drop(rvm);
    let log = client.lookup("rvm/orph/log").expect("the log");
    let exists = |name: &str| client.lookup(name).is_ok();

    // Crash after allocating (and partly filling) the new region, before the header named it.
    let orphan = client
        .alloc_on(0, log.size, Some("rvm/orph/log.9"))
        .expect("alloc the leftover");
    client
        .write(&orphan, 0, bytes::Bytes::from_static(b"half a copy"))
        .expect("write");
    let rvm = Rvm::open(f.config("orph", true)).expect("recover");
    let s = rvm.segment("s").expect("segment");
    assert_eq!(s.read_u64(0).expect("read"), 7);
    assert!(!exists("rvm/orph/log.9"), "the unnamed new log was kept");
    assert!(exists("rvm/orph/log"), "the live log was freed");
    commit_u64(&rvm, &s, 8, 8).expect("commit");
    drop(s);
    drop(rvm);

    // Crash after the copy and the header's new generation, before the old region was freed.
    let old = client.lookup("rvm/orph/log").expect("the log");
    let moved = client
        .alloc_on(0, old.size, Some("rvm/orph/log.12"))
        .expect("alloc the new log");
    let whole = client
        .read(&old, 0, 1 << 20)
        .expect("read the log's first MiB");
    client.write(&moved, 0, whole).expect("copy");
    let hdr = client.lookup("rvm/orph/hdr").expect("header");
    client
        .write(
            &hdr,
            32,
            bytes::Bytes::copy_from_slice(&12u64.to_le_bytes()),
        )
        .expect("name generation 12");
    let rvm = Rvm::open(f.config("orph", true)).expect("recover from the moved log");
    let s = rvm.segment("s").expect("segment");
    assert_eq!(
        (s.read_u64(0).expect("read"), s.read_u64(8).expect("read")),
        (7, 8)
    );
    assert!(!exists("rvm/orph/log"), "the old log was kept");
    assert!(exists("rvm/orph/log.12"), "the live log was freed");
    commit_u64(&rvm, &s, 16, 9).expect("commit into the adopted log");
    drop(s);
    drop(rvm);
    let rvm = Rvm::open(f.config("orph", true)).expect("recover again");
    let s = rvm.segment("s").expect("segment");
    assert_eq!(s.read_u64(16).expect("read"), 9);
}
