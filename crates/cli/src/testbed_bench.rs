//! `camelot bench testbed`: seed 000's "emulated vs real" — 4 KiB batched reads and
//! sockperf's TCP round trip, once over loopback and once between two testbed hosts on
//! a rate-limited link, in one result JSON.
//!
//! The load generator is the same program on both paths (`camelot
//! bench-testbed-client`, hidden): run directly for loopback, on host h0 for the
//! testbed, so only the path differs.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use camelot_bench::workload::{regions_on_every_node, run_load, LoadSpec, Mix};
use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_results::schema::{
    now_rfc3339, BenchResult, Comparison, LatencySummary, Point, Reference, Series,
};
use camelot_testbed::plan::{parse_rate, LinkSpec, Plan};
use camelot_testbed::{Testbed, DEFAULT_RUN_DIR};
use clap::Args;
use serde::{Deserialize, Serialize};

const SERVER_PORT: u16 = 7000;
const SOCKPERF_PORT: u16 = 11111;
const START: Duration = Duration::from_secs(10);
const READ_BYTES: u32 = 4096;
/// Each read region; reads land anywhere in it.
const REGION_BYTES: u64 = 64 << 20;
/// The reads are batched: this many threads, each with this many outstanding.
const THREADS: usize = 4;
const DEPTH: usize = 16;
/// What the issue asks of the testbed path: 4 KiB reads at ≥ 0.8× the link rate.
const LINK_FRACTION_TARGET: f64 = 0.8;
/// At most this many link rates in one run (a testbed each).
const RATES_MAX: usize = 8;

#[derive(Args)]
pub struct BenchTestbedArgs {
    /// Seconds per measurement (quick: 2).
    #[arg(long)]
    seconds: Option<f64>,
    #[arg(long)]
    quick: bool,
    /// Testbed link rates, comma-separated: one testbed and one point per rate.
    #[arg(long, value_delimiter = ',', default_value = "1gbit,10gbit")]
    rate: Vec<String>,
    #[arg(long, default_value = "results")]
    out: PathBuf,
    #[arg(long, env = "CAMELOT_TESTBED_DIR", default_value = DEFAULT_RUN_DIR)]
    run_dir: PathBuf,
}

#[derive(Args)]
pub struct ClientArgs {
    #[arg(long)]
    server: SocketAddr,
    #[arg(long)]
    seconds: f64,
}

#[derive(Debug, Serialize, Deserialize)]
struct ClientReport {
    requests: u64,
    ops_per_sec: f64,
    read_bytes_per_sec: f64,
    latency_us: LatencySummary,
}

/// The hidden client: 4 KiB reads, batched, against one server; one JSON line out.
pub fn client(a: ClientArgs) -> Result<()> {
    let client = Client::connect(ClusterMap::from_addrs(&[a.server]), ClientConfig::default())?;
    let regions = regions_on_every_node(&client, REGION_BYTES)?;
    let spec = LoadSpec {
        threads: THREADS,
        depth: DEPTH,
        requests: 1,
        min_duration: Duration::from_secs_f64(a.seconds),
        mix: Mix {
            reads_percent: 100,
            fetch_add_percent: 0,
        },
        sizes_bytes: vec![READ_BYTES],
        pin: false,
        event_loop: false,
        seed: 1,
    };
    let m = run_load(&client, &regions, &spec, None)?;
    let report = ClientReport {
        requests: m.requests,
        ops_per_sec: m.ops_per_sec(),
        read_bytes_per_sec: m.read_bytes_per_sec(),
        latency_us: m.latency.summary(),
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

struct Killed(Vec<Child>);
impl Drop for Killed {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_loopback_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// One path: the server and sockperf's server started by `server_cmd`, the client and
/// sockperf's client by `client_cmd` (a command for a program, placed on its host).
fn measure(
    server_cmd: &dyn Fn(&str) -> Command,
    client_cmd: &dyn Fn(&str) -> Command,
    server: SocketAddr,
    sockperf: SocketAddr,
    seconds: f64,
) -> Result<(ClientReport, LatencySummary, String)> {
    let exe = std::env::current_exe()?;
    let exe = exe.to_string_lossy();
    let mut children = Killed(Vec::new());
    let s = server_cmd(&exe)
        .args(["server", "--listen", &server.to_string(), "--memory", "1G"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start camelot server")?;
    let pid = s.id();
    children.0.push(s);
    if !Testbed::wait_listening(pid, server, START) {
        bail!("camelot server did not listen on {server}");
    }
    let out = client_cmd(&exe)
        .args(["bench-testbed-client", "--server", &server.to_string()])
        .args(["--seconds", &seconds.to_string()])
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("the read client failed ({})", out.status);
    }
    let report: ClientReport = serde_json::from_slice(&out.stdout).context("client report")?;

    let sp = server_cmd("sockperf")
        .args(["server", "--tcp", "-i", &sockperf.ip().to_string()])
        .args(["-p", &sockperf.port().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start sockperf (scripts/setup.sh installs it)")?;
    let pid = sp.id();
    children.0.push(sp);
    if !Testbed::wait_listening(pid, sockperf, START) {
        bail!("sockperf server did not listen on {sockperf}");
    }
    let secs = (seconds.ceil() as u64).max(1).to_string();
    let args = [
        "ping-pong",
        "--tcp",
        "-i",
        &sockperf.ip().to_string(),
        "-p",
        &sockperf.port().to_string(),
        "-m",
        "64",
        "-t",
        &secs,
        "--full-rtt",
    ];
    let command = format!("sockperf {}", args.join(" "));
    let out = client_cmd("timeout")
        .arg((seconds.ceil() as u64 + 20).to_string())
        .arg("sockperf")
        .args(args)
        .output()?;
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let rtt = camelot_bench::peers::parse_sockperf_output(&text)
        .map_err(|e| anyhow::anyhow!("sockperf: {e}"))?;
    Ok((report, rtt, command))
}

fn point(label: &str, r: &ClientReport) -> Point {
    let mut p = Point::new(label);
    p.ops_per_sec = Some(r.ops_per_sec);
    p.bytes_per_sec = Some(r.read_bytes_per_sec);
    p.latency_us = Some(r.latency_us.clone());
    p.extra.insert("requests".into(), r.requests.into());
    p
}

fn rtt_point(label: &str, rtt: &LatencySummary) -> Point {
    let mut p = Point::new(label);
    p.latency_us = Some(rtt.clone());
    p
}

pub fn run(a: BenchTestbedArgs) -> Result<()> {
    camelot_testbed::require_root()?;
    let seconds = a.seconds.unwrap_or(if a.quick { 2.0 } else { 10.0 });
    if !(seconds > 0.0 && seconds <= 3600.0) {
        bail!("--seconds: more than 0, at most 3600");
    }
    let rates = a
        .rate
        .iter()
        .map(|r| parse_rate(r).map(|bits| (r.clone(), bits)))
        .collect::<Result<Vec<_>, _>>()?;
    if rates.is_empty() || rates.len() > RATES_MAX {
        bail!("--rate: 1 to {RATES_MAX} rates");
    }
    let started = now_rfc3339();

    println!("loopback: 4 KiB reads, {THREADS} threads × {DEPTH}, {seconds} s …");
    let lo_server = SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::LOCALHOST,
        free_loopback_port()?,
    ));
    let lo_sockperf = SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::LOCALHOST,
        free_loopback_port()?,
    ));
    let plain = |p: &str| Command::new(p);
    let (lo, lo_rtt, sockperf_cmd) = measure(&plain, &plain, lo_server, lo_sockperf, seconds)?;
    let mbs = |b: f64| b / 1e6;
    println!(
        "  loopback: {:.0} MB/s (p50 {:.0} µs); sockperf RTT p50 {:.1} µs p99 {:.1} µs",
        mbs(lo.read_bytes_per_sec),
        lo.latency_us.p50,
        lo_rtt.p50,
        lo_rtt.p99
    );

    let mut reads = Series::new("4 KiB batched reads");
    reads.points.push(point("loopback", &lo));
    let mut rtts = Series::new("sockperf TCP RTT, 64 B");
    rtts.points.push(rtt_point("loopback", &lo_rtt));
    let mut references = Vec::new();
    let mut comparisons = Vec::new();
    let run = format!("bt{}", std::process::id() % 1_000_000);
    crate::testbed::down_on_signal(run.clone(), a.run_dir.clone())?;
    for (name, bits) in &rates {
        println!("testbed at {name}: the same, h0 → h1 …");
        let plan = Plan::new(
            &run,
            2,
            LinkSpec {
                rate_bits_per_s: Some(*bits),
                ..LinkSpec::default()
            },
        )?;
        let tb = Testbed::up(plan, &a.run_dir, Duration::ZERO)?;
        let server = SocketAddr::V4(SocketAddrV4::new(tb.plan.host_addr(1), SERVER_PORT));
        let sp = SocketAddr::V4(SocketAddrV4::new(tb.plan.host_addr(1), SOCKPERF_PORT));
        let on_h1 = |p: &str| tb.command(1, p);
        let on_h0 = |p: &str| tb.command(0, p);
        // Measured before `?`: the testbed comes down whatever happened.
        let result = measure(&on_h1, &on_h0, server, sp, seconds);
        let down = Testbed::down(&run, &a.run_dir);
        let (tbd, tb_rtt, _) = result?;
        down?;
        let label = format!("testbed {name}");
        let link_bytes_per_s = *bits as f64 / 8.0;
        println!(
            "  {label}: {:.0} MB/s (p50 {:.0} µs) = {:.2} of the link; sockperf RTT p50 {:.1} µs p99 {:.1} µs",
            mbs(tbd.read_bytes_per_sec),
            tbd.latency_us.p50,
            tbd.read_bytes_per_sec / link_bytes_per_s,
            tb_rtt.p50,
            tb_rtt.p99
        );
        reads.points.push(point(&label, &tbd));
        rtts.points.push(rtt_point(&label, &tb_rtt));
        references.push(Reference {
            label: format!("link rate ({name})"),
            metric: "bytes_per_sec".into(),
            value: link_bytes_per_s,
        });
        comparisons.push(
            Comparison::new(
                format!("{label}: 4 KiB reads ÷ link rate"),
                tbd.read_bytes_per_sec,
                link_bytes_per_s,
                "bytes/s",
                format!("link rate ({name})"),
            )
            .with_target(LINK_FRACTION_TARGET, false),
        );
        comparisons.push(Comparison::new(
            format!("{label} ÷ loopback, 4 KiB reads"),
            tbd.read_bytes_per_sec,
            lo.read_bytes_per_sec,
            "bytes/s",
            "loopback",
        ));
    }
    let config = serde_json::json!({
        "seconds": seconds,
        "read_bytes": READ_BYTES,
        "threads": THREADS,
        "depth": DEPTH,
        "region_bytes": REGION_BYTES,
        "link_rates_bits_per_s": rates.iter().map(|(_, b)| *b).collect::<Vec<_>>(),
        "testbed": "two hosts in network namespaces, veth pairs to a bridge, tbf both ways",
        "sockperf": sockperf_cmd,
        "quick": a.quick,
    });
    let mut result = BenchResult::new("testbed", started, config, vec![reads, rtts]);
    result.references = references;
    result.comparisons = comparisons;
    let path = camelot_results::output::write_result(&a.out, &result)?;
    println!("wrote {}", path.display());
    Ok(())
}
