"""Send and deliver order between two Python applications on two real daemons: thousands of
numbered messages each way, through every way of sending (``send``, ``send_many``,
``reserve``), each arriving once and in order."""

from __future__ import annotations

import asyncio

from cairn import AppSession

from .apps import Pump, numbered
from .cluster import Cluster, Harness, run

#: Messages each way.
N = 6000


def test_every_message_arrives_once_and_in_order_both_ways(harness: Harness) -> None:
    async def body() -> None:
        async with await Cluster.start(harness, ["n1", "n2"]) as cluster:
            a = await cluster.attach("n1", "order-a")
            b = await cluster.attach("n2", "order-b")
            assert (a.node_id, b.node_id) == ("n1", "n2")
            assert a.peers == {"n2"} and b.peers == {"n1"}
            assert a.flow_control and b.flow_control, "App/Consumed is open on both"
            assert a.incarnation != 0 and b.incarnation != 0
            pump_a, pump_b = Pump(a), Pump(b)

            async def send_all(session: AppSession, to: str) -> None:
                # A third each: one at a time, as runs of 100, through permits.
                third = N // 3
                for i in range(third):
                    await session.send(to, numbered(i, 24))
                for start in range(third, 2 * third, 100):
                    end = min(start + 100, 2 * third)
                    sent = await session.send_many(
                        [(to, numbered(i, 24)) for i in range(start, end)]
                    )
                    assert sent == end - start
                for i in range(2 * third, N):
                    with await session.reserve() as permit:
                        permit.send(to, numbered(i, 24))
                await session.flushed()

            await asyncio.gather(send_all(a, "n2"), send_all(b, "n1"))
            await pump_b.until("n2 got every message", lambda: pump_b.received_from("n1") == N)
            await pump_a.until("n1 got every message", lambda: pump_a.received_from("n2") == N)
            assert pump_a.count == N and pump_b.count == N, "each exactly once"
            # The daemons counted them through their channels too.
            status = await cluster.status("n1")
            out = [c for c in status.channels if getattr(c.channel, "from") == "n1"]
            assert [c.data_messages for c in out] == [N], status
            await pump_a.stop()
            await pump_b.stop()

    run(body(), timeout=90)
