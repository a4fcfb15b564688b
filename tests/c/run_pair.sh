#!/usr/bin/env bash
# run_pair.sh: runs rbr_server in the background and rbr_client against it,
# each under `timeout`, and fails unless both exit 0.  The server is killed
# if the client fails.
#
# usage: run_pair.sh SERVER CLIENT [ARGS...] [-- CLIENT_ARGS... [-- SERVER_ARGS...]]
#   ARGS go to both programs (e.g. -a shm://name -n 10000 -s 64 -v);
#   CLIENT_ARGS only to the client (e.g. -w 16), SERVER_ARGS only to the
#   server (e.g. -c 200).
# environment: RUN_PAIR_TIMEOUT  seconds allowed for each program (120)
#              RUN_PAIR_READY    seconds to wait for "listening on" (30)
set -u

if [ $# -lt 2 ]; then
    echo "usage: $0 SERVER CLIENT [ARGS...] [-- CLIENT_ARGS... [-- SERVER_ARGS...]]" >&2
    exit 2
fi
server=$1
client=$2
shift 2
common=()
client_only=()
server_only=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    common+=("$1")
    shift
done
[ $# -eq 0 ] || shift
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    client_only+=("$1")
    shift
done
[ $# -eq 0 ] || shift
server_only=("$@")

limit=${RUN_PAIR_TIMEOUT:-120}
ready=${RUN_PAIR_READY:-30}
log=$(mktemp "${TMPDIR:-/tmp}/run_pair.XXXXXX") || exit 2
spid=

cleanup() {
    if [ -n "$spid" ] && kill -0 "$spid" 2>/dev/null; then
        kill "$spid" 2>/dev/null
        wait "$spid" 2>/dev/null
    fi
    rm -f "$log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

show_server_log() {
    sed 's/^/[server] /' "$log"
}

timeout "$limit" "$server" "${common[@]}" "${server_only[@]}" >"$log" 2>&1 &
spid=$!

# Wait until the server is listening, or has died.
deadline=$((SECONDS + ready))
until grep -q '^listening on ' "$log"; do
    if ! kill -0 "$spid" 2>/dev/null; then
        wait "$spid"
        src=$?
        spid=
        show_server_log
        echo "run_pair: server exited with status $src before listening" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        show_server_log
        echo "run_pair: server not listening after ${ready}s" >&2
        exit 1
    fi
    sleep 0.05
done

start=$(date +%s.%N)
timeout "$limit" "$client" "${common[@]}" "${client_only[@]}" 2>&1 |
    sed -u 's/^/[client] /'
crc=${PIPESTATUS[0]}
if [ "$crc" -ne 0 ]; then
    echo "run_pair: client exited with status $crc; stopping the server" >&2
    kill "$spid" 2>/dev/null
fi
wait "$spid"
src=$?
spid=
end=$(date +%s.%N)
show_server_log

if [ "$crc" -ne 0 ] || [ "$src" -ne 0 ]; then
    echo "run_pair: FAILED (client status $crc, server status $src)" >&2
    exit 1
fi
awk -v a="$start" -v b="$end" \
    'BEGIN { printf "run_pair: OK (client and server exited 0, %.2f s)\n", b - a }'
exit 0
