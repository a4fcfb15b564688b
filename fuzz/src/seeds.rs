//! Writes the seed corpora under `fuzz/corpus/<target>/`, built from real messages:
//! `cargo run --bin seeds` in `fuzz/` (scripts/fuzz.sh does not need to: they are committed).

use std::fs;
use std::path::Path;

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    fs::create_dir_all(&dir).expect("corpus directory");
    fs::write(dir.join(name), bytes).expect("seed written");
}

fn main() {
    for (name, bytes) in rdmabridge::fuzzing::handshake_seeds() {
        write("handshake", name, &bytes);
    }
    for (name, bytes) in rdmabridge::fuzzing::ring_seeds() {
        write("ring", name, &bytes);
    }
    for (name, bytes) in rdmabridge::fuzzing::onesided_seeds() {
        write("onesided", name, &bytes);
    }
}
