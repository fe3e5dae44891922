//! Following the map in etcd, and the client's view of a map: what servers and clients
//! run to stay on the current epoch.

use std::sync::Arc;
use std::time::Duration;

use camelot_client::{MapSource, NodeInfo, PartitionTable};

use crate::error::MapError;
use crate::etcd::{EtcdCluster, EtcdError, Versioned, REQUEST_TIMEOUT};
use crate::map::ClusterMap;

/// After a failed read or a broken watch, wait this long before trying again (doubling
/// up to the max), so an etcd outage costs a few requests a second, not a busy loop.
pub const FOLLOW_BACKOFF_START: Duration = Duration::from_millis(100);
pub const FOLLOW_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Calls `apply` with the current map and then with every newer one, forever (run it as
/// a task; drop the task to stop). Epochs handed to `apply` only grow, across watch
/// breaks and re-reads too.
pub async fn follow(etcd: EtcdCluster, mut apply: impl FnMut(&ClusterMap) + Send) {
    let mut applied = 0;
    let mut backoff = FOLLOW_BACKOFF_START;
    loop {
        let result: Result<(), EtcdError> = async {
            // The watch starts at the revision the read saw: a map published in between
            // (a node that registers and then follows is given one at once) is not missed.
            let (current, revision) = etcd.read_map_at().await?;
            if let Some(v) = &current {
                if v.map.epoch > applied {
                    applied = v.map.epoch;
                    apply(&v.map);
                }
            }
            let mut watch = etcd
                .watch_map_after(revision, current.as_ref().map_or(0, |v| v.map.epoch))
                .await?;
            loop {
                let Versioned { map, .. } = watch.next().await?;
                backoff = FOLLOW_BACKOFF_START;
                if map.epoch > applied {
                    applied = map.epoch;
                    apply(&map);
                }
            }
        }
        .await;
        if let Err(e) = result {
            tracing::warn!("following the cluster map: {e}; again in {backoff:?}");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(FOLLOW_BACKOFF_MAX);
    }
}

/// The client's view of a map: its nodes and each partition's primary.
pub fn client_view(
    map: &ClusterMap,
) -> Result<(camelot_client::ClusterMap, PartitionTable), MapError> {
    let nodes = map
        .nodes
        .iter()
        .map(|n| NodeInfo {
            id: n.id,
            addr: n.addr,
        })
        .collect();
    let primaries = map
        .assignment
        .iter()
        .map(|r| {
            r.first()
                .copied()
                .ok_or(MapError::NoReplicas { partition: 0 })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let count = primaries.len();
    // Full backups only: a syncing replica may lack keys (replica reads skip it).
    let backups: Vec<Vec<u32>> = map
        .assignment
        .iter()
        .enumerate()
        .map(|(p, r)| {
            r.iter()
                .skip(1)
                .copied()
                .filter(|n| !map.is_syncing(p as u32, *n))
                .collect()
        })
        .collect();
    let table = PartitionTable::new(primaries)
        .and_then(|t| t.with_backups(backups))
        .ok_or(MapError::Partitions {
            value: count as u64,
            max: crate::map::PARTITIONS_MAX,
        })?;
    let view = camelot_client::ClusterMap {
        epoch: map.epoch,
        nodes,
    };
    Ok((view, table))
}

/// A [`MapSource`] over etcd for the blocking client: each fetch reads the map on a
/// runtime of its own, bounded by the request timeout. The blocking client's calls must
/// then not be made from a tokio runtime's thread (block_on inside one panics), which is
/// the blocking API's rule anyway.
pub struct EtcdMapSource {
    runtime: tokio::runtime::Runtime,
    etcd: EtcdCluster,
}

impl EtcdMapSource {
    pub fn connect(endpoints: &[String], prefix: &str) -> Result<Arc<EtcdMapSource>, EtcdError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| EtcdError::WatchEnded(format!("cannot start a runtime: {e}")))?;
        let etcd = runtime.block_on(EtcdCluster::connect(endpoints, prefix))?;
        Ok(Arc::new(EtcdMapSource { runtime, etcd }))
    }
}

impl MapSource for EtcdMapSource {
    fn fetch(&self) -> Result<(camelot_client::ClusterMap, PartitionTable), String> {
        let read = self
            .runtime
            .block_on(async { tokio::time::timeout(REQUEST_TIMEOUT, self.etcd.read_map()).await });
        match read {
            Ok(Ok(Some(v))) => client_view(&v.map).map_err(|e| e.to_string()),
            Ok(Ok(None)) => Err("no cluster map in etcd".into()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("etcd did not answer within {REQUEST_TIMEOUT:?}")),
        }
    }
}

/// A client that watches the map in etcd ([`watch_for_client`]): every new epoch is
/// installed in the client as etcd announces it, so the client routes by the new map
/// before any server has to answer it MOVED or STALE_EPOCH. Dropping it stops the watch
/// (its thread is joined). The client's own refresh-on-redirect stays as the fallback:
/// a watch only narrows the window in which a request can still go by an old map (the
/// time etcd takes to deliver the event); it cannot close it.
pub struct ClientMapWatch {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ClientMapWatch {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts a thread that follows the map in etcd ([`follow`]: watch, with re-reads and
/// backoff after a break) and installs each newer map in `client`. A map the client cannot
/// take (no partitions, say) is logged and skipped; the next one is tried.
pub fn watch_for_client(
    client: camelot_client::Client,
    endpoints: &[String],
    prefix: &str,
) -> Result<ClientMapWatch, EtcdError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| EtcdError::WatchEnded(format!("cannot start a runtime: {e}")))?;
    let etcd = runtime.block_on(EtcdCluster::connect(endpoints, prefix))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("camelot-map-watch".into())
        .spawn(move || {
            runtime.block_on(async move {
                let installing = follow(etcd, move |map| match client_view(map) {
                    Ok((view, table)) => {
                        if let Err(e) = client.set_cluster(view, table) {
                            tracing::warn!("cluster map epoch {}: {e}", map.epoch);
                        }
                    }
                    Err(e) => tracing::warn!("cluster map epoch {}: {e}", map.epoch),
                });
                tokio::select! {
                    _ = installing => {}
                    _ = stopped => {}
                }
            })
        })
        .map_err(|e| EtcdError::WatchEnded(format!("cannot start the watch thread: {e}")))?;
    Ok(ClientMapWatch {
        stop: Some(stop),
        thread: Some(thread),
    })
}
