"""Free space on the data disk: a full disk refuses new writes, is logged once, and clears by itself.

The CommitLog reports a full disk as ``LogFullError`` and leaves no trace of
the refused batch, so it can simply try again later. RocksDB cannot: once one
of its writes fails for lack of space (a WAL append, a memtable flush), it
refuses every write until the database is reopened (measured with rocksdict
0.3.29: writes keep failing after space is freed, and closing raises "Writer has
previous error"). So the store keeps a margin of free space for RocksDB: appends
are refused while less than ``margin`` bytes are free, and RocksDB writes are
not attempted below it either (``check``), which keeps it writable whoever
fills the disk. The condition is logged once when it starts and once when it
clears, however many writes it refuses meanwhile.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import final

from store.log.errors import LogFullError

__all__ = ["DiskSpace", "FULL_RETRY_S"]

LOGGER = logging.getLogger(__name__)

MiB = 1024 * 1024

MARGIN_SHARE = 64
"""The margin is 1/64 of the file system: room for RocksDB's WAL'd writes, a memtable flush and compaction
output while appends are refused..."""
MIN_MARGIN = 256 * 1024
MAX_MARGIN = 64 * MiB
"""...but at least 256 KiB (a small test tmpfs) and at most 64 MiB (one write buffer, store/rocks.py)."""

FULL_RETRY_S = 1.0
"""A write the full disk refused and that must still happen (a will, a session's deletion...) is tried again this
often: the store looks at its free space as often while the disk is full (store/node.py)."""

RECHECK_S = 0.01
"""Appends ask the file system for its free space at most this often while there is room: ``statvfs`` on every
append would cost a syscall per batch; a disk that fills faster than this still ends in ``LogFullError``."""


@final
class DiskSpace:
    """Whether the data disk under ``path`` has room, and the log lines of a full-disk episode.

    Thread-safe enough for its use: worker threads call :meth:`check`, and the
    worst a race does is one extra ``statvfs``.
    """

    def __init__(self, path: Path, margin: int | None = None) -> None:
        self._path = path
        if margin is None:
            st = os.statvfs(path)
            margin = min(MAX_MARGIN, max(MIN_MARGIN, st.f_blocks * st.f_frsize // MARGIN_SHARE))
        self.margin = margin
        self.full = False
        self.refusals = 0  # writes refused while full, since start
        self._checked = float("-inf")

    def free(self) -> int:
        """Bytes available to this process on the data disk now."""
        st = os.statvfs(self._path)
        return st.f_bavail * st.f_frsize

    def check(self, *, recent_ok: bool = False) -> None:
        """Raise ``LogFullError`` (ENOSPC) while less than the margin is free; call before writing.

        ``recent_ok``: trust a check that found room less than ``RECHECK_S`` ago (the append path).
        """
        now = time.monotonic()
        if recent_ok and not self.full and now - self._checked < RECHECK_S:
            return
        free = self.free()
        self._checked = now
        if free < self.margin:
            error = LogFullError(errno.ENOSPC, f"the data disk under {self._path} is full: {free} bytes free, "
                                               f"{self.margin} kept for the index database")
            self.refused(error)
            raise error
        self.cleared(free)

    def has_room(self) -> bool:
        """:meth:`check` as a boolean (a full disk is logged, not raised): may RocksDB write now?"""
        try:
            self.check()
        except LogFullError:
            return False
        return True

    def refused(self, error: OSError) -> None:
        """A write was refused for lack of space (by :meth:`check`, or ``LogFullError`` from the CommitLog)."""
        self.refusals += 1
        if self.full:
            return
        self.full = True
        LOGGER.error("data disk full: new QoS 1/2 messages are refused (MQTT 5: reason 0x97, 3.1.1: the connection "
                     "is closed), QoS 0 ones dropped, new subscriptions and CONNECTs that must delete a stored "
                     "session refused; delivery of stored messages goes on; resumes by itself once space is freed",
                     extra={"ctx": {"path": str(self._path), "error": str(error),
                                                      "margin_bytes": self.margin}})

    def cleared(self, free: int | None = None) -> None:
        """A write found room: ends a full-disk episode (logged once)."""
        if not self.full:
            return
        self.full = False
        LOGGER.warning("data disk has room again: messages are accepted again",
                       extra={"ctx": {"path": str(self._path), "free_bytes": free,
                                      "refused_since_start": self.refusals}})
