//! Connections cost no threads: 1,024 shm connections between two contexts in one process run
//! on the same library threads as 16 do, and carry traffic, in both progress modes; the same
//! over verbs (ignored on a machine without RDMA: it runs on soft-RoCE in the VM suite), where
//! all the connections of a queue also share one device CQ. Alone in its own test binary, so no
//! other test starts threads while it counts them.

mod common;

use std::time::Duration;

use common::*;
use rdmabridge::{
    CompletionQueue, ConnOptions, Connection, Context, CqOptions, Opcode, Progress, SendFlags,
    WcStatus,
};

/// Threads of this process right now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Threads of this process once those that were joined are gone (a joined thread may still be
/// listed for a moment, more so on a loaded machine): waits up to 5 s for at most `expect`.
fn threads_settled(expect: usize) -> usize {
    let t = std::time::Instant::now();
    loop {
        let n = threads();
        if n <= expect || t.elapsed() > Duration::from_secs(5) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Opens connections until `pairs` holds `upto` of them: (client in `cctx`, server in `sctx`).
fn open(
    pairs: &mut Vec<(Connection, Connection)>,
    upto: usize,
    (cctx, ccq): (&Context, &std::sync::Arc<CompletionQueue>),
    (l, scq): (&rdmabridge::Listener, &std::sync::Arc<CompletionQueue>),
    addr: &str,
) {
    open_with(
        pairs,
        upto,
        (cctx, ccq),
        (l, scq),
        addr,
        &ConnOptions::default(),
    );
}

fn open_with(
    pairs: &mut Vec<(Connection, Connection)>,
    upto: usize,
    (cctx, ccq): (&Context, &std::sync::Arc<CompletionQueue>),
    (l, scq): (&rdmabridge::Listener, &std::sync::Arc<CompletionQueue>),
    addr: &str,
    opts: &ConnOptions,
) {
    let n = upto - pairs.len();
    std::thread::scope(|s| {
        let acceptor = s.spawn(|| {
            (0..n)
                .map(|_| {
                    l.get_request(Some(Duration::from_secs(30)))
                        .unwrap()
                        .accept(scq, opts)
                        .unwrap()
                })
                .collect::<Vec<_>>()
        });
        let clients: Vec<_> = (0..n)
            .map(|_| cctx.connect(addr, ccq, opts).unwrap())
            .collect();
        // The acceptor takes the requests in the order the clients made them.
        pairs.extend(clients.into_iter().zip(acceptor.join().unwrap()));
    });
}

/// One message each way on `(c, s)`, checked on both sides.
fn exchange(
    (c, s): &(Connection, Connection),
    (cctx, ccq): (&Context, &CompletionQueue),
    (sctx, scq): (&Context, &CompletionQueue),
    k: u64,
) {
    for (from, from_cq, to, to_ctx, to_cq, word) in
        [(c, ccq, s, sctx, scq, k), (s, scq, c, cctx, ccq, !k)]
    {
        let mr = to_ctx
            .alloc_mr(64, rdmabridge::Access::LOCAL_WRITE)
            .unwrap();
        to.post_recv(&mr, 0, 64, k).unwrap();
        from.post_send_inline(&word.to_le_bytes(), k, SendFlags::SIGNALED)
            .unwrap();
        let r = next(to_cq);
        assert_eq!(
            (r.conn_id, r.opcode, r.status, r.wr_id, r.byte_len),
            (to.id(), Opcode::Recv, WcStatus::Success, k, 8)
        );
        let mut got = [0u8; 8];
        unsafe { mr.read(0, &mut got) }.unwrap();
        assert_eq!(u64::from_le_bytes(got), word, "pair {k}");
        let sc = next(from_cq);
        assert_eq!(
            (sc.conn_id, sc.opcode, sc.status, sc.wr_id),
            (from.id(), Opcode::Send, WcStatus::Success, k)
        );
    }
}

#[test]
fn a_thousand_connections_cost_no_more_threads_than_sixteen() {
    const FEW: usize = 16;
    const MANY: usize = 1024;
    raise_fd_limit(8192);
    for progress in [Progress::Caller, Progress::Thread] {
        let before = threads();
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
        let ccq = CompletionQueue::with_options(cq_opts).unwrap();
        let scq = CompletionQueue::with_options(cq_opts).unwrap();
        let addr = unique_addr("scale");
        let l = sctx.listen(&addr, MANY as u32).unwrap();
        let mut pairs = Vec::new();
        open(&mut pairs, FEW, (&cctx, &ccq), (&l, &scq), &addr);
        // Settled: the acceptor thread `open` joined may still be listed for a moment.
        let (few_threads, few_fds) = (threads_settled(before + 2), fd_count());
        open(&mut pairs, MANY, (&cctx, &ccq), (&l, &scq), &addr);
        let (many_threads, many_fds) = (threads_settled(few_threads), fd_count());
        eprintln!(
            "{progress:?}: {FEW} connections: {few_threads} threads, {few_fds} fds; \
             {MANY}: {many_threads} threads, {many_fds} fds (before: {before} threads)"
        );
        assert_eq!(
            many_threads, few_threads,
            "{progress:?}: threads grew with the connections"
        );
        assert!(
            few_threads <= before + 4,
            "{progress:?}: {} library threads for two contexts",
            few_threads - before
        );
        // Traffic flows on a sample spread over all of them, each way, with the rest idle.
        for (k, p) in pairs
            .iter()
            .enumerate()
            .step_by(61)
            .chain([(MANY - 1, &pairs[MANY - 1])])
        {
            exchange(p, (&cctx, &ccq), (&sctx, &scq), k as u64);
        }
        assert!(ccq.poll().is_none() && scq.poll().is_none());
        // Every connection ends with its disconnect record, queued when its drop returns.
        drop(pairs);
        for cq in [&ccq, &scq] {
            let mut n = 0;
            while let Some(c) = cq.poll() {
                assert_eq!(
                    (c.opcode, c.status),
                    (Opcode::Disconnected, WcStatus::Success)
                );
                n += 1;
            }
            assert_eq!(n, MANY, "{progress:?}: disconnect records");
        }
    }
}

/// Over verbs: 16 and then many connections between two contexts run on the contexts' driver
/// threads alone (counted in /proc/self/task), in both progress modes; every connection
/// carries a verified message each way, all on one completion queue per side (one device CQ);
/// then each is torn down with a receive still posted on both sides, which completes as
/// flushed, and its disconnect record comes last. `RBR_SCALE_CONNS` sets how many (default
/// 1,024; soft-RoCE's device CQ holds 32,767 entries, so the queue depths are 4).
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn verbs_connections_share_the_driver_and_one_device_cq() {
    const FEW: usize = 16;
    let many: usize = std::env::var("RBR_SCALE_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let net = Net::verbs_from_env();
    raise_fd_limit(4096);
    let opts = ConnOptions {
        send_queue_depth: 4,
        recv_queue_depth: 4,
        ..Default::default()
    };
    for progress in [Progress::Caller, Progress::Thread] {
        let t0 = std::time::Instant::now();
        let before = threads();
        let cq_opts = CqOptions {
            progress,
            ..Default::default()
        };
        let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
        let ccq = CompletionQueue::with_options(cq_opts).unwrap();
        let scq = CompletionQueue::with_options(cq_opts).unwrap();
        let addr = net.addr("scale");
        let l = sctx.listen(&addr, 1024).unwrap();
        let mut pairs = Vec::new();
        open_with(&mut pairs, FEW, (&cctx, &ccq), (&l, &scq), &addr, &opts);
        let (few_threads, few_fds) = (threads_settled(before + 2), fd_count());
        open_with(&mut pairs, many, (&cctx, &ccq), (&l, &scq), &addr, &opts);
        let (many_threads, many_fds) = (threads_settled(few_threads), fd_count());
        eprintln!(
            "verbs {progress:?}: {FEW} connections: {few_threads} threads, {few_fds} fds; \
             {many}: {many_threads} threads, {many_fds} fds (before: {before} threads); \
             set up in {:?}",
            t0.elapsed()
        );
        assert_eq!(
            many_threads, few_threads,
            "{progress:?}: threads grew with the connections"
        );
        assert!(
            few_threads <= before + 2,
            "{progress:?}: {} library threads for two contexts",
            few_threads - before
        );
        for (k, p) in pairs.iter().enumerate() {
            exchange(p, (&cctx, &ccq), (&sctx, &scq), k as u64);
        }
        assert!(ccq.poll().is_none() && scq.poll().is_none());
        // A receive left posted on each side of every connection: flushed at the end.
        let (cmr, smr) = (
            cctx.alloc_mr(64, rdmabridge::Access::LOCAL_WRITE).unwrap(),
            sctx.alloc_mr(64, rdmabridge::Access::LOCAL_WRITE).unwrap(),
        );
        for (c, s) in &pairs {
            c.post_recv(&cmr, 0, 64, 7).unwrap();
            s.post_recv(&smr, 0, 64, 7).unwrap();
        }
        let ids: Vec<(u64, u64)> = pairs.iter().map(|(c, s)| (c.id(), s.id())).collect();
        let t1 = std::time::Instant::now();
        drop(pairs);
        eprintln!("verbs {progress:?}: {many} torn down in {:?}", t1.elapsed());
        for (side, cq) in [(0, &ccq), (1, &scq)] {
            let mut seen = std::collections::HashMap::<u64, (bool, bool)>::new();
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while seen.values().filter(|v| v.1).count() < many {
                let Some(c) = cq.poll() else {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{progress:?}: disconnect records missing"
                    );
                    cq.wait(Some(Duration::from_millis(100))).unwrap();
                    continue;
                };
                let e = seen.entry(c.conn_id).or_default();
                assert!(!e.1, "{progress:?}: a record after the disconnect: {c:?}");
                match c.opcode {
                    Opcode::Recv => {
                        assert_eq!((c.status, c.wr_id), (WcStatus::Flushed, 7), "{c:?}");
                        assert!(!e.0, "{progress:?}: two flushed receives: {c:?}");
                        e.0 = true;
                    }
                    Opcode::Disconnected => {
                        assert_eq!(c.status, WcStatus::Success, "{c:?}");
                        assert!(e.0, "{progress:?}: the disconnect before the flush: {c:?}");
                        e.1 = true;
                    }
                    _ => panic!("{progress:?}: unexpected {c:?}"),
                }
            }
            for &(cid, sid) in &ids {
                let id = if side == 0 { cid } else { sid };
                assert_eq!(seen.get(&id), Some(&(true, true)), "connection {id}");
            }
            assert!(cq.poll().is_none());
        }
        drop((l, cmr, smr, cctx, sctx));
        // A context's driver thread is joined when the context goes, unless the last reference
        // went on that thread itself (a connection's teardown there), which then ends by
        // itself after its round: give it that long.
        assert_eq!(
            threads_settled(before),
            before,
            "{progress:?}: library threads left behind"
        );
    }
}

/// Over verbs at the default queue depths (128/128): more connections on one completion queue
/// than one device CQ holds on soft-RoCE (about 118), so the queue spreads them over several;
/// every one carries a verified message each way, and each reports its disconnect.
#[test]
#[ignore = "needs an RDMA device: runs on soft-RoCE via scripts/vm-test.sh"]
fn verbs_queue_takes_more_connections_than_one_device_cq_holds() {
    const CONNS: usize = 300;
    let net = Net::verbs_from_env();
    raise_fd_limit(4096);
    let opts = ConnOptions::default();
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let (ccq, scq) = (
        CompletionQueue::new().unwrap(),
        CompletionQueue::new().unwrap(),
    );
    let addr = net.addr("spill");
    let l = sctx.listen(&addr, 1024).unwrap();
    let mut pairs = Vec::new();
    open_with(&mut pairs, CONNS, (&cctx, &ccq), (&l, &scq), &addr, &opts);
    for (k, p) in pairs.iter().enumerate() {
        exchange(p, (&cctx, &ccq), (&sctx, &scq), k as u64);
    }
    let ids: Vec<u64> = pairs.iter().map(|(c, _)| c.id()).collect();
    drop(pairs);
    let mut gone = std::collections::HashSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while gone.len() < CONNS {
        match ccq.poll() {
            Some(c) => {
                assert_eq!(
                    (c.opcode, c.status),
                    (Opcode::Disconnected, WcStatus::Success)
                );
                assert!(gone.insert(c.conn_id), "two disconnects: {c:?}");
            }
            None => {
                assert!(std::time::Instant::now() < deadline, "disconnects missing");
                ccq.wait(Some(Duration::from_millis(100))).unwrap();
            }
        }
    }
    assert!(ids.iter().all(|id| gone.contains(id)));
}
