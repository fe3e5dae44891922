//! The real servers tests and benchmarks start, each on free loopback ports with its state
//! in a private directory, ready when `start` returns, killed and reaped on drop.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::process::{free_loopback_addr, os_args, program_version, Program, Readiness};
use crate::{ServerProcess, TestkitError};

pub const REDIS_SERVER: Program = Program::debian("redis-server", "redis-server");
pub const MEMCACHED: Program = Program::debian("memcached", "memcached");
pub const ETCD: Program = Program::debian("etcd", "etcd-server");
pub const IPERF3: Program = Program::debian("iperf3", "iperf3");

/// How long etcd may take from accepting connections to answering `/health` as healthy
/// (a single member elects itself; a loaded machine makes that slow).
const ETCD_HEALTHY_DEADLINE: Duration = Duration::from_secs(20);
const HEALTH_PROBE_TIMEOUT: Duration = Duration::from_millis(500);
const HEALTH_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// A health answer is a few hundred bytes; more is not etcd.
const HEALTH_REPLY_BYTES_MAX: u64 = 64 * 1024;
/// Fresh peer ports tried when etcd finds the one it was given taken.
const ETCD_PEER_PORT_ATTEMPTS: u32 = 3;
/// How the OS's "in use" error reads in etcd's output, which the start error quotes.
const ADDRESS_IN_USE: &str = "address already in use";

/// A real `redis-server`: persistence off, working directory private.
#[derive(Debug)]
pub struct RedisServer {
    process: ServerProcess,
}

impl RedisServer {
    pub fn start() -> Result<RedisServer, TestkitError> {
        RedisServer::start_with(&[])
    }

    /// With extra `redis-server` flags after the ones that make it private and
    /// non-persistent (`--io-threads 2`, `--requirepass x`, …).
    pub fn start_with(extra: &[&str]) -> Result<RedisServer, TestkitError> {
        let process = ServerProcess::start(REDIS_SERVER, "redis", Readiness::Accepting, |port| {
            let mut args = os_args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ]);
            args.extend(extra.iter().map(OsString::from));
            args
        })?;
        Ok(RedisServer { process })
    }

    pub fn addr(&self) -> SocketAddr {
        self.process.addr()
    }

    pub fn process(&self) -> &ServerProcess {
        &self.process
    }

    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// `redis-server --version`'s line.
    pub fn version() -> Result<String, TestkitError> {
        program_version(&REDIS_SERVER, &["--version"])
    }
}

/// A real `memcached` (TCP only).
#[derive(Debug)]
pub struct MemcachedServer {
    process: ServerProcess,
}

impl MemcachedServer {
    /// `threads` worker threads and a `memory_mib` cache, so a YCSB load is not evicted.
    pub fn start(threads: u32, memory_mib: u64) -> Result<MemcachedServer, TestkitError> {
        let process = ServerProcess::start(MEMCACHED, "memcached", Readiness::Accepting, |port| {
            os_args([
                "-l",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-U",
                "0",
                "-t",
                &threads.to_string(),
                "-m",
                &memory_mib.to_string(),
                // Items up to 32 MiB, like Camelot's values (memcached's default is 1 MiB).
                "-I",
                "32m",
                // Refuses to run as root otherwise; ignored when we are not root.
                "-u",
                "nobody",
            ])
        })?;
        Ok(MemcachedServer { process })
    }

    pub fn addr(&self) -> SocketAddr {
        self.process.addr()
    }

    pub fn process(&self) -> &ServerProcess {
        &self.process
    }

    /// `memcached -V`'s line.
    pub fn version() -> Result<String, TestkitError> {
        program_version(&MEMCACHED, &["-V"])
    }
}

/// A real single-member `etcd` with its data in a private directory, healthy (it has
/// elected itself and answers `/health`) when `start` returns.
#[derive(Debug)]
pub struct EtcdServer {
    process: ServerProcess,
}

impl EtcdServer {
    pub fn start() -> Result<EtcdServer, TestkitError> {
        // The peer port is picked free and then given up before etcd binds it, so another
        // process may take it meanwhile; the launcher's own retries would reuse it (they
        // pick only the client port), so a peer port that was taken gets a fresh one here.
        let mut last_failure = None;
        for _ in 0..ETCD_PEER_PORT_ATTEMPTS {
            let peer_addr = free_loopback_addr()?;
            match EtcdServer::start_with_peer(peer_addr) {
                Ok(server) => return Ok(server),
                Err(e) if e.to_string().contains(ADDRESS_IN_USE) => last_failure = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_failure
            .unwrap_or_else(|| TestkitError::Setup("etcd's peer port attempts ran out".into())))
    }

    fn start_with_peer(peer_addr: SocketAddr) -> Result<EtcdServer, TestkitError> {
        let data_dir_name = "data";
        let mut process = ServerProcess::start(ETCD, "etcd", Readiness::Accepting, |port| {
            let client_url = format!("http://127.0.0.1:{port}");
            let peer_url = format!("http://{peer_addr}");
            os_args([
                "--name",
                "camelot-test",
                "--data-dir",
                data_dir_name,
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &format!("camelot-test={peer_url}"),
                "--initial-cluster-state",
                "new",
                "--log-level",
                "warn",
            ])
        })?;
        wait_etcd_healthy(&mut process)?;
        Ok(EtcdServer { process })
    }

    /// The client address (`http://` + this is the endpoint).
    pub fn addr(&self) -> SocketAddr {
        self.process.addr()
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.process.addr())
    }

    pub fn process(&self) -> &ServerProcess {
        &self.process
    }

    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// `etcd --version`'s first line.
    pub fn version() -> Result<String, TestkitError> {
        program_version(&ETCD, &["--version"])
    }
}

fn wait_etcd_healthy(process: &mut ServerProcess) -> Result<(), TestkitError> {
    let deadline = Instant::now() + ETCD_HEALTHY_DEADLINE;
    loop {
        if !process.is_running() {
            return Err(TestkitError::Failed {
                program: ETCD.program.to_string(),
                detail: format!("exited before it was healthy: {}", process.output_excerpt()),
            });
        }
        let last = match http_get(process.addr(), "/health") {
            Ok(body) if is_healthy(&body) => return Ok(()),
            Ok(body) => body,
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(TestkitError::Failed {
                program: ETCD.program.to_string(),
                detail: format!(
                    "not healthy within {ETCD_HEALTHY_DEADLINE:?} (last answer: {last}): {}",
                    process.output_excerpt()
                ),
            });
        }
        std::thread::sleep(HEALTH_POLL_INTERVAL);
    }
}

/// etcd answers `{"health":"true","reason":""}` (older releases: without `reason`).
fn is_healthy(http_reply: &str) -> bool {
    http_reply.starts_with("HTTP/1.") && {
        let compact: String = http_reply.chars().filter(|c| !c.is_whitespace()).collect();
        compact.contains("\"health\":\"true\"")
    }
}

/// One HTTP/1.0 GET on loopback, bounded in time and size.
fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, HEALTH_PROBE_TIMEOUT)?;
    stream.set_read_timeout(Some(HEALTH_PROBE_TIMEOUT))?;
    stream.set_write_timeout(Some(HEALTH_PROBE_TIMEOUT))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut reply = Vec::new();
    stream
        .take(HEALTH_REPLY_BYTES_MAX)
        .read_to_end(&mut reply)?;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

/// An `iperf3 -s -1`: serves one test, then exits.
#[derive(Debug)]
pub struct Iperf3Server {
    process: ServerProcess,
}

impl Iperf3Server {
    pub fn start() -> Result<Iperf3Server, TestkitError> {
        // A one-test server (`-1`) would take a connect probe for its test and exit, and a
        // long-lived one briefly stops listening after every test; so readiness is the
        // socket reaching LISTEN, seen without connecting.
        let process = ServerProcess::start(IPERF3, "iperf3", Readiness::Listening, |port| {
            os_args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        })?;
        Ok(Iperf3Server { process })
    }

    pub fn addr(&self) -> SocketAddr {
        self.process.addr()
    }

    pub fn process(&self) -> &ServerProcess {
        &self.process
    }
}

/// A `camelot server` process: the binary is given, since only the caller knows where
/// it is (the `camelot` binary itself, or cargo's `CARGO_BIN_EXE_camelot` in its tests).
#[derive(Debug)]
pub struct CamelotServer {
    process: ServerProcess,
    resp_addr: Option<SocketAddr>,
}

/// What a `camelot server` is started with, beyond the loopback ports it gets.
#[derive(Debug, Clone, Default)]
pub struct CamelotServerOptions {
    /// Also open the Redis-protocol port (`--resp-listen`).
    pub resp: bool,
    /// Further `camelot server` flags (`--resp-threads 1`, `--memory 2G`, …).
    pub args: Vec<String>,
}

impl CamelotServer {
    pub fn start(
        binary: &Path,
        options: &CamelotServerOptions,
    ) -> Result<CamelotServer, TestkitError> {
        if !binary.is_file() {
            return Err(TestkitError::InvalidArgument(format!(
                "no camelot binary at {} (build it with `cargo build --release -p camelot`)",
                binary.display()
            )));
        }
        let program = Program {
            program: binary.to_string_lossy().into_owned().into(),
            package: "camelot (cargo build --release -p camelot)".into(),
        };
        let resp_addr = if options.resp {
            Some(free_loopback_addr()?)
        } else {
            None
        };
        let mut process = ServerProcess::start(program, "camelot", Readiness::Accepting, |port| {
            let mut args = vec![
                OsString::from("server"),
                OsString::from("--listen"),
                OsString::from(format!("127.0.0.1:{port}")),
            ];
            if let Some(resp) = resp_addr {
                args.push("--resp-listen".into());
                args.push(resp.to_string().into());
            }
            args.extend(options.args.iter().map(OsString::from));
            args
        })?;
        if let Some(resp) = resp_addr {
            process.wait_accepting(resp)?;
        }
        Ok(CamelotServer { process, resp_addr })
    }

    /// The native port.
    pub fn addr(&self) -> SocketAddr {
        self.process.addr()
    }

    /// The Redis-protocol port, when it was asked for.
    pub fn resp_addr(&self) -> Option<SocketAddr> {
        self.resp_addr
    }

    pub fn process(&self) -> &ServerProcess {
        &self.process
    }

    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }
}

/// Where the `camelot` binary is when the caller is that binary: the running executable.
pub fn current_camelot_binary() -> Result<PathBuf, TestkitError> {
    std::env::current_exe()
        .map_err(|e| TestkitError::Setup(format!("cannot tell where this program is: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_replies_are_recognised() {
        assert!(is_healthy(
            "HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"health\":\"true\",\"reason\":\"\"}"
        ));
        assert!(is_healthy("HTTP/1.1 200 OK\r\n\r\n{\"health\": \"true\"}"));
        assert!(!is_healthy(
            "HTTP/1.0 503 Service Unavailable\r\n\r\n{\"health\":\"false\",\"reason\":\"RAFT NO LEADER\"}"
        ));
        assert!(!is_healthy("{\"health\":\"true\"}"));
        assert!(!is_healthy(""));
    }
}
