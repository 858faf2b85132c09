"""Partition planning and the directory view it uses (spark_analytics.planning, .layout), without Spark."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from crc32c import crc32c
from tests.helpers.spark_fixtures import telemetry, write_log

from spark_analytics.framing import DecodeOptions, scan_range
from spark_analytics.layout import SegmentInfo, commitlog_dir, list_segments, read_flushed
from spark_analytics.planning import plan_ranges, readable_limit

MiB = 1 << 20


def seg(base: int, size: int, end: int | None = None, lo: int | None = None, hi: int | None = None) -> SegmentInfo:
    return SegmentInfo(base, f"/x/{base:020d}", size, end, None, lo, hi)


def test_large_segments_are_split_and_small_ones_packed() -> None:
    segments = [seg(0, 256 * MiB, 256 * MiB - 10), seg(256 * MiB, 8 * MiB, 256 * MiB + 8 * MiB),
                seg(264 * MiB, 8 * MiB, 272 * MiB), seg(272 * MiB, 8 * MiB)]
    parts = plan_ranges(segments, 272 * MiB + 5 * MiB, target_bytes=64 * MiB)
    assert [len(p) for p in parts] == [1, 1, 1, 1, 3]
    first = [p[0] for p in parts[:4]]
    assert [(r.start, r.end) for r in first][0] == (0, first[0].end) and first[-1].end == 256 * MiB - 10
    assert all(r.anchor == 0 and r.strict and r.limit == 256 * MiB - 10 for r in first)
    assert all(abs(r.nbytes - 64 * MiB) < 64 for r in first)
    packed = parts[4]
    assert [r.base for r in packed] == [256 * MiB, 264 * MiB, 272 * MiB]
    assert packed[-1].limit == 5 * MiB  # the flushed hint cuts the active segment


def test_readable_limit_rules() -> None:
    assert readable_limit(seg(0, 100), None) == (100, False)  # no hint, not sealed: read to the first bad record
    assert readable_limit(seg(0, 100, 90), None) == (90, True)
    assert readable_limit(seg(100, 100), 150) == (50, True)
    assert readable_limit(seg(100, 100), 50) == (0, True)


def test_time_bounds_skip_sealed_segments_only() -> None:
    segments = [seg(0, 10, 10, 1_000, 1_999), seg(10, 10, 20, 2_000, 2_999), seg(20, 10)]
    bases = lambda parts: [r.base for p in parts for r in p]  # noqa: E731
    assert bases(plan_ranges(segments, None, from_ms=2_500)) == [10, 20]
    assert bases(plan_ranges(segments, None, to_ms=2_000)) == [0, 20]
    assert bases(plan_ranges(segments, None, from_ms=1_500, to_ms=1_600)) == [0, 20]


def test_stream_ranges_start_at_the_offset_and_never_pass_the_end() -> None:
    segments = [seg(0, 1000, 990), seg(1000, 1000, 1995), seg(2000, 1000)]
    parts = plan_ranges(segments, None, start=1500, end=2300, target_bytes=1 << 20)
    (a, b), = parts
    assert (a.base, a.anchor, a.start, a.end, a.limit) == (1000, 500, 500, 995, 995)
    assert (b.base, b.anchor, b.start, b.end, b.limit, b.strict) == (2000, 0, 0, 300, 300, True)
    assert plan_ranges(segments, None, start=2300, end=2300) == []
    with pytest.raises(ValueError):
        plan_ranges(segments, None, target_bytes=0)


def test_planned_partitions_of_a_real_log_read_every_record_once(tmp_path: Path) -> None:
    offsets = write_log(tmp_path, telemetry(3000), segment_bytes=128 * 1024)
    directory = tmp_path / "commitlog"
    segments = list_segments(directory)
    assert len(segments) >= 3 and all(s.sealed for s in segments[:-1])
    for target in (10_000, 50_000, 300_000):
        seen = [o for part in plan_ranges(segments, read_flushed(directory), target_bytes=target)
                for rng in part for f in scan_range(rng, DecodeOptions()) for o in f.offset.tolist()]
        assert seen == offsets


def test_layout_reads_meta_and_the_flushed_hint(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(3000), segment_bytes=128 * 1024)
    assert commitlog_dir(tmp_path) == tmp_path / "commitlog" == commitlog_dir(tmp_path / "commitlog")
    with pytest.raises(FileNotFoundError):
        commitlog_dir(tmp_path / "nothing")
    directory = tmp_path / "commitlog"
    first = list_segments(directory)[0]
    meta = json.loads((directory / f"{first.base:020d}.meta").read_text())
    assert (first.end, first.records, first.min_store_ms, first.max_store_ms) == (
        meta["end"], meta["records"], meta["min_store_ms"], meta["max_store_ms"])
    (directory / f"{first.base:020d}.meta").write_text("{broken")
    assert not list_segments(directory)[0].sealed  # a bad .meta only costs the time skip
    flushed = read_flushed(directory)
    assert flushed is not None and flushed > 0
    (directory / "flushed").write_bytes(struct.pack(">QI", 77, crc32c(struct.pack(">Q", 77))))
    assert read_flushed(directory) == 77
    (directory / "flushed").write_bytes(struct.pack(">QI", 77, 0))
    assert read_flushed(directory) is None
