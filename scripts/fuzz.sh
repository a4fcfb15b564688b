#!/usr/bin/env bash
# The fuzz targets in fuzz/ (cargo-fuzz + libFuzzer, address sanitizer, debug assertions):
# builds them and runs each for a while, one after another, starting from its committed seed
# corpus (fuzz/corpus/<target>/); what the fuzzer finds new goes to fuzz/corpus-work/<target>/
# (not committed). Fails on any finding (crash, panic, sanitizer report, timeout, leak) and
# names the input that reproduces it.
#
#   scripts/fuzz.sh                  600 s per target (the documented long run)
#   scripts/fuzz.sh --quick          20 s per target (CI)
#   scripts/fuzz.sh --seconds N [TARGET...]
#
# The stable toolchain builds the targets with RUSTC_BOOTSTRAP=1 (for -Zsanitizer); cargo-fuzz
# is installed (pinned) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.1
ALL_TARGETS=(handshake ring onesided)
secs=600
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) secs=20 ;;
    --seconds) secs="$2"; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
[ ${#targets[@]} -gt 0 ] || targets=("${ALL_TARGETS[@]}")

if ! cargo fuzz --version 2>/dev/null | grep -qF " $CARGO_FUZZ_VERSION"; then
  echo "installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install --locked --quiet cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

export RUSTC_BOOTSTRAP=1
target_dir="${CARGO_TARGET_DIR:-$PWD/target}/fuzz"
host=$(rustc -vV | sed -n 's/^host: //p')
bin="$target_dir/$host/release"
mkdir -p "$target_dir"
echo "building the fuzz targets"
cargo fuzz build --release --debug-assertions --target-dir "$target_dir" >/dev/null 2>"$target_dir.build.log" || {
  cat "$target_dir.build.log" >&2
  exit 1
}

failed=0
for t in "${targets[@]}"; do
  seeds="fuzz/corpus/$t"
  work="fuzz/corpus-work/$t"
  artifacts="fuzz/artifacts/$t"
  [ -d "$seeds" ] || { echo "no seed corpus $seeds" >&2; exit 1; }
  mkdir -p "$work" "$artifacts"
  log="$artifacts/last-run.log"
  start=$(date +%s)
  if "$bin/$t" -max_total_time="$secs" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$artifacts/" "$work" "$seeds" >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
    echo "$t: $runs executions in $(( $(date +%s) - start )) s, $cov, no finding"
  else
    failed=1
    echo "$t: FINDING after $(( $(date +%s) - start )) s (log: $log)" >&2
    grep -E "panicked at|ERROR: |SUMMARY|Test unit written" "$log" | head -n 8 >&2 || true
    echo "reproduce: $bin/$t $artifacts/<crash-file>" >&2
  fi
done
exit "$failed"
