//! The workspace's `rust-version` is honest: every package in the locked dependency tree
//! declares one no newer, every crate of ours inherits it (so clippy's `incompatible_msrv`
//! lint checks our own use of std against it), and the README states it. No toolchain of
//! that version is needed to check this; `cargo metadata` reads what each crate declares.

use std::process::Command;

fn version(v: &str) -> (u64, u64, u64) {
    let mut parts = v.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

#[test]
fn rust_version_covers_every_dependency_and_is_stated() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .expect("members")
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    let packages = meta["packages"].as_array().expect("packages");
    let mut ours = None;
    for p in packages
        .iter()
        .filter(|p| p["id"].as_str().is_some_and(|id| members.contains(&id)))
    {
        let v = p["rust_version"]
            .as_str()
            .unwrap_or_else(|| panic!("{} declares no rust-version.workspace", p["name"]));
        assert!(
            ours.is_none_or(|o| o == v),
            "{} has rust-version {v}",
            p["name"]
        );
        ours = Some(v);
    }
    let ours = ours.expect("workspace members");
    let mut newer = Vec::new();
    for p in packages {
        if let Some(v) = p["rust_version"].as_str() {
            if version(v) > version(ours) {
                newer.push(format!("{} {} needs {v}", p["name"], p["version"]));
            }
        }
    }
    assert!(
        newer.is_empty(),
        "rust-version {ours} is older than what these need: {newer:?}"
    );
    let readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README");
    let stated = format!("Rust {ours}");
    assert!(
        readme.contains(&stated),
        "README does not state the MSRV as {stated:?}"
    );
}

/// Every Debian package a launcher names (`Program::debian(…, "package")`) and every tool
/// the scripts and tests call is in `scripts/setup.sh`, which asks apt for nothing when
/// nothing is missing.
#[test]
fn setup_installs_what_the_tests_and_scripts_call() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let setup = std::fs::read_to_string(format!("{root}/scripts/setup.sh")).expect("setup.sh");
    let list = setup
        .split_once("packages=(")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(list, _)| list)
        .expect("a packages=( … ) list");
    let listed: Vec<&str> = list.split_whitespace().collect();

    let mut wanted: Vec<String> = [
        ("jq", "jq"),             // scripts read result JSON with it
        ("ss", "iproute2"),       // scripts wait for iperf3's LISTEN socket
        ("cc", "gcc"),            // rvm-c's C example
        ("kill", "procps"),       // CLI tests signal servers
        ("python3", "python3"),   // ycsb-crosscheck.sh picks free ports
        ("chromium", "chromium"), // the report test
    ]
    .iter()
    .map(|(_, package)| package.to_string())
    .collect();
    let mut stack = vec![std::path::PathBuf::from(format!("{root}/crates"))];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("source");
                for call in text.split("Program::debian(").skip(1) {
                    let args = call.split(')').next().unwrap_or("");
                    if let Some(package) = args.split('"').nth(3) {
                        if !package.starts_with("camelot-no-such") && package != "coreutils" {
                            wanted.push(package.to_string());
                        }
                    }
                }
            }
        }
    }
    wanted.sort();
    wanted.dedup();
    let absent: Vec<&String> = wanted
        .iter()
        .filter(|p| !listed.contains(&p.as_str()))
        .collect();
    assert!(absent.is_empty(), "setup.sh does not install {absent:?}");
    assert!(wanted.iter().any(|p| p == "redis-server"), "{wanted:?}");

    // Idempotent: apt is asked only inside the branch where something is missing.
    let branch = setup
        .find("if ((${#missing[@]})); then\n  echo \"setup: installing")
        .expect("an install branch");
    let update = setup.find("$SUDO apt-get update").expect("apt-get update");
    assert!(
        update > branch,
        "apt-get update runs even when nothing is missing"
    );
    assert!(
        setup.contains("--check"),
        "no way to check without installing"
    );
}
