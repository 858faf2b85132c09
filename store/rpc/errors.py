"""The wire error for an exception of a store call, so that the client raises the same kind (store/rpc/client.py).

Shared by every connection kind a store serves: gateway nodes and back-end clients (store/rpc/server.py), replicas,
and log readers (store/rpc/reader.py).
"""

from __future__ import annotations

from store.api import (DelayedCapExceeded, InvalidOffset, LeaderFenced, LeaseLost, LogFullError, OffsetExpired,
                       RecordTooLarge, TopicError)
from store.rpc import wire as rpc
from store.rpc.access import AccessDenied

__all__ = ["KINDS", "error_frame"]


KINDS: tuple[tuple[type[BaseException], rpc.ErrorKind], ...] = (
    (AccessDenied, rpc.ErrorKind.DENIED),
    (LeaderFenced, rpc.ErrorKind.LEADER_FENCED),
    (LeaseLost, rpc.ErrorKind.FENCED),
    (RecordTooLarge, rpc.ErrorKind.RECORD_TOO_LARGE),
    (OffsetExpired, rpc.ErrorKind.EXPIRED),
    (InvalidOffset, rpc.ErrorKind.INVALID_OFFSET),
    (TopicError, rpc.ErrorKind.TOPIC),
    (DelayedCapExceeded, rpc.ErrorKind.DELAYED_CAP),
    (ValueError, rpc.ErrorKind.VALUE),
    (LogFullError, rpc.ErrorKind.LOG_FULL),
    (OSError, rpc.ErrorKind.OS),
)
"""Each exception class and its kind, the first match wins: subclasses (an ``InvalidOffset`` is a ``ValueError``)
come before their bases."""


def error_frame(request_id: int, exc: BaseException) -> rpc.Error:
    """The ``Error`` answering request ``request_id`` that failed with ``exc`` (``INTERNAL``: not a store error)."""
    kind = next((kind for cls, kind in KINDS if isinstance(exc, cls)), rpc.ErrorKind.INTERNAL)
    return rpc.Error(request_id, kind, str(exc) or type(exc).__name__)
