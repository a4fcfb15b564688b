//! A first-in first-out queue for a connection's work requests: a power-of-two ring of slots,
//! allocated once for the depth the connection was granted, so that a push or a pop is an
//! index masked and a slot written or read (a `VecDeque` wraps its indexes by comparing and
//! subtracting, and hands elements out through an `Option`). It grows, as a `VecDeque` does,
//! if it is ever pushed past its capacity.

use std::mem::MaybeUninit;

pub(crate) struct Fifo<T> {
    slots: Box<[MaybeUninit<T>]>,
    /// `slots.len() - 1`; the length is a power of two.
    mask: usize,
    /// Pushes and pops so far (wrapping): the elements are at `head..tail`, masked.
    head: usize,
    tail: usize,
}

impl<T> Fifo<T> {
    /// An empty queue with room for at least `n` elements.
    pub(crate) fn with_capacity(n: usize) -> Self {
        let cap = n.max(1).next_power_of_two();
        Fifo {
            slots: (0..cap).map(|_| MaybeUninit::uninit()).collect(),
            mask: cap - 1,
            head: 0,
            tail: 0,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.tail.wrapping_sub(self.head)
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.head == self.tail
    }

    #[inline]
    pub(crate) fn push_back(&mut self, v: T) {
        if self.len() > self.mask {
            self.grow();
        }
        // SAFETY: masked, the index is below `slots.len()` (`mask + 1`).
        unsafe { self.slots.get_unchecked_mut(self.tail & self.mask) }.write(v);
        self.tail = self.tail.wrapping_add(1);
    }

    #[inline]
    pub(crate) fn front(&self) -> Option<&T> {
        if self.is_empty() {
            return None;
        }
        // SAFETY: masked, the index is below `slots.len()`; `head` is below `tail`, so its
        // slot holds an element.
        Some(unsafe {
            self.slots
                .get_unchecked(self.head & self.mask)
                .assume_init_ref()
        })
    }

    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        if self.is_empty() {
            return None;
        }
        let i = self.head & self.mask;
        self.head = self.head.wrapping_add(1);
        // SAFETY: masked, `i` is below `slots.len()`; the slot held an element, which is
        // moved out and no longer counted.
        Some(unsafe { self.slots.get_unchecked(i).assume_init_read() })
    }

    /// Drops the first element where it lies (nothing when empty): cheaper than `pop_front`
    /// for an element that is not needed any more, which it would move out first.
    #[inline]
    pub(crate) fn drop_front(&mut self) {
        if self.is_empty() {
            return;
        }
        let i = self.head & self.mask;
        self.head = self.head.wrapping_add(1);
        // SAFETY: masked, `i` is below `slots.len()`; the slot held an element, which is
        // dropped and no longer counted.
        unsafe { self.slots.get_unchecked_mut(i).assume_init_drop() }
    }

    /// Doubles the capacity, keeping the order.
    #[cold]
    fn grow(&mut self) {
        let mut bigger = Fifo::with_capacity(2 * self.slots.len());
        while let Some(v) = self.pop_front() {
            bigger.push_back(v);
        }
        *self = bigger;
    }
}

impl<T> Drop for Fifo<T> {
    fn drop(&mut self) {
        while self.pop_front().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    #[test]
    fn behaves_as_a_vecdeque_across_wraps_and_growth_and_drops_what_is_left() {
        let mut q = Fifo::with_capacity(3);
        assert_eq!(q.slots.len(), 4);
        let mut model = std::collections::VecDeque::new();
        let mut next = 0u32;
        // Pushes and pops in uneven bursts: the indexes wrap many times, and the queue grows
        // past its first capacity.
        for round in 0..500u32 {
            for _ in 0..(round * 7 % 6) {
                q.push_back(next);
                model.push_back(next);
                next += 1;
            }
            for i in 0..(round * 3 % 5) {
                assert_eq!(q.front(), model.front());
                if i % 2 == 0 {
                    assert_eq!(q.pop_front(), model.pop_front());
                } else {
                    q.drop_front();
                    model.pop_front();
                }
            }
            assert_eq!((q.len(), q.is_empty()), (model.len(), model.is_empty()));
        }
        assert!(q.slots.len() > 4, "it grew");
        while let Some(v) = model.pop_front() {
            assert_eq!(q.pop_front(), Some(v));
        }
        assert_eq!(q.pop_front(), None);
        assert!(q.is_empty() && q.front().is_none());
        let rc = Rc::new(());
        let mut q = Fifo::with_capacity(4);
        for _ in 0..3 {
            q.push_back(rc.clone());
        }
        q.pop_front();
        assert_eq!(Rc::strong_count(&rc), 3);
        q.drop_front();
        assert_eq!(Rc::strong_count(&rc), 2, "dropped where it lay");
        drop(q);
        assert_eq!(Rc::strong_count(&rc), 1);
    }
}
