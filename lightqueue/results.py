"""The result of a queue read: ``PullResult``, shared by the light queues, the store's interface and its RPC.

A module of its own, importing nothing, so that what only needs the type (``store/api.py``, and the code
shipped to Spark executors with it) does not load RocksDB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["PullResult"]

T = TypeVar("T")


@dataclass(slots=True)  # not frozen: made per read, and frozen costs 6x to build
class PullResult(Generic[T]):
    """Messages read from one queue, in queue order.

    ``messages`` holds ``(queue offset, decoded message)``; ``next_offset`` is
    where the next pull starts; ``expired`` says that retention removed messages
    at or after the requested offset and the pull jumped over them.
    """

    messages: list[tuple[int, T]]
    next_offset: int
    expired: bool
