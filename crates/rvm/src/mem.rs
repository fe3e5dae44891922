//! Segment memory: page-aligned anonymous mappings, optionally at a given address.
//!
//! All of this crate's `unsafe` lives here. A [`Mapping`] owns its pages from `mmap` to
//! `munmap`; every access goes through bounds-checked copies. Safe Rust code reaches a
//! mapping only through `&mut` (segments keep it behind a mutex), so Rust callers never
//! race on its bytes; C callers of `rvm-c` write through the raw pointer and keep LRVM's
//! rule of declaring a range before writing it, from one thread per range.
//! [`try_lock_exclusive`] (the file backend's `flock`) is here for the same reason.

use crate::error::{Result, RvmError};
use std::ptr::NonNull;

pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is a uniquely owned heap-like allocation; nothing about it is tied to
// the thread that created it, and munmap may run on any thread.
unsafe impl Send for Mapping {}

fn round_to_pages(len: u64) -> Result<usize> {
    let page = crate::limits::PAGE_BYTES;
    let rounded = len
        .checked_add(page - 1)
        .map(|l| l / page * page)
        .filter(|l| *l > 0)
        .ok_or_else(|| RvmError::InvalidArgument(format!("cannot map {len} bytes")))?;
    usize::try_from(rounded).map_err(|_| RvmError::InvalidArgument(format!("{len} bytes")))
}

impl Mapping {
    /// Fresh zeroed pages wherever the kernel puts them.
    pub fn anywhere(len: u64) -> Result<Mapping> {
        let len = round_to_pages(len)?;
        // SAFETY: a private anonymous mapping with a null hint touches no existing memory;
        // the result is checked against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(RvmError::Map {
                len: len as u64,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).ok_or_else(|| RvmError::Map {
                len: len as u64,
                source: std::io::Error::other("mmap returned null"),
            })?,
            len,
        })
    }

    /// Fresh zeroed pages at exactly `addr`, or an error when any of that range is mapped.
    pub fn at(addr: u64, len: u64) -> Result<Mapping> {
        let len = round_to_pages(len)?;
        let taken = |reason: String| RvmError::AddressTaken {
            addr,
            len: len as u64,
            reason,
        };
        if addr == 0 || addr & (crate::limits::PAGE_BYTES - 1) != 0 {
            return Err(taken("the address is null or not page-aligned".into()));
        }
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping (the kernel fails
        // with EEXIST instead), so no memory anyone holds is touched. Kernels before 4.17
        // treat the address as a hint; the returned address is compared below and a
        // mapping elsewhere is unmapped again.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(taken(std::io::Error::last_os_error().to_string()));
        }
        let Some(ptr) = NonNull::new(p.cast::<u8>()) else {
            return Err(taken("mmap returned null".into()));
        };
        let mapping = Mapping { ptr, len };
        if p as u64 != addr {
            // Dropping unmaps the wrong-place mapping.
            drop(mapping);
            return Err(taken("the kernel placed the mapping elsewhere".into()));
        }
        Ok(mapping)
    }

    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The first byte, for C callers who write through it.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is ours and alive for as long as &mut self, which also
        // excludes every other Rust access to it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// See [`advise_huge_pages`]: for a mapping about to be written whole (recovery).
    pub fn advise_huge_pages(&mut self) {
        // SAFETY: the mapping is ours and alive for as long as &mut self; viewing
        // initialised bytes as MaybeUninit is always sound, and nothing is written.
        let region = unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().cast::<std::mem::MaybeUninit<u8>>(),
                self.len,
            )
        };
        advise_huge_pages(region);
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, n: usize) {
        assert!(
            offset.checked_add(n).is_some_and(|e| e <= self.len),
            "segment access {offset}+{n} outside {} bytes (callers check bounds first)",
            self.len
        );
    }

    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        // SAFETY: offset..offset+len is inside the mapping (checked above), the mapping is
        // alive while &self is, and `out` is a distinct Rust buffer so they cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }

    /// Appends `n` bytes from `offset` to `out`. Unlike zero-filling room in `out` and
    /// then [`Mapping::read`]ing into it, this writes the destination once: a commit
    /// record is built this way, and zeroing 40 MB first cost as much as the copy.
    pub fn append_to(&self, offset: usize, n: usize, out: &mut Vec<u8>) {
        self.check(offset, n);
        out.reserve(n);
        let at = out.len();
        // SAFETY: offset..offset+n is inside the mapping (checked above) and alive while
        // &self is; `reserve` made room for n more bytes in `out`, a distinct allocation,
        // so the regions cannot overlap; after the copy the n bytes past `at` are
        // initialised, which is what set_len requires.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr().add(at),
                n,
            );
            out.set_len(at + n);
        }
    }

    pub fn write(&mut self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: as in `read`; &mut self means no other Rust reference reads these bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
    }
}

/// Asks the kernel to back `region` with transparent huge pages where it can (the
/// 2 MiB-aligned parts of it): recovery writes every byte of a recovered segment and of
/// its log buffer, and faulting 40 MB in 4 KiB pages took ~10,000 faults per buffer,
/// two thirds of a 10,000-page recovery. Only a hint: regions under
/// [`HUGE_PAGE_ADVICE_BYTES_MIN`] and kernels without THP are left as they are.
pub fn advise_huge_pages(region: &mut [std::mem::MaybeUninit<u8>]) {
    if region.len() < HUGE_PAGE_ADVICE_BYTES_MIN {
        return;
    }
    let page = crate::limits::PAGE_BYTES as usize;
    let start = region.as_mut_ptr() as usize;
    let aligned = start.next_multiple_of(page);
    let end = (start + region.len()) / page * page;
    if end <= aligned {
        return;
    }
    // SAFETY: [aligned, end) lies inside `region`, memory we hold a unique reference to;
    // MADV_HUGEPAGE changes neither its contents nor its mapping, only how the kernel
    // backs pages not yet faulted in. Failure (no THP support) is harmless and ignored.
    unsafe {
        libc::madvise(
            aligned as *mut libc::c_void,
            end - aligned,
            libc::MADV_HUGEPAGE,
        );
    }
}

/// Smaller regions are not worth a huge page (one x86-64 huge page is 2 MiB).
pub const HUGE_PAGE_ADVICE_BYTES_MIN: usize = 2 << 20;

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned and nothing else unmaps them; no
        // reference into the pages outlives the Mapping (reads and writes copy).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Takes `flock(LOCK_EX | LOCK_NB)` on `file`: `Ok(false)` when another open file
/// description holds it. The lock lives as long as the descriptor (closing `file`, or the
/// process dying, releases it), so a crashed writer never leaves it held. std's
/// `File::try_lock` is newer than the workspace's minimum Rust.
pub fn try_lock_exclusive(file: &std::fs::File) -> std::io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock only reads its two integer arguments; the descriptor is valid for the
    // duration of the call because `file` is borrowed.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_zeroed_pages_and_reuses_an_address_only_when_free() {
        let mut m = Mapping::anywhere(5000).expect("map");
        assert_eq!(m.as_mut_slice().len(), 8192);
        let mut buf = [1u8; 16];
        m.read(8176, &mut buf);
        assert_eq!(buf, [0u8; 16]);
        m.write(100, b"abc");
        m.read(100, &mut buf[..3]);
        assert_eq!(&buf[..3], b"abc");
        let addr = m.addr();
        assert!(matches!(
            Mapping::at(addr, 4096),
            Err(RvmError::AddressTaken { .. })
        ));
        drop(m);
        let again = Mapping::at(addr, 8192).expect("free again after unmap");
        assert_eq!(again.addr(), addr);
        assert!(matches!(
            Mapping::at(addr + 1, 4096),
            Err(RvmError::AddressTaken { .. })
        ));
    }
}
