//! The writer the crash-consistency test kills: balanced transfers among accounts spread
//! over several segments, each transaction also bumping a sequence number, printing
//! `committed SEQ` after every commit that returned. Started again after every kill, it
//! recovers and carries on from where the last commit left things.
//!
//! Usage: rvm-crash-writer BACKEND NAME LOG_BYTES TRUNCATE_BYTES SEED
//!        rvm-crash-writer lazy BACKEND NAME LOG_BYTES flush|noflush|commit
//!        rvm-crash-writer fence BACKEND NAME LOG_BYTES
//!
//! The `fence` form (see [`fence`]) commits, then stops itself with SIGSTOP in the middle
//! of a truncation, for a test to take the instance over before it is continued.
//!
//! The `lazy` form makes lazy commits (see [`lazy`]), prints `parked` and waits to be
//! SIGKILLed, so that only what reached the backend survives: Rvm's drop, which would
//! flush, never runs.
//!
//! With `RVM_CRASH_WRITER_PAUSE=recovery` (or `=truncation`) the transfer writer prints
//! `paused in recovery` (`paused in truncation`) when its recovery has read the log (when
//! a truncation is about to write the homes) and waits there to be SIGKILLed: the crash
//! test forces some of its kills into those two phases instead of hoping the random
//! moment falls there.
//!
//! With `RVM_CRASH_WRITER_ACK_EARLY=1` the transfer loop reports each commit *before*
//! making it (a deliberately broken writer): the crash tests use it to show their checker
//! catches an acknowledged commit that is not there.

#![forbid(unsafe_code)]

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
    match args.first().map(String::as_str) {
        Some("lazy") => return lazy(&args[1..]),
        Some("fence") => return fence(&args[1..]),
        _ => {}
    }
    let ack_early = std::env::var("RVM_CRASH_WRITER_ACK_EARLY").is_ok_and(|v| v == "1");
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
    match std::env::var("RVM_CRASH_WRITER_PAUSE").as_deref() {
        Ok("recovery") => cfg.hooks.during_recovery = Some(pause_hook("recovery")),
        Ok("truncation") => cfg.hooks.during_truncation = Some(pause_hook("truncation")),
        Ok(other) => {
            return Err(format!(
                "RVM_CRASH_WRITER_PAUSE={other:?}: recovery|truncation"
            ))
        }
        Err(_) => {}
    }
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
    say(&format!("ready {seq}"))?;
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
        if ack_early {
            say(&format!("committed {seq}"))?;
            // Lazy: a kill from here on loses a commit that was reported.
            t.commit_lazy().map_err(|e| format!("commit {seq}: {e}"))?;
            continue;
        }
        t.commit().map_err(|e| format!("commit {seq}: {e}"))?;
        say(&format!("committed {seq}"))?;
    }
}

/// One line to stdout, flushed. Stdout is locked for that line only: a pause hook on the
/// truncator thread must be able to speak while this thread waits for the log.
fn say(line: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())
}

/// A hook that says `paused in PHASE` and never returns: the thread that reached the
/// phase waits there for the test's SIGKILL.
fn pause_hook(phase: &'static str) -> std::sync::Arc<dyn Fn() + Send + Sync> {
    std::sync::Arc::new(move || {
        let _ = say(&format!("paused in {phase}"));
        loop {
            std::thread::park();
        }
    })
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

/// Offsets in segment "lazy" of the `lazy` mode's values.
const LAZY_FLUSHED_OFFSET: u64 = 0;
const LAZY_FLUSHED_TOO_OFFSET: u64 = 8;
const LAZY_NEVER_FLUSHED_OFFSET: u64 = 16;
const LAZY_BEFORE_COMMIT_OFFSET: u64 = 24;
const LAZY_COMMITTED_OFFSET: u64 = 32;

/// `flush`: lazy commits of 1..=10 at 0 and 77 at 8, `flush`, a lazy 99 at 16.
/// `noflush`: the same without the flush. `commit` (after `flush`): a lazy 55 at 24, then
/// a plain commit of 88 at 32, which carries the lazy one with it.
fn lazy(args: &[String]) -> Result<(), String> {
    let e = |e: camelot_rvm::RvmError| e.to_string();
    let mut backend = BackendConfig::parse(&arg(args, 0, "backend")?).map_err(|e| e.to_string())?;
    let name = arg(args, 1, "name")?;
    let log_bytes = num(&arg(args, 2, "log bytes")?, "log bytes")?;
    let phase = arg(args, 3, "flush|noflush|commit")?;
    if let BackendConfig::Pool { log_bytes: l, .. } = &mut backend {
        *l = log_bytes;
    }
    let lazy_write = |rvm: &Rvm, s: &Segment, off: u64, v: u64| {
        let mut t = rvm.begin();
        t.set_range(s, off, 8)?;
        t.write_u64(s, off, v)?;
        t.commit_lazy()
    };
    let rvm = Rvm::open(Config::new(backend, &name).recover(phase == "commit")).map_err(e)?;
    match phase.as_str() {
        "flush" | "noflush" => {
            let s = rvm.alloc("lazy", 4096).map_err(e)?;
            for n in 1..=10 {
                lazy_write(&rvm, &s, LAZY_FLUSHED_OFFSET, n).map_err(e)?;
            }
            lazy_write(&rvm, &s, LAZY_FLUSHED_TOO_OFFSET, 77).map_err(e)?;
            if phase == "flush" {
                rvm.flush().map_err(e)?;
            }
            lazy_write(&rvm, &s, LAZY_NEVER_FLUSHED_OFFSET, 99).map_err(e)?;
        }
        "commit" => {
            let s = rvm.segment("lazy").ok_or("segment lazy missing")?;
            lazy_write(&rvm, &s, LAZY_BEFORE_COMMIT_OFFSET, 55).map_err(e)?;
            let mut t = rvm.begin();
            t.set_range(&s, LAZY_COMMITTED_OFFSET, 8).map_err(e)?;
            t.write_u64(&s, LAZY_COMMITTED_OFFSET, 88).map_err(e)?;
            t.commit().map_err(e)?;
        }
        other => return Err(format!("unknown lazy phase {other:?}")),
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "parked").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    // Killed here; `rvm` is never dropped.
    loop {
        std::thread::park();
    }
}

/// Offsets in segment "fence" of the `fence` mode's value.
const FENCE_VALUE_OFFSET: u64 = 0;
const FENCE_FIRST_VALUE: u64 = 111;
const FENCE_LATE_VALUE: u64 = 333;

/// Commits 111 at offset 0 of a new segment "fence", prints `committed`, then truncates the
/// log; the pool backend's hook before the home writes prints `paused` and stops this
/// process (SIGSTOP, sent by `kill`: std has no raise). Once continued, it prints
/// `truncate: ok` or `truncate: ERROR`, then tries to commit 333 and prints `commit: ok` or
/// `commit: ERROR`, and exits.
fn fence(args: &[String]) -> Result<(), String> {
    let e = |e: camelot_rvm::RvmError| e.to_string();
    let mut backend = BackendConfig::parse(&arg(args, 0, "backend")?).map_err(|e| e.to_string())?;
    let name = arg(args, 1, "name")?;
    let log_bytes = num(&arg(args, 2, "log bytes")?, "log bytes")?;
    if let BackendConfig::Pool { log_bytes: l, .. } = &mut backend {
        *l = log_bytes;
    }
    let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut cfg = Config::new(backend, &name);
    cfg.background_truncation = false;
    cfg.truncate_log_bytes = log_bytes;
    let hook_armed = std::sync::Arc::clone(&armed);
    cfg.hooks.before_home_writes = Some(std::sync::Arc::new(move || {
        if !hook_armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "paused");
        let _ = out.flush();
        drop(out);
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &std::process::id().to_string()])
            .status();
        if !stopped.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("rvm-crash-writer: could not stop itself: {stopped:?}");
            std::process::exit(2);
        }
    }));
    let rvm = Rvm::open(cfg).map_err(e)?;
    let s = rvm.alloc("fence", 4096).map_err(e)?;
    let commit = |v: u64| {
        let mut t = rvm.begin();
        t.set_range(&s, FENCE_VALUE_OFFSET, 8)?;
        t.write_u64(&s, FENCE_VALUE_OFFSET, v)?;
        t.commit()
    };
    commit(FENCE_FIRST_VALUE).map_err(e)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "committed").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let truncated = rvm.truncate();
    let committed = commit(FENCE_LATE_VALUE);
    let mut out = std::io::stdout().lock();
    let show = |r: Result<(), camelot_rvm::RvmError>| match r {
        Ok(()) => "ok".to_owned(),
        Err(e) => e.to_string(),
    };
    writeln!(out, "truncate: {}", show(truncated)).map_err(|e| e.to_string())?;
    writeln!(out, "commit: {}", show(committed)).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    // Not dropped: Rvm's drop would try more writes, and this test is about the two above.
    std::mem::forget(rvm);
    Ok(())
}
