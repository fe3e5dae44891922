//! Every fuzz target on stable, without libFuzzer: each seed in `corpus/<target>/` is run
//! as it is, then mutations of the seeds for `CAMELOT_FUZZ_SECONDS` per target (default
//! 1; CI runs 20, see scripts/fuzz.sh). The mutator's seed is printed and can be fixed
//! with `CAMELOT_FUZZ_SEED`. An input that panics is written to `artifacts/<target>/`,
//! where `cargo fuzz run <target> artifacts/<target>/<file>` replays it too.
//!
//! `cargo test --no-default-features --test corpus -- --ignored write_seed_corpus`
//! rewrites the seed files from the encoders (they are checked in).

use bytes::{Bytes, BytesMut};
use camelot_fuzz::mutate::Mutator;
use camelot_fuzz::TARGETS;
use camelot_proto::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Seed files one target may have; the corpus is meant to stay small.
const SEEDS_MAX: usize = 256;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

fn seconds() -> Duration {
    let s = std::env::var("CAMELOT_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(1.0);
    Duration::from_secs_f64(s)
}

fn mutator_seed() -> u64 {
    std::env::var("CAMELOT_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    files.sort();
    assert!(
        !files.is_empty() && files.len() <= SEEDS_MAX,
        "{}: {} seed files, want 1 to {SEEDS_MAX}",
        dir.display(),
        files.len()
    );
    files
        .iter()
        .map(|f| std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display())))
        .collect()
}

/// Runs `body` on `input`; on a panic keeps the input and fails with where it is.
fn run_one(target: &str, body: fn(&[u8]), input: &[u8], seed: u64) {
    if catch_unwind(AssertUnwindSafe(|| body(input))).is_err() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("artifacts")
            .join(target);
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join(format!("crash-{seed}-{}", input.len()));
        let kept = std::fs::write(&file, input).is_ok();
        panic!(
            "{target} panicked on a {}-byte input (mutator seed {seed}); {}",
            input.len(),
            if kept {
                format!("kept in {}", file.display())
            } else {
                format!("could not write it to {}", file.display())
            }
        );
    }
}

fn fuzz(target: &str) {
    let body = TARGETS
        .iter()
        .find(|(n, _)| *n == target)
        .map(|(_, f)| *f)
        .expect("a known target");
    let seeds = seeds(target);
    let seed = mutator_seed();
    for s in &seeds {
        run_one(target, body, s, seed);
    }
    let budget = seconds();
    let start = Instant::now();
    let mut m = Mutator::new(seed);
    let mut input = Vec::new();
    let mut runs = 0u64;
    while start.elapsed() < budget {
        m.next(&seeds, &mut input);
        run_one(target, body, &input, seed);
        runs += 1;
    }
    eprintln!(
        "fuzz {target}: {} seeds, {runs} mutated inputs in {:.1} s, mutator seed {seed}, no crash",
        seeds.len(),
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn every_target_has_a_corpus_and_a_test() {
    for (name, _) in TARGETS {
        assert!(!seeds(name).is_empty());
        let bin = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz_targets")
            .join(format!("{name}.rs"));
        assert!(bin.exists(), "{} missing", bin.display());
    }
    let this = include_str!("corpus.rs");
    for (name, _) in TARGETS {
        assert!(
            this.contains(&format!("fn {name}() {{\n    fuzz(\"{name}\")")),
            "no test runs {name}"
        );
    }
}

#[test]
fn decode_superblock() {
    fuzz("decode_superblock")
}

#[test]
fn nbd_session() {
    fuzz("nbd_session")
}

#[test]
fn decode_frame() {
    fuzz("decode_frame")
}

#[test]
fn frame_stream() {
    fuzz("frame_stream")
}

#[test]
fn exec_batch() {
    fuzz("exec_batch")
}

#[test]
fn resp_command() {
    fuzz("resp_command")
}

#[test]
fn memcached_reply() {
    fuzz("memcached_reply")
}

#[test]
fn decode_netctl() {
    fuzz("decode_netctl")
}

#[test]
fn rvm_record() {
    fuzz("rvm_record")
}

#[test]
fn clover_wire() {
    fuzz("clover_wire")
}

fn frame_bytes(f: &Frame) -> Vec<u8> {
    let mut buf = BytesMut::new();
    encode_frame(f, &mut buf).expect("encode");
    buf.to_vec()
}

fn body_of(f: &Frame) -> Vec<u8> {
    frame_bytes(f)[4..].to_vec()
}

fn requests(ops: Vec<Op>) -> Frame {
    Frame::Requests(RequestBatch {
        epoch: 0,
        requests: ops
            .into_iter()
            .zip(1..)
            .map(|(op, id)| Request { id, op })
            .collect(),
    })
}

fn region_ops() -> Vec<Op> {
    vec![
        Op::Alloc {
            size: 4096,
            name: Some("a".into()),
            mode: AccessMode::Private,
        },
        Op::Alloc {
            size: 10_000,
            name: None,
            mode: AccessMode::Shared,
        },
        Op::Lookup { name: "a".into() },
        Op::Write {
            region: 0,
            offset: 8,
            data: Bytes::from_static(b"12345678"),
        },
        Op::Read {
            region: 1,
            offset: 0,
            len: 16,
        },
        Op::Cas {
            region: 0,
            offset: 8,
            expected: 0,
            new: 7,
        },
        Op::FetchAdd {
            region: 1,
            offset: 0,
            delta: 1,
        },
        Op::Swap {
            region: 1,
            offset: 8,
            data: Bytes::from_static(b"swapped!"),
        },
        Op::XorInto {
            region: 1,
            offset: 8,
            data: Bytes::from_static(b"\xff\x00\xff\x00"),
        },
        Op::List,
        Op::Free { region: 0 },
        Op::Stats,
        Op::Ping,
    ]
}

fn object_ops() -> Vec<Op> {
    vec![
        Op::Put {
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"v"),
        },
        Op::Get {
            key: Bytes::from_static(b"k"),
        },
        Op::CasPut {
            key: Bytes::from_static(b"k"),
            expected_version: 1,
            value: Bytes::from_static(b"w"),
        },
        Op::Scan {
            start: Bytes::new(),
            limit: 10,
        },
        Op::ScanPartitions {
            after: Some(Bytes::from_static(b"k")),
            limit: 10,
            partitions: 16,
            mask: camelot_proto::partition_mask(16, [1, 9]),
            since_version: 2,
            keys_only: true,
            push_to: None,
        },
        Op::ScanPartitions {
            after: None,
            limit: 10,
            partitions: 16,
            mask: camelot_proto::partition_mask(16, [3]),
            since_version: 0,
            keys_only: false,
            push_to: Some(2),
        },
        Op::Delete {
            key: Bytes::from_static(b"k"),
        },
    ]
}

#[test]
#[ignore = "rewrites the checked-in seed corpus"]
fn write_seed_corpus() {
    let hello = Frame::Hello(Hello {
        version: PROTOCOL_VERSION,
        token: Bytes::from_static(b"s3cret"),
        principal: "alice".into(),
        fence: None,
    });
    let responses = Frame::Responses(ResponseBatch {
        responses: vec![
            Response {
                id: 1,
                result: Ok(Reply::Region(RegionInfo {
                    id: 0x1234_5678_9abc_def0,
                    size: 4096,
                    name: Some("a".into()),
                    mode: AccessMode::Shared,
                })),
            },
            Response {
                id: 2,
                result: Ok(Reply::Data(Bytes::from_static(b"data"))),
            },
            Response {
                id: 3,
                result: Err(ErrorReply::new(ErrorCode::QuotaExceeded, "quota")),
            },
            Response {
                id: 4,
                result: Ok(Reply::Items(vec![Item {
                    key: Bytes::from_static(b"k"),
                    version: 3,
                    value: Bytes::from_static(b"v"),
                }])),
            },
            Response {
                id: 5,
                result: Ok(Reply::Page(Page {
                    items: vec![Item {
                        key: Bytes::from_static(b"k"),
                        version: 4,
                        value: Bytes::new(),
                    }],
                    resume_after: Some(Bytes::from_static(b"k")),
                    version_clock: 5,
                    pushed_bytes: 0,
                })),
            },
        ],
    });
    let fatal = Frame::Fatal(ErrorReply::new(ErrorCode::AuthFailed, "no"));
    let reqs = [requests(region_ops()), requests(object_ops())];

    let mut corpus: Vec<(&str, &str, Vec<u8>)> = vec![
        ("decode_frame", "hello", body_of(&hello)),
        (
            "decode_frame",
            "hello-ok",
            body_of(&Frame::HelloOk(HelloOk {
                version: 2,
                epoch: 3,
                fence_generation: 1,
            })),
        ),
        ("decode_frame", "regions", body_of(&reqs[0])),
        ("decode_frame", "objects", body_of(&reqs[1])),
        ("decode_frame", "responses", body_of(&responses)),
        ("decode_frame", "fatal", body_of(&fatal)),
    ];
    let stream: Vec<u8> = [
        frame_bytes(&hello),
        frame_bytes(&reqs[0]),
        frame_bytes(&reqs[1]),
    ]
    .concat();
    corpus.push(("frame_stream", "session", stream));
    corpus.push(("frame_stream", "responses", frame_bytes(&responses)));
    corpus.push(("exec_batch", "regions", frame_bytes(&reqs[0])));
    corpus.push((
        "exec_batch",
        "two-turns",
        [
            frame_bytes(&reqs[0]),
            frame_bytes(&reqs[0]),
            frame_bytes(&reqs[1]),
        ]
        .concat(),
    ));
    corpus.push((
        "exec_batch",
        "shared",
        frame_bytes(&requests(vec![
            Op::Alloc {
                size: 8192,
                name: Some("s".into()),
                mode: AccessMode::Shared,
            },
            Op::Write {
                region: 0,
                offset: 0,
                data: Bytes::from_static(b"x"),
            },
        ])),
    ));
    corpus.push((
        "resp_command",
        "strings",
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\nPING\r\n".to_vec(),
    ));
    corpus.push((
        "resp_command",
        "hashes",
        b"*4\r\n$4\r\nHSET\r\n$1\r\nh\r\n$1\r\nf\r\n$1\r\nv\r\n*3\r\n$4\r\nZADD\r\n$1\r\nz\r\n$1\r\n1\r\n*5\r\n$3\r\nSET\r\n$1\r\nx\r\n$1\r\ny\r\n$2\r\nPX\r\n$3\r\n100\r\n".to_vec(),
    ));
    corpus.push((
        "memcached_reply",
        "hit",
        b"VALUE k 0 5\r\nhello\r\nEND\r\n".to_vec(),
    ));
    corpus.push(("memcached_reply", "miss", b"END\r\n".to_vec()));
    corpus.push((
        "memcached_reply",
        "error",
        b"SERVER_ERROR out of memory\r\n".to_vec(),
    ));
    {
        use camelot_bench::hw::netctl::{encode, Message};
        corpus.push((
            "decode_netctl",
            "ready",
            encode(&Message::Ready { udp_port: 5001 }),
        ));
        corpus.push(("decode_netctl", "stop", encode(&Message::Stop)));
        corpus.push((
            "decode_netctl",
            "refused",
            encode(&Message::Refused("busy".into())),
        ));
    }
    {
        use camelot_rvm::record::{encode_catalog, encode_record, Catalog, LogOp, Record, SegMeta};
        let meta = SegMeta {
            seg: 1,
            len: 4096,
            addr: 0x7f00_0000_0000,
            tag: "balances".into(),
        };
        let rec = |seq, ops| encode_record(&Record { seq, ops }).to_vec();
        let r1 = rec(1, vec![LogOp::Alloc(meta.clone())]);
        let r2 = rec(
            2,
            vec![LogOp::Write {
                seg: 1,
                offset: 8,
                data: Bytes::from_static(b"42424242"),
            }],
        );
        let r3 = rec(3, vec![LogOp::Free { seg: 1 }]);
        corpus.push(("rvm_record", "alloc", r1.clone()));
        corpus.push(("rvm_record", "log", [r1, r2, r3].concat()));
        corpus.push((
            "rvm_record",
            "catalog",
            encode_catalog(&Catalog {
                applied_seq: 3,
                next_seg: 2,
                segs: vec![meta],
            })
            .to_vec(),
        ));
    }
    {
        use camelot_clover::layout::{encode_node, Geometry, NodeAddr};
        use camelot_clover::wire::{encode_answer, encode_hello, encode_request, Answer, Request};
        // Bodies, as the decoders see them (the 4-byte length prefix off).
        let body = |b: Bytes| b[4..].to_vec();
        let node = NodeAddr { block: 1, slot: 2 };
        corpus.push((
            "clover_wire",
            "hello",
            body(encode_hello(b"token").expect("hello")),
        ));
        corpus.push((
            "clover_wire",
            "key",
            body(encode_request(&Request::Key(b"user:1".to_vec())).expect("key")),
        ));
        corpus.push((
            "clover_wire",
            "give_back",
            body(encode_request(&Request::GiveBack(vec![node, node])).expect("give back")),
        ));
        corpus.push((
            "clover_wire",
            "granted",
            body(encode_answer(&Answer::Nodes(vec![node])).expect("nodes")),
        ));
        let g = Geometry::new(8, 64).expect("geometry");
        let data = Bytes::from_static(b"value!!!");
        corpus.push((
            "clover_wire",
            "node",
            encode_node(&g, node, 7 << 32 | 1, 3, Some(&data[..]), false)
                .expect("node")
                .to_vec(),
        ));
    }
    for (target, name, bytes) in corpus {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).expect("corpus dir");
        std::fs::write(dir.join(name), bytes).expect("seed");
    }
}
