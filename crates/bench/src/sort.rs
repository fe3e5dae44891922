//! `camelot bench sort` (seed 000's *sortPerformance*): sorting N 8-byte keys held on a
//! memory server process with a given share of local memory — the far-memory sort of
//! `camelot_farmem::sort` over FarVecs — against `sort_unstable` over the same keys held
//! wholly in local memory, in the same run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use camelot_farmem::sort::sort_far;
use camelot_farmem::{CacheConfig, FarRegion, FarVec, PageCache, PageStore, RegionStore};
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Comparison, Point, Reference, Series};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::side::CamelotSpec;
use crate::workload::Target;
use crate::BenchError;

/// Keys a sort run holds at most (8 GiB of them).
pub const SORT_KEYS_MAX: u64 = 1 << 30;
const PAGE_BYTES: usize = 4096;
/// Each FarVec's own page cache (the run and merge buffers are the local memory budget).
const FARVEC_CACHE_BYTES: u64 = 2 << 20;
/// The FarRegion's pages: larger than the FarVec's, as `sort_unstable`'s partitions scan
/// memory in order and each fault then brings in more of what comes next.
const REGION_PAGE_BYTES: usize = 64 << 10;

#[derive(Debug, Clone)]
pub struct SortConfig {
    pub keys: u64,
    pub local_percents: Vec<u32>,
    pub servers: Vec<SocketAddr>,
    pub in_process: bool,
    pub token: Option<Vec<u8>>,
    pub seed: u64,
    /// Also sort with unmodified `sort_unstable` over a FarRegion (userfaultfd).
    pub region: bool,
    pub quick: bool,
}

impl Default for SortConfig {
    fn default() -> Self {
        SortConfig {
            keys: 128 << 20, // 1 GiB
            local_percents: vec![100, 50, 25, 10],
            servers: Vec::new(),
            in_process: false,
            token: None,
            seed: 1,
            region: true,
            quick: false,
        }
    }
}

impl SortConfig {
    /// 64 MiB of keys.
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.keys = self.keys.min(8 << 20);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if self.keys < 4096 || self.keys > SORT_KEYS_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "4096 to {SORT_KEYS_MAX} keys, not {}",
                self.keys
            )));
        }
        if self.local_percents.is_empty() || self.local_percents.iter().any(|p| *p == 0 || *p > 100)
        {
            return Err(BenchError::InvalidConfig(
                "local shares are percentages in 1..=100".into(),
            ));
        }
        Ok(())
    }
}

fn keys(n: u64, seed: u64) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen()).collect()
}

fn far_vec(
    client: &camelot_client::Client,
    region: &camelot_client::Region,
    keys: u64,
) -> Result<FarVec<u64, RegionStore>, BenchError> {
    let store = RegionStore::new(client.clone(), region.clone(), PAGE_BYTES)
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    let cache = PageCache::new(store, &CacheConfig::new(FARVEC_CACHE_BYTES))
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    FarVec::new(cache, keys).map_err(|e| BenchError::Setup(e.to_string()))
}

pub fn run(cfg: &SortConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    let bytes = cfg.keys * 8;
    let data = keys(cfg.keys, cfg.seed);
    // The all-local reference: the same keys, wholly local.
    let mut local = data.clone();
    let t = Instant::now();
    local.sort_unstable();
    let local_seconds = t.elapsed().as_secs_f64();
    drop(local);

    let mut spec = CamelotSpec::new(1, 2 * bytes + (64 << 20));
    spec.token = cfg.token.clone();
    let target = Target::open(&cfg.servers, &spec, cfg.in_process)?;
    let client = target.connect(true)?;
    let input_region = client.alloc(bytes, None)?;
    let output_region = client.alloc(bytes, None)?;
    let mut series = Series::new(target.label("FarVec sort (runs + k-way merge)"));
    let mut region_series = Series::new(target.label("sort_unstable over a FarRegion"));
    let mut comparisons = Vec::new();
    let mut percents = cfg.local_percents.clone();
    percents.sort_unstable_by(|a, b| b.cmp(a));
    for &percent in &percents {
        let input = far_vec(&client, &input_region, cfg.keys)?;
        let output = far_vec(&client, &output_region, cfg.keys)?;
        // Loading the keys is not timed: they are in far memory before the sort starts.
        for chunk in 0..data.len().div_ceil(1 << 20) {
            let from = chunk << 20;
            let until = (from + (1 << 20)).min(data.len());
            input
                .write_slice(from as u64, &data[from..until])
                .map_err(|e| BenchError::Setup(e.to_string()))?;
        }
        input
            .flush()
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        let local_elements = ((cfg.keys * percent as u64) / 100).max(1024) as usize;
        let (read_before, written_before) = (input.traffic(), output.traffic());
        let t = Instant::now();
        let stats = sort_far(&input, &output, local_elements)
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        output
            .flush()
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        let seconds = t.elapsed().as_secs_f64();
        // Checked, not trusted: every key in order, and as many as went in.
        let mut previous = 0u64;
        let mut count = 0u64;
        for chunk in output.chunks(1 << 20) {
            let chunk = chunk.map_err(|e| BenchError::Setup(e.to_string()))?;
            if chunk.first().is_some_and(|f| *f < previous) || chunk.windows(2).any(|w| w[0] > w[1])
            {
                return Err(BenchError::Check(format!(
                    "the output at {percent}% local is not sorted"
                )));
            }
            previous = chunk.last().copied().unwrap_or(previous);
            count += chunk.len() as u64;
        }
        if count != cfg.keys {
            return Err(BenchError::Check(format!(
                "{count} keys out of {}",
                cfg.keys
            )));
        }
        let (read_after, written_after) = (input.traffic(), output.traffic());
        let remote_bytes = (read_after.0 - read_before.0)
            + (read_after.1 - read_before.1)
            + (written_after.0 - written_before.0)
            + (written_after.1 - written_before.1);
        let mut p = Point::new(percent as f64);
        p.ops_per_sec = Some(cfg.keys as f64 / seconds.max(1e-9));
        for (k, v) in [
            ("runtime_seconds", json!(seconds)),
            ("all_local_runtime_seconds", json!(local_seconds)),
            (
                "slowdown_vs_all_local",
                json!(seconds / local_seconds.max(1e-9)),
            ),
            ("runs", json!(stats.runs)),
            ("remote_bytes", json!(remote_bytes)),
            (
                "local_bytes",
                json!(local_elements as u64 * 8 + 2 * FARVEC_CACHE_BYTES),
            ),
        ] {
            p.extra.insert(k.into(), v);
        }
        series.points.push(p);
        let target_ratio = match percent {
            50 => Some(1.5),
            25 => Some(3.0),
            _ => None,
        };
        let c = Comparison::new(
            format!("sort time at {percent}% local ÷ all-local sort_unstable"),
            seconds,
            local_seconds,
            "s",
            "sort_unstable, all keys local",
        );
        comparisons.push(match target_ratio {
            Some(t) => c.with_target(t, true),
            None => c,
        });
    }
    client.free(&input_region)?;
    client.free(&output_region)?;
    if cfg.region {
        let whole = bytes.div_ceil(REGION_PAGE_BYTES as u64) * REGION_PAGE_BYTES as u64;
        let region = client.alloc(whole, None)?;
        for &percent in &percents {
            let (p, c) = region_sort(&client, &region, &data, percent, local_seconds)?;
            region_series.points.push(p);
            comparisons.push(c);
        }
        client.free(&region)?;
    }
    let servers = target.describe();
    target.close()?;
    let config = json!({
        "x": "local memory (% of the keys)",
        "keys": cfg.keys,
        "key_bytes": 8,
        "data_bytes": bytes,
        "local_percents": percents,
        "page_bytes": PAGE_BYTES,
        "farvec_cache_bytes": FARVEC_CACHE_BYTES,
        "region_page_bytes": REGION_PAGE_BYTES,
        "region_prefetch": "sequential",
        "seed": cfg.seed,
        "process": servers["process"],
        "servers": servers,
        "sides": {
            "camelot": {"process": servers["process"], "client": "camelot_farmem::sort::sort_far over two FarVecs (input, output regions): sorting and merging on one thread; the merge's far reads and writes on one reader and one writer thread that only move bytes", "data_model": "random u64 keys"},
            "camelot FarRegion": {"process": servers["process"], "client": "slice::sort_unstable over a FarRegion (userfaultfd) on one region, one thread", "data_model": "the same keys"},
            "all-local": {"process": "in-process", "client": "slice::sort_unstable, one thread", "data_model": "the same keys"}
        },
        "quick": cfg.quick,
    });
    let mut all_series = vec![series];
    if cfg.region {
        all_series.push(region_series);
    }
    let mut result = BenchResult::new("sort", started, config, all_series);
    result.references = vec![Reference {
        label: "all-local sort_unstable".into(),
        metric: "ops_per_sec".into(),
        value: cfg.keys as f64 / local_seconds.max(1e-9),
    }];
    result.comparisons = comparisons;
    let figure = Figure::new(&format!(
        "Sort: {} keys of 8 B ({} MiB) over far memory",
        cfg.keys,
        bytes >> 20
    ))
    .panel({
        let mut panel = Panel::new("sort throughput", "local memory (% of the keys)", "Mkeys/s");
        for s in &result.series {
            panel = panel.line(
                &s.label,
                series_points(s, |p| p.ops_per_sec.map(|v| v / 1e6)),
            );
        }
        panel.references_from(&result, "ops_per_sec", 1e-6)
    });
    Ok(output::write_result_with_figure(out, &result, &figure)?)
}

/// `sort_unstable`, unmodified, over the keys in a FarRegion with `percent` local: the
/// keys are written to the region's store first (untimed), the sort and the flush of its
/// dirty pages are timed, and the order is checked after.
fn region_sort(
    client: &camelot_client::Client,
    region: &camelot_client::Region,
    data: &[u64],
    percent: u32,
    local_seconds: f64,
) -> Result<(Point, Comparison), BenchError> {
    let setup = |e: camelot_farmem::Error| BenchError::Setup(e.to_string());
    let bytes = data.len() * 8;
    let store =
        RegionStore::new(client.clone(), region.clone(), REGION_PAGE_BYTES).map_err(setup)?;
    let whole = bytes.div_ceil(REGION_PAGE_BYTES) * REGION_PAGE_BYTES;
    let mut image = bytemuck::cast_slice::<u64, u8>(data).to_vec();
    image.resize(whole, 0);
    store.write_run(0, &image).map_err(setup)?;
    drop(image);
    let local_bytes = (bytes as u64 * percent as u64 / 100).max(2 * REGION_PAGE_BYTES as u64);
    let mut config = CacheConfig::new(local_bytes);
    config.prefetch = "sequential".into();
    config.prefetch_window_pages = 8;
    let mut far = FarRegion::new(store, &config).map_err(setup)?;
    let t = Instant::now();
    let keys: &mut [u64] = bytemuck::cast_slice_mut(&mut far.bytes_mut()[..bytes]);
    keys.sort_unstable();
    far.flush().map_err(setup)?;
    let seconds = t.elapsed().as_secs_f64();
    let keys: &[u64] = bytemuck::cast_slice(&far.bytes()[..bytes]);
    if keys.windows(2).any(|w| w[0] > w[1]) {
        return Err(BenchError::Check(format!(
            "sort_unstable over the FarRegion at {percent}% local left keys out of order"
        )));
    }
    let stats = far.stats();
    let (read, written) = far.traffic_bytes();
    let mut p = Point::new(percent as f64);
    p.ops_per_sec = Some(data.len() as f64 / seconds.max(1e-9));
    for (k, v) in [
        ("runtime_seconds", json!(seconds)),
        ("all_local_runtime_seconds", json!(local_seconds)),
        (
            "slowdown_vs_all_local",
            json!(seconds / local_seconds.max(1e-9)),
        ),
        ("missing_faults", json!(stats.missing_faults)),
        ("write_faults", json!(stats.write_faults)),
        ("remote_bytes", json!(read + written)),
        ("local_bytes", json!(local_bytes)),
    ] {
        p.extra.insert(k.into(), v);
    }
    let c = Comparison::new(
        format!("sort_unstable over a FarRegion at {percent}% local ÷ all-local"),
        seconds,
        local_seconds,
        "s",
        "sort_unstable, all keys local",
    );
    Ok((p, c))
}
