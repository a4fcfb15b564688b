#!/usr/bin/env bash
# Runs every test that needs real RDMA, on soft-RoCE inside qemu VMs (docs/testing.md says how):
# two-host tests (two VMs joined over a host loopback port: a transfer, then a host killed and a
# link cut mid-transfer, which the other host - and, for the link, the host that lost it - must
# notice in bounded time), then the verbs suite, the C
# examples over verbs and against the stock librdmacm peers (one VM), whose summary line
# ("vm-guest-suite: N passed, N failed") closes the output.
# Needs: scripts/setup-vm.sh (packages), a release build, and the C examples built in BUILD_DIR.
# Usage: scripts/vm-test.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(realpath "${1:-build}")
bash scripts/setup-vm.sh
cargo build --release --quiet
# The tokio examples, which a test of the verbs binary runs over verbs.
cargo build --release --features tokio --examples --quiet
# The test binary (not the rbr-echo binary built alongside it): target/release/deps/verbs-HASH,
# with the async API's tests (feature tokio).
bin=$(cargo test --release --features tokio --test verbs --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\/deps\/verbs-[^"]*\)".*/\1/p' | tail -n 1)
[ -x "$bin" ] || { echo "vm-test: could not build the verbs test binary" >&2; exit 1; }
scale_bin=$(cargo test --release --test scale --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\/deps\/scale-[^"]*\)".*/\1/p' | tail -n 1)
[ -x "$scale_bin" ] || { echo "vm-test: could not build the scale test binary" >&2; exit 1; }
[ -x "$build/rbr_server" ] || { echo "vm-test: no C examples in $build (cmake --build first)" >&2; exit 1; }
# Two VMs, once more if one of them never booted (the guest never ran its command: nothing of
# the library ran there, so the run says nothing about it); any other failure stands.
two_vms() {
  local log rc=0
  log=$(mktemp /tmp/rbr-vm-two.XXXXXX)
  scripts/vm-run-two.sh "$@" 2>&1 | tee "$log" || rc=$?
  if [ "$rc" -ne 0 ] && grep -q 'VM failed to boot or guest setup failed' "$log"; then
    echo "vm-test: a VM did not boot; running the step once more"
    rc=0
    scripts/vm-run-two.sh "$@" || rc=$?
  fi
  rm -f "$log"
  return "$rc"
}
echo "== two VMs: a verified transfer between two hosts over soft-RoCE"
two_vms --timeout 900 -- \
  target/release/rbr-echo server rdma://198.18.2.1:7471 2000 65536 ::: \
  target/release/rbr-echo client rdma://198.18.2.1:7471 2000 65536
# A lost host or link must surface at the survivor as an error within the documented bound
# (about 3 s with the default options; checked against 30 s, since the VMs run under emulation,
# maybe on a loaded machine; a survivor that never noticed would hang until its time limit).
echo "== two VMs: the client VM is killed outright mid-transfer; the server must notice"
two_vms --timeout 600 --kill-client-after 12 -- \
  scripts/vm-guest-expect-loss.sh 30000 -- target/release/rbr-echo server rdma://198.18.2.1:7471 1000000 65536 ::: \
  target/release/rbr-echo client rdma://198.18.2.1:7471 1000000 65536
echo "== two VMs: the client VM's link goes down mid-transfer; both sides must notice"
two_vms --timeout 600 -- \
  scripts/vm-guest-expect-loss.sh 30000 -- target/release/rbr-echo server rdma://198.18.2.1:7471 1000000 65536 ::: \
  bash -c 'nic=$(ls /sys/class/net | grep -vx lo | head -n1)
    (sleep 12; ip link set "$nic" down; echo "link $nic down") &
    scripts/vm-guest-expect-loss.sh 30000 -- timeout 120 target/release/rbr-echo client rdma://198.18.2.1:7471 1000000 65536'
echo "== one VM: verbs suite, C examples, stock peers"
scripts/vm-run.sh --timeout 1800 -- scripts/vm-guest-suite.sh "$bin" "$build" "$scale_bin"
