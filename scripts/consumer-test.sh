#!/usr/bin/env bash
# Builds the library with CMake alone (cargo run by CMake, into a target directory of its own
# given by CARGO_TARGET_DIR, so nothing built before is reused), installs it into a scratch
# prefix, runs the installed rdmabridge-info, checks the license files, and builds
# tests/consumer against it every way the README gives: find_package, pkg-config (shared and
# static), add_subdirectory and FetchContent. Runs every program.
# Usage: scripts/consumer-test.sh [OUT_DIR]   (default build-consumer)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$root/build-consumer}")
rm -rf "$out"
mkdir -p "$out"
prefix=$out/prefix
export CARGO_TARGET_DIR=$out/cargo-target
consumer=$root/tests/consumer

echo "== cmake builds the library (cargo into $CARGO_TARGET_DIR) and installs it"
cmake -S "$root" -B "$out/lib" -DRDMABRIDGE_EXAMPLES=OFF >/dev/null
cmake --build "$out/lib" -j2
cmake --install "$out/lib" --prefix "$prefix"
[ -f "$CARGO_TARGET_DIR/release/librdmabridge.so" ] || {
  echo "consumer-test: cargo did not build into CARGO_TARGET_DIR" >&2; exit 1; }

echo "== the installed rdmabridge-info runs (exit 0 with or without an RDMA device)"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)
info=$("$prefix/bin/rdmabridge-info" shm://consumer-test) || {
  echo "consumer-test: $prefix/bin/rdmabridge-info failed (exit $?)" >&2; exit 1; }
printf '%s\n' "$info"
grep -qxF "rdmabridge $version" <<<"$info" || {
  echo "consumer-test: rdmabridge-info did not print its version, $version" >&2; exit 1; }
for want in "transports: shm, verbs" "RDMA devices: " "memlock limit (ulimit -l): " \
  "address shm://consumer-test: shm to consumer-test ("; do
  grep -qF -- "$want" <<<"$info" || {
    echo "consumer-test: rdmabridge-info printed no \"$want\"" >&2; exit 1; }
done
for f in LICENSE-MIT LICENSE-APACHE; do
  cmp "$root/$f" "$prefix/share/doc/rdmabridge/$f" || {
    echo "consumer-test: share/doc/rdmabridge/$f is missing or differs" >&2; exit 1; }
done

programs() { # DIR: runs the three consumer programs of a CMake build
  "$1/consumer_c"
  "$1/consumer_cxx"
  "$1/consumer_static"
  if ldd "$1/consumer_static" | grep -q librdmabridge; then
    echo "consumer-test: consumer_static needs the shared library" >&2; return 1
  fi
}

echo "== find_package(rdmabridge CONFIG) from the installed tree"
cmake -S "$consumer" -B "$out/package" -DRBR_USE=package -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$out/package" -j2 >/dev/null
grep -q "$prefix/include" "$out/package/CMakeFiles/consumer_c.dir/flags.make" || {
  echo "consumer-test: find_package did not give the installed headers" >&2; exit 1; }
programs "$out/package"

echo "== pkg-config rdmabridge from the installed tree"
(
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
cc "$consumer/consumer.c" $(pkg-config --cflags --libs rdmabridge) -o "$out/pc_shared"
LD_LIBRARY_PATH=$prefix/lib "$out/pc_shared"
c++ -std=c++17 "$consumer/consumer.cpp" $(pkg-config --cflags --libs rdmabridge) -o "$out/pc_cxx"
LD_LIBRARY_PATH=$prefix/lib "$out/pc_cxx"
private=$(pkg-config --static --libs-only-l rdmabridge | sed 's/-lrdmabridge//')
cc "$consumer/consumer.c" $(pkg-config --cflags --libs-only-L rdmabridge) \
  -Wl,-Bstatic -lrdmabridge -Wl,-Bdynamic $private -o "$out/pc_static"
"$out/pc_static"
! ldd "$out/pc_static" | grep -q librdmabridge
)

for use in subdirectory fetchcontent; do
  echo "== $use"
  cmake -S "$consumer" -B "$out/$use" -DRBR_USE=$use -DRDMABRIDGE_SOURCE="$root" >/dev/null
  cmake --build "$out/$use" -j2 >/dev/null
  programs "$out/$use"
done
echo "consumer-test: installed, and used through find_package, pkg-config, add_subdirectory and FetchContent"
