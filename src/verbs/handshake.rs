//! Establishing verbs connections: the RDMA CM connection flow on RC queue pairs, and the
//! verbs objects each connection owns.
//!
//! Server: event channel -> id (RDMA_PS_TCP) -> bind -> listen -> CONNECT_REQUEST -> (accepted:
//! the new id moves to a channel of its own) -> PD / shared device CQ / QP -> accept ->
//! ESTABLISHED. Everything after the request is taken runs on the context's driver, so taking
//! a request and accepting it cost their caller no more than reading the event.
//! Client: event channel -> id -> resolve address -> resolve route -> PD / shared device CQ /
//! QP -> connect -> ESTABLISHED. Each failure event maps to its own error. The device CQ is
//! shared by the connections of one completion queue on one device (`devcq.rs`).
//!
//! Library peers recognise each other by an 8-byte preamble in the private data (magic,
//! version, flags, length of the caller's data); a peer without it is a plain librdmacm
//! program and gets plain RC semantics, its private data passed through untouched
//! (`preamble.rs`).

use std::io;
use std::sync::Arc;
use std::time::Instant;

use rdma_sys as sys;
use sys::rdma_cm_event_type::*;

use crate::conn::seam::{ListenerSeam, RequestSeam};
use crate::conn::{ConnOptions, ConnRequest, Handshake, Setup, SrqInner, Started, Step, Transport};
use crate::cq::CompletionQueue;
use crate::domain::ContextInner;
use crate::driver::{Next, Ready, Registration};
use crate::error::{Error, Result};
use crate::verbs::cm::{CmEvent, CmId, EventChannel, cm_err, sockaddr};
use crate::verbs::conn::Conn;
use crate::verbs::conn::{HELLO_BIT, POOL_WR, RECV_BIT};
use crate::verbs::credit::{CreditMr, FLAG_CREDITS, HELLO_LEN, INTERNAL_SLOTS, Remote};
use crate::verbs::devcq::{Attachment, attach};
use crate::verbs::domain::Domain;
use crate::verbs::preamble::{offers_credits, parse_credit_ext, parse_preamble, with_preamble};
use crate::verbs::res::post_error;
use crate::verbs::res::{DeviceEvents, Limits, Pd, device_events};
use crate::verbs::srq::{self, DevicePool};

/// `rdma_set_option` level and name for the ACK timeout (rdma_cma.h; not in the bindings).
const RDMA_OPTION_ID: i32 = 0;
const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;
/// rdma_cm's reject reason when nobody listens on the port (IB_CM_REJ_INVALID_SERVICE_ID).
const REJ_NO_LISTENER: i32 = 8;

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

fn timeout_ms(deadline: Option<Instant>) -> i32 {
    crate::sys::remaining(deadline).map_or(5000, |d| d.as_millis().clamp(1, 60_000) as i32)
}

/// The verbs objects of one connection, destroyed in field order: QP, its share of the device
/// CQ, CM id, event channel (the driver takes the channel once the connection starts).
pub(super) struct Resources {
    qp: Option<QpGuard>,
    pub(super) att: Attachment,
    id: Option<CmId>,
    pub(super) ch: Option<EventChannel>,
    pub(super) pd: Arc<Pd>,
    pub(super) caps: sys::ibv_qp_cap,
    /// The device's port events, and the port this connection uses.
    pub(super) dev: Arc<DeviceEvents>,
    pub(super) port: u8,
    /// What the device allows the connection's one-sided operations.
    pub(super) limits: Limits,
    /// The credit word toward a library peer: after the QP in drop order, since the peer's
    /// device may write into it while the QP lives.
    credit: Option<CreditMr>,
    /// The shared receive queue the queue pair takes its receives from, with its device
    /// queue: after the QP in drop order.
    pub(super) pool: Option<(Arc<SrqInner>, Arc<DevicePool>)>,
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
    /// The objects of a connection over `id` and its channel `ch`, which it takes only when
    /// it succeeds (a handshake keeps them, and its descriptor, until its handler goes).
    fn new(
        ctx: &ContextInner,
        cq: &Arc<CompletionQueue>,
        id: &mut Option<CmId>,
        ch: &mut Option<EventChannel>,
        opts: &ConnOptions,
    ) -> Result<Resources> {
        let cm = id.as_ref().expect("a live id");
        let device = cm.verbs();
        if device.is_null() {
            return Err(Error::NoDevice);
        }
        let domain = ctx.transports.get::<Domain>();
        let pd = domain.pd(device)?;
        let dev = device_events(device)?;
        let limits = dev.limits;
        // SAFETY: live id, bound to a device port by now.
        let port = unsafe { (*cm.0).port_num };
        // Room in the shared device CQ for everything the queue pair may report at once: a
        // queue pair in error reports every outstanding work request, signaled or not - the
        // caller's, the library's own (credit writes, keepalive, hello) and the server's hello
        // receive.
        let pool = match &opts.srq {
            Some(q) => Some((q.inner.clone(), srq::bind(&q.inner, &pd, POOL_WR)?)),
            None => None,
        };
        // A queue pair on a shared receive queue has no receive queue of its own; the device
        // CQ makes room for the pool's receives once (`uses_pool`).
        let own_recvs = if pool.is_some() {
            0
        } else {
            opts.recv_queue_depth + 1
        };
        let need = opts.send_queue_depth + INTERNAL_SLOTS + own_recvs;
        let driver = ctx.driver.get().map_err(Error::Thread)?;
        domain.watch_ports(device, &driver)?;
        let mut att = attach(&domain.devcqs, &driver, cq, device, need)?;
        if let Some((q, d)) = &pool {
            att.uses_pool(d.raw as usize, q.depth() as u32)?;
        }
        // SAFETY: ibv_qp_init_attr is plain data; zero is a valid start.
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = att.devcq.raw;
        attr.recv_cq = att.devcq.raw;
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        // Slots beyond the caller's: the library's own work (keepalive, hello, credit writes)
        // must never take the caller's, nor the server's hello receive.
        attr.cap.max_send_wr = opts.send_queue_depth + INTERNAL_SLOTS;
        attr.cap.max_recv_wr = own_recvs;
        attr.cap.max_send_sge = limits.send_sge;
        attr.cap.max_recv_sge = 1;
        if let Some((_, d)) = &pool {
            attr.srq = d.raw;
        }
        attr.cap.max_inline_data = opts.max_inline;
        // SAFETY: live id, PD and attr (its CQ lives while `att` does); on success the id owns
        // the QP and attr.cap holds the granted capabilities.
        if unsafe { sys::rdma_create_qp(cm.0, pd.raw, &mut attr) } != 0 {
            let e = io::Error::last_os_error();
            return Err(Error::invalid(format!(
                "the device refused the queue pair (depths {}/{}, inline {}): {e}",
                opts.send_queue_depth, opts.recv_queue_depth, opts.max_inline
            )));
        }
        let qp = QpGuard(cm.0);
        // SAFETY: the id owns the live QP just made.
        att.enter(unsafe { (*(*cm.0).qp).qp_num });
        Ok(Resources {
            qp: Some(qp),
            att,
            caps: attr.cap,
            pd,
            dev,
            port,
            limits,
            id: id.take(),
            ch: ch.take(),
            credit: None,
            pool,
        })
    }

    fn id(&self) -> &CmId {
        self.id
            .as_ref()
            .expect("the id lives until the connection is destroyed")
    }

    /// The peer's address, for messages.
    pub(super) fn peer(&self) -> String {
        peer_name(self.id())
    }

    fn ch(&self) -> &EventChannel {
        self.ch
            .as_ref()
            .expect("the channel is taken only once established")
    }

    pub(super) fn id_raw(&self) -> *mut sys::rdma_cm_id {
        self.id().0
    }

    /// The queue pair.
    pub(super) fn qp_raw(&self) -> *mut sys::ibv_qp {
        // SAFETY: live id owning a QP (made in `new`).
        unsafe { (*self.id().0).qp }
    }

    /// Destroys the queue pair, the CM id and the credit block, in that order (teardown).
    pub(super) fn destroy(&mut self) {
        self.qp = None;
        self.id = None;
        self.credit = None;
    }

    /// A queue pair on a shared receive queue answers a message that finds the pool empty
    /// with receiver-not-ready, and the peer's device sends it again after the time this asks
    /// for: 0.64 ms (RDMA CM leaves the device's default, 655 ms, an age for a server whose
    /// pool is refilled as it polls).
    fn shorten_rnr_wait(&self) -> io::Result<()> {
        // SAFETY: plain data; zero is a valid start.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.min_rnr_timer = RNR_TIMER_640_US;
        let mask = sys::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as i32;
        // SAFETY: the id owns a live QP in RTS, where the RNR timer may change.
        let r = unsafe { sys::ibv_modify_qp(self.qp_raw(), &mut attr, mask) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        Ok(())
    }

    /// Posts the server's internal receive for the client's hello into `credit`'s block.
    fn post_hello_recv(&self, credit: &CreditMr) -> Result<()> {
        let mut sge = sys::ibv_sge {
            addr: credit.hello_addr(),
            length: HELLO_LEN as u32,
            lkey: credit.lkey(),
        };
        let mut wr = sys::ibv_recv_wr {
            wr_id: RECV_BIT | HELLO_BIT | self.att.tag,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the id owns a live QP; the work request and SGE are live locals; the block
        // is registered and outlives the QP (`credit` field order, then the shared state).
        let r = unsafe { sys::ibv_post_recv(self.qp_raw(), &mut wr, &mut bad) };
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
                self.id_raw(),
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

    /// The connection parameters: `data` as private data, and the RDMA read and atomic limits
    /// (a client offers what its device allows; a server answers with what both allow, and
    /// the client's queue pair takes the answer).
    fn conn_param(
        &self,
        data: &[u8],
        opts: &ConnOptions,
        (responder_resources, initiator_depth): (u8, u8),
    ) -> sys::rdma_conn_param {
        // SAFETY: rdma_conn_param is plain data; zero is a valid start.
        let mut p: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = data.as_ptr().cast();
        p.private_data_len = data.len() as u8;
        p.responder_resources = responder_resources;
        p.initiator_depth = initiator_depth;
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
                    let (library_peer, private_data) = parse_preamble(&ev.private_data);
                    return Ok(Some(Request {
                        id: Some(CmId(ev.id)),
                        ch: None,
                        library_peer,
                        credits: offers_credits(&ev.private_data),
                        private_data,
                        peer_responder_resources: ev.responder_resources,
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

impl ListenerSeam for Listener {
    fn fd(&self) -> i32 {
        self.ch.fd()
    }

    fn take(&self, deadline: Option<Instant>) -> Result<Option<ConnRequest>> {
        Ok(self.get_request(deadline)?.map(ConnRequest::new))
    }
}

/// A pending connection request.
pub(crate) struct Request {
    id: Option<CmId>,
    /// The id's own channel, once accepting moved it there; until then its events (only a
    /// peer giving up can send any) go to the listener's, which drops them.
    ch: Option<EventChannel>,
    library_peer: bool,
    /// The peer offers receive credits (not when its receives come from a shared queue).
    credits: bool,
    private_data: Vec<u8>,
    /// How many RDMA reads and atomics the client accepts from this side at once.
    peer_responder_resources: u8,
    ctx: Arc<ContextInner>,
}

/// How messages name the peer of `id`.
fn peer_name(id: &CmId) -> String {
    id.peer_addr()
        .map_or_else(|| "an address of unknown family".into(), |a| a.to_string())
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("verbs::Request")
    }
}

impl Request {
    /// Moves the id to a channel of its own, which the driver watches for the handshake (and
    /// the connection) from now on: a turn's work, not the caller's, as opening a channel and
    /// moving an id are system calls.
    fn own_channel(&mut self, reg: &Registration) -> Result<()> {
        let ch = self.ch.insert(EventChannel::new()?);
        self.id.as_ref().expect("unanswered").migrate(ch)?;
        reg.watch(0, ch.fd()).map_err(Error::Thread)
    }

    /// Answers the request with an accept: the queue pair is made, and the peer's
    /// confirmation is to come on the request's channel.
    fn answer(&mut self, cq: &Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Resources> {
        let mut res = Resources::new(&self.ctx, cq, &mut self.id, &mut self.ch, opts)?;
        let data = if self.library_peer && (res.pool.is_some() || !self.credits) {
            // A queue pair on a shared receive queue has no receive of its own for the hello,
            // and the pool's receives are not this connection's to count: no credits (see
            // `srq.rs`), on either side's pool; the peer's device waits for the pool's
            // receives.
            with_preamble(&opts.private_data, 0, &[])
        } else if self.library_peer {
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
        // Reads and atomics: accept as many as the device can answer; issue no more than the
        // client said it can answer (a plain librdmacm client says so too).
        let rd = (
            res.limits.responder_resources,
            res.limits
                .initiator_depth
                .min(self.peer_responder_resources),
        );
        let mut param = res.conn_param(&data, opts, rd);
        // SAFETY: live id with its QP; `param` points at `data`, alive for the call.
        if unsafe { sys::rdma_accept(res.id_raw(), &mut param) } != 0 {
            return Err(Error::Accept(io::Error::last_os_error()));
        }
        Ok(res)
    }
}

/// The accepting side's handshake: the accept, then the peer's confirmation.
struct Accepting {
    request: Request,
    cq: Arc<CompletionQueue>,
    opts: ConnOptions,
    /// For the peer's confirmation, once accepted.
    deadline: Option<Instant>,
    /// Once accepted.
    res: Option<Resources>,
}

impl Accepting {
    fn turn(&mut self, setup: &Setup) -> Result<Option<Established>> {
        let Some(res) = &self.res else {
            self.request.own_channel(setup.registration())?;
            self.res = Some(self.request.answer(&self.cq, &self.opts)?);
            // The peer has its timeout to confirm from the accept on, however long the turns
            // of other handshakes kept this one waiting for its first.
            self.deadline = self.opts.timeout.map(|t| Instant::now() + t);
            return Ok(None);
        };
        let peer = res.peer();
        let Some(_) = next_event(
            res.ch(),
            RDMA_CM_EVENT_ESTABLISHED,
            self.deadline,
            "waiting for the peer to confirm",
            &peer,
        )?
        else {
            return Ok(None);
        };
        let mut res = self.res.take().expect("accepted");
        if res.pool.is_some() {
            res.shorten_rnr_wait().map_err(Error::Accept)?;
        }
        // The server learns the client's word from the hello.
        let credits = res.credit.take().map(|c| (c, None));
        Ok(Some(Established {
            cq: self.cq.clone(),
            res,
            peer_data: std::mem::take(&mut self.request.private_data),
            library_peer: self.request.library_peer,
            credits,
        }))
    }
}

impl Handshake for Accepting {
    fn step(&mut self, _: &Ready, setup: &Setup) -> Step {
        let turn = self.turn(setup);
        step(turn, setup, &self.opts, self.deadline)
    }
}

/// A handshake's step from its turn's outcome: an established queue pair starts as the
/// connection.
fn step(
    turn: Result<Option<Established>>,
    setup: &Setup,
    opts: &ConnOptions,
    deadline: Option<Instant>,
) -> Step {
    match turn.and_then(|e| e.map(|e| Conn::start(e, opts, setup)).transpose()) {
        Ok(Some((conn, engine))) => Step::Up(Box::new(conn), engine),
        Ok(None) => Step::Wait(Next::Wait(deadline)),
        Err(e) => Step::Failed(e),
    }
}

/// The next event on `ch` if there is one, which must be `want`; `Ok(None)` when there is
/// none yet, [`Error::Timeout`] when there is none by `deadline`.
fn next_event(
    ch: &EventChannel,
    want: u32,
    deadline: Option<Instant>,
    doing: &'static str,
    target: &str,
) -> Result<Option<CmEvent>> {
    match ch.get_event(Some(Instant::now()))? {
        None if crate::sys::remaining(deadline).is_some_and(|d| d.is_zero()) => {
            Err(Error::Timeout(doing))
        }
        None => Ok(None),
        Some(ev) if ev.kind == want => Ok(Some(ev)),
        Some(ev) => Err(event_error(&ev, target)),
    }
}

impl RequestSeam for Request {
    /// The requester's address, for messages.
    fn peer(&self) -> String {
        self.id.as_ref().map_or_else(String::new, peer_name)
    }

    fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    fn reject(mut self: Box<Self>, private_data: &[u8]) -> Result<()> {
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

    fn context(&self) -> &Arc<ContextInner> {
        &self.ctx
    }

    fn transport(&self) -> Transport {
        Transport::Verbs
    }

    fn start(self: Box<Self>, cq: Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Started> {
        Ok(Started {
            handshake: Box::new(Accepting {
                request: *self,
                cq,
                opts: opts.clone(),
                deadline: None,
                res: None,
            }),
            fd: None,
        })
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

/// A queue pair established with its peer, for `engine.rs` to start as a connection.
pub(super) struct Established {
    pub(super) cq: Arc<CompletionQueue>,
    pub(super) res: Resources,
    /// The peer's private data (without the library's preamble).
    pub(super) peer_data: Vec<u8>,
    pub(super) library_peer: bool,
    /// Toward a library peer: this side's credit block and (a client's) the peer's word.
    pub(super) credits: Option<(CreditMr, Option<Remote>)>,
}

/// Starts connecting to `host:port`: making the channel and the id, resolving the address and
/// the route and connecting are the handshake's turns.
/// The encoding of 0.64 ms as a minimum RNR timer (InfiniBand's table of RNR NAK delays).
const RNR_TIMER_640_US: u8 = 12;

pub(crate) fn start_connect(
    ctx: Arc<ContextInner>,
    host: &str,
    port: u16,
    cq: Arc<CompletionQueue>,
    opts: &ConnOptions,
) -> Result<Started> {
    let (dst, _) = sockaddr(host, port)?;
    Ok(Started {
        handshake: Box::new(Connecting {
            ctx,
            cq,
            opts: opts.clone(),
            target: format!("rdma://{host}:{port}"),
            deadline: opts.timeout.map(|t| Instant::now() + t),
            dst,
            stage: ClientStage::Start,
            id: None,
            ch: None,
            res: None,
        }),
        fd: None,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ClientStage {
    Start,
    Address,
    Route,
    Connect,
}

/// The connecting side's handshake.
struct Connecting {
    ctx: Arc<ContextInner>,
    cq: Arc<CompletionQueue>,
    opts: ConnOptions,
    target: String,
    deadline: Option<Instant>,
    dst: libc::sockaddr_storage,
    stage: ClientStage,
    /// From the first turn until the queue pair is made (then in `res`).
    id: Option<CmId>,
    ch: Option<EventChannel>,
    res: Option<Resources>,
}

// SAFETY: the id and channel are used by one turn at a time; `dst` is plain data.
unsafe impl Send for Connecting {}

impl Connecting {
    fn id(&self) -> *mut sys::rdma_cm_id {
        self.id.as_ref().expect("before the queue pair").0
    }

    fn event(&self, want: u32, doing: &'static str) -> Result<Option<CmEvent>> {
        let ch = match &self.res {
            Some(res) => res.ch(),
            None => self.ch.as_ref().expect("before the queue pair"),
        };
        next_event(ch, want, self.deadline, doing, &self.target)
    }

    fn turn(&mut self, reg: &Registration) -> Result<Option<Established>> {
        match self.stage {
            ClientStage::Start => {
                // The id lives in the channel: on a failure here the id goes first.
                let ch = self.ch.insert(EventChannel::new()?);
                let id = CmId::new(ch)?;
                reg.watch(0, ch.fd()).map_err(Error::Thread)?;
                self.id = Some(id);
                let mut dst = self.dst;
                // SAFETY: live id; `dst` is a valid sockaddr.
                if unsafe {
                    sys::rdma_resolve_addr(
                        self.id(),
                        std::ptr::null_mut(),
                        (&raw mut dst).cast(),
                        timeout_ms(self.deadline),
                    )
                } != 0
                {
                    let e = io::Error::last_os_error();
                    return Err(match e.raw_os_error() {
                        Some(libc::ENETUNREACH)
                        | Some(libc::EHOSTUNREACH)
                        | Some(libc::ENODEV)
                        | Some(libc::EADDRNOTAVAIL) => {
                            Error::Unreachable(format!("{}: {e}", self.target))
                        }
                        _ => cm_err("rdma_resolve_addr")(e),
                    });
                }
                self.stage = ClientStage::Address;
            }
            ClientStage::Address => {
                if self
                    .event(RDMA_CM_EVENT_ADDR_RESOLVED, "resolving the address")?
                    .is_none()
                {
                    return Ok(None);
                }
                // SAFETY: live id with a resolved address.
                if unsafe { sys::rdma_resolve_route(self.id(), timeout_ms(self.deadline)) } != 0 {
                    return Err(cm_err("rdma_resolve_route")(io::Error::last_os_error()));
                }
                self.stage = ClientStage::Route;
            }
            ClientStage::Route => {
                if self
                    .event(RDMA_CM_EVENT_ROUTE_RESOLVED, "resolving the route")?
                    .is_none()
                {
                    return Ok(None);
                }
                let res =
                    Resources::new(&self.ctx, &self.cq, &mut self.id, &mut self.ch, &self.opts)?;
                let res = self.res.insert(res);
                // A client on a shared receive queue offers no credits (see `srq.rs`).
                let flags = if res.pool.is_some() {
                    0
                } else {
                    res.credit = Some(CreditMr::new(&res.pd)?);
                    FLAG_CREDITS
                };
                let data = with_preamble(&self.opts.private_data, flags, &[]);
                res.set_ack_timeout(&self.opts)?;
                let rd = (res.limits.responder_resources, res.limits.initiator_depth);
                let mut param = res.conn_param(&data, &self.opts, rd);
                // SAFETY: live id with its QP; `param` points at `data`, alive for the call.
                if unsafe { sys::rdma_connect(res.id_raw(), &mut param) } != 0 {
                    return Err(cm_err("rdma_connect")(io::Error::last_os_error()));
                }
                self.stage = ClientStage::Connect;
            }
            ClientStage::Connect => {
                let Some(ev) = self.event(RDMA_CM_EVENT_ESTABLISHED, "connecting")? else {
                    return Ok(None);
                };
                let mut res = self.res.take().expect("made at the route");
                if res.pool.is_some() {
                    res.shorten_rnr_wait().map_err(cm_err("ibv_modify_qp"))?;
                }
                let (library_peer, peer_data) = parse_preamble(&ev.private_data);
                // Credits only if the server offers its word; otherwise plain RC, and the
                // block nobody will write goes (its registration with it).
                let credits = match parse_credit_ext(&ev.private_data) {
                    Some(peer) => res.credit.take().map(|c| (c, Some(peer))),
                    None => {
                        res.credit = None;
                        None
                    }
                };
                return Ok(Some(Established {
                    cq: self.cq.clone(),
                    res,
                    peer_data,
                    library_peer,
                    credits,
                }));
            }
        }
        Ok(None)
    }
}

impl Handshake for Connecting {
    fn step(&mut self, _: &Ready, setup: &Setup) -> Step {
        let turn = self.turn(setup.registration()).map_err(|e| {
            // A connect lists no devices once one was seen (`device_present`): a failure
            // before the peer was reached asks whether a device went away.
            if self.stage != ClientStage::Connect && !crate::verbs::devices_listed() {
                Error::NoDevice
            } else {
                e
            }
        });
        step(turn, setup, &self.opts, self.deadline)
    }
}
