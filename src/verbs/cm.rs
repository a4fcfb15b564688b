//! RDMA CM objects: event channels, CM ids, and events copied out and acked at once.
//!
//! Every event is copied (type, status, ids, private data) and acked before anything else
//! happens, so `rdma_destroy_id` never waits for an unacked event. Each connection's id lives
//! on an event channel of its own (an accepted one is migrated there), dropped after the id.

use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::RawFd;
use std::time::Instant;

use rdma_sys as sys;

use crate::error::{Error, Result};

/// A connection set-up call's failure, named: `what` failed with the error it gets.
pub(crate) fn cm_err(what: &'static str) -> impl Fn(io::Error) -> Error {
    move |e| Error::Connect(io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// An RDMA CM event channel; destroyed on drop (after every id on it).
pub(crate) struct EventChannel(*mut sys::rdma_event_channel);

// SAFETY: the channel is a kernel object reached through an fd; librdmacm's calls on it are
// thread-safe, and ownership moves between threads only whole.
unsafe impl Send for EventChannel {}
// SAFETY: as above; only `fd()` and `get_event` (serialized by callers) use it through `&self`.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub(crate) fn new() -> Result<EventChannel> {
        // SAFETY: plain constructor; NULL (with errno) on failure.
        let ch = unsafe { sys::rdma_create_event_channel() };
        if ch.is_null() {
            let e = io::Error::last_os_error();
            return Err(if e.raw_os_error() == Some(libc::ENODEV) {
                Error::NoDevice
            } else {
                Error::Connect(e)
            });
        }
        let ch = EventChannel(ch);
        set_nonblocking(ch.fd())?;
        Ok(ch)
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: the channel is live for as long as `self`.
        unsafe { (*self.0).fd }
    }

    pub(crate) fn raw(&self) -> *mut sys::rdma_event_channel {
        self.0
    }

    /// The next event, waiting until `deadline` (`None` = forever); `Ok(None)` on timeout.
    pub(crate) fn get_event(&self, deadline: Option<Instant>) -> Result<Option<CmEvent>> {
        loop {
            let left = crate::sys::remaining(deadline);
            if !crate::sys::poll_one(self.fd(), libc::POLLIN, left).map_err(Error::Connect)? {
                return Ok(None);
            }
            let mut ev: *mut sys::rdma_cm_event = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; `ev` is written on success.
            if unsafe { sys::rdma_get_cm_event(self.0, &mut ev) } != 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Connect(e));
            }
            // SAFETY: a successful rdma_get_cm_event returns a live event, read then acked once.
            let copy = unsafe { CmEvent::copy(&*ev) };
            // SAFETY: acks the event just copied; it is not touched afterwards.
            unsafe { sys::rdma_ack_cm_event(ev) };
            return Ok(Some(copy));
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel is destroyed before it (ids hold no reference the
        // channel needs; owners drop ids first), and it is destroyed once.
        unsafe { sys::rdma_destroy_event_channel(self.0) };
    }
}

/// An event, copied out of librdmacm's storage.
#[derive(Debug)]
pub(crate) struct CmEvent {
    pub(crate) kind: u32,
    pub(crate) status: i32,
    pub(crate) id: *mut sys::rdma_cm_id,
    pub(crate) private_data: Vec<u8>,
    /// A connection request's (or its answer's) RDMA reads and atomics that the sender
    /// accepts from this side at once.
    pub(crate) responder_resources: u8,
}

impl CmEvent {
    /// # Safety
    /// `ev` must be a live event from `rdma_get_cm_event`, not yet acked.
    unsafe fn copy(ev: &sys::rdma_cm_event) -> CmEvent {
        // SAFETY: for connection events `param.conn` is the active union member; its
        // private_data points at private_data_len readable bytes (or is NULL).
        let private_data = unsafe {
            let conn = &ev.param.conn;
            if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    conn.private_data_len as usize,
                )
                .to_vec()
            }
        };
        // SAFETY: as above; for other events the byte is zero or meaningless, and only
        // connection requests read it.
        let responder_resources = unsafe { ev.param.conn.responder_resources };
        CmEvent {
            kind: ev.event,
            status: ev.status,
            id: ev.id,
            private_data,
            responder_resources,
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        use sys::rdma_cm_event_type::*;
        match self.kind {
            RDMA_CM_EVENT_ADDR_RESOLVED => "ADDR_RESOLVED",
            RDMA_CM_EVENT_ADDR_ERROR => "ADDR_ERROR",
            RDMA_CM_EVENT_ROUTE_RESOLVED => "ROUTE_RESOLVED",
            RDMA_CM_EVENT_ROUTE_ERROR => "ROUTE_ERROR",
            RDMA_CM_EVENT_CONNECT_REQUEST => "CONNECT_REQUEST",
            RDMA_CM_EVENT_CONNECT_ERROR => "CONNECT_ERROR",
            RDMA_CM_EVENT_UNREACHABLE => "UNREACHABLE",
            RDMA_CM_EVENT_REJECTED => "REJECTED",
            RDMA_CM_EVENT_ESTABLISHED => "ESTABLISHED",
            RDMA_CM_EVENT_DISCONNECTED => "DISCONNECTED",
            RDMA_CM_EVENT_DEVICE_REMOVAL => "DEVICE_REMOVAL",
            RDMA_CM_EVENT_TIMEWAIT_EXIT => "TIMEWAIT_EXIT",
            _ => "other",
        }
    }
}

/// A CM id. Destroyed on drop; its QP (if any) must be destroyed first (see `Qp`).
pub(crate) struct CmId(pub(crate) *mut sys::rdma_cm_id);

// SAFETY: a CM id is used by one owner at a time; librdmacm calls on it are thread-safe.
unsafe impl Send for CmId {}
// SAFETY: shared use is limited to reading `verbs`/`qp` pointers that do not change once set.
unsafe impl Sync for CmId {}

impl CmId {
    pub(crate) fn new(ch: &EventChannel) -> Result<CmId> {
        let mut id = std::ptr::null_mut();
        // SAFETY: the channel is live; `id` is written on success.
        let r = unsafe {
            sys::rdma_create_id(
                ch.raw(),
                &mut id,
                std::ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if r != 0 {
            return Err(Error::Connect(io::Error::last_os_error()));
        }
        Ok(CmId(id))
    }

    /// Moves the id (from a connection request) onto `ch`, so its events arrive there.
    pub(crate) fn migrate(&self, ch: &EventChannel) -> Result<()> {
        // SAFETY: both live; librdmacm moves pending events of the id along with it.
        if unsafe { sys::rdma_migrate_id(self.0, ch.raw()) } != 0 {
            return Err(Error::Accept(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// The peer's address: the one resolved for a client's id, the requester's for an id
    /// from a connection request. `None` before there is one, or for a family other than IP.
    pub(crate) fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is live; its route's destination is a sockaddr_storage-sized union
        // that librdmacm fills (zeroed, family 0, until then).
        let sa = unsafe { sys::rdma_get_peer_addr(&*self.0) };
        match i32::from(sa.sa_family) {
            libc::AF_INET => {
                // SAFETY: the family says the storage holds a sockaddr_in, which it has room for.
                let sin = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in>() };
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
            }
            libc::AF_INET6 => {
                // SAFETY: as above, for a sockaddr_in6.
                let sin6 = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in6>() };
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
            }
            _ => None,
        }
    }

    /// The device context the id is bound to (set once an address is resolved or bound).
    pub(crate) fn verbs(&self) -> *mut sys::ibv_context {
        // SAFETY: the id is live.
        unsafe { (*self.0).verbs }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: every event of this id was acked as it was read, so this cannot block on one;
        // the id is destroyed once, after its QP.
        unsafe { sys::rdma_destroy_id(self.0) };
    }
}

pub(crate) fn set_nonblocking(fd: RawFd) -> Result<()> {
    // SAFETY: fcntl on a descriptor owned by a live librdmacm/libibverbs object.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(Error::Connect(io::Error::last_os_error()));
    }
    Ok(())
}

/// A socket address for `host:port` (IP literal or resolvable name).
pub(crate) fn sockaddr(host: &str, port: u16) -> Result<(libc::sockaddr_storage, SocketAddr)> {
    let sa = match host.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, port),
        Err(_) => (host, port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Address {
                addr: format!("{host}:{port}"),
                reason: "cannot resolve host".into(),
            })?,
    };
    // SAFETY: sockaddr_storage is plain data; zero is valid.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match sa {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&raw mut st).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = port.to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
        }
        SocketAddr::V6(v6) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6.
            let sin6 = unsafe { &mut *(&raw mut st).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = port.to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            sin6.sin6_scope_id = v6.scope_id();
        }
    }
    Ok((st, sa))
}
