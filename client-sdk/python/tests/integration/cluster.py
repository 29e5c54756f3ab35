"""Real cairn processes for the integration tests, started as ``cairnctl cluster up`` starts
them (``client-sdk/cli/src/local_cluster.rs``): a coordinator, node daemons, and banks
(the Rust ``cairn-bank`` or the Python ``examples/bank.py``), each on free loopback ports,
each in a process group of its own, each logging to a file of its own.

- :class:`Harness` owns the processes and the scratch directory of one test: every process
  is killed (its process group, SIGKILL) when the test ends, pass or fail, and the scratch
  directory removed; the logs stay (``target/python-it-logs/<test>/``, or
  ``CAIRN_IT_LOGS``) and their tails are added to a failing test's report.
- :class:`Cluster` is a coordinator and its nodes, with the calls the tests wait on
  (``NodeAdmin/GetNodeStatus``, the Bank service, the coordinator through the SDK's own
  :class:`~cairn.CoordinatorClient`), optionally with mutual TLS everywhere and bearer
  tokens (``cairnctl certs init``, ``cairnctl auth token``).

Nothing here sleeps to synchronise: :func:`eventually` polls a condition until a deadline,
and fails naming what it waited for, what it last saw, and any process that died meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import pytest

import cairn
from cairn import AppSession, CairnError, CoordinatorClient, Tls
from cairn.bank.v1 import bank_pb2, bank_pb2_grpc
from cairn.v1 import coordinator_pb2, node_admin_pb2, node_admin_pb2_grpc, types_pb2

#: The repository (``client-sdk/python/tests/integration/cluster.py`` is four levels down).
REPO = Path(__file__).resolve().parents[4]
#: The Python package's directory (``client-sdk/python``).
PACKAGE = Path(__file__).resolve().parents[2]
#: The Python bank.
PYTHON_BANK = PACKAGE / "examples" / "bank.py"
#: What a full test run needs; checked before anything starts.
BINARIES = ("cairn-coordinator", "cairn-node", "cairn-bank", "cairnctl")
#: Seconds a cluster may take to come up (registered, wired, applications attached).
READY_TIMEOUT = 45.0
#: The user whose certificate the harness's own clients present in a TLS cluster.
ADMIN = "tester"

T = TypeVar("T")


def bin_dir() -> Path:
    """Where the Rust binaries are: ``CAIRN_BIN_DIR``, or ``<repo>/target/debug``."""
    return Path(os.environ.get("CAIRN_BIN_DIR") or REPO / "target" / "debug")


def binary(name: str) -> Path:
    """The path of binary ``name``; fails the test (never skips it) if it is not built."""
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"{name} is missing from {bin_dir()}: build cairn's binaries first with "
            "`cargo build --workspace --bins` (or point CAIRN_BIN_DIR at them)",
            pytrace=False,
        )
    return path


_GIVEN_PORTS: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (outgoing connections' ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now — one a bind to it succeeds on — never handed out twice
    by this process. As ``cairnctl cluster up`` picks them (``local_cluster.rs``): below the
    kernel's ephemeral range, so that no outgoing connection of the processes already
    running (a daemon reconnecting to a peer that is restarting, say) can take it before its
    own process binds it, as it could take a port the kernel picked for a bind to port 0."""
    high = _ephemeral_low()
    low = min(10_000, high // 2)
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _GIVEN_PORTS:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN_PORTS.add(port)
        return port
    raise RuntimeError("no free port found")


def loopback() -> str:
    """``127.0.0.1:PORT`` with a free port."""
    return f"127.0.0.1:{free_port()}"


_LOOP: asyncio.AbstractEventLoop | None = None


def run(coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
    """Runs a test's body, bounded by ``timeout`` seconds, on the event loop every test of
    this process shares (as ``asyncio.run`` would, but the loop stays open: gRPC's asyncio
    layer binds itself to a loop, and completions of a previous test's calls that arrive
    after its loop closed would fail in the poller, holding back the current loop's); the
    tasks the body left are cancelled when it ends."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    loop = _LOOP

    async def bounded() -> T:
        try:
            return await asyncio.wait_for(coroutine, timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"the test did not finish within {timeout:g} s") from None

    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(bounded())
    finally:
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)


# ---------------------------------------------------------------------- processes


class Process:
    """A child process in a process group of its own, its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str]) -> None:
        """Starts ``argv`` as ``name``, appending its stdout and stderr to ``log``."""
        self.name = name
        self.argv = list(argv)
        self.log = log
        #: Whether the test means it to run (a process the test killed is not a failure).
        self.expected = True
        with open(log, "ab") as out:
            out.write(f"==> {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        """Its process id (and process group id)."""
        return self.popen.pid

    def exited(self) -> int | None:
        """Its exit code if it has exited (negative: killed by that signal)."""
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL to its process group (``kill -9``), then reaps it."""
        self.expected = False
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end
            pass

    def cpu_seconds(self) -> float:
        """User and system CPU time it used so far (Linux ``/proc``; 0 if unknown)."""
        return cpu_seconds(self.pid)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far (0 if unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the command: state is field 3, utime 14 and stime 15 (1-based in proc(5)).
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a started process: no ``CAIRN_`` variables (each process is
    configured by its flags alone, as ``cluster up`` does it), and the ``cairn`` package
    the tests use first on ``PYTHONPATH`` (for the Python bank and helper processes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAIRN_")}
    package_parent = str(Path(cairn.__file__).resolve().parent.parent)
    paths = [package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


#: The harnesses of tests under way (their processes are killed if pytest is stopped).
LIVE: set[Harness] = set()


def close_all(signum: int | None = None, frame: object = None) -> None:
    """Kills the processes of every harness still open; as a signal handler (SIGTERM),
    then dies of the signal as it would have."""
    for harness in list(LIVE):
        harness.close()
    if signum is not None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class Harness:
    """The processes, scratch directory and logs of one test."""

    def __init__(self, name: str) -> None:
        """A harness for the test ``name``: its logs go to ``<logs>/<name>/`` (emptied
        first), its scratch files to a new temporary directory."""
        for needed in BINARIES:
            binary(needed)
        root = Path(os.environ.get("CAIRN_IT_LOGS") or REPO / "target" / "python-it-logs")
        self.logs = root / name
        shutil.rmtree(self.logs, ignore_errors=True)
        self.logs.mkdir(parents=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"cairn-py-it-{name[:40]}-"))
        self.processes: list[Process] = []
        LIVE.add(self)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        """Starts a process (logging to ``<logs>/<name>.log``, appended across restarts)."""
        process = Process(name, argv, self.logs / f"{name}.log", child_env(env))
        self.processes.append(process)
        return process

    def check_alive(self) -> None:
        """Fails naming any process that exited although the test did not stop it."""
        dead = [p for p in self.processes if p.expected and p.exited() is not None]
        if dead:
            for p in dead:
                p.expected = False  # said once
            named = ", ".join(f"{p.name} (exit {p.exited()})" for p in dead)
            raise AssertionError(f"exited unexpectedly: {named}\n{self.tails(dead, 40)}")

    def tails(self, processes: Iterable[Process] | None = None, lines: int = 60) -> str:
        """The last ``lines`` lines of each process's log."""
        out = []
        seen: set[Path] = set()
        for p in processes if processes is not None else self.processes:
            if p.log in seen:
                continue
            seen.add(p.log)
            try:
                text = p.log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"----- {p.log} (last {lines} lines)")
            out.extend(text[-lines:])
        return "\n".join(out)

    def close(self) -> None:
        """Kills every process started (newest first) and removes the scratch directory;
        the logs stay."""
        for p in reversed(self.processes):
            p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
        LIVE.discard(self)


async def eventually(
    what: str,
    check: Callable[[], Awaitable[T]],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    harness: Harness | None = None,
) -> T:
    """Polls ``check`` until it returns without raising (an assertion, a cairn or gRPC error,
    an OS error), for at most ``timeout`` seconds; its result. Fails naming ``what``, the
    last failure, and any process of ``harness`` that died meanwhile."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            return await check()
        except (AssertionError, CairnError, grpc.aio.AioRpcError, OSError, ValueError) as e:
            last = e
        if harness is not None:
            harness.check_alive()
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s (last: {last})")
        await asyncio.sleep(interval)


# ---------------------------------------------------------------------- TLS and tokens


@dataclass
class Security:
    """A secure cluster's files: ``cairnctl certs init``'s certificates (a CA, each node's,
    the coordinator's, the admin user :data:`ADMIN`'s) and a tokens file admitting
    :attr:`token` (an operator's) and :attr:`viewer_token`."""

    certs: Path
    tokens_file: Path
    token: str
    viewer_token: str

    @classmethod
    def create(cls, harness: Harness, nodes: Sequence[str]) -> Security:
        """Writes the certificates and the tokens file into the harness's scratch dir."""
        certs = harness.tmp / "certs"
        cairnctl = str(binary("cairnctl"))
        _check_output(
            [cairnctl, "certs", "init", "--nodes", ",".join(nodes)]
            + ["--users", f"{ADMIN}:admin", "--dir", str(certs)]
        )
        tokens, lines = [], []
        for role in ("operator", "viewer"):
            out = _check_output(
                [cairnctl, "auth", "token", "--role", role, "--name", f"py-it-{role}"]
                + ["-o", "json"]
            )
            made = json.loads(out)
            tokens.append(str(made["token"]))
            lines.append(str(made["line"]))
        tokens_file = harness.tmp / "tokens"
        tokens_file.write_text(
            "# cairn tokens of the Python integration tests\n" + "\n".join(lines) + "\n"
        )
        return cls(certs, tokens_file, tokens[0], tokens[1])

    @property
    def ca(self) -> Path:
        """The CA certificate."""
        return self.certs / "ca.pem"

    def tls_args(self, name: str) -> list[str]:
        """``--tls-cert``, ``--tls-key``, ``--tls-ca`` of certificate ``name``."""
        return [
            "--tls-cert",
            str(self.certs / f"{name}.pem"),
            "--tls-key",
            str(self.certs / f"{name}-key.pem"),
            "--tls-ca",
            str(self.ca),
        ]

    def tls(self, name: str) -> Tls:
        """The SDK's TLS presenting certificate ``name`` (a node id, or :data:`ADMIN`)."""
        return Tls.from_files(self.ca, self.certs / f"{name}.pem", self.certs / f"{name}-key.pem")


def _check_output(argv: list[str]) -> str:
    """Runs a short command; its stdout, or a failure with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=child_env())
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr}")
    return done.stdout


# ---------------------------------------------------------------------- the cluster


@dataclass
class Node:
    """One node: its daemon's addresses and process, and its bank's."""

    id: str
    peer: str
    app: str
    metrics: str
    bank: str
    daemon: Process | None = None
    bank_process: Process | None = None


class Cluster:
    """A coordinator and node daemons (and, when asked, banks), on loopback."""

    def __init__(
        self,
        harness: Harness,
        node_ids: Sequence[str],
        *,
        secure: bool = False,
        coordinator_args: Sequence[str] = (),
        node_args: Sequence[str] = (),
    ) -> None:
        """Describes the cluster; :meth:`start` starts it."""
        self.harness = harness
        self.security = Security.create(harness, node_ids) if secure else None
        self.coordinator = loopback()
        self.coordinator_metrics = loopback()
        self.data_dir = harness.tmp / "coordinator-data"
        self.coordinator_args = list(coordinator_args)
        self.node_args = list(node_args)
        self.nodes: dict[str, Node] = {
            i: Node(i, loopback(), loopback(), loopback(), loopback()) for i in node_ids
        }
        self.coordinator_process: Process | None = None
        self._client: CoordinatorClient | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: list[AppSession] = []

    @classmethod
    async def start(
        cls,
        harness: Harness,
        node_ids: Sequence[str],
        *,
        secure: bool = False,
        coordinator_args: Sequence[str] = (),
        node_args: Sequence[str] = (),
    ) -> Cluster:
        """Starts the coordinator and every daemon, and waits until each daemon is
        registered and wired to every other (a full mesh)."""
        cluster = cls(
            harness,
            node_ids,
            secure=secure,
            coordinator_args=coordinator_args,
            node_args=node_args,
        )
        cluster.start_coordinator()
        for node in node_ids:
            cluster.start_node(node)
        try:
            await cluster.wait_wired()
        except BaseException:
            await cluster.aclose()
            raise
        return cluster

    async def __aenter__(self) -> Cluster:
        """The cluster itself (its processes belong to the harness)."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Closes the harness's connections (the harness kills the processes)."""
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the connections this object opened, and the sessions :meth:`attach`
        opened (a test that failed half way leaves none open: gRPC's event-loop state goes
        with them)."""
        for session in self._sessions:
            await session.close(drain=0)
        self._sessions.clear()
        if self._client is not None:
            await self._client.close()
            self._client = None
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- processes

    def start_coordinator(self) -> Process:
        """Starts (or starts again) the coordinator."""
        argv = [str(binary("cairn-coordinator"))]
        argv += ["--listen", self.coordinator, "--metrics-listen", self.coordinator_metrics]
        argv += ["--data-dir", str(self.data_dir)]
        if self.security is not None:
            argv += self.security.tls_args("coordinator")
            argv += ["--auth-tokens", str(self.security.tokens_file)]
        argv += self.coordinator_args
        self.coordinator_process = self.harness.spawn("coordinator", argv)
        return self.coordinator_process

    def start_node(self, node_id: str) -> Process:
        """Starts (or starts again, on the same addresses) node ``node_id``'s daemon."""
        node = self.nodes[node_id]
        argv = [str(binary("cairn-node")), "--node-id", node.id, "--peer-listen", node.peer]
        argv += ["--app-listen", node.app, "--coordinator", self.coordinator]
        argv += ["--grace-period", "2s", "--metrics-listen", node.metrics]
        if self.security is not None:
            argv += self.security.tls_args(node.id)
            argv += ["--auth-tokens", str(self.security.tokens_file)]
        argv += self.node_args
        node.daemon = self.harness.spawn(f"{node.id}.node", argv)
        return node.daemon

    async def kill_node(self, node_id: str) -> None:
        """``kill -9`` of node ``node_id``'s daemon (its bank, if any, is left alone)."""
        node = self.nodes[node_id]
        if node.daemon is not None:
            node.daemon.kill()
        channel = self._channels.pop(node.peer, None)
        if channel is not None:
            await channel.close()

    def start_rust_bank(
        self, node_id: str, *, workload: float = 0.0, initial_balance: int = 1000
    ) -> Process:
        """Starts the Rust ``cairn-bank`` beside node ``node_id``."""
        node = self.nodes[node_id]
        argv = [str(binary("cairn-bank")), "--node", node.app, "--listen", node.bank]
        argv += ["--initial-balance", str(initial_balance), "--workload", str(workload)]
        if self.security is not None:
            argv += self.security.tls_args(node.id)
        node.bank_process = self.harness.spawn(f"{node.id}.bank", argv)
        return node.bank_process

    def start_python_bank(
        self, node_id: str, *, workload: float = 0.0, initial_balance: int = 1000
    ) -> Process:
        """Starts the Python bank (``examples/bank.py``, this interpreter) beside node
        ``node_id``, as a fresh process."""
        node = self.nodes[node_id]
        argv = [sys.executable, str(PYTHON_BANK), "--node", node.app, "--listen", node.bank]
        argv += ["--initial-balance", str(initial_balance), "--workload", str(workload)]
        argv += ["--log", "info"]
        if self.security is not None:
            argv += self.security.tls_args(node.id)
        node.bank_process = self.harness.spawn(f"{node.id}.pybank", argv)
        return node.bank_process

    def kill_bank(self, node_id: str) -> None:
        """``kill -9`` of node ``node_id``'s bank."""
        process = self.nodes[node_id].bank_process
        if process is not None:
            process.kill()

    # -- clients

    async def attach(self, node_id: str, application: str, **options: Any) -> AppSession:
        """An application's session with node ``node_id``'s daemon
        (:meth:`AppSession.connect` with ``options``; ``retry_for`` 10 s unless given),
        closed by :meth:`aclose` if the test has not closed it."""
        options.setdefault("retry_for", 10.0)
        session = await AppSession.connect(self.nodes[node_id].app, application, **options)
        self._sessions.append(session)
        return session

    def tls(self, name: str) -> Tls | None:
        """TLS presenting certificate ``name`` in a secure cluster; ``None`` otherwise."""
        return self.security.tls(name) if self.security is not None else None

    def _channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a daemon's peer port or a bank (the admin's certificate on TLS)."""
        channel = self._channels.get(address)
        if channel is None:
            if self.security is None:
                channel = grpc.aio.insecure_channel(address)
            else:
                credentials = self.security.tls(ADMIN).channel_credentials()
                channel = grpc.aio.secure_channel(address, credentials)
            self._channels[address] = channel
        return channel

    async def client(self) -> CoordinatorClient:
        """The harness's coordinator client (the admin's certificate on TLS), connected
        once the coordinator answers."""
        if self._client is None:

            async def connect() -> CoordinatorClient:
                return await CoordinatorClient.connect(self.coordinator, tls=self.tls(ADMIN))

            self._client = await eventually(
                "the coordinator answers", connect, harness=self.harness
            )
        return self._client

    async def status(self, node_id: str) -> node_admin_pb2.NodeStatus:
        """``NodeAdmin/GetNodeStatus`` of node ``node_id``'s daemon."""
        stub = node_admin_pb2_grpc.NodeAdminStub(self._channel(self.nodes[node_id].peer))
        return await stub.GetNodeStatus(node_admin_pb2.GetNodeStatusRequest(), timeout=5)

    def bank(self, node_id: str) -> bank_pb2_grpc.BankAsyncStub:
        """The Bank service of node ``node_id``'s bank."""
        return bank_pb2_grpc.BankStub(self._channel(self.nodes[node_id].bank))

    async def balance(self, node_id: str) -> bank_pb2.GetBalanceResponse:
        """Node ``node_id``'s bank's ``GetBalance``."""
        return await self.bank(node_id).GetBalance(bank_pb2.GetBalanceRequest(), timeout=5)

    async def set_workload(self, rate: float, nodes: Iterable[str] | None = None) -> None:
        """Sets every bank's (or ``nodes``' banks') workload; answers once none of the old
        rate is under way."""
        for node_id in nodes if nodes is not None else self.nodes:
            await self.bank(node_id).SetWorkload(bank_pb2.SetWorkloadRequest(rate=rate), timeout=10)

    # -- waiting

    async def wait_wired(
        self,
        nodes: Iterable[str] | None = None,
        *,
        app: bool = False,
        timeout: float = READY_TIMEOUT,
    ) -> None:
        """Waits until each of ``nodes`` (default all) has a channel to and from every other
        node, all up — and, with ``app``, an application attached."""
        want = 2 * (len(self.nodes) - 1)
        for node_id in nodes if nodes is not None else list(self.nodes):

            async def wired(node_id: str = node_id) -> None:
                status = await self.status(node_id)
                up = sum(1 for c in status.channels if c.connected)
                assert len(status.channels) == want and up == want, (
                    f"{node_id}: {up} of {want} channels up ({len(status.channels)} known)"
                )
                assert not app or status.application_attached, f"{node_id}: no application"

            await eventually(f"{node_id} is wired", wired, timeout=timeout, harness=self.harness)

    async def wait_banks_ready(self, nodes: Iterable[str] | None = None) -> None:
        """Waits until each bank (default: every node's) answers and knows every peer, and
        its daemon has it attached."""
        nodes = list(nodes if nodes is not None else self.nodes)
        await self.wait_wired(nodes, app=True)
        for node_id in nodes:

            async def ready(node_id: str = node_id) -> None:
                answer = await self.balance(node_id)
                assert len(answer.peers) == len(self.nodes) - 1, (
                    f"{node_id}'s bank knows {list(answer.peers)}"
                )

            await eventually(
                f"{node_id}'s bank is ready", ready, timeout=READY_TIMEOUT, harness=self.harness
            )

    async def snapshot(
        self,
        mode: str,
        *,
        data: bool = True,
        alignment_timeout_ms: int = 0,
    ) -> coordinator_pb2.Snapshot:
        """Starts a snapshot in ``mode`` through the SDK's coordinator client and waits for
        its end; fails unless it completed. The snapshot (with its data, by default)."""
        client = await self.client()
        snapshot_id = await client.start_snapshot(
            mode, alignment_timeout_ms=alignment_timeout_ms, labels={"test": "python-it"}
        )
        ended = await client.wait_snapshot(snapshot_id)
        assert ended.status == types_pb2.SNAPSHOT_STATUS_COMPLETED, (
            f"snapshot {snapshot_id} ({mode}) did not complete: "
            f"{types_pb2.SnapshotStatus.Name(ended.status)}: {ended.failure}"
        )
        if not data:
            return ended
        return await client.get_snapshot(snapshot_id, include_data=True)


# ---------------------------------------------------------------------- snapshots' data


def recorded(
    snapshot: coordinator_pb2.Snapshot, sender: str, receiver: str, by: str | None = None
) -> list[bytes]:
    """The payloads recorded in flight on channel ``sender``→``receiver`` by node ``by``, or
    by whichever node recorded them (in an unaligned snapshot the receiver records what was
    in its inbox, the sender what was still queued), in the order of the snapshot's parts."""
    out: list[bytes] = []
    for node in snapshot.nodes:
        if by is not None and node.node_id != by:
            continue
        for channel in node.channel_states:
            if getattr(channel.channel, "from") == sender and channel.channel.to == receiver:
                out.extend(m.payload for m in channel.messages)
    return out


def local_state(snapshot: coordinator_pb2.Snapshot, node_id: str) -> bytes:
    """Node ``node_id``'s recorded local state."""
    for node in snapshot.nodes:
        if node.node_id == node_id:
            return node.local_state
    raise AssertionError(f"snapshot {snapshot.plan.snapshot_id} has no part of {node_id}")


def bank_money(snapshot: coordinator_pb2.Snapshot) -> int:
    """The money in a snapshot of banks: every recorded balance (the state JSON's
    ``balance``) plus the amount of every transfer recorded in flight."""
    total = 0
    for node in snapshot.nodes:
        total += int(json.loads(node.local_state)["balance"])
        for channel in node.channel_states:
            for message in channel.messages:
                total += int(json.loads(message.payload)["amount"])
    return total
