//! The verbs transport: real RDMA through librdmacm and libibverbs (InfiniBand, RoCE,
//! soft-RoCE), on reliable-connected queue pairs.

#[cfg(feature = "verbs")]
mod cm;
#[cfg(feature = "verbs")]
mod credit;
#[cfg(feature = "verbs")]
mod devcq;
#[cfg(feature = "verbs")]
mod dispatch;
#[cfg(feature = "verbs")]
mod domain;
#[cfg(feature = "verbs")]
mod establish;
#[cfg(feature = "verbs")]
mod post;
#[cfg(feature = "verbs")]
mod preamble;
#[cfg(feature = "verbs")]
mod progress;
#[cfg(feature = "verbs")]
mod res;

#[cfg(feature = "verbs")]
pub(crate) use domain::Domain;
#[cfg(feature = "verbs")]
pub(crate) use establish::{Listener, Request};
#[cfg(feature = "verbs")]
pub(crate) use post::Conn;
#[cfg(feature = "verbs")]
pub(crate) use progress::connect;
#[cfg(feature = "verbs")]
pub(crate) use res::{Pd, Registrations, registration_error};

/// Whether this machine has at least one RDMA device.
#[cfg(feature = "verbs")]
pub(crate) fn device_present() -> bool {
    let mut n: libc::c_int = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a list (or NULL on failure) that
    // must be released with ibv_free_device_list, which is done at once.
    unsafe {
        let list = rdma_sys::ibv_get_device_list(&mut n);
        if list.is_null() {
            return false;
        }
        rdma_sys::ibv_free_device_list(list);
    }
    n > 0
}

/// Whether this machine has at least one RDMA device (never, without the `verbs` feature).
#[cfg(not(feature = "verbs"))]
pub(crate) fn device_present() -> bool {
    false
}

/// Stand-ins without the `verbs` feature, so the rest of the crate needs no `cfg`.
#[cfg(not(feature = "verbs"))]
mod absent {
    /// No protection domains without verbs.
    #[derive(Debug, Default)]
    pub(crate) struct Domain;
    /// No registrations without verbs.
    #[derive(Debug, Default)]
    pub(crate) struct Registrations;
}
#[cfg(not(feature = "verbs"))]
pub(crate) use absent::{Domain, Registrations};

#[cfg(feature = "verbs")]
mod seam {
    //! The verbs transport behind the connection core's seam.

    use std::os::fd::RawFd;
    use std::sync::Arc;
    use std::time::Instant;

    use crate::conn::seam::{ConnSeam, ListenerSeam, RequestSeam};
    use crate::conn::{ConnInfo, ConnOptions, ConnRequest, Connection, RecvRequest, SendRequest};
    use crate::cq::CompletionQueue;
    use crate::domain::ContextInner;
    use crate::error::Result;

    impl ListenerSeam for super::Listener {
        fn take(&self, deadline: Option<Instant>) -> Result<Option<ConnRequest>> {
            Ok(self.get_request(deadline)?.map(ConnRequest::new))
        }

        fn fd(&self) -> RawFd {
            super::Listener::fd(self)
        }
    }

    impl RequestSeam for super::Request {
        fn private_data(&self) -> &[u8] {
            super::Request::private_data(self)
        }

        fn accept(
            self: Box<Self>,
            cq: Arc<CompletionQueue>,
            opts: &ConnOptions,
        ) -> Result<Connection> {
            Ok(Connection::new(super::Request::accept(*self, cq, opts)?))
        }

        fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()> {
            super::Request::reject(*self, private_data)
        }
    }

    impl ConnSeam for super::Conn {
        fn info(&self) -> ConnInfo {
            super::Conn::info(self)
        }

        fn private_data(&self) -> &[u8] {
            super::Conn::private_data(self)
        }

        fn context(&self) -> &Arc<ContextInner> {
            super::Conn::context(self)
        }

        fn send(&self, wr: SendRequest<'_>) -> Result<()> {
            super::Conn::send(self, wr)
        }

        fn recv(&self, wr: RecvRequest<'_>) -> Result<()> {
            super::Conn::recv(self, wr)
        }

        fn disconnect(&self) {
            super::Conn::disconnect(self)
        }
    }
}
