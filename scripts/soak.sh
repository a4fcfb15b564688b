#!/usr/bin/env bash
# The soak (documented in docs/faults.md; not in CI, where ctest's soak_short runs 300 cycles):
#   1. 10,000 connect / transfer / close cycles (4 verified messages each way per cycle);
#   2. a mixed-traffic run for MINUTES minutes (default 10): message sizes from 1 byte to
#      64 KiB, and on every connection an RDMA write, a read back, a fetch-and-add and a
#      compare-and-swap, then a close by either side in turn.
# Both over shm, in one process holding both ends, from a Release build. Each prints the
# process's descriptor count and resident memory as it goes and fails if, after its warm-up
# (the first tenth), descriptors grow at all or resident memory by more than 8 MiB.
# usage: scripts/soak.sh [MINUTES] [CYCLES]     (defaults 10 and 10000)
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
cycles=${2:-10000}
dir=build-release
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$dir" -j2 --target rbr_soak >/dev/null
echo "== $cycles connect / transfer / close cycles"
"$dir/rbr_soak" -a "shm://rbr-soak-cycles-$$" -n "$cycles" -k 4 -s $((cycles / 20 > 0 ? cycles / 20 : 1))
echo "== mixed traffic for $minutes minutes"
"$dir/rbr_soak" -a "shm://rbr-soak-mixed-$$" -t $((minutes * 60)) -m -k 16 -s 2000
