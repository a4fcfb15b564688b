//! One-sided operations: remote-memory descriptors, RDMA write (with immediate), read and
//! atomics.
//!
//! Ordering on one connection: operations start and complete in the order they were posted,
//! and a write's bytes are in place at the peer before any later message or
//! write-with-immediate of the connection is delivered there. One exception: a send or write
//! with immediate that waits for the peer's receive (toward a library peer) keeps its place
//! among the sends and writes with immediate, but writes, reads and atomics posted after it do
//! not wait behind it: they may start and complete first.

use std::ffi::c_void;

use crate::conn::{REMOTE_DESC_LEN, RdmaOp, SGE_MAX};
use crate::ffi::conn::rbr_conn;
use crate::ffi::error::{RBR_OK, fail, null_arg, rbr_status, status};
use crate::ffi::mr::rbr_mr;
use crate::ffi::{arg_ref, bytes_arg, ffi_body, out_ptr};
use crate::{Access, Error, RemoteRegion, SendFlags, Sge};

/// Bytes of a packed remote-memory descriptor (`rbr_conn_pack_region`). Its layout is fixed:
/// bytes 0..2 "RB", 2 version (1), 3 transport (RBR_TRANSPORT_*), 4 the remote RBR_ACCESS_*
/// bits, 5..8 zero, 8..16 the region's address in its owner's process, 16..24 its length,
/// 24..28 its key, 28..32 zero; numbers little endian. A key is 32 bits on both transports
/// (over verbs the rkey), so a program may carry address, length and a 4-byte key its own way
/// and rebuild the remote with `rbr_conn_remote_from_raw`, over either transport.
pub const RBR_REMOTE_DESC_LEN: usize = 32;
const _: () = assert!(RBR_REMOTE_DESC_LEN == REMOTE_DESC_LEN);

/// Most local segments one one-sided operation may gather from or scatter into.
pub const RBR_SGE_MAX: usize = 4;
const _: () = assert!(RBR_SGE_MAX == SGE_MAX);

/// One local segment of a one-sided operation: `len` bytes at `offset` of `mr`.
#[repr(C)]
pub struct rbr_sge {
    /// The region (of the connection's context).
    pub mr: *const rbr_mr,
    /// Where the segment starts in the region.
    pub offset: usize,
    /// Its length in bytes.
    pub len: usize,
}

/// A peer's memory region as this side targets it, filled by `rbr_conn_unpack_remote` or
/// `rbr_conn_remote_from_raw` and valid on that connection only. A plain value: copy it
/// freely; it needs no freeing.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rbr_remote {
    /// The region's address in the peer's process.
    pub addr: u64,
    /// Its length in bytes, as described.
    pub len: u64,
    /// The key the peer's library checks each access against (32 bits: a larger value is
    /// RBR_ERR_INVALID at the post).
    pub key: u64,
    /// The remote RBR_ACCESS_* bits the peer described; after `rbr_conn_remote_from_raw`,
    /// all three (raw fields say nothing of them). Informative only: the peer's library or
    /// device checks each access against what it registered.
    pub access: u32,
    /// Zero.
    pub reserved: u32,
    /// The connection it was unpacked on (`rbr_conn_id`).
    pub conn_id: u64,
}

impl From<RemoteRegion> for rbr_remote {
    fn from(r: RemoteRegion) -> Self {
        rbr_remote {
            addr: r.addr,
            len: r.len,
            key: r.key,
            access: r.access.0,
            reserved: 0,
            conn_id: r.conn_id,
        }
    }
}

impl From<&rbr_remote> for RemoteRegion {
    fn from(r: &rbr_remote) -> Self {
        RemoteRegion {
            addr: r.addr,
            len: r.len,
            key: r.key,
            access: Access(r.access),
            conn_id: r.conn_id,
        }
    }
}

/// Lets the peer of `conn` reach `mr` with one-sided operations, as far as the region's
/// RBR_ACCESS_REMOTE_* bits allow, and writes the descriptor to send it into `desc`
/// (RBR_REMOTE_DESC_LEN bytes). The region stays reachable until it is destroyed. A region
/// without RBR_ACCESS_REMOTE_* bits is RBR_ERR_ACCESS; a region of another context,
/// RBR_ERR_INVALID.
///
/// Over shm a region from `rbr_mr_alloc` is mapped by the peer, which then writes, reads and
/// runs atomics on it with no system call; caller memory (`rbr_mr_register`) is reached with
/// process_vm_readv/writev where the kernel lets the peer do so, and otherwise this returns
/// RBR_ERR_UNSUPPORTED, as it does for caller memory with RBR_ACCESS_REMOTE_ATOMIC (atomics
/// need the shared mapping). Over shm at most 256 regions may be reachable through one
/// connection at once (RBR_ERR_INVALID beyond that, until some are destroyed), counting up to
/// 64 allocated regions that messages of 1 KiB or more were sent from (the peer copies those
/// out of its mapping of the region).
///
/// # Safety
/// `conn`, `mr` live; `desc` writable for RBR_REMOTE_DESC_LEN bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_pack_region(
    conn: *mut rbr_conn,
    mr: *const rbr_mr,
    desc: *mut u8,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let mr = arg_ref!(mr);
        let desc = out_ptr!(desc);
        match conn.inner.pack_region(&mr.inner) {
            Ok(d) => {
                // SAFETY: `desc` is writable for RBR_REMOTE_DESC_LEN bytes (contract).
                unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), desc, d.len()) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Unpacks the peer's descriptor `desc[0..len]` (from its `rbr_conn_pack_region`) into
/// `*out`, for use on `conn`. Only the descriptor's form is checked here (RBR_ERR_INVALID when
/// it is not one, or is for another transport); every access is checked against what the peer
/// registered when it runs.
///
/// # Safety
/// `conn` live; `desc` readable for `len` bytes; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_unpack_remote(
    conn: *const rbr_conn,
    desc: *const c_void,
    len: usize,
    out: *mut rbr_remote,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let out = out_ptr!(out);
        let desc = match bytes_arg(desc, len) {
            Ok(d) => d,
            Err(s) => return s,
        };
        match conn.inner.unpack_remote(desc) {
            Ok(r) => {
                // SAFETY: `out` is writable (contract) and was checked non-NULL.
                unsafe { out.write(r.into()) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Fills `*out` from raw fields, for peers that send address, length and key in their own
/// format (a plain librdmacm peer such as rping sends its buffer's address, rkey and length;
/// for a region of this library, over either transport, they are bytes 8..16, 16..24 and
/// 24..28 of its packed descriptor). `out->access` is every remote right
/// (RBR_ACCESS_REMOTE_WRITE | RBR_ACCESS_REMOTE_READ | RBR_ACCESS_REMOTE_ATOMIC); what the peer
/// allows is checked when an access runs. A range that wraps past the end of the address space,
/// or a key wider than 32 bits, is RBR_ERR_INVALID.
///
/// # Safety
/// `conn` live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_remote_from_raw(
    conn: *const rbr_conn,
    addr: u64,
    len: u64,
    key: u64,
    out: *mut rbr_remote,
) -> rbr_status {
    ffi_body!({
        let conn = arg_ref!(conn);
        let out = out_ptr!(out);
        match conn.inner.remote_from_raw(addr, len, key) {
            Ok(r) => {
                // SAFETY: `out` is writable (contract) and was checked non-NULL.
                unsafe { out.write(r.into()) };
                RBR_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Checks a C segment list (`NULL` allowed when `n` is 0): at most `SGE_MAX` entries, each
/// naming a region. Returns the entries, which [`sge`] turns into segments the core checks.
///
/// # Safety
/// `sgl` readable for `n` entries whose non-NULL `mr` are live.
unsafe fn segments<'a>(sgl: *const rbr_sge, n: usize) -> Result<&'a [rbr_sge], rbr_status> {
    if n > SGE_MAX {
        return Err(fail(Error::invalid(format!(
            "{n} local segments; at most {SGE_MAX}"
        ))));
    }
    if n == 0 {
        return Ok(&[]);
    }
    if sgl.is_null() {
        return Err(null_arg("sgl"));
    }
    // SAFETY: `sgl` is readable for `n` entries (contract).
    let list = unsafe { std::slice::from_raw_parts(sgl, n) };
    if list.iter().any(|e| e.mr.is_null()) {
        return Err(null_arg("sgl[i].mr"));
    }
    Ok(list)
}

/// An entry of a list [`segments`] passed.
///
/// # Safety
/// `e.mr` is a live region (non-NULL: checked by `segments`).
unsafe fn sge<'a>(e: &rbr_sge) -> Sge<'a> {
    Sge {
        // SAFETY: the caller's contract.
        mr: unsafe { &(*e.mr).inner },
        offset: e.offset,
        len: e.len,
    }
}

/// The connection, the one local segment and the remote region of a transfer call with exactly
/// one segment and every pointer set (the common small operation, which the short ways take);
/// `None` otherwise (the general way then checks the arguments and reports). Nothing here may
/// panic: `rbr_conn_post_write` runs it ahead of its catch of panics.
///
/// # Safety
/// As [`post_transfer`].
#[inline(always)]
#[deny(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]
unsafe fn one_segment<'a>(
    conn: *mut rbr_conn,
    sgl: *const rbr_sge,
    nsge: usize,
    remote: *const rbr_remote,
) -> Option<(&'a rbr_conn, Sge<'a>, RemoteRegion)> {
    if nsge != 1 || conn.is_null() || sgl.is_null() || remote.is_null() {
        return None;
    }
    // SAFETY: non-NULL, so live and readable (contract).
    let (c, e, r): (&rbr_conn, &rbr_sge, RemoteRegion) =
        unsafe { (&*conn, &*sgl, (&*remote).into()) };
    if e.mr.is_null() {
        return None;
    }
    // SAFETY: a non-NULL `mr` is live (contract).
    Some((c, unsafe { sge(e) }, r))
}

/// The body of the three transfer calls. A write (without immediate) or read of one segment,
/// every pointer set, goes the short way first ([`Connection::rdma_single`](crate::Connection));
/// anything that declines, a failed check included, goes the general way, which makes the
/// checks again and reports.
///
/// # Safety
/// As theirs.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn post_transfer(
    conn: *mut rbr_conn,
    sgl: *const rbr_sge,
    nsge: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    op: RdmaOp,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    // SAFETY: the caller's contract.
    if let Some((c, one, r)) = unsafe { one_segment(conn, sgl, nsge, remote) }
        && let Some(res) = c
            .inner
            .rdma_single(op, &one, &r, remote_offset, wr_id, SendFlags(flags))
    {
        return status(res);
    }
    // SAFETY: the caller's contract.
    unsafe { post_transfer_general(conn, sgl, nsge, remote, remote_offset, op, wr_id, flags) }
}

/// [`post_transfer`]'s general way, out of line: the short way's frame stays small.
///
/// # Safety
/// As [`post_transfer`].
#[allow(clippy::too_many_arguments)]
#[inline(never)]
unsafe fn post_transfer_general(
    conn: *mut rbr_conn,
    sgl: *const rbr_sge,
    nsge: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    op: RdmaOp,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    let conn = arg_ref!(conn);
    let remote: RemoteRegion = arg_ref!(remote).into();
    // SAFETY: the caller's contract.
    let list = match unsafe { segments(sgl, nsge) } {
        Ok(l) => l,
        Err(s) => return s,
    };
    // SAFETY: `segments` checked every entry's region is non-NULL; live by contract.
    let local = list.iter().map(|e| unsafe { sge(e) });
    status(
        conn.inner
            .transfer(op, local, &remote, remote_offset, wr_id, SendFlags(flags)),
    )
}

/// Posts an RDMA write of the local segments `sgl[0..nsge]` (gathered in order; none for a
/// zero-length write) to `remote_offset` of `remote` (which needs RBR_ACCESS_REMOTE_WRITE at
/// the peer). The local bytes must not change until the write completes (RBR_OP_WRITE). When
/// it completes the bytes are in the peer's memory; the peer is sure to see them once it has
/// received a later message or write-with-immediate of this connection. A key the peer did
/// not give, a range outside its region, or a region without the access is posted and
/// completes the write with RBR_WC_REMOTE_ACCESS (signaled or not), touches no byte of the
/// peer's memory, and fails the connection, as over verbs; the peer's connection ends with
/// RBR_WC_PEER_ACCESS. `flags`: RBR_SEND_SIGNALED. Unsignaled, the write holds a slot of the
/// send queue until it is done: over shm it runs during the call (the source may change once it
/// returns); over verbs the slot frees, and the source may change, once a later completion of
/// the send queue is taken (the library asks the device for one every few unsignaled requests
/// and takes it at the next poll; no signaled post is needed), at once for a write of at most
/// max_inline bytes. RBR_ERR_QUEUE_FULL when the send queue is full.
/// Refused at once (nothing posted): `nsge` above RBR_SGE_MAX, a segment with a NULL `mr`
/// (RBR_ERR_NULL), of another context, or over 4 GiB - 1 in all, a `remote` unpacked on another
/// connection or with a key wider than 32 bits, a `remote_offset` that wraps, an unknown flag
/// (RBR_ERR_INVALID); a segment outside its region (RBR_ERR_RANGE); a connection that is down
/// (RBR_ERR_DISCONNECTED).
///
/// # Safety
/// `conn`, `remote` live; `sgl` readable for `nsge` entries whose `mr` are live (NULL allowed
/// when `nsge` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_post_write(
    conn: *mut rbr_conn,
    sgl: *const rbr_sge,
    nsge: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    // The unsignaled write a transport finishes at once, ahead of the catch of panics (none
    // can happen on its way: see `one_segment` and `Connection::write_direct`).
    if flags == 0
        // SAFETY: the caller's contract is post_transfer's.
        && let Some((c, one, r)) = unsafe { one_segment(conn, sgl, nsge, remote) }
        && c.inner.write_direct(&one, &r, remote_offset)
    {
        return RBR_OK;
    }
    let op = RdmaOp::Write { imm: None };
    ffi_body!({
        // SAFETY: the caller's contract is post_transfer's.
        unsafe { post_transfer(conn, sgl, nsge, remote, remote_offset, op, wr_id, flags) }
    })
}

/// As `rbr_conn_post_write`, then consumes a receive posted at the peer, which completes
/// with RBR_OP_RECV_WRITE_IMM carrying `imm` and the length written, after the bytes are in
/// place. Like a send it waits for the peer to have a receive posted.
///
/// # Safety
/// As `rbr_conn_post_write`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn rbr_conn_post_write_imm(
    conn: *mut rbr_conn,
    sgl: *const rbr_sge,
    nsge: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    imm: u32,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    let op = RdmaOp::Write { imm: Some(imm) };
    ffi_body!({
        // SAFETY: the caller's contract is post_transfer's.
        unsafe { post_transfer(conn, sgl, nsge, remote, remote_offset, op, wr_id, flags) }
    })
}

/// Posts an RDMA read of the peer's bytes at `remote_offset` of `remote` (which needs
/// RBR_ACCESS_REMOTE_READ at the peer) into the local segments `sgl[0..nsge]` (scattered in
/// order; their regions need RBR_ACCESS_LOCAL_WRITE). Completes with RBR_OP_READ when the bytes
/// are in place. Errors as for `rbr_conn_post_write`.
///
/// # Safety
/// As `rbr_conn_post_write`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbr_conn_post_read(
    conn: *mut rbr_conn,
    sgl: *const rbr_sge,
    nsge: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    let op = RdmaOp::Read;
    ffi_body!({
        // SAFETY: the caller's contract is post_transfer's.
        unsafe { post_transfer(conn, sgl, nsge, remote, remote_offset, op, wr_id, flags) }
    })
}

/// The body of the two atomic calls.
///
/// # Safety
/// As theirs.
#[allow(clippy::too_many_arguments)]
unsafe fn post_atomic(
    conn: *mut rbr_conn,
    mr: *const rbr_mr,
    offset: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    op: RdmaOp,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    let conn = arg_ref!(conn);
    let mr = arg_ref!(mr);
    let remote: RemoteRegion = arg_ref!(remote).into();
    status(conn.inner.atomic(
        op,
        &mr.inner,
        offset,
        &remote,
        remote_offset,
        wr_id,
        SendFlags(flags),
    ))
}

/// Atomically adds `add` to the peer's 8-byte word at `remote_offset` of `remote` (8-byte
/// aligned; the peer's region needs RBR_ACCESS_REMOTE_ATOMIC). The word as it was lands in
/// `mr[offset..offset+8]` (8-byte aligned, RBR_ACCESS_LOCAL_WRITE) in host byte order; the
/// operation completes with RBR_OP_FETCH_ADD. Atomic against every other atomic on the word,
/// from any connection, and over shm against the owner's own atomic instructions too.
/// Refused at once (nothing posted, no completion, the connection stays up): a local word
/// (`mr` + `offset`) or remote word (`remote->addr + remote_offset`) not 8-byte aligned, a
/// `remote_offset` that wraps, `mr` of another context, a `remote` unpacked on another
/// connection or with a key wider than 32 bits, an unknown flag (RBR_ERR_INVALID); `mr[offset..offset+8]` outside the region (RBR_ERR_RANGE); `mr`
/// without RBR_ACCESS_LOCAL_WRITE (RBR_ERR_ACCESS); a full send queue (RBR_ERR_QUEUE_FULL); a
/// connection that is down (RBR_ERR_DISCONNECTED).
///
/// # Safety
/// `conn`, `mr`, `remote` live.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn rbr_conn_post_fetch_add(
    conn: *mut rbr_conn,
    mr: *const rbr_mr,
    offset: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    add: u64,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    let op = RdmaOp::FetchAdd { add };
    // SAFETY: the caller's contract is post_atomic's.
    ffi_body!({ unsafe { post_atomic(conn, mr, offset, remote, remote_offset, op, wr_id, flags) } })
}

/// Atomically stores `swap` in the peer's 8-byte word at `remote_offset` of `remote` if the
/// word equals `compare`. The word as it was lands in `mr[offset..offset+8]` (as for
/// `rbr_conn_post_fetch_add`): the swap happened when it equals `compare`. Completes with
/// RBR_OP_CMP_SWAP.
///
/// # Safety
/// `conn`, `mr`, `remote` live.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn rbr_conn_post_cmp_swap(
    conn: *mut rbr_conn,
    mr: *const rbr_mr,
    offset: usize,
    remote: *const rbr_remote,
    remote_offset: u64,
    compare: u64,
    swap: u64,
    wr_id: u64,
    flags: u32,
) -> rbr_status {
    let op = RdmaOp::CmpSwap { compare, swap };
    // SAFETY: the caller's contract is post_atomic's.
    ffi_body!({ unsafe { post_atomic(conn, mr, offset, remote, remote_offset, op, wr_id, flags) } })
}
