//! Connections that never block the caller: `connect_start` and `accept_start`, their outcome
//! as records on the queue, many in flight from one thread. Part of the common suite (both
//! transports).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::*;
use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Connection, Context, Error, Listener, MemoryRegion,
    Opcode, SendFlags, WcStatus,
};

/// Bytes each client sends and gets back.
const MSG: usize = 64;
/// A call that returned at once: generous for a loaded 2-core machine, far below a round trip
/// that waited (a silent listener's answer never comes).
const AT_ONCE: Duration = Duration::from_secs(2);

/// An event-loop server on its own thread: takes every request without blocking, accepts it
/// with `accept_start` (the receive posted at once, while the connection connects), and echoes
/// each message back. Rejects a client whose private data is `b"reject me"`.
struct EchoServer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl EchoServer {
    fn start(ctx: &Context, l: Listener) -> EchoServer {
        let stop = Arc::new(AtomicBool::new(false));
        let ctx = ctx.clone();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let cq = CompletionQueue::new().unwrap();
            let mr = ctx.alloc_mr(MSG * 1024, Access::LOCAL_WRITE).unwrap();
            let mut conns: HashMap<u64, (Connection, usize)> = HashMap::new();
            let mut established = 0;
            let mut slot = 0usize;
            while !flag.load(Ordering::SeqCst) {
                while let Some(req) = l.try_get_request().unwrap() {
                    if req.private_data() == b"reject me" {
                        req.reject(b"not you").unwrap();
                        continue;
                    }
                    let t = Instant::now();
                    let c = req.accept_start(&cq, &ConnOptions::default()).unwrap();
                    assert!(t.elapsed() < AT_ONCE, "accept_start took {:?}", t.elapsed());
                    let off = (slot % 1024) * MSG;
                    slot += 1;
                    c.post_recv(&mr, off, MSG, c.id()).unwrap();
                    conns.insert(c.id(), (c, off));
                }
                while let Some(wc) = cq.poll() {
                    match wc.opcode {
                        Opcode::Connected => {
                            assert_eq!(wc.status, WcStatus::Success);
                            established += 1;
                        }
                        Opcode::Recv if wc.status == WcStatus::Success => {
                            let (c, off) = &conns[&wc.conn_id];
                            c.post_send(&mr, *off, wc.byte_len as usize, 0, SendFlags::SIGNALED)
                                .unwrap();
                        }
                        Opcode::Send => assert_eq!(wc.status, WcStatus::Success),
                        Opcode::Disconnected => {
                            conns.remove(&wc.conn_id);
                        }
                        _ => {}
                    }
                }
                cq.wait(Some(Duration::from_millis(5))).unwrap();
            }
            established
        });
        EchoServer {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops it; how many connections it saw established.
    fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// One thread starts `n` connections to each of `servers` listeners at once, each posting its
/// receive while it connects; every one establishes (its CONNECTED record first) and carries a
/// verified message both ways. Returns the connections' count.
fn many_in_flight(net: &Net, servers: usize, n: usize) {
    let ctx = Context::new().unwrap();
    let mut running = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..servers {
        let addr = net.addr("starts");
        let l = ctx.listen(&addr, 1024).unwrap();
        running.push(EchoServer::start(&ctx, l));
        addrs.push(addr);
    }
    let cq = CompletionQueue::new().unwrap();
    let total = servers * n;
    let mr: Arc<MemoryRegion> = ctx.alloc_mr(2 * MSG * total, Access::LOCAL_WRITE).unwrap();
    let opts = ConnOptions {
        timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    let t = Instant::now();
    let mut conns = Vec::new();
    for i in 0..total {
        let start = Instant::now();
        let c = ctx.connect_start(&addrs[i % servers], &cq, &opts).unwrap();
        assert!(
            start.elapsed() < AT_ONCE,
            "connect_start took {:?}",
            start.elapsed()
        );
        let data = pattern(i as u64, MSG);
        // SAFETY: the send half of the slot, not posted yet.
        unsafe { mr.write(2 * MSG * i, &data).unwrap() };
        c.post_recv(&mr, 2 * MSG * i + MSG, MSG, i as u64).unwrap();
        assert!(
            matches!(
                c.post_send(&mr, 2 * MSG * i, MSG, 0, SendFlags(0)),
                Err(Error::State(_))
            ) || c.established().unwrap(),
            "a send before establishment is refused"
        );
        conns.push(c);
    }
    let started = t.elapsed();
    let index: HashMap<u64, usize> = conns.iter().enumerate().map(|(i, c)| (c.id(), i)).collect();
    let (mut up, mut echoed) = (0, 0);
    let mut seen_up = vec![false; total];
    while echoed < total {
        let wc = next(&cq);
        let i = index[&wc.conn_id];
        match wc.opcode {
            Opcode::Connected => {
                assert_eq!(wc.status, WcStatus::Success, "connection {i}");
                assert!(!seen_up[i], "one CONNECTED record per connection");
                seen_up[i] = true;
                up += 1;
                assert!(conns[i].established().unwrap());
                conns[i]
                    .post_send(&mr, 2 * MSG * i, MSG, u64::MAX, SendFlags(0))
                    .unwrap();
            }
            Opcode::Recv => {
                assert!(seen_up[i], "the CONNECTED record comes first");
                assert_eq!(wc.status, WcStatus::Success);
                assert_eq!(wc.wr_id, i as u64);
                let mut got = vec![0u8; MSG];
                // SAFETY: the receive completed; nothing writes the slot any more.
                unsafe { mr.read(2 * MSG * i + MSG, &mut got).unwrap() };
                assert_eq!(got, pattern(i as u64, MSG), "connection {i}");
                echoed += 1;
            }
            other => panic!("unexpected {other:?}: {wc:?}"),
        }
    }
    assert_eq!(up, total);
    eprintln!(
        "{total} connections to {servers} listeners: started in {started:?}, all echoed in {:?}",
        t.elapsed()
    );
    drop(conns);
    let established: usize = running.into_iter().map(EchoServer::stop).sum();
    assert_eq!(
        established, total,
        "the servers saw every connection established"
    );
}

pub fn one_thread_starts_many_connections_to_one_listener(net: &Net) {
    many_in_flight(
        net,
        1,
        match net {
            Net::Shm => 256,
            Net::Verbs(_) => 64,
        },
    );
}

pub fn one_thread_starts_many_connections_to_sixteen_listeners(net: &Net) {
    many_in_flight(
        net,
        16,
        match net {
            Net::Shm => 16,
            Net::Verbs(_) => 4,
        },
    );
}

/// Nobody listening, a rejection with private data, and a listener that never answers, all
/// started from one thread at once: each comes back as a failed CONNECTED record (receives
/// posted meanwhile flushed before it), with the status and data the blocking call returns,
/// and nothing blocks the thread.
pub fn failed_starts_arrive_as_records_with_their_reasons(net: &Net) {
    let ctx = Context::new().unwrap();
    let rejecting = net.addr("rejecting");
    let server = EchoServer::start(&ctx, ctx.listen(&rejecting, 16).unwrap());
    let silent = net.addr("silent");
    let _silent = ctx.listen(&silent, 16).unwrap(); // never takes a request
    let cq = CompletionQueue::new().unwrap();
    let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let opts = |data: &[u8], ms| ConnOptions {
        timeout: Some(Duration::from_millis(ms)),
        private_data: data.to_vec(),
        ..Default::default()
    };
    let t = Instant::now();
    let refused = ctx
        .connect_start(&net.addr("nobody"), &cq, &opts(b"", 30_000))
        .unwrap();
    let rejected = ctx
        .connect_start(&rejecting, &cq, &opts(b"reject me", 30_000))
        .unwrap();
    let timed_out = ctx.connect_start(&silent, &cq, &opts(b"", 300)).unwrap();
    for (k, c) in [&refused, &rejected, &timed_out].into_iter().enumerate() {
        // A refusal can come back before the receive is posted (over shm the driver learns
        // it from the socket at once); then the post says so and holds nothing.
        match c.post_recv(&mr, 64 * k, 64, 100 + k as u64) {
            Ok(()) => {}
            Err(Error::Disconnected) => assert!(c.established().is_err()),
            Err(e) => panic!("posting a receive while connecting: {e:?}"),
        }
    }
    assert!(t.elapsed() < AT_ONCE, "starting took {:?}", t.elapsed());
    let mut outcomes = HashMap::new();
    while outcomes.len() < 3 {
        let wc = next(&cq);
        match wc.opcode {
            Opcode::Recv => {
                assert_eq!(wc.status, WcStatus::Flushed);
                assert!(
                    !outcomes.contains_key(&wc.conn_id),
                    "flushed before the outcome"
                );
            }
            Opcode::Connected => {
                assert_eq!(wc.status, WcStatus::ConnectFailed);
                outcomes.insert(wc.conn_id, ());
            }
            other => panic!("unexpected {other:?}: {wc:?}"),
        }
    }
    assert!(
        cq.poll().is_none(),
        "a failed connection's record is its last"
    );
    assert!(
        matches!(refused.established(), Err(Error::Refused(_))),
        "{:?}",
        refused.established()
    );
    match rejected.established() {
        Err(Error::Rejected(d)) => assert_eq!(d, b"not you"),
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(rejected.private_data(), b"not you");
    assert!(
        matches!(timed_out.established(), Err(Error::Timeout(_))),
        "{:?}",
        timed_out.established()
    );
    assert!(matches!(
        refused.post_send(&mr, 0, 8, 0, SendFlags(0)),
        Err(Error::Disconnected)
    ));
    server.stop();
}

/// Dropping a connection while it connects ends the attempt at once and reports nothing; the
/// listener's side sees no connection.
pub fn dropping_a_connecting_connection_reports_nothing(net: &Net) {
    let ctx = Context::new().unwrap();
    let addr = net.addr("dropped");
    let _l = ctx.listen(&addr, 16).unwrap(); // never answers
    let cq = CompletionQueue::new().unwrap();
    let opts = ConnOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let c = ctx.connect_start(&addr, &cq, &opts).unwrap();
    assert!(!c.established().unwrap());
    let t = Instant::now();
    drop(c);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "drop took {:?}",
        t.elapsed()
    );
    assert!(!cq.wait(Some(Duration::from_millis(200))).unwrap());
    assert!(cq.poll().is_none());
}

/// Connections dropped at every point of their set-up - while connecting to a listener that
/// never answers, at once after a start that will succeed (with a receive held), while the
/// server's accept is still unconfirmed, and after a failed start - leave nothing behind
/// ([`Held`]).
pub fn connects_dropped_midway_leak_nothing(net: &Net) {
    // One malloc arena, as in connect_close_cycles_leak_nothing.
    // SAFETY: mallopt only changes the allocator's tuning.
    assert_eq!(unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) }, 1);
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let scq = CompletionQueue::new().unwrap();
    let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let opts = ConnOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let cycle = || {
        let silent = net.addr("leak-silent");
        let l = ctx.listen(&silent, 16).unwrap();
        let pending: Vec<_> = (0..4)
            .map(|_| ctx.connect_start(&silent, &cq, &opts).unwrap())
            .collect();
        drop(pending);
        drop(l);
        let addr = net.addr("leak-live");
        let l = ctx.listen(&addr, 16).unwrap();
        let c = ctx.connect_start(&addr, &cq, &opts).unwrap();
        c.post_recv(&mr, 0, 64, 1).unwrap();
        let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
        let s = req.accept_start(&scq, &opts).unwrap();
        s.post_recv(&mr, 64, 64, 2).unwrap();
        drop(s);
        drop(c);
        let refused = ctx
            .connect_start(&net.addr("leak-nobody"), &cq, &opts)
            .unwrap();
        while refused.established().is_ok_and(|up| !up) {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(refused);
        drop(l);
        // Whatever the dropped ones reported before they went.
        while cq.poll().is_some() || scq.poll().is_some() {}
    };
    // A connection made in full on each queue first: what a queue makes once, with its first
    // connection (over shm its notice board), is then there before the counts, whichever
    // point of set-up the cycles' drops reach.
    {
        let addr = net.addr("leak-first");
        let l = ctx.listen(&addr, 4).unwrap();
        std::thread::scope(|sc| {
            let h = sc.spawn(|| {
                l.get_request(Some(Duration::from_secs(10)))
                    .unwrap()
                    .accept(&scq, &opts)
                    .unwrap()
            });
            let c = ctx.connect(&addr, &cq, &opts).unwrap();
            drop((c, h.join().unwrap()));
        });
        while cq.poll().is_some() || scq.poll().is_some() {}
    }
    cycles_leave_nothing(net, 10, 50, cycle);
}

/// Connections in flight cost one descriptor each (shm: the socket; verbs: the RDMA CM event
/// channel - what an established connection keeps) and no thread: their handshakes are turns
/// on the context's one library thread.
pub fn connects_in_flight_cost_one_descriptor_and_no_thread(net: &Net) {
    // The library's threads, by name (the test harness runs others meanwhile).
    let threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter(|t| {
                let comm = t.as_ref().unwrap().path().join("comm");
                std::fs::read_to_string(comm).is_ok_and(|n| n.starts_with("rbr-"))
            })
            .count()
    };
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let addr = net.addr("in-flight");
    let _l = ctx.listen(&addr, 1024).unwrap(); // never answers
    let opts = ConnOptions {
        timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    let fds = fd_count();
    let n = 100;
    // Two batches: what the first connections bring once per context, queue and device (the
    // library's thread, a notice board, a device CQ) is in the first, so the second shows
    // the cost of a connection in flight.
    let mut conns = Vec::new();
    let mut counts = Vec::new();
    for _ in 0..2 {
        conns.extend((0..n).map(|_| ctx.connect_start(&addr, &cq, &opts).unwrap()));
        // Let the handshakes get as far as they can without an answer.
        std::thread::sleep(Duration::from_millis(1000));
        counts.push((fd_count(), threads()));
    }
    assert!(conns.iter().all(|c| !c.established().unwrap()));
    let per_batch = counts[1].0 - counts[0].0;
    eprintln!(
        "{} connections in flight: {} descriptors in all ({per_batch} for the second {n}), \
         {} library threads",
        2 * n,
        counts[1].0 - fds,
        counts[1].1
    );
    // Over verbs a device CQ holds a few hundred connections' work: the second batch may open
    // the next one (its completion channel, one descriptor for hundreds of connections).
    assert!(
        per_batch <= n + 1,
        "{per_batch} descriptors for {n} more connections in flight"
    );
    assert_eq!(counts[1].1, 1, "the context's one library thread");
    drop(conns);
}
