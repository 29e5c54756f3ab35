"""An in-process fake of a node daemon's ``cairn.v1.App`` service (grpc.aio on a free
loopback port), scripted by the tests: what the application sends is queued for the test,
and the test queues what the daemon sends."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import grpc

from cairn.v1 import app_pb2, app_pb2_grpc

T = TypeVar("T")

#: Seconds a test may wait for one thing.
WAIT = 5.0


def run(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an async test in a fresh event loop, with a time limit."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 30))

    return wrapper


async def within(awaitable: Awaitable[T], seconds: float = WAIT) -> T:
    """``awaitable``'s result, or a timeout."""
    return await asyncio.wait_for(awaitable, seconds)


async def _pump(source: AsyncIterator[T], sink: asyncio.Queue[T]) -> None:
    with contextlib.suppress(Exception):
        async for item in source:
            await sink.put(item)


class FakeDaemon(app_pb2_grpc.AppServicer):
    """A daemon's App service whose every move the test makes."""

    def __init__(
        self,
        *,
        node_id: str = "n1",
        cluster: str = "test",
        peers: Iterable[str] = ("n2", "n3"),
        session: int = 7,
        flow_key: int = 99,
        consumed: str = "ok",
        attach_error: grpc.StatusCode | None = None,
    ) -> None:
        """``consumed``: ``ok``, ``refuse`` (PERMISSION_DENIED) or ``silent`` (never
        answers). ``session`` 0: a daemon without flow control."""
        self.node_id = node_id
        self.cluster = cluster
        self.peers = list(peers)
        self.session = session
        self.flow_key = flow_key
        self.consumed_mode = consumed
        self.attach_error = attach_error
        self.attach: app_pb2.Attach | None = None
        self.from_app: asyncio.Queue[app_pb2.AppToNode] = asyncio.Queue()
        self.to_app: asyncio.Queue[app_pb2.NodeToApp | None] = asyncio.Queue()
        self.consumptions: asyncio.Queue[app_pb2.Consumption] = asyncio.Queue()
        self.taken: asyncio.Queue[app_pb2.Taken | None] = asyncio.Queue()
        self.consumed_calls = 0

    # The service.

    async def Session(
        self,
        request_iterator: AsyncIterator[app_pb2.AppToNode],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[app_pb2.NodeToApp]:
        requests = request_iterator.__aiter__()
        first = await requests.__anext__()
        if self.attach_error is not None:
            await context.abort(self.attach_error, "an application session is already attached")
        self.attach = first.attach
        yield app_pb2.NodeToApp(
            attached=app_pb2.Attached(
                node_id=self.node_id,
                cluster=self.cluster,
                peers=self.peers,
                incarnation=1234,
                session=self.session,
                flow_key=self.flow_key,
            )
        )
        pump = asyncio.create_task(_pump(requests, self.from_app))
        try:
            while True:
                message = await self.to_app.get()
                if message is None:
                    return
                yield message
        finally:
            pump.cancel()

    async def Consumed(
        self,
        request_iterator: AsyncIterator[app_pb2.Consumption],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[app_pb2.Taken]:
        self.consumed_calls += 1
        requests = request_iterator.__aiter__()
        first = await requests.__anext__()
        if self.consumed_mode == "refuse" or first.flow_key != self.flow_key:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong flow key")
        if self.consumed_mode == "silent":
            await asyncio.sleep(3600)
        await self.consumptions.put(first)
        await context.send_initial_metadata(())
        pump = asyncio.create_task(_pump(requests, self.consumptions))
        try:
            while True:
                taken = await self.taken.get()
                if taken is None:
                    return
                yield taken
        finally:
            pump.cancel()

    # The test's side.

    async def send(self, **kind: Any) -> None:
        """Sends the application one ``NodeToApp`` with ``kind`` set."""
        await self.to_app.put(app_pb2.NodeToApp(**kind))

    async def deliver_runs(self, *runs: tuple[str, list[bytes]]) -> None:
        """Delivers runs ``(from, payloads)``, packed."""
        batch = app_pb2.DeliverBatch()
        for sender, payloads in runs:
            run_ = batch.runs.add(payloads=b"".join(payloads), lengths=[len(p) for p in payloads])
            setattr(run_, "from", sender)
        await self.send(deliver=batch)

    async def next_from_app(self, kind: str | None = None) -> app_pb2.AppToNode:
        """The next message the application sent (of ``kind``, skipping others)."""
        while True:
            message = await within(self.from_app.get())
            if kind is None or message.WhichOneof("kind") == kind:
                return message

    async def sent_messages(self, n: int) -> list[tuple[str, bytes]]:
        """The next ``n`` application messages sent (from its send batches), in order."""
        out: list[tuple[str, bytes]] = []
        while len(out) < n:
            message = await self.next_from_app("send")
            for run_ in message.send.runs:
                at = 0
                for length in run_.lengths:
                    out.append((run_.to, run_.payloads[at : at + length]))
                    at += length
            for m in message.send.messages:
                out.append((m.to, m.payload))
        return out

    async def next_consumption(self, messages: int | None = None) -> app_pb2.Consumption:
        """The next acknowledgement (the first that counts ``messages``, if given)."""
        while True:
            c = await within(self.consumptions.get())
            if messages is None or c.messages >= messages:
                return c


@contextlib.asynccontextmanager
async def serving(
    daemon: FakeDaemon, credentials: grpc.ServerCredentials | None = None
) -> AsyncIterator[str]:
    """Serves ``daemon`` on a free loopback port (with TLS given ``credentials``); its
    address."""
    server = grpc.aio.server()
    app_pb2_grpc.add_AppServicer_to_server(daemon, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
