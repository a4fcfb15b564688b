//! The queue's handed-out descriptor with caller progress: an epoll set of the queue's eventfd
//! (records the library queues itself: disconnects, flushes, work its threads moved) and the
//! queue's bell, a Unix datagram socket in the abstract namespace that shm peers ring when
//! this side sleeps (UCX's `ucp_worker_get_efd` is the same shape: an epoll set of the
//! transports' own wake-up descriptors). A peer finds the bell's name on the queue's notice
//! board (`notice.rs`), so ringing it costs the peer one `sendto` and wakes the caller's
//! `epoll_wait` directly, with no library thread in between.
//!
//! Arming (`CompletionQueue::arm_bell`) happens in the poll that finds the queue empty, as
//! `fi_trywait` or `ucp_worker_arm` would be called before a sleep: it drains the bell, asks
//! the peers to ring it, and looks once more; a peer that writes after that rings, one that
//! wrote before is found by that look (Dekker with the peer's `Flow::notify_peer`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sys::cvt;

/// A word of the notice board (the `loom` checks in `ready.rs` put in their own).
pub(crate) trait Word {
    /// As [`std::sync::atomic::AtomicU64::load`].
    fn load(&self, order: Ordering) -> u64;
    /// As [`std::sync::atomic::AtomicU64::store`].
    fn store(&self, v: u64, order: Ordering);
    /// As [`std::sync::atomic::AtomicU64::compare_exchange`], reporting only success.
    fn cas(&self, current: u64, new: u64) -> bool;
    /// As [`std::sync::atomic::fence`], of the memory model this word lives in.
    fn fence(order: Ordering);
}

impl Word for std::sync::atomic::AtomicU64 {
    #[inline(always)]
    fn load(&self, order: Ordering) -> u64 {
        std::sync::atomic::AtomicU64::load(self, order)
    }

    #[inline(always)]
    fn store(&self, v: u64, order: Ordering) {
        std::sync::atomic::AtomicU64::store(self, v, order)
    }

    #[inline(always)]
    fn cas(&self, current: u64, new: u64) -> bool {
        self.compare_exchange(current, new, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    #[inline(always)]
    fn fence(order: Ordering) {
        std::sync::atomic::fence(order)
    }
}

/// The poller's side of the sleep announcement (see `notice.rs`): raises `sleeper`, then
/// tells whether `marks` (the board's summary) shows news, in which case the poller polls
/// again rather than sleeping.
#[inline]
pub(crate) fn announce_sleep<W: Word>(sleeper: &W, marks: &W) -> bool {
    sleeper.store(1, Ordering::SeqCst);
    // SeqCst fence: the store above comes before the look at the marks, pairing with the
    // marker's SeqCst mark before its look at the word (`take_sleeper`).
    W::fence(Ordering::SeqCst);
    marks.load(Ordering::SeqCst) != 0
}

/// The marker's side, after its SeqCst mark: whether a poller announced its sleep, taking the
/// announcement down (so that one ring serves it): if so, the caller rings the bell.
#[inline]
pub(crate) fn take_sleeper<W: Word>(sleeper: &W) -> bool {
    sleeper.load(Ordering::SeqCst) == 1 && sleeper.cas(1, 0)
}

/// What every bell's name starts with (after the abstract namespace's NUL): a peer rings
/// nothing else, whatever a hostile board says.
pub(crate) const PREFIX: &[u8] = b"\0rdmabridge-bell-";
/// Longest name (`sun_path`'s size).
pub(crate) const NAME_MAX: usize = 108;

/// The descriptor handed out, and the bell in it.
#[derive(Debug)]
pub(crate) struct QueueFd {
    epoll: OwnedFd,
    bell: OwnedFd,
    name: Vec<u8>,
}

impl QueueFd {
    /// An epoll set of `eventfd` and a new bell.
    pub(crate) fn new(eventfd: RawFd) -> std::io::Result<QueueFd> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // SAFETY: plain syscalls; each non-negative return is a new descriptor we own.
        let (epoll, bell) = unsafe {
            let e = cvt(libc::epoll_create1(libc::EPOLL_CLOEXEC))?;
            let e = OwnedFd::from_raw_fd(e);
            let b = cvt(libc::socket(
                libc::AF_UNIX,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
            ))?;
            (e, OwnedFd::from_raw_fd(b))
        };
        // Relaxed: only unique within the process; the pid makes it unique on the host.
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // SAFETY: getpid cannot fail.
        let pid = unsafe { libc::getpid() };
        let mut name = PREFIX.to_vec();
        name.extend_from_slice(format!("{pid}-{n}").as_bytes());
        let (addr, len) = sockaddr(&name).expect("a short name");
        // SAFETY: `addr` is a live sockaddr_un of `len` bytes.
        cvt(unsafe { libc::bind(bell.as_raw_fd(), (&raw const addr).cast(), len) })?;
        let q = QueueFd { epoll, bell, name };
        // The process's ringing socket is made with its first queue descriptor, not on the
        // first ring: over verbs that ring comes from the driver's thread, on a rare race.
        let _ = sender();
        q.watch(eventfd)?;
        q.watch(q.bell.as_raw_fd())?;
        Ok(q)
    }

    /// Adds a wake-up descriptor to the set: the queue's own two, and a transport's (a verbs
    /// device CQ's completion channel). Already there is no error.
    pub(crate) fn watch(&self, fd: RawFd) -> std::io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: `ev` is a live local; a bad `fd` is an error, not undefined behaviour.
        match cvt(unsafe { libc::epoll_ctl(self.raw(), libc::EPOLL_CTL_ADD, fd, &mut ev) }) {
            Err(e) if e.raw_os_error() != Some(libc::EEXIST) => Err(e),
            _ => Ok(()),
        }
    }

    /// Takes a descriptor added by [`watch`](Self::watch) out of the set, before it closes.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn unwatch(&self, fd: RawFd) {
        // SAFETY: no event is read for EPOLL_CTL_DEL; an fd not in the set is an error, ignored.
        let _ =
            unsafe { libc::epoll_ctl(self.raw(), libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }

    /// The epoll set: what the queue hands out.
    pub(crate) fn raw(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// The bell's name, for the notice board.
    pub(crate) fn name(&self) -> &[u8] {
        &self.name
    }

    /// Takes the rings waiting on the bell (up to 16 at a time, one system call: there is
    /// rarely more than one), so that a level-triggered waiter does not wake again for them.
    pub(crate) fn drain(&self) {
        const N: usize = 16;
        let mut bytes = [[0u8; 1]; N];
        // SAFETY: plain old data; all zeroes is a valid value of each.
        let mut iov: [libc::iovec; N] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut msgs: [libc::mmsghdr; N] = unsafe { std::mem::zeroed() };
        for ((m, v), b) in msgs.iter_mut().zip(iov.iter_mut()).zip(bytes.iter_mut()) {
            v.iov_base = b.as_mut_ptr().cast();
            v.iov_len = 1;
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
        }
        loop {
            // SAFETY: `msgs` holds N live headers, each pointing at a live iovec of one live
            // byte; the socket is ours.
            let n = unsafe {
                libc::recvmmsg(
                    self.bell.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    N as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if n < N as libc::c_int {
                return;
            }
        }
    }

    /// Rings this queue's own bell (a poll that could not arm, or news that came by a
    /// connection's socket instead).
    pub(crate) fn ring(&self) {
        ring(&self.name);
    }
}

/// A Unix address for an abstract `name` (starting with its NUL), and its length; `None` if
/// it does not fit.
fn sockaddr(name: &[u8]) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if name.len() > addr.sun_path.len() {
        return None;
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + name.len();
    Some((addr, len as libc::socklen_t))
}

/// The process's one socket for ringing bells (unbound: ringing needs no address of its own),
/// made with the first peer's board this process opens ([`super::notice::Board::open`]) or its
/// first queue descriptor ([`QueueFd::new`]), so that it is there before the first ring rather
/// than made in the middle of traffic.
pub(crate) fn sender() -> Option<&'static OwnedFd> {
    static SENDER: OnceLock<Option<OwnedFd>> = OnceLock::new();
    SENDER
        .get_or_init(|| {
            // SAFETY: plain syscall; a non-negative return is a new descriptor we own.
            let fd = unsafe {
                libc::socket(
                    libc::AF_UNIX,
                    libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                    0,
                )
            };
            // SAFETY: as above.
            (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
        })
        .as_ref()
}

/// Rings the bell named `name` (as a board gives it: checked here). Returns false when it could
/// not be rung (another network namespace, the bell closed): the caller rings another way.
/// A full bell counts as rung: it is readable already.
pub(crate) fn ring(name: &[u8]) -> bool {
    if !name.starts_with(PREFIX) {
        return false;
    }
    let Some((addr, len)) = sockaddr(name) else {
        return false;
    };
    let Some(sender) = sender() else {
        return false;
    };
    let byte = 1u8;
    // SAFETY: `byte` and `addr` are live locals of the lengths passed.
    let n = unsafe {
        libc::sendto(
            sender.as_raw_fd(),
            (&raw const byte).cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            (&raw const addr).cast(),
            len,
        )
    };
    n == 1 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::EventFd;

    fn readable(fd: RawFd) -> bool {
        crate::sys::poll_one(fd, libc::POLLIN, Some(std::time::Duration::ZERO)).unwrap()
    }

    #[test]
    fn the_set_is_readable_while_either_member_is() {
        let ev = EventFd::new().unwrap();
        let q = QueueFd::new(ev.raw()).unwrap();
        assert!(!readable(q.raw()));
        q.ring();
        assert!(readable(q.raw()));
        q.drain();
        assert!(!readable(q.raw()));
        ev.signal();
        assert!(readable(q.raw()));
        ev.clear();
        assert!(!readable(q.raw()));
    }

    #[test]
    fn only_names_of_bells_are_rung() {
        let ev = EventFd::new().unwrap();
        let q = QueueFd::new(ev.raw()).unwrap();
        assert!(ring(q.name()));
        assert!(!ring(b"\0somebody-else"));
        assert!(!ring(&[b'x'; 200]));
        let mut gone = q.name().to_vec();
        drop(q);
        assert!(!ring(&gone), "a closed bell is not rung");
        gone.extend_from_slice(&[b'x'; NAME_MAX]);
        assert!(!ring(&gone), "too long");
    }
}
