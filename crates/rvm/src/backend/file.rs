//! The file backend, for one machine: a log file, two catalog files and one home file per
//! segment in a directory. Every call fsyncs what it wrote before returning (and the
//! directory when it created or removed a file), so "committed" means fsync'd to the disk.
//! One writer at a time: an open takes `flock` on `DIR/lock` and holds it until dropped;
//! a second open (from any process) fails with [`RvmError::Fenced`].

use super::{Backend, HomeWrite};
use crate::error::{Result, RvmError};
use crate::limits::{FILE_LOG_BYTES_MAX, IO_CHUNK_BYTES};
use crate::record::{scan_stream, Record};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// How long an open waits for the directory's lock before it fails.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(500);
const LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(2);

pub struct FileBackend {
    dir: PathBuf,
    /// Held open for the `flock` on it.
    _lock: File,
    log: File,
    tail_bytes: Mutex<u64>,
    homes: Mutex<HashMap<u64, File>>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RvmError + '_ {
    move |source| RvmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl FileBackend {
    pub fn open(dir: &Path) -> Result<FileBackend> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let lock_path = dir.join("lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        // A lock released a moment ago can still be held for a moment: a child that a
        // thread of the last holder's process forked keeps the descriptor (and the lock)
        // until it execs. So a held lock is retried briefly before it counts as a live
        // second writer. (Seen in the 1000-kill crash run: 1 open in ~1000 refused.)
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        while !crate::mem::try_lock_exclusive(&lock).map_err(io(&lock_path))? {
            if std::time::Instant::now() >= deadline {
                return Err(RvmError::Fenced(format!(
                    "{} is locked by another open instance (flock on {}, held for {} ms)",
                    dir.display(),
                    lock_path.display(),
                    LOCK_WAIT.as_millis()
                )));
            }
            std::thread::sleep(LOCK_POLL);
        }
        let path = dir.join("log");
        let log = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io(&path))?;
        let b = FileBackend {
            dir: dir.to_path_buf(),
            _lock: lock,
            log,
            tail_bytes: Mutex::new(0),
            homes: Mutex::new(HashMap::new()),
        };
        b.sync_dir()?;
        Ok(b)
    }

    fn sync_dir(&self) -> Result<()> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&self.dir))
    }

    fn home_path(&self, seg: u64) -> PathBuf {
        self.dir.join(format!("seg-{seg}.home"))
    }

    fn with_home<T>(&self, seg: u64, f: impl FnOnce(&File, &Path) -> Result<T>) -> Result<T> {
        let path = self.home_path(seg);
        let mut homes = self.homes.lock();
        if let std::collections::hash_map::Entry::Vacant(slot) = homes.entry(seg) {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => {
                        RvmError::Corrupt(format!("segment {seg} has no home file"))
                    }
                    _ => io(&path)(e),
                })?;
            slot.insert(file);
        }
        match homes.get(&seg) {
            Some(file) => f(file, &path),
            None => Err(RvmError::Corrupt(format!("segment {seg} home vanished"))),
        }
    }
}

impl Backend for FileBackend {
    fn describe(&self) -> String {
        format!("file {}", self.dir.display())
    }

    fn append_log(&self, records: &[(u64, Bytes)]) -> Result<()> {
        let path = self.dir.join("log");
        let mut tail = self.tail_bytes.lock();
        let total: u64 = records.iter().map(|(_, b)| b.len() as u64).sum();
        if *tail + total > FILE_LOG_BYTES_MAX {
            return Err(RvmError::TooLarge {
                what: "file log bytes",
                got: *tail + total,
                max: FILE_LOG_BYTES_MAX,
            });
        }
        let mut at = *tail;
        for (_, b) in records {
            self.log.write_all_at(b, at).map_err(io(&path))?;
            at += b.len() as u64;
        }
        self.log.sync_data().map_err(io(&path))?;
        *tail = at;
        Ok(())
    }

    fn scan_log(&self, first_seq: u64) -> Result<Vec<Record>> {
        let path = self.dir.join("log");
        let len = self.log.metadata().map_err(io(&path))?.len();
        let (records, end) = scan_stream(len, first_seq, IO_CHUNK_BYTES, |off, n, buf| {
            let at = buf.len();
            buf.resize(at + n, 0);
            self.log
                .read_exact_at(&mut buf[at..], off)
                .map_err(io(&path))
        })?;
        *self.tail_bytes.lock() = end;
        Ok(records)
    }

    fn reset_log(&self, _next_seq: u64) -> Result<()> {
        let path = self.dir.join("log");
        let mut tail = self.tail_bytes.lock();
        self.log.set_len(0).map_err(io(&path))?;
        self.log.sync_all().map_err(io(&path))?;
        *tail = 0;
        Ok(())
    }

    fn log_capacity_bytes(&self) -> u64 {
        FILE_LOG_BYTES_MAX
    }

    fn read_catalog_slots(&self) -> Result<[Option<Bytes>; 2]> {
        let mut out = [None, None];
        for (i, slot) in out.iter_mut().enumerate() {
            let path = self.dir.join(format!("catalog.{i}"));
            match std::fs::read(&path) {
                Ok(b) => *slot = Some(Bytes::from(b)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(&path)(e)),
            }
        }
        Ok(out)
    }

    fn write_catalog_slot(&self, slot: usize, catalog: Bytes) -> Result<()> {
        let path = self.dir.join(format!("catalog.{slot}"));
        let existed = path.exists();
        // Truncating in place is safe: the other slot holds the previous catalog until
        // this one is whole and synced.
        let file = File::create(&path).map_err(io(&path))?;
        file.write_all_at(&catalog, 0).map_err(io(&path))?;
        file.sync_all().map_err(io(&path))?;
        if !existed {
            self.sync_dir()?;
        }
        Ok(())
    }

    fn create_home(&self, seg: u64, len: u64) -> Result<()> {
        let path = self.home_path(seg);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io(&path))?;
        file.set_len(len).map_err(io(&path))?;
        file.sync_all().map_err(io(&path))?;
        self.sync_dir()?;
        self.homes.lock().insert(seg, file);
        Ok(())
    }

    fn write_home(&self, writes: &[HomeWrite]) -> Result<()> {
        let mut touched = Vec::new();
        for w in writes {
            self.with_home(w.seg, |f, p| {
                f.write_all_at(&w.data, w.offset).map_err(io(p))
            })?;
            if !touched.contains(&w.seg) {
                touched.push(w.seg);
            }
        }
        for seg in touched {
            self.with_home(seg, |f, p| f.sync_data().map_err(io(p)))?;
        }
        Ok(())
    }

    fn read_home(&self, seg: u64, offset: u64, out: &mut [u8]) -> Result<()> {
        self.with_home(seg, |f, p| f.read_exact_at(out, offset).map_err(io(p)))
    }

    fn drop_home(&self, seg: u64, _len: u64) -> Result<()> {
        self.homes.lock().remove(&seg);
        let path = self.home_path(seg);
        match std::fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
    }
}
