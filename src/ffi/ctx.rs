//! `rbr_ctx`: the parent of listeners, connections and memory regions.

use crate::ffi::error::{RBR_OK, fail, rbr_status};
use crate::ffi::{ffi_body, ffi_body_or, out_ptr, struct_arg};
use crate::{Context, ContextOptions, Error};

/// A context. Create with `rbr_ctx_create`, free with `rbr_ctx_destroy`. Thread-safe. Objects
/// made from it keep what they need alive, so it may be destroyed before them.
pub struct rbr_ctx {
    pub(crate) inner: Context,
}

/// Context flag: let shared-memory peers running as another user connect.
pub const RBR_CTX_SHM_ANY_UID: u32 = 1;

/// Options of `rbr_ctx_create_ex`. Set `struct_size = sizeof(rbr_ctx_options)`.
#[repr(C)]
pub struct rbr_ctx_options {
    /// `sizeof(rbr_ctx_options)` as the caller knows it.
    pub struct_size: u32,
    /// `RBR_CTX_*` flags.
    pub flags: u32,
}

/// Creates a context with default options into `*out`.
///
/// # Safety
/// `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_ctx_create(out: *mut *mut rbr_ctx) -> rbr_status {
    crate::ffi::ffi_body!({
        // SAFETY: same contract, NULL options.
        unsafe { rbr_ctx_create_ex(std::ptr::null(), out) }
    })
}

/// Creates a context with `opts` (NULL = defaults) into `*out`. An unknown flag or a
/// `struct_size` no struct has is RBR_ERR_INVALID.
///
/// # Safety
/// `opts` is NULL or points at a readable `rbr_ctx_options`; `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_ctx_create_ex(
    opts: *const rbr_ctx_options,
    out: *mut *mut rbr_ctx,
) -> rbr_status {
    ffi_body!({
        let out = out_ptr!(out);
        let mut o = ContextOptions::default();
        // SAFETY: NULL or a readable struct (caller contract).
        let opts = match unsafe { struct_arg(opts, "rbr_ctx_options") } {
            Ok(o) => o,
            Err(s) => return s,
        };
        if let Some(opts) = opts {
            if opts.flags & !RBR_CTX_SHM_ANY_UID != 0 {
                return fail(Error::invalid(format!(
                    "unknown context flags {:#x}",
                    opts.flags
                )));
            }
            o.shm_allow_any_uid = opts.flags & RBR_CTX_SHM_ANY_UID != 0;
        }
        match Context::with_options(o) {
            Ok(inner) => {
                // SAFETY: `out` is non-NULL and writable (caller contract).
                unsafe { out.write(Box::into_raw(Box::new(rbr_ctx { inner }))) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Destroys a context handle. NULL is ignored.
///
/// # Safety
/// `ctx` is NULL or a context from `rbr_ctx_create*` not yet destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_ctx_destroy(ctx: *mut rbr_ctx) {
    ffi_body_or!((), {
        if !ctx.is_null() {
            // SAFETY: made by Box::into_raw in rbr_ctx_create_ex and not yet destroyed.
            drop(unsafe { Box::from_raw(ctx) });
        }
    })
}
