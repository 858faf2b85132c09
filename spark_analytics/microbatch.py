"""The streaming job's sink: every output of a micro-batch from one read of the CommitLog.

``lightgate analytics stream`` runs ONE Structured Streaming query over the
``commitlog`` source. Its ``foreachBatch`` sink (:class:`MicroBatchSink`)
writes the micro-batch's parsed rows once, as Parquet under the checkpoint
(the only action on the source's DataFrame), and computes every output table
from those staged rows with the batch job's own aggregations, so the tables
are what ``lightgate analytics batch`` writes over the records read so far:

- the watermark (event time; store time for the topic table) is the latest
  time read minus ``--watermark``, moved at the end of each micro-batch as
  Spark's is; a telemetry row older than the watermark when it is read is
  late and not aggregated (counted; quarantined rows are always written);
- a window (a day for ``device_day``, a silence gap by its end) closes when
  the watermark passes its end: it is written once, in ``final-<batch>-*``
  files; the windows still open are recomputed from the staged rows at each
  micro-batch and written as ``open-<batch>-*`` files that replace those of
  the micro-batch before (``device_last_seen`` is open for ever);
- staged rows are kept while a window that may hold them is open (and serve
  ``--dedup`` over that span).

Restarts: a micro-batch writes its output files and the state the next one
needs under ``state/<batch>/``, ``meta.json`` last, and only then moves the
files into the tables. Spark re-runs a micro-batch that was not committed
(with the same offsets): without ``meta.json`` it is recomputed from the
previous state (the tables were not touched yet); with it only the moves are
finished. Nothing is lost or counted twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from . import aggregate as agg
from .outputs import publish, write_table
from .telemetry import TelemetryMapping
from .times import window_label

__all__ = ["MicroBatchSink", "StreamState", "output_tables", "read_state"]

MICROS = 1_000_000

ON_TIME = "_on_time"
"""Staged column: a telemetry row at or after the event-time watermark when it was read (late rows are kept
staged for the quarantine and the topic table, never aggregated by event time)."""

REPEAT = "_repeat"
"""Staged column: a repeated message (``--dedup``), in no table; staged so that the count of records read is
exact and a later copy of its key is recognised."""

STORED_ON_TIME = "_stored_on_time"
"""Staged column: a row at or after the store-time watermark when it was read (the topic table's lateness)."""

DAYS_SCHEMA = "device string, date date, first_seen timestamp, last_seen timestamp, messages long, kind string"
DEVICES_SCHEMA = "device string, first_seen timestamp, last_seen timestamp, messages long, anchor timestamp"
"""State tables: ``days`` are device_day rows with their kind (the open ones are merged with the next
micro-batch); ``devices`` are device_last_seen's counters plus ``anchor``, a device's last event before the
watermark (where its next silence gap starts)."""


def output_tables(config: agg.AggregationConfig) -> list[str]:
    """The tables the stream writes under ``--out`` (those of the batch job; no chart)."""
    return [*(f"device_{window_label(w)}" for w in sorted(config.windows)),
            f"topic_{window_label(min(config.windows))}", "device_day", "device_last_seen", "silence_gaps",
            "quarantine"]


@dataclass
class StreamState:
    """What a micro-batch hands to the next one (``state/<batch>/meta.json``); times in µs since the epoch."""

    batch: int = -1
    event_watermark: int | None = None
    store_watermark: int | None = None
    staged: list[list[Any]] = field(default_factory=list)
    """``[batch, latest on-time event, latest store time]`` of each staged micro-batch still needed."""
    rows: int = 0
    """Records read so far (duplicates and quarantined ones included)."""
    repeats: int = 0
    """Of those, the repeated messages ``--dedup`` left out."""
    late: int = 0
    """Telemetry records read after the watermark had passed them: in no event-time table."""


def read_state(checkpoint: Path) -> StreamState:
    """The state the last complete micro-batch left under ``checkpoint``; an empty state before the first."""
    root = checkpoint / "state"
    done = sorted(int(d.name) for d in root.glob("[0-9]*") if (d / "meta.json").exists())
    if not done:
        return StreamState()
    return StreamState(**json.loads((root / f"{done[-1]:010d}" / "meta.json").read_text()))


def _ts(micros: int) -> Column:
    return F.timestamp_micros(F.lit(micros))


def _since(df: DataFrame, column: str, micros: int | None) -> DataFrame:
    return df if micros is None else df.where(F.col(column) >= _ts(micros))


def _floor(micros: int | None, window_s: int) -> int | None:
    """The start of the window holding ``micros``: windows ending after it start there or later."""
    return None if micros is None else micros - micros % (window_s * MICROS)


def _advance(watermark: int | None, latest: int | None, delay_s: int) -> int | None:
    if latest is None:
        return watermark
    moved = latest - delay_s * MICROS
    return moved if watermark is None else max(watermark, moved)


def _closed(column: str, watermark: int | None, *, strict: bool = False) -> Column | None:
    """Rows whose ``column`` (a window's or a gap's end) the watermark has passed: final (None: no watermark)."""
    if watermark is None:
        return None
    return F.col(column) < _ts(watermark) if strict else F.col(column) <= _ts(watermark)


def _kind(final: Column | None) -> Column:
    """``final`` rows are written once; ``open`` ones are replaced by the next micro-batch."""
    return F.lit("open") if final is None else F.when(final, F.lit("final")).otherwise(F.lit("open"))


def _still_needed(staged: list[list[Any]], event_wm: int | None, store_wm: int | None,
                  config: agg.AggregationConfig) -> list[list[Any]]:
    """The staged micro-batches holding rows of a window still open: an on-time event at or after the start
    of the oldest open window (gaps need the events since the watermark: later still), or a store time at or
    after the oldest open topic window's start."""
    event_from = None if event_wm is None else min(event_wm - event_wm % (w * MICROS) for w in config.windows)
    store_from = _floor(store_wm, min(config.windows))
    return [s for s in staged
            if (s[1] is not None and (event_from is None or s[1] >= event_from))
            or (s[2] is not None and (store_from is None or s[2] >= store_from))]


class MicroBatchSink:
    """The ``foreachBatch`` function of the stream: stage once, aggregate from the staged rows, publish.

    Resource handling: everything it keeps lives under ``checkpoint`` (``rows/<batch>``: staged rows;
    ``state/<batch>``: state and the files to publish), deleted once no later micro-batch needs it.
    """

    def __init__(self, out: Path, checkpoint: Path, mapping: TelemetryMapping, config: agg.AggregationConfig,
                 *, dedup: bool = False) -> None:
        self.out = out
        self.checkpoint = checkpoint
        self.rows_root = checkpoint / "rows"
        self.state_root = checkpoint / "state"
        self.mapping = mapping
        self.config = config
        self.dedup = dedup
        self.tables = output_tables(config)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        latest = read_state(self.checkpoint)
        if latest.batch > batch_id:
            raise RuntimeError(f"{self.state_root} is at micro-batch {latest.batch}, past the query's {batch_id}: "
                               "the checkpoint was changed by hand; start again with a new --checkpoint and --out")
        if latest.batch < batch_id:
            self._compute(batch, batch_id, latest)
        publish(self.state_root / f"{batch_id:010d}" / "pending", self.out, batch_id, self.tables)
        self._clean(read_state(self.checkpoint))

    def _rows(self, batch_id: int) -> str:
        return str(self.rows_root / f"{batch_id:010d}")

    def _state_table(self, spark: Any, prev: StreamState, name: str, schema: str) -> DataFrame | None:
        path = self.state_root / f"{prev.batch:010d}" / name
        return spark.read.schema(schema).parquet(str(path)) if path.exists() else None

    def _compute(self, batch: DataFrame, batch_id: int, prev: StreamState) -> None:
        spark = batch.sparkSession
        here = self.state_root / f"{batch_id:010d}"
        shutil.rmtree(here, ignore_errors=True)
        pending = here / "pending"
        config, ev_wm, st_wm = self.config, prev.event_watermark, prev.store_watermark

        rows = batch
        if self.dedup:
            earlier = [self._rows(k) for k, *_ in prev.staged]
            rows = agg.mark_repeats(rows, REPEAT, earlier=spark.read.parquet(*earlier) if earlier else None)
        else:
            rows = rows.withColumn(REPEAT, F.lit(False))
        kept = F.col("error").isNull() & ~F.col(REPEAT)
        on_time = kept & (F.lit(True) if ev_wm is None else F.col("event_ts") >= _ts(ev_wm))
        stored_on_time = ~F.col(REPEAT) & (F.lit(True) if st_wm is None else F.col("store_ts") >= _ts(st_wm))
        write_table(rows.withColumn(ON_TIME, on_time).withColumn(STORED_ON_TIME, stored_on_time),
                    Path(self._rows(batch_id)), partition_by=())  # the one read of the CommitLog
        new = spark.read.parquet(self._rows(batch_id))
        got = new.agg(F.count(F.lit(1)).alias("rows"), F.count(F.when(F.col(REPEAT), 1)).alias("repeats"),
                      F.count(F.when(F.col("error").isNull() & ~F.col(REPEAT) & ~F.col(ON_TIME), 1)).alias("late"),
                      F.unix_micros(F.max(F.when(F.col(ON_TIME), F.col("event_ts")))).alias("event"),
                      F.unix_micros(F.max("store_ts")).alias("store")).first()
        if not got["rows"]:  # the topic filter left every record out (or none was admitted): nothing changes
            for name in ("days", "devices"):  # the next micro-batch's state is this one's
                kept = self.state_root / f"{prev.batch:010d}" / name
                if kept.exists():
                    shutil.copytree(kept, here / name)
            self._complete(here, dataclasses.replace(prev, batch=batch_id))
            return
        new_ev = _advance(ev_wm, got["event"], config.watermark_s)
        new_st = _advance(st_wm, got["store"], config.watermark_s)
        staged = [*prev.staged, [batch_id, got["event"], got["store"]]]
        every = spark.read.parquet(*(self._rows(k) for k, *_ in staged))
        events, stored, fresh = (every.where(F.col(ON_TIME)), every.where(F.col(STORED_ON_TIME)),
                                 new.where(F.col(ON_TIME)))

        # windows open before this micro-batch, recomputed from every staged row they hold
        for window_s in sorted(config.windows):
            table = agg.device_windows(_since(events, "event_ts", _floor(ev_wm, window_s)), self.mapping.metrics,
                                       window_s, config)
            self._pend(table, _closed("window_end", new_ev), pending / f"device_{window_label(window_s)}")
        shortest = min(config.windows)
        topics = agg.topic_windows(_since(stored, "store_ts", _floor(st_wm, shortest)), shortest, config)
        self._pend(topics, _closed("window_end", new_st), pending / f"topic_{window_label(shortest)}")

        # device_day: this micro-batch's counts merged into the days still open
        days = agg.device_days(fresh)
        open_days = self._state_table(spark, prev, "days", DAYS_SCHEMA)
        if open_days is not None:
            days = (days.unionByName(open_days.where(F.col("kind") == "open").drop("kind"))
                    .groupBy("device", "date").agg(F.min("first_seen").alias("first_seen"),
                                                   F.max("last_seen").alias("last_seen"),
                                                   F.sum("messages").alias("messages")))
        day_final = None if new_ev is None else F.col("date") < F.to_date(_ts(new_ev))
        write_table(days.withColumn("kind", _kind(day_final)), here / "days", partition_by=())
        self._pend(spark.read.schema(DAYS_SCHEMA).parquet(str(here / "days")).drop("kind"), day_final,
                   pending / "device_day")

        # device_last_seen from per-device counters; anchors: each device's last event before the watermark
        previous = self._state_table(spark, prev, "devices", DEVICES_SCHEMA)
        counted = fresh.groupBy("device").agg(F.min("event_ts").alias("first_seen"),
                                              F.max("event_ts").alias("last_seen"),
                                              F.count(F.lit(1)).alias("messages"))
        parts = [counted.withColumn("anchor", F.lit(None).cast("timestamp"))]
        if new_ev is not None:
            passed = _since(events, "event_ts", ev_wm).where(F.col("event_ts") < _ts(new_ev))
            parts.append(passed.groupBy("device").agg(F.max("event_ts").alias("anchor"))
                         .select("device", *(F.lit(None).cast(t).alias(c) for c, t in (
                             ("first_seen", "timestamp"), ("last_seen", "timestamp"), ("messages", "long"))),
                                 "anchor"))
        if previous is not None:
            parts.append(previous)
        merged = parts[0]
        for part in parts[1:]:
            merged = merged.unionByName(part)
        merged = merged.groupBy("device").agg(F.min("first_seen").alias("first_seen"),
                                              F.max("last_seen").alias("last_seen"),
                                              F.sum("messages").alias("messages"), F.max("anchor").alias("anchor"))
        write_table(merged, here / "devices", partition_by=())
        devices = spark.read.schema(DEVICES_SCHEMA).parquet(str(here / "devices"))
        self._pend(agg.last_seen_from_days(devices.drop("anchor"), config), None, pending / "device_last_seen",
                   partition_by=())

        # gaps ending at or after the previous watermark: from the events since then and each device's anchor
        anchors = None if previous is None else previous.where(F.col("anchor").isNotNull()).select(
            "device", F.col("anchor").alias("last_seen"))
        gaps = agg.silence_gaps(_since(events, "event_ts", ev_wm), config, previous=anchors)
        self._pend(gaps, _closed("gap_end", new_ev, strict=True), pending / "silence_gaps")
        self._pend(agg.quarantine(new.where(~F.col(REPEAT))), F.lit(True), pending / "quarantine")

        self._complete(here, StreamState(batch_id, new_ev, new_st, _still_needed(staged, new_ev, new_st, config),
                                         prev.rows + got["rows"], prev.repeats + got["repeats"],
                                         prev.late + got["late"]))

    @staticmethod
    def _complete(here: Path, state: StreamState) -> None:
        """Write ``meta.json`` last: the micro-batch is complete, its results may be published."""
        here.mkdir(parents=True, exist_ok=True)
        temp = here / "meta.json.tmp"
        temp.write_text(json.dumps(dataclasses.asdict(state)))
        os.replace(temp, here / "meta.json")

    def _pend(self, table: DataFrame, final: Column | None, path: Path,
              partition_by: tuple[str, ...] = ("date",)) -> None:
        write_table(table.withColumn("kind", _kind(final)), path, partition_by=("kind", *partition_by))

    def _clean(self, state: StreamState) -> None:
        """Drop the state of earlier micro-batches and the staged rows no open window needs."""
        keep = {k for k, *_ in state.staged}
        for d in self.state_root.glob("[0-9]*"):
            if int(d.name) < state.batch:
                shutil.rmtree(d, ignore_errors=True)
        for d in self.rows_root.glob("[0-9]*"):
            if int(d.name) <= state.batch and int(d.name) not in keep:
                shutil.rmtree(d, ignore_errors=True)
