//! `camelot proxy` and `camelot bench middlebox`: argument parsing and glue over
//! `camelot-proxy` (the middlebox itself) and `camelot-bench` (its benches).

use anyhow::{Context, Result};
use camelot_client::{ClientConfig, ClusterMap};
use camelot_proxy::{ProxyConfig, ProxyError, ProxyServer};
use clap::{Args, Subcommand};
use std::time::Duration;
use tokio::net::TcpListener;

use crate::units::{format_bytes, parse_bytes};

#[derive(Subcommand)]
pub enum ProxyCommand {
    /// Run the proxy until SIGTERM or Ctrl-C.
    ///
    /// With --cas-to-write or --read-cache it answers from what it knows of the
    /// server's bytes, so it stops (exit status 3, "fail-stop") the moment that
    /// knowledge may be wrong: an upstream connection ends (the server died, was
    /// fenced, or a request timed out), or a lane's mutation may not have reached the
    /// server. Clients then fence the servers (`camelot proxy fence`) and go to them
    /// directly.
    Run(ProxyArgs),
    /// Print a proxy's counters.
    Stats(ProxyStatsArgs),
    /// Before clients go to the memory servers directly, past a proxy that died or is
    /// being retired: fence the servers, so nothing the proxy still had queued there
    /// runs after them, and a proxy with --cas-to-write that is still alive stops.
    Fence(ProxyFenceArgs),
}

#[derive(Args)]
pub struct ProxyFenceArgs {
    /// The memory servers (host:port, native ports) — not the proxies.
    #[arg(required = true, value_delimiter = ',')]
    servers: Vec<String>,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Args)]
pub struct ProxyArgs {
    /// Where clients connect (host:port).
    #[arg(long)]
    listen: String,
    /// The memory server behind the proxy (host:port, its native port).
    #[arg(long)]
    upstream: String,
    /// Cluster token: clients must present it, and the proxy presents it upstream.
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Carry every client's requests on N shared upstream connections, by region.
    #[arg(long, value_name = "N")]
    conn_map: Option<usize>,
    /// Turn a CAS the proxy can vouch for into a WRITE (needs --conn-map).
    #[arg(long)]
    cas_to_write: bool,
    /// Answer READs from what earlier READs and WRITEs showed (needs --conn-map).
    #[arg(long)]
    read_cache: bool,
    /// Keep each Clover key's tail and re-aim a writer's CAS at it, so the first CAS
    /// wins (needs --conn-map).
    #[arg(long)]
    write_cache: bool,
    /// Testing only: a deliberately broken write cache that answers a re-aimed CAS as
    /// won whatever the server said (the history tests show their checks catch it).
    #[arg(long, hide = true)]
    write_cache_fault: bool,
    /// Budget for what the proxy remembers (known words), over all lanes.
    #[arg(long, value_name = "BYTES", default_value = "64M", value_parser = parse_bytes)]
    memory: u64,
    /// Seconds an upstream request may take before its connection is given up (with
    /// --cas-to-write or --read-cache the proxy then stops: see `camelot proxy run
    /// --help`). Those proxies also PING each lane every second, so a server gone
    /// silent stops them within this time even when no client asks anything.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    upstream_timeout: f64,
    /// Bytes all clients' frames in flight may hold together, with room for their
    /// answers (a frame holds its share from when its length arrives until its answer
    /// is written). A client whose next frame finds it full is not read until there is
    /// room; after --client-timeout it is answered OUT_OF_MEMORY and closed. At least
    /// 128M (the largest frame and its answer).
    #[arg(long, value_name = "BYTES", default_value = "256M", value_parser = parse_bytes)]
    connection_memory: u64,
    /// Seconds a client may take to send the rest of a frame it announced, or to take an
    /// answer, or to wait for connection memory; past it the connection is closed and
    /// what it held is let go.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    client_timeout: f64,
    /// Worker threads of the proxy's runtime.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Args)]
pub struct ProxyStatsArgs {
    /// The proxy's address (host:port).
    addr: String,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Subcommand)]
pub enum MiddleboxCommand {
    /// One shared word, 1…64 clients: CAS direct against CAS→WRITE through the proxy;
    /// the proxy's operations per CPU-second beside the seed's 2.8 M per core.
    Cas(MiddleboxCasArgs),
    /// Bytes on the wire per operation each way, Clover YCSB-A zipf, direct and through a
    /// proxy with every technique (client side and server side).
    Bandwidth(MiddleboxLoadArgs),
    /// p50/p99 read and write latency, Clover zipf, 64 clients: direct, proxy
    /// pass-through, proxy with every technique.
    Tail(MiddleboxLoadArgs),
    /// Clover throughput on YCSB-A, YCSB-B and 100% write (zipf 0.99): direct, each
    /// technique, all; speed-up ÷ direct.
    FullSystem(MiddleboxLoadArgs),
    /// Speed-up ÷ Clover direct (YCSB-A zipf) vs the proxy's --memory budget.
    Memory(MiddleboxLoadArgs),
}

#[derive(Args)]
pub struct MiddleboxLoadArgs {
    /// Scaled down (1000 keys, 2 s per side).
    #[arg(long)]
    quick: bool,
    /// Client threads.
    #[arg(long)]
    clients: Option<usize>,
    /// Seconds per side.
    #[arg(long)]
    seconds: Option<f64>,
    /// Directory for the result JSON.
    #[arg(long, default_value = "results")]
    out: std::path::PathBuf,
}

#[derive(Args)]
pub struct MiddleboxCasArgs {
    /// Scaled down (4 client counts, 1 s each).
    #[arg(long)]
    quick: bool,
    /// Client counts, comma-separated.
    #[arg(long, value_delimiter = ',')]
    clients: Option<Vec<usize>>,
    /// Seconds per point.
    #[arg(long)]
    seconds: Option<f64>,
    /// Shared words each client CASes in one frame per round, in the batched point that
    /// follows the one-word points (0: no batched point).
    #[arg(long, value_name = "WORDS", default_value_t = 32)]
    batch: usize,
    /// Clients of the batched point.
    #[arg(long, value_name = "N", default_value_t = 32)]
    batch_clients: usize,
    /// Directory for middlebox-cas.json.
    #[arg(long, default_value = "results")]
    out: std::path::PathBuf,
}

pub fn bench(command: MiddleboxCommand) -> Result<()> {
    match command {
        MiddleboxCommand::Cas(a) => {
            let mut cfg = camelot_bench::middlebox::CasConfig::defaults(a.quick);
            if let Some(c) = a.clients {
                cfg.clients = c;
            }
            if let Some(s) = a.seconds {
                cfg.seconds_per_point = s;
            }
            cfg.batch_words = a.batch;
            cfg.batch_clients = a.batch_clients;
            let binary = std::env::current_exe().context("cannot tell where this program is")?;
            for path in camelot_bench::middlebox::run_cas(&cfg, &binary, &a.out)? {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        MiddleboxCommand::Bandwidth(a) => {
            let cfg = load_config(
                camelot_bench::middlebox::CloverLoadConfig::bandwidth(a.quick),
                &a,
            );
            let binary = std::env::current_exe().context("cannot tell where this program is")?;
            for path in camelot_bench::middlebox::run_bandwidth(&cfg, &binary, &a.out)? {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        MiddleboxCommand::FullSystem(a) => {
            let cfg = load_config(
                camelot_bench::middlebox::CloverLoadConfig::full_system(a.quick),
                &a,
            );
            let binary = std::env::current_exe().context("cannot tell where this program is")?;
            for path in camelot_bench::middlebox::run_full_system(&cfg, &binary, &a.out)? {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        MiddleboxCommand::Memory(a) => {
            let cfg = load_config(
                camelot_bench::middlebox::CloverLoadConfig::full_system(a.quick),
                &a,
            );
            let budgets = camelot_bench::middlebox::memory_budgets(a.quick);
            let binary = std::env::current_exe().context("cannot tell where this program is")?;
            for path in camelot_bench::middlebox::run_memory(&cfg, &budgets, &binary, &a.out)? {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        MiddleboxCommand::Tail(a) => {
            let cfg = load_config(
                camelot_bench::middlebox::CloverLoadConfig::tail(a.quick),
                &a,
            );
            let binary = std::env::current_exe().context("cannot tell where this program is")?;
            for path in camelot_bench::middlebox::run_tail(&cfg, &binary, &a.out)? {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
    }
}

fn load_config(
    mut cfg: camelot_bench::middlebox::CloverLoadConfig,
    a: &MiddleboxLoadArgs,
) -> camelot_bench::middlebox::CloverLoadConfig {
    if let Some(c) = a.clients {
        cfg.clients = c;
    }
    if let Some(s) = a.seconds {
        cfg.seconds_per_side = s;
    }
    cfg
}

pub fn run(command: ProxyCommand) -> Result<()> {
    match command {
        ProxyCommand::Run(a) => run_proxy(a),
        ProxyCommand::Stats(a) => stats(a),
        ProxyCommand::Fence(a) => fence(a),
    }
}

fn fence(a: ProxyFenceArgs) -> Result<()> {
    let addrs = a
        .servers
        .iter()
        .map(|s| crate::resolve(s))
        .collect::<Result<Vec<_>>>()?;
    let config = ClientConfig {
        token: a.token.map(String::into_bytes),
        connections_per_node: 1,
        ..ClientConfig::default()
    };
    let client = camelot_client::Client::connect(ClusterMap::from_addrs(&addrs), config)?;
    for (node, generation) in client.fence()? {
        let addr = addrs
            .get(node as usize)
            .map_or_else(String::new, |a| a.to_string());
        println!("{addr}: fenced (generation {generation})");
    }
    Ok(())
}

fn stats(a: ProxyStatsArgs) -> Result<()> {
    let addr = crate::resolve(&a.addr)?;
    let config = ClientConfig {
        token: a.token.map(String::into_bytes),
        connections_per_node: 1,
        ..ClientConfig::default()
    };
    let client = camelot_client::Client::connect(ClusterMap::from_addrs(&[addr]), config)?;
    println!("proxy {addr}");
    for (name, value) in client.stats(0)? {
        if name.ends_with("_bytes") || name.ends_with("_bytes_max") {
            println!("  {name:<28} {}", format_bytes(value));
        } else {
            println!("  {name:<28} {value}");
        }
    }
    Ok(())
}

fn run_proxy(a: ProxyArgs) -> Result<()> {
    let listen = crate::resolve(&a.listen)?;
    let upstream = crate::resolve(&a.upstream)?;
    if a.threads == 0 {
        anyhow::bail!("--threads must be at least 1");
    }
    if !(a.upstream_timeout.is_finite() && a.upstream_timeout > 0.0) {
        anyhow::bail!("--upstream-timeout must be a number of seconds above 0");
    }
    let upstream_timeout = Duration::try_from_secs_f64(a.upstream_timeout)
        .context("--upstream-timeout is too long")?;
    if !(a.client_timeout.is_finite() && a.client_timeout > 0.0) {
        anyhow::bail!("--client-timeout must be a number of seconds above 0");
    }
    let client_timeout =
        Duration::try_from_secs_f64(a.client_timeout).context("--client-timeout is too long")?;
    let config = ProxyConfig {
        upstream,
        token: a.token.map(String::into_bytes),
        conn_map: a.conn_map,
        cas_to_write: a.cas_to_write,
        read_cache: a.read_cache,
        write_cache: a.write_cache,
        write_cache_fault: a.write_cache_fault,
        memory_bytes: a.memory,
        upstream_timeout,
        connection_memory_bytes: a.connection_memory,
        client_timeout,
    };
    config.validate()?;
    // A multi-thread runtime even for one worker: a current-thread one was measured
    // against it (BENCHMARKS.md, issue 20, "batching") and was no faster — the lanes
    // coalesce as much either way (2.3 requests per frame at the server) and the
    // proxy's time goes to the kernel's send and wake-up paths, not to scheduling.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(a.threads)
        .build()
        .context("cannot start the async runtime")?;
    let served = rt.block_on(async move {
        let server = ProxyServer::connect(config).await?;
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        println!(
            "camelot proxy listening on {} for {upstream} (conn-map {}, cas-to-write {}, read-cache {}, write-cache {}, memory {})",
            listener.local_addr()?,
            a.conn_map.map_or("off".to_string(), |n| n.to_string()),
            if a.cas_to_write { "on" } else { "off" },
            if a.read_cache { "on" } else { "off" },
            if a.write_cache { "on" } else { "off" },
            format_bytes(a.memory),
        );
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("cannot install SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("cannot install Ctrl-C handler")?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        };
        anyhow::Ok(server.serve(listener, shutdown).await)
    })?;
    match served {
        Ok(()) => Ok(()),
        Err(e @ ProxyError::FailStop(_)) => {
            // Exit at once, without waiting for the runtime's tasks: clients must see
            // the proxy gone, not a proxy that answers nothing.
            eprintln!("camelot proxy: {e}");
            std::process::exit(3);
        }
        Err(e) => Err(e.into()),
    }
}
