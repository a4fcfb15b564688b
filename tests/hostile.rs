//! A hostile shm peer: a raw client that speaks the handshake, maps the shared segment it is
//! given, and then writes garbage into the rings and cursors of a live connection. The
//! library must end the connection with a protocol error - every outstanding work request
//! completes, then a disconnect record that is not a success - and keep serving, never crash.

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use common::*;
use rdmabridge::{
    Access, Completion, CompletionQueue, ConnOptions, Connection, Context, Opcode, SendFlags,
    WcStatus,
};

/// The wire format of the handshake and the layout of the shared segment, as documented in
/// `src/shm/wire.rs` and `src/shm/segment.rs`: a hostile peer knows them too.
const MAGIC: u32 = 0x3152_4252;
const VERSION: u16 = 5;
const HELLO: u16 = 1;
const ACCEPT: u16 = 2;
const NO_SLOT: u32 = u32::MAX;
/// Offset of ring `d`'s cursor (`RING + d * RING_STRIDE + 128`).
const RING_HEAD: usize = 256 + 2 * 512 + 128;
const RING_STRIDE: usize = 256;
/// Offset of ring 0's bytes (ring 0 carries the connecting side's messages).
const DATA: usize = 4096 + 2 * 4096;
/// A doorbell packet on the socket.
const WAKE: u8 = 1;

/// A peer that connected by hand: its socket and the shared segment, mapped writable.
struct Hostile {
    sock: OwnedFd,
    base: *mut u8,
    len: usize,
    cap: usize,
}

impl Drop for Hostile {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `connect_by_hand`, unused from here on.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl Hostile {
    /// Writes `bytes` at `off` of the segment.
    fn poke(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= self.len);
        // SAFETY: inside our writable mapping of the segment (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(off), bytes.len()) };
    }

    fn ring_peer(&self) {
        let b = [WAKE];
        // SAFETY: a one-byte send on our socket from a live local.
        unsafe { libc::send(self.sock.as_raw_fd(), b.as_ptr().cast(), 1, 0) };
    }
}

/// Sends a hello of this version (no notice board, no private data) and maps the segment the
/// accept brings.
fn connect_by_hand(addr: &str) -> Hostile {
    connect_asking(addr, 0)
}

/// [`connect_by_hand`], the hello asking for rings of `ring` bytes (0: none asked).
fn connect_asking(addr: &str, ring: u32) -> Hostile {
    connect_offering(addr, ring, &[])
}

/// [`connect_asking`], the hello offering the segments `offers` (inode numbers) as kept from
/// earlier connections; the accept must bring a new segment all the same.
fn connect_offering(addr: &str, ring: u32, offers: &[u64]) -> Hostile {
    let sock = raw_shm_peer(addr);
    let mut hello = Vec::new();
    hello.extend_from_slice(&MAGIC.to_le_bytes());
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&HELLO.to_le_bytes());
    hello.extend_from_slice(&16u32.to_le_bytes()); // send queue depth
    hello.extend_from_slice(&ring.to_le_bytes()); // ring size asked for
    hello.extend_from_slice(&NO_SLOT.to_le_bytes());
    hello.extend_from_slice(&[0; 16]); // probe word: none
    hello.extend_from_slice(&0u16.to_le_bytes()); // no private data
    hello.push(offers.len() as u8);
    for ino in offers {
        hello.extend_from_slice(&ino.to_le_bytes());
    }
    let mut buf = [0u8; 256];
    let mut cbuf = [0u64; 8];
    // SAFETY: plain socket calls on our socket; every buffer is a live local of the size
    // given; the descriptors that arrive are owned by the OwnedFds made from them only.
    let fds = unsafe {
        assert_eq!(
            libc::send(sock.as_raw_fd(), hello.as_ptr().cast(), hello.len(), 0),
            hello.len() as isize
        );
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut mh: libc::msghdr = std::mem::zeroed();
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = std::mem::size_of_val(&cbuf);
        let n = libc::recvmsg(sock.as_raw_fd(), &mut mh, libc::MSG_CMSG_CLOEXEC);
        assert!(n >= 38, "an accept: {n}");
        assert_eq!(u16::from_le_bytes([buf[6], buf[7]]), ACCEPT);
        assert_eq!(
            u32::from_le_bytes(buf[12..16].try_into().unwrap()),
            0,
            "no offered segment taken up"
        );
        let mut fds = Vec::new();
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c).cast::<i32>();
            let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
            for i in 0..count {
                fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
        fds
    };
    let seg = fds.first().expect("the segment comes with the accept");
    // SAFETY: `st` is a live local that fstat fills; the mapping is fresh, of the file's size.
    let (base, len) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::fstat(seg.as_raw_fd(), &mut st), 0);
        let len = st.st_size as usize;
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            seg.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        (p.cast::<u8>(), len)
    };
    let cap = u32::from_le_bytes(buf[8..12].try_into().unwrap()) as usize;
    assert_eq!(DATA + 2 * cap, len, "the segment's layout");
    Hostile {
        sock,
        base,
        len,
        cap,
    }
}

/// A listener keeps the segments of closed connections for the next connection from the same
/// client process. A peer that names them in its hello without being that process (here: the
/// same process id, but not the library's random probe word) gets a new segment, never one
/// another peer mapped.
#[test]
fn a_peer_offering_segments_kept_for_another_gets_a_new_one() {
    let (cctx, sctx) = (Context::new().unwrap(), Context::new().unwrap());
    let opts = ConnOptions::default();
    let mut kept = std::collections::BTreeSet::new();
    for _ in 0..3 {
        let (c, _ccq, s, _scq) =
            pair_between(&Net::Shm, &cctx, &sctx, &opts, &opts, Default::default());
        kept.extend(segment_inodes());
        drop((c, s));
        std::thread::sleep(Duration::from_millis(50));
    }
    let offers: Vec<u64> = kept.iter().copied().take(4).collect();
    let addr = unique_addr("offers");
    let l = sctx.listen(&addr, 4).unwrap();
    let cq = CompletionQueue::new().unwrap();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
            req.accept(&cq, &ConnOptions::default()).unwrap()
        });
        let peer = connect_offering(&addr, 0, &offers);
        let server = server.join().unwrap();
        let ino = segment_inodes()
            .difference(&kept)
            .copied()
            .collect::<Vec<_>>();
        assert_eq!(ino.len(), 1, "one new segment for the peer: {ino:?}");
        drop((server, peer));
    });
}

/// Accepts the next request on `addr` on a fresh completion queue, while `peer` connects.
fn accept_hostile(
    ctx: &Context,
    addr: &str,
) -> (Connection, std::sync::Arc<CompletionQueue>, Hostile) {
    let l = ctx.listen(addr, 4).unwrap();
    let cq = CompletionQueue::new().unwrap();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
            req.accept(&cq, &ConnOptions::default()).unwrap()
        });
        let peer = connect_by_hand(addr);
        (server.join().unwrap(), cq.clone(), peer)
    })
}

/// A hello asking for a ring no option could ask for (below the least, above the most, not in
/// 4 KiB steps) gets the listener's ring, as one that asks for none; a valid wish larger than
/// the listener's holds.
#[test]
fn a_ring_size_no_option_allows_is_ignored() {
    let ctx = Context::new().unwrap();
    for (wish, granted) in [
        (0, rdmabridge::SHM_RING_DEFAULT),
        (4096, rdmabridge::SHM_RING_DEFAULT),
        (20_000, rdmabridge::SHM_RING_DEFAULT),
        (u32::MAX, rdmabridge::SHM_RING_DEFAULT),
        ((1 << 30) + 4096, rdmabridge::SHM_RING_DEFAULT),
        (128 << 10, 128 << 10),
    ] {
        let addr = unique_addr("ring-wish");
        let l = ctx.listen(&addr, 4).unwrap();
        let cq = CompletionQueue::new().unwrap();
        let (server, peer) = std::thread::scope(|s| {
            let server = s.spawn(|| {
                let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
                req.accept(&cq, &ConnOptions::default()).unwrap()
            });
            let peer = connect_asking(&addr, wish);
            (server.join().unwrap(), peer)
        });
        assert_eq!(peer.cap, granted as usize, "asked for {wish}");
        assert_eq!(server.info().shm_ring_size, granted, "asked for {wish}");
    }
}

/// Every completion until the disconnect record (which is last), within 10 s.
fn until_disconnected(cq: &CompletionQueue) -> Vec<Completion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while Instant::now() < deadline {
        if !cq.wait(Some(Duration::from_millis(100))).unwrap() {
            continue;
        }
        while let Some(c) = cq.poll() {
            let end = c.opcode == Opcode::Disconnected;
            got.push(c);
            if end {
                return got;
            }
        }
    }
    panic!("no disconnect within 10 s; completions so far: {got:?}");
}

/// Checks the end of a connection a hostile peer broke: the outstanding work request
/// `wr_id` was flushed, and the disconnect says the connection failed.
fn assert_failed_by_protocol(got: &[Completion], wr_id: u64) {
    let wr = got
        .iter()
        .find(|c| c.wr_id == wr_id && c.opcode != Opcode::Disconnected)
        .unwrap_or_else(|| panic!("work request {wr_id} completes: {got:?}"));
    assert_eq!(wr.status, WcStatus::Flushed, "{got:?}");
    let end = got.last().unwrap();
    assert_eq!(end.opcode, Opcode::Disconnected);
    assert_eq!(end.status, WcStatus::General, "a protocol error: {got:?}");
}

/// A stamped record at the head of the ring the library reads that claims more bytes than the
/// ring holds: refused, the receive waiting for it is flushed, the connection ends.
#[test]
fn a_forged_oversized_record_ends_the_connection_with_a_protocol_error() {
    let ctx = Context::new().unwrap();
    let addr = unique_addr("hostile-record");
    let (conn, cq, peer) = accept_hostile(&ctx, &addr);
    let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    conn.post_recv(&mr, 0, 4096, 7).unwrap();
    // Header words after the stamp: len, flags (FIRST | LAST), imm, total; then the stamp
    // (ring position 0 + 1), last, as a producer publishes.
    let mut hdr = Vec::new();
    for w in [u32::MAX, 3, 0, u32::MAX] {
        hdr.extend_from_slice(&w.to_le_bytes());
    }
    peer.poke(DATA + 8, &hdr);
    peer.poke(DATA, &1u64.to_le_bytes());
    peer.ring_peer();
    assert_failed_by_protocol(&until_disconnected(&cq), 7);
    // Nothing was written into the receive's buffer.
    let mut bytes = vec![1u8; 4096];
    // SAFETY: the receive into these bytes completed (flushed): nothing writes them now.
    unsafe { mr.read(0, &mut bytes) }.unwrap();
    assert!(bytes.iter().all(|&b| b == 0));
    drop(peer);
}

/// A direct record (a large message the receiver copies itself) naming a region key the peer
/// never offered: refused, the receive waiting for it is flushed and untouched, the connection
/// ends. (The peer's hello names no word of its memory to read, so this side does not copy
/// from its process, and a record without a key is refused the same way.)
#[test]
fn a_forged_direct_record_with_an_unknown_key_ends_the_connection() {
    for key in [0x5eed_u64, 0] {
        let ctx = Context::new().unwrap();
        let addr = unique_addr("hostile-direct");
        let (conn, cq, peer) = accept_hostile(&ctx, &addr);
        let size = 512 << 10;
        let mr = ctx.alloc_mr(size, Access::LOCAL_WRITE).unwrap();
        conn.post_recv(&mr, 0, size, 7).unwrap();
        // Header words after the stamp: len 16, flags FIRST | LAST | DIRECT, imm, total; the
        // payload (address, key) after the 32-byte header; then the stamp, last.
        let mut hdr = Vec::new();
        for w in [16u32, 1 | 2 | 16, 0, 256 << 10] {
            hdr.extend_from_slice(&w.to_le_bytes());
        }
        peer.poke(DATA + 8, &hdr);
        let mut payload = Vec::new();
        payload.extend_from_slice(&(mr.as_ptr() as u64).to_le_bytes());
        payload.extend_from_slice(&key.to_le_bytes());
        peer.poke(DATA + 32, &payload);
        peer.poke(DATA, &1u64.to_le_bytes());
        peer.ring_peer();
        assert_failed_by_protocol(&until_disconnected(&cq), 7);
        let mut bytes = vec![1u8; size];
        // SAFETY: the receive into these bytes completed (flushed): nothing writes them now.
        unsafe { mr.read(0, &mut bytes) }.unwrap();
        assert!(
            bytes.iter().all(|&b| b == 0),
            "key {key:#x}: buffer untouched"
        );
        drop(peer);
    }
}

/// Garbage over both rings and both cursors - what the library reads and what it writes -
/// while it sends: the cursor of the ring it writes is out of range, so its send is refused
/// and the connection ends; nothing is written outside the segment (the process lives on).
#[test]
fn garbage_over_rings_and_cursors_ends_the_connection_and_the_library_lives_on() {
    let ctx = Context::new().unwrap();
    let addr = unique_addr("hostile-garbage");
    let (conn, cq, peer) = accept_hostile(&ctx, &addr);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut garbage = vec![0u8; 2 * peer.cap];
    for chunk in garbage.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    peer.poke(DATA, &garbage);
    for dir in 0..2 {
        peer.poke(RING_HEAD + dir * RING_STRIDE, &(x | 7).to_le_bytes());
    }
    peer.ring_peer();
    let mr = ctx.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    // The send goes into the ring although the peer (side 0) has posted no receive: the
    // library writes it, reading the cursor of the ring it writes.
    // SAFETY: no work request uses the region yet, and no peer can reach it (never exposed).
    unsafe { mr.write(0, b"hello") }.unwrap();
    conn.post_send(&mr, 0, 5, 9, SendFlags::SIGNALED).unwrap();
    peer.ring_peer();
    assert_failed_by_protocol(&until_disconnected(&cq), 9);
    drop(conn);
    drop(peer);
    // The context still serves: a real client connects, and its message arrives.
    let addr = unique_addr("after-garbage");
    let l = ctx.listen(&addr, 4).unwrap();
    let (cq1, cq2) = (
        CompletionQueue::new().unwrap(),
        CompletionQueue::new().unwrap(),
    );
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let req = l.get_request(Some(Duration::from_secs(10))).unwrap();
            req.accept(&cq1, &ConnOptions::default()).unwrap()
        });
        let client = ctx.connect(&addr, &cq2, &ConnOptions::default()).unwrap();
        let server = server.join().unwrap();
        server.post_recv(&mr, 1024, 64, 1).unwrap();
        client.post_send(&mr, 0, 5, 2, SendFlags::SIGNALED).unwrap();
        let c = next(&cq1);
        assert_eq!(
            (c.opcode, c.status, c.byte_len),
            (Opcode::Recv, WcStatus::Success, 5)
        );
    });
}
