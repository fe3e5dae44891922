//! What the Clover linearizability tests (clover, clover_meta, proxy) share: the memory
//! server they start, the values they write and each client's seeded stream of
//! operations, so a history from one file means the same as a history from another.
// Each test file is its own crate and uses only part of this.
#![allow(dead_code)]

use bytes::Bytes;
use camelot_check::{Op, Outcome};
use camelot_clover::{CloverError, Memory, Store};
use camelot_testkit::process::{Program, Readiness, ServerProcess};
use camelot_testkit::{CamelotServer, CamelotServerOptions};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;

/// Few keys, so that 32 clients contend on every one of them — but not so few that a
/// key's history has more overlapping operations than the checker can search within its
/// limits: with 4 keys, once Clover stopped queueing behind its metadata lock, one history
/// in three came back `Inconclusive` (memo limit) instead of a verdict.
pub const KEYS: u64 = 8;

/// A `camelot server` with 64 MiB, behind `token` if one is given.
pub fn memory_server(token: Option<&str>) -> CamelotServer {
    let mut args = vec!["--memory".into(), "64M".into()];
    if let Some(token) = token {
        args.extend(["--token".into(), token.into()]);
    }
    CamelotServer::start(
        Path::new(env!("CARGO_BIN_EXE_camelot")),
        &CamelotServerOptions { resp: false, args },
    )
    .expect("camelot server")
}

/// `camelot proxy run` in front of `upstream`, presenting `token`, with `flags`.
pub fn proxy_process(upstream: SocketAddr, token: &str, flags: &[&str]) -> ServerProcess {
    let mut extra: Vec<OsString> = vec!["--token".into(), token.into()];
    extra.extend(flags.iter().map(OsString::from));
    ServerProcess::start(
        Program {
            program: env!("CARGO_BIN_EXE_camelot").to_string().into(),
            package: "camelot".into(),
        },
        "camelot-proxy",
        Readiness::Accepting,
        move |port| {
            let mut args: Vec<OsString> = vec![
                "proxy".into(),
                "run".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}").into(),
                "--upstream".into(),
                upstream.to_string().into(),
            ];
            args.extend(extra.iter().cloned());
            args
        },
    )
    .expect("camelot proxy")
}

/// A register value as stored: 0 is "absent", which the checker's registers start as.
pub fn enc(v: u64) -> Option<Bytes> {
    (v != 0).then(|| Bytes::copy_from_slice(&v.to_le_bytes()))
}

pub fn dec(b: &Option<Bytes>) -> u64 {
    b.as_ref().map_or(0, |b| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[..8]);
        u64::from_le_bytes(w)
    })
}

/// One client's operations: 50% get, 30% put of a value nobody else writes, 20%
/// conditional put from the last value this client read for the key (so some of them
/// succeed), all drawn from a xorshift seeded by `seed` and the client's number.
pub struct Ops {
    client: u32,
    x: u64,
    seen: [u64; KEYS as usize],
}

impl Ops {
    pub fn new(seed: u64, client: u32) -> Ops {
        Ops {
            client,
            x: seed ^ u64::from(client),
            seen: [0; KEYS as usize],
        }
    }

    /// The `i`th operation: its key and what it does.
    pub fn next(&mut self, i: u32) -> (u64, Op) {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        let key = self.x % KEYS;
        let fresh = (u64::from(self.client) + 1) << 32 | u64::from(i + 1);
        let op = match (self.x >> 8) % 10 {
            0..=4 => Op::Read,
            5..=7 => Op::Write(fresh),
            _ => Op::Cas {
                expected: self.seen[key as usize],
                new: fresh,
            },
        };
        (key, op)
    }

    /// Runs `op` on `key` through `store`, remembering what a read saw.
    pub fn apply<M: Memory>(
        &mut self,
        store: &mut Store<M>,
        key: u64,
        op: Op,
    ) -> Result<Outcome, CloverError> {
        let kb = key.to_le_bytes();
        match op {
            Op::Read => store.get(&kb).map(|v| {
                self.seen[key as usize] = dec(&v);
                Outcome::Read(dec(&v))
            }),
            Op::Write(v) => store
                .put(&kb, enc(v).unwrap_or_default())
                .map(|_| Outcome::Written),
            Op::Cas { expected, new } => store
                .compare_and_put(&kb, enc(expected), enc(new))
                .map(|swapped| Outcome::Cas { swapped }),
        }
    }
}
