//! `camelot bench prefetch`: a sequential scan of far memory through the page cache with
//! each prefetcher, against one `iperf3 -R` stream (the server sends, as a scan's pages
//! flow) measured in the same run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use camelot_farmem::{CacheConfig, PageCache, RegionStore, PREFETCHER_NAMES};
use camelot_results::output;
use camelot_results::plot::{Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series};
use serde_json::json;

use crate::peers::{iperf3_tcp_stream_in, StreamDirection};
use crate::side::CamelotSpec;
use crate::workload::Target;
use crate::BenchError;

/// Bytes one access of the scan reads: a cache line.
const ACCESS_BYTES: usize = 64;

#[derive(Debug, Clone)]
pub struct PrefetchConfig {
    pub pages: u64,
    pub page_bytes: usize,
    pub local_percent: u32,
    /// Local memory in bytes (`--local-memory`): when set, it replaces `local_percent`.
    pub local_memory_bytes: Option<u64>,
    pub window_pages: u64,
    pub prefetchers: Vec<String>,
    pub iperf3_seconds: u64,
    pub servers: Vec<SocketAddr>,
    pub in_process: bool,
    pub token: Option<Vec<u8>>,
    pub quick: bool,
}

/// The scan's readahead window by default: 256 pages (1 MiB, requests of 512 KiB), the
/// prefetcher's most. On 2 vCPUs the scan ran 2.1–2.3 GB/s at 64 pages, 2.4–2.7 at 128,
/// 2.4–3.1 at 256 and no better, only noisier, at 512 or 1,024 (BENCHMARKS.md,
/// fifteenth session): with 256 KiB ahead, any 100 µs the server or the client's reader
/// is off the CPU stalls the scan. `--window` sets another.
pub const WINDOW_PAGES_DEFAULT: u64 = 256;

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            pages: 65_536, // 256 MiB
            page_bytes: 4096,
            local_percent: 10,
            local_memory_bytes: None,
            window_pages: WINDOW_PAGES_DEFAULT,
            prefetchers: PREFETCHER_NAMES.iter().map(|s| s.to_string()).collect(),
            iperf3_seconds: 3,
            servers: Vec::new(),
            in_process: false,
            token: None,
            quick: false,
        }
    }
}

impl PrefetchConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.pages = self.pages.min(4096);
        self.iperf3_seconds = 1;
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        camelot_farmem::store::check_page_bytes(self.page_bytes)
            .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        if self.pages < 16
            || self.pages.saturating_mul(self.page_bytes as u64) > crate::paging::PAGING_BYTES_MAX
        {
            return Err(BenchError::InvalidConfig(format!(
                "{} pages: 16 to {} B worth",
                self.pages,
                crate::paging::PAGING_BYTES_MAX
            )));
        }
        if self.local_percent == 0 || self.local_percent > 100 {
            return Err(BenchError::InvalidConfig(
                "--local is a percentage in 1..=100".into(),
            ));
        }
        if self
            .local_memory_bytes
            .is_some_and(|b| b < 2 * self.page_bytes as u64)
        {
            return Err(BenchError::InvalidConfig(format!(
                "--local-memory holds at least two pages ({} B)",
                2 * self.page_bytes
            )));
        }
        for p in &self.prefetchers {
            camelot_farmem::prefetcher_by_name(p, self.window_pages)
                .map_err(|e| BenchError::InvalidConfig(e.to_string()))?;
        }
        Ok(())
    }
}

pub fn run(cfg: &PrefetchConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let bytes = cfg.pages * cfg.page_bytes as u64;
    let mut spec = CamelotSpec::new(1, bytes + (16 << 20));
    spec.token = cfg.token.clone();
    let target = Target::open(&cfg.servers, &spec, cfg.in_process)?;
    let client = target.connect(true)?;
    let region = client.alloc(bytes, None)?;
    let frames = match cfg.local_memory_bytes {
        Some(b) => b / cfg.page_bytes as u64,
        None => (cfg.pages * cfg.local_percent as u64 / 100).max(2),
    };
    let mut series = Series::new(target.label("sequential scan, 64 B reads"));
    let mut rates = Vec::new();
    for name in &cfg.prefetchers {
        let store = RegionStore::new(client.clone(), region.clone(), cfg.page_bytes)
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        let mut config = CacheConfig::new(frames * cfg.page_bytes as u64);
        config.prefetch = name.clone();
        config.prefetch_window_pages = cfg.window_pages;
        let mut cache =
            PageCache::new(store, &config).map_err(|e| BenchError::Setup(e.to_string()))?;
        let mut line = [0u8; ACCESS_BYTES];
        let mut sum = 0u64;
        let t = Instant::now();
        let mut at = 0u64;
        while at + ACCESS_BYTES as u64 <= bytes {
            cache
                .read(at, &mut line)
                .map_err(|e| BenchError::Setup(e.to_string()))?;
            sum = sum.wrapping_add(line[0] as u64);
            at += ACCESS_BYTES as u64;
        }
        let seconds = t.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        let stats = cache.stats();
        let rate = bytes as f64 / seconds.max(1e-9);
        let mut p = Point::new(name.as_str());
        p.bytes_per_sec = Some(rate);
        for (k, v) in [
            ("runtime_seconds", json!(seconds)),
            ("misses", json!(stats.misses)),
            ("prefetched", json!(stats.prefetched)),
            ("prefetch_used", json!(stats.prefetch_used)),
        ] {
            p.extra.insert(k.into(), v);
        }
        series.points.push(p);
        rates.push((name.clone(), rate));
    }
    client.free(&region)?;
    let servers = target.describe();
    target.close()?;
    let iperf3 = iperf3_tcp_stream_in(
        Duration::from_secs(cfg.iperf3_seconds),
        StreamDirection::ServerToClient,
    )?;
    let rate_of = |n: &str| rates.iter().find(|(name, _)| name == n).map(|(_, r)| *r);
    let mut comparisons = Vec::new();
    if let (Some(seq), Some(none)) = (rate_of("sequential"), rate_of("none")) {
        comparisons.push(
            Comparison::new(
                "scan: sequential prefetch ÷ none",
                seq,
                none,
                "B/s",
                "the same scan without prefetch",
            )
            .with_target(3.0, false),
        );
    }
    if let Some(seq) = rate_of("sequential") {
        comparisons.push(
            Comparison::new(
                "scan with sequential prefetch ÷ iperf3 -R",
                seq,
                iperf3.bytes_per_sec,
                "B/s",
                "iperf3 -R, one stream",
            )
            .with_target(0.5, false),
        );
    }
    let config = json!({
        "x": "prefetcher",
        "pages": cfg.pages,
        "page_bytes": cfg.page_bytes,
        "data_bytes": bytes,
        "access_bytes": ACCESS_BYTES,
        "local_percent": cfg.local_memory_bytes.is_none().then_some(cfg.local_percent),
        "local_pages": frames,
        "local_bytes": frames * cfg.page_bytes as u64,
        "window_pages": cfg.window_pages,
        "process": servers["process"],
        "servers": servers,
        "sides": {
            "camelot": {"process": servers["process"], "client": "camelot-farmem PageCache over RegionStore, one thread", "data_model": "64 B reads in address order"},
            "iperf3": {"process": "separate", "client": iperf3.command, "data_model": "one TCP stream, server sends"}
        },
        "quick": cfg.quick,
    });
    let mut result = BenchResult::new("prefetch", started, config, vec![series]);
    result.references = vec![Reference {
        label: "iperf3 -R".into(),
        metric: "bytes_per_sec".into(),
        value: iperf3.bytes_per_sec,
    }];
    result.comparisons = comparisons;
    let categories: Vec<String> = cfg.prefetchers.clone();
    let points: Vec<(f64, f64)> = rates
        .iter()
        .enumerate()
        .map(|(i, (_, r))| (i as f64, r / 1e6))
        .collect();
    let figure = Figure::new(&format!(
        "Sequential scan of {} MiB with {} MiB of local memory",
        bytes >> 20,
        (frames * cfg.page_bytes as u64) >> 20
    ))
    .panel(
        Panel::new("scan throughput", "prefetcher", "MB/s")
            .bars(categories)
            .line(&result.series[0].label, points)
            .references_from(&result, "bytes_per_sec", 1e-6),
    );
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}
