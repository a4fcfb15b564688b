//! The router: takes a completion queue's records and hands each to the operation that waits
//! for it, by the token the library put in its `wr_id`; the rest (connection events, the
//! records of work posted through the plain API) queue for whoever reads them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

use crate::cq::{BATCH, Completion, CompletionQueue};
use crate::ops::Buf;

/// The bit set in every token: `wr_id`s with it belong to the router's operations, so that
/// the records of work posted with the plain API on the same queue (whose `wr_id`s keep it
/// clear) are never taken for them.
pub(crate) const TOKEN_BIT: u64 = 1 << 63;

/// Routes the records of one [`CompletionQueue`] to the operations waiting for them
/// ([`Op`](crate::ops::Op)), and queues the rest for [`poll_next`](Self::poll_next).
///
/// Runtime-neutral: something must call [`route`](Self::route) whenever the queue's
/// descriptor ([`CompletionQueue::fd`]) turns readable - a task of the program's runtime
/// waiting on it (the `tokio` feature's `rdmabridge::tokio::Queue` is one), or a thread in
/// [`CompletionQueue::wait`]. `route` takes records until the queue is empty, which is what
/// the descriptor's edge-triggered contract asks before the next wait.
///
/// Operations name their records by a token in `wr_id` with the top bit set. Work posted on
/// the same queue with the plain API must keep that bit clear in its `wr_id`s; its records,
/// and connection events ([`crate::Opcode::Disconnected`]), come out of
/// [`poll_next`](Self::poll_next) in the order the queue gave them.
pub struct Router {
    cq: Arc<CompletionQueue>,
    state: Mutex<State>,
    /// Held while taking records from the queue, so that records not claimed by an operation
    /// keep their order.
    routing: Mutex<()>,
    /// What drives it (a runtime's task, stopped when this is dropped), if one was attached.
    driver: std::sync::OnceLock<Box<dyn Send + Sync>>,
}

#[derive(Default)]
struct State {
    ops: HashMap<u64, Slot>,
    next: u64,
    /// Records no operation claims, oldest first.
    unclaimed: VecDeque<Completion>,
    reader: Option<Waker>,
}

/// An operation in flight.
enum Slot {
    /// Its future waits (and wants this waker woken).
    Waiting(Option<Waker>),
    /// Its record came and its future has not taken it yet.
    Done(Completion),
    /// Its future was dropped: what the operation holds stays here until its record comes.
    Abandoned(Option<Buf>),
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("Router")
            .field("in_flight", &s.ops.len())
            .field("unclaimed", &s.unclaimed.len())
            .finish()
    }
}

impl Router {
    /// A router for the records of `cq`.
    pub fn new(cq: Arc<CompletionQueue>) -> Arc<Self> {
        Arc::new(Router {
            cq,
            state: Mutex::new(State::default()),
            routing: Mutex::new(()),
            driver: std::sync::OnceLock::new(),
        })
    }

    /// Keeps `driver` (what calls [`route`](Self::route): a runtime's task, say) for as long
    /// as the router lives, and drops it with the router. The first one stays; a later one is
    /// given back.
    pub fn set_driver(&self, driver: Box<dyn Send + Sync>) -> Result<(), Box<dyn Send + Sync>> {
        self.driver.set(driver)
    }

    /// The queue it routes.
    pub fn queue(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }

    /// Takes every record queued (until a poll finds the queue empty) and hands each to its
    /// operation, or queues it for [`poll_next`](Self::poll_next); wakes whoever waits for
    /// them. Returns how many records it took. Never blocks for long: it waits only for
    /// another caller's `route` to finish.
    pub fn route(&self) -> usize {
        let _order = self.routing.lock();
        let mut batch = Vec::with_capacity(BATCH);
        let mut wake = Vec::new();
        let mut finished = Vec::new();
        let mut n = 0;
        loop {
            batch.clear();
            let got = self.cq.poll_into(&mut batch, BATCH);
            n += got;
            if got > 0 {
                let mut s = self.state.lock();
                for c in batch.drain(..) {
                    s.deliver(c, &mut wake, &mut finished);
                }
            }
            // Outside the lock: a waker may run its task at once, and the last buffer of a
            // region unmaps it.
            wake.drain(..).for_each(Waker::wake);
            finished.clear();
            if got < BATCH {
                return n;
            }
        }
    }

    /// The next record no operation claims, oldest first; when there is none, `Pending`, and
    /// `cx`'s waker is woken when one comes. One reader at a time: a second reader's waker
    /// replaces the first's.
    pub fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Completion> {
        let mut s = self.state.lock();
        match s.unclaimed.pop_front() {
            Some(c) => Poll::Ready(c),
            None => {
                store_waker(&mut s.reader, cx.waker());
                Poll::Pending
            }
        }
    }

    /// How many operations are in flight (posted, their records not yet taken by their
    /// futures), dropped futures' included.
    pub fn in_flight(&self) -> usize {
        self.state.lock().ops.len()
    }

    /// A new token, its operation waiting.
    pub(crate) fn register(&self) -> u64 {
        let mut s = self.state.lock();
        s.next = s.next.wrapping_add(1);
        let token = TOKEN_BIT | (s.next & !TOKEN_BIT);
        s.ops.insert(token, Slot::Waiting(None));
        token
    }

    /// Forgets `token`, whose operation was never posted.
    pub(crate) fn unregister(&self, token: u64) {
        self.state.lock().ops.remove(&token);
    }

    /// The record of `token` if it came (the token is then forgotten), or `Pending` with
    /// `cx`'s waker kept for it.
    pub(crate) fn poll_op(&self, token: u64, cx: &mut Context<'_>) -> Poll<Completion> {
        let mut s = self.state.lock();
        match s.ops.get_mut(&token) {
            Some(Slot::Waiting(w)) => {
                store_waker(w, cx.waker());
                Poll::Pending
            }
            Some(Slot::Done(c)) => {
                let c = *c;
                s.ops.remove(&token);
                Poll::Ready(c)
            }
            // Never: a token is forgotten only once its future took the record or was dropped.
            Some(Slot::Abandoned(_)) | None => Poll::Pending,
        }
    }

    /// The future of `token` was dropped before it took its record: `hold` stays until the
    /// record comes (at once, when it came already).
    pub(crate) fn abandon(&self, token: u64, hold: Option<Buf>) {
        let mut s = self.state.lock();
        if let Some(slot) = s.ops.get_mut(&token) {
            match slot {
                Slot::Done(_) => {
                    s.ops.remove(&token);
                }
                _ => *slot = Slot::Abandoned(hold),
            }
        }
    }
}

impl State {
    /// Hands `c` to its operation or to the reader; whoever to wake goes to `wake`, what a
    /// dropped future held to `finished`.
    fn deliver(&mut self, c: Completion, wake: &mut Vec<Waker>, finished: &mut Vec<Buf>) {
        if c.wr_id & TOKEN_BIT != 0
            && let Some(slot) = self.ops.get_mut(&c.wr_id)
        {
            match slot {
                Slot::Waiting(w) => {
                    wake.extend(w.take());
                    *slot = Slot::Done(c);
                }
                // What the dropped future held goes now: the operation is over.
                Slot::Abandoned(hold) => {
                    finished.extend(hold.take());
                    self.ops.remove(&c.wr_id);
                }
                // Never: one record per operation.
                Slot::Done(_) => {}
            }
            return;
        }
        self.unclaimed.push_back(c);
        wake.extend(self.reader.take());
    }
}

/// Keeps `waker` in `slot`, unless the one there wakes the same task.
fn store_waker(slot: &mut Option<Waker>, waker: &Waker) {
    match slot {
        Some(w) if w.will_wake(waker) => {}
        _ => *slot = Some(waker.clone()),
    }
}
