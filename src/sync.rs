//! The synchronisation primitives of the lock-free code that the model checks run: std's,
//! or in `loom` builds (`RUSTFLAGS="--cfg loom"`, the checks' only use) loom's, which the
//! model sees. Outside those builds these are std's types themselves, so the code is the same.

#[cfg(not(loom))]
pub(crate) use std::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize};

#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize};

/// How often a wait on a completion queue that polls, on a thread that may run on one CPU only,
/// lets the other threads of its CPU run (`sched_yield`). A thread woken on a CPU where another
/// polls does not get the CPU at once: the scheduler lets the poller finish its slice (about
/// 1 ms on Linux 6.18). In a process pinned to one CPU the library's thread shares it with the
/// program's, and without the yield every hand-off between them took that long: over shm, a
/// wait for a connection's end (which the library's thread reports) kept a program that opened
/// a connection per request to about 1,000 a second, and with progress threads a message took
/// about 85 µs one way. A thread free to run elsewhere does not yield: there the system call
/// costs more than it gives (2-4% of a 4 KiB round trip over soft-RoCE under emulation, where
/// the woken thread finds another CPU).
pub(crate) const YIELD_EVERY: std::time::Duration = std::time::Duration::from_micros(20);

/// Spins, then yields, until `done` is true or `bound` has passed: whether it came true. For
/// waits on another thread's short step (a copy, a claim held for one access).
pub(crate) fn spin_until(bound: std::time::Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else if start.elapsed() > bound {
            return false;
        } else {
            std::thread::yield_now();
        }
    }
    true
}

/// Whether the calling thread may run on one CPU only, as its affinity said when last looked at
/// (at most once a second per thread, `now` being the time: the look is a system call).
pub(crate) fn pinned_to_one_cpu(now: std::time::Instant) -> bool {
    use std::cell::Cell;
    use std::time::{Duration, Instant};
    thread_local! {
        static PINNED: Cell<Option<(bool, Instant)>> = const { Cell::new(None) };
    }
    PINNED.with(|p| {
        if let Some((pinned, at)) = p.get()
            && now.duration_since(at) < Duration::from_secs(1)
        {
            return pinned;
        }
        // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it for this thread.
        let pinned = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0
                && libc::CPU_COUNT(&set) == 1
        };
        p.set(Some((pinned, now)));
        pinned
    })
}

/// How many waits on completion queues of this process poll right now, past their first
/// rounds (see [`SpinningWait`]).
static SPINNING_WAITS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts a wait that polls, yielding its CPU every [`YIELD_EVERY`] (on a thread pinned to one
/// CPU), among [`SPINNING_WAITS`] while it lives: the library's thread, when its busy rounds
/// hold a CPU, yields too while one does (see [`waits_spin`]), so the two share the CPU at that
/// grain.
pub(crate) struct SpinningWait(());

impl SpinningWait {
    pub(crate) fn new() -> SpinningWait {
        // Relaxed: a hint for the library's thread, which looks again every few rounds.
        SPINNING_WAITS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        SpinningWait(())
    }
}

impl Drop for SpinningWait {
    fn drop(&mut self) {
        // Relaxed: as above.
        SPINNING_WAITS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether some wait of this process polls now, yielding its CPU now and then. The library's
/// thread yields its CPU while busy only then: a program thread that polls on its own
/// (`rbr_cq_poll` in a loop) never yields, and would keep a CPU handed to it for a whole slice.
pub(crate) fn waits_spin() -> bool {
    // Relaxed: a hint (see SPINNING_WAITS).
    SPINNING_WAITS.load(std::sync::atomic::Ordering::Relaxed) > 0
}

/// A lock for a hot path whose holders keep it briefly and never across a sleep (they copy,
/// make a system call that does not block, or take another lock held as briefly): taking it
/// is one atomic exchange, and letting it go is a plain release store (a mutex's release is an
/// atomic read-modify-write, since it must find out whether a waiter sleeps). A thread that
/// finds it held spins a little, then yields its CPU until the holder lets go, so a holder's
/// longest hold (a large copy) bounds every wait.
pub(crate) struct SpinLock<T> {
    held: std::sync::atomic::AtomicBool,
    value: std::cell::UnsafeCell<T>,
}

// SAFETY: the lock hands out the value to one thread at a time.
unsafe impl<T: Send> Send for SpinLock<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) fn new(value: T) -> Self {
        SpinLock {
            held: std::sync::atomic::AtomicBool::new(false),
            value: std::cell::UnsafeCell::new(value),
        }
    }

    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        use std::sync::atomic::Ordering;
        // Acquire: what the last holder did comes before what this one does.
        if self.held.swap(true, Ordering::Acquire) {
            self.lock_contended();
        }
        SpinGuard { lock: self }
    }

    /// The rest of `lock` when another holds the lock: out of line, so that the free case
    /// inlined into a hot path carries no loop and no call.
    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        use std::sync::atomic::Ordering;
        loop {
            let mut spins = 0u32;
            while self.held.load(Ordering::Relaxed) {
                if spins < 64 {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            // Acquire: as in `lock`.
            if !self.held.swap(true, Ordering::Acquire) {
                return;
            }
        }
    }

    /// The lock if it is free now.
    #[inline]
    pub(crate) fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        use std::sync::atomic::Ordering;
        // Acquire: as in `lock`. (The guard is made only once the lock is taken: dropping
        // one lets the lock go.)
        if self.held.load(Ordering::Relaxed) || self.held.swap(true, Ordering::Acquire) {
            return None;
        }
        Some(SpinGuard { lock: self })
    }
}

pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> std::ops::Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // Release: pairs with the next holder's Acquire.
        self.lock
            .held
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::SpinLock;

    #[test]
    fn a_failed_try_lock_leaves_the_lock_held() {
        let l = SpinLock::new(0u32);
        let g = l.lock();
        assert!(l.try_lock().is_none());
        // Still held: the failed attempt let nothing go.
        assert!(l.try_lock().is_none());
        drop(g);
        let g = l.try_lock().expect("free once the holder let go");
        assert!(l.try_lock().is_none());
        drop(g);
    }

    #[test]
    fn holders_exclude_each_other() {
        const THREADS: u64 = 4;
        const EACH: u64 = 50_000;
        let l = SpinLock::new((0u64, 0u64));
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let l = &l;
                s.spawn(move || {
                    let mut done = 0;
                    while done < EACH {
                        // Half the threads only try, as pollers do.
                        let g = if t % 2 == 0 {
                            Some(l.lock())
                        } else {
                            l.try_lock()
                        };
                        if let Some(mut g) = g {
                            // Two plain updates a racing holder would tear apart.
                            let v = g.0;
                            g.0 = v + 1;
                            g.1 += 1;
                            done += 1;
                        }
                    }
                });
            }
        });
        let g = l.lock();
        assert_eq!(*g, (THREADS * EACH, THREADS * EACH));
    }
}
