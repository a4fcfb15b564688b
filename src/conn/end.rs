//! How a connection ends, the same on every transport (the reliable-connected semantics of
//! docs/semantics.md): why it ended, the status its disconnect record carries for it, and the
//! order of its last records. Whatever is outstanding when it ends completes queue by queue
//! in posting order - the send queue's work (sends and one-sided operations), then the
//! receives - as flushed unless the transport knows how it ended ([`flush_outstanding`]); the
//! disconnect record comes after all of them ([`End::report`]), and nothing of the connection
//! after it: each transport closes the connection to its posters and takes it away from its
//! pollers before it flushes.
//!
//! Until then every post passes one gate: a connection that is down takes no work, and a queue
//! holding as many of the caller's work requests as its granted depth takes no more, until one
//! of them completes ([`admit_send`], [`admit_recv`]).

use crate::cq::{Opcode, Reporter, Sink, WcStatus};
use crate::error::{Error, Result};

/// Refuses work on a connection that is `down`.
#[inline]
pub(crate) fn ensure_up(down: bool) -> Result<()> {
    if down {
        return Err(Error::Disconnected);
    }
    Ok(())
}

/// The error of a failed send on a connection's socket: [`Error::Disconnected`] when it says
/// the peer is gone (its end closed or reset), else `other(e)`.
pub(crate) fn socket_error(e: std::io::Error, other: fn(std::io::Error) -> Error) -> Error {
    if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) {
        Error::Disconnected
    } else {
        other(e)
    }
}

/// Lets a post take a slot of the send queue (sends and one-sided operations), which holds
/// `outstanding` of the caller's work requests of the `depth` granted, on a connection that is
/// `down` or not.
#[inline]
pub(crate) fn admit_send(down: bool, outstanding: usize, depth: usize) -> Result<()> {
    admit(down, outstanding, depth, "send")
}

/// [`admit_send`] for the receive queue.
#[inline]
pub(crate) fn admit_recv(down: bool, outstanding: usize, depth: usize) -> Result<()> {
    admit(down, outstanding, depth, "receive")
}

#[inline(always)]
fn admit(down: bool, outstanding: usize, depth: usize, queue: &'static str) -> Result<()> {
    ensure_up(down)?;
    if outstanding >= depth {
        return Err(Error::QueueFull(queue));
    }
    Ok(())
}

/// Why a connection ended, as its transport found out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// This side's user closed it.
    Local,
    /// The peer closed it: `clean` when it closed in order (an RDMA CM disconnect, or a
    /// goodbye over shm), not when it vanished (its process died with the connection).
    Peer { clean: bool },
    /// Work of the connection failed with this status (the first failure, as the transport
    /// found it here or learned it from the peer), or the library itself did
    /// ([`WcStatus::General`]).
    Failed(WcStatus),
}

impl End {
    /// The status of the disconnect record: success for an orderly close by either side.
    pub(crate) fn status(self) -> WcStatus {
        match self {
            End::Local | End::Peer { clean: true } => WcStatus::Success,
            End::Peer { clean: false } => WcStatus::Transport,
            End::Failed(s) => s,
        }
    }

    /// Reports the end: the disconnect record, the connection's last (see the module's doc).
    pub(crate) fn report(self, report: &Reporter) {
        report.complete(0, Opcode::Disconnected, self.status(), 0, None);
    }
}

/// A work request of the caller's still outstanding when its connection ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unfinished {
    pub(crate) wr_id: u64,
    pub(crate) opcode: Opcode,
    /// How it ended, when the transport knows (it ran already, or the peer refused it);
    /// `None`: it is flushed.
    pub(crate) status: Option<WcStatus>,
}

impl Unfinished {
    /// A work request that is flushed (the usual case).
    pub(crate) fn flushed(wr_id: u64, opcode: Opcode) -> Unfinished {
        Unfinished {
            wr_id,
            opcode,
            status: None,
        }
    }
}

/// Completes what was outstanding on a connection that ended, into `out`: the send queue's
/// work (`sends`), then the receives (`recvs`, their ids), each in posting order.
pub(crate) fn flush_outstanding(
    report: &Reporter,
    out: &mut Sink<'_>,
    sends: impl Iterator<Item = Unfinished>,
    recvs: impl Iterator<Item = u64>,
) {
    for w in sends {
        let status = w.status.unwrap_or(WcStatus::Flushed);
        out.put(report.record(w.wr_id, w.opcode, status, 0, None));
    }
    for wr_id in recvs {
        out.put(report.record(wr_id, Opcode::Recv, WcStatus::Flushed, 0, None));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_that_is_down_or_a_full_queue_takes_no_work() {
        assert!(admit_send(false, 0, 1).is_ok());
        assert!(admit_recv(false, 127, 128).is_ok());
        assert!(matches!(
            admit_send(false, 4, 4),
            Err(Error::QueueFull("send"))
        ));
        assert!(matches!(
            admit_recv(false, 5, 4),
            Err(Error::QueueFull("receive"))
        ));
        // Down comes first, full queue or not.
        assert!(matches!(admit_send(true, 0, 4), Err(Error::Disconnected)));
        assert!(matches!(admit_recv(true, 4, 4), Err(Error::Disconnected)));
        assert!(ensure_up(false).is_ok());
        assert!(matches!(ensure_up(true), Err(Error::Disconnected)));
    }

    #[test]
    fn orderly_closes_succeed_and_failures_say_why() {
        assert_eq!(End::Local.status(), WcStatus::Success);
        assert_eq!(End::Peer { clean: true }.status(), WcStatus::Success);
        assert_eq!(End::Peer { clean: false }.status(), WcStatus::Transport);
        for s in [
            WcStatus::LocalLength,
            WcStatus::RemoteError,
            WcStatus::RemoteAccess,
            WcStatus::PeerAccess,
            WcStatus::Transport,
            WcStatus::General,
        ] {
            assert_eq!(End::Failed(s).status(), s);
        }
    }

    // Not in `loom` builds, where the queue is made of loom's atomics, which only work inside
    // a model.
    #[cfg(not(loom))]
    #[test]
    fn sends_then_receives_in_posting_order_then_the_end_last() {
        let cq = crate::cq::CompletionQueue::new().unwrap();
        let report = Reporter {
            cq: cq.clone(),
            conn_id: 7,
            context: 0,
            peer: String::new(),
        };
        let unfinished = |wr_id, opcode, status| Unfinished {
            wr_id,
            opcode,
            status,
        };
        let sends = [
            unfinished(1, Opcode::Send, None),
            unfinished(2, Opcode::Write, Some(WcStatus::RemoteAccess)),
            unfinished(3, Opcode::Send, Some(WcStatus::RemoteError)),
            unfinished(4, Opcode::Read, None),
        ];
        flush_outstanding(
            &report,
            &mut Sink::queue(&cq),
            sends.into_iter(),
            [10, 11].into_iter(),
        );
        End::Peer { clean: false }.report(&report);
        let got: Vec<_> = std::iter::from_fn(|| cq.poll())
            .map(|c| (c.wr_id, c.opcode, c.status, c.conn_id))
            .collect();
        assert_eq!(
            got,
            [
                (1, Opcode::Send, WcStatus::Flushed, 7),
                (2, Opcode::Write, WcStatus::RemoteAccess, 7),
                (3, Opcode::Send, WcStatus::RemoteError, 7),
                (4, Opcode::Read, WcStatus::Flushed, 7),
                (10, Opcode::Recv, WcStatus::Flushed, 7),
                (11, Opcode::Recv, WcStatus::Flushed, 7),
                (0, Opcode::Disconnected, WcStatus::Transport, 7),
            ]
        );
    }
}
