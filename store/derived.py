"""A RocksDB column family derived from control records: what a ``ControlApplier`` keeps by client id.

Dispatch applies control records in log order (store/dispatch.py); the family is only their product, so its writes
skip the WAL (a crash re-applies the log from the family's checkpoint) and it is persisted by the dispatcher's
flush, after the CommitLog's, so it never holds what the log lost. Deleting the family makes the next start
derive it again from the log.

Storage: key the client id (UTF-8), value what the applier keeps for it; the checkpoint (every control record
below it applied) under ``CHECKPOINT_KEY``, a byte that is no UTF-8 text, so no client id is it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from typing import final

import rocksdict

from lightqueue.memtable import MemtableFlush
from store.rocks import open_family

__all__ = ["APPLIED_KEY", "CHECKPOINT_KEY", "DerivedApplier", "DerivedFamily"]

CHECKPOINT_KEY = b"\xff"
APPLIED_KEY = b"\xfe"
"""Just past the last record applied, written before each change it makes (no WAL either): if RocksDB flushes the
family's memtable on its own and the log then loses its tail (a power loss under ``async``), the change cannot be
on disk without this mark, and :meth:`DerivedFamily.rewind` sees that a record past the log's end was applied."""
_MARKS = (CHECKPOINT_KEY, APPLIED_KEY)

_U64 = struct.Struct(">Q")
_NO_WAL = rocksdict.WriteOptions()
_NO_WAL.disable_wal = True


@final
class DerivedFamily:
    """One derived column family of the node's database (see the module docstring).

    ``legacy``: the family has entries and no checkpoint: written with the WAL by a version before control records,
    so the log does not hold what made it; its applier restates it once (``open_store``).

    Resource handling: the caller owns ``db``; :meth:`close` before closing it.
    """

    def __init__(self, db: rocksdict.Rdict, name: str) -> None:
        self._family: rocksdict.Rdict = open_family(db, name)
        self._db = db
        self._handle = db.get_column_family_handle(name)
        self._memtable = MemtableFlush()
        self._taken: int | None = None  # the checkpoint the last flush took, until it is on disk
        raw = self._family.get(CHECKPOINT_KEY)
        self.checkpoint = _U64.unpack(raw)[0] if raw is not None else 0
        mark = self._family.get(APPLIED_KEY)
        self.legacy = raw is None and mark is None and any(True for _ in self._family.keys())
        self.applied_end = max(self.checkpoint, _U64.unpack(mark)[0] if mark is not None else 0)

    def get(self, client_id: str) -> bytes | None:
        return self._family.get(client_id.encode())

    def put(self, client_id: str, value: bytes, offset: int) -> None:
        """Keep ``value`` for ``client_id``, as applied from the record at ``offset``."""
        self._mark(offset)
        self._family.put(client_id.encode(), value, _NO_WAL)

    def patch(self, entries: Mapping[str, bytes], offset: int) -> None:
        """:meth:`put` of each entry, :meth:`delete` of each empty one (an existing key only), the mark with them, in
        one write: a session patch holds a part per subscription (67 on average in issue 31's attack), and a write
        of each, with its mark, cost 4x as much as the batch."""
        family = self._family
        handle = self._handle
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, value in entries.items():
            raw = key.encode()
            if value:
                batch.put(raw, value, handle)
            elif family.get(raw) is not None:
                batch.delete(raw, handle)
        self.applied(offset)
        if batch.is_empty():
            return
        batch.put(APPLIED_KEY, _U64.pack(self.applied_end), handle)
        self._db.write(batch, _NO_WAL)

    def delete(self, client_id: str, offset: int) -> None:
        """Forget ``client_id`` (a record at ``offset`` said so); nothing is written when it has nothing."""
        key = client_id.encode()
        if self._family.get(key) is not None:
            self._mark(offset)
            self._family.delete(key, _NO_WAL)
        else:
            self.applied(offset)

    def applied(self, offset: int) -> None:
        """The record at ``offset`` was applied (whatever it changed)."""
        self.applied_end = max(self.applied_end, offset + 1)

    def _mark(self, offset: int) -> None:
        """The record at ``offset`` is about to change the family: its mark goes first (``APPLIED_KEY``)."""
        self.applied(offset)
        self._family.put(APPLIED_KEY, _U64.pack(self.applied_end), _NO_WAL)

    def items(self) -> Iterator[tuple[str, bytes]]:
        """Every entry (blocking: a scan of the family)."""
        for key, value in self._family.items():
            if key not in _MARKS:
                yield key.decode(), value

    def under(self, prefix: str) -> list[tuple[str, bytes]]:
        """The entries whose key starts with ``prefix`` (blocking: a seek and a range of the family)."""
        start = prefix.encode()
        found = []
        for key, value in self._family.items(from_key=start):
            if not key.startswith(start) or key in _MARKS:
                break
            found.append((key.decode(), value))
        return found

    def delete_under(self, prefix: str, offset: int) -> None:
        """Forget every entry whose key starts with ``prefix`` (a record at ``offset`` said so), in one range
        deletion (UTF-8 never holds the byte 0xFF, so it ends the range); nothing is written when there is none."""
        start = prefix.encode()
        first = next(iter(self._family.keys(from_key=start)), None)
        if first is None or not first.startswith(start):
            self.applied(offset)
            return
        self._mark(offset)
        self._family.delete_range(start, start + b"\xff", _NO_WAL)

    def keys(self) -> Iterator[str]:
        """Every client id (blocking: a scan of the keys only)."""
        for key in self._family.keys():
            if key not in _MARKS:
                yield key.decode()

    def flush(self, offset: int, *, wait: bool = True) -> None:
        """Move the checkpoint to ``offset`` and persist the family (the dispatcher's flush, after the log's);
        ``wait=False``: only switch the memtable, and let :meth:`settle` wait until it is written and move
        :attr:`checkpoint` (``LightQueues.flush``)."""
        self._family.put(CHECKPOINT_KEY, _U64.pack(offset), _NO_WAL)
        self._taken = offset
        self._memtable.flush(self._family, wait=False)
        if wait:
            self.settle()

    def settle(self) -> None:
        """Return once the memtable :meth:`flush` switched is on disk, its checkpoint then :attr:`checkpoint`."""
        self._memtable.wait(self._family)
        if self._taken is not None:
            self.checkpoint, self._taken = self._taken, None
            self.legacy = False

    def rewind(self, log_end: int) -> bool:
        """The log now ends at ``log_end``: when a record at or past it was applied, forget everything and start
        again from the log's first record (the family keeps no history). Whether it did."""
        if self.applied_end <= log_end and self.checkpoint <= log_end:
            return False
        for key in list(self._family.keys()):
            self._family.delete(key, _NO_WAL)
        self.flush(0)
        self.applied_end = 0
        return True

    def close(self) -> None:
        """Release the family handles (they keep the database open)."""
        self._family.close()
        del self._handle


class DerivedApplier:
    """What a ``ControlApplier`` that keeps one ``DerivedFamily`` (``name``) does the same as every other: its
    checkpoint, flush, rewind and close; ``legacy`` as the family's. Subclasses apply and restate."""

    def __init__(self, db: rocksdict.Rdict, name: str) -> None:
        self._family = DerivedFamily(db, name)

    @property
    def checkpoint(self) -> int:
        return self._family.checkpoint

    @property
    def legacy(self) -> bool:
        """Entries written before control records existed: the applier's ``restate`` makes them records once."""
        return self._family.legacy

    def flush(self, offset: int) -> None:
        self._family.flush(offset, wait=False)

    def settle(self) -> None:
        self._family.settle()

    def rewind(self, log_end: int) -> None:
        self._family.rewind(log_end)

    def close(self) -> None:
        self._family.close()
