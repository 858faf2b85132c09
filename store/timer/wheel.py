"""The TimerWheel: a file of fixed slots, one per second over a window used as a ring.

The slot of second ``s`` is ``s % window``; it holds the chain of TimerLog entries (store/timer/timerlog.py)
placed at that second: ``{delayed_s, first, last, num, pending}`` as in RocketMQ's TimerWheel, with ``pending``
the entries of the chain not fired yet (a slot whose last entry ends is cleared, so the next revolution starts a
new chain). A file, not a heap in memory: a week of seconds is 1.2 M slots, 39 MB of mostly sparse zeros.
The file holds the wheel as of the timer's last checkpoint (store/timer/checkpoint.py): a slot changed since then
is kept in memory (``dirty``) until the next checkpoint has recorded it, so a crash never leaves the file ahead of
the checkpoint; while a checkpoint writes the slots it recorded into the file (in a thread of its own) they are
read from ``writing``. The wheel is derived from the TimerLog: ``clear`` empties it before a rebuild.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import NamedTuple, final

__all__ = ["EMPTY", "SLOT_SIZE", "Slot", "TimerWheel"]

SLOT = struct.Struct(">QQQII")
SLOT_SIZE = SLOT.size  # 32 bytes

READ_SLOTS = 32768
"""Slots read per pread when the whole wheel is scanned."""


class Slot(NamedTuple):
    delayed_s: int  # the earliest second placed in this chain (0: empty slot)
    first: int  # TimerLog position of the chain's first entry (0: none)
    last: int  # ... and of its last entry, where a walk starts
    num: int  # entries in the chain
    pending: int  # entries of the chain not fired (nor rolled) yet


EMPTY = Slot(0, 0, 0, 0, 0)


@final
class TimerWheel:
    """The wheel file of ``window`` slots, as it was left (``fresh``: it was not there, or had another window, and
    was cleared: the caller rebuilds it from the TimerLog).

    Resource handling: :meth:`close` closes the file.
    """

    def __init__(self, path: Path, window: int) -> None:
        if window < 2:
            raise ValueError(f"a timer wheel needs at least 2 slots, not {window}")
        self.window = window
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.dirty: dict[int, Slot] = {}  # slot index -> slot, changed since the last checkpoint
        self.writing: dict[int, Slot] = {}  # slot index -> slot: a checkpoint recorded it, being written into the file
        self.fresh = os.fstat(self._fd).st_size != window * SLOT_SIZE
        if self.fresh:
            self.clear()

    def get(self, second: int) -> Slot:
        index = second % self.window
        slot = self.dirty.get(index) or self.writing.get(index)
        return slot if slot is not None else Slot._make(SLOT.unpack(os.pread(self._fd, SLOT_SIZE, index * SLOT_SIZE)))

    def put(self, second: int, slot: Slot) -> None:
        """Change a slot (in memory until a checkpoint recorded it and wrote it into the file)."""
        self.dirty[second % self.window] = slot

    def write(self, slots: dict[int, Slot]) -> None:
        """Write ``slots`` (by index) into the file."""
        for index, slot in slots.items():
            os.pwrite(self._fd, SLOT.pack(*slot), index * SLOT_SIZE)

    def next_due(self, first: int, last: int) -> int | None:
        """The first second of ``[first, last]`` whose slot holds pending entries placed at it or before (a scan
        in large reads: after a restart the dequeue step jumps over the empty seconds); None if there is none.
        A range longer than the window is scanned over its last window only: that visits every slot once, at the
        latest second it stands for, so an entry placed at any second up to ``last`` is found."""
        second = max(first, last - self.window + 1)
        dirty, writing = self.dirty, self.writing
        while second <= last:
            index = second % self.window
            count = min(READ_SLOTS, self.window - index, last - second + 1)
            chunk = os.pread(self._fd, count * SLOT_SIZE, index * SLOT_SIZE)
            for i, (delayed_s, _, _, _, pending) in enumerate(SLOT.iter_unpack(chunk)):
                changed = (dirty.get(index + i) if dirty else None) or (writing.get(index + i) if writing else None)
                if changed is not None:
                    delayed_s, pending = changed.delayed_s, changed.pending
                if pending and delayed_s <= second + i:
                    return second + i
            second += count
        return None

    def clear(self) -> None:
        """Every slot empty (sparse zeros)."""
        self.dirty = {}
        self.writing = {}
        os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, self.window * SLOT_SIZE)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)
