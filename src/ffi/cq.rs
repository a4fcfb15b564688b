//! `rbr_cq`: the completion queue and its records.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

use crate::cq::{DEFAULT_SPIN, SPIN_MAX};
use crate::ffi::error::{RBR_EMPTY, RBR_OK, fail, rbr_status};
use crate::ffi::{arg_ref, ffi_body, ffi_body_or, out_ptr, struct_arg, timeout_arg};
use crate::{Completion, CompletionQueue, CqOptions, Error, Opcode, Progress, WcStatus};

/// A completion queue. Create with `rbr_cq_create`, free with `rbr_cq_destroy`. Thread-safe:
/// any thread may poll or wait. Pollers never wait for each other: while one thread takes
/// completions from the queue's connections, a poll on another takes what is queued and
/// returns (RBR_EMPTY if nothing is) rather than waiting for it. Many connections may share
/// one. Connections using it keep it alive; destroying the handle early only drops the
/// caller's reference.
pub struct rbr_cq {
    pub(crate) inner: Arc<CompletionQueue>,
}

/// Opcode: a send finished.
pub const RBR_OP_SEND: u32 = 1;
/// Opcode: a receive was filled.
pub const RBR_OP_RECV: u32 = 2;
/// Opcode: a one-sided write (`rbr_conn_post_write` or `rbr_conn_post_write_imm`) finished.
pub const RBR_OP_WRITE: u32 = 3;
/// Opcode: a one-sided read finished; the bytes are in the local segments.
pub const RBR_OP_READ: u32 = 4;
/// Opcode: a fetch-and-add finished; the remote word as it was is in the local segment.
pub const RBR_OP_FETCH_ADD: u32 = 5;
/// Opcode: a compare-and-swap finished; the remote word as it was is in the local segment.
pub const RBR_OP_CMP_SWAP: u32 = 6;
/// Opcode: a posted receive was consumed by the peer's write with immediate. `imm_data` (with
/// RBR_WC_WITH_IMM in `flags`) carries the value, `byte_len` the bytes written; they are in
/// place. The receive's buffer is not touched.
pub const RBR_OP_RECV_WRITE_IMM: u32 = 7;
/// Opcode (connection event): the connection is down; every work request it had has
/// completed before this record, and none follows it. `status` is RBR_WC_SUCCESS for an
/// orderly close by either side (over verbs this includes a peer process that was killed: its
/// kernel closes the connection), RBR_WC_TRANSPORT when the peer vanished without a close,
/// RBR_WC_PEER_ACCESS when the peer made a one-sided access this side had not allowed, or the
/// error that failed the connection. How soon a vanished peer is noticed: shm at once (its
/// socket closes); verbs, for a lost host or link, within about keepalive_ms (1 s, for an idle
/// connection) + (retry_count + 1) x 4.096 us x 2^ack_timeout: about 3 s with the default
/// options. The host whose own link (RDMA port) goes down fails its connections within
/// (retry_count + 1) x 4.096 us x 2^ack_timeout of the port's going down, keepalive or not.
/// (The times measured are in docs/transports.md, "Verbs".)
pub const RBR_OP_DISCONNECTED: u32 = 16;
/// Opcode (connection event), only for connections started with `rbr_connect_start` or
/// `rbr_request_accept_start`: the connection is established (`status` RBR_WC_SUCCESS; sends
/// and one-sided operations may be posted from now on), or it could not be
/// (RBR_WC_CONNECT_FAILED; `rbr_conn_status` returns the status the blocking call would have,
/// and after a rejection `rbr_conn_private_data` has the listener's private data). A
/// successful CONNECTED record is the connection's first: none of its completions come before
/// it (with a shared receive queue, none of its messages). A failed connection's CONNECTED
/// record is its last: the receives posted while it connected complete RBR_WC_FLUSHED before
/// it, and no RBR_OP_DISCONNECTED follows.
pub const RBR_OP_CONNECTED: u32 = 17;
/// Opcode (shared receive queue event), on the queue named in `rbr_srq_options.cq`: fewer
/// receives are left in the pool than its armed limit (`rbr_srq_set_limit`). `wr_id` is the
/// receives left, `conn_id` 0, `conn_context` the pool's `rbr_srq_options.context`.
pub const RBR_OP_SRQ_LIMIT: u32 = 18;

/// Completion status: success.
pub const RBR_WC_SUCCESS: i32 = 0;
/// The connection went down before the work ran (flushed).
pub const RBR_WC_FLUSHED: i32 = 1;
/// The incoming message was larger than the posted receive buffer.
pub const RBR_WC_LOCAL_LENGTH: i32 = 2;
/// The peer could not take the message (its receive buffer was too small).
pub const RBR_WC_REMOTE_ERROR: i32 = 3;
/// The peer vanished or the link failed (not a peer's bad access: RBR_WC_PEER_ACCESS).
pub const RBR_WC_TRANSPORT: i32 = 4;
/// The local memory region does not allow the access.
pub const RBR_WC_LOCAL_PROTECTION: i32 = 5;
/// The remote memory region does not allow the access.
pub const RBR_WC_REMOTE_ACCESS: i32 = 6;
/// Any other failure.
pub const RBR_WC_GENERAL: i32 = 7;
/// Disconnect events only: the peer made a one-sided access this side had not allowed it (a
/// key it was never given, a range past a region, a right the region does not grant), and the
/// connection failed for it: a misbehaving peer, told apart from one that vanished
/// (RBR_WC_TRANSPORT). Over shm the peer's library checks every access and says so; over
/// verbs this side's device fails the connection's queue pair for the request, and the library
/// finds it so when the peer disconnects. Not reported for a peer that reads or writes where it
/// was allowed, whatever it writes.
pub const RBR_WC_PEER_ACCESS: i32 = 8;
/// RBR_OP_CONNECTED only: the connection could not be established.
pub const RBR_WC_CONNECT_FAILED: i32 = 9;

/// Completion flag: `imm_data` holds immediate data.
pub const RBR_WC_WITH_IMM: u32 = 1;

/// One finished work request or connection event, copied out by `rbr_cq_poll`. Plain data
/// the caller owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rbr_completion {
    /// The caller's work-request id (0 for connection events).
    pub wr_id: u64,
    /// The connection's id (`rbr_conn_id`).
    pub conn_id: u64,
    /// The connection's `context` from its options.
    pub conn_context: *mut c_void,
    /// `RBR_OP_*`.
    pub opcode: u32,
    /// `RBR_WC_*`.
    pub status: i32,
    /// Bytes received (receives only). On a receive that failed with RBR_WC_LOCAL_LENGTH, shm
    /// gives the length of the message that did not fit; verbs gives 0 (devices do not tell).
    /// 0 on every other failure.
    pub byte_len: u32,
    /// Immediate data when `flags & RBR_WC_WITH_IMM`.
    pub imm_data: u32,
    /// `RBR_WC_*` flags.
    pub flags: u32,
    /// Zero.
    pub reserved: u32,
}

impl From<Completion> for rbr_completion {
    fn from(c: Completion) -> Self {
        rbr_completion {
            wr_id: c.wr_id,
            conn_id: c.conn_id,
            conn_context: c.context as *mut c_void,
            opcode: match c.opcode {
                Opcode::Send => RBR_OP_SEND,
                Opcode::Recv => RBR_OP_RECV,
                Opcode::Write => RBR_OP_WRITE,
                Opcode::Read => RBR_OP_READ,
                Opcode::FetchAdd => RBR_OP_FETCH_ADD,
                Opcode::CmpSwap => RBR_OP_CMP_SWAP,
                Opcode::RecvWriteImm => RBR_OP_RECV_WRITE_IMM,
                Opcode::Disconnected => RBR_OP_DISCONNECTED,
                Opcode::Connected => RBR_OP_CONNECTED,
                Opcode::SrqLimit => RBR_OP_SRQ_LIMIT,
            },
            status: match c.status {
                WcStatus::Success => RBR_WC_SUCCESS,
                WcStatus::Flushed => RBR_WC_FLUSHED,
                WcStatus::LocalLength => RBR_WC_LOCAL_LENGTH,
                WcStatus::RemoteError => RBR_WC_REMOTE_ERROR,
                WcStatus::Transport => RBR_WC_TRANSPORT,
                WcStatus::LocalProtection => RBR_WC_LOCAL_PROTECTION,
                WcStatus::RemoteAccess => RBR_WC_REMOTE_ACCESS,
                WcStatus::General => RBR_WC_GENERAL,
                WcStatus::PeerAccess => RBR_WC_PEER_ACCESS,
                WcStatus::ConnectFailed => RBR_WC_CONNECT_FAILED,
            },
            byte_len: c.byte_len,
            imm_data: c.imm.unwrap_or(0),
            flags: if c.imm.is_some() { RBR_WC_WITH_IMM } else { 0 },
            reserved: 0,
        }
    }
}

/// Progress: `RBR_PROGRESS` from the environment (`caller` or `thread`), else
/// RBR_PROGRESS_CALLER.
pub const RBR_PROGRESS_DEFAULT: u32 = 0;
/// Progress (the default): the thread that calls `rbr_cq_poll` or `rbr_cq_wait` takes verbs
/// completions straight from the device, with no thread hand-off and no system call while it
/// polls. It is the default because it measured faster than RBR_PROGRESS_THREAD in latency
/// and streaming, side by side with perftest (the figures are in docs/performance.md).
/// Connection events, keepalives and teardown still run on a library thread, one per context
/// for all its connections. Over shm a post writes its message
/// straight into the shared ring when the peer has a receive posted and the ring has room, and
/// the poller takes incoming messages straight into the posted receives: messages move when
/// either side posts, polls or waits (a thread that sleeps in `rbr_cq_wait` or on `rbr_cq_fd`
/// hands the moving to the library's thread meanwhile), so a receiver that neither polls nor
/// waits holds its peer's sends back, as a full socket buffer would.
pub const RBR_PROGRESS_CALLER: u32 = 1;
/// Progress: a library thread moves each connection's work and queues every completion (the
/// context's one thread for all its connections: verbs on the device's completion events, shm
/// moving messages between the rings and the posted buffers); callers only take completions
/// from the queue.
pub const RBR_PROGRESS_THREAD: u32 = 2;

/// Options of `rbr_cq_create_ex`. Fill with `rbr_cq_options_init`, then change fields. Fields
/// are only ever added at the end; `struct_size` tells which exist.
#[repr(C)]
pub struct rbr_cq_options {
    /// `sizeof(rbr_cq_options)`, set by `rbr_cq_options_init`.
    pub struct_size: u32,
    /// `RBR_PROGRESS_*`. Default RBR_PROGRESS_DEFAULT.
    pub progress: u32,
    /// How long `rbr_cq_wait` keeps polling before it sleeps, at the least, in microseconds
    /// (at most 1000000). With RBR_PROGRESS_CALLER, while completions keep coming soon after
    /// waits start, a wait polls longer: up to four times the longest recent wait (a figure
    /// that shrinks by an eighth with every shorter wait), and at least twice the longest
    /// recent wait that slept and was woken within 1000 us (a figure that shrinks by a
    /// 16384th with every wait that did not sleep: waking up cost more than polling on), never
    /// past 1000 us, so that a steady exchange whose round trip is near spin_us, or that is
    /// held up now and then, does not fall into sleeping. After a
    /// wait longer than 1000 us (the queue went idle, or waking up took that long), waits poll
    /// for spin_us again, except the first and every 16th of a run of such waits, which poll
    /// for 1000 us to find out whether completions come soon again. With RBR_PROGRESS_THREAD
    /// it polls for spin_us exactly. Default 50; 0 never polls: every wait sleeps at once.
    /// On a thread that may run on one CPU only, a wait that polls yields that CPU
    /// (sched_yield) every 20 us, so that the library's thread, which shares it, is not held
    /// up for a scheduler slice.
    pub spin_us: u32,
}

/// Fills `*opts` with the defaults. NULL is ignored.
///
/// # Safety
/// `opts` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_options_init(opts: *mut rbr_cq_options) {
    ffi_body_or!((), {
        if opts.is_null() {
            return;
        }
        // SAFETY: non-NULL and writable (caller contract).
        unsafe {
            opts.write(rbr_cq_options {
                struct_size: std::mem::size_of::<rbr_cq_options>() as u32,
                progress: RBR_PROGRESS_DEFAULT,
                spin_us: DEFAULT_SPIN.as_micros() as u32,
            })
        };
    })
}

fn cq_options(opts: *const rbr_cq_options) -> Result<CqOptions, rbr_status> {
    let mut o = CqOptions::default();
    // SAFETY: NULL or a readable struct (caller contract).
    let Some(c) = (unsafe { struct_arg(opts, "rbr_cq_options") })? else {
        return Ok(o);
    };
    o.progress = match c.progress {
        RBR_PROGRESS_DEFAULT => o.progress,
        RBR_PROGRESS_CALLER => Progress::Caller,
        RBR_PROGRESS_THREAD => Progress::Thread,
        p => {
            return Err(fail(Error::invalid(format!(
                "progress {p} is not an RBR_PROGRESS_* value"
            ))));
        }
    };
    if u128::from(c.spin_us) > SPIN_MAX.as_micros() {
        return Err(fail(Error::invalid(format!(
            "spin_us {} is more than {}",
            c.spin_us,
            SPIN_MAX.as_micros()
        ))));
    }
    o.spin = std::time::Duration::from_micros(c.spin_us.into());
    Ok(o)
}

/// Creates an empty completion queue with the default options into `*out`.
///
/// # Safety
/// `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_create(out: *mut *mut rbr_cq) -> rbr_status {
    crate::ffi::ffi_body!({
        // SAFETY: same contract.
        unsafe { rbr_cq_create_ex(std::ptr::null(), out) }
    })
}

/// Creates an empty completion queue into `*out`. `opts` NULL means the defaults.
///
/// # Safety
/// `opts` is NULL or readable; `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_create_ex(
    opts: *const rbr_cq_options,
    out: *mut *mut rbr_cq,
) -> rbr_status {
    ffi_body!({
        let out = out_ptr!(out);
        let opts = match cq_options(opts) {
            Ok(o) => o,
            Err(s) => return s,
        };
        match CompletionQueue::with_options(opts) {
            Ok(inner) => {
                // SAFETY: `out` is non-NULL and writable (caller contract).
                unsafe { out.write(Box::into_raw(Box::new(rbr_cq { inner }))) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Destroys a completion queue handle. NULL is ignored.
///
/// # Safety
/// `cq` is NULL or a queue from `rbr_cq_create` not yet destroyed, not in use by another call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_destroy(cq: *mut rbr_cq) {
    ffi_body_or!((), {
        if !cq.is_null() {
            // SAFETY: made by Box::into_raw in rbr_cq_create and not yet destroyed.
            drop(unsafe { Box::from_raw(cq) });
        }
    })
}

/// Takes up to `max` completions into `out[0..max]`, oldest first, without blocking.
/// Returns RBR_OK with `*n >= 1`, or RBR_EMPTY with `*n = 0` when none is queued. `max` 0 is
/// RBR_ERR_INVALID. With RBR_PROGRESS_CALLER this is where verbs completions are taken from
/// the device.
///
/// # Safety
/// `out` must be writable for `max` records; `n` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_poll(
    cq: *mut rbr_cq,
    out: *mut rbr_completion,
    max: usize,
    n: *mut usize,
) -> rbr_status {
    ffi_body!({
        let cq = arg_ref!(cq);
        let out = out_ptr!(out);
        let n = out_ptr!(n);
        if max == 0 {
            return fail(Error::invalid("max is 0"));
        }
        // SAFETY: `out` is writable for `max` records (caller contract).
        let slots = unsafe { caller_records(out, max) };
        let got = cq.inner.poll_records(slots);
        // SAFETY: `n` is non-NULL and writable (caller contract).
        unsafe { n.write(got) };
        if got == 0 { RBR_EMPTY } else { RBR_OK }
    })
}

/// The caller's `max` records at `out`, for a poll to fill (records the caller's array cannot
/// hold are never asked for: no slice spans more than isize::MAX bytes).
///
/// # Safety
/// `out` is non-NULL, aligned and writable for `max` records, for the returned lifetime.
unsafe fn caller_records<'a>(
    out: *mut rbr_completion,
    max: usize,
) -> &'a mut [MaybeUninit<rbr_completion>] {
    let max = max.min(isize::MAX as usize / std::mem::size_of::<rbr_completion>());
    // SAFETY: writable for `max` records (the caller's contract); `MaybeUninit` has the
    // record's layout, and nothing is read from the slots before they are written.
    unsafe { std::slice::from_raw_parts_mut(out.cast(), max) }
}

/// Waits until a completion is queued (RBR_OK) or `timeout_ms` passes (RBR_ERR_TIMEOUT);
/// -1 waits forever; below -1 is RBR_ERR_INVALID. Polls first (for the queue's `spin_us`, or with RBR_PROGRESS_CALLER longer
/// while completions keep coming soon after waits start: see rbr_cq_options), then sleeps.
/// Takes nothing from the queue (what it finds in a device stays queued for `rbr_cq_poll`).
///
/// # Safety
/// `cq` must be a live queue.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_wait(cq: *mut rbr_cq, timeout_ms: i32) -> rbr_status {
    ffi_body!({
        let cq = arg_ref!(cq);
        let timeout = match timeout_arg(timeout_ms) {
            Ok(t) => t,
            Err(s) => return s,
        };
        match cq.inner.wait(timeout) {
            Ok(true) => RBR_OK,
            Ok(false) => fail(Error::Timeout("waiting for a completion")),
            Err(e) => fail(e),
        }
    })
}

/// rbr_cq_poll and rbr_cq_wait in one call, as a program that polls until RBR_EMPTY and then
/// waits would make them: takes up to `max` completions into `out[0..max]`, oldest first, and
/// when none is there waits for the first - polling for as long as rbr_cq_wait would, handing
/// what it finds straight into `out` (rbr_cq_wait then rbr_cq_poll pass it through the queue
/// in between), then sleeping as rbr_cq_wait does. Returns RBR_OK with `*n >= 1`, or
/// RBR_ERR_TIMEOUT (nothing written) when `timeout_ms` passes first; -1 waits forever; below -1
/// and `max` 0 are RBR_ERR_INVALID. Several threads may call it on one queue; each completion
/// goes to one of them.
///
/// # Safety
/// `out` must be writable for `max` records; `n` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_poll_wait(
    cq: *mut rbr_cq,
    out: *mut rbr_completion,
    max: usize,
    n: *mut usize,
    timeout_ms: i32,
) -> rbr_status {
    ffi_body!({
        let cq = arg_ref!(cq);
        let out = out_ptr!(out);
        let n = out_ptr!(n);
        if max == 0 {
            return fail(Error::invalid("max is 0"));
        }
        let timeout = match timeout_arg(timeout_ms) {
            Ok(t) => t,
            Err(s) => return s,
        };
        // SAFETY: as in `rbr_cq_poll`.
        let slots = unsafe { caller_records(out, max) };
        match cq.inner.poll_wait_records(slots, timeout) {
            Ok(0) => fail(Error::Timeout("waiting for a completion")),
            Ok(got) => {
                // SAFETY: `n` is non-NULL and writable (caller contract).
                unsafe { n.write(got) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Writes into `*fd` a descriptor for epoll/poll/select that wakes a sleeper when completions
/// (including connection events) are there to take, with no lost wake-up. Level-triggered, it
/// is readable while a poll would find a completion, and unreadable once a poll found nothing
/// and nothing has come since; edge-triggered (EPOLLET), a new edge comes with the first
/// completion after a poll that found the queue empty (RBR_EMPTY, or a call that returned fewer
/// records than asked for). The pattern for both: poll until RBR_EMPTY (or a short batch), then
/// sleep on the descriptor; it may wake with nothing to take (another thread took it, or what
/// woke it is not a completion yet). Handing it out counts as a poll that found nothing.
/// With RBR_PROGRESS_CALLER the program's polls go on moving the messages: the poll that finds
/// the queue empty asks for the descriptor to wake with the next one (shm peers ring a socket
/// in it; verbs devices announce the next completion on a completion channel in it), and no
/// library thread stands between a message and the program. While a thread sleeps in
/// rbr_cq_wait on the same queue, the library's threads move verbs completions instead.
/// The queue owns it: do not read, write or close it. Valid until the queue is destroyed.
///
/// # Safety
/// `cq` must be a live queue; `fd` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_cq_fd(cq: *const rbr_cq, fd: *mut i32) -> rbr_status {
    ffi_body!({
        let cq = arg_ref!(cq);
        let fd = out_ptr!(fd);
        // SAFETY: non-NULL and writable (caller contract).
        unsafe { fd.write(cq.inner.fd()) };
        RBR_OK
    })
}
