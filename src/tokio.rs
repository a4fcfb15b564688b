//! The `tokio` feature: the library's futures ([`crate::ops`]) driven by tokio, with no thread
//! of their own and no busy loop - one task per completion queue waits on the queue's
//! descriptor with `AsyncFd` and routes the records, and a listener's `accept` waits on the
//! listener's descriptor. RDMA then sits in `tokio::select!` beside sockets and timers.
//! The guide is docs/async-rust.md.
//!
//! ```
//! use rdmabridge::ops::Buf;
//! use rdmabridge::tokio::{Listener, Queue};
//! use rdmabridge::{ConnOptions, Context};
//!
//! # fn main() -> rdmabridge::Result<()> {
//! let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
//! rt.block_on(async {
//!     let ctx = Context::new()?;
//!     let addr = format!("shm://doc-{}", std::process::id());
//!     let listener = Listener::bind(&ctx, &addr, 16)?;
//!     let queue = Queue::new()?;
//!     let opts = ConnOptions::default();
//!     // Both ends in one task: neither call blocks, so the two make progress together.
//!     let (client, server) = tokio::join!(queue.connect(&ctx, &addr, &opts), async {
//!         queue.accept(listener.accept().await?, &opts).await
//!     });
//!     let (client, server) = (client?, server?);
//!     // A receive owns its buffer until the message is in it; no wr_id, no unsafe.
//!     let request = server.recv(Buf::alloc(&ctx, 64)?);
//!     client.send_copy(b"ping").await?;
//!     let (r, buf) = request.await;
//!     r?;
//!     assert_eq!(&buf[..], b"ping");
//!     Ok(())
//! })
//! # }
//! ```
use std::future::poll_fn;
use std::sync::{Arc, Weak};
use std::task::{Context as TaskContext, Poll};

use ::tokio::io::Interest;
use ::tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use ::tokio::runtime::Handle;
use ::tokio::task::AbortHandle;

use crate::conn::{ConnOptions, ConnRequest, Listener as PlainListener};
use crate::cq::{Completion, CompletionQueue, CqOptions};
use crate::ctx::Context;
use crate::error::{Error, Result};
use crate::log::log;
use crate::ops::{AsyncConnection, Router};

/// A completion queue driven by a tokio task: made inside a runtime, it routes the queue's
/// records to the futures of the operations posted on its connections, and queues the rest
/// for [`next`](Self::next). Cheap to clone; the task stops when the last clone, connection
/// and operation of the queue are gone.
#[derive(Debug, Clone)]
pub struct Queue {
    router: Arc<Router>,
}

/// Aborts the driver task when the router it drives is dropped.
struct Driver(AbortHandle);

impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Queue {
    /// A new completion queue with default options, driven by a task of the current runtime.
    /// Fails with [`Error::State`] outside a tokio runtime.
    pub fn new() -> Result<Self> {
        Self::with_options(CqOptions::default())
    }

    /// A new completion queue made with `opts`, driven as with [`new`](Self::new).
    pub fn with_options(opts: CqOptions) -> Result<Self> {
        Self::drive(CompletionQueue::with_options(opts)?)
    }

    /// Drives `cq` with a task of the current runtime. Nothing else should take records from
    /// `cq` meanwhile (they would not reach their futures).
    pub fn drive(cq: Arc<CompletionQueue>) -> Result<Self> {
        let rt = Handle::try_current().map_err(|_| Error::State("not inside a tokio runtime"))?;
        let _in = rt.enter();
        // SAFETY: the queue's descriptor stays open and the same for as long as the queue
        // lives, which the `Arc` moved into the `AsyncFd` guarantees.
        let afd = unsafe { AsyncFd::register_with_interest(cq.clone(), Interest::READABLE) }
            .map_err(|e| Error::CompletionQueue(e.into()))?;
        let router = Router::new(cq);
        let task = rt.spawn(route_while_ready(afd, Arc::downgrade(&router)));
        let _ = router.set_driver(Box::new(Driver(task.abort_handle())));
        Ok(Queue { router })
    }

    /// The router of the queue, for [`crate::ops::AsyncConnection`].
    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// The completion queue, for connections made with the plain API.
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        self.router.queue()
    }

    /// Connects to `addr` with this queue, without blocking:
    /// [`AsyncConnection::connect`].
    pub async fn connect(
        &self,
        ctx: &Context,
        addr: &str,
        opts: &ConnOptions,
    ) -> Result<AsyncConnection> {
        AsyncConnection::connect(ctx, addr, &self.router, opts).await
    }

    /// Accepts `req` with this queue, without blocking: [`AsyncConnection::accept`].
    pub async fn accept(&self, req: ConnRequest, opts: &ConnOptions) -> Result<AsyncConnection> {
        AsyncConnection::accept(req, &self.router, opts).await
    }

    /// The next record no operation's future claims (connection events, and the records of
    /// work posted with the plain API), oldest first. One reader at a time.
    pub async fn next(&self) -> Completion {
        poll_fn(|cx| self.router.poll_next(cx)).await
    }

    /// [`Router::poll_next`].
    pub fn poll_next(&self, cx: &mut TaskContext<'_>) -> Poll<Completion> {
        self.router.poll_next(cx)
    }
}

/// The driver: the textbook `AsyncFd` loop (tokio registers the descriptor edge-triggered):
/// wait until readable, route until the queue is empty, clear the readiness, again. The
/// queue's contract makes the next record after a poll that found it empty a new edge.
async fn route_while_ready(afd: AsyncFd<Arc<CompletionQueue>>, router: Weak<Router>) {
    loop {
        let mut ready = match afd.readable().await {
            Ok(r) => r,
            Err(e) => {
                log!(Error, "the completion queue's task stops: {e}");
                return;
            }
        };
        match router.upgrade() {
            Some(r) => r.route(),
            None => return,
        };
        ready.clear_ready();
    }
}

/// A listener whose [`accept`](Self::accept) is a future, on the listener's descriptor.
#[derive(Debug)]
pub struct Listener {
    fd: AsyncFd<PlainListener>,
}

impl Listener {
    /// Listens on `addr` (see the crate docs for address forms); inside a tokio runtime.
    pub fn bind(ctx: &Context, addr: &str, backlog: u32) -> Result<Self> {
        Self::from_listener(ctx.listen(addr, backlog)?)
    }

    /// Waits on `l`'s descriptor with the current runtime.
    pub fn from_listener(l: PlainListener) -> Result<Self> {
        let rt = Handle::try_current().map_err(|_| Error::State("not inside a tokio runtime"))?;
        let _in = rt.enter();
        // SAFETY: the listener's descriptor stays open and the same for as long as the
        // listener lives, and the `AsyncFd` owns the listener.
        let fd = unsafe { AsyncFd::register_with_interest(l, Interest::READABLE) }
            .map_err(|e| Error::Listen(e.into()))?;
        Ok(Listener { fd })
    }

    /// The next connection request. Cancel-safe: dropping the future loses no request. Any
    /// number of tasks may wait in it at once.
    pub async fn accept(&self) -> Result<ConnRequest> {
        loop {
            let mut ready = self.fd.readable().await.map_err(Error::Listen)?;
            if let Some(req) = Self::take(&mut ready)? {
                return Ok(req);
            }
        }
    }

    /// The next connection request, or `Pending` with `cx`'s waker kept for the listener's
    /// descriptor (only the last task to poll is woken).
    pub fn poll_accept(&self, cx: &mut TaskContext<'_>) -> Poll<Result<ConnRequest>> {
        loop {
            let mut ready = match self.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(r)) => r,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Error::Listen(e))),
                Poll::Pending => return Poll::Pending,
            };
            if let Some(req) = Self::take(&mut ready).transpose() {
                return Poll::Ready(req);
            }
        }
    }

    /// A request if one is complete; `None` having cleared the readiness, for the next edge
    /// (the listener's edge-triggered contract: take until `Ok(None)`, then wait).
    fn take(ready: &mut AsyncFdReadyGuard<'_, PlainListener>) -> Result<Option<ConnRequest>> {
        let r = ready.get_inner().try_get_request();
        if let Ok(None) = r {
            ready.clear_ready();
        }
        r
    }

    /// The plain listener.
    pub fn get_ref(&self) -> &PlainListener {
        self.fd.get_ref()
    }
}
