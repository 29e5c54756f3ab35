#!/usr/bin/env bash
# The nemesis checker's mutation check: builds a daemon with deliberately broken behaviours
# (cargo feature `mutants` of cairn-node; see node/src/mutants.rs), runs cairn-nemesis with
# each one planted, and fails unless the checker reports, for every mutant, the violations
# that bug must leave. A checker that passes a broken build proves nothing about a sound one.
#
#   record-one-too-few       the recording leaves out a channel's last in-flight message: cairn's
#                            own verifier fails those snapshots as inconsistent, a verdict the
#                            checker counts as a violation
#   record-wrong-message     a channel's second recorded message has the first one's bytes:
#                            every index is there, but one message's bytes twice and another's
#                            not at all; cairn's verifier cannot see it; the checker must, from
#                            the transfer ids in the data
#   drop-frame-on-reconnect  a channel drops its first data frame after a reconnect: the
#                            receiving bank's ids skip one, and the drained banks disagree
#
#   scripts/nemesis-mutants.sh            # every mutant, 30 s of faults each
#   CAIRN_MUTANT_SECONDS=60 scripts/nemesis-mutants.sh
#
# Needs what cairn-nemesis needs (the binaries, etcd). The mutant daemon is written to
# target/debug/cairn-node-mutants; target/debug/cairn-node is rebuilt without the mutants
# before any run, so no other test ever runs a mutant. Each run's history and output stay in
# target/nemesis-mutant-<name>.{jsonl,log}.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${CAIRN_MUTANT_SECONDS:-30}"
# Each mutant with the evidence (an extended regex over the violations) it must leave.
declare -A evidence=(
  [record-one-too-few]='failed as inconsistent|in neither state nor channel'
  [record-wrong-message]='in neither state nor channel|already counts it'
  [drop-frame-on-reconnect]='skipped|transfers lost'
)
mutants=(record-one-too-few record-wrong-message drop-frame-on-reconnect)

# Built over the whole workspace with one test target, so that features resolve as in
# scripts/test.sh's `cargo build --workspace --bins --tests` (dev-dependencies included): only
# cairn-node is compiled again, not tokio and tonic (`-p cairn-node` alone resolves its own).
echo "building the mutant daemon (cargo build --features cairn-node/mutants)"
cargo build --workspace --bin cairn-node --test coordinator_ha --features cairn-node/mutants --locked
cp target/debug/cairn-node target/debug/cairn-node-mutants
# The daemon every other test runs, as scripts/test.sh built it.
cargo build --workspace --bins --tests --locked
if cmp -s target/debug/cairn-node target/debug/cairn-node-mutants; then
  echo "error: target/debug/cairn-node is still the mutant build" >&2
  exit 1
fi

# One run at a time: each is timing-sensitive (a mutant must leave its evidence within 30 s
# of faults), and three clusters at once on two cores starve each other (tried: a run that
# never completed a first snapshot, a reconnect that never came). Each run's exit status is
# kept; the trap stops a run still going if the script is stopped.
pid=""
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi' EXIT
declare -A ended=()
for mutant in "${mutants[@]}"; do
  echo "mutant $mutant: cairn-nemesis --mutant $mutant --seconds $seconds"
  CAIRN_BINARY_CAIRN_NODE=target/debug/cairn-node-mutants \
    target/debug/cairn-nemesis --mutant "$mutant" --seconds "$seconds" --seed 1 \
    --history "target/nemesis-mutant-$mutant.jsonl" >"target/nemesis-mutant-$mutant.log" 2>&1 &
  pid=$!
  code=0
  wait "$pid" || code=$?
  pid=""
  ended[$mutant]=$code
done

status=0
for mutant in "${mutants[@]}"; do
  log="target/nemesis-mutant-$mutant.log"
  if [ "${ended[$mutant]}" -eq 0 ]; then
    echo "error: the checker found nothing wrong with mutant $mutant (see $log)" >&2
    status=1
  elif ! grep -q '^verdict: [0-9]* violations' "$log"; then
    # Exit 1 without a verdict is a run that broke, not a catch.
    echo "error: the run with mutant $mutant did not reach the checker (see $log):" >&2
    tail -5 "$log" >&2
    status=1
  elif ! grep '^VIOLATION' "$log" | grep -Eq "${evidence[$mutant]}"; then
    echo "error: mutant $mutant failed the run, but not with the violations it must leave" \
      "(/${evidence[$mutant]}/; see $log):" >&2
    grep '^VIOLATION' "$log" | head -5 >&2
    status=1
  else
    # Two kinds of catch: cairn's own verifier failed a snapshot as inconsistent (the checker
    # counts that verdict as a violation), or the checker's own checks of the banks' data.
    verdicts=$(sed -n 's/^VIOLATION: \([0-9]*\) snapshots in all failed as inconsistent$/\1/p' "$log")
    [ -n "$verdicts" ] || verdicts=$(grep -c 'failed as inconsistent' "$log" || true)
    own=$(grep '^VIOLATION' "$log" | grep -Evc 'failed as inconsistent|proves little|snapshot completed$' || true)
    echo "  caught: $(grep '^verdict:' "$log") ($verdicts snapshots failed as inconsistent;" \
      "$own violations from the checker's own checks of the data)"
    { grep '^VIOLATION' "$log" | grep -Ev 'failed as inconsistent|proves little' | head -2 || true
      grep '^VIOLATION' "$log" | grep 'failed as inconsistent' | head -1 || true; } |
      sed 's/^/  /' | cut -c1-240
  fi
done
exit "$status"
