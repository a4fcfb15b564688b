//! Integration tests of the shared-memory transport: the common suite, and what only shm has.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use rdmabridge::{CompletionQueue, ConnOptions, Context, Error};

const ECHO: &str = env!("CARGO_BIN_EXE_rbr-echo");

macro_rules! suite_over_shm {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            common::suite::$name(&Net::Shm);
        }
    )*};
}

common::for_each_suite_test!(suite_over_shm);

/// A peer running as another user is turned away (peer credentials), and the listener keeps
/// serving. Needs root to run the peer as `nobody`; the project's test command runs as root.
#[test]
fn peer_of_another_user_is_refused() {
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test runs as root (see README)"
    );
    let ctx = Context::new().unwrap();
    let addr = unique_addr("uid");
    let l = ctx.listen(&addr, 4).unwrap();
    let out = std::thread::scope(|s| {
        let h = s.spawn(|| {
            Command::new(ECHO)
                .args(["client", &addr, "1", "1"])
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        });
        // The foreign peer never becomes a request.
        assert!(matches!(
            l.get_request(Some(Duration::from_secs(3))),
            Err(Error::Timeout(_))
        ));
        h.join().unwrap()
    });
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("permission denied"), "{err}");
}

/// Connects a raw seqpacket socket to a listener's abstract address and sends `msg`; returns
/// the reply (if one came within 10 s: the listener closes the socket of what it does not
/// answer, which ends the wait at once).
fn raw_hello(addr: &str, msg: &[u8]) -> Option<Vec<u8>> {
    use std::os::fd::AsRawFd;
    let sock = raw_shm_peer(addr);
    let fd = sock.as_raw_fd();
    // SAFETY: plain libc socket calls on our socket; every buffer is live and sized.
    unsafe {
        libc::send(fd, msg.as_ptr().cast(), msg.len(), 0);
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut reply = None;
        if libc::poll(&mut p, 1, 10_000) == 1 {
            let mut buf = [0u8; 256];
            let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
            if n > 0 {
                reply = Some(buf[..n as usize].to_vec());
            }
        }
        reply
    }
}

/// Garbage and a future protocol version are turned away; the listener keeps serving.
#[test]
fn listener_survives_garbage_and_refuses_other_versions() {
    let ctx = Context::new().unwrap();
    let addr = unique_addr("hostile");
    let l = ctx.listen(&addr, 8).unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
            assert_eq!(req.private_data(), b"real");
            req.accept(&CompletionQueue::new().unwrap(), &ConnOptions::default())
                .unwrap()
        });
        assert_eq!(
            raw_hello(&addr, b"GET / HTTP/1.0"),
            None,
            "garbage gets no answer"
        );
        let mut v9 = Vec::new();
        v9.extend_from_slice(&0x3152_4252u32.to_le_bytes());
        v9.extend_from_slice(&9u16.to_le_bytes()); // version 9
        v9.extend_from_slice(&1u16.to_le_bytes()); // hello
        v9.extend_from_slice(&[0; 10]);
        let reply = raw_hello(&addr, &v9).expect("a version mismatch is answered");
        assert_eq!(
            u16::from_le_bytes([reply[6], reply[7]]),
            4,
            "reply kind: version mismatch"
        );
        assert_eq!(
            u32::from_le_bytes(reply[8..12].try_into().unwrap()),
            5,
            "names our version"
        );
        let cq = CompletionQueue::new().unwrap();
        let opts = ConnOptions {
            private_data: b"real".to_vec(),
            ..Default::default()
        };
        let c = ctx.connect(&addr, &cq, &opts).unwrap();
        drop(h.join().unwrap());
        drop(c);
    });
}

/// A listener that goes away before answering fails the connect with a connection error that
/// says so (not an OS error), at once rather than at the timeout.
#[test]
fn listener_gone_before_answering_fails_the_connect_at_once() {
    // A timeout far beyond the bound below, so that waiting for it cannot pass.
    const TIMEOUT: Duration = Duration::from_secs(60);
    let ctx = Context::new().unwrap();
    let addr = unique_addr("gone");
    let l = ctx.listen(&addr, 4).unwrap();
    let t = std::time::Instant::now();
    let r = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let cq = CompletionQueue::new().unwrap();
            let opts = ConnOptions {
                timeout: Some(TIMEOUT),
                ..Default::default()
            };
            ctx.connect(&addr, &cq, &opts)
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(l);
        h.join().unwrap()
    });
    match r {
        Err(Error::ConnectFailed(m)) => assert!(m.contains("closed the connection"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// Whether `fd` is readable within `ms`.
fn readable(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, ms) == 1 }
}

/// In an event loop, clients that connect and say nothing are dropped when their 2 s are up,
/// not before: the listener's descriptor turns readable then, and the next call drops them.
#[test]
fn event_loop_drops_silent_peers_when_their_time_is_up() {
    use std::os::fd::AsRawFd;
    let ctx = Context::new().unwrap();
    let addr = unique_addr("silent-drop");
    let l = ctx.listen(&addr, 16).unwrap();
    let peers: Vec<_> = (0..3).map(|_| raw_shm_peer(&addr)).collect();
    assert!(readable(l.fd(), 10_000));
    // Their 2 s start no earlier than this call, which takes them in.
    let taken = std::time::Instant::now();
    assert!(l.try_get_request().unwrap().is_none());
    assert!(
        !readable(l.fd(), 0),
        "silent peers keep the descriptor readable"
    );
    // The ceiling only has to catch a timer that never fires: generous for a loaded machine.
    assert!(
        readable(l.fd(), 20_000),
        "not readable within 20 s: the silent peers' time never came"
    );
    let waited = taken.elapsed();
    assert!(
        waited >= Duration::from_secs(2),
        "readable {waited:?} after the peers were taken in, before their 2 s were up"
    );
    // The three peers connected one after another: on a loaded machine their times may end a
    // little apart, so the next calls drop the later ones (at most one call per peer).
    let mut calls = 0;
    while calls < peers.len() && (calls == 0 || readable(l.fd(), 0)) {
        assert!(l.try_get_request().unwrap().is_none());
        calls += 1;
    }
    assert!(
        !readable(l.fd(), 0),
        "readable after the overdue peers were dropped"
    );
    for p in &peers {
        let mut b = [0u8; 8];
        // SAFETY: receives into a live local buffer; the socket is ours.
        let n = unsafe { libc::recv(p.as_raw_fd(), b.as_mut_ptr().cast(), 8, libc::MSG_DONTWAIT) };
        assert_eq!(n, 0, "a dropped peer sees its connection closed");
    }
}

/// More silent clients than the listener keeps pending (1,024) do not keep its descriptor
/// readable (an event loop would spin), and a real client still gets through once room is made.
#[test]
fn a_flood_of_silent_peers_does_not_make_the_loop_spin() {
    // SAFETY: reads and raises this process's own descriptor limit (soft up to hard).
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        if r.rlim_cur < 4096 {
            r.rlim_cur = r.rlim_max.min(8192);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
        }
    }
    let ctx = Context::new().unwrap();
    let addr = unique_addr("flood");
    let l = ctx.listen(&addr, 4096).unwrap();
    let peers: Vec<_> = (0..1100).map(|_| raw_shm_peer(&addr)).collect();
    assert!(readable(l.fd(), 1000));
    assert!(l.try_get_request().unwrap().is_none());
    assert!(
        !readable(l.fd(), 0),
        "1,100 silent peers keep the descriptor readable"
    );
    // When their time is up the pending ones are dropped, the rest are taken in and dropped in
    // turn, and a real client is served.
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let cq = CompletionQueue::new().unwrap();
            let opts = ConnOptions {
                timeout: Some(Duration::from_secs(20)),
                ..Default::default()
            };
            ctx.connect(&addr, &cq, &opts).map(drop)
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let mut wakeups = 0;
        let req = loop {
            assert!(
                std::time::Instant::now() < deadline,
                "the real client was not served"
            );
            if !readable(l.fd(), 100) {
                continue;
            }
            wakeups += 1;
            if let Some(r) = l.try_get_request().unwrap() {
                break r;
            }
        };
        assert!(wakeups < 100, "{wakeups} wake-ups: the loop spun");
        let conn = req
            .accept(&CompletionQueue::new().unwrap(), &ConnOptions::default())
            .unwrap();
        h.join().unwrap().unwrap();
        drop(conn);
    });
    drop(peers);
}

/// A receive posted while the sender's side sleeps with a send waiting for it (no receive to
/// go to) wakes that side at once, though the receiving side neither polls nor waits
/// afterwards, in both progress modes: the post rings a peer it sees asleep. The send completes
/// within 250 ms of the post in most rounds (the median of 8 is held to it, so that a round or
/// three that a loaded machine schedules late do not fail the test); without the ring every
/// round would wait for a side's library thread to look again on its own (every 500 ms when
/// nothing happens: about 400 ms in a build whose posts never ring). The sender sleeps on its
/// queue's descriptor, as an event loop would, and each side has a context of its own, as two
/// processes would.
#[test]
fn a_receive_posted_late_wakes_the_sleeping_sender_at_once() {
    use rdmabridge::{Access, CqOptions, Opcode, Progress, SendFlags, WcStatus};
    use std::sync::mpsc;
    use std::time::Instant;
    const BOUND: Duration = Duration::from_millis(250);
    for progress in [Progress::Caller, Progress::Thread] {
        // Each side in a context of its own, as in two processes: one library thread each.
        let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
        let opts = ConnOptions::default();
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let (c, ccq, s, scq) = pair_between(&Net::Shm, &cctx, &sctx, &opts, &opts, cq_opts);
        let fd = ccq.fd();
        let rmr = sctx.alloc_mr(64 * 8, Access::LOCAL_WRITE).unwrap();
        let mut took = Vec::new();
        for round in 0..8u64 {
            c.post_send_inline(&round.to_le_bytes(), round, SendFlags::SIGNALED)
                .unwrap();
            let (tx, rx) = mpsc::channel();
            std::thread::scope(|sc| {
                sc.spawn(|| {
                    // Long enough for the sender's side to be asleep.
                    std::thread::sleep(Duration::from_millis(100));
                    let posted = Instant::now();
                    s.post_recv(&rmr, round as usize * 64, 64, round).unwrap();
                    tx.send(posted).unwrap();
                });
                assert!(
                    readable(fd, 10_000),
                    "{progress:?} round {round}: no send completion within 10 s"
                );
            });
            took.push(rx.recv().unwrap().elapsed());
            let sc = ccq.poll().expect("the completion the descriptor announced");
            assert_eq!(
                (sc.opcode, sc.status, sc.wr_id),
                (Opcode::Send, WcStatus::Success, round)
            );
        }
        let mut sorted = took.clone();
        sorted.sort();
        assert!(
            sorted[sorted.len() / 2] < BOUND,
            "{progress:?}: the sends completed {took:?} after their receives were posted \
             (the median is held to {BOUND:?})"
        );
        // The messages are all there, in order.
        for round in 0..8u64 {
            let r = next(&scq);
            assert_eq!(
                (r.opcode, r.status, r.wr_id, r.byte_len),
                (Opcode::Recv, WcStatus::Success, round, 8)
            );
            let mut b = [0u8; 8];
            unsafe { rmr.read(round as usize * 64, &mut b) }.unwrap();
            assert_eq!(u64::from_le_bytes(b), round);
        }
    }
}

/// A receiver that only busy-polls gets every message over many connections, across idle
/// gaps long enough for its connections to go back to waiting on the queue's notice board
/// and to be woken by a mark again, in order per connection. (The connections' own threads do
/// not step in while the queue is polled, so a missed mark would show as a lost message.)
#[test]
fn busy_poller_gets_every_message_across_idle_gaps() {
    use rdmabridge::{Access, Opcode, SendFlags, WcStatus};
    use std::collections::HashMap;
    use std::time::Instant;

    const CONNS: usize = 16;
    const RECVS: usize = 8;
    const MSGS: u64 = 400;
    let ctx = Context::new().unwrap();
    let addr = unique_addr("gaps");
    let l = ctx.listen(&addr, 64).unwrap();
    let ccq = CompletionQueue::new().unwrap();
    let scq = CompletionQueue::new().unwrap();
    let (clients, servers) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            (0..CONNS)
                .map(|_| {
                    l.get_request(Some(Duration::from_secs(10)))
                        .unwrap()
                        .accept(&scq, &ConnOptions::default())
                        .unwrap()
                })
                .collect::<Vec<_>>()
        });
        let c: Vec<_> = (0..CONNS)
            .map(|_| ctx.connect(&addr, &ccq, &ConnOptions::default()).unwrap())
            .collect();
        (c, h.join().unwrap())
    });
    let mr = ctx
        .alloc_mr(CONNS * RECVS * 8, Access::LOCAL_WRITE)
        .unwrap();
    let index: HashMap<u64, usize> = servers
        .iter()
        .enumerate()
        .map(|(i, c)| (c.id(), i))
        .collect();
    for (i, s) in servers.iter().enumerate() {
        for j in 0..RECVS {
            let slot = i * RECVS + j;
            s.post_recv(&mr, slot * 8, 8, slot as u64).unwrap();
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            for k in 0..MSGS {
                // Gaps of 0 to 300 us: long enough, at the longer ones, for the receiving
                // connections to settle back onto the board.
                std::thread::sleep(Duration::from_micros(k % 4 * 100));
                let c = &clients[(k as usize * 7) % CONNS];
                c.post_send_inline(&k.to_le_bytes(), k, SendFlags::default())
                    .unwrap();
                while let Some(wc) = ccq.poll() {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                }
            }
        });
        let mut last = [None::<u64>; CONNS];
        let mut got = 0;
        let mut since = Instant::now();
        while got < MSGS {
            let Some(wc) = scq.poll() else {
                assert!(
                    since.elapsed() < Duration::from_secs(5),
                    "message {got} not seen within 5 s of busy polling"
                );
                continue;
            };
            since = Instant::now();
            assert_eq!((wc.opcode, wc.status), (Opcode::Recv, WcStatus::Success));
            let conn = index[&wc.conn_id];
            let slot = wc.wr_id as usize;
            let mut b = [0u8; 8];
            unsafe { mr.read(slot * 8, &mut b) }.unwrap();
            let k = u64::from_le_bytes(b);
            assert_eq!(
                (k as usize * 7) % CONNS,
                conn,
                "message {k} on the wrong connection"
            );
            assert!(last[conn].is_none_or(|p| p < k), "message {k} out of order");
            last[conn] = Some(k);
            servers[conn]
                .post_recv(&mr, slot * 8, 8, slot as u64)
                .unwrap();
            got += 1;
        }
    });
}

/// Out of file descriptors, taking a request says so (EMFILE) instead of leaving the client
/// to time out, and once descriptors are free again the same client is served. Runs in a
/// child process, since it lowers the descriptor limit.
#[test]
fn listener_out_of_descriptors_says_so_and_recovers() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "out_of_descriptors_child",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("1 passed"), "{text}");
}

#[test]
#[ignore = "run by listener_out_of_descriptors_says_so_and_recovers in a child process"]
fn out_of_descriptors_child() {
    use std::os::fd::OwnedFd;
    let ctx = Context::new().unwrap();
    let addr = unique_addr("emfile");
    let l = ctx.listen(&addr, 4).unwrap();
    std::thread::scope(|s| {
        let client = s.spawn(|| {
            let cq = CompletionQueue::new().unwrap();
            let opts = ConnOptions {
                timeout: Some(Duration::from_secs(20)),
                ..Default::default()
            };
            // Connected (its socket made) before the descriptors run out.
            ctx.connect(&addr, &cq, &opts).map(|_| ())
        });
        // The client is in the backlog (its hello follows its connect at once), however late
        // a loaded machine ran its thread.
        assert!(readable(l.fd(), 10_000), "the client never connected");
        std::thread::sleep(Duration::from_millis(200));
        // Use up every descriptor the limit allows.
        let mut hog: Vec<OwnedFd> = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            hog.push(f.into());
        }
        let r = l.get_request(Some(Duration::from_secs(1)));
        let e = r.expect_err("accept without a descriptor");
        assert!(
            matches!(e, Error::Accept(ref io) if io.raw_os_error() == Some(libc::EMFILE)),
            "{e}"
        );
        drop(hog);
        let req = l
            .get_request(Some(Duration::from_secs(10)))
            .expect("the client that waited");
        let cq = CompletionQueue::new().unwrap();
        let _conn = req.accept(&cq, &ConnOptions::default()).unwrap();
        client
            .join()
            .unwrap()
            .expect("the client's connect succeeds");
    });
}

/// One-sided operations over shm: a connected pair of one context, and a region of the
/// server's the client targets.
mod onesided {
    use super::*;
    use rdmabridge::{
        Access, Completion, Connection, MemoryRegion, Opcode, SendFlags, Sge, WcStatus,
    };
    use std::sync::Arc;

    const RW: Access = Access(
        Access::LOCAL_WRITE.0
            | Access::REMOTE_WRITE.0
            | Access::REMOTE_READ.0
            | Access::REMOTE_ATOMIC.0,
    );

    fn setup(
        ctx: &Context,
    ) -> (
        Connection,
        Arc<CompletionQueue>,
        Connection,
        Arc<CompletionQueue>,
    ) {
        pair(
            &Net::Shm,
            ctx,
            &ConnOptions::default(),
            &ConnOptions::default(),
        )
    }

    /// Completions of `cq` until (and with) the connection's disconnect record.
    fn until_disconnected(cq: &CompletionQueue) -> Vec<Completion> {
        let mut v = Vec::new();
        loop {
            let c = next(cq);
            v.push(c);
            if c.opcode == Opcode::Disconnected {
                return v;
            }
        }
    }

    /// Two threads write into one region through one connection: one streams unsignaled
    /// 1 MiB writes (the lock-free way, which holds the region's claim for nearly all its
    /// time), the other signaled 4 KiB ones (the locked way, which waits for the claim). Every
    /// write lands and succeeds, and the connection stays up.
    #[test]
    fn threads_writing_one_region_through_one_connection_all_succeed() {
        const N: u64 = 300;
        const MIB: usize = 1 << 20;
        let ctx = Context::new().unwrap();
        let (c, ccq, s, _scq) = setup(&ctx);
        let tmr = ctx.alloc_mr(2 * MIB, RW).unwrap();
        let remote = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
        let big = ctx.alloc_mr(MIB, Access::LOCAL_WRITE).unwrap();
        unsafe { big.write(0, &vec![0x5a; MIB]) }.unwrap();
        let small = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        unsafe { small.write(0, &[0xa5; 4096]) }.unwrap();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let seg = [Sge {
                    mr: &big,
                    offset: 0,
                    len: MIB,
                }];
                for _ in 0..N * 4 {
                    loop {
                        match c.post_write(&seg, &remote, 0, 0, SendFlags(0)) {
                            Ok(()) => break,
                            // The other thread's writes fill the queue until it takes them.
                            Err(Error::QueueFull(_)) => std::thread::yield_now(),
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            });
            let seg = [Sge {
                mr: &small,
                offset: 0,
                len: 4096,
            }];
            for i in 0..N {
                c.post_write(&seg, &remote, MIB as u64, i, SendFlags::SIGNALED)
                    .unwrap();
                let d = next(&ccq);
                assert_eq!(
                    (d.wr_id, d.opcode, d.status),
                    (i, Opcode::Write, WcStatus::Success)
                );
            }
        });
        let mut got = vec![0u8; 2 * MIB];
        unsafe { tmr.read(0, &mut got) }.unwrap();
        assert!(got[..MIB].iter().all(|&b| b == 0x5a));
        assert!(got[MIB..MIB + 4096].iter().all(|&b| b == 0xa5));
        assert!(got[MIB + 4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn caller_memory_with_remote_atomic_is_unsupported_at_pack_time() {
        let ctx = Context::new().unwrap();
        let (_c, _ccq, s, _scq) = setup(&ctx);
        let mut buf = vec![0u64; 64];
        // SAFETY: `buf` outlives the region (dropped at the end of the test, after it).
        let mr = unsafe { ctx.register_mr(buf.as_mut_ptr().cast(), 512, RW).unwrap() };
        let e = s.pack_region(&mr).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("REMOTE_ATOMIC"), "{e}");
        // Without the atomic bit the same memory may be exposed (the peer reaches this
        // process: same user, same process).
        // SAFETY: as above.
        let mr2 = unsafe {
            ctx.register_mr(
                buf.as_mut_ptr().cast(),
                512,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
            .unwrap()
        };
        s.pack_region(&mr2).unwrap();
        drop((mr, mr2));
        drop(buf);
    }

    #[test]
    fn a_write_lands_in_caller_registered_memory() {
        let ctx = Context::new().unwrap();
        let (c, ccq, s, _scq) = setup(&ctx);
        let mut target = vec![0u8; 8192];
        // SAFETY: `target` outlives the region.
        let tmr = unsafe {
            ctx.register_mr(
                target.as_mut_ptr(),
                target.len(),
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap()
        };
        let desc = s.pack_region(&tmr).unwrap();
        let remote = c.unpack_remote(&desc).unwrap();
        let src = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        let data = pattern(3, 4096);
        unsafe { src.write(0, &data) }.unwrap();
        let sgl = [
            Sge {
                mr: &src,
                offset: 0,
                len: 1000,
            },
            Sge {
                mr: &src,
                offset: 1000,
                len: 3096,
            },
        ];
        c.post_write(&sgl, &remote, 100, 7, SendFlags::SIGNALED)
            .unwrap();
        let done = next(&ccq);
        assert_eq!(
            (done.wr_id, done.opcode, done.status),
            (7, Opcode::Write, WcStatus::Success)
        );
        drop(tmr);
        assert_eq!(&target[100..4196], &data[..]);
        assert!(target[..100].iter().all(|&b| b == 0));
        assert!(target[4196..].iter().all(|&b| b == 0));
        drop(c);
        drop(s);
    }

    #[test]
    fn a_region_dropped_by_its_owner_is_no_longer_reachable() {
        // Unsignaled writes into an allocated region take the lock-free way once the first
        // has found the region.
        let cases = [false, true]
            .into_iter()
            .flat_map(|c| [(c, true), (c, false)]);
        for (caller_memory, signaled) in cases {
            let flags = if signaled {
                SendFlags::SIGNALED
            } else {
                SendFlags(0)
            };
            let ctx = Context::new().unwrap();
            let (c, ccq, s, scq) = setup(&ctx);
            let mut backing = vec![0u8; 4096];
            let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
            let tmr = if caller_memory {
                // SAFETY: `backing` outlives the region.
                unsafe { ctx.register_mr(backing.as_mut_ptr(), 4096, access).unwrap() }
            } else {
                ctx.alloc_mr(4096, access).unwrap()
            };
            let remote = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
            let src = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
            unsafe { src.write(0, &[0xab; 64]) }.unwrap();
            let sgl = [Sge {
                mr: &src,
                offset: 0,
                len: 64,
            }];
            for round in 0..3u8 {
                unsafe { src.write(0, &[0xab + round; 64]) }.unwrap();
                c.post_write(&sgl, &remote, 0, 1, flags).unwrap();
                if signaled {
                    assert_eq!(next(&ccq).status, WcStatus::Success);
                }
                let mut got = [0u8; 64];
                unsafe { tmr.read(0, &mut got) }.unwrap();
                assert_eq!(got, [0xab + round; 64], "landed when the post returned");
            }
            if !signaled {
                assert!(ccq.poll().is_none(), "nothing to report");
            }
            drop(tmr);
            if caller_memory {
                backing[..64].fill(0);
            }
            unsafe { src.write(0, &[0xcd; 64]) }.unwrap();
            c.post_write(&sgl, &remote, 0, 2, flags).unwrap();
            let done = next(&ccq);
            assert_eq!(
                (done.wr_id, done.opcode, done.status),
                (2, Opcode::Write, WcStatus::RemoteAccess)
            );
            if caller_memory {
                assert!(backing.iter().all(|&b| b == 0), "untouched");
            }
            // The connection failed: both sides end with their disconnect record.
            let rest = until_disconnected(&ccq);
            assert_eq!(rest.last().unwrap().status, WcStatus::RemoteAccess);
            assert_eq!(until_disconnected(&scq).len(), 1);
            assert!(matches!(
                c.post_write(&sgl, &remote, 0, 3, SendFlags::SIGNALED),
                Err(Error::Disconnected)
            ));
        }
    }

    #[test]
    fn writes_reads_and_atomics_on_an_allocated_region() {
        let ctx = Context::new().unwrap();
        let (c, ccq, s, scq) = setup(&ctx);
        let tmr = ctx.alloc_mr(1 << 20, RW).unwrap();
        let remote = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
        assert_eq!(
            s.pack_region(&tmr).unwrap(),
            s.pack_region(&tmr).unwrap(),
            "the same key again"
        );
        let local = ctx.alloc_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
        let data = pattern(9, 1 << 20);
        unsafe { local.write(0, &data) }.unwrap();
        let all = [Sge {
            mr: &local,
            offset: 0,
            len: 1 << 20,
        }];
        c.post_write(&all, &remote, 0, 1, SendFlags::SIGNALED)
            .unwrap();
        assert_eq!(next(&ccq).opcode, Opcode::Write);
        let mut got = vec![0u8; 1 << 20];
        unsafe { tmr.read(0, &mut got) }.unwrap();
        assert!(got == data);
        // Read it back into the other half of a zeroed region, scattered.
        unsafe { local.write(0, &vec![0u8; 1 << 20]) }.unwrap();
        let halves = [
            Sge {
                mr: &local,
                offset: 512 << 10,
                len: 256 << 10,
            },
            Sge {
                mr: &local,
                offset: 0,
                len: 256 << 10,
            },
        ];
        c.post_read(&halves, &remote, 0, 2, SendFlags::SIGNALED)
            .unwrap();
        let done = next(&ccq);
        assert_eq!(
            (done.opcode, done.status),
            (Opcode::Read, WcStatus::Success)
        );
        unsafe { local.read(512 << 10, &mut got[..256 << 10]) }.unwrap();
        assert!(got[..256 << 10] == data[..256 << 10]);
        unsafe { local.read(0, &mut got[..256 << 10]) }.unwrap();
        assert!(got[..256 << 10] == data[256 << 10..512 << 10]);
        // Atomics.
        unsafe { tmr.write(64, &5u64.to_ne_bytes()) }.unwrap();
        c.post_fetch_add(&local, 8, &remote, 64, 10, 3, SendFlags::SIGNALED)
            .unwrap();
        assert_eq!(next(&ccq).opcode, Opcode::FetchAdd);
        c.post_cmp_swap(&local, 16, &remote, 64, 15, 99, 4, SendFlags::SIGNALED)
            .unwrap();
        assert_eq!(next(&ccq).opcode, Opcode::CmpSwap);
        let word = |mr: &MemoryRegion, off| {
            let mut b = [0u8; 8];
            unsafe { mr.read(off, &mut b) }.unwrap();
            u64::from_ne_bytes(b)
        };
        assert_eq!((word(&local, 8), word(&local, 16)), (5, 15));
        assert_eq!(word(&tmr, 64), 99);
        // Write with immediate: consumes a receive, whose buffer stays untouched.
        let rbuf = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        unsafe { rbuf.write(0, &[7; 64]) }.unwrap();
        s.post_recv(&rbuf, 0, 64, 50).unwrap();
        c.post_write_imm(&all[..], &remote, 0, 0xfeed, 5, SendFlags::SIGNALED)
            .unwrap();
        let r = next(&scq);
        assert_eq!(
            (r.wr_id, r.opcode, r.status, r.byte_len, r.imm),
            (
                50,
                Opcode::RecvWriteImm,
                WcStatus::Success,
                1 << 20,
                Some(0xfeed)
            )
        );
        let w = next(&ccq);
        assert_eq!(
            (w.wr_id, w.opcode, w.status),
            (5, Opcode::Write, WcStatus::Success)
        );
        let mut r = [0u8; 64];
        unsafe { rbuf.read(0, &mut r) }.unwrap();
        assert_eq!(r, [7; 64]);
        // A wrong key fails and changes nothing.
        let bad = c
            .remote_from_raw(remote.addr(), remote.len(), remote.key() ^ 1)
            .unwrap();
        unsafe { tmr.read(0, &mut got) }.unwrap();
        let before = got.clone();
        c.post_write(&all, &bad, 0, 6, SendFlags::SIGNALED).unwrap();
        let e = next(&ccq);
        assert_eq!((e.wr_id, e.status), (6, WcStatus::RemoteAccess));
        unsafe { tmr.read(0, &mut got) }.unwrap();
        assert!(got == before);
        until_disconnected(&ccq);
        until_disconnected(&scq);
    }

    /// Unsignaled writes, reads and atomics (the path that does not take the connection's
    /// lock): their bytes land and nothing is reported for them; a send queue full of waiting
    /// sends refuses them as it refuses a send; one with a key the peer never gave is accepted,
    /// completes with RemoteAccess although unsignaled, touches nothing and fails the
    /// connection; once the connection is down they are refused.
    #[test]
    fn unsignaled_one_sided_operations_land_quietly_and_obey_the_queue_and_the_connection() {
        let ctx = Context::new().unwrap();
        let copts = ConnOptions {
            send_queue_depth: 2,
            ..ConnOptions::default()
        };
        let (c, ccq, s, scq) = pair(&Net::Shm, &ctx, &copts, &ConnOptions::default());
        let tmr = ctx.alloc_mr(4096, RW).unwrap();
        let remote = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
        let local = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        let data = pattern(5, 1024);
        unsafe { local.write(0, &data) }.unwrap();
        unsafe { tmr.write(2048, &pattern(6, 1024)) }.unwrap();
        let seg = |offset, len| Sge {
            mr: &local,
            offset,
            len,
        };
        let quiet = SendFlags(0);
        // Many in a row: the first fills the poster's cache of the peer's region, the rest
        // reuse it.
        for k in 0..16u64 {
            let at = 64 * k as usize;
            c.post_write(&[seg(at, 64)], &remote, at as u64, 100 + k, quiet)
                .unwrap();
        }
        c.post_read(&[seg(1024, 1024)], &remote, 2048, 200, quiet)
            .unwrap();
        c.post_fetch_add(&local, 3072, &remote, 3072, 5, 201, quiet)
            .unwrap();
        // One-sided operations complete in order: once this one has, so have those before.
        c.post_fetch_add(&local, 3080, &remote, 3072, 1, 202, SendFlags::SIGNALED)
            .unwrap();
        let done = next(&ccq);
        assert_eq!(
            (done.wr_id, done.opcode, done.status),
            (202, Opcode::FetchAdd, WcStatus::Success),
            "nothing reported for the unsignaled ones"
        );
        let mut got = vec![0u8; 1024];
        unsafe { tmr.read(0, &mut got) }.unwrap();
        assert_eq!(got, data, "the unsignaled writes landed");
        unsafe { local.read(1024, &mut got) }.unwrap();
        assert_eq!(got, pattern(6, 1024), "the unsignaled read landed");
        let mut word = [0u8; 8];
        unsafe { local.read(3080, &mut word) }.unwrap();
        assert_eq!(
            u64::from_le_bytes(word),
            5,
            "the unsignaled fetch-and-add ran first"
        );
        assert!(ccq.poll().is_none());

        // Two sends wait for receives the peer has not posted: the queue is full.
        c.post_send(&local, 0, 8, 300, SendFlags::SIGNALED).unwrap();
        c.post_send(&local, 8, 8, 301, SendFlags::SIGNALED).unwrap();
        assert!(matches!(
            c.post_write(&[seg(0, 8)], &remote, 0, 302, quiet),
            Err(Error::QueueFull(_))
        ));
        let rbuf = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        s.post_recv(&rbuf, 0, 8, 1).unwrap();
        s.post_recv(&rbuf, 8, 8, 2).unwrap();
        assert_eq!(next(&ccq).wr_id, 300);
        assert_eq!(next(&ccq).wr_id, 301);
        assert_eq!(next(&scq).wr_id, 1);
        assert_eq!(next(&scq).wr_id, 2);
        // Reaped: room again at once.
        c.post_write(&[seg(0, 8)], &remote, 0, 303, quiet).unwrap();

        // A key the peer never gave: accepted, then reported, although unsignaled.
        unsafe { tmr.read(0, &mut got) }.unwrap();
        let bad = c
            .remote_from_raw(remote.addr(), remote.len(), remote.key() ^ 1)
            .unwrap();
        c.post_write(&[seg(512, 64)], &bad, 0, 304, quiet).unwrap();
        let e = next(&ccq);
        assert_eq!(
            (e.wr_id, e.opcode, e.status),
            (304, Opcode::Write, WcStatus::RemoteAccess)
        );
        let mut after = vec![0u8; 1024];
        unsafe { tmr.read(0, &mut after) }.unwrap();
        assert_eq!(after, got, "a refused write touches nothing");
        assert_eq!(
            until_disconnected(&ccq).last().unwrap().status,
            WcStatus::RemoteAccess
        );
        until_disconnected(&scq);
        for r in [
            c.post_write(&[seg(0, 8)], &remote, 0, 305, quiet),
            c.post_read(&[seg(0, 8)], &remote, 0, 306, quiet),
        ] {
            assert!(matches!(r, Err(Error::Disconnected)), "{r:?}");
        }
    }

    #[test]
    fn a_one_sided_completion_comes_after_the_sends_in_flight_before_it() {
        let ctx = Context::new().unwrap();
        let (c, ccq, s, scq) = setup(&ctx);
        let tmr = ctx.alloc_mr(64, RW).unwrap();
        let remote = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
        let rbuf = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        s.post_recv(&rbuf, 0, 64, 1).unwrap();
        let local = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        c.post_send(&local, 0, 64, 10, SendFlags::SIGNALED).unwrap();
        let sgl = [Sge {
            mr: &local,
            offset: 0,
            len: 8,
        }];
        c.post_write(&sgl, &remote, 0, 11, SendFlags::SIGNALED)
            .unwrap();
        c.post_fetch_add(&local, 8, &remote, 8, 1, 12, SendFlags::SIGNALED)
            .unwrap();
        let got: Vec<_> = (0..3)
            .map(|_| next(&ccq))
            .map(|c| (c.wr_id, c.opcode))
            .collect();
        assert_eq!(
            got,
            [
                (10, Opcode::Send),
                (11, Opcode::Write),
                (12, Opcode::FetchAdd)
            ]
        );
        assert_eq!(next(&scq).opcode, Opcode::Recv);
    }

    /// Two connections to one region, from two threads: every fetch-and-add lands once
    /// (exact sum, every fetched value distinct); both progress modes.
    #[test]
    fn fetch_adds_from_two_connections_are_atomic() {
        use rdmabridge::{CqOptions, Progress};
        const N: u64 = 20_000;
        for progress in [Progress::Caller, Progress::Thread] {
            let ctx = Context::new().unwrap();
            let cq_opts = CqOptions {
                progress,
                ..CqOptions::default()
            };
            let o = ConnOptions::default();
            let (c1, q1, s1, _sq1) = pair_with(&Net::Shm, &ctx, &o, &o, cq_opts);
            let (c2, q2, s2, _sq2) = pair_with(&Net::Shm, &ctx, &o, &o, cq_opts);
            let tmr = ctx.alloc_mr(4096, RW).unwrap();
            let r1 = c1.unpack_remote(&s1.pack_region(&tmr).unwrap()).unwrap();
            let r2 = c2.unpack_remote(&s2.pack_region(&tmr).unwrap()).unwrap();
            let run = |c: &Connection, q: &CompletionQueue, r| {
                let local = ctx.alloc_mr(8, Access::LOCAL_WRITE).unwrap();
                let mut seen = Vec::with_capacity(N as usize);
                for i in 0..N {
                    c.post_fetch_add(&local, 0, &r, 128, 1, i, SendFlags::SIGNALED)
                        .unwrap();
                    let d = next(q);
                    assert_eq!(
                        (d.wr_id, d.opcode, d.status),
                        (i, Opcode::FetchAdd, WcStatus::Success)
                    );
                    let mut b = [0u8; 8];
                    unsafe { local.read(0, &mut b) }.unwrap();
                    seen.push(u64::from_ne_bytes(b));
                }
                seen
            };
            let (a, b) = std::thread::scope(|sc| {
                let h = sc.spawn(|| run(&c2, &q2, r2));
                (run(&c1, &q1, r1), h.join().unwrap())
            });
            let mut all: Vec<u64> = a.into_iter().chain(b).collect();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len() as u64, 2 * N, "{progress:?}");
            assert_eq!(*all.last().unwrap(), 2 * N - 1);
            let mut w = [0u8; 8];
            unsafe { tmr.read(128, &mut w) }.unwrap();
            assert_eq!(u64::from_ne_bytes(w), 2 * N);
        }
    }

    /// One-sided operations on the regions of another process: a library-allocated one (its
    /// memfd passed and mapped here) and caller memory (reached through the kernel), which,
    /// once the owner drops its region, is no longer reachable.
    #[test]
    fn regions_of_another_process_are_reached_until_dropped() {
        let addr = unique_addr("xproc");
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "onesided::target_child",
                "--test-threads=1",
            ])
            .env("RBR_TEST_TARGET_ADDR", &addr)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let ctx = Context::new().unwrap();
        let cq = CompletionQueue::new().unwrap();
        let start = std::time::Instant::now();
        let c = loop {
            match ctx.connect(&addr, &cq, &ConnOptions::default()) {
                Ok(c) => break c,
                Err(Error::Refused(_)) if start.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("{e}"),
            }
        };
        let msg = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        c.post_recv(&msg, 0, 64, 100).unwrap();
        assert_eq!(next(&cq).opcode, Opcode::Recv);
        let mut desc = [0u8; 64];
        unsafe { msg.read(0, &mut desc) }.unwrap();
        let a = c.unpack_remote(&desc[..32]).unwrap();
        let b = c.unpack_remote(&desc[32..]).unwrap();
        let local = ctx.alloc_mr(1 << 16, Access::LOCAL_WRITE).unwrap();
        unsafe { local.write(0, &pattern(1, 1 << 16)) }.unwrap();
        let halves = [
            Sge {
                mr: &local,
                offset: 0,
                len: 1000,
            },
            Sge {
                mr: &local,
                offset: 1000,
                len: (1 << 16) - 1000,
            },
        ];
        c.post_write(&halves, &a, 0, 1, SendFlags::SIGNALED)
            .unwrap();
        let word = ctx.alloc_mr(8, Access::LOCAL_WRITE).unwrap();
        c.post_fetch_add(&word, 0, &a, (1 << 16) - 8, 5, 2, SendFlags(0))
            .unwrap();
        let small = ctx.alloc_mr(1 << 14, Access::LOCAL_WRITE).unwrap();
        unsafe { small.write(0, &pattern(2, 1 << 14)) }.unwrap();
        let whole = [Sge {
            mr: &small,
            offset: 0,
            len: 1 << 14,
        }];
        c.post_write(&whole, &b, 0, 3, SendFlags::SIGNALED).unwrap();
        unsafe { small.write(0, &[0; 1 << 14]) }.unwrap();
        c.post_read(&whole, &b, 0, 4, SendFlags::SIGNALED).unwrap();
        c.post_recv(&msg, 0, 64, 101).unwrap();
        c.post_write_imm(&[], &a, 0, 1, 5, SendFlags::SIGNALED)
            .unwrap();
        let mut got = Vec::new();
        while got.len() < 5 {
            let d = next(&cq);
            assert_eq!(d.status, WcStatus::Success, "{d:?}");
            got.push((d.wr_id, d.opcode));
        }
        // This side's work completes in order; the owner's message (101), sent once it saw
        // the write with immediate, may come before or after that write's own completion.
        let ours: Vec<_> = got.iter().filter(|g| g.0 != 101).copied().collect();
        assert_eq!(
            ours,
            [
                (1, Opcode::Write),
                (3, Opcode::Write),
                (4, Opcode::Read),
                (5, Opcode::Write)
            ]
        );
        assert!(got.contains(&(101, Opcode::Recv)));
        let mut back = vec![0u8; 1 << 14];
        unsafe { small.read(0, &mut back) }.unwrap();
        assert!(back == pattern(2, 1 << 14), "read back through the kernel");
        // The owner dropped region b (its message said so): writing it fails, and the owner
        // checks that its memory did not change.
        unsafe { small.write(0, &pattern(3, 1 << 14)) }.unwrap();
        c.post_write(&whole, &b, 0, 6, SendFlags::SIGNALED).unwrap();
        let d = next(&cq);
        assert_eq!((d.wr_id, d.status), (6, WcStatus::RemoteAccess));
        while next(&cq).opcode != Opcode::Disconnected {}
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    #[ignore = "run by regions_of_another_process_are_reached_until_dropped in a child process"]
    fn target_child() {
        let addr = std::env::var("RBR_TEST_TARGET_ADDR").unwrap();
        let ctx = Context::new().unwrap();
        let l = ctx.listen(&addr, 4).unwrap();
        let cq = CompletionQueue::new().unwrap();
        let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
        let s = req.accept(&cq, &ConnOptions::default()).unwrap();
        let a = ctx.alloc_mr(1 << 16, RW).unwrap();
        let mut backing = vec![0u8; 1 << 14];
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        // SAFETY: `backing` outlives the region (dropped below, long before it).
        let b = unsafe {
            ctx.register_mr(backing.as_mut_ptr(), 1 << 14, access)
                .unwrap()
        };
        let msg = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        unsafe { msg.write(0, &s.pack_region(&a).unwrap()) }.unwrap();
        unsafe { msg.write(32, &s.pack_region(&b).unwrap()) }.unwrap();
        let rbuf = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        s.post_recv(&rbuf, 0, 64, 1).unwrap();
        s.post_send(&msg, 0, 64, 2, SendFlags::SIGNALED).unwrap();
        let mut imm = None;
        while imm.is_none() {
            let d = next(&cq);
            assert_eq!(d.status, WcStatus::Success, "{d:?}");
            if d.opcode == Opcode::RecvWriteImm {
                imm = Some((d.wr_id, d.imm, d.byte_len));
            }
        }
        assert_eq!(imm, Some((1, Some(1), 0)));
        let mut got = vec![0u8; 1 << 16];
        unsafe { a.read(0, &mut got) }.unwrap();
        let mut want = pattern(1, 1 << 16);
        let last = u64::from_ne_bytes(want[(1 << 16) - 8..].try_into().unwrap());
        want[(1 << 16) - 8..].copy_from_slice(&(last + 5).to_ne_bytes());
        assert!(got == want, "the mapped region holds the write and the add");
        drop(b);
        assert!(
            backing == pattern(2, 1 << 14),
            "caller memory holds the write"
        );
        s.post_send(&msg, 0, 8, 3, SendFlags::SIGNALED).unwrap();
        // The peer's next write fails its side of the connection; this side sees the end.
        while next(&cq).opcode != Opcode::Disconnected {}
        assert!(backing == pattern(2, 1 << 14), "untouched once dropped");
    }

    /// A send's completion comes before the completion of the answer the peer sent after
    /// taking it (a write with immediate data here, or a message), as over verbs: a ping-pong
    /// that waits for each in turn never sees them the other way round. Two contexts, so that
    /// each side has its own library thread (with progress threads, or while a side sleeps in
    /// its wait, that thread hands it the message).
    #[test]
    fn a_send_completes_before_the_answer_to_it() {
        let (sctx, cctx) = (Context::new().unwrap(), Context::new().unwrap());
        let addr = unique_addr("order");
        let l = sctx.listen(&addr, 4).unwrap();
        let (ccq, scq) = (
            CompletionQueue::new().unwrap(),
            CompletionQueue::new().unwrap(),
        );
        let o = ConnOptions::default();
        let (c, s) = std::thread::scope(|sc| {
            let h = sc.spawn(|| {
                l.get_request(Some(Duration::from_secs(10)))
                    .unwrap()
                    .accept(&scq, &o)
                    .unwrap()
            });
            (cctx.connect(&addr, &ccq, &o).unwrap(), h.join().unwrap())
        });
        let tmr = sctx.alloc_mr(64, RW).unwrap();
        let remote = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
        let sbuf = sctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        let cbuf = cctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        const ROUNDS: u64 = 5000;
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for r in 0..ROUNDS {
                    c.post_recv(&cbuf, 0, 64, r).unwrap();
                    let got = next(&ccq);
                    assert_eq!((got.wr_id, got.opcode), (r, Opcode::Recv), "round {r}");
                    if r % 2 == 0 {
                        c.post_write_imm(&[], &remote, 0, r as u32, r, SendFlags::SIGNALED)
                            .unwrap();
                    } else {
                        c.post_send_inline(b"a", r, SendFlags::SIGNALED).unwrap();
                    }
                    let done = next(&ccq);
                    assert_eq!(done.wr_id, r, "round {r}: {done:?}");
                }
            });
            for r in 0..ROUNDS {
                s.post_recv(&sbuf, 0, 64, r).unwrap();
                s.post_send_inline(b"k", r, SendFlags::SIGNALED).unwrap();
                let first = next(&scq);
                assert_eq!((first.wr_id, first.opcode), (r, Opcode::Send), "round {r}");
                let answer = next(&scq);
                let want = if r % 2 == 0 {
                    Opcode::RecvWriteImm
                } else {
                    Opcode::Recv
                };
                assert_eq!((answer.wr_id, answer.opcode), (r, want), "round {r}");
            }
        });
    }

    /// A peer that cannot reach this process's memory (another user: the kernel's ptrace
    /// rules) is refused caller memory at pack time, with the reason, and reaches a region
    /// the library allocated (mapped) all the same. Needs root, as the project's test command
    /// runs (the peer runs as `nobody`).
    #[test]
    fn a_peer_that_cannot_reach_this_process_gets_allocated_regions_only() {
        use std::os::unix::process::CommandExt;
        use std::process::Stdio;
        // SAFETY: geteuid cannot fail.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test runs as root (see README)"
        );
        let addr = unique_addr("otheruser");
        let ctx = Context::with_options(rdmabridge::ContextOptions {
            shm_allow_any_uid: true,
        })
        .unwrap();
        let l = ctx.listen(&addr, 4).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "onesided::other_user_child",
                "--test-threads=1",
            ])
            .env("RBR_TEST_TARGET_ADDR", &addr)
            .uid(65534)
            .gid(65534)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let cq = CompletionQueue::new().unwrap();
        let s = l
            .get_request(Some(Duration::from_secs(10)))
            .unwrap()
            .accept(&cq, &ConnOptions::default())
            .unwrap();
        let mut backing = vec![0u8; 4096];
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        // SAFETY: `backing` outlives the region.
        let cma = unsafe { ctx.register_mr(backing.as_mut_ptr(), 4096, access).unwrap() };
        let e = s.pack_region(&cma).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("ptrace"), "{e}");
        let tmr = ctx.alloc_mr(4096, access).unwrap();
        let msg = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        unsafe { msg.write(0, &s.pack_region(&tmr).unwrap()) }.unwrap();
        s.post_recv(&msg, 32, 32, 1).unwrap();
        s.post_send(&msg, 0, 32, 2, SendFlags::SIGNALED).unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            let d = next(&cq);
            assert_eq!(d.status, WcStatus::Success, "{d:?}");
            got.push(d.opcode);
        }
        let mut data = vec![0u8; 4096];
        unsafe { tmr.read(0, &mut data) }.unwrap();
        assert!(
            data == pattern(5, 4096),
            "the peer's write is in the region"
        );
        drop(s);
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        drop(cma);
        drop(backing);
    }

    #[test]
    #[ignore = "run as another user by a_peer_that_cannot_reach_this_process_gets_allocated_regions_only"]
    fn other_user_child() {
        let addr = std::env::var("RBR_TEST_TARGET_ADDR").unwrap();
        let ctx = Context::with_options(rdmabridge::ContextOptions {
            shm_allow_any_uid: true,
        })
        .unwrap();
        let cq = CompletionQueue::new().unwrap();
        let c = ctx.connect(&addr, &cq, &ConnOptions::default()).unwrap();
        let msg = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        c.post_recv(&msg, 0, 32, 1).unwrap();
        assert_eq!(next(&cq).opcode, Opcode::Recv);
        let mut desc = [0u8; 32];
        unsafe { msg.read(0, &mut desc) }.unwrap();
        let r = c.unpack_remote(&desc).unwrap();
        let local = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        unsafe { local.write(0, &pattern(5, 4096)) }.unwrap();
        let sgl = [Sge {
            mr: &local,
            offset: 0,
            len: 4096,
        }];
        c.post_write(&sgl, &r, 0, 2, SendFlags::SIGNALED).unwrap();
        assert_eq!(next(&cq).status, WcStatus::Success);
        c.post_send_inline(b"done", 3, SendFlags::SIGNALED).unwrap();
        while next(&cq).opcode != Opcode::Disconnected {}
    }
}

/// A server process SIGKILLed and started again on the same address while clients reconnect
/// (tests/common/faults.rs).
#[test]
fn server_restarted_while_clients_reconnect() {
    common::faults::server_restarted_while_clients_reconnect(&Net::Shm, "faults_echo_server_child");
}

/// The server process of `server_restarted_while_clients_reconnect` (does nothing unless that
/// test starts it).
#[test]
#[ignore = "the child process of server_restarted_while_clients_reconnect"]
fn faults_echo_server_child() {
    common::faults::echo_server_child();
}

/// Messages of 1 KiB and more from a region the library allocated go in one copy, the receiver
/// copying out of its own mapping of the region; from caller memory, messages of 256 KiB and
/// more, with `process_vm_readv`.
mod large_messages {
    use super::*;
    use rdmabridge::{Access, CqOptions, MemoryRegion, Opcode, Progress, SendFlags, WcStatus};
    use std::sync::Arc;

    /// A completion of `cq` that must be `(wr_id, opcode)`, successful; returns its length.
    fn expect(cq: &CompletionQueue, wr_id: u64, opcode: Opcode) -> u32 {
        let c = next(cq);
        assert_eq!(
            (c.wr_id, c.opcode, c.status),
            (wr_id, opcode, WcStatus::Success),
            "{c:?}"
        );
        c.byte_len
    }

    /// A connected pair: (client, its queue, server, its queue).
    type Pair = (
        rdmabridge::Connection,
        Arc<CompletionQueue>,
        rdmabridge::Connection,
        Arc<CompletionQueue>,
    );

    /// Sends `data` from `src` (at offset 8) into a fresh receive in `dst` and checks what
    /// arrived.
    fn send_and_check(
        (c, ccq, s, scq): &Pair,
        src: &Arc<MemoryRegion>,
        dst: &Arc<MemoryRegion>,
        data: &[u8],
        id: u64,
    ) {
        unsafe { src.write(8, data) }.unwrap();
        unsafe { dst.write(0, &vec![0u8; dst.len()]) }.unwrap();
        s.post_recv(dst, 0, dst.len(), id).unwrap();
        c.post_send(src, 8, data.len(), id, SendFlags::SIGNALED)
            .unwrap();
        assert_eq!(expect(scq, id, Opcode::Recv) as usize, data.len());
        expect(ccq, id, Opcode::Send);
        let mut got = vec![0u8; data.len()];
        unsafe { dst.read(0, &mut got) }.unwrap();
        assert!(got == data, "message {id} of {} bytes differs", data.len());
    }

    #[test]
    fn arrive_whole_from_allocated_and_caller_memory_in_both_progress_modes() {
        const MAX: usize = (1 << 20) + 24;
        for progress in [Progress::Caller, Progress::Thread] {
            let ctx = Context::new().unwrap();
            let (o, q) = (ConnOptions::default(), CqOptions::default());
            let p = pair_with(&Net::Shm, &ctx, &o, &o, CqOptions { progress, ..q });
            let allocated = ctx.alloc_mr(MAX, Access::LOCAL_WRITE).unwrap();
            let mut backing = vec![0u8; MAX];
            // SAFETY: `backing` outlives the region (dropped after it, at the end).
            let caller = unsafe {
                ctx.register_mr(backing.as_mut_ptr(), MAX, Access::LOCAL_WRITE)
                    .unwrap()
            };
            let dst = ctx.alloc_mr(MAX, Access::LOCAL_WRITE).unwrap();
            let mut id = 0;
            for src in [&allocated, &caller] {
                for size in [
                    1023,
                    1024,
                    4096,
                    (256 << 10) - 1,
                    256 << 10,
                    1 << 20,
                    MAX - 8,
                ] {
                    for _ in 0..3 {
                        id += 1;
                        let data = pattern(id, size);
                        send_and_check(&p, src, &dst, &data, id);
                    }
                }
            }
            drop(caller);
            drop(backing);
        }
    }

    /// Sending from a region the library allocated exposes it to the peer, within a budget of
    /// 64 of the connection's 256 region slots: after large sends from 70 regions the program
    /// still packs 192 regions of its own, not 193; a region that goes frees its slot.
    #[test]
    fn take_at_most_64_of_the_256_region_slots_and_free_them_with_the_region() {
        const SIZE: usize = 256 << 10;
        let ctx = Context::new().unwrap();
        let p = setup_pair(&ctx);
        let c = &p.0;
        let dst = ctx.alloc_mr(SIZE, Access::LOCAL_WRITE).unwrap();
        let mut senders = Vec::new();
        for id in 0..70u64 {
            let src = ctx.alloc_mr(SIZE + 8, Access::LOCAL_WRITE).unwrap();
            send_and_check(&p, &src, &dst, &pattern(id, SIZE), id);
            senders.push(src);
        }
        let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mine: Vec<_> = (0..192).map(|_| ctx.alloc_mr(4096, rw).unwrap()).collect();
        for mr in &mine {
            c.pack_region(mr).unwrap();
        }
        let one_more = ctx.alloc_mr(4096, rw).unwrap();
        let e = c.pack_region(&one_more).unwrap_err();
        assert!(e.to_string().contains("256"), "{e}");
        // Sends from the regions already exposed still go (and arrive whole).
        send_and_check(&p, &senders[3], &dst, &pattern(99, SIZE), 99);
        senders.truncate(60);
        c.pack_region(&one_more).unwrap();
        // Ten slots went with ten regions, and the program takes one of them. Large sends from
        // new regions still arrive (the slots in use are above the budget: not exposed).
        for id in 100..110u64 {
            let src = ctx.alloc_mr(SIZE + 8, Access::LOCAL_WRITE).unwrap();
            send_and_check(&p, &src, &dst, &pattern(id, SIZE), id);
        }
    }

    fn setup_pair(ctx: &Context) -> Pair {
        let opts = ConnOptions::default();
        pair(&Net::Shm, ctx, &opts, &opts)
    }
}

/// More dead peers than the listener looks at in one go, then a real client: an `EPOLLET`
/// loop on the listener gets the client without sleeping on it.
#[test]
fn edge_triggered_listener_sees_a_request_behind_dead_peers() {
    common::edge::edge_triggered_listener_sees_a_request_behind_dead_peers();
}

/// The ring size is the larger of the two sides' `shm_ring_size` (0: none asked, then the
/// default), both sides report it; and over the smallest ring, messages posted before any
/// receive - many times the ring's room, small inline ones and large ones from caller memory -
/// wait (in the ring, then in the sender's library) and arrive in order, each once, with their
/// bytes, as receives are posted one at a time.
#[test]
fn ring_is_the_larger_asked_for_and_messages_beyond_it_wait_in_order() {
    use rdmabridge::{Access, SHM_RING_DEFAULT, SHM_RING_MIN, SendFlags};
    let ctx = Context::new().unwrap();
    let with = |ring: u32| ConnOptions {
        shm_ring_size: ring,
        send_queue_depth: 256,
        recv_queue_depth: 256,
        max_inline: 1024,
        ..Default::default()
    };
    for (client, server, granted) in [
        (0, 0, SHM_RING_DEFAULT),
        (256 << 10, 0, 256 << 10),
        (0, 64 << 10, 64 << 10),
        (SHM_RING_MIN, 64 << 10, 64 << 10),
    ] {
        let (c, _ccq, s, _scq) = pair(&Net::Shm, &ctx, &with(client), &with(server));
        assert_eq!(
            (c.info().shm_ring_size, s.info().shm_ring_size),
            (granted, granted),
            "client asked {client}, server {server}"
        );
    }

    const SMALL: u64 = 120;
    const LARGE: usize = 100 << 10;
    let (c, ccq, s, scq) = pair(&Net::Shm, &ctx, &with(SHM_RING_MIN), &with(0));
    assert_eq!(s.info().shm_ring_size, SHM_RING_MIN);
    let message = |k: u64| pattern(k, if k % 40 == 39 { LARGE } else { 1000 });
    // Caller memory (not a region the library allocated): the large ones go through the ring.
    let mut large: Vec<Vec<u8>> = Vec::new();
    let mut regions = Vec::new();
    for k in 0..SMALL {
        let m = message(k);
        if m.len() > 1024 {
            large.push(m);
            let buf = large.last_mut().unwrap();
            // SAFETY: the buffer lives (unmoved: the Vec's heap block) until the region and the
            // send are done, at the end of this test.
            let mr = unsafe { ctx.register_mr(buf.as_mut_ptr(), buf.len(), Access(0)) }.unwrap();
            c.post_send(&mr, 0, LARGE, k, SendFlags::SIGNALED).unwrap();
            regions.push(mr);
        } else {
            c.post_send_inline(&m, k, SendFlags::SIGNALED).unwrap();
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let rmr = ctx.alloc_mr(LARGE, Access::LOCAL_WRITE).unwrap();
    let mut sends = 0;
    for k in 0..SMALL {
        s.post_recv(&rmr, 0, LARGE, k).unwrap();
        let r = next(&scq);
        assert_eq!(
            (r.opcode, r.status, r.wr_id, r.byte_len as usize),
            (
                rdmabridge::Opcode::Recv,
                rdmabridge::WcStatus::Success,
                k,
                message(k).len()
            ),
            "message {k}"
        );
        let mut got = vec![0u8; message(k).len()];
        unsafe { rmr.read(0, &mut got) }.unwrap();
        assert!(got == message(k), "message {k}'s bytes");
        while let Some(sc) = ccq.poll() {
            assert_eq!(
                (sc.status, sc.wr_id),
                (rdmabridge::WcStatus::Success, sends)
            );
            sends += 1;
        }
    }
    while sends < SMALL {
        let sc = next(&ccq);
        assert_eq!(
            (sc.status, sc.wr_id),
            (rdmabridge::WcStatus::Success, sends)
        );
        sends += 1;
    }
    assert!(scq.poll().is_none(), "a message delivered twice");
    drop((c, s));
    drop(regions);
}

/// A closed connection's segment is kept and serves the next connection between the same two
/// processes (here, two contexts of one), as new: the next connection gets exactly its own
/// messages, even though the one before left messages in the ring that were never received
/// (their records still stamped there).
#[test]
fn a_closed_connections_segment_serves_the_next_one_as_new() {
    use rdmabridge::{Access, Opcode, SendFlags, WcStatus};
    const ROUNDS: u64 = 20;
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let opts = ConnOptions {
        max_inline: 256,
        ..Default::default()
    };
    let message = |round: u64, k: u64| pattern(round * 100 + k, 64 + k as usize);
    let mut reused = 0;
    for round in 0..ROUNDS {
        let before = segment_inodes();
        let (c, ccq, s, scq) =
            pair_between(&Net::Shm, &cctx, &sctx, &opts, &opts, Default::default());
        if segment_inodes().is_subset(&before) {
            reused += 1;
        }
        let rmr = sctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        // A receive waits before anything is sent: what the ring held before must not pass
        // for a message.
        s.post_recv(&rmr, 0, 4096, 0).unwrap();
        for _ in 0..100 {
            if let Some(r) = scq.poll() {
                panic!("round {round}: {r:?} before anything was sent");
            }
        }
        for k in 0..5 {
            c.post_send_inline(&message(round, k), k, SendFlags::SIGNALED)
                .unwrap();
        }
        // Three are received; two stay in the ring.
        for k in 0..3 {
            if k > 0 {
                s.post_recv(&rmr, 0, 4096, k).unwrap();
            }
            let r = next(&scq);
            assert_eq!(
                (r.opcode, r.status, r.wr_id, r.byte_len as usize),
                (Opcode::Recv, WcStatus::Success, k, 64 + k as usize),
                "round {round}, message {k}"
            );
            let mut got = vec![0u8; 64 + k as usize];
            unsafe { rmr.read(0, &mut got) }.unwrap();
            assert!(
                got == message(round, k),
                "round {round}, message {k}'s bytes"
            );
        }
        // A send completes once its message is received.
        for k in 0..3 {
            let sc = next(&ccq);
            assert_eq!((sc.status, sc.wr_id), (WcStatus::Success, k));
        }
        drop((c, s, rmr));
        while let Some(r) = scq.poll() {
            assert_eq!(
                r.opcode,
                Opcode::Disconnected,
                "round {round}: nothing but the close after the messages received"
            );
        }
        // The segment is let go of on each side's library thread, after the close.
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        reused > 0,
        "no connection of {ROUNDS} took up a segment kept from the one before"
    );
}

/// How many lines of `/proc/self/maps` name a connection segment, read with system calls only
/// (no allocation, no lock): for a child just forked from this multi-threaded process.
fn segment_lines_after_fork() -> i32 {
    const NEEDLE: &[u8] = b"memfd:rdmabridge-shm";
    const KEEP: usize = NEEDLE.len() - 1;
    let mut buf = [0u8; 4096 + KEEP];
    let mut held = 0;
    let mut found = 0;
    // SAFETY: plain system calls on a NUL-terminated path and a live stack buffer, each read
    // into the part of it after the bytes kept from the last.
    unsafe {
        let fd = libc::open(c"/proc/self/maps".as_ptr(), libc::O_RDONLY);
        if fd < 0 {
            return 100;
        }
        loop {
            let n = libc::read(fd, buf[held..].as_mut_ptr().cast(), buf.len() - held);
            if n <= 0 {
                break;
            }
            let end = held + n as usize;
            found += buf[..end]
                .windows(NEEDLE.len())
                .filter(|w| *w == NEEDLE)
                .count();
            // The last bytes may begin a name the next read ends.
            let keep = end.min(KEEP);
            buf.copy_within(end - keep..end, 0);
            held = keep;
        }
        libc::close(fd);
    }
    found.min(99) as i32
}

/// A child this process forks maps none of its connections' segments: a segment kept after
/// its connection closed may carry a later connection of the parent's, which the child must
/// not see.
#[test]
fn a_forked_child_maps_no_segment() {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let opts = ConnOptions::default();
    let (c, _ccq, s, _scq) =
        pair_between(&Net::Shm, &cctx, &sctx, &opts, &opts, Default::default());
    assert!(
        segment_map_count() >= 2,
        "the connection's segment, mapped by both sides"
    );
    // SAFETY: the child makes system calls only, then exits without unwinding.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(segment_lines_after_fork()) };
    }
    assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
    let mut status = 0;
    // SAFETY: waits for our own child into a live local.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child ended: {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "segment mappings in the forked child"
    );
    drop((c, s));
}
