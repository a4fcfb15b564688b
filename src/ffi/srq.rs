//! `rbr_srq`: shared receive queues.

use std::ffi::c_void;

use crate::ffi::cq::rbr_cq;
use crate::ffi::ctx::rbr_ctx;
use crate::ffi::error::{RBR_OK, fail, rbr_status, status};
use crate::ffi::mr::rbr_mr;
use crate::ffi::{arg_ref, ffi_body, ffi_body_or, out_ptr, struct_arg};
use crate::{SharedRecvQueue, SrqOptions};

/// A shared receive queue: one pool of receives that many connections take their messages'
/// receives from, so that receive memory follows the traffic rather than the number of peers
/// (a verbs SRQ). Create with `rbr_srq_create`, name it in `rbr_conn_options.srq` when
/// connecting or accepting, post receives with `rbr_srq_post_recv` (`rbr_conn_post_recv` on
/// such a connection is RBR_ERR_INVALID), free with `rbr_srq_destroy`. Thread-safe.
///
/// A message on any of its connections takes the oldest receive of the pool; the receive's
/// completion (RBR_OP_RECV, or RBR_OP_RECV_WRITE_IMM) arrives on that connection's queue with
/// the connection's `conn_id` and `conn_context`. A peer's send waits while the pool is
/// empty, and is taken when a receive is posted: it never fails for it (over shm in the ring;
/// over verbs in the peer's device, which sends it again every 0.64 ms: receiver-not-ready,
/// with the peer's `rnr_retry_count`, 7 by default: without limit).
/// When a connection ends, a receive it had taken for a message not yet whole completes
/// RBR_WC_FLUSHED on its queue; the pool's other receives stay in the pool. Connections using
/// the pool keep it alive: destroying the handle early only drops the caller's reference;
/// receives still in the pool when it goes complete nowhere (their regions are let go then).
///
/// Over verbs the pool is a shared receive queue of the device, for connections on one
/// device; one pool for shm and verbs connections both is RBR_ERR_UNSUPPORTED. A verbs
/// connection with a pool speaks no receive credits with its peer.
pub struct rbr_srq {
    pub(crate) inner: SharedRecvQueue,
}

/// Options of `rbr_srq_create`. Fill with `rbr_srq_options_init`, then change fields. Fields
/// are only ever added at the end; `struct_size` tells which exist.
#[repr(C)]
pub struct rbr_srq_options {
    /// `sizeof(rbr_srq_options)`, set by `rbr_srq_options_init`.
    pub struct_size: u32,
    /// Most receives the pool holds at once (1..=16384). Default 1024.
    pub depth: u32,
    /// Where the pool's events go (RBR_OP_SRQ_LIMIT, see `rbr_srq_set_limit`); NULL for none.
    /// The pool keeps the queue alive.
    pub cq: *mut rbr_cq,
    /// Echoed as `conn_context` in the pool's events.
    pub context: *mut c_void,
}

/// Fills `*opts` with the defaults. NULL is ignored.
///
/// # Safety
/// `opts` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_srq_options_init(opts: *mut rbr_srq_options) {
    ffi_body_or!((), {
        if opts.is_null() {
            return;
        }
        // SAFETY: non-NULL and writable (caller contract).
        unsafe {
            opts.write(rbr_srq_options {
                struct_size: std::mem::size_of::<rbr_srq_options>() as u32,
                depth: SrqOptions::default().depth,
                cq: std::ptr::null_mut(),
                context: std::ptr::null_mut(),
            })
        };
    })
}

/// Creates a shared receive queue of `ctx` into `*out`; `opts` NULL means the defaults.
/// RBR_ERR_INVALID: a depth out of range.
///
/// # Safety
/// `ctx` live; `opts` NULL or readable, its `cq` NULL or live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_srq_create(
    ctx: *mut rbr_ctx,
    opts: *const rbr_srq_options,
    out: *mut *mut rbr_srq,
) -> rbr_status {
    ffi_body!({
        let ctx = arg_ref!(ctx);
        let out = out_ptr!(out);
        // SAFETY: NULL or a readable struct (caller contract).
        let o = match unsafe { struct_arg(opts, "rbr_srq_options") } {
            Ok(o) => o,
            Err(s) => return s,
        };
        let mut opts = SrqOptions::default();
        if let Some(o) = o {
            opts.depth = o.depth;
            opts.context = o.context as usize;
            // SAFETY: NULL or live (caller contract).
            opts.cq = unsafe { o.cq.as_ref() }.map(|cq| cq.inner.clone());
        }
        match ctx.inner.shared_recv_queue(&opts) {
            Ok(inner) => {
                // SAFETY: `out` is non-NULL and writable (caller contract).
                unsafe { out.write(Box::into_raw(Box::new(rbr_srq { inner }))) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Posts a receive into `mr[offset..offset+len]` (the region, of the pool's context, needs
/// RBR_ACCESS_LOCAL_WRITE) to the pool. Messages that waited for the pool are taken now, on
/// this thread. RBR_ERR_QUEUE_FULL when the pool holds `depth` receives; RBR_ERR_ACCESS,
/// RBR_ERR_RANGE and RBR_ERR_INVALID as for `rbr_conn_post_recv`.
///
/// # Safety
/// `srq`, `mr` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_srq_post_recv(
    srq: *mut rbr_srq,
    mr: *const rbr_mr,
    offset: usize,
    len: usize,
    wr_id: u64,
) -> rbr_status {
    ffi_body!({
        let srq = arg_ref!(srq);
        let mr = arg_ref!(mr);
        status(srq.inner.post_recv(&mr.inner, offset, len, wr_id))
    })
}

/// Arms the pool's limit: once fewer than `limit` receives are left in it, one record with
/// opcode RBR_OP_SRQ_LIMIT goes to the pool's queue (`rbr_srq_options.cq`), with the receives
/// left as its `wr_id`, and the limit is disarmed, as a verbs SRQ's limit event; at once when
/// fewer are left already. 0 disarms it. RBR_ERR_INVALID: a pool without a queue, or a limit
/// over its depth.
///
/// # Safety
/// `srq` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_srq_set_limit(srq: *mut rbr_srq, limit: u32) -> rbr_status {
    ffi_body!({
        let srq = arg_ref!(srq);
        status(srq.inner.set_limit(limit))
    })
}

/// Receives posted to the pool that no connection has taken yet; 0 for NULL.
///
/// # Safety
/// `srq` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_srq_len(srq: *const rbr_srq) -> usize {
    ffi_body_or!(0, {
        // SAFETY: NULL or live (caller contract).
        unsafe { srq.as_ref() }.map_or(0, |s| s.inner.len())
    })
}

/// Destroys a pool handle. NULL is ignored. Connections using the pool keep it alive.
///
/// # Safety
/// `srq` is NULL or a pool from `rbr_srq_create` not yet destroyed, not in use by another call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_srq_destroy(srq: *mut rbr_srq) {
    ffi_body_or!((), {
        if !srq.is_null() {
            // SAFETY: made by Box::into_raw in rbr_srq_create and not yet destroyed.
            drop(unsafe { Box::from_raw(srq) });
        }
    })
}
