#!/usr/bin/env bash
# Shared-memory benchmark, side by side: rdmabridge's shm transport (benchmarks/rbr_bench.c)
# against the stock tools (UCX's ucx_perftest, libfabric's fi_pingpong), in the same run, with
# the machine's limits.
#   ours:    rbr_bench lat (p50, p99, mean one-way), bw (MB/s), rate (messages/s)
#   ucx:     UCX_TLS=posix,self ucx_perftest tag_lat, tag_bw (bandwidth and message rate),
#            ucp_put_bw (one-sided puts, at the large sizes)
#   fi:      fi_pingpong -p shm -e rdm (mean one-way latency)
#   event:   both sides sleeping between messages, at 2 B, 64 B and 4 KiB: rbr_bench -E (an event
#            loop: rbr_cq_poll until RBR_EMPTY, then epoll_wait on rbr_cq_fd), tokio_lat (the same
#            through the tokio feature: a current-thread runtime whose queue task waits on the
#            descriptor, a send and a receive future per message; benchmarks/tokio_lat.rs),
#            rbr_bench -W -S 0 (rbr_cq_poll_wait with spin_us 0, which sleeps at once) and UCX's
#            event mode (ucx_perftest tag_lat -E sleep): p50 and mean one-way latency
#   limits:  rbr_limits (memcpy at 1 and 64 MiB on cpu1, cache-line round trip cpu0 <-> cpu1)
#   scaling: rbr_scaling (benchmarks/scaling.c) in each progress mode: the cost of an empty
#            rbr_cq_poll and the 64 B ping-pong latency with N = 1, 16, 256, 1024 connections
#            on one completion queue per side (all but one idle), each N against N = 1 of the
#            same run (target: the empty poll at 1,024 costs at most 2x the one at 1); and with
#            caller progress the round-robin message rate (rbr_scaling -r): one client sending
#            512 B messages round-robin over all N connections, polling after each send, the
#            server taking them into 16 receives per connection; each N against one connection
#            in passes side by side (target: at least 0.7x), and after it each process's resident
#            memory and its growth per connection (target: at most 64 KiB a connection); the
#            same again with the server's connections on one shared receive queue (-Q 4096),
#            and UCX's side: one client sending round-robin over N endpoints to one server
#            worker (benchmarks/ucx_scaling.c; ucx_perftest has no such mode)
#   setup:   rbr_setup (benchmarks/setup.c): connections one after another, each connected,
#            accepted, carrying a 64 B message each way and closed; and the same with 64
#            connections in flight from one client thread (rbr_connect_start), the server
#            accepting without blocking; connections per second (target in flight: 20,000)
#            (no stock tool measures this over shared memory: ours alone)
#   first:   rbr_first (benchmarks/first.c), both sides busy-polling and both in
#            rbr_cq_poll_wait: the slowest of the first 200 round trips of each new connection
#            (targets: 1 ms and 200 us), and a 64 B message sent while the peer has no receive,
#            which it posts 50 ms later: from that post to the receive's completion (targets:
#            10 us and 50 us) (ours alone)
# Every server runs on cpu0 and every client on cpu1 (taskset). In each round, every measurement
# of ours runs right next to the anchors' measurements of the same kind and size (the order
# rotating), so drift and other load hit them alike; the ratios pair the runs of each round and
# take the median over rounds. Absolute numbers depend on what else the machine does (other
# builds, VMs): read the ratios.
#
# Usage: benchmarks/shm.sh [--quick] [--event] [--out DIR] [ROUNDS]
#   --quick   two sizes per test, tiny counts, scaling at N = 1 and 16 only (for CI: proves the
#             pipeline, well under a minute once built); 1 round unless ROUNDS says otherwise
#   --event   the latency with both sides sleeping (event) alone
#   --out DIR results directory (default benchmarks/results, ignored by git)
#   ROUNDS    rounds (default 3)
# Writes into DIR: table.txt (printed at the end), results.csv (medians and ratios),
# rounds.csv (every measurement), raw.txt, shm.png (latency and bandwidth against size),
# logs/ (every tool's output).
# Needs root or sudo for apt (installs what is missing), cargo, and 2 or more cpus.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

quick=0 event_only=0 rounds="" out="$root/benchmarks/results"
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --event) event_only=1 ;;
    --out) out=${2:?--out needs a directory}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *[!0-9]*|"") echo "shm.sh: bad argument '$1'" >&2; exit 2 ;;
    *) rounds=$1 ;;
  esac
  shift
done
[ -n "$rounds" ] || rounds=$([ "$quick" = 1 ] && echo 1 || echo 3)
[ "$rounds" -ge 1 ] || { echo "shm.sh: ROUNDS must be 1 or more" >&2; exit 2; }
[ "$(nproc)" -ge 2 ] || { echo "shm.sh: needs 2 cpus (server on cpu0, client on cpu1)" >&2; exit 1; }
started=$(date +%s)

# ------------------------------------------------------------------ what it needs
bash scripts/setup.sh
packages=(ucx-utils libucx-dev libfabric-bin gnuplot-nox python3 iproute2 util-linux coreutils)
bash scripts/install-packages.sh shm.sh "${packages[@]}"

build=$root/build-shm-bench
echo "shm.sh: building (cargo release, cmake Release in $build)"
timeout 1800 cargo build --release --quiet
timeout 1800 cargo build --release --quiet --features tokio --example tokio_lat
tokio_lat=${CARGO_TARGET_DIR:-$root/target}/release/examples/tokio_lat
timeout 300 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
timeout 900 cmake --build "$build" -j2 --target rbr_bench rbr_rma_bench rbr_limits rbr_scaling \
  rbr_setup rbr_first ucx_scaling >/dev/null
ucx_scaling=$build/ucx_scaling
bench=$build/rbr_bench rma=$build/rbr_rma_bench limits=$build/rbr_limits scaling=$build/rbr_scaling
setup_bin=$build/rbr_setup first_bin=$build/rbr_first

# ------------------------------------------------------------------ plan
if [ "$quick" = 1 ]; then
  lat_sizes=(2 4096) bw_sizes=(4096 65536) rate_sizes=(2) put_sizes=(65536) rma_sizes=(8 65536)
  event_sizes=(64)
  lat_n=300 ucx_lat_warm=30 bw_bytes=$((8 << 20)) max_msgs=20000 fi_n=300
  limits_args=(-n 20000 -r 1) tmo=30
  scaling_args=(-N 1,16 -n 300 -b 3) scaling_tmo=60 setup_n=50 first_n=10
  scaling_rate_args=(-N 1,16 -n 100 -b 1 -r 20000 -w 64) scaling_pool=256
  ucx_scaling_args=(-N 1,16 -n 20000 -p 1)
  setup_inflight=16 setup_inflight_n=200
else
  lat_sizes=(2 64 1024 4096 65536 1048576)
  event_sizes=(2 64 4096)
  bw_sizes=(64 1024 4096 16384 65536 262144 1048576)
  rate_sizes=(2 64) put_sizes=(65536 1048576) rma_sizes=(8 4096 65536 1048576)
  lat_n=10000 ucx_lat_warm=1000 bw_bytes=$((1 << 30)) max_msgs=1000000 fi_n=10000
  limits_args=(-n 1000000 -r 5) tmo=180
  # With progress threads a round trip takes ~0.1-5 ms at 1,024 connections: minutes.
  scaling_args=(-N 1,16,256,1024 -n 10000 -b 11) scaling_tmo=900 setup_n=2000 first_n=50
  scaling_rate_args=(-N 1,16,256,1024 -n 1000 -b 1 -r 1000000) scaling_pool=4096
  ucx_scaling_args=(-N 1,16,256,1024 -n 200000 -p 5)
  setup_inflight=64 setup_inflight_n=20000
fi
join() { local IFS=,; echo "$*"; }
# Messages per streaming run, as rbr_bench counts them: BYTES / SIZE, at most MAX, at least 100.
stream_count() { local c=$((bw_bytes / $1)); [ $c -le $max_msgs ] || c=$max_msgs; [ $c -ge 100 ] || c=100; echo $c; }

mkdir -p "$out/logs"
raw=$out/raw.txt
: >"$raw"
rm -f "$out"/logs/* "$out/shm.png"
shm_name="rbr-bench-$$"
# TCP ports for the anchors' control connections on 127.0.0.1: our own block, skipping any that
# is taken.
port=$((30000 + ($$ % 2000) * 10))

# ------------------------------------------------------------------ process control
# Servers and the client run in the background and are waited for, so that a signal is acted on
# at once (bash runs a trap only after a foreground command ends).
servers=() cpid="" ucx_extra=()
cleanup() {
  local p
  for p in $cpid "${servers[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in $cpid "${servers[@]}"; do wait "$p" 2>/dev/null || true; done
  servers=() cpid=""
}
trap cleanup EXIT
trap 'echo "shm.sh: interrupted" >&2; exit 130' INT TERM HUP

next_port() {
  port=$((port + 1))
  while ss -Htan "( sport = :$port or dport = :$port )" 2>/dev/null | grep -q .; do
    port=$((port + 1))
  done
}
# wait_listen PORT PID: until something listens on PORT, or PID is gone, or 10 s passed.
wait_listen() {
  local i
  for i in $(seq 100); do
    ss -Htln "sport = :$1" 2>/dev/null | grep -q . && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
# start_server LOG CMD...: on cpu0, in the background; sets $spid.
start_server() {
  local log=$1; shift
  timeout "$tmo" taskset -c 0 "$@" >"$log" 2>&1 &
  spid=$!
  servers+=("$spid")
}
# end_server: waits for the last server (bounded by its timeout); returns its status.
end_server() {
  local rc=0
  wait "$spid" || rc=$?
  servers=("${servers[@]/$spid}")
  return $rc
}
client() {
  local rc=0
  timeout "$tmo" taskset -c 1 "$@" &
  cpid=$!
  wait "$cpid" || rc=$?
  cpid=""
  return $rc
}
fail() { echo "shm.sh: round $round: $*" >&2; }

# ------------------------------------------------------------------ the runs
# serve_and_run LOG WHAT PROGRAM ADDR SERVER_ARGS... -- CLIENT_ARGS...: PROGRAM's server on
# cpu0 (once it says it listens) and its client on cpu1, at ADDR; the client's RESULT lines go
# into raw.txt as ours (their test named $result_test when that is set), a failure is reported
# as WHAT's.
result_test=""
serve_and_run() {
  local log=$1 what=$2 prog=$3 addr=$4 sargs=() i
  shift 4
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do sargs+=("$1"); shift; done
  [ $# -eq 0 ] || shift
  start_server "$log.server" "$prog" -r server -a "$addr" "${sargs[@]}"
  for i in $(seq 100); do
    grep -q '^listening' "$log.server" 2>/dev/null && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.05
  done
  if client "$prog" -r client -a "$addr" "$@" >"$log" 2>&1 && end_server; then
    awk -v r="$round" -v t="$result_test" '$1 == "RESULT" { $1 = r " ours"; if (t != "") $2 = t
        print }' "$log" >>"$raw"
  else
    kill "$spid" 2>/dev/null || true
    end_server || true
    fail "$what failed (see $log)"
  fi
}

# ours TESTS SIZES...: one server, one client, every test at every size over one connection.
run_ours() {
  local tests=$1; shift
  local sizes
  sizes=$(join "$@")
  serve_and_run "$out/logs/r$round-ours-${tests//,/-}-${sizes//,/-}.log" "rbr_bench $tests" \
    "$bench" "shm://$shm_name" -T 30 -- -t "$tests" -s "$sizes" -n "$lat_n" -m "$max_msgs" \
    -b "$bw_bytes" -T 30
}

# run_event MODE SIZE: the latency test with both sides sleeping between messages, recorded as
# lat_MODE: fd (rbr_bench -E, an event loop on rbr_cq_fd), tokio (tokio_lat, the same through
# the tokio feature) or wait0 (rbr_bench -W -S 0, rbr_cq_poll_wait that sleeps at once).
run_event() {
  local mode=$1 size=$2 prog=$bench w=() t=(-t lat)
  case $mode in fd) w=(-E) ;; wait0) w=(-W -S 0) ;; tokio) prog=$tokio_lat t=() ;; esac
  result_test=lat_$mode serve_and_run "$out/logs/r$round-ours-lat-$mode-$size.log" \
    "${prog##*/} lat $mode" "$prog" "shm://$shm_name" -T 30 "${w[@]}" -- "${t[@]}" -s "$size" \
    -n "$lat_n" -T 30 "${w[@]}"
}

# run_rma TESTS SIZE: rbr_rma_bench (one-sided writes), our side of ucp_put_lat / ucp_put_bw.
run_rma() {
  local tests=$1 size=$2 c
  c=$(stream_count "$size")
  serve_and_run "$out/logs/r$round-rma-${1//,/-}-$2.log" "rbr_rma_bench $tests $size" "$rma" \
    "shm://$shm_name-rma" -T 30 -- -t "$tests" -s "$size" -n "$lat_n" -b "$((c * size))" -T 30
}

# ucx TEST SIZE N WARMUP: one server and client; records p50/mean latency or bandwidth and rate.
# ucx_perftest prints MB/s with MB = 2^20 bytes: converted here to 10^6 bytes.
# run_ucx TEST SIZE N WARMUP [NAME]: NAME (default TEST) is what raw.txt calls the result;
# ucx_extra (an array, when set) holds more options for the client (which the server follows).
run_ucx() {
  local test=$1 size=$2 n=$3 warm=$4 name=${5:-$1} log=$out/logs/r$round-ucx-${5:-$1}-$2.log try line
  for try in 1 2; do
    next_port
    start_server "$log.server" env UCX_TLS=posix,self ucx_perftest -p "$port" -c 0
    if wait_listen "$port" "$spid" &&
        client env UCX_TLS=posix,self ucx_perftest 127.0.0.1 -p "$port" -c 1 -t "$test" \
          -s "$size" -n "$n" -w "$warm" "${ucx_extra[@]}" -f -v >"$log" 2>&1 && end_server; then
      line=$(awk -F, '/^iterations,/ { for (i = 1; i <= NF; i++) h[$i] = i; getline;
          printf "p50_us=%s avg_us=%s mb_s=%.1f msgs_s=%s\n", $h["50.0_percentile_lat"],
            $h["overall_lat"], $h["overall_bw"] * 1.048576, $h["overall_mr"]; exit }' "$log")
      if [ -n "$line" ]; then
        case $test in
          tag_lat|ucp_put_lat) line=${line% mb_s=*} ;;
          *) line=${line#* avg_us=* } ;;
        esac
        echo "$round ucx $name $size $line" >>"$raw"
        return 0
      fi
    else
      kill "$spid" 2>/dev/null || true
      end_server || true
    fi
    fail "ucx_perftest $test $size try $try failed: $(tail -n 2 "$log" | tr '\n' ' ')"
  done
}

# run_ucx_sleep SIZE: tag_lat in UCX's event mode (-E sleep), recorded as tag_lat_sleep.
run_ucx_sleep() {
  local ucx_extra=(-E sleep)
  run_ucx tag_lat "$1" "$lat_n" "$ucx_lat_warm" tag_lat_sleep
}

# fi_pingpong SIZE: one server and client; its usec/xfer is the mean one-way latency.
run_fi() {
  local size=$1 log=$out/logs/r$round-fi-$1.log try us
  for try in 1 2; do
    next_port
    start_server "$log.server" fi_pingpong -p shm -e rdm -S "$size" -I "$fi_n" -B "$port"
    if wait_listen "$port" "$spid" &&
        client fi_pingpong -p shm -e rdm -S "$size" -I "$fi_n" -P "$port" 127.0.0.1 \
          >"$log" 2>&1 && end_server; then
      # The row under the header; its size column reads 4k, 1m, ...
      us=$(awk '$1 == "bytes" && $7 == "usec/xfer" { getline; print $7; exit }' "$log")
      if [ -n "$us" ]; then
        echo "$round fi pingpong $size avg_us=$us" >>"$raw"
        return 0
      fi
    else
      kill "$spid" 2>/dev/null || true
      end_server || true
    fi
    fail "fi_pingpong $size try $try failed: $(tail -n 2 "$log" | tr '\n' ' ')"
  done
}

# run_setup in_turn|in_flight: rbr_setup's server on cpu0, its client on cpu1, opening its
# connections one after another (test "setup") or setup_inflight at once ("setup_inflight").
run_setup() {
  local n=$setup_n c=1
  [ "$1" = in_turn ] || { n=$setup_inflight_n c=$setup_inflight result_test=setup_inflight; }
  serve_and_run "$out/logs/r$round-setup-$1.log" "rbr_setup -c $c" "$setup_bin" \
    "shm://$shm_name-setup" -T 30 -- -n "$n" -c "$c" -T 30
  result_test=""
}

# run_first busy|wait: rbr_first's server on cpu0, its client on cpu1, both busy-polling or both
# in rbr_cq_poll_wait; its lines go into raw.txt as first_MODE and late_MODE.
run_first() {
  local mode=$1 log=$out/logs/r$round-first-$1.log w=()
  [ "$mode" = busy ] || w=(-W)
  start_server "$log.server" "$first_bin" -r server -a "shm://$shm_name-first" -T 30 "${w[@]}"
  for i in $(seq 100); do
    grep -q '^listening' "$log.server" 2>/dev/null && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.05
  done
  if client "$first_bin" -r client -a "shm://$shm_name-first" -n "$first_n" -T 30 "${w[@]}" \
      >"$log" 2>&1 && end_server; then
    awk -v r="$round" -v m="$mode" '$1 == "RESULT" { $1 = r " ours"; $2 = $2 "_" m; print }' \
      "$log" >>"$raw"
  else
    kill "$spid" 2>/dev/null || true
    end_server || true
    fail "rbr_first ($mode) failed (see $log)"
  fi
}

run_limits() {
  local log=$out/logs/r$round-limits.log
  if client "$limits" -c 0,1 "${limits_args[@]}" >"$log" 2>&1; then
    awk -v r="$round" '$1 == "RESULT" { $1 = r; print }' "$log" >>"$raw"
  else
    fail "rbr_limits failed (see $log)"
  fi
}

# run_scaling MODE: rbr_scaling forks its own server (cpu0) and client (cpu1); one line per N.
run_scaling() {
  local mode=$1 log=$out/logs/r$round-scaling-$1.log rc=0
  timeout "$scaling_tmo" "$scaling" -p "$mode" -c 0,1 -a "shm://$shm_name-scaling" \
    "${scaling_args[@]}" >"$log" 2>&1 &
  cpid=$!
  wait "$cpid" || rc=$?
  cpid=""
  # Whatever N it reached is kept, even if a later one failed.
  awk -v r="$round" -v t="scaling_$mode" '$1 == "RESULT" && $2 == "scaling" {
      $1 = r " ours"; $2 = t; print }' "$log" >>"$raw"
  [ "$rc" -eq 0 ] || fail "rbr_scaling -p $mode failed (status $rc, see $log)"
}

# run_scaling_rate [POOL]: rbr_scaling -r, caller progress: the round-robin message rate per N;
# with POOL, the server's connections take their receives from one shared receive queue of
# POOL receives (-Q) instead of 16 each of their own, recorded as scaling_rate_pool and
# scaling_mem_pool.
run_scaling_rate() {
  local pool=${1:-} suffix="" extra=() log rc=0
  if [ -n "$pool" ]; then suffix=_pool extra=(-Q "$pool"); fi
  log=$out/logs/r$round-scaling-rate$suffix.log
  timeout "$scaling_tmo" "$scaling" -p caller -c 0,1 -a "shm://$shm_name-scaling-rate" \
    "${scaling_rate_args[@]}" "${extra[@]}" >"$log" 2>&1 &
  cpid=$!
  wait "$cpid" || rc=$?
  cpid=""
  awk -v r="$round" -v s="$suffix" '$1 == "RESULT" && ($2 == "scaling-rate" || $2 == "scaling-mem") {
      $1 = r " ours"; sub("-", "_", $2); $2 = $2 s; print }' "$log" >>"$raw"
  [ "$rc" -eq 0 ] || fail "rbr_scaling -r ${extra[*]} failed (status $rc, see $log)"
}

# run_ucx_scaling: UCX's side of the round-robin run (benchmarks/ucx_scaling.c: N endpoints of
# one client to one server worker), recorded as ucx scaling_rate and scaling_mem.
run_ucx_scaling() {
  local log=$out/logs/r$round-ucx-scaling.log rc=0
  UCX_TLS=posix,self timeout "$scaling_tmo" "$ucx_scaling" "${ucx_scaling_args[@]}" >"$log" 2>&1 &
  cpid=$!
  wait "$cpid" || rc=$?
  cpid=""
  awk -v r="$round" '$1 == "RESULT" && ($2 == "ucx-rate" || $2 == "ucx-mem") {
      $1 = r " ucx"; $2 = ($2 == "ucx-rate" ? "scaling_rate" : "scaling_mem"); print }' \
    "$log" >>"$raw"
  [ "$rc" -eq 0 ] || fail "ucx_scaling failed (status $rc, see $log)"
}

# Each measurement of ours runs right next to the anchors' measurements of the same kind and size,
# the order rotating with the size and the round, so that a change in the machine's load between
# them is as short-lived as it can be; the report pairs them round by round.
# in_turn K CMD...: runs the commands (strings) starting with the K-th, wrapping around.
in_turn() {
  local k=$1; shift
  local cmds=("$@") i
  for i in $(seq 0 $((${#cmds[@]} - 1))); do
    eval "${cmds[$(((k + i) % ${#cmds[@]}))]}"
  done
}
# pair_all KIND SIZES...: for every size, ours and the anchors of KIND (lat, bw or rate).
pair_all() {
  local kind=$1; shift
  local s c k=$round cmds
  for s in "$@"; do
    c=$(stream_count "$s")
    case $kind in
      lat) cmds=("run_ours lat $s" "run_ucx tag_lat $s $lat_n $ucx_lat_warm" "run_fi $s") ;;
      # both sides sleeping: ours as an event loop and in rbr_cq_poll_wait, UCX's event mode
      event) cmds=("run_event fd $s" "run_event tokio $s" "run_event wait0 $s"
                   "run_ucx_sleep $s") ;;
      bw) cmds=("run_ours bw $s" "run_ucx tag_bw $s $c $((c / 10 + 1))")
          if [[ " ${put_sizes[*]} " == *" $s "* ]]; then
            cmds+=("run_ucx ucp_put_bw $s $c $((c / 10 + 1))")
          fi ;;
      # one-sided: write ping-pong against ucp_put_lat, streaming writes against ucp_put_bw
      rma) cmds=("run_rma wlat,wbw $s" "run_ucx ucp_put_lat $s $lat_n $ucx_lat_warm"
                 "run_ucx ucp_put_bw $s $c $((c / 10 + 1))") ;;
      # ucx tag_bw again, its message rate recorded as tag_mr
      rate) cmds=("run_ours rate $s" "run_ucx tag_bw $s $c $((c / 10 + 1)) tag_mr") ;;
    esac
    in_turn $k "${cmds[@]}"
    k=$((k + 1))
  done
}

# Other engineers' qemu VMs take cpu time: note every round that had one at its start or end.
vm_running() { pgrep -f qemu-system >/dev/null 2>&1; }
vm_rounds=0
echo "shm.sh: $rounds round(s)$([ "$quick" = 1 ] && echo ", quick"); results in $out"
for round in $(seq "$rounds"); do
  vm=0
  if vm_running; then vm=1; echo "shm.sh: round $round/$rounds: a qemu VM is running"; fi
  echo "shm.sh: round $round/$rounds: latency with both sides sleeping between messages"
  pair_all event "${event_sizes[@]}"
  if [ "$event_only" = 0 ]; then
    echo "shm.sh: round $round/$rounds: latency"
    pair_all lat "${lat_sizes[@]}"
    echo "shm.sh: round $round/$rounds: bandwidth"
    pair_all bw "${bw_sizes[@]}"
    echo "shm.sh: round $round/$rounds: message rate"
    pair_all rate "${rate_sizes[@]}"
    echo "shm.sh: round $round/$rounds: one-sided writes"
    pair_all rma "${rma_sizes[@]}"
    echo "shm.sh: round $round/$rounds: limits"
    run_limits
    echo "shm.sh: round $round/$rounds: scaling (1 to ${scaling_args[1]##*,} connections)"
    in_turn $round "run_scaling caller" "run_scaling thread"
    echo "shm.sh: round $round/$rounds: round-robin message rate over 1 to ${scaling_rate_args[1]##*,} connections"
    in_turn $round "run_scaling_rate" "run_scaling_rate $scaling_pool" run_ucx_scaling
    echo "shm.sh: round $round/$rounds: connection setup"
    in_turn $round "run_setup in_turn" "run_setup in_flight"
    echo "shm.sh: round $round/$rounds: first round trips and a message that waits for its receive"
    in_turn $round "run_first busy" "run_first wait"
  fi
  if vm_running; then vm=1; echo "shm.sh: round $round/$rounds: a qemu VM is running"; fi
  vm_rounds=$((vm_rounds + vm))
done
if [ "$vm_rounds" -eq 0 ]; then
  vm_note="no qemu VM running at the start or end of any round"
else
  vm_note="a qemu VM running in $vm_rounds of $rounds round(s)"
fi

# ------------------------------------------------------------------ report
title="rdmabridge shm vs UCX / libfabric, $(date -u +%Y-%m-%dT%H:%MZ), $vm_note"
timeout 60 /usr/bin/python3 benchmarks/shm_report.py "$out" "$title"
timeout 60 gnuplot "$out/plot.gp" && echo "plot: $out/shm.png"
echo "shm.sh: done in $(($(date +%s) - started)) s"
