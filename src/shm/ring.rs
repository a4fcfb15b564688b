//! A single-producer, single-consumer byte ring in shared memory, carrying records of
//! `[stamp u64][len u32][flags u32][imm u32][total u32][unused u64]` + payload padded to 32
//! bytes. A record never wraps: the producer pads the end of the ring instead.
//!
//! A record announces itself: its stamp is its ring position + 1, stored last (Release), so
//! the consumer learns of new records by reading the header at its head - the cache line it
//! reads next anyway - and the producer publishes no separate cursor. Before stamping a
//! record, the producer zeroes the stamp where the next record will start, so that what was
//! there on the ring's previous lap (a payload's bytes, say) can never pass for a stamp. The
//! consumer publishes its head, which the producer reads only when it runs short of room.
//!
//! The head the peer publishes is checked whenever it is read, as is every record header,
//! since the peer may be hostile.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

pub(crate) const HDR: usize = 32;
/// Room kept free after every record for the next record's zeroed stamp.
const STAMP_ROOM: usize = ALIGN;
/// First record of a message.
pub(crate) const FIRST: u32 = 1;
/// Last record of a message.
pub(crate) const LAST: u32 = 2;
/// The message carries immediate data.
pub(crate) const IMM: u32 = 4;
/// Filler up to the end of the ring.
pub(crate) const PAD: u32 = 8;
/// The whole message stays in the sender's memory; the payload is its address and a key
/// ([`DIRECT_PAYLOAD`]), and the receiver copies the `total` bytes from there itself (see
/// `flow.rs`).
pub(crate) const DIRECT: u32 = 16;
/// Bytes of a [`DIRECT`] record's payload: the sender's address, and a key (see
/// [`Producer::write_direct`]).
pub(crate) const DIRECT_PAYLOAD: usize = 16;

/// A write with immediate data: the bytes are already in the receiver's memory; the record,
/// with no payload, carries the immediate value and, in `total`, the bytes written, and
/// consumes a receive like a message.
pub(crate) const WRITE_IMM: u32 = 32;

/// Records start and end on multiples of this, so a header always fits before the ring's end.
const ALIGN: usize = 32;

fn padded(len: usize) -> usize {
    (len + ALIGN - 1) & !(ALIGN - 1)
}

fn corrupt(what: &str) -> Error {
    Error::Protocol(format!("shared ring: {what}"))
}

/// A record's header, copied out of shared memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Record {
    pub(crate) len: usize,
    pub(crate) flags: u32,
    pub(crate) imm: u32,
    pub(crate) total: usize,
    /// Where the payload starts (inside the ring; `len` bytes, bounds checked).
    pub(crate) payload: *const u8,
}

/// The memory a ring lives in: its bytes, whose record stamps are accessed atomically and
/// everything else by copies, and the consumer's head word. The ends reach it only through
/// these calls, so that the model checks (`loom` builds, see `mod model`) can run the same
/// ends over memory whose every access the model sees. For [`Mapped`], the shared memory of a
/// connection, each call compiles to the single load, store or copy it names.
pub(crate) trait Memory {
    /// Loads the stamp word at `off`.
    ///
    /// # Safety
    /// `off` is ALIGN-aligned and below the ring's size.
    unsafe fn load_stamp(&self, off: usize, order: Ordering) -> u64;
    /// Stores the stamp word at `off`.
    ///
    /// # Safety
    /// As for [`Memory::load_stamp`].
    unsafe fn store_stamp(&self, off: usize, v: u64, order: Ordering);
    /// Loads the consumer's head word.
    fn load_head(&self, order: Ordering) -> u64;
    /// Stores the consumer's head word.
    fn store_head(&self, v: u64, order: Ordering);
    /// Copies `n` bytes from `src` into the ring at `off`.
    ///
    /// # Safety
    /// `off + n` is at most the ring's size, `src` is readable for `n` bytes, and the
    /// consumer is not reading these bytes (they are behind its head).
    unsafe fn copy_in(&self, off: usize, src: *const u8, n: usize);
    /// Copies `n` bytes of the ring at `off` into `dst`.
    ///
    /// # Safety
    /// `off + n` is at most the ring's size, `dst` is writable for `n` bytes, and the bytes
    /// belong to a stamped record (the producer does not write them).
    unsafe fn copy_out(&self, off: usize, dst: *mut u8, n: usize);
    /// The address of the ring's byte at `off`.
    ///
    /// # Safety
    /// `off` is at most the ring's size.
    unsafe fn at(&self, off: usize) -> *const u8;
}

/// A ring in memory mapped from the connection's segment.
pub(crate) struct Mapped {
    head: *const AtomicU64,
    data: *mut u8,
}

impl Mapped {
    /// # Safety
    /// The head word and the ring's bytes from `data` on must stay mapped for the life of the
    /// value, and the ring's stamps must only ever be accessed atomically.
    pub(crate) unsafe fn new(head: &AtomicU64, data: *mut u8) -> Self {
        Mapped { head, data }
    }

    /// # Safety
    /// As for [`Memory::load_stamp`].
    unsafe fn stamp(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is ALIGN-aligned and below the ring's size (the caller's contract), so
        // 8 bytes fit; the ring is mapped for our life, page-aligned, and its stamps are only
        // accessed atomically.
        unsafe { AtomicU64::from_ptr(self.data.add(off).cast()) }
    }

    fn head(&self) -> &AtomicU64 {
        // SAFETY: valid for our life (constructor contract).
        unsafe { &*self.head }
    }
}

impl Memory for Mapped {
    #[inline(always)]
    unsafe fn load_stamp(&self, off: usize, order: Ordering) -> u64 {
        // SAFETY: the caller's contract.
        unsafe { self.stamp(off) }.load(order)
    }

    #[inline(always)]
    unsafe fn store_stamp(&self, off: usize, v: u64, order: Ordering) {
        // SAFETY: the caller's contract.
        unsafe { self.stamp(off) }.store(v, order)
    }

    #[inline(always)]
    fn load_head(&self, order: Ordering) -> u64 {
        self.head().load(order)
    }

    #[inline(always)]
    fn store_head(&self, v: u64, order: Ordering) {
        self.head().store(v, order)
    }

    #[inline(always)]
    unsafe fn copy_in(&self, off: usize, src: *const u8, n: usize) {
        // SAFETY: the caller's contract: in bounds, readable, and free space.
        unsafe { crate::shm::copy::copy_message(src, self.data.add(off), n) }
    }

    #[inline(always)]
    unsafe fn copy_out(&self, off: usize, dst: *mut u8, n: usize) {
        // SAFETY: the caller's contract: in bounds, writable, and a stamped record's bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.data.add(off), dst, n) }
    }

    #[inline(always)]
    unsafe fn at(&self, off: usize) -> *const u8 {
        // SAFETY: `off` is at most the ring's size (the caller's contract): inside the mapping
        // or one past it.
        unsafe { self.data.add(off) }
    }
}

/// The producing end.
pub(crate) struct Producer<M: Memory = Mapped> {
    mem: M,
    cap: usize,
    tail: u64,
    /// `tail % cap`, kept alongside so that the hot path divides nothing (records never wrap,
    /// so it moves by a record's size and returns to 0 exactly at the ring's end).
    tail_at: usize,
    /// The consumer's head when last read (see [`Producer::head`]).
    known_head: u64,
}

/// The consuming end.
pub(crate) struct Consumer<M: Memory = Mapped> {
    mem: M,
    cap: usize,
    head: u64,
    /// `head % cap` (see `Producer::tail_at`).
    head_at: usize,
}

// SAFETY: both ends point into a mapping owned by the same engine, which moves them to its
// thread together with the mapping and keeps the mapping alive longer than them.
unsafe impl Send for Producer {}
// SAFETY: as for Producer.
unsafe impl Send for Consumer {}

impl Producer {
    /// # Safety
    /// The words and `data..data+cap` must stay mapped for the life of the producer, and this
    /// must be the only producer of the ring.
    pub(crate) unsafe fn new(head: &AtomicU64, data: *mut u8, cap: usize) -> Self {
        // SAFETY: the caller's contract; the ring's stamps are only accessed through the ends.
        Producer::over(unsafe { Mapped::new(head, data) }, cap)
    }
}

impl<M: Memory> Producer<M> {
    /// The producer of the ring of `cap` bytes in `mem` (a multiple of ALIGN), which nobody
    /// else produces into.
    pub(crate) fn over(mem: M, cap: usize) -> Self {
        Producer {
            mem,
            cap,
            tail: 0,
            tail_at: 0,
            known_head: 0,
        }
    }

    /// The consumer's published head, checked against our tail; remembered for [`write`],
    /// which reads the shared word again only when the remembered one leaves too little room.
    ///
    /// [`write`]: Producer::write
    pub(crate) fn head(&mut self) -> Result<u64> {
        self.known_head = self.load_head()?;
        Ok(self.known_head)
    }

    /// The consumer's published head, checked against our tail, without remembering it.
    pub(crate) fn load_head(&self) -> Result<u64> {
        // Acquire: the consumer's Release store of head follows its last read of those bytes, so
        // after this load the space behind `head` may be overwritten.
        let head = self.mem.load_head(Ordering::Acquire);
        if head > self.tail || self.tail - head > self.cap as u64 || head % ALIGN as u64 != 0 {
            return Err(corrupt("consumer cursor out of range"));
        }
        Ok(head)
    }

    /// Bytes that may be written as far as the remembered head tells, and how many of them
    /// are contiguous before the ring end.
    fn space(&self) -> (usize, usize) {
        let free = self.cap - (self.tail - self.known_head) as usize;
        debug_assert_eq!(self.tail_at, self.tail as usize % self.cap);
        let contig = self.cap - self.tail_at;
        (free, contig)
    }

    /// Writes the next record of a message if there is room: at most `want` bytes from `src`
    /// (fewer if the ring is short of space). Returns the payload bytes written, or `None` when
    /// nothing fit. `first`/`last_if_all` set the flags; the record is published at once.
    ///
    /// # Safety
    /// `src..src+want` must be readable.
    #[inline(always)]
    pub(crate) unsafe fn write(
        &mut self,
        src: *const u8,
        want: usize,
        first: bool,
        ends_message_if_all: bool,
        imm: Option<u32>,
        total: usize,
    ) -> Result<Option<usize>> {
        let size = HDR + padded(want);
        let (free, contig) = self.space();
        // The usual case: all of it fits as the remembered head tells, before the ring's end,
        // keeping STAMP_ROOM free behind it. Everything else goes the long way.
        if size + STAMP_ROOM <= free && size <= contig {
            let mut flags = if first { FIRST } else { 0 };
            if ends_message_if_all {
                flags |= LAST;
            }
            if imm.is_some() {
                flags |= IMM;
            }
            // SAFETY: tail_at + size <= cap (checked against `contig`), the caller guarantees
            // `src` is readable for `want` bytes, and the space is free (behind the consumer).
            unsafe { self.mem.copy_in(self.tail_at + HDR, src, want) };
            self.publish(want, flags, imm.unwrap_or(0), total);
            return Ok(Some(want));
        }
        // SAFETY: the caller's contract.
        unsafe { self.write_record(src, want, first, ends_message_if_all, imm, total, 0) }
    }

    /// Writes a [`DIRECT`] record for a message of `total` bytes at `addr` in this process:
    /// its payload is the address and `key`, the key under which the region holding the
    /// message is exposed to the peer (which then copies from its mapping of it), or 0 (the
    /// peer copies from this process with `process_vm_readv`). Returns whether it fit.
    pub(crate) fn write_direct(&mut self, addr: u64, key: u64, total: usize) -> Result<bool> {
        let mut b = [0u8; DIRECT_PAYLOAD];
        b[..8].copy_from_slice(&addr.to_le_bytes());
        b[8..].copy_from_slice(&key.to_le_bytes());
        // SAFETY: `b` is readable for its bytes.
        let r = unsafe {
            self.write_record(b.as_ptr(), DIRECT_PAYLOAD, true, true, None, total, DIRECT)?
        };
        Ok(r == Some(DIRECT_PAYLOAD))
    }

    /// Writes a [`WRITE_IMM`] record for a write of `total` bytes with immediate `imm`.
    /// Returns whether it fit.
    pub(crate) fn write_imm(&mut self, imm: u32, total: usize) -> Result<bool> {
        let none = [0u8; 0];
        // SAFETY: no byte is read from the empty source.
        let r = unsafe {
            self.write_record(none.as_ptr(), 0, true, true, Some(imm), total, WRITE_IMM)?
        };
        Ok(r == Some(0))
    }

    /// [`Producer::write`] with `extra` flags; a record with extra flags is written whole or
    /// not at all.
    ///
    /// # Safety
    /// `src..src+want` must be readable.
    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    unsafe fn write_record(
        &mut self,
        src: *const u8,
        want: usize,
        first: bool,
        ends_message_if_all: bool,
        imm: Option<u32>,
        total: usize,
        extra: u32,
    ) -> Result<Option<usize>> {
        let mut fresh = false;
        loop {
            let (free, contig) = self.space();
            // Everything written keeps STAMP_ROOM free behind it for the next zeroed stamp.
            let free = free.saturating_sub(STAMP_ROOM);
            if !fresh && free < HDR + padded(want) {
                // Short of room by what we last saw: look at what the consumer has freed since.
                // (Reading its cursor only then keeps its cache line off the common path.)
                self.head()?;
                fresh = true;
                continue;
            }
            let mut n = want;
            if extra != 0 && HDR + padded(n) > free {
                return Ok(None);
            }
            if HDR + padded(n) > contig {
                if n > 0 && extra == 0 && contig >= HDR + ALIGN {
                    n = n.min(contig - HDR);
                } else if free >= contig {
                    self.publish(contig - HDR, PAD, 0, 0);
                    continue;
                } else {
                    return Ok(None);
                }
            }
            if HDR + padded(n) > free {
                if n > 0 && free >= HDR + ALIGN {
                    n = n.min((free - HDR) & !(ALIGN - 1));
                } else {
                    return Ok(None);
                }
            }
            let mut flags = extra;
            if first {
                flags |= FIRST;
            }
            if n == want && ends_message_if_all {
                flags |= LAST;
            }
            if imm.is_some() {
                flags |= IMM;
            }
            let at = self.tail_at + HDR;
            // SAFETY: at + n <= cap (checked against `contig` above), the caller guarantees `src`
            // is readable for `want >= n` bytes, and the space is free (behind the consumer).
            unsafe { self.mem.copy_in(at, src, n) };
            self.publish(n, flags, imm.unwrap_or(0), total);
            return Ok(Some(n));
        }
    }

    /// Stores the stamp word of the record starting at ring offset `at` (ALIGN-aligned,
    /// below cap).
    fn stamp(&self, at: usize, v: u64, order: Ordering) {
        debug_assert!(at < self.cap && at % ALIGN == 0);
        // SAFETY: `at` is below cap, and ALIGN-aligned as every record position is.
        unsafe { self.mem.store_stamp(at, v, order) }
    }

    /// Writes the header of a record whose payload (`len` bytes) is in place, zeroes the next
    /// record's stamp, then stamps this one, which publishes it; moves the tail past it.
    fn publish(&mut self, len: usize, flags: u32, imm: u32, total: usize) {
        let at = self.tail_at;
        let words = [len as u32, flags, imm, total as u32];
        // SAFETY: at + HDR <= cap (at is ALIGN-aligned, cap a multiple of ALIGN, and a record
        // always fits before the end), and the space is free. Byte copy of the 16 bytes after the stamp.
        unsafe { self.mem.copy_in(at + 8, words.as_ptr().cast::<u8>(), 16) };
        let size = HDR + padded(len);
        let next = self.tail + size as u64;
        // A record never runs past the ring's end: the next one starts there or at 0.
        let next_at = if at + size == self.cap { 0 } else { at + size };
        // The space at `next` is free: `write` kept STAMP_ROOM behind every record.
        self.stamp(next_at, 0, Ordering::Relaxed);
        // Release: the payload, the header and the zeroed next stamp are visible before the
        // stamp that makes the record the consumer's.
        self.stamp(at, self.tail + 1, Ordering::Release);
        self.tail = next;
        self.tail_at = next_at;
    }

    /// Our tail: the ring position just past everything written so far.
    pub(crate) fn tail(&self) -> u64 {
        self.tail
    }
}

impl Consumer {
    /// # Safety
    /// As for [`Producer::new`], for the one consumer of the ring.
    pub(crate) unsafe fn new(head: &AtomicU64, data: *const u8, cap: usize) -> Self {
        // SAFETY: the caller's contract; the ring's stamps are only accessed through the ends.
        Consumer::over(unsafe { Mapped::new(head, data.cast_mut()) }, cap)
    }
}

impl<M: Memory> Consumer<M> {
    /// The consumer of the ring of `cap` bytes in `mem` (a multiple of ALIGN), which nobody
    /// else consumes from.
    pub(crate) fn over(mem: M, cap: usize) -> Self {
        Consumer {
            mem,
            cap,
            head: 0,
            head_at: 0,
        }
    }

    /// Loads the stamp word of the record at our head.
    fn stamp(&self, order: Ordering) -> u64 {
        debug_assert_eq!(self.head_at, self.head as usize % self.cap);
        // SAFETY: head_at (head % cap) is below cap, and ALIGN-aligned as every record
        // position is.
        unsafe { self.mem.load_stamp(self.head_at, order) }
    }

    /// Whether a record is waiting.
    pub(crate) fn has_data(&self) -> Result<bool> {
        Ok(self.stamp(Ordering::Acquire) == self.head + 1)
    }

    /// The next record, skipping padding; `None` when the ring is empty.
    pub(crate) fn peek(&mut self) -> Result<Option<Record>> {
        loop {
            // Acquire: pairs with the producer's Release of the stamp, so the header and
            // payload written before it are visible.
            if self.stamp(Ordering::Acquire) != self.head + 1 {
                return Ok(None);
            }
            let at = self.head_at;
            let mut words = [0u32; 4];
            // SAFETY: at + HDR <= cap (an ALIGN-aligned position in a ring whose size is a multiple
            // of ALIGN = HDR), and the record is stamped.
            unsafe {
                self.mem
                    .copy_out(at + 8, words.as_mut_ptr().cast::<u8>(), 16)
            };
            let [len, flags, imm, total] = words;
            let (len, total) = (len as usize, total as usize);
            let size = HDR + padded(len);
            if at + size > self.cap || size + STAMP_ROOM > self.cap {
                return Err(corrupt("record runs past the ring's end"));
            }
            if flags & PAD != 0 {
                if at + size != self.cap {
                    return Err(corrupt("padding that does not reach the ring's end"));
                }
                self.advance(size);
                continue;
            }
            if len > total {
                return Err(corrupt("record longer than its message"));
            }
            return Ok(Some(Record {
                len,
                flags,
                imm,
                total,
                // SAFETY: at + HDR + len <= cap, checked above.
                payload: unsafe { self.mem.at(at + HDR) },
            }));
        }
    }

    /// Releases the record returned by the last `peek` back to the producer.
    pub(crate) fn consume(&mut self, rec: &Record) {
        self.advance(HDR + padded(rec.len));
    }

    fn advance(&mut self, size: usize) {
        // `size` never takes the head past the ring's end (checked by `peek`).
        self.head += size as u64;
        self.head_at += size;
        if self.head_at == self.cap {
            self.head_at = 0;
        }
        // Release: our reads of the record happen before the producer may reuse its space.
        self.mem.store_head(self.head, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: usize = 4096;

    /// A ring in ordinary memory: (head word, bytes).
    fn ring() -> (Box<AtomicU64>, Vec<u64>) {
        (Box::new(AtomicU64::new(0)), vec![0u64; CAP / 8])
    }

    /// Payload whose every 8-byte word, at any ring position, holds a value a stamp there
    /// could expect (position + 1 on this lap or a later one): stale bytes that, without the
    /// zeroed next stamp, would pass for records.
    fn spoofing(len: usize, lap_base: u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(len);
        let mut i = 0u64;
        while v.len() < len {
            let word = lap_base + (HDR + CAP) as u64 + i * 8 + 1;
            v.extend_from_slice(&word.to_le_bytes());
            i += 1;
        }
        v.truncate(len);
        v
    }

    #[test]
    fn records_cross_many_laps_and_stale_bytes_never_pass_for_records() {
        let (head, mut mem) = ring();
        let data = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: head and data outlive both ends; one producer, one consumer, one thread.
        let (mut tx, mut rx) = unsafe {
            (
                Producer::new(&head, data, CAP),
                Consumer::new(&head, data, CAP),
            )
        };
        let mut sent = std::collections::VecDeque::new();
        let mut got = 0usize;
        let mut seed = 7u64;
        for round in 0..2000usize {
            // Lengths that vary from lap to lap, so records start where payload was before.
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = (seed >> 33) as usize % 1200;
            let msg = spoofing(len, tx.tail());
            // SAFETY: `msg` is readable for its length.
            if let Some(n) = unsafe { tx.write(msg.as_ptr(), len, true, true, None, len) }.unwrap()
            {
                // Short of room, a record may carry only the start of the bytes.
                assert!(n <= len);
                sent.push_back(msg[..n].to_vec());
            }
            // Take every other round, so the ring runs full at times.
            if round % 2 == 1 {
                while let Some(rec) = rx.peek().unwrap() {
                    let want = sent.pop_front().expect("a record the producer wrote");
                    assert_eq!(rec.len, want.len());
                    // SAFETY: the payload is `rec.len` bytes inside the ring.
                    let bytes = unsafe { std::slice::from_raw_parts(rec.payload, rec.len) };
                    assert_eq!(bytes, &want[..]);
                    rx.consume(&rec);
                    got += 1;
                }
                assert!(sent.is_empty());
                assert!(!rx.has_data().unwrap());
            }
        }
        assert!(got > 1000, "only {got} records went through");
        assert!(tx.tail() > 10 * CAP as u64, "the ring wrapped many times");
    }

    #[test]
    fn a_hostile_header_is_refused() {
        let (head, mut mem) = ring();
        let data = mem.as_mut_ptr().cast::<u8>();
        // A stamped record at 0 claiming more bytes than the ring holds.
        mem[0] = 1;
        mem[1] = u64::from(u32::MAX);
        // SAFETY: as above.
        let mut rx = unsafe { Consumer::new(&head, data, CAP) };
        assert!(rx.peek().is_err());
        // Padding that stops short of the ring's end.
        mem[1] = (u64::from(PAD) << 32) | 64;
        assert!(rx.peek().is_err());
    }
}

/// Model checks of the ring protocol: the real [`Producer`] and [`Consumer`] over memory whose
/// every access `loom` sees (run with `RUSTFLAGS="--cfg loom" cargo test --lib loom`).
#[cfg(all(test, loom))]
pub(crate) mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64 as ModelU64;
    use std::collections::VecDeque;

    /// The size of the model's rings.
    pub(crate) const CAP: usize = 256;

    /// A ring in the model's memory. Each ALIGN-sized slot's first word - where a record's
    /// stamp may go - is an atomic, holding the last stamp stored there or the bytes last
    /// copied over it (so stale payload can pass for a stamp, as in real memory); the bytes
    /// are 8-byte cells whose every copy `loom` checks for a race with the other end.
    struct Model {
        head: ModelU64,
        stamps: Vec<ModelU64>,
        words: Vec<UnsafeCell<[u8; 8]>>,
        /// What the producer wrote, in order, and the message lengths: an oracle outside
        /// the model (no synchronisation the protocol could lean on; loom runs one thread
        /// at a time).
        sent: std::sync::Mutex<(VecDeque<u8>, VecDeque<usize>)>,
    }

    /// A ring's memory in the model (shared by its two ends).
    #[derive(Clone)]
    pub(crate) struct Mem(Arc<Model>);

    impl Mem {
        /// A new ring of [`CAP`] bytes.
        pub(crate) fn new() -> Mem {
            Mem(Arc::new(Model {
                head: ModelU64::new(0),
                stamps: (0..CAP / ALIGN).map(|_| ModelU64::new(0)).collect(),
                words: (0..CAP / 8).map(|_| UnsafeCell::new([0; 8])).collect(),
                sent: Default::default(),
            }))
        }
    }

    impl Memory for Mem {
        unsafe fn load_stamp(&self, off: usize, order: Ordering) -> u64 {
            assert!(off % ALIGN == 0 && off < CAP);
            self.0.stamps[off / ALIGN].load(order)
        }

        unsafe fn store_stamp(&self, off: usize, v: u64, order: Ordering) {
            assert!(off % ALIGN == 0 && off < CAP);
            self.0.stamps[off / ALIGN].store(v, order)
        }

        fn load_head(&self, order: Ordering) -> u64 {
            self.0.head.load(order)
        }

        fn store_head(&self, v: u64, order: Ordering) {
            self.0.head.store(v, order)
        }

        unsafe fn copy_in(&self, off: usize, src: *const u8, n: usize) {
            assert!(off + n <= CAP);
            for w in off / 8..(off + n).div_ceil(8) {
                let bytes = self.0.words[w].with_mut(|p| {
                    // SAFETY: loom checked that nobody else accesses the word now.
                    let word = unsafe { &mut *p };
                    for (i, b) in word.iter_mut().enumerate() {
                        let at = w * 8 + i;
                        if (off..off + n).contains(&at) {
                            // SAFETY: `src` is readable for `n` bytes (the caller's contract).
                            *b = unsafe { *src.add(at - off) };
                        }
                    }
                    *word
                });
                if (w * 8) % ALIGN == 0 {
                    self.0.stamps[w * 8 / ALIGN]
                        .store(u64::from_le_bytes(bytes), Ordering::Relaxed);
                }
            }
        }

        unsafe fn copy_out(&self, off: usize, dst: *mut u8, n: usize) {
            assert!(off + n <= CAP);
            for w in off / 8..(off + n).div_ceil(8) {
                self.0.words[w].with(|p| {
                    // SAFETY: loom checked that nobody writes the word now.
                    let word = unsafe { &*p };
                    for (i, b) in word.iter().enumerate() {
                        let at = w * 8 + i;
                        if (off..off + n).contains(&at) {
                            // SAFETY: `dst` is writable for `n` bytes (the caller's contract).
                            unsafe { *dst.add(at - off) = *b };
                        }
                    }
                });
            }
        }

        /// Not an address: the offset, for [`payload`] to read through the model.
        unsafe fn at(&self, off: usize) -> *const u8 {
            std::ptr::null::<u8>().wrapping_add(off)
        }
    }

    /// A record's payload, read through the model.
    pub(crate) fn payload(mem: &Mem, rec: &Record) -> Vec<u8> {
        let mut v = vec![0u8; rec.len];
        // SAFETY: the record is stamped and its payload in bounds (checked by `peek`).
        unsafe { mem.copy_out(rec.payload as usize, v.as_mut_ptr(), rec.len) };
        v
    }

    /// A message of `len` bytes whose every 8-byte word holds what the stamp of the ring
    /// slot it would land in (were it written at `tail`) holds one lap later: stale bytes
    /// that, without the producer's zeroing of the next stamp, would pass for a record.
    fn spoofing(len: usize, tail: u64) -> Vec<u8> {
        let mut v = Vec::new();
        let mut at = tail + HDR as u64;
        while v.len() < len {
            v.extend_from_slice(&(at + CAP as u64 + 1).to_le_bytes());
            at += 8;
        }
        v.truncate(len);
        v
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
            b.preemption_bound = Some(3);
        }
        b.check(f);
    }

    /// Producer and consumer run at once over a ring of 256 bytes: four messages of
    /// varying size (320 bytes of records: the ring wraps, pads its end and, when short of
    /// room, splits a message). The consumer sees every byte exactly once, in order, intact,
    /// with each message's first and last record flagged; loom fails the run if either end
    /// touches bytes the other may be touching (a record read while written, or space
    /// reused while read).
    #[test]
    fn loom_ring_delivers_every_record_once_in_order_and_whole() {
        const LENS: [usize; 4] = [40, 24, 56, 8];
        model(|| {
            let mem = Mem::new();
            let mut tx = Producer::over(mem.clone(), CAP);
            let producer = loom::thread::spawn(move || {
                for len in LENS {
                    let msg = spoofing(len, tx.tail());
                    {
                        let mut sent = tx.mem.0.sent.lock().unwrap();
                        sent.0.extend(&msg);
                        sent.1.push_back(len);
                    }
                    let mut done = 0;
                    loop {
                        let rest = len - done;
                        // SAFETY: `msg[done..]` is readable for `rest` bytes.
                        let wrote = unsafe {
                            tx.write(msg[done..].as_ptr(), rest, done == 0, true, None, len)
                        };
                        match wrote.expect("a ring in good order") {
                            Some(n) => {
                                done += n;
                                if done == len {
                                    break;
                                }
                            }
                            None => loom::thread::yield_now(),
                        }
                    }
                }
            });
            let mut rx = Consumer::over(mem.clone(), CAP);
            let (mut msgs, mut in_msg) = (0, 0usize);
            while msgs < LENS.len() {
                let Some(rec) = rx.peek().expect("a ring in good order") else {
                    loom::thread::yield_now();
                    continue;
                };
                let bytes = payload(&mem, &rec);
                let mut sent = mem.0.sent.lock().unwrap();
                let len = *sent.1.front().expect("a record of a message sent");
                assert_eq!(rec.total, len);
                assert_eq!(
                    rec.flags & FIRST != 0,
                    in_msg == 0,
                    "FIRST on a message's start"
                );
                let want: Vec<u8> = sent.0.drain(..rec.len).collect();
                assert_eq!(bytes, want, "the bytes as written");
                in_msg += rec.len;
                assert_eq!(
                    rec.flags & LAST != 0,
                    in_msg == len,
                    "LAST on a message's end"
                );
                if in_msg == len {
                    sent.1.pop_front();
                    (msgs, in_msg) = (msgs + 1, 0);
                }
                drop(sent);
                rx.consume(&rec);
            }
            producer.join().unwrap();
            assert!(!rx.has_data().unwrap());
            assert!(rx.peek().unwrap().is_none());
        });
    }
}
