//! Shared receive queues over shared memory: many connections taking their receives from one
//! pool, messages that wait for the pool, its limit event, and what it refuses.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Net, next, pair_between};
use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Connection, Context, CqOptions, Error, Opcode, Progress,
    SendFlags, SharedRecvQueue, SrqOptions, WcStatus,
};

const MSG: usize = 256;

/// `n` connections from `cctx` to one listener of `sctx`, the server's all on `scq` with
/// `pool`, the clients' all on `ccq`.
fn connect_many(
    n: usize,
    cctx: &Context,
    sctx: &Context,
    ccq: &Arc<CompletionQueue>,
    scq: &Arc<CompletionQueue>,
    pool: &SharedRecvQueue,
) -> (Vec<Connection>, Vec<Connection>) {
    let addr = Net::Shm.addr("srq");
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

fn message(conn: usize, seq: u64) -> [u8; MSG] {
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
fn reap_sends(ccq: &CompletionQueue, clients: &[Connection], outstanding: &mut [usize]) {
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
fn take_messages(
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

/// Many connections, one pool much smaller than what their senders have outstanding: every
/// message arrives whole, in order per connection, its completion naming its connection, and
/// no send fails for want of a receive (they wait until the pool is refilled).
#[test]
fn many_connections_take_their_receives_from_one_small_pool() {
    for progress in [Progress::Caller, Progress::Thread] {
        const N: usize = 32;
        const PER_CONN: u64 = 200;
        const POOL: usize = 64;
        let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let ccq = CompletionQueue::with_options(cq_opts).unwrap();
        let scq = CompletionQueue::with_options(cq_opts).unwrap();
        let pool = sctx
            .shared_recv_queue(&SrqOptions {
                depth: POOL as u32,
                ..Default::default()
            })
            .unwrap();
        let (clients, servers) = connect_many(N, &cctx, &sctx, &ccq, &scq, &pool);
        let index: HashMap<u64, usize> = servers
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id(), i))
            .collect();
        // The server's buffers: one slot per pool entry, named by wr_id.
        let rmr = sctx.alloc_mr(POOL * MSG, Access::LOCAL_WRITE).unwrap();
        for slot in 0..POOL {
            pool.post_recv(&rmr, slot * MSG, MSG, slot as u64).unwrap();
        }
        assert_eq!(pool.len(), POOL);
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
        assert_eq!(pool.len(), POOL);
    }
}

/// A pool of its own, `depth` deep, events on `cq`.
fn pool_of(ctx: &Context, depth: u32, cq: Option<&Arc<CompletionQueue>>) -> SharedRecvQueue {
    ctx.shared_recv_queue(&SrqOptions {
        depth,
        cq: cq.cloned(),
        context: 77,
    })
    .unwrap()
}

/// One connection pair whose server takes its receives from `pool`.
fn pooled_pair(
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
        &Net::Shm,
        cctx,
        sctx,
        &ConnOptions::default(),
        &sopts,
        CqOptions::default(),
    )
}

/// Messages that found the pool empty wait in the ring; the post that refills the pool takes
/// them on the poster's thread: their completions are queued when the post returns, and the
/// senders' sends complete, one connection after the other as receives come.
#[test]
fn messages_that_wait_for_the_pool_are_taken_by_its_next_post() {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let pool = pool_of(&sctx, 16, None);
    let (c1, ccq1, s1, scq1) = pooled_pair(&cctx, &sctx, &pool);
    let (c2, ccq2, s2, scq2) = pooled_pair(&cctx, &sctx, &pool);
    c1.post_send_inline(b"one", 1, SendFlags::SIGNALED).unwrap();
    c2.post_send_inline(b"two", 2, SendFlags::SIGNALED).unwrap();
    // Nothing to receive into: the servers' polls find the messages and wait for the pool.
    let until = Instant::now() + Duration::from_millis(100);
    while Instant::now() < until {
        assert!(scq1.poll().is_none() && scq2.poll().is_none());
        assert!(ccq1.poll().is_none() && ccq2.poll().is_none());
    }
    let rmr = sctx.alloc_mr(2 * MSG, Access::LOCAL_WRITE).unwrap();
    let mut seen = Vec::new();
    for slot in 0..2u64 {
        pool.post_recv(&rmr, slot as usize * MSG, MSG, slot)
            .unwrap();
        // Taken by the post: queued already, one message per receive.
        let r = scq1
            .poll()
            .or_else(|| scq2.poll())
            .expect("queued by the post");
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.byte_len),
            (Opcode::Recv, WcStatus::Success, slot, 3)
        );
        assert!(
            scq1.poll().is_none() && scq2.poll().is_none(),
            "one receive, one message"
        );
        let mut b = [0u8; 3];
        unsafe { rmr.read(slot as usize * MSG, &mut b) }.unwrap();
        let (want, from) = if r.conn_id == s1.id() {
            (b"one", 1)
        } else {
            assert_eq!(r.conn_id, s2.id());
            (b"two", 2)
        };
        assert_eq!(&b, want);
        seen.push(from);
    }
    seen.sort();
    assert_eq!(seen, [1, 2]);
    for (ccq, id) in [(&ccq1, 1), (&ccq2, 2)] {
        let c = next(ccq);
        assert_eq!(
            (c.opcode, c.status, c.wr_id),
            (Opcode::Send, WcStatus::Success, id)
        );
    }
    assert!(pool.is_empty());
}

/// The limit event: armed, it comes once, when fewer receives than the limit are left,
/// carrying how many are; armed below what is left, at once; disarmed by 0.
#[test]
fn the_pool_reports_running_low_once_per_arming() {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let events = CompletionQueue::new().unwrap();
    let pool = pool_of(&sctx, 8, Some(&events));
    let (c, _ccq, _s, scq) = pooled_pair(&cctx, &sctx, &pool);
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

/// What a pool refuses, with a clear error and nothing changed.
#[test]
fn pools_refuse_bad_input_and_change_nothing() {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    for depth in [0, rdmabridge::QUEUE_DEPTH_MAX + 1] {
        let r = sctx.shared_recv_queue(&SrqOptions {
            depth,
            ..Default::default()
        });
        assert!(
            matches!(r, Err(Error::InvalidArgument(_))),
            "depth {depth}: {r:?}"
        );
    }
    let pool = pool_of(&sctx, 2, None);
    // No queue for its events.
    assert!(matches!(pool.set_limit(1), Err(Error::InvalidArgument(_))));
    pool.set_limit(0).unwrap();
    let rmr = sctx.alloc_mr(4 * MSG, Access::LOCAL_WRITE).unwrap();
    let ro = sctx.alloc_mr(MSG, Access(0)).unwrap();
    let other = cctx.alloc_mr(MSG, Access::LOCAL_WRITE).unwrap();
    assert!(matches!(
        pool.post_recv(&ro, 0, MSG, 0),
        Err(Error::Access(_))
    ));
    assert!(matches!(
        pool.post_recv(&other, 0, MSG, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(pool.post_recv(&rmr, 4 * MSG - 1, 2, 0).is_err());
    assert!(pool.is_empty());
    pool.post_recv(&rmr, 0, MSG, 0).unwrap();
    pool.post_recv(&rmr, MSG, MSG, 1).unwrap();
    assert!(matches!(
        pool.post_recv(&rmr, 2 * MSG, MSG, 2),
        Err(Error::QueueFull(_))
    ));
    assert_eq!(pool.len(), 2);
    // A connection with a pool takes no receives of its own.
    let (c, _ccq, s, scq) = pooled_pair(&cctx, &sctx, &pool);
    assert!(matches!(
        s.post_recv(&rmr, 2 * MSG, MSG, 5),
        Err(Error::InvalidArgument(_))
    ));
    c.post_send_inline(b"still works", 3, SendFlags(0)).unwrap();
    let r = next(&scq);
    assert_eq!((r.opcode, r.wr_id, r.byte_len), (Opcode::Recv, 0, 11));
    // A pool of another context.
    let foreign = pool_of(&cctx, 2, None);
    let addr = Net::Shm.addr("srq-foreign");
    let l = sctx.listen(&addr, 4).unwrap();
    let cq = CompletionQueue::new().unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let _ = cctx.connect(&addr, &cq, &ConnOptions::default());
        });
        let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
        let opts = ConnOptions {
            srq: Some(foreign.clone()),
            ..Default::default()
        };
        let r = req.accept(&cq, &opts);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    });
}

/// A connection that ends in the middle of a message it had taken a pool's receive for
/// completes that receive flushed on its queue; the pool's other receives stay, and every
/// region is let go once the pool and its connections are gone.
#[test]
fn a_connection_ending_mid_message_flushes_only_the_receive_it_took() {
    const BIG: usize = 128 * 1024;
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let pool = pool_of(&sctx, 4, None);
    let rmr = sctx.alloc_mr(4 * BIG, Access::LOCAL_WRITE).unwrap();
    {
        let (c, _ccq, s, scq) = pooled_pair(&cctx, &sctx, &pool);
        for slot in 0..4u64 {
            pool.post_recv(&rmr, slot as usize * BIG, BIG, slot)
                .unwrap();
        }
        // Caller memory under the size that goes direct: the message goes through the ring
        // in pieces, four times what the ring holds.
        let mut src = vec![7u8; BIG];
        let smr = unsafe { cctx.register_mr(src.as_mut_ptr(), BIG, Access(0)) }.unwrap();
        c.post_send(&smr, 0, BIG, 1, SendFlags::SIGNALED).unwrap();
        // One poll takes the pieces in the ring into the pool's oldest receive; the rest
        // cannot come before the ring has room again, which the next poll would make.
        while pool.len() == 4 {
            assert!(scq.poll().is_none(), "the message cannot be whole yet");
        }
        assert_eq!(pool.len(), 3, "one receive taken for the message");
        let id = s.id();
        drop(s);
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.conn_id),
            (Opcode::Recv, WcStatus::Flushed, 0, id)
        );
        let d = next(&scq);
        assert_eq!(d.opcode, Opcode::Disconnected);
        assert_eq!(pool.len(), 3);
        drop(c);
        drop(smr);
        drop(src);
    }
    drop(pool);
    assert_eq!(
        Arc::strong_count(&rmr),
        1,
        "the pool let its receives' region go"
    );
}

/// 1,024 connections on one pool of 4,096 receives, every client sending more than its share
/// at once: every message is delivered, verified and in order per connection, and every send
/// succeeds (those that found the pool empty waited for it).
#[test]
fn a_thousand_connections_share_one_pool_of_four_thousand_receives() {
    const N: usize = 1024;
    const PER_CONN: u64 = 16;
    const POOL: usize = 4096;
    common::raise_fd_limit(16384);
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let ccq = CompletionQueue::new().unwrap();
    let scq = CompletionQueue::new().unwrap();
    let pool = pool_of(&sctx, POOL as u32, None);
    let (clients, servers) = connect_many(N, &cctx, &sctx, &ccq, &scq, &pool);
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
    let mut got = vec![0u64; N];
    let mut outstanding = vec![PER_CONN as usize; N];
    let total = N as u64 * PER_CONN;
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
