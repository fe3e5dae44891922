//! `camelot farmem …`: far-memory tools that need no server.

use std::io::BufReader;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use camelot_bench::fault::FaultConfig;
use camelot_bench::paging::PagingConfig;
use camelot_bench::prefetch::PrefetchConfig;
use camelot_bench::sort::SortConfig;
use camelot_bench::QuickConfig;
use camelot_farmem::sim::{self, Workload};
use camelot_farmem::POLICY_NAMES;
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum FarmemCommand {
    /// Miss ratio of every eviction policy over a trace or a synthetic workload, in
    /// milliseconds and without any server: choose a policy before running anything.
    /// The policies are the page cache's own code, driven as the cache drives them.
    Simulate(SimulateArgs),
}

#[derive(Args)]
pub struct SimulateArgs {
    /// A trace: page numbers in decimal, separated by spaces or newlines; `#` comments.
    #[arg(long, conflicts_with = "workload")]
    trace: Option<PathBuf>,
    /// A synthetic workload: sequential, uniform, zipf:THETA (e.g. zipf:0.99), hotscan
    /// (a hot twentieth of the pages, then a scan of a fifth through the rest, repeated),
    /// loop (sequential, meant for a cache a little smaller than --pages).
    #[arg(long, default_value = "zipf:0.99")]
    workload: String,
    /// Distinct pages the workload ranges over.
    #[arg(long, default_value_t = 100_000)]
    pages: u64,
    /// Accesses the workload makes.
    #[arg(long, default_value_t = 1_000_000)]
    accesses: usize,
    /// Policies to compare, comma-separated, or `all` (lru, clock, fifo, random, s3fifo, arc).
    #[arg(long, default_value = "all")]
    policy: String,
    /// Cache sizes, comma-separated: a share of the trace's distinct pages (`10%`) or a
    /// page count (`2500`).
    #[arg(long, default_value = "10%")]
    cache: String,
    /// Seed for the workload and for the random policy: the same seed, the same answer.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(command: FarmemCommand) -> Result<()> {
    match command {
        FarmemCommand::Simulate(a) => simulate(a),
    }
}

fn simulate(a: SimulateArgs) -> Result<()> {
    let started = Instant::now();
    let (label, trace) = match &a.trace {
        Some(path) => {
            let file = std::fs::File::open(path)
                .with_context(|| format!("opening trace {}", path.display()))?;
            let trace = sim::read_trace(BufReader::new(file))
                .with_context(|| format!("reading trace {}", path.display()))?;
            (path.display().to_string(), trace)
        }
        None => {
            let workload = Workload::parse(&a.workload)?;
            let trace = workload.generate(a.pages, a.accesses, a.seed)?;
            (
                format!("{} over {} pages", workload.label(), a.pages),
                trace,
            )
        }
    };
    if trace.is_empty() {
        bail!("the trace has no accesses");
    }
    let policies: Vec<&str> = if a.policy == "all" {
        POLICY_NAMES.to_vec()
    } else {
        a.policy.split(',').map(str::trim).collect()
    };
    let working_set = sim::distinct_pages(&trace);
    println!(
        "{label}: {} accesses, {working_set} distinct pages (made in {} ms)",
        trace.len(),
        started.elapsed().as_millis()
    );
    println!(
        "{:>10}  {:>10}  {:<8}  {:>12}  {:>10}  {:>8}",
        "cache", "pages", "policy", "misses", "miss ratio", "ms"
    );
    for size in a.cache.split(',').map(str::trim) {
        let capacity = sim::parse_cache_pages(size, working_set)?;
        for run in sim::simulate_all(&policies, capacity, &trace, a.seed)? {
            println!(
                "{:>10}  {:>10}  {:<8}  {:>12}  {:>9.2}%  {:>8}",
                size,
                capacity,
                run.policy,
                run.counts.misses,
                run.counts.miss_ratio() * 100.0,
                run.elapsed.as_millis()
            );
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct PagingArgs {
    /// Distinct pages in the data set (held on one memory server, and locally for the
    /// all-local reference).
    #[arg(long)]
    pages: Option<u64>,
    /// Page size in bytes: a power of two, 4096 to 2 MiB.
    #[arg(long, default_value_t = 4096)]
    page_bytes: usize,
    /// Accesses per (workload, policy, local share).
    #[arg(long)]
    accesses: Option<usize>,
    /// Policies, comma-separated: lru, clock, fifo, random, s3fifo, arc.
    #[arg(long, value_delimiter = ',')]
    policy: Vec<String>,
    /// Workloads, comma-separated: sequential, uniform, zipf:THETA, hotscan, loop.
    #[arg(long, value_delimiter = ',')]
    workload: Vec<String>,
    /// Local memory as percentages of the data set, comma-separated.
    #[arg(long, value_delimiter = ',')]
    local: Vec<u32>,
    /// Prefetcher: none, sequential, trend.
    #[arg(long, default_value = "none")]
    prefetch: String,
    /// Percentage of accesses that also write their word.
    #[arg(long, default_value_t = 10)]
    writes: u8,
    #[command(flatten)]
    target: FarTarget,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    output: FarOutput,
}

pub fn bench_paging(a: PagingArgs) -> Result<()> {
    let mut cfg = PagingConfig::defaults(a.output.quick);
    if let Some(p) = a.pages {
        cfg.pages = p;
    }
    if let Some(n) = a.accesses {
        cfg.accesses = n;
    }
    if !a.policy.is_empty() {
        cfg.policies = a.policy;
    }
    if !a.workload.is_empty() {
        cfg.workloads = a.workload;
    }
    if !a.local.is_empty() {
        cfg.local_percents = a.local;
    }
    cfg.page_bytes = a.page_bytes;
    cfg.prefetch = a.prefetch;
    cfg.write_percent = a.writes;
    cfg.seed = a.seed;
    (cfg.servers, cfg.in_process, cfg.token) = a.target.resolve()?;
    let files = camelot_bench::paging::run(&cfg, &a.output.out)?;
    a.output.report(&files, print_paging_summary)
}

/// Per local share and workload: each policy's miss ratio and slowdown, best first.
fn print_paging_summary(result: &camelot_results::schema::BenchResult) {
    println!(
        "{:<28} {:<12} {:>10} {:>12} {:>10}",
        "policy, local", "workload", "miss ratio", "× all-local", "sim miss"
    );
    for s in result.series.iter().filter(|s| s.label != "all-local") {
        for p in &s.points {
            let get = |k: &str| p.extra.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
            let workload = match &p.x {
                camelot_results::schema::X::Label(l) => l.clone(),
                camelot_results::schema::X::Num(n) => n.to_string(),
            };
            println!(
                "{:<28} {:<12} {:>9.2}% {:>12.2} {:>9.2}%",
                s.label,
                workload,
                get("miss_ratio") * 100.0,
                get("slowdown_vs_all_local"),
                get("simulator_miss_ratio") * 100.0
            );
        }
    }
    // The check: on hot set + scan at the smallest local share, the better of
    // s3fifo and arc against lru, in points of miss ratio.
    let smallest = result.config["local_percents"]
        .as_array()
        .and_then(|a| a.iter().filter_map(|v| v.as_u64()).min());
    let Some(percent) = smallest else { return };
    let hotscan_misses = |policy: &str| -> Option<f64> {
        let label = format!("{policy}, {percent}% local");
        let s = result.series.iter().find(|s| s.label == label)?;
        let p = s
            .points
            .iter()
            .find(|p| matches!(&p.x, camelot_results::schema::X::Label(l) if l == "hotscan"))?;
        p.extra.get("miss_ratio")?.as_f64()
    };
    let best = ["s3fifo", "arc"]
        .into_iter()
        .filter_map(|p| Some((p, hotscan_misses(p)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    if let (Some(lru), Some((name, best))) = (hotscan_misses("lru"), best) {
        println!(
            "hotscan, {percent}% local: lru misses {:.2}%, {name} {:.2}% — {:.1} points lower (target ≥ 10 at 10% local)",
            lru * 100.0,
            best * 100.0,
            (lru - best) * 100.0
        );
    }
}

#[derive(Args)]
pub struct SortArgs {
    /// 8-byte keys to sort (default 134217728 = 1 GiB; --quick: 64 MiB).
    #[arg(long)]
    keys: Option<u64>,
    /// Local memory as percentages of the keys' bytes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100,50,25,10")]
    local: Vec<u32>,
    /// Skip the unmodified sort_unstable over a FarRegion (userfaultfd).
    #[arg(long)]
    no_region: bool,
    #[command(flatten)]
    target: FarTarget,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    output: FarOutput,
}

pub fn bench_sort(a: SortArgs) -> Result<()> {
    let mut cfg = SortConfig::defaults(a.output.quick);
    if let Some(k) = a.keys {
        cfg.keys = k;
    }
    cfg.local_percents = a.local;
    cfg.region = !a.no_region;
    cfg.seed = a.seed;
    (cfg.servers, cfg.in_process, cfg.token) = a.target.resolve()?;
    let files = camelot_bench::sort::run(&cfg, &a.output.out)?;
    a.output.report(&files, |result| {
        print!("{}", camelot_results::summary::comparison_table(result))
    })
}

#[derive(Args)]
pub struct PrefetchArgs {
    /// Pages of far memory the scan reads (default 65536 = 256 MiB of 4 KiB pages).
    #[arg(long)]
    pages: Option<u64>,
    /// Local memory as a percentage of the scanned bytes.
    #[arg(long, default_value_t = 10)]
    local: u32,
    /// Local memory as a byte budget for the page cache (e.g. 256MiB), instead of --local.
    #[arg(long, value_parser = crate::parse_bytes, conflicts_with = "local")]
    local_memory: Option<u64>,
    /// Most pages one access may prefetch (at most 256).
    #[arg(long, default_value_t = camelot_bench::prefetch::WINDOW_PAGES_DEFAULT)]
    window: u64,
    /// Prefetchers, comma-separated: none, sequential, trend.
    #[arg(long, value_delimiter = ',', default_value = "none,sequential,trend")]
    prefetch: Vec<String>,
    #[command(flatten)]
    target: FarTarget,
    #[command(flatten)]
    output: FarOutput,
}

pub fn bench_prefetch(a: PrefetchArgs) -> Result<()> {
    let mut cfg = PrefetchConfig::defaults(a.output.quick);
    if let Some(p) = a.pages {
        cfg.pages = p;
    }
    cfg.local_percent = a.local;
    cfg.local_memory_bytes = a.local_memory;
    cfg.window_pages = a.window;
    cfg.prefetchers = a.prefetch;
    (cfg.servers, cfg.in_process, cfg.token) = a.target.resolve()?;
    let files = camelot_bench::prefetch::run(&cfg, &a.output.out)?;
    a.output.report(&files, |result| {
        print!("{}", camelot_results::summary::comparison_table(result))
    })
}

#[derive(Args)]
pub struct FaultArgs {
    /// Pages each path touches, each once (default 65536 = 256 MiB of 4 KiB pages).
    #[arg(long)]
    pages: Option<u64>,
    /// Page size in bytes: a power of two, 4096 to 2 MiB.
    #[arg(long, default_value_t = 4096)]
    page_bytes: usize,
    /// Local memory as a percentage of the pages (1 to 99).
    #[arg(long, default_value_t = 10)]
    local: u32,
    /// Local memory as a byte budget for the page cache and regions (e.g. 64MiB),
    /// instead of --local.
    #[arg(long, value_parser = crate::parse_bytes, conflicts_with = "local")]
    local_memory: Option<u64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Threads faulting at once on the concurrent path (1 to 64).
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Fault-handler threads of each FarRegion (1 to 8).
    #[arg(long, default_value_t = camelot_farmem::region::FAULT_HANDLERS_DEFAULT)]
    fault_handlers: usize,
    #[command(flatten)]
    target: FarTarget,
    #[command(flatten)]
    output: FarOutput,
}

pub fn bench_fault(a: FaultArgs) -> Result<()> {
    let mut cfg = FaultConfig::defaults(a.output.quick);
    if let Some(p) = a.pages {
        cfg.pages = p;
    }
    cfg.page_bytes = a.page_bytes;
    cfg.local_percent = a.local;
    cfg.local_memory_bytes = a.local_memory;
    cfg.seed = a.seed;
    cfg.threads = a.threads;
    cfg.fault_handlers = a.fault_handlers;
    (cfg.servers, cfg.in_process, cfg.token) = a.target.resolve()?;
    let files = camelot_bench::fault::run(&cfg, &a.output.out)?;
    a.output.report(&files, |result| {
        println!(
            "{:<32} {:>10} {:>10} {:>12}",
            "path", "p50 µs", "p99 µs", "faults/s"
        );
        for p in result.series.iter().flat_map(|s| &s.points) {
            let name = match &p.x {
                camelot_results::schema::X::Label(l) => l.clone(),
                camelot_results::schema::X::Num(n) => n.to_string(),
            };
            let (p50, p99) = p.latency_us.as_ref().map_or((0.0, 0.0), |l| (l.p50, l.p99));
            println!(
                "{name:<32} {p50:>10.2} {p99:>10.2} {:>12.0}",
                p.ops_per_sec.unwrap_or(0.0)
            );
        }
        print!("{}", camelot_results::summary::comparison_table(result))
    })
}

/// Where a far-memory bench's memory server is: given, or started for the run.
#[derive(Args)]
pub struct FarTarget {
    /// Use this memory server instead of starting one (host:port).
    #[arg(long)]
    server: Option<String>,
    /// Run the memory server inside this process (labelled) instead of as a process.
    #[arg(long)]
    in_process: bool,
    /// Cluster token for --server (also read from CAMELOT_TOKEN).
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl FarTarget {
    /// (servers, in process, token) as the bench configs take them.
    fn resolve(&self) -> Result<(Vec<std::net::SocketAddr>, bool, Option<Vec<u8>>)> {
        let servers = self
            .server
            .iter()
            .map(|s| crate::resolve(s))
            .collect::<Result<_>>()?;
        Ok((
            servers,
            self.in_process,
            self.token.clone().map(String::into_bytes),
        ))
    }
}

/// How big a far-memory bench runs and where its result goes.
#[derive(Args)]
pub struct FarOutput {
    /// The same experiment scaled down to finish in under 30 s.
    #[arg(long)]
    quick: bool,
    /// Where the result JSON and its figure go.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

impl FarOutput {
    /// Prints the result (the JSON the bench wrote first) with `summary`, then the files.
    fn report(
        &self,
        files: &[PathBuf],
        summary: impl FnOnce(&camelot_results::schema::BenchResult),
    ) -> Result<()> {
        let json = files.first().context("the bench wrote no result")?;
        summary(&camelot_results::output::read_result(json)?);
        for f in files {
            println!("wrote {}", f.display());
        }
        Ok(())
    }
}
