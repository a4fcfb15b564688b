#!/usr/bin/env bash
# Verbs benchmark on soft-RoCE: boots the VM once and runs benchmarks/verbs-progress-guest.sh,
# which measures perftest (ib_send_lat, ib_send_bw) and the C examples in both progress modes
# (RBR_PROGRESS=caller|thread) side by side, and prints ratios to the stock tools.
# Usage: benchmarks/verbs-progress.sh [ROUNDS]   (default 3; about 2 minutes per round under TCG)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-vm.sh
cargo build --release --quiet
cmake -S . -B build-bench -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-bench -j2 >/dev/null
scripts/vm-run.sh --timeout 3000 -- benchmarks/verbs-progress-guest.sh "$(realpath build-bench)" "${1:-3}"
