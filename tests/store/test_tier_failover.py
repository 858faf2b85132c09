"""The Parquet tier shared by a replicated store's replicas (store/tier.py): only records the replicas confirmed are
converted, a converter that may not write (a leader whose lease is not valid) converts and publishes nothing, and a
segment another converter published is adopted, never converted twice; converters racing on one segment leave one
whole file. Real CommitLogs and tier files; the replicas' byte-identical logs are copies of one directory."""

from __future__ import annotations

import itertools
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
from tests.helpers.spark_fixtures import telemetry, write_log

from store.log.commitlog import CommitLog, CommitLogConfig
from store.tier import TierConfig, TierConverter
from store.tierfiles import TEMP_PREFIX, list_tier, open_tier

SEGMENT = 64 * 1024
CONFIG = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT)


def tier_config(tmp_path: Path) -> TierConfig:
    return TierConfig(uri=str(tmp_path / "tier"), cpu_share=1.0)


def tier_bases(tmp_path: Path) -> list[int]:
    return [f.base for f in list_tier(*open_tier(str(tmp_path / "tier")))]


def test_a_segment_beyond_the_confirm_offset_waits_until_the_replicas_confirm_it(tmp_path: Path) -> None:
    """A leader's sealed, flushed segment holding records its followers do not hold yet may not be the next
    leader's: the tier converts it only once the confirm offset passes its end."""
    write_log(tmp_path, telemetry(3000))
    with CommitLog.open(tmp_path / "commitlog", CONFIG) as log:
        sealed = [s for s in log.segments() if s.sealed]
        assert len(sealed) > 3
        log.hold_confirm(sealed[1].end + 1)  # inside the third segment: the replicas hold two whole segments
        converter = TierConverter(log, tier_config(tmp_path))
        converter.open()
        assert converter.convert_pending() == 2
        assert tier_bases(tmp_path) == [sealed[0].base, sealed[1].base]
        log.confirm(log.written_offset)
        assert converter.convert_pending() == len(sealed) - 2
    assert tier_bases(tmp_path) == [s.base for s in sealed]


def test_a_converter_that_may_not_write_converts_and_publishes_nothing(tmp_path: Path) -> None:
    """``may_convert`` is false (a leader whose lease ran out): no conversion starts; one whose lease runs out while
    it writes publishes nothing and leaves no temporary file; once allowed again it converts every segment once."""
    write_log(tmp_path, telemetry(3000))
    allowed = [False]
    with CommitLog.open(tmp_path / "commitlog", CONFIG) as log:
        sealed = [s.base for s in log.segments() if s.sealed]
        converter = TierConverter(log, tier_config(tmp_path), lambda: allowed[0])
        converter.open()
        assert converter.convert_pending() == 0 and tier_bases(tmp_path) == []
        checks = itertools.chain([True], itertools.repeat(False))  # allowed when the segment starts, not after
        converter.may_convert = lambda: next(checks)
        assert converter.convert_pending() == 0
        assert tier_bases(tmp_path) == [] and list((tmp_path / "tier").iterdir()) == []
        allowed[0] = True
        converter.may_convert = lambda: allowed[0]
        assert converter.convert_pending() == len(sealed)
    assert tier_bases(tmp_path) == sealed


def test_a_segment_another_replica_converted_is_adopted_not_converted_again(tmp_path: Path) -> None:
    """Two replicas' converters over one tier (the old leader's, then the new one's, both listing the tier before
    the other wrote): the second adopts the first's files; neither writes a segment the other published."""
    write_log(tmp_path / "a", telemetry(3000))
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # a follower's copy: the same bytes, the same segments
    with CommitLog.open(tmp_path / "a" / "commitlog", CONFIG) as log_a, \
            CommitLog.open(tmp_path / "b" / "commitlog", CONFIG) as log_b:
        sealed = [s.base for s in log_a.segments() if s.sealed]
        first, second = TierConverter(log_a, tier_config(tmp_path)), TierConverter(log_b, tier_config(tmp_path))
        first.open()
        second.open()
        assert first.convert(sealed[0]) and first.convert(sealed[1])
        written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "tier").iterdir()}
        assert second.convert_pending() == len(sealed) - 2  # the first two adopted
        assert second.may_delete(sealed[0]) and second.may_delete(sealed[1])  # retention may drop them
        assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "tier").iterdir() if p.name in written} == written
        assert first.convert_pending() == 0  # and the other way round
    assert tier_bases(tmp_path) == sealed


def test_converters_racing_on_the_same_segments_leave_whole_files_only(tmp_path: Path) -> None:
    """Two converters at once over the same segments (what the lease check prevents, checked anyway): each writes
    its own temporary file and renames it, so every published file is whole and no temporary file is left."""
    write_log(tmp_path / "a", telemetry(3000))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with CommitLog.open(tmp_path / "a" / "commitlog", CONFIG) as log_a, \
            CommitLog.open(tmp_path / "b" / "commitlog", CONFIG) as log_b:
        sealed = [s for s in log_a.segments() if s.sealed]
        converters = [TierConverter(log_a, tier_config(tmp_path)), TierConverter(log_b, tier_config(tmp_path))]
        for converter in converters:
            converter.open()
        start = threading.Barrier(2)
        errors: list[BaseException] = []

        def convert(converter: TierConverter) -> None:
            try:
                start.wait()
                converter.convert_pending()
            except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)

        threads = [threading.Thread(target=convert, args=(c,)) for c in converters]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    files = list_tier(*open_tier(str(tmp_path / "tier")))
    assert [f.base for f in files] == [s.base for s in sealed]
    assert not [p for p in (tmp_path / "tier").iterdir() if p.name.startswith(TEMP_PREFIX)]
    for tier_file, segment in zip(files, sealed):
        offsets = pq.read_table(tier_file.path, columns=["offset"]).column("offset").to_pylist()
        assert offsets and offsets == sorted(offsets) and segment.base <= offsets[0] and offsets[-1] < segment.end
