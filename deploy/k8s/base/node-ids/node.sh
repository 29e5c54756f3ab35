#!/usr/bin/env bash
# The node ids of the base: one StatefulSet of one pod per id, each mounting the Secret of
# its own id only (cairn-node-<i>-tls), so that no node pod holds another node's key. A
# StatefulSet has a single pod template, so one StatefulSet for every id would have to mount
# every id's Secret; hence one per id, each a directory here made from ../node-template.
#
#   deploy/k8s/base/node-ids/node.sh add [I]     write cairn-node-I/ (default: the next free
#                                                ordinal) and list it in kustomization.yaml
#   deploy/k8s/base/node-ids/node.sh remove I    unlist cairn-node-I and delete its directory
#   deploy/k8s/base/node-ids/node.sh list        the ids listed
#
# It edits files only; `kubectl apply -k` (of the base or your overlay) then creates the
# node's StatefulSet. A new node needs its certificate first, in Secret cairn-node-I-tls
# (tls.crt, tls.key, ca.crt): a cert-manager Certificate, a Secret from your CA, or a
# dev-certs entry (README, Kubernetes). Removing one from the files does not delete its
# StatefulSet from the cluster (kubectl apply does not prune): see README, Kubernetes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
list=$here/kustomization.yaml
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 64; }

ids() { sed -n 's/^  - \(cairn-node-[0-9][0-9]*\)$/\1/p' "$list"; }

case ${1:-} in
  list) ids ;;
  add)
    if [ -n "${2:-}" ]; then
      i=$2
    else
      i=0
      while ids | grep -qx "cairn-node-$i"; do i=$((i + 1)); done
    fi
    [[ $i =~ ^[0-9]+$ ]] || { echo "error: the ordinal must be a number, not $i" >&2; exit 64; }
    id=cairn-node-$i
    ! ids | grep -qx "$id" || { echo "error: $id is listed already" >&2; exit 1; }
    mkdir -p "$here/$id"
    cat >"$here/$id/kustomization.yaml" <<EOF
# Node $id (written by node.sh): the node pod template as StatefulSet $id, one pod
# ($id-0), with the explicit node id $id and only its own Secret, $id-tls,
# at /etc/cairn/tls. The label app.kubernetes.io/instance keeps each StatefulSet's selector
# to its own pod. The test ops make the build fail if the template's env order changes.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../../node-template
nameSuffix: "-$i"
labels:
  - pairs:
      app.kubernetes.io/instance: $id
    includeSelectors: true
    includeTemplates: true
patches:
  - target:
      kind: StatefulSet
      name: cairn-node
    patch: |-
      - op: test
        path: /spec/template/spec/containers/0/env/2/name
        value: CAIRN_NODE_ID
      - op: replace
        path: /spec/template/spec/containers/0/env/2/value
        value: $id
      - op: add
        path: /spec/template/spec/volumes/-
        value:
          name: tls
          secret:
            secretName: $id-tls
            defaultMode: 0440
EOF
    printf '  - %s\n' "$id" >>"$list"
    echo "wrote $here/$id; now give it Secret $id-tls, then kubectl apply -k"
    ;;
  remove)
    [ -n "${2:-}" ] || usage
    id=cairn-node-$2
    ids | grep -qx "$id" || { echo "error: $id is not listed" >&2; exit 1; }
    sed -i "/^  - $id\$/d" "$list"
    rm -r "${here:?}/$id"
    echo "removed $id from the files; in the cluster: kubectl delete statefulset $id, then cairnctl nodes remove $id"
    ;;
  *) usage ;;
esac
