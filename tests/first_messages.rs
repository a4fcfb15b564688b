//! Messages sent before the peer has a receive for them - the first ones after a connect, and
//! one that waits while the peer is busy elsewhere - over shm. The message waits in the ring,
//! and the post of the receive takes it on the spot: the receive's completion is there for the
//! poster's very next poll, with no wake-up of the sender, of either side's library thread, or
//! a timer in between (before, the sender's library thread had to be woken to send it, and the
//! receiver's poll found nothing at first). Behaviour, not speed: nothing here is timed but
//! the 10 s ceiling on a completion that must come.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use rdmabridge::{
    Access, CompletionQueue, ConnOptions, Context, CqOptions, Opcode, Progress, SendFlags, WcStatus,
};

/// The receive `wr_id` completed with `len` bytes, found by one poll of `cq` (no wait).
fn taken_at_once(cq: &CompletionQueue, wr_id: u64, len: u32, what: &str) {
    let c = cq
        .poll()
        .unwrap_or_else(|| panic!("{what}: the receive's post did not take the waiting message"));
    assert_eq!(
        (c.opcode, c.status, c.wr_id, c.byte_len),
        (Opcode::Recv, WcStatus::Success, wr_id, len),
        "{what}"
    );
}

/// The address [`frozen_sender_child`] connects to.
const SENDER_ADDR: &str = "RBR_TEST_FROZEN_SENDER_ADDR";
/// What the sending process says once its message is posted.
const POSTED: &str = "frozen-sender: posted";

/// The sending process of [`a_frozen_sender_s_message_is_taken_by_the_receive_post`] (this
/// test program run again, with [`SENDER_ADDR`] set): connects, posts one message while the
/// server has no receive, says so, and waits for the send's completion.
#[test]
#[ignore = "the sending process of a_frozen_sender_s_message_is_taken_by_the_receive_post"]
fn frozen_sender_child() {
    let addr = std::env::var_os(SENDER_ADDR).expect("run by its parent test");
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let c = ctx
        .connect(addr.to_str().unwrap(), &cq, &ConnOptions::default())
        .unwrap();
    c.post_send_inline(b"from a frozen process", 7, SendFlags::SIGNALED)
        .unwrap();
    println!("{POSTED}");
    let sc = next(&cq);
    assert_eq!(
        (sc.opcode, sc.status, sc.wr_id),
        (Opcode::Send, WcStatus::Success, 7)
    );
}

/// Kills the child when dropped (a failed test must not leave it stopped).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A message that waits for its receive needs nothing of its sender's process: the sender
/// posts it while the server has no receive, and its process is then stopped (SIGSTOP) - its
/// threads, the library's included, cannot run. The receive the server posts takes the
/// message at once; once the sender runs again, its send completes.
#[test]
fn a_frozen_sender_s_message_is_taken_by_the_receive_post() {
    let ctx = Context::new().unwrap();
    let addr = unique_addr("frozen");
    let l = ctx.listen(&addr, 4).unwrap();
    let mut child = Reaped(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "frozen_sender_child", "--ignored", "--nocapture"])
            .env(SENDER_ADDR, &addr)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let scq = CompletionQueue::new().unwrap();
    let s = l
        .get_request(Some(Duration::from_secs(10)))
        .unwrap()
        .accept(&scq, &ConnOptions::default())
        .unwrap();
    let out = BufReader::new(child.0.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines() {
            let Ok(line) = line else { break };
            if line.contains(POSTED) {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the sender posts its message within 10 s");
    let pid = child.0.id() as libc::pid_t;
    // SAFETY: a signal to our own child, which has not been reaped (it is still ours).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // Stopped for sure before the receive is posted: its state says so.
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|st| st.rsplit(") ").next().is_some_and(|f| f.starts_with('T')))
    };
    for _ in 0..1000 {
        if stopped() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(stopped(), "the sender's process did not stop");
    assert!(scq.poll().is_none(), "a message without a receive");
    let mr = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    s.post_recv(&mr, 0, 64, 1).unwrap();
    let msg = b"from a frozen process";
    taken_at_once(&scq, 1, msg.len() as u32, "frozen sender");
    let mut got = vec![0u8; msg.len()];
    // SAFETY: the receive into these bytes has completed; no other is posted there.
    unsafe { mr.read(0, &mut got) }.unwrap();
    assert_eq!(got, msg);
    // SAFETY: as for SIGSTOP.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let status = child.0.wait().unwrap();
    assert!(
        status.success(),
        "the sender's send did not complete: {status}"
    );
}

/// The first messages of a connection, sent right after the connect while the server has
/// posted no receive yet (two contexts: as two processes, each with its own library thread),
/// in both progress modes: each receive the server then posts, one at a time, takes the next
/// message at once, in order; every send completes.
#[test]
fn first_messages_are_taken_by_the_posts_of_their_receives() {
    for progress in [Progress::Caller, Progress::Thread] {
        let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let opts = ConnOptions::default();
        let (c, ccq, s, scq) = pair_between(&Net::Shm, &cctx, &sctx, &opts, &opts, cq_opts);
        let mr = sctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        let msgs: [&[u8]; 3] = [b"first", b"second message", b"3"];
        for (i, m) in msgs.iter().enumerate() {
            c.post_send_inline(m, i as u64, SendFlags::SIGNALED)
                .unwrap();
        }
        // The client leaves the library alone; the messages wait for receives.
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            scq.poll().is_none(),
            "{progress:?}: a message without a receive"
        );
        for (i, m) in msgs.iter().enumerate() {
            let at = 1024 * i;
            s.post_recv(&mr, at, 1024, 10 + i as u64).unwrap();
            taken_at_once(
                &scq,
                10 + i as u64,
                m.len() as u32,
                &format!("{progress:?} #{i}"),
            );
            let mut got = vec![0u8; m.len()];
            // SAFETY: the receive into these bytes has completed; no other is posted there.
            unsafe { mr.read(at, &mut got) }.unwrap();
            assert_eq!(&got, m, "{progress:?} #{i}");
        }
        for i in 0..msgs.len() as u64 {
            let sc = next(&ccq);
            assert_eq!(
                (sc.opcode, sc.status, sc.wr_id),
                (Opcode::Send, WcStatus::Success, i),
                "{progress:?}"
            );
        }
        assert!(scq.poll().is_none() && ccq.poll().is_none(), "{progress:?}");
    }
}

/// A warm connection (100 ping-pongs), then one more message while the server is away for
/// 50 ms with no receive posted, the client asleep in `poll_wait` for its send's completion
/// meanwhile: the server's receive takes the message as it is posted, the client's send
/// completes, and the connection carries on both ways. For a small inline message, one of
/// 64 KiB from a region the library allocated (the receiver copies it out of the sender's
/// region), and one of 200 KiB from the caller's memory (written into the ring in pieces) over
/// rings that hold it. Over the default rings, which hold only a piece of that one, the post
/// takes the first and the rest follows as the sleeping sender wakes to write it.
#[test]
fn a_message_that_waited_for_its_receive_is_taken_by_the_post() {
    const BIG: usize = 200 << 10;
    for (len, kind, ring) in [
        (64, "inline", 0),
        (64 << 10, "region", 0),
        (BIG, "caller memory", 512 << 10),
        (BIG, "caller memory, default ring", 0),
    ] {
        let what = format!("{len} B, {kind}");
        let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
        let opts = ConnOptions {
            shm_ring_size: ring,
            ..Default::default()
        };
        let (c, ccq, s, scq) =
            pair_between(&Net::Shm, &cctx, &sctx, &opts, &opts, CqOptions::default());
        let cmr = cctx.alloc_mr(2 * BIG, Access::LOCAL_WRITE).unwrap();
        let smr = sctx.alloc_mr(BIG, Access::LOCAL_WRITE).unwrap();
        for i in 0..100u64 {
            s.post_recv(&smr, 0, 64, i).unwrap();
            c.post_recv(&cmr, BIG, 64, i).unwrap();
            c.post_send_inline(&[i as u8; 64], i, SendFlags::default())
                .unwrap();
            assert_eq!(next(&scq).wr_id, i, "{what}");
            s.post_send_inline(&[i as u8; 64], i, SendFlags::default())
                .unwrap();
            assert_eq!(next(&ccq).wr_id, i, "{what}");
        }
        let data = pattern(len as u64, len);
        let mut owned = data.clone();
        // SAFETY: `owned` is neither moved nor touched until the region is dropped, after the
        // send's completion (below).
        let caller_mr =
            unsafe { cctx.register_mr(owned.as_mut_ptr(), owned.len(), Access::LOCAL_WRITE) }
                .unwrap();
        match kind {
            "inline" => c.post_send_inline(&data, 1000, SendFlags::SIGNALED),
            "region" => {
                // SAFETY: no work request uses these bytes of the region yet.
                unsafe { cmr.write(0, &data) }.unwrap();
                c.post_send(&cmr, 0, len, 1000, SendFlags::SIGNALED)
            }
            _ => c.post_send(&caller_mr, 0, len, 1000, SendFlags::SIGNALED),
        }
        .unwrap();
        std::thread::scope(|sc| {
            let sleeper = sc.spawn(|| {
                let mut got = Vec::new();
                ccq.poll_wait_with(1, Some(Duration::from_secs(10)), &mut |c| got.push(c))
                    .unwrap();
                got
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(scq.poll().is_none(), "{what}: a message without a receive");
            s.post_recv(&smr, 0, BIG, 2000).unwrap();
            if (len as u32) < s.info().shm_ring_size {
                taken_at_once(&scq, 2000, len as u32, &what);
            } else {
                let r = next(&scq);
                assert_eq!(
                    (r.opcode, r.status, r.wr_id, r.byte_len),
                    (Opcode::Recv, WcStatus::Success, 2000, len as u32),
                    "{what}"
                );
            }
            let got = sleeper.join().unwrap();
            assert_eq!(
                got.len(),
                1,
                "{what}: the send did not complete within 10 s"
            );
            assert_eq!(
                (got[0].opcode, got[0].status, got[0].wr_id),
                (Opcode::Send, WcStatus::Success, 1000),
                "{what}"
            );
        });
        drop(caller_mr);
        let mut back = vec![0u8; len];
        // SAFETY: the receive into these bytes has completed; no other is posted there.
        unsafe { smr.read(0, &mut back) }.unwrap();
        assert!(back == data, "{what}: the message differs");
        // Still connected, both ways.
        c.post_recv(&cmr, BIG, 64, 3000).unwrap();
        s.post_send_inline(b"on", 3001, SendFlags::SIGNALED)
            .unwrap();
        let r = next(&ccq);
        assert_eq!(
            (r.wr_id, r.status, r.byte_len),
            (3000, WcStatus::Success, 2)
        );
        assert_eq!(next(&scq).wr_id, 3001, "{what}");
        assert!(scq.poll().is_none() && ccq.poll().is_none(), "{what}");
    }
}
