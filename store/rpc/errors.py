"""The wire error for an exception of a store call, so that the client raises the same kind (store/rpc/client.py).

Shared by every connection kind a store serves: gateway nodes and back-end clients (store/rpc/server.py), replicas,
and log readers (store/rpc/reader.py).
"""

from __future__ import annotations

from store.api import (DelayedCapExceeded, InvalidOffset, LeaseLost, LogFullError, OffsetExpired, RecordTooLarge,
                       TopicError)
from store.rpc import wire as rpc
from store.rpc.access import AccessDenied

__all__ = ["error_frame"]


def error_frame(request_id: int, exc: BaseException) -> rpc.Error:
    """The ``Error`` answering request ``request_id`` that failed with ``exc``."""
    if isinstance(exc, AccessDenied):
        kind = rpc.ErrorKind.DENIED
    elif isinstance(exc, LeaseLost):
        kind = rpc.ErrorKind.FENCED
    elif isinstance(exc, RecordTooLarge):
        kind = rpc.ErrorKind.RECORD_TOO_LARGE
    elif isinstance(exc, OffsetExpired):
        kind = rpc.ErrorKind.EXPIRED
    elif isinstance(exc, InvalidOffset):
        kind = rpc.ErrorKind.INVALID_OFFSET
    elif isinstance(exc, TopicError):
        kind = rpc.ErrorKind.TOPIC
    elif isinstance(exc, DelayedCapExceeded):
        kind = rpc.ErrorKind.DELAYED_CAP
    elif isinstance(exc, ValueError):
        kind = rpc.ErrorKind.VALUE
    elif isinstance(exc, LogFullError):
        kind = rpc.ErrorKind.LOG_FULL
    elif isinstance(exc, OSError):
        kind = rpc.ErrorKind.OS
    else:
        kind = rpc.ErrorKind.INTERNAL
    return rpc.Error(request_id, kind, str(exc) or type(exc).__name__)
