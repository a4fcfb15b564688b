#!/usr/bin/env bash
# Installs what building and testing rdmabridge needs on Debian 12 (run as root, or with sudo
# available). Idempotent: packages already present are not fetched again.
set -euo pipefail

packages=(
  # build: rdma-sys runs bindgen, which needs libclang and clang's own headers (stddef.h)
  build-essential pkg-config cmake libibverbs-dev librdmacm-dev ibverbs-providers
  libclang1-14 libclang-common-14-dev
  # test: memcheck on the C examples (scripts/valgrind.sh)
  valgrind
)

bash "$(dirname "$0")/install-packages.sh" setup "${packages[@]}"

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust (stable) first" >&2
  exit 1
fi
