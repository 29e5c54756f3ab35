"""Restores through real daemons: a large state recorded in pieces and handed back in pieces,
and a restore that breaks off at the application — superseded by the next one while its
pieces were being handed over — which the application hears as ``RestoreAborted`` before
the next restore's pieces, and drops."""

from __future__ import annotations

import asyncio
import random
import time

from cairn import AppEvent, RestoreAborted, RestorePiece, RpcError
from cairn.v1 import types_pb2

from .apps import Pump
from .cluster import Cluster, Harness, eventually, run

#: The large state: far more than what the daemon's stream to the application, gRPC's
#: receive buffers (their HTTP/2 window grows with the bandwidth it measures: 5 to 24 MiB of
#: pieces were seen there) and the session's read-ahead (16 messages) hold, so that a
#: restore's last piece is still at the daemon while the application does not read.
STATE_MIB = 64
#: The pieces the application answers the record request with.
PIECE = 1 << 20
#: The coordinator's --restore-timeout: the restore the application leaves unread fails
#: after it; the next must be applied within it (it takes under a second here).
RESTORE_TIMEOUT = 6


def test_a_restore_in_pieces_and_a_superseded_one(harness: Harness) -> None:
    async def body() -> None:
        cluster = await Cluster.start(
            harness, ["n1", "n2"], coordinator_args=["--restore-timeout", f"{RESTORE_TIMEOUT}s"]
        )
        async with cluster:
            # Each MiB numbered, then one random MiB again: every piece differs, yet the
            # coordinator stores little (content-defined chunks, deduplicated), which spares
            # the test 64 MiB of fsynced writes.
            block = random.Random(36).randbytes(1 << 20)
            state = b"".join(i.to_bytes(8, "big") + block for i in range(STATE_MIB))
            size = len(state)
            big = await cluster.attach(
                "n1",
                "big-state",
                restore_in_pieces=True,
                # Answered with the state's pieces (an iterable), read by the writer.
                on_record_state=lambda _: (state[at : at + PIECE] for at in range(0, size, PIECE)),
                retry_for=10,
            )
            small = Pump(
                await cluster.attach("n2", "small"),
                state=lambda _: b"small state",
            )
            # The big application's reader: its events go to the test, and it stops reading
            # (leaves the session's buffers to fill) after the first restore's first piece,
            # until the test lets it go on. Record requests are answered inside next_event.
            events: asyncio.Queue[AppEvent] = asyncio.Queue()
            reading = asyncio.Event()
            reading.set()
            pause_after_first_piece = True

            async def reader() -> None:
                nonlocal pause_after_first_piece
                while True:
                    await reading.wait()
                    event = await big.next_event()
                    if event is None:
                        return
                    if isinstance(event, RestorePiece) and pause_after_first_piece:
                        pause_after_first_piece = False
                        reading.clear()
                    await events.put(event)

            reading_task = asyncio.create_task(reader())

            async def next_event() -> AppEvent:
                return await asyncio.wait_for(events.get(), 30)

            snapshot = await cluster.snapshot("chandy-lamport", data=False)
            sizes = {n.node_id: n.local_state_bytes for n in snapshot.nodes}
            assert sizes == {"n1": size, "n2": len(b"small state")}, sizes
            snapshot_id = snapshot.plan.snapshot_id
            client = await cluster.client()

            # Restore 1: the application takes its first piece, then reads nothing more.
            first = await client.restore_snapshot(snapshot_id)
            event = await next_event()
            assert isinstance(event, RestorePiece), event
            assert (event.restore_id, event.snapshot_id) == (first.restore_id, snapshot_id)
            assert not event.last and event.piece == state[: len(event.piece)]
            handed = len(event.piece)
            # It fails (n1 never applies it): the coordinator's restore timeout.
            failed = await client.wait_restore(first.restore_id, timeout=RESTORE_TIMEOUT + 30)
            assert not failed.done and failed.HasField("failure"), failed
            assert "n1" in failed.failure.message, failed.failure
            # A snapshot cannot start until a restore is applied everywhere.
            try:
                await client.start_snapshot("unaligned")
                raise AssertionError("a snapshot started after a failed restore")
            except RpcError as e:
                assert "did not finish" in e.details, e

            # Restore 2 supersedes it: the application now reads on, and hears restore 1
            # abort before restore 2's pieces, which make up the whole state again.
            second_started = time.monotonic()
            second = await client.restore_snapshot(snapshot_id)
            assert second.epoch > first.epoch
            reading.set()
            aborted: RestoreAborted | None = None
            staged = bytearray()
            while True:
                event = await next_event()
                if isinstance(event, RestorePiece) and event.restore_id == first.restore_id:
                    assert aborted is None, "restore 1's pieces came after its abort"
                    assert not event.last, (
                        f"all {size} bytes of restore 1 reached the application while it did "
                        "not read (buffered on the way): the test needs a larger STATE_MIB"
                    )
                    assert event.piece == state[handed : handed + len(event.piece)]
                    handed += len(event.piece)
                elif isinstance(event, RestoreAborted):
                    assert event.restore_id == first.restore_id, event
                    aborted = event
                elif isinstance(event, RestorePiece):
                    assert aborted is not None, "restore 1's abort comes before restore 2"
                    assert event.restore_id == second.restore_id, event
                    staged += event.piece
                    if event.last:
                        break
                else:
                    raise AssertionError(f"unexpected {event}")
            assert aborted is not None
            assert 0 < handed < size, f"{handed} bytes of restore 1 were handed over"
            assert bytes(staged) == state, "restore 2 handed over the whole state"
            big.restore_applied(second.restore_id)
            done = await client.wait_restore(second.restore_id, timeout=60)
            second_took = time.monotonic() - second_started
            assert done.done and not done.HasField("failure"), done
            assert sorted(done.applied) == ["n1", "n2"]
            print(
                f"\nrestore 1 broke off after {handed} of {size} bytes "
                f"({aborted.reason!r}); restore 2 handed over all {len(staged)} in "
                f"{second_took:.1f} s"
            )

            # The cluster is whole again: the next snapshot completes, with the same state.
            again = await eventually(
                "a snapshot after the restore",
                lambda: cluster.snapshot("unaligned", data=False),
                harness=harness,
            )
            assert again.status == types_pb2.SNAPSHOT_STATUS_COMPLETED
            assert {n.node_id: n.local_state_bytes for n in again.nodes}["n1"] == size
            assert events.empty(), f"unexpected {events.get_nowait()}"
            await big.close()
            await asyncio.wait_for(reading_task, 10)
            await small.stop()

    run(body(), timeout=100)
