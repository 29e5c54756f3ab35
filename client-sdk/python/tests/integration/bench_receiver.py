"""The receiving application of the throughput benchmark, in a process of its own (so that
it does not share a core's event loop with the sender): attaches to a daemon, says so on
stdout, consumes messages and prints, as JSON, when the first came and when the count
reached each ``MARK`` (``time.monotonic``, the same clock in every process on Linux); ends
after the last mark.

    python bench_receiver.py ADDRESS MARK [MARK...]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from cairn import AppSession, Message, RecordState


async def main(address: str, marks: list[int]) -> None:
    """Receives messages at the daemon at ``address`` until the last of ``marks``."""
    session = await AppSession.connect(address, "bench-receiver", retry_for=30)
    print(json.dumps({"attached": session.node_id}), flush=True)
    count = 0
    first = 0.0
    pending = sorted(marks)
    async for event in session:
        if type(event) is Message:
            if count == 0:
                first = time.monotonic()
            count += 1
            if count == pending[0]:
                at = time.monotonic()
                print(json.dumps({"count": count, "first": first, "at": at}), flush=True)
                pending.pop(0)
                if not pending:
                    break
        elif isinstance(event, RecordState):
            session.state_recorded(event.snapshot_id, str(count).encode())
    await session.close(drain=0)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], [int(mark) for mark in sys.argv[2:]]))
