//! The handshake target: establishment messages through the real decoder, both judges and the
//! real receiver, and shared segments through the real opener.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::conn::PRIVATE_DATA_MAX;
use crate::cq::notice::{NO_SLOT, SLOTS};
use crate::error::Error;
use crate::shm::peers::OFFERS_MAX;
use crate::shm::segment::Segment;
use crate::shm::socket::{pair, recv_msg, send_with_fds};
use crate::shm::wire::{
    ACCEPT, FDS_MAX, HEADER, HELLO, HelloVerdict, MSG_MAX, REJECT, REJECT_VERSION, VERSION, decode,
    encode_with_probe, judge_hello, judge_reply,
};

/// The fuzz target's entry (`fuzz/fuzz_targets/handshake.rs`). `data[0]`: bits 0-1, how many
/// descriptors come with the message (0..=3); bit 7, whether the message goes through a real
/// seqpacket socket pair and the real receiver (`recv_msg`) first; bit 6, whether the rest is
/// instead the header of a shared segment the peer hands over (bits 2-5: its size and seals),
/// opened by the real `Segment::open`. The rest is the message as the peer sent it. Runs the
/// real parser and both judges over it and checks what they accept against the wire format.
pub fn handshake(data: &[u8]) {
    let Some((&ctl, buf)) = data.split_first() else {
        return;
    };
    if ctl & 0x40 != 0 {
        return segment(ctl, buf);
    }
    let mut nfds = usize::from(ctl % 4);
    let received;
    let buf = if ctl & 0x80 != 0 {
        let Some((b, n)) = through_socket(buf, nfds) else {
            return;
        };
        (received, nfds) = (b, n);
        &received[..]
    } else {
        buf
    };
    let msg = match decode(buf) {
        Ok(msg) => msg,
        Err(Error::Protocol(_)) => return,
        Err(e) => panic!("a bad message is a protocol error, not {e:?}"),
    };
    assert!(buf.len() >= 12);
    if msg.version == VERSION {
        assert!(msg.data.len() <= PRIVATE_DATA_MAX && msg.offers.len() <= OFFERS_MAX);
        assert_eq!(
            HEADER + msg.data.len() + 1 + 8 * msg.offers.len(),
            buf.len()
        );
        // What was accepted is exactly what the sender encoded.
        let b = u32::from_le_bytes(buf[12..16].try_into().expect("4 bytes"));
        let again = encode_with_probe(
            msg.kind,
            msg.a,
            b,
            msg.slot,
            msg.probe,
            &msg.data,
            &msg.offers,
        );
        assert_eq!(again, buf);
    } else {
        assert!(msg.data.is_empty() && msg.offers.is_empty() && msg.slot == NO_SLOT);
    }
    match judge_hello(&msg, nfds) {
        HelloVerdict::Welcome { board_slot } => {
            assert_eq!(msg.version, VERSION);
            assert_eq!(msg.kind, HELLO);
            match board_slot {
                Some(slot) => assert!(slot < SLOTS && nfds == 1),
                None => assert!(nfds == 0 && msg.slot == NO_SLOT),
            }
        }
        HelloVerdict::OtherVersion => assert_ne!(msg.version, VERSION),
        HelloVerdict::Refuse => {}
    }
    match judge_reply(&msg, nfds) {
        Ok(board_slot) => {
            assert_eq!((msg.version, msg.kind), (VERSION, ACCEPT));
            // The new segment's descriptor comes unless an offered one is taken up.
            let segment = usize::from(msg.b == 0);
            match board_slot {
                Some(slot) => assert!(slot < SLOTS && nfds == segment + 1),
                None => assert!(nfds == segment && msg.slot == NO_SLOT),
            }
        }
        Err(Error::Rejected(data)) => assert!(data.len() <= PRIVATE_DATA_MAX),
        Err(Error::Protocol(_) | Error::Permission(_)) => {}
        Err(e) => panic!("unexpected verdict {e:?}"),
    }
}

/// Sends `buf` with `nfds` descriptors through a socket pair and takes it out with
/// [`recv_msg`]: what it returns is what was sent, and what it refuses is a protocol error (a
/// message too long, too many descriptors) or, for an empty packet, a hang-up.
fn through_socket(buf: &[u8], nfds: usize) -> Option<(Vec<u8>, usize)> {
    thread_local! {
        static PAIR: ((OwnedFd, OwnedFd), OwnedFd) = {
            // SAFETY: a NUL-terminated path; plain syscall.
            let null =
                unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            assert!(null >= 0, "/dev/null");
            // SAFETY: a fresh descriptor owned by nobody else.
            (pair(), unsafe { OwnedFd::from_raw_fd(null) })
        };
    }
    PAIR.with(|((tx, rx), null)| {
        let fds = vec![null.as_raw_fd(); nfds];
        let Ok(n) = send_with_fds(tx.as_raw_fd(), buf, &fds, libc::MSG_NOSIGNAL) else {
            // Longer than a packet may be: nothing was sent.
            return None;
        };
        assert_eq!(n, buf.len());
        match recv_msg(rx.as_raw_fd()) {
            Ok(Some((got, fds))) => {
                assert!(buf.len() <= MSG_MAX && !buf.is_empty() && nfds <= FDS_MAX);
                assert_eq!(got, buf);
                assert_eq!(fds.len(), nfds);
                Some((got, fds.len()))
            }
            Ok(None) => panic!("a packet was sent, none came"),
            Err(Error::Protocol(_)) => {
                assert!(buf.len() > MSG_MAX || nfds > FDS_MAX);
                None
            }
            Err(Error::Connect(_)) if buf.is_empty() => None,
            Err(e) => panic!("unexpected receive error {e:?}"),
        }
    })
}

/// A shared segment the peer sends: `buf` starts with its header, `ctl` bits 2-3 choose its
/// size and bits 4-5 leave out seals. Opened with the real [`Segment::open`]: what it accepts
/// has every seal and a ring size that fits the file.
fn segment(ctl: u8, buf: &[u8]) {
    const DATA: usize = 3 * 4096;
    const MIN_CAP: usize = 64 * 1024;
    let len = [
        DATA + 2 * MIN_CAP,
        DATA + 4 * MIN_CAP,
        DATA + 2 * MIN_CAP + 4096,
        4096,
    ][usize::from(ctl >> 2 & 3)];
    let all = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    let seals = match ctl >> 4 & 3 {
        0 => all,
        1 => all & !libc::F_SEAL_GROW,
        2 => libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        _ => 0,
    };
    // SAFETY: a NUL-terminated name and valid flags; the new descriptor is ours.
    let fd = unsafe {
        libc::memfd_create(
            c"rbr-fuzz".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let head = &buf[..buf.len().min(64)];
    // SAFETY: plain syscalls on our memfd; `head` is readable for its length.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
        assert_eq!(
            libc::pwrite(fd.as_raw_fd(), head.as_ptr().cast(), head.len(), 0),
            head.len() as isize
        );
        if seals != 0 {
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
        }
    }
    if let Ok(seg) = Segment::open(&fd) {
        assert_eq!(seals, all, "a segment that could be resized was accepted");
        assert_eq!(DATA + 2 * seg.cap(), len, "rings that do not fit the file");
        assert!(seg.cap() >= MIN_CAP && seg.cap() % 4096 == 0);
    }
}

/// Real messages, for the fuzz target's seed corpus: (name, input of [`handshake`]).
pub fn handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let with = |n: u8, m: Vec<u8>| [vec![n], m].concat();
    let probe = (0x7fff_1234_5678, 0x0123_4567_89ab_cdef);
    let segment_header = |cap: u32| {
        let mut h = 0x5242_5348_4d53_4547u64.to_le_bytes().to_vec(); // "RBSHMSEG"
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&cap.to_le_bytes());
        h
    };
    let mut v9 = encode_with_probe(HELLO, 9, 0, NO_SLOT, (0, 0), &[], &[]);
    v9[4] = 9;
    vec![
        (
            "hello",
            with(
                0,
                encode_with_probe(HELLO, 64, 64, NO_SLOT, probe, &[], &[]),
            ),
        ),
        (
            "hello-board-data",
            with(1, encode_with_probe(HELLO, 16, 32, 5, probe, b"real", &[])),
        ),
        (
            "accept",
            with(
                1,
                encode_with_probe(ACCEPT, 1 << 21, 0, NO_SLOT, probe, &[], &[]),
            ),
        ),
        (
            "hello-offers",
            with(
                0,
                encode_with_probe(HELLO, 16, 0, NO_SLOT, probe, &[], &[7, 9]),
            ),
        ),
        (
            "accept-offered",
            with(1, encode_with_probe(ACCEPT, 1 << 15, 2, 7, probe, &[], &[])),
        ),
        (
            "accept-board",
            with(
                2,
                encode_with_probe(ACCEPT, 1 << 16, 0, 7, probe, b"hi", &[]),
            ),
        ),
        (
            "reject",
            with(
                0,
                encode_with_probe(REJECT, 0, 0, NO_SLOT, probe, b"no", &[]),
            ),
        ),
        (
            "reject-version",
            with(
                0,
                encode_with_probe(REJECT_VERSION, 2, 0, NO_SLOT, probe, &[], &[]),
            ),
        ),
        ("hello-v9", with(0, v9)),
        (
            "socket-hello-board",
            with(
                0x81,
                encode_with_probe(HELLO, 16, 32, 5, probe, b"real", &[]),
            ),
        ),
        (
            "socket-accept",
            with(
                0x82,
                encode_with_probe(ACCEPT, 1 << 16, 0, 7, probe, &[], &[]),
            ),
        ),
        ("segment", with(0x40, segment_header(1 << 16))),
        ("segment-unsealed", with(0x70, segment_header(1 << 16))),
        ("segment-bigger", with(0x44, segment_header(1 << 17))),
        ("garbage", with(0, b"GET / HTTP/1.0".to_vec())),
    ]
}
