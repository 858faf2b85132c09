"""The POP groups' state, derived from the log: a ``ControlApplier`` (store/dispatch.py) over :class:`PopBook`.

Dispatch applies the POP control records here in log order (store/control.py), so a replica's dispatch, or a
rebuild after the index was deleted, derives the same groups. The state is in memory (bounded: ``MAX_INFLIGHT``
per group) and persisted by the dispatcher's flush, one RocksDB value per group that changed (family ``pop``,
through ``DerivedFamily``: no WAL, written after the CommitLog's flush, so it never holds what the log lost); a
start loads it and dispatch applies the records from its checkpoint on.

Readers (the pops, the revive step: store/pop/pops.py) run in the trio thread while dispatch applies in its own:
every access goes through :meth:`PopApplier.read` under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar, final

import msgspec
import rocksdict

from store.control import Control, PopAcked, PopCheckpoint, PopRestated, PopRevived
from store.derived import DerivedFamily
from store.log.record import Record
from store.pop.state import PopBook, PopGroup

__all__ = ["FAMILY", "PopApplier"]

FAMILY = "pop"
"""The RocksDB column family of the POP groups: key ``<group>\\0<queue>``, value the group's ``PopGroup``."""

_KINDS = (PopCheckpoint, PopAcked, PopRevived, PopRestated)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(PopGroup)

T = TypeVar("T")


@final
class PopApplier:
    """The ``ControlApplier`` of POP consumption (see the module docstring).

    Resource handling: the caller owns ``db``; :meth:`close` before closing it.
    """

    def __init__(self, db: rocksdict.Rdict) -> None:
        self._family = DerivedFamily(db, FAMILY)
        self._lock = threading.Lock()
        self._book = PopBook()
        self._dirty: set[tuple[str, str]] = set()
        self._applied = self._family.checkpoint  # just past the last POP record applied
        self._load()

    def _load(self) -> None:
        for key, value in self._family.items():
            group, _, queue = key.partition("\0")
            self._book.groups[(group, queue)] = _DECODER.decode(value)

    # -- ControlApplier ----------------------------------------------------------------------------------------

    @property
    def checkpoint(self) -> int:
        return self._family.checkpoint

    def apply(self, record: Record, control: Control) -> None:
        if not isinstance(control, _KINDS):
            return
        with self._lock:
            key = self._book.apply(record.offset, control)
            if key is not None:
                self._dirty.add(key)
            self._applied = max(self._applied, record.offset + record.size)

    def flush(self, offset: int) -> None:
        with self._lock:
            groups = self._book.groups
            for key in self._dirty:
                self._family.put(f"{key[0]}\0{key[1]}", _ENCODER.encode(groups[key]), max(0, offset - 1))
            self._dirty.clear()
            self._family.flush(offset, wait=False)

    def settle(self) -> None:
        self._family.settle()

    def rewind(self, log_end: int) -> None:
        """Records at or past ``log_end`` were applied: forget every group (memory and family) and let dispatch
        apply the log again from its start (the retention prelude restated what it deleted)."""
        with self._lock:
            if self._applied <= log_end and self._family.checkpoint <= log_end:
                return
            self._family.rewind(0)
            self._book.groups.clear()
            self._dirty.clear()
            self._applied = 0

    def restate(self) -> Iterable[Control]:
        with self._lock:
            return list(self._book.restate())

    def close(self) -> None:
        self._family.close()

    # -- what the pops read ------------------------------------------------------------------------------------

    def read(self, what: Callable[[PopBook], T]) -> T:
        """``what(book)`` under the lock: a consistent look at the groups (keep it short: dispatch waits)."""
        with self._lock:
            return what(self._book)
