"""What a session hands the application: the events of :meth:`cairn.AppSession.next_event`.

Match on them with ``match``/``case``::

    match event:
        case Message(sender, payload): ...
        case RecordState(snapshot_id): ...
        case Restore(restore_id, snapshot_id, state): ...
        case _: ...   # the rest, if the application does not care
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "AppEvent",
    "Message",
    "PeersChanged",
    "RecordState",
    "Restore",
    "RestoreAborted",
    "RestorePiece",
    "SnapshotAborted",
    "SnapshotCompleted",
]


@dataclass(frozen=True, slots=True)
class Message:
    """A message from a peer, in delivery order."""

    #: The sending node.
    sender: str
    #: The payload, as sent.
    payload: bytes


@dataclass(frozen=True, slots=True)
class RecordState:
    """Record your local state now and answer with
    :meth:`cairn.AppSession.state_recorded`. Everything received before this event belongs
    in the state; nothing after it.

    For an unaligned snapshot it comes between the next two messages, ahead of messages the
    daemon already handed the session: those are recorded as in flight, and follow as
    usual. Answer before asking for the next event (or at least before applying it), so
    that the state holds exactly the messages received before this.

    Not handed out when the session has a record-state callback (it answers itself).
    """

    #: The snapshot.
    snapshot_id: int


@dataclass(frozen=True, slots=True)
class Restore:
    """Replace your state with this recorded one, then call
    :meth:`cairn.AppSession.restore_applied` with no ``await`` in between (the daemon drops
    what the application sends until it hears that). The recorded messages that were in
    flight at the snapshot follow as ordinary :class:`Message` events, ahead of any new
    traffic."""

    #: The restore operation.
    restore_id: str
    #: The snapshot restored.
    snapshot_id: int
    #: The recorded local state.
    state: bytes


@dataclass(frozen=True, slots=True)
class RestorePiece:
    """Only with ``restore_in_pieces``: the next piece of a restored state, instead of one
    :class:`Restore` with all of it, so the application need not hold a large state
    twice. Stage the pieces aside (a restore may break off: see :class:`RestoreAborted`);
    on the ``last`` one, swap the staged state in and call
    :meth:`cairn.AppSession.restore_applied`, as for :class:`Restore`."""

    #: The restore operation.
    restore_id: str
    #: The snapshot restored.
    snapshot_id: int
    #: The next bytes of the recorded local state.
    piece: bytes
    #: True on the last piece.
    last: bool


@dataclass(frozen=True, slots=True)
class RestoreAborted:
    """Only with ``restore_in_pieces``: a restore whose pieces were being handed over broke
    off before its last (the daemon lost the rest, or a newer restore superseded it). Drop
    its pieces and keep the state you had; the daemon drops what you send, and delivers
    nothing, until a later restore is applied."""

    #: The restore operation.
    restore_id: str
    #: Why, in words.
    reason: str


@dataclass(frozen=True, slots=True)
class SnapshotCompleted:
    """Only with ``snapshot_outcomes_after``: a snapshot completed — every node's part is
    stored and verified, and the coordinator has stored that it completed, so a restore can
    bring back its state from now on. Effects held back until the state was durable may be
    made final now.

    Told in increasing id order together with :class:`SnapshotAborted`, at least once: a
    session that attaches again naming a lower id (see
    :attr:`cairn.AppSession.outcomes_heard`) hears again what it may have missed, as far as
    the coordinator keeps it (the newest 4,096 ends). Treat a repeated id as done already.
    """

    #: The snapshot.
    snapshot_id: int


@dataclass(frozen=True, slots=True)
class SnapshotAborted:
    """Only with ``snapshot_outcomes_after``: a snapshot failed or was aborted, and the
    coordinator stored that. Its state will never be restored. Same guarantees as
    :class:`SnapshotCompleted`."""

    #: The snapshot.
    snapshot_id: int
    #: Why, in words (at most 512 bytes).
    reason: str


@dataclass(frozen=True, slots=True)
class PeersChanged:
    """The nodes this node has a channel to changed (a member joined or was removed).
    :attr:`cairn.AppSession.peers` already holds the new set; sends to a node no longer in
    it fail with :class:`cairn.UnknownPeerError`. (The Rust SDK updates its peers without
    an event; an application may ignore this one.)"""

    #: Every peer now.
    peers: frozenset[str]


#: Something the daemon asks of, or hands to, the application.
AppEvent: TypeAlias = (
    Message
    | RecordState
    | Restore
    | RestorePiece
    | RestoreAborted
    | SnapshotCompleted
    | SnapshotAborted
    | PeersChanged
)
