//! Every YCSB workload on every target, scaled down, with real redis-server and
//! memcached started by the harness: zero errors and zero value mismatches, and a result
//! file in the schema. Camelot runs in process here (this crate's tests have no camelot
//! binary to start); the CLI's tests run the same bench with separate processes.

use camelot_bench::ycsb::targets::{clear, TargetKind};
use camelot_bench::ycsb::{run, run_one, RunOutcome, RunTarget, Workload, YcsbConfig};
use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_results::output::read_result;
use camelot_server::dev::{DevCluster, DevClusterConfig};

#[test]
fn every_workload_on_every_target_reads_back_what_it_wrote() {
    let out = std::env::temp_dir().join(format!("camelot-ycsb-test-{}", std::process::id()));
    let cfg = YcsbConfig {
        workloads: ["a", "b", "c", "d", "e", "f", "w"]
            .iter()
            .map(|w| Workload::parse(w).unwrap())
            .collect(),
        records: 2_000,
        operations: 2_000,
        threads: 4,
        spawn: ["camelot", "resp", "redis", "memcached"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        memory_bytes: 512 << 20,
        in_process: true,
        ..YcsbConfig::default()
    };
    let report = run(&cfg, &out, |line| eprintln!("{line}")).expect("ycsb runs");
    eprintln!("{}", report.table);
    assert_eq!(report.errors, 0);
    assert_eq!(report.mismatches, 0);

    let result = read_result(&out.join("ycsb.json")).expect("ycsb.json reads back");
    assert_eq!(result.bench, "ycsb");
    let labels: Vec<&str> = result.series.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "camelot-native (in-process)",
            "camelot-resp (in-process)",
            "redis",
            "memcached"
        ]
    );
    let sides = &result.config["sides"];
    assert_eq!(sides["camelot-resp (in-process)"]["process"], "in-process");
    assert_eq!(sides["redis"]["process"], "separate");
    assert_eq!(sides["redis"]["server_threads"], 1);
    assert_eq!(
        sides["memcached"]["server_threads"],
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    assert!(sides["redis"]["data_model"]
        .as_str()
        .is_some_and(|m| m.contains("hash per record")));
    assert_eq!(
        sides["redis"]["data_model"],
        sides["camelot-resp (in-process)"]["data_model"]
    );
    for s in &result.series {
        assert_eq!(s.points.len(), 7, "{}", s.label);
        for p in &s.points {
            let skipped = p.extra.contains_key("skipped");
            // Only memcached skips, and only E (no scans).
            assert_eq!(
                skipped,
                s.label == "memcached" && p.x == "E".into(),
                "{} {:?}",
                s.label,
                p.x
            );
            if !skipped {
                let ops = p.ops_per_sec.expect("throughput");
                assert!(ops.is_finite() && ops > 0.0);
                let l = p.latency_us.as_ref().expect("latency");
                assert!(l.p50 > 0.0 && l.p50 <= l.p99 && l.p99 <= l.max);
                // Per-operation figures are flat numbers, never nested JSON.
                assert!(p.extra.values().all(|v| !v.is_object()), "{:?}", p.extra);
                // Only a server process of its own can be metered: redis and memcached.
                let metered = p.extra.contains_key("server_cpu_seconds");
                assert_eq!(metered, !s.label.contains("in-process"), "{}", s.label);
            }
        }
    }
    assert!(out.join("ycsb.png").exists() && out.join("ycsb.svg").exists());
    assert!(report.table.contains("÷ redis"));
    // The in-process Camelot rows are compared (their CPU cannot be, so no CPU ratio).
    assert!(result
        .comparisons
        .iter()
        .any(|c| c.name.contains("throughput, 1 server thread")));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_target_rate_holds_the_rate_and_times_from_the_intended_start() {
    let out = std::env::temp_dir().join(format!("camelot-ycsb-rate-{}", std::process::id()));
    let cfg = YcsbConfig {
        workloads: vec![Workload::C],
        records: 500,
        operations: 1_000,
        threads: 4,
        target_ops: Some(2_000.0),
        spawn: vec!["camelot".into()],
        memory_bytes: 256 << 20,
        in_process: true,
        ..YcsbConfig::default()
    };
    let report = run(&cfg, &out, |_| {}).expect("ycsb runs");
    assert_eq!((report.errors, report.mismatches), (0, 0));
    let result = read_result(&out.join("ycsb.json")).expect("ycsb.json");
    let p = &result.series[0].points[0];
    let ops = p.ops_per_sec.expect("throughput");
    // 1,000 operations at 2,000/s take at least half a second: the rate cannot be beaten.
    assert!(
        ops <= 2_000.0 * 1.05,
        "{ops} ops/s against a 2,000 ops/s target"
    );
    assert!(ops >= 200.0, "{ops} ops/s: far below the target rate");
    assert_eq!(result.config["target_ops"], 2_000.0);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn clear_empties_a_camelot_store_so_the_next_load_starts_empty() {
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: 2,
        memory_bytes_per_node: 64 << 20,
        resp: true,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster");
    let client = Client::connect(
        ClusterMap::from_addrs(cluster.addrs()),
        ClientConfig::default(),
    )
    .expect("client");
    // More keys than one clear round takes, spread over both nodes.
    let keys: Vec<String> = (0..2_500).map(|i| format!("stray{i:05}")).collect();
    let pairs: Vec<(&[u8], bytes::Bytes)> = keys
        .iter()
        .map(|k| (k.as_bytes(), bytes::Bytes::from_static(b"left over")))
        .collect();
    for chunk in pairs.chunks(500) {
        client.put_many(chunk).expect("put");
    }
    assert_eq!(client.scan(b"", 10).expect("scan").len(), 10);

    let kind = TargetKind::Camelot {
        addrs: cluster.addrs().to_vec(),
        token: None,
    };
    clear(&kind).expect("clear");
    assert!(client.scan(b"", 10).expect("scan").is_empty());
    assert_eq!(client.get(b"stray00000").expect("get"), None);

    // A hash through the Redis port is invisible to the native scan: clear must say so
    // rather than report an empty store.
    let resp = cluster.resp_addrs()[0];
    let mut con = redis::Client::open(format!("redis://{resp}/"))
        .and_then(|c| c.get_connection())
        .expect("resp connection");
    let _: () = redis::cmd("HSET")
        .arg("h")
        .arg("f")
        .arg("v")
        .query(&mut con)
        .expect("hset");
    let err = clear(&kind).expect_err("a hash is left");
    assert!(err.contains("FLUSHALL"), "{err}");
    let _: () = redis::cmd("FLUSHALL").query(&mut con).expect("flushall");
    clear(&kind).expect("empty again");

    // A second load after a clear starts empty, on both faces: a run over 3,000 records,
    // then one over 500 (workload C inserts nothing), must leave exactly 500 records — a
    // clear that did nothing would leave the first run's 3,000.
    let objects = || -> u64 {
        (0..2)
            .map(|node| {
                let stats = client.stats(node).expect("stats");
                stats
                    .iter()
                    .find(|(name, _)| name == "objects")
                    .map_or(0, |(_, v)| *v)
            })
            .sum()
    };
    for target in [kind.clone(), TargetKind::Resp(resp)] {
        for records in [3_000, 500] {
            let cfg = YcsbConfig {
                workloads: vec![Workload::C],
                records,
                operations: 200,
                threads: 2,
                ..YcsbConfig::default()
            };
            let run_target = RunTarget {
                label: "camelot".into(),
                kind: target.clone(),
                pids: Vec::new(),
            };
            match run_one(&run_target, Workload::C, &cfg).expect("load and run") {
                RunOutcome::Done(r) => assert_eq!((r.errors, r.mismatches), (0, 0)),
                RunOutcome::Skipped(why) => panic!("skipped: {why}"),
            }
            // Through the Redis port, YCSB's Redis binding also keeps one sorted set,
            // `_indices`, of every key (what its SCAN reads).
            let index = u64::from(matches!(target, TargetKind::Resp(_)));
            assert_eq!(
                objects(),
                records + index,
                "{target:?} after a load of {records}"
            );
        }
        // The Redis-port run leaves hashes the native clear refuses; FLUSHALL them.
        clear(&target).expect("clear between faces");
        assert_eq!(objects(), 0);
    }
    cluster.shutdown().expect("shutdown");
}

#[test]
fn a_camelot_target_with_a_token_in_its_url_reaches_a_tokened_cluster() {
    let cluster = DevCluster::start(DevClusterConfig {
        nodes: 1,
        memory_bytes_per_node: 64 << 20,
        token: Some(b"s3cret".to_vec()),
        worker_threads: 2,
        ..DevClusterConfig::default()
    })
    .expect("dev cluster");
    let addr = cluster.addrs()[0];
    let out = std::env::temp_dir().join(format!("camelot-ycsb-token-{}", std::process::id()));
    let cfg = |url: &str| YcsbConfig {
        workloads: vec![Workload::A],
        records: 200,
        operations: 400,
        threads: 2,
        targets: vec![("camelot".into(), TargetKind::parse(url).expect("url"))],
        ..YcsbConfig::default()
    };
    let report = run(&cfg(&format!("camelot://:s3cret@{addr}")), &out, |_| {}).expect("runs");
    assert_eq!((report.errors, report.mismatches), (0, 0));
    let json = std::fs::read_to_string(out.join("ycsb.json")).expect("ycsb.json");
    assert!(!json.contains("s3cret"), "the token leaked into ycsb.json");
    // Without it (or with a wrong one) the cluster refuses the bench.
    for url in [
        format!("camelot://{addr}"),
        format!("camelot://:wrong@{addr}"),
    ] {
        assert!(run(&cfg(&url), &out, |_| {}).is_err(), "{url} was let in");
    }
    let _ = std::fs::remove_dir_all(&out);
}
