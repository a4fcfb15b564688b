//! One device CQ per (completion queue, device, context), shared by the queue pairs of every
//! connection of that queue on that device: an empty poll of the queue costs one
//! `ibv_poll_cq`, however many connections it serves.
//!
//! Each work completion is dispatched (`dispatch.rs`) by its queue-pair number to its
//! connection's ledger (`conn.rs`), under that connection's lock, so the per-connection order and semantics hold
//! (flushes, unsignaled sends completed by a later signaled one, credits and hello, failed-state
//! detection). A connection is a member from the creation of its queue pair until its teardown
//! has drained its flushes (or given up after the flush deadline); a completion of an unknown
//! queue pair is ignored. Queue-pair numbers are reused by devices, so a stale completion of a
//! destroyed queue pair could carry the number of a new one: every work-request id also
//! carries its connection's 16-bit tag (see `conn::TAG_SHIFT`), given out in turn by this CQ,
//! and a completion whose tag is not its member's is ignored. Mis-routing would take a stale
//! completion left unpolled while 65,536 more connections were made on this CQ and the last
//! of them got the same queue-pair number.
//!
//! Lock order: the poll lock (`DevCq::poll`), then a connection's state lock; posters take only
//! the latter. Callers' polls may wait for locks; the driver's turns only try them: a
//! completion whose connection's lock is held is parked, in order, and delivered before any
//! later one of that connection.
//!
//! The completion channel and its notification belong to this CQ. Its driver turn takes the
//! channel's events and moves completions into the queue - always with [`Progress::Thread`],
//! and with [`Progress::Caller`] while a thread sleeps in the queue's `wait` - re-arming,
//! then polling once more, so no completion is missed. With [`Progress::Caller`] and the
//! queue's descriptor handed out, the queue's pollers take the channel instead: it joins the
//! descriptor's epoll set, the driver stops listening to it, and the poll that finds the queue
//! empty takes its events, asks for the next one and polls once more (as a program around
//! `ibv_req_notify_cq` would, see [`Source::arm_descriptor`]): a completion that comes while the
//! program polls, or wakes it, never crosses the library's thread.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rdma_sys as sys;

use crate::conn::next_conn_id;
use crate::cq::{CompletionQueue, Progress, Sink, Source};
use crate::driver::{Driver, Handler, Next, Ready, Registration};
use crate::error::{Error, Result};
use crate::idmap::IdMap;
use crate::verbs::cm::set_nonblocking;
use crate::verbs::conn::{ConnState, Join, PostState, TAG_SHIFT, try_lock};
use crate::verbs::dispatch::{Channel, Member, PollState, Wc, complete, deliver, unpark};

/// Smallest device CQ made: room for a few connections before the first resize.
const MIN_CQE: u32 = 1024;
/// Most completions one driver turn moves before it lets the others run.
const TURN_BUDGET: usize = 4096;
/// CQ events taken before they are acknowledged in one call.
const ACK_EVERY: u32 = 64;

/// A device CQ shared by the connections of one completion queue on one device.
pub(crate) struct DevCq {
    /// Its key among the completion queue's sources (unique among connection ids).
    key: u64,
    cq: Arc<CompletionQueue>,
    device: *mut sys::ibv_context,
    pub(super) raw: *mut sys::ibv_cq,
    /// The completion channel (owned by the CQ's turns, see [`Owner`]) and its descriptor.
    comp: *mut sys::ibv_comp_channel,
    comp_fd: RawFd,
    caller_polls: bool,
    max_cqe: u32,
    /// Whether the device will announce the next completion on the completion channel.
    notify_armed: AtomicBool,
    /// The queue's pollers take the channel's events (the driver does not listen): they sleep
    /// on the queue's descriptor, which holds the channel's. Changed under the poll lock.
    pollers_channel: AtomicBool,
    /// How many members have sends held for credits (pollers then start those whose credits
    /// arrived).
    held: Arc<AtomicUsize>,
    poll: parking_lot::Mutex<PollState>,
    /// The CQ's own driver turns (completion events, and its end).
    reg: Registration,
}

// SAFETY: the raw CQ is polled, armed and resized, and its channel read by the pollers, only
// under the poll lock while not retired (or by its own driver turn, which owns and destroys
// them); libibverbs calls on them are thread-safe. The device context lives as long as the
// process (librdmacm keeps it open).
unsafe impl Send for DevCq {}
// SAFETY: as above.
unsafe impl Sync for DevCq {}

fn too_big(need: u32, max: u32) -> Error {
    Error::CompletionQueue(io::Error::other(format!(
        "a device CQ of {need} entries is needed (a connection takes its send and receive \
         depths plus {} library slots), but the device allows {max}: use smaller queue depths",
        crate::verbs::credit::INTERNAL_SLOTS + 1
    )))
}

/// A context's device CQs (held by their connections; found here by queue and device).
#[derive(Default)]
pub(crate) struct Table(Mutex<Vec<Weak<DevCq>>>);

/// The device CQ of `cq` on `device` in a context's `table`, made (its turns on `driver`) or
/// grown for one more connection that needs `need` entries.
pub(super) fn attach(
    table: &Table,
    driver: &Driver,
    cq: &Arc<CompletionQueue>,
    device: *mut sys::ibv_context,
    need: u32,
) -> Result<Attachment> {
    let mut table = table.0.lock().unwrap_or_else(|p| p.into_inner());
    table.retain(|w| w.strong_count() > 0);
    for d in table.iter().filter_map(Weak::upgrade) {
        if d.device != device || !Arc::ptr_eq(&d.cq, cq) {
            continue;
        }
        let mut ps = d.lock();
        // A full device CQ (at the device's largest size) leaves the connection to the next
        // one of the queue, or to a new one: the queue takes any number of connections.
        if ps.retired || ps.need.saturating_add(need) > d.max_cqe {
            continue;
        }
        let tag = d.reserve(&mut ps, need)?;
        drop(ps);
        return Ok(Attachment {
            devcq: d,
            need,
            tag,
            qp_num: None,
            released: false,
            pool: None,
        });
    }
    let d = DevCq::create(driver, cq, device, need)?;
    table.push(Arc::downgrade(&d));
    Ok(Attachment {
        devcq: d,
        need,
        tag: 0,
        qp_num: None,
        released: false,
        pool: None,
    })
}

/// Owns the device CQ and its completion channel: destroyed when the CQ's driver turns end
/// (after the driver took the channel out of its set, and after the last user left).
struct Owner {
    raw: *mut sys::ibv_cq,
    comp: *mut sys::ibv_comp_channel,
    /// CQ events taken and not yet acknowledged.
    unacked: u32,
}

// SAFETY: moved to the driver's thread whole, and used only there.
unsafe impl Send for Owner {}

impl Owner {
    fn ack(&mut self) {
        ack_events(self.raw, &mut self.unacked);
    }
}

/// Acknowledges the `unacked` events taken from `cq`'s channel (all of them before the CQ
/// goes), if there is a CQ (NULL: its making failed).
fn ack_events(cq: *mut sys::ibv_cq, unacked: &mut u32) {
    if *unacked > 0 && !cq.is_null() {
        // SAFETY: a live CQ (its owner or the poll lock keeps it); acknowledges exactly the
        // events taken from its channel.
        unsafe { sys::ibv_ack_cq_events(cq, *unacked) };
        *unacked = 0;
    }
}

/// Takes one event from the non-blocking channel `comp` of `cq`, counting it in `unacked`
/// (acknowledged every [`ACK_EVERY`]): false when none waits.
///
/// # Safety
/// `comp` and `cq` are live, and `unacked` is this reader's count for them.
unsafe fn take_event(
    comp: *mut sys::ibv_comp_channel,
    cq: *mut sys::ibv_cq,
    unacked: &mut u32,
) -> bool {
    let mut ev_cq = std::ptr::null_mut();
    let mut ctx = std::ptr::null_mut();
    // SAFETY: live non-blocking channel (the caller's contract); fails with EAGAIN when empty.
    if unsafe { sys::ibv_get_cq_event(comp, &mut ev_cq, &mut ctx) } != 0 {
        return false;
    }
    *unacked += 1;
    if *unacked >= ACK_EVERY {
        ack_events(cq, unacked);
    }
    true
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.ack();
        if !self.raw.is_null() {
            // SAFETY: every event was acknowledged just above; every queue pair that used it
            // is destroyed (its last user left), and nobody polls it any more (retired).
            unsafe { sys::ibv_destroy_cq(self.raw) };
        }
        // SAFETY: the CQ that used the channel is gone; destroyed once.
        unsafe { sys::ibv_destroy_comp_channel(self.comp) };
    }
}

impl DevCq {
    fn create(
        driver: &Driver,
        cq: &Arc<CompletionQueue>,
        device: *mut sys::ibv_context,
        need: u32,
    ) -> Result<Arc<DevCq>> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid start.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live device context; `attr` is written on success. Returns the errno value.
        let r = unsafe { sys::ibv_query_device(device, &mut attr) };
        if r != 0 {
            return Err(Error::CompletionQueue(io::Error::from_raw_os_error(r)));
        }
        let max_cqe = attr.max_cqe.max(1) as u32;
        if need > max_cqe {
            return Err(too_big(need, max_cqe));
        }
        // SAFETY: live device context; NULL with errno on failure.
        let comp = unsafe { sys::ibv_create_comp_channel(device) };
        if comp.is_null() {
            return Err(Error::CompletionQueue(io::Error::last_os_error()));
        }
        let mut owner = Owner {
            raw: std::ptr::null_mut(),
            comp,
            unacked: 0,
        };
        // SAFETY: the channel is live.
        let comp_fd = unsafe { (*comp).fd };
        set_nonblocking(comp_fd)?;
        let size = need.max(MIN_CQE).min(max_cqe);
        // SAFETY: live device and channel; NULL with errno on failure.
        let raw = unsafe { sys::ibv_create_cq(device, size as i32, std::ptr::null_mut(), comp, 0) };
        if raw.is_null() {
            return Err(Error::CompletionQueue(io::Error::last_os_error()));
        }
        owner.raw = raw;
        let d = Arc::new(DevCq {
            key: next_conn_id(),
            cq: cq.clone(),
            device,
            raw,
            comp,
            comp_fd,
            caller_polls: cq.options().progress == Progress::Caller,
            max_cqe,
            notify_armed: AtomicBool::new(false),
            pollers_channel: AtomicBool::new(false),
            held: Arc::new(AtomicUsize::new(0)),
            poll: parking_lot::Mutex::new(PollState {
                members: IdMap::default(),
                parked: 0,
                users: 1,
                // SAFETY: live CQ; `cqe` is what the device granted (at least the size asked).
                size: unsafe { (*raw).cqe }.max(0) as u32,
                need,
                next_tag: 1,
                pools: Vec::new(),
                retired: false,
                channel: Channel::default(),
            }),
            reg: driver.registration(),
        });
        // The first completion is announced (the driver then decides whether to go on).
        d.arm_notify();
        let turns = CqTurns {
            d: d.clone(),
            owner,
            pending: true,
        };
        driver
            .register(&d.reg, &[comp_fd], Box::new(turns))
            .map_err(Error::Thread)?;
        if d.caller_polls {
            cq.add_source(d.clone());
        }
        Ok(d)
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, PollState> {
        self.poll.lock()
    }

    /// Makes room for one more connection needing `need` entries; returns its tag.
    fn reserve(&self, ps: &mut PollState, need: u32) -> Result<u64> {
        self.grow(ps, need)?;
        ps.users += 1;
        let tag = ps.next_tag;
        // The last tag is never given out: a pool's receives carry it (`srq.rs`).
        ps.next_tag = match ps.next_tag.wrapping_add(1) {
            u16::MAX => 0,
            t => t,
        };
        Ok(u64::from(tag) << TAG_SHIFT)
    }

    /// Makes room for `more` entries.
    fn grow(&self, ps: &mut PollState, more: u32) -> Result<()> {
        let total = ps.need.saturating_add(more);
        if total > self.max_cqe {
            return Err(too_big(total, self.max_cqe));
        }
        if total > ps.size {
            let size = ps.size.saturating_mul(2).max(total).min(self.max_cqe);
            // SAFETY: live CQ (not retired, under the poll lock: nobody polls it meanwhile).
            // Returns the errno value.
            let r = unsafe { sys::ibv_resize_cq(self.raw, size as i32) };
            if r != 0 {
                return Err(Error::CompletionQueue(io::Error::new(
                    io::Error::from_raw_os_error(r).kind(),
                    format!(
                        "growing the device CQ to {size} entries failed: {}",
                        io::Error::from_raw_os_error(r)
                    ),
                )));
            }
            // SAFETY: live CQ; `cqe` is its size now.
            ps.size = unsafe { (*self.raw).cqe }.max(0) as u32;
        }
        ps.need = total;
        Ok(())
    }

    /// Asks the device for an event on the next completion, unless that is already asked:
    /// at most one request is out, and so at most one event waits on the channel. The caller
    /// holds the poll lock (not retired) or is the CQ's own turn.
    fn arm_notify(&self) {
        if !self.notify_armed.swap(true, Ordering::SeqCst) {
            // SAFETY: live CQ (see above).
            unsafe { sys::ibv_req_notify_cq(self.raw, 0) };
        }
    }

    /// The count of members with sends held, which each member keeps up to date
    /// (`ConnState::note_held`).
    pub(super) fn held_conns(&self) -> Arc<AtomicUsize> {
        self.held.clone()
    }

    /// From a driver turn: moves what the device has into the queue, if the poll lock is free
    /// at once (else a poller is doing just that).
    pub(super) fn drain_now(&self) {
        if let Some(mut ps) = try_lock(&self.poll)
            && !ps.retired
        {
            let cq = &self.cq;
            self.drain(&mut ps, TURN_BUDGET, false, &mut Sink::queue(cq));
        }
    }

    /// From a driver turn: asks for an event on the next completion (a closing connection
    /// waits for its flushes).
    pub(super) fn arm_now(&self) {
        if let Some(ps) = try_lock(&self.poll)
            && !ps.retired
        {
            self.arm_notify();
        }
    }

    /// Polls the device for about `max` records and delivers them (parked ones first).
    /// `blocking`: a caller's poll, which may wait for connections' locks; else a driver turn,
    /// which parks what it cannot deliver at once. Returns how many records it emitted.
    #[inline(always)]
    fn drain(&self, ps: &mut PollState, max: usize, blocking: bool, out: &mut Sink<'_>) -> usize {
        const BATCH: usize = 32;
        let mut n = 0;
        if ps.parked > 0 {
            n += unpark(ps, blocking, out);
        }
        let mut wcs = std::mem::MaybeUninit::<[sys::ibv_wc; BATCH]>::uninit();
        while n < max {
            let want = (max - n).min(BATCH) as i32;
            // SAFETY: live CQ (the poll lock is held and it is not retired); `wcs` has room
            // for BATCH >= want entries.
            let got = unsafe { sys::ibv_poll_cq(self.raw, want, wcs.as_mut_ptr().cast()) };
            if got <= 0 {
                break;
            }
            ps.channel.polled = true;
            for i in 0..got as usize {
                // SAFETY: ibv_poll_cq filled the first `got` entries.
                let wc = Wc::new(unsafe { &*wcs.as_ptr().cast::<sys::ibv_wc>().add(i) });
                n += deliver(ps, wc, blocking, out);
            }
            if got < want {
                break;
            }
        }
        n
    }

    /// A closing connection's last look: delivers what the device has (and what of its own is
    /// parked), takes it off the CQ, and runs `flush` under its lock, so that nothing of it is
    /// delivered afterwards. `false` when a lock was not free at once (try again later).
    pub(super) fn leave(
        &self,
        sh: &ConnState,
        qp_num: u32,
        flush: impl FnOnce(&mut PostState),
    ) -> bool {
        let Some(mut ps) = try_lock(&self.poll) else {
            return false;
        };
        let cq = &self.cq;
        if !ps.retired {
            self.drain(&mut ps, usize::MAX, false, &mut Sink::queue(cq));
        }
        let Some(mut st) = try_lock(&sh.state) else {
            return false;
        };
        if let Some(m) = ps.members.remove(&qp_num) {
            ps.parked -= m.parked.len();
            for wc in &m.parked {
                complete(sh, &mut st, wc, &mut Sink::queue(cq));
            }
        }
        flush(&mut st);
        true
    }

    /// Starts the sends of members whose credits arrived, and tells peers of the messages
    /// taken from their bounce areas (pollers, while members have either).
    fn pump_held(&self, ps: &PollState) {
        for m in ps.members.values() {
            if let Some(sh) = &m.sh
                && sh.has_held.load(Ordering::Relaxed)
            {
                let mut st = sh.lock();
                sh.pump(&mut st);
                sh.push_credits(&mut st);
            }
        }
    }

    /// One user fewer (blocking: `wait`; else only if the lock is free at once: `None` if it
    /// was not). When none is left the CQ retires: it leaves the queue's sources, and its turn
    /// destroys it (see [`gone`](Self::gone)); returns whether it did.
    fn release(
        &self,
        need: u32,
        qp_num: Option<u32>,
        pool: Option<usize>,
        wait: bool,
    ) -> Option<bool> {
        let mut ps = if wait {
            self.lock()
        } else {
            try_lock(&self.poll)?
        };
        if let Some(m) = qp_num.and_then(|q| ps.members.remove(&q)) {
            ps.parked -= m.parked.len();
        }
        ps.users -= 1;
        ps.need -= need;
        if let Some(key) = pool
            && let Some(at) = ps.pools.iter().position(|p| p.0 == key)
        {
            ps.pools[at].2 -= 1;
            if ps.pools[at].2 == 0 {
                ps.need -= ps.pools[at].1;
                ps.pools.swap_remove(at);
            }
        }
        let retire = ps.users == 0;
        if retire {
            ps.retired = true;
            if ps.channel.in_set
                && let Some(q) = self.cq.queue_fd()
            {
                q.unwatch(self.comp_fd);
            }
            ack_events(self.raw, &mut ps.channel.unacked);
        }
        drop(ps);
        if retire {
            if self.caller_polls {
                self.cq.remove_source(self.key);
            }
            self.reg.wake();
        }
        Some(retire)
    }

    /// Hands the channel to the queue's pollers (see [`Source::arm_descriptor`]): into the queue's
    /// descriptor, the driver no longer listening. False when it cannot be (no descriptor
    /// handed out, or a system call failed): the driver goes on taking it.
    fn give_pollers_channel(&self, ch: &mut Channel) -> bool {
        let Some(q) = self.cq.queue_fd() else {
            return false;
        };
        if !ch.in_set {
            if q.watch(self.comp_fd).is_err() {
                return false;
            }
            ch.in_set = true;
        }
        if self.reg.listen(0, self.comp_fd, false).is_err() {
            return false;
        }
        // SeqCst: before the look at the request (see the driver's turn).
        self.pollers_channel.store(true, Ordering::SeqCst);
        // The driver may have left events unread.
        ch.polled = true;
        true
    }

    /// Whether the retired CQ is destroyed (its turn ended).
    pub(super) fn gone(&self) -> bool {
        self.reg.finished()
    }
}

/// With [`Progress::Caller`], the completion queue's pollers take the completions of all the
/// CQ's connections straight from the device: one source, one `ibv_poll_cq` when empty.
impl Source for DevCq {
    fn key(&self) -> u64 {
        self.key
    }

    fn poll(&self, out: &mut Sink<'_>) {
        let mut ps = self.lock();
        if ps.retired {
            return;
        }
        // Relaxed: a hint (see `ConnState::note_held`).
        if self.held.load(Ordering::Relaxed) > 0 {
            self.pump_held(&ps);
        }
        // Under the poll lock nothing of these connections is on its way into the queue
        // from the device, so an empty queue means no older record of theirs waits there.
        // Into the queue, the device gives about as many as the poll asked for.
        let asked = out.asked();
        out.in_order(
            || self.cq.surely_empty(),
            asked,
            #[inline(always)]
            |limit, out| self.drain(&mut ps, limit, true, out),
        );
    }

    fn arm(&self) {
        let ps = self.lock();
        if ps.retired {
            return;
        }
        // A thread sleeps in `wait`: the driver takes the channel's events again.
        if self.pollers_channel.load(Ordering::Relaxed)
            && self.cq.library_moves(true)
            && self.reg.listen(0, self.comp_fd, true).is_ok()
        {
            self.pollers_channel.store(false, Ordering::SeqCst);
        }
        self.arm_notify();
    }

    /// A poller found the queue empty and is about to sleep on the queue's descriptor: takes
    /// the channel's waiting events (so that a level-triggered waiter does not wake for what
    /// was polled already), asks the device for an event on the next completion, and polls
    /// once more, since one may have come before the request. False when that poll moved
    /// something into the queue: the poller polls again.
    fn arm_descriptor(&self) -> bool {
        let mut ps = self.lock();
        if ps.retired || self.cq.library_moves(true) {
            return true;
        }
        if !self.pollers_channel.load(Ordering::Relaxed)
            && !self.give_pollers_channel(&mut ps.channel)
        {
            // The driver takes the events and moves what they announce into the queue.
            self.arm_notify();
            return true;
        }
        let armed = self.notify_armed.load(Ordering::SeqCst);
        // Armed, and nothing polled since: no event can be waiting, and the next completion
        // makes one. The usual case for a poller that polls on after finding nothing.
        if armed && !ps.channel.polled {
            return true;
        }
        // One read: a request brings at most one event, and only one is asked for at a time
        // (`notify_armed`).
        // SAFETY: live CQ and channel (not retired, under the poll lock); the pollers' count.
        if unsafe { take_event(self.comp, self.raw, &mut ps.channel.unacked) } {
            // The event consumed the request.
            self.notify_armed.store(false, Ordering::SeqCst);
        }
        ps.channel.polled = false;
        self.arm_notify();
        let cq = &self.cq;
        self.drain(&mut ps, TURN_BUDGET, true, &mut Sink::queue(cq)) == 0
    }
}

/// A connection's share of a device CQ: from before its queue pair is made until after it is
/// destroyed. Dropping it without [`try_release`](Self::try_release) releases it, waiting for
/// the poll lock.
pub(super) struct Attachment {
    pub(super) devcq: Arc<DevCq>,
    need: u32,
    /// The connection's tag, shifted into place (see `conn::TAG_SHIFT`).
    pub(super) tag: u64,
    qp_num: Option<u32>,
    released: bool,
    /// The shared receive queue whose completions the CQ makes room for, once for all its
    /// connections on it (see [`uses_pool`](Self::uses_pool)).
    pool: Option<usize>,
}

impl Attachment {
    /// The connection's queue pair takes its receives from the shared receive queue `key` of
    /// `depth` receives: the CQ makes room for all of them once, for every connection of the
    /// pool it serves, since they may all complete before a poll.
    pub(super) fn uses_pool(&mut self, key: usize, depth: u32) -> Result<()> {
        let mut ps = self.devcq.lock();
        if let Some(p) = ps.pools.iter_mut().find(|p| p.0 == key) {
            p.2 += 1;
        } else {
            self.devcq.grow(&mut ps, depth)?;
            ps.pools.push((key, depth, 1));
        }
        self.pool = Some(key);
        Ok(())
    }

    /// The queue pair was made: its completions are collected (parked) from now on.
    pub(super) fn enter(&mut self, qp_num: u32) {
        let mut ps = self.devcq.lock();
        ps.members.insert(
            qp_num,
            Member {
                tag: self.tag,
                sh: None,
                parked: VecDeque::new(),
            },
        );
        self.qp_num = Some(qp_num);
    }

    /// What hands the queue pair's completions to its connection once it is up.
    pub(super) fn joiner(&self) -> Box<dyn Join> {
        Box::new(Joiner {
            devcq: self.devcq.clone(),
            qp_num: self.qp_num,
        })
    }

    pub(super) fn qp_num(&self) -> Option<u32> {
        self.qp_num
    }

    /// Gives the share back once the queue pair is destroyed, if the poll lock is free at
    /// once (`None`: try again later). Returns whether that retired the device CQ.
    pub(super) fn try_release(&mut self) -> Option<bool> {
        let retired = self
            .devcq
            .release(self.need, self.qp_num, self.pool, false)?;
        self.released = true;
        Some(retired)
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if !self.released {
            self.devcq.release(self.need, self.qp_num, self.pool, true);
        }
    }
}

/// Hands a queue pair's completions to its connection (see [`Join`]).
struct Joiner {
    devcq: Arc<DevCq>,
    qp_num: Option<u32>,
}

impl Join for Joiner {
    /// The connection is up: its completions go to `sh`, those parked until now first.
    fn join(&self, sh: &Arc<ConnState>) {
        let mut ps = self.devcq.lock();
        let PollState {
            members, parked, ..
        } = &mut *ps;
        let Some(m) = self.qp_num.and_then(|q| members.get_mut(&q)) else {
            return;
        };
        m.sh = Some(sh.clone());
        let mut st = sh.lock();
        let cq = &self.devcq.cq;
        while let Some(p) = m.parked.pop_front() {
            *parked -= 1;
            complete(sh, &mut st, &p, &mut Sink::queue(cq));
        }
        if st.credits.is_some() {
            sh.push_credits(&mut st);
        }
    }
}

/// The device CQ's driver turns: its completion events, and its end.
struct CqTurns {
    d: Arc<DevCq>,
    owner: Owner,
    /// Events came (or the CQ is new): the device may hold completions nobody moved yet.
    pending: bool,
}

impl Handler for CqTurns {
    fn run(&mut self, ready: &Ready) -> Next {
        let d = &self.d;
        // Not under the poll lock, which busy pollers take all the time: the event is read
        // at once, so the channel does not keep the driver awake meanwhile.
        if ready.fd(0) {
            let Owner { raw, comp, unacked } = &mut self.owner;
            let mut took = false;
            // SAFETY: the turn owns the live CQ and channel; the driver's count.
            while unsafe { take_event(*comp, *raw, unacked) } {
                took = true;
            }
            if took {
                // The event consumed the request.
                d.notify_armed.store(false, Ordering::SeqCst);
                self.pending = true;
                // The pollers took the channel over meanwhile: one of them may have seen the
                // request still out and gone to sleep without asking again. Wake them to ask.
                // (SeqCst, after the store above: pairs with their taking the channel before
                // they look at the request.)
                if d.pollers_channel.load(Ordering::SeqCst) {
                    d.cq.ring_bell();
                }
            }
        }
        let Some(mut ps) = try_lock(&d.poll) else {
            // A poller holds it (and moves the completions meanwhile).
            return self.busy();
        };
        if ps.retired {
            return Next::Done;
        }
        if self.pending || ps.parked > 0 {
            let cq = &d.cq;
            loop {
                if d.drain(&mut ps, TURN_BUDGET, false, &mut Sink::queue(cq)) >= TURN_BUDGET {
                    return Next::Again;
                }
                // With progress threads, or while somebody sleeps on the queue, the device must
                // announce the next completion: ask, then look once more, so that nothing that
                // came in between is missed.
                if (!d.caller_polls || cq.library_moves(true))
                    && !d.notify_armed.load(Ordering::SeqCst)
                {
                    d.arm_notify();
                    continue;
                }
                break;
            }
            self.pending = false;
        }
        if ps.parked > 0 {
            self.busy()
        } else {
            Next::Wait(None)
        }
    }
}

impl CqTurns {
    /// What a turn that found a thread of the program in its way (holding the poll lock, or a
    /// connection's lock so that completions stayed parked) does next. With caller progress
    /// and nobody asleep in the queue's `wait`, nothing: the program's next poll takes
    /// what the device has and delivers the parked completions first, and a thread that
    /// goes to sleep arms the device and polls once more itself. Otherwise the turn must
    /// finish the work (queue what came, re-arm the device for the sleeper): it comes back
    /// soon, letting the holder run meanwhile.
    fn busy(&self) -> Next {
        if self.d.caller_polls && !self.d.cq.library_moves(true) {
            Next::Wait(None)
        } else {
            Next::Yield
        }
    }
}
