//! One-sided operations (RDMA write, write with immediate, read, atomics), the same over both
//! transports: run from tests/shm.rs and tests/verbs.rs through the suite.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use rdmabridge::{
    Access, Completion, CompletionQueue, ConnOptions, Connection, Context, Error, MemoryRegion,
    Opcode, RemoteRegion, SendFlags, Sge, WcStatus,
};

const SIG: SendFlags = SendFlags::SIGNALED;

/// The next completion, which must be a success of `op` with `wr_id`.
fn expect_ok(cq: &CompletionQueue, op: Opcode, wr_id: u64) -> Completion {
    let c = next(cq);
    assert_eq!(
        (c.opcode, c.status, c.wr_id),
        (op, WcStatus::Success, wr_id),
        "{c:?}"
    );
    c
}

/// Sends `desc` from `from` to `to` in a message and returns what `to` received.
fn hand_over(
    ctx: &Context,
    from: &Connection,
    from_cq: &CompletionQueue,
    to: &Connection,
    to_cq: &CompletionQueue,
    desc: &[u8],
) -> Vec<u8> {
    let buf = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    to.post_recv(&buf, 0, 64, 900).unwrap();
    from.post_send_inline(desc, 901, SIG).unwrap();
    expect_ok(from_cq, Opcode::Send, 901);
    let c = expect_ok(to_cq, Opcode::Recv, 900);
    let mut got = vec![0u8; c.byte_len as usize];
    unsafe { buf.read(0, &mut got) }.unwrap();
    got
}

/// The server's region `target`, unpacked on the client after a real exchange of descriptors.
fn remote_of(
    ctx: &Context,
    client: &Connection,
    ccq: &CompletionQueue,
    server: &Connection,
    scq: &CompletionQueue,
    target: &Arc<MemoryRegion>,
) -> RemoteRegion {
    let desc = server.pack_region(target).unwrap();
    let got = hand_over(ctx, server, scq, client, ccq, &desc);
    let r = client.unpack_remote(&got).unwrap();
    assert_eq!(
        (r.addr(), r.len()),
        (target.as_ptr() as u64, target.len() as u64)
    );
    r
}

/// Splits `0..len` of `mr` (from `base`) into three segments (fewer when shorter).
fn thirds(mr: &Arc<MemoryRegion>, base: usize, len: usize) -> Vec<Sge<'_>> {
    let cuts = [0, len / 3, 2 * len / 3, len];
    cuts.windows(2)
        .filter(|w| w[1] > w[0] || len == 0)
        .take(if len == 0 { 1 } else { 3 })
        .map(|w| Sge {
            mr,
            offset: base + w[0],
            len: w[1] - w[0],
        })
        .collect()
}

fn bytes(mr: &MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    unsafe { mr.read(offset, &mut v) }.unwrap();
    v
}

fn checksum(mr: &MemoryRegion) -> u64 {
    bytes(mr, 0, mr.len())
        .iter()
        .enumerate()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, (i, &b)| {
            (h ^ (b as u64 + i as u64)).wrapping_mul(0x100_0000_01b3)
        })
}

/// Write, read and write-with-immediate move verified data at 1 B..64 MiB, gathered from and
/// scattered into three local segments, into a library-allocated target region and into
/// caller memory; the immediate value and the length written arrive with the target's
/// receive, whose buffer stays untouched. Bad posts fail at once and post nothing.
pub fn one_sided_operations_move_verified_data_at_all_sizes(net: &Net) {
    let ctx = Context::new().unwrap();
    let (client, ccq, server, scq) =
        pair(net, &ctx, &ConnOptions::default(), &ConnOptions::default());
    let max = 64usize << 20;
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let target = ctx.alloc_mr(max + 64, rw).unwrap();
    let local = ctx.alloc_mr(max + 64, Access::LOCAL_WRITE).unwrap();
    let remote = remote_of(&ctx, &client, &ccq, &server, &scq, &target);
    let recv_buf = ctx.alloc_mr(16, Access::LOCAL_WRITE).unwrap();
    unsafe { recv_buf.write(0, &[0xee; 16]) }.unwrap();
    let mut wr = 0;
    // 12 and 24 B: segments of 4 and 8 B, which shm copies as single words.
    for size in [1usize, 7, 12, 24, 4096, 65536 + 5, 1 << 20, max] {
        // Unaligned on both ends, except at the largest size.
        let (loff, roff) = if size == max { (0, 0) } else { (3, 61) };
        let data = pattern(size as u64, size);
        unsafe { local.write(loff, &data) }.unwrap();
        wr += 1;
        client
            .post_write(&thirds(&local, loff, size), &remote, roff as u64, wr, SIG)
            .unwrap();
        expect_ok(&ccq, Opcode::Write, wr);
        assert!(bytes(&target, roff, size) == data, "write of {size} B");

        unsafe { local.write(loff, &vec![0u8; size]) }.unwrap();
        wr += 1;
        client
            .post_read(&thirds(&local, loff, size), &remote, roff as u64, wr, SIG)
            .unwrap();
        expect_ok(&ccq, Opcode::Read, wr);
        assert!(bytes(&local, loff, size) == data, "read of {size} B");

        let data2 = pattern(size as u64 + 1000, size);
        unsafe { local.write(loff, &data2) }.unwrap();
        server.post_recv(&recv_buf, 0, 16, 5000 + wr).unwrap();
        wr += 1;
        let imm = 0xabc0_0000 | size as u32 & 0xffff;
        client
            .post_write_imm(
                &thirds(&local, loff, size),
                &remote,
                roff as u64,
                imm,
                wr,
                SIG,
            )
            .unwrap();
        expect_ok(&ccq, Opcode::Write, wr);
        let c = expect_ok(&scq, Opcode::RecvWriteImm, 5000 + wr - 1);
        assert_eq!((c.imm, c.byte_len), (Some(imm), size as u32));
        assert!(bytes(&target, roff, size) == data2, "write-imm of {size} B");
        assert_eq!(bytes(&recv_buf, 0, 16), vec![0xee; 16]);
    }
    // A zero-length write with immediate: a pure signal.
    server.post_recv(&recv_buf, 0, 16, 7000).unwrap();
    client
        .post_write_imm(&[], &remote, 0, 42, 7001, SIG)
        .unwrap();
    expect_ok(&ccq, Opcode::Write, 7001);
    let c = expect_ok(&scq, Opcode::RecvWriteImm, 7000);
    assert_eq!((c.imm, c.byte_len), (Some(42), 0));

    // Caller memory as the target, and a single segment.
    let mut caller = vec![0u8; 1 << 20];
    // SAFETY: `caller` outlives the region (dropped at the end of the function, after it) and
    // the operations on it have completed before it is read.
    let creg = unsafe { ctx.register_mr(caller.as_mut_ptr(), caller.len(), rw) }.unwrap();
    let cremote = remote_of(&ctx, &client, &ccq, &server, &scq, &creg);
    for size in [1usize, 4096, 1 << 20] {
        let data = pattern(size as u64 + 7, size);
        unsafe { local.write(0, &data) }.unwrap();
        let seg = [Sge {
            mr: &local,
            offset: 0,
            len: size,
        }];
        wr += 1;
        client.post_write(&seg, &cremote, 0, wr, SIG).unwrap();
        expect_ok(&ccq, Opcode::Write, wr);
        assert!(
            bytes(&creg, 0, size) == data,
            "write of {size} B into caller memory"
        );
        unsafe { local.write(0, &vec![0u8; size]) }.unwrap();
        wr += 1;
        client.post_read(&seg, &cremote, 0, wr, SIG).unwrap();
        expect_ok(&ccq, Opcode::Read, wr);
        assert!(
            bytes(&local, 0, size) == data,
            "read of {size} B from caller memory"
        );
    }

    // Bad posts: a clear error at once, nothing posted (the next operation still works).
    let ro = ctx.alloc_mr(64, Access(0)).unwrap();
    let one = |mr| {
        [Sge {
            mr,
            offset: 0,
            len: 8,
        }]
    };
    assert!(matches!(
        client.post_read(&one(&ro), &remote, 0, 1, SIG),
        Err(Error::Access(_))
    ));
    let five: Vec<Sge> = (0..5)
        .map(|_| Sge {
            mr: &local,
            offset: 0,
            len: 1,
        })
        .collect();
    assert!(matches!(
        client.post_write(&five, &remote, 0, 1, SIG),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        client.post_write(
            &[Sge {
                mr: &local,
                offset: max,
                len: 128
            }],
            &remote,
            0,
            1,
            SIG
        ),
        Err(Error::Range { .. })
    ));
    assert!(matches!(
        client.post_fetch_add(&local, 4, &remote, 0, 1, 1, SIG),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        client.post_fetch_add(&local, 0, &remote, 4, 1, 1, SIG),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        client.post_write(&one(&local), &remote, u64::MAX - 4, 1, SIG),
        Err(Error::InvalidArgument(_))
    ));
    // A region unpacked on one connection (here the server's own) is refused on another.
    let theirs = server
        .unpack_remote(&server.pack_region(&target).unwrap())
        .unwrap();
    assert!(matches!(
        client.post_write(&one(&local), &theirs, 0, 1, SIG),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        client.unpack_remote(&[0u8; 32]),
        Err(Error::InvalidArgument(_))
    ));
    wr += 1;
    unsafe { local.write(0, b"still up") }.unwrap();
    client
        .post_write(&one(&local), &remote, 0, wr, SIG)
        .unwrap();
    expect_ok(&ccq, Opcode::Write, wr);
    assert_eq!(bytes(&target, 0, 8), b"still up");
    assert!(ccq.poll().is_none() && scq.poll().is_none());
    drop((client, server, creg));
    drop(caller);
}

/// Two connections each run `per` fetch-and-adds of 1 on one word of the server's, `window`
/// at a time: the word ends at exactly 2 x `per`, and the values fetched are each value from
/// 0 to 2 x `per` - 1 exactly once.
pub fn fetch_and_add_from_two_connections_sums_exactly(net: &Net) {
    let per: u64 = 100_000;
    let window = 16usize;
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let word = ctx
        .alloc_mr(64, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)
        .unwrap();
    let pairs: Vec<_> = (0..2).map(|_| pair(net, &ctx, &opts, &opts)).collect();
    let remotes: Vec<_> = pairs
        .iter()
        .map(|(c, ccq, s, scq)| remote_of(&ctx, c, ccq, s, scq, &word))
        .collect();
    let t = Instant::now();
    let fetched: Vec<Vec<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = pairs
            .iter()
            .zip(&remotes)
            .map(|((c, ccq, _, _), remote)| {
                let ctx = &ctx;
                s.spawn(move || {
                    let res = ctx.alloc_mr(8 * window, Access::LOCAL_WRITE).unwrap();
                    let mut got = Vec::with_capacity(per as usize);
                    let (mut posted, mut done) = (0u64, 0u64);
                    while done < per {
                        while posted < per && posted - done < window as u64 {
                            let slot = (posted % window as u64) as usize;
                            c.post_fetch_add(&res, slot * 8, remote, 0, 1, posted, SIG)
                                .unwrap();
                            posted += 1;
                        }
                        let k = expect_ok(ccq, Opcode::FetchAdd, done).wr_id;
                        let slot = (k % window as u64) as usize;
                        let mut b = [0u8; 8];
                        unsafe { res.read(slot * 8, &mut b) }.unwrap();
                        got.push(u64::from_ne_bytes(b));
                        done += 1;
                    }
                    got
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all: Vec<u64> = fetched.concat();
    all.sort_unstable();
    assert_eq!(
        u64::from_ne_bytes(bytes(&word, 0, 8).try_into().unwrap()),
        2 * per
    );
    assert!(
        all.iter().copied().eq(0..2 * per),
        "fetched values are not each of 0..{} once",
        2 * per
    );
    eprintln!("{} fetch-and-adds in {:?}", 2 * per, t.elapsed());
}

/// A spin lock built on compare-and-swap guards a read-modify-write of a counter made of
/// plain one-sided read and write: two connections each take the lock `rounds` times, and
/// the counter ends at exactly 2 x `rounds` (without the lock, increments get lost).
pub fn compare_and_swap_makes_a_working_lock(net: &Net) {
    let rounds: u64 = match net {
        Net::Shm => 20_000,
        Net::Verbs(_) => 500,
    };
    let ctx = Context::new().unwrap();
    let opts = ConnOptions::default();
    let words = ctx
        .alloc_mr(
            64,
            Access::LOCAL_WRITE
                | Access::REMOTE_ATOMIC
                | Access::REMOTE_READ
                | Access::REMOTE_WRITE,
        )
        .unwrap();
    let pairs: Vec<_> = (0..2).map(|_| pair(net, &ctx, &opts, &opts)).collect();
    let remotes: Vec<_> = pairs
        .iter()
        .map(|(c, ccq, s, scq)| remote_of(&ctx, c, ccq, s, scq, &words))
        .collect();
    std::thread::scope(|s| {
        for (i, ((c, ccq, _, _), remote)) in pairs.iter().zip(&remotes).enumerate() {
            let ctx = &ctx;
            s.spawn(move || {
                let me = i as u64 + 1;
                let local = ctx.alloc_mr(16, Access::LOCAL_WRITE).unwrap();
                let old = |wr| {
                    expect_ok(ccq, Opcode::CmpSwap, wr);
                    u64::from_ne_bytes(bytes(&local, 0, 8).try_into().unwrap())
                };
                let mut wr = 0;
                for _ in 0..rounds {
                    loop {
                        wr += 1;
                        c.post_cmp_swap(&local, 0, remote, 0, 0, me, wr, SIG)
                            .unwrap();
                        if old(wr) == 0 {
                            break;
                        }
                    }
                    let seg = [Sge {
                        mr: &local,
                        offset: 8,
                        len: 8,
                    }];
                    wr += 1;
                    c.post_read(&seg, remote, 8, wr, SIG).unwrap();
                    expect_ok(ccq, Opcode::Read, wr);
                    let n = u64::from_ne_bytes(bytes(&local, 8, 8).try_into().unwrap());
                    unsafe { local.write(8, &(n + 1).to_ne_bytes()) }.unwrap();
                    wr += 1;
                    c.post_write(&seg, remote, 8, wr, SIG).unwrap();
                    expect_ok(ccq, Opcode::Write, wr);
                    wr += 1;
                    c.post_cmp_swap(&local, 0, remote, 0, me, 0, wr, SIG)
                        .unwrap();
                    assert_eq!(old(wr), me, "the lock was not held by its owner");
                }
            });
        }
    });
    let count = u64::from_ne_bytes(bytes(&words, 8, 8).try_into().unwrap());
    assert_eq!(count, 2 * rounds);
    assert_eq!(bytes(&words, 0, 8), [0u8; 8], "the lock is free at the end");
}

/// A key the peer never gave, a range past the end of its region, and a write into a region
/// it allows only reading each complete with RemoteAccess, fail the connection (which ends
/// with its Disconnected record), and leave every byte of the target as it was. Each case
/// runs signaled on a fresh connection, and unsignaled (its failure is still reported) after
/// a good read of the region, which is what a stream of small writes looks like.
pub fn bad_remote_accesses_fail_with_remote_access_and_touch_nothing(net: &Net) {
    let cases = ["wrong key", "past the end", "read-only"];
    for (case, warm) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
        let ctx = Context::new().unwrap();
        let opts = ConnOptions::default();
        let (client, ccq, server, scq) = pair(net, &ctx, &opts, &opts);
        let access = if case == "read-only" {
            Access::LOCAL_WRITE | Access::REMOTE_READ
        } else {
            Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE
        };
        let target = ctx.alloc_mr(4096, access).unwrap();
        unsafe { target.write(0, &pattern(77, 4096)) }.unwrap();
        let before = checksum(&target);
        let mut remote = remote_of(&ctx, &client, &ccq, &server, &scq, &target);
        let local = ctx.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        let seg = [Sge {
            mr: &local,
            offset: 0,
            len: 64,
        }];
        if warm {
            client.post_read(&seg, &remote, 0, 9, SIG).unwrap();
            expect_ok(&ccq, Opcode::Read, 9);
            assert_eq!(bytes(&local, 0, 64), bytes(&target, 0, 64), "{case}");
        }
        let mut offset = 0;
        match case {
            "wrong key" => {
                let key = remote.key() ^ 0x5a5a_0000;
                remote = client
                    .remote_from_raw(remote.addr(), remote.len(), key)
                    .unwrap();
            }
            "past the end" => offset = 4096 - 32,
            _ => {}
        }
        unsafe { local.write(0, &[0x11; 64]) }.unwrap();
        let flags = if warm { SendFlags(0) } else { SIG };
        client.post_write(&seg, &remote, offset, 1, flags).unwrap();
        let c = next(&ccq);
        assert_eq!(
            (c.opcode, c.status, c.wr_id),
            (Opcode::Write, WcStatus::RemoteAccess, 1),
            "{case} (warm {warm}): {c:?}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let d = next(&ccq);
            if d.opcode == Opcode::Disconnected {
                assert_ne!(d.status, WcStatus::Success, "{case}");
                break;
            }
            assert_eq!(d.status, WcStatus::Flushed, "{case}: {d:?}");
            assert!(Instant::now() < deadline, "{case}: no Disconnected");
        }
        assert!(
            matches!(
                client.post_write(&seg, &remote, 0, 2, SIG),
                Err(Error::Disconnected)
            ),
            "{case}: the connection is down"
        );
        assert_eq!(checksum(&target), before, "{case}: the target changed");
        // The target learns why its connection ended: a peer's bad access, not a peer that
        // vanished (Transport) or closed (Success).
        let deadline = Instant::now() + Duration::from_secs(10);
        let end = loop {
            let d = next(&scq);
            if d.opcode == Opcode::Disconnected {
                break d;
            }
            assert_eq!(d.status, WcStatus::Flushed, "{case}: {d:?}");
            assert!(
                Instant::now() < deadline,
                "{case}: no Disconnected at the target"
            );
        };
        assert_eq!(
            end.status,
            WcStatus::PeerAccess,
            "{case} (warm {warm}): {end:?}"
        );
        drop((client, server));
    }
}

/// A raw remote built exactly as docs/one-sided.md says - address, length and key read from
/// bytes 8..16, 16..24 and 24..28 of the packed descriptor - reaches the region on either
/// transport with every operation, and has every remote right. Then what the guide says of
/// posting: an atomic on an unaligned word is refused at the post and posts nothing, the
/// connection staying up; a key wider than 32 bits is no key; and unsignaled writes, four
/// times the send queue's depth of them, need no signaled one to get through.
pub fn raw_remote_built_as_the_guide_says_reaches_the_region(net: &Net) {
    const DEPTH: u32 = 4;
    let ctx = Context::new().unwrap();
    let copts = ConnOptions {
        send_queue_depth: DEPTH,
        ..Default::default()
    };
    let (client, ccq, server, scq) = pair(net, &ctx, &copts, &ConnOptions::default());
    let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let target = ctx.alloc_mr(4096, Access::LOCAL_WRITE | all).unwrap();
    let desc = server.pack_region(&target).unwrap();
    let got = hand_over(&ctx, &server, &scq, &client, &ccq, &desc);
    let u64_at = |i: usize| u64::from_le_bytes(got[i..i + 8].try_into().unwrap());
    let key = u32::from_le_bytes(got[24..28].try_into().unwrap());
    assert_eq!(got[28..32], [0; 4], "bytes 28..32 of a descriptor are zero");
    let raw = client
        .remote_from_raw(u64_at(8), u64_at(16), key.into())
        .unwrap();
    assert_eq!(raw.access(), all, "a raw remote has every remote right");

    let local = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let seg = |offset: usize, len: usize| Sge {
        mr: &local,
        offset,
        len,
    };
    // Write (signaled), read back (signaled), fetch-and-add and compare-and-swap.
    unsafe { local.write(0, &pattern(5, 256)) }.unwrap();
    client
        .post_write(&[seg(0, 256)], &raw, 512, 11, SIG)
        .unwrap();
    expect_ok(&ccq, Opcode::Write, 11);
    assert_eq!(bytes(&target, 512, 256), pattern(5, 256));
    client
        .post_read(&[seg(1024, 256)], &raw, 512, 12, SIG)
        .unwrap();
    expect_ok(&ccq, Opcode::Read, 12);
    assert_eq!(bytes(&local, 1024, 256), pattern(5, 256));
    unsafe { target.write(0, &40u64.to_ne_bytes()) }.unwrap();
    client
        .post_fetch_add(&local, 2048, &raw, 0, 2, 13, SIG)
        .unwrap();
    expect_ok(&ccq, Opcode::FetchAdd, 13);
    client
        .post_cmp_swap(&local, 2056, &raw, 0, 42, 7, 14, SIG)
        .unwrap();
    expect_ok(&ccq, Opcode::CmpSwap, 14);
    assert_eq!(
        bytes(&local, 2048, 16),
        [40u64.to_ne_bytes(), 42u64.to_ne_bytes()].concat()
    );
    assert_eq!(bytes(&target, 0, 8), 7u64.to_ne_bytes());

    // An unaligned atomic: refused at the post, nothing posted, the connection up.
    let r = client.post_fetch_add(&local, 2048, &raw, 4, 1, 15, SIG);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let r = client.post_cmp_swap(&local, 2048, &raw, 12, 0, 1, 16, SIG);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    // A key wider than 32 bits is no key of either transport.
    let r = client.remote_from_raw(u64_at(8), u64_at(16), u64::from(key) | 1 << 32);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert!(ccq.poll().is_none(), "a refused post queued a record");
    assert_eq!(bytes(&target, 0, 8), 7u64.to_ne_bytes());

    // Unsignaled writes, 4x the depth, then a signaled read: a queue full of them (over verbs
    // it may be, for a moment) empties as the completion queue is polled, which returns
    // nothing for them.
    let post_polling = |what: &str, post: &dyn Fn() -> rdmabridge::Result<()>| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match post() {
                Ok(()) => return,
                Err(Error::QueueFull(_)) => {
                    assert!(Instant::now() < deadline, "{what}: the queue stayed full");
                    assert!(ccq.poll().is_none(), "a record for an unsignaled write");
                    std::thread::sleep(Duration::from_micros(100));
                }
                Err(e) => panic!("{what}: {e}"),
            }
        }
    };
    for k in 0..4 * DEPTH as usize {
        unsafe { local.write(k * 64, &pattern(k as u64 + 100, 64)) }.unwrap();
        let at = 1024 + k as u64 * 64;
        post_polling(&format!("write {k}"), &|| {
            client.post_write(&[seg(k * 64, 64)], &raw, at, 100 + k as u64, SendFlags(0))
        });
    }
    // The read completes after them (the send queue completes in order).
    post_polling("read", &|| {
        client.post_read(&[seg(2048, 1024)], &raw, 1024, 17, SIG)
    });
    expect_ok(&ccq, Opcode::Read, 17);
    for k in 0..4 * DEPTH as usize {
        assert_eq!(
            bytes(&local, 2048 + k * 64, 64),
            pattern(k as u64 + 100, 64),
            "write {k}"
        );
    }
    assert!(ccq.poll().is_none(), "a record for an unsignaled write");
}
