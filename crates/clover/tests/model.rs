//! The chain logic without sockets: the same state machines the network store runs,
//! against in-memory blocks, with the interleaving of clients' accesses and collection
//! passes chosen by proptest, every history checked for linearizability.

use bytes::Bytes;
use camelot_check::{check, History, Limits, Op, Outcome, Verdict};
use camelot_clover::chain::{Access, Answer, ReadOp, Step, WriteOp};
use camelot_clover::layout::{decode_node, tail_marker, Next, FLAG_REDIRECTED, HEADER_BYTES};
use camelot_clover::{
    ChainLimits, Geometry, Hint, Memory, Meta, MetaConfig, NodeAddr, SimMemory, Store, StoreConfig,
};
use proptest::prelude::*;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn enc(v: u64) -> Option<Bytes> {
    (v != 0).then(|| Bytes::copy_from_slice(&v.to_le_bytes()))
}

fn dec(b: &Option<Bytes>) -> u64 {
    b.as_ref().map_or(0, |b| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[..8]);
        u64::from_le_bytes(w)
    })
}

fn sim(blocks_max: u32, versions_kept: usize) -> (SimMemory, Arc<Meta<SimMemory>>) {
    let mem = SimMemory::new(Geometry::new(8, 8).unwrap());
    let config = MetaConfig {
        blocks_max,
        versions_kept,
        ..MetaConfig::default()
    };
    let meta = Arc::new(Meta::new(mem.clone(), config).unwrap());
    (mem, meta)
}

#[test]
fn sequential_put_get_delete_and_conditional_put() {
    let (mem, meta) = sim(4, 2);
    let mut s = Store::new(meta.clone(), mem, StoreConfig::default());
    assert_eq!(s.get(b"a").unwrap(), None);
    s.put(b"a", enc(7).unwrap()).unwrap();
    assert_eq!(dec(&s.get(b"a").unwrap()), 7);
    assert!(!s.compare_and_put(b"a", enc(8), enc(9)).unwrap());
    assert!(s.compare_and_put(b"a", enc(7), enc(9)).unwrap());
    assert_eq!(dec(&s.get(b"a").unwrap()), 9);
    s.delete(b"a").unwrap();
    assert_eq!(s.get(b"a").unwrap(), None);
    assert!(s.compare_and_put(b"a", None, enc(1)).unwrap());
    assert_eq!(dec(&s.get(b"a").unwrap()), 1);
    assert_eq!(s.get(b"b").unwrap(), None);
}

#[test]
fn collection_bounds_memory_and_stale_hints_restart() {
    // 2 blocks of 8 nodes: 16 nodes for 3 keys and thousands of writes.
    let (mem, meta) = sim(2, 1);
    let mut reader = Store::new(meta.clone(), mem.clone(), StoreConfig::default());
    let cfg = StoreConfig {
        grant_nodes: 2,
        ..StoreConfig::default()
    };
    let mut writer = Store::new(meta.clone(), mem, cfg);
    for k in [&b"x"[..], b"y", b"z"] {
        assert_eq!(reader.get(k).unwrap(), None);
    }
    for i in 1..=2_000u64 {
        let key: &[u8] = [&b"x"[..], b"y", b"z"][(i % 3) as usize];
        writer.put(key, enc(i).unwrap()).unwrap();
    }
    let stats = meta.stats();
    assert!(stats.blocks <= 2, "{stats:?}");
    assert!(stats.nodes_reclaimed > 1_900, "{stats:?}");
    // The reader's hints are versions long since reused: it notices and restarts.
    assert_eq!(dec(&reader.get(b"x").unwrap()), 1_998);
    assert_eq!(dec(&reader.get(b"y").unwrap()), 1_999);
    assert_eq!(dec(&reader.get(b"z").unwrap()), 2_000);
    assert!(reader.stats().restarts >= 1, "{:?}", reader.stats());
}

#[test]
fn a_full_store_says_so() {
    let (mem, meta) = sim(1, 1);
    let mut s = Store::new(meta, mem, StoreConfig::default());
    let mut failed = None;
    for k in 0..20u8 {
        if let Err(e) = s.put(&[k], enc(1).unwrap()) {
            failed = Some(e);
            break;
        }
    }
    assert!(
        matches!(
            failed,
            Some(camelot_clover::CloverError::OutOfMemory { blocks_max: 1 })
        ),
        "{failed:?}"
    );
}

/// A grant that finds nothing free while retired nodes wait only for an operation in
/// flight (here one pinned before any write) waits for that operation to end instead of
/// calling the store full.
#[test]
fn a_grant_waits_for_nodes_an_operation_in_flight_holds_back() {
    let (mem, meta) = sim(1, 1);
    let slot = meta.register();
    let pin = meta.pin(&slot);
    let writer = {
        let (meta, mem) = (meta.clone(), mem.clone());
        std::thread::spawn(move || {
            let cfg = StoreConfig {
                grant_nodes: 1,
                ..StoreConfig::default()
            };
            let mut s = Store::new(meta, mem, cfg);
            (1..=40u64)
                .map(|i| s.put(b"a", enc(i).unwrap()))
                .collect::<Result<Vec<_>, _>>()
        })
    };
    // Until the writer waits: its block used up, the rest retired behind the pin.
    let deadline = Instant::now() + Duration::from_secs(10);
    while meta.stats().grants_waited == 0 {
        assert!(
            !writer.is_finished() && Instant::now() < deadline,
            "no grant waited: {:?}",
            meta.stats()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(pin);
    let written = writer.join().expect("writer");
    assert!(written.is_ok(), "{written:?}");
    assert!(meta.stats().nodes_reclaimed > 0, "{:?}", meta.stats());
}

/// Two callers making the same new key while nodes are short get one id: the one whose
/// node came second finds the key made while it waited (two chains for one key would
/// give its stores two ids, and one's writes would be read by nobody).
#[test]
fn a_key_made_while_another_caller_waited_for_a_node_has_one_id() {
    let (mem, meta) = sim(1, 1);
    let slot = meta.register();
    let pin = meta.pin(&slot);
    let mut s = Store::new(meta.clone(), mem, StoreConfig::default());
    for i in 1..=4 {
        s.put(b"a", enc(i).unwrap()).unwrap();
    }
    drop(s);
    meta.gc().unwrap();
    // Every free node held elsewhere; the retired ones wait behind the pin.
    let held = meta.grant(1024).unwrap();
    let stats = meta.stats();
    assert!(
        stats.free_nodes == 0 && stats.limbo_nodes >= 2,
        "{stats:?} (held {})",
        held.len()
    );
    let makers: Vec<_> = (0..2)
        .map(|_| {
            let meta = meta.clone();
            std::thread::spawn(move || meta.key(b"new").map(|(id, _)| id))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while meta.stats().grants_waited < 2 {
        assert!(Instant::now() < deadline, "{:?}", meta.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(pin);
    let ids: Vec<u64> = makers
        .into_iter()
        .map(|m| m.join().expect("maker").expect("key"))
        .collect();
    assert_eq!(ids[0], ids[1], "one key, two ids");
    assert_eq!(meta.stats().keys, 2);
}

// ---- interleavings ----

#[derive(Debug, Clone)]
enum Planned {
    Read(u8),
    Write(u8),
    /// Conditional write expecting the value last seen by this client on that key
    /// (true) or something else.
    Cas(u8, bool),
}

fn planned() -> impl Strategy<Value = Planned> {
    prop_oneof![
        3 => (0u8..2).prop_map(Planned::Read),
        2 => (0u8..2).prop_map(Planned::Write),
        1 => (0u8..2, any::<bool>()).prop_map(|(k, b)| Planned::Cas(k, b)),
    ]
}

enum Machine {
    Read(ReadOp),
    Write(WriteOp, NodeAddr),
}

struct Running {
    machine: Machine,
    access: Access,
    key: u8,
    key_id: u64,
    op: Op,
    invoke: u64,
}

struct SimClient {
    id: u32,
    script: VecDeque<Planned>,
    hints: HashMap<u8, (u64, Hint)>,
    seen: HashMap<u8, u64>,
    free: Vec<NodeAddr>,
    running: Option<Running>,
}

/// How a simulated reader behaves: correctly, or (to show the checker catches it)
/// answering from its cached hint without walking to the tail.
#[derive(Clone, Copy, PartialEq)]
enum Reader {
    Correct,
    TrustsCache,
}

/// A simulated middlebox on the read path, as the proxy's read cache is: none, one that
/// sends a READ of an old version to the key's newest *linked* version (correct), or a
/// broken one that sends it to the newest version *written* (perhaps not yet linked).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Middlebox {
    None,
    RedirectsToLinked,
    RedirectsToWritten,
}

struct World {
    mem: SimMemory,
    meta: Arc<Meta<SimMemory>>,
    geometry: Geometry,
    clock: u64,
    fresh: u64,
    history: History<u8>,
    reader: Reader,
    middlebox: Middlebox,
    redirects: u64,
}

impl World {
    /// The node a middlebox answers a READ of `addr` with, if it redirects it.
    fn redirect(&self, addr: NodeAddr) -> Option<NodeAddr> {
        let (h, _) = decode_node(&self.mem.read(addr, HEADER_BYTES).ok()?).ok()?;
        let target = match self.middlebox {
            Middlebox::None => return None,
            Middlebox::RedirectsToLinked => {
                // The chain as it is now, from the head: its last node.
                let mut cur = self.meta.head(h.key_id).ok()?;
                for _ in 0..10_000 {
                    let (n, _) = decode_node(&self.mem.read(cur.addr, HEADER_BYTES).ok()?).ok()?;
                    if n.key_id != h.key_id || n.seq != cur.seq {
                        return None;
                    }
                    match Next::decode(n.next) {
                        Next::Node(a) => {
                            cur = Hint {
                                addr: a,
                                seq: cur.seq + 1,
                            }
                        }
                        _ => break,
                    }
                }
                cur
            }
            Middlebox::RedirectsToWritten => {
                let mut best: Option<Hint> = None;
                for block in 0..self.mem.blocks() {
                    for slot in 0..self.geometry.nodes_per_block {
                        let a = NodeAddr { block, slot };
                        let Ok((n, _)) = decode_node(&self.mem.read(a, HEADER_BYTES).ok()?) else {
                            continue;
                        };
                        if n.key_id == h.key_id
                            && n.next == tail_marker(n.key_id, n.seq)
                            && best.is_none_or(|b| n.seq > b.seq)
                        {
                            best = Some(Hint {
                                addr: a,
                                seq: n.seq,
                            });
                        }
                    }
                }
                best?
            }
        };
        (target.seq > h.seq && target.addr != addr).then_some(target.addr)
    }

    fn read_through_middlebox(&mut self, addr: NodeAddr, len: u32) -> Bytes {
        let Some(to) = self.redirect(addr) else {
            return self.mem.read(addr, len).unwrap();
        };
        self.redirects += 1;
        let mut b = self.mem.read(to, len).unwrap().to_vec();
        let flags = u32::from_le_bytes(b[28..32].try_into().unwrap()) | FLAG_REDIRECTED;
        b[28..32].copy_from_slice(&flags.to_le_bytes());
        Bytes::from(b)
    }
}

impl World {
    fn step(&mut self, c: &mut SimClient) {
        self.clock += 1;
        let Some(mut run) = c.running.take() else {
            self.start(c);
            return;
        };
        let answer = match &run.access {
            Access::Read { addr, len } => Answer::Data(self.read_through_middlebox(*addr, *len)),
            Access::Write { addr, data } => {
                self.mem.write(*addr, data.clone()).unwrap();
                Answer::Done
            }
            Access::Cas {
                addr,
                expected,
                new,
            } => Answer::Word(self.mem.cas(*addr, *expected, *new).unwrap()),
            Access::Head => Answer::Head(self.meta.head(run.key_id).unwrap()),
        };
        let finished = match &mut run.machine {
            Machine::Read(m) => match m.resume(answer).unwrap() {
                Step::Issue(a) => Err(a),
                Step::Finished(d) => {
                    c.hints.insert(run.key, (run.key_id, d.tail));
                    Ok(Outcome::Read(dec(&d.value)))
                }
            },
            Machine::Write(m, node) => match m.resume(answer).unwrap() {
                Step::Issue(a) => Err(a),
                Step::Finished(d) => {
                    c.hints.insert(run.key, (run.key_id, d.tail));
                    if !d.applied {
                        c.free.push(*node);
                    }
                    Ok(match run.op {
                        Op::Write(_) => Outcome::Written,
                        _ => Outcome::Cas { swapped: d.applied },
                    })
                }
            },
        };
        match finished {
            Err(a) => {
                run.access = a;
                c.running = Some(run);
            }
            Ok(outcome) => {
                if let Outcome::Read(v) = outcome {
                    c.seen.insert(run.key, v);
                }
                self.history
                    .push(
                        c.id,
                        run.key,
                        run.op,
                        run.invoke,
                        Some((self.clock, outcome)),
                    )
                    .unwrap();
            }
        }
    }

    fn start(&mut self, c: &mut SimClient) {
        let Some(p) = c.script.pop_front() else {
            return;
        };
        let key = match p {
            Planned::Read(k) | Planned::Write(k) | Planned::Cas(k, _) => k,
        };
        let (key_id, hint) = match c.hints.get(&key) {
            Some(&h) => h,
            None => {
                let h = self.meta.key(&[key]).unwrap();
                c.hints.insert(key, h);
                h
            }
        };
        let limits = ChainLimits::default();
        let invoke = self.clock;
        if let Planned::Read(_) = p {
            if self.reader == Reader::TrustsCache && c.seen.contains_key(&key) {
                // The broken reader: answers what it saw last, at once.
                let v = c.seen[&key];
                self.history
                    .push(
                        c.id,
                        key,
                        Op::Read,
                        invoke,
                        Some((invoke, Outcome::Read(v))),
                    )
                    .unwrap();
                return;
            }
            let mut m = ReadOp::new(&self.geometry, key_id, hint, limits);
            let access = m.start();
            c.running = Some(Running {
                machine: Machine::Read(m),
                access,
                key,
                key_id,
                op: Op::Read,
                invoke,
            });
            return;
        }
        if c.free.is_empty() {
            c.free = self.meta.grant(2).unwrap();
        }
        let node = c.free.pop().unwrap();
        self.fresh += 1;
        let new = self.fresh;
        let (op, condition) = match p {
            Planned::Cas(_, current) => {
                let seen = c.seen.get(&key).copied().unwrap_or(0);
                let expected = if current { seen } else { seen + 1_000_000 };
                (Op::Cas { expected, new }, Some(enc(expected)))
            }
            _ => (Op::Write(new), None),
        };
        let mut m = WriteOp::new(
            &self.geometry,
            key_id,
            hint,
            node,
            enc(new),
            condition,
            limits,
        )
        .unwrap();
        let access = m.start();
        c.running = Some(Running {
            machine: Machine::Write(m, node),
            access,
            key,
            key_id,
            op,
            invoke,
        });
    }
}

/// Runs the scripts under the schedule: each entry picks the client that takes the next
/// step, or (255) a collection pass. Nothing pins epochs here, so a pass frees retired
/// nodes at once and the next grant reuses them under other clients' feet: correctness
/// must come from the walk's checks alone.
fn run(
    scripts: Vec<Vec<Planned>>,
    schedule: &[u8],
    reader: Reader,
) -> (History<u8>, camelot_clover::MetaStats) {
    let (h, stats, _) = run_with(scripts, schedule, reader, Middlebox::None);
    (h, stats)
}

/// As [`run`], with a middlebox on the read path; also returns how many READs it
/// redirected.
fn run_with(
    scripts: Vec<Vec<Planned>>,
    schedule: &[u8],
    reader: Reader,
    middlebox: Middlebox,
) -> (History<u8>, camelot_clover::MetaStats, u64) {
    let geometry = Geometry::new(8, 8).unwrap();
    let mem = SimMemory::new(geometry);
    let config = MetaConfig {
        blocks_max: 16,
        versions_kept: 1,
        ..MetaConfig::default()
    };
    let meta = Arc::new(Meta::new(mem.clone(), config).unwrap());
    let mut world = World {
        mem,
        meta: meta.clone(),
        geometry,
        clock: 0,
        fresh: 0,
        history: History::new(0),
        reader,
        middlebox,
        redirects: 0,
    };
    let mut clients: Vec<SimClient> = scripts
        .into_iter()
        .enumerate()
        .map(|(i, s)| SimClient {
            id: i as u32,
            script: s.into(),
            hints: HashMap::new(),
            seen: HashMap::new(),
            free: Vec::new(),
            running: None,
        })
        .collect();
    let n = clients.len();
    for &pick in schedule {
        if pick == 255 {
            meta.gc().unwrap();
        } else {
            let c = &mut clients[usize::from(pick) % n];
            world.step(c);
        }
    }
    // Then everyone runs to the end, round-robin, collecting now and then.
    for round in 0.. {
        let busy: Vec<usize> = (0..n)
            .filter(|&i| clients[i].running.is_some() || !clients[i].script.is_empty())
            .collect();
        if busy.is_empty() {
            break;
        }
        for i in busy {
            world.step(&mut clients[i]);
        }
        if round % 7 == 0 {
            meta.gc().unwrap();
        }
    }
    (world.history, meta.stats(), world.redirects)
}

fn schedule() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop_oneof![9 => 0u8..4, 1 => Just(255u8)], 0..400)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn interleaved_clients_with_eager_reuse_are_linearizable(
        scripts in prop::collection::vec(prop::collection::vec(planned(), 0..25), 1..5),
        schedule in schedule(),
    ) {
        let (h, _) = run(scripts, &schedule, Reader::Correct);
        let report = check(&h, &Limits::default());
        prop_assert!(report.is_linearizable(), "{:?}\n{:?}", report.verdict, h);
    }
}

/// The pipeline (simulated clients → recorded history → checker) can fail: a reader
/// that answers from its cache instead of walking to the tail is caught.
#[test]
fn a_reader_trusting_its_cache_is_caught() {
    let mut caught = 0;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(20);
    for _ in 0..50 {
        let scripts: Vec<Vec<Planned>> = (0..3)
            .map(|_| {
                (0..20)
                    .map(|_| match rng.gen_range(0..3) {
                        0 => Planned::Write(0),
                        _ => Planned::Read(0),
                    })
                    .collect()
            })
            .collect();
        let schedule: Vec<u8> = (0..200).map(|_| rng.gen_range(0..3)).collect();
        let (h, _) = run(scripts.clone(), &schedule, Reader::TrustsCache);
        if let Verdict::NotLinearizable(_) = check(&h, &Limits::default()).verdict {
            caught += 1;
        }
        // The same scripts and schedule with the correct reader pass.
        let (h, _) = run(scripts, &schedule, Reader::Correct);
        assert!(check(&h, &Limits::default()).is_linearizable());
    }
    assert!(caught >= 25, "only {caught} of 50 broken runs caught");
}

#[test]
fn reuse_really_happens_in_the_interleavings() {
    // Without reuse the walk's checks would be untested: show the runs above reclaim.
    let scripts = vec![vec![Planned::Write(0); 40], vec![Planned::Read(0); 40]];
    let schedule: Vec<u8> = (0..200)
        .map(|i| if i % 10 == 9 { 255 } else { (i % 2) as u8 })
        .collect();
    let (h, stats) = run(scripts, &schedule, Reader::Correct);
    assert!(stats.nodes_reclaimed >= 20, "{stats:?}");
    assert!(check(&h, &Limits::default()).is_linearizable());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    /// A middlebox that sends READs of old versions to the newest linked one (what the
    /// proxy's read cache does, marking the answer) keeps every history linearizable.
    #[test]
    fn reads_redirected_to_the_linked_tail_are_linearizable(
        scripts in prop::collection::vec(prop::collection::vec(planned(), 0..25), 1..5),
        schedule in schedule(),
    ) {
        let (h, _, _) = run_with(scripts, &schedule, Reader::Correct, Middlebox::RedirectsToLinked);
        let report = check(&h, &Limits::default());
        prop_assert!(report.is_linearizable(), "{:?}\n{:?}", report.verdict, h);
    }
}

/// The redirect rule can fail: a middlebox that sends READs to the newest version
/// written (a writer's node before its CAS) is caught, while the correct one passes the
/// same scripts and schedules, and redirects for real.
#[test]
fn reads_redirected_to_unlinked_versions_are_caught() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(21);
    let (mut caught, mut redirected) = (0, 0);
    for _ in 0..60 {
        let scripts: Vec<Vec<Planned>> = (0..4)
            .map(|_| {
                (0..20)
                    .map(|_| match rng.gen_range(0..2) {
                        0 => Planned::Write(0),
                        _ => Planned::Read(0),
                    })
                    .collect()
            })
            .collect();
        let schedule: Vec<u8> = (0..300).map(|_| rng.gen_range(0..4)).collect();
        let (h, _, _) = run_with(
            scripts.clone(),
            &schedule,
            Reader::Correct,
            Middlebox::RedirectsToWritten,
        );
        if !check(&h, &Limits::default()).is_linearizable() {
            caught += 1;
        }
        let (h, _, n) = run_with(
            scripts,
            &schedule,
            Reader::Correct,
            Middlebox::RedirectsToLinked,
        );
        redirected += n;
        assert!(check(&h, &Limits::default()).is_linearizable());
    }
    eprintln!("broken middlebox caught in {caught} of 60 runs; the correct one redirected {redirected} READs");
    assert!(
        redirected > 100,
        "the correct middlebox redirected only {redirected} READs"
    );
    assert!(caught >= 30, "only {caught} of 60 broken runs caught");
}

// ---- a collection pass does not hold the metadata service up ----

/// Memory whose reads from the thread named "gc" stop at a gate until it opens, saying
/// when one is waiting: a collection pass caught in the middle of its reads.
#[derive(Clone)]
struct GatedMemory {
    inner: SimMemory,
    gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    waiting: std::sync::mpsc::SyncSender<()>,
}

impl Memory for GatedMemory {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn read(&self, addr: NodeAddr, len: u32) -> Result<Bytes, camelot_clover::CloverError> {
        if std::thread::current().name() == Some("gc") {
            let (open, cv) = &*self.gate;
            let mut open = open.lock().unwrap();
            if !*open {
                let _ = self.waiting.try_send(());
            }
            while !*open {
                open = cv.wait(open).unwrap();
            }
        }
        self.inner.read(addr, len)
    }
    fn write(&self, addr: NodeAddr, data: Bytes) -> Result<(), camelot_clover::CloverError> {
        self.inner.write(addr, data)
    }
    fn cas(
        &self,
        addr: NodeAddr,
        expected: u64,
        new: u64,
    ) -> Result<u64, camelot_clover::CloverError> {
        self.inner.cas(addr, expected, new)
    }
    fn add_block(&self) -> Result<u32, camelot_clover::CloverError> {
        self.inner.add_block()
    }
    fn blocks(&self) -> u32 {
        self.inner.blocks()
    }
}

/// Runs `f` on a thread of its own; its result if it ends within `secs`.
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).ok()
}

#[test]
fn stores_are_served_while_a_collection_pass_reads() {
    let (waiting, waited) = std::sync::mpsc::sync_channel(1);
    let gate = Arc::new((std::sync::Mutex::new(true), std::sync::Condvar::new()));
    let mem = GatedMemory {
        inner: SimMemory::new(Geometry::new(8, 8).unwrap()),
        gate: gate.clone(),
        waiting,
    };
    let config = MetaConfig {
        blocks_max: 1,
        versions_kept: 1,
        ..MetaConfig::default()
    };
    let meta = Arc::new(Meta::new(mem.clone(), config).unwrap());
    let cfg = StoreConfig {
        grant_nodes: 1,
        ..StoreConfig::default()
    };
    let mut writer = Store::new(meta.clone(), mem.clone(), cfg);
    // One block of 8 nodes: 3 heads, then versions until the pool is empty (grants of
    // one node take it down one by one; the grant after that needs a pass).
    let mut i = 0u64;
    while meta.stats().free_nodes > 0 || i < 3 {
        i += 1;
        assert!(i < 1_000, "the pool never ran empty: {:?}", meta.stats());
        writer.put(&[(i % 3) as u8], enc(i).unwrap()).unwrap();
    }
    assert_eq!(meta.stats().blocks, 1);
    *gate.0.lock().unwrap() = false;
    let pass = {
        let meta = meta.clone();
        std::thread::Builder::new()
            .name("gc".into())
            .spawn(move || meta.gc())
            .unwrap()
    };
    waited
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the pass reaches its reads");
    // Mid-pass: lookups and reads go on.
    let mut reader = Store::new(meta.clone(), mem.clone(), StoreConfig::default());
    let got = within(10, move || dec(&reader.get(&[0]).unwrap()));
    let open_gate = || {
        let (open, cv) = &*gate;
        *open.lock().unwrap() = true;
        cv.notify_all();
    };
    if got.is_none() {
        // Open it first: the stores dropped by the panic give their nodes back.
        open_gate();
        panic!("a read waited for the collection pass");
    }
    // The pool is empty, so a write needs what the pass frees: it waits for the pass
    // (a second pass beside it would append the same versions twice) and then
    // succeeds rather than calling the store full.
    let write = {
        let i = i + 1;
        std::thread::spawn(move || writer.put(&[0], enc(i).unwrap()))
    };
    open_gate();
    pass.join().unwrap().expect("the pass");
    let written = within(10, move || write.join().unwrap());
    assert!(
        matches!(written, Some(Ok(()))),
        "the write after the pass: {written:?}"
    );
    let mut reader = Store::new(meta.clone(), mem, StoreConfig::default());
    assert_eq!(dec(&reader.get(&[0]).unwrap()), i + 1);
    assert!(meta.stats().gc_passes >= 1);
}

/// Only nodes out with a writer may be given back: a node given back twice would be
/// granted to two writers, and a linked one freed would be overwritten under its
/// readers. Before, GIVE_BACK freed whatever it was told.
#[test]
fn give_back_frees_only_nodes_out_with_a_writer() {
    let (mem, meta) = sim(1, 2);
    let granted = meta.grant(2).unwrap();
    let free_after_grant = meta.stats().free_nodes;
    meta.give_back(vec![granted[0]]);
    assert_eq!(meta.stats().free_nodes, free_after_grant + 1);
    // Twice, and a node nobody was granted: neither is freed.
    meta.give_back(vec![granted[0]]);
    let never = camelot_clover::NodeAddr { block: 0, slot: 7 };
    assert!(!granted.contains(&never));
    meta.give_back(vec![never]);
    let stats = meta.stats();
    assert_eq!(stats.free_nodes, free_after_grant + 1, "{stats:?}");
    assert_eq!(stats.give_backs_refused, 2, "{stats:?}");
    // A node a writer linked (the pass saw it) can no longer be given back.
    let mut s = Store::new(
        meta.clone(),
        mem,
        StoreConfig {
            grant_nodes: 1,
            ..StoreConfig::default()
        },
    );
    s.put(b"k", enc(5).unwrap()).unwrap();
    meta.gc().unwrap();
    let linked = {
        let head = meta.key(b"k").unwrap().1;
        let bytes = meta
            .memory()
            .read(
                head.addr,
                camelot_clover::layout::RELINK_HEADER_BYTES as u32,
            )
            .unwrap();
        match camelot_clover::layout::Next::decode(
            camelot_clover::layout::node_header_fields(&bytes).0,
        ) {
            camelot_clover::layout::Next::Node(a) => a,
            other => panic!("the put's version is not linked: {other:?}"),
        }
    };
    let before = meta.stats();
    meta.give_back(vec![linked]);
    let after = meta.stats();
    assert_eq!(
        after.free_nodes, before.free_nodes,
        "a linked node was freed"
    );
    assert_eq!(after.give_backs_refused, before.give_backs_refused + 1);
    assert_eq!(dec(&s.get(b"k").unwrap()), 5);
}
