//! Entry points of the fuzz targets (`fuzz/`), built only with the `fuzzing` feature. Each
//! drives the real code over input the fuzzer controls, as a hostile peer would write it, and
//! checks that nothing is read or written outside what the library owns.

mod handshake;
mod onesided;
mod ring;

pub use handshake::{handshake, handshake_seeds};
pub use onesided::{onesided, onesided_seeds};
pub use ring::{ring, ring_seeds};

/// Reads the fuzzer's bytes in order; zeros once they run out.
pub(super) struct Input<'a>(&'a [u8]);

impl Input<'_> {
    pub(super) fn done(&self) -> bool {
        self.0.is_empty()
    }

    pub(super) fn bytes(&mut self, n: usize) -> &[u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }

    pub(super) fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    pub(super) fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | u16::from(self.u8()) << 8
    }

    pub(super) fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }

    pub(super) fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }
}
