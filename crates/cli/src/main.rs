//! `camelot`: thin glue over the libraries. Argument parsing, logging, signals and
//! printing live here; everything else lives in a library crate.
#![forbid(unsafe_code)]

mod chaos;
mod clover;
mod cluster;
mod cluster_bench;
mod farmem;
mod proxy;
mod testbed;
mod testbed_bench;
mod units;

use anyhow::{anyhow, bail, Context, Result};
use camelot_bench::threads::ThreadsConfig;
use camelot_client::{Client, ClientConfig, ClientError, ClusterMap};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use camelot_server::{ServerConfig, ServerHandle};
use clap::{Args, Parser, Subcommand};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use units::{format_bytes, parse_bytes};

#[derive(Parser)]
#[command(
    name = "camelot",
    version,
    about = "Camelot pools the RAM of many machines and serves it back to applications.",
    long_about = "Camelot pools the RAM of many machines and serves it back to applications.\n\n\
                  Start with `camelot demo` (a 3-node cluster on this machine, a short \
                  workload, a summary), then `camelot dev` to keep a cluster running and \
                  `camelot bench threads` to measure the request API."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one memory server until SIGTERM or Ctrl-C.
    Server(ServerArgs),
    /// Print a server's counters: memory used/cap, regions, connections, ops by kind.
    Stats(StatsArgs),
    /// Run N memory servers on loopback until Ctrl-C and print their addresses.
    Dev(DevArgs),
    /// Start a 3-node cluster here, run a short mixed workload across it, print a summary.
    Demo(DemoArgs),
    /// Run an experiment and write its results (JSON + figure) to --out.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Turn every result JSON in DIR into DIR/index.html: machine, figures, tables.
    Report(ReportArgs),
    /// Far memory: the page cache's eviction policies, without a server.
    #[command(subcommand)]
    Farmem(farmem::FarmemCommand),
    /// Block volumes striped over memory servers (raid0/1/4/5, rs:K+M): create, status,
    /// rebuild, scrub, read and write.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// A cluster on etcd: `up` (etcd, N servers, the map), `status`, `plan`.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// An emulated network on this machine (namespaces, a bridge, rate limits) and
    /// faults injected into it. Needs root.
    #[command(subcommand)]
    Testbed(testbed::TestbedCommand),
    /// Memory servers in a testbed, a recorded workload, seeded faults, then checkers:
    /// PASS/FAIL with the seed to replay. Needs root.
    Chaos(chaos::ChaosArgs),
    /// The client side of `chaos`, run by it on a testbed host.
    #[command(hide = true)]
    ChaosWorker(chaos::WorkerArgs),
    /// The read client of `bench testbed`, run by it on each path.
    #[command(hide = true)]
    BenchTestbedClient(testbed_bench::ClientArgs),
    /// One host's delay/loss relay, started by `testbed up` in the switch namespace.
    #[command(hide = true, name = camelot_testbed::RELAY_SUBCOMMAND)]
    TestbedRelay(testbed::RelayArgs),
    /// A middlebox between clients and one memory server: pass-through, connection
    /// mapping, CAS→WRITE (`camelot proxy run --help`), and its counters.
    #[command(subcommand)]
    Proxy(proxy::ProxyCommand),
    /// Clover, the one-sided key-value store: its metadata service (`meta`) and a store
    /// client (`put`, `get`, `delete`, `stats`).
    #[command(subcommand)]
    Clover(clover::CloverCommand),
}

#[derive(Subcommand)]
enum VolumeCommand {
    /// Create a volume from one region on each server, e.g.
    /// `camelot volume create --level raid5 --servers a,b,c,d --size 1GiB NAME`.
    Create(VolumeCreateArgs),
    /// Members, their state, whether the volume is degraded, and the progress of a
    /// rebuild another process runs (its record is at most a second old while it runs).
    /// Reads only: safe while another process serves or rebuilds the volume.
    Status(VolumeRef),
    /// Rebuild a lost member onto a replacement server (or the same one restarted):
    /// `--replace OLD=NEW`, addresses as host:port.
    Rebuild(VolumeRebuildArgs),
    /// Read every stripe, check parity against data, repair mismatches from data.
    Scrub(VolumeScrubArgs),
    /// Write LEN bytes at OFFSET to stdout, raw.
    Read(VolumeReadArgs),
    /// Write stdin's bytes at OFFSET (at most to the volume's end).
    Write(VolumeWriteArgs),
    /// Export the volume over NBD (fixed newstyle) until SIGTERM/Ctrl-C, for stock tools:
    /// `nbdinfo nbd://127.0.0.1:10809`, `nbdcopy disk.img nbd://127.0.0.1:10809`. The
    /// export answers to the volume's name and to the empty (default) name.
    ServeNbd(VolumeServeNbdArgs),
}

#[derive(Args)]
struct VolumeRef {
    /// The volume's name.
    name: String,
    /// Any one member server (host:port): the superblock there names the others.
    #[arg(long, env = "CAMELOT_VOLUME_SERVER")]
    server: String,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Args)]
struct VolumeCreateArgs {
    /// The volume's name ([A-Za-z0-9._-], at most 64 bytes).
    name: String,
    /// raid0, raid1 (n-way mirror), raid4, raid5 or rs:K+M (K data, M parity, K+M servers).
    #[arg(long)]
    level: String,
    /// Member servers (host:port), comma-separated, one region on each.
    #[arg(long, value_delimiter = ',', required = true)]
    servers: Vec<String>,
    /// Data capacity (rounded up to whole stripes), e.g. 1GiB.
    #[arg(long, value_parser = parse_bytes)]
    size: u64,
    /// Chunk size: a power of two from 4K to 4M.
    #[arg(long, default_value = "64K", value_parser = parse_bytes)]
    chunk: u64,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Args)]
struct VolumeRebuildArgs {
    #[command(flatten)]
    volume: VolumeRef,
    /// OLD=NEW: the lost member's address and the server to rebuild it on.
    #[arg(long)]
    replace: String,
    /// Most bytes a second the rebuild writes (e.g. 200M); 0: unlimited.
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    rate: u64,
}

#[derive(Args)]
struct VolumeScrubArgs {
    #[command(flatten)]
    volume: VolumeRef,
    /// Only report mismatches; do not rewrite parity.
    #[arg(long)]
    no_repair: bool,
}

#[derive(Args)]
struct VolumeReadArgs {
    #[command(flatten)]
    volume: VolumeRef,
    #[arg(long, value_parser = parse_bytes)]
    offset: u64,
    #[arg(long, value_parser = parse_bytes)]
    len: u64,
}

#[derive(Args)]
struct VolumeWriteArgs {
    #[command(flatten)]
    volume: VolumeRef,
    #[arg(long, value_parser = parse_bytes)]
    offset: u64,
}

#[derive(Args)]
struct VolumeServeNbdArgs {
    #[command(flatten)]
    volume: VolumeRef,
    /// Address to listen on (host:port). Loopback only unless --allow-non-loopback.
    #[arg(long, default_value = "127.0.0.1:10809")]
    listen: String,
    /// Listen beyond loopback. NBD carries no authentication: anyone who reaches the port
    /// reads and writes the volume.
    #[arg(long)]
    allow_non_loopback: bool,
    /// Most clients served at once (nbdcopy opens four); one more is hung up on.
    #[arg(long, default_value_t = camelot_blocks::nbd::CONNECTIONS_MAX_DEFAULT)]
    connections_max: usize,
    /// Refuse writes, trims and zeroing (EPERM).
    #[arg(long)]
    read_only: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RaidKind {
    /// GB/s of XOR and Reed–Solomon encode and decode on one core (no network).
    Encode,
    /// raid0, raid1, raid4, raid5, rs:4+2 over real servers: full-stripe write, 4 KiB
    /// random write and read, degraded read, memory overhead (seed 000's RaidComparison).
    Compare,
    /// raid4 (5 servers) against raid0 (4): sequential and 4 KiB random reads and
    /// writes at 1, 2, 4, 8 threads, an iperf3 stream beside (seed 000's Raid4Overhead).
    Overhead,
    /// raid5 under a 4 KiB 50/50 load: a member's server killed, then rebuilt onto a
    /// fresh one while the load runs; rebuild rate against iperf3, the load's dip.
    Rebuild,
}

#[derive(Args)]
struct RaidArgs {
    #[arg(value_enum)]
    kind: RaidKind,
    /// Scaled down to finish in seconds.
    #[arg(long)]
    quick: bool,
    /// compare, rebuild: client threads; overhead: thread counts, comma-separated.
    #[arg(long, value_delimiter = ',')]
    threads: Option<Vec<usize>>,
    /// compare: run the servers inside this process (labelled) instead of as
    /// `camelot server` processes.
    #[arg(long)]
    in_process: bool,
    /// rebuild: most bytes a second the rebuild writes (e.g. 100M); 0: unlimited.
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    rate: u64,
    /// Directory for raid-<kind>.json and its figure.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
struct ReportArgs {
    /// Directory of results written by `camelot bench … --out DIR`.
    dir: PathBuf,
}

#[derive(Args)]
struct ServerArgs {
    /// Address to listen on for the native protocol.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// Memory cap for regions and objects (e.g. 512M, 4G). Allocations past it are refused
    /// with OUT_OF_MEMORY (Redis port: -OOM). Connection buffers have a cap of their own,
    /// --connection-memory; the server's memory stays within the two plus a small
    /// constant (see README, "Server limits").
    #[arg(long, default_value = "1G", value_parser = parse_bytes, allow_hyphen_values = true)]
    memory: u64,
    /// Memory cap for all connections' input and output buffers together, on both ports.
    /// A connection whose buffers would pass it (a huge request, or replies a client does
    /// not read) gets an error and is closed; `camelot stats` shows it as "buffers".
    #[arg(long, value_name = "BYTES", default_value = "256M", value_parser = parse_bytes, allow_hyphen_values = true)]
    connection_memory: u64,
    /// Cluster token clients must present (also read from CAMELOT_TOKEN).
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Most concurrent client connections, both ports together.
    #[arg(long, default_value_t = camelot_server::CONNECTIONS_MAX_DEFAULT as i64, allow_hyphen_values = true)]
    connections_max: i64,
    /// Of those, most that may be open before authenticating (native: before HELLO;
    /// Redis port with a token: before AUTH). A new one arriving when that many wait
    /// takes the oldest one's place, so idle sockets cannot lock real clients out. Default: 64, or half of --connections-max if
    /// that is lower.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    unauth_connections_max: Option<i64>,
    /// Seconds a new connection has to authenticate before it is closed.
    #[arg(long, value_name = "SECONDS", default_value_t = camelot_server::HANDSHAKE_TIMEOUT_DEFAULT.as_secs_f64(), allow_hyphen_values = true)]
    auth_timeout: f64,
    /// Close a connection on which nothing arrives, or which takes none of our replies,
    /// for this many seconds. 0 (default): never, like Redis's `timeout 0`.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0.0,
        allow_hyphen_values = true
    )]
    idle_timeout: f64,
    /// Worker threads serving the native protocol (0: one per core). Benchmarks set it
    /// to match a peer's thread budget.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Also serve the Redis protocol (RESP2, RESP3 after HELLO 3) on this address, over the same objects, so
    /// redis-cli, redis-benchmark and Redis client libraries work unchanged. With a
    /// token, clients must AUTH with it.
    #[arg(long, value_name = "ADDR")]
    resp_listen: Option<String>,
    /// Event-loop threads for the Redis port, each single-threaded like Redis's own;
    /// 0 serves it on the worker pool the native port uses.
    #[arg(long, default_value_t = camelot_server::RESP_THREADS_DEFAULT)]
    resp_threads: usize,
    /// Microseconds each Redis-port event loop keeps polling after its last command, so
    /// a busy client's next request needs no wake-up; it stops by itself while other
    /// programs want the CPU. 0: sleep at once, as Redis does. At most 10000.
    #[arg(long, value_name = "US", default_value_t = camelot_server::resp::SPIN_IDLE_DEFAULT.as_micros() as u64)]
    resp_poll_us: u64,
    /// Executed operations per second over both ports together (a token bucket): makes
    /// this server a slow node, where cgroup v2 `cpu.max` is not available. Unset: no
    /// limit.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=camelot_server::throttle::OPS_PER_SEC_MAX))]
    ops_per_sec_max: Option<u64>,
    /// Longest argument (bulk string) the Redis port reads, in bytes: Redis's
    /// `proto-max-bulk-len`, with its default. Longer ones are a protocol error and a
    /// close. Values stored are still capped at 32 MiB (an error reply, not a close).
    #[arg(long, value_name = "BYTES", default_value_t = camelot_server::resp::codec::PROTO_MAX_BULK_LEN_DEFAULT)]
    proto_max_bulk_len: usize,
    /// Refuse to start without a token. Without this flag a server listening beyond
    /// loopback with no token starts, but warns (in its log and in `camelot stats`).
    #[arg(long)]
    require_token: bool,
    /// Most region bytes one principal (a client's HELLO name) may hold (e.g. 256M);
    /// past it ALLOC answers QUOTA_EXCEEDED. Default: no limit but --memory.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    quota_bytes: Option<u64>,
    /// Most regions one principal may hold at once. Default: no limit.
    #[arg(long, value_name = "N")]
    quota_regions: Option<u64>,
    #[command(flatten)]
    cluster: cluster::MemberArgs,
    /// A file of `NAME TOKEN` lines (`#` comments): each principal listed there is let in
    /// only with its own token, not the cluster token, so its private regions are private
    /// from other holders of the cluster token too. `anonymous` may be listed. The file
    /// must not be readable by group or others (chmod 600).
    #[arg(long, value_name = "FILE")]
    principal_tokens: Option<std::path::PathBuf>,
}

#[derive(Args)]
struct StatsArgs {
    /// Server address (host:port): its native port, not its Redis port.
    addr: String,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Seconds to wait for the server to connect and answer the handshake.
    #[arg(long, value_name = "SECONDS", default_value_t = 2.0)]
    timeout: f64,
}

#[derive(Args)]
struct DevArgs {
    /// Number of servers.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Memory cap per server.
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    memory: u64,
    /// First port (node i gets base+i); default: ports the OS picks.
    #[arg(long)]
    base_port: Option<u16>,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Args)]
struct DemoArgs {
    /// Requests in the workload.
    #[arg(long, default_value_t = 200_000)]
    requests: u64,
    /// Client threads.
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// The machine's limits (from `bench hw all --save`); default: results/limits.json.
    #[arg(long)]
    limits: Option<PathBuf>,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Request-API throughput and latency against client threads (seed 000's figure).
    Threads(ThreadsArgs),
    /// The request API's targets, each beside its peer in the same run: 4 KiB READs vs an
    /// iperf3 -R stream (one direction), 64 B READs vs redis-benchmark GETs of 64 B (and
    /// ops per server CPU-second), sockperf ping-pong, batching on vs off, no collapse at
    /// 64 threads.
    Api(ApiArgs),
    /// This machine's own limits (seed 003): CPU, memory, network over loopback.
    Hw(HwArgs),
    /// YCSB's core workloads (A–F, and W: 100% update) against Camelot, its Redis port,
    /// redis-server and memcached under one harness; every read is checked.
    Ycsb(YcsbArgs),
    /// redis-benchmark against Camelot's Redis-protocol port (as shipped, and as Redis
    /// runs: --resp-poll-us 0 --threads 1) and a real redis-server in the same run, each
    /// a process of its own with its CPU seconds metered; ratios of throughput and of ops
    /// per server CPU-second are the figures.
    Resp(RespArgs),
    /// RVM commit time against pages modified, per backend (seed 001), beside iperf3,
    /// sockperf and redis-benchmark measured in the same run.
    RvmCommit(RvmArgs),
    /// RVM recovery time against pages, per backend (seed 001), beside iperf3.
    RvmRecovery(RvmArgs),
    /// 4 KiB batched reads and sockperf's RTT over loopback and between two testbed
    /// hosts on a rate-limited link (seed 000's emulated vs real). Needs root.
    Testbed(testbed_bench::BenchTestbedArgs),
    /// Eviction policies × access patterns × local memory, paging from a memory server
    /// process (seed 000's policyPerformance), with the all-local time beside.
    Paging(farmem::PagingArgs),
    /// Sorting keys held in far memory with a share of local memory (seed 000's
    /// sortPerformance), against sort_unstable with every key local.
    Sort(farmem::SortArgs),
    /// A sequential scan of far memory with each prefetcher, beside an iperf3 stream.
    Prefetch(farmem::PrefetchArgs),
    /// One far page's cost: a FarRegion (userfaultfd) fault served from a memory server
    /// against a FarVec miss, with the remote 4 KiB read and a bare userfaultfd fault
    /// beside (latency p50/p99, faults a second).
    Fault(farmem::FaultArgs),
    /// Block volumes (issue 17): `raid encode` (parity and Reed–Solomon GB/s per core),
    /// `raid compare` (every level over real servers, degraded reads included), `raid
    /// overhead` (raid4 against raid0 by threads, iperf3 beside), `raid rebuild`
    /// (rebuild rate under load, the load's dip).
    Raid(RaidArgs),
    /// The middlebox (issue 20): `cas` — one shared word, CAS direct against CAS→WRITE
    /// through `camelot proxy`, 1…64 clients; `bandwidth` and `tail` — Clover direct
    /// against Clover through the proxy.
    #[command(subcommand)]
    Middlebox(proxy::MiddleboxCommand),
    /// The cluster (issue 19): `cluster throughput` — one server's GET/PUT throughput
    /// against value size 1 KiB..1 MiB through the client's KV API, iperf3 beside.
    #[command(subcommand)]
    Cluster(cluster::ClusterBenchCommand),
    /// Every bench above, then `camelot report`, into one directory.
    All(AllArgs),
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum HwKind {
    /// GFLOPS and GIOPS, one thread and one per core.
    Cpu,
    /// Sequential and random writes and reads, 4 KiB to 1 MiB, O_DIRECT where allowed.
    Disk,
    /// Sequential, random and memcpy bandwidth at 1 B, 1 KiB and 1 MiB blocks.
    Mem,
    /// TCP/UDP throughput against buffer size, TCP/UDP ping-pong latency.
    Net,
    /// cpu, mem, net and disk.
    All,
    /// Serve the far end of `bench hw net --peer` on --listen until SIGTERM or Ctrl-C.
    NetServer,
}

#[derive(Args)]
struct HwArgs {
    #[arg(value_enum)]
    kind: HwKind,
    /// Scaled down to finish quickly.
    #[arg(long)]
    quick: bool,
    /// Directory for the results and figures.
    #[arg(long, default_value = "results")]
    out: PathBuf,
    /// Where the disk bench puts its files (removed afterwards); default: the temp dir.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Also record the machine's limits from the results in --out into this file (without
    /// a value: --out/limits.json); other benches read it with --limits, or find
    /// `limits.json` in their --out (default: results/limits.json).
    #[arg(long, num_args = 0..=1)]
    save: Option<Option<PathBuf>>,
    /// net, all: measure against `camelot bench hw net-server` at host:port instead of
    /// one started here on loopback.
    #[arg(long)]
    peer: Option<String>,
    /// net-server: the address to listen on (0.0.0.0:PORT to serve other hosts).
    #[arg(long, default_value = "127.0.0.1:7071")]
    listen: String,
    /// disk: MiB of file per thread count, split between the threads (default 256, 32 with
    /// --quick).
    #[arg(long)]
    file_mib: Option<u64>,
    /// disk: block sizes in KiB, comma-separated (default 4,64,1024).
    #[arg(long, value_delimiter = ',')]
    block_kib: Option<Vec<usize>>,
}

#[derive(Args)]
struct AllArgs {
    /// Each bench scaled down to finish in under 30 s.
    #[arg(long)]
    quick: bool,
    /// Directory for every result, figure and index.html.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
struct RespArgs {
    /// redis-benchmark -n: requests per run.
    #[arg(long, default_value_t = 200_000)]
    requests: u64,
    /// redis-benchmark -c: parallel connections.
    #[arg(long, default_value_t = 50)]
    clients: u32,
    /// redis-benchmark -d: value bytes.
    #[arg(long, default_value_t = 100)]
    data_bytes: u32,
    /// redis-benchmark -P values to run, comma-separated (1 = no pipelining).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pipeline: Vec<u32>,
    /// Runs of each case per server, rotating who goes first; the median ratio counts.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Run Camelot inside the bench process instead of as `camelot server` processes
    /// (labelled; no server CPU seconds for it, and no `camelot parity` row, whose
    /// --resp-poll-us 0 --threads 1 need a process).
    #[arg(long)]
    in_process: bool,
    /// Scaled down to finish in under 30 s.
    #[arg(long)]
    quick: bool,
    /// Directory for resp.json and its figure.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
struct YcsbArgs {
    /// Workloads to run, comma-separated: a b c d e f (YCSB's core workloads) and w
    /// (100% update).
    #[arg(long, value_delimiter = ',', default_value = "a")]
    workload: Vec<String>,
    /// Records loaded before each workload runs.
    #[arg(long, default_value_t = 100_000)]
    records: u64,
    /// Operations in each run phase.
    #[arg(long, default_value_t = 200_000)]
    operations: u64,
    /// Client threads (closed loop: each waits for its answer before the next request).
    #[arg(long, default_value_t = 16)]
    threads: usize,
    /// Request distribution for every workload: zipfian, uniform, latest or hotspot
    /// (default: each workload's own; zipfian except D's latest).
    #[arg(long)]
    distribution: Option<String>,
    /// Fields per record.
    #[arg(long, default_value_t = 10)]
    fields: usize,
    /// Bytes per field (at least 16).
    #[arg(long, default_value_t = 100)]
    field_bytes: usize,
    /// A store to drive: camelot://[:TOKEN@]HOST:PORT[,HOST:PORT…], resp://HOST:PORT
    /// (Camelot's Redis port), redis://HOST:PORT, memcached://HOST:PORT. Repeatable.
    #[arg(long = "target", value_name = "URL")]
    targets: Vec<String>,
    /// Cluster token for camelot:// targets whose URL gives none (also read from
    /// CAMELOT_TOKEN).
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Stores to start for this run, comma-separated (needs --spawn), each its own
    /// server process on loopback: camelot (the native client, one value per record),
    /// resp (Camelot's Redis port with redis-server's budget: one thread; YCSB's Redis
    /// binding, a hash per record), resp-parity (the same, and the port sleeps after each
    /// command as Redis does: --resp-poll-us 0), resp-cores (the Redis port with an event loop per
    /// core; Camelot's default is one, the resp row), redis (redis-server, one thread,
    /// same binding), memcached (-t = this machine's cores). The table divides each by
    /// redis; every side's process, threads, version, flags and data model are in
    /// ycsb.json's config.sides, and each server's CPU seconds beside its throughput.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// Start the --compare stores on free loopback ports, and stop them afterwards.
    #[arg(long)]
    spawn: bool,
    /// Run spawned Camelot servers inside this process instead of as separate `camelot
    /// server` processes (every label then says "in-process"; no CPU figure for them).
    #[arg(long)]
    in_process: bool,
    /// Fixed total rate (ops/s) instead of a closed loop; latency counts from each
    /// operation's intended start, so a stall is not hidden (coordinated omission).
    #[arg(long)]
    target_ops: Option<f64>,
    /// Memory cap of a spawned Camelot node and memcached.
    #[arg(long, default_value = "8G", value_parser = parse_bytes)]
    memory: u64,
    /// Runs of each workload on each target, interleaved across targets; each figure is
    /// the median-throughput run (every run's figure is kept in the JSON).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Scaled down to finish in under 30 s.
    #[arg(long)]
    quick: bool,
    /// Directory for ycsb.json and its figures.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
struct ApiArgs {
    /// Requests per Camelot throughput point.
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// Seconds each peer program runs.
    #[arg(long, default_value_t = 5)]
    peer_seconds: u64,
    /// Times each peer/Camelot pair is measured (alternating); the median ratio counts.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Run the Camelot server inside the bench process instead of as a `camelot server`
    /// process like redis-server (labelled; no server CPU seconds for it).
    #[arg(long)]
    in_process: bool,
    /// Scaled down to finish in under 30 s.
    #[arg(long)]
    quick: bool,
    /// Directory for api.json and api.png.
    #[arg(long, default_value = "results")]
    out: PathBuf,
    /// The machine's limits (from `bench hw all --save`); default: limits.json in --out.
    #[arg(long)]
    limits: Option<PathBuf>,
}

#[derive(Args)]
struct RvmArgs {
    /// Backends to measure, comma-separated or repeated: pool, pool-mirrored, redis, file.
    /// Each trial starts a fresh one (dev servers, redis-server, a temp dir).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pool,pool-mirrored,redis,file"
    )]
    backend: Vec<String>,
    /// Page counts (x axis), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,3,10,30,100,300,1000,3000,10000"
    )]
    pages: Vec<u64>,
    /// Trials per page count, each on a fresh backend.
    #[arg(long, default_value_t = 3)]
    trials: usize,
    /// Seconds iperf3 and sockperf run.
    #[arg(long, default_value_t = 3)]
    peer_seconds: u64,
    /// Run the pool backend's Camelot servers inside this process instead of as separate
    /// `camelot server` processes like redis-server (every output then says "in-process").
    #[arg(long)]
    in_process: bool,
    /// Scaled down to finish in under 30 s.
    #[arg(long)]
    quick: bool,
    /// Directory for the result JSON and figures.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Args)]
struct ThreadsArgs {
    /// Total requests per thread count, shared by its threads (each takes the next one
    /// when it has room), so a point ends together rather than on its slowest thread.
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// Each point goes on past --requests until it has run this many seconds (a quick
    /// point at 64 threads is otherwise ~0.1 s, which one scheduling hiccup decides).
    #[arg(long, default_value_t = camelot_bench::threads::POINT_DURATION_MIN_DEFAULT.as_secs_f64())]
    min_seconds: f64,
    /// Percent of requests that are reads; the rest are writes.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(0..=100))]
    reads: u8,
    /// Bytes per request.
    #[arg(long, default_value = "4K", value_parser = parse_bytes)]
    size: u64,
    /// Thread counts to measure, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,24,32,40,48,56,64"
    )]
    threads: Vec<usize>,
    /// Requests each thread keeps outstanding (1: issue, wait, issue).
    #[arg(long, default_value_t = 1)]
    depth: usize,
    /// Do not pin threads to cores (default: pinned round-robin).
    #[arg(long)]
    no_pin: bool,
    /// Let pinned threads share connections with threads of other CPUs (by arrival
    /// order, as unpinned threads do). Default: a pinned thread's connection is shared
    /// only with threads of its own CPU, whose wake-ups then never cross CPUs.
    #[arg(long)]
    no_cpu_local: bool,
    /// Drive each thread count's load from that many tasks on one event-loop thread
    /// (the client's LoopClient face) instead of that many OS threads.
    #[arg(long)]
    event_loop: bool,
    /// Batching off: one request per frame.
    #[arg(long, conflicts_with = "compare_batching")]
    no_batching: bool,
    /// Run both modes, batched and unbatched, as two series.
    #[arg(long)]
    compare_batching: bool,
    /// Servers to use (host:port,…); default: `camelot server` processes started for the
    /// run (--nodes of them).
    #[arg(long, value_delimiter = ',')]
    servers: Vec<String>,
    /// Nodes started for the run when --servers is not given.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// Run those nodes inside the bench process (a dev cluster sharing its cores and CPU
    /// accounting) instead of as `camelot server` processes; every series label and the
    /// config say so, and no server CPU seconds are recorded.
    #[arg(long, conflicts_with = "servers")]
    in_process: bool,
    /// Bytes of the region each node serves requests from.
    #[arg(long, default_value = "64M", value_parser = parse_bytes)]
    region: u64,
    #[arg(long, env = "CAMELOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Scaled down to finish in under 30 s.
    #[arg(long)]
    quick: bool,
    /// Directory for threads.json and threads.png.
    #[arg(long, default_value = "results")]
    out: PathBuf,
    /// The machine's limits (from `bench hw all --save`); default: limits.json in --out.
    #[arg(long)]
    limits: Option<PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    init_logging(&cli.command);
    let result = run(cli);
    testbed::exit_if_interrupted();
    if let Err(e) = result {
        eprintln!("error: {}", error_text(&e));
        std::process::exit(1);
    }
}

/// An error and its causes on one line, each said once: a library error that names
/// its cause in its own message is not followed by that cause again. A refused token
/// says how to give one.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    let refused = e
        .chain()
        .find_map(|c| match c.downcast_ref::<ClientError>() {
            Some(ClientError::Auth { addr, .. }) => Some(*addr),
            _ => None,
        });
    if let Some(addr) = refused {
        text = format!(
            "{addr} refused the cluster token (wrong or missing): give the server's token \
             with --token or in the CAMELOT_TOKEN environment variable"
        );
    }
    text
}

fn init_logging(cmd: &Command) {
    // Servers log at info; interactive commands only warn, so their own output stays
    // readable. RUST_LOG overrides both.
    let default = match cmd {
        Command::Server(_) | Command::Dev(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Server(a) => server(a),
        Command::Stats(a) => stats(a),
        Command::Dev(a) => dev(a),
        Command::Demo(a) => demo(a),
        Command::Bench(BenchCommand::Threads(a)) => bench_threads(a),
        Command::Bench(BenchCommand::Api(a)) => bench_api(a),
        Command::Bench(BenchCommand::Ycsb(a)) => bench_ycsb(a),
        Command::Bench(BenchCommand::Resp(a)) => bench_resp(a),
        Command::Bench(BenchCommand::Paging(a)) => farmem::bench_paging(a),
        Command::Bench(BenchCommand::Sort(a)) => farmem::bench_sort(a),
        Command::Bench(BenchCommand::Prefetch(a)) => farmem::bench_prefetch(a),
        Command::Bench(BenchCommand::Fault(a)) => farmem::bench_fault(a),
        Command::Bench(BenchCommand::RvmCommit(a)) => bench_rvm(a, true),
        Command::Bench(BenchCommand::RvmRecovery(a)) => bench_rvm(a, false),
        Command::Bench(BenchCommand::All(a)) => bench_all(a),
        Command::Bench(BenchCommand::Hw(a)) => bench_hw(a),
        Command::Report(a) => report(a),
        Command::Farmem(c) => farmem::run(c),
        Command::Bench(BenchCommand::Raid(a)) => bench_raid(a),
        Command::Volume(c) => volume(c),
        Command::Cluster(c) => cluster::run(c),
        Command::Testbed(c) => testbed::run(c),
        Command::Chaos(a) => chaos::run(a),
        Command::ChaosWorker(a) => chaos::worker(a),
        Command::BenchTestbedClient(a) => testbed_bench::client(a),
        Command::TestbedRelay(a) => testbed::relay(a),
        Command::Bench(BenchCommand::Testbed(a)) => testbed_bench::run(a),
        Command::Proxy(c) => proxy::run(c),
        Command::Clover(c) => clover::run(c),
        Command::Bench(BenchCommand::Middlebox(c)) => proxy::bench(c),
        Command::Bench(BenchCommand::Cluster(c)) => cluster::bench(c),
    }
}

pub(crate) fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("cannot resolve '{addr}' (expected host:port)"))?
        .next()
        .with_context(|| format!("'{addr}' resolves to no address"))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// SIGTERM and SIGINT handlers, installed before a command announces that it is up: a
/// signal sent the moment the address is printed must stop it cleanly, not kill it.
/// Must be created inside a tokio runtime.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("cannot install the Ctrl-C handler")?,
        })
    }

    /// Resolves when SIGTERM or Ctrl-C arrives.
    async fn wait(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

fn server(a: ServerArgs) -> Result<()> {
    let listen = resolve(&a.listen)?;
    let limits = check_server_limits(&a)?;
    let ServerLimits {
        connections_max,
        unauth_connections_max,
        auth_timeout,
        idle_timeout,
    } = limits;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if a.threads > 0 {
        builder.worker_threads(a.threads);
    }
    let rt = builder.build().context("cannot start the async runtime")?;
    rt.block_on(async {
        let mut signals = Signals::install()?;
        let mut cfg = ServerConfig::new(listen, a.memory);
        cfg.token = a.token.map(String::into_bytes);
        cfg.connections_max = connections_max;
        cfg.unauthenticated_connections_max = unauth_connections_max;
        cfg.connection_buffers_bytes_max = a.connection_memory;
        cfg.handshake_timeout = auth_timeout;
        cfg.idle_timeout = idle_timeout;
        cfg.resp_listen = a.resp_listen.as_deref().map(resolve).transpose()?;
        cfg.resp_threads = a.resp_threads;
        cfg.resp_poll = std::time::Duration::from_micros(a.resp_poll_us);
        cfg.ops_per_sec_max = a.ops_per_sec_max;
        cfg.proto_max_bulk_len = a.proto_max_bulk_len;
        cfg.require_token = a.require_token;
        cluster::configure(&a.cluster, &mut cfg);
        if let Some(path) = &a.principal_tokens {
            cfg.principal_tokens = read_principal_tokens(path)?;
        }
        cfg.quota = camelot_server::Quota {
            bytes_max: a.quota_bytes.unwrap_or(u64::MAX),
            regions_max: a.quota_regions.unwrap_or(u64::MAX),
        };
        let handle = ServerHandle::start(cfg)
            .await
            .with_context(|| format!("cannot start a server on {listen}"))?;
        println!(
            "camelot server listening on {} (memory cap {}, connection buffers {})",
            handle.local_addr(),
            format_bytes(a.memory),
            format_bytes(a.connection_memory)
        );
        if let Some(resp) = handle.resp_addr() {
            println!("camelot server speaking the Redis protocol on {resp}");
        }
        let _member = cluster::join(&handle, &a.cluster).await?;
        if handle.state().exposed_without_token() {
            eprintln!(
                "WARNING: listening beyond loopback without a token: anyone who can reach \
                 this port can read, write and free its memory (set --token; \
                 --require-token refuses to start without one)"
            );
        }
        signals.wait().await;
        tracing::info!("signal received; answering in-flight requests, then stopping");
        handle.shutdown().await.context("shutdown failed")?;
        Ok(())
    })
}

struct ServerLimits {
    connections_max: usize,
    unauth_connections_max: usize,
    auth_timeout: std::time::Duration,
    idle_timeout: Option<std::time::Duration>,
}

/// Refuses limits that make no sense, and warns about caps this machine cannot back.
fn check_server_limits(a: &ServerArgs) -> Result<ServerLimits> {
    if a.memory == 0 {
        bail!("--memory 0 leaves no room for any region or object: give a size such as 512M or 4G");
    }
    if a.connection_memory < camelot_server::CONNECTION_BUFFERS_BYTES_MIN {
        bail!(
            "--connection-memory {} is too small: one connection needs {}",
            format_bytes(a.connection_memory),
            format_bytes(camelot_server::CONNECTION_BUFFERS_BYTES_MIN)
        );
    }
    if a.connections_max < 1 {
        bail!(
            "--connections-max {} would refuse every client: use at least 1",
            a.connections_max
        );
    }
    let connections_max = usize::try_from(a.connections_max)?;
    let unauth_connections_max = match a.unauth_connections_max {
        // Half at most, so unauthenticated sockets never hold every slot.
        None => camelot_server::UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT
            .min((connections_max / 2).max(1)),
        Some(n) if n < 1 => bail!(
            "--unauth-connections-max {n} would refuse every client (each connects before it \
             authenticates): use at least 1"
        ),
        Some(n) if n > a.connections_max => bail!(
            "--unauth-connections-max {n} is more than --connections-max {}: it must be at \
             most that, and lower to keep room for authenticated clients",
            a.connections_max
        ),
        Some(n) => usize::try_from(n)?,
    };
    let seconds = |flag: &str, v: f64| -> Result<std::time::Duration> {
        if !(v.is_finite() && v >= 0.0) {
            bail!("{flag} must be a number of seconds, at least 0, not {v}");
        }
        std::time::Duration::try_from_secs_f64(v).with_context(|| format!("{flag} {v} is too long"))
    };
    let auth_timeout = seconds("--auth-timeout", a.auth_timeout)?;
    if auth_timeout.is_zero() {
        bail!("--auth-timeout 0 would close every connection before it could authenticate");
    }
    let idle_timeout = Some(seconds("--idle-timeout", a.idle_timeout)?).filter(|d| !d.is_zero());
    if let Some(ram) = units::physical_memory_bytes() {
        let total = a.memory.saturating_add(a.connection_memory);
        if total > ram {
            eprintln!(
                "warning: --memory {} plus --connection-memory {} is more than this machine's {} \
                 of RAM: the server may be killed by the kernel before it refuses an allocation",
                format_bytes(a.memory),
                format_bytes(a.connection_memory),
                format_bytes(ram)
            );
        }
    }
    Ok(ServerLimits {
        connections_max,
        unauth_connections_max,
        auth_timeout,
        idle_timeout,
    })
}

fn stats(a: StatsArgs) -> Result<()> {
    let addr = resolve(&a.addr)?;
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        bail!("--timeout must be a number of seconds above 0");
    }
    let wait =
        std::time::Duration::try_from_secs_f64(a.timeout).context("--timeout is too long")?;
    let config = ClientConfig {
        token: a.token.map(String::into_bytes),
        connections_per_node: 1,
        connect_timeout: wait,
        request_timeout: wait,
        ..ClientConfig::default()
    };
    // The client's errors name the address already.
    let client = Client::connect(ClusterMap::from_addrs(&[addr]), config)?;
    let stats = client.stats(0)?;
    let get = |k: &str| stats.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
    println!("server {addr}");
    if get(camelot_server::STAT_EXPOSED_WITHOUT_TOKEN) != 0 {
        println!(
            "  WARNING     serving beyond loopback without a token: anyone who can reach \
             it can read, write and free its memory"
        );
    }
    println!(
        "  memory      {} used of {} (regions and objects)",
        format_bytes(get("memory_used_bytes")),
        format_bytes(get("memory_cap_bytes"))
    );
    println!(
        "  buffers     {} used of {} (connection input and output)",
        format_bytes(get("connection_buffers_used_bytes")),
        format_bytes(get("connection_buffers_cap_bytes"))
    );
    println!(
        "  total cap   {}",
        format_bytes(get("memory_cap_bytes").saturating_add(get("connection_buffers_cap_bytes")))
    );
    println!("  regions     {}", get("regions"));
    println!(
        "  connections {} open, {} since start",
        get("connections_current"),
        get("connections_total")
    );
    println!("  ops served");
    for (name, v) in stats.iter().filter(|(n, _)| n.starts_with("ops_")) {
        println!("    {:<12} {v}", &name[4..]);
    }
    for (name, v) in stats.iter().filter(|(n, _)| {
        !n.starts_with("ops_")
            && !matches!(
                n.as_str(),
                "memory_used_bytes"
                    | "memory_cap_bytes"
                    | "connection_buffers_used_bytes"
                    | "connection_buffers_cap_bytes"
                    | "regions"
                    | "connections_current"
                    | "connections_total"
            )
    }) {
        println!("  {name:<11} {v}");
    }
    Ok(())
}

fn dev(a: DevArgs) -> Result<()> {
    if a.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: a.nodes,
        memory_bytes_per_node: a.memory,
        token: a.token.map(String::into_bytes),
        base_port: a.base_port,
        ..DevClusterConfig::default()
    })
    .context("cannot start the dev cluster")?;
    let mut signals = {
        let _in_runtime = cluster.runtime().enter();
        Signals::install()?
    };
    let list: Vec<String> = cluster.addrs().iter().map(|a| a.to_string()).collect();
    println!(
        "camelot dev cluster: {} node(s), {} each",
        a.nodes,
        format_bytes(a.memory)
    );
    for (i, addr) in cluster.addrs().iter().enumerate() {
        println!("  node {i}: {addr}");
    }
    println!("servers: {}", list.join(","));
    println!("Ctrl-C to stop.");
    cluster.runtime().block_on(signals.wait());
    println!("stopping…");
    cluster.shutdown().context("shutdown failed")?;
    Ok(())
}

fn demo(a: DemoArgs) -> Result<()> {
    let results = std::path::Path::new(camelot_bench::hw::limits::DEFAULT_RESULTS_DIR);
    let summary = camelot_bench::demo::run(&camelot_bench::demo::DemoConfig {
        requests: a.requests,
        threads: a.threads,
        limits: find_limits(a.limits.as_deref(), results)?,
    })?;
    print!("{summary}");
    Ok(())
}

fn bench_threads(a: ThreadsArgs) -> Result<()> {
    let servers = a
        .servers
        .iter()
        .map(|s| resolve(s))
        .collect::<Result<Vec<_>>>()?;
    if !(a.min_seconds.is_finite() && a.min_seconds >= 0.0) {
        bail!("--min-seconds must be a number of seconds, at least 0");
    }
    let mut cfg = ThreadsConfig {
        requests: a.requests,
        min_point_duration: std::time::Duration::try_from_secs_f64(a.min_seconds)
            .context("--min-seconds is too large")?,
        reads_percent: a.reads,
        size_bytes: u32::try_from(a.size).context("--size is too large")?,
        threads: a.threads,
        depth: a.depth,
        pin: !a.no_pin,
        cpu_local: !a.no_cpu_local,
        event_loop: a.event_loop,
        modes: if a.compare_batching {
            vec![true, false]
        } else {
            vec![!a.no_batching]
        },
        servers,
        dev_nodes: a.nodes,
        in_process: a.in_process,
        region_bytes: a.region,
        token: a.token.map(String::into_bytes),
        quick: a.quick,
        limits: find_limits(a.limits.as_deref(), &a.out)?,
    };
    if a.quick {
        cfg.apply_quick();
    }
    let written = camelot_bench::threads::run(&cfg, &a.out)?;
    if cfg.limits.is_some() {
        let result = camelot_results::output::read_result(&a.out.join("threads.json"))?;
        for line in camelot_bench::threads::limits_summary(&result) {
            println!("{line}");
        }
    }
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// The limits in `explicit` (which must exist), else in `dir/limits.json` if there is one;
/// says which file the figures are read against.
fn find_limits(
    explicit: Option<&std::path::Path>,
    dir: &std::path::Path,
) -> Result<Option<camelot_bench::hw::limits::Limits>> {
    let found = camelot_bench::hw::limits::Limits::find(explicit, dir)?;
    Ok(found.map(|(limits, path)| {
        println!("reading results against the limits in {}", path.display());
        limits
    }))
}

fn bench_api(a: ApiArgs) -> Result<()> {
    let mut cfg = camelot_bench::api::ApiConfig {
        requests: a.requests,
        peer_seconds: a.peer_seconds,
        rounds: a.rounds,
        limits: find_limits(a.limits.as_deref(), &a.out)?,
        in_process: a.in_process,
        ..Default::default()
    };
    if a.quick {
        cfg.apply_quick();
    }
    let (written, table) = camelot_bench::api::run(&cfg, &a.out)?;
    print_outcome(&table, &written);
    Ok(())
}

/// A bench's table, then the files it wrote.
fn print_outcome(table: &str, written: &[std::path::PathBuf]) {
    print!("{table}");
    for p in written {
        println!("wrote {}", p.display());
    }
}

fn bench_resp(a: RespArgs) -> Result<()> {
    let mut cfg = camelot_bench::resp::RespBenchConfig {
        requests: a.requests,
        clients: a.clients,
        data_bytes: a.data_bytes,
        pipelines: a.pipeline,
        rounds: a.rounds,
        quick: false,
        in_process: a.in_process,
    };
    if a.quick {
        cfg.apply_quick();
    }
    let (written, table) = camelot_bench::resp::run(&cfg, &a.out)?;
    print_outcome(&table, &written);
    Ok(())
}

fn bench_ycsb(a: YcsbArgs) -> Result<()> {
    use camelot_bench::ycsb::{
        generators::Distribution, targets::TargetKind, Workload, YcsbConfig,
    };
    if !a.compare.is_empty() && !a.spawn {
        bail!(
            "--compare starts its stores itself: add --spawn (or give existing ones with --target)"
        );
    }
    let workloads = a
        .workload
        .iter()
        .map(|w| {
            Workload::parse(w).with_context(|| format!("unknown workload {w:?}: use a-f or w"))
        })
        .collect::<Result<Vec<_>>>()?;
    let distribution = a
        .distribution
        .as_deref()
        .map(|d| {
            Distribution::parse(d).with_context(|| {
                format!("unknown distribution {d:?}: zipfian, uniform, latest or hotspot")
            })
        })
        .transpose()?;
    let targets = a
        .targets
        .iter()
        .map(|url| {
            let label = url.split("://").next().unwrap_or(url).to_string();
            Ok((
                label,
                TargetKind::parse(url)?.with_default_token(a.token.as_deref()),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut cfg = YcsbConfig {
        workloads,
        records: a.records,
        operations: a.operations,
        threads: a.threads,
        distribution,
        fields: a.fields,
        field_bytes: a.field_bytes,
        target_ops: a.target_ops,
        targets,
        spawn: a.compare,
        memory_bytes: a.memory,
        in_process: a.in_process,
        rounds: a.rounds,
        ..YcsbConfig::default()
    };
    if a.quick {
        cfg.apply_quick();
    }
    let report = camelot_bench::ycsb::run(&cfg, &a.out, |line| eprintln!("{line}"))?;
    print_outcome(&report.table, &report.files);
    if report.errors > 0 || report.mismatches > 0 {
        bail!(
            "{} errors and {} value mismatches (details in ycsb.json)",
            report.errors,
            report.mismatches
        );
    }
    Ok(())
}

fn bench_rvm(a: RvmArgs, commit: bool) -> Result<()> {
    use camelot_bench::rvm::{RvmBackend, RvmBenchConfig};
    let mut cfg = RvmBenchConfig {
        backends: a
            .backend
            .iter()
            .map(|b| RvmBackend::parse(b.trim()))
            .collect::<Result<Vec<_>, _>>()?,
        pages: a.pages,
        trials: a.trials,
        peer_seconds: a.peer_seconds,
        in_process: a.in_process,
        ..RvmBenchConfig::default()
    };
    if a.quick {
        cfg.apply_quick();
    }
    let written = if commit {
        camelot_bench::rvm::run_commit(&cfg, &a.out)?
    } else {
        camelot_bench::rvm::run_recovery(&cfg, &a.out)?
    };
    if let Some(json) = written.first() {
        let result = camelot_results::output::read_result(json)?;
        for line in camelot_bench::rvm::ratio_lines(&result) {
            println!("{line}");
        }
    }
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn report(a: ReportArgs) -> Result<()> {
    let path = camelot_results::report::write_report(
        &a.dir,
        &[camelot_bench::hw::limits::LIMITS_FILE_NAME],
    )?;
    println!("wrote {}", path.display());
    Ok(())
}

fn bench_all(a: AllArgs) -> Result<()> {
    let binary = std::env::current_exe().context("cannot tell where this program is")?;
    let written = camelot_bench::all::run(&a.out, a.quick, &binary, |line| eprintln!("{line}"))?;
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn bench_hw(a: HwArgs) -> Result<()> {
    use camelot_bench::{hw, QuickConfig};
    let kinds: &[HwKind] = match a.kind {
        HwKind::All => &[HwKind::Cpu, HwKind::Mem, HwKind::Net, HwKind::Disk],
        HwKind::NetServer => return net_server(&a.listen),
        ref k => std::slice::from_ref(k),
    };
    if a.peer.is_some() && !kinds.iter().any(|k| matches!(k, HwKind::Net)) {
        bail!("--peer applies to `bench hw net` and `bench hw all` only");
    }
    if (a.file_mib.is_some() || a.block_kib.is_some())
        && !kinds.iter().any(|k| matches!(k, HwKind::Disk))
    {
        bail!("--file-mib and --block-kib apply to `bench hw disk` and `bench hw all` only");
    }
    let peer = a.peer.as_deref().map(resolve).transpose()?;
    for kind in kinds {
        let written = match kind {
            HwKind::Cpu => hw::cpu::run(&hw::cpu::CpuConfig::defaults(a.quick), &a.out)?,
            HwKind::Mem => hw::mem::run(&hw::mem::MemConfig::defaults(a.quick), &a.out)?,
            HwKind::Disk => {
                let mut c = hw::disk::DiskConfig::defaults(a.quick);
                if let Some(d) = &a.dir {
                    c.dir = d.clone();
                }
                if let Some(mib) = a.file_mib {
                    c.file_bytes = mib
                        .checked_mul(1 << 20)
                        .ok_or_else(|| anyhow!("--file-mib {mib} is too large"))?;
                }
                if let Some(kib) = &a.block_kib {
                    c.block_sizes_bytes = kib
                        .iter()
                        .map(|k| k.checked_mul(1 << 10))
                        .collect::<Option<Vec<usize>>>()
                        .ok_or_else(|| anyhow!("a --block-kib size is too large"))?;
                }
                let written = hw::disk::run(&c, &a.out)?;
                let result = camelot_results::output::read_result(&a.out.join("disk.json"))?;
                if let Some(note) = result.config["direct_note"].as_str() {
                    println!("disk: {note}");
                }
                written
            }
            HwKind::Net => {
                let c = hw::net::NetConfig {
                    peer,
                    ..hw::net::NetConfig::defaults(a.quick)
                };
                hw::net::run(&c, &a.out)?
            }
            HwKind::All | HwKind::NetServer => Vec::new(),
        };
        for p in written {
            println!("wrote {}", p.display());
        }
    }
    if let Some(path) = &a.save {
        let path = path
            .clone()
            .unwrap_or_else(|| a.out.join(hw::limits::LIMITS_FILE_NAME));
        hw::limits::Limits::from_results(&a.out)?.save(&path)?;
        println!("wrote {} (this machine's limits)", path.display());
    }
    Ok(())
}

fn net_server(listen: &str) -> Result<()> {
    let listen = resolve(listen)?;
    let rt = runtime()?;
    let mut signals = {
        let _in_runtime = rt.enter();
        Signals::install()?
    };
    let server = camelot_bench::hw::netserver::NetServer::start(listen)?;
    println!(
        "camelot net-server listening on {} (bench hw net --peer HOST:{})",
        server.local_addr(),
        server.local_addr().port()
    );
    rt.block_on(signals.wait());
    drop(server);
    Ok(())
}

fn bench_raid(a: RaidArgs) -> Result<()> {
    use camelot_bench::raid::{CompareConfig, EncodeConfig};
    use camelot_bench::QuickConfig;
    let written = match a.kind {
        RaidKind::Encode => {
            camelot_bench::raid::run_encode(&EncodeConfig::defaults(a.quick), &a.out)?
        }
        RaidKind::Compare => {
            let mut cfg = CompareConfig {
                in_process: a.in_process,
                ..CompareConfig::defaults(a.quick)
            };
            if let Some(t) = a.threads.as_ref().and_then(|t| t.first()) {
                cfg.threads = *t;
            }
            camelot_bench::raid::run_compare(&cfg, &a.out)?
        }
        RaidKind::Overhead => {
            let mut cfg = camelot_bench::raid::OverheadConfig {
                in_process: a.in_process,
                ..camelot_bench::raid::OverheadConfig::defaults(a.quick)
            };
            if let Some(t) = a.threads {
                cfg.threads = t;
            }
            camelot_bench::raid::run_overhead(&cfg, &a.out)?
        }
        RaidKind::Rebuild => {
            let mut cfg = camelot_bench::raid::RebuildConfig {
                in_process: a.in_process,
                rate_bytes_per_s: a.rate,
                ..camelot_bench::raid::RebuildConfig::defaults(a.quick)
            };
            if let Some(t) = a.threads.as_ref().and_then(|t| t.first()) {
                cfg.threads = *t;
            }
            camelot_bench::raid::run_rebuild(&cfg, &a.out)?
        }
    };
    if let Some(json) = written.first() {
        let result = camelot_results::output::read_result(json)?;
        print!("{}", camelot_results::summary::comparison_table(&result));
    }
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn volume_config(token: Option<String>) -> camelot_blocks::VolumeConfig {
    let mut cfg = camelot_blocks::VolumeConfig::default();
    cfg.client.token = token.map(String::into_bytes);
    cfg
}

fn open_volume(r: &VolumeRef) -> Result<camelot_blocks::Volume> {
    let (vol, resync) = camelot_blocks::Volume::open(
        resolve(&r.server)?,
        &r.name,
        &volume_config(r.token.clone()),
    )?;
    if resync.stripes_checked > 0 {
        eprintln!(
            "resynced {} stripes a writer left marked ({} had parity to repair)",
            resync.stripes_checked, resync.repaired
        );
    }
    Ok(vol)
}

fn serve_nbd(a: VolumeServeNbdArgs) -> Result<()> {
    let listen = resolve(&a.listen)?;
    let vol = std::sync::Arc::new(open_volume(&a.volume)?);
    let rt = runtime()?;
    let mut signals = rt.block_on(async { Signals::install() })?;
    let device: std::sync::Arc<dyn camelot_blocks::nbd::BlockDevice> = vol.clone();
    let mut server = camelot_blocks::NbdServer::start(
        device,
        vol.name(),
        camelot_blocks::NbdConfig {
            listen,
            allow_non_loopback: a.allow_non_loopback,
            connections_max: a.connections_max,
            read_only: a.read_only,
            ..camelot_blocks::NbdConfig::default()
        },
    )?;
    println!(
        "camelot volume {} ({} bytes{}) exported on nbd://{}",
        vol.name(),
        vol.capacity_bytes(),
        if a.read_only { ", read-only" } else { "" },
        server.local_addr()
    );
    std::io::Write::flush(&mut std::io::stdout())?;
    rt.block_on(signals.wait());
    // Hang up on clients first, then drop the volume, which clears its intent marks.
    server.stop();
    drop(server);
    drop(vol);
    Ok(())
}

/// A rebuild rewrites its progress record every second
/// (`camelot_blocks::volume::REBUILD_PROGRESS_INTERVAL`); one this much older says its
/// process has likely stopped (or one round took that long, which it never should).
const REBUILD_REPORT_STALE: std::time::Duration = std::time::Duration::from_secs(10);

fn print_status(st: &camelot_blocks::VolumeStatus) {
    println!(
        "volume {}: {}, {} members, chunk {}, capacity {}, memory overhead {:.2}x, generation {}",
        st.name,
        st.layout.level.name(),
        st.layout.members,
        format_bytes(st.layout.chunk_bytes),
        format_bytes(st.layout.capacity_bytes()),
        st.layout.memory_overhead(),
        st.generation
    );
    if st.degraded() {
        println!("state: degraded, missing members {:?}", st.missing);
    } else {
        println!("state: healthy");
    }
    if let Some((m, done, total)) = st.rebuild {
        match st.rebuild_reported_ago {
            Some(ago) => println!(
                "rebuild: member {m}, {done}/{total} stripes, reported {:.1} s ago{}",
                ago.as_secs_f64(),
                if ago > REBUILD_REPORT_STALE {
                    " (stale: the rebuilding process may have stopped)"
                } else {
                    ""
                }
            ),
            None => println!("rebuild: member {m}, {done}/{total} stripes"),
        }
    }
    for (i, m) in st.members.iter().enumerate() {
        let state = match m.state {
            camelot_blocks::superblock::MemberState::Active => "active",
            camelot_blocks::superblock::MemberState::Missing => "missing",
        };
        let reach = if st.unreachable.contains(&i) {
            ", unreachable now"
        } else {
            ""
        };
        println!("member {i}: {} region {} {state}{reach}", m.addr, m.region);
    }
}

fn volume(c: VolumeCommand) -> Result<()> {
    use std::io::{Read, Write};
    match c {
        VolumeCommand::Create(a) => {
            let servers = a
                .servers
                .iter()
                .map(|s| resolve(s))
                .collect::<Result<Vec<_>>>()?;
            let vol = camelot_blocks::Volume::create(
                &a.name,
                camelot_blocks::Level::parse(&a.level)?,
                &servers,
                a.chunk,
                a.size,
                &volume_config(a.token),
            )?;
            print_status(&vol.status());
        }
        VolumeCommand::Status(r) => print_status(&camelot_blocks::Volume::inspect(
            resolve(&r.server)?,
            &r.name,
            &volume_config(r.token.clone()),
        )?),
        VolumeCommand::ServeNbd(a) => serve_nbd(a)?,
        VolumeCommand::Rebuild(a) => {
            let vol = std::sync::Arc::new(open_volume(&a.volume)?);
            let (old, new) = a
                .replace
                .split_once('=')
                .ok_or_else(|| anyhow!("--replace wants OLD=NEW, not {:?}", a.replace))?;
            let (old, new) = (resolve(old)?, resolve(new)?);
            let member = vol
                .status()
                .members
                .iter()
                .position(|m| m.addr == old)
                .ok_or_else(|| anyhow!("{old} is not a member of {}", vol.name()))?;
            let worker = {
                let vol = vol.clone();
                std::thread::spawn(move || vol.rebuild(member, new, a.rate))
            };
            let mut last = std::time::Instant::now();
            while !worker.is_finished() {
                std::thread::sleep(std::time::Duration::from_millis(100));
                if last.elapsed() >= std::time::Duration::from_secs(1) {
                    if let Some((_, done, total)) = vol.status().rebuild {
                        println!("rebuild: {done}/{total} stripes");
                    }
                    last = std::time::Instant::now();
                }
            }
            worker
                .join()
                .map_err(|_| anyhow!("the rebuild thread panicked"))??;
            println!("rebuilt member {member} onto {new}");
            print_status(&vol.status());
        }
        VolumeCommand::Scrub(a) => {
            let vol = open_volume(&a.volume)?;
            let r = vol.scrub(!a.no_repair)?;
            println!(
                "scrub: {} stripes checked, {} mismatches, {} repaired, {} skipped (members missing)",
                r.stripes_checked, r.mismatches, r.repaired, r.skipped
            );
            if r.mismatches > r.repaired {
                bail!(
                    "{} stripes have parity that disagrees with data",
                    r.mismatches - r.repaired
                );
            }
        }
        VolumeCommand::Read(a) => {
            let vol = open_volume(&a.volume)?;
            let mut out = std::io::stdout().lock();
            let mut at = a.offset;
            let end = a
                .offset
                .checked_add(a.len)
                .ok_or_else(|| anyhow!("offset + len overflows"))?;
            let mut buf = vec![0u8; VOLUME_IO_STEP_BYTES.min(a.len) as usize];
            while at < end {
                let n = (end - at).min(VOLUME_IO_STEP_BYTES) as usize;
                vol.read(at, &mut buf[..n])?;
                out.write_all(&buf[..n])?;
                at += n as u64;
            }
            out.flush()?;
        }
        VolumeCommand::Write(a) => {
            let vol = open_volume(&a.volume)?;
            let room = vol.capacity_bytes().saturating_sub(a.offset);
            let mut input = std::io::stdin().lock();
            let mut at = a.offset;
            let mut buf = vec![0u8; VOLUME_IO_STEP_BYTES.min(room.max(1)) as usize];
            loop {
                let mut n = 0;
                while n < buf.len() {
                    match input.read(&mut buf[n..])? {
                        0 => break,
                        got => n += got,
                    }
                }
                if n == 0 {
                    break;
                }
                if at + n as u64 > vol.capacity_bytes() {
                    bail!(
                        "input runs past the volume's end ({} bytes)",
                        vol.capacity_bytes()
                    );
                }
                vol.write(at, &buf[..n])?;
                at += n as u64;
            }
            println!("wrote {} bytes at {}", at - a.offset, a.offset);
        }
    }
    Ok(())
}

/// Bytes `volume read`/`write` move per call.
const VOLUME_IO_STEP_BYTES: u64 = 8 << 20;

/// Reads a `--principal-tokens` file, refusing one that others could read: it holds
/// secrets, and a token everybody can read authenticates nobody.
fn read_principal_tokens(
    path: &std::path::Path,
) -> anyhow::Result<camelot_server::principals::PrincipalTokens> {
    use camelot_server::principals::{PrincipalTokens, PRINCIPAL_TOKENS_FILE_BYTES_MAX};
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {shown}"))?;
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        bail!(
            "{shown} is readable by group or others (mode {:o}); it holds tokens: chmod 600 it",
            mode & 0o777
        );
    }
    if meta.len() > PRINCIPAL_TOKENS_FILE_BYTES_MAX as u64 {
        bail!(
            "{shown} is {} bytes; a tokens file is at most {PRINCIPAL_TOKENS_FILE_BYTES_MAX}",
            meta.len()
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {shown}"))?;
    PrincipalTokens::parse(&text).with_context(|| format!("in {shown}"))
}
