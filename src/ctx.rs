//! The context: process-wide settings and the parent of every listener, connection and region.

use std::sync::Arc;

use crate::addr::{self, Endpoint};
use crate::conn::{ConnOptions, Connection, Listener};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion};
use crate::shm;

/// Settings of a [`Context`].
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    /// Let shared-memory peers running as another user connect (default: same user only).
    pub shm_allow_any_uid: bool,
}

#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) opts: ContextOptions,
}

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
            inner: Arc::new(ContextInner { opts }),
        })
    }

    /// Listens for connections on `addr` (see the crate docs for address forms).
    pub fn listen(&self, addr: &str, backlog: u32) -> Result<Listener> {
        match addr::resolve(addr)? {
            Endpoint::Shm { name } => Ok(Listener::from_shm(shm::Listener::bind(
                self.inner.clone(),
                &name,
                backlog,
            )?)),
            Endpoint::Verbs { .. } => Err(verbs_unavailable()),
        }
    }

    /// Connects to a listener at `addr`; the connection's completions go to `cq`.
    pub fn connect(
        &self,
        addr: &str,
        cq: &Arc<CompletionQueue>,
        opts: &ConnOptions,
    ) -> Result<Connection> {
        opts.validate()?;
        match addr::resolve(addr)? {
            Endpoint::Shm { name } => Ok(Connection::from_shm(shm::connect(
                self.inner.clone(),
                &name,
                cq.clone(),
                opts,
            )?)),
            Endpoint::Verbs { .. } => Err(verbs_unavailable()),
        }
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

/// The status for an endpoint that needs the verbs transport, which this release does not carry
/// yet: no device at all is the more useful answer when that is the case.
fn verbs_unavailable() -> Error {
    if !crate::verbs::device_present() {
        return Error::NoDevice;
    }
    Error::Unsupported("the verbs transport is not available in this release".into())
}
