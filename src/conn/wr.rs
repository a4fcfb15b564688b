//! Work requests: what a caller posts on a connection, checked once here for every transport.
//!
//! A transport receives a request only after these checks passed: the flags are known, the
//! region belongs to the connection's context, the range lies inside it, a receive may write
//! into it, an inline send fits the granted inline size. What is left for the transport is
//! what only it knows (queue depth, whether the connection is still open, the device).

use std::sync::Arc;

use crate::conn::remote::{KEY_MAX, RemoteRegion, SGE_MAX, check_key};
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion};

/// Flags of a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    /// Report a completion when the send finishes. Unsignaled sends report only failures.
    pub const SIGNALED: SendFlags = SendFlags(1);
    /// Every defined bit.
    pub const ALL: SendFlags = SendFlags(1);

    /// Whether the send is signaled.
    pub fn signaled(self) -> bool {
        self.0 & Self::SIGNALED.0 != 0
    }
}

/// Where a send's bytes are.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Payload<'a> {
    /// `len` bytes at `offset` of `mr`, starting at `ptr`; they must not change until the send
    /// completes, and the transport holds `mr` until then.
    Region {
        mr: &'a Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        ptr: *mut u8,
    },
    /// Bytes the transport copies before the post returns.
    Inline(&'a [u8]),
}

/// A checked send.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendRequest<'a> {
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    pub(crate) payload: Payload<'a>,
}

impl<'a> SendRequest<'a> {
    /// A send of `len` bytes at `offset` of `mr`, a region of `ctx`.
    #[inline]
    pub(crate) fn region(
        ctx: &Arc<ContextInner>,
        mr: &'a Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<Self> {
        check_send_flags(flags)?;
        let ptr = check_region(mr, ctx, offset, len)?;
        Ok(SendRequest {
            wr_id,
            signaled: flags.signaled(),
            payload: Payload::Region {
                mr,
                offset,
                len,
                ptr,
            },
        })
    }

    /// A send of `data`, copied at post time; at most `max_inline` bytes.
    #[inline]
    pub(crate) fn inline(
        data: &'a [u8],
        max_inline: u32,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<Self> {
        check_send_flags(flags)?;
        if data.len() > max_inline as usize {
            return Err(Error::invalid(format!(
                "inline send of {} bytes over max_inline {max_inline}",
                data.len()
            )));
        }
        Ok(SendRequest {
            wr_id,
            signaled: flags.signaled(),
            payload: Payload::Inline(data),
        })
    }

    /// The message's length in bytes.
    pub(crate) fn len(&self) -> usize {
        match self.payload {
            Payload::Region { len, .. } => len,
            Payload::Inline(d) => d.len(),
        }
    }

    /// The start of the message's bytes (valid for [`len`](Self::len) bytes during the post).
    pub(crate) fn ptr(&self) -> *const u8 {
        match self.payload {
            Payload::Region { ptr, .. } => ptr.cast_const(),
            Payload::Inline(d) => d.as_ptr(),
        }
    }
}

/// A checked receive: up to `len` bytes into `mr` at `offset` (starting at `ptr`), a region of
/// the connection's context with [`Access::LOCAL_WRITE`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvRequest<'a> {
    pub(crate) wr_id: u64,
    pub(crate) mr: &'a Arc<MemoryRegion>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    /// Read by the transports that hand the device an address (shm keeps the offset).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) ptr: *mut u8,
}

impl<'a> RecvRequest<'a> {
    #[inline]
    pub(crate) fn new(
        ctx: &Arc<ContextInner>,
        mr: &'a Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<Self> {
        let ptr = check_region(mr, ctx, offset, len)?;
        if !mr.access().contains(Access::LOCAL_WRITE) {
            return Err(Error::Access("receiving needs LOCAL_WRITE"));
        }
        Ok(RecvRequest {
            wr_id,
            mr,
            offset,
            len,
            ptr,
        })
    }
}

/// One local segment of a one-sided operation: `len` bytes at `offset` of `mr`.
#[derive(Debug, Clone, Copy)]
pub struct Sge<'a> {
    /// The region (of the connection's context).
    pub mr: &'a Arc<MemoryRegion>,
    /// Where the segment starts in the region.
    pub offset: usize,
    /// Its length in bytes.
    pub len: usize,
}

#[allow(dead_code)] // read by the transports' one-sided paths
/// A checked local segment: `len` bytes at `ptr`, inside `mr`, a region of the connection's
/// context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalSeg<'a> {
    pub(crate) mr: &'a Arc<MemoryRegion>,
    pub(crate) len: usize,
    pub(crate) ptr: *mut u8,
}

/// What a one-sided operation does at the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RdmaOp {
    /// Writes the local segments, in order, at the target; with an immediate value it then
    /// consumes a receive posted at the target, whose completion carries the value.
    Write { imm: Option<u32> },
    /// Reads the target's bytes into the local segments, in order.
    Read,
    /// Adds to the target's 8-byte word; the local segment gets the word as it was.
    FetchAdd { add: u64 },
    /// Stores `swap` in the target's 8-byte word if it equals `compare`; the local segment
    /// gets the word as it was.
    CmpSwap { compare: u64, swap: u64 },
}

impl RdmaOp {
    /// The opcode of its completion.
    pub(crate) fn opcode(self) -> crate::cq::Opcode {
        use crate::cq::Opcode;
        match self {
            RdmaOp::Write { .. } => Opcode::Write,
            RdmaOp::Read => Opcode::Read,
            RdmaOp::FetchAdd { .. } => Opcode::FetchAdd,
            RdmaOp::CmpSwap { .. } => Opcode::CmpSwap,
        }
    }
}

/// A checked one-sided operation: the local segments lie in regions of the connection's
/// context (with LOCAL_WRITE where the operation writes them), the remote range does not wrap,
/// an atomic's local and remote words are 8 bytes and 8-byte aligned. Whether the target allows
/// the access (key, bounds, rights) is checked by the transport, against what the target
/// registered, and fails the operation with [`crate::WcStatus::RemoteAccess`].
#[allow(dead_code)] // read by the transports' one-sided paths
#[derive(Debug, Clone, Copy)]
pub(crate) struct RdmaRequest<'a> {
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    pub(crate) op: RdmaOp,
    /// `segs[..nsegs]` are the operation's local segments.
    pub(crate) segs: [Option<LocalSeg<'a>>; SGE_MAX],
    pub(crate) nsegs: usize,
    /// Total bytes of the local segments.
    pub(crate) len: usize,
    /// The key of the remote region (as the peer gave it).
    pub(crate) key: u64,
    /// The target address: the region's address plus the caller's offset.
    pub(crate) remote_addr: u64,
}

impl<'a> RdmaRequest<'a> {
    /// A write or read of `local`, in order, at `remote_offset` of `remote`. Inlined into
    /// its caller, so that the request is built where the transport takes it from.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn transfer(
        ctx: &Arc<ContextInner>,
        conn_id: u64,
        op: RdmaOp,
        local: impl ExactSizeIterator<Item = Sge<'a>>,
        remote: &RemoteRegion,
        remote_offset: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<Self> {
        check_send_flags(flags)?;
        check_remote(remote, conn_id)?;
        let nsegs = local.len();
        if nsegs > SGE_MAX {
            return Err(Error::invalid(format!(
                "{nsegs} local segments; at most {SGE_MAX}"
            )));
        }
        let mut segs = [None; SGE_MAX];
        let mut len = 0usize;
        for (i, s) in local.enumerate() {
            let ptr = check_region(s.mr, ctx, s.offset, s.len)?;
            if op == RdmaOp::Read && !s.mr.access().contains(Access::LOCAL_WRITE) {
                return Err(Error::Access("a read's local segments need LOCAL_WRITE"));
            }
            len = len
                .checked_add(s.len)
                .filter(|&l| l <= u32::MAX as usize)
                .ok_or_else(|| Error::invalid("operation longer than 4 GiB - 1"))?;
            segs[i] = Some(LocalSeg {
                mr: s.mr,
                len: s.len,
                ptr,
            });
        }
        let remote_addr = remote_target(remote, remote_offset, len as u64)?;
        Ok(RdmaRequest {
            wr_id,
            signaled: flags.signaled(),
            op,
            segs,
            nsegs,
            len,
            key: remote.key,
            remote_addr,
        })
    }

    /// A fetch-and-add or compare-and-swap on the 8-byte word at `remote_offset` of `remote`;
    /// the word as it was lands at `local_offset` of `local`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn atomic(
        ctx: &Arc<ContextInner>,
        conn_id: u64,
        op: RdmaOp,
        local: &'a Arc<MemoryRegion>,
        local_offset: usize,
        remote: &RemoteRegion,
        remote_offset: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<Self> {
        check_send_flags(flags)?;
        check_remote(remote, conn_id)?;
        let ptr = check_region(local, ctx, local_offset, 8)?;
        if !local.access().contains(Access::LOCAL_WRITE) {
            return Err(Error::Access("an atomic's local word needs LOCAL_WRITE"));
        }
        if ptr as usize % 8 != 0 {
            return Err(Error::invalid(
                "an atomic's local word must be 8-byte aligned",
            ));
        }
        let remote_addr = remote_target(remote, remote_offset, 8)?;
        if remote_addr % 8 != 0 {
            return Err(Error::invalid(
                "an atomic's remote word must be 8-byte aligned",
            ));
        }
        let mut segs = [None; SGE_MAX];
        segs[0] = Some(LocalSeg {
            mr: local,
            len: 8,
            ptr,
        });
        Ok(RdmaRequest {
            wr_id,
            signaled: flags.signaled(),
            op,
            segs,
            nsegs: 1,
            len: 8,
            key: remote.key,
            remote_addr,
        })
    }

    /// The local segments.
    #[allow(dead_code)]
    pub(crate) fn segs(&self) -> impl Iterator<Item = &LocalSeg<'a>> {
        self.segs[..self.nsegs].iter().flatten()
    }
}

/// A write (without immediate) or read of one local segment that passed every check
/// [`RdmaRequest::transfer`] makes ([`check_single`]): for a transport's
/// [`rdma_single`](crate::conn::seam::ConnSeam::rdma_single), which takes the common small
/// operation without a request built.
#[derive(Debug)]
pub(crate) struct OneOp<'a> {
    /// [`RdmaOp::Write`] without immediate, or [`RdmaOp::Read`].
    pub(crate) op: RdmaOp,
    /// The local segment's region, and its `len` bytes at `ptr` inside it.
    pub(crate) mr: &'a Arc<MemoryRegion>,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// The peer's key and the target address (`len` bytes there do not wrap).
    pub(crate) key: u64,
    pub(crate) remote_addr: u64,
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
}

impl<'a> OneOp<'a> {
    /// The request [`RdmaRequest::transfer`] builds for the same operation, for a transport
    /// that posts it the general way (nothing is checked again).
    #[inline(always)]
    pub(crate) fn request(&self) -> RdmaRequest<'a> {
        let mut segs = [None; SGE_MAX];
        segs[0] = Some(LocalSeg {
            mr: self.mr,
            len: self.len,
            ptr: self.ptr,
        });
        RdmaRequest {
            wr_id: self.wr_id,
            signaled: self.signaled,
            op: self.op,
            segs,
            nsegs: 1,
            len: self.len,
            key: self.key,
            remote_addr: self.remote_addr,
        }
    }
}

/// The write or read `op` of the one local segment `local` at `remote_offset` of `remote`
/// with `flags`, checked as [`RdmaRequest::transfer`] checks it (flags, connection, context,
/// range, a read's LOCAL_WRITE, length, target address): the local start, the length and the
/// target address when every check passes (the parts of a [`OneOp`]); `None` when one fails
/// or `op` is another operation (the general path then reports, or posts it).
#[inline(always)]
pub(crate) fn check_single(
    ctx: &Arc<ContextInner>,
    conn_id: u64,
    op: RdmaOp,
    local: &Sge<'_>,
    remote: &RemoteRegion,
    remote_offset: u64,
    flags: SendFlags,
) -> Option<(*mut u8, usize, u64)> {
    let len = local.len;
    let read = match op {
        RdmaOp::Write { imm: None } => false,
        RdmaOp::Read => true,
        _ => return None,
    };
    if flags.0 & !SendFlags::SIGNALED.0 != 0
        || remote.conn_id != conn_id
        || remote.key > KEY_MAX
        || !local.mr.same_context(ctx)
        || len > u32::MAX as usize
        || (read && !local.mr.access().contains(Access::LOCAL_WRITE))
    {
        return None;
    }
    let ptr = local.mr.range_ptr(local.offset, len)?;
    let addr = target_addr(remote, remote_offset, len as u64)?;
    Some((ptr, len, addr))
}

/// The remote region was unpacked on this connection, and its key is one (a C caller fills
/// the record as it likes).
fn check_remote(remote: &RemoteRegion, conn_id: u64) -> Result<()> {
    if remote.conn_id != conn_id {
        return Err(Error::invalid(
            "the remote region was unpacked on another connection",
        ));
    }
    check_key(remote.key)
}

/// The target address of `len` bytes at `offset` of `remote`, if it does not wrap. (Whether
/// it lies inside the region the peer registered is the transport's check.)
fn remote_target(remote: &RemoteRegion, offset: u64, len: u64) -> Result<u64> {
    target_addr(remote, offset, len)
        .ok_or_else(|| Error::invalid("remote offset wraps past the end of the address space"))
}

/// As [`remote_target`], `None` when it wraps.
#[inline(always)]
fn target_addr(remote: &RemoteRegion, offset: u64, len: u64) -> Option<u64> {
    let addr = remote.addr.checked_add(offset)?;
    addr.checked_add(len).map(|_| addr)
}

/// Only known flags.
#[inline]
fn check_send_flags(flags: SendFlags) -> Result<()> {
    if flags.0 & !SendFlags::ALL.0 != 0 {
        return Err(Error::invalid(format!("unknown send flags {:#x}", flags.0)));
    }
    Ok(())
}

/// The region belongs to the connection's context, the range lies inside it, and its length
/// fits a completion. Returns the start of the range.
#[inline]
fn check_region(
    mr: &MemoryRegion,
    ctx: &Arc<ContextInner>,
    offset: usize,
    len: usize,
) -> Result<*mut u8> {
    if !mr.same_context(ctx) {
        return Err(Error::invalid("memory region belongs to another context"));
    }
    if len > u32::MAX as usize {
        return Err(Error::invalid("message longer than 4 GiB - 1"));
    }
    mr.slice_ptr(offset, len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Context;

    fn setup() -> (Context, Arc<MemoryRegion>) {
        let ctx = Context::new().unwrap();
        let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        (ctx, mr)
    }

    #[test]
    fn a_send_inside_its_region_passes_with_its_bytes() {
        let (ctx, mr) = setup();
        let wr = SendRequest::region(&ctx.inner, &mr, 100, 50, 7, SendFlags::SIGNALED).unwrap();
        assert_eq!(wr.len(), 50);
        assert_eq!(wr.ptr(), mr.as_ptr().wrapping_add(100).cast_const());
        assert!(wr.signaled);
        assert_eq!(wr.wr_id, 7);
        // The last byte of the region is inside; one past is not.
        assert!(SendRequest::region(&ctx.inner, &mr, 4095, 1, 0, SendFlags(0)).is_ok());
        assert!(matches!(
            SendRequest::region(&ctx.inner, &mr, 4095, 2, 0, SendFlags(0)),
            Err(Error::Range { .. })
        ));
        assert!(matches!(
            SendRequest::region(&ctx.inner, &mr, usize::MAX, 2, 0, SendFlags(0)),
            Err(Error::Range { .. })
        ));
    }

    #[test]
    fn unknown_flags_and_foreign_regions_are_refused() {
        let (ctx, mr) = setup();
        assert!(matches!(
            SendRequest::region(&ctx.inner, &mr, 0, 1, 0, SendFlags(2)),
            Err(Error::InvalidArgument(_))
        ));
        let other = Context::new().unwrap();
        assert!(matches!(
            SendRequest::region(&other.inner, &mr, 0, 1, 0, SendFlags(0)),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            RecvRequest::new(&other.inner, &mr, 0, 1, 0),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn inline_sends_fit_the_granted_size() {
        let data = [1u8; 65];
        let wr = SendRequest::inline(&data[..64], 64, 3, SendFlags(0)).unwrap();
        assert_eq!((wr.len(), wr.ptr()), (64, data.as_ptr()));
        assert!(!wr.signaled);
        assert!(matches!(
            SendRequest::inline(&data, 64, 3, SendFlags(0)),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn the_short_path_accepts_exactly_what_the_general_path_accepts() {
        // `check_single` lets a transport post a write or read at once; whatever it accepts,
        // the general path must accept too, with the same source, length, target and
        // signaling, and whatever the general path refuses it must decline (the general path
        // then reports it).
        let (ctx, mr) = setup();
        let ro = ctx.alloc_mr(8192, Access(0)).unwrap();
        let other = Context::new().unwrap();
        let foreign = other.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        let conn = 7;
        let near_end = u64::MAX - 4096;
        let remotes = [
            crate::conn::remote::from_raw(0x1000, 4096, 9, conn).unwrap(),
            crate::conn::remote::from_raw(0x1000, 4096, 9, conn + 1).unwrap(),
            crate::conn::remote::from_raw(near_end, 4096, 9, conn).unwrap(),
        ];
        let offsets = [0, 1, 4095, 4096, 4097, usize::MAX - 1, usize::MAX];
        let lens = [0, 1, 8, 4095, 4096, 4097, u32::MAX as usize + 1, usize::MAX];
        let remote_offsets = [0, 8, 4096, u64::MAX - 0x1000, u64::MAX];
        let ops = [RdmaOp::Write { imm: None }, RdmaOp::Read];
        let flags = [SendFlags(0), SendFlags::SIGNALED, SendFlags(0x80)];
        let mut accepted = [0; 2];
        for (i, &op) in ops.iter().enumerate() {
            for &flag in &flags {
                for region in [&mr, &ro, &foreign] {
                    for remote in &remotes {
                        for &offset in &offsets {
                            for &len in &lens {
                                for &roff in &remote_offsets {
                                    let local = Sge {
                                        mr: region,
                                        offset,
                                        len,
                                    };
                                    let short = check_single(
                                        &ctx.inner, conn, op, &local, remote, roff, flag,
                                    );
                                    let general = RdmaRequest::transfer(
                                        &ctx.inner,
                                        conn,
                                        op,
                                        std::iter::once(local),
                                        remote,
                                        roff,
                                        5,
                                        flag,
                                    );
                                    let case = (op, flag, offset, len, roff, remote.conn_id);
                                    match (short, general) {
                                        (Some((ptr, len, addr)), Ok(wr)) => {
                                            let seg = wr.segs().next().expect("one segment");
                                            assert!(Arc::ptr_eq(region, seg.mr), "{case:?}");
                                            assert_eq!(
                                                (ptr, len, addr),
                                                (seg.ptr, wr.len, wr.remote_addr),
                                                "{case:?}"
                                            );
                                            // What a transport posting it the general way
                                            // gets is the general path's request.
                                            let one = OneOp {
                                                op,
                                                mr: region,
                                                ptr,
                                                len,
                                                key: remote.key,
                                                remote_addr: addr,
                                                wr_id: 5,
                                                signaled: flag.signaled(),
                                            };
                                            assert_same_request(&one.request(), &wr, case);
                                            accepted[i] += 1;
                                        }
                                        (None, Err(_)) => {}
                                        (s, g) => {
                                            panic!("{case:?}: short {s:?}, general {:?}", g.err())
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(
            accepted.iter().all(|&n| n > 20),
            "the grid accepts some writes and reads ({accepted:?})"
        );
        // Only plain writes and reads: the others always take the general path.
        let local = Sge {
            mr: &mr,
            offset: 0,
            len: 8,
        };
        for op in [
            RdmaOp::Write { imm: Some(1) },
            RdmaOp::FetchAdd { add: 1 },
            RdmaOp::CmpSwap {
                compare: 0,
                swap: 1,
            },
        ] {
            let one = check_single(&ctx.inner, conn, op, &local, &remotes[0], 0, SendFlags(0));
            assert!(one.is_none(), "{op:?}");
        }
    }

    fn assert_same_request(a: &RdmaRequest<'_>, b: &RdmaRequest<'_>, case: impl std::fmt::Debug) {
        assert_eq!(
            (
                a.wr_id,
                a.signaled,
                a.op,
                a.nsegs,
                a.len,
                a.key,
                a.remote_addr
            ),
            (
                b.wr_id,
                b.signaled,
                b.op,
                b.nsegs,
                b.len,
                b.key,
                b.remote_addr
            ),
            "{case:?}"
        );
        for (x, y) in a.segs.iter().zip(&b.segs) {
            match (x, y) {
                (Some(x), Some(y)) => {
                    assert!(Arc::ptr_eq(x.mr, y.mr), "{case:?}");
                    assert_eq!((x.len, x.ptr), (y.len, y.ptr), "{case:?}");
                }
                (None, None) => {}
                _ => panic!("{case:?}: segments differ"),
            }
        }
    }

    #[test]
    fn a_receive_needs_local_write() {
        let ctx = Context::new().unwrap();
        let ro = ctx.alloc_mr(64, Access(0)).unwrap();
        assert!(matches!(
            RecvRequest::new(&ctx.inner, &ro, 0, 64, 0),
            Err(Error::Access(_))
        ));
        let rw = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        let wr = RecvRequest::new(&ctx.inner, &rw, 8, 56, 9).unwrap();
        assert_eq!(
            (wr.ptr, wr.len, wr.wr_id),
            (rw.as_ptr().wrapping_add(8), 56, 9)
        );
    }
}
