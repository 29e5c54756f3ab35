#!/usr/bin/env python3
"""Checks that the deployments speak the binaries' real language.

For the Kubernetes manifests (as `kubectl kustomize` builds them, base and external-etcd)
and the docker-compose file (as `docker-compose config` resolves it), every container that
runs a cairn binary is checked against that binary's `--help`:
  - every CAIRN_* environment variable and every --flag it is given is a real one;
  - every port it exposes (containerPort, or a published compose port) is one it listens on
    (the port of a *_LISTEN variable);
  - every probe and healthcheck asks a port it listens on;
  - every Service port targets a port some selected container exposes;
  - a daemon's drain (CAIRN_GRACE_PERIOD) fits in its pod's termination grace period;
  - the coordinator takes a scheduled snapshot every 30 s unless told otherwise.

    deploy/test/check-config.py BIN_DIR
"""
import re
import subprocess
import sys

import yaml

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/debug"
BINARIES = {"cairn-coordinator", "cairn-node", "cairn-bank", "cairnctl"}
errors = []
help_cache = {}


def help_of(binary):
    if binary not in help_cache:
        out = subprocess.run([f"{BIN}/{binary}", "--help"], capture_output=True, text=True, check=True)
        text = out.stdout
        help_cache[binary] = (set(re.findall(r"env: (CAIRN_[A-Z_]+)", text)), set(re.findall(r"(--[a-z][a-z-]*)", text)))
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
        if key.startswith("CAIRN_") and key not in envs:
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


def check_kubernetes(name, text):
    docs = [d for d in yaml.safe_load_all(text) if d]
    container_ports = {}  # selector label -> ports
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        label = doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        pod = doc["spec"]["template"]["spec"]
        for c in pod["containers"]:
            where = f"k8s {name} {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            exposed = {p["containerPort"] for p in c.get("ports", [])}
            container_ports.setdefault(label, set()).update(exposed)
            probed = set()
            for probe in ("readinessProbe", "livenessProbe"):
                if "grpc" in c.get(probe, {}):
                    probed.add(c[probe]["grpc"]["port"])
            command = c.get("command", []) + c.get("args", [])
            check_container(where, command, env, exposed, probed)
            check_schedule(where, command, env)
            if command and command[0] in BINARIES:
                grace = pod.get("terminationGracePeriodSeconds", 30)
                drain = env.get("CAIRN_GRACE_PERIOD")
                if drain and seconds(where, drain) >= grace:
                    errors.append(f"{where}: CAIRN_GRACE_PERIOD {drain} does not fit in terminationGracePeriodSeconds {grace}")
    for doc in docs:
        if doc["kind"] != "Service":
            continue
        label = doc["spec"]["selector"]["app.kubernetes.io/name"]
        for p in doc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            if target not in container_ports.get(label, set()):
                errors.append(f"k8s {name} Service/{doc['metadata']['name']}: port {target} is not a container port of {label}")


def check_compose(text):
    services = yaml.safe_load(text)["services"]
    listening_of = {}
    for name, s in services.items():
        command = s.get("command", [])
        if isinstance(command, str):
            command = command.split()
        env = s.get("environment", {}) or {}
        probed = set()
        test = (s.get("healthcheck") or {}).get("test", [])
        if test[1:3] == ["cairnctl", "health"]:
            probed.add(int(test[3].rsplit(":", 1)[1]))
        listening_of[name] = check_container(f"compose service {name}", command, env, set(), probed)
        check_schedule(f"compose service {name}", command, env)
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
                errors.append(f"compose service {name}: publishes {port}, but nothing there listens on it ({sorted(listening)})")


for overlay in ("base", "external-etcd"):
    text = subprocess.run(["kubectl", "kustomize", f"deploy/k8s/{overlay}"], capture_output=True, text=True, check=True).stdout
    check_kubernetes(overlay, text)
    if overlay == "external-etcd" and "value: http://cairn-etcd:2379" in text:
        errors.append("k8s external-etcd: the coordinator still points at the bundled etcd")
compose = subprocess.run(["docker-compose", "-f", "deploy/docker-compose.yml", "-f", "deploy/docker-compose.faults.yml", "config"],
                         capture_output=True, text=True, check=True).stdout
check_compose(compose)

if errors:
    print("deployment check FAILED:", *errors, sep="\n  ")
    sys.exit(1)
print(f"deployment check: passed ({len(help_cache)} binaries' flags against the Kubernetes manifests and the compose file)")
