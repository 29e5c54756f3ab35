"""A mixed cluster: two Rust banks (``cairn-bank``) and two Python banks
(``examples/bank.py``) under load, moving money to each other through four daemons, the
coordinator with automatic recovery. Snapshots in all three modes complete and the money
adds up in each (recorded balances plus recorded transfers in flight, read from the
snapshot's data); then a Python bank and its daemon are killed (``kill -9``) and started
again as fresh processes, automatic recovery restores the newest snapshot, and the money
adds up after the restore (every transfer delivered) and in a snapshot taken after it."""

from __future__ import annotations

import json

from cairn.v1 import coordinator_pb2

from .cluster import Cluster, Harness, bank_money, eventually, local_state, run

RUST, PYTHON = ["n1", "n2"], ["n3", "n4"]
NODES = RUST + PYTHON
INITIAL_BALANCE = 1000
TOTAL = INITIAL_BALANCE * len(NODES)
#: Random transfers per second of each bank (2,000 a second in all: snapshots record
#: transfers in flight).
WORKLOAD = 500.0
#: The Python bank that is killed with its daemon.
VICTIM = "n4"


def check_money(snapshot: coordinator_pb2.Snapshot, what: str) -> int:
    """The money adds up in a snapshot of the four banks; the transfers it recorded in
    flight."""
    assert sorted(n.node_id for n in snapshot.nodes) == NODES, what
    for node in NODES:
        state = json.loads(local_state(snapshot, node))
        assert set(state) >= {"balance", "line"}, f"{what}: {node}'s state {state}"
    in_flight = sum(len(c.messages) for n in snapshot.nodes for c in n.channel_states)
    money = bank_money(snapshot)
    assert money == TOTAL, f"{what}: the money does not add up: {money} != {TOTAL}"
    return in_flight


def test_rust_and_python_banks_share_consistent_snapshots_and_recover(harness: Harness) -> None:
    async def body() -> None:
        cluster = await Cluster.start(harness, NODES, coordinator_args=["--auto-restore"])
        async with cluster:
            for node in RUST:
                cluster.start_rust_bank(node, workload=WORKLOAD, initial_balance=INITIAL_BALANCE)
            for node in PYTHON:
                cluster.start_python_bank(node, workload=WORKLOAD, initial_balance=INITIAL_BALANCE)
            await cluster.wait_banks_ready()
            client = await cluster.client()

            # Money moves every way: Rust to Python, Python to Rust, and alike.
            async def everyone_paid() -> None:
                for node in NODES:
                    state = json.loads((await cluster.balance(node)).state_json)
                    got = sorted(state.get("received", {}))
                    assert got == [n for n in NODES if n != node], f"{node} received from {got}"

            await eventually("every bank received from every other", everyone_paid, harness=harness)

            recorded_in_flight: dict[str, list[int]] = {}
            for _ in range(2):
                for mode in ("chandy-lamport", "unaligned", "aligned"):
                    snapshot = await cluster.snapshot(mode)
                    in_flight = check_money(snapshot, f"{mode} snapshot")
                    recorded_in_flight.setdefault(mode, []).append(in_flight)
            newest = snapshot.plan.snapshot_id
            assert sum(map(sum, recorded_in_flight.values())) > 0, (
                f"no snapshot recorded a transfer in flight: {recorded_in_flight}"
            )

            # kill -9 of a Python bank and its daemon; both come back as fresh processes.
            restores = await client.list_restores(limit=1)
            before = restores[0].restore_id if restores else None
            cluster.kill_bank(VICTIM)
            await cluster.kill_node(VICTIM)
            cluster.start_node(VICTIM)
            cluster.start_python_bank(VICTIM, workload=WORKLOAD, initial_balance=INITIAL_BALANCE)

            async def recovered() -> coordinator_pb2.RestoreOperation:
                restores = await client.list_restores(limit=1)
                assert restores, "no restore yet"
                newest_restore = restores[0]
                assert newest_restore.restore_id != before, "no restore yet"
                assert not newest_restore.HasField("failure"), newest_restore.failure
                assert newest_restore.done, f"{newest_restore.restore_id} not done yet"
                return newest_restore

            operation = await eventually(
                "automatic recovery restored", recovered, timeout=60, harness=harness
            )
            assert "automatic recovery" in operation.requested_by, operation
            assert VICTIM in operation.requested_by, operation
            assert operation.snapshot_id == newest, "the newest completed snapshot"
            assert sorted(operation.applied) == NODES
            await cluster.wait_banks_ready()
            for node in NODES:
                answer = await cluster.balance(node)
                assert answer.restored_snapshot == newest, f"{node}: {answer}"

            # After the restore: with the transfers paused and those in flight delivered,
            # the banks hold all the money, and every transfer sent was received.
            await cluster.set_workload(0.0)

            async def settled() -> None:
                answers = {node: await cluster.balance(node) for node in NODES}
                states = {node: json.loads(a.state_json) for node, a in answers.items()}
                for sender, state in states.items():
                    for receiver, last in state.get("sent", {}).items():
                        got = states[receiver].get("received", {}).get(sender)
                        assert got == {"line": state["line"], "id": last}, (
                            f"{sender}→{receiver}: sent {last}, received {got}"
                        )
                money = sum(a.balance for a in answers.values())
                assert money == TOTAL, f"the banks hold {money} of {TOTAL}"

            await eventually("the money adds up after the restore", settled, harness=harness)
            for node in NODES:
                answer = await cluster.balance(node)
                counts = (
                    answer.duplicate_transfers,
                    answer.skipped_transfers,
                    answer.rejected_transfers,
                )
                assert counts == (0, 0, 0), f"{node}: duplicates, skipped, rejected {counts}"

            # And in snapshots after it, under load again.
            await cluster.set_workload(WORKLOAD)
            for mode in ("unaligned", "chandy-lamport", "aligned"):
                snapshot = await cluster.snapshot(mode)
                check_money(snapshot, f"{mode} snapshot after the restore")
                assert snapshot.plan.epoch == operation.epoch, "taken in the restore's epoch"
            print(
                f"\nmoney adds up in every snapshot (in flight: {recorded_in_flight}); "
                f"{operation.restore_id} ({operation.requested_by}) restored snapshot {newest}"
            )

    run(body(), timeout=120)
