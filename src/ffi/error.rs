//! Status codes, their names, and this thread's last error. The one place where Rust errors
//! become C codes.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_void};

use crate::error::Error;

/// The result of every fallible function: `RBR_OK` (0), `RBR_EMPTY` (1, nothing ready),
/// `RBR_IN_PROGRESS` (2, not finished yet), or a negative `RBR_ERR_*` code. Values are fixed
/// forever.
pub type rbr_status = i32;

/// Success.
pub const RBR_OK: rbr_status = 0;
/// Nothing ready (not an error): `rbr_cq_poll` found no completion.
pub const RBR_EMPTY: rbr_status = 1;
/// Not finished yet (not an error): `rbr_conn_status` of a connection still connecting.
pub const RBR_IN_PROGRESS: rbr_status = 2;
/// A required pointer argument was NULL.
pub const RBR_ERR_NULL: rbr_status = -1;
/// An argument is out of range or malformed.
pub const RBR_ERR_INVALID: rbr_status = -2;
/// Out of memory.
pub const RBR_ERR_NO_MEMORY: rbr_status = -3;
/// The operation did not finish within its timeout.
pub const RBR_ERR_TIMEOUT: rbr_status = -4;
/// Nobody listens at the address.
pub const RBR_ERR_REFUSED: rbr_status = -5;
/// The listener rejected the request; `rbr_last_reject_data` has its private data.
pub const RBR_ERR_REJECTED: rbr_status = -6;
/// The peer cannot be reached.
pub const RBR_ERR_UNREACHABLE: rbr_status = -7;
/// The address is malformed or cannot be resolved.
pub const RBR_ERR_ADDRESS: rbr_status = -8;
/// No route to the peer.
pub const RBR_ERR_ROUTE: rbr_status = -9;
/// Establishing the connection failed after it started.
pub const RBR_ERR_CONNECT: rbr_status = -10;
/// The RDMA device went away.
pub const RBR_ERR_DEVICE_REMOVED: rbr_status = -11;
/// The verbs transport was asked for and there is no RDMA device.
pub const RBR_ERR_NO_DEVICE: rbr_status = -12;
/// Not available in this build or on this machine.
pub const RBR_ERR_UNSUPPORTED: rbr_status = -13;
/// The connection is down.
pub const RBR_ERR_DISCONNECTED: rbr_status = -14;
/// The send or receive queue is full: reap completions, then post again.
pub const RBR_ERR_QUEUE_FULL: rbr_status = -15;
/// Refused because of who the caller is (peer credentials).
pub const RBR_ERR_PERMISSION: rbr_status = -16;
/// The peer broke the protocol or speaks another version.
pub const RBR_ERR_PROTOCOL: rbr_status = -17;
/// An operating-system call failed; `rbr_last_errno` has the errno.
pub const RBR_ERR_OS: rbr_status = -18;
/// A bug inside the library was caught at the boundary.
pub const RBR_ERR_PANIC: rbr_status = -19;
/// The offset and length do not lie inside the memory region.
pub const RBR_ERR_RANGE: rbr_status = -20;
/// Another listener already uses the address.
pub const RBR_ERR_ADDR_IN_USE: rbr_status = -21;
/// The memory region lacks the access the operation needs.
pub const RBR_ERR_ACCESS: rbr_status = -22;
/// The object is in the wrong state (for example, a request already answered).
pub const RBR_ERR_STATE: rbr_status = -23;

fn status_of(e: &Error) -> rbr_status {
    match e {
        Error::InvalidArgument(_) => RBR_ERR_INVALID,
        Error::Range { .. } => RBR_ERR_RANGE,
        Error::Access(_) => RBR_ERR_ACCESS,
        Error::Address { .. } => RBR_ERR_ADDRESS,
        Error::Unsupported(_) => RBR_ERR_UNSUPPORTED,
        Error::NoDevice => RBR_ERR_NO_DEVICE,
        Error::Refused(_) => RBR_ERR_REFUSED,
        Error::Unreachable(_) => RBR_ERR_UNREACHABLE,
        Error::Route(_) => RBR_ERR_ROUTE,
        Error::ConnectFailed(_) => RBR_ERR_CONNECT,
        Error::DeviceRemoved => RBR_ERR_DEVICE_REMOVED,
        Error::Rejected(_) => RBR_ERR_REJECTED,
        Error::Permission(_) => RBR_ERR_PERMISSION,
        Error::Protocol(_) => RBR_ERR_PROTOCOL,
        Error::Timeout(_) => RBR_ERR_TIMEOUT,
        Error::Disconnected => RBR_ERR_DISCONNECTED,
        Error::QueueFull(_) => RBR_ERR_QUEUE_FULL,
        Error::AddrInUse(_) => RBR_ERR_ADDR_IN_USE,
        Error::State(_) => RBR_ERR_STATE,
        // Made by the Rust API's results of completions only; a failed work request leaves
        // its connection down.
        Error::WorkRequest { .. } => RBR_ERR_DISCONNECTED,
        Error::Listen(io)
        | Error::Connect(io)
        | Error::Accept(io)
        | Error::SharedMemory(io)
        | Error::MemoryRegion(io)
        | Error::MemoryLock { source: io, .. }
        | Error::CompletionQueue(io)
        | Error::Thread(io) => {
            if io.raw_os_error() == Some(libc::ENOMEM) {
                RBR_ERR_NO_MEMORY
            } else {
                RBR_ERR_OS
            }
        }
    }
}

struct LastError {
    message: CString,
    errno: i32,
    reject_data: Vec<u8>,
}

thread_local! {
    static LAST: RefCell<LastError> = RefCell::new(LastError {
        message: CString::default(),
        errno: 0,
        reject_data: Vec::new(),
    });
}

fn record(message: String, errno: i32, reject_data: Option<Vec<u8>>) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| {
        let mut l = l.borrow_mut();
        l.message = message;
        l.errno = errno;
        if let Some(d) = reject_data {
            l.reject_data = d;
        }
    });
}

/// Records `e` as this thread's last error and returns its status.
pub(crate) fn fail(e: Error) -> rbr_status {
    let status = status_of(&e);
    let reject = match &e {
        Error::Rejected(d) => Some(d.clone()),
        _ => None,
    };
    record(e.to_string(), e.os_error().unwrap_or(0), reject);
    status
}

/// Maps a result: `Ok` to `RBR_OK`, `Err` through [`fail`].
pub(crate) fn status(r: crate::Result<()>) -> rbr_status {
    match r {
        Ok(()) => RBR_OK,
        Err(e) => fail(e),
    }
}

pub(crate) fn null_arg(name: &str) -> rbr_status {
    record(format!("argument {name} is NULL"), 0, None);
    RBR_ERR_NULL
}

pub(crate) fn panicked(msg: String) -> rbr_status {
    record(
        format!("internal error: a panic was caught at the C boundary: {msg}"),
        0,
        None,
    );
    RBR_ERR_PANIC
}

/// The name of a status code, e.g. `"RBR_ERR_TIMEOUT: timed out"`. Never NULL; the string is
/// static. Unknown values give `"unknown status"`.
#[unsafe(no_mangle)]
pub extern "C" fn rbr_status_str(status: i32) -> *const c_char {
    crate::ffi::ffi_body_or!(c"unknown status".as_ptr(), { status_name(status).as_ptr() })
}

fn status_name(status: i32) -> &'static std::ffi::CStr {
    match status {
        RBR_OK => c"RBR_OK: success",
        RBR_EMPTY => c"RBR_EMPTY: nothing ready",
        RBR_IN_PROGRESS => c"RBR_IN_PROGRESS: not finished yet",
        RBR_ERR_NULL => c"RBR_ERR_NULL: a required pointer was NULL",
        RBR_ERR_INVALID => c"RBR_ERR_INVALID: invalid argument",
        RBR_ERR_NO_MEMORY => c"RBR_ERR_NO_MEMORY: out of memory",
        RBR_ERR_TIMEOUT => c"RBR_ERR_TIMEOUT: timed out",
        RBR_ERR_REFUSED => c"RBR_ERR_REFUSED: connection refused, nobody listens there",
        RBR_ERR_REJECTED => c"RBR_ERR_REJECTED: connection rejected by the peer",
        RBR_ERR_UNREACHABLE => c"RBR_ERR_UNREACHABLE: peer unreachable",
        RBR_ERR_ADDRESS => c"RBR_ERR_ADDRESS: bad or unresolvable address",
        RBR_ERR_ROUTE => c"RBR_ERR_ROUTE: no route to the peer",
        RBR_ERR_CONNECT => c"RBR_ERR_CONNECT: connection establishment failed",
        RBR_ERR_DEVICE_REMOVED => c"RBR_ERR_DEVICE_REMOVED: RDMA device removed",
        RBR_ERR_NO_DEVICE => c"RBR_ERR_NO_DEVICE: no RDMA device",
        RBR_ERR_UNSUPPORTED => c"RBR_ERR_UNSUPPORTED: not supported",
        RBR_ERR_DISCONNECTED => c"RBR_ERR_DISCONNECTED: connection is down",
        RBR_ERR_QUEUE_FULL => c"RBR_ERR_QUEUE_FULL: queue full",
        RBR_ERR_PERMISSION => c"RBR_ERR_PERMISSION: permission denied",
        RBR_ERR_PROTOCOL => c"RBR_ERR_PROTOCOL: protocol error",
        RBR_ERR_OS => c"RBR_ERR_OS: operating system error",
        RBR_ERR_PANIC => c"RBR_ERR_PANIC: internal error",
        RBR_ERR_RANGE => c"RBR_ERR_RANGE: outside the memory region",
        RBR_ERR_ADDR_IN_USE => c"RBR_ERR_ADDR_IN_USE: address in use",
        RBR_ERR_ACCESS => c"RBR_ERR_ACCESS: memory region lacks the access",
        RBR_ERR_STATE => c"RBR_ERR_STATE: wrong state",
        _ => c"unknown status",
    }
}

/// This thread's message for its last failed call. Never NULL (empty when nothing failed yet);
/// valid until the next failing rdmabridge call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn rbr_last_error() -> *const c_char {
    // `try_with`/`try_borrow`: even on a thread whose locals are being torn down this returns
    // (an empty string) rather than panicking.
    crate::ffi::ffi_body_or!(c"".as_ptr(), {
        LAST.try_with(|l| l.try_borrow().map(|l| l.message.as_ptr()).ok())
            .ok()
            .flatten()
            .unwrap_or(c"".as_ptr())
    })
}

/// The OS errno behind this thread's last failure, or 0 when there was none.
#[unsafe(no_mangle)]
pub extern "C" fn rbr_last_errno() -> i32 {
    crate::ffi::ffi_body_or!(0, {
        LAST.try_with(|l| l.try_borrow().map(|l| l.errno).unwrap_or(0))
            .unwrap_or(0)
    })
}

/// Copies the private data of the last rejection this thread saw (`rbr_connect` returning
/// `RBR_ERR_REJECTED`) into `buf` (at most `cap` bytes) and its full length into `*len`.
/// `buf` may be NULL when `cap` is 0, to ask for the length.
///
/// # Safety
/// `buf` must be writable for `cap` bytes; `len` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_last_reject_data(
    buf: *mut c_void,
    cap: usize,
    len: *mut usize,
) -> rbr_status {
    crate::ffi::ffi_body!({
        let len = crate::ffi::out_ptr!(len);
        if cap > 0 && buf.is_null() {
            return null_arg("buf");
        }
        LAST.with(|l| {
            let l = l.borrow();
            let n = l.reject_data.len().min(cap);
            // SAFETY: `buf` is writable for `cap >= n` bytes (caller contract) and does not
            // overlap our own vector; `len` is non-NULL and writable.
            unsafe {
                std::ptr::copy_nonoverlapping(l.reject_data.as_ptr(), buf.cast::<u8>(), n);
                len.write(l.reject_data.len());
            }
        });
        RBR_OK
    })
}

/// The library's version, e.g. `"0.1.0"`. Static; never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn rbr_version() -> *const c_char {
    crate::ffi::ffi_body_or!(c"unknown".as_ptr(), { version().as_ptr() })
}

fn version() -> &'static std::ffi::CStr {
    static V: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes(),
    ) {
        Ok(v) => v,
        Err(_) => c"unknown",
    };
    V
}
