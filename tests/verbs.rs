//! The common suite over the verbs transport. These tests need an RDMA device: they run on
//! soft-RoCE inside the project's VM (`scripts/vm-test.sh`, part of `scripts/test.sh`), with
//! `--ignored`; on a machine without RDMA `cargo test` lists them as ignored.

mod common;

use common::Net;

macro_rules! suite_over_verbs {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        #[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
        fn $name() {
            common::suite::$name(&Net::verbs_from_env());
        }
    )*};
}

common::for_each_suite_test!(suite_over_verbs);

/// Shared receive queues over verbs (common/pools.rs; tests/srq.rs runs them over shm).
mod pools {
    use super::*;

    macro_rules! pools_over_verbs {
        ($($name:ident),* $(,)?) => {$(
            #[test]
            #[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
            fn $name() {
                common::pools::$name(&Net::verbs_from_env());
            }
        )*};
    }

    pools_over_verbs!(
        many_connections_take_their_receives_from_one_small_pool,
        the_pool_reports_running_low_once_per_arming,
        a_thousand_connections_share_one_pool_of_four_thousand_receives,
        sends_wait_for_an_empty_pool_as_long_as_it_takes,
        pools_and_their_connections_leave_nothing,
        a_connecting_side_takes_its_receives_from_a_pool,
        a_pooled_connection_reports_connected_before_its_messages,
    );
}

/// The async API's tests (feature `tokio`) over verbs.
#[cfg(feature = "tokio")]
mod asyncs {
    use super::*;

    macro_rules! async_over_verbs {
        ($($name:ident),* $(,)?) => {$(
            #[test]
            #[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
            fn $name() {
                common::asyncs::$name(&Net::verbs_from_env());
            }
        )*};
    }

    common::asyncs::for_each_async_test!(async_over_verbs);

    /// The tokio echo server serves 16 clients at once over verbs, every echo verified, and
    /// idles on their open connections (keepalives included) using little CPU: less than 5%
    /// of a core over 10 s under the VM's emulation.
    #[test]
    #[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
    fn tokio_server_serves_16_clients_at_once() {
        let addr = Net::verbs_from_env().addr("tokio-examples");
        let (server_ms, client_ms) = common::asyncs::examples_serve_many(&addr, 16, 10);
        assert!(server_ms < 500, "server busy while idle");
        assert!(client_ms < 500, "client busy while idle");
    }

    // Over shm this runs in tests/leaks.rs, alone in its binary while it counts.
    #[test]
    #[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
    fn futures_dropped_midway_leak_nothing() {
        common::asyncs::futures_dropped_midway_leak_nothing(&Net::verbs_from_env());
    }
}
// Over shm these run in tests/leaks.rs, alone in their binary while they count descriptors.
suite_over_verbs!(
    connect_close_cycles_leak_nothing,
    connects_dropped_midway_leak_nothing,
    connects_in_flight_cost_one_descriptor_and_no_thread
);

/// A connect to an address no route reaches fails with its own status, within the timeout.
/// (198.18.99.0/24 is on no interface of the VM, so nothing is ever sent.) The ceiling leaves
/// the emulated VM 2 s past the timeout and stays below the 5 s default.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn connect_to_unroutable_address_is_unreachable_within_timeout() {
    use rdmabridge::{CompletionQueue, ConnOptions, Context, Error};
    use std::time::{Duration, Instant};
    let _ = Net::verbs_from_env(); // only meaningful inside the VM
    let ctx = Context::new().unwrap();
    let cq = CompletionQueue::new().unwrap();
    let opts = ConnOptions {
        timeout: Some(Duration::from_secs(2)),
        ..Default::default()
    };
    let t = Instant::now();
    let r = ctx.connect("rdma://198.18.99.1:7471", &cq, &opts);
    assert!(matches!(r, Err(Error::Unreachable(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
}

/// Takes the test network interface down, and back up (waiting for the RDMA port to be active
/// again) when dropped, also when the test fails.
struct LinkDown(String);

impl LinkDown {
    fn new(netdev: &str) -> LinkDown {
        let ok = std::process::Command::new("ip")
            .args(["link", "set", "dev", netdev, "down"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip link set {netdev} down failed");
        LinkDown(netdev.to_owned())
    }
}

impl Drop for LinkDown {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "set", "dev", &self.0, "up"])
            .status();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            let active = std::fs::read_dir("/sys/class/infiniband")
                .into_iter()
                .flatten()
                .flatten()
                .any(|d| {
                    std::fs::read_to_string(d.path().join("ports/1/state"))
                        .is_ok_and(|s| s.contains("ACTIVE"))
                });
            if active {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// The local link goes down under idle connections that send no keepalives: the device's port
/// event alone makes both ends fail - every receive flushed, then a TRANSPORT disconnect -
/// within the documented bound (about 1 s + the retry bound of 1.9 s with the defaults; checked
/// against 20 s since the VM runs under emulation, on a machine that may be loaded; without the
/// port event nothing would ever end these idle connections). Run on its own
/// (scripts/vm-guest-suite.sh): it takes the VM's test interface down for a while.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn local_link_down_fails_idle_connections_within_bound() {
    use rdmabridge::{Access, ConnOptions, Context, Opcode, WcStatus};
    use std::time::{Duration, Instant};
    let net = Net::verbs_from_env();
    let netdev = std::env::var("RBR_TEST_NETDEV").expect("RBR_TEST_NETDEV is unset");
    let ctx = Context::new().unwrap();
    let opts = ConnOptions {
        keepalive: None,
        ..Default::default()
    };
    let (c, ccq, s, scq) = common::pair(&net, &ctx, &opts, &opts);
    let mr = ctx.alloc_mr(128, Access::LOCAL_WRITE).unwrap();
    c.post_recv(&mr, 0, 64, 1).unwrap();
    s.post_recv(&mr, 64, 64, 2).unwrap();
    // Idle for a while first: nothing may happen while the link is up.
    assert!(!ccq.wait(Some(Duration::from_millis(1500))).unwrap());
    assert!(!scq.wait(Some(Duration::from_millis(10))).unwrap());
    const BOUND: Duration = Duration::from_secs(20);
    // Each record within the bound (common::next gives up at 10 s).
    let next = |cq: &rdmabridge::CompletionQueue| loop {
        if let Some(c) = cq.poll() {
            return c;
        }
        assert!(
            cq.wait(Some(BOUND)).unwrap(),
            "no completion within {BOUND:?}"
        );
    };
    let down = LinkDown::new(&netdev);
    let t0 = Instant::now();
    for (cq, wr_id) in [(&ccq, 1), (&scq, 2)] {
        let r = next(cq);
        assert_eq!(
            (r.wr_id, r.opcode, r.status),
            (wr_id, Opcode::Recv, WcStatus::Flushed)
        );
        let d = next(cq);
        assert_eq!(
            (d.opcode, d.status),
            (Opcode::Disconnected, WcStatus::Transport)
        );
        let took = t0.elapsed();
        eprintln!("link down -> disconnect (wr {wr_id}'s side) after {took:?}");
        assert!(took < BOUND, "{took:?}");
    }
    drop(down);
    drop((c, s));
}

/// Starts the rdmacm-utils client `tool` toward our listener at `addr` (`-s HOST -p PORT`, then
/// `extra`), given 30 s at most, its output dropped.
fn stock_client(net: &Net, addr: &str, tool: &str, extra: &[&str]) -> std::process::Child {
    let Net::Verbs(ip) = net else { unreachable!() };
    let port = addr.rsplit(':').next().unwrap();
    std::process::Command::new("timeout")
        .args(["30", tool, "-s", ip, "-p", port])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{tool} (rdmacm-utils) must be installed in the VM: {e}"))
}

/// Toward a plain librdmacm client the library's accepting side takes its RNR retry count from
/// the client's connect request (docs/transports.md, "Verbs"): the stock `ucmatose` asks for none,
/// so a send of ours that finds no receive posted fails at once with TRANSPORT, and the
/// connection with it. A `ucmatose -C 1` client posts one receive before it connects, waits for
/// one message, replies with one and waits for the server's disconnect; we send two.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn plain_client_without_rnr_retries_fails_a_send_that_finds_no_receive() {
    use rdmabridge::{Access, CompletionQueue, ConnOptions, Context, Opcode, SendFlags, WcStatus};
    use std::time::{Duration, Instant};
    let net = Net::verbs_from_env();
    let addr = net.addr("ucmatose");
    let ctx = Context::new().unwrap();
    let l = ctx.listen(&addr, 4).unwrap();
    let mut client = stock_client(&net, &addr, "ucmatose", &["-C", "1", "-S", "100"]);
    let cq = CompletionQueue::new().unwrap();
    let conn = l
        .get_request(Some(Duration::from_secs(20)))
        .unwrap()
        .accept(&cq, &ConnOptions::default())
        .unwrap();
    let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    conn.post_recv(&mr, 0, 100, 1).unwrap();
    // The first send takes ucmatose's one receive; the second finds none.
    let t0 = Instant::now();
    conn.post_send(&mr, 1024, 100, 2, SendFlags::SIGNALED)
        .unwrap();
    conn.post_send(&mr, 2048, 100, 3, SendFlags::SIGNALED)
        .unwrap();
    let mut sends = Vec::new();
    let mut took = None;
    loop {
        let c = common::next(&cq);
        match c.opcode {
            Opcode::Send => {
                if c.wr_id == 3 {
                    took = Some(t0.elapsed());
                }
                sends.push((c.wr_id, c.status));
            }
            // ucmatose's reply may or may not arrive before our queue pair fails.
            Opcode::Recv => assert!(
                [WcStatus::Success, WcStatus::Flushed].contains(&c.status),
                "{c:?}"
            ),
            Opcode::Disconnected => {
                assert_eq!(c.status, WcStatus::Transport);
                break;
            }
            _ => panic!("unexpected {c:?}"),
        }
    }
    assert_eq!(
        sends,
        [(2, WcStatus::Success), (3, WcStatus::Transport)],
        "a send toward a client that asked for no RNR retries"
    );
    let took = took.unwrap();
    eprintln!("send without a receive at the plain peer failed after {took:?}");
    // It fails at once (no RNR retries); the ceiling is for an emulated VM on a loaded machine.
    assert!(took < Duration::from_secs(5), "{took:?}");
    drop(conn);
    let _ = client.wait();
}

/// A plain librdmacm client - the stock `rdma_client`, which posts one receive, connects,
/// sends 16 bytes and waits for its send and a 16-byte reply - served by a connection that
/// takes its receives from a shared receive queue: the client's message takes one of the
/// pool's receives, the reply reaches it, and it exits 0.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn plain_client_served_from_a_shared_receive_queue() {
    use rdmabridge::{Access, CompletionQueue, ConnOptions, Context, Opcode, SendFlags, WcStatus};
    use std::time::Duration;
    let net = Net::verbs_from_env();
    let addr = net.addr("rdma_client");
    let ctx = Context::new().unwrap();
    let pool = common::pools::pool_of(&ctx, 8, None);
    let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    for slot in 0..8u64 {
        pool.post_recv(&mr, slot as usize * 64, 64, 100 + slot)
            .unwrap();
    }
    let l = ctx.listen(&addr, 4).unwrap();
    let mut client = stock_client(&net, &addr, "rdma_client", &[]);
    let cq = CompletionQueue::new().unwrap();
    let opts = ConnOptions {
        srq: Some(pool.clone()),
        ..Default::default()
    };
    let conn = l
        .get_request(Some(Duration::from_secs(20)))
        .unwrap()
        .accept(&cq, &opts)
        .unwrap();
    let c = common::next(&cq);
    assert_eq!(
        (c.opcode, c.status, c.byte_len, c.conn_id),
        (Opcode::Recv, WcStatus::Success, 16, conn.id()),
        "{c:?}"
    );
    assert!((100..108).contains(&c.wr_id), "{c:?}");
    assert_eq!(pool.len(), 7);
    conn.post_send(&mr, 2048, 16, 1, SendFlags::SIGNALED)
        .unwrap();
    let c = common::next(&cq);
    assert_eq!(
        (c.opcode, c.status, c.wr_id),
        (Opcode::Send, WcStatus::Success, 1),
        "{c:?}"
    );
    let status = client.wait().unwrap();
    assert!(status.success(), "rdma_client: {status}");
    // The client disconnects once it has the reply.
    let c = common::next(&cq);
    assert_eq!(c.opcode, Opcode::Disconnected, "{c:?}");
    drop(conn);
    assert_eq!(pool.len(), 7, "the pool's other receives stay in it");
}

/// Allocations made by the current thread (counted by [`Counting`]).
mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static COUNT: Cell<u64> = const { Cell::new(0) };
    }

    /// The system allocator, counting each thread's allocations.
    pub struct Counting;

    // SAFETY: every call is passed on to the system allocator unchanged; the count is a
    // const-initialized thread-local that needs no allocation itself.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
            // SAFETY: the caller's contract is System's.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new) }
        }
    }

    pub fn this_thread() -> u64 {
        COUNT.with(|c| c.get())
    }
}

#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

/// Posting and polling allocate nothing: a thousand ping-pongs over verbs, with sends both
/// inline-sized and larger, make no allocation on the one thread that posts and polls both
/// ends (with progress on the caller's thread, the default).
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn posting_and_polling_allocate_nothing() {
    use rdmabridge::{
        Access, CompletionQueue, ConnOptions, Context, CqOptions, Opcode, Progress, SendFlags,
        WcStatus,
    };
    use std::time::{Duration, Instant};
    let net = Net::verbs_from_env();
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let cq_opts = CqOptions {
        progress: Progress::Caller,
        ..Default::default()
    };
    let (client, ccq, server, scq) = common::pair_with(&net, &ctx, &opts, &opts, cq_opts);
    const SIZE: usize = 4096;
    let mr = ctx.alloc_mr(4 * SIZE, Access::LOCAL_WRITE).unwrap();
    // Slots: client send, client receive, server receive (the server echoes from it).
    let (c_send, c_recv, s_recv) = (0, SIZE, 2 * SIZE);
    // Completions seen so far: [client send, client receive, server send, server receive].
    let mut seen = [0u64; 4];
    // Polls both queues, as a one-thread program serving both ends would, until `done`.
    let drive = |seen: &mut [u64; 4], len: usize, done: &dyn Fn(&[u64; 4]) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(seen) {
            for (cq, base) in [(&ccq, 0), (&scq, 2)] {
                let cq: &CompletionQueue = cq;
                if let Some(c) = cq.poll() {
                    assert_eq!(c.status, WcStatus::Success, "{c:?}");
                    match c.opcode {
                        Opcode::Send => seen[base] += 1,
                        Opcode::Recv => {
                            assert_eq!(c.byte_len as usize, len, "{c:?}");
                            seen[base + 1] += 1;
                        }
                        _ => panic!("unexpected {c:?}"),
                    }
                }
            }
            // A guard against a hang, not a measurement.
            assert!(Instant::now() < deadline, "stuck at {seen:?}");
        }
    };
    let mut round = |i: u64, len: usize| {
        server.post_recv(&mr, s_recv, SIZE, 2).unwrap();
        client.post_recv(&mr, c_recv, SIZE, 1).unwrap();
        client
            .post_send(&mr, c_send, len, 3, SendFlags::SIGNALED)
            .unwrap();
        drive(&mut seen, len, &|s| s[3] > i);
        server
            .post_send(&mr, s_recv, len, 4, SendFlags::SIGNALED)
            .unwrap();
        drive(&mut seen, len, &|s| s.iter().all(|&n| n > i));
    };
    let lens = [2, SIZE];
    // Warm-up: the first use of a region registers it, and the connections' first credit
    // writes and queues settle.
    for i in 0..100 {
        round(i, lens[i as usize % 2]);
    }
    let before = alloc_count::this_thread();
    for i in 100..1100 {
        round(i, lens[i as usize % 2]);
    }
    let made = alloc_count::this_thread() - before;
    assert_eq!(made, 0, "{made} allocations in 1000 ping-pongs");
}

/// The peer's region `target`, handed over in a message (which takes one of `to`'s receives).
fn hand_over_region(
    ctx: &rdmabridge::Context,
    owner: &rdmabridge::Connection,
    owner_cq: &rdmabridge::CompletionQueue,
    user: &rdmabridge::Connection,
    user_cq: &rdmabridge::CompletionQueue,
    target: &std::sync::Arc<rdmabridge::MemoryRegion>,
) -> rdmabridge::RemoteRegion {
    use rdmabridge::{Access, Opcode, SendFlags, WcStatus};
    let desc = owner.pack_region(target).unwrap();
    let buf = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    user.post_recv(&buf, 0, 64, 9000).unwrap();
    owner
        .post_send_inline(&desc, 9001, SendFlags::SIGNALED)
        .unwrap();
    let s = common::next(owner_cq);
    assert_eq!((s.opcode, s.status), (Opcode::Send, WcStatus::Success));
    let r = common::next(user_cq);
    assert_eq!((r.opcode, r.status), (Opcode::Recv, WcStatus::Success));
    let mut got = vec![0u8; r.byte_len as usize];
    unsafe { buf.read(0, &mut got) }.unwrap();
    user.unpack_remote(&got).unwrap()
}

/// Between two library peers a write with immediate takes one of the target's receives: it
/// waits for a credit like a send, in order with the sends, while a plain write posted after
/// both goes at once. The library's own traffic meanwhile (keepalives every 5 ms, credit
/// writes) reaches the target as nothing at all. Once receives are posted the target sees the
/// message, then the write's immediate and length, in that order, the immediate's receive
/// buffer untouched.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn write_with_immediate_waits_for_a_receive_in_order_with_sends() {
    use common::{next, pattern};
    use rdmabridge::{Access, ConnOptions, Context, Opcode, SendFlags, Sge, WcStatus};
    use std::time::Duration;
    let net = Net::verbs_from_env();
    let ctx = Context::new().unwrap();
    let opts = ConnOptions {
        keepalive: Some(Duration::from_millis(5)),
        ..Default::default()
    };
    let (c, ccq, s, scq) = common::pair(&net, &ctx, &opts, &opts);
    let target = ctx
        .alloc_mr(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let remote = hand_over_region(&ctx, &s, &scq, &c, &ccq, &target);
    let src = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    unsafe { src.write(0, &pattern(1, 4096)) }.unwrap();
    let sig = SendFlags::SIGNALED;
    c.post_send(&src, 0, 100, 1, sig).unwrap();
    let seg = |offset, len| Sge {
        mr: &src,
        offset,
        len,
    };
    c.post_write_imm(
        &[seg(100, 300), seg(400, 200)],
        &remote,
        0,
        0xdead_beef,
        2,
        sig,
    )
    .unwrap();
    c.post_write(&[seg(1000, 500)], &remote, 4096, 3, sig)
        .unwrap();
    let w = next(&ccq);
    assert_eq!(
        (w.opcode, w.status, w.wr_id),
        (Opcode::Write, WcStatus::Success, 3),
        "the plain write did not pass the held send and write with immediate"
    );
    let mut got = vec![0u8; 500];
    unsafe { target.read(4096, &mut got) }.unwrap();
    assert_eq!(got, pattern(1, 4096)[1000..1500]);
    // Keepalives and credit looks go on; neither side reports anything.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        ccq.poll().is_none(),
        "held work completed without a receive"
    );
    assert!(
        scq.poll().is_none(),
        "the library's own traffic reached the target"
    );
    let rbuf = ctx.alloc_mr(256, Access::LOCAL_WRITE).unwrap();
    unsafe { rbuf.write(0, &[0x5a; 256]) }.unwrap();
    s.post_recv(&rbuf, 0, 128, 10).unwrap();
    s.post_recv(&rbuf, 128, 128, 11).unwrap();
    let r = next(&scq);
    assert_eq!(
        (r.opcode, r.status, r.wr_id, r.byte_len),
        (Opcode::Recv, WcStatus::Success, 10, 100)
    );
    let r = next(&scq);
    assert_eq!(
        (r.opcode, r.status, r.wr_id, r.byte_len, r.imm),
        (
            Opcode::RecvWriteImm,
            WcStatus::Success,
            11,
            500,
            Some(0xdead_beef)
        )
    );
    let mut got = vec![0u8; 500];
    unsafe { target.read(0, &mut got) }.unwrap();
    assert_eq!(
        got,
        pattern(1, 4096)[100..600],
        "bytes of the write with immediate"
    );
    let mut untouched = vec![0u8; 128];
    unsafe { rbuf.read(128, &mut untouched) }.unwrap();
    assert_eq!(
        untouched,
        vec![0x5a; 128],
        "the immediate's receive buffer was written"
    );
    for (op, id) in [(Opcode::Send, 1), (Opcode::Write, 2)] {
        let x = next(&ccq);
        assert_eq!((x.opcode, x.status, x.wr_id), (op, WcStatus::Success, id));
    }
    // Credits keep flowing: the receives consumed by both are counted, so more go through.
    for k in 0..20u64 {
        s.post_recv(&rbuf, 0, 128, 100 + k).unwrap();
        if k % 2 == 0 {
            c.post_send(&src, 0, 64, 200 + k, sig).unwrap();
        } else {
            c.post_write_imm(&[seg(0, 64)], &remote, 0, k as u32, 200 + k, sig)
                .unwrap();
        }
        let x = next(&ccq);
        assert_eq!((x.status, x.wr_id), (WcStatus::Success, 200 + k));
        let r = next(&scq);
        let want = if k % 2 == 0 {
            (Opcode::Recv, None)
        } else {
            (Opcode::RecvWriteImm, Some(k as u32))
        };
        assert_eq!((r.opcode, r.imm, r.wr_id), (want.0, want.1, 100 + k));
    }
}

/// A disconnect flushes one-sided work with its own opcode: a write with immediate still
/// held for a receive the peer never posted, and reads and atomics that reached the device.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn held_write_with_immediate_is_flushed_as_a_write() {
    use common::next;
    use rdmabridge::{Access, ConnOptions, Context, Opcode, SendFlags, Sge, WcStatus};
    let net = Net::verbs_from_env();
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let (c, ccq, s, scq) = common::pair(&net, &ctx, &opts, &opts);
    let target = ctx
        .alloc_mr(
            4096,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let remote = hand_over_region(&ctx, &s, &scq, &c, &ccq, &target);
    let local = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let sge = [Sge {
        mr: &local,
        offset: 0,
        len: 64,
    }];
    c.post_write_imm(&sge, &remote, 0, 7, 1, SendFlags::SIGNALED)
        .unwrap();
    c.post_send(&local, 0, 8, 2, SendFlags::SIGNALED).unwrap();
    c.disconnect();
    let mut seen = Vec::new();
    loop {
        let x = next(&ccq);
        if x.opcode == Opcode::Disconnected {
            break;
        }
        seen.push((x.opcode, x.status, x.wr_id));
    }
    assert_eq!(
        seen,
        [
            (Opcode::Write, WcStatus::Flushed, 1),
            (Opcode::Send, WcStatus::Flushed, 2)
        ]
    );
    drop(s);
}

/// Unsignaled one-sided operations free their send-queue slots like unsignaled sends: with a
/// queue of 4, 400 of them (writes, reads, fetch-and-adds) go through without a record, and a
/// last signaled one reports; the counter shows every fetch-and-add ran.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn unsignaled_one_sided_operations_never_fill_the_send_queue() {
    use common::next;
    use rdmabridge::{Access, ConnOptions, Context, Error, Opcode, SendFlags, Sge, WcStatus};
    use std::time::{Duration, Instant};
    let net = Net::verbs_from_env();
    let ctx = Context::new().unwrap();
    let copts = ConnOptions {
        send_queue_depth: 4,
        ..Default::default()
    };
    let (c, ccq, s, scq) = common::pair(&net, &ctx, &copts, &ConnOptions::default());
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let target = ctx.alloc_mr(4096, all).unwrap();
    let remote = hand_over_region(&ctx, &s, &scq, &c, &ccq, &target);
    let local = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let sge = [Sge {
        mr: &local,
        offset: 64,
        len: 256,
    }];
    let n = 400u64;
    let mut adds = 0u64;
    for k in 0..=n {
        let flags = if k == n {
            SendFlags::SIGNALED
        } else {
            SendFlags(0)
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = match k % 3 {
                0 => c.post_write(&sge, &remote, 1024, k, flags),
                1 => c.post_read(&sge, &remote, 1024, k, flags),
                _ => c.post_fetch_add(&local, 0, &remote, 0, 1, k, flags),
            };
            match r {
                Ok(()) => break,
                Err(Error::QueueFull(_)) => {
                    assert!(Instant::now() < deadline, "op {k}: the queue stayed full");
                    assert!(ccq.poll().is_none(), "a record for unsignaled work");
                    std::thread::sleep(Duration::from_micros(100));
                }
                Err(e) => panic!("op {k}: {e}"),
            }
        }
        if k % 3 == 2 {
            adds += 1;
        }
    }
    let last = next(&ccq);
    assert_eq!(
        (last.opcode, last.status, last.wr_id),
        (Opcode::Read, WcStatus::Success, n)
    );
    assert!(ccq.poll().is_none());
    let mut word = [0u8; 8];
    unsafe { target.read(0, &mut word) }.unwrap();
    // The last fetch-and-add completed before the last read did (the send queue completes in
    // order), so the word holds them all.
    assert_eq!(u64::from_ne_bytes(word), adds);
}

/// A remote key is 32 bits (a verbs rkey): a larger one is refused at once, and the connection
/// goes on. (A C caller that puts one in an `rbr_remote` itself has its post refused:
/// `bad_input_matrix`.)
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn a_key_wider_than_32_bits_is_invalid_and_posts_nothing() {
    use common::next;
    use rdmabridge::{Access, ConnOptions, Context, Error, Opcode, SendFlags, Sge, WcStatus};
    let net = Net::verbs_from_env();
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let (c, ccq, s, scq) = common::pair(&net, &ctx, &opts, &opts);
    let target = ctx
        .alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let good = hand_over_region(&ctx, &s, &scq, &c, &ccq, &target);
    assert!(matches!(
        c.remote_from_raw(good.addr(), good.len(), good.key() | 1 << 32),
        Err(Error::InvalidArgument(_))
    ));
    let local = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    unsafe { local.write(0, &[7; 64]) }.unwrap();
    let sge = [Sge {
        mr: &local,
        offset: 0,
        len: 64,
    }];
    c.post_write(&sge, &good, 0, 2, SendFlags::SIGNALED)
        .unwrap();
    let x = next(&ccq);
    assert_eq!(
        (x.opcode, x.status, x.wr_id),
        (Opcode::Write, WcStatus::Success, 2)
    );
    let mut got = [0u8; 64];
    unsafe { target.read(0, &mut got) }.unwrap();
    assert_eq!(got, [7; 64]);
}

/// A server process SIGKILLed and started again on the same address while clients reconnect
/// (tests/common/faults.rs).
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn server_restarted_while_clients_reconnect() {
    common::faults::server_restarted_while_clients_reconnect(
        &Net::verbs_from_env(),
        "faults_echo_server_child",
    );
}

/// The server process of `server_restarted_while_clients_reconnect` (does nothing unless that
/// test starts it).
#[test]
#[ignore = "the child process of server_restarted_while_clients_reconnect"]
fn faults_echo_server_child() {
    common::faults::echo_server_child();
}
