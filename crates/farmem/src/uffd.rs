//! The crate's only `unsafe` code: an anonymous mapping, and the userfaultfd that serves
//! its page faults. Everything above it (the far region) is safe code deciding *which*
//! pages to install, write back and drop; this module only performs those steps.
//!
//! The kernel interface is declared here rather than taken from the `userfaultfd` crate:
//! that crate's `-sys` half generates its bindings with bindgen at build time, so every
//! machine building the workspace would need libclang, and its `copy` cannot install a
//! page write-protected in the same call (`UFFDIO_COPY_MODE_WP`), which is what makes
//! dirty tracking race-free (see [`Userfault::copy`]). The ABI below is the stable one
//! of `<linux/userfaultfd.h>`; the layouts are pinned by compile-time size checks and the
//! ioctl numbers by a test against the header's values.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

const UFFD_API: u64 = 0xAA;
const UFFDIO_TYPE: u64 = 0xAA;

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (UFFDIO_TYPE << 8) | nr
}
const IOC_NONE: u64 = 0;
const IOC_READ: u64 = 2;
const IOC_READ_WRITE: u64 = 3;

const USERFAULTFD_IOC_NEW: u64 = ioc(IOC_NONE, 0x00, 0);
const UFFDIO_API: u64 = ioc(IOC_READ_WRITE, 0x3F, size_of::<UffdioApi>());
const UFFDIO_REGISTER: u64 = ioc(IOC_READ_WRITE, 0x00, size_of::<UffdioRegister>());
const UFFDIO_WAKE: u64 = ioc(IOC_READ, 0x02, size_of::<UffdioRange>());
const UFFDIO_COPY: u64 = ioc(IOC_READ_WRITE, 0x03, size_of::<UffdioCopy>());
const UFFDIO_WRITEPROTECT: u64 = ioc(IOC_READ_WRITE, 0x06, size_of::<UffdioWriteprotect>());

const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
const UFFD_FEATURE_THREAD_ID: u64 = 1 << 8;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_COPY_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
const UFFD_PAGEFAULT_FLAG_WP: u64 = 1 << 1;
/// The range ioctls a registration must offer: wake, copy, write-protect.
const RANGE_IOCTLS_NEEDED: u64 = (1 << 0x02) | (1 << 0x03) | (1 << 0x06);

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}
/// `struct uffd_msg` with its union read as the page-fault member (the only event we
/// subscribe to): the kernel's struct is packed, but its natural layout has no padding.
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdMsg {
    event: u8,
    _reserved1: u8,
    _reserved2: u16,
    _reserved3: u32,
    flags: u64,
    address: u64,
    ptid: u32,
    _pad: u32,
}
const _: () = assert!(size_of::<UffdioApi>() == 24);
const _: () = assert!(size_of::<UffdioRegister>() == 32);
const _: () = assert!(size_of::<UffdioCopy>() == 40);
const _: () = assert!(size_of::<UffdioWriteprotect>() == 24);
const _: () = assert!(size_of::<UffdMsg>() == 32);

/// Fault messages read per `read(2)`.
pub(crate) const FAULTS_PER_READ_MAX: usize = 64;

/// One page fault on the mapping, as the kernel reported it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fault {
    /// Byte offset of the faulting (4 KiB-aligned) address from the mapping's start.
    pub offset: usize,
    /// The access was a write.
    pub write: bool,
    /// A write to a write-protected present page (not a missing page).
    pub write_protect: bool,
    /// The faulting thread.
    pub thread_id: u32,
}

/// Why a userfaultfd could not be had: the device's refusal and the system call's.
#[derive(Debug)]
pub(crate) struct OpenFailure {
    /// Opening `/dev/userfaultfd`, when it was tried and failed.
    pub device: Option<io::Error>,
    /// The `userfaultfd(2)` system call's failure.
    pub syscall: io::Error,
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

/// A userfaultfd (non-blocking, close-on-exec) with write-protect faults and the
/// faulting thread's id in every message.
pub(crate) struct Userfault {
    fd: OwnedFd,
}

impl Userfault {
    pub fn open() -> Result<Userfault, OpenFailure> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // /dev/userfaultfd (Linux 6.1+) is governed by its file mode; the system call by
        // vm.unprivileged_userfaultfd and CAP_SYS_PTRACE. Either will do.
        let device = match std::fs::File::options()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")
        {
            Ok(dev) => {
                // SAFETY: USERFAULTFD_IOC_NEW takes its flags by value and returns a new
                // descriptor or -1; `dev` is an open descriptor for the call's duration.
                let fd = unsafe {
                    libc::ioctl(
                        dev.as_raw_fd(),
                        USERFAULTFD_IOC_NEW as _,
                        flags as libc::c_int,
                    )
                };
                if fd >= 0 {
                    // SAFETY: the ioctl returned a fresh descriptor that nothing else owns.
                    return Ok(Userfault {
                        fd: unsafe { OwnedFd::from_raw_fd(fd) },
                    });
                }
                Some(last_error())
            }
            Err(e) => Some(e),
        };
        // SAFETY: userfaultfd(2) takes its flags by value and returns a descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd < 0 {
            return Err(OpenFailure {
                device,
                syscall: last_error(),
            });
        }
        // SAFETY: the system call returned a fresh descriptor that nothing else owns (a
        // descriptor number always fits in an int).
        Ok(Userfault {
            fd: unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) },
        })
    }

    /// The API handshake: asks for write-protect fault flags and thread ids.
    pub fn handshake(&self) -> io::Result<()> {
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_THREAD_ID,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes exactly one `struct uffdio_api`, which
        // `api` is (layout checked above), alive for the call.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_API as _, &mut api) } < 0 {
            return Err(last_error());
        }
        Ok(())
    }

    /// Registers the whole mapping for missing-page and write-protect faults.
    pub fn register(&self, map: &Mapping) -> io::Result<()> {
        let mut register = UffdioRegister {
            range: map.range(0, map.len),
            mode: UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one `struct uffdio_register`; the
        // range is our own live mapping.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER as _, &mut register) } < 0 {
            return Err(last_error());
        }
        if register.ioctls & RANGE_IOCTLS_NEEDED != RANGE_IOCTLS_NEEDED {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "the kernel offers range ioctls {:#x} on this mapping; copy, wake and \
                     write-protect are needed",
                    register.ioctls
                ),
            ));
        }
        Ok(())
    }

    /// Installs `src` at `offset` (whole pages, not yet present) and wakes the threads
    /// waiting on them. With `write_protect` the pages arrive write-protected in the same
    /// step, so no write can slip in unnoticed between the install and the protection:
    /// a clean page is exactly one that is present and protected. Returns false when a
    /// page was already present (a second fault on a page served meanwhile).
    pub fn copy(
        &self,
        map: &Mapping,
        offset: usize,
        src: &[u8],
        write_protect: bool,
    ) -> io::Result<bool> {
        map.check(offset, src.len())?;
        let mut copy = UffdioCopy {
            dst: map.addr() as u64 + offset as u64,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: if write_protect {
                UFFDIO_COPY_MODE_WP
            } else {
                0
            },
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads `src.len()` bytes from `src` (a live borrowed slice)
        // and fills the destination range, which `check` placed inside our registered
        // mapping; the kernel refuses (EEXIST) to overwrite a present page, so no byte
        // the program can see is changed — pages only come into existence.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_COPY as _, &mut copy) };
        if r < 0 {
            let e = last_error();
            if e.raw_os_error() == Some(libc::EEXIST) {
                self.wake(map, offset, src.len())?;
                return Ok(false);
            }
            return Err(e);
        }
        Ok(true)
    }

    /// Write-protects present pages (`protect`), or lifts the protection and wakes the
    /// threads waiting to write them.
    pub fn write_protect(
        &self,
        map: &Mapping,
        offset: usize,
        len: usize,
        protect: bool,
    ) -> io::Result<()> {
        map.check(offset, len)?;
        let mut wp = UffdioWriteprotect {
            range: map.range(offset, len),
            mode: if protect {
                UFFDIO_WRITEPROTECT_MODE_WP
            } else {
                0
            },
        };
        // SAFETY: UFFDIO_WRITEPROTECT reads one `struct uffdio_writeprotect` (and writes
        // nothing back); the range is inside our mapping. It changes page permissions
        // only, never contents.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT as _, &mut wp) } < 0 {
            return Err(last_error());
        }
        Ok(())
    }

    /// Wakes threads waiting on a range (to retry their access).
    pub fn wake(&self, map: &Mapping, offset: usize, len: usize) -> io::Result<()> {
        map.check(offset, len)?;
        let mut range = map.range(offset, len);
        // SAFETY: UFFDIO_WAKE reads one `struct uffdio_range` inside our mapping.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE as _, &mut range) } < 0 {
            return Err(last_error());
        }
        Ok(())
    }

    /// Waits until a fault is pending (true) or `stop` is signalled (false).
    pub fn wait(&self, stop: &Stop) -> io::Result<bool> {
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop.fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: poll(2) reads and writes the two `pollfd`s of a live array.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            if r < 0 {
                let e = last_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if fds[1].revents != 0 {
                return Ok(false);
            }
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                return Err(io::Error::other("the userfaultfd reported an error"));
            }
            if fds[0].revents != 0 {
                return Ok(true);
            }
        }
    }

    /// Appends the page faults pending (at most `max`, itself at most
    /// [`FAULTS_PER_READ_MAX`]) to `out`, offsets relative to `map`; other events are not
    /// subscribed to and are skipped. Several threads may read at once: the kernel hands
    /// each message to one reader.
    pub fn read_faults(&self, map: &Mapping, out: &mut Vec<Fault>, max: usize) -> io::Result<()> {
        let max = max.clamp(1, FAULTS_PER_READ_MAX);
        let mut msgs = [UffdMsg {
            event: 0,
            _reserved1: 0,
            _reserved2: 0,
            _reserved3: 0,
            flags: 0,
            address: 0,
            ptid: 0,
            _pad: 0,
        }; FAULTS_PER_READ_MAX];
        // SAFETY: read(2) writes at most `max` messages' bytes (≤ the array's size) into
        // it, and every bit pattern is a valid `UffdMsg` (plain integers).
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                msgs.as_mut_ptr().cast(),
                max * size_of::<UffdMsg>(),
            )
        };
        if n < 0 {
            let e = last_error();
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) {
                return Ok(());
            }
            return Err(e);
        }
        let count = n as usize / size_of::<UffdMsg>();
        let base = map.addr() as u64;
        for m in &msgs[..count] {
            if m.event != UFFD_EVENT_PAGEFAULT {
                continue;
            }
            let offset = m.address.wrapping_sub(base);
            if offset >= map.len as u64 {
                continue;
            }
            out.push(Fault {
                offset: offset as usize,
                write: m.flags & UFFD_PAGEFAULT_FLAG_WRITE != 0,
                write_protect: m.flags & UFFD_PAGEFAULT_FLAG_WP != 0,
                thread_id: m.ptid,
            });
        }
        Ok(())
    }
}

/// Sends SIGBUS to one thread of this process: what a thread blocked on a page that can
/// no longer be served gets, as it would from a failed swap-in.
pub(crate) fn sigbus_thread(thread_id: u32) {
    // SAFETY: getpid and tgkill take integers only; a thread id that has exited makes
    // tgkill fail with ESRCH, which leaves nothing to do.
    unsafe {
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            thread_id as libc::pid_t,
            libc::SIGBUS,
        );
    }
}

/// An eventfd the owner signals to stop the fault handler's wait.
pub(crate) struct Stop {
    fd: OwnedFd,
}

impl Stop {
    pub fn new() -> io::Result<Stop> {
        // SAFETY: eventfd(2) takes integers and returns a fresh descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(last_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Stop {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn signal(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of a live u64, as an eventfd requires.
        let n = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&one as *const u64).cast(),
                size_of::<u64>(),
            )
        };
        if n < 0 {
            return Err(last_error());
        }
        Ok(())
    }
}

/// A private anonymous mapping, unmapped on drop.
pub(crate) struct Mapping {
    addr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; the pointer is not tied to a
// thread. `Mapping` itself reads the bytes only in `copy_out` (see there); the program's
// access goes through the one [`Program`] made with it, whose borrows the type system
// checks.
unsafe impl Send for Mapping {}
// SAFETY: as for Send; `&Mapping` gives no mutable access to the bytes.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A mapping of `len` bytes, shared (for the fault handler) and the program's one
    /// handle on its bytes.
    pub fn new(len: usize) -> io::Result<(Arc<Mapping>, Program)> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an empty mapping",
            ));
        }
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing
        // aliases nothing; the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_error());
        }
        let Some(addr) = NonNull::new(p.cast::<u8>()) else {
            return Err(io::Error::other("mmap returned address 0"));
        };
        let map = Mapping { addr, len };
        // Huge pages would be filled whole by the kernel's own fault path, behind our
        // back; every page of this mapping must come through the handler.
        // SAFETY: madvise on our own mapping changes no contents.
        unsafe { libc::madvise(p, len, libc::MADV_NOHUGEPAGE) };
        let map = Arc::new(map);
        Ok((map.clone(), Program { map }))
    }

    pub fn addr(&self) -> *mut u8 {
        self.addr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    fn range(&self, offset: usize, len: usize) -> UffdioRange {
        UffdioRange {
            start: self.addr() as u64 + offset as u64,
            len: len as u64,
        }
    }

    fn check(&self, offset: usize, len: usize) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end)
                if end <= self.len && offset.is_multiple_of(4096) && len.is_multiple_of(4096) =>
            {
                Ok(())
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{len} bytes at {offset}: not whole pages inside a {} B mapping",
                    self.len
                ),
            )),
        }
    }

    /// Drops pages (MADV_DONTNEED): their next access is a missing-page fault again.
    pub fn discard(&self, offset: usize, len: usize) -> io::Result<()> {
        self.check(offset, len)?;
        // SAFETY: the range is inside our mapping. Discarding changes what a later read
        // sees only in the way this type's contract allows: the region logic discards a
        // page only after its bytes are safe in the store, and re-installs those same
        // bytes on the next fault.
        let r = unsafe { libc::madvise(self.addr().add(offset).cast(), len, libc::MADV_DONTNEED) };
        if r < 0 {
            return Err(last_error());
        }
        Ok(())
    }

    /// Write-protects present pages and copies them into `out`, for writing back. The
    /// caller names only pages it installed and has not discarded: reading a missing one
    /// would fault into the very handler that is reading it and never return.
    pub fn copy_out(&self, uffd: &Userfault, offset: usize, out: &mut [u8]) -> io::Result<()> {
        self.check(offset, out.len())?;
        uffd.write_protect(self, offset, out.len(), true)?;
        // SAFETY: the source range is inside our live mapping and does not overlap `out`
        // (a heap buffer). The program may hold a borrow of these bytes, but after the
        // write-protect above no thread can store to them until the handler lifts it
        // (a store faults and waits), so this read races with no write: it sees the
        // bytes as the program last left them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.addr().add(offset), out.as_mut_ptr(), out.len());
        }
        Ok(())
    }
}

/// The program's handle on a mapping's bytes: made once with the mapping and not
/// cloneable, so its `&`/`&mut` borrows are the only ones safe code can hold.
pub(crate) struct Program {
    map: Arc<Mapping>,
}

impl Program {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes from `addr` are one live mapping for as long as the `Arc`
        // this value holds. Its contents change under the program only by pages coming
        // into existence with the bytes they hold in the store (a page is discarded only
        // after its bytes were written back), so every read sees what the memory holds.
        // No `&mut` to them exists while this `&` does (`bytes_mut` takes `&mut self`).
        unsafe { std::slice::from_raw_parts(self.map.addr(), self.map.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`; `&mut self` on the only `Program` of this mapping makes
        // this the only borrow of the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.map.addr(), self.map.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this value owns; no borrow of it outlives
        // `self`.
        unsafe { libc::munmap(self.addr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values `<linux/userfaultfd.h>` gives on x86-64 and aarch64.
    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(USERFAULTFD_IOC_NEW, 0xaa00);
    }
}
