#!/usr/bin/env python3
"""cairn's example bank, in Python: the same application as the Rust ``cairn-bank``, so
that one cluster can run Rust and Python banks side by side and a snapshot of it still
adds up.

A bank holds a balance and moves money to the banks beside the other nodes as cairn
messages. It speaks exactly the Rust bank's formats:

- a transfer's payload: JSON ``{"amount":N,"line":L,"id":I}``;
- its recorded state: JSON ``{"balance":N,"line":L,"sent":{..},"received":{..}}`` (``sent``
  per peer the last transfer id sent; ``received`` per peer ``{"line":L,"id":I}``, the last
  transfer applied; empty maps left out; a ``ledger_pending`` list a Rust bank with a
  ledger recorded is kept as it is);

and serves the same ``cairn.bank.v1.Bank`` service (``Transfer``, ``GetBalance``,
``SetWorkload``) with gRPC health, with the same flags (and environment variables) where
they make sense::

    python examples/bank.py --node 127.0.0.1:7200 --listen 127.0.0.1:7300 --workload 100

The sender is debited in the same critical section that queues the message (no ``await``
between them), and the state is recorded in one too, so a transfer is wholly before the
cut (debited and sent) or wholly after it. Every transfer carries an id: the sender's
*line* (drawn when a bank starts with a fresh balance, kept through restores) and a count
per receiver (1, 2, …), so a receiver sees a duplicate or a gap at once (counted and
logged at ERROR; applied anyway). A delivered transfer whose payload does not decode, or
whose credit would overflow the balance (a u64), is refused: logged, counted, not applied.

Not here: ``--ledger`` (PostgreSQL exactly-once output) and ``--tls-crl``; both are
refused at start.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import importlib
import json
import logging
import math
import os
import random
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc

from cairn import AppSession, CairnError, Message, RecordState, Restore, Tls, TlsError, health
from cairn.bank.v1 import bank_pb2, bank_pb2_grpc

_log = logging.getLogger("cairn-bank")

U64_MAX = (1 << 64) - 1
#: A fresh line is drawn from 1 to this (2^53 - 1: exact in every JSON reader).
LINE_MAX = U64_MAX >> 11
#: The exit code of a bad flag (EX_USAGE), as the Rust tools use.
EXIT_USAGE = 64
#: Streams one connection may have open at once on the bank's port.
BANK_STREAMS = 64
#: The largest request the bank's port accepts (a control RPC's limit).
CONTROL_MESSAGE = 1 << 20


# ---------------------------------------------------------------------- the formats


class Malformed(ValueError):
    """A payload or state that is not what the Rust bank would accept (serde_json's rules:
    exact types, unsigned 64-bit integers, no duplicate fields)."""


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as its key/value pairs, in order (so duplicates are seen)."""


def _reject_constant(name: str) -> NoReturn:
    """Refuses ``NaN`` and ``Infinity``, which Python's JSON reader accepts."""
    raise Malformed(f"{name} is not JSON")


def _check_strings(value: Any) -> None:
    """Refuses strings serde_json refuses: lone surrogates (``"\\ud800"``)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise Malformed("a string holds a lone surrogate") from None
        elif isinstance(item, _Pairs):
            for key, inner in item:
                stack.append(key)
                stack.append(inner)
        elif isinstance(item, list):
            stack.extend(item)


def _parse(data: bytes) -> Any:
    """Parses JSON as serde_json does: UTF-8 only, no NaN or Infinity, objects kept as
    :class:`_Pairs`."""
    try:
        text = data.decode("utf-8")
        # serde_json reads "-0" as a float (refused where an unsigned integer goes).
        value = json.loads(
            text,
            object_pairs_hook=_Pairs,
            parse_constant=_reject_constant,
            parse_int=lambda s: -0.0 if s == "-0" else int(s),
        )
    except Malformed:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Malformed(f"not JSON: {e}") from None
    _check_strings(value)
    return value


def _u64(value: Any, what: str) -> int:
    """``value`` if it is an unsigned 64-bit integer (not a boolean, not a float)."""
    if type(value) is not int:
        raise Malformed(f"{what}: expected an unsigned integer, got {_kind(value)}")
    if not 0 <= value <= U64_MAX:
        raise Malformed(f"{what}: {value} is not an unsigned 64-bit integer")
    return value


def _kind(value: Any) -> str:
    """What a JSON value is, for messages (as serde_json words it)."""
    if isinstance(value, _Pairs):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a floating point number"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def _struct(value: Any, fields: Sequence[str], required: int, what: str) -> dict[str, Any]:
    """A struct as serde's derive reads it: an object (unknown keys ignored, a known key
    twice refused) or an array of the fields in order (at least ``required``, at most
    all)."""
    out: dict[str, Any] = {}
    if isinstance(value, _Pairs):
        for key, inner in value:
            if key in fields:
                if key in out:
                    raise Malformed(f"{what}: duplicate field `{key}`")
                out[key] = inner
        for name in fields[:required]:
            if name not in out:
                raise Malformed(f"{what}: missing field `{name}`")
        return out
    if isinstance(value, list) and not isinstance(value, _Pairs):
        if not required <= len(value) <= len(fields):
            raise Malformed(f"{what}: an array of {len(value)} elements")
        return dict(zip(fields, value, strict=False))
    raise Malformed(f"{what}: expected an object, got {_kind(value)}")


def _map(value: Any, what: str) -> list[tuple[str, Any]]:
    """A map's entries (a later duplicate key wins, as serde's maps do)."""
    if not isinstance(value, _Pairs):
        raise Malformed(f"{what}: expected a map, got {_kind(value)}")
    return list(dict(value).items())


def _dumps(value: Any) -> bytes:
    """Compact JSON as serde_json writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class TransferPayload:
    """A transfer's payload. ``line`` and ``id`` are 0 in payloads of older banks and of
    other programs sending on a bank's session (applied without an order check)."""

    amount: int
    line: int = 0
    id: int = 0

    def encode(self) -> bytes:
        """The payload's bytes: ``{"amount":N,"line":L,"id":I}``."""
        return _dumps({"amount": self.amount, "line": self.line, "id": self.id})

    @classmethod
    def decode(cls, payload: bytes) -> TransferPayload:
        """Parses a payload; :class:`Malformed` if the Rust bank would not accept it."""
        fields = _struct(_parse(payload), ("amount", "line", "id"), 1, "transfer")
        return cls(
            _u64(fields["amount"], "amount"),
            _u64(fields.get("line", 0), "line"),
            _u64(fields.get("id", 0), "id"),
        )


@dataclass
class Received:
    """The last transfer received from one peer: the sender's line and its id."""

    line: int
    id: int


class Order(enum.Enum):
    """Where a delivered transfer stands in its sender's order."""

    #: The next id of the line followed.
    NEXT = "next"
    #: The payload carries no id.
    UNTRACKED = "untracked"
    #: The first transfer seen from this sender, or transfer 1 of a new line of it.
    NEW_LINE = "new line"
    #: An id at or below the last applied: a duplicate.
    DUPLICATE = "duplicate"
    #: Ids were skipped: a loss (how many is returned beside it).
    SKIPPED = "skipped"


class Rejected(Exception):
    """A delivered transfer that is not applied."""


@dataclass(frozen=True)
class LedgerRow:
    """A transfer a Rust bank with a ledger carried past a cut (its ``ledger::Row``)."""

    sender: str
    line: int
    id: int
    amount: int


@dataclass
class BankState:
    """The recorded state of a bank (the Rust bank's ``BankState``)."""

    balance: int
    line: int = 0
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, Received] = field(default_factory=dict)
    #: Recorded by a Rust bank with a ledger; kept as it is.
    ledger_pending: list[int] = field(default_factory=list)
    #: Recorded by a Rust bank with a ledger whose cut carried its transfers; kept as it is.
    ledger_open: list[LedgerRow] = field(default_factory=list)

    @classmethod
    def fresh(cls, balance: int) -> BankState:
        """A bank's state when it starts: ``balance``, a fresh random line."""
        return cls(balance, random.randint(1, LINE_MAX))

    def to_json(self) -> bytes:
        """The state as the Rust bank records it (same fields, order and spacing)."""
        value: dict[str, Any] = {"balance": self.balance, "line": self.line}
        if self.sent:
            value["sent"] = {peer: self.sent[peer] for peer in sorted(self.sent)}
        if self.received:
            value["received"] = {
                peer: {"line": r.line, "id": r.id} for peer, r in sorted(self.received.items())
            }
        if self.ledger_pending:
            value["ledger_pending"] = list(self.ledger_pending)
        if self.ledger_open:
            value["ledger_open"] = [
                {"from": r.sender, "line": r.line, "id": r.id, "amount": r.amount}
                for r in self.ledger_open
            ]
        return _dumps(value)

    @classmethod
    def from_json(cls, data: bytes) -> BankState:
        """Parses a recorded state (a Rust or Python bank's; ``{"balance": N}`` of older
        banks too); :class:`Malformed` if the Rust bank would not accept it."""
        names = ("balance", "line", "sent", "received", "ledger_pending", "ledger_open")
        fields = _struct(_parse(data), names, 1, "state")
        sent = {
            peer: _u64(n, f"sent.{peer}") for peer, n in _map(fields.get("sent", _Pairs()), "sent")
        }
        received: dict[str, Received] = {}
        for peer, value in _map(fields.get("received", _Pairs()), "received"):
            r = _struct(value, ("line", "id"), 2, f"received.{peer}")
            received[peer] = Received(
                _u64(r["line"], f"received.{peer}.line"), _u64(r["id"], f"received.{peer}.id")
            )
        pending = fields.get("ledger_pending", [])
        if not isinstance(pending, list) or isinstance(pending, _Pairs):
            raise Malformed(f"ledger_pending: expected an array, got {_kind(pending)}")
        rows = fields.get("ledger_open", [])
        if not isinstance(rows, list) or isinstance(rows, _Pairs):
            raise Malformed(f"ledger_open: expected an array, got {_kind(rows)}")
        open_rows = []
        for i, row in enumerate(rows):
            r = _struct(row, ("from", "line", "id", "amount"), 4, f"ledger_open[{i}]")
            if not isinstance(r["from"], str):
                raise Malformed(f"ledger_open[{i}].from: expected a string, got {_kind(r['from'])}")
            open_rows.append(
                LedgerRow(
                    r["from"],
                    _u64(r["line"], f"ledger_open[{i}].line"),
                    _u64(r["id"], f"ledger_open[{i}].id"),
                    _u64(r["amount"], f"ledger_open[{i}].amount"),
                )
            )
        return cls(
            _u64(fields["balance"], "balance"),
            _u64(fields.get("line", 0), "line"),
            sent,
            received,
            [_u64(n, "ledger_pending") for n in pending],
            open_rows,
        )

    def receive(self, sender: str, payload: bytes) -> tuple[Order, int]:
        """Applies a delivered transfer from ``sender``: credits it and tells where it
        stands in the sender's order (and how many ids were skipped). A payload that does
        not decode, or a credit that would overflow, raises :class:`Rejected` and changes
        nothing."""
        try:
            transfer = TransferPayload.decode(payload)
        except Malformed as e:
            raise Rejected(f"the payload is not a transfer: {e}") from None
        credited = self.balance + transfer.amount
        if credited > U64_MAX:
            raise Rejected(
                f"crediting {transfer.amount} to the balance {self.balance} would overflow it (u64)"
            )
        self.balance = credited
        if transfer.id == 0:
            return Order.UNTRACKED, 0
        seen = Received(transfer.line, transfer.id)
        last = self.received.get(sender)
        if last is None:
            self.received[sender] = seen
            return (Order.NEXT if transfer.id == 1 else Order.NEW_LINE), 0
        if last.line != transfer.line:
            # The sender started afresh: its new line begins at 1, and anything before the
            # first one seen was lost.
            self.received[sender] = seen
            if transfer.id == 1:
                return Order.NEW_LINE, 0
            return Order.SKIPPED, transfer.id - 1
        gap = transfer.id - last.id
        if gap <= 0:
            return Order.DUPLICATE, 0
        last.id = transfer.id
        if gap == 1:
            return Order.NEXT, 0
        return Order.SKIPPED, gap - 1


# ---------------------------------------------------------------------- the bank


ROLES = {"viewer": 1, "operator": 2, "admin": 3}


class Bank(bank_pb2_grpc.BankServicer):
    """A bank: its state, its session, and the ``cairn.bank.v1.Bank`` service."""

    def __init__(self, session: AppSession, initial_balance: int, tls: bool) -> None:
        """A bank on ``session`` starting with ``initial_balance`` (``tls``: check roles)."""
        self.session = session
        self.state = BankState.fresh(initial_balance)
        self.restored = 0
        self.rejected = 0
        self.duplicates = 0
        self.skipped = 0
        self.rate = 0.0
        self.rate_changed = asyncio.Event()
        self.workload_busy = asyncio.Lock()
        self.tls = tls

    # The critical sections: no `await` inside, so nothing runs between the debit and the
    # send, or while the state is read for a snapshot.

    async def transfer(self, to: str, amount: int) -> int:
        """Debits and queues the transfer's message together; the balance after. Raises
        :class:`_Refused` with the status the Rust bank answers."""
        if amount == 0:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "amount must be positive")
        peers = self.session.peers
        if to not in peers:
            raise _Refused(
                grpc.StatusCode.NOT_FOUND,
                f"`{to}` is not a peer of {self.session.node_id} "
                f"(peers: {', '.join(sorted(peers))})",
            )
        try:
            permit = await self.session.reserve()
        except CairnError as e:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, f"node daemon: {e}") from None
        with permit:
            state = self.state
            if state.balance < amount:
                raise _Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"insufficient funds: balance {state.balance} < amount {amount}",
                )
            transfer_id = min(state.sent.get(to, 0) + 1, U64_MAX)
            try:
                permit.send(to, TransferPayload(amount, state.line, transfer_id).encode())
            except CairnError as e:
                raise _Refused(grpc.StatusCode.UNAVAILABLE, f"node daemon: {e}") from None
            state.sent[to] = transfer_id
            state.balance -= amount
            return state.balance

    def on_message(self, event: Message) -> None:
        """Applies a delivered transfer (or counts why not)."""
        try:
            order, skipped = self.state.receive(event.sender, event.payload)
        except Rejected as e:
            self.rejected += 1
            _log.error(
                "transfer from %s rejected, not applied (rejected %d): %s",
                event.sender,
                self.rejected,
                e,
            )
            return
        if order is Order.NEW_LINE:
            _log.info("transfers of a new line of the sender %s", event.sender)
        elif order is Order.DUPLICATE:
            self.duplicates += 1
            _log.error(
                "a transfer from %s delivered twice (applied; duplicates %d)",
                event.sender,
                self.duplicates,
            )
        elif order is Order.SKIPPED:
            self.skipped = min(self.skipped + skipped, U64_MAX)
            _log.error(
                "%d transfers from %s never delivered before a later one (total %d)",
                skipped,
                event.sender,
                self.skipped,
            )

    def on_record_state(self, snapshot_id: int) -> bytes:
        """The state to record at the cut."""
        _log.debug("snapshot %d: state recorded, balance %d", snapshot_id, self.state.balance)
        return self.state.to_json()

    def on_restore(self, event: Restore) -> None:
        """Replaces the state with a restored one and acknowledges it at once."""
        try:
            state = BankState.from_json(event.state)
        except Malformed as e:
            _log.error("snapshot %d: cannot restore a malformed state: %s", event.snapshot_id, e)
            return
        self.state = state
        self.session.restore_applied(event.restore_id)
        self.restored = event.snapshot_id
        _log.info("restored snapshot %d: balance %d", event.snapshot_id, state.balance)

    # The service.

    async def Transfer(
        self, request: bank_pb2.TransferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bank_pb2.TransferResponse:
        """Moves ``amount`` to the bank at node ``to``."""
        await self._authorize(context, "operator", "Transfer")
        try:
            balance = await self.transfer(request.to, request.amount)
        except _Refused as e:
            await context.abort(e.code, e.details)
        if request.wait_queued:
            try:
                await self.session.flushed()
            except CairnError as e:
                # Not UNAVAILABLE: a client would retry, and the transfer is already made.
                await context.abort(
                    grpc.StatusCode.ABORTED,
                    f"the transfer was made (balance now {balance}) but its queueing at the "
                    f"node daemon is not confirmed: {e}; do not retry it",
                )
        return bank_pb2.TransferResponse(balance=balance)

    async def GetBalance(
        self, request: bank_pb2.GetBalanceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bank_pb2.GetBalanceResponse:
        """This bank's balance, counters and the state it would record now."""
        await self._authorize(context, "viewer", "GetBalance")
        return bank_pb2.GetBalanceResponse(
            node_id=self.session.node_id,
            balance=self.state.balance,
            peers=sorted(self.session.peers),
            restored_snapshot=self.restored,
            rejected_transfers=self.rejected,
            duplicate_transfers=self.duplicates,
            skipped_transfers=self.skipped,
            state_json=self.state.to_json().decode("utf-8"),
        )

    async def SetWorkload(
        self, request: bank_pb2.SetWorkloadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bank_pb2.SetWorkloadResponse:
        """Changes the rate of random transfers; answers once none of the old rate is under
        way."""
        await self._authorize(context, "operator", "SetWorkload")
        rate = request.rate
        if not math.isfinite(rate) or rate < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rate must be a number of transfers per second, 0 or more; got {rate}",
            )
        previous, self.rate = self.rate, rate
        self.rate_changed.set()
        async with self.workload_busy:
            pass
        _log.info("workload changed: rate %g (was %g)", rate, previous)
        return bank_pb2.SetWorkloadResponse(previous_rate=previous)

    async def _authorize(
        self, context: grpc.aio.ServicerContext[Any, Any], needed: str, method: str
    ) -> None:
        """On a TLS connection, the role of the client certificate's one ``cairn://`` URI
        SAN of this cluster must be at least ``needed`` (the Rust bank's table); plaintext
        connections are let through."""
        if not self.tls:
            return
        auth = context.auth_context()
        uris = [
            u.decode("utf-8", "replace")
            for u in auth.get("peer_uri", [])
            if u.startswith(b"cairn://")
        ]
        cluster = self.session.cluster
        who: str
        role: str | None = None
        if len(uris) != 1:
            who = f"the certificate carries {len(uris)} cairn:// URI SANs; one is allowed"
        else:
            parts = uris[0][len("cairn://") :].split("/")
            if parts[0] != cluster:
                who = f"the certificate is {uris[0]}, not of cluster {cluster}"
            elif len(parts) == 3 and parts[1] in ROLES:
                role, who = parts[1], f"{parts[2]} ({parts[1]}) of cluster {cluster}"
            elif len(parts) == 3 and parts[1] == "node":
                who = f"node {parts[2]} of cluster {cluster}"
            else:
                who = uris[0]
        if role is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a client certificate with a role is required "
                f"(cairn://CLUSTER/ROLE/NAME; this one is {who})",
            )
        elif ROLES[role] < ROLES[needed]:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs {needed}; the certificate of {who.split(' (')[0]} is {role}",
            )


class _Refused(Exception):
    """A Bank call refused with a status code, as the Rust bank refuses it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        """The status ``code`` and its ``details``."""
        super().__init__(details)
        self.code = code
        self.details = details


async def workload(bank: Bank, max_amount: int) -> None:
    """Random transfers to random peers at the bank's rate (``SetWorkload`` changes it; 0
    pauses)."""
    loop = asyncio.get_running_loop()
    next_tick = loop.time()
    while True:
        rate = bank.rate
        if rate <= 0:
            bank.rate_changed.clear()
            await bank.rate_changed.wait()
            next_tick = loop.time()
            continue
        delay = next_tick - loop.time()
        if delay > 0:
            bank.rate_changed.clear()
            try:
                await asyncio.wait_for(bank.rate_changed.wait(), delay)
                next_tick = loop.time()
                continue  # a new rate: start its ticks now
            except asyncio.TimeoutError:
                pass
        # A missed tick is not made up for (the next one is an interval after this one).
        next_tick = max(next_tick, loop.time()) + 1.0 / rate
        async with bank.workload_busy:
            if bank.rate <= 0:
                continue
            balance = bank.state.balance
            peers = sorted(bank.session.peers)
            if balance == 0 or not peers:
                continue
            to = random.choice(peers)
            amount = random.randint(1, max(1, min(max_amount, balance)))
            try:
                await bank.transfer(to, amount)
            except _Refused as e:
                if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                    _log.warning("workload transfer failed: %s", e.details)
                    return


# ---------------------------------------------------------------------- serving


def _health_handler() -> grpc.GenericRpcHandler:
    """gRPC health for the bank: SERVING for the server and ``cairn.bank.v1.Bank``."""

    async def check(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """``Check``: SERVING for the server and the Bank service, NOT_FOUND otherwise."""
        try:
            service = health.decode_request(request)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed health check request")
        if service not in ("", "cairn.bank.v1.Bank"):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service}")
        return health.encode_response(health.ServingStatus.SERVING)

    return grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health",
        {"Check": grpc.unary_unary_rpc_method_handler(check)},
    )


def _add_reflection(server: grpc.aio.Server) -> None:
    """Reflection for grpcurl, if grpcio-reflection is installed (optional)."""
    try:
        reflection: Any = importlib.import_module("grpc_reflection.v1alpha.reflection")
    except ImportError:
        return
    names = (bank_pb2.DESCRIPTOR.services_by_name["Bank"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)


async def connect(
    args: argparse.Namespace, tls: Tls | None, record: Callable[[int], bytes]
) -> AppSession:
    """Attaches to the daemon, trying until ``--connect-timeout`` while it is not up."""
    return await AppSession.connect(
        args.node,
        "cairn-bank-python",
        tls=tls,
        on_record_state=record,
        retry_for=args.connect_timeout,
    )


async def run(
    args: argparse.Namespace,
    tls: Tls | None,
    stop: asyncio.Event | None = None,
    serving: Callable[[int], None] | None = None,
) -> int:
    """Runs the bank until a signal, or ``stop`` (0), or until its daemon session ends
    (1). ``serving`` is told the port the Bank service listens on once it does."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - not on Unix
                pass
    holder: list[Bank] = []
    session = await connect(args, tls, lambda snapshot_id: holder[0].on_record_state(snapshot_id))
    bank = Bank(session, args.initial_balance, tls is not None)
    holder.append(bank)
    bank.rate = args.workload
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", CONTROL_MESSAGE),
            ("grpc.max_concurrent_streams", BANK_STREAMS),
        ]
    )
    bank_pb2_grpc.add_BankServicer_to_server(bank, server)
    server.add_generic_rpc_handlers((_health_handler(),))
    _add_reflection(server)
    try:
        if tls is not None:
            port = server.add_secure_port(args.listen, tls.server_credentials())
        else:
            port = server.add_insecure_port(args.listen)
    except RuntimeError as e:
        await session.close(drain=0)
        print(f"error: --listen {args.listen}: cannot listen there: {e}", file=sys.stderr)
        return EXIT_USAGE
    if port == 0:
        await session.close(drain=0)
        print(f"error: --listen {args.listen}: cannot listen there", file=sys.stderr)
        return EXIT_USAGE
    await server.start()
    _log.info(
        "bank serving: node %s, port %d, balance %d", session.node_id, port, args.initial_balance
    )
    if serving is not None:
        serving(port)
    work = asyncio.create_task(workload(bank, args.max_amount))

    async def events() -> int:
        """Handles the session's events until it ends; the exit code."""
        try:
            async for event in session:
                if isinstance(event, Message):
                    bank.on_message(event)
                elif isinstance(event, Restore):
                    bank.on_restore(event)
                elif isinstance(event, RecordState):  # pragma: no cover - the callback answers
                    session.state_recorded(event.snapshot_id, bank.state.to_json())
                # Restores come whole (the state is small); outcomes are not followed.
        except CairnError as e:
            _log.error("session with the node daemon failed: %s", e)
            return 1
        _log.error("the node daemon closed the session")
        return 1

    receiving = asyncio.create_task(events())
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = receiving.result() if receiving in done else 0
    for task in (receiving, stopping, work):
        task.cancel()
    await asyncio.gather(receiving, stopping, work, return_exceptions=True)
    await server.stop(grace=1.0)
    await session.close()
    return code


# ---------------------------------------------------------------------- flags


def _duration(text: str) -> float:
    """Seconds of a duration as humantime writes them (``30s``, ``500ms``, ``1m30s``; a bare
    number is seconds)."""
    units = {
        "ns": 1e-9,
        "us": 1e-6,
        "ms": 1e-3,
        "s": 1.0,
        "sec": 1.0,
        "m": 60.0,
        "min": 60.0,
        "h": 3600.0,
    }
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 500ms)")
    total = 0.0
    for number, unit in parts:
        if unit not in units:
            raise argparse.ArgumentTypeError(f"unknown unit {unit!r} in {text!r}")
        total += float(number) * units[unit]
    return total


def _u64_flag(text: str) -> int:
    """An unsigned 64-bit integer flag."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an unsigned integer: {text!r}") from None
    if not 0 <= value <= U64_MAX:
        raise argparse.ArgumentTypeError(f"not an unsigned 64-bit integer: {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, exiting with 64 (EX_USAGE) on a bad flag, as the Rust tools do."""

    def error(self, message: str) -> NoReturn:
        """Prints the usage and the error, and exits with 64."""
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags (each also an environment variable, as the Rust bank's)."""
    env = os.environ.get
    p = _Parser(
        description="cairn's example bank in Python "
        "(the Rust cairn-bank's payloads, state and service)."
    )
    p.add_argument(
        "--node",
        default=env("CAIRN_NODE_ADDR", "127.0.0.1:7200"),
        help="the application address of the node daemon beside this bank (CAIRN_NODE_ADDR)",
    )
    p.add_argument(
        "--listen",
        default=env("CAIRN_BANK_LISTEN", "127.0.0.1:7300"),
        help="address the Bank service listens on (CAIRN_BANK_LISTEN)",
    )
    p.add_argument(
        "--initial-balance",
        type=_u64_flag,
        default=env("CAIRN_INITIAL_BALANCE", "1000"),
        help="the balance this bank starts with (CAIRN_INITIAL_BALANCE)",
    )
    p.add_argument(
        "--workload",
        type=float,
        default=env("CAIRN_WORKLOAD", "0"),
        help="random transfers per second to random peers, 0 for none (CAIRN_WORKLOAD)",
    )
    p.add_argument(
        "--max-amount",
        type=_u64_flag,
        default=env("CAIRN_MAX_AMOUNT", "10"),
        help="largest random transfer of the workload (CAIRN_MAX_AMOUNT)",
    )
    p.add_argument(
        "--connect-timeout",
        type=_duration,
        default=env("CAIRN_CONNECT_TIMEOUT", "30s"),
        help="how long to keep trying to reach the daemon at start, e.g. 30s "
        "(CAIRN_CONNECT_TIMEOUT)",
    )
    p.add_argument("--ledger", default=env("CAIRN_LEDGER"), help="not supported by the Python bank")
    p.add_argument(
        "--log",
        default=env("CAIRN_LOG", "info"),
        help="log level: error, warn, info, debug (CAIRN_LOG)",
    )
    p.add_argument(
        "--tls-cert",
        default=env("CAIRN_TLS_CERT"),
        help="this node's certificate, PEM (CAIRN_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key", default=env("CAIRN_TLS_KEY"), help="its private key, PEM (CAIRN_TLS_KEY)"
    )
    p.add_argument(
        "--tls-ca", default=env("CAIRN_TLS_CA"), help="the cluster's CA, PEM (CAIRN_TLS_CA)"
    )
    p.add_argument(
        "--tls-crl", default=env("CAIRN_TLS_CRL"), help="not supported by the Python bank"
    )
    args = p.parse_args(argv)
    if not (math.isfinite(args.workload) and args.workload >= 0) or args.max_amount == 0:
        p.error("--workload must be a non-negative number and --max-amount positive")
    if args.ledger:
        p.error(
            "--ledger is not supported by the Python bank (use the Rust cairn-bank for the ledger)"
        )
    if args.tls_crl:
        p.error("--tls-crl is not supported by the Python bank (gRPC Python takes no CRL)")
    return args


def _log_level(text: str) -> int:
    """A logging level from ``--log`` (a level name, or the bare level of a tracing
    filter such as ``warn,cairn=debug``)."""
    levels = {
        "trace": logging.DEBUG,
        "debug": logging.DEBUG,
        "info": logging.INFO,
        "warn": logging.WARNING,
        "warning": logging.WARNING,
        "error": logging.ERROR,
        "off": logging.CRITICAL + 1,
    }
    for directive in text.lower().split(","):
        if directive.strip() in levels:
            return levels[directive.strip()]
    return logging.INFO


def main(argv: Sequence[str] | None = None) -> int:
    """The command line."""
    args = parse_args(argv)
    logging.basicConfig(
        level=_log_level(args.log),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    given = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
    tls: Tls | None = None
    if any(given.values()):
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            print(
                "error: TLS needs --tls-cert, --tls-key and --tls-ca together; "
                f"{', '.join(missing)} missing",
                file=sys.stderr,
            )
            return EXIT_USAGE
        try:
            tls = Tls.from_files(args.tls_ca, args.tls_cert, args.tls_key)
        except TlsError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
    else:
        _log.warning(
            "no --tls-cert/--tls-key/--tls-ca: the session with the daemon and the Bank port "
            "are unencrypted and unauthenticated"
        )
    try:
        return asyncio.run(run(args, tls))
    except CairnError as e:
        _log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
