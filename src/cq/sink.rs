//! Where a poll puts the completions it takes: straight into the caller's records while they
//! last (the queue's own records, or records of the caller's own form, converted as they are
//! written), into the queue after that. The transports write each completion once, where it is
//! going, with no call through a closure per completion.

use std::mem::MaybeUninit;

use super::{Completion, CompletionQueue};

/// The caller's records a poll fills.
enum Slots<'a> {
    Own(&'a mut [MaybeUninit<Completion>]),
    /// Records of the caller's own form (the C surface's): each is converted as it is written,
    /// so a poll into them needs no records of the queue's in between.
    Converted(&'a mut dyn Records),
}

/// A caller's array of records of its own form, which a poll fills by converting each
/// completion as it writes it.
pub(crate) trait Records {
    /// How many records the array has.
    fn len(&self) -> usize;
    /// Writes `c`, converted, into record `i`.
    ///
    /// # Safety
    /// `i < len()`.
    unsafe fn write(&mut self, i: usize, c: Completion);
}

impl<R: From<Completion>> Records for &mut [MaybeUninit<R>] {
    #[inline]
    fn len(&self) -> usize {
        <[_]>::len(self)
    }

    #[inline]
    unsafe fn write(&mut self, i: usize, c: Completion) {
        // SAFETY: `i < len()` (the caller's contract).
        unsafe { self.get_unchecked_mut(i) }.write(c.into());
    }
}

/// The records a poll fills (perhaps none: everything then goes into the queue) and the
/// queue that takes whatever does not fit - a poll may produce more than it was asked for (a
/// message's completion brings the completions of the sends it follows).
pub(crate) struct Sink<'a> {
    slots: Slots<'a>,
    /// How many records `slots` has.
    len: usize,
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
        Sink::of(slots.len(), Slots::Own(slots), queue)
    }

    /// Fills the caller's `records` first (converting each completion), then `queue`.
    pub(crate) fn converting(records: &'a mut dyn Records, queue: &'a CompletionQueue) -> Self {
        Sink::of(records.len(), Slots::Converted(records), queue)
    }

    fn of(len: usize, slots: Slots<'a>, queue: &'a CompletionQueue) -> Self {
        Sink {
            slots,
            len,
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
        let i = self.filled;
        if i < self.len {
            // SAFETY: `i < len`, the number of records `slots` holds.
            unsafe {
                match &mut self.slots {
                    Slots::Own(s) => {
                        s.get_unchecked_mut(i).write(c);
                    }
                    Slots::Converted(r) => r.write(i, c),
                }
            }
            self.filled = i + 1;
        } else {
            self.queue.push(c);
            self.queued += 1;
        }
    }

    /// Whether a slot is free: a source may then hand records over directly, up to
    /// [`room`](Self::room) of them.
    #[inline]
    pub(crate) fn direct(&self) -> bool {
        self.filled < self.len
    }

    /// Slots still free.
    #[inline]
    pub(crate) fn room(&self) -> usize {
        self.len - self.filled
    }

    /// How many records the poll asked for (all there are when it has no slots).
    #[cfg(feature = "verbs")]
    #[inline]
    pub(crate) fn asked(&self) -> usize {
        if self.len == 0 { usize::MAX } else { self.len }
    }

    /// Runs a source's `take(limit, sink)` so that its records arrive in order: straight into
    /// the free slots (`limit`: their number) when there are some and `nothing_queued()` says
    /// that no older record of the source can be waiting in the queue; otherwise into the
    /// queue only (`limit`: `queued_limit`), where no new record overtakes an older one. A
    /// source without a free slot still takes what it has, into the queue: a connection
    /// looked at because of a mark on the board must take what it was marked for, as nothing
    /// marks it again.
    #[inline]
    pub(crate) fn in_order<R>(
        &mut self,
        nothing_queued: impl FnOnce() -> bool,
        queued_limit: usize,
        take: impl FnOnce(usize, &mut Sink<'_>) -> R,
    ) -> R {
        if self.direct() && nothing_queued() {
            let room = self.room();
            take(room, self)
        } else {
            let mut q = Sink::queue(self.queue);
            let r = take(queued_limit, &mut q);
            self.queued += q.queued;
            r
        }
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
}
