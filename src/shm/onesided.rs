//! One-sided operations over shm: the regions a side lets its peer reach (exports), the
//! peer's view of them (imports), and the accesses themselves.
//!
//! **Offers.** Exposing a region on a connection gives it a random 32-bit key (never a
//! counter; 32 bits as a verbs rkey, so that a program carries keys of either transport the
//! same way), unique among the connection's live keys and unlike the slot's previous one, and a
//! slot in this side's export table in the shared segment (`segment.rs`,
//! [`Export`]), stores the key in the slot's `live` word, and sends the peer an offer on the
//! connection's socket before returning: slot, key, address, length and remote access bits,
//! plus, for a region the library allocated, its memfd (SCM_RIGHTS; a read-only descriptor when
//! the offer grants no write or atomic access). The packet is in the peer's socket before the
//! descriptor the program sends can arrive there.
//!
//! **Imports.** The peer reads offers from the socket - its connection's background work does,
//! and so does a post that names a key it does not know yet (one reader at a time) - maps a
//! received memfd shared (read-only unless the offer grants write or atomic access), and keeps
//! key -> (mapping, slot, address, length, access). Caller memory comes without a descriptor
//! and is reached with `process_vm_writev`/`process_vm_readv`.
//!
//! **Accesses** run on the poster's thread. Each one is checked against the import (key,
//! range, access; the length of a mapping was checked against the memfd's size when it was
//! mapped), then claims the slot's `busy` word, checks that `live` still holds the key, copies
//! or runs the atomic instruction on the mapping (no system call), and lowers `busy`. A check
//! that fails touches nothing: the operation completes with
//! [`WcStatus::RemoteAccess`](crate::WcStatus::RemoteAccess) and the connection fails. The
//! common unsignaled write into a mapped region takes no lock of the connection's
//! (`shortcut.rs`).
//!
//! **Revocation** is synchronous: when a region is dropped, each connection it was exposed on
//! clears the slot's `live` word and then waits until `busy` is 0 (see [`Export`] for why the
//! two cannot miss each other), before the region's memory goes. The wait is bounded: it ends
//! at once when the peer's process has exited, and after [`REVOKE_WAIT`] in any case (a peer
//! that holds `busy` up that long is not following the protocol). A connection that ends
//! withdraws all its regions the same way. After a withdrawal the owner also sends the peer a
//! notice on the socket, so that it unmaps the region at once rather than at its next access
//! or the connection's end.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::conn::{LocalSeg, RdmaOp, RdmaRequest};
use crate::error::{Error, Result};
use crate::log::log;
use crate::mr::{Access, Exposure, MemoryRegion};
use crate::shm::flow::{BYE, WAKE};
use crate::shm::segment::{EXPORT_SLOTS, Export, READS_PEER_YES, Segment};
use crate::shm::shortcut::{Published, Shortcut};
use crate::sys::cvt;

/// Offer packet: a region the sender lets its peer reach.
pub(crate) const OFFER: u8 = 3;
/// Withdrawal notice: the region in a slot is gone, and the peer may unmap it. Only a hint
/// for the peer's housekeeping (what stops accesses is the export table, see [`Export`]).
pub(crate) const REVOKED: u8 = 4;
/// Bytes of a withdrawal notice: type, 3 zero bytes, slot (u32), key (u64).
const REVOKED_LEN: usize = 16;
/// Bytes of an offer packet.
const OFFER_LEN: usize = 40;
/// Offer kinds: caller memory (reached through the kernel), or a memfd that comes along.
const KIND_PROCESS: u32 = 0;
const KIND_MAPPED: u32 = 1;
/// At most this many of a connection's export slots in use when a region is exposed only so
/// that the peer may copy large messages out of it (see [`Exports::expose_for_send`]): the
/// rest stay for the program's own regions.
const SEND_SLOTS: usize = 64;
/// Longest a revocation waits for the peer's accesses in progress.
pub(crate) const REVOKE_WAIT: Duration = Duration::from_secs(10);
/// Longest exposing caller memory waits for the peer to say whether it can reach it (it says
/// so as its side of the connection starts, which may come just after this side's).
const PEER_DECIDES_WAIT: Duration = Duration::from_secs(2);
/// Longest an offer waits for room in the socket's send buffer.
const OFFER_SEND_WAIT: Duration = Duration::from_secs(1);

const REMOTE_BITS: u32 = Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0;

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
        if st.closed {
            return Err(Error::Disconnected);
        }
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
        let mut pkt = [0u8; OFFER_LEN];
        pkt[0] = OFFER;
        pkt[4..8].copy_from_slice(&(slot as u32).to_le_bytes());
        pkt[8..16].copy_from_slice(&key.to_le_bytes());
        pkt[16..24].copy_from_slice(&(mr.as_ptr() as u64).to_le_bytes());
        pkt[24..32].copy_from_slice(&(mr.len() as u64).to_le_bytes());
        pkt[32..36].copy_from_slice(&access.to_le_bytes());
        let kind = if memfd.is_some() {
            KIND_MAPPED
        } else {
            KIND_PROCESS
        };
        pkt[36..40].copy_from_slice(&kind.to_le_bytes());
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
fn close_entry(entry: &Export<'_>, peer: libc::pid_t) {
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
                let mut pkt = [0u8; REVOKED_LEN];
                pkt[0] = REVOKED;
                pkt[4..8].copy_from_slice(&(slot as u32).to_le_bytes());
                pkt[8..16].copy_from_slice(&key.to_le_bytes());
                // SAFETY: sends a live local buffer of its length on the connection's socket,
                // open while `sock` is set (the state's lock orders this before the close).
                // Not waiting: a full socket only delays the peer's unmapping to its next
                // access or the connection's end; MSG_NOSIGNAL turns a gone peer into EPIPE.
                unsafe {
                    libc::send(
                        sock,
                        pkt.as_ptr().cast(),
                        pkt.len(),
                        libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                    )
                };
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
    let mut iov = libc::iovec {
        iov_base: pkt.as_ptr() as *mut _,
        iov_len: pkt.len(),
    };
    let mut cbuf = [0u64; 4];
    // SAFETY: msghdr is plain data; zero is a valid "no name, no control" value.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    if let Some(fd) = fd {
        let bytes = std::mem::size_of::<RawFd>() as u32;
        mh.msg_control = cbuf.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is a pure size computation; one int fits the 32-byte buffer.
        mh.msg_controllen = unsafe { libc::CMSG_SPACE(bytes) } as usize;
        // SAFETY: the control buffer holds one header carrying one descriptor, so
        // CMSG_FIRSTHDR is non-null and CMSG_DATA points inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
            libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(fd);
        }
    }
    let deadline = Instant::now() + OFFER_SEND_WAIT;
    loop {
        // SAFETY: `mh` points at live locals (iov, pkt, cbuf) for the duration of the call.
        let n = unsafe { libc::sendmsg(sock, &mh, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Timeout("sending a region offer to the shm peer"));
                }
                let _ = crate::sys::poll_one(sock, libc::POLLOUT, Some(left));
            }
            _ if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => {
                return Err(Error::Disconnected);
            }
            _ => return Err(Error::SharedMemory(e)),
        }
    }
}

/// Where an imported region is.
enum Target {
    /// Mapped into this process (a memfd): `len` bytes at `base`.
    Mapped { base: NonNull<u8>, len: usize },
    /// In the peer's process, reached with process_vm_writev/readv.
    Process,
}

/// A region of the peer's that this side may reach, as the peer offered it.
pub(crate) struct Import {
    key: u64,
    slot: usize,
    addr: u64,
    len: u64,
    access: u32,
    target: Target,
    /// The connection's lock-free write path, once this import was published there: its
    /// mapping then retires there (see `shortcut.rs`).
    shortcut: OnceLock<Arc<Shortcut>>,
}

// SAFETY: the mapping is process-wide memory; an import only hands out bounds-checked accesses
// to it, and unmaps it only when dropped (when no access can hold it any more).
unsafe impl Send for Import {}
// SAFETY: as above.
unsafe impl Sync for Import {}

impl Drop for Import {
    fn drop(&mut self) {
        if let Target::Mapped { base, len } = self.target {
            match self.shortcut.get() {
                Some(s) => s.retire(self.slot, base, len),
                // SAFETY: base/len are what mmap returned in `Import::map`; the last holder is
                // gone, and the lock-free write path never reached it.
                None => unsafe {
                    libc::munmap(base.as_ptr().cast(), len);
                },
            }
        }
    }
}

impl Import {
    /// Parses an offer packet (and its descriptor); `None` when it is not a valid one (its
    /// key then stays unknown, and accesses with it fail).
    fn from_offer(pkt: &[u8], fd: Option<OwnedFd>) -> Option<Import> {
        if pkt.len() != OFFER_LEN {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(pkt[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(pkt[i..i + 8].try_into().expect("8 bytes"));
        let (slot, key, addr, len) = (u32_at(4) as usize, u64_at(8), u64_at(16), u64_at(24));
        let (access, kind) = (u32_at(32), u32_at(36));
        if slot >= EXPORT_SLOTS
            || key == 0
            || len == 0
            || access & !REMOTE_BITS != 0
            || addr.checked_add(len).is_none()
        {
            return None;
        }
        let target = match (kind, fd) {
            (KIND_PROCESS, None) => {
                if access & Access::REMOTE_ATOMIC.0 != 0 {
                    return None;
                }
                Target::Process
            }
            (KIND_MAPPED, Some(fd)) => {
                let writable = access & (Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0) != 0;
                Self::map(&fd, len, writable)?
            }
            _ => return None,
        };
        Some(Import {
            key,
            slot,
            addr,
            len,
            access,
            target,
            shortcut: OnceLock::new(),
        })
    }

    /// Publishes this import on the connection's lock-free write path `s` when it is a
    /// writable region mapped here. The caller holds the connection's import cache lock (see
    /// [`Shortcut::publish`]).
    pub(crate) fn publish(&self, s: &Arc<Shortcut>) {
        let Target::Mapped { base, .. } = self.target else {
            return;
        };
        if self.access & Access::REMOTE_WRITE.0 == 0 {
            return;
        }
        // First: from here on the mapping retires through `s` when this import goes.
        self.shortcut.get_or_init(|| s.clone());
        s.publish(Published {
            key: self.key,
            slot: self.slot,
            addr: self.addr,
            len: self.len,
            base,
        });
    }

    /// Maps `len` bytes of the peer's memfd, checking that the file holds them and cannot
    /// shrink under the mapping.
    fn map(fd: &OwnedFd, len: u64, writable: bool) -> Option<Target> {
        let len = usize::try_from(len).ok()?;
        // SAFETY: plain syscall on a descriptor we own.
        let seals = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }).ok()?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return None;
        }
        // SAFETY: `st` is a live local that fstat fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }).ok()?;
        if usize::try_from(st.st_size).ok()? < len {
            return None;
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping chosen by the kernel; nothing is overwritten. The file holds
        // `len` bytes and is sealed against shrinking, so the mapping never faults.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(Target::Mapped {
            base: NonNull::new(p.cast())?,
            len,
        })
    }

    /// Where an access needing the rights `need` to `len` bytes at the peer's address `addr`
    /// starts in the region, when the region allows it and holds every byte of it.
    #[inline(always)]
    fn reach(&self, need: u32, addr: u64, len: usize) -> Option<usize> {
        if self.access & need != need {
            return None;
        }
        self.offset(addr, len)
    }

    /// Where `len` bytes at the peer's address `addr` start in the region, when they all lie
    /// inside it.
    fn offset(&self, addr: u64, len: usize) -> Option<usize> {
        offset_in(self.addr, self.len, addr, len)
    }
}

/// Where `len` bytes at the peer's address `addr` start in a region of `size` bytes at the
/// peer's address `start`, when they all lie inside it.
#[inline(always)]
pub(crate) fn offset_in(start: u64, size: u64, addr: u64, len: usize) -> Option<usize> {
    let off = addr.checked_sub(start)?;
    let end = off.checked_add(len as u64)?;
    (end <= size).then_some(off as usize)
}

/// This side's reader of the connection's socket, and the regions of the peer it knows.
/// Whoever reads the socket holds it (one reader at a time).
#[derive(Default)]
pub(crate) struct Inbox {
    /// The peer said goodbye.
    pub(crate) said_bye: bool,
    /// The socket reached its end (`broken`: with an error): the peer is gone.
    pub(crate) eof: bool,
    pub(crate) broken: bool,
    imports: HashMap<u64, Arc<Import>>,
    /// Counts the imports forgotten (withdrawn, replaced, or all at the end), so that a
    /// poster's cached import (see [`ImportCache`]) can tell, without this lock, that it may
    /// be stale.
    forgotten: Arc<AtomicU64>,
}

/// The import a connection's last one-sided operation used, kept under its own lock (which
/// pollers never take, see `conn::Shared::imports`) so that the next operation with the same
/// key skips the flow's lock, the inbox's lock, its map and a reference count. Only a cache:
/// every access still checks the key against the peer's export table (`run`), so a stale entry
/// cannot reach a withdrawn region; it is dropped as soon as the inbox forgets anything, so
/// that the mapping goes with the region. Whoever holds it publishes the import it reaches on
/// the connection's lock-free write path (`shortcut.rs`).
#[derive(Default)]
pub(crate) struct ImportCache {
    entry: Option<(u64, Arc<Import>)>,
}

impl ImportCache {
    /// The cached import for `key`, if the inbox forgot nothing since it was taken (`seen`: the
    /// inbox's count now).
    pub(crate) fn get(&self, key: u64, seen: u64) -> Option<&Import> {
        match &self.entry {
            Some((g, imp)) if *g == seen && imp.key == key => Some(imp),
            _ => None,
        }
    }

    /// Caches `imp` (or nothing), taken from the inbox when its count was `seen`.
    pub(crate) fn set(&mut self, seen: u64, imp: Option<Arc<Import>>) {
        self.entry = imp.map(|i| (seen, i));
    }

    /// Drops the entry if the inbox forgot anything since it was taken.
    pub(crate) fn drop_stale(&mut self, seen: u64) {
        if self.entry.as_ref().is_some_and(|(g, _)| *g != seen) {
            self.entry = None;
        }
    }
}

impl Inbox {
    /// Reads every packet the socket holds: doorbells, goodbye, offers (mapped and recorded),
    /// the end. Returns whether a doorbell or goodbye was among them.
    pub(crate) fn drain(&mut self, sock: RawFd) -> bool {
        let mut news = false;
        let mut buf = [0u8; 64];
        let mut cbuf = [0u64; 4];
        while !self.eof {
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            // SAFETY: msghdr is plain data; zero is a valid starting value.
            let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
            mh.msg_iov = &mut iov;
            mh.msg_iovlen = 1;
            mh.msg_control = cbuf.as_mut_ptr().cast();
            mh.msg_controllen = std::mem::size_of_val(&cbuf);
            // SAFETY: `mh` points at live local buffers of the sizes it states.
            let n = unsafe {
                libc::recvmsg(sock, &mut mh, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC)
            };
            // Every descriptor that came is owned (and closed unless used) before anything else.
            let mut fds = Vec::new();
            if n >= 0 && mh.msg_controllen > 0 {
                // SAFETY: walking the control messages the kernel wrote into `cbuf`.
                unsafe {
                    let mut c = libc::CMSG_FIRSTHDR(&mh);
                    while !c.is_null() {
                        if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS
                        {
                            let data = libc::CMSG_DATA(c).cast::<RawFd>();
                            let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize)
                                / std::mem::size_of::<RawFd>();
                            for i in 0..count {
                                fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                            }
                        }
                        c = libc::CMSG_NXTHDR(&mh, c);
                    }
                }
            }
            match n {
                0 => self.eof = true,
                n if n > 0 => {
                    let pkt = &buf[..n as usize];
                    match pkt[0] {
                        WAKE => news = true,
                        BYE => {
                            news = true;
                            self.said_bye = true;
                        }
                        OFFER if fds.len() <= 1 && mh.msg_flags & libc::MSG_TRUNC == 0 => {
                            if let Some(imp) = Import::from_offer(pkt, fds.pop()) {
                                // A slot offered again carries a new region: the old one is gone.
                                let had = self.imports.len();
                                self.imports.retain(|_, i| i.slot != imp.slot);
                                if self.imports.len() != had {
                                    self.note_forgotten();
                                }
                                self.imports.insert(imp.key, Arc::new(imp));
                            }
                        }
                        REVOKED if pkt.len() == REVOKED_LEN => {
                            let slot = u32::from_le_bytes(pkt[4..8].try_into().expect("4"));
                            let key = u64::from_le_bytes(pkt[8..16].try_into().expect("8"));
                            if self
                                .imports
                                .get(&key)
                                .is_some_and(|i| i.slot == slot as usize)
                            {
                                self.imports.remove(&key);
                                self.note_forgotten();
                            }
                        }
                        // Anything else is not ours to understand; its descriptors close.
                        _ => {}
                    }
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::WouldBlock => break,
                        io::ErrorKind::Interrupted => {}
                        // A peer that closes with doorbells of ours still unread makes the
                        // kernel report a reset before the packets it sent first - its goodbye
                        // among them. The report is consumed by reading it: read on, and the
                        // goodbye (if it said one) and the end of file follow.
                        io::ErrorKind::ConnectionReset => {}
                        _ => {
                            self.eof = true;
                            self.broken = true;
                        }
                    }
                }
            }
        }
        news
    }

    /// The import with `key`, if the peer offered it.
    pub(crate) fn get(&self, key: u64) -> Option<Arc<Import>> {
        self.imports.get(&key).cloned()
    }

    /// As [`Inbox::get`], reading the socket first when the key is not known yet: its offer
    /// may still be there. The flag is [`Inbox::drain`]'s: doorbells or a goodbye were read,
    /// which are the background work's.
    pub(crate) fn find(&mut self, key: u64, sock: RawFd) -> (Option<Arc<Import>>, bool) {
        if let Some(i) = self.get(key) {
            return (Some(i), false);
        }
        let news = self.drain(sock);
        (self.get(key), news)
    }

    /// Forgets the import with `key` (the peer withdrew it); its mapping goes with its last
    /// holder.
    pub(crate) fn forget(&mut self, key: u64) {
        if self.imports.remove(&key).is_some() {
            self.note_forgotten();
        }
    }

    /// Forgets every import (the connection ended).
    pub(crate) fn clear(&mut self) {
        self.imports.clear();
        self.note_forgotten();
    }

    /// The count of forgetting, shared with the connection's posters (see [`ImportCache`]).
    pub(crate) fn forgotten(&self) -> Arc<AtomicU64> {
        self.forgotten.clone()
    }

    fn note_forgotten(&self) {
        // Release: the map's change comes before the count a poster compares (a poster that
        // misses the change still has its access refused by the export table's key).
        self.forgotten.fetch_add(1, Ordering::Release);
    }
}

/// Why an access did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The key, range or access right is not what the peer registered: nothing was touched.
    Denied,
    /// The peer withdrew the region: nothing was touched.
    Withdrawn,
}

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
        unsafe { copy(base.as_ptr().add(off).cast_const(), dst, len) }
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
                    copy(s.ptr.cast_const(), pos, s.len);
                    pos = pos.add(s.len);
                }
            }
        }
        RdmaOp::Read => {
            for s in wr.segs() {
                // SAFETY: as for writes; `s.ptr` is writable (LOCAL_WRITE, checked).
                unsafe {
                    copy(pos.cast_const(), s.ptr, s.len);
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

/// Copies `len` bytes: a word of 8 or 4 bytes (the size of a flag or a counter, whose
/// latency counts) as one load and one store, anything else as a message's bytes are copied
/// ([`crate::shm::copy::copy`]: inline up to 64 bytes, `memcpy` beyond).
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
#[inline(always)]
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract; unaligned accesses of exactly `len` bytes.
    unsafe {
        match len {
            8 => dst
                .cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned()),
            4 => dst
                .cast::<u32>()
                .write_unaligned(src.cast::<u32>().read_unaligned()),
            _ => crate::shm::copy::copy(src, dst, len),
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
        let mut pkt = vec![OFFER, 0, 0, 0];
        pkt.extend(slot.to_le_bytes());
        pkt.extend(key.to_le_bytes());
        pkt.extend(addr.to_le_bytes());
        pkt.extend(len.to_le_bytes());
        pkt.extend(REMOTE_BITS.to_le_bytes());
        pkt.extend(KIND_MAPPED.to_le_bytes());
        // SAFETY: dup of the region's live memfd; the copy is ours.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::dup(target.memfd().unwrap())) };
        let imp = Import::from_offer(&pkt, Some(fd)).expect("a well-formed offer");
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
