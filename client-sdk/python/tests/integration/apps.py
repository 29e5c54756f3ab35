"""Python applications the integration tests run on real daemons: numbered messages, and an
event pump that checks what arrives and answers the daemon."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from cairn import (
    AppEvent,
    AppSession,
    CairnError,
    Message,
    PeersChanged,
    RecordState,
    Restore,
    SnapshotAborted,
    SnapshotCompleted,
)


def numbered(i: int, size: int = 8) -> bytes:
    """Message ``i`` of a sequence: ``i`` as 8 bytes big-endian, padded to ``size``."""
    return i.to_bytes(8, "big") + bytes(max(0, size - 8))


def number_of(payload: bytes) -> int:
    """The number of a :func:`numbered` message."""
    return int.from_bytes(payload[:8], "big")


class Pump:
    """Runs a session's events in a task of its own: numbered messages are checked, per
    sender, to come in order from 0 (or from where :meth:`expect_from` says), record
    requests are answered with ``state(pump)`` at the cut, whole restores are applied at once
    (``on_restore``), and outcomes and peer changes are kept."""

    def __init__(
        self,
        session: AppSession,
        *,
        state: Callable[[Pump], bytes] | None = None,
        on_restore: Callable[[Restore], None] | None = None,
    ) -> None:
        """Starts pumping ``session``'s events."""
        self.session = session
        self._state: Callable[[Pump], bytes] = state or (lambda _: b"")
        self._on_restore = on_restore
        #: Per sender, the number of the next message expected.
        self.next: dict[str, int] = {}
        #: Messages received, all senders.
        self.count = 0
        #: Order violations seen (at most a few are kept).
        self.errors: list[str] = []
        #: Snapshot ids recorded, in order.
        self.records: list[int] = []
        #: Outcomes heard, in order.
        self.outcomes: list[SnapshotCompleted | SnapshotAborted] = []
        #: Other events.
        self.other: list[AppEvent] = []
        #: How the session ended: ``None`` while it runs, else the error or "closed".
        self.end: CairnError | str | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    def expect_from(self, sender: str, number: int) -> None:
        """From now on, ``sender``'s messages continue at ``number``."""
        self.next[sender] = number

    def received_from(self, sender: str) -> int:
        """The number of the next message expected from ``sender`` (messages so far)."""
        return self.next.get(sender, 0)

    async def _run(self) -> None:
        """The event loop of the application."""
        session = self.session
        try:
            async for event in session:
                if type(event) is Message:
                    expected = self.next.get(event.sender, 0)
                    got = number_of(event.payload)
                    if got != expected and len(self.errors) < 10:
                        self.errors.append(f"from {event.sender}: expected {expected}, got {got}")
                    self.next[event.sender] = got + 1
                    self.count += 1
                    now = time.monotonic()
                    if self.first_at is None:
                        self.first_at = now
                    self.last_at = now
                elif isinstance(event, RecordState):
                    self.records.append(event.snapshot_id)
                    session.state_recorded(event.snapshot_id, self._state(self))
                elif isinstance(event, Restore):
                    if self._on_restore is not None:
                        self._on_restore(event)
                    session.restore_applied(event.restore_id)
                elif isinstance(event, (SnapshotCompleted, SnapshotAborted)):
                    self.outcomes.append(event)
                elif isinstance(event, PeersChanged):
                    pass  # session.peers holds them
                else:
                    self.other.append(event)
                self._changed.set()
            self.end = "closed"
        except CairnError as e:
            self.end = e
        finally:
            if self.end is None:
                self.end = "cancelled"
            self._changed.set()

    async def until(self, what: str, condition: Callable[[], bool], timeout: float = 30.0) -> None:
        """Waits until ``condition()`` holds (checked after each event), at most
        ``timeout`` seconds; fails naming ``what`` and any order violation."""
        deadline = time.monotonic() + timeout
        while True:
            assert not self.errors, f"out of order: {self.errors}"
            if condition():
                return
            if self.end is not None:
                raise AssertionError(f"{what}: the session ended first ({self.end})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{what}: not within {timeout:g} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        """Closes the session and waits for the pump to end."""
        await self.session.close()
        await asyncio.gather(self.task, return_exceptions=True)
