"""The commitlog data source in a real local SparkSession (spark_analytics.source)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.helpers.spark_fixtures import (
    T0_MS,
    Msg,
    available_now_progress,
    scan_all,
    telemetry,
    write_log,
)

from spark_analytics.source import admitted_end
from spark_analytics.times import parse_time
from lightqueue.topics import matches
from store.api import NewMessage
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import FLAG_ZSTD, encode_record, new_batch
from tests.helpers.batches import readings

pytestmark = pytest.mark.spark


def test_rows_schema_and_split_partitions(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(2500) + [Msg("x/y", b"\x00\xff" * 30, T0_MS + 10**7, client_id="c", qos=2,
                                  retain=True, properties=b"\x26\x00\x01k\x00\x01v")]
    offsets = write_log(tmp_path, msgs)
    df = spark.read.format("commitlog").option("partitionBytes", "20000").load(str(tmp_path))
    assert df.columns == ["offset", "store_ts", "born_ts", "topic", "client_id", "qos", "retain", "properties", "payload"]
    segments = len(list((tmp_path / "commitlog").glob("0" * 15 + "*[0-9]")))
    assert df.rdd.getNumPartitions() > segments  # segments were cut into byte ranges
    got = df.orderBy("offset").collect()
    assert [r.offset for r in got] == offsets  # every record exactly once across the cuts
    assert [(r.topic, r.payload, r.client_id, r.qos, r.retain) for r in got] == [
        (m.topic, m.payload, m.client_id, m.qos, m.retain) for m in msgs]
    assert got[-1].properties == msgs[-1].properties
    assert round(got[7].store_ts.timestamp() * 1000) == msgs[7].store_ms


def test_topic_and_time_push_down_options(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(1500, devices=4)
    write_log(tmp_path, msgs)
    lo, hi = msgs[100].store_ms, msgs[1100].store_ms
    assert hi == T0_MS + 1_100_000 == parse_time("2023-11-14T22:31:20Z")
    df = (spark.read.format("commitlog").option("topicFilter", "fleet/+/telemetry").option("fromTime", str(lo))
          .option("toTime", "2023-11-14T22:31:20Z").load(str(tmp_path)))
    assert df.count() == 1000
    one = spark.read.format("commitlog").option("topicFilter", "fleet/dev2/#").load(str(tmp_path))
    assert sorted(r.offset for r in one.select("offset").collect()) == sorted(
        r.offset for r in spark.read.format("commitlog").load(str(tmp_path)).where("topic = 'fleet/dev2/telemetry'")
        .select("offset").collect())
    assert one.count() == sum(matches("fleet/dev2/#", m.topic) for m in msgs)


def test_telemetry_mode_counts_quarantine(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(1000, bad_every=25)
    write_log(tmp_path, msgs)
    df = (spark.read.format("commitlog").options(**{"parse": "telemetry", "telemetry.metrics": "temp,hum"})
          .load(str(tmp_path)))
    assert df.columns == ["offset", "store_ts", "topic", "device", "event_ts", "temp", "hum", "error", "payload"]
    bad = df.where("error is not null").collect()
    assert len(bad) == 40 and all(r.payload is not None for r in bad)
    assert df.where("error is null").count() == 960


def test_bad_options_fail_at_load(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(10))
    with pytest.raises(Exception, match="unknown commitlog option"):
        spark.read.format("commitlog").option("topic", "a").load(str(tmp_path)).count()


def test_a_schema_subset_builds_only_those_columns(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(300, bad_every=30)
    write_log(tmp_path, msgs)
    raw = spark.read.format("commitlog").schema("payload binary, offset long").load(str(tmp_path)).collect()
    assert [r.payload for r in raw] == [m.payload for m in msgs] and raw[0].offset == 0
    tel = (spark.read.format("commitlog").schema("temp double, error string")
           .options(**{"parse": "telemetry", "telemetry.metrics": "temp,hum"}).load(str(tmp_path)))
    assert tel.columns == ["temp", "error"] and tel.where("error is not null").count() == 10
    with pytest.raises(Exception, match="is not one of the commitlog source's columns"):
        spark.read.format("commitlog").schema("topic binary").load(str(tmp_path)).collect()


def test_where_on_store_time_and_topic_is_pushed_into_the_reader(spark: Any, tmp_path: Path) -> None:
    import datetime

    from pyspark.sql import functions as F

    msgs = telemetry(2000, devices=7)
    write_log(tmp_path, msgs)
    df = spark.read.format("commitlog").option("partitionBytes", "20000").load(str(tmp_path))
    cut = datetime.datetime.fromtimestamp((T0_MS + 1_000_500) / 1000, datetime.timezone.utc)
    late = datetime.datetime.fromtimestamp((T0_MS + 1_800_000) / 1000, datetime.timezone.utc)
    query = df.where((F.col("store_ts") > F.lit(cut)) & (F.col("store_ts") <= F.lit(late))
                     & (F.col("topic") == "fleet/dev3/telemetry") & F.col("qos").isin(0, 1))
    plan = query._jdf.queryExecution().executedPlan().toString()
    filters = [line for line in plan.splitlines() if re.search(r"\bFilter\b", line)]
    assert filters and all("store_ts" not in f and "topic" not in f for f in filters)  # only the qos test is left
    want = [m for m in msgs if T0_MS + 1_000_500 < m.store_ms <= T0_MS + 1_800_000
            and m.topic == "fleet/dev3/telemetry" and m.qos in (0, 1)]
    assert sorted(r.store_ts.timestamp() * 1000 for r in query.collect()) == [m.store_ms for m in want]


def test_positions_by_offset_and_time_and_several_topic_filters(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(1500, devices=5) + [Msg(f"alerts/dev{i % 5}/hot", b"{}", T0_MS + 1_500_000 + i) for i in range(40)]
    msgs[700] = dataclasses.replace(msgs[700], store_ms=T0_MS)  # a clock that went back: earlier than its neighbours
    offsets = write_log(tmp_path, msgs)
    log = scan_all(tmp_path)  # the CommitLog's own reader: the independent truth
    assert [o for o, _t, _p in log] == offsets

    def read(**options: str) -> list[int]:
        df = spark.read.format("commitlog").options(partitionBytes="20000", **options).load(str(tmp_path))
        return sorted(r.offset for r in df.select("offset").collect())

    assert read(startingOffsets=str(offsets[100]), endingOffsets=str(offsets[1200])) == offsets[100:1200]
    # not a record boundary: from the next record on; a stream offset's JSON names a position too
    assert read(startingOffsets=str(offsets[100] + 1), endingOffsets=str(offsets[1200] - 1)) == offsets[101:1200]
    assert read(startingOffsets=json.dumps({"segment": 0, "position": offsets[1490]})) == offsets[1490:]
    # a time is the position of the first record (in log order) stored at or after it: the record whose clock
    # went back is inside the range, which fromTime/toTime (a filter on each record's time) leave out
    lo, hi = msgs[300].store_ms, msgs[900].store_ms
    assert read(startingTimestamp=str(lo), endingTimestamp=str(hi)) == offsets[300:900]
    assert read(fromTime=str(lo), toTime=str(hi)) == [o for o, m in zip(offsets, msgs) if lo <= m.store_ms < hi]
    assert offsets[700] not in read(fromTime=str(lo), toTime=str(hi))
    assert read(startingTimestamp=str(T0_MS + 10**9)) == []  # nothing stored since
    filters = ["fleet/dev1/#", "+/dev1/telemetry", "alerts/#"]  # dev1's records match two of them
    want = [o for o, t, _p in log if any(matches(f, t) for f in filters)]
    assert read(topicFilters=json.dumps(filters[1:]), topicFilter=filters[0]) == want  # each record once
    assert read(topicFilters=json.dumps(filters), startingOffsets=str(offsets[1000])) == [o for o in want
                                                                                           if o >= offsets[1000]]
    # a stream: from an offset to a time, with availableNow, in steps of a rate limit
    frame = (spark.readStream.format("commitlog").options(startingOffsets=str(offsets[250]), endingTimestamp=str(hi),
                                                          maxRecordsPerTrigger="200").load(str(tmp_path)))
    progress = available_now_progress(frame.select("offset"), tmp_path / "out", tmp_path / "checkpoint")
    assert sum(p["numInputRows"] for p in progress) == 650
    assert sorted(r.offset for r in spark.read.parquet(str(tmp_path / "out")).collect()) == offsets[250:900]


def test_a_micro_batch_never_ends_inside_a_batch_record() -> None:
    """A batch record's rows are at consecutive offsets (docs/storage.md, "Batch records"): a rate limit that falls
    among them ends the micro-batch after the batch (a read from inside a record would start at the next one, so
    the batch's other rows would be lost), also when the batch goes on in the next chunk of offsets."""
    singles = np.array([0, 100, 200])
    batch = np.arange(300, 310)  # one batch record at 300, its 10 messages
    after = np.array([600, 700])
    chunks = [singles, batch, after]
    assert admitted_end(chunks, 0, 800, 2, None) == 200  # among single records: as before
    assert admitted_end(chunks, 0, 800, 5, None) == 600  # inside the batch: after it
    assert admitted_end([np.concatenate((singles, batch[:4])), batch[4:], after], 0, 800, 5, None) == 600
    assert admitted_end(chunks, 0, 800, 100, None) == 800
    assert admitted_end([batch, after], 300, 800, None, 1) == 600  # at least one record: the whole batch


def test_compressed_batch_records_are_a_row_per_message(spark: Any, tmp_path: Path) -> None:
    """Batch records whose bodies are zstd frames (docs/storage.md, "Compressed batch bodies") beside raw ones and
    single records: a row per message, at its position, with its own fields, across partitions."""
    expected = []
    with CommitLog.open(tmp_path / "commitlog", CommitLogConfig(segment_bytes=64 * 1024, max_record_bytes=64 * 1024)) as log:
        for n in range(40):
            items = [NewMessage("b/z", p, client_id=f"dev-{i % 3}", qos=i % 3) for i, p in enumerate(readings(12, n))]
            raw = new_batch("b/z", items, T0_MS + n, compress=n % 4 != 3)[0]
            assert bool(raw[12] & FLAG_ZSTD) == (n % 4 != 3)
            offset = log.append(raw)
            expected += [(offset + i, m.client_id, m.qos, m.payload) for i, m in enumerate(items)]
            offset = log.append(encode_record("b/z", b"single %d" % n, store_ms=T0_MS + n))
            expected.append((offset, "", 0, b"single %d" % n))
        log.flush()
    df = spark.read.format("commitlog").option("partitionBytes", "20000").load(str(tmp_path))
    assert [(r.offset, r.client_id, r.qos, r.payload) for r in df.orderBy("offset").collect()] == expected
