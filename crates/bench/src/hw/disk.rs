//! `camelot bench hw disk`: seed 003's disk experiments. Sequential and random writes and
//! reads at block sizes from 4 KiB to 1 MiB, one thread and N threads, on files under
//! `--dir`; O_DIRECT where the filesystem allows it (recorded when it does not), and a
//! mode that fsyncs after every write. Every read checks the block it got.

use super::{default_threads, run_together, validate_threads};
use crate::progress::Progress;
use crate::BenchError;
use camelot_results::output;
use camelot_results::plot::{series_points, Figure, Panel};
use camelot_results::schema::{now_rfc3339, BenchResult, Point, Series};
use serde_json::json;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// O_DIRECT wants buffers, offsets and lengths aligned to the device's logical block;
/// 4 KiB covers every device we run on.
const DIRECT_ALIGN: usize = 4096;
pub const BLOCK_BYTES_MIN: usize = DIRECT_ALIGN;
pub const BLOCK_BYTES_MAX: usize = 64 << 20;
pub const FILE_BYTES_MAX: u64 = 64 << 30;
/// Writes that lay a file out before the timed passes: large enough that laying out the
/// full 256 MiB takes a fraction of a second.
const LAYOUT_BLOCK_BYTES: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub block_sizes_bytes: Vec<usize>,
    pub threads: Vec<usize>,
    /// Bytes of file per thread count, split evenly between the threads.
    pub file_bytes: u64,
    /// Most time one operation at one block size may take; it stops early past this.
    pub seconds_per_point: f64,
    /// Try O_DIRECT (bypass the page cache).
    pub direct: bool,
    pub quick: bool,
}

impl Default for DiskConfig {
    fn default() -> Self {
        DiskConfig {
            dir: std::env::temp_dir(),
            block_sizes_bytes: vec![4 << 10, 64 << 10, 1 << 20],
            threads: default_threads(),
            file_bytes: 256 << 20,
            seconds_per_point: 3.0,
            direct: true,
            quick: false,
        }
    }
}

impl DiskConfig {
    pub fn apply_quick(&mut self) {
        self.quick = true;
        self.file_bytes = self.file_bytes.min(32 << 20);
        self.seconds_per_point = self.seconds_per_point.min(0.5);
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        validate_threads(&self.threads)?;
        if self.block_sizes_bytes.is_empty()
            || self
                .block_sizes_bytes
                .iter()
                .any(|b| *b < BLOCK_BYTES_MIN || *b > BLOCK_BYTES_MAX || b % DIRECT_ALIGN != 0)
        {
            return bad(format!(
                "block sizes must be multiples of {DIRECT_ALIGN} B between \
                 {BLOCK_BYTES_MIN} and {BLOCK_BYTES_MAX}"
            ));
        }
        if self.file_bytes == 0 || self.file_bytes > FILE_BYTES_MAX {
            return bad(format!("file size must be 1..={FILE_BYTES_MAX} bytes"));
        }
        let most_threads = self.threads.iter().copied().max().unwrap_or(1) as u64;
        let largest = self.block_sizes_bytes.iter().copied().max().unwrap_or(0) as u64;
        if self.file_bytes / most_threads < largest {
            return bad(format!(
                "{} bytes of file give each of {most_threads} threads less than one \
                 {largest}-byte block",
                self.file_bytes
            ));
        }
        if !(self.seconds_per_point.is_finite() && self.seconds_per_point > 0.0) {
            return bad("seconds per point must be positive".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    SeqWrite,
    RandWrite,
    SeqRead,
    RandRead,
    SeqWriteFsync,
}

impl Op {
    const ALL: [Op; 5] = [
        Op::SeqWrite,
        Op::RandWrite,
        Op::SeqRead,
        Op::RandRead,
        Op::SeqWriteFsync,
    ];
    fn label(self) -> &'static str {
        match self {
            Op::SeqWrite => "seq write",
            Op::RandWrite => "random write",
            Op::SeqRead => "seq read",
            Op::RandRead => "random read",
            Op::SeqWriteFsync => "seq write + fsync",
        }
    }
    fn writes(self) -> bool {
        !matches!(self, Op::SeqRead | Op::RandRead)
    }
}

/// The files of one run; removed when dropped, also on error.
struct Files {
    paths: Vec<PathBuf>,
}

impl Drop for Files {
    fn drop(&mut self) {
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn open(path: &Path, direct: bool) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Whether O_DIRECT works in `dir` (tmpfs, for one, refuses it).
fn direct_works(dir: &Path) -> bool {
    let probe = dir.join(format!("camelot-disk-probe-{}", std::process::id()));
    let ok = open(&probe, true)
        .and_then(|f| {
            let mut buf = vec![0u8; 2 * DIRECT_ALIGN];
            let at = buf.as_ptr().align_offset(DIRECT_ALIGN);
            f.write_at(&buf[at..at + DIRECT_ALIGN], 0)?;
            f.read_at(&mut buf[at..at + DIRECT_ALIGN], 0).map(|_| ())
        })
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// A block-aligned buffer without `unsafe`: a larger vector and the aligned window in it.
struct Aligned {
    storage: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    /// Filled with pseudo-random bytes, as fio fills its buffers. Writing every byte also
    /// gives every page of the buffer its own frame: an untouched buffer maps the shared
    /// zero page, whose 256 repeats in a 1 MiB O_DIRECT write cannot merge into fewer
    /// than 256 segments, so the block layer split each write in two on this VM's
    /// virtio disk (254 segments at most; /proc/diskstats counted 64–70 requests per 32
    /// writes against 32 with a written buffer). Done here, before any timing starts.
    fn new(len: usize) -> Aligned {
        let mut storage = vec![0u8; len + DIRECT_ALIGN];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for chunk in storage.chunks_mut(8) {
            let word = random_index(&mut state, u64::MAX).to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
        let at = storage.as_ptr().align_offset(DIRECT_ALIGN);
        Aligned { storage, at, len }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self) -> &[u8] {
        &self.storage[self.at..self.at + self.len]
    }
    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.at..self.at + self.len]
    }
}

/// Stamps block `index` into the buffer so a read can tell which block it got.
fn stamp(buf: &mut [u8], index: u64) {
    buf[..8].copy_from_slice(&index.to_le_bytes());
    let n = buf.len();
    buf[n - 8..].copy_from_slice(&(!index).to_le_bytes());
}

fn stamped(buf: &[u8]) -> (u64, u64) {
    let n = buf.len();
    let head = u64::from_le_bytes(buf[..8].try_into().unwrap_or([0; 8]));
    let tail = u64::from_le_bytes(buf[n - 8..].try_into().unwrap_or([0; 8]));
    (head, !tail)
}

/// A deterministic permutation-free random block order (xorshift over block indices).
fn random_index(state: &mut u64, blocks: u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state % blocks
}

struct Done {
    ops: u64,
    bytes: u64,
}

/// One thread's pass: `blocks` blocks of `buf.len()` bytes. The caller allocates `buf`
/// (see `Aligned::new`) so that its cost stays outside the timed region.
fn one_thread(
    file: &File,
    op: Op,
    buf: &mut Aligned,
    blocks: u64,
    seed: u64,
    deadline: Instant,
) -> Result<Done, String> {
    let block = buf.len();
    let mut rng = seed | 1;
    let mut ops = 0u64;
    for i in 0..blocks {
        if Instant::now() >= deadline && ops > 0 {
            break;
        }
        let index = match op {
            Op::RandWrite | Op::RandRead => random_index(&mut rng, blocks),
            _ => i,
        };
        let offset = index * block as u64;
        if op.writes() {
            stamp(buf.get_mut(), index);
            file.write_at(buf.get(), offset)
                .map_err(|e| format!("write at {offset}: {e}"))?;
            if op == Op::SeqWriteFsync {
                file.sync_data().map_err(|e| format!("fsync: {e}"))?;
            }
        } else {
            let n = file
                .read_at(buf.get_mut(), offset)
                .map_err(|e| format!("read at {offset}: {e}"))?;
            let (head, tail) = stamped(buf.get());
            if n != block || head != index || tail != index {
                return Err(format!(
                    "block {index} read back as {head}/{tail} ({n} bytes)"
                ));
            }
        }
        ops += 1;
    }
    if op.writes() && op != Op::SeqWriteFsync {
        // Buffered writes are not done until they reach the device.
        file.sync_data().map_err(|e| format!("fsync: {e}"))?;
    }
    Ok(Done {
        ops,
        bytes: ops * block as u64,
    })
}

/// Writes the first `bytes` of `file` once and syncs them, untimed. A fresh file's first
/// writes also allocate blocks and extend the file (journalled metadata; about 0.6× the
/// bandwidth of an overwrite on this VM, see BENCHMARKS.md); after this every timed write
/// overwrites written blocks, as fio's write job does after it lays out its file, and a
/// point no longer depends on which pass or block size happened to run first.
fn lay_out(file: &File, bytes: u64) -> Result<(), String> {
    let mut buf = Aligned::new(LAYOUT_BLOCK_BYTES);
    let mut offset = 0u64;
    while offset < bytes {
        let len = (bytes - offset).min(LAYOUT_BLOCK_BYTES as u64) as usize;
        stamp(buf.get_mut(), offset / LAYOUT_BLOCK_BYTES as u64);
        file.write_all_at(&buf.get()[..len], offset)
            .map_err(|e| format!("lay out at {offset}: {e}"))?;
        offset += len as u64;
    }
    file.sync_data().map_err(|e| format!("fsync: {e}"))
}

pub fn run(cfg: &DiskConfig, out: &Path) -> Result<Vec<PathBuf>, BenchError> {
    cfg.validate()?;
    std::fs::create_dir_all(&cfg.dir).map_err(|source| BenchError::Io {
        path: cfg.dir.clone(),
        source,
    })?;
    let started = now_rfc3339();
    let direct = cfg.direct && direct_works(&cfg.dir);
    let run_time = Duration::from_secs_f64(cfg.seconds_per_point);
    let steps = cfg.threads.len() * cfg.block_sizes_bytes.len() * Op::ALL.len();
    let progress = Progress::new(steps as u64, "disk");
    let mut series = Vec::new();
    for &threads in &cfg.threads {
        let per_thread = cfg.file_bytes / threads as u64;
        let files = Files {
            paths: (0..threads)
                .map(|t| {
                    cfg.dir
                        .join(format!("camelot-disk-{}-{t}.dat", std::process::id()))
                })
                .collect(),
        };
        let handles = files
            .paths
            .iter()
            .map(|p| {
                open(p, direct).map_err(|source| BenchError::Io {
                    path: p.clone(),
                    source,
                })
            })
            .collect::<Result<Vec<File>, _>>()?;
        // Every pass's blocks lie below this: block sizes are multiples of DIRECT_ALIGN.
        let laid_out_bytes = per_thread - per_thread % DIRECT_ALIGN as u64;
        for f in &handles {
            lay_out(f, laid_out_bytes).map_err(BenchError::Check)?;
        }
        for op in Op::ALL {
            let mut s = Series::new(format!("{} ×{threads}", op.label()));
            for &block in &cfg.block_sizes_bytes {
                progress.set_message(&format!("{} ×{threads}, {block} B", op.label()));
                let blocks = per_thread / block as u64;
                let mut bufs: Vec<Aligned> = handles.iter().map(|_| Aligned::new(block)).collect();
                if !op.writes() {
                    // Reads check stamps: lay the blocks down at this size first.
                    for (f, buf) in handles.iter().zip(&mut bufs) {
                        one_thread(f, Op::SeqWrite, buf, blocks, 0, far_future())
                            .map_err(BenchError::Check)?;
                    }
                }
                let inputs: Vec<(usize, (&File, Aligned))> =
                    handles.iter().zip(bufs).enumerate().collect();
                let together = run_together(inputs, |(t, (f, mut buf)), start| {
                    one_thread(f, op, &mut buf, blocks, t as u64 + 7, start + run_time)
                })?;
                let done = together
                    .outputs
                    .into_iter()
                    .collect::<Result<Vec<Done>, String>>()
                    .map_err(|e| BenchError::Check(format!("{} {block} B: {e}", op.label())))?;
                let secs = together.wall.as_secs_f64().max(1e-9);
                let mut p = Point::new(block);
                p.bytes_per_sec = Some(done.iter().map(|d| d.bytes).sum::<u64>() as f64 / secs);
                p.ops_per_sec = Some(done.iter().map(|d| d.ops).sum::<u64>() as f64 / secs);
                p.extra.insert("seconds".into(), json!(secs));
                s.points.push(p);
                progress.inc(1);
            }
            series.push(s);
        }
        drop(handles);
        drop(files);
    }
    progress.finish();
    let config = json!({
        "x": "block bytes",
        "dir": cfg.dir.display().to_string(),
        "block_sizes_bytes": cfg.block_sizes_bytes,
        "threads": cfg.threads,
        "file_bytes": cfg.file_bytes,
        "seconds_per_point": cfg.seconds_per_point,
        "direct_requested": cfg.direct,
        "direct": direct,
        "direct_note": if cfg.direct && !direct {
            "the filesystem refused O_DIRECT; buffered I/O through the page cache (reads may be served from memory)"
        } else if direct { "O_DIRECT: the page cache is bypassed" } else { "buffered I/O by request" },
        "quick": cfg.quick,
        "layout": "each file is written whole (1 MiB writes, then fdatasync) before the timed \
                   passes, so every timed write overwrites written blocks",
    });
    let result = BenchResult::new("disk", started, config, series);
    Ok(output::write_result_with_figure(
        out,
        &result,
        &figure(&result),
    )?)
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

/// The seed's two figures: disk write and disk read, MB/s against block size.
fn figure(result: &BenchResult) -> Figure {
    let mut write = Panel::new("disk write", "block (bytes)", "MB/s")
        .log_x()
        .log_y();
    let mut read = Panel::new("disk read", "block (bytes)", "MB/s")
        .log_x()
        .log_y();
    for s in &result.series {
        let pts = series_points(s, |p| p.bytes_per_sec.map(|b| b / 1e6));
        if s.label.contains("write") {
            write = write.line(&s.label, pts);
        } else {
            read = read.line(&s.label, pts);
        }
    }
    Figure::new("Disk").panel(write).panel(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configurations_are_refused() {
        let ok = DiskConfig::default();
        assert!(ok.validate().is_ok());
        for c in [
            DiskConfig {
                block_sizes_bytes: vec![512],
                ..ok.clone()
            },
            DiskConfig {
                block_sizes_bytes: vec![4096 + 1],
                ..ok.clone()
            },
            DiskConfig {
                file_bytes: 4096,
                ..ok.clone()
            },
            DiskConfig {
                threads: vec![0],
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(c.validate(), Err(BenchError::InvalidConfig(_))),
                "{c:?}"
            );
        }
    }

    #[test]
    fn stamps_identify_blocks() {
        let mut b = vec![0u8; 4096];
        stamp(&mut b, 42);
        assert_eq!(stamped(&b), (42, 42));
        let mut state = 9;
        for _ in 0..1000 {
            assert!(random_index(&mut state, 17) < 17);
        }
    }

    #[test]
    fn buffers_hold_data_in_every_page() {
        // An all-zero page would be the untouched zero page the buffer exists to avoid.
        let b = Aligned::new(1 << 20);
        assert_eq!(b.get().as_ptr().align_offset(DIRECT_ALIGN), 0);
        for page in b.get().chunks(4096) {
            assert!(page.iter().any(|&x| x != 0));
        }
    }

    #[test]
    fn lay_out_writes_the_whole_range_with_a_partial_last_write() {
        let base = crate::scratch_dir("disk-layout");
        std::fs::create_dir_all(&base).expect("scratch dir");
        let path = base.join("f.dat");
        let bytes = 2 * LAYOUT_BLOCK_BYTES as u64 + 3 * DIRECT_ALIGN as u64;
        let f = open(&path, direct_works(&base)).expect("open");
        lay_out(&f, bytes).expect("lay out");
        assert_eq!(f.metadata().expect("metadata").len(), bytes);
        drop(f);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_tiny_run_measures_every_operation_and_cleans_up() {
        let base = crate::scratch_dir("disk");
        let cfg = DiskConfig {
            dir: base.join("data"),
            block_sizes_bytes: vec![4096, 64 << 10],
            threads: vec![1, 2],
            file_bytes: 1 << 20,
            seconds_per_point: 0.05,
            direct: true,
            quick: true,
        };
        let out = base.join("out");
        run(&cfg, &out).expect("disk bench");
        let r = output::read_result(&out.join("disk.json")).expect("read back");
        assert_eq!(r.series.len(), 10);
        for s in &r.series {
            assert_eq!(s.points.len(), 2, "{}", s.label);
            for p in &s.points {
                for v in [p.bytes_per_sec, p.ops_per_sec] {
                    let v = v.expect("measured");
                    assert!(v.is_finite() && v > 0.0, "{}: {v}", s.label);
                }
            }
        }
        let left: Vec<_> = std::fs::read_dir(&cfg.dir)
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "files left behind: {left:?}");
        let _ = std::fs::remove_dir_all(&base);
    }
}
