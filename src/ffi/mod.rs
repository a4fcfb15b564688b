//! The C surface. Every `extern "C"` function lives here, one file per handle, and does only
//! null checks, handle conversion, the panic boundary and error-code mapping.
//!
//! Handles are `Box`ed Rust objects passed to C as opaque pointers; `*_destroy` takes them back.

#![allow(non_camel_case_types)]

pub mod conn;
pub mod cq;
pub mod ctx;
pub mod error;
pub mod listener;
pub mod mr;

pub use error::rbr_status;

/// Runs an exported function's body inside the panic boundary: a panic becomes
/// `RBR_ERR_PANIC` (with a last-error message) instead of unwinding into C.
macro_rules! ffi_body {
    ($body:block) => {{
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(
            || -> $crate::ffi::error::rbr_status { $body },
        )) {
            Ok(status) => status,
            Err(_) => $crate::ffi::error::panicked(),
        }
    }};
}

/// Like `ffi_body!` for functions that return no status: a panic is swallowed (and recorded
/// as the thread's last error) and `$default` is returned.
macro_rules! ffi_body_or {
    ($default:expr, $body:block) => {{
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| $body)) {
            Ok(v) => v,
            Err(_) => {
                $crate::ffi::error::panicked();
                $default
            }
        }
    }};
}

/// Turns a pointer argument into a reference, or returns `RBR_ERR_NULL` from the function.
macro_rules! arg_ref {
    ($p:expr) => {{
        let p = $p;
        // SAFETY: the C contract of every function is that non-NULL handle and struct pointers
        // point at live objects of the named type (handles made by this library and not yet
        // destroyed); NULL is checked here.
        match unsafe { p.as_ref() } {
            Some(r) => r,
            None => return $crate::ffi::error::null_arg(stringify!($p)),
        }
    }};
}

/// Like `arg_ref!` for an exclusive reference.
macro_rules! arg_mut {
    ($p:expr) => {{
        let p = $p;
        // SAFETY: as for `arg_ref!`; the caller does not use the object from another thread
        // during the call (documented per function).
        match unsafe { p.as_mut() } {
            Some(r) => r,
            None => return $crate::ffi::error::null_arg(stringify!($p)),
        }
    }};
}

/// Checks that an out-parameter is non-NULL, returning `RBR_ERR_NULL` otherwise.
macro_rules! out_ptr {
    ($p:expr) => {{
        let p = $p;
        if p.is_null() {
            return $crate::ffi::error::null_arg(stringify!($p));
        }
        p
    }};
}

/// Reads a C string argument as UTF-8, or returns NULL/INVALID from the function.
macro_rules! arg_str {
    ($p:expr) => {{
        let p = $p;
        if p.is_null() {
            return $crate::ffi::error::null_arg(stringify!($p));
        }
        // SAFETY: non-NULL, and the C contract is a NUL-terminated string.
        match unsafe { ::std::ffi::CStr::from_ptr(p) }.to_str() {
            Ok(s) => s,
            Err(_) => {
                return $crate::ffi::error::fail($crate::Error::invalid("string is not UTF-8"));
            }
        }
    }};
}

/// Turns an optional C timeout in milliseconds (-1 = forever) into a Duration.
pub(crate) fn timeout_arg(ms: i32) -> Result<Option<std::time::Duration>, rbr_status> {
    match ms {
        -1 => Ok(None),
        ms if ms >= 0 => Ok(Some(std::time::Duration::from_millis(ms as u64))),
        ms => Err(error::fail(crate::Error::invalid(format!(
            "timeout {ms} ms (use -1 for none)"
        )))),
    }
}

/// Views a C byte buffer (`NULL` allowed when `len` is 0).
pub(crate) fn bytes_arg<'a>(
    p: *const std::ffi::c_void,
    len: usize,
) -> Result<&'a [u8], rbr_status> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(error::null_arg("data"));
    }
    // SAFETY: non-NULL, and the C contract is `len` readable bytes for the duration of the call.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

pub(crate) use {arg_mut, arg_ref, arg_str, ffi_body, ffi_body_or, out_ptr};
