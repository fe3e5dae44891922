//! `camelot bench paging` (seed 000's *policyPerformance*): every eviction policy over
//! every access pattern at several shares of local memory, paging from a memory server
//! process — runtime, miss ratio and remote bytes, with the same accesses over plain
//! local memory (the all-local time) and the trace simulator's miss ratio beside.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use camelot_farmem::sim::{self, Workload};
use camelot_farmem::{CacheConfig, PageCache, PageStore, RegionStore, POLICY_NAMES};
use camelot_results::output;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Series, X};
use serde_json::json;

use crate::progress::Progress;
use crate::side::CamelotSpec;
use crate::workload::Target;
use crate::BenchError;

/// A paging run's data set is at most this large (it is also held locally, for the
/// all-local reference).
pub const PAGING_BYTES_MAX: u64 = 8 << 30;

#[derive(Debug, Clone)]
pub struct PagingConfig {
    pub pages: u64,
    pub page_bytes: usize,
    /// Accesses per (workload, policy, local share).
    pub accesses: usize,
    pub policies: Vec<String>,
    pub workloads: Vec<String>,
    /// Local memory as a percentage of the data set.
    pub local_percents: Vec<u32>,
    pub prefetch: String,
    /// Share of accesses that write (8 bytes), so eviction has dirty pages to write back.
    pub write_percent: u8,
    pub servers: Vec<SocketAddr>,
    pub in_process: bool,
    pub token: Option<Vec<u8>>,
    pub seed: u64,
    pub quick: bool,
}

impl Default for PagingConfig {
    fn default() -> Self {
        PagingConfig {
            pages: 16_384,
            page_bytes: 4096,
            accesses: 100_000,
            policies: POLICY_NAMES.iter().map(|s| s.to_string()).collect(),
            workloads: ["sequential", "uniform", "zipf:0.99", "hotscan", "loop"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            local_percents: vec![10, 25, 50, 100],
            prefetch: "none".into(),
            write_percent: 10,
            servers: Vec::new(),
            in_process: false,
            token: None,
            seed: 1,
            quick: false,
        }
    }
}

impl PagingConfig {
    /// Under 30 s on a 2-core machine: three policies, two workloads, two shares.
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.pages = self.pages.min(2048);
        self.accesses = self.accesses.min(4000);
        self.policies = ["lru", "s3fifo", "arc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        self.workloads = ["zipf:0.99", "hotscan"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        self.local_percents = vec![10, 50];
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        camelot_farmem::store::check_page_bytes(self.page_bytes)
            .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        let bytes = self.pages.saturating_mul(self.page_bytes as u64);
        if self.pages == 0 || bytes > PAGING_BYTES_MAX {
            return bad(format!(
                "a data set of 1 page to {PAGING_BYTES_MAX} B, not {bytes} B"
            ));
        }
        if self.accesses == 0 || self.accesses > sim::TRACE_ACCESSES_MAX {
            return bad(format!("1 to {} accesses", sim::TRACE_ACCESSES_MAX));
        }
        if let Some(p) = self.local_percents.iter().find(|p| **p == 0 || **p > 100) {
            return bad(format!("local share {p}% is outside 1..=100"));
        }
        if self.write_percent > 100 {
            return bad("--writes is a percentage".into());
        }
        for p in &self.policies {
            camelot_farmem::policy_by_name(p, 1, 0)
                .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        }
        for w in &self.workloads {
            Workload::parse(w).map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        }
        camelot_farmem::prefetcher_by_name(&self.prefetch, 32)
            .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        if self.policies.is_empty() || self.workloads.is_empty() || self.local_percents.is_empty() {
            return bad("at least one policy, workload and local share".into());
        }
        Ok(())
    }
}

/// Where in its page access `i` lands, and whether it writes: the same for every run.
fn access_at(i: usize, page: u64, page_bytes: usize, write_percent: u8) -> (u64, bool) {
    let word = (i.wrapping_mul(2_654_435_761) % (page_bytes / 8)) as u64;
    let writes = (i.wrapping_mul(40_503) % 100) < write_percent as usize;
    (page * page_bytes as u64 + word * 8, writes)
}

/// The accesses over plain local memory: the all-local time.
fn run_local(trace: &[u64], memory: &mut [u8], page_bytes: usize, write_percent: u8) -> (f64, u64) {
    let started = Instant::now();
    let mut sum = 0u64;
    for (i, &page) in trace.iter().enumerate() {
        let (at, writes) = access_at(i, page, page_bytes, write_percent);
        let at = at as usize;
        let mut word = [0u8; 8];
        word.copy_from_slice(&memory[at..at + 8]);
        sum = sum.wrapping_add(u64::from_le_bytes(word));
        if writes {
            memory[at..at + 8].copy_from_slice(&(i as u64).to_le_bytes());
        }
    }
    (started.elapsed().as_secs_f64(), std::hint::black_box(sum))
}

/// Runs the experiment and writes `paging.json` and its figure.
pub fn run(cfg: &PagingConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let data_bytes = cfg.pages * cfg.page_bytes as u64;
    let mut spec = CamelotSpec::new(1, data_bytes + (16 << 20));
    spec.token = cfg.token.clone();
    let target = Target::open(&cfg.servers, &spec, cfg.in_process)?;
    let client = target.connect(true)?;
    let region = client.alloc(data_bytes, None)?;
    let mut local_memory = vec![0u8; data_bytes as usize];
    let runs = cfg.workloads.len() * cfg.policies.len() * cfg.local_percents.len();
    let progress = Progress::new(runs as u64 * cfg.accesses as u64, "paging");
    let mut series: Vec<Series> = Vec::new();
    let mut all_local = Series::new("all-local");
    let mut checks = Vec::new();
    for workload_name in &cfg.workloads {
        let workload =
            Workload::parse(workload_name).map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        let trace = workload
            .generate(cfg.pages, cfg.accesses, cfg.seed)
            .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        let (local_seconds, _) =
            run_local(&trace, &mut local_memory, cfg.page_bytes, cfg.write_percent);
        let mut p = Point::new(workload.label());
        p.ops_per_sec = Some(trace.len() as f64 / local_seconds.max(1e-9));
        p.extra
            .insert("runtime_seconds".into(), json!(local_seconds));
        all_local.points.push(p);
        for &percent in &cfg.local_percents {
            let frames = ((cfg.pages * percent as u64) / 100).max(1);
            for policy in &cfg.policies {
                progress.set_message(&format!(
                    "{} · {policy} · {percent}% local",
                    workload.label()
                ));
                let store = RegionStore::new(client.clone(), region.clone(), cfg.page_bytes)
                    .map_err(|e| BenchError::Setup(e.to_string()))?;
                let mut config = CacheConfig::new(frames * cfg.page_bytes as u64);
                config.policy = policy.clone();
                config.prefetch = cfg.prefetch.clone();
                config.seed = cfg.seed;
                let mut cache =
                    PageCache::new(store, &config).map_err(|e| BenchError::Setup(e.to_string()))?;
                let t = Instant::now();
                let mut word = [0u8; 8];
                for (i, &page) in trace.iter().enumerate() {
                    let (at, writes) = access_at(i, page, cfg.page_bytes, cfg.write_percent);
                    cache
                        .read(at, &mut word)
                        .map_err(|e| BenchError::Setup(e.to_string()))?;
                    if writes {
                        cache
                            .write(at, &(i as u64).to_le_bytes())
                            .map_err(|e| BenchError::Setup(e.to_string()))?;
                    }
                }
                let seconds = t.elapsed().as_secs_f64();
                progress.inc(trace.len() as u64);
                let stats = cache.stats();
                let (read_bytes, written_bytes) = cache.store().traffic_bytes();
                let mut sim_policy =
                    camelot_farmem::policy_by_name(policy, frames as usize, cfg.seed)
                        .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
                // The cache saw a write as a second use of the page (a hit, which moves
                // it in most policies), so the simulator gets the same.
                let sim_trace = trace.iter().enumerate().flat_map(|(i, &page)| {
                    let (_, writes) = access_at(i, page, cfg.page_bytes, cfg.write_percent);
                    std::iter::once(page).chain(writes.then_some(page))
                });
                let simulated = sim::simulate(sim_policy.as_mut(), frames as usize, sim_trace);
                let miss_ratio = stats.misses as f64 / trace.len() as f64;
                let sim_ratio = simulated.misses as f64 / trace.len() as f64;
                if (miss_ratio - sim_ratio).abs() > 0.01 {
                    checks.push(format!(
                        "{} {policy} {percent}%: cache {miss_ratio:.4} vs simulator {sim_ratio:.4}",
                        workload.label()
                    ));
                }
                let label = format!("{policy}, {percent}% local");
                let s = match series.iter_mut().position(|s| s.label == label) {
                    Some(i) => &mut series[i],
                    None => {
                        series.push(Series::new(target.label(&label)));
                        series
                            .last_mut()
                            .ok_or_else(|| BenchError::Setup("series".into()))?
                    }
                };
                let mut p = Point::new(workload.label());
                p.ops_per_sec = Some(trace.len() as f64 / seconds.max(1e-9));
                for (k, v) in [
                    ("runtime_seconds", json!(seconds)),
                    ("all_local_runtime_seconds", json!(local_seconds)),
                    (
                        "slowdown_vs_all_local",
                        json!(seconds / local_seconds.max(1e-9)),
                    ),
                    ("miss_ratio", json!(miss_ratio)),
                    ("simulator_miss_ratio", json!(sim_ratio)),
                    ("remote_read_bytes", json!(read_bytes)),
                    ("remote_written_bytes", json!(written_bytes)),
                    ("evictions", json!(stats.evictions)),
                    ("written_back", json!(stats.written_back)),
                    ("prefetched", json!(stats.prefetched)),
                    ("local_pages", json!(frames)),
                ] {
                    p.extra.insert(k.into(), v);
                }
                s.points.push(p);
            }
        }
    }
    progress.finish();
    client.free(&region)?;
    let servers = target.describe();
    target.close()?;
    if !checks.is_empty() {
        return Err(BenchError::Check(format!(
            "the cache and the simulator disagree by more than 1 point: {}",
            checks.join("; ")
        )));
    }
    series.push(all_local);
    let config = json!({
        "x": "workload",
        "pages": cfg.pages,
        "page_bytes": cfg.page_bytes,
        "data_bytes": data_bytes,
        "accesses": cfg.accesses,
        "policies": cfg.policies,
        "workloads": cfg.workloads,
        "local_percents": cfg.local_percents,
        "prefetch": cfg.prefetch,
        "write_percent": cfg.write_percent,
        "seed": cfg.seed,
        "process": servers["process"],
        "servers": servers,
        "sides": {
            "camelot": {"process": servers["process"], "client": "camelot-farmem PageCache over RegionStore, one thread", "data_model": "8-byte access per trace entry into a 4 KiB-paged region"},
            "all-local": {"process": "in-process", "client": "the same accesses into a Vec<u8> of the whole data set", "data_model": "same"}
        },
        "quick": cfg.quick,
    });
    let result = BenchResult::new("paging", started, config, series);
    Ok(output::write_result_with_figure(
        out,
        &result,
        &figure(&result, cfg),
    )?)
}

/// Per local share: a panel of miss ratios (bars over workloads, one per policy), and one
/// of slowdown against all-local memory.
fn figure(result: &BenchResult, cfg: &PagingConfig) -> Figure {
    let categories: Vec<String> = cfg
        .workloads
        .iter()
        .filter_map(|w| Workload::parse(w).ok().map(|w| w.label()))
        .collect();
    let mut figure = Figure::new(&format!(
        "Paging: {} pages of {} B, {} accesses per run",
        cfg.pages, cfg.page_bytes, cfg.accesses
    ));
    for &percent in &cfg.local_percents {
        let mut misses = Panel::new(
            &format!("{percent}% local: miss ratio"),
            "workload",
            "miss ratio (%)",
        )
        .bars(categories.clone());
        let mut slowdown = Panel::new(
            &format!("{percent}% local: runtime ÷ all-local"),
            "workload",
            "× all-local",
        )
        .bars(categories.clone());
        for s in result
            .series
            .iter()
            .filter(|s| s.label.contains(&format!(", {percent}% local")))
        {
            let pick = |key: &str, scale: f64| -> Vec<(f64, f64)> {
                s.points
                    .iter()
                    .filter_map(|p| {
                        let X::Label(label) = &p.x else { return None };
                        let i = categories.iter().position(|c| c == label)?;
                        Some((i as f64, p.extra.get(key)?.as_f64()? * scale))
                    })
                    .collect()
            };
            let policy = s.label.split(',').next().unwrap_or(&s.label).to_string();
            misses = misses.line(&policy, pick("miss_ratio", 100.0));
            slowdown = slowdown.line(&policy, pick("slowdown_vs_all_local", 1.0));
        }
        figure = figure.panel(misses).panel(slowdown);
    }
    figure
}
