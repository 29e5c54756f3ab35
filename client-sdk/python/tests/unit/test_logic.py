"""The session's logic that needs no server: packed runs, state chunks, the send window,
early record requests, restore staging (ported from the Rust SDK's unit tests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cairn import Message, ProtocolError, Restore, RestoreAborted, RestorePiece, SessionClosedError
from cairn._early import ANSWERED_MEMORY, Copies, EarlyRecords
from cairn._packing import (
    STATE_CHUNK,
    chunks,
    pack_sends,
    rechunk,
    rechunk_async,
    unpack_deliveries,
)
from cairn._staging import RestoreStaging
from cairn._window import SEND_ROOM, Circulation, Confirmed, Room
from cairn.events import AppEvent
from cairn.v1 import app_pb2

from fake_daemon import run


def test_sends_are_packed_into_runs_per_destination() -> None:
    batch = pack_sends([("a", b"1"), ("a", b"22"), ("b", b""), ("a", b"333")]).send
    assert not batch.messages
    assert [(r.to, r.payloads, list(r.lengths)) for r in batch.runs] == [
        ("a", b"122", [1, 2]),
        ("b", b"", [0]),
        ("a", b"333", [3]),
    ]


def test_deliveries_are_unpacked_and_bounded() -> None:
    batch = app_pb2.DeliverBatch()
    m = batch.messages.add(payload=b"m")
    setattr(m, "from", "x")
    r = batch.runs.add(payloads=b"abcEXTRA", lengths=[1, 2])
    setattr(r, "from", "y")
    assert unpack_deliveries(batch) == [Message("x", b"m"), Message("y", b"a"), Message("y", b"bc")]
    r.lengths.append(10)
    with pytest.raises(ProtocolError):
        unpack_deliveries(batch)
    # A huge length cannot make the SDK read past the blob.
    bad = app_pb2.DeliverBatch()
    bad.runs.add(payloads=b"", lengths=[0xFFFF_FFFF])
    with pytest.raises(ProtocolError):
        unpack_deliveries(bad)


def test_states_are_cut_into_chunks() -> None:
    assert list(chunks(b"")) == [(b"", True)]
    assert list(chunks(b"abc")) == [(b"abc", True)]
    state = bytes(2 * STATE_CHUNK + 1)
    out = list(chunks(state))
    assert [len(c) for c, _ in out] == [STATE_CHUNK, STATE_CHUNK, 1]
    assert [last for _, last in out] == [False, False, True]
    assert list(chunks(bytes(STATE_CHUNK))) == [(bytes(STATE_CHUNK), True)]


def test_pieces_are_rechunked_with_the_last_marked() -> None:
    assert list(rechunk([])) == [(b"", True)]
    assert list(rechunk([b"", b""])) == [(b"", True)]
    assert list(rechunk([b"a", b"", b"b"])) == [(b"a", False), (b"b", True)]
    big = [b"x" * (STATE_CHUNK + 1)]
    assert [(len(c), last) for c, last in rechunk(big)] == [(STATE_CHUNK, False), (1, True)]

    async def pieces() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    async def collect() -> list[tuple[bytes, bool]]:
        return [item async for item in rechunk_async(pieces())]

    assert asyncio.run(collect()) == [(b"a", False), (b"b", True)]


def test_the_permits_in_circulation_follow_the_advised_window() -> None:
    c = Circulation()
    room = SEND_ROOM
    assert c.taken(100, None) == 100, "no advice: every permit comes back"
    # The window shrinks to 256: what comes back is held back until fewer than 256 permits
    # are left in circulation.
    assert c.taken(100, 256) == 0, "8,092 left: none back"
    assert c.taken(room - 300, 256) == 56, "200 left: back to 256"
    assert c.taken(200, 256) == 200, "at the window: each one back"
    # It grows back without a send taken.
    assert c.taken(0, 1024) == 768
    # A window past the SDK's bound, or of 0, is held to 1..=SEND_ROOM.
    assert c.taken(0, 2**64 - 1) == room - 1024
    assert c.taken(room, 0) == 1
    # A daemon that returns more than is out cannot underflow.
    assert c.taken(2**64 - 1, None) == room


@run
async def test_room_is_fifo_partial_and_closable() -> None:
    room = Room(2)
    assert room.try_acquire()
    assert await room.acquire() == 1
    assert not room.try_acquire()
    first = asyncio.create_task(room.acquire(2))
    await asyncio.sleep(0)
    second = asyncio.create_task(room.acquire(5, partial=True))
    await asyncio.sleep(0)
    room.add(1)
    await asyncio.sleep(0)
    assert not first.done() and not second.done(), "the head wants 2; the next waits behind it"
    room.add(2)
    assert await first == 2
    assert await second == 1, "partial: what there is"
    # A cancelled waiter gives what it was given back.
    waiter = asyncio.create_task(room.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    room.add(1)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert room.available == 1
    # Closing fails waiters and later calls.
    assert await room.acquire() == 1
    blocked = asyncio.create_task(room.acquire())
    await asyncio.sleep(0)
    room.close()
    with pytest.raises(SessionClosedError):
        await blocked
    with pytest.raises(SessionClosedError):
        await room.acquire()
    with pytest.raises(SessionClosedError):
        room.try_acquire()


@run
async def test_confirmed_never_goes_back() -> None:
    c = Confirmed()
    waiting = asyncio.create_task(c.wait(3))
    c.confirm(2)
    await asyncio.sleep(0)
    assert not waiting.done()
    c.confirm(1)
    c.confirm(3)
    assert await waiting
    assert c.count == 3
    late = asyncio.create_task(c.wait(5))
    await asyncio.sleep(0)
    c.close()
    assert not await late
    c.confirm(10)
    assert c.count == 3, "nothing after close"


def test_each_record_request_is_answered_once_at_the_first_copy_met() -> None:
    c = Copies()
    # Early first: the in-band copy is skipped.
    assert c.early(1)
    assert not c.in_band(1, True)
    # In band first: the early copy is skipped...
    assert c.in_band(2, True)
    assert not c.early(2)
    # ...even when it comes with the stream's end: the copies that came are met before what
    # was answered in band is forgotten.
    assert c.in_band(3, True)
    due = EarlyRecords()
    due.arrived([3, 4], ended=True)
    assert c.take_early(due) == 4, "3 was answered in band"
    assert c.take_early(due) is None
    assert not c.answered_in_band, "no early copy comes any more"
    # A request with no early copy is answered in band, and nothing is remembered.
    assert c.in_band(5, False)
    assert not c.answered_in_band
    # Each is met once more at most: memory does not grow.
    assert not c.in_band(4, True)
    assert not c.answered_early and not c.answered_in_band


def test_early_copies_and_answers_are_bounded() -> None:
    woken: list[int] = []
    due = EarlyRecords(lambda: woken.append(1))
    due.arrived(range(5 * ANSWERED_MEMORY))
    assert len(due.ids) == ANSWERED_MEMORY and due.ids[0] == 4 * ANSWERED_MEMORY
    assert woken
    c = Copies()
    for i in range(3 * ANSWERED_MEMORY):
        c.early(i)
        c.in_band(10**9 + i, True)
    assert len(c.answered_early) == ANSWERED_MEMORY
    assert len(c.answered_in_band) == ANSWERED_MEMORY
    assert min(c.answered_early) == 2 * ANSWERED_MEMORY, "the oldest go first"


def _piece(restore_id: str, chunk: bytes, last: bool) -> app_pb2.Restore:
    return app_pb2.Restore(restore_id=restore_id, snapshot_id=7, epoch=1, chunk=chunk, last=last)


def _aborted(restore_id: str) -> app_pb2.RestoreAborted:
    return app_pb2.RestoreAborted(restore_id=restore_id, reason="broke")


def test_pieces_are_gathered_into_one_restore_and_a_broken_one_is_dropped() -> None:
    staging = RestoreStaging()
    out: list[AppEvent] = []
    staging.piece(_piece("r1", b"ab", False), out.append)
    staging.piece(_piece("r1", b"cd", False), out.append)
    assert not out
    staging.piece(_piece("r1", b"e", True), out.append)
    assert out == [Restore("r1", 7, b"abcde")]
    out.clear()
    # r2 breaks off; r3 superseded by r4 mid-way: neither is handed over, and r4 holds none
    # of their bytes.
    staging.piece(_piece("r2", b"xx", False), out.append)
    staging.aborted(_aborted("r2"), out.append)
    staging.piece(_piece("r3", b"yy", False), out.append)
    staging.piece(_piece("r4", b"z", True), out.append)
    assert out == [Restore("r4", 7, b"z")]


def test_in_pieces_each_piece_is_handed_over_and_a_broken_restore_is_told() -> None:
    staging = RestoreStaging(in_pieces=True)
    out: list[AppEvent] = []
    staging.piece(_piece("r1", b"ab", False), out.append)
    staging.piece(_piece("r1", b"c", True), out.append)
    staging.aborted(_aborted("r1"), out.append)  # done already: nothing to abort
    staging.piece(_piece("r2", b"x", False), out.append)
    staging.aborted(_aborted("r2"), out.append)
    staging.piece(_piece("r3", b"y", False), out.append)
    staging.piece(_piece("r4", b"", True), out.append)
    assert out == [
        RestorePiece("r1", 7, b"ab", False),
        RestorePiece("r1", 7, b"c", True),
        RestorePiece("r2", 7, b"x", False),
        RestoreAborted("r2", "broke"),
        RestorePiece("r3", 7, b"y", False),
        RestoreAborted("r3", "superseded by restore r4"),
        RestorePiece("r4", 7, b"", True),
    ]
