//! Crash consistency, by SIGKILL: a writer process doing balanced transfers (and bumping a
//! sequence number with each) is killed at random moments — and so are the servers under
//! it: one pool mirror, or redis-server (run with `appendfsync always`). After every
//! kill, recovery in this process must find the total unchanged and the sequence number
//! at least at the last commit the writer reported, at most one past it (the commit in
//! flight at the kill may have landed whole before the writer could report it).
//!
//! The checker is shown able to fail: `*_catches_early_acks` runs the same loops with a
//! writer that reports each commit before making it, and expects violations.
//!
//! CI (`scripts/test.sh`) runs `KILLS_DEFAULT` kills per loop twice: in the workspace's
//! debug test run and again in a release build (`cargo test -p camelot-rvm --release
//! --test crash`). The full run, quoted in BENCHMARKS.md, is
//! `RVM_CRASH_KILLS=1000 cargo test -p camelot-rvm --release --test crash -- --nocapture`.

mod common;

use camelot_rvm::{BackendConfig, Config, Rvm, RvmError};
use camelot_testkit::RedisServer;
use common::{dev_node, scratch, Fixture, LineChild};
use rand::{Rng, SeedableRng};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const SEGMENTS: u64 = 4;
const ACCOUNTS_PER_SEGMENT: u64 = 64;
const ACCOUNT_STRIDE_BYTES: u64 = 200;
const INITIAL_BALANCE: u64 = 1000;
const KILLS_DEFAULT: usize = 50;
/// Kills of the runs with a deliberately broken writer: enough to see a violation.
const BROKEN_KILLS: usize = 3;
/// Commits the writer reports before a kill: random in 1..=this.
const COMMITS_BEFORE_KILL_MAX: u64 = 60;
/// Small, so truncation (and crashes during it) happen every few dozen commits.
const TRUNCATE_BYTES: u64 = 16 << 10;
/// After a server kill the writer's next commit must fail and the writer exit; past
/// this it is killed too, and the run counts a violation.
const WRITER_EXIT_DEADLINE: Duration = Duration::from_secs(10);
/// The broken writer never notices a dead server (its commits stay in memory): it is
/// killed sooner, the violation is what those runs are for.
const BROKEN_WRITER_EXIT_DEADLINE: Duration = Duration::from_millis(300);
/// A restarted redis-server answers -LOADING until it has replayed its AOF.
const REDIS_LOAD_DEADLINE: Duration = Duration::from_secs(30);
const ACK_EARLY: (&str, &str) = ("RVM_CRASH_WRITER_ACK_EARLY", "1");

fn kills() -> usize {
    std::env::var("RVM_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KILLS_DEFAULT)
}

fn number(line: &str, prefix: &str) -> u64 {
    line.strip_prefix(prefix)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("expected {prefix:?}N from the writer, got {line:?}"))
}

fn spawn_writer(spec: &str, name: &str, seed: u64, envs: &[(&str, &str)]) -> LineChild {
    let args = [
        spec.to_owned(),
        name.to_owned(),
        common::POOL_LOG_BYTES.to_string(),
        TRUNCATE_BYTES.to_string(),
        seed.to_string(),
    ];
    LineChild::writer(&args, envs)
}

/// Waits for the writer's `ready`, then for a random number of reported commits; returns
/// the last one reported.
fn run_until_target(w: &mut LineChild, rng: &mut impl Rng) -> u64 {
    let ready = number(&w.line(), "ready ");
    let target = rng.gen_range(1..=COMMITS_BEFORE_KILL_MAX);
    let mut reported = ready;
    while reported < ready + target {
        reported = number(&w.line(), "committed ");
    }
    reported
}

/// After a server under it was killed: the writer's commits must start failing, so it
/// exits; returns the last commit it reported, and whether it did exit in time.
fn drain_until_exit(mut w: LineChild, mut reported: u64, broken: bool) -> (u64, bool) {
    let wait = if broken {
        BROKEN_WRITER_EXIT_DEADLINE
    } else {
        WRITER_EXIT_DEADLINE
    };
    let deadline = Instant::now() + wait;
    let mut exited = false;
    while Instant::now() < deadline {
        match w.child.try_wait() {
            Ok(Some(_)) => {
                exited = true;
                break;
            }
            Ok(None) => {}
            Err(e) => panic!("waiting for the writer: {e}"),
        }
        // Lines arrive on their own thread; take what is there without blocking long.
        std::thread::sleep(Duration::from_millis(5));
    }
    for line in w.kill() {
        reported = number(&line, "committed ");
    }
    (reported, exited)
}

/// Recovers in this process and checks the invariant; `Ok(None)` before the writer's
/// first run finished initialising, `Err` for a violation.
fn check(backend: &BackendConfig, name: &str) -> Result<Option<u64>, String> {
    let mut cfg = Config::new(backend.clone(), name).recover(true);
    cfg.background_truncation = false;
    let rvm = Rvm::open(cfg).map_err(|e| format!("recovery failed: {e}"))?;
    let Some(meta) = rvm.segment("meta") else {
        return Ok(None);
    };
    let mut total = 0;
    for s in 0..SEGMENTS {
        let seg = rvm
            .segment(&format!("acct-{s}"))
            .ok_or("accounts missing although meta exists")?;
        for i in 0..ACCOUNTS_PER_SEGMENT {
            total += seg
                .read_u64(i * ACCOUNT_STRIDE_BYTES)
                .map_err(|e| e.to_string())?;
        }
    }
    if total != SEGMENTS * ACCOUNTS_PER_SEGMENT * INITIAL_BALANCE {
        return Err(format!("torn: money was made or lost (total {total})"));
    }
    Ok(Some(meta.read_u64(0).map_err(|e| e.to_string())?))
}

/// What a loop of kills found.
#[derive(Default)]
struct Outcome {
    kills: usize,
    /// Kills that landed while the writer was paused in its recovery (after reading the
    /// log, before restoring the segments) and inside a truncation (before its home
    /// writes): forced, so both phases are crashed in every run, not only when the random
    /// moment happens to fall there.
    in_recovery: usize,
    in_truncation: usize,
    /// "lost: …" (an acknowledged commit missing), "torn: …", "ahead: …", "failed: …".
    violations: Vec<String>,
    recovery_ms: Vec<f64>,
}

impl Outcome {
    /// Judges one recovery: `reported` is the last commit the writer reported, `last` the
    /// sequence number the previous recovery found.
    fn judge(
        &mut self,
        k: usize,
        checked: Result<Option<u64>, String>,
        reported: u64,
        last: &mut u64,
    ) {
        self.kills += 1;
        let seq = match checked {
            Ok(Some(seq)) => seq,
            Ok(None) if reported == 0 => return,
            Ok(None) => {
                self.violations.push(format!(
                    "lost: kill {k}: nothing recovered after commit {reported}"
                ));
                return;
            }
            Err(e) => {
                self.violations.push(format!("kill {k}: {e}"));
                return;
            }
        };
        if seq < reported {
            self.violations.push(format!(
                "lost: kill {k}: recovered seq {seq}, but commit {reported} was reported"
            ));
        } else if seq > reported + 1 {
            self.violations.push(format!(
                "ahead: kill {k}: recovered seq {seq}, more than one past {reported}"
            ));
        }
        if seq < *last {
            self.violations
                .push(format!("lost: kill {k}: went back from {last} to {seq}"));
        }
        *last = seq;
    }

    fn report(&self, label: &str, started: Instant) {
        let mut ms = self.recovery_ms.clone();
        ms.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            ms.get(((ms.len() as f64 * p).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(f64::NAN)
        };
        eprintln!(
            "{label}: {} kills ({} in the writer's recovery, {} in a truncation), {} \
             violations, {:.1} s; recovery p50 {:.1} ms, p99 {:.1} ms",
            self.kills,
            self.in_recovery,
            self.in_truncation,
            self.violations.len(),
            started.elapsed().as_secs_f64(),
            pct(0.50),
            pct(0.99),
        );
        for v in self.violations.iter().take(5) {
            eprintln!("  {v}");
        }
    }

    fn assert_clean(&self) {
        assert!(
            self.violations.is_empty(),
            "violations: {:?}",
            self.violations
        );
    }

    /// Both phases the pause hooks force were crashed, when the loop was long enough to
    /// reach them.
    fn assert_phases_crashed(&self) {
        if self.kills >= 10 {
            assert!(
                self.in_recovery >= 1 && self.in_truncation >= 1,
                "{} kills in recovery, {} in truncation",
                self.in_recovery,
                self.in_truncation
            );
        }
    }

    fn assert_lost_some(&self) {
        assert!(
            self.violations.iter().any(|v| v.starts_with("lost:")),
            "the checker missed a writer that acknowledges before committing: {:?}",
            self.violations
        );
    }
}

/// Where a writer-loop kill lands: at a random moment of the transfer loop (mid-commit,
/// or mid-truncation when one runs then), or forced into a phase by a pause hook.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Moment {
    Random,
    /// Right after the spawn: wherever start-up has got to.
    Startup,
    Recovery,
    Truncation,
}

/// Of every ten kills of a loop, one is forced into the writer's recovery, one into a
/// truncation and one hits start-up; the rest fall at random. A broken writer (lazy
/// commits never fill its log, so it never truncates) gets start-up and random kills only.
fn moment(k: usize, forced: bool) -> Moment {
    match (k % 10, forced) {
        (9, true) => Moment::Recovery,
        (4, true) => Moment::Truncation,
        (7, _) => Moment::Startup,
        _ => Moment::Random,
    }
}

/// Reads the writer's lines until it says `paused in PHASE`; returns the last commit it
/// reported by then (`last` if none).
fn run_until_paused(w: &mut LineChild, phase: &str, last: u64) -> u64 {
    let mut reported = last;
    loop {
        let line = w.line();
        if line == format!("paused in {phase}") {
            return reported;
        }
        if line.starts_with("ready ") {
            reported = number(&line, "ready ");
        } else {
            reported = number(&line, "committed ");
        }
    }
}

/// Kills of the writer alone: at random moments, right after its start, and — unless it
/// is a broken writer, whose lazy commits never fill the log — forced into its recovery
/// and into a truncation (see [`moment`]).
fn writer_kill_loop(
    spec: &str,
    backend: BackendConfig,
    kills: usize,
    envs: &[(&str, &str)],
) -> Outcome {
    let name = "crash";
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5eed);
    let mut out = Outcome::default();
    let mut last = 0;
    let started = Instant::now();
    let forced = !envs.contains(&ACK_EARLY);
    for k in 0..kills {
        let at = moment(k, forced);
        let pause = match at {
            Moment::Recovery => Some("recovery"),
            Moment::Truncation => Some("truncation"),
            Moment::Random | Moment::Startup => None,
        };
        let mut w = match pause {
            Some(phase) => {
                let mut envs = envs.to_vec();
                envs.push(("RVM_CRASH_WRITER_PAUSE", phase));
                spawn_writer(spec, name, rng.gen(), &envs)
            }
            None => spawn_writer(spec, name, rng.gen(), envs),
        };
        let mut reported = match at {
            Moment::Startup => last,
            Moment::Random => run_until_target(&mut w, &mut rng),
            Moment::Recovery => {
                out.in_recovery += 1;
                run_until_paused(&mut w, "recovery", last)
            }
            Moment::Truncation => {
                out.in_truncation += 1;
                run_until_paused(&mut w, "truncation", last)
            }
        };
        for line in w.kill() {
            if let Some(n) = line.strip_prefix("committed ") {
                reported = n.trim().parse().unwrap_or(reported);
            }
        }
        let t = Instant::now();
        let checked = check(&backend, name);
        out.recovery_ms.push(t.elapsed().as_secs_f64() * 1e3);
        out.judge(k, checked, reported, &mut last);
    }
    out.report(&format!("writer kills, {spec}"), started);
    out
}

#[test]
fn crash_pool() {
    let f = Fixture::start("pool");
    let out = writer_kill_loop(&f.spec(), f.backend(), kills(), &[]);
    out.assert_clean();
    out.assert_phases_crashed();
}

#[test]
fn crash_pool_mirrored() {
    let f = Fixture::start("pool-mirrored");
    let out = writer_kill_loop(&f.spec(), f.backend(), kills(), &[]);
    out.assert_clean();
    out.assert_phases_crashed();
}

#[test]
fn crash_redis() {
    let f = Fixture::start("redis");
    let out = writer_kill_loop(&f.spec(), f.backend(), kills(), &[]);
    out.assert_clean();
    out.assert_phases_crashed();
}

#[test]
fn crash_file() {
    let f = Fixture::start("file");
    let out = writer_kill_loop(&f.spec(), f.backend(), kills(), &[]);
    out.assert_clean();
    out.assert_phases_crashed();
}

#[test]
fn writer_kill_checker_catches_early_acks() {
    let f = Fixture::start("pool");
    writer_kill_loop(&f.spec(), f.backend(), BROKEN_KILLS, &[ACK_EARLY]).assert_lost_some();
}

/// Not a test of its own: with `RVM_TEST_SERVE=1` this test binary, started again by
/// [`ServerChild::start`], runs a Camelot memory server until it is killed, so that a
/// mirror can die by SIGKILL like any server process.
#[test]
#[ignore = "not a test: the server process the mirror-kill tests start"]
fn serve_child_process() {
    if std::env::var("RVM_TEST_SERVE").as_deref() != Ok("1") {
        return;
    }
    // A server restarted after a kill comes back on the port it had.
    let node = match std::env::var("RVM_TEST_SERVE_ADDR") {
        Ok(addr) => common::dev_node_on(addr.parse().expect("RVM_TEST_SERVE_ADDR")),
        Err(_) => dev_node(),
    };
    println!("serving {}", node.addrs()[0]);
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}

/// A Camelot memory server in a process of its own.
struct ServerChild {
    child: Option<LineChild>,
    addr: SocketAddr,
}

impl ServerChild {
    fn start() -> ServerChild {
        ServerChild::start_on(None)
    }

    /// On `addr` (a killed server's, to restart it there empty), or on a free port.
    fn start_on(addr: Option<SocketAddr>) -> ServerChild {
        let addr_env = addr.map(|a| a.to_string());
        let mut envs = vec![("RVM_TEST_SERVE", "1")];
        if let Some(a) = &addr_env {
            envs.push(("RVM_TEST_SERVE_ADDR", a));
        }
        let exe = std::env::current_exe().expect("own test binary");
        let args = [
            "--exact",
            "serve_child_process",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ]
        .map(String::from);
        let mut child = LineChild::spawn(&exe.to_string_lossy(), &args, &envs);
        loop {
            let line = child.line();
            // libtest may print "test serve_child_process ... " first on the same line.
            if let Some((_, addr)) = line.split_once("serving ") {
                let addr = addr.trim().parse().expect("server address");
                return ServerChild {
                    child: Some(child),
                    addr,
                };
            }
        }
    }

    fn kill(&mut self) {
        if let Some(c) = self.child.take() {
            c.kill();
        }
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// SIGKILL of one pool mirror (picked at random) while the writer commits: the writer's
/// next commit must fail, and recovery from the survivor alone must hold every commit
/// reported before the kill. The dead mirror is replaced by a fresh server, which the
/// next writer's recovery resyncs.
fn mirror_kill_loop(kills: usize, envs: &[(&str, &str)]) -> Outcome {
    let name = "mirror-crash";
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x3141);
    let mut servers = [ServerChild::start(), ServerChild::start()];
    let mut out = Outcome::default();
    let mut last = 0;
    let started = Instant::now();
    for k in 0..kills {
        let addrs = vec![servers[0].addr, servers[1].addr];
        let spec = format!("pool://{},{}", addrs[0], addrs[1]);
        let mut w = spawn_writer(&spec, name, rng.gen(), envs);
        let reported = run_until_target(&mut w, &mut rng);
        let victim = rng.gen_range(0..2);
        servers[victim].kill();
        let (reported, exited) = drain_until_exit(w, reported, !envs.is_empty());
        if !exited {
            out.violations.push(format!(
                "kill {k}: the writer kept running after its mirror died"
            ));
        }
        let backend = BackendConfig::Pool {
            servers: addrs,
            token: None,
            log_bytes: common::POOL_LOG_BYTES,
        };
        let t = Instant::now();
        let checked = check(&backend, name);
        out.recovery_ms.push(t.elapsed().as_secs_f64() * 1e3);
        out.judge(k, checked, reported, &mut last);
        servers[victim] = ServerChild::start();
    }
    out.report("mirror kills, pool (2 mirrors)", started);
    out
}

#[test]
fn crash_pool_mirror_kill() {
    mirror_kill_loop(kills(), &[]).assert_clean();
}

#[test]
fn mirror_kill_checker_catches_early_acks() {
    mirror_kill_loop(BROKEN_KILLS, &[ACK_EARLY]).assert_lost_some();
}

/// Waits until redis-server at `addr` answers PING with PONG (not -LOADING).
fn wait_redis_loaded(addr: SocketAddr) {
    let deadline = Instant::now() + REDIS_LOAD_DEADLINE;
    loop {
        let pong = TcpStream::connect(addr).and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(1)))?;
            s.write_all(b"PING\r\n")?;
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf)?;
            Ok(buf[..n].starts_with(b"+PONG"))
        });
        if matches!(pong, Ok(true)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "redis at {addr} never finished loading"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGKILL of redis-server (AOF on, fsync on every write) while the writer commits, then
/// a restart on the same data directory: every commit Redis acknowledged is there.
fn redis_kill_loop(kills: usize, envs: &[(&str, &str)]) -> Outcome {
    let name = "redis-crash";
    let dir = scratch("redis-aof");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let dir_arg = dir.to_string_lossy().into_owned();
    let start = || {
        let r = RedisServer::start_with(&[
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            &dir_arg,
        ])
        .expect("redis-server starts");
        wait_redis_loaded(r.addr());
        r
    };
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x2718);
    let mut redis = start();
    let mut out = Outcome::default();
    let mut last = 0;
    let started = Instant::now();
    for k in 0..kills {
        let spec = format!("redis://{}", redis.addr());
        let mut w = spawn_writer(&spec, name, rng.gen(), envs);
        let reported = run_until_target(&mut w, &mut rng);
        redis.process_mut().kill().expect("SIGKILL redis-server");
        let (reported, exited) = drain_until_exit(w, reported, !envs.is_empty());
        if !exited {
            out.violations.push(format!(
                "kill {k}: the writer kept running after Redis died"
            ));
        }
        drop(redis);
        redis = start();
        let backend = BackendConfig::Redis {
            addr: redis.addr(),
            wait_replicas: 0,
        };
        let t = Instant::now();
        let checked = check(&backend, name);
        out.recovery_ms.push(t.elapsed().as_secs_f64() * 1e3);
        out.judge(k, checked, reported, &mut last);
    }
    out.report("redis-server kills (appendfsync always)", started);
    drop(redis);
    let _ = std::fs::remove_dir_all(dir);
    out
}

#[test]
fn crash_redis_server_kill() {
    redis_kill_loop(kills(), &[]).assert_clean();
}

#[test]
fn redis_kill_checker_catches_early_acks() {
    redis_kill_loop(BROKEN_KILLS, &[ACK_EARLY]).assert_lost_some();
}

/// A mirrored instance with `commits` commits on two memory servers, each a process of
/// its own: the servers and the configuration to open it with (`recover` or not).
fn mirrored_instance(name: &str, commits: u64) -> ([ServerChild; 2], impl Fn(bool) -> Config) {
    let servers = [ServerChild::start(), ServerChild::start()];
    let backend = BackendConfig::Pool {
        servers: vec![servers[0].addr, servers[1].addr],
        token: None,
        log_bytes: common::POOL_LOG_BYTES,
    };
    let name = name.to_owned();
    let cfg = move |recover| Config::new(backend.clone(), &name).recover(recover);
    let rvm = Rvm::open(cfg(false)).expect("open");
    let s = rvm.alloc("s", 8192).expect("alloc");
    for n in 1..=commits {
        let mut t = rvm.begin();
        t.set_range(&s, (n % 8) * 1000, 8).expect("declare");
        t.write_u64(&s, (n % 8) * 1000, n).expect("write");
        t.commit().expect("commit");
    }
    (servers, cfg)
}

/// What the last 8 of `commits` commits left in segment `s` (`mirrored_instance`).
fn assert_last_commits(rvm: &Rvm, commits: u64) {
    let s = rvm.segment("s").expect("recovered segment");
    for n in commits - 7..=commits {
        assert_eq!(
            s.read_u64((n % 8) * 1000).expect("read"),
            n,
            "lost commit {n}"
        );
    }
}

/// SIGKILLs `server` and starts an empty one on its port: a memory server that crashed
/// and was brought back.
fn kill_and_restart_empty(server: &mut ServerChild) {
    let addr = server.addr;
    server.kill();
    *server = ServerChild::start_on(Some(addr));
}

/// A mirror SIGKILLed and restarted empty on its port while the other mirror is down
/// (SIGKILLed too): recovery must not take it for the instance — it would recover
/// nothing as if nothing had been there, and, its log growing with each such open, a
/// later recovery would rewrite the mirror that has the data from it.
#[test]
fn a_mirror_restarted_empty_is_not_taken_for_the_instance() {
    let ([mut a, mut b], cfg) = mirrored_instance("restarted-alone", 20);
    kill_and_restart_empty(&mut b);
    a.kill();
    for attempt in 0..3 {
        match Rvm::open(cfg(true)) {
            Err(RvmError::Unavailable(why)) => assert!(why.contains("restarted empty"), "{why}"),
            Err(e) => panic!("attempt {attempt}: {e}"),
            Ok(rvm) => panic!(
                "attempt {attempt}: recovered {} segments from a mirror restarted empty",
                rvm.segments().len()
            ),
        }
    }
}

/// A mirror SIGKILLed and restarted empty while the other answers is rewritten from the
/// other, and after that it holds the instance: with the other SIGKILLed, recovery from
/// it alone finds every commit.
#[test]
fn a_mirror_restarted_empty_is_rewritten_from_the_other() {
    let ([mut a, mut b], cfg) = mirrored_instance("restarted-both", 20);
    kill_and_restart_empty(&mut b);
    let rvm = Rvm::open(cfg(true)).expect("recovery with both mirrors");
    assert_last_commits(&rvm, 20);
    drop(rvm);
    a.kill();
    let rvm = Rvm::open(cfg(true)).expect("recovery from the rewritten mirror alone");
    assert_last_commits(&rvm, 20);
    drop(b);
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
