#!/usr/bin/env bash
# Runs in a VM of a two-host test: runs COMMAND (an rbr-echo peer in a transfer that is cut
# mid-way), and passes only if it fails with an error completion that surfaced at most BOUND_MS
# after its last successful completion, and within its own time limit (nothing hangs).
# Usage: scripts/vm-guest-expect-loss.sh BOUND_MS -- COMMAND...
set -u
bound=$1; shift 2
start=$(date +%s%N)
err=$("$@" 2>&1 >/dev/null); rc=$?
took=$(( ($(date +%s%N) - start) / 1000000 ))
echo "$err"
quiet=$(printf '%s\n' "$err" | sed -n 's/.* \([0-9]*\) ms after the last successful one.*/\1/p' | head -n1)
echo "vm-guest-expect-loss: exit $rc after ${took} ms; error surfaced ${quiet:-?} ms after the last successful completion (bound ${bound} ms)"
[ "$rc" -ne 0 ] && [ -n "$quiet" ] && [ "$quiet" -le "$bound" ]
