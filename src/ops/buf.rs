//! Buffers an operation owns while it runs: pieces of a region the library allocated, each
//! reachable through its `Buf` alone, so that reading and writing one needs no `unsafe`.

use std::sync::Arc;

use crate::ctx::Context;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion};

/// A buffer for sends, receives and one-sided operations, owned like a `Vec<u8>`: an
/// operation takes it by value and gives it back when it completes (as `tokio-uring` does),
/// so nobody can touch its bytes while the library or the peer does.
///
/// It holds `capacity()` bytes, zeroed when allocated, of which the first `len()` are its
/// contents (what a send or write sends, a read reads into; a receive sets them to the
/// message). Several buffers may share one region ([`Buf::alloc_many`]: one registration, one
/// descriptor), each its own piece of it. The region allows no remote access, so no peer can
/// write into a buffer either.
#[derive(Debug)]
pub struct Buf {
    mr: Arc<MemoryRegion>,
    offset: usize,
    cap: usize,
    len: usize,
}

impl Buf {
    /// A zeroed buffer of `capacity` bytes (its length too).
    pub fn alloc(ctx: &Context, capacity: usize) -> Result<Buf> {
        let mut v = Self::alloc_many(ctx, 1, capacity)?;
        Ok(v.remove(0))
    }

    /// `count` zeroed buffers of `capacity` bytes each (their lengths too), pieces of one
    /// region: the cheap way to have many (a region costs a descriptor and a registration).
    pub fn alloc_many(ctx: &Context, count: usize, capacity: usize) -> Result<Vec<Buf>> {
        if count == 0 || capacity == 0 {
            return Err(Error::invalid(
                "buffers need a count and a capacity above 0",
            ));
        }
        let total = count
            .checked_mul(capacity)
            .ok_or_else(|| Error::invalid("buffers too large"))?;
        let mr = ctx.alloc_mr(total, Access::LOCAL_WRITE)?;
        Ok((0..count)
            .map(|i| Buf {
                mr: mr.clone(),
                offset: i * capacity,
                cap: capacity,
                len: capacity,
            })
            .collect())
    }

    /// How many bytes it can hold.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets its length to `len` (at most the capacity). The bytes are those the buffer held
    /// there (zeros, or what an operation left).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cap {
            return Err(Error::invalid(format!(
                "length {len} over the buffer's capacity {}",
                self.cap
            )));
        }
        self.len = len;
        Ok(())
    }

    /// Copies `data` in and makes it the contents. Fails, changing nothing, when it is longer
    /// than the capacity.
    pub fn fill(&mut self, data: &[u8]) -> Result<()> {
        self.set_len(data.len())?;
        self.copy_from_slice(data);
        Ok(())
    }

    /// The region and the offset of the buffer in it, for posting.
    pub(crate) fn region(&self) -> (&Arc<MemoryRegion>, usize) {
        (&self.mr, self.offset)
    }

    /// The piece's start. The bytes are valid for `cap` bytes while `self` lives (the region
    /// is held), and initialized (zeroed at allocation).
    fn ptr(&self) -> *mut u8 {
        self.mr
            .range_ptr(self.offset, self.cap)
            .expect("a buffer lies inside its region")
    }
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid and initialized for `cap >= len` bytes while the region lives
        // (held by `self`). Nobody else reads or writes them meanwhile: the region is reachable
        // through buffers only, each piece through one buffer, and its access allows no peer
        // to write; the library uses a piece only while an operation owns its buffer, and
        // then no reference into it exists (the buffer moved into the operation).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl AsRef<[u8]> for Buf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for Buf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}
