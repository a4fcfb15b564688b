//! How a connection puts its completions into its completion queue.

use std::sync::Arc;

use super::{Completion, CompletionQueue, Opcode, WcStatus};

/// Reports one connection's completions into its completion queue.
#[derive(Debug)]
pub(crate) struct Reporter {
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) conn_id: u64,
    pub(crate) context: usize,
    /// The peer, as messages name it.
    pub(crate) peer: String,
}

impl Reporter {
    pub(crate) fn complete(
        &self,
        wr_id: u64,
        opcode: Opcode,
        status: WcStatus,
        byte_len: u32,
        imm: Option<u32>,
    ) {
        if opcode == Opcode::Disconnected {
            // Once per connection: its last record.
            match status {
                WcStatus::Success => crate::log::log!(
                    Info,
                    "connection {} with {} disconnected (orderly close)",
                    self.conn_id,
                    self.peer
                ),
                s => crate::log::log!(
                    Warn,
                    "connection {} with {} disconnected: {s:?}",
                    self.conn_id,
                    self.peer
                ),
            }
        }
        self.cq
            .push(self.record(wr_id, opcode, status, byte_len, imm));
    }

    pub(crate) fn record(
        &self,
        wr_id: u64,
        opcode: Opcode,
        status: WcStatus,
        byte_len: u32,
        imm: Option<u32>,
    ) -> Completion {
        Completion {
            wr_id,
            conn_id: self.conn_id,
            context: self.context,
            opcode,
            status,
            byte_len,
            imm,
        }
    }
}
