#!/usr/bin/env bash
# Every test: formatting, lints, header freshness, the Rust test suites, and the C examples and
# test programs (built with -Werror, ASan and UBSan) under ctest. Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo clippy --all-targets -- -D warnings (and with the tokio feature)"
cargo clippy --all-targets --quiet -- -D warnings
cargo clippy --all-targets --features tokio --quiet -- -D warnings
echo "== cargo doc --no-deps, warnings denied (and with the tokio feature)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --features tokio --quiet
echo "== header freshness"
RDMABRIDGE_UPDATE_HEADER=1 cargo build --release --quiet
git diff --exit-code -- include/rdmabridge.h || {
  echo "include/rdmabridge.h is stale: run scripts/regen-header.sh and commit it" >&2
  exit 1
}
echo "== cargo test (release)"
cargo test --release
echo "== cargo test without the verbs feature (shm only: what a machine without rdma-core builds)"
cargo test --release --no-default-features --quiet
echo "== the tokio feature: the async API's tests, its examples and its leak checks"
cargo test --release --features tokio --quiet
echo "== the shm suite again with progress threads (RBR_PROGRESS=thread)"
RBR_PROGRESS=thread cargo test --release --test shm
echo "== model checks (loom): shm ring, completion-queue readiness, doorbells"
# Its own target dir: --cfg loom rebuilds every crate, which would otherwise throw away the build above.
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom" cargo test --release --lib loom
echo "== cargo package: the crate as published builds (only what Cargo.toml's include lists)"
# --allow-dirty: like every step here, this checks the tree as it stands, edits included.
cargo package --allow-dirty --quiet
echo "== C examples and tests/c (Debug: ASan + UBSan) under ctest"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build -j2
ctest --test-dir build --output-on-failure
echo "== valgrind memcheck on the C examples (short run)"
bash scripts/valgrind.sh build-release
echo "== CMake alone builds, installs and is found (find_package, pkg-config, add_subdirectory, FetchContent)"
bash scripts/consumer-test.sh build-consumer
echo "== benchmarks at tiny sizes (proves the side-by-side pipeline works; figures are not checked)"
bash benchmarks/shm.sh --quick --out build/bench-quick
echo "== fuzz targets, a short run each"
bash scripts/fuzz.sh --quick
echo "== shm busy path: at most 0.01 system calls per message (100,000-message ping-pong under strace)"
bash benchmarks/syscalls.sh --quick --max 0.01 --out build/syscalls-quick
echo "== real RDMA: soft-RoCE in a qemu VM"
bash scripts/vm-test.sh build
