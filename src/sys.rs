//! Thin safe wrappers over the few libc calls the core needs: eventfd, poll, errno.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// The calling thread's last OS error.
pub(crate) fn last_os_error() -> io::Error {
    io::Error::last_os_error()
}

/// Maps a `-1`-on-failure libc return value to an `io::Result`.
pub(crate) fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(last_os_error())
    } else {
        Ok(ret)
    }
}

/// Creates a memfd of `len` bytes, sealed so that no process holding it can resize it: memory
/// shared with a peer that cannot shrink under a mapping.
pub(crate) fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is NUL-terminated and the flags are valid.
    let fd = cvt(unsafe {
        libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    })?;
    // SAFETY: `fd` is fresh and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscalls on a descriptor we own.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
    // SAFETY: as above.
    cvt(unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    })?;
    Ok(fd)
}

/// What `fstat` says of `fd`.
pub(crate) fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall on a descriptor the caller owns, into a live local.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

/// Maps the first `len` bytes of `fd` shared and read-write. The caller unmaps them.
pub(crate) fn map_shared(fd: &OwnedFd, len: usize) -> io::Result<std::ptr::NonNull<u8>> {
    // SAFETY: a fresh mapping chosen by the kernel; nothing is overwritten, and the result is
    // checked against MAP_FAILED. Accessing the mapping past the file's end is the caller's to
    // rule out (memfds are sized, or sealed against shrinking, before mapping).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(last_os_error());
    }
    Ok(std::ptr::NonNull::new(p.cast()).expect("mmap never returns NULL on success"))
}

/// A non-blocking eventfd used as a level-triggered readiness flag.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a non-negative return is a new descriptor we own.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the descriptor readable (adds one to its counter).
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local u64 to a descriptor we own. The only possible
        // failure is EAGAIN on counter overflow, when the fd is readable anyway.
        unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Makes the descriptor unreadable (resets its counter to zero).
    pub(crate) fn clear(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live local u64 from a descriptor we own; EAGAIN (already
        // zero) is the expected failure and leaves nothing to do.
        unsafe { libc::read(self.0.as_raw_fd(), (&raw mut v).cast(), 8) };
    }

    pub(crate) fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Converts an optional timeout into poll(2)'s milliseconds (-1 = forever), rounding up so a
/// short timeout never becomes a busy poll of zero.
pub(crate) fn poll_ms(timeout: Option<Duration>) -> libc::c_int {
    match timeout {
        None => -1,
        Some(d) => {
            let ms = d.as_micros().div_ceil(1000);
            ms.min(i32::MAX as u128) as libc::c_int
        }
    }
}

/// Time left until `deadline`, or `None` for no deadline. Saturates at zero.
pub(crate) fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// Waits until one of `fds` reports one of its requested events, or the timeout passes.
/// Returns the number of ready descriptors (0 on timeout). EINTR restarts with the time left.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let ms = poll_ms(remaining(deadline));
        // SAFETY: `fds` is a live, exclusively borrowed slice of pollfd and its length is passed.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Waits for `events` on one descriptor; true if ready, false on timeout.
pub(crate) fn poll_one(
    fd: RawFd,
    events: libc::c_short,
    timeout: Option<Duration>,
) -> io::Result<bool> {
    let mut p = [libc::pollfd {
        fd,
        events,
        revents: 0,
    }];
    Ok(poll(&mut p, timeout)? > 0)
}
