//! Resource-leak and resource-count tests over shm, alone in their own test binary so no other test opens
//! descriptors or mappings while they count them. They run one after another in one test:
//! the test harness starts a thread for each test as another ends, and a thread that starts
//! between two counts of another test adds its stack to the process's mappings (once, on a
//! loaded machine, a count found two mappings more, none of them the library's).

mod common;

#[test]
fn leak_checks_one_after_another() {
    connect_close_cycles_leak_nothing();
    common::suite::connects_dropped_midway_leak_nothing(&common::Net::Shm);
    common::suite::connects_in_flight_cost_one_descriptor_and_no_thread(&common::Net::Shm);
    expose_and_close_cycles_leak_nothing();
    a_dropped_region_is_unmapped_by_the_peer_while_the_connection_lives();
    large_messages_through_mappings_leak_nothing();
    common::pools::pools_and_their_connections_leave_nothing(&common::Net::Shm);
    #[cfg(feature = "tokio")]
    common::asyncs::futures_dropped_midway_leak_nothing(&common::Net::Shm);
    // The counts above leave out connection segments, which a context keeps after its
    // connections close (at most 64 a side); with every context gone, none is mapped.
    let t = std::time::Instant::now();
    while common::segment_map_count() > 0 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "{} segment mappings with every context gone",
            common::segment_map_count()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

fn connect_close_cycles_leak_nothing() {
    common::suite::connect_close_cycles_leak_nothing(&common::Net::Shm);
}

/// Regions exposed on connections (a mapped region, a read-only one, one dropped before the
/// close, one after) and accessed by the peer (the mapped one also the lock-free way) leave no
/// descriptor or mapping behind once the connections are closed.
fn expose_and_close_cycles_leak_nothing() {
    use common::*;
    use rdmabridge::{Access, ConnOptions, Context, Opcode, SendFlags, Sge, WcStatus};

    let ctx = Context::new().unwrap();
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let cycle = |ctx: &Context| {
        let o = ConnOptions::default();
        let (c, ccq, s, scq) = pair(&Net::Shm, ctx, &o, &o);
        let tmr = ctx.alloc_mr(8192, all | Access::REMOTE_ATOMIC).unwrap();
        let ro = ctx.alloc_mr(4096, Access::REMOTE_READ).unwrap();
        let mut backing = vec![0u8; 4096];
        // SAFETY: `backing` outlives the region (dropped below, before it).
        let cma = unsafe { ctx.register_mr(backing.as_mut_ptr(), 4096, all).unwrap() };
        let r1 = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
        let r2 = c.unpack_remote(&s.pack_region(&ro).unwrap()).unwrap();
        let r3 = c.unpack_remote(&s.pack_region(&cma).unwrap()).unwrap();
        let local = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        let sgl = [Sge {
            mr: &local,
            offset: 0,
            len: 64,
        }];
        // Unsignaled: the second takes the lock-free way, and the region, dropped below
        // while the connection lives, keeps its address range reserved until the close.
        for _ in 0..2 {
            c.post_write(&sgl, &r1, 0, 0, SendFlags(0)).unwrap();
        }
        c.post_write(&sgl, &r1, 0, 1, SendFlags::SIGNALED).unwrap();
        c.post_read(&sgl, &r2, 0, 2, SendFlags::SIGNALED).unwrap();
        c.post_write(&sgl, &r3, 0, 3, SendFlags::SIGNALED).unwrap();
        for _ in 0..3 {
            assert_eq!(next(&ccq).status, WcStatus::Success);
        }
        drop(tmr);
        drop((c, s));
        for cq in [&ccq, &scq] {
            while next(cq).opcode != Opcode::Disconnected {}
        }
        drop((ro, cma));
        drop(backing);
    };
    // What the first cycle makes once and keeps is not a leak.
    cycles_leave_nothing(&Net::Shm, 1, 20, || cycle(&ctx));
}

/// A region its owner drops is unmapped by the peer that mapped it soon after (the owner's
/// withdrawal notice), not only when the connection ends.
fn a_dropped_region_is_unmapped_by_the_peer_while_the_connection_lives() {
    use common::*;
    use rdmabridge::{Access, ConnOptions, Context, SendFlags, Sge, WcStatus};

    let ctx = Context::new().unwrap();
    let o = ConnOptions::default();
    let (c, ccq, s, _scq) = pair(&Net::Shm, &ctx, &o, &o);
    let local = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let sgl = [Sge {
        mr: &local,
        offset: 0,
        len: 64,
    }];
    let before = our_map_count();
    for round in 0..3 {
        let tmr = ctx
            .alloc_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let r = c.unpack_remote(&s.pack_region(&tmr).unwrap()).unwrap();
        c.post_write(&sgl, &r, 0, round, SendFlags::SIGNALED)
            .unwrap();
        assert_eq!(next(&ccq).status, WcStatus::Success);
        assert_eq!(
            our_map_count(),
            before + 2,
            "the owner's mapping and the peer's"
        );
        drop(tmr);
        let t = std::time::Instant::now();
        while our_map_count() != before {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(5),
                "round {round}: the peer still maps the dropped region"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// A large message sent from an allocated region goes through the peer's mapping of the
/// region (one more mapping of it while it lives, gone soon after it is dropped), and cycles
/// of that - the region dropped before the connection closes, or after - leave no descriptor
/// or mapping behind.
fn large_messages_through_mappings_leak_nothing() {
    use common::*;
    use rdmabridge::{Access, ConnOptions, Context, Opcode, SendFlags, WcStatus};

    const SIZE: usize = 1 << 20;
    let ctx = Context::new().unwrap();
    let wait_maps = |want: usize, what: &str| {
        let t = std::time::Instant::now();
        while our_map_count() != want {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(5),
                "{what}: {} mappings of regions, not {want}",
                our_map_count()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    let cycle = |ctx: &Context, drop_first: bool| {
        let dst = ctx.alloc_mr(SIZE, Access::LOCAL_WRITE).unwrap();
        let base = our_map_count();
        let o = ConnOptions::default();
        let (c, ccq, s, scq) = pair(&Net::Shm, ctx, &o, &o);
        let before = our_map_count();
        let src = ctx.alloc_mr(SIZE, Access::LOCAL_WRITE).unwrap();
        unsafe { src.write(0, &pattern(5, SIZE)) }.unwrap();
        s.post_recv(&dst, 0, SIZE, 1).unwrap();
        c.post_send(&src, 0, SIZE, 2, SendFlags::SIGNALED).unwrap();
        for cq in [&scq, &ccq] {
            assert_eq!(next(cq).status, WcStatus::Success);
        }
        let mut got = vec![0u8; SIZE];
        unsafe { dst.read(0, &mut got) }.unwrap();
        assert!(got == pattern(5, SIZE));
        assert_eq!(
            our_map_count(),
            before + 2,
            "the sender's mapping and the peer's"
        );
        if drop_first {
            drop(src);
            wait_maps(before, "the region dropped");
            drop((c, s));
        } else {
            drop((c, s));
            drop(src);
        }
        for cq in [&ccq, &scq] {
            while next(cq).opcode != Opcode::Disconnected {}
        }
        drop((ccq, scq));
        wait_maps(base, "the connection closed");
    };
    cycle(&ctx, true);
    let (fds, maps, ours) = (fd_count(), map_count(), our_map_count());
    for i in 0..20 {
        cycle(&ctx, i % 2 == 0);
    }
    assert_eq!(
        (fd_count(), map_count(), our_map_count()),
        (fds, maps, ours)
    );
}
