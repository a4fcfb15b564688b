//! The public connection types, the same for every transport: [`Listener`], [`ConnRequest`],
//! [`Connection`] and their options.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::shm;

/// Most bytes of private data a connect, accept or reject may carry. The same on every
/// transport, so a program never depends on which one it runs over.
pub const PRIVATE_DATA_MAX: usize = 48;
/// Deepest send or receive queue a connection may ask for.
pub const QUEUE_DEPTH_MAX: u32 = 16384;
/// Largest inline send a connection may ask for.
pub const INLINE_MAX: u32 = 1024;

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
    /// Verbs, toward plain librdmacm peers: how often a send that found no receive posted is
    /// retried by the device (0..=7; 7 = without limit). Default 7. Between two peers using
    /// this library a send waits for the peer's receive in the library (receive credits), as
    /// over shm, and never meets a missing receive. When this side accepts, the device takes
    /// the value the connecting peer asked for instead (see the README). Ignored by shm.
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
        check_private_data(&self.private_data)
    }
}

/// The checks every transport makes before posting a send: only known flags.
pub(crate) fn check_send_flags(flags: SendFlags) -> Result<()> {
    if flags.0 & !SendFlags::ALL.0 != 0 {
        return Err(Error::invalid(format!("unknown send flags {:#x}", flags.0)));
    }
    Ok(())
}

/// The checks every transport makes on a region a work request names: it belongs to the
/// connection's context, the range lies inside it, and its length fits a completion. Returns
/// the start of the range.
pub(crate) fn check_region(
    mr: &MemoryRegion,
    ctx: &Arc<crate::domain::ContextInner>,
    offset: usize,
    len: usize,
) -> Result<*mut u8> {
    if !mr.same_context(ctx) {
        return Err(Error::invalid("memory region belongs to another context"));
    }
    if len > u32::MAX as usize {
        return Err(Error::invalid("message longer than 4 GiB - 1"));
    }
    mr.slice_ptr(offset, len)
}

/// The region checks of [`check_region`] for a receive, which also needs the library to be
/// allowed to write into the region.
pub(crate) fn check_recv_region(
    mr: &MemoryRegion,
    ctx: &Arc<crate::domain::ContextInner>,
    offset: usize,
    len: usize,
) -> Result<*mut u8> {
    let ptr = check_region(mr, ctx, offset, len)?;
    if !mr.access().contains(crate::mr::Access::LOCAL_WRITE) {
        return Err(Error::Access("receiving needs LOCAL_WRITE"));
    }
    Ok(ptr)
}

/// An inline send must fit the granted inline size.
pub(crate) fn check_inline(len: usize, max_inline: u32) -> Result<()> {
    if len > max_inline as usize {
        return Err(Error::invalid(format!(
            "inline send of {len} bytes over max_inline {max_inline}"
        )));
    }
    Ok(())
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

/// Flags of a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    /// Report a completion when the send finishes. Unsignaled sends report only failures.
    pub const SIGNALED: SendFlags = SendFlags(1);
    /// Every defined bit.
    pub const ALL: SendFlags = SendFlags(1);

    /// Whether the send is signaled.
    pub fn signaled(self) -> bool {
        self.0 & Self::SIGNALED.0 != 0
    }
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

/// Dispatches a call to the transport behind an object.
macro_rules! dispatch {
    ($self:expr, $imp:ident => $e:expr) => {
        match $self {
            Imp::Shm($imp) => $e,
            #[cfg(feature = "verbs")]
            Imp::Verbs($imp) => $e,
            #[cfg(not(feature = "verbs"))]
            Imp::Never(n, _) => match *n {},
        }
    };
}

#[derive(Debug)]
enum Imp<S, V> {
    Shm(S),
    #[cfg(feature = "verbs")]
    Verbs(V),
    #[cfg(not(feature = "verbs"))]
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<V>),
}

#[cfg(feature = "verbs")]
type VerbsListener = crate::verbs::Listener;
#[cfg(feature = "verbs")]
type VerbsRequest = crate::verbs::Request;
#[cfg(feature = "verbs")]
type VerbsConn = crate::verbs::Conn;
#[cfg(not(feature = "verbs"))]
type VerbsListener = ();
#[cfg(not(feature = "verbs"))]
type VerbsRequest = ();
#[cfg(not(feature = "verbs"))]
type VerbsConn = ();

/// A listening endpoint. Thread-safe.
#[derive(Debug)]
pub struct Listener {
    imp: Imp<shm::Listener, VerbsListener>,
}

impl Listener {
    pub(crate) fn from_shm(imp: shm::Listener) -> Self {
        Listener { imp: Imp::Shm(imp) }
    }

    #[cfg(feature = "verbs")]
    pub(crate) fn from_verbs(imp: crate::verbs::Listener) -> Self {
        Listener {
            imp: Imp::Verbs(imp),
        }
    }

    /// Takes the next connection request, waiting up to `timeout` (`None` = forever).
    /// [`Error::Timeout`] when none came in time.
    pub fn get_request(&self, timeout: Option<Duration>) -> Result<ConnRequest> {
        let deadline = timeout.map(|t| Instant::now() + t);
        self.take(deadline)?
            .ok_or(Error::Timeout("waiting for a connection request"))
    }

    /// Takes a connection request if a complete one is there, without waiting: `Ok(None)`
    /// when there is none yet. For event loops: call it when [`fd`](Self::fd) is readable, until
    /// it gives `None`. A request whose handshake has only partly arrived stays with the
    /// listener for a later call; it is never dropped for being early.
    pub fn try_get_request(&self) -> Result<Option<ConnRequest>> {
        self.take(Some(Instant::now()))
    }

    fn take(&self, deadline: Option<Instant>) -> Result<Option<ConnRequest>> {
        Ok(match &self.imp {
            Imp::Shm(l) => l
                .get_request(deadline)?
                .map(|r| ConnRequest { imp: Imp::Shm(r) }),
            #[cfg(feature = "verbs")]
            Imp::Verbs(l) => l
                .get_request(deadline)?
                .map(|r| ConnRequest { imp: Imp::Verbs(r) }),
            #[cfg(not(feature = "verbs"))]
            Imp::Never(n, _) => match *n {},
        })
    }

    /// A descriptor that is readable while a call to [`try_get_request`](Self::try_get_request)
    /// may make progress (level-triggered), for epoll/poll/select. A readable descriptor may
    /// still give no request (a handshake partly arrived, or a client turned away); a client
    /// that connects and says nothing never makes it readable. Owned by the listener; do not
    /// read it or close it.
    pub fn fd(&self) -> RawFd {
        match &self.imp {
            Imp::Shm(l) => l.fd(),
            #[cfg(feature = "verbs")]
            Imp::Verbs(l) => l.fd(),
            #[cfg(not(feature = "verbs"))]
            Imp::Never(n, _) => match *n {},
        }
    }
}

/// A peer's request to connect. Answer it with [`accept`](Self::accept) or
/// [`reject`](Self::reject); dropping it unanswered rejects it without private data.
#[derive(Debug)]
pub struct ConnRequest {
    imp: Imp<shm::Request, VerbsRequest>,
}

impl ConnRequest {
    /// The private data the peer sent with its request. (A plain librdmacm peer's private data
    /// arrives as the transport delivers it, which may be padded with zeros.)
    pub fn private_data(&self) -> &[u8] {
        match &self.imp {
            Imp::Shm(r) => r.private_data(),
            #[cfg(feature = "verbs")]
            Imp::Verbs(r) => r.private_data(),
            #[cfg(not(feature = "verbs"))]
            Imp::Never(n, _) => match *n {},
        }
    }

    /// Accepts the request; the connection's completions go to `cq`.
    pub fn accept(self, cq: &Arc<CompletionQueue>, opts: &ConnOptions) -> Result<Connection> {
        opts.validate()?;
        match self.imp {
            Imp::Shm(r) => Ok(Connection {
                imp: Imp::Shm(r.accept(cq.clone(), opts)?),
            }),
            #[cfg(feature = "verbs")]
            Imp::Verbs(r) => Ok(Connection {
                imp: Imp::Verbs(r.accept(cq.clone(), opts)?),
            }),
            #[cfg(not(feature = "verbs"))]
            Imp::Never(n, _) => match n {},
        }
    }

    /// Rejects the request, sending `private_data` (at most [`PRIVATE_DATA_MAX`] bytes).
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        check_private_data(private_data)?;
        match self.imp {
            Imp::Shm(r) => r.reject(private_data),
            #[cfg(feature = "verbs")]
            Imp::Verbs(r) => r.reject(private_data),
            #[cfg(not(feature = "verbs"))]
            Imp::Never(n, _) => match n {},
        }
    }
}

/// An established connection: reliable, in-order messages, like an RC queue pair.
///
/// Thread-safe: any thread may post at any time. Dropping it disconnects (if still connected),
/// completes every outstanding work request with [`crate::WcStatus::Flushed`], delivers a
/// [`crate::Opcode::Disconnected`] record, and releases everything, in bounded time.
#[derive(Debug)]
pub struct Connection {
    imp: Imp<shm::Conn, VerbsConn>,
}

impl Connection {
    pub(crate) fn from_shm(imp: shm::Conn) -> Self {
        Connection { imp: Imp::Shm(imp) }
    }

    #[cfg(feature = "verbs")]
    pub(crate) fn from_verbs(imp: crate::verbs::Conn) -> Self {
        Connection {
            imp: Imp::Verbs(imp),
        }
    }

    /// The connection's id, echoed in its completions.
    pub fn id(&self) -> u64 {
        self.info().id
    }

    /// What was granted.
    pub fn info(&self) -> ConnInfo {
        dispatch!(&self.imp, c => c.info())
    }

    /// The private data the peer sent when it accepted (client) or requested (server).
    pub fn private_data(&self) -> &[u8] {
        dispatch!(&self.imp, c => c.private_data())
    }

    /// Sends `len` bytes at `offset` of `mr`. The bytes must not change until the send
    /// completes. Fails with [`Error::QueueFull`] when the send queue is full.
    pub fn post_send(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
        flags: SendFlags,
    ) -> Result<()> {
        dispatch!(&self.imp, c => c.post_send(mr, offset, len, wr_id, flags))
    }

    /// Sends `data`, copied before this returns (at most the granted `max_inline` bytes).
    pub fn post_send_inline(&self, data: &[u8], wr_id: u64, flags: SendFlags) -> Result<()> {
        dispatch!(&self.imp, c => c.post_send_inline(data, wr_id, flags))
    }

    /// Posts a receive of up to `len` bytes into `mr` at `offset` (needs
    /// [`crate::Access::LOCAL_WRITE`]). Messages fill receives in the order they were posted.
    pub fn post_recv(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<()> {
        dispatch!(&self.imp, c => c.post_recv(mr, offset, len, wr_id))
    }

    /// Starts an orderly disconnect. Outstanding work completes (flushed), then a
    /// [`crate::Opcode::Disconnected`] record arrives on the completion queue. Idempotent.
    pub fn disconnect(&self) {
        dispatch!(&self.imp, c => c.disconnect())
    }
}
