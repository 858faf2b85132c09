"""Writer subprocess for tests/store/log/test_durability.py: appends until killed, printing what is acknowledged.

Usage: ``python tests/helpers/commitlog_writer.py DIR sync|async``

Every record's payload is :func:`payload` of its sequence number, so the test
can check each acknowledged record byte for byte after the SIGKILL.

- ``sync``: 16 trio tasks append small durable batches through AsyncCommitLog;
  once a batch returns, one ``ack <offset> <size> <seq>`` line per record.
- ``async``: one task appends batches without waiting for durability, printing
  ``ack`` lines and ``flushed <offset>`` whenever the flushed offset moved.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from store.log.aio import AsyncCommitLog
from store.log.commitlog import CommitLogConfig
from store.log.record import encode_record

SEGMENT_BYTES = 64 * 1024
"""Small, so the kill lands near segment rolls too."""


def payload(seq: int) -> bytes:
    return f"{seq}:".encode() * (1 + seq % 37)


def record(seq: int) -> bytes:
    return encode_record(f"dev/{seq % 10}/t", payload(seq), client_id=f"c{seq % 3}", qos=1)


async def main(directory: Path, mode: str) -> None:
    cfg = CommitLogConfig(segment_bytes=SEGMENT_BYTES, max_record_bytes=SEGMENT_BYTES, flush=mode,
                          flush_interval_ms=5, flush_min_bytes=2048)
    counter = iter(range(10**9))
    async with AsyncCommitLog.open(directory, cfg) as log:
        async def writer() -> None:
            while True:
                seqs = [next(counter) for _ in range(1 + next(counter) % 4)]
                records = [record(s) for s in seqs]
                offsets = await log.append_batch(records)
                lines = [f"ack {o} {len(r)} {s}" for o, r, s in zip(offsets, records, seqs)]
                if mode == "async":
                    lines.append(f"flushed {log.log.flushed_offset}")
                print("\n".join(lines), flush=True)

        async with trio.open_nursery() as nursery:
            for _ in range(16 if mode == "sync" else 1):
                nursery.start_soon(writer)


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), sys.argv[2])
