//! A dev cluster: N memory servers on loopback inside this process, on a runtime of their
//! own, so blocking callers (the CLI, benchmarks, tests) need not run one.

use crate::{Quota, ServerConfig, ServerError, ServerHandle};
use std::net::{Ipv4Addr, SocketAddr};

/// Most nodes a dev cluster will start; each holds a listener and its own arena.
pub const DEV_NODES_MAX: usize = 64;

#[derive(Debug, Clone)]
pub struct DevClusterConfig {
    pub nodes: usize,
    pub memory_bytes_per_node: u64,
    pub token: Option<Vec<u8>>,
    /// Node i listens on `base_port + i`; `None` lets the OS pick free ports.
    pub base_port: Option<u16>,
    /// Worker threads of the cluster's runtime; 0 means one per core.
    pub worker_threads: usize,
    /// Also serve the Redis protocol on each node (on a port the OS picks).
    pub resp: bool,
    /// What each principal may hold in regions on each node.
    pub quota: Quota,
}

impl Default for DevClusterConfig {
    fn default() -> Self {
        DevClusterConfig {
            nodes: 3,
            memory_bytes_per_node: 256 << 20,
            token: None,
            base_port: None,
            worker_threads: 0,
            resp: false,
            quota: Quota::UNLIMITED,
        }
    }
}

pub struct DevCluster {
    runtime: tokio::runtime::Runtime,
    servers: Vec<ServerHandle>,
    addrs: Vec<SocketAddr>,
}

impl DevCluster {
    pub fn start(config: DevClusterConfig) -> Result<DevCluster, ServerError> {
        if config.nodes == 0 || config.nodes > DEV_NODES_MAX {
            return Err(ServerError::Config(format!(
                "a dev cluster has 1 to {DEV_NODES_MAX} nodes, not {}",
                config.nodes
            )));
        }
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.enable_all().thread_name("camelot-dev");
        if config.worker_threads > 0 {
            builder.worker_threads(config.worker_threads);
        }
        let runtime = builder.build().map_err(ServerError::Runtime)?;
        let servers = runtime.block_on(async {
            let mut servers = Vec::with_capacity(config.nodes);
            for i in 0..config.nodes {
                let port = match config.base_port {
                    Some(base) => base.checked_add(i as u16).ok_or_else(|| {
                        ServerError::Config(format!(
                            "base port {base} + {} nodes passes 65535",
                            config.nodes
                        ))
                    })?,
                    None => 0,
                };
                let mut cfg = ServerConfig::new(
                    SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                    config.memory_bytes_per_node,
                );
                cfg.token = config.token.clone();
                cfg.quota = config.quota;
                if config.resp {
                    cfg.resp_listen = Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
                }
                servers.push(ServerHandle::start(cfg).await?);
            }
            Ok::<_, ServerError>(servers)
        })?;
        let addrs = servers.iter().map(ServerHandle::local_addr).collect();
        Ok(DevCluster {
            runtime,
            servers,
            addrs,
        })
    }

    /// Each node's Redis-protocol address (empty unless `resp` was asked for).
    pub fn resp_addrs(&self) -> Vec<SocketAddr> {
        self.servers
            .iter()
            .filter_map(ServerHandle::resp_addr)
            .collect()
    }

    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The runtime the servers run on, for callers that want to wait on it (signals).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }

    pub fn servers(&self) -> &[ServerHandle] {
        &self.servers
    }

    /// Counters of every node, in node order.
    pub fn stats(&self) -> Vec<Vec<(String, u64)>> {
        self.servers.iter().map(ServerHandle::stats).collect()
    }

    /// Shuts every node down (each answers what it has received), then the runtime.
    /// Returns the first error; every node is still asked to stop.
    pub fn shutdown(self) -> Result<(), ServerError> {
        let DevCluster {
            runtime, servers, ..
        } = self;
        let result = runtime.block_on(async {
            let mut first = Ok(());
            for s in servers {
                if let Err(e) = s.shutdown().await {
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
            first
        });
        runtime.shutdown_background();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;

    #[test]
    fn starts_distinct_listeners_and_stops() {
        let cluster = DevCluster::start(DevClusterConfig {
            nodes: 3,
            memory_bytes_per_node: 1 << 20,
            worker_threads: 1,
            ..DevClusterConfig::default()
        })
        .expect("start");
        let addrs = cluster.addrs().to_vec();
        assert_eq!(addrs.len(), 3);
        let mut ports: Vec<u16> = addrs.iter().map(SocketAddr::port).collect();
        ports.dedup();
        assert_eq!(ports.len(), 3);
        for a in &addrs {
            TcpStream::connect(a).expect("node accepts");
        }
        cluster.shutdown().expect("shutdown");
        for a in &addrs {
            assert!(TcpStream::connect(a).is_err(), "{a} still accepts");
        }
    }

    #[test]
    fn refuses_zero_and_too_many_nodes() {
        for nodes in [0, DEV_NODES_MAX + 1] {
            let r = DevCluster::start(DevClusterConfig {
                nodes,
                ..DevClusterConfig::default()
            });
            assert!(matches!(r, Err(ServerError::Config(_))), "{nodes} nodes");
        }
    }
}
