# Shared helpers for scripts/vm-run.sh and scripts/vm-run-two.sh (sourced, not run). A VM is
# virtme-ng booting Debian's kernel under qemu without KVM, with the host's root file system
# read-only, /tmp a throwaway overlay and one results dir (--rwdir) that persists on the host.
# Each VM runs inside `timeout` (its own process group: timeout, vng and the qemu it forks), so
# `vm_kill PID` ends all of it.

# Newest /boot/vmlinuz-*-amd64 whose modules are installed (rdma_rxe is a module).
vm_kernel() {
  local k v best=""
  for k in $(ls /boot/vmlinuz-*-amd64 2>/dev/null | sort -V); do
    v=${k#/boot/vmlinuz-}
    [ -d "/lib/modules/$v/kernel" ] && best=$k
  done
  [ -n "$best" ] || { echo "vm: no /boot/vmlinuz-*-amd64 with /lib/modules; run scripts/setup-vm.sh" >&2; return 1; }
  echo "$best"
}

# vm_start DIR MEMORY TIMEOUT QEMU_OPTS SETUP -- COMMAND...: writes DIR/guest.sh (modprobe
# rdma_rxe, SETUP shell lines that must create rxe0 and export variables, wait for rxe0 ACTIVE, cd
# to $PWD, run COMMAND into DIR/output and DIR/rc) and boots it in the background; sets VM_PID.
vm_start() {
  local d=$1 mem=$2 t=$3 qopts=$4 setup=$5 kernel; shift 6
  kernel=$(vm_kernel)
  cat >"$d/guest.sh" <<EOS
set -euo pipefail
R=$(printf %q "$d"); exec >"\$R/setup.log" 2>&1; : >"\$R/t_boot"; set -x
export PATH=$(printf %q "$PATH"):/usr/sbin:/sbin
modprobe rdma_rxe
$setup
for i in \$(seq 150); do rdma link show rxe0/1 | grep -q 'state ACTIVE' && break; sleep 0.2; done
rdma link show rxe0/1 | grep 'state ACTIVE'
ibv_devices
cd $(printf %q "$PWD")
set +ex; : >"\$R/t_cmd"
$(printf '%q ' "$@") >"\$R/output" 2>&1 </dev/null
echo \$? >"\$R/rc"
EOS
  local args=(--run "$kernel" --disable-kvm --user root --memory "$mem" --cpus 2 --rwdir "$d")
  # Under emulation the kernel distrusts the TSC and falls back to the HPET, whose every read
  # (each clock_gettime) is an emulated device access of ~0.6 us; the emulated TSC is
  # monotonic, so trusting it keeps clock reads in the vDSO for every program alike.
  args+=(--append "tsc=reliable clocksource=tsc")
  # The guest sees the host's / read-only but /tmp as an empty overlay: share the checkout
  # explicitly, so a clone under /tmp (as CI's may be) is visible too.
  local repo; repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  case $repo in /tmp|/tmp/*) args+=(--rwdir "$repo") ;; esac
  local rw; for rw in ${VM_RW[@]+"${VM_RW[@]}"}; do args+=(--rwdir "$rw"); done
  [ -z "$qopts" ] || args+=(--qemu-opts="$qopts")
  date +%s.%N >"$d/t_host"
  timeout -k 10 "$t" vng "${args[@]}" --exec "bash $d/guest.sh" </dev/null >"$d/vng.log" 2>&1 &
  VM_PID=$!
}

vm_kill() { # PID...: end each VM's process group (timeout, vng, qemu) if anything of it is left
  local p
  for p in "$@"; do
    kill -TERM -- "-$p" 2>/dev/null || continue
    sleep 1; kill -KILL -- "-$p" 2>/dev/null || true
  done
}

_vm_secs() { [ -e "$2" ] && awk -v a="$(date -r "$2" +%s.%N)" -v b="$1" 'BEGIN{printf "%.1fs", a-b}' || echo -n '-'; }

# vm_finish DIR PID LABEL TIMEOUT: waits for the VM, prints the command's output and a summary
# line; returns the guest command's exit code, or 124 (timeout) / 125 (no boot or setup failed).
vm_finish() {
  local d=$1 pid=$2 label=$3 t=$4 vrc=0 t0
  wait "$pid" || vrc=$?
  t0=$(cat "$d/t_host")
  echo "===== $label: output"
  [ -e "$d/output" ] && cat "$d/output"
  local times="script started $(_vm_secs "$t0" "$d/t_boot"), rxe0 ACTIVE $(_vm_secs "$t0" "$d/t_cmd"), done $(_vm_secs "$t0" "$d/rc") after start"
  if [ -s "$d/rc" ]; then
    local rc; rc=$(cat "$d/rc")
    echo "===== $label: exit $rc (vng exit $vrc; $times)"
    return "$rc"
  fi
  if [ "$vrc" -eq 124 ] || [ "$vrc" -eq 137 ]; then
    echo "===== $label: TIMED OUT after ${t}s ($times)" >&2; vrc=124
  else
    echo "===== $label: VM failed to boot or guest setup failed (vng exit $vrc; $times)" >&2; vrc=125
  fi
  echo "--- guest setup log (tail):" >&2; tail -n 20 "$d/setup.log" >&2 2>/dev/null || echo "(none: the guest never ran its script)" >&2
  echo "--- vng log (tail):" >&2; tail -n 20 "$d/vng.log" >&2
  return "$vrc"
}
