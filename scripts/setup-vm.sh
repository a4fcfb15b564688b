#!/usr/bin/env bash
# Installs what scripts/vm-run.sh and scripts/vm-run-two.sh need (soft-RoCE inside a qemu VM booted
# with virtme-ng; see docs/testing.md) on Debian 12, as root. Idempotent: apt runs only when a
# package is missing, pip only when `vng` is not on PATH.
# Usage: scripts/setup-vm.sh
set -euo pipefail

packages=(qemu-system-x86 linux-image-amd64 busybox-static rdmacm-utils ibverbs-utils
          ibverbs-providers perftest iproute2 kmod)

bash "$(dirname "$0")/install-packages.sh" setup-vm "${packages[@]}"

if ! command -v vng >/dev/null 2>&1; then
  echo "setup-vm: installing virtme-ng (pip)"
  if command -v pip >/dev/null 2>&1; then PIP=(pip); else PIP=(python3 -m pip); fi
  "${PIP[@]}" install -q virtme-ng
  command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
  hash -r
  command -v vng >/dev/null 2>&1 || { echo "setup-vm: vng not on PATH after install" >&2; exit 1; }
fi

# The harness boots the newest Debian kernel that has its modules installed (rdma_rxe is a module).
ls /boot/vmlinuz-*-amd64 >/dev/null 2>&1 || { echo "setup-vm: no /boot/vmlinuz-*-amd64" >&2; exit 1; }
echo "setup-vm: ok ($(command -v vng))"
