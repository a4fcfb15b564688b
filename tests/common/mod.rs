//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdmabridge::{Completion, CompletionQueue, ConnOptions, Connection, Context, CqOptions};

pub mod edge;
pub mod faults;
pub mod onesided;
pub mod suite;

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

/// Open descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Mappings of this process.
pub fn map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

/// Mappings of the library's own shared memory (segments and allocated regions).
pub fn our_map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:rdmabridge"))
        .count()
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
