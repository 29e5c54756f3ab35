#!/usr/bin/env bash
# cairn's fast check, for contributors before a push: formatting, clippy with warnings as
# errors, the purity of cairn-core, the docs with warnings as errors, the unit tests and the
# deterministic simulation. No root, no Docker, no network (beyond cargo's own registry if
# the dependencies are not fetched yet); about a minute on 2 cores once built.
#
#   ./scripts/check.sh            # everything above
#   ./scripts/check.sh --static   # fmt, clippy, purity and docs only (scripts/test.sh runs the
#                                 # tests itself, in its `cargo test --workspace`)
#
# scripts/test.sh (CI) runs `check.sh --static` first, then everything that needs processes,
# etcd and Docker, and the tests once, in `cargo test --workspace`.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n==> [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }
start=$SECONDS
static_only=false
case "${1:-}" in
  --static) static_only=true ;;
  "") ;;
  *) echo "usage: scripts/check.sh [--static]" >&2; exit 2 ;;
esac

say "cargo fmt --all --check"
cargo fmt --all --check

say "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

say "the SDK an application links (cairn-sdk: cairn-rpc without its server runtime; no clap, tracing-subscriber, humantime, prometheus-client; axum comes with tonic's router)"
# CAIRN_CHECK_SDK_CLIPPY=no leaves its clippy out (scripts/test.sh runs it on its own, beside the
# deployment checks and the compose test).
if [ "${CAIRN_CHECK_SDK_CLIPPY:-yes}" != no ]; then
  cargo clippy -p cairn-sdk --locked -- -D warnings
fi
if cargo tree -p cairn-sdk -e normal --prefix none --locked | grep -E '^(clap|tracing-subscriber|humantime|prometheus-client) '; then
  echo "error: the SDK depends on a server or CLI crate (above)" >&2
  exit 1
fi

say "the daemons do not stand on the client SDK; the fuzzers stand on cairn-proto alone"
for daemon in cairn-node cairn-coordinator; do
  if cargo tree -p "$daemon" -e normal --prefix none --locked | grep -E '^cairn-(sdk|cli) '; then
    echo "error: $daemon depends on the client SDK (above): server code belongs in cairn-rpc" >&2
    exit 1
  fi
done
fuzz_packages=$(grep -c '^\[\[package\]\]' fuzz/Cargo.lock)
if [ "$fuzz_packages" -ge 80 ]; then
  echo "error: fuzz/Cargo.lock holds $fuzz_packages packages (fewer than 80: the fuzzers need cairn-proto, not the daemons)" >&2
  exit 1
fi
echo "fuzz/Cargo.lock: $fuzz_packages packages"

say "the shape of issue 32: no wire message in the coordinator's task, no non-test file over 500 lines in node/, coordinator/, client-sdk/"
if grep -rn 'pb::\|cairn_proto::v1\|cairn_rpc::v1' coordinator/src/task/; then
  echo "error: the coordinator's task speaks domain types only (cairn_core::control, the stored records): convert at its edges (coordinator/src/api/)" >&2
  exit 1
fi
if ! scripts/long-files.sh; then
  echo "error: the files above have over 500 lines besides their tests: split them by concern" >&2
  exit 1
fi

say "the coordinator's engine reads no clock and takes no randomness of its own (time and seeds come in with its inputs)"
if grep -rn 'SystemTime\|Instant::\|thread_rng\|RandomState' core/src/coordinator/; then
  echo "error: the engine (core/src/coordinator/) is deterministic: take the time from the input's Now" >&2
  exit 1
fi

say "cairn-core stays pure (no tokio, tonic, prost, etcd-client)"
if cargo tree -p cairn-core -e normal --prefix none --locked | grep -E '^(tokio|tonic|prost|etcd-client) '; then
  echo "error: cairn-core depends on an I/O crate (above); keep the algorithm sans-IO" >&2
  exit 1
fi

say "cargo doc --workspace --no-deps (warnings are errors: broken or private intra-doc links)"
RUSTDOCFLAGS="${RUSTDOCFLAGS:-} -D warnings" cargo doc --workspace --no-deps --locked

if "$static_only"; then
  printf '\ncheck --static: passed in %d s\n' "$((SECONDS - start))"
  exit 0
fi

say "unit tests (cargo test --workspace --lib --bins)"
cargo test --workspace --lib --bins --locked

say "cairn-core's tests (rules, tracker, verifier, doc-tests)"
cargo test -p cairn-core --locked

say "the deterministic simulation (integration-tests/tests/it/simulation.rs)"
cargo test -p cairn-integration-tests --test it simulation:: --locked

printf '\ncheck: passed in %d s\n' "$((SECONDS - start))"
