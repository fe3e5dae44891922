//! `camelot bench fault`: what one far page costs on each path, one thread —
//! - a FarRegion fault (userfaultfd) whose page comes from a memory server,
//! - the same through the explicit path, a FarVec miss,
//! - a bare FarRegion fault served from local memory (userfaultfd's own cost),
//! - the remote 4 KiB read alone (its round trip),
//!
//! - FarRegion faults from several threads at once (`--threads`), each touching its share
//!   of the pages, which the region's handler pool (`--fault-handlers`) serves with
//!   overlapping remote reads,
//!
//! each as latency p50/p99 (HdrHistogram) and faults a second. Every touch lands on a
//! page not present (each page once, in a shuffled order, through a cache of a tenth
//! of them), so every measured access is a fault/miss. Every path over the server also
//! records the server's CPU seconds (a separate `camelot server` process by default) and
//! faults per server CPU-second, and `config["sides"]` records how each side ran.

use std::path::{Path, PathBuf};
use std::time::Instant;

use camelot_farmem::{
    CacheConfig, FarRegion, FarVec, LocalStore, PageCache, PageStore, RegionStore,
};
use camelot_results::output;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;

use crate::latency::LatencyRecorder;
use crate::side::{cpu_extra, sides_json, CamelotSpec, ClientSide, Side};
use crate::workload::Target;
use crate::BenchError;

/// Largest far space the bench maps (pages × page size).
pub const FAULT_BYTES_MAX: u64 = 4 << 30;
/// Most threads of the concurrent path.
pub const FAULT_THREADS_MAX: usize = 64;

#[derive(Debug, Clone)]
pub struct FaultConfig {
    /// Pages touched per path (each once).
    pub pages: u64,
    pub page_bytes: usize,
    /// Local memory as a percentage of the pages.
    pub local_percent: u32,
    /// Local memory in bytes (`--local-memory`): when set, it replaces `local_percent`.
    pub local_memory_bytes: Option<u64>,
    pub seed: u64,
    pub servers: Vec<std::net::SocketAddr>,
    pub in_process: bool,
    pub token: Option<Vec<u8>>,
    pub quick: bool,
    /// Threads faulting at once on the concurrent path.
    pub threads: usize,
    /// The FarRegions' fault-handler threads.
    pub fault_handlers: usize,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            pages: 65_536, // 256 MiB of 4 KiB pages
            page_bytes: 4096,
            local_percent: 10,
            local_memory_bytes: None,
            seed: 1,
            servers: Vec::new(),
            in_process: false,
            token: None,
            quick: false,
            threads: 4,
            fault_handlers: camelot_farmem::region::FAULT_HANDLERS_DEFAULT,
        }
    }
}

impl FaultConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.pages = self.pages.min(4096);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        camelot_farmem::store::check_page_bytes(self.page_bytes)
            .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        if self.pages < 64 || self.pages.saturating_mul(self.page_bytes as u64) > FAULT_BYTES_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "{} pages: 64 to {FAULT_BYTES_MAX} B worth",
                self.pages
            )));
        }
        if !(1..=FAULT_THREADS_MAX).contains(&self.threads) {
            return Err(BenchError::InvalidConfig(format!(
                "--threads {}: 1 to {FAULT_THREADS_MAX}",
                self.threads
            )));
        }
        if !(1..=camelot_farmem::region::FAULT_HANDLERS_MAX).contains(&self.fault_handlers) {
            return Err(BenchError::InvalidConfig(format!(
                "--fault-handlers {}: 1 to {}",
                self.fault_handlers,
                camelot_farmem::region::FAULT_HANDLERS_MAX
            )));
        }
        if self.local_percent == 0 || self.local_percent >= 100 {
            return Err(BenchError::InvalidConfig(
                "--local is a percentage in 1..=99 (at 100 nothing would fault)".into(),
            ));
        }
        if let Some(b) = self.local_memory_bytes {
            let data = self.pages * self.page_bytes as u64;
            if b < 2 * self.page_bytes as u64 || b >= data {
                return Err(BenchError::InvalidConfig(format!(
                    "--local-memory {b}: two pages ({} B) up to less than the {data} B \
                     touched (else nothing would fault)",
                    2 * self.page_bytes
                )));
            }
        }
        Ok(())
    }

    fn local_bytes(&self) -> u64 {
        match self.local_memory_bytes {
            Some(b) => b / self.page_bytes as u64 * self.page_bytes as u64,
            None => (self.pages * self.local_percent as u64 / 100).max(2) * self.page_bytes as u64,
        }
    }

    fn cache_config(&self) -> CacheConfig {
        let mut config = CacheConfig::new(self.local_bytes());
        config.fault_handlers = self.fault_handlers;
        config
    }
}

/// One path's figures.
struct PathRun {
    latency: LatencyRecorder,
    seconds: f64,
    faults: u64,
    /// CPU seconds of the memory server over the path (none for the local store, nor
    /// when the server is not a process of this run's).
    server_cpu_seconds: Option<f64>,
}

impl PathRun {
    fn point(&self, label: &str) -> Point {
        let mut p = Point::new(label);
        p.latency_us = Some(self.latency.summary());
        p.ops_per_sec = Some(self.faults as f64 / self.seconds.max(1e-9));
        p.extra.insert("faults".into(), json!(self.faults));
        p.extra.insert("seconds".into(), json!(self.seconds));
        for (k, v) in cpu_extra(self.faults as f64, self.server_cpu_seconds) {
            p.extra.insert(k.into(), v);
        }
        p
    }
}

fn setup<E: std::fmt::Display>(e: E) -> BenchError {
    BenchError::Setup(e.to_string())
}

/// Touches one byte of every page of a FarRegion, in `order`, timing each touch.
fn region_faults<S: PageStore + 'static>(
    store: S,
    cfg: &FaultConfig,
    order: &[u64],
) -> Result<(PathRun, u64), BenchError> {
    let region = FarRegion::new(store, &cfg.cache_config()).map_err(setup)?;
    let bytes = region.bytes();
    let mut latency = LatencyRecorder::new();
    let mut sum = 0u64;
    let t = Instant::now();
    for &page in order {
        let at = page as usize * cfg.page_bytes;
        let started = Instant::now();
        sum = sum.wrapping_add(std::hint::black_box(bytes[at]) as u64);
        latency.record(started.elapsed());
    }
    let seconds = t.elapsed().as_secs_f64();
    std::hint::black_box(sum);
    let stats = region.stats();
    if let Some(why) = region.failure() {
        return Err(BenchError::Setup(why));
    }
    Ok((
        PathRun {
            latency,
            seconds,
            faults: order.len() as u64,
            server_cpu_seconds: None,
        },
        stats.missing_faults,
    ))
}

/// `region_faults` from `cfg.threads` threads at once, each touching its share of
/// `order`; latency is per touch, the rate is all touches over the wall time.
fn region_faults_threaded<S: PageStore + 'static>(
    store: S,
    cfg: &FaultConfig,
    order: &[u64],
) -> Result<(PathRun, u64), BenchError> {
    let region = FarRegion::new(store, &cfg.cache_config()).map_err(setup)?;
    let bytes = region.bytes();
    let share = order.len().div_ceil(cfg.threads);
    let t = Instant::now();
    let recorders: Vec<LatencyRecorder> = std::thread::scope(|s| {
        let joins: Vec<_> = order
            .chunks(share)
            .map(|pages| {
                s.spawn(move || {
                    let mut latency = LatencyRecorder::new();
                    let mut sum = 0u64;
                    for &page in pages {
                        let at = page as usize * cfg.page_bytes;
                        let started = Instant::now();
                        sum = sum.wrapping_add(std::hint::black_box(bytes[at]) as u64);
                        latency.record(started.elapsed());
                    }
                    std::hint::black_box(sum);
                    latency
                })
            })
            .collect();
        joins.into_iter().filter_map(|j| j.join().ok()).collect()
    });
    let seconds = t.elapsed().as_secs_f64();
    if let Some(why) = region.failure() {
        return Err(BenchError::Setup(why));
    }
    let mut latency = LatencyRecorder::new();
    for r in &recorders {
        latency.merge(r);
    }
    let stats = region.stats();
    Ok((
        PathRun {
            latency,
            seconds,
            faults: order.len() as u64,
            server_cpu_seconds: None,
        },
        stats.missing_faults,
    ))
}

pub fn run(cfg: &FaultConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let bytes = cfg.pages * cfg.page_bytes as u64;
    let mut order: Vec<u64> = (0..cfg.pages).collect();
    order.shuffle(&mut SmallRng::seed_from_u64(cfg.seed));

    // Userfaultfd alone: pages from this process's memory.
    let local = LocalStore::new(cfg.page_bytes, cfg.pages).map_err(setup)?;
    let (bare, bare_faults) = region_faults(local, cfg, &order)?;

    let mut spec = CamelotSpec::new(1, 2 * bytes + (16 << 20));
    spec.token = cfg.token.clone();
    let target = Target::open(&cfg.servers, &spec, cfg.in_process)?;
    let client = target.connect(true)?;
    let region = client.alloc(bytes, None)?;

    // The remote read alone: one page, one request, the same pages in the same order.
    let store = RegionStore::new(client.clone(), region.clone(), cfg.page_bytes).map_err(setup)?;
    let meter = target.cpu_meter();
    let mut rtt = LatencyRecorder::new();
    let mut buf = vec![vec![0u8; cfg.page_bytes].into_boxed_slice()];
    let t = Instant::now();
    for &page in &order {
        let started = Instant::now();
        store.read_pages(&[page], &mut buf).map_err(setup)?;
        rtt.record(started.elapsed());
    }
    let rtt = PathRun {
        latency: rtt,
        seconds: t.elapsed().as_secs_f64(),
        faults: order.len() as u64,
        server_cpu_seconds: meter.seconds(),
    };

    // The transparent path: a FarRegion over the server.
    let meter = target.cpu_meter();
    let (mut far, far_faults) = region_faults(store, cfg, &order)?;
    far.server_cpu_seconds = meter.seconds();

    // Several threads faulting at once on the same pages, through a new region.
    let store = RegionStore::new(client.clone(), region.clone(), cfg.page_bytes).map_err(setup)?;
    let meter = target.cpu_meter();
    let (mut concurrent, concurrent_faults) = region_faults_threaded(store, cfg, &order)?;
    concurrent.server_cpu_seconds = meter.seconds();

    // The explicit path: a FarVec<u8> miss on the same pages.
    let store = RegionStore::new(client.clone(), region.clone(), cfg.page_bytes).map_err(setup)?;
    let cache = PageCache::new(store, &CacheConfig::new(cfg.local_bytes())).map_err(setup)?;
    let v: FarVec<u8, _> = FarVec::new(cache, bytes).map_err(setup)?;
    let meter = target.cpu_meter();
    let mut latency = LatencyRecorder::new();
    let mut sum = 0u64;
    let t = Instant::now();
    for &page in &order {
        let started = Instant::now();
        sum = sum.wrapping_add(v.get(page * cfg.page_bytes as u64).map_err(setup)? as u64);
        latency.record(started.elapsed());
    }
    std::hint::black_box(sum);
    let farvec = PathRun {
        latency,
        seconds: t.elapsed().as_secs_f64(),
        faults: v.stats().misses,
        server_cpu_seconds: meter.seconds(),
    };
    client.free(&region)?;
    let servers = target.describe();
    let one_page = format!("one byte read per {} B page", cfg.page_bytes);
    let sides = [
        target.side(
            "camelot",
            ClientSide {
                client: "camelot-farmem FarRegion (userfaultfd) and FarVec over RegionStore".into(),
                client_threads: 1,
                depth: 1,
                data_model: one_page.clone(),
                resp_face: false,
            },
        ),
        target.side(
            &format!("camelot, {} threads", cfg.threads),
            ClientSide {
                client: format!(
                    "camelot-farmem FarRegion, {} fault-handler threads",
                    cfg.fault_handlers
                ),
                client_threads: cfg.threads,
                depth: 1,
                data_model: one_page.clone(),
                resp_face: false,
            },
        ),
        target.side(
            "remote read",
            ClientSide {
                client: "camelot-farmem RegionStore::read_pages, one page a request".into(),
                client_threads: 1,
                depth: 1,
                data_model: format!("{} B region READs", cfg.page_bytes),
                resp_face: false,
            },
        ),
        Side {
            label: "bare".into(),
            server: "none: LocalStore, pages from the bench's own memory".into(),
            process: "in-process".into(),
            server_threads: None,
            nodes: 0,
            version: format!("camelot {}", env!("CARGO_PKG_VERSION")),
            flags: Vec::new(),
            command: String::new(),
            client: ClientSide {
                client: "camelot-farmem FarRegion over LocalStore".into(),
                client_threads: 1,
                depth: 1,
                data_model: one_page,
                resp_face: false,
            },
        },
    ];
    let label = target.label("one byte read per page, every touch a fault");
    target.close()?;

    let p50 = |r: &PathRun| r.latency.summary().p50;
    let rate = |r: &PathRun| r.faults as f64 / r.seconds.max(1e-9);
    let mut series = Series::new(label);
    let concurrent_label = format!("FarRegion faults, remote, {} threads", cfg.threads);
    for (label, run) in [
        ("FarRegion fault, remote", &far),
        ("FarVec miss, remote", &farvec),
        ("FarRegion fault, local store", &bare),
        ("remote 4 KiB read", &rtt),
        (concurrent_label.as_str(), &concurrent),
    ] {
        series.points.push(run.point(label));
    }
    let comparisons = vec![
        Comparison::new(
            "FarRegion fault p50 ÷ (remote read p50 + bare fault p50)",
            p50(&far),
            p50(&rtt) + p50(&bare),
            "µs",
            "remote 4 KiB read + bare userfaultfd fault",
        )
        .with_target(2.0, true),
        Comparison::new(
            "FarRegion fault p50 ÷ FarVec miss p50",
            p50(&far),
            p50(&farvec),
            "µs",
            "FarVec miss (explicit path)",
        ),
        Comparison::new(
            format!("FarRegion faults/s, {} threads ÷ 1 thread", cfg.threads),
            rate(&concurrent),
            rate(&far),
            "faults/s",
            "one thread faulting (same region, same pages)",
        ),
    ];
    let config = json!({
        "x": "path",
        "pages": cfg.pages,
        "page_bytes": cfg.page_bytes,
        "data_bytes": bytes,
        "local_percent": cfg.local_memory_bytes.is_none().then_some(cfg.local_percent),
        "local_bytes": cfg.local_bytes(),
        "seed": cfg.seed,
        "policy": "lru",
        "prefetch": "none",
        "order": "every page once, shuffled",
        "faults_counted": {"far_region_remote": far_faults, "far_region_local": bare_faults, "far_region_concurrent": concurrent_faults},
        "threads": cfg.threads,
        "fault_handlers": cfg.fault_handlers,
        "process": servers["process"],
        "servers": servers,
        "sides": sides_json(&sides),
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("fault", started, config, vec![series]);
    result.references = vec![
        Reference {
            label: "remote 4 KiB read p50".into(),
            metric: "latency_us_p50".into(),
            value: p50(&rtt),
        },
        Reference {
            label: "bare userfaultfd fault p50".into(),
            metric: "latency_us_p50".into(),
            value: p50(&bare),
        },
    ];
    result.comparisons = comparisons;
    let labels: Vec<String> = result.series[0]
        .points
        .iter()
        .map(|p| match &p.x {
            camelot_results::schema::X::Label(l) => l.clone(),
            camelot_results::schema::X::Num(n) => n.to_string(),
        })
        .collect();
    let p50s: Vec<(f64, f64)> = result.series[0]
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| (i as f64, p.latency_us.as_ref().map_or(0.0, |l| l.p50)))
        .collect();
    let p99s: Vec<(f64, f64)> = result.series[0]
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| (i as f64, p.latency_us.as_ref().map_or(0.0, |l| l.p99)))
        .collect();
    let figure = Figure::new(&format!(
        "One far page, {} KiB, with {} KiB of local memory",
        cfg.page_bytes >> 10,
        cfg.local_bytes() >> 10
    ))
    .panel(
        Panel::new("latency per fault", "path", "µs")
            .bars(labels)
            .line("p50", p50s)
            .line("p99", p99s),
    );
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}
