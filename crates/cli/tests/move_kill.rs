//! A partition move whose *source* or *target* server is SIGKILLed mid-way, on a real
//! etcd and real `camelot server` processes: the mover fails, and `camelot cluster move
//! --rollback` leaves the map as before the move — partitions on the source, unfenced,
//! no move record — never half-applied. With the target killed, every write acknowledged
//! on the source is still there. (With the source killed and R = 1 its data died with it;
//! what is checked then is the map and that the target kept no scratch copies.) The target
//! is also killed while the source is pushing it the first pass's pages itself.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use camelot_client::{reply, Client, ClientConfig, ClusterMap as ClientMap};
use camelot_cluster::follow::EtcdMapSource;
use camelot_proto::Op;

mod support;
use support::{bin, wait_for, PREFIX};

const PARTITIONS: u32 = 8;
const KEYS: usize = 300;
const MOVER_TIME_MAX: Duration = Duration::from_secs(60);

/// Runs `camelot cluster move ARGS` to its end; (success, stdout + stderr).
fn mover(endpoint: &str, args: &[&str], on_hold: impl FnOnce()) -> (bool, String) {
    let mut child = Command::new(bin())
        .args(["cluster", "move", "--etcd", endpoint])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut on_hold = Some(on_hold);
    let start = Instant::now();
    let status = loop {
        while let Ok(line) = lines.try_recv() {
            if line.contains("holding at") {
                if let Some(f) = on_hold.take() {
                    f();
                }
            }
            seen.push(line);
        }
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < MOVER_TIME_MAX,
            "the mover did not end:\n{seen:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    seen.extend(lines.iter());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status.success(), format!("{}\n{err}", seen.join("\n")))
}

/// Values of the bulk a push is killed in the middle of: enough pages (of 4 MiB) that
/// the target's first APPLYs come well before the walk's end, even in a release build.
const BULK_KEYS: usize = 1_500;
const BULK_VALUE_BYTES: usize = 64 << 10;

/// When the victim is killed.
#[derive(Clone, Copy, PartialEq)]
enum Kill {
    /// While the mover holds after its copy passes.
    AfterCopy,
    /// As soon as the target has applied a first pushed copy, while the source is still
    /// pushing the first pass's pages (checked: the pass never ends).
    MidPush,
}

/// Kills `victim` (0: the source, 1: the target) at `when`; the mover goes on, fails,
/// and is rolled back.
fn kill_mid_move(victim: usize, when: Kill) {
    let mut c = support::start(2, "256M", &[]);
    let before = c.publish_initial(PARTITIONS, 1);
    let parts: Vec<String> = (0..PARTITIONS)
        .filter(|p| before.primary(*p) == Some(0))
        .map(|p| p.to_string())
        .collect();
    assert!(!parts.is_empty());
    // The servers at the map's epoch before anyone writes.
    let raw = Client::connect(ClientMap::from_addrs(&c.addrs), ClientConfig::default()).unwrap();
    support::wait_epoch(&raw, 0..2, before.epoch);
    let mut bulk: Vec<Vec<u8>> = Vec::new();
    if when == Kill::MidPush {
        let value = Bytes::from(vec![b'b'; BULK_VALUE_BYTES]);
        for i in 0.. {
            let k = format!("bulk-{i:06}").into_bytes();
            if before.primary(camelot_proto::partition_of(&k, PARTITIONS)) == Some(0) {
                reply::version(raw.call(
                    0,
                    Op::Put {
                        key: Bytes::from(k.clone()),
                        value: value.clone(),
                    },
                ))
                .unwrap();
                bulk.push(k);
                if bulk.len() == BULK_KEYS {
                    break;
                }
            }
        }
    }

    // One writer on node 0's keys (the source's), last acknowledged value per key.
    let writer = Client::connect(ClientMap::from_addrs(&c.addrs), ClientConfig::default()).unwrap();
    writer.set_map_source(EtcdMapSource::connect(&[c.endpoint.clone()], PREFIX).unwrap());
    assert!(writer.refresh_map().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let acked: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
    let count = Arc::new(AtomicU64::new(0));
    let thread = {
        let (stop, acked, count) = (stop.clone(), acked.clone(), count.clone());
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                for i in 0..KEYS {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let k = format!("k{i:04}");
                    let v = format!("{k}-{round}");
                    if writer.put(k.as_bytes(), v.clone()).is_ok() {
                        acked.lock().unwrap().insert(k, v);
                        count.fetch_add(1, Ordering::Relaxed);
                    } else {
                        acked.lock().unwrap().remove(&k);
                    }
                }
            }
        })
    };
    wait_for("writes acknowledged", Duration::from_secs(30), || {
        count.load(Ordering::Relaxed) >= 1_000
    });

    let mut args: Vec<&str> = parts.iter().map(String::as_str).collect();
    args.extend(["--to", "1"]);
    let (ok, out) = if when == Kill::AfterCopy {
        args.extend(["--hold-at", "copied", "--hold-ms", "300"]);
        let server = &mut c.servers[victim];
        mover(&c.endpoint, &args, || {
            server.process_mut().kill().unwrap(); // SIGKILL
        })
    } else {
        let (server, endpoint) = (&mut c.servers[victim], &c.endpoint);
        std::thread::scope(|s| {
            s.spawn(|| {
                let target = Client::connect(
                    ClientMap::from_addrs(&c.addrs[1..]),
                    ClientConfig::default(),
                )
                .unwrap();
                wait_for("the target's first pushed copy", MOVER_TIME_MAX, || {
                    let stats = target.stats(0).unwrap();
                    stats.iter().any(|(n, v)| n == "ops_apply" && *v > 0)
                });
                server.process_mut().kill().unwrap(); // SIGKILL
            });
            mover(endpoint, &args, || {})
        })
    };
    assert!(!ok, "the mover succeeded with node {victim} killed:\n{out}");
    if when == Kill::MidPush {
        assert!(
            !out.contains("pass 1:"),
            "the kill came after the first pass, not in its pushes:\n{out}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
    let rec = c.rt.block_on(c.etcd.read_move()).unwrap();
    assert!(rec.is_some(), "the failed move left its record:\n{out}");

    let (ok, rollback) = mover(&c.endpoint, &["--rollback"], || {});
    assert!(ok, "rollback failed:\n{rollback}");
    let after = c.rt.block_on(c.etcd.read_map()).unwrap().unwrap().map;
    assert!(c.rt.block_on(c.etcd.read_move()).unwrap().is_none());
    assert!(after.fenced.is_empty(), "still fenced:\n{out}\n{rollback}");
    for p in 0..PARTITIONS {
        assert_eq!(
            after.primary(p),
            before.primary(p),
            "partition {p}:\n{out}\n{rollback}"
        );
    }
    if victim == 1 {
        // The source lived: every acknowledged write is still read there.
        let reader = Client::connect(
            ClientMap::from_addrs(&c.addrs[..1]),
            ClientConfig::default(),
        )
        .unwrap();
        // The source's keys (about half): the target's are the dead node's, whose last
        // writes' outcome is unknown — and the writer may stop before it has failed on
        // each of them once, which alone would drop them from the book.
        let acked: BTreeMap<String, String> = acked
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| {
                before.primary(camelot_proto::partition_of(k.as_bytes(), PARTITIONS)) == Some(0)
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert!(acked.len() > KEYS / 4, "{} keys checked", acked.len());
        let bulk_lost = bulk
            .iter()
            .filter(|k| reader.get(k).unwrap().map(|x| x.value.len()) != Some(BULK_VALUE_BYTES))
            .count();
        assert_eq!(bulk_lost, 0, "bulk values lost on the source");
        let lost: Vec<&String> = acked
            .iter()
            .filter(|(k, v)| {
                reader.get(k.as_bytes()).unwrap().map(|x| x.value.to_vec())
                    != Some(v.as_bytes().to_vec())
            })
            .map(|(k, _)| k)
            .collect();
        assert!(
            lost.is_empty(),
            "{} lost: {:?}",
            lost.len(),
            &lost[..lost.len().min(5)]
        );
    } else {
        // The target lived: the rollback deleted its scratch copies.
        let raw1 = Client::connect(
            ClientMap::from_addrs(&c.addrs[1..]),
            ClientConfig::default(),
        )
        .unwrap();
        let items = reply::items(raw1.call(
            0,
            Op::Scan {
                start: Bytes::new(),
                limit: 4096,
            },
        ))
        .unwrap();
        let kept: Vec<_> = items
            .iter()
            .filter(|i| {
                parts.contains(&camelot_proto::partition_of(&i.key, PARTITIONS).to_string())
            })
            .collect();
        assert!(
            kept.is_empty(),
            "{} scratch copies left on the target",
            kept.len()
        );
    }
    println!("node {victim} killed:\n{out}\nrollback:\n{rollback}");
}

#[test]
fn a_target_killed_mid_move_is_rolled_back_with_no_acknowledged_write_lost() {
    kill_mid_move(1, Kill::AfterCopy);
}

#[test]
fn a_source_killed_mid_move_is_rolled_back_not_half_applied() {
    kill_mid_move(0, Kill::AfterCopy);
}

/// The source pushes the first pass's pages to the target itself; the target dies under
/// them. The source answers the page as not copied (its data untouched), the mover
/// fails inside the pass, and the rollback restores the map.
#[test]
fn a_target_killed_while_the_source_pushes_it_pages_is_rolled_back_with_nothing_lost() {
    kill_mid_move(1, Kill::MidPush);
}
