//! The lock-free write: a connection's posters write into the peer's region that its
//! unsignaled writes last reached with no lock of the connection's, one atomic exchange per
//! write (the export entry's `busy` word, which the access must raise anyway).
//!
//! **Publication.** The paths that take the connection's import cache lock (so one publisher
//! at a time), whenever they reach a writable mapped import for an unsignaled write without
//! immediate data, publish its key, slot, address, length and mapping here unless it is
//! published already, a seqlock: `seq` is odd while nothing is published or the fields change,
//! and only grows. A writer reads the fields, claims the entry's `busy` word (exchange to 1;
//! when it was not 0 another access holds it and the writer leaves the write to the locked
//! path), reads `seq` again and the entry's `live` key: when both are as they were, the region
//! is the published one, mapped, and not withdrawn, so it copies and lowers `busy`.
//!
//! **Retirement.** An import that was ever published, when it goes, first makes `seq` odd, then
//! waits until `busy` is 0 (whichever of the two comes second sees the other, as in the export
//! protocol: a writer that read the old `seq` holds `busy` until its copy is over), then
//! replaces its mapping with private anonymous memory instead of unmapping it. The peer's
//! memory is released at once; the address range stays reserved until the connection goes (up
//! to [`RETIRED_MAX`] ranges, the oldest unmapped beyond that). The wait alone would do for a
//! peer that follows the protocol, but `busy` lives in memory the peer can write: a peer that
//! cleared it under a copy in progress could otherwise have this process write into memory it
//! had unmapped - and maybe reused. With the range kept, such a copy lands in memory nobody
//! reads.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering, fence};
use std::time::Duration;

use parking_lot::Mutex;

use super::{REVOKE_WAIT, offset_in};
use crate::log::log;
use crate::shm::copy::copy_access;
use crate::shm::segment::{EXPORT_SLOTS, Segment};

/// Longest a retirement waits for a copy in progress (one copy of at most 4 GiB - 1, by a
/// thread that may be descheduled meanwhile): as long as the owner waits for an access. After
/// it the range is never unmapped before the connection goes.
const RETIRE_WAIT: Duration = REVOKE_WAIT;
/// At most this many retired ranges are kept per connection; beyond, the oldest one whose
/// wait ended is unmapped.
const RETIRED_MAX: usize = 256;

/// The published import of one connection (see the module docs).
pub(crate) struct Shortcut {
    /// Odd while nothing is published or the fields change; only grows.
    seq: AtomicU64,
    key: AtomicU64,
    slot: AtomicUsize,
    /// The peer's address of the region's first byte, and its length.
    addr: AtomicU64,
    len: AtomicU64,
    /// Where the region is mapped here (writable).
    base: AtomicPtr<u8>,
    /// The connection's segment, held so that it stays mapped for `table`: where the peer's
    /// side of it has its export table (see [`Segment::export_table`]).
    _seg: Arc<Segment>,
    table: NonNull<AtomicU64>,
    /// Retired ranges: start, length, and whether the retirement's wait ended (those may be
    /// unmapped before the connection goes).
    retired: Mutex<VecDeque<(usize, usize, bool)>>,
}

// SAFETY: `base` and `table` point into process-wide mappings - the peer's region, mapped or
// reserved while any writer may reach it (the module docs), and the segment, which `_seg`
// keeps - that are accessed only as the protocol above says, from any thread.
unsafe impl Send for Shortcut {}
// SAFETY: as above; every field is atomic or under a lock.
unsafe impl Sync for Shortcut {}

/// What [`Shortcut::publish`] publishes: a writable region of the peer's mapped here.
pub(crate) struct Published {
    pub(crate) key: u64,
    pub(crate) slot: usize,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) base: NonNull<u8>,
}

impl Shortcut {
    /// Nothing published yet; `seg`/`peer_side`: where the peer's export table is.
    pub(crate) fn new(seg: Arc<Segment>, peer_side: usize) -> Shortcut {
        let table = seg.export_table(peer_side).expect("a side of the segment");
        Shortcut {
            table,
            seq: AtomicU64::new(1),
            key: AtomicU64::new(0),
            slot: AtomicUsize::new(0),
            addr: AtomicU64::new(0),
            len: AtomicU64::new(0),
            base: AtomicPtr::new(std::ptr::null_mut()),
            _seg: seg,
            retired: Mutex::new(VecDeque::new()),
        }
    }

    /// Whether `p` is what is published now.
    fn holds(&self, p: &Published) -> bool {
        // Relaxed: only publishers write the fields, and they run one at a time (the caller's
        // lock); a retirement moving `seq` on after this read is seen by every writer.
        self.seq.load(Ordering::Relaxed) & 1 == 0
            && self.key.load(Ordering::Relaxed) == p.key
            && self.base.load(Ordering::Relaxed) == p.base.as_ptr()
    }

    /// Publishes `p`. The caller holds the connection's import cache lock (publishers run one
    /// at a time), holds the import `p` describes alive through the call, and has made sure
    /// that the import retires here when it goes ([`Shortcut::retire`]).
    pub(crate) fn publish(&self, p: Published) {
        if self.holds(&p) {
            return;
        }
        // An RMW, not a store: a retirement may make `seq` odd at the same time. Relaxed, then
        // a Release fence: the odd value comes before the fields' new values for anyone who
        // reads them (the seqlock's writer side).
        self.seq.fetch_or(1, Ordering::Relaxed);
        fence(Ordering::Release);
        self.key.store(p.key, Ordering::Relaxed);
        self.slot.store(p.slot, Ordering::Relaxed);
        self.addr.store(p.addr, Ordering::Relaxed);
        self.len.store(p.len, Ordering::Relaxed);
        self.base.store(p.base.as_ptr(), Ordering::Relaxed);
        // Release: the fields come before the even value a writer acquires. Odd to even: so
        // `seq` only grows, and a writer's first reading is never seen again once it moved.
        self.seq.fetch_add(1, Ordering::Release);
    }

    /// The `live` and `busy` words of entry `slot` of the peer's export table; `None` for a slot
    /// out of range.
    #[inline(always)]
    fn entry(&self, slot: usize) -> Option<(&AtomicU64, &AtomicU64)> {
        if slot >= EXPORT_SLOTS {
            return None;
        }
        // SAFETY: entry `slot` of the table, whose two words lie inside the segment, which
        // `self._seg` keeps mapped as long as `self`; shared words are only accessed atomically.
        unsafe {
            let at = self.table.as_ptr().add(2 * slot);
            Some((&*at, &*at.add(1)))
        }
    }

    /// Copies `len` bytes at `src` to the peer's address `addr` of the region with `key` when
    /// that region is the published one, holds the range, and was not withdrawn: true then;
    /// false, having touched nothing, otherwise (the locked path then does the write). It runs
    /// ahead of the C surface's catch of panics (`Connection::write_direct`): nothing here
    /// may panic.
    ///
    /// # Safety
    /// `src` is readable for `len` bytes.
    #[inline(always)]
    #[deny(
        clippy::panic,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing
    )]
    pub(crate) unsafe fn write(&self, key: u64, src: *const u8, len: usize, addr: u64) -> bool {
        // Acquire: pairs with the publisher's Release, so the fields read are at least those.
        let seq = self.seq.load(Ordering::Acquire);
        // Relaxed: checked against `seq` below before anything is done with them.
        if seq & 1 != 0 || self.key.load(Ordering::Relaxed) != key {
            return false;
        }
        let start = self.addr.load(Ordering::Relaxed);
        let size = self.len.load(Ordering::Relaxed);
        let base = self.base.load(Ordering::Relaxed);
        let slot = self.slot.load(Ordering::Relaxed);
        let Some(off) = offset_in(start, size, addr, len) else {
            return false;
        };
        // A slot read in the middle of a change is still one of the table's (bounds-checked),
        // and the claim below is given back untouched when `seq` moved.
        let Some((live, busy)) = self.entry(slot) else {
            return false;
        };
        // SeqCst: the claim comes before the reads of `seq` and `live` (Dekker with a
        // retirement's move of `seq` and read of `busy`, and with the owner's clear of `live`
        // and read of `busy`). Not 0: another access holds the entry; not ours to lower.
        if busy.swap(1, Ordering::SeqCst) != 0 {
            return false;
        }
        // Acquire: the fields' reads above come before the second read of `seq` (the
        // seqlock's reader side).
        fence(Ordering::Acquire);
        let same = self.seq.load(Ordering::SeqCst) == seq && live.load(Ordering::SeqCst) == key;
        if same {
            // SAFETY: `seq` did not move between the reads of the fields and the claim, so
            // they describe the published import, whose mapping stays while the claim is held
            // (its retirement waits for `busy`) and is writable for `start..start + size`,
            // which holds `addr..addr + len` (`offset_in`); `src` is readable for `len` (the
            // caller's contract).
            unsafe { copy_access(src, base.add(off), len) };
        }
        // Release: the copy comes before the owner, or a retirement, seeing 0.
        busy.store(0, Ordering::Release);
        same
    }

    /// An import that was published goes: nothing is published any more (whichever import it
    /// was: the locked path publishes again at its next access), no writer reaches it once this
    /// returns, and its
    /// mapping (`len` bytes at `base`, the peer's region in `slot`) is replaced by private
    /// memory, kept reserved (see the module docs).
    pub(crate) fn retire(&self, slot: usize, base: NonNull<u8>, len: usize) {
        // SeqCst: the move comes before the read of `busy` (Dekker with `write`). Even to odd
        // (a move), or odd already, which is a move since any even value a writer read.
        self.seq.fetch_or(1, Ordering::SeqCst);
        let waited = match self.entry(slot) {
            Some((_, busy)) => wait_unclaimed(busy),
            None => true,
        };
        // SAFETY: `base..base + len` is the import's own mapping (what mmap returned), which
        // nothing else in this process uses: replacing it with fresh private memory touches no
        // other mapping.
        let p = unsafe {
            libc::mmap(
                base.as_ptr().cast(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            // The peer's memory stays mapped until the connection goes; still safe.
            log!(
                Warn,
                "could not release a withdrawn shm region's mapping: {}",
                std::io::Error::last_os_error()
            );
        }
        let mut retired = self.retired.lock();
        retired.push_back((base.as_ptr() as usize, len, waited));
        if retired.len() > RETIRED_MAX
            && let Some(i) = retired.iter().position(|r| r.2)
        {
            let (start, len, _) = retired.remove(i).expect("found above");
            // SAFETY: a retired range of this connection, whose retirement saw no copy in
            // progress after `seq` moved: no writer of a well-behaved peer's connection reaches it.
            unsafe { libc::munmap(start as *mut libc::c_void, len) };
        }
    }
}

impl Drop for Shortcut {
    fn drop(&mut self) {
        for (start, len, _) in self.retired.get_mut().drain(..) {
            // SAFETY: retired ranges of this connection; with the shortcut gone, so are its
            // writers (they hold the connection).
            unsafe { libc::munmap(start as *mut libc::c_void, len) };
        }
    }
}

/// Waits until `busy` is 0, at most [`RETIRE_WAIT`]: whether it was.
fn wait_unclaimed(busy: &AtomicU64) -> bool {
    // SeqCst: pairs with the writer's claim (see `Shortcut::retire`).
    crate::sync::spin_until(RETIRE_WAIT, || busy.load(Ordering::SeqCst) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// `LEN` bytes of a memfd mapped twice: once for the shortcut (which retires it), once to
    /// watch what reaches the file.
    struct Page {
        theirs: NonNull<u8>,
        watch: NonNull<u8>,
    }

    const LEN: usize = 1 << 20;

    fn page() -> Page {
        let fd = crate::sys::sealed_memfd(c"shortcut-test", LEN).unwrap();
        Page {
            theirs: crate::sys::map_shared(&fd, LEN).unwrap(),
            watch: crate::sys::map_shared(&fd, LEN).unwrap(),
        }
    }

    impl Drop for Page {
        fn drop(&mut self) {
            // SAFETY: the watch mapping is the test's own (the other one is the shortcut's).
            unsafe { libc::munmap(self.watch.as_ptr().cast(), LEN) };
        }
    }

    /// The word at `off` of a mapping, read as the writers may change it.
    fn word(at: NonNull<u8>, off: usize) -> u64 {
        // SAFETY: `at` maps `LEN` bytes, live while the test runs; `off + 8 <= LEN` here.
        unsafe { at.as_ptr().add(off).cast::<u64>().read_volatile() }
    }

    fn watched(p: &Page) -> u64 {
        word(p.watch, 0)
    }

    const ADDR: u64 = 0x10_0000;
    static ONE: u64 = 1;

    fn publish(s: &Shortcut, p: &Page, key: u64) {
        s.publish(Published {
            key,
            slot: 2,
            addr: ADDR,
            len: LEN as u64,
            base: p.theirs,
        });
    }

    #[test]
    fn a_write_reaches_only_the_published_region_within_its_bounds() {
        let (seg, _fd) = Segment::create(64 * 1024).unwrap();
        let seg = Arc::new(seg);
        let s = Shortcut::new(seg.clone(), 0);
        let p = page();
        let v = 0x1122_3344_5566_7788u64;
        let src = (&raw const v).cast::<u8>();
        let live = |k: u64| seg.export(0, 2).unwrap().live.store(k, Ordering::SeqCst);
        // SAFETY: `src` and `ONE`, all it is given, are 8 readable bytes.
        let w = |key: u64, src: *const u8, addr: u64| unsafe { s.write(key, src, 8, addr) };
        assert!(!w(7, src, ADDR), "nothing published");
        live(7);
        publish(&s, &p, 7);
        assert!(!w(8, src, ADDR), "another key");
        let end = ADDR + LEN as u64;
        assert!(!w(7, src, end - 7), "past the end");
        assert!(!w(7, src, ADDR - 1), "before the start");
        assert_eq!(watched(&p), 0);
        assert!(w(7, src, ADDR));
        assert!(w(7, src, end - 8));
        assert_eq!((watched(&p), word(p.watch, LEN - 8)), (v, v));
        // Withdrawn by the owner: refused, nothing touched.
        live(0);
        assert!(!w(7, (&raw const ONE).cast(), ADDR));
        assert_eq!(watched(&p), v);
        // Claimed by another access: left to the locked path, and the claim left as it was.
        live(7);
        let busy = seg.export(0, 2).unwrap().busy;
        busy.store(1, Ordering::SeqCst);
        assert!(!w(7, (&raw const ONE).cast(), ADDR));
        assert_eq!(busy.load(Ordering::SeqCst), 1);
        busy.store(0, Ordering::SeqCst);
        // Retired: refused, and the file no longer mapped there.
        s.retire(2, p.theirs, LEN);
        assert!(!w(7, (&raw const ONE).cast(), ADDR));
        assert_eq!((watched(&p), word(p.theirs, 0)), (v, 0));
    }

    /// The shortcut's protocol under a race: a writer keeps copying a whole region, each round
    /// a new one, while the test retires it (the owner never withdraws it: only the shortcut
    /// stops the writer). Once a retirement has returned, no copy may be in progress - its
    /// mapping's replacement stays zero - no write begun after it may report success, and
    /// nothing reaches the retired region's file.
    #[test]
    fn no_write_reaches_a_region_after_its_retirement_returned() {
        const ROUNDS: u64 = 300;
        let (seg, _fd) = Segment::create(64 * 1024).unwrap();
        let seg = Arc::new(seg);
        let s = Shortcut::new(seg.clone(), 0);
        let current = AtomicU64::new(0);
        let retired = AtomicU64::new(0);
        let stop = AtomicBool::new(false);
        let (mut in_progress, mut reached) = (0, 0);
        let succeeded_late = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                let mut buf = vec![0u64; LEN / 8];
                let mut late = 0;
                while !stop.load(Ordering::Relaxed) {
                    // Acquire: a retirement before these reads returned before the write.
                    let r = retired.load(Ordering::Acquire);
                    let k = current.load(Ordering::Acquire);
                    if buf[0] != k {
                        buf.fill(k);
                    }
                    // SAFETY: `buf` holds LEN readable bytes.
                    if unsafe { s.write(k, buf.as_ptr().cast(), LEN, ADDR) } && r >= k {
                        late += 1;
                    }
                }
                late
            });
            for k in 1..=ROUNDS {
                let p = page();
                seg.export(0, 2).unwrap().live.store(k, Ordering::SeqCst);
                current.store(k, Ordering::Release);
                publish(&s, &p, k);
                let wrote = crate::sync::spin_until(Duration::from_secs(10), || {
                    word(p.watch, LEN - 8) == k
                });
                assert!(
                    wrote,
                    "round {k}: the writer never wrote the published region"
                );
                s.retire(2, p.theirs, LEN);
                // Release: pairs with the writer's Acquire.
                retired.store(k, Ordering::Release);
                if (0..LEN).step_by(4096).any(|off| word(p.theirs, off) != 0) {
                    in_progress += 1;
                }
                // SAFETY: the watch mapping is the test's own.
                unsafe { std::ptr::write_bytes(p.watch.as_ptr(), 0, LEN) };
                std::thread::sleep(Duration::from_micros(100));
                if (0..LEN).step_by(4096).any(|off| word(p.watch, off) != 0) {
                    reached += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap()
        });
        assert_eq!(
            (in_progress, reached, succeeded_late),
            (0, 0, 0),
            "copies in progress after a retirement returned, copies that reached a retired \
             region's file, writes begun after it that reported success"
        );
        assert!(s.retired.lock().len() <= RETIRED_MAX);
    }
}
