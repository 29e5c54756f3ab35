"""The Python bank (examples/bank.py): the Rust bank's payloads and recorded state, byte for
byte; what it accepts and refuses as serde_json does; and its Bank service against the fake
daemon (transfers, deliveries, record and restore, workload, health, TLS roles)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cairn import Tls, health
from cairn.bank.v1 import bank_pb2, bank_pb2_grpc
from cairn.v1 import app_pb2

from certs import make_certs
from conftest import load_example
from fake_daemon import FakeDaemon, run, serving, within

bank: Any = load_example("bank")
U64_MAX = 2**64 - 1


# ---------------------------------------------------------------------- the formats


def test_payloads_and_states_are_written_as_the_rust_bank_writes_them() -> None:
    assert bank.TransferPayload(5, 1, 2).encode() == b'{"amount":5,"line":1,"id":2}'
    assert bank.TransferPayload(7).encode() == b'{"amount":7,"line":0,"id":0}'
    state = bank.BankState(12, 7)
    assert state.to_json() == b'{"balance":12,"line":7}'
    state.sent = {"n3": 3, "n10": 1, "n2": U64_MAX}
    state.received = {"n2": bank.Received(8, 4), "a": bank.Received(1, 1)}
    assert state.to_json() == (
        b'{"balance":12,"line":7,"sent":{"n10":1,"n2":18446744073709551615,"n3":3},'
        b'"received":{"a":{"line":1,"id":1},"n2":{"line":8,"id":4}}}'
    )
    state.ledger_pending = [3, 5]
    assert state.to_json().endswith(b',"ledger_pending":[3,5]}')
    assert bank.BankState.from_json(state.to_json()) == state
    state.ledger_open = [bank.LedgerRow("n2", 8, 5, 10)]
    assert state.to_json().endswith(
        b',"ledger_pending":[3,5],"ledger_open":[{"from":"n2","line":8,"id":5,"amount":10}]}'
    )
    assert bank.BankState.from_json(state.to_json()) == state
    fresh = bank.BankState.fresh(1000)
    assert 1 <= fresh.line <= U64_MAX >> 11 and fresh.balance == 1000


def test_older_states_and_payloads_still_parse() -> None:
    old = bank.BankState.from_json(b'{"balance":5}')
    assert (old.balance, old.line, old.sent, old.received) == (5, 0, {}, {})
    assert bank.TransferPayload.decode(b'{"amount":4}') == bank.TransferPayload(4, 0, 0)
    # Unknown fields are ignored; whitespace is JSON's; an array is a struct.
    assert bank.TransferPayload.decode(
        b' {"x":[1,{}],"amount":3 , "id":2} '
    ) == bank.TransferPayload(3, 0, 2)
    # serde_json reads -0 as the float -0.0, which no unsigned field takes.
    with pytest.raises(bank.Malformed):
        bank.TransferPayload.decode(b'{"amount":-0}')
    assert bank.TransferPayload.decode(b"[5]") == bank.TransferPayload(5)
    assert bank.TransferPayload.decode(b"[5,1,2]") == bank.TransferPayload(5, 1, 2)
    # A map's later duplicate wins (a struct's is refused).
    state = bank.BankState.from_json(b'{"balance":1,"sent":{"a":1,"a":2}}')
    assert state.sent == {"a": 2}


@pytest.mark.parametrize(
    "bad",
    [
        b"garbage",
        b"",
        b'{"amount":-1}',
        b'{"amount":18446744073709551616}',
        b'{"amount":"5"}',
        b'{"amount":5.0}',
        b'{"amount":1e2}',
        b'{"amount":true}',
        b'{"amount":null}',
        b'{"amount":NaN}',
        b'{"amount":Infinity}',
        b'{"line":1}',
        b'{"amount":1,"amount":2}',
        b'{"amount":1,"line":null}',
        b'{"amount":1,"x":"\\ud800"}',
        b'{"amount":1} x',
        b"[]",
        b"[1,2,3,4]",
        b"5",
        b'"text"',
        b'\xef\xbb\xbf{"amount":1}',
        b'{"amount":1,"x":"\xff"}',
        '{"amount":1}'.encode("utf-16"),
    ],
)
def test_a_payload_that_does_not_decode_is_rejected_and_not_applied(bad: bytes) -> None:
    state = bank.BankState(7)
    with pytest.raises(bank.Rejected):
        state.receive("n1", bad)
    assert state.balance == 7 and not state.received


def test_a_credit_that_would_overflow_is_rejected_and_not_applied() -> None:
    state = bank.BankState(U64_MAX - 3)
    with pytest.raises(bank.Rejected, match="overflow"):
        state.receive("n1", bank.TransferPayload(4).encode())
    assert state.balance == U64_MAX - 3
    state.receive("n1", bank.TransferPayload(3).encode())
    assert state.balance == U64_MAX


def test_transfer_ids_tell_duplicates_gaps_and_new_lines() -> None:
    def transfer(line: int, id: int) -> bytes:
        return bytes(bank.TransferPayload(1, line, id).encode())

    order = bank.Order
    state = bank.BankState.fresh(0)
    assert state.receive("a", transfer(7, 1)) == (order.NEXT, 0)
    assert state.receive("a", transfer(7, 2)) == (order.NEXT, 0)
    assert state.receive("a", transfer(7, 2)) == (order.DUPLICATE, 0)
    assert state.receive("a", transfer(7, 1)) == (order.DUPLICATE, 0)
    assert state.receive("a", transfer(7, 5)) == (order.SKIPPED, 2)
    assert state.receive("a", transfer(7, 6)) == (order.NEXT, 0)
    # The sender started afresh: its new line is followed from transfer 1; a later first one
    # means the ones before it were lost.
    assert state.receive("a", transfer(9, 1)) == (order.NEW_LINE, 0)
    assert state.receive("a", transfer(9, 2)) == (order.NEXT, 0)
    assert state.receive("a", transfer(8, 3)) == (order.SKIPPED, 2)
    assert state.receive("a", transfer(8, 4)) == (order.NEXT, 0)
    # Another sender, joined in the middle of its line; and a transfer by hand.
    assert state.receive("b", transfer(3, 40)) == (order.NEW_LINE, 0)
    assert state.receive("b", bank.TransferPayload(1).encode()) == (order.UNTRACKED, 0)
    assert state.balance == 12
    assert state.received["a"] == bank.Received(8, 4)
    assert state.received["b"] == bank.Received(3, 40)
    assert bank.BankState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    "bad",
    [
        b'{"line":1}',
        b'{"balance":1,"sent":[]}',
        b'{"balance":1,"sent":{"a":-1}}',
        b'{"balance":1,"received":{"a":{"line":1}}}',
        b'{"balance":1,"received":{"a":{"line":1,"id":2,"id":3}}}',
        b'{"balance":1,"ledger_pending":{}}',
        b'{"balance":1,"ledger_open":{}}',
        b'{"balance":1,"ledger_open":[{"from":1,"line":1,"id":1,"amount":1}]}',
        b'{"balance":1,"ledger_open":[{"from":"a","line":1,"id":1}]}',
        b'{"balance":1,"balance":2}',
    ],
)
def test_a_malformed_state_is_refused(bad: bytes) -> None:
    with pytest.raises(bank.Malformed):
        bank.BankState.from_json(bad)


def test_flags() -> None:
    args = bank.parse_args(["--workload", "2.5", "--connect-timeout", "1m30s"])
    assert (args.node, args.listen, args.initial_balance) == (
        "127.0.0.1:7200",
        "127.0.0.1:7300",
        1000,
    )
    assert (args.workload, args.max_amount, args.connect_timeout) == (2.5, 10, 90.0)
    assert bank.parse_args(["--connect-timeout", "500ms"]).connect_timeout == 0.5
    for bad in (
        ["--workload", "-1"],
        ["--workload", "nan"],
        ["--max-amount", "0"],
        ["--initial-balance", "-5"],
        ["--connect-timeout", "soon"],
        ["--ledger", "postgres://x"],
        ["--tls-crl", "crl.pem"],
        ["--bogus"],
    ):
        with pytest.raises(SystemExit) as e:
            bank.parse_args(bad)
        assert e.value.code == 64, bad


# ---------------------------------------------------------------------- the service


@contextlib.asynccontextmanager
async def running_bank(
    daemon: FakeDaemon,
    *flags: str,
    tls: Tls | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> AsyncIterator[tuple[int, asyncio.Task[int]]]:
    """The bank, attached to ``daemon``, serving on a free port: its port and its task."""
    async with serving(daemon, credentials) as address:
        args = bank.parse_args(["--node", address, "--listen", "127.0.0.1:0", *flags])
        stop = asyncio.Event()
        port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(bank.run(args, tls, stop, port.set_result))
        done, _ = await asyncio.wait({port, task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert port in done, task.result() if task.done() else "the bank did not start"
        try:
            yield port.result(), task
        finally:
            stop.set()
            await within(asyncio.shield(task), 10)


def stub(port: int, tls: Tls | None = None) -> tuple[grpc.aio.Channel, bank_pb2_grpc.BankAsyncStub]:
    address = f"127.0.0.1:{port}"
    if tls is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, tls.channel_credentials())
    return channel, bank_pb2_grpc.BankStub(channel)


@run
async def test_the_bank_service_end_to_end() -> None:
    daemon = FakeDaemon(peers=["n2", "n3"])
    async with running_bank(daemon, "--initial-balance", "100") as (port, task):
        channel, client = stub(port)
        balance = await client.GetBalance(bank_pb2.GetBalanceRequest())
        assert (balance.node_id, balance.balance, list(balance.peers)) == ("n1", 100, ["n2", "n3"])
        line = json.loads(balance.state_json)["line"]
        assert balance.state_json == f'{{"balance":100,"line":{line}}}'
        assert daemon.attach is not None and daemon.attach.application == "cairn-bank-python"

        # Transfers: debited at once, sent with the line and an id per receiver.
        assert (await client.Transfer(bank_pb2.TransferRequest(to="n2", amount=5))).balance == 95
        assert (await client.Transfer(bank_pb2.TransferRequest(to="n2", amount=6))).balance == 89
        assert (await client.Transfer(bank_pb2.TransferRequest(to="n3", amount=1))).balance == 88
        sent = await daemon.sent_messages(3)
        assert sent == [
            ("n2", b'{"amount":5,"line":%d,"id":1}' % line),
            ("n2", b'{"amount":6,"line":%d,"id":2}' % line),
            ("n3", b'{"amount":1,"line":%d,"id":1}' % line),
        ]
        for request, code in [
            (bank_pb2.TransferRequest(to="n2", amount=0), grpc.StatusCode.INVALID_ARGUMENT),
            (bank_pb2.TransferRequest(to="n9", amount=1), grpc.StatusCode.NOT_FOUND),
            (bank_pb2.TransferRequest(to="n2", amount=89), grpc.StatusCode.FAILED_PRECONDITION),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.Transfer(request)
            assert refused.value.code() == code
        # wait_queued: answered once the daemon took the message off the session.
        waiting = asyncio.ensure_future(
            client.Transfer(bank_pb2.TransferRequest(to="n3", amount=1, wait_queued=True))
        )
        await daemon.sent_messages(1)
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await daemon.taken.put(app_pb2.Taken(messages=4))
        assert (await within(waiting)).balance == 87

        # Deliveries: applied, duplicates and gaps counted, garbage refused.
        await daemon.deliver_runs(
            (
                "n2",
                [
                    b'{"amount":10,"line":9,"id":1}',
                    b'{"amount":10,"line":9,"id":1}',
                    b'{"amount":10,"line":9,"id":4}',
                    b"not json",
                ],
            )
        )
        await daemon.send(record_state=app_pb2.RecordState(snapshot_id=3))
        recorded = (await daemon.next_from_app("state_recorded")).state_recorded
        assert recorded.snapshot_id == 3 and recorded.last and recorded.consumed == 4
        balance = await client.GetBalance(bank_pb2.GetBalanceRequest())
        assert balance.balance == 117
        assert (
            balance.duplicate_transfers,
            balance.skipped_transfers,
            balance.rejected_transfers,
        ) == (1, 2, 1)
        assert recorded.chunk == balance.state_json.encode()
        assert json.loads(balance.state_json) == {
            "balance": 117,
            "line": line,
            "sent": {"n2": 2, "n3": 2},
            "received": {"n2": {"line": 9, "id": 4}},
        }

        # A restore replaces the state and is acknowledged.
        restored = b'{"balance":500,"line":42,"sent":{"n2":9},"received":{},"ledger_pending":[2]}'
        await daemon.send(
            restore=app_pb2.Restore(
                restore_id="restore-1", snapshot_id=2, epoch=1, chunk=restored, last=True
            )
        )
        assert (
            await daemon.next_from_app("restore_applied")
        ).restore_applied.restore_id == "restore-1"
        balance = await client.GetBalance(bank_pb2.GetBalanceRequest())
        assert (balance.balance, balance.restored_snapshot) == (500, 2)
        assert (
            balance.state_json == '{"balance":500,"line":42,"sent":{"n2":9},"ledger_pending":[2]}'
        )
        await client.Transfer(bank_pb2.TransferRequest(to="n2", amount=1))
        assert await daemon.sent_messages(1) == [("n2", b'{"amount":1,"line":42,"id":10}')]

        # The workload: random transfers at the rate; 0 pauses them.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.SetWorkload(bank_pb2.SetWorkloadRequest(rate=-1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await client.SetWorkload(bank_pb2.SetWorkloadRequest(rate=200))).previous_rate == 0
        workload = await daemon.sent_messages(5)
        assert all(to in ("n2", "n3") and 1 <= json.loads(p)["amount"] <= 10 for to, p in workload)
        assert (await client.SetWorkload(bank_pb2.SetWorkloadRequest(rate=0))).previous_rate == 200
        await asyncio.sleep(0.05)
        while not daemon.from_app.empty():
            daemon.from_app.get_nowait()
        await asyncio.sleep(0.2)
        assert daemon.from_app.empty(), "paused"
        total = (await client.GetBalance(bank_pb2.GetBalanceRequest())).balance
        assert total < 499

        # Health.
        check: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            health.CHECK, request_serializer=bytes, response_deserializer=bytes
        )
        answer = await check(health.encode_request("cairn.bank.v1.Bank"))
        assert health.decode_response(answer) == health.ServingStatus.SERVING
        await channel.close()

        # The daemon ends the session: the bank stops with an error.
        await daemon.to_app.put(None)
        assert await within(task) == 1


@run
async def test_the_bank_over_tls_checks_roles(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    node = Tls.from_files(certs / "ca.pem", certs / "n1.pem", certs / "n1-key.pem")
    daemon = FakeDaemon(peers=["n2"], cluster="test")
    flags = (
        "--tls-ca",
        str(certs / "ca.pem"),
        "--tls-cert",
        str(certs / "n1.pem"),
        "--tls-key",
        str(certs / "n1-key.pem"),
    )
    async with running_bank(daemon, *flags, tls=node, credentials=node.server_credentials()) as (
        port,
        _,
    ):

        def as_(name: str) -> Tls:
            return Tls.from_files(
                certs / "ca.pem", certs / f"{name}.pem", certs / f"{name}-key.pem"
            )

        channel, admin = stub(port, as_("admin"))
        assert (await admin.GetBalance(bank_pb2.GetBalanceRequest())).node_id == "n1"
        assert (await admin.Transfer(bank_pb2.TransferRequest(to="n2", amount=1))).balance == 999
        await channel.close()
        channel, viewer = stub(port, as_("viewer"))
        await viewer.GetBalance(bank_pb2.GetBalanceRequest())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await viewer.Transfer(bank_pb2.TransferRequest(to="n2", amount=1))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Transfer needs operator" in (refused.value.details() or "")
        await channel.close()
        for name in ("n1", "stranger"):
            channel, other = stub(port, as_(name))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await other.GetBalance(bank_pb2.GetBalanceRequest())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "a client certificate with a role is required" in (refused.value.details() or "")
            await channel.close()
        # Without a client certificate: refused in the handshake.
        channel, anonymous = stub(port, Tls.from_files(certs / "ca.pem"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await anonymous.GetBalance(bank_pb2.GetBalanceRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()
