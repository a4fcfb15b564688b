//! The context: process-wide settings and the parent of every listener, connection and region.

use std::sync::Arc;

use crate::addr;
use crate::conn::{ConnOptions, Connection, Listener, SharedRecvQueue, SrqOptions};
use crate::cq::CompletionQueue;
use crate::domain::ContextInner;
pub use crate::domain::ContextOptions;
use crate::error::Result;
use crate::log::log;
use crate::mr::{Access, MemoryRegion};
use crate::transports;

/// The parent of listeners, connections and memory regions.
///
/// Cheap to clone (a shared handle) and thread-safe. Objects made from it keep what they need
/// alive, so it may be dropped before them.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl Context {
    /// A context with default options.
    pub fn new() -> Result<Self> {
        Self::with_options(ContextOptions::default())
    }

    /// A context with the given options.
    pub fn with_options(opts: ContextOptions) -> Result<Self> {
        Ok(Context {
            inner: Arc::new(ContextInner::new(opts)),
        })
    }

    /// Listens for connections on `addr` (see the crate docs for address forms).
    pub fn listen(&self, addr: &str, backlog: u32) -> Result<Listener> {
        let r =
            addr::resolve(addr).and_then(|ep| transports::listen(self.inner.clone(), ep, backlog));
        match &r {
            Ok(_) => log!(Info, "listening on {addr}"),
            Err(e) => log!(Warn, "listening on {addr} failed: {e}"),
        }
        r
    }

    /// Connects to a listener at `addr`; the connection's completions go to `cq`. Returns once
    /// the connection is established, or failed.
    pub fn connect(
        &self,
        addr: &str,
        cq: &Arc<CompletionQueue>,
        opts: &ConnOptions,
    ) -> Result<Connection> {
        let r = self
            .start(addr, cq, opts, false)
            .and_then(Connection::established_now);
        match &r {
            Ok(c) => log!(
                Info,
                "connection {} to {addr} established ({:?})",
                c.id(),
                c.info().transport
            ),
            Err(e) => log!(Warn, "connecting to {addr} failed: {e}"),
        }
        r
    }

    /// Starts connecting to a listener at `addr` and returns at once, the connection
    /// connecting: its outcome arrives on `cq` as an [`crate::Opcode::Connected`] record
    /// (established, or failed with [`crate::WcStatus::ConnectFailed`]: then
    /// [`Connection::established`] returns the error [`connect`](Self::connect) would have).
    /// Receives may be posted meanwhile; other posts fail with [`crate::Error::State`] until
    /// it is established. Only a malformed address or options fail here.
    pub fn connect_start(
        &self,
        addr: &str,
        cq: &Arc<CompletionQueue>,
        opts: &ConnOptions,
    ) -> Result<Connection> {
        self.start(addr, cq, opts, true)
    }

    fn start(
        &self,
        addr: &str,
        cq: &Arc<CompletionQueue>,
        opts: &ConnOptions,
        records: bool,
    ) -> Result<Connection> {
        opts.validate()?;
        addr::resolve(addr)
            .and_then(|ep| transports::connect(self.inner.clone(), ep, cq.clone(), opts, records))
    }

    /// A shared receive queue: one pool of receives for the connections that name it in
    /// [`ConnOptions::srq`] (see [`SharedRecvQueue`]).
    pub fn shared_recv_queue(&self, opts: &SrqOptions) -> Result<SharedRecvQueue> {
        SharedRecvQueue::new(self.inner.clone(), opts)
    }

    /// Allocates a zeroed memory region of `len` bytes that the library owns.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<Arc<MemoryRegion>> {
        MemoryRegion::alloc(self.inner.clone(), len, access)
    }

    /// Registers caller memory as a region.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid for reads (and for writes, with
    /// [`Access::LOCAL_WRITE`]) until the region is dropped and every work request posted with
    /// it has completed.
    pub unsafe fn register_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<MemoryRegion>> {
        // SAFETY: the caller upholds the contract stated above, which is the callee's.
        unsafe { MemoryRegion::register(self.inner.clone(), addr, len, access) }
    }
}
