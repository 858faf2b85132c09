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
before runs, is a run of one); ``len`` is the u16 byte length of the string that
follows it, so a variable-length prefix never runs into the next field.
"""

from __future__ import annotations

import struct

__all__ = [
    "APPLIED",
    "CHECKPOINT",
    "ENTRY",
    "RUN_ENTRIES",
    "NEXT_FILTER_ID",
    "NEXT_ID",
    "RETAINED",
    "U16",
    "U64",
    "active_key",
    "entry_key",
    "entry_prefix",
    "held_by_key",
    "held_by_prefix",
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
]

U64 = struct.Struct(">Q")
U16 = struct.Struct(">H")

ENTRY = struct.Struct(">QIQ")
"""An index entry: CommitLog offset, record size, store timestamp (ms) - 20 bytes; an ``E`` key's value is a run."""

RUN_ENTRIES = 1024
"""Entries per ``E`` key at most. A key per entry cost dispatch a RocksDB put and a memtable insert per entry
and queue (about 1.5 us of a fan-in message's 25); a pull reads whole runs, so a run stays small enough
(20 KiB) that reading one for a few entries costs little."""

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
