//! `rbr_listener` and `rbr_request`: listening and answering connection requests.

use std::ffi::{c_char, c_void};

use crate::ffi::conn::{finish, options, rbr_conn, rbr_conn_options};
use crate::ffi::cq::rbr_cq;
use crate::ffi::ctx::rbr_ctx;
use crate::ffi::error::{RBR_EMPTY, RBR_OK, fail, rbr_status, status};
use crate::ffi::{
    arg_mut, arg_ref, arg_str, copy_out, ffi_body, ffi_body_or, out_ptr, private_data_arg,
    timeout_arg,
};
use std::sync::Arc;

use crate::{CompletionQueue, ConnOptions, ConnRequest, Connection, Error, Listener};

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

/// Listens on `addr` (`shm://NAME`, `rdma://HOST:PORT` or `HOST:PORT`; see "Limits" above)
/// with room for `backlog` requests not yet taken; writes the listener into `*out`.
/// RBR_ERR_ADDR_IN_USE when another listener has the address; RBR_ERR_ADDRESS when it is
/// malformed; RBR_ERR_INVALID when it is not UTF-8. A `backlog` out of range is taken as the
/// nearest allowed (0 as 1; above the system's limit, the limit).
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

/// Writes into `*fd` a descriptor for epoll/poll/select that is readable while a call to
/// `rbr_listener_get_request` with timeout 0 may make progress (level-triggered); registered
/// edge-triggered (EPOLLET), whatever arrives after a call that returned RBR_EMPTY makes a new
/// edge. The pattern for both: when it is readable, call `rbr_listener_get_request(l, 0, &req)`
/// until RBR_EMPTY, then sleep on it again. A readable
/// descriptor may still give RBR_EMPTY (a handshake that has only partly arrived, or a client
/// that was turned away); a client that connects and says nothing never makes it readable and
/// is dropped after 2 s. Owned by the listener: do not read or close it. Valid until the
/// listener is destroyed.
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

/// Takes the next connection request into `*out`, waiting up to `timeout_ms` (-1 = forever).
/// With `timeout_ms` 0 it never blocks: RBR_OK with a request, or RBR_EMPTY (not an error;
/// `rbr_last_error` is untouched) when no complete request is there yet. A request whose
/// handshake has only partly arrived stays with the listener for a later call; no peer is
/// dropped for being early. With a positive timeout, RBR_ERR_TIMEOUT when none came in time.
/// Requests beyond the listen backlog (not yet taken) get no answer: the connecting side's
/// `rbr_connect` keeps trying (shm) or waits (verbs: the RDMA CM drops them) and fails with
/// RBR_ERR_TIMEOUT when its own timeout ends, unless room is made before that (seen on
/// soft-RoCE with a backlog of 1: the requests beyond it got no answer and timed out).
/// A timeout below -1 is RBR_ERR_INVALID.
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
        let got = if timeout_ms == 0 {
            match l.inner.try_get_request() {
                Ok(Some(r)) => r,
                Ok(None) => return RBR_EMPTY,
                Err(e) => return fail(e),
            }
        } else {
            match l.inner.get_request(timeout) {
                Ok(r) => r,
                Err(e) => return fail(e),
            }
        };
        let private_data = got.private_data().to_vec();
        let req = rbr_request {
            inner: Some(got),
            private_data,
        };
        // SAFETY: non-NULL and writable (caller contract).
        unsafe { out.write(Box::into_raw(Box::new(req))) };
        RBR_OK
    })
}

/// Copies the private data the peer sent with its request into `buf` (at most `cap` bytes) and
/// writes its full length into `*len`; a `len` above `cap` means it was cut short. `buf` may be
/// NULL when `cap` is 0, to ask for the length. A buffer of RBR_PRIVATE_DATA_RECV_MAX bytes
/// always suffices.
///
/// # Safety
/// `r` live; `buf` writable for `cap` bytes; `len` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_request_private_data(
    r: *const rbr_request,
    buf: *mut c_void,
    cap: usize,
    len: *mut usize,
) -> rbr_status {
    ffi_body!({
        let r = arg_ref!(r);
        let len = out_ptr!(len);
        // SAFETY: the caller's contract above is copy_out's.
        unsafe { copy_out(&r.private_data, buf, cap, len) }
    })
}

/// Accepts the request and writes the connection into `*out`; its completions go to `cq`.
/// Bad options return RBR_ERR_INVALID and leave the request unanswered; otherwise the request
/// is answered (even if accepting then fails) and only `rbr_request_destroy` remains.
/// RBR_ERR_STATE if it was already answered.
/// How long it blocks: over shm it does not wait for the peer (it creates the connection's
/// shared memory and answers: typically well under a millisecond); over verbs it creates the
/// queue pair and waits for the peer to confirm, one round trip on the network, at most
/// `opts->timeout_ms` (RBR_ERR_TIMEOUT, and the peer's connect fails).
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
        // SAFETY: as this function's contract.
        unsafe { accept_with(r, cq, opts, out, ConnRequest::accept) }
    })
}

/// Accepts the request without waiting and writes the connection into `*out`, connecting; its
/// completions go to `cq`. Returns at once: the connection's establishment (over verbs, the
/// peer's confirmation) or its failure arrives on `cq` as an RBR_OP_CONNECTED record, as for
/// `rbr_connect_start` (see there, and `rbr_conn_status`). The request is answered either
/// way; only `rbr_request_destroy` remains. RBR_ERR_STATE if it was already answered.
///
/// # Safety
/// `r`, `cq` live; `opts` NULL or readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_request_accept_start(
    r: *mut rbr_request,
    cq: *mut rbr_cq,
    opts: *const rbr_conn_options,
    out: *mut *mut rbr_conn,
) -> rbr_status {
    ffi_body!({
        // SAFETY: as this function's contract.
        unsafe { accept_with(r, cq, opts, out, ConnRequest::accept_start) }
    })
}

/// `rbr_request_accept` and `rbr_request_accept_start`: checks the arguments and answers with
/// `accept` (inside their panic boundary).
///
/// # Safety
/// As theirs.
unsafe fn accept_with(
    r: *mut rbr_request,
    cq: *mut rbr_cq,
    opts: *const rbr_conn_options,
    out: *mut *mut rbr_conn,
    accept: fn(ConnRequest, &Arc<CompletionQueue>, &ConnOptions) -> crate::Result<Connection>,
) -> rbr_status {
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
    finish(accept(req, &cq.inner, &opts), out)
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
        let data = match private_data_arg(data, len) {
            Ok(d) => d,
            Err(s) => return s,
        };
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
