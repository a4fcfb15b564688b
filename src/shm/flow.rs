//! The data path of one shm connection: posted work, the two rings and completions.
//! Whoever holds the connection's lock drives it: the thread that posts writes its message
//! straight into the outgoing ring when it has room, and the thread that polls the
//! completion queue takes incoming messages straight into the posted receives
//! ([`Progress::Caller`](crate::Progress::Caller)); the context's progress driver
//! (`engine.rs`) does the same only while somebody sleeps on the queue, or always with
//! [`Progress::Thread`](crate::Progress::Thread).
//!
//! A message goes into the ring at once, whether or not the peer has posted a receive for it
//! yet: the ring holds it until a receive is there, and the receiver takes it the moment one
//! is - the thread that posts that receive takes it on the spot - so a send that waited for
//! its receive moves with no wake-up of the sender, its library's thread or a timer. A slow
//! receiver holds the sender back by the ring's room, and nothing is lost. A send completes
//! when the receiver has taken it out of the ring, as an RC send completes when the peer
//! acknowledges it; a receive too small for its message fails the connection and the send with
//! [`WcStatus::RemoteError`].

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::conn::{
    End, PooledRecv, SrqInner, Unfinished, Waiter, admit_recv, admit_send, ensure_up,
    flush_outstanding,
};
use crate::cq::notice::Board;
use crate::cq::{Completion, Opcode, Reporter, Sink, WcStatus};
use crate::error::{Error, Result};
use crate::fifo::Fifo;
use crate::mr::MemoryRegion;
use crate::shm::onesided::{self, Exports, SocketReader};
use crate::shm::ring::{self, Consumer, Producer, Record};
use crate::shm::segment::{
    FATAL_ACCESS, FATAL_LENGTH, FATAL_PROTOCOL, READS_PEER_NO, READS_PEER_YES, Segment,
};
use crate::shm::wire::{WAKE, send_packet};
use crate::shm::{bell, direct};

/// [`Flow::gate`] of a connection that is down: above every send queue's depth.
pub(crate) const GATE_DOWN: usize = usize::MAX;

/// The regions shared on a connection, both ways: its exports, to expose the region a send
/// comes from, and the reader of its socket, which knows the regions the peer exposed. A flow
/// needs them for large messages in one copy through the mapping of a region the library
/// allocated (see `onesided/`).
pub(crate) struct SharedRegions {
    pub(crate) exports: Arc<Exports>,
    pub(crate) inbox: Arc<Mutex<SocketReader>>,
}

/// Where a send's bytes come from while it waits to be written into the ring.
pub(crate) enum SendSrc {
    Region {
        mr: Arc<MemoryRegion>,
        offset: usize,
    },
    Inline(Box<[u8]>),
}

/// What a queued work request sends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendKind {
    /// A message.
    Send,
    /// The record of a write with immediate data, whose `written` bytes are in place.
    WriteImm { imm: u32, written: usize },
}

impl SendKind {
    fn opcode(self) -> Opcode {
        match self {
            SendKind::Send => Opcode::Send,
            SendKind::WriteImm { .. } => Opcode::Write,
        }
    }
}

/// A send not yet fully written into the ring.
pub(crate) struct SendWr {
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    pub(crate) len: usize,
    pub(crate) src: SendSrc,
    pub(crate) kind: SendKind,
}

impl SendWr {
    /// Start of the bytes to send (valid for `len` bytes while the work request lives).
    fn ptr(&self) -> *const u8 {
        match &self.src {
            SendSrc::Region { mr, offset } => mr
                .slice_ptr(*offset, self.len)
                .expect("range checked when posted")
                .cast_const(),
            SendSrc::Inline(b) => b.as_ptr(),
        }
    }
}

/// A posted receive.
pub(crate) struct RecvWr {
    pub(crate) wr_id: u64,
    pub(crate) mr: Arc<MemoryRegion>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl From<PooledRecv> for RecvWr {
    fn from(r: PooledRecv) -> Self {
        RecvWr {
            wr_id: r.wr_id,
            mr: r.mr,
            offset: r.offset,
            len: r.len,
        }
    }
}

/// The shared receive queue a connection takes its receives from (see `conn/srq.rs`).
pub(crate) struct Pool {
    pub(crate) srq: Arc<SrqInner>,
    /// The connection, as the pool's waiter.
    pub(crate) me: Weak<dyn Waiter>,
    /// The connection waits for the pool: a message found it empty.
    waiting: bool,
    /// The connection's messages may take the pool's receives: its `Connected` record is on
    /// the queue, which none of its completions may precede (before, messages wait in the
    /// ring, as for a connection whose receives are not posted yet).
    open: bool,
}

impl Pool {
    pub(crate) fn new(srq: Arc<SrqInner>, me: Weak<dyn Waiter>) -> Pool {
        Pool {
            srq,
            me,
            waiting: false,
            open: false,
        }
    }
}

/// One send fully in the ring, waiting for the peer to take it. Its bytes are no longer
/// needed, so it holds no buffer.
struct InFlight {
    end: u64,
    seq: u64,
    wr_id: u64,
    signaled: bool,
    opcode: Opcode,
    /// How it ended, for a one-sided operation that ran already and only waits for the sends
    /// before it to complete first; `Success` otherwise.
    status: WcStatus,
    /// A one-sided operation that finished with nothing in flight before it: it waits only
    /// for a poll to report it (`end` 0), and is reported with `status` even if the
    /// connection ends first.
    done: bool,
    /// A direct send's region, which the peer reads until it takes the record.
    _hold: Option<Arc<MemoryRegion>>,
}

/// Why taking a message failed: a receive too small for it, or a peer that broke the ring
/// protocol (what it broke is not reported further: the connection ends either way).
enum ReceiveError {
    Length,
    Protocol,
}

impl From<Error> for ReceiveError {
    fn from(_: Error) -> Self {
        ReceiveError::Protocol
    }
}

/// The state of one connection's data path, kept under the connection's lock.
pub(crate) struct Flow {
    seg: Arc<Segment>,
    side: usize,
    /// The handshake socket, for doorbells; owned by the connection's driver handler, which
    /// closes it only after setting `closed` under the lock.
    sock: RawFd,
    tx: Producer,
    rx: Consumer,
    max_chunk: usize,
    send_depth: usize,
    recv_depth: usize,
    /// Sends not yet fully written; the front one has `copied` bytes in the ring.
    pending: Fifo<SendWr>,
    copied: usize,
    inflight: Fifo<InFlight>,
    /// How many of `inflight` report a completion when they end (see `sleep_request`).
    inflight_signaled: usize,
    /// Posted receives; the front one has `filled` bytes of a message when `filling`. With a
    /// shared receive queue, the one receive taken from it for the message being taken.
    recvs: Fifo<RecvWr>,
    /// The shared receive queue the receives come from, if any.
    pool: Option<Pool>,
    filling: bool,
    filled: usize,
    /// Messages started, messages received.
    msgs_started: u64,
    msgs_received: u64,
    /// The ring's head when the sender last tried to write.
    seen_head: u64,
    /// The peer's notice board and our slot there: marked whenever the peer has news.
    peer_board: Option<(Arc<Board>, u32)>,
    /// The peer's process, when this side can copy from its memory (direct records).
    peer_pid: Option<libc::pid_t>,
    /// The peer can copy from ours, so large sends may go direct (known once it says so).
    peer_reads_us: bool,
    /// Messages through a region's mapping (see [`SharedRegions`]).
    regions: SharedRegions,
    /// The id of the region the last message through a mapping came from, and its key: a
    /// region exposed on the connection stays so while it lives, and ids are never reused.
    sent_from: Option<(u64, u64)>,
    /// See [`Flow::take_inbox_news`].
    inbox_news: bool,
    /// No more posting or progress: the connection is down (set by its driver in teardown).
    pub(crate) closed: bool,
    /// Why the connection must end, as found by whoever drove it; its driver tears it down.
    pub(crate) failed: Option<End>,
}

impl Flow {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        seg: Arc<Segment>,
        side: usize,
        sock: RawFd,
        send_depth: u32,
        recv_depth: u32,
        peer_board: Option<(Arc<Board>, u32)>,
        peer_pid: Option<libc::pid_t>,
        regions: SharedRegions,
        pool: Option<Pool>,
    ) -> Flow {
        let reads = if peer_pid.is_some() {
            READS_PEER_YES
        } else {
            READS_PEER_NO
        };
        // Release: nothing to order before it, but the peer reads it with Acquire.
        seg.ctrl(side).reads_peer.store(reads, Ordering::Release);
        let cap = seg.cap();
        // SAFETY: the cursors and rings live in `seg`, which the flow owns: the mapping lasts
        // as long as the producer and consumer can be used (they touch no memory when
        // dropped). Side `side` is the only producer of ring `side` and the only consumer of
        // ring `1 - side`, and the flow's lock makes one thread at a time drive them.
        let (tx, rx) = unsafe {
            (
                Producer::new(seg.head(side), seg.data(side), cap),
                Consumer::new(seg.head(1 - side), seg.data(1 - side), cap),
            )
        };
        Flow {
            side,
            sock,
            tx,
            rx,
            max_chunk: (cap / 4).min(64 * 1024),
            send_depth: send_depth as usize,
            recv_depth: recv_depth as usize,
            seg,
            pending: Fifo::with_capacity(send_depth as usize),
            copied: 0,
            inflight: Fifo::with_capacity(send_depth as usize),
            inflight_signaled: 0,
            recvs: Fifo::with_capacity(if pool.is_some() {
                1
            } else {
                recv_depth as usize
            }),
            pool,
            filling: false,
            filled: 0,
            msgs_started: 0,
            msgs_received: 0,
            seen_head: 0,
            peer_board,
            peer_pid,
            peer_reads_us: false,
            regions,
            sent_from: None,
            inbox_news: false,
            closed: false,
            failed: None,
        }
    }

    /// Whether the connection is down: closed, or failed and waiting for its driver to close
    /// it. It takes no more work either way.
    fn down(&self) -> bool {
        self.closed || self.failed.is_some()
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        ensure_up(self.down())
    }

    /// What the connection's lock-free one-sided path may rely on, published whenever the
    /// lock is let go (see `conn::FlowGuard`): the send queue's slots in use, or [`GATE_DOWN`]
    /// once the connection is closed or failed.
    pub(crate) fn gate(&self) -> usize {
        if self.down() {
            GATE_DOWN
        } else {
            self.pending.len() + self.inflight.len()
        }
    }

    pub(crate) fn claim_send(&self) -> Result<()> {
        let outstanding = self.pending.len() + self.inflight.len();
        admit_send(self.down(), outstanding, self.send_depth)
    }

    /// Posts a send of `len` bytes at `ptr` (inside `region`, when they are in one): written
    /// into the ring at once, or started as a direct record, when nothing waits before it and
    /// the ring has room (the bytes are then no longer needed, or held with the region);
    /// otherwise queued, with `keep` making the bytes outlive the call.
    ///
    /// `gate`: the flow's [`gate`](Self::gate) as the caller read it at the start of its hold
    /// of the flow's lock (what the guard published as the lock was last let go, which nothing
    /// has changed since): below the send queue's depth, the connection is open and the send
    /// has its slot, which saves working that out again; otherwise the send is refused.
    ///
    /// # Safety
    /// `ptr` is readable for `len` bytes during the call.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post_send(
        &mut self,
        gate: usize,
        ptr: *const u8,
        len: usize,
        wr_id: u64,
        signaled: bool,
        region: Option<&Arc<MemoryRegion>>,
        keep: impl FnOnce() -> SendSrc,
    ) -> Result<()> {
        debug_assert_eq!(gate, self.gate());
        if gate >= self.send_depth {
            // Down or full: which of the two, as the others say it.
            self.claim_send()?;
        }
        let mut copied = 0;
        let direct = match region {
            Some(mr) if self.pending.is_empty() => self.direct_key(len, mr).map(|k| (mr, k)),
            _ => None,
        };
        if let Some((mr, key)) = direct {
            let started = self.start_direct(ptr, len, wr_id, signaled, mr, key);
            if self.or_fail(started)? {
                self.ring_peer();
                return Ok(());
            }
        } else if self.pending.is_empty() {
            // SAFETY: the caller's contract.
            let started = unsafe { self.start_message(ptr, len, wr_id, signaled) };
            match self.or_fail(started)? {
                Some(n) if n == len => {
                    self.ring_peer();
                    return Ok(());
                }
                Some(n) => copied = n,
                None => {}
            }
        }
        let src = keep();
        self.pending.push_back(SendWr {
            wr_id,
            signaled,
            len,
            src,
            kind: SendKind::Send,
        });
        if copied > 0 {
            // This send is the front one, partly written.
            self.copied = copied;
        }
        self.wait_for_room(copied > 0)
    }

    /// Posts the record of a write with immediate data whose `written` bytes are already in
    /// the peer's memory: it consumes a receive there like a message, so it goes into the ring
    /// (behind the sends that wait for room) as a send does, and completes when the peer took
    /// it.
    pub(crate) fn post_write_imm(
        &mut self,
        imm: u32,
        written: usize,
        wr_id: u64,
        signaled: bool,
    ) -> Result<()> {
        self.claim_send()?;
        if self.pending.is_empty() {
            let wrote = self.tx.write_imm(imm, written);
            if self.or_fail(wrote)? {
                self.start_write_imm(wr_id, signaled);
                self.ring_peer();
                return Ok(());
            }
        }
        self.pending.push_back(SendWr {
            wr_id,
            signaled,
            len: 0,
            src: SendSrc::Inline(Box::default()),
            kind: SendKind::WriteImm { imm, written },
        });
        self.wait_for_room(false)
    }

    /// After a send (or write with immediate data) was queued to wait for ring space: asks the
    /// peer for a doorbell when it frees some, so the connection's driver can move it on even
    /// if nobody polls here. Then writes what fits now, which also covers room made before the
    /// request (Dekker with `ring_peer`), and tells the peer about everything written
    /// (`wrote`: some of the send went in already).
    fn wait_for_room(&mut self, wrote: bool) -> Result<()> {
        self.set_sleeping(bell::RECORDS | bell::TAKEN);
        let moved = self.transmit();
        if self.or_fail(moved)? || wrote {
            self.ring_peer();
        }
        Ok(())
    }

    /// Passes `r` on, having failed the connection when it is an error: writing into the
    /// ring or reading the peer's words found the peer breaking the protocol.
    fn or_fail<T>(&mut self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.fail_protocol();
        }
        r
    }

    /// A one-sided operation ran (at post time) and ended with `status`: it completes now,
    /// or, when sends are in flight, after them, so that the connection's completions come in
    /// the order the work was posted (sends still waiting for ring space do not hold it
    /// back). An unsignaled success reports nothing and takes no slot. A
    /// signaled success with nothing in flight is reported by the next poll, straight into the
    /// caller's hands as a send's completion is, rather than through the queue (whose blocks a
    /// push allocates now and then); until then it holds a slot, as over verbs.
    pub(crate) fn finish_onesided(
        &mut self,
        report: &Reporter,
        wr_id: u64,
        opcode: Opcode,
        status: WcStatus,
        signaled: bool,
    ) {
        if !signaled && status == WcStatus::Success {
            return;
        }
        let done = self.inflight.is_empty();
        if done && status != WcStatus::Success {
            // The connection fails with it: reported at once.
            report.complete(wr_id, opcode, status, 0, None);
            return;
        }
        self.push_inflight(InFlight {
            // Nothing before it to wait for: any head passes it.
            end: if done { 0 } else { self.tx.tail() },
            // Never a message's number: the peer refuses none of it.
            seq: u64::MAX,
            wr_id,
            signaled: true,
            opcode,
            status,
            done,
            _hold: None,
        });
    }

    /// Puts `f` in flight, behind the others.
    #[inline]
    fn push_inflight(&mut self, f: InFlight) {
        self.inflight_signaled += usize::from(f.signaled);
        self.inflight.push_back(f);
    }

    /// A write-with-immediate record went into the ring: it is in flight.
    fn start_write_imm(&mut self, wr_id: u64, signaled: bool) {
        self.msgs_started += 1;
        self.push_inflight(InFlight {
            end: self.tx.tail(),
            seq: self.msgs_started - 1,
            wr_id,
            signaled,
            opcode: Opcode::Write,
            status: WcStatus::Success,
            done: false,
            _hold: None,
        });
    }

    /// The connection's socket (open while the flow is not closed).
    pub(crate) fn sock(&self) -> RawFd {
        self.sock
    }

    /// A one-sided operation of this side was refused by what the peer registered: the
    /// connection fails (its driver tears it down), as a verbs queue pair goes to error.
    pub(crate) fn fail_access(&mut self) {
        self.seg
            .ctrl(self.side)
            .fatal
            .store(FATAL_ACCESS << 48, Ordering::SeqCst);
        self.failed
            .get_or_insert(End::Failed(WcStatus::RemoteAccess));
    }

    /// Whether sends wait for ring space.
    pub(crate) fn blocked(&self) -> bool {
        !self.pending.is_empty()
    }

    /// How a send of `len` bytes from `mr` goes in one copy (a direct record), when the peer
    /// may read this process's memory (it said so; otherwise the message goes through the
    /// ring, as it does when `None` is returned): `Some(key)` of `mr` as exposed to the peer,
    /// which copies from its own mapping of it (a region the library allocated, from
    /// [`direct::MAPPED_MIN`] bytes; the peer can read no more than it already could);
    /// `Some(0)` when it copies from this process with `process_vm_readv` (from
    /// [`direct::DIRECT_MIN`] bytes).
    #[inline]
    fn direct_key(&mut self, len: usize, mr: &Arc<MemoryRegion>) -> Option<u64> {
        if len < direct::MAPPED_MIN {
            return None;
        }
        self.direct_key_large(len, mr)
    }

    /// [`direct_key`](Self::direct_key) for a message of at least [`direct::MAPPED_MIN`]
    /// bytes (a call: small messages, the common case, stop before it).
    #[inline(never)]
    fn direct_key_large(&mut self, len: usize, mr: &Arc<MemoryRegion>) -> Option<u64> {
        if !self.peer_reads_us() {
            return None;
        }
        if let Some((id, key)) = self.sent_from
            && id == mr.id()
        {
            return Some(key);
        }
        if let Some(key) = self.regions.exports.expose_for_send(self.sock, mr) {
            self.sent_from = Some((mr.id(), key));
            return Some(key);
        }
        (len >= direct::DIRECT_MIN).then_some(0)
    }

    /// Whether the peer has said it can copy from this process.
    fn peer_reads_us(&mut self) -> bool {
        if !self.peer_reads_us {
            self.peer_reads_us = self
                .seg
                .ctrl(1 - self.side)
                .reads_peer
                .load(Ordering::Acquire)
                == READS_PEER_YES;
        }
        self.peer_reads_us
    }

    /// Starts a message of `len` bytes at `ptr` (inside `mr`) as a direct record if the ring
    /// has room; returns whether it did. The send holds `mr` until the peer takes the
    /// record, which it does only after copying the bytes.
    #[allow(clippy::too_many_arguments)]
    fn start_direct(
        &mut self,
        ptr: *const u8,
        len: usize,
        wr_id: u64,
        signaled: bool,
        mr: &Arc<MemoryRegion>,
        key: u64,
    ) -> Result<bool> {
        if !self.tx.write_direct(ptr as u64, key, len)? {
            return Ok(false);
        }
        self.msgs_started += 1;
        self.push_inflight(InFlight {
            end: self.tx.tail(),
            seq: self.msgs_started - 1,
            wr_id,
            signaled,
            opcode: Opcode::Send,
            status: WcStatus::Success,
            done: false,
            _hold: Some(mr.clone()),
        });
        Ok(true)
    }

    /// Writes the first record of a new message if the ring has room; returns how many
    /// bytes went in (`None`: nothing did). A message written whole is in flight.
    ///
    /// # Safety
    /// `ptr` is readable for `len` bytes.
    unsafe fn start_message(
        &mut self,
        ptr: *const u8,
        len: usize,
        wr_id: u64,
        signaled: bool,
    ) -> Result<Option<usize>> {
        let want = len.min(self.max_chunk);
        // SAFETY: `ptr` is readable for `len >= want` bytes (caller contract).
        let wrote = unsafe { self.tx.write(ptr, want, true, want == len, None, len)? };
        let Some(n) = wrote else { return Ok(None) };
        self.msgs_started += 1;
        if n == len {
            self.push_inflight(InFlight {
                end: self.tx.tail(),
                seq: self.msgs_started - 1,
                wr_id,
                signaled,
                opcode: Opcode::Send,
                status: WcStatus::Success,
                done: false,
                _hold: None,
            });
        }
        Ok(Some(n))
    }

    /// Posts a receive. A message that waited in the ring for it (the peer sent before any
    /// receive was there) is taken now, on this thread: its completion goes into the queue
    /// and the peer's send completes, with no wake-up of either side in between. A reason to
    /// end the connection found on the way is left in `failed` (the post itself succeeded).
    pub(crate) fn post_recv(&mut self, wr: RecvWr, report: &Reporter) -> Result<()> {
        // The core refuses a pooled connection's own receives before they get here.
        debug_assert!(self.pool.is_none());
        admit_recv(self.down(), self.recvs.len(), self.recv_depth)?;
        let starved = self.recvs.is_empty();
        self.recvs.push_back(wr);
        // Only the first receive can find a message waiting for one: with receives posted,
        // messages are taken as they come. The look reads the stamp at our head, the line
        // the next poll reads anyway.
        if starved && self.rx.has_data().unwrap_or(true) {
            self.take_waiting(report);
        }
        Ok(())
    }

    /// The shared receive queue was refilled while a message waited for it: takes what
    /// waits, as the post of a receive of the connection's own does.
    pub(crate) fn pool_refilled(&mut self, report: &Reporter) {
        if let Some(pool) = &mut self.pool {
            pool.waiting = false;
        }
        if !self.down() {
            self.take_waiting(report);
        }
    }

    /// Lets the connection's messages take the pool's receives, and takes those that waited.
    /// Returns whether the connection has a pool.
    pub(crate) fn open_pool(&mut self, report: &Reporter) -> bool {
        let Some(pool) = &mut self.pool else {
            return false;
        };
        pool.open = true;
        self.pool_refilled(report);
        true
    }

    /// Takes the messages that waited for receives, on the thread that gave them one: their
    /// completions go into the queue and the peer's sends complete, with no wake-up of either
    /// side in between. A reason to end the connection found on the way is left in `failed`.
    fn take_waiting(&mut self, report: &Reporter) {
        let taken = match self.receive(report, usize::MAX, &mut Sink::queue(&report.cq)) {
            Ok(taken) => taken,
            Err(ReceiveError::Length) => {
                self.failed
                    .get_or_insert(End::Failed(WcStatus::LocalLength));
                return;
            }
            Err(ReceiveError::Protocol) => {
                self.fail_protocol();
                return;
            }
        };
        if taken {
            // The peer's send completed and its ring has room: a doorbell if it sleeps
            // waiting for that.
            self.notify_peer(bell::TAKEN);
        }
    }

    /// Whether a receive is there for the next message: one of the connection's own, or one
    /// it takes from its shared receive queue now. Without one, the connection waits for the
    /// pool (its next post hands it receives).
    #[inline]
    fn recv_ready(&mut self) -> bool {
        if !self.recvs.is_empty() {
            return true;
        }
        let Some(pool) = self.pool.as_mut().filter(|p| p.open) else {
            return false;
        };
        let waiter = (!pool.waiting).then_some(&pool.me);
        match pool.srq.take(waiter) {
            Some(r) => {
                self.recvs.push_back(r.into());
                true
            }
            None => {
                pool.waiting = true;
                false
            }
        }
    }

    /// Whether a message in the ring could find a receive now (a look, taking none).
    #[inline]
    fn recvs_available(&self) -> bool {
        !self.recvs.is_empty()
            || self
                .pool
                .as_ref()
                .is_some_and(|p| p.open && p.srq.available())
    }

    /// Records a protocol failure of the peer in our control words; the connection ends.
    fn fail_protocol(&mut self) {
        self.seg
            .ctrl(self.side)
            .fatal
            .store(FATAL_PROTOCOL << 48, Ordering::SeqCst);
        self.failed.get_or_insert(End::Failed(WcStatus::General));
    }

    /// One pass over everything: fills receives from the incoming ring, completes the sends
    /// the peer took (see below), writes what waits into the outgoing ring, and rings the peer
    /// if it sleeps and something changed for it. Completions go to `out` in order. At most
    /// `limit` messages are taken (the rest wait in the ring for the next step, so that a
    /// poller that asked for that many completions gets them without the surplus going
    /// through the queue). Returns whether anything moved; a reason to end the connection is
    /// left in `failed`.
    pub(crate) fn step(&mut self, report: &Reporter, limit: usize, out: &mut Sink<'_>) -> bool {
        if self.closed || self.failed.is_some() {
            return false;
        }
        let mut moved = false;
        // What the peer must hear of: a doorbell if it sleeps waiting for it, and a mark on
        // its board if it asked for marks (see `notify_peer`).
        let mut news = 0;
        let received = match self.receive(report, limit, out) {
            Ok(m) => m,
            Err(ReceiveError::Length) => {
                self.failed = Some(End::Failed(WcStatus::LocalLength));
                return true;
            }
            Err(ReceiveError::Protocol) => {
                self.fail_protocol();
                return true;
            }
        };
        moved |= received;
        if received {
            news |= bell::TAKEN;
        }
        // Sends complete when the peer has taken them, which means reading the peer's cursor:
        // a cache line the peer writes. A step that delivered messages leaves that for the
        // next one (the caller is waiting for what it got), unless the send queue is filling.
        if !received || 2 * self.inflight.len() >= self.send_depth {
            match self.complete_sends(report, out) {
                Ok(m) => moved |= m,
                Err(_) => {
                    self.fail_protocol();
                    return true;
                }
            }
        }
        match self.transmit() {
            Ok(m) => {
                moved |= m;
                if m {
                    news |= bell::RECORDS;
                }
            }
            Err(_) => {
                self.fail_protocol();
                return true;
            }
        }
        if news != 0 {
            self.notify_peer(news);
        }
        moved
    }

    /// Whether sends are in flight or waiting: the connection then needs looking at until they
    /// complete, which the peer announces only on the board (when asked to).
    pub(crate) fn busy(&self) -> bool {
        !self.inflight.is_empty() || !self.pending.is_empty()
    }

    /// Writes as much of the waiting sends into the ring as its room allows.
    fn transmit(&mut self) -> Result<bool> {
        if self.pending.is_empty() {
            return Ok(false);
        }
        self.seen_head = self.tx.head()?;
        let mut moved = false;
        while let Some(wr) = self.pending.front() {
            let first = self.copied == 0;
            if let SendKind::WriteImm { imm, written } = wr.kind {
                if !self.tx.write_imm(imm, written)? {
                    break;
                }
                let wr = self.pending.pop_front().expect("front exists");
                self.start_write_imm(wr.wr_id, wr.signaled);
                moved = true;
                continue;
            }
            let region = match &wr.src {
                SendSrc::Region { mr, .. } if first && wr.len >= direct::MAPPED_MIN => {
                    Some(mr.clone())
                }
                _ => None,
            };
            let len = wr.len;
            if let Some(mr) = region
                && let Some(key) = self.direct_key(len, &mr)
            {
                let wr = self.pending.front().expect("front exists");
                let (ptr, len, wr_id, signaled) = (wr.ptr(), wr.len, wr.wr_id, wr.signaled);
                if !self.start_direct(ptr, len, wr_id, signaled, &mr, key)? {
                    break;
                }
                self.pending.pop_front();
                moved = true;
                continue;
            }
            let wr = self.pending.front().expect("front exists");
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
                self.push_inflight(InFlight {
                    end: self.tx.tail(),
                    seq: self.msgs_started - 1,
                    wr_id: wr.wr_id,
                    signaled: wr.signaled,
                    opcode: Opcode::Send,
                    status: WcStatus::Success,
                    done: false,
                    _hold: None,
                });
                self.copied = 0;
            }
        }
        Ok(moved)
    }

    /// Completes the sends the peer has taken out of the ring.
    fn complete_sends(&mut self, report: &Reporter, out: &mut Sink<'_>) -> Result<bool> {
        if self.inflight.is_empty() {
            return Ok(false);
        }
        let head = self.tx.head()?;
        let mut moved = false;
        while let Some(f) = self.inflight.front()
            && f.end <= head
        {
            let (signaled, wr_id, opcode) = (f.signaled, f.wr_id, f.opcode);
            // The slot is free before the completion is seen (dropped first): a caller that
            // reaps it may post again at once, as with a verbs queue pair.
            self.inflight.drop_front();
            if signaled {
                self.inflight_signaled -= 1;
                out.put(report.record(wr_id, opcode, WcStatus::Success, 0, None));
            }
            moved = true;
        }
        Ok(moved)
    }

    /// Moves records from the incoming ring into posted receives, until `limit` messages
    /// have completed or no receive is left: a message that finds none waits in the ring
    /// (see `post_recv`).
    fn receive(
        &mut self,
        report: &Reporter,
        limit: usize,
        out: &mut Sink<'_>,
    ) -> std::result::Result<bool, ReceiveError> {
        let mut moved = false;
        let mut done = 0;
        while done < limit
            && (!self.recvs.is_empty() || self.pool.is_some())
            && let Some(rec) = self.rx.peek()?
        {
            if !self.recv_ready() {
                break;
            }
            if rec.flags & WHOLE_MASK == ring::FIRST | ring::LAST && !self.filling {
                self.take_whole(&rec, report, out)?;
                done += 1;
                moved = true;
                continue;
            }
            let delivered = self.take_record(&rec, report, out)?;
            self.rx.consume(&rec);
            // A message's completion goes out only once its record is consumed: the peer's
            // send is then taken (our cursor moved) before any thread can see the message and
            // answer it, so the peer completes its send before it sees the answer.
            if let Some(c) = delivered {
                out.put(c);
                done += 1;
            }
            moved = true;
        }
        Ok(moved)
    }

    /// Takes a message that is whole in one record (the usual small message; a record
    /// without the extra flags of a direct record or a write with immediate data): the
    /// checks of [`take_record`](Self::take_record) for that case, without its bookkeeping
    /// of a message in parts, and the record consumed before the completion goes to `out`
    /// (see `receive`): written there directly, this being the hot path.
    #[inline]
    fn take_whole(
        &mut self,
        rec: &Record,
        report: &Reporter,
        out: &mut Sink<'_>,
    ) -> std::result::Result<(), ReceiveError> {
        let Some(wr) = self.recvs.front() else {
            return Err(ReceiveError::Protocol);
        };
        if rec.total > wr.len {
            return Err(self.refuse_length(rec.total, report, out));
        }
        if rec.len != rec.total {
            return Err(ReceiveError::Protocol);
        }
        let dst = wr
            .mr
            .slice_ptr(wr.offset, rec.len)
            .map_err(|_| ReceiveError::Protocol)?;
        // SAFETY: `dst` was bounds-checked against the receive's region (valid while the work
        // request holds it) and `rec.payload` against the ring (checked by `peek`).
        unsafe { std::ptr::copy_nonoverlapping(rec.payload, dst, rec.len) };
        let wr_id = self.finish_recv(report, out)?;
        let imm = (rec.flags & ring::IMM != 0).then_some(rec.imm);
        self.rx.consume(rec);
        out.put(report.record(
            wr_id,
            Opcode::Recv,
            WcStatus::Success,
            rec.total as u32,
            imm,
        ));
        Ok(())
    }

    /// Takes one record into the front receive. Returns the completion of the message when
    /// this record ended it (see `receive`).
    fn take_record(
        &mut self,
        rec: &Record,
        report: &Reporter,
        out: &mut Sink<'_>,
    ) -> std::result::Result<Option<Completion>, ReceiveError> {
        let proto = |_: &str| ReceiveError::Protocol;
        if rec.flags & ring::DIRECT != 0 {
            return self.take_direct(rec, report, out).map(Some);
        }
        if rec.flags & ring::WRITE_IMM != 0 {
            return self.take_write_imm(rec, report, out).map(Some);
        }
        let first = rec.flags & ring::FIRST != 0;
        if first == self.filling {
            return Err(proto("message boundaries out of order"));
        }
        let Some(wr) = self.recvs.front() else {
            return Err(proto("message without a receive"));
        };
        if first {
            if rec.total > wr.len {
                return Err(self.refuse_length(rec.total, report, out));
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
            .map_err(|_| ReceiveError::Protocol)?;
        // SAFETY: `dst` was bounds-checked against the receive's region (valid while the work
        // request holds it) and `rec.payload` against the ring (checked by `peek`).
        unsafe { std::ptr::copy_nonoverlapping(rec.payload, dst, rec.len) };
        self.filled += rec.len;
        if rec.flags & ring::LAST != 0 {
            if self.filled != rec.total {
                return Err(proto("message shorter than announced"));
            }
            let imm = (rec.flags & ring::IMM != 0).then_some(rec.imm);
            return self
                .deliver(Opcode::Recv, rec.total, imm, report, out)
                .map(Some);
        }
        Ok(None)
    }

    /// The front receive holds a whole message of `total` bytes (or was consumed by a write
    /// with immediate data: `opcode`): it completes. Returns its completion, which goes out
    /// once the record is consumed (see `receive`).
    ///
    /// First come the completions of our sends the peer took before it finished this message:
    /// a program that waits for its send's completion and then for the answer to it sees them
    /// in that order, as over verbs. (The peer's cursor is read only while sends are in flight;
    /// the record's stamp, taken with Acquire, came after the peer moved it.)
    #[inline]
    fn deliver(
        &mut self,
        opcode: Opcode,
        total: usize,
        imm: Option<u32>,
        report: &Reporter,
        out: &mut Sink<'_>,
    ) -> std::result::Result<Completion, ReceiveError> {
        let wr_id = self.finish_recv(report, out)?;
        Ok(report.record(wr_id, opcode, WcStatus::Success, total as u32, imm))
    }

    /// The front receive is done: the sends the peer took before come first (see
    /// [`deliver`](Self::deliver)), then the receive leaves the queue. Returns its `wr_id`.
    #[inline]
    fn finish_recv(
        &mut self,
        report: &Reporter,
        out: &mut Sink<'_>,
    ) -> std::result::Result<u64, ReceiveError> {
        if !self.inflight.is_empty() {
            self.complete_sends(report, out)?;
        }
        let wr = self.recvs.pop_front().expect("a receive is posted");
        self.filling = false;
        self.msgs_received += 1;
        Ok(wr.wr_id)
    }

    /// A receive too small for the message of `total` bytes: the receive fails, and so does
    /// the connection, telling the peer which message it refused.
    fn refuse_length(
        &mut self,
        total: usize,
        report: &Reporter,
        out: &mut Sink<'_>,
    ) -> ReceiveError {
        let wr = self.recvs.pop_front().expect("a receive is posted");
        let seq = self.msgs_received;
        self.seg
            .ctrl(self.side)
            .fatal
            .store(FATAL_LENGTH << 48 | seq, Ordering::SeqCst);
        out.put(report.record(
            wr.wr_id,
            Opcode::Recv,
            WcStatus::LocalLength,
            total as u32,
            None,
        ));
        ReceiveError::Length
    }

    /// Takes a write-with-immediate record: the peer's bytes are in place (its stamp, taken
    /// with Acquire, was released after them), so the front receive completes with the
    /// immediate value and the length written; its buffer is untouched.
    fn take_write_imm(
        &mut self,
        rec: &Record,
        report: &Reporter,
        out: &mut Sink<'_>,
    ) -> std::result::Result<Completion, ReceiveError> {
        let whole = ring::FIRST | ring::LAST | ring::IMM;
        if self.filling || rec.flags & whole != whole || rec.len != 0 {
            return Err(ReceiveError::Protocol);
        }
        if self.recvs.is_empty() {
            return Err(ReceiveError::Protocol);
        }
        self.deliver(Opcode::RecvWriteImm, rec.total, Some(rec.imm), report, out)
    }

    /// Takes a direct record: copies the whole message from the peer's memory into the
    /// receive. The record is consumed (and the peer's send completes) only after the copy.
    fn take_direct(
        &mut self,
        rec: &Record,
        report: &Reporter,
        out: &mut Sink<'_>,
    ) -> std::result::Result<Completion, ReceiveError> {
        let whole = ring::FIRST | ring::LAST;
        // A direct record is a whole message.
        if self.filling || rec.flags & whole != whole || rec.len != ring::DIRECT_PAYLOAD {
            return Err(ReceiveError::Protocol);
        }
        let Some(wr) = self.recvs.front() else {
            return Err(ReceiveError::Protocol);
        };
        if rec.total > wr.len {
            return Err(self.refuse_length(rec.total, report, out));
        }
        let dst = wr
            .mr
            .slice_ptr(wr.offset, rec.total)
            .map_err(|_| ReceiveError::Protocol)?;
        // SAFETY: the payload is DIRECT_PAYLOAD bytes inside the ring (checked by `peek`).
        let payload = unsafe {
            rec.payload
                .cast::<[u8; ring::DIRECT_PAYLOAD]>()
                .read_unaligned()
        };
        let addr = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
        let key = u64::from_le_bytes(payload[8..].try_into().expect("8 bytes"));
        // The receive's range was bounds-checked against its region, which the work request
        // holds; a bad address or key of the peer's fails the copy, not this process.
        if key != 0 {
            self.copy_mapped(key, addr, dst, rec.total)?;
        } else {
            // Only a peer told it may copy from this process sends such records.
            let Some(pid) = self.peer_pid else {
                return Err(ReceiveError::Protocol);
            };
            direct::copy_from(pid, addr, dst, rec.total).map_err(|_| ReceiveError::Protocol)?;
        }
        self.deliver(Opcode::Recv, rec.total, None, report, out)
    }

    /// Copies a large message of `len` bytes at the peer's `addr` out of the peer's region it
    /// exposed under `key` (see `direct_key`), mapped here, into `dst`.
    fn copy_mapped(
        &mut self,
        key: u64,
        addr: u64,
        dst: *mut u8,
        len: usize,
    ) -> std::result::Result<(), ReceiveError> {
        // The offer went out before the record did: if not read yet, it is in the socket.
        let (import, news) = self.regions.inbox.lock().find(key, self.sock);
        let copied = import.ok_or(ReceiveError::Protocol).and_then(|import| {
            // SAFETY: `dst` is writable for `len` bytes (a posted receive's range, checked by
            // the caller); the peer's mapping is not this side's memory.
            unsafe { onesided::copy_mapped(&import, addr, dst, len, &self.seg, 1 - self.side) }
                .map_err(|_| ReceiveError::Protocol)
        });
        // Doorbells or a goodbye read here are the background work's (see `take_inbox_news`).
        self.inbox_news |= news;
        copied
    }

    /// Whether a receive read doorbells or a goodbye from the socket on the way (see
    /// `copy_mapped`): whoever drove the flow then wakes the connection's background work,
    /// whose news they are. Reading it clears it.
    pub(crate) fn take_inbox_news(&mut self) -> bool {
        std::mem::take(&mut self.inbox_news)
    }

    /// Tells the peer it has new records: marks its notice board if it asked for that (so its
    /// pollers look at this connection), and rings its doorbell if it sleeps.
    fn ring_peer(&mut self) {
        self.notify_peer(bell::RECORDS);
    }

    /// Rings the peer's doorbell if it sleeps waiting for any of `news` (see `bell`) - the one
    /// system call of the data path, made only when the peer asked for it - and marks its
    /// notice board when the peer asked for marks for any of `news` (its `want_mark`: new
    /// records, and its records taken - sends to complete, ring room for sends waiting - for a
    /// connection its pollers do not look at every time). A peer whose pollers sleep on its
    /// queue's descriptor is rung on that queue's bell (named on its board): by its
    /// announcement on the board for a marked connection, by the connection's own ([`bell::QUEUE`])
    /// for one it polls every time. A bell that cannot be rung (a peer in another network
    /// namespace) falls back to the socket, whose reader rings it.
    fn notify_peer(&mut self, news: u32) {
        let peer = self.seg.ctrl(1 - self.side);
        let mut marked = false;
        // After the fence that orders our ring stores before it (see `bell`).
        let mark_board = || {
            if peer.want_mark.load(Ordering::SeqCst) & news != 0
                && let Some((board, slot)) = &self.peer_board
            {
                board.mark(*slot);
                marked = true;
            }
        };
        let asked = bell::must_ring(peer.sleeping, news, mark_board);
        let board = self.peer_board.as_ref().map(|(b, _)| &**b);
        let mut rung = true;
        if marked && let Some(board) = board {
            rung = board.ring_sleeper();
        }
        if asked != 0 {
            rung &= asked & bell::QUEUE != 0 && board.is_some_and(Board::ring_bell);
        }
        if !rung {
            send_packet(self.sock, WAKE);
        }
    }

    /// What this side last asked the peer to ring for (0: nothing, or the peer has rung).
    pub(crate) fn sleeping(&self) -> u32 {
        self.seg.ctrl(self.side).sleeping.load(Ordering::SeqCst)
    }

    /// Announces (or withdraws) that this side wants its notice board marked when the peer
    /// has news for it (it no longer polls the connection every time): records written, and
    /// ours taken, which completes our sends and makes room for those that wait.
    pub(crate) fn set_want_mark(&self, on: bool) {
        let news = if on { bell::RECORDS | bell::TAKEN } else { 0 };
        bell::announce(self.seg.ctrl(self.side).want_mark, news);
    }

    /// Announces (or withdraws: 0) that this side wants a doorbell for `news` of the peer's
    /// (see `bell`).
    pub(crate) fn set_sleeping(&self, news: u32) {
        bell::announce(self.seg.ctrl(self.side).sleeping, news);
    }

    /// What a sleep of this side waits for: new records, and the peer taking ours when sends
    /// wait for room or a completion is to be reported when it does. Unsignaled sends
    /// alone need no doorbell when taken: their slots come back with the next poll.
    pub(crate) fn sleep_request(&self) -> u32 {
        if self.inflight_signaled > 0 || !self.pending.is_empty() {
            bell::RECORDS | bell::TAKEN
        } else {
            bell::RECORDS
        }
    }

    /// Whether anything could move now (checked after announcing sleep).
    pub(crate) fn has_work(&self) -> bool {
        if self.failed.is_some() {
            return true;
        }
        // A message without a receive waits for one: the post of that receive takes it.
        if self.recvs_available() && self.rx.has_data().unwrap_or(true) {
            return true;
        }
        if !self.inflight.is_empty() {
            match self.tx.load_head() {
                Ok(h) if self.inflight.front().is_some_and(|f| f.end <= h) => return true,
                Err(_) => return true,
                Ok(_) => {}
            }
        }
        // A stalled sender waits for ring space: did the peer free some since the last
        // attempt?
        !self.pending.is_empty() && self.tx.load_head().map_or(true, |h| h != self.seen_head)
    }

    /// Ends the data path: no more posting or progress. Takes what the peer delivered before
    /// it left (`end` is a peer's close), completes everything else as flushed, and returns
    /// why the connection ended, for its disconnect record. Completions go to `out`.
    pub(crate) fn close(&mut self, mut end: End, report: &Reporter, out: &mut Sink<'_>) -> End {
        if !self.closed && self.failed.is_none() {
            if let End::Peer { .. } = end {
                // Everything the peer finished writing before it left is delivered.
                match self.receive(report, usize::MAX, out) {
                    Err(ReceiveError::Length) => end = End::Failed(WcStatus::LocalLength),
                    Err(ReceiveError::Protocol) => end = End::Failed(WcStatus::General),
                    Ok(_) => {}
                }
            }
            // The sends the peer took, whichever side ended the connection, were delivered:
            // they complete as such (an unsignaled one reports nothing), not as flushed.
            let _ = self.complete_sends(report, out);
        }
        self.closed = true;
        // Which of our sends the peer refused, if it failed the connection.
        let peer_fatal = self.seg.ctrl(1 - self.side).fatal.load(Ordering::SeqCst);
        let refused_seq =
            (peer_fatal >> 48 == FATAL_LENGTH).then_some(peer_fatal & ((1 << 48) - 1));
        self.inflight_signaled = 0;
        let (inflight, pending, recvs) = (&mut self.inflight, &mut self.pending, &mut self.recvs);
        let in_ring = std::iter::from_fn(|| inflight.pop_front()).map(|f| Unfinished {
            wr_id: f.wr_id,
            opcode: f.opcode,
            status: if Some(f.seq) == refused_seq {
                Some(WcStatus::RemoteError)
            } else if f.done || f.status != WcStatus::Success {
                Some(f.status)
            } else {
                None
            },
        });
        let waiting = std::iter::from_fn(|| pending.pop_front())
            .map(|wr| Unfinished::flushed(wr.wr_id, wr.kind.opcode()));
        let recvs = std::iter::from_fn(|| recvs.pop_front()).map(|wr| wr.wr_id);
        flush_outstanding(report, out, in_ring.chain(waiting), recvs);
        told_by_peer(end, peer_fatal)
    }
}

/// `end`, once what the peer's library marked in its control words when it failed the
/// connection (`fatal`) is known: that it refused one of this side's messages (too long for its
/// receive), or one of its own accesses to this side's memory, or found this side breaking the
/// protocol.
fn told_by_peer(end: End, fatal: u64) -> End {
    if fatal == 0 {
        return end;
    }
    match (end, fatal >> 48) {
        (End::Failed(_), _) => end,
        (_, FATAL_LENGTH) => End::Failed(WcStatus::RemoteError),
        (End::Peer { .. }, FATAL_ACCESS) => End::Failed(WcStatus::PeerAccess),
        // Otherwise a peer that vanished is lost to this side, whatever it marked.
        (End::Peer { clean: false }, _) => end,
        _ => End::Failed(WcStatus::General),
    }
}

/// The flags that tell a record holding a whole message of its own (both ends, neither
/// direct nor a write with immediate data).
const WHOLE_MASK: u32 = ring::FIRST | ring::LAST | ring::DIRECT | ring::WRITE_IMM;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_peer_marked_says_why_the_connection_ended() {
        let lost = End::Peer { clean: false };
        let bye = End::Peer { clean: true };
        let length = FATAL_LENGTH << 48 | 7;
        let access = FATAL_ACCESS << 48;
        let protocol = FATAL_PROTOCOL << 48;
        for end in [End::Local, bye, lost, End::Failed(WcStatus::LocalLength)] {
            assert_eq!(told_by_peer(end, 0), end);
        }
        for end in [End::Local, bye, lost] {
            assert_eq!(told_by_peer(end, length).status(), WcStatus::RemoteError);
        }
        assert_eq!(told_by_peer(bye, access).status(), WcStatus::PeerAccess);
        assert_eq!(told_by_peer(lost, access).status(), WcStatus::PeerAccess);
        assert_eq!(told_by_peer(End::Local, access).status(), WcStatus::General);
        assert_eq!(told_by_peer(lost, protocol).status(), WcStatus::Transport);
        assert_eq!(told_by_peer(bye, protocol).status(), WcStatus::General);
        let own = End::Failed(WcStatus::RemoteAccess);
        assert_eq!(told_by_peer(own, length), own);
    }
}
