//! Connection establishment over a Unix seqpacket socket in the abstract namespace
//! (`@rdmabridge/NAME`): peer credentials are checked, versions and private data exchanged, and
//! the accepting side passes the shared segment's descriptor with SCM_RIGHTS. The socket then
//! stays open for the life of the connection: doorbells travel over it, and its end of file is
//! how each side learns, at once, that the other has gone - even when it was killed.
//!
//! Messages (little-endian): magic `u32`, version `u16`, kind `u16`, three `u32` parameters,
//! private-data length `u16`, private data. The hello carries the client's queue depths and the
//! slot of the connection on its completion queue's notice board (with the board's descriptor),
//! the accept the ring size and the server's slot (with the segment's descriptor, then the
//! board's): each side marks the other's slot when it has news for it (see `cq/notice.rs`).
//! Every message also names a word of the sender's memory and its value, so that the other
//! side can find out whether it may copy large messages straight from there (`direct.rs`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::conn::seam::{ListenerSeam, RequestSeam};
use crate::conn::{ConnOptions, ConnRequest, Connection, PRIVATE_DATA_MAX};
use crate::cq::CompletionQueue;
use crate::cq::notice::{Board, NO_SLOT, SLOTS};
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::shm::conn::{Conn, Link};
use crate::shm::direct;
use crate::shm::segment::{DEFAULT_RING_CAP, Segment};
use crate::sys::{self, cvt};

const MAGIC: u32 = 0x3152_4252; // "RBR1"
/// Version 2: notice boards. Version 3: a direct record carries a key (a large message copied
/// out of the mapping of the region it is in).
const VERSION: u16 = 3;
const HELLO: u16 = 1;
const ACCEPT: u16 = 2;
const REJECT: u16 = 3;
const REJECT_VERSION: u16 = 4;
const REJECT_PERMISSION: u16 = 5;
const HEADER: usize = 38;
const MSG_MAX: usize = HEADER + PRIVATE_DATA_MAX;
/// How long the listener waits for a connected client's hello before dropping it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

struct Msg {
    version: u16,
    kind: u16,
    a: u32,
    /// The sender's notice-board slot ([`NO_SLOT`]: none).
    slot: u32,
    /// The sender's probe word: address and value.
    probe: (u64, u64),
    data: Vec<u8>,
}

fn encode(kind: u16, a: u32, b: u32, slot: u32, data: &[u8]) -> Vec<u8> {
    encode_with_probe(kind, a, b, slot, direct::probe(), data)
}

/// [`encode`] with the probe word given.
fn encode_with_probe(
    kind: u16,
    a: u32,
    b: u32,
    slot: u32,
    (addr, value): (u64, u64),
    data: &[u8],
) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + data.len());
    v.extend_from_slice(&MAGIC.to_le_bytes());
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&kind.to_le_bytes());
    v.extend_from_slice(&a.to_le_bytes());
    v.extend_from_slice(&b.to_le_bytes());
    v.extend_from_slice(&slot.to_le_bytes());
    v.extend_from_slice(&addr.to_le_bytes());
    v.extend_from_slice(&value.to_le_bytes());
    v.extend_from_slice(&(data.len() as u16).to_le_bytes());
    v.extend_from_slice(data);
    v
}

fn decode(buf: &[u8]) -> Result<Msg> {
    let bad = |m: &str| Error::Protocol(format!("handshake: {m}"));
    if buf.len() < 12 {
        return Err(bad("message too short"));
    }
    let u16_at = |i: usize| u16::from_le_bytes([buf[i], buf[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    if u32_at(0) != MAGIC {
        return Err(bad("not an rdmabridge peer"));
    }
    let (version, kind, a) = (u16_at(4), u16_at(6), u32_at(8));
    if version != VERSION {
        // Another version lays the rest out differently: only these fields are read, so that
        // a mismatch can be named.
        return Ok(Msg {
            version,
            kind,
            a,
            slot: NO_SLOT,
            probe: (0, 0),
            data: Vec::new(),
        });
    }
    if buf.len() < HEADER {
        return Err(bad("message too short"));
    }
    let u64_at = |i: usize| u64::from(u32_at(i)) | u64::from(u32_at(i + 4)) << 32;
    let len = u16_at(36) as usize;
    if len > PRIVATE_DATA_MAX || HEADER + len != buf.len() {
        return Err(bad("bad private data length"));
    }
    Ok(Msg {
        version,
        kind,
        a,
        slot: u32_at(16),
        probe: (u64_at(20), u64_at(28)),
        data: buf[HEADER..].to_vec(),
    })
}

/// What the listener makes of a decoded hello that came with `nfds` descriptors.
#[derive(Debug, PartialEq, Eq)]
enum HelloVerdict {
    /// Not a hello, or its notice-board slot and descriptors disagree: dropped unanswered.
    Refuse,
    /// A hello of another version: answered with ours, then dropped.
    OtherVersion,
    /// A hello to go on with: with the client's notice-board slot (its descriptor is the one
    /// that came), or without a board.
    Welcome { board_slot: Option<u32> },
}

fn judge_hello(msg: &Msg, nfds: usize) -> HelloVerdict {
    if msg.kind != HELLO {
        return HelloVerdict::Refuse;
    }
    if msg.version != VERSION {
        return HelloVerdict::OtherVersion;
    }
    // The client's notice board comes with its slot, and nothing else comes with a hello.
    match (msg.slot, nfds) {
        (NO_SLOT, 0) => HelloVerdict::Welcome { board_slot: None },
        (slot, 1) if slot < SLOTS => HelloVerdict::Welcome {
            board_slot: Some(slot),
        },
        _ => HelloVerdict::Refuse,
    }
}

/// Judges the listener's decoded answer to a hello, which came with `nfds` descriptors: for an
/// accept (the segment's descriptor first, then the listener's notice board when it names a
/// slot), the listener's slot, if any; the reason the connect fails otherwise.
fn judge_reply(msg: &Msg, nfds: usize) -> Result<Option<u32>> {
    match msg.kind {
        ACCEPT => {}
        REJECT => return Err(Error::Rejected(msg.data.clone())),
        REJECT_VERSION => {
            return Err(Error::Protocol(format!(
                "listener speaks version {}, this library {VERSION}",
                msg.a
            )));
        }
        REJECT_PERMISSION => {
            return Err(Error::Permission("the listener refuses this user".into()));
        }
        k => {
            return Err(Error::Protocol(format!(
                "handshake: unexpected message kind {k}"
            )));
        }
    }
    if msg.version != VERSION {
        return Err(Error::Protocol(format!(
            "handshake: an accept of version {}, this library {VERSION}",
            msg.version
        )));
    }
    match (msg.slot, nfds) {
        (_, 0) => Err(Error::Protocol(
            "handshake: accept without a segment".into(),
        )),
        (NO_SLOT, 1) => Ok(None),
        (slot, 2) if slot < SLOTS => Ok(Some(slot)),
        _ => Err(Error::Protocol(
            "handshake: notice board and slot do not match".into(),
        )),
    }
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; a non-negative result is a new descriptor we own.
    let fd = cvt(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    })?;
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The abstract socket address of `name` and its length.
fn address(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = format!("rdmabridge/{name}");
    // sun_path[0] stays 0: the abstract namespace. Names are capped at parse time to fit.
    for (i, b) in path.bytes().enumerate() {
        sa.sun_path[i + 1] = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + path.len();
    (sa, len as libc::socklen_t)
}

/// The peer's user and process ids.
fn peer_cred(fd: RawFd) -> io::Result<(u32, libc::pid_t)> {
    // SAFETY: ucred is plain data; getsockopt fills at most `len` bytes of it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: pointers to live locals with their true sizes.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    })?;
    Ok((cred.uid, cred.pid))
}

fn my_uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// Most descriptors one message carries.
const FDS_MAX: usize = 2;

/// Sends one message, with `fds` attached (at most [`FDS_MAX`]).
fn send_msg(sock: RawFd, msg: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut _,
        iov_len: msg.len(),
    };
    let mut cbuf = [0u64; 4]; // CMSG_SPACE(FDS_MAX * sizeof(int)) rounded up, 8-aligned
    // SAFETY: msghdr is plain data; zero is a valid "no name, no control" value.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    assert!(fds.len() <= FDS_MAX);
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(bytes) } as usize;
        debug_assert!(space <= std::mem::size_of_val(&cbuf));
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = space;
        // SAFETY: the control buffer is large enough for one header carrying `fds` (checked
        // above), so CMSG_FIRSTHDR is non-null and CMSG_DATA points inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
            let data = libc::CMSG_DATA(c).cast::<RawFd>();
            for (i, &fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd);
            }
        }
    }
    // SAFETY: `mh` points at live locals (iov, msg, cbuf) for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &mh, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != msg.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short handshake send",
        ));
    }
    Ok(())
}

/// Receives one message within `timeout`, with the descriptors attached to it.
fn recv_msg(sock: RawFd, timeout: Option<Duration>) -> Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    if !sys::poll_one(sock, libc::POLLIN, timeout).map_err(Error::Connect)? {
        return Ok(None);
    }
    let mut buf = [0u8; MSG_MAX + 1];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; zero is a valid starting value.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: `mh` points at live local buffers of the sizes it states.
    let n = unsafe { libc::recvmsg(sock, &mut mh, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            return Ok(None);
        }
        return Err(Error::Connect(e));
    }
    // Take ownership of every descriptor that arrived before judging the message, so none leaks.
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`, with the libc macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count =
                    ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
    }
    if n == 0 {
        return Err(Error::Connect(io::Error::from(
            io::ErrorKind::ConnectionReset,
        )));
    }
    if mh.msg_flags & libc::MSG_CTRUNC != 0 && fds.is_empty() {
        // A descriptor was sent but could not be installed: this process is out of them.
        return Err(Error::Connect(io::Error::from_raw_os_error(libc::EMFILE)));
    }
    // The buffer holds one byte more than a message may have, so a message of exactly that
    // length arrives whole, without MSG_TRUNC: it is oversized all the same.
    if mh.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0
        || n as usize > MSG_MAX
        || fds.len() > FDS_MAX
    {
        return Err(Error::Protocol("handshake: oversized message".into()));
    }
    Ok(Some((buf[..n as usize].to_vec(), fds)))
}

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
                if let Err(e) = self.accept_backlog(pending) {
                    accept_failed = Some(e);
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
            match recv_msg(pending[i].sock.as_raw_fd(), Some(Duration::ZERO)) {
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
        Ok(())
    }

    /// Accepts every connection in the backlog (up to [`PENDING_MAX`] pending in all).
    fn accept_backlog(&self, pending: &mut Vec<Pending>) -> Result<()> {
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
                    Some(libc::EAGAIN) => Ok(()),
                    Some(libc::EINTR) | Some(libc::ECONNABORTED) => continue,
                    // Out of descriptors: the caller must hear of it (a client waiting in the
                    // backlog would otherwise only see its connect time out). The rest stay
                    // in the backlog for a later call.
                    Some(libc::EMFILE) | Some(libc::ENFILE) => Err(Error::Accept(e)),
                    // Short of kernel memory for a moment: leave them for later.
                    Some(libc::ENOBUFS) | Some(libc::ENOMEM) => Ok(()),
                    _ => Err(Error::Accept(e)),
                };
            }
            // SAFETY: a fresh descriptor from accept4, owned by nobody else.
            let sock = unsafe { OwnedFd::from_raw_fd(fd) };
            if epoll_ctl(self.fd(), libc::EPOLL_CTL_ADD, fd, fd as u64).is_err() {
                continue; // dropped: the client sees its connection closed
            }
            pending.push(Pending {
                sock,
                since: Instant::now(),
            });
        }
        Ok(())
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

/// A client's pending request.
#[derive(Debug)]
pub(crate) struct Request {
    sock: Option<OwnedFd>,
    private_data: Vec<u8>,
    /// The client's notice board and its slot there, when it has one.
    board: Option<(OwnedFd, u32)>,
    /// The client's process and probe word.
    peer: (libc::pid_t, (u64, u64)),
    ctx: Arc<ContextInner>,
}

impl Request {
    pub(crate) fn into_conn(
        mut self,
        cq: Arc<CompletionQueue>,
        opts: &ConnOptions,
    ) -> Result<Conn> {
        let sock = self
            .sock
            .take()
            .expect("an unanswered request has its socket");
        let (seg, fd) = Segment::create(DEFAULT_RING_CAP)?;
        // Before the accept goes out: the client is waiting for it, so its memory is there.
        let (pid, (addr, value)) = self.peer;
        let peer_pid = direct::can_read(pid, addr, value).then_some(pid);
        let peer_board = match self.board.take() {
            Some((fd, slot)) => Some((Board::open(&fd)?, slot)),
            None => None,
        };
        let slot = cq.reserve_slot();
        let mut fds = vec![fd.as_raw_fd()];
        fds.extend(slot.as_ref().map(|s| s.board_fd()));
        let slot_no = slot.as_ref().map_or(NO_SLOT, |s| s.slot());
        let reply = encode(ACCEPT, seg.cap() as u32, 0, slot_no, &opts.private_data);
        send_msg(sock.as_raw_fd(), &reply, &fds).map_err(|e| {
            if e.raw_os_error() == Some(libc::EPIPE) || e.raw_os_error() == Some(libc::ECONNRESET) {
                Error::Disconnected
            } else {
                Error::Accept(e)
            }
        })?;
        drop(fd);
        let data = std::mem::take(&mut self.private_data);
        let link = Link {
            side: 1,
            sock,
            seg,
            slot,
            peer_board,
            peer_pid,
            peer_proc: pid,
        };
        Conn::start(self.ctx.clone(), cq, opts, link, data)
    }
}

impl RequestSeam for Request {
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The requesting process, for messages.
    fn peer(&self) -> String {
        super::conn::process_name(self.peer.0)
    }

    fn reject(mut self: Box<Self>, private_data: &[u8]) -> Result<()> {
        let sock = self
            .sock
            .take()
            .expect("an unanswered request has its socket");
        send_msg(
            sock.as_raw_fd(),
            &encode(REJECT, 0, 0, NO_SLOT, private_data),
            &[],
        )
        .map_err(Error::Accept)
    }

    fn accept(self: Box<Self>, cq: Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Connection> {
        Ok(Connection::new((*self).into_conn(cq, opts)?))
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(sock) = self.sock.take() {
            let _ = send_msg(sock.as_raw_fd(), &encode(REJECT, 0, 0, NO_SLOT, &[]), &[]);
        }
    }
}

/// Connects to the listener `name`.
pub(crate) fn connect(
    ctx: Arc<ContextInner>,
    name: &str,
    cq: Arc<CompletionQueue>,
    opts: &ConnOptions,
) -> Result<Conn> {
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    let timed_out = || Error::Timeout("connecting");
    let sock = socket().map_err(Error::Connect)?;
    let (sa, len) = address(name);
    loop {
        // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
        let r = unsafe { libc::connect(sock.as_raw_fd(), (&raw const sa).cast(), len) };
        if r == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => {
                return Err(Error::Refused(format!("shm://{name}")));
            }
            // The listener's backlog is full: try again until the deadline.
            Some(libc::EAGAIN) | Some(libc::EINTR) => {
                if sys::remaining(deadline).is_some_and(|d| d.is_zero()) {
                    return Err(timed_out());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            _ => return Err(Error::Connect(e)),
        }
    }
    let pid = match peer_cred(sock.as_raw_fd()) {
        Ok((uid, pid)) if uid == my_uid() || ctx.opts.shm_allow_any_uid => pid,
        Ok((uid, _)) => return Err(Error::Permission(format!("listener runs as uid {uid}"))),
        Err(e) => return Err(Error::Connect(e)),
    };
    let slot = cq.reserve_slot();
    let hello = encode(
        HELLO,
        opts.send_queue_depth,
        opts.recv_queue_depth,
        slot.as_ref().map_or(NO_SLOT, |s| s.slot()),
        &opts.private_data,
    );
    let hello_fds: Vec<RawFd> = slot.as_ref().map(|s| s.board_fd()).into_iter().collect();
    // The listener closing the connection before it answers (it went away, or dropped a client
    // that stayed silent too long) is a failed establishment, not an OS error.
    let hung_up = |e: &io::Error| {
        matches!(e.raw_os_error(), Some(libc::EPIPE) | Some(libc::ECONNRESET))
            || e.kind() == io::ErrorKind::ConnectionReset
    };
    let closed = || {
        Error::ConnectFailed(format!(
            "shm://{name}: the listener closed the connection before answering"
        ))
    };
    send_msg(sock.as_raw_fd(), &hello, &hello_fds).map_err(|e| {
        if hung_up(&e) {
            closed()
        } else {
            Error::Connect(e)
        }
    })?;
    let reply = match recv_msg(sock.as_raw_fd(), sys::remaining(deadline)) {
        Err(Error::Connect(e)) if hung_up(&e) => return Err(closed()),
        r => r?,
    };
    let Some((buf, fds)) = reply else {
        return Err(timed_out());
    };
    let msg = decode(&buf)?;
    let board_slot = judge_reply(&msg, fds.len())?;
    let mut fds = fds.into_iter();
    let fd = fds.next().expect("judged: an accept carries its segment");
    let seg = Segment::open(&fd)?;
    drop(fd);
    if seg.cap() != msg.a as usize {
        return Err(Error::Protocol("handshake: ring size mismatch".into()));
    }
    let peer_board = match (board_slot, fds.next()) {
        (Some(slot), Some(fd)) => Some((Board::open(&fd)?, slot)),
        _ => None,
    };
    let (addr, value) = msg.probe;
    let peer_pid = direct::can_read(pid, addr, value).then_some(pid);
    let link = Link {
        side: 0,
        sock,
        seg,
        slot,
        peer_board,
        peer_pid,
        peer_proc: pid,
    };
    Conn::start(ctx, cq, opts, link, msg.data)
}

/// The fuzz target's entry (`fuzz/fuzz_targets/handshake.rs`). `data[0]`: bits 0-1, how many
/// descriptors come with the message (0..=3); bit 7, whether the message goes through a real
/// seqpacket socket pair and the real receiver (`recv_msg`) first; bit 6, whether the rest is
/// instead the header of a shared segment the peer hands over (bits 2-5: its size and seals),
/// opened by the real `Segment::open`. The rest is the message as the peer sent it. Runs the
/// real parser and both judges over it and checks what they accept against the wire format.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_message(data: &[u8]) {
    let Some((&ctl, buf)) = data.split_first() else {
        return;
    };
    if ctl & 0x40 != 0 {
        return fuzz_segment(ctl, buf);
    }
    let mut nfds = usize::from(ctl % 4);
    let received;
    let buf = if ctl & 0x80 != 0 {
        let Some((b, n)) = fuzz_through_socket(buf, nfds) else {
            return;
        };
        (received, nfds) = (b, n);
        &received[..]
    } else {
        buf
    };
    let msg = match decode(buf) {
        Ok(msg) => msg,
        Err(Error::Protocol(_)) => return,
        Err(e) => panic!("a bad message is a protocol error, not {e:?}"),
    };
    assert!(buf.len() >= 12);
    if msg.version == VERSION {
        assert!(msg.data.len() <= PRIVATE_DATA_MAX);
        assert_eq!(HEADER + msg.data.len(), buf.len());
        // What was accepted is exactly what the sender encoded.
        let b = u32::from_le_bytes(buf[12..16].try_into().expect("4 bytes"));
        let again = encode_with_probe(msg.kind, msg.a, b, msg.slot, msg.probe, &msg.data);
        assert_eq!(again, buf);
    } else {
        assert!(msg.data.is_empty() && msg.slot == NO_SLOT);
    }
    match judge_hello(&msg, nfds) {
        HelloVerdict::Welcome { board_slot } => {
            assert_eq!(msg.version, VERSION);
            assert_eq!(msg.kind, HELLO);
            match board_slot {
                Some(slot) => assert!(slot < SLOTS && nfds == 1),
                None => assert!(nfds == 0 && msg.slot == NO_SLOT),
            }
        }
        HelloVerdict::OtherVersion => assert_ne!(msg.version, VERSION),
        HelloVerdict::Refuse => {}
    }
    match judge_reply(&msg, nfds) {
        Ok(board_slot) => {
            assert_eq!((msg.version, msg.kind), (VERSION, ACCEPT));
            match board_slot {
                Some(slot) => assert!(slot < SLOTS && nfds == 2),
                None => assert!(nfds == 1 && msg.slot == NO_SLOT),
            }
        }
        Err(Error::Rejected(data)) => assert!(data.len() <= PRIVATE_DATA_MAX),
        Err(Error::Protocol(_) | Error::Permission(_)) => {}
        Err(e) => panic!("unexpected verdict {e:?}"),
    }
}

/// Sends `buf` with `nfds` descriptors through a socket pair and takes it out with
/// [`recv_msg`]: what it returns is what was sent, and what it refuses is a protocol error (a
/// message too long, too many descriptors) or, for an empty packet, a hang-up.
#[cfg(feature = "fuzzing")]
fn fuzz_through_socket(buf: &[u8], nfds: usize) -> Option<(Vec<u8>, usize)> {
    thread_local! {
        static PAIR: (OwnedFd, OwnedFd, OwnedFd) = {
            let mut sv = [0; 2];
            // SAFETY: plain syscall into a live local array of two descriptors.
            let r = unsafe {
                libc::socketpair(
                    libc::AF_UNIX,
                    libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                    0,
                    sv.as_mut_ptr(),
                )
            };
            assert_eq!(r, 0, "socketpair");
            // SAFETY: a NUL-terminated path; plain syscall.
            let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            assert!(null >= 0, "/dev/null");
            // SAFETY: fresh descriptors owned by nobody else.
            unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1]), OwnedFd::from_raw_fd(null)) }
        };
    }
    PAIR.with(|(tx, rx, null)| {
        let fds = vec![null.as_raw_fd(); nfds];
        let mut iov = libc::iovec {
            iov_base: buf.as_ptr().cast_mut().cast(),
            iov_len: buf.len(),
        };
        let mut cbuf = [0u64; 8];
        // SAFETY: msghdr is plain data; zero is a valid "no name, no control" value.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        if nfds > 0 {
            let bytes = std::mem::size_of_val(&fds[..]) as u32;
            mh.msg_control = cbuf.as_mut_ptr().cast();
            // SAFETY: pure size computations; at most 4 descriptors fit `cbuf`.
            mh.msg_controllen = unsafe { libc::CMSG_SPACE(bytes) } as usize;
            // SAFETY: `cbuf` holds one header carrying `fds`, so CMSG_FIRSTHDR is non-null and
            // CMSG_DATA points inside it.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&mh);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for (i, &fd) in fds.iter().enumerate() {
                    data.add(i).write_unaligned(fd);
                }
            }
        }
        // SAFETY: `mh` points at live locals for the duration of the call.
        let n = unsafe { libc::sendmsg(tx.as_raw_fd(), &mh, libc::MSG_NOSIGNAL) };
        if n < 0 {
            // Longer than a packet may be: nothing was sent.
            return None;
        }
        assert_eq!(n as usize, buf.len());
        match recv_msg(rx.as_raw_fd(), Some(Duration::ZERO)) {
            Ok(Some((got, fds))) => {
                assert!(buf.len() <= MSG_MAX && !buf.is_empty() && nfds <= FDS_MAX);
                assert_eq!(got, buf);
                assert_eq!(fds.len(), nfds);
                Some((got, fds.len()))
            }
            Ok(None) => panic!("a packet was sent, none came"),
            Err(Error::Protocol(_)) => {
                assert!(buf.len() > MSG_MAX || nfds > FDS_MAX);
                None
            }
            Err(Error::Connect(_)) if buf.is_empty() => None,
            Err(e) => panic!("unexpected receive error {e:?}"),
        }
    })
}

/// A shared segment the peer sends: `buf` starts with its header, `ctl` bits 2-3 choose its
/// size and bits 4-5 leave out seals. Opened with the real [`Segment::open`]: what it accepts
/// has every seal and a ring size that fits the file.
#[cfg(feature = "fuzzing")]
fn fuzz_segment(ctl: u8, buf: &[u8]) {
    const DATA: usize = 3 * 4096;
    const MIN_CAP: usize = 64 * 1024;
    let len = [
        DATA + 2 * MIN_CAP,
        DATA + 4 * MIN_CAP,
        DATA + 2 * MIN_CAP + 4096,
        4096,
    ][usize::from(ctl >> 2 & 3)];
    let all = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    let seals = match ctl >> 4 & 3 {
        0 => all,
        1 => all & !libc::F_SEAL_GROW,
        2 => libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        _ => 0,
    };
    // SAFETY: a NUL-terminated name and valid flags; the new descriptor is ours.
    let fd = unsafe {
        libc::memfd_create(
            c"rbr-fuzz".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let head = &buf[..buf.len().min(64)];
    // SAFETY: plain syscalls on our memfd; `head` is readable for its length.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
        assert_eq!(
            libc::pwrite(fd.as_raw_fd(), head.as_ptr().cast(), head.len(), 0),
            head.len() as isize
        );
        if seals != 0 {
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
        }
    }
    if let Ok(seg) = Segment::open(&fd) {
        assert_eq!(seals, all, "a segment that could be resized was accepted");
        assert_eq!(DATA + 2 * seg.cap(), len, "rings that do not fit the file");
        assert!(seg.cap() >= MIN_CAP && seg.cap() % 4096 == 0);
    }
}

/// Real messages, for the fuzz target's seed corpus: (name, `fuzz_message` input).
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let with = |n: u8, m: Vec<u8>| [vec![n], m].concat();
    let probe = (0x7fff_1234_5678, 0x0123_4567_89ab_cdef);
    let segment_header = |cap: u32| {
        let mut h = 0x5242_5348_4d53_4547u64.to_le_bytes().to_vec(); // "RBSHMSEG"
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&cap.to_le_bytes());
        h
    };
    let mut v9 = encode_with_probe(HELLO, 9, 0, NO_SLOT, (0, 0), &[]);
    v9[4] = 9;
    vec![
        (
            "hello",
            with(0, encode_with_probe(HELLO, 64, 64, NO_SLOT, probe, &[])),
        ),
        (
            "hello-board-data",
            with(1, encode_with_probe(HELLO, 16, 32, 5, probe, b"real")),
        ),
        (
            "accept",
            with(
                1,
                encode_with_probe(ACCEPT, 1 << 21, 0, NO_SLOT, probe, &[]),
            ),
        ),
        (
            "accept-board",
            with(2, encode_with_probe(ACCEPT, 1 << 16, 0, 7, probe, b"hi")),
        ),
        (
            "reject",
            with(0, encode_with_probe(REJECT, 0, 0, NO_SLOT, probe, b"no")),
        ),
        (
            "reject-version",
            with(
                0,
                encode_with_probe(REJECT_VERSION, 2, 0, NO_SLOT, probe, &[]),
            ),
        ),
        ("hello-v9", with(0, v9)),
        (
            "socket-hello-board",
            with(0x81, encode_with_probe(HELLO, 16, 32, 5, probe, b"real")),
        ),
        (
            "socket-accept",
            with(0x82, encode_with_probe(ACCEPT, 1 << 16, 0, 7, probe, &[])),
        ),
        ("segment", with(0x40, segment_header(1 << 16))),
        ("segment-unsealed", with(0x70, segment_header(1 << 16))),
        ("segment-bigger", with(0x44, segment_header(1 << 17))),
        ("garbage", with(0, b"GET / HTTP/1.0".to_vec())),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seqpacket pair (non-blocking).
    fn pair() -> (OwnedFd, OwnedFd) {
        let mut sv = [0; 2];
        // SAFETY: plain syscall into a live local array of two descriptors.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
                sv.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0);
        // SAFETY: fresh descriptors owned by nobody else.
        unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) }
    }

    /// Found by the handshake fuzz target: a message one byte longer than any valid one fit
    /// the receive buffer exactly and was passed on as if it had a valid size.
    #[test]
    fn messages_longer_than_the_longest_are_refused_at_every_length() {
        let (tx, rx) = pair();
        for len in [MSG_MAX + 1, MSG_MAX + 2, 4 * MSG_MAX] {
            send_msg(tx.as_raw_fd(), &vec![0x10; len], &[]).unwrap();
            match recv_msg(rx.as_raw_fd(), Some(Duration::ZERO)) {
                Err(Error::Protocol(m)) => assert!(m.contains("oversized"), "{m}"),
                other => panic!("{len} bytes: {other:?}"),
            }
        }
        let longest = encode(HELLO, 1, 1, NO_SLOT, &[7; PRIVATE_DATA_MAX]);
        assert_eq!(longest.len(), MSG_MAX);
        send_msg(tx.as_raw_fd(), &longest, &[]).unwrap();
        let (got, fds) = recv_msg(rx.as_raw_fd(), Some(Duration::ZERO))
            .unwrap()
            .expect("a message");
        assert_eq!((got, fds.len()), (longest, 0));
    }
}
