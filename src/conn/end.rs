//! How a connection ends, the same on every transport (the reliable-connected semantics of
//! docs/semantics.md): why it ended, and the status its disconnect record carries for it.

use crate::cq::WcStatus;

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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
