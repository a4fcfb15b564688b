//! This side's exports: exposing a region (its key, its slot, the offer), and revoking it.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::{REMOTE_BITS, REVOKE_WAIT};
use crate::conn::{ensure_up, socket_error};
use crate::error::{Error, Result};
use crate::log::log;
use crate::mr::{Access, Exposure, MemoryRegion};
use crate::shm::segment::{EXPORT_SLOTS, Export, READS_PEER_YES, Segment};
use crate::shm::socket::send_with_fds;
use crate::shm::wire::{Offer, OfferKind, Revoked, send_unwaited};

/// At most this many of a connection's export slots in use when a region is exposed only so
/// that the peer may copy large messages out of it (see [`Exports::expose_for_send`]): the
/// rest stay for the program's own regions.
const SEND_SLOTS: usize = 64;
/// Longest exposing caller memory waits for the peer to say whether it can reach it (it says
/// so as its side of the connection starts, which may come just after this side's).
const PEER_DECIDES_WAIT: Duration = Duration::from_secs(2);
/// Longest an offer waits for room in the socket's send buffer.
const OFFER_SEND_WAIT: Duration = Duration::from_secs(1);

/// A random key: 32 bits from the kernel (a key is 32 bits on both transports, see
/// `conn/remote.rs`), never 0 (0 marks a withdrawn slot).
fn random_key() -> Result<u64> {
    loop {
        let mut k = 0u32;
        // SAFETY: fills 4 bytes of a live local.
        let n = unsafe { libc::getrandom((&raw mut k).cast(), 4, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::MemoryRegion(e));
        }
        if n == 4 && k != 0 {
            return Ok(u64::from(k));
        }
    }
}

/// A fresh key for `slot`: none of the connection's live keys (the peer finds imports by key),
/// and not the key the slot last held, so that a peer's access still holding the previous
/// region's import fails the slot's `live` check instead of landing in the old mapping.
fn fresh_key(st: &ExportState, slot: usize) -> Result<u64> {
    loop {
        let k = random_key()?;
        if k != st.last_key[slot] && !st.by_mr.values().any(|&(live, _)| live == k) {
            return Ok(k);
        }
    }
}

/// The regions this side of one connection lets its peer reach.
pub(crate) struct Exports {
    seg: Arc<Segment>,
    side: usize,
    /// The peer's process, to stop waiting for a peer that has exited.
    peer_proc: libc::pid_t,
    state: Mutex<ExportState>,
}

#[derive(Default)]
struct ExportState {
    /// Region id -> (key, slot).
    by_mr: HashMap<u64, (u64, usize)>,
    /// Slots in use.
    used: Vec<bool>,
    /// The key each slot held last (0: none yet).
    last_key: Vec<u64>,
    /// The connection ended: nothing more is exposed.
    closed: bool,
    /// The connection's socket, for withdrawal notices; `None` once its teardown began (the
    /// socket closes after that).
    sock: Option<RawFd>,
}

impl Exports {
    /// The exports of the connection whose segment is `seg`, of which this is side `side`,
    /// whose peer is process `peer_proc` and whose socket is `sock` (see [`Exports::close`]).
    pub(crate) fn new(
        seg: Arc<Segment>,
        side: usize,
        peer_proc: libc::pid_t,
        sock: RawFd,
    ) -> Exports {
        Exports {
            seg,
            side,
            peer_proc,
            state: Mutex::new(ExportState {
                used: vec![false; EXPORT_SLOTS],
                last_key: vec![0; EXPORT_SLOTS],
                sock: Some(sock),
                ..Default::default()
            }),
        }
    }

    /// Whether the peer can reach this process's memory (it passed the kernel's ptrace check
    /// when its side of the connection started), waiting a bounded time for it to say.
    pub(crate) fn peer_reaches_us(&self) -> bool {
        let word = self.seg.ctrl(1 - self.side).reads_peer;
        let deadline = Instant::now() + PEER_DECIDES_WAIT;
        loop {
            // Acquire: pairs with the peer's Release of the word.
            match word.load(Ordering::Acquire) {
                0 if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(100)),
                v => return v == READS_PEER_YES,
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ExportState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets the peer reach `mr`: returns its key on this connection, offering it to the peer
    /// on `sock` the first time. `peer_reaches_us`: the peer found it may reach this process's
    /// memory (the kernel's ptrace check), which caller memory needs.
    pub(crate) fn expose(
        self: &Arc<Self>,
        sock: RawFd,
        mr: &Arc<MemoryRegion>,
        peer_reaches_us: bool,
    ) -> Result<u64> {
        let mut st = self.lock();
        ensure_up(st.closed)?;
        if let Some(&(key, _)) = st.by_mr.get(&mr.id()) {
            return Ok(key);
        }
        let access = mr.access().0 & REMOTE_BITS;
        let memfd = mr.memfd();
        if memfd.is_none() {
            if access & Access::REMOTE_ATOMIC.0 != 0 {
                return Err(Error::Unsupported(
                    "over shm, atomics need memory the peer maps: caller memory cannot have \
                     REMOTE_ATOMIC; use a region the library allocates (alloc_mr / rbr_mr_alloc)"
                        .into(),
                ));
            }
            if !peer_reaches_us {
                return Err(Error::Unsupported(
                    "over shm, the peer cannot reach caller memory of this process: the kernel \
                     does not let it (ptrace rules: another user, Yama ptrace_scope, or another \
                     PID namespace); use a region the library allocates (alloc_mr / \
                     rbr_mr_alloc), which the peer maps"
                        .into(),
                ));
            }
        }
        let Some(slot) = st.used.iter().position(|u| !u) else {
            return Err(Error::invalid(format!(
                "at most {EXPORT_SLOTS} regions may be exposed on one shm connection at once"
            )));
        };
        let key = fresh_key(&st, slot)?;
        let entry = self.seg.export(self.side, slot).expect("slot in range");
        // SeqCst: live before the offer leaves, so that the peer finds it live once it has it.
        entry.live.store(key, Ordering::SeqCst);
        let pkt = Offer {
            slot: slot as u32,
            key,
            addr: mr.as_ptr() as u64,
            len: mr.len() as u64,
            access,
            kind: if memfd.is_some() {
                OfferKind::Mapped
            } else {
                OfferKind::Process
            },
        }
        .encode();
        let sent = match memfd {
            Some(fd) => {
                let writable = access & (Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0) != 0;
                // A read-only offer carries a read-only descriptor where /proc allows one.
                let ro = if writable { None } else { reopen_read_only(fd) };
                let fd = ro.as_ref().map_or(fd, |f| f.as_raw_fd());
                send_offer(sock, &pkt, Some(fd))
            }
            None => send_offer(sock, &pkt, None),
        };
        if let Err(e) = sent {
            entry.live.store(0, Ordering::SeqCst);
            return Err(e);
        }
        st.used[slot] = true;
        st.last_key[slot] = key;
        st.by_mr.insert(mr.id(), (key, slot));
        let weak: Weak<dyn Exposure> = Arc::downgrade(self) as Weak<dyn Exposure>;
        mr.add_exposure(weak);
        Ok(key)
    }

    /// The key under which the peer may copy a large message straight out of `mr`, a region
    /// the library allocated, exposing it now if it is not yet (its offer is then in the
    /// peer's socket before the message's record can be in its ring). `None` when it cannot
    /// be - caller memory, the connection ending, [`SEND_SLOTS`] slots in use, an offer that
    /// did not go out - and the message goes another way. The exposure lasts, as any, until
    /// the region or the connection goes; the peer's process can read the whole region
    /// meanwhile (its library reads only the messages' bytes), which is why the flow asks
    /// for it only of a peer that may read this process's memory anyway (`Flow::direct_key`).
    pub(crate) fn expose_for_send(
        self: &Arc<Self>,
        sock: RawFd,
        mr: &Arc<MemoryRegion>,
    ) -> Option<u64> {
        mr.memfd()?;
        {
            let st = self.lock();
            if let Some(&(key, _)) = st.by_mr.get(&mr.id()) {
                return Some(key);
            }
            // One entry per slot in use.
            if st.by_mr.len() >= SEND_SLOTS {
                return None;
            }
        }
        self.expose(sock, mr, false).ok()
    }

    /// The connection ended: every region is withdrawn, and no access of the peer to any of
    /// them is in progress when this returns. Called before the connection's socket closes.
    pub(crate) fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.sock = None;
        let slots: Vec<usize> = st.by_mr.drain().map(|(_, (_, slot))| slot).collect();
        for slot in slots {
            self.withdraw(slot);
            st.used[slot] = false;
        }
    }

    /// Clears the slot's key, then waits until no access of the peer is in progress there.
    fn withdraw(&self, slot: usize) {
        let entry = self.seg.export(self.side, slot).expect("slot in range");
        close_entry(&entry, self.peer_proc);
    }
}

/// The owner's side of an export's protocol (see [`Export`]): clears `live`, then waits until
/// `busy` is 0 (bounded, see the module docs).
pub(super) fn close_entry(entry: &Export<'_>, peer: libc::pid_t) {
    // SeqCst: the clear comes before the read of `busy` (Dekker with `guarded`).
    entry.live.store(0, Ordering::SeqCst);
    wait_idle(entry.busy, peer);
}

impl Exposure for Exports {
    fn revoke(&self, mr_id: u64) {
        let mut st = self.lock();
        if let Some((key, slot)) = st.by_mr.remove(&mr_id) {
            self.withdraw(slot);
            st.used[slot] = false;
            if let Some(sock) = st.sock {
                let slot = slot as u32;
                // The socket is open while `sock` is set (the state's lock orders this before
                // the close).
                send_unwaited(sock, &Revoked { slot, key }.encode());
            }
        }
    }
}

impl Drop for Exports {
    fn drop(&mut self) {
        self.close();
    }
}

/// Waits until `busy` is 0; bounded (see the module docs).
fn wait_idle(busy: &AtomicU64, peer: libc::pid_t) {
    // SeqCst: pairs with the peer's raise of `busy` (Dekker), and acquires what its last
    // access did before it lowered the count.
    if busy.load(Ordering::SeqCst) == 0 {
        return;
    }
    let start = Instant::now();
    let mut pidfd: Option<OwnedFd> = None;
    let mut spins = 0u32;
    while busy.load(Ordering::SeqCst) != 0 {
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
            continue;
        }
        if peer_exited(peer, &mut pidfd) {
            return;
        }
        if start.elapsed() > REVOKE_WAIT {
            log!(
                Warn,
                "the shm peer kept an access to a withdrawn region going for {REVOKE_WAIT:?}; \
                 waiting no longer"
            );
            return;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Whether process `pid` has exited (a zombie counts: it runs no more).
fn peer_exited(pid: libc::pid_t, pidfd: &mut Option<OwnedFd>) -> bool {
    if pid <= 0 {
        return false;
    }
    if pidfd.is_none() {
        // SAFETY: pidfd_open takes a pid and flags; a non-negative result is a new descriptor.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        }
        // SAFETY: `fd` was just returned and is owned by nobody else.
        *pidfd = Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
    }
    let fd = pidfd.as_ref().expect("opened above").as_raw_fd();
    // A pidfd is readable once its process has exited.
    crate::sys::poll_one(fd, libc::POLLIN, Some(Duration::ZERO)).unwrap_or(false)
}

/// A read-only descriptor of the same file as `fd`, through /proc; `None` when /proc does not
/// give one (the peer's library then still maps the region read-only).
fn reopen_read_only(fd: RawFd) -> Option<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).ok()?;
    // SAFETY: a NUL-terminated path and valid flags; a non-negative result is a new descriptor.
    let r = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    // SAFETY: `r` is a fresh descriptor owned by nobody else.
    (r >= 0).then(|| unsafe { OwnedFd::from_raw_fd(r) })
}

/// Sends an offer packet, with `fd` attached, waiting a bounded time for room.
fn send_offer(sock: RawFd, pkt: &[u8], fd: Option<RawFd>) -> Result<()> {
    let deadline = Instant::now() + OFFER_SEND_WAIT;
    loop {
        let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
        let Err(e) = send_with_fds(sock, pkt, fd.as_slice(), flags) else {
            return Ok(());
        };
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Timeout("sending a region offer to the shm peer"));
                }
                let _ = crate::sys::poll_one(sock, libc::POLLOUT, Some(left));
            }
            _ => return Err(socket_error(e, Error::SharedMemory)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_withdrawal_waits_for_the_access_in_progress() {
        let busy = AtomicU64::new(1);
        let t = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                busy.fetch_sub(1, Ordering::Release);
            });
            wait_idle(&busy, std::process::id() as libc::pid_t);
        });
        assert_eq!(busy.load(Ordering::SeqCst), 0);
        assert!(t.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn a_withdrawal_stops_waiting_for_a_peer_that_exited() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as libc::pid_t;
        // An access the peer will never finish: it is killed in the middle of it.
        let busy = AtomicU64::new(1);
        let t = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                child.kill().unwrap();
            });
            wait_idle(&busy, pid);
        });
        let took = t.elapsed();
        // Half the bound it must not wait out: a loaded machine has seconds to spare.
        assert!(
            took < REVOKE_WAIT / 2,
            "released {took:?} after the start (the bound is {REVOKE_WAIT:?})"
        );
        child.wait().unwrap();
    }

    #[test]
    fn keys_are_random_32_bits_and_never_zero() {
        let keys: Vec<u64> = (0..64).map(|_| random_key().unwrap()).collect();
        assert!(
            keys.iter().all(|&k| k <= u64::from(u32::MAX)),
            "a key is 32 bits"
        );
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len());
        assert!(!keys.contains(&0));
        assert!(
            keys.windows(2).all(|w| w[1].wrapping_sub(w[0]) != 1),
            "not a counter"
        );
    }
}
