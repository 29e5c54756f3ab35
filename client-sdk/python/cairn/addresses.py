"""Addresses: what a ``HOST:PORT`` to dial may be, lists of coordinator replicas, and the
leader a follower replica names.

These follow the Rust SDK's rules (``cairn_rpc::leader``, ``cairn_sdk::coordinator``) so
that a list or a hint is accepted or refused alike in both languages.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "LEADER_METADATA",
    "LEADER_SERVICE",
    "MAX_ADDRESSES",
    "MAX_ADDRESS_LEN",
    "check_address",
    "host_of",
    "leader_in",
    "parse_addresses",
]

#: The gRPC health service that is SERVING only on the leading coordinator replica.
LEADER_SERVICE = "cairn.v1.Leader"

#: The response metadata in which a follower replica names the leader (``HOST:PORT``).
LEADER_METADATA = "cairn-leader"

#: The longest address accepted (a DNS name is at most 253 bytes, plus a port).
MAX_ADDRESS_LEN = 255

#: The most addresses a list of coordinator replicas may hold.
MAX_ADDRESSES = 16

_HEX_IPV6 = frozenset("0123456789abcdefABCDEF:.")
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._")


def _bare_ipv6(host: str) -> bool:
    """Whether ``host`` looks like an IPv6 address written without brackets."""
    return ":" in host and all(c in _HEX_IPV6 for c in host)


def check_address(address: str) -> str | None:
    """Why ``address`` is not a ``HOST:PORT`` to dial, or ``None`` if it is one.

    A good address is at most :data:`MAX_ADDRESS_LEN` printable ASCII characters: a host
    name or IPv4 address (letters, digits, ``-``, ``.``, ``_``) or an IPv6 address in
    brackets, and a port from 1 to 65535. The reason completes a sentence whose subject is
    the address ("has no port (HOST:PORT)").
    """
    if len(address) > MAX_ADDRESS_LEN:
        return f"is longer than {MAX_ADDRESS_LEN} bytes"
    if not all("!" <= c <= "~" for c in address):
        return "holds a character that is not printable ASCII (or a space)"
    if "://" in address:
        return "is a URL: give HOST:PORT, without a scheme"
    host, sep, port = address.rpartition(":")
    if not sep:
        return "has no port (HOST:PORT)"
    if not port or len(port) > 5 or not port.isdigit() or not port.isascii():
        if _bare_ipv6(address):
            return "is an IPv6 address without brackets and port ([ADDRESS]:PORT)"
        return "has no port (HOST:PORT)"
    if not 1 <= int(port) <= 65535:
        return "has a port outside 1-65535"
    if host.startswith("["):
        inner = host[1:]
        ok = inner.endswith("]") and len(inner) > 1 and all(c in _HEX_IPV6 for c in inner[:-1])
    else:
        ok = bool(host) and all(c in _HOST_CHARS for c in host)
    if ok:
        return None
    if _bare_ipv6(host):
        return "is an IPv6 address without brackets ([ADDRESS]:PORT)"
    return "has no valid host (a name, an IPv4 address or [an IPv6 address])"


def host_of(address: str) -> str:
    """The host part of ``HOST:PORT`` (``[::1]:7000`` gives ``::1``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        host = address
    return host.lstrip("[").rstrip("]")


def parse_addresses(addresses: str) -> list[str]:
    """The addresses of a comma-separated list (spaces around entries are ignored), each
    checked with :func:`check_address`.

    Raises :class:`ValueError` naming the bad entry: an empty entry, more than
    :data:`MAX_ADDRESSES`, or a malformed address.
    """
    entries = [a.strip() for a in addresses.split(",")]
    if len(entries) > MAX_ADDRESSES:
        raise ValueError(
            f"{len(entries)} addresses; at most {MAX_ADDRESSES} coordinator replicas may be listed"
        )
    for i, entry in enumerate(entries):
        if not entry:
            if len(entries) == 1:
                raise ValueError("no address (HOST:PORT, or a comma-separated list of them)")
            raise ValueError(f"entry {i + 1} of the list is empty")
        why = check_address(entry)
        if why is not None:
            raise ValueError(f"`{entry}` {why}")
    return entries


def leader_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The leader a follower named in response ``metadata`` (:data:`LEADER_METADATA`), if
    it names an address that passes :func:`check_address`; ``None`` otherwise."""
    if metadata is None:
        return None
    for key, value in metadata:
        if key.lower() != LEADER_METADATA:
            continue
        if isinstance(value, bytes):
            try:
                value = value.decode("ascii")
            except UnicodeDecodeError:
                return None
        value = value.strip()
        return value if check_address(value) is None else None
    return None
