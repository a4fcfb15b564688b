//! The doorbell handshake: a side about to sleep announces it in a word of the segment, then
//! looks at its rings once more; the peer, after writing to them, rings the doorbell (a packet
//! on the handshake socket, the data path's one system call) only if it finds that
//! announcement, and takes it down as it rings, so each sleep costs one doorbell at most. The
//! announcement says what the sleeper waits for: new records ([`RECORDS`]), and, when it has
//! sends to complete or to write, the peer taking its records too ([`TAKEN`]); a peer that only
//! took records rings a sleeper that asked for that alone, since waking a process is the
//! costliest step of a message (tens of microseconds in a VM) and lands on the peer's path. A
//! SeqCst fence on each side between its store and its look at the other's words (Dekker)
//! means that either the sleeper sees the writer's record or the writer sees the sleeper's
//! announcement: a sleeper is never left asleep with work waiting. The `loom` check below
//! runs these functions, with the real ring ends, over the model's atomics.

use std::sync::atomic::{AtomicU32, Ordering};

/// A word of the segment that announces a request (the `loom` check puts in its own).
pub(crate) trait Flag {
    /// As [`AtomicU32::load`].
    fn load(&self, order: Ordering) -> u32;
    /// As [`AtomicU32::store`].
    fn store(&self, v: u32, order: Ordering);
    /// As [`AtomicU32::compare_exchange`].
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        ok: Ordering,
        err: Ordering,
    ) -> Result<u32, u32>;
    /// As [`std::sync::atomic::fence`], of the memory model this word lives in.
    fn fence(order: Ordering);
}

impl Flag for AtomicU32 {
    #[inline(always)]
    fn load(&self, order: Ordering) -> u32 {
        AtomicU32::load(self, order)
    }

    #[inline(always)]
    fn store(&self, v: u32, order: Ordering) {
        AtomicU32::store(self, v, order)
    }

    #[inline(always)]
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        ok: Ordering,
        err: Ordering,
    ) -> Result<u32, u32> {
        AtomicU32::compare_exchange(self, current, new, ok, err)
    }

    #[inline(always)]
    fn fence(order: Ordering) {
        std::sync::atomic::fence(order)
    }
}

/// A sleeper's request: ring when you write records.
pub(crate) const RECORDS: u32 = 1;
/// A sleeper's request, with [`RECORDS`]: ring also when you take my records (my sends
/// complete, my ring has room).
pub(crate) const TAKEN: u32 = 2;
/// With the others: ring my completion queue's bell (named on my notice board), not the
/// connection's socket - the sleeper is a poller of the queue, not the library's thread.
pub(crate) const QUEUE: u32 = 4;

/// Sets one of this side's request words for the peer to `value` (0: no request). The SeqCst
/// fence orders the store before the caller's re-check of the rings, pairing with the peer's
/// fence in [`must_ring`] before it reads the word: either the peer sees the request or the
/// caller sees what the peer wrote. A sleeper announces again (and looks again) whenever what
/// it waits for changes.
#[inline(always)]
pub(crate) fn announce<F: Flag>(flag: &F, value: u32) {
    flag.store(value, Ordering::SeqCst);
    F::fence(Ordering::SeqCst);
}

/// The writer's side, after its ring stores: what the peer asked for if this writer must ring
/// its doorbell (0: no ring), which it must when the peer announced that it sleeps
/// (`sleeping`) waiting for any of `news`
/// ([`RECORDS`]: records were written; [`TAKEN`]: the peer's records were taken); taking the
/// announcement down makes this writer the one that rings. `between` runs after the fence
/// that orders the writer's stores before its reads of the peer's words (it marks the
/// peer's notice board). When the announcement changes under the look, the sleeper looks at
/// the rings again after it (see [`announce`]), so no doorbell is owed.
#[inline(always)]
pub(crate) fn must_ring<F: Flag>(sleeping: &F, news: u32, between: impl FnOnce()) -> u32 {
    // SeqCst fence: our ring stores are ordered before reading the peer's notice board and
    // `sleeping`, pairing with its clearing of the board, and its store of `sleeping`
    // (`announce`), before its re-check of the rings (Dekker).
    F::fence(Ordering::SeqCst);
    between();
    let asked = sleeping.load(Ordering::SeqCst);
    if asked & news != 0
        && sleeping
            .compare_exchange(asked, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    {
        asked
    } else {
        0
    }
}

/// Model check of the doorbell: the real [`announce`] and [`must_ring`] and the real ring
/// ends, over loom's atomics (run with `RUSTFLAGS="--cfg loom" cargo test --lib loom`). The
/// sleeper follows the connection's turn as `engine.rs` takes it - take what the ring holds,
/// announce the sleep, look once more, sleep until a doorbell - and the writer
/// `Flow::notify_peer` after each record it writes. Not modelled: the notice board marked
/// between the fence and the look at `sleeping`, the poster's wake-up of its own side
/// (`ConnState::kick`), and the sleep's timeout (without which a lost doorbell hangs the model).
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use crate::shm::ring::loom_model::{CAP, Mem, payload};
    use crate::shm::ring::{Consumer, Producer};
    use loom::sync::atomic::AtomicU32 as ModelU32;
    use loom::sync::{Arc, Condvar, Mutex};
    use loom::thread;

    impl Flag for ModelU32 {
        fn load(&self, order: Ordering) -> u32 {
            ModelU32::load(self, order)
        }

        fn store(&self, v: u32, order: Ordering) {
            ModelU32::store(self, v, order)
        }

        fn compare_exchange(
            &self,
            current: u32,
            new: u32,
            ok: Ordering,
            err: Ordering,
        ) -> Result<u32, u32> {
            ModelU32::compare_exchange(self, current, new, ok, err)
        }

        fn fence(order: Ordering) {
            loom::sync::atomic::fence(order)
        }
    }

    /// The handshake socket, as far as doorbells go: packets sent and not yet read.
    #[derive(Default)]
    struct Socket {
        packets: Mutex<usize>,
        arrived: Condvar,
    }

    impl Socket {
        fn send(&self) {
            *self.packets.lock().unwrap() += 1;
            self.arrived.notify_all();
        }

        /// Sleeps until a packet is there, then reads them all. Loom fails the run as a
        /// deadlock if no packet ever comes.
        fn sleep(&self) {
            let mut p = self.packets.lock().unwrap();
            while *p == 0 {
                p = self.arrived.wait(p).unwrap();
            }
            *p = 0;
        }
    }

    /// One side writes three records, each followed by the doorbell check; the other takes
    /// them, announcing its sleep whenever it finds none. It always gets all three (a lost
    /// doorbell would leave it asleep with a record waiting: a deadlock to loom), and the
    /// writer rang only on an announced sleep, at most once for each.
    #[test]
    fn loom_doorbell_never_leaves_the_peer_asleep_with_work() {
        const N: u8 = 3;
        let mut b = loom::model::Builder::new();
        if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
            b.preemption_bound = Some(4);
        }
        b.check(|| {
            let mem = Mem::new();
            let sleeping = Arc::new(ModelU32::new(0));
            let sock = Arc::new(Socket::default());
            let rang = Arc::new(Mutex::new(0usize));
            let (flag, bell, count) = (sleeping.clone(), sock.clone(), rang.clone());
            let mut tx = Producer::over(mem.clone(), CAP);
            let writer = thread::spawn(move || {
                for i in 0..N {
                    let byte = [i];
                    // SAFETY: `byte` is readable for its one byte.
                    let wrote = unsafe { tx.write(byte.as_ptr(), 1, true, true, None, 1) };
                    assert_eq!(wrote.unwrap(), Some(1), "three small records fit");
                    if must_ring(&*flag, RECORDS, || {}) != 0 {
                        *count.lock().unwrap() += 1;
                        bell.send();
                    }
                }
            });
            let mut rx = Consumer::over(mem.clone(), CAP);
            let (mut got, mut announced) = (0u8, 0usize);
            loop {
                while let Some(rec) = rx.peek().unwrap() {
                    assert_eq!(payload(&mem, &rec), [got]);
                    rx.consume(&rec);
                    got += 1;
                }
                if got == N {
                    break;
                }
                announce(&*sleeping, RECORDS);
                announced += 1;
                if rx.has_data().unwrap() {
                    continue;
                }
                sock.sleep();
            }
            writer.join().unwrap();
            // Each doorbell took an announcement down.
            assert!(*rang.lock().unwrap() <= announced);
        });
    }
}
