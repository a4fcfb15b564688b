//! Shared receive queues on either transport: many connections taking their receives from
//! one pool, its limit event, and a thousand connections on one pool (tests/srq.rs runs them
//! over shm, tests/verbs.rs over verbs on soft-RoCE).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Net, next, pair_between};
use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Connection, Context, CqOptions, Opcode, Progress,
    SendFlags, SharedRecvQueue, SrqOptions, WcStatus,
};

pub const MSG: usize = 256;

/// `n` connections from `cctx` to one listener of `sctx`, the server's all on `scq` with
/// `pool`, the clients' all on `ccq`.
pub fn connect_many(
    net: &Net,
    n: usize,
    cctx: &Context,
    sctx: &Context,
    ccq: &Arc<CompletionQueue>,
    scq: &Arc<CompletionQueue>,
    pool: &SharedRecvQueue,
) -> (Vec<Connection>, Vec<Connection>) {
    let addr = net.addr("srq");
    let l = sctx.listen(&addr, 64).unwrap();
    let sopts = ConnOptions {
        srq: Some(pool.clone()),
        ..Default::default()
    };
    let copts = ConnOptions {
        send_queue_depth: 16,
        ..Default::default()
    };
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            (0..n)
                .map(|_| {
                    l.get_request(Some(Duration::from_secs(10)))
                        .unwrap()
                        .accept(scq, &sopts)
                        .unwrap()
                })
                .collect::<Vec<_>>()
        });
        let clients = (0..n)
            .map(|_| cctx.connect(&addr, ccq, &copts).unwrap())
            .collect::<Vec<_>>();
        (clients, h.join().unwrap())
    })
}

pub fn message(conn: usize, seq: u64) -> [u8; MSG] {
    let mut m = [0u8; MSG];
    m[..8].copy_from_slice(&(conn as u64).to_le_bytes());
    m[8..16].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in m[16..].iter_mut().enumerate() {
        *b = (conn as u64 * 31 + seq * 7 + i as u64) as u8;
    }
    m
}

/// Takes the clients' send completions queued on `ccq`, each a success, counting them off
/// `outstanding`.
pub fn reap_sends(ccq: &CompletionQueue, clients: &[Connection], outstanding: &mut [usize]) {
    while let Some(c) = ccq.poll() {
        assert_eq!(
            (c.opcode, c.status),
            (Opcode::Send, WcStatus::Success),
            "{c:?}"
        );
        let i = clients.iter().position(|k| k.id() == c.conn_id).unwrap();
        outstanding[i] -= 1;
    }
}

/// Takes the messages queued on the server's `scq`, each `len` bytes into a pool receive of
/// `stride` bytes at its slot (`wr_id`), checks it is the next message of its connection
/// (`index` maps the servers' ids to the clients' numbers), and posts the slot to `pool`
/// again. Returns how many it took.
pub fn take_messages(
    scq: &CompletionQueue,
    pool: &SharedRecvQueue,
    rmr: &Arc<rdmabridge::MemoryRegion>,
    stride: usize,
    len: usize,
    index: &HashMap<u64, usize>,
    got: &mut [u64],
) -> u64 {
    let mut taken = 0;
    while let Some(r) = scq.poll() {
        assert_eq!(
            (r.opcode, r.status, r.byte_len as usize),
            (Opcode::Recv, WcStatus::Success, len),
            "{r:?}"
        );
        let i = index[&r.conn_id];
        let slot = r.wr_id as usize;
        let mut b = vec![0u8; len];
        unsafe { rmr.read(slot * stride, &mut b) }.unwrap();
        assert_eq!(
            b[..],
            message(i, got[i])[..len],
            "connection {i}, message {}",
            got[i]
        );
        got[i] += 1;
        taken += 1;
        pool.post_recv(rmr, slot * stride, stride, slot as u64)
            .unwrap();
    }
    taken
}

/// Many connections on one pool: every message arrives whole, in order per connection, its
/// completion naming its connection, and no send fails. Over shm the pool is far smaller
/// than what the senders have outstanding (their messages wait in the rings until it is
/// refilled); over verbs it holds all of it, as a send that finds the pool empty waits in the
/// peer's device (receiver not ready), which soft-RoCE turns into a failed connection when
/// it waits long (see docs/transports.md).
pub fn many_connections_take_their_receives_from_one_small_pool(net: &Net) {
    for progress in [Progress::Caller, Progress::Thread] {
        const N: usize = 32;
        const PER_CONN: u64 = 200;
        let pool_depth = match net {
            Net::Shm => 64,
            Net::Verbs(_) => 64,
        };
        let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let ccq = CompletionQueue::with_options(cq_opts).unwrap();
        let scq = CompletionQueue::with_options(cq_opts).unwrap();
        let pool = sctx
            .shared_recv_queue(&SrqOptions {
                depth: pool_depth as u32,
                ..Default::default()
            })
            .unwrap();
        let (clients, servers) = connect_many(net, N, &cctx, &sctx, &ccq, &scq, &pool);
        let index: HashMap<u64, usize> = servers
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id(), i))
            .collect();
        // The server's buffers: one slot per pool entry, named by wr_id.
        let rmr = sctx
            .alloc_mr(pool_depth * MSG, Access::LOCAL_WRITE)
            .unwrap();
        for slot in 0..pool_depth {
            pool.post_recv(&rmr, slot * MSG, MSG, slot as u64).unwrap();
        }
        assert_eq!(pool.len(), pool_depth);
        let mut sent = [0u64; N];
        let mut outstanding = [0usize; N];
        let mut got = [0u64; N];
        let total = N as u64 * PER_CONN;
        let mut received = 0;
        let deadline = Instant::now() + Duration::from_secs(60);
        while received < total {
            assert!(
                Instant::now() < deadline,
                "{progress:?}: {received} of {total} in 60 s"
            );
            for (i, c) in clients.iter().enumerate() {
                while outstanding[i] < 16 && sent[i] < PER_CONN {
                    let m = message(i, sent[i]);
                    c.post_send_inline(&m[..64], sent[i], SendFlags::SIGNALED)
                        .unwrap();
                    sent[i] += 1;
                    outstanding[i] += 1;
                }
            }
            reap_sends(&ccq, &clients, &mut outstanding);
            received += take_messages(&scq, &pool, &rmr, MSG, 64, &index, &mut got);
        }
        assert!(got.iter().all(|&g| g == PER_CONN), "{got:?}");
        // Every send completes, none failed.
        let deadline = Instant::now() + Duration::from_secs(10);
        while outstanding.iter().any(|&o| o > 0) {
            assert!(
                Instant::now() < deadline,
                "sends outstanding: {outstanding:?}"
            );
            reap_sends(&ccq, &clients, &mut outstanding);
        }
        assert_eq!(pool.len(), pool_depth);
    }
}

/// A pool of its own, `depth` deep, events on `cq`.
pub fn pool_of(ctx: &Context, depth: u32, cq: Option<&Arc<CompletionQueue>>) -> SharedRecvQueue {
    ctx.shared_recv_queue(&SrqOptions {
        depth,
        cq: cq.cloned(),
        context: 77,
    })
    .unwrap()
}

/// One connection pair whose server takes its receives from `pool`.
pub fn pooled_pair(
    net: &Net,
    cctx: &Context,
    sctx: &Context,
    pool: &SharedRecvQueue,
) -> (
    Connection,
    Arc<CompletionQueue>,
    Connection,
    Arc<CompletionQueue>,
) {
    let sopts = ConnOptions {
        srq: Some(pool.clone()),
        ..Default::default()
    };
    pair_between(
        net,
        cctx,
        sctx,
        &ConnOptions::default(),
        &sopts,
        CqOptions::default(),
    )
}

/// The limit event: armed, it comes once, when fewer receives than the limit are left,
/// carrying how many are; armed below what is left, at once; disarmed by 0.
pub fn the_pool_reports_running_low_once_per_arming(net: &Net) {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let events = CompletionQueue::new().unwrap();
    let pool = pool_of(&sctx, 8, Some(&events));
    let (c, _ccq, _s, scq) = pooled_pair(net, &cctx, &sctx, &pool);
    let rmr = sctx.alloc_mr(8 * MSG, Access::LOCAL_WRITE).unwrap();
    for slot in 0..8u64 {
        pool.post_recv(&rmr, slot as usize * MSG, MSG, slot)
            .unwrap();
    }
    pool.set_limit(4).unwrap();
    for k in 0..6u64 {
        c.post_send_inline(&k.to_le_bytes(), k, SendFlags(0))
            .unwrap();
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id),
            (Opcode::Recv, WcStatus::Success, k)
        );
        let left = 8 - (k + 1);
        match events.poll() {
            Some(e) => {
                assert_eq!(left, 3, "the event came at {left} left");
                assert_eq!(
                    (e.opcode, e.status, e.wr_id, e.conn_id, e.context),
                    (Opcode::SrqLimit, WcStatus::Success, 3, 0, 77)
                );
            }
            None => assert_ne!(left, 3, "no event at 3 left of a limit of 4"),
        }
    }
    // Once per arming: 2 left now, no second event.
    assert!(events.poll().is_none());
    // Armed above what is left: at once.
    pool.set_limit(3).unwrap();
    let e = events.poll().expect("an event at once");
    assert_eq!((e.opcode, e.wr_id), (Opcode::SrqLimit, 2));
    // Disarmed: none.
    pool.set_limit(0).unwrap();
    c.post_send_inline(b"x", 9, SendFlags(0)).unwrap();
    next(&scq);
    assert!(events.poll().is_none());
}

/// 1,024 connections on one pool of 4,096 receives, every client sending 16 messages at once:
/// every message is delivered, verified and in order per connection, and every send succeeds.
/// Over shm that is four times what the pool holds (those that found it empty waited for
/// it); over verbs 256 connections, whose messages the pool holds all at once (see
/// `many_connections_take_their_receives_from_one_small_pool`).
pub fn a_thousand_connections_share_one_pool_of_four_thousand_receives(net: &Net) {
    let n = match net {
        Net::Shm => 1024,
        Net::Verbs(_) => 256,
    };
    const PER_CONN: u64 = 16;
    const POOL: usize = 4096;
    super::raise_fd_limit(match net {
        Net::Shm => 16384,
        Net::Verbs(_) => 4096,
    });
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let ccq = CompletionQueue::new().unwrap();
    let scq = CompletionQueue::new().unwrap();
    let pool = pool_of(&sctx, POOL as u32, None);
    let (clients, servers) = connect_many(net, n, &cctx, &sctx, &ccq, &scq, &pool);
    let index: HashMap<u64, usize> = servers
        .iter()
        .enumerate()
        .map(|(i, s)| (s.id(), i))
        .collect();
    let rmr = sctx.alloc_mr(POOL * 16, Access::LOCAL_WRITE).unwrap();
    for slot in 0..POOL {
        pool.post_recv(&rmr, slot * 16, 16, slot as u64).unwrap();
    }
    // Four times what the pool holds, all at once.
    for (i, c) in clients.iter().enumerate() {
        for k in 0..PER_CONN {
            c.post_send_inline(&message(i, k)[..16], k, SendFlags::SIGNALED)
                .unwrap();
        }
    }
    let mut got = vec![0u64; n];
    let mut outstanding = vec![PER_CONN as usize; n];
    let total = n as u64 * PER_CONN;
    let mut received = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while received < total || outstanding.iter().any(|&o| o > 0) {
        assert!(
            Instant::now() < deadline,
            "{received} of {total} messages in 120 s"
        );
        reap_sends(&ccq, &clients, &mut outstanding);
        received += take_messages(&scq, &pool, &rmr, 16, 16, &index, &mut got);
    }
    assert_eq!(pool.len(), POOL);
}

/// A send that finds the pool empty waits for it as long as it takes - over verbs 6 s, beyond
/// the (retry_count + 1) x ACK timeout (4.3 s with the defaults) after which soft-RoCE fails
/// a send whose receive is late - and is taken, in order, once receives come; the senders'
/// sends complete only then, and none fails.
pub fn sends_wait_for_an_empty_pool_as_long_as_it_takes(net: &Net) {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let pool = pool_of(&sctx, 8, None);
    let (c, ccq, s, scq) = pooled_pair(net, &cctx, &sctx, &pool);
    for k in 0..4u64 {
        c.post_send_inline(&message(0, k)[..32], k, SendFlags::SIGNALED)
            .unwrap();
    }
    let wait = match net {
        Net::Shm => Duration::from_secs(1),
        Net::Verbs(_) => Duration::from_secs(6),
    };
    let until = Instant::now() + wait;
    while Instant::now() < until {
        assert!(scq.poll().is_none(), "a message without a receive");
        assert!(ccq.poll().is_none(), "a send completed without a receive");
        std::thread::sleep(Duration::from_millis(1));
    }
    let rmr = sctx.alloc_mr(4 * MSG, Access::LOCAL_WRITE).unwrap();
    for slot in 0..4u64 {
        pool.post_recv(&rmr, slot as usize * MSG, MSG, slot)
            .unwrap();
    }
    for k in 0..4u64 {
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.byte_len, r.conn_id),
            (Opcode::Recv, WcStatus::Success, k, 32, s.id())
        );
        let mut b = [0u8; 32];
        unsafe { rmr.read(k as usize * MSG, &mut b) }.unwrap();
        assert_eq!(b[..], message(0, k)[..32]);
    }
    for k in 0..4u64 {
        let sc = next(&ccq);
        assert_eq!(
            (sc.opcode, sc.status, sc.wr_id),
            (Opcode::Send, WcStatus::Success, k)
        );
    }
}

/// A pool and its connections leave nothing behind once dropped (over verbs: the device's
/// shared receive queue, its registrations and the queue pairs; receives still in the pool
/// let their regions go).
pub fn pools_and_their_connections_leave_nothing(net: &Net) {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let cycle = || {
        let pool = pool_of(&sctx, 16, None);
        let rmr = sctx.alloc_mr(4 * MSG, Access::LOCAL_WRITE).unwrap();
        for slot in 0..4u64 {
            pool.post_recv(&rmr, slot as usize * MSG, MSG, slot)
                .unwrap();
        }
        let (c, ccq, s, scq) = pooled_pair(net, &cctx, &sctx, &pool);
        c.post_send_inline(&message(0, 0)[..32], 1, SendFlags::SIGNALED)
            .unwrap();
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.conn_id),
            (Opcode::Recv, WcStatus::Success, s.id())
        );
        assert_eq!(next(&ccq).opcode, Opcode::Send);
        drop(c);
        drop(s);
        drop(pool);
        assert_eq!(
            Arc::strong_count(&rmr),
            1,
            "the pool let its receives' region go"
        );
    };
    super::cycles_leave_nothing(net, 5, 30, cycle);
}

/// The connecting side may take its receives from a pool too: a server with receives of its
/// own sends to clients whose receives come from one pool of theirs, including sends that
/// find the pool empty and wait for it.
pub fn a_connecting_side_takes_its_receives_from_a_pool(net: &Net) {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let pool = pool_of(&cctx, 8, None);
    let copts = ConnOptions {
        srq: Some(pool.clone()),
        ..Default::default()
    };
    let mut pairs = Vec::new();
    for _ in 0..2 {
        pairs.push(pair_between(
            net,
            &cctx,
            &sctx,
            &copts,
            &ConnOptions::default(),
            CqOptions::default(),
        ));
    }
    // Both servers send before the clients' pool has a receive.
    for (k, (_, _, s, _)) in pairs.iter().enumerate() {
        for m in 0..3u64 {
            s.post_send_inline(&message(k, m)[..32], m, SendFlags::SIGNALED)
                .unwrap();
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let rmr = cctx.alloc_mr(6 * MSG, Access::LOCAL_WRITE).unwrap();
    for slot in 0..6u64 {
        pool.post_recv(&rmr, slot as usize * MSG, MSG, slot)
            .unwrap();
    }
    for (k, (c, ccq, _, scq)) in pairs.iter().enumerate() {
        for m in 0..3u64 {
            let r = next(ccq);
            assert_eq!(
                (r.opcode, r.status, r.conn_id, r.byte_len),
                (Opcode::Recv, WcStatus::Success, c.id(), 32)
            );
            let mut b = [0u8; 32];
            unsafe { rmr.read(r.wr_id as usize * MSG, &mut b) }.unwrap();
            assert_eq!(b[..], message(k, m)[..32], "connection {k}, message {m}");
            let sc = next(scq);
            assert_eq!((sc.opcode, sc.status), (Opcode::Send, WcStatus::Success));
        }
    }
    assert!(pool.is_empty());
}

/// A connection accepted without blocking reports `Connected` before any of its messages,
/// even when its peer sends at once and the pool's receives are there first: over verbs the
/// device takes them as soon as the queue pair can receive, over shm the connection could
/// take them before the handshake's last step. The server is one thread that accepts and
/// polls its queue in turns, as an event loop does; each client sends right after its connect
/// returns.
pub fn a_pooled_connection_reports_connected_before_its_messages(net: &Net) {
    const N: usize = 48;
    const PER_CONN: u64 = 4;
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let ccq = CompletionQueue::new().unwrap();
    let scq = CompletionQueue::new().unwrap();
    let slots = N * PER_CONN as usize;
    let pool = pool_of(&sctx, slots as u32, None);
    let rmr = sctx.alloc_mr(slots * 16, Access::LOCAL_WRITE).unwrap();
    for slot in 0..slots {
        pool.post_recv(&rmr, slot * 16, 16, slot as u64).unwrap();
    }
    let addr = net.addr("srq-order");
    let l = sctx.listen(&addr, 64).unwrap();
    let sopts = ConnOptions {
        srq: Some(pool.clone()),
        ..Default::default()
    };
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let mut servers = Vec::new();
            // Per connection: whether its Connected came, and its messages.
            let mut seen: HashMap<u64, (bool, u64)> = HashMap::new();
            let deadline = Instant::now() + Duration::from_secs(60);
            let whole = |seen: &HashMap<u64, (bool, u64)>| {
                seen.len() == N && seen.values().all(|&(up, m)| up && m == PER_CONN)
            };
            while !whole(&seen) {
                assert!(Instant::now() < deadline, "{seen:?} after 60 s");
                if servers.len() < N
                    && let Some(r) = l.try_get_request().unwrap()
                {
                    servers.push(r.accept_start(&scq, &sopts).unwrap());
                }
                while let Some(r) = scq.poll() {
                    assert_eq!(r.status, WcStatus::Success, "{r:?}");
                    let e = seen.entry(r.conn_id).or_insert((false, 0));
                    match r.opcode {
                        Opcode::Connected => e.0 = true,
                        Opcode::Recv => {
                            assert!(
                                e.0,
                                "a message of connection {} before its Connected",
                                r.conn_id
                            );
                            e.1 += 1;
                        }
                        op => panic!("unexpected {op:?}: {r:?}"),
                    }
                }
            }
            servers
        });
        let copts = ConnOptions {
            send_queue_depth: 16,
            ..Default::default()
        };
        let clients: Vec<Connection> = (0..N)
            .map(|i| {
                let c = cctx.connect(&addr, &ccq, &copts).unwrap();
                for k in 0..PER_CONN {
                    c.post_send_inline(&message(i, k)[..16], k, SendFlags::SIGNALED)
                        .unwrap();
                }
                c
            })
            .collect();
        let mut outstanding = vec![PER_CONN as usize; N];
        let deadline = Instant::now() + Duration::from_secs(60);
        while outstanding.iter().any(|&o| o > 0) {
            assert!(Instant::now() < deadline, "sends outstanding after 60 s");
            reap_sends(&ccq, &clients, &mut outstanding);
        }
        let servers = server.join().unwrap();
        assert_eq!(servers.len(), N);
    });
}
