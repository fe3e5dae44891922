//! The write hole: a writer process SIGKILLed at random moments, often between a stripe's
//! data and its parity. After each kill the volume is opened again (which resyncs the
//! stripes the writer had marked) and scrubbed: no stripe may have parity that disagrees
//! with its data. The same loop with the intent words turned off must find such stripes,
//! which shows the checker can fail.
//!
//! CI runs `KILLS_DEFAULT` kills; the full run is
//! `VOLUME_CRASH_KILLS=200 cargo test -p camelot-blocks --test write_hole`.

use camelot_blocks::{Level, ScrubReport, Volume, VolumeConfig};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use rand::{Rng, SeedableRng};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const KILLS_DEFAULT: usize = 40;
/// Writes the writer reports before it is killed: random in 0..=this.
const WRITES_BEFORE_KILL_MAX: usize = 12;
/// Upper bound of the random pause between a reported write and the kill.
const KILL_JITTER_US_MAX: u64 = 1500;
const WRITER_LINE_TIMEOUT: Duration = Duration::from_secs(20);

fn kills() -> usize {
    std::env::var("VOLUME_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KILLS_DEFAULT)
}

fn cluster(n: usize) -> (DevCluster, Vec<SocketAddr>) {
    let c = DevCluster::start(DevClusterConfig {
        nodes: n,
        memory_bytes_per_node: 64 << 20,
        worker_threads: 2,
        ..DevClusterConfig::default()
    })
    .expect("cluster");
    let addrs = c.addrs().to_vec();
    (c, addrs)
}

/// Kills writer after writer; returns (total of what each reopen resynced, total
/// mismatches the scrubs after it found).
fn kill_loop(level: Level, n: usize, name: &str, intent: bool, kills: usize) -> (ScrubReport, u64) {
    let (_cluster, addrs) = cluster(n);
    let cfg = VolumeConfig {
        write_intent: intent,
        ..VolumeConfig::default()
    };
    Volume::create(name, level, &addrs, 4096, 768 << 10, &cfg).expect("create");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0xb10c);
    let mut resynced = ScrubReport::default();
    let mut mismatches = 0;
    for i in 0..kills {
        let mut args = vec![addrs[i % n].to_string(), name.to_string(), i.to_string()];
        if !intent {
            args.push("--no-intent".into());
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_volume-crash-writer"))
            .args(&args)
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
        // Wait for the open, then for a random number of finished writes: the kill lands
        // somewhere inside the next one.
        let wait_for = 1 + rng.gen_range(0..=WRITES_BEFORE_KILL_MAX);
        for _ in 0..wait_for {
            let line = lines
                .recv_timeout(WRITER_LINE_TIMEOUT)
                .unwrap_or_else(|e| panic!("writer {i} silent ({e}): {:?}", child.try_wait()));
            assert!(line == "open" || line.starts_with("wrote "), "{line}");
        }
        // Not synchronisation: a random moment inside the next write (a write here takes
        // a few hundred microseconds), so kills land in every phase of it.
        std::thread::sleep(Duration::from_micros(rng.gen_range(0..KILL_JITTER_US_MAX)));
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");

        // Another process opens the volume (resyncing the marks) and checks every stripe.
        let (vol, report) = Volume::open(addrs[(i + 1) % n], name, &cfg).expect("open");
        resynced.stripes_checked += report.stripes_checked;
        resynced.mismatches += report.mismatches;
        resynced.repaired += report.repaired;
        let scrub = vol.scrub(false).expect("scrub");
        assert_eq!(scrub.skipped, 0);
        mismatches += scrub.mismatches;
        if scrub.mismatches > 0 {
            // Leave the next round a consistent volume, so each kill is judged alone.
            vol.scrub(true).expect("repair");
        }
    }
    (resynced, mismatches)
}

#[test]
fn a_writer_killed_mid_stripe_leaves_no_silent_parity_mismatch() {
    let kills = kills();
    for (level, n, name) in [
        (Level::Raid5, 4, "hole5"),
        (Level::Rs { k: 4, m: 2 }, 6, "holers"),
    ] {
        let (resynced, mismatches) = kill_loop(level, n, name, true, kills);
        println!(
            "{}: {kills} kills, reopen resynced {} marked stripes ({} torn, repaired), scrub \
             found {mismatches} mismatches",
            level.name(),
            resynced.stripes_checked,
            resynced.mismatches
        );
        assert_eq!(mismatches, 0, "{}: silent parity mismatches", level.name());
    }
}

#[test]
fn without_intent_words_the_checker_finds_torn_stripes() {
    let (_, mismatches) = kill_loop(Level::Raid5, 4, "nohole", false, kills());
    println!("raid5 without intents: scrub found {mismatches} mismatches");
    assert!(
        mismatches > 0,
        "no torn stripe in {} kills: the kill test cannot tell the fix from its absence",
        kills()
    );
}
