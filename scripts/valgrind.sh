#!/usr/bin/env bash
# valgrind memcheck on the C examples, from a Release build (no ASan): a server and a client
# exchanging a few hundred verified messages over shm, and the bad-input matrix. Fails on any
# memory error and on any definite leak. Takes about a minute.
# usage: scripts/valgrind.sh [BUILD_DIR]   (default build-release)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-release}
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$dir" -j2 --target rbr_server rbr_client rbr_bad_matrix >/dev/null
vg=(valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite
    --show-leak-kinds=definite --track-fds=no -q)
addr="shm://rbr-valgrind-$$"
slog=$(mktemp) clog=$(mktemp)
trap 'rm -f "$slog" "$clog"; [ -z "${spid:-}" ] || kill "$spid" 2>/dev/null || true' EXIT

timeout 150 "${vg[@]}" "$dir/rbr_server" -a "$addr" -n 300 -s 64 -v >"$slog" 2>&1 &
spid=$!
for _ in $(seq 600); do
  grep -q "listening on" "$slog" && break
  kill -0 "$spid" 2>/dev/null || break
  sleep 0.1
done
crc=0
timeout 150 "${vg[@]}" "$dir/rbr_client" -a "$addr" -n 300 -s 64 -v >"$clog" 2>&1 || crc=$?
src=0
wait "$spid" || src=$?
spid=
echo "-- server (exit $src)"; cat "$slog"
echo "-- client (exit $crc)"; cat "$clog"
[ "$src" -eq 0 ] && [ "$crc" -eq 0 ] || { echo "valgrind: the pair failed or memcheck reported errors" >&2; exit 1; }

mrc=0
timeout 150 "${vg[@]}" "$dir/rbr_bad_matrix" -a "shm://rbr-valgrind-matrix-$$" >"$clog" 2>&1 || mrc=$?
echo "-- bad-input matrix (exit $mrc)"; cat "$clog"
[ "$mrc" -eq 0 ] || { echo "valgrind: the bad-input matrix failed or memcheck reported errors" >&2; exit 1; }
echo "valgrind: no memory error, no definite leak"
