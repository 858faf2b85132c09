"""Corrupt records in a segment read by the `commitlog` data source of a real local SparkSession: skipped the way
the store skips them (a bad CRC alone, broken framing up to the next valid record), every other record read once.
(The WARNING line and the count each skip gives are checked without Spark, in tests/test_spark_framing.py.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tests.helpers.spark_fixtures import encode, telemetry, write_log

from spark_analytics.layout import list_segments

pytestmark = pytest.mark.spark


def flip(path: str, position: int) -> None:
    with open(path, "r+b") as fh:
        byte = os.pread(fh.fileno(), 1, position)
        os.pwrite(fh.fileno(), bytes([byte[0] ^ 0x01]), position)


def test_a_flipped_bit_in_a_sealed_segment_costs_only_its_record(spark: Any, tmp_path: Path) -> None:
    msgs = telemetry(2500)
    offsets = write_log(tmp_path, msgs)
    seg = list_segments(tmp_path / "commitlog")[1]
    assert seg.sealed
    inside = [i for i, o in enumerate(offsets) if seg.base <= o < seg.end]
    crc, framing = inside[10], inside[len(inside) // 2]
    flip(seg.path, offsets[crc] - seg.base + len(encode(msgs[crc])) - 3)  # a payload bit: the CRC fails
    flip(seg.path, offsets[framing] - seg.base + 2)  # a length bit: the walk cannot step over it
    df = spark.read.format("commitlog").option("partitionBytes", "20000").load(str(tmp_path))
    assert df.rdd.getNumPartitions() > len(list_segments(tmp_path / "commitlog"))  # segments cut into ranges
    got = df.orderBy("offset").collect()
    assert [r.offset for r in got] == [o for i, o in enumerate(offsets) if i not in (crc, framing)]
    assert [r.payload for r in got] == [m.payload for i, m in enumerate(msgs) if i not in (crc, framing)]
