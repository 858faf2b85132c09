"""The admin endpoint's connection slots: a bounded number open, and the ones waiting on their client give way.

Each open admin connection holds a slot. A connection is *idle* while it waits
on its client (for a request: a new connection, one kept alive between
requests, one sending its head or body) and *busy* while the node answers a
request it has read whole. When a new connection finds every slot taken, the
slot idle longest is taken back: its connection is closed and the new one
gets the slot, as nginx closes its idle ("reusable") connections when it runs
out of connections. So connections that send nothing (a flood of them, or
clients that went away without a FIN) never lock out a health probe or a
scrape: only ``limit`` requests being answered at once do, and then the new
connection is refused (503).

Sans-IO: a slot closes its connection through the callable it was given (the
server passes its connection's cancel scope's ``cancel``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import final

__all__ = ["Slot", "Slots", "SlotStatistics"]


@dataclass(frozen=True, slots=True)
class SlotStatistics:
    open: int  # connections holding a slot
    busy: int  # of which the node is answering a request
    reclaimed: int  # idle connections closed to make room, since the start
    refused: int  # connections refused because every slot was busy, since the start


@final
class Slot:
    """One connection's slot: idle when taken; ``busy``/``idle`` as the connection moves; ``release`` at its end."""

    __slots__ = ("_slots", "_close")

    def __init__(self, slots: Slots, close: Callable[[], None]) -> None:
        self._slots = slots
        self._close = close

    def busy(self) -> None:
        """The node answers a request on this connection: it keeps its slot until ``idle``."""
        self._slots._idle.pop(self, None)

    def idle(self) -> None:
        """The connection waits on its client again: it is the last to give way (the longest idle gives first)."""
        if self in self._slots._open:
            self._slots._idle.pop(self, None)
            self._slots._idle[self] = None

    def release(self) -> None:
        """The connection ended (or was taken back); idempotent."""
        self._slots._idle.pop(self, None)
        self._slots._open.discard(self)


@final
class Slots:
    """The slots of one admin listener.

    Args:
        limit: connections open at once (0: no limit, nothing is ever taken back).
    """

    __slots__ = ("limit", "_open", "_idle", "_reclaimed", "_refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: set[Slot] = set()
        self._idle: dict[Slot, None] = {}  # the idle slots, longest idle first
        self._reclaimed = 0
        self._refused = 0

    def full(self) -> bool:
        """Every slot is taken: the next ``take`` closes an idle connection, or refuses."""
        return bool(self.limit) and len(self._open) >= self.limit

    def take(self, close: Callable[[], None]) -> Slot | None:
        """A slot for a new connection (idle), or None when every slot is busy (refuse it).

        At the limit, the connection idle longest is closed first (``close`` of its slot is called) and gives
        its slot up at once; its task ends at its next checkpoint.
        """
        if self.full():
            if not self._idle:
                self._refused += 1
                return None
            oldest = next(iter(self._idle))
            oldest.release()
            self._reclaimed += 1
            oldest._close()
        slot = Slot(self, close)
        self._open.add(slot)
        self._idle[slot] = None
        return slot

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(len(self._open), len(self._open) - len(self._idle), self._reclaimed, self._refused)
