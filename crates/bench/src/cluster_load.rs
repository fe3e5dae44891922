//! The load the cluster benches drive: YCSB-B (95 % reads, 5 % updates; YCSB's scrambled
//! zipfian over the records) through the client's key-value API, one client per thread
//! as YCSB gives each thread its own DB binding. Every operation is timed, attributed to
//! the class of the node the client routed it to and to the second it finished in, and
//! every read is checked: a missing record or a value not written for its key is a bad
//! read, counted apart from the client's errors.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use camelot_client::{Client, NodeId};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::latency::LatencyRecorder;
use crate::ycsb::generators::{key_name, Distribution, KeyChooser};
use crate::BenchError;

/// Most one-second buckets a run keeps (an hour); later operations go to the last one.
pub const BUCKETS_MAX: usize = 3600;
/// Most node classes a run tells apart.
pub const CLASSES_MAX: usize = 16;
/// Most records a run loads.
pub const RECORDS_MAX: u64 = 10_000_000;
/// Most bytes per value.
pub const VALUE_BYTES_MAX: usize = 1 << 20;
/// Records per PUT batch while loading.
const LOAD_BATCH: usize = 512;
/// Problem descriptions kept per thread (the counts are always exact).
const PROBLEMS_KEPT: usize = 4;
/// YCSB-B's read share.
pub const YCSB_B_READ_FRACTION: f64 = 0.95;

/// What one run of the load does.
#[derive(Debug, Clone)]
pub struct KvLoad {
    pub records: u64,
    pub value_bytes: usize,
    pub threads: usize,
    /// Share of operations that are reads; the rest are updates.
    pub read_fraction: f64,
    /// Operations per second over every thread (each thread paced at its share, latency
    /// counted from when the operation was due, so a stall is not hidden), or `None`: as
    /// fast as the threads go, one request in flight each (YCSB without `-target`).
    pub target_ops_per_sec: Option<f64>,
    /// Seeds the threads' key and operation choices (thread `t` uses `seed + t`).
    pub seed: u64,
}

impl KvLoad {
    pub fn validate(&self, threads_max: usize) -> Result<(), BenchError> {
        crate::checks::check_threads(&[self.threads], threads_max)?;
        if self.records == 0 || self.records > RECORDS_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "records must be 1 to {RECORDS_MAX}"
            )));
        }
        if self.value_bytes < MIN_VALUE_BYTES || self.value_bytes > VALUE_BYTES_MAX {
            return Err(BenchError::InvalidConfig(format!(
                "values must be {MIN_VALUE_BYTES} to {VALUE_BYTES_MAX} bytes"
            )));
        }
        if !(0.0..=1.0).contains(&self.read_fraction) {
            return Err(BenchError::InvalidConfig(
                "the read fraction must be 0 to 1".into(),
            ));
        }
        if let Some(rate) = self.target_ops_per_sec {
            crate::checks::check_seconds("the target rate", rate)?;
        }
        Ok(())
    }
}

/// A value must hold its key's longest name and the separator.
pub const MIN_VALUE_BYTES: usize = 32;

/// The value written for `key` in `round` (0 when loading): the key, `#`, the round, then
/// filler to `value_bytes`. A read is right when it starts with the key and `#` and has
/// the full size.
pub fn value_for(key: &str, round: u64, value_bytes: usize) -> Bytes {
    let mut v = format!("{key}#{round}#").into_bytes();
    v.resize(value_bytes.max(v.len()), b'.');
    v.truncate(value_bytes);
    Bytes::from(v)
}

/// Whether `value` is one that was written for `key`.
pub fn is_value_of(key: &str, value: &[u8], value_bytes: usize) -> bool {
    value.len() == value_bytes
        && value.len() > key.len()
        && value.starts_with(key.as_bytes())
        && value[key.len()] == b'#'
}

/// Writes every record (`user…` keys, as YCSB names them) in batches.
pub fn load_records(client: &Client, load: &KvLoad) -> Result<(), BenchError> {
    let keys: Vec<String> = (0..load.records).map(key_name).collect();
    for chunk in keys.chunks(LOAD_BATCH) {
        let pairs: Vec<(&String, Bytes)> = chunk
            .iter()
            .map(|k| (k, value_for(k, 0, load.value_bytes)))
            .collect();
        client
            .put_many(&pairs)
            .map_err(|e| BenchError::Setup(format!("loading the records: {e}")))?;
    }
    Ok(())
}

/// One second of a run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Bucket {
    /// Operations that finished in this second (whatever their outcome).
    pub ops: u64,
    pub failed: u64,
    pub bad_reads: u64,
    pub latency_ns_max: u64,
    /// The longest single GET and PUT call, from when it was made (not when it was due:
    /// a thread held up earlier makes its next calls late, not slow).
    pub read_call_ns_max: u64,
    pub write_call_ns_max: u64,
}

/// What the threads measured, merged.
#[derive(Debug, Clone)]
pub struct Tally {
    /// Latency of the operations routed to each node class.
    pub per_class: Vec<LatencyRecorder>,
    pub buckets: Vec<Bucket>,
    pub reads: u64,
    pub updates: u64,
    /// Calls the client answered with an error.
    pub failed: u64,
    /// Reads of a missing record or of a value not written for the key.
    pub bad_reads: u64,
    /// A few of the failures, described.
    pub problems: Vec<String>,
    /// From the first operation due to the last one finished.
    pub seconds: f64,
}

impl Tally {
    fn new(classes: usize) -> Tally {
        Tally {
            per_class: (0..classes).map(|_| LatencyRecorder::new()).collect(),
            buckets: Vec::new(),
            reads: 0,
            updates: 0,
            failed: 0,
            bad_reads: 0,
            problems: Vec::new(),
            seconds: 0.0,
        }
    }

    pub fn ops(&self) -> u64 {
        self.reads + self.updates
    }

    fn bucket(&mut self, at: Duration) -> &mut Bucket {
        let i = (at.as_secs() as usize).min(BUCKETS_MAX - 1);
        if self.buckets.len() <= i {
            self.buckets.resize(i + 1, Bucket::default());
        }
        &mut self.buckets[i]
    }

    fn problem(&mut self, what: String) {
        if self.problems.len() < PROBLEMS_KEPT {
            self.problems.push(what);
        }
    }

    fn merge(&mut self, other: &Tally) {
        for (mine, theirs) in self.per_class.iter_mut().zip(&other.per_class) {
            mine.merge(theirs);
        }
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), Bucket::default());
        }
        for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
            mine.ops += theirs.ops;
            mine.failed += theirs.failed;
            mine.bad_reads += theirs.bad_reads;
            mine.latency_ns_max = mine.latency_ns_max.max(theirs.latency_ns_max);
            mine.read_call_ns_max = mine.read_call_ns_max.max(theirs.read_call_ns_max);
            mine.write_call_ns_max = mine.write_call_ns_max.max(theirs.write_call_ns_max);
        }
        self.reads += other.reads;
        self.updates += other.updates;
        self.failed += other.failed;
        self.bad_reads += other.bad_reads;
        for p in &other.problems {
            if self.problems.len() < PROBLEMS_KEPT * 2 {
                self.problems.push(p.clone());
            }
        }
        self.seconds = self.seconds.max(other.seconds);
    }
}

/// When a run ends: after a duration, or when a flag is raised (by whoever changes the
/// cluster beneath it).
pub enum Until<'a> {
    Elapsed(Duration),
    Flag(&'a AtomicBool),
}

/// Runs `load` over `clients` (one per thread; there must be `load.threads`), buckets
/// counted from `t0`. `class_of` names the class of the node a key is routed to (below
/// `classes`).
pub fn run(
    clients: &[Client],
    load: &KvLoad,
    classes: usize,
    class_of: &(dyn Fn(NodeId) -> usize + Sync),
    t0: Instant,
    until: Until<'_>,
) -> Result<Tally, BenchError> {
    if clients.len() != load.threads {
        return Err(BenchError::InvalidConfig(format!(
            "{} clients for {} threads",
            clients.len(),
            load.threads
        )));
    }
    if classes == 0 || classes > CLASSES_MAX {
        return Err(BenchError::InvalidConfig(format!(
            "classes must be 1 to {CLASSES_MAX}"
        )));
    }
    let start = Instant::now();
    let deadline = match until {
        Until::Elapsed(d) => Some(start + d),
        Until::Flag(_) => None,
    };
    let stop_flag = match until {
        Until::Flag(f) => Some(f),
        Until::Elapsed(_) => None,
    };
    let done = |now: Instant| {
        deadline.is_some_and(|d| now >= d) || stop_flag.is_some_and(|f| f.load(Ordering::Relaxed))
    };
    // Each thread's interval between operations when paced.
    let interval = load
        .target_ops_per_sec
        .map(|rate| Duration::from_secs_f64(load.threads as f64 / rate));
    let tallies = std::thread::scope(|s| {
        let workers: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(t, client)| {
                let done = &done;
                s.spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(load.seed.wrapping_add(t as u64));
                    let mut keys = KeyChooser::new(Distribution::Zipfian, load.records, 0);
                    let mut tally = Tally::new(classes);
                    let mut round = 0u64;
                    // Threads start spread over one interval, not all at once.
                    let mut due =
                        interval.map(|i| start + i.mul_f64(t as f64 / load.threads as f64));
                    loop {
                        let now = Instant::now();
                        if done(now) {
                            break;
                        }
                        let began = match due {
                            Some(d) => {
                                if d > now {
                                    std::thread::sleep(d - now);
                                }
                                d
                            }
                            None => now,
                        };
                        let key = key_name(keys.next(&mut rng, load.records - 1));
                        let read = rng.gen::<f64>() < load.read_fraction;
                        let class = client
                            .node_for_key(key.as_bytes())
                            .map(|n| class_of(n).min(classes - 1))
                            .unwrap_or(0);
                        let called = Instant::now();
                        let (failed, bad) = if read {
                            tally.reads += 1;
                            match client.get(key.as_bytes()) {
                                Ok(Some(v)) if is_value_of(&key, &v.value, load.value_bytes) => {
                                    (false, false)
                                }
                                Ok(other) => {
                                    tally.problem(format!(
                                        "GET {key}: {}",
                                        other.map_or("missing".to_string(), |v| format!(
                                            "a {}-byte value not written for it",
                                            v.value.len()
                                        ))
                                    ));
                                    (false, true)
                                }
                                Err(e) => {
                                    tally.problem(format!("GET {key}: {e}"));
                                    (true, false)
                                }
                            }
                        } else {
                            tally.updates += 1;
                            round += 1;
                            let value = value_for(&key, round, load.value_bytes);
                            match client.put(key.as_bytes(), value) {
                                Ok(_) => (false, false),
                                Err(e) => {
                                    tally.problem(format!("PUT {key}: {e}"));
                                    (true, false)
                                }
                            }
                        };
                        let finished = Instant::now();
                        let latency = finished.saturating_duration_since(began);
                        tally.per_class[class].record(latency);
                        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
                        let b = tally.bucket(finished.saturating_duration_since(t0));
                        b.ops += 1;
                        b.failed += u64::from(failed);
                        b.bad_reads += u64::from(bad);
                        b.latency_ns_max = b.latency_ns_max.max(ns);
                        let call_ns =
                            u64::try_from(finished.saturating_duration_since(called).as_nanos())
                                .unwrap_or(u64::MAX);
                        let call_max = if read {
                            &mut b.read_call_ns_max
                        } else {
                            &mut b.write_call_ns_max
                        };
                        *call_max = (*call_max).max(call_ns);
                        tally.failed += u64::from(failed);
                        tally.bad_reads += u64::from(bad);
                        if let (Some(d), Some(i)) = (due.as_mut(), interval) {
                            *d += i;
                        }
                    }
                    tally.seconds = start.elapsed().as_secs_f64();
                    tally
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .map_err(|_| BenchError::Setup("a load thread panicked".into()))
            })
            .collect::<Result<Vec<Tally>, BenchError>>()
    })?;
    let mut all = Tally::new(classes);
    for t in &tallies {
        all.merge(t);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_client::{ClientConfig, ClusterMap};
    use camelot_server::dev::{DevCluster, DevClusterConfig};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn values_are_recognised_for_their_key_only(
            k in 0u64..1_000_000, other in 0u64..1_000_000, round in 0u64..u64::MAX,
            bytes in MIN_VALUE_BYTES..4096,
        ) {
            let key = key_name(k);
            let v = value_for(&key, round, bytes);
            prop_assert_eq!(v.len(), bytes);
            prop_assert!(is_value_of(&key, &v, bytes));
            prop_assert!(!is_value_of(&key, &v[..bytes - 1], bytes));
            let other_key = key_name(other);
            if other_key != key && !key.starts_with(&format!("{other_key}#")) {
                prop_assert!(!is_value_of(&other_key, &v, bytes));
            }
        }
    }

    #[test]
    fn bad_loads_are_refused() {
        let ok = KvLoad {
            records: 100,
            value_bytes: 1024,
            threads: 2,
            read_fraction: YCSB_B_READ_FRACTION,
            target_ops_per_sec: None,
            seed: 1,
        };
        assert!(ok.validate(8).is_ok());
        for bad in [
            KvLoad {
                records: 0,
                ..ok.clone()
            },
            KvLoad {
                value_bytes: 8,
                ..ok.clone()
            },
            KvLoad {
                threads: 9,
                ..ok.clone()
            },
            KvLoad {
                read_fraction: 1.5,
                ..ok.clone()
            },
            KvLoad {
                target_ops_per_sec: Some(0.0),
                ..ok.clone()
            },
        ] {
            assert!(bad.validate(8).is_err(), "{bad:?}");
        }
    }

    /// Against real servers (in process): every operation is counted once, in a bucket
    /// and in its node's class, a paced run keeps its rate, and a record deleted behind
    /// the load's back is a bad read, not a success.
    #[test]
    fn the_load_counts_every_operation_and_catches_a_missing_record() {
        let cluster = DevCluster::start(DevClusterConfig {
            nodes: 2,
            memory_bytes_per_node: 64 << 20,
            ..DevClusterConfig::default()
        })
        .unwrap();
        let connect = || {
            Client::connect(
                ClusterMap::from_addrs(cluster.addrs()),
                ClientConfig::default(),
            )
            .unwrap()
        };
        let load = KvLoad {
            records: 200,
            value_bytes: 100,
            threads: 2,
            read_fraction: YCSB_B_READ_FRACTION,
            target_ops_per_sec: Some(400.0),
            seed: 7,
        };
        let loader = connect();
        load_records(&loader, &load).unwrap();
        let clients = vec![connect(), connect()];
        let t0 = Instant::now();
        let tally = run(
            &clients,
            &load,
            2,
            &|n| n as usize,
            t0,
            Until::Elapsed(Duration::from_millis(1500)),
        )
        .unwrap();
        let per_class: u64 = tally.per_class.iter().map(|r| r.count()).sum();
        let bucketed: u64 = tally.buckets.iter().map(|b| b.ops).sum();
        assert_eq!(per_class, tally.ops());
        assert_eq!(bucketed, tally.ops());
        assert!(
            tally.per_class.iter().all(|r| r.count() > 0),
            "both nodes served"
        );
        assert_eq!(
            (tally.failed, tally.bad_reads),
            (0, 0),
            "{:?}",
            tally.problems
        );
        let rate = tally.ops() as f64 / tally.seconds;
        assert!(
            (250.0..=480.0).contains(&rate),
            "paced at 400/s, ran at {rate}"
        );

        // Delete the hottest records: zipfian reads find them missing.
        for k in 0..20 {
            loader.delete(key_name(k).as_bytes()).unwrap();
        }
        let closed = KvLoad {
            target_ops_per_sec: None,
            read_fraction: 1.0,
            ..load
        };
        let tally = run(
            &clients,
            &closed,
            2,
            &|n| n as usize,
            Instant::now(),
            Until::Elapsed(Duration::from_millis(300)),
        )
        .unwrap();
        assert!(tally.bad_reads > 0, "deleted records read as present");
        assert!(tally.problems.iter().any(|p| p.contains("missing")));
        drop(clients);
        drop(loader);
        cluster.shutdown().unwrap();
    }
}
