//! Fuzz target: see `rdmabridge::fuzzing::onesided`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmabridge::fuzzing::onesided(data));
