//! Crash consistency: a writer process doing balanced transfers is SIGKILLed at random
//! moments; every recovery must find the total unchanged and the sequence number at the
//! last commit that returned (or the one in flight at the kill, which may have become
//! durable before the writer could report it).
//!
//! CI runs a few kills per backend; the full run is
//! `RVM_CRASH_KILLS=200 cargo test -p camelot-rvm --release --test crash`.

mod common;

use camelot_rvm::{BackendConfig, Config, Rvm, RvmError};
use common::{dev_node, scratch, Fixture, Redis};
use rand::{Rng, SeedableRng};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SEGMENTS: u64 = 4;
const ACCOUNTS_PER_SEGMENT: u64 = 64;
const ACCOUNT_STRIDE_BYTES: u64 = 200;
const INITIAL_BALANCE: u64 = 1000;
const KILLS_DEFAULT: usize = 6;
/// Commits the writer reports before it is killed: random in 1..=this.
const COMMITS_BEFORE_KILL_MAX: u64 = 60;
/// Small, so truncation (and crashes during it) happen every few dozen commits.
const TRUNCATE_BYTES: u64 = 16 << 10;
const WRITER_LINE_TIMEOUT: Duration = Duration::from_secs(20);

fn kills() -> usize {
    std::env::var("RVM_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KILLS_DEFAULT)
}

struct Writer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Writer {
    fn spawn(backend: &str, name: &str, seed: u64) -> Writer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rvm-crash-writer"))
            .args([backend, name, &common::POOL_LOG_BYTES.to_string()])
            .args([TRUNCATE_BYTES.to_string(), seed.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("writer starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Writer { child, lines }
    }

    /// The next line, failing the test if the writer is silent too long.
    fn line(&mut self) -> String {
        match self.lines.recv_timeout(WRITER_LINE_TIMEOUT) {
            Ok(l) => l,
            Err(e) => {
                let status = self.child.try_wait();
                panic!(
                    "writer said nothing within {WRITER_LINE_TIMEOUT:?} ({e}); status {status:?}"
                )
            }
        }
    }

    /// SIGKILLs the writer and returns the lines it wrote before dying (commits that
    /// returned while we were not looking).
    fn kill(mut self) -> Vec<String> {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
        // The pipe reaches EOF now, which ends the reader thread and the channel.
        let mut rest = Vec::new();
        let deadline = Instant::now() + WRITER_LINE_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => rest.push(l),
                Err(mpsc::RecvTimeoutError::Disconnected) => return rest,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("writer pipe never closed"),
            }
        }
    }
}

fn number(line: &str, prefix: &str) -> u64 {
    line.strip_prefix(prefix)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("expected {prefix:?}N from the writer, got {line:?}"))
}

/// Recovers in this process and checks the invariant; returns the sequence number.
fn check(backend: &BackendConfig, name: &str) -> Option<u64> {
    let mut cfg = Config::new(backend.clone(), name).recover(true);
    cfg.background_truncation = false;
    let rvm = Rvm::open(cfg).expect("recovery succeeds after a kill");
    let meta = rvm.segment("meta")?;
    let mut total = 0;
    for s in 0..SEGMENTS {
        let seg = rvm
            .segment(&format!("acct-{s}"))
            .expect("accounts exist once meta does");
        for i in 0..ACCOUNTS_PER_SEGMENT {
            total += seg.read_u64(i * ACCOUNT_STRIDE_BYTES).expect("read");
        }
    }
    assert_eq!(
        total,
        SEGMENTS * ACCOUNTS_PER_SEGMENT * INITIAL_BALANCE,
        "money was made or lost"
    );
    Some(meta.read_u64(0).expect("read"))
}

fn crash_loop(spec: &str, backend: BackendConfig) {
    let name = "crash";
    let kills = kills();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5eed);
    let mut last_returned = 0u64;
    let started = Instant::now();
    for k in 0..kills {
        let mut w = Writer::spawn(spec, name, rng.gen());
        let ready = number(&w.line(), "ready ");
        let target = rng.gen_range(1..=COMMITS_BEFORE_KILL_MAX);
        let mut reported = ready;
        while reported < ready + target {
            reported = number(&w.line(), "committed ");
        }
        for line in w.kill() {
            reported = number(&line, "committed ");
        }
        let seq = check(&backend, name).expect("initialised before the first report");
        assert!(
            seq >= reported && seq <= reported + 1,
            "kill {k}: recovered seq {seq}, but the last reported commit was {reported}"
        );
        assert!(
            seq >= last_returned,
            "kill {k}: went back from {last_returned} to {seq}"
        );
        last_returned = seq;
    }
    eprintln!(
        "{spec}: {kills} kills in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn crash_pool() {
    let f = Fixture::start("pool");
    let BackendConfig::Pool { servers, .. } = f.backend() else {
        unreachable!()
    };
    crash_loop(&format!("pool://{}", servers[0]), f.backend());
}

#[test]
fn crash_pool_mirrored() {
    let f = Fixture::start("pool-mirrored");
    let BackendConfig::Pool { servers, .. } = f.backend() else {
        unreachable!()
    };
    crash_loop(
        &format!("pool://{},{}", servers[0], servers[1]),
        f.backend(),
    );
}

#[test]
fn crash_redis() {
    let r = Redis::start();
    crash_loop(
        &format!("redis://{}", r.addr),
        BackendConfig::Redis {
            addr: r.addr,
            wait_replicas: 0,
        },
    );
}

#[test]
fn crash_file() {
    let dir = scratch("crash-file");
    crash_loop(
        &format!("file://{}", dir.display()),
        BackendConfig::File { dir: dir.clone() },
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Mirrored pool: a server dies between commits; recovery from the survivor loses
/// nothing, commits without the mirror fail loudly, and either server can be the one lost.
#[test]
fn mirrored_pool_survives_either_server() {
    for lose in 0..2 {
        let nodes = [dev_node(), dev_node()];
        let servers = vec![nodes[0].addrs()[0], nodes[1].addrs()[0]];
        let backend = BackendConfig::Pool {
            servers: servers.clone(),
            token: None,
            log_bytes: common::POOL_LOG_BYTES,
        };
        let cfg = |recover| {
            let mut c = Config::new(backend.clone(), "mirror").recover(recover);
            c.truncate_log_bytes = 8 << 10;
            c.background_truncation = false;
            c
        };
        let rvm = Rvm::open(cfg(false)).expect("open");
        let s = rvm.alloc("s", 8192).expect("alloc");
        for n in 1..=50u64 {
            let mut t = rvm.begin();
            t.set_range(&s, (n % 8) * 1000, 8).expect("declare");
            t.write_u64(&s, (n % 8) * 1000, n).expect("write");
            t.commit().expect("commit");
        }
        let [a, b] = nodes;
        let (dead, alive) = if lose == 0 { (a, b) } else { (b, a) };
        dead.shutdown().expect("server stops");
        let mut t = rvm.begin();
        t.set_range(&s, 7900, 8).expect("declare");
        t.write_u64(&s, 7900, 999).expect("write");
        assert!(t.commit().is_err(), "a commit returned without its mirror");
        drop(rvm);
        let rvm = Rvm::open(cfg(true)).expect("recovery from the surviving server");
        let s = rvm.segment("s").expect("recovered");
        for n in 43..=50u64 {
            assert_eq!(
                s.read_u64((n % 8) * 1000).expect("read"),
                n,
                "lost commit {n}"
            );
        }
        // The failed commit may have reached the survivor (like a crash mid-commit):
        // either outcome is allowed, anything else is not.
        let v = s.read_u64(7900).expect("read");
        assert!(v == 0 || v == 999, "torn value {v}");
        let mut t = rvm.begin();
        t.set_range(&s, 8, 8).expect("declare");
        t.write_u64(&s, 8, 1).expect("write");
        assert!(
            matches!(
                t.commit(),
                Err(RvmError::Unavailable(_)) | Err(RvmError::Failed(_))
            ),
            "a degraded mirror accepted a commit"
        );
        drop(alive);
    }
}
