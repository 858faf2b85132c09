"""The CommitLog's exceptions, in one place (the record-format ones are re-exported)."""

from __future__ import annotations

import errno

from store.log.record import CorruptRecord, RecordTooLarge

__all__ = ["CorruptRecord", "InvalidOffset", "LogFullError", "OffsetExpired", "RecordTooLarge",
           "RetentionDeferred", "StartupError",
           "FULL_ERRNOS"]

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errnos that mean "no room": the log stays usable and appends work again once space frees."""


class LogFullError(OSError):
    """An append could not be written because the disk (or quota) is full.

    Carries the original ``errno``. Nothing already stored was damaged and the
    rejected batch left no trace; retry once space is freed.
    """


class StartupError(Exception):
    """The store cannot open its data: the message is the one line an operator needs (what happened, what to do)."""


class OffsetExpired(LookupError):
    """The offset is below the log's minimum offset: retention deleted it."""

    def __init__(self, offset: int, min_offset: int) -> None:
        super().__init__(f"offset {offset} has expired: retention deleted it (the log now starts at {min_offset})")
        self.offset = offset
        self.min_offset = min_offset


class RetentionDeferred(Exception):
    """A retention prelude could not do its part now (a replicated log's end was not confirmed in time): nothing
    is deleted this run, and ``CommitLog.delete_expired`` says why in one log line (no traceback: not a fault)."""


class InvalidOffset(ValueError):
    """No record starts at this offset: it is negative, beyond the written end, or not a record boundary."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"offset {offset}: {reason}")
        self.offset = offset
