//! Whole frames on one interface (an `AF_PACKET` socket), for the delay/loss relay.
//!
//! The only `unsafe` of the crate: five libc calls with their arguments checked here.
//! Each socket asks for a virtio-net header before every frame (`PACKET_VNET_HDR`), so
//! a 64 KiB TCP segmentation-offload packet crossing a veth arrives as one frame with
//! its offload described, and is sent on as one: the relay never parses or segments
//! anything, and a frame longer than the MTU is not refused on the way out.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// From `linux/if_packet.h` (not every libc version exports them).
const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_OUTGOING: u8 = 4;
/// Largest frame read: a 64 KiB offload packet plus its Ethernet and virtio-net headers.
pub const FRAME_BYTES_MAX: usize = 65_536 + 64;

pub struct PacketSocket {
    fd: OwnedFd,
}

impl PacketSocket {
    /// A socket that receives every frame arriving on `ifname` and sends out of it.
    pub fn bind(ifname: &str) -> io::Result<PacketSocket> {
        let name = CString::new(ifname).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: `name` is a NUL-terminated string that outlives the call, which only
        // reads it.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(io::Error::last_os_error());
        }
        let protocol = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: a plain system call with constant arguments; the result is checked
        // before it is used.
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::c_int::from(protocol),
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor the kernel just returned to us and nothing else
        // holds; from here `fd` owns it and closes it exactly once.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let on: libc::c_int = 1;
        // SAFETY: `on` is a live c_int and the length passed is its size.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_VNET_HDR,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: sockaddr_ll is a C struct of integers and byte arrays, for which all
        // zero bytes is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = protocol;
        addr.sll_ifindex = ifindex as libc::c_int;
        // SAFETY: `addr` is a live sockaddr_ll and the length passed is its size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(PacketSocket { fd })
    }

    /// The next frame the interface received (frames it sent are skipped), with its
    /// virtio-net header, into `buf`; its length.
    pub fn recv_incoming(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: as in `bind`: all zero bytes is a valid sockaddr_ll.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut from_len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: `buf` is writable for `buf.len()` bytes, `from` and `from_len` are
            // live and `from_len` holds `from`'s size; the kernel writes within them.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    (&mut from as *mut libc::sockaddr_ll).cast(),
                    &mut from_len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if from.sll_pkttype == PACKET_OUTGOING {
                continue;
            }
            return Ok(n as usize);
        }
    }

    /// Sends one frame (with its virtio-net header, as `recv_incoming` gave it).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        loop {
            // SAFETY: `frame` is readable for `frame.len()` bytes; the kernel only reads.
            let n =
                unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
            if n >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}
