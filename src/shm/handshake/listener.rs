//! The listening side: the listening socket, its clients whose hello has not arrived yet, and
//! the epoll set over them that is the listener's descriptor.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Request;
use crate::conn::ConnRequest;
use crate::conn::seam::ListenerSeam;
use crate::cq::notice::NO_SLOT;
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::shm::socket::{address, my_uid, peer_cred, recv_msg, send_msg, socket};
use crate::shm::wire::{
    HelloVerdict, REJECT_PERMISSION, REJECT_VERSION, VERSION, decode, encode, judge_hello,
};
use crate::sys::{self, cvt};

/// How long the listener waits for a connected client's hello before dropping it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// Most accepted sockets whose hello has not arrived yet; beyond that, further connections wait
/// in the kernel's backlog until some of these are answered or time out.
const PENDING_MAX: usize = 1024;

/// Ready descriptors of the listener's set that one look takes.
const STEP_BATCH: usize = 64;
/// The epoll tag of the listening socket itself (pending sockets are tagged with their fd).
const LISTEN_TAG: u64 = u64::MAX;
/// The epoll tag of the timer that fires when the oldest pending hello is overdue.
const TIMER_TAG: u64 = u64::MAX - 1;

/// A connected client whose hello has not fully arrived yet.
#[derive(Debug)]
struct Pending {
    sock: OwnedFd,
    since: Instant,
}

/// A listening shm endpoint.
///
/// Its descriptor is an epoll set of the listening socket, of every accepted socket whose
/// hello has not arrived yet, and of a timer, so it is readable exactly while a call may make
/// progress: a client that connects and says nothing never makes it readable until its
/// [`HELLO_TIMEOUT`] is up, when the timer does and the next call drops it. Taking a request
/// never waits for a half-arrived hello and never loses one: accepted sockets stay pending
/// across calls until their hello is complete. With [`PENDING_MAX`] clients pending, the
/// listening socket leaves the set until one of them is answered or dropped, so a flood of
/// silent clients cannot keep the descriptor readable.
#[derive(Debug)]
pub(crate) struct Listener {
    sock: OwnedFd,
    epoll: OwnedFd,
    timer: OwnedFd,
    pending: Mutex<PendingSet>,
    ctx: Arc<ContextInner>,
}

#[derive(Debug)]
struct PendingSet {
    clients: Vec<Pending>,
    /// Whether the listening socket is in the epoll set (it leaves it while the set is full).
    listening: bool,
    /// When the timer was last set to fire (`None`: disarmed), so that a round that changes
    /// nothing makes no system call for it.
    armed: Option<Instant>,
}

fn epoll_ctl(epoll: RawFd, op: libc::c_int, fd: RawFd, tag: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: tag,
    };
    // SAFETY: plain syscall on descriptors we own; `ev` is a live local.
    cvt(unsafe { libc::epoll_ctl(epoll, op, fd, &mut ev) }).map(drop)
}

impl Listener {
    pub(crate) fn bind(ctx: Arc<ContextInner>, name: &str, backlog: u32) -> Result<Listener> {
        let sock = socket().map_err(Error::Listen)?;
        let (sa, len) = address(name);
        // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
        if let Err(e) = cvt(unsafe { libc::bind(sock.as_raw_fd(), (&raw const sa).cast(), len) }) {
            return Err(if e.raw_os_error() == Some(libc::EADDRINUSE) {
                Error::AddrInUse(format!("shm://{name}"))
            } else {
                Error::Listen(e)
            });
        }
        let backlog = backlog.clamp(1, libc::SOMAXCONN as u32) as libc::c_int;
        // SAFETY: plain syscall on our socket.
        cvt(unsafe { libc::listen(sock.as_raw_fd(), backlog) }).map_err(Error::Listen)?;
        // SAFETY: plain syscall; a non-negative result is a new descriptor we own.
        let epoll =
            cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }).map_err(Error::Listen)?;
        // SAFETY: fresh descriptor owned by nobody else.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        epoll_ctl(
            epoll.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            sock.as_raw_fd(),
            LISTEN_TAG,
        )
        .map_err(Error::Listen)?;
        // SAFETY: plain syscall; a non-negative result is a new descriptor we own.
        let timer = cvt(unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        })
        .map_err(Error::Listen)?;
        // SAFETY: fresh descriptor owned by nobody else.
        let timer = unsafe { OwnedFd::from_raw_fd(timer) };
        epoll_ctl(
            epoll.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            timer.as_raw_fd(),
            TIMER_TAG,
        )
        .map_err(Error::Listen)?;
        Ok(Listener {
            sock,
            epoll,
            timer,
            pending: Mutex::new(PendingSet {
                clients: Vec::new(),
                listening: true,
                armed: None,
            }),
            ctx,
        })
    }

    /// Takes the next complete request, waiting until `deadline` (`None` = forever, a past
    /// deadline = do not wait). `Ok(None)` when none is complete by then.
    pub(crate) fn get_request(&self, deadline: Option<Instant>) -> Result<Option<Request>> {
        loop {
            let next_expiry = {
                let mut set = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                let found = self.step(&mut set.clients)?;
                self.update(&mut set)?;
                if let Some(req) = found {
                    return Ok(Some(req));
                }
                set.clients.iter().map(|p| p.since + HELLO_TIMEOUT).min()
            };
            let now = Instant::now();
            if deadline.is_some_and(|d| d <= now) {
                return Ok(None);
            }
            // Sleep until something is readable, the deadline, or the oldest pending hello
            // expires (so a silent client is dropped even if nothing else happens).
            let wake = match (deadline, next_expiry) {
                (Some(d), Some(e)) => Some(d.min(e)),
                (d, e) => d.or(e),
            };
            sys::poll_one(self.fd(), libc::POLLIN, sys::remaining(wake)).map_err(Error::Accept)?;
        }
    }

    /// One round without waiting: accepts what the backlog holds, reads the hellos that have
    /// arrived, drops clients whose hello is overdue. Returns the first complete request.
    /// Without one, it has looked at everything that was ready: an edge-triggered waiter on
    /// the listener's descriptor that calls until nothing comes may then sleep, since
    /// whatever happens next makes a new edge.
    fn step(&self, pending: &mut Vec<Pending>) -> Result<Option<Request>> {
        // Enough batches to see every descriptor of the set (the listening socket, the timer
        // and every pending client) once ready ones rotate to the back.
        for _ in 0..(PENDING_MAX + 2).div_ceil(STEP_BATCH) + 1 {
            let (found, full) = self.step_batch(pending)?;
            if found.is_some() || !full {
                return Ok(found);
            }
        }
        Ok(None)
    }

    /// A round of [`step`](Self::step) over at most [`STEP_BATCH`] ready descriptors; also
    /// says whether the batch was full (more may be ready).
    fn step_batch(&self, pending: &mut Vec<Pending>) -> Result<(Option<Request>, bool)> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; STEP_BATCH];
        // SAFETY: `events` is a live local array of the length passed; timeout 0 never blocks.
        let n = unsafe {
            libc::epoll_wait(
                self.fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                0,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(Error::Accept(e));
            }
        }
        let ready: Vec<u64> = events[..n.max(0) as usize].iter().map(|e| e.u64).collect();
        let mut found = None;
        // A failed accept (out of descriptors) is reported only when no request was found:
        // the clients already pending are still served.
        let mut accept_failed = None;
        for tag in ready {
            if tag == LISTEN_TAG {
                if found.is_some() {
                    // Level-triggered: the backlog is reported again on the next call.
                    continue;
                }
                match self.accept_backlog(pending) {
                    Ok(request) => found = request,
                    Err(e) => accept_failed = Some(e),
                }
                continue;
            }
            if tag == TIMER_TAG {
                // Fired: read it so it stops being readable; the overdue are dropped below.
                let mut ticks = 0u64;
                // SAFETY: reads 8 bytes into a live local from our non-blocking timerfd.
                unsafe { libc::read(self.timer.as_raw_fd(), (&raw mut ticks).cast(), 8) };
                continue;
            }
            if found.is_some() {
                // Level-triggered: it will be reported again on the next call.
                continue;
            }
            let Some(i) = pending
                .iter()
                .position(|p| p.sock.as_raw_fd() as u64 == tag)
            else {
                continue;
            };
            match recv_msg(pending[i].sock.as_raw_fd()) {
                // Readable but nothing to read (a spurious wake-up): keep waiting for it.
                Ok(None) => {}
                Ok(Some((buf, fds))) => {
                    let p = self.forget(pending, i);
                    found = self.read_hello(p.sock, &buf, fds);
                }
                // The client hung up or sent something malformed: drop it.
                Err(_) => drop(self.forget(pending, i)),
            }
        }
        let now = Instant::now();
        while let Some(i) = pending.iter().position(|p| now >= p.since + HELLO_TIMEOUT) {
            drop(self.forget(pending, i));
        }
        let full = n as usize == STEP_BATCH;
        match (found, accept_failed) {
            (None, Some(e)) => Err(e),
            (found, _) => Ok((found, full)),
        }
    }

    /// After a round: the listening socket is in the epoll set exactly while there is room for
    /// more pending clients, and the timer fires when the oldest pending hello is overdue.
    fn update(&self, set: &mut PendingSet) -> Result<()> {
        let room = set.clients.len() < PENDING_MAX;
        if room != set.listening {
            let op = if room {
                libc::EPOLL_CTL_ADD
            } else {
                libc::EPOLL_CTL_DEL
            };
            epoll_ctl(self.fd(), op, self.sock.as_raw_fd(), LISTEN_TAG).map_err(Error::Accept)?;
            set.listening = room;
        }
        let next = set.clients.iter().map(|p| p.since + HELLO_TIMEOUT).min();
        // A timer that fired was set for a client dropped since, so `armed` then differs from
        // `next` and the timer is set again.
        if next == set.armed {
            return Ok(());
        }
        // SAFETY: itimerspec is plain data; all zero disarms the timer.
        let mut spec: libc::itimerspec = unsafe { std::mem::zeroed() };
        if let Some(at) = next {
            // At least 1 ns: an all-zero value would disarm the timer instead.
            let d = at
                .saturating_duration_since(Instant::now())
                .max(Duration::from_nanos(1));
            spec.it_value.tv_sec = d.as_secs() as libc::time_t;
            spec.it_value.tv_nsec = d.subsec_nanos() as libc::c_long;
        }
        // SAFETY: plain syscall on our timerfd with a live, initialised itimerspec (relative).
        cvt(unsafe {
            libc::timerfd_settime(self.timer.as_raw_fd(), 0, &spec, std::ptr::null_mut())
        })
        .map_err(Error::Accept)?;
        set.armed = next;
        Ok(())
    }

    /// Accepts the connections in the backlog (up to [`PENDING_MAX`] pending in all) until one
    /// whose hello has come already makes a request, which it returns: the rest stay in the
    /// backlog, which keeps the listener's descriptor readable. A client whose hello has not
    /// come yet waits in the epoll set for it.
    fn accept_backlog(&self, pending: &mut Vec<Pending>) -> Result<Option<Request>> {
        while pending.len() < PENDING_MAX {
            // SAFETY: accept4 on our listening socket without an address buffer.
            let fd = unsafe {
                libc::accept4(
                    self.sock.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if fd < 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(None),
                    Some(libc::EINTR) | Some(libc::ECONNABORTED) => continue,
                    // Out of descriptors: the caller must hear of it (a client waiting in the
                    // backlog would otherwise only see its connect time out). The rest stay
                    // in the backlog for a later call.
                    Some(libc::EMFILE) | Some(libc::ENFILE) => Err(Error::Accept(e)),
                    // Short of kernel memory for a moment: leave them for later.
                    Some(libc::ENOBUFS) | Some(libc::ENOMEM) => Ok(None),
                    _ => Err(Error::Accept(e)),
                };
            }
            // SAFETY: a fresh descriptor from accept4, owned by nobody else.
            let sock = unsafe { OwnedFd::from_raw_fd(fd) };
            // A client sends its hello as soon as it is connected: under load it is often
            // there already, and then the socket need not join the set and leave it again.
            match recv_msg(fd) {
                Ok(None) => {}
                Ok(Some((buf, fds))) => match self.read_hello(sock, &buf, fds) {
                    Some(request) => return Ok(Some(request)),
                    None => continue,
                },
                // The client hung up or sent something malformed: drop it.
                Err(_) => continue,
            }
            if epoll_ctl(self.fd(), libc::EPOLL_CTL_ADD, fd, fd as u64).is_err() {
                continue; // dropped: the client sees its connection closed
            }
            pending.push(Pending {
                sock,
                since: Instant::now(),
            });
        }
        Ok(None)
    }

    /// Takes pending client `i` out of the epoll set and the list.
    fn forget(&self, pending: &mut Vec<Pending>, i: usize) -> Pending {
        let p = pending.swap_remove(i);
        let _ = epoll_ctl(self.fd(), libc::EPOLL_CTL_DEL, p.sock.as_raw_fd(), 0);
        p
    }

    /// Checks a client's hello. `None` means the client was turned away (and told why, when it
    /// is an rdmabridge peer).
    fn read_hello(&self, sock: OwnedFd, buf: &[u8], mut fds: Vec<OwnedFd>) -> Option<Request> {
        let Ok(msg) = decode(buf) else {
            return None;
        };
        let board = match judge_hello(&msg, fds.len()) {
            HelloVerdict::Refuse => return None,
            HelloVerdict::OtherVersion => {
                let _ = send_msg(
                    sock.as_raw_fd(),
                    &encode(REJECT_VERSION, VERSION.into(), 0, NO_SLOT, &[]),
                    &[],
                );
                return None;
            }
            HelloVerdict::Welcome { board_slot: None } => None,
            HelloVerdict::Welcome {
                board_slot: Some(slot),
            } => Some((fds.pop().expect("one descriptor"), slot)),
        };
        let (uid_ok, pid) = match peer_cred(sock.as_raw_fd()) {
            Ok((uid, pid)) => (uid == my_uid() || self.ctx.opts.shm_allow_any_uid, pid),
            Err(_) => (false, 0),
        };
        if !uid_ok {
            let _ = send_msg(
                sock.as_raw_fd(),
                &encode(REJECT_PERMISSION, 0, 0, NO_SLOT, &[]),
                &[],
            );
            return None;
        }
        Some(Request {
            sock: Some(sock),
            private_data: msg.data,
            board,
            peer: (pid, msg.probe),
            ring_wish: msg.b,
            offers: msg.offers,
            ctx: self.ctx.clone(),
        })
    }
}

impl ListenerSeam for Listener {
    fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    fn take(&self, deadline: Option<Instant>) -> Result<Option<ConnRequest>> {
        Ok(self.get_request(deadline)?.map(ConnRequest::new))
    }
}
