//! Memory regions: caller memory registered with the library, or memory the library allocates.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::domain::ContextInner;
use crate::error::{Error, Result};

/// Access rights of a memory region, combined with `|`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access(pub u32);

impl Access {
    /// The library may write into it locally (needed to receive into it).
    pub const LOCAL_WRITE: Access = Access(1);
    /// The peer may write into it with one-sided operations.
    pub const REMOTE_WRITE: Access = Access(2);
    /// The peer may read it with one-sided operations.
    pub const REMOTE_READ: Access = Access(4);
    /// The peer may run atomics on it.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Every defined bit.
    pub const ALL: Access = Access(15);

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

static NEXT_MR_ID: AtomicU64 = AtomicU64::new(1);

/// Memory the library owns: a shared-memory file mapped into this process, so that a peer on the
/// same host can later map it too. The file is sealed against resizing, so that a peer's
/// mapping of it can never fault.
#[derive(Debug)]
struct Owned {
    fd: OwnedFd,
}

/// A region of memory that work requests may use.
///
/// Thread-safe. Held by an `Arc`: every posted work request keeps its region alive until it
/// completes, so dropping the last handle early never frees memory still in use by the library.
#[derive(Debug)]
pub struct MemoryRegion {
    ptr: NonNull<u8>,
    len: usize,
    access: Access,
    id: u64,
    owned: Option<Owned>,
    /// Registrations with the domains devices reach memory through (verbs: protection
    /// domains), made on first use by a connection. Released before the memory (see `Drop`).
    regs: Registrations,
    /// The connections that let their peer reach this region (see [`Exposure`]); each
    /// withdraws it when the region is dropped, before its memory goes.
    exposures: Mutex<Vec<Weak<dyn Exposure>>>,
    /// Set once the region was exposed on some connection (so that dropping the many regions
    /// never exposed costs no lock).
    exposed: AtomicBool,
    _ctx: Arc<ContextInner>,
}

/// A domain through which a device reaches memory (verbs: a protection domain), which a
/// region is registered with on its first use there.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only verbs registers memory
pub(crate) trait Registrar: Send + Sync + 'static {
    /// Registers `addr..addr + len` with `access` in `domain`.
    ///
    /// # Safety
    /// The memory stays valid for `len` bytes until the registration is dropped.
    unsafe fn register(
        domain: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn Registration>>;
}

/// A region's registration in one domain; dropping it deregisters. It keeps its domain alive,
/// so the domain's address names no other while the registration lives.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only verbs registers memory
pub(crate) trait Registration: Send + Sync {
    fn keys(&self) -> Keys;
}

/// The keys of a registration: the local one work requests carry, the remote one a peer's
/// one-sided operations carry.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only verbs registers memory
#[derive(Debug, Clone, Copy)]
pub(crate) struct Keys {
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

/// A region's registrations, one per domain it was used in.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only verbs registers memory
#[derive(Default)]
struct Registrations {
    /// (the domain's address, the registration).
    regs: Mutex<Vec<(usize, Box<dyn Registration>)>>,
    /// The first registration's domain and keys, read without the lock on every post. The
    /// address cannot name another domain while the region lives, since the registration in
    /// `regs` keeps that domain alive.
    first: OnceLock<(usize, Keys)>,
}

impl std::fmt::Debug for Registrations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.regs.lock().map_or(0, |r| r.len());
        write!(f, "Registrations({n})")
    }
}

/// A connection's table of the regions its peer may reach with one-sided operations.
pub(crate) trait Exposure: Send + Sync {
    /// The region with id `mr_id` is going away: after this returns the peer can no longer
    /// reach it through this connection, and no access of the peer to it is in progress.
    fn revoke(&self, mr_id: u64);
}

// SAFETY: the region is plain memory; the struct only hands out its address and copies bytes in
// and out with explicit bounds checks, in `unsafe` methods whose contract rules out concurrent
// access to the bytes themselves, as with any RDMA buffer.
unsafe impl Send for MemoryRegion {}
// SAFETY: see `Send`; no method mutates the struct through `&self`.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers caller memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid for reads (and writes, with [`Access::LOCAL_WRITE`])
    /// until the region is dropped and every work request posted with it has completed.
    pub(crate) unsafe fn register(
        ctx: Arc<ContextInner>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<Self>> {
        let ptr = NonNull::new(addr).ok_or_else(|| Error::invalid("address is NULL"))?;
        check_args(len, access)?;
        if (addr as usize).checked_add(len).is_none() {
            return Err(Error::invalid(format!(
                "range {addr:p}+{len} wraps past the end of the address space"
            )));
        }
        Ok(Arc::new(MemoryRegion {
            ptr,
            len,
            access,
            id: NEXT_MR_ID.fetch_add(1, Ordering::Relaxed),
            owned: None,
            regs: Default::default(),
            exposures: Mutex::new(Vec::new()),
            exposed: AtomicBool::new(false),
            _ctx: ctx,
        }))
    }

    /// Allocates `len` zeroed bytes the library owns.
    pub(crate) fn alloc(ctx: Arc<ContextInner>, len: usize, access: Access) -> Result<Arc<Self>> {
        check_args(len, access)?;
        libc::off_t::try_from(len).map_err(|_| Error::invalid("length too large"))?;
        let fd = crate::sys::sealed_memfd(c"rdmabridge-mr", len).map_err(Error::MemoryRegion)?;
        let ptr = crate::sys::map_shared(&fd, len).map_err(Error::MemoryRegion)?;
        Ok(Arc::new(MemoryRegion {
            ptr,
            len,
            access,
            id: NEXT_MR_ID.fetch_add(1, Ordering::Relaxed),
            owned: Some(Owned { fd }),
            regs: Default::default(),
            exposures: Mutex::new(Vec::new()),
            exposed: AtomicBool::new(false),
            _ctx: ctx,
        }))
    }

    /// Start of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never true: regions have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The access the region was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// A number unique to this region within the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Copies `data` into the region at `offset`. Fails with [`Error::Range`] (changing
    /// nothing) when the bytes do not lie inside the region.
    ///
    /// Unsafe because the library and the peer read and write a region's bytes behind this
    /// handle's back, from other threads and processes, while work is posted: a copy that
    /// overlaps them is a data race, which Rust leaves undefined (and whose bytes would be
    /// torn anyway). Nothing here can tell which bytes are in flight without a lock on every
    /// post and completion, and a peer's one-sided accesses are not seen at all, so the
    /// caller keeps to the same rule as for any RDMA buffer (as the `unsafe` posting of
    /// rust-ibverbs has its callers do). Posting with a region stays safe: the region, held
    /// alive by every work request, is what keeps the memory valid.
    ///
    /// # Safety
    /// While the copy runs, nothing else reads or writes `offset..offset + data.len()` of the
    /// region: no work request that uses these bytes is outstanding - a send, write or atomic
    /// from them, a receive, read or atomic into them (the bytes belong to the caller again
    /// once its completion is polled) - no peer reads or writes them with one-sided
    /// operations (agree on that with it, for instance by messages), and no other thread
    /// reads or writes them, through this handle or another.
    pub unsafe fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        let dst = self.slice_ptr(offset, data.len())?;
        // SAFETY: `slice_ptr` checked that offset..offset+len lies inside the region, which is
        // valid memory for as long as `self` lives; `data` cannot overlap it mutably; nobody
        // else accesses these bytes meanwhile (the caller's contract).
        unsafe { std::ptr::copy(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes from the region at `offset` into `out`. Fails with
    /// [`Error::Range`] (changing nothing) when the bytes do not lie inside the region.
    ///
    /// Unsafe for the reason [`write`](Self::write) is.
    ///
    /// # Safety
    /// While the copy runs, nothing writes `offset..offset + out.len()` of the region: no
    /// receive, read or atomic into these bytes is outstanding (they belong to the caller
    /// once its completion is polled), no peer writes them with one-sided operations, and no
    /// other thread writes them.
    pub unsafe fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let src = self.slice_ptr(offset, out.len())?;
        // SAFETY: bounds checked by `slice_ptr`; `out` is an exclusive borrow of caller memory;
        // nobody writes these bytes meanwhile (the caller's contract).
        unsafe { std::ptr::copy(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Checks that `offset..offset+len` lies in the region and returns its start.
    pub(crate) fn slice_ptr(&self, offset: usize, len: usize) -> Result<*mut u8> {
        // Lazily: an `Error` has drop glue, and built eagerly it is built and dropped on every
        // successful check of every post (50 instructions a send, measured).
        #[allow(clippy::unnecessary_lazy_evaluations)]
        self.range_ptr(offset, len).ok_or_else(|| Error::Range {
            offset,
            len,
            region_len: self.len,
        })
    }

    /// As [`slice_ptr`](Self::slice_ptr), `None` for a range outside the region.
    #[inline(always)]
    pub(crate) fn range_ptr(&self, offset: usize, len: usize) -> Option<*mut u8> {
        match offset.checked_add(len) {
            // SAFETY: offset <= len of the region, so the result stays inside (or one past)
            // the same allocation.
            Some(end) if end <= self.len => Some(unsafe { self.ptr.as_ptr().add(offset) }),
            _ => None,
        }
    }

    /// The local key of this region in `domain`, registering it there on first use.
    #[inline]
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn lkey_in<R: Registrar>(&self, domain: &Arc<R>) -> Result<u32> {
        self.keys_in(domain).map(|k| k.lkey)
    }

    /// The remote key of this region in `domain` (what the peer's one-sided operations carry),
    /// registering it there on first use.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn rkey_in<R: Registrar>(&self, domain: &Arc<R>) -> Result<u32> {
        self.keys_in(domain).map(|k| k.rkey)
    }

    /// The keys of this region in `domain`, registering it there on first use (with the access
    /// flags the region was made with: what its remote key allows is what a peer may do).
    #[inline]
    fn keys_in<R: Registrar>(&self, domain: &Arc<R>) -> Result<Keys> {
        // The first registration's keys, without the lock: most regions are only ever used
        // in one domain.
        if let Some(&(at, keys)) = self.regs.first.get()
            && at == Arc::as_ptr(domain) as *const () as usize
        {
            return Ok(keys);
        }
        self.keys_registering(domain)
    }

    /// [`keys_in`](Self::keys_in) for a region used in another domain than its first, or not
    /// yet.
    #[cold]
    #[inline(never)]
    fn keys_registering<R: Registrar>(&self, domain: &Arc<R>) -> Result<Keys> {
        let at = Arc::as_ptr(domain) as *const () as usize;
        let mut regs = self.regs.regs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, r)) = regs.iter().find(|(d, _)| *d == at) {
            return Ok(r.keys());
        }
        // SAFETY: the region's memory is valid for `len` bytes while it lives (its own
        // contract), and its registrations are dropped before the memory is released (`Drop`).
        let r = unsafe { R::register(domain, self.ptr.as_ptr(), self.len, self.access)? };
        let keys = r.keys();
        regs.push((at, r));
        if regs.len() == 1 {
            // Only the first registration ever sets it (under the lock), so it never changes.
            let _ = self.regs.first.set((at, keys));
        }
        Ok(keys)
    }

    /// The shared-memory file holding the region, for a region the library allocated.
    pub(crate) fn memfd(&self) -> Option<RawFd> {
        self.owned.as_ref().map(|o| o.fd.as_raw_fd())
    }

    /// Remembers that `table` lets a peer reach this region: it is told when the region goes.
    pub(crate) fn add_exposure(&self, table: Weak<dyn Exposure>) {
        let mut v = self.exposures.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.push(table);
        // Relaxed: read in `drop`, which runs after every other use of the region.
        self.exposed.store(true, Ordering::Relaxed);
    }

    pub(crate) fn same_context(&self, ctx: &Arc<ContextInner>) -> bool {
        Arc::ptr_eq(&self._ctx, ctx)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // First no peer may reach the memory any more (each connection it was exposed on
        // withdraws it and waits for accesses in progress), then it goes.
        if *self.exposed.get_mut() {
            let tables =
                std::mem::take(self.exposures.get_mut().unwrap_or_else(|p| p.into_inner()));
            for t in tables.iter().filter_map(Weak::upgrade) {
                t.revoke(self.id);
            }
        }
        // Deregister from every domain before the memory can go away.
        drop(std::mem::take(&mut self.regs));
        if self.owned.is_some() {
            // SAFETY: ptr/len are exactly what mmap returned in `alloc`; the last Arc is gone,
            // so no work request or caller reference can still use the mapping.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

fn check_args(len: usize, access: Access) -> Result<()> {
    if len == 0 {
        return Err(Error::invalid("memory region length is 0"));
    }
    if len > isize::MAX as usize {
        return Err(Error::invalid(format!(
            "memory region length {len} exceeds the address space"
        )));
    }
    if access.0 & !Access::ALL.0 != 0 {
        return Err(Error::invalid(format!(
            "unknown access bits {:#x}",
            access.0
        )));
    }
    if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE)
        || access.contains(Access::REMOTE_ATOMIC) && !access.contains(Access::LOCAL_WRITE)
    {
        return Err(Error::invalid(
            "remote write and atomic access need local write access",
        ));
    }
    Ok(())
}
