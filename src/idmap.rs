//! Maps keyed by the library's own integers (connection and registration ids, queue-pair
//! numbers), looked up on the completion path. Their keys never come from a peer, so they need
//! no protection against chosen collisions, and a multiply-and-rotate hash is enough: a few
//! instructions where the standard library's keyed hash takes about a hundred.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map keyed by an integer the library chose or the device reported.
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Hashes integer keys. The table takes its bucket from the low bits and its tag from the top
/// ones: the multiplication by an odd constant spreads every key bit into the top bits, and the
/// keys' own low bits (distinct for nearby ids) stay in the low ones.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

/// 2^64 / golden ratio, odd.
const K: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(K);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearby_keys_hash_apart_in_low_and_high_bits() {
        let h = |n: u64| {
            let mut s = IdHasher::default();
            s.write_u64(n);
            s.finish()
        };
        let hashes: Vec<u64> = (0..1024).map(h).collect();
        let low: std::collections::HashSet<u64> = hashes.iter().map(|x| x & 1023).collect();
        assert_eq!(
            low.len(),
            1024,
            "1,024 consecutive keys share a low-bit bucket"
        );
        let top: std::collections::HashSet<u64> = hashes.iter().map(|x| x >> 57).collect();
        assert!(top.len() > 100, "only {} distinct 7-bit tags", top.len());
    }

    #[test]
    fn a_map_finds_what_it_holds() {
        let mut m: IdMap<u32, u32> = IdMap::default();
        for q in (0..5000u32).map(|i| i.wrapping_mul(2_654_435_761)) {
            m.insert(q, q ^ 7);
        }
        assert_eq!(m.len(), 5000);
        for q in (0..5000u32).map(|i| i.wrapping_mul(2_654_435_761)) {
            assert_eq!(m.get(&q), Some(&(q ^ 7)));
        }
        assert_eq!(m.get(&1), None);
    }
}
