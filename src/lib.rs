//! rdmabridge: RDMA connections as easy as sockets - listen, accept, connect, post, poll - over
//! real RDMA (verbs) or, for peers on the same host, shared memory; from Rust, C and C++.
//!
//! # Quick start
//! ```no_run
//! use rdmabridge::{Access, CompletionQueue, ConnOptions, Context, Opcode, SendFlags};
//! use std::time::Duration;
//!
//! # fn main() -> rdmabridge::Result<()> {
//! let ctx = Context::new()?;
//! let cq = CompletionQueue::new()?;
//! // Server side: let listener = ctx.listen("shm://demo", 16)?;
//! //              let conn = listener.get_request(None)?.accept(&cq, &ConnOptions::default())?;
//! let conn = ctx.connect("shm://demo", &cq, &ConnOptions::default())?;
//! let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE)?;
//! conn.post_recv(&mr, 2048, 2048, 2)?;
//! // SAFETY: no work request or peer uses these bytes yet.
//! unsafe { mr.write(0, b"hello")? };
//! conn.post_send(&mr, 0, 5, 1, SendFlags::SIGNALED)?;
//! while cq.wait(Some(Duration::from_secs(5)))? {
//!     let c = cq.poll().expect("wait said a completion is queued");
//!     if c.opcode == Opcode::Recv {
//!         break;
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Addresses
//! `shm://NAME` (shared memory on this host), `rdma://HOST:PORT` (verbs), or `HOST:PORT`
//! (shared memory for loopback, and for this machine's own addresses when it has no RDMA
//! device; verbs otherwise; `RBR_TRANSPORT=shm|verbs|auto` overrides). A verbs endpoint on a
//! machine without an RDMA device reports [`Error::NoDevice`].
//!
//! # Semantics
//! A connection behaves like an RC queue pair: messages are reliable and in order; a send waits
//! for the peer to post a receive (it is never dropped); a receive too small for its message
//! completes with [`WcStatus::LocalLength`] and fails the connection. A send completes when the
//! peer has taken the message.
//!
//! # Async
//! [`ops`] makes every operation a future that resolves to its outcome (no `wr_id` kept by
//! hand, buffers owned by the operation while it runs, no `unsafe`), for any runtime; with the
//! `tokio` feature, `rdmabridge::tokio` drives them and adds `connect(...).await` and
//! `accept().await`. A runnable example is in that module; the guide is docs/async-rust.md.
//!
//! # Thread safety
//! [`Context`], [`CompletionQueue`], [`MemoryRegion`], [`Listener`] and [`Connection`] are
//! `Send + Sync`: any thread may post, poll or wait at any time. A region's bytes are the
//! exception: the library and the peer access them while work is posted, so copying them in
//! and out ([`MemoryRegion::write`], [`MemoryRegion::read`]) is `unsafe`, with the rule of
//! any RDMA buffer - hands off while work that uses them is outstanding.
//!
//! # Resource cleanup
//! Everything is released on drop. Dropping a [`Connection`] disconnects it, completes every
//! outstanding work request with [`WcStatus::Flushed`], and delivers an [`Opcode::Disconnected`]
//! record - in bounded time, never blocking on the peer. A posted work request holds its memory
//! region alive until it completes.

#![deny(
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks
)]

mod addr;
mod conn;
mod cq;
mod ctx;
pub mod diag;
mod domain;
mod driver;
mod error;
pub mod ffi;
mod fifo;
mod idmap;
mod log;
mod mr;
pub mod ops;
mod panic;
mod shm;
mod sync;
mod sys;
#[cfg(all(feature = "tokio", not(loom)))]
pub mod tokio;
mod transports;
mod verbs;

/// Entry points of the fuzz targets in `fuzz/` (feature `fuzzing`, never on by default): each
/// runs the real parsing and checking code over bytes a hostile peer controls. Not an API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::shm::fuzz::{
        handshake, handshake_seeds, onesided, onesided_seeds, ring, ring_seeds,
    };
}

pub use conn::{
    ConnInfo, ConnOptions, ConnRequest, Connection, INLINE_MAX, Listener, PRIVATE_DATA_MAX,
    QUEUE_DEPTH_MAX, REMOTE_DESC_LEN, RemoteRegion, SGE_MAX, SHM_RING_DEFAULT, SHM_RING_MAX,
    SHM_RING_MIN, SendFlags, Sge, SharedRecvQueue, SrqOptions, Transport,
};
pub use cq::{Completion, CompletionQueue, CqOptions, Opcode, Progress, WcStatus};
pub use ctx::{Context, ContextOptions};
pub use error::{Error, Result};
pub use mr::{Access, MemoryRegion};
