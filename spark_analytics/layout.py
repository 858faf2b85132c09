"""The CommitLog directory as the Spark reader sees it: segment files, their
``.meta`` time bounds and the ``flushed`` hint (see docs/storage.md).

spark_analytics imports only the record format from ``store``, so the few
on-disk names are re-read here: a segment is ``<20-digit base offset>``, a
sealed segment has ``<base>.meta`` next to it, and ``flushed`` holds the
durable global offset. Nothing here opens a segment's data.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from crc32c import crc32c

__all__ = ["SegmentInfo", "commitlog_dir", "list_segments", "read_flushed"]

SEGMENT_NAME_DIGITS = 20
"""Zero-padded so names sort like offsets; the CommitLog writes exactly this many digits."""

FLUSHED_FILE = "flushed"
"""u64 BE flushed global offset + u32 BE CRC32C of those 8 bytes, rewritten after every flush."""

_FLUSHED = struct.Struct(">QI")


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment file. ``end`` is the global offset after its last record when
    the segment is sealed (from ``.meta``), else None; times are store times in ms."""

    base: int
    path: str
    size: int
    end: int | None = None
    records: int | None = None
    min_store_ms: int | None = None
    max_store_ms: int | None = None

    @property
    def sealed(self) -> bool:
        return self.end is not None


def commitlog_dir(path: str | os.PathLike[str]) -> Path:
    """Accept a data directory (``<data>/commitlog`` inside) or the CommitLog directory itself (named
    ``commitlog``, or holding segment files or a ``flushed`` hint).

    Raises:
        FileNotFoundError: neither, with both places in the message (a wrong directory is named as such,
            not reported later as a log without telemetry).
    """
    root = Path(path)
    if (root / "commitlog").is_dir():
        return root / "commitlog"
    if root.is_dir() and (root.name == "commitlog" or (root / FLUSHED_FILE).exists()
                          or any(len(p.name) == SEGMENT_NAME_DIGITS and p.name.isdigit() for p in root.iterdir())):
        return root
    raise FileNotFoundError(f"no CommitLog at {root} (looked for {root / 'commitlog'} and for segment files in {root})")


def _read_meta(path: Path, base: int) -> dict[str, int] | None:
    """The sealed-segment metadata, or None when it is missing, unreadable or not ours.

    A bad ``.meta`` only costs the time skip, never data, so it is ignored.
    """
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("version") != 1 or meta.get("base") != base:
        return None
    fields = ("end", "records", "min_store_ms", "max_store_ms")
    if not all(isinstance(meta.get(k), int) for k in fields[:2]):
        return None
    return {k: meta[k] for k in fields if isinstance(meta.get(k), int)}


def list_segments(directory: str | os.PathLike[str]) -> list[SegmentInfo]:
    """The segment files of ``directory`` in offset order, with their ``.meta`` when present."""
    directory = Path(directory)
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if len(name) != SEGMENT_NAME_DIGITS or not name.isdigit():
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:  # deleted by retention while we listed
                continue
            base = int(name)
            meta = _read_meta(directory / f"{name}.meta", base) or {}
            found.append(SegmentInfo(base, entry.path, size, meta.get("end"), meta.get("records"),
                                     meta.get("min_store_ms"), meta.get("max_store_ms")))
    found.sort(key=lambda s: s.base)
    return found


def read_flushed(directory: str | os.PathLike[str]) -> int | None:
    """The durable global offset from ``flushed``, or None when it is absent or its CRC is bad."""
    try:
        raw = (Path(directory) / FLUSHED_FILE).read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) != _FLUSHED.size:
        return None
    offset, crc = _FLUSHED.unpack(raw)
    if crc32c(raw[:8]) != crc:
        return None
    return offset
