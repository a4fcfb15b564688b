//! The context: process-wide settings and the parent of every listener, connection and region.

use std::sync::Arc;

use crate::addr::{self, Endpoint};
use crate::conn::{ConnOptions, Connection, Listener};
use crate::cq::CompletionQueue;
use crate::domain::ContextInner;
pub use crate::domain::ContextOptions;
use crate::error::{Error, Result};
use crate::log::log;
use crate::mr::{Access, MemoryRegion};
use crate::shm;

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
        let r = match addr::resolve(addr)? {
            Endpoint::Shm { name } => {
                shm::Listener::bind(self.inner.clone(), &name, backlog).map(Listener::new)
            }
            Endpoint::Verbs { host, port } => verbs_listen(self, &host, port, backlog),
        };
        match &r {
            Ok(_) => log!(Info, "listening on {addr}"),
            Err(e) => log!(Warn, "listening on {addr} failed: {e}"),
        }
        r
    }

    /// Connects to a listener at `addr`; the connection's completions go to `cq`.
    pub fn connect(
        &self,
        addr: &str,
        cq: &Arc<CompletionQueue>,
        opts: &ConnOptions,
    ) -> Result<Connection> {
        opts.validate()?;
        let r = match addr::resolve(addr)? {
            Endpoint::Shm { name } => {
                shm::connect(self.inner.clone(), &name, cq.clone(), opts).map(Connection::new)
            }
            Endpoint::Verbs { host, port } => verbs_connect(self, &host, port, cq, opts),
        };
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

#[cfg(feature = "verbs")]
fn verbs_listen(ctx: &Context, host: &str, port: u16, backlog: u32) -> Result<Listener> {
    if !crate::verbs::device_present() {
        return Err(Error::NoDevice);
    }
    Ok(Listener::new(crate::verbs::Listener::bind(
        ctx.inner.clone(),
        host,
        port,
        backlog,
    )?))
}

#[cfg(feature = "verbs")]
fn verbs_connect(
    ctx: &Context,
    host: &str,
    port: u16,
    cq: &Arc<CompletionQueue>,
    opts: &ConnOptions,
) -> Result<Connection> {
    if !crate::verbs::device_present() {
        return Err(Error::NoDevice);
    }
    Ok(Connection::new(crate::verbs::connect(
        ctx.inner.clone(),
        host,
        port,
        cq.clone(),
        opts,
    )?))
}

#[cfg(not(feature = "verbs"))]
fn verbs_listen(_: &Context, _: &str, _: u16, _: u32) -> Result<Listener> {
    Err(Error::Unsupported("built without the verbs feature".into()))
}

#[cfg(not(feature = "verbs"))]
fn verbs_connect(
    _: &Context,
    _: &str,
    _: u16,
    _: &Arc<CompletionQueue>,
    _: &ConnOptions,
) -> Result<Connection> {
    Err(Error::Unsupported("built without the verbs feature".into()))
}
