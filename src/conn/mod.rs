//! The connection core, the same for every transport: the public types [`Listener`],
//! [`ConnRequest`], [`Connection`] and their options; the work requests and their checks
//! (`wr.rs`); how a connection ends (`end.rs`); and the seam a transport implements behind them ([`seam`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

mod end;
mod remote;
mod setup;
mod srq;
mod wr;

pub(crate) use end::{
    End, Unfinished, admit_recv, admit_send, ensure_up, flush_outstanding, socket_error,
};
pub use remote::{REMOTE_DESC_LEN, RemoteRegion, SGE_MAX};
#[cfg(feature = "fuzzing")]
pub(crate) use remote::{pack as pack_remote, unpack as unpack_remote};
pub(crate) use setup::{Handshake, Setup, Started, Step};
#[allow(unused_imports)] // the transports that take receives from a pool name them
pub(crate) use srq::{PoolDevice, PooledRecv, SrqInner, Waiter};
pub use srq::{SharedRecvQueue, SrqOptions};
#[allow(unused_imports)] // the transports' one-sided paths name it
pub(crate) use wr::{LocalSeg, OneOp, Payload, RdmaOp, RdmaRequest, RecvRequest, SendRequest};
pub use wr::{SendFlags, Sge};

use crate::cq::CompletionQueue;
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::log::log;
use crate::mr::{Access, MemoryRegion};
use seam::{ConnSeam, ListenerSeam, RequestSeam};

/// Most bytes of private data a connect, accept or reject may carry. The same on every
/// transport, so a program never depends on which one it runs over.
pub const PRIVATE_DATA_MAX: usize = 48;
/// Deepest send or receive queue a connection may ask for.
pub const QUEUE_DEPTH_MAX: u32 = 16384;
/// Largest inline send a connection may ask for.
pub const INLINE_MAX: u32 = 1024;
/// Smallest [`ConnOptions::shm_ring_size`] (besides 0, the default).
pub const SHM_RING_MIN: u32 = 16 * 1024;
/// Largest [`ConnOptions::shm_ring_size`].
pub const SHM_RING_MAX: u32 = 1 << 30;
/// The ring size of a shm connection when neither side asks for one.
pub const SHM_RING_DEFAULT: u32 = 32 * 1024;

/// Whether `size` is a ring size a connection may ask for (besides 0, none).
pub(crate) fn shm_ring_size_allowed(size: u32) -> bool {
    (SHM_RING_MIN..=SHM_RING_MAX).contains(&size) && size % 4096 == 0
}

static NEXT_CONN_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_conn_id() -> u64 {
    NEXT_CONN_ID.fetch_add(1, Ordering::Relaxed)
}

/// Settings of one connection, for [`crate::Context::connect`] and [`ConnRequest::accept`].
#[derive(Debug, Clone)]
pub struct ConnOptions {
    /// Most sends outstanding at once (posted, not yet completed). Default 128.
    pub send_queue_depth: u32,
    /// Most receives outstanding at once. Default 128.
    pub recv_queue_depth: u32,
    /// Largest send that may be posted inline (copied at post time). Default 64.
    pub max_inline: u32,
    /// How long the call may wait for the peer. Connect: establishment in all (address and
    /// route resolution, the handshake). Accept: over verbs, the wait for the peer to confirm
    /// (shm does not wait for the peer). `None` waits forever; zero is invalid. Default 5 s.
    pub timeout: Option<Duration>,
    /// Private data for the peer (at most [`PRIVATE_DATA_MAX`] bytes).
    pub private_data: Vec<u8>,
    /// Echoed in every completion of the connection.
    pub context: usize,
    /// Verbs: how often the device resends a packet the peer did not acknowledge before the
    /// connection fails (0..=7). Default 6: some devices (soft-RoCE) read 7 as "forever",
    /// which would leave a lost peer unnoticed. Ignored by shm.
    pub retry_count: u8,
    /// Verbs, toward plain librdmacm peers and toward a peer whose connection takes its
    /// receives from a shared receive queue: how often a send that found no receive posted is
    /// retried by the device (0..=7; 7 = without limit). Default 7. Between two peers using
    /// this library a send waits for the peer's receive in the library (receive credits; over
    /// shm a message waits in the ring) and never meets a missing receive. When this side
    /// accepts, the device takes the value the connecting peer asked for instead (see
    /// docs/transports.md, "Verbs"). Ignored by shm.
    pub rnr_retry_count: u8,
    /// Verbs: how long the device waits for an acknowledgement before resending, as the
    /// exponent `t` of 4.096 µs × 2^t (0..=31). Default 16 (about 0.27 s). With `retry_count`
    /// it bounds how long a lost peer takes to notice: about (retry_count + 1) × that time.
    /// Ignored by shm.
    pub ack_timeout: u8,
    /// Verbs: how long a connection to a library peer may sit with no send outstanding before
    /// the library sends a keepalive (a zero-length RDMA write, which touches no memory), so
    /// that a peer whose host or link is gone is noticed on an idle connection too; `None`
    /// sends none. 1 ms..=1 h. Default 1 s. Ignored by shm (a vanished shm peer is noticed at
    /// once) and toward plain peers.
    pub keepalive: Option<Duration>,
    /// Shared memory: bytes of each of the connection's two rings (one per direction), in which
    /// messages wait for their receives. The larger of the two sides' values holds; 0 on both
    /// gives [`SHM_RING_DEFAULT`] (32 KiB). 0, or a multiple of 4096 in
    /// [`SHM_RING_MIN`]..=[`SHM_RING_MAX`]. When the peer may read this process's memory (see
    /// docs/transports.md), a message of at least 1 KiB from a region the library allocated,
    /// or of at least 256 KiB from other memory, takes only a 48-byte record of it: the
    /// receiver copies the bytes from where they are. A larger ring lets more of the other
    /// messages wait in it before sends wait for room in the sender's library, at that much
    /// memory per connection. Ignored by verbs.
    pub shm_ring_size: u32,
    /// The pool the connection takes its receives from, instead of receives posted to it
    /// (see [`SharedRecvQueue`]); of the same context. `recv_queue_depth` is then unused.
    pub srq: Option<SharedRecvQueue>,
}

impl Default for ConnOptions {
    fn default() -> Self {
        ConnOptions {
            send_queue_depth: 128,
            recv_queue_depth: 128,
            max_inline: 64,
            timeout: Some(Duration::from_secs(5)),
            private_data: Vec::new(),
            context: 0,
            retry_count: 6,
            rnr_retry_count: 7,
            ack_timeout: 16,
            keepalive: Some(Duration::from_secs(1)),
            shm_ring_size: 0,
            srq: None,
        }
    }
}

impl ConnOptions {
    /// Checks every field; the error says which one is wrong.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("send", self.send_queue_depth),
            ("receive", self.recv_queue_depth),
        ] {
            if v == 0 || v > QUEUE_DEPTH_MAX {
                return Err(Error::invalid(format!(
                    "{name} queue depth {v} not in 1..={QUEUE_DEPTH_MAX}"
                )));
            }
        }
        if self.retry_count > 7 || self.rnr_retry_count > 7 {
            return Err(Error::invalid("retry counts go from 0 to 7"));
        }
        if self.ack_timeout > 31 {
            return Err(Error::invalid("ack_timeout goes from 0 to 31"));
        }
        if self.timeout == Some(Duration::ZERO) {
            return Err(Error::invalid(
                "timeout 0 leaves no time for the peer: use a positive timeout, or none",
            ));
        }
        if let Some(k) = self.keepalive
            && !(Duration::from_millis(1)..=Duration::from_secs(3600)).contains(&k)
        {
            return Err(Error::invalid(format!("keepalive {k:?} not in 1 ms..=1 h")));
        }
        if self.max_inline > INLINE_MAX {
            return Err(Error::invalid(format!(
                "max_inline {} over {INLINE_MAX}",
                self.max_inline
            )));
        }
        let ring = self.shm_ring_size;
        if ring != 0 && !shm_ring_size_allowed(ring) {
            return Err(Error::invalid(format!(
                "shm_ring_size {ring} is not 0 or a multiple of 4096 in {SHM_RING_MIN}..={SHM_RING_MAX}"
            )));
        }
        check_private_data(&self.private_data)
    }
}

pub(crate) fn check_private_data(data: &[u8]) -> Result<()> {
    check_private_data_len(data.len())
}

/// The private-data limit, on a length alone: the C surface checks it before it reads a byte.
pub(crate) fn check_private_data_len(len: usize) -> Result<()> {
    if len > PRIVATE_DATA_MAX {
        return Err(Error::invalid(format!(
            "private data of {len} bytes over {PRIVATE_DATA_MAX} (RBR_PRIVATE_DATA_MAX)"
        )));
    }
    Ok(())
}

/// What was granted to a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnInfo {
    /// The connection's id, echoed in its completions.
    pub id: u64,
    /// Granted send queue depth.
    pub send_queue_depth: u32,
    /// Granted receive queue depth.
    pub recv_queue_depth: u32,
    /// Granted inline size.
    pub max_inline: u32,
    /// Shared memory: bytes of each of its rings (see [`ConnOptions::shm_ring_size`]); 0 over
    /// verbs.
    pub shm_ring_size: u32,
    /// Which transport carries it.
    pub transport: Transport,
}

/// A transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// Shared memory between processes on one host.
    Shm,
    /// RDMA verbs.
    Verbs,
}

/// A listening endpoint. Thread-safe.
#[derive(Debug)]
pub struct Listener {
    imp: Box<dyn ListenerSeam>,
}

impl Listener {
    pub(crate) fn new(imp: impl ListenerSeam + 'static) -> Self {
        Listener { imp: Box::new(imp) }
    }

    /// Takes the next connection request, waiting up to `timeout` (`None` = forever).
    /// [`Error::Timeout`] when none came in time.
    pub fn get_request(&self, timeout: Option<Duration>) -> Result<ConnRequest> {
        let deadline = timeout.map(|t| Instant::now() + t);
        self.imp
            .take(deadline)?
            .ok_or(Error::Timeout("waiting for a connection request"))
    }

    /// Takes a connection request if a complete one is there, without waiting: `Ok(None)`
    /// when there is none yet. For event loops: call it when [`fd`](Self::fd) is readable, until
    /// it gives `None`. A request whose handshake has only partly arrived stays with the
    /// listener for a later call; it is never dropped for being early.
    pub fn try_get_request(&self) -> Result<Option<ConnRequest>> {
        self.imp.take(Some(Instant::now()))
    }

    /// A descriptor for epoll, poll, select, mio or tokio's `AsyncFd` (also through [`AsFd`]
    /// and [`AsRawFd`]). Level-triggered, it is readable while a call to
    /// [`try_get_request`](Self::try_get_request) may make progress; edge-triggered, once a
    /// call has returned `Ok(None)`, whatever arrives next makes a new edge - so call it until
    /// `Ok(None)`, then wait. A readable descriptor may still give no request (a handshake
    /// partly arrived, or a client turned away); a client that connects and says nothing never
    /// makes it readable. Owned by the listener; do not read it or close it.
    pub fn fd(&self) -> RawFd {
        self.imp.fd()
    }
}

impl AsFd for Listener {
    /// [`Listener::fd`], borrowed for as long as the listener lives.
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor is owned by the listener and closed only when it drops, which
        // the borrow of `self` rules out for the lifetime returned.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl AsRawFd for Listener {
    /// [`Listener::fd`].
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

/// A peer's request to connect. Answer it with [`accept`](Self::accept) or
/// [`reject`](Self::reject); dropping it unanswered rejects it without private data.
#[derive(Debug)]
pub struct ConnRequest {
    imp: Box<dyn RequestSeam>,
}

impl ConnRequest {
    pub(crate) fn new(imp: impl RequestSeam + 'static) -> Self {
        ConnRequest { imp: Box::new(imp) }
    }

    /// The private data the peer sent with its request. (A plain librdmacm peer's private data
    /// arrives as the transport delivers it, which may be padded with zeros.)
    pub fn private_data(&self) -> &[u8] {
        self.imp.private_data()
    }

    /// Accepts the request; the connection's completions go to `cq`. Returns once the
    /// connection is established (over verbs: when the peer confirmed), or failed.
    pub fn accept(self, cq: &Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Connection> {
        let peer = self.imp.peer();
        let r = self
            .start(cq, opts, false)
            .and_then(Connection::established_now);
        match &r {
            Ok(c) => log!(
                Info,
                "connection {} from {peer} accepted ({:?})",
                c.id(),
                c.info().transport
            ),
            Err(e) => log!(Warn, "accepting a connection from {peer} failed: {e}"),
        }
        r
    }

    /// Accepts the request without waiting: returns at once with the connection connecting.
    /// Its establishment (over verbs: the peer's confirmation), or its failure, arrives as an
    /// [`crate::Opcode::Connected`] record on `cq`; see [`Connection::established`].
    pub fn accept_start(self, cq: &Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Connection> {
        self.start(cq, opts, true)
    }

    fn start(
        self,
        cq: &Arc<CompletionQueue>,
        opts: &ConnOptions,
        records: bool,
    ) -> Result<Connection> {
        opts.validate()?;
        let ctx = self.imp.context().clone();
        let setup = Setup::new(
            &ctx,
            cq,
            opts,
            self.imp.transport(),
            self.imp.peer(),
            records,
        )?;
        let started = self.imp.start(cq.clone(), opts)?;
        Connection::start(setup, started)
    }

    /// Rejects the request, sending `private_data` (at most [`PRIVATE_DATA_MAX`] bytes).
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        check_private_data(private_data)?;
        let peer = self.imp.peer();
        let r = self.imp.reject(private_data);
        match &r {
            Ok(()) => log!(Info, "request from {peer} rejected"),
            Err(e) => log!(Warn, "rejecting the request from {peer} failed: {e}"),
        }
        r
    }
}

/// A connection: reliable, in-order messages, like an RC queue pair.
///
/// Made established by [`crate::Context::connect`] and [`ConnRequest::accept`], or connecting
/// by [`crate::Context::connect_start`] and [`ConnRequest::accept_start`] (see
/// [`established`](Self::established)): while it connects, receives may be posted (they are
/// posted in order once it is up) and every other post fails with [`Error::State`].
///
/// Thread-safe: any thread may post at any time. Dropping it disconnects (if still connected),
/// completes every outstanding work request with [`crate::WcStatus::Flushed`], delivers a
/// [`crate::Opcode::Disconnected`] record, and releases everything, in bounded time. Dropped
/// while connecting, it ends the handshake (and reports nothing more).
#[derive(Debug)]
pub struct Connection {
    /// The transport's half, set once the connection is up (at once for one made by a
    /// blocking call).
    up: OnceLock<Up>,
    /// The set-up the connection came out of, shared with its handshake.
    setup: Arc<Setup>,
    ctx: Arc<ContextInner>,
}

/// An established connection's transport half, with what the transport granted: fixed for the
/// connection's life, kept here so that a post checks against them without calls through the
/// seam.
#[derive(Debug)]
struct Up {
    imp: Box<dyn ConnSeam>,
    info: ConnInfo,
    /// What the transport said of [`ConnSeam::writes_directly`].
    writes_directly: bool,
}

impl Connection {
    /// A connection over `setup`, whose handshake `started` is, running it.
    pub(crate) fn start(setup: Arc<Setup>, started: Started) -> Result<Connection> {
        setup.run(started)?;
        Ok(Connection {
            up: OnceLock::new(),
            ctx: setup.context().clone(),
            setup,
        })
    }

    /// The established connection (for the blocking calls): waits for the handshake.
    pub(crate) fn established_now(self) -> Result<Connection> {
        self.setup.wait()?;
        self.up()?;
        Ok(self)
    }

    /// The transport's half: `Err` while connecting ([`Error::State`]) or once the set-up
    /// failed.
    #[inline(always)]
    fn up(&self) -> Result<&Up> {
        match self.up.get() {
            Some(up) => Ok(up),
            None => self.take_up(),
        }
    }

    #[cold]
    fn take_up(&self) -> Result<&Up> {
        // Installed under the set-up's lock: a thread that finds the half given out already
        // finds it here.
        self.setup
            .hand_over(|imp| {
                let _ = self.up.set(Up {
                    info: imp.info(),
                    writes_directly: imp.writes_directly(),
                    imp,
                });
            })
            .map_err(|_| Error::Disconnected)?;
        self.up
            .get()
            .ok_or(Error::State("the connection is not established yet"))
    }

    /// Whether the connection is established: `Ok(true)` once it is, `Ok(false)` while it
    /// connects, or the error its set-up failed with - the one the blocking call
    /// ([`crate::Context::connect`], [`ConnRequest::accept`]) returns: [`Error::Refused`],
    /// [`Error::Rejected`] with the listener's private data, [`Error::Timeout`], ... Stays
    /// `Ok(true)` after the connection goes down (the queue's
    /// [`crate::Opcode::Disconnected`] record says that).
    pub fn established(&self) -> Result<bool> {
        if self.up.get().is_some() {
            return Ok(true);
        }
        self.setup.status()
    }

    /// [`established`](Self::established) for a runtime: `Ready` with the outcome, or
    /// `Pending` with `cx`'s waker woken once there is one. For wrapping in a future; the
    /// `tokio` feature's `connect` does.
    pub fn poll_established(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<()>> {
        if self.up.get().is_some() {
            return std::task::Poll::Ready(Ok(()));
        }
        self.setup.poll(cx.waker())
    }

    /// The connection's id, echoed in its completions.
    #[inline]
    pub fn id(&self) -> u64 {
        self.setup.id()
    }

    /// What was granted; while connecting, only the id and transport (the rest zero).
    #[inline]
    pub fn info(&self) -> ConnInfo {
        match self.up() {
            Ok(up) => up.info,
            Err(_) => ConnInfo {
                id: self.id(),
                send_queue_depth: 0,
                recv_queue_depth: 0,
                max_inline: 0,
                shm_ring_size: 0,
                transport: self.setup.transport(),
            },
        }
    }

    /// The private data the peer sent when it accepted (client) or requested (server).
    /// While connecting: none; after a rejection, the listener's private data.
    pub fn private_data(&self) -> &[u8] {
        match self.up() {
            Ok(up) => up.imp.private_data(),
            Err(_) => self.setup.reject_data(),
        }
    }

    /// Sends `len` bytes at `offset` of `mr`. The bytes must not change until the send
    /// completes. Fails with [`Error::QueueFull`] when the send queue is full.
    #[inline]
    pub fn post_send(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        let up = self.up()?;
        let wr = SendRequest::region(&self.ctx, mr, offset, len, wr_id, flags)?;
        up.imp.send(wr)
    }

    /// Sends `data`, copied before this returns (at most the granted `max_inline` bytes).
    #[inline]
    pub fn post_send_inline(&self, data: &[u8], wr_id: u64, flags: SendFlags) -> Result<()> {
        let up = self.up()?;
        let wr = SendRequest::inline(data, up.info.max_inline, wr_id, flags)?;
        up.imp.send(wr)
    }

    /// Posts a receive of up to `len` bytes into `mr` at `offset` (needs
    /// [`crate::Access::LOCAL_WRITE`]). Messages fill receives in the order they were posted.
    /// A connection created with a [`SharedRecvQueue`] takes its receives from there, and
    /// this fails with [`Error::InvalidArgument`].
    #[inline]
    pub fn post_recv(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<()> {
        if self.setup.pooled() {
            return Err(Error::invalid(
                "the connection takes its receives from its shared receive queue: post them there",
            ));
        }
        let wr = RecvRequest::new(&self.ctx, mr, offset, len, wr_id)?;
        match self.up.get() {
            Some(up) => up.imp.recv(wr),
            None => self.recv_connecting(wr),
        }
    }

    /// Lets the peer reach `mr` with one-sided operations over this connection, as far as the
    /// region's remote access bits allow, and returns the descriptor to send it (in a message,
    /// in private data, or in the program's own format: the layout is fixed, see
    /// [`REMOTE_DESC_LEN`]). The peer unpacks it with [`Connection::unpack_remote`]. The
    /// region stays reachable until it is dropped (and the connection lives).
    ///
    /// Over shm a region allocated by the library ([`crate::Context::alloc_mr`]) is mapped by
    /// the peer, which then reads, writes and runs atomics on it with no system call; caller
    /// memory is reached with `process_vm_readv`/`process_vm_writev` where the kernel lets the
    /// peer do so, and otherwise this fails with [`Error::Unsupported`], as it does for caller
    /// memory with [`crate::Access::REMOTE_ATOMIC`] (atomics need the shared mapping). Over
    /// shm at most 256 regions may be reachable through one connection at once
    /// ([`Error::InvalidArgument`] beyond that, until some are dropped), counting up to 64
    /// allocated regions that messages of 1 KiB or more were sent from (the peer copies
    /// those out of its mapping of the region); dropping a region waits for the peer's
    /// accesses to it in progress (a bounded time).
    pub fn pack_region(&self, mr: &Arc<MemoryRegion>) -> Result<[u8; REMOTE_DESC_LEN]> {
        if !mr.same_context(&self.ctx) {
            return Err(Error::invalid("memory region belongs to another context"));
        }
        let remote =
            Access(Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0);
        if mr.access().0 & remote.0 == 0 {
            return Err(Error::Access(
                "the region allows no remote access (REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC)",
            ));
        }
        let key = self.up()?.imp.expose(mr)?;
        Ok(remote::pack(
            self.info().transport,
            mr.access(),
            mr.as_ptr() as u64,
            mr.len() as u64,
            key,
        ))
    }

    /// Unpacks a descriptor the peer packed with [`Connection::pack_region`], for use on this
    /// connection. Only its form is checked here; every access is checked against what the
    /// peer registered when it runs.
    pub fn unpack_remote(&self, desc: &[u8]) -> Result<RemoteRegion> {
        let info = self.info();
        remote::unpack(desc, info.transport, info.id)
    }

    /// A remote region from its raw fields, for peers that send address, key and length in
    /// their own format (over verbs the key is the region's rkey, as a plain librdmacm peer
    /// gives it).
    pub fn remote_from_raw(&self, addr: u64, len: u64, key: u64) -> Result<RemoteRegion> {
        remote::from_raw(addr, len, key, self.id())
    }

    /// Writes the local segments, in order, into the peer's memory at `remote_offset` of
    /// `remote` (which needs REMOTE_WRITE). The local bytes must not change until the write
    /// completes. On completion the bytes are in the peer's memory; the peer sees them for
    /// certain once it has a later message or write-with-immediate of this connection.
    pub fn post_write(
        &self,
        local: &[Sge<'_>],
        remote: &RemoteRegion,
        remote_offset: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        let op = RdmaOp::Write { imm: None };
        if let [one] = local {
            if flags == SendFlags(0) && self.write_direct(one, remote, remote_offset) {
                return Ok(());
            }
            if let Some(r) = self.rdma_single(op, one, remote, remote_offset, wr_id, flags) {
                return r;
            }
        }
        self.transfer(
            op,
            local.iter().copied(),
            remote,
            remote_offset,
            wr_id,
            flags,
        )
    }

    /// As [`Connection::post_write`], then consumes a receive posted at the peer, whose
    /// completion ([`crate::Opcode::RecvWriteImm`]) carries `imm` and the length written, and
    /// comes after the bytes are in place. Like a send, it waits for the peer's receive.
    pub fn post_write_imm(
        &self,
        local: &[Sge<'_>],
        remote: &RemoteRegion,
        remote_offset: u64,
        imm: u32,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        let op = RdmaOp::Write { imm: Some(imm) };
        self.transfer(
            op,
            local.iter().copied(),
            remote,
            remote_offset,
            wr_id,
            flags,
        )
    }

    /// Reads the peer's bytes at `remote_offset` of `remote` (which needs REMOTE_READ) into the
    /// local segments (which need LOCAL_WRITE), in order.
    pub fn post_read(
        &self,
        local: &[Sge<'_>],
        remote: &RemoteRegion,
        remote_offset: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        if let [one] = local {
            if let Some(r) =
                self.rdma_single(RdmaOp::Read, one, remote, remote_offset, wr_id, flags)
            {
                return r;
            }
        }
        let local = local.iter().copied();
        self.transfer(RdmaOp::Read, local, remote, remote_offset, wr_id, flags)
    }

    /// Atomically adds `add` to the peer's 8-byte word at `remote_offset` of `remote` (8-byte
    /// aligned, REMOTE_ATOMIC); the word as it was lands at `local_offset` of `local` (8-byte
    /// aligned, LOCAL_WRITE), in host byte order.
    #[allow(clippy::too_many_arguments)]
    pub fn post_fetch_add(
        &self,
        local: &Arc<MemoryRegion>,
        local_offset: usize,
        remote: &RemoteRegion,
        remote_offset: u64,
        add: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        let op = RdmaOp::FetchAdd { add };
        self.atomic(op, local, local_offset, remote, remote_offset, wr_id, flags)
    }

    /// Atomically stores `swap` in the peer's 8-byte word at `remote_offset` of `remote` if the
    /// word equals `compare`; the word as it was lands at `local_offset` of `local` (as for
    /// [`Connection::post_fetch_add`]). The swap happened when that value equals `compare`.
    #[allow(clippy::too_many_arguments)]
    pub fn post_cmp_swap(
        &self,
        local: &Arc<MemoryRegion>,
        local_offset: usize,
        remote: &RemoteRegion,
        remote_offset: u64,
        compare: u64,
        swap: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        let op = RdmaOp::CmpSwap { compare, swap };
        self.atomic(op, local, local_offset, remote, remote_offset, wr_id, flags)
    }

    /// Posts a write or read of the local segments `local`.
    pub(crate) fn transfer<'a>(
        &self,
        op: RdmaOp,
        local: impl ExactSizeIterator<Item = Sge<'a>>,
        remote: &RemoteRegion,
        remote_offset: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        let up = self.up()?;
        let wr = RdmaRequest::transfer(
            &self.ctx,
            up.info.id,
            op,
            local,
            remote,
            remote_offset,
            wr_id,
            flags,
        )?;
        up.imp.rdma(&wr)
    }

    /// The unsignaled write (no immediate) of the one local segment `local` that the transport
    /// finishes at once on the caller's thread ([`ConnSeam::write_direct`]): true when it did,
    /// false having done nothing (a failed check included: the caller then posts it another
    /// way, which reports). Nothing on its way can panic, so the C surface runs it ahead of its
    /// catch of panics.
    #[inline(always)]
    #[deny(
        clippy::panic,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing
    )]
    pub(crate) fn write_direct(&self, local: &Sge<'_>, remote: &RemoteRegion, offset: u64) -> bool {
        let Some(up) = self.up.get() else {
            return false;
        };
        if !up.writes_directly {
            return false;
        }
        let op = RdmaOp::Write { imm: None };
        match wr::check_single(
            &self.ctx,
            up.info.id,
            op,
            local,
            remote,
            offset,
            SendFlags(0),
        ) {
            // SAFETY: `check_single` found `ptr..ptr + len` inside `local.mr`, which the caller
            // holds through the call.
            Some((ptr, len, addr)) => unsafe { up.imp.write_direct(ptr, len, remote.key, addr) },
            None => false,
        }
    }

    /// Posts the write (without immediate) or read `op` of the one local segment `local` the
    /// short way ([`ConnSeam::rdma_single`]: the common small operation, with no request for
    /// four segments built and walked; the callers of an unsignaled write try
    /// [`write_direct`](Self::write_direct) first): `Some` with the outcome. `None` having
    /// done nothing when a check fails or `op` is another operation: the caller then posts it
    /// through [`Connection::transfer`], which reports the error.
    #[inline(always)]
    pub(crate) fn rdma_single(
        &self,
        op: RdmaOp,
        local: &Sge<'_>,
        remote: &RemoteRegion,
        offset: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Option<Result<()>> {
        let up = self.up.get()?;
        let (ptr, len, addr) =
            wr::check_single(&self.ctx, up.info.id, op, local, remote, offset, flags)?;
        let one = OneOp {
            op,
            mr: local.mr,
            ptr,
            len,
            key: remote.key,
            remote_addr: addr,
            wr_id,
            signaled: flags.signaled(),
        };
        // SAFETY: `check_single` found `ptr..ptr + len` inside `local.mr`, which the caller
        // holds through the call.
        Some(unsafe { up.imp.rdma_single(&one) })
    }

    /// Posts an atomic.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn atomic(
        &self,
        op: RdmaOp,
        local: &Arc<MemoryRegion>,
        local_offset: usize,
        remote: &RemoteRegion,
        remote_offset: u64,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        let up = self.up()?;
        let wr = RdmaRequest::atomic(
            &self.ctx,
            up.info.id,
            op,
            local,
            local_offset,
            remote,
            remote_offset,
            wr_id,
            flags,
        )?;
        up.imp.rdma(&wr)
    }

    /// The context it belongs to.
    pub(crate) fn context_inner(&self) -> &Arc<ContextInner> {
        &self.ctx
    }

    /// Starts an orderly disconnect. Outstanding work completes (flushed), then a
    /// [`crate::Opcode::Disconnected`] record arrives on the completion queue. Idempotent.
    pub fn disconnect(&self) {
        match self.up() {
            Ok(up) => up.imp.disconnect(),
            // Ends the handshake; a connection that never came up reports no disconnect.
            Err(_) => self.setup.cancel(),
        }
    }

    /// Holds a receive posted while connecting, or posts it if the connection came up.
    #[cold]
    fn recv_connecting(&self, wr: RecvRequest<'_>) -> Result<()> {
        let depth = self.setup.recv_depth();
        if self
            .setup
            .hold_recv(wr.mr, wr.offset, wr.len, wr.wr_id, depth)?
        {
            return Ok(());
        }
        self.up()?.imp.recv(wr)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if self.up.get().is_none() {
            // Not yet taken: the handshake ends, or the half it brought up is torn down here.
            drop(self.setup.abandon());
        }
    }
}

/// What a transport provides behind the public types: the narrow seam the library's
/// connection core calls through, so that no method repeats a branch per transport.
pub(crate) mod seam {
    use super::*;

    /// A transport's listener.
    pub(crate) trait ListenerSeam: Send + Sync + std::fmt::Debug {
        /// The next complete request, waiting until `deadline` (`None`: forever); `Ok(None)`
        /// when none came by then.
        fn take(&self, deadline: Option<Instant>) -> Result<Option<ConnRequest>>;
        /// The listener's pollable descriptor.
        fn fd(&self) -> RawFd;
    }

    /// A transport's unanswered connection request. Dropping it rejects it.
    pub(crate) trait RequestSeam: Send + Sync + std::fmt::Debug {
        fn private_data(&self) -> &[u8];
        /// Who asked, for messages: an address, or a process on this host.
        fn peer(&self) -> String;
        /// The context of the listener it came to.
        fn context(&self) -> &Arc<ContextInner>;
        /// Which transport the connection will be over.
        fn transport(&self) -> Transport;
        /// Answers the request with an accept: the handshake that brings the connection up
        /// (`opts` were validated).
        fn start(self: Box<Self>, cq: Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Started>;
        /// `private_data` was checked against [`PRIVATE_DATA_MAX`].
        fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()>;
    }

    /// A transport's connection. Dropping it tears the connection down.
    pub(crate) trait ConnSeam: Send + Sync + std::fmt::Debug {
        fn info(&self) -> ConnInfo;
        fn private_data(&self) -> &[u8];
        /// Posts a send that passed the core's checks ([`wr`]).
        fn send(&self, wr: SendRequest<'_>) -> Result<()>;
        /// Posts a receive that passed the core's checks ([`wr`]).
        fn recv(&self, wr: RecvRequest<'_>) -> Result<()>;
        /// The connection is up and its [`crate::Opcode::Connected`] record (if it reports one) is on
        /// its queue: its completions may follow from now on, never before. Called once,
        /// before the receives held while it connected are posted.
        fn connected(&self);
        /// Lets the peer reach `mr` (which has remote access bits and belongs to the
        /// connection's context) with one-sided operations; returns the key its accesses
        /// carry. Calling it again for the same region returns the same key.
        fn expose(&self, mr: &Arc<MemoryRegion>) -> Result<u64>;
        /// Posts a one-sided operation that passed the core's checks ([`wr`]).
        fn rdma(&self, wr: &RdmaRequest<'_>) -> Result<()>;
        /// Posts the checked write or read `one` ([`wr::check_single`]) as
        /// [`rdma`](Self::rdma) posts [`one.request()`](OneOp::request) (and reporting what it
        /// would), the short way where the transport has one.
        ///
        /// # Safety
        /// `one.ptr` is valid for `one.len` bytes inside `one.mr` through the call.
        unsafe fn rdma_single(&self, one: &OneOp<'_>) -> Result<()>;
        /// Whether the transport finishes some unsignaled writes at once on the caller's thread
        /// ([`write_direct`](Self::write_direct)); asked once, when the [`Connection`] is made.
        /// A transport that posts every write to a device says no (the default).
        fn writes_directly(&self) -> bool {
            false
        }
        /// An unsignaled write of `len` bytes at `src` to the peer's address `remote_addr` of
        /// the region with `key` (checked by [`wr::check_single`]), finished at once on the
        /// caller's thread with nothing to report (shm: a copy into a region published on the
        /// connection): true when it was; false having done nothing (the caller then posts it
        /// through [`rdma_single`](Self::rdma_single), which reports). Called only when
        /// [`writes_directly`](Self::writes_directly) said yes. Its arguments are in registers
        /// (the common small write), and nothing on its way may panic: the C surface calls it
        /// ahead of its catch of panics.
        ///
        /// # Safety
        /// `src` is readable for `len` bytes through the call.
        unsafe fn write_direct(
            &self,
            src: *const u8,
            len: usize,
            key: u64,
            remote_addr: u64,
        ) -> bool {
            let _ = (src, len, key, remote_addr);
            false
        }
        fn disconnect(&self);
    }
}
