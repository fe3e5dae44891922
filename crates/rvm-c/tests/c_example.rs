//! Builds examples/list.c against librvm_c with the system C compiler, runs it on a real
//! file backend and a real memory server, SIGKILLs it mid-run, and checks the recovered
//! list: every pointer valid (segments came back at their addresses), nothing committed
//! lost.

use camelot_server::dev::{DevCluster, DevClusterConfig};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const LINE_TIMEOUT: Duration = Duration::from_secs(20);
const KILLS: usize = 3;

/// Where cargo put librvm_c.so: beside this test in target/<profile>/deps during
/// `cargo test`, or uplifted to target/<profile> by a plain build.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    let deps = exe.parent().expect("deps dir").to_path_buf();
    match deps.parent() {
        Some(up) if !deps.join("librvm_c.so").exists() => up.to_path_buf(),
        _ => deps,
    }
}

fn build_example(out: &Path) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin = out.join("list");
    let lib = lib_dir();
    assert!(
        lib.join("librvm_c.so").exists(),
        "librvm_c.so not in {}",
        lib.display()
    );
    let status = Command::new("cc")
        .arg(manifest.join("examples/list.c"))
        .arg("-I")
        .arg(manifest.join("include"))
        .arg("-Wall")
        .arg("-Werror")
        .arg("-o")
        .arg(&bin)
        .arg(format!("-L{}", lib.display()))
        // RPATH, not RUNPATH: `cargo test` sets LD_LIBRARY_PATH to target/<profile> too,
        // which outranks a RUNPATH, and a stale uplifted librvm_c.so there (from an
        // older plain build) would then be the one loaded.
        .arg("-Wl,--disable-new-dtags")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lrvm_c")
        .status()
        .expect("cc runs");
    assert!(status.success(), "cc failed on examples/list.c");
    bin
}

fn check(bin: &Path, backend: &str) -> (i64, i64) {
    let out = Command::new(bin)
        .args([backend, "check"])
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "check failed: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let words: Vec<&str> = text.split_whitespace().collect();
    let count: i64 = words.get(1).and_then(|w| w.parse().ok()).expect("count");
    let sum: i64 = words.get(3).and_then(|w| w.parse().ok()).expect("sum");
    assert_eq!(
        sum,
        count * (count + 1) / 2,
        "list values are not 1..=count: {text}"
    );
    (count, sum)
}

fn run(bin: &Path, backend: &str) {
    let out = Command::new(bin)
        .args([backend, "add", "20"])
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(check(bin, backend).0, 20);
    for k in 0..KILLS {
        let mut child = Command::new(bin)
            .args([backend, "add", "100000"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut last = 0i64;
        for _ in 0..(5 + 7 * k) {
            let line = rx
                .recv_timeout(LINE_TIMEOUT)
                .expect("the example reports commits");
            last = line.trim_start_matches("added ").parse().expect("added N");
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        while let Ok(line) = rx.recv_timeout(LINE_TIMEOUT) {
            last = line.trim_start_matches("added ").parse().expect("added N");
        }
        let (count, _) = check(bin, backend);
        assert!(
            count == last || count == last + 1,
            "kill {k}: {count} nodes, {last} reported"
        );
    }
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("camelot-rvm-c-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("scratch");
    d
}

#[test]
fn linked_list_survives_kills_on_file_and_pool() {
    let dir = scratch("list");
    let bin = build_example(&dir);
    run(&bin, &format!("file://{}", dir.join("data").display()));
    let node = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 512 << 20,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev node");
    run(&bin, &format!("pool://{}", node.addrs()[0]));
    // A bad backend is a clear error, not a crash.
    let out = Command::new(&bin)
        .args(["nfs://x", "check"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown scheme"));
    let _ = std::fs::remove_dir_all(dir);
}
