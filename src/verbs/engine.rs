//! The background work of one verbs connection, run by its context's progress driver
//! (`crate::driver`) rather than a thread of its own: connection events (its RDMA CM event
//! channel is its one descriptor), keepalives, the credit look-ups while sends are held, the
//! port-down grace, and teardown - each a deadline or a readiness, never a wait. Completions
//! are moved by the shared device CQ (`devcq.rs`): by the queue's pollers, by its own driver
//! turns, and by these turns on the way.
//!
//! A turn never blocks: it only tries the connection's lock (and the device CQ's poll lock),
//! and comes back when a poster or poller holds it.
//!
//! Teardown, as turns: a side that closes first writes the claims of messages it took from its
//! bounce area that the peer was not yet told, and waits for that write; the queue pair is
//! disconnected (which flushes its work); each turn then takes what the device reported and
//! looks at what is outstanding, until nothing is or [`FLUSH_WAIT`] has passed; the connection
//! then leaves the device CQ, reports the rest as flushed, destroys its queue pair, CM id and
//! credit block, gives its share of the device CQ back, and reports the disconnect - its last
//! record.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use rdma_sys as sys;
use sys::rdma_cm_event_type::*;

use crate::conn::{ConnInfo, ConnOptions, End, Setup, Transport, Unfinished, flush_outstanding};
use crate::cq::{Reporter, Sink, WcStatus};
use crate::driver::{Handler, Next, Ready};
use crate::error::Result;
use crate::verbs::cm::EventChannel;
use crate::verbs::conn::{Conn, ConnState, PostState, try_lock};
use crate::verbs::credit::{Credits, HELLO_LEN, INTERNAL_SLOTS};
use crate::verbs::devcq::DevCq;
use crate::verbs::handshake::{Established, Resources};
use crate::verbs::res::post_error;

/// How long a connection's turns first wait while sends wait for credits (or a credit write
/// is owed), doubling up to [`CREDIT_POLL_MAX`].
const CREDIT_POLL_MIN: Duration = Duration::from_micros(50);
const CREDIT_POLL_MAX: Duration = Duration::from_millis(4);
/// How long teardown waits for the device to flush outstanding work before reporting the
/// rest as flushed itself.
pub(super) const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// While teardown waits for flushes: the longest between two looks at the device CQ.
const FLUSH_STEP: Duration = Duration::from_millis(20);
/// How often a connection's turn comes when nothing else brings it (it looks at the device
/// CQ for failures, at the port, and at the ledger), at the least.
const TICK: Duration = Duration::from_secs(1);

/// Where the connection is in its life.
#[derive(Clone, Copy)]
enum Stage {
    Up,
    /// Ending: the connection is to be closed to posters and disconnected.
    Close(End),
    /// Closing here: waiting (until the deadline) for the write of the last claims, the work
    /// request numbered, to complete before the disconnect.
    Tell(End, u64, Instant),
    /// Waiting (until the deadline) for the device to flush the outstanding work.
    Flush(End, Instant),
    /// Leaving the device CQ; the rest is reported as flushed.
    Leave(End),
    /// Resources destroyed; giving the device CQ share back.
    Release(End),
    /// This was the device CQ's last connection: waiting for the CQ to be destroyed (by its
    /// own turn), so that nothing of the connection is left when the disconnect is reported.
    CqGone(End),
    /// Reporting the disconnect.
    Report(End),
}

/// The grid routine deadlines are rounded up to (see `Engine::turn`).
const GRID: Duration = Duration::from_millis(8);

/// `t`, rounded up to the next point of a grid of [`GRID`] common to the process.
fn on_grid(t: Instant) -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    let since = t.saturating_duration_since(epoch).as_nanos();
    let grid = GRID.as_nanos();
    let up = (grid - since % grid) % grid;
    t + Duration::from_nanos(up as u64)
}

/// How long a queue pair resends an unacknowledged packet before it fails:
/// (retry_count + 1) x 4.096 us x 2^ack_timeout.
fn retry_bound(opts: &ConnOptions) -> Duration {
    let t = u32::from(opts.ack_timeout.min(31));
    Duration::from_nanos(4096 * (1u64 << t) * (u64::from(opts.retry_count) + 1))
}

pub(super) struct Engine {
    sh: Arc<ConnState>,
    /// The device CQ the connection shares with the others of its queue on its device.
    devcq: Arc<DevCq>,
    /// Dropped in teardown, except the share of the device CQ until it is given back.
    res: Option<Resources>,
    /// The CM event channel, the registration's descriptor 0: closed only when the driver
    /// drops this handler, after it took the descriptor out of its set.
    ch: Option<EventChannel>,
    /// How long the connection's port may stay down before the connection fails: as long as
    /// the device's resends would take to give up on a peer that stopped answering.
    port_grace: Duration,
    /// How long the next wait is while sends wait for credits.
    credit_poll: Duration,
    /// The ledger's sequence when the last turn looked, and when it last changed (the
    /// connection was active): a keepalive goes out after a whole keepalive period without.
    seen_seq: u64,
    active: Instant,
    /// The peer disconnected (the end is decided once the device CQ has been looked at).
    peer_gone: bool,
    /// [`Progress::Caller`](crate::Progress::Caller): the queue's pollers take completions
    /// from the device.
    caller_polls: bool,
    /// The queue's count of polls when the last turn looked.
    seen_polls: u64,
    stage: Stage,
}

impl Engine {
    fn res(&self) -> &Resources {
        self.res.as_ref().expect("resources live until teardown")
    }

    /// One turn while the connection is up: `Err` when it must end.
    fn turn(&mut self, ready: &Ready) -> std::result::Result<Next, End> {
        if ready.fd(0) {
            self.read_cm_events()?;
        }
        if self.sh.reg.stop_asked() {
            return Err(End::Local);
        }
        // A failed work request the device reported (before a disconnect, too: the peer often
        // disconnects because of it) says why the connection ends. With caller progress the
        // queue's pollers take it from the device (and wake this connection when it failed
        // it): the turn looks itself only when they have not polled since its last turn, or
        // when the peer disconnected. So busy pollers never meet the driver on the CQ's lock.
        // Relaxed: the poll count is a sign of life, sampled.
        let polls = self.sh.report.cq.polls();
        if !self.caller_polls || polls == self.seen_polls || self.peer_gone {
            self.devcq.drain_now();
        }
        self.seen_polls = polls;
        let now = Instant::now();
        let Some(mut st) = try_lock(&self.sh.state) else {
            return Ok(Next::Yield);
        };
        self.sh.pump(&mut st);
        self.sh.push_credits(&mut st);
        if let Some(fail) = st.failed {
            return Err(End::Failed(fail));
        }
        if self.peer_gone {
            // An RDMA CM disconnect: the peer's kernel closes in order even for a process
            // that died.
            return Err(End::Peer { clean: true });
        }
        // The routine looks (tick, keepalive) of all the connections fall on a common grid, so
        // that many idle connections cost their driver few wake-ups.
        let mut routine = now + TICK;
        if let Some(k) = self.sh.keepalive {
            if st.next_seq != self.seen_seq {
                self.seen_seq = st.next_seq;
                self.active = now;
            } else if now >= self.active + k {
                self.send_keepalive(&mut st);
                self.seen_seq = st.next_seq;
                self.active = now;
            }
            routine = routine.min(self.active + k);
        }
        let mut next = on_grid(routine);
        let r = self.res();
        if let Some(since) = r.dev.down_since(r.port) {
            // The local port went down and stayed down: the peer can't be reached, and some
            // devices never fail the queue pair's outstanding work on their own.
            let at = since + self.port_grace;
            if now >= at {
                return Err(End::Failed(WcStatus::Transport));
            }
            next = next.min(at);
        }
        if ConnState::credit_busy(&st) {
            // Sends wait for credits, which arrive on a message of the peer's (its delivery
            // starts them) or as an RDMA write (no completion): look at the word again soon,
            // backing off while nothing comes.
            next = next.min(now + self.credit_poll);
            self.credit_poll = (self.credit_poll * 2).min(CREDIT_POLL_MAX);
        } else {
            self.credit_poll = CREDIT_POLL_MIN;
        }
        Ok(Next::Wait(Some(next)))
    }

    fn read_cm_events(&mut self) -> std::result::Result<(), End> {
        let ch = self
            .ch
            .as_ref()
            .expect("the channel lives as long as the engine");
        loop {
            match ch.get_event(Some(Instant::now())) {
                Ok(Some(ev)) => match ev.kind {
                    RDMA_CM_EVENT_DISCONNECTED => self.peer_gone = true,
                    RDMA_CM_EVENT_DEVICE_REMOVAL => return Err(End::Failed(WcStatus::Transport)),
                    _ => {}
                },
                Ok(None) => return Ok(()),
                Err(_) => return Err(End::Failed(WcStatus::General)),
            }
        }
    }

    /// Posts a keepalive when nothing is outstanding on the send queue (so the queue pair has
    /// been idle for a whole keepalive period); a busy connection needs none.
    /// (Unsignaled credit writes that finished long ago do not count: the device reports
    /// nothing more of them.)
    fn send_keepalive(&self, st: &mut PostState) {
        if st.closed || st.sends.iter().any(|e| !e.internal || e.hw_signaled) {
            return;
        }
        // A failed post is left for the next period.
        self.post_empty_write(st);
    }

    /// Posts a signaled zero-length RDMA write of the library's own (a keepalive, or the
    /// teardown's drain marker); a failed post is dropped (each caller says what then).
    fn post_empty_write(&self, st: &mut PostState) {
        // SAFETY: ibv_send_wr is plain data; zero is a valid start (no SGE, remote address 0,
        // rkey 0: a zero-length RDMA write checks neither, and a flushed one runs nowhere).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        let _ = self.sh.post_internal(st, &mut wr, true);
    }

    /// Posts a signaled zero-length RDMA write behind everything on the send queue, which is
    /// in the error state now: the device flushes it, and since an RC queue pair completes its
    /// work in order, its flush says that every work request before it is done - the ones the
    /// device reported, and the unsignaled ones it did not because they had finished. Without
    /// it an unsignaled send that had reached the peer looked outstanding: the flush waited
    /// [`FLUSH_WAIT`] for a report that never comes and then called it flushed. When the
    /// device refuses the post, that remains the way.
    fn post_drain_marker(&self, st: &mut PostState) {
        if !st.sends.iter().any(|e| !e.hw_signaled) {
            // Everything left is reported by the device itself.
            return;
        }
        // The queue pair lives until the teardown's `Leave` stage, after the flushes.
        self.post_empty_write(st);
    }

    /// Whether the device has put the queue pair in the error state (false when it cannot
    /// say). Only before this side's own disconnect, which puts it there.
    fn qp_in_error(&self) -> bool {
        // SAFETY: plain data; zero is a valid start for both.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP lives until the teardown's `Leave` stage; both out-parameters are live
        // locals.
        let r = unsafe {
            sys::ibv_query_qp(
                self.sh.qp,
                &mut attr,
                sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        r == 0 && attr.qp_state == sys::ibv_qp_state::IBV_QPS_ERR
    }

    /// Before `deadline`: arms the device CQ so that the next completion wakes this
    /// connection, and returns the wait until then (or [`FLUSH_STEP`], the longest between
    /// two looks).
    fn wait_for_device(&self, deadline: Instant) -> Option<Next> {
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        self.devcq.arm_now();
        Some(Next::Wait(Some((now + FLUSH_STEP).min(deadline))))
    }

    /// One teardown turn (see the module's doc).
    fn teardown(&mut self) -> Next {
        loop {
            match self.stage {
                Stage::Up => unreachable!("teardown of a live connection"),
                Stage::Close(end) => {
                    let Some(mut st) = try_lock(&self.sh.state) else {
                        return Next::Yield;
                    };
                    // Messages this side took from its bounce area are delivered, but their
                    // sender knows it only from the claims: they go before the disconnect,
                    // which would flush them unwritten. (A peer that left, or a failed
                    // connection, gets nothing more.)
                    if matches!(end, End::Local) {
                        if let Some(seq) = self.sh.tell_claims(&mut st) {
                            drop(st);
                            self.stage = Stage::Tell(end, seq, Instant::now() + FLUSH_WAIT);
                            continue;
                        }
                    }
                    st.closed = true;
                    // The peer disconnected with nothing of this side's failed, but the queue
                    // pair is in error already (nothing here moved it; a disconnect does not):
                    // the device failed it as the responder of a request of the peer's, which a
                    // peer of this library makes only with a one-sided access it was not
                    // allowed (a bad key or range, a right the region lacks).
                    let end = match end {
                        End::Peer { .. } if st.failed.is_none() && self.qp_in_error() => {
                            End::Failed(WcStatus::PeerAccess)
                        }
                        end => end,
                    };
                    // SAFETY: live id; moves the QP to the error state so outstanding work is
                    // flushed. An error (already disconnected) changes nothing.
                    unsafe { sys::rdma_disconnect(self.res().id_raw()) };
                    self.post_drain_marker(&mut st);
                    drop(st);
                    self.stage = Stage::Flush(end, Instant::now() + FLUSH_WAIT);
                }
                Stage::Tell(end, seq, deadline) => {
                    self.devcq.drain_now();
                    let Some(st) = try_lock(&self.sh.state) else {
                        return Next::Yield;
                    };
                    let written =
                        st.failed.is_some() || st.sends.front().is_none_or(|e| e.seq > seq);
                    drop(st);
                    if !written && let Some(wait) = self.wait_for_device(deadline) {
                        return wait;
                    }
                    self.stage = Stage::Close(end);
                }
                Stage::Flush(end, deadline) => {
                    self.devcq.drain_now();
                    let Some(st) = try_lock(&self.sh.state) else {
                        return Next::Yield;
                    };
                    let outstanding = st.outstanding();
                    // A peer that disconnects because one of this side's work requests failed
                    // there (a receive too small, say) may be heard of before the device reports
                    // the failure here: when it comes, with the flushes, it says why the
                    // connection ended. (Flushes themselves fail nothing.) That failure is also
                    // what put the queue pair in error when the peer's disconnect came first, so
                    // it overrides a peer's bad access inferred from that state at `Close`.
                    let end = match (end, st.failed) {
                        (End::Peer { .. } | End::Failed(WcStatus::PeerAccess), Some(status)) => {
                            End::Failed(status)
                        }
                        (end, _) => end,
                    };
                    drop(st);
                    self.stage = Stage::Flush(end, deadline);
                    // Flushes come as completions; their delivery wakes this connection.
                    if outstanding && let Some(wait) = self.wait_for_device(deadline) {
                        return wait;
                    }
                    self.stage = Stage::Leave(end);
                }
                Stage::Leave(end) => {
                    let sh = &self.sh;
                    let qp_num = self.res().att.qp_num().unwrap_or(u32::MAX);
                    if !self.devcq.leave(sh, qp_num, |st| flush_rest(sh, st)) {
                        return Next::Yield;
                    }
                    // Resources go before the record, so a caller that sees it can count on
                    // them being gone (the device CQ is shared; the CM channel is closed with
                    // this handler).
                    self.res.as_mut().expect("resources").destroy();
                    self.stage = Stage::Release(end);
                }
                Stage::Release(end) => {
                    let Some(retired) = self.res.as_mut().expect("resources").att.try_release()
                    else {
                        return Next::Yield;
                    };
                    self.res = None;
                    self.stage = if retired {
                        Stage::CqGone(end)
                    } else {
                        Stage::Report(end)
                    };
                }
                Stage::CqGone(end) => {
                    if !self.devcq.gone() {
                        return Next::Again;
                    }
                    self.stage = Stage::Report(end);
                }
                Stage::Report(end) => {
                    end.report(&self.sh.report);
                    return Next::Done;
                }
            }
        }
    }
}

/// Completes everything the device did not report as flushed: the send-queue work that
/// reached it (sends and one-sided operations), then the sends and writes with immediate held
/// for credits (which never did), then the receives.
fn flush_rest(sh: &ConnState, st: &mut PostState) {
    // The peer may have taken the first from its bounce area (and said so before it left).
    sh.finish_bounced(st);
    let held = st.credits.as_mut().map(|c| {
        // Nothing more is told the peer.
        c.claims_told = c.claims;
        std::mem::take(&mut c.held)
    });
    sh.note_held(st);
    let (sends, recvs) = (&mut st.sends, &mut st.recvs);
    let on_device = std::iter::from_fn(|| sends.pop_front())
        .filter(|e| !e.internal)
        .map(|e| Unfinished::flushed(e.wr_id, e.op));
    let held = held
        .into_iter()
        .flatten()
        .map(|h| Unfinished::flushed(h.wr_id, h.opcode()));
    let recvs = std::iter::from_fn(|| recvs.pop_front()).map(|e| e.wr_id);
    let report = &sh.report;
    flush_outstanding(
        report,
        &mut Sink::queue(&report.cq),
        on_device.chain(held),
        recvs,
    );
}

impl Handler for Engine {
    fn run(&mut self, ready: &Ready) -> Next {
        if let Stage::Up = self.stage {
            let end = match crate::panic::catch(|| self.turn(ready)) {
                Ok(Ok(next)) => return next,
                Ok(Err(end)) => end,
                Err(_) => End::Failed(WcStatus::General),
            };
            self.stage = Stage::Close(end);
        } else if ready.fd(0) {
            // What comes on the CM channel once the connection is ending (its own disconnect's
            // event among it) changes nothing, but left unread it would keep the descriptor
            // ready, making every round of the driver a turn of this connection while it waits
            // for its flushes.
            let _ = self.read_cm_events();
        }
        self.teardown()
    }
}

impl Conn {
    /// Starts a connection whose queue pair is established: its shared state joins the device
    /// CQ, and the turns that take over its handshake's registration are returned.
    pub(super) fn start(
        e: Established,
        opts: &ConnOptions,
        setup: &Setup,
    ) -> Result<(Conn, Box<dyn Handler>)> {
        let Established {
            cq,
            mut res,
            peer_data,
            library_peer,
            credits,
        } = e;
        let info = ConnInfo {
            id: setup.id(),
            send_queue_depth: (res.caps.max_send_wr - INTERNAL_SLOTS).min(opts.send_queue_depth),
            // On a shared receive queue the connection has no receive queue of its own.
            recv_queue_depth: if res.pool.is_some() {
                0
            } else {
                (res.caps.max_recv_wr - 1).min(opts.recv_queue_depth)
            },
            max_inline: res.caps.max_inline_data.min(opts.max_inline),
            shm_ring_size: 0,
            transport: Transport::Verbs,
        };
        // A client that speaks credits sends its hello first (see `crate::verbs::credit`).
        let client_hello = credits.as_ref().is_some_and(|(_, peer)| peer.is_some());
        let credits = credits.map(|(mut mr, peer)| {
            if peer.is_some() {
                mr.fill_hello();
            }
            Credits::new(mr, peer, info.send_queue_depth, info.recv_queue_depth)
        });
        let sh = Arc::new(ConnState {
            info,
            report: Reporter {
                cq,
                conn_id: info.id,
                context: opts.context,
                peer: res.peer(),
            },
            pd: res.pd.clone(),
            qp: res.qp_raw(),
            max_send_sge: res.caps.max_send_sge.min(crate::conn::SGE_MAX as u32),
            atomics: res.limits.atomics,
            tag: res.att.tag,
            held_conns: res.att.devcq.held_conns(),
            state: parking_lot::Mutex::new(PostState {
                closed: false,
                failed: None,
                next_seq: 0,
                sends: std::collections::VecDeque::with_capacity(
                    (info.send_queue_depth + INTERNAL_SLOTS) as usize,
                ),
                recvs: std::collections::VecDeque::with_capacity(info.recv_queue_depth as usize),
                user_work: 0,
                internal_out: 0,
                unsignaled_run: 0,
                credits,
            }),
            reg: setup.registration().clone(),
            has_held: AtomicBool::new(false),
            pool: res.pool.clone(),
            keepalive: opts.keepalive.filter(|_| library_peer),
        });
        if client_hello {
            let mut st = sh.lock();
            let c = st.credits.as_ref().expect("credits");
            let mut sge = sys::ibv_sge {
                addr: c.mr.hello_addr(),
                length: HELLO_LEN as u32,
                lkey: c.mr.lkey(),
            };
            // SAFETY: ibv_send_wr is plain data; zero is a valid start.
            let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND;
            if let Err(r) = sh.post_internal(&mut st, &mut wr, true) {
                return Err(post_error(r, "send"));
            }
        }
        // Until the connection is up (`Conn::connected`), the device CQ parks this queue pair's
        // completions; then they go to `sh`.
        let join = parking_lot::Mutex::new(Some(res.att.joiner()));
        let ch = res.ch.take().expect("the connection's event channel");
        let engine = Engine {
            devcq: res.att.devcq.clone(),
            sh: sh.clone(),
            res: Some(res),
            ch: Some(ch),
            port_grace: retry_bound(opts),
            credit_poll: CREDIT_POLL_MIN,
            seen_seq: 0,
            active: Instant::now(),
            peer_gone: false,
            caller_polls: sh.report.cq.options().progress == crate::cq::Progress::Caller,
            seen_polls: u64::MAX,
            stage: Stage::Up,
        };
        let conn = Conn {
            sh,
            private_data: peer_data,
            join,
        };
        Ok((conn, Box::new(engine)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routine_deadlines_fall_on_a_common_grid_never_early() {
        on_grid(Instant::now()); // fixes the grid's origin
        let t0 = Instant::now();
        let g0 = on_grid(t0);
        assert!(g0 >= t0 && g0 < t0 + GRID);
        for us in [1, 999, 3_001, 7_999, 8_000, 123_456] {
            let t = t0 + Duration::from_micros(us);
            let g = on_grid(t);
            assert!(g >= t && g < t + GRID, "{us} us");
            assert_eq!(on_grid(g), g, "a grid point stays put");
            // Every instant between the previous point and this one maps to it.
            assert_eq!(on_grid(g - GRID + Duration::from_nanos(1)), g);
        }
    }
}
