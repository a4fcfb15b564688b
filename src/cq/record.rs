//! The records a completion queue hands out: what finished ([`Opcode`]), how it ended
//! ([`WcStatus`]), and the [`Completion`] that carries both.

/// What a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Opcode {
    /// A posted send finished (or failed).
    Send,
    /// A posted receive was filled (or failed).
    Recv,
    /// A one-sided write (with or without immediate) finished (or failed).
    Write,
    /// A one-sided read finished: the bytes are in the local segments.
    Read,
    /// A fetch-and-add finished: the word as it was is in the local segment.
    FetchAdd,
    /// A compare-and-swap finished: the word as it was is in the local segment.
    CmpSwap,
    /// A posted receive was consumed by the peer's write with immediate: `imm` carries the
    /// value, `byte_len` the bytes written, which are in place.
    RecvWriteImm,
    /// Connection event, only for connections started with
    /// [`crate::Context::connect_start`] or [`crate::ConnRequest::accept_start`]: the
    /// connection is established ([`WcStatus::Success`]), or it could not be
    /// ([`WcStatus::ConnectFailed`]; [`crate::Connection::established`] says why). A successful
    /// one is the connection's first record: none of its completions come before it (with a
    /// shared receive queue, none of its messages). A failed one is the connection's last
    /// record: the receives posted while it connected complete [`WcStatus::Flushed`] before
    /// it, and no [`Opcode::Disconnected`] follows.
    Connected,
    /// Connection event: the connection is down and every work request it had has completed.
    /// It is the last record a connection ever produces.
    Disconnected,
    /// A shared receive queue's event, on the queue named in its
    /// [`crate::SrqOptions::cq`]: fewer receives are left in it than its armed limit
    /// ([`crate::SharedRecvQueue::set_limit`]). `wr_id` is the receives left, `conn_id` 0,
    /// `context` the pool's [`crate::SrqOptions::context`].
    SrqLimit,
}

/// How a work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcStatus {
    /// It succeeded.
    Success,
    /// The connection went down before it ran.
    Flushed,
    /// The incoming message was larger than the posted receive buffer.
    LocalLength,
    /// The peer could not take the message (for a send: its receive buffer was too small).
    RemoteError,
    /// The peer vanished or the link failed (for a disconnect event: it was not a clean close).
    Transport,
    /// The local memory region does not allow the access.
    LocalProtection,
    /// The remote memory region does not allow the access.
    RemoteAccess,
    /// Any other failure.
    General,
    /// For a disconnect event: the peer made a one-sided access this side had not allowed (a
    /// key it was never given, a range past a region, a right the region does not grant), and
    /// the connection failed for it. Over verbs: the device failed the queue pair for a request
    /// of the peer's, as it does for such an access.
    PeerAccess,
    /// The connection could not be established (on an [`Opcode::Connected`] record).
    ConnectFailed,
}

/// One finished work request or connection event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The caller's work-request id, echoed (0 for connection events).
    pub wr_id: u64,
    /// The connection it belongs to ([`crate::Connection::id`]).
    pub conn_id: u64,
    /// The connection's user context ([`crate::ConnOptions::context`]).
    pub context: usize,
    /// What finished.
    pub opcode: Opcode,
    /// How it ended.
    pub status: WcStatus,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// Immediate data, when the message carried some.
    pub imm: Option<u32>,
}

impl Completion {
    /// The record as a `Result`: itself when its status is [`WcStatus::Success`], otherwise
    /// [`Error::WorkRequest`](crate::Error::WorkRequest) with its opcode and status.
    pub fn into_result(self) -> crate::Result<Completion> {
        match self.status {
            WcStatus::Success => Ok(self),
            status => Err(crate::Error::WorkRequest {
                opcode: self.opcode,
                status,
            }),
        }
    }
}
