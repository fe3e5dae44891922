//! Real servers for the RVM tests: Camelot dev clusters in process and redis-server as a
//! child process, all on loopback ports picked at run time.
#![allow(dead_code)]

use camelot_rvm::{BackendConfig, Config};
use camelot_server::dev::{DevCluster, DevClusterConfig};
use camelot_testkit::RedisServer;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
pub const NODE_MEMORY_BYTES: u64 = 128 << 20;
/// Small enough that several instances share a dev node, large enough for every test.
pub const POOL_LOG_BYTES: u64 = 8 << 20;

pub fn dev_node() -> DevCluster {
    DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: NODE_MEMORY_BYTES,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster starts")
}

/// A real redis-server on a free loopback port: the benchmarks' own peer launcher, which
/// retries a port another process took and kills and reaps the server on drop.
pub struct Redis {
    _server: RedisServer,
    pub addr: SocketAddr,
}

impl Redis {
    pub fn start() -> Redis {
        let server =
            RedisServer::start().expect("redis-server starts (scripts/setup.sh installs it)");
        Redis {
            addr: server.addr(),
            _server: server,
        }
    }
}

pub fn scratch(tag: &str) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "camelot-rvm-{tag}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}

/// One backend of the shared suite, with whatever servers it needs kept alive.
pub enum Fixture {
    Pool(DevCluster),
    Mirrored(DevCluster, DevCluster),
    Redis(Redis),
    File(PathBuf),
}

impl Fixture {
    pub fn start(kind: &str) -> Fixture {
        match kind {
            "pool" => Fixture::Pool(dev_node()),
            "pool-mirrored" => Fixture::Mirrored(dev_node(), dev_node()),
            "redis" => Fixture::Redis(Redis::start()),
            "file" => Fixture::File(scratch("file")),
            other => panic!("unknown backend {other}"),
        }
    }

    pub fn backend(&self) -> BackendConfig {
        match self {
            Fixture::Pool(c) => BackendConfig::Pool {
                servers: c.addrs().to_vec(),
                token: None,
                log_bytes: POOL_LOG_BYTES,
            },
            Fixture::Mirrored(a, b) => BackendConfig::Pool {
                servers: vec![a.addrs()[0], b.addrs()[0]],
                token: None,
                log_bytes: POOL_LOG_BYTES,
            },
            Fixture::Redis(r) => BackendConfig::Redis { addr: r.addr },
            Fixture::File(dir) => BackendConfig::File { dir: dir.clone() },
        }
    }

    pub fn config(&self, name: &str, recover: bool) -> Config {
        Config::new(self.backend(), name).recover(recover)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Fixture::File(dir) = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
