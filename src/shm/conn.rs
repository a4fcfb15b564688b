//! One shm connection as its users see it: the queues they post into, shared with the
//! connection's progress thread (`engine.rs`), which does all the moving of bytes.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::thread::JoinHandle;

use crossbeam_queue::ArrayQueue;

use crate::conn::{ConnInfo, ConnOptions, SendFlags, Transport, next_conn_id};
use crate::cq::{CompletionQueue, Reporter};
use crate::ctx::ContextInner;
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::shm::engine::Engine;
use crate::shm::segment::Segment;
use crate::sys::EventFd;

/// Where a send's bytes come from.
pub(crate) enum SendSrc {
    Region {
        mr: Arc<MemoryRegion>,
        offset: usize,
    },
    Inline(Box<[u8]>),
}

pub(crate) struct SendWr {
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    pub(crate) len: usize,
    pub(crate) src: SendSrc,
}

impl SendWr {
    /// Start of the bytes to send (valid for `len` bytes while the work request lives).
    pub(crate) fn ptr(&self) -> *const u8 {
        match &self.src {
            SendSrc::Region { mr, offset } => mr
                .slice_ptr(*offset, self.len)
                .expect("range checked when posted")
                .cast_const(),
            SendSrc::Inline(b) => b.as_ptr(),
        }
    }
}

pub(crate) struct RecvWr {
    pub(crate) wr_id: u64,
    pub(crate) mr: Arc<MemoryRegion>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

/// State shared by the users of a connection and its progress thread.
pub(crate) struct Shared {
    pub(crate) info: ConnInfo,
    /// Where this connection's completions go.
    pub(crate) report: Reporter,
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) sq: ArrayQueue<SendWr>,
    pub(crate) rq: ArrayQueue<RecvWr>,
    /// Sends posted and not yet completed; bounded by the send queue depth.
    pub(crate) sq_used: AtomicUsize,
    /// Receives posted and not yet completed.
    pub(crate) rq_used: AtomicUsize,
    /// Set by the engine when the connection is down; posting then fails.
    pub(crate) closed: AtomicBool,
    /// Posts under way; the engine waits for zero after setting `closed`, so no work request
    /// can slip into a queue after the final flush.
    pub(crate) posting: AtomicUsize,
    /// The user asked for a disconnect.
    pub(crate) stop: AtomicBool,
    /// The engine is about to sleep (or sleeps) and wants `wake` signalled.
    pub(crate) engine_sleeping: AtomicBool,
    pub(crate) wake: EventFd,
}

impl Shared {
    /// Wakes the engine if it sleeps.
    pub(crate) fn kick(&self) {
        // SeqCst fence: orders our queue push before the read of `engine_sleeping`, pairing with
        // the engine's store of `engine_sleeping` before it re-checks the queues (Dekker).
        fence(Ordering::SeqCst);
        if self.engine_sleeping.load(Ordering::SeqCst)
            && self.engine_sleeping.swap(false, Ordering::SeqCst)
        {
            self.wake.signal();
        }
    }

    /// Runs `push` as one post: refused once the connection is down; counted in `posting` so
    /// the engine's final flush sees everything pushed.
    fn post(&self, push: impl FnOnce() -> Result<()>) -> Result<()> {
        // SeqCst: `posting` and `closed` form a Dekker pair with the engine's teardown.
        self.posting.fetch_add(1, Ordering::SeqCst);
        let r = if self.closed.load(Ordering::SeqCst) {
            Err(Error::Disconnected)
        } else {
            push()
        };
        self.posting.fetch_sub(1, Ordering::SeqCst);
        if r.is_ok() {
            self.kick();
        }
        r
    }
}

/// Claims one slot of a queue of `depth`, or fails with QueueFull.
fn claim(used: &AtomicUsize, depth: u32, which: &'static str) -> Result<()> {
    // Relaxed is enough: the counter only bounds queue occupancy; the queue itself orders data.
    let prev = used.fetch_add(1, Ordering::Relaxed);
    if prev >= depth as usize {
        used.fetch_sub(1, Ordering::Relaxed);
        return Err(Error::QueueFull(which));
    }
    Ok(())
}

/// The user's handle of an shm connection. Dropping it tears the connection down.
pub(crate) struct Conn {
    sh: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    private_data: Vec<u8>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("shm::Conn")
            .field("info", &self.sh.info)
            .finish()
    }
}

impl Conn {
    /// Starts the connection's engine over an established handshake socket and segment.
    pub(crate) fn start(
        ctx: Arc<ContextInner>,
        cq: Arc<CompletionQueue>,
        opts: &ConnOptions,
        side: usize,
        sock: OwnedFd,
        seg: Segment,
        peer_private_data: Vec<u8>,
    ) -> Result<Conn> {
        let info = ConnInfo {
            id: next_conn_id(),
            send_queue_depth: opts.send_queue_depth,
            recv_queue_depth: opts.recv_queue_depth,
            max_inline: opts.max_inline,
            transport: Transport::Shm,
        };
        let sh = Arc::new(Shared {
            info,
            report: Reporter {
                cq,
                conn_id: info.id,
                context: opts.context,
            },
            ctx,
            sq: ArrayQueue::new(opts.send_queue_depth as usize),
            rq: ArrayQueue::new(opts.recv_queue_depth as usize),
            sq_used: AtomicUsize::new(0),
            rq_used: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            posting: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            engine_sleeping: AtomicBool::new(false),
            wake: EventFd::new().map_err(Error::Thread)?,
        });
        let engine = Engine::new(sh.clone(), side, sock, seg)?;
        let thread = std::thread::Builder::new()
            .name(format!("rbr-shm-{}", info.id))
            .spawn(move || engine.run())
            .map_err(Error::Thread)?;
        Ok(Conn {
            sh,
            thread: Some(thread),
            private_data: peer_private_data,
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
        crate::conn::check_region(mr, &self.sh.ctx, offset, len)?;
        let wr = SendWr {
            wr_id,
            signaled: flags.signaled(),
            len,
            src: SendSrc::Region {
                mr: mr.clone(),
                offset,
            },
        };
        self.push_send(wr)
    }

    pub(crate) fn post_send_inline(&self, data: &[u8], wr_id: u64, flags: SendFlags) -> Result<()> {
        crate::conn::check_send_flags(flags)?;
        crate::conn::check_inline(data.len(), self.sh.info.max_inline)?;
        let wr = SendWr {
            wr_id,
            signaled: flags.signaled(),
            len: data.len(),
            src: SendSrc::Inline(data.into()),
        };
        self.push_send(wr)
    }

    fn push_send(&self, wr: SendWr) -> Result<()> {
        let sh = &self.sh;
        sh.post(|| {
            claim(&sh.sq_used, sh.info.send_queue_depth, "send")?;
            if sh.sq.push(wr).is_err() {
                unreachable!("a claimed slot always fits");
            }
            Ok(())
        })
    }

    pub(crate) fn post_recv(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<()> {
        crate::conn::check_recv_region(mr, &self.sh.ctx, offset, len)?;
        let sh = &self.sh;
        let wr = RecvWr {
            wr_id,
            mr: mr.clone(),
            offset,
            len,
        };
        sh.post(|| {
            claim(&sh.rq_used, sh.info.recv_queue_depth, "receive")?;
            if sh.rq.push(wr).is_err() {
                unreachable!("a claimed slot always fits");
            }
            Ok(())
        })
    }

    pub(crate) fn disconnect(&self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        self.sh.kick();
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.disconnect();
        if let Some(t) = self.thread.take() {
            // The engine's teardown is local work and its sleeps are woken by `kick`, so this
            // join is bounded. A panic inside it has already been reported as a disconnect.
            let _ = t.join();
        }
    }
}
