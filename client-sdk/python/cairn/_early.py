"""Early copies of record requests (``Taken.record_state``, docs/architecture.md §4.2):
which copy of each request the application answers — the first it meets, once."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

#: Most record requests remembered as answered from one copy while the other is due (as
#: many snapshots as could be in flight at once, and more); also the most early copies
#: kept waiting, and the most cuts kept unanswered.
ANSWERED_MEMORY = 1024


def remember(memory: dict[int, None], snapshot_id: int) -> None:
    """Adds ``snapshot_id`` to ``memory`` (an ordered set), bounded by
    :data:`ANSWERED_MEMORY`: the lowest ids go first."""
    memory[snapshot_id] = None
    while len(memory) > ANSWERED_MEMORY:
        del memory[min(memory)]


class Copies:
    """Which copy of each record request the application answers: the first it meets,
    once."""

    def __init__(self) -> None:
        """Nothing answered."""
        #: Requests answered at their early copy, whose in-band copy is still to come...
        self.answered_early: dict[int, None] = {}
        #: ...and answered in band, whose early copy is still to come.
        self.answered_in_band: dict[int, None] = {}

    def early(self, snapshot_id: int) -> bool:
        """An early copy of ``snapshot_id``: whether the cut is here."""
        if snapshot_id in self.answered_in_band:
            del self.answered_in_band[snapshot_id]
            return False
        remember(self.answered_early, snapshot_id)
        return True

    def in_band(self, snapshot_id: int, early_copy: bool) -> bool:
        """The in-band copy of ``snapshot_id`` (``early_copy``: one went ahead): whether
        the cut is here."""
        if snapshot_id in self.answered_early:
            del self.answered_early[snapshot_id]
            return False
        if early_copy:
            remember(self.answered_in_band, snapshot_id)
        return True

    def take_early(self, due: EarlyRecords) -> int | None:
        """The next early copy to cut at from those that came; skips those answered in
        band."""
        while due.ids:
            snapshot_id = due.ids.popleft()
            if self.early(snapshot_id):
                return snapshot_id
        if due.ended:
            # Every copy that came was met, and no more come: none is waited for.
            self.answered_in_band.clear()
        return None


class EarlyRecords:
    """Record requests that came ahead of the session's deliveries, not taken yet, and
    whether the stream bringing them ended (no more come)."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        """``wake`` is called when some arrive (to wake a session waiting for
        deliveries)."""
        self.ids: deque[int] = deque()
        self.ended = False
        self._wake = wake

    def arrived(self, ids: Iterable[int], ended: bool = False) -> None:
        """Takes the ids of a ``Taken`` message (bounded whatever the daemon sends: the
        newest are the ones still due), and whether the stream ended."""
        self.ids.extend(ids)
        while len(self.ids) > ANSWERED_MEMORY:
            self.ids.popleft()
        self.ended |= ended
        self._wake()
