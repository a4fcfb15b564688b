#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (a step of scripts/vm-guest-suite.sh): rdmabridge-info names the
# device, its active port and its GIDs; says which device an rdma:// address of the VM and a
# plain address of it take, and why; registers 1 MiB; and, for a non-root user under
# `ulimit -l 64`, names the memory-lock limit as the cause of the failed registration.
# Usage: scripts/vm-guest-info-check.sh RDMABRIDGE_INFO_BINARY VM_ADDRESS
set -u
bin=$(realpath "$1") ip=$2
failed=0
check() { # PATTERN: a line of $out matches it
  if grep -qE -- "$1" <<<"$out"; then echo "  ok: $1"; else echo "  MISSING: $1"; failed=1; fi
}
out=$("$bin" "rdma://$ip:7000" "$ip:7000" "shm://info")
echo "$out"
check '^RDMA devices: [1-9]'
check '^  rxe0$'
check '^    port 1: ACTIVE, MTU [0-9]+, link layer Ethernet'
check "GID\[[0-9]+\] ::ffff:$ip"
check "^address rdma://$ip:7000: verbs to $ip:7000 \(the rdma:// form names verbs\)$"
check '^  device rxe0, port 1$'
check "^address $ip:7000: verbs to $ip:7000 \(an address of this machine, which has an RDMA device\)$"
check '^  registration of 1 MiB on rxe0: ok$'
out=$(setpriv --reuid=65534 --regid=65534 --clear-groups \
  bash -c 'ulimit -l 64 && exec "$0" --register 1M' "$bin")
echo "$out"
check '^memlock limit \(ulimit -l\): 64 KiB \(hard 64 KiB\)$'
check '^  registration of 1 MiB on rxe0: FAILED: .*RLIMIT_MEMLOCK'
check '^hint: memlock limit \(ulimit -l\) is 64 KiB'
exit $failed
