//! The progress thread of one shm connection: moves posted sends into the outgoing ring,
//! fills posted receives from the incoming ring, completes work, and notices the peer leaving.
//!
//! Flow control is by credits: the receiver publishes how many receives it has posted in all,
//! and the sender starts message `n` only once `n` receives exist, so a message always has a
//! buffer when it arrives and a slow receiver holds the sender back instead of losing data.
//! A send completes when the receiver has taken it out of the ring, as an RC send completes
//! when the peer acknowledges it; a receive too small for its message fails the connection and
//! the send with [`WcStatus::RemoteError`].

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use crate::cq::{Opcode, WcStatus};
use crate::error::{Error, Result};
use crate::shm::conn::{RecvWr, SendWr, Shared};
use crate::shm::ring::{self, Consumer, Producer, Record};
use crate::shm::segment::{FATAL_LENGTH, FATAL_PROTOCOL, Segment};
use crate::sys;

/// Doorbell packet: "look at the rings".
pub(crate) const WAKE: u8 = 1;
/// Goodbye packet: an orderly close follows.
pub(crate) const BYE: u8 = 2;

/// How long the engine spins on an idle connection before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
/// Longest single sleep; each wake-up re-checks everything.
const MAX_SLEEP: Duration = Duration::from_millis(500);

/// Why the connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The user asked for it.
    Local,
    /// The peer closed: `clean` if it said goodbye first.
    Peer { clean: bool },
    /// A receive here was too small for a message.
    LocalLength,
    /// The peer broke the protocol (or a panic inside the engine).
    Protocol,
}

/// One send fully in the ring, waiting for the peer to take it.
struct InFlight {
    end: u64,
    seq: u64,
    wr: SendWr,
}

pub(crate) struct Engine {
    sh: Arc<Shared>,
    seg: Segment,
    side: usize,
    sock: OwnedFd,
    tx: Producer,
    rx: Consumer,
    max_chunk: usize,
    /// Sends not yet fully written; the front one has `copied` bytes in the ring.
    pending: VecDeque<SendWr>,
    copied: usize,
    inflight: VecDeque<InFlight>,
    /// Posted receives; the front one has `filled` bytes of a message when `filling`.
    recvs: VecDeque<RecvWr>,
    filling: bool,
    filled: usize,
    /// Messages started (credits used), receives posted, messages received.
    msgs_started: u64,
    recvs_posted: u64,
    msgs_received: u64,
    peer_said_bye: bool,
    /// The peer's receive count and ring head when the sender last tried to write.
    seen_credits: u64,
    seen_head: u64,
}

impl Engine {
    pub(crate) fn new(sh: Arc<Shared>, side: usize, sock: OwnedFd, seg: Segment) -> Result<Engine> {
        let cap = seg.cap();
        let (tx_tail, tx_head) = seg.cursors(side);
        let (rx_tail, rx_head) = seg.cursors(1 - side);
        // SAFETY: the cursors and rings live in `seg`, which the engine owns and drops after
        // the producer and consumer; side `side` is the only producer of ring `side` and the
        // only consumer of ring `1 - side`.
        let (tx, rx) = unsafe {
            (
                Producer::new(tx_tail, tx_head, seg.data(side), cap),
                Consumer::new(rx_tail, rx_head, seg.data(1 - side), cap),
            )
        };
        Ok(Engine {
            sh,
            side,
            sock,
            tx,
            rx,
            max_chunk: (cap / 4).min(64 * 1024),
            seg,
            pending: VecDeque::new(),
            copied: 0,
            inflight: VecDeque::new(),
            recvs: VecDeque::new(),
            filling: false,
            filled: 0,
            msgs_started: 0,
            recvs_posted: 0,
            msgs_received: 0,
            peer_said_bye: false,
            seen_credits: 0,
            seen_head: 0,
        })
    }

    /// Runs until the connection ends, then completes everything and reports the disconnect.
    pub(crate) fn run(mut self) {
        let end = crate::panic::catch(|| self.main_loop()).unwrap_or(End::Protocol);
        self.teardown(end);
    }

    fn main_loop(&mut self) -> End {
        let mut idle_since: Option<Instant> = None;
        loop {
            if self.sh.stop.load(Ordering::SeqCst) {
                return End::Local;
            }
            match self.step() {
                Err(end) => return end,
                Ok(true) => idle_since = None,
                Ok(false) => {
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    if since.elapsed() < SPIN {
                        std::hint::spin_loop();
                        continue;
                    }
                    if let Err(end) = self.sleep() {
                        return end;
                    }
                    idle_since = None;
                }
            }
        }
    }

    fn fail_protocol(&self, _e: Error) -> End {
        self.seg
            .ctrl(self.side)
            .fatal
            .store(FATAL_PROTOCOL << 48, Ordering::SeqCst);
        End::Protocol
    }

    /// One pass over everything; true if anything moved.
    fn step(&mut self) -> std::result::Result<bool, End> {
        let mut moved = false;
        let mut ring_peer = false;
        // Receives first, so credits reach the peer as early as possible.
        while let Some(r) = self.sh.rq.pop() {
            self.recvs.push_back(r);
            self.recvs_posted += 1;
            moved = true;
            ring_peer = true;
        }
        if ring_peer {
            // Release: the peer reading this count may send into the receives it counts.
            self.seg
                .ctrl(self.side)
                .recv_posted
                .store(self.recvs_posted, Ordering::Release);
        }
        while let Some(s) = self.sh.sq.pop() {
            self.pending.push_back(s);
            moved = true;
        }
        match self.transmit() {
            Ok(m) => {
                moved |= m;
                ring_peer |= m;
            }
            Err(e) => return Err(self.fail_protocol(e)),
        }
        match self.complete_sends() {
            Ok(m) => moved |= m,
            Err(e) => return Err(self.fail_protocol(e)),
        }
        match self.receive() {
            Ok(m) => {
                moved |= m;
                ring_peer |= m;
            }
            Err(ReceiveError::Length) => return Err(End::LocalLength),
            Err(ReceiveError::Protocol(e)) => return Err(self.fail_protocol(e)),
        }
        if ring_peer {
            self.ring_peer();
        }
        Ok(moved)
    }

    /// Writes as much of the pending sends into the ring as credits and space allow.
    fn transmit(&mut self) -> Result<bool> {
        let mut moved = false;
        // Acquire: pairs with the peer's Release of its receive count.
        let credits = self
            .seg
            .ctrl(1 - self.side)
            .recv_posted
            .load(Ordering::Acquire);
        self.seen_credits = credits;
        self.seen_head = self.tx.head()?;
        while let Some(wr) = self.pending.front() {
            let first = self.copied == 0;
            if first && self.msgs_started >= credits {
                break;
            }
            let want = (wr.len - self.copied).min(self.max_chunk);
            let ends = self.copied + want == wr.len;
            // SAFETY: `wr.ptr()` is valid for `wr.len` bytes while the work request lives (the
            // region is held by it; inline data is owned by it), and copied + want <= len.
            let wrote = unsafe {
                self.tx
                    .write(wr.ptr().add(self.copied), want, first, ends, None, wr.len)?
            };
            let Some(n) = wrote else { break };
            moved = true;
            if first {
                self.msgs_started += 1;
            }
            self.copied += n;
            if self.copied == wr.len {
                let wr = self.pending.pop_front().expect("front exists");
                self.inflight.push_back(InFlight {
                    end: self.tx.tail(),
                    seq: self.msgs_started - 1,
                    wr,
                });
                self.copied = 0;
            }
        }
        Ok(moved)
    }

    /// Completes the sends the peer has taken out of the ring.
    fn complete_sends(&mut self) -> Result<bool> {
        if self.inflight.is_empty() {
            return Ok(false);
        }
        let head = self.tx.head()?;
        let mut moved = false;
        while self.inflight.front().is_some_and(|f| f.end <= head) {
            let f = self.inflight.pop_front().expect("front exists");
            self.finish_send(f.wr, WcStatus::Success);
            moved = true;
        }
        Ok(moved)
    }

    fn finish_send(&self, wr: SendWr, status: WcStatus) {
        // The slot is free before the completion is queued: a caller that reaps it may post
        // again at once, as with a verbs queue pair.
        self.sh.sq_used.fetch_sub(1, Ordering::Relaxed);
        if wr.signaled || status != WcStatus::Success {
            self.sh
                .report
                .complete(wr.wr_id, Opcode::Send, status, 0, None);
        }
    }

    fn finish_recv(&self, wr: RecvWr, status: WcStatus, len: usize, imm: Option<u32>) {
        // As for sends: free the slot first.
        self.sh.rq_used.fetch_sub(1, Ordering::Relaxed);
        self.sh
            .report
            .complete(wr.wr_id, Opcode::Recv, status, len as u32, imm);
    }

    /// Moves records from the incoming ring into posted receives.
    fn receive(&mut self) -> std::result::Result<bool, ReceiveError> {
        let mut moved = false;
        while let Some(rec) = self.rx.peek()? {
            self.take_record(&rec)?;
            self.rx.consume(&rec);
            moved = true;
        }
        Ok(moved)
    }

    fn take_record(&mut self, rec: &Record) -> std::result::Result<(), ReceiveError> {
        let proto = |m: &str| ReceiveError::Protocol(Error::Protocol(format!("shm peer: {m}")));
        let first = rec.flags & ring::FIRST != 0;
        if first == self.filling {
            return Err(proto("message boundaries out of order"));
        }
        let Some(wr) = self.recvs.front() else {
            return Err(proto("message sent without a receive credit"));
        };
        if first {
            if rec.total > wr.len {
                let wr = self.recvs.pop_front().expect("front exists");
                let seq = self.msgs_received;
                self.seg
                    .ctrl(self.side)
                    .fatal
                    .store(FATAL_LENGTH << 48 | seq, Ordering::SeqCst);
                self.finish_recv(wr, WcStatus::LocalLength, rec.total, None);
                return Err(ReceiveError::Length);
            }
            self.filling = true;
            self.filled = 0;
        }
        if self.filled + rec.len > rec.total.min(wr.len) {
            return Err(proto("message longer than announced"));
        }
        let dst = wr
            .mr
            .slice_ptr(wr.offset + self.filled, rec.len)
            .map_err(ReceiveError::Protocol)?;
        // SAFETY: `dst` was bounds-checked against the receive's region (valid while the work
        // request holds it) and `rec.payload` against the ring (checked by `peek`).
        unsafe { std::ptr::copy_nonoverlapping(rec.payload, dst, rec.len) };
        self.filled += rec.len;
        if rec.flags & ring::LAST != 0 {
            if self.filled != rec.total {
                return Err(proto("message shorter than announced"));
            }
            let imm = (rec.flags & ring::IMM != 0).then_some(rec.imm);
            let wr = self.recvs.pop_front().expect("front exists");
            self.finish_recv(wr, WcStatus::Success, rec.total, imm);
            self.filling = false;
            self.msgs_received += 1;
        }
        Ok(())
    }

    /// Rings the peer's doorbell if it sleeps.
    fn ring_peer(&self) {
        let peer = self.seg.ctrl(1 - self.side);
        // SeqCst fence: our ring/credit stores above are ordered before reading the peer's
        // `sleeping`, pairing with its store of `sleeping` before its final re-check (Dekker).
        fence(Ordering::SeqCst);
        if peer.sleeping.load(Ordering::SeqCst) == 1
            && peer
                .sleeping
                .compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            self.send_packet(WAKE);
        }
    }

    fn send_packet(&self, b: u8) {
        // SAFETY: sends one byte from a live local; MSG_NOSIGNAL turns a closed peer into EPIPE,
        // which is ignored here because the hang-up is noticed by the poll in `sleep`.
        unsafe {
            libc::send(
                self.sock.as_raw_fd(),
                (&raw const b).cast(),
                1,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
    }

    /// Whether anything could move now (checked after announcing sleep).
    fn has_work(&self) -> bool {
        if !self.sh.sq.is_empty() || !self.sh.rq.is_empty() || self.sh.stop.load(Ordering::SeqCst) {
            return true;
        }
        if self.rx.has_data().unwrap_or(true) {
            return true;
        }
        if !self.inflight.is_empty() {
            match self.tx.head() {
                Ok(h) if self.inflight.front().is_some_and(|f| f.end <= h) => return true,
                Err(_) => return true,
                Ok(_) => {}
            }
        }
        if !self.pending.is_empty() {
            // A stalled sender waits for credits or ring space: did either change since the
            // last attempt?
            let credits = self
                .seg
                .ctrl(1 - self.side)
                .recv_posted
                .load(Ordering::Acquire);
            if credits != self.seen_credits || self.tx.head().map_or(true, |h| h != self.seen_head)
            {
                return true;
            }
        }
        false
    }

    /// Sleeps until the peer rings, the user posts, or the peer hangs up.
    fn sleep(&mut self) -> std::result::Result<(), End> {
        self.seg.ctrl(self.side).sleeping.store(1, Ordering::SeqCst);
        self.sh.engine_sleeping.store(true, Ordering::SeqCst);
        // SeqCst fence: the stores above come before the re-check below (Dekker with
        // `ring_peer` and `Shared::kick`).
        fence(Ordering::SeqCst);
        let timeout = if self.has_work() {
            Duration::ZERO
        } else {
            MAX_SLEEP
        };
        let mut fds = [
            libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.sh.wake.raw(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let polled = sys::poll(&mut fds, Some(timeout));
        self.seg.ctrl(self.side).sleeping.store(0, Ordering::SeqCst);
        self.sh.engine_sleeping.store(false, Ordering::SeqCst);
        if polled.is_err() {
            return Err(End::Peer { clean: false });
        }
        if fds[1].revents != 0 {
            self.sh.wake.clear();
        }
        if fds[0].revents != 0 {
            self.drain_socket()?;
        }
        Ok(())
    }

    /// Reads doorbell packets; an end of file means the peer is gone.
    fn drain_socket(&mut self) -> std::result::Result<(), End> {
        let mut buf = [0u8; 64];
        loop {
            // SAFETY: receives into a live local buffer of the given length.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            match n {
                0 => {
                    return Err(End::Peer {
                        clean: self.peer_said_bye,
                    });
                }
                n if n > 0 => {
                    if buf[..n as usize].contains(&BYE) {
                        self.peer_said_bye = true;
                    }
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    return match e.kind() {
                        std::io::ErrorKind::WouldBlock => Ok(()),
                        std::io::ErrorKind::Interrupted => continue,
                        // A peer that closes with doorbells of ours still unread makes the
                        // kernel report a reset before the packets it sent first - its goodbye
                        // among them. The report is consumed by reading it: read on, and the
                        // goodbye (if it said one) and the end of file follow.
                        std::io::ErrorKind::ConnectionReset => continue,
                        _ => Err(End::Peer { clean: false }),
                    };
                }
            }
        }
    }

    /// Ends the connection: tells the peer, takes what it delivered, completes everything else
    /// as flushed, and reports the disconnect as this connection's last completion.
    fn teardown(&mut self, mut end: End) {
        match end {
            End::Local => self.send_packet(BYE),
            End::Peer { .. } => {
                // Everything the peer finished writing before it left is delivered.
                match self.receive() {
                    Err(ReceiveError::Length) => end = End::LocalLength,
                    Err(ReceiveError::Protocol(_)) => end = End::Protocol,
                    Ok(_) => {}
                }
                let _ = self.complete_sends();
            }
            End::LocalLength | End::Protocol => {}
        }
        // SAFETY: plain syscall on our own socket; the peer sees end of file at once.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };

        // No post can start once `closed` is seen; wait out the ones under way.
        self.sh.closed.store(true, Ordering::SeqCst);
        while self.sh.posting.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        while let Some(r) = self.sh.rq.pop() {
            self.recvs.push_back(r);
        }
        while let Some(s) = self.sh.sq.pop() {
            self.pending.push_back(s);
        }

        // Which of our sends the peer refused, if it failed the connection.
        let peer_fatal = self.seg.ctrl(1 - self.side).fatal.load(Ordering::SeqCst);
        let refused_seq =
            (peer_fatal >> 48 == FATAL_LENGTH).then_some(peer_fatal & ((1 << 48) - 1));
        while let Some(f) = self.inflight.pop_front() {
            let status = if Some(f.seq) == refused_seq {
                WcStatus::RemoteError
            } else {
                WcStatus::Flushed
            };
            self.finish_send(f.wr, status);
        }
        while let Some(wr) = self.pending.pop_front() {
            self.finish_send(wr, WcStatus::Flushed);
        }
        while let Some(wr) = self.recvs.pop_front() {
            self.finish_recv(wr, WcStatus::Flushed, 0, None);
        }
        let status = match end {
            End::Local | End::Peer { clean: true } if peer_fatal == 0 => WcStatus::Success,
            End::Local | End::Peer { .. } if refused_seq.is_some() => WcStatus::RemoteError,
            End::Peer { clean: false } => WcStatus::Transport,
            End::LocalLength => WcStatus::LocalLength,
            _ => WcStatus::General,
        };
        self.sh
            .report
            .complete(0, Opcode::Disconnected, status, 0, None);
    }
}

enum ReceiveError {
    Length,
    Protocol(Error),
}

impl From<Error> for ReceiveError {
    fn from(e: Error) -> Self {
        ReceiveError::Protocol(e)
    }
}
