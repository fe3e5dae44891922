//! One conformance suite, two faces: the native key-value client and the Redis-protocol
//! port (driven by the `redis` crate through Camelot's CAMELOT.* versioned commands).
//! Both run against a real 3-node dev cluster on loopback.

use bytes::Bytes;
use camelot_client::kv::merge_in_key_order;
use camelot_client::proto::limits::{KEY_BYTES_MAX, VALUE_BYTES_MAX};
use camelot_client::proto::Item;
use camelot_client::{partition_of, CasOutcome, Client, ClientConfig, ClusterMap};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use std::time::Duration;

type Versioned = (u64, Vec<u8>);

/// What the suite needs of a face. Errors are strings: the suite only checks that the
/// right calls fail.
trait Face: Sync {
    fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, String>;
    fn get(&self, key: &[u8]) -> Result<Option<Versioned>, String>;
    /// `None` on a version conflict.
    fn cas(&self, key: &[u8], expected: u64, value: &[u8]) -> Result<Option<u64>, String>;
    fn delete(&self, key: &[u8]) -> Result<Option<u64>, String>;
    fn scan(&self, start: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, u64)>, String>;
}

struct Native(Client);

impl Face for Native {
    fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, String> {
        self.0
            .put(key, Bytes::copy_from_slice(value))
            .map_err(|e| e.to_string())
    }
    fn get(&self, key: &[u8]) -> Result<Option<Versioned>, String> {
        self.0
            .get(key)
            .map(|o| o.map(|v| (v.version, v.value.to_vec())))
            .map_err(|e| e.to_string())
    }
    fn cas(&self, key: &[u8], expected: u64, value: &[u8]) -> Result<Option<u64>, String> {
        match self.0.cas_put(key, expected, Bytes::copy_from_slice(value)) {
            Ok(CasOutcome::Stored(v)) => Ok(Some(v)),
            Ok(CasOutcome::Conflict) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }
    fn delete(&self, key: &[u8]) -> Result<Option<u64>, String> {
        self.0.delete(key).map_err(|e| e.to_string())
    }
    fn scan(&self, start: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, u64)>, String> {
        self.0
            .scan(start, limit)
            .map(|items| {
                items
                    .into_iter()
                    .map(|i| (i.key.to_vec(), i.version))
                    .collect()
            })
            .map_err(|e| e.to_string())
    }
}

/// The RESP face routes keys exactly as the native client does (same partitions, same
/// map), one connection per node's RESP port.
struct Resp {
    map: ClusterMap,
    conns: Vec<parking_lot::Mutex<redis::Connection>>,
}

impl Resp {
    fn conn(&self, key: &[u8]) -> parking_lot::MutexGuard<'_, redis::Connection> {
        let node = self.map.node_for_partition(partition_of(key)).unwrap();
        self.conns[node as usize].lock()
    }
}

fn redis_err(e: redis::RedisError) -> String {
    e.to_string()
}

impl Face for Resp {
    fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, String> {
        redis::cmd("CAMELOT.PUT")
            .arg(key)
            .arg(value)
            .query(&mut *self.conn(key))
            .map_err(redis_err)
    }
    fn get(&self, key: &[u8]) -> Result<Option<Versioned>, String> {
        redis::cmd("CAMELOT.GET")
            .arg(key)
            .query(&mut *self.conn(key))
            .map_err(redis_err)
    }
    fn cas(&self, key: &[u8], expected: u64, value: &[u8]) -> Result<Option<u64>, String> {
        redis::cmd("CAMELOT.CAS")
            .arg(key)
            .arg(expected)
            .arg(value)
            .query(&mut *self.conn(key))
            .map_err(redis_err)
    }
    fn delete(&self, key: &[u8]) -> Result<Option<u64>, String> {
        redis::cmd("CAMELOT.DEL")
            .arg(key)
            .query(&mut *self.conn(key))
            .map_err(redis_err)
    }
    fn scan(&self, start: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, u64)>, String> {
        let mut runs = Vec::new();
        for c in &self.conns {
            let flat: Vec<redis::Value> = redis::cmd("CAMELOT.SCAN")
                .arg(start)
                .arg(limit)
                .query(&mut *c.lock())
                .map_err(redis_err)?;
            let mut run = Vec::new();
            for triple in flat.chunks_exact(3) {
                let key: Vec<u8> = redis::from_redis_value(&triple[0]).map_err(redis_err)?;
                let version: u64 = redis::from_redis_value(&triple[1]).map_err(redis_err)?;
                run.push(Item {
                    key: Bytes::from(key),
                    version,
                    value: Bytes::new(),
                });
            }
            runs.push(run);
        }
        Ok(merge_in_key_order(runs, limit)
            .into_iter()
            .map(|i| (i.key.to_vec(), i.version))
            .collect())
    }
}

struct Setup {
    cluster: DevCluster,
}

impl Setup {
    fn new(memory_bytes_per_node: u64) -> Setup {
        let cluster = DevCluster::start(DevClusterConfig {
            nodes: 3,
            memory_bytes_per_node,
            worker_threads: 2,
            resp: true,
            ..DevClusterConfig::default()
        })
        .expect("dev cluster starts");
        Setup { cluster }
    }

    fn faces(&self) -> Vec<(&'static str, Box<dyn Face>)> {
        let map = ClusterMap::from_addrs(self.cluster.addrs());
        let config = ClientConfig {
            request_timeout: Duration::from_secs(20),
            ..ClientConfig::default()
        };
        let native = Native(Client::connect(map.clone(), config).expect("client connects"));
        let conns = self
            .cluster
            .resp_addrs()
            .into_iter()
            .map(|a| {
                let c = redis::Client::open(format!("redis://{a}/")).unwrap();
                parking_lot::Mutex::new(
                    c.get_connection_with_timeout(Duration::from_secs(5))
                        .expect("RESP connection"),
                )
            })
            .collect();
        vec![
            ("native", Box::new(native)),
            ("resp", Box::new(Resp { map, conns })),
        ]
    }
}

/// Runs `check` on each face against its own fresh cluster.
fn each_face(memory_bytes_per_node: u64, check: impl Fn(&str, &dyn Face, &DevCluster)) {
    for which in 0..2 {
        let setup = Setup::new(memory_bytes_per_node);
        let faces = setup.faces();
        let (name, face) = &faces[which];
        check(name, face.as_ref(), &setup.cluster);
        drop(faces);
        setup.cluster.shutdown().expect("clean shutdown");
    }
}

#[test]
fn versions_advance_and_deletes_report_them() {
    each_face(64 << 20, |name, f, _| {
        assert_eq!(f.get(b"k").unwrap(), None, "{name}");
        let v1 = f.put(b"k", b"one").unwrap();
        let v2 = f.put(b"k", b"two").unwrap();
        assert!(v2 > v1, "{name}");
        assert_eq!(f.get(b"k").unwrap(), Some((v2, b"two".to_vec())), "{name}");
        assert_eq!(f.delete(b"k").unwrap(), Some(v2), "{name}");
        assert_eq!(f.delete(b"k").unwrap(), None, "{name}");
        assert_eq!(f.get(b"k").unwrap(), None, "{name}");
    });
}

#[test]
fn cas_conflicts_change_nothing_and_contended_cas_loses_no_update() {
    each_face(64 << 20, |name, f, _| {
        let v1 = f
            .cas(b"c", 0, b"first")
            .unwrap()
            .expect("absent key: stored");
        assert_eq!(f.cas(b"c", 0, b"again").unwrap(), None, "{name}");
        assert_eq!(f.cas(b"c", v1 + 1000, b"wrong").unwrap(), None, "{name}");
        assert_eq!(
            f.get(b"c").unwrap(),
            Some((v1, b"first".to_vec())),
            "{name}"
        );
        let v2 = f
            .cas(b"c", v1, b"second")
            .unwrap()
            .expect("matching version");
        assert!(v2 > v1);

        f.put(b"counter", b"0").unwrap();
        let (threads, per_thread) = (4u64, 100u64);
        let conflicts = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    for _ in 0..per_thread {
                        loop {
                            let (v, bytes) = f.get(b"counter").unwrap().unwrap();
                            let n: u64 = std::str::from_utf8(&bytes).unwrap().parse().unwrap();
                            if f.cas(b"counter", v, (n + 1).to_string().as_bytes())
                                .unwrap()
                                .is_some()
                            {
                                break;
                            }
                            conflicts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let (_, bytes) = f.get(b"counter").unwrap().unwrap();
        assert_eq!(
            bytes,
            (threads * per_thread).to_string().as_bytes(),
            "{name}"
        );
        eprintln!("{name}: {} CAS conflicts retried", conflicts.into_inner());
    });
}

#[test]
fn scans_merge_every_node_in_key_order() {
    each_face(64 << 20, |name, f, cluster| {
        for i in (0..300).rev() {
            f.put(format!("key{i:04}").as_bytes(), b"v").unwrap();
        }
        // The keys really are spread: every node holds a fair share.
        for stats in cluster.stats() {
            let objects = stats.iter().find(|(n, _)| n == "objects").unwrap().1;
            assert!(
                (60..=140).contains(&objects),
                "{name}: uneven spread {objects}"
            );
        }
        let got: Vec<Vec<u8>> = f
            .scan(b"key0100", 50)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let expected: Vec<Vec<u8>> = (100..150)
            .map(|i| format!("key{i:04}").into_bytes())
            .collect();
        assert_eq!(got, expected, "{name}");
        let tail = f.scan(b"key0290", 100).unwrap();
        assert_eq!(tail.len(), 10, "{name}");
        assert!(f.scan(b"kez", 10).unwrap().is_empty(), "{name}");
    });
}

#[test]
fn large_values_round_trip() {
    each_face(256 << 20, |name, f, _| {
        let big: Vec<u8> = (0..16 << 20).map(|i: u32| (i % 251) as u8).collect();
        let v = f.put(b"big", &big).unwrap();
        assert_eq!(f.get(b"big").unwrap(), Some((v, big.clone())), "{name}");
        let mb: Vec<u8> = vec![0xa5; 1 << 20];
        for i in 0..8 {
            f.put(format!("mb{i}").as_bytes(), &mb).unwrap();
        }
        for i in 0..8 {
            assert_eq!(
                f.get(format!("mb{i}").as_bytes()).unwrap().unwrap().1,
                mb,
                "{name}"
            );
        }
    });
}

#[test]
fn limits_and_a_full_server_are_errors_that_keep_data() {
    each_face(8 << 20, |name, f, _| {
        assert!(
            f.put(&vec![b'k'; KEY_BYTES_MAX + 1], b"v").is_err(),
            "{name}"
        );
        assert!(f.put(b"fine", b"v").is_ok(), "{name}");
        // Fill the cluster with 1 MiB values until every node refuses.
        let value = vec![7u8; 1 << 20];
        let mut stored = Vec::new();
        let mut refused = 0;
        for i in 0..64 {
            let key = format!("fill{i}");
            match f.put(key.as_bytes(), &value) {
                Ok(v) => stored.push((key, v)),
                Err(e) => {
                    assert!(
                        e.contains("OUT_OF_MEMORY") || e.contains("OOM"),
                        "{name}: {e}"
                    );
                    refused += 1;
                }
            }
        }
        assert!(
            refused > 0 && stored.len() >= 12,
            "{name}: {} stored",
            stored.len()
        );
        for (k, v) in &stored {
            assert_eq!(
                f.get(k.as_bytes()).unwrap().map(|x| x.0),
                Some(*v),
                "{name}"
            );
        }
        assert_eq!(f.get(b"fine").unwrap().map(|x| x.1), Some(b"v".to_vec()));
    });
    // Past the value limit: refused before it is sent (native), or the port says why
    // and closes (RESP).
    let setup = Setup::new(64 << 20);
    for (name, f) in setup.faces() {
        let too_big = vec![0u8; VALUE_BYTES_MAX + 1];
        assert!(f.put(b"huge", &too_big).is_err(), "{name}");
    }
}
