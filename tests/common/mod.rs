//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdmabridge::{Completion, CompletionQueue, ConnOptions, Connection, Context, CqOptions};

#[cfg(feature = "tokio")]
pub mod asyncs;
pub mod edge;
pub mod faults;
pub mod onesided;
pub mod pools;
pub mod starts;
pub mod suite;

/// The common suite (suite.rs), listed once for both transports: `for_each_suite_test!(m)`
/// hands every name to `m!`, the transport's own macro that makes each a `#[test]` with that
/// transport's attributes (tests/shm.rs, tests/verbs.rs).
#[allow(unused_macros)] // only the transports' test binaries list the suite
macro_rules! for_each_suite_test {
    ($each:ident) => {
        $each!(
            processes_exchange_verified_messages_at_all_sizes,
            connect_to_name_nobody_listens_on_is_refused_at_once,
            connect_to_silent_listener_times_out_within_its_timeout,
            second_listener_on_same_name_is_addr_in_use,
            reject_carries_private_data_both_ways,
            accept_private_data_reaches_the_client,
            oversized_private_data_is_invalid_and_nothing_is_sent,
            peer_killed_mid_stream_is_reported_at_once,
            slow_receiver_holds_sender_back_and_loses_nothing,
            receive_too_small_fails_both_sides_with_length_errors,
            bad_posts_return_clear_errors_and_post_nothing,
            disconnect_flushes_and_reports_on_both_sides,
            connections_ending_every_way_leave_the_next_ones_clean,
            delivered_unsignaled_send_reports_nothing_at_close,
            completion_fd_is_readable_while_a_poll_finds_completions,
            edge_triggered_waiter_never_sleeps_on_a_queued_completion,
            edge_triggered_loops_on_both_sides_never_stall,
            tokio_async_fd_loop_never_sleeps_on_a_queued_completion,
            edge_triggered_listener_takes_a_burst,
            slot_is_free_once_its_completion_is_seen,
            idle_connection_stays_up_and_reports_nothing,
            sleepers_wake_for_late_completions_in_both_progress_modes,
            threads_polling_one_queue_take_each_completion_once,
            threads_posting_on_one_connection_deliver_each_message_once,
            destroying_a_connection_wakes_threads_waiting_on_its_queue,
            c_destroying_a_connection_wakes_a_thread_in_rbr_cq_wait,
            orderly_close_with_receives_posted_is_always_success,
            event_loop_accepts_a_burst_without_losing_a_peer,
            late_receive_send_waits_and_completes,
            waiting_messages_arrive_in_the_receives_post_once_and_in_order,
            a_waiting_message_taken_just_before_a_close_is_a_success_at_the_sender,
            a_sender_closing_on_the_answer_to_its_waiting_message_sees_no_flush,
            unsignaled_sends_never_fill_the_send_queue,
            one_sided_operations_move_verified_data_at_all_sizes,
            fetch_and_add_from_two_connections_sums_exactly,
            compare_and_swap_makes_a_working_lock,
            bad_remote_accesses_fail_with_remote_access_and_touch_nothing,
            raw_remote_built_as_the_guide_says_reaches_the_region,
            one_thread_starts_many_connections_to_one_listener,
            one_thread_starts_many_connections_to_sixteen_listeners,
            failed_starts_arrive_as_records_with_their_reasons,
            dropping_a_connecting_connection_reports_nothing,
        );
    };
}
#[allow(unused_imports)]
pub(crate) use for_each_suite_test;

/// The transport a test runs over.
pub enum Net {
    /// Shared memory.
    Shm,
    /// Verbs, listening on this IP address (an RDMA device's address: soft-RoCE in the VM).
    Verbs(String),
}

impl Net {
    /// Verbs on the address the VM harness exports as RBR_TEST_ADDR.
    pub fn verbs_from_env() -> Net {
        let ip = std::env::var("RBR_TEST_ADDR")
            .expect("RBR_TEST_ADDR is unset: run the verbs tests through scripts/vm-test.sh");
        Net::Verbs(ip)
    }

    /// An address no other test (or test run) uses.
    pub fn addr(&self, tag: &str) -> String {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id() as u64;
        match self {
            Net::Shm => format!("shm://test-{tag}-{pid}-{n}"),
            Net::Verbs(ip) => format!("rdma://{ip}:{}", 20000 + (pid * 97 + n) % 40000),
        }
    }
}

/// A shared-memory address no other test (or test run) uses.
pub fn unique_addr(tag: &str) -> String {
    Net::Shm.addr(tag)
}

/// The next completion, failing the test if none arrives within 10 s.
pub fn next(cq: &CompletionQueue) -> Completion {
    loop {
        if let Some(c) = cq.poll() {
            return c;
        }
        assert!(
            cq.wait(Some(Duration::from_secs(10))).unwrap(),
            "no completion within 10 s"
        );
    }
}

/// A connected pair: the client and its queue, the server and its queue.
pub type Pair = (
    Connection,
    Arc<CompletionQueue>,
    Connection,
    Arc<CompletionQueue>,
);

/// A connected pair in this process: (client, server), each on its own completion queue.
pub fn pair(net: &Net, ctx: &Context, copts: &ConnOptions, sopts: &ConnOptions) -> Pair {
    pair_with(net, ctx, copts, sopts, CqOptions::default())
}

/// As [`pair`], with both completion queues made with `cq_opts`.
pub fn pair_with(
    net: &Net,
    ctx: &Context,
    copts: &ConnOptions,
    sopts: &ConnOptions,
    cq_opts: CqOptions,
) -> Pair {
    pair_between(net, ctx, ctx, copts, sopts, cq_opts)
}

/// As [`pair_with`], the client in context `cctx` and the server in `sctx` (two contexts: as
/// two processes, each side with a library thread of its own).
pub fn pair_between(
    net: &Net,
    cctx: &Context,
    sctx: &Context,
    copts: &ConnOptions,
    sopts: &ConnOptions,
    cq_opts: CqOptions,
) -> Pair {
    let addr = net.addr("pair");
    let l = sctx.listen(&addr, 4).unwrap();
    let ccq = CompletionQueue::with_options(cq_opts).unwrap();
    let scq = CompletionQueue::with_options(cq_opts).unwrap();
    let (client, server) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            l.get_request(Some(Duration::from_secs(10)))
                .unwrap()
                .accept(&scq, sopts)
                .unwrap()
        });
        let c = cctx.connect(&addr, &ccq, copts).unwrap();
        (c, h.join().unwrap())
    });
    (client, ccq, server, scq)
}

/// Message pattern shared with rbr-echo and the C examples.
pub fn pattern(k: u64, size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| (k.wrapping_mul(131) as usize + i * 7 + 1) as u8)
        .collect()
}

/// Raises this process's descriptor limit (soft, up to the hard one) to at least `want`.
pub fn raise_fd_limit(want: u64) {
    // SAFETY: reads and sets this process's own limit through a live local rlimit.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        if r.rlim_cur < want {
            r.rlim_cur = r.rlim_max.min(want);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
        }
        assert!(
            r.rlim_cur >= want,
            "descriptor limit {} < {want}",
            r.rlim_cur
        );
    }
}

/// Open descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// What this process's descriptors are, by kind and sorted: each one's target with the
/// instance numbers dropped ("socket:[123]" and "anon_inode:[eventfd]" read "socket" and
/// "anon_inode:eventfd"), so two counts compare kinds, not inode numbers, and a leak names
/// what stayed open.
pub fn fd_kinds() -> Vec<String> {
    let mut kinds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|target| {
            let t = target.to_string_lossy();
            match t.split_once(":[") {
                Some((kind, rest)) if rest.trim_end_matches(']').parse::<u64>().is_ok() => {
                    kind.to_string()
                }
                Some((kind, rest)) => format!("{kind}:{}", rest.trim_end_matches(']')),
                None => t.into_owned(),
            }
        })
        .collect();
    kinds.sort();
    kinds
}

/// Whether a line of `/proc/self/maps` is a shm connection's segment, which a context keeps
/// after the connection closes, for the next connection between the same two processes, until
/// the context goes: counted apart ([`segment_map_count`]), not as a leak.
fn is_segment(line: &str) -> bool {
    line.contains("memfd:rdmabridge-shm")
}

/// Mappings of this process, but for connection segments.
pub fn map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| !is_segment(l))
        .count()
}

/// Mappings of the library's own shared memory (allocated regions, queues' notice boards), but
/// for connection segments.
pub fn our_map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:rdmabridge") && !is_segment(l))
        .count()
}

/// The inode numbers of the shm connection segments this process maps.
pub fn segment_inodes() -> std::collections::BTreeSet<u64> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| is_segment(l))
        .map(|l| l.split_whitespace().nth(4).unwrap().parse().unwrap())
        .collect()
}

/// Mappings of shm connections' segments, live or kept by their contexts.
pub fn segment_map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| is_segment(l))
        .count()
}

/// What a leak would show in: this process's descriptors, its mappings (all, and those of
/// the library's own segments and regions), and over verbs what the kernel holds for RDMA
/// (see [`rdma_objects`]) and the memory pinned for registrations (`VmPin`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub fds: Vec<String>,
    pub maps: usize,
    pub ours: usize,
    pub rdma: Vec<(String, u64)>,
    pub pinned_kb: u64,
}

impl Held {
    pub fn now(net: &Net) -> Held {
        let verbs = matches!(net, Net::Verbs(_));
        Held {
            fds: fd_kinds(),
            maps: map_count(),
            ours: our_map_count(),
            rdma: if verbs { rdma_objects() } else { Vec::new() },
            pinned_kb: if verbs { pinned_kb() } else { 0 },
        }
    }
}

/// The RDMA objects the kernel tracks on each device, by kind (`rdma resource show`: memory
/// registrations, queue pairs, completion queues, shared receive queues, protection domains,
/// CM ids, device contexts), as `("rxe0 mr", 3)`. Counted over the whole machine: in the VM
/// only the test process uses the device.
pub fn rdma_objects() -> Vec<(String, u64)> {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .expect("the rdma tool (iproute2) counts the kernel's RDMA objects");
    assert!(out.status.success(), "rdma resource show: {out:?}");
    let mut objects = Vec::new();
    // One line per device: "0: rxe0: pd 1 cq 2 qp 1 cm_id 0 mr 0 ctx 1 srq 1".
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let [_, dev, counts @ ..] = &words[..] else {
            continue;
        };
        for kv in counts.chunks(2) {
            if let [kind, n] = kv {
                let n = n
                    .parse()
                    .unwrap_or_else(|_| panic!("rdma resource show: {line}"));
                objects.push((format!("{} {kind}", dev.trim_end_matches(':')), n));
            }
        }
    }
    assert!(!objects.is_empty(), "rdma resource show lists no device");
    objects
}

/// Memory this process has pinned (kB): what its memory registrations hold.
pub fn pinned_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmPin:"))
        .expect("VmPin in /proc/self/status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Runs `cycle` `warm` times (what it makes once and keeps - thread stacks, allocator arenas,
/// a queue's first objects - is not a leak), then `n` times more, after which the process
/// holds what it held before them ([`Held`]). Each count waits (up to 10 s) for the library's
/// thread to finish the teardowns it runs after a drop returned (over verbs, a connection
/// dropped while connecting): the one before the cycles until the count holds still for
/// 200 ms, the one after them until it is back where it was.
pub fn cycles_leave_nothing(net: &Net, warm: usize, n: usize, mut cycle: impl FnMut()) {
    for _ in 0..warm {
        cycle();
    }
    let mut last = None;
    let before = held_once(net, "never settled", |now| {
        last.replace(now.clone()).as_ref() == Some(now)
    });
    for _ in 0..n {
        cycle();
    }
    held_once(net, &format!("leaked (before: {before:?})"), |now| {
        *now == before
    });
}

/// What the process holds once `ok` accepts it, counted every 200 ms; fails with `what` after
/// 10 s.
fn held_once(net: &Net, what: &str, mut ok: impl FnMut(&Held) -> bool) -> Held {
    let t = std::time::Instant::now();
    loop {
        let now = Held::now(net);
        if ok(&now) {
            return now;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{what}: {now:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A seqpacket socket connected to the shm listener at `addr` (`shm://NAME`) that has said
/// nothing yet: a raw peer for tests of the handshake.
pub fn raw_shm_peer(addr: &str) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    let name = addr.strip_prefix("shm://").unwrap();
    // SAFETY: plain libc socket calls on locals; every buffer is live and sized; the new
    // descriptor is owned by the returned OwnedFd only.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut sa: libc::sockaddr_un = std::mem::zeroed();
        sa.sun_family = libc::AF_UNIX as _;
        let path = format!("rdmabridge/{name}");
        for (i, b) in path.bytes().enumerate() {
            sa.sun_path[i + 1] = b as _;
        }
        let len = (2 + 1 + path.len()) as libc::socklen_t;
        assert_eq!(libc::connect(fd, (&raw const sa).cast(), len), 0);
        owned
    }
}

/// Where cargo put the example binaries: `examples/` next to this test's `deps/` (a plain
/// `cargo test` builds them; with `--test examples` alone, build them first: `--examples`).
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps")
        .join("examples")
        .join(name)
}
