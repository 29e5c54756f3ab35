"""Throughput of the Python SDK through real daemons (issue 36's measurement): 64-byte
messages from a Python application on one node to a Python application on another (each in
a process of its own), sent with packed runs (``send_many`` of 1,024: one ``SendBatch`` of
runs per 256 messages) and one at a time (``send``), delivered as packed runs and consumed
through the async iterator. Beside it, the same flow between Rust applications, measured in
the same run by ``cairn-bench --quick --scenarios d``. Prints the numbers and where the CPU
went; asserts only that every message arrived.

``CAIRN_PY_BENCH_MESSAGES`` sets the messages of the packed phase (default 200,000);
``CAIRN_PY_BENCH_BASELINE=0`` leaves the Rust baseline out (it takes about 15 s)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .cluster import Cluster, Harness, Process, binary, cpu_seconds, eventually, run

HERE = Path(__file__).resolve().parent
SIZE = 64
PACKED = max(1024, int(os.environ.get("CAIRN_PY_BENCH_MESSAGES", "200000")) // 1024 * 1024)
ONE_BY_ONE = PACKED // 4


def _lines(process: Process) -> list[dict[str, Any]]:
    """The JSON lines the receiver printed so far."""
    out = []
    for line in process.log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _rust_baseline(harness: Harness) -> float | None:
    """Messages/s of 64 B between two Rust applications through two daemons
    (``cairn-bench --quick --scenarios d``, its "cairn, two daemons" row), or ``None`` if
    left out."""
    if os.environ.get("CAIRN_PY_BENCH_BASELINE", "1") == "0":
        return None
    out = harness.tmp / "bench.json"
    process = harness.spawn(
        "cairn-bench",
        [str(binary("cairn-bench")), "--quick", "--scenarios", "d", "--out", str(out)],
    )
    code = process.popen.wait(timeout=300)
    process.expected = False
    assert code == 0, f"cairn-bench failed ({code}): see {process.log}"
    found: list[float] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if (
                value.get("scenario") == "d"
                and value.get("payload") == SIZE
                and str(value.get("path", "")).startswith("cairn")
            ):
                found.append(float(value["per_s"]))
            for inner in value.values():
                walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    walk(json.loads(out.read_text()))
    assert found, f"no 64 B cairn row in {out}"
    return found[0]


@pytest.mark.benchmark
def test_throughput_of_the_python_sdk_through_real_daemons(harness: Harness) -> None:
    results: dict[str, float] = {}
    cpu: dict[str, float] = {}

    async def body() -> None:
        async with await Cluster.start(harness, ["n1", "n2"]) as cluster:
            receiver = harness.spawn(
                "receiver",
                [sys.executable, str(HERE / "bench_receiver.py"), cluster.nodes["n2"].app]
                + [str(PACKED), str(PACKED + ONE_BY_ONE)],
            )

            async def attached() -> None:
                assert any("attached" in line for line in _lines(receiver)), "not attached"

            await eventually("the receiver attached", attached, harness=harness)
            sender = await cluster.attach("n1", "bench-sender")
            payload = b"p" * SIZE
            batch = [("n2", payload)] * 1024
            daemons = {n: cluster.nodes[n].daemon for n in ("n1", "n2")}
            processes = {"sender (Python)": os.getpid(), "receiver (Python)": receiver.pid}
            for node, daemon in daemons.items():
                assert daemon is not None
                processes[f"{node} daemon"] = daemon.pid
            before = {name: cpu_seconds(pid) for name, pid in processes.items()}

            started = time.monotonic()
            for _ in range(PACKED // 1024):
                await sender.send_many(batch)
            await sender.flushed()
            taken = time.monotonic()

            async def mark(n: int) -> dict[str, Any]:
                lines = [line for line in _lines(receiver) if line.get("count") == n]
                assert lines, f"the receiver has not had {n} yet"
                return lines[0]

            first_mark = await eventually(
                "the receiver got the packed phase",
                lambda: mark(PACKED),
                interval=0.01,
                timeout=120,
                harness=harness,
            )
            seen = time.monotonic()
            after = {name: cpu_seconds(pid) for name, pid in processes.items()}
            wall = seen - started
            for name in processes:
                cpu[name] = after[name] - before[name]
            cpu["wall"] = wall

            results["send, packed runs (send_many of 1024)"] = PACKED / (taken - started)
            results["delivery, packed runs (consumed)"] = PACKED / (
                first_mark["at"] - first_mark["first"]
            )
            results["end to end, packed runs"] = PACKED / (first_mark["at"] - started)

            started = time.monotonic()
            for _ in range(ONE_BY_ONE):
                await sender.send("n2", payload)
            await sender.flushed()
            results["send, one at a time (send; taken by the daemon)"] = ONE_BY_ONE / (
                time.monotonic() - started
            )
            last_mark = await eventually(
                "the receiver got everything",
                lambda: mark(PACKED + ONE_BY_ONE),
                interval=0.01,
                timeout=120,
                harness=harness,
            )
            assert last_mark["count"] == PACKED + ONE_BY_ONE
            results["end to end, one at a time"] = ONE_BY_ONE / (last_mark["at"] - started)
            await sender.close()
            # The daemons go before the baseline starts its own.
            for node in cluster.nodes:
                await cluster.kill_node(node)
            assert cluster.coordinator_process is not None
            cluster.coordinator_process.kill()

    run(body(), timeout=240)
    baseline = _rust_baseline(harness)
    lines = [f"{name}: {rate:,.0f} messages/s" for name, rate in results.items()]
    if baseline is not None:
        lines.append(
            f"baseline, Rust apps through two daemons (cairn-bench d): {baseline:,.0f} messages/s"
        )
        lines.append(
            f"Python end to end / Rust: {results['end to end, packed runs'] / baseline:.0%}"
        )
    wall = cpu.pop("wall")
    busiest = max(cpu, key=lambda name: cpu[name])
    usage = ", ".join(
        f"{name} {seconds / wall:.0%} ({seconds / PACKED * 1e6:.1f} µs a message)"
        for name, seconds in cpu.items()
    )
    lines.append(f"CPU during the packed phase ({wall:.2f} s; share of one core): {usage}")
    cores = os.cpu_count() or 1
    lines.append(
        f"what limits it: the busiest process is the {busiest}, at "
        f"{cpu[busiest] / PACKED * 1e6:.1f} µs of CPU a message (at most "
        f"{PACKED / cpu[busiest]:,.0f} messages/s on a core of its own); the four processes "
        f"used {sum(cpu.values()) / wall:.2f} of this machine's {cores} cores. The Python "
        "side costs the most per message: an event object each and a turn of the async "
        "iterator (next_event) on receipt, the packing into runs on sending, and the gRPC "
        "and asyncio turns per batch; the daemons move the same messages for less"
    )
    print(
        f"\n{SIZE} B messages, {PACKED:,} packed + {ONE_BY_ONE:,} one at a time:\n  "
        + "\n  ".join(lines)
    )
