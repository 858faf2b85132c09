"""``lightgate bench analytics``: rows/s of the per-device telemetry aggregation, and the tier's costs.

One run measures the same aggregation (per device per 1-minute window: count,
min, max, mean and sample stddev of each metric; ``--percentiles`` adds
p50/p95) over the same records (those of the sealed segments) several ways:

- ``tier``: the ``commitlog`` source reading the Parquet tier only (the
  sealed segments converted by store/tier.py), parsing payloads in the reader;
- ``commitlog``: the ``commitlog`` source reading the segment files (the live
  tail's path: framing, CRC checks and JSON parsing in the reader);
- ``store_rpc``: the ``commitlog`` source reading the same segments over a
  store node's RPC (``store=HOST:PORT``: ``ReadLog`` answers framed on the
  executor, what a cluster without shared files reads), one partition;
- ``records_parquet``: Spark over plain Parquet of the same records (the raw
  record columns written by Spark with its defaults), payloads parsed by the
  JVM's ``from_json``: the baseline of the tier's >= 0.9x target;
- ``parquet``: Spark over the already parsed telemetry rows in Parquet (the
  ceiling: columnar, no parsing at all);
- ``python``: a single-process pure-Python reference (the CommitLog's own
  ``scan`` + orjson + dicts), which also checks the Spark result's totals.

The source reads only the columns the aggregation needs (``.schema(...)``:
Python data sources get no column pruning from Spark). Also measured:
``.where()`` on ``store_ts`` pushed into the reader against the same filter
Spark evaluates after a full read; partitions of 1 MiB against the default
64 MiB (the cost of a partition should follow its size); and the tier
conversion's records per CPU second and share of a core.

The log is generated with the real CommitLog (``--segment-mib`` segments,
batches of encoded records). Spark results are materialised with the
``noop`` sink so every aggregate is computed and nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from crc32c import crc32c

from gateway.bench.common import Stopwatch
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import encode_record

T0_MS = 1_699_999_980_000  # a whole minute, so windows line up with the generated times
STEP_MS = 2  # 500 records per second across the fleet
APPEND_BATCH = 4096
METRICS = ("temp", "hum", "bat")
TARGET_TIER_RATIO = 0.9  # tier / records_parquet
TARGET_LIVE_RATIO = 0.5  # commitlog / records_parquet
SMALL_PARTITION_BYTES = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=5_000_000, help="telemetry records to generate (default 5M)")
    parser.add_argument("--devices", type=int, default=1000, help="devices in the fleet (default 1000)")
    parser.add_argument("--runs", type=int, default=3, help="timed Spark runs per variant (default 3; medians reported)")
    parser.add_argument("--python-runs", type=int, default=1, help="runs of the pure-Python reference (default 1)")
    parser.add_argument("--master", default="local[2]", help="Spark master URL (default local[2])")
    parser.add_argument("--percentiles", action="store_true", help="also compute approximate p50/p95 per metric")
    parser.add_argument("--no-crc", action="store_true", help="read the CommitLog without CRC checks")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--segment-mib", type=int, default=32,
                        help="CommitLog segment size (default 32 MiB, so a few million records fill several)")
    parser.add_argument("--tier-cpu-share", type=float, default=0.25,
                        help="the tier conversion's throttle for its second, throttled measurement (default 0.25)")


def _generate(data: Path, records: int, devices: int, config: CommitLogConfig) -> dict[str, float]:
    """Write ``records`` telemetry messages with the CommitLog; return timings."""
    rnd = random.Random(1)
    encode_s = append_s = 0.0
    with CommitLog.open(data / "commitlog", config) as log:
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


def _sealed_copy(data: Path, sealed: Path, config: CommitLogConfig) -> tuple[int, int]:
    """Hard-link the sealed segments (and their .meta) of ``data`` into ``sealed/commitlog`` with a
    ``flushed`` hint at their end: the same records for every variant. Returns their count and bytes."""
    from store.log.commitlog import HINT_FILE

    target = sealed / "commitlog"
    target.mkdir(parents=True)
    with CommitLog.open(data / "commitlog", config) as log:
        segs = [s for s in log.segments() if s.sealed]
    for seg in segs:
        os.link(seg.path, target / seg.path.name)
        os.link(seg.path.with_name(seg.path.name + ".meta"), target / (seg.path.name + ".meta"))
    end = segs[-1].end
    (target / HINT_FILE).write_bytes(end.to_bytes(8, "big") + crc32c(end.to_bytes(8, "big")).to_bytes(4, "big"))
    return sum(s.records for s in segs), sum(s.used for s in segs)


def _convert(data: Path, tier: Path, config: CommitLogConfig, cpu_share: float, limit: int | None = None
             ) -> dict[str, float]:
    """Convert the sealed segments (at most ``limit``) into ``tier``; wall and CPU seconds, records."""
    from store.tier import TierConfig, TierConverter

    with CommitLog.open(data / "commitlog", config) as log:
        converter = TierConverter(log, TierConfig(uri=str(tier), cpu_share=cpu_share))
        converter.open()
        began, cpu0 = time.perf_counter(), time.process_time()
        for base in converter.pending()[:limit]:
            converter.convert(base)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
        stats = converter.statistics()
        converter.close()
    return {"records": stats.records, "wall_s": wall, "cpu_s": cpu, "records_per_cpu_s": stats.records / cpu,
            "records_per_s": stats.records / wall, "core_share": cpu / wall}


@contextlib.contextmanager
def store_node(data: Path, config: CommitLogConfig) -> Iterator[str]:
    """A store node on ``data`` serving its RPC from a thread, its dispatch caught up (so that no indexing
    runs during the timed reads) and retention off (the records are old); yields HOST:PORT. The Spark tests
    serve their logs through it too (tests/helpers/spark_fixtures.py)."""
    import dataclasses

    import trio

    from store.node import open_store
    from store.rpc.server import serve_rpc

    address: list[str] = []
    ready, stop = threading.Event(), threading.Event()
    keep = dataclasses.replace(config, retention_hours=0.0, retention_check_interval_s=0)  # 2023 records: not old

    async def serve() -> None:
        async with open_store(data, keep) as store, trio.open_nursery() as nursery:
            listeners = await nursery.start(lambda task_status: serve_rpc(store, "127.0.0.1", 0,
                                                                           task_status=task_status))
            await store.dispatcher.wait_dispatched(store.log.log.written_offset)
            address.append(f"127.0.0.1:{listeners[0].socket.getsockname()[1]}")
            ready.set()
            while not stop.is_set():
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    try:
        while not ready.wait(1.0):
            if not thread.is_alive():
                raise RuntimeError("the benchmark's store node did not start")
        yield address[0]
    finally:
        stop.set()
        thread.join()


def _python_reference(data: Path, config: CommitLogConfig) -> tuple[float, dict[str, Any]]:
    """The same aggregation in one Python process; returns (seconds, totals)."""
    import orjson

    groups: dict[tuple[str, int], list[float]] = {}
    with Stopwatch() as sw:
        with CommitLog.open(data / "commitlog", config) as log:
            offset = log.min_offset
            end = log.written_offset
            while offset < end:
                result = log.scan(offset, 8 << 20)
                for rec in result.records:
                    if rec.control:  # the store's own records, not telemetry
                        continue
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
    from pyspark.sql import types as T

    from spark_analytics.session import spark_session
    from spark_analytics.telemetry import TelemetryMapping

    work = args.dir or Path(tempfile.mkdtemp(prefix="lightgate-bench-analytics-"))
    data, sealed, served, tier = work / "data", work / "sealed", work / "served", work / "tier"
    empty = work / "empty" / "commitlog"
    try:
        config = CommitLogConfig(segment_bytes=args.segment_mib << 20)
        generated = _generate(data, args.records, args.devices, config)
        records, log_bytes = _sealed_copy(data, sealed, config)
        segments = len(list((sealed / "commitlog").glob("0" * 5 + "*[0-9]")))
        conversion = _convert(data, tier, config, 1.0)
        shutil.rmtree(tier)
        throttled = _convert(data, tier, config, args.tier_cpu_share, limit=1)
        shutil.rmtree(tier)
        _convert(data, tier, config, 1.0)
        empty.mkdir(parents=True)
        spark = spark_session(args.master, app_name="lightgate-bench-analytics")
        mapping = TelemetryMapping(METRICS)
        options = {**mapping.to_options(), "verifyCrc": "false" if args.no_crc else "true"}
        columns = f"device string, event_ts timestamp, {', '.join(f'{m} double' for m in METRICS)}, error string"

        def source(path: Path = sealed, **extra: str) -> Any:
            """The telemetry rows, with only the columns the aggregation reads (as Parquet's pruning gives it)."""
            return (spark.read.format("commitlog").schema(columns).options(**options, **extra).load(str(path))
                    .where(F.col("error").isNull()))

        def from_tier(**extra: str) -> Any:
            return source(empty, tier=str(tier), **extra)

        payload_schema = T.StructType([T.StructField(m, T.DoubleType()) for m in METRICS])

        def records_parquet(path: Path) -> Any:
            raw = spark.read.parquet(str(path))
            parsed = F.from_json(F.col("payload").cast("string"), payload_schema)
            return raw.select(F.split("topic", "/")[1].alias("device"), F.col("store_ts").alias("event_ts"),
                              *[parsed[m].alias(m) for m in METRICS])

        # Warm-up (JVM JIT, Python workers): a minute of data through the paths.
        warm = {"fromTime": str(T0_MS), "toTime": str(T0_MS + 60_000)}
        for frame in (source(**warm), from_tier(**warm)):
            _aggregate(frame, args.percentiles).write.format("noop").mode("overwrite").save()
        parquet, raw_parquet = work / "telemetry.parquet", work / "records.parquet"
        with Stopwatch() as sw:
            source().select("device", "event_ts", *METRICS).write.mode("overwrite").parquet(str(parquet))
        parquet_write_s = sw.seconds
        spark.read.format("commitlog").load(str(sealed)).write.mode("overwrite").parquet(str(raw_parquet))
        for frame in (spark.read.parquet(str(parquet)), records_parquet(raw_parquet)):
            _aggregate(frame.limit(1000), args.percentiles).write.format("noop").mode("overwrite").save()

        _sealed_copy(data, served, config)  # links of the same segments: the store node writes its own files
        with store_node(served, config) as address:
            def over_rpc() -> Any:
                return (spark.read.format("commitlog").schema(columns).options(**options, store=address).load()
                        .where(F.col("error").isNull()))

            _aggregate(over_rpc().limit(1000), args.percentiles).write.format("noop").mode("overwrite").save()
            variants = {"tier": from_tier, "commitlog": source, "store_rpc": over_rpc,
                        "records_parquet": lambda: records_parquet(raw_parquet),
                        "parquet": lambda: spark.read.parquet(str(parquet))}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.runs):
                for name, make in variants.items():
                    with Stopwatch() as sw:
                        _aggregate(make(), args.percentiles).write.format("noop").mode("overwrite").save()
                    times[name].append(sw.seconds)
            rpc_groups = _aggregate(over_rpc(), args.percentiles).count()
        spark_groups = _aggregate(from_tier(), args.percentiles).count()

        # push-down: a tenth of the time range through .where(), pushed into the reader, and the same filter
        # written so that Spark cannot push it (evaluated after reading everything)
        cut = T0_MS + int(records * STEP_MS * 0.9)  # the last tenth of the sealed records
        since = F.lit(cut / 1000).cast("timestamp")
        pushdown: dict[str, list[float]] = {"pushed": [], "not_pushed": [], "all_columns": [], "four_columns": []}
        for _ in range(args.runs):
            everything = spark.read.format("commitlog").options(**options).load(str(sealed))
            # the same test on the timestamp's text (UTC, so it orders like the time): Spark pushes no cast
            as_text = F.date_format(since, "yyyy-MM-dd HH:mm:ss")
            for name, frame in (("pushed", everything.where(F.col("store_ts") >= since)),
                                ("not_pushed", everything.where(F.col("store_ts").cast("string") >= as_text))):
                with Stopwatch() as sw:
                    frame.select("offset").write.format("noop").mode("overwrite").save()
                pushdown[name].append(sw.seconds)
            for name, frame in (("all_columns", spark.read.format("commitlog").options(**options).load(str(sealed))),
                                ("four_columns", source())):
                with Stopwatch() as sw:
                    frame.select("device", "event_ts").write.format("noop").mode("overwrite").save()
                pushdown[name].append(sw.seconds)

        # partition cost: the same read in 1 MiB partitions against the default
        partition_times: dict[str, list[float]] = {"commitlog_64mib": times["commitlog"], "tier_64mib": times["tier"],
                                                   "commitlog_1mib": [], "tier_1mib": []}
        small = {"partitionBytes": str(SMALL_PARTITION_BYTES)}
        for _ in range(args.runs):
            for name, frame in (("commitlog_1mib", source(**small)), ("tier_1mib", from_tier(**small))):
                with Stopwatch() as sw:
                    _aggregate(frame, args.percentiles).write.format("noop").mode("overwrite").save()
                partition_times[name].append(sw.seconds)
        python_times, totals = [], {}
        for _ in range(args.python_runs):
            seconds, totals = _python_reference(sealed, config)
            python_times.append(seconds)
        spark.stop()

        def variant(values: list[float]) -> dict[str, Any]:
            med = statistics.median(values)
            return {"seconds_median": med, "seconds_runs": values, "rows_per_s": records / med}

        result = {name: variant(values) for name, values in times.items()}
        result["python"] = variant(python_times)
        rate = {k: result[k]["rows_per_s"] for k in result}
        med = {k: statistics.median(v) for k, v in {**pushdown, **partition_times}.items()}
        result.update({
            "records": records,
            "records_generated": args.records,
            "devices": args.devices,
            "segments": segments,
            "segment_mib": args.segment_mib,
            "percentiles": args.percentiles,
            "verify_crc": not args.no_crc,
            "master": args.master,
            "generate": generated,
            "tier_conversion": conversion,
            "tier_conversion_throttled": {**throttled, "cpu_share": args.tier_cpu_share},
            "tier_bytes": sum(p.stat().st_size for p in tier.glob("*.parquet")),
            "log_bytes": log_bytes,
            "parquet_write_s": parquet_write_s,
            "groups": spark_groups,
            "python_totals": totals,
            "groups_agree": totals.get("groups") == spark_groups == rpc_groups and totals.get("rows") == records,
            "ratio_tier_to_records_parquet": rate["tier"] / rate["records_parquet"],
            "ratio_commitlog_to_records_parquet": rate["commitlog"] / rate["records_parquet"],
            "ratio_store_rpc_to_records_parquet": rate["store_rpc"] / rate["records_parquet"],
            "ratio_store_rpc_to_commitlog": rate["store_rpc"] / rate["commitlog"],
            "ratio_tier_to_parquet": rate["tier"] / rate["parquet"],
            "ratio_commitlog_to_parquet": rate["commitlog"] / rate["parquet"],
            "ratio_commitlog_to_python": rate["commitlog"] / rate["python"],
            "pushdown_seconds": {k: pushdown[k] for k in pushdown},
            "filter_pushdown_speedup": med["not_pushed"] / med["pushed"],
            "column_subset_speedup": med["all_columns"] / med["four_columns"],
            "partition_seconds": partition_times,
            "partition_cost_1mib_vs_64mib": {"commitlog": med["commitlog_1mib"] / med["commitlog_64mib"],
                                             "tier": med["tier_1mib"] / med["tier_64mib"]},
            "target_tier_ratio": TARGET_TIER_RATIO,
            "target_live_ratio": TARGET_LIVE_RATIO,
            "meets_targets": rate["tier"] / rate["records_parquet"] >= TARGET_TIER_RATIO
            and rate["commitlog"] / rate["records_parquet"] >= TARGET_LIVE_RATIO,
        })
        return result
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
