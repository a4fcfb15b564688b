#!/usr/bin/env bash
# Installs what building and testing rdmabridge needs on Debian 12 (run as root, or with sudo
# available). Idempotent: packages already present are not fetched again.
set -euo pipefail

packages=(
  # build: rdma-sys runs bindgen, which needs libclang and clang's own headers (stddef.h)
  build-essential pkg-config cmake libibverbs-dev librdmacm-dev ibverbs-providers
  libclang1-14 libclang-common-14-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust (stable) first" >&2
  exit 1
fi
