#!/usr/bin/env bash
# Everything a cairn cluster needs for mutual TLS and bearer tokens, in one command: a
# development CA and every certificate (`cairnctl certs init`), and an admin token.
#
#   deploy/make-certs.sh DIR --nodes ID,ID,... [--users NAME:ROLE,...] [--san HOST,...]
#                            [--node-san HOST,...] [--servers NAME,...] [--cluster NAME] [--force]
#
#   docker-compose:  deploy/make-certs.sh deploy/certs --nodes n1,n2,n3 --users admin:admin --servers etcd
#   Kubernetes:      deploy/make-certs.sh deploy/k8s/dev-certs/certs --san cairn-coordinator \
#                      --nodes cairn-node-0,cairn-node-1,cairn-node-2 --node-san cairn-node \
#                      --users admin:admin,prometheus:viewer --servers cairn-etcd
#
# --node-san HOST adds DNS:HOST to every node's certificate, beside its own DNS:ID: a name
# that all nodes share, for a scraper that checks one server name for every daemon
# (Prometheus' tls_config server_name is one per scrape job; in Kubernetes the monitoring
# component's ServiceMonitor checks DNS:cairn-node, the nodes' headless Service). Peers
# still check DNS:ID, so it lets no node pass for another. `cairnctl certs init` writes
# the certificates; with --node-san this script then issues each node's anew with openssl
# from the same CA, key, subject, validity end and extensions, plus the names given.
#
# --servers NAME writes NAME.pem and NAME-key.pem for a server that is not a cairn process:
# etcd, which serves mutual TLS with it (DNS:NAME, DNS:localhost, IP:127.0.0.1, no cairn
# identity). NAME is the host name its clients dial: `etcd` in compose, the Service
# `cairn-etcd` in Kubernetes. That certificate is signed by a CA of etcd's own
# (etcd-ca.pem, etcd-ca-key.pem), not the cluster's CA, and so is the one client
# certificate etcd admits: the coordinator's (coordinator-etcd.pem, coordinator-etcd-key.pem;
# CN coordinator). etcd's --trusted-ca-file is etcd-ca.pem: no node's, person's or tool's
# certificate (all of ca.pem) reaches it.
#
# The flags after DIR go to `cairnctl certs init --dir DIR` (see its --help). Then it
# writes DIR/tokens, the --auth-tokens file admitting one new token with role admin (the
# file holds its SHA-256 only), and DIR/admin.token, the token itself (0600): use it as
# `grpcurl -H "authorization: Bearer $(cat DIR/admin.token)"` or CAIRN_TOKEN. Existing
# files are kept (an error) unless --force.
#
# Permissions: DIR is made 0700, so on this host only you reach its files; within it the
# coordinator's (coordinator-key.pem and, with --servers, coordinator-etcd-key.pem), the
# nodes' and the servers' (etcd's) keys are made 0644, because the containers run as
# another uid (10001 in the image of deploy/Dockerfile; etcd's root has no capabilities, so
# no CAP_DAC_OVERRIDE) and compose mounts each file by itself, so a container sees the
# file's own mode, not DIR's. The CAs' keys (ca-key.pem, etcd-ca-key.pem: never mounted
# anywhere) and the users' keys stay 0600.
#
# cairnctl is $CAIRNCTL, or the one on PATH (cargo build --bins: target/debug/cairnctl).
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 64; }
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || usage
dir=$1; shift
cairnctl=${CAIRNCTL:-cairnctl}
command -v "$cairnctl" >/dev/null ||
  { echo "error: $cairnctl not found: cargo build --bins, then put target/debug on PATH or set CAIRNCTL" >&2; exit 1; }

# The node ids, the servers' names, and whether --force was given (the flags cairnctl reads);
# --node-san is this script's own and is not passed on.
nodes=() servers=() node_sans=() force=false
args=() given=("$@")
for ((i = 0; i < ${#given[@]}; i++)); do
  case ${given[i]} in
    --node-san) IFS=, read -r -a more <<<"${given[i + 1]:-}"; node_sans+=("${more[@]}"); i=$((i + 1)); continue ;;
    --node-san=*) IFS=, read -r -a more <<<"${given[i]#--node-san=}"; node_sans+=("${more[@]}"); continue ;;
  esac
  args+=("${given[i]}")
done
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --nodes) IFS=, read -r -a more <<<"${args[i + 1]:-}"; nodes+=("${more[@]}") ;;
    --nodes=*) IFS=, read -r -a more <<<"${args[i]#--nodes=}"; nodes+=("${more[@]}") ;;
    --servers) IFS=, read -r -a more <<<"${args[i + 1]:-}"; servers+=("${more[@]}") ;;
    --servers=*) IFS=, read -r -a more <<<"${args[i]#--servers=}"; servers+=("${more[@]}") ;;
    --force) force=true ;;
  esac
done
if [ "$force" = false ]; then
  for f in tokens admin.token; do
    [ ! -e "$dir/$f" ] || { echo "error: $dir/$f exists; give --force to overwrite" >&2; exit 1; }
  done
fi

"$cairnctl" certs init --dir "$dir" "${args[@]}"
chmod 700 "$dir"
# --node-san: each node's certificate again, with the shared names added.
if [ ${#node_sans[@]} -gt 0 ]; then
  command -v openssl >/dev/null || { echo "error: --node-san needs openssl" >&2; exit 1; }
  extra=$(printf ',DNS:%s' "${node_sans[@]}")
  for node in "${nodes[@]}"; do
    pem=$dir/$node.pem
    have=$(openssl x509 -in "$pem" -noout -ext subjectAltName | tail -n +2 | sed 's/IP Address:/IP:/g; s/ //g')
    end=$(date -d "$(openssl x509 -in "$pem" -noout -enddate | cut -d= -f2)" +%s)
    days=$(( (end - $(date +%s)) / 86400 ))
    work=$(mktemp -d)
    printf '%s\n' "subjectAltName=$have$extra" "keyUsage=critical,digitalSignature" \
      "extendedKeyUsage=serverAuth,clientAuth" "basicConstraints=critical,CA:FALSE" \
      "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid" > "$work/ext"
    openssl x509 -x509toreq -in "$pem" -key "$dir/$node-key.pem" -out "$work/req.pem" 2>/dev/null
    openssl x509 -req -in "$work/req.pem" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" -days "$days" \
      -extfile "$work/ext" -out "$pem" 2>/dev/null
    rm -r "$work"
  done
  echo "added ${node_sans[*]} to the certificates of ${nodes[*]}"
fi
keys=(coordinator "${nodes[@]}" "${servers[@]}")
[ ${#servers[@]} -eq 0 ] || keys+=(coordinator-etcd)
for key in "${keys[@]}"; do chmod 644 "$dir/$key-key.pem"; done

out=$("$cairnctl" auth token --role admin --name admin)
token=$(sed -n 's/^token: //p' <<<"$out")
line=$(tail -n 1 <<<"$out")
[[ -n $token && $line == "admin "* ]] || { echo "error: cannot read cairnctl auth token's output: $out" >&2; exit 1; }
(umask 077 && printf '%s\n' "$token" > "$dir/admin.token")
printf '# ROLE SHA256HEX NAME (cairnctl auth token --role ROLE adds a token: append its line)\n%s\n' "$line" > "$dir/tokens"
chmod 644 "$dir/tokens"
echo "wrote $dir/tokens (one admin token) and $dir/admin.token (the token: keep it secret)"
