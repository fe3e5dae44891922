//! Block volumes over `camelot server` processes: a member SIGKILLed under load, and the
//! `camelot volume` commands as a script would use them.

use camelot_blocks::{Level, Volume, VolumeConfig};
use camelot_testkit::{CamelotServer, CamelotServerOptions};
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");
const BLOCK: u64 = 4096;
/// Writes done before the kill, and after it, before the load stops.
const WRITES_BEFORE_KILL: u64 = 300;
const WRITES_AFTER_KILL: u64 = 300;
const LOAD_DEADLINE: Duration = Duration::from_secs(60);

fn server() -> CamelotServer {
    CamelotServer::start(
        Path::new(CAMELOT),
        &CamelotServerOptions {
            resp: false,
            args: vec![
                "--memory".into(),
                "128M".into(),
                "--threads".into(),
                "1".into(),
            ],
        },
    )
    .expect("camelot server")
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// What a load with one member SIGKILLed part-way saw.
#[derive(Debug, Default)]
struct Outcome {
    failed_reads: u64,
    failed_writes: u64,
    wrong_reads: u64,
    lost_acknowledged_writes: u64,
    slowest_op: Duration,
    ops_after_kill: u64,
}

/// Readers check a static half of the volume; a writer rewrites blocks of the other half
/// and records each acknowledged value; member 2's server is SIGKILLed after
/// `WRITES_BEFORE_KILL` writes. Afterwards every acknowledged write is read back.
fn kill_under_load(level: Level, n: usize) -> (Outcome, Volume) {
    let mut servers: Vec<CamelotServer> = (0..n).map(|_| server()).collect();
    let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
    let vol = Arc::new(
        Volume::create(
            "load",
            level,
            &addrs,
            16 << 10,
            4 << 20,
            &VolumeConfig::default(),
        )
        .expect("create"),
    );
    let blocks = vol.capacity_bytes() / BLOCK;
    let half = blocks / 2;
    let static_byte = |b: u64| (b * 7 + 1) as u8;
    for b in 0..half {
        vol.write(b * BLOCK, &[static_byte(b); BLOCK as usize])
            .expect("fill");
    }
    let acked: Arc<Mutex<Vec<Option<u8>>>> = Arc::new(Mutex::new(vec![None; blocks as usize]));
    let writes = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicBool::new(false));
    let outcome = Arc::new(Mutex::new(Outcome::default()));

    let mut workers = Vec::new();
    {
        let (vol, acked, writes, stop, outcome, killed) = (
            vol.clone(),
            acked.clone(),
            writes.clone(),
            stop.clone(),
            outcome.clone(),
            killed.clone(),
        );
        workers.push(std::thread::spawn(move || {
            let mut x = 0x5eed_u64;
            while !stop.load(Ordering::Relaxed) {
                let b = half + xorshift(&mut x) % (blocks - half);
                let v = (xorshift(&mut x) % 255) as u8 + 1;
                let t = Instant::now();
                let r = vol.write(b * BLOCK, &[v; BLOCK as usize]);
                let took = t.elapsed();
                let mut o = outcome.lock().expect("outcome");
                o.slowest_op = o.slowest_op.max(took);
                if killed.load(Ordering::Relaxed) {
                    o.ops_after_kill += 1;
                }
                match r {
                    Ok(()) => {
                        acked.lock().expect("acked")[b as usize] = Some(v);
                        writes.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => o.failed_writes += 1,
                }
            }
        }));
    }
    for r in 0..2u64 {
        let (vol, stop, outcome, killed) =
            (vol.clone(), stop.clone(), outcome.clone(), killed.clone());
        workers.push(std::thread::spawn(move || {
            let mut x = 0xfeed + r;
            let mut buf = vec![0u8; BLOCK as usize];
            while !stop.load(Ordering::Relaxed) {
                let b = xorshift(&mut x) % half;
                let t = Instant::now();
                let res = vol.read(b * BLOCK, &mut buf);
                let took = t.elapsed();
                let mut o = outcome.lock().expect("outcome");
                o.slowest_op = o.slowest_op.max(took);
                if killed.load(Ordering::Relaxed) {
                    o.ops_after_kill += 1;
                }
                match res {
                    Ok(()) if buf.iter().all(|&c| c == static_byte(b)) => {}
                    Ok(()) => o.wrong_reads += 1,
                    Err(_) => o.failed_reads += 1,
                }
            }
        }));
    }
    let deadline = Instant::now() + LOAD_DEADLINE;
    let wait_writes = |target: u64| {
        while writes.load(Ordering::Relaxed) < target && Instant::now() < deadline {
            if workers.iter().all(|w| w.is_finished()) {
                break;
            }
            std::thread::yield_now();
        }
    };
    wait_writes(WRITES_BEFORE_KILL);
    servers[2].process_mut().kill().expect("SIGKILL member 2");
    killed.store(true, Ordering::Relaxed);
    let at_kill = writes.load(Ordering::Relaxed);
    wait_writes(at_kill + WRITES_AFTER_KILL);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("worker");
    }
    let mut o = std::mem::take(&mut *outcome.lock().expect("outcome"));
    let mut buf = vec![0u8; BLOCK as usize];
    for (b, v) in acked.lock().expect("acked").iter().enumerate() {
        if let Some(v) = v {
            match vol.read(b as u64 * BLOCK, &mut buf) {
                Ok(()) if buf.iter().all(|c| c == v) => {}
                _ => o.lost_acknowledged_writes += 1,
            }
        }
    }
    drop(servers);
    let vol = Arc::try_unwrap(vol).ok().expect("sole owner");
    (o, vol)
}

#[test]
fn a_member_sigkilled_under_load_loses_nothing_and_stalls_under_a_second() {
    for (level, n) in [(Level::Raid5, 4), (Level::Rs { k: 2, m: 2 }, 4)] {
        let (o, vol) = kill_under_load(level, n);
        println!("{}: {o:?}", level.name());
        assert_eq!(o.failed_reads, 0, "{}: {o:?}", level.name());
        assert_eq!(o.failed_writes, 0, "{}: {o:?}", level.name());
        assert_eq!(o.wrong_reads, 0, "{}: {o:?}", level.name());
        assert_eq!(o.lost_acknowledged_writes, 0, "{}: {o:?}", level.name());
        assert!(
            o.ops_after_kill > 0,
            "{}: nothing ran after the kill",
            level.name()
        );
        assert!(
            o.slowest_op < Duration::from_secs(1),
            "{}: an operation took {:?}",
            level.name(),
            o.slowest_op
        );
        assert_eq!(vol.status().missing, vec![2]);
    }
}

#[test]
fn the_kill_checker_sees_failures_where_there_is_no_redundancy() {
    // raid0 cannot survive the kill: the same checker must count failed operations.
    let (o, _vol) = kill_under_load(Level::Raid0, 4);
    println!("raid0: {o:?}");
    assert!(
        o.failed_reads + o.failed_writes + o.lost_acknowledged_writes > 0,
        "raid0 lost a member and the checker saw nothing: {o:?}"
    );
}

#[test]
fn check_members_notices_a_member_sigkilled_while_the_volume_is_idle() {
    // The race `bench raid compare` once lost: a kill is noticed only by a call that
    // touches the killed member. An idle volume has not noticed it; `check_members` does.
    for (level, n, victim) in [
        (Level::Raid4, 5, 1),
        (Level::Raid1, 2, 1),
        (Level::Raid5, 5, 3),
    ] {
        let mut servers: Vec<CamelotServer> = (0..n).map(|_| server()).collect();
        let addrs: Vec<SocketAddr> = servers.iter().map(CamelotServer::addr).collect();
        let vol = Volume::create(
            "probe",
            level,
            &addrs,
            16 << 10,
            1 << 20,
            &VolumeConfig::default(),
        )
        .expect("create");
        vol.write(0, &[7u8; BLOCK as usize]).expect("write");
        assert_eq!(vol.check_members(), Vec::<usize>::new(), "{}", level.name());
        assert!(!vol.status().degraded(), "{}", level.name());

        servers[victim].process_mut().kill().expect("SIGKILL");
        assert!(
            !vol.status().degraded(),
            "{}: nothing touched the member, yet the volume says it noticed",
            level.name()
        );
        let started = Instant::now();
        assert_eq!(vol.check_members(), vec![victim], "{}", level.name());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{}: a probe of a dead member took {:?}",
            level.name(),
            started.elapsed()
        );
        assert_eq!(vol.status().missing, vec![victim], "{}", level.name());
        // Nothing left to notice; the volume still reads what was written.
        assert_eq!(vol.check_members(), Vec::<usize>::new(), "{}", level.name());
        let mut back = [0u8; BLOCK as usize];
        vol.read(0, &mut back).expect("degraded read");
        assert_eq!(back, [7u8; BLOCK as usize], "{}", level.name());
    }
}

fn camelot(args: &[&str], stdin: Option<&[u8]>) -> (bool, Vec<u8>, String) {
    let mut child = Command::new(CAMELOT)
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("camelot runs");
    {
        let mut input = child.stdin.take().expect("stdin");
        if let Some(data) = stdin {
            input.write_all(data).expect("stdin write");
        }
    }
    let out = child.wait_with_output().expect("camelot ends");
    (
        out.status.success(),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The volume commands a script would run, against `camelot server` processes: create,
/// write, read, SIGKILL a member, read degraded, status, rebuild onto a fresh server,
/// scrub clean, then lose another member and read through the rebuilt one.
fn volume_commands_on(level: &str, members: usize) {
    let mut servers: Vec<CamelotServer> = (0..members).map(|_| server()).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let list = addrs.join(",");
    let name = format!("cli-{}", level.replace([':', '+'], "-"));
    let (ok, out, err) = camelot(
        &[
            "volume",
            "create",
            "--level",
            level,
            "--servers",
            &list,
            "--size",
            "1M",
            "--chunk",
            "16K",
            &name,
        ],
        None,
    );
    assert!(ok, "{level}: {err}");
    let created = String::from_utf8_lossy(&out);
    assert!(
        created.contains(&format!("{level}, {members} members")),
        "{created}"
    );

    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    let (ok, _, err) = camelot(
        &[
            "volume", "write", &name, "--server", &addrs[1], "--offset", "777",
        ],
        Some(&data),
    );
    assert!(ok, "{level}: {err}");
    let read = |server: &str| {
        camelot(
            &[
                "volume", "read", &name, "--server", server, "--offset", "777", "--len", "100000",
            ],
            None,
        )
    };
    let (ok, out, err) = read(&addrs[2]);
    assert!(ok && out == data, "{level}: {err}");

    servers[0].process_mut().kill().expect("SIGKILL");
    let (ok, out, err) = read(&addrs[2]);
    assert!(ok && out == data, "{level}: degraded read: {err}");
    let (ok, out, err) = camelot(&["volume", "status", &name, "--server", &addrs[1]], None);
    let status = String::from_utf8_lossy(&out);
    assert!(
        ok && status.contains("degraded, missing members [0]"),
        "{level}: {status} {err}"
    );

    let fresh = server();
    let replace = format!("{}={}", addrs[0], fresh.addr());
    let (ok, out, err) = camelot(
        &[
            "volume",
            "rebuild",
            &name,
            "--server",
            &addrs[1],
            "--replace",
            &replace,
        ],
        None,
    );
    let text = String::from_utf8_lossy(&out);
    assert!(
        ok && text.contains("state: healthy"),
        "{level}: {text} {err}"
    );
    let (ok, out, err) = camelot(
        &[
            "volume",
            "scrub",
            &name,
            "--server",
            &addrs[2],
            "--no-repair",
        ],
        None,
    );
    let text = String::from_utf8_lossy(&out);
    assert!(
        ok && text.contains(", 0 mismatches"),
        "{level}: {text} {err}"
    );
    // Lose another member: the rebuilt one must now carry its share.
    servers[1].process_mut().kill().expect("SIGKILL");
    let (ok, out, err) = read(&addrs[2]);
    assert!(
        ok && out == data,
        "{level}: read through the rebuilt member: {err}"
    );
    drop(fresh);
}

#[test]
fn volume_commands_create_write_read_degrade_rebuild_and_scrub() {
    volume_commands_on("raid5", 3);
}

#[test]
fn volume_commands_work_for_raid1_raid4_and_rs_over_server_processes() {
    for (level, members) in [("raid1", 3), ("raid4", 3), ("rs:4+2", 6)] {
        volume_commands_on(level, members);
    }
}

/// `volume status` run by another process while `volume rebuild` works (rate-limited so
/// it takes seconds) shows the rebuild part-way, from the progress record the rebuild
/// writes to every member; once the rebuild is done, status shows a healthy volume and no
/// rebuild.
#[test]
fn volume_status_in_another_process_shows_a_rebuild_under_way() {
    const STATUS_DEADLINE: Duration = Duration::from_secs(120);
    let mut servers: Vec<CamelotServer> = (0..3).map(|_| server()).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let (ok, _, err) = camelot(
        &[
            "volume",
            "create",
            "--level",
            "raid5",
            "--servers",
            &addrs.join(","),
            "--size",
            "2M",
            "--chunk",
            "16K",
            "progress",
        ],
        None,
    );
    assert!(ok, "{err}");
    servers[0].process_mut().kill().expect("SIGKILL");
    let fresh = server();
    let replace = format!("{}={}", addrs[0], fresh.addr());
    // 1 MiB to rebuild at 256 KiB/s: about four seconds.
    let mut rebuild = Command::new(CAMELOT)
        .args([
            "volume",
            "rebuild",
            "progress",
            "--server",
            &addrs[1],
            "--replace",
            &replace,
            "--rate",
            "256K",
        ])
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("camelot volume rebuild");
    let status = || {
        let (ok, out, err) = camelot(
            &["volume", "status", "progress", "--server", &addrs[2]],
            None,
        );
        assert!(ok, "status: {err}");
        String::from_utf8_lossy(&out).into_owned()
    };
    let deadline = Instant::now() + STATUS_DEADLINE;
    let mut part_way = None;
    let finished = loop {
        if let Some(done) = rebuild.try_wait().expect("try_wait") {
            break done;
        }
        assert!(Instant::now() < deadline, "the rebuild never finished");
        let text = status();
        if let Some(line) = text.lines().find(|l| l.starts_with("rebuild: member 0, ")) {
            let counts = line["rebuild: member 0, ".len()..]
                .split_whitespace()
                .next()
                .and_then(|c| c.split_once('/'))
                .and_then(|(d, t)| Some((d.parse::<u64>().ok()?, t.parse::<u64>().ok()?)));
            if let Some((done, total)) = counts {
                assert!(done <= total, "{line}");
                if done > 0 && done < total {
                    assert!(
                        line.contains("reported") && text.contains("degraded"),
                        "{text}"
                    );
                    part_way.get_or_insert(text);
                }
            }
        }
    };
    let mut err = String::new();
    if let Some(mut e) = rebuild.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    assert!(finished.success(), "rebuild failed: {err}");
    assert!(
        part_way.is_some(),
        "status never showed the rebuild part-way"
    );
    let text = status();
    assert!(
        text.contains("state: healthy") && !text.contains("rebuild:"),
        "after the rebuild: {text}"
    );
    drop(fresh);
}

const NBDINFO: camelot_testkit::process::Program =
    camelot_testkit::process::Program::debian("nbdinfo", "libnbd-bin");
const NBDCOPY: camelot_testkit::process::Program =
    camelot_testkit::process::Program::debian("nbdcopy", "libnbd-bin");
const NBD_CLIENT_LIMIT: Duration = Duration::from_secs(60);

fn run_nbd_tool(
    tool: &camelot_testkit::process::Program,
    args: &[&str],
    scratch: &camelot_testkit::process::ScratchDir,
) -> String {
    let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
    let done =
        camelot_testkit::process::run_to_end(tool, &args, scratch, &tool.program, NBD_CLIENT_LIMIT)
            .expect("nbd tool ran");
    assert!(
        done.status.success(),
        "{}",
        done.failure(tool, "nbd tool failed")
    );
    done.stdout
}

#[test]
fn serve_nbd_exports_a_volume_to_nbdinfo_and_nbdcopy_and_stops_on_sigterm() {
    use std::io::BufRead;
    let servers: Vec<CamelotServer> = (0..4).map(|_| server()).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let (ok, _, err) = camelot(
        &[
            "volume",
            "create",
            "--level",
            "raid5",
            "--servers",
            &addrs.join(","),
            "--size",
            "3M",
            "--chunk",
            "16K",
            "nbdvol",
        ],
        None,
    );
    assert!(ok, "{err}");

    // Beyond loopback without the flag: refused before anything is bound.
    let (ok, _, err) = camelot(
        &[
            "volume",
            "serve-nbd",
            "nbdvol",
            "--server",
            &addrs[0],
            "--listen",
            "0.0.0.0:0",
        ],
        None,
    );
    assert!(!ok && err.contains("refusing to listen"), "{err}");

    let mut child = Command::new(CAMELOT)
        .args([
            "volume",
            "serve-nbd",
            "nbdvol",
            "--server",
            &addrs[1],
            "--listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("camelot volume serve-nbd");
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().expect("stdout");
    let mut child = KillOnDrop(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("serve-nbd announces its address");
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("nbd://"))
        .unwrap_or_else(|| panic!("no nbd:// address in {line:?}"))
        .to_string();
    assert!(url.starts_with("nbd://127.0.0.1:"), "{url}");

    let scratch = camelot_testkit::process::ScratchDir::new("cli-nbd").unwrap();
    let size: u64 = run_nbd_tool(&NBDINFO, &["--size", &url], &scratch)
        .trim()
        .parse()
        .expect("a size");
    // 3 MiB rounded up to whole stripes of 3 × 16 KiB.
    assert_eq!(size, (3u64 << 20).div_ceil(3 * 16384) * 3 * 16384);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..size).map(|_| xorshift(&mut x) as u8).collect();
    let input = scratch.path.join("in.img");
    let output = scratch.path.join("out.img");
    std::fs::write(&input, &data).unwrap();
    run_nbd_tool(&NBDCOPY, &[input.to_str().unwrap(), &url], &scratch);
    run_nbd_tool(&NBDCOPY, &[&url, output.to_str().unwrap()], &scratch);
    assert!(
        std::fs::read(&output).unwrap() == data,
        "nbdcopy read back different bytes"
    );
    // And through the volume's own read path, from another member.
    let (ok, out, err) = camelot(
        &[
            "volume", "read", "nbdvol", "--server", &addrs[3], "--offset", "0", "--len", "65536",
        ],
        None,
    );
    assert!(ok && out == data[..65536], "{err}");

    let term = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.0.try_wait().expect("try_wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "serve-nbd ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "serve-nbd exited with {status}");
    drop(servers);
}
