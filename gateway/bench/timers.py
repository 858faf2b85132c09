"""``lightgate bench timers``: delayed messages in the store (store/timer/), scheduled, held, and dequeued.

An in-process store schedules ``--messages`` delayed messages due over ``--spread`` seconds after a lead time
that covers the scheduling; it reports the scheduling rate (appended and applied by dispatch), the process's RSS
and the disk growth with all of them pending, then waits until the last one is delivered and reports the dequeue
rate (delivered messages over the time from the first delivery to the last: with ``--spread 0`` all are due at
once and it is the step's capacity) and the lateness of every message (its delivered record's store time minus its
due time: p50, p99, max).
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from store.api import NewMessage
from store.log.commitlog import CommitLogConfig
from store.log.record import now_ms
from store.node import StoreNode, open_store
from store.usage import process_usage

DUE = struct.Struct(">Q")
"""Each payload starts with its due time (ms), so lateness is read back from the delivered records."""

BATCH = 1000
"""Delayed messages per append."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--messages", type=int, default=100_000, help="delayed messages scheduled")
    parser.add_argument("--spread", type=float, default=10.0, help="seconds their due times are spread over")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes of each message")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lightgate-bench-timers-", dir=args.dir) as tmp:
        return trio.run(_run, Path(tmp), args)


async def _run(data: Path, args: argparse.Namespace) -> dict[str, Any]:
    count, spread_ms = args.messages, int(args.spread * 1000)
    filler = b"x" * max(0, args.payload - DUE.size)
    rss_before = process_usage().rss_bytes
    async with open_store(data, CommitLogConfig()) as node:
        disk_before = _disk(data)
        lead_ms = 5000 + count // 10  # long enough to schedule them all before the first is due (10 k/ms budget)
        first_due = now_ms() + lead_ms
        started = time.perf_counter()
        for start in range(0, count, BATCH):
            batch = []
            for i in range(start, min(count, start + BATCH)):
                due = first_due + i * spread_ms // count
                batch.append(NewMessage(f"bench/{i % 100}", DUE.pack(due) + filler, "bench", 1, deliver_at_ms=due))
            await node.append(batch)
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        scheduled_s = time.perf_counter() - started
        pending = node.timers.pending
        rss_pending = process_usage().rss_bytes
        disk_pending = _disk(data)
        with trio.fail_after(lead_ms / 1000 + args.spread + 600):
            while node.timers.pending:
                await trio.sleep(0.1)  # polling the figure the bench reports on, not a synchronisation
        delivered = await trio.to_thread.run_sync(_delivered, node)
    lateness = sorted(store_ms - due for due, store_ms in delivered)
    went = [store_ms for _, store_ms in delivered]
    last = len(lateness) - 1
    return {
        "messages": count, "pending_after_scheduling": pending, "delivered": len(lateness),
        "scheduled_per_s": round(count / scheduled_s),
        "dequeued_per_s": round(len(went) * 1000 / max(1, max(went) - min(went))) if went else 0,
        "lateness_ms": {"p50": lateness[last // 2], "p99": lateness[last * 99 // 100], "max": lateness[-1]}
        if lateness else None,
        "rss_growth_bytes": rss_pending - rss_before, "disk_growth_bytes": disk_pending - disk_before,
        "disk_bytes_per_pending": round((disk_pending - disk_before) / max(1, count)),
        "load_average": round(os.getloadavg()[0], 2),
    }


def _delivered(node: StoreNode) -> list[tuple[int, int]]:
    """(due ms, store ms) of every delivered message (blocking: reads the topics' queues)."""
    found = []
    for topic in range(100):
        offset = 0
        while True:
            result = node.read(f"bench/{topic}", offset, max_count=4096, max_bytes=16 << 20)
            if not result.messages:
                break
            for queue_offset, record in result.messages:
                found.append((DUE.unpack_from(record.payload)[0], record.store_ms))
                offset = queue_offset + 1
    return found


def _disk(data: Path) -> int:
    """Bytes the store's files take on disk (allocated blocks: the wheel is sparse)."""
    return sum(path.stat().st_blocks * 512 for path in data.rglob("*") if path.is_file())
