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
/// The worker's line that the volume has every member, rebuilt and scrubbed (kv: that
/// the map has every node, live, with R full replicas of every partition).
const WHOLE_LINE: &str = "whole";
/// kv: the worker's line that node N's registration is gone and the map no longer has
/// it: the runner restarts it if its process is dead (one still running registers again
/// by itself).
const LOST_LINE_PREFIX: &str = "lost ";
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

/// kv face: where etcd listens on the control host (its peer port stays on that host's
/// loopback), and how the cluster is set up.
const ETCD_PORT: u16 = 2379;
const ETCD_PEER_URL: &str = "http://127.0.0.1:2380";
const ETCD_START: Duration = Duration::from_secs(15);
/// The servers' and the controller's lease TTL (the cluster's default): a pause or a
/// partition longer than this is a failover.
const KV_LEASE_TTL_S: u64 = 2;
/// How long a primary waits for its backup before it answers REPLICA_UNAVAILABLE.
const KV_REPLICATION_TIMEOUT_MS: u64 = 500;
/// The kv face's last fault: one server (the one leading most partitions in the
/// worker's map, h1 in a run that never killed it) and the worker cut off from the rest
/// (its backups and etcd) this long, then that server killed, the partition healed and
/// the server restarted. It answers the writes it leads while it cannot reach its
/// backups: a correct primary only with REPLICA_UNAVAILABLE, a broken one
/// (`--unsafe-ack-before-replication`) with an acknowledgement — lost with it. The
/// worker picks the server (asked with `finale`), and its clients then use only keys
/// that server leads: of random keys two in three are led by the others, whose
/// operations wait out their timeout in the partition, so an unfocused finale made a
/// handful of writes to the cut-off server, often all overwritten again before the
/// final read (the broken servers passed seeds 8 and 9 that way). A server killed
/// earlier in the run rejoins leading nothing, hence the worker's pick.
const KV_FINALE_HOLD: Duration = Duration::from_secs(2);
/// The seeded schedule ends this long before the run does, to leave room for the finale.
const KV_FINALE_MS: u64 = 3_000;
/// The orchestrator's word to the worker before the kv finale, and the start of the
/// worker's answer (`finale N`: the server to cut off).
const FINALE_LINE: &str = "finale";
/// How long the orchestrator waits for that answer (then it cuts off server 0).
const FINALE_TARGET_WAIT: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Face {
    /// A RAID-5 volume over three memory servers (one is lost at a time).
    Raid5,
    /// RVM on a mirrored pool (two memory servers).
    Rvm,
    /// A key-value cluster with replication R=2: three `camelot server --etcd` nodes,
    /// etcd and the failover controller on a host of their own (needs the `etcd` build).
    Kv,
}

impl Face {
    fn servers(self) -> usize {
        match self {
            Face::Raid5 => 3,
            Face::Rvm => 2,
            Face::Kv => 3,
        }
    }
    /// Testbed hosts: the worker's (h0), the servers', and for kv the control host
    /// (etcd and the controller), which no fault targets.
    fn hosts(self) -> usize {
        match self {
            Face::Kv => self.servers() + 2,
            _ => self.servers() + 1,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Face::Raid5 => "raid5",
            Face::Rvm => "rvm",
            Face::Kv => "kv",
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
    /// Test only (kv): every server acknowledges writes before its backup has them, so
    /// the final fault (backups paused, their primary killed) loses acknowledged writes
    /// and acknowledged-writes-present must report FAIL (it is shown able to).
    #[arg(long, hide = true)]
    unsafe_ack_before_replication: bool,
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
    /// kv: the etcd endpoint (on the control host).
    #[arg(long)]
    etcd: Option<String>,
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
    /// kv: the map's epoch when the final state was read (1: the controller never
    /// published a failover).
    #[serde(default)]
    map_epoch: Option<u64>,
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
    /// Flags after `--listen ADDR --memory M`, per server (kv: its cluster membership).
    extra: Vec<Vec<String>>,
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
            .args(&self.extra[i])
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

    /// Whether server `i`'s process is running (not killed, not exited).
    fn is_running(&mut self, i: usize) -> bool {
        self.children[i]
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
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
    #[cfg(not(feature = "etcd"))]
    if a.face == Face::Kv {
        bail!(
            "--face kv: this camelot was built without etcd support: rebuild with \
             `cargo build -p camelot --features etcd` (its build needs protoc, which \
             scripts/setup.sh installs)"
        );
    }
    let duration_ms = duration.as_millis() as u64;
    // kv: the seeded faults end before the finale (see KV_FINALE_HOLD).
    let schedule_ms = match a.face {
        Face::Kv if duration_ms < 2 * KV_FINALE_MS => {
            bail!(
                "--face kv needs --duration of at least {} s",
                2 * KV_FINALE_MS / 1000
            )
        }
        Face::Kv => duration_ms - KV_FINALE_MS,
        _ => duration_ms,
    };
    let faults = schedule(&ScheduleSpec {
        seed: a.seed,
        duration_ms: schedule_ms,
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
        a.face.hosts(),
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
    // kv: etcd first (the servers register in it), the controller after the servers.
    let control_host = a.face.servers() + 1;
    let mut helpers = Helpers::default();
    let etcd_url = if a.face == Face::Kv {
        Some(start_etcd(tb, control_host, &logs, &mut helpers)?)
    } else {
        None
    };
    let extra = (0..addrs.len())
        .map(|i| match &etcd_url {
            None => Vec::new(),
            Some(url) => {
                let mut v: Vec<String> = vec![
                    "--etcd".into(),
                    url.clone(),
                    "--node-id".into(),
                    i.to_string(),
                    "--lease-ttl".into(),
                    KV_LEASE_TTL_S.to_string(),
                    "--replication-timeout-ms".into(),
                    KV_REPLICATION_TIMEOUT_MS.to_string(),
                ];
                if a.unsafe_ack_before_replication {
                    v.push("--unsafe-ack-before-replication".into());
                }
                v
            }
        })
        .collect();
    let mut servers = Servers {
        children: (0..addrs.len()).map(|_| None).collect(),
        addrs: addrs.clone(),
        logs: logs.clone(),
        extra,
    };
    for i in 0..addrs.len() {
        servers.start(tb, i)?;
    }
    if let Some(url) = &etcd_url {
        start_controller(tb, control_host, url, &logs, &mut helpers)?;
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
    if let Some(url) = &etcd_url {
        worker_cmd.args(["--etcd", url]);
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
    //
    // The kv cluster (R=2) is the same: a node is lost until the controller has failed
    // it over, it is back (a killed one restarted by this runner, as a supervisor would,
    // once the worker — which sees etcd — says its registration is gone: `lost N`; one
    // paused or cut off past its lease registers again by itself) and the map
    // has R full replicas of every partition on all three nodes again (`whole`).
    let waits_for_whole = matches!(a.face, Face::Raid5 | Face::Kv);
    let mut whole = true;
    let mut late_repairs = Vec::new();
    let mut skipped = 0usize;
    let started = Instant::now();
    let wait_whole = |servers: &mut Servers, late_repairs: &mut Vec<String>| -> Result<bool> {
        let deadline = Instant::now() + WHOLE_WAIT_MAX;
        let whole = wait_for_whole(&lines, deadline, |node| {
            // A server still running (paused or cut off past its lease) registers again
            // by itself; restarting it would race its new registration.
            if servers.is_running(node) {
                println!(
                    "  {:>7.2} s  node {node} lost its registration: its server runs on and registers again",
                    started.elapsed().as_secs_f64(),
                );
                return Ok(());
            }
            println!(
                "  {:>7.2} s  node {node} lost its registration: restarting h{}",
                started.elapsed().as_secs_f64(),
                node + 1
            );
            servers.reap(node);
            servers.start(tb, node)
        })?;
        if !whole {
            late_repairs.push(format!(
                "{:.2} s: the {} was not whole {WHOLE_WAIT_MAX:?} after a heal",
                started.elapsed().as_secs_f64(),
                if a.face == Face::Kv {
                    "cluster"
                } else {
                    "volume"
                }
            ));
        }
        Ok(whole)
    };
    for ev in &faults {
        sleep_until(started, ev.start_ms);
        if waits_for_whole && !whole {
            whole = wait_whole(&mut servers, &mut late_repairs)?;
        }
        let start_ms = started.elapsed().as_millis() as u64;
        if start_ms + ev.hold_ms >= schedule_ms {
            skipped += 1;
            continue;
        }
        apply(tb, &mut servers, ev, started)?;
        if a.face == Face::Kv && ev.kind == FaultKind::Kill {
            tell(&mut stdin, &format!("killed {}", ev.target))?;
        }
        sleep_until(started, start_ms + ev.hold_ms);
        heal(tb, &mut servers, ev, started, a.face)?;
        tell(&mut stdin, "healed")?;
        whole = false;
    }
    if skipped > 0 {
        println!("  {skipped} faults skipped: waiting for repairs left them no time to heal");
    }
    if a.face == Face::Kv {
        if !whole {
            wait_whole(&mut servers, &mut late_repairs)?;
        }
        sleep_until(started, schedule_ms);
        tell(&mut stdin, FINALE_LINE)?;
        let node = finale_target(&lines, Instant::now() + FINALE_TARGET_WAIT);
        kv_finale(tb, &mut servers, node, started)?;
        tell(&mut stdin, &format!("killed {node}"))?;
        tell(&mut stdin, "healed")?;
        // The final state is read from the repaired cluster.
        wait_whole(&mut servers, &mut late_repairs)?;
    }
    sleep_until(started, duration.as_millis() as u64);
    tell(&mut stdin, "stop")?;
    let report = recv_skipping(&lines, Instant::now() + WORKER_REPORT);
    let _ = worker.kill();
    let _ = worker.wait();
    let report: Report = match report {
        Ok(line) => {
            // Kept with the logs (removed on PASS): a FAIL is read from the history.
            std::fs::write(logs.join("report.json"), &line)?;
            serde_json::from_str(&line).context("the worker's report")?
        }
        Err(_) => bail!(
            "FAIL seed {}: the worker gave no report in {WORKER_REPORT:?} (log: {}); replay: {replay}",
            a.seed,
            logs.join("worker.log").display()
        ),
    };
    drop(servers);
    drop(helpers);
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
    } else if a.face == Face::Rvm {
        println!(
            "  rvm recovery matches the last acknowledged commit: {}",
            if violations.is_empty() { "ok" } else { "no" }
        );
    }
    if let Some(epoch) = report.map_epoch {
        // The first map is epoch 1; every failover, join and re-replication the
        // controller published since is one more.
        println!(
            "  kv map epoch at the end: {epoch} (the controller published {} maps)",
            epoch.saturating_sub(1)
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

/// Processes on the control host (etcd, the controller): killed when dropped (the
/// testbed's `down` would kill them too; this keeps the order: before the namespaces go),
/// and then their scratch directories removed.
#[derive(Default)]
struct Helpers(Vec<Child>, Vec<PathBuf>);
impl Drop for Helpers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        for d in &self.1 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Where etcd keeps its data: in memory (`/dev/shm`) when the machine has it. The chaos
/// run tests Camelot, not the disk under etcd: on a disk shared with builds, etcd's WAL
/// syncs took up to 4.5 s here, every lease in the cluster expired at once and the run
/// spent its remaining faults on a cluster with no registered node.
fn etcd_data_dir(logs: &std::path::Path) -> PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    match logs.file_name() {
        Some(name) if shm.is_dir() => shm.join(name).with_extension("etcd"),
        _ => logs.join("etcd-data"),
    }
}

/// Starts a single-member etcd on `host`, listening for clients on that host's testbed
/// address only (its peer port on the host's own loopback): nothing outside the testbed
/// can reach it. Its data directory is [`etcd_data_dir`]. Returns its endpoint.
fn start_etcd(
    tb: &Testbed,
    host: usize,
    logs: &std::path::Path,
    helpers: &mut Helpers,
) -> Result<String> {
    let addr = SocketAddr::V4(SocketAddrV4::new(tb.plan.host_addr(host), ETCD_PORT));
    let url = format!("http://{addr}");
    let data = etcd_data_dir(logs);
    helpers.1.push(data.clone());
    let child = tb
        .command(host, "etcd")
        .args(["--name", "chaos", "--data-dir"])
        .arg(&data)
        .args([
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            ETCD_PEER_URL,
            "--initial-advertise-peer-urls",
            ETCD_PEER_URL,
            "--initial-cluster",
            &format!("chaos={ETCD_PEER_URL}"),
            "--initial-cluster-state",
            "new",
            "--log-level",
            "warn",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(logs.join("etcd.log"))?)
        .spawn()
        .context("cannot start etcd (is Debian's etcd-server installed?)")?;
    let pid = child.id();
    helpers.0.push(child);
    if !Testbed::wait_listening(pid, addr, ETCD_START) {
        bail!(
            "etcd on h{host} did not listen on {addr} in {ETCD_START:?} (log: {})",
            logs.join("etcd.log").display()
        );
    }
    Ok(url)
}

fn start_controller(
    tb: &Testbed,
    host: usize,
    etcd: &str,
    logs: &std::path::Path,
    helpers: &mut Helpers,
) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the camelot binary")?;
    let log = std::fs::File::create(logs.join("controller.log"))?;
    let child = tb
        .command(host, &exe)
        .args(["cluster", "controller", "--etcd", etcd, "--name", "chaos"])
        .args(["--lease-ttl", &KV_LEASE_TTL_S.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("cannot start the controller")?;
    helpers.0.push(child);
    Ok(())
}

/// The server the worker names for the finale (its line `finale N`), or server 0 if it
/// names none by `deadline`. Other lines are skipped: only a run whose cluster was not
/// whole again before the finale (a failure already) has any to say here.
fn finale_target(lines: &mpsc::Receiver<String>, deadline: Instant) -> usize {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = lines.recv_timeout(left) else {
            return 0;
        };
        let named = line
            .trim()
            .strip_prefix(FINALE_LINE)
            .and_then(|rest| rest.trim().parse::<usize>().ok());
        if let Some(node) = named.filter(|n| *n < Face::Kv.servers()) {
            return node;
        }
    }
}

/// The kv face's last fault (see [`KV_FINALE_HOLD`]): h0 (the worker) and server
/// `node` cut off from the other servers (every backup of its partitions) and the
/// control host; `node` killed; the partition healed. It comes back as after any kill
/// (`lost N`, then a restart).
fn kv_finale(tb: &Testbed, servers: &mut Servers, node: usize, started: Instant) -> Result<()> {
    let host = node + 1;
    println!(
        "  {:>7.2} s  final fault: partition h0 h{host} for {:.2} s, then kill h{host}",
        started.elapsed().as_secs_f64(),
        KV_FINALE_HOLD.as_secs_f64()
    );
    tb.partition(&[0, host])?;
    // The fault's hold, as the schedule's own holds: not a wait for a condition.
    std::thread::sleep(KV_FINALE_HOLD);
    tb.kill(&[host])?;
    servers.reap(node);
    tb.heal()?;
    println!("  {:>7.2} s  healed", started.elapsed().as_secs_f64());
    Ok(())
}

/// Waits until the worker prints [`WHOLE_LINE`] (true) or `deadline` passes (false);
/// on each `lost N` it prints meanwhile (kv), calls `restart(N)`.
fn wait_for_whole(
    lines: &mpsc::Receiver<String>,
    deadline: Instant,
    mut restart: impl FnMut(usize) -> Result<()>,
) -> Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.trim() == WHOLE_LINE => return Ok(true),
            Ok(line) => {
                if let Some(n) = line.trim().strip_prefix(LOST_LINE_PREFIX) {
                    match n.parse::<usize>() {
                        Ok(n) if n < Face::Kv.servers() => restart(n)?,
                        _ => bail!("the worker said {line:?}"),
                    }
                }
            }
            Err(_) => return Ok(false),
        }
    }
}

/// The worker's report: its next line that is a JSON object (it comes after any number
/// of `whole` and `lost N` lines).
fn recv_skipping(
    lines: &mpsc::Receiver<String>,
    deadline: Instant,
) -> std::result::Result<String, mpsc::RecvTimeoutError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left)?;
        if line.trim_start().starts_with('{') {
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

fn heal(
    tb: &Testbed,
    servers: &mut Servers,
    ev: &FaultEvent,
    started: Instant,
    face: Face,
) -> Result<()> {
    match ev.kind {
        // A kv node comes back only once its registration is gone (`lost N`): a node
        // registers under its id once, and a process that restarts while its old lease
        // lives is refused — after it has followed the map (see the report on issue 21).
        FaultKind::Kill if face == Face::Kv => {}
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
    /// kv: server N was killed (its registration outlives it by up to a lease TTL, so
    /// the cluster is not whole until it has been lost and is back).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    Killed(usize),
    /// kv: the finale is next. The worker names the server it cuts off (`finale N`,
    /// the one leading most partitions), and the clients use what it leads until it is
    /// killed.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    Finale,
    Stop,
}

fn control_channel() -> mpsc::Receiver<Msg> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let msg = match line.as_deref().map(str::trim) {
                Ok("healed") => Msg::Healed,
                Ok(l) if l.starts_with("killed ") => match l["killed ".len()..].parse() {
                    Ok(n) => Msg::Killed(n),
                    Err(_) => Msg::Stop,
                },
                Ok(FINALE_LINE) => Msg::Finale,
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
    /// Writes made so far (the next one's value is derived from it, see `value_of`).
    next_value: u64,
    /// This recorder's client, and how many clients share the run: client `c`'s `n`th
    /// write writes `(n - 1) * clients + c + 1`, so no two writes write the same value.
    client: u32,
    clients: u32,
    /// This recorder's share of [`OPS_PER_S_MAX`].
    ops_per_s_max: u64,
    broken: bool,
    /// The `--broken-stale-reads` component: a read cache filled by reads and never
    /// invalidated by writes (`None`: reads go to the store).
    stale_cache: Option<std::collections::HashMap<u64, Found>>,
}

impl Recorder {
    fn new(
        started: Instant,
        client: u32,
        clients: u32,
        broken: bool,
        stale_reads: bool,
    ) -> Recorder {
        Recorder {
            started,
            history: Vec::new(),
            errors: 0,
            first_errors: Vec::new(),
            next_value: 0,
            client,
            clients,
            ops_per_s_max: (OPS_PER_S_MAX / u64::from(clients.max(1))).max(1),
            broken,
            stale_cache: stale_reads.then(std::collections::HashMap::new),
        }
    }

    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// The value of this client's `n`th write (n ≥ 1).
    fn value_of(&self, n: u64) -> u64 {
        (n - 1) * u64::from(self.clients) + u64::from(self.client) + 1
    }

    /// Runs one write through `f`, recording it. With the broken flag every fifth write
    /// is acknowledged without being made.
    fn write(&mut self, key: u64, f: impl FnOnce(u64) -> std::result::Result<(), String>) {
        self.next_value += 1;
        let value = self.value_of(self.next_value);
        let invoked_us = self.now_us();
        let result = if self.broken && self.next_value.is_multiple_of(5) {
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
                client: self.client,
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
                client: self.client,
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
                client: self.client,
                key,
                action: Action::Write(self.value_of(self.next_value)),
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
        let due_us = self.history.len() as u64 * 1_000_000 / self.ops_per_s_max;
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
    let rec = Recorder::new(
        Instant::now(),
        0,
        1,
        a.broken_ack_before_write,
        a.broken_stale_reads,
    );
    let report = match a.face {
        Face::Raid5 => worker_raid5(&a, rec, &control)?,
        Face::Rvm => worker_rvm(&a, rec, &control)?,
        #[cfg(feature = "etcd")]
        Face::Kv => kv::worker(&a, rec.started, &control)?,
        #[cfg(not(feature = "etcd"))]
        Face::Kv => bail!("--face kv needs the etcd build"),
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
            Ok(Msg::Killed(_) | Msg::Finale) => {}
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
        map_epoch: None,
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
        map_epoch: None,
    })
}

/// The kv face's worker: `KV_CLIENTS` client threads over the cluster, each recording
/// its own history, and a thread that keeps their maps current.
#[cfg(feature = "etcd")]
mod kv {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::Arc;

    use camelot_client::{
        Client, ClientConfig, ClusterMap as ClientMap, MapSource, NodeInfo, PartitionTable,
    };
    use camelot_cluster::etcd::{EtcdCluster, EtcdError};
    use camelot_cluster::failover::Alive;
    use camelot_cluster::follow::EtcdMapSource;
    use camelot_cluster::{ClusterMap, Node, PREFIX_DEFAULT};
    use rand::{Rng, SeedableRng};

    use super::*;

    const KV_PARTITIONS: u32 = 64;
    const KV_REPLICATION: u32 = 2;
    /// Registers (keys `chaos-0` …) the kv workload writes and reads.
    const KV_KEYS: u64 = 1024;
    /// Client threads, each a client of its own with a history of its own: writes of one
    /// thread wait for a node while the others go on, as independent clients do.
    const KV_CLIENTS: usize = 4;
    /// Short, so that a thread stuck on a partitioned or paused node goes on to the next
    /// operation soon (the final fault counts on it).
    const KV_REQUEST_TIMEOUT: Duration = Duration::from_millis(250);
    /// A background thread installs the map's newest epoch this often (client threads never
    /// wait on etcd themselves: a partitioned client would wait its 5 s request timeout).
    const KV_MAP_REFRESH: Duration = Duration::from_millis(100);
    /// How long the worker keeps trying to read a register back after `stop` (a failover
    /// may still be under way).
    const KV_FINAL_READ_WAIT: Duration = Duration::from_secs(30);
    /// How long the worker waits for etcd and for the servers to register.
    const KV_SETUP_WAIT: Duration = Duration::from_secs(25);
    /// How often the kv worker looks at the map and the registrations after a heal.
    const KV_HEALTH_POLL: Duration = Duration::from_millis(100);
    /// In the finale, how many random keys a client draws looking for one the cut-off
    /// server leads (each is one with chance 1/3; then it takes the last drawn).
    const FINALE_KEY_DRAWS_MAX: u32 = 64;
    /// `Focus` holds this when no server is singled out.
    const NO_FOCUS: u32 = u32::MAX;

    /// The server the finale cuts off, whose keys the clients use until it is killed
    /// ([`NO_FOCUS`] otherwise).
    type Focus = Arc<AtomicU32>;

    /// The next register to use: a random one, or with a focus (and the client's
    /// partition table) a random one the focused server leads.
    fn next_key(rng: &mut impl Rng, focus: Option<(u32, &PartitionTable)>) -> u64 {
        let mut k = rng.gen_range(0..KV_KEYS);
        let Some((node, table)) = focus else {
            return k;
        };
        for _ in 1..FINALE_KEY_DRAWS_MAX {
            if table.node_for_key(key_name(k).as_bytes()) == node {
                break;
            }
            k = rng.gen_range(0..KV_KEYS);
        }
        k
    }

    fn key_name(k: u64) -> String {
        format!("chaos-{k}")
    }

    /// A GET's answer as a register value: no object is the initial 0.
    fn decode(v: Option<camelot_client::Versioned>) -> Found {
        match v {
            None => Found::Value(0),
            Some(v) => match std::str::from_utf8(&v.value)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
            {
                Some(x) if x != 0 => Found::Value(x),
                _ => Found::Garbage,
            },
        }
    }

    /// Waits (bounded) until etcd answers and every server is registered, then publishes
    /// the first map: `KV_PARTITIONS` partitions over them, R = `KV_REPLICATION`.
    fn set_up(url: &str, servers: usize) -> Result<u64> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let deadline = Instant::now() + KV_SETUP_WAIT;
        rt.block_on(async {
            let mut last = String::from("nothing tried");
            loop {
                if Instant::now() >= deadline {
                    bail!("the kv cluster was not up within {KV_SETUP_WAIT:?}: {last}");
                }
                let attempt = async {
                    let etcd = EtcdCluster::connect(&[url.to_owned()], PREFIX_DEFAULT).await?;
                    if let Some(v) = etcd.read_map().await? {
                        return Ok::<_, EtcdError>(Some(v.map.epoch));
                    }
                    let live = etcd.live_nodes().await?;
                    if live.len() < servers {
                        return Ok(None);
                    }
                    let published = etcd
                        .update_map(3, move |_| {
                            Ok(ClusterMap::initial(
                                live.clone(),
                                KV_PARTITIONS,
                                KV_REPLICATION,
                            )?)
                        })
                        .await?;
                    Ok(Some(published.map.epoch))
                };
                match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                    Ok(Ok(Some(epoch))) => return Ok(epoch),
                    Ok(Ok(None)) => last = "not every server registered".into(),
                    Ok(Err(e)) => last = e.to_string(),
                    Err(_) => last = "etcd did not answer within 5 s".into(),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    }

    /// What the map and the registrations say of the cluster: whether it is whole
    /// (every server registered and in the map under that registration, every partition
    /// with R full replicas, nothing syncing or fenced), and the servers that are lost
    /// (no registration, and the controller has taken them out of the map).
    pub(super) fn health(map: &ClusterMap, live: &[Node], servers: usize) -> (bool, Vec<u32>) {
        let alive = Alive::new(live.iter().cloned());
        let ids = 0..servers as u32;
        let lost = ids
            .clone()
            .filter(|id| !live.iter().any(|n| n.id == *id) && map.node(*id).is_none())
            .collect();
        let whole = ids
            .clone()
            .all(|id| map.node(id).is_some_and(|entry| alive.holds(entry)))
            && map
                .assignment
                .iter()
                .all(|r| r.len() == KV_REPLICATION as usize)
            && map.syncing.is_empty()
            && map.fenced.is_empty();
        (whole, lost)
    }

    /// The server leading most partitions in `table` (the lowest id of a tie).
    fn leading_most(table: &PartitionTable) -> Option<u32> {
        let mut led: BTreeMap<u32, usize> = BTreeMap::new();
        for &node in table.primaries() {
            *led.entry(node).or_default() += 1;
        }
        led.into_iter()
            .max_by_key(|&(node, n)| (n, std::cmp::Reverse(node)))
            .map(|(node, _)| node)
    }

    /// Until `stop`: after each `healed`, looks at etcd every [`KV_HEALTH_POLL`] and says
    /// `lost N` (once per loss) and `whole` (then waits for the next heal). Asked for
    /// the finale, it names the server leading most partitions in `client`'s map and
    /// focuses the clients on it; `killed N` of that server ends the focus.
    fn watch_health(
        url: &str,
        servers: usize,
        control: &mpsc::Receiver<Msg>,
        client: &Client,
        focus: &Focus,
    ) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let etcd = rt
            .block_on(EtcdCluster::connect(&[url.to_owned()], PREFIX_DEFAULT))
            .map_err(|e| anyhow::anyhow!("cannot reach etcd at {url}: {e}"))?;
        let mut pending = false;
        let mut said_lost = std::collections::BTreeSet::new();
        // Killed servers not yet seen lost.
        let mut killed = std::collections::BTreeSet::new();
        loop {
            let msg = if pending {
                control.recv_timeout(KV_HEALTH_POLL)
            } else {
                control
                    .recv()
                    .map_err(|_| mpsc::RecvTimeoutError::Disconnected)
            };
            match msg {
                Ok(Msg::Healed) => pending = true,
                Ok(Msg::Killed(n)) => {
                    killed.insert(n as u32);
                    let _ = focus.compare_exchange(
                        n as u32,
                        NO_FOCUS,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                }
                Ok(Msg::Finale) => {
                    let node = client
                        .partition_table()
                        .and_then(|t| leading_most(&t))
                        .unwrap_or(0);
                    focus.store(node, Ordering::Relaxed);
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "{FINALE_LINE} {node}")?;
                    out.flush()?;
                }
                Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if !pending {
                continue;
            }
            let look = rt.block_on(async {
                tokio::time::timeout(KV_HEALTH_POLL * 10, async {
                    Ok::<_, EtcdError>((etcd.read_map().await?, etcd.live_nodes().await?))
                })
                .await
            });
            let Ok(Ok((Some(v), live))) = look else {
                continue;
            };
            let (whole, lost) = health(&v.map, &live, servers);
            said_lost.retain(|id| !live.iter().any(|n| n.id == *id));
            let mut out = std::io::stdout().lock();
            for id in lost {
                killed.remove(&id);
                if said_lost.insert(id) {
                    writeln!(out, "{LOST_LINE_PREFIX}{id}")?;
                }
            }
            if whole && killed.is_empty() {
                writeln!(out, "{WHOLE_LINE}")?;
                pending = false;
            }
            out.flush()?;
        }
    }

    fn source(url: &str) -> Result<Arc<EtcdMapSource>> {
        EtcdMapSource::connect(&[url.to_owned()], PREFIX_DEFAULT)
            .map_err(|e| anyhow::anyhow!("cannot reach etcd at {url}: {e}"))
    }

    pub(super) fn worker(
        a: &WorkerArgs,
        started: Instant,
        control: &mpsc::Receiver<Msg>,
    ) -> Result<Report> {
        let url = a.etcd.as_deref().context("--face kv needs --etcd")?;
        set_up(url, a.servers.len())?;
        let nodes: Vec<NodeInfo> = a
            .servers
            .iter()
            .enumerate()
            .map(|(i, addr)| NodeInfo {
                id: i as u32,
                addr: *addr,
            })
            .collect();
        let config = ClientConfig {
            request_timeout: KV_REQUEST_TIMEOUT,
            ..ClientConfig::default()
        };
        let mut clients = Vec::with_capacity(KV_CLIENTS);
        for _ in 0..KV_CLIENTS {
            let c = Client::connect(
                ClientMap {
                    epoch: 0,
                    nodes: nodes.clone(),
                },
                config.clone(),
            )?;
            // Its own source, for the MOVED/STALE_EPOCH answers it follows itself.
            c.set_map_source(source(url)?);
            c.refresh_map()?;
            clients.push(c);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let focus: Focus = Arc::new(AtomicU32::new(NO_FOCUS));
        let refresher = {
            let (stop, clients, source) = (stop.clone(), clients.clone(), source(url)?);
            std::thread::Builder::new()
                .name("chaos-kv-map".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        // Errors (etcd cut off by a partition) are retried next period.
                        if let Ok((map, table)) = source.fetch() {
                            for c in &clients {
                                let _ = c.set_cluster(map.clone(), table.clone());
                            }
                        }
                        std::thread::sleep(KV_MAP_REFRESH);
                    }
                })?
        };
        let mut threads = Vec::with_capacity(KV_CLIENTS);
        for (i, client) in clients.iter().cloned().enumerate() {
            let (stop, focus) = (stop.clone(), focus.clone());
            let mut rec = Recorder::new(
                started,
                i as u32,
                KV_CLIENTS as u32,
                a.broken_ack_before_write,
                a.broken_stale_reads,
            );
            let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed ^ ((i as u64) << 48));
            threads.push(
                std::thread::Builder::new()
                    .name(format!("chaos-kv-{i}"))
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            if rec.hold_back() {
                                continue;
                            }
                            let node = focus.load(Ordering::Relaxed);
                            let table = (node != NO_FOCUS)
                                .then(|| client.partition_table())
                                .flatten();
                            let k = next_key(&mut rng, table.as_deref().map(|t| (node, t)));
                            let name = key_name(k);
                            if rng.gen_ratio(1, READ_ONE_IN) {
                                rec.read(k, || {
                                    client
                                        .get(name.as_bytes())
                                        .map(decode)
                                        .map_err(|e| format!("get {name}: {e}"))
                                });
                            } else {
                                rec.write(k, |v| {
                                    client
                                        .put(name.as_bytes(), v.to_string())
                                        .map(|_| ())
                                        .map_err(|e| format!("put {name}: {e}"))
                                });
                            }
                        }
                        rec.finish(0);
                        rec
                    })?,
            );
        }
        println!("ready");
        std::io::stdout().flush()?;
        watch_health(url, a.servers.len(), control, &clients[0], &focus)?;
        stop.store(true, Ordering::Relaxed);
        let mut history = Vec::new();
        let (mut errors, mut first_errors) = (0, Vec::new());
        for t in threads {
            let rec = t
                .join()
                .map_err(|_| anyhow::anyhow!("a kv client thread panicked"))?;
            history.extend(rec.history);
            errors += rec.errors;
            first_errors.extend(rec.first_errors);
        }
        let _ = refresher.join();
        history.sort_by_key(|o| (o.invoked_us, o.client));
        first_errors.truncate(FIRST_ERRORS_MAX);

        // The final state, read once the cluster answers again (a failover may be under
        // way): every register written.
        let mut rec = Recorder::new(started, KV_CLIENTS as u32, 1, false, false);
        let reader = &clients[0];
        let written: std::collections::BTreeSet<u64> = history
            .iter()
            .filter(|o| o.write_value().is_some())
            .map(|o| o.key)
            .collect();
        let deadline = Instant::now() + KV_FINAL_READ_WAIT;
        let mut found = BTreeMap::new();
        for &k in &written {
            let name = key_name(k);
            let f = loop {
                match reader.get(name.as_bytes()) {
                    Ok(v) => break decode(v),
                    Err(e) if Instant::now() >= deadline => {
                        rec.error(format!("final read of {name}: {e}"));
                        break Found::Unreadable;
                    }
                    Err(_) => {
                        let _ = reader.refresh_map();
                        std::thread::sleep(ERROR_BACKOFF);
                    }
                }
            };
            found.insert(k, f);
        }
        errors += rec.errors;
        first_errors.extend(rec.first_errors);
        first_errors.truncate(FIRST_ERRORS_MAX);
        Ok(Report {
            history,
            found,
            scrub_mismatches: None,
            scrub_skipped: None,
            repairs: 0,
            errors,
            first_errors,
            map_epoch: Some(reader.epoch()),
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn get_answers_decode_to_register_values() {
            assert_eq!(decode(None), Found::Value(0));
            let v = |s: &'static str| {
                Some(camelot_client::Versioned {
                    version: 1,
                    value: s.into(),
                })
            };
            assert_eq!(decode(v("42")), Found::Value(42));
            assert_eq!(decode(v("0")), Found::Garbage);
            assert_eq!(decode(v("x1")), Found::Garbage);
        }

        #[test]
        fn a_focus_draws_only_keys_the_focused_server_leads() {
            let table = PartitionTable::new((0..64).map(|p| p % 3).collect()).unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(8);
            let leaders = |focus: Option<(u32, &PartitionTable)>, rng: &mut _| {
                let mut seen = std::collections::BTreeSet::new();
                for _ in 0..300 {
                    let k = next_key(rng, focus);
                    assert!(k < KV_KEYS);
                    seen.insert(table.node_for_key(key_name(k).as_bytes()));
                }
                seen
            };
            assert_eq!(leaders(None, &mut rng).len(), 3);
            for node in 0..3 {
                let seen = leaders(Some((node, &table)), &mut rng);
                assert_eq!(seen, [node].into(), "focus on {node}");
            }
        }

        #[test]
        fn the_finale_cuts_off_the_server_leading_most_partitions() {
            let table = |p: Vec<u32>| PartitionTable::new(p).unwrap();
            assert_eq!(leading_most(&table(vec![0, 1, 2, 1, 2, 1])), Some(1));
            // A server killed earlier leads nothing: never picked.
            assert_eq!(leading_most(&table(vec![1, 2, 2, 1, 2])), Some(2));
            assert_eq!(
                leading_most(&table(vec![2, 1, 1, 2])),
                Some(1),
                "a tie: lowest id"
            );
        }

        fn node(id: u32, lease: i64) -> Node {
            Node {
                id,
                addr: SocketAddr::from(([10, 213, 0, id as u8 + 2], 7000)),
                weight: 1,
                lease,
                incarnation: 0,
            }
        }

        #[test]
        fn health_is_whole_only_with_every_node_registered_in_the_map_at_r2() {
            let live: Vec<Node> = (0..3).map(|i| node(i, 100 + i64::from(i))).collect();
            let map = ClusterMap::initial(live.clone(), 8, 2).unwrap();
            assert_eq!(health(&map, &live, 3), (true, vec![]));
            // Node 1 restarted (a new lease): not whole, not lost (it is registered).
            let mut restarted = live.clone();
            restarted[1].lease = 999;
            assert_eq!(health(&map, &restarted, 3), (false, vec![]));
            // Node 2's registration is gone: lost only once the map no longer has it.
            let two = &live[..2];
            assert_eq!(health(&map, two, 3), (false, vec![]));
            let without = ClusterMap::initial(two.to_vec(), 8, 2).unwrap();
            assert_eq!(health(&without, two, 3), (false, vec![2]));
            // Back and registered, but the map not yet at R=2 on it: not whole.
            let mut short = map.clone();
            short.assignment[0].truncate(1);
            assert_eq!(health(&short, &live, 3), (false, vec![]));
        }
    }
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
