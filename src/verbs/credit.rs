//! Library-level receive credits between two library peers, so the device never meets a peer
//! without a receive posted (receiver not ready). Soft-RoCE counts its retransmit-timer expiries
//! during an RNR wait against `retry_count`, so an RNR wait longer than about
//! (retry_count + 1) x ack timeout fails the connection although `rnr_retry_count` is 7.
//!
//! Each side owns a small registered block. Its `word` holds the peer's cumulative count of
//! receives posted, which the peer writes with an RDMA WRITE (a SEND would take one of the
//! receives it counts). A send goes to the device only while (the peer's count) > (sends handed
//! to the device); otherwise it is held by the library and started, in order, when the count
//! grows.
//!
//! The count also rides on every send: a send goes as a SEND with immediate whose immediate
//! is the low 32 bits of the sender's count, which the receiving library takes (and reports
//! no immediate: the caller's sends carry none). So two peers that both send - a ping-pong, a
//! request and its reply - tell each other their counts for free, and credit writes, each one
//! more work request on the wire, go out only toward a peer that receives more than it sends.
//!
//! A write with immediate consumes one of the peer's receives too: it counts as a send here,
//! waits in the same queue, in order with sends, and the receive it takes counts as consumed
//! at the peer like any other. One-sided operations without an immediate consume nothing and
//! never wait. The library's own traffic never consumes a receive of the caller's: credit
//! writes and keepalives are RDMA writes without an immediate (no receive, no completion at
//! the peer), and the hello is taken by the server's own receive, posted before any of the
//! caller's.
//!
//! A send that finds no credit need not wait for the peer's next receive to come back as a
//! credit write: the sender writes it (up to [`BOUNCE`] bytes, one at a time) into the
//! `bounce` area of the peer's block, then a header naming it (its place among the sender's
//! messages, and its length), as two RDMA WRITEs in that order, and keeps it held. A receive
//! the peer posts while none of its receives is on the device takes the message from there,
//! in the poster's call, and counts it in a word of the sender's (`claimed`, written before
//! its next count of receives); the sender then completes the send. If instead a credit
//! arrives first (the receive went to the device before the header landed), the held send
//! goes as a SEND, and the header, naming a message the receiver has by then, is ignored.
//! Either way one side decides: the receiver takes from the bounce area only with no receive
//! on the device, and the sender sends only on a credit, that is, for a receive that is on the
//! device. A claim reaches the sender before anything the receiver sends after taking the
//! message (its sends and writes with immediate, and its own bounced messages, wait until the
//! claim is written; the device delivers a write before what is posted after it), so a sender
//! that closes as soon as the answer comes has seen its send taken; a receiver that closes
//! first writes its claims before it disconnects.
//!
//! Address exchange: the connect request has no room for an address and key (56 bytes, of
//! which the caller may use 48), so the server puts its word's address and key in its accept
//! (after the caller's data, flag [`FLAG_CREDITS`]), and pre-posts one internal receive before
//! accepting; the client's first send is an internal hello carrying its own word's address and
//! key, which that receive takes.

use std::cell::UnsafeCell;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rdma_sys as sys;

use crate::conn::{RdmaOp, SGE_MAX};
use crate::cq::Opcode;
use crate::error::{Error, Result};
use crate::verbs::res::Pd;

/// Preamble flag (byte 5): the sender speaks credits. In a connect request: the client can; in
/// an accept: the server does, and its word's address and key follow the caller's data.
pub(crate) const FLAG_CREDITS: u8 = 1;
/// Bytes the accept carries after the caller's data with [`FLAG_CREDITS`]: address, key.
pub(crate) const EXT_LEN: usize = 12;
/// Bytes a message may have to go through the peer's bounce area.
pub(crate) const BOUNCE: usize = crate::conn::INLINE_MAX as usize;
/// The headers of the bounce area count messages modulo 2^48.
pub(crate) const COUNT_MASK: u64 = (1 << 48) - 1;
/// Bytes of the hello message: the client's word's address and key (and 4 spare).
pub(crate) const HELLO_LEN: usize = 16;
/// Send-queue slots the library keeps for itself beyond the caller's depth: the hello, a
/// keepalive, and up to [`CREDIT_WRITES_MAX`] credit writes not yet reaped.
pub(crate) const INTERNAL_SLOTS: u32 = 2 + CREDIT_WRITES_MAX;
/// Most internal work requests in flight (not yet reaped) before a credit write waits.
pub(crate) const CREDIT_WRITES_MAX: u32 = 16;
/// Every this many internal work requests one is signaled, so their slots are reaped.
pub(crate) const SIGNAL_EVERY: u32 = 8;

/// The registered block: the word the peer writes, the source of this side's writes, and the
/// hello (sent by a client, received by a server).
#[repr(C, align(64))]
pub(crate) struct Block {
    /// The peer's cumulative count of receives posted (written by the peer's device).
    pub(crate) word: AtomicU64,
    /// This side's count, as the source of its credit writes. Only ever grows, so a device that
    /// reads it after a later update still writes a true count.
    pub(crate) src: AtomicU64,
    pub(crate) hello: [u8; HELLO_LEN],
    /// The header of the message in `bounce`, written by the peer's device after the message
    /// and its length: its place among the peer's messages (from 1, modulo 2^48). Alone in its
    /// word, as a device may write (and this side read) a word a byte at a time: a value that
    /// reads as the one expected has all the bytes in which it differs from the last one,
    /// and so comes after the message and its length.
    staged: AtomicU64,
    /// The length of the message in `bounce`.
    bounced_len: AtomicU64,
    /// How many of this side's messages the peer took from its bounce area (written by the
    /// peer's device, always before its next count of receives), and the source of this
    /// side's writes of its own.
    claimed: AtomicU64,
    pub(crate) claims_src: AtomicU64,
    bounce: UnsafeCell<[u8; BOUNCE]>,
}

/// A [`Block`] registered with a protection domain (local write, remote write). Deregistered
/// before the block is freed; must outlive the queue pair that may write into it.
pub(crate) struct CreditMr {
    block: Box<Block>,
    mr: *mut sys::ibv_mr,
    _pd: Arc<Pd>,
}

// SAFETY: the block is shared with the device only through its atomics and the hello bytes
// (written before the hello is posted, read after its receive completed); the MR is only
// read (keys) and deregistered once, on drop.
unsafe impl Send for CreditMr {}
// SAFETY: as above.
unsafe impl Sync for CreditMr {}

impl CreditMr {
    pub(crate) fn new(pd: &Arc<Pd>) -> Result<CreditMr> {
        let mut block = Box::new(Block {
            word: AtomicU64::new(0),
            src: AtomicU64::new(0),
            hello: [0; HELLO_LEN],
            staged: AtomicU64::new(0),
            bounced_len: AtomicU64::new(0),
            claimed: AtomicU64::new(0),
            claims_src: AtomicU64::new(0),
            bounce: UnsafeCell::new([0; BOUNCE]),
        });
        let flags = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        // SAFETY: the block is a live heap allocation of size_of::<Block>() bytes that stays
        // put (boxed) and is freed only after the registration is dropped (field order in
        // Drop below).
        let mr = unsafe {
            sys::ibv_reg_mr(
                pd.raw,
                (&raw mut *block).cast(),
                std::mem::size_of::<Block>(),
                flags as i32,
            )
        };
        if mr.is_null() {
            return Err(Error::MemoryRegion(io::Error::new(
                io::Error::last_os_error().kind(),
                format!(
                    "registering the connection's credit word failed: {}",
                    io::Error::last_os_error()
                ),
            )));
        }
        Ok(CreditMr {
            block,
            mr,
            _pd: pd.clone(),
        })
    }

    pub(crate) fn block(&self) -> &Block {
        &self.block
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: live registration.
        unsafe { (*self.mr).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: live registration.
        unsafe { (*self.mr).rkey }
    }

    pub(crate) fn word_addr(&self) -> u64 {
        (&raw const self.block.word) as u64
    }

    pub(crate) fn src_addr(&self) -> u64 {
        (&raw const self.block.src) as u64
    }

    pub(crate) fn hello_addr(&self) -> u64 {
        (&raw const self.block.hello) as u64
    }

    /// Where the peer writes: address and key, as the accept extension or the hello carry it.
    pub(crate) fn encode_remote(&self) -> [u8; EXT_LEN] {
        let mut b = [0u8; EXT_LEN];
        b[..8].copy_from_slice(&self.word_addr().to_le_bytes());
        b[8..].copy_from_slice(&self.rkey().to_le_bytes());
        b
    }

    /// Fills the hello with this side's word address and key (before it is posted).
    pub(crate) fn fill_hello(&mut self) {
        let r = self.encode_remote();
        self.block.hello[..EXT_LEN].copy_from_slice(&r);
    }

    /// The peer's word as its hello carried it (after the hello's receive completed).
    pub(crate) fn read_hello(&self) -> Remote {
        // SAFETY: the device wrote the hello bytes before reporting the receive; read them
        // volatile, as memory written behind the compiler's back.
        let h: [u8; HELLO_LEN] = unsafe { std::ptr::read_volatile(&raw const self.block.hello) };
        Remote::decode(&h[..EXT_LEN]).expect("EXT_LEN bytes")
    }

    /// The peer's count of receives posted, as its last credit write left it (see also
    /// [`Credits::peer_seen`]).
    pub(crate) fn peer_count(&self) -> u64 {
        // Acquire: pairs with nothing in this process (the device writes the word); it keeps
        // later reads (the claims) from moving before this one.
        self.block.word.load(Ordering::Acquire)
    }

    /// How many of this side's messages the peer took from its bounce area.
    fn peer_claims(&self) -> u64 {
        // Acquire: as above.
        self.block.claimed.load(Ordering::Acquire)
    }

    pub(crate) fn claims_src_addr(&self) -> u64 {
        (&raw const self.block.claims_src) as u64
    }

    /// Copies the message the peer left in the bounce area into `dst` (room for `room`
    /// bytes), if it is the peer's message number `index` (modulo 2^48) and fits; returns its
    /// length.
    ///
    /// # Safety
    /// `dst` is valid for writes of `room` bytes.
    unsafe fn take_bounce(&self, index: u64, dst: *mut u8, room: usize) -> Option<usize> {
        // Acquire: the header is written after the message and its length (writes in order
        // on one queue pair); the reads below must not move before this load.
        if self.block.staged.load(Ordering::Acquire) != index & COUNT_MASK {
            return None;
        }
        let len = self.block.bounced_len.load(Ordering::Acquire) as usize;
        if len > room.min(BOUNCE) {
            return None;
        }
        // SAFETY: `len` is within the bounce area, which the peer's device wrote before the
        // header and leaves alone until this side's claim reaches it; `dst` as the caller
        // promises.
        unsafe { std::ptr::copy_nonoverlapping(self.block.bounce.get().cast::<u8>(), dst, len) };
        Some(len)
    }
}

impl Drop for CreditMr {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once; the queue pair that could write into
        // the block is destroyed before the connection's shared state (and this) is dropped.
        unsafe { sys::ibv_dereg_mr(self.mr) };
    }
}

/// The peer's word: where this side's credit writes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Remote {
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
}

impl Remote {
    /// The peer's bounce area and the header after it (its block has this side's layout: the
    /// preamble's version says so).
    pub(crate) fn bounce(&self) -> u64 {
        self.addr + std::mem::offset_of!(Block, bounce) as u64
    }

    pub(crate) fn staged(&self) -> u64 {
        self.addr + std::mem::offset_of!(Block, staged) as u64
    }

    pub(crate) fn claimed(&self) -> u64 {
        self.addr + std::mem::offset_of!(Block, claimed) as u64
    }

    pub(crate) fn bounced_len(&self) -> u64 {
        self.addr + std::mem::offset_of!(Block, bounced_len) as u64
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Remote> {
        if b.len() < EXT_LEN {
            return None;
        }
        Some(Remote {
            addr: u64::from_le_bytes(b[..8].try_into().ok()?),
            rkey: u32::from_le_bytes(b[8..12].try_into().ok()?),
        })
    }
}

/// The regions a piece of the caller's work reads or writes, held alive until it completes.
pub(crate) type Regions = [Option<Arc<crate::mr::MemoryRegion>>; SGE_MAX];

/// What a piece of the caller's send-queue work does, as the device gets it.
pub(crate) enum Work {
    /// A send of `len` bytes at `ptr` (local key `lkey`); for an inline send, `ptr` may point
    /// into the connection's staging area.
    Send {
        ptr: *mut u8,
        len: u32,
        lkey: u32,
        inline: bool,
    },
    /// A one-sided operation with its local segments (`sges[..nsge]`, none empty), the target
    /// address and the peer's key.
    Rdma {
        op: RdmaOp,
        sges: [sys::ibv_sge; SGE_MAX],
        nsge: u32,
        remote_addr: u64,
        rkey: u32,
    },
}

/// A piece of the caller's send-queue work: posted at once, or, when it needs one of the
/// peer's receives (a send, a write with immediate) and the peer has none posted yet, held by
/// the library until credits arrive.
pub(crate) struct SendWork {
    pub(crate) work: Work,
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    pub(crate) mrs: Regions,
}

impl SendWork {
    /// The opcode its completion carries.
    pub(crate) fn opcode(&self) -> Opcode {
        match self.work {
            Work::Send { .. } => Opcode::Send,
            Work::Rdma { op, .. } => op.opcode(),
        }
    }

    /// Whether it consumes a receive at the peer, and so needs a credit: a send, or a write
    /// with immediate. (The library's own writes never carry an immediate, so they consume
    /// nothing at the peer and are never mistaken there for the caller's.)
    pub(crate) fn needs_credit(&self) -> bool {
        matches!(
            self.work,
            Work::Send { .. }
                | Work::Rdma {
                    op: RdmaOp::Write { imm: Some(_) },
                    ..
                }
        )
    }
}

/// The credit state of one connection (under the connection's lock).
pub(crate) struct Credits {
    pub(crate) mr: CreditMr,
    /// The peer's word; a server learns it from the hello.
    pub(crate) peer: Option<Remote>,
    /// Caller's sends and writes with immediate handed to the device: each takes one of the
    /// peer's receives.
    pub(crate) sent: u64,
    /// Caller's receives posted.
    pub(crate) posted: u64,
    /// The count last told the peer (by a credit write, or on a send).
    pub(crate) pushed: u64,
    /// The peer's count as the immediates of its sends told it (its credit writes tell it
    /// too, in the block's word: the larger of the two holds).
    pub(crate) peer_seen: u64,
    /// Caller's receives seen completed (by a message, by a write with immediate, or
    /// flushed).
    pub(crate) consumed: u64,
    /// Push when the peer's credit as this side knows it (pushed - consumed) falls below this.
    pub(crate) low: u64,
    /// A credit write is due but could not go out yet (no hello, or no free internal slot).
    pub(crate) owed: bool,
    /// The peer's messages this side took from its bounce area, and how many of them the
    /// last credit write told.
    pub(crate) claims: u64,
    pub(crate) claims_told: u64,
    /// This side's messages the peer took from its bounce area, as far as seen.
    pub(crate) claims_seen: u64,
    /// The first held send is in the peer's bounce area.
    pub(crate) bounced: bool,
    pub(crate) held: std::collections::VecDeque<SendWork>,
    /// Copies of held inline sends, one slot of `max_inline` bytes per send-queue entry (made
    /// on the first held inline send).
    pub(crate) staging: Vec<u8>,
    pub(crate) staging_next: usize,
}

impl Credits {
    pub(crate) fn new(
        mr: CreditMr,
        peer: Option<Remote>,
        send_depth: u32,
        recv_depth: u32,
    ) -> Self {
        Credits {
            mr,
            peer,
            sent: 0,
            posted: 0,
            pushed: 0,
            peer_seen: 0,
            consumed: 0,
            low: u64::from((recv_depth / 4).clamp(1, 16)),
            owed: false,
            claims: 0,
            claims_told: 0,
            claims_seen: 0,
            bounced: false,
            held: std::collections::VecDeque::with_capacity(send_depth as usize),
            staging: Vec::new(),
            staging_next: 0,
        }
    }

    /// Whether the peer is known to have a receive posted for one more send (or write with
    /// immediate).
    pub(crate) fn available(&self) -> bool {
        self.peer_seen > self.sent || self.mr.peer_count() > self.sent
    }

    /// The immediate this side's sends carry: its count of receives posted (low 32 bits), in
    /// network byte order, as the device takes it. Once the send is posted, [`told`] notes
    /// that the peer will know the count.
    ///
    /// [`told`]: Self::told
    pub(crate) fn imm_for_send(&self) -> u32 {
        (self.telling() as u32).to_be()
    }

    /// A send carrying [`imm_for_send`](Self::imm_for_send) was posted: the peer learns the
    /// count from it, so no credit write is owed for it.
    pub(crate) fn told(&mut self) {
        self.pushed = self.telling();
        self.owed = self.posted > self.pushed;
    }

    /// The count a send may tell: the receives posted, unless a claim is yet to be written
    /// (which must reach the peer before any count of receives posted after it).
    fn telling(&self) -> u64 {
        if !self.claim_pending() {
            self.posted
        } else {
            self.pushed
        }
    }

    /// Takes the peer's count from the immediate of a send of its (host byte order). The
    /// count only grows, and a send carries it as it was when posted: a value behind the one
    /// known (modulo 2^32) is an older count and changes nothing.
    pub(crate) fn note_peer_imm(&mut self, imm: u32) {
        self.peer_seen = advance(self.peer_seen, imm);
    }

    /// Whether a credit write should go out now (lazily: only when the peer's credit as this
    /// side knows it runs low, or one is owed; at once when a message was taken from the
    /// bounce area, as its send waits for that).
    pub(crate) fn push_due(&self) -> bool {
        (self.posted > self.pushed
            && (self.owed || self.pushed.saturating_sub(self.consumed) < self.low))
            || self.claim_pending()
    }

    /// Whether this side took messages from its bounce area that the peer was not yet told of.
    pub(crate) fn claim_pending(&self) -> bool {
        self.claims_told != self.claims
    }

    /// The number the next message of this side's has among its messages (from 1): the
    /// sends and writes with immediate handed to the device and those the peer took from the
    /// bounce area.
    pub(crate) fn next_index(&self) -> u64 {
        self.sent + self.claims_seen + 1
    }

    /// Takes the peer's next message from the bounce area into a receive at `dst` of `room`
    /// bytes, if it is there and no receive of this side's is on the device (`on_device`):
    /// then the message is the next one and was sent nowhere else. Returns its length.
    ///
    /// # Safety
    /// `dst` is valid for writes of `room` bytes.
    pub(crate) unsafe fn take_bounced(
        &mut self,
        on_device: bool,
        dst: *mut u8,
        room: usize,
    ) -> Option<usize> {
        if on_device {
            return None;
        }
        // Every receive posted has completed: the peer's messages so far are those.
        let index = self.consumed + self.claims + 1;
        // SAFETY: as the caller promises.
        let n = unsafe { self.mr.take_bounce(index, dst, room) }?;
        self.claims += 1;
        Some(n)
    }

    /// Whether the peer took the bounced send (the first held one) from its bounce area; if
    /// so, counts it as taken.
    pub(crate) fn bounced_taken(&mut self) -> bool {
        if self.bounced && self.mr.peer_claims() == self.claims_seen + 1 {
            self.claims_seen += 1;
            self.bounced = false;
            return true;
        }
        false
    }

    /// Copies an inline send into its staging slot; returns where it now lives.
    pub(crate) fn stage(&mut self, data: &[u8], depth: u32, max_inline: u32) -> *mut u8 {
        let slot = max_inline.max(1) as usize;
        if self.staging.is_empty() {
            self.staging = vec![0; slot * depth as usize];
        }
        // SendWork sends leave in order and at most `depth` are held, so slot i is free again by
        // the time it comes round.
        let at = (self.staging_next % depth as usize) * slot;
        self.staging_next = self.staging_next.wrapping_add(1);
        self.staging[at..at + data.len()].copy_from_slice(data);
        self.staging[at..].as_mut_ptr()
    }
}

/// The count `known` brought up to the one whose low 32 bits are `low`, if that one is not
/// behind it (modulo 2^32: counts move by far less than 2^31 between two sends).
fn advance(known: u64, low: u32) -> u64 {
    let ahead = low.wrapping_sub(known as u32);
    if ahead < 1 << 31 {
        known + u64::from(ahead)
    } else {
        known
    }
}

#[cfg(test)]
mod tests {
    use super::advance;

    #[test]
    fn a_count_from_an_immediate_only_moves_forward() {
        assert_eq!(advance(0, 0), 0);
        assert_eq!(advance(0, 5), 5);
        assert_eq!(advance(5, 5), 5);
        // An older count (a send posted before the one already seen) changes nothing.
        assert_eq!(advance(9, 5), 9);
        // Across the 32-bit wrap, in both directions.
        let near = (1u64 << 32) - 2;
        assert_eq!(advance(near, 3), (1 << 32) + 3);
        assert_eq!(advance((1 << 32) + 3, u32::MAX), (1 << 32) + 3);
        // Far past 2^32 the high bits come from what is known.
        assert_eq!(advance((7 << 32) + 10, 12), (7 << 32) + 12);
    }
}
