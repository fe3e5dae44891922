//! The C API of `camelot-farmem` (see `include/farmem.h`): a [`FarRegion`] over a region
//! on one memory server, handed to C as a plain pointer. The handle is a boxed Rust
//! object behind an opaque pointer; errors are kept per thread for `farmem_last_error`.
//! All `unsafe` is in [`ffi`]: turning C pointers into references and strings.
//!
//! It is a crate of its own rather than a module of `camelot-farmem` because it must be
//! built as a `cdylib`/`staticlib` — which every crate depending on `camelot-farmem`
//! would otherwise pay for — and because the C contract (NULL/-1 returns, a per-thread
//! error string) has no place in the Rust API; `camelot-rvm-c` is split the same way.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::net::{SocketAddr, ToSocketAddrs};

use camelot_client::{Client, ClientConfig, ClusterMap};
use camelot_farmem::{CacheConfig, Error, FarRegion, RegionStore};

/// The region's page size: the mapping's (4 KiB), so every fault moves one page.
const PAGE_BYTES: usize = 4096;
/// Largest region `farmem_open` maps (the address space it reserves, not memory).
pub const REGION_BYTES_MAX: u64 = 1 << 40;
const POLICY_DEFAULT: &str = "clock";
const PREFETCH_DEFAULT: &str = "sequential";

pub struct FarmemRegion {
    region: FarRegion<RegionStore>,
    /// The first byte, taken once at open: C owns every access to the bytes from then on.
    addr: *mut u8,
}

/// Stats in the layout of `farmem_stats_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FarmemStats {
    pub missing_faults: u64,
    pub write_faults: u64,
    pub prefetched: u64,
    pub evictions: u64,
    pub written_back: u64,
    pub read_bytes: u64,
    pub written_bytes: u64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: impl std::fmt::Display) {
    // Interior NULs would cut the message; replace them rather than lose it.
    let text = msg.to_string().replace('\0', " ");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(text).unwrap_or_default());
}

/// The arguments of `farmem_open`, checked: whole pages, within the limits.
#[derive(Debug, Clone)]
pub struct OpenArgs {
    pub server: SocketAddr,
    pub token: Option<Vec<u8>>,
    pub pages: u64,
    pub config: CacheConfig,
}

fn resolve(server: &str) -> Result<SocketAddr, Error> {
    server
        .to_socket_addrs()
        .map_err(|e| Error::Invalid(format!("server {server:?}: {e} (HOST:PORT expected)")))?
        .next()
        .ok_or_else(|| Error::Invalid(format!("server {server:?} resolves to no address")))
}

/// Checks `farmem_open`'s arguments without touching the network or the kernel.
pub fn open_args(
    server: &str,
    token: Option<&str>,
    bytes: u64,
    local_bytes: u64,
    policy: Option<&str>,
    prefetch: Option<&str>,
) -> Result<OpenArgs, Error> {
    if bytes == 0 || bytes > REGION_BYTES_MAX {
        return Err(Error::Invalid(format!(
            "a region of {bytes} B: 1 B to {REGION_BYTES_MAX} B"
        )));
    }
    if local_bytes < PAGE_BYTES as u64 {
        return Err(Error::Invalid(format!(
            "local memory of {local_bytes} B holds no {PAGE_BYTES} B page"
        )));
    }
    let policy = policy.unwrap_or(POLICY_DEFAULT);
    let prefetch = prefetch.unwrap_or(PREFETCH_DEFAULT);
    if !camelot_farmem::POLICY_NAMES.contains(&policy) {
        return Err(Error::Invalid(format!(
            "policy {policy:?}: one of {:?}",
            camelot_farmem::POLICY_NAMES
        )));
    }
    if !camelot_farmem::PREFETCHER_NAMES.contains(&prefetch) {
        return Err(Error::Invalid(format!(
            "prefetch {prefetch:?}: one of {:?}",
            camelot_farmem::PREFETCHER_NAMES
        )));
    }
    let mut config = CacheConfig::new(local_bytes);
    config.policy = policy.into();
    config.prefetch = prefetch.into();
    Ok(OpenArgs {
        server: resolve(server)?,
        token: token.map(|t| t.as_bytes().to_vec()),
        pages: bytes.div_ceil(PAGE_BYTES as u64),
        config,
    })
}

fn open(args: OpenArgs) -> Result<FarmemRegion, Error> {
    let client = Client::connect(
        ClusterMap::from_addrs(&[args.server]),
        ClientConfig {
            token: args.token,
            ..ClientConfig::default()
        },
    )?;
    let store = RegionStore::alloc(client, args.pages, PAGE_BYTES, None)?;
    let mut region = FarRegion::new(store, &args.config)?;
    let addr = region.bytes_mut().as_mut_ptr();
    Ok(FarmemRegion { region, addr })
}

fn stats(r: &FarmemRegion) -> FarmemStats {
    let s = r.region.stats();
    let (read_bytes, written_bytes) = r.region.traffic_bytes();
    FarmemStats {
        missing_faults: s.missing_faults,
        write_faults: s.write_faults,
        prefetched: s.prefetched,
        evictions: s.evictions,
        written_back: s.written_back,
        read_bytes,
        written_bytes,
    }
}

fn close(r: FarmemRegion) -> Result<(), Error> {
    let failure = r.region.failure();
    // No flush: the pages are freed with the region, so writing them back is wasted.
    let store = r.region.into_store_discarding()?;
    let freed = store.free();
    match failure {
        Some(why) => Err(Error::RegionFailed(why)),
        None => freed,
    }
}

mod ffi {
    use super::*;

    /// # Safety
    /// `p` is NULL or a NUL-terminated string that outlives the call.
    unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Error> {
        if p.is_null() {
            return Ok(None);
        }
        // SAFETY: non-null, and farmem.h requires a NUL-terminated string that outlives
        // the call; we copy out of it before returning to C.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_str()
            .map(Some)
            .map_err(|_| Error::Invalid(format!("{what} is not UTF-8")))
    }

    fn fail<T>(e: impl std::fmt::Display, v: T) -> T {
        set_error(e);
        v
    }

    /// # Safety
    /// `region` is NULL or a live handle from `farmem_open`.
    unsafe fn region_ref<'a>(region: *mut FarmemRegion) -> Result<&'a FarmemRegion, Error> {
        // SAFETY: a live handle is a valid, aligned Box allocation from farmem_open; we
        // take a shared reference only (every method used through it takes &self).
        unsafe { region.as_ref() }.ok_or_else(|| Error::Invalid("region is NULL".into()))
    }

    #[no_mangle]
    pub extern "C" fn farmem_last_error() -> *const c_char {
        // The pointer stays valid until this thread's next failing call replaces it.
        LAST_ERROR.with(|e| e.borrow().as_ptr())
    }

    /// # Safety
    /// `server` is a NUL-terminated string; `token`, `policy`, `prefetch` are NULL or
    /// NUL-terminated strings.
    #[no_mangle]
    pub unsafe extern "C" fn farmem_open(
        server: *const c_char,
        token: *const c_char,
        bytes: usize,
        local_bytes: usize,
        policy: *const c_char,
        prefetch: *const c_char,
    ) -> *mut FarmemRegion {
        // SAFETY: the header's contract for these arguments, as opt_str requires.
        let strings = unsafe {
            (|| {
                let server = opt_str(server, "server")?
                    .ok_or_else(|| Error::Invalid("server is NULL".into()))?;
                Ok::<_, Error>((
                    server,
                    opt_str(token, "token")?,
                    opt_str(policy, "policy")?,
                    opt_str(prefetch, "prefetch")?,
                ))
            })()
        };
        let opened = strings.and_then(|(server, token, policy, prefetch)| {
            open(open_args(
                server,
                token,
                bytes as u64,
                local_bytes as u64,
                policy,
                prefetch,
            )?)
        });
        match opened {
            Ok(r) => Box::into_raw(Box::new(r)),
            Err(e) => fail(e, std::ptr::null_mut()),
        }
    }

    /// # Safety
    /// `region` is NULL or a live handle.
    #[no_mangle]
    pub unsafe extern "C" fn farmem_addr(region: *mut FarmemRegion) -> *mut c_void {
        // SAFETY: the header's contract for region.
        match unsafe { region_ref(region) } {
            Ok(r) => r.addr.cast(),
            Err(e) => fail(e, std::ptr::null_mut()),
        }
    }

    /// # Safety
    /// `region` is NULL or a live handle.
    #[no_mangle]
    pub unsafe extern "C" fn farmem_len(region: *mut FarmemRegion) -> usize {
        // SAFETY: the header's contract for region.
        match unsafe { region_ref(region) } {
            Ok(r) => r.region.len(),
            Err(e) => fail(e, 0),
        }
    }

    /// # Safety
    /// `region` is NULL or a live handle.
    #[no_mangle]
    pub unsafe extern "C" fn farmem_flush(region: *mut FarmemRegion) -> c_int {
        // SAFETY: the header's contract for region.
        match unsafe { region_ref(region) }.and_then(|r| r.region.flush()) {
            Ok(()) => 0,
            Err(e) => fail(e, -1),
        }
    }

    /// # Safety
    /// `region` is NULL or a live handle; `out` is NULL or points at a writable
    /// `farmem_stats_t`.
    #[no_mangle]
    pub unsafe extern "C" fn farmem_stats(
        region: *mut FarmemRegion,
        out: *mut FarmemStats,
    ) -> c_int {
        // SAFETY: the header's contract for region.
        let r = match unsafe { region_ref(region) } {
            Ok(r) => r,
            Err(e) => return fail(e, -1),
        };
        // SAFETY: NULL or a valid, aligned farmem_stats_t (whose layout FarmemStats is,
        // repr(C) with the same seven u64 fields) that the caller lets us write.
        match unsafe { out.as_mut() } {
            Some(out) => {
                *out = stats(r);
                0
            }
            None => fail(Error::Invalid("out is NULL".into()), -1),
        }
    }

    /// # Safety
    /// `region` is NULL or a handle from `farmem_open`, and neither it nor any byte of
    /// the region is used after this call.
    #[no_mangle]
    pub unsafe extern "C" fn farmem_close(region: *mut FarmemRegion) -> c_int {
        if region.is_null() {
            return fail(Error::Invalid("region is NULL".into()), -1);
        }
        // SAFETY: from Box::into_raw in farmem_open; the caller gives it up here.
        let r = unsafe { Box::from_raw(region) };
        match close(*r) {
            Ok(()) => 0,
            Err(e) => fail(e, -1),
        }
    }
}

pub use ffi::*;

#[cfg(test)]
mod tests {
    use super::*;

    fn args(bytes: u64, local: u64, policy: Option<&str>) -> Result<OpenArgs, Error> {
        open_args("127.0.0.1:7000", None, bytes, local, policy, None)
    }

    #[test]
    fn arguments_are_checked_before_anything_opens() {
        let a = args(10_000, 8192, None).expect("valid");
        assert_eq!(a.pages, 3, "rounded up to whole pages");
        assert_eq!(a.config.policy, POLICY_DEFAULT);
        assert_eq!(a.config.prefetch, PREFETCH_DEFAULT);
        assert_eq!(a.config.local_bytes_max, 8192);
        assert!(args(0, 8192, None).is_err());
        assert!(args(REGION_BYTES_MAX + 1, 8192, None).is_err());
        assert!(args(4096, 4095, None).is_err());
        assert!(args(4096, 4096, Some("mru")).is_err());
        assert!(open_args("127.0.0.1:7000", None, 4096, 4096, None, Some("x")).is_err());
        assert!(open_args("no port", None, 4096, 4096, None, None).is_err());
        let t = open_args("127.0.0.1:1", Some("s3cret"), 4096, 4096, Some("arc"), None);
        assert_eq!(t.expect("valid").token.as_deref(), Some(&b"s3cret"[..]));
    }

    #[test]
    fn null_arguments_are_errors_with_a_message() {
        // SAFETY: NULLs are allowed by the header for every argument checked here.
        unsafe {
            let r = farmem_open(
                std::ptr::null(),
                std::ptr::null(),
                4096,
                4096,
                std::ptr::null(),
                std::ptr::null(),
            );
            assert!(r.is_null());
            let msg = std::ffi::CStr::from_ptr(farmem_last_error());
            assert_eq!(msg.to_str().expect("utf-8"), "server is NULL");
            assert_eq!(farmem_close(std::ptr::null_mut()), -1);
            assert_eq!(farmem_len(std::ptr::null_mut()), 0);
            assert!(farmem_addr(std::ptr::null_mut()).is_null());
        }
    }
}
