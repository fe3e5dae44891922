//! `camelot bench middlebox cas` (issue 20, seed 002's cas_vs_swap): one shared word,
//! 1…64 clients each incrementing it with CAS, straight to a `camelot server` process and
//! through a `camelot proxy` process with `--conn-map 1 --cas-to-write`; successful
//! increments per second for both, and the proxy's requests per proxy CPU-second.

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

#[derive(Debug, Clone)]
pub struct CasConfig {
    pub clients: Vec<usize>,
    pub seconds_per_point: f64,
    pub quick: bool,
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
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        if self.clients.is_empty() || self.clients.iter().any(|&c| c == 0 || c > CLIENTS_MAX) {
            return Err(BenchError::InvalidConfig(format!(
                "clients are 1 to {CLIENTS_MAX}"
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

/// `clients` threads, each with its own connection, incrementing word 0 by CAS for
/// `seconds`: read once, then CAS from the last value seen (a failed CAS returns the
/// current value, so a retry needs no read).
fn hammer(
    map: &ClusterMap,
    region: &Region,
    clients: usize,
    seconds: f64,
) -> Result<Measured, BenchError> {
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
    let threads: Vec<_> = conns
        .into_iter()
        .map(|c| {
            let (stop, start, region) = (stop.clone(), start.clone(), region.clone());
            std::thread::spawn(move || -> Result<(u64, u64), String> {
                let mut cur = {
                    let b = c.read(&region, 0, 8).map_err(|e| e.to_string())?;
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&b[..8]);
                    u64::from_le_bytes(w)
                };
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

fn word(client: &Client, region: &Region) -> Result<u64, BenchError> {
    let b = client
        .read(region, 0, 8)
        .map_err(|e| BenchError::Setup(format!("read the word: {e}")))?;
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    Ok(u64::from_le_bytes(w))
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
    // A fresh word for every point and side: the proxy vouches only for words whose
    // every write it has seen, so a word the direct side moved must never reach it.
    let fresh_word = || {
        admin
            .alloc_with(4096, None, AccessMode::Shared)
            .map_err(|e| BenchError::Setup(format!("alloc: {e}")))
    };

    let mut direct_series = Series::new("CAS direct");
    let mut proxy_series = Series::new("CAS→WRITE via proxy");
    let mut at_32 = (None, None);
    let mut best_proxy_ops_per_cpu_s: f64 = 0.0;
    for &n in &cfg.clients {
        let region = fresh_word()?;
        let d = hammer(&direct, &region, n, cfg.seconds_per_point)?;
        let moved = word(&admin, &region)?;
        if moved != d.increments {
            return Err(BenchError::Check(format!(
                "direct: {} increments counted, the word moved {moved}",
                d.increments
            )));
        }
        let _ = admin.free(&region);
        let region = fresh_word()?;
        let cpu0 = proxy.cpu_seconds()?;
        let p = hammer(&via, &region, n, cfg.seconds_per_point)?;
        let cpu = proxy.cpu_seconds()? - cpu0;
        // Every increment counted was a CAS the proxy answered after its WRITE was done.
        let moved = word(&admin, &region)?;
        if moved != p.increments {
            return Err(BenchError::Check(format!(
                "proxy: {} increments counted, the word moved {moved}",
                p.increments
            )));
        }
        let _ = admin.free(&region);
        let ops_per_cpu_s = if cpu > 0.0 {
            p.attempts as f64 / cpu
        } else {
            f64::NAN
        };
        if ops_per_cpu_s.is_finite() {
            best_proxy_ops_per_cpu_s = best_proxy_ops_per_cpu_s.max(ops_per_cpu_s);
        }
        let mut dp = Point::new(n);
        dp.ops_per_sec = Some(d.increments_per_s);
        dp.extra.insert("cas_attempts".into(), json!(d.attempts));
        dp.extra.insert("increments".into(), json!(d.increments));
        direct_series.points.push(dp);
        let mut pp = Point::new(n);
        pp.ops_per_sec = Some(p.increments_per_s);
        pp.extra.insert("cas_attempts".into(), json!(p.attempts));
        pp.extra.insert("increments".into(), json!(p.increments));
        pp.extra.insert("proxy_cpu_s".into(), json!(cpu));
        pp.extra
            .insert("proxy_ops_per_cpu_s".into(), json!(ops_per_cpu_s));
        proxy_series.points.push(pp);
        eprintln!(
            "{n:>3} clients: direct {:>9.0} incr/s, via proxy {:>9.0} incr/s ({:.2}×), proxy {:.0} ops/CPU-s",
            d.increments_per_s,
            p.increments_per_s,
            p.increments_per_s / d.increments_per_s,
            ops_per_cpu_s
        );
        if n == 32 {
            at_32 = (Some(d.increments_per_s), Some(p.increments_per_s));
        }
    }
    let config = json!({
        "x": "clients",
        "clients": cfg.clients,
        "seconds_per_point": cfg.seconds_per_point,
        "quick": cfg.quick,
        "workload": "one shared 8-byte word; each client: CAS(last seen, last seen + 1), a failed CAS's answer is the next guess",
        "figure": "successful increments per second",
        "server": "camelot server --memory 64M (a process)",
        "proxy": format!("camelot proxy run {}", proxy_flags.join(" ")),
        "client": "camelot-client, one connection per client thread",
        "proxy_ops": "every CAS the proxy answered, per CPU-second of the proxy process",
    });
    let mut result = BenchResult::new(
        "middlebox-cas",
        started,
        config,
        vec![direct_series, proxy_series],
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
    Ok(vec![output::write_result(out, &result)?])
}
