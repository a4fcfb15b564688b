//! The shared-memory transport, for peers on the same host.
//!
//! A connection is a Unix-socket handshake (credentials checked, private data both ways) that
//! hands over a sealed memfd with two lock-free byte rings, one per direction. Posting writes
//! into the rings on the caller's thread, and polling the completion queue takes from them
//! (`flow.rs`). Each completion queue has a notice board on which peers mark the connections
//! with news (`notice.rs`), so a poll looks at those only. The context's progress driver
//! watches for the peer leaving and moves data only while nobody else does (`engine.rs`), for
//! all its connections on one thread.

mod conn;
mod direct;
mod engine;
mod flow;
mod handshake;
pub(crate) mod notice;
mod ring;
mod segment;

pub(crate) use conn::Conn;
pub(crate) use handshake::{Listener, Request, connect};

mod seam {
    //! The shm transport behind the connection core's seam.

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
