//! The Redis port's argument limit (`proto-max-bulk-len`) and its counters, over real
//! loopback sockets.

use camelot_server::{ServerConfig, ServerHandle};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Bound on every network wait; far above what loopback needs, even for 40 MB.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

fn start(config: impl FnOnce(&mut ServerConfig)) -> (tokio::runtime::Runtime, ServerHandle) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), 256 << 20);
    cfg.resp_listen = Some("127.0.0.1:0".parse().unwrap());
    config(&mut cfg);
    let server = runtime
        .block_on(async { tokio::time::timeout(IO_TIMEOUT, ServerHandle::start(cfg)).await })
        .expect("start timed out")
        .expect("the server starts");
    (runtime, server)
}

fn connect(server: &ServerHandle) -> TcpStream {
    let s = TcpStream::connect(server.resp_addr().expect("a RESP port")).expect("connects");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    s
}

/// Reads one reply line (a simple string, error or integer).
fn read_line(s: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        match s.read(&mut byte) {
            Ok(0) => break,
            Ok(_) => line.push(byte[0]),
            Err(e) => panic!("read failed after {line:?}: {e}"),
        }
    }
    String::from_utf8_lossy(&line).into_owned()
}

fn set_command(value_len: usize) -> Vec<u8> {
    let mut cmd = format!("*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n${value_len}\r\n").into_bytes();
    cmd.resize(cmd.len() + value_len, b'v');
    cmd.extend_from_slice(b"\r\n");
    cmd
}

fn stop(runtime: tokio::runtime::Runtime, server: ServerHandle) {
    runtime
        .block_on(async { tokio::time::timeout(IO_TIMEOUT, server.shutdown()).await })
        .expect("shutdown timed out")
        .expect("shutdown is clean");
}

#[test]
fn a_value_past_the_old_32_mib_cap_is_answered_not_cut_off() {
    let (runtime, server) = start(|_| {});
    let mut s = connect(&server);
    // The old port closed the connection at the header, so a client still sending
    // (redis-cli -x) died of SIGPIPE with nothing said. Now the whole command is read
    // and answered, and the connection goes on.
    let len = 40 << 20;
    s.write_all(&set_command(len))
        .expect("the whole command is taken");
    assert_eq!(
        read_line(&mut s),
        format!(
            "-ERR value of {len} bytes exceeds the limit of {}\r\n",
            32 << 20
        )
    );
    s.write_all(b"PING\r\n").unwrap();
    assert_eq!(read_line(&mut s), "+PONG\r\n");
    stop(runtime, server);
}

#[test]
fn proto_max_bulk_len_is_a_setting_with_a_floor() {
    let (runtime, server) = start(|c| c.proto_max_bulk_len = 1 << 20);
    let mut s = connect(&server);
    s.write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2000000\r\n")
        .unwrap();
    assert_eq!(
        read_line(&mut s),
        "-ERR Protocol error: invalid bulk length\r\n"
    );
    // Then the connection is closed, as Redis does.
    assert_eq!(read_line(&mut s), "");
    // A value within the limit is fine on a new connection.
    let mut s = connect(&server);
    s.write_all(&set_command(1000)).unwrap();
    assert_eq!(read_line(&mut s), "+OK\r\n");
    stop(runtime, server);

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), 1 << 20);
    cfg.proto_max_bulk_len = 1000;
    let refused = runtime.block_on(ServerHandle::start(cfg));
    assert!(
        refused.is_err(),
        "a 1000-byte proto-max-bulk-len was accepted"
    );
}

#[test]
fn redis_port_traffic_counts_as_ops_served() {
    let (runtime, server) = start(|_| {});
    let mut s = connect(&server);
    for (cmd, reply) in [
        ("SET a 1", "+OK\r\n"),
        ("INCR a", ":2\r\n"),
        ("LPUSH l x", ":1\r\n"),
        ("DEL a", ":1\r\n"),
    ] {
        s.write_all(format!("{cmd}\r\n").as_bytes()).unwrap();
        assert_eq!(read_line(&mut s), reply, "{cmd}");
    }
    let stats = server.stats();
    let get = |k: &str| stats.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    assert_eq!(get("ops_resp_strings"), Some(2));
    assert_eq!(get("ops_resp_lists"), Some(1));
    assert_eq!(get("ops_resp_keys"), Some(1));
    assert_eq!(get("resp_commands"), Some(4));
    stop(runtime, server);
}
