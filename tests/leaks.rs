//! Resource-leak test, alone in its own test binary so no other test opens descriptors or
//! mappings while it counts them.

mod common;

use common::*;
use rdmabridge::{Access, ConnOptions, Context, Opcode, SendFlags, WcStatus};

/// 200 connect / transfer / close cycles: descriptors and mappings return to where they were.
#[test]
fn connect_close_cycles_leak_nothing() {
    let ctx = Context::new().unwrap();
    let cycle = |ctx: &Context| {
        let (c, ccq, s, scq) = pair(ctx, &ConnOptions::default(), &ConnOptions::default());
        let mr = ctx.alloc_mr(8192, Access::LOCAL_WRITE).unwrap();
        s.post_recv(&mr, 4096, 4096, 7).unwrap();
        mr.write(0, &pattern(3, 4096)).unwrap();
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
    for _ in 0..50 {
        cycle(&ctx); // warm up glibc's thread-stack cache and malloc arenas
    }
    let (fds, maps, ours) = (fd_count(), map_count(), our_map_count());
    for _ in 0..200 {
        cycle(&ctx);
    }
    assert_eq!(fd_count(), fds, "descriptors leaked");
    assert_eq!(
        our_map_count(),
        ours,
        "shared segments or regions left mapped"
    );
    assert_eq!(map_count(), maps, "mappings leaked");
}
