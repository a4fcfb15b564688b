//! What travels on a connection's socket, byte for byte: every message and packet, its tag,
//! its layout, and its encoding and decoding. All numbers are little-endian.
//!
//! **Establishment** (`handshake/`). The client's hello is answered with an accept or a
//! rejection. A message: magic `u32`, version `u16`, kind `u16`, three `u32` parameters, a
//! probe word's address and value (`u64` each), private-data length `u16`, private data, a
//! count `u8` of offered segments and their inode numbers (`u64` each). The hello carries the
//! client's send queue depth, the ring size it asks for (0: none), the slot of the connection
//! on its completion queue's notice board (with the board's descriptor) and the segments it
//! keeps from the listener's process (`peers.rs`); the accept the ring size, which offered
//! segment it takes up again (its index + 1; 0: a new one) and the server's slot (with the new
//! segment's descriptor, then the board's): each side marks the other's slot when it has news
//! for it (see `cq/notice.rs`). The probe word is a word of the sender's memory and its value,
//! so that the other side can find out whether it may copy large messages straight from there
//! (`direct.rs`).
//!
//! **Packets.** Once the connection is up its socket (a Unix seqpacket socket: one packet per
//! send, never merged or split) carries packets whose first byte is their tag; the bytes
//! between a tag and the first field are 0.
//!
//! | tag         | bytes | what it says                                        | comes with     |
//! |-------------|-------|-----------------------------------------------------|----------------|
//! | [`WAKE`]    | 1     | doorbell: look at the rings (`bell.rs`)             |                |
//! | [`BYE`]     | 1     | goodbye: an orderly close follows                   |                |
//! | [`OFFER`]   | 40    | a region the sender lets its peer reach ([`Offer`]) | a memfd or not |
//! | [`REVOKED`] | 16    | the region in a slot is gone ([`Revoked`])          |                |
//!
//! A doorbell or goodbye is known by its tag alone. A receiver ignores an offer or notice of
//! another length, an offer with more than one descriptor, and a packet of another tag,
//! closing the descriptors that came with it: what it cannot read is not its to act on.

use std::os::fd::RawFd;

use crate::conn::PRIVATE_DATA_MAX;
use crate::cq::notice::{NO_SLOT, SLOTS};
use crate::error::{Error, Result};
use crate::shm::direct;
use crate::shm::peers::OFFERS_MAX;

pub(crate) const MAGIC: u32 = 0x3152_4252; // "RBR1"
/// Version 2: notice boards. Version 3: a direct record carries a key (a large message copied
/// out of the mapping of the region it is in). Version 4: the hello's second parameter is the
/// ring size the client asks for, no longer its receive queue depth. Version 5: segments kept
/// from earlier connections, offered and taken up again.
pub(crate) const VERSION: u16 = 5;
pub(crate) const HELLO: u16 = 1;
pub(crate) const ACCEPT: u16 = 2;
pub(crate) const REJECT: u16 = 3;
pub(crate) const REJECT_VERSION: u16 = 4;
pub(crate) const REJECT_PERMISSION: u16 = 5;
pub(crate) const HEADER: usize = 38;
pub(crate) const MSG_MAX: usize = HEADER + PRIVATE_DATA_MAX + 1 + 8 * OFFERS_MAX;

/// Most descriptors one message carries.
pub(crate) const FDS_MAX: usize = 2;

pub(crate) struct Msg {
    pub(crate) version: u16,
    pub(crate) kind: u16,
    pub(crate) a: u32,
    pub(crate) b: u32,
    /// The sender's notice-board slot ([`NO_SLOT`]: none).
    pub(crate) slot: u32,
    /// The sender's probe word: address and value.
    pub(crate) probe: (u64, u64),
    pub(crate) data: Vec<u8>,
    /// The segments offered (their inode numbers), at most [`OFFERS_MAX`].
    pub(crate) offers: Vec<u64>,
}

pub(crate) fn encode(kind: u16, a: u32, b: u32, slot: u32, data: &[u8]) -> Vec<u8> {
    encode_with_probe(kind, a, b, slot, direct::probe(), data, &[])
}

/// A hello offering the segments `offers` (at most [`OFFERS_MAX`]; see [`encode`]).
pub(crate) fn encode_hello(a: u32, b: u32, slot: u32, data: &[u8], offers: &[u64]) -> Vec<u8> {
    encode_with_probe(HELLO, a, b, slot, direct::probe(), data, offers)
}

/// [`encode`] with the probe word and the offers given.
pub(crate) fn encode_with_probe(
    kind: u16,
    a: u32,
    b: u32,
    slot: u32,
    (addr, value): (u64, u64),
    data: &[u8],
    offers: &[u64],
) -> Vec<u8> {
    debug_assert!(offers.len() <= OFFERS_MAX);
    let mut v = Vec::with_capacity(HEADER + data.len() + 1 + 8 * offers.len());
    v.extend_from_slice(&MAGIC.to_le_bytes());
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&kind.to_le_bytes());
    v.extend_from_slice(&a.to_le_bytes());
    v.extend_from_slice(&b.to_le_bytes());
    v.extend_from_slice(&slot.to_le_bytes());
    v.extend_from_slice(&addr.to_le_bytes());
    v.extend_from_slice(&value.to_le_bytes());
    v.extend_from_slice(&(data.len() as u16).to_le_bytes());
    v.extend_from_slice(data);
    v.push(offers.len() as u8);
    for ino in offers {
        v.extend_from_slice(&ino.to_le_bytes());
    }
    v
}

pub(crate) fn decode(buf: &[u8]) -> Result<Msg> {
    let bad = |m: &str| Error::Protocol(format!("handshake: {m}"));
    if buf.len() < 12 {
        return Err(bad("message too short"));
    }
    let u16_at = |i: usize| u16::from_le_bytes([buf[i], buf[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    if u32_at(0) != MAGIC {
        return Err(bad("not an rdmabridge peer"));
    }
    let (version, kind, a) = (u16_at(4), u16_at(6), u32_at(8));
    if version != VERSION {
        // Another version lays the rest out differently: only these fields are read, so that
        // a mismatch can be named.
        return Ok(Msg {
            version,
            kind,
            a,
            b: 0,
            slot: NO_SLOT,
            probe: (0, 0),
            data: Vec::new(),
            offers: Vec::new(),
        });
    }
    if buf.len() < HEADER {
        return Err(bad("message too short"));
    }
    let u64_at = |i: usize| u64::from(u32_at(i)) | u64::from(u32_at(i + 4)) << 32;
    let len = u16_at(36) as usize;
    if len > PRIVATE_DATA_MAX || HEADER + len >= buf.len() {
        return Err(bad("bad private data length"));
    }
    let tail = HEADER + len;
    let count = usize::from(buf[tail]);
    if count > OFFERS_MAX || tail + 1 + 8 * count != buf.len() {
        return Err(bad("bad count of offered segments"));
    }
    Ok(Msg {
        version,
        kind,
        a,
        b: u32_at(12),
        slot: u32_at(16),
        probe: (u64_at(20), u64_at(28)),
        data: buf[HEADER..tail].to_vec(),
        offers: (0..count).map(|i| u64_at(tail + 1 + 8 * i)).collect(),
    })
}

/// What the listener makes of a decoded hello that came with `nfds` descriptors.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HelloVerdict {
    /// Not a hello, or its notice-board slot and descriptors disagree: dropped unanswered.
    Refuse,
    /// A hello of another version: answered with ours, then dropped.
    OtherVersion,
    /// A hello to go on with: with the client's notice-board slot (its descriptor is the one
    /// that came), or without a board.
    Welcome { board_slot: Option<u32> },
}

pub(crate) fn judge_hello(msg: &Msg, nfds: usize) -> HelloVerdict {
    if msg.kind != HELLO {
        return HelloVerdict::Refuse;
    }
    if msg.version != VERSION {
        return HelloVerdict::OtherVersion;
    }
    // The client's notice board comes with its slot, and nothing else comes with a hello.
    match (msg.slot, nfds) {
        (NO_SLOT, 0) => HelloVerdict::Welcome { board_slot: None },
        (slot, 1) if slot < SLOTS => HelloVerdict::Welcome {
            board_slot: Some(slot),
        },
        _ => HelloVerdict::Refuse,
    }
}

/// Judges the listener's decoded answer to a hello, which came with `nfds` descriptors: for an
/// accept (the segment's descriptor first unless it takes up an offered one, then the
/// listener's notice board when it names a slot), the listener's slot, if any; the reason the
/// connect fails otherwise.
pub(crate) fn judge_reply(msg: &Msg, nfds: usize) -> Result<Option<u32>> {
    match msg.kind {
        ACCEPT => {}
        REJECT => return Err(Error::Rejected(msg.data.clone())),
        REJECT_VERSION => {
            return Err(Error::Protocol(format!(
                "listener speaks version {}, this library {VERSION}",
                msg.a
            )));
        }
        REJECT_PERMISSION => {
            return Err(Error::Permission("the listener refuses this user".into()));
        }
        k => {
            return Err(Error::Protocol(format!(
                "handshake: unexpected message kind {k}"
            )));
        }
    }
    if msg.version != VERSION {
        return Err(Error::Protocol(format!(
            "handshake: an accept of version {}, this library {VERSION}",
            msg.version
        )));
    }
    // The new segment's descriptor, unless an offered one is taken up.
    let segment = usize::from(msg.b == 0);
    match (msg.slot, nfds.checked_sub(segment)) {
        (_, None) => Err(Error::Protocol(
            "handshake: accept without a segment".into(),
        )),
        (NO_SLOT, Some(0)) => Ok(None),
        (slot, Some(1)) if slot < SLOTS => Ok(Some(slot)),
        _ => Err(Error::Protocol(
            "handshake: notice board and slot do not match".into(),
        )),
    }
}

/// Doorbell packet: "look at the rings".
pub(crate) const WAKE: u8 = 1;
/// Goodbye packet: an orderly close follows.
pub(crate) const BYE: u8 = 2;
/// Offer packet: a region the sender lets its peer reach.
pub(crate) const OFFER: u8 = 3;
/// Withdrawal notice: the region in a slot is gone, and the peer may unmap it. Only a hint
/// for the peer's housekeeping (what stops accesses is the export table, see
/// [`Export`](crate::shm::segment::Export)).
pub(crate) const REVOKED: u8 = 4;

/// Bytes of an offer packet.
pub(crate) const OFFER_LEN: usize = 40;
/// Bytes of a withdrawal notice.
const REVOKED_LEN: usize = 16;

/// How the peer reaches an offered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OfferKind {
    /// Caller memory, reached through the kernel (`process_vm_writev`/`readv`); no descriptor
    /// comes with the offer.
    Process,
    /// Memory the library allocated: its memfd comes with the offer, and the peer maps it.
    Mapped,
}

impl OfferKind {
    const PROCESS: u32 = 0;
    const MAPPED: u32 = 1;
}

/// An offer: tag, 3 zero bytes, slot `u32`, key `u64`, the region's address `u64` and length
/// `u64` in the sender's memory, its remote access bits `u32`, its kind `u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offer {
    /// The sender's export slot that guards the region.
    pub(crate) slot: u32,
    pub(crate) key: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// The remote access bits the region grants ([`Access`](crate::Access)).
    pub(crate) access: u32,
    pub(crate) kind: OfferKind,
}

impl Offer {
    pub(crate) fn encode(&self) -> [u8; OFFER_LEN] {
        let kind = match self.kind {
            OfferKind::Process => OfferKind::PROCESS,
            OfferKind::Mapped => OfferKind::MAPPED,
        };
        let mut pkt = [0u8; OFFER_LEN];
        pkt[0] = OFFER;
        pkt[4..8].copy_from_slice(&self.slot.to_le_bytes());
        pkt[8..16].copy_from_slice(&self.key.to_le_bytes());
        pkt[16..24].copy_from_slice(&self.addr.to_le_bytes());
        pkt[24..32].copy_from_slice(&self.len.to_le_bytes());
        pkt[32..36].copy_from_slice(&self.access.to_le_bytes());
        pkt[36..40].copy_from_slice(&kind.to_le_bytes());
        pkt
    }

    /// Reads an offer packet (tag already checked); `None` when it has another length or an
    /// unknown kind. Its fields are the peer's word: the importer checks them.
    fn decode(pkt: &[u8]) -> Option<Offer> {
        if pkt.len() != OFFER_LEN {
            return None;
        }
        let kind = match u32_at(pkt, 36) {
            OfferKind::PROCESS => OfferKind::Process,
            OfferKind::MAPPED => OfferKind::Mapped,
            _ => return None,
        };
        Some(Offer {
            slot: u32_at(pkt, 4),
            key: u64_at(pkt, 8),
            addr: u64_at(pkt, 16),
            len: u64_at(pkt, 24),
            access: u32_at(pkt, 32),
            kind,
        })
    }
}

/// A withdrawal notice: tag, 3 zero bytes, slot `u32`, key `u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Revoked {
    pub(crate) slot: u32,
    pub(crate) key: u64,
}

impl Revoked {
    pub(crate) fn encode(&self) -> [u8; REVOKED_LEN] {
        let mut pkt = [0u8; REVOKED_LEN];
        pkt[0] = REVOKED;
        pkt[4..8].copy_from_slice(&self.slot.to_le_bytes());
        pkt[8..16].copy_from_slice(&self.key.to_le_bytes());
        pkt
    }

    /// Reads a withdrawal notice (tag already checked); `None` when it has another length.
    fn decode(pkt: &[u8]) -> Option<Revoked> {
        (pkt.len() == REVOKED_LEN).then(|| Revoked {
            slot: u32_at(pkt, 4),
            key: u64_at(pkt, 8),
        })
    }
}

/// A packet as read from the socket.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Packet {
    Wake,
    Bye,
    Offer(Offer),
    Revoked(Revoked),
    /// Another tag, or a packet of one of ours with the wrong length: ignored.
    Unknown,
}

impl Packet {
    /// Reads one packet of at least one byte (a doorbell or goodbye is known by its tag alone,
    /// whatever follows it).
    pub(crate) fn decode(pkt: &[u8]) -> Packet {
        let decoded = match pkt[0] {
            WAKE => Some(Packet::Wake),
            BYE => Some(Packet::Bye),
            OFFER => Offer::decode(pkt).map(Packet::Offer),
            REVOKED => Revoked::decode(pkt).map(Packet::Revoked),
            _ => None,
        };
        decoded.unwrap_or(Packet::Unknown)
    }
}

fn u32_at(pkt: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(pkt[i..i + 4].try_into().expect("4 bytes"))
}

fn u64_at(pkt: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(pkt[i..i + 8].try_into().expect("8 bytes"))
}

/// Sends a packet that is its tag alone ([`WAKE`], [`BYE`]) without waiting.
pub(crate) fn send_packet(sock: RawFd, tag: u8) {
    send_unwaited(sock, &[tag]);
}

/// Sends `pkt` without waiting, on `sock`, which the caller keeps open for the call. A full
/// socket drops it, which delays only what it hints at: the peer has doorbells of ours unread
/// then, and its unmapping of a withdrawn region waits for its next access or the
/// connection's end. MSG_NOSIGNAL turns a closed peer into EPIPE, ignored too: the hang-up is
/// noticed by the connection's driver.
pub(crate) fn send_unwaited(sock: RawFd, pkt: &[u8]) {
    // SAFETY: sends a live buffer of its length on a socket the caller keeps open.
    unsafe {
        libc::send(
            sock,
            pkt.as_ptr().cast(),
            pkt.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout a peer of this version reads; a change here breaks every connection
    /// between two builds of the same version.
    #[test]
    fn packets_keep_their_layout_and_read_back_as_sent() {
        let offer = Offer {
            slot: 3,
            key: 0x5eed_0001,
            addr: 0x7f12_3450_0000,
            len: 4096,
            access: 0b1110,
            kind: OfferKind::Mapped,
        };
        let pkt = offer.encode();
        assert_eq!(pkt[..8], [OFFER, 0, 0, 0, 3, 0, 0, 0]);
        assert_eq!(pkt[36..], [1, 0, 0, 0]);
        assert_eq!(Packet::decode(&pkt), Packet::Offer(offer));
        let revoked = Revoked { slot: 9, key: 7 };
        let pkt = revoked.encode();
        assert_eq!(pkt, [REVOKED, 0, 0, 0, 9, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Packet::decode(&pkt), Packet::Revoked(revoked));
        assert_eq!(Packet::decode(&[WAKE, 9, 9]), Packet::Wake);
        assert_eq!(Packet::decode(&[BYE]), Packet::Bye);
    }

    #[test]
    fn packets_of_the_wrong_length_or_kind_are_unknown() {
        let offer = Offer {
            slot: 0,
            key: 1,
            addr: 0,
            len: 1,
            access: 0,
            kind: OfferKind::Process,
        };
        let mut pkt = offer.encode();
        assert_eq!(Packet::decode(&pkt[..39]), Packet::Unknown);
        pkt[36] = 2;
        assert_eq!(Packet::decode(&pkt), Packet::Unknown);
        let revoked = Revoked { slot: 0, key: 1 }.encode();
        assert_eq!(
            Packet::decode(&[&revoked[..], &[0]].concat()),
            Packet::Unknown
        );
        assert_eq!(Packet::decode(&[5]), Packet::Unknown);
    }
}
