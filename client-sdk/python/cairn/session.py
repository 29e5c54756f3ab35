"""The application's session with its local node daemon (the ``cairn.v1.App`` service).

An application opens one :class:`AppSession` to the daemon beside it, sends messages to
other nodes through it, receives theirs, and — when a snapshot reaches it — records its
local state. The session's two directions are ordered, which is what makes the cut exact
without pausing anything: messages received before :class:`~cairn.events.RecordState`
belong in the state, and messages sent before :meth:`AppSession.state_recorded` precede
the snapshot's marker.

A message and the state change it stands for must be on the same side of the cut. In
asyncio that is easy: code without an ``await`` runs alone, so reserve room first
(:meth:`AppSession.reserve`, which may wait), then change the state and send through the
permit with no ``await`` in between.

What the session does for the application, as the Rust SDK does:

- **Packed runs.** It attaches with ``packed_deliveries`` (consecutive deliveries from one
  node come as one blob plus lengths) and sends consecutive messages to one node as runs,
  coalescing up to 256 messages or 256 KiB into one ``SendBatch``.
- **The delivery window.** It attaches with ``acknowledges_deliveries`` and acknowledges
  what the application consumed on a second stream (``App/Consumed``, opened before
  :meth:`AppSession.connect` returns), so the daemon hands it at most about 50 ms of its
  work and a record request never waits behind more.
- **The send window.** Sends wait for room: at most 8,192 (or the window the daemon
  advises, ``Taken.window``) sent and not yet taken by the daemon.
- **Early record requests.** A record request that overtook the daemon's inbox comes on the
  flow stream too; the session cuts there (between two messages), answers with the count
  of messages consumed, and skips the copy that follows in band.
- **Restores** gathered into one :class:`~cairn.events.Restore` or handed over in pieces
  (``restore_in_pieces``), with :class:`~cairn.events.RestoreAborted`.
- **Snapshot outcomes** (``snapshot_outcomes_after``), never handed out twice in a session.

Every input from the daemon is bounded as the Rust SDK bounds it.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from types import TracebackType
from typing import TypeAlias

import grpc

from ._channel import open_channel
from ._early import ANSWERED_MEMORY, Copies, EarlyRecords
from ._packing import (
    MAX_PAYLOAD,
    SEND_BATCH,
    SEND_BATCH_BYTES,
    chunks,
    pack_sends,
    rechunk,
    rechunk_async,
    unpack_deliveries,
)
from ._staging import RestoreStaging
from ._window import Circulation, Confirmed, Room
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
    RestorePiece,
    SnapshotAborted,
    SnapshotCompleted,
)
from .tls import Tls
from .v1 import app_pb2, app_pb2_grpc

__all__ = [
    "AppSession",
    "RecordStateAnswer",
    "RecordStateCallback",
    "SendPermit",
]

_log = logging.getLogger("cairn.session")

#: How long :meth:`AppSession.connect` waits for the daemon to open ``App/Consumed``.
CONSUMED_OPEN_TIMEOUT = 10.0
#: Consumed messages after which the session acknowledges them even with more buffered
#: (it always does before it waits for more), and lets the loop's other tasks run.
ACK_EVERY = 256
#: Messages handed out after which :meth:`AppSession.next_event` gives the loop a turn even
#: with more buffered, so that the flow task sees an early record request (and the writer
#: and the acknowledgements run) while the application works through a batch.
YIELD_EVERY = 64
#: Messages from the daemon read ahead of the application (each a batch of deliveries or
#: one control message); the daemon's delivery window bounds what they hold.
INBOX = 16
#: Seconds :meth:`AppSession.close` lets the writer put what was sent on the wire.
CLOSE_DRAIN = 5.0

#: What an application may answer a record request with: the state's bytes, or its pieces
#: in order (an iterable or an async iterable of bytes, read by the session's writer as it
#: writes them: it must give the state as it was at the cut).
RecordStateAnswer: TypeAlias = (
    "bytes | bytearray | memoryview | Iterable[bytes] | AsyncIterable[bytes]"
)
#: A record-state callback: given the snapshot id, the state (see :data:`RecordStateAnswer`),
#: or ``None`` to leave the request unanswered (the snapshot then fails); may be async.
RecordStateCallback: TypeAlias = (
    "Callable[[int], RecordStateAnswer | None | Awaitable[RecordStateAnswer | None]]"
)


class _Signal(enum.Enum):
    """What the session's tasks tell :meth:`AppSession.next_event` besides messages."""

    WAKE = "wake"  # an early record request, or a failure: look again
    EOF = "eof"  # the daemon ended the session


_Inbound: TypeAlias = "app_pb2.NodeToApp | CairnError | _Signal"


class _State:
    """A recorded state on its way to the writer."""

    __slots__ = ("consumed", "snapshot_id", "state")

    def __init__(self, snapshot_id: int, consumed: int | None, state: RecordStateAnswer) -> None:
        """The state of ``snapshot_id``, cut after ``consumed`` messages."""
        self.snapshot_id = snapshot_id
        self.consumed = consumed
        self.state = state


class _RestoreApplied:
    """A restore acknowledgement on its way to the writer."""

    __slots__ = ("restore_id",)

    def __init__(self, restore_id: str) -> None:
        """The acknowledgement of ``restore_id``."""
        self.restore_id = restore_id


_Outgoing: TypeAlias = "tuple[str, bytes] | _State | _RestoreApplied"


class _StateFailed(Exception):
    """A recorded state's pieces failed; ``written``: whether some went out already."""

    def __init__(self, snapshot_id: int, written: bool, cause: BaseException) -> None:
        """The pieces of ``snapshot_id``'s state failed with ``cause``."""
        super().__init__(f"the recorded state of snapshot {snapshot_id} failed: {cause!r}")
        self.snapshot_id = snapshot_id
        self.written = written


def _as_bytes(payload: bytes | bytearray | memoryview) -> bytes:
    """``payload`` as ``bytes`` (copied only if it is not already)."""
    return payload if type(payload) is bytes else bytes(payload)


class SendPermit:
    """Room for one message, reserved by :meth:`AppSession.reserve`. Sending through it
    never waits, so it can happen with the state change the message stands for, with no
    ``await`` in between. A permit not used goes back with :meth:`release` (or at the end
    of a ``with`` block)."""

    __slots__ = ("_session", "_used")

    def __init__(self, session: AppSession) -> None:
        """Room taken for one send through ``session``."""
        self._session = session
        self._used = False

    def send(self, to: str, payload: bytes | bytearray | memoryview) -> None:
        """Sends ``payload`` to node ``to``. Raises :class:`UnknownPeerError` (the permit
        goes back), :class:`SessionClosedError`, or :class:`RuntimeError` if the permit was
        used already."""
        if self._used:
            raise RuntimeError("this send permit was used already")
        session = self._session
        if to not in session._peers:
            self.release()
            raise UnknownPeerError(to)
        data = _as_bytes(payload)
        if len(data) > MAX_PAYLOAD:
            self.release()
            raise ValueError(f"a payload of {len(data)} bytes is over {MAX_PAYLOAD}")
        self._used = True
        session._push_send(to, data)

    def release(self) -> None:
        """Gives the room back unused (nothing if it was used)."""
        if not self._used:
            self._used = True
            self._session._room.add(1)

    def __enter__(self) -> SendPermit:
        """The permit itself; the end of the block gives it back unless it sent."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Gives the room back if the permit was not used."""
        self.release()

    def __del__(self) -> None:
        # Dropped unused: the room goes back (as a Rust permit's does when dropped).
        """A permit dropped unused gives its room back."""
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class AppSession:
    """An open session with the node daemon beside the application.

    Open it with :meth:`connect`; receive with :meth:`next_event` or ``async for event in
    session``; send with :meth:`send`, :meth:`send_many` or :meth:`reserve`; answer
    :class:`~cairn.events.RecordState` with :meth:`state_recorded` (or give
    ``on_record_state``); acknowledge a :class:`~cairn.events.Restore` with
    :meth:`restore_applied`. Close it with :meth:`close` (or ``async with``).

    Every method is for the event loop the session was opened on; the sending methods may
    be called from any of its tasks. Everything sent reaches the daemon in the order it
    was sent.
    """

    # ------------------------------------------------------------------ opening

    @classmethod
    async def connect(
        cls,
        address: str,
        application: str = "python",
        *,
        tls: Tls | None = None,
        snapshot_outcomes_after: int | None = None,
        restore_in_pieces: bool = False,
        on_record_state: RecordStateCallback | None = None,
        retry_for: float = 0.0,
        attach_timeout: float = 30.0,
    ) -> AppSession:
        """Connects to the daemon's application port (``HOST:PORT``) and attaches as
        ``application`` (a name for its logs).

        - ``tls``: mutual TLS, when the daemon serves its application port with TLS (it
          does with ``--tls-*`` flags): the application presents its node's certificate
          (``cairn://CLUSTER/node/ID``; the daemon refuses any other) and checks the
          daemon's against the CA for the host it dials.
        - ``snapshot_outcomes_after``: follow the snapshots' ends — hear
          :class:`~cairn.events.SnapshotCompleted` and
          :class:`~cairn.events.SnapshotAborted` for every snapshot with a higher id, first
          those that ended already (as far as the coordinator keeps them), then each as it
          ends. Give the highest id the application has acted on: 0 on a fresh start, the
          restored state's on a restart, :attr:`outcomes_heard` on a reattach. ``None``:
          none are told.
        - ``restore_in_pieces``: hand restored states over as
          :class:`~cairn.events.RestorePiece` events (see :meth:`set_restore_in_pieces`).
        - ``on_record_state``: answer record requests with this callback (see
          :meth:`set_record_state_callback`) instead of handing out
          :class:`~cairn.events.RecordState`.
        - ``retry_for``: keep trying for this many seconds while the error is retryable
          (the daemon is not up yet): 50 ms, doubling to 1 s, between attempts.
        - ``attach_timeout``: seconds one attempt may take to connect and be attached.

        Raises :class:`ConnectError` (nothing usable answers), :class:`RpcError` (the
        daemon refused, e.g. FAILED_PRECONDITION while another session is attached),
        :class:`ProtocolError`.
        """
        deadline = time.monotonic() + max(0.0, retry_for)
        delay = 0.05
        while True:
            try:
                return await cls._attach(
                    address,
                    application,
                    tls,
                    snapshot_outcomes_after,
                    restore_in_pieces,
                    on_record_state,
                    attach_timeout,
                )
            except CairnError as e:
                if not e.retryable or time.monotonic() + delay >= deadline:
                    raise
                _log.debug("daemon at %s not ready (%s); retrying", address, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    @classmethod
    async def _attach(
        cls,
        address: str,
        application: str,
        tls: Tls | None,
        snapshot_outcomes_after: int | None,
        restore_in_pieces: bool,
        on_record_state: RecordStateCallback | None,
        attach_timeout: float,
    ) -> AppSession:
        """One attempt of :meth:`connect`."""
        channel = open_channel(address, tls)
        try:
            stub = app_pb2_grpc.AppStub(channel)
            call = stub.Session()
            attach = app_pb2.Attach(
                application=application, packed_deliveries=True, acknowledges_deliveries=True
            )
            if snapshot_outcomes_after is not None:
                attach.snapshot_outcomes_after = snapshot_outcomes_after
            try:
                attached = await asyncio.wait_for(_handshake(call, attach), attach_timeout)
            except asyncio.TimeoutError:
                call.cancel()
                raise ConnectError(address, f"no answer within {attach_timeout:g} s") from None
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    raise ConnectError(address, e.details() or "unavailable") from None
                raise RpcError.from_grpc(e) from None
            session = cls(
                channel,
                stub,
                call,
                attached,
                snapshot_outcomes_after=snapshot_outcomes_after,
                restore_in_pieces=restore_in_pieces,
                on_record_state=on_record_state,
            )
        except BaseException:
            await channel.close()
            raise
        try:
            await session._open_flow()
        except BaseException:
            await session.close(drain=0)
            raise
        return session

    def __init__(
        self,
        channel: grpc.aio.Channel,
        stub: app_pb2_grpc.AppAsyncStub,
        call: grpc.aio.StreamStreamCall[app_pb2.AppToNode, app_pb2.NodeToApp],
        attached: app_pb2.Attached,
        *,
        snapshot_outcomes_after: int | None,
        restore_in_pieces: bool,
        on_record_state: RecordStateCallback | None,
    ) -> None:
        """Internal: use :meth:`connect`."""
        self._channel = channel
        self._stub = stub
        self._call = call
        self._attached = attached
        self._peers: frozenset[str] = frozenset(attached.peers)
        self._on_record_state = on_record_state
        # What the daemon sends, read ahead by the reader task.
        self._inbox: asyncio.Queue[_Inbound] = asyncio.Queue(INBOX)
        self._buffered: deque[AppEvent] = deque()
        self._staging = RestoreStaging(restore_in_pieces)
        self._ended = False  # the daemon's stream ended (EOF handed out, or an error)
        self._end_error: CairnError | None = None
        self._failure: CairnError | None = None  # the session broke on this side
        self._closed = False
        # Deliveries consumed (messages, bytes), and the count the daemon was last told.
        self._consumed = 0
        self._consumed_bytes = 0
        self._acknowledged = 0
        self._ack_counts = (0, 0)  # the latest (messages, bytes) to tell the daemon
        self._ack_wake = asyncio.Event()
        # Early copies of record requests, and which copy of each was answered.
        self._early = EarlyRecords(self._wake_inbox)
        self._copies = Copies()
        # Where each cut not answered yet was taken: messages consumed.
        self._cuts: dict[int, int] = {}
        # Let the loop's other tasks (the writer, the acknowledgements, the flow stream) run
        # at the next call; messages handed out since they last could.
        self._yield_next = False
        self._since_yield = 0
        self._pending_restore: str | None = None
        self._outcomes_heard = snapshot_outcomes_after or 0
        # Sending: the window, what is queued for the writer, and the counts.
        self._room = Room()
        self._outgoing: deque[_Outgoing] = deque()
        self._writer_wake = asyncio.Event()
        self._sends = 0  # sends queued so far
        self._written = 0  # sends written to the stream so far
        self._confirmed = Confirmed()
        # Room comes back as sends are written (no flow stream), not as the daemon takes
        # them; sends are confirmed as written (the daemon does not report what it takes).
        self._on_write = attached.session == 0
        self._confirm_on_write = attached.session == 0
        self._flow_call: grpc.aio.StreamStreamCall[app_pb2.Consumption, app_pb2.Taken] | None = None
        self._writer_done = False  # the writer stopped: nothing more goes out
        self._reader_done = False  # the daemon's stream ended (its end may not be read yet)
        self._writing = False  # the writer holds an item it has not written yet
        self._tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(self._read_loop(), name="cairn-session-reader"),
            asyncio.create_task(self._write_loop(), name="cairn-session-writer"),
        ]

    async def _open_flow(self) -> None:
        """Opens ``App/Consumed`` before :meth:`connect` returns: the daemon's window is
        in force (or known to be off) before the application sends or reads anything. A
        daemon that refuses it, or does not answer in time, leaves the session without
        windows (room comes back as sends are written)."""
        session, flow_key = self._attached.session, self._attached.flow_key
        if session == 0:
            # A daemon that names no session has no such stream.
            self._early.arrived((), True)
            return
        call = self._stub.Consumed()
        first = app_pb2.Consumption(session=session, messages=0, bytes=0, flow_key=flow_key)
        try:
            await asyncio.wait_for(_open_consumed(call, first), CONSUMED_OPEN_TIMEOUT)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, RpcError) as e:
            call.cancel()
            why = (
                f"no answer within {CONSUMED_OPEN_TIMEOUT:g} s"
                if isinstance(e, asyncio.TimeoutError)
                else str(e if isinstance(e, RpcError) else RpcError.from_grpc(e))
            )
            _log.warning(
                "the daemon refused the flow-control stream (App/Consumed): %s; going on "
                "without windows",
                why,
            )
            self._confirm_on_write = True
            self._tasks.append(
                asyncio.create_task(self._flow_loop(None), name="cairn-session-flow")
            )
            return
        self._flow_call = call
        self._tasks.append(asyncio.create_task(self._flow_loop(call), name="cairn-session-flow"))
        self._tasks.append(asyncio.create_task(self._ack_loop(call), name="cairn-session-acks"))

    # ------------------------------------------------------------------ what it is

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._attached.node_id

    @property
    def cluster(self) -> str:
        """The cluster's name."""
        return self._attached.cluster

    @property
    def incarnation(self) -> int:
        """The daemon's incarnation (a new one after each restart)."""
        return self._attached.incarnation

    @property
    def session_id(self) -> int:
        """This session, as the daemon names it (0: a daemon without flow control)."""
        return self._attached.session

    @property
    def peers(self) -> frozenset[str]:
        """The nodes this node has a channel to now (changes as members join or are
        removed; see :class:`~cairn.events.PeersChanged`)."""
        return self._peers

    @property
    def outcomes_heard(self) -> int:
        """The highest snapshot id whose end this session handed out (or the id it attached
        following from): what to give as ``snapshot_outcomes_after`` when attaching again,
        once the application has acted on every end handed out."""
        return self._outcomes_heard

    @property
    def flow_control(self) -> bool:
        """Whether the daemon's delivery and send windows are in force (the ``App/Consumed``
        stream is open)."""
        return self._flow_call is not None and not self._flow_call.done()

    @property
    def closed(self) -> bool:
        """Whether the session ended (the daemon ended it, it broke, or it was closed):
        nothing more can be sent; events already received may still be read."""
        return (
            self._closed
            or self._ended
            or self._reader_done
            or self._writer_done
            or self._failure is not None
        )

    def set_restore_in_pieces(self, on: bool) -> None:
        """From now on, hand restored states over as :class:`~cairn.events.RestorePiece`
        events as they come from the daemon (pieces of up to 128 KiB) rather than as one
        :class:`~cairn.events.Restore`: for states too large to hold twice."""
        self._staging.in_pieces = on

    def set_record_state_callback(self, callback: RecordStateCallback | None) -> None:
        """Answers every record request with ``callback`` (``None``: hand out
        :class:`~cairn.events.RecordState` events again).

        The callback is called inside :meth:`next_event`, at the cut, with the snapshot
        id; it returns the state (bytes, or its pieces as an iterable or async iterable of
        bytes), or ``None`` to leave the request unanswered (the snapshot fails, as when a
        two-phase-commit sink cannot pre-commit). It may be a coroutine function: the
        state it returns is sent when it returns, so it must read the state after its
        last ``await``. Pieces are read as they are written: they must give the state as
        it was when the callback returned (a copy, or data nothing changes meanwhile).
        """
        self._on_record_state = callback

    # ------------------------------------------------------------------ receiving

    def __aiter__(self) -> AppSession:
        """The session is its own async iterator of events."""
        return self

    async def __anext__(self) -> AppEvent:
        """The next event; stops once the daemon closed the session."""
        event = await self.next_event()
        if event is None:
            raise StopAsyncIteration
        return event

    async def next_event(self) -> AppEvent | None:
        """The next event; ``None`` once the daemon closed the session (or it was closed).

        Raises :class:`RpcError` if the session's stream failed, :class:`ProtocolError`
        if the daemon sent something unexpected (the session is then over).
        """
        if self._pending_restore is not None:
            # Handed over whole and not acknowledged by the application: acknowledged now.
            try:
                self.restore_applied(self._pending_restore)
            except SessionClosedError:
                self._pending_restore = None
        if self._yield_next:
            # A recorded state (or an acknowledgement, or an early record request) waits for
            # another task of the session, which an application busy with buffered messages
            # would never let run: its events come without waiting.
            self._yield_next = False
            self._since_yield = 0
            await asyncio.sleep(0)
        buffered = self._buffered
        early = self._early
        while True:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                return None
            # A record request that overtook the deliveries: the cut is here, between two
            # messages.
            if early.ids or early.ended:
                snapshot_id = self._copies.take_early(early)
                if snapshot_id is not None:
                    cut = self._cut(snapshot_id)
                    if self._on_record_state is None:
                        return cut
                    await self._answer(snapshot_id, self._on_record_state)
                    continue
            if buffered:
                event = buffered.popleft()
                if type(event) is Message:
                    self._consumed += 1
                    self._consumed_bytes += len(event.payload)
                    if self._consumed - self._acknowledged >= ACK_EVERY:
                        self._acknowledge()
                    self._since_yield += 1
                    if self._since_yield >= YIELD_EVERY:
                        self._yield_next = True
                    return event
                if type(event) is Restore or (type(event) is RestorePiece and event.last):
                    # Acknowledged when the application next asks for an event, if it did
                    # not itself (not before: a restore superseded mid-way leaves an abort
                    # ahead of the next one).
                    self._pending_restore = event.restore_id
                return event
            # Everything taken: say so before waiting for more.
            self._acknowledge()
            if self._ended:
                if self._end_error is not None:
                    raise self._end_error
                return None
            item = await self._inbox.get()
            self._since_yield = 0
            if type(item) is _Signal:
                if item is _Signal.EOF:
                    self._ended = True
                continue
            if isinstance(item, CairnError):
                self._ended = True
                self._end_error = item
                continue
            assert isinstance(item, app_pb2.NodeToApp)
            taken = self._take(item)
            if taken is None:
                continue
            if type(taken) is RecordState and self._on_record_state is not None:
                await self._answer(taken.snapshot_id, self._on_record_state)
                continue
            return taken

    def _take(self, message: app_pb2.NodeToApp) -> AppEvent | None:
        """Takes one message from the daemon: an event to hand out now, or ``None`` (what
        it brought is buffered, or nothing to hand out)."""
        kind = message.WhichOneof("kind")
        if kind == "deliver":
            try:
                self._buffered.extend(unpack_deliveries(message.deliver))
            except ProtocolError as e:
                self._fail(e)
            return None
        if kind == "record_state":
            r = message.record_state
            # Answered at its early copy already: the cut was there.
            if not self._copies.in_band(r.snapshot_id, r.early_copy):
                return None
            return self._cut(r.snapshot_id)
        if kind == "restore":
            self._staging.piece(message.restore, self._buffered.append)
            return None
        if kind == "restore_aborted":
            self._staging.aborted(message.restore_aborted, self._buffered.append)
            return None
        if kind == "snapshot_completed":
            snapshot_id = message.snapshot_completed.snapshot_id
            # Never backwards: a confused daemon cannot make an end heard twice.
            if snapshot_id > self._outcomes_heard:
                self._outcomes_heard = snapshot_id
                return SnapshotCompleted(snapshot_id)
            return None
        if kind == "snapshot_aborted":
            aborted = message.snapshot_aborted
            if aborted.snapshot_id > self._outcomes_heard:
                self._outcomes_heard = aborted.snapshot_id
                return SnapshotAborted(aborted.snapshot_id, aborted.reason)
            return None
        if kind == "peers":
            self._peers = frozenset(message.peers.peers)
            return PeersChanged(self._peers)
        self._fail(ProtocolError(f"unexpected message from the daemon ({kind or 'empty'})"))
        return None

    def _cut(self, snapshot_id: int) -> RecordState:
        """The application takes its cut for ``snapshot_id`` here: after the messages it
        has consumed so far, which the answer names."""
        cuts = self._cuts
        cuts[snapshot_id] = self._consumed
        while len(cuts) > ANSWERED_MEMORY:
            del cuts[min(cuts)]
        self._yield_next = True
        return RecordState(snapshot_id)

    async def _answer(self, snapshot_id: int, callback: RecordStateCallback) -> None:
        """Answers the cut just taken for ``snapshot_id`` with ``callback``'s state."""
        answer = callback(snapshot_id)
        if inspect.isawaitable(answer):
            answer = await answer
        if answer is None:
            # Not answered: the snapshot fails (a later one takes its place).
            self._cuts.pop(snapshot_id, None)
            return
        try:
            self.state_recorded(snapshot_id, answer)
        except SessionClosedError:
            # A request read ahead of the session's end: the end is reported as it is
            # (None, or the stream's error), not as this answer that came too late.
            return

    def _acknowledge(self) -> None:
        """Tells the daemon what the application has consumed (it keeps at most a window
        of messages handed over and not consumed)."""
        if self._consumed != self._acknowledged:
            self._acknowledged = self._consumed
            self._ack_counts = (self._consumed, self._consumed_bytes)
            self._ack_wake.set()

    # ------------------------------------------------------------------ sending

    async def send(self, to: str, payload: bytes | bytearray | memoryview) -> None:
        """Sends ``payload`` to node ``to``, waiting while the send window is full (a slow
        peer pushes back). Raises :class:`UnknownPeerError` for a node that is not a peer,
        :class:`SessionClosedError` once the session ended."""
        if to not in self._peers:
            raise UnknownPeerError(to)
        data = _as_bytes(payload)
        if len(data) > MAX_PAYLOAD:
            raise ValueError(f"a payload of {len(data)} bytes is over {MAX_PAYLOAD}")
        room = self._room
        if not room.try_acquire():
            await room.acquire()
        self._push_send(to, data)

    async def send_many(
        self, messages: Iterable[tuple[str, bytes | bytearray | memoryview]]
    ) -> int:
        """Sends every ``(to, payload)`` of ``messages`` in order, taking room as it comes
        free (as many at once as there is); how many were sent. Every destination is
        checked first: an unknown peer raises :class:`UnknownPeerError` before anything is
        sent."""
        items = [(to, _as_bytes(payload)) for to, payload in messages]
        peers = self._peers
        for to, data in items:
            if to not in peers:
                raise UnknownPeerError(to)
            if len(data) > MAX_PAYLOAD:
                raise ValueError(f"a payload of {len(data)} bytes is over {MAX_PAYLOAD}")
        at, total = 0, len(items)
        while at < total:
            taken = await self._room.acquire(total - at, partial=True)
            for to, data in items[at : at + taken]:
                self._push_send(to, data)
            at += taken
        return total

    async def reserve(self) -> SendPermit:
        """Waits for room for one message: the permit sends it without waiting (see the
        module's docs). Raises :class:`SessionClosedError` once the session ended."""
        room = self._room
        if not room.try_acquire():
            await room.acquire()
        return SendPermit(self)

    def _push_send(self, to: str, data: bytes) -> None:
        """Queues one send for the writer (its room is taken already)."""
        if self._stopped():
            raise self._closed_error()
        self._sends += 1
        self._outgoing.append((to, data))
        self._writer_wake.set()

    def _push(self, item: _State | _RestoreApplied) -> None:
        """Queues a state or an acknowledgement for the writer."""
        if self._stopped():
            raise self._closed_error()
        self._outgoing.append(item)
        self._writer_wake.set()

    def _stopped(self) -> bool:
        """Whether nothing more can be sent."""
        return self._closed or self._failure is not None or self._writer_done or self._reader_done

    def _closed_error(self) -> SessionClosedError:
        """The error of a send after the session stopped."""
        if self._closed:
            return SessionClosedError("the session was closed")
        return SessionClosedError()

    async def flushed(self) -> None:
        """Waits until the daemon has taken every message sent before the call off the
        session and queued it for its peer (a ``NodeAdmin/GetNodeStatus`` read after it
        counts them). A daemon that does not report what it takes is waited for only until
        they are written. Raises :class:`SessionClosedError` if the session ends first:
        they may or may not have been taken."""
        if not await self._confirmed.wait(self._sends):
            raise SessionClosedError("the session ended before the daemon confirmed the sends")

    def state_recorded(self, snapshot_id: int, state: RecordStateAnswer) -> None:
        """Answers :class:`~cairn.events.RecordState` with the local state. Never waits: the
        state follows everything sent before it, and precedes everything after.

        ``state`` is the state's bytes (sent in chunks of 256 KiB), or its pieces as an
        iterable or async iterable of bytes, read by the session's writer as it writes
        them (nothing else goes between them): they must give the state as it was at this
        call. If the pieces fail half way the session cannot go on (it ends with a
        :class:`ProtocolError`); if they fail before the first, the request stays
        unanswered and the snapshot fails.

        Raises :class:`ValueError` for a snapshot the session did not ask for or that was
        answered already, :class:`SessionClosedError` once the session ended.
        """
        if snapshot_id not in self._cuts:
            raise ValueError(f"snapshot {snapshot_id} was not asked for, or was answered already")
        if isinstance(state, (bytearray, memoryview)):
            # Copied now: the writer reads it later, and the caller may reuse its buffer,
            # which would put a state from after the cut into the snapshot.
            state = bytes(state)
        consumed = self._cuts.pop(snapshot_id)
        self._push(_State(snapshot_id, consumed, state))

    def restore_applied(self, restore_id: str) -> None:
        """Acknowledges a :class:`~cairn.events.Restore` (or the last
        :class:`~cairn.events.RestorePiece`): the application now runs on the restored
        state. Until the daemon gets this, it drops every message the application sends —
        they were decided on the state the restore replaced — so call it right after
        replacing the state, with no ``await`` in between. If the application never calls
        it, the session acknowledges when the application next asks for an event (exact
        only if nothing sends meanwhile). Never waits; nothing for another restore than
        the pending one."""
        if self._pending_restore != restore_id:
            return
        self._pending_restore = None
        self._push(_RestoreApplied(restore_id))

    # ------------------------------------------------------------------ closing

    async def close(self, drain: float = CLOSE_DRAIN) -> None:
        """Ends the session: lets the writer put what was sent on the wire (for up to
        ``drain`` seconds), then closes both streams and the connection. Sends waiting for
        room fail with :class:`SessionClosedError`; :meth:`next_event` returns ``None``."""
        if self._closed:
            return
        if drain > 0 and not self._stopped():
            deadline = time.monotonic() + drain
            while (
                (self._outgoing or self._writing)
                and time.monotonic() < deadline
                and not self._stopped()
            ):
                await asyncio.sleep(0.005)
        self._closed = True
        self._room.close(SessionClosedError("the session was closed"))
        self._confirmed.close()
        self._wake_inbox()
        for task in self._tasks:
            task.cancel()
        self._call.cancel()
        if self._flow_call is not None:
            self._flow_call.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._channel.close()

    async def __aenter__(self) -> AppSession:
        """The session itself."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Closes the session (draining what was sent, unless leaving on an error)."""
        await self.close(drain=CLOSE_DRAIN if exc is None else 0)

    # ------------------------------------------------------------------ the tasks

    def _wake_inbox(self) -> None:
        """Wakes :meth:`next_event` if it waits for the daemon (it is waiting only when the
        inbox is empty: a full inbox needs no wake)."""
        try:
            self._inbox.put_nowait(_Signal.WAKE)
        except asyncio.QueueFull:
            pass

    def _fail(self, error: CairnError) -> None:
        """The session broke on this side: it ends, and :meth:`next_event` raises
        ``error``."""
        if self._failure is None:
            self._failure = error
            _log.error("the session with the node daemon broke: %s", error)
        self._room.close(SessionClosedError(f"the session broke: {error}"))
        self._confirmed.close()
        self._call.cancel()
        self._wake_inbox()

    async def _read_loop(self) -> None:
        """Reads what the daemon sends into the inbox (bounded: it waits for the
        application, and HTTP/2 and the daemon's window push back)."""
        call = self._call
        inbox = self._inbox
        item: _Inbound
        try:
            while True:
                message = await call.read()
                if not isinstance(message, app_pb2.NodeToApp):
                    item = _Signal.EOF
                    break
                await inbox.put(message)
        except grpc.aio.AioRpcError as e:
            item = RpcError.from_grpc(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - anything else ends the session too
            item = ProtocolError(f"reading the session failed: {e!r}")
        # The session is over: nothing more can be sent.
        self._reader_done = True
        self._room.close(SessionClosedError())
        self._confirmed.close()
        await inbox.put(item)

    async def _write_loop(self) -> None:
        """Puts what the application sends on the stream in order: sends coalesced into
        batches of runs, states cut into chunks. Counts the sends it writes; gives their
        room back as it writes them only for a daemon without flow control (else the
        daemon says when it took them)."""
        call = self._call
        out = self._outgoing
        wake = self._writer_wake
        try:
            while True:
                if not out:
                    self._writing = False
                    wake.clear()
                    await wake.wait()
                    continue
                self._writing = True
                item = out.popleft()
                if type(item) is tuple:
                    batch = [item]
                    size = len(item[1])
                    while out and len(batch) < SEND_BATCH and size < SEND_BATCH_BYTES:
                        following = out[0]
                        if type(following) is not tuple:
                            break
                        out.popleft()
                        batch.append(following)
                        size += len(following[1])
                    n = len(batch)
                    # Counted before they can be taken.
                    self._written += n
                    await call.write(pack_sends(batch))
                    if self._on_write:
                        self._room.add(n)
                    if self._confirm_on_write:
                        self._confirmed.confirm(self._written)
                elif isinstance(item, _State):
                    try:
                        await self._write_state(call, item)
                    except _StateFailed as e:
                        if e.written:
                            self._fail(ProtocolError(str(e)))
                            return
                        _log.error("%s; snapshot %d is not answered (it fails)", e, e.snapshot_id)
                else:
                    assert isinstance(item, _RestoreApplied)
                    message = app_pb2.AppToNode(
                        restore_applied=app_pb2.RestoreApplied(restore_id=item.restore_id)
                    )
                    await call.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream ended: the reader tells why
            _log.debug("the session's writer stopped: %r", e)
        finally:
            self._writer_done = True
            self._writing = False
            self._room.close(SessionClosedError())

    async def _write_state(
        self,
        call: grpc.aio.StreamStreamCall[app_pb2.AppToNode, app_pb2.NodeToApp],
        item: _State,
    ) -> None:
        """Writes a recorded state as consecutive chunks; the cut is the first's."""
        state = item.state
        written = False

        async def write(chunk: bytes, last: bool) -> None:
            """Writes one chunk; the first carries the cut (``consumed``)."""
            nonlocal written
            recorded = app_pb2.StateRecorded(snapshot_id=item.snapshot_id, chunk=chunk, last=last)
            if not written and item.consumed is not None:
                recorded.consumed = item.consumed
            written = True
            await call.write(app_pb2.AppToNode(state_recorded=recorded))

        if isinstance(state, (bytes, bytearray, memoryview)):
            for chunk, last in chunks(_as_bytes(state)):
                await write(chunk, last)
            return
        try:
            if isinstance(state, AsyncIterable):
                async for chunk, last in rechunk_async(state):
                    await write(chunk, last)
            else:
                for chunk, last in rechunk(state):
                    await write(chunk, last)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - the application's pieces failed
            raise _StateFailed(item.snapshot_id, written, e) from e

    async def _ack_loop(
        self, call: grpc.aio.StreamStreamCall[app_pb2.Consumption, app_pb2.Taken]
    ) -> None:
        """Tells the daemon, on ``App/Consumed``, how many delivered messages (and bytes)
        the application consumed; only the latest count matters."""
        session, flow_key = self._attached.session, self._attached.flow_key
        wake = self._ack_wake
        try:
            while True:
                await wake.wait()
                wake.clear()
                messages, nbytes = self._ack_counts
                consumption = app_pb2.Consumption(
                    session=session, messages=messages, bytes=nbytes, flow_key=flow_key
                )
                await call.write(consumption)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream ended: the flow task sees it
            _log.debug("acknowledgements stopped: %r", e)

    async def _flow_loop(
        self, call: grpc.aio.StreamStreamCall[app_pb2.Consumption, app_pb2.Taken] | None
    ) -> None:
        """Reads ``App/Consumed``: the sends the daemon took (room comes back, kept at the
        window it advises; :meth:`flushed` is confirmed) and early record requests. When
        it ends (or never opened), room comes back as sends are written."""
        released = 0
        circulation = Circulation()
        room = self._room
        try:
            if call is not None:
                while True:
                    taken = await call.read()
                    if not isinstance(taken, app_pb2.Taken):
                        break
                    if taken.record_state:
                        # Bounded whatever the daemon sends: the newest are still due.
                        self._early.arrived(taken.record_state[-ANSWERED_MEMORY:])
                    # Never more than was written: a confused daemon cannot inflate it.
                    messages = min(taken.messages, self._written)
                    returned = max(0, messages - released)
                    window = taken.window if taken.HasField("window") else None
                    give = circulation.taken(returned, window)
                    if give > 0:
                        room.add(give)
                    if returned > 0:
                        released = messages
                        self._confirmed.confirm(released)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream broke: go on without windows
            _log.debug("the flow-control stream ended: %r", e)
        # Without the daemon's counts, room comes back as sends are written (no send
        # window), rather than never: what is written already goes back now, and a window
        # the daemon had shrunk opens to the SDK's own.
        self._on_write = True
        give = circulation.taken(max(0, self._written - released), None)
        if give > 0:
            room.add(give)
        if call is not None:
            # What the daemon did not report taking is not confirmed now.
            self._confirmed.close()
        self._early.arrived((), True)


async def _handshake(
    call: grpc.aio.StreamStreamCall[app_pb2.AppToNode, app_pb2.NodeToApp],
    attach: app_pb2.Attach,
) -> app_pb2.Attached:
    """Sends ``Attach`` and reads ``Attached``."""
    try:
        await call.write(app_pb2.AppToNode(attach=attach))
    except asyncio.InvalidStateError:
        pass  # the call ended already: reading tells why
    first = await call.read()
    if not isinstance(first, app_pb2.NodeToApp):
        raise SessionClosedError("the daemon ended the session before attaching it")
    if first.WhichOneof("kind") != "attached":
        raise ProtocolError("expected Attached first")
    return first.attached


async def _open_consumed(
    call: grpc.aio.StreamStreamCall[app_pb2.Consumption, app_pb2.Taken],
    first: app_pb2.Consumption,
) -> None:
    """Sends the flow stream's first message (naming the session) and waits for the daemon
    to answer it; raises :class:`RpcError` if it refused."""
    try:
        await call.write(first)
    except asyncio.InvalidStateError:
        pass
    await call.initial_metadata()
    if call.done():
        code = await call.code()
        if code != grpc.StatusCode.OK:
            raise RpcError(code, await call.details() or "", await call.trailing_metadata())
