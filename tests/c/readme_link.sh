#!/usr/bin/env bash
# readme_link.sh: builds tests/c/link_check.c with the link lines the README gives, from the
# repository root, and runs each program straight from the build output. Fails if any does not
# build or run.
# usage: readme_link.sh REPO_ROOT OUT_DIR
set -euo pipefail
root=$(realpath "$1") out=$(realpath -m "$2")
mkdir -p "$out"
cd "$root"
src=tests/c/link_check.c

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
echo "== C++: the README's C++ snippet, built with its link line"
# The snippet is the body of main; with nobody listening on shm://demo its first connect
# throws RBR_ERR_REFUSED, which is what this run expects (it proves the throwing form).
{
  echo '#include <cstdio>'
  sed -n '/^## C++$/,/^## /p' README.md | sed -n '/^```cpp$/,/^```$/p' | sed '1d;$d' |
    sed '/^#include/!d'
  echo 'int main() try {'
  sed -n '/^## C++$/,/^## /p' README.md | sed -n '/^```cpp$/,/^```$/p' | sed '1d;$d' |
    sed '/^#include/d'
  echo '  return 1; /* connected to shm://demo: not expected here */'
  echo '} catch (const rbr::error &e) { std::printf("%s\n", e.what()); return e.status() == RBR_ERR_REFUSED ? 0 : 1; }'
} >"$out/readme_cxx.cpp"
c++ -std=c++17 "$out/readme_cxx.cpp" -I include -L target/release -lrdmabridge -o "$out/readme_cxx"
LD_LIBRARY_PATH=target/release "$out/readme_cxx"
echo "readme_link: 4 programs built and ran"
