//! A writer paused across another opener's takeover must not land anything once it is
//! continued: the pool server refuses every WRITE not guarded by the current epoch, and
//! redis-server aborts the home writes' MULTI/EXEC because the takeover's INCR touched the
//! epoch key the writer WATCHes.
//! The paused writer is a real process (`rvm-crash-writer fence`) that stops itself with
//! SIGSTOP between deciding to write its truncation's homes and sending them — the moment
//! a check made by the client beforehand cannot cover (for redis: after the WATCH and the
//! GET that found its own epoch, before MULTI/EXEC).

mod common;

use camelot_rvm::{Rvm, Segment};
use common::{Fixture, LineChild, POOL_LOG_BYTES};
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

fn commit_u64(rvm: &Rvm, s: &Segment, off: u64, v: u64) {
    let mut t = rvm.begin();
    t.set_range(s, off, 8).expect("declare");
    t.write_u64(s, off, v).expect("write");
    t.commit().expect("commit");
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
