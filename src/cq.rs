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
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result};
use crate::sync::SpinLock;
use crate::sys::EventFd;

pub(crate) mod notice;
mod options;
mod ready;
mod record;
mod report;
mod sink;
mod sources;
mod wait;

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
            // No arming here for a sleeper on the descriptor: once it has been asked for, the
            // library's threads keep the devices' completion events armed (see `fd`).
        }
        // Room left: the poll found the queue empty, which is where an edge-triggered waiter
        // goes to sleep; the next completion queued must make a new edge for it.
        if out.room() > 0 && self.ready.starve() {
            self.pop_into(&mut out);
        }
        out.filled()
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

    /// Whether a thread sleeps on, or somebody watches, the descriptor: then the devices must
    /// announce every completion, since nobody may be polling.
    pub(crate) fn watched(&self) -> bool {
        self.ready.watched()
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
    /// - level-triggered (`poll`, `select`, plain `epoll`): readable exactly while completions
    ///   are queued, once the calls that queue and take them have returned;
    /// - edge-triggered (`EPOLLET`, mio, tokio): after a [`poll`](Self::poll) (or any of the
    ///   polling calls) finds the queue empty, the next completion makes a new edge. So the
    ///   usual loop is safe: poll until `None` (for the batch forms, until a call returns
    ///   fewer than it asked for), then wait for the next edge (tokio: `clear_ready`, then
    ///   `readable().await`).
    ///
    /// Either way it may also wake with nothing to take (another thread took it first): poll,
    /// and wait again when the poll finds nothing.
    ///
    /// With [`Progress::Caller`], asking for it makes the devices announce every completion
    /// from then on, and the library's threads queue them as they come (as with
    /// [`Progress::Thread`]), which costs latency; a program that only polls should not ask
    /// for it.
    pub fn fd(&self) -> RawFd {
        if self.ready.export() {
            // From now on the devices announce every completion: ask for the next one, then
            // queue whatever came before the request.
            self.arm_sources();
            self.fill_from_sources(true);
        }
        self.ready.signal().raw()
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
