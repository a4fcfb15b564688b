#!/usr/bin/env bash
# Regenerates include/rdmabridge.h from src/ffi/ (the only step that writes outside OUT_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
RDMABRIDGE_UPDATE_HEADER=1 cargo build --quiet "$@"
echo "include/rdmabridge.h regenerated"
