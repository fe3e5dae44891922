//! Running a plan: `ip`/`tc` invocations, the run's state on disk, processes in the
//! namespaces, faults, and a `down` that works from whatever a crash left.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};
use serde::{Deserialize, Serialize};

use crate::plan::{run_ns_prefix, Cmd, LinkSpec, Plan, NS_PREFIX};
use crate::TestbedError;

/// Where runs keep their state unless told otherwise: tmpfs, so a reboot (which also
/// drops every namespace) drops the state with it.
pub const DEFAULT_RUN_DIR: &str = "/run/camelot-testbed";
const STATE_FILE: &str = "state.json";
/// How long `down` waits for SIGKILLed processes to leave a namespace.
const KILL_DEADLINE: Duration = Duration::from_secs(5);
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// A state file larger than this is not ours.
const STATE_BYTES_MAX: u64 = 1 << 20;
/// The hidden subcommand of the running program that is a relay (see `relay`), and the
/// line it prints once its sockets are bound.
pub const RELAY_SUBCOMMAND: &str = "testbed-relay";
pub const RELAY_READY: &str = "relaying";
/// How long `up` waits for a relay to bind its sockets.
const RELAY_START: Duration = Duration::from_secs(10);

/// Fails with a message saying what is missing unless we run as root.
pub fn require_root() -> Result<(), TestbedError> {
    let euid = rustix::process::geteuid();
    if euid.is_root() {
        Ok(())
    } else {
        Err(TestbedError::NotRoot {
            euid: euid.as_raw(),
        })
    }
}

/// What is on disk while a run is up. Written before the first namespace is created,
/// so a `down` after a crash of `up` knows everything `up` may have made.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct State {
    plan: Plan,
    up_pid: u32,
}

fn run_dir(base: &Path, run: &str) -> PathBuf {
    base.join(run)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TestbedError + '_ {
    move |source| TestbedError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Runs one command to its end; its stderr becomes the error.
pub fn run_cmd(cmd: &Cmd) -> Result<String, TestbedError> {
    let missing = |e: std::io::Error| TestbedError::MissingTool {
        program: cmd.program.to_string(),
        detail: e.to_string(),
    };
    let out = match &cmd.stdin {
        None => Command::new(cmd.program)
            .args(&cmd.args)
            .output()
            .map_err(missing)?,
        Some(lines) => {
            let mut child = Command::new(cmd.program)
                .args(&cmd.args)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(missing)?;
            // A batch is a few KiB, well under a pipe's buffer: writing it all before
            // reading any output cannot deadlock.
            if let Some(mut stdin) = child.stdin.take() {
                use std::io::Write;
                stdin.write_all(lines.as_bytes()).map_err(missing)?;
            }
            child.wait_with_output().map_err(missing)?
        }
    };
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(TestbedError::Command {
            command: cmd.line(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn ip(args: &[&str]) -> Cmd {
    Cmd {
        program: "ip",
        args: args.iter().map(|s| s.to_string()).collect(),
        stdin: None,
    }
}

/// Our namespaces that exist now (`ip netns list`), of one run or of all runs.
pub fn existing_namespaces(run: Option<&str>) -> Result<Vec<String>, TestbedError> {
    let prefix = match run {
        Some(r) => run_ns_prefix(r),
        None => format!("{NS_PREFIX}-"),
    };
    let out = run_cmd(&ip(&["netns", "list"]))?;
    Ok(parse_netns_list(&out)
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect())
}

/// `ip netns list` prints `name` or `name (id: N)` a line.
fn parse_netns_list(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// The pids whose network namespace is `ns` (none if it does not exist).
pub fn namespace_pids(ns: &str) -> Vec<i32> {
    match run_cmd(&ip(&["netns", "pids", ns])) {
        Ok(out) => out
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn signal(pid: i32, sig: Signal) -> Result<(), TestbedError> {
    let Some(p) = Pid::from_raw(pid) else {
        return Ok(());
    };
    match kill_process(p, sig) {
        Ok(()) => Ok(()),
        // Gone between listing and signalling: what we wanted anyway.
        Err(rustix::io::Errno::SRCH) => Ok(()),
        Err(e) => Err(TestbedError::Signal {
            pid,
            detail: e.to_string(),
        }),
    }
}

/// SIGKILLs everything in `ns` and waits (bounded) until nothing is left in it.
fn empty_namespace(ns: &str) -> Result<(), TestbedError> {
    let deadline = Instant::now() + KILL_DEADLINE;
    loop {
        let pids = namespace_pids(ns);
        if pids.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(TestbedError::Stuck {
                ns: ns.to_string(),
                pids,
                secs: KILL_DEADLINE.as_secs(),
            });
        }
        for pid in pids {
            signal(pid, Signal::KILL)?;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// What `down` removed.
#[derive(Debug, Default)]
pub struct DownReport {
    pub namespaces_removed: Vec<String>,
    pub state_removed: bool,
}

/// A testbed that is up.
#[derive(Debug, Clone)]
pub struct Testbed {
    pub plan: Plan,
    dir: PathBuf,
}

impl Testbed {
    /// Builds `plan`. `step_pause` is a pause after every command, for the test that
    /// SIGKILLs `up` halfway (zero otherwise). On any error what was made is removed.
    pub fn up(plan: Plan, base: &Path, step_pause: Duration) -> Result<Testbed, TestbedError> {
        require_root()?;
        let dir = run_dir(base, &plan.run);
        let state_path = dir.join(STATE_FILE);
        if state_path.exists() || !existing_namespaces(Some(&plan.run))?.is_empty() {
            return Err(TestbedError::AlreadyUp {
                run: plan.run.clone(),
                dir,
            });
        }
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let state = State {
            plan: plan.clone(),
            up_pid: std::process::id(),
        };
        let json = serde_json::to_vec_pretty(&state).map_err(|e| TestbedError::BadState {
            path: state_path.clone(),
            detail: e.to_string(),
        })?;
        // Written (and renamed into place) before anything is created: a `down` after
        // a SIGKILL of this process at any later point finds it.
        let tmp = dir.join("state.json.tmp");
        fs::write(&tmp, json).map_err(io_err(&tmp))?;
        fs::rename(&tmp, &state_path).map_err(io_err(&state_path))?;
        let tb = Testbed { plan, dir };
        for cmd in crate::plan::batch(&tb.plan.up_commands(), &tb.plan.switch_ns()) {
            if let Err(e) = run_cmd(&cmd) {
                let _ = Testbed::down(&tb.plan.run, base);
                return Err(e);
            }
            if !step_pause.is_zero() {
                std::thread::sleep(step_pause);
            }
        }
        if let Some(imp) = tb.plan.link.impairment() {
            for h in 0..tb.plan.hosts {
                if let Err(e) = tb.start_relay(h, imp) {
                    let _ = Testbed::down(&tb.plan.run, base);
                    return Err(e);
                }
            }
        }
        Ok(tb)
    }

    /// Starts host `host`'s relay in the switch namespace and waits until it has bound
    /// its sockets. The relay is this program's hidden [`RELAY_SUBCOMMAND`] (the `camelot`
    /// binary has it); it runs until `down` kills it with the namespace's other
    /// processes. Its errors go to `relay-hN.log` in the run's directory.
    fn start_relay(&self, host: usize, imp: crate::plan::Impairment) -> Result<(), TestbedError> {
        use std::io::BufRead;
        let exe = std::env::current_exe().map_err(io_err(Path::new("/proc/self/exe")))?;
        let log_path = self.dir.join(format!("relay-h{host}.log"));
        let log = fs::File::create(&log_path).map_err(io_err(&log_path))?;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.plan.switch_ns()])
            .arg(&exe)
            .arg(RELAY_SUBCOMMAND)
            .args(["--a", &Plan::switch_port(host)])
            .args(["--b", &Plan::relay_port(host)])
            .args(["--delay-us", &imp.delay_us.to_string()])
            .args(["--loss-ppm", &imp.loss_ppm.to_string()])
            .args(["--seed", &host.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| TestbedError::Relay {
                detail: format!("cannot start {}: {e}", exe.display()),
            })?;
        let stdout = child.stdout.take().ok_or_else(|| TestbedError::Relay {
            detail: "no stdout".into(),
        })?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        match rx.recv_timeout(RELAY_START) {
            Ok(line) if line.trim() == RELAY_READY => Ok(()),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(TestbedError::Relay {
                    detail: format!(
                        "the relay for h{host} did not start in {RELAY_START:?}: {}",
                        fs::read_to_string(&log_path).unwrap_or_default().trim()
                    ),
                })
            }
        }
    }

    /// The run `run`, from its state file.
    pub fn open(run: &str, base: &Path) -> Result<Testbed, TestbedError> {
        crate::plan::check_run_name(run)?;
        let dir = run_dir(base, run);
        let path = dir.join(STATE_FILE);
        let state = read_state(&path).map_err(|e| match e {
            TestbedError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                TestbedError::NotUp {
                    run: run.to_string(),
                    dir: dir.clone(),
                }
            }
            e => e,
        })?;
        Ok(Testbed {
            plan: state.plan,
            dir,
        })
    }

    /// The run's directory (state, and anything its users want to keep beside it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Removes every namespace of run `run` — those the state names and any other with
    /// the run's prefix — after SIGKILLing every process in them, then the state.
    /// Idempotent: what is already gone is skipped, and a second call finds nothing.
    pub fn down(run: &str, base: &Path) -> Result<DownReport, TestbedError> {
        require_root()?;
        crate::plan::check_run_name(run)?;
        let dir = run_dir(base, run);
        let path = dir.join(STATE_FILE);
        let mut names = existing_namespaces(Some(run))?;
        if let Ok(state) = read_state(&path) {
            for n in state.plan.namespaces() {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
        let mut report = DownReport::default();
        let existing = existing_namespaces(Some(run))?;
        for ns in &names {
            empty_namespace(ns)?;
            if existing.contains(ns) {
                match run_cmd(&ip(&["netns", "del", ns])) {
                    Ok(_) => report.namespaces_removed.push(ns.clone()),
                    // Removed by someone else meanwhile.
                    Err(_) if !existing_namespaces(Some(run))?.contains(ns) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
            report.state_removed = true;
        }
        Ok(report)
    }

    /// Runs that have state or namespaces now.
    pub fn list(base: &Path) -> Result<Vec<String>, TestbedError> {
        let mut runs: Vec<String> = existing_namespaces(None)?
            .iter()
            .filter_map(|n| n.strip_prefix(&format!("{NS_PREFIX}-")))
            .filter_map(|rest| rest.rsplit_once('-').map(|(run, _)| run.to_string()))
            .collect();
        if let Ok(entries) = fs::read_dir(base) {
            for e in entries.flatten() {
                if e.path().join(STATE_FILE).exists() {
                    runs.push(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
        runs.sort();
        runs.dedup();
        Ok(runs)
    }

    /// A command that runs `program` on `host` (`ip netns exec`, which execs it: the
    /// child's pid is the program's).
    pub fn command(&self, host: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.arg("netns")
            .arg("exec")
            .arg(self.plan.host_ns(host))
            .arg(program);
        c
    }

    /// Waits until process `pid` (running on some host) listens on `addr`, as its own
    /// namespace's /proc/PID/net/tcp shows; false if it does not within `timeout` or
    /// its /proc entry goes away (it exited).
    pub fn wait_listening(pid: u32, addr: std::net::SocketAddr, timeout: Duration) -> bool {
        let path = format!("/proc/{pid}/net/tcp");
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match fs::read_to_string(&path) {
                Ok(t) if camelot_testkit::process::is_listening(&t, addr) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        false
    }

    pub fn host_pids(&self, host: usize) -> Vec<i32> {
        namespace_pids(&self.plan.host_ns(host))
    }

    fn signal_hosts(&self, hosts: &[usize], sig: Signal) -> Result<usize, TestbedError> {
        let mut n = 0;
        for &h in hosts {
            for pid in self.host_pids(h) {
                signal(pid, sig)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// SIGKILL every process on `hosts`; returns how many were signalled.
    pub fn kill(&self, hosts: &[usize]) -> Result<usize, TestbedError> {
        self.signal_hosts(hosts, Signal::KILL)
    }

    /// SIGSTOP every process on `hosts`.
    pub fn pause(&self, hosts: &[usize]) -> Result<usize, TestbedError> {
        self.signal_hosts(hosts, Signal::STOP)
    }

    /// SIGCONT every process on `hosts`.
    pub fn resume(&self, hosts: &[usize]) -> Result<usize, TestbedError> {
        self.signal_hosts(hosts, Signal::CONT)
    }

    /// Cuts `group` off from every other host (see [`Plan::partition_commands`]).
    pub fn partition(&self, group: &[usize]) -> Result<(), TestbedError> {
        for c in self.plan.partition_commands(group) {
            run_cmd(&c)?;
        }
        Ok(())
    }

    /// Re-shapes `hosts`' links to `link` (the `slow` fault).
    pub fn shape(&self, hosts: &[usize], link: &LinkSpec) -> Result<(), TestbedError> {
        for &h in hosts {
            for c in self.plan.shape_commands(h, link, "replace") {
                run_shape(&c)?;
            }
        }
        Ok(())
    }

    /// Undoes partitions, downed links and slowed links; resumes paused processes.
    pub fn heal(&self) -> Result<(), TestbedError> {
        for c in self.plan.heal_commands() {
            run_shape(&c)?;
        }
        let all: Vec<usize> = (0..self.plan.hosts).collect();
        self.resume(&all)?;
        Ok(())
    }
}

/// Runs a shaping or healing command; removing shaping from a link that has none is
/// not an error (the kernel says "handle of zero": only its default qdisc is there).
fn run_shape(cmd: &Cmd) -> Result<(), TestbedError> {
    match run_cmd(cmd) {
        Ok(_) => Ok(()),
        Err(TestbedError::Command { stderr, .. })
            if cmd.args.iter().any(|a| a == "del") && stderr.contains("handle of zero") =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

fn read_state(path: &Path) -> Result<State, TestbedError> {
    let meta = fs::metadata(path).map_err(io_err(path))?;
    if meta.len() > STATE_BYTES_MAX {
        return Err(TestbedError::BadState {
            path: path.to_path_buf(),
            detail: format!("{} bytes, more than {STATE_BYTES_MAX}", meta.len()),
        });
    }
    let bytes = fs::read(path).map_err(io_err(path))?;
    serde_json::from_slice(&bytes).map_err(|e| TestbedError::BadState {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netns_list_parses_both_forms() {
        let out = "cmlt-tb-a-h1 (id: 3)\ncmlt-tb-a-sw\n\nother (id: 0)\n";
        assert_eq!(
            parse_netns_list(out),
            vec!["cmlt-tb-a-h1", "cmlt-tb-a-sw", "other"]
        );
    }
}
