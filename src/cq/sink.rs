//! Where a poll puts the completions it takes: straight into the caller's records while they
//! last, into the queue after that. The transports write each completion once, where it is
//! going, with no call through a closure per completion.

use std::mem::MaybeUninit;

use super::{Completion, CompletionQueue};

/// The records a poll fills (perhaps none: everything then goes into the queue) and the
/// queue that takes whatever does not fit - a poll may produce more than it was asked for (a
/// message's completion brings the completions of the sends it follows).
pub(crate) struct Sink<'a> {
    slots: &'a mut [MaybeUninit<Completion>],
    /// Records written into `slots`, from the start.
    filled: usize,
    /// Records pushed into `queue`.
    queued: usize,
    queue: &'a CompletionQueue,
}

impl<'a> Sink<'a> {
    /// Fills `slots` first, then `queue`.
    pub(crate) fn new(
        slots: &'a mut [MaybeUninit<Completion>],
        queue: &'a CompletionQueue,
    ) -> Self {
        Sink {
            slots,
            filled: 0,
            queued: 0,
            queue,
        }
    }

    /// Everything into `queue`.
    pub(crate) fn queue(queue: &'a CompletionQueue) -> Self {
        Sink::new(&mut [], queue)
    }

    /// Hands over one completion.
    #[inline]
    pub(crate) fn put(&mut self, c: Completion) {
        match self.slots.get_mut(self.filled) {
            Some(slot) => {
                slot.write(c);
                self.filled += 1;
            }
            None => {
                self.queue.push(c);
                self.queued += 1;
            }
        }
    }

    /// Whether a slot is free: a source may then hand records over directly, up to
    /// [`room`](Self::room) of them. When none is, a source takes everything it has into
    /// the queue instead (a connection looked at because of a mark on the board must take
    /// what it was marked for: nothing marks it again).
    #[inline]
    pub(crate) fn direct(&self) -> bool {
        self.filled < self.slots.len()
    }

    /// Slots still free.
    #[inline]
    pub(crate) fn room(&self) -> usize {
        self.slots.len() - self.filled
    }

    /// Records written into the slots so far (the first `filled()` slots are initialized).
    #[inline]
    pub(crate) fn filled(&self) -> usize {
        self.filled
    }

    /// Records handed over so far, slots and queue together.
    #[inline]
    pub(crate) fn produced(&self) -> usize {
        self.filled + self.queued
    }

    /// Runs `f` with everything it produces going into the queue (a source whose older
    /// records may still be queued must not let new ones overtake them), counted here.
    pub(crate) fn queued_only<R>(&mut self, f: impl FnOnce(&mut Sink<'_>) -> R) -> R {
        let mut q = Sink::queue(self.queue);
        let r = f(&mut q);
        self.queued += q.queued;
        r
    }
}
