//! The connection's Unix socket: creating and addressing it, the peer's credentials, and
//! packets with the descriptors they carry (SCM_RIGHTS): the establishment's messages here,
//! and the offers of regions (`onesided/`).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use crate::error::{Error, Result};
use crate::shm::wire::{FDS_MAX, MSG_MAX};
use crate::sys::cvt;

pub(crate) fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; a non-negative result is a new descriptor we own.
    let fd = cvt(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    })?;
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The abstract socket address of `name` and its length.
pub(crate) fn address(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = format!("rdmabridge/{name}");
    // sun_path[0] stays 0: the abstract namespace. Names are capped at parse time to fit.
    for (i, b) in path.bytes().enumerate() {
        sa.sun_path[i + 1] = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + path.len();
    (sa, len as libc::socklen_t)
}

/// The peer's user and process ids.
pub(crate) fn peer_cred(fd: RawFd) -> io::Result<(u32, libc::pid_t)> {
    // SAFETY: ucred is plain data; getsockopt fills at most `len` bytes of it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: pointers to live locals with their true sizes.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    })?;
    Ok((cred.uid, cred.pid))
}

pub(crate) fn my_uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// A connected pair of seqpacket sockets (non-blocking), as the two ends of a connection.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn pair() -> (OwnedFd, OwnedFd) {
    let mut sv = [0; 2];
    // SAFETY: plain syscall into a live local array of two descriptors.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
            sv.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "socketpair");
    // SAFETY: fresh descriptors owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) }
}

/// Sends `pkt` with `fds` attached (at most 4) in one `sendmsg` with `flags`: the bytes sent.
pub(crate) fn send_with_fds(
    sock: RawFd,
    pkt: &[u8],
    fds: &[RawFd],
    flags: libc::c_int,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: pkt.as_ptr().cast_mut().cast(),
        iov_len: pkt.len(),
    };
    let mut cbuf = [0u64; 4]; // CMSG_SPACE of 4 descriptors, 8-aligned
    // SAFETY: msghdr is plain data; zero is a valid "no name, no control" value.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(bytes) } as usize;
        assert!(
            space <= std::mem::size_of_val(&cbuf),
            "at most 4 descriptors"
        );
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = space;
        // SAFETY: the control buffer is large enough for one header carrying `fds` (checked
        // above), so CMSG_FIRSTHDR is non-null and CMSG_DATA points inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
            let data = libc::CMSG_DATA(c).cast::<RawFd>();
            for (i, &fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd);
            }
        }
    }
    // SAFETY: `mh` points at live locals (iov, pkt, cbuf) for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &mh, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// A packet [`recv_with_fds`] took.
pub(crate) struct Received {
    /// Its length; 0 at the end of file.
    pub(crate) len: usize,
    /// The descriptors that came with it, owned (closed unless used).
    pub(crate) fds: Vec<OwnedFd>,
    /// The receive's `msg_flags` (`MSG_TRUNC`, `MSG_CTRUNC`).
    pub(crate) flags: libc::c_int,
}

/// Receives one packet into `buf` without waiting, with room for the control messages in
/// `cbuf` (the kernel closes descriptors beyond it, and says `MSG_CTRUNC`). Every descriptor
/// that came is owned before anything else, so that none leaks whatever the packet is.
pub(crate) fn recv_with_fds(sock: RawFd, buf: &mut [u8], cbuf: &mut [u64]) -> io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; zero is a valid starting value.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = std::mem::size_of_val(cbuf);
    // SAFETY: `mh` points at live buffers of the sizes it states.
    let n = unsafe { libc::recvmsg(sock, &mut mh, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`, with the libc macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count =
                    ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
    }
    Ok(Received {
        len: n as usize,
        fds,
        flags: mh.msg_flags,
    })
}

/// Sends one message, with `fds` attached (at most [`FDS_MAX`]).
pub(crate) fn send_msg(sock: RawFd, msg: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= FDS_MAX);
    let n = send_with_fds(sock, msg, fds, libc::MSG_NOSIGNAL)?;
    if n != msg.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short handshake send",
        ));
    }
    Ok(())
}

/// Receives one message if one is there, with the descriptors attached to it: `None` when
/// none is (the socket is non-blocking and the receive never waits, so no poll comes first).
pub(crate) fn recv_msg(sock: RawFd) -> Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut buf = [0u8; MSG_MAX + 1];
    let mut cbuf = [0u64; 8];
    let Received { len: n, fds, flags } = match recv_with_fds(sock, &mut buf, &mut cbuf) {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(Error::Connect(e)),
    };
    if n == 0 {
        return Err(Error::Connect(io::Error::from(
            io::ErrorKind::ConnectionReset,
        )));
    }
    if flags & libc::MSG_CTRUNC != 0 && fds.is_empty() {
        // A descriptor was sent but could not be installed: this process is out of them.
        return Err(Error::Connect(io::Error::from_raw_os_error(libc::EMFILE)));
    }
    // The buffer holds one byte more than a message may have, so a message of exactly that
    // length arrives whole, without MSG_TRUNC: it is oversized all the same.
    if flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 || n > MSG_MAX || fds.len() > FDS_MAX {
        return Err(Error::Protocol("handshake: oversized message".into()));
    }
    Ok(Some((buf[..n].to_vec(), fds)))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;
    use crate::conn::PRIVATE_DATA_MAX;
    use crate::cq::notice::NO_SLOT;
    use crate::shm::peers::OFFERS_MAX;
    use crate::shm::wire::encode_hello;

    /// Found by the handshake fuzz target: a message one byte longer than any valid one fit
    /// the receive buffer exactly and was passed on as if it had a valid size.
    #[test]
    fn messages_longer_than_the_longest_are_refused_at_every_length() {
        let (tx, rx) = pair();
        for len in [MSG_MAX + 1, MSG_MAX + 2, 4 * MSG_MAX] {
            send_msg(tx.as_raw_fd(), &vec![0x10; len], &[]).unwrap();
            match recv_msg(rx.as_raw_fd()) {
                Err(Error::Protocol(m)) => assert!(m.contains("oversized"), "{m}"),
                other => panic!("{len} bytes: {other:?}"),
            }
        }
        let longest = encode_hello(1, 1, NO_SLOT, &[7; PRIVATE_DATA_MAX], &[9; OFFERS_MAX]);
        assert_eq!(longest.len(), MSG_MAX);
        send_msg(tx.as_raw_fd(), &longest, &[]).unwrap();
        let (got, fds) = recv_msg(rx.as_raw_fd()).unwrap().expect("a message");
        assert_eq!((got, fds.len()), (longest, 0));
    }
}
