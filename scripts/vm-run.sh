#!/usr/bin/env bash
# Runs one command inside a qemu VM with soft-RoCE (see docs/testing.md) and exits with that
# command's exit code. The guest loads rdma_rxe, makes dummy interface rt0 = 198.18.0.1/24 with
# rxe0 on it, waits for rxe0 ACTIVE, exports RBR_TEST_ADDR=198.18.0.1, RBR_TEST_NETDEV=rt0 and
# RBR_VM=1, cds to the
# directory this script was invoked from and runs COMMAND (argv, no shell: use `bash -c '...'` for
# pipes or `&`). Its stdout+stderr are printed after the VM stops. Boot takes ~20-30 s (no KVM).
#
# Usage: scripts/vm-run.sh [--timeout SECS] [--rw DIR]... -- COMMAND...
#   --timeout SECS  whole-VM limit (default 1200); exit 124 when hit, 125 if the VM fails to boot
#   --rw DIR        make host DIR writable in the guest (repeatable). The guest sees the host's /
#                   read-only and /tmp as an empty throwaway overlay, so a command that writes
#                   into the repo (e.g. cargo and its target/) needs --rw /work/main/target.
# Example: scripts/vm-run.sh -- target/release/deps/verbs-XXXX --test-threads=1
# Needs scripts/setup-vm.sh (root). Runs one VM at a time; the machine has 2 cores.
set -euo pipefail
source "$(dirname "$0")/vm-lib.sh"

timeout=1200 VM_RW=()
while [ $# -gt 0 ]; do
  case $1 in
    --timeout) timeout=$2; shift 2 ;;
    --rw) VM_RW+=("$(realpath "$2")"); shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--timeout SECS] [--rw DIR]... -- COMMAND..." >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--timeout SECS] [--rw DIR]... -- COMMAND..." >&2; exit 2; }

dir=$(mktemp -d /tmp/rbr-vm.XXXXXX) VM_PID=""
trap '[ -z "$VM_PID" ] || vm_kill "$VM_PID"; rm -rf "$dir"' EXIT
trap 'exit 130' INT TERM

setup='ip link add rt0 type dummy; ip addr add 198.18.0.1/24 dev rt0; ip link set rt0 up
rdma link add rxe0 type rxe netdev rt0
export RBR_TEST_ADDR=198.18.0.1 RBR_TEST_NETDEV=rt0 RBR_VM=1'
vm_start "$dir" 2G "$timeout" "" "$setup" -- "$@"
rc=0; vm_finish "$dir" "$VM_PID" vm "$timeout" || rc=$?
exit "$rc"
