//! Many slow readers against a real `camelot server` process: clients that pipeline
//! requests for 1 MB values (RESP GETs and native READs) and never read the answers.
//! The server's resident memory must stay within its caps plus a stated constant, and
//! it must go on serving. The same for a real `camelot proxy run` in front of a server,
//! with READs of 32 MiB, against its `--connection-memory`. Set
//! `CAMELOT_SLOW_READERS_BIN` to run the same checks against another build (that is how
//! they were shown to fail on the code before each budget: see ARCHITECTURE.md).

use bytes::{Bytes, BytesMut};
use camelot_proto::{
    decode_frame, encode_frame, Frame, FrameDecoder, Hello, Op, Reply, Request, RequestBatch,
    PROTOCOL_VERSION,
};
use camelot_testkit::process::{Program, Readiness, ServerProcess};
use camelot_testkit::{CamelotServer, CamelotServerOptions};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// `--memory` (regions and objects; this test stores 2 MiB of it).
const MEMORY_BYTES: u64 = 32 * MIB;
/// `--connection-memory`: every connection's buffers together.
const CONNECTION_MEMORY_BYTES: u64 = 32 * MIB;
/// What the server may hold beyond its two caps: code, the async runtime and its
/// threads, the allocator's slack and one reply per serving thread in flight (see
/// ARCHITECTURE.md, "What a server's memory is bounded by").
const RSS_OVERHEAD_BYTES_MAX: u64 = 48 * MIB;
const VALUE_BYTES: usize = 1_000_000;
const RESP_CONNECTIONS: usize = 160;
const NATIVE_CONNECTIONS: usize = 48;
const REQUESTS_PER_CONNECTION: usize = 16;
/// Bound on every network wait.
const WAIT: Duration = Duration::from_secs(20);
/// RSS is watched until it has not reached a new high for this long (or `WATCH_MAX`).
const SETTLED_AFTER: Duration = Duration::from_millis(1500);
const WATCH_MAX: Duration = Duration::from_secs(20);

fn binary() -> PathBuf {
    std::env::var_os("CAMELOT_SLOW_READERS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_camelot")))
}

fn vm_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("server status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kib * 1024
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&addr, WAIT).expect("connect");
    s.set_read_timeout(Some(WAIT)).expect("read timeout");
    s.set_write_timeout(Some(WAIT)).expect("write timeout");
    s
}

fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn frame(f: &Frame) -> BytesMut {
    let mut buf = BytesMut::new();
    encode_frame(f, &mut buf).expect("encode");
    buf
}

fn hello() -> BytesMut {
    frame(&Frame::Hello(Hello {
        version: PROTOCOL_VERSION,
        token: Bytes::new(),
        principal: String::new(),
        fence: None,
    }))
}

fn recv(s: &mut TcpStream, buf: &mut BytesMut) -> Frame {
    loop {
        if let Some(body) = FrameDecoder::split_frame(buf).expect("sane frame") {
            return decode_frame(body).expect("decodable frame");
        }
        let mut chunk = [0u8; 65536];
        let n = s.read(&mut chunk).expect("read");
        assert!(n > 0, "server closed");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// ALLOCs a region of `size` bytes over the native port; returns its id.
fn alloc(addr: SocketAddr, size: u64, mode: camelot_proto::AccessMode) -> u64 {
    let mut n = connect(addr);
    let mut buf = BytesMut::new();
    n.write_all(&hello()).expect("HELLO");
    assert!(matches!(recv(&mut n, &mut buf), Frame::HelloOk(_)));
    let alloc = Frame::Requests(RequestBatch {
        epoch: 0,
        requests: vec![Request {
            id: 1,
            op: Op::Alloc {
                size,
                name: None,
                mode,
            },
        }],
    });
    n.write_all(&frame(&alloc)).expect("ALLOC");
    match recv(&mut n, &mut buf) {
        Frame::Responses(r) => match &r.responses[0].result {
            Ok(Reply::Region(info)) => info.id,
            other => panic!("ALLOC: {other:?}"),
        },
        other => panic!("ALLOC: {other:?}"),
    }
}

/// Stores the value both ports will be asked for; returns the native region's id.
fn load(server: &CamelotServer) -> u64 {
    let value = vec![b'v'; VALUE_BYTES];
    let mut r = connect(server.resp_addr().expect("resp port"));
    r.write_all(&resp(&[b"SET", b"big", &value])).expect("SET");
    let mut ok = [0u8; 5];
    r.read_exact(&mut ok).expect("SET reply");
    assert_eq!(&ok, b"+OK\r\n");

    alloc(
        server.addr(),
        VALUE_BYTES as u64,
        camelot_proto::AccessMode::Private,
    )
}

/// Opens the slow readers: each sends its requests and never reads. Writes that the
/// server no longer takes (it stopped reading, or closed the connection) are fine.
fn open_slow_readers(server: &CamelotServer, region: u64) -> Vec<TcpStream> {
    let get = resp(&[b"GET", b"big"]).repeat(REQUESTS_PER_CONNECTION);
    let mut native_burst = hello();
    let reads = Frame::Requests(RequestBatch {
        epoch: 0,
        requests: (0..REQUESTS_PER_CONNECTION as u64)
            .map(|id| Request {
                id,
                op: Op::Read {
                    region,
                    offset: 0,
                    len: VALUE_BYTES as u32,
                },
            })
            .collect(),
    });
    // One READ per frame, so the server has work after each of its writes.
    for r in 0..REQUESTS_PER_CONNECTION as u64 {
        let Frame::Requests(b) = &reads else {
            unreachable!()
        };
        native_burst.extend_from_slice(&frame(&Frame::Requests(RequestBatch {
            epoch: 0,
            requests: vec![b.requests[r as usize].clone()],
        })));
    }
    let mut conns = Vec::new();
    for i in 0..RESP_CONNECTIONS + NATIVE_CONNECTIONS {
        let (addr, burst) = if i < RESP_CONNECTIONS {
            (server.resp_addr().expect("resp port"), &get[..])
        } else {
            (server.addr(), &native_burst[..])
        };
        let mut s = connect(addr);
        s.set_write_timeout(Some(Duration::from_millis(200)))
            .expect("write timeout");
        let _ = s.write_all(burst);
        conns.push(s);
    }
    conns
}

/// The highest RSS seen until it stops rising (bounded by `WATCH_MAX`).
fn watch_peak_rss(pid: u32) -> u64 {
    let start = Instant::now();
    let mut peak = vm_rss_bytes(pid);
    let mut last_rise = Instant::now();
    while last_rise.elapsed() < SETTLED_AFTER && start.elapsed() < WATCH_MAX {
        std::thread::sleep(Duration::from_millis(20));
        let rss = vm_rss_bytes(pid);
        if rss > peak {
            peak = rss;
            last_rise = Instant::now();
        }
    }
    peak
}

#[test]
fn slow_readers_cannot_take_the_server_past_its_memory_caps() {
    let bin = binary();
    let custom = std::env::var_os("CAMELOT_SLOW_READERS_BIN").is_some();
    let mut args = vec![
        "--memory".to_string(),
        MEMORY_BYTES.to_string(),
        "--threads".into(),
        "2".into(),
    ];
    if !custom {
        args.extend([
            "--connection-memory".into(),
            CONNECTION_MEMORY_BYTES.to_string(),
        ]);
    }
    let server = CamelotServer::start(&bin, &CamelotServerOptions { resp: true, args })
        .expect("start camelot server");
    let pid = server.process().pid();
    let region = load(&server);
    let idle_rss = vm_rss_bytes(pid);

    let conns = open_slow_readers(&server, region);
    let peak = watch_peak_rss(pid);
    let bound = MEMORY_BYTES + CONNECTION_MEMORY_BYTES + RSS_OVERHEAD_BYTES_MAX;
    eprintln!(
        "slow readers: {} connections, server RSS {} MiB before, peak {} MiB, bound {} MiB",
        conns.len(),
        idle_rss / MIB,
        peak / MIB,
        bound / MIB
    );
    assert!(
        peak <= bound,
        "server RSS reached {} MiB with {} slow readers; the bound is {} MiB",
        peak / MIB,
        conns.len(),
        bound / MIB
    );

    // Still serving: once the slow readers leave, a new client gets the value.
    drop(conns);
    let mut r = connect(server.resp_addr().expect("resp port"));
    r.write_all(&resp(&[b"STRLEN", b"big"])).expect("STRLEN");
    let want = format!(":{VALUE_BYTES}\r\n");
    let mut got = vec![0u8; want.len()];
    r.read_exact(&mut got).expect("STRLEN reply");
    assert_eq!(String::from_utf8_lossy(&got), want);
}

/// The proxy's region: one READ of it is the largest a request may ask for.
const PROXY_READ_BYTES: usize = camelot_proto::limits::IO_BYTES_MAX;
/// The proxy's `--connection-memory` (its default).
const PROXY_CONNECTION_MEMORY_BYTES: u64 = 256 * MIB;
/// What the proxy may hold beyond that budget: code, the runtime, the allocator's slack,
/// and per connection the answer being encoded while its replies are still held (one
/// frame's worth for the moment between the two) and its upstream connection's buffers.
const PROXY_RSS_OVERHEAD_BYTES_MAX: u64 = 160 * MIB;
const PROXY_SLOW_READERS: usize = 6;
/// The proxy's `--client-timeout`: a slow reader that takes no answer this long is closed.
const PROXY_CLIENT_TIMEOUT_S: u64 = 6;
/// Frames of one READ each; 6 × 16 × 32 MiB asks the proxy for 3 GiB of answers.
const PROXY_FRAMES_PER_READER: usize = 16;

fn proxy(upstream: SocketAddr, bin: &std::path::Path, custom: bool) -> ServerProcess {
    let bin = bin.to_path_buf();
    ServerProcess::start(
        Program {
            program: bin.to_string_lossy().into_owned().into(),
            package: "camelot".into(),
        },
        "camelot-proxy",
        Readiness::Accepting,
        move |port| {
            let mut args: Vec<OsString> = vec![
                "proxy".into(),
                "run".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}").into(),
                "--upstream".into(),
                upstream.to_string().into(),
            ];
            if !custom {
                args.push("--connection-memory".into());
                args.push(PROXY_CONNECTION_MEMORY_BYTES.to_string().into());
                args.push("--client-timeout".into());
                args.push(PROXY_CLIENT_TIMEOUT_S.to_string().into());
            }
            args
        },
    )
    .expect("start camelot proxy")
}

/// A memory server holding one shared region of `PROXY_READ_BYTES`, and a proxy in front
/// of it (both of the binary under test); returns the server, the region and the proxy.
fn proxied_region() -> (CamelotServer, u64, ServerProcess) {
    let bin = binary();
    let custom = std::env::var_os("CAMELOT_SLOW_READERS_BIN").is_some();
    let server = CamelotServer::start(
        &bin,
        &CamelotServerOptions {
            resp: false,
            args: vec!["--memory".into(), (64 * MIB).to_string()],
        },
    )
    .expect("start camelot server");
    let region = alloc(
        server.addr(),
        PROXY_READ_BYTES as u64,
        camelot_proto::AccessMode::Shared,
    );
    let p = proxy(server.addr(), &bin, custom);
    (server, region, p)
}

/// A READ of the whole proxied region, as request `id`.
fn read_whole(region: u64, id: u64) -> Request {
    Request {
        id,
        op: Op::Read {
            region,
            offset: 0,
            len: PROXY_READ_BYTES as u32,
        },
    }
}

#[test]
fn slow_readers_cannot_take_a_proxy_past_its_connection_memory() {
    let (_server, region, p) = proxied_region();
    let pid = p.pid();
    let idle_rss = vm_rss_bytes(pid);

    let mut burst = hello();
    for id in 0..PROXY_FRAMES_PER_READER as u64 {
        burst.extend_from_slice(&frame(&Frame::Requests(RequestBatch {
            epoch: 0,
            requests: vec![read_whole(region, id)],
        })));
    }
    let conns: Vec<TcpStream> = (0..PROXY_SLOW_READERS)
        .map(|_| {
            let mut s = connect(p.addr());
            s.write_all(&burst).expect("the slow reader's frames");
            s
        })
        .collect();
    let peak = watch_peak_rss(pid);
    let bound = PROXY_CONNECTION_MEMORY_BYTES + PROXY_RSS_OVERHEAD_BYTES_MAX;
    eprintln!(
        "proxy slow readers: {} connections, proxy RSS {} MiB before, peak {} MiB, bound {} MiB",
        conns.len(),
        idle_rss / MIB,
        peak / MIB,
        bound / MIB
    );
    assert!(
        peak <= bound,
        "proxy RSS reached {} MiB with {} slow readers; the bound is {} MiB",
        peak / MIB,
        conns.len(),
        bound / MIB
    );

    // Still serving while they stay connected: a client asking for as much as one of
    // them waits for room (the slow readers are closed once they take no answer for the
    // client timeout), it is not turned away.
    let started = Instant::now();
    let mut c = connect(p.addr());
    c.set_read_timeout(Some(Duration::from_secs(40)))
        .expect("read timeout");
    let mut buf = BytesMut::new();
    c.write_all(&hello()).expect("HELLO");
    assert!(matches!(recv(&mut c, &mut buf), Frame::HelloOk(_)));
    let ask = Frame::Requests(RequestBatch {
        epoch: 0,
        requests: vec![
            read_whole(region, 1),
            // A second 32 MiB reply does not fit the answer: refused without a trip.
            read_whole(region, 2),
            Request {
                id: 3,
                op: Op::Stats,
            },
        ],
    });
    c.write_all(&frame(&ask)).expect("READs and STATS");
    let Frame::Responses(r) = recv(&mut c, &mut buf) else {
        panic!("no answer from the proxy")
    };
    eprintln!(
        "a client beside the slow readers was answered after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    drop(conns);
    match &r.responses[0].result {
        Ok(Reply::Data(d)) => assert_eq!(d.len(), PROXY_READ_BYTES),
        other => panic!("READ through the proxy: {other:?}"),
    }
    match &r.responses[1].result {
        Err(e) => assert_eq!(e.code, camelot_proto::ErrorCode::TooLarge, "{e:?}"),
        other => panic!("second READ: {other:?}"),
    }
    let Ok(Reply::Stats(stats)) = &r.responses[2].result else {
        panic!("STATS: {:?}", r.responses[2].result)
    };
    let stat = |name: &str| {
        stats
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(|| panic!("no stat {name}"), |(_, v)| *v)
    };
    assert!(
        stat("proxy_closed_stalled") + stat("proxy_refused_over_memory") >= 1,
        "{stats:?}"
    );
    assert_eq!(stat("proxy_refused_too_large"), 1, "{stats:?}");
}

/// An ALLOC of a gibibyte is answered without writing its bytes: the server's resident
/// memory grows as the region is written, not at the ALLOC (on the code before, the
/// worker thread wrote every zero — 1 GiB resident at once, and a third of a second per
/// GiB in which that thread's other connections waited).
#[test]
fn a_large_alloc_takes_memory_as_it_is_written() {
    const REGION_BYTES: u64 = 1 << 30;
    let server = CamelotServer::start(
        &binary(),
        &CamelotServerOptions {
            resp: false,
            args: vec!["--memory".into(), (2 * REGION_BYTES).to_string()],
        },
    )
    .expect("start camelot server");
    let pid = server.process().pid();
    let region = alloc(
        server.addr(),
        REGION_BYTES,
        camelot_proto::AccessMode::Shared,
    );
    let rss = vm_rss_bytes(pid);
    eprintln!("after a 1 GiB ALLOC the server holds {} MiB", rss / MIB);
    assert!(
        rss < 256 * MIB,
        "the ALLOC made the server resident at {} MiB",
        rss / MIB
    );
    // The region reads as zeros, and its last bytes can be written.
    let mut c = connect(server.addr());
    let mut buf = BytesMut::new();
    c.write_all(&hello()).expect("HELLO");
    assert!(matches!(recv(&mut c, &mut buf), Frame::HelloOk(_)));
    let ops = Frame::Requests(RequestBatch {
        epoch: 0,
        requests: vec![
            Request {
                id: 1,
                op: Op::Write {
                    region,
                    offset: REGION_BYTES - 8,
                    data: Bytes::from_static(b"lastword"),
                },
            },
            Request {
                id: 2,
                op: Op::Read {
                    region,
                    offset: REGION_BYTES - 16,
                    len: 16,
                },
            },
        ],
    });
    c.write_all(&frame(&ops)).expect("WRITE and READ");
    let Frame::Responses(r) = recv(&mut c, &mut buf) else {
        panic!("no answer")
    };
    assert!(r.responses[0].result.is_ok(), "{:?}", r.responses[0].result);
    match &r.responses[1].result {
        Ok(Reply::Data(d)) => assert_eq!(&d[..], b"\0\0\0\0\0\0\0\0lastword"),
        other => panic!("READ: {other:?}"),
    }
}

/// Clients that each read one 32 MiB answer through a pass-through proxy (a lane of its
/// own per client) and then sit idle: what the proxy holds afterwards is not those
/// answers (their upstream and client-side buffers let go once the frame is done).
#[test]
fn idle_clients_after_big_reads_leave_the_proxy_small() {
    const CLIENTS: usize = 8;
    let (_server, region, p) = proxied_region();
    let read = frame(&Frame::Requests(RequestBatch {
        epoch: 0,
        requests: vec![read_whole(region, 1)],
    }));
    let idle: Vec<TcpStream> = (0..CLIENTS)
        .map(|_| {
            let mut c = connect(p.addr());
            let mut buf = BytesMut::new();
            c.write_all(&hello()).expect("HELLO");
            assert!(matches!(recv(&mut c, &mut buf), Frame::HelloOk(_)));
            c.write_all(&read).expect("READ");
            match recv(&mut c, &mut buf) {
                Frame::Responses(r) => assert!(r.responses[0].result.is_ok()),
                other => panic!("READ through the proxy: {other:?}"),
            }
            c
        })
        .collect();
    let rss = vm_rss_bytes(p.pid());
    eprintln!(
        "{} idle clients after a 32 MiB read each: proxy RSS {} MiB",
        idle.len(),
        rss / MIB
    );
    assert!(
        rss < 96 * MIB,
        "the proxy kept {} MiB for {} idle clients",
        rss / MIB,
        idle.len()
    );
}
