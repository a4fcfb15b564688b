#!/usr/bin/env bash
# The main job: builds the library and the C examples, then runs the example server and client
# exchanging verified messages over the default transport, printing latency and throughput.
# Usage: scripts/demo.sh [-n COUNT] [-s SIZE] [-a ADDRESS]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --quiet
cmake -S . -B build-demo -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-demo -j2 >/dev/null

count=10000 size=4096 addr="shm://rdmabridge-demo-$$"
while getopts "n:s:a:" opt; do
  case $opt in
    n) count=$OPTARG ;; s) size=$OPTARG ;; a) addr=$OPTARG ;;
    *) echo "usage: $0 [-n COUNT] [-s SIZE] [-a ADDRESS]" >&2; exit 2 ;;
  esac
done
echo "demo: $count messages of $size bytes each way over $addr, every one verified"
log=$(mktemp)
./build-demo/rbr_server -a "$addr" -n "$count" -s "$size" -v > >(tee "$log") 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
# The client connects once the server says it listens (a connect before that is refused).
for _ in $(seq 150); do grep -q '^listening on' "$log" && break; sleep 0.2; done
grep -q '^listening on' "$log" || { echo "demo: the server did not start listening" >&2; exit 1; }
./build-demo/rbr_client -a "$addr" -n "$count" -s "$size" -v
wait $server
trap - EXIT
rm -f "$log"
echo "demo: server and client both exited 0"
