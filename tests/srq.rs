//! Shared receive queues over shared memory: the tests both transports run (common/pools.rs),
//! and what is particular to shm: a message waiting in the ring is taken by the post that
//! refills the pool, what a pool refuses, and a connection ending in the middle of a message.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pools::{self, MSG, pool_of, pooled_pair};
use common::{Net, next};
use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Context, Error, Opcode, SendFlags, SrqOptions, WcStatus,
};

#[test]
fn many_connections_take_their_receives_from_one_small_pool() {
    pools::many_connections_take_their_receives_from_one_small_pool(&Net::Shm);
}

#[test]
fn the_pool_reports_running_low_once_per_arming() {
    pools::the_pool_reports_running_low_once_per_arming(&Net::Shm);
}

#[test]
fn a_connecting_side_takes_its_receives_from_a_pool() {
    pools::a_connecting_side_takes_its_receives_from_a_pool(&Net::Shm);
}

#[test]
fn a_pooled_connection_reports_connected_before_its_messages() {
    pools::a_pooled_connection_reports_connected_before_its_messages(&Net::Shm);
}

#[test]
fn sends_wait_for_an_empty_pool_as_long_as_it_takes() {
    pools::sends_wait_for_an_empty_pool_as_long_as_it_takes(&Net::Shm);
}

#[test]
fn a_thousand_connections_share_one_pool_of_four_thousand_receives() {
    pools::a_thousand_connections_share_one_pool_of_four_thousand_receives(&Net::Shm);
}

/// Messages that found the pool empty wait in the ring; the post that refills the pool takes
/// them on the poster's thread: their completions are queued when the post returns, and the
/// senders' sends complete, one connection after the other as receives come.
#[test]
fn messages_that_wait_for_the_pool_are_taken_by_its_next_post() {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let pool = pool_of(&sctx, 16, None);
    let (c1, ccq1, s1, scq1) = pooled_pair(&Net::Shm, &cctx, &sctx, &pool);
    let (c2, ccq2, s2, scq2) = pooled_pair(&Net::Shm, &cctx, &sctx, &pool);
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
    let (c, _ccq, s, scq) = pooled_pair(&Net::Shm, &cctx, &sctx, &pool);
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
        let (c, _ccq, s, scq) = pooled_pair(&Net::Shm, &cctx, &sctx, &pool);
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
