//! The shm busy path allocates nothing: with caller progress, posting sends (from a memory
//! region and inline), receives and one-sided writes (unsignaled, and every 16th signaled) and
//! polling the completion queues for the completions makes no heap allocation per message once the connection is warm, through the Rust API and
//! through the C surface. Alone in its own test binary, because it counts through the
//! process's global allocator.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::backtrace::Backtrace;
use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::Net;
use rdmabridge::ffi::conn::*;
use rdmabridge::ffi::cq::*;
use rdmabridge::ffi::ctx::*;
use rdmabridge::ffi::error::*;
use rdmabridge::ffi::listener::*;
use rdmabridge::ffi::mr::*;
use rdmabridge::{
    Access, Completion, CompletionQueue, ConnOptions, Context, CqOptions, Opcode, Progress,
    SendFlags, Sge, WcStatus,
};

/// Counts allocations (including zeroed ones and reallocations) while armed: those of the
/// thread that drives the busy path, and, separately, those of every other thread (the
/// library's own connection threads, and other tests setting up). Captures a backtrace of the
/// first one on the driving thread.
struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static ON_DRIVER: AtomicU64 = AtomicU64::new(0);
static ELSEWHERE: AtomicU64 = AtomicU64::new(0);
static FIRST_SITE: Mutex<Option<Backtrace>> = Mutex::new(None);

thread_local! {
    /// This thread drives the busy path.
    static DRIVER: Cell<bool> = const { Cell::new(false) };
    /// This thread is inside the counter already (capturing a backtrace allocates).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

impl Counting {
    fn note(&self) {
        // Relaxed: a flag the driving thread sets and clears itself; other threads' counts are
        // only reported, so seeing the flag late or early makes no difference to the assertion.
        if !ARMED.load(Ordering::Relaxed) {
            return;
        }
        // `try_with`: thread-locals may be gone while a thread exits.
        let driver = DRIVER.try_with(Cell::get).unwrap_or(false);
        if !driver {
            ELSEWHERE.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if INSIDE.try_with(|i| i.replace(true)).unwrap_or(true) {
            return;
        }
        if ON_DRIVER.fetch_add(1, Ordering::Relaxed) == 0 {
            let bt = Backtrace::force_capture();
            *FIRST_SITE.lock().unwrap_or_else(|p| p.into_inner()) = Some(bt);
        }
        let _ = INSIDE.try_with(|i| i.set(false));
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counting around it
// touches only atomics, const-initialised thread-locals and (on the first counted allocation
// only, guarded against re-entry) a mutex and a backtrace.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One measurement at a time (the counters are shared).
static MEASURING: Mutex<()> = Mutex::new(());

/// What [`count_allocations`] saw.
struct Counts {
    on_driver: u64,
    elsewhere: u64,
}

/// Runs `round_trip(i)` WARMUP times, then ROUND_TRIPS times counting allocations; prints the
/// counts and the first allocation site on the calling thread, if any. `round_trip` returns
/// the completions it took, which are summed and checked against the messages sent.
fn count_allocations(mut round_trip: impl FnMut(u64) -> u64) -> Counts {
    let _one = MEASURING.lock().unwrap_or_else(|p| p.into_inner());
    ON_DRIVER.store(0, Ordering::Relaxed);
    ELSEWHERE.store(0, Ordering::Relaxed);
    *FIRST_SITE.lock().unwrap_or_else(|p| p.into_inner()) = None;
    DRIVER.with(|d| d.set(true));
    for i in 0..WARMUP {
        round_trip(i);
    }
    ARMED.store(true, Ordering::Relaxed);
    let mut completions = 0;
    for i in 0..ROUND_TRIPS {
        completions += round_trip(WARMUP + i);
    }
    ARMED.store(false, Ordering::Relaxed);
    DRIVER.with(|d| d.set(false));

    let counts = Counts {
        on_driver: ON_DRIVER.load(Ordering::Relaxed),
        elsewhere: ELSEWHERE.load(Ordering::Relaxed),
    };
    let messages = 2 * ROUND_TRIPS;
    eprintln!(
        "{messages} messages, {completions} completions taken: {} allocations on the posting \
         and polling thread, {} on the process's other threads meanwhile (the library's, and \
         other tests' set-up)",
        counts.on_driver, counts.elsewhere
    );
    if let Some(bt) = FIRST_SITE.lock().unwrap_or_else(|p| p.into_inner()).take() {
        eprintln!("first allocation on the busy path:\n{bt}");
    }
    // Every message's send and receive completion was taken (a few send completions of the
    // last round trips may still be on their way).
    assert!(
        completions >= 2 * messages - 4,
        "{completions} completions for {messages} messages"
    );
    counts
}

const SIZE: usize = 64;
const WARMUP: u64 = 1_000;
const ROUND_TRIPS: u64 = 10_000;
/// Completions taken per poll, as a C caller's array of records would hold.
const BATCH: usize = 16;

/// Polls `cq` (busily, as a polling program does) until a receive completes; returns the
/// number of completions taken. Fails the test on anything but success.
fn poll_until_recv(cq: &CompletionQueue, batch: &mut [Option<Completion>; BATCH]) -> u64 {
    let mut taken = 0;
    let mut spins = 0u64;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut n = 0;
        cq.poll_with(BATCH, &mut |c| {
            batch[n] = Some(c);
            n += 1;
        });
        let mut got_recv = false;
        for c in batch[..n].iter().flatten() {
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            got_recv |= c.opcode == Opcode::Recv;
        }
        taken += n as u64;
        if got_recv {
            return taken;
        }
        // The clock only now and then, as a polling program reads it.
        spins += 1;
        assert!(
            spins % 4096 != 0 || Instant::now() < deadline,
            "no receive completion within 10 s"
        );
    }
}

#[test]
fn shm_busy_path_makes_no_allocation_per_message() {
    let ctx = Context::new().unwrap();
    let opts = ConnOptions {
        send_queue_depth: 16,
        recv_queue_depth: 16,
        ..ConnOptions::default()
    };
    let cq_opts = CqOptions {
        progress: Progress::Caller,
        ..CqOptions::default()
    };
    let (client, ccq, server, scq) = common::pair_with(&Net::Shm, &ctx, &opts, &opts, cq_opts);
    let cmr = ctx.alloc_mr(SIZE, Access::LOCAL_WRITE).unwrap();
    let smr = ctx.alloc_mr(SIZE, Access::LOCAL_WRITE).unwrap();
    // The server's region the client writes into.
    let target = ctx
        .alloc_mr(SIZE, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let remote = client
        .unpack_remote(&server.pack_region(&target).unwrap())
        .unwrap();
    let write = [Sge {
        mr: &cmr,
        offset: 0,
        len: 8,
    }];
    let inline = [7u8; SIZE];
    let mut batch = [None; BATCH];
    for _ in 0..4 {
        client.post_recv(&cmr, 0, SIZE, 1).unwrap();
        server.post_recv(&smr, 0, SIZE, 2).unwrap();
    }

    // One round trip: the client writes 8 bytes into the server's region (unsignaled, every
    // 16th signaled) and sends from its region, the server takes it, posts a new receive and
    // answers inline, the client takes the answer and posts a new receive. Every send is
    // signaled, so each side also reaps a send completion per round trip.
    let mut round_trip = |i: u64| -> u64 {
        let flags = if i % 16 == 0 {
            SendFlags::SIGNALED
        } else {
            SendFlags(0)
        };
        client.post_write(&write, &remote, 0, i, flags).unwrap();
        client
            .post_send(&cmr, 0, SIZE, i, SendFlags::SIGNALED)
            .unwrap();
        let mut taken = poll_until_recv(&scq, &mut batch);
        server.post_recv(&smr, 0, SIZE, 2).unwrap();
        server
            .post_send_inline(&inline, i, SendFlags::SIGNALED)
            .unwrap();
        taken += poll_until_recv(&ccq, &mut batch);
        client.post_recv(&cmr, 0, SIZE, 1).unwrap();
        taken
    };

    let counts = count_allocations(&mut round_trip);
    assert_eq!(
        counts.on_driver,
        0,
        "the busy path allocated {} times in {} messages; first site above",
        counts.on_driver,
        2 * ROUND_TRIPS
    );
}

/// Polls `cq` through the C surface until a receive completes; returns the completions taken.
///
/// # Safety
/// `cq` is a live queue.
unsafe fn c_poll_until_recv(cq: *mut rbr_cq, wc: &mut [rbr_completion; BATCH]) -> u64 {
    let mut taken = 0;
    let mut spins = 0u64;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut n = 0;
        // SAFETY: `cq` is live (caller contract) and `wc` holds BATCH records.
        let st = unsafe { rbr_cq_poll(cq, wc.as_mut_ptr(), BATCH, &mut n) };
        assert!(st == RBR_OK || st == RBR_EMPTY, "rbr_cq_poll: {st}");
        let mut got_recv = false;
        for c in &wc[..n] {
            assert_eq!(c.status, RBR_WC_SUCCESS, "opcode {}", c.opcode);
            got_recv |= c.opcode == RBR_OP_RECV;
        }
        taken += n as u64;
        if got_recv {
            return taken;
        }
        spins += 1;
        assert!(
            spins % 4096 != 0 || Instant::now() < deadline,
            "no receive completion within 10 s"
        );
    }
}

#[test]
fn shm_busy_path_through_the_c_surface_makes_no_allocation_per_message() {
    // SAFETY: every pointer passed is a live handle made here or a live local: the accepting
    // thread is joined and the round-trip closure last called before anything is destroyed;
    // each handle is destroyed once, connections before what they use.
    unsafe {
        let mut ctx = std::ptr::null_mut();
        assert_eq!(rbr_ctx_create(&mut ctx), RBR_OK);
        let mut cq_opts = std::mem::zeroed();
        rbr_cq_options_init(&mut cq_opts);
        cq_opts.progress = RBR_PROGRESS_CALLER;
        let (mut scq, mut ccq) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(rbr_cq_create_ex(&cq_opts, &mut scq), RBR_OK);
        assert_eq!(rbr_cq_create_ex(&cq_opts, &mut ccq), RBR_OK);
        let mut opts = std::mem::zeroed();
        rbr_conn_options_init(&mut opts);
        opts.send_queue_depth = 16;
        opts.recv_queue_depth = 16;
        let addr = std::ffi::CString::new(Net::Shm.addr("alloc-c")).unwrap();
        let mut l = std::ptr::null_mut();
        assert_eq!(rbr_listen(ctx, addr.as_ptr(), 4, &mut l), RBR_OK);
        // Handles cross to the accepting thread as addresses (raw pointers are not Send).
        let (l_u, scq_u, opts_u) = (l as usize, scq as usize, &raw const opts as usize);
        let accept = std::thread::spawn(move || {
            let mut r = std::ptr::null_mut();
            let mut conn = std::ptr::null_mut();
            assert_eq!(
                rbr_listener_get_request(l_u as *mut rbr_listener, 10_000, &mut r),
                RBR_OK
            );
            assert_eq!(
                rbr_request_accept(
                    r,
                    scq_u as *mut rbr_cq,
                    opts_u as *const rbr_conn_options,
                    &mut conn
                ),
                RBR_OK
            );
            rbr_request_destroy(r);
            conn as usize
        });
        let mut client = std::ptr::null_mut();
        assert_eq!(
            rbr_connect(ctx, addr.as_ptr(), ccq, &opts, &mut client),
            RBR_OK
        );
        let server = accept.join().unwrap() as *mut rbr_conn;
        let (mut cmr, mut smr) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(
            rbr_mr_alloc(ctx, SIZE, RBR_ACCESS_LOCAL_WRITE, &mut cmr),
            RBR_OK
        );
        assert_eq!(
            rbr_mr_alloc(ctx, SIZE, RBR_ACCESS_LOCAL_WRITE, &mut smr),
            RBR_OK
        );
        for _ in 0..4 {
            assert_eq!(rbr_conn_post_recv(client, cmr, 0, SIZE, 1), RBR_OK);
            assert_eq!(rbr_conn_post_recv(server, smr, 0, SIZE, 2), RBR_OK);
        }
        let inline = [7u8; SIZE];
        let mut wc = [std::mem::zeroed::<rbr_completion>(); BATCH];

        // The round trip of the Rust test above, through the C functions.
        let mut round_trip = |i: u64| -> u64 {
            assert_eq!(
                rbr_conn_post_send(client, cmr, 0, SIZE, i, RBR_SEND_SIGNALED),
                RBR_OK
            );
            let mut taken = c_poll_until_recv(scq, &mut wc);
            assert_eq!(rbr_conn_post_recv(server, smr, 0, SIZE, 2), RBR_OK);
            assert_eq!(
                rbr_conn_post_send_inline(
                    server,
                    inline.as_ptr().cast(),
                    SIZE,
                    i,
                    RBR_SEND_SIGNALED
                ),
                RBR_OK
            );
            taken += c_poll_until_recv(ccq, &mut wc);
            assert_eq!(rbr_conn_post_recv(client, cmr, 0, SIZE, 1), RBR_OK);
            taken
        };
        let counts = count_allocations(&mut round_trip);

        rbr_conn_destroy(client);
        rbr_conn_destroy(server);
        rbr_mr_destroy(cmr);
        rbr_mr_destroy(smr);
        rbr_listener_destroy(l);
        rbr_cq_destroy(scq);
        rbr_cq_destroy(ccq);
        rbr_ctx_destroy(ctx);
        assert_eq!(
            counts.on_driver,
            0,
            "the busy path allocated {} times in {} messages; first site above",
            counts.on_driver,
            2 * ROUND_TRIPS
        );
    }
}
