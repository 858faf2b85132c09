"""Shared helpers of the spark_analytics tests: CommitLogs written with the real
CommitLog and generated telemetry. The ``spark`` fixture (one SparkSession per
test run) is tests/spark_analytics/conftest.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow.dataset as ds

from gateway.bench.analytics import store_node as bench_store_node
from spark_analytics import cli
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import encode_record
from store.tier import TierConfig, TierConverter

T0_MS = 1_699_999_980_000
"""2023-11-14T22:13:00Z, a whole minute: generated times line up with windows."""

SEGMENT_BYTES = 64 * 1024
"""Small segments, so a few thousand records span many of them."""


@dataclass(frozen=True)
class Msg:
    """One generated message: what a pure-Python reference needs to know."""

    topic: str
    payload: bytes
    store_ms: int
    client_id: str = ""
    qos: int = 0
    retain: bool = False
    properties: bytes = b""


def encode(msg: Msg) -> bytes:
    return encode_record(msg.topic, msg.payload, client_id=msg.client_id, qos=msg.qos, retain=msg.retain,
                         properties=msg.properties, born_ms=max(0, msg.store_ms - 3), store_ms=msg.store_ms)


def write_log(data: Path, msgs: Iterable[Msg], *, segment_bytes: int = SEGMENT_BYTES, batch: int = 500) -> list[int]:
    """Append ``msgs`` to the CommitLog under ``data/commitlog`` (created or
    continued), flush and close it. Returns the offsets of the appended records."""
    offsets: list[int] = []
    config = CommitLogConfig(segment_bytes=segment_bytes, max_record_bytes=min(segment_bytes, 1 << 20), flush="async")
    log = CommitLog.open(data / "commitlog", config)
    try:
        chunk: list[bytes] = []
        for msg in msgs:
            chunk.append(encode(msg))
            if len(chunk) == batch:
                offsets += log.append_batch(chunk)
                chunk = []
        if chunk:
            offsets += log.append_batch(chunk)
        log.flush()
    finally:
        log.close()
    return offsets


def telemetry(n: int, *, devices: int = 7, start_ms: int = T0_MS, step_ms: int = 1_000, seed: int = 7,
              bad_every: int = 0) -> list[Msg]:
    """``n`` telemetry messages on ``fleet/<device>/telemetry`` with temp/hum
    payloads and store times ``step_ms`` apart; every ``bad_every``-th payload
    is malformed in one of several ways (for the quarantine)."""
    rnd = random.Random(seed)
    bad = [b"{not json", b"[1, 2, 3]", b'{"temp": "warm", "hum": 1}', b'{"other": 1}', b""]
    out = []
    for i in range(n):
        device = f"dev{i % devices}"
        if bad_every and i % bad_every == bad_every - 1:
            payload = bad[(i // bad_every) % len(bad)]
        else:
            body: dict[str, Any] = {"temp": round(rnd.uniform(-20, 40), 3), "hum": rnd.randint(0, 100)}
            if i % 11 == 5:
                del body["hum"]  # partial metrics are still telemetry
            payload = json.dumps(body).encode()
        out.append(Msg(f"fleet/{device}/telemetry", payload, start_ms + i * step_ms, client_id=device, qos=i % 3))
    return out


def scan_all(data: Path) -> list[tuple[int, str, bytes]]:
    """(offset, topic, payload) of every record, by the CommitLog itself."""
    out = []
    with CommitLog.open(data / "commitlog", CommitLogConfig(segment_bytes=SEGMENT_BYTES,
                                                            max_record_bytes=SEGMENT_BYTES)) as log:
        offset = log.min_offset
        while offset < log.written_offset:
            scanned = log.scan(offset)
            out += [(r.offset, r.topic, r.payload) for r in scanned.records]
            offset = scanned.next_offset
    return out


def tier_then_expire(data: Path, convert: int, keep_local: int) -> None:
    """Convert the oldest ``convert`` segments the tier does not have, then let retention delete the tiered
    segments but the newest ``keep_local`` of them."""
    config = CommitLogConfig(segment_bytes=SEGMENT_BYTES, max_record_bytes=SEGMENT_BYTES, retention_max_bytes=1)
    with CommitLog.open(data / "commitlog", config) as log:
        converter = TierConverter(log, TierConfig(uri=str(data / "tier"), cpu_share=1.0, row_group_rows=200))
        converter.open()
        pending = converter.pending()
        assert len(pending) >= convert
        for base in pending[:convert]:
            assert converter.convert(base)
        tiered = [s.base for s in log.segments() if converter.may_delete(s.base)]
        keep_from = tiered[-keep_local] if keep_local else pending[convert] if len(pending) > convert \
            else log.segments()[-1].base
        log.set_retention_guard(lambda base: converter.may_delete(base) and base < keep_from)
        log.delete_expired()
        assert log.segments()[0].base == keep_from


@contextlib.contextmanager
def store_node(data: Path) -> Iterator[str]:
    """A store node on ``data``'s CommitLog, serving its RPC on a free port from a thread; yields HOST:PORT."""
    with bench_store_node(data, CommitLogConfig(segment_bytes=SEGMENT_BYTES, max_record_bytes=SEGMENT_BYTES)) as at:
        yield at


TABLES = ("device_1m", "device_1h", "topic_1m", "device_day", "device_last_seen", "silence_gaps", "quarantine")
"""The tables a batch or stream run writes with the default windows (spark_analytics.jobs)."""


def analytics_args(*argv: str) -> argparse.Namespace:
    """``lightgate analytics <argv>`` parsed as the CLI parses it (for ``spark_analytics.cli.run``)."""
    parser = argparse.ArgumentParser(prog="lightgate analytics")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def available_now_progress(frame: Any, out: Path, checkpoint: Path) -> list[dict[str, Any]]:
    """Run the streaming ``frame`` to a Parquet sink with trigger(availableNow); return the query's progress."""
    query = (frame.writeStream.format("parquet").outputMode("append").option("path", str(out))
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination(120)
    assert not query.isActive and query.exception() is None, query.exception()
    return query.recentProgress


def table_rows(path: Path) -> list[tuple]:
    """Every row of a (date-partitioned) Parquet table read with pyarrow, as sorted tuples; floats to 12
    digits (a mean or a standard deviation summed in another order differs in the last bits)."""
    data = ds.dataset(path, format="parquet", partitioning="hive").to_table()
    columns = sorted(c for c in data.column_names if c != "payload")
    return sorted(tuple(f"{v:.12g}" if isinstance(v, float) else str(v) for v in (row[c] for c in columns))
                  for row in data.select(columns).to_pylist())
