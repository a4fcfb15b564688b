//! Work requests: what a caller posts on a connection, checked once here for every transport.
//!
//! A transport receives a request only after these checks passed: the flags are known, the
//! region belongs to the connection's context, the range lies inside it, a receive may write
//! into it, an inline send fits the granted inline size. What is left for the transport is
//! what only it knows (queue depth, whether the connection is still open, the device).

use std::sync::Arc;

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

/// Only known flags.
fn check_send_flags(flags: SendFlags) -> Result<()> {
    if flags.0 & !SendFlags::ALL.0 != 0 {
        return Err(Error::invalid(format!("unknown send flags {:#x}", flags.0)));
    }
    Ok(())
}

/// The region belongs to the connection's context, the range lies inside it, and its length
/// fits a completion. Returns the start of the range.
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
