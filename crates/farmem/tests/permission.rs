//! FarRegion where userfaultfd is refused: this test binary runs itself again as user
//! `nobody`, and the child's `FarRegion::new` must fail with the typed error that names
//! the sysctl to change. (The tests run as root, as CI does, so they can drop to nobody.)

use std::os::unix::process::CommandExt;
use std::process::Command;

use camelot_farmem::{CacheConfig, Error, FarRegion, LocalStore};

const CHILD_ENV: &str = "CAMELOT_FARMEM_UNPRIVILEGED_CHILD";
const NOBODY: u32 = 65534;

/// The child: tries to make a region and prints what happened.
#[test]
#[ignore = "the child process of an_unprivileged_process_is_told_why_and_what_to_change"]
fn unprivileged_child() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let store = LocalStore::new(4096, 4).expect("store");
    match FarRegion::new(store, &CacheConfig::new(2 * 4096)) {
        Err(e @ Error::UserfaultNotPermitted(_)) => println!("\nREFUSED: {e}"),
        Err(e) => println!("\nOTHER: {e}"),
        Ok(_) => println!("\nALLOWED"),
    }
}

#[test]
fn an_unprivileged_process_is_told_why_and_what_to_change() {
    let sysctl =
        std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "unprivileged_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("run the child as nobody (the tests need root)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the child failed: {stdout}");
    if sysctl.trim() == "1" {
        // Unprivileged userfaultfd is allowed here: nobody may make a region.
        assert!(stdout.contains("ALLOWED"), "{stdout}");
        return;
    }
    assert!(stdout.contains("REFUSED: "), "{stdout}");
    for says in [
        "not permitted",
        "/dev/userfaultfd",
        "vm.unprivileged_userfaultfd=1",
        "FarVec needs none of this",
    ] {
        assert!(stdout.contains(says), "{says:?} missing from: {stdout}");
    }
}
