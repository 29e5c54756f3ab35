#!/usr/bin/env bash
# Runs every cargo-fuzz target under fuzz/ for a bounded time with a fixed seed, on the
# stable toolchain (`-s none`: no sanitizer, which would need nightly). Fails on the first
# crash; libFuzzer leaves the input in fuzz/artifacts/TARGET/ — copy it into
# fuzz/regressions/TARGET/ with the fix, so tests/it/fuzz_replay.rs replays it forever.
#
#   scripts/fuzz.sh                 # every target, CAIRN_FUZZ_SECONDS (30) each, seed 1, a core each
#   scripts/fuzz.sh records 600     # one target, ten minutes
#   CAIRN_FUZZ_BUILD_ONLY=1 scripts/fuzz.sh   # install cargo-fuzz and build the targets only
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${2:-${CAIRN_FUZZ_SECONDS:-30}}"
# `run` must get the build's flags or it rebuilds. (cargo-fuzz's release build uses one
# codegen unit; 16 was measured slower on this 2-core machine: 6 min 55 s against 6 min 8 s.
# fuzz/Cargo.toml's release profile optimises at level 1: 4 min 45 s to build against
# 6 min 54 s, for about 12 % fewer inputs a second.)
build=(-s none)
seed="${CAIRN_FUZZ_SEED:-1}"
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "==> installing cargo-fuzz 0.13.2 (crates.io)"
  cargo install cargo-fuzz --version 0.13.2 --locked --quiet
fi
cd fuzz
targets="${1:-$(cargo fuzz list)}"
echo "==> building the fuzz targets (release, coverage-instrumented)"
cargo fuzz build "${build[@]}"
# CAIRN_FUZZ_BUILD_ONLY=1: install and build only (scripts/test.sh builds in the background).
if [ "${CAIRN_FUZZ_BUILD_ONLY:-0}" = 1 ]; then
  exit 0
fi
# One target a core at a time (CAIRN_FUZZ_JOBS, default: the cores): each libFuzzer process
# is single-threaded, so two cores fuzz two targets in the time of one.
jobs="${CAIRN_FUZZ_JOBS:-$(nproc)}"
# Fuzzes one target into its own log; its exit status is its verdict.
fuzz_one() {
  local target=$1 work
  # The corpus grows in a scratch copy: the checked-in one stays as committed.
  work="$(mktemp -d)"
  cp -r "corpus/$target/." "$work/"
  local status=0
  cargo fuzz run "${build[@]}" "$target" "$work" -- \
    -max_total_time="$seconds" -seed="$seed" -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 >"$work.log" 2>&1 || status=$?
  echo "==> $target: $(grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb)" "$work.log" | tr '\n' ' ' || true)"
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$work.log" >&2
    echo "error: $target crashed (exit $status); the input is in fuzz/artifacts/$target/" >&2
  fi
  rm -rf "$work" "$work.log"
  return "$status"
}
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
failed=0
for target in $targets; do
  echo "==> fuzzing $target for ${seconds}s (seed $seed)"
  fuzz_one "$target" &
  pids+=("$!")
  if [ "${#pids[@]}" -ge "$jobs" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
  [ "$failed" -eq 0 ] || exit 1
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
pids=()
exit "$failed"
