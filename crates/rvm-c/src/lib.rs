//! The C API of `camelot-rvm` (see `include/rvm.h`). Handles are boxed Rust objects behind
//! opaque pointers; errors are kept per thread for `rvm_last_error`. All `unsafe` is in
//! [`ffi`]: turning C pointers into references and strings.

use camelot_rvm::{BackendConfig, Config, Rvm, RvmError, Segment, Txn};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};

/// The root pointer lives in a segment of its own.
const ROOT_TAG: &str = "__rvm_root";
const ROOT_BYTES: u64 = 8;

pub struct RvmCfg {
    rvm: Rvm,
}

pub struct RvmTxn {
    txn: Txn,
    root: Option<Segment>,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: impl std::fmt::Display) {
    // Interior NULs would cut the message; replace them rather than lose it.
    let text = msg.to_string().replace('\0', " ");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(text).unwrap_or_default());
}

fn open(backend: &str, name: &str, recover: bool) -> Result<RvmCfg, RvmError> {
    let mut cfg = Config::new(BackendConfig::parse(backend)?, name).recover(recover);
    cfg.fixed_addresses = true;
    let rvm = Rvm::open(cfg)?;
    if rvm.segment(ROOT_TAG).is_none() {
        rvm.alloc(ROOT_TAG, ROOT_BYTES)?;
    }
    Ok(RvmCfg { rvm })
}

mod ffi {
    use super::*;

    /// # Safety (for every helper below)
    /// C callers pass pointers that are null or point where the header says.
    unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str, RvmError> {
        if p.is_null() {
            return Err(RvmError::InvalidArgument(format!("{what} is NULL")));
        }
        // SAFETY: non-null, and rvm.h requires a NUL-terminated string that outlives the
        // call; we copy out of it before returning to C.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_str()
            .map_err(|_| RvmError::InvalidArgument(format!("{what} is not UTF-8")))
    }

    fn fail<T>(e: impl std::fmt::Display, v: T) -> T {
        set_error(e);
        v
    }

    #[no_mangle]
    pub extern "C" fn rvm_last_error() -> *const c_char {
        // The pointer stays valid until this thread's next failing call replaces it.
        LAST_ERROR.with(|e| e.borrow().as_ptr())
    }

    /// # Safety
    /// `backend` and `name` are NUL-terminated strings.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_cfg_create(
        backend: *const c_char,
        name: *const c_char,
        recover: c_int,
    ) -> *mut RvmCfg {
        // SAFETY: the header's contract for these arguments, as str_arg requires.
        let args =
            unsafe { str_arg(backend, "backend").and_then(|b| Ok((b, str_arg(name, "name")?))) };
        match args.and_then(|(b, n)| open(b, n, recover != 0)) {
            Ok(cfg) => Box::into_raw(Box::new(cfg)),
            Err(e) => fail(e, std::ptr::null_mut()),
        }
    }

    /// # Safety
    /// `cfg` is NULL or came from `rvm_cfg_create` and is not used afterwards.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_cfg_destroy(cfg: *mut RvmCfg) {
        if !cfg.is_null() {
            // SAFETY: cfg came from Box::into_raw in rvm_cfg_create and the caller gives
            // up every use of it with this call.
            drop(unsafe { Box::from_raw(cfg) });
        }
    }

    /// # Safety
    /// `cfg` is NULL or a live handle from `rvm_cfg_create`.
    unsafe fn cfg_ref<'a>(cfg: *mut RvmCfg) -> Result<&'a RvmCfg, RvmError> {
        // SAFETY: a live handle from rvm_cfg_create is a valid, aligned Box allocation;
        // we only take a shared reference (RvmCfg is Sync).
        unsafe { cfg.as_ref() }.ok_or_else(|| RvmError::InvalidArgument("cfg is NULL".into()))
    }

    /// # Safety
    /// `cfg` is a live handle; `tag` a NUL-terminated string.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_alloc(
        cfg: *mut RvmCfg,
        tag: *const c_char,
        bytes: usize,
    ) -> *mut c_void {
        // SAFETY: the header's contract for cfg and tag.
        let r = unsafe { cfg_ref(cfg).and_then(|c| Ok((c, str_arg(tag, "tag")?))) };
        match r.and_then(|(c, t)| c.rvm.alloc(t, bytes as u64)) {
            Ok(seg) => seg.as_mut_ptr().cast(),
            Err(e) => fail(e, std::ptr::null_mut()),
        }
    }

    /// # Safety
    /// `cfg` is a live handle; `tag` a NUL-terminated string.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_segment(cfg: *mut RvmCfg, tag: *const c_char) -> *mut c_void {
        // SAFETY: the header's contract for cfg and tag.
        let r = unsafe { cfg_ref(cfg).and_then(|c| Ok((c, str_arg(tag, "tag")?))) };
        match r {
            Ok((c, t)) => match c.rvm.segment(t) {
                Some(seg) => seg.as_mut_ptr().cast(),
                None => fail(RvmError::NoSuchTag(t.into()), std::ptr::null_mut()),
            },
            Err(e) => fail(e, std::ptr::null_mut()),
        }
    }

    /// # Safety
    /// `cfg` is a live handle, and outlives the transaction.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_txn_begin(cfg: *mut RvmCfg) -> *mut RvmTxn {
        // SAFETY: the header's contract for cfg.
        match unsafe { cfg_ref(cfg) } {
            Ok(c) => Box::into_raw(Box::new(RvmTxn {
                txn: c.rvm.begin(),
                root: c.rvm.segment(ROOT_TAG),
            })),
            Err(e) => fail(e, std::ptr::null_mut()),
        }
    }

    /// # Safety
    /// `txn` is NULL or a live handle from `rvm_txn_begin`.
    unsafe fn txn_mut<'a>(txn: *mut RvmTxn) -> Result<&'a mut RvmTxn, RvmError> {
        // SAFETY: a live handle is a valid Box allocation used by one thread at a time
        // (rvm.h: a transaction is not shared between threads).
        unsafe { txn.as_mut() }.ok_or_else(|| RvmError::InvalidArgument("txn is NULL".into()))
    }

    /// # Safety
    /// `txn` is NULL or a handle from `rvm_txn_begin`, not used after this call.
    unsafe fn txn_take(txn: *mut RvmTxn) -> Result<Box<RvmTxn>, RvmError> {
        if txn.is_null() {
            return Err(RvmError::InvalidArgument("txn is NULL".into()));
        }
        // SAFETY: from Box::into_raw in rvm_txn_begin; the caller gives it up here.
        Ok(unsafe { Box::from_raw(txn) })
    }

    fn find(t: &RvmTxn, addr: u64) -> Option<(Segment, u64)> {
        t.txn.segment_at(addr)
    }

    /// # Safety
    /// `txn` is a live handle.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_set_range(
        txn: *mut RvmTxn,
        addr: *mut c_void,
        len: usize,
    ) -> c_int {
        // SAFETY: the header's contract for txn.
        let r = unsafe { txn_mut(txn) }.and_then(|t| {
            let (seg, off) = match find(t, addr as u64) {
                Some(f) => f,
                None => {
                    return Err(RvmError::InvalidArgument(format!(
                        "{addr:p} is not inside a live segment"
                    )))
                }
            };
            t.txn.set_range(&seg, off, len as u64)
        });
        match r {
            Ok(()) => 0,
            Err(e) => fail(e, -1),
        }
    }

    /// # Safety
    /// `txn` is a live handle.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_free(txn: *mut RvmTxn, segment: *mut c_void) -> c_int {
        // SAFETY: the header's contract for txn.
        let r = unsafe { txn_mut(txn) }.and_then(|t| {
            let (seg, _) = find(t, segment as u64)
                .filter(|(_, off)| *off == 0)
                .ok_or_else(|| {
                    RvmError::InvalidArgument(format!("{segment:p} is not a segment"))
                })?;
            let tag = seg.tag().to_owned();
            t.txn.free(&tag)
        });
        match r {
            Ok(()) => 0,
            Err(e) => fail(e, -1),
        }
    }

    /// # Safety
    /// `txn` is a handle from `rvm_txn_begin`, not used after this call.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_txn_commit(txn: *mut RvmTxn) -> c_int {
        // SAFETY: the header's contract for txn.
        match unsafe { txn_take(txn) }.and_then(|t| t.txn.commit()) {
            Ok(()) => 0,
            Err(e) => fail(e, -1),
        }
    }

    /// # Safety
    /// `txn` is NULL or a handle from `rvm_txn_begin`, not used after this call.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_txn_abort(txn: *mut RvmTxn) {
        // SAFETY: the header's contract for txn.
        if let Ok(t) = unsafe { txn_take(txn) } {
            t.txn.abort();
        }
    }

    /// # Safety
    /// `txn` is a live handle.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_set_root(txn: *mut RvmTxn, root: *mut c_void) -> c_int {
        // SAFETY: the header's contract for txn.
        let r = unsafe { txn_mut(txn) }.and_then(|t| {
            let seg = t
                .root
                .clone()
                .ok_or_else(|| RvmError::NoSuchTag(ROOT_TAG.into()))?;
            t.txn.set_range(&seg, 0, ROOT_BYTES)?;
            t.txn.write_u64(&seg, 0, root as u64)
        });
        match r {
            Ok(()) => 0,
            Err(e) => fail(e, -1),
        }
    }

    /// # Safety
    /// `cfg` is a live handle.
    #[no_mangle]
    pub unsafe extern "C" fn rvm_get_root(cfg: *mut RvmCfg) -> *mut c_void {
        // SAFETY: the header's contract for cfg.
        let r = unsafe { cfg_ref(cfg) }.and_then(|c| {
            c.rvm
                .segment(ROOT_TAG)
                .ok_or_else(|| RvmError::NoSuchTag(ROOT_TAG.into()))?
                .read_u64(0)
        });
        match r {
            Ok(v) => v as usize as *mut c_void,
            Err(e) => fail(e, std::ptr::null_mut()),
        }
    }
}

pub use ffi::*;
