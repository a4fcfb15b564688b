//! Posting on a verbs connection: the ledger of outstanding work that posters, the pollers of
//! the shared device CQ (`devcq.rs`) and the connection's driver turns (`engine.rs`) share
//! under the connection's lock, the caller's sends, receives and one-sided operations, and the
//! library's own work (hello, keepalive, credit writes; see `credit.rs`).
//!
//! Lock order: a device CQ's poll lock, then a connection's state lock. Posters take only the
//! connection's lock, and never while holding it take a poll lock. (This module knows nothing
//! of the device CQ, which holds the connections' shared state: no module cycle.)

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use rdma_sys as sys;

use crate::conn::seam::ConnSeam;
use crate::conn::{
    ConnInfo, OneOp, Payload, RdmaOp, RdmaRequest, RecvRequest, SGE_MAX, SendRequest, admit_recv,
    admit_send,
};
use crate::cq::{Opcode, Reporter, WcStatus};
use crate::driver::Registration;
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::verbs::credit::{
    BOUNCE, COUNT_MASK, CREDIT_WRITES_MAX, Credits, Regions, SIGNAL_EVERY, SendWork, Work,
};
use crate::verbs::res::post_error;

/// Work-request ids the library hands the device: bit 63 marks a receive, bit 62 the server's
/// internal receive for the client's hello; bits 46..62 carry the connection's tag (see
/// `devcq.rs`: a completion is delivered only to the connection whose queue-pair number and
/// tag it carries); bits 0..46 the posting sequence (modulo 2^46, see [`at_or_before`]).
pub(super) const RECV_BIT: u64 = 1 << 63;
pub(super) const HELLO_BIT: u64 = 1 << 62;
pub(super) const TAG_SHIFT: u32 = 46;
pub(super) const TAG_MASK: u64 = 0xffff << TAG_SHIFT;
pub(super) const SEQ_MASK: u64 = (1 << TAG_SHIFT) - 1;
/// The id bits of a receive of a shared receive queue (`srq.rs`): a receive, the hello bit and
/// every tag bit (a tag no connection is given, see `devcq.rs`), the pool's slot in the low
/// bits.
pub(super) const POOL_WR: u64 = RECV_BIT | HELLO_BIT | TAG_MASK;

/// Whether a work-request id names a receive of a shared receive queue.
#[inline]
pub(super) fn is_pool_wr(wr_id: u64) -> bool {
    wr_id & POOL_WR == POOL_WR
}

/// Whether the work request with sequence `e` was posted at or before the one with (masked)
/// sequence `s`: modular, since far fewer than 2^45 work requests are ever outstanding at once.
pub(super) fn at_or_before(e: u64, s: u64) -> bool {
    (s.wrapping_sub(e) & SEQ_MASK) < 1 << (TAG_SHIFT - 1)
}

pub(super) struct SendEntry {
    pub(super) seq: u64,
    pub(super) wr_id: u64,
    /// What its completion reports (the caller's send or one-sided operation).
    pub(super) op: Opcode,
    pub(super) signaled: bool,
    /// The library's own (keepalive, hello, credit write): never reported, but its failure
    /// fails the connection.
    pub(super) internal: bool,
    /// Whether the device reports its completion (an unsignaled one is reaped by a later one).
    pub(super) hw_signaled: bool,
    /// The regions the device reads or writes for it, held until it completes.
    pub(super) _mrs: Regions,
}

impl SendEntry {
    /// Lets the entry go, its regions dropped in line (the usual case, no region freed, calls
    /// nothing).
    #[inline(always)]
    pub(super) fn release(self) {
        // One by one: dropping the array (or an iterator over it) is a call.
        let [a, b, c, d] = self._mrs;
        drop(a);
        drop(b);
        drop(c);
        drop(d);
    }
}

pub(super) struct RecvEntry {
    pub(super) seq: u64,
    pub(super) wr_id: u64,
    pub(super) _mr: Arc<MemoryRegion>,
}

/// What posters, pollers and the driver share under one lock: the outstanding work in posting
/// order (sends and receives each complete in order on an RC queue pair), and whether the
/// queue pair may still be posted to.
pub(super) struct PostState {
    pub(super) closed: bool,
    /// The first error that failed the queue pair, as whoever polled the device found it.
    pub(super) failed: Option<WcStatus>,
    pub(super) next_seq: u64,
    /// Everything handed to the device's send queue, in order.
    pub(super) sends: VecDeque<SendEntry>,
    pub(super) recvs: VecDeque<RecvEntry>,
    /// The caller's send-queue work outstanding (sends and one-sided operations): on the
    /// device or held for credits.
    pub(super) user_work: usize,
    /// The library's own work requests on the device, not yet reaped.
    pub(super) internal_out: u32,
    /// Work requests (the library's or the caller's) posted unsignaled to the device since
    /// the last signaled one.
    pub(super) unsignaled_run: u32,
    /// Toward a library peer: receive credits, and the sends (and writes with immediate) held
    /// for them.
    pub(super) credits: Option<Credits>,
}

impl PostState {
    /// Whether work the device will still report is outstanding (unsignaled internal work
    /// that finished is never reported: not counted).
    pub(super) fn outstanding(&self) -> bool {
        self.sends.iter().any(|e| !e.internal || e.hw_signaled) || !self.recvs.is_empty()
    }
}

pub(super) struct ConnState {
    pub(super) info: ConnInfo,
    /// Where this connection's completions go.
    pub(super) report: Reporter,
    pub(super) pd: Arc<crate::verbs::res::Pd>,
    pub(super) qp: *mut sys::ibv_qp,
    /// Most local segments the queue pair takes in one work request (at most [`SGE_MAX`]).
    pub(super) max_send_sge: u32,
    /// Whether the device runs atomic operations.
    pub(super) atomics: bool,
    /// This connection's tag in its work-request ids (already shifted, see [`TAG_SHIFT`]).
    pub(super) tag: u64,
    /// How many connections of the device CQ this connection shares (`devcq.rs`) have sends
    /// held for credits: its pollers then start those whose credits arrived.
    pub(super) held_conns: Arc<AtomicUsize>,
    pub(super) state: Mutex<PostState>,
    /// The connection's registration with its context's driver: wakes its turn, and carries
    /// the user's disconnect ([`Registration::stop`]).
    pub(super) reg: Registration,
    /// Sends are held for credits, or the peer is yet to learn that this side took a message
    /// from its bounce area (see [`note_held`](Self::note_held); changed under the state
    /// lock, read by pollers without it to find whom to pump).
    pub(super) has_held: AtomicBool,
    /// The shared receive queue its queue pair takes its receives from, and its device
    /// queue: completions of the pool's receives are reported from there (`dispatch.rs`).
    pub(super) pool: Option<(
        Arc<crate::conn::SrqInner>,
        Arc<crate::verbs::srq::DevicePool>,
    )>,
    /// How long the connection may be idle before a keepalive goes out: the option, toward a
    /// library peer (negotiated at connect); none toward a plain peer. A keepalive's
    /// acknowledgement, or its failure after `retry_count` resends, is how a peer whose host or
    /// link is gone is noticed on an idle connection.
    pub(super) keepalive: Option<Duration>,
}

// SAFETY: the QP pointer is used only under `state`'s lock while `closed` is false (posting);
// the driver destroys the QP only after setting `closed` under that lock. libibverbs posting
// calls are thread-safe.
unsafe impl Send for ConnState {}
// SAFETY: as above.
unsafe impl Sync for ConnState {}

/// How often a driver turn tries a lock before it gives up and comes back later: its holder
/// (a poster or poller) holds it only briefly, and the driver must not wait for it.
const LOCK_TRIES: u32 = 64;

/// `m`'s lock if it comes free at once (see [`LOCK_TRIES`]).
pub(super) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    for _ in 0..LOCK_TRIES {
        if let Some(g) = m.try_lock() {
            return Some(g);
        }
        std::hint::spin_loop();
    }
    None
}

impl ConnState {
    pub(super) fn lock(&self) -> MutexGuard<'_, PostState> {
        self.state.lock()
    }

    /// Hands a piece of the caller's work to the device (`st.user_work` already counts it).
    /// On failure the work comes back with the error number, so that held work keeps its place.
    #[allow(clippy::result_large_err)] // the error path is rare; the work is moved, not copied
    fn post_user(
        &self,
        st: &mut PostState,
        h: SendWork,
    ) -> std::result::Result<(), (i32, SendWork)> {
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        let mut f = 0;
        // The device only reads the list during the post; local copies keep it live that long.
        let mut send_sge;
        let mut sges;
        match h.work {
            Work::Send {
                ptr,
                len,
                lkey,
                inline,
            } => {
                send_sge = sys::ibv_sge {
                    addr: ptr as u64,
                    length: len,
                    lkey,
                };
                wr.sg_list = &mut send_sge;
                wr.num_sge = if len == 0 { 0 } else { 1 };
                set_send_opcode(st, &mut wr);
                if inline {
                    f |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
                }
            }
            Work::Rdma {
                op,
                sges: list,
                nsge,
                remote_addr,
                rkey,
            } => {
                sges = list;
                f |= rdma_wr(
                    &mut wr,
                    op,
                    &mut sges[..nsge as usize],
                    remote_addr,
                    rkey,
                    &self.info,
                );
            }
        }
        wr.send_flags = f;
        let (op, wr_id, signaled) = (h.opcode(), h.wr_id, h.signaled);
        // SAFETY: the work request and its SGEs are live locals; the local memory is valid
        // until the work completes (held by `mrs`) or, inline, copied during the call (from
        // the caller's slice or region, which the posting call holds, or from the staging slot
        // that no later send reuses before this one left).
        match unsafe { self.post_wr(st, &mut wr, wr_id, op, signaled, h.mrs) } {
            Ok(()) => {
                note_told(st, &wr);
                Ok(())
            }
            Err((r, mrs)) => Err((r, SendWork { mrs, ..h })),
        }
    }

    /// Hands the caller's `wr` (all but its id and signaling filled in) to the device as the
    /// next of the send queue, and notes it in the ledger with the regions it uses. On failure
    /// the regions come back with the error number.
    ///
    /// # Safety
    /// `wr` and its SGEs are valid for the call, and the local memory they name until the
    /// work completes (held by `mrs`) or, inline, for the call.
    #[inline(always)]
    unsafe fn post_wr(
        &self,
        st: &mut PostState,
        wr: &mut sys::ibv_send_wr,
        wr_id: u64,
        op: Opcode,
        signaled: bool,
        mrs: Regions,
    ) -> std::result::Result<(), (i32, Regions)> {
        let seq = st.next_seq;
        wr.wr_id = (seq & SEQ_MASK) | self.tag;
        // The device reports unsignaled work to nobody, so its slot is freed only by a later
        // reported completion: of the work requests in a row the caller left unsignaled (sends
        // and one-sided operations alike), every SIGNAL_EVERY-th (or every other one, on a
        // queue less than twice that deep) asks the device for a completion all the same,
        // which the library takes and reports to nobody.
        let period = SIGNAL_EVERY
            .min(self.info.send_queue_depth.div_ceil(2))
            .max(1);
        let hw_signaled = signaled || st.unsignaled_run + 1 >= period;
        if hw_signaled {
            wr.send_flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live while `closed` is false (callers check it under the lock);
        // the work request and its memory as the caller promises. The remote side is the peer
        // device's to check.
        let r = unsafe { sys::ibv_post_send(self.qp, wr, &mut bad) };
        if r != 0 {
            return Err((r, mrs));
        }
        st.next_seq += 1;
        st.unsignaled_run = if hw_signaled {
            0
        } else {
            st.unsignaled_run + 1
        };
        st.sends.push_back(SendEntry {
            seq,
            wr_id,
            op,
            signaled,
            internal: false,
            hw_signaled,
            _mrs: mrs,
        });
        Ok(())
    }

    /// Posts one of the library's own send work requests; signals every [`SIGNAL_EVERY`]th
    /// (or when `signal`), so their slots are reaped. Returns the post's error number.
    pub(super) fn post_internal(
        &self,
        st: &mut PostState,
        wr: &mut sys::ibv_send_wr,
        signal: bool,
    ) -> std::result::Result<(), i32> {
        self.post_internal_chain(st, std::slice::from_mut(wr), signal)
    }

    /// [`post_internal`](Self::post_internal) for work requests that go to the device in one
    /// call, in order (`signal` asks for the last one's completion).
    pub(super) fn post_internal_chain(
        &self,
        st: &mut PostState,
        wrs: &mut [sys::ibv_send_wr],
        signal: bool,
    ) -> std::result::Result<(), i32> {
        let first = st.next_seq;
        let mut run = st.unsignaled_run;
        let n = wrs.len();
        for (i, wr) in wrs.iter_mut().enumerate() {
            let signal = (signal && i + 1 == n) || run + 1 >= SIGNAL_EVERY;
            // The library's own traffic never carries an immediate: at the peer it must never
            // consume (or be taken for) a receive of the caller's (see `credit.rs`).
            debug_assert!(
                wr.opcode == sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE
                    || wr.opcode == sys::ibv_wr_opcode::IBV_WR_SEND
            );
            wr.wr_id = ((first + i as u64) & SEQ_MASK) | self.tag;
            if signal {
                wr.send_flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            run = if signal { 0 } else { run + 1 };
        }
        for i in 1..n {
            let next: *mut sys::ibv_send_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live while `closed` is false (callers check it under the lock); the
        // work requests and their SGEs (if any) are live for the call and point into the
        // connection's registered credit block, which outlives the QP, or are inline.
        let r = unsafe { sys::ibv_post_send(self.qp, wrs.as_mut_ptr(), &mut bad) };
        if r != 0 {
            return Err(r);
        }
        st.next_seq += n as u64;
        st.internal_out += n as u32;
        st.unsignaled_run = run;
        for (i, wr) in wrs.iter().enumerate() {
            let hw_signaled = wr.send_flags & sys::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0;
            st.sends.push_back(SendEntry {
                seq: first + i as u64,
                wr_id: 0,
                op: Opcode::Send,
                signaled: false,
                internal: true,
                hw_signaled,
                _mrs: Default::default(),
            });
        }
        Ok(())
    }

    /// A failure of the library's own posting (error number `r`) fails the connection, as a
    /// failed keepalive does. The device refuses work on a queue pair it can no longer send on
    /// (seen when the link goes down): a transport failure. ENOMEM (a full send queue) would be
    /// the library's own accounting error.
    fn fail(&self, st: &mut PostState, r: i32) {
        if st.failed.is_none() {
            st.failed = Some(if r == libc::ENOMEM {
                WcStatus::General
            } else {
                WcStatus::Transport
            });
        }
        self.reg.wake();
    }

    /// Starts held sends (and writes with immediate), in order, for as many as the peer has
    /// receives posted.
    pub(super) fn pump(&self, st: &mut PostState) {
        if st.closed || st.failed.is_some() {
            return;
        }
        loop {
            let Some(c) = st.credits.as_mut() else { return };
            if c.held.is_empty() {
                break;
            }
            // The count of receives before the claims: the peer writes them the other way
            // round, so a count that shows a receive comes with the claims made before it.
            let credit = c.available();
            if self.finish_bounced(st) {
                continue;
            }
            if !credit || !self.claims_told_first(st) {
                break;
            }
            // A credit: the peer has a receive on the device, and so takes nothing from its
            // bounce area until this send fills it (see `credit.rs`).
            let c = st.credits.as_mut().expect("credits");
            c.bounced = false;
            let h = c.held.pop_front().expect("not empty");
            match self.post_user(st, h) {
                Ok(()) => st.credits.as_mut().expect("credits").sent += 1,
                Err((r, h)) => {
                    st.credits.as_mut().expect("credits").held.push_front(h);
                    self.fail(st, r);
                    break;
                }
            }
        }
        // The first of those still held waits for a credit: it goes to the bounce area.
        self.bounce_first(st);
        self.note_held(st);
    }

    /// Completes the first held send if the peer took it from its bounce area (it is
    /// delivered); returns whether it did.
    pub(super) fn finish_bounced(&self, st: &mut PostState) -> bool {
        let Some(c) = st.credits.as_mut() else {
            return false;
        };
        if !c.bounced_taken() {
            return false;
        }
        let h = c.held.pop_front().expect("a bounced send is held");
        st.user_work -= 1;
        if h.signaled {
            let r = &self.report;
            r.cq.push(r.record(h.wr_id, Opcode::Send, WcStatus::Success, 0, None));
        }
        true
    }

    /// Brings [`has_held`](Self::has_held) and the device CQ's count of connections with held
    /// sends in line with `st` (called under the state lock after the held sends or the
    /// claims change).
    pub(super) fn note_held(&self, st: &PostState) {
        let held = st
            .credits
            .as_ref()
            .is_some_and(|c| !c.held.is_empty() || c.claim_pending());
        // Relaxed: only changed under the state lock; pollers read it as a hint (a stale
        // value costs one pump late, which the connection's own turn makes up for).
        if held != self.has_held.load(Ordering::Relaxed) {
            self.has_held.store(held, Ordering::Relaxed);
            if held {
                self.held_conns.fetch_add(1, Ordering::Relaxed);
            } else {
                self.held_conns.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Writes the first held send into the peer's bounce area, then its header (see
    /// `credit.rs`), if it is small enough and an inline copy, and none is there already.
    pub(super) fn bounce_first(&self, st: &mut PostState) {
        if st.closed
            || st.failed.is_some()
            || st.internal_out + 3 > CREDIT_WRITES_MAX
            || !self.claims_told_first(st)
        {
            return;
        }
        let Some(c) = st.credits.as_mut() else { return };
        let (Some(peer), false) = (c.peer, c.bounced) else {
            return;
        };
        let Some(SendWork {
            work:
                Work::Send {
                    ptr,
                    len,
                    inline: true,
                    ..
                },
            ..
        }) = c.held.front()
        else {
            return;
        };
        let (ptr, len) = (*ptr, *len);
        if len as usize > BOUNCE {
            return;
        }
        let header = c.next_index() & COUNT_MASK;
        let length = u64::from(len);
        c.bounced = true;
        // The message, its length, then its header: one call, writes in order.
        let mut sges = [
            sys::ibv_sge {
                addr: ptr as u64,
                length: len,
                lkey: 0,
            },
            sys::ibv_sge {
                addr: (&raw const length) as u64,
                length: 8,
                lkey: 0,
            },
            sys::ibv_sge {
                addr: (&raw const header) as u64,
                length: 8,
                lkey: 0,
            },
        ];
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut wrs: [sys::ibv_send_wr; 3] = unsafe { std::mem::zeroed() };
        for ((wr, sge), remote_addr) in
            wrs.iter_mut()
                .zip(&mut sges)
                .zip([peer.bounce(), peer.bounced_len(), peer.staged()])
        {
            wr.sg_list = sge;
            wr.num_sge = 1;
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            // Inline: the device copies the bytes (the held send's copy, the length and the
            // header on this stack) during the post.
            wr.send_flags = sys::ibv_send_flags::IBV_SEND_INLINE.0;
            wr.wr.rdma.remote_addr = remote_addr;
            wr.wr.rdma.rkey = peer.rkey;
        }
        // An empty message is its length and header.
        let from = usize::from(len == 0);
        if let Err(r) = self.post_internal_chain(st, &mut wrs[from..], false) {
            self.fail(st, r);
        }
    }

    /// Writes this side's count of receives posted into the peer's credit word, if due (see
    /// [`Credits::push_due`]) and possible; otherwise notes it as owed. Inlined: on most
    /// calls (every receive posted, every delivery) nothing is due.
    #[inline]
    pub(super) fn push_credits(&self, st: &mut PostState) {
        if st.credits.as_ref().is_some_and(Credits::push_due) {
            self.push_due_credits(st, false);
        }
    }

    /// Tells the peer of the messages this side took from its bounce area, if one is untold,
    /// before work that takes one of the peer's receives: the peer may learn that its message
    /// arrived from a later message of this side's (an answer) and close at once, so the
    /// claim must be in its memory first - the device delivers a write before the message
    /// posted after it. Returns false when a claim is still untold (the peer's word is not
    /// known yet, or no internal slot is free): that work waits, held.
    pub(super) fn claims_told_first(&self, st: &mut PostState) -> bool {
        self.write_claims(st, false)
    }

    /// Writes the claims not yet told the peer (with the count of receives), `signal`ed or
    /// not, if any is pending; returns whether none is left untold.
    fn write_claims(&self, st: &mut PostState, signal: bool) -> bool {
        if st.credits.as_ref().is_some_and(Credits::claim_pending) {
            self.push_due_credits(st, signal);
        }
        !st.credits.as_ref().is_some_and(Credits::claim_pending)
    }

    /// Writes the claims not yet told the peer, signaled, on the way to a disconnect: the
    /// peer's sends they name completed nowhere else, and its teardown would flush them as
    /// never delivered. Returns the number of the write whose completion says they are there
    /// (none when nothing is pending or nothing could go out).
    pub(super) fn tell_claims(&self, st: &mut PostState) -> Option<u64> {
        if !st.credits.as_ref().is_some_and(Credits::claim_pending) {
            return None;
        }
        self.write_claims(st, true).then(|| st.next_seq - 1)
    }

    /// [`push_credits`](Self::push_credits) once a write is due.
    #[inline(never)]
    fn push_due_credits(&self, st: &mut PostState, signal: bool) {
        if st.closed || st.failed.is_some() {
            return;
        }
        let internal_out = st.internal_out;
        let Some(c) = st.credits.as_mut() else { return };
        let Some(peer) = c.peer else {
            c.owed = true;
            return;
        };
        if internal_out + 2 > CREDIT_WRITES_MAX {
            c.owed = true;
            return;
        }
        let (count, claims) = (c.posted, c.claims);
        let told_claim = c.claim_pending();
        // Relaxed: the device reads the words during the post below, whose system call orders
        // it; they only grow, so a later read still finds true counts.
        let block = c.mr.block();
        block.src.store(count, Ordering::Relaxed);
        block.claims_src.store(claims, Ordering::Relaxed);
        // The claims first: a peer that sees the count of receives, written after them, sees
        // them too (see `credit.rs`).
        let mut sges = [
            (c.mr.claims_src_addr(), peer.claimed()),
            (c.mr.src_addr(), peer.addr),
        ]
        .map(|(addr, remote)| {
            (
                sys::ibv_sge {
                    addr,
                    length: 8,
                    lkey: c.mr.lkey(),
                },
                remote,
            )
        });
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut wrs: [sys::ibv_send_wr; 2] = unsafe { std::mem::zeroed() };
        for (wr, (sge, remote)) in wrs.iter_mut().zip(&mut sges) {
            wr.sg_list = sge;
            wr.num_sge = 1;
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.wr.rdma.remote_addr = *remote;
            wr.wr.rdma.rkey = peer.rkey;
        }
        let from = usize::from(!told_claim);
        match self.post_internal_chain(st, &mut wrs[from..], signal) {
            Ok(()) => {
                let c = st.credits.as_mut().expect("credits");
                c.pushed = count;
                c.claims_told = claims;
                c.owed = false;
                if told_claim {
                    self.note_held(st);
                }
            }
            Err(r) => self.fail(st, r),
        }
    }

    /// Whether the connection's turn must look again soon: sends wait for credits, or a
    /// credit write is owed.
    pub(super) fn credit_busy(st: &PostState) -> bool {
        st.credits
            .as_ref()
            .is_some_and(|c| !c.held.is_empty() || c.owed || c.claim_pending())
    }
}

/// Hands a queue pair's completions to its connection (the device CQ's, `devcq.rs`): done
/// once the connection's `Connected` record is on its queue, so that none of its completions
/// (a shared receive queue's receive, taken by the device before then) precedes it.
pub(super) trait Join: Send {
    fn join(&self, sh: &Arc<ConnState>);
}

/// The user's handle of a verbs connection. Dropping it tears the connection down.
pub(crate) struct Conn {
    pub(super) sh: Arc<ConnState>,
    pub(super) private_data: Vec<u8>,
    /// Taken when the connection is up ([`ConnSeam::connected`]).
    pub(super) join: Mutex<Option<Box<dyn Join>>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("verbs::Conn")
            .field("info", &self.sh.info)
            .finish()
    }
}

impl Conn {
    /// Whether the caller's send-queue work may go to the device now: `Err` when the
    /// connection is down or its send queue is full; `Ok(false)` when it needs a receive at
    /// the peer (`credit`) that the peer has not posted yet, or others wait for one before it,
    /// or this side took a message of the peer's that it cannot tell it of yet (see
    /// [`ConnState::claims_told_first`]).
    fn may_post(&self, st: &mut PostState, credit: bool) -> Result<bool> {
        admit_send(
            st.closed,
            st.user_work,
            self.sh.info.send_queue_depth as usize,
        )?;
        Ok(!(credit
            && (st
                .credits
                .as_ref()
                .is_some_and(|c| !c.held.is_empty() || !c.available())
                || !self.sh.claims_told_first(st))))
    }

    /// Counts the caller's work just handed to the device (`credit`: it took one).
    fn count_posted(st: &mut PostState, credit: bool) {
        st.user_work += 1;
        if credit && let Some(c) = st.credits.as_mut() {
            c.sent += 1;
        }
    }

    /// An inline send of `len` bytes at `ptr` (readable for the call): straight to the device
    /// when it may go at once, without building the work that waits for credits.
    #[inline]
    fn send_inline(&self, ptr: *mut u8, len: usize, wr_id: u64, signaled: bool) -> Result<()> {
        let mut st = self.sh.lock();
        if !self.may_post(&mut st, true)? {
            // SendWork for credits: the general way holds it.
            drop(st);
            return self.post_send_raw(ptr, len, 0, wr_id, signaled, true, None);
        }
        let mut sge = sys::ibv_sge {
            addr: ptr as u64,
            length: len as u32,
            lkey: 0,
        };
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        set_send_opcode(&st, &mut wr);
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_INLINE.0;
        // SAFETY: `wr` and `sge` are live locals; the bytes are the caller's slice or a range
        // of its region that check_region found inside it, readable for this call, and the
        // device copies them during the post.
        if let Err((r, _)) = unsafe {
            self.sh.post_wr(
                &mut st,
                &mut wr,
                wr_id,
                Opcode::Send,
                signaled,
                Regions::default(),
            )
        } {
            return Err(post_error(r, "send"));
        }
        note_told(&mut st, &wr);
        Self::count_posted(&mut st, true);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn post_send_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        lkey: u32,
        wr_id: u64,
        signaled: bool,
        inline: bool,
        mr: Option<Arc<MemoryRegion>>,
    ) -> Result<()> {
        let mut mrs: Regions = Default::default();
        mrs[0] = mr;
        self.submit(SendWork {
            work: Work::Send {
                ptr,
                len: len as u32,
                lkey,
                inline,
            },
            wr_id,
            signaled,
            mrs,
        })
    }

    /// Hands the caller's work to the device, or, when it needs a receive the peer has not
    /// posted yet (or others wait before it), holds it for credits.
    fn submit(&self, mut h: SendWork) -> Result<()> {
        let mut st = self.sh.lock();
        let credit = h.needs_credit();
        if !self.may_post(&mut st, credit)? {
            let c = st
                .credits
                .as_mut()
                .expect("work waits for credits only toward a library peer");
            // The peer has no receive for it yet: held, and started in order when credits
            // arrive. An inline send's bytes are copied now, as the caller may reuse them.
            if let Work::Send {
                ptr,
                len,
                inline: true,
                ..
            } = &mut h.work
            {
                // SAFETY: `ptr`/`len` are the caller's slice (post_send_inline) or a range of
                // the caller's region that check_region found inside it (post_send), readable
                // for the whole call.
                let data = unsafe { std::slice::from_raw_parts(*ptr, *len as usize) };
                *ptr = c.stage(data, self.sh.info.send_queue_depth, self.sh.info.max_inline);
            }
            let first = c.held.is_empty();
            c.held.push_back(h);
            st.user_work += 1;
            if first {
                self.sh.bounce_first(&mut st);
                // The credits may come while nobody polls: the connection's turn looks for
                // them, once it knows sends are held; pollers pump on their polls.
                self.sh.note_held(&st);
                drop(st);
                self.sh.reg.wake();
            }
            return Ok(());
        }
        if let Err((r, _)) = self.sh.post_user(&mut st, h) {
            return Err(post_error(r, "send"));
        }
        Self::count_posted(&mut st, credit);
        Ok(())
    }

    /// Posts the one-sided operation `op` (one that waits for no credit) on `sges` to the
    /// device at once: the work request built here, posted and noted in the ledger under the
    /// connection's lock. `mrs` hold the local regions until it completes.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn post_now(
        &self,
        op: RdmaOp,
        sges: &mut [sys::ibv_sge],
        remote_addr: u64,
        rkey: u32,
        wr_id: u64,
        signaled: bool,
        mrs: Regions,
    ) -> Result<()> {
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut dev: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        dev.send_flags = rdma_wr(&mut dev, op, sges, remote_addr, rkey, &self.sh.info);
        let mut st = self.sh.lock();
        self.may_post(&mut st, false)?;
        // SAFETY: `dev` and `sges` are live locals; the local memory stays valid until the
        // work completes (held by `mrs`) or, inline, is copied during the call.
        let posted = unsafe {
            self.sh
                .post_wr(&mut st, &mut dev, wr_id, op.opcode(), signaled, mrs)
        };
        if let Err((r, _)) = posted {
            return Err(post_error(r, "send"));
        }
        Self::count_posted(&mut st, false);
        Ok(())
    }
}

impl ConnSeam for Conn {
    fn info(&self) -> ConnInfo {
        self.sh.info
    }

    fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// Posts a checked send.
    fn send(&self, wr: SendRequest<'_>) -> Result<()> {
        let len = wr.len();
        let signaled = wr.signaled;
        let ptr = wr.ptr().cast_mut();
        match wr.payload {
            // Small enough to travel inside the work request: copied now, so the device reads
            // no memory for it (nor needs its key) and the region need not be held until it
            // completes.
            Payload::Region { .. } if len > 0 && len <= self.sh.info.max_inline as usize => {
                self.send_inline(ptr, len, wr.wr_id, signaled)
            }
            Payload::Region { mr, .. } => {
                let lkey = mr.lkey_in(&self.sh.pd)?;
                self.post_send_raw(ptr, len, lkey, wr.wr_id, signaled, false, Some(mr.clone()))
            }
            Payload::Inline(_) => self.send_inline(ptr, len, wr.wr_id, signaled),
        }
    }

    fn connected(&self) {
        if let Some(j) = self.join.lock().take() {
            j.join(&self.sh);
        }
    }

    /// Posts a checked receive.
    fn recv(&self, wr: RecvRequest<'_>) -> Result<()> {
        let RecvRequest {
            wr_id,
            mr,
            len,
            ptr,
            ..
        } = wr;
        let lkey = mr.lkey_in(&self.sh.pd)?;
        let mut st = self.sh.lock();
        admit_recv(
            st.closed,
            st.recvs.len(),
            self.sh.info.recv_queue_depth as usize,
        )?;
        let on_device = !st.recvs.is_empty();
        if let Some(c) = st.credits.as_mut()
            // SAFETY: `ptr` is valid for `len` bytes of the caller's region (checked).
            && let Some(n) = unsafe { c.take_bounced(on_device, ptr, len) }
        {
            // A send of the peer's waited for this receive: it completes here, and the
            // peer learns it took its message.
            let r = &self.sh.report;
            r.cq.push(r.record(wr_id, Opcode::Recv, WcStatus::Success, n as u32, None));
            // The peer's send completes once it learns of the claim: written by the next
            // poll of the queue (or this connection's next turn), not here - a post costs
            // its caller no write to the device (under soft-RoCE, a system call that runs the
            // whole transfer).
            self.sh.note_held(&st);
            return Ok(());
        }
        let seq = st.next_seq;
        let mut sge = sys::ibv_sge {
            addr: ptr as u64,
            length: len as u32,
            lkey,
        };
        let mut wr = sys::ibv_recv_wr {
            wr_id: (seq & SEQ_MASK) | self.sh.tag | RECV_BIT,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: if len == 0 { 0 } else { 1 },
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: as for sends; the buffer stays valid until the receive completes (held by
        // the entry's Arc of the region).
        let r = unsafe { sys::ibv_post_recv(self.sh.qp, &mut wr, &mut bad) };
        if r != 0 {
            return Err(post_error(r, "receive"));
        }
        st.next_seq += 1;
        st.recvs.push_back(RecvEntry {
            seq,
            wr_id,
            _mr: mr.clone(),
        });
        if let Some(c) = st.credits.as_mut() {
            c.posted += 1;
        }
        self.sh.push_credits(&mut st);
        Ok(())
    }

    /// Lets the peer reach `mr` with one-sided operations: registers it in the connection's
    /// protection domain (once; with the region's access bits) and returns its remote key.
    fn expose(&self, mr: &Arc<MemoryRegion>) -> Result<u64> {
        mr.rkey_in(&self.sh.pd).map(u64::from)
    }

    /// Posts the checked write or read `one` of one local segment straight to the device, as
    /// [`Conn::rdma`] posts it but with no segment list walked: the common small operation. A
    /// key that is not a verbs key and an empty segment (which `rdma` refuses, or posts with
    /// no segment) go through `rdma`.
    ///
    /// # Safety
    /// `one.ptr` is valid for `one.len` bytes inside `one.mr` (the ledger keeps the region
    /// until the work completes).
    #[inline]
    unsafe fn rdma_single(&self, one: &OneOp<'_>) -> Result<()> {
        let rkey = match u32::try_from(one.key) {
            Ok(k) if one.len > 0 => k,
            _ => return self.rdma(&one.request()),
        };
        let lkey = one.mr.lkey_in(&self.sh.pd)?;
        let mut sges = [sys::ibv_sge {
            addr: one.ptr as u64,
            length: one.len as u32,
            lkey,
        }; 1];
        let mut mrs: Regions = Default::default();
        mrs[0] = Some(one.mr.clone());
        self.post_now(
            one.op,
            &mut sges,
            one.remote_addr,
            rkey,
            one.wr_id,
            one.signaled,
            mrs,
        )
    }

    /// Posts a checked one-sided operation. A write with immediate takes one of the peer's
    /// receives, so toward a library peer it waits for a credit like a send, in order with
    /// the sends; the others go to the device at once.
    fn rdma(&self, wr: &RdmaRequest<'_>) -> Result<()> {
        let rkey = u32::try_from(wr.key).map_err(|_| {
            Error::invalid(format!(
                "key {:#x} is not a verbs remote key (they are 32 bits)",
                wr.key
            ))
        })?;
        let atomic = matches!(wr.op, RdmaOp::FetchAdd { .. } | RdmaOp::CmpSwap { .. });
        if atomic && !self.sh.atomics {
            return Err(Error::Unsupported(
                "the connection's device runs no atomic operations".into(),
            ));
        }
        let nonempty = wr.segs[..wr.nsegs].iter().flatten().filter(|s| s.len > 0);
        if nonempty.clone().count() > self.sh.max_send_sge as usize {
            return Err(Error::Unsupported(format!(
                "the connection's device takes at most {} local segments in one operation",
                self.sh.max_send_sge
            )));
        }
        let mut sges = [sys::ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        }; SGE_MAX];
        let mut mrs: Regions = Default::default();
        let mut nsge = 0;
        // Empty segments are left out: some devices read a length of 0 as 2 GiB.
        for seg in nonempty {
            sges[nsge] = sys::ibv_sge {
                addr: seg.ptr as u64,
                length: seg.len as u32,
                lkey: seg.mr.lkey_in(&self.sh.pd)?,
            };
            mrs[nsge] = Some(seg.mr.clone());
            nsge += 1;
        }
        let nsge = nsge as u32;
        if matches!(wr.op, RdmaOp::Write { imm: Some(_) }) {
            // It takes a receive at the peer: it may have to wait for a credit.
            return self.submit(SendWork {
                work: Work::Rdma {
                    op: wr.op,
                    sges,
                    nsge,
                    remote_addr: wr.remote_addr,
                    rkey,
                },
                wr_id: wr.wr_id,
                signaled: wr.signaled,
                mrs,
            });
        }
        // The rest goes to the device at once (none waits for credits, nor behind held
        // sends).
        let sges = &mut sges[..nsge as usize];
        self.post_now(
            wr.op,
            sges,
            wr.remote_addr,
            rkey,
            wr.wr_id,
            wr.signaled,
            mrs,
        )
    }

    fn disconnect(&self) {
        self.sh.reg.stop();
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.disconnect();
        // The teardown runs as driver turns that never wait for the peer: bounded by the
        // flush deadline (`engine::FLUSH_WAIT`). When this returns the disconnect has been
        // reported and every resource of the connection is gone.
        self.sh.reg.wait_finished();
    }
}

/// Makes `wr` a send of the caller's: toward a library peer a SEND with immediate carrying
/// this side's count of receives posted (see `credit.rs`), else a plain SEND.
fn set_send_opcode(st: &PostState, wr: &mut sys::ibv_send_wr) {
    match &st.credits {
        Some(c) => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
            wr.imm_data_invalidated_rkey_union.imm_data = c.imm_for_send();
        }
        None => wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND,
    }
}

/// After `wr` was posted: a send that carried this side's count told the peer of it.
fn note_told(st: &mut PostState, wr: &sys::ibv_send_wr) {
    if wr.opcode == sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM
        && let Some(c) = st.credits.as_mut()
    {
        c.told();
    }
}

/// [`rdma_wr`]'s opcode and fields of a write with immediate or an atomic operation.
#[inline(never)]
fn rdma_wr_other(wr: &mut sys::ibv_send_wr, op: RdmaOp, remote_addr: u64, rkey: u32) {
    match op {
        RdmaOp::Write { imm: Some(imm) } => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            // Network byte order on the wire; the peer's library turns it back.
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        RdmaOp::Write { imm: None } => wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        RdmaOp::Read => wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
        RdmaOp::FetchAdd { add } => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
            wr.wr.atomic = sys::atomic_t {
                remote_addr,
                compare_add: add,
                swap: 0,
                rkey,
            };
        }
        RdmaOp::CmpSwap { compare, swap } => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
            wr.wr.atomic = sys::atomic_t {
                remote_addr,
                compare_add: compare,
                swap,
                rkey,
            };
        }
    }
}

/// Fills `wr` (zeroed) for the one-sided operation `op` on `sges` at `remote_addr`
/// of the region with `rkey`, and returns its send flags: a write that fits the connection's
/// inline size goes inline, as sends do (the device copies the bytes during the post and need
/// not fetch them later). `sges` must stay in place until the post.
#[inline(always)]
fn rdma_wr(
    wr: &mut sys::ibv_send_wr,
    op: RdmaOp,
    sges: &mut [sys::ibv_sge],
    remote_addr: u64,
    rkey: u32,
    info: &ConnInfo,
) -> u32 {
    wr.sg_list = sges.as_mut_ptr();
    wr.num_sge = sges.len() as i32;
    // Three ways, not a table of jumps: an indirect jump costs more than the two tests (under
    // emulation, far more).
    match op {
        RdmaOp::Read => wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
        RdmaOp::Write { imm: None } => wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        _ => rdma_wr_other(wr, op, remote_addr, rkey),
    }
    if matches!(op, RdmaOp::Write { .. } | RdmaOp::Read) {
        wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
    }
    let len: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
    if matches!(op, RdmaOp::Write { .. }) && len > 0 && len <= u64::from(info.max_inline) {
        sys::ibv_send_flags::IBV_SEND_INLINE.0
    } else {
        0
    }
}
