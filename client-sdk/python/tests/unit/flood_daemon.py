"""A daemon's App service for measuring the SDK's throughput, run as its own process (so
that it does not share the SDK's event loop): it delivers MESSAGES payloads of SIZE bytes in
packed runs of 1024 as fast as the session reads them, and takes the application's sends,
reporting what it took on App/Consumed.

    python flood_daemon.py MESSAGES SIZE      # prints the port, then serves until killed
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from cairn.v1 import app_pb2, app_pb2_grpc

RUN = 1024


class Flood(app_pb2_grpc.AppServicer):
    def __init__(self, messages: int, size: int) -> None:
        self.messages = messages
        self.size = size
        self.taken = 0
        self.changed = asyncio.Event()

    async def _take(self, requests: AsyncIterator[app_pb2.AppToNode]) -> None:
        async for message in requests:
            if message.HasField("send"):
                self.taken += sum(len(r.lengths) for r in message.send.runs) + len(
                    message.send.messages
                )
                self.changed.set()

    async def Session(
        self,
        request_iterator: AsyncIterator[app_pb2.AppToNode],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[app_pb2.NodeToApp]:
        requests = request_iterator.__aiter__()
        await requests.__anext__()
        yield app_pb2.NodeToApp(
            attached=app_pb2.Attached(
                node_id="n1", cluster="bench", peers=["n2"], session=1, flow_key=1
            )
        )
        taker = asyncio.create_task(self._take(requests))
        payload = b"p" * self.size
        run = app_pb2.DeliverRun(payloads=payload * RUN, lengths=[self.size] * RUN)
        setattr(run, "from", "n2")
        batch = app_pb2.NodeToApp(deliver=app_pb2.DeliverBatch(runs=[run]))
        for _ in range(self.messages // RUN):
            yield batch
        try:
            await asyncio.sleep(3600)
        finally:
            taker.cancel()

    async def Consumed(
        self,
        request_iterator: AsyncIterator[app_pb2.Consumption],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[app_pb2.Taken]:
        requests = request_iterator.__aiter__()
        await requests.__anext__()
        await context.send_initial_metadata(())
        reported = -1
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.taken != reported:
                reported = self.taken
                yield app_pb2.Taken(messages=reported)


async def main() -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    app_pb2_grpc.add_AppServicer_to_server(Flood(int(sys.argv[1]), int(sys.argv[2])), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
