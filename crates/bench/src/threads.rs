//! `camelot bench threads`: seed 000's experiment. Throughput and latency of the request API
//! against the number of client threads, batched and unbatched.

use crate::hw::limits::{Against, Limits};
use crate::progress::Progress;
use crate::side::{sides_json, CamelotSpec, ClientSide};
use crate::workload::{self, LoadSpec, Mix, Target, DEPTH_MAX, THREADS_MAX};
use crate::BenchError;
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Reference, Series};
use serde_json::json;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Thread counts past this are almost certainly a typo on a 2-core machine.
pub const THREAD_COUNTS_MAX: usize = 64;
/// Every point runs at least this long: a quick point at 64 threads took about 0.1 s
/// otherwise, short enough for one neighbour's time slice to halve it.
pub const POINT_DURATION_MIN_DEFAULT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct ThreadsConfig {
    /// Requests per thread count, over all threads (at least; see `min_point_duration`).
    pub requests: u64,
    /// Each thread count's point goes on past `requests` until it has run this long.
    pub min_point_duration: Duration,
    pub reads_percent: u8,
    pub size_bytes: u32,
    pub threads: Vec<usize>,
    pub depth: usize,
    pub pin: bool,
    /// Pinned threads share connections only within their CPU (`ClientConfig::cpu_local`).
    pub cpu_local: bool,
    /// Tasks on one event-loop thread instead of OS threads (see `LoadSpec::event_loop`).
    pub event_loop: bool,
    /// One series per entry: `true` batched, `false` one request per frame.
    pub modes: Vec<bool>,
    /// Servers to use; empty starts `dev_nodes` servers for the run.
    pub servers: Vec<SocketAddr>,
    pub dev_nodes: usize,
    /// Start those servers inside this process instead of as `camelot server` processes
    /// (labelled in every series and in the config).
    pub in_process: bool,
    /// Bytes of the region on each node that requests land in.
    pub region_bytes: u64,
    pub token: Option<Vec<u8>>,
    pub quick: bool,
    /// This machine's limits: each point then records its share of the TCP stream limit.
    pub limits: Option<crate::hw::limits::Limits>,
}

impl Default for ThreadsConfig {
    fn default() -> Self {
        ThreadsConfig {
            requests: 1_000_000,
            min_point_duration: POINT_DURATION_MIN_DEFAULT,
            reads_percent: 50,
            size_bytes: 4096,
            threads: vec![1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64],
            depth: 1,
            pin: true,
            cpu_local: true,
            event_loop: false,
            modes: vec![true],
            servers: Vec::new(),
            dev_nodes: 1,
            in_process: false,
            region_bytes: 64 << 20,
            token: None,
            quick: false,
            limits: None,
        }
    }
}

impl ThreadsConfig {
    /// Scales the run down to finish in under 30 s on a 2-core machine.
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.requests = self.requests.min(20_000);
        if self.threads.len() > 4 {
            let keep = [1usize, 4, 16, 64];
            let mut t: Vec<usize> = self
                .threads
                .iter()
                .copied()
                .filter(|t| keep.contains(t))
                .collect();
            if t.is_empty() {
                t = self.threads.iter().copied().step_by(3).collect();
            }
            self.threads = t;
        }
        self.region_bytes = self.region_bytes.min(16 << 20);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        if self.threads.is_empty() || self.threads.len() > THREAD_COUNTS_MAX {
            return bad(format!("give 1 to {THREAD_COUNTS_MAX} thread counts"));
        }
        if let Some(t) = self.threads.iter().find(|t| **t == 0 || **t > THREADS_MAX) {
            return bad(format!("thread count {t} is outside 1..={THREADS_MAX}"));
        }
        if self.depth == 0 || self.depth > DEPTH_MAX {
            return bad(format!("depth must be 1..={DEPTH_MAX}"));
        }
        if self.reads_percent > 100 {
            return bad("--reads is a percentage".into());
        }
        if self.modes.is_empty() {
            return bad("no mode to run".into());
        }
        if self.requests < self.threads.iter().copied().max().unwrap_or(1) as u64 {
            return bad("fewer requests than threads".into());
        }
        if self.min_point_duration > workload::MIN_DURATION_MAX {
            return bad(format!(
                "points of at least {:?} are past {:?}",
                self.min_point_duration,
                workload::MIN_DURATION_MAX
            ));
        }
        if self.size_bytes as u64 + 8 > self.region_bytes {
            return bad(format!(
                "{}-byte requests do not fit a {}-byte region",
                self.size_bytes, self.region_bytes
            ));
        }
        Ok(())
    }
}

pub fn mode_label(batched: bool) -> &'static str {
    if batched {
        "batched"
    } else {
        "unbatched"
    }
}

/// Runs the experiment and writes `threads.json`, `threads.png` and `threads.svg`.
pub fn run(cfg: &ThreadsConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    let started = now_rfc3339();
    // The region plus headroom for the allocator's page rounding.
    let mut spec = CamelotSpec::new(cfg.dev_nodes, cfg.region_bytes + (1 << 20));
    spec.token = cfg.token.clone();
    let target = Target::open(&cfg.servers, &spec, cfg.in_process)?;
    let total = cfg.requests * cfg.threads.len() as u64 * cfg.modes.len() as u64;
    let progress = Progress::new(total, "threads");
    let mut series = Vec::new();
    for &batched in &cfg.modes {
        let client = target.connect_with(camelot_client::ClientConfig {
            batching: batched,
            cpu_local: cfg.cpu_local,
            ..Default::default()
        })?;
        let regions = workload::regions_on_every_node(&client, cfg.region_bytes)?;
        let mut s = Series::new(target.label(mode_label(batched)));
        for &threads in &cfg.threads {
            progress.set_message(&format!("{} · {threads} threads", mode_label(batched)));
            let spec = LoadSpec {
                threads,
                depth: cfg.depth,
                requests: cfg.requests,
                min_duration: cfg.min_point_duration,
                mix: Mix {
                    reads_percent: cfg.reads_percent,
                    fetch_add_percent: 0,
                },
                sizes_bytes: vec![cfg.size_bytes],
                pin: cfg.pin,
                event_loop: cfg.event_loop,
                seed: threads as u64,
            };
            let m = target.run_load(&client, &regions, &spec, Some(&progress))?;
            let mut p = Point::new(threads);
            p.ops_per_sec = Some(m.ops_per_sec());
            p.bytes_per_sec = Some(m.bytes_per_sec());
            p.latency_us = Some(m.latency.summary());
            p.extra.insert("reads".into(), json!(m.reads));
            p.extra.insert("writes".into(), json!(m.writes));
            for (k, v) in m.run_extra().into_iter().chain(m.cpu_extra()) {
                p.extra.insert(k.into(), v);
            }
            if let Some(l) = &cfg.limits {
                l.annotate_network_point(&mut p);
            }
            s.points.push(p);
        }
        workload::free_all(&client, &regions)?;
        series.push(s);
    }
    progress.finish();
    let servers = target.describe();
    let side = target.side(
        "camelot",
        ClientSide {
            client: format!(
                "camelot-client ({})",
                cfg.modes
                    .iter()
                    .map(|b| mode_label(*b))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            // The x axis: each point has its own count; the side records the largest.
            client_threads: cfg.threads.iter().copied().max().unwrap_or(1),
            depth: cfg.depth,
            data_model: format!(
                "{} B region READ/WRITE, {}% reads",
                cfg.size_bytes, cfg.reads_percent
            ),
            resp_face: false,
        },
    );
    target.close()?;

    let config = json!({
        "x": "threads",
        "requests": cfg.requests,
        "min_point_seconds": cfg.min_point_duration.as_secs_f64(),
        "reads_percent": cfg.reads_percent,
        "size_bytes": cfg.size_bytes,
        "threads": cfg.threads,
        "depth": cfg.depth,
        "pinned": cfg.pin,
        "cpu_local": cfg.cpu_local,
        "modes": cfg.modes.iter().map(|b| mode_label(*b)).collect::<Vec<_>>(),
        "process": servers["process"],
        "servers": servers,
        "sides": sides_json(&[side]),
        "region_bytes": cfg.region_bytes,
        "quick": cfg.quick,
    });
    let mut config = config;
    if let Some(limit) = cfg.limits.as_ref().and_then(|l| l.tcp_stream_bytes_per_sec) {
        config["tcp_stream_limit_bytes_per_sec"] = json!(limit);
    }
    let mut result = BenchResult::new("threads", started, config, series);
    if let Some(l) = &cfg.limits {
        result.references = limit_references(l);
    }
    Ok(output::write_result_with_figure(
        out,
        &result,
        &figure(&result, cfg),
    )?)
}

/// Seed 000's figure: latency and throughput against threads, one line per mode.
fn figure(result: &BenchResult, cfg: &ThreadsConfig) -> Figure {
    let mut latency = Panel::new("latency", "client threads", "latency (µs)").log_y();
    let mut throughput = Panel::new("throughput", "client threads", "throughput (MB/s)");
    for s in &result.series {
        latency = latency.percentile_lines(s);
        throughput = throughput.line(
            &s.label,
            series_points(s, |p| p.bytes_per_sec.map(|b| b / 1e6)),
        );
    }
    let latency = latency.references_from(result, "latency_us.", 1.0);
    let throughput = throughput.references_from(result, "bytes_per_sec", 1e-6);
    Figure::new(&format!(
        "Request API: {} B requests, {}% reads, depth {}",
        cfg.size_bytes, cfg.reads_percent, cfg.depth
    ))
    .panel(latency)
    .panel(throughput)
}

/// The machine's measured network limits as lines a figure draws: the TCP stream over
/// its throughput, the TCP ping-pong p50 under its latency. Unmeasured ones are left out.
pub fn limit_references(limits: &Limits) -> Vec<Reference> {
    let mut refs = Vec::new();
    if let Some(v) = limits.tcp_stream_bytes_per_sec {
        refs.push(Reference {
            label: "TCP stream limit (limits.json)".into(),
            metric: "bytes_per_sec".into(),
            value: v,
        });
    }
    if let Some(v) = limits.tcp_pingpong_us_p50 {
        refs.push(Reference {
            label: "TCP ping-pong p50 limit (limits.json)".into(),
            metric: "latency_us.p50".into(),
            value: v,
        });
    }
    refs
}

/// One line per series: its best throughput as a share of the machine's TCP stream limit.
pub fn limits_summary(result: &BenchResult) -> Vec<String> {
    let against = Against::TcpStream;
    result
        .series
        .iter()
        .filter_map(|s| {
            let best = s
                .points
                .iter()
                .filter_map(|p| Some((p.extra.get(against.key())?.as_f64()?, p)))
                .max_by(|a, b| a.0.total_cmp(&b.0))?;
            Some(format!(
                "{}: best {:.0} MB/s at {} threads = {}",
                s.label,
                best.1.bytes_per_sec.unwrap_or(0.0) / 1e6,
                best.1.x.as_f64().unwrap_or(0.0),
                against.describe(best.0)
            ))
        })
        .collect()
}
