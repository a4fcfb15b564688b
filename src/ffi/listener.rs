//! `rbr_listener` and `rbr_request`: listening and answering connection requests.

use std::ffi::{c_char, c_void};

use crate::ffi::conn::{finish, options, rbr_conn, rbr_conn_options};
use crate::ffi::cq::rbr_cq;
use crate::ffi::ctx::rbr_ctx;
use crate::ffi::error::{RBR_OK, fail, rbr_status, status};
use crate::ffi::{
    arg_mut, arg_ref, arg_str, bytes_arg, ffi_body, ffi_body_or, out_ptr, timeout_arg,
};
use crate::{ConnRequest, Error, Listener};

/// A listening endpoint. Create with `rbr_listen`, free with `rbr_listener_destroy`.
/// Thread-safe.
pub struct rbr_listener {
    inner: Listener,
}

/// A peer's request to connect, from `rbr_listener_get_request`. Read its private data, then
/// answer it once with `rbr_request_accept` or `rbr_request_reject`; free it with
/// `rbr_request_destroy` in every case (destroying an unanswered request rejects it). Not
/// thread-safe: use it from one thread at a time.
pub struct rbr_request {
    inner: Option<ConnRequest>,
    private_data: Vec<u8>,
}

/// Listens on `addr` (`shm://NAME`, `rdma://HOST:PORT` or `HOST:PORT`) with room for
/// `backlog` unanswered requests; writes the listener into `*out`.
/// RBR_ERR_ADDR_IN_USE when another listener has the address.
///
/// # Safety
/// `ctx` live; `addr` a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_listen(
    ctx: *mut rbr_ctx,
    addr: *const c_char,
    backlog: u32,
    out: *mut *mut rbr_listener,
) -> rbr_status {
    ffi_body!({
        let ctx = arg_ref!(ctx);
        let addr = arg_str!(addr);
        let out = out_ptr!(out);
        match ctx.inner.listen(addr, backlog) {
            Ok(inner) => {
                // SAFETY: non-NULL and writable (caller contract).
                unsafe { out.write(Box::into_raw(Box::new(rbr_listener { inner }))) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Stops listening and frees the listener. Requests already taken stay valid. NULL is ignored.
///
/// # Safety
/// `l` is NULL or a listener not yet destroyed, with no other call on it under way.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_listener_destroy(l: *mut rbr_listener) {
    ffi_body_or!((), {
        if !l.is_null() {
            // SAFETY: made by Box::into_raw in rbr_listen and not yet destroyed.
            drop(unsafe { Box::from_raw(l) });
        }
    })
}

/// Writes into `*fd` a descriptor that is readable while a connection request may be
/// waiting (level-triggered), for epoll/poll/select. Owned by the listener.
///
/// # Safety
/// `l` live; `fd` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_listener_fd(l: *const rbr_listener, fd: *mut i32) -> rbr_status {
    ffi_body!({
        let l = arg_ref!(l);
        let fd = out_ptr!(fd);
        // SAFETY: non-NULL and writable (caller contract).
        unsafe { fd.write(l.inner.fd()) };
        RBR_OK
    })
}

/// Waits up to `timeout_ms` (-1 = forever) for the next connection request and writes it into
/// `*out`. RBR_ERR_TIMEOUT when none came in time.
///
/// # Safety
/// `l` live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_listener_get_request(
    l: *mut rbr_listener,
    timeout_ms: i32,
    out: *mut *mut rbr_request,
) -> rbr_status {
    ffi_body!({
        let l = arg_ref!(l);
        let out = out_ptr!(out);
        let timeout = match timeout_arg(timeout_ms) {
            Ok(t) => t,
            Err(s) => return s,
        };
        match l.inner.get_request(timeout) {
            Ok(r) => {
                let private_data = r.private_data().to_vec();
                let req = rbr_request {
                    inner: Some(r),
                    private_data,
                };
                // SAFETY: non-NULL and writable (caller contract).
                unsafe { out.write(Box::into_raw(Box::new(req))) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Writes a pointer to the request's private data into `*data` and its length into `*len`.
/// The bytes live as long as the request.
///
/// # Safety
/// `r` live; `data`, `len` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_request_private_data(
    r: *const rbr_request,
    data: *mut *const c_void,
    len: *mut usize,
) -> rbr_status {
    ffi_body!({
        let r = arg_ref!(r);
        let data = out_ptr!(data);
        let len = out_ptr!(len);
        // SAFETY: both non-NULL and writable (caller contract).
        unsafe {
            data.write(r.private_data.as_ptr().cast());
            len.write(r.private_data.len());
        }
        RBR_OK
    })
}

/// Accepts the request and writes the connection into `*out`; its completions go to `cq`.
/// Bad options return RBR_ERR_INVALID and leave the request unanswered; otherwise the request
/// is answered (even if accepting then fails) and only `rbr_request_destroy` remains.
/// RBR_ERR_STATE if it was already answered.
///
/// # Safety
/// `r`, `cq` live; `opts` NULL or readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_request_accept(
    r: *mut rbr_request,
    cq: *mut rbr_cq,
    opts: *const rbr_conn_options,
    out: *mut *mut rbr_conn,
) -> rbr_status {
    ffi_body!({
        let r = arg_mut!(r);
        let cq = arg_ref!(cq);
        let out = out_ptr!(out);
        let opts = match options(opts) {
            Ok(o) => o,
            Err(s) => return s,
        };
        let Some(req) = r.inner.take() else {
            return fail(Error::State("the request was already answered"));
        };
        finish(req.accept(&cq.inner, &opts), out)
    })
}

/// Rejects the request, sending `data[0..len]` (at most RBR_PRIVATE_DATA_MAX bytes) to the
/// peer, whose `rbr_connect` returns RBR_ERR_REJECTED. RBR_ERR_STATE if already answered.
///
/// # Safety
/// `r` live; `data` readable for `len` bytes (NULL allowed when `len` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_request_reject(
    r: *mut rbr_request,
    data: *const c_void,
    len: usize,
) -> rbr_status {
    ffi_body!({
        let r = arg_mut!(r);
        let data = match bytes_arg(data, len) {
            Ok(d) => d,
            Err(s) => return s,
        };
        if let Err(e) = crate::conn::check_private_data(data) {
            return fail(e);
        }
        let Some(req) = r.inner.take() else {
            return fail(Error::State("the request was already answered"));
        };
        status(req.reject(data))
    })
}

/// Frees a request; an unanswered one is rejected without private data. NULL is ignored.
///
/// # Safety
/// `r` is NULL or a request not yet destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_request_destroy(r: *mut rbr_request) {
    ffi_body_or!((), {
        if !r.is_null() {
            // SAFETY: made by Box::into_raw in rbr_listener_get_request and not yet destroyed.
            drop(unsafe { Box::from_raw(r) });
        }
    })
}
