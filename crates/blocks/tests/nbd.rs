//! A volume over real servers on loopback, exported over NBD and used by the stock libnbd
//! tools (`nbdinfo`, `nbdcopy` from Debian's libnbd-bin, which scripts/setup.sh installs)
//! and by a hand-rolled client where a test needs a request cut in half.

use camelot_blocks::nbd::{BlockDevice, NbdConfig, NbdServer};
use camelot_blocks::nbd_proto::{self as p, RequestHeader};
use camelot_blocks::{Level, Volume, VolumeConfig};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use camelot_testkit::process::{os_args, run_to_end, Program, ScratchDir};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const NBDINFO: Program = Program::debian("nbdinfo", "libnbd-bin");
const NBDCOPY: Program = Program::debian("nbdcopy", "libnbd-bin");
const CLIENT_TIME_LIMIT: Duration = Duration::from_secs(60);
const WAIT_LIMIT: Duration = Duration::from_secs(20);
const CHUNK: u64 = 16 << 10;

fn servers(n: usize) -> (Vec<DevCluster>, Vec<SocketAddr>) {
    let s: Vec<DevCluster> = (0..n)
        .map(|_| {
            DevCluster::start(DevClusterConfig {
                nodes: 1,
                memory_bytes_per_node: 64 << 20,
                worker_threads: 1,
                ..DevClusterConfig::default()
            })
            .expect("server")
        })
        .collect();
    let addrs = s.iter().map(|c| c.addrs()[0]).collect();
    (s, addrs)
}

fn raid5(name: &str, addrs: &[SocketAddr], size: u64) -> Arc<Volume> {
    Arc::new(
        Volume::create(
            name,
            Level::Raid5,
            addrs,
            CHUNK,
            size,
            &VolumeConfig::default(),
        )
        .expect("create"),
    )
}

fn export(vol: &Arc<Volume>, connections_max: usize) -> NbdServer {
    let device: Arc<dyn BlockDevice> = vol.clone();
    NbdServer::start(
        device,
        vol.name(),
        NbdConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            connections_max,
            ..NbdConfig::default()
        },
    )
    .expect("nbd server")
}

fn url(server: &NbdServer) -> String {
    format!("nbd://{}", server.local_addr())
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT_LIMIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn nbdcopy(scratch: &ScratchDir, from: &str, to: &str) {
    let done = run_to_end(
        &NBDCOPY,
        &os_args([from, to]),
        scratch,
        "nbdcopy",
        CLIENT_TIME_LIMIT,
    )
    .expect("nbdcopy ran");
    assert!(
        done.status.success(),
        "{}",
        done.failure(&NBDCOPY, "nbdcopy failed")
    );
}

fn nbdinfo_size(scratch: &ScratchDir, url: &str) -> u64 {
    let done = run_to_end(
        &NBDINFO,
        &os_args(["--size", url]),
        scratch,
        "nbdinfo",
        CLIENT_TIME_LIMIT,
    )
    .expect("nbdinfo ran");
    assert!(
        done.status.success(),
        "{}",
        done.failure(&NBDINFO, "nbdinfo failed")
    );
    done.stdout.trim().parse().expect("nbdinfo prints a size")
}

/// A minimal client: fixed newstyle, EXPORT_NAME, simple replies.
struct RawClient {
    sock: TcpStream,
    size: u64,
}

impl RawClient {
    fn connect(addr: SocketAddr) -> RawClient {
        let mut sock = TcpStream::connect(addr).expect("connect");
        sock.set_read_timeout(Some(WAIT_LIMIT)).unwrap();
        let mut greeting = [0u8; p::GREETING_BYTES];
        sock.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[..8], &p::NBD_MAGIC.to_be_bytes());
        let mut hello = (p::CLIENT_FLAG_FIXED_NEWSTYLE | p::CLIENT_FLAG_NO_ZEROES)
            .to_be_bytes()
            .to_vec();
        hello.extend_from_slice(&p::IHAVEOPT.to_be_bytes());
        hello.extend_from_slice(&p::OPT_EXPORT_NAME.to_be_bytes());
        hello.extend_from_slice(&0u32.to_be_bytes());
        sock.write_all(&hello).unwrap();
        let mut answer = [0u8; 10];
        sock.read_exact(&mut answer).expect("export name answer");
        let mut size = [0u8; 8];
        size.copy_from_slice(&answer[..8]);
        RawClient {
            sock,
            size: u64::from_be_bytes(size),
        }
    }

    fn header(command: u16, handle: u64, offset: u64, length: u32) -> [u8; 28] {
        p::encode_request_header(&RequestHeader {
            flags: 0,
            command,
            handle,
            offset,
            length,
        })
    }

    fn reply(&mut self, handle: u64) -> u32 {
        let mut r = [0u8; p::SIMPLE_REPLY_HEADER_BYTES];
        self.sock.read_exact(&mut r).expect("reply");
        assert_eq!(&r[..4], &p::SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&r[8..], &handle.to_be_bytes());
        u32::from_be_bytes([r[4], r[5], r[6], r[7]])
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut m = Self::header(p::CMD_WRITE, 1, offset, data.len() as u32).to_vec();
        m.extend_from_slice(data);
        self.sock.write_all(&m).unwrap();
        assert_eq!(self.reply(1), 0);
    }

    fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        self.sock
            .write_all(&Self::header(p::CMD_READ, 2, offset, len as u32))
            .unwrap();
        assert_eq!(self.reply(2), 0);
        let mut buf = vec![0u8; len];
        self.sock.read_exact(&mut buf).expect("read data");
        buf
    }
}

#[test]
fn nbdinfo_sees_the_size_and_nbdcopy_round_trips_a_random_file() {
    let (_servers, addrs) = servers(4);
    let vol = raid5("nbd1", &addrs, 6 << 20);
    let server = export(&vol, 8);
    let scratch = ScratchDir::new("nbd-copy").unwrap();
    assert_eq!(nbdinfo_size(&scratch, &url(&server)), vol.capacity_bytes());

    let mut rng = SmallRng::seed_from_u64(17);
    let data: Vec<u8> = (0..vol.capacity_bytes()).map(|_| rng.gen()).collect();
    let input = scratch.path.join("in.bin");
    let output = scratch.path.join("out.bin");
    std::fs::write(&input, &data).unwrap();
    nbdcopy(&scratch, input.to_str().unwrap(), &url(&server));
    // What nbdcopy wrote is in the volume itself, read past the export.
    let mut direct = vec![0u8; data.len()];
    vol.read(0, &mut direct).unwrap();
    assert!(direct == data, "the volume does not hold the copied file");
    nbdcopy(&scratch, &url(&server), output.to_str().unwrap());
    let back = std::fs::read(&output).unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "nbdcopy read back different bytes");
    assert_eq!(vol.scrub(false).unwrap().mismatches, 0);
}

#[test]
fn a_client_killed_mid_write_leaves_the_server_serving_others() {
    let (_servers, addrs) = servers(4);
    let vol = raid5("nbd2", &addrs, 8 << 20);
    let server = export(&vol, 8);
    let scratch = ScratchDir::new("nbd-kill").unwrap();
    let mut other = RawClient::connect(server.local_addr());
    assert_eq!(other.size, vol.capacity_bytes());
    // Past the 6 MiB nbdcopy is fed.
    let mark = vol.capacity_bytes() - 4096;
    other.write(mark, b"before");

    // A stock client streaming from a pipe, SIGKILLed while its writes are under way.
    let mut nbdcopy = Command::new(NBDCOPY.program.as_ref())
        .args(["-", &url(&server)])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nbdcopy (libnbd-bin) starts");
    let mut stdin = nbdcopy.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        let block = vec![0xabu8; 256 << 10];
        // Ends when nbdcopy dies (broken pipe) or the volume is covered.
        for _ in 0..24 {
            if stdin.write_all(&block).is_err() {
                break;
            }
        }
        // Held open so nbdcopy waits for more rather than finishing.
        std::thread::sleep(Duration::from_secs(30));
    });
    let before = server.stats().bytes_written.load(Ordering::SeqCst);
    wait_for("nbdcopy's writes", || {
        server.stats().bytes_written.load(Ordering::SeqCst) > before
    });
    nbdcopy.kill().expect("SIGKILL nbdcopy");
    nbdcopy.wait().unwrap();
    wait_for("the killed client's connections to close", || {
        server.stats().connections_active.load(Ordering::SeqCst) == 1
    });

    // A client cut off in the middle of a write's payload changes nothing.
    {
        let mut torn = RawClient::connect(server.local_addr());
        let mut m = RawClient::header(p::CMD_WRITE, 9, 1 << 20, 64 << 10).to_vec();
        m.extend_from_slice(&[0x55u8; 1000]);
        torn.sock.write_all(&m).unwrap();
    }
    wait_for("the torn client's connection to close", || {
        server.stats().connections_active.load(Ordering::SeqCst) == 1
    });
    let mut region = vec![0u8; 64 << 10];
    vol.read(1 << 20, &mut region).unwrap();
    assert!(
        !region.contains(&0x55),
        "part of a write whose payload never arrived reached the volume"
    );

    // The connection that was there all along still works, and so do new ones.
    assert_eq!(other.read(mark, 6), b"before");
    other.write(mark, b"after!");
    assert_eq!(other.read(mark, 6), b"after!");
    assert_eq!(nbdinfo_size(&scratch, &url(&server)), vol.capacity_bytes());
    let out = scratch.path.join("out.bin");
    nbdcopy_after_kill(&scratch, &server, &out);
    let copied = std::fs::read(&out).unwrap();
    let mark = mark as usize;
    assert_eq!(&copied[mark..mark + 6], b"after!");
    drop(feeder);
}

fn nbdcopy_after_kill(scratch: &ScratchDir, server: &NbdServer, out: &std::path::Path) {
    nbdcopy(scratch, &url(server), out.to_str().unwrap());
}

#[test]
fn connections_past_the_limit_are_closed_and_a_freed_slot_serves_again() {
    let (_servers, addrs) = servers(3);
    let vol = Arc::new(
        Volume::create(
            "nbd3",
            Level::Raid0,
            &addrs,
            CHUNK,
            1 << 20,
            &VolumeConfig::default(),
        )
        .unwrap(),
    );
    let server = export(&vol, 2);
    let a = RawClient::connect(server.local_addr());
    let mut b = RawClient::connect(server.local_addr());
    wait_for("two connections", || {
        server.stats().connections_active.load(Ordering::SeqCst) == 2
    });
    let mut third = TcpStream::connect(server.local_addr()).unwrap();
    third.set_read_timeout(Some(WAIT_LIMIT)).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(
        third.read(&mut buf).unwrap_or(0),
        0,
        "a connection past the limit was greeted"
    );
    assert_eq!(server.stats().connections_refused.load(Ordering::SeqCst), 1);
    drop(a);
    wait_for("a freed slot", || {
        server.stats().connections_active.load(Ordering::SeqCst) == 1
    });
    let mut c = RawClient::connect(server.local_addr());
    c.write(0, b"xyz");
    assert_eq!(b.read(0, 3), b"xyz");
}

const FIO: Program = Program::debian("fio", "fio");

/// fio's own NBD engine (libnbd underneath) writes random 4 KiB blocks with checksums,
/// then reads every one back and verifies it: a third stock client, with a queue depth.
#[test]
fn fio_nbd_engine_writes_and_verifies_random_blocks() {
    let (_servers, addrs) = servers(4);
    let vol = raid5("nbd4", &addrs, 4 << 20);
    let server = export(&vol, 8);
    let scratch = ScratchDir::new("nbd-fio").unwrap();
    let uri = format!("--uri={}", url(&server));
    let done = run_to_end(
        &FIO,
        &os_args([
            "--name=verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            "--size=4m",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--output-format=json",
        ]),
        &scratch,
        "fio",
        CLIENT_TIME_LIMIT,
    )
    .expect("fio ran");
    assert!(
        done.status.success(),
        "{}",
        done.failure(&FIO, "fio failed")
    );
    let json_start = done.stdout.find('{').expect("fio prints JSON");
    let report: serde_json::Value =
        serde_json::from_str(&done.stdout[json_start..]).expect("fio's JSON");
    let job = &report["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    // Every block written was read back for the verify.
    let written = job["write"]["io_bytes"].as_u64().expect("bytes written");
    let read = job["read"]["io_bytes"].as_u64().expect("bytes read");
    assert_eq!(written, 4 << 20);
    assert_eq!(read, written, "fio did not read back what it wrote");
    assert!(server.stats().bytes_written.load(Ordering::SeqCst) >= 4 << 20);
}

/// A client that asks for reads and never takes the replies, and one that connects and
/// never finishes its handshake: both are hung up on, and their slots come back.
#[test]
fn clients_that_stall_are_hung_up_on_and_free_their_slots() {
    let (_servers, addrs) = servers(3);
    let vol = Arc::new(
        Volume::create(
            "nbd5",
            Level::Raid0,
            &addrs,
            CHUNK,
            8 << 20,
            &VolumeConfig::default(),
        )
        .unwrap(),
    );
    let device: Arc<dyn BlockDevice> = vol.clone();
    let server = NbdServer::start(
        device,
        vol.name(),
        NbdConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            connections_max: 2,
            handshake_timeout: Duration::from_millis(300),
            reply_timeout: Duration::from_millis(300),
            ..NbdConfig::default()
        },
    )
    .expect("nbd server");
    let mut greedy = RawClient::connect(server.local_addr());
    // Far more reply bytes than the socket buffers hold, none of them read.
    let mut asks = Vec::new();
    for h in 0..64u64 {
        asks.extend_from_slice(&RawClient::header(p::CMD_READ, h, 0, 8 << 20));
    }
    greedy.sock.write_all(&asks).unwrap();
    let _silent = TcpStream::connect(server.local_addr()).unwrap();
    wait_for("two connections", || {
        server.stats().connections_active.load(Ordering::SeqCst) == 2
    });
    wait_for("both stalled clients to be dropped", || {
        server.stats().connections_active.load(Ordering::SeqCst) == 0
    });
    let mut fresh = RawClient::connect(server.local_addr());
    fresh.write(0, b"served");
    assert_eq!(fresh.read(0, 6), b"served");
}
