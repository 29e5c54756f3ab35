"""gRPC channels to cairn's servers, set up as the Rust SDK sets up its connections."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from .addresses import check_address
from .errors import ConnectError
from .tls import Tls

#: The largest message the SDK accepts from a server (the Rust SDK's decoding limit): a
#: snapshot with its data, a piece of recorded messages, a delivery batch.
MAX_RECEIVE = 64 << 20

#: Channel options common to every channel the SDK opens.
BASE_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.max_receive_message_length", MAX_RECEIVE),
    ("grpc.max_send_message_length", MAX_RECEIVE),
    # One connection per channel: a session is not multiplexed with another client's
    # traffic to the same daemon, and a closed channel closes its connection.
    ("grpc.use_local_subchannel_pool", 1),
)


def open_channel(
    address: str,
    tls: Tls | None,
    *,
    server_name: str | None = None,
    options: Sequence[tuple[str, int | str]] = (),
) -> grpc.aio.Channel:
    """A channel to ``address`` (``HOST:PORT``): plaintext without ``tls``; with it, TLS
    whose server certificate must name ``server_name`` (default: the host dialed) and
    that presents ``tls``'s identity, if any. Raises :class:`ConnectError` for a malformed
    address. The connection is made by the first call."""
    why = check_address(address)
    if why is not None:
        raise ConnectError(address, f"`{address}` {why}")
    all_options: list[tuple[str, int | str]] = [*BASE_OPTIONS, *options]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=all_options)
    if server_name is not None:
        all_options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=all_options)
