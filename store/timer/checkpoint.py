"""The timer's checkpoint: how far dispatch got, the counts at that point, and the redo of the files' last changes.

Opening the store must not walk the TimerLog (10 M pending entries are 640 MB): the wheel file and the counts
are kept as they were at the checkpoint instead. Between two checkpoints the wheel's slots and the ends of the
TimerLog's checkpointed entries change in memory only (store/timer/wheel.py, store/timer/timerlog.py); a
checkpoint carries those changes (a redo), is written atomically, and only then are they written into the files
in place. So after any crash the files plus the last checkpoint's redo are the state at that checkpoint (the
in-place writes of an older redo were fdatasynced before the newer checkpoint replaced it), and dispatch applies
the records after it again. Layout: docs/storage.md, "Delayed delivery".
"""

from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from crc32c import crc32c

from store.timer.timerlog import big_endian
from store.timer.wheel import SLOT, Slot

__all__ = ["TimerCheckpoint", "read_checkpoint", "write_checkpoint"]

MAGIC = b"LGT2"
_HEADER = struct.Struct(">4sQQQQQIIII")
_PAIR = struct.Struct(">QQ")
_SLOT_AT = struct.Struct(">Q")


@dataclass
class TimerCheckpoint:
    """The timer's state at CommitLog ``offset``, less what the files hold themselves."""

    offset: int = 0  # every record below it is applied
    count: int = 0  # TimerLog entries it covers (the rest is cut on open)
    pending: int = 0
    earliest: int = 0  # the lowest wheel second placed since the TimerLog was last empty (where dequeue starts)
    lowest_real: int = 0  # the Delayed offset of the TimerLog's first entry (ends older than it find nothing)
    buckets: dict[int, int] = field(default_factory=dict)  # pending entries per BUCKET_BITS of CommitLog
    clients: dict[int, int] = field(default_factory=dict)  # pending entries per client hash
    slots: dict[int, Slot] = field(default_factory=dict)  # redo: wheel slots by index
    ends: dict[int, int] = field(default_factory=dict)  # redo: TimerLog position -> done_at


def read_checkpoint(path: Path) -> TimerCheckpoint | None:
    """The checkpoint at ``path``; None when there is none, or it is damaged or of another format (the timer is
    then derived again from the whole log)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _HEADER.size + 4 or crc32c(data[:-4]) != int.from_bytes(data[-4:], "big"):
        return None
    magic, offset, count, pending, earliest, lowest_real, *sizes = _HEADER.unpack_from(data)
    n_buckets, n_clients, n_slots, n_ends = sizes
    if magic != MAGIC or len(data) != _HEADER.size + 4 + (n_buckets + n_clients + n_ends) * _PAIR.size \
            + n_slots * (_SLOT_AT.size + SLOT.size):
        return None
    at = _HEADER.size
    found = []
    for n in (n_buckets, n_clients):
        found.append(dict(_PAIR.iter_unpack(data[at:at + n * _PAIR.size])))
        at += n * _PAIR.size
    slots = {}
    for _ in range(n_slots):
        (index,) = _SLOT_AT.unpack_from(data, at)
        slots[index] = Slot._make(SLOT.unpack_from(data, at + _SLOT_AT.size))
        at += _SLOT_AT.size + SLOT.size
    ends = dict(_PAIR.iter_unpack(data[at:at + n_ends * _PAIR.size]))
    return TimerCheckpoint(offset, count, pending, earliest, lowest_real, found[0], found[1], slots, ends)


def _pairs(ends: dict[int, int]) -> bytes:
    """``ends`` as ``u64 position, u64 done_at`` pairs, each column copied in whole (100,000 ends: 3 ms, not 7 ms
    of ints packed one by one holding the GIL in the checkpoint writer's thread)."""
    pairs = array("Q", bytes(_PAIR.size * len(ends)))
    view = memoryview(pairs)
    view[0::2] = memoryview(array("Q", ends))
    view[1::2] = memoryview(array("Q", ends.values()))
    return big_endian(pairs).tobytes()


def write_checkpoint(path: Path, checkpoint: TimerCheckpoint) -> None:
    """Atomically: temporary file, fsync, rename, directory fsync."""
    c = checkpoint
    parts = [_HEADER.pack(MAGIC, c.offset, c.count, c.pending, c.earliest, c.lowest_real, len(c.buckets),
                          len(c.clients), len(c.slots), len(c.ends))]
    parts.extend(_PAIR.pack(*item) for counts in (c.buckets, c.clients) for item in counts.items())
    parts.extend(_SLOT_AT.pack(index) + SLOT.pack(*slot) for index, slot in c.slots.items())
    parts.append(_pairs(c.ends))
    body = b"".join(parts)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:  # a file object writes it whole (os.write may write a part)
        handle.write(body + crc32c(body).to_bytes(4, "big"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
