//! The one-sided target.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use super::Input;
use crate::conn::{RdmaOp, RdmaRequest, Sge, Transport, pack_remote, unpack_remote};
use crate::mr::{Access, MemoryRegion};
use crate::shm::onesided::{Refused, Shortcut, SocketReader, run};
use crate::shm::segment::Segment;
use crate::shm::socket::{pair, send_with_fds};
use crate::shm::wire::{OFFER, OFFER_LEN, REVOKED};
use crate::{Context, SendFlags};

/// What the one-sided target needs once: a context, the region the offers map (its memfd),
/// a local region for the requests' segments, a segment holding the export table, and the
/// lock-free write path over it.
struct OneSided {
    ctx: Context,
    target: Arc<MemoryRegion>,
    local: Arc<MemoryRegion>,
    seg: Arc<Segment>,
    shortcut: Arc<Shortcut>,
    /// Both ends of a seqpacket pair: offers go in at `.0` and the inbox reads `.1`.
    socks: (OwnedFd, OwnedFd),
}

// SAFETY: the segment is a private mapping of this process, used from one thread at a time
// (the fuzzer runs inputs one after another).
unsafe impl Sync for OneSided {}
// SAFETY: as above.
unsafe impl Send for OneSided {}

const TARGET_LEN: usize = 64 * 1024;
const LOCAL_LEN: usize = 4096;

fn onesided_state() -> &'static OneSided {
    static STATE: OnceLock<OneSided> = OnceLock::new();
    STATE.get_or_init(|| {
        let ctx = Context::new().expect("a context");
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let target = MemoryRegion::alloc(ctx.inner.clone(), TARGET_LEN, all).expect("region");
        let local =
            MemoryRegion::alloc(ctx.inner.clone(), LOCAL_LEN, Access::LOCAL_WRITE).expect("mr");
        let (seg, _fd) = Segment::create(64 * 1024).expect("a segment");
        let seg = Arc::new(seg);
        let shortcut = Arc::new(Shortcut::new(seg.clone(), 0));
        let socks = pair();
        OneSided {
            ctx,
            target,
            local,
            seg,
            shortcut,
            socks,
        }
    })
}

/// Sends one packet, with `fd` attached when given.
fn send_packet(sock: RawFd, pkt: &[u8], fd: Option<RawFd>) {
    let sent = send_with_fds(sock, pkt, fd.as_slice(), libc::MSG_NOSIGNAL);
    assert_eq!(sent.ok(), Some(pkt.len()), "sendmsg");
}

/// The one-sided target: packets from the peer (offers, with the memfd of a real region or
/// without one; withdrawals; anything) go through the real socket reader into the imports;
/// then requests - a descriptor unpacked by the real unpacker, an operation, local segments,
/// an offset - are checked by the real request checks and run against the import with the
/// key they name and the export table in a real segment, whose `live` word the input sets.
/// Checks that an access runs only inside the offered range, with the rights offered, on a
/// live key, and that an atomic's word is 8-byte aligned in the mapping.
pub fn onesided(data: &[u8]) {
    let st = onesided_state();
    let mut input = Input(data);
    let mut inbox = SocketReader::default();
    let mut offers: Vec<[u8; OFFER_LEN]> = Vec::new();
    let conn_id = 1;
    while !input.done() {
        match input.u8() % 4 {
            0 => {
                // An offer packet, as the peer composes it, with the memfd or without.
                let mut pkt = [0u8; OFFER_LEN];
                let b = input.bytes(OFFER_LEN);
                pkt[..b.len()].copy_from_slice(b);
                pkt[0] = OFFER;
                let with_fd = pkt[1] & 1 != 0;
                let fd = with_fd.then(|| st.target.memfd().expect("an allocated region"));
                send_packet(st.socks.0.as_raw_fd(), &pkt, fd);
                offers.push(pkt);
                inbox.drain(st.socks.1.as_raw_fd());
            }
            1 => {
                // Any other packet: a withdrawal, or garbage.
                let n = usize::from(input.u8() % 65).max(1);
                let mut pkt = input.bytes(n).to_vec();
                if pkt.is_empty() {
                    pkt.push(REVOKED);
                }
                send_packet(st.socks.0.as_raw_fd(), &pkt, None);
                inbox.drain(st.socks.1.as_raw_fd());
            }
            _ => {
                request(st, &mut input, &inbox, &offers, conn_id);
            }
        }
    }
    inbox.drain(st.socks.1.as_raw_fd());
    inbox.clear();
    for slot in 0..crate::shm::segment::EXPORT_SLOTS {
        let e = st.seg.export(0, slot).expect("a slot");
        e.live.store(0, Ordering::Relaxed);
        assert_eq!(
            e.busy.load(Ordering::Relaxed),
            0,
            "an access left busy raised"
        );
    }
}

/// The slots of the offers with `key` that an import could have come from.
fn offer_slots(offers: &[[u8; OFFER_LEN]], key: u64) -> Vec<usize> {
    offers
        .iter()
        .filter(|o| o[8..16] == key.to_le_bytes())
        .map(|o| u32::from_le_bytes(o[4..8].try_into().expect("4 bytes")) as usize)
        .filter(|&s| s < crate::shm::segment::EXPORT_SLOTS)
        .collect()
}

fn request(
    st: &OneSided,
    input: &mut Input<'_>,
    inbox: &SocketReader,
    offers: &[[u8; OFFER_LEN]],
    conn_id: u64,
) {
    let mut desc = [0u8; 32];
    let b = input.bytes(32);
    desc[..b.len()].copy_from_slice(b);
    let remote = match unpack_remote(&desc, Transport::Shm, conn_id) {
        Ok(r) => r,
        Err(_) => return,
    };
    assert!(remote.addr.checked_add(remote.len).is_some());
    let op = match input.u8() % 4 {
        0 => RdmaOp::Write { imm: None },
        1 => RdmaOp::Read,
        2 => RdmaOp::FetchAdd { add: 1 },
        _ => RdmaOp::CmpSwap {
            compare: 0,
            swap: 1,
        },
    };
    let remote_offset = input.u64() % (2 * TARGET_LEN as u64 + 64);
    let inner = &st.ctx.inner;
    let wr = match op {
        RdmaOp::Write { .. } | RdmaOp::Read => {
            let n = usize::from(input.u8()) % 5;
            let sges: Vec<Sge<'_>> = (0..n)
                .map(|_| Sge {
                    mr: &st.local,
                    offset: usize::from(input.u16()) % (LOCAL_LEN + 8),
                    len: usize::from(input.u16()) % (LOCAL_LEN + 8),
                })
                .collect();
            RdmaRequest::transfer(
                inner,
                conn_id,
                op,
                sges.into_iter(),
                &remote,
                remote_offset,
                0,
                SendFlags::SIGNALED,
            )
        }
        _ => {
            let local_offset = usize::from(input.u16()) % (LOCAL_LEN + 8);
            RdmaRequest::atomic(
                inner,
                conn_id,
                op,
                &st.local,
                local_offset,
                &remote,
                remote_offset,
                0,
                SendFlags::SIGNALED,
            )
        }
    };
    let Ok(wr) = wr else { return };
    for s in wr.segs() {
        let lo = st.local.slice_ptr(0, LOCAL_LEN).expect("whole region") as usize;
        assert!(s.ptr as usize >= lo && s.ptr as usize + s.len <= lo + LOCAL_LEN);
    }
    let Some(imp) = inbox.get(remote.key) else {
        return;
    };
    let slots = offer_slots(offers, remote.key);
    assert!(!slots.is_empty(), "an import comes from an offer");
    let live = input.u8() & 1 != 0;
    let value = if live { remote.key } else { remote.key ^ 1 };
    for &slot in &slots {
        let e = st.seg.export(0, slot).expect("an offered slot exists");
        e.live.store(value, Ordering::SeqCst);
    }
    // A write of one segment also goes the lock-free way, as the connection's next one would
    // once the import is published (the fuzzer runs one input at a time: the one publisher).
    let single = wr.segs().count() == 1;
    let quick = (matches!(op, RdmaOp::Write { imm: None }) && single).then(|| {
        imp.publish(&st.shortcut);
        let s = wr.segs().next().expect("one segment");
        // SAFETY: the segment lies inside the local region (checked above).
        unsafe { st.shortcut.write(remote.key, s.ptr, s.len, wr.remote_addr) }
    });
    let r = run(&imp, &wr, &st.seg, 0, None);
    for &slot in &slots {
        let e = st.seg.export(0, slot).expect("an offered slot exists");
        e.live.store(0, Ordering::SeqCst);
    }
    let need = match op {
        RdmaOp::Write { .. } => Access::REMOTE_WRITE.0,
        RdmaOp::Read => Access::REMOTE_READ.0,
        _ => Access::REMOTE_ATOMIC.0,
    };
    // Some offer of this key (the one the import came from) allowed exactly this access.
    let allowed = || {
        offers
            .iter()
            .filter(|o| o[8..16] == remote.key.to_le_bytes())
            .any(|o| {
                let word = |i: usize| u64::from_le_bytes(o[i..i + 8].try_into().expect("8 bytes"));
                let (addr, len) = (word(16), word(24));
                let access = u32::from_le_bytes(o[32..36].try_into().expect("4 bytes"));
                let Some(off) = wr.remote_addr.checked_sub(addr) else {
                    return false;
                };
                o[1] & 1 != 0 // a mapping: there is no peer process to reach through the kernel
                && access & need == need
                && off + wr.len as u64 <= len
                && len <= TARGET_LEN as u64
                && (need != Access::REMOTE_ATOMIC.0 || off % 8 == 0)
            })
    };
    if quick == Some(true) {
        assert!(live, "a lock-free write on a withdrawn key");
        assert!(allowed(), "a lock-free write no offer allowed: {wr:?}");
        assert!(
            r.is_ok(),
            "a lock-free write the general path refused: {wr:?} {r:?}"
        );
    }
    if r.is_ok() {
        assert!(live, "an access on a withdrawn key");
        assert!(allowed(), "an access no offer allowed: {wr:?}");
    } else if r == Err(Refused::Withdrawn) {
        assert!(!live);
    }
}

/// Seeds for [`onesided`]: real offers and descriptors, with every operation.
pub fn onesided_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let key = 0x5eed_0001u64; // keys are 32 bits
    let (addr, len) = (0x7f12_3450_0000u64, 4096u64);
    let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let offer = |mapped: bool, slot: u32, access: Access| {
        let mut v = vec![0u8, OFFER, u8::from(mapped), 0, 0];
        v.extend(slot.to_le_bytes());
        v.extend(key.to_le_bytes());
        v.extend(addr.to_le_bytes());
        v.extend(len.to_le_bytes());
        v.extend(access.0.to_le_bytes());
        v.extend(u32::from(mapped).to_le_bytes());
        v
    };
    let desc = |access: Access| pack_remote(Transport::Shm, access, addr, len, key).to_vec();
    let transfer = |op: u8, off: u64, segs: &[(u16, u16)], live: bool| {
        let mut v = [vec![2u8], desc(all), vec![op]].concat();
        v.extend(off.to_le_bytes());
        v.push(segs.len() as u8);
        for (o, l) in segs {
            v.extend(o.to_le_bytes());
            v.extend(l.to_le_bytes());
        }
        v.push(u8::from(live));
        v
    };
    let atomic = |op: u8, off: u64, local: u16| {
        let mut v = [vec![2u8], desc(all), vec![op]].concat();
        v.extend(off.to_le_bytes());
        v.extend(local.to_le_bytes());
        v.push(1);
        v
    };
    let mut revoked = vec![1u8, 16, REVOKED, 0, 0, 0];
    revoked.extend(3u32.to_le_bytes());
    revoked.extend(key.to_le_bytes());
    vec![
        (
            "write",
            [
                offer(true, 3, all),
                transfer(0, 16, &[(0, 64), (128, 8)], true),
            ]
            .concat(),
        ),
        (
            "read",
            [offer(true, 3, all), transfer(1, 0, &[(0, 4096)], true)].concat(),
        ),
        ("fetch-add", [offer(true, 3, all), atomic(2, 8, 8)].concat()),
        (
            "cmp-swap",
            [offer(true, 3, all), atomic(3, 4088, 0)].concat(),
        ),
        (
            "withdrawn",
            [offer(true, 3, all), transfer(0, 0, &[(0, 8)], false)].concat(),
        ),
        (
            "read-only",
            [
                offer(true, 9, Access::REMOTE_READ),
                transfer(0, 0, &[(0, 8)], true),
            ]
            .concat(),
        ),
        (
            "revoked",
            [
                offer(true, 3, all),
                revoked,
                transfer(1, 0, &[(0, 8)], true),
            ]
            .concat(),
        ),
        (
            "process",
            [
                offer(false, 4, Access::REMOTE_READ),
                transfer(1, 0, &[(0, 8)], true),
            ]
            .concat(),
        ),
    ]
}
