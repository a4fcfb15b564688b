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
use crate::conn::{ConnOptions, Connection, socket_error};
use crate::cq::CompletionQueue;
use crate::cq::notice::{Board, NO_SLOT};
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::shm::conn::{Conn, Link};
use crate::shm::direct;
use crate::shm::engine;
use crate::shm::segment::{DEFAULT_RING_CAP, Segment};
use crate::shm::socket::{address, my_uid, peer_cred, recv_msg, send_msg, socket};
use crate::shm::wire::{ACCEPT, HELLO, REJECT, decode, encode, judge_reply};
use crate::sys;

pub(crate) use listener::Listener;

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
        engine::start(self.ctx.clone(), cq, opts, link, data)
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
    engine::start(ctx, cq, opts, link, msg.data)
}
