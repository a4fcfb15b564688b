#!/usr/bin/env bash
# Verbs benchmark on soft-RoCE: boots the VM once and runs benchmarks/verbs-progress-guest.sh,
# which measures perftest (ib_send_lat, ib_send_bw) and cmtime against the C examples in both
# progress modes (RBR_PROGRESS=caller|thread) side by side, and prints a table of ratios to the
# stock tools: latency p50 and p99 at 2 B and 4 KiB, bandwidth from 64 KiB to 1 MiB, connection
# setup; medians over the rounds with their spread.
# Writes into benchmarks/results-verbs/: raw.txt (every figure of every round), table.md (the
# table above), results.csv (per measure and tool: median, min, max, ratio to the stock tool)
# and verbs.png (latency and bandwidth against size, ours and the stock tools).
# Usage: benchmarks/verbs-progress.sh [ROUNDS]   (default 3; about 8 minutes per round under TCG)
#        benchmarks/verbs-progress.sh --quick     (one round at tiny counts, caller progress only:
#                                                   proves the pipeline; about a minute)
#        RBR_BENCH_MEASURES=setup|event|first|scale benchmarks/verbs-progress.sh [ROUNDS]
#                                                  (only connection setup, only the pairs
#                                                   asleep between messages, only the first
#                                                   messages of a connection (rbr_first and
#                                                   ib_send_lat's first round trips), or only
#                                                   the round-robin run over N connections)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3} quick=
if [ "$rounds" = --quick ]; then rounds=1 quick=--quick; fi
bash scripts/setup-vm.sh
bash scripts/install-packages.sh verbs-progress.sh gnuplot-nox python3
out=$PWD/benchmarks/results-verbs
mkdir -p "$out"
rm -f "$out"/raw.txt "$out"/table.md "$out"/results.csv "$out"/verbs.png
cargo build --release --quiet
cmake -S . -B build-bench -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-bench -j2 >/dev/null
scripts/vm-run.sh --timeout 5400 --rw "$out" -- \
  env RBR_BENCH_MEASURES="${RBR_BENCH_MEASURES:-all}" benchmarks/verbs-progress-guest.sh "$(realpath build-bench)" "$rounds" "${quick:--}" "$out"
[ -s "$out/raw.txt" ] || { echo "verbs-progress.sh: no results from the VM" >&2; exit 1; }
timeout 60 python3 benchmarks/verbs_report.py "$out"
timeout 60 gnuplot "$out/plot.gp" && echo "plot: $out/verbs.png"
