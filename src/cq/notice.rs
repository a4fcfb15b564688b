//! A completion queue's notice board: one shared page on which peers in other processes (the
//! shared-memory transport's) mark which of the queue's connections has news (a message in its
//! ring), so that a poll looks at those connections only and an empty poll costs the same with
//! one connection or thousands.
//!
//! Layout: a summary word at offset 0 (bit `g` set: word `g` may have bits set), then
//! [`WORDS`] words from offset [`WORDS_AT`], one bit per connection slot. A peer that writes
//! after its ring's words sets the connection's bit, and the group's summary bit when
//! the word was empty; a poller clears the summary, then each marked word, then looks at those
//! connections. A SeqCst fence on both sides between the data and the mark makes sure that
//! either the poller sees the data or the writer sees the cleared bit and sets it again.
//!
//! The page is a sealed memfd that each peer maps. A peer may write anything into it: a wrong
//! bit only makes a poll look at a connection with nothing new.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use crate::error::{Error, Result};
use crate::sys::cvt;

/// Words of connection bits; the summary word has one bit per word.
pub(crate) const WORDS: usize = 64;
/// Connection slots per board.
pub(crate) const SLOTS: u32 = (WORDS * 64) as u32;
/// A connection with no slot: its peer marks nothing.
pub(crate) const NO_SLOT: u32 = u32::MAX;
/// Right after the summary, so that the first slots share its cache line: with few
/// connections a mark and a take each move one line between the cores.
const WORDS_AT: usize = 8;
const LEN: usize = 4096;

/// A mapped notice board: the queue's own, or a peer's.
#[derive(Debug)]
pub(crate) struct Board {
    base: NonNull<u8>,
    /// The queue's own board keeps its descriptor to pass to peers.
    fd: Option<OwnedFd>,
}

// SAFETY: the mapping is process-wide memory accessed only through atomics.
unsafe impl Send for Board {}
// SAFETY: as above.
unsafe impl Sync for Board {}

impl Board {
    /// Creates a board for a completion queue.
    pub(crate) fn create() -> Result<Board> {
        let fd = crate::sys::sealed_memfd(c"rdmabridge-cq", LEN).map_err(Error::SharedMemory)?;
        let base = crate::sys::map_shared(&fd, LEN).map_err(Error::SharedMemory)?;
        Ok(Board { base, fd: Some(fd) })
    }

    /// Maps a peer's board, checking that it cannot shrink under the mapping.
    pub(crate) fn open(fd: &OwnedFd) -> Result<Board> {
        let proto = |m: &str| Error::Protocol(format!("notice board: {m}"));
        // SAFETY: plain syscall on a descriptor we own.
        let seals = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })
            .map_err(|_| proto("not a sealable memfd"))?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(proto("not sealed against shrinking"));
        }
        // SAFETY: `st` is a live local that fstat fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }).map_err(Error::SharedMemory)?;
        if st.st_size < LEN as libc::off_t {
            return Err(proto("too small"));
        }
        let base = crate::sys::map_shared(fd, LEN).map_err(Error::SharedMemory)?;
        Ok(Board { base, fd: None })
    }

    /// The descriptor to pass to a peer (the queue's own board only).
    pub(crate) fn raw_fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(|f| f.as_raw_fd())
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= LEN);
        // SAFETY: `off` is 8-aligned inside the page, which lives as long as `self`; the page
        // is only ever accessed atomically.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    fn summary(&self) -> &AtomicU64 {
        self.word(0)
    }

    fn group(&self, g: usize) -> &AtomicU64 {
        self.word(WORDS_AT + 8 * g)
    }

    /// Marks `slot` as having news. The caller has issued a SeqCst fence after writing the
    /// news (see the module docs). A slot out of range marks nothing.
    pub(crate) fn mark(&self, slot: u32) {
        if slot >= SLOTS {
            return;
        }
        let (g, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        let w = self.group(g);
        // Already marked and not yet taken: the poller that takes it looks at the news too.
        if w.load(Ordering::SeqCst) & bit != 0 {
            return;
        }
        if w.fetch_or(bit, Ordering::SeqCst) == 0 {
            self.summary().fetch_or(1 << g, Ordering::SeqCst);
        }
    }

    /// Whether any slot may be marked: one load, the whole cost of an empty poll.
    pub(crate) fn any(&self) -> bool {
        self.summary().load(Ordering::Relaxed) != 0
    }

    /// Takes every mark, clearing them, and calls `f` with each marked slot. A slot's mark is
    /// cleared before `f` runs for it, so news that comes during the call marks it again.
    pub(crate) fn take(&self, mut f: impl FnMut(u32)) {
        let mut groups = self.summary().swap(0, Ordering::SeqCst);
        while groups != 0 {
            let g = groups.trailing_zeros();
            groups &= groups - 1;
            let mut bits = self.group(g as usize).swap(0, Ordering::SeqCst);
            // The clear above comes before reading any ring word of these slots
            // (Dekker with `mark`).
            fence(Ordering::SeqCst);
            while bits != 0 {
                let i = bits.trailing_zeros();
                bits &= bits - 1;
                f(g * 64 + i);
            }
        }
    }

    /// Marks `slot` again (news seen but not fully taken).
    pub(crate) fn remark(&self, slot: u32) {
        fence(Ordering::SeqCst);
        self.mark(slot);
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        // SAFETY: base/LEN are what mmap returned; nothing uses the mapping any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), LEN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(b: &Board) -> Vec<u32> {
        let mut v = Vec::new();
        b.take(|s| v.push(s));
        v
    }

    #[test]
    fn marks_are_taken_once_and_in_slot_order() {
        let b = Board::create().unwrap();
        assert!(!b.any());
        for s in [4095, 0, 64, 63, 0] {
            b.mark(s);
        }
        b.mark(SLOTS);
        b.mark(NO_SLOT);
        assert!(b.any());
        assert_eq!(taken(&b), vec![0, 63, 64, 4095]);
        assert!(!b.any());
        assert!(taken(&b).is_empty());
        b.remark(7);
        assert_eq!(taken(&b), vec![7]);
    }

    #[test]
    fn a_peer_sees_the_same_page() {
        let own = Board::create().unwrap();
        let fd = own.fd.as_ref().unwrap().try_clone().unwrap();
        let peer = Board::open(&fd).unwrap();
        peer.mark(100);
        assert_eq!(taken(&own), vec![100]);
        assert!(!peer.any());
    }
}
