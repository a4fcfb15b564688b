#!/usr/bin/env bash
# guide_check.sh: builds the server and the client of docs/first-connection.md exactly as the
# guide shows them (its first code block is shared by both), links them with the README's link
# line, runs them against each other, and checks the echo. Run by ctest.
# usage: guide_check.sh REPO_ROOT OUT_DIR SHM_NAME
set -euo pipefail
root=$(realpath "$1") out=$(realpath -m "$2") name=$3
mkdir -p "$out"
cd "$root"
guide=docs/first-connection.md
block() { # N: the Nth ```c block of the guide, with the guide's listener name replaced
  awk -v want="$1" '/^```c$/ {n++; on = (n == want); next} /^```$/ {on = 0} on' "$guide" |
    sed "s|shm://first|shm://$name|g"
}
{ block 1; block 2; } >"$out/guide_server.c"
{ block 1; block 3; } >"$out/guide_client.c"
for p in guide_server guide_client; do
  cc -std=c99 -Wall -Wextra -Werror "$out/$p.c" -I include -L target/release -lrdmabridge \
    -Wl,-rpath,"$PWD/target/release" -o "$out/$p"
done
timeout 30 "$out/guide_server" & server=$!
reply=""
for _ in $(seq 100); do            # the client may come before the server listens: retry
  if reply=$(timeout 10 "$out/guide_client" 2>/dev/null); then break; fi
  sleep 0.1
done
wait "$server"
echo "$reply"
[ "$reply" = "echo: hello" ]
