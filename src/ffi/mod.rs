//! The C surface. Every `extern "C"` function lives here, one file per handle, and does only
//! null checks, handle conversion, the panic boundary and error-code mapping.
//!
//! Handles are `Box`ed Rust objects passed to C as opaque pointers; `*_destroy` takes them back.

#![allow(non_camel_case_types)]

// In the order a program meets the handles, which the generated header follows.
pub mod ctx;

pub mod error;

pub mod mr;

pub mod cq;

pub mod srq;

pub mod listener;

pub mod conn;

pub mod rdma;

pub use error::rbr_status;

/// Runs an exported function's body inside the panic boundary: a panic becomes
/// `RBR_ERR_PANIC` (its message goes to `rbr_last_error`, never to stderr) instead of unwinding
/// into C.
macro_rules! ffi_body {
    ($body:block) => {{
        match $crate::panic::catch(|| -> $crate::ffi::error::rbr_status { $body }) {
            Ok(status) => status,
            Err(msg) => $crate::ffi::error::panicked(msg),
        }
    }};
}

/// Like `ffi_body!` for functions that return no status: a panic is swallowed (and recorded
/// as the thread's last error) and `$default` is returned.
macro_rules! ffi_body_or {
    ($default:expr, $body:block) => {{
        match $crate::panic::catch(|| $body) {
            Ok(v) => v,
            Err(msg) => {
                $crate::ffi::error::panicked(msg);
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

/// Largest `struct_size` an options struct may claim: bytes past what this library knows must
/// be zero, and nobody's struct grows this large.
const STRUCT_SIZE_MAX: usize = 4096;

/// Reads a versioned input struct whose first field is `u32 struct_size` (NULL = `None`).
/// `struct_size` below this library's size is refused (call the struct's `_init`); above it,
/// the extra bytes (fields of a newer header) must all be zero, so that nothing the caller
/// set is silently ignored.
///
/// # Safety
/// `p` is NULL or readable for `struct_size` bytes (the C contract of every such struct).
pub(crate) unsafe fn struct_arg<'a, T>(
    p: *const T,
    name: &str,
) -> Result<Option<&'a T>, rbr_status> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and readable (caller contract); every such struct starts with its size.
    let size = unsafe { p.cast::<u32>().read() } as usize;
    let known = std::mem::size_of::<T>();
    if size < known {
        return Err(error::fail(crate::Error::invalid(format!(
            "{name}.struct_size {size} is smaller than this library's {known} (call the _init function)"
        ))));
    }
    if size > STRUCT_SIZE_MAX {
        return Err(error::fail(crate::Error::invalid(format!(
            "{name}.struct_size {size} is not a struct size (at most {STRUCT_SIZE_MAX})"
        ))));
    }
    // SAFETY: the caller's struct is `size` readable bytes, of which `known` are ours.
    let extra = unsafe { std::slice::from_raw_parts(p.cast::<u8>().add(known), size - known) };
    if extra.iter().any(|&b| b != 0) {
        return Err(error::fail(crate::Error::invalid(format!(
            "{name} sets fields this library does not know (struct_size {size}, library {known})"
        ))));
    }
    // SAFETY: non-NULL, readable and at least `known` bytes (checked above).
    Ok(Some(unsafe { &*p }))
}

/// [`struct_arg`] for a struct that has grown since its first version, whose size is `oldest`:
/// a caller built against an older header passes a smaller `struct_size`, and the fields its
/// version lacks take their values from `defaults`. Below `oldest` is refused.
///
/// # Safety
/// As for [`struct_arg`].
pub(crate) unsafe fn grown_struct_arg<T: Copy>(
    p: *const T,
    name: &str,
    oldest: usize,
    defaults: T,
) -> Result<Option<T>, rbr_status> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and readable (caller contract); every such struct starts with its size.
    let size = unsafe { p.cast::<u32>().read() } as usize;
    if size >= std::mem::size_of::<T>() {
        // SAFETY: the caller's contract.
        return Ok(unsafe { struct_arg(p, name) }?.copied());
    }
    if size < oldest {
        return Err(error::fail(crate::Error::invalid(format!(
            "{name}.struct_size {size} is smaller than any version of it (call the _init function)"
        ))));
    }
    let mut v = defaults;
    // SAFETY: the caller's struct is `size` readable bytes, fewer than `T` has; they are the
    // leading fields of `T` as its older version laid them out (fields are only ever added at
    // the end), so every byte copied lands in the field it belongs to.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut v).cast::<u8>(), size) };
    Ok(Some(v))
}

/// Views private data given as pointer and length, checking the length against
/// `RBR_PRIVATE_DATA_MAX` before reading any byte.
pub(crate) fn private_data_arg<'a>(
    p: *const std::ffi::c_void,
    len: usize,
) -> Result<&'a [u8], rbr_status> {
    crate::conn::check_private_data_len(len).map_err(error::fail)?;
    bytes_arg(p, len)
}

/// Copies `data` into the caller's `buf` (at most `cap` bytes) and its full length into
/// `*len`. `buf` may be NULL when `cap` is 0.
///
/// # Safety
/// `buf` writable for `cap` bytes; `len` non-NULL and writable.
pub(crate) unsafe fn copy_out(
    data: &[u8],
    buf: *mut std::ffi::c_void,
    cap: usize,
    len: *mut usize,
) -> rbr_status {
    if cap > 0 && buf.is_null() {
        return error::null_arg("buf");
    }
    let n = data.len().min(cap);
    // SAFETY: `buf` is writable for `cap >= n` bytes (caller contract) and cannot overlap the
    // library's own copy of the data; `len` is non-NULL and writable.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), buf.cast::<u8>(), n);
        len.write(data.len());
    }
    error::RBR_OK
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
