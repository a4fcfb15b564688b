//! Fuzz target: see `rdmabridge::fuzzing::handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdmabridge::fuzzing::handshake(data));
