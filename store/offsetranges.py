"""Sets of queue offsets kept as ranges: what a consumer group member holds, and what it acknowledges.

A claim hands out runs of consecutive offsets (a batch record's messages are one run), and a consumer
acknowledges what it claimed: kept and sent as ``(base, count)`` ranges, a member's claims of 10,000 messages
cost a handful of ranges, not a set of 10,000 ints to fill, subtract and take the minimum of on every
acknowledgement (store/groups.py).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from typing import final

__all__ = ["OffsetRanges", "ranges_of"]

Range = tuple[int, int]
"""``(base, count)``: the offsets ``base`` to ``base + count - 1``."""


def ranges_of(offsets: Iterable[int]) -> list[Range]:
    """``offsets`` as ``(base, count)`` ranges of consecutive ones, in order (duplicates counted once).

    A claim's offsets are mostly one run: that case costs a sort, not a Python step per offset.
    """
    ordered = sorted(set(offsets))
    if not ordered:
        return []
    if ordered[-1] - ordered[0] + 1 == len(ordered):
        return [(ordered[0], len(ordered))]
    starts = [0, *(i for i in range(1, len(ordered)) if ordered[i] != ordered[i - 1] + 1), len(ordered)]
    return [(ordered[start], stop - start) for start, stop in zip(starts, starts[1:])]


@final
class OffsetRanges:
    """A set of offsets as sorted, disjoint, non-adjacent ranges; ``len`` is the number of offsets."""

    __slots__ = ("_starts", "_stops", "_count")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []  # exclusive; _stops[k] < _starts[k + 1]
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        for start, stop in zip(self._starts, self._stops):
            yield from range(start, stop)

    def ranges(self) -> list[Range]:
        return [(start, stop - start) for start, stop in zip(self._starts, self._stops)]

    def low(self) -> int | None:
        """The lowest offset, None when empty."""
        return self._starts[0] if self._starts else None

    def add(self, base: int, count: int) -> None:
        """Add offsets ``base`` to ``base + count - 1`` (a no-op for ``count`` < 1)."""
        if count < 1:
            return
        start, stop = base, base + count
        starts, stops = self._starts, self._stops
        first = bisect_left(stops, start)  # ranges ending at or after start touch or overlap it
        last = bisect_right(starts, stop)  # ... up to those starting at or before stop
        if first < last:
            start = min(start, starts[first])
            stop = max(stop, stops[last - 1])
            self._count -= sum(stops[k] - starts[k] for k in range(first, last))
        starts[first:last] = [start]
        stops[first:last] = [stop]
        self._count += stop - start

    def remove(self, base: int, count: int) -> int:
        """Remove offsets ``base`` to ``base + count - 1``; returns how many of them were in the set."""
        if count < 1:
            return 0
        start, stop = base, base + count
        starts, stops = self._starts, self._stops
        first = bisect_right(stops, start)  # the first range ending after start
        last = bisect_left(starts, stop)  # ... up to the last starting before stop
        if first >= last:
            return 0
        kept_starts: list[int] = []
        kept_stops: list[int] = []
        removed = 0
        for k in range(first, last):
            low, high = starts[k], stops[k]
            removed += min(high, stop) - max(low, start)
            if low < start:
                kept_starts.append(low)
                kept_stops.append(start)
            if high > stop:
                kept_starts.append(stop)
                kept_stops.append(high)
        starts[first:last] = kept_starts
        stops[first:last] = kept_stops
        self._count -= removed
        return removed

    def remove_below(self, below: int) -> int:
        """Remove every offset below ``below``; returns how many were removed."""
        low = self.low()
        return 0 if low is None else self.remove(low, below - low)
