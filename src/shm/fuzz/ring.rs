//! The ring target.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Input;
use crate::shm::ring::{self, Consumer, Producer};

/// The ring target: one ring in memory the fuzzer also writes, an honest producer and the
/// real consumer on it, and a hostile peer between them that pokes bytes, forges stamped
/// records at the consumer's head, and overwrites the consumer's published head (which the
/// producer reads). Checks that every record the consumer returns lies inside the ring, that
/// its head only moves forward in whole records, and - while the peer has done nothing
/// hostile - that records arrive exactly as written and neither end reports an error.
pub fn ring(data: &[u8]) {
    let mut input = Input(data);
    let cap = 32 * (4 + usize::from(input.u8()) % 125);
    let head = AtomicU64::new(0);
    // Heap memory, so that the address sanitizer sees any access past the ring.
    let mut mem = vec![0u64; cap / 8];
    let base = mem.as_mut_ptr().cast::<u8>();
    // SAFETY: `head` and `mem` outlive both ends (dropped after them, below); one producer,
    // one consumer, one thread.
    let (mut tx, mut rx) = unsafe {
        (
            Some(Producer::new(&head, base, cap)),
            Some(Consumer::new(&head, base, cap)),
        )
    };
    let src: Vec<u8> = (0..2 * cap).map(|i| (i * 7 + 3) as u8).collect();
    let mut hostile = false;
    let mut sent: VecDeque<Vec<u8>> = VecDeque::new();
    let mut published = 0u64;
    while !input.done() {
        match input.u8() % 8 {
            0 => {
                // Poke bytes anywhere in the ring.
                let at = usize::from(input.u16()) % cap;
                let n = usize::from(input.u8() % 33).min(cap - at);
                let bytes = input.bytes(n).to_vec();
                // SAFETY: at + bytes.len() <= cap; single-threaded.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(at), bytes.len()) };
                hostile = true;
            }
            1 => {
                // Forge a stamped record at the consumer's head.
                let at = (published % cap as u64) as usize;
                let mut hdr = [0u8; 24];
                hdr[..8].copy_from_slice(&(published + 1).to_le_bytes());
                let words = input.bytes(16).to_vec();
                hdr[8..8 + words.len()].copy_from_slice(&words);
                let n = hdr.len().min(cap - at);
                // SAFETY: at + n <= cap; single-threaded.
                unsafe { std::ptr::copy_nonoverlapping(hdr.as_ptr(), base.add(at), n) };
                hostile = true;
            }
            2 | 3 => {
                let Some(c) = rx.as_mut() else { continue };
                match c.peek() {
                    Ok(Some(rec)) => {
                        let (lo, hi) = (base as usize, base as usize + cap);
                        let p = rec.payload as usize;
                        assert!(p >= lo && p <= hi && p + rec.len <= hi, "record outside");
                        assert!(rec.len <= rec.total, "record longer than its message");
                        // SAFETY: just checked to lie inside the ring.
                        let got = unsafe { std::slice::from_raw_parts(rec.payload, rec.len) };
                        if !hostile {
                            let want = sent.pop_front().expect("only records that were sent");
                            assert_eq!(got, &want[..]);
                        }
                        c.consume(&rec);
                        // The consumer published its head, in whole records, forward only (by
                        // at most a padding to the ring's end and this record).
                        let now = head.load(Ordering::Relaxed);
                        let moved = now.checked_sub(published).expect("the head went back");
                        assert!(now % 32 == 0 && moved >= 32 && moved <= 2 * cap as u64);
                        published = now;
                    }
                    Ok(None) => {
                        if !hostile {
                            assert!(sent.is_empty(), "a record that was sent is missing");
                        }
                    }
                    Err(e) => {
                        assert!(hostile, "an honest ring refused: {e}");
                        rx = None;
                    }
                }
            }
            4 | 5 => {
                let Some(p) = tx.as_mut() else { continue };
                let want = usize::from(input.u16()) % (2 * cap);
                let flags = input.u8();
                // SAFETY: `src` is readable for 2 * cap > want bytes.
                let r = unsafe {
                    p.write(
                        src.as_ptr(),
                        want,
                        true,
                        true,
                        (flags & 1 != 0).then_some(7),
                        want,
                    )
                };
                match r {
                    Ok(Some(n)) => {
                        assert!(n <= want);
                        sent.push_back(src[..n].to_vec());
                    }
                    Ok(None) => {}
                    Err(e) => {
                        assert!(hostile, "an honest head refused: {e}");
                        tx = None;
                    }
                }
            }
            6 => {
                let Some(p) = tx.as_mut() else { continue };
                let (addr, total) = (input.u64(), usize::from(input.u16()));
                let r = if input.u8() & 1 == 0 {
                    // A direct message is never shorter than its record (flow.rs sends only
                    // large ones so).
                    let key = input.u64();
                    p.write_direct(addr, key, total.max(ring::DIRECT_PAYLOAD))
                        .map(|ok| ok.then(|| [addr.to_le_bytes(), key.to_le_bytes()].concat()))
                } else {
                    p.write_imm(addr as u32, total).map(|ok| ok.then(Vec::new))
                };
                match r {
                    Ok(Some(payload)) => sent.push_back(payload),
                    Ok(None) => {}
                    Err(e) => {
                        assert!(hostile, "an honest head refused: {e}");
                        tx = None;
                    }
                }
            }
            _ => {
                // A hostile consumer cursor, as the producer reads it.
                head.store(input.u64(), Ordering::Relaxed);
                hostile = true;
            }
        }
    }
    // Both ends are gone before the memory they point into.
    let _ = (tx, rx);
    drop(mem);
}

/// Seeds for [`ring()`]: honest traffic of several shapes, and a few hostile moves.
pub fn ring_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let write =
        |n: u16, imm: bool| [vec![4], n.to_le_bytes().to_vec(), vec![u8::from(imm)]].concat();
    let peek = || vec![2u8];
    let mut honest = vec![28u8]; // a ring of 1024 bytes
    for n in [0u16, 1, 31, 32, 100, 500, 700, 64, 1000] {
        honest.extend(write(n, n % 2 == 1));
        honest.extend(peek());
        honest.extend(peek());
    }
    let mut laps = vec![0u8]; // the smallest ring: 128 bytes
    for i in 0..40u16 {
        laps.extend(write(i * 13 % 90, false));
        if i % 3 != 0 {
            laps.extend(peek());
        }
    }
    let mut direct = vec![60u8];
    for sel in [0u8, 1] {
        direct.push(6);
        direct.extend(0x7f00_dead_beefu64.to_le_bytes());
        direct.extend(4096u16.to_le_bytes());
        direct.push(sel);
        direct.extend(peek());
    }
    let forge = |len: u32, flags: u32, total: u32| {
        let mut v = vec![1u8];
        for w in [len, flags, 0, total] {
            v.extend(w.to_le_bytes());
        }
        v
    };
    let huge = [vec![28], forge(u32::MAX, 3, u32::MAX), peek()].concat();
    let short_pad = [vec![28], forge(64, 8, 0), peek()].concat();
    let good_forgery = [vec![28], forge(8, 3, 8), peek(), peek()].concat();
    let mut head = vec![28u8];
    head.extend(write(200, false));
    head.push(7);
    head.extend(4096u64.to_le_bytes());
    head.extend(write(900, false));
    let mut poke = vec![28u8];
    poke.extend(write(100, false));
    poke.extend([0, 8, 0, 8]);
    poke.extend(u64::MAX.to_le_bytes());
    poke.extend(peek());
    vec![
        ("honest", honest),
        ("laps", laps),
        ("direct-imm", direct),
        ("huge-record", huge),
        ("short-pad", short_pad),
        ("forged-record", good_forgery),
        ("hostile-head", head),
        ("poke-header", poke),
    ]
}
