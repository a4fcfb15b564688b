#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (scripts/vm-guest-suite.sh calls it; alone: scripts/vm-run.sh
# -- scripts/vm-guest-rping-check.sh BUILD_DIR): the C example rbr_rping_peer against
# rdma-core's stock rping (rdmacm-utils), in both roles, over RBR_TEST_ADDR, at two ping sizes.
#   our server, stock `rping -c -V -C 10 -S SIZE`: rping validates every echo (-V), prints each
#     (-v), and must print all 10; our server checks every ping it RDMA-reads
#   stock `rping -s -V`, our client: our client checks every echo against its ping and rping's
#     pattern; the stock server must print all 10 pings it read
# Each side must exit 0. Prints what both printed; exits non-zero on any failure.
# Usage: scripts/vm-guest-rping-check.sh BUILD_DIR
set -u
build=${1:?usage: $0 BUILD_DIR}
ip=${RBR_TEST_ADDR:?RBR_TEST_ADDR is unset: run me inside the VM (scripts/vm-run.sh)}
peer=$build/rbr_rping_peer
[ -x "$peer" ] || { echo "vm-guest-rping-check: no $peer (cmake --build first)" >&2; exit 1; }
command -v rping >/dev/null || { echo "vm-guest-rping-check: no rping (rdmacm-utils)" >&2; exit 1; }
count=10
failed=0

our_server() { # SIZE PORT
  local size=$1 port=$2 slog=/tmp/rping-our-server.log clog=/tmp/rping-stock-client.log
  # Emptied first: the redirection below happens in the child, maybe after the first look for
  # "listening", which would then find the previous size's line.
  : >"$slog"
  timeout 120 "$peer" -s -a "$ip" -p "$port" -C "$count" -S "$size" >"$slog" 2>&1 & local s=$!
  for _ in $(seq 100); do grep -q '^listening on' "$slog" && break; sleep 0.2; done
  timeout 60 rping -c -V -v -C "$count" -S "$size" -a "$ip" -p "$port" >"$clog" 2>&1; local c=$?
  wait "$s"; local r=$?
  local pings; pings=$(grep -c '^ping data: rdma-ping-' "$clog")
  echo "--- our server, stock rping client, $count x $size B"
  cut -c1-120 "$slog"; tail -n 3 "$clog" | cut -c1-120
  echo "rping -c exit $c ($pings pings validated), rbr_rping_peer -s exit $r"
  [ "$c" -eq 0 ] && [ "$r" -eq 0 ] && [ "$pings" -eq "$count" ] && ! grep -q 'mismatch' "$clog"
}

our_client() { # SIZE PORT
  local size=$1 port=$2 slog=/tmp/rping-stock-server.log clog=/tmp/rping-our-client.log
  timeout 120 rping -s -V -v -S "$size" -a "$ip" -p "$port" >"$slog" 2>&1 & local s=$!
  # rping says nothing when it listens: retry the connect while it starts.
  local c=1
  for _ in $(seq 10); do
    sleep 1
    timeout 60 "$peer" -c -a "$ip" -p "$port" -C "$count" -S "$size" >"$clog" 2>&1; c=$?
    grep -q 'RBR_ERR_REFUSED\|RBR_ERR_REJECTED' "$clog" || break
  done
  wait "$s"; local r=$?
  local pings; pings=$(grep -c '^server ping data: rdma-ping-' "$slog")
  echo "--- stock rping server, our client, $count x $size B"
  cut -c1-120 "$clog"; tail -n 3 "$slog" | cut -c1-120
  echo "rbr_rping_peer -c exit $c, rping -s exit $r ($pings pings read)"
  [ "$c" -eq 0 ] && [ "$r" -eq 0 ] && [ "$pings" -eq "$count" ]
}

port=7560
for size in 64 16384; do
  our_server "$size" "$port" || failed=$((failed + 1))
  our_client "$size" $((port + 1)) || failed=$((failed + 1))
  port=$((port + 2))
done
echo "vm-guest-rping-check: $failed failed"
[ "$failed" -eq 0 ]
