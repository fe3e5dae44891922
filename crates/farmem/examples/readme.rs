//! The README's two far-memory examples, line for line between the `README:` markers:
//! `cargo test -p camelot-farmem` builds this file (so the examples compile against the
//! crate as it is) and `tests/readme.rs` checks that the README shows exactly these
//! lines. To run them against a memory server (1 GiB of it, and userfaultfd for the
//! second): `cargo run -p camelot-farmem --example readme -- 127.0.0.1:7000`.

use camelot_client::{Client, ClientConfig, ClusterMap};

fn farvec(client: &Client) -> Result<(), Box<dyn std::error::Error>> {
    // README: farvec
    use camelot_farmem::{CacheConfig, FarVec, PageCache, RegionStore};
    let store = RegionStore::alloc(client.clone(), 1 << 18, 4096, Some("big"))?; // 1 GiB far
    let mut config = CacheConfig::new(256 << 20); // 256 MiB of local frames
    config.policy = "s3fifo".into(); // lru clock fifo random s3fifo arc
    config.prefetch = "sequential".into(); // none sequential trend
    let v: FarVec<u64, _> = FarVec::new(PageCache::new(store, &config)?, 1 << 27)?;
    v.set(12345, 42)?;
    let total: u64 = v.iter().sum::<Result<u64, _>>()?; // pages come and go as needed
    let head: u64 = v.slice(0..4096)?.pieces().flatten().sum(); // views of pinned frames
    v.flush()?; // dirty pages back to the server

    // README: end
    println!("sum {total}, first 4096 {head}");
    Ok(())
}

fn far_region(client: &Client) -> Result<(), Box<dyn std::error::Error>> {
    // README: farregion
    use camelot_farmem::{CacheConfig, FarRegion, RegionStore};
    let store = RegionStore::alloc(client.clone(), 1 << 18, 4096, Some("keys"))?; // 1 GiB far
    let mut region = FarRegion::new(store, &CacheConfig::new(512 << 20))?; // 512 MiB local
    let keys: &mut [u64] = bytemuck::cast_slice_mut(region.bytes_mut());
    keys.sort_unstable(); // faults bring pages in and out
    region.flush()?;
    // README: end
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(server) = std::env::args().nth(1) else {
        eprintln!("usage: readme HOST:PORT (a camelot server with 2 GiB free)");
        std::process::exit(2);
    };
    let addr: std::net::SocketAddr = server.parse()?;
    let client = Client::connect(ClusterMap::from_addrs(&[addr]), ClientConfig::default())?;
    farvec(&client)?;
    far_region(&client)?;
    Ok(())
}
