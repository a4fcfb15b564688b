//! Waiting for completions: polling for a budget that follows how soon completions came
//! to recent waits, then sleeping on the queue's descriptor.

use std::mem::MaybeUninit;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Completion, CompletionQueue, Progress, SPIN_ADAPT_MAX, SPIN_MAX, hand_over};
#[cfg(doc)]
use super::{CqOptions, ready::Readiness};
use crate::error::{Error, Result};
use crate::sync::{SpinningWait, YIELD_EVERY, pinned_to_one_cpu};
use crate::sys;

impl CompletionQueue {
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
}

// Not in `loom` builds, where the queue's readiness is made of loom's atomics, which only work
// inside a model.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::cq::tests::queue_and_reporter;
    use crate::cq::{CqOptions, DEFAULT_SPIN, Opcode, WcStatus};
    use std::sync::Arc;

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
