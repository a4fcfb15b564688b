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
//! The page also carries the queue's sleep announcement (at [`SLEEPER_AT`]) and, from when
//! its descriptor is handed out, the name of its bell (`bell.rs`, at [`BELL_AT`]): a poll
//! that finds the queue empty sets the word and looks at the summary once more, a peer that
//! marks a slot looks at the word after the mark and rings the bell if it takes the word
//! down (Dekker again: either the poll sees the mark or the peer sees the word).
//!
//! The page is a sealed memfd that each peer maps. A peer may write anything into it: a wrong
//! bit only makes a poll look at a connection with nothing new, a wrong word a bell rung for
//! nothing, and a wrong name is checked before it is rung.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::bell;
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
/// The sleep announcement: 1 while a poller of the queue sleeps or is about to.
const SLEEPER_AT: usize = 1024;
/// The bell's name: its length, then its bytes, in words.
const BELL_AT: usize = 1088;
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

    /// Maps a peer's board, checking that it cannot shrink under the mapping; `st` is what
    /// `fstat` says of `fd`.
    pub(crate) fn open(fd: &OwnedFd, st: &libc::stat) -> Result<Board> {
        // The bell of the board's queue may be rung from now on.
        let _ = bell::sender();
        let proto = |m: &str| Error::Protocol(format!("notice board: {m}"));
        // SAFETY: plain syscall on a descriptor we own.
        let seals = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })
            .map_err(|_| proto("not a sealable memfd"))?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(proto("not sealed against shrinking"));
        }
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

    /// Writes the name of the queue's bell, for peers to ring (the queue's own board only).
    pub(crate) fn set_bell_name(&self, name: &[u8]) {
        let name = &name[..name.len().min(bell::NAME_MAX)];
        for (i, chunk) in name.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            // Relaxed: published by the SeqCst store of the length below.
            self.word(BELL_AT + 8 + 8 * i)
                .store(u64::from_ne_bytes(w), Ordering::Relaxed);
        }
        self.word(BELL_AT)
            .store(name.len() as u64, Ordering::SeqCst);
    }

    /// The bell's name as the page says (a peer's page: checked by whoever rings it).
    fn bell_name(&self, out: &mut [u8; bell::NAME_MAX]) -> usize {
        // SeqCst: pairs with the store in `set_bell_name`.
        let len = (self.word(BELL_AT).load(Ordering::SeqCst) as usize).min(bell::NAME_MAX);
        for (i, chunk) in out[..len].chunks_mut(8).enumerate() {
            let w = self
                .word(BELL_AT + 8 + 8 * i)
                .load(Ordering::Relaxed)
                .to_ne_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
        len
    }

    /// Announces that a poller goes to sleep, then tells whether any slot is marked: if so,
    /// the poller must poll again rather than sleep. Otherwise a peer that marks a slot from
    /// now on rings the bell (see the module's docs).
    pub(crate) fn announce_sleep(&self) -> bool {
        bell::announce_sleep(self.word(SLEEPER_AT), self.summary())
    }

    /// Whether the sleep announcement is still up (no peer has rung since it was made).
    pub(crate) fn sleep_announced(&self) -> bool {
        self.word(SLEEPER_AT).load(Ordering::Relaxed) == 1
    }

    /// The marker's side, after [`mark`](Self::mark): rings the queue's bell if a poller
    /// announced its sleep, taking the announcement down so that one ring serves it. Returns
    /// false when the bell could not be rung (the caller wakes the peer another way).
    pub(crate) fn ring_sleeper(&self) -> bool {
        !bell::take_sleeper(self.word(SLEEPER_AT)) || self.ring_bell()
    }

    /// Rings the queue's bell as named on the page.
    pub(crate) fn ring_bell(&self) -> bool {
        let mut name = [0u8; bell::NAME_MAX];
        let len = self.bell_name(&mut name);
        bell::ring(&name[..len])
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

    fn open(fd: &OwnedFd) -> Board {
        Board::open(fd, &crate::sys::fstat(fd).unwrap()).unwrap()
    }

    #[test]
    fn a_mark_after_an_announced_sleep_rings_the_bell_once() {
        let ev = crate::sys::EventFd::new().unwrap();
        let q = bell::QueueFd::new(ev.raw()).unwrap();
        let own = Board::create().unwrap();
        own.set_bell_name(q.name());
        let peer = open(own.fd.as_ref().unwrap());
        let readable = || crate::sys::poll_one(q.raw(), libc::POLLIN, Some(Default::default()));
        assert!(peer.ring_sleeper(), "nobody sleeps: nothing to ring");
        assert!(!readable().unwrap());
        assert!(!own.announce_sleep(), "nothing marked");
        peer.mark(3);
        assert!(peer.ring_sleeper());
        assert!(readable().unwrap());
        q.drain();
        assert!(!own.sleep_announced());
        peer.mark(4);
        assert!(peer.ring_sleeper());
        assert!(!readable().unwrap(), "one ring for one sleep");
        assert!(own.announce_sleep(), "marks are waiting: no sleep");
    }

    #[test]
    fn a_peer_sees_the_same_page() {
        let own = Board::create().unwrap();
        let fd = own.fd.as_ref().unwrap().try_clone().unwrap();
        let peer = open(&fd);
        peer.mark(100);
        assert_eq!(taken(&own), vec![100]);
        assert!(!peer.any());
    }
}
