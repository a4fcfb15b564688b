#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (benchmarks/verbs-progress.sh boots it). Measures, side by side in
# one boot, the stock perftest tools against the C examples over verbs in both progress modes:
#   latency:    ib_send_lat -R -s 2       vs  rbr_client ping-pong, 2 B (median one-way)
#   throughput: ib_send_bw  -R -s 65536   vs  rbr_client streaming, 64 KiB, window 32
# rdmabridge runs as rbr-caller (progress on the caller's thread, the default), rbr-thread
# (progress threads) and rbr-caller-busy (caller progress, rbr_cq_wait never sleeping).
# Each round runs every variant once, in turn, so drift hits them alike. Prints one line per run
# ("RESULT kind tool value") and, at the end, medians and ratios.
# Usage (in the guest): benchmarks/verbs-progress-guest.sh C_BUILD_DIR [ROUNDS]
set -u
build=$1 rounds=${2:-3}
ip=${RBR_TEST_ADDR:?RBR_TEST_ADDR is unset: run me through benchmarks/verbs-progress.sh}
port=18000 results=/tmp/bench-results
: >"$results"

next_port() { port=$((port + 1)); }

# perftest: server and client of TOOL with ARGS; prints the client's result line. About 1 run in
# 18 fails to connect on rxe (BENCH-ANCHORS.md), so up to 3 tries with a fresh server each.
perftest() { # TOOL ARGS...
  local tool=$1; shift
  local try
  for try in 1 2 3; do
    next_port
    timeout 120 "$tool" -R -d rxe0 -p "$port" "$@" >/tmp/perf-server.log 2>&1 &
    local s=$!
    sleep 1
    if timeout 120 "$tool" -R -d rxe0 -p "$port" "$@" "$ip" >/tmp/perf-client.log 2>&1; then
      wait "$s"
      # The result row: the first line that starts with the size column.
      awk '$1 ~ /^[0-9]+$/ && NF >= 5 { print; exit }' /tmp/perf-client.log
      return 0
    fi
    kill "$s" 2>/dev/null; wait "$s" 2>/dev/null
    echo "($tool try $try failed: $(tail -n 2 /tmp/perf-client.log | tr '\n' ' '))" >&2
  done
  return 1
}

# rbr: the C server and client with progress MODE and rbr_cq_wait spin SPIN us (- = the
# library's default) on both sides; prints the client's output.
rbr() { # MODE SPIN SIZE COUNT
  local mode=$1 spin=$2 size=$3 count=$4
  local opts=(-p "$mode")
  [ "$spin" = - ] || opts+=(-S "$spin")
  next_port
  local addr="rdma://$ip:$port"
  timeout 300 "$build/rbr_server" "${opts[@]}" -q -a "$addr" -n "$count" -s "$size" \
    >/tmp/rbr-server.log 2>&1 &
  local s=$!
  local i
  for i in $(seq 100); do grep -q '^listening on' /tmp/rbr-server.log && break; sleep 0.1; done
  timeout 300 "$build/rbr_client" "${opts[@]}" -a "$addr" -n "$count" -s "$size" -w 32 \
    >/tmp/rbr-client.log 2>&1
  local c=$?
  wait "$s"; local r=$?
  if [ "$c" -ne 0 ] || [ "$r" -ne 0 ]; then
    echo "rbr ($mode) failed: client $c, server $r" >&2
    cat /tmp/rbr-client.log /tmp/rbr-server.log >&2
    return 1
  fi
  cat /tmp/rbr-client.log
}

record() { echo "RESULT $*" | tee -a "$results"; }

# The rdmabridge variants, MODE/SPIN: both progress modes with the library's default spin, and
# caller progress polling without sleeping (as perftest does) for a ping-pong's whole wait.
# RBR_BENCH_VARIANTS="MODE/SPIN ..." measures others.
variants=${RBR_BENCH_VARIANTS:-"caller/- thread/- caller/1000000"}
name() { case $1 in */-) echo "rbr-${1%/*}" ;; */1000000) echo "rbr-${1%/*}-busy" ;; *) echo "rbr-${1%/*}-spin${1#*/}" ;; esac; }

echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource), $(nproc) CPUs"
for round in $(seq "$rounds"); do
  echo "== round $round"
  # ib_send_lat columns: bytes iterations t_min t_max t_typical t_avg ...
  if row=$(perftest ib_send_lat -s 2 -n 1000); then
    record lat ib_send_lat "$(echo "$row" | awk '{ print $5 }')"
  fi
  for v in $variants; do
    if out=$(rbr "${v%/*}" "${v#*/}" 2 1000); then
      record lat "$(name "$v")" "$(echo "$out" | sed -n 's/.*latency median \([0-9.]*\) us.*/\1/p')"
    fi
  done
  # ib_send_bw columns: bytes iterations BW_peak BW_average MsgRate, in MiB/s.
  if row=$(perftest ib_send_bw -s 65536 -n 1000); then
    record bw ib_send_bw "$(echo "$row" | awk '{ printf "%.1f", $4 * 1.048576 }')"
  fi
  for v in $variants; do
    if out=$(rbr "${v%/*}" "${v#*/}" 65536 1000); then
      record bw "$(name "$v")" "$(echo "$out" | sed -n 's/^streaming: .*: \([0-9.]*\) MB\/s.*/\1/p')"
    fi
  done
done

echo "== summary (medians over $rounds rounds; latency: one-way us, lower is better;"
echo "   throughput: MB/s = 10^6 bytes/s, higher is better)"
median() { sort -n | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
m() { awk -v k="$1" -v t="$2" '$2 == k && $3 == t && $4 != "" { print $4 }' "$results" | median; }
lat_ref=$(m lat ib_send_lat) bw_ref=$(m bw ib_send_bw)
names=$(for v in $variants; do name "$v"; done)
for t in ib_send_lat $names; do
  v=$(m lat "$t"); [ -n "$v" ] || continue
  echo "latency  $t: $v us ($(awk -v a="$v" -v b="$lat_ref" 'BEGIN { if (b > 0) printf "%.2fx ib_send_lat", a / b }'))"
done
for t in ib_send_bw $names; do
  v=$(m bw "$t"); [ -n "$v" ] || continue
  echo "throughput $t: $v MB/s ($(awk -v a="$v" -v b="$bw_ref" 'BEGIN { if (b > 0) printf "%.2fx ib_send_bw", a / b }'))"
done
# Every variant must have produced every round's figure.
n=$(wc -l <"$results")
want=$((rounds * 2 * (1 + $(echo $variants | wc -w))))
[ "$n" -eq "$want" ] || { echo "bench: $n of $want runs produced a figure" >&2; exit 1; }
