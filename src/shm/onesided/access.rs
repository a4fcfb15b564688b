//! Running an access on the peer's region: the checks, the export protocol's accessing side,
//! and the copy or atomic instruction on a mapping, or the copy through the kernel.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::import::{Import, Target};
use super::{REVOKE_WAIT, Refused};
use crate::conn::{LocalSeg, RdmaOp, RdmaRequest};
use crate::mr::Access;
use crate::shm::copy::copy_access;
use crate::shm::segment::{Export, Segment};

/// The access `op` needs at the target.
fn needs(op: RdmaOp) -> u32 {
    match op {
        RdmaOp::Write { .. } => Access::REMOTE_WRITE.0,
        RdmaOp::Read => Access::REMOTE_READ.0,
        RdmaOp::FetchAdd { .. } | RdmaOp::CmpSwap { .. } => Access::REMOTE_ATOMIC.0,
    }
}

/// Runs the checked request `wr` on the peer's region `imp`. `seg`/`peer_side`: where the
/// peer's export table is; `peer_pid`: the peer's process when this side may reach its memory.
/// The caller holds the connection's import cache lock (which keeps `imp` cached).
pub(crate) fn run(
    imp: &Import,
    wr: &RdmaRequest<'_>,
    seg: &Segment,
    peer_side: usize,
    peer_pid: Option<libc::pid_t>,
) -> std::result::Result<(), Refused> {
    let need = needs(wr.op);
    let off = imp
        .reach(need, wr.remote_addr, wr.len)
        .ok_or(Refused::Denied)?;
    // An atomic's word must be 8-byte aligned where it is accessed: the core checked the
    // address the caller named, but the peer chose where its region starts, so the word's
    // place in the mapping (which starts on a page) is checked here.
    if need == Access::REMOTE_ATOMIC.0 && off % 8 != 0 {
        return Err(Refused::Denied);
    }
    let Some(entry) = seg.export(peer_side, imp.slot) else {
        return Err(Refused::Denied);
    };
    guarded(&entry, imp.key, || match imp.target {
        // SAFETY: `off..off+len` lies inside the mapping (checked above against the import's
        // length, which `Import::map` checked against the file), the mapping stays while
        // `imp` lives, and it is writable where the access needs it (writes and atomics need
        // an offer that made it writable).
        Target::Mapped { base, .. } => unsafe {
            mapped(base.as_ptr().add(off), wr);
            Ok(())
        },
        Target::Process => match peer_pid {
            Some(pid) => process(pid, wr).map_err(|_| Refused::Denied),
            None => Err(Refused::Denied),
        },
    })
    .unwrap_or(Err(Refused::Withdrawn))
}

/// Copies `len` bytes at the peer's address `addr`, which must lie inside the region `imp`
/// maps here, into `dst`, under the export protocol (as a read does): the receiving side of a
/// large message sent from a region the peer exposed for it. `Err` when the range is not
/// inside the region, the region is not mapped here, or the peer withdrew it; nothing is
/// copied then.
///
/// # Safety
/// `dst` is writable for `len` bytes and does not overlap the mapping.
pub(crate) unsafe fn copy_mapped(
    imp: &Import,
    addr: u64,
    dst: *mut u8,
    len: usize,
    seg: &Segment,
    peer_side: usize,
) -> std::result::Result<(), Refused> {
    let Target::Mapped { base, .. } = imp.target else {
        return Err(Refused::Denied);
    };
    let off = imp.offset(addr, len).ok_or(Refused::Denied)?;
    let entry = seg.export(peer_side, imp.slot).ok_or(Refused::Denied)?;
    guarded(&entry, imp.key, || {
        // SAFETY: `off..off+len` lies inside the import's length, which `Import::map` checked
        // against the file and mapped; `dst` is writable for `len` (the caller's contract).
        unsafe { copy_access(base.as_ptr().add(off).cast_const(), dst, len) }
    })
    .ok_or(Refused::Withdrawn)
}

/// The accessing side of an export's protocol (see [`Export`]): claims `busy`, runs `access`
/// if `live` still holds `key` (`None` if not: withdrawn), and lowers `busy`.
///
/// `busy` is a claim: raised by an exchange that found it 0, lowered only by whoever raised it,
/// so that this side's accesses to one entry run one at a time - those of the locked paths, and
/// the lock-free write's (`shortcut.rs`), which leaves the write to the locked path when the
/// entry is claimed. Claim then look, with a full barrier between (the exchange; Dekker with the
/// owner's clear of `live` and look at `busy`): if the key is still there, the owner waits for
/// the lowering. A plain store for the raise with a system-wide barrier on the owner's side
/// (`membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)`) was tried and is not sound: the kernel can
/// skip a CPU that runs a thread of a registered process (seen on Linux 6.18: no interrupt to
/// that CPU in 10,000 barriers), and the race test below then caught a late access. A claim not
/// had within [`CLAIM_WAIT`] (an entry the peer holds raised) counts as withdrawn.
#[inline(always)]
fn guarded<R>(entry: &Export<'_>, key: u64, access: impl FnOnce() -> R) -> Option<R> {
    // SeqCst: the claim comes before the look at `live` (see above).
    if entry.busy.swap(1, Ordering::SeqCst) != 0 && !claim_contended(entry.busy, CLAIM_WAIT) {
        return None;
    }
    let r = (entry.live.load(Ordering::SeqCst) == key).then(access);
    // Release: the access comes before the owner, seeing 0, lets the memory go.
    entry.busy.store(0, Ordering::Release);
    r
}

/// Longest [`guarded`] waits for another access of this side to give an entry up: as long as
/// the owner waits for an access (an access of this side holds it for one copy, however many
/// come one after another; only a peer that raised it itself holds it longer).
const CLAIM_WAIT: Duration = REVOKE_WAIT;

/// Claims `busy` held by another access: whether it was had within `bound`.
#[cold]
fn claim_contended(busy: &AtomicU64, bound: Duration) -> bool {
    // SeqCst: as the first exchange.
    crate::sync::spin_until(bound, || busy.swap(1, Ordering::SeqCst) == 0)
}

/// The access on a mapping: plain copies, or atomic instructions.
///
/// # Safety
/// `at` is valid for `wr.len` bytes (8-aligned for atomics, which `run` checked), writable
/// where `wr` writes.
unsafe fn mapped(at: *mut u8, wr: &RdmaRequest<'_>) {
    let mut pos = at;
    match wr.op {
        RdmaOp::Write { .. } => {
            for s in wr.segs() {
                // SAFETY: `s.ptr` is readable for `s.len` bytes (checked by the core, the
                // region held by the request); the segments add up to `wr.len`.
                unsafe {
                    copy_access(s.ptr.cast_const(), pos, s.len);
                    pos = pos.add(s.len);
                }
            }
        }
        RdmaOp::Read => {
            for s in wr.segs() {
                // SAFETY: as for writes; `s.ptr` is writable (LOCAL_WRITE, checked).
                unsafe {
                    copy_access(pos.cast_const(), s.ptr, s.len);
                    pos = pos.add(s.len);
                }
            }
        }
        RdmaOp::FetchAdd { .. } | RdmaOp::CmpSwap { .. } => {
            // SAFETY: the word is 8-aligned, inside the mapping, and shared memory is accessed
            // atomically by everyone who follows the protocol.
            let word = unsafe { AtomicU64::from_ptr(at.cast()) };
            // SeqCst: atomics order with every other atomic on the word, wherever it runs.
            let old = match wr.op {
                RdmaOp::FetchAdd { add } => word.fetch_add(add, Ordering::SeqCst),
                RdmaOp::CmpSwap { compare, swap } => {
                    match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                        Ok(v) | Err(v) => v,
                    }
                }
                _ => unreachable!("atomics only"),
            };
            let s: &LocalSeg<'_> = wr.segs().next().expect("an atomic has its local word");
            // SAFETY: the local word is 8 bytes, 8-aligned and writable (checked by the core).
            unsafe { s.ptr.cast::<u64>().write(old) };
        }
    }
}

/// The access through the kernel, in the peer's process (writes and reads only).
fn process(pid: libc::pid_t, wr: &RdmaRequest<'_>) -> io::Result<()> {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; crate::conn::SGE_MAX];
    let mut n = 0;
    for s in wr.segs().filter(|s| s.len > 0) {
        iov[n] = libc::iovec {
            iov_base: s.ptr.cast(),
            iov_len: s.len,
        };
        n += 1;
    }
    let mut done = 0usize;
    while done < wr.len {
        // The local segments from `done` on.
        let mut local = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; crate::conn::SGE_MAX];
        let (mut k, mut skip) = (0, done);
        for v in &iov[..n] {
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            local[k] = libc::iovec {
                iov_base: v.iov_base.cast::<u8>().wrapping_add(skip).cast(),
                iov_len: v.iov_len - skip,
            };
            skip = 0;
            k += 1;
        }
        let remote = libc::iovec {
            iov_base: (wr.remote_addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: wr.len - done,
        };
        // SAFETY: the local iovecs lie inside the request's checked segments (readable, and
        // writable for reads); the remote one is checked by the kernel against the peer's
        // mappings, and was checked by us against what the peer registered.
        let r = unsafe {
            match wr.op {
                RdmaOp::Read => libc::process_vm_readv(pid, local.as_ptr(), k as _, &remote, 1, 0),
                _ => libc::process_vm_writev(pid, local.as_ptr(), k as _, &remote, 1, 0),
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        done += r as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::time::Instant;

    use super::super::REMOTE_BITS;
    use super::super::export::close_entry;
    use super::*;
    use crate::mr::MemoryRegion;
    use crate::shm::wire::{Offer, OfferKind};

    /// `busy` is a claim: an access waits for another of this side's to lower it, and a
    /// claim that is not had in time gives up without lowering what it never raised.
    #[test]
    fn an_access_waits_for_a_claimed_entry_and_gives_up_on_a_stuck_one() {
        let (seg, _fd) = Segment::create(64 * 1024).unwrap();
        let entry = seg.export(0, 0).unwrap();
        entry.live.store(5, Ordering::SeqCst);
        entry.busy.store(1, Ordering::SeqCst);
        let t = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                entry.busy.store(0, Ordering::Release);
            });
            assert_eq!(guarded(&entry, 5, || 9), Some(9));
        });
        assert!(t.elapsed() >= Duration::from_millis(30));
        assert_eq!(
            entry.busy.load(Ordering::SeqCst),
            0,
            "lowered by the access"
        );
        entry.busy.store(1, Ordering::SeqCst);
        let t = Instant::now();
        assert!(!claim_contended(entry.busy, Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert_eq!(
            entry.busy.load(Ordering::SeqCst),
            1,
            "not lowered: not its claim"
        );
    }

    /// The export protocol under a race: an accessor keeps accessing (writing the key it used
    /// into `touched`, as a write into the region would) while the owner withdraws; once the
    /// withdrawal has returned, no access may run.
    #[test]
    fn no_access_runs_after_its_withdrawal_returned() {
        use std::sync::atomic::AtomicBool;
        const ROUNDS: u64 = 20_000;
        let (seg, _fd) = Segment::create(64 * 1024).unwrap();
        let pid = std::process::id() as libc::pid_t;
        let entry = seg.export(0, 0).unwrap();
        let touched = AtomicU64::new(0);
        let target = AtomicU64::new(0);
        let stop = AtomicBool::new(false);
        let mut late = 0;
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let k = target.load(Ordering::Acquire);
                    if k != 0 {
                        guarded(&entry, k, || touched.store(k, Ordering::Relaxed));
                    }
                }
            });
            for k in 1..=ROUNDS {
                entry.live.store(k, Ordering::SeqCst);
                target.store(k, Ordering::Release);
                let seen = crate::sync::spin_until(Duration::from_secs(10), || {
                    touched.load(Ordering::Relaxed) == k
                });
                assert!(seen, "round {k}: the accessor never accessed");
                close_entry(&entry, pid);
                // The region's memory goes here; an access from now on would touch it.
                touched.store(0, Ordering::Relaxed);
                for _ in 0..50 {
                    std::hint::spin_loop();
                }
                if touched.load(Ordering::SeqCst) != 0 {
                    late += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert_eq!(late, 0, "accesses after the withdrawal returned");
    }

    /// Found by the `onesided` fuzz target: a peer that offers a region starting 4 bytes past an
    /// 8-byte boundary made an atomic on an aligned address land misaligned in the mapping.
    #[test]
    fn an_atomic_misaligned_by_the_peers_offer_is_refused_and_touches_nothing() {
        use crate::{Context, SendFlags};
        let ctx = Context::new().unwrap();
        let target = MemoryRegion::alloc(ctx.inner.clone(), 4096, Access::LOCAL_WRITE).unwrap();
        let local = MemoryRegion::alloc(ctx.inner.clone(), 4096, Access::LOCAL_WRITE).unwrap();
        let (seg, _fd) = Segment::create(64 * 1024).unwrap();
        let key = 0x5eedu64;
        let (slot, addr, len) = (3u32, 0x7f12_3450_0004u64, 4096u64);
        let offer = Offer {
            slot,
            key,
            addr,
            len,
            access: REMOTE_BITS,
            kind: OfferKind::Mapped,
        };
        // SAFETY: dup of the region's live memfd; the copy is ours.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::dup(target.memfd().unwrap())) };
        let imp = Import::from_offer(&offer, Some(fd)).expect("a well-formed offer");
        seg.export(0, slot as usize)
            .unwrap()
            .live
            .store(key, Ordering::SeqCst);
        let remote = crate::conn::RemoteRegion {
            addr,
            len,
            key,
            access: Access(REMOTE_BITS),
            conn_id: 1,
        };
        let add = RdmaOp::FetchAdd { add: 1 };
        // Offset 4 names the aligned address addr + 4, which is 4 bytes into the mapping.
        let wr = RdmaRequest::atomic(&ctx.inner, 1, add, &local, 0, &remote, 4, 0, SendFlags(0))
            .expect("the caller's side is well-formed");
        assert_eq!(run(&imp, &wr, &seg, 0, None), Err(Refused::Denied));
        let mut word = [0u8; 16];
        // SAFETY: the one access was refused and no other is in flight; nothing else writes
        // the region.
        unsafe { target.read(0, &mut word) }.unwrap();
        assert_eq!(word, [0; 16], "nothing touched");
        // (With the region starting 4 bytes past a boundary, no word the caller may name - an
        // aligned address - is aligned in the mapping: every atomic on it is refused.)
    }
}
