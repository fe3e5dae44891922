//! Each launcher against the real program: it starts, serves, costs CPU we can read, and
//! is gone after a SIGKILL or a drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use camelot_testkit::{EtcdServer, MemcachedServer, RedisServer, TestkitError};

const IO_TIMEOUT: Duration = Duration::from_secs(5);

fn connect(addr: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(stream)
}

fn line(reader: &mut impl BufRead) -> std::io::Result<String> {
    let mut text = String::new();
    reader.read_line(&mut text)?;
    Ok(text)
}

#[test]
fn redis_serves_reports_cpu_and_dies_on_sigkill() -> Result<(), Box<dyn std::error::Error>> {
    let mut redis = RedisServer::start()?;
    let addr = redis.addr();
    assert!(addr.ip().is_loopback());
    let mut conn = connect(addr)?;
    conn.write_all(b"SET k v\r\nGET k\r\n")?;
    let mut reader = BufReader::new(conn.try_clone()?);
    assert_eq!(line(&mut reader)?, "+OK\r\n");
    assert_eq!(line(&mut reader)?, "$1\r\n");
    assert_eq!(line(&mut reader)?, "v\r\n");
    assert!(redis.process().cpu_seconds()? >= 0.0);
    assert!(RedisServer::version()?.contains("Redis server"));

    redis.process_mut().kill()?;
    assert!(!redis.process_mut().is_running());
    let mut after = [0u8; 1];
    // The socket of a killed server reads as closed (0 bytes) or reset.
    assert!(!matches!(conn.read(&mut after), Ok(n) if n > 0));
    Ok(())
}

#[test]
fn memcached_serves() -> Result<(), Box<dyn std::error::Error>> {
    let memcached = MemcachedServer::start(1, 64)?;
    let mut conn = connect(memcached.addr())?;
    conn.write_all(b"set k 0 0 1\r\nv\r\nget k\r\n")?;
    let mut reader = BufReader::new(conn);
    assert_eq!(line(&mut reader)?, "STORED\r\n");
    assert_eq!(line(&mut reader)?, "VALUE k 0 1\r\n");
    assert!(MemcachedServer::version()?.starts_with("memcached"));
    Ok(())
}

#[test]
fn etcd_is_healthy_and_stores_a_key() -> Result<(), Box<dyn std::error::Error>> {
    let etcd = EtcdServer::start()?;
    // etcd's JSON gateway: base64("k") = "aw==", base64("v") = "dg==".
    let body = r#"{"key":"aw==","value":"dg=="}"#;
    let mut conn = connect(etcd.addr())?;
    write!(
        conn,
        "POST /v3/kv/put HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut reply = String::new();
    conn.take(64 * 1024).read_to_string(&mut reply)?;
    assert!(reply.starts_with("HTTP/1.0 200"), "{reply}");
    let body = r#"{"key":"aw=="}"#;
    let mut conn = connect(etcd.addr())?;
    write!(
        conn,
        "POST /v3/kv/range HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut reply = String::new();
    conn.take(64 * 1024).read_to_string(&mut reply)?;
    assert!(reply.contains("\"value\":\"dg==\""), "{reply}");
    assert!(EtcdServer::version()?.to_lowercase().contains("etcd"));
    Ok(())
}

#[test]
fn a_dropped_server_is_gone() -> Result<(), TestkitError> {
    let redis = RedisServer::start()?;
    let addr = redis.addr();
    let dir = redis.process().dir().to_path_buf();
    drop(redis);
    assert!(TcpStream::connect_timeout(&addr, IO_TIMEOUT).is_err());
    assert!(!dir.exists());
    Ok(())
}
