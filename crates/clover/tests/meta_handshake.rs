//! The metadata server's handshake against a peer that trickles its HELLO: the connection
//! must end at the handshake timeout as a whole, not survive on a byte per read timeout.

use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_clover::{Geometry, Meta, MetaConfig, MetaServer, MetaServerConfig, RegionMemory};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(600);
/// How often the peer sends its next byte: well inside the timeout.
const TRICKLE_EVERY: Duration = Duration::from_millis(150);
/// How long the peer trickles before the test calls the connection kept for good.
const TRICKLE_FOR: Duration = Duration::from_secs(4);

/// Trickles a HELLO one byte per `TRICKLE_EVERY`; how long the server kept the
/// connection (`None`: still open after `TRICKLE_FOR`).
fn kept_for(addr: std::net::SocketAddr) -> Option<Duration> {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(TRICKLE_EVERY)).expect("timeout");
    // A 64-byte HELLO announced, then its body a byte at a time.
    let mut bytes = 64u32.to_le_bytes().to_vec();
    bytes.extend(std::iter::repeat_n(0u8, 64));
    let start = Instant::now();
    for b in bytes.iter().cycle() {
        if start.elapsed() > TRICKLE_FOR {
            return None;
        }
        if s.write_all(&[*b]).is_err() {
            return Some(start.elapsed());
        }
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => return Some(start.elapsed()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

#[test]
fn a_trickled_hello_is_cut_off_at_the_handshake_timeout() {
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 16 << 20,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster");
    let client = Client::connect(
        ClusterMap::from_addrs(cluster.addrs()),
        ClientConfig::default(),
    )
    .expect("client");
    let mem = RegionMemory::new(client, Geometry::new(8, 64).expect("geometry"));
    let meta = Arc::new(Meta::new(mem, MetaConfig::default()).expect("meta"));
    let mut config = MetaServerConfig::new(
        vec![cluster.addrs()[0].to_string()],
        Some(b"token".to_vec()),
    );
    config.handshake_timeout = HANDSHAKE_TIMEOUT;
    let server = MetaServer::new(meta, config).expect("server");
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr().expect("addr");
    let stop = Arc::new(AtomicBool::new(false));
    let serving = {
        let stop = stop.clone();
        std::thread::spawn(move || server.serve(listener, stop))
    };
    let kept = kept_for(addr);
    stop.store(true, Ordering::Relaxed);
    // The accept loop looks at `stop` when a connection comes.
    let _ = TcpStream::connect(addr);
    let _ = serving.join();
    match kept {
        Some(d) => assert!(
            d < HANDSHAKE_TIMEOUT + Duration::from_secs(1),
            "the trickling peer was kept {d:?}"
        ),
        None => panic!("a peer trickling its HELLO was kept past {TRICKLE_FOR:?}"),
    }
}
