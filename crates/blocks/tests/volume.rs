//! Volumes over real servers on loopback (one dev cluster a server, so a test can stop one
//! and the volume sees a server gone). The SIGKILL tests, which need `camelot server`
//! processes and a killable writer, live in the CLI crate's tests.

use camelot_blocks::{Level, ScrubReport, Volume, VolumeConfig};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;

const CHUNK: u64 = 4096;

fn server() -> DevCluster {
    DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 64 << 20,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("server")
}

fn servers(n: usize) -> (Vec<DevCluster>, Vec<SocketAddr>) {
    let s: Vec<DevCluster> = (0..n).map(|_| server()).collect();
    let addrs = s.iter().map(|c| c.addrs()[0]).collect();
    (s, addrs)
}

fn levels() -> Vec<(Level, usize)> {
    vec![
        (Level::Raid0, 3),
        (Level::Raid1, 3),
        (Level::Raid4, 4),
        (Level::Raid5, 4),
        (Level::Rs { k: 4, m: 2 }, 6),
    ]
}

/// Random writes of random sizes and alignments, mirrored in a shadow buffer; every read
/// must match it.
fn exercise(vol: &Volume, shadow: &mut [u8], rng: &mut SmallRng, rounds: usize) {
    let cap = shadow.len() as u64;
    for _ in 0..rounds {
        let len = match rng.gen_range(0..4) {
            0 => rng.gen_range(1..64),
            1 => 4096,
            2 => rng.gen_range(1..(4 * CHUNK)),
            _ => rng.gen_range(1..(16 * CHUNK)),
        }
        .min(cap);
        let off = rng.gen_range(0..=cap - len);
        if rng.gen_bool(0.6) {
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            vol.write(off, &data).expect("write");
            shadow[off as usize..(off + len) as usize].copy_from_slice(&data);
        } else {
            let mut buf = vec![0u8; len as usize];
            vol.read(off, &mut buf).expect("read");
            assert!(
                buf == shadow[off as usize..(off + len) as usize],
                "read [{off}, +{len}) differs from what was written"
            );
        }
    }
}

fn read_all(vol: &Volume) -> Vec<u8> {
    let mut buf = vec![0u8; vol.capacity_bytes() as usize];
    vol.read(0, &mut buf).expect("read all");
    buf
}

#[test]
fn every_level_reads_back_what_it_wrote_and_scrubs_clean() {
    for (level, n) in levels() {
        let (_servers, addrs) = servers(n);
        let vol = Volume::create(
            "t1",
            level,
            &addrs,
            CHUNK,
            1 << 20,
            &VolumeConfig::default(),
        )
        .expect("create");
        let mut shadow = vec![0u8; vol.capacity_bytes() as usize];
        let mut rng = SmallRng::seed_from_u64(17);
        exercise(&vol, &mut shadow, &mut rng, 150);
        assert_eq!(read_all(&vol), shadow, "{}", level.name());
        let report = vol.scrub(false).expect("scrub");
        assert_eq!(report.mismatches, 0, "{}: {report:?}", level.name());
        assert_eq!(report.stripes_checked, vol.layout().stripes);
    }
}

#[test]
fn scrub_finds_and_repairs_a_corrupted_parity_chunk() {
    let (servers, addrs) = servers(4);
    let cfg = VolumeConfig::default();
    let vol = Volume::create("t2", Level::Raid5, &addrs, CHUNK, 256 << 10, &cfg).expect("create");
    let data: Vec<u8> = (0..vol.capacity_bytes())
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    vol.write(0, &data).expect("write");
    // Corrupt stripe 0's parity chunk behind the volume's back.
    let parity_member = vol.layout().member_of(0, 3);
    let client = camelot_client::Client::connect(
        camelot_client::ClusterMap::from_addrs(&[addrs[parity_member]]),
        camelot_client::ClientConfig::default(),
    )
    .expect("client");
    let region = client
        .lookup(&camelot_blocks::volume::region_name("t2", parity_member))
        .expect("region");
    let base = region.size - vol.layout().member_data_bytes();
    client
        .write(&region, base + 10, vec![0xEEu8; 5])
        .expect("corrupt");
    let found = vol.scrub(true).expect("scrub");
    assert_eq!(found.mismatches, 1, "{found:?}");
    assert_eq!(found.repaired, 1);
    assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0);
    drop(servers);
}

#[test]
fn a_lost_member_degrades_reads_and_writes_then_rebuild_restores_it() {
    for (level, n) in levels().into_iter().skip(1) {
        let (mut servers, addrs) = servers(n);
        let vol = Volume::create(
            "t3",
            level,
            &addrs,
            CHUNK,
            512 << 10,
            &VolumeConfig::default(),
        )
        .expect("create");
        let mut shadow = vec![0u8; vol.capacity_bytes() as usize];
        let mut rng = SmallRng::seed_from_u64(5);
        exercise(&vol, &mut shadow, &mut rng, 60);

        // Lose member 1: its server stops.
        servers.remove(1).shutdown().expect("stop");
        assert_eq!(read_all(&vol), shadow, "{} degraded read", level.name());
        let st = vol.status();
        assert!(st.degraded(), "{}", level.name());
        assert_eq!(st.missing, vec![1]);
        exercise(&vol, &mut shadow, &mut rng, 80);
        assert_eq!(
            read_all(&vol),
            shadow,
            "{} after degraded writes",
            level.name()
        );

        // Rebuild onto a fresh server while the volume is idle, then lose another member
        // so reads must use the rebuilt one.
        let fresh = server();
        vol.rebuild(1, fresh.addrs()[0], 0).expect("rebuild");
        assert!(!vol.status().degraded());
        assert_eq!(
            vol.scrub(false).expect("scrub").mismatches,
            0,
            "{}",
            level.name()
        );
        servers.remove(0).shutdown().expect("stop another");
        assert_eq!(
            read_all(&vol),
            shadow,
            "{} reads through the rebuilt member",
            level.name()
        );
        drop(fresh);
    }
}

#[test]
fn rs_survives_any_two_lost_members() {
    let (mut servers, addrs) = servers(6);
    let vol = Volume::create(
        "t4",
        Level::Rs { k: 4, m: 2 },
        &addrs,
        CHUNK,
        512 << 10,
        &VolumeConfig::default(),
    )
    .expect("create");
    let mut shadow = vec![0u8; vol.capacity_bytes() as usize];
    let mut rng = SmallRng::seed_from_u64(9);
    exercise(&vol, &mut shadow, &mut rng, 60);
    servers.remove(4).shutdown().expect("stop");
    servers.remove(2).shutdown().expect("stop");
    assert_eq!(read_all(&vol), shadow);
    exercise(&vol, &mut shadow, &mut rng, 60);
    assert_eq!(read_all(&vol), shadow);
    assert_eq!(vol.status().missing, vec![2, 4]);
}

#[test]
fn open_needs_one_member_and_sees_the_degraded_state() {
    let (mut servers, addrs) = servers(4);
    let cfg = VolumeConfig::default();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 241) as u8).collect();
    {
        let vol = Volume::create("t5", Level::Raid5, &addrs, CHUNK, 1 << 20, &cfg).expect("create");
        vol.write(12_345, &data).expect("write");
    }
    servers.remove(0).shutdown().expect("stop");
    let (vol, resync) = Volume::open(addrs[2], "t5", &cfg).expect("open");
    assert_eq!(resync, ScrubReport::default());
    assert_eq!(vol.status().missing, vec![0]);
    let mut buf = vec![0u8; data.len()];
    vol.read(12_345, &mut buf).expect("read");
    assert!(buf == data);
    assert!(Volume::open(addrs[2], "nope", &cfg).is_err());
}

#[test]
fn concurrent_writers_on_shared_stripes_keep_parity_consistent() {
    let (_servers, addrs) = servers(4);
    let vol = std::sync::Arc::new(
        Volume::create(
            "t6",
            Level::Raid5,
            &addrs,
            CHUNK,
            256 << 10,
            &VolumeConfig::default(),
        )
        .expect("create"),
    );
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let vol = vol.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                for _ in 0..100 {
                    // 512-byte writes owned by thread t: disjoint bytes, shared stripes.
                    let slot = rng.gen_range(0..vol.capacity_bytes() / 2048);
                    let off = slot * 2048 + t * 512;
                    vol.write(off, &[t as u8 + 1; 512]).expect("write");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("writer");
    }
    assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0);
}

/// Sum of one STATS counter over every server.
fn ops(servers: &[DevCluster], name: &str) -> u64 {
    servers
        .iter()
        .flat_map(|c| c.stats())
        .flatten()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| v)
        .sum()
}

/// A sub-chunk write on a parity level is two requests: SWAP on the data member and
/// XOR_INTO on each parity member, nothing read (the old way was four: two reads, two
/// writes). Reads back and scrubs clean, so the deltas landed where they belong.
#[test]
fn a_small_parity_write_is_one_swap_and_one_xor_per_parity_member() {
    for (level, n, m) in [
        (Level::Raid5, 4, 1u64),
        (Level::Raid4, 4, 1),
        (Level::Rs { k: 2, m: 2 }, 4, 2),
    ] {
        let (servers, addrs) = servers(n);
        let name = format!("small{n}{m}{level:?}").replace(|c: char| !c.is_alphanumeric(), "");
        let vol = Volume::create(
            &name,
            level,
            &addrs,
            CHUNK,
            256 << 10,
            &VolumeConfig::default(),
        )
        .expect("create");
        // The zone's intent mark goes out on the first write; count the second.
        vol.write(0, &[1u8; 512]).expect("first write");
        let before: Vec<u64> = ["ops_read", "ops_write", "ops_swap", "ops_xor_into"]
            .iter()
            .map(|k| ops(&servers, k))
            .collect();
        vol.write(CHUNK + 1024, &[7u8; 1024]).expect("small write");
        let after: Vec<u64> = ["ops_read", "ops_write", "ops_swap", "ops_xor_into"]
            .iter()
            .map(|k| ops(&servers, k))
            .collect();
        let delta: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        assert_eq!(
            delta,
            vec![0, 0, 1, m],
            "{level:?}: read, write, swap, xor_into"
        );
        let mut buf = vec![0u8; 2048];
        vol.read(CHUNK, &mut buf).expect("read");
        assert!(buf[..1024].iter().all(|&b| b == 0) && buf[1024..].iter().all(|&b| b == 7));
        assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0, "{level:?}");
    }
}

/// Degraded, a write whose pieces all fall on present members costs what it costs
/// healthy, minus the absent member: a sub-chunk write is one SWAP and an XOR_INTO per
/// present parity member, a full stripe one WRITE per present member, nothing read. Only
/// a piece on the lost member reads the stripe back. Reads follow a shadow copy, and the
/// rebuilt volume scrubs clean, so parity stayed the code of the data throughout.
#[test]
fn degraded_writes_off_the_lost_member_read_nothing() {
    for (level, n) in [(Level::Raid5, 4), (Level::Rs { k: 2, m: 2 }, 4)] {
        let (mut servers, addrs) = servers(n);
        let name = format!("deg{n}{level:?}").replace(|c: char| !c.is_alphanumeric(), "");
        let vol = Volume::create(
            &name,
            level,
            &addrs,
            CHUNK,
            256 << 10,
            &VolumeConfig::default(),
        )
        .expect("create");
        let mut shadow = vec![0u8; vol.capacity_bytes() as usize];
        let mut rng = SmallRng::seed_from_u64(11);
        exercise(&vol, &mut shadow, &mut rng, 30);
        let lost = 1;
        servers.remove(lost).shutdown().expect("stop");
        assert_eq!(read_all(&vol), shadow, "{level:?}: degraded read");
        assert_eq!(vol.status().missing, vec![lost]);

        let layout = *vol.layout();
        let k = layout.data_slots();
        let stripe_bytes = layout.stripe_data_bytes();
        let keys = ["ops_read", "ops_write", "ops_swap", "ops_xor_into"];
        let mut write_counting = |offset: u64, data: &[u8]| -> Vec<u64> {
            let before: Vec<u64> = keys.iter().map(|k| ops(&servers, k)).collect();
            vol.write(offset, data).expect("degraded write");
            shadow[offset as usize..][..data.len()].copy_from_slice(data);
            let after: Vec<u64> = keys.iter().map(|k| ops(&servers, k)).collect();
            after.iter().zip(&before).map(|(a, b)| a - b).collect()
        };
        for s in 0..(n as u64) {
            let lost_slot = layout.slot_of(s, lost);
            let parity_present = (k..n).filter(|&j| j != lost_slot).count() as u64;
            // A sub-chunk write on a present data member.
            let j = (0..k)
                .find(|&j| j != lost_slot)
                .expect("a present data slot");
            let at = s * stripe_bytes + j as u64 * CHUNK + 512;
            let delta = write_counting(at, &[s as u8 + 1; 1024]);
            assert_eq!(
                delta,
                vec![0, 0, 1, parity_present],
                "{level:?} stripe {s} (lost slot {lost_slot}): read, write, swap, xor_into"
            );
            // A full stripe: every present member written once, nothing read.
            let delta = write_counting(s * stripe_bytes, &vec![s as u8 + 9; stripe_bytes as usize]);
            assert_eq!(
                delta,
                vec![0, n as u64 - 1, 0, 0],
                "{level:?} stripe {s}: full"
            );
            // A piece on the lost member: the stripe is read back to rebuild it.
            if lost_slot < k {
                let at = s * stripe_bytes + lost_slot as u64 * CHUNK + 100;
                let delta = write_counting(at, &[s as u8 + 50; 300]);
                assert!(delta[0] > 0, "{level:?} stripe {s}: {delta:?}");
            }
        }
        exercise(&vol, &mut shadow, &mut rng, 40);
        assert_eq!(read_all(&vol), shadow, "{level:?}: after degraded writes");
        let fresh = server();
        vol.rebuild(lost, fresh.addrs()[0], 0).expect("rebuild");
        assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0, "{level:?}");
        servers.remove(0).shutdown().expect("stop another");
        assert_eq!(
            read_all(&vol),
            shadow,
            "{level:?}: through the rebuilt member"
        );
        drop(fresh);
    }
}

#[test]
fn bad_arguments_are_refused() {
    let (_servers, addrs) = servers(3);
    let cfg = VolumeConfig::default();
    assert!(Volume::create("bad name", Level::Raid5, &addrs, CHUNK, 1 << 20, &cfg).is_err());
    assert!(Volume::create(
        "x",
        Level::Raid5,
        &[addrs[0], addrs[0], addrs[1]],
        CHUNK,
        1 << 20,
        &cfg
    )
    .is_err());
    let vol = Volume::create("x", Level::Raid5, &addrs, CHUNK, 1 << 20, &cfg).expect("create");
    let mut buf = [0u8; 10];
    assert!(vol.read(vol.capacity_bytes() - 5, &mut buf).is_err());
    assert!(vol.write(u64::MAX - 2, &buf).is_err());
}

#[test]
fn rebuild_runs_in_the_background_while_the_volume_serves() {
    let (mut servers, addrs) = servers(4);
    let vol = std::sync::Arc::new(
        Volume::create(
            "t7",
            Level::Raid5,
            &addrs,
            CHUNK,
            768 << 10,
            &VolumeConfig::default(),
        )
        .expect("create"),
    );
    let mut shadow = vec![0u8; vol.capacity_bytes() as usize];
    let mut rng = SmallRng::seed_from_u64(77);
    exercise(&vol, &mut shadow, &mut rng, 40);
    servers.remove(2).shutdown().expect("stop");
    exercise(&vol, &mut shadow, &mut rng, 20);
    assert_eq!(vol.status().missing, vec![2]);

    let fresh = server();
    let target = fresh.addrs()[0];
    // 256 stripes of 4 KiB at 2 MiB/s: about half a second of rebuilding to serve through.
    let rebuilder = {
        let vol = vol.clone();
        std::thread::spawn(move || vol.rebuild(2, target, 2 << 20))
    };
    let mut saw_progress = false;
    let mut rounds = 0;
    while !rebuilder.is_finished() {
        exercise(&vol, &mut shadow, &mut rng, 5);
        rounds += 1;
        if let Some((member, done, total)) = vol.status().rebuild {
            assert_eq!(member, 2);
            saw_progress |= done > 0 && done < total;
        }
        assert!(rounds < 100_000, "rebuild never finished");
    }
    rebuilder.join().expect("rebuild thread").expect("rebuild");
    assert!(saw_progress, "never saw the rebuild part-way");
    assert!(!vol.status().degraded());
    assert_eq!(read_all(&vol), shadow);
    assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0);
    // The rebuilt member now carries its share: lose another and read through it.
    servers.remove(0).shutdown().expect("stop another");
    assert_eq!(read_all(&vol), shadow);
    drop(fresh);
}

/// Writers hammer the whole volume while an unlimited rebuild runs: a write on either side
/// of the cursor must leave the new member right, or scrub, and reading through the
/// rebuilt member with another member lost, would see it.
#[test]
fn writes_during_an_unlimited_rebuild_reach_the_new_member() {
    const WRITERS: u64 = 3;
    let (mut servers, addrs) = servers(4);
    let vol = std::sync::Arc::new(
        Volume::create(
            "t8",
            Level::Raid5,
            &addrs,
            CHUNK,
            12 << 20,
            &VolumeConfig::default(),
        )
        .expect("create"),
    );
    let blocks = vol.capacity_bytes() / 4096;
    let shadow = std::sync::Arc::new(parking_lot::Mutex::new(vec![
        0u8;
        vol.capacity_bytes() as usize
    ]));
    servers.remove(2).shutdown().expect("stop");
    vol.write(0, &[1]).expect("a write notices the lost member");
    shadow.lock()[0] = 1;
    assert_eq!(vol.status().missing, vec![2]);

    let fresh = server();
    let target = fresh.addrs()[0];
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (vol, shadow, done) = (vol.clone(), shadow.clone(), done.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(800 + w);
                let mut writes = 0u64;
                while !done.load(std::sync::atomic::Ordering::SeqCst) || writes < 50 {
                    // Disjoint blocks per writer, so the shadow's order is the volume's.
                    let block = rng.gen_range(0..blocks / WRITERS) * WRITERS + w;
                    let data: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
                    vol.write(block * 4096, &data).expect("write");
                    shadow.lock()[(block * 4096) as usize..(block * 4096 + 4096) as usize]
                        .copy_from_slice(&data);
                    writes += 1;
                }
                writes
            })
        })
        .collect();
    vol.rebuild(2, target, 0).expect("rebuild");
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let writes: u64 = writers.into_iter().map(|w| w.join().expect("writer")).sum();
    assert!(writes >= 50 * WRITERS);
    assert!(!vol.status().degraded());
    let shadow = shadow.lock().clone();
    assert!(read_all(&vol) == shadow, "data differs after the rebuild");
    assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0);
    servers.remove(0).shutdown().expect("stop another");
    assert!(
        read_all(&vol) == shadow,
        "reading through the rebuilt member gave different data"
    );
    drop(fresh);
}

/// (READ, WRITE, SWAP, XOR_INTO, batches) one server has counted.
fn counters(server: &DevCluster) -> [u64; 5] {
    let stats = server.stats();
    let get = |name: &str| {
        stats
            .iter()
            .flatten()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .sum::<u64>()
    };
    [
        get("ops_read"),
        get("ops_write"),
        get("ops_swap"),
        get("ops_xor_into"),
        get("batches"),
    ]
}

/// A full-stripe write computes parity from the new data: no member is read (no READ,
/// no SWAP, no XOR_INTO), every member gets one WRITE per stripe, and each member's share
/// of the call arrives as one batch (one frame), not one per chunk.
#[test]
fn a_full_stripe_write_reads_nothing_and_sends_one_batch_per_member() {
    const STRIPES: u64 = 3;
    for (level, n) in [
        (Level::Raid4, 4),
        (Level::Raid5, 4),
        (Level::Rs { k: 4, m: 2 }, 6),
    ] {
        let (servers, addrs) = servers(n);
        let name = format!("full{n}{level:?}").replace(|c: char| !c.is_alphanumeric(), "");
        let vol = Volume::create(
            &name,
            level,
            &addrs,
            CHUNK,
            256 << 10,
            &VolumeConfig::default(),
        )
        .expect("create");
        let stripe = vol.layout().stripe_data_bytes();
        // The zone's intent mark goes out with the first write; count the next one.
        vol.write(0, &vec![1u8; stripe as usize])
            .expect("first write");
        let before: Vec<[u64; 5]> = servers.iter().map(counters).collect();
        let data: Vec<u8> = (0..STRIPES * stripe).map(|i| (i % 251) as u8).collect();
        vol.write(stripe, &data).expect("full-stripe write");
        let after: Vec<[u64; 5]> = servers.iter().map(counters).collect();
        for (m, (a, b)) in after.iter().zip(&before).enumerate() {
            let d: Vec<u64> = a.iter().zip(b).map(|(a, b)| a - b).collect();
            assert_eq!(
                d,
                vec![0, STRIPES, 0, 0, 1],
                "{level:?} member {m}: read, write, swap, xor_into, batches"
            );
        }
        let mut back = vec![0u8; data.len()];
        vol.read(stripe, &mut back).expect("read");
        assert!(back == data, "{level:?}: read back differs");
        assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0, "{level:?}");
    }
}

/// A TCP relay on loopback that holds every byte the server sends for `delay` before
/// passing it on (in arrival order), so each request/answer exchange through it costs at
/// least `delay`: how many exchanges a call waits for one after another shows in its
/// wall time.
struct DelayProxy {
    addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Answer chunks one direction of a relay holds at most before the reader waits.
const PROXY_QUEUE_CHUNKS_MAX: usize = 1024;

impl DelayProxy {
    fn start(upstream: SocketAddr, delay: std::time::Duration) -> DelayProxy {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listens");
        let addr = listener.local_addr().expect("proxy address");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopping.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (Ok(mut client_in), Ok(mut server_out)) =
                    (client.try_clone(), server.try_clone())
                else {
                    continue;
                };
                // Requests go straight through.
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut client_in, &mut server_out);
                    let _ = server_out.shutdown(Shutdown::Write);
                });
                // Answers wait `delay` from when they arrived.
                let (tx, rx) = std::sync::mpsc::sync_channel::<(std::time::Instant, Vec<u8>)>(
                    PROXY_QUEUE_CHUNKS_MAX,
                );
                let mut server_in = server;
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = server_in.read(&mut buf) {
                        if n == 0
                            || tx
                                .send((std::time::Instant::now() + delay, buf[..n].to_vec()))
                                .is_err()
                        {
                            break;
                        }
                    }
                });
                let mut client_out = client;
                std::thread::spawn(move || {
                    for (due, bytes) in rx {
                        // The relay's job is to hold bytes this long: this sleep is the
                        // simulated wire, not a wait for another thread.
                        std::thread::sleep(
                            due.saturating_duration_since(std::time::Instant::now()),
                        );
                        if client_out.write_all(&bytes).is_err() {
                            break;
                        }
                    }
                    let _ = client_out.shutdown(Shutdown::Both);
                });
            }
        });
        DelayProxy { addr, stop }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}

/// One call's chunk I/O leaves at once to every member it touches: through relays that
/// delay every answer by `DELAY`, a two-stripe write or read over four members takes one
/// delay (members one after another would take four, chunks one after another eight),
/// and a sub-chunk parity write takes two (SWAP, then XOR_INTO).
#[test]
fn one_call_waits_one_round_trip_for_all_its_members_at_once() {
    const DELAY: std::time::Duration = std::time::Duration::from_millis(150);
    let (_servers, addrs) = servers(4);
    let proxies: Vec<DelayProxy> = addrs.iter().map(|a| DelayProxy::start(*a, DELAY)).collect();
    let via: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let vol = Volume::create(
        "rtt",
        Level::Raid5,
        &via,
        CHUNK,
        256 << 10,
        &VolumeConfig::default(),
    )
    .expect("create");
    let stripe = vol.layout().stripe_data_bytes() as usize;
    // Marks zone 0 and opens a connection to every member.
    vol.write(0, &vec![1u8; stripe]).expect("first write");
    let data: Vec<u8> = (0..2 * stripe).map(|i| (i % 253) as u8).collect();
    let timed = |f: &dyn Fn()| {
        let t = std::time::Instant::now();
        f();
        t.elapsed()
    };
    let full = timed(&|| vol.write(stripe as u64, &data).expect("full-stripe write"));
    let read = timed(&|| {
        let mut back = vec![0u8; data.len()];
        vol.read(stripe as u64, &mut back).expect("read");
        assert!(back == data, "read back differs");
    });
    let small = timed(&|| {
        vol.write(stripe as u64 + 100, &[9u8; 200])
            .expect("small write")
    });
    for (what, took, trips) in [
        ("two-stripe write", full, 1),
        ("two-stripe read", read, 1),
        ("sub-chunk write", small, 2),
    ] {
        assert!(
            took >= DELAY * trips && took < DELAY * (trips + 1),
            "{what} took {took:?}: want {trips} round trip(s) of {DELAY:?} \
             (each member in turn would take {:?})",
            DELAY * 4 * trips
        );
    }
    assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0);
}

/// A rate-limited rebuild never gets ahead of its budget: at any moment it has rebuilt
/// at most `rate × elapsed` plus the round under way, so it takes at least the member's
/// bytes ÷ the rate.
#[test]
fn a_rebuild_keeps_to_its_rate_limit() {
    const RATE: u64 = 1 << 20;
    /// Stripes a rebuild round handles (the volume's `STRIPES_PER_ROUND`).
    const ROUND_STRIPES: u64 = 16;
    let (mut servers, addrs) = servers(4);
    let vol = std::sync::Arc::new(
        Volume::create(
            "rate",
            Level::Raid5,
            &addrs,
            CHUNK,
            1 << 20,
            &VolumeConfig::default(),
        )
        .expect("create"),
    );
    let mut shadow = vec![0u8; vol.capacity_bytes() as usize];
    let mut rng = SmallRng::seed_from_u64(31);
    exercise(&vol, &mut shadow, &mut rng, 30);
    servers.remove(1).shutdown().expect("stop");
    assert_eq!(read_all(&vol), shadow);
    assert_eq!(vol.status().missing, vec![1]);
    let fresh = server();
    let target = fresh.addrs()[0];
    let member_bytes = vol.layout().member_data_bytes();
    let started = std::time::Instant::now();
    let rebuilder = {
        let vol = vol.clone();
        std::thread::spawn(move || vol.rebuild(1, target, RATE))
    };
    let mut samples = 0;
    while !rebuilder.is_finished() {
        if let Some((_, done, _)) = vol.status().rebuild {
            // Read after the status, so the allowance is if anything generous.
            let allowed =
                RATE as f64 * started.elapsed().as_secs_f64() + (ROUND_STRIPES * CHUNK) as f64;
            assert!(
                (done * CHUNK) as f64 <= allowed,
                "{done} stripes rebuilt after {:?}: more than {RATE} B/s allows",
                started.elapsed()
            );
            samples += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    rebuilder.join().expect("rebuild thread").expect("rebuild");
    let took = started.elapsed();
    let floor = std::time::Duration::from_secs_f64(member_bytes as f64 / RATE as f64);
    assert!(
        took >= floor,
        "rebuilt {member_bytes} B in {took:?}: faster than {RATE} B/s ({floor:?})"
    );
    assert!(samples > 0, "never saw the rebuild under way");
    assert!(!vol.status().degraded());
    assert_eq!(read_all(&vol), shadow);
    assert_eq!(vol.scrub(false).expect("scrub").mismatches, 0);
    drop(fresh);
}
