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
/// `Flow::notify_peer` after each record it writes. Not modelled there: the poster's wake-up
/// of its own side (`ConnState::kick`), and the sleep's timeout (without which a lost doorbell
/// hangs the model). The notice board's mark for records taken, made by `must_ring`'s
/// `between` when the peer asked for it, is modelled in the second check.
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

    /// The model's runner: four preemptions unless `LOOM_MAX_PREEMPTIONS` says otherwise.
    fn builder() -> loom::model::Builder {
        let mut b = loom::model::Builder::new();
        if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
            b.preemption_bound = Some(4);
        }
        b
    }

    /// One side writes three records, each followed by the doorbell check; the other takes
    /// them, announcing its sleep whenever it finds none. It always gets all three (a lost
    /// doorbell would leave it asleep with a record waiting: a deadlock to loom), and the
    /// writer rang only on an announced sleep, at most once for each.
    #[test]
    fn loom_doorbell_never_leaves_the_peer_asleep_with_work() {
        const N: u8 = 3;
        builder().check(|| {
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

    /// A connection's slot on its queue's notice board, as far as one slot goes: the bit, and
    /// the queue's descriptor that a poller with nothing to do sleeps on until a mark.
    #[derive(Default)]
    struct Slot {
        bit: loom::sync::atomic::AtomicU64,
        woken: Mutex<()>,
        marked: Condvar,
    }

    impl Slot {
        /// `Board::mark`, then the ring of a sleeping poller.
        fn mark(&self) {
            if self.bit.load(Ordering::SeqCst) != 0 {
                return;
            }
            let _g = self.woken.lock().unwrap();
            self.bit.fetch_or(1, Ordering::SeqCst);
            self.marked.notify_all();
        }

        /// `Board::take` for the slot: whether it was marked.
        fn take(&self) -> bool {
            let was = self.bit.swap(0, Ordering::SeqCst);
            loom::sync::atomic::fence(Ordering::SeqCst);
            was != 0
        }

        /// Sleeps until the slot is marked, and takes the mark. Loom fails the run as a
        /// deadlock if no mark ever comes.
        fn sleep(&self) {
            let mut g = self.woken.lock().unwrap();
            while !self.take() {
                g = self.marked.wait(g).unwrap();
            }
        }
    }

    /// A sender whose connection leaves the list its queue polls every time while its sends
    /// are in flight: it asks the peer for marks (`want_mark`, as `ConnState::settle` does,
    /// with records taken among them), looks at its ring's head once more, and from then on
    /// looks only when the slot is marked. The receiver takes the records one by one, each
    /// followed by `Flow::notify_peer`'s check, which marks the slot when asked to for records
    /// taken. The sender always sees every send complete (a lost mark would leave it asleep
    /// with its sends taken: a deadlock to loom).
    #[test]
    fn loom_taken_records_reach_a_sender_off_the_busy_list() {
        const N: u8 = 2;
        builder().check(|| {
            let mem = Mem::new();
            let sleeping = Arc::new(ModelU32::new(0));
            // Polled every time to begin with: no marks asked for.
            let want_mark = Arc::new(ModelU32::new(0));
            let slot = Arc::new(Slot::default());
            let mut tx = Producer::over(mem.clone(), CAP);
            for i in 0..N {
                let byte = [i];
                // SAFETY: `byte` is readable for its one byte.
                let wrote = unsafe { tx.write(byte.as_ptr(), 1, true, true, None, 1) };
                assert_eq!(wrote.unwrap(), Some(1), "small records fit");
            }
            let end = tx.tail();
            let (want, marks) = (want_mark.clone(), slot.clone());
            let mut rx = Consumer::over(mem.clone(), CAP);
            let receiver = thread::spawn(move || {
                let mut got = 0u8;
                while got < N {
                    let Some(rec) = rx.peek().unwrap() else {
                        thread::yield_now();
                        continue;
                    };
                    rx.consume(&rec);
                    got += 1;
                    must_ring(&*sleeping, TAKEN, || {
                        if want.load(Ordering::SeqCst) & TAKEN != 0 {
                            marks.mark();
                        }
                    });
                }
            });
            announce(&*want_mark, RECORDS | TAKEN);
            while tx.head().unwrap() < end {
                slot.sleep();
            }
            receiver.join().unwrap();
        });
    }
}
