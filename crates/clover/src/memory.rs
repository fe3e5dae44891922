//! The one-sided memory a store runs on: Camelot regions through the request API
//! ([`RegionMemory`]), or plain vectors for tests of the logic without sockets
//! ([`SimMemory`]).

use crate::layout::{Geometry, NodeAddr, BLOCKS_MAX};
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

/// Blocks are shared regions on the cluster's memory servers, placed round-robin; nodes
/// are read, written and CASed with the request API's READ, WRITE and CAS only.
#[derive(Clone)]
pub struct RegionMemory {
    client: Client,
    geometry: Geometry,
    blocks: Arc<RwLock<Vec<Region>>>,
    next_server: Arc<AtomicUsize>,
}

impl RegionMemory {
    pub fn new(client: Client, geometry: Geometry) -> RegionMemory {
        RegionMemory {
            client,
            geometry,
            blocks: Arc::new(RwLock::new(Vec::new())),
            next_server: Arc::new(AtomicUsize::new(0)),
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
        let region = self
            .blocks
            .read()
            .get(addr.block as usize)
            .cloned()
            .ok_or(CloverError::BadAddress(addr))?;
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
