//! The completion bridge: a lock-free queue the transports fill and any caller thread drains,
//! plus one pollable descriptor that is readable exactly while completions are queued. With
//! [`Progress::Caller`] the pollers also take verbs completions straight from the devices.

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result};
use crate::sync::{SpinGuard, SpinLock, SpinningWait, YIELD_EVERY, pinned_to_one_cpu};
use crate::sys::{self, EventFd};

pub(crate) mod notice;
mod ready;
mod sink;
use notice::{Board, SLOTS};
use ready::Readiness;
pub(crate) use sink::Sink;

/// What a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Opcode {
    /// A posted send finished (or failed).
    Send,
    /// A posted receive was filled (or failed).
    Recv,
    /// A one-sided write (with or without immediate) finished (or failed).
    Write,
    /// A one-sided read finished: the bytes are in the local segments.
    Read,
    /// A fetch-and-add finished: the word as it was is in the local segment.
    FetchAdd,
    /// A compare-and-swap finished: the word as it was is in the local segment.
    CmpSwap,
    /// A posted receive was consumed by the peer's write with immediate: `imm` carries the
    /// value, `byte_len` the bytes written, which are in place.
    RecvWriteImm,
    /// Connection event: the connection is down and every work request it had has completed.
    /// It is the last record a connection ever produces.
    Disconnected,
}

/// How a work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcStatus {
    /// It succeeded.
    Success,
    /// The connection went down before it ran.
    Flushed,
    /// The incoming message was larger than the posted receive buffer.
    LocalLength,
    /// The peer could not take the message (for a send: its receive buffer was too small).
    RemoteError,
    /// The peer vanished or the link failed (for a disconnect event: it was not a clean close).
    Transport,
    /// The local memory region does not allow the access.
    LocalProtection,
    /// The remote memory region does not allow the access.
    RemoteAccess,
    /// Any other failure.
    General,
    /// For a disconnect event: the peer made a one-sided access this side had not allowed (a
    /// key it was never given, a range past a region, a right the region does not grant), and
    /// the connection failed for it. Over verbs: the device failed the queue pair for a request
    /// of the peer's, as it does for such an access.
    PeerAccess,
}

/// One finished work request or connection event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The caller's work-request id, echoed (0 for connection events).
    pub wr_id: u64,
    /// The connection it belongs to ([`crate::Connection::id`]).
    pub conn_id: u64,
    /// The connection's user context ([`crate::ConnOptions::context`]).
    pub context: usize,
    /// What finished.
    pub opcode: Opcode,
    /// How it ended.
    pub status: WcStatus,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// Immediate data, when the message carried some.
    pub imm: Option<u32>,
}

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

/// Who moves a connection's finished work from the device into the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Progress {
    /// The thread that polls or waits on the queue takes verbs completions straight from the
    /// device, and moves shm messages between the shared rings and the posted receives (a post
    /// writes its message into the ring itself when it can): no thread hand-off and no system
    /// call on the busy path. A library thread still handles connection events, keepalives and
    /// teardown (one per context, for all its connections), and moves work only while a caller sleeps in [`CompletionQueue::wait`] or
    /// watches [`CompletionQueue::fd`] (and, over shm, for sends that wait for ring space,
    /// and when nobody has polled for 10 ms). The default (it measured faster; see
    /// docs/performance.md).
    Caller,
    /// A library thread moves each connection's work and every completion into the queue
    /// (the context's one thread for all its connections: verbs on the device's completion
    /// events; shm between the rings and the posted buffers, taking turns among the busy
    /// ones); callers only take completions from there.
    Thread,
}

impl Progress {
    /// `RBR_PROGRESS=caller|thread` when set to one of those, else [`Progress::Caller`].
    pub fn from_env() -> Progress {
        match std::env::var("RBR_PROGRESS").as_deref() {
            Ok("thread") => Progress::Thread,
            _ => Progress::Caller,
        }
    }
}

/// How a completion queue makes progress and waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqOptions {
    /// Who takes verbs completions from the device. Default: [`Progress::from_env`].
    pub progress: Progress,
    /// How long [`CompletionQueue::wait`] keeps polling before it sleeps, at the least.
    /// With [`Progress::Caller`], while completions keep coming soon after waits start, a wait
    /// polls longer: up to four times the longest recent wait (a figure that shrinks by an
    /// eighth with every wait that is shorter), and at least twice the longest recent wait
    /// that slept and was woken within 1 ms (a figure that shrinks by a 16384th with every
    /// wait that did not sleep: waking up cost more than polling on would have), never past
    /// 1 ms, so that a steady exchange whose round trip is near `spin`, or that is held up
    /// now and then, does not fall into the sleeping path. After a
    /// wait longer than 1 ms (the queue went idle, or waking up took that long),
    /// waits poll for `spin` again, except the first and every 16th of a run of such waits,
    /// which poll for 1 ms to find out whether completions come soon again.
    /// (With [`Progress::Thread`] the wait polls for `spin` exactly: longer polling would take
    /// the CPU from the threads that fill the queue.) Zero never polls: every wait sleeps at
    /// once. Default 50 µs; at most 1 s.
    /// On a thread that may run on one CPU only, a wait that polls yields that CPU
    /// (`sched_yield`) every 20 µs, so that the library's thread, which shares it, is not held
    /// up for a scheduler slice.
    pub spin: Duration,
}

impl Default for CqOptions {
    fn default() -> Self {
        CqOptions {
            progress: Progress::from_env(),
            spin: DEFAULT_SPIN,
        }
    }
}

/// The default of [`CqOptions::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Longest [`CqOptions::spin`].
pub const SPIN_MAX: Duration = Duration::from_secs(1);
/// Longest that [`CompletionQueue::wait`] extends its polling to, beyond [`CqOptions::spin`],
/// while completions keep coming soon after waits start.
pub const SPIN_ADAPT_MAX: Duration = Duration::from_millis(1);

/// Completions a connection keeps in the device until a caller takes them
/// ([`Progress::Caller`]). Implemented by the verbs connection.
pub(crate) trait Source: Send + Sync {
    /// The connection's id, which the queue removes it by.
    fn key(&self) -> u64;
    /// Takes finished work from the device (about as many records as `out` has room for), in
    /// order. Hands records to `out`'s slots when it has some and nothing is queued yet (so
    /// no record overtakes an older one of the same connection), else queues them.
    fn poll(&self, out: &mut Sink<'_>);
    /// Asks the device for an event on the next completion, which the library's thread
    /// then moves into the queue.
    fn arm(&self);
    /// After a poll of a connection with a notice-board slot that is polled every time:
    /// whether it has been idle long enough to leave that list, in which case it has asked its
    /// peer to mark the board when it next has news.
    fn settle(&self) -> bool {
        false
    }
    /// After a poll prompted by a mark on the board: whether the connection is busy (it
    /// moved something, or has work outstanding) and so joins the list polled every time.
    fn busy(&self) -> bool {
        true
    }
    /// Joins the list polled every time: the peer need not mark the board any more.
    fn activate(&self) {}
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

    /// Moves completions into the queue from every connection (`all`) or from those that may
    /// have news. Returns how many.
    fn fill_from_sources(&self, all: bool) -> usize {
        let mut out = Sink::queue(self);
        if all {
            self.each_source(|s| s.poll(&mut out));
        } else {
            self.each_ready(|s| s.poll(&mut out));
        }
        out.produced()
    }

    fn arm_sources(&self) {
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
    /// becomes busy when its slot is marked, and leaves the busy list once idle (see
    /// [`Source::settle`]): a busy connection costs its peer no marking, and with nothing
    /// marked and nothing busy this is one load.
    ///
    /// A poller never waits for another here: while one holds the lists (looking at the
    /// connections, or adding or removing one), the others return at once - the one inside
    /// takes what the connections have, and the marks it has not taken stay on the board for
    /// the next poll. (The sleeping path, `each_source`, does wait: it must look at them all.)
    #[inline(always)]
    fn each_ready(&self, mut f: impl FnMut(&dyn Source)) {
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
                    if s.busy() {
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
        if let Some(b) = self.board.get() {
            b.remark(r.slot);
        }
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

    /// Waits until at least one completion is queued or the timeout passes (`None` = forever).
    /// Polls first - for [`CqOptions::spin`], or longer while completions keep coming soon
    /// after waits start (see there) - then sleeps. Returns `Ok(true)` when something is
    /// queued, `Ok(false)` on timeout. Takes nothing (completions found in a device are queued
    /// for the next poll).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        if !self.queue.is_empty() {
            return Ok(true);
        }
        let mut start = None;
        if self.spin(&mut start, timeout, || {
            self.fill_from_sources(false) > 0 || !self.queue.is_empty()
        }) {
            self.note_spun(start);
            return Ok(true);
        }
        let start = start.expect("a spin that gave up read the clock");
        self.sleep_until(start, timeout.map(|t| start + t))
    }

    /// Takes up to `max` completions, oldest first, handing them to `take`, and waits for the
    /// first if there is none: polls as [`poll_with`](Self::poll_with) does - handing what it
    /// finds straight over, without the queue in between - for as long as [`wait`](Self::wait)
    /// would poll, then sleeps as it does. Returns how many it took: 0 only when the timeout
    /// passed (`None` = forever) first.
    pub fn poll_wait_with(
        &self,
        max: usize,
        timeout: Option<Duration>,
        take: &mut dyn FnMut(Completion),
    ) -> Result<usize> {
        self.poll_batches(
            max,
            |first| self.poll_wait_slots(first, timeout),
            |b, _| hand_over(b, take),
        )
    }

    /// [`poll_wait_with`](Self::poll_wait_with) into the first of `slots` (as many as it
    /// returns are initialized).
    pub(crate) fn poll_wait_slots(
        &self,
        slots: &mut [MaybeUninit<Completion>],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        self.poll_wait_into(slots, timeout, Self::poll_slots)
    }

    /// [`poll_wait_slots`](Self::poll_wait_slots) into records of the caller's own form (the
    /// C surface's), each converted as it is written.
    pub(crate) fn poll_wait_records<R: From<Completion>>(
        &self,
        records: &mut [MaybeUninit<R>],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        self.poll_wait_into(records, timeout, Self::poll_records)
    }

    /// Polls with `poll` ([`poll_slots`](Self::poll_slots) or
    /// [`poll_records`](Self::poll_records)) into `slots`, waiting as
    /// [`poll_wait_with`](Self::poll_wait_with) does for the first.
    fn poll_wait_into<T>(
        &self,
        slots: &mut [MaybeUninit<T>],
        timeout: Option<Duration>,
        poll: impl Fn(&Self, &mut [MaybeUninit<T>]) -> usize,
    ) -> Result<usize> {
        let n = poll(self, slots);
        if n > 0 || slots.is_empty() {
            return Ok(n);
        }
        let mut start = None;
        let mut n = 0;
        if self.spin(&mut start, timeout, || {
            n = poll(self, slots);
            n > 0
        }) {
            self.note_spun(start);
            return Ok(n);
        }
        let start = start.expect("a spin that gave up read the clock");
        let deadline = timeout.map(|t| start + t);
        // Another thread may take what woke this one: sleep again until the deadline.
        while self.sleep_until(start, deadline)? {
            let n = poll(self, slots);
            if n > 0 {
                return Ok(n);
            }
        }
        Ok(0)
    }

    /// Calls `found` in a loop (and spins between calls) until it returns true, for the spin
    /// budget of a wait (see [`spin_budget`](Self::spin_budget)), at most `timeout`. Returns
    /// whether it returned true. The wait's start goes into `start`, read with the clock's
    /// first look, which comes only after 16 rounds (at once with a zero budget): a wait that
    /// ends sooner never reads the clock. It always has when this returns false.
    /// On a thread pinned to one CPU, it lets the other threads of that CPU run every
    /// [`YIELD_EVERY`] of polling.
    fn spin(
        &self,
        start: &mut Option<Instant>,
        timeout: Option<Duration>,
        mut found: impl FnMut() -> bool,
    ) -> bool {
        let budget = self.spin_budget().min(timeout.unwrap_or(SPIN_MAX));
        let every = if budget.is_zero() { 1 } else { 16 };
        let mut round = 0u32;
        let mut yielded: Option<Instant> = None;
        // Whether it yields (a thread pinned to one CPU), looked up with the clock's first look,
        // and then counted (a wait that ends sooner is neither).
        let mut yields: Option<Option<SpinningWait>> = None;
        loop {
            if found() {
                return true;
            }
            // The clock is read every 16th round only: on some machines it costs more than a
            // round of polling. The same goes for the pause that lets a sibling hardware thread
            // run: each round is a whole poll already, and under emulation (qemu's TCG) a pause
            // leaves the translated code, which costs more than a round.
            round = round.wrapping_add(1);
            if round % every == 0 {
                let now = Instant::now();
                let began = *start.get_or_insert(now);
                let pinned = yields
                    .get_or_insert_with(|| pinned_to_one_cpu(now).then(SpinningWait::new))
                    .is_some();
                if now >= began + budget {
                    return false;
                }
                if pinned && now >= yielded.unwrap_or(began) + YIELD_EVERY {
                    // Whoever waits for this CPU - the library's own thread, which may be the
                    // one to produce what this wait is for - runs now.
                    std::thread::yield_now();
                    yielded = Some(now);
                }
                std::hint::spin_loop();
            }
        }
    }

    /// Notes a wait that found a completion while polling: one that never read the clock
    /// (it ended within 16 rounds) took no time worth the name.
    fn note_spun(&self, start: Option<Instant>) {
        self.note_took(start.map_or(Duration::ZERO, |s| s.elapsed()), true, false);
    }

    /// The sleeping part of a wait that began at `start`: until a completion is queued
    /// (`Ok(true)`) or `deadline` (`Ok(false)`).
    fn sleep_until(&self, start: Instant, deadline: Option<Instant>) -> Result<bool> {
        loop {
            let r = self.ready.watching(|| self.sleep(deadline));
            match r {
                // The descriptor was stale (nobody watched it while the queue drained): it is
                // up to date now, so sleep again.
                Ok(true) if self.queue.is_empty() => continue,
                Ok(found) => {
                    self.note_wait(start, found, true);
                    return Ok(found);
                }
                r => return r,
            }
        }
    }

    /// How long the next wait polls before it sleeps: [`CqOptions::spin`], or with caller
    /// progress up to four times the recent waits while they are short (at most
    /// [`SPIN_ADAPT_MAX`]); never with a spin of 0.
    fn spin_budget(&self) -> Duration {
        /// In a run of long waits, the first and every this many-th poll for SPIN_ADAPT_MAX.
        const PROBE_EVERY: u32 = 16;
        let spin = self.opts.spin;
        if spin.is_zero() || self.opts.progress != Progress::Caller {
            return spin;
        }
        // Relaxed, here and below: hints only; a stale figure costs some polling or an early
        // sleep.
        let long = self.long_waits.load(Ordering::Relaxed);
        if long > 0 {
            // The queue went idle, or waking from a sleep is that slow: polling that long now
            // and then tells which, and leaves the sleeping path once completions come soon.
            return if long % PROBE_EVERY == 1 {
                spin.max(SPIN_ADAPT_MAX)
            } else {
                spin
            };
        }
        let recent = Duration::from_nanos(self.recent_wait.load(Ordering::Relaxed));
        let slept = Duration::from_nanos(self.slept_wait.load(Ordering::Relaxed));
        spin.max((recent * 4).max(slept).min(SPIN_ADAPT_MAX))
    }

    /// Notes how long a wait that began at `start` took (`found`: it ended with a completion,
    /// else by its timeout; `slept`: it went to sleep), for [`spin_budget`](Self::spin_budget).
    fn note_wait(&self, start: Instant, found: bool, slept: bool) {
        self.note_took(start.elapsed(), found, slept);
    }

    fn note_took(&self, took: Duration, found: bool, slept: bool) {
        // Relaxed throughout: hints only (see spin_budget); racing waiters may each lose an
        // update.
        if took > SPIN_ADAPT_MAX {
            self.long_waits.fetch_add(1, Ordering::Relaxed);
            self.recent_wait.store(0, Ordering::Relaxed);
            return;
        }
        if !found {
            // A short timeout says nothing about when completions come.
            return;
        }
        let took = took.as_nanos() as u64;
        let recent = self.recent_wait.load(Ordering::Relaxed);
        self.recent_wait
            .store(took.max(recent - recent / 8), Ordering::Relaxed);
        self.long_waits.store(0, Ordering::Relaxed);
        // A wait that slept and was woken within SPIN_ADAPT_MAX would have done better polling
        // on: the next ones poll that long (twice it), and only slowly less, so that an
        // occasional late completion (the machine was busy elsewhere for a moment) does not
        // put every wait after it through the slow wake-up again.
        let slept_wait = self.slept_wait.load(Ordering::Relaxed);
        let slept_wait = if slept {
            slept_wait.max(took.saturating_mul(2))
        } else {
            slept_wait - slept_wait / 16384
        };
        self.slept_wait.store(slept_wait, Ordering::Relaxed);
    }

    /// Sleeps until the descriptor is readable, as a watcher (see [`Readiness::watching`]).
    fn sleep(&self, deadline: Option<Instant>) -> Result<bool> {
        self.ready.update(false);
        self.arm_sources();
        if self.fill_from_sources(true) > 0 {
            return Ok(true);
        }
        sys::poll_one(
            self.ready.signal().raw(),
            libc::POLLIN,
            sys::remaining(deadline),
        )
        .map_err(Error::CompletionQueue)
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

/// The connections a queue's pollers drive.
#[derive(Default)]
struct Sources {
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

/// Reports one connection's completions into its completion queue.
#[derive(Debug)]
pub(crate) struct Reporter {
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) conn_id: u64,
    pub(crate) context: usize,
    /// The peer, as messages name it.
    pub(crate) peer: String,
}

impl Reporter {
    pub(crate) fn complete(
        &self,
        wr_id: u64,
        opcode: Opcode,
        status: WcStatus,
        byte_len: u32,
        imm: Option<u32>,
    ) {
        if opcode == Opcode::Disconnected {
            // Once per connection: its last record.
            match status {
                WcStatus::Success => crate::log::log!(
                    Info,
                    "connection {} with {} disconnected (orderly close)",
                    self.conn_id,
                    self.peer
                ),
                s => crate::log::log!(
                    Warn,
                    "connection {} with {} disconnected: {s:?}",
                    self.conn_id,
                    self.peer
                ),
            }
        }
        self.cq
            .push(self.record(wr_id, opcode, status, byte_len, imm));
    }

    pub(crate) fn record(
        &self,
        wr_id: u64,
        opcode: Opcode,
        status: WcStatus,
        byte_len: u32,
        imm: Option<u32>,
    ) -> Completion {
        Completion {
            wr_id,
            conn_id: self.conn_id,
            context: self.context,
            opcode,
            status,
            byte_len,
            imm,
        }
    }
}

// Not in `loom` builds, where the queue's readiness is made of loom's atomics, which only work
// inside a model.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A queue, and a connection's reporter on it.
    fn queue_and_reporter() -> (Arc<CompletionQueue>, Reporter) {
        let cq = CompletionQueue::new().unwrap();
        let r = Reporter {
            cq: cq.clone(),
            conn_id: 1,
            context: 0,
            peer: String::new(),
        };
        (cq, r)
    }

    #[test]
    fn poll_wait_with_hands_over_what_is_queued_at_once() {
        let (cq, r) = queue_and_reporter();
        for i in 0..3 {
            cq.push(r.record(i, Opcode::Send, WcStatus::Success, 0, None));
        }
        let mut got = Vec::new();
        let n = cq
            .poll_wait_with(2, Some(Duration::from_secs(5)), &mut |c| got.push(c.wr_id))
            .unwrap();
        assert_eq!((n, got.as_slice()), (2, &[0, 1][..]));
        let n = cq
            .poll_wait_with(2, Some(Duration::from_secs(5)), &mut |c| got.push(c.wr_id))
            .unwrap();
        assert_eq!((n, got.as_slice()), (1, &[0, 1, 2][..]));
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

    #[test]
    fn poll_wait_with_times_out_having_taken_nothing() {
        let cq = CompletionQueue::new().unwrap();
        let t = Instant::now();
        let n = cq
            .poll_wait_with(4, Some(Duration::from_millis(30)), &mut |c| {
                panic!("nothing was queued, yet {c:?} came")
            })
            .unwrap();
        assert_eq!(n, 0);
        assert!(
            t.elapsed() >= Duration::from_millis(30),
            "{:?}",
            t.elapsed()
        );
    }

    fn queue(spin: Duration) -> Arc<CompletionQueue> {
        CompletionQueue::with_options(CqOptions {
            progress: Progress::Caller,
            spin,
        })
        .expect("queue")
    }

    #[test]
    fn wait_polls_longer_while_completions_come_soon_and_falls_back_when_idle() {
        let us = Duration::from_micros;
        let q = queue(us(50));
        assert_eq!(q.spin_budget(), us(50), "a new queue polls for its spin");
        q.note_took(us(100), true, false);
        assert_eq!(
            q.spin_budget(),
            us(400),
            "four times the longest recent wait"
        );
        // A shorter wait shrinks the figure by an eighth: 100 -> 87.5 us.
        q.note_took(us(10), true, false);
        assert_eq!(q.spin_budget(), us(350));
        // Never below the spin, never past SPIN_ADAPT_MAX.
        for _ in 0..64 {
            q.note_took(us(1), true, false);
        }
        assert_eq!(q.spin_budget(), us(50));
        q.note_took(SPIN_ADAPT_MAX, true, false);
        assert_eq!(q.spin_budget(), SPIN_ADAPT_MAX);
        // A short timeout changes nothing.
        q.note_took(us(5), false, false);
        assert_eq!(q.spin_budget(), SPIN_ADAPT_MAX);
    }

    #[test]
    fn a_wait_that_slept_and_was_woken_soon_keeps_later_waits_polling_that_long() {
        let us = Duration::from_micros;
        let q = queue(us(50));
        q.note_took(us(20), true, false);
        assert_eq!(q.spin_budget(), us(80));
        // Woken 300 us after it began: the next waits poll for twice that.
        q.note_took(us(300), true, true);
        assert_eq!(q.spin_budget(), us(1200).min(SPIN_ADAPT_MAX));
        let q = queue(us(50));
        q.note_took(us(200), true, true);
        // Short waits shrink four times the recent wait fast, the slept figure slowly.
        for _ in 0..1000 {
            q.note_took(us(20), true, false);
        }
        let b = q.spin_budget();
        assert!(b > us(370) && b < us(400), "{b:?}");
        // Long sleeps leave it at the spin (the queue is idle) until a wait is short again.
        let long = SPIN_ADAPT_MAX + us(1);
        q.note_took(long, true, true);
        q.note_took(long, true, true);
        assert_eq!(q.spin_budget(), us(50));
        q.note_took(us(20), true, false);
        assert!(q.spin_budget() > us(370));
        // A sleep that ended by its timeout says nothing.
        let q = queue(us(50));
        q.note_took(us(200), false, true);
        assert_eq!(q.spin_budget(), us(50));
    }

    #[test]
    fn after_long_waits_only_every_16th_polls_long_until_one_is_short() {
        let us = Duration::from_micros;
        let q = queue(us(50));
        q.note_took(us(100), true, false);
        let long = SPIN_ADAPT_MAX + us(1);
        let mut budgets = Vec::new();
        for _ in 0..33 {
            q.note_took(long, true, false);
            budgets.push(q.spin_budget());
        }
        for (i, b) in budgets.iter().enumerate() {
            let probe = i % 16 == 0;
            assert_eq!(*b, if probe { SPIN_ADAPT_MAX } else { us(50) }, "wait {i}");
        }
        // A probe that finds a completion soon ends the run.
        q.note_took(us(30), true, false);
        assert_eq!(q.spin_budget(), us(120));
    }

    #[test]
    fn zero_spin_progress_threads_and_a_long_spin_keep_the_spin_as_set() {
        let q = queue(Duration::ZERO);
        q.note_took(Duration::from_micros(100), true, false);
        assert_eq!(q.spin_budget(), Duration::ZERO);
        let q = CompletionQueue::with_options(CqOptions {
            progress: Progress::Thread,
            spin: DEFAULT_SPIN,
        })
        .unwrap();
        q.note_took(Duration::from_micros(100), true, false);
        assert_eq!(
            q.spin_budget(),
            DEFAULT_SPIN,
            "progress threads: spin exactly"
        );
        let q = queue(SPIN_MAX);
        q.note_took(Duration::from_micros(100), true, false);
        assert_eq!(q.spin_budget(), SPIN_MAX);
    }
}
