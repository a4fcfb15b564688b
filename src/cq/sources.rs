//! The connections a queue's pollers drive ([`Progress::Caller`]): those looked at on every
//! poll, those on the notice board looked at when their slot is marked, and the slots reserved
//! for connections being made.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::notice::{Board, SLOTS};
use super::{CompletionQueue, Progress, Sink};
use crate::sync::SpinGuard;

/// Completions a transport keeps where they finished (a device CQ, a connection's rings) until
/// a caller's poll takes them ([`Progress::Caller`]). Implemented by a verbs device CQ and an
/// shm connection.
pub(crate) trait Source: Send + Sync {
    /// The source's key (a connection or device CQ id), which the queue removes it by.
    fn key(&self) -> u64;
    /// Takes finished work (about as many records as `out` has room for), in order. Hands
    /// records to `out`'s slots when it has some and nothing is queued yet (so no record
    /// overtakes an older one of the same connection), else queues them.
    fn poll(&self, out: &mut Sink<'_>);
    /// Somebody is about to sleep on the queue or watch its descriptor: have the next
    /// completion moved into the queue without a poll (verbs: ask the device for an event,
    /// which the library's thread handles; shm: wake the connection's background work).
    fn arm(&self);
    /// After a poll of a connection with a notice-board slot that is polled every time:
    /// whether it has been idle long enough to leave that list, in which case it has asked its
    /// peer to mark the board when it next has news.
    fn settle(&self) -> bool {
        false
    }
    /// After a poll prompted by a mark on the board: whether the connection is busy (it
    /// moved something, or has work outstanding) and so joins the list polled every time,
    /// if that list has room.
    fn busy(&self) -> bool {
        true
    }
    /// Joins the list polled every time: the peer need not mark the board any more.
    fn activate(&self) {}
    /// A poller of the queue is about to sleep on its descriptor: for a connection polled
    /// every time, ask the peer to ring the queue's bell with its next news (see `bell.rs`).
    /// Returns false when news is there already (or the connection is busy elsewhere): the
    /// poller polls again.
    fn arm_bell(&self) -> bool {
        true
    }
    /// As [`arm_bell`](Self::arm_bell), for a source looked at on every poll that has a
    /// descriptor of its own to join the queue's (a verbs device CQ: its completion
    /// channel, on which the device announces the next completion).
    fn arm_descriptor(&self) -> bool {
        true
    }
}

impl CompletionQueue {
    /// Moves completions into the queue from every connection (`all`) or from those that may
    /// have news. Returns how many.
    pub(super) fn fill_from_sources(&self, all: bool) -> usize {
        let mut out = Sink::queue(self);
        if all {
            self.each_source(|s| s.poll(&mut out));
        } else {
            self.each_ready(|s| s.poll(&mut out));
        }
        out.produced()
    }

    pub(super) fn arm_sources(&self) {
        self.each_source(|s| s.arm());
    }

    fn lock_sources(&self) -> SpinGuard<'_, Sources> {
        self.sources.lock()
    }

    /// Calls `f` with every connection.
    fn each_source(&self, mut f: impl FnMut(&dyn Source)) {
        if self.nsources.load(Ordering::Relaxed) == 0 {
            return;
        }
        let sources = self.lock_sources();
        for s in sources.scan.iter().chain(sources.slots.iter().flatten()) {
            f(&**s);
        }
    }

    /// Calls `f` with every connection that may have news: those without a notice-board slot
    /// and the busy ones (always), and those whose slot is marked. A connection on the board
    /// joins the busy list when its slot is marked and it is busy, while that list holds
    /// fewer than [`BUSY_MAX`], and leaves it once idle (see [`Source::settle`]): a busy
    /// connection on the list costs its peer no marking, and with nothing marked and nothing
    /// on the list this is one load. Busy connections beyond the list's room stay on the
    /// board, marked by their peers whenever they have news, so that a poll's cost follows
    /// the news and not the number of busy connections.
    ///
    /// A poller never waits for another here: while one holds the lists (looking at the
    /// connections, or adding or removing one), the others return at once - the one inside
    /// takes what the connections have, and the marks it has not taken stay on the board for
    /// the next poll. (The sleeping path, `each_source`, does wait: it must look at them all.)
    #[inline(always)]
    pub(super) fn each_ready(&self, mut f: impl FnMut(&dyn Source)) {
        let marked = self.board.get().filter(|b| b.any());
        if marked.is_none() && self.nscan.load(Ordering::Relaxed) == 0 {
            return;
        }
        let Some(mut guard) = self.sources.try_lock() else {
            return;
        };
        let Sources {
            scan,
            slots,
            active,
            is_active,
            ..
        } = &mut *guard;
        let len = scan.len();
        if len == 1 {
            // The usual case with verbs: one device CQ for all the connections.
            f(&*scan[0]);
        } else if len > 1 {
            let start = self.next_source.fetch_add(1, Ordering::Relaxed) % len;
            for i in 0..len {
                f(&*scan[(start + i) % len]);
            }
        }
        let mut i = 0;
        while i < active.len() {
            let slot = active[i] as usize;
            let settled = match &slots[slot] {
                Some(s) => {
                    f(&**s);
                    s.settle()
                }
                None => true,
            };
            if settled {
                active.swap_remove(i);
                is_active[slot] = false;
            } else {
                i += 1;
            }
        }
        if let Some(board) = marked {
            board.take(|slot| {
                let slot = slot as usize;
                if let Some(Some(s)) = slots.get(slot)
                    && !is_active[slot]
                {
                    f(&**s);
                    if active.len() < BUSY_MAX && s.busy() {
                        // News the peer writes before it sees this is polled now anyway.
                        s.activate();
                        active.push(slot as u32);
                        is_active[slot] = true;
                    }
                }
            });
        }
        guard.publish_scan_count(&self.nscan);
    }

    /// [`Source::arm_bell`] for every connection looked at on every poll. Returns how many
    /// of those on the board it armed, or `None` when one had news or another poller holds
    /// the lists (the caller polls again).
    pub(super) fn arm_polled_sources(&self) -> Option<usize> {
        let guard = self.sources.try_lock()?;
        if guard.scan.iter().any(|s| !s.arm_descriptor()) {
            return None;
        }
        for &slot in &guard.active {
            if let Some(s) = &guard.slots[slot as usize]
                && !s.arm_bell()
            {
                return None;
            }
        }
        Some(guard.active.len())
    }

    /// Adds a connection that is looked at on every poll.
    pub(crate) fn add_source(&self, s: Arc<dyn Source>) {
        let mut sources = self.lock_sources();
        sources.scan.push(s);
        sources.publish_scan_count(&self.nscan);
        self.nsources.fetch_add(1, Ordering::Relaxed);
    }

    /// Reserves a notice-board slot for a connection being made, for its peer to mark. `None`
    /// when the queue's pollers take no part ([`Progress::Thread`]), the board is full, or it
    /// could not be made: the connection is then looked at on every poll.
    pub(crate) fn reserve_slot(self: &Arc<Self>) -> Option<SlotReservation> {
        if self.opts.progress != Progress::Caller {
            return None;
        }
        let board = match self.board.get() {
            Some(b) => b,
            None => {
                let b = Board::create().ok()?;
                // Another thread may have made one first: then that one is used.
                let _ = self.board.set(b);
                self.board.get()?
            }
        };
        let mut sources = self.lock_sources();
        let slot = match sources.free.pop() {
            Some(s) => s,
            None if (sources.slots.len() as u32) < SLOTS => {
                sources.slots.push(None);
                sources.is_active.push(false);
                sources.slots.len() as u32 - 1
            }
            None => return None,
        };
        Some(SlotReservation {
            cq: self.clone(),
            slot,
            board_fd: board.raw_fd().expect("the queue's own board"),
            used: false,
        })
    }

    /// Adds a connection at its reserved slot; a poll looks at it when its slot is marked
    /// (and once now, for anything that came before).
    pub(crate) fn add_source_at(&self, s: Arc<dyn Source>, mut r: SlotReservation) {
        let mut sources = self.lock_sources();
        sources.slots[r.slot as usize] = Some(s);
        r.used = true;
        self.nsources.fetch_add(1, Ordering::Relaxed);
        drop(sources);
        if let Some(b) = self.board.get() {
            b.remark(r.slot);
        }
        // A poller asleep on the descriptor announced its sleep before this connection came:
        // it looks now. SeqCst fence: the mark comes before the look at the descriptor,
        // pairing with the fence of its first arming (`Board::announce_sleep`).
        std::sync::atomic::fence(Ordering::SeqCst);
        self.ring_bell();
    }

    /// Marks a connection's slot, so that the next poll looks at it.
    pub(crate) fn remark(&self, slot: u32) {
        if let Some(b) = self.board.get() {
            b.remark(slot);
        }
    }

    pub(crate) fn remove_source(&self, key: u64) {
        let mut sources = self.lock_sources();
        let before = sources.scan.len();
        sources.scan.retain(|s| s.key() != key);
        let mut removed = before - sources.scan.len();
        let at = sources
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.key() == key));
        if let Some(i) = at {
            sources.slots[i] = None;
            sources.free.push(i as u32);
            if sources.is_active[i] {
                sources.is_active[i] = false;
                sources.active.retain(|&a| a as usize != i);
            }
            removed += 1;
        }
        sources.publish_scan_count(&self.nscan);
        self.nsources.fetch_sub(removed, Ordering::Relaxed);
    }
}

/// Connections at most on a queue's list polled every time: the usual one or few busy
/// connections, which spare their peers the marking. Polling one of them that has nothing
/// costs a look at its ring (a line the peer writes), so the list stays short.
const BUSY_MAX: usize = 2;

/// The connections a queue's pollers drive.
#[derive(Default)]
pub(super) struct Sources {
    /// Looked at on every poll (verbs connections, and shm ones without a slot).
    scan: Vec<Arc<dyn Source>>,
    /// By notice-board slot: looked at when the slot is marked.
    slots: Vec<Option<Arc<dyn Source>>>,
    /// Slots no connection holds or has reserved.
    free: Vec<u32>,
    /// Slots polled every time (busy connections), and whether each slot is among them.
    active: Vec<u32>,
    is_active: Vec<bool>,
}

impl Sources {
    /// Publishes how many connections a poll looks at every time, for the lock-free check
    /// of whether it must take the lock at all.
    fn publish_scan_count(&self, nscan: &AtomicUsize) {
        nscan.store(self.scan.len() + self.active.len(), Ordering::Relaxed);
    }
}

/// A notice-board slot reserved for a connection being made. Given back when dropped unless
/// the connection took it ([`CompletionQueue::add_source_at`]).
pub(crate) struct SlotReservation {
    cq: Arc<CompletionQueue>,
    slot: u32,
    board_fd: RawFd,
    used: bool,
}

impl SlotReservation {
    /// The slot, for the peer to mark.
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    /// The board's descriptor, to pass to the peer (owned by the queue).
    pub(crate) fn board_fd(&self) -> RawFd {
        self.board_fd
    }
}

impl std::fmt::Debug for SlotReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotReservation")
            .field("slot", &self.slot)
            .finish()
    }
}

impl Drop for SlotReservation {
    fn drop(&mut self) {
        if !self.used {
            self.cq.lock_sources().free.push(self.slot);
        }
    }
}
