"""A POP consumer process that pops one batch, acknowledges its first half, says which it got and which it
acknowledged (one JSON line), and holds the rest unacknowledged until it is killed (tests/crash/test_pop.py).

Usage: ``python pop_holder.py PORT GROUP FILTER COUNT INVISIBLE_S``.
"""

import json
import sys

import trio

from store.clients.pop import PopConsumer


async def main(port: str, group: str, filter: str, count: str, invisible_s: str) -> None:
    async with PopConsumer.connect("127.0.0.1", int(port), group=group, filter=filter,
                                   invisible_s=float(invisible_s), wait_s=30.0) as consumer:
        batch: list = []
        while len(batch) < int(count):
            batch += await consumer.pop(max_count=int(count) - len(batch))
        acked = [m.payload.decode() for m in batch[: len(batch) // 2] if await consumer.ack(m)]
        print(json.dumps({"popped": [m.payload.decode() for m in batch], "acked": acked}), flush=True)
        await trio.sleep_forever()  # busy with the rest: never acknowledges it


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:])
