"""What can go wrong talking to a node daemon or a coordinator.

Every error the SDK raises is a :class:`CairnError`; :attr:`CairnError.retryable` says
whether trying again later may succeed, as the Rust SDK's ``Error::is_retryable`` does.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from .addresses import leader_in

__all__ = [
    "CairnError",
    "ConnectError",
    "ProtocolError",
    "RpcError",
    "SessionClosedError",
    "UnknownPeerError",
]

#: The status codes after which a call may succeed if tried again.
_RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


class CairnError(Exception):
    """The base of every error of the SDK."""

    @property
    def retryable(self) -> bool:
        """Whether trying again later may succeed (the daemon is restarting, the network
        blipped), as opposed to a request that will never work."""
        return False


class ConnectError(CairnError):
    """The address is malformed, or nothing usable answers there (refused, TLS handshake
    failed, no answer in time)."""

    def __init__(self, address: str, reason: str) -> None:
        """An error connecting to ``address``, and why."""
        super().__init__(f"cannot connect to {address}: {reason}")
        #: Where.
        self.address = address
        #: Why.
        self.reason = reason

    @property
    def retryable(self) -> bool:
        """Always: the server may come up."""
        return True


class RpcError(CairnError):
    """The server answered a call with an error status.

    UNAVAILABLE from a coordinator replica that follows names the leader
    (:attr:`leader`), and the text ends with "; the leader is HOST:PORT" unless the
    server's message says so already.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        metadata: Iterable[tuple[str, str | bytes]] | None = None,
    ) -> None:
        """A status: its code, the server's message, and the response metadata (for the leader)."""
        leader = leader_in(metadata) if code == grpc.StatusCode.UNAVAILABLE else None
        note = ""
        if leader is not None and f"the leader is {leader}" not in details:
            note = f"; the leader is {leader}"
        super().__init__(f"{code.name}: {details}{note}")
        #: The status code.
        self.code = code
        #: The server's message.
        self.details = details
        #: The leading coordinator replica a follower named (``HOST:PORT``), if any.
        self.leader = leader

    @classmethod
    def from_grpc(cls, error: grpc.aio.AioRpcError) -> RpcError:
        """The error of a failed gRPC call, with the leader its metadata names."""
        metadata: list[tuple[str, str | bytes]] = []
        for source in (error.trailing_metadata(), error.initial_metadata()):
            if source:
                metadata.extend((str(k), v) for k, v in source)
        return cls(error.code(), error.details() or "", metadata)

    @property
    def retryable(self) -> bool:
        """For UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED and DEADLINE_EXCEEDED."""
        return self.code in _RETRYABLE_CODES


class UnknownPeerError(CairnError):
    """The destination of a send is not a peer of this node (see
    :attr:`cairn.AppSession.peers`)."""

    def __init__(self, peer: str) -> None:
        """A send to ``peer``, which is not a peer."""
        super().__init__(f"`{peer}` is not a peer of this node")
        #: The destination named.
        self.peer = peer


class SessionClosedError(CairnError):
    """The session with the node daemon ended (or was closed)."""

    def __init__(self, why: str = "the session with the node daemon ended") -> None:
        """The session ended; ``why`` says how."""
        super().__init__(why)

    @property
    def retryable(self) -> bool:
        """Always: a new session may be attached."""
        return True


class ProtocolError(CairnError):
    """The daemon sent something the SDK did not expect (or the application broke the
    protocol, e.g. a recorded state whose chunks failed half way)."""
