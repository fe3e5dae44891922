//! The writer the crash-consistency test kills: balanced transfers among accounts spread
//! over several segments, each transaction also bumping a sequence number, printing
//! `committed SEQ` after every commit that returned. Started again after every kill, it
//! recovers and carries on from where the last commit left things.
//!
//! Usage: rvm-crash-writer BACKEND NAME LOG_BYTES TRUNCATE_BYTES SEED

use camelot_rvm::{BackendConfig, Config, Rvm, Segment};
use rand::{Rng, SeedableRng};
use std::io::Write;

/// Layout shared with the test (tests/crash.rs): SEGMENTS segments of ACCOUNTS_PER_SEGMENT
/// 8-byte balances, ACCOUNT_STRIDE_BYTES apart so transfers touch several pages; the
/// sequence number is the first word of segment "meta".
const SEGMENTS: u64 = 4;
const ACCOUNTS_PER_SEGMENT: u64 = 64;
const ACCOUNT_STRIDE_BYTES: u64 = 200;
const INITIAL_BALANCE: u64 = 1000;
const TRANSFERS_PER_TXN_MAX: usize = 4;

fn main() {
    if let Err(e) = run() {
        eprintln!("rvm-crash-writer: {e}");
        std::process::exit(1);
    }
}

fn arg(args: &[String], i: usize, what: &str) -> Result<String, String> {
    args.get(i)
        .cloned()
        .ok_or_else(|| format!("missing argument {i}: {what}"))
}

fn num(s: &str, what: &str) -> Result<u64, String> {
    s.parse()
        .map_err(|_| format!("{what} must be a number, not {s:?}"))
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut backend =
        BackendConfig::parse(&arg(&args, 0, "backend")?).map_err(|e| e.to_string())?;
    let name = arg(&args, 1, "name")?;
    let log_bytes = num(&arg(&args, 2, "log bytes")?, "log bytes")?;
    let truncate = num(&arg(&args, 3, "truncate bytes")?, "truncate bytes")?;
    let seed = num(&arg(&args, 4, "seed")?, "seed")?;
    if let BackendConfig::Pool { log_bytes: l, .. } = &mut backend {
        *l = log_bytes;
    }
    let mut cfg = Config::new(backend, &name).recover(true);
    cfg.truncate_log_bytes = truncate;
    let rvm = Rvm::open(cfg).map_err(|e| format!("open: {e}"))?;
    let (accounts, meta) = match rvm.segment("meta") {
        Some(meta) => {
            let accounts = (0..SEGMENTS)
                .map(|i| {
                    rvm.segment(&format!("acct-{i}"))
                        .ok_or(format!("acct-{i} missing"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            (accounts, meta)
        }
        None => init(&rvm)?,
    };
    let mut seq = meta.read_u64(0).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {seq}").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    loop {
        let mut t = rvm.begin();
        for _ in 0..rng.gen_range(1..=TRANSFERS_PER_TXN_MAX) {
            let (sa, ia) = (
                rng.gen_range(0..SEGMENTS),
                rng.gen_range(0..ACCOUNTS_PER_SEGMENT),
            );
            let (sb, ib) = (
                rng.gen_range(0..SEGMENTS),
                rng.gen_range(0..ACCOUNTS_PER_SEGMENT),
            );
            let (a, b) = (&accounts[sa as usize], &accounts[sb as usize]);
            let (oa, ob) = (ia * ACCOUNT_STRIDE_BYTES, ib * ACCOUNT_STRIDE_BYTES);
            t.set_range(a, oa, 8).map_err(|e| e.to_string())?;
            t.set_range(b, ob, 8).map_err(|e| e.to_string())?;
            let from = a.read_u64(oa).map_err(|e| e.to_string())?;
            let amount = rng.gen_range(0..=from.min(100));
            t.write_u64(a, oa, from - amount)
                .map_err(|e| e.to_string())?;
            let to = b.read_u64(ob).map_err(|e| e.to_string())?;
            t.write_u64(b, ob, to + amount).map_err(|e| e.to_string())?;
        }
        seq += 1;
        t.set_range(&meta, 0, 8).map_err(|e| e.to_string())?;
        t.write_u64(&meta, 0, seq).map_err(|e| e.to_string())?;
        t.commit().map_err(|e| format!("commit {seq}: {e}"))?;
        writeln!(out, "committed {seq}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
}

fn init(rvm: &Rvm) -> Result<(Vec<Segment>, Segment), String> {
    let e = |e: camelot_rvm::RvmError| e.to_string();
    let accounts = (0..SEGMENTS)
        .map(|i| {
            rvm.alloc(
                &format!("acct-{i}"),
                ACCOUNTS_PER_SEGMENT * ACCOUNT_STRIDE_BYTES,
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(e)?;
    let mut t = rvm.begin();
    for a in &accounts {
        for i in 0..ACCOUNTS_PER_SEGMENT {
            t.set_range(a, i * ACCOUNT_STRIDE_BYTES, 8).map_err(e)?;
            t.write_u64(a, i * ACCOUNT_STRIDE_BYTES, INITIAL_BALANCE)
                .map_err(e)?;
        }
    }
    t.commit().map_err(e)?;
    // "meta" last: its presence means the accounts are initialised and committed.
    let meta = rvm.alloc("meta", 4096).map_err(e)?;
    Ok((accounts, meta))
}
