#!/usr/bin/env bash
# Runs every cargo-fuzz target under fuzz/ for a bounded time with a fixed seed, on the
# stable toolchain (`-s none`: no sanitizer, which would need nightly). Fails on the first
# crash; libFuzzer leaves the input in fuzz/artifacts/TARGET/ — copy it into
# fuzz/regressions/TARGET/ with the fix, so tests/it/fuzz_replay.rs replays it forever.
#
#   scripts/fuzz.sh                 # every target, CAIRN_FUZZ_SECONDS (30) each, seed 1
#   scripts/fuzz.sh records 600     # one target, ten minutes
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
for target in $targets; do
  echo "==> fuzzing $target for ${seconds}s (seed $seed)"
  # The corpus grows in a scratch copy: the checked-in one stays as committed.
  work="$(mktemp -d)"
  cp -r "corpus/$target/." "$work/"
  status=0
  cargo fuzz run "${build[@]}" "$target" "$work" -- \
    -max_total_time="$seconds" -seed="$seed" -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 >"$work.log" 2>&1 || status=$?
  grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb)" "$work.log" | tr '\n' ' ' || true
  echo
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$work.log" >&2
    rm -rf "$work" "$work.log"
    echo "error: $target crashed (exit $status); the input is in fuzz/artifacts/$target/" >&2
    exit 1
  fi
  rm -rf "$work" "$work.log"
done
