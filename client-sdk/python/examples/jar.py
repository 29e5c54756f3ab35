"""A tip jar beside cairn's banks: it keeps the money banks send it and gives a coin back
now and then. Its state is a bank's ({"balance": N}), so a snapshot still adds up."""

import asyncio
import json
import sys

from cairn import AppSession, Message, RecordState, Restore


async def main(address: str) -> None:
    """Runs the jar against the daemon at ``address`` until the session ends."""
    balance = 0
    async with await AppSession.connect(address, "jar", retry_for=30) as session:
        async for event in session:
            match event:
                case Message(sender, payload):
                    balance += json.loads(payload)["amount"]  # a bank's transfer
                    if balance > 10:
                        permit = await session.reserve()  # may wait: before the change
                        balance -= 1  # the debit and its message, with no await between
                        permit.send(sender, b'{"amount":1}')
                case RecordState(snapshot_id):
                    session.state_recorded(snapshot_id, json.dumps({"balance": balance}).encode())
                case Restore(restore_id, _, state):
                    balance = json.loads(state)["balance"]
                    session.restore_applied(restore_id)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7200"))
