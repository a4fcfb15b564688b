#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (scripts/vm-test.sh boots it): every verbs test, in one boot.
#   1. the Rust suite over verbs (tests/verbs.rs, run with --ignored), in both progress modes
#      (with the fault tests of tests/common/faults.rs: a server process killed and restarted)
#   2. the C bad-input matrix over verbs (tests/c/bad_matrix.c), and the C examples talking to each other over verbs, every message verified (and the
#      one-sided example: RDMA writes signaled by writes with immediate)
#   3. the C examples against the stock librdmacm peers: our server serving rdma_client, our
#      client talking to rdma_server, and rbr_rping_peer in either role of rping against the
#      stock rping (one-sided reads and writes of each other's buffers, every ping verified)
#      and the library accepting the stock ucmatose client, which asks for no RNR retries: a send
#      that finds no receive fails at once (docs/transports.md, "Verbs")
#   4. a non-root client under `ulimit -l 64`: its first post of a 1 MiB region fails, naming
#      RLIMIT_MEMLOCK, its value and the size
#   5. the verbs benchmark at tiny counts (benchmarks/verbs-progress-guest.sh --quick)
#   6. many connections (1,024) between two contexts on one completion queue per side: the
#      contexts' driver threads only, one device CQ, a verified message each way on every one,
#      every record flushed and the disconnect last (tests/scale.rs), in both progress modes;
#      and the empty-poll cost with 1 and with 1,024 idle connections (benchmarks/scaling.c)
#      300 connections at the default depths on one queue: more than one device CQ holds
#   7. rdmabridge-info's view of the VM (scripts/vm-guest-info-check.sh)
#   8. the local link taken down under idle connections
# Usage (in the guest): scripts/vm-guest-suite.sh VERBS_TEST_BINARY C_BUILD_DIR SCALE_TEST_BINARY
# Prints one line per step and a closing "N passed, N failed" naming the failed steps (the
# last line is what a log's tail shows); exits non-zero if any failed.
set -u
verbs_bin=$1 build=$2 scale_bin=$3
ip=${RBR_TEST_ADDR:?RBR_TEST_ADDR is unset: run me through scripts/vm-test.sh}
cd "$(dirname "$0")/.."
passed=0 failed=0 failed_names=""
step() { # NAME COMMAND...
  local name=$1; shift
  echo "=== $name"
  if "$@"; then echo "=== $name: ok"; passed=$((passed + 1)); else
    echo "=== $name: FAILED ($?)"; failed=$((failed + 1)); failed_names+="${failed_names:+; }$name"
  fi
}

stock_client() { # our server, stock rdma_client; RBR_LOG names the client's address
  local port=7471
  local log=/tmp/stock_client.log
  RBR_LOG=info timeout 60 "$build/rbr_server" -P -a "rdma://$ip:$port" -n 1 -s 16 >"$log" 2>&1 & local s=$!
  for _ in $(seq 100); do grep -q '^listening on' "$log" && break; sleep 0.2; done
  timeout 30 rdma_client -s "$ip" -p "$port"; local c=$?
  wait "$s"; local r=$?
  cat "$log"
  echo "rdma_client exit $c, rbr_server exit $r"
  local named=0
  grep -Eq "info: connection [0-9]+ from $ip:[0-9]+ accepted \(Verbs\)" "$log" &&
    grep -Eq "connection [0-9]+ with $ip:[0-9]+ disconnected" "$log" && named=1
  [ "$named" -eq 1 ] || echo "the server's log does not name the client's address"
  [ "$c" -eq 0 ] && [ "$r" -eq 0 ] && [ "$named" -eq 1 ]
}

stock_server() { # stock rdma_server, our client; RBR_LOG names the server's address
  local port=7472
  local log=/tmp/stock_server.log
  timeout 60 rdma_server -p "$port" & local s=$!
  # rdma_server says nothing when it listens: retry the connect while it starts (a fixed wait
  # is too short for an emulated VM on a loaded machine).
  local c=1
  for _ in $(seq 30); do
    sleep 1
    RBR_LOG=info timeout 30 "$build/rbr_client" -P -a "rdma://$ip:$port" -n 1 -s 16 2>"$log"; c=$?
    grep -q 'RBR_ERR_REFUSED\|RBR_ERR_REJECTED' "$log" || break
  done
  wait "$s"; local r=$?
  cat "$log"
  echo "rbr_client exit $c, rdma_server exit $r"
  local named=0
  grep -Eq "connection [0-9]+ with $ip:$port disconnected" "$log" && named=1
  [ "$named" -eq 1 ] || echo "the client's log does not name the server's address"
  [ "$c" -eq 0 ] && [ "$r" -eq 0 ] && [ "$named" -eq 1 ]
}

epoll_burst() { # the epoll server (one thread, two descriptors) and a burst of verbs clients
  RUN_PAIR_TIMEOUT=300 tests/c/run_pair.sh "$build/rbr_epoll_server" "$build/rbr_burst_client" \
    -a "rdma://$ip:7476" -s 4096 -- -n 20 -m 100 -t 240 -- -c 20 -t 270
}

epoll_pool_burst() { # the same, the clients sharing one pool of 64 receives (rbr_srq)
  RUN_PAIR_TIMEOUT=300 tests/c/run_pair.sh "$build/rbr_epoll_server" "$build/rbr_burst_client" \
    -a "rdma://$ip:7477" -s 4096 -- -n 20 -m 100 -w 8 -t 240 -- -c 20 -t 270 -Q 64
}

wait_listening() { # LOG: waits (up to 20 s) for the server's "listening on" line
  for _ in $(seq 100); do grep -q '^listening on' "$1" && return 0; sleep 0.2; done
  return 1
}

memlock_limit() { # non-root client, ulimit -l 64, 1 MiB messages: the error names the limit
  local port=7474 log=/tmp/memlock.log slog=/tmp/memlock_server.log
  timeout 60 "$build/rbr_server" -a "rdma://$ip:$port" -n 1 -s 1M >"$slog" 2>&1 & local s=$!
  wait_listening "$slog"
  setpriv --reuid=65534 --regid=65534 --clear-groups bash -c \
    'ulimit -l 64 && exec timeout 30 "$0" -a "$1" -n 1 -s 1M' \
    "$(realpath "$build/rbr_client")" "rdma://$ip:$port" >"$log" 2>&1
  local c=$?
  kill "$s" 2>/dev/null; wait "$s" 2>/dev/null
  cat "$log"
  echo "rbr_client (uid 65534, ulimit -l 64) exit $c"
  [ "$c" -ne 0 ] && grep -q 'RBR_ERR_NO_MEMORY' "$log" &&
    grep -Eq 'registration of [0-9]+ bytes failed: .*RLIMIT_MEMLOCK \(ulimit -l\) to 65536 bytes' "$log"
}

step "rust suite over verbs" "$verbs_bin" --ignored --test-threads=1 --exact \
  --skip local_link_down_fails_idle_connections_within_bound \
  --skip plain_client_without_rnr_retries_fails_a_send_that_finds_no_receive
# The tests of completions and teardown again, with progress threads instead of progress on the
# caller's thread (connection set-up does not depend on it; the tests that switch modes
# themselves ran in both above).
step "rust suite over verbs, RBR_PROGRESS=thread" env RBR_PROGRESS=thread "$verbs_bin" --ignored \
  --test-threads=1 --exact bad_posts_return_clear_errors_and_post_nothing \
  completion_fd_is_readable_while_a_poll_finds_completions \
  disconnect_flushes_and_reports_on_both_sides idle_connection_stays_up_and_reports_nothing \
  peer_killed_mid_stream_is_reported_at_once \
  receive_too_small_fails_both_sides_with_length_errors slot_is_free_once_its_completion_is_seen \
  slow_receiver_holds_sender_back_and_loses_nothing \
  bad_remote_accesses_fail_with_remote_access_and_touch_nothing \
  compare_and_swap_makes_a_working_lock
# Every function of the header against bad input, over verbs (ports 7497 to 7499).
step "C bad-input matrix over verbs" timeout 300 "$build/rbr_bad_matrix" -a "rdma://$ip:7497"
for size in 1 4096 1048576; do
  n=2000; [ "$size" -ge 1048576 ] && n=200
  step "C examples over verbs, $n x $size B" \
    tests/c/run_pair.sh "$build/rbr_server" "$build/rbr_client" -a "rdma://$ip:$((7480 + ${#size}))" -n "$n" -s "$size" -v
done
step "C examples over verbs, progress threads, 2000 x 4096 B" \
  tests/c/run_pair.sh "$build/rbr_server" "$build/rbr_client" -a "rdma://$ip:7490" -n 2000 -s 4096 -v -p thread
step "C epoll server, 20 clients x 100 x 4096 B at once over verbs" epoll_burst
step "C epoll server with one shared receive queue of 64 for 20 clients x 8 outstanding over verbs" \
  epoll_pool_burst
step "C one-sided example over verbs: 100 rounds of 8 RDMA writes of 4096 B, each signaled by a write with immediate" \
  tests/c/run_pair.sh "$build/rbr_rdma_write" "$build/rbr_rdma_write" -a "rdma://$ip:7495" \
  -n 100 -z 4096 -- -c -- -s
step "C server with the stock rdma_client" stock_client
step "C client with the stock rdma_server" stock_server
step "C rping peer with the stock rping, both roles, verified pings" \
  scripts/vm-guest-rping-check.sh "$build"
step "library server with the stock ucmatose client (no RNR retries)" "$verbs_bin" --ignored \
  --exact plain_client_without_rnr_retries_fails_a_send_that_finds_no_receive --nocapture
step "non-root C client over RLIMIT_MEMLOCK: the error names the limit" memlock_limit
# The verbs benchmark's whole pipeline (perftest, cmtime and ours, side by side) at tiny counts:
# proves it works; its figures are not checked.
step "verbs benchmark pipeline at tiny counts (figures not checked)" \
  benchmarks/verbs-progress-guest.sh "$build" 1 --quick
step "1,024 verbs connections: driver threads only, one device CQ, every record" \
  "$scale_bin" --ignored --exact verbs_connections_share_the_driver_and_one_device_cq --nocapture
step "300 verbs connections at the default depths on one queue: more than one device CQ holds" \
  "$scale_bin" --ignored --exact verbs_queue_takes_more_connections_than_one_device_cq_holds
step "rdmabridge-info: the device, its port and GIDs, the device for an address, memlock named" \
  scripts/vm-guest-info-check.sh target/release/rdmabridge-info "$ip"
step "empty poll with 1 and 1,024 idle verbs connections (figures printed)" \
  timeout 900 "$build/rbr_scaling" -a "rdma://$ip:7495" -N 1,1024 -n 200 -b 5 -T 120
# Last, since it takes the interface down for a while.
step "local link down under idle connections" "$verbs_bin" --ignored --exact \
  local_link_down_fails_idle_connections_within_bound --nocapture
echo "vm-guest-suite: $passed passed, $failed failed${failed_names:+ ($failed_names)}"
[ "$failed" -eq 0 ]
