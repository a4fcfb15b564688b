//! Operations as futures, for any async runtime: each send, receive, one-sided write or read
//! and atomic is posted at once and resolves to its outcome, found by a token the library
//! puts in its `wr_id`, so a program keeps no table of `wr_id`s.
//!
//! The pieces: [`Router`] hands a completion queue's records to the operations waiting for
//! them (the runtime calls [`Router::route`] when the queue's descriptor turns readable);
//! [`AsyncConnection`] posts operations and returns their futures ([`Op`]); [`Buf`] is a
//! buffer an operation owns while it runs. The `tokio` feature adds the task that waits on
//! the descriptor (`rdmabridge::tokio::Queue`) and a listener whose `accept` is a future.
//!
//! # Dropping a future
//! An operation is posted when its method is called, not when its future is first polled,
//! and it runs to its completion whatever becomes of the future: the library cannot recall a
//! work request. Dropping the future before then (a `select!` that took another branch, a
//! timeout) keeps the buffer the operation owns with the router until the operation's record
//! comes, then releases it; the record itself is dropped. Nothing leaks, and nothing else can
//! reach the buffer's bytes while the device or the peer may still use them. Every operation
//! gets its record in bounded time, since a connection that goes down flushes its work (and
//! dropping the [`AsyncConnection`] disconnects it) - except a receive of a shared receive
//! queue ([`AsyncRecvQueue`]), which waits in the pool for a message of any of its
//! connections.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::cq::Completion;
use crate::error::{Error, Result};

mod buf;
mod conn;
mod router;

pub use buf::Buf;
pub use conn::{AsyncConnection, AsyncRecvQueue, CmpSwap, FetchAdd, Remote};
pub use router::Router;

/// What an operation's future turns its record (or the failure of its post) into, with the
/// buffer it held.
type Finish<T> = fn(Result<Completion>, &mut Option<Buf>) -> T;

/// The future of one posted operation: resolves to its outcome once the router has its
/// record. See the module docs for what dropping it does.
#[must_use = "the operation is posted; its future tells how it ended"]
pub struct Op<T> {
    router: Arc<Router>,
    /// The operation's token; 0 once the future has resolved, or when the post failed.
    token: u64,
    /// Why the post failed.
    failed: Option<Error>,
    /// The buffer the operation owns.
    buf: Option<Buf>,
    /// Where a buffer the output does not return goes back (the atomics' words).
    spare: Option<Arc<parking_lot::Mutex<Vec<Buf>>>>,
    finish: Finish<T>,
}

impl<T> std::fmt::Debug for Op<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("token", &self.token)
            .field("failed", &self.failed)
            .finish()
    }
}

impl<T> Op<T> {
    /// Posts an operation with `post` (given its token and the buffer) and returns its future.
    fn post(
        router: &Arc<Router>,
        buf: Option<Buf>,
        finish: Finish<T>,
        post: impl FnOnce(u64, Option<&Buf>) -> Result<()>,
    ) -> Self {
        // The token is in the table before the post: the record may be routed before the
        // post returns.
        let token = router.register();
        let (token, failed) = match post(token, buf.as_ref()) {
            Ok(()) => (token, None),
            Err(e) => {
                router.unregister(token);
                (0, Some(e))
            }
        };
        Op {
            router: router.clone(),
            token,
            failed,
            buf,
            spare: None,
            finish,
        }
    }

    /// The outcome once its record came (`cx` is woken when it does). The runtime-neutral
    /// form of awaiting it.
    pub fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<T> {
        let r = if let Some(e) = self.failed.take() {
            Err(e)
        } else {
            assert!(
                self.token != 0,
                "an operation's future polled after it resolved"
            );
            match self.router.poll_op(self.token, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(c) => {
                    self.token = 0;
                    c.into_result()
                }
            }
        };
        let out = (self.finish)(r, &mut self.buf);
        if let (Some(spare), Some(b)) = (&self.spare, self.buf.take()) {
            spare.lock().push(b);
        }
        Poll::Ready(out)
    }
}

impl<T> Future for Op<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.get_mut().poll_complete(cx)
    }
}

impl<T> Drop for Op<T> {
    fn drop(&mut self) {
        if self.token != 0 {
            self.router.abandon(self.token, self.buf.take());
        }
    }
}
