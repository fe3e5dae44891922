//! `camelot bench all`: every bench that exists, then the report, so one command
//! reproduces the whole evaluation. New benches join [`BENCHES`] and [`run`].

use crate::api::ApiConfig;
use crate::hw::{cpu::CpuConfig, disk::DiskConfig, mem::MemConfig, net::NetConfig};
use crate::threads::ThreadsConfig;
use crate::{report, BenchError};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The benches `all` runs, in order (the report comes last).
pub const BENCHES: [&str; 6] = ["cpu", "mem", "net", "disk", "threads", "api"];

/// Runs every bench into `out` (each scaled down when `quick`), then writes
/// `out/index.html`. `log` hears one line as each bench starts and ends.
pub fn run(out: &Path, quick: bool, mut log: impl FnMut(&str)) -> Result<Vec<PathBuf>, BenchError> {
    let mut written = Vec::new();
    let mut timed = |name: &str, f: &mut dyn FnMut() -> Result<Vec<PathBuf>, BenchError>| {
        log(&format!(
            "bench {name}: running{}",
            if quick { " (quick)" } else { "" }
        ));
        let t = Instant::now();
        let files = f()?;
        log(&format!(
            "bench {name}: done in {:.1} s",
            t.elapsed().as_secs_f64()
        ));
        written.extend(files);
        Ok::<_, BenchError>(())
    };
    // The machine's own limits first: the request API's figures are read against them.
    timed("cpu", &mut || {
        let mut cfg = CpuConfig::default();
        if quick {
            cfg.apply_quick();
        }
        crate::hw::cpu::run(&cfg, out)
    })?;
    timed("mem", &mut || {
        let mut cfg = MemConfig::default();
        if quick {
            cfg.apply_quick();
        }
        crate::hw::mem::run(&cfg, out)
    })?;
    timed("net", &mut || {
        let mut cfg = NetConfig::default();
        if quick {
            cfg.apply_quick();
        }
        crate::hw::net::run(&cfg, out)
    })?;
    timed("disk", &mut || {
        let mut cfg = DiskConfig::default();
        if quick {
            cfg.apply_quick();
        }
        crate::hw::disk::run(&cfg, out)
    })?;
    // The limits the hw benches just measured; the request API is read against them.
    let limits = crate::hw::limits::Limits::from_results(out)?;
    let limits_path = out.join(crate::hw::limits::LIMITS_FILE_NAME);
    timed("limits", &mut || {
        limits.save(&limits_path)?;
        Ok(vec![limits_path.clone()])
    })?;
    timed("threads", &mut || {
        let mut cfg = ThreadsConfig {
            modes: vec![true, false],
            limits: Some(limits.clone()),
            ..ThreadsConfig::default()
        };
        if quick {
            cfg.apply_quick();
        }
        crate::threads::run(&cfg, out)
    })?;
    timed("api", &mut || {
        let mut cfg = ApiConfig::default();
        if quick {
            cfg.apply_quick();
        }
        crate::api::run(&cfg, out).map(|(files, _table)| files)
    })?;
    written.push(report::write_report(out)?);
    Ok(written)
}
