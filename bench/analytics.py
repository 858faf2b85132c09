"""``lightgate bench analytics``: rows/s of the per-device telemetry aggregation.

One run measures the same aggregation (per device per 1-minute window: count,
min, max, mean and sample stddev of each metric; ``--percentiles`` adds
p50/p95) three ways over the same rows:

- ``commitlog``: Spark reading CommitLog segments with the ``commitlog``
  source (framing, CRC checks and JSON parsing in the reader), asking for
  the columns the aggregation reads with ``.schema(...)``;
- ``parquet``: Spark reading the same telemetry rows stored as Parquet (the
  ceiling: columnar, no parsing);
- ``python``: a single-process pure-Python reference (the CommitLog's own
  ``scan`` + orjson + dicts), which also checks the Spark result's totals.

The log is generated with the real CommitLog (default 256 MiB segments,
batches of encoded records). Spark results are materialised with the
``noop`` sink so every aggregate is computed and nothing is written.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Stopwatch
from store.commitlog import CommitLog, CommitLogConfig
from store.record import encode_record

T0_MS = 1_699_999_980_000  # a whole minute, so windows line up with the generated times
STEP_MS = 2  # 500 records per second across the fleet
APPEND_BATCH = 4096
METRICS = ("temp", "hum", "bat")
TARGET_ROWS_PER_S = 600_000
TARGET_PARQUET_RATIO = 0.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=5_000_000, help="telemetry records to generate (default 5M)")
    parser.add_argument("--devices", type=int, default=1000, help="devices in the fleet (default 1000)")
    parser.add_argument("--runs", type=int, default=3, help="timed Spark runs per variant (default 3; medians reported)")
    parser.add_argument("--python-runs", type=int, default=1, help="runs of the pure-Python reference (default 1)")
    parser.add_argument("--master", default="local[2]", help="Spark master URL (default local[2])")
    parser.add_argument("--percentiles", action="store_true", help="also compute approximate p50/p95 per metric")
    parser.add_argument("--no-crc", action="store_true", help="read the CommitLog without CRC checks")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")


def _generate(data: Path, records: int, devices: int) -> dict[str, float]:
    """Write ``records`` telemetry messages with the CommitLog; return timings."""
    rnd = random.Random(1)
    encode_s = append_s = 0.0
    with CommitLog.open(data / "commitlog", CommitLogConfig()) as log:
        for start in range(0, records, APPEND_BATCH):
            t = time.perf_counter()
            batch = []
            for i in range(start, min(start + APPEND_BATCH, records)):
                device = f"dev{i % devices}"
                payload = b'{"temp":%.3f,"hum":%.2f,"bat":%.3f}' % (
                    rnd.uniform(-20, 40), rnd.uniform(0, 100), rnd.uniform(3.2, 4.2))
                store_ms = T0_MS + i * STEP_MS
                batch.append(encode_record(f"fleet/{device}/telemetry", payload, client_id=device, qos=1,
                                           born_ms=store_ms - 5, store_ms=store_ms))
            t2 = time.perf_counter()
            log.append_batch(batch)
            append_s += time.perf_counter() - t2
            encode_s += t2 - t
        log.flush()
    total = encode_s + append_s
    return {"seconds": total, "records_per_s": records / total, "append_only_records_per_s": records / append_s}


def _aggregate(df: Any, percentiles: bool) -> Any:
    from pyspark.sql import functions as F

    aggs = [F.count(F.lit(1)).alias("count")]
    for m in METRICS:
        aggs += [F.min(m), F.max(m), F.avg(m), F.stddev_samp(m)]
        if percentiles:
            aggs.append(F.percentile_approx(m, [0.5, 0.95]))
    return df.groupBy("device", F.window("event_ts", "60 seconds")).agg(*aggs)


def _python_reference(data: Path, devices: int) -> tuple[float, dict[str, Any]]:
    """The same aggregation in one Python process; returns (seconds, totals)."""
    import orjson

    groups: dict[tuple[str, int], list[float]] = {}
    with Stopwatch() as sw:
        with CommitLog.open(data / "commitlog", CommitLogConfig()) as log:
            offset = log.min_offset
            end = log.written_offset
            while offset < end:
                result = log.scan(offset, 8 << 20)
                for rec in result.records:
                    body = orjson.loads(rec.payload)
                    key = (rec.topic.split("/")[1], rec.store_ms - rec.store_ms % 60_000)
                    cell = groups.get(key)
                    if cell is None:
                        cell = groups[key] = [0, *([math.inf, -math.inf, 0.0, 0.0] * len(METRICS))]
                    cell[0] += 1
                    for j, m in enumerate(METRICS):
                        v = body[m]
                        base = 1 + 4 * j
                        if v < cell[base]:
                            cell[base] = v
                        if v > cell[base + 1]:
                            cell[base + 1] = v
                        cell[base + 2] += v
                        cell[base + 3] += v * v
                if result.next_offset == offset:
                    break
                offset = result.next_offset
        # mean and stddev per group, as Spark reports them
        for cell in groups.values():
            n = cell[0]
            for j in range(len(METRICS)):
                base = 1 + 4 * j
                mean = cell[base + 2] / n
                cell[base + 3] = math.sqrt(max(cell[base + 3] - n * mean * mean, 0.0) / (n - 1)) if n > 1 else math.nan
                cell[base + 2] = mean
    return sw.seconds, {"groups": len(groups), "rows": sum(c[0] for c in groups.values())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from spark_analytics.session import spark_session
    from spark_analytics.telemetry import TelemetryMapping

    work = args.dir or Path(tempfile.mkdtemp(prefix="lightgate-bench-analytics-"))
    data = work / "data"
    try:
        generated = _generate(data, args.records, args.devices)
        segments = len(list((data / "commitlog").glob("0" * 5 + "*[0-9]")))
        spark = spark_session(args.master, app_name="lightgate-bench-analytics")
        mapping = TelemetryMapping(METRICS)
        options = {**mapping.to_options(), "verifyCrc": "false" if args.no_crc else "true"}
        columns = f"device string, event_ts timestamp, {', '.join(f'{m} double' for m in METRICS)}, error string"

        def source(**extra: str) -> Any:
            """The telemetry rows, with only the columns the aggregation reads (as Parquet's pruning gives it)."""
            return (spark.read.format("commitlog").schema(columns).options(**options, **extra).load(str(data))
                    .where(F.col("error").isNull()))

        # Warm-up (JVM JIT, Python workers): a minute of data through both paths.
        warm = {"fromTime": str(T0_MS), "toTime": str(T0_MS + 60_000)}
        _aggregate(source(**warm), args.percentiles).write.format("noop").mode("overwrite").save()
        parquet = work / "telemetry.parquet"
        with Stopwatch() as sw:
            source().select("device", "event_ts", *METRICS).write.mode("overwrite").parquet(str(parquet))
        parquet_write_s = sw.seconds
        _aggregate(spark.read.parquet(str(parquet)).limit(1000), args.percentiles).write.format("noop").mode("overwrite").save()

        times: dict[str, list[float]] = {"commitlog": [], "parquet": []}
        for _ in range(args.runs):
            for name, frame in (("commitlog", source()), ("parquet", spark.read.parquet(str(parquet)))):
                with Stopwatch() as sw:
                    _aggregate(frame, args.percentiles).write.format("noop").mode("overwrite").save()
                times[name].append(sw.seconds)
        spark_groups = _aggregate(source(), args.percentiles).count()
        python_times, totals = [], {}
        for _ in range(args.python_runs):
            seconds, totals = _python_reference(data, args.devices)
            python_times.append(seconds)
        spark.stop()

        def variant(values: list[float]) -> dict[str, Any]:
            med = statistics.median(values)
            return {"seconds_median": med, "seconds_runs": values, "rows_per_s": args.records / med}

        result = {name: variant(values) for name, values in times.items()}
        result["python"] = variant(python_times)
        cl, pq, py = (result[k]["rows_per_s"] for k in ("commitlog", "parquet", "python"))
        result.update({
            "records": args.records,
            "devices": args.devices,
            "segments": segments,
            "percentiles": args.percentiles,
            "verify_crc": not args.no_crc,
            "master": args.master,
            "generate": generated,
            "parquet_write_s": parquet_write_s,
            "groups": spark_groups,
            "python_totals": totals,
            "groups_agree": totals.get("groups") == spark_groups and totals.get("rows") == args.records,
            "ratio_commitlog_to_parquet": cl / pq,
            "ratio_commitlog_to_python": cl / py,
            "target_rows_per_s": TARGET_ROWS_PER_S,
            "target_parquet_ratio": TARGET_PARQUET_RATIO,
            "meets_targets": cl >= TARGET_ROWS_PER_S and cl / pq >= TARGET_PARQUET_RATIO,
        })
        return result
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
