//! The verbs transport: the RDMA CM connection flow on RC queue pairs, posting, and a thread
//! per connection for its connection events, keepalives and teardown. Completions are taken
//! from the device CQ by the completion queue's pollers ([`Progress::Caller`], the default) or
//! by that thread, which then sleeps on the completion channel ([`Progress::Thread`]).
//!
//! Server: event channel -> id (RDMA_PS_TCP) -> bind -> listen -> CONNECT_REQUEST (the new id
//! moves to a channel of its own) -> PD / completion channel / CQ / QP -> accept -> ESTABLISHED.
//! Client: event channel -> id -> resolve address -> resolve route -> PD / channel / CQ / QP ->
//! connect -> ESTABLISHED. Each failure event maps to its own error.
//!
//! Library peers recognise each other by an 8-byte preamble in the private data (magic,
//! version, flags, length of the caller's data); a peer without it is a plain librdmacm
//! program and gets plain RC semantics, its private data passed through untouched
//! (`preamble.rs`).

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_sys as sys;
use sys::rdma_cm_event_type::*;

use crate::conn::{
    ConnInfo, ConnOptions, Payload, RecvRequest, SendFlags, SendRequest, Transport, next_conn_id,
};
use crate::cq::{Completion, CompletionQueue, Opcode, Progress, Reporter, Source, WcStatus};
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::sys::EventFd;
use crate::verbs::cm::{CmEvent, CmId, EventChannel, set_nonblocking, sockaddr};
use crate::verbs::credit::{
    CREDIT_WRITES_MAX, CreditMr, Credits, FLAG_CREDITS, HELLO_LEN, Held, INTERNAL_SLOTS, Remote,
    SIGNAL_EVERY,
};
use crate::verbs::preamble::{parse_credit_ext, parse_preamble, with_preamble};
use crate::verbs::res::{CompChannel, Cq, DeviceEvents, Pd, device_events};

/// `rdma_set_option` level and name for the ACK timeout (rdma_cma.h; not in the bindings).
const RDMA_OPTION_ID: i32 = 0;
const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;
/// rdma_cm's reject reason when nobody listens on the port (IB_CM_REJ_INVALID_SERVICE_ID).
const REJ_NO_LISTENER: i32 = 8;
const RECV_BIT: u64 = 1 << 63;
/// The work-request id of a server's internal receive for the client's hello.
const HELLO_WR_ID: u64 = RECV_BIT | (1 << 62);
/// How long the connection's thread first sleeps while sends wait for credits (or a credit
/// write is owed), doubling up to [`CREDIT_POLL_MAX`].
const CREDIT_POLL_MIN: Duration = Duration::from_micros(50);
const CREDIT_POLL_MAX: Duration = Duration::from_millis(4);
/// How long teardown waits for the device to flush outstanding work before reporting the
/// rest as flushed itself.
const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// How often the engine looks at the connection when nothing else wakes it (port state, and the
/// device CQ with progress on the caller's thread), at the least.
const TICK: Duration = Duration::from_secs(1);

fn cm_err(what: &'static str) -> impl Fn(io::Error) -> Error {
    move |e| Error::Connect(io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// Maps a failure event during establishment to its error.
fn event_error(ev: &CmEvent, target: &str) -> Error {
    let errno = -ev.status;
    let unreachable = [
        libc::ENETUNREACH,
        libc::EHOSTUNREACH,
        libc::ENODEV,
        libc::EADDRNOTAVAIL,
    ]
    .contains(&errno);
    match ev.kind {
        RDMA_CM_EVENT_ADDR_ERROR if unreachable || errno == libc::ETIMEDOUT => {
            Error::Unreachable(format!(
                "{target}: address resolution failed ({})",
                io::Error::from_raw_os_error(errno)
            ))
        }
        RDMA_CM_EVENT_ADDR_ERROR => Error::Address {
            addr: target.to_owned(),
            reason: format!(
                "address resolution failed ({})",
                io::Error::from_raw_os_error(errno)
            ),
        },
        RDMA_CM_EVENT_ROUTE_ERROR => {
            Error::Route(format!("{target}: {}", io::Error::from_raw_os_error(errno)))
        }
        RDMA_CM_EVENT_UNREACHABLE => Error::Unreachable(format!(
            "{target}: the peer did not answer (status {})",
            ev.status
        )),
        RDMA_CM_EVENT_REJECTED if ev.status == REJ_NO_LISTENER => Error::Refused(target.to_owned()),
        RDMA_CM_EVENT_REJECTED => Error::Rejected(parse_preamble(&ev.private_data).1),
        RDMA_CM_EVENT_DEVICE_REMOVAL => Error::DeviceRemoved,
        _ => Error::ConnectFailed(format!("{target}: {} (status {})", ev.name(), ev.status)),
    }
}

/// Waits for the next event on `ch`, which must be `want`; anything else is an error.
fn expect_event(
    ch: &EventChannel,
    want: u32,
    deadline: Option<Instant>,
    doing: &'static str,
    target: &str,
) -> Result<CmEvent> {
    match ch.get_event(deadline)? {
        None => Err(Error::Timeout(doing)),
        Some(ev) if ev.kind == want => Ok(ev),
        Some(ev) => Err(event_error(&ev, target)),
    }
}

fn timeout_ms(deadline: Option<Instant>) -> i32 {
    crate::sys::remaining(deadline).map_or(5000, |d| d.as_millis().clamp(1, 60_000) as i32)
}

/// The verbs objects of one connection, destroyed in field order: QP, CQ, completion channel,
/// CM id, event channel.
struct Resources {
    _qp: QpGuard,
    cq: Cq,
    comp: CompChannel,
    id: CmId,
    ch: EventChannel,
    pd: Arc<Pd>,
    caps: sys::ibv_qp_cap,
    /// The device's port events, and the port this connection uses.
    dev: Arc<DeviceEvents>,
    port: u8,
    /// The credit word toward a library peer: after the QP in drop order, since the peer's
    /// device may write into it while the QP lives.
    credit: Option<CreditMr>,
}

/// Destroys the id's QP on drop.
struct QpGuard(*mut sys::rdma_cm_id);

// SAFETY: moves with the Resources that own the id.
unsafe impl Send for QpGuard {}

impl Drop for QpGuard {
    fn drop(&mut self) {
        // SAFETY: the QP was created on this id by rdma_create_qp, and posters are fenced off by
        // the connection's `closed` flag before the resources are dropped.
        unsafe { sys::rdma_destroy_qp(self.0) };
    }
}

impl Resources {
    fn new(
        ctx: &ContextInner,
        id: CmId,
        ch: EventChannel,
        opts: &ConnOptions,
    ) -> Result<Resources> {
        let device = id.verbs();
        if device.is_null() {
            return Err(Error::NoDevice);
        }
        let pd = ctx.verbs.pd(device)?;
        let dev = device_events(device)?;
        // SAFETY: live id, bound to a device port by now.
        let port = unsafe { (*id.0).port_num };
        // SAFETY: live device context; NULL with errno on failure.
        let comp = unsafe { sys::ibv_create_comp_channel(device) };
        if comp.is_null() {
            return Err(Error::CompletionQueue(io::Error::last_os_error()));
        }
        let comp = CompChannel(comp);
        // SAFETY: the channel is live.
        set_nonblocking(unsafe { (*comp.0).fd })?;
        // Room for the internal work: credit writes, keepalive and hello (send side), and the
        // server's hello receive.
        let cq = Cq::new(
            device,
            &comp,
            opts.send_queue_depth + opts.recv_queue_depth + INTERNAL_SLOTS + 1,
        )?;
        // SAFETY: ibv_qp_init_attr is plain data; zero is a valid start.
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.raw;
        attr.recv_cq = cq.raw;
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        // Slots beyond the caller's: the library's own work (keepalive, hello, credit writes)
        // must never take the caller's, nor the server's hello receive.
        attr.cap.max_send_wr = opts.send_queue_depth + INTERNAL_SLOTS;
        attr.cap.max_recv_wr = opts.recv_queue_depth + 1;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.cap.max_inline_data = opts.max_inline;
        // SAFETY: live id, PD and attr; on success the id owns the QP and attr.cap holds the
        // granted capabilities.
        if unsafe { sys::rdma_create_qp(id.0, pd.raw, &mut attr) } != 0 {
            let e = io::Error::last_os_error();
            return Err(Error::invalid(format!(
                "the device refused the queue pair (depths {}/{}, inline {}): {e}",
                opts.send_queue_depth, opts.recv_queue_depth, opts.max_inline
            )));
        }
        // SAFETY: the CQ is live; arms the first notification.
        unsafe { sys::ibv_req_notify_cq(cq.raw, 0) };
        Ok(Resources {
            _qp: QpGuard(id.0),
            cq,
            comp,
            caps: attr.cap,
            pd,
            dev,
            port,
            id,
            ch,
            credit: None,
        })
    }

    /// Posts the server's internal receive for the client's hello into `credit`'s block.
    fn post_hello_recv(&self, credit: &CreditMr) -> Result<()> {
        let mut sge = sys::ibv_sge {
            addr: credit.hello_addr(),
            length: HELLO_LEN as u32,
            lkey: credit.lkey(),
        };
        let mut wr = sys::ibv_recv_wr {
            wr_id: HELLO_WR_ID,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the id owns a live QP; the work request and SGE are live locals; the block
        // is registered and outlives the QP (`credit` field order, then the shared state).
        let r = unsafe { sys::ibv_post_recv((*self.id.0).qp, &mut wr, &mut bad) };
        if r != 0 {
            return Err(post_error(r, "receive"));
        }
        Ok(())
    }

    /// Sets the local ACK timeout the queue pair gets when it becomes ready to send: without
    /// it some devices (soft-RoCE among them) wait for a lost peer's acknowledgement forever.
    fn set_ack_timeout(&self, opts: &ConnOptions) -> Result<()> {
        let t: u8 = opts.ack_timeout;
        // SAFETY: live id; the option value is one readable byte.
        let r = unsafe {
            sys::rdma_set_option(
                self.id.0,
                RDMA_OPTION_ID,
                RDMA_OPTION_ID_ACK_TIMEOUT,
                (&raw const t).cast_mut().cast(),
                1,
            )
        };
        if r != 0 {
            return Err(cm_err("rdma_set_option(ACK_TIMEOUT)")(
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    fn conn_param(&self, data: &[u8], opts: &ConnOptions) -> sys::rdma_conn_param {
        // SAFETY: rdma_conn_param is plain data; zero is a valid start.
        let mut p: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = data.as_ptr().cast();
        p.private_data_len = data.len() as u8;
        p.responder_resources = 1;
        p.initiator_depth = 1;
        p.retry_count = opts.retry_count;
        // 7 = retry forever while the peer has no receive posted: a send waits, never fails.
        p.rnr_retry_count = opts.rnr_retry_count;
        p
    }
}

/// A listening verbs endpoint.
pub(crate) struct Listener {
    id: CmId,
    ch: EventChannel,
    ctx: Arc<ContextInner>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("verbs::Listener")
    }
}

impl Listener {
    pub(crate) fn bind(
        ctx: Arc<ContextInner>,
        host: &str,
        port: u16,
        backlog: u32,
    ) -> Result<Listener> {
        let ch = EventChannel::new()?;
        let id = CmId::new(&ch)?;
        let (mut sa, _) = sockaddr(host, port)?;
        // SAFETY: live id; `sa` is a valid sockaddr of its family.
        if unsafe { sys::rdma_bind_addr(id.0, (&raw mut sa).cast()) } != 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EADDRINUSE) => Error::AddrInUse(format!("rdma://{host}:{port}")),
                Some(libc::EADDRNOTAVAIL) | Some(libc::ENODEV) => Error::Address {
                    addr: format!("rdma://{host}:{port}"),
                    reason: format!("no RDMA device has this address ({e})"),
                },
                _ => Error::Listen(e),
            });
        }
        // SAFETY: bound id.
        if unsafe { sys::rdma_listen(id.0, backlog.clamp(1, 1024) as i32) } != 0 {
            return Err(Error::Listen(io::Error::last_os_error()));
        }
        Ok(Listener { id, ch, ctx })
    }

    pub(crate) fn fd(&self) -> i32 {
        self.ch.fd()
    }

    /// Takes the next connection request, waiting until `deadline` (`None` = forever, a past
    /// deadline = do not wait); `Ok(None)` when none came by then. A CONNECT_REQUEST event is
    /// complete when it arrives, so nothing is ever half-taken.
    pub(crate) fn get_request(&self, deadline: Option<Instant>) -> Result<Option<Request>> {
        loop {
            let Some(ev) = self.ch.get_event(deadline)? else {
                return Ok(None);
            };
            match ev.kind {
                RDMA_CM_EVENT_CONNECT_REQUEST => {
                    let id = CmId(ev.id);
                    let ch = EventChannel::new()?;
                    id.migrate(&ch)?;
                    let (library_peer, private_data) = parse_preamble(&ev.private_data);
                    return Ok(Some(Request {
                        id: Some(id),
                        ch: Some(ch),
                        library_peer,
                        private_data,
                        ctx: self.ctx.clone(),
                    }));
                }
                RDMA_CM_EVENT_DEVICE_REMOVAL if ev.id == self.id.0 => {
                    return Err(Error::DeviceRemoved);
                }
                // Events of requests not yet moved to their own channel: nothing to do.
                _ => {}
            }
        }
    }
}

/// A pending connection request.
pub(crate) struct Request {
    id: Option<CmId>,
    ch: Option<EventChannel>,
    library_peer: bool,
    private_data: Vec<u8>,
    ctx: Arc<ContextInner>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("verbs::Request")
    }
}

impl Request {
    pub(crate) fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    pub(crate) fn accept(mut self, cq: Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Conn> {
        let (id, ch) = (
            self.id.take().expect("unanswered"),
            self.ch.take().expect("unanswered"),
        );
        let mut res = Resources::new(&self.ctx, id, ch, opts)?;
        let data = if self.library_peer {
            // Credits: the client's hello must find a receive, so one is posted before the
            // accept (first in the receive queue); the accept tells the client where this side's
            // credit word is.
            let credit = CreditMr::new(&res.pd)?;
            res.post_hello_recv(&credit)?;
            let ext = credit.encode_remote();
            res.credit = Some(credit);
            with_preamble(&opts.private_data, FLAG_CREDITS, &ext)
        } else {
            opts.private_data.clone()
        };
        res.set_ack_timeout(opts)?;
        let mut param = res.conn_param(&data, opts);
        // SAFETY: live id with its QP; `param` points at `data`, alive for the call.
        if unsafe { sys::rdma_accept(res.id.0, &mut param) } != 0 {
            return Err(Error::Accept(io::Error::last_os_error()));
        }
        let deadline = opts.timeout.map(|t| Instant::now() + t);
        expect_event(
            &res.ch,
            RDMA_CM_EVENT_ESTABLISHED,
            deadline,
            "waiting for the peer to confirm",
            "peer",
        )?;
        let pd = std::mem::take(&mut self.private_data);
        // The server learns the client's word from the hello.
        let credits = res.credit.take().map(|c| (c, None));
        Conn::start(
            self.ctx.clone(),
            cq,
            opts,
            res,
            pd,
            self.library_peer,
            credits,
        )
    }

    pub(crate) fn reject(mut self, private_data: &[u8]) -> Result<()> {
        let id = self.id.take().expect("unanswered");
        let data = if self.library_peer {
            with_preamble(private_data, 0, &[])
        } else {
            private_data.to_vec()
        };
        // SAFETY: live id of an unanswered request; data is readable for its length.
        if unsafe { sys::rdma_reject(id.0, data.as_ptr().cast(), data.len() as u8) } != 0 {
            return Err(Error::Accept(io::Error::last_os_error()));
        }
        Ok(())
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            // SAFETY: live id of an unanswered request.
            unsafe { sys::rdma_reject(id.0, std::ptr::null(), 0) };
        }
    }
}

/// Connects to `host:port`.
pub(crate) fn connect(
    ctx: Arc<ContextInner>,
    host: &str,
    port: u16,
    cq: Arc<CompletionQueue>,
    opts: &ConnOptions,
) -> Result<Conn> {
    let target = format!("rdma://{host}:{port}");
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    let ch = EventChannel::new()?;
    let id = CmId::new(&ch)?;
    let (mut dst, _) = sockaddr(host, port)?;
    // SAFETY: live id; `dst` is a valid sockaddr.
    if unsafe {
        sys::rdma_resolve_addr(
            id.0,
            std::ptr::null_mut(),
            (&raw mut dst).cast(),
            timeout_ms(deadline),
        )
    } != 0
    {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENETUNREACH)
            | Some(libc::EHOSTUNREACH)
            | Some(libc::ENODEV)
            | Some(libc::EADDRNOTAVAIL) => Error::Unreachable(format!("{target}: {e}")),
            _ => cm_err("rdma_resolve_addr")(e),
        });
    }
    expect_event(
        &ch,
        RDMA_CM_EVENT_ADDR_RESOLVED,
        deadline,
        "resolving the address",
        &target,
    )?;
    // SAFETY: live id with a resolved address.
    if unsafe { sys::rdma_resolve_route(id.0, timeout_ms(deadline)) } != 0 {
        return Err(cm_err("rdma_resolve_route")(io::Error::last_os_error()));
    }
    expect_event(
        &ch,
        RDMA_CM_EVENT_ROUTE_RESOLVED,
        deadline,
        "resolving the route",
        &target,
    )?;
    let mut res = Resources::new(&ctx, id, ch, opts)?;
    res.credit = Some(CreditMr::new(&res.pd)?);
    let data = with_preamble(&opts.private_data, FLAG_CREDITS, &[]);
    res.set_ack_timeout(opts)?;
    let mut param = res.conn_param(&data, opts);
    // SAFETY: live id with its QP; `param` points at `data`, alive for the call.
    if unsafe { sys::rdma_connect(res.id.0, &mut param) } != 0 {
        return Err(cm_err("rdma_connect")(io::Error::last_os_error()));
    }
    let ev = expect_event(
        &res.ch,
        RDMA_CM_EVENT_ESTABLISHED,
        deadline,
        "connecting",
        &target,
    )?;
    let (library_peer, peer_data) = parse_preamble(&ev.private_data);
    // Credits only if the server offers its word; otherwise plain RC.
    let credits = match parse_credit_ext(&ev.private_data) {
        Some(peer) => res.credit.take().map(|c| (c, Some(peer))),
        None => None,
    };
    Conn::start(ctx, cq, opts, res, peer_data, library_peer, credits)
}

struct SendEntry {
    seq: u64,
    wr_id: u64,
    signaled: bool,
    /// The library's own (keepalive, hello, credit write): never reported, but its failure
    /// fails the connection.
    internal: bool,
    /// Whether the device reports its completion (an unsignaled one is reaped by a later one).
    hw_signaled: bool,
    _mr: Option<Arc<MemoryRegion>>,
}

struct RecvEntry {
    seq: u64,
    wr_id: u64,
    _mr: Arc<MemoryRegion>,
}

/// What posters and the engine share under one lock: the outstanding work in posting order
/// (sends and receives each complete in order on an RC queue pair), and whether the queue
/// pair may still be posted to.
struct PostState {
    closed: bool,
    /// The first error that failed the queue pair, as whoever polled the device found it.
    failed: Option<WcStatus>,
    next_seq: u64,
    /// Everything handed to the device's send queue, in order.
    sends: VecDeque<SendEntry>,
    recvs: VecDeque<RecvEntry>,
    /// The caller's sends outstanding: on the device or held for credits.
    user_sends: usize,
    /// The library's own work requests on the device, not yet reaped.
    internal_out: u32,
    /// Unsignaled internal work requests posted since the last signaled one.
    unsignaled_run: u32,
    /// Toward a library peer: receive credits, and the sends held for them.
    credits: Option<Credits>,
}

struct Shared {
    info: ConnInfo,
    /// Where this connection's completions go.
    report: Reporter,
    ctx: Arc<ContextInner>,
    pd: Arc<Pd>,
    qp: *mut sys::ibv_qp,
    /// The device CQ: polled under `state`'s lock while `closed` is false (by callers, with
    /// [`Progress::Caller`]) and by the engine thread.
    hw_cq: *mut sys::ibv_cq,
    /// Whether the device will announce the next completion on the completion channel.
    notify_armed: AtomicBool,
    state: Mutex<PostState>,
    stop: AtomicBool,
    wake: EventFd,
    /// How long the connection may be idle before a keepalive goes out: the option, toward a
    /// library peer (negotiated at connect); none toward a plain peer. A keepalive's
    /// acknowledgement, or its failure after `retry_count` resends, is how a peer whose host or
    /// link is gone is noticed on an idle connection.
    keepalive: Option<Duration>,
}

// SAFETY: the QP and CQ pointers are used only under `state`'s lock while `closed` is false, or
// by the engine thread that owns them; libibverbs posting and polling calls are thread-safe.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, PostState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Polls the device CQ for about `max` records and completes the work it reports, in
    /// order, through `emit`. Notes the first error that failed the queue pair in
    /// `st.failed`. Returns how many records it emitted.
    fn take_hw(&self, st: &mut PostState, max: usize, emit: &mut dyn FnMut(Completion)) -> usize {
        const BATCH: usize = 32;
        let mut n = 0;
        let mut wcs = std::mem::MaybeUninit::<[sys::ibv_wc; BATCH]>::uninit();
        while n < max {
            let want = (max - n).min(BATCH) as i32;
            // SAFETY: live CQ (caller holds the lock with `closed` false, or is the engine
            // before teardown destroys it); `wcs` has room for BATCH >= want entries.
            let got = unsafe { sys::ibv_poll_cq(self.hw_cq, want, wcs.as_mut_ptr().cast()) };
            if got <= 0 {
                break;
            }
            for i in 0..got as usize {
                // SAFETY: ibv_poll_cq filled the first `got` entries.
                let wc = unsafe { &*wcs.as_ptr().cast::<sys::ibv_wc>().add(i) };
                let mut status = map_status(wc.status);
                // soft-RoCE (rxe) reports a receive too small for its message as a local QP
                // operation error rather than a length error; on a receive that is what it means.
                if wc.wr_id & RECV_BIT != 0 && wc.status == sys::ibv_wc_status::IBV_WC_LOC_QP_OP_ERR
                {
                    status = WcStatus::LocalLength;
                }
                if status != WcStatus::Success && status != WcStatus::Flushed && st.failed.is_none()
                {
                    st.failed = Some(status);
                }
                n += self.complete(st, wc, status, emit);
            }
            if got < want {
                break;
            }
        }
        if st.credits.is_some() {
            self.push_credits(st);
        }
        n
    }

    /// Completes the work one device completion reports. Returns how many records it emitted.
    fn complete(
        &self,
        st: &mut PostState,
        wc: &sys::ibv_wc,
        status: WcStatus,
        emit: &mut dyn FnMut(Completion),
    ) -> usize {
        let mut n = 0;
        if wc.wr_id == HELLO_WR_ID {
            // The client's hello: where this side's credit writes go from now on.
            if status == WcStatus::Success
                && let Some(c) = st.credits.as_mut()
            {
                c.peer = Some(c.mr.read_hello());
                c.owed = c.posted > c.pushed;
            }
            return 0;
        }
        if wc.wr_id & RECV_BIT != 0 {
            let seq = wc.wr_id & !RECV_BIT;
            while st.recvs.front().is_some_and(|e| e.seq <= seq) {
                let e = st.recvs.pop_front().expect("front exists");
                if let Some(c) = st.credits.as_mut() {
                    c.consumed += 1;
                }
                let (status, len) = if e.seq == seq {
                    // The device's byte count means something only for a success.
                    let len = if status == WcStatus::Success {
                        wc.byte_len
                    } else {
                        0
                    };
                    (status, len)
                } else {
                    (WcStatus::Flushed, 0)
                };
                let imm = (e.seq == seq && wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
                    // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate data.
                    .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
                emit(self.report.record(e.wr_id, Opcode::Recv, status, len, imm));
                n += 1;
            }
        } else {
            let seq = wc.wr_id;
            // Sends complete in order: the unsignaled ones before `seq` finished successfully.
            while st.sends.front().is_some_and(|e| e.seq <= seq) {
                let e = st.sends.pop_front().expect("front exists");
                if e.internal {
                    st.internal_out -= 1;
                } else {
                    st.user_sends -= 1;
                }
                let s = if e.seq == seq {
                    status
                } else {
                    WcStatus::Success
                };
                if !e.internal && (e.signaled || s != WcStatus::Success) {
                    emit(self.report.record(e.wr_id, Opcode::Send, s, 0, None));
                    n += 1;
                }
            }
        }
        n
    }

    /// Asks the device for an event on the next completion, unless that is already asked.
    fn arm_notify(&self) {
        if !self.notify_armed.swap(true, Ordering::SeqCst) {
            // SAFETY: live CQ (the caller holds the lock with `closed` false, or is the engine).
            unsafe { sys::ibv_req_notify_cq(self.hw_cq, 0) };
        }
    }

    /// Hands one of the caller's sends to the device (`st.user_sends` already counts it).
    fn post_user_send(&self, st: &mut PostState, h: Held) -> std::result::Result<(), (i32, Held)> {
        let seq = st.next_seq;
        let mut sge = sys::ibv_sge {
            addr: h.ptr as u64,
            length: h.len,
            lkey: h.lkey,
        };
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = seq;
        wr.sg_list = &mut sge;
        wr.num_sge = if h.len == 0 { 0 } else { 1 };
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND;
        let mut f = 0;
        if h.signaled {
            f |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if h.inline {
            f |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        wr.send_flags = f;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live while `closed` is false (callers check it under the lock); the
        // work request and SGE are live locals; the buffer is valid until the send completes
        // (held by `mr`) or, inline, copied during the call (from the caller's slice or region,
        // which the posting call holds, or from the staging slot that no later send reuses
        // before this one left).
        let r = unsafe { sys::ibv_post_send(self.qp, &mut wr, &mut bad) };
        if r != 0 {
            return Err((r, h));
        }
        st.next_seq += 1;
        st.sends.push_back(SendEntry {
            seq,
            wr_id: h.wr_id,
            signaled: h.signaled,
            internal: false,
            hw_signaled: h.signaled,
            _mr: h.mr,
        });
        Ok(())
    }

    /// Posts one of the library's own send work requests; signals every [`SIGNAL_EVERY`]th
    /// (or when `signal`), so their slots are reaped. Returns the post's error number.
    fn post_internal(
        &self,
        st: &mut PostState,
        wr: &mut sys::ibv_send_wr,
        signal: bool,
    ) -> std::result::Result<(), i32> {
        let seq = st.next_seq;
        let signal = signal || st.unsignaled_run + 1 >= SIGNAL_EVERY;
        wr.wr_id = seq;
        if signal {
            wr.send_flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live while `closed` is false (callers check it under the lock); the
        // work request and its SGE (if any) are live for the call and point into the
        // connection's registered credit block, which outlives the QP.
        let r = unsafe { sys::ibv_post_send(self.qp, wr, &mut bad) };
        if r != 0 {
            return Err(r);
        }
        st.next_seq += 1;
        st.internal_out += 1;
        st.unsignaled_run = if signal { 0 } else { st.unsignaled_run + 1 };
        st.sends.push_back(SendEntry {
            seq,
            wr_id: 0,
            signaled: false,
            internal: true,
            hw_signaled: signal,
            _mr: None,
        });
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
        self.wake.signal();
    }

    /// Starts held sends, in order, for as many as the peer has receives posted.
    fn pump(&self, st: &mut PostState) {
        if st.closed || st.failed.is_some() {
            return;
        }
        loop {
            let Some(c) = st.credits.as_mut() else { return };
            if c.held.is_empty() || !c.available() {
                return;
            }
            let h = c.held.pop_front().expect("not empty");
            match self.post_user_send(st, h) {
                Ok(()) => st.credits.as_mut().expect("credits").sent += 1,
                Err((r, h)) => {
                    st.credits.as_mut().expect("credits").held.push_front(h);
                    self.fail(st, r);
                    return;
                }
            }
        }
    }

    /// Writes this side's count of receives posted into the peer's credit word, if due (see
    /// [`Credits::push_due`]) and possible; otherwise notes it as owed.
    fn push_credits(&self, st: &mut PostState) {
        if st.closed || st.failed.is_some() {
            return;
        }
        let internal_out = st.internal_out;
        let Some(c) = st.credits.as_mut() else { return };
        if !c.push_due() {
            return;
        }
        let Some(peer) = c.peer else {
            c.owed = true;
            return;
        };
        if internal_out >= CREDIT_WRITES_MAX {
            c.owed = true;
            return;
        }
        let count = c.posted;
        // Relaxed: the device reads the word during the post below, whose system call orders
        // it; the value only grows, so a later read still finds a true count.
        c.mr.block().src.store(count, Ordering::Relaxed);
        let mut sge = sys::ibv_sge {
            addr: c.mr.src_addr(),
            length: 8,
            lkey: c.mr.lkey(),
        };
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.wr.rdma.remote_addr = peer.addr;
        wr.wr.rdma.rkey = peer.rkey;
        match self.post_internal(st, &mut wr, false) {
            Ok(()) => {
                let c = st.credits.as_mut().expect("credits");
                c.pushed = count;
                c.owed = false;
            }
            Err(r) => self.fail(st, r),
        }
    }

    /// Whether the connection's thread must look again soon: sends wait for credits, or a
    /// credit write is owed.
    fn credit_busy(st: &PostState) -> bool {
        st.credits
            .as_ref()
            .is_some_and(|c| !c.held.is_empty() || c.owed)
    }
}

/// With [`Progress::Caller`], the completion queue's pollers take this connection's completions
/// straight from the device.
impl Source for Shared {
    fn key(&self) -> u64 {
        self.info.id
    }

    fn poll(&self, max: usize, direct: Option<&mut dyn FnMut(Completion)>) -> usize {
        let mut st = self.lock();
        if st.closed {
            return 0;
        }
        if st.credits.as_ref().is_some_and(|c| !c.held.is_empty()) {
            self.pump(&mut st);
        }
        let failed = st.failed.is_some();
        let cq = &self.report.cq;
        let n = match direct {
            // Under the lock nothing of this connection is on its way into the queue, so an
            // empty queue means no older record of it is waiting there.
            Some(take) if cq.is_empty() => self.take_hw(&mut st, max, take),
            _ => self.take_hw(&mut st, max, &mut |c| cq.push(c)),
        };
        if !failed && st.failed.is_some() {
            // The engine thread tears the connection down.
            self.wake.signal();
        }
        n
    }

    fn arm(&self) {
        let st = self.lock();
        if !st.closed {
            self.arm_notify();
        }
    }
}

/// The user's handle of a verbs connection. Dropping it tears the connection down.
pub(crate) struct Conn {
    sh: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    private_data: Vec<u8>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("verbs::Conn")
            .field("info", &self.sh.info)
            .finish()
    }
}

impl Conn {
    fn start(
        ctx: Arc<ContextInner>,
        cq: Arc<CompletionQueue>,
        opts: &ConnOptions,
        res: Resources,
        peer_data: Vec<u8>,
        library_peer: bool,
        credits: Option<(CreditMr, Option<Remote>)>,
    ) -> Result<Conn> {
        let info = ConnInfo {
            id: next_conn_id(),
            send_queue_depth: (res.caps.max_send_wr - INTERNAL_SLOTS).min(opts.send_queue_depth),
            recv_queue_depth: (res.caps.max_recv_wr - 1).min(opts.recv_queue_depth),
            max_inline: res.caps.max_inline_data.min(opts.max_inline),
            transport: Transport::Verbs,
        };
        // SAFETY: the id owns a live QP (created in Resources::new).
        let qp = unsafe { (*res.id.0).qp };
        let caller_polls = cq.options().progress == Progress::Caller;
        // A client that speaks credits sends its hello first (see `crate::verbs::credit`).
        let client_hello = credits.as_ref().is_some_and(|(_, peer)| peer.is_some());
        let credits = credits.map(|(mut mr, peer)| {
            if peer.is_some() {
                mr.fill_hello();
            }
            Credits::new(mr, peer, info.send_queue_depth, info.recv_queue_depth)
        });
        let sh = Arc::new(Shared {
            info,
            report: Reporter {
                cq,
                conn_id: info.id,
                context: opts.context,
            },
            ctx,
            pd: res.pd.clone(),
            qp,
            hw_cq: res.cq.raw,
            // Resources::new asked for the first event.
            notify_armed: AtomicBool::new(true),
            state: Mutex::new(PostState {
                closed: false,
                failed: None,
                next_seq: 0,
                sends: VecDeque::with_capacity((info.send_queue_depth + INTERNAL_SLOTS) as usize),
                recvs: VecDeque::with_capacity(info.recv_queue_depth as usize),
                user_sends: 0,
                internal_out: 0,
                unsignaled_run: 0,
                credits,
            }),
            stop: AtomicBool::new(false),
            wake: EventFd::new().map_err(Error::Thread)?,
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
        if caller_polls {
            sh.report.cq.add_source(sh.clone());
        }
        let engine = Engine {
            sh: sh.clone(),
            res: Some(res),
            caller_polls,
            port_grace: retry_bound(opts),
            credit_poll: CREDIT_POLL_MIN,
        };
        let thread = std::thread::Builder::new()
            .name(format!("rbr-verbs-{}", info.id))
            .spawn(move || engine.run())
            .map_err(Error::Thread)?;
        Ok(Conn {
            sh,
            thread: Some(thread),
            private_data: peer_data,
        })
    }

    pub(crate) fn info(&self) -> ConnInfo {
        self.sh.info
    }

    pub(crate) fn context(&self) -> &Arc<ContextInner> {
        &self.sh.ctx
    }

    pub(crate) fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// Posts a checked send.
    pub(crate) fn send(&self, wr: SendRequest<'_>) -> Result<()> {
        let len = wr.len();
        let flags = SendFlags(u32::from(wr.signaled));
        let ptr = wr.ptr().cast_mut();
        match wr.payload {
            Payload::Region { mr, .. } => {
                let lkey = mr.verbs_lkey(&self.sh.pd)?;
                if len > 0 && len <= self.sh.info.max_inline as usize {
                    // Small enough to travel inside the work request: copied now, so the
                    // device reads no memory for it and the region need not be held until it
                    // completes.
                    return self.post_send_raw(ptr, len, lkey, wr.wr_id, flags, true, None);
                }
                self.post_send_raw(ptr, len, lkey, wr.wr_id, flags, false, Some(mr.clone()))
            }
            Payload::Inline(_) => self.post_send_raw(ptr, len, 0, wr.wr_id, flags, true, None),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn post_send_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        lkey: u32,
        wr_id: u64,
        flags: SendFlags,
        inline: bool,
        mr: Option<Arc<MemoryRegion>>,
    ) -> Result<()> {
        let mut st = self.sh.lock();
        if st.closed {
            return Err(Error::Disconnected);
        }
        if st.user_sends >= self.sh.info.send_queue_depth as usize {
            return Err(Error::QueueFull("send"));
        }
        let mut h = Held {
            ptr,
            len: len as u32,
            lkey,
            wr_id,
            signaled: flags.signaled(),
            inline,
            mr,
        };
        if let Some(c) = st.credits.as_mut()
            && (!c.held.is_empty() || !c.available())
        {
            // The peer has no receive for it yet: held, and started in order when credits
            // arrive. An inline send's bytes are copied now, as the caller may reuse them.
            if inline {
                // SAFETY: `ptr`/`len` are the caller's slice (post_send_inline) or a range of
                // the caller's region that check_region found inside it (post_send), readable
                // for the whole call.
                let data = unsafe { std::slice::from_raw_parts(ptr, len) };
                h.ptr = c.stage(data, self.sh.info.send_queue_depth, self.sh.info.max_inline);
            }
            let first = c.held.is_empty();
            c.held.push_back(h);
            st.user_sends += 1;
            if first {
                // The credits may come while this thread polls nothing: the connection's
                // thread starts held sends then, once it knows some are held.
                self.sh.wake.signal();
            }
            return Ok(());
        }
        if let Err((r, _)) = self.sh.post_user_send(&mut st, h) {
            return Err(post_error(r, "send"));
        }
        st.user_sends += 1;
        if let Some(c) = st.credits.as_mut() {
            c.sent += 1;
        }
        Ok(())
    }

    /// Posts a checked receive.
    pub(crate) fn recv(&self, wr: RecvRequest<'_>) -> Result<()> {
        let RecvRequest {
            wr_id,
            mr,
            len,
            ptr,
            ..
        } = wr;
        let lkey = mr.verbs_lkey(&self.sh.pd)?;
        let mut st = self.sh.lock();
        if st.closed {
            return Err(Error::Disconnected);
        }
        if st.recvs.len() >= self.sh.info.recv_queue_depth as usize {
            return Err(Error::QueueFull("receive"));
        }
        let seq = st.next_seq;
        let mut sge = sys::ibv_sge {
            addr: ptr as u64,
            length: len as u32,
            lkey,
        };
        let mut wr = sys::ibv_recv_wr {
            wr_id: seq | RECV_BIT,
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
            self.sh.push_credits(&mut st);
        }
        Ok(())
    }

    pub(crate) fn disconnect(&self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        self.sh.wake.signal();
    }
}

/// Waits on `fds` for at most `timeout`, with microsecond resolution (the credit poll's first
/// sleeps are well under a millisecond). Returns how many are ready; an interruption counts as
/// a timeout.
fn poll_fine(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `fds` is a live, exclusively borrowed slice of pollfd and its length is passed;
    // `ts` is a live timespec; no signal mask.
    let n = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    if n >= 0 {
        return Ok(n as usize);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::Interrupted {
        return Ok(0);
    }
    Err(e)
}

/// ibv_post_* return the errno itself (they do not set errno).
fn post_error(r: i32, which: &'static str) -> Error {
    if r == libc::ENOMEM {
        Error::QueueFull(which)
    } else {
        Error::Connect(io::Error::from_raw_os_error(r))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.disconnect();
        if let Some(t) = self.thread.take() {
            // Teardown is bounded (FLUSH_WAIT), so this join is too.
            let _ = t.join();
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

/// Why the connection ended, and the status of its disconnect record.
#[derive(Clone, Copy)]
enum End {
    Local,
    Peer,
    Failed(WcStatus),
}

struct Engine {
    sh: Arc<Shared>,
    res: Option<Resources>,
    /// [`Progress::Caller`]: callers poll the device; the engine asks for completion events
    /// only while somebody sleeps on or watches the completion queue.
    caller_polls: bool,
    /// How long the connection's port may stay down before the connection fails: as long as
    /// the device's resends would take to give up on a peer that stopped answering.
    port_grace: Duration,
    /// How long the thread sleeps next while sends wait for credits.
    credit_poll: Duration,
}

/// How long a queue pair resends an unacknowledged packet before it fails:
/// (retry_count + 1) x 4.096 us x 2^ack_timeout.
fn retry_bound(opts: &ConnOptions) -> Duration {
    let t = u32::from(opts.ack_timeout.min(31));
    Duration::from_nanos(4096 * (1u64 << t) * (u64::from(opts.retry_count) + 1))
}

impl Engine {
    fn run(mut self) {
        let end =
            crate::panic::catch(|| self.main_loop()).unwrap_or(End::Failed(WcStatus::General));
        self.teardown(end);
    }

    fn res(&mut self) -> &mut Resources {
        self.res.as_mut().expect("resources live until teardown")
    }

    fn main_loop(&mut self) -> End {
        // When the connection last had anything to do: a keepalive goes out after a whole
        // keepalive period without.
        let mut active = Instant::now();
        loop {
            if self.sh.stop.load(Ordering::SeqCst) {
                return End::Local;
            }
            let (failed, credit_busy) = self.drain_cq();
            if let Some(fail) = failed {
                return End::Failed(fail);
            }
            let port_down = {
                let r = self.res();
                r.dev.down_since(r.port)
            };
            if port_down.is_some_and(|since| since.elapsed() >= self.port_grace) {
                // The local port went down and stayed down: the peer can't be reached, and some
                // devices never fail the queue pair's outstanding work on their own.
                return End::Failed(WcStatus::Transport);
            }
            if self.caller_polls && self.sh.report.cq.watched() {
                // Somebody sleeps on the queue: the device must announce what comes next. The
                // drain at the top of the next round takes what came in before the request.
                if !self.sh.notify_armed.load(Ordering::SeqCst) {
                    self.sh.arm_notify();
                    continue;
                }
            }
            let (comp_fd, cm_fd, dev_fd) = {
                let r = self.res();
                // SAFETY: the completion channel is live.
                (unsafe { (*r.comp.0).fd }, r.ch.fd(), r.dev.fd())
            };
            let mut fds = [
                libc::pollfd {
                    fd: comp_fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: cm_fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.sh.wake.raw(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: dev_fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let idle = self
                .sh
                .keepalive
                .map_or(TICK, |k| k.saturating_sub(active.elapsed()));
            let mut tick = port_down.map_or(idle, |since| {
                idle.min(self.port_grace.saturating_sub(since.elapsed()))
            });
            if credit_busy {
                // Sends wait for credits, which arrive as an RDMA write (no event): look at the
                // word again soon, backing off while nothing comes.
                tick = tick.min(self.credit_poll);
                self.credit_poll = (self.credit_poll * 2).min(CREDIT_POLL_MAX);
            } else {
                self.credit_poll = CREDIT_POLL_MIN;
            }
            let ready = match poll_fine(&mut fds, tick) {
                Ok(n) => n,
                Err(_) => return End::Failed(WcStatus::General),
            };
            if ready > 0 {
                active = Instant::now();
            } else if let Some(k) = self.sh.keepalive
                && active.elapsed() >= k
            {
                self.send_keepalive();
                active = Instant::now();
            }
            if fds[2].revents != 0 {
                self.sh.wake.clear();
            }
            if fds[3].revents != 0 {
                self.res().dev.drain();
            }
            if fds[0].revents != 0 {
                self.take_cq_events(!self.caller_polls);
            }
            if fds[1].revents != 0 {
                match self.res().ch.get_event(Some(Instant::now())) {
                    Ok(Some(ev)) => match ev.kind {
                        RDMA_CM_EVENT_DISCONNECTED => {
                            // A failed work request the device reported before the disconnect
                            // (the peer often disconnects because of it) says why the
                            // connection ended: look before calling it an orderly close.
                            return match self.drain_cq().0 {
                                Some(fail) => End::Failed(fail),
                                None => End::Peer,
                            };
                        }
                        RDMA_CM_EVENT_DEVICE_REMOVAL => return End::Failed(WcStatus::Transport),
                        _ => {}
                    },
                    Ok(None) => {}
                    Err(_) => return End::Failed(WcStatus::General),
                }
            }
        }
    }

    /// Posts a keepalive when nothing is outstanding on the send queue (so the queue pair has
    /// been idle for a whole keepalive period); a busy connection needs none.
    /// (Unsignaled credit writes that finished long ago do not count: the device reports
    /// nothing more of them.)
    fn send_keepalive(&self) {
        let mut st = self.sh.lock();
        if st.closed || st.sends.iter().any(|e| !e.internal || e.hw_signaled) {
            return;
        }
        // SAFETY: ibv_send_wr is plain data; zero is a valid start (no SGE, remote address 0,
        // rkey 0: a zero-length RDMA write checks neither).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        // A failed post is left for the next period.
        let _ = self.sh.post_internal(&mut st, &mut wr, true);
    }

    /// Takes pending notifications from the completion channel and re-arms the CQ (with
    /// [`Progress::Thread`], or in teardown; with [`Progress::Caller`] the main loop re-arms
    /// only for a sleeper); the caller polls the CQ afterwards, so nothing that arrived in
    /// between is missed.
    fn take_cq_events(&mut self, rearm: bool) {
        let sh = self.sh.clone();
        let r = self.res();
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: live non-blocking channel; fails with EAGAIN when empty.
            if unsafe { sys::ibv_get_cq_event(r.comp.0, &mut cq, &mut ctx) } != 0 {
                break;
            }
            r.cq.unacked += 1;
        }
        if r.cq.unacked >= 64 {
            r.cq.ack();
        }
        // The event consumed the request (or it is made again right below).
        sh.notify_armed.store(false, Ordering::SeqCst);
        if rearm {
            sh.arm_notify();
        }
    }

    /// Polls the CQ dry and queues the completions of the work it reports. Returns the error
    /// that failed the queue pair, if any (found now, or earlier by a caller's poll).
    /// Also starts sends whose credits arrived and makes owed credit writes; says whether
    /// sends still wait for credits (or a write is still owed).
    fn drain_cq(&mut self) -> (Option<WcStatus>, bool) {
        let sh = &self.sh;
        let mut st = sh.lock();
        sh.pump(&mut st);
        sh.take_hw(&mut st, usize::MAX, &mut |c| sh.report.cq.push(c));
        (st.failed, Shared::credit_busy(&st))
    }

    /// Disconnects, waits (bounded) for the device to flush every outstanding work request,
    /// reports the rest as flushed, reports the disconnect, and destroys the resources.
    fn teardown(&mut self, end: End) {
        self.sh.lock().closed = true;
        // Callers no longer poll the device CQ; from here the engine alone drains it.
        self.sh.report.cq.remove_source(self.sh.info.id);
        // SAFETY: live id; moves the QP to the error state so outstanding work is flushed. An
        // error (already disconnected) changes nothing.
        unsafe { sys::rdma_disconnect(self.res().id.0) };
        let deadline = Instant::now() + FLUSH_WAIT;
        loop {
            self.drain_cq();
            let outstanding = {
                let st = self.sh.lock();
                // Unsignaled internal work that finished is never reported: not waited for.
                st.sends.iter().any(|e| !e.internal || e.hw_signaled) || !st.recvs.is_empty()
            };
            if !outstanding || Instant::now() >= deadline {
                break;
            }
            // SAFETY: the completion channel is live.
            let fd = unsafe { (*self.res().comp.0).fd };
            let _ = crate::sys::poll_one(fd, libc::POLLIN, Some(Duration::from_millis(20)));
            self.take_cq_events(true);
        }
        {
            let mut st = self.sh.lock();
            while let Some(e) = st.sends.pop_front() {
                if !e.internal {
                    self.sh
                        .report
                        .complete(e.wr_id, Opcode::Send, WcStatus::Flushed, 0, None);
                }
            }
            // Sends held for credits never reached the device: flushed, after those that did.
            let held = st.credits.as_mut().map(|c| std::mem::take(&mut c.held));
            for h in held.into_iter().flatten() {
                self.sh
                    .report
                    .complete(h.wr_id, Opcode::Send, WcStatus::Flushed, 0, None);
            }
            while let Some(e) = st.recvs.pop_front() {
                self.sh
                    .report
                    .complete(e.wr_id, Opcode::Recv, WcStatus::Flushed, 0, None);
            }
        }
        let status = match end {
            End::Local | End::Peer => WcStatus::Success,
            End::Failed(s) => s,
        };
        // Resources go before the record, so a caller that sees it can count on them being gone.
        self.res = None;
        self.sh
            .report
            .complete(0, Opcode::Disconnected, status, 0, None);
    }
}
