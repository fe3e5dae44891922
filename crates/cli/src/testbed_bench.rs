//! `camelot bench testbed`: seed 000's "emulated vs real" — 4 KiB batched reads, the
//! threads experiment (4 KiB reads against client threads, one request outstanding per
//! thread and batched) and sockperf's TCP round trip, once over loopback and once between
//! two testbed hosts on a rate-limited link, in one result JSON.
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
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{
    now_rfc3339, BenchResult, Comparison, LatencySummary, Point, Reference, Series, X,
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
/// The threads experiment's client thread counts, and the ceiling on what --threads takes.
const THREAD_COUNTS_DEFAULT: &str = "1,4,16";
const THREAD_COUNTS_MAX: usize = 8;
const CLIENT_THREADS_MAX: usize = 64;
/// Each threads-experiment point runs this share of --seconds: there are 2 × counts of
/// them per path, and the headline 4 KiB figure keeps the full time.
const THREADS_POINT_SHARE: f64 = 0.5;

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
    /// The threads experiment's client thread counts, comma-separated: each is run with
    /// one request outstanding per thread and with 16 (batched), on every path.
    #[arg(long, value_delimiter = ',', default_value = THREAD_COUNTS_DEFAULT)]
    threads: Vec<usize>,
    /// Also run the first rate with this one-way delay per link (the testbed's relay):
    /// e.g. 50us. A round trip crosses four link ends, so it gains four delays.
    #[arg(long)]
    delay: Option<String>,
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
    #[arg(long, default_value_t = THREADS)]
    threads: usize,
    /// Requests each thread keeps outstanding (1: unbatched).
    #[arg(long, default_value_t = DEPTH)]
    depth: usize,
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
    if !(1..=CLIENT_THREADS_MAX).contains(&a.threads) || !(1..=DEPTH).contains(&a.depth) {
        bail!("--threads 1..={CLIENT_THREADS_MAX}, --depth 1..={DEPTH}");
    }
    let client = Client::connect(ClusterMap::from_addrs(&[a.server]), ClientConfig::default())?;
    let regions = regions_on_every_node(&client, REGION_BYTES)?;
    let spec = LoadSpec {
        threads: a.threads,
        depth: a.depth,
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
    thread_points: &[(usize, usize)],
) -> Result<Measured> {
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
    let reads = |threads: usize, depth: usize, seconds: f64| -> Result<ClientReport> {
        let out = client_cmd(&exe)
            .args(["bench-testbed-client", "--server", &server.to_string()])
            .args(["--seconds", &seconds.to_string()])
            .args(["--threads", &threads.to_string()])
            .args(["--depth", &depth.to_string()])
            .stderr(Stdio::inherit())
            .output()?;
        if !out.status.success() {
            bail!("the read client failed ({})", out.status);
        }
        serde_json::from_slice(&out.stdout).context("client report")
    };
    let report = reads(THREADS, DEPTH, seconds)?;
    let threads = thread_points
        .iter()
        .map(|&(t, d)| reads(t, d, seconds * THREADS_POINT_SHARE))
        .collect::<Result<Vec<_>>>()?;

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
    Ok(Measured {
        reads: report,
        threads,
        rtt,
        sockperf_command: command,
    })
}

/// One path's figures: the headline 4 KiB reads, the threads experiment's points (in
/// the order asked) and the round trip.
struct Measured {
    reads: ClientReport,
    threads: Vec<ClientReport>,
    rtt: LatencySummary,
    sockperf_command: String,
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
    let delay_us = a
        .delay
        .as_deref()
        .map(camelot_testbed::plan::parse_delay_us)
        .transpose()?;
    // (label, rate, delay) of every testbed path.
    let mut paths: Vec<(String, u64, Option<u64>)> = rates
        .iter()
        .map(|(name, bits)| (name.clone(), *bits, None))
        .collect();
    if let (Some(d), Some(delay)) = (delay_us, a.delay.as_ref()) {
        paths.push((
            format!("{} + {delay} delay", rates[0].0),
            rates[0].1,
            Some(d),
        ));
    }
    if a.threads.is_empty()
        || a.threads.len() > THREAD_COUNTS_MAX
        || a.threads
            .iter()
            .any(|t| !(1..=CLIENT_THREADS_MAX).contains(t))
    {
        bail!("--threads: 1 to {THREAD_COUNTS_MAX} counts, each 1..={CLIENT_THREADS_MAX}");
    }
    // Unbatched first, then batched, each over every thread count.
    let thread_points: Vec<(usize, usize)> = [1, DEPTH]
        .iter()
        .flat_map(|&d| a.threads.iter().map(move |&t| (t, d)))
        .collect();
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
    let lo_all = measure(
        &plain,
        &plain,
        lo_server,
        lo_sockperf,
        seconds,
        &thread_points,
    )?;
    let (lo, lo_rtt) = (&lo_all.reads, &lo_all.rtt);
    let mbs = |b: f64| b / 1e6;
    println!(
        "  loopback: {:.0} MB/s (p50 {:.0} µs); sockperf RTT p50 {:.1} µs p99 {:.1} µs",
        mbs(lo.read_bytes_per_sec),
        lo.latency_us.p50,
        lo_rtt.p50,
        lo_rtt.p99
    );

    let mut reads = Series::new("4 KiB batched reads");
    reads.points.push(point("loopback", lo));
    let mut rtts = Series::new("sockperf TCP RTT, 64 B");
    rtts.points.push(rtt_point("loopback", lo_rtt));
    let mut thread_series = vec![
        Series::new("threads experiment, 4 KiB reads, 1 outstanding per thread"),
        Series::new(format!(
            "threads experiment, 4 KiB reads, {DEPTH} outstanding per thread"
        )),
    ];
    // The figure's threads panel: ops/s against client threads, a line per path and depth.
    let mut thread_lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut add_thread_points = |path: &str, m: &Measured| {
        for (&(t, d), r) in thread_points.iter().zip(&m.threads) {
            let series = &mut thread_series[usize::from(d != 1)];
            series
                .points
                .push(point(&format!("{path}, {t} threads"), r));
            let line = format!("{path} ×{d}");
            match thread_lines.iter_mut().find(|(l, _)| *l == line) {
                Some((_, points)) => points.push((t as f64, r.ops_per_sec)),
                None => thread_lines.push((line, vec![(t as f64, r.ops_per_sec)])),
            }
        }
    };
    add_thread_points("loopback", &lo_all);
    let mut references = Vec::new();
    let mut comparisons = Vec::new();
    let run = format!("bt{}", std::process::id() % 1_000_000);
    crate::testbed::down_on_signal(run.clone(), a.run_dir.clone())?;
    for (name, bits, delay_us) in &paths {
        println!("testbed at {name}: the same, h0 → h1 …");
        let plan = Plan::new(
            &run,
            2,
            LinkSpec {
                rate_bits_per_s: Some(*bits),
                delay_us: *delay_us,
                ..LinkSpec::default()
            },
        )?;
        let tb = Testbed::up(plan, &a.run_dir, Duration::ZERO)?;
        let server = SocketAddr::V4(SocketAddrV4::new(tb.plan.host_addr(1), SERVER_PORT));
        let sp = SocketAddr::V4(SocketAddrV4::new(tb.plan.host_addr(1), SOCKPERF_PORT));
        let on_h1 = |p: &str| tb.command(1, p);
        let on_h0 = |p: &str| tb.command(0, p);
        // Measured before `?`: the testbed comes down whatever happened.
        let result = measure(&on_h1, &on_h0, server, sp, seconds, &thread_points);
        let down = Testbed::down(&run, &a.run_dir);
        let tb_all = result?;
        down?;
        let (tbd, tb_rtt) = (&tb_all.reads, &tb_all.rtt);
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
        reads.points.push(point(&label, tbd));
        rtts.points.push(rtt_point(&label, tb_rtt));
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
        add_thread_points(&label, &tb_all);
        for ((&(t, d), r), l) in thread_points
            .iter()
            .zip(&tb_all.threads)
            .zip(&lo_all.threads)
        {
            println!(
                "  threads experiment, {t} threads × {d}: testbed {:.0} vs loopback {:.0} ops/s ({:.2})",
                r.ops_per_sec,
                l.ops_per_sec,
                r.ops_per_sec / l.ops_per_sec
            );
            comparisons.push(Comparison::new(
                format!("{label} ÷ loopback, threads experiment, {t} threads × {d}"),
                r.ops_per_sec,
                l.ops_per_sec,
                "ops/s",
                "loopback",
            ));
        }
    }
    let config = serde_json::json!({
        "seconds": seconds,
        "read_bytes": READ_BYTES,
        "threads": THREADS,
        "depth": DEPTH,
        "region_bytes": REGION_BYTES,
        "link_rates_bits_per_s": rates.iter().map(|(_, b)| *b).collect::<Vec<_>>(),
        "delay_us_per_link": delay_us,
        "delay_by": "user-space relay per host in the switch namespace (no netem here)",
        "testbed": "two hosts in network namespaces, veth pairs to a bridge, tbf both ways",
        "sockperf": lo_all.sockperf_command,
        "threads_experiment": {
            "threads": a.threads,
            "depths": [1, DEPTH],
            "seconds_per_point": seconds * THREADS_POINT_SHARE,
        },
        "quick": a.quick,
    });
    let fig = figure(&reads, &rtts, &references, thread_lines);
    let mut series = vec![reads, rtts];
    series.extend(thread_series);
    let mut result = BenchResult::new("testbed", started, config, series);
    result.references = references;
    result.comparisons = comparisons;
    for path in camelot_results::output::write_result_with_figure(&a.out, &result, &fig)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The paths are names, not numbers, so the reads and round trips are bars by path (the
/// link rates beside the reads); the threads experiment keeps its numeric axis.
fn figure(
    reads: &Series,
    rtts: &Series,
    references: &[Reference],
    thread_lines: Vec<(String, Vec<(f64, f64)>)>,
) -> Figure {
    let names = |s: &Series| -> Vec<String> {
        s.points
            .iter()
            .map(|p| match &p.x {
                X::Label(l) => l.clone(),
                X::Num(n) => n.to_string(),
            })
            .collect()
    };
    let indexed = |s: &Series, f: &dyn Fn(&Point) -> Option<f64>| -> Vec<(f64, f64)> {
        s.points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((i as f64, f(p)?)))
            .collect()
    };
    let mut read_panel = Panel::new("4 KiB batched reads", "path", "GB/s")
        .bars(names(reads))
        .line(
            "camelot",
            indexed(reads, &|p| p.bytes_per_sec.map(|b| b / 1e9)),
        );
    for r in references {
        read_panel = read_panel.reference(&r.label, r.value / 1e9);
    }
    let rtt_panel = Panel::new("TCP round trip (sockperf, 64 B)", "path", "µs")
        .bars(names(rtts))
        .line(
            "p50",
            indexed(rtts, &|p| p.latency_us.as_ref().map(|l| l.p50)),
        )
        .line(
            "p99",
            indexed(rtts, &|p| p.latency_us.as_ref().map(|l| l.p99)),
        );
    let mut threads_panel =
        Panel::new("threads experiment, 4 KiB reads", "client threads", "ops/s").log_y();
    for (label, points) in &thread_lines {
        threads_panel = threads_panel.line(label, points.clone());
    }
    Figure::new("testbed: emulated network vs loopback")
        .panel(read_panel)
        .panel(rtt_panel)
        .panel(threads_panel)
}
