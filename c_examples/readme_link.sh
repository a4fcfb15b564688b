#!/usr/bin/env bash
# readme_link.sh: builds c_examples/link_check.c with the link lines the README gives, from the
# repository root, and runs each program straight from the build output. Fails if any does not
# build or run.
# usage: readme_link.sh REPO_ROOT OUT_DIR
set -euo pipefail
root=$(realpath "$1") out=$(realpath -m "$2")
mkdir -p "$out"
cd "$root"
src=c_examples/link_check.c

echo "== shared, run with LD_LIBRARY_PATH"
cc "$src" -I include -L target/release -lrdmabridge -o "$out/link_shared"
LD_LIBRARY_PATH=target/release "$out/link_shared"

echo "== shared, with an rpath"
cc "$src" -I include -L target/release -lrdmabridge -Wl,-rpath,"$PWD/target/release" \
  -o "$out/link_rpath"
"$out/link_rpath"

echo "== static"
cc "$src" -I include target/release/librdmabridge.a -lrdmacm -libverbs -lpthread -ldl -lm \
  -o "$out/link_static"
"$out/link_static"
echo "readme_link: 3 programs built and ran"
