"""cairn's Python SDK: what an application uses to live under cairn, and a coordinator
client for scripts.

An application talks to the cairn daemon beside it over one :class:`AppSession`: it sends
messages to other nodes, receives theirs, and — when a snapshot reaches it — records its
local state. See the package's README ("Writing an application in Python")::

    import asyncio
    from cairn import AppSession, Message, RecordState, Restore

    async def main() -> None:
        count = 0
        async with await AppSession.connect("127.0.0.1:7200", "counter") as session:
            async for event in session:
                match event:
                    case Message():
                        count += 1
                    case RecordState(snapshot_id):
                        session.state_recorded(snapshot_id, str(count).encode())
                    case Restore(restore_id, _, state):
                        count = int(state or b"0")
                        session.restore_applied(restore_id)

    asyncio.run(main())

Layout: :mod:`cairn.session` (:class:`AppSession`, :class:`SendPermit`),
:mod:`cairn.events` (what :meth:`AppSession.next_event` hands out),
:mod:`cairn.coordinator` (:class:`CoordinatorClient`), :mod:`cairn.tls` (:class:`Tls`),
:mod:`cairn.errors`, and the generated protobuf modules :mod:`cairn.v1` (``app_pb2``,
``coordinator_pb2``, ``types_pb2``, …) and :mod:`cairn.bank.v1` (the example bank's).
"""

from ._version import __version__
from .coordinator import CoordinatorClient, new_request_id
from .errors import (
    CairnError,
    ConnectError,
    ProtocolError,
    RpcError,
    SessionClosedError,
    UnknownPeerError,
)
from .events import (
    AppEvent,
    Message,
    PeersChanged,
    RecordState,
    Restore,
    RestoreAborted,
    RestorePiece,
    SnapshotAborted,
    SnapshotCompleted,
)
from .session import AppSession, RecordStateAnswer, RecordStateCallback, SendPermit
from .tls import Tls, TlsError

__all__ = [
    "AppEvent",
    "AppSession",
    "CairnError",
    "ConnectError",
    "CoordinatorClient",
    "Message",
    "PeersChanged",
    "ProtocolError",
    "RecordState",
    "RecordStateAnswer",
    "RecordStateCallback",
    "Restore",
    "RestoreAborted",
    "RestorePiece",
    "RpcError",
    "SendPermit",
    "SessionClosedError",
    "SnapshotAborted",
    "SnapshotCompleted",
    "Tls",
    "TlsError",
    "UnknownPeerError",
    "__version__",
    "new_request_id",
]
