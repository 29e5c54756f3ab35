"""The send window: room for sends the daemon has not taken yet, kept at the size the daemon
advises (``Taken.window``); and the count of sends the daemon confirmed taking."""

from __future__ import annotations

import asyncio
from collections import deque

from .errors import SessionClosedError

#: Most messages a session may have on their way to the daemon and not taken by it yet:
#: few enough that a recorded state sent behind them is not held up, whatever their size.
#: The daemon advises fewer (``Taken.window``) while a slow peer holds it back.
SEND_ROOM = 8192


class Room:
    """A counting semaphore whose permits are sends the application may still make; FIFO,
    with permits added in bulk and taken in bulk. Closing it fails every waiter with
    :class:`SessionClosedError`."""

    def __init__(self, permits: int = SEND_ROOM) -> None:
        """Starts with ``permits`` free."""
        self._permits = permits
        # Each waiter: how many it wants, whether fewer (at least one) will do, its future.
        self._waiters: deque[tuple[int, bool, asyncio.Future[int]]] = deque()
        self._closed: SessionClosedError | None = None

    @property
    def available(self) -> int:
        """Permits free now."""
        return self._permits

    def try_acquire(self) -> bool:
        """Takes one permit if one is free and nobody waits before; never waits."""
        if self._closed is not None:
            raise self._closed
        if self._permits > 0 and not self._waiters:
            self._permits -= 1
            return True
        return False

    async def acquire(self, n: int = 1, *, partial: bool = False) -> int:
        """Waits for ``n`` permits (or, with ``partial``, for at least one and takes up to
        ``n``), behind earlier waiters; how many were taken. Raises
        :class:`SessionClosedError` once closed."""
        if self._closed is not None:
            raise self._closed
        if n <= 0:
            return 0
        if not self._waiters and (self._permits >= n or (partial and self._permits > 0)):
            taken = min(n, self._permits)
            self._permits -= taken
            return taken
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, partial, future))
        try:
            return await future
        except asyncio.CancelledError:
            # Given permits before the cancellation landed: they go back.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.add(future.result())
            else:
                self._wake()
            raise

    def add(self, n: int) -> None:
        """Adds ``n`` permits and wakes whom they satisfy."""
        if n > 0:
            self._permits += n
            self._wake()

    def _wake(self) -> None:
        """Gives free permits to the waiters at the head of the queue, in order."""
        while self._waiters:
            want, partial, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if self._permits >= want:
                give = want
            elif partial and self._permits > 0:
                give = self._permits
            else:
                return
            self._waiters.popleft()
            self._permits -= give
            future.set_result(give)

    def close(self, error: SessionClosedError | None = None) -> None:
        """Fails every waiter, and every later acquire, with ``error``."""
        if self._closed is not None:
            return
        self._closed = error or SessionClosedError()
        while self._waiters:
            _, _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(self._closed)


class Circulation:
    """The send window's permits in circulation — free, held by the application, or spent on
    sends the daemon has not taken — kept at the window the daemon advises (at most
    :data:`SEND_ROOM`): a window that shrinks holds back permits that come back; one that
    grows adds permits."""

    def __init__(self) -> None:
        """Starts with :data:`SEND_ROOM` in circulation."""
        self.circulating = SEND_ROOM

    def taken(self, returned: int, window: int | None) -> int:
        """The daemon took ``returned`` more sends and advises ``window`` (``None``: the
        SDK's own bound): the permits to add to the room."""
        target = SEND_ROOM if window is None else min(max(window, 1), SEND_ROOM)
        keep = max(0, self.circulating - returned)
        now = max(target, keep)
        self.circulating = now
        return now - keep


class Confirmed:
    """How many sends the daemon confirmed taking off the session (only ever raised), and
    whether no more will be confirmed; :meth:`wait` waits for a count."""

    def __init__(self) -> None:
        """Nothing confirmed, open."""
        self.count = 0
        self.closed = False
        self._changed = asyncio.Event()

    def confirm(self, n: int) -> None:
        """Raises the count to ``n`` (never lowers it; nothing after :meth:`close`)."""
        if n > self.count and not self.closed:
            self.count = n
            self._notify()

    def close(self) -> None:
        """No more sends will be confirmed."""
        if not self.closed:
            self.closed = True
            self._notify()

    def _notify(self) -> None:
        """Wakes every waiter (each checks its count again)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, target: int) -> bool:
        """Waits until ``target`` sends are confirmed (``True``) or no more will be
        (``False``, unless they are)."""
        while self.count < target and not self.closed:
            await self._changed.wait()
        return self.count >= target
