#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (benchmarks/verbs-progress.sh boots it). Measures, side by side in
# one boot, the stock tools against the C examples over verbs in both progress modes:
#   latency:    ib_send_lat -R at 2 B and 4 KiB  vs  rbr_client ping-pong (one-way: p50, p99)
#   event:      ib_send_lat -R -e (perftest's completion-channel mode) at 2 B and 4 KiB  vs
#               rbr_bench -E (an event loop: rbr_cq_poll until RBR_EMPTY, then epoll_wait on
#               rbr_cq_fd) and rbr_bench -W -S 0 (rbr_cq_poll_wait sleeping at once)
#   throughput: ib_send_bw -R from 64 KiB up     vs  rbr_client streaming, window 32
#   one-sided:  ib_write_lat / ib_read_lat -R at 2 B and 4 KiB, ib_write_bw / ib_read_bw -R from
#               64 KiB up  vs  rbr_rma_bench (write ping-pong polling memory, read round
#               trips, streaming writes and reads, window 32; both sides busy-poll, as
#               perftest's do: with -R its server polls for the closing handshake all through
#               the client's run, even while the client reads); and the 2 B read split at the
#               client's write() to the device (benchmarks/write_split.c): inside it, the
#               kernel's share of the round trip, outside it, the program's own
#   setup:      cmtime (N connections)           vs  rbr_setup (N connections one after another,
#               each connected, accepted, carrying a 64 B message each way and closed; server
#               and client in two processes, as cmtime's); connections per second of the
#               client's whole run, for both
#   in flight:  cmtime -c C (it sets up all C at once) vs rbr_setup -n C -c C (all C started at
#               once with rbr_connect_start from one thread, each carrying its message each way
#               and closed; the server accepts them without blocking); the same measure
#   first:      rbr_first (benchmarks/first.c), both sides busy-polling and both in
#               rbr_cq_poll_wait: per connection the slowest of the first 200 round trips from
#               the connect (median over connections, against the busy run's steady round trip),
#               the very first round trip (median over connections, against the same),
#               and a message sent while the peer sleeps 50 ms before posting its receive, timed
#               from that post to the receive's completion (against ib_send_lat's one-way 2 B);
#               beside them ib_send_lat -U's first round trip on a new queue pair against its
#               steady one (RBR_BENCH_MEASURES=first runs only these)
#   scale:      rbr_scaling's round-robin rate over 1, 16 and 256 connections on one queue,
#               each against one connection side by side, and the resident and registered
#               (pinned) memory each connection adds on each side; then the same with the
#               server's connections on one shared receive queue of 4,096 receives
#               (RBR_BENCH_MEASURES=scale)
# rdmabridge runs as rbr-caller (progress on the caller's thread, the default), rbr-thread
# (progress threads) and rbr-caller-busy (caller progress, rbr_cq_wait never sleeping), all
# three the C example (rbr_client/rbr_server: streaming there is echoed, so both directions
# carry it), and as rbr-bench: benchmarks/rbr_bench, which measures as perftest does (caller
# progress, both sides busy-polling rbr_cq_poll, one-way streaming), rbr-bench-wait: the same
# waiting with rbr_cq_poll_wait (its default poll-then-sleep), and rbr-bench-wait2: waiting in
# two calls, rbr_cq_poll and, when it finds nothing, rbr_cq_wait.
# Each round runs every tool once per measure, in turn, so drift hits them alike. Prints one
# line per figure ("RESULT measure tool field value") and, at the end, a table: medians over
# the rounds, the spread (min-max over rounds) and ratios to the stock tool of each measure.
# Usage (in the guest): benchmarks/verbs-progress-guest.sh C_BUILD_DIR [ROUNDS] [--quick|-] [OUT]
#   --quick: one round at tiny counts, caller progress only (proves the pipeline works)
#   OUT: a directory writable from the guest; raw.txt (every figure) and table.md go there
#   RBR_BENCH_MEASURES=setup (environment): only the two setup pairs, each round (minutes, for
#   setup's spread over many rounds); =event: only the pairs asleep between messages
set -u
build=$1 rounds=${2:-3} quick=${3:-} outdir=${4:-}
ip=${RBR_TEST_ADDR:?RBR_TEST_ADDR is unset: run me through benchmarks/verbs-progress.sh}
port=18000 results=/tmp/bench-results
: >"$results"

# Sizes and counts. Streaming moves about 64 MiB per run (at least 64 messages).
lat_sizes="2 4096" bw_sizes="65536 262144 1048576" conns=100 inflight=64 first_n=10 scale_n=1,16,256 scale_pool=4096
lat_n() { [ "$1" -ge 4096 ] && echo 300 || echo 1000; } # ib_send_lat hangs on rxe at 4 KiB x 1000
bw_n() { local n=$((64 * 1048576 / $1)); [ "$n" -ge 64 ] && echo "$n" || echo 64; }
variants=${RBR_BENCH_VARIANTS:-"caller/- thread/- caller/1000000"}
if [ "$quick" = --quick ]; then
  rounds=1 bw_sizes=65536 conns=10 inflight=10 first_n=2 scale_n=1,16 scale_pool=256
  lat_n() { echo 100; }
  bw_n() { echo 50; }
  variants=${RBR_BENCH_VARIANTS:-"caller/-"}
fi

next_port() { port=$((port + 1)); }
# What the clients of perftest() and pair() run under (empty: nothing; see split_read).
client_env=()
now_ns() { date +%s%N; }

# perftest: server and client of TOOL with ARGS; prints the client's result line. About 1 run in
# 18 fails to connect on rxe here, so up to 3 tries with a fresh server each.
perftest() { # TOOL ARGS...
  local tool=$1; shift
  local try
  for try in 1 2 3; do
    next_port
    timeout 120 "$tool" -R -d rxe0 -p "$port" "$@" >/tmp/perf-server.log 2>&1 &
    local s=$!
    sleep 1
    local row=
    if env "${client_env[@]}" timeout 120 "$tool" -R -d rxe0 -p "$port" "$@" "$ip" \
      >/tmp/perf-client.log 2>&1; then
      wait "$s"
      # The result row: the first line that starts with the size column. A row of 0 or inf
      # (seen on rxe) is a failed run.
      row=$(awk '$1 ~ /^[0-9]+$/ && NF >= 5 { print; exit }' /tmp/perf-client.log)
      if [ -n "$row" ] && ! echo "$row" | awk '{ for (i = 3; i <= NF && i <= 6; i++) if ($i == "inf" || $i + 0 == 0) exit 1 }'; then
        row=
      fi
      if [ -n "$row" ]; then echo "$row"; return 0; fi
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
  # Emptied here, not by the redirection below: that happens in the child, which may run
  # after the first look for "listening" and so let a previous run's line through.
  : >/tmp/rbr-server.log
  timeout 300 "$build/rbr_server" "${opts[@]}" -q -a "$addr" -n "$count" -s "$size" \
    >/tmp/rbr-server.log 2>&1 &
  local s=$!
  local i
  # Up to 60 s: under emulation on a loaded host a server's first device open can take long.
  for i in $(seq 600); do grep -q '^listening on' /tmp/rbr-server.log && break; kill -0 "$s" 2>/dev/null || break; sleep 0.1; done
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

# cmtime: N connections (set up at once, then torn down); prints connections per second of the
# client's whole run. The rdma-core 44 server never exits: killed once the client is done.
cmtime_rate() { # N
  local n=$1 try
  for try in 1 2 3; do
    next_port
    timeout 120 cmtime -b "$ip" -c "$n" -p "$port" >/tmp/cmtime-server.log 2>&1 &
    local s=$!
    sleep 1
    local t0; t0=$(now_ns)
    if timeout 120 cmtime -s "$ip" -c "$n" -p "$port" >/tmp/cmtime-client.log 2>&1; then
      local t1; t1=$(now_ns)
      kill "$s" 2>/dev/null; wait "$s" 2>/dev/null
      awk -v n="$n" -v ns=$((t1 - t0)) 'BEGIN { printf "%.1f\n", n / (ns / 1e9) }'
      return 0
    fi
    kill "$s" 2>/dev/null; wait "$s" 2>/dev/null
    echo "(cmtime try $try failed: $(tail -n 2 /tmp/cmtime-client.log | tr '\n' ' '))" >&2
  done
  return 1
}

# rbr_setup: N connections, C in flight (1: one after another, with the blocking connect), each
# connected, accepted, carrying a 64 B message each way and closed; prints connections per
# second of the client's whole run.
rbr_conn_rate() { # N [C]
  local n=$1 c=${2:-1} i
  next_port
  : >/tmp/setup-server.log
  timeout 300 "$build/rbr_setup" -r server -a "rdma://$ip:$port" -T 60 >/tmp/setup-server.log 2>&1 &
  local s=$!
  for i in $(seq 600); do grep -q '^listening' /tmp/setup-server.log && break; kill -0 "$s" 2>/dev/null || break; sleep 0.1; done
  local t0; t0=$(now_ns)
  if ! timeout 300 "$build/rbr_setup" -r client -a "rdma://$ip:$port" -n "$n" -c "$c" -T 60 \
    >/tmp/setup-client.log 2>&1; then
    echo "rbr_setup failed:" >&2; cat /tmp/setup-client.log /tmp/setup-server.log >&2
    kill "$s" 2>/dev/null; wait "$s" 2>/dev/null
    return 1
  fi
  local t1; t1=$(now_ns)
  wait "$s" || { echo "rbr_setup server failed:" >&2; cat /tmp/setup-server.log >&2; return 1; }
  awk -v n="$n" -v ns=$((t1 - t0)) 'BEGIN { printf "%.1f\n", n / (ns / 1e9) }'
}

# rbr_first busy|wait: a server and a client, both busy-polling or both in rbr_cq_poll_wait, over
# first_n connections; prints the client's two RESULT lines (first, late).
first_run() { # busy|wait
  local w=() i
  [ "$1" = wait ] && w=(-W)
  next_port
  : >/tmp/first-server.log
  timeout 300 "$build/rbr_first" -r server -a "rdma://$ip:$port" -T 60 "${w[@]}" >/tmp/first-server.log 2>&1 &
  local s=$!
  for i in $(seq 600); do grep -q '^listening' /tmp/first-server.log && break; kill -0 "$s" 2>/dev/null || break; sleep 0.1; done
  if ! timeout 600 "$build/rbr_first" -r client -a "rdma://$ip:$port" -n "$first_n" -T 60 "${w[@]}" \
    >/tmp/first-client.log 2>&1; then
    echo "rbr_first ($1) failed:" >&2; cat /tmp/first-client.log /tmp/first-server.log >&2
    kill "$s" 2>/dev/null; wait "$s" 2>/dev/null
    return 1
  fi
  wait "$s" || { echo "rbr_first server ($1) failed:" >&2; cat /tmp/first-server.log >&2; return 1; }
  grep '^RESULT ' /tmp/first-client.log
}

# The stock tool's first round trip on a fresh connection: first_n runs of ib_send_lat -U (each
# a new queue pair, 200 iterations of 64 B, every iteration's time printed in order); prints
# the median over runs of the first iteration and of each run's median, as round trips (the
# tool prints half of each).
stock_first() {
  local r firsts=() meds=() its
  for r in $(seq "$first_n"); do
    perftest ib_send_lat -s 64 -n 200 -U >/dev/null || return 1
    its=$(awk -F', ' '/^[0-9]+, [0-9.]+$/ { print $2 * 2 }' /tmp/perf-client.log)
    [ "$(echo "$its" | wc -l)" -ge 2 ] || return 1
    firsts+=("$(echo "$its" | head -n 1)") meds+=("$(echo "$its" | median)")
  done
  echo "$(printf '%s\n' "${firsts[@]}" | median) $(printf '%s\n' "${meds[@]}" | median)"
}
# The median of the numbers on stdin, one a line.
median() { sort -g | awk '{ a[NR] = $1 } END { print NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

# A server and a client of PROGRAM (rbr_bench or rbr_rma_bench) on a fresh port: TEST at SIZE,
# COUNT operations (32 in flight when streaming), EXTRA options given to both sides; prints the
# client's RESULT line.
pair() { # PROGRAM TEST SIZE COUNT [EXTRA...]
  local prog=$1 test=$2 size=$3 count=$4 extra=("${@:5}")
  local slog=/tmp/$prog-server.log clog=/tmp/$prog-client.log
  next_port
  local addr="rdma://$ip:$port"
  : >"$slog" # (emptied first: see rbr)
  timeout 300 "$build/$prog" -r server -a "$addr" "${extra[@]}" >"$slog" 2>&1 &
  local s=$!
  local i
  # Up to 60 s: under emulation on a loaded host a server's first device open can take long.
  for i in $(seq 600); do grep -q '^listening on' "$slog" && break; kill -0 "$s" 2>/dev/null || break; sleep 0.1; done
  env "${client_env[@]}" timeout 300 "$build/$prog" -r client -a "$addr" -t "$test" -s "$size" \
    -n "$count" \
    -b "$((count * size))" -w 32 "${extra[@]}" >"$clog" 2>&1
  local c=$?
  wait "$s"; local r=$?
  if [ "$c" -ne 0 ] || [ "$r" -ne 0 ]; then
    echo "$prog $test failed: client $c, server $r" >&2
    cat "$clog" "$slog" >&2
    return 1
  fi
  grep -E "^(RESULT $test |SPLIT )" "$clog"
}

# rbr_bench: TEST (lat, bw), measured as perftest measures: both sides busy-poll rbr_cq_poll
# (caller progress, the default), a ping-pong for latency, one-way streaming for bandwidth; with
# -W both wait with rbr_cq_poll_wait, with -Y with rbr_cq_poll then rbr_cq_wait.
bench() { pair rbr_bench "$@"; } # TEST SIZE COUNT [-W|-Y]

# rbr_rma_bench: TEST (wlat, rlat, wbw, rbw); both sides busy-poll, as perftest's do (its
# server, with -R, polls for the closing handshake while the client reads or streams writes).
rma() { pair rbr_rma_bench "$@"; } # TEST SIZE COUNT

record() { echo "RESULT $*" | tee -a "$results"; }

# The read round trip split at the client's write() to the device, where soft-RoCE runs the
# whole exchange (benchmarks/write_split.c): rkern = time inside it (the kernel's share),
# ruser = from one write's return to the next (the program's own: the provider's poll and
# post, and for ours the library's). Separate runs from the headline figures, which run
# without the module. ASan (the CI build) would refuse a module loaded ahead of it.
split_read() { # SIZE COUNT
  local size=$1 n=$2 row out
  client_env=(LD_PRELOAD="$build/librbr_write_split.so" ASAN_OPTIONS=verify_asan_link_order=0)
  if row=$(perftest ib_read_lat -s "$size" -n "$n"); then
    record_split "$size" ib_read_lat "$(grep '^SPLIT ' /tmp/perf-client.log)"
  fi
  if out=$(rma rlat "$size" "$n"); then
    record_split "$size" rbr-rma "$(echo "$out" | grep '^SPLIT ')"
  fi
  client_env=()
}
record_split() { # SIZE TOOL SPLIT-LINE
  record "rkern$1" "$2" p50 "$(echo "$3" | sed -n 's/.* in_write_p50_us=\([0-9.]*\).*/\1/p')"
  record "ruser$1" "$2" p50 "$(echo "$3" | sed -n 's/.* outside_p50_us=\([0-9.]*\).*/\1/p')"
}

name() { case $1 in */-) echo "rbr-${1%/*}" ;; */1000000) echo "rbr-${1%/*}-busy" ;; *) echo "rbr-${1%/*}-spin${1#*/}" ;; esac; }

measures=${RBR_BENCH_MEASURES:-all}
case $measures in all|setup|event|first|scale) ;; *) echo "RBR_BENCH_MEASURES: all, setup, event, first or scale, not '$measures'" >&2; exit 2 ;; esac
# setup_pairs: connections one after another and in flight, each against cmtime with the same
# count (cmtime sets its connections up all at once).
setup_pairs() {
  local v
  if v=$(cmtime_rate "$conns"); then record conn cmtime cps "$v"; fi
  if v=$(rbr_conn_rate "$conns"); then record conn rbr-setup cps "$v"; fi
  if v=$(cmtime_rate "$inflight"); then record "inflight$inflight" cmtime cps "$v"; fi
  if v=$(rbr_conn_rate "$inflight" "$inflight"); then record "inflight$inflight" rbr-setup cps "$v"; fi
}

# event_pairs SIZE N: both sides asleep between messages: perftest on its completion channel,
# ours as an event loop on the queue's descriptor and in a wait that sleeps at once.
event_pairs() {
  local row out w f t
  if row=$(perftest ib_send_lat -e -s "$1" -n "$2"); then
    record "elat$1" ib_send_lat-e p50 "$(echo "$row" | awk '{ print $5 }')"
    record "elat$1" ib_send_lat-e p99 "$(echo "$row" | awk '{ print $8 }')"
  fi
  for w in E W0; do
    f=(-E) t=rbr-bench-fd
    [ $w = W0 ] && f=(-W -S 0) t=rbr-bench-wait0
    if out=$(bench lat "$1" "$2" "${f[@]}"); then
      record "elat$1" $t p50 "$(echo "$out" | sed -n 's/.* p50_us=\([0-9.]*\).*/\1/p')"
      record "elat$1" $t p99 "$(echo "$out" | sed -n 's/.* p99_us=\([0-9.]*\).*/\1/p')"
    fi
  done
}

# scale_pairs: rbr_scaling's round-robin run (one client sending 512 B messages round-robin over
# N connections on one queue to a server polling one queue, each N against one connection
# side by side) at N = 1, 16 and 256 (scale_n); and, from the second N on, what each connection
# added to each process's resident memory and to its pinned memory (what it registered with the
# device). Twice: the server's connections with 16 receives each (measures rrN, rrmemN), then
# taking their receives from one shared receive queue of scale_pool (rrqN, rrqmemN).
scale_pairs() {
  local out line n rate side pool m
  for pool in "" "$scale_pool"; do
    next_port
    m=rr
    [ -z "$pool" ] || m=rrq
    if ! out=$(timeout 900 "$build/rbr_scaling" -a "rdma://$ip:$port" -N "$scale_n" -n 200 -b 1 \
      -r 20000 -w 32 -m 512 -p caller -c 0,1 -T 60 ${pool:+-Q "$pool"} 2>&1); then
      echo "rbr_scaling ${pool:+-Q $pool }failed:" >&2; echo "$out" >&2
      return 1
    fi
    while read -r line; do
      set -- $line
      n=$3
      case $2 in
        scaling-rate)
          rate=$(echo "$line" | sed -n 's/.* msgs_per_s=\([0-9.]*\).*/\1/p')
          side=$(echo "$line" | sed -n 's/.* side_ratio=\([0-9.]*\).*/\1/p')
          record "$m$n" rbr-one-conn rate "$(awk -v r="$rate" -v s="$side" 'BEGIN { printf "%.0f", r / s }')"
          record "$m$n" rbr-n-conns rate "$rate"
          ;;
        scaling-mem)
          echo "$line" | grep -q per_conn || continue
          record "${m}mem$n" client-resident kib "$(echo "$line" | sed -n 's/.* client_kib_per_conn=\([0-9.-]*\).*/\1/p')"
          record "${m}mem$n" server-resident kib "$(echo "$line" | sed -n 's/.* server_kib_per_conn=\([0-9.-]*\).*/\1/p')"
          record "${m}mem$n" client-registered kib "$(echo "$line" | sed -n 's/.* client_pin_kib_per_conn=\([0-9.-]*\).*/\1/p')"
          record "${m}mem$n" server-registered kib "$(echo "$line" | sed -n 's/.* server_pin_kib_per_conn=\([0-9.-]*\).*/\1/p')"
          ;;
      esac
    done < <(echo "$out" | grep -E '^RESULT scaling-(rate|mem) ')
  done
}

# first_pairs: rbr_first both ways and the stock tool's first round trips (above); the late
# message against this round's one-way ib_send_lat at the smallest size (measured here when
# only these run), the first round trips against the busy run's steady round trip.
first_pairs() {
  local sl out f l mode steady row
  if [ "$measures" = first ]; then
    row=$(perftest ib_send_lat -s "${lat_sizes%% *}" -n "$(lat_n "${lat_sizes%% *}")") &&
      sl=$(echo "$row" | awk '{ print $5 }')
  else
    sl=$(awk -v m="lat${lat_sizes%% *}" '$2 == m && $3 == "ib_send_lat" && $4 == "p50" { v = $5 } END { print v }' "$results")
  fi
  [ -n "$sl" ] && record late64 ib_send_lat p50 "$sl"
  for mode in busy wait; do
    if out=$(first_run $mode); then
      f=$(echo "$out" | grep '^RESULT first') l=$(echo "$out" | grep '^RESULT late')
      if [ $mode = busy ]; then
        steady=$(echo "$f" | sed -n 's/.* rtt_p50_us=\([0-9.]*\).*/\1/p')
        record first64 rbr-steady p50 "$steady"
        record firstone64 rbr-steady p50 "$steady"
      fi
      record first64 "rbr-first-$mode" p50 "$(echo "$f" | sed -n 's/.* worst_p50_us=\([0-9.]*\).*/\1/p')"
      record firstone64 "rbr-first-$mode" p50 "$(echo "$f" | sed -n 's/.* first_p50_us=\([0-9.]*\).*/\1/p')"
      record late64 "rbr-first-$mode" p50 "$(echo "$l" | sed -n 's/.* p50_us=\([0-9.]*\).*/\1/p')"
    fi
  done
  # The same for the stock tool: how much slower than its steady round trip its first one is.
  if out=$(stock_first); then
    record firststock64 ib_send_lat-steady p50 "${out#* }"
    record firststock64 ib_send_lat-first p50 "${out% *}"
  fi
}

echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource), $(nproc) CPUs"
for round in $(seq "$rounds"); do
  echo "== round $round"
  if [ "$measures" = setup ]; then setup_pairs; continue; fi
  if [ "$measures" = first ]; then first_pairs; continue; fi
  if [ "$measures" = scale ]; then scale_pairs; continue; fi
  if [ "$measures" = event ]; then
    for size in $lat_sizes; do event_pairs "$size" "$(lat_n "$size")"; done
    continue
  fi
  for size in $lat_sizes; do
    n=$(lat_n "$size")
    # ib_send_lat columns: bytes iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%.
    if row=$(perftest ib_send_lat -s "$size" -n "$n"); then
      record "lat$size" ib_send_lat p50 "$(echo "$row" | awk '{ print $5 }')"
      record "lat$size" ib_send_lat p99 "$(echo "$row" | awk '{ print $8 }')"
    fi
    for v in $variants; do
      if out=$(rbr "${v%/*}" "${v#*/}" "$size" "$n"); then
        record "lat$size" "$(name "$v")" p50 "$(echo "$out" | sed -n 's/.*latency median \([0-9.]*\) us.*/\1/p')"
        record "lat$size" "$(name "$v")" p99 "$(echo "$out" | sed -n 's/.*latency median .*, p99 \([0-9.]*\) us.*/\1/p')"
      fi
    done
    for w in busy W Y; do
      f=() t=rbr-bench
      case $w in W) f=(-W) t=rbr-bench-wait ;; Y) f=(-Y) t=rbr-bench-wait2 ;; esac
      if out=$(bench lat "$size" "$n" "${f[@]}"); then
        record "lat$size" $t p50 "$(echo "$out" | sed -n 's/.* p50_us=\([0-9.]*\).*/\1/p')"
        record "lat$size" $t p99 "$(echo "$out" | sed -n 's/.* p99_us=\([0-9.]*\).*/\1/p')"
      fi
    done
    event_pairs "$size" "$n"
  done
  for size in $bw_sizes; do
    n=$(bw_n "$size")
    # ib_send_bw columns: bytes iterations BW_peak BW_average MsgRate; BW in MiB/s.
    if row=$(perftest ib_send_bw -s "$size" -n "$n"); then
      record "bw$size" ib_send_bw mbs "$(echo "$row" | awk '{ printf "%.1f", $4 * 1.048576 }')"
    fi
    for v in $variants; do
      if out=$(rbr "${v%/*}" "${v#*/}" "$size" "$n"); then
        record "bw$size" "$(name "$v")" mbs "$(echo "$out" | sed -n 's/^streaming: .*: \([0-9.]*\) MB\/s.*/\1/p')"
      fi
    done
    for w in busy W Y; do
      f=() t=rbr-bench
      case $w in W) f=(-W) t=rbr-bench-wait ;; Y) f=(-Y) t=rbr-bench-wait2 ;; esac
      if out=$(bench bw "$size" "$n" "${f[@]}"); then
        record "bw$size" $t mbs "$(echo "$out" | sed -n 's/.* mb_s=\([0-9.]*\).*/\1/p')"
      fi
    done
  done
  for size in $lat_sizes; do
    n=$(lat_n "$size")
    for op in write read; do
      m=${op:0:1}lat$size
      if row=$(perftest "ib_${op}_lat" -s "$size" -n "$n"); then
        record "$m" "ib_${op}_lat" p50 "$(echo "$row" | awk '{ print $5 }')"
        record "$m" "ib_${op}_lat" p99 "$(echo "$row" | awk '{ print $8 }')"
      fi
      if out=$(rma "${op:0:1}lat" "$size" "$n"); then
        record "$m" rbr-rma p50 "$(echo "$out" | sed -n 's/.* p50_us=\([0-9.]*\).*/\1/p')"
        record "$m" rbr-rma p99 "$(echo "$out" | sed -n 's/.* p99_us=\([0-9.]*\).*/\1/p')"
      fi
    done
  done
  split_read "${lat_sizes%% *}" "$(lat_n "${lat_sizes%% *}")"
  for size in $bw_sizes; do
    n=$(bw_n "$size")
    for op in write read; do
      m=${op:0:1}bw$size
      if row=$(perftest "ib_${op}_bw" -s "$size" -n "$n"); then
        record "$m" "ib_${op}_bw" mbs "$(echo "$row" | awk '{ printf "%.1f", $4 * 1.048576 }')"
      fi
      if out=$(rma "${op:0:1}bw" "$size" "$n"); then
        record "$m" rbr-rma mbs "$(echo "$out" | sed -n 's/.* mb_s=\([0-9.]*\).*/\1/p')"
      fi
    done
  done
  setup_pairs
  first_pairs
  scale_pairs
done

# The table: per measure, the stock tool first, then ours; medians over the rounds, the spread
# of the headline figure (min-max over rounds), and ratios to the stock tool's medians.
# Latency: one-way us, lower is better (ratio > 1 is slower). Throughput: MB/s (10^6 bytes/s),
# setup: connections/s, higher is better (ratio < 1 is slower).
echo "== summary: $rounds round(s); medians (min-max over rounds); ratio = ours / stock tool"
awk '
  $1 == "RESULT" && $5 != "" {
    k = $2 SUBSEP $3 SUBSEP $4; n[k]++; v[k, n[k]] = $5
    if (!(($2, $3) in seen)) { seen[$2, $3] = 1; tools[$2] = tools[$2] " " $3 }
    if (!($2 in mseen)) { mseen[$2] = 1; order[++nm] = $2 }
  }
  function med(k,   i, j, t, c, a) {
    c = n[k]; if (!c) return ""
    for (i = 1; i <= c; i++) a[i] = v[k, i] + 0
    for (i = 2; i <= c; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    lo[k] = a[1]; hi[k] = a[c]
    return c % 2 ? a[(c + 1) / 2] : (a[c / 2] + a[c / 2 + 1]) / 2
  }
  function label(m) {
    if (m ~ /^rkern/) return "read " substr(m, 6) " B: inside write()"
    if (m ~ /^ruser/) return "read " substr(m, 6) " B: outside write()"
    if (m ~ /^[wr]lat/) { s = substr(m, 5) + 0; return (m ~ /^w/ ? "write" : "read") " latency " (s >= 1024 ? s / 1024 " KiB" : s " B") }
    if (m ~ /^[wr]bw/) { s = substr(m, 4) + 0; return (m ~ /^w/ ? "write" : "read") " bandwidth " (s >= 1048576 ? s / 1048576 " MiB" : s / 1024 " KiB") }
    if (m ~ /^late/) return "message waiting for its receive, " substr(m, 5) " B: post to completion"
    if (m ~ /^lat/) { s = substr(m, 4) + 0; return "latency " (s >= 1024 ? s / 1024 " KiB" : s " B") }
    if (m ~ /^elat/) { s = substr(m, 5) + 0; return "latency asleep between messages " (s >= 1024 ? s / 1024 " KiB" : s " B") }
    if (m ~ /^bw/) { s = substr(m, 3) + 0; return "bandwidth " (s >= 1048576 ? s / 1048576 " MiB" : s / 1024 " KiB") }
    if (m ~ /^firststock/) return "the stock tool'"'"'s first round trip after the connect, " substr(m, 11) " B"
    if (m ~ /^firstone/) return "the first round trip after the connect, " substr(m, 9) " B"
    if (m ~ /^first/) return "slowest of the first round trips, " substr(m, 6) " B"
    if (m ~ /^inflight/) return "connection setup, " substr(m, 9) " in flight"
    if (m ~ /^rrqmem/) return "memory added per connection, " substr(m, 7) " connections, one shared receive queue"
    if (m ~ /^rrmem/) return "memory added per connection, " substr(m, 6) " connections"
    if (m ~ /^rrq/) return "round-robin message rate, 512 B, " substr(m, 4) " connections on one shared receive queue against one"
    if (m ~ /^rr/) return "round-robin message rate, 512 B, " substr(m, 3) " connections against one"
    return "connection setup"
  }
  function ratio(a, b) { return (b > 0 && a != "") ? sprintf("%.2fx", a / b) : "-" }
  # The median over rounds of each round'"'"'s ratio (the two ran minutes apart at most, under
  # the same load), and the ratios round by round.
  function paired(k, kr,   i, j, t, c, a, s) {
    c = n[k]; if (!c || n[kr] != c) return "-"
    for (i = 1; i <= c; i++) { if (v[kr, i] + 0 <= 0) return "-"; a[i] = v[k, i] / v[kr, i] }
    s = ""; for (i = 1; i <= c; i++) s = s (i > 1 ? ", " : "") sprintf("%.2f", a[i])
    for (i = 2; i <= c; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return sprintf("%.2fx (%s)", c % 2 ? a[(c + 1) / 2] : (a[c / 2] + a[c / 2 + 1]) / 2, s)
  }
  END {
    printf "| measure | tool | p50 or figure (min-max) | p99 (min-max) | ratio p50 | ratio p99 | ratio p50 by round: median (rounds) |\n"
    printf "| --- | --- | --- | --- | --- | --- | --- |\n"
    for (i = 1; i <= nm; i++) {
      m = order[i]; split(substr(tools[m], 2), ts, " ")
      field = m ~ /^([wre]?lat|rkern|ruser|late|first)/ ? "p50" : (m ~ /^[wr]?bw/ ? "mbs" : (m ~ /^rrq?mem/ ? "kib" : (m ~ /^rr/ ? "rate" : "cps")))
      unit = m ~ /^([wre]?lat|rkern|ruser|late|first)/ ? " us" : (m ~ /^[wr]?bw/ ? " MB/s" : (m ~ /^rrq?mem/ ? " KiB" : (m ~ /^rr/ ? " msg/s" : " conn/s")))
      ref = ts[1]; r50 = med(m SUBSEP ref SUBSEP field); r99 = med(m SUBSEP ref SUBSEP "p99")
      for (j = 1; (j in ts); j++) {
        t = ts[j]; k = m SUBSEP t SUBSEP field
        a = med(k); if (a == "") continue
        kb = m SUBSEP t SUBSEP "p99"; b = med(kb)
        printf "| %s | %s | %s%s (%s-%s) | %s | %s | %s | %s |\n", label(m), t, a, unit, lo[k], hi[k],
          (b == "" ? "-" : b unit " (" lo[kb] "-" hi[kb] ")"), (m ~ /^rrmem/ ? "-" : ratio(a, r50)), (b == "" ? "-" : ratio(b, r99)),
          (m ~ /^rrmem/ ? "-" : paired(k, m SUBSEP ref SUBSEP field))
      }
    }
  }' "$results" | tee /tmp/bench-table.md
if [ -n "$outdir" ]; then
  cp "$results" "$outdir/raw.txt"
  cp /tmp/bench-table.md "$outdir/table.md"
fi
# Every tool must have produced every round's figure.
nv=$(echo $variants | wc -w) nl=$(echo $lat_sizes | wc -w) nb=$(echo $bw_sizes | wc -w)
ns=$(echo "$scale_n" | tr , ' ' | wc -w); ns=$((2 * (2 * ns + 4 * (ns - 1))))
# (one-sided: write and read, each the stock tool and ours: 2 x 2 x 2 latency figures per
# size, 2 x 2 bandwidth figures per size; the read's split: 2 figures of each tool; rbr_first:
# 3 figures of the late message, 3 of the slowest first round trips and 3 of the very first,
# and the stock tool's first and steady round trips; the round-robin run, without and with the
# shared receive queue: 2 rates at each N and 4 memory figures at each N but the first;
# setup: 2 pairs; asleep between
# messages: 2 figures of each of 3 tools per size)
if [ "$measures" = setup ]; then
  want=$((rounds * 4))
elif [ "$measures" = event ]; then
  want=$((rounds * nl * 6))
elif [ "$measures" = first ]; then
  want=$((rounds * (9 + 2)))
elif [ "$measures" = scale ]; then
  want=$((rounds * ns))
else
  want=$((rounds * (nl * 2 * (4 + nv) + nb * (4 + nv) + 4 + nl * 8 + nb * 4 + 4 + 9 + 2 + ns + nl * 6)))
fi
n=$(awk 'NF == 5' "$results" | wc -l)
[ "$n" -eq "$want" ] || { echo "bench: $n of $want figures produced" >&2; exit 1; }
