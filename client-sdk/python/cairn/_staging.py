"""A restored state's pieces, gathered into one event or handed on one by one."""

from __future__ import annotations

from collections.abc import Callable

from .events import AppEvent, Restore, RestoreAborted, RestorePiece
from .v1 import app_pb2


class RestoreStaging:
    """A restored state's pieces as they come from the daemon: gathered into one
    :class:`Restore`, or handed on as :class:`RestorePiece` events (``in_pieces``)."""

    def __init__(self, in_pieces: bool = False) -> None:
        """Gathers the pieces unless ``in_pieces``."""
        self.in_pieces = in_pieces
        #: The restore whose pieces are coming: its id, and (unless in pieces) what came.
        self.current: tuple[str, bytearray] | None = None

    def piece(self, r: app_pb2.Restore, out: Callable[[AppEvent], None]) -> None:
        """Takes a piece; the events it makes go to ``out``."""
        staged = bytearray()
        if self.current is not None:
            current_id, current = self.current
            self.current = None
            if current_id == r.restore_id:
                staged = current
            elif self.in_pieces:
                # A piece of another restore: the one before was superseded mid-way.
                out(RestoreAborted(current_id, f"superseded by restore {r.restore_id}"))
        if self.in_pieces:
            if not r.last:
                self.current = (r.restore_id, staged)
            out(RestorePiece(r.restore_id, r.snapshot_id, r.chunk, r.last))
            return
        staged += r.chunk
        if not r.last:
            self.current = (r.restore_id, staged)
            return
        out(Restore(r.restore_id, r.snapshot_id, bytes(staged)))

    def aborted(self, a: app_pb2.RestoreAborted, out: Callable[[AppEvent], None]) -> None:
        """The daemon aborted a restore whose pieces were coming: what came is dropped (and
        the application told, if it was handed pieces)."""
        if self.current is not None and self.current[0] == a.restore_id:
            self.current = None
            if self.in_pieces:
                out(RestoreAborted(a.restore_id, a.reason))
