//! The testbed for real: namespaces, links, rate limits and faults, as root. Without
//! root each test checks the refusal instead and says so; CI (which runs as root) sets
//! `CI`, under which not being root fails the test rather than passing quietly.
//!
//! Every address used here is one of the testbed's own (10.213.0.0/24), which exists
//! only inside namespaces these tests create and remove.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use camelot_testbed::plan::{parse_rate, LinkSpec, Plan};
use camelot_testbed::{net, Testbed, TestbedError};

const IPERF_PORT: u16 = 5201;

fn base() -> PathBuf {
    std::env::temp_dir().join(format!("camelot-testbed-tests-{}", std::process::id()))
}

/// A run name of this test process's own, so parallel tests and other checkouts
/// never meet.
fn run_name(tag: &str) -> String {
    format!("{tag}{}", std::process::id() % 100_000)
}

/// True when we can run; otherwise checks that `up` refuses with the root message.
fn root_or_checked_refusal() -> bool {
    if net::require_root().is_ok() {
        return true;
    }
    let plan = Plan::new("x", 1, LinkSpec::default()).unwrap();
    let err = Testbed::up(plan, &base(), Duration::ZERO).unwrap_err();
    assert!(matches!(err, TestbedError::NotRoot { .. }), "{err}");
    assert!(err.to_string().contains("needs root"));
    assert!(
        std::env::var_os("CI").is_none(),
        "CI runs as root: the testbed tests must run there, not skip"
    );
    eprintln!("not root: checked the refusal only");
    false
}

/// Removes the run even when an assertion fails.
struct Down(String);
impl Drop for Down {
    fn drop(&mut self) {
        let _ = Testbed::down(&self.0, &base());
    }
}

fn root_links() -> Vec<String> {
    let out = Command::new("ip").args(["-o", "link"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(':').nth(1).map(|n| n.trim().to_string()))
        .collect()
}

/// An iperf3 server on `host`; `one_off` serves one test then exits (a bare TCP
/// connect counts as one, so connect probes need a lasting server).
fn iperf_server(tb: &Testbed, host: usize, one_off: bool) -> Child {
    let addr = tb.plan.host_addr(host);
    let mut cmd = tb.command(host, "iperf3");
    if one_off {
        cmd.arg("-1");
    }
    let child = cmd
        .args(["-s", "-B", &addr.to_string(), "-p", &IPERF_PORT.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        Testbed::wait_listening(
            child.id(),
            SocketAddr::new(addr.into(), IPERF_PORT),
            Duration::from_secs(5)
        ),
        "iperf3 server on h{host} did not listen"
    );
    child
}

/// Whether `from` can open a TCP connection to `to`'s iperf3 port within 1 s.
fn tcp_connects(tb: &Testbed, from: usize, to: usize) -> bool {
    let script = format!("exec 3<>/dev/tcp/{}/{IPERF_PORT}", tb.plan.host_addr(to));
    tb.command(from, "timeout")
        .args(["1", "bash", "-c", &script])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// Receiver-side bits per second of a `seconds`-long iperf3 run from `from` to `to`.
fn iperf_bits_per_s(tb: &Testbed, from: usize, to: usize, seconds: u32) -> f64 {
    let mut server = iperf_server(tb, to, true);
    let out = tb
        .command(from, "timeout")
        .args([
            &(seconds + 10).to_string(),
            "iperf3",
            "-c",
            &tb.plan.host_addr(to).to_string(),
            "-p",
            &IPERF_PORT.to_string(),
            "-t",
            &seconds.to_string(),
            "-J",
        ])
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        out.status.success(),
        "iperf3: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap()
}

fn assert_gone(run: &str, links_before: &[String]) {
    assert!(net::existing_namespaces(Some(run)).unwrap().is_empty());
    let after = root_links();
    for l in &after {
        assert!(
            links_before.contains(l),
            "link {l} left in the machine's namespace"
        );
    }
    assert!(!base().join(run).exists(), "state left behind");
}

#[test]
fn up_8_hosts_within_2s_connects_and_down_leaves_nothing() {
    if !root_or_checked_refusal() {
        return;
    }
    let run = run_name("a");
    let _down = Down(run.clone());
    let links_before = root_links();
    let started = Instant::now();
    let tb = Testbed::up(
        Plan::new(
            &run,
            8,
            LinkSpec {
                rate_bits_per_s: Some(1_000_000_000),
                ..Default::default()
            },
        )
        .unwrap(),
        &base(),
        Duration::ZERO,
    )
    .unwrap();
    let up_s = started.elapsed().as_secs_f64();
    eprintln!("up --hosts 8 --rate 1gbit: {up_s:.3} s");
    assert!(up_s <= 2.0, "up took {up_s:.3} s, the target is 2 s");
    assert_eq!(net::existing_namespaces(Some(&run)).unwrap().len(), 9);
    // Nothing of ours in the machine's namespace.
    assert_eq!(root_links(), links_before);

    let mut server = iperf_server(&tb, 0, false);
    for from in 1..8 {
        assert!(tcp_connects(&tb, from, 0), "h{from} → h0");
    }
    let server_pid = server.id();

    let started = Instant::now();
    let report = Testbed::down(&run, &base()).unwrap();
    eprintln!("down: {:.3} s", started.elapsed().as_secs_f64());
    assert_eq!(report.namespaces_removed.len(), 9);
    // The server was SIGKILLed by down, not left running.
    let status = server.wait().unwrap();
    assert!(
        !status.success(),
        "iperf3 {server_pid} ended by a signal: {status:?}"
    );
    assert_gone(&run, &links_before);
    // Idempotent.
    let again = Testbed::down(&run, &base()).unwrap();
    assert!(again.namespaces_removed.is_empty() && !again.state_removed);
}

#[test]
fn rate_limit_is_honoured_and_slow_changes_it() {
    if !root_or_checked_refusal() {
        return;
    }
    let run = run_name("b");
    let _down = Down(run.clone());
    let rate = parse_rate("200mbit").unwrap();
    let tb = Testbed::up(
        Plan::new(
            &run,
            2,
            LinkSpec {
                rate_bits_per_s: Some(rate),
                ..Default::default()
            },
        )
        .unwrap(),
        &base(),
        Duration::ZERO,
    )
    .unwrap();
    let got = iperf_bits_per_s(&tb, 1, 0, 2);
    eprintln!("iperf3 over a 200 Mbit/s link: {:.1} Mbit/s", got / 1e6);
    assert!(
        got > 0.7 * rate as f64 && got < 1.05 * rate as f64,
        "{got} bit/s over a {rate} bit/s link"
    );
    // The `slow` fault lowers it; heal restores it.
    let slow = parse_rate("40mbit").unwrap();
    tb.shape(
        &[1],
        &LinkSpec {
            rate_bits_per_s: Some(slow),
            ..Default::default()
        },
    )
    .unwrap();
    let got_slow = iperf_bits_per_s(&tb, 1, 0, 2);
    eprintln!("after slow h1 40mbit: {:.1} Mbit/s", got_slow / 1e6);
    assert!(
        got_slow > 0.7 * slow as f64 && got_slow < 1.05 * slow as f64,
        "{got_slow}"
    );
    tb.heal().unwrap();
    let healed = iperf_bits_per_s(&tb, 1, 0, 1);
    assert!(healed > 0.7 * rate as f64, "{healed} after heal");
}

#[test]
fn partition_cuts_silently_and_heal_restores() {
    if !root_or_checked_refusal() {
        return;
    }
    let run = run_name("c");
    let _down = Down(run.clone());
    let tb = Testbed::up(
        Plan::new(&run, 3, LinkSpec::default()).unwrap(),
        &base(),
        Duration::ZERO,
    )
    .unwrap();
    let mut server = iperf_server(&tb, 0, false);
    assert!(tcp_connects(&tb, 1, 0));
    tb.partition(&[0]).unwrap();
    let started = Instant::now();
    assert!(
        !tcp_connects(&tb, 1, 0),
        "h1 reached h0 across the partition"
    );
    // Silent: the connect hung until the 1 s timeout, it was not refused at once.
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert!(!tcp_connects(&tb, 2, 0));
    tb.heal().unwrap();
    assert!(tcp_connects(&tb, 1, 0), "heal did not restore h1 → h0");
    let _ = server.kill();
    let _ = server.wait();
}

#[test]
fn faults_signal_host_processes_and_down_kills_the_rest() {
    if !root_or_checked_refusal() {
        return;
    }
    let run = run_name("d");
    let _down = Down(run.clone());
    let links_before = root_links();
    let tb = Testbed::up(
        Plan::new(&run, 2, LinkSpec::default()).unwrap(),
        &base(),
        Duration::ZERO,
    )
    .unwrap();
    let mut a = tb.command(0, "sleep").arg("600").spawn().unwrap();
    let mut b = tb.command(1, "sleep").arg("600").spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while tb.host_pids(0).is_empty() || tb.host_pids(1).is_empty() {
        assert!(
            Instant::now() < deadline,
            "sleep never showed up in its namespace"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(tb.host_pids(0), vec![a.id() as i32]);
    // pause → stopped (state T), resume → running again.
    assert_eq!(tb.pause(&[1]).unwrap(), 1);
    let state = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.chars().next().unwrap()))
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while state(b.id()) != Some('T') {
        assert!(
            Instant::now() < deadline,
            "not stopped: {:?}",
            state(b.id())
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    tb.resume(&[1]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while state(b.id()) == Some('T') {
        assert!(Instant::now() < deadline, "not resumed");
        std::thread::sleep(Duration::from_millis(10));
    }
    // kill → SIGKILL.
    assert_eq!(tb.kill(&[0]).unwrap(), 1);
    let st = a.wait().unwrap();
    assert!(!st.success());
    // down SIGKILLs what is still running.
    Testbed::down(&run, &base()).unwrap();
    let st = b.wait().unwrap();
    assert!(!st.success());
    assert_gone(&run, &links_before);
}
