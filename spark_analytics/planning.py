"""Planning: which bytes of which segments each Spark partition reads.

Partitions are byte ranges, decided from file sizes, ``.meta`` and the
``flushed`` hint only: the planner (the driver) never reads segment data, so
planning costs the same for 1 MiB or 1 TiB of log and works where only the
executors can read the files cheaply. A segment larger than the target is cut
into equal byte ranges; each reader starts at the first record at or after its
range start by walking record lengths from a known boundary (the segment start
or the stream offset) and finishes the record that straddles its range end,
so every record is read by exactly one partition. Segments smaller than the
target are packed together into one partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from store.tierfiles import TierFile

from .framing import ScanRange
from .layout import SegmentInfo
from .live import LiveRange
from .tier import TierRange, plan_tier_file

__all__ = ["PARTITION_BYTES", "LogLayout", "Range", "plan_log", "plan_ranges", "readable_limit"]

Range = ScanRange | TierRange | LiveRange
"""What a partition reads: bytes of a local segment, rows of a tier file, or the live tail over the RPC."""

NO_END = (1 << 63) - 1

PARTITION_BYTES = 64 << 20
"""Spark pays ~60-70 ms per task on this machine: ~64 MiB of segment data per
partition keeps that overhead near 2% while still giving two cores work early."""


def readable_limit(seg: SegmentInfo, flushed: int | None) -> tuple[int, bool]:
    """Where reading ``seg`` must stop (a segment position) and whether the bytes
    below are known durable (``strict``: an invalid record there is corruption).

    The flushed hint and the sealed end are record boundaries; without either
    the whole file is readable and the data ends at the first invalid record.
    """
    limit, strict = seg.size, False
    if seg.end is not None:
        limit, strict = min(limit, seg.end - seg.base), True
    if flushed is not None:
        limit, strict = min(limit, max(0, flushed - seg.base)), True
    return limit, strict


def plan_ranges(
    segments: list[SegmentInfo],
    flushed: int | None,
    *,
    start: int = 0,
    end: int | None = None,
    from_ms: int | None = None,
    to_ms: int | None = None,
    target_bytes: int = PARTITION_BYTES,
) -> list[tuple[ScanRange, ...]]:
    """Group the readable bytes of ``segments`` between global offsets
    ``[start, end)`` into partitions of about ``target_bytes``.

    ``start`` must be a record boundary (0, or an offset a stream returned);
    ``end`` too, and then no range reads past it. Segments whose ``.meta``
    time bounds miss ``[from_ms, to_ms)`` are skipped whole.

    Returns one tuple of ranges per partition, in offset order.
    """
    if target_bytes <= 0:
        raise ValueError(f"the partition size must be positive, not {target_bytes}")
    return _group(_segment_pieces(segments, flushed, start, end, from_ms, to_ms, target_bytes), target_bytes)


def _segment_pieces(segments: list[SegmentInfo], flushed: int | None, start: int, end: int | None,
                    from_ms: int | None, to_ms: int | None, target_bytes: int) -> list[ScanRange]:
    """The byte ranges of ``segments`` in ``[start, end)``, each at most about ``target_bytes``."""
    pieces: list[ScanRange] = []
    for seg in segments:
        if _outside_time(seg, from_ms, to_ms):
            continue
        limit, strict = readable_limit(seg, flushed)
        if end is not None and end - seg.base < limit:
            limit, strict = max(0, end - seg.base), True
        first = max(0, start - seg.base)
        if first >= limit:
            continue
        count = -(-(limit - first) // target_bytes)
        step = -(-(limit - first) // count)
        for lo in range(first, limit, step):
            pieces.append(ScanRange(seg.path, seg.base, first, lo, min(lo + step, limit), limit, strict))
    return pieces


def _start(piece: Range) -> int:
    return piece.base + piece.start if isinstance(piece, ScanRange) else piece.start


def _group(pieces: Sequence[Range], target_bytes: int) -> list[tuple[Any, ...]]:
    """Pack consecutive pieces into partitions of about ``target_bytes``, in offset order."""
    partitions: list[tuple[Any, ...]] = []
    group: list[Any] = []
    size = 0
    for piece in pieces:
        if group and size + piece.nbytes > target_bytes:
            partitions.append(tuple(group))
            group, size = [], 0
        group.append(piece)
        size += piece.nbytes
    if group:
        partitions.append(tuple(group))
    return partitions


def _outside_time(seg: SegmentInfo, from_ms: int | None, to_ms: int | None) -> bool:
    """True when the segment's known store-time bounds miss ``[from_ms, to_ms)`` entirely."""
    if from_ms is not None and seg.max_store_ms is not None and seg.max_store_ms < from_ms:
        return True
    return to_ms is not None and seg.min_store_ms is not None and seg.min_store_ms >= to_ms


@dataclass(frozen=True)
class LogLayout:
    """The log as the driver sees it: the tier's files, the local segments not in the tier, and the live
    tail over the store's RPC (``store`` mode: no local segments, ``live_start``..``flushed``)."""

    segments: list[SegmentInfo] = field(default_factory=list)
    flushed: int | None = None
    tier_uri: str | None = None
    tier: list[TierFile] = field(default_factory=list)
    store: str | None = None
    store_token: str = ""
    live_start: int = 0

    @property
    def oldest(self) -> int | None:
        """The oldest offset still readable anywhere (None for an empty log)."""
        firsts = [f.base for f in self.tier[:1]] + [s.base for s in self.local()[:1]]
        if self.store is not None:
            firsts.append(self.live_start)
        return min(firsts) if firsts else None

    def local(self) -> list[SegmentInfo]:
        """The local segments read from files: those the tier does not hold."""
        held = {f.base for f in self.tier}
        return [s for s in self.segments if s.base not in held]

    def bases(self) -> list[int]:
        """Where the pieces of the log start, in order (record boundaries): the tier's files, the local
        segments and (``store`` mode) the live tail."""
        return sorted({f.base for f in self.tier} | {s.base for s in self.local()}
                      | ({self.live_start} if self.store is not None else set()))

    def end(self) -> int:
        """Where the durable log ends: the store's flushed offset, else the ``flushed`` hint, else 0."""
        return self.flushed or 0


def plan_log(layout: LogLayout, *, start: int = 0, end: int | None = None, from_ms: int | None = None,
             to_ms: int | None = None, target_bytes: int = PARTITION_BYTES) -> list[tuple[Range, ...]]:
    """Partitions reading each record of ``[start, end)`` exactly once: from the tier when it holds the
    segment, else from the local segment file, else (``store`` mode) over the RPC; in offset order."""
    if target_bytes <= 0:
        raise ValueError(f"the partition size must be positive, not {target_bytes}")
    stop = NO_END if end is None else end
    local = layout.local()
    bases = layout.bases()
    following = dict(zip(bases, [*bases[1:], NO_END]))
    pieces: list[Range] = []
    for tier_file in layout.tier:
        lo, hi = max(start, tier_file.base), min(stop, following[tier_file.base])
        if lo < hi:
            pieces += plan_tier_file(layout.tier_uri or "", tier_file, lo, hi, target_bytes)
    pieces += _segment_pieces(local, layout.flushed, start, end, from_ms, to_ms, target_bytes)
    if layout.store is not None and layout.flushed is not None:
        lo, hi = max(start, layout.live_start), min(stop, layout.flushed)
        if lo < hi:
            pieces.append(LiveRange(layout.store, layout.store_token, lo, hi))
    pieces.sort(key=_start)
    return _group(pieces, target_bytes)
