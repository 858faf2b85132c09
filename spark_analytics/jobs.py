"""The batch and streaming telemetry jobs behind ``lightgate analytics``.

Output tables under ``--out`` (all but the last two partitioned by ``date``):

- ``device_<w>`` per window length ``w`` (``device_1m``, ``device_1h``):
  per device per window count, min, max, mean, stddev, p50, p95 per metric;
- ``topic_<w>`` for the shortest window: messages and rate per topic;
- ``silence_gaps``: gaps between a device's messages longer than the threshold;
- ``quarantine``: rows whose payload did not parse, with the reason and bytes;
- ``device_day``: first/last seen and message count per device per day;
- ``device_last_seen``: first/last seen, message count and silence at the end per device;
- ``fleet_metrics.png``: fleet-wide messages, devices and metric means over time (batch).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

import pyarrow as pa

from . import aggregate as agg
from .framing import RAW_SCHEMA
from .microbatch import REPEAT, MicroBatchSink, output_tables
from .options import ReaderOptions
from .outputs import BatchSummary, fleet_chart, write_table
from .source import FORMAT, plan_read, read_partition
from .telemetry import TelemetryMapping
from .times import window_label

__all__ = ["NoTelemetry", "check_metrics", "check_rerun_range", "infer_metrics", "read_telemetry", "run_batch",
           "spark_progress", "start_stream"]

METRIC_SAMPLE = 2_000
"""Payloads inspected to guess the metric fields when none are given: enough to
see every field of a homogeneous fleet, cheap enough to read on the driver."""


METRIC_SHARE = 0.1
"""A field seen in fewer of the sampled payloads is a stray (often a malformed
message), not a fleet metric; rarer metrics can still be named with --metrics."""

NOT_METRICS = frozenset({"ts", "time", "timestamp", "t", "epoch", "seq", "sequence", "seqno", "id", "msg_id",
                         "message_id", "counter"})
"""Numeric fields with these names are times, sequence numbers or ids, not metrics, when guessing metrics
(``seq`` and ``sent_ns`` are what ``lightgate simulate`` adds to every payload)."""

NOT_METRIC_SUFFIXES = ("_ts", "_ns", "_us", "_ms", "_at", "_time", "_id", "_seq")
"""Field names ending so are times or ids too (``sent_ns``, ``created_at``, ``device_id``)."""


class NoTelemetry(ValueError):
    """The records to aggregate are not there: nothing matches, or nothing parses (a clear CLI error)."""


def _payloads(spark_options: dict[str, str]) -> Iterator[bytes]:
    """Durable payloads in offset order, read on the driver the way the source reads them (local segments,
    tier, store RPC), for sampling."""
    opts = ReaderOptions.parse(spark_options)
    only_payload = pa.schema([RAW_SCHEMA.field("payload")])
    for ranges in plan_read(opts):
        for batch in read_partition(ranges, opts, only_payload):
            yield from batch.column(0).to_pylist()


def _sample(spark_options: dict[str, str]) -> tuple[int, dict[str, int]]:
    """How many payloads were sampled, and in how many each top-level field held a number (not a bool)."""
    seen: dict[str, int] = {}
    sampled = 0
    for payload in itertools.islice(_payloads(spark_options), METRIC_SAMPLE):
        sampled += 1
        with contextlib.suppress(orjson.JSONDecodeError):
            obj = orjson.loads(payload[3:] if payload[:3] == b"\xef\xbb\xbf" else payload)
            if isinstance(obj, dict):
                for key, value in obj.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        seen[key] = seen.get(key, 0) + 1
    return sampled, seen


def _where(spark_options: dict[str, str]) -> str:
    place = spark_options.get("path") or f"the store at {spark_options.get('store')}"
    return place + _matching(spark_options)


def _matching(spark_options: dict[str, str]) -> str:
    """`` matching a/+, b/#`` for the topic filter options, or nothing."""
    topics = ([spark_options["topicFilter"]] if spark_options.get("topicFilter") else []) + (
        json.loads(spark_options["topicFilters"]) if spark_options.get("topicFilters") else [])
    return f" matching {', '.join(topics)}" if topics else ""


def infer_metrics(spark_options: dict[str, str], *, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Guess the metric fields: the top-level payload fields holding a number
    (not a bool) in at least :data:`METRIC_SHARE` of the first
    :data:`METRIC_SAMPLE` payloads, in first-seen order; times, sequence numbers
    and ids excluded (:data:`NOT_METRICS`, :data:`NOT_METRIC_SUFFIXES`).

    ``spark_options`` are the source's reader options (path, tier, store, topicFilter).

    Raises:
        NoTelemetry: no record matches, or no numeric field was found (name the metrics explicitly).
    """
    sampled, seen = _sample(spark_options)
    if not sampled:
        raise NoTelemetry(f"no records in {_where(spark_options)}")
    metrics = tuple(k for k, n in seen.items() if n >= METRIC_SHARE * sampled and k not in exclude
                    and k not in NOT_METRICS and not k.endswith(NOT_METRIC_SUFFIXES) and k.isidentifier())
    if not metrics:
        raise NoTelemetry(f"found no numeric payload field in the first {sampled} records of "
                          f"{_where(spark_options)}; pass --metrics")
    return metrics


def check_metrics(spark_options: dict[str, str], metrics: tuple[str, ...]) -> None:
    """Refuse named metrics that none of the first payloads has as a number (a misspelled name would
    quarantine every row).

    Raises:
        NoTelemetry: no record matches, or a metric is in none of the sampled payloads.
    """
    sampled, seen = _sample(spark_options)
    if not sampled:
        raise NoTelemetry(f"no records in {_where(spark_options)}")
    missing = [m for m in metrics if m not in seen]
    if missing:
        fields = ", ".join(sorted(seen)) or "none"
        raise NoTelemetry(f"metric(s) {', '.join(missing)} are in none of the first {sampled} payloads of "
                          f"{_where(spark_options)} (numeric fields there: {fields})")


def read_telemetry(spark: Any, data: str | Path | None, mapping: TelemetryMapping, *, stream: bool = False,
                   **options: str) -> DataFrame:
    """The ``commitlog`` source with ``parse=telemetry`` for ``mapping``; ``options``
    are further reader options (topicFilter, fromTime, verifyCrc, tier, store, ...);
    ``data`` may be None with the ``store`` option."""
    reader = (spark.readStream if stream else spark.read).format(FORMAT).options(**mapping.to_options(), **options)
    return reader.load(str(data)) if data is not None else reader.load()


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


DAY_MS = 86_400_000


def check_rerun_range(from_ms: int | None, to_ms: int | None, windows: tuple[int, ...]) -> None:
    """A batch run over part of the log replaces whole ``date`` partitions, so its range must be whole UTC
    days and its windows must not cross midnight.

    Raises:
        ValueError: a bound that is not a UTC midnight, or a window that does not divide a day.
    """
    for name, bound in (("--from", from_ms), ("--to", to_ms)):
        if bound is not None and bound % DAY_MS:
            raise ValueError(f"{name} must be a UTC midnight (e.g. 2026-05-01): a run over part of the log "
                             "replaces whole days of the date-partitioned tables")
    if from_ms is not None or to_ms is not None:
        bad = [w for w in windows if DAY_MS // 1000 % w]
        if bad:
            raise ValueError(f"with --from/--to every window must divide a day (1m, 5m, 1h, 1d ...), not "
                             f"{', '.join(f'{w}s' for w in bad)}: a window across midnight spans two partitions")


def _in_range(column: str, from_ms: int | None, to_ms: int | None) -> Any:
    cond = F.lit(True)
    if from_ms is not None:
        cond = cond & (F.col(column) >= F.lit(from_ms / 1000).cast("timestamp"))
    if to_ms is not None:
        cond = cond & (F.col(column) < F.lit(to_ms / 1000).cast("timestamp"))
    return cond


def run_batch(
    spark: Any,
    *,
    data: str | Path | None,
    out: Path,
    mapping: TelemetryMapping,
    config: agg.AggregationConfig,
    reader_options: dict[str, str] | None = None,
    fmt: str = "parquet",
    chart: bool = True,
    from_ms: int | None = None,
    to_ms: int | None = None,
    dedup: bool = False,
    step: Callable[[str], None] = lambda _label: None,
) -> BatchSummary:
    """Read the CommitLog once (cached), write every output table and the chart.

    A run over ``[from_ms, to_ms)`` (whole UTC days, :func:`check_rerun_range`)
    replaces exactly those days of the date-partitioned tables with what a run
    over the whole log writes there: the device tables, ``device_day`` and the
    gaps take the records whose *event* date is in the range (with a payload
    time the whole log is read to find them), the topic and quarantine tables
    those whose *store* date is; a gap from a day of the range to the next
    event after it is found from ``device_day`` of the later days; and
    ``device_last_seen`` is rebuilt from every day of ``device_day``. Days
    outside the range are not touched. ``dedup`` drops repeated
    ``(device, key)`` rows first (``mapping.key``).

    ``step`` is told what runs next (for the progress display).

    Raises:
        NoTelemetry: no record in the range, or every record was quarantined.
    """
    check_rerun_range(from_ms, to_ms, config.windows)
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    options = dict(reader_options or {})
    payload_time = mapping.time_field is not None
    if not payload_time:  # event time is store time: the range is pushed into the reader
        options.update({k: str(v) for k, v in (("fromTime", from_ms), ("toTime", to_ms)) if v is not None})
    read = read_telemetry(spark, data, mapping, **options)
    read = agg.mark_repeats(read, REPEAT) if dedup else read.withColumn(REPEAT, F.lit(False))
    read = read.persist()  # the one read of the CommitLog: the counts below and every table come from it
    df = read.where(~F.col(REPEAT)).drop(REPEAT)
    summary = BatchSummary()
    try:
        step("reading and parsing the CommitLog")
        in_range = _in_range("event_ts", from_ms, to_ms) | (F.col("error").isNotNull()
                                                             & _in_range("store_ts", from_ms, to_ms))
        events = df.where(in_range) if payload_time else df
        stored = df.where(_in_range("store_ts", from_ms, to_ms)) if payload_time else df
        kept = ~F.col(REPEAT)
        counts = (read.where(in_range) if payload_time else read).agg(
            F.count(F.lit(1)).alias("n"), F.count(F.when(F.col(REPEAT), 1)).alias("repeats"),
            F.count(F.when(kept, F.col("error"))).alias("bad"), F.min(F.when(kept, F.col("event_ts"))).alias("lo"),
            F.max(F.when(kept, F.col("event_ts"))).alias("hi")).first()
        summary.records, summary.repeats, summary.quarantined = counts["n"], counts["repeats"], counts["bad"]
        summary.parsed = summary.records - summary.repeats - summary.quarantined
        summary.first_ts, summary.last_ts = counts["lo"], counts["hi"]
        if not summary.records:
            raise NoTelemetry(f"no records in {data if data is not None else options.get('store')}"
                              f"{_matching(options)}"
                              f"{' in the given time range' if from_ms is not None or to_ms is not None else ''}")
        if not summary.parsed:
            top = agg.quarantine(df).groupBy("error").count().orderBy(F.desc("count")).first()
            raise NoTelemetry(f"all {summary.records:,} records were quarantined (first reason: {top['error']}); "
                              "check --metrics, --device and --time")

        tables: dict[str, DataFrame] = {}
        for window_s in sorted(config.windows):
            name = f"device_{window_label(window_s)}"
            step(f"per-device {window_label(window_s)} windows")
            table = agg.device_windows(events, mapping.metrics, window_s, config)
            write_table(table, out / name, fmt=fmt)
            tables[name] = table
        shortest = min(config.windows)
        topic_name = f"topic_{window_label(shortest)}"
        step("per-topic counts and rates")
        write_table(agg.topic_windows(stored, shortest, config), out / topic_name, fmt=fmt)
        step("last seen and silence gaps")
        write_table(agg.device_days(events), out / "device_day", fmt=fmt)
        reader = spark.read.format(fmt)
        days = reader.load(str(out / "device_day"))
        write_table(agg.last_seen_from_days(days, config), out / "device_last_seen", fmt=fmt, partition_by=())
        following = None
        if to_ms is not None:
            after = days.where(F.col("date") >= F.lit(to_ms / 1000).cast("timestamp").cast("date"))
            following = after.groupBy("device").agg(F.min("first_seen").alias("first_seen"))
        gaps = agg.silence_gaps(events, config, following=following)
        if to_ms is not None:
            gaps = gaps.where(_in_range("gap_start", None, to_ms))
        write_table(gaps, out / "silence_gaps", fmt=fmt)
        step("quarantine")
        write_table(agg.quarantine(stored), out / "quarantine", fmt=fmt)
        summary.tables = {name: str(out / name) for name in
                          [*tables, topic_name, "device_day", "device_last_seen", "silence_gaps", "quarantine"]}

        step("summary")
        seen = reader.load(str(out / "device_last_seen"))
        summary.devices = seen.count()
        summary.silent_devices = seen.where("silent").count()
        summary.gaps = gaps.count()
        summary.quarantine_reasons = [
            (r["error"], r["n"]) for r in agg.quarantine(events).groupBy("error")
            .agg(F.count(F.lit(1)).alias("n")).orderBy(F.desc("n")).limit(5).collect()]
        stats = agg.telemetry_rows(events).agg(*[x for m in mapping.metrics for x in (
            F.min(m), F.avg(m), F.max(m))]).first()
        summary.metrics = [(m, stats[3 * i], stats[3 * i + 1], stats[3 * i + 2])
                           for i, m in enumerate(mapping.metrics)]
        topics = (agg.topic_windows(stored, shortest, config).groupBy("topic")
                  .agg(F.sum("count").alias("n")).orderBy(F.desc("n"), "topic").limit(5).collect())
        span = max((summary.last_ts - summary.first_ts).total_seconds(), 1.0) if summary.first_ts else 1.0
        summary.top_topics = [(r["topic"], r["n"], r["n"] / span) for r in topics]
        if chart and summary.parsed:
            step("chart")
            first = f"device_{window_label(shortest)}"
            series = agg.fleet_series(reader.load(str(out / first)), mapping.metrics)
            summary.chart = str(fleet_chart(series, mapping.metrics, out / "fleet_metrics.png"))
    finally:
        read.unpersist()
    return summary


FORMER_LAYOUT = "_spark_metadata"
"""What the former stream (one query per output, Spark's file sink) left in each table; its tables and
checkpoints do not mix with the one-query stream's."""


def start_stream(
    spark: Any,
    *,
    data: str | Path | None,
    out: Path,
    checkpoint: Path,
    mapping: TelemetryMapping,
    config: agg.AggregationConfig,
    trigger: dict[str, Any],
    reader_options: dict[str, str] | None = None,
    dedup: bool = False,
) -> Any:
    """Start the one streaming query that reads the CommitLog once per micro-batch and keeps every output
    table (those of :func:`run_batch` but the chart) as the batch job writes it over the records read so far
    (microbatch.py). Spark's checkpoint is ``checkpoint/query``; the staged rows and the state are beside it.
    Returns the started query.

    Raises:
        ValueError: ``out`` or ``checkpoint`` hold the former stream's tables or checkpoints.
    """
    tables = output_tables(config)
    former = [str(p) for p in (*(out / t / FORMER_LAYOUT for t in tables), *(checkpoint / t for t in tables))
              if p.exists()]
    if former:
        raise ValueError(f"{former[0]} was written by the former stream (one query per output); give the stream "
                         "a new --out and --checkpoint")
    df = read_telemetry(spark, data, mapping, stream=True, **(reader_options or {}))
    sink = MicroBatchSink(out, checkpoint, mapping, config, dedup=dedup)
    return (df.writeStream.queryName("lightgate_analytics").foreachBatch(sink)
            .option("checkpointLocation", str(checkpoint / "query")).trigger(**trigger).start())
