"""Packed runs (consecutive messages to or from one node as one blob plus lengths) and
recorded states cut into chunks: the session's wire formats, apart from the session."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence

from .errors import ProtocolError
from .events import Message
from .v1 import app_pb2

#: Largest piece of a recorded state sent in one message.
STATE_CHUNK = 256 << 10
#: Most messages coalesced into one ``SendBatch``.
SEND_BATCH = 256
#: Most payload bytes coalesced into one ``SendBatch``: well under the daemon's HTTP/2
#: window, so a batch never waits for a window update in the middle.
SEND_BATCH_BYTES = 256 << 10
#: Largest payload a run's ``uint32`` length can describe.
MAX_PAYLOAD = 0xFFFF_FFFF


def pack_sends(sends: Sequence[tuple[str, bytes]]) -> app_pb2.AppToNode:
    """One ``SendBatch`` of ``sends`` (destination, payload), in order: consecutive sends
    to one node share a run."""
    runs: list[app_pb2.SendRun] = []
    i, n = 0, len(sends)
    while i < n:
        to = sends[i][0]
        j = i + 1
        while j < n and sends[j][0] == to:
            j += 1
        group = sends[i:j]
        runs.append(
            app_pb2.SendRun(
                to=to,
                payloads=b"".join([p for _, p in group]),
                lengths=[len(p) for _, p in group],
            )
        )
        i = j
    return app_pb2.AppToNode(send=app_pb2.SendBatch(runs=runs))


def unpack_deliveries(batch: app_pb2.DeliverBatch) -> list[Message]:
    """The messages of a ``DeliverBatch``, in delivery order: its ``messages``, then each
    run's. Raises :class:`ProtocolError` for a run shorter than its lengths (as the Rust
    SDK does; bytes past the lengths are ignored)."""
    # `from` is a Python keyword: the generated field is read with getattr.
    out = [Message(getattr(m, "from"), m.payload) for m in batch.messages]
    for run in batch.runs:
        sender: str = getattr(run, "from")
        payloads = run.payloads
        size = len(payloads)
        at = 0
        for length in run.lengths:
            end = at + length
            if end > size:
                raise ProtocolError("a delivered run is shorter than its lengths")
            out.append(Message(sender, payloads[at:end]))
            at = end
    return out


def chunks(state: bytes) -> Iterator[tuple[bytes, bool]]:
    """``state`` as pieces of at most :data:`STATE_CHUNK` bytes, each with whether it is
    the last; an empty state is one empty last piece."""
    n = max(1, -(-len(state) // STATE_CHUNK))
    view = memoryview(state)
    for i in range(n):
        yield bytes(view[i * STATE_CHUNK : (i + 1) * STATE_CHUNK]), i + 1 == n


def _split(piece: bytes) -> Iterator[bytes]:
    """``piece`` cut into chunks of at most :data:`STATE_CHUNK` bytes."""
    if len(piece) <= STATE_CHUNK:
        yield piece
        return
    view = memoryview(piece)
    for at in range(0, len(piece), STATE_CHUNK):
        yield bytes(view[at : at + STATE_CHUNK])


def rechunk(pieces: Iterable[bytes]) -> Iterator[tuple[bytes, bool]]:
    """The pieces an application answers a record request with, as chunks of at most
    :data:`STATE_CHUNK` bytes, each with whether it is the last (one piece is held back to
    know). Empty pieces are skipped; no pieces at all is one empty last chunk."""
    held: bytes | None = None
    for piece in pieces:
        for chunk in _split(bytes(piece)):
            if not chunk:
                continue
            if held is not None:
                yield held, False
            held = chunk
    yield (held if held is not None else b""), True


async def rechunk_async(pieces: AsyncIterable[bytes]) -> AsyncIterator[tuple[bytes, bool]]:
    """:func:`rechunk` for pieces that come asynchronously."""
    held: bytes | None = None
    async for piece in pieces:
        for chunk in _split(bytes(piece)):
            if not chunk:
                continue
            if held is not None:
                yield held, False
            held = chunk
    yield (held if held is not None else b""), True
