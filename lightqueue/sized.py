"""A cache bounded by entries *and* bytes, oldest entry out first: for caches keyed by topic or queue name.

A count alone does not bound memory when the keys are client input: 65,536
cached topics of 65 KB each are 4 GB. Each entry here costs what it holds (the
key's and the value's ``sys.getsizeof``) plus a fixed ``ENTRY_OVERHEAD``, and
inserting evicts the oldest entries until both bounds hold.

Not thread-safe for writers: one thread (or a lock) inserts and removes;
``get`` is the dict's own, safe from any thread under the GIL.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Generic, TypeVar, final

__all__ = ["ENTRY_OVERHEAD", "SizedCache"]

K = TypeVar("K")
V = TypeVar("V")

ENTRY_OVERHEAD = 100
"""Bytes an entry costs beyond its key and value: its dict slot and hash table share (about 100 in CPython 3.11)."""


@final
class SizedCache(Generic[K, V]):
    """``{key: value}``, at most ``max_entries`` entries and ``max_bytes`` bytes (estimated).

    Args:
        value_bytes: the bytes a value costs (default ``sys.getsizeof``); values that share one object
            (a state cached once) pass a constant.
    """

    __slots__ = ("get", "bytes", "_items", "_max_entries", "_max_bytes", "_value_bytes")

    def __init__(self, max_entries: int, max_bytes: int, value_bytes: Callable[[V], int] = sys.getsizeof) -> None:
        self._items: dict[K, V] = {}
        # The value under a key, or None: the dict's own get, without a Python frame (hot paths call it per message).
        self.get: Callable[[K], V | None] = self._items.get
        self.bytes = 0
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._value_bytes = value_bytes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: K, value: V) -> None:
        """Insert (or replace) ``key``, then evict the oldest entries beyond either bound.

        An entry larger than ``max_bytes`` on its own is not kept.
        """
        items = self._items
        if key in items:
            self.pop(key)
        cost = self._cost(key, value)
        if cost > self._max_bytes:
            return
        items[key] = value
        self.bytes += cost
        while len(items) > self._max_entries or self.bytes > self._max_bytes:
            self.pop(next(iter(items)))

    def pop(self, key: K) -> V | None:
        """Remove ``key``; returns its value, or None if it was not cached."""
        value = self._items.pop(key, None)
        if value is not None:
            self.bytes -= self._cost(key, value)
        return value

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

    def _cost(self, key: K, value: V) -> int:
        return sys.getsizeof(key) + self._value_bytes(value) + ENTRY_OVERHEAD
