"""The session against an in-process fake of the daemon's App service: attach, packed
deliveries and their acknowledgements, sends and the send window, record requests (in band,
early, in chunks, by callback), restores (whole, in pieces, aborted), peers, outcomes, and
how the session ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from cairn import (
    AppSession,
    ConnectError,
    Message,
    PeersChanged,
    ProtocolError,
    RecordState,
    Restore,
    RestoreAborted,
    RestorePiece,
    RpcError,
    SessionClosedError,
    SnapshotAborted,
    SnapshotCompleted,
    UnknownPeerError,
)
from cairn import session as session_module
from cairn._packing import STATE_CHUNK
from cairn._window import SEND_ROOM
from cairn.v1 import app_pb2

from fake_daemon import FakeDaemon, run, serving, within


@contextlib.asynccontextmanager
async def attached(daemon: FakeDaemon, **options: object) -> AsyncIterator[AppSession]:
    async with serving(daemon) as address:
        session = await AppSession.connect(address, "test-app", **options)  # type: ignore[arg-type]
        try:
            yield session
        finally:
            await session.close(drain=0)


def state_of(messages: list[app_pb2.AppToNode]) -> bytes:
    return b"".join(m.state_recorded.chunk for m in messages)


@run
async def test_attach_asks_for_packed_deliveries_windows_and_outcomes() -> None:
    daemon = FakeDaemon(peers=["n2", "n3"])
    async with attached(daemon, snapshot_outcomes_after=5) as session:
        assert daemon.attach is not None
        assert daemon.attach.application == "test-app"
        assert daemon.attach.packed_deliveries and daemon.attach.acknowledges_deliveries
        assert daemon.attach.HasField("snapshot_outcomes_after")
        assert daemon.attach.snapshot_outcomes_after == 5
        assert (session.node_id, session.cluster, session.incarnation) == ("n1", "test", 1234)
        assert session.peers == {"n2", "n3"}
        assert session.outcomes_heard == 5
        # The flow stream is open before connect returns, presenting the session's key.
        first = await daemon.next_consumption()
        assert (first.session, first.flow_key, first.messages, first.bytes) == (7, 99, 0, 0)
        assert session.flow_control
    daemon = FakeDaemon()
    async with attached(daemon) as session:
        assert daemon.attach is not None and not daemon.attach.HasField("snapshot_outcomes_after")
        assert session.outcomes_heard == 0


@run
async def test_deliveries_come_in_order_and_are_acknowledged() -> None:
    daemon = FakeDaemon()
    async with attached(daemon) as session:
        await daemon.next_consumption()
        batch = app_pb2.DeliverBatch()
        plain = batch.messages.add(payload=b"m0")
        setattr(plain, "from", "n3")
        run_ = batch.runs.add(payloads=b"abcdef", lengths=[1, 2, 0, 3])
        setattr(run_, "from", "n2")
        await daemon.send(deliver=batch)
        await daemon.deliver_runs(("n3", [b"x", b"yy"]))
        got = [await within(session.next_event()) for _ in range(7)]
        assert got == [
            Message("n3", b"m0"),
            Message("n2", b"a"),
            Message("n2", b"bc"),
            Message("n2", b""),
            Message("n2", b"def"),
            Message("n3", b"x"),
            Message("n3", b"yy"),
        ]
        # Everything taken: acknowledged before the session waits for more.
        waiting = asyncio.create_task(session.next_event())
        consumption = await daemon.next_consumption(7)
        assert (consumption.messages, consumption.bytes) == (7, 2 + 1 + 2 + 0 + 3 + 1 + 2)
        assert (consumption.session, consumption.flow_key) == (7, 99)
        waiting.cancel()


@run
async def test_a_long_run_is_acknowledged_while_it_is_consumed() -> None:
    daemon = FakeDaemon()
    async with attached(daemon) as session:
        await daemon.next_consumption()
        await daemon.deliver_runs(("n2", [b"p"] * 1000))
        for _ in range(600):
            await within(session.next_event())
        # Every 256 consumed, even with more buffered.
        consumption = await daemon.next_consumption(256)
        assert consumption.messages in (256, 512)


@run
async def test_sends_are_packed_into_runs_in_order() -> None:
    daemon = FakeDaemon(peers=["n2", "n3"])
    async with attached(daemon) as session:
        await session.send("n2", b"a")
        await session.send("n2", bytearray(b"bb"))
        await session.send("n3", memoryview(b"c"))
        assert await session.send_many([("n3", b"d"), ("n2", b"e")]) == 2
        permit = await session.reserve()
        permit.send("n3", b"f")
        with pytest.raises(RuntimeError):
            permit.send("n3", b"again")
        sent = await daemon.sent_messages(6)
        assert sent == [
            ("n2", b"a"),
            ("n2", b"bb"),
            ("n3", b"c"),
            ("n3", b"d"),
            ("n2", b"e"),
            ("n3", b"f"),
        ]
        with pytest.raises(UnknownPeerError):
            await session.send("n9", b"x")
        with pytest.raises(UnknownPeerError):
            await session.send_many([("n2", b"ok"), ("n9", b"x")])
        # A permit whose send is refused goes back.
        free = session._room.available
        permit = await session.reserve()
        with pytest.raises(UnknownPeerError):
            permit.send("n9", b"x")
        assert session._room.available == free


@run
async def test_a_batch_is_at_most_256_messages_and_runs_group_destinations() -> None:
    daemon = FakeDaemon(peers=["n2", "n3"])
    async with attached(daemon) as session:
        messages = [("n2" if i % 100 < 50 else "n3", i.to_bytes(4, "big")) for i in range(600)]
        await session.send_many(messages)
        batches = []
        total = 0
        while total < 600:
            batch = (await daemon.next_from_app("send")).send
            batches.append(batch)
            total += sum(len(r.lengths) for r in batch.runs)
        assert all(sum(len(r.lengths) for r in b.runs) <= 256 for b in batches)
        flat = [
            (r.to, r.payloads[4 * i : 4 * i + 4])
            for b in batches
            for r in b.runs
            for i in range(len(r.lengths))
        ]
        assert flat == messages
        # Consecutive messages to one node share a run.
        assert all(len(r.lengths) > 1 for b in batches for r in b.runs[1:-1])


@run
async def test_the_send_window_waits_for_what_the_daemon_takes() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        await session.send_many([("n2", b"x")] * SEND_ROOM)
        blocked = asyncio.create_task(session.send("n2", b"one more"))
        await asyncio.sleep(0.1)
        assert not blocked.done(), "the window is full"
        # The daemon takes 10 (and advises a window of 1000): the window shrinks to 1000,
        # so nothing comes back until fewer than 1000 are out.
        await daemon.taken.put(app_pb2.Taken(messages=10, window=1000))
        await asyncio.sleep(0.1)
        assert not blocked.done()
        await daemon.taken.put(app_pb2.Taken(messages=SEND_ROOM - 999, window=1000))
        await within(blocked)
        # A confused daemon cannot return more than was written.
        await daemon.taken.put(app_pb2.Taken(messages=10**12))
        await asyncio.sleep(0.1)
        assert session._room.available <= SEND_ROOM


@run
async def test_flushed_waits_until_the_daemon_took_every_send() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        await session.send_many([("n2", b"x")] * 3)
        flushed = asyncio.create_task(session.flushed())
        await daemon.sent_messages(3)
        await asyncio.sleep(0.05)
        assert not flushed.done()
        await daemon.taken.put(app_pb2.Taken(messages=2))
        await asyncio.sleep(0.05)
        assert not flushed.done()
        await daemon.taken.put(app_pb2.Taken(messages=3))
        await within(flushed)
        # The flow stream ends: what is not confirmed is not confirmed now.
        await session.send("n2", b"y")
        flushed = asyncio.create_task(session.flushed())
        await daemon.taken.put(None)
        with pytest.raises(SessionClosedError):
            await within(flushed)


@run
async def test_a_record_request_in_band_cuts_after_every_message_before_it() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        await daemon.deliver_runs(("n2", [b"a", b"b"]))
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=3))
        assert await within(session.next_event()) == Message("n2", b"a")
        assert await within(session.next_event()) == Message("n2", b"b")
        assert await within(session.next_event()) == RecordState(3)
        await session.send("n2", b"before")
        big = bytes(range(256)) * (STATE_CHUNK * 2 // 256 + 7)
        session.state_recorded(3, big)
        await session.send("n2", b"after")
        with pytest.raises(ValueError):
            session.state_recorded(3, b"twice")
        with pytest.raises(ValueError):
            session.state_recorded(4, b"never asked")
        order: list[str | None] = []
        chunks = []
        while len(order) < 3 or order[-1] != "send":
            m = await daemon.next_from_app()
            order.append(m.WhichOneof("kind"))
            if m.HasField("state_recorded"):
                chunks.append(m)
        assert order == ["send", "state_recorded", "state_recorded", "state_recorded", "send"]
        assert [m.state_recorded.last for m in chunks] == [False, False, True]
        assert all(len(m.state_recorded.chunk) <= STATE_CHUNK for m in chunks)
        assert state_of(chunks) == big
        # The cut is the first chunk's, after both messages.
        assert (
            chunks[0].state_recorded.HasField("consumed") and chunks[0].state_recorded.consumed == 2
        )
        assert not any(m.state_recorded.HasField("consumed") for m in chunks[1:])


@run
async def test_an_early_record_request_cuts_between_two_messages() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        await daemon.deliver_runs(("n2", [b"%d" % i for i in range(10)]))
        for i in range(3):
            assert await within(session.next_event()) == Message("n2", b"%d" % i)
        # The request overtakes the seven messages the session holds...
        await daemon.taken.put(app_pb2.Taken(record_state=[5]))
        await asyncio.sleep(0.1)
        assert await within(session.next_event()) == RecordState(5)
        session.state_recorded(5, b"state")
        recorded = (await daemon.next_from_app("state_recorded")).state_recorded
        assert (recorded.snapshot_id, recorded.consumed, recorded.last) == (5, 3, True)
        # ...and its copy in band, once the rest were consumed, is skipped.
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=5, early_copy=True))
        await daemon.send(snapshot_completed=app_pb2.SnapshotCompleted(snapshot_id=1))
        rest = [await within(session.next_event()) for _ in range(8)]
        assert rest == [Message("n2", b"%d" % i) for i in range(3, 10)] + [SnapshotCompleted(1)]


@run
async def test_a_request_met_in_band_first_skips_its_early_copy() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=8, early_copy=True))
        assert await within(session.next_event()) == RecordState(8)
        session.state_recorded(8, b"s")
        await daemon.taken.put(app_pb2.Taken(record_state=[8]))
        await daemon.deliver_runs(("n2", [b"m"]))
        assert await within(session.next_event()) == Message("n2", b"m")


@run
async def test_a_callback_answers_record_requests_in_pieces() -> None:
    daemon = FakeDaemon(peers=["n2"])
    answers: list[int] = []

    def pieces(snapshot_id: int) -> Iterator[bytes]:
        answers.append(snapshot_id)
        yield b"x" * (STATE_CHUNK + 10)
        yield b""
        yield b"tail"

    async with attached(daemon, on_record_state=pieces) as session:
        await daemon.deliver_runs(("n2", [b"a"]))
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=1))
        await daemon.deliver_runs(("n2", [b"b"]))
        # The request is not handed out: the callback answered it.
        assert await within(session.next_event()) == Message("n2", b"a")
        assert await within(session.next_event()) == Message("n2", b"b")
        assert answers == [1]
        # Pieces are cut to 256 KiB (not merged); empty ones are skipped.
        chunks = [await daemon.next_from_app("state_recorded") for _ in range(3)]
        assert [len(c.state_recorded.chunk) for c in chunks] == [STATE_CHUNK, 10, 4]
        assert [c.state_recorded.last for c in chunks] == [False, False, True]
        assert chunks[0].state_recorded.consumed == 1

        async def later(snapshot_id: int) -> bytes | None:
            await asyncio.sleep(0.01)
            return None if snapshot_id == 2 else b"async"

        session.set_record_state_callback(later)
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=2))
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=3))
        await daemon.deliver_runs(("n2", [b"c"]))
        assert await within(session.next_event()) == Message("n2", b"c")
        recorded = (await daemon.next_from_app("state_recorded")).state_recorded
        assert (recorded.snapshot_id, recorded.chunk, recorded.last) == (3, b"async", True)


@run
async def test_an_empty_state_and_async_pieces() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=1))
        assert await within(session.next_event()) == RecordState(1)
        session.state_recorded(1, b"")
        recorded = (await daemon.next_from_app("state_recorded")).state_recorded
        assert (recorded.chunk, recorded.last, recorded.consumed) == (b"", True, 0)

        async def pieces() -> AsyncIterator[bytes]:
            for piece in (b"ab", b"cd"):
                await asyncio.sleep(0)
                yield piece

        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=2))
        assert await within(session.next_event()) == RecordState(2)
        session.state_recorded(2, pieces())
        await session.send("n2", b"after")
        first = await daemon.next_from_app()
        second = await daemon.next_from_app()
        third = await daemon.next_from_app()
        assert [first.state_recorded.chunk, second.state_recorded.chunk] == [b"ab", b"cd"]
        assert [first.state_recorded.last, second.state_recorded.last] == [False, True]
        assert third.WhichOneof("kind") == "send"


@run
async def test_pieces_that_fail_half_way_end_the_session() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:

        def broken() -> Iterator[bytes]:
            yield b"a"
            yield b"b"
            raise OSError("disk gone")

        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=1))
        assert await within(session.next_event()) == RecordState(1)
        session.state_recorded(1, broken())
        with pytest.raises(ProtocolError, match="disk gone"):
            await within(session.next_event())
        assert session.closed
        with pytest.raises(SessionClosedError):
            await session.send("n2", b"x")


@run
async def test_pieces_that_fail_before_the_first_leave_the_request_unanswered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:

        class Unreadable:
            def __iter__(self) -> Iterator[bytes]:
                raise OSError("nothing to read")

        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=1))
        assert await within(session.next_event()) == RecordState(1)
        with caplog.at_level(logging.ERROR, "cairn.session"):
            session.state_recorded(1, Unreadable())
            await session.send("n2", b"goes on")
            assert (await daemon.next_from_app()).WhichOneof("kind") == "send"
        assert "snapshot 1 is not answered" in caplog.text
        assert not session.closed


@run
async def test_a_restore_is_gathered_and_acknowledged() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        for chunk, last in ((b"ab", False), (b"cd", False), (b"e", True)):
            await daemon.send(
                restore=app_pb2.Restore(
                    restore_id="r1", snapshot_id=4, epoch=1, chunk=chunk, last=last
                )
            )
        await daemon.deliver_runs(("n2", [b"in flight"]))
        assert await within(session.next_event()) == Restore("r1", 4, b"abcde")
        session.restore_applied("r1")
        session.restore_applied("r1")  # once only
        session.restore_applied("other")  # not the pending one
        applied = await daemon.next_from_app("restore_applied")
        assert applied.restore_applied.restore_id == "r1"
        assert await within(session.next_event()) == Message("n2", b"in flight")
        # One the application does not acknowledge is acknowledged at its next call.
        await daemon.send(
            restore=app_pb2.Restore(restore_id="r2", snapshot_id=5, chunk=b"z", last=True)
        )
        assert await within(session.next_event()) == Restore("r2", 5, b"z")
        pending = asyncio.create_task(session.next_event())
        applied = await daemon.next_from_app("restore_applied")
        assert applied.restore_applied.restore_id == "r2"
        pending.cancel()
        assert daemon.from_app.empty()


@run
async def test_a_restore_in_pieces_may_break_off() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon, restore_in_pieces=True) as session:

        async def piece(restore_id: str, chunk: bytes, last: bool) -> None:
            await daemon.send(
                restore=app_pb2.Restore(
                    restore_id=restore_id, snapshot_id=7, chunk=chunk, last=last
                )
            )

        await piece("r1", b"ab", False)
        await daemon.send(restore_aborted=app_pb2.RestoreAborted(restore_id="r1", reason="lost"))
        await piece("r2", b"x", False)
        await piece("r3", b"y", True)
        events = [await within(session.next_event()) for _ in range(5)]
        assert events == [
            RestorePiece("r1", 7, b"ab", False),
            RestoreAborted("r1", "lost"),
            RestorePiece("r2", 7, b"x", False),
            RestoreAborted("r2", "superseded by restore r3"),
            RestorePiece("r3", 7, b"y", True),
        ]
        session.restore_applied("r3")
        assert (await daemon.next_from_app("restore_applied")).restore_applied.restore_id == "r3"
        # Gathered again from now on; an abort of a whole restore's pieces says nothing.
        session.set_restore_in_pieces(False)
        await piece("r4", b"p", False)
        await daemon.send(restore_aborted=app_pb2.RestoreAborted(restore_id="r4", reason="lost"))
        await piece("r5", b"q", True)
        assert await within(session.next_event()) == Restore("r5", 7, b"q")


@run
async def test_outcomes_are_handed_out_once_in_order_and_peers_change() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon, snapshot_outcomes_after=2) as session:
        await daemon.send(snapshot_completed=app_pb2.SnapshotCompleted(snapshot_id=2))  # heard
        await daemon.send(snapshot_aborted=app_pb2.SnapshotAborted(snapshot_id=3, reason="timeout"))
        await daemon.send(snapshot_completed=app_pb2.SnapshotCompleted(snapshot_id=3))  # again
        await daemon.send(snapshot_completed=app_pb2.SnapshotCompleted(snapshot_id=4))
        await daemon.send(peers=app_pb2.Peers(peers=["n2", "n4"]))
        assert await within(session.next_event()) == SnapshotAborted(3, "timeout")
        assert await within(session.next_event()) == SnapshotCompleted(4)
        assert session.outcomes_heard == 4
        assert await within(session.next_event()) == PeersChanged(frozenset({"n2", "n4"}))
        assert session.peers == {"n2", "n4"}
        await session.send("n4", b"to the newcomer")
        assert await daemon.sent_messages(1) == [("n4", b"to the newcomer")]


@run
async def test_a_run_shorter_than_its_lengths_is_a_protocol_error() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        batch = app_pb2.DeliverBatch()
        bad = batch.runs.add(payloads=b"abc", lengths=[2, 2])
        setattr(bad, "from", "n2")
        await daemon.send(deliver=batch)
        with pytest.raises(ProtocolError, match="shorter than its lengths"):
            await within(session.next_event())
        with pytest.raises(ProtocolError):
            await within(session.next_event())


@run
async def test_the_daemon_ending_the_session() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with attached(daemon) as session:
        await daemon.deliver_runs(("n2", [b"last"]))
        await daemon.to_app.put(None)
        events = [event async for event in session]
        assert events == [Message("n2", b"last")]
        assert await within(session.next_event()) is None
        with pytest.raises(SessionClosedError):
            await session.send("n2", b"x")
        assert session.closed


@run
async def test_a_refused_flow_stream_leaves_the_session_without_windows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon = FakeDaemon(peers=["n2"], consumed="refuse")
    with caplog.at_level(logging.WARNING, "cairn.session"):
        async with attached(daemon) as session:
            assert not session.flow_control
            # Room comes back as sends are written; flushed is confirmed as they are.
            await session.send_many([("n2", b"x")] * (SEND_ROOM + 100))
            await within(session.flushed())
            await daemon.deliver_runs(("n2", [b"m"]))
            assert await within(session.next_event()) == Message("n2", b"m")
    assert "refused the flow-control stream" in caplog.text


@run
async def test_a_silent_flow_stream_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "CONSUMED_OPEN_TIMEOUT", 0.3)
    daemon = FakeDaemon(peers=["n2"], consumed="silent")
    async with attached(daemon) as session:
        assert not session.flow_control
        await session.send("n2", b"x")
        await within(session.flushed())


@run
async def test_a_daemon_without_flow_control() -> None:
    daemon = FakeDaemon(peers=["n2"], session=0)
    async with attached(daemon) as session:
        assert daemon.consumed_calls == 0
        await session.send_many([("n2", b"x")] * (SEND_ROOM + 1))
        await within(session.flushed())
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=1))
        assert await within(session.next_event()) == RecordState(1)


@run
async def test_connect_errors() -> None:
    # Nothing listens: a retryable ConnectError (and retry_for keeps trying).
    async with serving(FakeDaemon()) as address:
        pass
    with pytest.raises(ConnectError) as refused:
        await AppSession.connect(address)
    assert refused.value.retryable
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ConnectError):
        await AppSession.connect(address, retry_for=0.5)
    assert loop.time() - started >= 0.3
    with pytest.raises(ConnectError, match="no port"):
        await AppSession.connect("localhost")
    # A session is attached already: FAILED_PRECONDITION, not retryable.
    daemon = FakeDaemon(attach_error=grpc.StatusCode.FAILED_PRECONDITION)
    async with serving(daemon) as address:
        with pytest.raises(RpcError) as busy:
            await AppSession.connect(address, retry_for=5)
        assert busy.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert not busy.value.retryable


@run
async def test_connect_retries_until_the_daemon_is_up() -> None:
    daemon = FakeDaemon()
    server = grpc.aio.server()
    from cairn.v1 import app_pb2_grpc

    app_pb2_grpc.add_AppServicer_to_server(daemon, server)
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    connecting = asyncio.create_task(AppSession.connect(address, retry_for=10))
    await asyncio.sleep(0.3)
    await server.start()
    session = await within(connecting)
    assert session.node_id == "n1"
    await session.close()
    await server.stop(0)


@run
async def test_close_fails_waiting_sends_and_ends_iteration() -> None:
    daemon = FakeDaemon(peers=["n2"])
    async with serving(daemon) as address:
        session = await AppSession.connect(address)
        await session.send_many([("n2", b"x")] * SEND_ROOM)
        blocked = asyncio.create_task(session.send("n2", b"y"))
        await asyncio.sleep(0.05)
        await session.close()
        with pytest.raises(SessionClosedError):
            await within(blocked)
        assert await session.next_event() is None
        with pytest.raises(SessionClosedError):
            await session.reserve()
