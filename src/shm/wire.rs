//! What travels on a connection's socket, byte for byte: every packet's tag, its layout, and
//! its encoding and decoding.
//!
//! Once the connection is up its socket (a Unix seqpacket socket: one packet per send, never
//! merged or split) carries packets whose first byte is their tag. All numbers are
//! little-endian; the bytes between a tag and the first field are 0.
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
