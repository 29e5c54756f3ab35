#!/usr/bin/env python3
"""Checks that the deployments speak the binaries' real language.

For the Kubernetes manifests (as `kubectl kustomize` builds them: base, external-etcd,
external-s3, cert-manager-csi, and cert-manager-csi with the monitoring component) and the docker-compose files (as `docker-compose config` resolves them: the
default cluster, and the S3 variant with docker-compose.s3.yml), every container that runs
a cairn binary is checked against that binary's `--help`:
  - every CAIRN_* and AWS_* environment variable and every --flag it is given is a real
    one (an AWS_* one: a variable of --help, or a credential its help names);
  - every port it exposes (containerPort, or a published compose port) is one it listens on
    (the port of a *_LISTEN variable);
  - every probe and healthcheck asks a port it listens on;
  - every Service port targets a port some selected container exposes;
  - a daemon's drain (CAIRN_GRACE_PERIOD) fits in its pod's termination grace period;
  - the coordinator takes a scheduled snapshot every 30 s unless told otherwise;
  - every coordinator and node daemon runs mutual TLS and bearer tokens (CAIRN_TLS_CERT,
    CAIRN_TLS_KEY, CAIRN_TLS_CA, CAIRN_AUTH_TOKENS), and every bank mutual TLS with its
    node's certificate (the first three), each file on a read-only mount of a
    Kubernetes Secret or a compose bind mount; a daemon's application port is on loopback;
  - the coordinator reaches etcd over mutual TLS: CAIRN_ETCD is https:// only, with
    CAIRN_ETCD_CA, CAIRN_ETCD_CERT and CAIRN_ETCD_KEY on read-only mounts as above;
  - etcd (compose, and the bundled one in Kubernetes) serves mutual TLS only: https://
    client URLs, --client-cert-auth, --cert-file/--key-file/--trusted-ca-file on read-only
    mounts, and its probes and healthcheck are etcdctl over TLS with a certificate;
  - in compose, etcd's --trusted-ca-file is a CA of its own: not the file any cairn
    container has as CAIRN_TLS_CA, and the file the coordinator has as CAIRN_ETCD_CA, whose
    CAIRN_ETCD_CERT/KEY are not its CAIRN_TLS_CERT/KEY;
  - an S3 blob store (CAIRN_BLOB_STORE s3://...) is a valid bucket and prefix, with
    AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY given (in Kubernetes from a Secret, by
    secretKeyRef; in compose from an env file, never written in the compose file),
    --s3-allow-http exactly when the endpoint is http://, and every node daemon given a
    store names its coordinator's; a coordinator on S3 mounts no PersistentVolumeClaim
    (it keeps nothing on disk), and no claim is left that no pod mounts.
In every Kubernetes build, each node pod holds its own node's key only:
  - a pod template that may run as several node ids (CAIRN_NODE_ID follows the pod's name,
    or several replicas) mounts no node's Secret (by volume, projected volume, env or
    envFrom); a workload of one pod with an explicit node id mounts that node's Secret and no
    other's; a pod that is no node's (coordinator, etcd) mounts none. A Secret is a node's by
    its certificate's URI SAN cairn://CLUSTER/node/ID where the build has its data
    (dev-certs), else by its name (ID-tls);
  - a csi.cert-manager.io volume of a node pod requests exactly URI cairn://CLUSTER/node/
    ${POD_NAME}, DNS ${POD_NAME} and IP 127.0.0.1, read-only with an fs-group, in a pod
    whose node id is $(POD_NAME); the daemon's and the application's CAIRN_TLS_KEY are on
    that volume or on the pod's own node's Secret;
  - every cairn container of a build runs one image.
And the custom resources, which kubernetes-validate has no schema for (it warns and passes
them; scripts/test.sh fails on any other kind it cannot validate): cert-manager Issuers and
Certificates (known fields, an Issuer of the build, cert-manager's usages and key settings;
each certificate the identity its Secret's pods need, and etcd's from an issuer that issues
no cairn identity), the Prometheus operator's ServiceMonitors (a Service of the build and its
metrics port, https, a client certificate with a role, and a serverName every scraped
certificate carries: the csi volume's dns-names, a Certificate's dnsNames or, in dev-certs,
the Secrets' SANs) and PrometheusRule (its groups equal deploy/monitoring/cairn-rules.yaml's).
And the deployments' exposure:
  - every Kubernetes container runs non-root (as the Dockerfile's user, for the cairn image)
    with a read-only root filesystem, no privilege escalation, every capability dropped and
    the RuntimeDefault seccomp profile (pod or container securityContext);
  - every workload has a NetworkPolicy that selects it, whose ingress rules each name a
    source and ports, and admit exactly the ports its containers expose;
  - every compose port is published on ${CAIRN_BIND:-127.0.0.1} (loopback unless told
    otherwise) except etcd's, on 127.0.0.1 whatever CAIRN_BIND says; etcd is on compose
    networks that only the coordinator shares (no daemon or bank); every compose service has a read-only root filesystem, no capabilities
    and no-new-privileges, and a healthcheck unless it is a job others wait for
    (service_completed_successfully); the S3 server (SeaweedFS, in the S3 variant)
    publishes no port, runs as a non-root user by default and shares its networks with
    the coordinators and node daemons only (and what shares their network namespaces).

And, given DEV_CERTS (a copy of deploy/k8s/dev-certs whose certs/ deploy/make-certs.sh
wrote), that overlay and dev-certs-monitoring beside it: checked as above, and every Secret a pod mounts is one it makes, with
the keys mounted, and each certificate names the identity its pod needs (the coordinator
URI:cairn://cairn/coordinator and DNS:cairn-coordinator, the Service the daemons dial; node
Secret cairn-node-<i>-tls URI:cairn://cairn/node/cairn-node-<i> and DNS:cairn-node-<i>;
etcd's Secret cairn-etcd-tls DNS:cairn-etcd, the host the coordinator dials, and
IP:127.0.0.1, its probes', and no cairn identity); and the CA etcd trusts (ca.crt of
cairn-etcd-tls) is that of Secret cairn-coordinator-etcd-tls, whose certificate it signed
and which names no cairn identity, while no other Secret's certificate (the coordinator's
cairn one, the nodes') chains to it nor has it as ca.crt: only the coordinator reaches etcd.

    deploy/test/check-config.py BIN_DIR [DEV_CERTS]
"""
import base64
import os
import re
import subprocess
import sys
import tempfile

import yaml

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/debug"
DEV_CERTS = sys.argv[2] if len(sys.argv) > 2 else None
BINARIES = {"cairn-coordinator", "cairn-node", "cairn-bank", "cairnctl"}
errors = []
help_cache = {}


def help_of(binary):
    if binary not in help_cache:
        out = subprocess.run([f"{BIN}/{binary}", "--help"], capture_output=True, text=True, check=True)
        text = out.stdout
        # Variables: those --help shows as `[env: NAME]`, and the AWS_* credentials the
        # blob store flags' help names (read from the environment, no flag).
        envs = set(re.findall(r"env: ([A-Z][A-Z0-9_]*)", text)) | set(re.findall(r"\b(AWS_[A-Z0-9_]+)\b", text))
        help_cache[binary] = (envs, set(re.findall(r"(--[a-z][a-z0-9-]*)", text)))
    return help_cache[binary]


def seconds(where, text):
    """A duration as the binaries write it (10s, 500ms, 2m), in seconds."""
    match = re.fullmatch(r"(\d+)(ms|s|m)", text.strip())
    if not match:
        errors.append(f"{where}: cannot read the duration {text!r} (write e.g. 10s or 500ms)")
        return 0
    value, unit = int(match[1]), match[2]
    return value / 1000 if unit == "ms" else value * 60 if unit == "m" else value


def listen_ports(env):
    ports = set()
    for key, value in env.items():
        if key.endswith("_LISTEN") and value:
            ports.add(int(str(value).rsplit(":", 1)[1]))
    return ports


def check_container(where, command, env, exposed, probed):
    binary = command[0]
    if binary not in BINARIES:
        return set()
    envs, flags = help_of(binary)
    for key in env:
        if key.startswith(("CAIRN_", "AWS_")) and key not in envs:
            errors.append(f"{where}: {binary} has no variable {key}")
    for arg in command[1:]:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in flags:
            errors.append(f"{where}: {binary} has no flag {flag}")
    listening = listen_ports(env)
    for port in exposed:
        if port not in listening:
            errors.append(f"{where}: exposes port {port}, but {binary} listens on {sorted(listening)}")
    for port in probed:
        if port not in listening:
            errors.append(f"{where}: probes port {port}, but {binary} listens on {sorted(listening)}")
    return listening


def check_schedule(where, command, env):
    """The deployments snapshot every 30 s unless told otherwise."""
    if not command or command[0] != "cairn-coordinator":
        return
    value = str(env.get("CAIRN_SCHEDULE_INTERVAL", ""))
    default = re.fullmatch(r"\$\{CAIRN_SCHEDULE_INTERVAL:-([^}]*)\}", value)
    if default:
        value = default.group(1)
    if value != "30s":
        errors.append(f"{where}: CAIRN_SCHEDULE_INTERVAL is {value!r}; the deployments snapshot every 30s by default")


SECURE = ("CAIRN_TLS_CERT", "CAIRN_TLS_KEY", "CAIRN_TLS_CA", "CAIRN_AUTH_TOKENS")


ETCD_TLS = ("CAIRN_ETCD_CA", "CAIRN_ETCD_CERT", "CAIRN_ETCD_KEY")


def check_mounted(where, what, path, mounts):
    """`path` is on a read-only mount of a Secret or a bind mount."""
    mount = max((m for m in mounts if path == m[0] or path.startswith(m[0].rstrip("/") + "/")),
                key=lambda m: len(m[0]), default=None)
    if mount is None:
        errors.append(f"{where}: {what} {path} is on no mounted volume")
    elif not mount[1]:
        errors.append(f"{where}: {what} {path} is on a mount that is not read-only ({mount[0]})")
    elif mount[2] is None:
        errors.append(f"{where}: {what} {path} is on {mount[0]}, which is not a Secret or a bind mount")


def flag_values(command):
    """--flag=value and --flag value of a command line, as a dict (a bare --flag: True)."""
    values = {}
    args = list(command[1:])
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        if "=" in arg:
            flag, value = arg.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            flag, value = arg, args[i + 1]
        else:
            flag, value = arg, True
        values[flag] = value
    return values


def check_etcd(where, command, mounts, probes):
    """etcd serves mutual TLS only, from read-only mounts; its probes speak TLS too.

    `probes`: the etcdctl command lines of its probes or healthcheck (another kind of
    probe is an error: none can present a client certificate)."""
    if not command or command[0] != "etcd":
        return
    flags = flag_values(command)
    if flags.get("--client-cert-auth") not in (True, "true"):
        errors.append(f"{where}: etcd runs without --client-cert-auth (any client could read and rewrite cairn's metadata)")
    for flag in ("--listen-client-urls", "--advertise-client-urls"):
        for url in str(flags.get(flag, "")).split(","):
            if not url.startswith("https://"):
                errors.append(f"{where}: etcd {flag} {url!r} is not https://")
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file"):
        path = flags.get(flag)
        if not isinstance(path, str):
            errors.append(f"{where}: etcd runs without {flag}")
        else:
            check_mounted(where, f"etcd {flag}", path, mounts)
    if not probes:
        errors.append(f"{where}: etcd has no probe or healthcheck")
    for probe in probes:
        if probe is None:
            errors.append(f"{where}: an etcd probe that is not etcdctl (nothing else can present a client certificate)")
            continue
        pf = flag_values(probe)
        if not str(pf.get("--endpoints", "")).startswith("https://"):
            errors.append(f"{where}: the etcdctl probe {probe} does not dial https://")
        for flag in ("--cacert", "--cert", "--key"):
            if not isinstance(pf.get(flag), str):
                errors.append(f"{where}: the etcdctl probe {probe} has no {flag}")
            else:
                check_mounted(where, f"probe {flag}", pf[flag], mounts)


def check_secure(where, command, env, mounts):
    """A daemon runs mutual TLS and tokens from read-only mounts; its app port is loopback.

    `mounts`: (target, read-only, what) of the container's mounts, `what` naming the source
    when it is acceptable (a Secret, a bind mount) or None."""
    if not command or command[0] not in ("cairn-coordinator", "cairn-node", "cairn-bank"):
        return
    # A bank is part of its node: mutual TLS with the node's certificate, no tokens file.
    keys = SECURE[:3] if command[0] == "cairn-bank" else SECURE
    for key in keys:
        path = str(env.get(key, ""))
        if not path:
            errors.append(f"{where}: {key} is not set (the deployments run mutual TLS and bearer tokens)")
            continue
        check_mounted(where, key, path, mounts)
    if command[0] == "cairn-coordinator":
        endpoints = [e.strip() for e in str(env.get("CAIRN_ETCD", "")).split(",") if e.strip()]
        if not endpoints:
            errors.append(f"{where}: CAIRN_ETCD is not set (the deployments keep the metadata in etcd)")
        for endpoint in endpoints:
            if not endpoint.startswith("https://"):
                errors.append(f"{where}: CAIRN_ETCD endpoint {endpoint!r} is not https:// (etcd runs mutual TLS)")
        for key in ETCD_TLS:
            path = str(env.get(key, ""))
            if not path:
                errors.append(f"{where}: {key} is not set (the coordinator reaches etcd over mutual TLS)")
            else:
                check_mounted(where, key, path, mounts)
    app = str(env.get("CAIRN_APP_LISTEN", ""))
    if command[0] == "cairn-node" and not app.startswith("127.0.0.1:"):
        errors.append(f"{where}: CAIRN_APP_LISTEN {app!r} is not on loopback (only the application beside the daemon uses it)")


S3_BUCKET = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/[A-Za-z0-9._-]+)*/?")
S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def check_s3(where, command, env, given=None):
    """A coordinator's or daemon's blob store; returns it (None: the default directory).

    `given`: for Kubernetes, how each variable is given ("value", "configMap",
    "secret", "field"): the credentials must come from a Secret."""
    if not command or command[0] not in ("cairn-coordinator", "cairn-node"):
        return None
    flags = flag_values(command)
    store = flags.get("--blob-store") or env.get("CAIRN_BLOB_STORE") or None
    if not isinstance(store, str) or not store.startswith("s3://"):
        return store if isinstance(store, str) else None
    if not S3_BUCKET.fullmatch(store):
        errors.append(f"{where}: the blob store {store!r} is not s3://BUCKET/PREFIX (a bucket is 3 to 63 lowercase letters, digits, dots and hyphens)")
    for key in S3_CREDENTIALS:
        if key not in env:
            errors.append(f"{where}: the blob store {store} has no {key} (the S3 credentials)")
        elif given is not None and given.get(key) != "secret":
            errors.append(f"{where}: {key} is given as a {given.get(key)}, not from a Secret (secretKeyRef)")
    endpoint = flags.get("--s3-endpoint") or env.get("AWS_ENDPOINT_URL") or ""
    plain = isinstance(endpoint, str) and endpoint.startswith("http://")
    allow_http = flags.get("--s3-allow-http") is True
    if plain and not allow_http:
        errors.append(f"{where}: the S3 endpoint {endpoint} is plain HTTP, which {command[0]} refuses without --s3-allow-http")
    if allow_http and not plain:
        errors.append(f"{where}: --s3-allow-http, but the S3 endpoint {endpoint or '(AWS)'} is not http://")
    return store


def check_stores(name, stores):
    """Every node daemon given a store names its coordinator's (it writes chunks there that
    the coordinator reads). `stores`: (binary, where, store) of every container."""
    coordinators = {store for binary, _, store in stores if binary == "cairn-coordinator"}
    for binary, where, store in stores:
        if binary == "cairn-node" and store is not None and store not in coordinators:
            errors.append(f"{where}: writes its chunks to {store}, but the coordinator's store is {sorted(coordinators, key=str)}")


def image_uid():
    """The uid deploy/Dockerfile's runtime stage runs as (its last USER)."""
    users = re.findall(r"^USER\s+(\S+)", open("deploy/Dockerfile").read(), re.M)
    if not users or not users[-1].split(":")[0].isdigit():
        errors.append(f"deploy/Dockerfile: the runtime stage must end with a numeric USER, not {users}")
        return None
    uid = int(users[-1].split(":")[0])
    if uid == 0:
        errors.append("deploy/Dockerfile: the runtime stage runs as root")
    return uid


def check_security_context(where, pod, container, uid):
    """Non-root, read-only root, no escalation, no capabilities, RuntimeDefault seccomp."""
    pod_sc = pod.get("securityContext") or {}
    sc = container.get("securityContext") or {}

    def effective(key):
        return sc.get(key, pod_sc.get(key))

    if effective("runAsNonRoot") is not True:
        errors.append(f"{where}: runAsNonRoot is not true")
    run_as = effective("runAsUser")
    if not isinstance(run_as, int) or run_as == 0:
        errors.append(f"{where}: runAsUser must be a non-root uid, not {run_as!r}")
    elif uid is not None and run_as != uid:
        errors.append(f"{where}: runs as uid {run_as}, but the cairn image's user is {uid} (deploy/Dockerfile)")
    if sc.get("readOnlyRootFilesystem") is not True:
        errors.append(f"{where}: readOnlyRootFilesystem is not true")
    if sc.get("allowPrivilegeEscalation") is not False:
        errors.append(f"{where}: allowPrivilegeEscalation is not false")
    if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
        errors.append(f"{where}: capabilities do not drop ALL")
    if (sc.get("capabilities") or {}).get("add"):
        errors.append(f"{where}: adds capabilities {sc['capabilities']['add']}")
    if (effective("seccompProfile") or {}).get("type") != "RuntimeDefault":
        errors.append(f"{where}: seccompProfile is not RuntimeDefault")
    if sc.get("privileged"):
        errors.append(f"{where}: privileged")


def check_network_policies(name, docs, container_ports):
    """Every workload is selected by a NetworkPolicy admitting exactly its ports."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for label, ports in container_ports.items():
        admitted = set()
        selected = False
        for policy in policies:
            spec = policy["spec"]
            if (spec.get("podSelector") or {}).get("matchLabels", {}).get("app.kubernetes.io/name") != label:
                continue
            selected = True
            where = f"k8s {name} NetworkPolicy/{policy['metadata']['name']}"
            if "Ingress" not in spec.get("policyTypes", []):
                errors.append(f"{where}: does not restrict Ingress")
            for rule in spec.get("ingress", []):
                if not rule.get("from"):
                    errors.append(f"{where}: an ingress rule admits every source (no `from`)")
                if not rule.get("ports"):
                    errors.append(f"{where}: an ingress rule admits every port (no `ports`)")
                for p in rule.get("ports", []):
                    if p["port"] not in ports:
                        errors.append(f"{where}: admits port {p['port']}, which {label} does not expose ({sorted(ports)})")
                    admitted.add(p["port"])
        if not selected:
            errors.append(f"k8s {name}: no NetworkPolicy selects app.kubernetes.io/name={label}")
        elif ports - admitted:
            errors.append(f"k8s {name}: the NetworkPolicies for {label} admit nothing on {sorted(ports - admitted)}")


def env_of(where, container, configmaps):
    """A container's variables (a ConfigMap's key resolved; a Secret's, a field's: "") and
    how each is given."""
    env, sources = {}, {}
    for e in container.get("env", []):
        source = e.get("valueFrom") or {}
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = configmaps.get(ref["name"], {}).get(ref["key"])
            if value is None:
                if not ref.get("optional"):
                    errors.append(f"{where}: {e['name']} names key {ref['key']} of ConfigMap {ref['name']}, which the build lacks")
                continue
            env[e["name"]], sources[e["name"]] = value, "configMap"
        elif "secretKeyRef" in source:
            env[e["name"]], sources[e["name"]] = "", "secret"
        elif source:
            env[e["name"]], sources[e["name"]] = "", "field"
        else:
            env[e["name"]], sources[e["name"]] = e.get("value", ""), "value"
    return env, sources


def check_kubernetes(name, text):
    docs = [d for d in yaml.safe_load_all(text) if d]
    container_ports = {}  # selector label -> ports
    uid = image_uid()
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    stores = []  # (binary, where, blob store) of every cairn container
    claimed = set()  # PersistentVolumeClaims some pod mounts
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        label = doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        pod = doc["spec"]["template"]["spec"]
        for c in pod["containers"]:
            where = f"k8s {name} {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
            env, given = env_of(where, c, configmaps)
            exposed = {p["containerPort"] for p in c.get("ports", [])}
            container_ports.setdefault(label, set()).update(exposed)
            command = c.get("command", []) + c.get("args", [])
            probed = set()
            etcd_probes = []  # etcd's: etcdctl command lines (None: another kind of probe)
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe not in c:
                    continue
                if "grpc" in c[probe]:
                    probed.add(c[probe]["grpc"]["port"])
                exec_command = (c[probe].get("exec") or {}).get("command", [])
                if command[:1] == ["etcd"]:
                    etcd_probes.append(exec_command if exec_command[:1] == ["etcdctl"] else None)
                elif exec_command[:2] == ["cairnctl", "health"]:
                    probed.add(int(exec_command[2].rsplit(":", 1)[1]))
                elif exec_command:
                    errors.append(f"{where}: {probe} runs {exec_command}, not `cairnctl health HOST:PORT`")
            check_security_context(where, pod, c, uid if c.get("image", "").split(":")[0] == "cairn" else None)
            check_container(where, command, env, exposed, probed)
            check_schedule(where, command, env)
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            mounts = []
            for m in c.get("volumeMounts", []):
                v = volumes.get(m["name"], {})
                sources = [s for s in (v.get("projected") or {}).get("sources", [])] if "projected" in v else []
                secret = "secret" in v or (sources and all("secret" in s for s in sources))
                # cert-manager's csi-driver: a certificate issued for the pod, read-only.
                csi = (v.get("csi") or {}).get("driver") == CSI_DRIVER and (v["csi"].get("readOnly") is True)
                mounts.append((m["mountPath"], m.get("readOnly") is True,
                               "Secret" if secret else "cert-manager csi" if csi else None))
            check_secure(where, command, env, mounts)
            check_etcd(where, command, mounts, etcd_probes)
            store = check_s3(where, command, env, given)
            if command and command[0] in ("cairn-coordinator", "cairn-node"):
                stores.append((command[0], where, store))
            if command[:1] == ["cairn-coordinator"] and str(store).startswith("s3://") and env.get("CAIRN_ETCD"):
                for m in c.get("volumeMounts", []):
                    if "persistentVolumeClaim" in volumes.get(m["name"], {}):
                        errors.append(f"{where}: keeps its data in {store} and its metadata in etcd, yet mounts PersistentVolumeClaim "
                                      f"{volumes[m['name']]['persistentVolumeClaim']['claimName']} at {m['mountPath']} (nothing is written there)")
            if command and command[0] in BINARIES:
                grace = pod.get("terminationGracePeriodSeconds", 30)
                drain = env.get("CAIRN_GRACE_PERIOD")
                if drain and seconds(where, drain) >= grace:
                    errors.append(f"{where}: CAIRN_GRACE_PERIOD {drain} does not fit in terminationGracePeriodSeconds {grace}")
        for v in pod.get("volumes", []):
            if "persistentVolumeClaim" in v:
                claimed.add(v["persistentVolumeClaim"]["claimName"])
        for t in doc["spec"].get("volumeClaimTemplates", []):
            claimed.add(t["metadata"]["name"])
    check_stores(f"k8s {name}", stores)
    for doc in docs:
        if doc["kind"] == "PersistentVolumeClaim" and doc["metadata"]["name"] not in claimed:
            errors.append(f"k8s {name} PersistentVolumeClaim/{doc['metadata']['name']}: no pod mounts it")
    check_network_policies(name, docs, container_ports)
    for doc in docs:
        if doc["kind"] != "Service":
            continue
        label = doc["spec"]["selector"]["app.kubernetes.io/name"]
        for p in doc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            if target not in container_ports.get(label, set()):
                errors.append(f"k8s {name} Service/{doc['metadata']['name']}: port {target} is not a container port of {label}")
    check_one_door(name, docs)
    check_node_keys(name, docs)
    check_one_image(name, docs)
    check_custom_resources(name, docs)


def check_one_door(name, docs):
    """One Service reaches every coordinator replica, and any replica answers any call (a
    follower forwards to the leader): the Service selects the replicas' pods whatever their
    role, its gRPC port is the replicas', and no probe keeps a follower out (a readiness
    probe on cairn.v1.Leader would leave only the leader behind the Service)."""
    coordinators = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                    and any((c.get("command") or c.get("args") or [""])[0] == "cairn-coordinator"
                            for c in d["spec"]["template"]["spec"]["containers"])]
    if not coordinators:
        return
    for doc in coordinators:
        where = f"k8s {name} {doc['kind']}/{doc['metadata']['name']}"
        labels = doc["spec"]["template"]["metadata"]["labels"]
        if doc["spec"].get("replicas", 1) < 2:
            errors.append(f"{where}: {doc['spec'].get('replicas', 1)} replica (the one door needs two to mean anything)")
        services = [s for s in docs if s["kind"] == "Service"
                    and all(labels.get(k) == v for k, v in s["spec"].get("selector", {}).items())
                    and any(p["port"] == 7000 for p in s["spec"]["ports"])]
        if len(services) != 1:
            errors.append(f"{where}: {len(services)} Services reach its gRPC port 7000, not one")
        for s in services:
            if s["spec"].get("selector", {}).keys() - {"app.kubernetes.io/name"}:
                errors.append(f"k8s {name} Service/{s['metadata']['name']}: selects by {sorted(s['spec']['selector'])}, "
                              "not every replica")
        for c in doc["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                command = c.get(probe, {}).get("exec", {}).get("command", [])
                if "cairn.v1.Leader" in command:
                    errors.append(f"{where}: its {probe} asks cairn.v1.Leader, which keeps every follower "
                                  "out of the Service; any replica answers every call")


def sans(pem):
    """The subjectAltName of a PEM certificate, as openssl prints it."""
    out = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName"], input=pem,
                         capture_output=True, text=True, check=True).stdout
    return {s.strip() for s in " ".join(out.splitlines()[1:]).split(",") if s.strip()}


def check_secrets(name, text):
    """Every Secret a pod mounts exists, with the keys it mounts and the right identity."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    secrets = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "Secret"}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for v in doc["spec"]["template"]["spec"].get("volumes", []):
            refs = []
            if "secret" in v:
                refs.append((v["secret"]["secretName"], [i["key"] for i in v["secret"].get("items", [])]))
            for source in (v.get("projected") or {}).get("sources", []):
                if "secret" in source:
                    refs.append((source["secret"]["name"], [i["key"] for i in source["secret"].get("items", [])]))
            for secret, keys in refs:
                where = f"k8s {name} {doc['kind']}/{doc['metadata']['name']} volume {v['name']}"
                if secret not in secrets:
                    errors.append(f"{where}: mounts Secret {secret}, which the overlay does not make")
                    continue
                for key in keys or secrets[secret]:
                    if key not in secrets[secret]:
                        errors.append(f"{where}: mounts key {key} of Secret {secret}, which lacks it")
    expected = {"cairn-coordinator-tls": {"URI:cairn://cairn/coordinator", "DNS:cairn-coordinator"},
                "cairn-etcd-tls": {"DNS:cairn-etcd", "IP Address:127.0.0.1"}}
    if "cairn-etcd-tls" not in secrets:
        errors.append(f"k8s {name}: no Secret cairn-etcd-tls (etcd's certificate: make-certs.sh --servers cairn-etcd)")
    for secret in secrets:
        node = re.fullmatch(r"(cairn-node-\d+)-tls", secret)
        if node:
            expected[secret] = {f"URI:cairn://cairn/node/{node[1]}", f"DNS:{node[1]}"}
    for secret, wanted in expected.items():
        if "tls.crt" not in secrets.get(secret, {}):
            continue
        names = sans(base64.b64decode(secrets[secret]["tls.crt"]).decode())
        if wanted - names:
            errors.append(f"k8s {name} Secret/{secret}: the certificate lacks {sorted(wanted - names)} (it has {sorted(names)})")
        if secret in ("cairn-etcd-tls", "cairn-coordinator-etcd-tls") and any(n.startswith("URI:cairn://") for n in names):
            errors.append(f"k8s {name} Secret/{secret}: a certificate of etcd's CA carries a cairn identity ({sorted(names)})")
    check_etcd_trust(name, secrets)


def chains(ca_pem, cert_pem):
    """Whether `cert_pem` chains to `ca_pem` (openssl verify)."""
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/ca.pem", "w") as f:
            f.write(ca_pem)
        with open(f"{d}/cert.pem", "w") as f:
            f.write(cert_pem)
        return subprocess.run(["openssl", "verify", "-CAfile", f"{d}/ca.pem", f"{d}/cert.pem"],
                              capture_output=True).returncode == 0


def check_etcd_trust(name, secrets):
    """etcd trusts a CA of its own: the coordinator's etcd client certificate chains to
    it, no other Secret's certificate does, and no other Secret has it as its ca.crt."""
    where = f"k8s {name}"
    pem = lambda secret, key: base64.b64decode(secrets[secret][key]).decode()
    if "ca.crt" not in secrets.get("cairn-etcd-tls", {}):
        return
    etcd_ca = pem("cairn-etcd-tls", "ca.crt")
    client = "cairn-coordinator-etcd-tls"
    if not {"tls.crt", "tls.key", "ca.crt"} <= set(secrets.get(client, {})):
        errors.append(f"{where}: no Secret {client} with tls.crt, tls.key and ca.crt (the coordinator's client certificate for etcd)")
    else:
        if pem(client, "ca.crt") != etcd_ca:
            errors.append(f"{where} Secret/{client}: its ca.crt is not the CA etcd trusts (cairn-etcd-tls ca.crt)")
        if not chains(etcd_ca, pem(client, "tls.crt")):
            errors.append(f"{where} Secret/{client}: its certificate is not signed by the CA etcd trusts")
    for secret, data in secrets.items():
        if secret in ("cairn-etcd-tls", client):
            continue
        if data.get("ca.crt") and pem(secret, "ca.crt") == etcd_ca:
            errors.append(f"{where} Secret/{secret}: its ca.crt is etcd's CA (etcd must trust a CA of its own, not cairn's)")
        if data.get("tls.crt") and chains(etcd_ca, pem(secret, "tls.crt")):
            errors.append(f"{where} Secret/{secret}: its certificate is signed by the CA etcd trusts, so it can read and rewrite cairn's metadata")


# --- Each node pod holds its own node's key only -------------------------------------------

CSI_DRIVER = "csi.cert-manager.io"
NODE_SECRET = re.compile(r"(cairn-node-\d+)-tls")  # the convention: Secret <node id>-tls
NODE_URI = re.compile(r"URI:cairn://[^/]+/node/(.+)")
ROLE_URI = re.compile(r"cairn://[^/]+/(viewer|operator|admin)/[^/]+")
san_cache = {}


def secret_sans(secrets, secret):
    """The SANs of a Secret's tls.crt in the build (None: not in the build, or no tls.crt)."""
    data = secrets.get(secret) or {}
    if "tls.crt" not in data:
        return None
    if data["tls.crt"] not in san_cache:
        san_cache[data["tls.crt"]] = sans(base64.b64decode(data["tls.crt"]).decode())
    return san_cache[data["tls.crt"]]


def node_of_secret(secrets, known_ids, secret):
    """Whose node key a Secret holds: by its certificate's URI SAN when the build has its
    data (dev-certs), else by its name (<node id>-tls); None: no node's."""
    names = secret_sans(secrets, secret)
    if names is not None:
        owners = [m[1] for n in names if (m := NODE_URI.fullmatch(n))]
        return owners[0] if owners else None
    m = re.fullmatch(r"(.+)-tls", secret)
    if m and (m[1] in known_ids or NODE_SECRET.fullmatch(secret)):
        return m[1]
    return None


def pod_secrets(pod):
    """The Secrets a pod references: (Secret, where): volumes (secret, projected), env
    (secretKeyRef) and envFrom (secretRef) of every container and init container."""
    refs = []
    for v in pod.get("volumes", []):
        if "secret" in v:
            refs.append((v["secret"]["secretName"], f"volume {v['name']}"))
        for source in (v.get("projected") or {}).get("sources", []):
            if "secret" in source:
                refs.append((source["secret"]["name"], f"volume {v['name']}"))
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                refs.append((ref["name"], f"container {c['name']} variable {e['name']}"))
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                refs.append((e["secretRef"]["name"], f"container {c['name']} envFrom"))
    return refs


def node_identity(doc):
    """A workload's node daemon and the id it runs as: (container, id), id None for a
    template that runs as several ids (the id follows the pod's name, $(POD_NAME), or is
    unset); (None, None) for a workload with no node daemon."""
    for c in doc["spec"]["template"]["spec"]["containers"]:
        command = c.get("command", []) + c.get("args", [])
        if command[:1] != ["cairn-node"]:
            continue
        value = next((e.get("value") for e in c.get("env", []) if e["name"] == "CAIRN_NODE_ID"), None)
        value = flag_values(command).get("--node-id", value)
        return c, (value if isinstance(value, str) and value and "$(" not in value else None)
    return None, None


def check_csi_volume(where, v, runs_as):
    """A csi.cert-manager.io volume of a node pod requests the pod's own identity."""
    attrs = v["csi"].get("volumeAttributes") or {}
    uris = [u for u in attrs.get(f"{CSI_DRIVER}/uri-sans", "").split(",") if u]
    dns = [d for d in attrs.get(f"{CSI_DRIVER}/dns-names", "").split(",") if d]
    ips = [i for i in attrs.get(f"{CSI_DRIVER}/ip-sans", "").split(",") if i]
    if len(uris) != 1 or not re.fullmatch(r"cairn://[^/]+/node/\$\{POD_NAME\}", uris[0]):
        errors.append(f"{where}: its {CSI_DRIVER} volume {v['name']} requests URI SANs {uris}, not exactly "
                      "cairn://CLUSTER/node/${POD_NAME} (each pod's own identity, filled in by the driver)")
    if "${POD_NAME}" not in dns:
        errors.append(f"{where}: its {CSI_DRIVER} volume {v['name']} requests DNS names {dns}, without ${{POD_NAME}} "
                      "(the name peers check)")
    if "127.0.0.1" not in ips:
        errors.append(f"{where}: its {CSI_DRIVER} volume {v['name']} requests IP SANs {ips}, without 127.0.0.1 (the probes)")
    if runs_as is not None:
        errors.append(f"{where}: runs as node {runs_as}, but its {CSI_DRIVER} volume names the pod (${{POD_NAME}}): "
                      "give it CAIRN_NODE_ID=$(POD_NAME)")
    if v["csi"].get("readOnly") is not True:
        errors.append(f"{where}: its {CSI_DRIVER} volume {v['name']} is not readOnly")
    if attrs.get(f"{CSI_DRIVER}/fs-group") is None:
        errors.append(f"{where}: its {CSI_DRIVER} volume {v['name']} sets no fs-group (the non-root user could not read its key)")


def check_node_keys(name, docs):
    """No node pod mounts another node's key: a pod template that may run as several node
    ids mounts no node's Secret (its key comes from a csi.cert-manager.io volume naming
    ${POD_NAME}); a workload of one pod with an explicit node id mounts that node's Secret
    and no other; no other pod (coordinator, etcd) mounts a node's Secret; and the daemon's
    and the application's key files are on the pod's own identity."""
    secrets = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "Secret"}
    known = {node_identity(d)[1] for d in docs if d["kind"] in ("Deployment", "StatefulSet")} - {None}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        where = f"k8s {name} {doc['kind']}/{doc['metadata']['name']}"
        pod = doc["spec"]["template"]["spec"]
        node, runs_as = node_identity(doc)
        replicas = doc["spec"].get("replicas", 1)
        if node is not None and runs_as is not None and replicas != 1:
            errors.append(f"{where}: {replicas} pods run as the one node id {runs_as}")
        owners = {}  # Secret -> the node whose key it holds
        for secret, what in pod_secrets(pod):
            owner = node_of_secret(secrets, known, secret)
            if owner is None:
                continue
            owners[secret] = owner
            if node is None:
                errors.append(f"{where}: {what} mounts Secret {secret}, node {owner}'s key, in a pod that is no node's")
            elif runs_as is None:
                errors.append(f"{where}: its pod template runs as several node ids (CAIRN_NODE_ID follows the pod's name), "
                              f"yet {what} mounts Secret {secret}, node {owner}'s key: every pod of it would hold that key")
            elif owner != runs_as:
                errors.append(f"{where}: runs as node {runs_as}, yet {what} mounts Secret {secret}, node {owner}'s key")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for v in volumes.values():
            if (v.get("csi") or {}).get("driver") != CSI_DRIVER:
                continue
            if node is None:
                uris = (v["csi"].get("volumeAttributes") or {}).get(f"{CSI_DRIVER}/uri-sans", "")
                if "/node/" in uris:
                    errors.append(f"{where}: its {CSI_DRIVER} volume {v['name']} requests a node identity ({uris}) in a pod that is no node's")
                continue
            check_csi_volume(where, v, runs_as)
        if node is None:
            continue
        # The daemon's and the application's keys: on the pod's own identity.
        for c in pod["containers"]:
            key = next((e.get("value") for e in c.get("env", []) if e["name"] == "CAIRN_TLS_KEY"), None)
            if not key:
                continue
            mounts = [m for m in c.get("volumeMounts", []) if key.startswith(m["mountPath"].rstrip("/") + "/")]
            mount = max(mounts, key=lambda m: len(m["mountPath"]), default=None)
            v = volumes.get(mount["name"], {}) if mount else {}
            if (v.get("csi") or {}).get("driver") == CSI_DRIVER:
                continue  # checked above: the pod's own identity
            held = {owners.get(s) for s, w in pod_secrets({"volumes": [v]})} if v else set()
            if runs_as is None or held != {runs_as}:
                errors.append(f"{where} container {c['name']}: CAIRN_TLS_KEY {key} is not on a volume of its own node's "
                              f"certificate (it runs as {runs_as or 'the pod name'}; the volume holds {sorted(map(str, held)) or 'no node key'})")


def check_one_image(name, docs):
    """Every cairn container of a build runs one image (an overlay that includes the node
    template itself must set the image the base sets)."""
    images = {}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if (c.get("command") or [""])[0] in BINARIES:
                images.setdefault(c.get("image"), []).append(f"{doc['metadata']['name']}/{c['name']}")
    if len(images) > 1:
        errors.append(f"k8s {name}: the cairn containers run different images: {images}")


# --- Custom resources (cert-manager, the Prometheus operator) --------------------------------
# kubernetes-validate has no schema for these kinds (it warns and passes them), so their
# fields are checked here: the keys each may have (of those cairn uses and their neighbours),
# the values that matter, and what they must say for cairn.
CUSTOM = {
    ("cert-manager.io/v1", "Issuer"): {"ca", "selfSigned", "acme", "vault", "venafi"},
    ("cert-manager.io/v1", "Certificate"): {
        "secretName", "issuerRef", "duration", "renewBefore", "privateKey", "usages", "uris", "dnsNames",
        "ipAddresses", "commonName", "emailAddresses", "subject", "isCA", "secretTemplate",
        "revisionHistoryLimit", "keystores", "literalSubject", "additionalOutputFormats"},
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels", "sampleLimit"},
    ("monitoring.coreos.com/v1", "PrometheusRule"): {"groups"},
}
USAGES = {"signing", "digital signature", "content commitment", "key encipherment", "key agreement",
          "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
          "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
          "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"}
ENDPOINT_KEYS = {"port", "path", "scheme", "interval", "scrapeTimeout", "tlsConfig", "authorization",
                 "bearerTokenSecret", "honorLabels", "relabelings", "metricRelabelings", "params"}
TLS_KEYS = {"ca", "cert", "keySecret", "serverName", "insecureSkipVerify", "minVersion", "maxVersion"}
GO_DURATION = re.compile(r"(\d+(h|m|s|ms))+")


def selected(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_custom_resources(name, docs):
    where0 = f"k8s {name}"
    custom = [d for d in docs if (d.get("apiVersion"), d["kind"]) in CUSTOM]
    for d in docs:
        group = d.get("apiVersion", "").split("/")[0]
        if (d.get("apiVersion"), d["kind"]) not in CUSTOM and group in ("cert-manager.io", "monitoring.coreos.com"):
            errors.append(f"{where0}: {d['apiVersion']} {d['kind']}/{d['metadata']['name']} is a kind this check does not know")
    for d in custom:
        where = f"{where0} {d['kind']}/{d['metadata']['name']}"
        spec = d.get("spec") or {}
        extra = set(spec) - CUSTOM[(d["apiVersion"], d["kind"])]
        if extra:
            errors.append(f"{where}: unknown spec fields {sorted(extra)}")
    issuers = {d["metadata"]["name"]: d.get("spec") or {} for d in custom if d["kind"] == "Issuer"}
    for issuer, spec in issuers.items():
        if len(spec) != 1 or ("ca" in spec and not (spec["ca"] or {}).get("secretName")):
            errors.append(f"{where0} Issuer/{issuer}: needs exactly one kind of issuer (a `ca` with its secretName)")
    certificates = {}  # secretName -> spec
    for d in custom:
        if d["kind"] != "Certificate":
            continue
        where, spec = f"{where0} Certificate/{d['metadata']['name']}", d.get("spec") or {}
        ref = spec.get("issuerRef") or {}
        if not spec.get("secretName"):
            errors.append(f"{where}: no secretName")
        if ref.get("kind", "Issuer") not in ("Issuer", "ClusterIssuer") or not ref.get("name"):
            errors.append(f"{where}: issuerRef {ref} is not an Issuer or ClusterIssuer by name")
        elif ref.get("kind", "Issuer") == "Issuer" and ref["name"] not in issuers:
            errors.append(f"{where}: its Issuer {ref['name']} is not in the build")
        if set(spec.get("usages", [])) - USAGES:
            errors.append(f"{where}: unknown usages {sorted(set(spec.get('usages', [])) - USAGES)}")
        for key in ("duration", "renewBefore"):
            if key in spec and not GO_DURATION.fullmatch(str(spec[key])):
                errors.append(f"{where}: {key} {spec[key]!r} is not a duration (e.g. 2160h)")
        pk = spec.get("privateKey") or {}
        if set(pk) - {"algorithm", "size", "rotationPolicy", "encoding"} or pk.get("algorithm", "RSA") not in ("RSA", "ECDSA", "Ed25519") \
                or pk.get("rotationPolicy", "Never") not in ("Never", "Always") or pk.get("encoding", "PKCS1") not in ("PKCS1", "PKCS8"):
            errors.append(f"{where}: privateKey {pk} is not cert-manager's")
        certificates[spec.get("secretName")] = spec
    check_certificate_identities(where0, certificates, docs)
    for d in custom:
        if d["kind"] == "ServiceMonitor":
            check_service_monitor(where0, d, docs, certificates)
        if d["kind"] == "PrometheusRule":
            source = yaml.safe_load(open("deploy/monitoring/cairn-rules.yaml"))["groups"]
            if (d.get("spec") or {}).get("groups") != source:
                errors.append(f"{where0} PrometheusRule/{d['metadata']['name']}: its spec.groups differ from the groups of "
                              "deploy/monitoring/cairn-rules.yaml (the source of truth: copy them)")


def check_certificate_identities(where0, certificates, docs):
    """Certificates name what their Secrets' pods need, as check_secrets does for files, and
    etcd's come from an issuer of their own."""
    cairn_issuers = set()
    for secret, spec in certificates.items():
        where = f"{where0} Certificate of Secret {secret}"
        uris, dns, ips, usages = spec.get("uris", []), spec.get("dnsNames", []), spec.get("ipAddresses", []), spec.get("usages", [])
        wanted = None
        node = NODE_SECRET.fullmatch(secret or "")
        if secret == "cairn-coordinator-tls":
            wanted = (["cairn://cairn/coordinator"], {"coordinator", "cairn-coordinator"}, {"127.0.0.1"}, {"server auth", "client auth"})
        elif node:
            wanted = ([f"cairn://cairn/node/{node[1]}"], {node[1]}, {"127.0.0.1"}, {"server auth", "client auth"})
        elif secret == "cairn-etcd-tls":
            wanted = ([], {"cairn-etcd"}, {"127.0.0.1"}, {"server auth", "client auth"})
        elif secret == "cairn-coordinator-etcd-tls":
            wanted = ([], set(), set(), {"client auth"})
        if wanted:
            if uris != wanted[0]:
                errors.append(f"{where}: uris {uris}, not {wanted[0]}")
            if wanted[1] - set(dns) or wanted[2] - set(ips) or wanted[3] - set(usages):
                errors.append(f"{where}: lacks {sorted(wanted[1] - set(dns))} {sorted(wanted[2] - set(ips))} {sorted(wanted[3] - set(usages))}")
        if any(u.startswith("cairn://") for u in uris):
            cairn_issuers.add((spec.get("issuerRef") or {}).get("name"))
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for v in d["spec"]["template"]["spec"].get("volumes", []):
                if (v.get("csi") or {}).get("driver") == CSI_DRIVER:
                    cairn_issuers.add((v["csi"].get("volumeAttributes") or {}).get(f"{CSI_DRIVER}/issuer-name"))
    etcd = [certificates[s] for s in ("cairn-etcd-tls", "cairn-coordinator-etcd-tls") if s in certificates]
    etcd_issuers = {(spec.get("issuerRef") or {}).get("name") for spec in etcd}
    if len(etcd_issuers) > 1:
        errors.append(f"{where0}: etcd's certificate and the coordinator's client certificate for it come from different issuers {sorted(etcd_issuers)}")
    if etcd_issuers & cairn_issuers:
        errors.append(f"{where0}: etcd's issuer {sorted(etcd_issuers & cairn_issuers)} also issues cairn identities: they could reach etcd")


def scraped_names(docs, certificates, workload):
    """The DNS names every certificate of a workload's daemon carries, or None where the
    build does not say (its Secret made outside it)."""
    secrets = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "Secret"}
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        if (c.get("command") or [""])[0] not in ("cairn-coordinator", "cairn-node"):
            continue
        cert = next((e.get("value") for e in c.get("env", []) if e["name"] == "CAIRN_TLS_CERT"), "")
        mounts = [m for m in c.get("volumeMounts", []) if cert.startswith(m["mountPath"].rstrip("/") + "/")]
        mount = max(mounts, key=lambda m: len(m["mountPath"]), default=None)
        v = volumes.get(mount["name"], {}) if mount else {}
        if (v.get("csi") or {}).get("driver") == CSI_DRIVER:
            return {d for d in (v["csi"].get("volumeAttributes") or {}).get(f"{CSI_DRIVER}/dns-names", "").split(",") if d}
        secret = (v.get("secret") or {}).get("secretName")
        if secret in certificates:
            return set(certificates[secret].get("dnsNames", []))
        names = secret_sans(secrets, secret) if secret else None
        if names is not None:
            return {n[4:] for n in names if n.startswith("DNS:")}
        # Without the certificate: what every coordinator certificate carries (the daemons check it).
        return {"coordinator"} if c["command"][0] == "cairn-coordinator" else None
    return None


def check_service_monitor(where0, d, docs, certificates):
    """A ServiceMonitor scrapes cairn's metrics port over mutual TLS, checking a server name
    that every scraped certificate carries, with a client certificate of the cluster's CA
    that has a role (/metrics needs viewer)."""
    where, spec = f"{where0} ServiceMonitor/{d['metadata']['name']}", d.get("spec") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    services = [s for s in docs if s["kind"] == "Service" and selected(selector, s["metadata"].get("labels") or {})]
    if not services:
        errors.append(f"{where}: its selector {selector} selects no Service of the build (a Service's own labels)")
    secrets = {s["metadata"]["name"]: s.get("data", {}) for s in docs if s["kind"] == "Secret"}
    for e in spec.get("endpoints", []):
        if set(e) - ENDPOINT_KEYS:
            errors.append(f"{where}: unknown endpoint fields {sorted(set(e) - ENDPOINT_KEYS)}")
        if e.get("scheme") != "https":
            errors.append(f"{where}: scheme {e.get('scheme')!r}, not https (cairn's metrics port serves mutual TLS)")
        tls = e.get("tlsConfig") or {}
        if set(tls) - TLS_KEYS:
            errors.append(f"{where}: unknown tlsConfig fields {sorted(set(tls) - TLS_KEYS)}")
        if tls.get("insecureSkipVerify"):
            errors.append(f"{where}: insecureSkipVerify")
        refs = [(tls.get("ca") or {}).get("secret"), (tls.get("cert") or {}).get("secret"), tls.get("keySecret")]
        if not all(r and r.get("name") and r.get("key") for r in refs):
            errors.append(f"{where}: tlsConfig needs ca, cert and keySecret from a Secret (a client certificate: every port is mutual TLS)")
            continue
        client = refs[1]["name"]
        roles = None
        if client in certificates:
            roles = [u for u in certificates[client].get("uris", []) if ROLE_URI.fullmatch(u)]
        elif secret_sans(secrets, client) is not None:
            roles = [n[4:] for n in secret_sans(secrets, client) if ROLE_URI.fullmatch(n[4:])]
        if roles == []:
            errors.append(f"{where}: its client certificate (Secret {client}) has no role URI (cairn://CLUSTER/viewer/NAME): /metrics answers 401")
        for s in services:
            port = next((p for p in s["spec"]["ports"] if p.get("name") == e.get("port")), None)
            if port is None:
                errors.append(f"{where}: Service {s['metadata']['name']} has no port named {e.get('port')!r}")
                continue
            for w in docs:
                if w["kind"] not in ("Deployment", "StatefulSet") or not selected(s["spec"].get("selector"), w["spec"]["template"]["metadata"].get("labels") or {}):
                    continue
                for c in w["spec"]["template"]["spec"]["containers"]:
                    env = {x["name"]: x.get("value", "") for x in c.get("env", [])}
                    if (c.get("command") or [""])[0] in ("cairn-coordinator", "cairn-node") and \
                            not str(env.get("CAIRN_METRICS_LISTEN", "")).endswith(f":{port.get('targetPort', port['port'])}"):
                        errors.append(f"{where}: port {e.get('port')} of Service {s['metadata']['name']} is not the metrics port of {w['metadata']['name']}")
                names = scraped_names(docs, certificates, w)
                if names is not None and tls.get("serverName") not in names:
                    errors.append(f"{where}: serverName {tls.get('serverName')!r} is not a DNS name of {w['kind']}/{w['metadata']['name']}'s "
                                  f"certificate ({sorted(names)}): every scrape would fail verification")


BIND = "${CAIRN_BIND:-127.0.0.1}:"


def networks_of(services, name):
    """The compose networks a service is on (a network_mode service:X shares X's)."""
    s = services[name]
    mode = str(s.get("network_mode", ""))
    if mode.startswith("service:"):
        return networks_of(services, mode.split(":", 1)[1])
    return set(s.get("networks") or ["default"])


def check_compose_exposure(raw, text, everywhere, label="compose"):
    """Published on loopback unless CAIRN_BIND says otherwise (etcd: always loopback);
    etcd on networks of its own; hardened containers. `everywhere`: the config resolved
    with CAIRN_BIND=0.0.0.0."""
    for name, s in (yaml.safe_load(raw)["services"] or {}).items():
        for p in s.get("ports", []):
            bind = "127.0.0.1:" if name == "etcd" else BIND
            if not isinstance(p, str) or not p.startswith(bind):
                errors.append(f"{label} service {name}: port {p!r} is not published on {bind[:-1]}")
    for name, s in yaml.safe_load(everywhere)["services"].items():
        if (s.get("command") or [""])[0] != "etcd":
            continue
        for p in s.get("ports", []):
            host = p.get("host_ip") if isinstance(p, dict) else str(p).rsplit(":", 2)[0] if str(p).count(":") == 2 else None
            if host != "127.0.0.1":
                errors.append(f"{label} service {name}: with CAIRN_BIND=0.0.0.0 etcd is published on {host or 'every interface'}, not 127.0.0.1")
    services = yaml.safe_load(text)["services"]
    for name, s in services.items():
        if (s.get("command") or [""])[0] != "etcd":
            continue
        mine = networks_of(services, name)
        for other in services:
            if other == name or not mine & networks_of(services, other):
                continue
            if (services[other].get("command") or [""])[0] != "cairn-coordinator":
                errors.append(f"{label} service {other}: shares etcd's network(s) {sorted(mine & networks_of(services, other))}; only the coordinator may")
    for name, s in yaml.safe_load(text)["services"].items():
        for p in s.get("ports", []):
            host = p.get("host_ip") if isinstance(p, dict) else str(p).rsplit(":", 2)[0] if str(p).count(":") == 2 else None
            if host != "127.0.0.1":
                errors.append(f"{label} service {name}: publishes {p!r} on {host or 'every interface'}, not 127.0.0.1 by default")
        if s.get("read_only") is not True:
            errors.append(f"{label} service {name}: read_only is not true")
        if "ALL" not in (s.get("cap_drop") or []):
            errors.append(f"{label} service {name}: cap_drop does not drop ALL")
        if s.get("cap_add"):
            errors.append(f"{label} service {name}: adds capabilities {s['cap_add']}")
        if not any(str(o).replace("=", ":") in ("no-new-privileges:true", "no-new-privileges") for o in s.get("security_opt") or []):
            errors.append(f"{label} service {name}: security_opt lacks no-new-privileges:true")


def check_compose_etcd_trust(text, label="compose"):
    """etcd's --trusted-ca-file is a CA of its own: no cairn container's CAIRN_TLS_CA, and
    the coordinators' CAIRN_ETCD_CA; the coordinators' etcd client certificate is not their
    cairn one. Compared by the bind mounts' sources (the files need not exist)."""
    services = yaml.safe_load(text)["services"]

    def source(s, path):
        for v in s.get("volumes", []):
            if isinstance(v, dict) and v.get("target") == path:
                return v.get("source")
        return None

    trusted = {}
    for name, s in services.items():
        command = s.get("command") or []
        if command[:1] == ["etcd"]:
            path = flag_values(command).get("--trusted-ca-file")
            trusted[name] = source(s, path) if isinstance(path, str) else None
    for etcd, ca in trusted.items():
        if ca is None:
            continue  # check_etcd names it
        for name, s in services.items():
            command, env = s.get("command") or [""], s.get("environment") or {}
            if command[0] not in ("cairn-coordinator", "cairn-node", "cairn-bank"):
                continue
            where = f"{label} service {name}"
            if source(s, env.get("CAIRN_TLS_CA")) == ca:
                errors.append(f"{where}: its CAIRN_TLS_CA is the CA etcd ({etcd}) trusts: every certificate of cairn's CA could reach etcd")
            if command[0] != "cairn-coordinator":
                continue
            if source(s, env.get("CAIRN_ETCD_CA")) != ca:
                errors.append(f"{where}: CAIRN_ETCD_CA is not the CA etcd ({etcd}) trusts ({ca})")
            for key in ("CERT", "KEY"):
                mine = source(s, env.get(f"CAIRN_ETCD_{key}"))
                if mine is not None and mine == source(s, env.get(f"CAIRN_TLS_{key}")):
                    errors.append(f"{where}: CAIRN_ETCD_{key} is its CAIRN_TLS_{key} (etcd's client certificate must be of etcd's CA)")


def check_compose(text, label="compose"):
    services = yaml.safe_load(text)["services"]
    listening_of = {}
    stores = []  # (binary, where, blob store) of every coordinator and daemon
    for name, s in services.items():
        command = s.get("command", [])
        if isinstance(command, str):
            command = command.split()
        env = s.get("environment", {}) or {}
        probed = set()
        test = (s.get("healthcheck") or {}).get("test", [])
        if test[1:3] == ["cairnctl", "health"]:
            probed.add(int(test[3].rsplit(":", 1)[1]))
        listening_of[name] = check_container(f"{label} service {name}", command, env, set(), probed)
        check_schedule(f"{label} service {name}", command, env)
        mounts = []
        for v in s.get("volumes", []):
            if isinstance(v, dict):
                mounts.append((v["target"], v.get("read_only") is True, "bind" if v.get("type") == "bind" else None))
            else:
                parts = str(v).split(":")
                mounts.append((parts[1], parts[2:3] == ["ro"], None))
        check_secure(f"{label} service {name}", command, env, mounts)
        store = check_s3(f"{label} service {name}", command, env)
        if command[:1] in (["cairn-coordinator"], ["cairn-node"]):
            stores.append((command[0], f"{label} service {name}", store))
        if command[:1] == ["etcd"]:
            probe = test[1:] if test[:1] == ["CMD"] and test[1:2] == ["etcdctl"] else None
            check_etcd(f"{label} service {name}", command, mounts, [probe] if test else [])
    for name, s in services.items():
        published = {int(p["target"]) if isinstance(p, dict) else int(str(p).rsplit(":", 1)[1].split("/")[0])
                     for p in s.get("ports", [])}
        if not (s.get("command") or [""])[0] in BINARIES:
            continue
        # A bank sharing this daemon's network namespace listens here too.
        listening = set(listening_of[name])
        for other, o in services.items():
            if o.get("network_mode") == f"service:{name}":
                listening |= listening_of[other]
        for port in published:
            if port not in listening:
                errors.append(f"{label} service {name}: publishes {port}, but nothing there listens on it ({sorted(listening)})")
    check_stores(label, stores)
    check_compose_etcd_trust(text, label)


def check_compose_services(label, raws, text):
    """Healthchecks; S3 credentials never written in a compose file (`raws`: the files'
    text); the S3 server (SeaweedFS) published nowhere, non-root, and on networks shared
    with the coordinators and node daemons only."""
    services = yaml.safe_load(text)["services"]
    jobs = {dep for s in services.values() for dep, cond in (s.get("depends_on") or {}).items()
            if isinstance(cond, dict) and cond.get("condition") == "service_completed_successfully"}
    for name, s in services.items():
        if name not in jobs and not s.get("healthcheck"):
            errors.append(f"{label} service {name}: no healthcheck")
    for raw in raws:
        for name, s in (yaml.safe_load(raw).get("services") or {}).items():
            env = s.get("environment") or {}
            keys = list(env) if isinstance(env, dict) else [str(e).split("=", 1)[0] for e in env]
            for key in S3_CREDENTIALS:
                if key in keys:
                    errors.append(f"{label} service {name}: {key} is written in the compose file (keep it in the env file)")
    for name, s in services.items():
        entrypoint, command = s.get("entrypoint") or [], s.get("command") or []
        line = (entrypoint if isinstance(entrypoint, list) else str(entrypoint).split()) + \
            (command if isinstance(command, list) else str(command).split())
        if line[:1] != ["weed"] or "server" not in line:
            continue
        if s.get("ports"):
            errors.append(f"{label} service {name}: the S3 server publishes {s['ports']} (only the coordinators and daemons use it)")
        if str(s.get("user", "")).split(":")[0] in ("", "0", "root"):
            errors.append(f"{label} service {name}: the S3 server runs as root by default (user {s.get('user')!r})")
        mine = networks_of(services, name)
        for other, o in services.items():
            # One sharing a network namespace (a bank, the bucket job) is where its host is.
            if other == name or str(o.get("network_mode", "")).startswith("service:") or not mine & networks_of(services, other):
                continue
            if (o.get("command") or [""])[0] not in ("cairn-coordinator", "cairn-node"):
                errors.append(f"{label} service {other}: shares the S3 server's network(s) {sorted(mine & networks_of(services, other))}; "
                              "only the coordinators and node daemons may")


def kustomize(path):
    return subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True, check=True).stdout


def with_monitoring(overlay):
    """An overlay with the monitoring component (deploy/k8s/monitoring), built from a
    kustomization in a temporary directory that includes both (by relative paths: kustomize
    refuses absolute ones)."""
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/kustomization.yaml", "w") as f:
            yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                            "resources": [os.path.relpath(overlay, d)],
                            "components": [os.path.relpath("deploy/k8s/monitoring", d)]}, f)
        return kustomize(d)


for overlay in ("base", "external-etcd", "external-s3", "cert-manager-csi"):
    text = kustomize(f"deploy/k8s/{overlay}")
    check_kubernetes(overlay, text)
    if overlay == "external-etcd" and "cairn-etcd:2379" in text:
        errors.append("k8s external-etcd: the coordinator still points at the bundled etcd")
    if overlay == "external-s3" and "s3://" not in text:
        errors.append("k8s external-s3: no container has an s3:// blob store")
    if overlay == "cert-manager-csi" and CSI_DRIVER not in text:
        errors.append(f"k8s cert-manager-csi: no {CSI_DRIVER} volume")
# The monitoring component over the cert-manager overlay: its ServiceMonitors' server names
# against the csi volumes' and Certificates' names, and their client certificate's role.
text = with_monitoring("deploy/k8s/cert-manager-csi")
check_kubernetes("cert-manager-csi + monitoring", text)
if sorted(d["kind"] for d in yaml.safe_load_all(text) if d and d["apiVersion"].startswith("monitoring.coreos.com/")) != \
        ["PrometheusRule", "ServiceMonitor", "ServiceMonitor"]:
    errors.append("k8s monitoring: the component does not add two ServiceMonitors and a PrometheusRule")
if DEV_CERTS:
    text = kustomize(DEV_CERTS)
    check_kubernetes("dev-certs", text)
    check_secrets("dev-certs", text)
    # dev-certs with the monitoring component (the ready overlay beside it in the copy):
    # the server names against the certificates' real SANs.
    text = kustomize(os.path.join(os.path.dirname(os.path.abspath(DEV_CERTS)), "dev-certs-monitoring"))
    check_kubernetes("dev-certs-monitoring", text)
    check_secrets("dev-certs-monitoring", text)
# Resolved with the defaults: no CAIRN_BIND or port variable from the caller's environment.
defaults = {k: v for k, v in os.environ.items() if not (k == "CAIRN_BIND" or re.fullmatch(r"CAIRN_[A-Z0-9]+_PORT", k))}
compose = subprocess.run(["docker-compose", "-f", "deploy/docker-compose.yml", "-f", "deploy/docker-compose.faults.yml", "config"],
                         capture_output=True, text=True, check=True, env=defaults).stdout
everywhere = subprocess.run(["docker-compose", "-f", "deploy/docker-compose.yml", "config"],
                            capture_output=True, text=True, check=True, env={**defaults, "CAIRN_BIND": "0.0.0.0"}).stdout
check_compose(compose)
check_compose_exposure(open("deploy/docker-compose.yml").read(), compose, everywhere)
check_compose_services("compose", [open(f"deploy/{f}").read() for f in ("docker-compose.yml", "docker-compose.faults.yml")], compose)
# The S3 variant: its credentials file, as the header of docker-compose.s3.yml writes it,
# in a directory of its own (CAIRN_CERTS; the certificates need not exist for `config`).
with tempfile.TemporaryDirectory() as certs:
    with open(f"{certs}/s3.env", "w") as f:
        f.write("AWS_ACCESS_KEY_ID=check\nAWS_SECRET_ACCESS_KEY=check-config\n")
    s3_files = ["-f", "deploy/docker-compose.yml", "-f", "deploy/docker-compose.s3.yml"]
    s3 = subprocess.run(["docker-compose", *s3_files, "config"], capture_output=True, text=True, check=True,
                        env={**defaults, "CAIRN_CERTS": certs}).stdout
    s3_everywhere = subprocess.run(["docker-compose", *s3_files, "config"], capture_output=True, text=True, check=True,
                                   env={**defaults, "CAIRN_CERTS": certs, "CAIRN_BIND": "0.0.0.0"}).stdout
check_compose(s3, "compose (S3)")
check_compose_exposure(open("deploy/docker-compose.s3.yml").read(), s3, s3_everywhere, "compose (S3)")
check_compose_services("compose (S3)", [open(f"deploy/{f}").read() for f in ("docker-compose.yml", "docker-compose.s3.yml")], s3)
if not any(str(s.get("environment", {}).get("CAIRN_BLOB_STORE", "")).startswith("s3://")
           for s in yaml.safe_load(s3)["services"].values()):
    errors.append("compose (S3): no service has an s3:// CAIRN_BLOB_STORE")

if errors:
    print("deployment check FAILED:", *errors, sep="\n  ")
    sys.exit(1)
print(f"deployment check: passed ({len(help_cache)} binaries' flags against the Kubernetes manifests"
      f"{' (with the dev-certs Secrets)' if DEV_CERTS else ''} and the compose files, with and without S3)")
