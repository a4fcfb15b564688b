//! Connection establishment over a Unix seqpacket socket in the abstract namespace
//! (`@rdmabridge/NAME`): peer credentials are checked, versions and private data exchanged, and
//! the accepting side passes the shared segment's descriptor with SCM_RIGHTS. The socket then
//! stays open for the life of the connection: doorbells travel over it, and its end of file is
//! how each side learns, at once, that the other has gone - even when it was killed.
//!
//! The messages are in `wire.rs`, the listener and its epoll set in `listener.rs`, the socket
//! and the passing of descriptors in `socket.rs`.

mod listener;

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::conn::seam::RequestSeam;
use crate::conn::{
    ConnOptions, Handshake, SHM_RING_DEFAULT, Setup, Started, Step, Transport,
    shm_ring_size_allowed, socket_error,
};
use crate::cq::notice::NO_SLOT;
use crate::cq::{CompletionQueue, SlotReservation};
use crate::domain::ContextInner;
use crate::driver::{Next, Ready};
use crate::error::{Error, Result};
use crate::shm::conn::{Conn, Link};
use crate::shm::engine::{self, Engine};
use crate::shm::peers::{Kept, Peers};
use crate::shm::segment::Segment;
use crate::shm::socket::{address, my_uid, peer_cred, recv_msg, send_msg, socket};
use crate::shm::wire::{ACCEPT, REJECT, decode, encode, encode_hello, judge_reply};
use crate::sys;

pub(crate) use listener::Listener;

/// The ring size of a connection: the larger of the client's wish and the listener's option
/// (each 0 when it has none), else the default. A wish that no option could be (from a hostile
/// or broken client) counts as none.
fn ring_size(wish: u32, own: u32) -> usize {
    let wish = if shm_ring_size_allowed(wish) { wish } else { 0 };
    let size = wish.max(own);
    (if size == 0 { SHM_RING_DEFAULT } else { size }) as usize
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
    /// The ring size the client asked for (0: none).
    ring_wish: u32,
    /// The segments the client keeps from this process (inode numbers; see `peers.rs`).
    offers: Vec<u64>,
    ctx: Arc<ContextInner>,
}

impl Request {
    /// Answers the request with an accept and starts the connection.
    fn answer(
        &mut self,
        setup: &Setup,
        cq: Arc<CompletionQueue>,
        opts: &ConnOptions,
    ) -> Result<(Conn, Box<Engine>)> {
        let sock = self
            .sock
            .take()
            .expect("an unanswered request has its socket");
        let cap = ring_size(self.ring_wish, opts.shm_ring_size);
        let peers = self.ctx.transports.get::<Peers>();
        let (pid, (addr, value)) = self.peer;
        let probe = (pid, addr, value);
        // A segment made for this client earlier and let go of on both sides, or a new one.
        let (mut seg, fd, taken) = match peers.take_offered(probe, &self.offers, cap) {
            Some((i, seg)) => {
                seg.reset();
                (seg, None, i as u32 + 1)
            }
            None => {
                let (seg, fd) = Segment::create(cap)?;
                (seg, Some(fd), 0)
            }
        };
        seg.keep_with(Peers::keeper(&peers, Kept::Made(probe)));
        // Before the accept goes out: the client is waiting for it, so its memory is there.
        let peer_pid = peers.can_read(pid, addr, value).then_some(pid);
        let peer_board = match self.board.take() {
            Some((fd, slot)) => Some((peers.board(&fd)?, slot)),
            None => None,
        };
        let slot = cq.reserve_slot();
        let mut fds: Vec<RawFd> = fd.as_ref().map(|f| f.as_raw_fd()).into_iter().collect();
        fds.extend(slot.as_ref().map(|s| s.board_fd()));
        let slot_no = slot.as_ref().map_or(NO_SLOT, |s| s.slot());
        let reply = encode(ACCEPT, cap as u32, taken, slot_no, &opts.private_data);
        send_msg(sock.as_raw_fd(), &reply, &fds).map_err(|e| socket_error(e, Error::Accept))?;
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
        engine::start(setup, cq, opts, link, data)
    }
}

/// The accepting side's handshake: its one turn answers the request.
struct Accepting {
    request: Request,
    cq: Arc<CompletionQueue>,
    opts: ConnOptions,
}

impl Handshake for Accepting {
    fn step(&mut self, _: &Ready, setup: &Setup) -> Step {
        match self.request.answer(setup, self.cq.clone(), &self.opts) {
            Ok((conn, engine)) => Step::Up(Box::new(conn), engine),
            Err(e) => Step::Failed(e),
        }
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

    fn context(&self) -> &Arc<ContextInner> {
        &self.ctx
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

    fn transport(&self) -> Transport {
        Transport::Shm
    }

    fn start(self: Box<Self>, cq: Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Started> {
        let fd = self
            .sock
            .as_ref()
            .expect("an unanswered request has its socket")
            .as_raw_fd();
        Ok(Started {
            handshake: Box::new(Accepting {
                request: *self,
                cq,
                opts: opts.clone(),
            }),
            fd: Some(fd),
        })
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(sock) = self.sock.take() {
            let _ = send_msg(sock.as_raw_fd(), &encode(REJECT, 0, 0, NO_SLOT, &[]), &[]);
        }
    }
}

/// Starts connecting to the listener `name`: the socket is made here; connecting, the hello
/// and the reply are the handshake's turns.
pub(crate) fn start_connect(
    name: &str,
    cq: Arc<CompletionQueue>,
    opts: &ConnOptions,
) -> Result<Started> {
    let sock = socket().map_err(Error::Connect)?;
    let fd = sock.as_raw_fd();
    let mut connecting = Connecting {
        name: name.to_owned(),
        deadline: opts.timeout.map(|t| Instant::now() + t),
        cq,
        opts: opts.clone(),
        sock: Some(sock),
        connected: None,
        sent: None,
        offered: Vec::new(),
    };
    // Connecting a Unix socket never waits, and a socket not yet connected polls as hung up:
    // connected here, it is quiet in the driver's set until the listener answers. Its outcome
    // (a refusal too) is the first turn's.
    connecting.connected = Some(connecting.connect());
    Ok(Started {
        handshake: Box::new(connecting),
        fd: Some(fd),
    })
}

/// While the listener's backlog is full: how soon connecting is tried again.
const BACKLOG_RETRY: Duration = Duration::from_millis(1);

/// The connecting side's handshake.
struct Connecting {
    name: String,
    deadline: Option<Instant>,
    cq: Arc<CompletionQueue>,
    opts: ConnOptions,
    sock: Option<OwnedFd>,
    /// What connecting said when the connection started, for the first turn.
    connected: Option<Result<bool>>,
    /// Once the hello is out: the listener's process and this side's notice-board slot.
    sent: Option<(libc::pid_t, Option<SlotReservation>)>,
    /// The segments kept from the listener's process that the hello offered, held until the
    /// answer (unmapped when dropped).
    offered: Vec<Segment>,
}

impl Handshake for Connecting {
    fn step(&mut self, _: &Ready, setup: &Setup) -> Step {
        match self.turn(setup) {
            Ok(step) => step,
            Err(e) => Step::Failed(e),
        }
    }
}

/// The listener closing the connection before it answers (it went away, or dropped a client
/// that stayed silent too long) is a failed establishment, not an OS error.
fn hung_up(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPIPE) | Some(libc::ECONNRESET))
        || e.kind() == io::ErrorKind::ConnectionReset
}

impl Connecting {
    fn sock(&self) -> RawFd {
        self.sock.as_ref().expect("held until up").as_raw_fd()
    }

    fn closed(&self) -> Error {
        Error::ConnectFailed(format!(
            "shm://{}: the listener closed the connection before answering",
            self.name
        ))
    }

    /// Waits for the socket until the deadline, or fails having reached it.
    fn wait(&self, retry: Option<Instant>) -> Result<Step> {
        if sys::remaining(self.deadline).is_some_and(|d| d.is_zero()) {
            return Err(Error::Timeout("connecting"));
        }
        let at = match (retry, self.deadline) {
            (Some(r), Some(d)) => Some(r.min(d)),
            (r, d) => r.or(d),
        };
        Ok(Step::Wait(Next::Wait(at)))
    }

    fn turn(&mut self, setup: &Setup) -> Result<Step> {
        if self.sent.is_none() {
            return self.hello(setup);
        }
        let reply = match recv_msg(self.sock()) {
            Err(Error::Connect(e)) if hung_up(&e) => return Err(self.closed()),
            r => r?,
        };
        let Some((buf, fds)) = reply else {
            return self.wait(None);
        };
        let msg = decode(&buf)?;
        let board_slot = judge_reply(&msg, fds.len())?;
        let mut fds = fds.into_iter();
        let (pid, slot) = self.sent.take().expect("the hello went out");
        let mut seg = match msg.b {
            0 => {
                let fd = fds
                    .next()
                    .expect("judged: a new segment's descriptor comes");
                Segment::open(&fd)?
            }
            i => {
                let i = i as usize - 1;
                if i >= self.offered.len() {
                    return Err(Error::Protocol(
                        "handshake: the listener took up a segment not offered".into(),
                    ));
                }
                self.offered.swap_remove(i).reopen()?
            }
        };
        if seg.cap() != msg.a as usize {
            return Err(Error::Protocol("handshake: ring size mismatch".into()));
        }
        // Offers not taken up are unmapped.
        self.offered.clear();
        let peers = setup.context().transports.get::<Peers>();
        seg.keep_with(Peers::keeper(&peers, Kept::Mapped(pid)));
        let peer_board = match (board_slot, fds.next()) {
            (Some(slot), Some(fd)) => Some((peers.board(&fd)?, slot)),
            _ => None,
        };
        let (addr, value) = msg.probe;
        let peer_pid = peers.can_read(pid, addr, value).then_some(pid);
        let link = Link {
            side: 0,
            sock: self.sock.take().expect("held until up"),
            seg,
            slot,
            peer_board,
            peer_pid,
            peer_proc: pid,
        };
        let (conn, engine) = engine::start(setup, self.cq.clone(), &self.opts, link, msg.data)?;
        Ok(Step::Up(Box::new(conn), engine))
    }

    /// Connects the socket: `Ok(false)` while the listener's backlog is full.
    fn connect(&self) -> Result<bool> {
        let (sa, len) = address(&self.name);
        // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
        if unsafe { libc::connect(self.sock(), (&raw const sa).cast(), len) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => {
                Err(Error::Refused(format!("shm://{}", self.name)))
            }
            Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(false),
            _ => Err(Error::Connect(e)),
        }
    }

    /// Connects (if not yet) and sends the hello.
    fn hello(&mut self, setup: &Setup) -> Result<Step> {
        let connected = match self.connected.take() {
            Some(r) => r?,
            None => self.connect()?,
        };
        if !connected {
            // The listener's backlog is full: try again soon, until the deadline.
            return self.wait(Some(Instant::now() + BACKLOG_RETRY));
        }
        let pid = match peer_cred(self.sock()) {
            Ok((uid, pid)) if uid == my_uid() || setup.context().opts.shm_allow_any_uid => pid,
            Ok((uid, _)) => return Err(Error::Permission(format!("listener runs as uid {uid}"))),
            Err(e) => return Err(Error::Connect(e)),
        };
        let slot = self.cq.reserve_slot();
        let peers = setup.context().transports.get::<Peers>();
        self.offered = peers.offers(pid);
        let offers: Vec<u64> = self.offered.iter().map(Segment::ino).collect();
        let hello = encode_hello(
            self.opts.send_queue_depth,
            self.opts.shm_ring_size,
            slot.as_ref().map_or(NO_SLOT, |s| s.slot()),
            &self.opts.private_data,
            &offers,
        );
        let hello_fds: Vec<RawFd> = slot.as_ref().map(|s| s.board_fd()).into_iter().collect();
        send_msg(self.sock(), &hello, &hello_fds).map_err(|e| {
            if hung_up(&e) {
                self.closed()
            } else {
                Error::Connect(e)
            }
        })?;
        self.sent = Some((pid, slot));
        self.wait(None)
    }
}
