"""The tier converter: sealed CommitLog segments to Parquet files, in the background, exactly once.

After RocketMQ 5's tiered storage: a sealed segment never changes, so it can
be copied once into a cheaper, columnar form, and the local segment can then
go when retention wants it while analytics keep reading the data. The files'
format is store/tierfiles.py; readers are docs/analytics.md.

The store node runs one :class:`TierConverter` (``open_store`` with a
``TierConfig``):

- **what**: every sealed segment whose data is published (flushed, and confirmed by the replicas of a
  replicated store: a segment with records beyond the confirm offset may not be the next leader's), oldest
  first, that the tier does not have yet. The tier's listing is the record of what is
  done: a file exists under its final name only once complete, so a restart
  resumes with the first segment that has no file (a conversion cut short
  leaves a temporary file, removed at the next start), and a segment whose file appeared since the converter
  listed the tier (another replica converted it) is adopted, not converted again;
- **one converter**: the tier is shared by a replicated store's replicas, and only the leader converts: the node
  gives the converter a predicate, checked before each segment and again before a file is published, that is
  false once the leader's lease is not valid (store/replica/leader.py): a fenced leader, even one frozen past its
  lease whose role loop has not noticed yet, starts no conversion and publishes nothing (docs/storage.md);
- **crash-safe**: written under a temporary name, then renamed; on a local
  tier the file and its directory are fsynced before and after the rename, so
  after a power loss a visible file is a complete one. Object stores
  (S3-compatible) publish an object only when its upload completes;
- **throttled**: the conversion works at most ``cpu_share`` of a core (it
  sleeps in proportion to the time it worked), so ingest is not slowed
  beyond noise; ``lightgate bench analytics`` reports the cost per record;
- **retention**: the CommitLog's retention never deletes a segment the tier
  does not hold yet (its retention guard), and the tier's own retention
  (``tier.retention_hours``) deletes tier files oldest first by their newest
  store time.

Error handling: a conversion that fails (the tier is unreachable, the disk is
full) is logged at ERROR and retried at the next check; the local segment is
kept meanwhile. A segment retention deleted before the tier existed is logged
once and skipped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import trio

from store.log.commitlog import CommitLog
from store.log.errors import OffsetExpired
from store.log.record import FLAG_BATCH, FLAG_CONTROL, FLAG_RETAIN, QOS_MASK, Record
from store.tierfiles import META_PREFIX, RECORD_SCHEMA, TEMP_PREFIX, TierMeta, file_name, list_tier, open_tier, read_meta

__all__ = ["TierConfig", "TierConverter", "TierStatistics", "run_tier"]

LOGGER = logging.getLogger(__name__)

SCAN_BYTES = 8 * 1024 * 1024
"""One CommitLog scan per chunk: big enough to amortise the read, small enough that a throttle pause comes often."""

ROW_GROUP_ROWS = 128 * 1024
"""Rows per Parquet row group: ~10-15 MiB of telemetry before compression, the size Spark and DuckDB split work by,
and fine enough for the offset and store-time statistics to skip most of a file in a narrow read."""

STATISTICS_COLUMNS = ["offset", "store_ts", "born_ts", "topic", "client_id", "qos", "retain"]
"""Columns with min/max statistics: the ones readers filter on. Payload and properties statistics would be
truncated byte strings that prune nothing."""

RECORDS_KEY = (META_PREFIX + "records").encode()

COMPRESSION_LEVEL = 3
"""zstd's default level: about snappy's speed at a clearly better ratio on JSON payloads."""


@dataclass(frozen=True)
class TierConfig:
    """Tier settings; the keys match ``tier.*`` in gateway/app/config.py. An empty ``uri`` turns the tier off."""

    uri: str = ""
    retention_hours: float = 0.0  # 0 = tier files are kept for ever
    cpu_share: float = 0.25
    check_interval_s: float = 10.0
    row_group_rows: int = ROW_GROUP_ROWS

    def __post_init__(self) -> None:
        if not 0 < self.cpu_share <= 1:
            raise ValueError(f"tier.cpu_share must be in (0, 1], not {self.cpu_share!r}")
        if self.retention_hours < 0 or self.check_interval_s <= 0 or self.row_group_rows <= 0:
            raise ValueError("tier.retention_hours must not be negative, tier.check_interval_s and the row group "
                             "size must be positive")

    @property
    def enabled(self) -> bool:
        return bool(self.uri)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> TierConfig:
        """Build from flat ``tier.*`` settings (others are ignored)."""
        return cls(**{key.partition(".")[2]: value for key, value in values.items() if key.startswith("tier.")})


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """The converter's figures: segments and records converted, the CPU seconds it spent on them."""

    segments: int
    records: int
    cpu_s: float
    tiered_bases: int
    skipped: int


def _batch(records: list[Record]) -> pa.RecordBatch:
    """The records as one batch of :data:`RECORD_SCHEMA`."""
    store = [r.store_ms * 1000 for r in records]
    return pa.RecordBatch.from_arrays([
        pa.array([r.offset for r in records], pa.int64()),
        pa.array(store, RECORD_SCHEMA.field("store_ts").type),
        pa.array([r.born_ms * 1000 for r in records], RECORD_SCHEMA.field("born_ts").type),
        pa.array([r.topic for r in records], pa.string()),
        pa.array([r.client_id for r in records], pa.string()),
        pa.array([r.flags & QOS_MASK for r in records], pa.int8()),
        pa.array([bool(r.flags & FLAG_RETAIN) for r in records], pa.bool_()),
        pa.array([r.properties for r in records], pa.binary()),
        pa.array([r.payload for r in records], pa.binary()),
    ], schema=RECORD_SCHEMA)


class TierConverter:
    """Converts the sealed segments of one CommitLog into the tier (see the module docstring).

    The conversion runs in a worker thread (:meth:`convert_pending`); :meth:`stop`
    makes it return between two chunks. Thread-safe for one converting thread
    plus the retention thread asking :meth:`may_delete`.
    """

    def __init__(self, log: CommitLog, config: TierConfig, may_convert: Callable[[], bool] = lambda: True) -> None:
        """``may_convert``: whether this node may write the tier now (a replicated leader: its lease is valid);
        called from the converting thread, before each segment and before each file is published."""
        self.log = log
        self.config = config
        self.may_convert = may_convert
        self._refused = False  # the last check refused: logged once per refusal
        self.fs, self.root = open_tier(config.uri)
        self._local = isinstance(self.fs, pafs.LocalFileSystem)
        self._stop = threading.Event()
        self._metas: dict[int, TierMeta] = {}
        self._missing_logged: set[int] = set()
        self._segments = 0
        self._records = 0
        self._cpu_s = 0.0
        self._skipped = 0

    def open(self) -> None:
        """Create the tier directory, remove leftover temporary files, and learn what the tier holds."""
        self.fs.create_dir(self.root, recursive=True)
        for info in self.fs.get_file_info(pafs.FileSelector(self.root)):
            if info.base_name.startswith(TEMP_PREFIX):
                self.fs.delete_file(info.path)
        for tier_file in list_tier(self.fs, self.root):
            meta, _parquet = read_meta(self.fs, tier_file.path)
            self._metas[tier_file.base] = meta
        self.log.set_retention_guard(self.may_delete)

    def close(self) -> None:
        self.log.set_retention_guard(None)

    def may_delete(self, base: int) -> bool:
        """The CommitLog's retention guard: a segment may go once the tier holds it."""
        return base in self._metas

    def stop(self) -> None:
        self._stop.set()

    def statistics(self) -> TierStatistics:
        return TierStatistics(self._segments, self._records, self._cpu_s, len(self._metas), self._skipped)

    def pending(self) -> list[int]:
        """Base offsets of the sealed, published segments the tier does not hold yet, oldest first."""
        published = self.log.published_offset
        return [s.base for s in self.log.segments() if s.sealed and s.end <= published and s.base not in self._metas]

    def convert_pending(self) -> int:
        """Convert every pending segment (worker thread); returns how many were converted.

        Raises:
            OSError: writing the tier failed (the segment stays pending).
        """
        self._stop.clear()
        done = 0
        for base in self.pending():
            if self._stop.is_set() or not self._allowed():
                break
            if self.convert(base):
                done += 1
        return done

    def convert(self, base: int) -> bool:
        """Convert the sealed segment at ``base``; False if the tier has it (another replica's file is adopted),
        it was deleted first, or the converter was stopped or may not convert."""
        info = next((s for s in self.log.segments() if s.base == base), None)
        if info is None or not info.sealed or base in self._metas:
            return False
        final = f"{self.root}/{file_name(base)}"
        if self.fs.get_file_info(final).type != pafs.FileType.NotFound:
            self._metas[base] = read_meta(self.fs, final)[0]
            LOGGER.info("tier: segment already in the tier (converted by another replica): adopted",
                        extra={"ctx": {"base": base}})
            return False
        temp = f"{self.root}/{TEMP_PREFIX}{file_name(base)}.{uuid.uuid4().hex}.part"
        meta = TierMeta(base, info.end, 0, info.min_store_ms, info.max_store_ms)
        try:
            records, cpu_s = self._write(temp, info.base, info.end, meta)
        except OffsetExpired:
            self._discard(temp)
            if base not in self._missing_logged:
                self._missing_logged.add(base)
                self._skipped += 1
                LOGGER.warning("tier: segment deleted by retention before it was converted",
                               extra={"ctx": {"base": base}})
            return False
        except BaseException:
            self._discard(temp)
            raise
        if records is None or not self._allowed():  # stopped, or no longer the leader: publish nothing
            self._discard(temp)
            return False
        self._publish(temp, final)
        self._metas[base] = TierMeta(base, info.end, records, info.min_store_ms, info.max_store_ms)
        self._segments += 1
        self._records += records
        self._cpu_s += cpu_s
        LOGGER.info("tier: segment converted", extra={"ctx": {
            "base": base, "records": records, "cpu_s": round(cpu_s, 3),
            "records_per_cpu_s": round(records / cpu_s) if cpu_s else None}})
        return True

    def _allowed(self) -> bool:
        """``may_convert()``, its refusal logged once until it allows again."""
        allowed = self.may_convert()
        if not allowed and not self._refused:
            LOGGER.warning("tier: not converting: this replica's leader lease is not valid (another replica may "
                           "lead and convert)")
        self._refused = not allowed
        return allowed

    def _write(self, path: str, start: int, end: int, meta: TierMeta) -> tuple[int | None, float]:
        """Write the records of ``[start, end)`` to ``path``; (records, CPU seconds), or (None, _) when stopped."""
        schema = RECORD_SCHEMA.with_metadata(meta.to_metadata(records=False))
        share = self.config.cpu_share
        records = 0
        cpu_s = 0.0
        sink = open(path, "wb") if self._local else self.fs.open_output_stream(path)
        try:
            with pq.ParquetWriter(sink, schema, compression="zstd", compression_level=COMPRESSION_LEVEL,
                                  write_statistics=STATISTICS_COLUMNS, use_dictionary=["topic", "client_id"],
                                  store_schema=True) as writer:
                pending: list[pa.RecordBatch] = []
                rows = 0
                offset = start
                while offset < end:
                    if self._stop.is_set():
                        return None, cpu_s
                    began, began_cpu = time.monotonic(), time.thread_time()
                    scanned = self.log.scan(offset, SCAN_BYTES)
                    chunk = [m for r in scanned.records if r.offset < end and not r.flags & FLAG_CONTROL
                             for m in (r.messages if r.flags & FLAG_BATCH else (r,))]  # a row per message
                    if chunk:
                        pending.append(_batch(chunk))
                        rows += len(chunk)
                        records += len(chunk)
                    if rows >= self.config.row_group_rows or scanned.next_offset >= end or not scanned.records:
                        if pending:
                            writer.write_table(pa.Table.from_batches(pending, schema),
                                               row_group_size=self.config.row_group_rows)
                        pending, rows = [], 0
                    if scanned.next_offset <= offset:
                        break
                    offset = scanned.next_offset
                    worked = time.monotonic() - began
                    cpu_s += time.thread_time() - began_cpu
                    if share < 1 and self._stop.wait(worked * (1 - share) / share):
                        return None, cpu_s
                writer.add_key_value_metadata({RECORDS_KEY: str(records).encode()})
            if self._local:
                sink.flush()
                os.fsync(sink.fileno())
        finally:
            sink.close()
        return records, cpu_s

    def _publish(self, temp: str, final: str) -> None:
        """Make a complete file visible under its final name (atomically)."""
        self.fs.move(temp, final)
        if self._local:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _discard(self, temp: str) -> None:
        try:
            self.fs.delete_file(temp)
        except (FileNotFoundError, OSError):
            pass

    def delete_expired(self, now_ms: int | None = None) -> list[int]:
        """The tier's retention: delete files whose newest store time is older than ``retention_hours``,
        oldest first (stopping at the first one kept, so the tier stays contiguous). Returns their bases."""
        hours = self.config.retention_hours
        if hours <= 0:
            return []
        cutoff = (int(time.time() * 1000) if now_ms is None else now_ms) - hours * 3_600_000
        local = {s.base for s in self.log.segments()}
        deleted = []
        for base in sorted(self._metas):
            meta = self._metas[base]
            if meta.max_store_ms is not None and meta.max_store_ms >= cutoff:
                break
            if base in local:  # the local copy is still there: the tier keeps its copy as long
                break
            self.fs.delete_file(f"{self.root}/{file_name(base)}")
            del self._metas[base]
            deleted.append(base)
        if deleted:
            LOGGER.info("tier retention deleted files", extra={"ctx": {"files": len(deleted), "oldest": deleted[0]}})
        return deleted


async def run_tier(converter: TierConverter, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Convert pending segments every ``check_interval_s`` and apply the tier's retention, until cancelled.

    Resource handling: opens the converter (in a thread) and closes it (drops the retention guard) on exit;
    a cancelled run stops the conversion in progress between two chunks and waits for it.
    """
    await trio.to_thread.run_sync(converter.open)
    task_status.started()
    idle = threading.Event()
    idle.set()

    def work() -> None:
        idle.clear()
        try:
            converter.convert_pending()
            converter.delete_expired()
        finally:
            idle.set()

    try:
        while True:
            try:
                await trio.to_thread.run_sync(work, abandon_on_cancel=True)
            except OSError as exc:
                LOGGER.error("tier conversion failed; the local segments are kept, retried in %.0f s",
                             converter.config.check_interval_s, extra={"ctx": {"error": str(exc)}})
            await trio.sleep(converter.config.check_interval_s)
    finally:
        converter.stop()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(idle.wait)
        converter.close()
