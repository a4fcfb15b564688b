//! The lock-free half of a completion queue's descriptor: the count of queued completions,
//! the watchers, and the readiness of the descriptor that follows them. Kept apart from the
//! queue so that the `loom` checks below run these very functions over the model's atomics
//! and lock (`crate::sync`), with a flag for the eventfd.

use std::sync::atomic::Ordering;

use crate::sync::{AtomicBool, AtomicUsize, Mutex};
use crate::sys::EventFd;

/// What makes a descriptor readable or not: the queue's eventfd (a model's flag in the
/// `loom` checks).
pub(crate) trait Signal {
    /// Makes it readable.
    fn signal(&self);
    /// Makes it unreadable.
    fn clear(&self);
}

impl Signal for EventFd {
    fn signal(&self) {
        EventFd::signal(self)
    }

    fn clear(&self) {
        EventFd::clear(self)
    }
}

/// Set in [`Readiness::pending`] by a consumer that found the queue empty while somebody
/// watches: the next push must make a new edge on the descriptor (see [`Readiness::starve`]).
const STARVED: usize = 1 << (usize::BITS - 1);

/// The lock-free half of a completion queue's descriptor. Two contracts, for the two kinds
/// of waiter:
/// - level-triggered: `signal` is readable exactly while completions are queued - once every
///   push and pop has returned, and whenever a watcher looks - touching it only on the
///   0 <-> 1 transitions of the count while somebody watches;
/// - edge-triggered (tokio, mio and any `EPOLLET` waiter): once a consumer has polled the
///   queue empty ([`starve`]), the next completion queued writes `signal` again, even if it
///   is readable already, so a waiter that drained the queue always gets a new edge.
///
/// The `loom` checks (`mod loom_model`) run these functions as they are, over the model's
/// atomics and lock (`crate::sync`).
///
/// [`starve`]: Readiness::starve
pub(crate) struct Readiness<S: Signal = EventFd> {
    /// Count of completions pushed or about to be pushed, never below the queue's length:
    /// producers add before they push, consumers subtract after they pop. The top bit is
    /// [`STARVED`]; one word, so that a consumer's mark and a producer's count are ordered by
    /// the word's own modification order.
    pending: AtomicUsize,
    /// Whether `signal` is readable. Only changed under the lock, so the descriptor's state
    /// and `pending` can't disagree once both sides are done (no lost or stale wake-up).
    armed: Mutex<bool>,
    signal: S,
    /// Threads asleep on `signal`, plus one once it has been handed out. While zero, nobody
    /// looks at it, so queueing and taking skip its system calls; whoever starts looking
    /// brings it up to date first.
    watchers: AtomicUsize,
    exported: AtomicBool,
}

impl<S: Signal> Readiness<S> {
    /// Nothing queued, nobody watching; `signal` starts unreadable.
    pub(crate) fn new(signal: S) -> Self {
        Readiness {
            pending: AtomicUsize::new(0),
            armed: Mutex::new(false),
            signal,
            watchers: AtomicUsize::new(0),
            exported: AtomicBool::new(false),
        }
    }

    /// Queues a completion with `push`.
    #[inline]
    pub(crate) fn push(&self, push: impl FnOnce()) {
        // SeqCst: the increment and the `watchers` load below pair with a new watcher's
        // increment and its look at `pending` (one of the two sees the other).
        let before = self.pending.fetch_add(1, Ordering::SeqCst);
        push();
        if self.watchers.load(Ordering::SeqCst) == 0 {
            return;
        }
        // A read-modify-write even when nobody starved: a plain load could be satisfied
        // before this thread's push is visible to a consumer marking the word meanwhile,
        // which would then miss both the completion and the edge (store-load reordering).
        let starved = self.pending.fetch_and(!STARVED, Ordering::SeqCst) & STARVED != 0;
        if before & !STARVED == 0 || starved {
            // 0 -> 1: readable for level-triggered waiters. Starved: a consumer found the
            // queue empty since the last edge (perhaps while this completion was counted but
            // not yet pushed), and its descriptor may be readable already, so only a new
            // write makes the edge it waits for.
            self.update(starved);
        }
    }

    /// Takes a completion with `pop`.
    #[inline]
    pub(crate) fn pop<T>(&self, pop: impl FnOnce() -> Option<T>) -> Option<T> {
        let c = pop()?;
        if self.pending.fetch_sub(1, Ordering::SeqCst) & !STARVED == 1
            && self.watchers.load(Ordering::SeqCst) > 0
        {
            self.update(false);
        }
        Some(c)
    }

    /// Whether nothing is queued (`pending` is never below the queue's length).
    #[inline]
    pub(crate) fn none_pending(&self) -> bool {
        // Acquire: a completion counted here was pushed by a thread whose writes before it
        // we may then read.
        self.pending.load(Ordering::Acquire) & !STARVED == 0
    }

    /// Notes that a consumer polled the queue empty, so that the next completion queued makes
    /// a new edge on the descriptor for an edge-triggered waiter. Call it after a poll that
    /// found nothing more; it does nothing while nobody watches. Returns true when a push was
    /// under way as it looked: the caller polls once more (what that push queued is then
    /// either found by that poll or announced by a new edge, never neither).
    #[inline]
    pub(crate) fn starve(&self) -> bool {
        if self.watchers.load(Ordering::SeqCst) == 0 {
            return false;
        }
        // SeqCst read-modify-write on the producers' word: a push whose `fetch_and` comes
        // later sees the mark and writes the descriptor; one whose `fetch_and` came earlier
        // has pushed before it, which the poll that follows this sees (the read-modify-writes
        // synchronize).
        self.pending.fetch_or(STARVED, Ordering::SeqCst) & !STARVED > 0
    }

    /// What the descriptor's readiness is kept in.
    pub(crate) fn signal(&self) -> &S {
        &self.signal
    }

    /// Whether a thread sleeps on `signal` (or is about to), as opposed to its having been
    /// handed out; `None` while nobody watches it at all (one load).
    #[inline]
    pub(crate) fn slept_on(&self) -> Option<bool> {
        let w = self.watchers.load(Ordering::SeqCst);
        if w == 0 {
            return None;
        }
        // SeqCst: as the watchers' count.
        Some(w > usize::from(self.exported.load(Ordering::SeqCst)))
    }

    /// Runs `sleep` as a watcher: it brings `signal` up to date with [`update`] and sleeps
    /// on it, and any push or pop meanwhile keeps it up to date.
    ///
    /// [`update`]: Readiness::update
    pub(crate) fn watching<R>(&self, sleep: impl FnOnce() -> R) -> R {
        self.watchers.fetch_add(1, Ordering::SeqCst);
        let r = sleep();
        self.watchers.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// Hands `signal` out for good (a watcher from now on): true the first time, after
    /// bringing it up to date.
    pub(crate) fn export(&self) -> bool {
        if self.exported.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.watchers.fetch_add(1, Ordering::SeqCst);
        self.update(false);
        true
    }

    /// Brings `signal`'s readability in line with `pending`, and with `edge` writes it again
    /// even if it is readable already (a new edge for a waiter that drained the queue). Runs
    /// only on the 0 <-> 1 transitions and after a starved poll while someone watches, so the
    /// lock is off the steady-state path.
    pub(crate) fn update(&self, edge: bool) {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        // SeqCst: see every increment and decrement published before the lock was taken.
        let want = self.pending.load(Ordering::SeqCst) & !STARVED > 0;
        if want && (edge || !*armed) {
            self.signal.signal();
        } else if !want && *armed {
            self.signal.clear();
        }
        *armed = want;
    }
}

/// Model checks of the descriptor's readiness: the real [`Readiness`] over loom's atomics and
/// lock, a flag with a condition variable for the eventfd, and a count for the queue (run
/// with `RUSTFLAGS="--cfg loom" cargo test --lib loom`). What `CompletionQueue` adds around
/// these calls - the device polling in `sleep`, the `poll(2)` itself - is not modelled.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::atomic::AtomicUsize as Count;
    use loom::sync::{Arc, Condvar};
    use loom::thread;

    /// The eventfd: readable or not, the writes made to it (each one an edge for an
    /// `EPOLLET` waiter), and a sleeper on it.
    #[derive(Default)]
    struct Fd {
        state: Mutex<FdState>,
        changed: Condvar,
    }

    #[derive(Default)]
    struct FdState {
        readable: bool,
        edges: usize,
        /// Rings waiting on the queue's bell (`bell.rs`), which shares the handed-out
        /// descriptor (an epoll set) with the eventfd: each ring is an edge of that set too.
        rings: usize,
    }

    impl Signal for Fd {
        fn signal(&self) {
            let mut st = self.state.lock().unwrap();
            st.readable = true;
            st.edges += 1;
            self.changed.notify_all();
        }

        fn clear(&self) {
            self.state.lock().unwrap().readable = false;
        }
    }

    impl Fd {
        fn is_readable(&self) -> bool {
            self.state.lock().unwrap().readable
        }

        /// A peer rings the queue's bell.
        fn ring(&self) {
            let mut st = self.state.lock().unwrap();
            st.rings += 1;
            st.edges += 1;
            self.changed.notify_all();
        }

        /// The arming poll takes the rings waiting on the bell.
        fn drain(&self) {
            self.state.lock().unwrap().rings = 0;
        }

        /// `epoll_wait` on an `EPOLLET` registration without a timeout: returns once a write
        /// newer than the `seen`-th came (loom fails the run as a deadlock if none ever does),
        /// with the count of writes so far (the events taken).
        fn sleep_until_edge_after(&self, seen: usize) -> usize {
            let mut st = self.state.lock().unwrap();
            while st.edges == seen {
                st = self.changed.wait(st).unwrap();
            }
            st.edges
        }

        /// `poll(2)` without a timeout: loom fails the run as a deadlock if this never returns.
        fn sleep_until_readable(&self) {
            let mut st = self.state.lock().unwrap();
            while !st.readable {
                st = self.changed.wait(st).unwrap();
            }
        }
    }

    /// A queue with its readiness; the queue is a count (the real one, a `SegQueue`, also
    /// orders a push before the pop that takes it).
    struct Q {
        ready: Readiness<Fd>,
        queued: Count,
    }

    impl Q {
        fn new() -> Arc<Q> {
            let ready = Readiness::new(Fd::default());
            // Loom does not count an atomic's initial value as a SeqCst store, so it lets a
            // SeqCst load return it even after a later SeqCst store (a false alarm: in C11
            // the initialisation happens before that store, so the load cannot). Storing the
            // same values SeqCst before any thread starts gives the model C11's answer.
            ready.pending.store(0, Ordering::SeqCst);
            ready.watchers.store(0, Ordering::SeqCst);
            Arc::new(Q {
                ready,
                queued: Count::new(0),
            })
        }

        fn push(&self) {
            self.ready.push(|| {
                self.queued.fetch_add(1, Ordering::Release);
            });
        }

        fn pop(&self) -> bool {
            self.ready
                .pop(|| {
                    self.queued
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                        .ok()
                })
                .is_some()
        }

        fn is_empty(&self) -> bool {
            self.queued.load(Ordering::Acquire) == 0
        }
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
            b.preemption_bound = Some(3);
        }
        b.check(f);
    }

    /// The descriptor is handed out while one thread queues two completions and another
    /// takes what it finds, twice: once all are done, it is readable exactly when
    /// completions are left.
    #[test]
    fn loom_cq_fd_readable_exactly_while_completions_queued() {
        model(|| {
            let q = Q::new();
            let q1 = q.clone();
            let exporter = thread::spawn(move || assert!(q1.ready.export()));
            let q2 = q.clone();
            let pusher = thread::spawn(move || {
                q2.push();
                q2.push();
            });
            let taken = usize::from(q.pop()) + usize::from(q.pop());
            exporter.join().unwrap();
            pusher.join().unwrap();
            assert!(!q.ready.export(), "handed out once");
            assert_eq!(q.is_empty(), taken == 2);
            assert_eq!(
                q.ready.signal().is_readable(),
                !q.is_empty(),
                "readable exactly while completions are queued ({taken} of 2 taken)"
            );
        });
    }

    /// `CompletionQueue::wait`'s sleeping loop (watch, bring the descriptor up to date, sleep
    /// on it, and sleep again if the queue is empty by then) while one thread queues two
    /// completions and another takes one: the sleeper always wakes (a lost wake-up would
    /// leave it asleep with a completion queued, which loom reports as a deadlock), and no
    /// watcher is left behind.
    #[test]
    fn loom_cq_sleeping_waiter_always_wakes() {
        model(|| {
            let q = Q::new();
            let q1 = q.clone();
            let waiter = thread::spawn(move || {
                loop {
                    q1.ready.watching(|| {
                        q1.ready.update(false);
                        q1.ready.signal().sleep_until_readable();
                    });
                    if !q1.is_empty() {
                        break;
                    }
                    // Readable but empty: a pusher between its count and its push, or a
                    // stale descriptor; the real loop goes round again at once (a spin
                    // that needs another thread's progress, which loom must be told of).
                    thread::yield_now();
                }
            });
            let q2 = q.clone();
            let pusher = thread::spawn(move || {
                q2.push();
                q2.push();
            });
            q.pop();
            pusher.join().unwrap();
            waiter.join().unwrap();
            assert!(q.ready.slept_on().is_none());
        });
    }

    /// `CompletionQueue::poll` as an edge-triggered consumer calls it until it finds nothing:
    /// takes one if there is one, else marks the queue starved and takes one if a push was
    /// under way (the poll's end, `poll_sink`).
    fn poll(q: &Q) -> bool {
        q.pop() || (q.ready.starve() && q.pop())
    }

    /// tokio's textbook `AsyncFd` loop (or any `EPOLLET` waiter) on a handed-out descriptor:
    /// poll until nothing comes, then sleep until the next edge, until `want` completions were
    /// taken, while `pushes` completions are queued by another thread (after `before` queued
    /// before the loop starts). A lost edge - the waiter asleep with a completion queued and no
    /// write to come - is a deadlock loom reports.
    fn edge_triggered_consumer_takes_all(before: usize, pushes: usize) {
        model(move || {
            let q = Q::new();
            assert!(q.ready.export());
            for _ in 0..before {
                q.push();
            }
            let q2 = q.clone();
            let pusher = thread::spawn(move || {
                for _ in 0..pushes {
                    q2.push();
                }
            });
            let (mut taken, mut seen) = (0, 0);
            loop {
                while poll(&q) {
                    taken += 1;
                }
                if taken == before + pushes {
                    break;
                }
                seen = q.ready.signal().sleep_until_edge_after(seen);
            }
            pusher.join().unwrap();
            assert!(q.is_empty());
            assert!(!q.ready.signal().is_readable(), "unreadable once drained");
        });
    }

    /// Pops that take the count to 0 crossing pushes that take it to 1 (and pushes counted
    /// but not yet queued when the consumer looks): every completion is taken, no edge lost.
    #[test]
    fn loom_cq_edge_triggered_waiter_never_misses_an_edge() {
        edge_triggered_consumer_takes_all(0, 2);
    }

    /// The same with one completion queued before the waiter starts, so pushes also come
    /// while the count is above zero (no 0 -> 1 transition to make the edge).
    #[test]
    fn loom_cq_edge_triggered_waiter_sees_pushes_above_zero() {
        edge_triggered_consumer_takes_all(1, 2);
    }

    /// The new arming: a connection that the pollers move (its peer writes `ring`, marks the
    /// board's summary `marks`, and rings the bell if a poller announced its sleep in
    /// `sleeper`), beside the queue the library pushes to, both behind one descriptor.
    /// `announce_sleep` and `take_sleeper` are the real ones (`bell.rs`), over loom's atomics.
    struct Armed {
        q: Arc<Q>,
        ring: Count,
        marks: loom::sync::atomic::AtomicU64,
        sleeper: loom::sync::atomic::AtomicU64,
    }

    impl crate::cq::bell::Word for loom::sync::atomic::AtomicU64 {
        fn load(&self, order: Ordering) -> u64 {
            loom::sync::atomic::AtomicU64::load(self, order)
        }

        fn store(&self, v: u64, order: Ordering) {
            loom::sync::atomic::AtomicU64::store(self, v, order)
        }

        fn cas(&self, current: u64, new: u64) -> bool {
            self.compare_exchange(current, new, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        }

        fn fence(order: Ordering) {
            loom::sync::atomic::fence(order)
        }
    }

    impl Armed {
        fn new() -> Arc<Armed> {
            let a = Armed {
                q: Q::new(),
                ring: Count::new(0),
                marks: loom::sync::atomic::AtomicU64::new(0),
                sleeper: loom::sync::atomic::AtomicU64::new(0),
            };
            // See `Q::new`.
            a.marks.store(0, Ordering::SeqCst);
            a.sleeper.store(0, Ordering::SeqCst);
            assert!(a.q.ready.export());
            Arc::new(a)
        }

        /// The peer's `Flow::notify_peer` after writing a message: the record, the fence, the
        /// mark, then the look at the announcement.
        fn peer_writes(&self) {
            self.ring.fetch_add(1, Ordering::Release);
            loom::sync::atomic::fence(Ordering::SeqCst);
            self.marks.fetch_or(1, Ordering::SeqCst);
            if crate::cq::bell::take_sleeper(&self.sleeper) {
                self.q.ready.signal().ring();
            }
        }

        /// `poll_sink`: the queue, then the marked connection (the board's `take`: clear,
        /// fence, read the ring; a poll takes all its messages), then, finding nothing,
        /// starve. Returns how many it took.
        fn poll(&self) -> usize {
            if self.q.pop() {
                return 1;
            }
            if self.marks.swap(0, Ordering::SeqCst) != 0 {
                loom::sync::atomic::fence(Ordering::SeqCst);
                let n = self.ring.swap(0, Ordering::AcqRel);
                if n > 0 {
                    return n;
                }
            }
            usize::from(self.q.ready.starve() && self.q.pop())
        }

        /// `arm_bell`: drain, then announce; false when marks are waiting (poll again).
        fn arm(&self) -> bool {
            self.q.ready.signal().drain();
            !crate::cq::bell::announce_sleep(&self.sleeper, &self.marks)
        }
    }

    /// An edge-triggered event loop on the handed-out descriptor (poll until nothing, arm,
    /// sleep until the next edge of the set) while a peer writes `writes` messages and the
    /// library pushes `pushes` completions: it takes every one, and never sleeps with one
    /// waiting and no edge to come (which loom reports as a deadlock).
    fn event_loop_takes_all(writes: usize, pushes: usize) {
        model(move || {
            let a = Armed::new();
            let a1 = a.clone();
            let peer = thread::spawn(move || {
                for _ in 0..writes {
                    a1.peer_writes();
                }
            });
            let a2 = a.clone();
            let library = thread::spawn(move || {
                for _ in 0..pushes {
                    a2.q.push();
                }
            });
            let (mut taken, mut seen) = (0, 0);
            loop {
                loop {
                    match a.poll() {
                        0 => break,
                        n => taken += n,
                    }
                }
                if taken == writes + pushes {
                    break;
                }
                if !a.arm() {
                    continue;
                }
                seen = a.q.ready.signal().sleep_until_edge_after(seen);
            }
            peer.join().unwrap();
            library.join().unwrap();
            assert!(a.q.is_empty());
        });
    }

    /// A peer's message and a completion the library queues cross the loop's arming: both
    /// are taken.
    #[test]
    fn loom_cq_armed_event_loop_takes_a_message_and_a_push_that_cross() {
        event_loop_takes_all(1, 1);
    }

    /// Two messages of the peer, the second written while the loop polls or arms for the
    /// first: one ring per announced sleep, and still nothing missed.
    #[test]
    fn loom_cq_armed_event_loop_takes_messages_written_as_it_arms() {
        event_loop_takes_all(2, 0);
    }
}
