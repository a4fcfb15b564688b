//! This side's imports: the peer's offers read from the connection's socket, the regions they
//! map, and the posters' cache of the last one used.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::shortcut::{Published, Shortcut};
use super::{REMOTE_BITS, offset_in};
use crate::mr::Access;
use crate::shm::segment::EXPORT_SLOTS;
use crate::shm::socket::{Received, recv_with_fds};
use crate::shm::wire::{Offer, OfferKind, Packet, Revoked};
use crate::sys::cvt;

/// Where an imported region is.
pub(super) enum Target {
    /// Mapped into this process (a memfd): `len` bytes at `base`.
    Mapped { base: NonNull<u8>, len: usize },
    /// In the peer's process, reached with process_vm_writev/readv.
    Process,
}

/// A region of the peer's that this side may reach, as the peer offered it.
pub(crate) struct Import {
    pub(super) key: u64,
    pub(super) slot: usize,
    addr: u64,
    len: u64,
    access: u32,
    pub(super) target: Target,
    /// The connection's lock-free write path, once this import was published there: its
    /// mapping then retires there (see `shortcut.rs`).
    shortcut: OnceLock<Arc<Shortcut>>,
}

// SAFETY: the mapping is process-wide memory; an import only hands out bounds-checked accesses
// to it, and unmaps it only when dropped (when no access can hold it any more).
unsafe impl Send for Import {}
// SAFETY: as above.
unsafe impl Sync for Import {}

impl Drop for Import {
    fn drop(&mut self) {
        if let Target::Mapped { base, len } = self.target {
            match self.shortcut.get() {
                Some(s) => s.retire(self.slot, base, len),
                // SAFETY: base/len are what mmap returned in `Import::map`; the last holder is
                // gone, and the lock-free write path never reached it.
                None => unsafe {
                    libc::munmap(base.as_ptr().cast(), len);
                },
            }
        }
    }
}

impl Import {
    /// Checks an offer (and its descriptor); `None` when it is not a valid one (its key then
    /// stays unknown, and accesses with it fail).
    pub(super) fn from_offer(offer: &Offer, fd: Option<OwnedFd>) -> Option<Import> {
        let Offer {
            slot,
            key,
            addr,
            len,
            access,
            kind,
        } = *offer;
        let slot = slot as usize;
        if slot >= EXPORT_SLOTS
            || key == 0
            || len == 0
            || access & !REMOTE_BITS != 0
            || addr.checked_add(len).is_none()
        {
            return None;
        }
        let target = match (kind, fd) {
            (OfferKind::Process, None) => {
                if access & Access::REMOTE_ATOMIC.0 != 0 {
                    return None;
                }
                Target::Process
            }
            (OfferKind::Mapped, Some(fd)) => {
                let writable = access & (Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0) != 0;
                Self::map(&fd, len, writable)?
            }
            _ => return None,
        };
        Some(Import {
            key,
            slot,
            addr,
            len,
            access,
            target,
            shortcut: OnceLock::new(),
        })
    }

    /// Publishes this import on the connection's lock-free write path `s` when it is a
    /// writable region mapped here. The caller holds the connection's import cache lock (see
    /// [`Shortcut::publish`]).
    pub(crate) fn publish(&self, s: &Arc<Shortcut>) {
        let Target::Mapped { base, .. } = self.target else {
            return;
        };
        if self.access & Access::REMOTE_WRITE.0 == 0 {
            return;
        }
        // First: from here on the mapping retires through `s` when this import goes.
        self.shortcut.get_or_init(|| s.clone());
        s.publish(Published {
            key: self.key,
            slot: self.slot,
            addr: self.addr,
            len: self.len,
            base,
        });
    }

    /// Maps `len` bytes of the peer's memfd, checking that the file holds them and cannot
    /// shrink under the mapping.
    fn map(fd: &OwnedFd, len: u64, writable: bool) -> Option<Target> {
        let len = usize::try_from(len).ok()?;
        // SAFETY: plain syscall on a descriptor we own.
        let seals = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }).ok()?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return None;
        }
        let st = crate::sys::fstat(fd).ok()?;
        if usize::try_from(st.st_size).ok()? < len {
            return None;
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping chosen by the kernel; nothing is overwritten. The file holds
        // `len` bytes and is sealed against shrinking, so the mapping never faults.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(Target::Mapped {
            base: NonNull::new(p.cast())?,
            len,
        })
    }

    /// Where an access needing the rights `need` to `len` bytes at the peer's address `addr`
    /// starts in the region, when the region allows it and holds every byte of it.
    #[inline(always)]
    pub(super) fn reach(&self, need: u32, addr: u64, len: usize) -> Option<usize> {
        if self.access & need != need {
            return None;
        }
        self.offset(addr, len)
    }

    /// Where `len` bytes at the peer's address `addr` start in the region, when they all lie
    /// inside it.
    pub(super) fn offset(&self, addr: u64, len: usize) -> Option<usize> {
        offset_in(self.addr, self.len, addr, len)
    }
}

/// This side's reader of the connection's socket, and the regions of the peer it knows.
/// Whoever reads the socket holds it (one reader at a time).
#[derive(Default)]
pub(crate) struct SocketReader {
    /// The peer said goodbye.
    pub(crate) said_bye: bool,
    /// The socket reached its end (`broken`: with an error): the peer is gone.
    pub(crate) eof: bool,
    pub(crate) broken: bool,
    imports: HashMap<u64, Arc<Import>>,
    /// Counts the imports forgotten (withdrawn, replaced, or all at the end), so that a
    /// poster's cached import (see [`ImportCache`]) can tell, without this lock, that it may
    /// be stale.
    forgotten: Arc<AtomicU64>,
}

/// The import a connection's last one-sided operation used, kept under its own lock (which
/// pollers never take, see `conn::ConnState::imports`) so that the next operation with the same
/// key skips the flow's lock, the inbox's lock, its map and a reference count. Only a cache:
/// every access still checks the key against the peer's export table (`run`), so a stale entry
/// cannot reach a withdrawn region; it is dropped as soon as the inbox forgets anything, so
/// that the mapping goes with the region. Whoever holds it publishes the import it reaches on
/// the connection's lock-free write path (`shortcut.rs`).
#[derive(Default)]
pub(crate) struct ImportCache {
    entry: Option<(u64, Arc<Import>)>,
}

impl ImportCache {
    /// The cached import for `key`, if the inbox forgot nothing since it was taken (`seen`: the
    /// inbox's count now).
    pub(crate) fn get(&self, key: u64, seen: u64) -> Option<&Import> {
        match &self.entry {
            Some((g, imp)) if *g == seen && imp.key == key => Some(imp),
            _ => None,
        }
    }

    /// Caches `imp` (or nothing), taken from the inbox when its count was `seen`.
    pub(crate) fn set(&mut self, seen: u64, imp: Option<Arc<Import>>) {
        self.entry = imp.map(|i| (seen, i));
    }

    /// Drops the entry if the inbox forgot anything since it was taken.
    pub(crate) fn drop_stale(&mut self, seen: u64) {
        if self.entry.as_ref().is_some_and(|(g, _)| *g != seen) {
            self.entry = None;
        }
    }
}

impl SocketReader {
    /// Reads every packet the socket holds: doorbells, goodbye, offers (mapped and recorded),
    /// the end. Returns whether a doorbell or goodbye was among them.
    pub(crate) fn drain(&mut self, sock: RawFd) -> bool {
        let mut news = false;
        let mut buf = [0u8; 64];
        let mut cbuf = [0u64; 4];
        while !self.eof {
            match recv_with_fds(sock, &mut buf, &mut cbuf) {
                Ok(Received { len: 0, .. }) => self.eof = true,
                Ok(Received {
                    len,
                    mut fds,
                    flags,
                }) => {
                    let pkt = &buf[..len];
                    match Packet::decode(pkt) {
                        Packet::Wake => news = true,
                        Packet::Bye => {
                            news = true;
                            self.said_bye = true;
                        }
                        Packet::Offer(offer) if fds.len() <= 1 && flags & libc::MSG_TRUNC == 0 => {
                            if let Some(imp) = Import::from_offer(&offer, fds.pop()) {
                                // A slot offered again carries a new region: the old one is gone.
                                let had = self.imports.len();
                                self.imports.retain(|_, i| i.slot != imp.slot);
                                if self.imports.len() != had {
                                    self.note_forgotten();
                                }
                                self.imports.insert(imp.key, Arc::new(imp));
                            }
                        }
                        Packet::Revoked(Revoked { slot, key })
                            if self
                                .imports
                                .get(&key)
                                .is_some_and(|i| i.slot == slot as usize) =>
                        {
                            self.imports.remove(&key);
                            self.note_forgotten();
                        }
                        // Anything else is not ours to understand; its descriptors close.
                        _ => {}
                    }
                }
                Err(e) => match e.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => {}
                    // A peer that closes with doorbells of ours still unread makes the kernel
                    // report a reset before the packets it sent first - its goodbye among
                    // them. The report is consumed by reading it: read on, and the goodbye (if
                    // it said one) and the end of file follow.
                    io::ErrorKind::ConnectionReset => {}
                    _ => {
                        self.eof = true;
                        self.broken = true;
                    }
                },
            }
        }
        news
    }

    /// The import with `key`, if the peer offered it.
    pub(crate) fn get(&self, key: u64) -> Option<Arc<Import>> {
        self.imports.get(&key).cloned()
    }

    /// As [`SocketReader::get`], reading the socket first when the key is not known yet: its offer
    /// may still be there. The flag is [`SocketReader::drain`]'s: doorbells or a goodbye were read,
    /// which are the background work's.
    pub(crate) fn find(&mut self, key: u64, sock: RawFd) -> (Option<Arc<Import>>, bool) {
        if let Some(i) = self.get(key) {
            return (Some(i), false);
        }
        let news = self.drain(sock);
        (self.get(key), news)
    }

    /// Forgets the import with `key` (the peer withdrew it); its mapping goes with its last
    /// holder.
    pub(crate) fn forget(&mut self, key: u64) {
        if self.imports.remove(&key).is_some() {
            self.note_forgotten();
        }
    }

    /// Forgets every import (the connection ended).
    pub(crate) fn clear(&mut self) {
        self.imports.clear();
        self.note_forgotten();
    }

    /// The count of forgetting, shared with the connection's posters (see [`ImportCache`]).
    pub(crate) fn forgotten(&self) -> Arc<AtomicU64> {
        self.forgotten.clone()
    }

    fn note_forgotten(&self) {
        // Release: the map's change comes before the count a poster compares (a poster that
        // misses the change still has its access refused by the export table's key).
        self.forgotten.fetch_add(1, Ordering::Release);
    }
}
