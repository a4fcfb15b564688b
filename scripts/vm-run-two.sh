#!/usr/bin/env bash
# Runs a server command and a client command in two soft-RoCE VMs joined by a qemu socket netdev
# over a free 127.0.0.1 port (see docs/testing.md). VM 1 (server, started first, 198.18.2.1/24)
# listens on the port; VM 2 (client, 198.18.2.2/24) is started once it does. Each guest puts rxe0
# on its one NIC, exports RBR_LOCAL_ADDR, RBR_PEER_ADDR (and RBR_TEST_ADDR=RBR_LOCAL_ADDR,
# RBR_VM=1), cds to the invoking directory and runs its command (argv, no shell: use bash -c).
# The client boots ~5 s after the server: it should retry its first connect for ~20-30 s.
# Prints both outputs; exits 0 only if both commands exit 0 (else the server's non-zero code,
# then the client's; 124 timeout, 125 VM failed to boot).
#
# Usage: scripts/vm-run-two.sh [--timeout SECS] [--kill-client-after SECS] -- SERVER_COMMAND... ::: CLIENT_COMMAND...
#   --timeout SECS  limit for each VM (default 1200). 1G memory each; both share the 2 cores.
#   --kill-client-after SECS  kill VM 2 outright (its qemu) SECS after its command started: a
#                   host failure; the exit code is then the server's alone.
# Example: scripts/vm-run-two.sh -- rping -s -a 198.18.2.1 -C 3 ::: bash -c 'until rping -c -a 198.18.2.1 -C 3; do sleep 2; done'
set -euo pipefail
source "$(dirname "$0")/vm-lib.sh"

usage() { echo "usage: $0 [--timeout SECS] -- SERVER_COMMAND... ::: CLIENT_COMMAND..." >&2; exit 2; }
timeout=1200 server=() client=() kill_after=""
while [ $# -gt 0 ]; do
  case $1 in
    --timeout) timeout=$2; shift 2 ;;
    --kill-client-after) kill_after=$2; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
while [ $# -gt 0 ] && [ "$1" != ":::" ]; do server+=("$1"); shift; done
[ $# -gt 0 ] && shift || true
client=("$@")
[ ${#server[@]} -gt 0 ] && [ ${#client[@]} -gt 0 ] || usage

listening() { ss -Hltn "sport = :$1" | grep -q .; }
for _ in $(seq 100); do
  port=$((20000 + RANDOM % 40000))
  ss -Htan "sport = :$port" | grep -q . || break
done

d1=$(mktemp -d /tmp/rbr-vm1.XXXXXX) d2=$(mktemp -d /tmp/rbr-vm2.XXXXXX) pids=()
trap '[ ${#pids[@]} -eq 0 ] || vm_kill "${pids[@]}"; rm -rf "$d1" "$d2"' EXIT
trap 'exit 130' INT TERM

setup() { # LOCAL PEER
  cat <<EOS
modprobe virtio_net || true
for i in \$(seq 100); do nic=\$(ls /sys/class/net | grep -vx lo | head -n1 || true); [ -n "\$nic" ] && break; sleep 0.2; done
ip addr add $1/24 dev \$nic; ip link set \$nic up
rdma link add rxe0 type rxe netdev \$nic
export RBR_LOCAL_ADDR=$1 RBR_PEER_ADDR=$2 RBR_TEST_ADDR=$1 RBR_VM=1
EOS
}
net="-netdev socket,id=n1,%s=127.0.0.1:$port -device virtio-net-pci,netdev=n1,mac=52:54:00:00:00:0%s"

echo "vm-run-two: VM 1 (server) listening on 127.0.0.1:$port" >&2
vm_start "$d1" 1G "$timeout" "$(printf -- "$net" listen 1)" "$(setup 198.18.2.1 198.18.2.2)" -- "${server[@]}"
pids+=("$VM_PID")
for _ in $(seq 600); do listening "$port" || ! kill -0 "${pids[0]}" 2>/dev/null && break; sleep 0.1; done
if listening "$port"; then
  vm_start "$d2" 1G "$timeout" "$(printf -- "$net" connect 2)" "$(setup 198.18.2.2 198.18.2.1)" -- "${client[@]}"
  pids+=("$VM_PID")
else
  echo "vm-run-two: VM 1 never listened on 127.0.0.1:$port" >&2; vm_kill "${pids[0]}"
fi

rc1=0 rc2=0
if [ -n "$kill_after" ] && [ ${#pids[@]} -gt 1 ]; then
  for _ in $(seq "$((timeout * 10))"); do [ -e "$d2/t_cmd" ] || ! kill -0 "${pids[1]}" 2>/dev/null && break; sleep 0.1; done
  sleep "$kill_after"
  echo "vm-run-two: killing VM 2 (client) outright at $(date +%T.%N)" >&2
  kill -KILL -- "-${pids[1]}" 2>/dev/null || true
  wait "${pids[1]}" 2>/dev/null || true
  pids=("${pids[0]}")
fi
vm_finish "$d1" "${pids[0]}" "VM 1 (server)" "$timeout" || rc1=$?
if [ -n "$kill_after" ]; then rc2=0
elif [ ${#pids[@]} -gt 1 ]; then vm_finish "$d2" "${pids[1]}" "VM 2 (client)" "$timeout" || rc2=$?; else rc2=125; fi
[ "$rc1" -ne 0 ] && exit "$rc1"
exit "$rc2"
