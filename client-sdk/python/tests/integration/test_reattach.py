"""Reattaching after a daemon restart: ``kill -9`` of a daemon ends its application's
session; the application attaches again to the restarted daemon (``retry_for``), naming
``snapshot_outcomes_after`` to hear the snapshots' ends again, and goes on sending and
receiving, and taking part in snapshots."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from cairn import AppSession, SnapshotCompleted

from .apps import Pump, numbered
from .cluster import Cluster, Harness, eventually, run

#: Messages each way, before and after the restart.
N = 1500


async def exchange(a: AppSession, b: AppSession, start: int, pump_a: Pump, pump_b: Pump) -> None:
    """Sends messages ``start`` to ``start + N - 1`` each way and waits until they arrived."""
    await a.send_many([("n2", numbered(i)) for i in range(start, start + N)])
    await b.send_many([("n1", numbered(i)) for i in range(start, start + N)])
    await pump_b.until("n2 got n1's messages", lambda: pump_b.received_from("n1") == start + N)
    await pump_a.until("n1 got n2's messages", lambda: pump_a.received_from("n2") == start + N)


def test_an_application_reattaches_after_its_daemon_is_killed(harness: Harness) -> None:
    async def body() -> None:
        async with await Cluster.start(harness, ["n1", "n2"]) as cluster:
            a = await cluster.attach("n1", "reattacher", snapshot_outcomes_after=0, retry_for=0)
            b = await cluster.attach("n2", "stays")
            pump_a, pump_b = Pump(a, state=lambda _: b"a"), Pump(b, state=lambda _: b"b")
            await exchange(a, b, 0, pump_a, pump_b)
            first = (await cluster.snapshot("chandy-lamport", data=False)).plan.snapshot_id
            second = (await cluster.snapshot("unaligned", data=False)).plan.snapshot_id
            await pump_a.until("both outcomes heard", lambda: len(pump_a.outcomes) == 2)
            assert pump_a.outcomes == [SnapshotCompleted(first), SnapshotCompleted(second)]
            assert a.outcomes_heard == second
            incarnation = a.incarnation

            # kill -9: the session ends (the stream breaks, or the daemon's end is read).
            await cluster.kill_node("n1")
            await pump_a.until("the session ended", lambda: pump_a.end is not None)
            assert a.closed
            await a.close()
            cluster.start_node("n1")
            # Attach again as soon as the daemon is up, and hear the ends again from the
            # first one on (the application says it acted on those before `first`).
            a = await cluster.attach(
                "n1", "reattacher", snapshot_outcomes_after=first - 1, retry_for=30
            )
            assert a.incarnation != incarnation, "a new daemon process"
            pump_a = Pump(a, state=lambda _: b"a again")
            await pump_a.until(
                "the ends heard again", lambda: len(pump_a.outcomes) == 2, timeout=30
            )
            assert pump_a.outcomes == [SnapshotCompleted(first), SnapshotCompleted(second)]
            assert a.outcomes_heard == second

            # It keeps working: messages both ways once the channels are back…
            await cluster.wait_wired(app=True)
            await eventually("n1 knows n2 again", _peer_known(a, "n2"), harness=harness)
            pump_a.expect_from("n2", N)
            await exchange(a, b, N, pump_a, pump_b)
            assert pump_a.count == N and pump_b.count == 2 * N
            # …and snapshots, whose ends it hears once.
            third = (await cluster.snapshot("aligned", data=False)).plan.snapshot_id
            await pump_a.until("the new end heard", lambda: len(pump_a.outcomes) == 3)
            assert pump_a.outcomes[-1] == SnapshotCompleted(third) and third > second
            assert a.outcomes_heard == third
            assert pump_a.records == [third], "the new session recorded the new snapshot"
            await pump_a.stop()
            await pump_b.stop()

    run(body(), timeout=90)


def _peer_known(session: AppSession, peer: str) -> Callable[[], Awaitable[None]]:
    """A check that ``peer`` is among ``session``'s peers."""

    async def check() -> None:
        assert peer in session.peers, f"peers: {sorted(session.peers)}"

    return check
