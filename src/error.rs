//! The crate's one error type. Each variant names what failed; the C surface maps every variant
//! to an `rbr_status` code in exactly one place (`src/ffi/error.rs`).

use std::io;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in rdmabridge.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument is out of range or malformed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An offset and length do not lie inside the memory region.
    #[error("range {offset}+{len} is outside the memory region of {region_len} bytes")]
    Range {
        /// Offset asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// The memory region was not registered with the access the operation needs.
    #[error("memory region lacks access: {0}")]
    Access(&'static str),
    /// The address is malformed or names nothing that can be resolved.
    #[error("bad address {addr:?}: {reason}")]
    Address {
        /// The address as given.
        addr: String,
        /// Why it was refused.
        reason: String,
    },
    /// The operation or transport is not available in this build or on this machine.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The verbs transport was asked for and this machine has no RDMA device.
    #[error("no RDMA device on this machine")]
    NoDevice,
    /// The peer cannot be reached (no route, or it does not answer).
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// No route to the peer could be resolved.
    #[error("route resolution failed: {0}")]
    Route(String),
    /// Establishing the connection failed after it started.
    #[error("connection establishment failed: {0}")]
    ConnectFailed(String),
    /// The RDMA device went away.
    #[error("the RDMA device was removed")]
    DeviceRemoved,
    /// Nobody listens at the address.
    #[error("connection refused: nobody listens at {0}")]
    Refused(String),
    /// The listener rejected the request; carries the listener's private data.
    #[error("connection rejected by the peer ({} bytes of private data)", .0.len())]
    Rejected(Vec<u8>),
    /// The listener refused the request because of who the caller is (peer credentials).
    #[error("permission denied: {0}")]
    Permission(String),
    /// The peer speaks a protocol version or format this library does not.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Something did not happen within its timeout.
    #[error("timed out while {0}")]
    Timeout(&'static str),
    /// The connection is down; no more work can be posted.
    #[error("the connection is disconnected")]
    Disconnected,
    /// The send or receive queue already holds its depth of outstanding work.
    #[error("the {0} queue is full")]
    QueueFull(&'static str),
    /// The address is already in use by another listener.
    #[error("address {0} is already in use")]
    AddrInUse(String),
    /// The object is in the wrong state for the operation.
    #[error("wrong state: {0}")]
    State(&'static str),
    /// Creating the listening socket failed.
    #[error("listen failed: {0}")]
    Listen(#[source] io::Error),
    /// Connecting or exchanging the handshake failed.
    #[error("connect failed: {0}")]
    Connect(#[source] io::Error),
    /// Accepting a connection request failed.
    #[error("accept failed: {0}")]
    Accept(#[source] io::Error),
    /// Creating or mapping shared memory failed.
    #[error("shared memory failed: {0}")]
    SharedMemory(#[source] io::Error),
    /// Allocating or registering a memory region failed.
    #[error("memory registration failed: {0}")]
    MemoryRegion(#[source] io::Error),
    /// Registering a memory region with an RDMA device failed with ENOMEM or EPERM: pinned
    /// memory counts against the locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`), which
    /// this reports with the size asked. Registration happens at the region's first use with
    /// a device (its first post), not when it is allocated.
    #[error(
        "memory registration of {len} bytes failed: {source}; locked memory is limited by \
         RLIMIT_MEMLOCK (ulimit -l) to {limit} (raise it, or register less)"
    )]
    MemoryLock {
        /// Bytes the registration asked to pin.
        len: usize,
        /// The limit at the time, as text (e.g. "65536 bytes, hard limit 65536 bytes").
        limit: String,
        /// What the device reported.
        #[source]
        source: io::Error,
    },
    /// A work request completed with an error status (see [`crate::WcStatus`]); after any
    /// but a flush the connection fails too, as a queue pair does.
    #[error("{opcode:?} work request failed: {status:?}")]
    WorkRequest {
        /// What the request was.
        opcode: crate::Opcode,
        /// How it ended.
        status: crate::WcStatus,
    },
    /// Creating or waiting on a completion queue failed.
    #[error("completion queue failed: {0}")]
    CompletionQueue(#[source] io::Error),
    /// Starting a progress thread failed (over shm: the context's, with its first connection),
    /// or registering the connection with it.
    #[error("the progress thread could not be started or take the connection: {0}")]
    Thread(#[source] io::Error),
}

impl Error {
    /// The OS error number behind this error, if there is one.
    pub fn os_error(&self) -> Option<i32> {
        match self {
            Error::Listen(e)
            | Error::Connect(e)
            | Error::Accept(e)
            | Error::SharedMemory(e)
            | Error::MemoryRegion(e)
            | Error::MemoryLock { source: e, .. }
            | Error::CompletionQueue(e)
            | Error::Thread(e) => e.raw_os_error(),
            _ => None,
        }
    }

    /// The same error again, for an outcome told to more than one waiter (an OS error keeps
    /// its number, or else its kind and message).
    pub(crate) fn duplicate(&self) -> Error {
        let io = |e: &io::Error| match e.raw_os_error() {
            Some(n) => io::Error::from_raw_os_error(n),
            None => io::Error::new(e.kind(), e.to_string()),
        };
        match self {
            Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
            Error::Range {
                offset,
                len,
                region_len,
            } => Error::Range {
                offset: *offset,
                len: *len,
                region_len: *region_len,
            },
            Error::Access(s) => Error::Access(s),
            Error::Address { addr, reason } => Error::Address {
                addr: addr.clone(),
                reason: reason.clone(),
            },
            Error::Unsupported(s) => Error::Unsupported(s.clone()),
            Error::NoDevice => Error::NoDevice,
            Error::Unreachable(s) => Error::Unreachable(s.clone()),
            Error::Route(s) => Error::Route(s.clone()),
            Error::ConnectFailed(s) => Error::ConnectFailed(s.clone()),
            Error::DeviceRemoved => Error::DeviceRemoved,
            Error::Refused(s) => Error::Refused(s.clone()),
            Error::Rejected(d) => Error::Rejected(d.clone()),
            Error::Permission(s) => Error::Permission(s.clone()),
            Error::Protocol(s) => Error::Protocol(s.clone()),
            Error::Timeout(s) => Error::Timeout(s),
            Error::Disconnected => Error::Disconnected,
            Error::QueueFull(s) => Error::QueueFull(s),
            Error::AddrInUse(s) => Error::AddrInUse(s.clone()),
            Error::State(s) => Error::State(s),
            Error::WorkRequest { opcode, status } => Error::WorkRequest {
                opcode: *opcode,
                status: *status,
            },
            Error::Listen(e) => Error::Listen(io(e)),
            Error::Connect(e) => Error::Connect(io(e)),
            Error::Accept(e) => Error::Accept(io(e)),
            Error::SharedMemory(e) => Error::SharedMemory(io(e)),
            Error::MemoryRegion(e) => Error::MemoryRegion(io(e)),
            Error::MemoryLock { len, limit, source } => Error::MemoryLock {
                len: *len,
                limit: limit.clone(),
                source: io(source),
            },
            Error::CompletionQueue(e) => Error::CompletionQueue(io(e)),
            Error::Thread(e) => Error::Thread(io(e)),
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}
