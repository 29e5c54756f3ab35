"""Recording during a flood: one Python application floods another through real daemons
while snapshots in each mode are started through the SDK's coordinator client. Each
completes, and its data is consistent: what the receiver recorded it had received, plus the
messages recorded in flight, is exactly what the sender recorded it had sent — in order."""

from __future__ import annotations

import asyncio
import json

from .apps import Pump, number_of, numbered
from .cluster import Cluster, Harness, local_state, recorded, run

#: Messages sent before the first snapshot starts (the flood is under way).
WARM_UP = 3000


def test_snapshots_during_a_flood_record_what_was_in_flight(harness: Harness) -> None:
    async def body() -> None:
        async with await Cluster.start(harness, ["n1", "n2"]) as cluster:
            a = await cluster.attach("n1", "flooder")
            b = await cluster.attach("n2", "receiver")
            sent = 0
            # Each state is read at the cut, with no await between the count and the answer.
            pump_a = Pump(a, state=lambda _: json.dumps({"sent": sent}).encode())
            pump_b = Pump(
                b, state=lambda p: json.dumps({"received": p.received_from("n1")}).encode()
            )
            stop = asyncio.Event()

            async def flood() -> None:
                nonlocal sent
                while not stop.is_set():
                    permit = await a.reserve()  # may wait: before the message and its count
                    permit.send("n2", numbered(sent, 16))
                    sent += 1

            flooding = asyncio.create_task(flood())
            await pump_b.until("the flood is under way", lambda: pump_b.count >= WARM_UP)
            cuts = []
            for mode in ("chandy-lamport", "unaligned", "aligned"):
                snapshot = await cluster.snapshot(mode)
                was_sent = json.loads(local_state(snapshot, "n1"))["sent"]
                was_received = json.loads(local_state(snapshot, "n2"))["received"]
                in_flight = [number_of(p) for p in recorded(snapshot, "n1", "n2")]
                assert was_received + len(in_flight) == was_sent, (
                    f"{mode}: received {was_received} + {len(in_flight)} in flight "
                    f"!= sent {was_sent}"
                )
                assert sorted(in_flight) == list(range(was_received, was_sent)), (
                    f"{mode}: in flight {in_flight[:5]}…, not {was_received}..{was_sent}"
                )
                for node in ("n1", "n2"):
                    by_node = [number_of(p) for p in recorded(snapshot, "n1", "n2", by=node)]
                    assert by_node == sorted(by_node), f"{mode}: {node} recorded out of order"
                assert recorded(snapshot, "n2", "n1") == [], "nothing flows n2→n1"
                assert not flooding.done(), "the flood went on through the snapshot"
                cuts.append((mode, was_sent, was_received, len(in_flight)))
            stop.set()
            await flooding
            await a.flushed()
            total = sent
            await pump_b.until("every message arrived", lambda: pump_b.received_from("n1") == total)
            assert pump_b.count == total
            assert cuts[0][1] >= WARM_UP and cuts[-1][1] < total, cuts
            assert [r for r in pump_a.records] == [r for r in pump_b.records], "both recorded each"
            print(f"\nflood of {total} messages; cuts (mode, sent, received, in flight): {cuts}")
            await pump_a.stop()
            await pump_b.stop()

    run(body(), timeout=90)
