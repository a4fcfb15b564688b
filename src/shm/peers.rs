//! What the transport keeps per context about the processes it connects to, so that a
//! connection pays once per peer, not once per connection: the peers' notice boards it has
//! mapped (one mapping per board, shared by every connection that marks it), whether it can
//! read a peer process's memory (one probe per process), and the segments of its closed
//! connections.
//!
//! **Kept segments.** Making a segment (a memfd, sized, sealed, mapped, its pages faulted in)
//! and unmapping it at the end is about half of what an shm connection costs the listener. So
//! when the last user of a connection's segment lets go of it, the mapping is kept (at most
//! [`KEPT_MAX`] on each side, small rings only) for the next connection between the same two
//! processes. Reuse needs both sides to have let go: the connecting side offers a segment it
//! keeps from the listener's process in its hello (and holds it for that connection until the
//! answer, then unmaps it if not taken up); the listener takes it up if it made it for the same
//! client process - known by its process id and its random probe word (see `direct.rs`), so
//! never one another process ever mapped - and keeps it, makes it as new
//! ([`Segment::reset`]), and names it in its accept instead of sending a descriptor. A client
//! that lies about letting go only spoils its own connection; a listener can name only a
//! segment the client already maps, which the client checks as a new one.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, Weak};

use crate::cq::notice::Board;
use crate::error::{Error, Result};
use crate::shm::direct;
use crate::shm::segment::{Keeper, Segment};

/// Probe results kept before the oldest are forgotten (a forgotten one is probed again).
const PROBES_MAX: usize = 1024;
/// Segments kept on each side (made, and mapped from peers) before the oldest are unmapped.
const KEPT_MAX: usize = 64;
/// Largest segment kept: 64 KiB rings and the header (the default rings are 32 KiB), so the
/// segments kept hold at most about 9 MiB of a process's memory.
const KEPT_LEN_MAX: usize = 16 * 1024 + 2 * 64 * 1024;
/// Most segments a hello may offer.
pub(crate) const OFFERS_MAX: usize = 4;
/// Segments a hello offers: one. An offer the listener does not take up is unmapped (the
/// listener no longer keeps it, or has not let go of it yet: either way it would most likely
/// miss again), so offering more would unmap more; and connections started together do not
/// take all the segments kept between two processes.
const OFFERS: usize = 1;

/// Whose a kept segment is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept {
    /// Made by this side for the client process with this probe (see [`Probe`]).
    Made(Probe),
    /// Mapped from the listener's process with this id.
    Mapped(libc::pid_t),
}

/// The context's knowledge of its peers (its [`TransportStates`](crate::domain::TransportStates)
/// entry for shm).
#[derive(Default)]
pub(crate) struct Peers {
    /// Boards mapped, by the memfd's inode. An entry lives while a connection holds the board
    /// (its mapping keeps the inode, so the number names no other file meanwhile); dead ones
    /// are swept as boards are added.
    boards: Mutex<Boards>,
    /// Probe outcomes by the peer's process and the word it named.
    readable: Mutex<HashMap<Probe, bool>>,
    /// Segments of closed connections, oldest first: made by this side, and mapped from peers.
    made: Mutex<VecDeque<(Probe, Segment)>>,
    mapped: Mutex<VecDeque<(libc::pid_t, Segment)>>,
}

#[derive(Default)]
struct Boards {
    by_inode: HashMap<(libc::dev_t, libc::ino_t), Weak<Board>>,
    /// Entries at which dead ones are swept next (twice the live ones at the last sweep).
    sweep_at: usize,
}

/// A peer process, and its probe word's address and value (see `direct.rs`).
pub(crate) type Probe = (libc::pid_t, u64, u64);

/// Adds `seg` to `list` under `key`; returns the oldest when there are too many.
fn push<K>(list: &Mutex<VecDeque<(K, Segment)>>, key: K, seg: Segment) -> Option<(K, Segment)> {
    let mut list = list.lock().unwrap_or_else(|p| p.into_inner());
    list.push_back((key, seg));
    (list.len() > KEPT_MAX).then(|| list.pop_front()).flatten()
}

impl Peers {
    /// The peer's board that `fd` names: the mapping a live connection already holds, or a new
    /// one (checked as [`Board::open`] checks it).
    pub(crate) fn board(&self, fd: &OwnedFd) -> Result<Arc<Board>> {
        let st = crate::sys::fstat(fd).map_err(Error::SharedMemory)?;
        let key = (st.st_dev, st.st_ino);
        let mut boards = self.boards.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(board) = boards.by_inode.get(&key).and_then(Weak::upgrade) {
            return Ok(board);
        }
        let board = Arc::new(Board::open(fd, &st)?);
        if boards.by_inode.len() >= boards.sweep_at {
            boards.by_inode.retain(|_, b| b.strong_count() > 0);
            boards.sweep_at = (2 * boards.by_inode.len()).max(16);
        }
        boards.by_inode.insert(key, Arc::downgrade(&board));
        Ok(board)
    }

    /// What keeps a segment as `kept` says when it is dropped, while the context's `peers` are
    /// there (see [`Segment::keep_with`]).
    pub(crate) fn keeper(peers: &Arc<Peers>, kept: Kept) -> Keeper {
        let peers = Arc::downgrade(peers);
        Box::new(move |seg| {
            if let Some(peers) = peers.upgrade() {
                peers.keep(kept, seg);
            }
        })
    }

    /// Keeps the segment of a closed connection (see the module's documentation); a large
    /// one, or the oldest when too many are kept, is unmapped.
    fn keep(&self, kept: Kept, seg: Segment) {
        if seg.len() > KEPT_LEN_MAX {
            return;
        }
        // Unmapped (dropped) outside the lock.
        let _oldest = match kept {
            Kept::Made(probe) => push(&self.made, probe, seg).map(|(_, s)| s),
            Kept::Mapped(pid) => push(&self.mapped, pid, seg).map(|(_, s)| s),
        };
    }

    /// For a hello to the listener process `pid`: takes out the segments kept from it (at most
    /// [`OFFERS`], oldest first), which the connection then holds; those the listener does not
    /// take up are unmapped when dropped.
    pub(crate) fn offers(&self, pid: libc::pid_t) -> Vec<Segment> {
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        while out.len() < OFFERS
            && let Some(at) = mapped.iter().position(|(p, _)| *p == pid)
        {
            out.extend(mapped.remove(at).map(|(_, s)| s));
        }
        out
    }

    /// For an accept to the client `probe`, which offered the segments `offers` (inode
    /// numbers): the first of them this side made for that client and keeps, with rings of
    /// `cap` bytes, and its index among the offers.
    pub(crate) fn take_offered(
        &self,
        probe: Probe,
        offers: &[u64],
        cap: usize,
    ) -> Option<(usize, Segment)> {
        if offers.is_empty() {
            return None;
        }
        let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        offers.iter().enumerate().find_map(|(i, &ino)| {
            let at = made
                .iter()
                .position(|(p, s)| *p == probe && s.ino() == ino && s.cap() == cap)?;
            made.remove(at).map(|(_, s)| (i, s))
        })
    }

    /// Whether this process can read the memory of the peer `pid`, whose probe word is at
    /// `addr` holding `value`. Asked once per process and word: the word's value is random
    /// per process, so another process that comes to have the same id names another word.
    /// A process that makes itself unreadable later fails its own direct messages, as it
    /// would on the connections it already has.
    pub(crate) fn can_read(&self, pid: libc::pid_t, addr: u64, value: u64) -> bool {
        let key = (pid, addr, value);
        if let Some(&known) = self
            .readable
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return known;
        }
        // Not under the lock: it reads the peer's memory.
        let can = direct::can_read(pid, addr, value);
        let mut readable = self.readable.lock().unwrap_or_else(|p| p.into_inner());
        if readable.len() >= PROBES_MAX {
            readable.clear();
        }
        readable.insert(key, can);
        can
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::BorrowedFd;

    use super::*;

    /// A descriptor of `board`'s memfd, as a peer receives it.
    fn passed(board: &Board) -> OwnedFd {
        let raw = board.raw_fd().expect("a queue's own board");
        // SAFETY: `board` keeps the descriptor open for the duration of the borrow.
        unsafe { BorrowedFd::borrow_raw(raw) }
            .try_clone_to_owned()
            .unwrap()
    }

    #[test]
    fn connections_to_one_board_share_one_mapping_while_any_holds_it() {
        let peers = Peers::default();
        let (own, other) = (Board::create().unwrap(), Board::create().unwrap());
        let first = peers.board(&passed(&own)).unwrap();
        let second = peers.board(&passed(&own)).unwrap();
        assert!(Arc::ptr_eq(&first, &second), "one mapping for one board");
        let elsewhere = peers.board(&passed(&other)).unwrap();
        assert!(!Arc::ptr_eq(&first, &elsewhere));
        // What one peer's mapping marks, the board's queue sees.
        second.mark(7);
        let mut marked = Vec::new();
        own.take(|s| marked.push(s));
        assert_eq!(marked, vec![7]);
        drop((first, second));
        let again = peers.board(&passed(&own)).unwrap();
        assert_eq!(
            Arc::strong_count(&again),
            1,
            "the cache holds no mapping alive"
        );
        again.mark(9);
        own.take(|s| assert_eq!(s, 9));
    }

    /// A new segment of the default size, and its inode number.
    fn segment() -> (Segment, u64) {
        let (seg, _fd) = Segment::create(crate::conn::SHM_RING_DEFAULT as usize).unwrap();
        let ino = seg.ino();
        (seg, ino)
    }

    #[test]
    fn a_kept_segment_is_taken_up_only_by_its_own_peer_and_ring_size() {
        let peers = Arc::new(Peers::default());
        let (me, other) = ((7, 1, 2), (7, 1, 3));
        let (mut seg, ino) = segment();
        seg.keep_with(Peers::keeper(&peers, Kept::Made(me)));
        drop(seg);
        let cap = crate::conn::SHM_RING_DEFAULT as usize;
        assert!(
            peers.take_offered(other, &[ino], cap).is_none(),
            "another peer"
        );
        assert!(
            peers.take_offered(me, &[ino], 2 * cap).is_none(),
            "another size"
        );
        assert!(
            peers.take_offered(me, &[ino + 1], cap).is_none(),
            "not offered"
        );
        let (i, seg) = peers
            .take_offered(me, &[ino + 1, ino], cap)
            .expect("taken up");
        assert_eq!((i, seg.ino()), (1, ino));
        assert!(peers.take_offered(me, &[ino], cap).is_none(), "taken once");
        // Mapped from a listener: offered to that listener's process only, once.
        let mut seg = seg;
        seg.keep_with(Peers::keeper(&peers, Kept::Mapped(9)));
        drop(seg);
        assert!(peers.offers(8).is_empty());
        let offered = peers.offers(9);
        assert_eq!(offered.iter().map(Segment::ino).collect::<Vec<_>>(), [ino]);
        assert!(
            peers.offers(9).is_empty(),
            "held by the connection that offered it"
        );
        drop(offered);
        assert!(
            peers.offers(9).is_empty(),
            "an offer not taken up is unmapped"
        );
    }

    #[test]
    fn at_most_kept_max_segments_are_kept_the_oldest_go_first() {
        let peers = Arc::new(Peers::default());
        let inos: Vec<u64> = (0..KEPT_MAX + 3)
            .map(|_| {
                let (mut seg, ino) = segment();
                seg.keep_with(Peers::keeper(&peers, Kept::Mapped(9)));
                ino
            })
            .collect();
        assert_eq!(peers.mapped.lock().unwrap().len(), KEPT_MAX);
        let offered = peers.offers(9);
        assert_eq!(offered[0].ino(), inos[3], "the three oldest were unmapped");
        // Large rings are not kept; nothing is once the context's state is gone.
        let (mut big, _fd) = Segment::create(1 << 20).unwrap();
        big.keep_with(Peers::keeper(&peers, Kept::Mapped(9)));
        drop(big);
        assert_eq!(peers.mapped.lock().unwrap().len(), KEPT_MAX - 1);
        let (mut seg, _) = segment();
        seg.keep_with(Peers::keeper(&peers, Kept::Mapped(9)));
        drop(peers);
        drop(seg);
    }

    #[test]
    fn a_probe_is_answered_once_per_process_and_word() {
        let peers = Peers::default();
        let (addr, value) = direct::probe();
        // SAFETY: getpid cannot fail.
        let me = unsafe { libc::getpid() };
        assert!(peers.can_read(me, addr, value));
        assert!(peers.can_read(me, addr, value));
        assert!(
            !peers.can_read(me, addr, value ^ 2),
            "another word is probed anew"
        );
        assert_eq!(peers.readable.lock().unwrap().len(), 2);
    }
}
