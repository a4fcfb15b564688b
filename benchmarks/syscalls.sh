#!/usr/bin/env bash
# System calls per message on the shm busy path: a 64 B ping-pong of benchmarks/rbr_bench (both
# sides busy-poll rbr_cq_poll and never sleep; caller progress, the default) with each side
# under `strace -c -f` (every thread of the process: the caller's and the library's own). The
# design promises no system call per message while there is work: the only ones left should be
# the fixed cost of setting up and closing the connection, and the library threads' occasional
# naps while the caller polls.
#   messages   round trips timed by rbr_bench (plus its warm-up of a tenth as many); in each
#              round trip each side sends one message and receives one
#   per side   system calls of the whole process (setup and teardown included) / round trips,
#              the table of calls by name, and the same per thread (from a second, plain
#              `strace -f` pass only when the bound is broken, to say where they come from)
# Exits 1 when either side makes more than MAX system calls per round trip.
#
# Usage: benchmarks/syscalls.sh [--quick] [--max MAX] [--out DIR] [MESSAGES]
#   --quick   100,000 round trips (for scripts/test.sh)
#   --max     the bound (default 0.01)
#   --out DIR results directory (default benchmarks/results/syscalls, ignored by git)
#   MESSAGES  round trips (default 1000000)
# Needs root or sudo for apt (installs strace when missing), cargo, and 2 or more cpus.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

quick=0 max=0.01 msgs="" out="$root/benchmarks/results/syscalls"
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --max) max=${2:?--max needs a number}; shift ;;
    --out) out=${2:?--out needs a directory}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *[!0-9]*|"") echo "syscalls.sh: bad argument '$1'" >&2; exit 2 ;;
    *) msgs=$1 ;;
  esac
  shift
done
[ -n "$msgs" ] || msgs=$([ "$quick" = 1 ] && echo 100000 || echo 1000000)
[ "$(nproc)" -ge 2 ] || { echo "syscalls.sh: needs 2 cpus" >&2; exit 1; }

bash scripts/setup.sh
bash scripts/install-packages.sh syscalls.sh strace util-linux coreutils

build=$root/build-shm-bench
echo "syscalls.sh: building (cargo release, cmake Release in $build)"
timeout 1800 cargo build --release --quiet
timeout 300 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
timeout 900 cmake --build "$build" -j2 --target rbr_bench >/dev/null
bench=$build/rbr_bench

mkdir -p "$out"
rm -f "$out"/*.strace "$out"/*.log "$out"/*.trace
addr="shm://rbr-syscalls-$$"
warm=$((msgs / 10 < 100 ? 100 : msgs / 10))
trips=$((msgs + warm))
tmo=$((120 + msgs / 2000))

spid=""
cleanup() { [ -z "$spid" ] || { kill "$spid" 2>/dev/null || true; wait "$spid" 2>/dev/null || true; }; }
trap cleanup EXIT
trap 'echo "syscalls.sh: interrupted" >&2; exit 130' INT TERM HUP

# run_pair PREFIX STRACE-ARGS...: server on cpu0 and client on cpu1, each under strace.
run_pair() {
  local pre=$1 i rc=0; shift
  timeout "$tmo" taskset -c 0 strace "$@" -o "$out/$pre-server.strace" \
    "$bench" -r server -a "$addr" -T 60 >"$out/$pre-server.log" 2>&1 &
  spid=$!
  for i in $(seq 200); do
    grep -q '^listening' "$out/$pre-server.log" 2>/dev/null && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.05
  done
  timeout "$tmo" taskset -c 1 strace "$@" -o "$out/$pre-client.strace" \
    "$bench" -r client -a "$addr" -t lat -s 64 -n "$msgs" -T 60 >"$out/$pre-client.log" 2>&1 ||
    rc=$?
  wait "$spid" || rc=$((rc ? rc : $?))
  spid=""
  if [ "$rc" -ne 0 ]; then
    echo "syscalls.sh: the ping-pong failed (status $rc); see $out/$pre-*.log" >&2
    tail -n 5 "$out/$pre-server.log" "$out/$pre-client.log" >&2
    exit 1
  fi
}

echo "syscalls.sh: $msgs round trips of 64 B (+ $warm warm-up) under strace -c -f"
run_pair count -f -c
grep '^RESULT' "$out/count-client.log" || true

# The total line of strace -c: "100.00 SECONDS USECS/CALL CALLS [ERRORS] total".
calls_of() { awk '$NF == "total" { print $4 }' "$1"; }
over=0
for side in server client; do
  calls=$(calls_of "$out/count-$side.strace")
  [ -n "$calls" ] || { echo "syscalls.sh: no strace summary for the $side" >&2; exit 1; }
  per=$(awk -v c="$calls" -v m="$trips" 'BEGIN { printf "%.6f", c / m }')
  echo
  echo "$side: $calls system calls in $trips round trips: $per per round trip (bound $max)"
  # The table, busiest first, without its header rules (all of it in the .strace file).
  awk '$1 ~ /^[0-9.]+$/ && $NF != "total"' "$out/count-$side.strace" | sort -k4,4nr |
    awk 'NR <= 12 { printf "  %-20s %8d calls%s\n", $NF, $4, NF == 6 ? " (" $5 " failed)" : "" }
      NR > 12 { rest += $4; kinds++ }
      END { if (kinds) printf "  %d other kinds      %8d calls\n", kinds, rest }'
  if awk -v p="$per" -v m="$max" 'BEGIN { exit !(p > m) }'; then over=1; fi
done

if [ "$over" = 1 ]; then
  # Where they come from: every call with its thread, then each thread's name (the library
  # names its connection threads rbr-shm-ID) and count.
  echo
  echo "syscalls.sh: over the bound; tracing every call by thread to say where they come from"
  run_pair trace -f -qq -e 'trace=!clock_gettime'
  for side in server client; do
    echo "$side, system calls by thread and name (the caller's thread is 'main'):"
    awk '/resumed>/ { next }
      $2 ~ /^execve\(/ { name[$1] = "main" }
      $2 ~ /^prctl\(PR_SET_NAME,/ { t = $3; gsub(/[",)]/, "", t); name[$1] = t }
      { split($2, a, "("); c[$1 SUBSEP a[1]]++ }
      END { for (k in c) { split(k, p, SUBSEP)
              printf "%d %s %s\n", c[k], (p[1] in name ? name[p[1]] : "tid-" p[1]), p[2] } }' \
      "$out/trace-$side.strace" | sort -nr | head -n 15 |
      awk '{ printf "  %8d  %-12s %s\n", $1, $2, $3 }'
  done
  echo "syscalls.sh: FAILED: more than $max system calls per round trip (logs in $out)" >&2
  exit 1
fi
echo
echo "syscalls.sh: ok: at most $max system calls per round trip on both sides"
