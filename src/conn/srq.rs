//! Shared receive queues: one pool of receives for many connections, so that a server's
//! receive memory follows its traffic rather than the number of its peers (as a verbs SRQ,
//! a libfabric shared receive context). A connection created with a pool in its options takes
//! each message's receive from the pool, in the order the receives were posted there, and
//! reports the receive's completion on its own queue, naming itself.
//!
//! A message that arrives while the pool is empty waits for it, as a message waits for a
//! connection's own receive: its connection becomes a waiter of the pool, and the post that
//! refills the pool hands the new receives to the waiters on the poster's thread, as a post of
//! a connection's own receive takes a message that waited for it.
//!
//! Locks: a connection takes the pool's lock under its own (to take a receive, or to wait);
//! a post takes the pool's lock alone, and calls the waiters with no lock held.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use super::{QUEUE_DEPTH_MAX, RecvRequest};
use crate::cq::{Completion, CompletionQueue, Opcode, WcStatus};
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::sync::SpinLock;

/// Settings of a [`SharedRecvQueue`], for [`crate::Context::shared_recv_queue`].
#[derive(Debug, Clone)]
pub struct SrqOptions {
    /// Most receives the pool holds at once (1..=16384). Default 1024.
    pub depth: u32,
    /// Where the pool's own events go (its limit, see [`SharedRecvQueue::set_limit`]); `None`
    /// for no events.
    pub cq: Option<Arc<CompletionQueue>>,
    /// Echoed as the `context` of the pool's events.
    pub context: usize,
}

impl Default for SrqOptions {
    fn default() -> Self {
        SrqOptions {
            depth: 1024,
            cq: None,
            context: 0,
        }
    }
}

/// A pool of receives that many connections take their messages' receives from. Create it
/// with [`crate::Context::shared_recv_queue`], name it in [`crate::ConnOptions::srq`] when
/// connecting or accepting, and post receives to it with [`post_recv`](Self::post_recv)
/// instead of to the connections (whose own [`crate::Connection::post_recv`] then fails with
/// [`Error::InvalidArgument`]).
///
/// A message on any of the connections takes the oldest receive of the pool; its completion
/// ([`Opcode::Recv`], or [`Opcode::RecvWriteImm`]) arrives on that connection's queue with the
/// connection's id and context. A peer's send waits while the pool is empty and is taken when
/// a receive is posted: it never fails for it (over shm in the connection's ring, taken by the
/// post; over verbs in the peer's device, which sends it again every 0.64 ms until the pool has
/// a receive - receiver-not-ready, with the peer's `rnr_retry_count`: 7, the default, retries
/// without limit). When a connection ends, a receive it had taken from the pool for a message
/// not yet whole completes [`WcStatus::Flushed`] on its queue; the pool's other receives stay
/// in the pool. Receives still in the pool when the pool goes (the last clone and the last
/// connection using it are dropped) complete nowhere: their regions are let go then.
///
/// Over verbs the pool is a shared receive queue of the device (`ibv_srq`), for connections on
/// one device; one pool for shm and verbs connections both is refused with
/// [`Error::Unsupported`]. A verbs connection with a pool speaks no receive credits with its
/// peer (the pool's receives are not one connection's to count), so a send of its peer that
/// finds the pool empty waits in the peer's device rather than in its library.
///
/// Cloning is cheap and gives the same pool.
#[derive(Clone)]
pub struct SharedRecvQueue {
    pub(crate) inner: Arc<SrqInner>,
}

impl std::fmt::Debug for SharedRecvQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRecvQueue")
            .field("depth", &self.inner.depth)
            .field("len", &self.len())
            .finish()
    }
}

/// A receive posted to a pool, until a connection takes it.
pub(crate) struct PooledRecv {
    pub(crate) wr_id: u64,
    pub(crate) mr: Arc<MemoryRegion>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

/// Where a pool's receives go when a transport keeps them on its device (verbs: a shared
/// receive queue of the device's), which then reports them taken with
/// [`SrqInner::taken_by_device`].
pub(crate) trait PoolDevice: Send + Sync {
    /// Hands a receive to the device (the pool's count already holds it).
    fn post(&self, r: PooledRecv) -> Result<()>;
}

/// Who takes a pool's receives: the connections themselves (as over shm, with [`SrqInner::take`])
/// or a device (for `key`, the transport's name of it).
enum Binding {
    None,
    Local,
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Device(usize, Arc<dyn PoolDevice>, Arc<dyn Any + Send + Sync>),
}

/// A connection with a message waiting for a receive of the pool.
pub(crate) trait Waiter: Send + Sync {
    /// The pool has receives again: take them for the waiting messages (on the poster's
    /// thread, with no lock of the pool's held).
    fn pool_refilled(&self);
}

pub(crate) struct SrqInner {
    ctx: Arc<ContextInner>,
    depth: usize,
    events: Option<Arc<CompletionQueue>>,
    context: usize,
    /// How many receives the pool holds: read without the lock by connections deciding
    /// whether a waiting message could move.
    count: AtomicUsize,
    state: SpinLock<PoolState>,
}

struct PoolState {
    binding: Binding,
    recvs: VecDeque<PooledRecv>,
    /// Report an event once fewer than this many receives are left (0: disarmed).
    limit: usize,
    waiters: VecDeque<Weak<dyn Waiter>>,
}

impl SharedRecvQueue {
    pub(crate) fn new(ctx: Arc<ContextInner>, opts: &SrqOptions) -> Result<Self> {
        if opts.depth == 0 || opts.depth > QUEUE_DEPTH_MAX {
            return Err(Error::invalid(format!(
                "shared receive queue depth {} not in 1..={QUEUE_DEPTH_MAX}",
                opts.depth
            )));
        }
        Ok(SharedRecvQueue {
            inner: Arc::new(SrqInner {
                ctx,
                depth: opts.depth as usize,
                events: opts.cq.clone(),
                context: opts.context,
                count: AtomicUsize::new(0),
                state: SpinLock::new(PoolState {
                    binding: Binding::None,
                    recvs: VecDeque::new(),
                    limit: 0,
                    waiters: VecDeque::new(),
                }),
            }),
        })
    }

    /// Posts a receive of up to `len` bytes into `mr` at `offset` (needs
    /// [`crate::Access::LOCAL_WRITE`]) to the pool. Fails with [`Error::QueueFull`] when the
    /// pool holds `depth` receives. Messages that waited for the pool are taken now, on this
    /// thread.
    pub fn post_recv(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<()> {
        let wr = RecvRequest::new(&self.inner.ctx, mr, offset, len, wr_id)?;
        let inner = &*self.inner;
        let r = PooledRecv {
            wr_id: wr.wr_id,
            mr: wr.mr.clone(),
            offset: wr.offset,
            len: wr.len,
        };
        let d = {
            let mut st = inner.state.lock();
            // Relaxed: every change is made under the lock.
            let count = inner.count.load(Ordering::Relaxed);
            if count >= inner.depth {
                return Err(Error::QueueFull("shared receive"));
            }
            // Relaxed: the lock orders it for those who take; a reader without the lock only
            // decides whether to look.
            inner.count.store(count + 1, Ordering::Relaxed);
            match &st.binding {
                Binding::Device(_, d, _) => d.clone(),
                _ => {
                    // In the same hold as the count: a taker sets the count from the list.
                    st.recvs.push_back(r);
                    drop(st);
                    self.serve_waiters();
                    return Ok(());
                }
            }
        };
        if let Err(e) = d.post(r) {
            let _st = inner.state.lock();
            inner.count.fetch_sub(1, Ordering::Relaxed);
            return Err(e);
        }
        Ok(())
    }

    /// Hands the pool's receives to the connections whose messages wait, oldest waiter first,
    /// while any are left. A waiter that finds none (another connection was quicker) waits
    /// again.
    fn serve_waiters(&self) {
        let inner = &*self.inner;
        loop {
            let waiter = {
                let mut st = inner.state.lock();
                if st.recvs.is_empty() {
                    break;
                }
                match st.waiters.pop_front() {
                    Some(w) => w,
                    None => break,
                }
            };
            if let Some(w) = waiter.upgrade() {
                w.pool_refilled();
            }
        }
    }

    /// Arms the pool's limit: once fewer than `limit` receives are left in it, one
    /// [`Opcode::SrqLimit`] record goes to the pool's queue ([`SrqOptions::cq`]), with the
    /// receives left as its `wr_id`, and the limit is disarmed (as a verbs SRQ's limit event);
    /// at once when fewer are left already. 0 disarms it. Fails with
    /// [`Error::InvalidArgument`] for a pool without a queue or a limit over its depth.
    pub fn set_limit(&self, limit: u32) -> Result<()> {
        let inner = &*self.inner;
        if limit != 0 && inner.events.is_none() {
            return Err(Error::invalid(
                "the shared receive queue has no completion queue for its events",
            ));
        }
        if limit as usize > inner.depth {
            return Err(Error::invalid(format!(
                "limit {limit} over the shared receive queue's depth {}",
                inner.depth
            )));
        }
        inner.update(|st| st.limit = limit as usize);
        Ok(())
    }

    /// Receives posted to the pool that no connection has taken yet.
    pub fn len(&self) -> usize {
        self.inner.count.load(Ordering::Relaxed)
    }

    /// Whether the pool holds no receive.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most receives the pool holds at once.
    pub fn depth(&self) -> u32 {
        self.inner.depth as u32
    }

    /// Whether the pool belongs to `ctx`.
    pub(crate) fn same_context(&self, ctx: &Arc<ContextInner>) -> bool {
        Arc::ptr_eq(&self.inner.ctx, ctx)
    }
}

impl SrqInner {
    /// Binds the pool to connections that take its receives themselves ([`take`](Self::take)).
    /// Fails for a pool bound to a device.
    pub(crate) fn bind_local(&self) -> Result<()> {
        let mut st = self.state.lock();
        match st.binding {
            Binding::Device(..) => Err(Error::Unsupported(
                "the shared receive queue serves connections of an RDMA device".into(),
            )),
            _ => {
                st.binding = Binding::Local;
                Ok(())
            }
        }
    }

    /// Binds the pool to the device a transport names `key`, made by `make` on first use with
    /// the receives posted so far (which it must take) and the pool's depth; returns it (as
    /// the transport's own type, to downcast). Fails for a pool that serves connections
    /// taking their receives themselves, or another device.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn bind_device<D: PoolDevice + Any>(
        &self,
        key: usize,
        make: impl FnOnce(Vec<PooledRecv>, usize) -> Result<D>,
    ) -> Result<Arc<dyn Any + Send + Sync>> {
        let mut st = self.state.lock();
        match &st.binding {
            Binding::Device(k, _, a) if *k == key => return Ok(a.clone()),
            Binding::Device(..) => {
                return Err(Error::Unsupported(
                    "the shared receive queue serves connections of another RDMA device".into(),
                ));
            }
            Binding::Local => {
                return Err(Error::Unsupported(
                    "the shared receive queue serves shared-memory connections".into(),
                ));
            }
            Binding::None => {}
        }
        let posted: Vec<PooledRecv> = st.recvs.drain(..).collect();
        let d = Arc::new(make(posted, self.depth)?);
        st.binding = Binding::Device(key, d.clone(), d.clone());
        Ok(d)
    }

    /// The device took one of the pool's receives (for a message, or flushed it).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn taken_by_device(&self) {
        self.update(|_| {
            // Relaxed: every change is made under the lock.
            let n = self.count.load(Ordering::Relaxed).saturating_sub(1);
            self.count.store(n, Ordering::Relaxed);
        });
    }

    /// Takes the oldest receive. When there is none and `waiter` is given, it becomes a
    /// waiter of the pool: the next post calls it.
    pub(crate) fn take(&self, waiter: Option<&Weak<dyn Waiter>>) -> Option<PooledRecv> {
        self.update(|st| {
            let r = st.recvs.pop_front();
            match &r {
                Some(_) => self.count.store(st.recvs.len(), Ordering::Relaxed),
                None => {
                    if let Some(w) = waiter {
                        st.waiters.push_back(w.clone());
                    }
                }
            }
            r
        })
    }

    /// Most receives the pool holds at once.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn depth(&self) -> usize {
        self.depth
    }

    /// Whether the pool holds a receive now (a look without the lock).
    #[inline]
    pub(crate) fn available(&self) -> bool {
        self.count.load(Ordering::Relaxed) != 0
    }

    /// Runs `f` on the pool's state under its lock, then reports the limit event (outside the
    /// lock: the pool's queue may wake a waiter) when the receives left fell below the armed
    /// limit. Every change of the count goes through here or is a post, which only raises it.
    fn update<T>(&self, f: impl FnOnce(&mut PoolState) -> T) -> T {
        let (out, left) = {
            let mut st = self.state.lock();
            let out = f(&mut st);
            let left = self.low(&mut st);
            (out, left)
        };
        if let Some(left) = left {
            self.report_low(left);
        }
        out
    }

    /// The receives left, when they fell below the armed limit (which it disarms).
    fn low(&self, st: &mut PoolState) -> Option<usize> {
        // Relaxed: every change is made under the lock, which the caller holds.
        let left = self.count.load(Ordering::Relaxed);
        if st.limit == 0 || left >= st.limit {
            return None;
        }
        st.limit = 0;
        Some(left)
    }

    fn report_low(&self, left: usize) {
        if let Some(cq) = &self.events {
            cq.push(Completion {
                wr_id: left as u64,
                conn_id: 0,
                context: self.context,
                opcode: Opcode::SrqLimit,
                status: WcStatus::Success,
                byte_len: 0,
                imm: None,
            });
        }
    }
}
