//! The one-sided memory a store runs on: Camelot regions through the request API
//! ([`RegionMemory`]), or plain vectors for tests of the logic without sockets
//! ([`SimMemory`]).

use crate::layout::{Geometry, NodeAddr, BLOCKS_MAX};
use crate::wire::BlockRef;
use crate::CloverError;
use bytes::Bytes;
use camelot_client::{AccessMode, Client, Region};
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One-sided access to version nodes, plus adding blocks (only the metadata service
/// does that).
pub trait Memory: Send + Sync {
    fn geometry(&self) -> Geometry;
    fn read(&self, addr: NodeAddr, len: u32) -> Result<Bytes, CloverError>;
    fn write(&self, addr: NodeAddr, data: Bytes) -> Result<(), CloverError>;
    /// CAS on the node's first word; returns the word before.
    fn cas(&self, addr: NodeAddr, expected: u64, new: u64) -> Result<u64, CloverError>;
    /// Makes a new block and returns its index.
    fn add_block(&self) -> Result<u32, CloverError>;
    fn blocks(&self) -> u32;
}

/// Where a store that does not make its blocks learns them: the metadata server.
pub trait BlockSource: Send + Sync {
    /// The blocks from index `from` on (possibly only some of them; none past the end).
    fn blocks_from(&self, from: u32) -> Result<Vec<BlockRef>, CloverError>;
}

/// Blocks are shared regions on the cluster's memory servers, placed round-robin; nodes
/// are read, written and CASed with the request API's READ, WRITE and CAS only.
#[derive(Clone)]
pub struct RegionMemory {
    client: Client,
    geometry: Geometry,
    blocks: Arc<RwLock<Vec<Region>>>,
    next_server: Arc<AtomicUsize>,
    /// Set for a store whose blocks the metadata server makes: an unknown block index
    /// is looked up there (block `i` of the client's map is server `i` of the service's).
    source: Option<Arc<dyn BlockSource>>,
}

impl RegionMemory {
    pub fn new(client: Client, geometry: Geometry) -> RegionMemory {
        RegionMemory {
            client,
            geometry,
            blocks: Arc::new(RwLock::new(Vec::new())),
            next_server: Arc::new(AtomicUsize::new(0)),
            source: None,
        }
    }

    /// Memory whose blocks `source` makes and names; the client's map lists the same
    /// servers in the same order as the source's (or proxies in front of them).
    pub fn remote(
        client: Client,
        geometry: Geometry,
        source: Arc<dyn BlockSource>,
    ) -> RegionMemory {
        RegionMemory {
            source: Some(source),
            ..RegionMemory::new(client, geometry)
        }
    }

    /// Blocks from `from` on, at most `max`, as the metadata server names them.
    pub fn block_refs(&self, from: u32, max: usize) -> Vec<BlockRef> {
        let map = self.client.map();
        self.blocks
            .read()
            .iter()
            .skip(from as usize)
            .take(max)
            .map(|r| BlockRef {
                server: map
                    .nodes
                    .iter()
                    .position(|n| n.id == r.node)
                    .map_or(u32::MAX, |i| i as u32),
                region: r.id,
                size: r.size,
            })
            .collect()
    }

    /// Learns blocks from the source until `block` is known (or the source has no more).
    fn learn(&self, block: u32) -> Result<(), CloverError> {
        let Some(source) = &self.source else {
            return Ok(());
        };
        let map = self.client.map();
        loop {
            let have = self.blocks.read().len() as u32;
            if block < have {
                return Ok(());
            }
            let refs = source.blocks_from(have)?;
            if refs.is_empty() {
                return Ok(());
            }
            let mut blocks = self.blocks.write();
            // Another thread may have learned them meanwhile.
            if blocks.len() as u32 != have {
                continue;
            }
            for r in refs {
                let node = map.nodes.get(r.server as usize).ok_or_else(|| {
                    CloverError::InvalidArgument(format!(
                        "block on server {} of the metadata service, but this client knows {} servers",
                        r.server,
                        map.nodes.len()
                    ))
                })?;
                if blocks.len() >= BLOCKS_MAX as usize {
                    return Err(CloverError::OutOfMemory {
                        blocks_max: BLOCKS_MAX,
                    });
                }
                blocks.push(Region {
                    node: node.id,
                    id: r.region,
                    size: r.size,
                    name: None,
                    mode: AccessMode::Shared,
                });
            }
        }
    }

    /// The same blocks through another client (its own connections).
    pub fn with_client(&self, client: Client) -> RegionMemory {
        RegionMemory {
            client,
            ..self.clone()
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The region holding a node and the node's offset in it.
    fn place(&self, addr: NodeAddr) -> Result<(Region, u64), CloverError> {
        let known = self.blocks.read().get(addr.block as usize).cloned();
        let region = match known {
            Some(r) => r,
            None => {
                self.learn(addr.block)?;
                self.blocks
                    .read()
                    .get(addr.block as usize)
                    .cloned()
                    .ok_or(CloverError::BadAddress(addr))?
            }
        };
        let offset = self
            .geometry
            .offset(addr)
            .ok_or(CloverError::BadAddress(addr))?;
        Ok((region, offset))
    }
}

impl Memory for RegionMemory {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn read(&self, addr: NodeAddr, len: u32) -> Result<Bytes, CloverError> {
        let (region, offset) = self.place(addr)?;
        Ok(self.client.read(&region, offset, len)?)
    }

    fn write(&self, addr: NodeAddr, data: Bytes) -> Result<(), CloverError> {
        let (region, offset) = self.place(addr)?;
        Ok(self.client.write(&region, offset, data)?)
    }

    fn cas(&self, addr: NodeAddr, expected: u64, new: u64) -> Result<u64, CloverError> {
        let (region, offset) = self.place(addr)?;
        Ok(self.client.cas(&region, offset, expected, new)?)
    }

    fn add_block(&self) -> Result<u32, CloverError> {
        if self.source.is_some() {
            return Err(CloverError::InvalidArgument(
                "only the metadata service makes blocks".into(),
            ));
        }
        let map = self.client.map();
        if map.nodes.is_empty() {
            return Err(CloverError::Client(camelot_client::ClientError::EmptyMap));
        }
        let i = self.next_server.fetch_add(1, Ordering::Relaxed) % map.nodes.len();
        let region = self.client.alloc_on_with(
            map.nodes[i].id,
            self.geometry.block_bytes(),
            None,
            AccessMode::Shared,
        )?;
        let mut blocks = self.blocks.write();
        if blocks.len() >= BLOCKS_MAX as usize {
            return Err(CloverError::OutOfMemory {
                blocks_max: BLOCKS_MAX,
            });
        }
        blocks.push(region);
        Ok((blocks.len() - 1) as u32)
    }

    fn blocks(&self) -> u32 {
        self.blocks.read().len() as u32
    }
}

/// Blocks as byte vectors behind one lock, so every access is atomic as a server makes
/// it: the model the chain logic is tested on without sockets.
#[derive(Clone)]
pub struct SimMemory {
    geometry: Geometry,
    blocks: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl SimMemory {
    pub fn new(geometry: Geometry) -> SimMemory {
        SimMemory {
            geometry,
            blocks: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn span(&self, addr: NodeAddr, len: usize) -> Result<(usize, usize), CloverError> {
        let offset = self
            .geometry
            .offset(addr)
            .ok_or(CloverError::BadAddress(addr))? as usize;
        let end = offset + len;
        if end as u64 > self.geometry.block_bytes() {
            return Err(CloverError::BadAddress(addr));
        }
        Ok((offset, end))
    }
}

impl Memory for SimMemory {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn read(&self, addr: NodeAddr, len: u32) -> Result<Bytes, CloverError> {
        let (from, to) = self.span(addr, len as usize)?;
        let blocks = self.blocks.lock();
        let block = blocks
            .get(addr.block as usize)
            .ok_or(CloverError::BadAddress(addr))?;
        Ok(Bytes::copy_from_slice(&block[from..to]))
    }

    fn write(&self, addr: NodeAddr, data: Bytes) -> Result<(), CloverError> {
        let (from, to) = self.span(addr, data.len())?;
        let mut blocks = self.blocks.lock();
        let block = blocks
            .get_mut(addr.block as usize)
            .ok_or(CloverError::BadAddress(addr))?;
        block[from..to].copy_from_slice(&data);
        Ok(())
    }

    fn cas(&self, addr: NodeAddr, expected: u64, new: u64) -> Result<u64, CloverError> {
        let (from, to) = self.span(addr, 8)?;
        let mut blocks = self.blocks.lock();
        let block = blocks
            .get_mut(addr.block as usize)
            .ok_or(CloverError::BadAddress(addr))?;
        let mut w = [0u8; 8];
        w.copy_from_slice(&block[from..to]);
        let before = u64::from_le_bytes(w);
        if before == expected {
            block[from..to].copy_from_slice(&new.to_le_bytes());
        }
        Ok(before)
    }

    fn add_block(&self) -> Result<u32, CloverError> {
        let mut blocks = self.blocks.lock();
        blocks.push(vec![0; self.geometry.block_bytes() as usize]);
        Ok((blocks.len() - 1) as u32)
    }

    fn blocks(&self) -> u32 {
        self.blocks.lock().len() as u32
    }
}
