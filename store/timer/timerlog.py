"""The TimerLog: an append-only file of fixed-size entries, one per delayed message waiting in the wheel.

Each entry points at the ``Delayed`` control record in the CommitLog that carries the message (``offset_real``,
``size_real``) and links to the previous entry of the same wheel slot (``prev``), so a slot is a chain walked
backwards from its last entry, as in RocketMQ's TimerLog. It is derived from the log (store/timer/applier.py
appends and updates it while dispatch applies ``Delayed``, ``TimersFired`` and ``TimersRolled`` records), so it
can be rebuilt from the log. This module knows the bytes only. Layout: docs/storage.md, "Delayed delivery".
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator, NamedTuple, final

__all__ = ["ENTRY", "ENTRY_SIZE", "TimerEntry", "TimerLog"]

ENTRY = struct.Struct(">QQQQQQIIQ")
ENTRY_SIZE = ENTRY.size  # 64 bytes

READ_ENTRIES = 16384
"""Entries read per pread when the whole file is walked (recovery)."""


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

    def append(self, entry: TimerEntry) -> int:
        """Write ``entry`` at the end; returns its position."""
        os.pwrite(self._fd, ENTRY.pack(*entry), self.count * ENTRY_SIZE)
        self.count += 1
        return self.count

    def read(self, pos: int) -> TimerEntry:
        """The entry at position ``pos`` (1-based)."""
        return TimerEntry._make(ENTRY.unpack(os.pread(self._fd, ENTRY_SIZE, (pos - 1) * ENTRY_SIZE)))

    def write(self, pos: int, entry: TimerEntry) -> None:
        os.pwrite(self._fd, ENTRY.pack(*entry), (pos - 1) * ENTRY_SIZE)

    def entries(self, start: int = 1, stop: int | None = None) -> Iterator[tuple[int, TimerEntry]]:
        """The entries from position ``start`` to ``stop`` (default: the last) with their positions, in file order
        (a walk in large reads)."""
        pos = start
        end = self.count if stop is None else min(stop, self.count)
        while pos <= end:
            chunk = os.pread(self._fd, min(READ_ENTRIES, end - pos + 1) * ENTRY_SIZE, (pos - 1) * ENTRY_SIZE)
            for fields in ENTRY.iter_unpack(chunk[: len(chunk) - len(chunk) % ENTRY_SIZE]):
                yield pos, TimerEntry._make(fields)
                pos += 1
            if len(chunk) < ENTRY_SIZE:
                break

    def truncate(self, count: int) -> None:
        """Keep the first ``count`` entries."""
        os.ftruncate(self._fd, count * ENTRY_SIZE)
        self.count = count

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)
