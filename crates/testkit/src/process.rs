//! Starting, watching and stopping programs: the mechanics every launcher shares.
//!
//! Every process started here is owned by a guard that kills and reaps it when dropped,
//! so an error or a panic never leaves a server behind, and every wait has a deadline, so
//! a program that hangs cannot hang a test.

use std::borrow::Cow;
use std::ffi::OsString;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::TestkitError;

/// How long a server may take to accept its first connection.
pub const SERVER_START_DEADLINE: Duration = Duration::from_secs(10);
/// Picking a free port and binding it are two steps; another process can take the port in
/// between, so a server that exits at start is retried on a fresh port.
const SERVER_START_ATTEMPTS: u32 = 3;
const CONNECT_PROBE_TIMEOUT: Duration = Duration::from_millis(200);
/// Between two looks at a condition that has a deadline (a child exiting, a port opening).
const POLL_INTERVAL: Duration = Duration::from_millis(10);
pub const EXCERPT_BYTES_MAX: usize = 2048;
/// The kernel reports process times in USER_HZ ticks, fixed at 100 by its ABI on the
/// architectures Camelot runs on (x86_64, aarch64); reading `sysconf` would need `unsafe`.
const USER_HZ: f64 = 100.0;

/// A program (a name looked up on PATH, or a path) and where to get it, named in the
/// error when it is missing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    pub program: Cow<'static, str>,
    pub package: Cow<'static, str>,
}

impl Program {
    /// A program from a Debian package.
    pub const fn debian(program: &'static str, package: &'static str) -> Program {
        Program {
            program: Cow::Borrowed(program),
            package: Cow::Borrowed(package),
        }
    }
}

/// Whether this process runs as root (effective uid 0, from /proc/self/status): tests of
/// what needs root (network namespaces) check it, and must not skip in CI.
pub fn euid_is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("0")
}

/// Removes terminal colour sequences (`ESC [ ... letter`), which sockperf prints even
/// into a file.
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

pub fn whole_seconds(duration: Duration) -> u64 {
    let secs = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    secs.max(1)
}

pub fn os_args<const N: usize>(args: [&str; N]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// The command as a person would type it, for reports.
pub fn command_line(program: &str, args: &[OsString]) -> String {
    let mut line = program.to_string();
    for arg in args {
        let arg = arg.to_string_lossy();
        line.push(' ');
        if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || c == '"') {
            line.push_str(&format!("{arg:?}"));
        } else {
            line.push_str(&arg);
        }
    }
    line
}

/// A private directory for one peer run: server working directories and the captured
/// output of every process. Removed on drop.
#[derive(Debug)]
pub struct ScratchDir {
    pub path: PathBuf,
}

/// The prefix of every scratch directory's name: `camelot-peer-{tag}-{pid}-{seq}-{nanos}`.
const SCRATCH_PREFIX: &str = "camelot-peer-";

impl ScratchDir {
    pub fn new(tag: &str) -> Result<ScratchDir, TestkitError> {
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        // Once per process: what owners SIGKILLed earlier left behind.
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(|| {
            remove_orphaned_scratch_dirs();
        });
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "{SCRATCH_PREFIX}{tag}-{}-{}-{nanos}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        ));
        // create_dir, not create_dir_all: an existing directory would not be ours.
        std::fs::create_dir(&path).map_err(|source| TestkitError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(ScratchDir { path })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Best effort: a leftover directory in /tmp is not worth failing a run over.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Removes the scratch directories whose owning process has ended without removing
/// them (SIGKILLed, its destructors never ran); returns how many went. A directory whose
/// owner is alive, or whose name is not a scratch directory's, is left alone, and so is
/// everything when `/proc` cannot tell which processes are alive.
pub fn remove_orphaned_scratch_dirs() -> usize {
    if !Path::new("/proc/self").exists() {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        // Not followed: a link is never ours to remove through.
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(scratch_owner) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if std::fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The owner's pid in a scratch directory's name (the tag may itself hold dashes).
fn scratch_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(SCRATCH_PREFIX)?;
    let mut fields = rest.rsplitn(4, '-');
    let (nanos, seq, pid, tag) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    if tag.is_empty() || nanos.parse::<u128>().is_err() || seq.parse::<u64>().is_err() {
        return None;
    }
    pid.parse().ok()
}

/// Owns a child process: dropping it kills and reaps the child.
#[derive(Debug)]
pub struct ChildGuard {
    pub child: Child,
    pub stdout_path: PathBuf,
    pub stderr_path: PathBuf,
}

impl ChildGuard {
    pub fn output_excerpt(&self) -> String {
        output_excerpt(
            &read_lossy(&self.stdout_path),
            &read_lossy(&self.stderr_path),
        )
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // kill fails only when the child has already exited; wait then just reaps it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `peer` with its output going to files in `scratch` (a pipe nobody drains could
/// fill up and stall a long-running server).
pub fn spawn(
    peer: &Program,
    args: &[OsString],
    scratch: &ScratchDir,
    name: &str,
) -> Result<ChildGuard, TestkitError> {
    let stdout_path = scratch.path.join(format!("{name}.stdout"));
    let stderr_path = scratch.path.join(format!("{name}.stderr"));
    let create = |path: &Path| {
        File::create(path).map_err(|source| TestkitError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    let stdout = create(&stdout_path)?;
    let stderr = create(&stderr_path)?;
    let mut command = Command::new(peer.program.as_ref());
    command
        .args(args)
        .current_dir(&scratch.path)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr);
    crate::lifeline::apply(&mut command);
    let child = command.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => TestkitError::Missing {
            program: peer.program.to_string(),
            package: peer.package.to_string(),
        },
        _ => TestkitError::Failed {
            program: peer.program.to_string(),
            detail: format!("cannot start it: {e}"),
        },
    })?;
    Ok(ChildGuard {
        child,
        stdout_path,
        stderr_path,
    })
}

/// What a finished client left behind.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub command: String,
}

impl Finished {
    pub fn failure(&self, peer: &Program, what: &str) -> TestkitError {
        TestkitError::Failed {
            program: peer.program.to_string(),
            detail: format!(
                "{what} ({}, `{}`): {}",
                self.status,
                self.command,
                output_excerpt(&self.stdout, &self.stderr)
            ),
        }
    }
}

/// Runs a client to completion, killing it once it has run for `time_limit`.
pub fn run_to_end(
    peer: &Program,
    args: &[OsString],
    scratch: &ScratchDir,
    name: &str,
    time_limit: Duration,
) -> Result<Finished, TestkitError> {
    let mut guard = spawn(peer, args, scratch, name)?;
    let deadline = Instant::now() + time_limit;
    let status = loop {
        match guard.child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                return Err(TestkitError::TimedOut {
                    program: peer.program.to_string(),
                    detail: format!(
                        "still running after {time_limit:?}, killed: {}",
                        guard.output_excerpt()
                    ),
                });
            }
            Ok(None) => std::thread::sleep(POLL_INTERVAL),
            Err(e) => {
                return Err(TestkitError::Failed {
                    program: peer.program.to_string(),
                    detail: format!("cannot wait for it: {e}"),
                })
            }
        }
    };
    Ok(Finished {
        status,
        stdout: read_lossy(&guard.stdout_path),
        stderr: read_lossy(&guard.stderr_path),
        command: command_line(&peer.program, args),
    })
}

/// How to tell that a server is ready for its client.
#[derive(Clone, Copy, Debug)]
pub enum Readiness {
    /// A TCP connection succeeds (and is closed at once).
    Accepting,
    /// Its socket is in LISTEN state in /proc/net/tcp: for servers that must not see a
    /// connection other than the measured one.
    Listening,
}

pub enum StartFailure {
    Exited(ExitStatus),
    Silent,
    Wait(std::io::Error),
}

/// Starts a server on a free loopback port and waits until it accepts connections.
pub fn start_server(
    peer: &Program,
    scratch: &ScratchDir,
    readiness: Readiness,
    args_for_port: impl Fn(u16) -> Vec<OsString>,
) -> Result<(ChildGuard, SocketAddr, String), TestkitError> {
    let mut last_failure = String::new();
    for attempt in 1..=SERVER_START_ATTEMPTS {
        let addr = free_loopback_addr()?;
        let args = args_for_port(addr.port());
        let mut server = spawn(peer, &args, scratch, &format!("server-{attempt}"))?;
        match wait_ready(&mut server.child, addr, readiness, SERVER_START_DEADLINE) {
            Ok(()) => return Ok((server, addr, command_line(&peer.program, &args))),
            Err(StartFailure::Exited(status)) => {
                last_failure = format!(
                    "`{}` exited ({status}) before accepting connections: {}",
                    command_line(&peer.program, &args),
                    server.output_excerpt()
                );
            }
            Err(StartFailure::Silent) => {
                return Err(TestkitError::Failed {
                    program: peer.program.to_string(),
                    detail: format!(
                        "`{}` was not ready on {addr} within {:?}: {}",
                        command_line(&peer.program, &args),
                        SERVER_START_DEADLINE,
                        server.output_excerpt()
                    ),
                })
            }
            Err(StartFailure::Wait(e)) => {
                return Err(TestkitError::Failed {
                    program: peer.program.to_string(),
                    detail: format!("cannot wait for the server: {e}"),
                })
            }
        }
    }
    Err(TestkitError::Failed {
        program: peer.program.to_string(),
        detail: format!("the server failed {SERVER_START_ATTEMPTS} times; last: {last_failure}"),
    })
}

pub fn wait_ready(
    child: &mut Child,
    addr: SocketAddr,
    readiness: Readiness,
    deadline_after: Duration,
) -> Result<(), StartFailure> {
    let deadline = Instant::now() + deadline_after;
    loop {
        if let Some(status) = child.try_wait().map_err(StartFailure::Wait)? {
            return Err(StartFailure::Exited(status));
        }
        let ready = match readiness {
            Readiness::Accepting => {
                TcpStream::connect_timeout(&addr, CONNECT_PROBE_TIMEOUT).is_ok()
            }
            Readiness::Listening => std::fs::read_to_string("/proc/net/tcp")
                .map(|table| is_listening(&table, addr))
                .unwrap_or(false),
        };
        if ready {
            // Whoever answered, it must be our server: had it lost the port to another
            // process it would have exited by now or will shortly, so look once more.
            return match child.try_wait().map_err(StartFailure::Wait)? {
                Some(status) => Err(StartFailure::Exited(status)),
                None => Ok(()),
            };
        }
        if Instant::now() >= deadline {
            return Err(StartFailure::Silent);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Whether /proc/net/tcp shows an IPv4 socket listening on `addr`. Its rows read
/// `sl local_address rem_address st ...` with `local_address` as `%08X:%04X` of the address
/// in memory order and the port, and `st` 0A for LISTEN.
pub fn is_listening(proc_net_tcp: &str, addr: SocketAddr) -> bool {
    const TCP_LISTEN: &str = "0A";
    let SocketAddr::V4(addr) = addr else {
        return false;
    };
    let octets = addr.ip().octets();
    // The kernel prints the address's in-memory bytes as a host-order integer.
    let ip_hex = [
        format!("{:08X}", u32::from_le_bytes(octets)),
        format!("{:08X}", u32::from_be_bytes(octets)),
    ];
    let port_hex = format!("{:04X}", addr.port());
    proc_net_tcp.lines().skip(1).any(|row| {
        let mut columns = row.split_whitespace().skip(1);
        let (Some(local), Some(_remote), Some(state)) =
            (columns.next(), columns.next(), columns.next())
        else {
            return false;
        };
        let Some((ip, port)) = local.split_once(':') else {
            return false;
        };
        state == TCP_LISTEN && port == port_hex && ip_hex.iter().any(|h| h == ip)
    })
}

/// A loopback port that was free a moment ago: the kernel picks it for an ephemeral bind.
pub fn free_loopback_addr() -> Result<SocketAddr, TestkitError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| TestkitError::Setup(format!("cannot bind a loopback port: {e}")))?;
    listener
        .local_addr()
        .map_err(|e| TestkitError::Setup(format!("cannot read a loopback port: {e}")))
}

pub fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Stderr and stdout of a failed program, bounded to about EXCERPT_BYTES_MAX in all.
pub fn output_excerpt(stdout: &str, stderr: &str) -> String {
    let half = EXCERPT_BYTES_MAX / 2;
    let parts: Vec<String> = [("stderr", stderr), ("stdout", stdout)]
        .into_iter()
        .map(|(name, text)| (name, strip_ansi_all(text)))
        .filter(|(_, text)| !text.trim().is_empty())
        .map(|(name, text)| format!("{name}: {}", tail(text.trim(), half)))
        .collect();
    if parts.is_empty() {
        "no output".to_string()
    } else {
        parts.join(" | ")
    }
}

pub fn strip_ansi_all(text: &str) -> String {
    text.lines().map(strip_ansi).collect::<Vec<_>>().join("\n")
}

/// The last `bytes_max` bytes of `text` (the end of a log says why a program gave up).
pub fn tail(text: &str, bytes_max: usize) -> String {
    if text.len() <= bytes_max {
        return text.to_string();
    }
    let mut start = text.len() - bytes_max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// CPU seconds (user + system, every thread) a live process has used so far, from
/// `/proc/PID/stat`. Taken before and after a run, the difference is what the run cost
/// the server: the figure a reader can trust on a shared machine, where wall-clock
/// throughput also measures the neighbours.
pub fn cpu_seconds(pid: u32) -> Result<f64, TestkitError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    let text = std::fs::read_to_string(&path).map_err(|source| TestkitError::Io {
        path: path.clone(),
        source,
    })?;
    parse_stat_cpu_ticks(&text)
        .map(|ticks| ticks as f64 / USER_HZ)
        .ok_or_else(|| {
            TestkitError::Setup(format!("cannot read CPU times from {}", path.display()))
        })
}

/// utime + stime (fields 14 and 15) of a `/proc/PID/stat` line. The command name (field
/// 2) is in parentheses and may itself hold spaces and parentheses, so fields are counted
/// from the last `)`.
pub fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // After the name: state is field 3, so utime (14) is the 12th word and stime the 13th.
    let mut words = after_name.split_whitespace().skip(11);
    let utime: u64 = words.next()?.parse().ok()?;
    let stime: u64 = words.next()?.parse().ok()?;
    utime.checked_add(stime)
}

/// The first line a program prints of its version (`redis-server --version`,
/// `memcached -V`), for the record of what a comparison ran against.
pub fn program_version(peer: &Program, args: &[&str]) -> Result<String, TestkitError> {
    let scratch = ScratchDir::new("version")?;
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    let run = run_to_end(peer, &args, &scratch, "version", VERSION_TIME_LIMIT)?;
    if !run.status.success() {
        return Err(run.failure(peer, "could not tell its version"));
    }
    let text = if run.stdout.trim().is_empty() {
        &run.stderr
    } else {
        &run.stdout
    };
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

const VERSION_TIME_LIMIT: Duration = Duration::from_secs(10);

/// A server program running on a loopback port, owned: dropping it kills and reaps it and
/// then removes its private directory.
#[derive(Debug)]
pub struct ServerProcess {
    // Declared before the scratch directory: the server must be gone before its
    // directory is removed.
    guard: ChildGuard,
    addr: SocketAddr,
    program: Program,
    command: String,
    scratch: ScratchDir,
}

impl ServerProcess {
    /// Starts `program` on a free loopback port (`args_for_port` builds its arguments
    /// for the port picked) and waits until it is `readiness`-ready.
    pub fn start(
        program: Program,
        tag: &str,
        readiness: Readiness,
        args_for_port: impl Fn(u16) -> Vec<OsString>,
    ) -> Result<ServerProcess, TestkitError> {
        let scratch = ScratchDir::new(tag)?;
        let (guard, addr, command) = start_server(&program, &scratch, readiness, args_for_port)?;
        Ok(ServerProcess {
            guard,
            addr,
            program,
            command,
            scratch,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn pid(&self) -> u32 {
        self.guard.child.id()
    }

    /// The command line it was started with, as a person would type it.
    pub fn command(&self) -> &str {
        &self.command
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Its private working directory.
    pub fn dir(&self) -> &Path {
        &self.scratch.path
    }

    /// CPU seconds it has used so far (see [`cpu_seconds`]).
    pub fn cpu_seconds(&self) -> Result<f64, TestkitError> {
        cpu_seconds(self.pid())
    }

    /// Whether it is still running (it has not exited or been killed).
    pub fn is_running(&mut self) -> bool {
        matches!(self.guard.child.try_wait(), Ok(None))
    }

    /// SIGKILL now, and reap it: for tests that must see a crash, not a graceful stop.
    pub fn kill(&mut self) -> Result<(), TestkitError> {
        let program = self.program.program.to_string();
        match self.guard.child.kill() {
            Ok(()) => {}
            // Already exited: reaping it below is all that is left to do.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {}
            Err(e) => {
                return Err(TestkitError::Failed {
                    program,
                    detail: format!("cannot kill it: {e}"),
                })
            }
        }
        self.guard
            .child
            .wait()
            .map(|_| ())
            .map_err(|e| TestkitError::Failed {
                program,
                detail: format!("cannot reap it: {e}"),
            })
    }

    /// What it printed so far, bounded (for error messages).
    pub fn output_excerpt(&self) -> String {
        self.guard.output_excerpt()
    }

    /// Waits until `addr` (a second port of the same server) accepts connections, failing
    /// early if the server exits.
    pub fn wait_accepting(&mut self, addr: SocketAddr) -> Result<(), TestkitError> {
        match wait_ready(
            &mut self.guard.child,
            addr,
            Readiness::Accepting,
            SERVER_START_DEADLINE,
        ) {
            Ok(()) => Ok(()),
            Err(StartFailure::Exited(status)) => Err(TestkitError::Failed {
                program: self.program.program.to_string(),
                detail: format!("exited ({status}): {}", self.output_excerpt()),
            }),
            Err(StartFailure::Silent) => Err(TestkitError::Failed {
                program: self.program.program.to_string(),
                detail: format!(
                    "not accepting on {addr} within {SERVER_START_DEADLINE:?}: {}",
                    self.output_excerpt()
                ),
            }),
            Err(StartFailure::Wait(e)) => Err(TestkitError::Failed {
                program: self.program.program.to_string(),
                detail: format!("cannot wait for it: {e}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_scratch_dirs_owner_is_read_back_from_its_name(
            tag in "[a-z0-9-]{1,20}",
            pid in any::<u32>(),
            seq in any::<u64>(),
            nanos in any::<u128>(),
        ) {
            let name = format!("{SCRATCH_PREFIX}{tag}-{pid}-{seq}-{nanos}");
            prop_assert_eq!(scratch_owner(&name), Some(pid));
        }
    }

    #[test]
    fn names_not_of_scratch_dirs_have_no_owner() {
        for name in [
            "camelot-peer-",
            "camelot-peer-12-3-4",
            "camelot-peer-tag-x-3-4",
            "camelot-peer-tag-12-3-y",
            "other-tag-12-3-4",
        ] {
            assert_eq!(scratch_owner(name), None, "{name}");
        }
    }

    #[test]
    fn only_scratch_dirs_of_ended_owners_are_removed() {
        let mut child = Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let tmp = std::env::temp_dir();
        let orphan = tmp.join(format!("{SCRATCH_PREFIX}sweep-test-{dead}-0-1"));
        let ours = tmp.join(format!(
            "{SCRATCH_PREFIX}sweep-test-{}-0-1",
            std::process::id()
        ));
        for d in [&orphan, &ours] {
            std::fs::create_dir_all(d.join("data")).unwrap();
        }
        // The pid of `true` could be taken again meanwhile; then nothing is removed,
        // which is the safe side, and the assertion below says so.
        assert!(
            !Path::new(&format!("/proc/{dead}")).exists(),
            "pid {dead} reused"
        );
        remove_orphaned_scratch_dirs();
        let (orphan_left, ours_left) = (orphan.exists(), ours.exists());
        let _ = std::fs::remove_dir_all(&ours);
        assert!(!orphan_left, "{orphan:?} left");
        assert!(ours_left, "a live owner's directory was removed");
    }

    #[test]
    fn listening_sockets_are_found_in_proc_net_tcp() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:5BA5 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 18947 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 1058 1 0 100 0 0 10 0
";
        let addr = |port| SocketAddr::from(([127, 0, 0, 1], port));
        assert!(is_listening(table, addr(0x5BA5)));
        // Established, not listening.
        assert!(!is_listening(table, addr(0x1F90)));
        assert!(!is_listening(table, addr(0x5BA6)));
        assert!(!is_listening(
            table,
            SocketAddr::from(([10, 0, 0, 1], 0x5BA5))
        ));
        assert!(!is_listening("", addr(1)));
    }

    #[test]
    fn a_real_listener_is_seen() -> Result<(), std::io::Error> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let table = std::fs::read_to_string("/proc/net/tcp")?;
        assert!(is_listening(&table, addr));
        drop(listener);
        Ok(())
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(whole_seconds(Duration::ZERO), 1);
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_millis(2001)), 3);
    }

    #[test]
    fn command_lines_quote_empty_arguments() {
        let args = os_args(["--save", "", "--dir", "/tmp/a b"]);
        assert_eq!(
            command_line("redis-server", &args),
            r#"redis-server --save "" --dir "/tmp/a b""#
        );
    }

    #[test]
    fn excerpts_are_bounded() {
        let long = "x".repeat(10_000) + "é the end";
        let excerpt = output_excerpt(&long, &long);
        assert!(excerpt.len() <= EXCERPT_BYTES_MAX + 64, "{}", excerpt.len());
        assert!(excerpt.ends_with("the end"));
        assert_eq!(output_excerpt("", " \n"), "no output");
        assert_eq!(tail("ééé", 3), "…é");
    }

    #[test]
    fn missing_program_is_named_with_its_package() -> Result<(), TestkitError> {
        let scratch = ScratchDir::new("missing")?;
        let peer = Program::debian("camelot-no-such-program", "camelot-no-such-package");
        let result = run_to_end(&peer, &[], &scratch, "c", Duration::from_secs(5));
        let err = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("apt install camelot-no-such-package"), "{err}");
        assert!(err.contains("scripts/setup.sh"), "{err}");
        Ok(())
    }

    #[test]
    fn clients_past_their_time_limit_are_killed() -> Result<(), TestkitError> {
        let scratch = ScratchDir::new("slow")?;
        // Stands in for a peer that hangs: `tail -f` never exits on its own.
        let hanging = Program::debian("tail", "coreutils");
        let started = Instant::now();
        let result = run_to_end(
            &hanging,
            &os_args(["-f", "/dev/null"]),
            &scratch,
            "t",
            Duration::from_millis(200),
        );
        assert!(
            matches!(&result, Err(TestkitError::TimedOut { detail, .. }) if detail.contains("killed")),
            "{:?}",
            result.err()
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        Ok(())
    }

    #[test]
    fn stat_lines_give_user_plus_system_ticks() {
        // A real /proc/self/stat line, its name holding a space and a parenthesis.
        let line = "4242 (a b) c) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 75 0 0 20 0 3 0 \
                    9999 12345678 900 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(parse_stat_cpu_ticks(line), Some(325));
        assert_eq!(parse_stat_cpu_ticks("4242 (x) S 1 2"), None);
        assert_eq!(parse_stat_cpu_ticks(""), None);
    }

    #[test]
    fn this_process_uses_cpu_time_that_grows() -> Result<(), TestkitError> {
        let before = cpu_seconds(std::process::id())?;
        // Burn about 50 ms of CPU: at 10 ms ticks the counter must move.
        let started = Instant::now();
        let mut x = 0u64;
        while started.elapsed() < Duration::from_millis(60) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let after = cpu_seconds(std::process::id())?;
        assert!(after > before, "{before} -> {after}");
        assert!(cpu_seconds(u32::MAX).is_err());
        Ok(())
    }

    proptest! {
        #[test]
        fn stat_parser_never_panics(text in ".{0,120}") {
            let _ = parse_stat_cpu_ticks(&text);
        }
    }
}
