//! `camelot chaos`: memory servers on testbed hosts, a workload on another host that
//! records every read's and write's invocation and return, faults from a seeded
//! schedule, heal, then checkers over the history and what is left. PASS/FAIL with the
//! seed to replay.
//!
//! Two processes: this one (the orchestrator, in the machine's namespace: it builds the
//! testbed, starts and kills servers, injects faults, judges) and `camelot chaos-worker`
//! on host h0 (the client: it can reach the servers only through the emulated network).
//! They talk over the worker's stdin (`healed`, `stop`) and stdout (`ready`, then one
//! JSON report).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use camelot_testbed::history::{
    check_acked_writes_present, check_linearizable, Action, Found, Linearizability, Op,
    HISTORY_OPS_MAX,
};
use camelot_testbed::plan::{LinkSpec, Plan};
use camelot_testbed::schedule::{
    parse_duration_ms, parse_kinds, schedule, FaultEvent, FaultKind, ScheduleSpec,
};
use camelot_testbed::{Testbed, DEFAULT_RUN_DIR};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

/// The port every memory server listens on, on its own host's address.
const SERVER_PORT: u16 = 7000;
const SERVER_START: Duration = Duration::from_secs(10);
/// How long the worker may take to create its volume or instance and say `ready`.
const WORKER_READY: Duration = Duration::from_secs(30);
/// How long the worker may take to repair, check and report after `stop`.
const WORKER_REPORT: Duration = Duration::from_secs(120);
/// The worker's report is one JSON line of at most this many bytes.
const REPORT_BYTES_MAX: usize = 256 << 20;
/// RAID-5 volume geometry: small, so a rebuild between two faults takes milliseconds.
const VOLUME_BYTES: u64 = 4 << 20;
const CHUNK_BYTES: u64 = 64 << 10;
const BLOCK_BYTES: usize = 4096;
/// Pool log for the RVM face: one 8-byte commit a record, so a few MiB is plenty.
const RVM_LOG_BYTES: u64 = 8 << 20;
/// After an error the worker waits this long before its next operation, so a dead
/// member does not turn the loop into a spin.
const ERROR_BACKOFF: Duration = Duration::from_millis(20);
const REPAIR_ROUNDS_MAX: usize = 10;
/// How long after a heal the runner waits for the RAID-5 worker to say the volume is
/// whole again before it counts a failure and goes on with the schedule.
const WHOLE_WAIT_MAX: Duration = Duration::from_secs(60);
/// The worker's line that the volume has every member, rebuilt and scrubbed.
const WHOLE_LINE: &str = "whole";
/// The worker makes at most this many operations a second (unpaced it made 1,500–2,800
/// writes on this machine): faults, not volume, are what a chaos run is for, and the
/// history of a 30-minute run stays under 2M operations.
const OPS_PER_S_MAX: u64 = 1_000;
/// One operation in this many is a read of a seeded random register, the rest writes.
const READ_ONE_IN: u32 = 4;
/// Registers the RVM face's transactions set (one each): its history is split per
/// register for the linearizability search, which is quadratic in one key's operations.
const RVM_COUNTERS: u64 = 1024;
const PACING_SLEEP: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Face {
    /// A RAID-5 volume over three memory servers (one is lost at a time).
    Raid5,
    /// RVM on a mirrored pool (two memory servers).
    Rvm,
}

impl Face {
    fn servers(self) -> usize {
        match self {
            Face::Raid5 => 3,
            Face::Rvm => 2,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Face::Raid5 => "raid5",
            Face::Rvm => "rvm",
        }
    }
}

#[derive(Args)]
pub struct ChaosArgs {
    /// The schedule's seed: the same seed replays the same faults.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long the workload runs: seconds, or 60s, 30m, 2h (every fault is healed
    /// before it ends).
    #[arg(long, default_value = "60s")]
    duration: String,
    /// Fault kinds the schedule draws from.
    #[arg(long, default_value = "kill,pause,partition")]
    faults: String,
    #[arg(long, value_enum, default_value_t = Face::Raid5)]
    face: Face,
    /// Shorter gaps (0.7–1.5 s) and holds (0.3–1.2 s) than the default (2–10 s, 1–5 s),
    /// so a short run still sees several faults: what tests run.
    #[arg(long)]
    quick: bool,
    /// Every link's rate.
    #[arg(long, default_value = "1gbit")]
    rate: String,
    /// Where the testbed keeps its state.
    #[arg(long, env = "CAMELOT_TESTBED_DIR", default_value = DEFAULT_RUN_DIR)]
    run_dir: PathBuf,
    /// Test only: the worker acknowledges some writes without making them, so the
    /// checkers must report FAIL (they are shown able to).
    #[arg(long, hide = true)]
    broken_ack_before_write: bool,
    /// Test only (raid5): stripe 0's parity is overwritten behind the volume's back just
    /// before the final scrub, so the scrub checker must report FAIL (it is shown able to).
    #[arg(long, hide = true)]
    broken_parity: bool,
    /// Test only: the worker's reads go through a cache that writes never invalidate, so
    /// reads answer from a stale copy and the linearizability checker must report FAIL
    /// (the final state is read past it, so acknowledged-writes-present still passes).
    #[arg(long, hide = true)]
    broken_stale_reads: bool,
}

#[derive(Args)]
pub struct WorkerArgs {
    #[arg(long, value_enum)]
    face: Face,
    #[arg(long, value_delimiter = ',')]
    servers: Vec<SocketAddr>,
    #[arg(long)]
    seed: u64,
    #[arg(long)]
    broken_ack_before_write: bool,
    #[arg(long)]
    broken_parity: bool,
    #[arg(long)]
    broken_stale_reads: bool,
}

/// What the worker reports after `stop`.
#[derive(Debug, Serialize, Deserialize)]
struct Report {
    history: Vec<Op>,
    found: BTreeMap<u64, Found>,
    /// RAID-5: stripes whose parity disagreed with data on the final scrub.
    scrub_mismatches: Option<u64>,
    scrub_skipped: Option<u64>,
    repairs: u64,
    errors: u64,
    first_errors: Vec<String>,
}

const FIRST_ERRORS_MAX: usize = 5;

/// The testbed, removed when this goes out of scope whatever happened.
struct Bed(Testbed, PathBuf);
impl Drop for Bed {
    fn drop(&mut self) {
        if let Err(e) = Testbed::down(&self.0.plan.run, &self.1) {
            eprintln!("chaos: testbed down failed: {e}");
        }
    }
}

struct Servers {
    children: Vec<Option<Child>>,
    addrs: Vec<SocketAddr>,
    logs: PathBuf,
}

impl Servers {
    fn start(&mut self, tb: &Testbed, i: usize) -> Result<()> {
        let exe = std::env::current_exe().context("cannot find the camelot binary")?;
        let host = i + 1;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("server-h{host}.log")))?;
        let mut child = tb
            .command(host, &exe)
            .args([
                "server",
                "--listen",
                &self.addrs[i].to_string(),
                "--memory",
                "256M",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start a server")?;
        if !Testbed::wait_listening(child.id(), self.addrs[i], SERVER_START) {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the server on h{host} did not listen on {} in {SERVER_START:?}",
                self.addrs[i]
            );
        }
        self.children[i] = Some(child);
        Ok(())
    }

    fn reap(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.reap(i);
        }
    }
}

fn tell(stdin: &mut ChildStdin, line: &str) -> Result<()> {
    writeln!(stdin, "{line}")
        .and_then(|_| stdin.flush())
        .context("the chaos worker went away")
}

pub fn run(a: ChaosArgs) -> Result<()> {
    camelot_testbed::require_root()?;
    let kinds = parse_kinds(&a.faults)?;
    let duration = Duration::from_millis(parse_duration_ms(&a.duration)?);
    let (gap_ms, hold_ms) = if a.quick {
        ((700, 1500), (300, 1200))
    } else {
        ((2_000, 10_000), (1_000, 5_000))
    };
    let faults = schedule(&ScheduleSpec {
        seed: a.seed,
        duration_ms: duration.as_millis() as u64,
        kinds: kinds.clone(),
        targets: a.face.servers(),
        gap_ms,
        hold_ms,
    })?;
    let replay = format!(
        "camelot chaos --seed {} --duration {} --faults {} --face {}{}",
        a.seed,
        a.duration,
        kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(","),
        a.face.name(),
        if a.quick { " --quick" } else { "" }
    );
    let run = format!("ch{}", std::process::id() % 1_000_000);
    println!(
        "chaos: seed {} face {} duration {:.1} s, {} faults scheduled (testbed {run})",
        a.seed,
        a.face.name(),
        duration.as_secs_f64(),
        faults.len()
    );
    let plan = Plan::new(
        &run,
        a.face.servers() + 1,
        LinkSpec {
            rate_bits_per_s: Some(camelot_testbed::plan::parse_rate(&a.rate)?),
            ..LinkSpec::default()
        },
    )?;
    crate::testbed::down_on_signal(run.clone(), a.run_dir.clone())?;
    let tb = Testbed::up(plan, &a.run_dir, Duration::ZERO)?;
    let bed = Bed(tb, a.run_dir.clone());
    let tb = &bed.0;
    let logs = std::env::temp_dir().join(format!("camelot-chaos-{run}"));
    std::fs::create_dir_all(&logs)?;
    let addrs: Vec<SocketAddr> = (1..=a.face.servers())
        .map(|h| SocketAddr::V4(SocketAddrV4::new(tb.plan.host_addr(h), SERVER_PORT)))
        .collect();
    let mut servers = Servers {
        children: (0..addrs.len()).map(|_| None).collect(),
        addrs: addrs.clone(),
        logs: logs.clone(),
    };
    for i in 0..addrs.len() {
        servers.start(tb, i)?;
    }

    let exe = std::env::current_exe()?;
    let mut worker_cmd = tb.command(0, &exe);
    worker_cmd
        .args([
            "chaos-worker",
            "--face",
            a.face.name(),
            "--seed",
            &a.seed.to_string(),
            "--servers",
        ])
        .arg(
            addrs
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
    if a.broken_ack_before_write {
        worker_cmd.arg("--broken-ack-before-write");
    }
    if a.broken_parity {
        worker_cmd.arg("--broken-parity");
    }
    if a.broken_stale_reads {
        worker_cmd.arg("--broken-stale-reads");
    }
    let mut worker = worker_cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(logs.join("worker.log"))?)
        .spawn()
        .context("cannot start the chaos worker")?;
    let mut stdin = worker.stdin.take().context("worker stdin")?;
    let stdout = worker.stdout.take().context("worker stdout")?;
    let (lines_tx, lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        loop {
            let mut line = String::new();
            match Read::take(&mut r, REPORT_BYTES_MAX as u64).read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if lines_tx.send(line).is_err() {
                        break;
                    }
                }
            }
        }
    });
    let ready = lines.recv_timeout(WORKER_READY);
    if ready.as_deref().map(str::trim) != Ok("ready") {
        let _ = worker.kill();
        let _ = worker.wait();
        bail!(
            "the chaos worker did not start (log: {})",
            logs.join("worker.log").display()
        );
    }

    // RAID-5 tolerates one lost member, and a member is lost until it is rebuilt, not
    // only while its fault lasts: the next fault waits until the worker says the volume
    // is whole again (rebuilt and scrubbed), or it would be a second loss — a promise
    // RAID-5 does not make (an md array fails the same way). Waiting shifts later faults;
    // one that would no longer be healed before the end is skipped and counted.
    let waits_for_whole = a.face == Face::Raid5;
    let mut whole = true;
    let mut late_repairs = Vec::new();
    let mut skipped = 0usize;
    let started = Instant::now();
    for ev in &faults {
        sleep_until(started, ev.start_ms);
        if waits_for_whole && !whole {
            let deadline = Instant::now() + WHOLE_WAIT_MAX;
            whole = wait_for_line(&lines, WHOLE_LINE, deadline);
            if !whole {
                late_repairs.push(format!(
                    "{:.2} s: the volume was not whole {WHOLE_WAIT_MAX:?} after a heal",
                    started.elapsed().as_secs_f64()
                ));
            }
        }
        let start_ms = started.elapsed().as_millis() as u64;
        if start_ms + ev.hold_ms >= duration.as_millis() as u64 {
            skipped += 1;
            continue;
        }
        apply(tb, &mut servers, ev, started)?;
        sleep_until(started, start_ms + ev.hold_ms);
        heal(tb, &mut servers, ev, started)?;
        tell(&mut stdin, "healed")?;
        whole = false;
    }
    if skipped > 0 {
        println!("  {skipped} faults skipped: waiting for repairs left them no time to heal");
    }
    sleep_until(started, duration.as_millis() as u64);
    tell(&mut stdin, "stop")?;
    let report = recv_skipping(&lines, WHOLE_LINE, Instant::now() + WORKER_REPORT);
    let _ = worker.kill();
    let _ = worker.wait();
    let report: Report = match report {
        Ok(line) => serde_json::from_str(&line).context("the worker's report")?,
        Err(_) => bail!(
            "FAIL seed {}: the worker gave no report in {WORKER_REPORT:?} (log: {}); replay: {replay}",
            a.seed,
            logs.join("worker.log").display()
        ),
    };
    drop(servers);
    drop(bed);

    let violations = check_acked_writes_present(&report.history, &report.found);
    let linearizability = check_linearizable(&report.history, &report.found);
    let writes = report
        .history
        .iter()
        .filter(|o| o.write_value().is_some())
        .count();
    let acked = report
        .history
        .iter()
        .filter(|o| o.acked && o.write_value().is_some())
        .count();
    let reads = report.history.len() - writes;
    let reads_answered = report
        .history
        .iter()
        .filter(|o| o.acked && matches!(o.action, Action::Read(_)))
        .count();
    println!(
        "chaos: {} writes ({} acknowledged, {} failed), {} reads ({} answered), {} repairs, {} errors{}",
        writes,
        acked,
        writes - acked,
        reads,
        reads_answered,
        report.repairs,
        report.errors,
        if report.first_errors.is_empty() {
            String::new()
        } else {
            format!(" (first: {})", report.first_errors.join("; "))
        }
    );
    let mut failed = late_repairs;
    if !violations.is_empty() {
        failed.push(format!(
            "acknowledged writes present: {} violations, e.g. key {}: {}",
            violations.len(),
            violations[0].key,
            violations[0].why
        ));
    } else {
        println!(
            "  acknowledged writes present: ok ({} registers)",
            report.found.len()
        );
    }
    match &linearizability {
        Linearizability::Linearizable { keys, operations } => println!(
            "  linearizable (camelot-check, final state as reads): ok ({keys} registers, {operations} operations)"
        ),
        Linearizability::NotLinearizable { why, .. } => {
            failed.push(format!("linearizable: no, {why}"))
        }
        Linearizability::Inconclusive { key, limit } => failed.push(format!(
            "linearizable: not decided, the search reached {limit} on key {key}"
        )),
    }
    if a.face == Face::Raid5 {
        match (report.scrub_mismatches, report.scrub_skipped) {
            (Some(0), Some(0)) => println!("  raid5 scrub clean: ok"),
            (m, s) => failed.push(format!("raid5 scrub: mismatches {m:?}, skipped {s:?}")),
        }
    } else {
        println!(
            "  rvm recovery matches the last acknowledged commit: {}",
            if violations.is_empty() { "ok" } else { "no" }
        );
    }
    if acked == 0 {
        failed.push("no write was acknowledged: the run checked nothing".into());
    }
    if failed.is_empty() {
        println!("PASS seed {} (replay: {replay})", a.seed);
        let _ = std::fs::remove_dir_all(&logs);
        Ok(())
    } else {
        for f in &failed {
            println!("  {f}");
        }
        println!(
            "FAIL seed {} (replay: {replay}; logs in {})",
            a.seed,
            logs.display()
        );
        bail!("chaos FAIL, seed {}", a.seed)
    }
}

/// Waits until the worker prints `want` (true) or `deadline` passes (false).
fn wait_for_line(lines: &mpsc::Receiver<String>, want: &str, deadline: Instant) -> bool {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.trim() == want => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

/// The worker's next line that is not `skip` (its report comes after any number of them).
fn recv_skipping(
    lines: &mpsc::Receiver<String>,
    skip: &str,
    deadline: Instant,
) -> std::result::Result<String, mpsc::RecvTimeoutError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left)?;
        if line.trim() != skip {
            return Ok(line);
        }
    }
}

fn sleep_until(started: Instant, ms: u64) {
    let at = started + Duration::from_millis(ms);
    let now = Instant::now();
    if at > now {
        std::thread::sleep(at - now);
    }
}

fn apply(tb: &Testbed, servers: &mut Servers, ev: &FaultEvent, started: Instant) -> Result<()> {
    let host = ev.target + 1;
    println!(
        "  {:>7.2} s  {} h{host} for {:.2} s",
        started.elapsed().as_secs_f64(),
        ev.kind.name(),
        ev.hold_ms as f64 / 1000.0
    );
    match ev.kind {
        FaultKind::Kill => {
            tb.kill(&[host])?;
            servers.reap(ev.target);
        }
        FaultKind::Pause => {
            tb.pause(&[host])?;
        }
        FaultKind::Partition => tb.partition(&[host])?,
    }
    Ok(())
}

fn heal(tb: &Testbed, servers: &mut Servers, ev: &FaultEvent, started: Instant) -> Result<()> {
    match ev.kind {
        // A memory server keeps nothing: it comes back empty, as after a crash.
        FaultKind::Kill => servers.start(tb, ev.target)?,
        FaultKind::Pause => {
            tb.resume(&[ev.target + 1])?;
        }
        FaultKind::Partition => tb.heal()?,
    }
    println!("  {:>7.2} s  healed", started.elapsed().as_secs_f64());
    Ok(())
}

// ---------------------------------------------------------------- the worker (on h0)

enum Msg {
    Healed,
    Stop,
}

fn control_channel() -> mpsc::Receiver<Msg> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let msg = match line.as_deref().map(str::trim) {
                Ok("healed") => Msg::Healed,
                // `stop`, or the orchestrator went away.
                _ => Msg::Stop,
            };
            let stop = matches!(msg, Msg::Stop);
            if tx.send(msg).is_err() || stop {
                return;
            }
        }
        let _ = tx.send(Msg::Stop);
    });
    rx
}

/// A block's content for a value: its number and the value, then a fill derived from
/// both, so a block holding anything else (torn, stale, zero) is recognised.
fn block_bytes(block: u64, value: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_BYTES];
    b[..8].copy_from_slice(&block.to_le_bytes());
    b[8..16].copy_from_slice(&value.to_le_bytes());
    let word = (value.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ block).to_le_bytes();
    for (i, x) in b[16..].iter_mut().enumerate() {
        *x = word[i % 8];
    }
    b
}

fn decode_block(block: u64, b: &[u8]) -> Found {
    if b.iter().all(|&x| x == 0) {
        return Found::Value(0);
    }
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[8..16]);
    let value = u64::from_le_bytes(v);
    if value != 0 && block_bytes(block, value) == b {
        Found::Value(value)
    } else {
        Found::Garbage
    }
}

struct Recorder {
    started: Instant,
    history: Vec<Op>,
    errors: u64,
    first_errors: Vec<String>,
    next_value: u64,
    broken: bool,
    /// The `--broken-stale-reads` component: a read cache filled by reads and never
    /// invalidated by writes (`None`: reads go to the store).
    stale_cache: Option<std::collections::HashMap<u64, Found>>,
}

impl Recorder {
    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// Runs one write through `f`, recording it. With the broken flag every fifth write
    /// is acknowledged without being made.
    fn write(&mut self, key: u64, f: impl FnOnce(u64) -> std::result::Result<(), String>) {
        self.next_value += 1;
        let value = self.next_value;
        let invoked_us = self.now_us();
        let result = if self.broken && value.is_multiple_of(5) {
            Ok(())
        } else {
            f(value)
        };
        let returned_us = self.now_us();
        if let Err(e) = &result {
            self.error(e.clone());
        }
        if self.history.len() < HISTORY_OPS_MAX {
            self.history.push(Op {
                client: 0,
                key,
                action: Action::Write(value),
                invoked_us,
                returned_us,
                acked: result.is_ok(),
            });
        }
        if result.is_err() {
            std::thread::sleep(ERROR_BACKOFF);
        }
    }

    /// Runs one read through `f` (or, in the broken variant, answers from the stale
    /// cache when it holds the key), recording what it found.
    fn read(&mut self, key: u64, f: impl FnOnce() -> std::result::Result<Found, String>) {
        let invoked_us = self.now_us();
        let cached = self.stale_cache.as_ref().and_then(|c| c.get(&key).copied());
        let result = match cached {
            Some(f) => Ok(f),
            None => f(),
        };
        let returned_us = self.now_us();
        if let (Some(cache), Ok(found)) = (self.stale_cache.as_mut(), &result) {
            cache.entry(key).or_insert(*found);
        }
        if let Err(e) = &result {
            self.error(e.clone());
        }
        if self.history.len() < HISTORY_OPS_MAX {
            self.history.push(Op {
                client: 0,
                key,
                action: Action::Read(result.as_ref().copied().unwrap_or(Found::Unreadable)),
                invoked_us,
                returned_us,
                acked: result.is_ok(),
            });
        }
        if result.is_err() {
            std::thread::sleep(ERROR_BACKOFF);
        }
    }

    /// The broken variant's last word: one more write acknowledged and never made, as
    /// a store that acks before persisting and then loses the write. (Every fifth write
    /// is enough to fail RAID-5's thousand registers; RVM's one register shows only
    /// the last write, so the broken run always ends with one.)
    fn finish(&mut self, key: u64) {
        if self.broken {
            self.next_value += 1;
            let t = self.now_us();
            self.history.push(Op {
                client: 0,
                key,
                action: Action::Write(self.next_value),
                invoked_us: t,
                returned_us: t,
                acked: true,
            });
        }
    }

    fn error(&mut self, e: String) {
        self.errors += 1;
        // Every error also goes to the worker's log (its stderr), with the run's clock:
        // the report keeps only the first few, and a failed run is read from the log.
        eprintln!("{:>10.3} s  error: {e}", self.now_us() as f64 / 1e6);
        if self.first_errors.len() < FIRST_ERRORS_MAX {
            self.first_errors.push(e);
        }
    }

    /// Whether the next operation should wait: the history is full (then the worker
    /// only waits for `stop`, so its repair never races the orchestrator's faults), or
    /// the operations are ahead of `OPS_PER_S_MAX` (pacing, so a 30-minute run's history
    /// stays a few hundred MB at most). Sleeps a little if so.
    fn hold_back(&self) -> bool {
        let due_us = self.history.len() as u64 * 1_000_000 / OPS_PER_S_MAX;
        let ahead = due_us > self.now_us();
        if self.history.len() >= HISTORY_OPS_MAX || ahead {
            std::thread::sleep(PACING_SLEEP);
            return true;
        }
        false
    }
}

pub fn worker(a: WorkerArgs) -> Result<()> {
    if a.servers.len() != a.face.servers() {
        bail!("--servers: {} for {}", a.face.servers(), a.face.name());
    }
    let control = control_channel();
    let rec = Recorder {
        started: Instant::now(),
        history: Vec::new(),
        errors: 0,
        first_errors: Vec::new(),
        next_value: 0,
        broken: a.broken_ack_before_write,
        stale_cache: a.broken_stale_reads.then(std::collections::HashMap::new),
    };
    let report = match a.face {
        Face::Raid5 => worker_raid5(&a, rec, &control)?,
        Face::Rvm => worker_rvm(&a, rec, &control)?,
    };
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, &report)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}

/// Rebuilds whatever is missing (a member restarted empty may be noticed only by the
/// scrub) until a scrub runs over every stripe with nobody missing; that scrub's report,
/// or `None` if the volume is not whole after [`REPAIR_ROUNDS_MAX`] rounds.
fn repair_until_whole(
    vol: &camelot_blocks::volume::Volume,
    rec: &mut Recorder,
    repairs: &mut u64,
) -> Option<camelot_blocks::volume::ScrubReport> {
    for _ in 0..REPAIR_ROUNDS_MAX {
        let st = vol.status();
        if !st.missing.is_empty() {
            let mut all = true;
            for &m in &st.missing {
                if let Err(e) = vol.rebuild(m, st.members[m].addr, 0) {
                    rec.error(format!("rebuild of member {m}: {e}"));
                    all = false;
                }
            }
            if all {
                *repairs += 1;
            }
            continue;
        }
        match vol.scrub(false) {
            Ok(r) if vol.status().missing.is_empty() && r.skipped == 0 => return Some(r),
            Ok(_) => {}
            Err(e) => rec.error(format!("scrub: {e}")),
        }
    }
    None
}

/// The `--broken-parity` fault: a few bytes of stripe 0's parity chunk rewritten through
/// a client of its own, as a write hole or a bit flip would leave them.
fn overwrite_parity_of_stripe_0(
    vol: &camelot_blocks::volume::Volume,
    servers: &[SocketAddr],
) -> Result<()> {
    let layout = vol.layout();
    let member = layout.member_of(0, layout.data_slots());
    let client = camelot_client::Client::connect(
        camelot_client::ClusterMap::from_addrs(&[servers[member]]),
        camelot_client::ClientConfig::default(),
    )?;
    let region = client.lookup(&camelot_blocks::volume::region_name(vol.name(), member))?;
    let base = region.size - layout.member_data_bytes();
    let old = client.read(&region, base, 8)?;
    let flipped: Vec<u8> = old.iter().map(|b| !b).collect();
    client.write(&region, base, flipped)?;
    Ok(())
}

/// Drains the control channel: (healed since last look, stop).
fn poll(control: &mpsc::Receiver<Msg>) -> (bool, bool) {
    let (mut healed, mut stop) = (false, false);
    loop {
        match control.try_recv() {
            Ok(Msg::Healed) => healed = true,
            Ok(Msg::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                stop = true;
                break;
            }
            Err(mpsc::TryRecvError::Empty) => break,
        }
    }
    (healed, stop)
}

/// One turn's look at the control channel: true to stop. A heal heard is noted in
/// `repair_pending` here, before pacing may skip the rest of the turn: `poll` has
/// drained the message, and when the flag was set only after the pacing check a heal
/// heard on a paced turn was dropped — never repaired, so the runner waited its 60 s for
/// `whole` and its next fault was a second loss (raid5 seeds 103 and 104).
fn take_control(control: &mpsc::Receiver<Msg>, repair_pending: &mut bool) -> bool {
    let (healed, stop) = poll(control);
    *repair_pending |= healed;
    stop
}

fn worker_raid5(
    a: &WorkerArgs,
    mut rec: Recorder,
    control: &mpsc::Receiver<Msg>,
) -> Result<Report> {
    use camelot_blocks::layout::Level;
    use camelot_blocks::volume::{Volume, VolumeConfig};
    use rand::{Rng, SeedableRng};

    let config = VolumeConfig::default();
    let vol = Volume::create(
        "chaos",
        Level::Raid5,
        &a.servers,
        CHUNK_BYTES,
        VOLUME_BYTES,
        &config,
    )
    .context("cannot create the volume")?;
    let blocks = VOLUME_BYTES / BLOCK_BYTES as u64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    println!("ready");
    std::io::stdout().flush()?;
    let mut repairs = 0u64;
    let mut repair_pending = false;
    let mut read_buf = vec![0u8; BLOCK_BYTES];
    loop {
        if take_control(control, &mut repair_pending) {
            break;
        }
        if rec.hold_back() {
            continue;
        }
        if repair_pending && repair_until_whole(&vol, &mut rec, &mut repairs).is_some() {
            repair_pending = false;
            println!("{WHOLE_LINE}");
            std::io::stdout().flush()?;
        }
        let block = rng.gen_range(0..blocks);
        if rng.gen_ratio(1, READ_ONE_IN) {
            rec.read(block, || {
                vol.read(block * BLOCK_BYTES as u64, &mut read_buf)
                    .map_err(|e| format!("read of block {block}: {e}"))?;
                Ok(decode_block(block, &read_buf))
            });
        } else {
            rec.write(block, |value| {
                vol.write(block * BLOCK_BYTES as u64, &block_bytes(block, value))
                    .map_err(|e| e.to_string())
            });
        }
    }
    rec.finish(0);
    let mut final_scrub = repair_until_whole(&vol, &mut rec, &mut repairs);
    if a.broken_parity && final_scrub.is_some() {
        // After every rebuild, so no rebuild can recompute the parity it changes.
        if let Err(e) = overwrite_parity_of_stripe_0(&vol, &a.servers) {
            rec.error(format!("broken parity: {e}"));
        }
        final_scrub = match vol.scrub(false) {
            Ok(r) => Some(r),
            Err(e) => {
                rec.error(format!("scrub: {e}"));
                None
            }
        };
    }
    let mut found = BTreeMap::new();
    let mut buf = vec![0u8; BLOCK_BYTES];
    let written: std::collections::BTreeSet<u64> = rec
        .history
        .iter()
        .filter(|o| o.write_value().is_some())
        .map(|o| o.key)
        .collect();
    for &block in &written {
        let f = match vol.read(block * BLOCK_BYTES as u64, &mut buf) {
            Ok(()) => decode_block(block, &buf),
            Err(e) => {
                rec.error(format!("final read of block {block}: {e}"));
                Found::Unreadable
            }
        };
        found.insert(block, f);
    }
    Ok(Report {
        scrub_mismatches: final_scrub.as_ref().map(|r| r.mismatches),
        scrub_skipped: final_scrub.as_ref().map(|r| r.skipped),
        history: rec.history,
        found,
        repairs,
        errors: rec.errors,
        first_errors: rec.first_errors,
    })
}

fn worker_rvm(a: &WorkerArgs, mut rec: Recorder, control: &mpsc::Receiver<Msg>) -> Result<Report> {
    use camelot_rvm::{BackendConfig, Config, Rvm};
    use rand::{Rng, SeedableRng};

    let backend = BackendConfig::Pool {
        servers: a.servers.clone(),
        token: None,
        log_bytes: RVM_LOG_BYTES,
    };
    let open = |recover: bool| -> std::result::Result<(Rvm, camelot_rvm::Segment), String> {
        let rvm = Rvm::open(Config::new(backend.clone(), "chaos").recover(recover))
            .map_err(|e| format!("open: {e}"))?;
        let seg = match rvm.segment("counters") {
            Some(s) => s,
            None => rvm
                .alloc("counters", RVM_COUNTERS * 8)
                .map_err(|e| format!("alloc: {e}"))?,
        };
        Ok((rvm, seg))
    };
    let mut current = Some(open(false).map_err(anyhow::Error::msg)?);
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    println!("ready");
    std::io::stdout().flush()?;
    let mut repairs = 0u64;
    loop {
        let (_, stop) = poll(control);
        if stop {
            break;
        }
        if rec.hold_back() {
            continue;
        }
        if current.is_none() {
            // A failed commit leaves the instance failed: only a recovering open
            // decides what the log holds.
            match open(true) {
                Ok(c) => {
                    current = Some(c);
                    repairs += 1;
                }
                Err(e) => {
                    rec.error(e);
                    std::thread::sleep(ERROR_BACKOFF);
                    continue;
                }
            }
        }
        let Some((rvm, seg)) = current.as_ref() else {
            continue;
        };
        let counter = rng.gen_range(0..RVM_COUNTERS);
        if rng.gen_ratio(1, READ_ONE_IN) {
            // What the instance's segment holds: after a recovering open, what
            // recovery made of the log.
            rec.read(counter, || {
                seg.read_u64(counter * 8)
                    .map(Found::Value)
                    .map_err(|e| format!("read of counter {counter}: {e}"))
            });
            continue;
        }
        let mut failed = false;
        rec.write(counter, |value| {
            let mut txn = rvm.begin();
            let r = txn
                .set_range(seg, counter * 8, 8)
                .and_then(|()| txn.write_u64(seg, counter * 8, value))
                .and_then(|()| txn.commit())
                .map_err(|e| format!("commit: {e}"));
            failed = r.is_err();
            r
        });
        if failed {
            current = None;
        }
    }
    rec.finish(0);
    drop(current);
    // Healed: recovery must find each counter's last acknowledged commit (or a later one).
    let written: std::collections::BTreeSet<u64> = rec
        .history
        .iter()
        .filter(|o| o.write_value().is_some())
        .map(|o| o.key)
        .collect();
    let mut found: BTreeMap<u64, Found> = written.iter().map(|&k| (k, Found::Unreadable)).collect();
    for _ in 0..REPAIR_ROUNDS_MAX {
        match open(true) {
            Ok((_rvm, seg)) => {
                for &k in &written {
                    match seg.read_u64(k * 8) {
                        Ok(v) => {
                            found.insert(k, Found::Value(v));
                        }
                        Err(e) => rec.error(format!("final read of counter {k}: {e}")),
                    }
                }
                break;
            }
            Err(e) => {
                rec.error(format!("final recovery: {e}"));
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
    Ok(Report {
        history: rec.history,
        found,
        scrub_mismatches: None,
        scrub_skipped: None,
        repairs,
        errors: rec.errors,
        first_errors: rec.first_errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (raid5 seeds 103 and 104): a heal heard on a turn that pacing then
    /// skips stays pending until a repair takes it.
    #[test]
    fn a_heal_heard_on_a_paced_turn_is_not_lost() {
        let (tx, rx) = mpsc::channel();
        let mut repair_pending = false;
        tx.send(Msg::Healed).unwrap();
        assert!(!take_control(&rx, &mut repair_pending));
        // The turn is held back here (no repair); the next turn hears nothing new.
        assert!(!take_control(&rx, &mut repair_pending));
        assert!(repair_pending, "the heal was dropped");
        tx.send(Msg::Stop).unwrap();
        assert!(take_control(&rx, &mut repair_pending));
    }

    #[test]
    fn blocks_decode_to_their_value_and_nothing_else() {
        let b = block_bytes(7, 42);
        assert_eq!(decode_block(7, &b), Found::Value(42));
        assert_eq!(decode_block(8, &b), Found::Garbage);
        assert_eq!(decode_block(7, &vec![0; BLOCK_BYTES]), Found::Value(0));
        let mut torn = b.clone();
        torn[2000] ^= 1;
        assert_eq!(decode_block(7, &torn), Found::Garbage);
    }
}
