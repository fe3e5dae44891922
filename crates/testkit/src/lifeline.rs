//! Children that die with the launcher that started them. A launcher such as `camelot
//! cluster up` stops its servers, etcd and controllers when it is stopped; SIGKILLed, it
//! runs no destructor, and without this they would run on with nobody to stop them.
//!
//! Linux's parent-death signal is tied to the *thread* that started the child: a child
//! started from a thread that ends (a pool's worker) is killed then. So a launcher turns
//! this on and starts its children from its main thread.
#![allow(unsafe_code)]

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

static CHILDREN_DIE_WITH_LAUNCHER: AtomicBool = AtomicBool::new(false);

/// From now on every server this process starts through the testkit gets SIGKILL when the
/// thread that started it ends. For launchers only (see the module documentation); tests
/// leave it off, since they may share a server started by a thread that has finished.
pub fn children_die_with_this_process() {
    CHILDREN_DIE_WITH_LAUNCHER.store(true, Ordering::SeqCst);
}

/// Ties `cmd`'s child to the calling thread when [`children_die_with_this_process`] was
/// called.
pub(crate) fn apply(cmd: &mut Command) {
    if CHILDREN_DIE_WITH_LAUNCHER.load(Ordering::SeqCst) {
        tie_to_this_thread(cmd);
    }
}

/// `cmd`'s child gets SIGKILL when the calling thread ends (the process's main thread:
/// when the process ends, however it ends).
pub fn tie_to_this_thread(cmd: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: `pre_exec` runs the closure in the child between fork and exec, where only
    // async-signal-safe calls are allowed and no lock may be taken: `prctl`, `getppid`
    // and `_exit` are such calls, `last_os_error` only reads errno, and the closure
    // touches nothing but the integer it captured by value.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died before the prctl took effect: no signal will come.
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}
