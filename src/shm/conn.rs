//! One shm connection as its users see it: posting takes the connection's lock and drives the
//! data path (`flow.rs`) on the caller's thread; with [`Progress::Caller`] so does polling the
//! completion queue. Its background work (`engine.rs`), run by the context's progress driver,
//! watches for the peer leaving, moves data while somebody sleeps on the queue (or always, with
//! [`Progress::Thread`]), and tears the connection down.

use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, MutexGuard};

use crate::conn::seam::ConnSeam;
use crate::conn::{
    ConnInfo, ConnOptions, OneOp, Payload, RdmaOp, RdmaRequest, RecvRequest, SendRequest, Setup,
    Transport, Waiter,
};
use crate::cq::notice::Board;
use crate::cq::{CompletionQueue, Progress, Reporter, Sink, SlotReservation, Source, WcStatus};
use crate::driver::Registration;
use crate::error::Result;
use crate::mr::MemoryRegion;
use crate::shm::bell;
use crate::shm::flow::{Flow, Pool, RecvWr, SendSrc, SharedRegions};
use crate::shm::onesided::{self, Exports, Import, ImportCache, Shortcut, SocketReader};
use crate::shm::segment::Segment;
use crate::sync::{SpinGuard, SpinLock};

/// State shared by the users of a connection, the pollers of its completion queue, and its
/// background work on the driver.
pub(crate) struct ConnState {
    pub(crate) info: ConnInfo,
    /// Where this connection's completions go.
    pub(crate) report: Reporter,
    /// The data path. Held briefly by whoever posts, polls or drives, never across a sleep (a
    /// spin lock); taken through [`ConnState::lock`], whose guard publishes `gate` as it lets go.
    flow: SpinLock<Flow>,
    /// [`Flow::gate`] as of the last release of the flow's lock: what the lock-free one-sided
    /// path reads instead of taking that lock (see [`Conn::rdma`]).
    gate: AtomicUsize,
    /// The peer's region the last one-sided operation reached (see `onesided/`). Taken
    /// after the flow's lock when both are held, and alone by the lock-free one-sided path;
    /// never by pollers. A spin lock: it is held for an access or a look-up, never across a
    /// sleep (the locked path may take the socket reader's lock, held as briefly).
    imports: Arc<SpinLock<ImportCache>>,
    /// The peer's region the lock-free write reaches (see `onesided/shortcut.rs`), published
    /// by whoever holds `imports` and fills it.
    shortcut: Arc<Shortcut>,
    /// The connection's segment, this side's index in it, and the peer's process when this
    /// side may reach its memory (as the flow has them; fixed for the connection's life).
    seg: Arc<Segment>,
    side: usize,
    peer_pid: Option<libc::pid_t>,
    /// Pollers of the completion queue drive the data path ([`Progress::Caller`]).
    pub(crate) caller_polls: bool,
    /// The background work is about to sleep (or sleeps) and wants `wake` called.
    pub(crate) engine_sleeping: AtomicBool,
    /// The connection's registration with the driver: wakes its background work, and carries
    /// the user's disconnect ([`Registration::stop`]).
    pub(crate) wake: Registration,
    /// The connection's slot on its queue's notice board, when it has one.
    slot: Option<u32>,
    /// The regions this side lets the peer reach (one-sided operations).
    pub(crate) exports: Arc<Exports>,
    /// The reader of the connection's socket and the peer's regions it learned of. Taken
    /// after the flow's lock when both are held.
    pub(crate) inbox: Arc<Mutex<SocketReader>>,
    /// How many imports the inbox forgot so far (its [`SocketReader::forgotten`]).
    pub(crate) imports_forgotten: Arc<AtomicU64>,
    /// Polls in a row that moved nothing (see `settle`).
    idle_polls: AtomicU32,
    /// On its queue's list of connections polled every time (see `activate`): the peer marks
    /// nothing, and nothing need mark the connection's slot for a poll to look at it.
    polled_every_time: AtomicBool,
}

/// The flow's lock, held: as it lets go it publishes the flow's [`Flow::gate`] - still under
/// the lock, so the publications follow the lock's order and the last one is always current.
pub(crate) struct FlowGuard<'a> {
    gate: &'a AtomicUsize,
    flow: SpinGuard<'a, Flow>,
}

impl FlowGuard<'_> {
    /// The gate as the lock's last holder published it: at the start of this hold, the flow's
    /// [`Flow::gate`] as it is (every change to the flow is made under the lock, and
    /// published as the lock goes).
    pub(crate) fn published(&self) -> usize {
        // Relaxed: the store was made under the lock we hold now.
        self.gate.load(Ordering::Relaxed)
    }
}

impl Deref for FlowGuard<'_> {
    type Target = Flow;
    fn deref(&self) -> &Flow {
        &self.flow
    }
}

impl DerefMut for FlowGuard<'_> {
    fn deref_mut(&mut self) -> &mut Flow {
        &mut self.flow
    }
}

impl Drop for FlowGuard<'_> {
    fn drop(&mut self) {
        // Release: whoever reads the gate with Acquire and finds the connection up also sees
        // what the flow did under the lock before it (the disconnect record, in particular,
        // is queued only after the gate says down).
        self.gate.store(self.flow.gate(), Ordering::Release);
    }
}

impl ConnState {
    pub(crate) fn lock(&self) -> FlowGuard<'_> {
        FlowGuard {
            gate: &self.gate,
            flow: self.flow.lock(),
        }
    }

    /// The flow's lock if it is free now.
    pub(crate) fn try_lock(&self) -> Option<FlowGuard<'_>> {
        let flow = self.flow.try_lock()?;
        Some(FlowGuard {
            gate: &self.gate,
            flow,
        })
    }

    #[inline]
    pub(crate) fn lock_imports(&self) -> SpinGuard<'_, ImportCache> {
        self.imports.lock()
    }

    pub(crate) fn lock_inbox(&self) -> MutexGuard<'_, SocketReader> {
        self.inbox.lock()
    }

    /// Wakes the connection's background work if it sleeps.
    pub(crate) fn kick(&self) {
        // SeqCst fence: orders what we changed before the read of `engine_sleeping`, pairing
        // with the background work's store of `engine_sleeping` before it re-checks (Dekker).
        fence(Ordering::SeqCst);
        if self.engine_sleeping.load(Ordering::SeqCst)
            && self.engine_sleeping.swap(false, Ordering::SeqCst)
        {
            self.wake.wake();
        }
    }

    /// Marks the connection on its own queue's board, so that the next poll looks at it (news
    /// seen and not all taken, or work posted that the peer will not announce before it takes
    /// it: a one-sided completion due now). Nothing to do while the connection is polled every
    /// time.
    fn watch_sends(&self) {
        // Relaxed: a stale `true` is impossible - it turns false under the flow's lock (see
        // `settle`), which every caller took before; a stale `false` costs a useless mark.
        if let Some(slot) = self.slot
            && !self.polled_every_time.load(Ordering::Relaxed)
        {
            self.report.cq.remark(slot);
        }
    }

    /// Whether the background work moves the connection's data now rather than the queue's
    /// pollers: always with progress threads; with caller progress while a thread sleeps in
    /// the queue's `wait`, or when the queue's descriptor was handed out and this connection
    /// cannot ring its bell (it has no slot on the board).
    #[inline]
    pub(crate) fn library_moves(&self) -> bool {
        !self.caller_polls || self.report.cq.library_moves(self.slot.is_some())
    }

    /// After a post: the background work must see the new work if it is the one moving data
    /// now (progress threads, or a sleeper on the queue). Otherwise, when the queue's
    /// descriptor has been handed out and the post has a completion to report, a poller may
    /// sleep on it (this post came from another thread): the peer rings the queue's bell
    /// when it takes the records.
    fn posted(&self, signaled: bool) {
        if self.library_moves() {
            self.kick();
        } else if signaled && self.report.cq.has_bell() {
            self.ask_for_ring();
        }
    }

    /// See `posted`: announce, then look (Dekker with the peer's `notify_peer`), and ring
    /// the bell here when the peer took the records already.
    #[inline(never)]
    fn ask_for_ring(&self) {
        let flow = self.lock();
        let want = flow.sleep_request();
        if want & bell::TAKEN == 0 {
            return;
        }
        self.report.cq.ring_asked();
        flow.set_sleeping(want | flow.sleeping() | bell::QUEUE);
        let work = flow.has_work();
        drop(flow);
        if work {
            self.report.cq.ring_bell();
        }
    }
}

impl ConnState {
    /// After messages that waited for receives were taken on a poster's thread (the post of
    /// a receive, or of the shared receive queue's): that may have ended the connection, or
    /// read packets of the background work's from the socket, which then looks at them now.
    fn after_taking(&self, mut flow: FlowGuard<'_>) {
        let wake = flow.failed.is_some() || flow.take_inbox_news();
        drop(flow);
        if wake {
            self.wake.wake();
        }
    }
}

/// The shared receive queue has receives again, posted on this thread.
impl Waiter for ConnState {
    fn pool_refilled(&self) {
        let mut flow = self.lock();
        flow.pool_refilled(&self.report);
        self.after_taking(flow);
    }
}

/// With [`Progress::Caller`], the completion queue's pollers drive this connection's data path.
impl Source for ConnState {
    fn key(&self) -> u64 {
        self.info.id
    }

    fn poll(&self, out: &mut Sink<'_>) {
        // A poller never waits for the connection's lock: whoever holds it (a poster, another
        // poller, the background work) is moving the connection right now. The next poll
        // looks again - a connection on the list polled every time stays there, and one
        // looked at for a mark on the board is marked again, so its news is not forgotten.
        // Otherwise a connection on the board is marked again only when this poll moved
        // something and left work behind (messages beyond the poll's limit, sends the step
        // left to complete); news that comes later the peer marks, having been asked to (see
        // `settle`), so a busy connection off the list costs a poll nothing until it has news.
        let Some(mut flow) = self.try_lock() else {
            self.watch_sends();
            return;
        };
        if flow.closed || flow.failed.is_some() {
            return;
        }
        let report = &self.report;
        // Under the lock nothing of this connection is on its way into the queue, so an
        // empty queue means no older record of it is waiting there.
        let moved = out.in_order(
            || report.cq.is_empty(),
            usize::MAX,
            |limit, out| flow.step(report, limit, out),
        );
        // Relaxed, load then store: only this connection's pollers count, under its lock.
        let idle = if moved {
            0
        } else {
            self.idle_polls.load(Ordering::Relaxed).saturating_add(1)
        };
        self.idle_polls.store(idle, Ordering::Relaxed);
        if flow.failed.is_some() || flow.take_inbox_news() {
            // The background work tears it down, or has packets of its own to look at.
            drop(flow);
            self.wake.wake();
        } else if moved && !self.polled_every_time.load(Ordering::Relaxed) && flow.has_work() {
            drop(flow);
            self.watch_sends();
        }
    }

    fn arm(&self) {
        // Somebody is about to sleep on the queue: the background work takes over moving data
        // and asks the peer for doorbells until the queue is no longer watched.
        self.wake.wake();
    }

    fn arm_bell(&self) -> bool {
        let Some(flow) = self.try_lock() else {
            return false;
        };
        if flow.closed || flow.failed.is_some() {
            // The background work ends it, and queues the end.
            return true;
        }
        // Announce, then look once more (Dekker with the peer's `notify_peer`).
        flow.set_sleeping(flow.sleep_request() | bell::QUEUE);
        !flow.has_work()
    }

    fn settle(&self) -> bool {
        if self.slot.is_none() || self.idle_polls.load(Ordering::Relaxed) < SETTLE_POLLS {
            return false;
        }
        // Somebody moves the connection right now: not idle.
        let Some(flow) = self.try_lock() else {
            return false;
        };
        if flow.busy() || flow.closed || flow.failed.is_some() {
            // Waiting on the peer, not idle: count again from here.
            self.idle_polls.store(0, Ordering::Relaxed);
            return false;
        }
        // Ask for marks, then look once more: whatever the peer wrote before it could see the
        // request is found now (Dekker with its `notify_peer`).
        flow.set_want_mark(true);
        if flow.has_work() {
            flow.set_want_mark(false);
            self.idle_polls.store(0, Ordering::Relaxed);
            return false;
        }
        // Under the flow's lock: a poster that takes it next marks the slot (`watch_sends`).
        self.polled_every_time.store(false, Ordering::Relaxed);
        true
    }

    fn busy(&self) -> bool {
        // A connection whose lock somebody holds counts as busy.
        self.idle_polls.load(Ordering::Relaxed) == 0 || self.try_lock().is_none_or(|f| f.busy())
    }

    fn activate(&self) {
        self.idle_polls.store(0, Ordering::Relaxed);
        // Not under the flow's lock: the queue's changes of its lists, from which this and
        // `settle` are called, come one at a time, and so do the changes of `want_mark`.
        bell::announce(self.seg.ctrl(self.side).want_mark, 0);
        self.polled_every_time.store(true, Ordering::Relaxed);
    }
}

/// What an established handshake hands to the connection.
pub(crate) struct Link {
    /// 0: the connecting side; 1: the accepting side.
    pub(crate) side: usize,
    pub(crate) sock: OwnedFd,
    pub(crate) seg: Segment,
    /// This connection's slot on its queue's notice board, which the peer marks.
    pub(crate) slot: Option<SlotReservation>,
    /// The peer's notice board and its slot there, which this side marks.
    pub(crate) peer_board: Option<(Arc<Board>, u32)>,
    /// The peer's process, when this side can copy from its memory.
    pub(crate) peer_pid: Option<libc::pid_t>,
    /// The peer's process, as the socket's credentials name it.
    pub(crate) peer_proc: libc::pid_t,
}

/// Polls in a row that find nothing before a connection leaves the list its queue polls every
/// time and asks its peer to mark the board instead (tens of microseconds of idleness): a
/// connection in steady use costs its peer no marking, an idle one costs the pollers nothing.
const SETTLE_POLLS: u32 = 1024;

/// The user's handle of an shm connection. Dropping it tears the connection down.
pub(crate) struct Conn {
    sh: Arc<ConnState>,
    private_data: Vec<u8>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("shm::Conn")
            .field("info", &self.sh.info)
            .finish()
    }
}

/// How messages name the peer process.
pub(crate) fn process_name(pid: libc::pid_t) -> String {
    format!("process {pid}")
}

impl Conn {
    /// The connection's handle, over its started state (see `engine::start`).
    pub(crate) fn new(sh: Arc<ConnState>, peer_private_data: Vec<u8>) -> Conn {
        Conn {
            sh,
            private_data: peer_private_data,
        }
    }
}

/// A connection's state as its handshake leaves it, before its background work starts: the
/// socket that work will own, and the notice-board slot the queue keeps for it.
pub(crate) struct Unstarted {
    pub(crate) sh: Arc<ConnState>,
    pub(crate) sock: OwnedFd,
    pub(crate) slot: Option<SlotReservation>,
}

impl Unstarted {
    /// The state of a connection over an established handshake socket and segment.
    pub(crate) fn new(
        setup: &Setup,
        cq: Arc<CompletionQueue>,
        opts: &ConnOptions,
        link: Link,
    ) -> Result<Unstarted> {
        let Link {
            side,
            sock,
            seg,
            slot,
            peer_board,
            peer_pid,
            peer_proc,
        } = link;
        let info = ConnInfo {
            id: setup.id(),
            send_queue_depth: opts.send_queue_depth,
            // On a shared receive queue the connection has no receive queue of its own.
            recv_queue_depth: if opts.srq.is_some() {
                0
            } else {
                opts.recv_queue_depth
            },
            max_inline: opts.max_inline,
            shm_ring_size: seg.cap() as u32,
            transport: Transport::Shm,
        };
        let caller_polls = cq.options().progress == Progress::Caller;
        let seg = Arc::new(seg);
        let exports = Arc::new(Exports::new(seg.clone(), side, peer_proc, sock.as_raw_fd()));
        let inbox = SocketReader::default();
        let imports_forgotten = inbox.forgotten();
        let inbox = Arc::new(Mutex::new(inbox));
        let imports = Arc::new(SpinLock::new(ImportCache::default()));
        let shortcut = Arc::new(Shortcut::new(seg.clone(), 1 - side));
        if let Some(q) = &opts.srq {
            q.inner.bind_local()?;
        }
        let sock_fd = sock.as_raw_fd();
        // The flow names its connection as the waiter of its shared receive queue.
        let sh = Arc::new_cyclic(|me: &Weak<ConnState>| {
            let pool = opts
                .srq
                .as_ref()
                .map(|q| Pool::new(q.inner.clone(), me.clone() as Weak<dyn Waiter>));
            let flow = Flow::new(
                seg.clone(),
                side,
                sock_fd,
                opts.send_queue_depth,
                opts.recv_queue_depth,
                peer_board,
                peer_pid,
                SharedRegions {
                    exports: exports.clone(),
                    inbox: inbox.clone(),
                },
                pool,
            );
            ConnState {
                info,
                report: Reporter {
                    cq,
                    conn_id: info.id,
                    context: opts.context,
                    peer: process_name(peer_proc),
                },
                gate: AtomicUsize::new(flow.gate()),
                flow: SpinLock::new(flow),
                imports,
                shortcut,
                seg,
                side,
                peer_pid,
                caller_polls,
                engine_sleeping: AtomicBool::new(false),
                wake: setup.registration().clone(),
                slot: slot.as_ref().map(|r| r.slot()),
                idle_polls: AtomicU32::new(0),
                polled_every_time: AtomicBool::new(false),
                exports,
                imports_forgotten,
                inbox,
            }
        });
        Ok(Unstarted { sh, sock, slot })
    }
}

impl Conn {
    /// The lock-free path of an unsignaled one-sided operation without immediate data: when the
    /// connection is up, its send queue has room (as `gate` says: what the flow's lock last
    /// left behind) and the peer's region is the cached one, runs the access holding only the
    /// import cache's lock (which pollers never take) and returns true. A success reports
    /// nothing, takes no slot and leaves the flow as it was, which is why the flow's lock is
    /// not needed. Returns false, having touched nothing, in every other case (a refused access
    /// touches nothing either): the locked path then does it all, and reports what must be.
    ///
    /// Ordering: a post on this thread before this one has published its gate (the guard
    /// stores it before the lock goes), so a full queue or a connection that went down is
    /// seen; a post on another thread at the same time is unordered with this one, as the
    /// header says of posts from several threads. Once the connection is down the gate says so
    /// before its disconnect record is queued: a program that saw the record gets
    /// `Disconnected` from here too, via the locked path.
    fn unlocked_rdma(&self, wr: &RdmaRequest<'_>) -> bool {
        if !self.sendable() {
            return false;
        }
        let cache = self.sh.lock_imports();
        // Acquire: pairs with the inbox's count of what it forgot.
        let seen = self.sh.imports_forgotten.load(Ordering::Acquire);
        let Some(imp) = cache.get(wr.key, seen) else {
            return false;
        };
        // The cache's lock keeps `imp` (and its mapping) alive through the access: teardown
        // and the background work drop cached imports only under it.
        self.access(imp, wr).is_ok()
    }

    /// Runs `wr` on the peer's region `imp`, cached (the caller holds the import cache's lock),
    /// first publishing the region for the lock-free write when `wr` is what that write does:
    /// the paths that reach a region for one publish it, so that the next goes that way. Only
    /// those: a region that was published keeps its address range reserved until the
    /// connection goes (see `onesided/shortcut.rs`).
    fn access(&self, imp: &Import, wr: &RdmaRequest<'_>) -> Result<(), onesided::Refused> {
        if !wr.signaled && wr.op == (RdmaOp::Write { imm: None }) {
            imp.publish(&self.sh.shortcut);
        }
        onesided::run(imp, wr, &self.sh.seg, 1 - self.sh.side, self.sh.peer_pid)
    }

    /// Whether the connection is up and its send queue has room, as the flow's lock last left
    /// it (see `unlocked_rdma`).
    #[inline(always)]
    fn sendable(&self) -> bool {
        let depth = self.sh.info.send_queue_depth as usize;
        // Acquire: pairs with the guard's Release (see `FlowGuard`). A connection that is down
        // has `GATE_DOWN`, above every depth.
        self.sh.gate.load(Ordering::Acquire) < depth
    }

    /// A one-sided operation under the flow's lock (see `rdma`).
    fn locked_rdma(&self, wr: &RdmaRequest<'_>) -> Result<()> {
        let opcode = wr.op.opcode();
        let mut flow = self.sh.lock();
        flow.claim_send()?;
        let key = wr.key;
        let mut cache = self.sh.lock_imports();
        // Acquire: pairs with the inbox's count of what it forgot.
        let seen = self.sh.imports_forgotten.load(Ordering::Acquire);
        let seen = if cache.get(key, seen).is_some() {
            seen
        } else {
            let mut inbox = self.sh.lock_inbox();
            let (import, news) = inbox.find(key, flow.sock());
            if news {
                // Doorbells or a goodbye meant for the background work: pass them on.
                self.sh.wake.wake();
            }
            // Read under the inbox's lock: whatever it forgets later changes the count.
            let seen = self.sh.imports_forgotten.load(Ordering::Acquire);
            cache.set(seen, import);
            seen
        };
        let result = match cache.get(key, seen) {
            Some(imp) => self.access(imp, wr),
            None => Err(onesided::Refused::Denied),
        };
        let was_busy = flow.busy();
        let report = &self.sh.report;
        let failed = match result {
            Ok(()) => {
                drop(cache);
                if let RdmaOp::Write { imm: Some(imm) } = wr.op {
                    flow.post_write_imm(imm, wr.len, wr.wr_id, wr.signaled)?;
                } else {
                    flow.finish_onesided(report, wr.wr_id, opcode, WcStatus::Success, wr.signaled);
                }
                false
            }
            Err(refused) => {
                if refused == onesided::Refused::Withdrawn {
                    self.sh.lock_inbox().forget(key);
                    cache.set(0, None);
                }
                drop(cache);
                flow.finish_onesided(report, wr.wr_id, opcode, WcStatus::RemoteAccess, true);
                flow.fail_access();
                true
            }
        };
        let busy = flow.busy();
        drop(flow);
        if failed {
            // The background work tears the connection down.
            self.sh.wake.wake();
        } else if busy {
            if !was_busy {
                self.sh.watch_sends();
            }
            self.sh.posted(wr.signaled);
        }
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
        let keep = || match wr.payload {
            Payload::Region { mr, offset, .. } => SendSrc::Region {
                mr: mr.clone(),
                offset,
            },
            Payload::Inline(data) => SendSrc::Inline(data.into()),
        };
        let region = match wr.payload {
            Payload::Region { mr, .. } => Some(mr),
            Payload::Inline(_) => None,
        };
        let mut flow = self.sh.lock();
        let gate = flow.published();
        // Sends in flight or waiting (the gate counts them), or the connection is down (and
        // the post is refused below).
        let was_busy = gate != 0;
        // SAFETY: a checked request's bytes are readable for its length during the call: a
        // range inside a region the caller holds, or the caller's slice.
        unsafe {
            flow.post_send(
                gate,
                wr.ptr(),
                wr.len(),
                wr.wr_id,
                wr.signaled,
                region,
                keep,
            )
        }?;
        drop(flow);
        if !was_busy {
            self.sh.watch_sends();
        }
        self.sh.posted(wr.signaled);
        Ok(())
    }

    /// Posts a checked receive.
    fn recv(&self, wr: RecvRequest<'_>) -> Result<()> {
        let wr = RecvWr {
            wr_id: wr.wr_id,
            mr: wr.mr.clone(),
            offset: wr.offset,
            len: wr.len,
        };
        let mut flow = self.sh.lock();
        flow.post_recv(wr, &self.sh.report)?;
        self.sh.after_taking(flow);
        Ok(())
    }

    /// Opens the shared receive queue to the connection's messages (one that came first waits
    /// in the ring and is taken now).
    fn connected(&self) {
        let mut flow = self.sh.lock();
        if flow.open_pool(&self.sh.report) {
            self.sh.after_taking(flow);
        }
    }

    /// Lets the peer reach `mr` with one-sided operations; returns its key (see
    /// `onesided/`: the offer is in the peer's socket when this returns).
    fn expose(&self, mr: &Arc<MemoryRegion>) -> Result<u64> {
        // Caller memory needs the peer to reach this process; it says whether it can as its
        // side starts, which may be just after ours (asked before taking the lock).
        let reaches = mr.memfd().is_none() && self.sh.exports.peer_reaches_us();
        // The flow's lock keeps the socket open while the offer goes out.
        let flow = self.sh.lock();
        flow.check_open()?;
        self.sh.exports.expose(flow.sock(), mr, reaches)
    }

    /// Posts a checked one-sided operation. It runs now, on this thread, with no system call
    /// when the peer's region is mapped here. An unsignaled write, read or atomic (the common
    /// case of a stream of small writes) takes the lock-free path when it can; everything
    /// else, and whatever that path declines, runs under the flow's lock - so that it cannot
    /// complete after the connection's disconnect record - and a write with immediate data then
    /// queues its record like a send.
    fn rdma(&self, wr: &RdmaRequest<'_>) -> Result<()> {
        if !wr.signaled
            && !matches!(wr.op, RdmaOp::Write { imm: Some(_) })
            && self.unlocked_rdma(wr)
        {
            return Ok(());
        }
        self.locked_rdma(wr)
    }

    /// Over shared memory the short way is [`write_direct`](Self::write_direct)'s: the rest of the
    /// checked one-segment operations go through [`Conn::rdma`], not checked again.
    ///
    /// # Safety
    /// None needed; the signature is the seam's.
    unsafe fn rdma_single(&self, one: &OneOp<'_>) -> Result<()> {
        self.rdma(&one.request())
    }

    fn writes_directly(&self) -> bool {
        true
    }

    /// The lock-free path of the common small write: one local segment, unsignaled, no
    /// immediate. Done here with no lock when the connection is up and its send queue has room
    /// (as for `unlocked_rdma`) and the peer's region is the one published on the connection's
    /// shortcut (`onesided/shortcut.rs`).
    #[inline]
    unsafe fn write_direct(&self, src: *const u8, len: usize, key: u64, remote_addr: u64) -> bool {
        // SAFETY: the caller's contract.
        self.sendable() && unsafe { self.sh.shortcut.write(key, src, len, remote_addr) }
    }

    fn disconnect(&self) {
        self.sh.wake.stop();
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.disconnect();
        // The teardown is local work that never waits for the peer, and the driver runs it at
        // once after `disconnect`, so this wait is bounded. When it returns the disconnect has
        // been reported and the socket closed.
        self.sh.wake.wait_finished();
    }
}
