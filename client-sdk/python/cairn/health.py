"""The two messages of gRPC's health service (``grpc.health.v1.Health/Check``), encoded by
hand so that the SDK needs no package beyond grpcio and protobuf: the coordinator client
asks a replica whether it leads (:data:`cairn.addresses.LEADER_SERVICE`), and the example
bank serves the check.

``HealthCheckRequest { string service = 1; }`` and ``HealthCheckResponse { ServingStatus
status = 1; }``, in proto3's wire format.
"""

from __future__ import annotations

import enum

__all__ = [
    "CHECK",
    "ServingStatus",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
]

#: The method path of ``Check``.
CHECK = "/grpc.health.v1.Health/Check"

#: The longest service name accepted in a request (a name, not data).
_MAX_SERVICE = 1024


class ServingStatus(enum.IntEnum):
    """``HealthCheckResponse.ServingStatus``."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    SERVICE_UNKNOWN = 3


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``at`` in ``data``, and where it ends."""
    value = 0
    for shift in range(0, 70, 7):
        if at >= len(data):
            raise ValueError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value & 0xFFFF_FFFF_FFFF_FFFF, at
    raise ValueError("varint longer than 10 bytes")


def _fields(data: bytes) -> dict[int, int | bytes]:
    """The last value of each field (varints and length-delimited only; the other wire
    types are skipped)."""
    fields: dict[int, int | bytes] = {}
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields[number], at = _read_varint(data, at)
        elif wire == 2:
            length, at = _read_varint(data, at)
            if at + length > len(data):
                raise ValueError("truncated field")
            fields[number] = data[at : at + length]
            at += length
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"wire type {wire} not supported")
        if at > len(data):
            raise ValueError("truncated field")
    return fields


def encode_request(service: str) -> bytes:
    """A ``HealthCheckRequest`` for ``service`` ("" for the server as a whole)."""
    data = service.encode()
    return (b"\x0a" + _varint(len(data)) + data) if data else b""


def decode_request(data: bytes) -> str:
    """The service a ``HealthCheckRequest`` names; :class:`ValueError` if malformed."""
    value = _fields(data).get(1, b"")
    if not isinstance(value, bytes) or len(value) > _MAX_SERVICE:
        raise ValueError("not a health check request")
    return value.decode()


def encode_response(status: ServingStatus) -> bytes:
    """A ``HealthCheckResponse`` with ``status``."""
    return (b"\x08" + _varint(int(status))) if status else b""


def decode_response(data: bytes) -> ServingStatus:
    """The status of a ``HealthCheckResponse`` (UNKNOWN for a value it does not know);
    :class:`ValueError` if malformed."""
    value = _fields(data).get(1, 0)
    if not isinstance(value, int):
        raise ValueError("not a health check response")
    try:
        return ServingStatus(value)
    except ValueError:
        return ServingStatus.UNKNOWN
