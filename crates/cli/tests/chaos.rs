//! `camelot chaos` end to end, as root: memory servers on testbed hosts, the worker on
//! another, seeded kills, pauses and partitions, then the checkers. Each face passes a
//! short fixed-seed run, and each fails when the worker acknowledges writes it never
//! made (the checkers are shown able to fail). Bounded: a run that hangs is killed.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_camelot");
const RUN_DEADLINE: Duration = Duration::from_secs(180);

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("0");
    if !root {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs as root: the chaos tests must run there, not skip"
        );
        let out = Command::new(BIN)
            .args(["chaos", "--quick"])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&out.stderr).contains("needs root"));
        eprintln!("not root: checked the refusal only");
    }
    root
}

/// Runs chaos; returns (succeeded, stdout).
fn chaos(args: &[&str]) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("camelot-chaos-tests-{}", std::process::id()));
    let mut child = Command::new(BIN)
        .arg("chaos")
        .args(args)
        .env("CAMELOT_TESTBED_DIR", &dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + RUN_DEADLINE;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chaos {args:?} ran past {RUN_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = reader.join().unwrap();
    eprintln!("{out}");
    (status.success(), out)
}

/// The run's own testbed (named in its first line) is gone.
fn its_namespaces_are_gone(out: &str) {
    let run = out
        .split("(testbed ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .expect("chaos names its testbed");
    let listed = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let prefix = format!("cmlt-tb-{run}-");
    assert!(
        !String::from_utf8_lossy(&listed.stdout).contains(&prefix),
        "testbed {run} left behind"
    );
}

#[test]
fn raid5_survives_kills_pauses_and_partitions() {
    if !is_root() {
        return;
    }
    let (ok, out) = chaos(&[
        "--seed",
        "7",
        "--duration",
        "10",
        "--quick",
        "--face",
        "raid5",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("PASS seed 7"));
    // Seed 7's schedule has every kind of fault: the run was not a quiet one.
    for kind in ["kill h", "pause h", "partition h"] {
        assert!(out.contains(kind), "no {kind} in seed 7's run");
    }
    assert!(out.contains("raid5 scrub clean: ok"));
    assert!(out.contains("linearizable (camelot-check"), "{out}");
    its_namespaces_are_gone(&out);
}

#[test]
fn rvm_on_a_mirrored_pool_recovers_the_last_acknowledged_commit() {
    if !is_root() {
        return;
    }
    let (ok, out) = chaos(&[
        "--seed",
        "3",
        "--duration",
        "10",
        "--quick",
        "--face",
        "rvm",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("PASS seed 3"));
    assert!(out.contains("kill h"));
    assert!(out.contains("rvm recovery matches the last acknowledged commit: ok"));
    assert!(out.contains("linearizable (camelot-check"), "{out}");
    its_namespaces_are_gone(&out);
}

/// The linearizability checker can fail: reads answered from a copy writes never
/// update make chaos FAIL on it, while the final state (read past the cache) still
/// holds every acknowledged write — so it is this checker, not the other, that catches
/// it.
#[test]
fn reads_from_a_stale_copy_make_the_linearizability_checker_fail() {
    if !is_root() {
        return;
    }
    for face in ["raid5", "rvm"] {
        let (ok, out) = chaos(&[
            "--seed",
            "7",
            "--duration",
            "4",
            "--quick",
            "--face",
            face,
            "--broken-stale-reads",
        ]);
        assert!(!ok, "{face}: {out}");
        assert!(out.contains("FAIL seed 7"), "{face}: {out}");
        assert!(out.contains("linearizable: no, key"), "{face}: {out}");
        assert!(
            out.contains("acknowledged writes present: ok"),
            "{face}: {out}"
        );
        its_namespaces_are_gone(&out);
    }
}

#[test]
fn acknowledging_before_writing_makes_chaos_fail() {
    if !is_root() {
        return;
    }
    for face in ["raid5", "rvm"] {
        let (ok, out) = chaos(&[
            "--seed",
            "7",
            "--duration",
            "4",
            "--quick",
            "--face",
            face,
            "--broken-ack-before-write",
        ]);
        assert!(!ok, "{face}: {out}");
        assert!(out.contains("FAIL seed 7"), "{face}: {out}");
        assert!(
            out.contains("acknowledged writes present:") && out.contains("violations"),
            "{face}: {out}"
        );
        its_namespaces_are_gone(&out);
    }
}

#[test]
fn a_parity_chunk_changed_behind_the_volume_makes_the_scrub_checker_fail() {
    if !is_root() {
        return;
    }
    let (ok, out) = chaos(&[
        "--seed",
        "7",
        "--duration",
        "4",
        "--quick",
        "--face",
        "raid5",
        "--broken-parity",
    ]);
    assert!(!ok, "{out}");
    assert!(out.contains("FAIL seed 7"), "{out}");
    assert!(out.contains("raid5 scrub: mismatches Some(1)"), "{out}");
    its_namespaces_are_gone(&out);
}

/// Kills the chaos process if the test gives up on it (a panic on a timeout included),
/// so a failing test never leaves a run going.
struct KillOnDrop(std::process::Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Generous: three servers start (up to 10 s each) and the worker creates its volume
/// before the first fault, while the other chaos tests share the two cores.
const FIRST_FAULT_WAIT: Duration = Duration::from_secs(120);
const EXIT_AFTER_SIGTERM_WAIT: Duration = Duration::from_secs(60);

#[test]
fn sigterm_mid_run_takes_the_testbed_down() {
    if !is_root() {
        return;
    }
    use std::io::BufRead;
    let dir = std::env::temp_dir().join(format!("camelot-chaos-tests-{}", std::process::id()));
    let mut child = KillOnDrop(
        Command::new(BIN)
            .args(["chaos", "--seed", "7", "--duration", "30", "--quick"])
            .env("CAMELOT_TESTBED_DIR", &dir)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + FIRST_FAULT_WAIT;
    let next_line = |what: &str| {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => line,
            // The guard kills the run as the panic unwinds.
            Err(e) => panic!("no {what} from chaos within {FIRST_FAULT_WAIT:?}: {e}"),
        }
    };
    let first = next_line("first line");
    // The first fault's line: the testbed is up and the servers and worker run.
    let fault = next_line("fault line");
    assert!(fault.contains(" h"), "{fault}");
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + EXIT_AFTER_SIGTERM_WAIT;
    let st = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "chaos did not exit {EXIT_AFTER_SIGTERM_WAIT:?} after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Whatever it printed after the fault line, for a failure's message.
    let rest: Vec<String> = rx.try_iter().collect();
    assert_eq!(st.code(), Some(130), "after SIGTERM: {rest:?}");
    its_namespaces_are_gone(&first);
}

/// The kv face: etcd, three `camelot server --etcd` nodes with R=2 and the failover
/// controller on testbed hosts of their own, four recorded clients, seed 7's faults and
/// the final fault (h1 cut off from its backups, then killed). Every acknowledged write is
/// read back, the cluster was whole again after every fault, and the controller failed
/// over (the map moved on from its first epoch).
///
/// Linearizability is required too: a primary serves no write before its backups have
/// it (the anomaly the first runs of this face found, a read of a write whose copy the
/// backup refused and that a failover then lost, is
/// `server.rs::a_write_its_backup_refused_is_not_read_until_the_backup_has_it`).
#[cfg(feature = "etcd")]
#[test]
fn kv_with_two_replicas_survives_kills_pauses_and_partitions() {
    if !is_root() {
        return;
    }
    let (ok, out) = chaos(&["--seed", "7", "--duration", "10", "--quick", "--face", "kv"]);
    assert!(ok && out.contains("PASS seed 7"), "{out}");
    assert!(out.contains("linearizable (camelot-check"), "{out}");
    for kind in ["kill h", "pause h", "partition h", "final fault"] {
        assert!(out.contains(kind), "no {kind} in seed 7's kv run");
    }
    assert!(out.contains("acknowledged writes present: ok"), "{out}");
    let published: u64 = out
        .split("the controller published ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("kv reports the map's epoch");
    assert!(published >= 1, "the controller never failed over: {out}");
    its_namespaces_are_gone(&out);
}

/// The kv checkers can fail: servers that acknowledge a write before their backup has
/// it (`--unsafe-ack-before-replication`) lose what the finale's server acknowledged
/// while it was cut off from its backups, and the checkers report it.
#[cfg(feature = "etcd")]
#[test]
fn acknowledging_before_replication_makes_kv_chaos_fail() {
    if !is_root() {
        return;
    }
    // In the finale the clients use only keys the cut-off server leads, so it
    // acknowledges hundreds of writes its backups never get. Before they did, most of
    // their operations waited on the other servers in the partition, a handful were
    // acknowledged, and later writes often overwrote all of them: a fresh-clone CI run
    // had seeds 7, 8 and 9 all pass. The seeds stay as a margin: the broken servers must
    // be caught by a checker on one of them.
    let mut runs = Vec::new();
    for seed in ["7", "8", "9"] {
        let (ok, out) = chaos(&[
            "--seed",
            seed,
            "--duration",
            "10",
            "--quick",
            "--face",
            "kv",
            "--unsafe-ack-before-replication",
        ]);
        its_namespaces_are_gone(&out);
        // A checker must be what caught it (not an error, not a cluster that stayed
        // broken): the lost writes show as missing at the end or as reads no order
        // explains.
        let caught = !ok
            && ((out.contains("acknowledged writes present:") && out.contains("violations"))
                || out.contains("linearizable: no"));
        runs.push(out);
        if caught {
            return;
        }
    }
    panic!("no seed's checkers caught the broken servers: {runs:#?}");
}
