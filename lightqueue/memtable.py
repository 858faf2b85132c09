"""A RocksDB column family's memtable flushed in two steps: switched while its writer holds still, written while it
goes on.

``Rdict.flush(wait=True)`` switches the family's memtable and then waits until RocksDB wrote it as a table file:
hundreds of ms under load, and dispatch held its lock through all of it (store/dispatch.py). The switch alone is
quick and happens in the caller, also with ``wait=False``: the memtable written is exactly the writes made before
the call, however long the writing takes and whatever is written meanwhile. rocksdict has no call that waits for a
flush without switching again (which would take the later writes along), so :meth:`MemtableFlush.wait` looks at
the family's count of memtables still to write until it is zero.
"""

from __future__ import annotations

import time
from typing import final

import rocksdict

__all__ = ["MemtableFlush", "MemtableFlushError"]

POLL_S = 0.005
"""How often :meth:`MemtableFlush.wait` looks: a memtable takes tens to hundreds of ms to write."""

_UNWRITTEN = "rocksdb.num-immutable-mem-table"
_ERRORS = "rocksdb.background-errors"


class MemtableFlushError(RuntimeError):
    """RocksDB failed in the background while the memtable waited to be written (a full disk...)."""


@final
class MemtableFlush:
    """Switches a family's memtable (:meth:`start`) and waits until what it switched is on disk (:meth:`wait`).

    Resource handling: holds no handle; the caller passes its family to each call.
    """

    def __init__(self) -> None:
        self._errors = 0

    def start(self, family: rocksdict.Rdict) -> None:
        """Make the writes so far the next table file, without waiting for it (quick: no I/O)."""
        self._errors = family.property_int_value(_ERRORS) or 0
        family.flush(False)

    def wait(self, family: rocksdict.Rdict) -> None:
        """Return once every memtable switched so far is written (RocksDB writes them in order).

        Raises:
            MemtableFlushError: RocksDB reported a background error meanwhile (it then refuses writes).
        """
        while family.property_int_value(_UNWRITTEN):
            errors = family.property_int_value(_ERRORS) or 0
            if errors > self._errors:
                raise MemtableFlushError(f"RocksDB could not write a memtable ({_ERRORS}: {errors})")
            time.sleep(POLL_S)

    def flush(self, family: rocksdict.Rdict, *, wait: bool) -> None:
        """:meth:`start`, and :meth:`wait` if ``wait``."""
        self.start(family)
        if wait:
            self.wait(family)
