"""The coordinator client against in-process fake replicas: finding the leader, bearer
tokens, StartSnapshot's retries with one request id, snapshots with their data, watching,
restores, pages."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from cairn import ConnectError, CoordinatorClient, RpcError, health
from cairn.v1 import coordinator_pb2 as pb
from cairn.v1 import coordinator_pb2_grpc, types_pb2

from fake_daemon import run


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """A replica: its leadership as its health service tells it, and a few calls."""

    def __init__(self, status: health.ServingStatus | None = health.ServingStatus.SERVING) -> None:
        self.status = status  # None: the Leader service is unknown (NOT_FOUND)
        self.hint: str | None = None
        self.refuse_starts: list[tuple[grpc.StatusCode, str | None]] = []
        self.starts: list[pb.StartSnapshotRequest] = []
        self.started: dict[str, int] = {}
        self.metadata: list[dict[str, str]] = []
        self.restores: list[pb.RestoreSnapshotRequest] = []
        self.polls = 0
        self.cut_short = False

    def _seen(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})

    def health_handler(self) -> grpc.GenericRpcHandler:
        async def check(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            assert health.decode_request(request) == "cairn.v1.Leader"
            if self.hint is not None:
                await context.send_initial_metadata((("cairn-leader", self.hint),))
            if self.status is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
            return health.encode_response(self.status)

        return grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}
        )

    async def StartSnapshot(
        self, request: pb.StartSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StartSnapshotResponse:
        self._seen(context)
        self.starts.append(request)
        if self.refuse_starts:
            code, leader = self.refuse_starts.pop(0)
            metadata = (("cairn-leader", leader),) if leader else ()
            await context.abort(code, "this replica cannot start it", trailing_metadata=metadata)
        snapshot_id = self.started.setdefault(request.request_id, len(self.started) + 1)
        return pb.StartSnapshotResponse(snapshot_id=snapshot_id)

    async def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Snapshot:
        self._seen(context)
        if request.snapshot_id == 404:
            await context.abort(grpc.StatusCode.NOT_FOUND, "snapshot 404 does not exist")
        snapshot = pb.Snapshot(status=types_pb2.SNAPSHOT_STATUS_COMPLETED)
        snapshot.plan.snapshot_id = request.snapshot_id
        for node in ("n1", "n2"):
            snapshot.nodes.add(node_id=node, recorded=True, reported=True)
        return snapshot

    async def ReadSnapshotData(
        self, request: pb.ReadSnapshotDataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SnapshotData]:
        channel = types_pb2.ChannelRef(to="n1")
        setattr(channel, "from", "n2")
        yield pb.SnapshotData(node_id="n1", local_state=b"ab")
        yield pb.SnapshotData(node_id="n1", local_state=b"cd")
        for index in (0, 1):
            state = types_pb2.ChannelState(channel=channel)
            state.messages.add(index=index, payload=b"m%d" % index)
            yield pb.SnapshotData(node_id="n1", channel_state=state)
        yield pb.SnapshotData(
            node_id="n1", end=pb.NodeDataEnd(local_state_bytes=4, recorded_messages=2)
        )
        yield pb.SnapshotData(node_id="n2", local_state=b"x")
        yield pb.SnapshotData(node_id="n9", local_state=b"not a participant")
        if not self.cut_short:
            yield pb.SnapshotData(node_id="n2", end=pb.NodeDataEnd(local_state_bytes=1))

    async def WatchSnapshot(
        self, request: pb.WatchSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SnapshotProgress]:
        for status, recorded in (
            (types_pb2.SNAPSHOT_STATUS_IN_PROGRESS, []),
            (types_pb2.SNAPSHOT_STATUS_IN_PROGRESS, ["n1"]),
            (types_pb2.SNAPSHOT_STATUS_COMPLETED, ["n1", "n2"]),
        ):
            yield pb.SnapshotProgress(
                snapshot_id=request.snapshot_id, status=status, recorded=recorded
            )

    async def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListSnapshotsResponse:
        assert request.status == types_pb2.SNAPSHOT_STATUS_COMPLETED
        first = request.page_token == ""
        ids = (5, 4) if first else (3,)
        response = pb.ListSnapshotsResponse(next_page_token="p2" if first else "")
        for i in ids:
            response.snapshots.add().plan.snapshot_id = i
        return response

    async def RestoreSnapshot(
        self, request: pb.RestoreSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RestoreOperation:
        self.restores.append(request)
        return pb.RestoreOperation(
            restore_id=f"restore-{len(self.restores)}", snapshot_id=request.snapshot_id
        )

    async def GetRestore(
        self, request: pb.GetRestoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RestoreOperation:
        self.polls += 1
        return pb.RestoreOperation(restore_id=request.restore_id, done=self.polls >= 3)

    async def ListRestores(
        self, request: pb.ListRestoresRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListRestoresResponse:
        return pb.ListRestoresResponse(
            restores=[
                pb.RestoreOperation(restore_id="restore-2", epoch=2),
                pb.RestoreOperation(restore_id="restore-1"),
            ]
        )


def fake(status: health.ServingStatus | None = health.ServingStatus.SERVING) -> FakeCoordinator:
    """A replica answering ``status`` (it implements only the calls the tests make)."""
    return FakeCoordinator(status)  # type: ignore[abstract]


@contextlib.asynccontextmanager
async def replicas(*fakes: FakeCoordinator) -> AsyncIterator[list[str]]:
    servers = []
    addresses = []
    for fake in fakes:
        server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(fake, server)
        server.add_generic_rpc_handlers((fake.health_handler(),))
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    try:
        yield addresses
    finally:
        for server in servers:
            await server.stop(0)


async def dead_address() -> str:
    """An address nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


@run
async def test_the_leader_is_found_in_the_list_or_through_a_hint() -> None:
    dead = await dead_address()
    follower, leader = fake(health.ServingStatus.NOT_SERVING), fake()
    async with replicas(follower, leader) as (f, lead):
        async with await CoordinatorClient.connect(f"{dead},{f},{lead}") as client:
            assert client.address == lead
        # A follower names the leader, which the list lacks.
        follower.hint = lead
        async with await CoordinatorClient.connect(f"{dead},{f}") as client:
            assert client.address == lead
    # A coordinator that does not know cairn.v1.Leader leads.
    async with replicas(fake(None)) as (older,):
        async with await CoordinatorClient.connect(older) as client:
            assert client.address == older


@run
async def test_without_a_leader_the_first_that_answers_is_used_after_the_wait() -> None:
    dead = await dead_address()
    first = fake(health.ServingStatus.NOT_SERVING)
    second = fake(health.ServingStatus.NOT_SERVING)
    async with replicas(first, second) as (a, b):
        second.hint = a  # stale: a does not lead either
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with await CoordinatorClient.connect(f"{dead},{a},{b}", election_wait=0.5) as client:
            assert client.address == a
        assert 0.3 <= loop.time() - started < 5


@run
async def test_nothing_reachable_fails_at_once_naming_each() -> None:
    a, b = await dead_address(), await dead_address()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ConnectError) as e:
        await CoordinatorClient.connect(f"{a},{b}")
    assert loop.time() - started < 5
    assert e.value.address == f"{a},{b}"
    assert e.value.reason.startswith(f"{a}: ") and f"; {b}: " in e.value.reason
    with pytest.raises(ConnectError, match="entry 2 of the list is empty"):
        await CoordinatorClient.connect("a:1,")
    with pytest.raises(ConnectError, match="header"):
        await CoordinatorClient.connect(a, token="bad\ntoken")


@run
async def test_start_snapshot_asks_the_new_leader_again_with_the_same_request_id() -> None:
    old, new = fake(), fake(health.ServingStatus.NOT_SERVING)
    async with replicas(old, new) as (a, b):
        client = await CoordinatorClient.connect(f"{a},{b}", token=" s3cret ")
        # Leadership moves to b; a refuses naming it.
        old.status, new.status = health.ServingStatus.NOT_SERVING, health.ServingStatus.SERVING
        old.refuse_starts = [(grpc.StatusCode.UNAVAILABLE, b)]
        snapshot_id = await client.start_snapshot(
            "unaligned", labels={"reason": "test"}, alignment_timeout_ms=5
        )
        assert snapshot_id == 1 and client.address == b
        assert len(old.starts) == 1 and len(new.starts) == 1
        assert old.starts[0].request_id == new.starts[0].request_id != ""
        assert new.starts[0].mode == types_pb2.SNAPSHOT_MODE_UNALIGNED
        assert dict(new.starts[0].labels) == {"reason": "test"}
        assert new.metadata[-1]["authorization"] == "Bearer s3cret"
        # ABORTED (the answer lost): asked again; the same request id answers the same id.
        new.refuse_starts = [(grpc.StatusCode.ABORTED, None)]
        assert await client.start_snapshot(request_id="fixed") == 2
        assert [s.request_id for s in new.starts[-2:]] == ["fixed", "fixed"]
        # Anything else is not retried; nor more than four attempts.
        new.refuse_starts = [(grpc.StatusCode.RESOURCE_EXHAUSTED, None)]
        with pytest.raises(RpcError) as e:
            await client.start_snapshot()
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retryable
        new.refuse_starts = [(grpc.StatusCode.UNAVAILABLE, None)] * 4
        before = len(new.starts)
        with pytest.raises(RpcError):
            await client.start_snapshot()
        assert len(new.starts) - before == 4
        await client.close()


@run
async def test_a_snapshot_with_its_data_and_its_progress() -> None:
    replica = fake()
    async with replicas(replica) as (address,):
        async with await CoordinatorClient.connect(address) as client:
            snapshot = await client.get_snapshot(7, include_data=True)
            n1, n2 = snapshot.nodes
            assert (n1.local_state, n2.local_state) == (b"abcd", b"x")
            assert len(n1.channel_states) == 1, "pieces of one channel are joined"
            assert [m.payload for m in n1.channel_states[0].messages] == [b"m0", b"m1"]
            assert not (await client.get_snapshot(7)).nodes[0].local_state
            replica.cut_short = True
            with pytest.raises(RpcError) as e:
                await client.get_snapshot(7, include_data=True)
            assert e.value.code == grpc.StatusCode.DATA_LOSS and "n2" in e.value.details
            with pytest.raises(RpcError) as e:
                await client.get_snapshot(404)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            statuses = [p.status async for p in client.watch_snapshot(7)]
            assert statuses[-1] == types_pb2.SNAPSHOT_STATUS_COMPLETED and len(statuses) == 3
            ids = [s.plan.snapshot_id async for s in client.iter_snapshots("completed")]
            assert ids == [5, 4, 3]


@run
async def test_restores() -> None:
    replica = fake()
    async with replicas(replica) as (address,):
        async with await CoordinatorClient.connect(address) as client:
            operation = await client.restore_snapshot(3)
            assert operation.restore_id == "restore-1"
            assert not replica.restores[0].HasField("if_epoch")
            await client.restore_snapshot(3, if_epoch=0)
            assert replica.restores[1].HasField("if_epoch") and replica.restores[1].if_epoch == 0
            done = await client.wait_restore("restore-1", poll=0.01, timeout=5)
            assert done.done and replica.polls == 3
            assert [r.restore_id for r in await client.list_restores()] == [
                "restore-2",
                "restore-1",
            ]
