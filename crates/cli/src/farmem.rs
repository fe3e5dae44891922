//! `camelot farmem …`: far-memory tools that need no server.

use std::io::BufReader;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
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
