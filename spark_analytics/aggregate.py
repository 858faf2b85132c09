"""Telemetry aggregates as Spark DataFrame transformations.

Input is the ``commitlog`` source read with ``parse=telemetry``: columns
offset, store_ts, topic, device, event_ts, one double per metric, error and
payload. Rows with an ``error`` are quarantine rows; the aggregates use the
others. The batch job applies them to the whole log (or some days of it); the
stream applies the same functions to the staged rows of the windows still
open (microbatch.py), so both write the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

__all__ = [
    "AggregationConfig",
    "device_days",
    "device_windows",
    "fleet_series",
    "last_seen",
    "last_seen_from_days",
    "mark_repeats",
    "quarantine",
    "silence_gaps",
    "telemetry_rows",
    "topic_windows",
]


@dataclass(frozen=True, slots=True)
class AggregationConfig:
    """Window lengths (s), the percentiles, the silence threshold and the streaming watermark."""

    windows: tuple[int, ...] = (60, 3600)
    percentiles: tuple[float, ...] = (0.5, 0.95)
    percentile_accuracy: int = 10_000  # Spark's default: relative error 1/accuracy
    silence_s: int = 300
    watermark_s: int = 600

    def __post_init__(self) -> None:
        if not self.windows or any(w <= 0 for w in self.windows):
            raise ValueError(f"window lengths must be positive seconds, not {self.windows}")
        if any(not 0 < p < 1 for p in self.percentiles):
            raise ValueError(f"percentiles must be between 0 and 1, not {self.percentiles}")


def _seconds_between(start: Column, end: Column) -> Column:
    """Exact seconds between two timestamps (a cast to double rounds to ~0.1 us)."""
    return (F.unix_micros(end) - F.unix_micros(start)) / 1_000_000


def _pct_name(p: float) -> str:
    return "p" + f"{p * 100:g}".replace(".", "_")


def telemetry_rows(df: DataFrame) -> DataFrame:
    """The rows whose payload parsed (no quarantine reason)."""
    return df.where(F.col("error").isNull())


def quarantine(df: DataFrame) -> DataFrame:
    """The rows whose payload did not parse, with the reason and the payload bytes."""
    return (df.where(F.col("error").isNotNull())
            .select("offset", "store_ts", "topic", "device", "error", "payload",
                    F.to_date("store_ts").alias("date")))


def _metric_aggs(metrics: Sequence[str], config: AggregationConfig) -> list[Column]:
    out: list[Column] = [F.count(F.lit(1)).alias("count")]
    for m in metrics:
        col = F.col(m)
        out += [
            F.count(col).alias(f"{m}_count"),
            F.min(col).alias(f"{m}_min"),
            F.max(col).alias(f"{m}_max"),
            F.avg(col).alias(f"{m}_mean"),
            F.stddev_samp(col).alias(f"{m}_stddev"),
            F.percentile_approx(col, list(config.percentiles), config.percentile_accuracy).alias(f"{m}_pct"),
        ]
    return out


def _flatten_percentiles(df: DataFrame, metrics: Sequence[str], config: AggregationConfig) -> DataFrame:
    extra = [F.col(f"{m}_pct")[i].alias(f"{m}_{_pct_name(p)}")
             for m in metrics for i, p in enumerate(config.percentiles)]
    return df.select(*[c for c in df.columns if not c.endswith("_pct")], *extra)


def device_windows(df: DataFrame, metrics: Sequence[str], window_s: int, config: AggregationConfig) -> DataFrame:
    """Per device per event-time window: count, then per metric count, min, max,
    mean, sample stddev and approximate percentiles. Columns: device,
    window_start, window_end, count, ``<metric>_{count,min,max,mean,stddev,pNN}``, date."""
    agg = (telemetry_rows(df).groupBy("device", F.window("event_ts", f"{window_s} seconds").alias("w"))
           .agg(*_metric_aggs(metrics, config)))
    agg = agg.select("device", F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                     *[c for c in agg.columns if c not in ("device", "w")])
    return _flatten_percentiles(agg, metrics, config).withColumn("date", F.to_date("window_start"))


def topic_windows(df: DataFrame, window_s: int, config: AggregationConfig) -> DataFrame:
    """Per topic per store-time window: message count (quarantined ones included:
    they are messages too) and rate in messages per second."""
    agg = df.groupBy("topic", F.window("store_ts", f"{window_s} seconds").alias("w")).agg(
        F.count(F.lit(1)).alias("count"))
    return agg.select(
        "topic",
        F.col("w.start").alias("window_start"),
        F.col("w.end").alias("window_end"),
        "count",
        (F.col("count") / F.lit(float(window_s))).alias("rate_per_s"),
        F.to_date("w.start").alias("date"),
    )


def device_days(df: DataFrame) -> DataFrame:
    """Per device per event date: first and last event time and message count (the ``device_day`` table:
    partitioned by date, so a rerun over some days replaces their rows and ``device_last_seen`` is rebuilt
    from all days)."""
    return (telemetry_rows(df).withColumn("date", F.to_date("event_ts")).groupBy("device", "date")
            .agg(F.min("event_ts").alias("first_seen"), F.max("event_ts").alias("last_seen"),
                 F.count(F.lit(1)).alias("messages")))


def last_seen(df: DataFrame, config: AggregationConfig) -> DataFrame:
    """Per device: first and last event time, message count, and how long it has
    been silent at the end of the data (``silent_s``, ``silent`` past the threshold)."""
    return last_seen_from_days(device_days(df), config)


def last_seen_from_days(days: DataFrame, config: AggregationConfig) -> DataFrame:
    """:func:`last_seen` from a :func:`device_days` table (all days of all runs)."""
    per_device = days.groupBy("device").agg(
        F.min("first_seen").alias("first_seen"), F.max("last_seen").alias("last_seen"),
        F.sum("messages").alias("messages"))
    data_end = days.agg(F.max("last_seen").alias("data_end"))
    silent = _seconds_between(F.col("last_seen"), F.col("data_end"))
    return (per_device.crossJoin(data_end)
            .select("device", "first_seen", "last_seen", "messages", silent.alias("silent_s"),
                    (silent > config.silence_s).alias("silent")))


def silence_gaps(df: DataFrame, config: AggregationConfig, *, previous: DataFrame | None = None,
                 following: DataFrame | None = None) -> DataFrame:
    """Gaps longer than the threshold between consecutive event times of a device.

    ``previous`` (device, last_seen) carries the last event of each device from
    earlier data, so a gap that spans two micro-batches is found too;
    ``following`` (device, first_seen) the first event after the data, so a
    rerun over some days finds the gap from their last event to the next day's
    first (the gaps returned all start in ``df``'s data or ``previous``).
    """
    events = telemetry_rows(df).select("device", "event_ts")
    if previous is not None:
        events = events.unionByName(previous.select("device", F.col("last_seen").alias("event_ts")))
    if following is not None:
        events = events.unionByName(following.select("device", F.col("first_seen").alias("event_ts")))
    before = F.lag("event_ts").over(Window.partitionBy("device").orderBy("event_ts"))
    gaps = events.select("device", before.alias("gap_start"), F.col("event_ts").alias("gap_end"))
    seconds = _seconds_between(F.col("gap_start"), F.col("gap_end"))
    return (gaps.where(seconds > config.silence_s)
            .select("device", "gap_start", "gap_end", seconds.alias("gap_s"), F.to_date("gap_start").alias("date")))


def mark_repeats(df: DataFrame, column: str, *, earlier: DataFrame | None = None) -> DataFrame:
    """``df`` with a boolean ``column``: the row repeats a telemetry message, the same ``key`` (a payload field,
    ``telemetry.key``) of the same device.

    A non-persistent client that reconnects may publish a QoS 1/2 message again, and
    the store keeps both. The first stored copy (lowest offset) is not a repeat, so a
    stream and a batch run keep the same one; a key already in ``earlier`` (rows of
    earlier micro-batches) makes every copy a repeat. Rows without a key (quarantined,
    or no key field) are not repeats. One pass over ``df`` (a union of two filters of it
    would read the CommitLog twice).
    """
    keyed = F.col("key").isNotNull()
    first = F.row_number().over(Window.partitionBy("device", "key").orderBy("offset"))
    if earlier is not None:
        seen = earlier.where(keyed).select("device", "key").distinct().withColumn("_seen", F.lit(True))
        df = df.join(seen, ["device", "key"], "left").select(*df.columns, "_seen")
        return df.withColumn(column, keyed & (F.col("_seen").isNotNull() | (first > 1))).drop("_seen")
    return df.withColumn(column, keyed & (first > 1))


def fleet_series(device_table: DataFrame, metrics: Sequence[str]) -> Any:
    """Fleet-wide series per window from a device-window table, as pandas for the chart:
    window_start, messages, devices and the mean of each metric over devices."""
    return (device_table.groupBy("window_start")
            .agg(F.sum("count").alias("messages"), F.countDistinct("device").alias("devices"),
                 *[(F.sum(F.col(f"{m}_mean") * F.col(f"{m}_count")) / F.sum(f"{m}_count")).alias(m)
                   for m in metrics])
            .orderBy("window_start").toPandas())
