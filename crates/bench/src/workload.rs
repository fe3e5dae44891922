//! The closed-loop load generator behind `threads`, `demo` and `api`: T client threads,
//! each keeping `depth` requests outstanding against regions spread over the nodes.

use crate::latency::LatencyRecorder;
use crate::progress::Progress;
use crate::BenchError;
use bytes::Bytes;
use camelot_client::proto::{Op, Reply};
use camelot_client::{
    Client, ClientConfig, ClusterMap, LoopClient, LoopPending, NodeId, Pending, Region,
};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Most client threads one measurement starts.
pub const THREADS_MAX: usize = 1024;
/// Most requests one thread keeps outstanding (bounded by what a connection may queue).
pub const DEPTH_MAX: usize = 4096;
/// Progress is published every this many requests, so threads do not contend on it.
const PROGRESS_STEP: u64 = 1024;
/// How often the event-loop driver moves the progress bar.
const PROGRESS_TICK: Duration = Duration::from_millis(200);

/// Where requests go: the servers given, or a dev cluster started for the run.
pub struct Target {
    dev: Option<DevCluster>,
    addrs: Vec<SocketAddr>,
    token: Option<Vec<u8>>,
}

impl Target {
    /// Uses `servers`, or starts `dev_nodes` loopback servers with `memory_bytes_per_node`.
    pub fn open(
        servers: &[SocketAddr],
        dev_nodes: usize,
        memory_bytes_per_node: u64,
        token: Option<Vec<u8>>,
    ) -> Result<Target, BenchError> {
        if !servers.is_empty() {
            return Ok(Target {
                dev: None,
                addrs: servers.to_vec(),
                token,
            });
        }
        let dev = DevCluster::start(DevClusterConfig {
            nodes: dev_nodes,
            memory_bytes_per_node,
            token: token.clone(),
            ..DevClusterConfig::default()
        })?;
        Ok(Target {
            addrs: dev.addrs().to_vec(),
            dev: Some(dev),
            token,
        })
    }

    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// True when the servers run inside this process (and share its cores).
    pub fn is_embedded(&self) -> bool {
        self.dev.is_some()
    }

    pub fn connect(&self, batching: bool) -> Result<Client, BenchError> {
        self.connect_with(ClientConfig {
            batching,
            ..ClientConfig::default()
        })
    }

    /// A client with `config` (its token replaced by the target's).
    pub fn connect_with(&self, config: ClientConfig) -> Result<Client, BenchError> {
        let config = ClientConfig {
            token: self.token.clone(),
            ..config
        };
        Ok(Client::connect(
            ClusterMap::from_addrs(&self.addrs),
            config,
        )?)
    }

    /// Server counters, node by node, when the servers are embedded.
    pub fn dev_stats(&self) -> Option<Vec<Vec<(String, u64)>>> {
        self.dev.as_ref().map(DevCluster::stats)
    }

    pub fn close(self) -> Result<(), BenchError> {
        if let Some(dev) = self.dev {
            dev.shutdown()?;
        }
        Ok(())
    }
}

/// What each request does, chosen per request from one random draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    /// Percent reads; the rest of the non-atomic share are writes.
    pub reads_percent: u8,
    /// Percent FETCH_ADDs on word 0 of a region (taken out of the writes' share).
    pub fetch_add_percent: u8,
}

#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub threads: usize,
    pub depth: usize,
    /// Requests in total, over all threads.
    pub requests: u64,
    pub mix: Mix,
    /// Request sizes; each request picks one uniformly.
    pub sizes_bytes: Vec<u32>,
    /// Pin thread i to core i mod cores.
    pub pin: bool,
    /// Drive the load from `threads` tasks on one event-loop thread (the client's
    /// [`LoopClient`] face) instead of `threads` OS threads.
    pub event_loop: bool,
    pub seed: u64,
}

impl LoadSpec {
    pub fn validate(&self, regions: &[Region]) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        if self.threads == 0 || self.threads > THREADS_MAX {
            return bad(format!(
                "threads must be 1..={THREADS_MAX}, not {}",
                self.threads
            ));
        }
        if self.depth == 0 || self.depth > DEPTH_MAX {
            return bad(format!("depth must be 1..={DEPTH_MAX}, not {}", self.depth));
        }
        if self.mix.reads_percent as u32 + self.mix.fetch_add_percent as u32 > 100 {
            return bad("reads and fetch-adds add up to more than 100%".into());
        }
        if self.sizes_bytes.is_empty() || self.sizes_bytes.contains(&0) {
            return bad("request sizes must be at least 1 byte".into());
        }
        let largest = *self.sizes_bytes.iter().max().unwrap_or(&0) as u64;
        if largest > camelot_client::proto::limits::IO_BYTES_MAX as u64 {
            return bad(format!(
                "{largest}-byte requests exceed the protocol's {} per request",
                camelot_client::proto::limits::IO_BYTES_MAX
            ));
        }
        if regions.is_empty() {
            return bad("no regions to send requests to".into());
        }
        // Word 0 is the FETCH_ADD counter; data requests stay clear of it.
        for r in regions {
            if r.size < largest + 8 {
                return bad(format!(
                    "a {}-byte region cannot hold {largest}-byte requests",
                    r.size
                ));
            }
        }
        Ok(())
    }
}

/// What one measurement saw.
#[derive(Debug, Clone)]
pub struct Measured {
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub fetch_adds: u64,
    /// Payload bytes moved by reads and writes.
    pub bytes: u64,
    pub elapsed: Duration,
    pub latency: LatencyRecorder,
}

impl Measured {
    pub fn ops_per_sec(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

#[derive(Default)]
struct Tally {
    reads: u64,
    writes: u64,
    fetch_adds: u64,
    bytes: u64,
}

/// Runs `spec` against `regions` (spread over nodes) and measures it. Every request must
/// succeed: one error fails the measurement, since a figure built on errors is no figure.
pub fn run_load(
    client: &Client,
    regions: &[Region],
    spec: &LoadSpec,
    progress: Option<&Progress>,
) -> Result<Measured, BenchError> {
    spec.validate(regions)?;
    let cores = if spec.pin {
        core_affinity::get_core_ids().unwrap_or_default()
    } else {
        Vec::new()
    };
    let largest = *spec.sizes_bytes.iter().max().unwrap_or(&1) as usize;
    // One shared buffer: a write's payload is a cheap slice of it, not a fresh allocation.
    let payload = Bytes::from(
        (0..largest + 8)
            .map(|i| (i * 31 + 7) as u8)
            .collect::<Vec<_>>(),
    );
    if spec.event_loop {
        return run_event_loop(client, regions, spec, payload, progress);
    }
    let barrier = Barrier::new(spec.threads + 1);
    let progressed = AtomicU64::new(0);
    let per_thread = spec.requests / spec.threads as u64;
    let extra = spec.requests % spec.threads as u64;

    let (outcomes, elapsed) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..spec.threads)
            .map(|t| {
                let core = (!cores.is_empty()).then(|| cores[t % cores.len()]);
                let n = per_thread + u64::from((t as u64) < extra);
                let (barrier, payload, progressed) = (&barrier, payload.clone(), &progressed);
                s.spawn(move || {
                    if let Some(c) = core {
                        core_affinity::set_for_current(c);
                    }
                    let seed = spec.seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    barrier.wait();
                    let r = one_thread(client, regions, spec, n, seed, &payload, |k| {
                        if let Some(p) = progress {
                            p.inc(k);
                        }
                        progressed.fetch_add(k, Ordering::Relaxed);
                    });
                    (r, Instant::now())
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let outcomes: Vec<_> = handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    (
                        Err(BenchError::Check("a load thread panicked".into())),
                        Instant::now(),
                    )
                })
            })
            .collect();
        let end = outcomes.iter().map(|(_, t)| *t).max().unwrap_or(start);
        (outcomes, end.duration_since(start))
    });

    measured(outcomes.into_iter().map(|(r, _)| r), elapsed)
}

type DriverOutcome = Result<(Tally, LatencyRecorder), BenchError>;

/// Adds up what every driver (thread or task) saw; one failed driver fails the whole.
fn measured(
    outcomes: impl IntoIterator<Item = DriverOutcome>,
    elapsed: Duration,
) -> Result<Measured, BenchError> {
    let mut m = Measured {
        requests: 0,
        reads: 0,
        writes: 0,
        fetch_adds: 0,
        bytes: 0,
        elapsed,
        latency: LatencyRecorder::new(),
    };
    for r in outcomes {
        let (tally, lat) = r?;
        m.reads += tally.reads;
        m.writes += tally.writes;
        m.fetch_adds += tally.fetch_adds;
        m.bytes += tally.bytes;
        m.latency.merge(&lat);
    }
    m.requests = m.reads + m.writes + m.fetch_adds;
    Ok(m)
}

/// [`run_load`] with `spec.threads` tasks on one event-loop thread (this one), through a
/// [`LoopClient`] with the same configuration as `client`.
fn run_event_loop(
    client: &Client,
    regions: &[Region],
    spec: &LoadSpec,
    payload: Bytes,
    progress: Option<&Progress>,
) -> Result<Measured, BenchError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Check(format!("cannot start a runtime: {e}")))?;
    let per_task = spec.requests / spec.threads as u64;
    let extra = spec.requests % spec.threads as u64;
    let regions = Arc::new(regions.to_vec());
    let shared_spec = Arc::new(spec.clone());
    let progressed = Arc::new(AtomicU64::new(0));
    rt.block_on(async {
        let lc = LoopClient::connect((*client.map()).clone(), client.config().clone()).await?;
        let mut tasks = tokio::task::JoinSet::new();
        let start = Instant::now();
        for t in 0..spec.threads {
            let n = per_task + u64::from((t as u64) < extra);
            let seed = spec.seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            tasks.spawn(one_task(
                lc.clone(),
                regions.clone(),
                shared_spec.clone(),
                n,
                seed,
                payload.clone(),
                progressed.clone(),
            ));
        }
        let mut outcomes = Vec::with_capacity(spec.threads);
        let mut shown = 0;
        let mut tick = tokio::time::interval(PROGRESS_TICK);
        while !tasks.is_empty() {
            tokio::select! {
                done = tasks.join_next() => {
                    if let Some(done) = done {
                        outcomes.push(done.unwrap_or_else(|_| {
                            Err(BenchError::Check("a load task panicked".into()))
                        }));
                    }
                }
                _ = tick.tick() => {}
            }
            let now = progressed.load(Ordering::Relaxed);
            if let Some(p) = progress {
                p.inc(now - shown);
            }
            shown = now;
        }
        measured(outcomes, start.elapsed())
    })
}

/// One load driver's request stream: which region, offset, size and kind, drawn from a
/// seeded generator, and the tally of what it asked for.
struct Requests<'a> {
    rng: SmallRng,
    regions: &'a [Region],
    spec: &'a LoadSpec,
    payload: &'a Bytes,
    tally: Tally,
}

impl<'a> Requests<'a> {
    fn new(regions: &'a [Region], spec: &'a LoadSpec, seed: u64, payload: &'a Bytes) -> Self {
        Requests {
            rng: SmallRng::seed_from_u64(seed),
            regions,
            spec,
            payload,
            tally: Tally::default(),
        }
    }

    /// The next request, and for a read the bytes its answer must hold.
    fn next(&mut self) -> (NodeId, Op, Option<u32>) {
        let rng = &mut self.rng;
        let region = &self.regions[rng.gen_range(0..self.regions.len())];
        let sizes = &self.spec.sizes_bytes;
        let size = sizes[rng.gen_range(0..sizes.len())];
        // Slots are whole multiples of the size past the counter word, so requests
        // never straddle it and stay aligned the way applications use regions.
        let slots = (region.size - 8) / size as u64;
        let offset = 8 + rng.gen_range(0..slots) * size as u64;
        let dice = rng.gen_range(0..100u32);
        let reads = self.spec.mix.reads_percent as u32;
        let faas = reads + self.spec.mix.fetch_add_percent as u32;
        let t = &mut self.tally;
        if dice < reads {
            t.reads += 1;
            (region.node, region.read_op(offset, size), Some(size))
        } else if dice < faas {
            t.fetch_adds += 1;
            (region.node, region.fetch_add_op(0, 1), None)
        } else {
            t.writes += 1;
            t.bytes += size as u64;
            let data = self.payload.slice(..size as usize);
            (region.node, region.write_op(offset, data), None)
        }
    }

    /// Checks an answer against what was asked; a read's bytes count once they arrive.
    fn answered(&mut self, read_len: Option<u32>, reply: Reply) -> Result<(), BenchError> {
        match (read_len, reply) {
            (Some(len), Reply::Data(d)) if d.len() == len as usize => {
                self.tally.bytes += len as u64;
                Ok(())
            }
            (None, Reply::Done | Reply::Word(_)) => Ok(()),
            (_, other) => Err(BenchError::Check(format!(
                "unexpected reply {other:?} during the load"
            ))),
        }
    }
}

fn one_thread(
    client: &Client,
    regions: &[Region],
    spec: &LoadSpec,
    n: u64,
    seed: u64,
    payload: &Bytes,
    mut report: impl FnMut(u64),
) -> Result<(Tally, LatencyRecorder), BenchError> {
    let mut requests = Requests::new(regions, spec, seed, payload);
    let mut lat = LatencyRecorder::new();
    let mut inflight: VecDeque<(Pending, Instant, Option<u32>)> =
        VecDeque::with_capacity(spec.depth);
    let mut issued = 0u64;
    let mut unreported = 0u64;
    let mut burst: Vec<(NodeId, Op)> = Vec::with_capacity(spec.depth);
    let mut burst_reads: Vec<Option<u32>> = Vec::with_capacity(spec.depth);
    while issued < n || !inflight.is_empty() {
        while issued < n && inflight.len() + burst.len() < spec.depth {
            let (node, op, read_len) = requests.next();
            burst.push((node, op));
            burst_reads.push(read_len);
            issued += 1;
        }
        if !burst.is_empty() {
            // Everything the window has room for leaves together, timed from before the
            // submit (which may itself write to the socket).
            let sent = Instant::now();
            let pendings = client.submit_many(burst.drain(..))?;
            inflight.extend(
                pendings
                    .into_iter()
                    .zip(burst_reads.drain(..))
                    .map(|(p, r)| (p, sent, r)),
            );
        }
        // Take the oldest answer, waiting if need be, then every one already in: the
        // window is refilled in one burst, not one request per wake-up.
        while let Some((pending, sent, read_len)) = inflight.pop_front() {
            let reply = pending.wait()?;
            lat.record(sent.elapsed());
            requests.answered(read_len, reply)?;
            unreported += 1;
            if unreported == PROGRESS_STEP {
                report(unreported);
                unreported = 0;
            }
            if !inflight.front().is_some_and(|(p, _, _)| p.is_ready()) {
                break;
            }
        }
    }
    report(unreported);
    Ok((requests.tally, lat))
}

/// [`one_thread`] as a task of the event-loop face: the same window and the same checks.
async fn one_task(
    client: LoopClient,
    regions: Arc<Vec<Region>>,
    spec: Arc<LoadSpec>,
    n: u64,
    seed: u64,
    payload: Bytes,
    progressed: Arc<AtomicU64>,
) -> Result<(Tally, LatencyRecorder), BenchError> {
    let mut requests = Requests::new(&regions, &spec, seed, &payload);
    let mut lat = LatencyRecorder::new();
    let mut inflight: VecDeque<(LoopPending, Instant, Option<u32>)> =
        VecDeque::with_capacity(spec.depth);
    let mut issued = 0u64;
    let mut unreported = 0u64;
    while issued < n || !inflight.is_empty() {
        // One clock read per refill and one per sweep of answers, as redis-benchmark
        // reads it per write and per reply: on one thread driving 256 requests in flight
        // a read per request was ~5% of the client's time. Both are taken on the far
        // side of what they bound, so a latency can only come out longer, never shorter.
        let sent = Instant::now();
        while issued < n && inflight.len() < spec.depth {
            let (node, op, read_len) = requests.next();
            inflight.push_back((client.submit(node, op).await?, sent, read_len));
            issued += 1;
        }
        let mut answered_at = None;
        while let Some((pending, sent, read_len)) = inflight.pop_front() {
            let reply = pending.await?;
            let at = *answered_at.get_or_insert_with(Instant::now);
            lat.record(at.saturating_duration_since(sent));
            requests.answered(read_len, reply)?;
            unreported += 1;
            if unreported == PROGRESS_STEP {
                progressed.fetch_add(unreported, Ordering::Relaxed);
                unreported = 0;
            }
            if !inflight.front().is_some_and(|(p, _, _)| p.is_ready()) {
                break;
            }
        }
    }
    progressed.fetch_add(unreported, Ordering::Relaxed);
    Ok((requests.tally, lat))
}

/// Allocates one region of `bytes` on every node of the client's map.
pub fn regions_on_every_node(client: &Client, bytes: u64) -> Result<Vec<Region>, BenchError> {
    let ids: Vec<_> = client.map().node_ids().collect();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        out.push(client.alloc_on(id, bytes, None)?);
    }
    Ok(out)
}

/// Frees what [`regions_on_every_node`] allocated.
pub fn free_all(client: &Client, regions: &[Region]) -> Result<(), BenchError> {
    for r in regions {
        client.free(r)?;
    }
    Ok(())
}

/// Sum of the FETCH_ADD counters (word 0) over `regions`.
pub fn counters_total(client: &Client, regions: &[Region]) -> Result<u64, BenchError> {
    let mut total = 0u64;
    for r in regions {
        match client.call(r.node, r.fetch_add_op(0, 0))? {
            Reply::Word(w) => total = total.wrapping_add(w),
            other => {
                return Err(BenchError::Check(format!(
                    "unexpected reply {other:?} to a counter read"
                )))
            }
        }
    }
    Ok(total)
}
