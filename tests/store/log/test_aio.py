"""store/log/aio.py: the trio wrapper's group commit, async flush policy, reads and background retention."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import trio

from store.log.aio import AsyncCommitLog
from store.log.commitlog import CommitLog, CommitLogConfig, read_flushed_hint
from store.log.errors import OffsetExpired
from store.log.record import encode_record

SEG = 16384


def rec(i: int, size: int = 100) -> bytes:
    tag = f"{i}:".encode()
    return encode_record("t/x", tag + b"p" * (size - 46 - len(tag)))


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition (polling), failing the test after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def test_sync_appends_are_durable_when_they_return_and_share_fsyncs(tmp_path):
    writers, per_writer = 64, 10
    cfg = CommitLogConfig(segment_bytes=SEG, max_record_bytes=SEG, flush="sync")
    async with AsyncCommitLog.open(tmp_path, cfg) as alog:
        async def writer(w: int) -> None:
            for i in range(per_writer):
                record = rec(w * 1000 + i)
                [offset] = await alog.append_batch([record])
                assert alog.log.flushed_offset >= offset + len(record)
                assert read_flushed_hint(tmp_path) >= offset + len(record)

        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w)
        stats = alog.log.statistics()
        assert stats.appended_records == writers * per_writer
        assert stats.flushes <= writers * per_writer // 8  # one fsync covered many appends


async def test_durable_false_in_sync_mode_does_not_wait(tmp_path):
    cfg = CommitLogConfig(flush="sync", flush_interval_ms=60_000)
    async with AsyncCommitLog.open(tmp_path, cfg) as alog:
        [offset] = await alog.append_batch([rec(0)], durable=False)
        assert alog.log.flushed_offset == 0 < alog.log.written_offset
        await alog.append_batch([rec(1)], durable=True)
        assert alog.log.flushed_offset == alog.log.written_offset


async def test_async_policy_flushes_once_enough_is_dirty(tmp_path):
    cfg = CommitLogConfig(flush="async", flush_interval_ms=20, flush_min_bytes=1000, flush_force_interval_ms=600_000)
    async with AsyncCommitLog.open(tmp_path, cfg) as alog:
        await alog.append_batch([rec(i) for i in range(12)])
        assert alog.log.flushed_offset == 0
        await until(lambda: alog.log.flushed_offset == 1200)


async def test_async_policy_flushes_a_little_dirt_only_at_the_force_interval(tmp_path):
    cfg = CommitLogConfig(flush="async", flush_interval_ms=10, flush_min_bytes=10_000, flush_force_interval_ms=300)
    async with AsyncCommitLog.open(tmp_path, cfg) as alog:
        await trio.to_thread.run_sync(alog.log.flush)  # the force interval counts from the flusher's start
        start = trio.current_time()
        await alog.append_batch([rec(0)])
        await until(lambda: alog.log.flushed_offset == 100)
        assert trio.current_time() - start >= 0.25  # not at the 10 ms checks: below flush_min_bytes


async def test_durable_true_in_async_mode_waits_for_a_group_commit(tmp_path):
    cfg = CommitLogConfig(flush="async", flush_interval_ms=60_000)
    async with AsyncCommitLog.open(tmp_path, cfg) as alog:
        await alog.append_batch([rec(0)])
        assert alog.log.flushed_offset == 0
        offset = await alog.append(rec(1), durable=True)
        assert alog.log.flushed_offset >= offset + 100


async def test_reads_and_scans_off_the_loop(tmp_path):
    async with AsyncCommitLog.open(tmp_path, CommitLogConfig(segment_bytes=SEG, max_record_bytes=SEG)) as alog:
        records = [rec(i) for i in range(300)]
        offsets = await alog.append_batch(records)
        assert (await alog.read(offsets[7])).payload.startswith(b"7:")
        assert await alog.read_bytes(offsets[8], 100) == records[8]
        seen, offset = [], 0
        while offset < alog.log.written_offset:
            result = await alog.scan(offset, 1000)
            seen.extend(r.offset for r in result.records)
            offset = result.next_offset
        assert seen == offsets
        assert await alog.flush() == alog.log.written_offset


async def test_retention_runs_in_the_background(tmp_path):
    cfg = CommitLogConfig(segment_bytes=4096, max_record_bytes=4096, retention_max_bytes=8192,
                          retention_check_interval_s=0.01)
    async with AsyncCommitLog.open(tmp_path, cfg) as alog:
        expired: list[int] = []
        alog.log.add_retention_listener(expired.append)
        await alog.append_batch([rec(i, 1000) for i in range(20)])
        await until(lambda: alog.log.min_offset > 0)
        assert alog.log.written_offset - alog.log.min_offset <= 8192
        with pytest.raises(OffsetExpired, match="expired"):
            await alog.read(0)
        await until(lambda: bool(expired))


async def test_open_closes_and_flushes_on_exit(tmp_path):
    async with AsyncCommitLog.open(tmp_path, CommitLogConfig(flush_interval_ms=60_000)) as alog:
        await alog.append_batch([rec(0), rec(1)])
        log = alog.log
    assert log.closed
    assert read_flushed_hint(tmp_path) == 200


async def test_an_error_in_the_body_comes_out_unwrapped_and_the_log_is_closed(tmp_path):
    with pytest.raises(KeyError, match="boom"):
        async with AsyncCommitLog.open(tmp_path, CommitLogConfig(flush_interval_ms=60_000)) as alog:
            await alog.append_batch([rec(0)])
            raise KeyError("boom")
    assert alog.log.closed
    assert read_flushed_hint(tmp_path) == 100


async def test_run_in_a_callers_nursery(tmp_path):
    with CommitLog.open(Path(tmp_path), CommitLogConfig(flush="sync")) as log:
        alog = AsyncCommitLog(log)
        async with trio.open_nursery() as nursery:
            await nursery.start(alog.run)
            await alog.append_batch([rec(0)])
            assert log.flushed_offset == 100
            nursery.cancel_scope.cancel()
