//! Edge-triggered waiters on a completion queue's descriptor (`EPOLLET`, as tokio and mio
//! register it): a server answering pings on several connections sleeps only in `epoll_wait`,
//! after polling its queue until it is empty, and must never sleep with a completion queued.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::*;
use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Connection, Context, MemoryRegion, Opcode, SendFlags,
    WcStatus,
};

/// Connections the ping-pong runs over, on one completion queue at each end.
pub const CONNS: usize = 4;
/// Bytes of a ping (and its echo): the round's number.
const PING: usize = 8;
/// Receives each server connection keeps posted, each in a slot of its own that is reposted
/// once the echo sent from it has completed.
const SLOTS: usize = 4;
/// How long the server may sleep with a completion queued before that counts as a stall: far
/// longer than any round trip, even on a loaded machine, yet far shorter than forever.
pub const STALL: Duration = Duration::from_secs(1);
/// Ceiling for a whole run: a run that stalls for good fails here at the latest.
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// Round trips of a test run: `RBR_EDGE_ROUNDS` when set (the long runs), else `default`.
pub fn rounds(default: u64) -> u64 {
    std::env::var("RBR_EDGE_ROUNDS")
        .ok()
        .map_or(default, |s| s.parse().expect("RBR_EDGE_ROUNDS is a count"))
}

/// Threads that only spin, beside a test, for the run's length: the machine made busy the way
/// that shows lost wake-ups (the waiter's thread is preempted at the wrong moment). Dropped:
/// they stop.
pub struct BusyLoops(Arc<AtomicBool>, Vec<std::thread::JoinHandle<()>>);

impl BusyLoops {
    pub fn start(n: usize) -> BusyLoops {
        let stop = Arc::new(AtomicBool::new(false));
        let hs = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        BusyLoops(stop, hs)
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        for h in self.1.drain(..) {
            let _ = h.join();
        }
    }
}

/// `CONNS` connections from one client queue to one server queue.
pub struct Mesh {
    pub ctx: Context,
    pub clients: Vec<Connection>,
    pub ccq: Arc<CompletionQueue>,
    pub servers: Vec<Connection>,
    pub scq: Arc<CompletionQueue>,
}

impl Mesh {
    pub fn new(net: &Net) -> Mesh {
        let ctx = Context::new().unwrap();
        let addr = net.addr("edge");
        let l = ctx.listen(&addr, CONNS as u32).unwrap();
        let ccq = CompletionQueue::new().unwrap();
        let scq = CompletionQueue::new().unwrap();
        let opts = ConnOptions::default();
        // Which server connection answers which client does not matter: each echoes on its
        // own connection.
        let (clients, servers) = std::thread::scope(|s| {
            let h = s.spawn(|| {
                (0..CONNS)
                    .map(|_| {
                        l.get_request(Some(Duration::from_secs(30)))
                            .unwrap()
                            .accept(&scq, &opts)
                            .unwrap()
                    })
                    .collect::<Vec<_>>()
            });
            let c: Vec<_> = (0..CONNS)
                .map(|_| ctx.connect(&addr, &ccq, &opts).unwrap())
                .collect();
            (c, h.join().unwrap())
        });
        Mesh {
            ctx,
            clients,
            ccq,
            servers,
            scq,
        }
    }
}

/// The server's side of the ping-pong, whatever it sleeps in: posts its receives, then
/// [`Echo::handle`] answers each ping with a signaled send from the slot it arrived in and
/// reposts the slot once that send has completed.
pub struct Echo<'a> {
    conns: &'a [Connection],
    mrs: Vec<Arc<MemoryRegion>>,
    pub answered: u64,
}

impl<'a> Echo<'a> {
    pub fn new(ctx: &Context, conns: &'a [Connection]) -> Echo<'a> {
        let mrs: Vec<_> = conns
            .iter()
            .map(|_| ctx.alloc_mr(SLOTS * PING, Access::LOCAL_WRITE).unwrap())
            .collect();
        for (i, c) in conns.iter().enumerate() {
            for s in 0..SLOTS {
                c.post_recv(&mrs[i], s * PING, PING, slot_id(i, s)).unwrap();
            }
        }
        Echo {
            conns,
            mrs,
            answered: 0,
        }
    }

    /// One completion of the server's queue.
    pub fn handle(&mut self, c: rdmabridge::Completion) {
        assert_eq!(c.status, WcStatus::Success, "server: {c:?}");
        let (i, s) = ((c.wr_id >> 8) as usize, (c.wr_id & 0xff) as usize);
        match c.opcode {
            Opcode::Recv => {
                assert_eq!(c.byte_len as usize, PING, "server: {c:?}");
                self.conns[i]
                    .post_send(&self.mrs[i], s * PING, PING, c.wr_id, SendFlags::SIGNALED)
                    .unwrap();
                self.answered += 1;
            }
            Opcode::Send => self.conns[i]
                .post_recv(&self.mrs[i], s * PING, PING, c.wr_id)
                .unwrap(),
            _ => panic!("server: unexpected {c:?}"),
        }
    }
}

fn slot_id(conn: usize, slot: usize) -> u64 {
    ((conn as u64) << 8) | slot as u64
}

/// The client's side: `rounds` pings in all, one in flight per connection, each echo checked;
/// polls and waits in the library (caller progress, no descriptor). Runs on its own thread.
pub fn ping(mesh: &Mesh, rounds: u64) {
    ping_with(mesh, rounds, || next(&mesh.ccq));
}

/// [`ping`] as an `EPOLLIN | EPOLLET` event loop on the client queue's descriptor: poll until
/// `None`, then sleep in `epoll_wait`. Returns how often a wait timed out ([`STALL`]) with a
/// completion there to take.
pub fn ping_epoll(mesh: &Mesh, rounds: u64) -> u32 {
    let cq = &mesh.ccq;
    let ep = EdgeWaiter::on(&**cq);
    let mut stalls = 0;
    let limit = Instant::now() + RUN_LIMIT;
    ping_with(mesh, rounds, || {
        loop {
            if let Some(c) = cq.poll() {
                return c;
            }
            assert!(Instant::now() < limit, "run not done within {RUN_LIMIT:?}");
            if !ep.wait(STALL) && !cq.is_empty() {
                stalls += 1;
            }
        }
    });
    stalls
}

/// [`ping`], taking each completion from `next`.
fn ping_with(mesh: &Mesh, rounds: u64, mut next: impl FnMut() -> rdmabridge::Completion) {
    let mrs: Vec<_> = mesh
        .clients
        .iter()
        .map(|_| mesh.ctx.alloc_mr(2 * PING, Access::LOCAL_WRITE).unwrap())
        .collect();
    // Per connection: the round in flight, whether its send and its echo have completed.
    let mut state = vec![(0u64, true, true); CONNS];
    let mut started = 0u64;
    let mut done = 0u64;
    let start = |i: usize, k: u64, state: &mut Vec<(u64, bool, bool)>| {
        // SAFETY: the previous ping's send has completed and its echo arrived (checked before
        // this is called): no work request uses either half of the region.
        unsafe { mrs[i].write(0, &k.to_le_bytes()) }.unwrap();
        mesh.clients[i]
            .post_recv(&mrs[i], PING, PING, i as u64)
            .unwrap();
        mesh.clients[i]
            .post_send(&mrs[i], 0, PING, i as u64, SendFlags::SIGNALED)
            .unwrap();
        state[i] = (k, false, false);
    };
    for i in 0..CONNS {
        if started < rounds {
            start(i, started, &mut state);
            started += 1;
        }
    }
    while done < rounds {
        let c = next();
        assert_eq!(c.status, WcStatus::Success, "client: {c:?}");
        let i = c.wr_id as usize;
        match c.opcode {
            Opcode::Send => state[i].1 = true,
            Opcode::Recv => {
                let mut back = [0u8; PING];
                // SAFETY: the receive into the second half completed; nothing else is posted
                // there.
                unsafe { mrs[i].read(PING, &mut back) }.unwrap();
                assert_eq!(
                    u64::from_le_bytes(back),
                    state[i].0,
                    "echo of connection {i}"
                );
                state[i].2 = true;
                done += 1;
            }
            _ => panic!("client: unexpected {c:?}"),
        }
        if state[i].1 && state[i].2 && started < rounds {
            start(i, started, &mut state);
            started += 1;
        }
    }
}

/// What [`epoll_server`] found: round trips answered, and how often `epoll_wait` timed out
/// with a completion queued.
pub struct EdgeRun {
    pub answered: u64,
    pub stalls: u32,
}

/// The server as an `EPOLLIN | EPOLLET` event loop: poll the queue until `None`, then sleep
/// in `epoll_wait`; each wait that times out ([`STALL`]) with a completion queued is a stall
/// (a lost edge). Returns when `rounds` pings were answered and their sends completed.
pub fn epoll_server(mesh: &Mesh, rounds: u64) -> EdgeRun {
    let cq = &mesh.scq;
    let mut echo = Echo::new(&mesh.ctx, &mesh.servers);
    let ep = EdgeWaiter::on(&**cq);
    let mut stalls = 0;
    let mut sends_done = 0u64;
    let limit = Instant::now() + RUN_LIMIT;
    while sends_done < rounds {
        while let Some(c) = cq.poll() {
            if c.opcode == Opcode::Send {
                sends_done += 1;
            }
            echo.handle(c);
        }
        if sends_done == rounds {
            break;
        }
        assert!(Instant::now() < limit, "run not done within {RUN_LIMIT:?}");
        let woke = ep.wait(STALL);
        if !woke && !cq.is_empty() {
            stalls += 1;
        }
    }
    EdgeRun {
        answered: echo.answered,
        stalls,
    }
}

/// An `EPOLLET` server answers `rounds` pings over [`CONNS`] connections with two busy loops
/// beside it, and never sleeps with a completion queued.
pub fn edge_triggered_waiter_never_sleeps_on_a_queued_completion(net: &Net) {
    ping_pong_never_stalls(net, epoll_server);
}

/// Runs `server` against [`ping`] for the test's rounds with two busy loops beside them, and
/// checks that every ping was answered and the server never slept on a queued completion.
fn ping_pong_never_stalls(net: &Net, server: fn(&Mesh, u64) -> EdgeRun) {
    let rounds = rounds(match net {
        Net::Shm => 40_000,
        Net::Verbs(_) => 4_000,
    });
    let mesh = Mesh::new(net);
    let _busy = BusyLoops::start(2);
    let run = std::thread::scope(|s| {
        let client = s.spawn(|| ping(&mesh, rounds));
        let run = server(&mesh, rounds);
        client.join().unwrap();
        run
    });
    assert_eq!(run.answered, rounds);
    assert_eq!(
        run.stalls, 0,
        "the server slept {} times for {STALL:?} with a completion queued",
        run.stalls
    );
}

/// Both sides `EPOLLIN | EPOLLET` event loops, each polling its queue until `None` and then
/// sleeping in `epoll_wait` on its descriptor (caller progress: the pollers move the data and
/// the peers wake the descriptors), over [`CONNS`] connections with two busy loops beside
/// them: every ping answered, and neither side ever sleeps with a completion to take.
pub fn edge_triggered_loops_on_both_sides_never_stall(net: &Net) {
    let rounds = rounds(match net {
        Net::Shm => 40_000,
        Net::Verbs(_) => 4_000,
    });
    let mesh = Mesh::new(net);
    let _busy = BusyLoops::start(2);
    let (run, client_stalls) = std::thread::scope(|s| {
        let client = s.spawn(|| ping_epoll(&mesh, rounds));
        let run = epoll_server(&mesh, rounds);
        (run, client.join().unwrap())
    });
    assert_eq!(run.answered, rounds);
    assert_eq!(
        (run.stalls, client_stalls),
        (0, 0),
        "server and client slept that many times for {STALL:?} with a completion to take"
    );
}

/// An `EPOLLIN | EPOLLET` registration of one descriptor, as mio and tokio make it.
pub struct EdgeWaiter(std::os::fd::OwnedFd);

impl EdgeWaiter {
    pub fn on(fd: &impl AsRawFd) -> EdgeWaiter {
        use std::os::fd::FromRawFd;
        // SAFETY: plain epoll calls on a new descriptor, owned by the returned value only; the
        // event is a live local and `fd` is open (borrowed).
        unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            assert!(ep >= 0, "{}", std::io::Error::last_os_error());
            let ep = std::os::fd::OwnedFd::from_raw_fd(ep);
            let mut ev = libc::epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLET) as u32,
                u64: 1,
            };
            let r = libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd.as_raw_fd(), &mut ev);
            assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
            EdgeWaiter(ep)
        }
    }

    /// Sleeps until an edge or `timeout`: whether an edge came.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut out = [libc::epoll_event { events: 0, u64: 0 }];
        // SAFETY: `out` is a live local array of the length passed.
        let n = unsafe {
            libc::epoll_wait(
                self.0.as_raw_fd(),
                out.as_mut_ptr(),
                1,
                timeout.as_millis() as i32,
            )
        };
        n == 1
    }
}

/// The server as tokio's textbook `AsyncFd` loop on the queue (tokio registers it
/// `EPOLLET`): wait until readable, poll until `None`, `clear_ready`, again. A wait that times
/// out ([`STALL`]) with a completion queued is a stall.
pub fn tokio_server(mesh: &Mesh, rounds: u64) -> EdgeRun {
    use tokio::io::Interest;
    use tokio::io::unix::AsyncFd;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // SAFETY: the queue's descriptor is open for as long as the queue lives, which the
        // `Arc` moved into the `AsyncFd` guarantees, and `as_raw_fd` always returns it.
        let afd = unsafe { AsyncFd::register_with_interest(mesh.scq.clone(), Interest::READABLE) }
            .unwrap();
        let mut echo = Echo::new(&mesh.ctx, &mesh.servers);
        let mut stalls = 0;
        let mut sends_done = 0u64;
        let limit = Instant::now() + RUN_LIMIT;
        while sends_done < rounds {
            assert!(Instant::now() < limit, "run not done within {RUN_LIMIT:?}");
            let mut guard = match tokio::time::timeout(STALL, afd.readable()).await {
                Ok(g) => g.unwrap(),
                Err(_) => {
                    if !afd.get_ref().is_empty() {
                        stalls += 1;
                    }
                    continue;
                }
            };
            while let Some(c) = afd.get_ref().poll() {
                if c.opcode == Opcode::Send {
                    sends_done += 1;
                }
                echo.handle(c);
            }
            guard.clear_ready();
        }
        EdgeRun {
            answered: echo.answered,
            stalls,
        }
    })
}

/// tokio's textbook `AsyncFd` loop answers `rounds` pings over [`CONNS`] connections with two
/// busy loops beside it, and never sleeps with a completion queued.
pub fn tokio_async_fd_loop_never_sleeps_on_a_queued_completion(net: &Net) {
    ping_pong_never_stalls(net, tokio_server);
}

/// A burst of clients against a listener whose descriptor is registered `EPOLLIN | EPOLLET`,
/// served as an edge-triggered loop does: take requests until none comes, then sleep in
/// `epoll_wait`. Every client is accepted, and no wait times out ([`STALL`]) while a request
/// is there to take.
pub fn edge_triggered_listener_takes_a_burst(net: &Net) {
    let clients = match net {
        Net::Shm => 150,
        Net::Verbs(_) => 20,
    };
    let ctx = Context::new().unwrap();
    let addr = net.addr("edge-burst");
    let l = ctx.listen(&addr, 256).unwrap();
    let ep = EdgeWaiter::on(&l);
    let scq = CompletionQueue::new().unwrap();
    let barrier = std::sync::Barrier::new(clients);
    let _busy = BusyLoops::start(2);
    let (accepted, stalls) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(|| {
                    let cq = CompletionQueue::new().unwrap();
                    let opts = ConnOptions {
                        timeout: Some(Duration::from_secs(120)),
                        ..Default::default()
                    };
                    barrier.wait();
                    let c = ctx
                        .connect(&addr, &cq, &opts)
                        .expect("every client connects");
                    // Stay connected until the server has taken everybody.
                    while next(&cq).opcode != Opcode::Disconnected {}
                    drop(c);
                })
            })
            .collect();
        let mut conns = Vec::new();
        let mut stalls = 0;
        let limit = Instant::now() + RUN_LIMIT;
        loop {
            while let Some(req) = l.try_get_request().unwrap() {
                conns.push(req.accept(&scq, &ConnOptions::default()).unwrap());
            }
            if conns.len() == clients {
                break;
            }
            assert!(
                Instant::now() < limit,
                "accepted {} of {clients}",
                conns.len()
            );
            let woke = ep.wait(STALL);
            if !woke {
                // Asleep for STALL: a stall if a request was there to take all along.
                if let Some(req) = l.try_get_request().unwrap() {
                    stalls += 1;
                    conns.push(req.accept(&scq, &ConnOptions::default()).unwrap());
                }
            }
        }
        let n = conns.len();
        drop(conns); // the clients see their disconnect and end
        for h in handles {
            h.join().unwrap();
        }
        (n, stalls)
    });
    assert_eq!(accepted, clients);
    assert_eq!(
        stalls, 0,
        "the loop slept {stalls} times for {STALL:?} with a request to take"
    );
}

/// More peers than one look of the listener takes (64) connect and hang up without a word,
/// then one real client connects: an edge-triggered loop on the listener's descriptor that
/// takes requests until none comes, then sleeps, gets the client without sleeping a
/// [`STALL`] first (shm: the dead peers are raw sockets).
pub fn edge_triggered_listener_sees_a_request_behind_dead_peers() {
    let ctx = Context::new().unwrap();
    let addr = Net::Shm.addr("edge-dead");
    let l = ctx.listen(&addr, 256).unwrap();
    let ep = EdgeWaiter::on(&l);
    // Taken into the listener's set, then gone: each is ready (hung up) at the next look.
    let dead: Vec<_> = (0..150).map(|_| raw_shm_peer(&addr)).collect();
    assert!(l.try_get_request().unwrap().is_none());
    drop(dead);
    let scq = CompletionQueue::new().unwrap();
    let connecting = std::sync::OnceLock::new();
    std::thread::scope(|s| {
        let client = s.spawn(|| {
            let cq = CompletionQueue::new().unwrap();
            connecting.set(Instant::now()).unwrap();
            ctx.connect(&addr, &cq, &ConnOptions::default())
                .expect("the client connects")
        });
        // Let the client's connection land behind the dead peers before the loop looks.
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        let conn = loop {
            if let Some(req) = l.try_get_request().unwrap() {
                break req.accept(&scq, &ConnOptions::default()).unwrap();
            }
            assert!(start.elapsed() < RUN_LIMIT, "no request");
            let waiting = Instant::now();
            let woke = ep.wait(STALL);
            // Asleep for STALL although the client was connecting before the sleep began.
            assert!(
                woke || connecting.get().is_none_or(|&t| t > waiting),
                "slept {STALL:?} with the client's request there to take"
            );
        };
        drop(client.join().unwrap());
        drop(conn);
    });
}
