//! The closed-loop load generator behind `threads`, `demo` and `api`: T client threads,
//! each keeping `depth` requests outstanding against regions spread over the nodes.

use crate::latency::LatencyRecorder;
use crate::progress::Progress;
use crate::side::{CamelotNodes, CamelotSpec, ClientSide, CpuMeter, Placement, Side};
use crate::BenchError;
use bytes::Bytes;
use camelot_client::proto::{Op, Reply};
use camelot_client::{
    Client, ClientConfig, ClusterMap, LoopClient, LoopPending, NodeId, Pending, Region,
};
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
/// Longest minimum duration one measurement may ask for.
pub const MIN_DURATION_MAX: Duration = Duration::from_secs(3600);

/// The requests of one measurement, shared by its drivers. Each takes its next request
/// from the pool when its window has room, so a driver the scheduler favours does more
/// and none is left finishing a private quota alone: with fixed per-thread quotas, 64
/// batched threads finished over a spread of 30–40% of the run (first 106 ms, last
/// 145–175 ms), and the last third measured a handful of threads, not 64. Once the pool
/// is empty, drivers go on until the minimum duration is over.
struct Quota {
    remaining: AtomicU64,
    base: Instant,
    /// Nanoseconds after `base` until which drivers go on past the pool (set by
    /// `start`, before the drivers are released).
    deadline_ns: AtomicU64,
}

impl Quota {
    fn new(requests: u64) -> Quota {
        Quota {
            remaining: AtomicU64::new(requests),
            base: Instant::now(),
            deadline_ns: AtomicU64::new(0),
        }
    }

    /// Starts the clock: drivers go on at least `min_duration` from now.
    fn start(&self, min_duration: Duration) {
        let ns = (self.base.elapsed() + min_duration).as_nanos();
        self.deadline_ns
            .store(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Whether the caller may issue one more request.
    fn claim(&self) -> bool {
        let pooled = self
            .remaining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
            .is_ok();
        pooled
            || self.base.elapsed().as_nanos() < u128::from(self.deadline_ns.load(Ordering::Relaxed))
    }
}

/// Where requests go: servers that were already running (`--servers`), or Camelot
/// servers started for the run — `camelot server` processes by default, like every peer a
/// bench compares against, or a dev cluster inside this process when asked for (and then
/// labelled so wherever its figures go).
pub struct Target {
    nodes: Option<CamelotNodes>,
    addrs: Vec<SocketAddr>,
    token: Option<Vec<u8>>,
}

impl Target {
    /// Uses `servers` when there are any (the spec's token applies to them), else starts
    /// the servers `spec` describes: separate `camelot server` processes, or in this
    /// process when `in_process`.
    pub fn open(
        servers: &[SocketAddr],
        spec: &CamelotSpec,
        in_process: bool,
    ) -> Result<Target, BenchError> {
        if servers.is_empty() {
            Target::start(spec, &Placement::choose(in_process)?)
        } else if in_process {
            Err(BenchError::InvalidConfig(
                "servers that are given run where they run: drop --in-process".into(),
            ))
        } else {
            Ok(Target {
                nodes: None,
                addrs: servers.to_vec(),
                token: spec.token.clone(),
            })
        }
    }

    /// Starts the servers `spec` describes, placed as `placement` says.
    pub fn start(spec: &CamelotSpec, placement: &Placement) -> Result<Target, BenchError> {
        let nodes = CamelotNodes::start(spec, placement)?;
        Ok(Target {
            addrs: nodes.addrs(),
            token: spec.token.clone(),
            nodes: Some(nodes),
        })
    }

    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The servers started for this run (none when they were given).
    pub fn nodes(&self) -> Option<&CamelotNodes> {
        self.nodes.as_ref()
    }

    /// True when the servers run inside this process (and share its cores).
    pub fn is_in_process(&self) -> bool {
        self.nodes
            .as_ref()
            .is_some_and(|n| n.placement().is_in_process())
    }

    /// `label`, marked when the servers run in this process.
    pub fn label(&self, label: &str) -> String {
        match &self.nodes {
            Some(n) => n.placement().label(label),
            None => label.to_string(),
        }
    }

    /// A meter of the servers' CPU seconds; it reads nothing when there is no process of
    /// ours to meter (servers given, or in process).
    pub fn cpu_meter(&self) -> CpuMeter {
        match &self.nodes {
            Some(n) => n.cpu_meter(),
            None => CpuMeter::start(Vec::new()),
        }
    }

    /// How the servers ran, for a result's `config`: `process` (`separate`, `in-process`
    /// or `given`), the addresses or the command line, the flags and the serving threads.
    pub fn describe(&self) -> serde_json::Value {
        match &self.nodes {
            None => serde_json::json!({
                "process": "given",
                "servers": self.addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            }),
            Some(n) => {
                let mut d = serde_json::json!({
                    "process": n.placement().name(),
                    "nodes": n.spec().nodes,
                    "flags": n.spec().flags(),
                    "server_threads": n.spec().serving_threads(false),
                });
                if let Some(p) = n.processes().first() {
                    d["command"] = serde_json::json!(p.command());
                }
                d
            }
        }
    }

    /// The record of this side for `config["sides"]`: the servers started for the run
    /// as they ran, or, for servers given with `--servers`, their addresses (what they
    /// are and how they run is not this bench's to know).
    pub fn side(&self, label: &str, client: ClientSide) -> Side {
        match &self.nodes {
            Some(n) => n.side(label, client),
            None => Side {
                label: label.to_string(),
                server: "camelot".into(),
                process: "given".into(),
                server_threads: None,
                nodes: self.addrs.len(),
                version: "unknown (servers given with --servers)".into(),
                flags: Vec::new(),
                command: self
                    .addrs
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                client,
            },
        }
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

    /// Server counters, node by node, when the servers run in this process.
    pub fn dev_stats(&self) -> Option<Vec<Vec<(String, u64)>>> {
        self.nodes.as_ref().and_then(CamelotNodes::dev_stats)
    }

    /// [`run_load`], with the servers' CPU seconds over the measurement recorded in the
    /// result when there is a process to meter.
    pub fn run_load(
        &self,
        client: &Client,
        regions: &[Region],
        spec: &LoadSpec,
        progress: Option<&Progress>,
    ) -> Result<Measured, BenchError> {
        let meter = self.cpu_meter();
        let mut m = run_load(client, regions, spec, progress)?;
        m.server_cpu_seconds = meter.seconds();
        Ok(m)
    }

    pub fn close(self) -> Result<(), BenchError> {
        match self.nodes {
            Some(n) => n.stop(),
            None => Ok(()),
        }
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
    /// Requests in total, over all threads: a shared pool each driver takes its next
    /// request from, so the run ends when the pool does, not on its slowest driver.
    pub requests: u64,
    /// The drivers keep going past `requests` until this much time has passed, so a
    /// point is never a fraction of a second that one scheduling hiccup decides.
    pub min_duration: Duration,
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
        if self.min_duration > MIN_DURATION_MAX {
            return bad(format!(
                "a minimum duration of {:?} is more than {MIN_DURATION_MAX:?}",
                self.min_duration
            ));
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

/// Server CPU seconds below which a ratio of two servers' ops per CPU-second is left
/// out: the kernel counts CPU time in 10 ms ticks, so a run needs ten of them before the
/// rounding is under 10%. (A point still records its own figure from one tick up.)
pub const CPU_SECONDS_FOR_RATIO_MIN: f64 = 0.1;

/// What one measurement saw.
#[derive(Debug, Clone)]
pub struct Measured {
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub fetch_adds: u64,
    /// Payload bytes moved by reads and writes, both directions together.
    pub bytes: u64,
    /// Payload bytes the reads brought back (server to client).
    pub read_bytes: u64,
    /// Payload bytes the writes sent (client to server).
    pub write_bytes: u64,
    pub elapsed: Duration,
    pub latency: LatencyRecorder,
    /// CPU seconds the server processes spent over the measurement, when they are
    /// processes of this run ([`Target::run_load`]).
    pub server_cpu_seconds: Option<f64>,
    /// Fewest and most requests one driver (thread or task) completed: how evenly the
    /// client shared the work out.
    pub driver_requests_min: u64,
    pub driver_requests_max: u64,
}

impl Measured {
    pub fn ops_per_sec(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    /// Payload rate in one direction: what the reads brought back.
    pub fn read_bytes_per_sec(&self) -> f64 {
        self.read_bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    /// `server_cpu_seconds` and `ops_per_server_cpu_second` for a point's `extra`
    /// (nothing without a metered process).
    pub fn cpu_extra(&self) -> Vec<(&'static str, serde_json::Value)> {
        crate::side::cpu_extra(self.requests as f64, self.server_cpu_seconds)
    }

    /// What a point records about the run beyond its figures: its length, the requests
    /// done and how they were spread over the drivers.
    pub fn run_extra(&self) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("seconds", serde_json::json!(self.elapsed.as_secs_f64())),
            ("requests", serde_json::json!(self.requests)),
            (
                "driver_requests_min",
                serde_json::json!(self.driver_requests_min),
            ),
            (
                "driver_requests_max",
                serde_json::json!(self.driver_requests_max),
            ),
        ]
    }
}

#[derive(Default)]
struct Tally {
    reads: u64,
    writes: u64,
    fetch_adds: u64,
    read_bytes: u64,
    write_bytes: u64,
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
    let quota = Quota::new(spec.requests);

    let (outcomes, elapsed) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..spec.threads)
            .map(|t| {
                let core = (!cores.is_empty()).then(|| cores[t % cores.len()]);
                let (barrier, payload, progressed, quota) =
                    (&barrier, payload.clone(), &progressed, &quota);
                s.spawn(move || {
                    if let Some(c) = core {
                        core_affinity::set_for_current(c);
                    }
                    let seed = spec.seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    barrier.wait();
                    let r = one_thread(client, regions, spec, quota, seed, &payload, |k| {
                        if let Some(p) = progress {
                            p.inc(k);
                        }
                        progressed.fetch_add(k, Ordering::Relaxed);
                    });
                    (r, Instant::now())
                })
            })
            .collect();
        // Every thread is waiting at the barrier by now. The clock starts before they are
        // released, so waking 64 of them counts against the run, never for it.
        let start = Instant::now();
        quota.start(spec.min_duration);
        barrier.wait();
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
        read_bytes: 0,
        write_bytes: 0,
        elapsed,
        latency: LatencyRecorder::new(),
        server_cpu_seconds: None,
        driver_requests_min: u64::MAX,
        driver_requests_max: 0,
    };
    for r in outcomes {
        let (tally, lat) = r?;
        let done = tally.reads + tally.writes + tally.fetch_adds;
        m.driver_requests_min = m.driver_requests_min.min(done);
        m.driver_requests_max = m.driver_requests_max.max(done);
        m.reads += tally.reads;
        m.writes += tally.writes;
        m.fetch_adds += tally.fetch_adds;
        m.read_bytes += tally.read_bytes;
        m.write_bytes += tally.write_bytes;
        m.latency.merge(&lat);
    }
    m.requests = m.reads + m.writes + m.fetch_adds;
    m.bytes = m.read_bytes + m.write_bytes;
    m.driver_requests_min = m.driver_requests_min.min(m.driver_requests_max);
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
    let quota = Arc::new(Quota::new(spec.requests));
    let regions = Arc::new(regions.to_vec());
    let shared_spec = Arc::new(spec.clone());
    let progressed = Arc::new(AtomicU64::new(0));
    rt.block_on(async {
        let lc = LoopClient::connect((*client.map()).clone(), client.config().clone()).await?;
        let mut tasks = tokio::task::JoinSet::new();
        let start = Instant::now();
        quota.start(spec.min_duration);
        for t in 0..spec.threads {
            let seed = spec.seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            tasks.spawn(one_task(
                lc.clone(),
                regions.clone(),
                shared_spec.clone(),
                quota.clone(),
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
            t.write_bytes += size as u64;
            let data = self.payload.slice(..size as usize);
            (region.node, region.write_op(offset, data), None)
        }
    }

    /// Checks an answer against what was asked; a read's bytes count once they arrive.
    fn answered(&mut self, read_len: Option<u32>, reply: Reply) -> Result<(), BenchError> {
        match (read_len, reply) {
            (Some(len), Reply::Data(d)) if d.len() == len as usize => {
                self.tally.read_bytes += len as u64;
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
    quota: &Quota,
    seed: u64,
    payload: &Bytes,
    mut report: impl FnMut(u64),
) -> Result<(Tally, LatencyRecorder), BenchError> {
    let mut requests = Requests::new(regions, spec, seed, payload);
    let mut lat = LatencyRecorder::new();
    let mut inflight: VecDeque<(Pending, Instant, Option<u32>)> =
        VecDeque::with_capacity(spec.depth);
    let mut more = true;
    let mut unreported = 0u64;
    let mut burst: Vec<(NodeId, Op)> = Vec::with_capacity(spec.depth);
    let mut burst_reads: Vec<Option<u32>> = Vec::with_capacity(spec.depth);
    while more || !inflight.is_empty() {
        while more && inflight.len() + burst.len() < spec.depth {
            more = quota.claim();
            if !more {
                break;
            }
            let (node, op, read_len) = requests.next();
            burst.push((node, op));
            burst_reads.push(read_len);
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
    quota: Arc<Quota>,
    seed: u64,
    payload: Bytes,
    progressed: Arc<AtomicU64>,
) -> Result<(Tally, LatencyRecorder), BenchError> {
    let mut requests = Requests::new(&regions, &spec, seed, &payload);
    let mut lat = LatencyRecorder::new();
    let mut inflight: VecDeque<(LoopPending, Instant, Option<u32>)> =
        VecDeque::with_capacity(spec.depth);
    let mut more = true;
    let mut unreported = 0u64;
    while more || !inflight.is_empty() {
        // One clock read per refill and one per sweep of answers, as redis-benchmark
        // reads it per write and per reply: on one thread driving 256 requests in flight
        // a read per request was ~5% of the client's time. Both are taken on the far
        // side of what they bound, so a latency can only come out longer, never shorter.
        let sent = Instant::now();
        while more && inflight.len() < spec.depth {
            more = quota.claim();
            if !more {
                break;
            }
            let (node, op, read_len) = requests.next();
            inflight.push_back((client.submit(node, op).await?, sent, read_len));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_hands_out_exactly_its_requests_then_runs_out_the_clock() {
        let q = Quota::new(3);
        q.start(Duration::ZERO);
        assert!(q.claim() && q.claim() && q.claim());
        assert!(!q.claim(), "no fourth request without a minimum duration");

        let min = Duration::from_millis(30);
        let q = Quota::new(2);
        let t = Instant::now();
        q.start(min);
        let mut claimed = 0u64;
        while q.claim() {
            claimed += 1;
        }
        assert!(claimed > 2, "went on past the pool");
        assert!(t.elapsed() >= min, "stopped before the minimum duration");
    }

    fn spec(event_loop: bool, min_duration: Duration) -> LoadSpec {
        LoadSpec {
            threads: 4,
            depth: 2,
            requests: 400,
            min_duration,
            mix: Mix {
                reads_percent: 50,
                fetch_add_percent: 0,
            },
            sizes_bytes: vec![64],
            pin: false,
            event_loop,
            seed: 7,
        }
    }

    #[test]
    fn loads_share_one_pool_and_count_each_direction() -> Result<(), BenchError> {
        let target = Target::start(&CamelotSpec::new(1, 2 << 20), &Placement::InProcess)?;
        assert!(target.is_in_process());
        assert_eq!(target.label("batched"), "batched (in-process)");
        assert_eq!(target.describe()["process"], "in-process");
        let client = target.connect(true)?;
        let regions = regions_on_every_node(&client, 1 << 20)?;
        for event_loop in [false, true] {
            let m = target.run_load(&client, &regions, &spec(event_loop, Duration::ZERO), None)?;
            assert_eq!(m.requests, 400, "exactly the pool without a time floor");
            assert_eq!(m.reads + m.writes, m.requests);
            assert_eq!(m.read_bytes, m.reads * 64);
            assert_eq!(m.write_bytes, m.writes * 64);
            assert_eq!(m.bytes, m.read_bytes + m.write_bytes);
            assert!(m.driver_requests_min <= m.driver_requests_max);
            assert!(m.driver_requests_max <= m.requests);
            assert_eq!(m.server_cpu_seconds, None, "nothing to meter in process");
            assert!(m.cpu_extra().is_empty());

            let min = Duration::from_millis(150);
            let m = target.run_load(&client, &regions, &spec(event_loop, min), None)?;
            assert!(m.requests >= 400, "{}", m.requests);
            assert!(m.elapsed >= min, "{:?}", m.elapsed);
        }
        free_all(&client, &regions)?;
        drop(client);
        target.close()
    }

    #[test]
    fn given_servers_cannot_be_in_process() {
        let addr = SocketAddr::from(([127, 0, 0, 1], 1));
        let spec = CamelotSpec::new(1, 1 << 20);
        assert!(matches!(
            Target::open(&[addr], &spec, true),
            Err(BenchError::InvalidConfig(_))
        ));
        let given = Target::open(&[addr], &spec, false).expect("nothing to start");
        assert_eq!(given.describe()["process"], "given");
        assert_eq!(given.label("batched"), "batched");
        assert_eq!(given.cpu_meter().seconds(), None);
    }
}
