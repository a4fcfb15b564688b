#!/usr/bin/env bash
# Installs the named Debian packages that are not installed yet (as root, or with sudo
# available); does nothing when all are there. Used by setup.sh, setup-vm.sh and the benchmarks.
# Usage: scripts/install-packages.sh WHO PACKAGE...   (WHO prefixes the one message it prints)
set -euo pipefail
who=$1; shift
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -gt 0 ] || exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "$who: installing ${missing[*]}"
timeout 600 $SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive timeout 900 $SUDO apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
