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
/// The whole message stays in the sender's memory; the payload is its address (`u64`), and
/// the receiver copies the `total` bytes from there itself (see `flow.rs`).
pub(crate) const DIRECT: u32 = 16;

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

/// The producing end.
pub(crate) struct Producer {
    head_word: *const AtomicU64,
    data: *mut u8,
    cap: usize,
    tail: u64,
    /// The consumer's head when last read (see [`Producer::head`]).
    known_head: u64,
}

/// The consuming end.
pub(crate) struct Consumer {
    head_word: *const AtomicU64,
    data: *const u8,
    cap: usize,
    head: u64,
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
        Producer {
            head_word: head,
            data,
            cap,
            tail: 0,
            known_head: 0,
        }
    }

    fn head_word(&self) -> &AtomicU64 {
        // SAFETY: valid for the producer's life (constructor contract).
        unsafe { &*self.head_word }
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
        let head = self.head_word().load(Ordering::Acquire);
        if head > self.tail || self.tail - head > self.cap as u64 || head % ALIGN as u64 != 0 {
            return Err(corrupt("consumer cursor out of range"));
        }
        Ok(head)
    }

    /// Bytes that may be written as far as the remembered head tells, and how many of them
    /// are contiguous before the ring end.
    fn space(&self) -> (usize, usize) {
        let free = self.cap - (self.tail - self.known_head) as usize;
        let contig = self.cap - (self.tail as usize % self.cap);
        (free, contig)
    }

    /// Writes the next record of a message if there is room: at most `want` bytes from `src`
    /// (fewer if the ring is short of space). Returns the payload bytes written, or `None` when
    /// nothing fit. `first`/`last_if_all` set the flags; the record is published at once.
    ///
    /// # Safety
    /// `src..src+want` must be readable.
    pub(crate) unsafe fn write(
        &mut self,
        src: *const u8,
        want: usize,
        first: bool,
        ends_message_if_all: bool,
        imm: Option<u32>,
        total: usize,
    ) -> Result<Option<usize>> {
        // SAFETY: the caller's contract.
        unsafe { self.write_record(src, want, first, ends_message_if_all, imm, total, 0) }
    }

    /// Writes a [`DIRECT`] record for a message of `total` bytes at `addr` in this process.
    /// Returns whether it fit.
    pub(crate) fn write_direct(&mut self, addr: u64, total: usize) -> Result<bool> {
        let b = addr.to_le_bytes();
        // SAFETY: `b` is readable for its 8 bytes.
        let r = unsafe { self.write_record(b.as_ptr(), 8, true, true, None, total, DIRECT)? };
        Ok(r == Some(8))
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
            let at = self.tail as usize % self.cap + HDR;
            // SAFETY: at + n <= cap (checked against `contig` above), the caller guarantees `src`
            // is readable for `want >= n` bytes, and the space is free (behind the consumer).
            unsafe { std::ptr::copy_nonoverlapping(src, self.data.add(at), n) };
            self.publish(n, flags, imm.unwrap_or(0), total);
            return Ok(Some(n));
        }
    }

    /// The stamp word of the record starting at ring position `pos` (ALIGN-aligned).
    fn stamp(&self, pos: u64) -> &AtomicU64 {
        // SAFETY: pos % cap is ALIGN-aligned and below cap, so 8 bytes fit; the ring is mapped
        // for the producer's life, page-aligned, and its stamps are only accessed atomically.
        unsafe { AtomicU64::from_ptr(self.data.add(pos as usize % self.cap).cast()) }
    }

    /// Writes the header of a record whose payload (`len` bytes) is in place, zeroes the next
    /// record's stamp, then stamps this one, which publishes it; moves the tail past it.
    fn publish(&mut self, len: usize, flags: u32, imm: u32, total: usize) {
        let at = self.tail as usize % self.cap;
        let words = [len as u32, flags, imm, total as u32];
        // SAFETY: at + HDR <= cap (at is ALIGN-aligned, cap a multiple of ALIGN, and a record
        // always fits before the end), and the space is free. Byte copy of the 16 bytes after the stamp.
        unsafe {
            std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), self.data.add(at + 8), 16)
        };
        let next = self.tail + (HDR + padded(len)) as u64;
        // The space at `next` is free: `write` kept STAMP_ROOM behind every record.
        self.stamp(next).store(0, Ordering::Relaxed);
        // Release: the payload, the header and the zeroed next stamp are visible before the
        // stamp that makes the record the consumer's.
        self.stamp(self.tail)
            .store(self.tail + 1, Ordering::Release);
        self.tail = next;
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
        Consumer {
            head_word: head,
            data,
            cap,
            head: 0,
        }
    }

    /// The stamp word of the record at our head.
    fn stamp(&self) -> &AtomicU64 {
        // SAFETY: head % cap is ALIGN-aligned and below cap, so 8 bytes fit; the ring is mapped
        // for the consumer's life, page-aligned, and its stamps are only accessed atomically.
        unsafe {
            AtomicU64::from_ptr(
                self.data
                    .add(self.head as usize % self.cap)
                    .cast_mut()
                    .cast(),
            )
        }
    }

    /// Whether a record is waiting.
    pub(crate) fn has_data(&self) -> Result<bool> {
        Ok(self.stamp().load(Ordering::Acquire) == self.head + 1)
    }

    /// The next record, skipping padding; `None` when the ring is empty.
    pub(crate) fn peek(&mut self) -> Result<Option<Record>> {
        loop {
            // Acquire: pairs with the producer's Release of the stamp, so the header and
            // payload written before it are visible.
            if self.stamp().load(Ordering::Acquire) != self.head + 1 {
                return Ok(None);
            }
            let at = self.head as usize % self.cap;
            let mut words = [0u32; 4];
            // SAFETY: at + HDR <= cap (an ALIGN-aligned position in a ring whose size is a multiple
            // of ALIGN = HDR), and the record is stamped.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.data.add(at + 8),
                    words.as_mut_ptr().cast::<u8>(),
                    16,
                )
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
                payload: unsafe { self.data.add(at + HDR) },
            }));
        }
    }

    /// Releases the record returned by the last `peek` back to the producer.
    pub(crate) fn consume(&mut self, rec: &Record) {
        self.advance(HDR + padded(rec.len));
    }

    fn advance(&mut self, size: usize) {
        self.head += size as u64;
        // SAFETY: constructor contract.
        let head_word = unsafe { &*self.head_word };
        // Release: our reads of the record happen before the producer may reuse its space.
        head_word.store(self.head, Ordering::Release);
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
