"""The SDK's throughput with packed runs, against a daemon in another process: deliveries
consumed, and sends taken, per second, for 64-byte messages. Prints the numbers (and asserts
only that the session moves them all); CAIRN_BENCH_MESSAGES sets how many (default 100,000).
What limits them is the Python side: one event object per message, and the event loop's
turns per batch."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from cairn import AppSession, Message

from conftest import ROOT

HERE = Path(__file__).resolve().parent
MESSAGES = int(os.environ.get("CAIRN_BENCH_MESSAGES", "100000")) // 1024 * 1024
SIZE = 64


def test_throughput_of_deliveries_and_sends(capsys: object) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    daemon = subprocess.Popen(
        [sys.executable, str(HERE / "flood_daemon.py"), str(MESSAGES), str(SIZE)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert daemon.stdout is not None
        port = int(daemon.stdout.readline())
        results = asyncio.run(asyncio.wait_for(measure(f"127.0.0.1:{port}"), 120))
    finally:
        daemon.kill()
        daemon.wait()
    lines = [
        f"{name}: {MESSAGES / seconds:,.0f} messages/s of {SIZE} B ({seconds:.2f} s)"
        for name, seconds in results
    ]
    print("\nthroughput through the Python SDK:\n  " + "\n  ".join(lines))


async def measure(address: str) -> list[tuple[str, float]]:
    session = await AppSession.connect(address, "bench")
    results = []
    started = time.perf_counter()
    received = 0
    async for event in session:
        if type(event) is Message:
            received += 1
            if received == MESSAGES:
                break
    results.append(("deliveries (next_event)", time.perf_counter() - started))

    payload = b"s" * SIZE
    started = time.perf_counter()
    for _ in range(MESSAGES):
        await session.send("n2", payload)
    await session.flushed()
    results.append(("sends (send, one at a time)", time.perf_counter() - started))

    started = time.perf_counter()
    batch = [("n2", payload)] * 1024
    for _ in range(MESSAGES // 1024):
        await session.send_many(batch)
    await session.flushed()
    results.append(("sends (send_many of 1024)", time.perf_counter() - started))
    await session.close()
    return results
