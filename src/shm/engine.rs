//! The background work of one shm connection, run by its context's progress driver
//! (`crate::driver`). It notices the peer leaving (its socket's end of file) and the user's
//! disconnect, moves data while nobody else does - always with
//! [`Progress::Thread`](crate::Progress::Thread), and with
//! [`Progress::Caller`](crate::Progress::Caller) only while somebody sleeps on the completion
//! queue or watches its descriptor - and tears the connection down. The busy path, posting and
//! polling, never waits for it, and it never waits for them: where they hold the connection's
//! lock it comes back on a later turn.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use crate::conn::End;
use crate::conn::{ConnOptions, Setup};
use crate::cq::CompletionQueue;
use crate::cq::{Sink, WcStatus};
use crate::driver::{Handler, Next, Ready};
use crate::error::Result;
use crate::shm::bell;
use crate::shm::conn::{Conn, ConnState, FlowGuard, Link, Unstarted};
use crate::shm::wire::{BYE, send_packet};

/// Starts a connection over an established handshake socket and segment: its state, its place
/// among its queue's sources (or on the queue's notice board), and the background work that
/// takes over the handshake's registration on the context's driver.
pub(crate) fn start(
    setup: &Setup,
    cq: Arc<CompletionQueue>,
    opts: &ConnOptions,
    link: Link,
    peer_private_data: Vec<u8>,
) -> Result<(Conn, Box<Engine>)> {
    let Unstarted { sh, sock, slot } = Unstarted::new(setup, cq, opts, link)?;
    // Before the background work starts, so that its teardown's removal always comes after.
    if slot.is_some() {
        // The connection starts on the board, not polled every time: the peer marks it.
        // Asked for before the queue's first look at it, so no message falls between.
        sh.lock().set_want_mark(true);
    }
    if sh.caller_polls {
        match slot {
            Some(r) => sh.report.cq.add_source_at(sh.clone(), r),
            None => sh.report.cq.add_source(sh.clone()),
        }
    }
    let engine = Box::new(Engine::new(sh.clone(), sock));
    Ok((Conn::new(sh, peer_private_data), engine))
}

/// While the driver moves a connection's data: how long it keeps looking at it after the last
/// movement before the connection sleeps.
const SPIN: Duration = Duration::from_micros(50);
/// Longest single sleep; each wake-up re-checks everything.
const MAX_SLEEP: Duration = Duration::from_millis(500);
/// Longest sleep of a connection whose lock a poster held (see `Engine::contended`).
const POSTER_MISSED: Duration = Duration::from_millis(1);
/// How long the pollers may leave the connection alone before the driver assists them.
const IDLE: Duration = Duration::from_millis(10);

pub(crate) struct Engine {
    sh: Arc<ConnState>,
    /// The handshake socket (descriptor 0 of the registration): doorbells, goodbye, hang-up.
    sock: OwnedFd,
    /// The pollers' count of polls when this connection's last turn looked.
    seen_polls: u64,
    /// While it moves data: since when nothing moved (it spins for [`SPIN`], then sleeps).
    idle_since: Option<Instant>,
    /// The last turn went to sleep and asked posters for a wake-up (`engine_sleeping`).
    slept: bool,
    /// The connection is ending for this reason: the peer has been told and the rest of the
    /// teardown waits for the connection's lock.
    ending: Option<End>,
    /// The inbox's count of forgotten imports when the posters' cache was last cleaned.
    forgotten_seen: u64,
}

/// How often a turn tries the connection's lock before it gives up and comes back later.
const LOCK_TRIES: u32 = 64;

/// The connection's lock if it comes free at once: a poster or poller holding it is moving the
/// connection itself (and holds it only briefly), and the driver must not wait for it.
fn try_lock(sh: &ConnState) -> Option<FlowGuard<'_>> {
    for _ in 0..LOCK_TRIES {
        match sh.try_lock() {
            Some(g) => return Some(g),
            None => std::hint::spin_loop(),
        }
    }
    None
}

impl Engine {
    pub(crate) fn new(sh: Arc<ConnState>, sock: OwnedFd) -> Engine {
        Engine {
            sh,
            sock,
            seen_polls: u64::MAX,
            idle_since: None,
            slept: false,
            ending: None,
            forgotten_seen: 0,
        }
    }

    /// Whether this connection's turns move data now (rather than the pollers of the queue).
    fn drives(&self) -> bool {
        self.sh.library_moves()
    }

    /// One turn while the connection is up: `Err` when it must end.
    fn turn(&mut self, ready: &Ready) -> std::result::Result<Next, End> {
        if self.slept {
            // Woken (or the sleep ran out): posters need not wake us while we look.
            self.slept = false;
            self.sh.engine_sleeping.store(false, Ordering::SeqCst);
            self.idle_since = None;
        }
        if ready.fd(0) {
            self.drain_socket()?;
            if !self.drives() {
                // Perhaps a doorbell the peer could not ring on the queue's bell: the pollers
                // that may sleep on the queue's descriptor look.
                self.sh.report.cq.ring_bell();
            }
        }
        if self.sh.wake.stop_asked() {
            return Err(End::Local);
        }
        self.clean_import_cache();
        if !self.drives() {
            return self.assist();
        }
        let Some(mut flow) = try_lock(&self.sh) else {
            return Ok(self.contended());
        };
        let cq = &self.sh.report.cq;
        let moved = flow.step(&self.sh.report, usize::MAX, &mut Sink::queue(cq));
        if let Some(end) = flow.failed {
            return Err(end);
        }
        // Packets the step read from the socket (a goodbye, an end) are looked at next round.
        let moved = flow.take_inbox_news() || moved;
        drop(flow);
        if moved {
            self.idle_since = None;
            return Ok(Next::Again);
        }
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < SPIN {
            return Ok(Next::Again);
        }
        // Ask the peer for a doorbell and our posters for a wake-up, then look once more
        // before sleeping (Dekker with the peer's `ring_peer` and our posters' `kick`).
        self.sh.engine_sleeping.store(true, Ordering::SeqCst);
        self.slept = true;
        let Some(flow) = try_lock(&self.sh) else {
            return Ok(self.contended());
        };
        // What the sleep waits for, as of now: a post meanwhile kicks this work, whose next
        // sleep asks again.
        flow.set_sleeping(flow.sleep_request());
        Ok(if flow.has_work() {
            Next::Again
        } else {
            Next::Wait(Some(Instant::now() + MAX_SLEEP))
        })
    }

    /// Drops the posters' cached import once the inbox forgot it (the peer withdrew the
    /// region), so that its mapping goes now rather than at the next one-sided operation.
    /// When a poster holds the lock, a later turn (each comes within [`MAX_SLEEP`]) tries again.
    fn clean_import_cache(&mut self) {
        // Acquire: pairs with the inbox's count.
        let forgotten = self.sh.imports_forgotten.load(Ordering::Acquire);
        if forgotten == self.forgotten_seen {
            return;
        }
        // The posters hold the cache's lock only briefly: wait for it.
        self.sh.lock_imports().drop_stale(forgotten);
        self.forgotten_seen = forgotten;
    }

    /// What a turn that moves data does when a thread of the program holds the connection's
    /// lock (it is moving the connection itself meanwhile). With progress threads only posters
    /// take it, and each wakes the connection after its post if it says it sleeps: so it
    /// sleeps (Dekker with `kick`), for at most [`POSTER_MISSED`] in case the post failed
    /// (a failed post wakes nobody). Pollers wake nobody: come back next round.
    fn contended(&mut self) -> Next {
        if self.sh.caller_polls {
            return Next::Yield;
        }
        self.sh.engine_sleeping.store(true, Ordering::SeqCst);
        self.slept = true;
        // SeqCst fence: the store above comes before the look at the lock, pairing with the
        // fence in `kick` after the poster let go of it.
        fence(Ordering::SeqCst);
        match self.sh.try_lock() {
            None => Next::Wait(Some(Instant::now() + POSTER_MISSED)),
            Some(_) => Next::Again,
        }
    }

    /// A turn while the pollers drive ([`Progress::Caller`](crate::Progress::Caller), nobody
    /// sleeping on the queue): no doorbell from the peer is needed while they do. When they
    /// stop (no poll for [`IDLE`]) the connection's turns assist them: they ask the peer for
    /// doorbells and move what it announces - messages into the posted receives, sends that
    /// waited for ring space - so that nothing waits for this side to poll again.
    /// The same for sends that wait, at once.
    fn assist(&mut self) -> std::result::Result<Next, End> {
        self.idle_since = None;
        // Relaxed: only a sign of life of the pollers, sampled.
        let polls = self.sh.report.cq.polls();
        let assist = polls == self.seen_polls;
        self.seen_polls = polls;
        let Some(mut flow) = try_lock(&self.sh) else {
            // Somebody moves the connection right now; look again next round.
            return Ok(Next::Yield);
        };
        let help = assist || flow.blocked();
        if help {
            let cq = &self.sh.report.cq;
            flow.step(&self.sh.report, usize::MAX, &mut Sink::queue(cq));
        }
        if let Some(end) = flow.failed {
            return Err(end);
        }
        if flow.take_inbox_news() {
            // Packets the step read from the socket (a goodbye, an end): looked at at once.
            return Ok(Next::Again);
        }
        let help = assist || flow.blocked();
        // A poller's request for the queue's bell stands until the peer rings it.
        let queue = match flow.sleeping() & bell::QUEUE {
            0 => 0,
            q => q | flow.sleep_request(),
        };
        // Everything, while it assists: posts do not kick it (see `ConnState::posted`).
        flow.set_sleeping(queue | if help { bell::RECORDS | bell::TAKEN } else { 0 });
        let work = help && flow.has_work();
        Ok(if work {
            Next::Again
        } else if assist {
            Next::Wait(Some(Instant::now() + MAX_SLEEP))
        } else {
            Next::Wait(Some(Instant::now() + IDLE))
        })
    }

    /// Reads the socket's packets (doorbells, goodbye, offers of regions: see `wire.rs`); an
    /// end of file means the peer is gone.
    fn drain_socket(&mut self) -> std::result::Result<(), End> {
        let mut inbox = self.sh.lock_inbox();
        inbox.drain(self.sock.as_raw_fd());
        if inbox.eof {
            return Err(End::Peer {
                clean: inbox.said_bye && !inbox.broken,
            });
        }
        Ok(())
    }

    /// Starts ending the connection: tells the peer (goodbye when the user ended it, then
    /// end of file at once) and takes it away from the pollers, who no longer drive it; from
    /// here the driver alone completes it.
    fn begin_teardown(&mut self, end: End) {
        self.ending = Some(end);
        if end == End::Local {
            send_packet(self.sock.as_raw_fd(), BYE);
        }
        // SAFETY: plain syscall on our own socket; the peer sees end of file at once.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
        self.sh.report.cq.remove_source(self.sh.info.id);
    }

    /// Finishes ending the connection once its lock is free: takes what the peer delivered,
    /// completes everything else as flushed, and reports the disconnect as this connection's
    /// last completion.
    fn finish_teardown(&mut self, end: End) -> Next {
        let Some(mut flow) = try_lock(&self.sh) else {
            return Next::Yield;
        };
        let cq = &self.sh.report.cq;
        let end = flow.close(end, &self.sh.report, &mut Sink::queue(cq));
        self.sh.lock_imports().set(0, None);
        drop(flow);
        // Nothing is reachable through the connection any more, either way.
        self.sh.exports.close();
        self.sh.lock_inbox().clear();
        end.report(&self.sh.report);
        Next::Done
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The socket closes with the engine, however it ended: the connection's regions stop
        // being reachable and its withdrawal notices stop using the socket before that.
        self.sh.exports.close();
    }
}

impl Handler for Engine {
    fn run(&mut self, ready: &Ready) -> Next {
        let end = match self.ending {
            Some(end) => end,
            None => {
                let end = match crate::panic::catch(|| self.turn(ready)) {
                    Ok(Ok(next)) => return next,
                    Ok(Err(end)) => end,
                    Err(_) => End::Failed(WcStatus::General),
                };
                self.begin_teardown(end);
                end
            }
        };
        self.finish_teardown(end)
    }
}
