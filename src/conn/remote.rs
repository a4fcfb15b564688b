//! Remote memory: the descriptor a side packs for a region it lets its peer access, and the
//! [`RemoteRegion`] the peer unpacks from it and targets with one-sided operations.
//!
//! The descriptor is [`REMOTE_DESC_LEN`] bytes with a fixed, documented layout, so that a
//! program may carry it in a message, in private data, or in its own wire format:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..2 | `"RB"` |
//! | 2 | version, 1 |
//! | 3 | transport ([`Transport`]: 1 shm, 2 verbs) |
//! | 4 | the region's remote access bits ([`Access`]) |
//! | 5..8 | zero |
//! | 8..16 | address of the region's first byte in the owner's address space, little endian |
//! | 16..24 | length in bytes, little endian |
//! | 24..28 | key, little endian: 32 bits on both transports (over verbs the rkey) |
//! | 28..32 | zero |
//!
//! A key is 32 bits on both transports, so that a program that carries address, length and
//! key its own way (4 bytes of key, as a verbs rkey) works unchanged over either, through
//! [`crate::Connection::remote_from_raw`].

use crate::conn::Transport;
use crate::error::{Error, Result};
use crate::mr::Access;

/// Bytes of a packed remote-memory descriptor.
pub const REMOTE_DESC_LEN: usize = 32;

/// Most local segments one one-sided operation may gather from or scatter into.
pub const SGE_MAX: usize = 4;

const MAGIC: [u8; 2] = *b"RB";
const VERSION: u8 = 1;

/// A peer's memory region as this side targets it: unpacked from the peer's descriptor with
/// [`crate::Connection::unpack_remote`], valid on that connection only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) key: u64,
    pub(crate) access: Access,
    pub(crate) conn_id: u64,
}

impl RemoteRegion {
    /// The region's address in the peer's address space.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The region's length in bytes, as the peer described it.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the described region is empty (never, for a region the library packed).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The key the peer's library checks every access against.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The access the peer allows, as it described it (its library enforces what it
    /// registered, whatever the descriptor says).
    pub fn access(&self) -> Access {
        self.access
    }
}

/// Packs a descriptor.
pub(crate) fn pack(
    transport: Transport,
    access: Access,
    addr: u64,
    len: u64,
    key: u64,
) -> [u8; REMOTE_DESC_LEN] {
    let mut d = [0u8; REMOTE_DESC_LEN];
    d[0..2].copy_from_slice(&MAGIC);
    d[2] = VERSION;
    d[3] = transport_code(transport);
    d[4] = remote_bits(access);
    d[8..16].copy_from_slice(&addr.to_le_bytes());
    d[16..24].copy_from_slice(&len.to_le_bytes());
    d[24..32].copy_from_slice(&key.to_le_bytes());
    d
}

/// The largest key: keys are 32 bits on both transports.
pub(crate) const KEY_MAX: u64 = u32::MAX as u64;

/// `key` is a key (32 bits).
pub(crate) fn check_key(key: u64) -> Result<()> {
    if key > KEY_MAX {
        return Err(Error::invalid(format!(
            "key {key:#x} is wider than 32 bits: keys are 32 bits on both transports"
        )));
    }
    Ok(())
}

/// Unpacks a descriptor for connection `conn_id` over `transport`. Checks the form only: the
/// key and the bounds are checked when an operation uses them, against what the owner
/// registered.
pub(crate) fn unpack(desc: &[u8], transport: Transport, conn_id: u64) -> Result<RemoteRegion> {
    if desc.len() != REMOTE_DESC_LEN {
        return Err(Error::invalid(format!(
            "a remote descriptor is {REMOTE_DESC_LEN} bytes, not {}",
            desc.len()
        )));
    }
    if desc[0..2] != MAGIC || desc[2] != VERSION || desc[5..8] != [0, 0, 0] {
        return Err(Error::invalid(
            "not a remote descriptor of this library (bad magic, version or padding)",
        ));
    }
    if desc[3] != transport_code(transport) {
        return Err(Error::invalid(format!(
            "the descriptor is for another transport ({}) than the connection's ({transport:?})",
            desc[3]
        )));
    }
    let bits = desc[4] as u32;
    let remote = Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0;
    if bits & !remote != 0 {
        return Err(Error::invalid(format!(
            "unknown access bits {bits:#x} in the descriptor"
        )));
    }
    let word = |i: usize| u64::from_le_bytes(desc[i..i + 8].try_into().expect("8 bytes"));
    let (addr, len, key) = (word(8), word(16), word(24));
    check_key(key)?;
    if addr.checked_add(len).is_none() {
        return Err(Error::invalid(
            "the descriptor's range wraps past the end of the address space",
        ));
    }
    Ok(RemoteRegion {
        addr,
        len,
        key,
        access: Access(bits),
        conn_id,
    })
}

/// A region described by its raw fields (for peers that exchange address, key and length their
/// own way). Its access is every remote right: the peer's library (or device) checks what it
/// registered when an operation runs.
pub(crate) fn from_raw(addr: u64, len: u64, key: u64, conn_id: u64) -> Result<RemoteRegion> {
    check_key(key)?;
    if addr.checked_add(len).is_none() {
        return Err(Error::invalid(
            "the range wraps past the end of the address space",
        ));
    }
    Ok(RemoteRegion {
        addr,
        len,
        key,
        access: Access(Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0),
        conn_id,
    })
}

fn transport_code(t: Transport) -> u8 {
    match t {
        Transport::Shm => 1,
        Transport::Verbs => 2,
    }
}

fn remote_bits(a: Access) -> u8 {
    (a.0 & (Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_unpacks_to_what_was_packed() {
        let d = pack(
            Transport::Verbs,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            0x7f00_1234_0000,
            4096,
            0xdead_beef,
        );
        let r = unpack(&d, Transport::Verbs, 9).unwrap();
        assert_eq!(
            (r.addr(), r.len(), r.key(), r.access(), r.conn_id),
            (0x7f00_1234_0000, 4096, 0xdead_beef, Access::REMOTE_WRITE, 9)
        );
    }

    #[test]
    fn malformed_descriptors_are_refused() {
        let d = pack(Transport::Shm, Access::REMOTE_READ, 4096, 64, 1);
        assert!(unpack(&d[..31], Transport::Shm, 1).is_err());
        assert!(unpack(&d, Transport::Verbs, 1).is_err());
        for (i, v) in [(0, b'X'), (2, 2), (4, 0x80), (5, 1)] {
            let mut bad = d;
            bad[i] = v;
            assert!(unpack(&bad, Transport::Shm, 1).is_err(), "byte {i}");
        }
        let wraps = pack(Transport::Shm, Access::REMOTE_READ, u64::MAX - 8, 64, 1);
        assert!(unpack(&wraps, Transport::Shm, 1).is_err());
        let mut wide = d;
        wide[28] = 1;
        assert!(
            unpack(&wide, Transport::Shm, 1).is_err(),
            "a key over 32 bits"
        );
    }

    #[test]
    fn the_key_is_bytes_24_to_28_and_raw_fields_make_the_same_region() {
        let d = pack(
            Transport::Shm,
            Access::REMOTE_WRITE,
            0x1000,
            64,
            0xfeed_f00d,
        );
        assert_eq!(d[24..28], 0xfeed_f00du32.to_le_bytes());
        assert_eq!(d[28..32], [0; 4]);
        let key = u32::from_le_bytes(d[24..28].try_into().unwrap());
        let raw = from_raw(0x1000, 64, key.into(), 3).unwrap();
        assert_eq!(raw.key(), unpack(&d, Transport::Shm, 3).unwrap().key());
        assert!(from_raw(0x1000, 64, 1 << 32, 3).is_err());
    }
}
