//! The one test suite every backend passes: pool, mirrored pool, redis and file, each on
//! real servers (or a real directory).

mod common;

use camelot_rvm::{limits, Rvm, RvmError, Segment};
use common::Fixture;
use rand::{Rng, SeedableRng};

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen()).collect()
}

/// Commits `data` at `off` of `s` as a transaction of its own.
fn commit_one_write(rvm: &Rvm, s: &Segment, off: u64, data: &[u8]) {
    let mut t = rvm.begin();
    t.set_range(s, off, data.len() as u64).expect("declare");
    t.write(s, off, data).expect("write");
    t.commit().expect("commit");
}

fn commit_and_recover(f: &Fixture) {
    let rvm = Rvm::open(f.config("rt", false)).expect("open");
    let a = rvm.alloc("alpha", 5000).expect("alloc");
    assert_eq!(a.len(), 8192, "rounded to pages");
    assert_eq!(a.addr() % limits::PAGE_BYTES, 0, "page-aligned");
    let b = rvm.alloc("beta", 3 << 20).expect("alloc");
    // Spans more than one I/O chunk, so chunked writes and reads are exercised.
    let big = pattern(1, (2 << 20) + 123);
    let mut t = rvm.begin();
    t.set_range(&a, 100, 16).expect("declare");
    t.write(&a, 100, b"sixteen bytes!!!").expect("write");
    t.set_range(&b, 4000, big.len() as u64).expect("declare");
    t.write(&b, 4000, &big).expect("write");
    t.commit().expect("commit");
    // Uncommitted changes after the last commit must not survive.
    let mut t = rvm.begin();
    t.set_range(&a, 0, 8).expect("declare");
    t.write_u64(&a, 0, 99).expect("write");
    // Still open when the instance closes (a leaked one would keep the file backend's
    // lock, like a live process).
    drop(rvm);
    drop(t);

    let rvm = Rvm::open(f.config("rt", true)).expect("recover");
    let a = rvm.segment("alpha").expect("alpha recovered");
    let b = rvm.segment("beta").expect("beta recovered");
    assert_eq!(a.read(100, 16).expect("read"), b"sixteen bytes!!!");
    assert_eq!(
        a.read_u64(0).expect("read"),
        0,
        "uncommitted write survived"
    );
    assert_eq!(b.read(4000, big.len()).expect("read"), big);
    assert_eq!(b.read(0, 4000).expect("read"), vec![0u8; 4000]);
    rvm.truncate().expect("truncate");
    assert_eq!(rvm.log_bytes(), 0);
    drop(rvm);
    // After truncation the same state comes from the homes alone.
    let rvm = Rvm::open(f.config("rt", true)).expect("recover");
    let b = rvm.segment("beta").expect("beta recovered");
    assert_eq!(b.read(4000, big.len()).expect("read"), big);
    drop(rvm);
    // Without recovery the instance starts empty.
    let rvm = Rvm::open(f.config("rt", false)).expect("fresh");
    assert!(rvm.segments().is_empty());
    drop(rvm);
    let rvm = Rvm::open(f.config("rt", true)).expect("recover");
    assert!(
        rvm.segments().is_empty(),
        "a fresh open discards what was there"
    );
}

fn abort_restores_exactly(f: &Fixture) {
    let rvm = Rvm::open(f.config("abort", false)).expect("open");
    let s = rvm.alloc("s", 4 * 4096).expect("alloc");
    let before = pattern(2, 4 * 4096);
    let mut t = rvm.begin();
    t.set_range(&s, 0, before.len() as u64).expect("declare");
    t.write(&s, 0, &before).expect("write");
    t.commit().expect("commit");
    let mut t = rvm.begin();
    // Overlapping declarations by one transaction are fine and still undo exactly.
    t.set_range(&s, 10, 5000).expect("declare");
    t.write(&s, 10, &pattern(3, 5000)).expect("write");
    t.set_range(&s, 4000, 9000).expect("overlap own");
    t.write(&s, 4000, &pattern(4, 9000)).expect("write");
    assert_ne!(s.read(0, before.len()).expect("read"), before);
    t.abort();
    assert_eq!(s.read(0, before.len()).expect("read"), before);
    {
        let mut t = rvm.begin();
        t.set_range(&s, 0, 64).expect("declare");
        t.write(&s, 0, &[0xEE; 64]).expect("write");
        // Dropped without commit: aborts.
    }
    assert_eq!(s.read(0, before.len()).expect("read"), before);
    drop(rvm);
    let rvm = Rvm::open(f.config("abort", true)).expect("recover");
    let s = rvm.segment("s").expect("recovered");
    assert_eq!(s.read(0, before.len()).expect("read"), before);
}

fn free_takes_effect_at_commit(f: &Fixture) {
    let rvm = Rvm::open(f.config("free", false)).expect("open");
    let s = rvm.alloc("doomed", 4096).expect("alloc");
    rvm.alloc("kept", 4096).expect("alloc");
    let mut t = rvm.begin();
    t.free("doomed").expect("free");
    assert!(rvm.segment("doomed").is_some(), "vanished before commit");
    t.abort();
    assert!(rvm.segment("doomed").is_some(), "vanished after abort");
    let mut t = rvm.begin();
    t.free("doomed").expect("free");
    t.commit().expect("commit");
    assert!(rvm.segment("doomed").is_none(), "still there after commit");
    assert!(matches!(s.read(0, 1), Err(RvmError::SegmentFreed { .. })));
    let mut t = rvm.begin();
    assert!(matches!(
        t.set_range(&s, 0, 1),
        Err(RvmError::SegmentFreed { .. })
    ));
    assert!(matches!(t.free("doomed"), Err(RvmError::NoSuchTag(_))));
    drop(t);
    drop(rvm);
    let rvm = Rvm::open(f.config("free", true)).expect("recover");
    assert!(rvm.segment("doomed").is_none(), "a freed tag came back");
    assert!(rvm.segment("kept").is_some());
    let again = rvm.alloc("doomed", 4096).expect("the tag is free again");
    assert_eq!(again.read_u64(0).expect("read"), 0);
    rvm.truncate().expect("truncate");
    drop(rvm);
    let rvm = Rvm::open(f.config("free", true)).expect("recover");
    let tags: Vec<String> = rvm.segments().iter().map(|s| s.tag().to_owned()).collect();
    assert_eq!(tags, vec!["doomed".to_string(), "kept".to_string()]);
}

fn concurrent_disjoint_and_overlap_conflicts(f: &Fixture) {
    const THREADS: u64 = 4;
    const COMMITS: u64 = 40;
    let rvm = Rvm::open(f.config("conc", false)).expect("open");
    let s = rvm.alloc("shared", THREADS * 4096).expect("alloc");
    std::thread::scope(|scope| {
        for i in 0..THREADS {
            let (rvm, s) = (&rvm, s.clone());
            scope.spawn(move || {
                for n in 1..=COMMITS {
                    let mut t = rvm.begin();
                    t.set_range(&s, i * 4096, 16)
                        .expect("disjoint ranges never conflict");
                    t.write_u64(&s, i * 4096, n).expect("write");
                    t.write_u64(&s, i * 4096 + 8, n * 1000 + i).expect("write");
                    t.commit().expect("commit");
                }
            });
        }
    });
    let mut t1 = rvm.begin();
    t1.set_range(&s, 100, 50).expect("declare");
    let mut t2 = rvm.begin();
    assert!(matches!(
        t2.set_range(&s, 149, 10),
        Err(RvmError::RangeConflict { .. })
    ));
    t2.set_range(&s, 150, 10).expect("adjacent is fine");
    assert!(matches!(
        t2.free("shared"),
        Err(RvmError::RangeConflict { .. })
    ));
    assert!(matches!(
        t2.write(&s, 100, b"x"),
        Err(RvmError::NotDeclared { .. })
    ));
    t1.abort();
    t2.set_range(&s, 149, 10).expect("released by abort");
    t2.abort();
    drop(rvm);
    let rvm = Rvm::open(f.config("conc", true)).expect("recover");
    let s = rvm.segment("shared").expect("recovered");
    for i in 0..THREADS {
        assert_eq!(s.read_u64(i * 4096).expect("read"), COMMITS);
        assert_eq!(s.read_u64(i * 4096 + 8).expect("read"), COMMITS * 1000 + i);
    }
}

fn log_is_truncated(f: &Fixture) {
    const THRESHOLD_BYTES: u64 = 64 << 10;
    let mut cfg = f.config("trunc", false);
    cfg.truncate_log_bytes = THRESHOLD_BYTES;
    cfg.background_truncation = false;
    let rvm = Rvm::open(cfg.clone()).expect("open");
    let s = rvm.alloc("s", 64 * 4096).expect("alloc");
    let mut log_bytes_max = 0;
    for n in 0..300u64 {
        let mut t = rvm.begin();
        let off = (n % 64) * 4096;
        t.set_range(&s, off, 1024).expect("declare");
        t.write(&s, off, &pattern(n, 1024)).expect("write");
        t.commit().expect("commit");
        log_bytes_max = log_bytes_max.max(rvm.log_bytes());
    }
    assert!(
        log_bytes_max < THRESHOLD_BYTES + 2048,
        "log grew to {log_bytes_max} bytes past a {THRESHOLD_BYTES}-byte threshold"
    );
    drop(rvm);
    // Background truncation: the log shrinks without anyone asking.
    cfg.background_truncation = true;
    cfg.recover = true;
    let rvm = Rvm::open(cfg).expect("recover");
    let s = rvm.segment("s").expect("recovered");
    for n in 236..300u64 {
        assert_eq!(
            s.read((n % 64) * 4096, 1024).expect("read"),
            pattern(n, 1024)
        );
    }
    for n in 0..200u64 {
        let mut t = rvm.begin();
        t.set_range(&s, 0, 1024).expect("declare");
        t.write(&s, 0, &pattern(n, 1024)).expect("write");
        t.commit().expect("commit");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while rvm.log_bytes() >= THRESHOLD_BYTES {
        assert!(
            std::time::Instant::now() < deadline,
            "background truncation never ran"
        );
        std::thread::yield_now();
    }
}

/// Lazy commits reach the backend at `flush` (and with the next plain commit), checked
/// across a SIGKILL of the process that made them, so nothing but the backend can carry
/// them: a `flush` that did nothing fails this (the `noflush` run shows the check sees
/// that difference), and so would a lazy commit that was written at once.
fn lazy_commits_flush(f: &Fixture) {
    let run = |name: &str, phase: &str| {
        let args = [
            f.spec(),
            name.to_owned(),
            common::POOL_LOG_BYTES.to_string(),
        ];
        let mut args: Vec<String> = std::iter::once("lazy".to_owned()).chain(args).collect();
        args.push(phase.to_owned());
        let mut w = common::LineChild::writer(&args, &[]);
        assert_eq!(w.line(), "parked", "lazy writer {phase}");
        w.kill();
    };
    let read = |name: &str| {
        let rvm = Rvm::open(f.config(name, true)).expect("recover");
        let s = rvm.segment("lazy").expect("allocated before the kill");
        let v: Vec<u64> = (0..5).map(|i| s.read_u64(i * 8).expect("read")).collect();
        v
    };
    run("lazy-noflush", "noflush");
    assert_eq!(
        read("lazy-noflush"),
        [0, 0, 0, 0, 0],
        "lazy commits reached the backend unflushed"
    );
    run("lazy", "flush");
    assert_eq!(
        read("lazy"),
        [10, 77, 0, 0, 0],
        "flush did not put the lazy commits in the backend's log"
    );
    run("lazy", "commit");
    assert_eq!(
        read("lazy"),
        [10, 77, 0, 55, 88],
        "a plain commit did not carry a lazy one"
    );
}

fn bad_arguments_are_clear_errors(f: &Fixture) {
    let rvm = Rvm::open(f.config("bad", false)).expect("open");
    assert!(matches!(
        rvm.alloc("", 4096),
        Err(RvmError::InvalidArgument(_))
    ));
    assert!(matches!(
        rvm.alloc(&"t".repeat(limits::TAG_BYTES_MAX + 1), 4096),
        Err(RvmError::InvalidArgument(_))
    ));
    assert!(matches!(
        rvm.alloc("zero", 0),
        Err(RvmError::TooLarge { .. })
    ));
    assert!(matches!(
        rvm.alloc("huge", limits::SEGMENT_BYTES_MAX + 1),
        Err(RvmError::TooLarge { .. })
    ));
    let s = rvm.alloc("s", 4096).expect("alloc");
    assert!(matches!(rvm.alloc("s", 4096), Err(RvmError::TagExists(_))));
    let mut t = rvm.begin();
    assert!(matches!(
        t.set_range(&s, 4090, 7),
        Err(RvmError::OutOfBounds { .. })
    ));
    assert!(matches!(
        t.set_range(&s, u64::MAX, 2),
        Err(RvmError::OutOfBounds { .. })
    ));
    assert!(matches!(
        t.set_range(&s, 0, 0),
        Err(RvmError::InvalidArgument(_))
    ));
    assert!(matches!(t.free("nope"), Err(RvmError::NoSuchTag(_))));
    let msg = t
        .set_range(&s, 4090, 7)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("4090") && msg.contains("\"s\""),
        "unclear message: {msg}"
    );
    t.abort();
    for name in [
        "",
        "has space",
        "slash/y",
        &"n".repeat(limits::NAME_BYTES_MAX + 1),
    ] {
        let mut cfg = f.config("x", false);
        cfg.name = name.to_owned();
        assert!(
            matches!(Rvm::open(cfg), Err(RvmError::InvalidArgument(_))),
            "{name:?}"
        );
    }
}

/// A commit of whole pages big enough that the pool backend's recovery reads it straight
/// into segment memory (`PLACE_WRITE_BYTES_MIN`), between small writes into the same
/// bytes before and after it: recovery keeps log order, and a truncation after recovery
/// writes the committed bytes to the home, not what an open transaction put in memory.
fn placed_writes_keep_log_order(f: &Fixture) {
    const MIB: u64 = 1 << 20;
    let big = pattern(2, 2 * MIB as usize);
    let rvm = Rvm::open(f.config("placed", false)).expect("open");
    let s = rvm.alloc("s", 4 * MIB).expect("alloc");
    let write = |off: u64, data: &[u8]| commit_one_write(&rvm, &s, off, data);
    write(MIB + 300 * 4096 + 10, b"older");
    write(5, b"outside");
    write(MIB, &big);
    write(MIB + 100, b"newest");
    drop(s);
    drop(rvm);
    let mut want = big.clone();
    want[100..106].copy_from_slice(b"newest");
    let check = |rvm: &Rvm| {
        let s = rvm.segment("s").expect("recovered");
        assert_eq!(s.read(MIB, want.len()).expect("read"), want);
        assert_eq!(s.read(5, 7).expect("read"), b"outside");
        assert_eq!(s.read(3 * MIB, 4096).expect("read"), vec![0; 4096]);
    };
    let rvm = Rvm::open(f.config("placed", true)).expect("recover");
    check(&rvm);
    let s = rvm.segment("s").expect("recovered");
    let mut open_txn = rvm.begin();
    open_txn.set_range(&s, MIB + 8192, 8).expect("declare");
    open_txn.write_u64(&s, MIB + 8192, 0xbad).expect("write");
    rvm.truncate().expect("truncate");
    open_txn.abort();
    drop(s);
    drop(rvm);
    // From the homes alone now.
    let rvm = Rvm::open(f.config("placed", true)).expect("recover after truncation");
    check(&rvm);
}

/// A big record whose payload is corrupt in the log (as a commit torn by a crash leaves
/// it) after recovery has read part of it straight into segment memory, over the same
/// pages an earlier good record placed: recovery falls back to scanning without placing,
/// and the segment shows the earlier record's bytes, not the corrupt one's.
#[test]
fn corrupt_placed_record_is_not_published_pool() {
    use camelot_client::{reply, Client, ClientConfig, ClusterMap};
    use camelot_rvm::record::decode_header;
    const MIB: u64 = 1 << 20;
    let f = Fixture::start("pool");
    let rvm = Rvm::open(f.config("torn", false)).expect("open");
    let s = rvm.alloc("s", 4 * MIB).expect("alloc");
    let write = |off: u64, data: &[u8]| commit_one_write(&rvm, &s, off, data);
    write(0, b"before");
    let good = pattern(3, 2 * MIB as usize);
    write(MIB, &good);
    write(MIB, &pattern(4, 2 * MIB as usize));
    drop(s);
    drop(rvm);

    // Flip one payload byte of the last (big) record in the server's log region.
    let Fixture::Pool(node) = &f else {
        unreachable!()
    };
    let client = Client::connect(
        ClusterMap::from_addrs(node.addrs()),
        ClientConfig::default(),
    )
    .expect("connect");
    let log = client.lookup("rvm/torn/log").expect("log region");
    let read = |off: u64, len: u32| {
        reply::data(
            client
                .submit(0, log.read_op(off, len))
                .expect("submit")
                .wait(),
        )
        .expect("read")
    };
    let mut at = 0u64;
    let mut starts = Vec::new();
    while let Ok(h) = decode_header(&read(at, 32)) {
        starts.push(at);
        at += h.total_bytes();
    }
    let last = *starts.last().expect("records in the log");
    assert!(at - last > 2 * MIB, "the big record is last");
    let victim = last + 32 + 4 + 21 + 4096;
    let mut byte = read(victim, 1).to_vec();
    byte[0] ^= 0x40;
    reply::done(
        client
            .submit(0, log.write_op(victim, bytes::Bytes::from(byte)))
            .expect("submit")
            .wait(),
    )
    .expect("write");

    let rvm = Rvm::open(f.config("torn", true)).expect("recover");
    let s = rvm.segment("s").expect("recovered");
    assert_eq!(s.read(0, 6).expect("read"), b"before");
    assert!(
        s.read(MIB, good.len()).expect("read") == good,
        "bytes of a record that fails its checksum were published"
    );
    // The instance goes on from the last good record.
    let mut t = rvm.begin();
    t.set_range(&s, 0, 5).expect("declare");
    t.write(&s, 0, b"after").expect("write");
    t.commit().expect("commit");
    drop(s);
    drop(rvm);
    let rvm = Rvm::open(f.config("torn", true)).expect("recover again");
    let s = rvm.segment("s").expect("recovered");
    assert_eq!(s.read(0, 6).expect("read"), b"aftere");
}

/// A catalog longer than the pool backend's first catalog read (CATALOG_FIRST_READ_BYTES)
/// is read whole: every segment comes back from the homes after a truncation.
fn long_catalog_recovers(f: &Fixture) {
    const SEGS: usize = 1200;
    let tag = |i: usize| format!("{i:04}-{}", "t".repeat(52));
    let rvm = Rvm::open(f.config("longcat", false)).expect("open");
    for i in 0..SEGS {
        let s = rvm.alloc(&tag(i), 4096).expect("alloc");
        let mut t = rvm.begin();
        t.set_range(&s, 0, 8).expect("declare");
        t.write_u64(&s, 0, i as u64 + 1).expect("write");
        t.commit_lazy().expect("commit");
    }
    rvm.flush().expect("flush");
    rvm.truncate()
        .expect("truncate: the catalog now names every segment");
    assert!(
        SEGS * (tag(0).len() + 24) > limits::CATALOG_FIRST_READ_BYTES,
        "the catalog must be longer than the first read"
    );
    drop(rvm);
    let rvm = Rvm::open(f.config("longcat", true)).expect("recover");
    assert_eq!(rvm.segments().len(), SEGS);
    for i in 0..SEGS {
        let s = rvm.segment(&tag(i)).expect("recovered");
        assert_eq!(s.read_u64(0).expect("read"), i as u64 + 1);
    }
}

#[test]
fn long_catalog_recovers_pool() {
    long_catalog_recovers(&Fixture::start("pool"));
}

#[test]
fn long_catalog_recovers_pool_mirrored() {
    long_catalog_recovers(&Fixture::start("pool-mirrored"));
}

/// A commit big enough that the second mirror is fed from a thread of its own
/// (`MIRROR_THREAD_BYTES_MIN`, 4 MiB) is whole on each mirror: either server alone, as a
/// single-server pool, recovers every byte of it.
#[test]
fn a_big_mirrored_commit_is_whole_on_each_mirror() {
    const MIB: u64 = 1 << 20;
    // Room for both commits' records (the suite's 8 MiB log holds neither).
    const LOG_BYTES: u64 = 24 * MIB;
    let f = Fixture::start("pool-mirrored");
    let Fixture::Mirrored(a, b) = &f else {
        unreachable!("a mirrored fixture")
    };
    let config = |servers: Vec<std::net::SocketAddr>, recover: bool| {
        let backend = camelot_rvm::BackendConfig::Pool {
            servers,
            token: None,
            log_bytes: LOG_BYTES,
        };
        camelot_rvm::Config::new(backend, "bigmirror").recover(recover)
    };
    let (a, b) = (a.addrs()[0], b.addrs()[0]);
    let first = pattern(3, (9 * MIB) as usize + 123);
    let second = pattern(4, (5 * MIB) as usize);
    let rvm = Rvm::open(config(vec![a, b], false)).expect("open");
    let s = rvm.alloc("s", 10 * MIB).expect("alloc");
    for (off, data) in [(7, &first), (MIB / 2, &second)] {
        commit_one_write(&rvm, &s, off, data);
    }
    drop(s);
    drop(rvm);
    let mut want = vec![0u8; (10 * MIB) as usize];
    want[7..7 + first.len()].copy_from_slice(&first);
    want[(MIB / 2) as usize..(MIB / 2) as usize + second.len()].copy_from_slice(&second);
    for server in [a, b] {
        let rvm = Rvm::open(config(vec![server], true)).expect("recover from one mirror");
        let s = rvm.segment("s").expect("recovered");
        assert!(
            s.read(0, want.len()).expect("read") == want,
            "{server} does not hold both commits whole"
        );
    }
}

macro_rules! suite {
    ($($backend:ident => $kind:literal),*) => {$(
        mod $backend {
            use super::*;
            fn fixture() -> Fixture { Fixture::start($kind) }
            #[test] fn commit_and_recover() { super::commit_and_recover(&fixture()) }
            #[test] fn abort_restores_exactly() { super::abort_restores_exactly(&fixture()) }
            #[test] fn free_takes_effect_at_commit() { super::free_takes_effect_at_commit(&fixture()) }
            #[test] fn concurrent_disjoint_and_overlap_conflicts() {
                super::concurrent_disjoint_and_overlap_conflicts(&fixture())
            }
            #[test] fn log_is_truncated() { super::log_is_truncated(&fixture()) }
            #[test] fn placed_writes_keep_log_order() {
                super::placed_writes_keep_log_order(&fixture())
            }
            #[test] fn lazy_commits_flush() { super::lazy_commits_flush(&fixture()) }
            #[test] fn bad_arguments_are_clear_errors() { super::bad_arguments_are_clear_errors(&fixture()) }
        }
    )*};
}

suite!(pool => "pool", pool_mirrored => "pool-mirrored", redis => "redis", file => "file");

// The redis backend against Camelot's own Redis port: the same suite, with the port's
// SETRANGE (truncation writes homes with it) and MULTI/EXEC (the guarded writes).
suite!(camelot_resp => "camelot-resp");
