//! The completion bridge: a lock-free queue the transports fill and any caller thread drains,
//! plus one pollable descriptor that is readable exactly while completions are queued. With
//! [`Progress::Caller`] the pollers also take verbs completions straight from the devices.
//!
//! Here: the queue, its polls and its descriptor. Apart: the records (`record.rs`), the options
//! (`options.rs`), the connections the pollers drive (`sources.rs`) and the notice board that
//! tells which of them have news (`notice.rs`), waiting (`wait.rs`), a connection's reporter
//! (`report.rs`), where a poll writes what it takes (`sink.rs`) and the descriptor's readiness
//! (`ready.rs`).

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result};
use crate::sync::SpinLock;
use crate::sys::EventFd;

mod bell;
pub(crate) mod notice;
mod options;
mod ready;
mod record;
mod report;
mod sink;
mod sources;
mod wait;

use bell::QueueFd;
use notice::Board;
pub use options::{CqOptions, DEFAULT_SPIN, Progress, SPIN_ADAPT_MAX, SPIN_MAX};
use ready::Readiness;
pub use record::{Completion, Opcode, WcStatus};
pub(crate) use report::Reporter;
pub(crate) use sink::Sink;
use sources::Sources;
pub(crate) use sources::{SlotReservation, Source};

/// How many completions a poll that hands them over one by one (through a closure, or into a
/// `Vec`) takes at a time, into slots on the stack.
pub(crate) const BATCH: usize = 32;

/// Hands the completions in `got` (all initialized) to `take`, in order.
fn hand_over(got: &[MaybeUninit<Completion>], take: &mut dyn FnMut(Completion)) {
    for c in got {
        // SAFETY: the caller's slots are initialized; `Completion` is `Copy`.
        take(unsafe { c.assume_init_read() });
    }
}

/// A completion queue that any number of connections share and any thread drains.
///
/// Thread-safe: `poll`, `wait` and `fd` may be called from any thread at once; pollers never
/// wait for each other (a poll that finds another thread taking completions from the
/// connections returns what is queued, perhaps nothing). Completions of one connection arrive
/// in the order its work finished.
pub struct CompletionQueue {
    queue: SegQueue<Completion>,
    /// The descriptor, readable exactly while `queue` holds completions.
    ready: Readiness,
    opts: CqOptions,
    /// Connections whose completions callers take from the device or the rings
    /// ([`Progress::Caller`]). A spin lock, taken on every poll that has connections to look
    /// at: its holders wait for nothing longer than a device CQ's or a connection's lock,
    /// which are held briefly.
    sources: SpinLock<Sources>,
    nsources: AtomicUsize,
    /// Connections looked at on every poll (`Sources::scan` and `Sources::active`).
    nscan: AtomicUsize,
    /// Where shm peers mark the connections that have news, so that a poll looks only at
    /// those; made with the first slot.
    board: OnceLock<Board>,
    /// The descriptor handed out with [`Progress::Caller`] (see `bell.rs`), made by the first
    /// call of [`fd`](Self::fd); `None` inside when it could not be made, or with progress
    /// threads, which hand out the eventfd itself.
    handed_out: OnceLock<Option<QueueFd>>,
    /// The bell's name is on the board.
    bell_named: AtomicBool,
    /// The bell may have been rung since it was last drained other than through the board's
    /// sleep announcement: a connection's own announcement, or this side itself.
    bell_maybe_rung: AtomicBool,
    /// Calls of `poll_with`: a sign of life of the pollers, which the shm transport samples
    /// to tell when they have stopped driving its connections.
    polls: AtomicU64,
    /// Where the next scan of `sources` starts, so a small `max` can't starve the later ones.
    next_source: AtomicUsize,
    /// How long recent waits took to find a completion, in nanoseconds: the longest of them,
    /// shrinking by an eighth with every shorter one; 0 once the queue went idle. `wait`
    /// polls for up to four times this (see [`CqOptions::spin`]).
    recent_wait: AtomicU64,
    /// How many waits in a row lasted longer than [`SPIN_ADAPT_MAX`].
    long_waits: AtomicU32,
    /// Twice the longest recent wait that slept and still found its completion within
    /// [`SPIN_ADAPT_MAX`], in nanoseconds, shrinking by a 16384th with every wait that did not
    /// sleep: waking up cost more than polling on would have, so waits poll at least this
    /// long for a good while (see [`CqOptions::spin`]).
    slept_wait: AtomicU64,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("queued", &self.queue.len())
            .field("opts", &self.opts)
            .finish()
    }
}

impl CompletionQueue {
    /// Creates an empty completion queue with the default options.
    pub fn new() -> Result<Arc<Self>> {
        Self::with_options(CqOptions::default())
    }

    /// Creates an empty completion queue.
    pub fn with_options(opts: CqOptions) -> Result<Arc<Self>> {
        if opts.spin > SPIN_MAX {
            return Err(Error::invalid(format!(
                "spin {:?} is longer than {SPIN_MAX:?}",
                opts.spin
            )));
        }
        Ok(Arc::new(CompletionQueue {
            queue: SegQueue::new(),
            ready: Readiness::new(EventFd::new().map_err(Error::CompletionQueue)?),
            opts,
            sources: SpinLock::new(Sources::default()),
            nsources: AtomicUsize::new(0),
            nscan: AtomicUsize::new(0),
            board: OnceLock::new(),
            handed_out: OnceLock::new(),
            bell_named: AtomicBool::new(false),
            bell_maybe_rung: AtomicBool::new(false),
            next_source: AtomicUsize::new(0),
            polls: AtomicU64::new(0),
            recent_wait: AtomicU64::new(0),
            long_waits: AtomicU32::new(0),
            slept_wait: AtomicU64::new(0),
        }))
    }

    /// The options the queue was made with.
    pub fn options(&self) -> CqOptions {
        self.opts
    }

    pub(crate) fn push(&self, c: Completion) {
        self.ready.push(|| self.queue.push(c));
    }

    fn pop(&self) -> Option<Completion> {
        self.ready.pop(|| self.queue.pop())
    }

    /// Takes the oldest completion, if any. Never blocks.
    pub fn poll(&self) -> Option<Completion> {
        let mut slot = [MaybeUninit::uninit()];
        let n = self.poll_slots(&mut slot);
        // SAFETY: poll_slots initialized the first `n` slots.
        (n == 1).then(|| unsafe { slot[0].assume_init_read() })
    }

    /// Takes up to `max` completions into `out` (appending). Returns how many were taken.
    pub fn poll_into(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let got = |b: &[MaybeUninit<Completion>], _| {
            // SAFETY: the batch's slots are initialized; `Completion` is `Copy`.
            out.extend(b.iter().map(|c| unsafe { c.assume_init_read() }));
        };
        self.poll_batches(max, |first| Ok(self.poll_slots(first)), got)
            .unwrap_or_default()
    }

    /// Hands up to `max` completions, oldest first, to `take`. Returns how many. Never blocks.
    pub fn poll_with(&self, max: usize, take: &mut dyn FnMut(Completion)) -> usize {
        self.poll_batches(
            max,
            |first| Ok(self.poll_slots(first)),
            |b, _| hand_over(b, take),
        )
        .unwrap_or_default()
    }

    /// Takes up to `max` completions in batches of at most [`BATCH`], in slots on the stack:
    /// the first batch from `first` (a poll, or a poll that waits), more with polls while the
    /// batches come back full. Each batch goes to `got` (its slots initialized) with the count
    /// of those before it. Returns how many in all; an error of `first`'s as it is.
    pub(crate) fn poll_batches(
        &self,
        max: usize,
        first: impl FnOnce(&mut [MaybeUninit<Completion>]) -> Result<usize>,
        mut got: impl FnMut(&[MaybeUninit<Completion>], usize),
    ) -> Result<usize> {
        let mut batch = [const { MaybeUninit::uninit() }; BATCH];
        let mut want = max.min(BATCH);
        let mut took = first(&mut batch[..want])?;
        let mut n = 0;
        loop {
            got(&batch[..took], n);
            n += took;
            if took < want || n == max {
                return Ok(n);
            }
            want = (max - n).min(BATCH);
            took = self.poll_slots(&mut batch[..want]);
        }
    }

    /// Takes up to `slots.len()` completions, oldest first, into the first slots. Returns
    /// how many (that many slots are initialized). Never blocks.
    pub(crate) fn poll_slots(&self, slots: &mut [MaybeUninit<Completion>]) -> usize {
        self.poll_sink(Sink::new(slots, self))
    }

    /// [`poll_slots`](Self::poll_slots) into records of the caller's own form (the C
    /// surface's), each converted as it is written.
    pub(crate) fn poll_records<R: From<Completion>>(
        &self,
        mut records: &mut [MaybeUninit<R>],
    ) -> usize {
        self.poll_sink(Sink::converting(&mut records, self))
    }

    /// Takes completions, oldest first, into `out`'s slots, and no more. Returns how many.
    #[inline(always)]
    fn poll_sink(&self, mut out: Sink<'_>) -> usize {
        // Not a read-modify-write: pollers racing may count two polls as one, which is still
        // a sign of life.
        self.polls
            .store(self.polls.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        if out.room() == 0 {
            return 0;
        }
        // The queue's count first: an empty poll then calls nothing to look at the queue.
        if !self.ready.none_pending() {
            self.pop_into(&mut out);
        }
        if out.room() > 0 && self.nsources.load(Ordering::Relaxed) > 0 {
            self.each_ready(|s| s.poll(&mut out));
            if out.room() > 0 && !self.ready.none_pending() {
                self.pop_into(&mut out);
            }
        }
        // Room left: the poll found the queue empty, which is where an edge-triggered waiter
        // goes to sleep; the next completion queued must make a new edge for it.
        if out.room() > 0 && self.ready.starve() {
            self.pop_into(&mut out);
        }
        // And the next news of a connection that the pollers move must ring the bell.
        if out.room() > 0
            && let Some(q) = self.bell()
        {
            self.arm_or_poll(q, &mut out);
        }
        out.filled()
    }

    /// The descriptor handed out with caller progress, once it has been.
    #[inline]
    fn bell(&self) -> Option<&QueueFd> {
        self.handed_out.get().and_then(Option::as_ref)
    }

    /// After a poll with room left (the queue found empty): asks the connections that the
    /// pollers move to ring the bell with their next news, polling them again when news came
    /// meanwhile. When news keeps coming as it tries, it rings the bell itself, so a waiter
    /// wakes and polls again: the descriptor never sleeps through news.
    #[inline(never)]
    fn arm_or_poll(&self, q: &QueueFd, out: &mut Sink<'_>) {
        self.arm_or(q, || {
            self.each_ready(|s| s.poll(out));
            if out.room() > 0 && !self.ready.none_pending() {
                self.pop_into(out);
            }
            // Full: the caller polls again before it sleeps.
            out.room() == 0
        });
    }

    /// Arms the bell (see [`arm_bell`](Self::arm_bell)), calling `poll` when news came
    /// meanwhile (it returns true when the caller got what it asked for and need not arm),
    /// twice; then rings the bell instead.
    fn arm_or(&self, q: &QueueFd, mut poll: impl FnMut() -> bool) {
        for _ in 0..2 {
            if self.arm_bell(q) || poll() {
                return;
            }
        }
        // Relaxed: drained by the next arming poll, whichever thread it runs on; a ring is
        // only ever one more wake-up.
        self.bell_maybe_rung.store(true, Ordering::Relaxed);
        q.ring();
    }

    /// Drains the bell and asks for a ring with the next news: on the board for connections
    /// that are marked there, on their own for those polled every time. Returns false when a
    /// connection had news already (or its lock was held): the caller polls again.
    fn arm_bell(&self, q: &QueueFd) -> bool {
        let Some(board) = self.board.get() else {
            // No connection that marks the board: nothing rings the bell but this side; the
            // connections looked at on every poll arm what they have (a device's channel).
            return self.nsources.load(Ordering::Relaxed) == 0
                || self.arm_polled_sources().is_some();
        };
        // Relaxed, here and below: only this queue's pollers read them, and a stale look
        // costs one drain more or less (the drain comes before the announcement either way).
        if !self.bell_named.load(Ordering::Relaxed) {
            board.set_bell_name(q.name());
            self.bell_named.store(true, Ordering::Relaxed);
        }
        let rung = self.bell_maybe_rung.swap(false, Ordering::Relaxed);
        if rung || !board.sleep_announced() {
            // Rung since the last arming: the news is found by the looks below (or was taken
            // by a poll), so the rings need not wake a level-triggered waiter again.
            q.drain();
        }
        if board.announce_sleep() {
            return false;
        }
        match self.arm_polled_sources() {
            Some(armed) => {
                if armed > 0 {
                    self.bell_maybe_rung.store(true, Ordering::Relaxed);
                }
                true
            }
            None => false,
        }
    }

    /// Takes queued completions into `out`'s free slots. Its callers look at the queue's count
    /// first (one load, where asking the queue itself costs a fence).
    fn pop_into(&self, out: &mut Sink<'_>) {
        while out.room() > 0 {
            match self.pop() {
                Some(c) => out.put(c),
                None => break,
            }
        }
    }

    /// How many polls there have been (see `polls`).
    pub(crate) fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }

    /// The descriptor handed out with caller progress, once it has been (a verbs device CQ
    /// adds its completion channel to it).
    #[cfg(feature = "verbs")]
    pub(crate) fn queue_fd(&self) -> Option<&QueueFd> {
        self.bell()
    }

    /// Whether the library's threads must move a connection's data now (with
    /// [`Progress::Caller`]): while a thread sleeps in [`wait`](Self::wait), and once the
    /// descriptor has been handed out - unless the connection wakes the descriptor itself
    /// (`on_board`: an shm connection that rings the bell, a verbs device CQ whose channel
    /// joins the set) and there is one, in which case the pollers go on moving it. One load
    /// while nobody watches.
    #[inline]
    pub(crate) fn library_moves(&self, on_board: bool) -> bool {
        match self.ready.slept_on() {
            None => false,
            Some(true) => true,
            Some(false) => !(on_board && self.bell().is_some()),
        }
    }

    /// Whether the descriptor has been handed out with a bell in it.
    #[inline]
    pub(crate) fn has_bell(&self) -> bool {
        self.bell().is_some()
    }

    /// A connection asked its peer to ring the bell: the next arming drains it.
    pub(crate) fn ring_asked(&self) {
        // Relaxed: see `arm_bell`.
        self.bell_maybe_rung.store(true, Ordering::Relaxed);
    }

    /// News reached a connection some other way than the bell (a doorbell on its socket)
    /// while its pollers may sleep on the descriptor: rings the bell for them.
    pub(crate) fn ring_bell(&self) {
        if let Some(q) = self.bell() {
            self.bell_maybe_rung.store(true, Ordering::Relaxed);
            q.ring();
        }
    }

    /// Number of completions queued right now (not counting any still in a device).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no completion is queued right now (not counting any still in a device).
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether nothing is queued, in one load: `false` may still mean an empty queue (a
    /// completion on its way in or out), `true` never means a queued one.
    #[cfg(feature = "verbs")]
    #[inline]
    pub(crate) fn surely_empty(&self) -> bool {
        self.ready.none_pending()
    }

    /// A descriptor for epoll, poll, select, mio or tokio's `AsyncFd` (also through
    /// [`AsFd`] and [`AsRawFd`]). Owned by the queue; do not read, write or close it.
    ///
    /// Readiness, for both kinds of waiter:
    /// - level-triggered (`poll`, `select`, plain `epoll`): readable while a poll would find a
    ///   completion - one queued, or one a poll would take from a connection; unreadable once
    ///   a poll has found nothing and nothing has come since;
    /// - edge-triggered (`EPOLLET`, mio, tokio): after a [`poll`](Self::poll) (or any of the
    ///   polling calls) finds the queue empty, the next completion makes a new edge. So the
    ///   usual loop is safe: poll until `None` (for the batch forms, until a call returns
    ///   fewer than it asked for), then wait for the next edge (tokio: `clear_ready`, then
    ///   `readable().await`).
    ///
    /// Either way it may also wake with nothing to take (another thread took it first, or
    /// what woke it is not a completion yet): poll, and wait again when the poll finds
    /// nothing. Nothing need be polled before the first wait: handing it out counts as a poll
    /// that found the queue empty.
    ///
    /// With [`Progress::Caller`] the pollers go on moving the data: the poll that finds the
    /// queue empty asks for the descriptor to become readable with the next news (as
    /// `ibv_req_notify_cq`, `ucp_worker_arm` or `fi_trywait` are called before a sleep) - shm
    /// peers ring a socket, verbs devices announce the next completion on their completion
    /// channel - and the descriptor holds those beside the queue's own readiness. A
    /// completion that comes while the program polls, or wakes it, never crosses a library
    /// thread. (While a thread sleeps in [`wait`](Self::wait), the library's threads move
    /// the completions, as with [`Progress::Thread`].)
    pub fn fd(&self) -> RawFd {
        let set = self.handed_out.get_or_init(|| {
            (self.opts.progress == Progress::Caller)
                .then(|| QueueFd::new(self.ready.signal().raw()).ok())
                .flatten()
        });
        if self.ready.export() {
            // From now on the devices announce every completion: ask for the next one, then
            // queue whatever came before the request.
            self.arm_sources();
            self.fill_from_sources(true);
            // As after a poll that found the queue empty: nobody need poll before sleeping.
            if let Some(q) = set {
                self.arm_or(q, || {
                    self.fill_from_sources(false);
                    false
                });
            }
        }
        set.as_ref().map_or(self.ready.signal().raw(), QueueFd::raw)
    }
}

impl AsFd for CompletionQueue {
    /// [`CompletionQueue::fd`], borrowed for as long as the queue lives.
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the eventfd is owned by the queue and closed only when it drops, which the
        // borrow of `self` rules out for the lifetime returned.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl AsRawFd for CompletionQueue {
    /// [`CompletionQueue::fd`].
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

// Not in `loom` builds, where the queue's readiness is made of loom's atomics, which only work
// inside a model.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A queue, and a connection's reporter on it.
    pub(super) fn queue_and_reporter() -> (Arc<CompletionQueue>, Reporter) {
        let cq = CompletionQueue::new().unwrap();
        let r = Reporter {
            cq: cq.clone(),
            conn_id: 1,
            context: 0,
            peer: String::new(),
        };
        (cq, r)
    }

    /// The polls that hand completions over in batches (a closure's, a `Vec`'s) take them all,
    /// in order, across batch boundaries, and never more than asked; a `max` of `usize::MAX`
    /// takes what there is.
    #[test]
    fn polls_in_batches_take_everything_in_order_and_no_more_than_asked() {
        let (cq, r) = queue_and_reporter();
        let total = 3 * BATCH as u64 + 5;
        for i in 0..total {
            cq.push(r.record(i, Opcode::Send, WcStatus::Success, 0, None));
        }
        let mut got = Vec::new();
        assert_eq!(cq.poll_into(&mut got, BATCH + 1), BATCH + 1);
        let mut ids = Vec::new();
        assert_eq!(cq.poll_with(BATCH, &mut |c| ids.push(c.wr_id)), BATCH);
        got.extend(
            ids.iter()
                .map(|&i| r.record(i, Opcode::Send, WcStatus::Success, 0, None)),
        );
        assert_eq!(cq.poll().map(|c| c.wr_id), Some(2 * BATCH as u64 + 1));
        let rest = cq.poll_into(&mut got, usize::MAX);
        assert_eq!(rest, total as usize - 2 * BATCH - 2);
        assert_eq!(cq.poll_into(&mut got, usize::MAX), 0);
        let mut want: Vec<u64> = (0..total).collect();
        want.remove(2 * BATCH + 1);
        assert_eq!(got.iter().map(|c| c.wr_id).collect::<Vec<_>>(), want);
        assert!(cq.poll().is_none());
    }
}
