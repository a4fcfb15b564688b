//! The async API's tests (feature `tokio`), for both transports: operations as futures
//! resolve to their outcomes, failures are errors with their status, records nobody awaits come
//! out of the queue's stream, `connect` and `accept` are futures with the blocking calls'
//! errors. tests/tokio.rs runs them over shm, tests/verbs.rs over verbs.

use std::time::Duration;

use super::{Net, pair};
use rdmabridge::ops::{AsyncConnection, AsyncRecvQueue, Buf, CmpSwap, FetchAdd, Remote};
use rdmabridge::tokio::{Listener, Queue};
use rdmabridge::{Access, ConnOptions, Context, Error, Opcode, SendFlags, WcStatus};

/// Every test here, listed once for both transports (as `for_each_suite_test!`).
#[allow(unused_macros)]
macro_rules! for_each_async_test {
    ($each:ident) => {
        $each!(
            operations_resolve_to_their_outcomes,
            a_failed_operation_is_an_error_with_its_status,
            operations_sit_in_select_beside_timers,
            a_listener_accepts_as_a_future,
            connect_and_accept_are_futures_with_the_blocking_calls_errors,
            a_pool_receives_as_futures,
        );
    };
}
#[allow(unused_imports)]
pub(crate) use for_each_async_test;

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A connected pair, each side on a queue driven by the current runtime.
pub fn async_pair(net: &Net, ctx: &Context) -> (AsyncConnection, Queue, AsyncConnection, Queue) {
    let o = ConnOptions::default();
    let (c, ccq, s, scq) = pair(net, ctx, &o, &o);
    let (cq, sq) = (Queue::drive(ccq).unwrap(), Queue::drive(scq).unwrap());
    let c = AsyncConnection::new(c, cq.router().clone());
    let s = AsyncConnection::new(s, sq.router().clone());
    (c, cq, s, sq)
}

pub fn operations_resolve_to_their_outcomes(net: &Net) {
    runtime().block_on(async {
        let ctx = Context::new().unwrap();
        let (c, cq, s, _sq) = async_pair(net, &ctx);
        // The server lets the client reach a region and tells it where.
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let target = ctx.alloc_mr(4096, all | Access::REMOTE_ATOMIC).unwrap();
        let desc = s.pack_region(&target).unwrap();
        let got = c.recv(Buf::alloc(&ctx, 64).unwrap());
        s.send_copy(&desc).await.unwrap();
        let (r, buf) = got.await;
        assert_eq!(r.unwrap().opcode, Opcode::Recv);
        let region = c.unpack_remote(&buf).unwrap();

        // A write, read back.
        let mut out = Buf::alloc(&ctx, 5).unwrap();
        out.copy_from_slice(b"hello");
        let at = Remote {
            region,
            offset: 100,
        };
        let (r, out) = c.write(out, at).await;
        r.unwrap();
        let (r, back) = c.read(Buf::alloc(&ctx, 5).unwrap(), at).await;
        r.unwrap();
        assert_eq!(&back[..], &out[..]);

        // Atomics give the word as it was.
        let add = FetchAdd {
            region,
            offset: 8,
            add: 5,
        };
        assert_eq!(c.fetch_add(add).await.unwrap(), 0);
        assert_eq!(c.fetch_add(add).await.unwrap(), 5);
        let swap = CmpSwap {
            region,
            offset: 8,
            compare: 10,
            swap: 7,
        };
        assert_eq!(c.cmp_swap(swap).await.unwrap(), 10);
        assert_eq!(c.cmp_swap(swap).await.unwrap(), 7, "no swap: the word is 7");

        // Messages, many in flight, each back with its buffer.
        let recvs: Vec<_> = Buf::alloc_many(&ctx, 8, 4096)
            .unwrap()
            .into_iter()
            .map(|b| s.recv(b))
            .collect();
        let sends: Vec<_> = (0..8u64)
            .map(|k| {
                let mut b = Buf::alloc(&ctx, 4096).unwrap();
                b.fill(&super::pattern(k, 1000 + k as usize)).unwrap();
                c.send(b)
            })
            .collect();
        for (k, r) in recvs.into_iter().enumerate() {
            let (r, b) = r.await;
            assert_eq!(r.unwrap().byte_len as usize, b.len());
            assert_eq!(&b[..], &super::pattern(k as u64, 1000 + k)[..]);
        }
        for s in sends {
            s.await.0.unwrap();
        }

        // A plain post's record is nobody's future's: it comes out of the queue's stream.
        c.post_send_inline(b"plain", 7, SendFlags::SIGNALED)
            .unwrap();
        let (r, b) = s.recv(Buf::alloc(&ctx, 64).unwrap()).await;
        r.unwrap();
        assert_eq!(&b[..], b"plain");
        let plain = cq.next().await;
        assert_eq!((plain.wr_id, plain.opcode), (7, Opcode::Send));
        assert_eq!(cq.router().in_flight(), 0);
    });
}

pub fn a_failed_operation_is_an_error_with_its_status(net: &Net) {
    runtime().block_on(async {
        let ctx = Context::new().unwrap();
        let (c, cq, s, _sq) = async_pair(net, &ctx);
        let small = s.recv(Buf::alloc(&ctx, 16).unwrap());
        let mut big = Buf::alloc(&ctx, 100).unwrap();
        big.fill(&[1; 100]).unwrap();
        let sent = c.send(big);
        let (r, _) = small.await;
        assert!(matches!(
            r,
            Err(Error::WorkRequest {
                opcode: Opcode::Recv,
                status: WcStatus::LocalLength
            })
        ));
        // The connection fails; the send ends with an error too, and the client hears of
        // the end on its stream.
        assert!(sent.await.0.is_err());
        let end = cq.next().await;
        assert_eq!(end.opcode, Opcode::Disconnected);
        // A post on a connection that is down fails at once, through its future.
        let (r, _) = c.send(Buf::alloc(&ctx, 8).unwrap()).await;
        assert!(matches!(r, Err(Error::Disconnected)), "{r:?}");
    });
}

/// A future dropped before its operation completed (here in a `select!` a timer won)
/// changes nothing for the others: its buffer stays with the router until the record comes.
pub fn operations_sit_in_select_beside_timers(net: &Net) {
    runtime().block_on(async {
        let ctx = Context::new().unwrap();
        let (c, _cq, s, sq) = async_pair(net, &ctx);
        let mut recv = s.recv(Buf::alloc(&ctx, 64).unwrap());
        let mut ticks = 0;
        let (r, b) = loop {
            tokio::select! {
                r = &mut recv => break r,
                _ = tokio::time::sleep(Duration::from_millis(20)) => {
                    ticks += 1;
                    if ticks == 3 {
                        c.send_copy(b"late").await.unwrap();
                    }
                }
            }
        };
        r.unwrap();
        assert_eq!((&b[..], ticks), (&b"late"[..], 3));
        // Dropped while waiting: the message it would have taken is taken and dropped.
        let dropped = s.recv(b);
        tokio::select! {
            _ = dropped => unreachable!("nothing was sent"),
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        assert_eq!(sq.router().in_flight(), 1);
        c.send_copy(b"lost").await.unwrap();
        while sq.router().in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
}

pub fn a_listener_accepts_as_a_future(net: &Net) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    runtime().block_on(async {
        let ctx = Context::new().unwrap();
        let addr = net.addr("tokio-accept");
        let l = Arc::new(Listener::bind(&ctx, &addr, 16).unwrap());
        let q = Queue::new().unwrap();
        let clients = 8;
        // Plain blocking clients, each on a thread of its own.
        let dialers: Vec<_> = (0..clients)
            .map(|_| {
                let (ctx, addr) = (ctx.clone(), addr.clone());
                std::thread::spawn(move || {
                    let cq = rdmabridge::CompletionQueue::new().unwrap();
                    ctx.connect(&addr, &cq, &ConnOptions::default()).unwrap()
                })
            })
            .collect();
        // Two tasks wait in `accept` at once; between them they take every request.
        let claimed = Arc::new(AtomicUsize::new(0));
        let acceptors: Vec<_> = (0..2)
            .map(|_| {
                let (l, q, claimed) = (l.clone(), q.clone(), claimed.clone());
                tokio::spawn(async move {
                    let mut mine = Vec::new();
                    while claimed.fetch_add(1, Ordering::Relaxed) < clients {
                        let req = tokio::time::timeout(Duration::from_secs(10), l.accept())
                            .await
                            .expect("a request within 10 s")
                            .unwrap();
                        mine.push(q.accept(req, &ConnOptions::default()).await.unwrap());
                    }
                    mine
                })
            })
            .collect();
        let mut accepted = 0;
        for a in acceptors {
            accepted += a.await.unwrap().len();
        }
        assert_eq!(accepted, clients);
        for d in dialers {
            d.join().unwrap();
        }
    });
}

/// A server's connections take their receives from one pool whose receives are futures
/// ([`AsyncRecvQueue`]): each resolves, with its buffer, to a message of whichever client
/// came first, in order per client, its record naming the connection.
pub fn a_pool_receives_as_futures(net: &Net) {
    use std::collections::HashMap;
    runtime().block_on(async {
        const CLIENTS: usize = 4;
        const EACH: u64 = 3;
        let ctx = Context::new().unwrap();
        let addr = net.addr("tokio-pool");
        let l = Listener::bind(&ctx, &addr, 16).unwrap();
        let q = Queue::new().unwrap();
        let pool = ctx
            .shared_recv_queue(&rdmabridge::SrqOptions::default())
            .unwrap();
        let pooled = AsyncRecvQueue::new(pool.clone(), q.router().clone());
        // Receives first: every client's messages find one.
        let recvs: Vec<_> = (0..CLIENTS as u64 * EACH)
            .map(|_| pooled.recv(Buf::alloc(&ctx, 64).unwrap()))
            .collect();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let done_rx = std::sync::Arc::new(std::sync::Mutex::new(done_rx));
        let dialers: Vec<_> = (0..CLIENTS)
            .map(|k| {
                let (ctx, addr, done) = (ctx.clone(), addr.clone(), done_rx.clone());
                std::thread::spawn(move || {
                    let cq = rdmabridge::CompletionQueue::new().unwrap();
                    let c = ctx.connect(&addr, &cq, &ConnOptions::default()).unwrap();
                    for m in 0..EACH {
                        let msg = [k as u8, m as u8];
                        c.post_send_inline(&msg, m, SendFlags::SIGNALED).unwrap();
                        assert_eq!(super::next(&cq).status, WcStatus::Success);
                    }
                    // Up until the server has taken everything.
                    let _ = done.lock().unwrap().recv();
                })
            })
            .collect();
        let opts = ConnOptions {
            srq: Some(pool.clone()),
            ..Default::default()
        };
        let mut conns = HashMap::new();
        for _ in 0..CLIENTS {
            let req = tokio::time::timeout(Duration::from_secs(10), l.accept())
                .await
                .expect("a request within 10 s")
                .unwrap();
            let c = q.accept(req, &opts).await.unwrap();
            conns.insert(c.id(), c);
        }
        let mut next_of: HashMap<u64, HashMap<u8, u8>> = HashMap::new();
        for r in recvs {
            let (rec, buf) = tokio::time::timeout(Duration::from_secs(10), r)
                .await
                .expect("a message within 10 s");
            let rec = rec.unwrap();
            assert_eq!((rec.opcode, buf.len()), (Opcode::Recv, 2));
            assert!(conns.contains_key(&rec.conn_id));
            let (k, m) = (buf[0], buf[1]);
            let seen = next_of
                .entry(rec.conn_id)
                .or_default()
                .entry(k)
                .or_insert(0);
            assert_eq!(m, *seen, "client {k}: messages in order");
            *seen += 1;
        }
        assert_eq!(next_of.len(), CLIENTS, "every connection delivered");
        for _ in 0..CLIENTS {
            done_tx.send(()).unwrap();
        }
        for d in dialers {
            d.join().unwrap();
        }
    });
}

/// `connect` and `accept` are futures that never block the thread: many connect at once to
/// one listener, and a failed set-up is the blocking call's error, the listener's private
/// data included.
pub fn connect_and_accept_are_futures_with_the_blocking_calls_errors(net: &Net) {
    runtime().block_on(async {
        let ctx = Context::new().unwrap();
        let o = ConnOptions::default();
        let q = Queue::new().unwrap();
        let nobody = net.addr("tokio-nobody");
        let r = q.connect(&ctx, &nobody, &o).await;
        assert!(matches!(r, Err(Error::Refused(_))), "{r:?}");

        let addr = net.addr("tokio-connect");
        let l = Listener::bind(&ctx, &addr, 64).unwrap();
        let clients = 32;
        let dials: Vec<_> = (0..clients)
            .map(|i| {
                let (ctx, q, addr) = (ctx.clone(), q.clone(), addr.clone());
                tokio::spawn(async move {
                    let o = ConnOptions {
                        private_data: vec![i as u8],
                        ..Default::default()
                    };
                    q.connect(&ctx, &addr, &o).await
                })
            })
            .collect();
        // The odd ones are turned away with a word; the even ones accepted and greeted.
        let sq = Queue::new().unwrap();
        let mut accepted = Vec::new();
        for _ in 0..clients {
            let req = l.accept().await.unwrap();
            let i = req.private_data()[0];
            if i % 2 == 1 {
                req.reject(&[b'n', i]).unwrap();
            } else {
                let c = sq.accept(req, &o).await.unwrap();
                // Not awaited here: a send waits for the client's receive.
                let greeting = c.send_copy(&[i]);
                accepted.push((c, greeting));
            }
        }
        for (i, d) in dials.into_iter().enumerate() {
            match d.await.unwrap() {
                Ok(c) => {
                    assert_eq!(i % 2, 0);
                    let (r, b) = c.recv(Buf::alloc(&ctx, 8).unwrap()).await;
                    r.unwrap();
                    assert_eq!(&b[..], &[i as u8]);
                }
                Err(Error::Rejected(data)) => {
                    assert_eq!(i % 2, 1);
                    assert_eq!(&data[..2], &[b'n', i as u8]);
                }
                Err(e) => panic!("connection {i}: {e}"),
            }
        }
        assert_eq!(accepted.len(), clients / 2);
        for (_, greeting) in accepted {
            greeting.await.unwrap();
        }
    });
}

/// Idle CPU time (user + system) of process `pid` so far, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process's stat");
    // After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
    let rest = &stat[stat.rfind(')').expect("stat's command") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// The tokio echo server (examples/tokio_server.rs) at `addr`, and one client process
/// (examples/tokio_client.rs) with `clients` connections at once, 200 echoes each, every one
/// verified; then both processes' CPU time, in milliseconds, over `idle` seconds with all the
/// connections open and idle.
pub fn examples_serve_many(addr: &str, clients: usize, idle: u64) -> (u64, u64) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut server = Command::new(super::example("tokio_server"))
        .arg(addr)
        .stdout(Stdio::piped())
        .spawn()
        .expect("examples/tokio_server runs (cargo test --features tokio builds it)");
    // The client starts once the server says it listens (a client started before would be
    // refused); the rest of what the server says is read away meanwhile.
    let mut said = std::io::BufReader::new(server.stdout.take().unwrap()).lines();
    let first = said.next().map(|l| l.unwrap()).unwrap_or_default();
    assert!(
        first.starts_with("listening on"),
        "the server said {first:?}"
    );
    std::thread::spawn(move || said.for_each(drop));
    let mut client = Command::new(super::example("tokio_client"))
        .args([addr, "200", &clients.to_string(), &(idle + 2).to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("examples/tokio_client runs");
    // Wait for the verdict, then measure both processes while the connections idle.
    let mut line = String::new();
    std::io::BufReader::new(client.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let want = format!(
        "{} echoes verified over {clients} connections",
        200 * clients
    );
    assert!(line.starts_with(&want), "{line}");
    let (s0, c0) = (cpu_ticks(server.id()), cpu_ticks(client.id()));
    std::thread::sleep(Duration::from_secs(idle));
    let (s1, c1) = (cpu_ticks(server.id()), cpu_ticks(client.id()));
    assert!(client.wait().unwrap().success());
    let _ = server.kill();
    let _ = server.wait();
    let tick_ms = 1000 / 100; // USER_HZ is 100 on Linux
    let (server_ms, client_ms) = ((s1 - s0) * tick_ms, (c1 - c0) * tick_ms);
    println!(
        "CPU time over {idle} idle seconds with {clients} connections open: server {server_ms} ms, client {client_ms} ms"
    );
    (server_ms, client_ms)
}

/// Futures dropped before they resolve leak nothing ([`super::Held`]: descriptors, mappings,
/// and over verbs the kernel's registrations and queues and the pinned memory):
/// - operations: receives nobody sends to, a send the peer has no receive for, a write, a
///   read and two atomics, dropped at once; they keep their buffers until their records come
///   (the close flushes them), then release them, and no operation is left;
/// - a connect waiting for a listener that takes no request;
/// - an accept waiting for a request, and an accept dropped after its first poll.
pub fn futures_dropped_midway_leak_nothing(net: &Net) {
    // One malloc arena, as in connect_close_cycles_leak_nothing.
    // SAFETY: mallopt only changes the allocator's tuning.
    assert_eq!(unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) }, 1);
    let rt = runtime();
    let ctx = Context::new().unwrap();
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let o = ConnOptions::default();
    let cycle = || {
        rt.block_on(async {
            let (c, cq, s, sq) = async_pair(net, &ctx);
            let target = ctx.alloc_mr(4096, all | Access::REMOTE_ATOMIC).unwrap();
            let region = c.unpack_remote(&s.pack_region(&target).unwrap()).unwrap();
            for b in Buf::alloc_many(&ctx, 4, 256).unwrap() {
                drop(c.recv(b));
            }
            drop(c.send(Buf::alloc(&ctx, 100).unwrap()));
            let at = |offset| Remote { region, offset };
            drop(c.write(Buf::alloc(&ctx, 64).unwrap(), at(64)));
            drop(c.read(Buf::alloc(&ctx, 64).unwrap(), at(128)));
            drop(c.fetch_add(FetchAdd {
                region,
                offset: 8,
                add: 1,
            }));
            drop(c.cmp_swap(CmpSwap {
                region,
                offset: 16,
                compare: 0,
                swap: 1,
            }));
            assert!(cq.router().in_flight() >= 5, "the receives and the send");
            if let Net::Verbs(_) = net {
                let held = super::Held::now(net);
                let mrs: u64 = held
                    .rdma
                    .iter()
                    .filter(|(k, _)| k.ends_with(" mr"))
                    .map(|(_, n)| n)
                    .sum();
                assert!(
                    mrs >= 2 && held.pinned_kb > 0,
                    "the counts see the operations' registrations: {held:?}"
                );
            }
            drop((c, s, target));
            for q in [&cq, &sq] {
                while q.next().await.opcode != Opcode::Disconnected {}
                assert_eq!(q.router().in_flight(), 0, "every operation is over");
            }

            // A connect dropped while it waits for a listener that takes no request.
            let deaf = net.addr("dropped-connect");
            let _deaf = ctx.listen(&deaf, 4).unwrap();
            let mid = tokio::time::timeout(Duration::from_millis(50), cq.connect(&ctx, &deaf, &o));
            assert!(mid.await.is_err(), "the connect still waits");

            // An accept dropped while no request came, then one dropped after its first poll
            // (the connection started, not yet established).
            let addr = net.addr("dropped-accept");
            let l = Listener::bind(&ctx, &addr, 4).unwrap();
            let none = tokio::time::timeout(Duration::from_millis(1), l.accept()).await;
            assert!(none.is_err(), "no request yet");
            let dial = tokio::spawn({
                let (ctx, cq, addr) = (ctx.clone(), cq.clone(), addr.clone());
                async move { cq.connect(&ctx, &addr, &ConnOptions::default()).await }
            });
            let req = l.accept().await.unwrap();
            let _ = tokio::time::timeout(Duration::ZERO, sq.accept(req, &o)).await;
            // The client either saw the connection up and then down, or never up.
            drop(dial.await.unwrap());
        });
    };
    super::cycles_leave_nothing(net, 3, 20, cycle);
}
