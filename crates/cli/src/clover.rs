//! `camelot clover`: Clover's metadata server (`meta`) and a command-line store client
//! (`put`, `get`, `delete`, `stats`) over `camelot-clover`.

use anyhow::{bail, Context, Result};
use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_clover::remote::{open, RemoteConfig};
use camelot_clover::{
    Geometry, Meta, MetaConfig, MetaServer, MetaServerConfig, RegionMemory, RemoteMeta, Store,
    StoreConfig,
};
use clap::{Args, Subcommand};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

#[derive(Subcommand)]
pub enum CloverCommand {
    /// Run Clover's metadata service over memory servers until killed: it makes blocks
    /// (shared regions) on them, hands out free nodes, keeps each key's head and collects
    /// old versions; stores in any process reach it with --meta.
    Meta(MetaArgs),
    /// Write KEY's value (a new version).
    Put(PutArgs),
    /// Print KEY's value (exit status 1 if it has none).
    Get(KeyArgs),
    /// Delete KEY (a version that says "absent").
    Delete(KeyArgs),
    /// Print the metadata service's counters.
    Stats(StoreArgs),
}

#[derive(Args)]
pub struct MetaArgs {
    /// Where stores connect (host:port).
    #[arg(long)]
    listen: String,
    /// The memory servers holding the blocks (host:port, their native port),
    /// comma-separated; stores use them in this order.
    #[arg(long, value_delimiter = ',', required = true)]
    servers: Vec<String>,
    /// Proxies in front of those servers, one each, in the same order (comma-separated):
    /// the service then makes blocks, writes new keys' heads and reads for collection
    /// through them. Give it whenever stores go through caching proxies — everything
    /// that writes the regions must pass a proxy while it runs, or the proxy answers
    /// a reused node's reads from what it held before (stores then fail on that key).
    /// While a proxy is down, what needs it (new keys, new blocks, collection) fails
    /// and resumes when it is back on its address.
    #[arg(long, value_delimiter = ',')]
    via: Option<Vec<String>>,
    /// Cluster token: stores must present it, and the service presents it to servers.
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Largest value a version holds (nodes are fixed-size slots).
    #[arg(long, default_value_t = 64)]
    value_bytes: u32,
    /// Nodes per block (one region each).
    #[arg(long, default_value_t = 4096)]
    nodes_per_block: u32,
    /// Most blocks: with the two above, the store's whole memory.
    #[arg(long, default_value_t = 64)]
    blocks_max: u32,
    #[arg(long, default_value_t = camelot_clover::meta::KEYS_MAX_DEFAULT)]
    keys_max: usize,
    /// Versions of each key kept (the current one included).
    #[arg(long, default_value_t = 2)]
    versions_kept: usize,
    /// Milliseconds between collection passes.
    #[arg(long, default_value_t = 10)]
    gc_interval_ms: u64,
    /// Milliseconds a retired version waits before its node is reused.
    #[arg(long, default_value_t = 100)]
    reuse_grace_ms: u64,
    /// Stores connected at once.
    #[arg(long, default_value_t = camelot_clover::server::CONNECTIONS_MAX_DEFAULT)]
    connections_max: usize,
    /// Testing only: a deliberately broken service that grants every node twice (the
    /// history tests show their checks catch it).
    #[arg(long, hide = true)]
    fault_double_grant: bool,
}

#[derive(Args)]
pub struct StoreArgs {
    /// The metadata service (host:port).
    #[arg(long, env = "CAMELOT_CLOVER_META")]
    meta: String,
    /// Proxies in front of the memory servers, one each, in the service's order
    /// (comma-separated); without it, the servers directly.
    #[arg(long, value_delimiter = ',')]
    via: Option<Vec<String>>,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Args)]
pub struct KeyArgs {
    #[command(flatten)]
    store: StoreArgs,
    key: String,
}

#[derive(Args)]
pub struct PutArgs {
    #[command(flatten)]
    store: StoreArgs,
    key: String,
    value: String,
}

pub fn run(command: CloverCommand) -> Result<()> {
    match command {
        CloverCommand::Meta(a) => meta(a),
        CloverCommand::Put(a) => {
            let (_, mut store) = store(&a.store)?;
            store.put(a.key.as_bytes(), a.value.into_bytes())?;
            Ok(())
        }
        CloverCommand::Get(a) => {
            let (_, mut store) = store(&a.store)?;
            match store.get(a.key.as_bytes())? {
                Some(v) => {
                    println!("{}", String::from_utf8_lossy(&v));
                    Ok(())
                }
                None => {
                    eprintln!("{}: no value", a.key);
                    std::process::exit(1);
                }
            }
        }
        CloverCommand::Delete(a) => {
            let (_, mut store) = store(&a.store)?;
            store.delete(a.key.as_bytes())?;
            Ok(())
        }
        CloverCommand::Stats(a) => {
            let remote = RemoteMeta::connect(remote_config(&a)?)?;
            let info = remote.info();
            println!(
                "clover meta {} ({}-byte values, {} nodes a block, at most {} blocks; servers {})",
                a.meta,
                info.geometry.value_bytes_max,
                info.geometry.nodes_per_block,
                info.blocks_max,
                info.servers.join(",")
            );
            for (name, value) in remote.stats()? {
                println!("  {name:<30} {value}");
            }
            Ok(())
        }
    }
}

fn remote_config(a: &StoreArgs) -> Result<RemoteConfig> {
    Ok(RemoteConfig::new(
        crate::resolve(&a.meta)?,
        a.token.clone().map(String::into_bytes),
    ))
}

fn store(a: &StoreArgs) -> Result<(Arc<RemoteMeta>, Store<RegionMemory>)> {
    let via: Option<Vec<SocketAddr>> = a
        .via
        .as_ref()
        .map(|v| v.iter().map(|s| crate::resolve(s)).collect::<Result<_>>())
        .transpose()?;
    let config = ClientConfig {
        token: a.token.clone().map(String::into_bytes),
        connections_per_node: 1,
        ..ClientConfig::default()
    };
    let (remote, memory) = open(remote_config(a)?, via.as_deref(), config)
        .with_context(|| format!("cannot open the store of {}", a.meta))?;
    let store = Store::new(
        remote.clone(),
        memory,
        StoreConfig {
            // One operation: a handful of nodes, the rest given back at once.
            grant_nodes: 1,
            ..StoreConfig::default()
        },
    );
    Ok((remote, store))
}

fn meta(a: MetaArgs) -> Result<()> {
    if a.gc_interval_ms == 0 {
        bail!("--gc-interval-ms must be at least 1");
    }
    let mut addrs: Vec<SocketAddr> = a
        .servers
        .iter()
        .map(|s| crate::resolve(s))
        .collect::<Result<_>>()?;
    if let Some(via) = &a.via {
        if via.len() != addrs.len() {
            bail!(
                "--via names {} proxies for {} servers: one in front of each, in --servers' order",
                via.len(),
                addrs.len()
            );
        }
        addrs = via
            .iter()
            .map(|s| crate::resolve(s))
            .collect::<Result<_>>()?;
    }
    let token = a.token.map(String::into_bytes);
    let geometry = Geometry::new(a.value_bytes, a.nodes_per_block)?;
    let client = Client::connect(
        ClusterMap::from_addrs(&addrs),
        ClientConfig {
            token: token.clone(),
            connections_per_node: 1,
            ..ClientConfig::default()
        },
    )
    .with_context(|| {
        if a.via.is_some() {
            "cannot reach the proxies"
        } else {
            "cannot reach the memory servers"
        }
    })?;
    let mem = RegionMemory::new(client, geometry);
    let meta = Arc::new(Meta::new(
        mem,
        MetaConfig {
            blocks_max: a.blocks_max,
            keys_max: a.keys_max,
            versions_kept: a.versions_kept,
            reuse_grace: Duration::from_millis(a.reuse_grace_ms),
            fault_double_grant: a.fault_double_grant,
        },
    )?);
    let mut config = MetaServerConfig::new(a.servers.clone(), token);
    config.connections_max = a.connections_max;
    config.gc_interval = Duration::from_millis(a.gc_interval_ms);
    let server = MetaServer::new(meta, config)?;
    let listener =
        TcpListener::bind(&a.listen).with_context(|| format!("cannot listen on {}", a.listen))?;
    println!(
        "camelot clover meta listening on {} for {}{} ({}-byte values, {} nodes a block, at most {} blocks)",
        listener.local_addr()?,
        a.servers.join(","),
        a.via
            .as_ref()
            .map_or(String::new(), |v| format!(" via {}", v.join(","))),
        a.value_bytes,
        a.nodes_per_block,
        a.blocks_max,
    );
    // Runs until the process is killed: the service keeps nothing that needs flushing.
    server.serve(listener, Arc::new(AtomicBool::new(false)))?;
    Ok(())
}
