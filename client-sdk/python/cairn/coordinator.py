"""A client of the coordinator's ``cairn.v1.Coordinator`` service: the read and admin calls
scripts make (start, get, list, watch, abort, delete and verify snapshots; restore and
follow restores; members, policy, leadership).

It behaves as the Rust SDK's ``CoordinatorClient``: it finds the leading replica of a
highly available coordinator through the gRPC health service, sends a bearer token on every
call, speaks mutual TLS (checking that the certificate names ``coordinator``), and retries
``StartSnapshot`` with one request id when the answer is lost to a leader change.

::

    async with await CoordinatorClient.connect("127.0.0.1:7000", token=token, tls=tls) as c:
        snapshot_id = await c.start_snapshot("unaligned")
        async for progress in c.watch_snapshot(snapshot_id):
            print(progress.status, progress.recorded)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TypeAlias, TypeVar

import grpc

from . import health
from ._channel import open_channel
from .addresses import LEADER_SERVICE, leader_in, parse_addresses
from .errors import ConnectError, ProtocolError, RpcError
from .tls import Tls
from .v1 import coordinator_pb2 as pb
from .v1 import coordinator_pb2_grpc, types_pb2

__all__ = [
    "COORDINATOR_NAME",
    "ELECTION_WAIT",
    "START_ATTEMPTS",
    "CoordinatorClient",
    "new_request_id",
]

_log = logging.getLogger("cairn.coordinator")

#: How many times :meth:`CoordinatorClient.start_snapshot` asks, with one request id, while
#: the answer is lost to a leader change.
START_ATTEMPTS = 4
#: Seconds connecting waits for a replica to lead while every reachable one follows (an
#: election), before it settles for a follower.
ELECTION_WAIT = 10.0
#: Seconds one replica has to accept a connection and answer the health check.
PROBE_TIMEOUT = 5.0
#: The name every coordinator replica's certificate carries (``DNS:coordinator``), checked
#: whatever address is dialed.
COORDINATOR_NAME = "coordinator"
#: Most pages :meth:`CoordinatorClient.iter_snapshots` reads (a guard against a server
#: that hands out page tokens forever).
MAX_PAGES = 100_000

SnapshotModeArg: TypeAlias = "types_pb2.SnapshotMode.ValueType | str"
SnapshotStatusArg: TypeAlias = "types_pb2.SnapshotStatus.ValueType | str"

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def new_request_id() -> str:
    """A fresh request id for ``StartSnapshot``: a random UUID (version 4)."""
    return str(uuid.uuid4())


def snapshot_mode(mode: SnapshotModeArg) -> types_pb2.SnapshotMode.ValueType:
    """A snapshot mode from its value or name: ``"unaligned"``, ``"aligned"``,
    ``"chandy-lamport"`` (or ``"SNAPSHOT_MODE_UNALIGNED"``…)."""
    if not isinstance(mode, str):
        return mode
    name = mode.strip().upper().replace("-", "_")
    if not name.startswith("SNAPSHOT_MODE_"):
        name = "SNAPSHOT_MODE_" + name
    try:
        return types_pb2.SnapshotMode.Value(name)
    except ValueError:
        raise ValueError(
            f"unknown snapshot mode {mode!r}: chandy-lamport, unaligned or aligned"
        ) from None


def snapshot_status(status: SnapshotStatusArg) -> types_pb2.SnapshotStatus.ValueType:
    """A snapshot status from its value or name: ``"completed"``, ``"failed"``…"""
    if not isinstance(status, str):
        return status
    name = status.strip().upper().replace("-", "_")
    if not name.startswith("SNAPSHOT_STATUS_"):
        name = "SNAPSHOT_STATUS_" + name
    try:
        return types_pb2.SnapshotStatus.Value(name)
    except ValueError:
        raise ValueError(
            f"unknown snapshot status {status!r}: in_progress, completed, failed or aborted"
        ) from None


def _bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` metadata of ``token`` (trimmed); none without one."""
    if token is None:
        return ()
    value = f"Bearer {token.strip()}"
    if not all(c == "\t" or " " <= c <= "~" for c in value):
        raise ValueError("the token holds characters a header cannot carry")
    return (("authorization", value),)


def _identity(data: bytes) -> bytes:
    """Bytes as they are (the health messages are encoded by hand)."""
    return data


@dataclass
class _Probe:
    """What one replica said when asked whether it leads."""

    channel: grpc.aio.Channel | None
    leads: bool = False
    hint: str | None = None
    why: str = ""


async def _probe(address: str, tls: Tls | None) -> _Probe:
    """Connects to ``address`` and asks it whether it leads, within
    :data:`PROBE_TIMEOUT`."""
    try:
        channel = open_channel(address, tls, server_name=COORDINATOR_NAME if tls else None)
    except ConnectError as e:
        return _Probe(None, why=e.reason)
    check = channel.unary_unary(
        health.CHECK, request_serializer=_identity, response_deserializer=_identity
    )
    try:
        call = check(health.encode_request(LEADER_SERVICE), timeout=PROBE_TIMEOUT)
        status = health.decode_response(await call)
        if status == health.ServingStatus.SERVING:
            return _Probe(channel, leads=True)
        return _Probe(channel, hint=leader_in(await call.initial_metadata()))
    except grpc.aio.AioRpcError as e:
        # A coordinator that does not know the service (one from before high availability,
        # or on the embedded store), or has no health service at all, leads.
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
            return _Probe(channel, leads=True)
        await channel.close()
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return _Probe(None, why=f"no answer within {PROBE_TIMEOUT:g} s")
        return _Probe(None, why=f"the health check failed: {e.code().name}: {e.details()}")
    except ValueError as e:
        await channel.close()
        return _Probe(None, why=f"the health check's answer is malformed: {e}")


async def _ask_each(
    candidates: list[str], tls: Tls | None
) -> tuple[
    tuple[str, grpc.aio.Channel] | None, tuple[str, grpc.aio.Channel] | None, list[tuple[str, str]]
]:
    """One pass over ``candidates``: the leader, or else the first replica that answered
    and why each other did not. A leader a follower names is asked at once (each named
    one once). Channels not returned are closed."""
    follower: tuple[str, grpc.aio.Channel] | None = None
    unreachable: list[tuple[str, str]] = []
    asked: list[str] = []

    async def settle(address: str, found: _Probe) -> None:
        """Keeps the first follower's channel; closes any later one's."""
        nonlocal follower
        assert found.channel is not None
        if follower is None:
            follower = (address, found.channel)
        else:
            await found.channel.close()

    for address in candidates:
        asked.append(address)
        found = await _probe(address, tls)
        if found.channel is None:
            unreachable.append((address, found.why))
            continue
        if found.leads:
            if follower is not None:
                await follower[1].close()
            return (address, found.channel), None, unreachable
        hint = found.hint
        if hint is not None and hint not in asked:
            asked.append(hint)
            named = await _probe(hint, tls)
            if named.channel is not None and named.leads:
                await found.channel.close()
                if follower is not None:
                    await follower[1].close()
                return (hint, named.channel), None, unreachable
            if named.channel is not None:
                await named.channel.close()
            _log.debug("%s names %s the leader, which does not lead", address, hint)
        await settle(address, found)
    return None, follower, unreachable


async def _find_leader(
    candidates: list[str], tls: Tls | None, wait: float
) -> tuple[str, grpc.aio.Channel]:
    """The leader among ``candidates`` (asked in order), or, once no replica has led for
    ``wait`` seconds, the first that answered."""
    deadline = time.monotonic() + wait
    pause = 0.1
    while True:
        leader, follower, unreachable = await _ask_each(candidates, tls)
        if leader is not None:
            return leader
        if follower is None:
            # Nothing answered: no election to wait for.
            if len(candidates) == 1 and len(unreachable) == 1:
                reason = unreachable[0][1]
            else:
                reason = "; ".join(f"{a}: {why}" for a, why in unreachable)
            raise ConnectError(",".join(candidates), reason)
        if time.monotonic() + pause >= deadline:
            _log.warning(
                "no coordinator replica leads after %g s (an election?); using %s, which "
                "follows: reads work, writes fail with UNAVAILABLE",
                wait,
                follower[0],
            )
            return follower
        await follower[1].close()
        await asyncio.sleep(pause)
        pause = min(pause * 2, 1.0)


class CoordinatorClient:
    """A connection to the coordinator — to the leading replica of a highly available one.

    Open it with :meth:`connect`; close it with :meth:`close` (or ``async with``). Every
    call raises :class:`~cairn.RpcError` with the server's status (UNAVAILABLE from a
    follower names the leader: :attr:`~cairn.RpcError.leader`; then
    :meth:`reconnect_to_leader`). Calls without a method here go through :attr:`raw` with
    :attr:`metadata`.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        addresses: list[str],
        metadata: tuple[tuple[str, str], ...],
        tls: Tls | None,
        election_wait: float,
    ) -> None:
        """Internal: use :meth:`connect`."""
        self._channel = channel
        self._stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self._address = address
        self._addresses = addresses
        self._metadata = metadata
        self._tls = tls
        self._election_wait = election_wait

    @classmethod
    async def connect(
        cls,
        address: str,
        *,
        token: str | None = None,
        tls: Tls | None = None,
        election_wait: float = ELECTION_WAIT,
    ) -> CoordinatorClient:
        """Connects to the leading coordinator among ``address``: one ``HOST:PORT`` or a
        comma-separated list of at most 16 replicas.

        - ``token``: a bearer token sent on every call (``authorization: Bearer …``; the
          coordinator's ``--auth-tokens``).
        - ``tls``: mutual TLS; the replica's certificate must name ``coordinator``, and
          ``tls``'s identity is presented as the client certificate (a coordinator with
          ``--tls-*`` flags requires one; its role authorizes calls a token does not).

        Each address is asked in turn, through the gRPC health service, whether it leads;
        the first that does is used. A follower that names the leader has that address
        asked next, even if the list lacks it. A coordinator that does not know the
        service counts as the leader. While none leads (an election) the list is asked
        again for up to ``election_wait`` seconds; then the first replica that answered is
        used (reads work there, writes fail with UNAVAILABLE). Nothing reachable:
        :class:`~cairn.ConnectError` naming each address and why.
        """
        try:
            addresses = parse_addresses(address)
        except ValueError as e:
            raise ConnectError(address, str(e)) from None
        try:
            metadata = _bearer(token)
        except ValueError as e:
            raise ConnectError(address, str(e)) from None
        found, channel = await _find_leader(addresses, tls, election_wait)
        return cls(channel, found, addresses, metadata, tls, election_wait)

    @property
    def address(self) -> str:
        """The replica this client calls (the leader when it was found)."""
        return self._address

    @property
    def raw(self) -> coordinator_pb2_grpc.CoordinatorAsyncStub:
        """The generated stub, for every other call (pass :attr:`metadata`)."""
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries (the bearer token, if any)."""
        return self._metadata

    async def reconnect_to_leader(self, hint: str | None = None) -> None:
        """Finds the leader again (asking ``hint`` first, if given: the leader a follower
        named) and calls it from now on; for after a call failed with UNAVAILABLE because
        leadership moved. On failure the client keeps the connection it had."""
        candidates = [hint] if hint else []
        candidates += [a for a in self._addresses if a != hint]
        address, channel = await _find_leader(candidates, self._tls, self._election_wait)
        _log.debug("coordinator: now calling %s", address)
        old = self._channel
        self._channel = channel
        self._stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self._address = address
        await old.close()

    async def close(self) -> None:
        """Closes the connection."""
        await self._channel.close()

    async def __aenter__(self) -> CoordinatorClient:
        """The client itself."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Closes the client."""
        await self.close()

    async def _unary(
        self, method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req
    ) -> _Resp:
        """Calls ``method`` with the token; its error as :class:`~cairn.RpcError`."""
        try:
            return await method(request, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise RpcError.from_grpc(e) from None

    # ------------------------------------------------------------------ snapshots

    async def start_snapshot(
        self,
        mode: SnapshotModeArg = types_pb2.SNAPSHOT_MODE_UNSPECIFIED,
        *,
        initiators: Iterable[str] = (),
        timeout_ms: int = 0,
        alignment_timeout_ms: int = 0,
        labels: Mapping[str, str] | None = None,
        request_id: str | None = None,
    ) -> int:
        """Starts a snapshot; returns its id.

        ``mode``: a ``SnapshotMode`` or its name (``"unaligned"``; default Chandy–Lamport);
        ``initiators``: empty lets the coordinator choose; ``timeout_ms``: 0 for the
        coordinator's default; ``alignment_timeout_ms``: ALIGNED only, 0 = never;
        ``labels``: stored with the snapshot.

        The request carries a request id (a fresh random one unless given), which makes it
        idempotent: when the answer is lost — UNAVAILABLE or ABORTED — the client finds the
        leader again and asks again with the same id, up to :data:`START_ATTEMPTS` times;
        a start that did happen answers its snapshot's id, so a retry never starts a
        second snapshot.
        """
        request = pb.StartSnapshotRequest(
            mode=snapshot_mode(mode),
            initiators=list(initiators),
            timeout_ms=timeout_ms,
            alignment_timeout_ms=alignment_timeout_ms,
            labels=dict(labels or {}),
            request_id=request_id or new_request_id(),
        )
        attempt = 1
        while True:
            try:
                response = await self._stub.StartSnapshot(request, metadata=self._metadata)
                return response.snapshot_id
            except grpc.aio.AioRpcError as e:
                error = RpcError.from_grpc(e)
            lost = error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
            if not lost or attempt >= START_ATTEMPTS:
                raise error
            attempt += 1
            _log.debug(
                "%s: %s; asking the leader again (attempt %d of %d, request id %s)",
                self._address,
                error,
                attempt,
                START_ATTEMPTS,
                request.request_id,
            )
            await self.reconnect_to_leader(error.leader)

    async def get_snapshot(self, snapshot_id: int, include_data: bool = False) -> pb.Snapshot:
        """A snapshot's metadata, optionally with its data (each node's local state and
        recorded messages). The data of a completed snapshot is read with
        :meth:`read_snapshot_data`, in pieces (states larger than a gRPC message can be
        read), and gathered here in memory; a node's data cut short raises
        :class:`~cairn.RpcError` (DATA_LOSS)."""
        snapshot = await self._unary(
            self._stub.GetSnapshot, pb.GetSnapshotRequest(snapshot_id=snapshot_id)
        )
        if not include_data:
            return snapshot
        if snapshot.status != types_pb2.SNAPSHOT_STATUS_COMPLETED:
            # A snapshot that did not complete: whatever parts it stored, in one message.
            return await self._unary(
                self._stub.GetSnapshot,
                pb.GetSnapshotRequest(snapshot_id=snapshot_id, include_data=True),
            )
        nodes = {node.node_id: node for node in snapshot.nodes}
        states: dict[str, list[bytes]] = {}
        ended: set[str] = set()
        async for piece in self.read_snapshot_data(snapshot_id):
            node = nodes.get(piece.node_id)
            if node is None:
                continue
            kind = piece.WhichOneof("kind")
            if kind == "local_state":
                states.setdefault(piece.node_id, []).append(piece.local_state)
            elif kind == "channel_state":
                state = piece.channel_state
                last = node.channel_states[-1] if node.channel_states else None
                if last is not None and last.channel == state.channel:
                    last.messages.extend(state.messages)
                else:
                    node.channel_states.append(state)
            elif kind == "end":
                ended.add(piece.node_id)
        for node in snapshot.nodes:
            # A stream that ended without a node's end was cut short: not the data.
            if node.node_id not in ended:
                raise RpcError(
                    grpc.StatusCode.DATA_LOSS,
                    f"the data of node {node.node_id} ended before its end marker",
                )
            node.local_state = b"".join(states.pop(node.node_id, []))
        return snapshot

    async def read_snapshot_data(
        self, snapshot_id: int, node: str | None = None
    ) -> AsyncIterator[pb.SnapshotData]:
        """A completed snapshot's data as a stream of pieces: per node (only ``node``, if
        given) its local state chunk by chunk, then its recorded messages channel by
        channel, then an ``end`` with the totals. Every chunk is checked against its
        SHA-256 by the coordinator as it is read; a bad one ends the stream with
        DATA_LOSS naming it."""
        request = pb.ReadSnapshotDataRequest(snapshot_id=snapshot_id, node_id=node or "")
        call = self._stub.ReadSnapshotData(request, metadata=self._metadata)
        try:
            async for piece in call:
                yield piece
        except grpc.aio.AioRpcError as e:
            raise RpcError.from_grpc(e) from None
        finally:
            call.cancel()

    async def list_snapshots(
        self,
        status: SnapshotStatusArg = types_pb2.SNAPSHOT_STATUS_UNSPECIFIED,
        *,
        mode: SnapshotModeArg = types_pb2.SNAPSHOT_MODE_UNSPECIFIED,
        page_size: int = 0,
        page_token: str = "",
    ) -> pb.ListSnapshotsResponse:
        """One page of snapshots, newest first, without data, optionally filtered by status
        and mode; with the overview over every snapshot kept. ``page_size`` 0 means 100."""
        request = pb.ListSnapshotsRequest(
            status=snapshot_status(status),
            mode=snapshot_mode(mode),
            page_size=page_size,
            page_token=page_token,
        )
        return await self._unary(self._stub.ListSnapshots, request)

    async def iter_snapshots(
        self,
        status: SnapshotStatusArg = types_pb2.SNAPSHOT_STATUS_UNSPECIFIED,
        *,
        mode: SnapshotModeArg = types_pb2.SNAPSHOT_MODE_UNSPECIFIED,
        page_size: int = 0,
    ) -> AsyncIterator[pb.Snapshot]:
        """Every snapshot (newest first, without data), page after page."""
        token = ""
        seen: set[str] = set()
        for _ in range(MAX_PAGES):
            page = await self.list_snapshots(
                status, mode=mode, page_size=page_size, page_token=token
            )
            for snapshot in page.snapshots:
                yield snapshot
            token = page.next_page_token
            if not token:
                return
            if token in seen:
                raise ProtocolError(f"the coordinator handed out page token {token!r} twice")
            seen.add(token)
        raise ProtocolError(f"more than {MAX_PAGES} pages of snapshots")

    async def watch_snapshot(self, snapshot_id: int) -> AsyncIterator[pb.SnapshotProgress]:
        """A snapshot's progress, step by step (and at least once a second while it runs),
        ending after its final status."""
        call = self._stub.WatchSnapshot(
            pb.WatchSnapshotRequest(snapshot_id=snapshot_id), metadata=self._metadata
        )
        try:
            async for progress in call:
                yield progress
        except grpc.aio.AioRpcError as e:
            raise RpcError.from_grpc(e) from None
        finally:
            call.cancel()

    async def wait_snapshot(self, snapshot_id: int) -> pb.Snapshot:
        """Waits (watching) until the snapshot ended; the snapshot as stored then."""
        async for _ in self.watch_snapshot(snapshot_id):
            pass
        return await self.get_snapshot(snapshot_id)

    async def abort_snapshot(self, snapshot_id: int, reason: str = "") -> pb.Snapshot:
        """Aborts a snapshot in progress (``reason`` is kept with it)."""
        request = pb.AbortSnapshotRequest(snapshot_id=snapshot_id, reason=reason)
        return await self._unary(self._stub.AbortSnapshot, request)

    async def delete_snapshot(self, snapshot_id: int) -> int:
        """Deletes a finished snapshot; the chunk bytes freed."""
        request = pb.DeleteSnapshotRequest(snapshot_id=snapshot_id)
        return (await self._unary(self._stub.DeleteSnapshot, request)).bytes_freed

    async def verify_snapshot(self, snapshot_id: int) -> pb.VerifySnapshotResponse:
        """Reads every chunk of a snapshot and checks it against its SHA-256 name
        (DATA_LOSS naming the first bad one)."""
        request = pb.VerifySnapshotRequest(snapshot_id=snapshot_id)
        return await self._unary(self._stub.VerifySnapshot, request)

    async def diff_snapshots(self, from_snapshot_id: int, to_snapshot_id: int) -> pb.SnapshotDiff:
        """Compares two snapshots node by node."""
        request = pb.DiffSnapshotsRequest(
            from_snapshot_id=from_snapshot_id, to_snapshot_id=to_snapshot_id
        )
        return await self._unary(self._stub.DiffSnapshots, request)

    # ------------------------------------------------------------------ restores

    async def restore_snapshot(
        self, snapshot_id: int, *, if_epoch: int | None = None
    ) -> pb.RestoreOperation:
        """Rolls the cluster back to a completed snapshot; returns at once with the
        operation (follow it with :meth:`get_restore` or :meth:`wait_restore`).

        ``if_epoch``: refused with FAILED_PRECONDITION unless the cluster is still in this
        epoch (the newest restore's ``epoch`` in :meth:`list_restores`; 0 before any) — so
        a restore chosen from what the caller saw never goes through when another restore
        came in between."""
        request = pb.RestoreSnapshotRequest(snapshot_id=snapshot_id)
        if if_epoch is not None:
            request.if_epoch = if_epoch
        return await self._unary(self._stub.RestoreSnapshot, request)

    async def get_restore(self, restore_id: str) -> pb.RestoreOperation:
        """A restore operation's progress and result."""
        request = pb.GetRestoreRequest(restore_id=restore_id)
        return await self._unary(self._stub.GetRestore, request)

    async def list_restores(self, limit: int = 0) -> list[pb.RestoreOperation]:
        """Restore operations, newest first (at most ``limit``; 0 means 100)."""
        request = pb.ListRestoresRequest(limit=limit)
        return list((await self._unary(self._stub.ListRestores, request)).restores)

    async def wait_restore(
        self, restore_id: str, *, timeout: float | None = None, poll: float = 0.1
    ) -> pb.RestoreOperation:
        """Polls a restore until it is done or failed; the operation then. Raises
        :class:`TimeoutError` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            operation = await self.get_restore(restore_id)
            if operation.done or operation.HasField("failure"):
                return operation
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{restore_id} is not done after {timeout:g} s")
            await asyncio.sleep(poll)

    # ------------------------------------------------------------------ the cluster

    async def list_nodes(self) -> pb.ListNodesResponse:
        """The cluster's members and the channels of the topology."""
        return await self._unary(self._stub.ListNodes, pb.ListNodesRequest())

    async def remove_node(self, node_id: str) -> pb.ListNodesResponse:
        """Removes a node that is down from the cluster (admin role)."""
        return await self._unary(self._stub.RemoveNode, pb.RemoveNodeRequest(node_id=node_id))

    async def get_policy(self) -> pb.Policy:
        """The snapshot schedule and its state."""
        return await self._unary(self._stub.GetPolicy, pb.GetPolicyRequest())

    async def set_policy(
        self,
        policy: pb.Policy | None = None,
        *,
        update: Iterable[str] = (),
        reset_to_flags: bool = False,
    ) -> pb.Policy:
        """Changes the snapshot schedule: the fields of ``policy`` named in ``update``
        (empty: every field that is not zero), or back to the coordinator's flags."""
        request = pb.SetPolicyRequest(update=list(update), reset_to_flags=reset_to_flags)
        if policy is not None:
            request.policy.CopyFrom(policy)
        return await self._unary(self._stub.SetPolicy, request)

    async def get_leadership(self) -> pb.Leadership:
        """The coordinator replicas, which one leads and its term (any replica answers)."""
        return await self._unary(self._stub.GetLeadership, pb.GetLeadershipRequest())
