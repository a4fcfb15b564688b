//! Setting a connection up without blocking the caller. The [`Connection`] exists from the
//! start; its transport's handshake runs as turns on the context's driver (a [`Handshake`]),
//! and its outcome goes to whoever waits: a blocking call ([`Setup::wait`]), a future
//! ([`Setup::poll`]), and - for connections started with `connect_start` or `accept_start` -
//! the completion queue, as an [`Opcode::Connected`] record. The blocking calls are these same
//! turns with the caller waiting for them.
//!
//! Once established, the handshake hands its registration and descriptors over to the
//! connection's own background work ([`crate::driver::Handler::successor`]), so a connection
//! in set-up holds no descriptor it will not hold once up. Receives posted while connecting
//! are kept here and posted, in order, when the connection is up; every other post says
//! [`Error::State`].

use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Poll, Waker};

use super::seam::ConnSeam;
use super::{ConnOptions, RecvRequest, Transport, next_conn_id};
use crate::cq::{CompletionQueue, Opcode, Reporter, WcStatus};
use crate::domain::ContextInner;
use crate::driver::{Handler, Next, Ready, Registration};
use crate::error::{Error, Result};
use crate::log::log;
use crate::mr::MemoryRegion;

/// One turn of a transport's handshake.
pub(crate) enum Step {
    /// Not done: run again as this says (never [`Next::Done`]).
    Wait(Next),
    /// Established: the connection, and the handler that runs its background work from now
    /// on, under the same registration and over the same descriptor.
    Up(Box<dyn ConnSeam>, Box<dyn Handler>),
    /// It failed with the error the blocking call returns.
    Failed(Error),
}

/// A transport's handshake in progress, run on the context's driver: each turn does what can
/// be done without blocking.
pub(crate) trait Handshake: Send {
    fn step(&mut self, ready: &Ready, setup: &Setup) -> Step;
}

/// A handshake ready to run over its one descriptor.
pub(crate) struct Started {
    pub(crate) handshake: Box<dyn Handshake>,
    /// `None`: the handshake makes its descriptor in its first turn and has the driver watch
    /// it then ([`Registration::watch`]), so that its caller makes no system call for it.
    pub(crate) fd: Option<RawFd>,
}

/// A receive posted while the connection was connecting.
struct HeldRecv {
    mr: Arc<MemoryRegion>,
    offset: usize,
    len: usize,
    wr_id: u64,
}

enum State {
    Connecting {
        recvs: Vec<HeldRecv>,
        waker: Option<Waker>,
        /// The connection was dropped: the handshake ends at its next turn, reporting
        /// nothing.
        abandoned: bool,
        /// The caller disconnected it: the handshake ends at its next turn.
        cancelled: bool,
    },
    /// Established; the connection takes its transport's half from here once.
    Up(Option<Box<dyn ConnSeam>>),
    Failed(Error),
}

/// The set-up of one connection, shared by the [`Connection`](super::Connection) and its
/// handshake.
pub(crate) struct Setup {
    id: u64,
    transport: Transport,
    ctx: Arc<ContextInner>,
    /// Where the outcome is reported (when `report`), and the receives held.
    report: Reporter,
    /// Whether the outcome is a record on the queue.
    records: bool,
    /// The receive queue's depth asked for: the most receives held while connecting.
    recv_depth: u32,
    /// The connection takes its receives from a shared receive queue.
    pooled: bool,
    /// The registration the handshake runs under, and the connection's work after it.
    reg: Registration,
    state: Mutex<State>,
    changed: Condvar,
    /// Once failed: the private data of a rejection, for `Connection::private_data`.
    reject_data: std::sync::OnceLock<Vec<u8>>,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Setup({})", self.id)
    }
}

impl Setup {
    /// A set-up toward `peer` (for messages) over `transport`; its outcome goes to `cq` as a
    /// record when `records`.
    pub(crate) fn new(
        ctx: &Arc<ContextInner>,
        cq: &Arc<CompletionQueue>,
        opts: &ConnOptions,
        transport: Transport,
        peer: String,
        records: bool,
    ) -> Result<Arc<Setup>> {
        if let Some(srq) = &opts.srq
            && !srq.same_context(ctx)
        {
            return Err(Error::invalid(
                "the shared receive queue belongs to another context",
            ));
        }
        let driver = ctx.driver.get().map_err(Error::Thread)?;
        let id = next_conn_id();
        Ok(Arc::new(Setup {
            id,
            transport,
            ctx: ctx.clone(),
            report: Reporter {
                cq: cq.clone(),
                conn_id: id,
                context: opts.context,
                peer,
            },
            records,
            recv_depth: opts.recv_queue_depth,
            pooled: opts.srq.is_some(),
            reg: driver.registration(),
            state: Mutex::new(State::Connecting {
                recvs: Vec::new(),
                waker: None,
                abandoned: false,
                cancelled: false,
            }),
            changed: Condvar::new(),
            reject_data: std::sync::OnceLock::new(),
        }))
    }

    /// The connection's id, for its transport state.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn context(&self) -> &Arc<ContextInner> {
        &self.ctx
    }

    pub(crate) fn recv_depth(&self) -> u32 {
        self.recv_depth
    }

    /// Whether the connection takes its receives from a shared receive queue.
    pub(crate) fn pooled(&self) -> bool {
        self.pooled
    }

    pub(crate) fn transport(&self) -> Transport {
        self.transport
    }

    /// The registration the connection's background work runs under once it is up.
    pub(crate) fn registration(&self) -> &Registration {
        &self.reg
    }

    /// Runs `started` on the context's driver.
    pub(crate) fn run(self: &Arc<Self>, started: Started) -> Result<()> {
        let driver = self.ctx.driver.get().map_err(Error::Thread)?;
        let turns = Box::new(Turns {
            setup: self.clone(),
            handshake: started.handshake,
            next: None,
            ran: false,
        });
        driver
            .register(&self.reg, started.fd.as_slice(), turns)
            .map_err(Error::Thread)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn established(&self, imp: Box<dyn ConnSeam>) {
        let mut st = self.lock();
        let State::Connecting {
            recvs,
            waker,
            abandoned,
            ..
        } = std::mem::replace(&mut *st, State::Up(None))
        else {
            imp.connected();
            *st = State::Up(Some(imp));
            return;
        };
        if self.records && !abandoned {
            self.report
                .complete(0, Opcode::Connected, WcStatus::Success, 0, None);
        }
        // After the record: none of the connection's completions can come before it (a shared
        // receive queue's receives are taken from here on; these are posted from here on).
        imp.connected();
        for r in recvs {
            let posted = RecvRequest::new(&self.ctx, &r.mr, r.offset, r.len, r.wr_id)
                .and_then(|wr| imp.recv(wr));
            if let Err(e) = posted {
                log!(Warn, "a receive held while connecting failed to post: {e}");
                self.report
                    .complete(r.wr_id, Opcode::Recv, WcStatus::General, 0, None);
            }
        }
        *st = State::Up(Some(imp));
        drop(st);
        self.changed.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn fail(&self, e: Error) {
        let mut st = self.lock();
        let State::Connecting {
            recvs,
            waker,
            abandoned,
            ..
        } = &mut *st
        else {
            return;
        };
        log!(Warn, "connecting to {} failed: {e}", self.report.peer);
        for r in recvs.drain(..) {
            self.report
                .complete(r.wr_id, Opcode::Recv, WcStatus::Flushed, 0, None);
        }
        if self.records && !*abandoned {
            // The connection's last record: it never came up.
            self.report
                .complete(0, Opcode::Connected, WcStatus::ConnectFailed, 0, None);
        }
        let waker = waker.take();
        if let Error::Rejected(d) = &e {
            let _ = self.reject_data.set(d.clone());
        }
        *st = State::Failed(e);
        drop(st);
        self.changed.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Why the handshake is to end before its outcome, if it is.
    fn ending(&self) -> Option<Error> {
        match &*self.lock() {
            State::Connecting {
                abandoned: true, ..
            } => Some(Error::State("the connection was dropped while connecting")),
            State::Connecting {
                cancelled: true, ..
            } => Some(Error::Disconnected),
            _ => None,
        }
    }

    /// The caller disconnected the connection while it connected: the handshake fails with
    /// [`Error::Disconnected`] at its next turn.
    pub(crate) fn cancel(&self) {
        if let State::Connecting { cancelled, .. } = &mut *self.lock() {
            *cancelled = true;
            self.reg.wake();
        }
    }

    /// Holds a receive until the connection is up: `Ok(true)` when held, `Ok(false)` when the
    /// connection is up (post it there), the failure when it failed.
    pub(crate) fn hold_recv(
        &self,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        wr_id: u64,
        depth: u32,
    ) -> Result<bool> {
        let mut st = self.lock();
        match &mut *st {
            State::Connecting { recvs, .. } => {
                if recvs.len() >= depth as usize {
                    return Err(Error::QueueFull("receive"));
                }
                recvs.push(HeldRecv {
                    mr: mr.clone(),
                    offset,
                    len,
                    wr_id,
                });
                Ok(true)
            }
            State::Up(_) => Ok(false),
            State::Failed(_) => Err(Error::Disconnected),
        }
    }

    /// Hands the transport's half of the connection, once it is up, to `install` (once, under
    /// the set-up's lock); the failure if the set-up failed.
    pub(crate) fn hand_over(&self, install: impl FnOnce(Box<dyn ConnSeam>)) -> Result<()> {
        match &mut *self.lock() {
            State::Connecting { .. } => Ok(()),
            State::Up(imp) => {
                if let Some(imp) = imp.take() {
                    install(imp);
                }
                Ok(())
            }
            State::Failed(e) => Err(e.duplicate()),
        }
    }

    /// Waits for the outcome: `Ok` once up, or the failure.
    pub(crate) fn wait(&self) -> Result<()> {
        let mut st = self.lock();
        loop {
            match &*st {
                State::Connecting { .. } => {
                    st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                State::Up(_) => return Ok(()),
                State::Failed(e) => return Err(e.duplicate()),
            }
        }
    }

    /// The outcome if there is one; else `waker` is woken when there is.
    pub(crate) fn poll(&self, waker: &Waker) -> Poll<Result<()>> {
        match &mut *self.lock() {
            State::Connecting { waker: w, .. } => {
                if !w.as_ref().is_some_and(|w| w.will_wake(waker)) {
                    *w = Some(waker.clone());
                }
                Poll::Pending
            }
            State::Up(_) => Poll::Ready(Ok(())),
            State::Failed(e) => Poll::Ready(Err(e.duplicate())),
        }
    }

    /// The outcome so far: `Ok(true)` up, `Ok(false)` connecting, or the failure.
    pub(crate) fn status(&self) -> Result<bool> {
        match &*self.lock() {
            State::Connecting { .. } => Ok(false),
            State::Up(_) => Ok(true),
            State::Failed(e) => Err(e.duplicate()),
        }
    }

    /// The private data of a rejection, once the set-up failed with one.
    pub(crate) fn reject_data(&self) -> &[u8] {
        self.reject_data.get().map_or(&[], |d| d.as_slice())
    }

    /// The connection is dropped before it took its transport's half: ends the handshake (its
    /// descriptors closed when this returns) and returns the half if it came up meanwhile, for
    /// the caller to drop (which tears it down).
    pub(crate) fn abandon(&self) -> Option<Box<dyn ConnSeam>> {
        let mut st = self.lock();
        loop {
            match &mut *st {
                State::Connecting { abandoned, .. } => {
                    *abandoned = true;
                    self.reg.wake();
                    st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                State::Up(imp) => {
                    if let Some(imp) = imp.take() {
                        return Some(imp);
                    }
                    // Taken by the connection before: it tears itself down.
                    return None;
                }
                State::Failed(_) => {
                    drop(st);
                    self.reg.wait_finished();
                    return None;
                }
            }
        }
    }
}

/// The driver's handler of a handshake: its turns, then its successor.
struct Turns {
    setup: Arc<Setup>,
    handshake: Box<dyn Handshake>,
    next: Option<Box<dyn Handler>>,
    /// It had a turn: a registration that failed reports nothing (its caller returns the
    /// error, and there is no connection to report on).
    ran: bool,
}

impl Handler for Turns {
    fn run(&mut self, ready: &Ready) -> Next {
        self.ran = true;
        if let Some(e) = self.setup.ending() {
            self.setup.fail(e);
            return Next::Done;
        }
        let setup = &self.setup;
        let handshake = &mut self.handshake;
        match crate::panic::catch(|| handshake.step(ready, setup)) {
            Ok(Step::Wait(Next::Done)) => {
                self.setup.fail(Error::ConnectFailed(
                    "the handshake ended without an outcome".into(),
                ));
                Next::Done
            }
            Ok(Step::Wait(next)) => next,
            Ok(Step::Up(imp, work)) => {
                self.setup.established(imp);
                self.next = Some(work);
                Next::Done
            }
            Ok(Step::Failed(e)) => {
                self.setup.fail(e);
                Next::Done
            }
            Err(msg) => {
                self.setup
                    .fail(Error::ConnectFailed(format!("internal error: {msg}")));
                Next::Done
            }
        }
    }

    fn successor(&mut self) -> Option<Box<dyn Handler>> {
        self.next.take()
    }
}

impl Drop for Turns {
    fn drop(&mut self) {
        // Only a driver that stops drops a handshake that is still running; its waiters must
        // not wait forever.
        if self.ran {
            self.setup
                .fail(Error::ConnectFailed("the progress driver stopped".into()));
        }
    }
}
