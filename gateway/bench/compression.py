"""``lightgate bench compression``: batch records with and without zstd bodies (``commitlog.batch_compression``): bytes on disk and CPU.

For each payload kind (``telemetry``: simulator JSON, a device id, a sequence number, a timestamp and readings of
the simulator's metrics, about ``--sizes`` bytes each; ``random``: random bytes of exactly that size), each size,
each batch size and each compression (``off``, ``zstd``), a fresh store in this process takes ``--messages``
messages of one topic from 100 devices, appended ``--batch`` at a time as batch records (``append(batch=True)``),
awaited in turn until indexed; then it is closed and opened again and every message is pulled back from disk (the
records kept in memory would spare the reads their decoding). One ``BENCH`` line per run says: log bytes per
message (the CommitLog's bytes: what compression changes; the index is the same either way), the share of batch
records stored compressed, CPU per 1,000 messages to append (encode, write, index) and to pull them back (read,
inflate, decode), and the codec alone: ``new_batch`` and ``decode_record`` per 1,000 messages, without the store.
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import trio

from gateway.bench.common import emit
from gateway.bench.telemetry import METRICS, RandomWalk
from store.api import NewMessage, PullRequest
from store.local import LocalStore
from store.log.commitlog import BATCH_COMPRESSIONS, CommitLogConfig
from store.log.record import FLAG_ZSTD, decode_record, new_batch, now_ms
from store.node import open_store

KINDS = ("telemetry", "random")
TOPIC = "fleet/ingest"
CLIENT = "svc-ingest"
DEVICES = 100
"""Devices whose readings share the topic: the ids, keys and values repeat across a batch as they do in a fleet's."""

PULL = 2000
"""Messages a pull asks for: the whole log is read back in a few dozen calls."""

SEED = 30
"""The payloads are the same in every run (and for both compressions): a byte count is then a fact, not a sample."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--results", type=Path, default=None,
                        help="where the per-run lines are appended (default: the checkout's bench/results)")
    parser.add_argument("--messages", type=int, default=32768, help="messages per run")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024], help="payload bytes (about, for JSON)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 256], help="messages per batch record")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One ``BENCH`` line per run (emitted here); returns the summary: per kind, size and batch, zstd against off."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="lightgate-bench-compression-", dir=args.dir) as tmp:
        for kind, size in itertools.product(args.kinds, args.sizes):
            payloads = make_payloads(kind, size, args.messages)  # the same for every batch size and compression
            mean = round(sum(map(len, payloads)) / len(payloads), 1)
            for batch, compression in itertools.product(args.batches, BATCH_COMPRESSIONS):
                data = Path(tmp) / f"{kind}-{size}-{batch}-{compression}"
                row = trio.run(_run, data, payloads, batch, compression)
                rows.append(emit("compression", row | {"kind": kind, "payload": size, "batch": batch,
                                                       "compression": compression, "mean_payload_bytes": mean},
                                 args.results)["result"])
    return {"summary": _summary(rows)}


def make_payloads(kind: str, size: int, count: int) -> list[bytes]:
    """``count`` payloads of ``kind``, each of about ``size`` bytes (JSON: one reading at least, then more while
    they fit; random bytes are exactly ``size``)."""
    rng = random.Random(SEED)
    if kind == "random":
        return [rng.randbytes(size) for _ in range(count)]
    walks = [RandomWalk(list(METRICS.values())) for _ in range(DEVICES)]
    start = 1_767_225_600_000
    payloads = []
    for i in range(count):
        device, seq = i % DEVICES, i // DEVICES
        doc: dict[str, Any] = {"device": f"dev-{device:03d}", "seq": seq, "ts": start + i * 10}
        readings = walks[device].step(rng)
        for name, value in readings.items():  # a reading at a time while it fits, one at least
            if len(doc) > 3 and len(orjson.dumps({**doc, name: value})) > size:
                break
            doc[name] = value
        else:  # every metric fits: earlier samples follow, as a device that reports in bursts sends them
            samples: list[dict[str, Any]] = []
            doc["samples"] = samples
            while len(orjson.dumps(doc)) < size - 100:
                samples.append({"ts": start + i * 10 - 1000 * (len(samples) + 1), **walks[device].step(rng)})
        payloads.append(orjson.dumps(doc))
    return payloads


async def _run(data: Path, payloads: list[bytes], batch: int, compression: str) -> dict[str, Any]:
    messages = [NewMessage(TOPIC, p, client_id=CLIENT, qos=1) for p in payloads]
    runs = [messages[i:i + batch] for i in range(0, len(messages), batch)]
    config = CommitLogConfig(batch_compression=compression)
    async with open_store(data, config) as node:
        local = LocalStore(node, "bench-compression")
        try:
            cpu = time.process_time()
            for run in runs:
                await local.append(run, batch=True)
            while (await local.statistics()).dispatch_lag:
                await trio.lowlevel.checkpoint()
            append_s = time.process_time() - cpu
            log_bytes = (await local.statistics()).written_offset
        finally:
            local.close()
    async with open_store(data, config) as node:  # the records kept in memory are gone: pulls read the disk
        local = LocalStore(node, "bench-compression")
        try:
            cpu = time.process_time()
            read = 0
            while read < len(messages):
                [result] = await local.pull([PullRequest(TOPIC, read, PULL, 64 << 20)])
                read += len(result.messages)
            read_s = time.process_time() - cpu
        finally:
            local.close()
    encode_s, decode_s, compressed = _codec(runs, compression == "zstd")
    per_1000 = 1e6 / len(messages)  # seconds -> ms per 1,000 messages
    return {
        "messages": len(messages), "log_bytes_per_message": round(log_bytes / len(messages), 1),
        "compressed_share": round(compressed / len(runs), 3),
        "append_cpu_ms_per_1000": round(append_s * per_1000, 2), "read_cpu_ms_per_1000": round(read_s * per_1000, 2),
        "cpu_ms_per_1000": round((append_s + read_s) * per_1000, 2),
        "codec_encode_ms_per_1000": round(encode_s * per_1000, 3),
        "codec_decode_ms_per_1000": round(decode_s * per_1000, 3),
    }


def _codec(runs: list[list[NewMessage]], compress: bool) -> tuple[float, float, int]:
    """CPU seconds of ``new_batch`` and of ``decode_record`` over every run, and how many came out compressed."""
    store_ms = now_ms()
    cpu = time.process_time()
    records = [new_batch(TOPIC, run, store_ms, compress=compress)[0] for run in runs]
    encode_s = time.process_time() - cpu
    cpu = time.process_time()
    for raw in records:
        decode_record(raw, 0, 0)
    decode_s = time.process_time() - cpu
    return encode_s, decode_s, sum(1 for raw in records if raw[12] & FLAG_ZSTD)


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind, size and batch: zstd's log bytes as a share of off's, and the CPU it adds per 1,000 messages."""
    summary = []
    for key, group in itertools.groupby(rows, lambda r: (r["kind"], r["payload"], r["batch"])):
        by = {r["compression"]: r for r in group}
        off, zstd = by.get("off"), by.get("zstd")
        if off and zstd:
            summary.append({
                "kind": key[0], "payload": key[1], "batch": key[2],
                "log_bytes_per_message": [off["log_bytes_per_message"], zstd["log_bytes_per_message"]],
                "bytes_ratio": round(zstd["log_bytes_per_message"] / off["log_bytes_per_message"], 3),
                "cpu_ms_per_1000": [off["cpu_ms_per_1000"], zstd["cpu_ms_per_1000"]],
                "codec_ms_per_1000": [round(r["codec_encode_ms_per_1000"] + r["codec_decode_ms_per_1000"], 3)
                                      for r in (off, zstd)]})
    return summary
