//! Dispatch of a shared device CQ's work completions (`devcq.rs`) to the connections' ledgers
//! (`conn.rs`): by queue-pair number and tag, under each connection's lock, in the order the
//! device reported them - parked, in order, when a driver turn finds the lock held.
//!
//! The ledger keeps each connection's outstanding work in posting order (sends and receives
//! each complete in order on an RC queue pair): a completion also completes the unsignaled
//! sends before it (successfully) and the receives before it (as flushed); the first error
//! fails the connection; the server's hello receive tells it where its credit writes go.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdma_sys as sys;

use crate::cq::{Opcode, Sink, WcStatus};
use crate::idmap::IdMap;
use crate::verbs::conn::{
    ConnState, HELLO_BIT, PostState, RECV_BIT, SEQ_MASK, TAG_MASK, at_or_before, is_pool_wr,
    try_lock,
};

/// A work completion, copied out of the device's record.
#[derive(Clone, Copy)]
pub(super) struct Wc {
    pub(super) wr_id: u64,
    pub(super) qp_num: u32,
    status: WcStatus,
    byte_len: u32,
    imm: Option<u32>,
    /// A receive the peer's write with immediate consumed (its bytes are in place elsewhere).
    write_imm: bool,
}

impl Wc {
    pub(super) fn new(wc: &sys::ibv_wc) -> Wc {
        let mut status = map_status(wc.status);
        // soft-RoCE (rxe) reports a receive too small for its message as a local QP operation
        // error rather than a length error; on a receive that is what it means.
        if wc.wr_id & RECV_BIT != 0 && wc.status == sys::ibv_wc_status::IBV_WC_LOC_QP_OP_ERR {
            status = WcStatus::LocalLength;
        }
        let imm = (wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate data.
            .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        Wc {
            wr_id: wc.wr_id,
            qp_num: wc.qp_num,
            // The opcode is defined only for a success.
            write_imm: status == WcStatus::Success
                && wc.opcode == sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            status,
            // The device's byte count means something only for a success (for a write with
            // immediate, it is the bytes written).
            byte_len: if status == WcStatus::Success {
                wc.byte_len
            } else {
                0
            },
            imm,
        }
    }
}

fn map_status(s: u32) -> WcStatus {
    use sys::ibv_wc_status::*;
    match s {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        IBV_WC_LOC_PROT_ERR | IBV_WC_LOC_ACCESS_ERR => WcStatus::LocalProtection,
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        IBV_WC_REM_INV_REQ_ERR | IBV_WC_REM_OP_ERR => WcStatus::RemoteError,
        IBV_WC_RETRY_EXC_ERR | IBV_WC_RNR_RETRY_EXC_ERR | IBV_WC_RESP_TIMEOUT_ERR => {
            WcStatus::Transport
        }
        _ => WcStatus::General,
    }
}

/// A connection on the device CQ.
pub(super) struct Member {
    pub(super) tag: u64,
    /// Its shared state, from the start of the connection (completions that come before, such
    /// as the client's hello arriving at a server still setting up, are parked until then).
    pub(super) sh: Option<Arc<ConnState>>,
    /// Completions not yet delivered because its lock was held by a thread of the program.
    pub(super) parked: VecDeque<Wc>,
}

/// What the poll lock guards.
pub(super) struct PollState {
    pub(super) members: IdMap<u32, Member>,
    /// Parked completions, over all members.
    pub(super) parked: usize,
    /// Connections using the CQ (from before their queue pair exists until after it is gone).
    pub(super) users: u32,
    /// Entries the CQ holds, and how many its users may need at once: each connection's send
    /// and receive depths and the library's own slots, since a queue pair in error reports
    /// every outstanding work request, signaled or not.
    pub(super) size: u32,
    pub(super) need: u32,
    pub(super) next_tag: u16,
    /// The shared receive queues whose receives may complete here (key, depth, connections),
    /// each counted once in `need`.
    pub(super) pools: Vec<(usize, u32, u32)>,
    /// No user is left: the CQ is being destroyed, and must not be touched.
    pub(super) retired: bool,
    /// The pollers' side of the completion channel (see `DevCq::arm_descriptor`).
    pub(super) channel: Channel,
}

/// The completion channel, as the queue's pollers keep it (whether they take its events is
/// `DevCq::pollers_channel`).
#[derive(Default)]
pub(super) struct Channel {
    /// It is in the queue's descriptor (an epoll set).
    pub(super) in_set: bool,
    /// The device gave completions since the pollers last took the channel's events: an
    /// event may wait there, which the next arming must take (else it would keep a
    /// level-triggered waiter awake).
    pub(super) polled: bool,
    /// Events the pollers took and have not acknowledged.
    pub(super) unacked: u32,
}

/// Delivers `wc` to its connection, or parks it (see [`DevCq::drain`](crate::verbs::devcq::DevCq::drain)). Returns how many
/// records it emitted.
#[inline(always)]
pub(super) fn deliver(ps: &mut PollState, wc: Wc, blocking: bool, out: &mut Sink<'_>) -> usize {
    let PollState {
        members, parked, ..
    } = ps;
    // An unknown queue pair, or a stale completion of an earlier one with the same number
    // (see the module's doc): nobody's.
    let Some(m) = members.get_mut(&wc.qp_num) else {
        return 0;
    };
    // A pool's receive carries no connection's tag (`srq.rs`).
    if wc.wr_id & TAG_MASK != m.tag && !is_pool_wr(wc.wr_id) {
        return 0;
    }
    let Member {
        sh, parked: mine, ..
    } = m;
    let Some(sh) = sh.as_deref() else {
        mine.push_back(wc);
        *parked += 1;
        return 0;
    };
    let guard = if blocking {
        Some(sh.lock())
    } else {
        try_lock(&sh.state)
    };
    let Some(mut st) = guard else {
        mine.push_back(wc);
        *parked += 1;
        return 0;
    };
    let failed = st.failed.is_some();
    let mut n = 0;
    if *parked > 0 {
        while let Some(p) = mine.pop_front() {
            *parked -= 1;
            n += complete(sh, &mut st, &p, out);
        }
    }
    n += complete(sh, &mut st, &wc, out);
    settle(sh, &mut st, failed);
    n
}

/// Delivers parked completions of every member whose lock can be had. Returns the records.
pub(super) fn unpark(ps: &mut PollState, blocking: bool, out: &mut Sink<'_>) -> usize {
    let mut n = 0;
    let PollState {
        members, parked, ..
    } = ps;
    for m in members.values_mut() {
        if m.parked.is_empty() {
            continue;
        }
        let Some(sh) = m.sh.clone() else { continue };
        let guard = if blocking {
            Some(sh.lock())
        } else {
            try_lock(&sh.state)
        };
        let Some(mut st) = guard else { continue };
        let failed = st.failed.is_some();
        while let Some(p) = m.parked.pop_front() {
            *parked -= 1;
            n += complete(&sh, &mut st, &p, out);
        }
        settle(&sh, &mut st, failed);
    }
    n
}

/// After completions were delivered to a connection: owed credit writes go out, and its turn
/// runs when it just failed (to tear it down) or is closing (it waits for its flushes).
fn settle(sh: &ConnState, st: &mut PostState, failed_before: bool) {
    sh.push_credits(st);
    // A message of the peer's may have brought credits for sends held for them.
    // Relaxed: only changed under the state lock, which is held.
    if sh.has_held.load(Ordering::Relaxed) {
        sh.pump(st);
    }
    if (!failed_before && st.failed.is_some()) || st.closed {
        sh.reg.wake();
    }
}

/// Completes the work one device completion reports, in the connection's ledger. Notes the
/// first error that failed the queue pair. Returns how many records it emitted.
#[inline(always)]
pub(super) fn complete(sh: &ConnState, st: &mut PostState, wc: &Wc, out: &mut Sink<'_>) -> usize {
    let status = wc.status;
    if status != WcStatus::Success && status != WcStatus::Flushed && st.failed.is_none() {
        st.failed = Some(status);
    }
    let mut n = 0;
    if is_pool_wr(wc.wr_id) {
        // A receive of the connection's shared receive queue: the device took it from the
        // pool for this connection's message (or flushed it there, as the queue pair failed
        // in the middle of one).
        if let Some((q, d)) = &sh.pool
            && let Some(wr_id) = d.take(wc.wr_id)
        {
            q.taken_by_device();
            let op = if wc.write_imm {
                Opcode::RecvWriteImm
            } else {
                Opcode::Recv
            };
            out.put(sh.report.record(wr_id, op, status, wc.byte_len, wc.imm));
            return 1;
        }
        return 0;
    }
    if wc.wr_id & HELLO_BIT != 0 {
        // The client's hello: where this side's credit writes go from now on.
        if status == WcStatus::Success
            && let Some(c) = st.credits.as_mut()
        {
            c.peer = Some(c.mr.read_hello());
            c.owed = c.posted > c.pushed;
        }
        return 0;
    }
    let seq = wc.wr_id & SEQ_MASK;
    if wc.wr_id & RECV_BIT != 0 {
        // Usually the oldest receive is the one that completed: the loop ends with it.
        while let Some(e) = st.recvs.pop_front() {
            let this = e.seq & SEQ_MASK == seq;
            if !this && !at_or_before(e.seq, seq) {
                // Posted after the one that completed (a stale completion): not this one's.
                st.recvs.push_front(e);
                break;
            }
            if let Some(c) = st.credits.as_mut() {
                c.consumed += 1;
            }
            n += 1;
            if this {
                let (op, imm) = match (wc.write_imm, st.credits.as_mut()) {
                    (true, _) => (Opcode::RecvWriteImm, wc.imm),
                    // A library peer's send: its immediate is the peer's count of receives
                    // posted, the library's, not the caller's (see `credit.rs`).
                    (false, Some(c)) => {
                        if let (WcStatus::Success, Some(count)) = (status, wc.imm) {
                            c.note_peer_imm(count);
                        }
                        (Opcode::Recv, None)
                    }
                    (false, None) => (Opcode::Recv, wc.imm),
                };
                out.put(sh.report.record(e.wr_id, op, status, wc.byte_len, imm));
                break;
            }
            out.put(
                sh.report
                    .record(e.wr_id, Opcode::Recv, WcStatus::Flushed, 0, None),
            );
        }
    } else {
        // The send queue completes in order (sends and one-sided operations alike): the
        // unsignaled work before `seq` finished successfully. Each record carries the opcode
        // the ledger noted at posting (a device's opcode is undefined on an error).
        while let Some(e) = st.sends.pop_front() {
            let this = e.seq & SEQ_MASK == seq;
            if !this && !at_or_before(e.seq, seq) {
                // Posted after the one that completed (a stale completion): not this one's.
                st.sends.push_front(e);
                break;
            }
            if e.internal {
                st.internal_out -= 1;
            } else {
                st.user_work -= 1;
            }
            let s = if this { status } else { WcStatus::Success };
            if !e.internal && (e.signaled || s != WcStatus::Success) {
                out.put(sh.report.record(e.wr_id, e.op, s, 0, None));
                n += 1;
            }
            e.release();
            if this {
                break;
            }
        }
    }
    n
}
