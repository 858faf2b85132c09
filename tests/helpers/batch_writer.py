"""Writer subprocess for tests/crash/test_batches.py: a store node appending batch records until killed.

Usage: ``python tests/helpers/batch_writer.py DATA sync|async``

Batches of 1 to 40 messages on three topics go through ``StoreApi.append(batch=True)``; every message's payload
is :func:`payload` of its sequence number, its batch's first one and its batch's size, so the test can check each
message byte for byte and that every batch it finds is whole.

- ``sync``: 8 trio tasks append (each append returns once on disk); one ``ack <topic> <first position> <first
  seq> <count>`` line per batch once its append returned.
- ``async``: one task appends, printing ``ack`` lines and ``flushed <offset>`` whenever the flushed offset moved.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from store.api import NewMessage
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.node import open_store

SEGMENT_BYTES = 64 * 1024
"""Small, so the kill lands near segment rolls too."""

TOPICS = ("bat/0", "bat/1", "bat/2")


def config(mode: str) -> CommitLogConfig:
    return CommitLogConfig(segment_bytes=SEGMENT_BYTES, max_record_bytes=SEGMENT_BYTES, flush=mode,
                           flush_interval_ms=5, flush_min_bytes=2048)


def payload(seq: int, first: int, count: int) -> bytes:
    return f"{seq}:{first}:{count};".encode() * (1 + seq % 5)


def parse(data: bytes) -> tuple[int, int, int]:
    """(seq, its batch's first seq, its batch's size) of a :func:`payload`."""
    seq, first, count = data.split(b";")[0].split(b":")
    return int(seq), int(first), int(count)


async def main(data: Path, mode: str) -> None:
    counter = iter(range(10**9))
    async with open_store(data, config(mode)) as node:
        store = LocalStore(node, "writer")

        async def writer() -> None:
            while True:
                first = next(counter)
                count = 1 + first % 40
                for _ in range(count - 1):
                    next(counter)
                topic = TOPICS[first % 3]
                messages = [NewMessage(topic, payload(first + i, first, count), client_id=f"c{i % 4}", qos=1)
                            for i in range(count)]
                positions = await store.append(messages, batch=True)
                line = f"ack {topic} {positions[0].offset} {first} {count}"
                if mode == "async":
                    line += f"\nflushed {node.log.log.flushed_offset}"
                print(line, flush=True)

        async with trio.open_nursery() as nursery:
            for _ in range(8 if mode == "sync" else 1):
                nursery.start_soon(writer)


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), sys.argv[2])
