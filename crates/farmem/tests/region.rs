//! The page cache and FarVec over a real memory server on loopback. (A server
//! SIGKILLed under far memory is tested on `camelot server` processes, in
//! `crates/cli/tests/far_memory.rs`.)

use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_farmem::{CacheConfig, FarVec, PageCache, PageStore, RegionStore, VolumeStore};
use camelot_server::dev::{DevCluster, DevClusterConfig};

const PAGE: usize = 4096;

fn server() -> (DevCluster, Client) {
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 64 << 20,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster");
    let client = Client::connect(
        ClusterMap::from_addrs(cluster.addrs()),
        ClientConfig::default(),
    )
    .expect("client");
    (cluster, client)
}

/// A FarVec four times larger than its local memory: every element written reads back,
/// only a quarter of the pages are local at any time, the traffic is what the misses
/// say, and after a flush a second program finds the data by the region's name.
#[test]
fn farvec_over_a_memory_server_keeps_every_element() {
    let (_cluster, client) = server();
    let len: u64 = 64 * 1024; // 512 KiB of u64: 128 pages
    let pages = len * 8 / PAGE as u64;
    let store =
        RegionStore::alloc(client.clone(), pages, PAGE, Some("farvec-test")).expect("region");
    let mut config = CacheConfig::new(pages / 4 * PAGE as u64);
    config.policy = "s3fifo".into();
    config.prefetch = "sequential".into();
    let cache = PageCache::new(store, &config).expect("cache");
    let v: FarVec<u64, _> = FarVec::new(cache, len).expect("farvec");
    for i in 0..len {
        v.set(i, i ^ 0x5555).expect("set");
    }
    for i in (0..len).rev().step_by(7) {
        assert_eq!(v.get(i).expect("get"), i ^ 0x5555, "element {i}");
    }
    let stats = v.stats();
    assert!(stats.evictions > 0 && stats.written_back > 0, "{stats:?}");
    v.flush().expect("flush");
    let cache = v.into_cache();
    assert!(cache.resident_pages() <= (pages / 4) as usize);
    let (read, written) = cache.store().traffic_bytes();
    assert!(
        read >= (stats.misses * PAGE as u64),
        "read {read} B for {} misses",
        stats.misses
    );
    assert!(
        written >= pages * PAGE as u64,
        "every page was dirtied and written back once at least: {written}"
    );

    // Another program, another cache: the data is in the server, under the name.
    let region = client.lookup("farvec-test").expect("lookup");
    let store = RegionStore::new(client, region, PAGE).expect("store");
    let again: FarVec<u64, _> = FarVec::new(
        PageCache::new(store, &CacheConfig::new(8 * PAGE as u64)).expect("cache"),
        len,
    )
    .expect("farvec");
    let sum: u64 = again
        .iter()
        .map(|x| x.expect("element"))
        .fold(0, u64::wrapping_add);
    let want: u64 = (0..len).map(|i| i ^ 0x5555).fold(0, u64::wrapping_add);
    assert_eq!(sum, want);
}

/// The direct path over a server: runs written and read in place (several requests in
/// flight), agreeing with the page-at-a-time path, and refused past the end.
#[test]
fn runs_move_straight_between_slices_and_a_server() {
    let (_cluster, client) = server();
    let pages = 600u64; // 2.4 MiB: three 1 MiB requests a run
    let store = RegionStore::alloc(client, pages, PAGE, None).expect("region");
    let data: Vec<u8> = (0..(pages as usize - 10) * PAGE)
        .map(|i| (i * 31 / 4096) as u8)
        .collect();
    store.write_run(5, &data).expect("write_run");
    let mut back = vec![0u8; data.len()];
    store.read_run(5, &mut back).expect("read_run");
    assert!(back == data, "the run did not read back");
    let mut page = vec![vec![0u8; PAGE].into_boxed_slice()];
    store.read_pages(&[300], &mut page).expect("read_pages");
    assert_eq!(&page[0][..], &data[295 * PAGE..296 * PAGE]);
    assert!(store.read_run(pages - 1, &mut [0u8; 2 * PAGE]).is_err());
    assert!(store.write_run(0, &[0u8; 100]).is_err(), "not whole pages");
    assert_eq!(
        store.traffic_bytes(),
        ((data.len() + PAGE) as u64, data.len() as u64)
    );
}

/// Direct writes reuse their request buffers from run to run (more than a window of
/// them, the last one short): each run lands with its own bytes, none of the run
/// before — a buffer refilled without being emptied, or handed out while still on
/// the wire, would show here.
#[test]
fn reused_write_buffers_carry_each_run_s_own_bytes() {
    let (_cluster, client) = server();
    let pages = 20 * 256 + 3; // 20 MiB and 3 pages: over a 16 MiB window
    let store = RegionStore::alloc(client, pages, PAGE, None).expect("region");
    let first: Vec<u8> = (0..pages as usize * PAGE)
        .map(|i| (i % 251) as u8)
        .collect();
    store.write_run(0, &first).expect("first run");
    // A shorter run at another offset: its requests start and end elsewhere.
    let second: Vec<u8> = (0..(pages as usize - 700) * PAGE)
        .map(|i| (i % 241) as u8 ^ 0xa5)
        .collect();
    store.write_run(300, &second).expect("second run");
    let mut want = first;
    want[300 * PAGE..300 * PAGE + second.len()].copy_from_slice(&second);
    let mut back = vec![0u8; want.len()];
    store.read_run(0, &mut back).expect("read back");
    let wrong = back.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(wrong, None, "first wrong byte");
}

/// A VolumeStore over raid5 on three servers: runs and pages agree, and a FarVec's
/// large slices (the direct path) and single elements (the cached path) see each other.
#[test]
fn a_volume_store_serves_runs_pages_and_a_farvec() {
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: 3,
        memory_bytes_per_node: 64 << 20,
        worker_threads: 1,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster");
    let volume = camelot_blocks::Volume::create(
        "farmem-vol",
        camelot_blocks::Level::Raid5,
        cluster.addrs(),
        16 << 10,
        4 << 20,
        &camelot_blocks::VolumeConfig::default(),
    )
    .expect("volume");
    let store = VolumeStore::new(std::sync::Arc::new(volume), PAGE).expect("store");
    let pages = store.pages();
    assert_eq!(pages, 1024);
    let data: Vec<u8> = (0..100 * PAGE).map(|i| (i / 13) as u8).collect();
    store.write_run(7, &data).expect("write_run");
    let mut page = vec![vec![0u8; PAGE].into_boxed_slice()];
    store.read_pages(&[50], &mut page).expect("read_pages");
    assert_eq!(&page[0][..], &data[43 * PAGE..44 * PAGE]);

    let cache = PageCache::new(store, &CacheConfig::new(8 * PAGE as u64)).expect("cache");
    let v: FarVec<u64, _> = FarVec::new(cache, pages * PAGE as u64 / 8).expect("farvec");
    let values: Vec<u64> = (0..v.len()).map(|i| i * 5 + 1).collect();
    v.write_slice(0, &values).expect("write_slice");
    v.set(777, 3).expect("set");
    assert_eq!(v.get(12_345).expect("get"), 12_345 * 5 + 1);
    let mut back = vec![0u64; values.len()];
    v.read_slice(0, &mut back).expect("read_slice");
    assert_eq!(back[777], 3, "the dirty frame is newer than the store");
    back[777] = values[777];
    assert!(back == values);
    assert!(v.stats().direct_pages > 1000, "{:?}", v.stats());
}
