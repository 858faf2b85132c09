"""One CommitLog segment: a fixed-size file of opaque bytes, named by its base offset.

A segment knows nothing of MQTT or of the record layout: it appends bytes at its
write position, reads byte ranges, syncs and truncates. The CommitLog decides
what the bytes are (including the end-of-segment marker it asks us to write).

I/O is ``os.pwrite``/``os.pread`` on a file descriptor, not ``mmap``. The file
is pre-sized sparse (``ftruncate``), so a write may have to allocate blocks: with
``pwrite`` a full disk is an ``ENOSPC`` error we can report and undo, with a
memory map it is a ``SIGBUS`` that kills the process. Appends are one large
``pwrite`` per batch and scans one large ``pread``, so the syscall cost is
amortised and a map would save nothing measurable on the hot paths.
"""

from __future__ import annotations

import enum
import errno
import os
import threading
from pathlib import Path
from typing import NamedTuple

__all__ = ["AppendResult", "AppendStatus", "Segment", "SegmentRetired", "segment_name", "parse_segment_name"]

NAME_DIGITS = 20
"""Zero-padded so that names sort like offsets (u64 max has 20 digits)."""


def segment_name(base: int) -> str:
    """The file name of the segment starting at global offset ``base``."""
    return f"{base:0{NAME_DIGITS}d}"


def parse_segment_name(name: str) -> int | None:
    """The base offset a segment file name encodes, or None if it is not a segment name."""
    if len(name) == NAME_DIGITS and name.isdigit():
        return int(name)
    return None


class AppendStatus(enum.Enum):
    """Outcome of :meth:`Segment.append`."""

    OK = "ok"
    END_OF_SEGMENT = "end_of_segment"  # the data does not fit in the room left; nothing was written


class AppendResult(NamedTuple):
    """A tuple rather than a frozen dataclass: it is built once per append, and that is ~3x cheaper."""

    status: AppendStatus
    offset: int  # position of the data within the segment (the write position when it did not fit)
    size: int


class SegmentRetired(Exception):
    """The segment was deleted (retention) or closed; its bytes are gone."""


class Segment:
    """Owns exactly one file ``<dir>/<20-digit base>`` of ``size`` bytes.

    Positions are relative to the segment start; ``base + position`` is the
    global CommitLog offset. ``write_pos`` is where the next append goes and
    ``flushed_pos`` how much of that is known durable.

    Concurrency: one writer (the CommitLog, under its lock) calls append,
    seal and truncate; any thread may read and sync. Readers pin the
    segment (:meth:`pinned`) so retention can retire it without closing the
    descriptor under a running ``pread``: the descriptor is closed when the
    last pin is released.

    Resource handling: the segment owns its file descriptor; :meth:`close`
    (or :meth:`retire`) releases it.
    """

    __slots__ = ("base", "size", "path", "write_pos", "flushed_pos", "sealed",
                 "_fd", "_pins", "_retired", "_pin_lock")

    def __init__(self, path: Path, base: int, size: int, fd: int, write_pos: int = 0) -> None:
        self.base = base
        self.size = size
        self.path = path
        self.write_pos = write_pos
        self.flushed_pos = 0
        self.sealed = False
        self._fd = fd
        self._pins = 0
        self._retired = False
        self._pin_lock = threading.Lock()

    @classmethod
    def create(cls, directory: Path, base: int, size: int) -> Segment:
        """Create the file (it must not exist) and pre-size it with sparse zeros.

        Raises:
            FileExistsError: a segment with this base already exists.
            OSError: ENOSPC and friends; no file is left behind.
        """
        path = directory / segment_name(base)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, base, size, fd)

    @classmethod
    def open(cls, path: Path, size: int) -> Segment:
        """Open an existing segment file, re-extending it to ``size`` if it is shorter.

        A shorter file is what a crash in the middle of :meth:`truncate` leaves;
        the missing part reads as zeros, i.e. "nothing written".
        """
        base = parse_segment_name(path.name)
        if base is None:
            raise ValueError(f"{path} is not named like a segment (20 decimal digits)")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            raise
        return cls(path, base, size, fd)

    @property
    def end(self) -> int:
        """The global offset just past this segment (the next segment's base)."""
        return self.base + self.size

    @property
    def remaining(self) -> int:
        return self.size - self.write_pos

    def append(self, data: bytes) -> AppendResult:
        """Write ``data`` at the write position in one ``pwrite`` and advance it.

        Raises:
            ValueError: the segment is sealed (a bug in the caller).
            OSError: the write failed (e.g. ENOSPC). Whatever part of ``data``
                reached the file is zeroed again and ``write_pos`` is unchanged,
                so the segment is exactly as before the call.
        """
        if self.sealed:
            raise ValueError(f"segment {self.path.name} is sealed")
        size = len(data)
        pos = self.write_pos
        if size > self.size - pos:
            return AppendResult(AppendStatus.END_OF_SEGMENT, pos, size)
        self._write_tail(pos, data)
        self.write_pos = pos + size
        return AppendResult(AppendStatus.OK, pos, size)

    def seal(self, marker: bytes = b"") -> None:
        """Close the segment for appends, writing ``marker`` (if any) at the write position.

        The marker is not counted in ``write_pos``: that stays the end of the
        data, which is what the CommitLog records as the segment's end.

        Raises:
            OSError: the marker could not be written; the segment is unchanged.
        """
        if marker:
            if len(marker) > self.size - self.write_pos:
                raise ValueError(f"a {len(marker)}-byte marker does not fit in {self.remaining} bytes")
            self._write_tail(self.write_pos, marker)
        self.sealed = True

    def _write_tail(self, pos: int, data: bytes) -> None:
        """Write all of ``data`` at ``pos`` (the tail); on failure zero it again and raise."""
        done = 0
        try:
            done = os.pwrite(self._fd, data, pos)
            if done == len(data):
                return
            view = memoryview(data)
            while done < len(view):
                written = os.pwrite(self._fd, view[done:], pos + done)
                if written == 0:
                    raise OSError(errno.EIO, f"pwrite made no progress at {self.path}:{pos + done}")
                done += written
        except OSError:
            if done:
                self.zero_from(pos)
            raise

    def read(self, pos: int, size: int) -> bytes:
        """Read up to ``size`` bytes at ``pos`` (fewer only at the end of the file)."""
        return os.pread(self._fd, size, pos)

    def sync(self) -> int:
        """``fdatasync`` the file; returns the write position that is now durable.

        The position is captured before the sync, so bytes appended while the
        sync runs are not claimed durable.
        """
        target = self.write_pos
        os.fdatasync(self._fd)
        if target > self.flushed_pos:
            self.flushed_pos = target
        return target

    def zero_from(self, pos: int) -> None:
        """Make every byte from ``pos`` to the end zeros again (and free their blocks).

        Shrinking and re-growing the file is the portable hole punch: the tail
        reads as zeros and holds no disk space, so this works on a full disk.
        """
        os.ftruncate(self._fd, pos)
        os.ftruncate(self._fd, self.size)

    def truncate(self, pos: int) -> None:
        """Drop everything from ``pos`` on: zero it and move the write position back."""
        self.zero_from(pos)
        self.write_pos = pos
        self.flushed_pos = min(self.flushed_pos, pos)
        self.sealed = False

    def dirty_end(self, pos: int) -> int:
        """The position just past the last non-zero byte at or after ``pos`` (``pos`` if none).

        Skips holes with SEEK_DATA/SEEK_HOLE so a mostly empty segment costs no reads.
        """
        end = pos
        cursor = pos
        chunk = 1 << 20
        while cursor < self.size:
            try:
                start = os.lseek(self._fd, cursor, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after cursor
                    break
                raise
            stop = min(os.lseek(self._fd, start, os.SEEK_HOLE), self.size)
            while start < stop:
                block = os.pread(self._fd, min(chunk, stop - start), start)
                stripped = len(block.rstrip(b"\0"))
                if stripped:
                    end = start + stripped
                start += len(block) or (stop - start)
            cursor = stop
        return end

    def pinned(self) -> _Pin:
        """``with segment.pinned(): segment.read(...)``; raises SegmentRetired if it is gone."""
        return _Pin(self)

    def retire(self) -> None:
        """Mark the segment gone; its descriptor closes once no reader holds a pin."""
        with self._pin_lock:
            self._retired = True
            if self._pins:
                return
        self._close_fd()

    def close(self) -> None:
        """Close the descriptor now (the CommitLog is closing; readers must be done)."""
        with self._pin_lock:
            self._retired = True
        self._close_fd()

    def _close_fd(self) -> None:
        with self._pin_lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __repr__(self) -> str:
        return f"Segment(base={self.base}, size={self.size}, write_pos={self.write_pos}, sealed={self.sealed})"


class _Pin:
    __slots__ = ("_segment",)

    def __init__(self, segment: Segment) -> None:
        self._segment = segment

    def __enter__(self) -> Segment:
        seg = self._segment
        with seg._pin_lock:
            if seg._retired:
                raise SegmentRetired(f"segment {seg.path.name} was deleted")
            seg._pins += 1
        return seg

    def __exit__(self, *exc: object) -> None:
        seg = self._segment
        with seg._pin_lock:
            seg._pins -= 1
            close = seg._retired and seg._pins == 0
        if close:
            seg._close_fd()
