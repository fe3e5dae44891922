//! An emulated network on one machine (Mininet's role): a network namespace per host,
//! veth pairs to a bridge in a switch namespace, rate limits with `tbf`, faults (kill,
//! pause, partition, slow), and the seeded fault schedule chaos runs replay.
//!
//! `plan` (names, addresses, the exact `ip`/`tc` commands) and `schedule` are pure and
//! tested without root; `net` runs them and keeps the run's state on disk so `down`
//! cleans up after any crash.

// The one exception is `packet` (raw frames for the relay), which allows it locally.
#![deny(unsafe_code)]

pub mod history;
pub mod net;
mod packet;
pub mod plan;
pub mod relay;
pub mod schedule;

pub use net::{require_root, Testbed, DEFAULT_RUN_DIR, RELAY_READY, RELAY_SUBCOMMAND};
pub use plan::{LinkSpec, Plan};
pub use schedule::{FaultEvent, FaultKind, ScheduleSpec};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    #[error(
        "the testbed needs root: network namespaces, veth links and qdiscs are privileged \
         (effective uid {euid}); run it as root, e.g. `sudo camelot testbed …`"
    )]
    NotRoot { euid: u32 },
    #[error("`{program}` cannot be run ({detail}): install iproute2 (scripts/setup.sh)")]
    MissingTool { program: String, detail: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("delay/loss relay: {detail}")]
    Relay { detail: String },
    #[error(
        "testbed {run:?} is already up (state in {dir}); `camelot testbed down --name {run}` first"
    )]
    AlreadyUp { run: String, dir: PathBuf },
    #[error("testbed {run:?} is not up (no state in {dir})")]
    NotUp { run: String, dir: PathBuf },
    #[error("no host {host:?}: this testbed has h0 … h{}", hosts.saturating_sub(1))]
    NoSuchHost { host: String, hosts: usize },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state file {path} is not valid: {detail}")]
    BadState { path: PathBuf, detail: String },
    #[error("processes {pids:?} in namespace {ns} still running {secs} s after SIGKILL")]
    Stuck {
        ns: String,
        pids: Vec<i32>,
        secs: u64,
    },
    #[error("signal to pid {pid}: {detail}")]
    Signal { pid: i32, detail: String },
}
