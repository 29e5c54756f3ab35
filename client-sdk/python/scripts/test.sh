#!/usr/bin/env bash
# The Python SDK's checks (issue 36): installs the package as a user would (not editable)
# into a virtual environment, type-checks it with mypy --strict (pyproject.toml), then runs
# the unit tests (in-process fakes) and the integration tests (real daemons, a coordinator
# and banks, started from the built binaries), printing how long each stage took.
#
#   client-sdk/python/scripts/test.sh
#
# Needs: python3 (3.10 or later, with venv) and pip's access to PyPI; for the integration
# tests, cairn's binaries built first (`cargo build --workspace --bins`; CAIRN_BIN_DIR names
# another directory than target/debug). Variables: CAIRN_PY_VENV (the environment, default
# target/pyvenv), CAIRN_IT_LOGS (the integration tests' process logs, default
# target/python-it-logs), CAIRN_PY_BENCH_MESSAGES, CAIRN_PY_BENCH_BASELINE=0 (the
# throughput test's size, and leaving out its Rust baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
package=$(pwd)
repo=$(cd ../.. && pwd)
venv="${CAIRN_PY_VENV:-$repo/target/pyvenv}"
export CAIRN_BIN_DIR="${CAIRN_BIN_DIR:-$repo/target/debug}"

started=$SECONDS
stage_started=$SECONDS
timings=()
say() { printf '\n==> [%dm%02ds] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }
done_stage() {
  timings+=("$(printf '%4ds  %s' $((SECONDS - stage_started)) "$1")")
  stage_started=$SECONDS
}

say "virtual environment $venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -c 'import sys; assert sys.version_info >= (3, 10), f"Python {sys.version} is older than 3.10"'
pip=("$py" -m pip --disable-pip-version-check --quiet)
# The package from this directory, built as pip builds it (its build step generates the gRPC
# modules from ../../proto), with what the checks need; grpcio-tools and mypy-protobuf
# generate the same modules into the working tree for mypy, which checks the source here.
# (pip builds and reinstalls a local directory whatever version is installed: the tests run
# against this tree's code; a previous build's directory goes first, so that nothing stale
# of it gets into the wheel.)
rm -rf "$package/build"
"${pip[@]}" install "$package[dev]" pytest grpcio-tools mypy-protobuf
# (From another directory: `python -c` puts the working directory, this one, first.)
(cd / && "$py" -c 'import cairn, cairn.v1.app_pb2; print("installed:", cairn.__version__, cairn.__file__)')
done_stage "install (pip install ./client-sdk/python[dev])"

say "mypy --strict (pyproject.toml: cairn, examples, tests)"
"$py" scripts/gen_protos.py >/dev/null
"$venv/bin/mypy"
done_stage "mypy --strict"

say "unit tests (pytest tests/unit: in-process fakes)"
# From this directory: `pytest` puts the test directories on sys.path, not this one, so
# the tests import the installed package.
"$venv/bin/pytest" -q -p no:cacheprovider --durations=5 tests/unit
done_stage "unit tests"

say "integration tests (pytest tests/integration: real daemons from $CAIRN_BIN_DIR)"
for binary in cairn-coordinator cairn-node cairn-bank cairnctl cairn-bench; do
  if [ ! -x "$CAIRN_BIN_DIR/$binary" ]; then
    echo "error: $binary is missing from $CAIRN_BIN_DIR: build the binaries first with \`cargo build --workspace --bins\`" >&2
    exit 1
  fi
done
"$venv/bin/pytest" -v -rP -p no:cacheprovider --durations=0 tests/integration
done_stage "integration tests"

say "the Python SDK's checks passed"
printf '%s\n' "${timings[@]}"
printf '%4ds  total\n' $((SECONDS - started))
