//! The writer the write-hole test kills: opens a volume (which resyncs whatever the last
//! killed writer left marked) and writes random ranges — small ones inside a chunk, and
//! large ones across many stripes — forever, printing `wrote N` after each write that
//! returned.
//!
//! Usage: volume-crash-writer ADDR NAME SEED [--no-intent]

#![forbid(unsafe_code)]

use camelot_blocks::{Volume, VolumeConfig};
use rand::{Rng, SeedableRng};
use std::io::Write;

fn main() {
    if let Err(e) = run() {
        eprintln!("volume-crash-writer: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let addr = args
        .first()
        .ok_or("missing ADDR")?
        .parse()
        .map_err(|e| format!("ADDR: {e}"))?;
    let name = args.get(1).ok_or("missing NAME")?;
    let seed: u64 = args
        .get(2)
        .ok_or("missing SEED")?
        .parse()
        .map_err(|e| format!("SEED: {e}"))?;
    let config = VolumeConfig {
        write_intent: !args.iter().any(|a| a == "--no-intent"),
        ..VolumeConfig::default()
    };
    let (vol, _) = Volume::open(addr, name, &config).map_err(|e| e.to_string())?;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let cap = vol.capacity_bytes();
    let mut out = std::io::stdout().lock();
    writeln!(out, "open").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    for n in 0u64.. {
        let len = if rng.gen_bool(0.5) {
            rng.gen_range(1..8192)
        } else {
            rng.gen_range(64 << 10..256 << 10)
        }
        .min(cap);
        let off = rng.gen_range(0..=cap - len);
        let byte: u8 = rng.gen();
        let data = vec![byte; len as usize];
        vol.write(off, &data).map_err(|e| e.to_string())?;
        writeln!(out, "wrote {n}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    Ok(())
}
