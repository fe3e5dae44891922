//! `camelot bench middlebox cas` (issue 20, seed 002's cas_vs_swap): one shared word,
//! 1…64 clients each incrementing it with CAS, straight to a `camelot server` process and
//! through a `camelot proxy` process with `--conn-map 1 --cas-to-write`; successful
//! increments per second for both, and the proxy's requests per proxy CPU-second. Then
//! the same with batching (the "≥ 1 M with batching"): each client CASes
//! `batch_words` shared words in one frame per round, direct and through the proxy.

use crate::BenchError;
use camelot_client::{AccessMode, Client, ClientConfig, ClusterMap, Region};
use camelot_results::output;
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series};
use camelot_testkit::process::{Program, Readiness, ServerProcess};
use camelot_testkit::{CamelotServer, CamelotServerOptions};
use serde_json::json;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Most clients a run may ask for (each is a thread and a connection).
pub const CLIENTS_MAX: usize = 256;
/// The seed's ceiling: CAS→WRITE operations per middlebox core per second.
pub const SEED_PROXY_OPS_PER_CORE_S: f64 = 2.8e6;
/// The floor for CAS→WRITE ÷ CAS direct at 32 clients.
pub const CAS_TO_WRITE_RATIO_TARGET: f64 = 5.0;
/// The goal for proxy operations per proxy CPU-second, with batching.
pub const PROXY_OPS_PER_CPU_S_GOAL: f64 = 1e6;
/// Most shared words one batched round may CAS (8 bytes each, in one 4 KiB region).
pub const BATCH_WORDS_MAX: usize = 512;

#[derive(Debug, Clone)]
pub struct CasConfig {
    pub clients: Vec<usize>,
    pub seconds_per_point: f64,
    pub quick: bool,
    /// Shared words each client CASes in one frame per round in the batched point (0:
    /// no batched point).
    pub batch_words: usize,
    /// Clients of the batched point.
    pub batch_clients: usize,
}

impl CasConfig {
    pub fn defaults(quick: bool) -> CasConfig {
        CasConfig {
            clients: if quick {
                vec![1, 8, 32, 64]
            } else {
                vec![1, 2, 4, 8, 16, 32, 64]
            },
            seconds_per_point: if quick { 1.0 } else { 5.0 },
            quick,
            batch_words: 32,
            batch_clients: 32,
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        if self.clients.is_empty() || self.clients.iter().any(|&c| c == 0 || c > CLIENTS_MAX) {
            return Err(BenchError::InvalidConfig(format!(
                "clients are 1 to {CLIENTS_MAX}"
            )));
        }
        if self.batch_words > BATCH_WORDS_MAX
            || (self.batch_words > 0 && !(1..=CLIENTS_MAX).contains(&self.batch_clients))
        {
            return Err(BenchError::InvalidConfig(format!(
                "a batch is 0 to {BATCH_WORDS_MAX} words, for 1 to {CLIENTS_MAX} clients"
            )));
        }
        if !(self.seconds_per_point.is_finite()
            && self.seconds_per_point > 0.0
            && self.seconds_per_point <= 3600.0)
        {
            return Err(BenchError::InvalidConfig(
                "seconds per point: above 0, at most an hour".into(),
            ));
        }
        Ok(())
    }
}

struct Measured {
    increments_per_s: f64,
    attempts: u64,
    increments: u64,
}

/// Runs `clients` threads, each with its own connection, for `seconds`. Each calls
/// `work(index, client, stop, start)`, which sets up, waits on `start`, runs until
/// `stop`, and returns its (CAS attempts, wins).
fn run_clients<F>(
    map: &ClusterMap,
    clients: usize,
    seconds: f64,
    work: F,
) -> Result<Measured, BenchError>
where
    F: Fn(usize, Client, &AtomicBool, &Barrier) -> Result<(u64, u64), String>
        + Send
        + Sync
        + 'static,
{
    let config = ClientConfig {
        connections_per_node: 1,
        ..ClientConfig::default()
    };
    let conns: Vec<Client> = (0..clients)
        .map(|_| Client::connect(map.clone(), config.clone()))
        .collect::<Result<_, _>>()
        .map_err(|e| BenchError::Setup(format!("connect: {e}")))?;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(clients + 1));
    let work = Arc::new(work);
    let threads: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let (stop, start, work) = (stop.clone(), start.clone(), work.clone());
            std::thread::spawn(move || work(i, c, &stop, &start))
        })
        .collect();
    start.wait();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    let mut attempts = 0;
    let mut increments = 0;
    for th in threads {
        let (a, w) = th
            .join()
            .map_err(|_| BenchError::Setup("a client thread panicked".into()))?
            .map_err(BenchError::Setup)?;
        attempts += a;
        increments += w;
    }
    let elapsed = t.elapsed().as_secs_f64();
    Ok(Measured {
        increments_per_s: increments as f64 / elapsed,
        attempts,
        increments,
    })
}

/// `clients` threads incrementing word 0 by CAS: read once, then CAS from the last value
/// seen (a failed CAS returns the current value, so a retry needs no read).
fn hammer(
    map: &ClusterMap,
    region: &Region,
    clients: usize,
    seconds: f64,
) -> Result<Measured, BenchError> {
    let region = region.clone();
    run_clients(map, clients, seconds, move |_, c, stop, start| {
        let b = c.read(&region, 0, 8).map_err(|e| e.to_string())?;
        let mut cur = words_in(&b).next().ok_or("a short read of the word")?;
        start.wait();
        let (mut attempts, mut wins) = (0u64, 0u64);
        while !stop.load(Ordering::Relaxed) {
            let before = c.cas(&region, 0, cur, cur + 1).map_err(|e| e.to_string())?;
            attempts += 1;
            if before == cur {
                wins += 1;
                cur += 1;
            } else {
                cur = before;
            }
        }
        Ok((attempts, wins))
    })
}

/// Whose words a batched client CASes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sharing {
    /// Words 0..`words`, the same for every client: contended, so most CASes fail, and
    /// the proxy answers those itself from the value it knows.
    Shared,
    /// A block of `words` words per client: every CAS wins, and the proxy turns each into
    /// a WRITE upstream.
    Own,
}

impl Sharing {
    fn label(self) -> &'static str {
        match self {
            Sharing::Shared => "shared",
            Sharing::Own => "own",
        }
    }
}

/// `clients` threads incrementing `words` words of `region` (`Sharing::Own`: words of
/// its own): every round sends one CAS per word (from the last value seen there) in one
/// batch and waits for all of them.
fn hammer_batched(
    map: &ClusterMap,
    region: &Region,
    clients: usize,
    words: usize,
    sharing: Sharing,
    seconds: f64,
) -> Result<Measured, BenchError> {
    let region = region.clone();
    run_clients(map, clients, seconds, move |client, c, stop, start| {
        let base = match sharing {
            Sharing::Shared => 0,
            Sharing::Own => (client * words * 8) as u64,
        };
        let b = c
            .read(&region, base, (words * 8) as u32)
            .map_err(|e| e.to_string())?;
        let mut cur: Vec<u64> = words_in(&b).collect();
        start.wait();
        let (mut attempts, mut wins) = (0u64, 0u64);
        while !stop.load(Ordering::Relaxed) {
            let ops = cur
                .iter()
                .enumerate()
                .map(|(i, &v)| (region.node, region.cas_op(base + i as u64 * 8, v, v + 1)));
            let pendings = c.submit_many(ops).map_err(|e| e.to_string())?;
            for (slot, pending) in cur.iter_mut().zip(pendings) {
                let before =
                    camelot_client::reply::word(pending.wait()).map_err(|e| e.to_string())?;
                attempts += 1;
                if before == *slot {
                    wins += 1;
                    *slot += 1;
                } else {
                    *slot = before;
                }
            }
        }
        Ok((attempts, wins))
    })
}

/// The little-endian 8-byte words in `bytes` (a short tail is left out).
fn words_in(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
}

/// One side of a point, as `cas_side` measured it.
struct Side {
    measured: Measured,
    server_cpu_s: f64,
    /// The proxy's CPU seconds and its CAS counters' growth (`proxy_cas_counts`).
    proxy: Option<(f64, [u64; 3])>,
}

/// One side of a point: a fresh region of at least `words` words, `hammer` run on it
/// while the server's (and the proxy's) CPU seconds and CAS counters are read, the words
/// checked against the increments counted, the region freed. A fresh region for every
/// side: the proxy vouches only for words whose every write it has seen, so words the
/// direct side moved must never reach it.
fn cas_side(
    admin: &Client,
    server: &CamelotServer,
    proxy: Option<(&ServerProcess, &ClusterMap)>,
    words: usize,
    name: &str,
    hammer: impl FnOnce(&Region) -> Result<Measured, BenchError>,
) -> Result<Side, BenchError> {
    let region = admin
        .alloc_with((words as u64 * 8).max(4096), None, AccessMode::Shared)
        .map_err(|e| BenchError::Setup(format!("alloc: {e}")))?;
    let counts_before = proxy.map(|(_, c)| proxy_cas_counts(c)).transpose()?;
    let (measured, server_cpu_s, proxy_cpu_s) =
        cpu_during(server, proxy.map(|(p, _)| p), || hammer(&region))?;
    let counts_after = proxy.map(|(_, c)| proxy_cas_counts(c)).transpose()?;
    // Every increment counted through the proxy was a CAS it answered after its WRITE
    // was done.
    check_words(admin, &region, words, measured.increments, name)?;
    let _ = admin.free(&region);
    let proxy = counts_before
        .zip(counts_after)
        .map(|(b, a)| (proxy_cpu_s, [0, 1, 2].map(|i| a[i].saturating_sub(b[i]))));
    Ok(Side {
        measured,
        server_cpu_s,
        proxy,
    })
}

impl Side {
    /// Its point at `clients`, and (through the proxy) the CAS the proxy answered per
    /// proxy CPU-second (NaN when no CPU time was seen).
    fn point(&self, clients: usize) -> (Point, f64) {
        let m = &self.measured;
        let mut pt = Point::new(clients);
        pt.ops_per_sec = Some(m.increments_per_s);
        pt.extra.insert("cas_attempts".into(), json!(m.attempts));
        pt.extra.insert("increments".into(), json!(m.increments));
        pt.extra
            .insert("server_cpu_s".into(), json!(self.server_cpu_s));
        let mut ops_per_cpu_s = f64::NAN;
        if let Some((cpu, counts)) = self.proxy {
            if cpu > 0.0 {
                ops_per_cpu_s = m.attempts as f64 / cpu;
            }
            pt.extra.insert("proxy_cpu_s".into(), json!(cpu));
            pt.extra
                .insert("proxy_ops_per_cpu_s".into(), json!(ops_per_cpu_s));
            for (name, n) in [
                "proxy_cas_converted",
                "proxy_cas_failed_locally",
                "proxy_cas_forwarded",
            ]
            .into_iter()
            .zip(counts)
            {
                pt.extra.insert(name.into(), json!(n));
            }
        }
        (pt, ops_per_cpu_s)
    }
}

pub fn run_cas(cfg: &CasConfig, binary: &Path, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let server = CamelotServer::start(
        binary,
        &CamelotServerOptions {
            resp: false,
            args: vec!["--memory".into(), "64M".into()],
        },
    )?;
    let upstream = server.addr();
    let proxy_flags = ["--conn-map", "1", "--cas-to-write", "--threads", "1"];
    let proxy = ServerProcess::start(
        Program {
            program: binary.to_string_lossy().into_owned().into(),
            package: "camelot".into(),
        },
        "camelot-proxy",
        Readiness::Accepting,
        |port| {
            let mut args: Vec<OsString> = vec![
                "proxy".into(),
                "run".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}").into(),
                "--upstream".into(),
                upstream.to_string().into(),
            ];
            args.extend(proxy_flags.iter().map(OsString::from));
            args
        },
    )?;
    let direct = ClusterMap::from_addrs(&[upstream]);
    let via = ClusterMap::from_addrs(&[proxy.addr()]);
    let admin = Client::connect(direct.clone(), ClientConfig::default())
        .map_err(|e| BenchError::Setup(format!("connect: {e}")))?;
    let via_proxy = Some((&proxy, &via));
    let secs = cfg.seconds_per_point;

    let mut direct_series = Series::new("CAS direct");
    let mut proxy_series = Series::new("CAS→WRITE via proxy");
    let mut at_32 = (None, None);
    let mut best_proxy_ops_per_cpu_s: f64 = 0.0;
    for &n in &cfg.clients {
        let d = cas_side(&admin, &server, None, 1, "direct", |r| {
            hammer(&direct, r, n, secs)
        })?;
        let p = cas_side(&admin, &server, via_proxy, 1, "proxy", |r| {
            hammer(&via, r, n, secs)
        })?;
        let (dp, _) = d.point(n);
        let (pp, ops_per_cpu_s) = p.point(n);
        direct_series.points.push(dp);
        proxy_series.points.push(pp);
        if ops_per_cpu_s.is_finite() {
            best_proxy_ops_per_cpu_s = best_proxy_ops_per_cpu_s.max(ops_per_cpu_s);
        }
        let (d, p) = (d.measured.increments_per_s, p.measured.increments_per_s);
        eprintln!(
            "{n:>3} clients: direct {d:>9.0} incr/s, via proxy {p:>9.0} incr/s ({:.2}×), proxy {ops_per_cpu_s:.0} ops/CPU-s",
            p / d,
        );
        if n == 32 {
            at_32 = (Some(d), Some(p));
        }
    }
    // The batched points: the same two sides, each client CASing `batch_words` words in
    // one frame per round; first words every client shares, then words of its own.
    let mut batched_series = Vec::new();
    let mut batched = Vec::new();
    if cfg.batch_words > 0 {
        let (n, w) = (cfg.batch_clients, cfg.batch_words);
        for sharing in [Sharing::Shared, Sharing::Own] {
            let total_words = match sharing {
                Sharing::Shared => w,
                Sharing::Own => w * n,
            };
            let d = cas_side(&admin, &server, None, total_words, "direct, batched", |r| {
                hammer_batched(&direct, r, n, w, sharing, secs)
            })?;
            let p = cas_side(
                &admin,
                &server,
                via_proxy,
                total_words,
                "proxy, batched",
                |r| hammer_batched(&via, r, n, w, sharing, secs),
            )?;
            let how = format!("{w} {} words per frame", sharing.label());
            let (dp, _) = d.point(n);
            let (pp, ops_per_cpu_s) = p.point(n);
            let (d, p) = (d.measured.increments_per_s, p.measured.increments_per_s);
            eprintln!(
                "{n:>3} clients × {how}: direct {d:>9.0} incr/s, via proxy {p:>9.0} incr/s ({:.2}×), proxy {ops_per_cpu_s:.0} ops/CPU-s",
                p / d,
            );
            let mut ds = Series::new(format!("CAS direct, {how}"));
            ds.points.push(dp);
            let mut ps = Series::new(format!("CAS→WRITE via proxy, {how}"));
            ps.points.push(pp);
            batched_series.extend([ds, ps]);
            batched.push((how, n, d, p, ops_per_cpu_s));
        }
    }
    let config = json!({
        "x": "clients",
        "clients": cfg.clients,
        "batch_words": cfg.batch_words,
        "batch_clients": cfg.batch_clients,
        "batched_workload": "each client: one frame per round with a CAS(last seen, last seen + 1) on each of batch_words words, then waits for all answers; 'shared': the same words for every client, 'own': a block of words per client",
        "seconds_per_point": cfg.seconds_per_point,
        "quick": cfg.quick,
        "workload": "one shared 8-byte word; each client: CAS(last seen, last seen + 1), a failed CAS's answer is the next guess",
        "figure": "successful increments per second",
        "server": "camelot server --memory 64M (a process)",
        "proxy": format!("camelot proxy run {}", proxy_flags.join(" ")),
        "client": "camelot-client, one connection per client thread",
        "proxy_ops": "every CAS the proxy answered, per CPU-second of the proxy process",
        "cpu": "server_cpu_s per point: CPU seconds of the server process over that side; proxy_cpu_s the same of the proxy",
    });
    let mut result = BenchResult::new(
        "middlebox-cas",
        started,
        config,
        [vec![direct_series, proxy_series], batched_series].concat(),
    );
    result.references.push(Reference {
        label: "seed 002: 2.8 M ops/s per middlebox core".into(),
        metric: "proxy_ops_per_cpu_s".into(),
        value: SEED_PROXY_OPS_PER_CORE_S,
    });
    if let (Some(d), Some(p)) = at_32 {
        result.comparisons.push(
            Comparison::new(
                "CAS→WRITE via proxy ÷ CAS direct, 32 clients, one word",
                p,
                d,
                "increments/s",
                "CAS direct (same run)",
            )
            .with_target(CAS_TO_WRITE_RATIO_TARGET, false),
        );
    }
    if best_proxy_ops_per_cpu_s > 0.0 {
        result.comparisons.push(Comparison::new(
            "proxy CAS answered per proxy CPU-second (best point)",
            best_proxy_ops_per_cpu_s,
            SEED_PROXY_OPS_PER_CORE_S,
            "ops/CPU-s",
            "seed 002's middlebox (per core)",
        ));
    }
    for (how, n, d, p, ops_per_cpu_s) in batched {
        result.comparisons.push(Comparison::new(
            format!("CAS→WRITE via proxy ÷ CAS direct, {n} clients × {how}"),
            p,
            d,
            "increments/s",
            "CAS direct, batched the same way (same run)",
        ));
        if ops_per_cpu_s.is_finite() {
            // The goal, 1 M, as a share of the seed's figure it is reported beside.
            result.comparisons.push(
                Comparison::new(
                    format!(
                        "proxy CAS answered per proxy CPU-second, {n} clients × {how} (goal 1 M)"
                    ),
                    ops_per_cpu_s,
                    SEED_PROXY_OPS_PER_CORE_S,
                    "ops/CPU-s",
                    "seed 002's middlebox (per core)",
                )
                .with_target(PROXY_OPS_PER_CPU_S_GOAL / SEED_PROXY_OPS_PER_CORE_S, false),
            );
        }
    }
    Ok(vec![output::write_result(out, &result)?])
}

/// What `f` returns, and the CPU seconds the server process and the proxy process (0
/// without one) used meanwhile.
fn cpu_during<T>(
    server: &CamelotServer,
    proxy: Option<&ServerProcess>,
    f: impl FnOnce() -> Result<T, BenchError>,
) -> Result<(T, f64, f64), BenchError> {
    let s0 = server.process().cpu_seconds()?;
    let p0 = proxy.map(ServerProcess::cpu_seconds).transpose()?;
    let out = f()?;
    let server_cpu = server.process().cpu_seconds()? - s0;
    let proxy_cpu = match (proxy, p0) {
        (Some(p), Some(p0)) => p.cpu_seconds()? - p0,
        _ => 0.0,
    };
    Ok((out, server_cpu, proxy_cpu))
}

/// Words read per request when checking the batched points' totals.
const CHECK_READ_WORDS: usize = 8192;

/// The proxy's CAS counters: converted to WRITEs, failed from the value it knew,
/// forwarded as CAS. A connection of its own, closed at once, so none is held open
/// beside the measured clients.
fn proxy_cas_counts(proxy: &ClusterMap) -> Result<[u64; 3], BenchError> {
    let stats = Client::connect(proxy.clone(), ClientConfig::default())
        .map_err(|e| BenchError::Setup(format!("connect to the proxy: {e}")))?
        .stats(0)
        .map_err(|e| BenchError::Setup(format!("proxy stats: {e}")))?;
    let get = |name: &str| {
        stats
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
            .ok_or_else(|| BenchError::Setup(format!("the proxy's stats lack {name}")))
    };
    Ok([
        get("proxy_cas_converted")?,
        get("proxy_cas_failed_locally")?,
        get("proxy_cas_forwarded")?,
    ])
}

/// Fails unless words 0..`words` of `region` sum to `increments`: every increment a
/// client counted is on the server, and nothing else is.
fn check_words(
    admin: &Client,
    region: &Region,
    words: usize,
    increments: u64,
    side: &str,
) -> Result<(), BenchError> {
    let mut moved = 0u64;
    for first in (0..words).step_by(CHECK_READ_WORDS) {
        let n = CHECK_READ_WORDS.min(words - first);
        let bytes = admin
            .read(region, (first * 8) as u64, (n * 8) as u32)
            .map_err(|e| BenchError::Setup(format!("read the words: {e}")))?;
        moved += words_in(&bytes).sum::<u64>();
    }
    if moved != increments {
        return Err(BenchError::Check(format!(
            "{side}: {increments} increments counted, the words moved {moved}"
        )));
    }
    Ok(())
}

// ---- Clover YCSB load, direct and through the proxy: the bandwidth and tail benches ----

/// Keys of the Clover load (zipf 0.99 over them).
pub const CLOVER_KEYS_MAX: u64 = 1 << 20;
/// The ceiling for pass-through p50 ÷ direct p50.
pub const PASS_THROUGH_P50_RATIO_TARGET: f64 = 1.3;
/// The floor for the cut in bytes per operation (YCSB-A zipf) with the proxy.
pub const BANDWIDTH_CUT_TARGET: f64 = 0.5;
const CLOVER_VALUE_BYTES: u32 = 64;
const LATENCY_US_MAX: u64 = 60_000_000;

#[derive(Debug, Clone)]
pub struct CloverLoadConfig {
    pub clients: usize,
    pub keys: u64,
    /// Share of operations that are writes (YCSB-A: 0.5).
    pub write_fraction: f64,
    pub seconds_per_side: f64,
    pub quick: bool,
}

impl CloverLoadConfig {
    pub fn bandwidth(quick: bool) -> CloverLoadConfig {
        CloverLoadConfig {
            clients: if quick { 16 } else { 32 },
            keys: if quick { 1000 } else { 10_000 },
            write_fraction: 0.5,
            seconds_per_side: if quick { 2.0 } else { 10.0 },
            quick,
        }
    }

    pub fn tail(quick: bool) -> CloverLoadConfig {
        CloverLoadConfig {
            clients: 64,
            ..CloverLoadConfig::bandwidth(quick)
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        if self.clients == 0 || self.clients > CLIENTS_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "clients are 1 to {CLIENTS_MAX}"
            )));
        }
        if self.keys < 2 || self.keys > CLOVER_KEYS_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "keys are 2 to {CLOVER_KEYS_MAX}"
            )));
        }
        if !(0.0..=1.0).contains(&self.write_fraction) {
            return Err(BenchError::InvalidConfig(
                "the write fraction is 0 to 1".into(),
            ));
        }
        if !(self.seconds_per_side.is_finite()
            && self.seconds_per_side > 0.0
            && self.seconds_per_side <= 3600.0)
        {
            return Err(BenchError::InvalidConfig(
                "seconds per side: above 0, at most an hour".into(),
            ));
        }
        Ok(())
    }
}

/// One side's run of the Clover load.
struct CloverSide {
    ops: u64,
    reads: hdrhistogram::Histogram<u64>,
    writes: hdrhistogram::Histogram<u64>,
    elapsed_s: f64,
}

fn summary(h: &hdrhistogram::Histogram<u64>) -> camelot_results::schema::LatencySummary {
    camelot_results::schema::LatencySummary {
        p50: h.value_at_quantile(0.5) as f64,
        p90: h.value_at_quantile(0.9) as f64,
        p99: h.value_at_quantile(0.99) as f64,
        p999: h.value_at_quantile(0.999) as f64,
        max: h.max() as f64,
    }
}

fn new_histogram() -> Result<hdrhistogram::Histogram<u64>, BenchError> {
    hdrhistogram::Histogram::new_with_bounds(1, LATENCY_US_MAX, 3)
        .map_err(|e| BenchError::Setup(format!("histogram: {e}")))
}

/// A fresh Clover store (its own metadata service and regions) reached through `map`,
/// loaded by `cfg.clients` threads for `cfg.seconds_per_side`: YCSB-style reads and
/// writes, keys zipf 0.99. Every key is written once before the clock starts, so every
/// timed read finds a value; a read that finds none is an error.
fn clover_side(map: &ClusterMap, cfg: &CloverLoadConfig) -> Result<CloverSide, BenchError> {
    clover_side_with(map, cfg, &mut || Ok(()))
}

/// As [`clover_side`], calling `after_preload` once the keys are written and before the
/// load threads connect (counters read there leave the preload out).
fn clover_side_with(
    map: &ClusterMap,
    cfg: &CloverLoadConfig,
    after_preload: &mut dyn FnMut() -> Result<(), BenchError>,
) -> Result<CloverSide, BenchError> {
    use camelot_clover::{Geometry, Meta, MetaConfig, RegionMemory, Store, StoreConfig};
    use rand::{Rng, SeedableRng};
    let setup = |what: &str, e: String| BenchError::Setup(format!("clover {what}: {e}"));
    let config = ClientConfig {
        connections_per_node: 1,
        ..ClientConfig::default()
    };
    let connect = || {
        Client::connect(map.clone(), config.clone()).map_err(|e| setup("connect", e.to_string()))
    };
    let geometry =
        Geometry::new(CLOVER_VALUE_BYTES, 256).map_err(|e| setup("geometry", e.to_string()))?;
    let mem = RegionMemory::new(connect()?, geometry);
    let meta = Arc::new(
        Meta::new(
            mem.clone(),
            MetaConfig {
                blocks_max: 1024,
                keys_max: cfg.keys as usize + 16,
                versions_kept: 2,
                ..MetaConfig::default()
            },
        )
        .map_err(|e| setup("meta", e.to_string()))?,
    );
    let value = bytes::Bytes::from(vec![0xA5u8; CLOVER_VALUE_BYTES as usize]);
    {
        let mut store = Store::new(meta.clone(), mem.clone(), StoreConfig::default());
        for k in 0..cfg.keys {
            store
                .put(&k.to_le_bytes(), value.clone())
                .map_err(|e| setup("preload", e.to_string()))?;
            if k % 64 == 63 {
                meta.gc().map_err(|e| setup("gc", e.to_string()))?;
            }
        }
    }
    after_preload()?;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(cfg.clients + 2));
    let collector = {
        let (meta, stop, start) = (meta.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || -> Result<(), String> {
            start.wait();
            while !stop.load(Ordering::Relaxed) {
                meta.gc().map_err(|e| e.to_string())?;
                // Pacing, not synchronisation: collection keeps up with writers.
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok(())
        })
    };
    let mut threads = Vec::with_capacity(cfg.clients);
    for c in 0..cfg.clients {
        let mem = mem.with_client(connect()?);
        let (meta, stop, start, value) = (meta.clone(), stop.clone(), start.clone(), value.clone());
        let (keys, write_fraction) = (cfg.keys, cfg.write_fraction);
        let mut reads = new_histogram()?;
        let mut writes = new_histogram()?;
        threads.push(std::thread::spawn(move || -> Result<_, String> {
            let mut store = Store::new(meta, mem, StoreConfig::default());
            let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5EED ^ c as u64);
            let mut zipf = crate::ycsb::generators::Zipfian::new(0, keys);
            let mut ops = 0u64;
            start.wait();
            while !stop.load(Ordering::Relaxed) {
                let key = zipf.next(rng.gen::<f64>()).to_le_bytes();
                let t = Instant::now();
                if rng.gen::<f64>() < write_fraction {
                    store.put(&key, value.clone()).map_err(|e| e.to_string())?;
                    let _ = writes.record((t.elapsed().as_micros() as u64).max(1));
                } else {
                    let got = store.get(&key).map_err(|e| e.to_string())?;
                    if got.as_deref() != Some(&value[..]) {
                        return Err(format!("read of a preloaded key found {got:?}"));
                    }
                    let _ = reads.record((t.elapsed().as_micros() as u64).max(1));
                }
                ops += 1;
            }
            Ok((ops, reads, writes))
        }));
    }
    start.wait();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(cfg.seconds_per_side));
    stop.store(true, Ordering::Relaxed);
    let mut side = CloverSide {
        ops: 0,
        reads: new_histogram()?,
        writes: new_histogram()?,
        elapsed_s: 0.0,
    };
    let mut failure = None;
    for th in threads {
        match th.join() {
            Ok(Ok((ops, r, w))) => {
                side.ops += ops;
                let _ = side.reads.add(&r);
                let _ = side.writes.add(&w);
            }
            Ok(Err(e)) => failure = Some(e),
            Err(_) => failure = Some("a client thread panicked".into()),
        }
    }
    side.elapsed_s = t.elapsed().as_secs_f64();
    match collector.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => failure = Some(format!("gc: {e}")),
        Err(_) => failure = Some("the collector panicked".into()),
    }
    if let Some(e) = failure {
        return Err(BenchError::Check(format!("clover load: {e}")));
    }
    Ok(side)
}

/// Grouped bars for a result whose x values are labels (the report draws numeric x
/// only): one category per distinct x, in order of first appearance, one bar group per
/// series, `value` of each point.
fn bars_figure(
    result: &BenchResult,
    title: &str,
    y_label: &str,
    value: impl Fn(&Point) -> Option<f64>,
) -> camelot_results::plot::Figure {
    use camelot_results::plot::{Figure, Panel};
    use camelot_results::schema::X;
    let label = |x: &X| match x {
        X::Label(l) => l.clone(),
        X::Num(n) => n.to_string(),
    };
    let mut categories: Vec<String> = Vec::new();
    for p in result.series.iter().flat_map(|s| &s.points) {
        let l = label(&p.x);
        if !categories.contains(&l) {
            categories.push(l);
        }
    }
    let mut panel = Panel::new(title, "", y_label).bars(categories.clone());
    for s in &result.series {
        let points: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter_map(|p| {
                let i = categories.iter().position(|c| *c == label(&p.x))?;
                Some((i as f64, value(p)?))
            })
            .collect();
        panel = panel.line(&s.label, points);
    }
    Figure::new(&result.bench).panel(panel)
}

fn start_proxy(
    binary: &Path,
    upstream: std::net::SocketAddr,
    flags: &[&str],
) -> Result<ServerProcess, BenchError> {
    let flags: Vec<OsString> = flags.iter().map(OsString::from).collect();
    Ok(ServerProcess::start(
        Program {
            program: binary.to_string_lossy().into_owned().into(),
            package: "camelot".into(),
        },
        "camelot-proxy",
        Readiness::Accepting,
        |port| {
            let mut args: Vec<OsString> = vec![
                "proxy".into(),
                "run".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}").into(),
                "--upstream".into(),
                upstream.to_string().into(),
            ];
            args.extend(flags.iter().cloned());
            args
        },
    )?)
}

fn start_clover_server(binary: &Path) -> Result<CamelotServer, BenchError> {
    Ok(CamelotServer::start(
        binary,
        &CamelotServerOptions {
            resp: false,
            args: vec!["--memory".into(), "512M".into()],
        },
    )?)
}

fn stat_of(stats: &[(String, u64)], name: &str) -> Result<u64, BenchError> {
    stats
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
        .ok_or_else(|| BenchError::Check(format!("STATS has no {name}")))
}

fn stats(client: &Client) -> Result<Vec<(String, u64)>, BenchError> {
    client
        .stats(0)
        .map_err(|e| BenchError::Setup(format!("stats: {e}")))
}

/// Every technique the proxy has, for the "with the proxy" side.
pub const PROXY_ALL_FLAGS: [&str; 6] = [
    "--conn-map",
    "4",
    "--cas-to-write",
    "--read-cache",
    "--write-cache",
    "--threads=1",
];

fn load_config_json(cfg: &CloverLoadConfig) -> serde_json::Value {
    json!({
        "clients": cfg.clients,
        "keys": cfg.keys,
        "key_distribution": "zipf 0.99 (YCSB's zipfian)",
        "write_fraction": cfg.write_fraction,
        "value_bytes": CLOVER_VALUE_BYTES,
        "seconds_per_side": cfg.seconds_per_side,
        "quick": cfg.quick,
        "store": "camelot-clover, a fresh metadata service and regions per side, gc every 2 ms",
        "server": "camelot server --memory 512M (a process)",
        "client": "camelot-client, one connection per client thread",
    })
}

/// `camelot bench middlebox bandwidth`: bytes on the wire per operation, each way, for
/// Clover direct and through a proxy with every technique; the server's own counters
/// give the upstream side, the proxy's the client side.
pub fn run_bandwidth(
    cfg: &CloverLoadConfig,
    binary: &Path,
    out: &Path,
) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let server = start_clover_server(binary)?;
    let upstream = server.addr();
    let direct = ClusterMap::from_addrs(&[upstream]);
    let admin = Client::connect(direct.clone(), ClientConfig::default())
        .map_err(|e| BenchError::Setup(format!("connect: {e}")))?;
    let proxy = start_proxy(binary, upstream, &PROXY_ALL_FLAGS)?;
    let proxy_admin = Client::connect(
        ClusterMap::from_addrs(&[proxy.addr()]),
        ClientConfig::default(),
    )
    .map_err(|e| BenchError::Setup(format!("connect to the proxy: {e}")))?;

    // Counters are read after each side's preload and after its timed run: the bytes
    // are the timed operations' only (plus the load threads' handshakes and the STATS
    // reads, a few hundred bytes).
    let delta = |a: &[(String, u64)], b: &[(String, u64)], n: &str| -> Result<f64, BenchError> {
        Ok(stat_of(b, n)?.saturating_sub(stat_of(a, n)?) as f64)
    };
    let mut s0 = Vec::new();
    let d = clover_side_with(&direct, cfg, &mut || {
        s0 = stats(&admin)?;
        Ok(())
    })?;
    let s1 = stats(&admin)?;
    let (mut p0, mut s1p) = (Vec::new(), Vec::new());
    let p = clover_side_with(&ClusterMap::from_addrs(&[proxy.addr()]), cfg, &mut || {
        s1p = stats(&admin)?;
        p0 = stats(&proxy_admin)?;
        Ok(())
    })?;
    let p1 = stats(&proxy_admin)?;
    let s2 = stats(&admin)?;
    let p_upstream_up = delta(&p0, &p1, "proxy_bytes_to_upstream")? / p.ops as f64;
    let p_upstream_down = delta(&p0, &p1, "proxy_bytes_from_upstream")? / p.ops as f64;

    let d_up = delta(&s0, &s1, "bytes_in")? / d.ops as f64;
    let d_down = delta(&s0, &s1, "bytes_out")? / d.ops as f64;
    let p_client_up = delta(&p0, &p1, "proxy_bytes_from_clients")? / p.ops as f64;
    let p_client_down = delta(&p0, &p1, "proxy_bytes_to_clients")? / p.ops as f64;
    let p_server_up = delta(&s1p, &s2, "bytes_in")? / p.ops as f64;
    let p_server_down = delta(&s1p, &s2, "bytes_out")? / p.ops as f64;
    // Requests per frame the server received: how much the proxy's lanes coalesce.
    let requests_per_frame = |a: &[(String, u64)], b: &[(String, u64)]| -> f64 {
        let ops: u64 = b
            .iter()
            .filter(|(n, _)| n.starts_with("ops_"))
            .map(|(n, v)| v.saturating_sub(stat_of(a, n).unwrap_or(0)))
            .sum();
        let frames = stat_of(b, "batches")
            .unwrap_or(0)
            .saturating_sub(stat_of(a, "batches").unwrap_or(0));
        ops as f64 / frames.max(1) as f64
    };
    let d_per_frame = requests_per_frame(&s0, &s1);
    let p_per_frame = requests_per_frame(&s1p, &s2);
    eprintln!(
        "direct: {} ops, {:.0} B/op to server, {:.0} B/op back",
        d.ops, d_up, d_down
    );
    eprintln!(
        "proxy:  {} ops, client side {:.0} B/op up / {:.0} back; server side {:.0} B/op up / {:.0} back; proxy's upstream count {:.0} / {:.0}",
        p.ops, p_client_up, p_client_down, p_server_up, p_server_down, p_upstream_up, p_upstream_down
    );
    eprintln!(
        "requests per frame at the server: direct {d_per_frame:.2}, from the proxy {p_per_frame:.2}"
    );
    let point = |label: &str, up: f64, down: f64, ops: u64, elapsed: f64| {
        let mut pt = Point::new(label);
        pt.ops_per_sec = Some(ops as f64 / elapsed);
        pt.extra.insert("bytes_per_op_to_server".into(), json!(up));
        pt.extra
            .insert("bytes_per_op_from_server".into(), json!(down));
        pt.extra
            .insert("bytes_per_op_total".into(), json!(up + down));
        pt.extra.insert("ops".into(), json!(ops));
        pt
    };
    let mut direct_series = Series::new("Clover direct (client ↔ server)");
    let mut direct_point = point("direct", d_up, d_down, d.ops, d.elapsed_s);
    direct_point
        .extra
        .insert("server_requests_per_frame".into(), json!(d_per_frame));
    direct_series.points.push(direct_point);
    let mut server_side = Series::new("through the proxy: proxy ↔ server");
    let mut upstream = point(
        "proxy ↔ server",
        p_server_up,
        p_server_down,
        p.ops,
        p.elapsed_s,
    );
    upstream
        .extra
        .insert("server_requests_per_frame".into(), json!(p_per_frame));
    upstream.extra.insert(
        "proxy_counted_bytes_per_op_to_server".into(),
        json!(p_upstream_up),
    );
    upstream.extra.insert(
        "proxy_counted_bytes_per_op_from_server".into(),
        json!(p_upstream_down),
    );
    server_side.points.push(upstream);
    let mut client_side = Series::new("through the proxy: clients ↔ proxy");
    client_side.points.push(point(
        "clients ↔ proxy",
        p_client_up,
        p_client_down,
        p.ops,
        p.elapsed_s,
    ));
    let mut config = load_config_json(cfg);
    config["figure"] = json!(
        "bytes on the wire per operation, each way (frames as counted by the server and the proxy)"
    );
    config["proxy"] = json!(format!("camelot proxy run {}", PROXY_ALL_FLAGS.join(" ")));
    config["counted"] = json!("counters read after each side's preload and after its timed run, divided by timed operations (the load threads' handshakes and the STATS reads, a few hundred bytes, included); proxy_counted_* are the proxy's own count of its upstream requests and replies (frame headers excluded)");
    let mut result = BenchResult::new(
        "middlebox-bandwidth",
        started,
        config,
        vec![direct_series, server_side, client_side],
    );
    let (d_total, p_total) = (d_up + d_down, p_server_up + p_server_down);
    result.comparisons.push(
        Comparison::new(
            "bytes per operation at the server, proxy ÷ direct (YCSB-A zipf)",
            p_total,
            d_total,
            "bytes/op",
            "Clover direct (same run)",
        )
        .with_target(1.0 - BANDWIDTH_CUT_TARGET, true),
    );
    result.comparisons.push(Comparison::new(
        "bytes per operation, clients ↔ proxy ÷ direct",
        p_client_up + p_client_down,
        d_total,
        "bytes/op",
        "Clover direct (same run)",
    ));
    drop(proxy);
    drop(server);
    let figure = bars_figure(&result, "bytes per operation, both ways", "bytes/op", |p| {
        p.extra.get("bytes_per_op_total").and_then(|v| v.as_f64())
    });
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}

/// `camelot bench middlebox tail`: p50/p99 read and write latency of Clover, direct,
/// through a pass-through proxy, and through a proxy with every technique.
pub fn run_tail(
    cfg: &CloverLoadConfig,
    binary: &Path,
    out: &Path,
) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let server = start_clover_server(binary)?;
    let upstream = server.addr();
    let pass = start_proxy(binary, upstream, &["--threads=1"])?;
    let all = start_proxy(binary, upstream, &PROXY_ALL_FLAGS)?;
    let sides: [(&str, ClusterMap); 3] = [
        ("Clover direct", ClusterMap::from_addrs(&[upstream])),
        ("proxy pass-through", ClusterMap::from_addrs(&[pass.addr()])),
        (
            "proxy, every technique",
            ClusterMap::from_addrs(&[all.addr()]),
        ),
    ];
    let mut series = Vec::new();
    let mut p50 = Vec::new();
    for (label, map) in &sides {
        let side = clover_side(map, cfg)?;
        let (r, w) = (summary(&side.reads), summary(&side.writes));
        eprintln!(
            "{label:<24} {:>8.0} ops/s  read p50 {:>6.0} µs p99 {:>7.0} µs  write p50 {:>6.0} µs p99 {:>7.0} µs",
            side.ops as f64 / side.elapsed_s,
            r.p50,
            r.p99,
            w.p50,
            w.p99
        );
        let all_ops = {
            let mut h = side.reads.clone();
            let _ = h.add(&side.writes);
            summary(&h)
        };
        p50.push((r.p99, w.p99, all_ops.p50));
        let mut s = Series::new(*label);
        for (kind, sum, n) in [
            ("read", r, side.reads.len()),
            ("write", w, side.writes.len()),
        ] {
            let mut pt = Point::new(kind);
            pt.ops_per_sec = Some(side.ops as f64 / side.elapsed_s);
            pt.latency_us = Some(sum);
            pt.extra.insert("count".into(), json!(n));
            s.points.push(pt);
        }
        series.push(s);
    }
    let mut config = load_config_json(cfg);
    config["figure"] = json!("per-operation latency (µs) of reads and writes, 64 clients, zipf");
    config["proxies"] = json!([
        "camelot proxy run --threads=1",
        format!("camelot proxy run {}", PROXY_ALL_FLAGS.join(" ")),
    ]);
    let mut result = BenchResult::new("middlebox-tail", started, config, series);
    result.comparisons.push(
        Comparison::new(
            "p50 of all operations, proxy pass-through ÷ direct",
            p50[1].2,
            p50[0].2,
            "µs",
            "Clover direct (same run)",
        )
        .with_target(PASS_THROUGH_P50_RATIO_TARGET, true),
    );
    for (i, what) in [(0usize, "read"), (1, "write")] {
        let pick = |t: &(f64, f64, f64)| if i == 0 { t.0 } else { t.1 };
        result.comparisons.push(Comparison::new(
            format!("{what} p99, proxy with every technique ÷ direct"),
            pick(&p50[2]),
            pick(&p50[0]),
            "µs",
            "Clover direct (same run)",
        ));
    }
    drop(all);
    drop(pass);
    drop(server);
    let figure = bars_figure(&result, "p99 latency", "µs", |p| {
        p.latency_us.as_ref().map(|l| l.p99)
    });
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}

/// The bars of `bench middlebox full-system`: each technique alone (with the mapping it
/// needs; `+conn map` is mapping alone), then all. The baseline is Clover direct.
pub const FULL_SYSTEM_BARS: [(&str, &[&str]); 5] = [
    ("+read cache", &["--conn-map", "4", "--read-cache"]),
    ("+write cache", &["--conn-map", "4", "--write-cache"]),
    ("+conn map", &["--conn-map", "4"]),
    ("+CAS→write", &["--conn-map", "4", "--cas-to-write"]),
    (
        "all",
        &[
            "--conn-map",
            "4",
            "--read-cache",
            "--write-cache",
            "--cas-to-write",
        ],
    ),
];
/// The workloads of `full-system`: name, share of writes, and the floor for all
/// techniques ÷ Clover direct.
pub const FULL_SYSTEM_WORKLOADS: [(&str, f64, f64); 3] = [
    ("YCSB-A", 0.5, 3.0),
    ("YCSB-B", 0.05, 1.3),
    ("100% write", 1.0, 3.0),
];

impl CloverLoadConfig {
    /// `full-system` and `memory`: 32 clients (16 quick), short sides.
    pub fn full_system(quick: bool) -> CloverLoadConfig {
        CloverLoadConfig {
            seconds_per_side: if quick { 1.0 } else { 10.0 },
            ..CloverLoadConfig::bandwidth(quick)
        }
    }
}

/// One side measured with the server's and (if any) the proxy's CPU seconds.
fn measured_side(
    server: &CamelotServer,
    proxy: Option<&ServerProcess>,
    map: &ClusterMap,
    cfg: &CloverLoadConfig,
) -> Result<(CloverSide, f64, f64), BenchError> {
    cpu_during(server, proxy, || clover_side(map, cfg))
}

fn speedup_point(
    label: &str,
    side: &CloverSide,
    server_cpu_s: f64,
    proxy_cpu_s: f64,
    baseline_ops_per_sec: f64,
) -> Point {
    let ops_per_sec = side.ops as f64 / side.elapsed_s;
    let mut pt = Point::new(label);
    pt.ops_per_sec = Some(ops_per_sec);
    pt.extra.insert(
        "speedup_vs_direct".into(),
        json!(ops_per_sec / baseline_ops_per_sec),
    );
    pt.extra.insert("ops".into(), json!(side.ops));
    pt.extra.insert("server_cpu_s".into(), json!(server_cpu_s));
    pt.extra.insert("proxy_cpu_s".into(), json!(proxy_cpu_s));
    pt
}

/// `camelot bench middlebox full-system`: Clover throughput on YCSB-A, YCSB-B and 100%
/// write (zipf 0.99), direct and through a proxy with each technique and with all;
/// speed-ups ÷ the same run's direct.
pub fn run_full_system(
    cfg: &CloverLoadConfig,
    binary: &Path,
    out: &Path,
) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let server = start_clover_server(binary)?;
    let direct = ClusterMap::from_addrs(&[server.addr()]);
    let mut series = Vec::new();
    let mut comparisons = Vec::new();
    for (workload, write_fraction, target) in FULL_SYSTEM_WORKLOADS {
        let wcfg = CloverLoadConfig {
            write_fraction,
            ..cfg.clone()
        };
        let mut s = Series::new(workload);
        let (base, server_cpu, _) = measured_side(&server, None, &direct, &wcfg)?;
        let base_ops = base.ops as f64 / base.elapsed_s;
        eprintln!(
            "{workload:<11} {:<14} {base_ops:>9.0} ops/s",
            "Clover direct"
        );
        s.points.push(speedup_point(
            "Clover direct",
            &base,
            server_cpu,
            0.0,
            base_ops,
        ));
        let mut all_ops = 0.0;
        for (bar, flags) in FULL_SYSTEM_BARS {
            let mut f = flags.to_vec();
            f.push("--threads=1");
            let proxy = start_proxy(binary, server.addr(), &f)?;
            let via = ClusterMap::from_addrs(&[proxy.addr()]);
            let (side, server_cpu, proxy_cpu) = measured_side(&server, Some(&proxy), &via, &wcfg)?;
            let ops = side.ops as f64 / side.elapsed_s;
            eprintln!(
                "{workload:<11} {bar:<14} {ops:>9.0} ops/s  {:.2}×  (server {server_cpu:.2} CPU-s, proxy {proxy_cpu:.2} CPU-s)",
                ops / base_ops
            );
            s.points
                .push(speedup_point(bar, &side, server_cpu, proxy_cpu, base_ops));
            if bar == "all" {
                all_ops = ops;
            }
        }
        comparisons.push(
            Comparison::new(
                format!("{workload}, all techniques ÷ Clover direct (ops/s)"),
                all_ops,
                base_ops,
                "ops/s",
                "Clover direct (same run)",
            )
            .with_target(target, false),
        );
        series.push(s);
    }
    let mut config = load_config_json(cfg);
    config["figure"] = json!("Clover throughput per technique ÷ Clover direct, per workload");
    config["workloads"] = json!(FULL_SYSTEM_WORKLOADS
        .iter()
        .map(|(w, f, t)| json!({"name": w, "write_fraction": f, "target_all_vs_direct": t}))
        .collect::<Vec<_>>());
    config["bars"] = json!(FULL_SYSTEM_BARS
        .iter()
        .map(|(b, f)| json!({"bar": b, "proxy": format!("camelot proxy run {} --threads=1", f.join(" "))}))
        .collect::<Vec<_>>());
    config["cpu"] = json!("server_cpu_s and proxy_cpu_s per point: CPU seconds of each process over that side (preload included)");
    let mut result = BenchResult::new("middlebox-full-system", started, config, series);
    result.comparisons = comparisons;
    drop(server);
    let figure = bars_figure(&result, "throughput", "ops/s", |p| p.ops_per_sec);
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}

/// Proxy `--memory` budgets of `bench middlebox memory`, from a few KiB (a dozen write
/// cache tails, a few read cache entries behind a 64-slot table) to right-sized (every
/// hot key's tail and node cached).
pub fn memory_budgets(quick: bool) -> Vec<u64> {
    if quick {
        vec![4 << 10, 64 << 10, 16 << 20]
    } else {
        vec![
            4 << 10,
            16 << 10,
            64 << 10,
            256 << 10,
            1 << 20,
            4 << 20,
            16 << 20,
        ]
    }
}

/// `camelot bench middlebox memory`: YCSB-A zipf through a proxy with every technique
/// (one lane), speed-up ÷ Clover direct as the proxy's memory budget grows.
pub fn run_memory(
    cfg: &CloverLoadConfig,
    budgets: &[u64],
    binary: &Path,
    out: &Path,
) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    if budgets.is_empty() {
        return Err(BenchError::InvalidConfig("no memory budgets".into()));
    }
    let started = now_rfc3339();
    let server = start_clover_server(binary)?;
    let direct = ClusterMap::from_addrs(&[server.addr()]);
    let (base, server_cpu, _) = measured_side(&server, None, &direct, cfg)?;
    let base_ops = base.ops as f64 / base.elapsed_s;
    eprintln!("Clover direct        {base_ops:>9.0} ops/s");
    let mut direct_series = Series::new("Clover direct");
    direct_series
        .points
        .push(speedup_point("direct", &base, server_cpu, 0.0, base_ops));
    let mut s = Series::new("proxy, every technique, by --memory");
    let flags = [
        "--conn-map",
        "1",
        "--read-cache",
        "--write-cache",
        "--cas-to-write",
        "--threads=1",
    ];
    let mut last = 0.0;
    for &budget in budgets {
        let memory = format!("--memory={budget}");
        let mut f = flags.to_vec();
        f.push(&memory);
        let proxy = start_proxy(binary, server.addr(), &f)?;
        let via = ClusterMap::from_addrs(&[proxy.addr()]);
        let (side, server_cpu, proxy_cpu) = measured_side(&server, Some(&proxy), &via, cfg)?;
        let admin = Client::connect(via.clone(), ClientConfig::default())
            .map_err(|e| BenchError::Setup(format!("connect to the proxy: {e}")))?;
        let st = stats(&admin)?;
        let state_bytes = stat_of(&st, "proxy_state_bytes")?;
        let ops = side.ops as f64 / side.elapsed_s;
        eprintln!(
            "--memory {budget:>9} B {ops:>9.0} ops/s  {:.2}×  (state {state_bytes} B, proxy {proxy_cpu:.2} CPU-s)",
            ops / base_ops
        );
        let mut pt = speedup_point(
            &format!("{budget} B"),
            &side,
            server_cpu,
            proxy_cpu,
            base_ops,
        );
        pt.x = camelot_results::schema::X::Num(budget as f64);
        pt.extra.insert("memory_bytes".into(), json!(budget));
        pt.extra
            .insert("proxy_state_bytes".into(), json!(state_bytes));
        s.points.push(pt);
        last = ops;
    }
    let mut config = load_config_json(cfg);
    config["figure"] =
        json!("speed-up ÷ Clover direct vs the proxy's --memory budget (YCSB-A zipf)");
    config["proxy"] = json!(format!(
        "camelot proxy run {} --memory=BYTES",
        flags.join(" ")
    ));
    config["cpu"] = json!("server_cpu_s and proxy_cpu_s per point: CPU seconds of each process over that side (preload included)");
    let mut result = BenchResult::new("middlebox-memory", started, config, vec![direct_series, s]);
    result.comparisons.push(Comparison::new(
        "YCSB-A, every technique at the largest budget ÷ Clover direct (ops/s)",
        last,
        base_ops,
        "ops/s",
        "Clover direct (same run)",
    ));
    drop(server);
    let figure = bars_figure(&result, "throughput by --memory (bytes)", "ops/s", |p| {
        p.ops_per_sec
    });
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}
