//! The data path's copies: a message's bytes, and a one-sided access's. Sizes a message
//! usually has are copied inline: a call to `memcpy` (through the PLT, then its own dispatch on
//! the size) costs more than the copy of a small message itself.

/// Copies `len` bytes of a message from `src` to `dst`: up to 64 bytes with at most four
/// unaligned loads and four unaligned stores (overlapping at the middle when `len` is not a
/// power of two), longer ones with `memcpy`.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `len` bytes,
/// the two not overlapping.
#[inline(always)]
pub(crate) unsafe fn copy_message(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: in every arm each access lies inside `src..src+len` or `dst..dst+len` (the
    // second one of an arm ends exactly at `len`, and `len` is at least its width there);
    // the caller's contract covers those ranges, and unaligned accesses are allowed.
    unsafe {
        if len > 64 {
            std::ptr::copy_nonoverlapping(src, dst, len);
        } else if len > 32 {
            let (a, b) = (load::<u128>(src, 0), load::<u128>(src, 16));
            let (c, d) = (load::<u128>(src, len - 32), load::<u128>(src, len - 16));
            store(dst, 0, a);
            store(dst, 16, b);
            store(dst, len - 32, c);
            store(dst, len - 16, d);
        } else if len > 16 {
            let (a, b) = (load::<u128>(src, 0), load::<u128>(src, len - 16));
            store(dst, 0, a);
            store(dst, len - 16, b);
        } else if len >= 8 {
            let (a, b) = (load::<u64>(src, 0), load::<u64>(src, len - 8));
            store(dst, 0, a);
            store(dst, len - 8, b);
        } else if len >= 4 {
            let (a, b) = (load::<u32>(src, 0), load::<u32>(src, len - 4));
            store(dst, 0, a);
            store(dst, len - 4, b);
        } else if len > 0 {
            let (a, b, c) = (*src, *src.add(len / 2), *src.add(len - 1));
            *dst = a;
            *dst.add(len / 2) = b;
            *dst.add(len - 1) = c;
        }
    }
}

/// Copies the `len` bytes of an access into or out of a peer's region mapped here: a word of
/// 8 or 4 bytes (the size of a flag or a counter, whose latency counts) as one load and one
/// store, anything else as a message's bytes are copied ([`copy_message`]: inline up to 64
/// bytes, `memcpy` beyond).
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
#[inline(always)]
pub(crate) unsafe fn copy_access(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract; unaligned accesses of exactly `len` bytes.
    unsafe {
        match len {
            8 => dst
                .cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned()),
            4 => dst
                .cast::<u32>()
                .write_unaligned(src.cast::<u32>().read_unaligned()),
            _ => copy_message(src, dst, len),
        }
    }
}

/// # Safety
/// `p + at` is readable for `size_of::<T>()` bytes.
#[inline(always)]
unsafe fn load<T: Copy>(p: *const u8, at: usize) -> T {
    // SAFETY: the caller's contract.
    unsafe { p.add(at).cast::<T>().read_unaligned() }
}

/// # Safety
/// `p + at` is writable for `size_of::<T>()` bytes.
#[inline(always)]
unsafe fn store<T: Copy>(p: *mut u8, at: usize, v: T) {
    // SAFETY: the caller's contract.
    unsafe { p.add(at).cast::<T>().write_unaligned(v) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_length_up_to_past_the_inline_sizes_copies_exactly_its_bytes() {
        let src: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in 0..=130 {
            for off in [0usize, 1, 7] {
                let mut dst = vec![0xEEu8; 200];
                // SAFETY: both buffers hold off + len + 1 bytes and are distinct.
                unsafe { copy_message(src.as_ptr().add(off), dst.as_mut_ptr().add(1), len) };
                assert_eq!(dst[0], 0xEE, "byte before, len {len}");
                assert_eq!(
                    &dst[1..1 + len],
                    &src[off..off + len],
                    "len {len} off {off}"
                );
                assert!(
                    dst[1 + len..].iter().all(|&b| b == 0xEE),
                    "byte after, len {len}"
                );
            }
        }
    }
}
