"""The batch and streaming telemetry jobs behind ``lightgate analytics``.

Output tables under ``--out`` (all but the last two partitioned by ``date``):

- ``device_<w>`` per window length ``w`` (``device_1m``, ``device_1h``):
  per device per window count, min, max, mean, stddev, p50, p95 per metric;
- ``topic_<w>`` for the shortest window: messages and rate per topic;
- ``silence_gaps``: gaps between a device's messages longer than the threshold;
- ``quarantine``: rows whose payload did not parse, with the reason and bytes;
- ``device_last_seen``: first/last seen and message count per device;
- ``fleet_metrics.png``: fleet-wide messages, devices and metric means over time (batch).
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from . import aggregate as agg
from .framing import DecodeOptions, scan_range
from .layout import commitlog_dir, list_segments, read_flushed
from .outputs import BatchSummary, fleet_chart, write_table
from .planning import plan_ranges
from .source import FORMAT
from .telemetry import TelemetryMapping
from .times import window_label

__all__ = ["infer_metrics", "read_telemetry", "run_batch", "spark_progress", "start_streams"]

METRIC_SAMPLE = 2_000
"""Payloads inspected to guess the metric fields when none are given: enough to
see every field of a homogeneous fleet, cheap enough to read on the driver."""


METRIC_SHARE = 0.1
"""A field seen in fewer of the sampled payloads is a stray (often a malformed
message), not a fleet metric; rarer metrics can still be named with --metrics."""

TIME_FIELDS = frozenset({"ts", "time", "timestamp", "t", "epoch"})
"""Numeric fields with these names are times, not metrics, when guessing metrics."""


def _payloads(directory: Path, topic_filter: str | None) -> Iterator[bytes]:
    """Every durable payload in offset order (for sampling on the driver)."""
    for ranges in plan_ranges(list_segments(directory), read_flushed(directory)):
        for rng in ranges:
            for frames in scan_range(rng, DecodeOptions(topic_filter=topic_filter)):
                buf = frames.buffer
                for a, b in zip(*(x.tolist() for x in frames.payload_bounds())):
                    yield buf[a:b]


def infer_metrics(data: str | Path, *, exclude: tuple[str, ...] = (), topic_filter: str | None = None) -> tuple[str, ...]:
    """Guess the metric fields: the top-level payload fields holding a number
    (not a bool) in at least :data:`METRIC_SHARE` of the first
    :data:`METRIC_SAMPLE` payloads, in first-seen order; time-like names excluded.

    Raises:
        ValueError: no numeric field was found (name the metrics explicitly).
    """
    directory = commitlog_dir(data)
    seen: dict[str, int] = {}
    sampled = 0
    for payload in itertools.islice(_payloads(directory, topic_filter), METRIC_SAMPLE):
        sampled += 1
        with contextlib.suppress(orjson.JSONDecodeError):
            obj = orjson.loads(payload)
            if isinstance(obj, dict):
                for key, value in obj.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        seen[key] = seen.get(key, 0) + 1
    metrics = tuple(k for k, n in seen.items() if n >= METRIC_SHARE * sampled
                    and k not in exclude and k not in TIME_FIELDS and k.isidentifier())
    if not metrics:
        raise ValueError(f"found no numeric payload field in the first {sampled} records of {directory}; pass --metrics")
    return metrics


def read_telemetry(spark: Any, data: str | Path, mapping: TelemetryMapping, *, stream: bool = False,
                   **options: str) -> DataFrame:
    """The ``commitlog`` source with ``parse=telemetry`` for ``mapping``; ``options``
    are further reader options (topicFilter, fromTime, verifyCrc, ...)."""
    reader = spark.readStream if stream else spark.read
    return reader.format(FORMAT).options(**mapping.to_options(), **options).load(str(data))


@contextlib.contextmanager
def spark_progress(spark: Any, update: Callable[[int, int], None], interval_s: float = 0.25) -> Iterator[None]:
    """Report (completed tasks, total tasks) of the running Spark stages to
    ``update`` from a polling thread while the block runs; our progress
    display replaces Spark's console bar, which the quiet session disables."""
    tracker = spark.sparkContext.statusTracker()
    done = threading.Event()

    def poll() -> None:
        while not done.wait(interval_s):
            stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
            stages = [s for s in stages if s is not None]
            if stages:
                update(sum(s.numCompletedTasks for s in stages), sum(s.numTasks for s in stages))

    thread = threading.Thread(target=poll, name="spark-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run_batch(
    spark: Any,
    *,
    data: str | Path,
    out: Path,
    mapping: TelemetryMapping,
    config: agg.AggregationConfig,
    reader_options: dict[str, str] | None = None,
    fmt: str = "parquet",
    chart: bool = True,
    step: Callable[[str], None] = lambda _label: None,
) -> BatchSummary:
    """Read the CommitLog once (cached), write every output table and the chart.

    ``step`` is told what runs next (for the progress display).
    """
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    df = read_telemetry(spark, data, mapping, **(reader_options or {})).persist()
    summary = BatchSummary()
    try:
        step("reading and parsing the CommitLog")
        counts = df.agg(F.count(F.lit(1)).alias("n"), F.count("error").alias("bad"),
                        F.min("event_ts").alias("lo"), F.max("event_ts").alias("hi")).first()
        summary.records, summary.quarantined = counts["n"], counts["bad"]
        summary.parsed = summary.records - summary.quarantined
        summary.first_ts, summary.last_ts = counts["lo"], counts["hi"]

        tables: dict[str, DataFrame] = {}
        for window_s in sorted(config.windows):
            name = f"device_{window_label(window_s)}"
            step(f"per-device {window_label(window_s)} windows")
            table = agg.device_windows(df, mapping.metrics, window_s, config)
            write_table(table, out / name, fmt=fmt)
            tables[name] = table
        shortest = min(config.windows)
        topic_name = f"topic_{window_label(shortest)}"
        step("per-topic counts and rates")
        write_table(agg.topic_windows(df, shortest, config), out / topic_name, fmt=fmt)
        step("last seen and silence gaps")
        write_table(agg.last_seen(df, config), out / "device_last_seen", fmt=fmt, partition_by=())
        write_table(agg.silence_gaps(df, config), out / "silence_gaps", fmt=fmt)
        step("quarantine")
        write_table(agg.quarantine(df), out / "quarantine", fmt=fmt)
        summary.tables = {name: str(out / name) for name in
                          [*tables, topic_name, "device_last_seen", "silence_gaps", "quarantine"]}

        step("summary")
        reader = spark.read.format(fmt)
        seen = reader.load(str(out / "device_last_seen"))
        summary.devices = seen.count()
        summary.silent_devices = seen.where("silent").count()
        summary.gaps = agg.silence_gaps(df, config).count()
        summary.quarantine_reasons = [
            (r["error"], r["n"]) for r in agg.quarantine(df).groupBy("error")
            .agg(F.count(F.lit(1)).alias("n")).orderBy(F.desc("n")).limit(5).collect()]
        stats = agg.telemetry_rows(df).agg(*[x for m in mapping.metrics for x in (
            F.min(m), F.avg(m), F.max(m))]).first()
        summary.metrics = [(m, stats[3 * i], stats[3 * i + 1], stats[3 * i + 2])
                           for i, m in enumerate(mapping.metrics)]
        topics = (reader.load(str(out / topic_name)).groupBy("topic")
                  .agg(F.sum("count").alias("n")).orderBy(F.desc("n"), "topic").limit(5).collect())
        span = max((summary.last_ts - summary.first_ts).total_seconds(), 1.0) if summary.first_ts else 1.0
        summary.top_topics = [(r["topic"], r["n"], r["n"] / span) for r in topics]
        if chart and summary.parsed:
            step("chart")
            first = f"device_{window_label(shortest)}"
            series = agg.fleet_series(reader.load(str(out / first)), mapping.metrics)
            summary.chart = str(fleet_chart(series, mapping.metrics, out / "fleet_metrics.png"))
    finally:
        df.unpersist()
    return summary


def _last_seen_sink(out: Path, config: agg.AggregationConfig, fmt: str) -> Callable[[DataFrame, int], None]:
    """foreachBatch handler keeping ``device_last_seen`` and appending ``silence_gaps``.

    The last-seen table is small state carried from batch to batch (it records
    the batch id that produced it, so a re-run batch is skipped). It is
    rewritten beside the old one and swapped in, as Spark cannot overwrite a
    path it is reading. Gaps are appended before the swap: at-least-once.
    """
    state = out / "device_last_seen"

    def handle(batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        previous = spark.read.format(fmt).load(str(state)) if state.exists() else None
        if previous is not None and previous.agg(F.max("batch_id")).first()[0] >= batch_id:
            return
        rows = agg.telemetry_rows(batch)
        write_table(agg.silence_gaps(batch, config, previous=previous), out / "silence_gaps", fmt=fmt, mode="append")
        current = rows.groupBy("device").agg(F.min("event_ts").alias("first_seen"),
                                             F.max("event_ts").alias("last_seen"),
                                             F.count(F.lit(1)).alias("messages"))
        if previous is not None:
            current = (current.unionByName(previous.select("device", "first_seen", "last_seen", "messages"))
                       .groupBy("device").agg(F.min("first_seen").alias("first_seen"),
                                              F.max("last_seen").alias("last_seen"),
                                              F.sum("messages").alias("messages")))
        fresh = state.with_name(f"{state.name}.{uuid.uuid4().hex}")
        write_table(current.withColumn("batch_id", F.lit(batch_id)), fresh, fmt=fmt, partition_by=())
        old = state.with_name(f"{state.name}.old")
        if state.exists():
            state.rename(old)
        fresh.rename(state)
        shutil.rmtree(old, ignore_errors=True)

    return handle


def start_streams(
    spark: Any,
    *,
    data: str | Path,
    out: Path,
    checkpoint: Path,
    mapping: TelemetryMapping,
    config: agg.AggregationConfig,
    trigger: dict[str, Any],
    reader_options: dict[str, str] | None = None,
    fmt: str = "parquet",
) -> list[Any]:
    """Start one streaming query per output (each with its own checkpoint
    directory under ``checkpoint``); windowed outputs are appended when the
    event-time watermark closes them. Returns the started queries."""
    df = read_telemetry(spark, data, mapping, stream=True, **(reader_options or {}))
    shortest = min(config.windows)
    appends: dict[str, DataFrame] = {
        f"device_{window_label(w)}": agg.device_windows(df, mapping.metrics, w, config, streaming=True)
        for w in sorted(config.windows)
    }
    appends[f"topic_{window_label(shortest)}"] = agg.topic_windows(df, shortest, config, streaming=True)
    appends["quarantine"] = agg.quarantine(df)
    queries = []
    for name, frame in appends.items():
        writer = (frame.writeStream.queryName(name).format(fmt).outputMode("append").partitionBy("date")
                  .option("path", str(out / name)).option("checkpointLocation", str(checkpoint / name))
                  .trigger(**trigger))
        queries.append(writer.start())
    queries.append(df.writeStream.queryName("device_last_seen").foreachBatch(_last_seen_sink(out, config, fmt))
                   .option("checkpointLocation", str(checkpoint / "device_last_seen")).trigger(**trigger).start())
    return queries
