//! A writer paused across another opener's takeover must not land anything once it is
//! continued: the pool server refuses every WRITE not guarded by the current epoch, and
//! redis-server aborts the home writes' MULTI/EXEC because the takeover's SET touched the
//! epoch key the writer WATCHes.
//! The paused writer is a real process (`rvm-crash-writer fence`) that stops itself with
//! SIGSTOP between deciding to write its truncation's homes and sending them — the moment
//! a check made by the client beforehand cannot cover (for redis: after the WATCH and the
//! GET that found its own epoch, before MULTI/EXEC).

mod common;

use camelot_rvm::{BackendConfig, Config};
use camelot_rvm::{Rvm, Segment};
use common::{Fixture, LineChild, POOL_LOG_BYTES};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How long the paused writer may take to show as stopped in /proc.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "PID (COMM) STATE ...": COMM may hold spaces and parentheses, so after the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {sig} {pid}: {status}");
}

fn try_commit_u64(rvm: &Rvm, s: &Segment, off: u64, v: u64) -> camelot_rvm::Result<()> {
    let mut t = rvm.begin();
    t.set_range(s, off, 8).expect("declare");
    t.write_u64(s, off, v).expect("write");
    t.commit()
}

fn commit_u64(rvm: &Rvm, s: &Segment, off: u64, v: u64) {
    try_commit_u64(rvm, s, off, v).expect("commit");
}

/// A (a process) commits 111 and is stopped while truncating, just before its home
/// writes; B opens the instance, sees 111, commits 222 over it and 444 beside it and
/// truncates, so the homes hold B's values; A is continued. A's truncation and its next
/// commit must both fail, and a recovery must find B's values. Before the server checked
/// the epoch on every WRITE, A's home write landed (its epoch check had passed before it
/// stopped) and the recovery found 111 where B had committed 222.
fn paused_writer_lands_nothing(kind: &str) {
    let f = Fixture::start(kind);
    let name = "fence";
    let mut a = LineChild::writer(
        &[
            "fence".into(),
            f.spec(),
            name.into(),
            POOL_LOG_BYTES.to_string(),
        ],
        &[],
    );
    assert_eq!(a.line(), "committed");
    assert_eq!(a.line(), "paused");
    let pid = a.child.id();
    let deadline = Instant::now() + STOP_TIMEOUT;
    while process_state(pid) != Some('T') {
        assert!(
            Instant::now() < deadline,
            "writer {pid} did not stop within {STOP_TIMEOUT:?} (state {:?})",
            process_state(pid)
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    let b = Rvm::open(f.config(name, true)).expect("B opens while A is stopped");
    let s = b.segment("fence").expect("A's segment");
    assert_eq!(s.read_u64(0).expect("read"), 111, "A's commit is recovered");
    commit_u64(&b, &s, 0, 222);
    commit_u64(&b, &s, 8, 444);
    b.truncate()
        .expect("B truncates: its values go to the homes");
    drop(s);
    b.close().expect("B closes");

    signal(pid, "-CONT");
    let truncated = a.line();
    let committed = a.line();
    let status = a.child.wait().expect("A exits");
    assert!(status.success(), "A failed outright: {status}");
    assert!(
        truncated.starts_with("truncate: ") && truncated.contains("fenced"),
        "A's truncation after the takeover did not fail as fenced: {truncated:?}"
    );
    assert!(
        committed.starts_with("commit: ") && committed != "commit: ok",
        "A committed after the takeover: {committed:?}"
    );

    let c = Rvm::open(f.config(name, true)).expect("recover");
    let s = c.segment("fence").expect("segment");
    assert_eq!(
        (s.read_u64(0).expect("read"), s.read_u64(8).expect("read")),
        (222, 444),
        "B's commits were overwritten by the fenced writer"
    );
}

#[test]
fn pool_paused_writer_lands_nothing_after_a_takeover() {
    paused_writer_lands_nothing("pool");
}

#[test]
fn mirrored_pool_paused_writer_lands_nothing_after_a_takeover() {
    paused_writer_lands_nothing("pool-mirrored");
}

/// Against a real redis-server. With the home writes sent as before (SETRANGEs, then a
/// GET of the epoch in the same pipeline), A's SETRANGE landed over B's truncated value
/// and the recovery read 111.
#[test]
fn redis_paused_writer_lands_nothing_after_a_takeover() {
    paused_writer_lands_nothing("redis");
}

/// Against Camelot's own RESP port, whose EXEC runs with the object store to itself and
/// whose WATCH compares the epoch key's version. Before the port had MULTI/EXEC the
/// backend fell back to writes-then-GET there, and A's home write landed (recovery read
/// 111).
#[test]
fn camelot_resp_paused_writer_lands_nothing_after_a_takeover() {
    paused_writer_lands_nothing("camelot-resp");
}

/// How long a test's own command to redis-server may take.
const REDIS_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends one inline command to redis-server at `addr`; returns the reader of its reply.
fn redis_send(addr: SocketAddr, command: &str) -> BufReader<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, REDIS_COMMAND_TIMEOUT).expect("connect");
    stream
        .set_read_timeout(Some(REDIS_COMMAND_TIMEOUT))
        .expect("timeout");
    stream
        .write_all(format!("{command}\r\n").as_bytes())
        .expect("send");
    BufReader::new(stream)
}

fn read_line(reader: &mut BufReader<TcpStream>) -> String {
    let mut line = String::new();
    reader.read_line(&mut line).expect("redis answers");
    line.trim_end().to_string()
}

/// Sends one inline command to redis-server at `addr`; returns its one-line reply.
fn redis_command(addr: SocketAddr, command: &str) -> String {
    read_line(&mut redis_send(addr, command))
}

fn redis_config(addr: SocketAddr, name: &str) -> Config {
    Config::new(
        BackendConfig::Redis {
            addr,
            wait_replicas: 0,
        },
        name,
    )
    .recover(true)
}

/// Redis loses every key while A holds the instance (FLUSHALL here; a failover to a replica
/// that had not caught up does the same), and B opens the name afresh. A's next commit
/// must fail as fenced. When each open INCRed a counter, B drew A's epoch (1) again and A
/// went on committing into B's instance.
#[test]
fn redis_that_lost_its_keys_fences_the_writer_that_held_them() {
    let redis = common::Redis::start();
    let a = Rvm::open(redis_config(redis.addr, "lost")).expect("A opens");
    let s = a.alloc("s", 4096).expect("A allocates");
    commit_u64(&a, &s, 0, 111);
    assert_eq!(redis_command(redis.addr, "FLUSHALL"), "+OK");

    let b = Rvm::open(redis_config(redis.addr, "lost")).expect("B opens afresh");
    assert!(
        b.segment("s").is_none(),
        "B found A's segment after FLUSHALL"
    );
    let sb = b.alloc("s", 4096).expect("B allocates");
    commit_u64(&b, &sb, 0, 222);

    let late = try_commit_u64(&a, &s, 0, 999);
    assert!(
        matches!(late, Err(camelot_rvm::RvmError::Fenced(_))),
        "A committed into the instance B made after Redis lost its keys: {late:?}"
    );
}

/// A's last batch lands after Redis lost its keys (its fencing GET then finds no epoch, so
/// the commit fails for A, but the record stays). B makes the instance afresh and commits
/// up to the sequence number just before that record's, then crashes (dropped without
/// truncating); C recovers. When log keys held only the sequence number, C's scan went on
/// into A's record and replayed 999 over B's 222.
#[test]
fn redis_a_fenced_writer_s_record_is_not_replayed_into_a_new_instance() {
    let redis = common::Redis::start();
    let a = Rvm::open(redis_config(redis.addr, "stale")).expect("A opens");
    let s = a.alloc("s", 4096).expect("A allocates");
    commit_u64(&a, &s, 0, 111);
    assert_eq!(redis_command(redis.addr, "FLUSHALL"), "+OK");
    let late = try_commit_u64(&a, &s, 0, 999);
    assert!(late.is_err(), "A committed after Redis lost its keys");
    let left = redis_command(redis.addr, "DBSIZE");
    assert_ne!(
        left, ":0",
        "A's last record did not land: the test shows nothing"
    );

    let b = Rvm::open(redis_config(redis.addr, "stale")).expect("B opens afresh");
    let sb = b.alloc("s", 4096).expect("B allocates");
    commit_u64(&b, &sb, 0, 222);
    drop(sb);
    drop(b);

    let c = Rvm::open(redis_config(redis.addr, "stale")).expect("C recovers");
    let sc = c.segment("s").expect("B's segment");
    assert_eq!(
        sc.read_u64(0).expect("read"),
        222,
        "recovery replayed the record a fenced writer left before the instance was made"
    );
}

/// B opens (recovering A's 111) and so fences A; A's next commit, sent after B's scan of
/// the log, fails for A — but its record can land at the sequence number after the last
/// one B read. B commits nothing and is dropped (a crash: no truncation); C recovers and
/// must find what B found. Before B claimed the end of the log at its open, A's record
/// sat where C's scan went on, and C replayed 999: a commit that failed for its writer,
/// and that B (which may have answered reads with 111 meanwhile) never saw.
#[test]
fn redis_a_fenced_writer_s_late_record_is_not_replayed_by_a_later_recovery() {
    let redis = common::Redis::start();
    let a = Rvm::open(redis_config(redis.addr, "late")).expect("A opens");
    let s = a.alloc("s", 4096).expect("A allocates");
    commit_u64(&a, &s, 0, 111);
    let keys_before = redis_command(redis.addr, "DBSIZE");

    let b = Rvm::open(redis_config(redis.addr, "late")).expect("B recovers");
    let sb = b.segment("s").expect("A's segment");
    assert_eq!(sb.read_u64(0).expect("read"), 111);
    let late = try_commit_u64(&a, &s, 0, 999);
    assert!(
        matches!(late, Err(camelot_rvm::RvmError::Fenced(_))),
        "A committed after B's open: {late:?}"
    );
    drop(sb);
    drop(b);

    let c = Rvm::open(redis_config(redis.addr, "late")).expect("C recovers");
    let sc = c.segment("s").expect("the segment");
    assert_eq!(
        sc.read_u64(0).expect("read"),
        111,
        "recovery replayed a record its fenced writer sent after B's open (keys before \
         B's open: {keys_before})"
    );
    // And the log goes on from there: C commits, and D recovers that.
    commit_u64(&c, &sc, 0, 333);
    drop(sc);
    drop(c);
    let d = Rvm::open(redis_config(redis.addr, "late")).expect("D recovers");
    assert_eq!(d.segment("s").expect("seg").read_u64(0).expect("read"), 333);
}

/// GET of `key` on redis-server at `addr` (a bulk reply), `None` when absent.
fn redis_get(addr: SocketAddr, key: &str) -> Option<String> {
    let mut reader = redis_send(addr, &format!("GET {key}"));
    (read_line(&mut reader) != "$-1").then(|| read_line(&mut reader))
}

/// An instance written before log keys carried an id (records under `rvm:NS:log:SEQ`, no
/// id key; made here from a new one by renaming its keys) recovers its untruncated
/// commits. Given a new id, it read no records and came back without them.
#[test]
fn redis_an_instance_from_before_ids_keeps_its_untruncated_commits() {
    let redis = common::Redis::start();
    let a = Rvm::open(redis_config(redis.addr, "legacy")).expect("open");
    let s = a.alloc("s", 4096).expect("alloc");
    commit_u64(&a, &s, 0, 111);
    commit_u64(&a, &s, 8, 222);
    drop(s);
    drop(a);
    let id: u64 = redis_get(redis.addr, "rvm:legacy:instance")
        .expect("an instance id")
        .parse()
        .expect("a number");
    let mut renamed = 0;
    for seq in 1..=16 {
        let reply = redis_command(
            redis.addr,
            &format!("RENAME rvm:legacy:log:{id:016x}:{seq} rvm:legacy:log:{seq}"),
        );
        renamed += usize::from(reply == "+OK");
    }
    assert!(renamed >= 2, "only {renamed} records to rename");
    assert_eq!(redis_command(redis.addr, "DEL rvm:legacy:instance"), ":1");

    let b = Rvm::open(redis_config(redis.addr, "legacy")).expect("recovers");
    let s = b.segment("s").expect("the segment");
    assert_eq!(
        (s.read_u64(0).expect("read"), s.read_u64(8).expect("read")),
        (111, 222),
        "an instance from before ids lost its untruncated commits"
    );
}

/// A Redis that may evict keys without a TTL would drop committed records silently: the
/// open refuses it and says what to set.
#[test]
fn redis_that_may_evict_any_key_is_refused() {
    let redis = camelot_testkit::RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"])
        .expect("redis-server starts");
    let err = match Rvm::open(redis_config(redis.addr(), "evict")) {
        Ok(_) => panic!("an RVM instance opened on a Redis that may evict its log"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("allkeys-lru") && err.contains("noeviction"),
        "the refusal does not say why and what to set: {err}"
    );
}
