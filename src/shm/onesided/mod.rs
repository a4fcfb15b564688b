//! One-sided operations over shm: the regions a side lets its peer reach (exports,
//! `export.rs`), the peer's view of them (imports, `import.rs`), and the accesses themselves
//! (`access.rs`).
//!
//! **Offers.** Exposing a region on a connection gives it a random 32-bit key (never a
//! counter; 32 bits as a verbs rkey, so that a program carries keys of either transport the
//! same way), unique among the connection's live keys and unlike the slot's previous one, and a
//! slot in this side's export table in the shared segment (`segment.rs`,
//! [`Export`](crate::shm::segment::Export)), stores the key in the slot's `live` word, and
//! sends the peer an offer on the connection's socket before returning (`wire.rs`): slot,
//! key, address, length and remote access bits, plus, for a region the library allocated, its
//! memfd (SCM_RIGHTS; a read-only descriptor when the offer grants no write or atomic access).
//! The packet is in the peer's socket before the descriptor the program sends can arrive
//! there.
//!
//! **Imports.** The peer reads offers from the socket - its connection's background work does,
//! and so does a post that names a key it does not know yet (one reader at a time) - maps a
//! received memfd shared (read-only unless the offer grants write or atomic access), and keeps
//! key -> (mapping, slot, address, length, access). Caller memory comes without a descriptor
//! and is reached with `process_vm_writev`/`process_vm_readv`.
//!
//! **Accesses** run on the poster's thread. Each one is checked against the import (key,
//! range, access; the length of a mapping was checked against the memfd's size when it was
//! mapped), then claims the slot's `busy` word, checks that `live` still holds the key, copies
//! or runs the atomic instruction on the mapping (no system call), and lowers `busy`. A check
//! that fails touches nothing: the operation completes with
//! [`WcStatus::RemoteAccess`](crate::WcStatus::RemoteAccess) and the connection fails. The
//! common unsignaled write into a mapped region takes no lock of the connection's
//! (`shortcut.rs`).
//!
//! **Revocation** is synchronous: when a region is dropped, each connection it was exposed on
//! clears the slot's `live` word and then waits until `busy` is 0 (see
//! [`Export`](crate::shm::segment::Export) for why the two cannot miss each other), before the
//! region's memory goes. The wait is bounded: it ends
//! at once when the peer's process has exited, and after [`REVOKE_WAIT`] in any case (a peer
//! that holds `busy` up that long is not following the protocol). A connection that ends
//! withdraws all its regions the same way. After a withdrawal the owner also sends the peer a
//! notice on the socket, so that it unmaps the region at once rather than at its next access
//! or the connection's end.

mod access;
mod export;
mod import;
mod shortcut;

use std::time::Duration;

use crate::mr::Access;

pub(crate) use access::{copy_mapped, run};
pub(crate) use export::Exports;
pub(crate) use import::{Import, ImportCache, SocketReader};
pub(crate) use shortcut::Shortcut;

/// Longest a revocation waits for the peer's accesses in progress.
pub(crate) const REVOKE_WAIT: Duration = Duration::from_secs(10);

const REMOTE_BITS: u32 = Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0;

/// Where `len` bytes at the peer's address `addr` start in a region of `size` bytes at the
/// peer's address `start`, when they all lie inside it.
#[inline(always)]
pub(crate) fn offset_in(start: u64, size: u64, addr: u64, len: usize) -> Option<usize> {
    let off = addr.checked_sub(start)?;
    let end = off.checked_add(len as u64)?;
    (end <= size).then_some(off as usize)
}

/// Why an access did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The key, range or access right is not what the peer registered: nothing was touched.
    Denied,
    /// The peer withdrew the region: nothing was touched.
    Withdrawn,
}
