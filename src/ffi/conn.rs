//! `rbr_conn`: connections, their options, and posting work.

use std::ffi::{c_char, c_void};
use std::time::Duration;

use crate::ffi::cq::rbr_cq;
use crate::ffi::ctx::rbr_ctx;
use crate::ffi::error::{RBR_IN_PROGRESS, RBR_OK, fail, rbr_status, status};
use crate::ffi::mr::rbr_mr;
use crate::ffi::srq::rbr_srq;
use crate::ffi::{
    arg_ref, arg_str, bytes_arg, copy_out, ffi_body, ffi_body_or, grown_struct_arg, out_ptr,
    private_data_arg,
};
use std::sync::Arc;

use crate::{CompletionQueue, ConnOptions, Connection, Context, Error, SendFlags, Transport};

/// A connection: reliable, in-order messages, like an RC queue pair. Create with `rbr_connect`
/// or `rbr_request_accept` (established when they return), or with `rbr_connect_start` or
/// `rbr_request_accept_start` (connecting; see there); free with `rbr_conn_destroy`.
/// Thread-safe: any thread may post at any time (destroy only when no other call on it is under
/// way). The connection's
/// order is the order in which its posts were made: posts one thread makes one after another
/// keep their order, and posts made at the same moment from several threads take some order
/// among themselves, which the library chooses. (Over shm an unsignaled RDMA write, read or
/// atomic may run at once on the posting thread without the lock that orders the others; it
/// still obeys this.)
pub struct rbr_conn {
    pub(crate) inner: Connection,
}

/// Most bytes of private data a connect, accept or reject may carry (every transport).
pub const RBR_PRIVATE_DATA_MAX: usize = 48;
const _: () = assert!(RBR_PRIVATE_DATA_MAX == crate::PRIVATE_DATA_MAX);

/// Most bytes of private data the library can hand over from a peer: a peer using this library
/// sends at most RBR_PRIVATE_DATA_MAX, but a plain librdmacm peer's data arrives as RDMA CM
/// delivers it, padded with zeros (up to 56 bytes in a request, 196 in an accept, 148 in a
/// reject). A buffer of this size always holds it whole.
pub const RBR_PRIVATE_DATA_RECV_MAX: usize = 196;

/// Send flag: report a completion when the send (or one-sided operation) finishes. Without it
/// the operation reports only a failure, and its slot of the send queue still frees once it is
/// done: the library sees to it, so no signaled post once per send-queue depth is needed (over
/// verbs a full queue empties as the completion queue is polled).
pub const RBR_SEND_SIGNALED: u32 = 1;

/// Transport: shared memory on this host.
pub const RBR_TRANSPORT_SHM: u32 = 1;
/// Transport: RDMA verbs.
pub const RBR_TRANSPORT_VERBS: u32 = 2;

/// Options of `rbr_connect` and `rbr_request_accept`. Fill with `rbr_conn_options_init`,
/// then change fields. Fields are only ever added at the end; `struct_size` tells which exist.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rbr_conn_options {
    /// `sizeof(rbr_conn_options)`, set by `rbr_conn_options_init`.
    pub struct_size: u32,
    /// Most sends outstanding at once (1..=16384). Default 128.
    pub send_queue_depth: u32,
    /// Most receives outstanding at once (1..=16384). Default 128.
    pub recv_queue_depth: u32,
    /// Largest inline send (at most 1024). Default 64.
    pub max_inline: u32,
    /// How long the call may wait for the peer, in ms; -1 = no limit; 0 is invalid (it would
    /// leave no time for the peer to answer). Default 5000.
    /// `rbr_connect`: establishment in all (address and route resolution, the handshake).
    /// `rbr_request_accept`: over verbs, the wait for the peer to confirm the accept; shm does
    /// not wait for the peer (its accept takes about the time of creating the connection).
    pub timeout_ms: i32,
    /// Private data for the peer; copied during the call. NULL when `private_data_len` is 0.
    pub private_data: *const c_void,
    /// At most `RBR_PRIVATE_DATA_MAX`; checked before any byte of `private_data` is read.
    pub private_data_len: usize,
    /// Echoed as `conn_context` in every completion of the connection.
    pub context: *mut c_void,
    /// Verbs: resends of an unacknowledged packet before the connection fails (0..=7).
    /// Default 6 (some devices, soft-RoCE among them, read 7 as "forever"). Ignored by shm.
    pub retry_count: u8,
    /// Verbs, toward plain librdmacm peers and toward a peer whose connection has a shared
    /// receive queue: retries of a send that found no receive posted (0..=7; 7 = without
    /// limit). Default 7. Between peers using this library a send waits
    /// for the peer's receive in the library (receive credits; over shm in the ring). When
    /// this side accepts, the device uses what the connecting peer asked for instead. Ignored
    /// by shm.
    pub rnr_retry_count: u8,
    /// Verbs: ACK timeout exponent t, waiting 4.096 us * 2^t before a resend (0..=31).
    /// Default 16 (about 0.27 s). Ignored by shm.
    pub ack_timeout: u8,
    /// Verbs: how long a connection to a library peer may sit with no send outstanding before
    /// the library sends a keepalive (a zero-length RDMA write), so that a lost peer is noticed
    /// on an idle connection too; in ms, 1..=3600000, or 0 for none. Default 1000. Ignored by
    /// shm and toward plain peers.
    pub keepalive_ms: u32,
    /// Shared memory: bytes of each of the connection's two rings (one per direction), in
    /// which messages wait for their receives. The larger of the two sides' values holds; 0 on
    /// both gives 32 KiB. 0, or a multiple of 4096 from 16 KiB to 1 GiB. When the peer may
    /// read this process's memory (docs/transports.md), a message of at least 1 KiB from a
    /// region `rbr_mr_alloc` made, or of at least 256 KiB from other memory, takes only a
    /// 48-byte record of it: the receiver copies the bytes from where they are. A larger ring
    /// lets more of the other messages wait in it before sends wait for room in the sender's
    /// library, at that much memory per connection. Default 0. Ignored by verbs.
    /// (Since 2026-12: a caller built against an earlier header, whose struct ends before this
    /// field, gets 0.)
    pub shm_ring_size: u32,
    /// The shared receive queue the connection takes its receives from (of the same
    /// context), instead of receives posted to it; NULL for none. `recv_queue_depth` is then
    /// unused. Default NULL. (Since 2026-12: a caller built against an earlier header gets
    /// NULL.)
    pub srq: *mut rbr_srq,
}

/// `sizeof(rbr_conn_options)` before `shm_ring_size`, the first field added.
const CONN_OPTIONS_FIRST_SIZE: usize = std::mem::offset_of!(rbr_conn_options, shm_ring_size);

/// What a connection was granted; filled by `rbr_conn_get_info`. Set `struct_size` first.
#[repr(C)]
pub struct rbr_conn_info {
    /// `sizeof(rbr_conn_info)` as the caller knows it.
    pub struct_size: u32,
    /// `RBR_TRANSPORT_*`.
    pub transport: u32,
    /// The connection's id.
    pub id: u64,
    /// Granted send queue depth.
    pub send_queue_depth: u32,
    /// Granted receive queue depth.
    pub recv_queue_depth: u32,
    /// Granted inline size.
    pub max_inline: u32,
    /// Shared memory: bytes of each of its rings (see `rbr_conn_options.shm_ring_size`); 0
    /// over verbs. (Zero before 2026-12, in the same place.)
    pub shm_ring_size: u32,
}

/// Fills `*opts` with the defaults. NULL is ignored.
///
/// # Safety
/// `opts` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_options_init(opts: *mut rbr_conn_options) {
    ffi_body_or!((), {
        if opts.is_null() {
            return;
        }
        // SAFETY: non-NULL and writable (caller contract).
        unsafe { opts.write(default_options()) };
    })
}

fn default_options() -> rbr_conn_options {
    let d = ConnOptions::default();
    rbr_conn_options {
        struct_size: std::mem::size_of::<rbr_conn_options>() as u32,
        send_queue_depth: d.send_queue_depth,
        recv_queue_depth: d.recv_queue_depth,
        max_inline: d.max_inline,
        timeout_ms: d.timeout.map_or(-1, |t| t.as_millis() as i32),
        private_data: std::ptr::null(),
        private_data_len: 0,
        context: std::ptr::null_mut(),
        retry_count: d.retry_count,
        rnr_retry_count: d.rnr_retry_count,
        ack_timeout: d.ack_timeout,
        keepalive_ms: d.keepalive.map_or(0, |k| k.as_millis() as u32),
        shm_ring_size: d.shm_ring_size,
        srq: std::ptr::null_mut(),
    }
}

/// Converts C options (NULL = defaults) into validated Rust options.
pub(crate) fn options(opts: *const rbr_conn_options) -> Result<ConnOptions, rbr_status> {
    // SAFETY: NULL or a readable struct (caller contract of every function taking options).
    let grown = unsafe {
        grown_struct_arg(
            opts,
            "rbr_conn_options",
            CONN_OPTIONS_FIRST_SIZE,
            default_options(),
        )
    };
    let Some(o) = grown? else {
        return Ok(ConnOptions::default());
    };
    let timeout = match o.timeout_ms {
        -1 => None,
        ms if ms >= 0 => Some(Duration::from_millis(ms as u64)),
        ms => return Err(fail(Error::invalid(format!("timeout_ms {ms}")))),
    };
    let r = ConnOptions {
        send_queue_depth: o.send_queue_depth,
        recv_queue_depth: o.recv_queue_depth,
        max_inline: o.max_inline,
        timeout,
        private_data: private_data_arg(o.private_data, o.private_data_len)?.to_vec(),
        context: o.context as usize,
        retry_count: o.retry_count,
        rnr_retry_count: o.rnr_retry_count,
        ack_timeout: o.ack_timeout,
        keepalive: (o.keepalive_ms != 0).then(|| Duration::from_millis(o.keepalive_ms.into())),
        shm_ring_size: o.shm_ring_size,
        // SAFETY: NULL or live (caller contract of every function taking options).
        srq: unsafe { o.srq.as_ref() }.map(|s| s.inner.clone()),
    };
    r.validate().map_err(fail)?;
    Ok(r)
}

pub(crate) fn finish(r: crate::Result<Connection>, out: *mut *mut rbr_conn) -> rbr_status {
    match r {
        Ok(inner) => {
            // SAFETY: `out` was checked non-NULL by the caller of `finish` and is writable.
            unsafe { out.write(Box::into_raw(Box::new(rbr_conn { inner }))) };
            RBR_OK
        }
        Err(e) => fail(e),
    }
}

/// `rbr_connect` and `rbr_connect_start`: checks the arguments and connects with `connect`
/// (inside their panic boundary).
///
/// # Safety
/// As theirs.
unsafe fn connect_with(
    ctx: *mut rbr_ctx,
    addr: *const c_char,
    cq: *mut rbr_cq,
    opts: *const rbr_conn_options,
    out: *mut *mut rbr_conn,
    connect: fn(&Context, &str, &Arc<CompletionQueue>, &ConnOptions) -> crate::Result<Connection>,
) -> rbr_status {
    let ctx = arg_ref!(ctx);
    let addr = arg_str!(addr);
    let cq = arg_ref!(cq);
    let out = out_ptr!(out);
    let opts = match options(opts) {
        Ok(o) => o,
        Err(s) => return s,
    };
    finish(connect(&ctx.inner, addr, &cq.inner, &opts), out)
}

/// Connects to the listener at `addr` and writes the connection into `*out`; its completions
/// go to `cq`. Blocks at most `opts->timeout_ms`. RBR_ERR_REFUSED: nobody listens there;
/// RBR_ERR_REJECTED: the listener said no (`rbr_last_reject_data` has its private data);
/// RBR_ERR_TIMEOUT: no answer in time.
///
/// # Safety
/// `ctx`, `cq` live; `addr` a NUL-terminated string; `opts` NULL or readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_connect(
    ctx: *mut rbr_ctx,
    addr: *const c_char,
    cq: *mut rbr_cq,
    opts: *const rbr_conn_options,
    out: *mut *mut rbr_conn,
) -> rbr_status {
    ffi_body!({
        // SAFETY: as this function's contract.
        unsafe { connect_with(ctx, addr, cq, opts, out, Context::connect) }
    })
}

/// Starts connecting to the listener at `addr` and returns at once, writing the connection
/// into `*out` in a connecting state; its completions go to `cq`. The outcome arrives on `cq`
/// as an RBR_OP_CONNECTED record: RBR_WC_SUCCESS once established, RBR_WC_CONNECT_FAILED when
/// it could not be (then `rbr_conn_status` returns what `rbr_connect` would have:
/// RBR_ERR_REFUSED, RBR_ERR_REJECTED with the listener's private data in
/// `rbr_conn_private_data`, RBR_ERR_TIMEOUT after `opts->timeout_ms`, ...). While it connects,
/// receives may be posted (they are posted in order once it is up, at most
/// `opts->recv_queue_depth` of them); sends and one-sided posts return RBR_ERR_STATE. Only
/// bad arguments fail here (RBR_ERR_INVALID, RBR_ERR_ADDRESS, ...), and nothing is made then.
/// Destroying the connection while it connects ends the attempt; nothing more is reported.
///
/// # Safety
/// `ctx`, `cq` live; `addr` a NUL-terminated string; `opts` NULL or readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_connect_start(
    ctx: *mut rbr_ctx,
    addr: *const c_char,
    cq: *mut rbr_cq,
    opts: *const rbr_conn_options,
    out: *mut *mut rbr_conn,
) -> rbr_status {
    ffi_body!({
        // SAFETY: as this function's contract.
        unsafe { connect_with(ctx, addr, cq, opts, out, Context::connect_start) }
    })
}

/// Where a connection made by `rbr_connect_start` or `rbr_request_accept_start` stands:
/// RBR_OK once established (and after it goes down: the RBR_OP_DISCONNECTED record says
/// that), RBR_IN_PROGRESS while it connects, or the status its set-up failed with - the one the
/// blocking call returns - with its message in `rbr_last_error` (and, for RBR_ERR_REJECTED,
/// the listener's private data in `rbr_last_reject_data` and `rbr_conn_private_data`).
/// A connection made by a blocking call is always RBR_OK.
///
/// # Safety
/// `conn` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_status(conn: *const rbr_conn) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        match conn.inner.established() {
            Ok(true) => RBR_OK,
            Ok(false) => RBR_IN_PROGRESS,
            Err(e) => fail(e),
        }
    })
}

/// Posts a send of `mr[offset..offset+len]`. The bytes must not change until the send
/// completes. `flags`: `RBR_SEND_SIGNALED` (any other bit is RBR_ERR_INVALID).
/// RBR_ERR_RANGE when the range is not inside the region; RBR_ERR_INVALID when `len` is over
/// 4 GiB - 1 or the region belongs to another context. RBR_ERR_QUEUE_FULL when the send queue
/// is full; RBR_ERR_DISCONNECTED once the connection is down (closed by either side, or
/// failed). Nothing is posted on any error.
///
/// # Safety
/// `conn`, `mr` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_post_send(
    conn: *mut rbr_conn,
    mr: *const rbr_mr,
    offset: usize,
    len: usize,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let mr = arg_ref!(mr);
        status(
            conn.inner
                .post_send(&mr.inner, offset, len, wr_id, SendFlags(flags)),
        )
    })
}

/// Posts a send of `buf[0..len]`, copied before this returns, so `buf` may be reused at once.
/// `len` may be at most the connection's granted `max_inline` (RBR_ERR_INVALID beyond it).
/// Flags and the other errors as for `rbr_conn_post_send`.
///
/// # Safety
/// `conn` live; `buf` readable for `len` bytes (NULL allowed when `len` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_post_send_inline(
    conn: *mut rbr_conn,
    buf: *const c_void,
    len: usize,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let data = match bytes_arg(buf, len) {
            Ok(d) => d,
            Err(s) => return s,
        };
        status(conn.inner.post_send_inline(data, wr_id, SendFlags(flags)))
    })
}

/// Posts a receive into `mr[offset..offset+len]` (the region needs RBR_ACCESS_LOCAL_WRITE).
/// Messages fill receives in the order they were posted; a message longer than its receive
/// completes it with RBR_WC_LOCAL_LENGTH and fails the connection. RBR_ERR_ACCESS when the
/// region lacks RBR_ACCESS_LOCAL_WRITE; RBR_ERR_QUEUE_FULL when the receive queue is full;
/// the other errors as for `rbr_conn_post_send`.
///
/// # Safety
/// `conn`, `mr` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_post_recv(
    conn: *mut rbr_conn,
    mr: *const rbr_mr,
    offset: usize,
    len: usize,
    wr_id: u64,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let mr = arg_ref!(mr);
        status(conn.inner.post_recv(&mr.inner, offset, len, wr_id))
    })
}

/// Copies the private data the peer sent (the acceptor's on the connecting side, the
/// requester's on the accepting side) into `buf` (at most `cap` bytes) and writes its full
/// length into `*len`; a `len` above `cap` means it was cut short. `buf` may be NULL when `cap`
/// is 0, to ask for the length. A buffer of RBR_PRIVATE_DATA_RECV_MAX bytes always suffices.
///
/// # Safety
/// `conn` live; `buf` writable for `cap` bytes; `len` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_private_data(
    conn: *const rbr_conn,
    buf: *mut c_void,
    cap: usize,
    len: *mut usize,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let len = out_ptr!(len);
        // SAFETY: the caller's contract above is copy_out's.
        unsafe { copy_out(conn.inner.private_data(), buf, cap, len) }
    })
}

/// Fills `*info` (whose `struct_size` the caller sets) with what the connection was granted.
/// A `struct_size` smaller than any version of the struct is RBR_ERR_INVALID.
///
/// # Safety
/// `conn` live; `info` readable and writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_get_info(
    conn: *const rbr_conn,
    info: *mut rbr_conn_info,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let info = out_ptr!(info);
        // SAFETY: non-NULL and readable (caller contract).
        let size = unsafe { (*info).struct_size } as usize;
        if size < std::mem::size_of::<rbr_conn_info>() {
            return fail(Error::invalid("rbr_conn_info.struct_size is too small"));
        }
        let i = conn.inner.info();
        // SAFETY: non-NULL and writable for at least our struct's size (checked above).
        unsafe {
            info.write(rbr_conn_info {
                struct_size: std::mem::size_of::<rbr_conn_info>() as u32,
                transport: match i.transport {
                    Transport::Shm => RBR_TRANSPORT_SHM,
                    Transport::Verbs => RBR_TRANSPORT_VERBS,
                },
                id: i.id,
                send_queue_depth: i.send_queue_depth,
                recv_queue_depth: i.recv_queue_depth,
                max_inline: i.max_inline,
                shm_ring_size: i.shm_ring_size,
            })
        };
        RBR_OK
    })
}

/// The connection's id (as in its completions), or 0 for NULL.
///
/// # Safety
/// `conn` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_id(conn: *const rbr_conn) -> u64 {
    ffi_body_or!(0, {
        // SAFETY: NULL or live (caller contract).
        unsafe { conn.as_ref() }.map_or(0, |c| c.inner.id())
    })
}

/// Starts an orderly disconnect and returns at once. Outstanding work completes with
/// RBR_WC_FLUSHED, then an RBR_OP_DISCONNECTED record arrives on the completion queue. The peer
/// gets its own RBR_OP_DISCONNECTED. Calling it again does nothing.
///
/// # Safety
/// `conn` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_disconnect(conn: *mut rbr_conn) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        conn.inner.disconnect();
        RBR_OK
    })
}

/// Disconnects (if still connected), completes outstanding work as flushed (the records still
/// reach the completion queue, followed by RBR_OP_DISCONNECTED), and frees the connection.
/// Returns in bounded time whatever the peer does. NULL is ignored.
///
/// # Safety
/// `conn` is NULL or a connection not yet destroyed, with no other call on it under way.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_destroy(conn: *mut rbr_conn) {
    ffi_body_or!((), {
        if !conn.is_null() {
            // SAFETY: made by Box::into_raw in `finish` and not yet destroyed.
            drop(unsafe { Box::from_raw(conn) });
        }
    })
}
