"""The light queues' RocksDB key layout: one byte of key type, then big-endian fields.

Everything lives in one column family, so a memtable flush persists one
consistent prefix of all writes. The first byte says what a key is:

    key                                        value                           written
    C                                          u64 CommitLog offset dispatched up to   index batch (no WAL)
    c                                          u64 CommitLog offset control records are applied up to  no WAL
    I                                          u64 next topic queue id (from 2^32)      index batch (no WAL)
    F                                          u64 next filter queue id (below 2^32)    with an activation (no WAL)
    T                                          u64 CommitLog min offset retention has applied  with WAL
    N name                                     u64 queue id                    index batch or activation (no WAL)
    Q id                                       name (UTF-8)                    index batch or activation (no WAL)
    E id qoff                                  a run of entries from qoff: per entry u64 log offset,
                                               u32 size, u64 store ms (20 bytes)      index batch (no WAL)
                                               or a batch run: "B", then per batch record u64 log
                                               offset, u32 size, u64 store ms, u32 count (24 bytes)
    M id                                       u64 max queue offset (next to write)    index batch (no WAL)
    m id                                       u64 min queue offset (first kept)       with WAL, after a flush
    A filter                                   u64 log offset it is active since       activation (no WAL)
    H len filter holder                        (empty): filter held by holder          activation (no WAL)
    h len holder filter                        (empty): the same, by holder            activation (no WAL)
    O len owner id                             u64 next offset to consume              commit (no WAL)
    R id owner                                 (empty): queue id referenced by owner   commit (no WAL)

Everything but ``m`` and ``T`` is derived from the CommitLog: messages (index batches) and control records
(activations, releases, commits, session ends: store/queuecontrol.py applies them).

``id`` and ``qoff`` are u64 big-endian, so one queue's runs are contiguous
and sorted by queue offset (a run holds the consecutive entries one dispatch
batch gave the queue, at most ``RUN_ENTRIES``; one entry per key, the layout
before runs, is a run of one); a batch record (store/log/record.py, ``FLAG_BATCH``) is one entry of a *batch run*
for its ``count`` queue offsets (base + i is its message i, at log position offset + i), so a queue's consecutive
batch records of one dispatch batch share a key and cost 24 bytes each however many messages they hold. A batch
run's value is 1 + 24n bytes, never a multiple of 20: the two kinds are told apart by the value. ``len`` is the u16 byte length of the string that
follows it, so a variable-length prefix never runs into the next field.
"""

from __future__ import annotations

import struct
from typing import Callable, Iterator

__all__ = [
    "APPLIED",
    "BATCH_ENTRY",
    "BATCH_RUN",
    "CHECKPOINT",
    "ENTRY",
    "RUN_ENTRIES",
    "NEXT_FILTER_ID",
    "NEXT_ID",
    "RETAINED",
    "U16",
    "U64",
    "active_key",
    "cut_run",
    "entry_key",
    "entry_prefix",
    "is_batch_run",
    "held_by_key",
    "held_by_prefix",
    "holding_keys",
    "holder_key",
    "holder_prefix",
    "id_key",
    "max_key",
    "min_key",
    "name_key",
    "offset_key",
    "offset_prefix",
    "prefix_end",
    "ref_key",
    "ref_prefix",
    "run_entries",
    "run_span",
]

U64 = struct.Struct(">Q")
U16 = struct.Struct(">H")

ENTRY = struct.Struct(">QIQ")
"""An index entry: CommitLog offset, record size, store timestamp (ms) - 20 bytes; an ``E`` key's value is a run."""

RUN_ENTRIES = 1024
"""Entries per ``E`` key at most. A key per entry cost dispatch a RocksDB put and a memtable insert per entry
and queue (about 1.5 us of a fan-in message's 25); a pull reads whole runs, so a run stays small enough
(20 KiB) that reading one for a few entries costs little."""

BATCH_ENTRY = struct.Struct(">QIQI")
"""A batch record's index entry: CommitLog offset, record size, store timestamp (ms), message count - 24 bytes."""

BATCH_RUN = b"B"
"""The first byte of a batch run's value (its entries follow)."""

CHECKPOINT = b"C"
APPLIED = b"c"
NEXT_ID = b"I"
NEXT_FILTER_ID = b"F"
RETAINED = b"T"


def _str(text: str) -> bytes:
    raw = text.encode()
    return U16.pack(len(raw)) + raw


def name_key(name: str) -> bytes:
    return b"N" + name.encode()


def id_key(qid: int) -> bytes:
    return b"Q" + U64.pack(qid)


def entry_prefix(qid: int) -> bytes:
    return b"E" + U64.pack(qid)


def entry_key(qid: int, qoff: int) -> bytes:
    return b"E" + U64.pack(qid) + U64.pack(qoff)


def max_key(qid: int) -> bytes:
    return b"M" + U64.pack(qid)


def min_key(qid: int) -> bytes:
    return b"m" + U64.pack(qid)


def active_key(filter: str) -> bytes:
    return b"A" + filter.encode()


def holder_prefix(filter: str) -> bytes:
    return b"H" + _str(filter)


def holder_key(filter: str, holder: str) -> bytes:
    return holder_prefix(filter) + holder.encode()


def held_by_prefix(holder: str) -> bytes:
    return b"h" + _str(holder)


def held_by_key(holder: str, filter: str) -> bytes:
    return held_by_prefix(holder) + filter.encode()


def holding_keys(holder: str) -> Callable[[str], tuple[bytes, bytes]]:
    """``filter -> (holder_key(filter, holder), held_by_key(holder, filter))`` for one holder, its part encoded
    once: a run of a holder's activations (issue 31: 62 filters a run, 50,000 in all) made both keys a filter, four
    calls and two encodings of each name."""
    tail = holder.encode()
    by_holder = held_by_prefix(holder)

    def of(filter: str) -> tuple[bytes, bytes]:
        raw = filter.encode()
        return b"H" + U16.pack(len(raw)) + raw + tail, by_holder + raw

    return of


def offset_prefix(owner: str) -> bytes:
    return b"O" + _str(owner)


def offset_key(owner: str, qid: int) -> bytes:
    return offset_prefix(owner) + U64.pack(qid)


def ref_prefix(qid: int) -> bytes:
    return b"R" + U64.pack(qid)


def ref_key(qid: int, owner: str) -> bytes:
    return ref_prefix(qid) + owner.encode()


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix`` (an exclusive upper bound)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        raise ValueError("a prefix of only 0xff bytes has no upper bound")
    return stripped[:-1] + bytes([stripped[-1] + 1])


def is_batch_run(value: bytes) -> bool:
    """Is this ``E`` value a batch run (else a run of single records' entries)?"""
    return len(value) % ENTRY.size != 0 and value[:1] == BATCH_RUN


def run_entries(first: int, value: bytes) -> Iterator[tuple[int, int, int, int, int]]:
    """The entries of an ``E`` key's run starting at queue offset ``first``, as ``(queue offset, log offset, size,
    store ms, count)``: count 0 for a single record (one queue offset), the message count for a batch record."""
    if not is_batch_run(value):
        for i, (log_offset, size, store_ms) in enumerate(ENTRY.iter_unpack(value)):
            yield first + i, log_offset, size, store_ms, 0
        return
    qoff = first
    for log_offset, size, store_ms, count in BATCH_ENTRY.iter_unpack(value[1:]):
        yield qoff, log_offset, size, store_ms, count
        qoff += count


def run_span(value: bytes) -> int:
    """How many queue offsets a run covers."""
    if not is_batch_run(value):
        return len(value) // ENTRY.size
    return sum(count for _, _, _, count in BATCH_ENTRY.iter_unpack(value[1:]))


def cut_run(first: int, value: bytes, end: int) -> bytes:
    """The run starting at ``first`` without its entries at or past queue offset ``end`` (which starts an entry)."""
    if not is_batch_run(value):
        return value[:(end - first) * ENTRY.size]
    kept = sum(1 for qoff, _, _, _, count in run_entries(first, value) if qoff + count <= end)
    return value[:1 + kept * BATCH_ENTRY.size]
