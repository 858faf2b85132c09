"""The ``commitlog`` source over tier + local sealed segments + live tail as one log (spark_analytics.tier,
live, planning.plan_log): every record exactly once, against the CommitLog's own scan taken before retention."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.helpers.spark_fixtures import (
    SEGMENT_BYTES,
    T0_MS,
    available_now_progress,
    scan_all,
    store_node,
    telemetry,
    tier_then_expire,
    write_log,
)

from spark_analytics.options import ReaderOptions
from spark_analytics.source import CommitLogReader
from spark_analytics.tier import TierRange

pytestmark = pytest.mark.spark


def rows(spark: Any, **options: str) -> list[tuple[int, str, bytes]]:
    df = spark.read.format("commitlog").options(**options).load().select("offset", "topic", "payload")
    return sorted((r.offset, r.topic, bytes(r.payload)) for r in df.collect())


def test_tier_local_and_active_segments_read_as_one_log(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(4000, bad_every=13))
    expected = scan_all(tmp_path)
    tier_then_expire(tmp_path, convert=4, keep_local=2)  # tier: 4 segments, 2 of them also local
    reader = CommitLogReader(ReaderOptions.parse({"path": str(tmp_path), "tier": str(tmp_path / "tier"),
                                                  "partitionBytes": "20000"}))
    kinds = [type(r).__name__ for p in reader.partitions() for r in p.ranges]
    assert kinds.count("TierRange") >= 4 and "ScanRange" in kinds
    got = rows(spark, path=str(tmp_path), tier=(tmp_path / "tier").as_uri(), partitionBytes="20000")
    assert got == expected  # each record once: no loss where local segments went, no duplicate where both exist
    assert len(rows(spark, path=str(tmp_path))) < len(expected)  # without the tier, retention's deletions show


def test_push_down_over_the_tier_and_a_large_file_split_by_row_groups(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(3000, devices=5))
    expected = scan_all(tmp_path)
    tier_then_expire(tmp_path, convert=3, keep_local=0)
    tier = str(tmp_path / "tier")
    reader = CommitLogReader(ReaderOptions.parse({"path": str(tmp_path), "tier": tier, "partitionBytes": "4000"}))
    split = [r for p in reader.partitions() for r in p.ranges if isinstance(r, TierRange)]
    assert any(r.row_groups is not None for r in split)  # files larger than a partition are cut by row groups
    lo, hi = T0_MS + 300_000, T0_MS + 2_000_000
    got = rows(spark, path=str(tmp_path), tier=tier, partitionBytes="4000", topicFilter="fleet/+/telemetry",
               fromTime=str(lo), toTime=str(hi))
    by_offset = {o: i for i, (o, *_r) in enumerate(expected)}
    want = [r for r in expected if lo <= T0_MS + by_offset[r[0]] * 1000 < hi]
    assert got == want and len(want) > 1000
    assert rows(spark, path=str(tmp_path), tier=tier, topicFilter="fleet/dev1/#") == \
        [r for r in expected if r[1] == "fleet/dev1/telemetry"]


def test_telemetry_over_the_tier_matches_a_python_parse(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(2500, devices=4, bad_every=50))
    expected = scan_all(tmp_path)
    tier_then_expire(tmp_path, convert=3, keep_local=1)
    df = (spark.read.format("commitlog").options(parse="telemetry", **{"telemetry.metrics": "temp,hum"})
          .option("tier", str(tmp_path / "tier")).load(str(tmp_path)))
    got = {r.device: (r.n, r.t) for r in df.where("error is null").groupBy("device")
           .agg({"*": "count", "temp": "sum"}).withColumnRenamed("count(1)", "n")
           .withColumnRenamed("sum(temp)", "t").collect()}
    want: dict[str, list[float]] = {}
    for _offset, topic, payload in expected:
        try:
            body = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(body, dict) or isinstance(body.get("temp"), str) or not {"temp", "hum"} & set(body):
            continue
        cell = want.setdefault(topic.split("/")[1], [0, 0.0])
        cell[0] += 1
        cell[1] += body.get("temp") or 0.0
    assert {d: n for d, (n, _t) in got.items()} == {d: c[0] for d, c in want.items()}
    assert all(abs(got[d][1] - want[d][1]) < 1e-6 for d in want)


def test_a_stream_reads_tier_and_local_once_with_a_rate_limit_and_reports_the_lag(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(2000))
    tier_then_expire(tmp_path, convert=2, keep_local=1)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    stream = lambda: (spark.readStream.format("commitlog").options(tier=str(tmp_path / "tier"),  # noqa: E731
                                                                    maxRecordsPerTrigger="700")
                      .load(str(tmp_path)).select("offset", "topic"))
    progress = available_now_progress(stream(), out, checkpoint)
    batches = [p["numInputRows"] for p in progress if p["numInputRows"]]
    assert sum(batches) == 2000 and max(batches) <= 700 and len(batches) >= 3
    assert all(p["sources"][0]["latestOffset"] is not None for p in progress)  # the end of the log: the lag
    write_log(tmp_path, telemetry(700, start_ms=T0_MS + 10**7), segment_bytes=SEGMENT_BYTES)
    tier_then_expire(tmp_path, convert=1, keep_local=0)  # what the stream read before is gone locally now
    progress = available_now_progress(stream(), out, checkpoint)
    assert sum(p["numInputRows"] for p in progress) == 700  # only the new records
    got = sorted(r.offset for r in spark.read.parquet(str(out)).collect())
    assert len(got) == len(set(got)) == 2700


def test_without_the_segment_files_the_live_tail_comes_over_the_rpc(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(3000, bad_every=9))
    expected = scan_all(tmp_path)
    tier_then_expire(tmp_path, convert=3, keep_local=1)
    with store_node(tmp_path) as address:
        reader = CommitLogReader(ReaderOptions.parse({"store": address, "tier": (tmp_path / "tier").as_uri()}))
        kinds = {type(r).__name__ for p in reader.partitions() for r in p.ranges}
        assert kinds == {"TierRange", "LiveRange"}  # nothing is read from the segment files
        got = rows(spark, store=address, tier=(tmp_path / "tier").as_uri())
    assert got == expected


def test_a_stream_over_the_rpc_and_the_tier_reads_every_record_once(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(2500))
    expected = [o for o, *_ in scan_all(tmp_path)]
    tier_then_expire(tmp_path, convert=2, keep_local=0)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with store_node(tmp_path) as address:
        frame = (spark.readStream.format("commitlog")
                 .options(store=address, tier=str(tmp_path / "tier"), maxRecordsPerTrigger="1000").load()
                 .select("offset"))
        progress = available_now_progress(frame, out, checkpoint)
    assert max(p["numInputRows"] for p in progress) <= 1000
    assert sorted(r.offset for r in spark.read.parquet(str(out)).collect()) == expected
