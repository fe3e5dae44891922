//! A stock redis-py, default settings, against `camelot server --resp-listen`: what a new
//! user tries first. Both redis-pys `scripts/setup.sh` installs run the same script
//! (`redis_py_client.py`): Debian 12's 4.3.4 (RESP2, no handshake commands) and PyPI's
//! 8.1.0 (HELLO 3 and CLIENT SETINFO on connect), each doing SET/GET/HSET, a pipeline, a
//! MULTI/EXEC transaction and a WATCH conflict.

use camelot_testkit::{CamelotServer, CamelotServerOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the client script with `python` against `addr` under coreutils `timeout`, so a
/// client stuck on a reply fails the test instead of hanging it. Returns its stdout.
fn run_client(python: &Path, addr: std::net::SocketAddr) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/redis_py_client.py");
    let out = Command::new("timeout")
        .arg("60")
        .arg(python)
        .arg(&script)
        .arg(addr.to_string())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} (run scripts/setup.sh): {e}",
                python.display()
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} failed against {addr}:\n{stdout}{}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn stock_redis_py_connects_and_runs_strings_hashes_pipelines_and_transactions() {
    let server = CamelotServer::start(
        Path::new(CAMELOT),
        &CamelotServerOptions {
            resp: true,
            args: vec!["--memory".into(), "64M".into()],
        },
    )
    .expect("camelot server starts");
    let addr = server.resp_addr().expect("a Redis port");
    assert!(addr.ip().is_loopback());

    let debian = run_client(Path::new("/usr/bin/python3"), addr);
    assert!(
        debian.starts_with("redis-py 4.") && debian.contains("(RESP 2)"),
        "Debian's python3-redis: {debian}"
    );
    let venv = repo().join(".venv/redis-py/bin/python");
    assert!(
        venv.is_file(),
        "no redis-py 8 at {} (run scripts/setup.sh)",
        venv.display()
    );
    let pypi = run_client(&venv, addr);
    assert!(
        pypi.starts_with("redis-py 8.") && pypi.contains("(RESP 3)"),
        "redis-py 8 with its defaults speaks RESP3: {pypi}"
    );
}
