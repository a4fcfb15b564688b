//! The progress driver: one library thread per context that does the background work of all the
//! context's connections - noticing a peer leave, moving data while nobody polls, deadlines, and
//! teardown - so that a connection costs no thread of its own.
//!
//! A connection registers its file descriptors and a [`Handler`]. The driver waits on all of
//! them at once (one epoll set) and runs a connection's handler when one of its descriptors is
//! ready, when somebody wakes it through its [`Registration`], when the deadline it asked for
//! passes, or at once again when it asked for that ([`Next::Again`], for a connection that
//! spins while it moves data). Every handler that asked to run again gets one turn per round,
//! in turn, so one busy connection cannot starve the others. A handler must return quickly and
//! never block (it tries locks rather than waiting for them, and comes back later).
//!
//! A connection's teardown runs in its handler too; when the handler says [`Next::Done`] the
//! driver removes its descriptors from the set, drops it (closing what it owns), and only then
//! tells whoever waits in [`Registration::wait_finished`].
//!
//! The thread starts with the context's first connection and ends when the context is dropped
//! (which cannot happen while a connection of it still exists).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::idmap::IdMap;
use crate::sync::{YIELD_EVERY, waits_spin};
use crate::sys::{self, EventFd};

/// Most descriptors one registration may watch.
pub(crate) const MAX_FDS: usize = 4;
/// How many rounds of running busy handlers pass between two looks at the descriptors (a look
/// is a system call; the handlers' own work needs none).
const LOOK_EVERY: u64 = 16;
/// The epoll key of the driver's own doorbell (registration keys are `id << 2 | index`, and ids
/// start at 1).
const BELL: u64 = u64::MAX;

/// What a handler wants after its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Run again in the next round, without waiting.
    Again,
    /// As [`Next::Again`], for a handler that could not do its work because a thread of the
    /// program holds what it needs (a connection's lock): when every handler that asked to run
    /// again says this, the driver lets other threads run before the next round rather than
    /// spin against the holder.
    Yield,
    /// Run when a descriptor is ready, on a wake-up, or at the deadline (`None`: no deadline).
    Wait(Option<Instant>),
    /// Finished: remove the descriptors, drop the handler.
    Done,
}

/// Which of a handler's descriptors were reported ready since its last turn (epoll events, by
/// the index they were registered at).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Ready {
    events: [u32; MAX_FDS],
}

impl Ready {
    /// Whether descriptor `i` (in registration order) reported anything: data, hang-up, error.
    pub(crate) fn fd(&self, i: usize) -> bool {
        self.events.get(i).is_some_and(|&e| e != 0)
    }
}

/// A connection's background work, run on the driver's thread.
pub(crate) trait Handler: Send {
    /// One turn: look at what is ready, do what can be done now without blocking, and say what
    /// next. A panic ends the registration (as [`Next::Done`]).
    fn run(&mut self, ready: &Ready) -> Next;

    /// Asked when a turn said [`Next::Done`]: the handler that takes over this one's
    /// registration and descriptors (a connection's background work, after its handshake
    /// over the same descriptors), or `None` to end the registration.
    fn successor(&mut self) -> Option<Box<dyn Handler>> {
        None
    }
}

/// The driver of a context, started on first use. Dropping it stops the thread.
pub(crate) struct Lazy {
    running: Mutex<Option<(Driver, JoinHandle<()>)>>,
}

impl std::fmt::Debug for Lazy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let started = self.running.lock().map(|r| r.is_some()).unwrap_or_default();
        f.debug_struct("driver::Lazy")
            .field("started", &started)
            .finish()
    }
}

impl Default for Lazy {
    fn default() -> Self {
        Lazy {
            running: Mutex::new(None),
        }
    }
}

impl Lazy {
    /// The driver, started now if it was not yet.
    pub(crate) fn get(&self) -> io::Result<Driver> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((d, _)) = &*running {
            return Ok(d.clone());
        }
        let core = Arc::new(Core::new()?);
        let driver = Driver { core: core.clone() };
        let thread = std::thread::Builder::new()
            .name("rbr-driver".into())
            .spawn(move || Thread::new(core).run())?;
        *running = Some((driver.clone(), thread));
        Ok(driver)
    }
}

impl Drop for Lazy {
    fn drop(&mut self) {
        let running = self.running.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some((d, thread)) = running.take() {
            d.core.stop.store(true, Ordering::SeqCst);
            d.core.bell.signal();
            // The last user of a context may be let go on the driver's own thread (inside a
            // handler being dropped); it then ends by itself after this round.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// A handle on a running driver, for registering connections.
#[derive(Clone)]
pub(crate) struct Driver {
    core: Arc<Core>,
}

impl Driver {
    /// A new registration, not yet running: hand it to the handler's state (to wake it), then
    /// [`register`](Self::register) the handler under it.
    pub(crate) fn registration(&self) -> Registration {
        Registration {
            core: self.core.clone(),
            slot: Arc::new(Slot {
                // Relaxed: ids only need to be unique.
                id: self.core.next_id.fetch_add(1, Ordering::Relaxed),
                woken: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                finished: Mutex::new(false),
                done: Condvar::new(),
                added: Mutex::new(Vec::new()),
                grew: AtomicBool::new(false),
            }),
        }
    }

    /// Starts running `handler` under `reg` for `fds` (level-triggered `EPOLLIN`): its first
    /// turn comes at once. The handler must keep the descriptors open until it is dropped.
    /// On failure nothing is registered and `handler` is dropped here.
    pub(crate) fn register(
        &self,
        reg: &Registration,
        fds: &[RawFd],
        handler: Box<dyn Handler>,
    ) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let id = reg.slot.id;
        let mut list = [-1; MAX_FDS];
        list[..fds.len()].copy_from_slice(fds);
        let mut failed = None;
        // The descriptors join the set under the inbox's lock, with the entry posted in the
        // same hold: a descriptor ready at once (a socket not yet connected polls as hung up)
        // names an entry the thread does not have yet, and the thread then reads its mail,
        // which waits for this post, rather than spinning on the event meanwhile.
        self.core.post(|inbox| {
            for (i, &fd) in fds.iter().enumerate() {
                if let Err(e) = self.core.ctl(libc::EPOLL_CTL_ADD, fd, id << 2 | i as u64) {
                    for &added in &fds[..i] {
                        let _ = self.core.ctl(libc::EPOLL_CTL_DEL, added, 0);
                    }
                    failed = Some(e);
                    return;
                }
            }
            inbox.new.push(Entry {
                handler,
                slot: reg.slot.clone(),
                fds: list,
                nfds: fds.len(),
                ready: Ready::default(),
                deadline: None,
                round: 0,
            })
        });
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// One registration's handle, for waking its handler, asking it to stop, and waiting for its
/// end.
#[derive(Clone)]
pub(crate) struct Registration {
    core: Arc<Core>,
    slot: Arc<Slot>,
}

struct Slot {
    id: u64,
    /// A wake-up is on its way to the driver.
    woken: AtomicBool,
    /// The owner asked the handler to end (see [`Registration::stop`]).
    stop: AtomicBool,
    finished: Mutex<bool>,
    done: Condvar,
    /// Descriptors the handler added in its turn (see [`Registration::watch`]), by index,
    /// for the driver to record once the turn is over.
    added: Mutex<Vec<(usize, RawFd)>>,
    /// `added` holds something.
    grew: AtomicBool,
}

impl Slot {
    fn finish(&self) {
        *self.finished.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.done.notify_all();
    }
}

impl Registration {
    /// Has the handler run soon (once, however often this is called before it does).
    pub(crate) fn wake(&self) {
        // AcqRel: pairs with the driver's clearing of the flag before the handler's turn, so a
        // wake-up after that clearing is never merged into the turn that already started.
        if !self.slot.woken.swap(true, Ordering::AcqRel) {
            let id = self.slot.id;
            self.core.post(|inbox| inbox.woken.push(id));
        }
    }

    /// Asks the handler to end (a connection's disconnect) and has it run soon. Idempotent.
    pub(crate) fn stop(&self) {
        self.slot.stop.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Has the driver listen to the registration's `i`-th descriptor `fd` again (`on`), or
    /// not (its events then wait for whoever else takes them, as a queue's pollers take a
    /// device's completion events while they sleep on the queue's descriptor). The
    /// registration must be running (not yet ended).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn listen(&self, i: usize, fd: RawFd, on: bool) -> io::Result<()> {
        let events = if on { libc::EPOLLIN as u32 } else { 0 };
        self.core.ctl_events(
            libc::EPOLL_CTL_MOD,
            fd,
            self.slot.id << 2 | i as u64,
            events,
        )
    }

    /// From the handler's own turn: has the driver listen to `fd` as the registration's
    /// `i`-th descriptor from now on (a handshake that makes its descriptor on the driver's
    /// thread rather than on its caller's). It leaves the set when the registration ends.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn watch(&self, i: usize, fd: RawFd) -> io::Result<()> {
        if i >= MAX_FDS {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.core
            .ctl(libc::EPOLL_CTL_ADD, fd, self.slot.id << 2 | i as u64)?;
        let mut added = self.slot.added.lock().unwrap_or_else(|p| p.into_inner());
        added.push((i, fd));
        // Relaxed: read by the same thread, once the turn is over.
        self.slot.grew.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Whether [`stop`](Self::stop) was called.
    pub(crate) fn stop_asked(&self) -> bool {
        self.slot.stop.load(Ordering::SeqCst)
    }

    /// Whether the handler has said [`Next::Done`] (or failed) and has been dropped.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn finished(&self) -> bool {
        *self.slot.finished.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the handler has said [`Next::Done`] (or failed) and has been dropped.
    /// Bounded as long as handlers finish in bounded time: the driver never blocks.
    pub(crate) fn wait_finished(&self) {
        let mut finished = self.slot.finished.lock().unwrap_or_else(|p| p.into_inner());
        while !*finished {
            finished = self
                .slot
                .done
                .wait(finished)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What user threads hand to the driver's thread.
#[derive(Default)]
struct Inbox {
    new: Vec<Entry>,
    woken: Vec<u64>,
}

/// The state the driver's thread shares with its users.
struct Core {
    epoll: OwnedFd,
    /// Rung when the inbox gets something while the thread sleeps, and to stop it.
    bell: EventFd,
    inbox: Mutex<Inbox>,
    /// The inbox holds something.
    mail: AtomicBool,
    /// The thread sleeps (or is about to) and wants `bell` rung for new mail.
    sleeping: AtomicBool,
    stop: AtomicBool,
    next_id: AtomicU64,
}

impl Core {
    fn new() -> io::Result<Core> {
        // SAFETY: epoll_create1 takes no pointers; a non-negative return is a new descriptor.
        let fd = sys::cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` was just returned by epoll_create1 and is owned by nobody else.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        let core = Core {
            epoll,
            bell: EventFd::new()?,
            inbox: Mutex::new(Inbox::default()),
            mail: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
        };
        core.ctl(libc::EPOLL_CTL_ADD, core.bell.raw(), BELL)?;
        Ok(core)
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, key: u64) -> io::Result<()> {
        self.ctl_events(op, fd, key, libc::EPOLLIN as u32)
    }

    fn ctl_events(&self, op: libc::c_int, fd: RawFd, key: u64, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: key };
        // SAFETY: `ev` is a live epoll_event (ignored for EPOLL_CTL_DEL); the epoll descriptor
        // is ours; a bad `fd` is reported as an error, not undefined behaviour.
        sys::cvt(unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) }).map(drop)
    }

    /// Puts something in the inbox and rings the bell if the thread sleeps.
    fn post(&self, f: impl FnOnce(&mut Inbox)) {
        {
            let mut inbox = self.inbox.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut inbox);
            // SeqCst: see the fence below.
            self.mail.store(true, Ordering::SeqCst);
        }
        // SeqCst fence: the mail above is ordered before reading `sleeping`, pairing with the
        // thread's store of `sleeping` before its last look at `mail` (Dekker): either it sees
        // the mail, or we see it sleeping and ring.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) && self.sleeping.swap(false, Ordering::SeqCst) {
            self.bell.signal();
        }
    }

    /// Swaps the inbox with `into` (empty, its capacity kept for the next mail).
    fn take_mail(&self, into: &mut Inbox) {
        let mut inbox = self.inbox.lock().unwrap_or_else(|p| p.into_inner());
        self.mail.store(false, Ordering::SeqCst);
        std::mem::swap(&mut *inbox, into);
    }
}

/// One registration, owned by the driver's thread.
struct Entry {
    handler: Box<dyn Handler>,
    slot: Arc<Slot>,
    fds: [RawFd; MAX_FDS],
    nfds: usize,
    /// What happened since its last turn.
    ready: Ready,
    /// When it wants its next turn at the latest.
    deadline: Option<Instant>,
    /// The round it is due in (so it runs once per round however many reasons it has).
    round: u64,
}

impl Entry {
    /// Takes the descriptors its handler added in its turn into its list, which the
    /// registration's end removes from the set.
    #[cold]
    fn record_added(&mut self) {
        self.slot.grew.store(false, Ordering::Relaxed);
        let mut added = self.slot.added.lock().unwrap_or_else(|p| p.into_inner());
        for (i, fd) in added.drain(..) {
            self.fds[i] = fd;
            self.nfds = self.nfds.max(i + 1);
        }
    }
}

/// The driver's thread.
struct Thread {
    core: Arc<Core>,
    entries: IdMap<u64, Entry>,
    /// The inbox last taken, emptied: handed back to the core with the next take, so that
    /// wake-ups allocate nothing.
    spare: Inbox,
    /// Deadlines, soonest first; an element whose entry has another deadline now is stale.
    timers: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Registrations that asked to run again at once.
    busy: Vec<u64>,
    /// How many of them waited for a thread of the program ([`Next::Yield`]).
    yielding: usize,
    due: Vec<u64>,
    round: u64,
}

impl Thread {
    fn new(core: Arc<Core>) -> Thread {
        Thread {
            core,
            entries: IdMap::default(),
            spare: Inbox::default(),
            timers: BinaryHeap::new(),
            busy: Vec::new(),
            yielding: 0,
            due: Vec::new(),
            round: 0,
        }
    }

    fn run(mut self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        let mut yielded = Instant::now();
        while !self.core.stop.load(Ordering::SeqCst) {
            self.round += 1;
            if self.busy.is_empty() || self.round % LOOK_EVERY == 0 {
                self.look(&mut events);
            }
            if self.core.mail.load(Ordering::SeqCst) {
                self.read_mail();
            }
            self.expire_timers();
            for id in std::mem::take(&mut self.busy) {
                self.mark(id);
            }
            self.turns();
            if self.yielding > 0 && self.yielding == self.busy.len() {
                // Everyone busy waits for a thread of the program: let it run.
                std::thread::yield_now();
            } else if !self.busy.is_empty() && self.round % LOOK_EVERY == 0 && waits_spin() {
                // Busy rounds hold the CPU while a program's thread polls in a wait, perhaps
                // on this CPU, for what these rounds produce: share it (see `waits_spin`).
                let now = Instant::now();
                if now >= yielded + YIELD_EVERY {
                    std::thread::yield_now();
                    yielded = now;
                }
            }
        }
        // Stopped: only by the owner going away, which a connection prevents while it lives.
        // Whatever is left is dropped, so nobody waits for it forever.
        self.read_mail();
        for id in self.entries.keys().copied().collect::<Vec<_>>() {
            self.remove(id);
        }
    }

    /// Waits for descriptors (not at all while handlers are busy, else until the next
    /// deadline) and notes which registrations they belong to.
    fn look(&mut self, events: &mut [libc::epoll_event]) {
        let mut timeout = if self.busy.is_empty() {
            self.next_deadline()
                .map(|d| d.saturating_duration_since(Instant::now()))
        } else {
            Some(Duration::ZERO)
        };
        let sleeps = timeout != Some(Duration::ZERO);
        if sleeps {
            self.core.sleeping.store(true, Ordering::SeqCst);
            // SeqCst fence: `sleeping` is set before the last look at the mail (Dekker with
            // `Core::post`).
            fence(Ordering::SeqCst);
            if self.core.mail.load(Ordering::SeqCst) || self.core.stop.load(Ordering::SeqCst) {
                timeout = Some(Duration::ZERO);
            }
        }
        // SAFETY: `events` is a live, exclusively borrowed buffer whose length is passed; the
        // epoll descriptor is ours.
        let n = unsafe {
            libc::epoll_wait(
                self.core.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len().min(i32::MAX as usize) as libc::c_int,
                sys::poll_ms(timeout),
            )
        };
        if sleeps {
            self.core.sleeping.store(false, Ordering::SeqCst);
        }
        let mut unknown = false;
        // An interruption (or any failure) is a look that found nothing.
        for ev in events.iter().take(n.max(0) as usize) {
            let (key, what) = (ev.u64, ev.events);
            if key == BELL {
                self.core.bell.clear();
                continue;
            }
            let (id, i) = (key >> 2, (key & 3) as usize);
            if let Some(e) = self.entries.get_mut(&id) {
                e.ready.events[i] |= what;
                self.mark(id);
            } else {
                unknown = true;
            }
        }
        if unknown {
            // A registration being posted (see `Driver::register`): its entry is in the mail.
            self.read_mail();
        }
    }

    fn read_mail(&mut self) {
        let mut inbox = std::mem::take(&mut self.spare);
        self.core.take_mail(&mut inbox);
        for e in inbox.new.drain(..) {
            let id = e.slot.id;
            self.entries.insert(id, e);
            self.mark(id);
        }
        for &id in &inbox.woken {
            if let Some(e) = self.entries.get_mut(&id) {
                // AcqRel: pairs with `Registration::wake`; a wake-up from now on is a new one.
                e.slot.woken.swap(false, Ordering::AcqRel);
                self.mark(id);
            }
        }
        inbox.woken.clear();
        self.spare = inbox;
    }

    /// The soonest deadline, dropping stale timers on the way.
    fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if self.entries.get(&id).is_some_and(|e| e.deadline == Some(t)) {
                return Some(t);
            }
            self.timers.pop();
        }
        None
    }

    fn expire_timers(&mut self) {
        let now = Instant::now();
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            if self.entries.get(&id).is_some_and(|e| e.deadline == Some(t)) {
                self.mark(id);
            }
        }
    }

    fn mark(&mut self, id: u64) {
        if let Some(e) = self.entries.get_mut(&id)
            && e.round != self.round
        {
            e.round = self.round;
            self.due.push(id);
        }
    }

    /// Gives every registration due this round its turn, in the order they became due.
    fn turns(&mut self) {
        let due = std::mem::take(&mut self.due);
        self.yielding = 0;
        for &id in &due {
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            let ready = std::mem::take(&mut e.ready);
            e.deadline = None;
            let next = crate::panic::catch(|| e.handler.run(&ready)).unwrap_or(Next::Done);
            if e.slot.grew.load(Ordering::Relaxed) {
                e.record_added();
            }
            match next {
                Next::Again => self.busy.push(id),
                Next::Yield => {
                    self.busy.push(id);
                    self.yielding += 1;
                }
                Next::Wait(None) => {}
                Next::Wait(Some(t)) => {
                    e.deadline = Some(t);
                    self.timers.push(Reverse((t, id)));
                }
                Next::Done => match crate::panic::catch(|| e.handler.successor()) {
                    Ok(Some(next)) => {
                        let done = std::mem::replace(&mut e.handler, next);
                        let _ = crate::panic::catch(move || drop(done));
                        // The successor's first turn comes in the next round.
                        self.busy.push(id);
                    }
                    _ => self.remove(id),
                },
            }
        }
        self.due = due;
        self.due.clear();
        // Stale timers pile up when handlers change their deadlines often: keep the heap
        // within a few times the live ones.
        if self.timers.len() > 64 && self.timers.len() > 4 * self.entries.len() {
            let entries = &self.entries;
            self.timers.retain(|&Reverse((t, id))| {
                entries.get(&id).is_some_and(|e| e.deadline == Some(t))
            });
        }
    }

    /// Ends a registration: its descriptors leave the set before the handler (which may own
    /// them) is dropped, then its waiter is told.
    fn remove(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        for &fd in &e.fds[..e.nfds] {
            let _ = self.core.ctl(libc::EPOLL_CTL_DEL, fd, 0);
        }
        let Entry { handler, slot, .. } = e;
        // A panic while dropping is the handler's to report; the waiter is told either way.
        let _ = crate::panic::catch(move || drop(handler));
        slot.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::mpsc::{Receiver, Sender, channel};

    const LONG: Duration = Duration::from_secs(10);

    /// Asks to run again on every turn until told to stop; counts its turns.
    struct Spinner {
        turns: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
        dropped: Arc<AtomicBool>,
    }

    impl Handler for Spinner {
        fn run(&mut self, _: &Ready) -> Next {
            self.turns.fetch_add(1, Ordering::SeqCst);
            if self.stop.load(Ordering::SeqCst) {
                Next::Done
            } else {
                Next::Again
            }
        }
    }

    impl Drop for Spinner {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    /// Reports each turn ("ready" when its descriptor was, else "turn"), then waits for
    /// `every` (or without deadline).
    struct Probe {
        tx: Sender<&'static str>,
        efd: Option<Arc<EventFd>>,
        every: Option<Duration>,
    }

    impl Handler for Probe {
        fn run(&mut self, ready: &Ready) -> Next {
            if ready.fd(0) {
                self.efd
                    .as_ref()
                    .expect("registered with a descriptor")
                    .clear();
                let _ = self.tx.send("ready");
            } else {
                let _ = self.tx.send("turn");
            }
            Next::Wait(self.every.map(|d| Instant::now() + d))
        }
    }

    fn probe(
        d: &Driver,
        efd: Option<Arc<EventFd>>,
        every: Option<Duration>,
    ) -> (Registration, Receiver<&'static str>) {
        let (tx, rx) = channel();
        let reg = d.registration();
        let fds: Vec<RawFd> = efd.iter().map(|e| e.raw()).collect();
        d.register(&reg, &fds, Box::new(Probe { tx, efd, every }))
            .unwrap();
        assert_eq!(
            rx.recv_timeout(LONG),
            Ok("turn"),
            "the first turn comes at once"
        );
        (reg, rx)
    }

    /// While one handler spins without end, the others still run for their descriptors,
    /// wake-ups and deadlines; the spinner's end is waited for, after it was dropped.
    #[test]
    fn a_spinning_handler_does_not_starve_the_others() {
        let lazy = Lazy::default();
        let d = lazy.get().unwrap();
        let turns = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(AtomicBool::new(false));
        let spin = d.registration();
        let spinner = Spinner {
            turns: turns.clone(),
            stop: stop.clone(),
            dropped: dropped.clone(),
        };
        d.register(&spin, &[], Box::new(spinner)).unwrap();
        let t = Instant::now();
        while turns.load(Ordering::SeqCst) < 1000 {
            assert!(t.elapsed() < LONG, "the spinner does not run");
            std::thread::yield_now();
        }

        let efd = Arc::new(EventFd::new().unwrap());
        let (reg, rx) = probe(&d, Some(efd.clone()), None);
        efd.signal();
        assert_eq!(rx.recv_timeout(LONG), Ok("ready"));
        reg.wake();
        assert_eq!(rx.recv_timeout(LONG), Ok("turn"));

        let (_timed, rx) = probe(&d, None, Some(Duration::from_millis(5)));
        for _ in 0..3 {
            assert_eq!(
                rx.recv_timeout(LONG),
                Ok("turn"),
                "the deadline passed unseen"
            );
        }

        stop.store(true, Ordering::SeqCst);
        spin.wait_finished();
        assert!(
            dropped.load(Ordering::SeqCst),
            "finished before it was dropped"
        );
    }

    /// A handler that panics ends its registration: its waiter is not left waiting.
    #[test]
    fn a_panicking_handler_is_finished() {
        struct Panics;
        impl Handler for Panics {
            fn run(&mut self, _: &Ready) -> Next {
                panic!("handler bug");
            }
        }
        let lazy = Lazy::default();
        let d = lazy.get().unwrap();
        let reg = d.registration();
        d.register(&reg, &[], Box::new(Panics)).unwrap();
        reg.wait_finished();
    }
}
