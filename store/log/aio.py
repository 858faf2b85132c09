"""The trio face of the CommitLog: appends on the loop, fsyncs and large reads in threads.

Appends are a copy into the page cache, fast enough to run on the event loop.
Everything that can block for milliseconds (fsync, recovery, large reads,
retention) runs in ``trio.to_thread``. One background flusher task implements
both flush policies:

- ``sync`` (group commit): a durable append waits until ``flushed_offset``
  covers it. The flusher gathers waiters for one scheduler round at a time
  (at most ``sync_interval_ms``), then runs one ``flush()`` for all of them;
  writers arriving during that fsync are covered by the next one.
- ``async``: every ``flush_interval_ms`` the flusher flushes if at least
  ``flush_min_bytes`` are dirty, and flushes whatever is dirty every
  ``flush_force_interval_ms``. A ``durable=True`` append still waits for a
  group commit.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Sequence, final

import trio

from store.log.commitlog import SCAN_BYTES, CommitLog, CommitLogConfig, ScanResult
from store.log.record import Record
from store.tasks import background

__all__ = ["AsyncCommitLog", "LatencyBuckets"]

LOGGER = logging.getLogger(__name__)

FLUSH_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds of the flush-time buckets: an fsync takes well under a millisecond on an idle SSD and
seconds on a saturated disk; page-cache back-pressure starts at ~1 s, so the range must reach past it."""


@final
class LatencyBuckets:
    """A fixed-bucket histogram of durations in plain ints, cheap enough for a hot path; read at scrape time.

    ``counts[i]`` counts observations ``<= bounds[i]`` (and above the bound
    before it); the last count is for observations above every bound.
    Prometheus histograms are built from it when metrics are scraped.
    """

    __slots__ = ("bounds", "counts", "sum_s")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float, count: int = 1) -> None:
        """Count ``count`` observations of ``seconds``."""
        self.counts[bisect_left(self.bounds, seconds)] += count
        self.sum_s += seconds * count


class _Round:
    """One flush: waiters wait on ``done`` and then look at ``error``."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class AsyncCommitLog:
    """Wraps a :class:`CommitLog` for trio.

    Use ``async with AsyncCommitLog.open(path, config) as log:``, or build one
    around an open CommitLog and ``await nursery.start(alog.run)``.

    Resource handling: ``open`` owns the CommitLog and closes it (flushing) on
    exit; with ``AsyncCommitLog(log)`` the caller keeps ownership of ``log``.
    """

    def __init__(self, log: CommitLog) -> None:
        self.log = log
        self._config = log.config
        self._round = _Round()
        self._wakeup = trio.Event()
        self._waiting = 0
        self._arrivals = 0  # only grows: gathering watches it, as writers leaving and re-joining cancel out in _waiting
        self.flush_latency = LatencyBuckets(FLUSH_BUCKETS_S)  # seconds per successful flush() (fsync)

    @classmethod
    @asynccontextmanager
    async def open(cls, directory: Path, config: CommitLogConfig | None = None) -> AsyncIterator[AsyncCommitLog]:
        """Open (and recover, in a thread) the log, run its background tasks, close it on exit.

        Error handling: the background tasks log their I/O errors instead of
        raising, so an exception from the ``async with`` body comes out as
        itself, not wrapped in an exception group.
        """
        log = await trio.to_thread.run_sync(CommitLog.open, directory, config)
        try:
            alog = cls(log)
            async with background(alog.run):
                yield alog
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(log.close)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the flusher and the retention loop until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._flusher)
            nursery.start_soon(self._retention)
            task_status.started()

    # ------------------------------------------------------------------ appends

    async def append_batch(self, records: Sequence[bytes], *, durable: bool | None = None) -> list[int]:
        """Append encoded records; with ``durable`` (default: iff the policy is sync) wait until they are on disk.

        Raises:
            The exceptions of :meth:`CommitLog.append_batch`; and, when durable,
            OSError if the fsync covering the records failed.
        """
        offsets = self.log.append_batch(records)
        if durable is None:
            durable = self._config.flush == "sync"
        if durable and offsets:
            await self.wait_flushed(offsets[-1] + len(records[-1]))
        else:
            await trio.lowlevel.checkpoint()
        return offsets

    async def append(self, record: bytes, *, durable: bool | None = None) -> int:
        return (await self.append_batch((record,), durable=durable))[0]

    async def wait_flushed(self, offset: int) -> None:
        """Return once everything below ``offset`` is durable (joins the next group commit).

        Raises:
            OSError: the flush that should have covered ``offset`` failed.
        """
        if self.log.flushed_offset >= offset:
            await trio.lowlevel.checkpoint()
            return
        while self.log.flushed_offset < offset:
            current = self._round
            self._waiting += 1
            self._arrivals += 1
            self._wakeup.set()
            try:
                await current.done.wait()
            finally:
                self._waiting -= 1
            if current.error is not None and self.log.flushed_offset < offset:
                raise OSError(f"the flush covering offset {offset} failed: {current.error}") from current.error

    async def flush(self) -> int:
        """Flush now (in a thread); returns the flushed offset."""
        return await trio.to_thread.run_sync(self.log.flush)

    # ------------------------------------------------------------------ reads

    async def read(self, offset: int) -> Record:
        return await trio.to_thread.run_sync(self.log.read, offset)

    async def read_bytes(self, offset: int, size: int) -> bytes:
        return await trio.to_thread.run_sync(self.log.read_bytes, offset, size)

    async def scan(self, from_offset: int, max_bytes: int = SCAN_BYTES) -> ScanResult:
        return await trio.to_thread.run_sync(self.log.scan, from_offset, max_bytes)

    # ------------------------------------------------------------------ background

    async def _flusher(self) -> None:
        cfg = self._config
        log = self.log
        interval = cfg.flush_interval_ms / 1000
        force = cfg.flush_force_interval_ms / 1000
        last = trio.current_time()
        while True:
            with trio.move_on_after(interval):
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            if self._waiting:
                await self._gather()
            else:
                dirty = log.written_offset - log.flushed_offset
                if not (dirty >= cfg.flush_min_bytes or (dirty > 0 and trio.current_time() - last >= force)):
                    continue
            await self._flush_round()
            last = trio.current_time()

    async def _gather(self) -> None:
        """Let every runnable writer append and queue up before the fsync, for at most sync_interval_ms."""
        deadline = trio.current_time() + self._config.sync_interval_ms / 1000
        seen = -1
        while self._arrivals != seen and trio.current_time() < deadline:
            seen = self._arrivals
            await trio.lowlevel.checkpoint()

    async def _flush_round(self) -> None:
        current, self._round = self._round, _Round()
        started = time.perf_counter()
        try:
            await trio.to_thread.run_sync(self.log.flush)
            self.flush_latency.observe(time.perf_counter() - started)
        except (OSError, ValueError) as exc:
            current.error = exc
            LOGGER.error("CommitLog flush failed", extra={"ctx": {"error": str(exc)}})
        finally:
            current.done.set()

    async def _retention(self) -> None:
        """Run retention now and then every ``retention_check_interval_s`` (0 disables it)."""
        interval = self._config.retention_check_interval_s
        if interval <= 0:
            return
        while True:
            try:
                await trio.to_thread.run_sync(self.log.delete_expired)
            except OSError as exc:
                LOGGER.error("CommitLog retention failed", extra={"ctx": {"error": str(exc)}})
            await trio.sleep(interval)
