"""Streaming reads of the CommitLog: offsets, availableNow, processing-time
triggers, torn tails and retention (spark_analytics.source)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from tests.helpers.spark_fixtures import (
    T0_MS,
    Msg,
    available_now_progress,
    encode,
    telemetry,
    write_log,
)

from spark_analytics.aggregate import AggregationConfig, device_windows
from spark_analytics.jobs import read_telemetry
from spark_analytics.layout import FLUSHED_FILE, list_segments
from spark_analytics.telemetry import TelemetryMapping
from store.log.commitlog import CommitLog, CommitLogConfig

pytestmark = pytest.mark.spark

MAPPING = TelemetryMapping(("temp", "hum"))


def run_available_now(frame: Any, out: Path, checkpoint: Path) -> int:
    """Run ``frame`` as :func:`available_now_progress`; return the input rows it read."""
    return sum(p["numInputRows"] for p in available_now_progress(frame, out, checkpoint))


def global_offset(offset: str | dict[str, int]) -> int:
    """A stream offset of the progress (JSON text or a dict) as a global log offset."""
    value = json.loads(offset) if isinstance(offset, str) else offset
    return value["segment"] + value["position"]


def raw_stream(spark: Any, data: Path, **options: str) -> Any:
    return spark.readStream.format("commitlog").options(**options).load(str(data)).select("offset", "topic")


def test_available_now_emits_closed_windows_and_reads_only_new_records(spark: Any, tmp_path: Path) -> None:
    config = AggregationConfig(windows=(60,), watermark_s=60)
    first = telemetry(600, devices=3)  # ten minutes, one record a second
    write_log(tmp_path, first)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    windows = lambda: device_windows(  # noqa: E731
        read_telemetry(spark, tmp_path, MAPPING, stream=True).withWatermark("event_ts", "60 seconds"),
        MAPPING.metrics, 60, config)
    assert run_available_now(windows(), out, checkpoint) == 600
    # the final watermark (last event - 60 s) closes the windows ending by then, in this run
    rows = spark.read.parquet(str(out)).collect()
    assert sorted({round(r.window_start.timestamp()) - T0_MS // 1000 for r in rows}) == list(range(0, 480, 60))
    assert all(r["count"] == 20 for r in rows) and len(rows) == 8 * 3

    write_log(tmp_path, telemetry(300, devices=3, start_ms=T0_MS + 600_000))
    assert run_available_now(windows(), out, checkpoint) == 300  # only the new records
    rows = spark.read.parquet(str(out)).collect()
    starts = [round(r.window_start.timestamp()) - T0_MS // 1000 for r in rows]
    assert sorted(set(starts)) == list(range(0, 780, 60)) and len(rows) == len(set(zip(starts, [r.device for r in rows])))
    assert all(r["count"] == 20 for r in rows)


def test_a_half_written_record_is_read_once_complete(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(50)
    offsets = write_log(tmp_path, msgs)
    (tmp_path / "commitlog" / FLUSHED_FILE).unlink()  # no hint: the reader must find the end by CRC
    seg = list_segments(tmp_path / "commitlog")[-1]
    end = offsets[-1] + len(encode(msgs[-1]))
    tail = encode(Msg("fleet/late/telemetry", b'{"temp": 1}', T0_MS + 99_000))
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with open(seg.path, "r+b") as fh:
        os.pwrite(fh.fileno(), tail[:30], end - seg.base)
        assert run_available_now(raw_stream(spark, tmp_path), out, checkpoint) == 50
        os.pwrite(fh.fileno(), tail[30:], end - seg.base + 30)
    assert run_available_now(raw_stream(spark, tmp_path), out, checkpoint) == 1
    got = sorted(r.offset for r in spark.read.parquet(str(out)).collect())
    assert got == [*offsets, end]


def test_segments_deleted_behind_the_stream(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(1500))
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    assert run_available_now(raw_stream(spark, tmp_path), out, checkpoint) == 1500
    later = write_log(tmp_path, telemetry(3000, start_ms=T0_MS + 10**7))
    config = CommitLogConfig(segment_bytes=64 * 1024, max_record_bytes=64 * 1024, retention_max_bytes=100_000)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        assert log.delete_expired()
        oldest = log.min_offset
    assert later[0] < oldest  # records the stream never read are gone

    query = (raw_stream(spark, tmp_path).writeStream.format("parquet").option("path", str(out))
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="deleted by retention before this stream read them"):
        query.awaitTermination(120)

    read = run_available_now(raw_stream(spark, tmp_path, failOnDataLoss="false"), out, checkpoint)
    assert read == sum(1 for o in later if o >= oldest)


def test_processing_time_trigger_picks_up_appends(spark: Any, tmp_path: Path) -> None:
    first = write_log(tmp_path, telemetry(200))
    query = (raw_stream(spark, tmp_path).writeStream.format("memory").queryName("commitlog_tail")
             .trigger(processingTime="500 milliseconds").start())
    try:
        query.processAllAvailable()
        assert spark.table("commitlog_tail").count() == 200
        second = write_log(tmp_path, telemetry(300, start_ms=T0_MS + 10**6))
        query.processAllAvailable()
        got = sorted(r.offset for r in spark.table("commitlog_tail").collect())
        assert got == first + second
    finally:
        query.stop()


def test_max_bytes_per_trigger_takes_a_backlog_in_steps_of_about_that_many_bytes(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(600)
    offsets = write_log(tmp_path, msgs)
    record = max(len(encode(m)) for m in msgs)
    end = offsets[-1] + len(encode(msgs[-1]))
    progress = available_now_progress(raw_stream(spark, tmp_path, maxBytesPerTrigger="16384"), tmp_path / "out",
                                      tmp_path / "checkpoint")
    batches = [p for p in progress if p["numInputRows"]]
    assert sum(p["numInputRows"] for p in batches) == 600
    ends = [global_offset(p["sources"][0]["endOffset"]) for p in batches]
    spans = [b - a for a, b in zip([offsets[0], *ends], ends)]
    assert ends[-1] == end and max(spans) < 16384 + record  # whole records, about 16 KiB a micro-batch
    assert len(batches) >= (end - offsets[0]) // (16384 + record) >= 3


def test_past_admit_until_no_micro_batch_admits_a_record(spark: Any, tmp_path: Path) -> None:
    """What ``lightgate analytics stream --timeout`` relies on to stop between micro-batches; the next run
    goes on from where the stream stopped."""
    write_log(tmp_path, telemetry(300))
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    stopped = raw_stream(spark, tmp_path, maxRecordsPerTrigger="100", admitUntil="2000-01-01T00:00:00Z")
    assert run_available_now(stopped, out, checkpoint) == 0
    assert run_available_now(raw_stream(spark, tmp_path, maxRecordsPerTrigger="100"), out, checkpoint) == 300
