//! What the transport keeps per context about the processes it connects to, so that a
//! connection pays once per peer, not once per connection: the peers' notice boards it has
//! mapped (one mapping per board, shared by every connection that marks it) and whether it can
//! read a peer process's memory (one probe per process).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, Weak};

use crate::cq::notice::Board;
use crate::error::{Error, Result};
use crate::shm::direct;

/// Probe results kept before the oldest are forgotten (a forgotten one is probed again).
const PROBES_MAX: usize = 1024;

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
}

#[derive(Default)]
struct Boards {
    by_inode: HashMap<(libc::dev_t, libc::ino_t), Weak<Board>>,
    /// Entries at which dead ones are swept next (twice the live ones at the last sweep).
    sweep_at: usize,
}

/// A peer process, and its probe word's address and value (see `direct.rs`).
type Probe = (libc::pid_t, u64, u64);

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
