//! `rbr_mr`: memory regions.

use std::ffi::c_void;
use std::sync::Arc;

use crate::ffi::ctx::rbr_ctx;
use crate::ffi::error::{RBR_OK, fail, rbr_status};
use crate::ffi::{arg_ref, ffi_body, ffi_body_or, out_ptr};
use crate::{Access, MemoryRegion};

/// A memory region. Create with `rbr_mr_register` or `rbr_mr_alloc`, free with
/// `rbr_mr_destroy`. Thread-safe. Work requests posted with it keep it alive until they
/// complete: destroying the handle early never frees memory the library still uses.
pub struct rbr_mr {
    pub(crate) inner: Arc<MemoryRegion>,
}

/// Access: the library may write into the region (needed to receive into it).
pub const RBR_ACCESS_LOCAL_WRITE: u32 = 1;
/// Access: the peer may write into it with one-sided operations.
pub const RBR_ACCESS_REMOTE_WRITE: u32 = 2;
/// Access: the peer may read it with one-sided operations.
pub const RBR_ACCESS_REMOTE_READ: u32 = 4;
/// Access: the peer may run atomics on it.
pub const RBR_ACCESS_REMOTE_ATOMIC: u32 = 8;

fn finish(r: crate::Result<Arc<MemoryRegion>>, out: *mut *mut rbr_mr) -> rbr_status {
    match r {
        Ok(inner) => {
            // SAFETY: `out` was checked non-NULL by the caller of `finish` and is writable.
            unsafe { out.write(Box::into_raw(Box::new(rbr_mr { inner }))) };
            RBR_OK
        }
        Err(e) => fail(e),
    }
}

/// Registers caller memory `addr[0..len]` with `access` (`RBR_ACCESS_*`) into `*out`.
/// The memory stays the caller's: it must remain valid until the region is destroyed and
/// every work request posted with it has completed. `access` 0 is allowed and enough to send
/// from; receiving into a region needs RBR_ACCESS_LOCAL_WRITE. RBR_ERR_INVALID: `len` 0, a
/// range that wraps past the end of the address space, an unknown access bit, or
/// RBR_ACCESS_REMOTE_WRITE or RBR_ACCESS_REMOTE_ATOMIC without RBR_ACCESS_LOCAL_WRITE. The region belongs to `ctx`: only connections of
/// that context may post it. Over verbs the region is registered with a device when a
/// connection on that device first posts it, not here; a memory-lock limit too low for it
/// (RLIMIT_MEMLOCK, `ulimit -l`) then fails that post with RBR_ERR_NO_MEMORY, and
/// `rbr_last_error` names the limit.
///
/// # Safety
/// `ctx` live; `addr` valid for `len` bytes as above; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_mr_register(
    ctx: *mut rbr_ctx,
    addr: *mut c_void,
    len: usize,
    access: u32,
    out: *mut *mut rbr_mr,
) -> rbr_status {
    ffi_body!({
        let ctx = arg_ref!(ctx);
        let out = out_ptr!(out);
        if addr.is_null() {
            return crate::ffi::error::null_arg("addr");
        }
        // SAFETY: the caller's contract above is exactly register_mr's.
        finish(
            unsafe { ctx.inner.register_mr(addr.cast(), len, Access(access)) },
            out,
        )
    })
}

/// Allocates `len` zeroed bytes the library owns, as a region with `access`, into `*out`.
/// `rbr_mr_addr` gives the address; the memory is freed once the region is destroyed and no
/// posted work uses it. Access, context and registration as for `rbr_mr_register`.
///
/// # Safety
/// `ctx` live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_mr_alloc(
    ctx: *mut rbr_ctx,
    len: usize,
    access: u32,
    out: *mut *mut rbr_mr,
) -> rbr_status {
    ffi_body!({
        let ctx = arg_ref!(ctx);
        let out = out_ptr!(out);
        finish(ctx.inner.alloc_mr(len, Access(access)), out)
    })
}

/// The region's first byte, or NULL for a NULL region. Valid while the region lives.
///
/// # Safety
/// `mr` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_mr_addr(mr: *const rbr_mr) -> *mut c_void {
    ffi_body_or!(std::ptr::null_mut(), {
        // SAFETY: NULL or live (caller contract).
        match unsafe { mr.as_ref() } {
            Some(mr) => mr.inner.as_ptr().cast(),
            None => std::ptr::null_mut(),
        }
    })
}

/// The region's length in bytes, or 0 for a NULL region.
///
/// # Safety
/// `mr` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_mr_len(mr: *const rbr_mr) -> usize {
    ffi_body_or!(0, {
        // SAFETY: NULL or live (caller contract).
        unsafe { mr.as_ref() }.map_or(0, |mr| mr.inner.len())
    })
}

/// Destroys a region handle. NULL is ignored. Registered caller memory is not freed.
///
/// The region goes once no posted work holds it any more. A region a peer could reach with
/// one-sided operations stops being reachable then, on every connection it was packed for;
/// over shm that waits for the peer's accesses to it already in progress (a bounded time, and
/// not at all for a peer that has exited), so no byte lands in the memory afterwards.
///
/// # Safety
/// `mr` is NULL or a region not yet destroyed, not in use by another call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_mr_destroy(mr: *mut rbr_mr) {
    ffi_body_or!((), {
        if !mr.is_null() {
            // SAFETY: made by Box::into_raw in `finish` and not yet destroyed.
            drop(unsafe { Box::from_raw(mr) });
        }
    })
}
