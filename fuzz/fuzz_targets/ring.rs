//! Fuzz target: see `rdmabridge::fuzzing::ring`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmabridge::fuzzing::ring(data));
