//! Large messages in one copy: the receiver copies them straight from the sender's memory
//! with `process_vm_readv` (cross-memory attach), instead of the sender copying into the ring
//! and the receiver out of it.
//!
//! Whether a process may read its peer's memory depends on the kernel's ptrace rules (same
//! user, no stricter Yama setting, the same PID namespace), so each side finds out during the
//! handshake: the peer names a word of its memory and the value it holds, and this side reads
//! it. Only when that worked does this side tell the peer, in the shared segment, that it may
//! send direct records; otherwise every message goes through the ring.

use std::io;
use std::sync::OnceLock;

/// Messages of at least this many bytes, sent from caller memory, go direct when the peer can
/// read this process (it copies them with `process_vm_readv`): below it the two pipelined
/// copies through the ring are as fast.
pub(crate) const DIRECT_MIN: usize = 256 * 1024;
/// Messages of at least this many bytes, sent from a region the library allocated, go direct
/// when the peer can read this process (it copies them out of its mapping of the region, a
/// plain `memcpy`). Measured on the host in interleaved runs (`rbr_bench`, one-way p50): at
/// 64 B the ring is faster (0.150 against 0.190 us), at 256 B they are even, and from 1 KiB
/// the one copy is (0.20 against 0.29 us; 4 KiB 0.25 against 0.72 us).
pub(crate) const MAPPED_MIN: usize = 1024;

/// A word of this process's memory holding a random value, for peers to test reading it.
static PROBE: OnceLock<Box<u64>> = OnceLock::new();

/// The address and value of this process's probe word, for the handshake.
pub(crate) fn probe() -> (u64, u64) {
    let word = PROBE.get_or_init(|| {
        let mut v = 0u64;
        // SAFETY: fills 8 bytes of a live local. On failure the value stays partly known,
        // which only weakens the check against reading some other process by mistake.
        unsafe { libc::getrandom((&raw mut v).cast(), 8, 0) };
        Box::new(v | 1)
    });
    (&raw const **word as u64, **word)
}

/// Whether this process can read the peer `pid`'s memory: its probe word holds `value`.
pub(crate) fn can_read(pid: libc::pid_t, addr: u64, value: u64) -> bool {
    if pid <= 0 || addr == 0 {
        return false;
    }
    let mut got = 0u64;
    copy_from(pid, addr, (&raw mut got).cast(), 8).is_ok() && got == value
}

/// Copies `len` bytes at `addr` in process `pid` to `dst`.
///
/// `dst..dst+len` must be writable memory of this process; the kernel checks the peer's side
/// and fails the call (rather than faulting) if the peer named memory it does not have.
pub(crate) fn copy_from(pid: libc::pid_t, addr: u64, dst: *mut u8, len: usize) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        let local = libc::iovec {
            // SAFETY: done < len, inside the destination.
            iov_base: unsafe { dst.add(done) }.cast(),
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: one local iovec inside memory the caller vouches for; the remote one is
        // checked by the kernel against the peer's mappings.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        done += n as usize;
    }
    Ok(())
}
