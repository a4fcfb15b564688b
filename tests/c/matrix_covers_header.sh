#!/bin/sh
# Fails when a function the header declares is not called by the bad-input matrix, so a new
# export cannot be left out of it.  usage: matrix_covers_header.sh HEADER MATRIX.c...
set -eu
header=$1; shift
# Declarations: a line that starts with a return type and names rbr_xxx( (doc comments start
# with " *", so they are not counted).
names=$(grep -E '^[a-z][a-z0-9_ ]*[ *]rbr_[a-z0-9_]+\(' "$header" |
        sed -E 's/.*[ *](rbr_[a-z0-9_]+)\(.*/\1/' | sort -u)
count=$(printf '%s\n' "$names" | grep -c . || true)
[ "$count" -ge 40 ] || { echo "only $count declarations found in $header: is the pattern stale?"; exit 1; }
missing=0
for n in $names; do
  if ! cat "$@" | grep -Eq "(^|[^a-z0-9_])$n\("; then
    echo "not in the bad-input matrix: $n"
    missing=$((missing + 1))
  fi
done
[ "$missing" -eq 0 ] || { echo "$missing of $count header functions missing from $*"; exit 1; }
echo "all $count functions of $(basename "$header") are in the bad-input matrix"
