"""The CommitLog: an append-only queue of fixed-size segment files holding every message once.

A record's address is its global byte offset. One writer appends batches under
a lock (one ``pwrite`` per segment a batch touches); any number of threads read
concurrently. ``written_offset`` only moves after a batch is completely in the
file, so readers never see part of a record. Durability is separate:
``flush()`` fsyncs and moves ``flushed_offset``; the flush *policy* (async timer
or sync group commit) lives in ``store.log.aio``, which calls ``flush()``.

Directory layout (``docs/storage.md`` has the details)::

    <dir>/00000000000000000000        segment files, named by base offset
    <dir>/00000000000268435456.meta   JSON summary of a sealed, fsynced segment
    <dir>/flushed                     hint: u64 published offset + CRC32C, for out-of-process readers
    <dir>/epochs                      leader epochs and their start offsets (store.log.epochs)
    <dir>/lock                        flock held while a CommitLog has the directory open

Recovery on open walks every segment from the first one without a valid
``.meta`` (normally only the active one) record by record, checking lengths and
CRCs. The log is a clean prefix: the first bad or torn record ends it, and
everything after it is zeroed, later segments included.

Replication adds three things: :meth:`CommitLog.append_frames` writes bytes copied
from a leader's log at the same offsets, :meth:`CommitLog.truncate` cuts the log
at a record boundary, and the confirm offset (:meth:`CommitLog.confirm`) bounds
what readers may see to the records the replicas hold. Without replicas it
follows ``written_offset`` and costs nothing.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import json
import logging
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from crc32c import crc32c

from store.log.epochs import EpochFile
from store.log.errors import (FULL_ERRNOS, CorruptRecord, InvalidOffset, LogFullError, OffsetExpired, RecordTooLarge,
                              RetentionDeferred)
from store.log.record import (EOS_SIZE, HEADER_SIZE, MAGIC_EOS, MAGIC_V1, PEEK, STORE_MS, STORE_MS_AT, Record, check_frame,
                              decode_record, encode_eos)
from store.log.segment import Segment, SegmentRetired, parse_segment_name, segment_name

__all__ = [
    "CommitLog",
    "CommitLogConfig",
    "CommitLogStatistics",
    "CorruptRange",
    "ScanResult",
    "SegmentInfo",
    "read_flushed_hint",
]

LOGGER = logging.getLogger(__name__)

MiB = 1024 * 1024

READ_GAP = 16 * 1024
"""read_many reads across gaps up to this size (other queues' records) rather than making another pread."""
READ_SPAN = 4 * MiB
"""read_many's largest single read."""

SCAN_BYTES = 4 * MiB
"""Default scan size: large enough to amortise the pread, small enough to keep a batch's latency low."""

WALK_CHUNK = 8 * MiB
"""Recovery reads segments in chunks this big: few syscalls, bounded memory."""

READ_GUESS = 4096
"""``read(offset)`` first reads this much: most records fit, so one pread usually suffices."""

MAX_KNOWN_CORRUPT = 65_536
"""Corrupt records remembered by offset, so that each is logged and counted once however often it is read."""

MAGIC_PREFIX = MAGIC_V1.to_bytes(4, "big")[:2]
""""LG": both magics start with it; a resync after corrupt bytes looks for it (store.log.record's layout)."""

SKIPPED = b""
"""What ``read_many`` returns for a corrupt record (never a valid record: those are at least 43 bytes)."""

MIN_SEGMENT_BYTES = 4096
"""Smaller segments would be all overhead; tests use a few KiB."""

HINT_FILE = "flushed"
"""Spark and other out-of-process readers look for this name (docs/storage.md)."""

LOCK_FILE = "lock"
"""flock()ed while open: two writers on one directory would destroy each other's records."""

META_SUFFIX = ".meta"
"""``<base>.meta`` sorts next to its segment and never parses as a segment name."""

META_VERSION = 1
"""Bumped when the .meta fields change; an unknown version is rebuilt from the segment."""

BATCH_COMPRESSIONS = ("off", "zstd")
"""``commitlog.batch_compression``: batch record bodies stay raw, or go as zstd frames when that saves space
(store/log/record.py, ``FLAG_ZSTD``). Single records are never compressed."""
BATCH_COMPRESSION = "zstd"
"""The default: batched telemetry JSON takes a fifth to a fourteenth of the log bytes for at most ~2.5 us of CPU
per message to compress and ~1 us to inflate; incompressible bodies stay raw (docs/storage.md, "Compressed batch
bodies", has the measurements)."""

_HINT = struct.Struct(">QI")  # flushed offset, CRC32C of its 8 bytes
_MAGIC = struct.Struct(">I")  # a frame's magic, 8 bytes into it
_U64 = struct.Struct(">Q")


@dataclass(frozen=True)
class CommitLogConfig:
    """CommitLog settings; the keys match ``commitlog.*`` and ``retention.*`` in gateway/app/config.py."""

    segment_bytes: int = 256 * MiB
    max_record_bytes: int = 1 * MiB
    flush: str = "async"
    flush_interval_ms: int = 500
    flush_min_bytes: int = 16384
    flush_force_interval_ms: int = 10_000
    sync_interval_ms: int = 10
    batch_compression: str = BATCH_COMPRESSION
    retention_hours: float = 72.0  # 0 = no age limit
    retention_max_bytes: int = 0  # 0 = no size limit
    retention_check_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.flush not in ("async", "sync"):
            raise ValueError(f"flush policy must be 'async' or 'sync', not {self.flush!r}")
        if self.batch_compression not in BATCH_COMPRESSIONS:
            raise ValueError(f"batch_compression must be 'off' or 'zstd', not {self.batch_compression!r}")
        if self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be at least {MIN_SEGMENT_BYTES}, not {self.segment_bytes}")
        if not HEADER_SIZE <= self.max_record_bytes <= self.segment_bytes:
            raise ValueError(
                f"max_record_bytes must be between {HEADER_SIZE} and segment_bytes ({self.segment_bytes}),"
                f" not {self.max_record_bytes}: a record must fit in one segment"
            )
        for name in ("flush_interval_ms", "flush_min_bytes", "flush_force_interval_ms", "sync_interval_ms",
                     "retention_hours", "retention_max_bytes", "retention_check_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, not {getattr(self, name)!r}")

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> CommitLogConfig:
        """Build from flat ``section.name`` settings (``commitlog.*``, ``retention.*``); others are ignored."""
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            section, _, name = key.partition(".")
            if section == "commitlog":
                kwargs[name] = value
            elif section == "retention":
                kwargs["retention_" + name] = value
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class CorruptRange:
    """Bytes a scan skipped because they are not a valid record; never served as data."""

    offset: int
    end: int
    reason: str


@dataclass(frozen=True, slots=True)
class ScanResult:
    records: list[Record]
    next_offset: int
    corrupt: tuple[CorruptRange, ...] = ()


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What tools and the Spark planner need to know about one segment."""

    base: int
    path: Path
    sealed: bool
    used: int  # bytes of records (excluding the end-of-segment marker)
    end: int  # global offset after the last record
    records: int
    min_store_ms: int | None
    max_store_ms: int | None


@dataclass(frozen=True, slots=True)
class CommitLogStatistics:
    written_offset: int
    flushed_offset: int
    min_offset: int
    segments: int
    appended_records: int
    appended_batches: int
    flushes: int  # flush() calls that synced something
    corrupt_records: int = 0  # corrupt records (or byte ranges) found and skipped since open, each counted once


@dataclass(slots=True)
class _Stats:
    """Per-segment record count and store-time bounds, for the .meta file and retention."""

    records: int = 0
    min_ms: int | None = None
    max_ms: int | None = None
    meta_written: bool = False

    def add(self, records: int, lo: int, hi: int) -> None:
        self.records += records
        self.min_ms = lo if self.min_ms is None else min(self.min_ms, lo)
        self.max_ms = hi if self.max_ms is None else max(self.max_ms, hi)


@dataclass(frozen=True, slots=True)
class _View:
    """The published segment list; replaced whole, so readers take a consistent snapshot."""

    bases: list[int]
    segments: list[Segment]

    @classmethod
    def of(cls, segments: list[Segment]) -> _View:
        return cls([s.base for s in segments], segments)

    def find(self, offset: int) -> Segment:
        return self.segments[bisect.bisect_right(self.bases, offset) - 1]


@dataclass(slots=True)
class _Walk:
    """How a recovery walk of one segment ended."""

    end: int  # position after the last valid record
    stop: str  # "eos", "full", "short tail", "zeros" or the reason the record at ``end`` is bad
    stats: _Stats = field(default_factory=_Stats)
    skipped: list[CorruptRange] = field(default_factory=list)  # corrupt bytes below the flushed mark, stepped over

    @property
    def clean_seal(self) -> bool:
        return self.stop in ("eos", "full", "short tail")

    @property
    def bad(self) -> bool:
        return self.stop not in ("eos", "full", "short tail", "zeros")


class CommitLog:
    """The append-only log of encoded records over a directory of segment files.

    Concurrency: appends are serialised by one lock (held only for the copy into
    the file); ``flush`` can run in another thread while appends continue;
    ``read``/``read_bytes``/``scan`` run in any thread without the lock.

    Resource handling: the CommitLog owns its segment files, the hint file and
    the directory lock; :meth:`close` (or leaving a ``with`` block) flushes and
    releases them.
    """

    def __init__(self, directory: Path, config: CommitLogConfig, lock_fd: int, hint_fd: int, dir_fd: int) -> None:
        """Use :meth:`open`; this only sets up empty state around the already opened descriptors."""
        self._dir = directory
        self._config = config
        self._lock_fd = lock_fd
        self._hint_fd = hint_fd
        self._dir_fd = dir_fd
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._view = _View([], [])
        self._stats: dict[int, _Stats] = {}
        self._written = 0
        self._flushed = 0
        self._held: int | None = None  # the confirm offset while replicas confirm; None: it follows _written
        self._confirmed = threading.Condition(threading.Lock())  # notified when the confirm offset moves
        self.epochs = EpochFile(directory / "epochs", [])
        self._dir_dirty = False
        self._fsync_error: OSError | None = None
        self._closed = False
        self._released = False
        self._listeners: list[Callable[[int], None]] = []
        self._preludes: list[Callable[[int], None]] = []
        self._retention_guard: Callable[[int], bool] | None = None
        self._guards: list[Callable[[int, int], bool]] = []
        self._appended_records = 0
        self._appended_batches = 0
        self._flushes = 0
        self._corrupt: dict[int, None] = {}  # offsets of the corrupt records reported (bounded: MAX_KNOWN_CORRUPT)
        self._corrupt_lock = threading.Lock()
        self._corrupt_records = 0

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, directory: Path, config: CommitLogConfig | None = None) -> CommitLog:
        """Open (creating if missing) the log in ``directory`` and recover it.

        Raises:
            OSError: the directory is locked by another open CommitLog, or I/O failed.
            ValueError: the segment files are inconsistent (overlapping sizes).
        """
        config = config or CommitLogConfig()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        fds: list[int] = []
        try:
            fds.append(os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
            try:
                fcntl.flock(fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OSError(errno.EBUSY, f"CommitLog {directory} is already open"
                                           f" (its {LOCK_FILE} file is locked)") from None
            fds.append(os.open(directory / HINT_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
            fds.append(os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        log = cls(directory, config, *fds)
        try:
            log._load()
        except BaseException:
            log._release()
            raise
        return log

    def _load(self) -> None:
        for leftover in self._dir.glob("*.tmp"):
            leftover.unlink()
        self.epochs = EpochFile.open(self._dir)
        bases = sorted(b for b in (parse_segment_name(p.name) for p in self._dir.iterdir()) if b is not None)
        if not bases:
            self._view = _View.of([Segment.create(self._dir, 0, self._config.segment_bytes)])
            self._stats[0] = _Stats()
            self._fsync_dir()
            self._write_hint(0)
            return
        segments = [self._open_segment(bases, i) for i in range(len(bases))]
        self._view = _View.of(segments)
        self._recover(read_flushed_hint(self._dir))
        self._written = self._flushed = self._view.segments[-1].base + self._view.segments[-1].write_pos
        self._write_hint(self._flushed)
        self.epochs.truncate_from(self._written + 1)  # epochs of records the recovery dropped

    def _open_segment(self, bases: list[int], i: int) -> Segment:
        path = self._dir / segment_name(bases[i])
        if i + 1 < len(bases):
            size = bases[i + 1] - bases[i]
            actual = path.stat().st_size
            if actual > size:
                raise ValueError(f"segment {path.name} has {actual} bytes but the next segment starts {size} bytes"
                                 " after it: the directory is inconsistent")
        else:
            size = max(path.stat().st_size, self._config.segment_bytes)
        return Segment.open(path, size)

    def _recover(self, hint: int | None) -> None:
        """Trust sealed segments with a valid .meta; walk the rest and cut the log at the first bad record."""
        segments = self._view.segments
        last = len(segments) - 1
        first_walk = last
        for i, seg in enumerate(segments[:-1]):
            meta = self._read_meta(seg)
            if meta is None:
                first_walk = i
                break
            seg.write_pos = seg.flushed_pos = meta["end"] - seg.base
            seg.sealed = True
            self._stats[seg.base] = _Stats(meta["records"], meta["min_store_ms"], meta["max_store_ms"], True)
        for i in range(first_walk, last + 1):
            seg = segments[i]
            walk = _walk(seg, 0 if hint is None else hint - seg.base)
            for bad in walk.skipped:
                self._report_corrupt(seg, bad.offset, bad.end, bad.reason)
            seg.write_pos = walk.end
            self._stats[seg.base] = walk.stats
            cut = walk.bad or (i < last and not walk.clean_seal)
            garbage_end = seg.dirty_end(walk.end) if walk.stop == "zeros" else walk.end
            if cut or garbage_end > walk.end:
                self._cut(i, walk, hint)
                break
            if walk.clean_seal and (i < last or walk.stop == "eos"):
                seg.sealed = True
        for seg in self._view.segments[first_walk:]:
            seg.sync()
        if self._view.segments[-1].sealed:
            successor = self._create_next(self._view.segments[-1])
            self._stats[successor.base] = _Stats()
            self._view = _View.of(self._view.segments + [successor])
        self._fsync_dir()
        for seg in self._view.segments[first_walk:-1]:
            self._write_meta(seg)

    def _cut(self, i: int, walk: _Walk, hint: int | None) -> None:
        """Zero segment ``i`` from the end of its valid records and delete every later segment."""
        segments = self._view.segments
        seg = segments[i]
        cut_at = seg.base + walk.end
        dropped = seg.dirty_end(walk.end) - walk.end
        for later in segments[i + 1:]:
            dropped += later.dirty_end(0)
        if walk.bad:
            reason = walk.stop
        elif i < len(segments) - 1:
            reason = "a sealed segment ends without an end-of-segment marker"
        else:
            reason = "non-zero bytes after the last record"
        durable = hint is not None and cut_at < hint
        LOGGER.log(
            logging.ERROR if durable else logging.WARNING,
            "CommitLog recovery dropped a %s tail", "corrupt DURABLE" if durable else "torn or corrupt",
            extra={"ctx": {"offset": cut_at, "dropped_bytes": dropped, "reason": reason,
                           "segments_deleted": len(segments) - i - 1, "flushed_hint": hint}},
        )
        seg.truncate(walk.end)
        for later in segments[i + 1:]:
            later.close()
            later.path.unlink()
            self._meta_path(later).unlink(missing_ok=True)
            self._stats.pop(later.base, None)
        self._meta_path(seg).unlink(missing_ok=True)
        self._view = _View.of(segments[: i + 1])

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def config(self) -> CommitLogConfig:
        return self._config

    @property
    def written_offset(self) -> int:
        """End of the last complete record: everything below it can be read."""
        return self._written

    @property
    def flushed_offset(self) -> int:
        """Everything below this offset is on disk (fsynced)."""
        return self._flushed

    @property
    def confirm_offset(self) -> int:
        """Every record below this offset is confirmed: the replicas hold it (``written_offset`` without
        replicas). Dispatch indexes no record at or past it and readers are served none."""
        held = self._held
        return self._written if held is None else held

    @property
    def published_offset(self) -> int:
        """What out-of-process readers may read (the ``flushed`` hint, ``read_span``): flushed and confirmed."""
        return min(self._flushed, self.confirm_offset)

    def hold_confirm(self, offset: int | None = None) -> None:
        """Replicas follow this log from now on: the confirm offset stays at ``offset`` (a record boundary; default:
        the written end; never past it) until :meth:`confirm` moves it (a no-op when it is held already). A replica
        reopening its log holds it where it knew the group had confirmed, so what only it has is not served."""
        with self._lock:
            if self._held is None:
                self._held = self._written if offset is None else max(0, min(offset, self._written))

    def release_confirm(self) -> None:
        """No replica follows any more: the confirm offset follows ``written_offset`` again."""
        with self._lock:
            self._held = None
        self._write_hint(self.published_offset)
        with self._confirmed:
            self._confirmed.notify_all()

    def confirm(self, offset: int) -> None:
        """The replicas hold every record below ``offset`` (a record boundary: the end of a batch they
        acknowledged). A no-op while the confirm offset follows ``written_offset``. The caller then wakes
        dispatch (``Dispatcher.wake``), which indexes up to it.

        Raises:
            ValueError: ``offset`` is beyond ``written_offset`` or below the current confirm offset (only
                :meth:`truncate` moves it back).
        """
        with self._lock:
            if offset > self._written:
                raise ValueError(f"cannot confirm offset {offset}: beyond the written end of the log ({self._written})")
            if self._held is None:
                return
            if offset < self._held:
                raise ValueError(f"cannot confirm offset {offset}: the log is confirmed up to {self._held} already,"
                                 " and only a truncate moves it back")
            self._held = offset
        self._write_hint(self.published_offset)
        with self._confirmed:
            self._confirmed.notify_all()

    def wait_confirmed(self, offset: int, timeout: float) -> bool:
        """Block until the confirm offset reaches ``offset`` (True) or ``timeout`` seconds passed (False); never
        holds the append lock meanwhile, since :meth:`confirm` takes it. Any thread but the one that confirms."""
        with self._confirmed:
            return self._confirmed.wait_for(lambda: self.confirm_offset >= offset or self._closed, timeout) \
                and not self._closed

    @property
    def min_offset(self) -> int:
        """The first readable offset; retention moves it up."""
        return self._view.bases[0]

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> CommitLogStatistics:
        return CommitLogStatistics(self._written, self._flushed, self.min_offset, len(self._view.segments),
                                   self._appended_records, self._appended_batches, self._flushes,
                                   self._corrupt_records)

    def _report_corrupt(self, seg: Segment, offset: int, end: int, reason: str) -> None:
        """Log (one ERROR line naming the file and offset) and count a corrupt record the first time it is met;
        readers skip it every time. Any thread."""
        with self._corrupt_lock:
            if offset in self._corrupt:
                return
            if len(self._corrupt) >= MAX_KNOWN_CORRUPT:
                del self._corrupt[next(iter(self._corrupt))]
            self._corrupt[offset] = None
            self._corrupt_records += 1
        LOGGER.error("corrupt record skipped: its bytes are never served; every other record still is",
                     extra={"ctx": {"file": str(seg.path), "offset": offset, "position": offset - seg.base,
                                    "bytes": end - offset, "reason": reason}})

    # ------------------------------------------------------------------ appending

    def append(self, record: bytes) -> int:
        """Append one encoded record; returns its offset. See :meth:`append_batch`."""
        return self.append_batch((record,))[0]

    def append_batch(self, records: Sequence[bytes]) -> list[int]:
        """Append encoded records (``store.log.record.encode_record``) in one write per segment touched.

        All-or-nothing: if any record is rejected or the write fails, no record
        of the batch is stored and the log is exactly as before.

        Returns:
            The offset of each record, in order.

        Raises:
            RecordTooLarge: a record is larger than ``max_record_bytes``.
            ValueError: a record is not an encoded v1 record, or the log is closed.
            LogFullError: the disk or quota is full (errno ENOSPC/EDQUOT); retry once space frees.
            OSError: any other write failure, or a previous fsync failed (reopen the log).
        """
        if not records:
            return []
        sizes = self._sizes(records)
        try:
            peeks = [PEEK.unpack_from(r) for r in records]
        except struct.error:
            raise ValueError(f"a record is shorter than the {HEADER_SIZE}-byte header: not an encoded record") from None
        lengths, magics, store_ms = zip(*peeks)
        if list(lengths) != sizes or magics.count(MAGIC_V1) != len(magics):
            i = next(i for i, (p, s) in enumerate(zip(peeks, sizes)) if p[0] != s or p[1] != MAGIC_V1)
            raise ValueError(f"record {i} of the batch is not an encoded v1 record (length field {peeks[i][0]},"
                             f" {sizes[i]} bytes, magic 0x{peeks[i][1]:08x})")
        with self._lock:
            self._check_writable()
            return self._append_locked(records, sizes, store_ms)

    def append_computed(self, compute: Callable[[int], Sequence[bytes] | None]) -> list[int] | None:
        """Append the records ``compute(end)`` makes for the log's end as it is, with nothing appended between
        (store/restate.py); None if it makes none. It runs under the append lock: appends wait for it. The
        records are ones this process encoded (their headers are not checked)."""
        with self._lock:
            self._check_writable()
            records = compute(self._written)
            if not records:
                return None
            sizes = self._sizes(records)
            return self._append_locked(records, sizes, [PEEK.unpack_from(r)[2] for r in records])

    def append_stamped(self, records: Sequence[bytes], store_ms: int) -> list[int]:
        """:meth:`append_batch` for records this process encoded itself (``store.log.record.new_record``), all
        stamped ``store_ms``: their headers are not parsed again, which was a tenth of an append's cost.

        Raises what :meth:`append_batch` raises, but does not check that the records are well formed.
        """
        if not records:
            return []
        sizes = self._sizes(records)
        with self._lock:
            self._check_writable()
            return self._append_locked(records, sizes, (store_ms,) * len(records))

    def _sizes(self, records: Sequence[bytes]) -> list[int]:
        """The records' sizes; raises RecordTooLarge for a record over ``max_record_bytes``."""
        sizes = [len(r) for r in records]
        if max(sizes) > self._config.max_record_bytes:
            i = next(i for i, s in enumerate(sizes) if s > self._config.max_record_bytes)
            raise RecordTooLarge(f"record {i} of the batch has {sizes[i]} bytes; the maximum record size is"
                                 f" {self._config.max_record_bytes} bytes")
        return sizes

    def _append_locked(self, records: Sequence[bytes], sizes: list[int], store_ms: Sequence[int]) -> list[int]:
        view = self._view
        seg = view.segments[-1]
        n = len(records)
        if sum(sizes) > seg.remaining:
            return self._append_rolling(view, records, sizes, store_ms)
        try:  # the common case: the whole batch fits in the active segment
            pos = seg.append(records[0] if n == 1 else b"".join(records)).offset
        except OSError as exc:
            raise self._full_error(exc, n) from exc
        self._stats[seg.base].add(n, min(store_ms), max(store_ms))
        self._written = seg.base + seg.write_pos
        self._appended_records += n
        self._appended_batches += 1
        return list(accumulate(sizes[:-1], initial=seg.base + pos))

    def _append_rolling(self, view: _View, records: Sequence[bytes], sizes: list[int],
                        store_ms: Sequence[int]) -> list[int]:
        """Append a batch that crosses into new segments: one write per segment, undone whole on failure."""
        seg = view.segments[-1]
        created: list[Segment] = []
        chunks: list[tuple[Segment, int, int]] = []  # (segment, first record, end record) for the stats
        offsets: list[int] = []
        n = len(records)
        i = 0
        with self._undoing(seg, created, n):
            while True:
                room = seg.remaining
                j = i
                used = 0
                while j < n and used + sizes[j] <= room:
                    used += sizes[j]
                    j += 1
                if j > i:
                    result = seg.append(records[i] if j == i + 1 else b"".join(records[i:j]))
                    offsets.extend(accumulate(sizes[i:j - 1], initial=seg.base + result.offset))
                    chunks.append((seg, i, j))
                    i = j
                if i == n:
                    break
                seg = self._roll(seg)
                created.append(seg)
        for new in created:
            self._stats[new.base] = _Stats()
        for s, lo, hi in chunks:
            self._stats[s.base].add(hi - lo, min(store_ms[lo:hi]), max(store_ms[lo:hi]))
        self._publish(view, created, n)
        return offsets

    @contextmanager
    def _undoing(self, first: Segment, created: list[Segment], n: int) -> Iterator[None]:
        """Take back a write of ``n`` records that fails part way: the segments it created (``created``, filled
        in as it goes) go, and ``first`` is cut where it began; ENOSPC/EDQUOT become ``LogFullError``."""
        first_pos = first.write_pos
        try:
            yield
        except BaseException as exc:
            for new in created:
                new.close()
                new.path.unlink(missing_ok=True)
            first.truncate(first_pos)
            if isinstance(exc, OSError):
                raise self._full_error(exc, n) from exc
            raise

    def _publish(self, view: _View, created: list[Segment], n: int) -> None:
        """Make a write of ``n`` records across the segments it ``created`` visible: the segments before the
        offset."""
        self._dir_dirty = self._dir_dirty or bool(created)
        self._view = _View.of(view.segments + created)
        last = self._view.segments[-1]
        self._written = last.base + last.write_pos
        self._appended_records += n
        self._appended_batches += 1

    def _full_error(self, exc: OSError, n: int) -> OSError:
        """``LogFullError`` for ENOSPC/EDQUOT (the batch left no trace), else ``exc`` itself."""
        if exc.errno not in FULL_ERRNOS:
            return exc
        return LogFullError(exc.errno, f"CommitLog {self._dir} is full ({os.strerror(exc.errno)}): the batch"
                                       f" of {n} records was not stored; nothing else changed")

    def _roll(self, seg: Segment) -> Segment:
        """Seal ``seg`` with an end-of-segment marker and create the next segment.

        The new file is created first: if that fails, ``seg`` is untouched.
        """
        new = self._create_next(seg)
        try:
            seg.seal(encode_eos(seg.remaining) if seg.remaining >= EOS_SIZE else b"")
        except OSError:
            new.close()
            new.path.unlink(missing_ok=True)
            raise
        return new

    def _create_next(self, seg: Segment) -> Segment:
        """The segment after ``seg``. Created inline: a sparse 256 MiB file takes ~25 us to make
        (measured), so pre-allocating it in the background would not flatten anything."""
        return Segment.create(self._dir, seg.end, self._config.segment_bytes)

    def _check_writable(self) -> None:
        if self._closed:
            raise ValueError(f"CommitLog {self._dir} is closed")
        if self._fsync_error is not None:
            raise OSError(self._fsync_error.errno, f"CommitLog {self._dir} cannot promise durability after a failed"
                                                   f" fsync ({self._fsync_error}); reopen it to recover")

    # ------------------------------------------------------------------ flushing

    def flush(self) -> int:
        """fdatasync everything written so far; returns the new flushed offset.

        Runs without the append lock, so appends continue meanwhile; bytes
        appended during the sync are left for the next flush. Also writes the
        .meta of newly sealed segments and the ``flushed`` hint.

        Raises:
            OSError: the sync failed. The log then refuses further appends and
                flushes (the kernel may have dropped the dirty pages): reopen it.
        """
        with self._flush_lock:
            if self._released:
                raise ValueError(f"CommitLog {self._dir} is closed")
            if self._fsync_error is not None:
                self._check_writable()
            return self._flush_locked()

    def _flush_locked(self) -> int:
        target = self._written
        view = self._view
        if target <= self._flushed and not self._dir_dirty:
            return self._flushed
        try:
            for seg in view.segments:
                if seg.end > self._flushed and seg.base < target:
                    try:
                        with seg.pinned():
                            seg.sync()
                    except SegmentRetired:
                        continue  # retention deleted it meanwhile: nothing left to sync
            if self._dir_dirty:
                self._dir_dirty = False
                self._fsync_dir()
        except OSError as exc:
            self._fsync_error = exc
            LOGGER.error("CommitLog fsync failed; appends are refused until the log is reopened",
                         extra={"ctx": {"dir": str(self._dir), "error": str(exc)}})
            raise
        for seg in view.segments[:-1]:
            stats = self._stats.get(seg.base)
            if stats is not None and not stats.meta_written and seg.end <= target:
                self._write_meta(seg)
        if target > self._flushed:
            self._flushed = target
        self._flushes += 1
        self._write_hint(self.published_offset)
        return self._flushed

    def _fsync_dir(self) -> None:
        """New or deleted segment files are only durable once the directory is synced."""
        os.fsync(self._dir_fd)

    def _write_hint(self, offset: int) -> None:
        raw = _U64.pack(offset)
        try:
            os.pwrite(self._hint_fd, _HINT.pack(offset, crc32c(raw)), 0)
        except OSError as exc:  # a hint: readers fall back to CRC checks, recovery recomputes the truth
            LOGGER.warning("could not update the flushed-offset hint", extra={"ctx": {"error": str(exc)}})

    def _meta_path(self, seg: Segment) -> Path:
        return self._dir / (segment_name(seg.base) + META_SUFFIX)

    def _write_meta(self, seg: Segment) -> None:
        """Write ``<base>.meta`` atomically (tmp + rename); a failure only costs a rebuild on open."""
        stats = self._stats[seg.base]
        doc = {"version": META_VERSION, "base": seg.base, "end": seg.base + seg.write_pos, "records": stats.records,
               "min_store_ms": stats.min_ms, "max_store_ms": stats.max_ms}
        path = self._meta_path(seg)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            LOGGER.warning("could not write segment metadata; it is rebuilt on the next open",
                           extra={"ctx": {"segment": path.name, "error": str(exc)}})
            return
        stats.meta_written = True

    def _read_meta(self, seg: Segment) -> dict[str, Any] | None:
        """The segment's .meta if it is present and agrees with the segment's bytes, else None."""
        path = self._meta_path(seg)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            LOGGER.warning("unreadable segment metadata; rebuilding it", extra={"ctx": {"file": path.name, "error": str(exc)}})
            return None
        try:
            ok = (doc["version"] == META_VERSION and doc["base"] == seg.base
                  and seg.base <= doc["end"] <= seg.end and doc["records"] >= 0
                  and all(doc[k] is None or isinstance(doc[k], int) for k in ("min_store_ms", "max_store_ms")))
        except (KeyError, TypeError):
            ok = False
        if ok:
            pos = doc["end"] - seg.base
            left = seg.size - pos
            if left >= EOS_SIZE:
                ok = _is_eos(seg.read(pos, EOS_SIZE), left)
        if not ok:
            LOGGER.warning("stale segment metadata; rebuilding it", extra={"ctx": {"file": path.name}})
            return None
        return doc

    # ------------------------------------------------------------------ reading

    def read(self, offset: int) -> Record:
        """Read and decode the record at ``offset``.

        Raises:
            OffsetExpired: below ``min_offset`` (retention deleted it).
            InvalidOffset: negative, at or beyond ``written_offset``, or no record starts there.
            CorruptRecord: the record fails its length or CRC checks (it is never returned).
        """
        seg, pos, end = self._locate(offset)
        try:
            with seg.pinned():
                buf = seg.read(pos, min(READ_GUESS, end - pos))
                if len(buf) >= 4:
                    size = int.from_bytes(buf[:4], "big")
                    if len(buf) < size <= end - pos:
                        buf = seg.read(pos, size)
        except SegmentRetired:
            raise OffsetExpired(offset, self.min_offset) from None
        self._check_record(buf, offset)
        return decode_record(buf, 0, offset)

    def read_bytes(self, offset: int, size: int) -> bytes:
        """The raw bytes of the record at ``offset`` (``size`` as stored by an index), CRC-checked.

        Raises:
            OffsetExpired, InvalidOffset, CorruptRecord: as for :meth:`read`; InvalidOffset
                also when ``size`` is not the record's length.
        """
        seg, pos, end = self._locate(offset)
        if size < HEADER_SIZE or size > end - pos:
            raise InvalidOffset(offset, f"size {size} does not fit a record there")
        try:
            with seg.pinned():
                buf = seg.read(pos, size)
        except SegmentRetired:
            raise OffsetExpired(offset, self.min_offset) from None
        if int.from_bytes(buf[:4], "big") != size:
            raise InvalidOffset(offset, f"the record there is not {size} bytes long")
        try:
            self._check_record(buf, offset)
        except CorruptRecord as exc:
            self._report_corrupt(seg, offset, offset + size, str(exc))
            raise
        return buf

    def next_record_offset(self, offset: int) -> int:
        """Where the next record at or after ``offset`` (at most ``written_offset``) starts: ``offset`` itself,
        or, at the end of a segment's data (before its end-of-segment marker or short tail), the next segment's
        base. What :meth:`scan` skips, for readers that know the records but not the segments."""
        view = self._view
        written = self._written
        if offset >= written or offset < view.bases[0]:
            return offset
        seg = view.find(offset)
        if min(written, seg.base + seg.write_pos) <= offset:
            return seg.end
        return offset

    def read_span(self, offset: int, max_bytes: int) -> tuple[int, bytes, int]:
        """Raw bytes of the log from the record boundary ``offset``, for readers that frame records
        themselves (the store RPC's ``ReadLog``, Spark executors without the files).

        Returns ``(start, data, data_end)``: ``start`` is ``offset``, or the next
        segment's base when ``offset`` is at the end of a segment's data; ``data``
        is at most ``max_bytes`` from ``start``, never past the published offset (flushed and confirmed) nor
        the segment's data (it may end inside a record, which the caller reads
        again from its start); ``data_end`` is where the segment's readable data
        ends (its sealed end, or the published offset). Nothing is decoded or checked.

        Raises:
            OffsetExpired: below ``min_offset``.
            InvalidOffset: beyond the published offset.
        """
        flushed = self.published_offset
        view = self._view
        if self._closed:
            raise ValueError(f"CommitLog {self._dir} is closed")
        if offset < view.bases[0]:
            raise OffsetExpired(offset, view.bases[0])
        if offset > flushed or offset < 0:
            raise InvalidOffset(offset, f"beyond the flushed end of the log ({flushed}, flushed and confirmed)")
        seg = view.find(offset)
        data_end = min(flushed, seg.base + seg.write_pos)
        if offset >= data_end and seg.sealed and seg.end <= flushed:
            offset = seg.end
            seg = view.find(offset)
            data_end = min(flushed, seg.base + seg.write_pos)
        try:
            with seg.pinned():
                data = seg.read(offset - seg.base, max(0, min(max_bytes, data_end - offset)))
        except SegmentRetired:
            raise OffsetExpired(offset, self.min_offset) from None
        return offset, data, data_end

    def read_many(self, locations: Sequence[tuple[int, int]]) -> list[bytes | None]:
        """The raw bytes of the records at ``(offset, size)`` locations (in log order), CRC-checked;
        None for a record retention deleted; ``SKIPPED`` (``b""``) for one whose bytes are not the record the
        location promises (a flipped bit, a length that disagrees, or past the log's end): it is logged and
        counted once (``statistics().corrupt_records``) and never served, and every other record still is.

        A queue's records often lie close together in the log (a topic's
        burst, a first-level queue taking most of the traffic): records less
        than ``READ_GAP`` apart in one segment are read with one pread.
        """
        found: list[bytes | None] = []
        i = 0
        count = len(locations)
        while i < count:
            offset, size = locations[i]
            try:
                seg, pos, end = self._locate(offset)
                if size < HEADER_SIZE or size > end - pos:
                    raise InvalidOffset(offset, f"size {size} does not fit a record there")
            except OffsetExpired:
                found.append(None)
                i += 1
                continue
            except InvalidOffset as exc:
                self._report_corrupt(self._view.find(max(offset, self.min_offset)), offset, offset + size, str(exc))
                found.append(SKIPPED)
                i += 1
                continue
            j = i + 1
            stop = offset + size
            limit = seg.base + end
            while j < count:
                nxt, nsize = locations[j]
                if nxt < stop or nxt - stop > READ_GAP or nxt + nsize > limit or nxt + nsize - offset > READ_SPAN:
                    break
                stop = nxt + nsize
                j += 1
            try:
                with seg.pinned():
                    buf = seg.read(pos, stop - offset)
            except SegmentRetired:
                found.extend([None] * (j - i))
                i = j
                continue
            for at, length in locations[i:j]:
                raw = buf[at - offset : at - offset + length]
                try:
                    if len(raw) < HEADER_SIZE or int.from_bytes(raw[:4], "big") != length:
                        raise CorruptRecord(f"the record there is not {length} bytes long")
                    self._check_record(raw, at)
                except (CorruptRecord, InvalidOffset) as exc:
                    self._report_corrupt(seg, at, at + length, str(exc))
                    raw = SKIPPED
                found.append(raw)
            i = j
        return found

    def _locate(self, offset: int) -> tuple[Segment, int, int]:
        """(segment, position in it, end of its readable data) for a read at ``offset``."""
        written = self._written  # before the view: the view is then at least as new
        view = self._view
        if self._closed:
            raise ValueError(f"CommitLog {self._dir} is closed")
        if offset < view.bases[0]:
            raise OffsetExpired(offset, view.bases[0])
        if offset >= written:
            raise InvalidOffset(offset, f"beyond the written end of the log ({written})")
        seg = view.find(offset)
        end = min(written, seg.base + seg.write_pos) - seg.base
        pos = offset - seg.base
        if pos >= end:
            raise InvalidOffset(offset, "in the unused tail of a segment")
        return seg, pos, end

    @staticmethod
    def _check_record(buf: bytes, offset: int) -> None:
        if len(buf) < EOS_SIZE or int.from_bytes(buf[8:12], "big") != MAGIC_V1:
            raise InvalidOffset(offset, "no record starts there")
        try:
            check_frame(buf, 0, len(buf))
        except CorruptRecord as exc:
            raise CorruptRecord(f"record at offset {offset}: {exc}") from None

    def scan(self, from_offset: int, max_bytes: int = SCAN_BYTES, end: int | None = None) -> ScanResult:
        """Decode the complete records from ``from_offset``, reading about ``max_bytes``.

        One pread per segment touched; every record's CRC is verified (cheap
        next to decoding, and it is what keeps a flipped bit from being served).
        A record larger than ``max_bytes`` is still returned whole. Corrupt bytes
        are skipped and reported in ``corrupt`` (and logged once), never returned:
        a record with intact framing but a bad CRC is skipped alone; after broken
        framing the scan resumes at the next valid record (``_resync``).

        ``end`` (a record boundary, e.g. the confirm offset) stops the scan before ``written_offset``.

        Returns:
            The records and ``next_offset``, where the next scan starts (past
            end-of-segment markers, so it may be the next segment's base).

        Raises:
            OffsetExpired: ``from_offset`` is below ``min_offset``.
            InvalidOffset: ``from_offset`` is beyond ``written_offset``.
        """
        written = self._written if end is None else min(end, self._written)
        view = self._view
        if self._closed:
            raise ValueError(f"CommitLog {self._dir} is closed")
        if from_offset < view.bases[0]:
            raise OffsetExpired(from_offset, view.bases[0])
        if from_offset > written or from_offset < 0:
            raise InvalidOffset(from_offset, f"beyond the written end of the log ({written})")
        records: list[Record] = []
        corrupt: list[CorruptRange] = []
        offset = from_offset
        budget = max_bytes
        while offset < written and budget > 0:
            seg = view.find(offset)
            data_end = min(written, seg.base + seg.write_pos)
            if offset >= data_end:
                offset = seg.end  # past the end-of-segment marker or short tail
                continue
            try:
                with seg.pinned():
                    buf = seg.read(offset - seg.base, min(budget, data_end - offset))
                    if not records and len(buf) >= 4:
                        size = int.from_bytes(buf[:4], "big")
                        if len(buf) < size <= data_end - offset:  # a first record larger than max_bytes
                            buf = seg.read(offset - seg.base, size)
            except SegmentRetired:
                if records:
                    break
                raise OffsetExpired(offset, self.min_offset) from None
            consumed, bad = _decode_into(records, buf, offset, data_end)
            budget -= consumed
            offset += consumed
            if bad is not None:
                if bad.end < 0:  # the framing is broken: the next record starts where a valid one is found
                    bad = CorruptRange(bad.offset, seg.base + _resync(seg, offset - seg.base, data_end - seg.base),
                                       bad.reason)
                corrupt.append(bad)
                self._report_corrupt(seg, bad.offset, bad.end, bad.reason)
                budget -= bad.end - offset
                offset = bad.end
            elif offset < data_end:
                break  # the next record did not fit in this read: the next scan starts with it
        return ScanResult(records, offset, tuple(corrupt))

    # ------------------------------------------------------------------ replication

    def read_frames(self, offset: int, max_bytes: int) -> bytes:
        """The log's bytes from the record boundary ``offset`` as :meth:`append_frames` takes them on a replica:
        whole frames up to about ``max_bytes`` (at least one), up to ``written_offset`` (the replicas confirm
        what they copied, so they read past the confirm offset); a sealed segment's end-of-segment marker (or
        its short tail of zeros) is included, and the frames after it are the next segment's. Nothing is
        decoded; the replica checks every frame.

        Raises:
            OffsetExpired: below ``min_offset``.
            InvalidOffset: beyond ``written_offset``.
        """
        written = self._written
        view = self._view
        if offset < view.bases[0]:
            raise OffsetExpired(offset, view.bases[0])
        if not 0 <= offset <= written:
            raise InvalidOffset(offset, f"beyond the written end of the log ({written})")
        parts: list[bytes] = []
        budget = max_bytes
        while offset < written and budget > 0:
            seg = view.find(offset)
            data_end = min(written, seg.base + seg.write_pos)
            if offset >= data_end:
                left = seg.end - offset
                parts.append(encode_eos(left) if left >= EOS_SIZE else bytes(left))
                budget -= min(left, EOS_SIZE)
                offset = seg.end
                continue
            try:
                with seg.pinned():
                    buf = seg.read(offset - seg.base, min(max(budget, READ_GUESS), data_end - offset))
                    first = int.from_bytes(buf[:4], "big")
                    if len(buf) < first <= data_end - offset:
                        buf = seg.read(offset - seg.base, first)
            except SegmentRetired:
                raise OffsetExpired(offset, self.min_offset) from None
            # Data ends on a record boundary: a read up to it is whole frames without walking them.
            whole = len(buf) if offset + len(buf) == data_end else _whole_frames(buf)
            parts.append(buf[:whole])
            budget -= whole
            offset += whole
            if whole < len(buf) or offset < data_end:
                break
        return b"".join(parts)

    def append_frames(self, offset: int, data: bytes, decoded: list[Record] | None = None) -> int:
        """Append bytes copied from a leader's log (:meth:`read_frames`) at the same offsets; returns the new
        ``written_offset``. Every frame is checked (length, magic, CRC); an end-of-segment marker or short tail
        seals this log's segment where the leader's ended, so both logs have the same segments and offsets.
        All-or-nothing, like :meth:`append_batch`.

        ``decoded``: the records are also decoded into it, in order and placed at their offsets, while they are
        checked (a replica's dispatch then indexes them without reading, checking and decoding them again); it
        stops before a record that does not decode (its CRC held: a writer's bug, which dispatch's scan reports).
        Meaningful only when the call returns.

        Raises:
            ValueError: ``offset`` is not this log's ``written_offset`` (a gap or an overlap), or the segment
                layout disagrees (the leader's ``segment_bytes`` differ), or the log is closed.
            CorruptRecord: a frame does not check (nothing was written).
            RecordTooLarge: a record is larger than ``max_record_bytes``.
            LogFullError, OSError: as for :meth:`append_batch`.
        """
        if not data:
            return self._written
        with self._lock:
            self._check_writable()
            if offset != self._written:
                raise ValueError(f"frames at offset {offset} do not continue this log, which ends at {self._written}"
                                 f" ({'a gap' if offset > self._written else 'an overlap'})")
            pieces = _plan_frames(data, offset, self._view.segments[-1].end, self._config, decoded)
            return self._write_frames(pieces, sum(len(p.records) for p in pieces))

    def _write_frames(self, pieces: list[_Piece], count: int) -> int:
        view = self._view
        first = seg = view.segments[-1]
        created: list[Segment] = []
        with self._undoing(first, created, count):
            for piece in pieces:
                if piece.data:
                    seg.append(piece.data)
                if piece.sealed:
                    seg = self._roll(seg)
                    created.append(seg)
        for new in created:
            self._stats[new.base] = _Stats()
        for s, piece in zip([first, *created], pieces):
            if piece.records:
                self._stats[s.base].add(len(piece.records), min(piece.records), max(piece.records))
        self._publish(view, created, count)
        return self._written

    def truncate(self, offset: int) -> None:
        """Cut the log at the record boundary ``offset`` (``min_offset`` <= offset <= ``written_offset``): a
        follower drops what its leader does not have. Later segments and their ``.meta`` go, the segment it
        lands in is zeroed after it and un-sealed, the written, flushed and confirm offsets and the epochs
        follow. Durable on return.

        Crash-safe at every step: the epochs and the ``flushed`` hint are lowered first (so recovery never
        takes the zeros below an old hint for damage to step over), segments are deleted newest first (the
        rest is a valid log), then the cut segment is zeroed from ``offset``. A crash leaves a valid log
        ending at or after ``offset`` and at or before the old end; truncating again finishes the job.
        Readers of the dropped records must have stopped (they were past the confirm offset, or the caller,
        :meth:`store.dispatch.Dispatcher.truncate`, holds them).

        Raises:
            InvalidOffset: ``offset`` is out of bounds or no record starts there.
            OSError: I/O failed; the log may be partly cut (still valid): call again.
        """
        with self._flush_lock, self._lock:
            self._check_writable()
            view = self._view
            if offset < view.bases[0] or offset > self._written:
                raise InvalidOffset(offset, f"outside the log [{view.bases[0]}, {self._written}]")
            i = bisect.bisect_right(view.bases, offset) - 1
            seg = view.segments[i]
            pos = offset - seg.base
            if offset < self._written and pos < seg.write_pos:
                self.read(offset)  # raises InvalidOffset or CorruptRecord unless a record starts there
            self.epochs.truncate_from(offset)
            if offset == self._written:
                return
            self._write_hint(min(self.published_offset, offset))
            os.fsync(self._hint_fd)
            doomed = view.segments[i + 1:]
            self._view = _View.of(view.segments[: i + 1])  # first: a failure below leaves a consistent log
            self._written = min(self._written, seg.base + seg.write_pos)
            self._flushed = min(self._flushed, self._written)
            if self._held is not None:
                self._held = min(self._held, self._written)
            for later in reversed(doomed):
                later.retire()
                self._meta_path(later).unlink(missing_ok=True)
                later.path.unlink()
                self._fsync_dir()
                self._stats.pop(later.base, None)
            self._meta_path(seg).unlink(missing_ok=True)
            self._fsync_dir()
            seg.truncate(pos)
            seg.sync()
            self._stats[seg.base] = _walk(seg).stats
            self._written = offset
            self._flushed = min(self._flushed, offset)
            if self._held is not None:
                self._held = min(self._held, offset)
            self._write_hint(self.published_offset)
        LOGGER.warning("CommitLog truncated", extra={"ctx": {"offset": offset, "segments_deleted": len(doomed)}})

    def start_at(self, offset: int) -> None:
        """Begin this empty log at ``offset`` (a new replica joining a leader whose retention deleted the log
        below ``offset``): its one segment is replaced by an empty one named by that base, so it has the leader's
        segments and offsets from there on. Durable on return; recovery opens such a log as one retention cut.

        Crash-safe: the old segment goes first (a crash then leaves no segment, and the next open starts an
        empty log at 0 again), then the new one is created and the hint written.

        Raises:
            ValueError: the log holds records.
        """
        with self._flush_lock, self._lock:
            self._check_writable()
            view = self._view
            if self._written != view.bases[0]:
                raise ValueError(f"cannot start a log that holds records ([{view.bases[0]}, {self._written})) at"
                                 f" {offset}")
            if offset == self._written:
                return
            old = view.segments[0]
            old.retire()
            self._meta_path(old).unlink(missing_ok=True)
            old.path.unlink()
            self._fsync_dir()
            seg = Segment.create(self._dir, offset, self._config.segment_bytes)
            self._fsync_dir()
            self._stats.pop(old.base, None)
            self._stats[offset] = _Stats()
            self._view = _View.of([seg])
            self._written = self._flushed = offset
            if self._held is not None:
                self._held = offset
            self._write_hint(offset)
            os.fsync(self._hint_fd)
        LOGGER.info("CommitLog started at its leader's first offset", extra={"ctx": {"offset": offset}})

    # ------------------------------------------------------------------ retention

    def add_retention_listener(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(new_min_offset)`` after retention deletes segments (in the thread that ran it)."""
        self._listeners.append(fn)

    def add_retention_prelude(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(new_min_offset)`` before retention deletes the segments below it (in the thread that runs it):
        it appends, durably, what must outlive them (store/restate.py). If it raises, nothing is deleted this time."""
        self._preludes.append(fn)

    def set_retention_guard(self, may_delete: Callable[[int], bool] | None) -> None:
        """Let retention delete a segment only if ``may_delete(base)`` is true (None: no guard).

        The Parquet tier (store/tier.py) uses it so that retention never deletes a
        segment it has not converted yet; the segments after a refused one stay too.
        """
        self._retention_guard = may_delete

    def add_retention_guard(self, may_delete: Callable[[int, int], bool]) -> None:
        """Let retention delete the segment ``[base, end)`` only if ``may_delete(base, end)`` is true as well
        (called under the log's lock: it must not call the log). The timer (store/timer/) keeps the segments its
        pending entries point into; the segments after a refused one stay too."""
        self._guards.append(may_delete)

    def delete_expired(self, now_ms: int | None = None) -> list[int]:
        """Delete whole sealed segments older than ``retention_hours`` or beyond ``retention_max_bytes``.

        Age is the segment's newest store timestamp (from its .meta; the file's
        mtime when unknown). Segments go oldest first, so the log stays
        contiguous; the active segment is never deleted.

        Returns:
            The base offsets of the deleted segments.
        """
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        cfg = self._config
        with self._lock:
            if self._closed:
                return []
            segments = self._view.segments
            total = self._written - segments[0].base
            cutoff = now_ms - cfg.retention_hours * 3_600_000 if cfg.retention_hours > 0 else None
            count = 0
            for seg, after in zip(segments, segments[1:]):
                too_big = cfg.retention_max_bytes > 0 and total > cfg.retention_max_bytes
                too_old = cutoff is not None and self._newest_ms(seg) < cutoff
                if not (too_big or too_old) or not self._guarded(seg, after):
                    break
                total -= seg.size
                count += 1
            if not count:
                return []
            doomed = segments[:count]
        try:
            for prelude in self._preludes:
                prelude(segments[count].base)
        except RetentionDeferred as exc:
            LOGGER.warning("CommitLog retention deferred: %s", exc, extra={"ctx": {"segments": count}})
            return []
        except Exception:
            LOGGER.exception("CommitLog retention deferred: what must outlive the segments was not restated",
                             extra={"ctx": {"segments": count}})
            return []
        return self._delete_oldest(doomed)

    def delete_before(self, offset: int) -> list[int]:
        """A follower's retention: delete the sealed segments wholly below ``offset`` (its leader's ``min_offset``:
        the leader deleted them), oldest first, under the same guards as :meth:`delete_expired` but with no
        prelude (the leader's restatement is in the log this one copied; a follower never appends). The active
        segment is never deleted. Returns the base offsets of the deleted segments."""
        with self._lock:
            if self._closed:
                return []
            segments = self._view.segments
            doomed = []
            for seg, after in zip(segments, segments[1:]):
                if after.base > offset or not self._guarded(seg, after):
                    break
                doomed.append(seg)
        return self._delete_oldest(doomed) if doomed else []

    def _guarded(self, seg: Segment, after: Segment) -> bool:
        """Whether the retention guards let ``seg`` (followed by ``after``) be deleted. Hold the lock."""
        if self._retention_guard is not None and not self._retention_guard(seg.base):
            return False
        return all(may_delete(seg.base, after.base) for may_delete in self._guards)

    def _delete_oldest(self, doomed: list[Segment]) -> list[int]:
        """Delete the oldest segments ``doomed`` (unless the log was closed or cut meanwhile), then tell the
        retention listeners the new ``min_offset``."""
        count = len(doomed)
        with self._lock:
            if self._closed or self._view.segments[:count] != doomed:  # closed, or cut meanwhile: next run
                return []
            self._view = _View.of(self._view.segments[count:])
        for seg in doomed:
            seg.retire()
            seg.path.unlink(missing_ok=True)
            self._meta_path(seg).unlink(missing_ok=True)
            self._stats.pop(seg.base, None)
        new_min = self.min_offset
        LOGGER.info("CommitLog retention deleted segments",
                    extra={"ctx": {"segments": count, "min_offset": new_min}})
        for fn in list(self._listeners):
            try:
                fn(new_min)
            except Exception:
                LOGGER.exception("retention listener failed", extra={"ctx": {"listener": repr(fn)}})
        return [s.base for s in doomed]

    def _newest_ms(self, seg: Segment) -> float:
        stats = self._stats.get(seg.base)
        if stats is not None and stats.max_ms is not None:
            return stats.max_ms
        try:
            return seg.path.stat().st_mtime * 1000
        except FileNotFoundError:
            return float("-inf")

    # ------------------------------------------------------------------ tools, closing

    def segments(self) -> list[SegmentInfo]:
        """One record per segment, oldest first."""
        written = self._written
        out = []
        for seg in self._view.segments:
            used = min(written - seg.base, seg.write_pos)
            stats = self._stats.get(seg.base) or _Stats()
            out.append(SegmentInfo(seg.base, seg.path, seg.sealed, used, seg.base + used,
                                   stats.records, stats.min_ms, stats.max_ms))
        return out

    def close(self) -> None:
        """Flush, write the hint, and release every file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._confirmed:
            self._confirmed.notify_all()
        with self._flush_lock:
            try:
                if self._fsync_error is None:
                    self._flush_locked()
            finally:
                for seg in self._view.segments:
                    seg.close()
                self._release()

    def _release(self) -> None:
        self._released = True
        for fd in (self._hint_fd, self._dir_fd, self._lock_fd):
            os.close(fd)

    def __enter__(self) -> CommitLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CommitLog({str(self._dir)!r}, written={self._written}, flushed={self._flushed})"


def read_flushed_hint(directory: Path) -> int | None:
    """The flushed offset recorded in ``<directory>/flushed``, or None if absent or its CRC is bad."""
    try:
        raw = (Path(directory) / HINT_FILE).read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < _HINT.size:
        return None
    offset, crc = _HINT.unpack_from(raw)
    return offset if crc == crc32c(raw[:8]) else None


@dataclass(frozen=True, slots=True)
class _Piece:
    """Frames for one segment of :meth:`CommitLog.append_frames`: its records' bytes, their store times, and
    whether the leader's segment ended after them (sealed: this log rolls to the next segment)."""

    data: bytes
    records: list[int]
    sealed: bool


def _plan_frames(data: bytes, offset: int, seg_end: int, config: CommitLogConfig,
                 decoded: list[Record] | None = None) -> list[_Piece]:
    """Check every frame of a leader's bytes starting at ``offset`` (``seg_end``: where this log's active
    segment ends) and split them by segment; decode the records into ``decoded`` (see ``append_frames``).
    Raises CorruptRecord, RecordTooLarge or ValueError."""
    pieces: list[_Piece] = []
    times: list[int] = []
    start = p = 0
    limit = len(data)
    max_record = config.max_record_bytes
    while p < limit:
        left = seg_end - offset
        if left < EOS_SIZE:
            if data[p:p + left] != bytes(left):
                raise CorruptRecord(f"frame at offset {offset}: the {left}-byte short tail of a segment is not zeros"
                                    " or not whole")
            pieces.append(_Piece(data[start:p], times, True))
            times, p, start = [], p + left, p + left
            offset, seg_end = seg_end, seg_end + config.segment_bytes
            continue
        if p + EOS_SIZE <= limit and _MAGIC.unpack_from(data, p + 8)[0] == MAGIC_EOS:  # the rest of the segment
            if data[p:p + EOS_SIZE] != encode_eos(left):
                size = int.from_bytes(data[p:p + 4], "big")
                if data[p:p + EOS_SIZE] != encode_eos(size):
                    raise CorruptRecord(f"frame at offset {offset}: an invalid end-of-segment marker")
                raise ValueError(f"frame at offset {offset}: the leader's segment ends with {size} bytes left, this"
                                 f" log's with {left}: the segment layouts disagree (segment_bytes differ)")
            pieces.append(_Piece(data[start:p], times, True))
            times, p, start = [], p + EOS_SIZE, p + EOS_SIZE
            offset, seg_end = seg_end, seg_end + config.segment_bytes
            continue
        try:
            _, size = check_frame(data, p, limit)
        except CorruptRecord as exc:
            raise CorruptRecord(f"frame at offset {offset}: {exc}") from None
        if size == 0:
            raise CorruptRecord(f"frame at offset {offset}: zeros where a frame should be")
        if size > left:
            raise ValueError(f"frame at offset {offset}: a record of {size} bytes crosses this log's segment end"
                             f" ({left} bytes left): the segment layouts disagree (segment_bytes differ)")
        if size > max_record:
            raise RecordTooLarge(f"frame at offset {offset}: a record of {size} bytes exceeds the maximum record"
                                 f" size of {max_record} bytes")
        times.append(STORE_MS.unpack_from(data, p + STORE_MS_AT)[0])
        if decoded is not None:
            try:
                decoded.append(decode_record(data, p, offset))
            except (CorruptRecord, ValueError):  # a bad batch body, bad UTF-8: past its CRC, a writer's bug
                decoded = None  # dispatch reads it, and what follows, from the log
        p += size
        offset += size
    pieces.append(_Piece(data[start:], times, False))
    return pieces


def _whole_frames(buf: bytes) -> int:
    """How many bytes at the start of ``buf`` are whole frames (by their length fields, not checked)."""
    p = 0
    while p + 4 <= len(buf):
        size = int.from_bytes(buf[p:p + 4], "big")
        if size < EOS_SIZE or p + size > len(buf):
            break
        p += size
    return p


def _is_eos(buf: bytes | memoryview, left: int) -> bool:
    """True if ``buf`` starts with the end-of-segment marker for a segment with ``left`` bytes left."""
    return bytes(buf[:EOS_SIZE]) == encode_eos(left)


def _decode_into(records: list[Record], buf: bytes, offset: int, data_end: int) -> tuple[int, CorruptRange | None]:
    """Check and decode the complete records in ``buf`` (read at ``offset``) into ``records``.

    Returns the bytes consumed and, if the bytes at the stop point are not a
    valid record, the range to skip. A record cut by the end of ``buf`` (but
    not by ``data_end``) just ends the loop: the next scan reads it.
    """
    limit = len(buf)
    at_data_end = offset + limit >= data_end
    p = 0
    append = records.append
    while p < limit:
        try:
            magic, size = check_frame(buf, p, limit)
        except CorruptRecord as exc:
            if not at_data_end:
                if p + 4 > limit:
                    return p, None
                claimed = int.from_bytes(buf[p:p + 4], "big")
                if p + claimed > limit and offset + p + claimed <= data_end:
                    return p, None
            return p, _corrupt_range(buf, p, offset, data_end, str(exc))
        if magic != MAGIC_V1:
            what = "zeros" if size == 0 else "an end-of-segment marker"
            return p, CorruptRange(offset + p, -1, f"{what} inside written data")
        try:
            append(decode_record(buf, p, offset + p))
        except CorruptRecord as exc:  # it passed its CRC (a writer's bug): skipped alone, like a CRC-bad one
            return p, CorruptRange(offset + p, offset + p + size, str(exc))
        p += size
    return p, None


def _corrupt_range(buf: bytes, p: int, offset: int, data_end: int, reason: str) -> CorruptRange:
    """Skip a CRC-bad record whose framing is intact by its length; anything else up to an end the scan
    finds (``end`` -1: ``_resync``)."""
    try:
        magic, size = check_frame(buf, p, len(buf), verify_crc=False)
    except CorruptRecord:
        return CorruptRange(offset + p, -1, reason)
    if magic == MAGIC_V1:
        return CorruptRange(offset + p, offset + p + size, reason)
    return CorruptRange(offset + p, -1, reason)


def _resync(seg: Segment, pos: int, end: int) -> int:
    """Where the first valid record (or end-of-segment marker) after the corrupt bytes at ``pos`` starts,
    searching the segment up to position ``end``; ``end`` if none does.

    A candidate has a magic at +8 and must pass every frame check, its CRC32C included: a false match is a
    one in 2^32 event (or a payload that holds a whole encoded record). Reads in ``WALK_CHUNK``s.
    """
    at = pos + 1
    while at + EOS_SIZE <= end:
        chunk = seg.read(at, min(WALK_CHUNK, end - at))
        i = chunk.find(MAGIC_PREFIX, 8)
        while i != -1:
            if _valid_at(seg, at + i - 8, end):
                return at + i - 8
            i = chunk.find(MAGIC_PREFIX, i + 1)
        if at + len(chunk) >= end:
            break
        at += len(chunk) - 9  # a magic across the boundary: its record starts 8 bytes before, in the next chunk
    return end


def _valid_at(seg: Segment, q: int, end: int) -> bool:
    """Does a whole, CRC-valid record (or the end-of-segment marker for this position) start at ``q``?"""
    head = seg.read(q, EOS_SIZE)
    magic = int.from_bytes(head[8:12], "big")
    if magic == MAGIC_EOS:
        return _is_eos(head, seg.size - q)
    size = int.from_bytes(head[:4], "big")
    if magic != MAGIC_V1 or not HEADER_SIZE <= size <= end - q:
        return False
    try:
        check_frame(seg.read(q, size), 0, size)
    except CorruptRecord:
        return False
    return True


def _walk(seg: Segment, durable: int = 0) -> _Walk:
    """Recovery's record-by-record check of a whole segment: where its valid records end, and why.

    Below ``durable`` (the flushed mark, as a position in this segment) the bytes were fsynced: a bad record
    there is damage, not a torn write, and the walk steps over it to the next valid record (``_Walk.skipped``)
    instead of ending the log there; past it, the first bad record ends the walk.
    """
    stats = _Stats()
    skipped: list[CorruptRange] = []
    pos = 0
    buf = b""
    buf_start = 0

    def step_over(reason: str) -> bool:
        nonlocal pos, buf
        if pos >= durable:
            return False
        found = _resync(seg, pos, seg.size)
        if found >= seg.size:
            return False
        skipped.append(CorruptRange(seg.base + pos, seg.base + found, reason))
        pos, buf = found, b""
        return True

    while True:
        left = seg.size - pos
        if left == 0:
            return _Walk(pos, "full", stats, skipped)
        if left < EOS_SIZE:
            tail = seg.read(pos, left)
            if tail.count(0) == len(tail):
                return _Walk(pos, "short tail", stats, skipped)
            return _Walk(pos, f"{left} non-zero bytes after the last record, too short for a record", stats, skipped)
        p = pos - buf_start
        if p + EOS_SIZE > len(buf):
            buf = seg.read(pos, min(WALK_CHUNK, left))
            buf_start, p = pos, 0
        if int.from_bytes(buf[p + 8:p + 12], "big") == MAGIC_EOS:
            if _is_eos(buf[p:], left):
                return _Walk(pos, "eos", stats, skipped)
            if step_over("invalid end-of-segment marker"):
                continue
            return _Walk(pos, "invalid end-of-segment marker", stats, skipped)
        need = int.from_bytes(buf[p:p + 4], "big")
        if p + need > len(buf) and buf_start + len(buf) < seg.size:
            buf = seg.read(pos, min(max(WALK_CHUNK, need), left))
            buf_start, p = pos, 0
        try:
            magic, size = check_frame(buf, p, len(buf))
        except CorruptRecord as exc:
            if step_over(str(exc)):
                continue
            return _Walk(pos, str(exc), stats, skipped)
        if size == 0:
            if step_over("zeros below the flushed mark"):
                continue
            return _Walk(pos, "zeros", stats, skipped)
        (ms,) = STORE_MS.unpack_from(buf, p + STORE_MS_AT)
        stats.add(1, ms, ms)
        pos += size
