"""The delivery window, through real daemons: a Python application that falls behind never
makes a record request wait behind more than the window its daemon handed it. The request's
early copy (on ``App/Consumed``) overtakes the messages handed over and not consumed; the
session cuts between two messages and names its cut, and the daemon records the rest as in
flight — in order, and consistent with what the sender recorded it sent.

As the Rust SDK's test (``integration-tests/tests/it/node_channels.rs``,
``an_unaligned_record_request_overtakes_the_delivery_window``): first a stalled application
(reading nothing while its inbox fills), then a slow one (whose window the daemon has sized
to its measured pace)."""

from __future__ import annotations

import asyncio
import json

from cairn import Message, RecordState
from cairn.v1 import coordinator_pb2, types_pb2

from .apps import Pump, number_of, numbered
from .cluster import Cluster, Harness, eventually, local_state, recorded, run

#: The daemons' --channel-buffer: b's inbox fills to it while its application stalls.
BUFFER = 4096
#: The window a daemon hands an application before it has measured its pace
#: (`node_loop::flow::APP_INITIAL`).
INITIAL_WINDOW = 1024
#: Messages of each phase.
STALLED, SLOW = 16_000, 12_000


def test_a_record_request_waits_behind_no_more_than_the_delivery_window(
    harness: Harness,
) -> None:
    async def body() -> None:
        cluster = await Cluster.start(
            harness, ["n1", "n2"], node_args=["--channel-buffer", str(BUFFER)]
        )
        async with cluster:
            client = await cluster.client()
            a = await cluster.attach("n1", "sender")
            b = await cluster.attach("n2", "behind")
            sent = 0
            Pump(a, state=lambda _: json.dumps({"sent": sent}).encode())

            async def flood(until: int) -> None:
                nonlocal sent
                while sent < until:
                    permit = await a.reserve()
                    permit.send("n2", numbered(sent))
                    sent += 1

            received = 0
            cut_at: dict[int, int] = {}

            async def read(until: int, slow: bool) -> None:
                """b's application: checks the order, answers record requests with how many
                it received; ``slow``: about a millisecond of work every ten messages."""
                nonlocal received
                while received < until:
                    event = await b.next_event()
                    if isinstance(event, Message):
                        assert number_of(event.payload) == received, "out of order"
                        received += 1
                        if slow and received % 10 == 0:
                            await asyncio.sleep(0.001)  # the application's work, not a wait
                    elif isinstance(event, RecordState):
                        cut_at[event.snapshot_id] = received
                        state = json.dumps({"received": received}).encode()
                        b.state_recorded(event.snapshot_id, state)
                    else:
                        raise AssertionError(f"unexpected {event}")

            def check(
                snapshot_id: int, snapshot: coordinator_pb2.Snapshot
            ) -> tuple[int, int, list[int]]:
                """The snapshot is consistent: b's cut plus what was recorded in flight is
                what a sent, in order. (a's sent count, b's cut, b's own recording.)"""
                was_sent = json.loads(local_state(snapshot, "n1"))["sent"]
                was_received = json.loads(local_state(snapshot, "n2"))["received"]
                assert was_received == cut_at[snapshot_id]
                in_flight = [number_of(p) for p in recorded(snapshot, "n1", "n2")]
                assert sorted(in_flight) == list(range(was_received, was_sent)), (
                    f"received {was_received} + in flight {len(in_flight)} != sent {was_sent}"
                )
                by_n2 = [
                    number_of(m.payload)
                    for node in snapshot.nodes
                    if node.node_id == "n2"
                    for c in node.channel_states
                    for m in c.messages
                ]
                return was_sent, was_received, by_n2

            # 1. Stalled: b reads nothing. The window goes to it, then its inbox fills to
            # the credits granted, and a's sends back up.
            flooding = asyncio.create_task(flood(STALLED))

            overflows: list[str] = []  # bounds broken at any poll: failures, not retries

            async def backed_up() -> tuple[int, int]:
                status = await cluster.status("n2")
                window = status.delivery_window
                out = window.handed - window.consumed
                if status.inbox_depth > BUFFER or out > window.size_messages:
                    overflows.append(
                        f"inbox {status.inbox_depth} (buffer {BUFFER}), {out} handed over "
                        f"(window {window.size_messages})"
                    )
                assert window.acknowledges, "the session acknowledges its deliveries"
                assert status.inbox_depth == BUFFER and out == window.size_messages, (
                    f"inbox {status.inbox_depth}, {out} of {window.size_messages} handed over"
                )
                return status.inbox_depth, window.size_messages

            inbox, window = await eventually("n2 backed up", backed_up, harness=harness)
            assert not overflows, overflows
            assert window == INITIAL_WINDOW, "no pace measured yet"
            snapshot_id = await client.start_snapshot("unaligned")

            async def reached() -> None:
                status = await cluster.status("n2")
                assert snapshot_id in status.snapshots_in_flight, "the marker is not at n2"

            # The marker reaches n2 while its application still reads nothing: it overtook
            # a's queue and n2's inbox, which only the application drains.
            await eventually("the marker reached n2", reached, interval=0.01, harness=harness)
            await asyncio.gather(read(STALLED, slow=False), flooding)
            snapshot_1 = await client.wait_snapshot(snapshot_id)
            assert snapshot_1.status == types_pb2.SNAPSHOT_STATUS_COMPLETED, snapshot_1
            before_record = cut_at[snapshot_id]
            assert before_record < window, (
                f"n2's application consumed {before_record} messages before its record "
                f"request: the whole window of {window} it had been handed, which the "
                "request's early copy should have overtaken"
            )
            full = await client.get_snapshot(snapshot_id, include_data=True)
            _, _, by_n2 = check(snapshot_id, full)
            assert len(by_n2) >= inbox + window - before_record, (
                f"n2 recorded {len(by_n2)}; its inbox of {inbox} and the "
                f"{window - before_record} handed over and not consumed were overtaken"
            )
            assert by_n2 == list(range(before_record, before_record + len(by_n2))), (
                "n2 recorded from the first message not consumed, in order"
            )
            print(
                f"\nstalled: cut after {before_record} of {window} handed over; "
                f"{len(by_n2)} recorded in flight at n2 (inbox {inbox})"
            )

            # 2. Slow: b works through a backlog at its own pace; the daemon sizes the
            # window to about 50 ms of it. A request taken while it lags is answered after
            # at most a window's worth of the messages it was handed.
            flooding = asyncio.create_task(flood(STALLED + SLOW))
            reading = asyncio.create_task(read(STALLED + SLOW, slow=True))

            async def measured() -> int:
                status = await cluster.status("n2")
                size = status.delivery_window.size_messages
                assert received >= STALLED + 2000, f"{received - STALLED} read"
                assert size < INITIAL_WINDOW and status.inbox_depth > 0, (
                    f"window {size}, inbox {status.inbox_depth}"
                )
                return size

            await eventually("n2's pace measured", measured, interval=0.01, harness=harness)
            snapshot_id = await client.start_snapshot("unaligned")

            async def seen() -> tuple[int, int]:
                status = await cluster.status("n2")
                assert snapshot_id in status.snapshots_in_flight or snapshot_id in cut_at
                return received, status.delivery_window.size_messages

            consumed_when_seen, window_then = await eventually(
                "the marker reached n2", seen, interval=0.005, harness=harness
            )
            await asyncio.gather(reading, flooding)
            snapshot_2 = await client.wait_snapshot(snapshot_id)
            assert snapshot_2.status == types_pb2.SNAPSHOT_STATUS_COMPLETED, snapshot_2
            assert snapshot_id in cut_at, "n2 was asked to record"
            behind = cut_at[snapshot_id] - consumed_when_seen
            assert behind <= window_then, (
                f"n2's application consumed {behind} messages after the marker reached it "
                f"before its record request, more than its window of {window_then}"
            )
            full = await client.get_snapshot(snapshot_id, include_data=True)
            check(snapshot_id, full)
            print(
                f"slow: window {window_then}; cut "
                + (f"{behind} messages after" if behind >= 0 else "before")
                + f" the test saw the marker at n2; {len(recorded(full, 'n1', 'n2'))} "
                "recorded in flight"
            )
            assert received == STALLED + SLOW
            await b.close()

    run(body(), timeout=90)
