"""CommitLog append throughput (async and sync group commit) next to the disk's raw numbers.

Measured in one run, on the file system of ``--data``:

- raw sequential write bandwidth (1 MiB writes for ``--seconds``, then one
  fdatasync, timed like the async appends) and raw fsync rate (4 KiB pwrite +
  fdatasync per iteration): the ceilings;
- ``async``: one trio task appending batches through AsyncCommitLog without
  waiting for durability (the background flusher applies the 500 ms / 16 KiB /
  10 s policy); the clock stops after a final flush, so the data is on disk.
  Reported append-only (records encoded beforehand) and encode+append;
- ``sync``: 64 trio tasks appending durable batches (group commit), plus one
  writer appending single records, which is one fsync per record.

Every number is the median of ``--runs`` runs of ``--seconds`` each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from itertools import cycle, islice
from pathlib import Path
from typing import Any, Callable

import trio

from gateway.bench.common import Stopwatch, median_of
from store.log.aio import AsyncCommitLog
from store.log.commitlog import CommitLogConfig
from store.log.record import encode_record

MiB = 1024 * 1024
PAYLOADS = (100, 1024)  # a small telemetry reading and a typical larger message (the two sizes)
BATCHES = (1, 16, 256)  # one record per append, a typical publish burst, and the batcher's large batches
SYNC_WRITERS = 64  # concurrent durable writers, as the issue asks: enough to show what group commit shares
POOL = 4096
"""Distinct pre-encoded records cycled through by the append-only runs (more would only cost set-up time)."""

TOPIC = "fleet/device-00042/telemetry"  # realistic lengths: they are part of every record's size
CLIENT = "device-00042"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=Path("data"),
                        help="directory on the disk to measure; a temporary sub-directory is used and removed")
    parser.add_argument("--seconds", type=float, default=1.0, help="duration of each measurement")
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement (the median is reported)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.data.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.data))
    try:
        return _run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    raw_seq = median_of(args.runs, lambda: _raw_sequential_mbps(root, args.seconds))
    raw_fsync = median_of(args.runs, lambda: _raw_fsyncs_per_s(root, args.seconds))
    rows = []
    for payload in PAYLOADS:
        pool = [_encode(payload) for _ in range(POOL)]
        size = len(pool[0])
        for batch in BATCHES:
            append_only = median_of(args.runs, lambda: _async_rate(root, pool, batch, args.seconds, encode=None))
            with_encode = median_of(args.runs, lambda: _async_rate(root, pool, batch, args.seconds, encode=payload))
            rows.append(_row("async", payload, size, batch, 1, append_only, with_encode))
        for batch in BATCHES:
            rate = median_of(args.runs, lambda: _sync_rate(root, pool, batch, SYNC_WRITERS, args.seconds))
            rows.append(_row("sync", payload, size, batch, SYNC_WRITERS, rate, None))
    one_fsync = median_of(args.runs, lambda: _sync_rate(root, [_encode(100)] * 16, 1, 1, args.seconds))

    def find(mode: str, payload: int, batch: int) -> dict[str, Any]:
        return next(r for r in rows if (r["mode"], r["payload"], r["batch"]) == (mode, payload, batch))

    async_1k = max(find("async", 1024, b)["MBps"] for b in BATCHES)
    small = find("async", 100, 256)
    group = find("sync", 100, 1)["appends_per_s"]  # same unit of work as the baseline: one record per append
    return {
        "raw": {"seq_write_MBps": raw_seq, "fsyncs_per_s": raw_fsync},
        "one_fsync_per_record_appends_per_s": one_fsync,
        "rows": rows,
        "targets": {
            "async_1KiB_vs_raw_seq": _target(async_1k / raw_seq["median"], 0.5),
            "async_100B_batch256_encode_and_append_per_s": _target(small["encode_appends_per_s"], 300_000),
            "async_100B_batch256_append_only_per_s": _target(small["appends_per_s"], 300_000),
            "sync_group_commit_vs_one_fsync_per_record": _target(group / one_fsync["median"], 20),
        },
        "settings": {"seconds": args.seconds, "runs": args.runs, "sync_writers": SYNC_WRITERS,
                     "data": str(args.data.resolve())},
    }


def _encode(payload: int) -> bytes:
    return encode_record(TOPIC, os.urandom(payload), client_id=CLIENT, qos=1)


def _row(mode: str, payload: int, size: int, batch: int, writers: int,
         rate: dict[str, Any], with_encode: dict[str, Any] | None) -> dict[str, Any]:
    row = {"mode": mode, "payload": payload, "record_bytes": size, "batch": batch, "writers": writers,
           "appends_per_s": round(rate["median"]), "MBps": round(rate["median"] * size / 1e6, 1),
           "runs": [round(v) for v in rate["runs"]]}
    if with_encode is not None:
        row["encode_appends_per_s"] = round(with_encode["median"])
        row["encode_runs"] = [round(v) for v in with_encode["runs"]]
    return row


def _target(value: float, target: float) -> dict[str, Any]:
    return {"value": round(value, 2), "target": target, "met": value >= target}


def _fresh(root: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=root))


def _raw_sequential_mbps(root: Path, seconds: float) -> float:
    """Buffered 1 MiB writes for ``seconds``, then one fdatasync: what the disk sustains for a log.

    Timed like :func:`_async_rate` (write for a while, then make it durable),
    so the two numbers compare like with like.
    """
    path = _fresh(root) / "raw"
    block = os.urandom(MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = 0
    try:
        with Stopwatch() as sw:
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                written += os.write(fd, block)
            os.fdatasync(fd)
    finally:
        os.close(fd)
        shutil.rmtree(path.parent)
    return written / sw.seconds / 1e6


def _raw_fsyncs_per_s(root: Path, seconds: float) -> float:
    """A 4 KiB pwrite and an fdatasync per iteration: the cost of making one small append durable."""
    path = _fresh(root) / "raw"
    block = os.urandom(4096)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    count = 0
    try:
        start = time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline:
            os.pwrite(fd, block, count * 4096)
            os.fdatasync(fd)
            count += 1
        return count / (time.perf_counter() - start)
    finally:
        os.close(fd)
        shutil.rmtree(path.parent)


def _batches(pool: list[bytes], batch: int) -> Callable[[], list[bytes]]:
    stream = cycle(pool)
    return lambda: list(islice(stream, batch))


def _async_rate(root: Path, pool: list[bytes], batch: int, seconds: float, *, encode: int | None) -> float:
    """Records/s appended without waiting for durability, timed until a final flush completes.

    ``encode``: None appends records from ``pool``; a payload size encodes
    each record inside the timed loop instead.
    """
    directory = _fresh(root)
    next_batch = _batches(pool, batch)

    async def main() -> float:
        async with AsyncCommitLog.open(directory, CommitLogConfig(flush="async")) as log:
            count = 0
            body = os.urandom(encode or 0)
            start = time.perf_counter()
            deadline = start + seconds
            while time.perf_counter() < deadline:
                if encode is not None:
                    records = [encode_record(TOPIC, body, client_id=CLIENT, qos=1) for _ in range(batch)]
                else:
                    records = next_batch()
                await log.append_batch(records, durable=False)
                count += batch
            await log.flush()
            return count / (time.perf_counter() - start)

    try:
        return trio.run(main)
    finally:
        shutil.rmtree(directory)


def _sync_rate(root: Path, pool: list[bytes], batch: int, writers: int, seconds: float) -> float:
    """Records/s acknowledged as durable with ``writers`` concurrent tasks (group commit)."""
    directory = _fresh(root)
    counts = [0] * writers

    async def main() -> float:
        async with AsyncCommitLog.open(directory, CommitLogConfig(flush="sync")) as log:
            start = time.perf_counter()
            deadline = start + seconds

            async def writer(w: int) -> None:
                next_batch = _batches(pool[w::writers] or pool, batch)
                while time.perf_counter() < deadline:
                    await log.append_batch(next_batch(), durable=True)
                    counts[w] += batch

            async with trio.open_nursery() as nursery:
                for w in range(writers):
                    nursery.start_soon(writer, w)
            return sum(counts) / (time.perf_counter() - start)

    try:
        return trio.run(main)
    finally:
        shutil.rmtree(directory)
