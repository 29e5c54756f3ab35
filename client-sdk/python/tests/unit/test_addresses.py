"""Addresses, leader hints and errors, as the Rust SDK checks them."""

from __future__ import annotations

import grpc
import pytest

from cairn import ConnectError, RpcError, SessionClosedError, UnknownPeerError, health
from cairn.addresses import (
    MAX_ADDRESS_LEN,
    MAX_ADDRESSES,
    check_address,
    host_of,
    leader_in,
    parse_addresses,
)
from cairn.coordinator import _bearer, snapshot_mode, snapshot_status
from cairn.v1 import types_pb2


def test_address_lists() -> None:
    assert parse_addresses("127.0.0.1:7000") == ["127.0.0.1:7000"]
    assert parse_addresses("a:1, b.example:7000 ,[::1]:7000") == [
        "a:1",
        "b.example:7000",
        "[::1]:7000",
    ]

    def reason(addresses: str) -> str:
        with pytest.raises(ValueError) as e:
            parse_addresses(addresses)
        return str(e.value)

    assert "no address" in reason("")
    assert "entry 2 of the list is empty" in reason("a:1,,b:2")
    assert "entry 2 of the list is empty" in reason("a:1,")
    assert "`b` has no port (HOST:PORT)" in reason("a:1,b")
    assert "at most 16" in reason(",".join(["h:1"] * (MAX_ADDRESSES + 1)))
    assert len(parse_addresses(",".join(["h:1"] * MAX_ADDRESSES))) == MAX_ADDRESSES


def test_addresses_and_hints_are_checked() -> None:
    for good in [
        "127.0.0.1:7000",
        "coordinator-0.cairn.svc.cluster.local:7000",
        "my_host:1",
        "[::1]:65535",
        "[fe80::1]:7000",
    ]:
        assert check_address(good) is None, good
    long = "a" * MAX_ADDRESS_LEN + ":7000"
    for bad, why in [
        ("host", "has no port"),
        ("host:", "has no port"),
        ("host:http", "has no port"),
        ("host:0", "outside 1-65535"),
        ("host:65536", "outside 1-65535"),
        (":7000", "no valid host"),
        ("::1", "without brackets"),
        ("fe80::1:7000", "without brackets"),
        ("[::1:7000", "no valid host"),
        ("[]:7000", "no valid host"),
        ("a b:7000", "printable"),
        ("h\u00e9:7000", "printable"),
        ("evil.example/x:7000", "no valid host"),
        ("user@host:7000", "no valid host"),
        ("http://host:7000", "is a URL"),
        ("x:y:7000", "no valid host"),
        (long, "longer than 255"),
        ("host:\u0661\u0662", "printable"),
    ]:
        why_not = check_address(bad)
        assert why_not is not None and why in why_not, (bad, why_not)
    assert leader_in(None) is None
    assert leader_in([("cairn-leader", "10.0.0.2:7000")]) == "10.0.0.2:7000"
    assert leader_in([("Cairn-Leader", b" 10.0.0.2:7000 ")]) == "10.0.0.2:7000"
    for bad in ["", "10.0.0.2", "a b:7000", "x/y:1", long]:
        assert leader_in([("cairn-leader", bad)]) is None, bad
    assert host_of("[::1]:7000") == "::1"
    assert host_of("n1:7000") == "n1"
    assert host_of("n1") == "n1"


def test_an_unavailable_follower_names_the_leader() -> None:
    metadata = [("cairn-leader", "10.0.0.2:7000")]
    error = RpcError(grpc.StatusCode.UNAVAILABLE, "this replica follows", metadata)
    assert error.leader == "10.0.0.2:7000"
    assert str(error).endswith("this replica follows; the leader is 10.0.0.2:7000")
    assert error.retryable
    # Another code, or a bad hint: no leader.
    assert RpcError(grpc.StatusCode.FAILED_PRECONDITION, "no", metadata).leader is None
    assert not RpcError(grpc.StatusCode.FAILED_PRECONDITION, "no").retryable
    nonsense = RpcError(grpc.StatusCode.UNAVAILABLE, "x", [("cairn-leader", "nonsense")])
    assert nonsense.leader is None and "leader is" not in str(nonsense)
    # A message that names the leader already is not repeated.
    said = RpcError(
        grpc.StatusCode.UNAVAILABLE,
        "this coordinator (c2:7000) is a follower: the leader is c1:7000 (term 41)",
        [("cairn-leader", "c1:7000")],
    )
    assert said.leader == "c1:7000" and str(said).count("c1:7000") == 1


def test_which_errors_are_retryable() -> None:
    assert ConnectError("a:1", "refused").retryable
    assert SessionClosedError().retryable
    assert not UnknownPeerError("n9").retryable
    for code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED", "DEADLINE_EXCEEDED"):
        assert RpcError(getattr(grpc.StatusCode, code), "").retryable


def test_the_token_header() -> None:
    assert _bearer(None) == ()
    assert _bearer(" s3cr3t-token\n") == (("authorization", "Bearer s3cr3t-token"),)
    with pytest.raises(ValueError):
        _bearer("bad\ntoken")


def test_modes_and_statuses_by_name() -> None:
    assert snapshot_mode("unaligned") == types_pb2.SNAPSHOT_MODE_UNALIGNED
    assert snapshot_mode("chandy-lamport") == types_pb2.SNAPSHOT_MODE_CHANDY_LAMPORT
    assert snapshot_mode("SNAPSHOT_MODE_ALIGNED") == types_pb2.SNAPSHOT_MODE_ALIGNED
    assert snapshot_mode(types_pb2.SNAPSHOT_MODE_ALIGNED) == types_pb2.SNAPSHOT_MODE_ALIGNED
    assert snapshot_status("completed") == types_pb2.SNAPSHOT_STATUS_COMPLETED
    with pytest.raises(ValueError):
        snapshot_mode("fast")
    with pytest.raises(ValueError):
        snapshot_status("done")


def test_health_messages() -> None:
    assert health.decode_request(health.encode_request("cairn.v1.Leader")) == "cairn.v1.Leader"
    assert health.decode_request(b"") == ""
    for status in health.ServingStatus:
        assert health.decode_response(health.encode_response(status)) == status
    # Unknown fields are skipped; an unknown status is UNKNOWN; garbage is refused.
    assert (
        health.decode_response(b"\x12\x03abc\x08\x01\x1d\x00\x00\x00\x00")
        == health.ServingStatus.SERVING
    )
    assert health.decode_response(b"\x08\x09") == health.ServingStatus.UNKNOWN
    for garbage in (b"\x08", b"\x0a\x05ab", b"\x0f", b"\x08" + b"\xff" * 11):
        with pytest.raises(ValueError):
            health.decode_response(garbage)
