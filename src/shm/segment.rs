//! The shared segment of one shm connection: a sealed memfd holding a header page (control
//! words of both sides, ring cursors) and two byte rings, one per direction.
//!
//! Layout (all offsets from the start of the mapping):
//! - `0`: magic `u64`, version `u32`, ring capacity `u32`.
//! - `CTRL + side * CTRL_STRIDE`: the control words one side writes (`side` 0 = the connecting
//!   side, 1 = the accepting side): `sleeping` and `want_mark` (u32 each), a word unused since
//!   version 4 (u64), `fatal` (u64), `reads_peer` (u32), each on its own cache line pair.
//! - `RING + dir * RING_STRIDE`: the cursor of ring `dir` (ring `d` carries side `d`'s
//!   messages): `head`, written by the consumer (the records announce themselves, see
//!   `ring.rs`).
//! - `EXPORTS + side * EXPORTS_STRIDE`: the export table of `side` (see [`Export`]): one
//!   entry per region that side lets its peer reach, [`EXPORT_SLOTS`] of them.
//! - `DATA + dir * cap`: the bytes of ring `dir`.
//!
//! The peer maps the same memory and may write anything into it: every value read from it is
//! checked before use (see `ring.rs`), and the file is sealed against shrinking so the mapping
//! can never fault.

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::conn::{SHM_RING_MAX, SHM_RING_MIN};
use crate::error::{Error, Result};
use crate::sys::cvt;

const MAGIC: u64 = 0x5242_5348_4d53_4547; // "RBSHMSEG"
/// Version 3: export tables (one-sided operations) and write-with-immediate records.
/// Version 4: messages go into the ring before the peer has a receive for them (no receive
/// credits: the count of receives posted is gone).
/// Version 5: a side may ask to be rung on its queue's bell ([`crate::shm::bell::QUEUE`], and
/// the sleep announcement on its notice board) rather than on the socket.
const VERSION: u32 = 5;
const CTRL: usize = 256;
const CTRL_STRIDE: usize = 512;
const RING: usize = CTRL + 2 * CTRL_STRIDE;
const RING_STRIDE: usize = 256;
const EXPORTS: usize = 4096;
const EXPORTS_STRIDE: usize = 4096;
/// Bytes of one export table entry: `live` and `busy`, 8 each.
const EXPORT_ENTRY: usize = 16;
/// Regions one side of a connection may let its peer reach at once.
pub(crate) const EXPORT_SLOTS: usize = EXPORTS_STRIDE / EXPORT_ENTRY;
const DATA: usize = EXPORTS + 2 * EXPORTS_STRIDE;
// The number the documentation of `pack_region` / `rbr_conn_pack_region` gives.
const _: () = assert!(EXPORT_SLOTS == 256);
/// Smallest and largest ring a peer may propose: those a connection's options allow.
const MIN_CAP: usize = SHM_RING_MIN as usize;
const MAX_CAP: usize = SHM_RING_MAX as usize;

/// One side's control words.
pub(crate) struct Ctrl<'a> {
    /// 1 while that side's progress thread sleeps and wants a doorbell.
    pub(crate) sleeping: &'a AtomicU32,
    /// What news of the other's that side wants its notice board marked for while it does
    /// not poll the connection every time ([`bell::RECORDS`](crate::shm::bell::RECORDS):
    /// records written; [`bell::TAKEN`](crate::shm::bell::TAKEN): its records taken), 0 while
    /// it does. Next to `sleeping`: the writer reads both together.
    pub(crate) want_mark: &'a AtomicU32,
    /// Non-zero once that side failed the connection: `FATAL_* << 48 | message sequence`.
    pub(crate) fatal: &'a AtomicU64,
    /// [`READS_PEER_YES`] once that side has found it can copy straight from the other's
    /// memory: the other may then send large messages as
    /// [`DIRECT`](crate::shm::ring::DIRECT) records, and expose caller memory to it.
    /// [`READS_PEER_NO`] once it found it cannot; 0 until that side's connection started.
    pub(crate) reads_peer: &'a AtomicU32,
}

/// One entry of a side's export table, through which the peer reaches one region.
///
/// The owner writes `live`: the region's key while the peer may reach it, 0 otherwise. The
/// peer claims `busy` (an exchange to 1 that found 0; whoever claimed it lowers it, so the
/// peer's accesses through the connection to one entry run one at a time) around every access,
/// and looks at `live` only after claiming it (both SeqCst); the owner, to withdraw a region,
/// clears `live` and then waits for `busy` to be 0 (both SeqCst). Whichever of the two comes
/// second sees the other: either the access finds the region withdrawn and touches nothing, or
/// the owner waits until it is over.
pub(crate) struct Export<'a> {
    /// The region's key while it is reachable; 0 otherwise.
    pub(crate) live: &'a AtomicU64,
    /// Nonzero while the peer accesses the region.
    pub(crate) busy: &'a AtomicU64,
}

/// `reads_peer`: that side can reach the other's memory.
pub(crate) const READS_PEER_YES: u32 = 1;
/// `reads_peer`: that side cannot reach the other's memory.
pub(crate) const READS_PEER_NO: u32 = 2;

/// A receive buffer was too small for the message with the sequence number in the low bits.
pub(crate) const FATAL_LENGTH: u64 = 1;
/// The peer broke the ring protocol.
pub(crate) const FATAL_PROTOCOL: u64 = 2;
/// A one-sided operation named memory the other side did not let it reach.
pub(crate) const FATAL_ACCESS: u64 = 3;

/// What takes a dropped segment's mapping instead of its being unmapped (see `peers.rs`).
pub(crate) type Keeper = Box<dyn FnOnce(Segment) + Send + Sync>;

/// A mapped segment. Unmapped on drop, or kept for the next connection with the same peer
/// process (see [`Segment::keep_with`]).
pub(crate) struct Segment {
    base: NonNull<u8>,
    len: usize,
    cap: usize,
    /// The memfd's inode: how the two sides name a segment they both kept.
    ino: u64,
    /// Where the mapping goes when the segment is dropped, instead of being unmapped.
    keep: Option<Keeper>,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("cap", &self.cap)
            .field("ino", &self.ino)
            .field("kept", &self.keep.is_some())
            .finish()
    }
}

// SAFETY: the mapping is process-wide memory; all shared words are accessed through atomics and
// ring bytes only by the one engine thread that owns the segment.
unsafe impl Send for Segment {}
// SAFETY: see `Send`; `&Segment` only exposes atomics and raw pointers.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates a sealed segment with rings of `cap` bytes; returns it with its descriptor, which
    /// the caller passes to the peer and then closes.
    pub(crate) fn create(cap: usize) -> Result<(Segment, OwnedFd)> {
        if !(MIN_CAP..=MAX_CAP).contains(&cap) || cap % 4096 != 0 {
            return Err(Error::invalid(format!(
                "ring size {cap} not a multiple of 4096 in range"
            )));
        }
        let len = DATA + 2 * cap;
        let fd = crate::sys::sealed_memfd(c"rdmabridge-shm", len).map_err(Error::SharedMemory)?;
        let st = crate::sys::fstat(&fd).map_err(Error::SharedMemory)?;
        let seg = Segment::map(&fd, len, cap, st.st_ino)?;
        seg.write_header();
        Ok((seg, fd))
    }

    /// Writes the header's magic, version and ring size.
    fn write_header(&self) {
        // SAFETY: the header page is ours alone until the segment is named to the peer (a new
        // one, or a kept one both sides let go of); offsets 0, 8 and 12 are inside it and
        // aligned for their types.
        unsafe {
            self.base.as_ptr().cast::<u64>().write(MAGIC);
            self.base.as_ptr().add(8).cast::<u32>().write(VERSION);
            self.base
                .as_ptr()
                .add(12)
                .cast::<u32>()
                .write(self.cap as u32);
        }
    }

    /// Maps a segment the peer sent, checking its seals, size and header.
    pub(crate) fn open(fd: &OwnedFd) -> Result<Segment> {
        let proto = |m: &str| Error::Protocol(format!("shared segment: {m}"));
        // SAFETY: plain syscall on a descriptor we own.
        let seals = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })
            .map_err(|_| proto("not a sealable memfd"))?;
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if seals & need != need {
            return Err(proto("not sealed against resizing"));
        }
        let st = crate::sys::fstat(fd).map_err(Error::SharedMemory)?;
        let len = usize::try_from(st.st_size).map_err(|_| proto("negative size"))?;
        if len < DATA + 2 * MIN_CAP {
            return Err(proto("too small"));
        }
        let mut seg = Segment::map(fd, len, 0, st.st_ino)?;
        seg.cap = seg.checked_cap()?;
        Ok(seg)
    }

    /// The ring size the header gives, checked against the mapping (the peer may have written
    /// anything there).
    fn checked_cap(&self) -> Result<usize> {
        let proto = |m: &str| Error::Protocol(format!("shared segment: {m}"));
        // SAFETY: the mapping holds at least DATA bytes; offsets are aligned for their types.
        let (magic, version, cap) = unsafe {
            (
                self.base.as_ptr().cast::<u64>().read_volatile(),
                self.base.as_ptr().add(8).cast::<u32>().read_volatile(),
                self.base.as_ptr().add(12).cast::<u32>().read_volatile() as usize,
            )
        };
        if magic != MAGIC {
            return Err(proto("bad magic"));
        }
        if version != VERSION {
            return Err(Error::Protocol(format!(
                "shared segment version {version}, want {VERSION}"
            )));
        }
        if !(MIN_CAP..=MAX_CAP).contains(&cap) || cap % 4096 != 0 || DATA + 2 * cap != self.len {
            return Err(proto("ring size does not match the segment"));
        }
        Ok(cap)
    }

    fn map(fd: &OwnedFd, len: usize, cap: usize, ino: libc::ino_t) -> Result<Segment> {
        let base = crate::sys::map_shared(fd, len).map_err(Error::SharedMemory)?;
        let seg = Segment {
            base,
            len,
            cap,
            ino,
            keep: None,
        };
        // Not inherited by a child this process forks: a segment may carry later connections
        // (it is kept when its connection closes), which a child mapping it could read.
        // SAFETY: the whole of the mapping just made; changes only what fork does with it.
        cvt(unsafe { libc::madvise(base.as_ptr().cast(), len, libc::MADV_DONTFORK) })
            .map_err(Error::SharedMemory)?;
        Ok(seg)
    }

    /// Takes up a kept segment again, its header checked as [`open`](Self::open) checks a new
    /// one's: the other side made it as new before naming it.
    pub(crate) fn reopen(mut self) -> Result<Segment> {
        self.cap = self.checked_cap()?;
        Ok(self)
    }

    /// Makes a kept segment, which both sides have let go of, as new for the next connection:
    /// a new one holds its header and zeroes, but only the words either side reads before the
    /// other writes them need to be zero - the control words, cursors and export tables, and
    /// each ring's first stamp. Every later stamp position is zeroed by the ring's producer
    /// before the consumer can reach it (`ring.rs`), so bytes of the earlier connection left in
    /// the rings never pass for a record.
    pub(crate) fn reset(&self) {
        // The header too: the peer may have written anything there.
        self.write_header();
        // SAFETY: [16, DATA) and each ring's first 8 bytes lie in the mapping; neither side's
        // connection uses the segment any more (it was kept on both, see `peers.rs`).
        unsafe {
            self.base.as_ptr().add(16).write_bytes(0, DATA - 16);
            self.data(0).write_bytes(0, 8);
            self.data(1).write_bytes(0, 8);
        }
    }

    /// The memfd's inode number.
    pub(crate) fn ino(&self) -> u64 {
        self.ino
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// When dropped, the segment goes to `keeper` (a copy of it, owning the mapping and with
    /// no keeper), rather than being unmapped.
    pub(crate) fn keep_with(&mut self, keeper: Keeper) {
        self.keep = Some(keeper);
    }

    /// Bytes per ring.
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= DATA);
        // SAFETY: `off` is one of the fixed, 8-aligned offsets inside the header pages, which
        // lives as long as `self`; memory shared with the peer is only ever accessed atomically.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off + 4 <= DATA);
        // SAFETY: as for `u64_at`.
        unsafe { AtomicU32::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    /// The control words `side` writes.
    pub(crate) fn ctrl(&self, side: usize) -> Ctrl<'_> {
        let b = CTRL + side * CTRL_STRIDE;
        Ctrl {
            sleeping: self.u32_at(b),
            want_mark: self.u32_at(b + 4),
            fatal: self.u64_at(b + 256),
            reads_peer: self.u32_at(b + 384),
        }
    }

    /// Entry `slot` of the export table of `side`; `None` when `slot` is out of range (the
    /// peer names slots, so they are checked).
    pub(crate) fn export(&self, side: usize, slot: usize) -> Option<Export<'_>> {
        if side > 1 || slot >= EXPORT_SLOTS {
            return None;
        }
        let b = EXPORTS + side * EXPORTS_STRIDE + slot * EXPORT_ENTRY;
        Some(Export {
            live: self.u64_at(b),
            busy: self.u64_at(b + 8),
        })
    }

    /// Where side `side`'s export table starts ([`EXPORT_SLOTS`] entries of two words,
    /// `live` then `busy`, as [`Segment::export`] gives them); `None` for a side out of range.
    /// Valid as long as the segment.
    pub(crate) fn export_table(&self, side: usize) -> Option<NonNull<AtomicU64>> {
        (side <= 1).then(|| NonNull::from(self.u64_at(EXPORTS + side * EXPORTS_STRIDE)))
    }

    /// The head cursor of ring `dir`.
    pub(crate) fn head(&self, dir: usize) -> &AtomicU64 {
        self.u64_at(RING + dir * RING_STRIDE + 128)
    }

    /// First byte of ring `dir`; `cap()` bytes follow.
    pub(crate) fn data(&self, dir: usize) -> *mut u8 {
        // SAFETY: DATA + dir * cap + cap <= len for dir in {0, 1}, checked in `open`/`create`.
        unsafe { self.base.as_ptr().add(DATA + dir * self.cap) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Some(keeper) = self.keep.take() {
            // The mapping moves to the copy; this one no longer owns it.
            keeper(Segment {
                base: self.base,
                len: self.len,
                cap: self.cap,
                ino: self.ino,
                keep: None,
            });
            return;
        }
        // SAFETY: base/len are what mmap returned; the owner (the engine) is done with it.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
