#!/usr/bin/env bash
# System calls per message on the shm busy path: a 64 B ping-pong of benchmarks/rbr_bench (both
# sides busy-poll rbr_cq_poll and never sleep; caller progress, the default) with each side
# under `strace -c -f` (every thread of the process: the caller's and the library's own). The
# design promises no system call per message while there is work: the only ones left should be
# the fixed cost of setting up and closing the connection, and the library threads' occasional
# naps while the caller polls.
# Then 1 MiB messages, which go in one copy: the sender's region is one the library allocated
# (rbr_bench's are), so the receiver copies straight out of its own mapping of it, with no
# `process_vm_readv` (the one copy from caller memory) beyond the handshake's, which this stage
# checks. Its counts are
# printed, not held to the bound: a round trip takes a hundred times as long, and the library
# thread's naps, which come with time and not with messages, are most of them.
#   messages   round trips timed by rbr_bench (plus its warm-up of a tenth as many); in each
#              round trip each side sends one message and receives one
#   per side   system calls of the whole process (setup and teardown included) / round trips,
#              the table of calls by name, and the same per thread (from a second, plain
#              `strace -f` pass only when the bound is broken, to say where they come from)
# Exits 1 when either side makes more than MAX system calls per round trip of 64 B, or calls
# process_vm_readv in the 1 MiB stage.
#
# Usage: benchmarks/syscalls.sh [--quick] [--max MAX] [--out DIR] [MESSAGES]
#   --quick   100,000 round trips of 64 B, 30,000 of 1 MiB (for scripts/test.sh)
#   --max     the bound (default 0.01)
#   --out DIR results directory (default benchmarks/results/syscalls, ignored by git)
#   MESSAGES  round trips of 64 B (default 1000000; of 1 MiB a tenth as many, at least 30000)
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
warm_of() { echo $(($1 / 10 < 100 ? 100 : $1 / 10)); }
big=$((1 << 20)) big_msgs=$((msgs / 10 < 30000 ? 30000 : msgs / 10))
tmo=$((120 + msgs / 2000 + big_msgs / 200))

spid=""
cleanup() { [ -z "$spid" ] || { kill "$spid" 2>/dev/null || true; wait "$spid" 2>/dev/null || true; }; }
trap cleanup EXIT
trap 'echo "syscalls.sh: interrupted" >&2; exit 130' INT TERM HUP

# run_pair PREFIX SIZE ROUND-TRIPS STRACE-ARGS...: server on cpu0 and client on cpu1, each under
# strace.
run_pair() {
  local pre=$1 size=$2 n=$3 i rc=0; shift 3
  timeout "$tmo" taskset -c 0 strace "$@" -o "$out/$pre-server.strace" \
    "$bench" -r server -a "$addr" -T 60 >"$out/$pre-server.log" 2>&1 &
  spid=$!
  for i in $(seq 200); do
    grep -q '^listening' "$out/$pre-server.log" 2>/dev/null && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.05
  done
  timeout "$tmo" taskset -c 1 strace "$@" -o "$out/$pre-client.strace" \
    "$bench" -r client -a "$addr" -t lat -s "$size" -n "$n" -T 60 >"$out/$pre-client.log" 2>&1 ||
    rc=$?
  wait "$spid" || rc=$((rc ? rc : $?))
  spid=""
  if [ "$rc" -ne 0 ]; then
    echo "syscalls.sh: the ping-pong failed (status $rc); see $out/$pre-*.log" >&2
    tail -n 5 "$out/$pre-server.log" "$out/$pre-client.log" >&2
    exit 1
  fi
}

# The total line of strace -c: "100.00 SECONDS USECS/CALL CALLS [ERRORS] total"; the calls of
# one kind.
calls_of() { awk '$NF == "total" { print $4 }' "$1"; }
calls_named() { awk -v n="$2" '$NF == n { print $4; found = 1 } END { if (!found) print 0 }' "$1"; }

# stage PREFIX SIZE ROUND-TRIPS [BOUND]: the ping-pong under strace -c -f, its counts, and with
# BOUND (1) held to the bound (with a per-thread trace when over it).
stage() {
  local pre=$1 size=$2 n=$3 bound=${4:-0} warm trips side calls per over=0
  warm=$(warm_of "$n")
  trips=$((n + warm))
  echo "syscalls.sh: $n round trips of $size B (+ $warm warm-up) under strace -c -f"
  run_pair "$pre" "$size" "$n" -f -c
  grep '^RESULT' "$out/$pre-client.log" || true
  for side in server client; do
    calls=$(calls_of "$out/$pre-$side.strace")
    [ -n "$calls" ] || { echo "syscalls.sh: no strace summary for the $side" >&2; exit 1; }
    per=$(awk -v c="$calls" -v m="$trips" 'BEGIN { printf "%.6f", c / m }')
    echo
    echo "$side: $calls system calls in $trips round trips: $per per round trip$(
      [ "$bound" = 1 ] && echo " (bound $max)")"
    # The table, busiest first, without its header rules (all of it in the .strace file).
    awk '$1 ~ /^[0-9.]+$/ && $NF != "total"' "$out/$pre-$side.strace" | sort -k4,4nr |
      awk 'NR <= 12 { printf "  %-20s %8d calls%s\n", $NF, $4, NF == 6 ? " (" $5 " failed)" : "" }
        NR > 12 { rest += $4; kinds++ }
        END { if (kinds) printf "  %d other kinds      %8d calls\n", kinds, rest }'
    if [ "$bound" = 1 ] && awk -v p="$per" -v m="$max" 'BEGIN { exit !(p > m) }'; then
      over=1
    fi
  done

  if [ "$over" = 1 ]; then
    # Where they come from: every call with its thread, then each thread's name (the library
    # names its threads) and count.
    echo
    echo "syscalls.sh: over the bound; tracing every call by thread to say where they come from"
    run_pair "$pre-trace" "$size" "$n" -f -qq -e 'trace=!clock_gettime'
    for side in server client; do
      echo "$side, system calls by thread and name (the caller's thread is 'main'):"
      awk '/resumed>/ { next }
        $2 ~ /^execve\(/ { name[$1] = "main" }
        $2 ~ /^prctl\(PR_SET_NAME,/ { t = $3; gsub(/[",)]/, "", t); name[$1] = t }
        { split($2, a, "("); c[$1 SUBSEP a[1]]++ }
        END { for (k in c) { split(k, p, SUBSEP)
                printf "%d %s %s\n", c[k], (p[1] in name ? name[p[1]] : "tid-" p[1]), p[2] } }' \
        "$out/$pre-trace-$side.strace" | sort -nr | head -n 15 |
        awk '{ printf "  %8d  %-12s %s\n", $1, $2, $3 }'
    done
    echo "syscalls.sh: FAILED: more than $max system calls per round trip (logs in $out)" >&2
    exit 1
  fi
  echo
}

stage count 64 "$msgs" 1
stage big "$big" "$big_msgs"
# The handshake reads a word of the peer once (can it?): the 64 B run makes as many calls.
for side in server client; do
  n=$(calls_named "$out/big-$side.strace" process_vm_readv)
  n0=$(calls_named "$out/count-$side.strace" process_vm_readv)
  echo "$side: process_vm_readv $n times with 1 MiB messages, $n0 with 64 B (the handshake's)"
  if [ "$n" -gt "$n0" ]; then
    echo "syscalls.sh: FAILED: 1 MiB messages from an allocated region did not go through the" \
      "region's mapping (logs in $out)" >&2
    exit 1
  fi
done
echo "syscalls.sh: ok: at most $max system calls per round trip of 64 B on both sides;" \
  "no process_vm_readv for 1 MiB messages from allocated regions beyond the handshake's"
