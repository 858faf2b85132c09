"""The TimerLog: an append-only file of fixed-size entries, one per delayed message waiting in the wheel.

Each entry points at the ``Delayed`` control record in the CommitLog that carries the message (``offset_real``,
``size_real``) and links to the previous entry of the same wheel slot (``prev``), so a slot is a chain walked
backwards from its last entry, as in RocketMQ's TimerLog. It is derived from the log (store/timer/applier.py
appends and updates it while dispatch applies ``Delayed``, ``TimersFired`` and ``TimersRolled`` records), so it
can be rebuilt from the log. Entries are appended, and ended by setting ``done_at``: the end of an entry the last
checkpoint covers (``durable``) is kept in memory until the next checkpoint has recorded it (``ends``), so a crash
never leaves the file ahead of the checkpoint (store/timer/checkpoint.py); while a checkpoint writes the ends it
recorded into the file (in a thread of its own) they are read from ``writing``. This module knows the bytes only.
Layout: docs/storage.md, "Delayed delivery".
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from bisect import bisect_left
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Sequence, final

__all__ = ["ENTRY", "ENTRY_SIZE", "TimerEntry", "TimerLog", "big_endian", "read_entries"]

ENTRY = struct.Struct(">QQQQQQIIQ")
ENTRY_SIZE = ENTRY.size  # 64 bytes
_DONE_AT = struct.Struct(">Q")
_DONE_AT_AT = 40  # byte of done_at in an entry

READ_ENTRIES = 16384
"""Entries read per pread when the whole file is walked (recovery)."""

END_GAP = 64
"""Entries at most this many apart are read or written back in one block (4 KiB between two of them at most)."""

WRITE_BLOCK = 1024
"""Entries one block of ``TimerLog.write_ends`` spans at most (64 KiB read, patched and written back: Python
work on 1,024 ends at most between two calls that hand the GIL over)."""

SORT_SLICE = 16384
"""Ends ``TimerLog.write_ends`` sorts and looks up in one C call (which holds the GIL throughout): about 1 ms each;
sorting 100,000 ends in no order at once held it for 15 ms."""


class TimerEntry(NamedTuple):
    """One delayed message in the wheel. Positions are entry numbers + 1, so that 0 means "none"."""

    prev: int  # position of the previous entry of the same slot, 0: the first
    slot_s: int  # the second whose slot holds it (its due second, or the window's last when it is due beyond)
    due_ms: int  # when it is due, ms since the epoch
    offset_real: int  # CommitLog offset of its Delayed record
    made_at: int  # CommitLog offset of the record that made this entry (Delayed, or TimersRolled)
    done_at: int  # CommitLog offset of the record that ended it (TimersFired or TimersRolled); 0: pending
    size_real: int  # size of the Delayed record
    hash_topic: int  # CRC32C of the real topic (listing by topic)
    hash_client: int  # 64-bit hash of the publisher's client id (per-client counts)


@final
class TimerLog:
    """The TimerLog file: append, read and rewrite entries by position with pread/pwrite.

    Resource handling: :meth:`close` closes the file.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.count = os.fstat(self._fd).st_size // ENTRY_SIZE  # a torn last entry is ignored (and overwritten)
        self.durable = 0  # entries the last checkpoint covers: their ends wait in ``ends``
        self.ends: dict[int, int] = {}  # position -> done_at, of entries up to ``durable`` ended since
        self.writing: dict[int, int] = {}  # position -> done_at: ends a checkpoint recorded, being written
        self.reads = 0  # entries read since opened (a statistic: opening must not walk the file)

    def append(self, entry: TimerEntry) -> int:
        """Write ``entry`` at the end; returns its position."""
        os.pwrite(self._fd, ENTRY.pack(*entry), self.count * ENTRY_SIZE)
        self.count += 1
        return self.count

    def read(self, pos: int) -> TimerEntry:
        """The entry at position ``pos`` (1-based)."""
        self.reads += 1
        entry = TimerEntry._make(ENTRY.unpack(os.pread(self._fd, ENTRY_SIZE, (pos - 1) * ENTRY_SIZE)))
        done_at = self.ends.get(pos) or self.writing.get(pos)
        return entry if done_at is None else entry._replace(done_at=done_at)

    def end(self, pos: int, done_at: int) -> None:
        """Set the entry's ``done_at`` (in memory while the last checkpoint covers it)."""
        if pos <= self.durable:
            self.ends[pos] = done_at
        else:
            os.pwrite(self._fd, _DONE_AT.pack(done_at), (pos - 1) * ENTRY_SIZE + _DONE_AT_AT)

    def read_many(self, positions: list[int]) -> list[TimerEntry]:
        """The entries at ``positions`` (sorted, each at most ``count``), entries close together read as one
        block: a batch of ends (a ``TimersFired`` record) reads its entries in a few preads, not one each."""
        found = []
        ends, writing = self.ends, self.writing
        for first, block, group in self._blocks(positions):
            for pos in group:
                entry = TimerEntry._make(ENTRY.unpack_from(block, (pos - first) * ENTRY_SIZE))
                done_at = ends.get(pos) or writing.get(pos)
                found.append(entry if done_at is None else entry._replace(done_at=done_at))
        self.reads += len(found)
        return found

    def write_ends(self, ends: Mapping[int, int]) -> None:
        """Write ``ends`` (position -> done_at) into the file, entries close together read, patched and written back
        as one block. The checkpoint writer's thread runs this while the event loop and dispatch go on, so it holds
        the GIL in short stretches: a C call (a sort, a lookup of many) does not hand it over, and is made on
        ``SORT_SLICE`` ends at a time; a block's pread and pwrite do. A checkpoint carries up to ``ENDS_FLUSH`` ends
        (store/timer/applier.py): packed one by one, 100,000 of them held it for about 30 ms."""
        given = list(ends)
        keys = given.copy()
        for start in range(0, len(keys), SORT_SLICE):
            keys[start:start + SORT_SLICE] = sorted(keys[start:start + SORT_SLICE])
        keys.sort()  # merges the sorted slices
        positions, done = array("Q", keys), array("Q")
        if keys == given:  # ended in file order (firing in due order): the values are in order already
            done.extend(ends.values())
        else:
            for start in range(0, len(keys), SORT_SLICE):
                done.extend(map(ends.__getitem__, keys[start:start + SORT_SLICE]))
        self._patch(positions, big_endian(done))

    def _patch(self, positions: array, done: array) -> None:
        """Set the ``done_at`` of the entries at ``positions`` (sorted) to ``done`` (:func:`big_endian`), a block at a
        time: the block read, its ``done_at`` column patched, and written back as it was around the ends."""
        i, count = 0, len(positions)
        while i < count:
            first = positions[i]
            k = bisect_left(positions, first + WRITE_BLOCK, i)
            if positions[k - 1] - first >= (k - i) * END_GAP:  # sparse: the neighbours only
                k = _group(positions, i, WRITE_BLOCK)
            span = positions[k - 1] - first + 1
            block = bytearray(os.pread(self._fd, span * ENTRY_SIZE, (first - 1) * ENTRY_SIZE))
            column = memoryview(block).cast("Q")[_DONE_AT_AT // 8::ENTRY_SIZE // 8]  # big-endian bytes, as done
            if span == k - i:  # a run of ended entries (firing in due order makes them): one strided copy
                column[:] = memoryview(done)[i:k]
            else:
                for pos, value in zip(positions[i:k], done[i:k]):
                    column[pos - first] = value
            os.pwrite(self._fd, block, (first - 1) * ENTRY_SIZE)
            i = k

    def _blocks(self, positions: list[int]) -> Iterator[tuple[int, bytearray, list[int]]]:
        """``positions`` (sorted) in groups of neighbours (:func:`_group`), each with its first position and the
        entries from there to its last, read with one pread."""
        i, count = 0, len(positions)
        while i < count:
            k = _group(positions, i, READ_ENTRIES)
            first, last = positions[i], positions[k - 1]
            yield first, bytearray(os.pread(self._fd, (last - first + 1) * ENTRY_SIZE, (first - 1) * ENTRY_SIZE)), \
                positions[i:k]
            i = k

    def write(self, pos: int, entry: TimerEntry) -> None:
        """Rewrite an entry in place (a rebuild, which writes a checkpoint after it)."""
        os.pwrite(self._fd, ENTRY.pack(*entry), (pos - 1) * ENTRY_SIZE)

    def entries(self, start: int = 1, stop: int | None = None) -> Iterator[tuple[int, TimerEntry]]:
        """The entries from position ``start`` to ``stop`` (default: the last) with their positions, in file order
        (a walk in large reads), the ends kept in memory since the checkpoint applied."""
        for item in read_entries(self._fd, self.count if stop is None else min(stop, self.count), self.ends, start,
                                 self.writing):
            self.reads += 1
            yield item

    def truncate(self, count: int) -> None:
        """Keep the first ``count`` entries."""
        os.ftruncate(self._fd, count * ENTRY_SIZE)
        self.count = count
        self.durable = min(self.durable, count)
        self.ends = {pos: at for pos, at in self.ends.items() if pos <= count}

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def read_entries(fd: int, count: int, ends: Mapping[int, int], start: int = 1,
                 writing: Mapping[int, int] | None = None) -> Iterator[tuple[int, TimerEntry]]:
    """The entries ``start`` to ``count`` of the TimerLog file open at ``fd``, with their positions and ``ends``
    (position -> done_at), then ``writing``, applied, in file order: a walk in large reads."""
    writing = writing or {}
    pos = start
    while pos <= count:
        chunk = os.pread(fd, min(READ_ENTRIES, count - pos + 1) * ENTRY_SIZE, (pos - 1) * ENTRY_SIZE)
        for fields in ENTRY.iter_unpack(chunk[: len(chunk) - len(chunk) % ENTRY_SIZE]):
            entry = TimerEntry._make(fields)
            done_at = ends.get(pos) or writing.get(pos)
            yield pos, entry if done_at is None else entry._replace(done_at=done_at)
            pos += 1
        if len(chunk) < ENTRY_SIZE:
            break


def _group(positions: Sequence[int], i: int, span: int) -> int:
    """The end of the group of neighbours of ``positions`` (sorted) from index ``i``: positions at most ``END_GAP``
    apart, spanning fewer than ``span`` entries."""
    first = last = positions[i]
    k, count = i + 1, len(positions)
    while k < count and positions[k] - last <= END_GAP and positions[k] - first < span:
        last = positions[k]
        k += 1
    return k


def big_endian(values: array) -> array:
    """``values`` (an array of u64, changed in place) whose items, stored natively, are their big-endian bytes: the
    files' byte order, written from the array's buffer (or a view of it) in one copy, not packed one by one."""
    if sys.byteorder == "little":
        values.byteswap()
    return values
