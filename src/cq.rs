//! The completion bridge: a lock-free queue the transports fill and any caller thread drains,
//! plus one pollable descriptor that is readable exactly while completions are queued.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result};
use crate::sys::{self, EventFd};

/// What a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Opcode {
    /// A posted send finished (or failed).
    Send,
    /// A posted receive was filled (or failed).
    Recv,
    /// Connection event: the connection is down and every work request it had has completed.
    /// It is the last record a connection ever produces.
    Disconnected,
}

/// How a work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcStatus {
    /// It succeeded.
    Success,
    /// The connection went down before it ran.
    Flushed,
    /// The incoming message was larger than the posted receive buffer.
    LocalLength,
    /// The peer could not take the message (for a send: its receive buffer was too small).
    RemoteError,
    /// The peer vanished or the link failed (for a disconnect event: it was not a clean close).
    Transport,
    /// The local memory region does not allow the access.
    LocalProtection,
    /// The remote memory region does not allow the access.
    RemoteAccess,
    /// Any other failure.
    General,
}

/// One finished work request or connection event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The caller's work-request id, echoed (0 for connection events).
    pub wr_id: u64,
    /// The connection it belongs to ([`crate::Connection::id`]).
    pub conn_id: u64,
    /// The connection's user context ([`crate::ConnOptions::context`]).
    pub context: usize,
    /// What finished.
    pub opcode: Opcode,
    /// How it ended.
    pub status: WcStatus,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// Immediate data, when the message carried some.
    pub imm: Option<u32>,
}

/// A completion queue that any number of connections share and any thread drains.
///
/// Thread-safe: `poll`, `wait` and `fd` may be called from any thread at once. Completions of one
/// connection arrive in the order its work finished.
#[derive(Debug)]
pub struct CompletionQueue {
    queue: SegQueue<Completion>,
    /// Count of completions pushed or about to be pushed, never below the queue's length:
    /// producers add before they push, consumers subtract after they pop.
    pending: AtomicUsize,
    /// Whether `efd` is readable. Only changed under the lock, so the descriptor's state and
    /// `pending` can't disagree once both sides are done (no lost or stale wake-up).
    armed: Mutex<bool>,
    efd: EventFd,
}

impl CompletionQueue {
    /// Creates an empty completion queue.
    pub fn new() -> Result<Arc<Self>> {
        Ok(Arc::new(CompletionQueue {
            queue: SegQueue::new(),
            pending: AtomicUsize::new(0),
            armed: Mutex::new(false),
            efd: EventFd::new().map_err(Error::CompletionQueue)?,
        }))
    }

    pub(crate) fn push(&self, c: Completion) {
        // AcqRel: the increment is ordered before the push, so a consumer never sees more items
        // than `pending` counts.
        let before = self.pending.fetch_add(1, Ordering::AcqRel);
        self.queue.push(c);
        if before == 0 {
            self.update_fd();
        }
    }

    /// Takes the oldest completion, if any. Never blocks.
    pub fn poll(&self) -> Option<Completion> {
        let c = self.queue.pop()?;
        // AcqRel: pairs with the producer's increment; the value seen decides who disarms.
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.update_fd();
        }
        Some(c)
    }

    /// Takes up to `max` completions into `out` (appending). Returns how many were taken.
    pub fn poll_into(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            match self.poll() {
                Some(c) => {
                    out.push(c);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Number of completions queued right now.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no completion is queued right now.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Waits until at least one completion is queued or the timeout passes (`None` = forever).
    /// Returns `Ok(true)` when something is queued, `Ok(false)` on timeout. Takes nothing.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        if !self.queue.is_empty() {
            return Ok(true);
        }
        sys::poll_one(self.efd.raw(), libc::POLLIN, timeout).map_err(Error::CompletionQueue)
    }

    /// A descriptor for epoll/poll/select: readable exactly while completions are queued
    /// (level-triggered). Owned by the queue; do not read, write or close it.
    pub fn fd(&self) -> RawFd {
        self.efd.raw()
    }

    /// Brings the descriptor's readability in line with `pending`. Runs only on the 0 <-> 1
    /// transitions, so the lock is off the steady-state path.
    fn update_fd(&self) {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        // Acquire: see every increment and decrement published before the lock was taken.
        let want = self.pending.load(Ordering::Acquire) > 0;
        if want != *armed {
            if want {
                self.efd.signal();
            } else {
                self.efd.clear();
            }
            *armed = want;
        }
    }
}

/// Reports one connection's completions into its completion queue.
#[derive(Debug)]
pub(crate) struct Reporter {
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) conn_id: u64,
    pub(crate) context: usize,
}

impl Reporter {
    pub(crate) fn complete(
        &self,
        wr_id: u64,
        opcode: Opcode,
        status: WcStatus,
        byte_len: u32,
        imm: Option<u32>,
    ) {
        self.cq.push(Completion {
            wr_id,
            conn_id: self.conn_id,
            context: self.context,
            opcode,
            status,
            byte_len,
            imm,
        });
    }
}
