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
//! program and gets plain RC semantics, its private data passed through untouched.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_sys as sys;
use sys::rdma_cm_event_type::*;

use crate::conn::{ConnInfo, ConnOptions, SendFlags, Transport, next_conn_id};
use crate::cq::{Completion, CompletionQueue, Opcode, Progress, Reporter, Source, WcStatus};
use crate::ctx::ContextInner;
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::sys::EventFd;
use crate::verbs::cm::{CmEvent, CmId, EventChannel, set_nonblocking, sockaddr};
use crate::verbs::res::{CompChannel, Cq, DeviceEvents, Pd, device_events};

const MAGIC: [u8; 4] = *b"RBRv";
const PREAMBLE_VERSION: u8 = 1;
const PREAMBLE: usize = 8;
/// `rdma_set_option` level and name for the ACK timeout (rdma_cma.h; not in the bindings).
const RDMA_OPTION_ID: i32 = 0;
const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;
/// rdma_cm's reject reason when nobody listens on the port (IB_CM_REJ_INVALID_SERVICE_ID).
const REJ_NO_LISTENER: i32 = 8;
const RECV_BIT: u64 = 1 << 63;
/// How long teardown waits for the device to flush outstanding work before reporting the
/// rest as flushed itself.
const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// How often the engine looks at the connection when nothing else wakes it (port state, and the
/// device CQ with progress on the caller's thread), at the least.
const TICK: Duration = Duration::from_secs(1);

fn with_preamble(user: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(PREAMBLE + user.len());
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&[PREAMBLE_VERSION, 0, user.len() as u8, 0]);
    v.extend_from_slice(user);
    v
}

/// Splits received private data into (is a library peer, the caller's data).
fn parse_preamble(data: &[u8]) -> (bool, Vec<u8>) {
    if data.len() >= PREAMBLE && data[..4] == MAGIC && data[4] == PREAMBLE_VERSION {
        let len = data[6] as usize;
        if PREAMBLE + len <= data.len() {
            return (true, data[PREAMBLE..PREAMBLE + len].to_vec());
        }
    }
    (false, data.to_vec())
}

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
        let cq = Cq::new(device, &comp, opts.send_queue_depth + opts.recv_queue_depth)?;
        // SAFETY: ibv_qp_init_attr is plain data; zero is a valid start.
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.raw;
        attr.recv_cq = cq.raw;
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        // One slot more than asked for: the engine's keepalive must never take the caller's.
        attr.cap.max_send_wr = opts.send_queue_depth + 1;
        attr.cap.max_recv_wr = opts.recv_queue_depth;
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
        })
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
        let res = Resources::new(&self.ctx, id, ch, opts)?;
        let data = if self.library_peer {
            with_preamble(&opts.private_data)
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
        Conn::start(self.ctx.clone(), cq, opts, res, pd, self.library_peer)
    }

    pub(crate) fn reject(mut self, private_data: &[u8]) -> Result<()> {
        let id = self.id.take().expect("unanswered");
        let data = if self.library_peer {
            with_preamble(private_data)
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
    let res = Resources::new(&ctx, id, ch, opts)?;
    let data = with_preamble(&opts.private_data);
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
    Conn::start(ctx, cq, opts, res, peer_data, library_peer)
}

struct SendEntry {
    seq: u64,
    wr_id: u64,
    signaled: bool,
    /// A keepalive of the library's own: never reported, but its failure fails the connection.
    internal: bool,
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
    sends: VecDeque<SendEntry>,
    recvs: VecDeque<RecvEntry>,
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
        const BATCH: usize = 16;
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
        if wc.wr_id & RECV_BIT != 0 {
            let seq = wc.wr_id & !RECV_BIT;
            while st.recvs.front().is_some_and(|e| e.seq <= seq) {
                let e = st.recvs.pop_front().expect("front exists");
                let (status, len) = if e.seq == seq {
                    (status, wc.byte_len)
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
    ) -> Result<Conn> {
        let info = ConnInfo {
            id: next_conn_id(),
            send_queue_depth: (res.caps.max_send_wr - 1).min(opts.send_queue_depth),
            recv_queue_depth: res.caps.max_recv_wr.min(opts.recv_queue_depth),
            max_inline: res.caps.max_inline_data.min(opts.max_inline),
            transport: Transport::Verbs,
        };
        // SAFETY: the id owns a live QP (created in Resources::new).
        let qp = unsafe { (*res.id.0).qp };
        let caller_polls = cq.options().progress == Progress::Caller;
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
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
            }),
            stop: AtomicBool::new(false),
            wake: EventFd::new().map_err(Error::Thread)?,
            keepalive: opts.keepalive.filter(|_| library_peer),
        });
        if caller_polls {
            sh.report.cq.add_source(sh.clone());
        }
        let engine = Engine {
            sh: sh.clone(),
            res: Some(res),
            caller_polls,
            port_grace: retry_bound(opts),
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

    pub(crate) fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    pub(crate) fn post_send(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        crate::conn::check_send_flags(flags)?;
        let ptr = crate::conn::check_region(mr, &self.sh.ctx, offset, len)?;
        let lkey = mr.verbs_lkey(&self.sh.pd)?;
        self.post_send_raw(ptr, len, lkey, wr_id, flags, false, Some(mr.clone()))
    }

    pub(crate) fn post_send_inline(&self, data: &[u8], wr_id: u64, flags: SendFlags) -> Result<()> {
        crate::conn::check_send_flags(flags)?;
        crate::conn::check_inline(data.len(), self.sh.info.max_inline)?;
        self.post_send_raw(
            data.as_ptr().cast_mut(),
            data.len(),
            0,
            wr_id,
            flags,
            true,
            None,
        )
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
        if st.sends.len() >= self.sh.info.send_queue_depth as usize {
            return Err(Error::QueueFull("send"));
        }
        let seq = st.next_seq;
        let mut sge = sys::ibv_sge {
            addr: ptr as u64,
            length: len as u32,
            lkey,
        };
        // SAFETY: ibv_send_wr is plain data; zero is a valid start.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = seq;
        wr.sg_list = &mut sge;
        wr.num_sge = if len == 0 { 0 } else { 1 };
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND;
        let mut f = 0;
        if flags.signaled() {
            f |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if inline {
            f |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        wr.send_flags = f;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live while `closed` is false (checked under the lock); the work
        // request and SGE are live locals; the buffer is valid until the send completes (held
        // by `mr`) or, inline, copied during the call.
        let r = unsafe { sys::ibv_post_send(self.sh.qp, &mut wr, &mut bad) };
        if r != 0 {
            return Err(post_error(r, "send"));
        }
        st.next_seq += 1;
        st.sends.push_back(SendEntry {
            seq,
            wr_id,
            signaled: flags.signaled(),
            internal: false,
            _mr: mr,
        });
        Ok(())
    }

    pub(crate) fn post_recv(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<()> {
        let ptr = crate::conn::check_recv_region(mr, &self.sh.ctx, offset, len)?;
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
        Ok(())
    }

    pub(crate) fn disconnect(&self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        self.sh.wake.signal();
    }
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
}

/// How long a queue pair resends an unacknowledged packet before it fails:
/// (retry_count + 1) x 4.096 us x 2^ack_timeout.
fn retry_bound(opts: &ConnOptions) -> Duration {
    let t = u32::from(opts.ack_timeout.min(31));
    Duration::from_nanos(4096 * (1u64 << t) * (u64::from(opts.retry_count) + 1))
}

impl Engine {
    fn run(mut self) {
        let end = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.main_loop()))
        {
            Ok(end) => end,
            Err(_) => End::Failed(WcStatus::General),
        };
        self.teardown(end);
    }

    fn res(&mut self) -> &mut Resources {
        self.res.as_mut().expect("resources live until teardown")
    }

    fn main_loop(&mut self) -> End {
        loop {
            if self.sh.stop.load(Ordering::SeqCst) {
                return End::Local;
            }
            if let Some(fail) = self.drain_cq() {
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
            let idle = self.sh.keepalive.unwrap_or(TICK);
            let tick = port_down.map_or(idle, |since| {
                idle.min(self.port_grace.saturating_sub(since.elapsed()))
            });
            let ready = match crate::sys::poll(&mut fds, Some(tick)) {
                Ok(n) => n,
                Err(_) => return End::Failed(WcStatus::General),
            };
            if ready == 0 && self.sh.keepalive.is_some() {
                self.send_keepalive();
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
                        RDMA_CM_EVENT_DISCONNECTED => return End::Peer,
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
    fn send_keepalive(&self) {
        let mut st = self.sh.lock();
        if st.closed || !st.sends.is_empty() {
            return;
        }
        let seq = st.next_seq;
        // SAFETY: ibv_send_wr is plain data; zero is a valid start (no SGE, remote address 0,
        // rkey 0: a zero-length RDMA write checks neither).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = seq;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live while `closed` is false (checked under the lock); the work
        // request is a live local with no buffers.
        let r = unsafe { sys::ibv_post_send(self.sh.qp, &mut wr, &mut bad) };
        if r == 0 {
            st.next_seq += 1;
            st.sends.push_back(SendEntry {
                seq,
                wr_id: 0,
                signaled: false,
                internal: true,
                _mr: None,
            });
        }
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
    fn drain_cq(&mut self) -> Option<WcStatus> {
        let sh = &self.sh;
        let mut st = sh.lock();
        sh.take_hw(&mut st, usize::MAX, &mut |c| sh.report.cq.push(c));
        st.failed
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
                !st.sends.is_empty() || !st.recvs.is_empty()
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
