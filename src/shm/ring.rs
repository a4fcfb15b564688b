//! A single-producer, single-consumer byte ring in shared memory, carrying records of
//! `[len u32][flags u32][imm u32][total u32]` + payload padded to 16 bytes. A record never wraps:
//! the producer pads the end of the ring instead.
//!
//! Each side keeps its own cursor locally and only publishes it; the cursor the peer publishes
//! is checked on every read, as is every record header, since the peer may be hostile.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

pub(crate) const HDR: usize = 16;
/// First record of a message.
pub(crate) const FIRST: u32 = 1;
/// Last record of a message.
pub(crate) const LAST: u32 = 2;
/// The message carries immediate data.
pub(crate) const IMM: u32 = 4;
/// Filler up to the end of the ring.
pub(crate) const PAD: u32 = 8;

fn padded(len: usize) -> usize {
    (len + 15) & !15
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
    tail_word: *const AtomicU64,
    head_word: *const AtomicU64,
    data: *mut u8,
    cap: usize,
    tail: u64,
    /// The consumer's head when last read (see [`Producer::head`]).
    known_head: u64,
}

/// The consuming end.
pub(crate) struct Consumer {
    tail_word: *const AtomicU64,
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
    pub(crate) unsafe fn new(
        tail: &AtomicU64,
        head: &AtomicU64,
        data: *mut u8,
        cap: usize,
    ) -> Self {
        Producer {
            tail_word: tail,
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
        if head > self.tail || self.tail - head > self.cap as u64 || head % 16 != 0 {
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
        let mut fresh = false;
        loop {
            let (free, contig) = self.space();
            if !fresh && free < HDR + padded(want) {
                // Short of room by what we last saw: look at what the consumer has freed since.
                // (Reading its cursor only then keeps its cache line off the common path.)
                self.head()?;
                fresh = true;
                continue;
            }
            let mut n = want;
            if HDR + padded(n) > contig {
                if n > 0 && contig >= HDR + 16 {
                    n = n.min(contig - HDR);
                } else if free >= contig {
                    self.put_header(contig - HDR, PAD, 0, 0);
                    self.tail += contig as u64;
                    continue;
                } else {
                    return Ok(None);
                }
            }
            if HDR + padded(n) > free {
                if n > 0 && free >= HDR + 16 {
                    n = n.min((free - HDR) & !15);
                } else {
                    return Ok(None);
                }
            }
            let mut flags = 0;
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
            self.put_header(n, flags, imm.unwrap_or(0), total);
            self.tail += (HDR + padded(n)) as u64;
            // SAFETY: constructor contract.
            let tail_word = unsafe { &*self.tail_word };
            // Release: publishes the header and payload written above before the new tail.
            tail_word.store(self.tail, Ordering::Release);
            return Ok(Some(n));
        }
    }

    fn put_header(&mut self, len: usize, flags: u32, imm: u32, total: usize) {
        let at = self.tail as usize % self.cap;
        let words = [len as u32, flags, imm, total as u32];
        // SAFETY: at + HDR <= cap (at is 16-aligned and cap a multiple of 16), and the space is
        // free. Unaligned-safe byte copy of the 16 header bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), self.data.add(at), HDR)
        };
    }

    /// Our tail: the ring position just past everything written so far.
    pub(crate) fn tail(&self) -> u64 {
        self.tail
    }
}

impl Consumer {
    /// # Safety
    /// As for [`Producer::new`], for the one consumer of the ring.
    pub(crate) unsafe fn new(
        tail: &AtomicU64,
        head: &AtomicU64,
        data: *const u8,
        cap: usize,
    ) -> Self {
        Consumer {
            tail_word: tail,
            head_word: head,
            data,
            cap,
            head: 0,
        }
    }

    /// The producer's published tail, checked against our head.
    pub(crate) fn tail(&self) -> Result<u64> {
        // SAFETY: constructor contract.
        let tail_word = unsafe { &*self.tail_word };
        // Acquire: pairs with the producer's Release store, so the records before it are visible.
        let tail = tail_word.load(Ordering::Acquire);
        if tail < self.head || tail - self.head > self.cap as u64 || tail % 16 != 0 {
            return Err(corrupt("producer cursor out of range"));
        }
        Ok(tail)
    }

    /// Whether a record is waiting.
    pub(crate) fn has_data(&self) -> Result<bool> {
        Ok(self.tail()? != self.head)
    }

    /// The next record, skipping padding; `None` when the ring is empty.
    pub(crate) fn peek(&mut self) -> Result<Option<Record>> {
        loop {
            let tail = self.tail()?;
            if tail == self.head {
                return Ok(None);
            }
            let avail = (tail - self.head) as usize;
            let at = self.head as usize % self.cap;
            let mut words = [0u32; 4];
            // SAFETY: at + HDR <= cap (16-aligned position in a ring whose size is a multiple of
            // 16) and the bytes are behind the published tail.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.data.add(at),
                    words.as_mut_ptr().cast::<u8>(),
                    HDR,
                )
            };
            let [len, flags, imm, total] = words;
            let (len, total) = (len as usize, total as usize);
            let size = HDR + padded(len);
            if size > avail || at + size > self.cap {
                return Err(corrupt("record runs past the data written"));
            }
            if flags & PAD != 0 {
                // A pad record is published together with the real record after it.
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
