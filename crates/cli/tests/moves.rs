//! Partition moves while serving, on a real etcd and real `camelot server` processes,
//! driven by the real `camelot cluster move` (a process the tests SIGKILL mid-move):
//! no acknowledged write is lost, and a client with a stale map never reads a value older
//! than the last one acknowledged.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use camelot_client::{reply, Client, ClientConfig, ClusterMap as ClientMap};
use camelot_cluster::etcd::EtcdCluster;
use camelot_cluster::follow::EtcdMapSource;
use camelot_cluster::ClusterMap;
use camelot_proto::Op;
use camelot_testkit::{CamelotServer, EtcdServer};

const PARTITIONS: u32 = 8;
const WRITERS: usize = 2;
const KEYS_PER_WRITER: usize = 300;
const VALUE_BYTES: usize = 256;
const MOVE_TIMEOUT: Duration = Duration::from_secs(60);

mod support;
use support::{bin, wait_for, PREFIX};

struct Cluster {
    _etcd_server: EtcdServer,
    _servers: Vec<CamelotServer>,
    endpoint: String,
    addrs: Vec<std::net::SocketAddr>,
    rt: tokio::runtime::Runtime,
    etcd: EtcdCluster,
    raw: Client,
}

impl Cluster {
    /// Two servers on etcd, a map of [`PARTITIONS`] over both, both at its epoch.
    fn start() -> Cluster {
        let support::EtcdServers {
            etcd_server,
            endpoint,
            servers,
            addrs,
            rt,
            etcd,
        } = support::start(2, "128M", &[]);
        let live = rt.block_on(etcd.live_nodes()).unwrap();
        let first = ClusterMap::initial(live, PARTITIONS, 1).unwrap();
        rt.block_on(etcd.update_map(3, move |_| Ok(first.clone())))
            .unwrap();
        // Epoch 0: never redirected; sees every server's counters and keys.
        let raw = Client::connect(ClientMap::from_addrs(&addrs), ClientConfig::default()).unwrap();
        let c = Cluster {
            _etcd_server: etcd_server,
            _servers: servers,
            endpoint,
            addrs,
            rt,
            etcd,
            raw,
        };
        c.wait_epochs(1);
        c
    }

    fn map(&self) -> ClusterMap {
        self.rt.block_on(self.etcd.read_map()).unwrap().unwrap().map
    }

    fn wait_epochs(&self, epoch: u64) {
        support::wait_epoch(&self.raw, 0..2, epoch);
    }

    /// A client that has the current map and refreshes it from etcd only when a server
    /// redirects it.
    fn client(&self) -> Client {
        let client =
            Client::connect(ClientMap::from_addrs(&self.addrs), ClientConfig::default()).unwrap();
        client.set_map_source(
            EtcdMapSource::connect(std::slice::from_ref(&self.endpoint), PREFIX).unwrap(),
        );
        assert!(client.refresh_map().unwrap());
        client
    }

    /// Keys on `node` (all of them, by scan at epoch 0) with their partitions.
    fn keys_on(&self, node: u32) -> Vec<(Bytes, u32)> {
        let mut out = Vec::new();
        let mut start = Bytes::new();
        loop {
            let items = reply::items(self.raw.call(
                node,
                Op::Scan {
                    start: start.clone(),
                    limit: 4096,
                },
            ))
            .unwrap();
            let Some(last) = items.last() else {
                return out;
            };
            let mut next = last.key.to_vec();
            next.push(0);
            start = Bytes::from(next);
            out.extend(items.into_iter().map(|i| {
                let p = camelot_proto::partition_of(&i.key, PARTITIONS);
                (i.key, p)
            }));
        }
    }

    fn mover(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin());
        cmd.args(["cluster", "move", "--etcd", &self.endpoint])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Runs `camelot cluster move ARGS` to its end; its stdout.
    fn run_mover(&self, args: &[&str]) -> String {
        let mut child = self.mover(args).spawn().unwrap();
        let lines = lines_of(&mut child);
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > MOVE_TIMEOUT {
                child.kill().unwrap();
                panic!("cluster move {args:?} did not end within {MOVE_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        let out: Vec<String> = lines.try_iter().collect();
        let out = out.join("\n");
        assert!(
            status.success(),
            "cluster move {args:?}: {status}\n{out}\n{stderr}"
        );
        out
    }
}

fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Writers that each own a set of keys, put (and now and then delete) them in a loop,
/// and after each acknowledged write read the key back through a client whose map is
/// refreshed only on redirects: the read must return exactly what was just acknowledged
/// (no other writer touches the key), so an older value is a violation.
struct Load {
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Acked>>,
    acked_count: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    stale_reads: Arc<Mutex<Vec<String>>>,
    threads: Vec<JoinHandle<()>>,
}

/// Each key's last acknowledged value (`None`: deleted).
type Acked = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

fn key(w: usize, i: usize) -> Vec<u8> {
    format!("w{w}-{i:05}").into_bytes()
}

impl Load {
    fn start(c: &Cluster) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(BTreeMap::new()));
        let acked_count = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let stale_reads = Arc::new(Mutex::new(Vec::new()));
        let threads =
            (0..WRITERS)
                .map(|w| {
                    let (writer, reader) = (c.client(), c.client());
                    let (stop, acked, acked_count, failed, stale_reads) = (
                        stop.clone(),
                        acked.clone(),
                        acked_count.clone(),
                        failed.clone(),
                        stale_reads.clone(),
                    );
                    std::thread::spawn(move || {
                        let mut round = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            round += 1;
                            for i in 0..KEYS_PER_WRITER {
                                let k = key(w, i);
                                let delete = (round + i as u64).is_multiple_of(11);
                                let value = if delete {
                                    None
                                } else {
                                    let mut v = format!("{w}-{i}-{round}-").into_bytes();
                                    v.resize(VALUE_BYTES, b'.');
                                    Some(v)
                                };
                                let ok = match &value {
                                    Some(v) => writer.put(&k, v.clone()).is_ok(),
                                    None => writer.delete(&k).is_ok(),
                                };
                                if !ok {
                                    // Unknown outcome: the key's last acknowledged value is no
                                    // longer the only one it may hold; stop checking it.
                                    failed.fetch_add(1, Ordering::Relaxed);
                                    acked.lock().unwrap().remove(&k);
                                    continue;
                                }
                                acked.lock().unwrap().insert(k.clone(), value.clone());
                                acked_count.fetch_add(1, Ordering::Relaxed);
                                match reader.get(&k) {
                                    Ok(got) => {
                                        let got = got.map(|v| v.value.to_vec());
                                        if got != value {
                                            stale_reads.lock().unwrap().push(format!(
                                                "{}: read {:?}, just acknowledged {:?}",
                                                String::from_utf8_lossy(&k),
                                                got.map(|g| String::from_utf8_lossy(&g[..12])
                                                    .into_owned()),
                                                value.map(|g| String::from_utf8_lossy(&g[..12])
                                                    .into_owned())
                                            ));
                                        }
                                    }
                                    Err(_) => {
                                        failed.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                            }
                        }
                    })
                })
                .collect();
        Load {
            stop,
            acked,
            acked_count,
            failed,
            stale_reads,
            threads,
        }
    }

    fn wait_progress(&self, writes: u64) {
        let from = self.acked_count.load(Ordering::Relaxed);
        wait_for("writers make progress", Duration::from_secs(30), || {
            self.acked_count.load(Ordering::Relaxed) >= from + writes
        });
    }

    fn stop(mut self) -> Load {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        self
    }

    /// Reads every acknowledged write back at the current owner; the lost ones.
    fn lost(&self, c: &Cluster) -> Vec<String> {
        let fresh = c.client();
        let acked = self.acked.lock().unwrap();
        assert!(
            acked.len() > WRITERS * KEYS_PER_WRITER / 2,
            "too few keys checked"
        );
        acked
            .iter()
            .filter_map(|(k, want)| {
                let got = fresh.get(k).unwrap().map(|v| v.value.to_vec());
                (got != *want).then(|| {
                    format!(
                        "{}: {:?} (acknowledged {:?})",
                        String::from_utf8_lossy(k),
                        got.map(|g| String::from_utf8_lossy(&g[..12]).into_owned()),
                        want.as_ref()
                            .map(|g| String::from_utf8_lossy(&g[..12]).into_owned())
                    )
                })
            })
            .collect()
    }
}

/// Partitions whose primary is `node`, as command-line words.
fn partitions_of(map: &ClusterMap, node: u32) -> Vec<String> {
    (0..map.partitions())
        .filter(|p| map.primary(*p) == Some(node))
        .map(|p| p.to_string())
        .collect()
}

fn move_args(parts: &[String], to: u32) -> Vec<String> {
    let mut a = parts.to_vec();
    a.push("--to".into());
    a.push(to.to_string());
    a
}

fn fence_ms(out: &str) -> f64 {
    let at = out.find("fence held ").expect("a fence was reported") + "fence held ".len();
    out[at..].split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn a_move_under_concurrent_writes_loses_no_acknowledged_write() {
    let c = Cluster::start();
    let map = c.map();
    let parts = partitions_of(&map, 0);
    assert!(!parts.is_empty());
    let load = Load::start(&c);
    load.wait_progress(2_000);
    let words = move_args(&parts, 1);
    let args: Vec<&str> = words.iter().map(String::as_str).collect();
    let out = c.run_mover(&args);
    println!("{out}");
    load.wait_progress(2_000);
    let load = load.stop();
    let after = c.map();
    for p in &parts {
        assert_eq!(after.primary(p.parse().unwrap()), Some(1), "{out}");
    }
    assert!(after.fenced.is_empty());
    assert!(c.rt.block_on(c.etcd.read_move()).unwrap().is_none());
    let fence = fence_ms(&out);
    assert!(
        fence <= camelot_cluster::moves::FENCE_MAX.as_secs_f64() * 1e3,
        "fence {fence} ms"
    );
    let lost = load.lost(&c);
    assert!(
        lost.is_empty(),
        "{} lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    let stale = load.stale_reads.lock().unwrap().clone();
    assert!(stale.is_empty(), "{stale:?}");
    // The old owner's copies are gone.
    assert!(c.keys_on(0).is_empty(), "node 0 still holds keys");
    println!(
        "acknowledged {} writes, {} failed client calls, fence {fence} ms",
        load.acked_count.load(Ordering::Relaxed),
        load.failed.load(Ordering::Relaxed)
    );
}

#[test]
fn a_mover_killed_at_any_phase_is_resumed_or_rolled_back_with_no_write_lost() {
    let c = Cluster::start();
    let parts = partitions_of(&c.map(), 0);
    let load = Load::start(&c);
    load.wait_progress(1_000);
    for (i, phase) in ["copied", "fenced", "final-copied", "switched"]
        .into_iter()
        .enumerate()
    {
        for rollback in [false, true] {
            let map = c.map();
            let owner = map.primary(parts[0].parse().unwrap()).unwrap();
            let to = 1 - owner;
            let words = move_args(&parts, to);
            let mut args: Vec<&str> = words.iter().map(String::as_str).collect();
            args.extend(["--hold-at", phase]);
            let mut child = c.mover(&args).spawn().unwrap();
            let lines = lines_of(&mut child);
            let deadline = Instant::now() + MOVE_TIMEOUT;
            loop {
                let line = lines
                    .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .unwrap_or_else(|e| panic!("no hold at {phase}: {e}"));
                if line.contains("holding at") {
                    break;
                }
            }
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            let rec = c.rt.block_on(c.etcd.read_move()).unwrap();
            assert!(rec.is_some(), "killed at {phase}, the record remains");
            let out = if rollback {
                c.run_mover(&["--rollback"])
            } else {
                c.run_mover(&args[..args.len() - 2])
            };
            let after = c.map();
            c.wait_epochs(after.epoch);
            // Once switched, a move can only be finished.
            let expect = if rollback && phase != "switched" {
                owner
            } else {
                to
            };
            for p in &parts {
                assert_eq!(
                    after.primary(p.parse().unwrap()),
                    Some(expect),
                    "killed at {phase}, rollback {rollback}:\n{out}"
                );
            }
            assert!(after.fenced.is_empty());
            assert!(c.rt.block_on(c.etcd.read_move()).unwrap().is_none());
            let other = 1 - expect;
            assert!(
                c.keys_on(other).iter().all(|(_, p)| !parts.contains(&p.to_string())),
                "node {other} kept copies of the moved partitions (killed at {phase}, rollback {rollback})"
            );
            println!("round {i} {phase} rollback={rollback}: ok");
            load.wait_progress(200);
        }
    }
    let load = load.stop();
    let lost = load.lost(&c);
    assert!(
        lost.is_empty(),
        "{} lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    let stale = load.stale_reads.lock().unwrap().clone();
    assert!(stale.is_empty(), "{stale:?}");
}

/// The checker can fail: a mover that switches without the final copy under the fence
/// loses the writes made after its last catch-up pass. The writers stop while the mover
/// holds between its last pass and the fence, so no later write hides a lost one.
#[test]
fn without_the_final_copy_acknowledged_writes_are_lost() {
    let c = Cluster::start();
    let parts = partitions_of(&c.map(), 0);
    let load = Load::start(&c);
    load.wait_progress(2_000);
    let words = move_args(&parts, 1);
    let mut args: Vec<&str> = words.iter().map(String::as_str).collect();
    args.extend([
        "--unsafe-no-final-copy",
        "--hold-at",
        "copied",
        "--hold-ms",
        "1000",
    ]);
    let mut child = c.mover(&args).spawn().unwrap();
    let lines = lines_of(&mut child);
    loop {
        let line = lines.recv_timeout(MOVE_TIMEOUT).expect("a hold at copied");
        if line.contains("holding at") {
            break;
        }
    }
    load.wait_progress(200);
    let load = load.stop();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < MOVE_TIMEOUT, "the mover did not end");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());
    let lost = load.lost(&c);
    println!(
        "lost without the final copy: {} of {}",
        lost.len(),
        load.acked.lock().unwrap().len()
    );
    assert!(
        !lost.is_empty(),
        "the broken mover lost nothing: the checker is blind"
    );
}

/// The copy rate of one move against iperf3's loopback stream (issue 19: ≥ 0.3×), and
/// the fence. A measurement, not a check of correctness: run by hand with
/// `cargo test -p camelot --features etcd --test moves -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_move_copy_rate_against_iperf3() {
    const VALUE: usize = 16 * 1024;
    const KEYS: usize = 3_000;
    let c = Cluster::start();
    let map = c.map();
    let parts = partitions_of(&map, 0);
    let writer = c.client();
    let value = Bytes::from(vec![b'x'; VALUE]);
    let mut loaded = 0;
    for i in 0.. {
        let k = format!("bulk-{i:07}").into_bytes();
        if map.primary(map.partition_of(&k)) != Some(0) {
            continue;
        }
        writer.put(&k, value.clone()).unwrap();
        loaded += 1;
        if loaded == KEYS {
            break;
        }
    }
    let words = move_args(&parts, 1);
    let args: Vec<&str> = words.iter().map(String::as_str).collect();
    let out = c.run_mover(&args);
    println!("{out}");
    let line = out.lines().find(|l| l.starts_with("moved ")).unwrap();
    let at = line.find(" s (").unwrap() + 4;
    let mb_s: f64 = line[at..].split(' ').next().unwrap().parse().unwrap();
    let iperf = camelot_bench::peers::iperf3_tcp_stream(Duration::from_secs(2)).unwrap();
    let iperf_mb_s = iperf.bytes_per_sec / 1e6;
    println!(
        "move copy {mb_s:.1} MB/s ({} MB in the move), iperf3 {iperf_mb_s:.1} MB/s ({}): ratio {:.3}; fence {} ms",
        KEYS * VALUE / 1_000_000,
        iperf.command,
        mb_s / iperf_mb_s,
        fence_ms(&out)
    );
}
