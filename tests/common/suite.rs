//! The transport-independent integration tests: every one runs over shm (tests/shm.rs) and
//! over verbs on soft-RoCE (tests/verbs.rs), unchanged but for the address.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[allow(unused_imports)] // the suite runners name them through `suite::`
pub use super::edge::{
    edge_triggered_listener_takes_a_burst, edge_triggered_loops_on_both_sides_never_stall,
    edge_triggered_waiter_never_sleeps_on_a_queued_completion,
    tokio_async_fd_loop_never_sleeps_on_a_queued_completion,
};
#[allow(unused_imports)] // the suite runners name them through `suite::`
pub use super::onesided::*;
#[allow(unused_imports)] // the suite runners name them through `suite::`
pub use super::starts::*;
use super::*;
use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Context, CqOptions, Error, Opcode, Progress, SendFlags,
    WcStatus,
};

const ECHO: &str = env!("CARGO_BIN_EXE_rbr-echo");

/// Two processes exchange 10,000 verified messages each way at every size from 1 B to 1 MiB
/// (over shm the largest are copied straight from the sender's memory; one size sits just
/// below that threshold).
pub fn processes_exchange_verified_messages_at_all_sizes(net: &Net) {
    for size in [0usize, 1, 64, 4096, 65536, (256 << 10) - 1, 1 << 20] {
        // 10,000 messages at every size; over verbs, where the device is soft-RoCE under full
        // emulation (tens of MB/s), large sizes send 256 MiB each way instead.
        let count = match net {
            Net::Shm => 10_000,
            Net::Verbs(_) => 10_000.min((256 << 20) / size.max(1)),
        };
        let addr = net.addr("proc");
        let mut server = Command::new(ECHO)
            .args(["server", &addr, &count.to_string(), &size.to_string()])
            .spawn()
            .unwrap();
        let client = Command::new(ECHO)
            .args(["client", &addr, &count.to_string(), &size.to_string()])
            .status()
            .unwrap();
        let server = server.wait().unwrap();
        assert!(client.success(), "client failed at size {size}");
        assert!(server.success(), "server failed at size {size}");
    }
}

/// Refused at once, not when the connect's timeout is up: the bound leaves a loaded machine
/// seconds to spare and stays far below the timeout.
pub fn connect_to_name_nobody_listens_on_is_refused_at_once(net: &Net) {
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let opts = ConnOptions {
        timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    let t = Instant::now();
    let r = ctx.connect(&net.addr("nobody"), &cq, &opts);
    assert!(matches!(r, Err(Error::Refused(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// Times out after its own timeout, not before, and not at the 5 s default (the ceiling leaves
/// a loaded machine seconds to spare, and stays below the default).
pub fn connect_to_silent_listener_times_out_within_its_timeout(net: &Net) {
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let addr = net.addr("silent");
    let _l = ctx.listen(&addr, 4).unwrap(); // never takes the request
    let opts = ConnOptions {
        timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    let t = Instant::now();
    let r = ctx.connect(&addr, &cq, &opts);
    let took = t.elapsed();
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(4),
        "{took:?}"
    );
}

pub fn second_listener_on_same_name_is_addr_in_use(net: &Net) {
    let ctx = Context::new().unwrap();
    let addr = net.addr("dup");
    let _l = ctx.listen(&addr, 4).unwrap();
    assert!(matches!(ctx.listen(&addr, 4), Err(Error::AddrInUse(_))));
}

pub fn reject_carries_private_data_both_ways(net: &Net) {
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let addr = net.addr("reject");
    let l = ctx.listen(&addr, 4).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
            assert_eq!(req.private_data(), b"may I?");
            req.reject(b"no, busy").unwrap();
        });
        let opts = ConnOptions {
            private_data: b"may I?".to_vec(),
            ..Default::default()
        };
        match ctx.connect(&addr, &cq, &opts) {
            Err(Error::Rejected(d)) => assert_eq!(d, b"no, busy"),
            other => panic!("expected a rejection, got {other:?}"),
        }
    });
}

pub fn accept_private_data_reaches_the_client(net: &Net) {
    let ctx = Context::new().unwrap();
    let copts = ConnOptions {
        private_data: b"hello".to_vec(),
        ..Default::default()
    };
    let sopts = ConnOptions {
        private_data: b"welcome".to_vec(),
        ..Default::default()
    };
    let (c, _ccq, s, _scq) = pair(net, &ctx, &copts, &sopts);
    assert_eq!(c.private_data(), b"welcome");
    assert_eq!(s.private_data(), b"hello");
}

pub fn oversized_private_data_is_invalid_and_nothing_is_sent(net: &Net) {
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let addr = net.addr("bigpd");
    let l = ctx.listen(&addr, 4).unwrap();
    let opts = ConnOptions {
        private_data: vec![0; 49],
        ..Default::default()
    };
    assert!(matches!(
        ctx.connect(&addr, &cq, &opts),
        Err(Error::InvalidArgument(_))
    ));
    // Nothing reached the listener.
    assert!(matches!(
        l.get_request(Some(Duration::from_millis(50))),
        Err(Error::Timeout(_))
    ));
}

/// A peer killed with SIGKILL mid-stream: the survivor gets flush completions for all its
/// outstanding work and a disconnect event at once (the dead process's socket or connection
/// closes; it takes milliseconds, and the 5 s ceiling is for a loaded machine: learning it
/// from a timer instead - keepalives, the device's retries - would show as the wrong status
/// over verbs), and tears down cleanly.
pub fn peer_killed_mid_stream_is_reported_at_once(net: &Net) {
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let addr = net.addr("kill");
    let l = ctx.listen(&addr, 4).unwrap();
    let mut child = Command::new(ECHO)
        .args(["flood", &addr, "4096"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let conn = l
        .get_request(Some(Duration::from_secs(10)))
        .unwrap()
        .accept(&cq, &ConnOptions::default())
        .unwrap();
    let mr = ctx.alloc_mr(64 * 4096, Access::LOCAL_WRITE).unwrap();
    for i in 0..64 {
        conn.post_recv(&mr, i * 4096, 4096, i as u64).unwrap();
    }
    // Sends the flooder will never take (it posted 32 receives): some stay outstanding.
    for i in 0..40 {
        conn.post_send(&mr, 0, 4096, 1000 + i, SendFlags::SIGNALED)
            .unwrap();
    }
    // Let the stream run: receives complete and are re-posted.
    let mut received = 0;
    let (mut recv_out, mut send_out) = (64u64, 40u64);
    // Each receive that completes below is posted again, so 64 stay outstanding.
    while received < 500 {
        let c = next(&cq);
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        match c.opcode {
            Opcode::Recv => {
                received += 1;
                conn.post_recv(&mr, (c.wr_id as usize) * 4096, 4096, c.wr_id)
                    .unwrap();
            }
            Opcode::Send => send_out -= 1,
            Opcode::Disconnected => panic!("disconnected early"),
            _ => unreachable!(),
        }
    }
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    let (mut flushed_recv, mut flushed_send) = (0, 0);
    loop {
        let c = next(&cq);
        match (c.opcode, c.status) {
            (Opcode::Recv, WcStatus::Success) => recv_out -= 1, // delivered before the kill
            (Opcode::Send, WcStatus::Success) => send_out -= 1,
            (Opcode::Recv, WcStatus::Flushed) => flushed_recv += 1,
            (Opcode::Send, WcStatus::Flushed) => flushed_send += 1,
            (Opcode::Disconnected, s) => {
                // Over shm the survivor sees the peer vanish; over verbs the killed process's
                // kernel closes its connection in order (a DREQ), which reads as a disconnect.
                let want = match net {
                    Net::Shm => WcStatus::Transport,
                    Net::Verbs(_) => WcStatus::Success,
                };
                assert_eq!(s, want);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "took {:?}",
        killed.elapsed()
    );
    assert_eq!(
        flushed_recv, recv_out,
        "every outstanding receive is flushed"
    );
    assert_eq!(flushed_send, send_out, "every outstanding send is flushed");
    assert!(send_out > 0, "the test meant to leave sends outstanding");
    assert!(cq.poll().is_none(), "nothing after the disconnect event");
    assert!(matches!(
        conn.post_send(&mr, 0, 1, 1, SendFlags::SIGNALED),
        Err(Error::Disconnected)
    ));
    drop(conn);
    drop(l);
}

/// A receiver that posts receives slowly never loses a message: the sender is held back
/// (verbs: receive credits; shm: messages wait in the ring for their receives).
pub fn slow_receiver_holds_sender_back_and_loses_nothing(net: &Net) {
    let ctx = Context::new().unwrap();
    let opts = ConnOptions {
        send_queue_depth: 300,
        ..Default::default()
    };
    let (c, ccq, s, scq) = pair(net, &ctx, &opts, &ConnOptions::default());
    let n = 300usize;
    let smr = ctx.alloc_mr(n * 100, Access::LOCAL_WRITE).unwrap();
    for k in 0..n {
        unsafe { smr.write(k * 100, &pattern(k as u64, 100)) }.unwrap();
        c.post_send(&smr, k * 100, 100, k as u64, SendFlags::SIGNALED)
            .unwrap();
    }
    let rmr = ctx.alloc_mr(100, Access::LOCAL_WRITE).unwrap();
    let mut buf = vec![0u8; 100];
    for k in 0..n {
        // No send can complete before a receive exists for it.
        let mut done = 0;
        while let Some(sc) = ccq.poll() {
            assert_eq!(sc.status, WcStatus::Success);
            done += 1;
        }
        assert_eq!(
            done,
            if k == 0 { 0 } else { 1 },
            "sends completed ahead of receives"
        );
        s.post_recv(&rmr, 0, 100, k as u64).unwrap();
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.byte_len),
            (Opcode::Recv, WcStatus::Success, k as u64, 100)
        );
        unsafe { rmr.read(0, &mut buf) }.unwrap();
        assert_eq!(buf, pattern(k as u64, 100), "message {k}");
        // Wait for the matching send completion before the next receive (waiting drives the
        // sender's progress, as polling does).
        if k + 1 < n {
            assert!(
                ccq.wait(Some(Duration::from_secs(5))).unwrap(),
                "send {k} did not complete"
            );
        }
        if k > 0 && k % 50 == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A receive one byte too small, for a small message and for one large enough to be copied
/// straight from the sender's memory over shm.
pub fn receive_too_small_fails_both_sides_with_length_errors(net: &Net) {
    for len in [11usize, (1 << 20) + 1] {
        let ctx = Context::new().unwrap();
        let (c, ccq, s, scq) = pair(net, &ctx, &ConnOptions::default(), &ConnOptions::default());
        let mr = ctx.alloc_mr(4 << 20, Access::LOCAL_WRITE).unwrap();
        s.post_recv(&mr, 0, len - 1, 1).unwrap();
        s.post_recv(&mr, 2 << 20, 100, 2).unwrap();
        c.post_send(&mr, 0, len, 5, SendFlags::SIGNALED).unwrap();
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id),
            (Opcode::Recv, WcStatus::LocalLength, 1),
            "{len} bytes"
        );
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id),
            (Opcode::Recv, WcStatus::Flushed, 2)
        );
        assert_eq!(next(&scq).opcode, Opcode::Disconnected);
        let sc = next(&ccq);
        assert_eq!(
            (sc.opcode, sc.status, sc.wr_id),
            (Opcode::Send, WcStatus::RemoteError, 5),
            "{len} bytes"
        );
        let d = next(&ccq);
        assert_eq!(
            (d.opcode, d.status),
            (Opcode::Disconnected, WcStatus::RemoteError)
        );
    }
}

pub fn bad_posts_return_clear_errors_and_post_nothing(net: &Net) {
    let ctx = Context::new().unwrap();
    let opts = ConnOptions {
        send_queue_depth: 2,
        recv_queue_depth: 2,
        max_inline: 16,
        ..Default::default()
    };
    let (c, ccq, s, scq) = pair(net, &ctx, &opts, &opts);
    let mr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let ro = ctx.alloc_mr(64, Access::default()).unwrap();
    let other = Context::new()
        .unwrap()
        .alloc_mr(64, Access::LOCAL_WRITE)
        .unwrap();
    assert!(matches!(
        c.post_send(&mr, 60, 5, 1, SendFlags::SIGNALED),
        Err(Error::Range { .. })
    ));
    assert!(matches!(
        c.post_send(&mr, usize::MAX, 2, 1, SendFlags::SIGNALED),
        Err(Error::Range { .. })
    ));
    assert!(matches!(
        c.post_send(&mr, 0, 1, 1, SendFlags(0x80)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        c.post_send(&other, 0, 1, 1, SendFlags::SIGNALED),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(s.post_recv(&ro, 0, 8, 1), Err(Error::Access(_))));
    assert!(matches!(
        c.post_send_inline(&[0; 17], 1, SendFlags::SIGNALED),
        Err(Error::InvalidArgument(_))
    ));
    // Two receives fill the receive queue; the third is refused.
    s.post_recv(&mr, 0, 8, 1).unwrap();
    s.post_recv(&mr, 8, 8, 2).unwrap();
    assert!(matches!(
        s.post_recv(&mr, 16, 8, 3),
        Err(Error::QueueFull(_))
    ));
    // Nothing was posted by the refused calls: exactly two messages go through.
    c.post_send_inline(b"inline!", 10, SendFlags::SIGNALED)
        .unwrap();
    c.post_send(&mr, 32, 4, 11, SendFlags(0)).unwrap(); // unsignaled: no completion
    let a = next(&scq);
    let b = next(&scq);
    assert_eq!((a.wr_id, a.byte_len, b.wr_id, b.byte_len), (1, 7, 2, 4));
    let mut got = [0u8; 7];
    unsafe { mr.read(0, &mut got) }.unwrap();
    assert_eq!(&got, b"inline!");
    assert_eq!(next(&ccq).wr_id, 10);
    std::thread::sleep(Duration::from_millis(50));
    assert!(ccq.poll().is_none(), "an unsignaled send reported success");
    assert!(scq.poll().is_none(), "a refused post produced a completion");
}

pub fn disconnect_flushes_and_reports_on_both_sides(net: &Net) {
    let ctx = Context::new().unwrap();
    let (c, ccq, s, scq) = pair(net, &ctx, &ConnOptions::default(), &ConnOptions::default());
    let mr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    c.post_recv(&mr, 0, 8, 1).unwrap();
    c.post_send(&mr, 8, 8, 2, SendFlags::SIGNALED).unwrap(); // the server posts no receive
    c.disconnect();
    let mut seen = Vec::new();
    loop {
        let e = next(&ccq);
        seen.push((e.opcode, e.status, e.wr_id));
        if e.opcode == Opcode::Disconnected {
            break;
        }
    }
    seen.sort_by_key(|x| x.2);
    assert_eq!(
        seen,
        vec![
            (Opcode::Disconnected, WcStatus::Success, 0),
            (Opcode::Recv, WcStatus::Flushed, 1),
            (Opcode::Send, WcStatus::Flushed, 2)
        ]
    );
    let e = next(&scq);
    assert_eq!(
        (e.opcode, e.status),
        (Opcode::Disconnected, WcStatus::Success)
    );
    assert!(matches!(
        s.post_recv(&mr, 0, 8, 1),
        Err(Error::Disconnected)
    ));
    assert!(matches!(
        c.post_recv(&mr, 0, 8, 1),
        Err(Error::Disconnected)
    ));
}

/// Connections of one context that end every way - refused, rejected, closed by the peer,
/// closed here - leave nothing behind for the next ones, which take up the descriptor numbers
/// (and over verbs the queue-pair numbers) the ended ones freed: an event, a completion or a
/// descriptor of the library's set left behind would fail the next handshake or end the next
/// connection. Each round ends with a connection that carries a message each way and reports
/// exactly its own completions.
pub fn connections_ending_every_way_leave_the_next_ones_clean(net: &Net) {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let cq = CompletionQueue::new().unwrap();
    let opts = ConnOptions::default();
    let rejecting_addr = net.addr("rejecting");
    let rejecting = sctx.listen(&rejecting_addr, 4).unwrap();
    for round in 0..20u64 {
        let r = cctx.connect(&net.addr("nobody"), &cq, &opts);
        assert!(matches!(r, Err(Error::Refused(_))), "round {round}: {r:?}");
        std::thread::scope(|s| {
            s.spawn(|| {
                let req = rejecting
                    .get_request(Some(Duration::from_secs(10)))
                    .unwrap();
                req.reject(b"not now").unwrap();
            });
            match cctx.connect(&rejecting_addr, &cq, &opts) {
                Err(Error::Rejected(d)) => assert_eq!(d, b"not now", "round {round}"),
                other => panic!("round {round}: expected a rejection, got {other:?}"),
            }
        });
        // Closed by the peer: the client goes at once, its end perhaps not yet seen.
        let (c, _ccq, s, _scq) =
            pair_between(net, &cctx, &sctx, &opts, &opts, CqOptions::default());
        drop(s);
        drop(c);
        // Closed here, the peer's end seen.
        let (c, ccq, s, scq) = pair_between(net, &cctx, &sctx, &opts, &opts, CqOptions::default());
        drop(c);
        let e = next(&ccq);
        assert_eq!(
            (e.opcode, e.status),
            (Opcode::Disconnected, WcStatus::Success)
        );
        let e = next(&scq);
        assert_eq!(
            (e.opcode, e.status),
            (Opcode::Disconnected, WcStatus::Success)
        );
        drop(s);
        // The next one works and reports only its own work.
        let (c, ccq, s, scq) = pair_between(net, &cctx, &sctx, &opts, &opts, CqOptions::default());
        let (cmr, smr) = (
            cctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap(),
            sctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap(),
        );
        s.post_recv(&smr, 0, 32, 1).unwrap();
        c.post_recv(&cmr, 0, 32, 2).unwrap();
        unsafe { cmr.write(32, &round.to_le_bytes()) }.unwrap();
        c.post_send(&cmr, 32, 8, 3, SendFlags::SIGNALED).unwrap();
        let e = next(&scq);
        assert_eq!(
            (e.opcode, e.status, e.wr_id, e.byte_len),
            (Opcode::Recv, WcStatus::Success, 1, 8)
        );
        unsafe { smr.write(32, &(round + 100).to_le_bytes()) }.unwrap();
        s.post_send(&smr, 32, 8, 4, SendFlags::SIGNALED).unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            let e = next(&ccq);
            got.push((e.opcode, e.status, e.wr_id));
        }
        got.sort_by_key(|g| g.2);
        assert_eq!(
            got,
            [
                (Opcode::Recv, WcStatus::Success, 2),
                (Opcode::Send, WcStatus::Success, 3)
            ],
            "round {round}"
        );
        let e = next(&scq);
        assert_eq!(
            (e.opcode, e.status, e.wr_id),
            (Opcode::Send, WcStatus::Success, 4)
        );
        let mut buf = [0u8; 8];
        unsafe { cmr.read(0, &mut buf) }.unwrap();
        assert_eq!(u64::from_le_bytes(buf), round + 100);
        unsafe { smr.read(0, &mut buf) }.unwrap();
        assert_eq!(u64::from_le_bytes(buf), round);
        assert!(
            ccq.poll().is_none() && scq.poll().is_none(),
            "round {round}"
        );
        drop((c, s));
        for q in [&ccq, &scq] {
            let e = next(q);
            assert_eq!(
                (e.opcode, e.status),
                (Opcode::Disconnected, WcStatus::Success)
            );
        }
    }
    assert!(
        cq.poll().is_none(),
        "failed connects report nothing on the queue"
    );
}

/// An unsignaled send reports only a failure: one the peer received reports nothing when the
/// connection closes afterwards (it is not flushed), and the close is reported without the
/// library waiting out its 2 s bound on the device's flushes, which is kept for work whose
/// fate it cannot learn.
pub fn delivered_unsignaled_send_reports_nothing_at_close(net: &Net) {
    let ctx = Context::new().unwrap();
    let (c, ccq, s, scq) = pair(net, &ctx, &ConnOptions::default(), &ConnOptions::default());
    let mr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    s.post_recv(&mr, 0, 16, 1).unwrap();
    c.post_send_inline(b"delivered", 2, SendFlags::default())
        .unwrap();
    let e = next(&scq);
    assert_eq!(
        (e.opcode, e.status, e.wr_id, e.byte_len),
        (Opcode::Recv, WcStatus::Success, 1, 9)
    );
    let t = Instant::now();
    c.disconnect();
    let e = next(&ccq);
    assert_eq!(
        (e.opcode, e.status),
        (Opcode::Disconnected, WcStatus::Success),
        "the delivered unsignaled send reported {e:?}"
    );
    // The wait it must not make is 2 s long, never shorter: the ceiling sits just below it.
    assert!(
        t.elapsed() < Duration::from_millis(1900),
        "the close took {:?}: the library waited for a flush that never comes",
        t.elapsed()
    );
    let e = next(&scq);
    assert_eq!(
        (e.opcode, e.status),
        (Opcode::Disconnected, WcStatus::Success)
    );
}

/// The queue's descriptor, level-triggered: readable once a poll finds completions (sends
/// completed while nobody polled, a disconnect the library queued), unreadable again once a
/// poll has found nothing and nothing new came.
pub fn completion_fd_is_readable_while_a_poll_finds_completions(net: &Net) {
    let readable_within = |fd, t: Duration| {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, t.as_millis() as i32) == 1 }
    };
    let readable = |fd| readable_within(fd, Duration::ZERO);
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let addr = net.addr("fd");
    let l = ctx.listen(&addr, 4).unwrap();
    let scq = CompletionQueue::new().unwrap();
    let (c, s) = std::thread::scope(|t| {
        let h = t.spawn(|| {
            l.get_request(Some(Duration::from_secs(10)))
                .unwrap()
                .accept(&scq, &ConnOptions::default())
                .unwrap()
        });
        (
            ctx.connect(&addr, &cq, &ConnOptions::default()).unwrap(),
            h.join().unwrap(),
        )
    });
    let mr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    assert!(!readable(cq.fd()));
    for i in 0..3 {
        s.post_recv(&mr, 0, 64, i).unwrap();
        c.post_send(&mr, 0, 8, i, SendFlags::SIGNALED).unwrap();
    }
    // The receiving side takes the messages (its polls move them out of an shm ring) and
    // keeps what it takes out of the way; over verbs with progress threads its thread may
    // queue them after the sends completed here.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut received = 0;
    while received < 3 {
        assert!(
            Instant::now() < deadline,
            "{received} of 3 receives completed"
        );
        scq.wait(Some(Duration::from_millis(100))).unwrap();
        received += scq.poll_into(&mut Vec::new(), 16);
    }
    assert_eq!(received, 3);
    // The sends completed: the descriptor says so, though nobody polled this queue since
    // they were posted (over shm its pollers take them from the ring, so a poll is what
    // queues them).
    let mut sends = 0;
    while sends < 3 {
        let woke = Instant::now();
        assert!(
            readable_within(cq.fd(), Duration::from_secs(5)),
            "{sends} of 3 send completions announced"
        );
        assert!(woke.elapsed() < Duration::from_secs(5));
        while let Some(e) = cq.poll() {
            assert_eq!((e.opcode, e.status), (Opcode::Send, WcStatus::Success));
            sends += 1;
        }
    }
    assert!(
        !readable(cq.fd()),
        "readable after a poll found nothing, with nothing new"
    );
    assert!(!cq.wait(Some(Duration::from_millis(20))).unwrap());
    // Queued by the library itself (a disconnect): readable while queued, then not.
    drop(s);
    assert!(readable_within(cq.fd(), Duration::from_secs(5)));
    let e = next(&cq);
    assert_eq!(e.opcode, Opcode::Disconnected);
    assert!(cq.poll().is_none());
    assert!(!readable(cq.fd()), "readable with nothing queued");
    drop(c);
}

/// A queue slot is free as soon as its completion can be polled: a full receive queue takes a
/// new receive right after each completion, every time.
pub fn slot_is_free_once_its_completion_is_seen(net: &Net) {
    let ctx = Context::new().unwrap();
    let opts = ConnOptions {
        send_queue_depth: 4,
        recv_queue_depth: 4,
        ..Default::default()
    };
    let (c, ccq, s, scq) = pair(net, &ctx, &opts, &opts);
    let mr = ctx.alloc_mr(4 * 64, Access::LOCAL_WRITE).unwrap();
    for i in 0..4 {
        s.post_recv(&mr, i * 64, 64, i as u64).unwrap();
    }
    for k in 0..2000u64 {
        c.post_send_inline(&k.to_le_bytes(), k, SendFlags::SIGNALED)
            .unwrap();
        let r = next(&scq);
        assert_eq!((r.opcode, r.status), (Opcode::Recv, WcStatus::Success));
        s.post_recv(&mr, r.wr_id as usize * 64, 64, r.wr_id)
            .expect("slot freed with its completion");
        let sc = next(&ccq);
        assert_eq!(sc.wr_id, k);
    }
}

/// 200 connect / transfer / close cycles: descriptors, mappings and (over verbs) the kernel's
/// RDMA objects and pinned memory return to where they were.
pub fn connect_close_cycles_leak_nothing(net: &Net) {
    // One malloc arena: glibc otherwise maps a new arena whenever a thread meets contention,
    // and that allocator noise would hide in the mapping count.
    // SAFETY: mallopt only changes the allocator's tuning.
    assert_eq!(unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) }, 1);
    let ctx = Context::new().unwrap();
    let cycle = |ctx: &Context| {
        let (c, ccq, s, scq) = pair(net, ctx, &ConnOptions::default(), &ConnOptions::default());
        let mr = ctx.alloc_mr(8192, Access::LOCAL_WRITE).unwrap();
        s.post_recv(&mr, 4096, 4096, 7).unwrap();
        unsafe { mr.write(0, &pattern(3, 4096)) }.unwrap();
        c.post_send(&mr, 0, 4096, 9, SendFlags::SIGNALED).unwrap();
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.byte_len, r.wr_id),
            (Opcode::Recv, WcStatus::Success, 4096, 7)
        );
        let sc = next(&ccq);
        assert_eq!((sc.opcode, sc.wr_id), (Opcode::Send, 9));
        drop(c);
        drop(s);
    };
    // The warm-up fills glibc's thread-stack cache and malloc arenas.
    cycles_leave_nothing(net, 50, 200, || cycle(&ctx));
}

/// A connection left idle (over verbs the library then sends keepalives of its own) stays up,
/// reports nothing of its own, and carries messages afterwards.
pub fn idle_connection_stays_up_and_reports_nothing(net: &Net) {
    let ctx = Context::new().unwrap();
    let (c, ccq, s, scq) = pair(net, &ctx, &ConnOptions::default(), &ConnOptions::default());
    std::thread::sleep(Duration::from_millis(3500));
    assert!(
        ccq.poll().is_none() && scq.poll().is_none(),
        "an idle connection reported something"
    );
    let mr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    s.post_recv(&mr, 0, 64, 1).unwrap();
    c.post_send_inline(b"still here", 2, SendFlags::SIGNALED)
        .unwrap();
    let r = next(&scq);
    assert_eq!(
        (r.opcode, r.status, r.byte_len),
        (Opcode::Recv, WcStatus::Success, 10)
    );
    let sc = next(&ccq);
    assert_eq!(
        (sc.opcode, sc.status, sc.wr_id),
        (Opcode::Send, WcStatus::Success, 2)
    );
    assert!(ccq.poll().is_none() && scq.poll().is_none());
}

fn read_u64(mr: &rdmabridge::MemoryRegion, offset: usize) -> u64 {
    let mut b = [0u8; 8];
    unsafe { mr.read(offset, &mut b) }.unwrap();
    u64::from_le_bytes(b)
}

fn fd_readable_within(fd: i32, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) == 1 }
}

/// In both progress modes, with no spinning, a sleeper wakes for a completion that arrives
/// after it went to sleep: on the descriptor after a poll found nothing, and in `wait`.
pub fn sleepers_wake_for_late_completions_in_both_progress_modes(net: &Net) {
    for progress in [Progress::Caller, Progress::Thread] {
        let ctx = Context::new().unwrap();
        let cq_opts = CqOptions {
            progress,
            spin: Duration::ZERO,
        };
        let copts = ConnOptions::default();
        let (c, ccq, s, scq) = pair_with(net, &ctx, &copts, &copts, cq_opts);
        let mr = ctx.alloc_mr(128, Access::LOCAL_WRITE).unwrap();
        // One exchange before the descriptor is asked for, so whatever the device was asked to
        // announce at the start has been used up.
        s.post_recv(&mr, 0, 64, 99).unwrap();
        c.post_send_inline(b"warm-up", 99, SendFlags::SIGNALED)
            .unwrap();
        assert_eq!(next(&scq).wr_id, 99);
        assert_eq!(next(&ccq).wr_id, 99);
        let sfd = scq.fd();
        for k in 0..20u64 {
            // Server: sleep on the descriptor (the first time without polling at all, since it
            // is readable exactly while something is queued; later after a poll found nothing).
            s.post_recv(&mr, 0, 64, k).unwrap();
            if k > 0 {
                assert_eq!(scq.poll(), None, "{progress:?}");
            }
            std::thread::scope(|t| {
                t.spawn(|| {
                    std::thread::sleep(Duration::from_millis(20));
                    c.post_send_inline(&k.to_le_bytes(), k, SendFlags::SIGNALED)
                        .unwrap();
                });
                assert!(
                    fd_readable_within(sfd, Duration::from_secs(10)),
                    "{progress:?}: descriptor not readable for a late receive ({k})"
                );
            });
            let r = scq.poll().expect("readable, so something is queued");
            assert_eq!(
                (r.wr_id, r.opcode, r.status, r.byte_len),
                (k, Opcode::Recv, WcStatus::Success, 8),
                "{progress:?}"
            );
            assert_eq!(read_u64(&mr, 0), k);
            let sc = next(&ccq);
            assert_eq!(
                (sc.wr_id, sc.opcode, sc.status),
                (k, Opcode::Send, WcStatus::Success)
            );
            // Client: nothing queued, then sleep in wait() for the server's late reply.
            c.post_recv(&mr, 64, 64, k).unwrap();
            assert_eq!(ccq.poll(), None, "{progress:?}");
            std::thread::scope(|t| {
                t.spawn(|| {
                    std::thread::sleep(Duration::from_millis(20));
                    s.post_send_inline(&(!k).to_le_bytes(), k, SendFlags::SIGNALED)
                        .unwrap();
                });
                assert!(
                    ccq.wait(Some(Duration::from_secs(10))).unwrap(),
                    "{progress:?}: wait did not wake for a late receive ({k})"
                );
            });
            let r = ccq.poll().expect("wait said something is queued");
            assert_eq!(
                (r.wr_id, r.opcode, r.status),
                (k, Opcode::Recv, WcStatus::Success)
            );
            assert_eq!(read_u64(&mr, 64), !k);
            let sc = next(&scq);
            assert_eq!(
                (sc.wr_id, sc.opcode, sc.status),
                (k, Opcode::Send, WcStatus::Success)
            );
        }
        assert_eq!(scq.poll(), None);
        assert!(
            !fd_readable_within(sfd, Duration::ZERO),
            "readable with nothing queued"
        );
    }
}

/// In both progress modes, three threads polling one queue (busy-polling; polling, then
/// waiting; and with poll_wait_with) take every completion exactly once, and each connection's
/// completions in order.
pub fn threads_polling_one_queue_take_each_completion_once(net: &Net) {
    const N: u64 = 3000;
    const SLOTS: usize = 32;
    for progress in [Progress::Caller, Progress::Thread] {
        let ctx = Context::new().unwrap();
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let opts = ConnOptions {
            recv_queue_depth: SLOTS as u32,
            ..Default::default()
        };
        let (c, ccq, s, scq) = pair_with(net, &ctx, &opts, &opts, cq_opts);
        let mr = ctx.alloc_mr(SLOTS * 8, Access::LOCAL_WRITE).unwrap();
        for i in 0..SLOTS {
            s.post_recv(&mr, i * 8, 8, i as u64).unwrap();
        }
        let seen = std::sync::Mutex::new(vec![0u32; N as usize]);
        let taken = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|t| {
            // One thread busy-polls, one polls and waits when it finds nothing, one takes up
            // to four at a time with poll_wait_with (polling, then sleeping, in one call).
            for how in ["busy", "poll, then wait", "poll_wait_with"] {
                let (s, scq, mr, seen, taken) = (&s, &scq, &mr, &seen, &taken);
                t.spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(120);
                    let mut last = None;
                    let mut batch = Vec::new();
                    while taken.load(std::sync::atomic::Ordering::SeqCst) < N {
                        assert!(Instant::now() < deadline, "{progress:?}: stalled");
                        match how {
                            "busy" => batch.extend(scq.poll()),
                            "poll, then wait" => match scq.poll() {
                                Some(r) => batch.push(r),
                                None => {
                                    scq.wait(Some(Duration::from_millis(50))).unwrap();
                                }
                            },
                            _ => {
                                let got = scq
                                    .poll_wait_with(4, Some(Duration::from_millis(50)), &mut |c| {
                                        batch.push(c)
                                    })
                                    .unwrap();
                                assert!(got == batch.len() && got <= 4, "{progress:?}: {got}");
                            }
                        }
                        for r in batch.drain(..) {
                            assert_eq!((r.opcode, r.status), (Opcode::Recv, WcStatus::Success));
                            let slot = r.wr_id as usize;
                            let k = read_u64(mr, slot * 8);
                            // This thread's share of the messages comes out in sending order.
                            assert!(
                                last.is_none_or(|l| l < k),
                                "{progress:?} ({how}): {k} after {last:?}"
                            );
                            last = Some(k);
                            seen.lock().unwrap()[k as usize] += 1;
                            taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            if k + (SLOTS as u64) < N {
                                s.post_recv(mr, slot * 8, 8, slot as u64).unwrap();
                            }
                        }
                    }
                });
            }
            let mut inflight = 0;
            for k in 0..N {
                while inflight >= 64 {
                    let sc = next(&ccq);
                    assert_eq!((sc.opcode, sc.status), (Opcode::Send, WcStatus::Success));
                    inflight -= 1;
                }
                c.post_send_inline(&k.to_le_bytes(), k, SendFlags::SIGNALED)
                    .unwrap();
                inflight += 1;
            }
            while inflight > 0 {
                assert_eq!(next(&ccq).status, WcStatus::Success);
                inflight -= 1;
            }
        });
        assert!(
            seen.lock().unwrap().iter().all(|&n| n == 1),
            "{progress:?}: a message was lost or seen twice"
        );
    }
}

/// An orderly close is reported as one, whichever side closes and with receives posted on both:
/// every outstanding receive is flushed, then both sides' disconnect records say success.
pub fn orderly_close_with_receives_posted_is_always_success(net: &Net) {
    let pairs = match net {
        Net::Shm => 2000,
        Net::Verbs(_) => 40,
    };
    let ctx = Context::new().unwrap();
    let addr = net.addr("close");
    let l = ctx.listen(&addr, 16).unwrap();
    let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let ccq = CompletionQueue::new().unwrap();
    let scq = CompletionQueue::new().unwrap();
    // Takes one connection's records up to its disconnect: `recvs` flushed receives, then the
    // disconnect, whose status is returned.
    let drain = |cq: &CompletionQueue, recvs: usize, i: usize| {
        let mut flushed = 0;
        loop {
            let c = next(cq);
            match c.opcode {
                Opcode::Recv => {
                    assert_eq!(c.status, WcStatus::Flushed, "pair {i}: {c:?}");
                    flushed += 1;
                }
                Opcode::Disconnected => {
                    assert_eq!(flushed, recvs, "pair {i}: flushed receives");
                    return c.status;
                }
                _ => panic!("pair {i}: unexpected {c:?}"),
            }
        }
    };
    for i in 0..pairs {
        let (c, s) = std::thread::scope(|sc| {
            let h = sc.spawn(|| {
                l.get_request(Some(Duration::from_secs(10)))
                    .unwrap()
                    .accept(&scq, &ConnOptions::default())
                    .unwrap()
            });
            let c = ctx.connect(&addr, &ccq, &ConnOptions::default()).unwrap();
            (c, h.join().unwrap())
        });
        for k in 0..4u64 {
            let off = k as usize * 1024;
            c.post_recv(&mr, off, 1024, k).unwrap();
            s.post_recv(&mr, off, 1024, k).unwrap();
        }
        // Alternate which side closes.
        let (closer, closer_cq, peer, peer_cq) = if i % 2 == 0 {
            (c, &ccq, s, &scq)
        } else {
            (s, &scq, c, &ccq)
        };
        drop(closer);
        assert_eq!(
            drain(closer_cq, 4, i),
            WcStatus::Success,
            "pair {i}: closer"
        );
        assert_eq!(drain(peer_cq, 4, i), WcStatus::Success, "pair {i}: peer");
        drop(peer);
        assert!(
            ccq.poll().is_none() && scq.poll().is_none(),
            "pair {i}: records after the disconnect"
        );
    }
}

/// Accepting from an event loop: `try_get_request` never blocks and never loses a peer. A burst
/// of clients connecting at once, served by a loop that only takes requests without waiting
/// when the listener's descriptor is readable, all get connected; over shm, clients that connect
/// and then say nothing neither make the descriptor readable nor stall the loop.
pub fn event_loop_accepts_a_burst_without_losing_a_peer(net: &Net) {
    let clients = match net {
        Net::Shm => 200,
        Net::Verbs(_) => 20,
    };
    // A call that blocked would wait for a request (forever) or for a silent peer's 2 s: the
    // ceiling stays below that and leaves a loaded machine room.
    const NEVER_BLOCKS: Duration = Duration::from_secs(1);
    let ctx = Context::new().unwrap();
    let addr = net.addr("burst");
    let l = ctx.listen(&addr, 256).unwrap();
    let fd = l.fd();
    let readable = |ms: i32| {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, ms) == 1 }
    };
    let t = Instant::now();
    assert!(l.try_get_request().unwrap().is_none());
    assert!(t.elapsed() < NEVER_BLOCKS, "{:?}", t.elapsed());
    assert!(!readable(0), "readable with nobody connecting");
    // Silent peers (shm): connected sockets that never send a hello.
    let silent: Vec<std::os::fd::OwnedFd> = match net {
        Net::Shm => (0..3).map(|_| raw_shm_peer(&addr)).collect(),
        Net::Verbs(_) => Vec::new(),
    };
    if !silent.is_empty() {
        assert!(
            readable(1000),
            "a connecting peer makes the listener readable"
        );
        let t = Instant::now();
        assert!(
            l.try_get_request().unwrap().is_none(),
            "a silent peer is no request"
        );
        assert!(t.elapsed() < NEVER_BLOCKS, "{:?}", t.elapsed());
        assert!(!readable(0), "silent peers keep the descriptor readable");
    }
    let scq = CompletionQueue::new().unwrap();
    let barrier = std::sync::Barrier::new(clients);
    let accepted = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(|| {
                    let cq = CompletionQueue::new().unwrap();
                    let opts = ConnOptions {
                        timeout: Some(Duration::from_secs(60)),
                        ..Default::default()
                    };
                    barrier.wait();
                    let c = ctx
                        .connect(&addr, &cq, &opts)
                        .expect("every client connects");
                    // Stay connected until the server has taken everybody.
                    loop {
                        let r = next(&cq);
                        if r.opcode == Opcode::Disconnected {
                            break;
                        }
                    }
                    drop(c);
                })
            })
            .collect();
        let mut conns = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        while conns.len() < clients {
            assert!(
                Instant::now() < deadline,
                "accepted {} of {clients}",
                conns.len()
            );
            if !readable(100) {
                continue;
            }
            while let Some(req) = l.try_get_request().unwrap() {
                conns.push(req.accept(&scq, &ConnOptions::default()).unwrap());
            }
        }
        let n = conns.len();
        drop(conns); // the clients see their disconnect and end
        for h in handles {
            h.join().unwrap();
        }
        n
    });
    assert_eq!(accepted, clients);
    drop(silent);
}

/// A message sent before its receive exists is delivered by the receive's post: the receive's
/// completion is in the queue when `post_recv` returns, without the sender's library or a
/// timer having to move it (most rounds are held to that: over verbs the message reaches the
/// receiver's library ahead of the post only once two RDMA writes landed, which a loaded
/// machine may delay past the wait here). Then messages raced against receives posted one at
/// a time - some finding a receive, some waiting, some posted just as the receive is - arrive
/// each once, in order, with their bytes.
pub fn waiting_messages_arrive_in_the_receives_post_once_and_in_order(net: &Net) {
    const ROUNDS: u64 = 6;
    const RACED: u64 = 2_000;
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let (c, ccq, s, scq) = pair(net, &ctx, &opts, &opts);
    let rmr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let message = |k: u64| {
        let mut m = pattern(k, 8 + (k % 57) as usize);
        m[..8].copy_from_slice(&k.to_le_bytes());
        m
    };
    let mut at_once = 0;
    for k in 0..ROUNDS {
        c.post_send_inline(&message(k), k, SendFlags::SIGNALED)
            .unwrap();
        // The sender's side is idle meanwhile.
        std::thread::sleep(Duration::from_millis(300));
        s.post_recv(&rmr, 0, 64, k).unwrap();
        let r = match scq.poll() {
            Some(r) => {
                at_once += 1;
                r
            }
            None => next(&scq),
        };
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.byte_len),
            (Opcode::Recv, WcStatus::Success, k, message(k).len() as u32)
        );
        let mut got = vec![0u8; message(k).len()];
        unsafe { rmr.read(0, &mut got) }.unwrap();
        assert_eq!(got, message(k), "round {k}");
        let sc = next(&ccq);
        assert_eq!(
            (sc.opcode, sc.status, sc.wr_id),
            (Opcode::Send, WcStatus::Success, k)
        );
    }
    assert!(
        at_once * 2 > ROUNDS,
        "{at_once} of {ROUNDS} waiting messages were delivered by their receive's post"
    );

    // Raced: the client keeps up to 4 sends out; the server posts one receive at a time,
    // now at once, now after a pause.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut out = 0;
            for k in ROUNDS..ROUNDS + RACED {
                while out >= 4 {
                    let done = next(&ccq);
                    assert_eq!(
                        (done.opcode, done.status),
                        (Opcode::Send, WcStatus::Success)
                    );
                    out -= 1;
                }
                c.post_send_inline(&message(k), k, SendFlags::SIGNALED)
                    .unwrap();
                out += 1;
                if k % 7 == 0 {
                    std::thread::sleep(Duration::from_micros(50 * (k % 5)));
                }
            }
            for _ in 0..out {
                assert_eq!(next(&ccq).status, WcStatus::Success);
            }
        });
        for k in ROUNDS..ROUNDS + RACED {
            if k % 3 == 0 {
                std::thread::sleep(Duration::from_micros(30 * (k % 11)));
            }
            s.post_recv(&rmr, 0, 64, k).unwrap();
            let r = next(&scq);
            assert_eq!(
                (r.opcode, r.status, r.wr_id, r.byte_len),
                (Opcode::Recv, WcStatus::Success, k, message(k).len() as u32),
                "message {k}"
            );
            let mut got = vec![0u8; message(k).len()];
            unsafe { rmr.read(0, &mut got) }.unwrap();
            assert_eq!(got, message(k), "message {k}");
        }
    });
    assert!(scq.poll().is_none(), "a message delivered twice");
}

/// A receiver that closes right after posting the receive a waiting message went to (no poll
/// of its queue between, as a server that answers one request and hangs up): the sender's send
/// completes as its receive did - a success when the message arrived, never flushed while the
/// receiver has it. Over verbs the message is mostly taken from the bounce area by the post, and
/// only the claim written before the disconnect tells the sender so.
pub fn a_waiting_message_taken_just_before_a_close_is_a_success_at_the_sender(net: &Net) {
    const ROUNDS: u64 = 6;
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let rmr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let mut delivered = 0;
    for k in 0..ROUNDS {
        let (c, ccq, s, scq) = pair(net, &ctx, &opts, &opts);
        c.post_send_inline(&pattern(k, 24), k, SendFlags::SIGNALED)
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        s.post_recv(&rmr, 0, 64, k).unwrap();
        drop(s);
        let r = next(&scq);
        assert_eq!((r.opcode, r.wr_id), (Opcode::Recv, k), "round {k}");
        let sc = next(&ccq);
        assert_eq!((sc.opcode, sc.wr_id), (Opcode::Send, k), "round {k}");
        assert_eq!(
            sc.status, r.status,
            "round {k}: the receive completed {:?}, the send {:?}",
            r.status, sc.status
        );
        if r.status == WcStatus::Success {
            delivered += 1;
            let mut got = vec![0u8; 24];
            unsafe { rmr.read(0, &mut got) }.unwrap();
            assert_eq!(got, pattern(k, 24), "round {k}");
        }
        assert_eq!(next(&ccq).opcode, Opcode::Disconnected, "round {k}");
        drop(c);
    }
    assert!(
        delivered > 0,
        "no round delivered its message before the close"
    );
}

/// A sender that closes as soon as the answer to its waiting message comes (a client that
/// sends a request, takes the reply and hangs up): its send, unsignaled, reports nothing - it
/// was delivered - never a flush. The receiver posts the receive the message waited for and
/// answers at once, without a poll between; over verbs the post mostly takes the message from
/// the bounce area, and the sender learns that only from the claim, which must reach it before
/// the answer does.
pub fn a_sender_closing_on_the_answer_to_its_waiting_message_sees_no_flush(net: &Net) {
    const ROUNDS: u64 = 6;
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let smr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let cmr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    for k in 0..ROUNDS {
        let (c, ccq, s, scq) = pair(net, &ctx, &opts, &opts);
        c.post_recv(&cmr, 0, 64, 100 + k).unwrap();
        c.post_send_inline(&pattern(k, 24), k, SendFlags::default())
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        s.post_recv(&smr, 0, 64, k).unwrap();
        s.post_send_inline(&pattern(k + 1, 16), 200 + k, SendFlags::default())
            .unwrap();
        let a = next(&ccq);
        assert_eq!(
            (a.opcode, a.status, a.wr_id, a.byte_len),
            (Opcode::Recv, WcStatus::Success, 100 + k, 16),
            "round {k}"
        );
        drop(c);
        let end = next(&ccq);
        assert_eq!(
            (end.opcode, end.status),
            (Opcode::Disconnected, WcStatus::Success),
            "round {k}: the sender's queue after the answer: {end:?}"
        );
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.byte_len),
            (Opcode::Recv, WcStatus::Success, k, 24),
            "round {k}"
        );
        let mut got = vec![0u8; 24];
        unsafe { smr.read(0, &mut got) }.unwrap();
        assert_eq!(got, pattern(k, 24), "round {k}");
        drop(s);
    }
}

/// A send whose receive is posted 10 s late waits for it and completes with the right bytes,
/// with the default options, while the sender sleeps in `wait`: the library, not the device's
/// receiver-not-ready retries (which soft-RoCE bounds by `retry_count`, ~4 s), holds it back.
/// Both a 2-byte inline send and a 64 KiB send from a region, in both progress modes; the
/// connection works on afterwards.
pub fn late_receive_send_waits_and_completes(net: &Net) {
    const LATE: Duration = Duration::from_secs(10);
    const BIG: usize = 64 << 10;
    for progress in [Progress::Caller, Progress::Thread] {
        let ctx = Context::new().unwrap();
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let opts = ConnOptions::default();
        let (c, ccq, s, scq) = pair_with(net, &ctx, &opts, &opts, cq_opts);
        let smr = ctx.alloc_mr(BIG, Access::LOCAL_WRITE).unwrap();
        unsafe { smr.write(0, &pattern(7, BIG)) }.unwrap();
        let rmr = ctx.alloc_mr(BIG + 64, Access::LOCAL_WRITE).unwrap();
        let t0 = Instant::now();
        c.post_send_inline(&[0xa5, 0x5a], 1, SendFlags::SIGNALED)
            .unwrap();
        c.post_send(&smr, 0, BIG, 2, SendFlags::SIGNALED).unwrap();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                std::thread::sleep(LATE);
                s.post_recv(&rmr, 0, 64, 10).unwrap();
                s.post_recv(&rmr, 64, BIG, 11).unwrap();
            });
            // The sender sleeps meanwhile; it wakes for its first completion only once the
            // receives exist.
            assert!(
                ccq.wait(Some(LATE + Duration::from_secs(20))).unwrap(),
                "{progress:?}: no send completion within {:?}",
                LATE + Duration::from_secs(20)
            );
            let woke = t0.elapsed();
            assert!(
                woke >= LATE,
                "{progress:?}: a send completed after {woke:?}"
            );
            eprintln!("{progress:?}: first send completion after {woke:?}");
        });
        for wr_id in [1, 2] {
            let sc = next(&ccq);
            assert_eq!(
                (sc.opcode, sc.status, sc.wr_id),
                (Opcode::Send, WcStatus::Success, wr_id),
                "{progress:?}"
            );
        }
        for (wr_id, len) in [(10, 2), (11, BIG as u32)] {
            let r = next(&scq);
            assert_eq!(
                (r.opcode, r.status, r.wr_id, r.byte_len),
                (Opcode::Recv, WcStatus::Success, wr_id, len),
                "{progress:?}"
            );
        }
        let mut got = vec![0u8; BIG];
        unsafe { rmr.read(0, &mut got[..2]) }.unwrap();
        assert_eq!(got[..2], [0xa5, 0x5a], "{progress:?}");
        unsafe { rmr.read(64, &mut got) }.unwrap();
        assert!(
            got == pattern(7, BIG),
            "{progress:?}: 64 KiB message differs"
        );
        // Still connected, both ways.
        c.post_recv(&rmr, 0, 64, 20).unwrap();
        s.post_send_inline(b"ok", 21, SendFlags::SIGNALED).unwrap();
        let r = next(&ccq);
        assert_eq!((r.wr_id, r.status, r.byte_len), (20, WcStatus::Success, 2));
        let sc = next(&scq);
        assert_eq!((sc.wr_id, sc.status), (21, WcStatus::Success));
        assert!(ccq.is_empty() && scq.is_empty());
        drop((c, s));
    }
}

/// Sends that ask for no completion never fill the send queue (of depth 16, 4 and 1): 64 of
/// them go out one after another (polling reaps what finished, reporting none of it), every
/// message arrives in order with its bytes, and a signaled send after them is the sender's
/// only completion.
pub fn unsignaled_sends_never_fill_the_send_queue(net: &Net) {
    let ctx = Context::new().unwrap();
    for depth in [16, 4, 1] {
        unsignaled_sends_at_depth(net, &ctx, depth);
    }
}

fn unsignaled_sends_at_depth(net: &Net, ctx: &Context, depth: u32) {
    const N: usize = 64;
    const SIZE: usize = 64;
    let copts = ConnOptions {
        send_queue_depth: depth,
        ..Default::default()
    };
    let sopts = ConnOptions {
        recv_queue_depth: 128,
        ..Default::default()
    };
    let (c, ccq, s, scq) = pair(net, ctx, &copts, &sopts);
    let cmr = ctx.alloc_mr((N + 1) * SIZE, Access::LOCAL_WRITE).unwrap();
    let smr = ctx.alloc_mr((N + 1) * SIZE, Access::LOCAL_WRITE).unwrap();
    for k in 0..=N {
        s.post_recv(&smr, k * SIZE, SIZE, k as u64).unwrap();
    }
    for k in 0..=N {
        unsafe { cmr.write(k * SIZE, &pattern(k as u64, SIZE)) }.unwrap();
        let flags = if k == N {
            SendFlags::SIGNALED
        } else {
            SendFlags(0)
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match c.post_send(&cmr, k * SIZE, SIZE, k as u64, flags) {
                Ok(()) => break,
                Err(Error::QueueFull(_)) => {
                    assert!(
                        Instant::now() < deadline,
                        "depth {depth}, send {k}: the send queue stayed full of finished unsignaled sends"
                    );
                    // Reaps finished sends; an unsignaled success is never reported.
                    assert!(ccq.poll().is_none(), "a record for an unsignaled send");
                    std::thread::sleep(Duration::from_micros(100));
                }
                Err(e) => panic!("send {k}: {e}"),
            }
        }
    }
    let done = next(&ccq);
    assert_eq!(
        (done.opcode, done.status, done.wr_id),
        (Opcode::Send, WcStatus::Success, N as u64)
    );
    for k in 0..=N {
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.byte_len as usize),
            (Opcode::Recv, WcStatus::Success, k as u64, SIZE),
            "message {k}"
        );
        let mut got = vec![0u8; SIZE];
        unsafe { smr.read(k * SIZE, &mut got) }.unwrap();
        assert_eq!(got, pattern(k as u64, SIZE), "message {k}");
    }
    assert!(ccq.poll().is_none());
    drop((c, s));
}

/// In both progress modes, four threads post sends on one connection at once (each polling the
/// sender's queue, shared by all four, whenever the send queue is full), and three threads poll
/// the receiver's queue and repost receives on the other connection at once: every message
/// arrives exactly once, intact, each sender's in its posting order, and every send completes
/// exactly once.
pub fn threads_posting_on_one_connection_deliver_each_message_once(net: &Net) {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    const SENDERS: u64 = 4;
    const PER: u64 = 600;
    const TOTAL: u64 = SENDERS * PER;
    const SLOTS: usize = 64;
    for progress in [Progress::Caller, Progress::Thread] {
        let ctx = Context::new().unwrap();
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let opts = ConnOptions {
            recv_queue_depth: SLOTS as u32,
            send_queue_depth: 32,
            ..Default::default()
        };
        let (c, ccq, s, scq) = pair_with(net, &ctx, &opts, &opts, cq_opts);
        let mr = ctx.alloc_mr(SLOTS * 16, Access::LOCAL_WRITE).unwrap();
        for i in 0..SLOTS {
            s.post_recv(&mr, i * 16, 16, i as u64).unwrap();
        }
        let seen = Mutex::new(vec![0u32; TOTAL as usize]);
        let sent = Mutex::new(vec![0u32; TOTAL as usize]);
        let (received, completed) = (AtomicU64::new(0), AtomicU64::new(0));
        let deadline = Instant::now() + Duration::from_secs(120);
        // A send completion taken by any of the senders.
        let take_send = |r: rdmabridge::Completion| {
            assert_eq!(
                (r.opcode, r.status),
                (Opcode::Send, WcStatus::Success),
                "{progress:?}"
            );
            sent.lock().unwrap()[r.wr_id as usize] += 1;
            completed.fetch_add(1, SeqCst);
        };
        std::thread::scope(|t| {
            for _ in 0..3 {
                let (s, scq, mr, seen, received) = (&s, &scq, &mr, &seen, &received);
                t.spawn(move || {
                    let mut last = [None::<u64>; SENDERS as usize];
                    while received.load(SeqCst) < TOTAL {
                        assert!(Instant::now() < deadline, "{progress:?}: receivers stalled");
                        let Some(r) = scq.poll() else {
                            scq.wait(Some(Duration::from_millis(20))).unwrap();
                            continue;
                        };
                        assert_eq!(
                            (r.opcode, r.status, r.byte_len),
                            (Opcode::Recv, WcStatus::Success, 16),
                            "{progress:?}"
                        );
                        let slot = r.wr_id as usize;
                        let mut b = [0u8; 16];
                        unsafe { mr.read(slot * 16, &mut b) }.unwrap();
                        let who = u64::from_le_bytes(b[..8].try_into().unwrap());
                        let k = u64::from_le_bytes(b[8..].try_into().unwrap());
                        assert!(who < SENDERS && k < PER, "{progress:?}: garbled {b:?}");
                        // This thread's share of each sender's messages is in posting order.
                        let l = &mut last[who as usize];
                        assert!(l.is_none_or(|l| l < k), "{progress:?}: {k} after {l:?}");
                        *l = Some(k);
                        seen.lock().unwrap()[(who * PER + k) as usize] += 1;
                        // Repost before counting, so no sender waits on a receive that the
                        // end of the test would leave unposted.
                        s.post_recv(mr, slot * 16, 16, slot as u64).unwrap();
                        received.fetch_add(1, SeqCst);
                    }
                });
            }
            for who in 0..SENDERS {
                let (c, ccq, take_send, completed) = (&c, &ccq, &take_send, &completed);
                t.spawn(move || {
                    for k in 0..PER {
                        let mut msg = [0u8; 16];
                        msg[..8].copy_from_slice(&who.to_le_bytes());
                        msg[8..].copy_from_slice(&k.to_le_bytes());
                        loop {
                            assert!(Instant::now() < deadline, "{progress:?}: senders stalled");
                            match c.post_send_inline(&msg, who * PER + k, SendFlags::SIGNALED) {
                                Ok(()) => break,
                                Err(Error::QueueFull(_)) => match ccq.poll() {
                                    Some(r) => take_send(r),
                                    None => std::thread::yield_now(),
                                },
                                Err(e) => panic!("{progress:?}: post_send: {e}"),
                            }
                        }
                    }
                    while completed.load(SeqCst) < TOTAL {
                        assert!(Instant::now() < deadline, "{progress:?}: sends stalled");
                        match ccq.poll() {
                            Some(r) => take_send(r),
                            None => {
                                ccq.wait(Some(Duration::from_millis(20))).unwrap();
                            }
                        }
                    }
                });
            }
        });
        assert!(
            seen.lock().unwrap().iter().all(|&n| n == 1),
            "{progress:?}: a message was lost or delivered twice"
        );
        assert!(
            sent.lock().unwrap().iter().all(|&n| n == 1),
            "{progress:?}: a send completion was lost or taken twice"
        );
        assert_eq!((scq.poll(), ccq.poll()), (None, None));
    }
}

/// In both progress modes, one thread sleeps in `wait` and another on the queue's descriptor,
/// with two receives posted, while the main thread destroys - the waiters' connection, its
/// peer, or everything the main thread holds (connection, context and its handle of the
/// queue): both waiters return within 10 s (well before their 30 s timeouts, which they would
/// reach if nothing woke them), the queue then holds the flushed receives and the
/// disconnect record, last, and the destroyed connection has let go of the queue.
pub fn destroying_a_connection_wakes_threads_waiting_on_its_queue(net: &Net) {
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Destroy {
        Own,
        Peer,
        Everything,
    }
    for progress in [Progress::Caller, Progress::Thread] {
        for what in [Destroy::Own, Destroy::Peer, Destroy::Everything] {
            let case = format!("{progress:?}, {what:?}");
            let ctx = Context::new().unwrap();
            let cq_opts = CqOptions {
                progress,
                ..Default::default()
            };
            let copts = ConnOptions::default();
            let (c, ccq, s, scq) = pair_with(net, &ctx, &copts, &copts, cq_opts);
            let mr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
            s.post_recv(&mr, 0, 8, 1).unwrap();
            s.post_recv(&mr, 8, 8, 2).unwrap();
            let fd = scq.fd();
            let waiters_q = scq.clone();
            let (mut c, mut s, mut ctx, mut scq) = (Some(c), Some(s), Some(ctx), Some(scq));
            std::thread::scope(|t| {
                let q = &waiters_q;
                let waiter = t.spawn(move || {
                    let t0 = Instant::now();
                    let r = q.wait(Some(Duration::from_secs(30)));
                    (r.map_err(|e| e.to_string()), t0.elapsed())
                });
                let fd_waiter = t.spawn(move || {
                    let t0 = Instant::now();
                    (
                        fd_readable_within(fd, Duration::from_secs(30)),
                        t0.elapsed(),
                    )
                });
                // Let both fall asleep.
                std::thread::sleep(Duration::from_millis(200));
                assert!(!waiter.is_finished() && !fd_waiter.is_finished(), "{case}");
                match what {
                    Destroy::Own => drop(s.take()),
                    Destroy::Peer => drop(c.take()),
                    Destroy::Everything => {
                        drop(s.take());
                        drop(ctx.take());
                        drop(scq.take());
                    }
                }
                let (r, took) = waiter.join().unwrap();
                assert_eq!(r, Ok(true), "{case}: wait");
                assert!(took < Duration::from_secs(10), "{case}: wait took {took:?}");
                let (readable, took) = fd_waiter.join().unwrap();
                assert!(readable, "{case}: descriptor");
                assert!(took < Duration::from_secs(10), "{case}: poll took {took:?}");
            });
            let mut seen = Vec::new();
            loop {
                let e = next(&waiters_q);
                seen.push((e.opcode, e.status, e.wr_id));
                if e.opcode == Opcode::Disconnected {
                    break;
                }
            }
            seen.sort_by_key(|x| x.2);
            assert_eq!(seen.len(), 3, "{case}: {seen:?}");
            assert_eq!(seen[0].0, Opcode::Disconnected, "{case}");
            assert_eq!(
                &seen[1..],
                &[
                    (Opcode::Recv, WcStatus::Flushed, 1),
                    (Opcode::Recv, WcStatus::Flushed, 2)
                ],
                "{case}"
            );
            assert_eq!(
                waiters_q.poll(),
                None,
                "{case}: nothing after the disconnect"
            );
            // The waiters' side goes too; then nothing but this handle holds the queue.
            drop(s.take());
            drop(scq.take());
            let deadline = Instant::now() + Duration::from_secs(5);
            while std::sync::Arc::strong_count(&waiters_q) > 1 {
                assert!(
                    Instant::now() < deadline,
                    "{case}: the queue is still held {} times",
                    std::sync::Arc::strong_count(&waiters_q) - 1
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            drop((c, ccq));
        }
    }
}

/// The same through the C surface, which allows destroying a connection while another thread
/// waits on its queue (only the queue itself must not be destroyed under a waiter): a thread
/// in `rbr_cq_wait` (30 s) with two receives posted returns RBR_OK within 10 s of
/// `rbr_conn_destroy`, and finds the flushed receives and RBR_OP_DISCONNECTED, last.
pub fn c_destroying_a_connection_wakes_a_thread_in_rbr_cq_wait(net: &Net) {
    use rdmabridge::ffi::conn::*;
    use rdmabridge::ffi::cq::*;
    use rdmabridge::ffi::ctx::*;
    use rdmabridge::ffi::error::*;
    use rdmabridge::ffi::listener::*;
    use rdmabridge::ffi::mr::*;
    use std::ptr::null_mut;
    // SAFETY: every pointer is a live handle from the calls below or a live local; each
    // handle is destroyed once, when no other call on it is under way (the waiter only
    // uses the queue, which outlives it).
    unsafe {
        let mut ctx = null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let (mut scq, mut ccq) = (null_mut(), null_mut());
        assert_eq!(rbr_cq_create(&mut scq), RBR_OK);
        assert_eq!(rbr_cq_create(&mut ccq), RBR_OK);
        let addr = std::ffi::CString::new(net.addr("c-destroy")).unwrap();
        let mut l = null_mut();
        assert_eq!(rbr_listen(ctx, addr.as_ptr(), 4, &mut l), RBR_OK);
        let mut opts = std::mem::zeroed();
        rbr_conn_options_init(&mut opts);
        let (l_u, scq_u, opts_u) = (l as usize, scq as usize, &raw const opts as usize);
        let server = std::thread::spawn(move || {
            let mut r = null_mut();
            assert_eq!(
                rbr_listener_get_request(l_u as *mut _, 10_000, &mut r),
                RBR_OK
            );
            let mut conn = null_mut();
            assert_eq!(
                rbr_request_accept(r, scq_u as *mut _, opts_u as *const _, &mut conn),
                RBR_OK
            );
            rbr_request_destroy(r);
            conn as usize
        });
        let mut client = null_mut();
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), ccq, &opts, &mut client),
            RBR_OK
        );
        let server = server.join().unwrap() as *mut rbr_conn;
        let mut mr = null_mut();
        assert_eq!(
            rbr_mr_alloc(ctx, 64, RBR_ACCESS_LOCAL_WRITE, &mut mr),
            RBR_OK
        );
        assert_eq!(rbr_conn_post_recv(server, mr, 0, 8, 1), RBR_OK);
        assert_eq!(rbr_conn_post_recv(server, mr, 8, 8, 2), RBR_OK);
        let waiter = std::thread::spawn(move || {
            let t0 = Instant::now();
            (rbr_cq_wait(scq_u as *mut _, 30_000), t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(!waiter.is_finished(), "the waiter sleeps");
        rbr_conn_destroy(server);
        let (st, took) = waiter.join().unwrap();
        assert_eq!(st, RBR_OK, "rbr_cq_wait");
        assert!(took < Duration::from_secs(10), "rbr_cq_wait took {took:?}");
        let mut seen = Vec::new();
        while seen
            .last()
            .is_none_or(|&(op, _, _)| op != RBR_OP_DISCONNECTED)
        {
            let mut c = std::mem::zeroed::<rbr_completion>();
            let mut n = 0;
            match rbr_cq_poll(scq, &mut c, 1, &mut n) {
                RBR_OK => seen.push((c.opcode, c.status, c.wr_id)),
                st => {
                    assert_eq!(st, RBR_EMPTY);
                    assert_eq!(rbr_cq_wait(scq, 10_000), RBR_OK, "records after {seen:?}");
                }
            }
        }
        assert_eq!(
            seen,
            [
                (RBR_OP_RECV, RBR_WC_FLUSHED, 1),
                (RBR_OP_RECV, RBR_WC_FLUSHED, 2),
                (RBR_OP_DISCONNECTED, RBR_WC_SUCCESS, 0)
            ]
        );
        rbr_conn_destroy(client);
        rbr_mr_destroy(mr);
        rbr_listener_destroy(l);
        rbr_cq_destroy(scq);
        rbr_cq_destroy(ccq);
        rbr_ctx_destroy(ctx);
    }
}
