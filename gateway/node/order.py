"""Read order across connections: a subscription read before an append is applied before that append is written.

Each connection hands its node actions to the node in its own order (its
worker task, gateway/node/connection.py), but the workers of different connections run
in any order, and an append may even be written in the step that read it
(``GatewayNode.append_now``). A subscription starts at its ``Activated`` control
record in the CommitLog (``StoreNode.activate``), and once it is applied every
later record lists the filter's queue (docs/architecture.md, "Target queues are
fixed at append time"). The log orders what is written, not what was read: without
an order between connections, a PUBLISH read a few microseconds after a
SUBSCRIBE on another connection was often written before the activation's
record, and lost to that subscription.

Here an activation holds a *fence* from the moment the channel asks for it
(its SUBSCRIBE was read) until the store has applied it; an append read while
fences are open carries a *mark* and waits for every fence opened before it,
not for later ones: activations and appends are applied in the order they
were read, and no append waits behind an activation read after it.

Only the order of an append and the activations of filters that match its topic
matters (no other subscription would get it): a fence knows its filters, and an
append read while only fences of other filters are open (``fences``) may be
written at once. Fifty sessions subscribing 1,000 filters each kept a fence
open at every moment: without this, every other client's publishes waited
behind them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import final

import trio

from lightqueue.topics import is_wildcard, matches

__all__ = ["ReadOrder"]


@final
class ReadOrder:
    """The fences of one node: activations read and not yet applied, in the order they were read.

    Fences are numbered in read order; a mark is the number the next fence
    would get, so an append marked ``m`` waits for the fences below ``m``.
    """

    __slots__ = ("_next", "_open", "_exact", "_wild", "_changed")

    def __init__(self) -> None:
        self._next = 0
        self._open: dict[int, tuple[str, ...]] = {}  # open fences and their filters, oldest first (insertion order)
        self._exact: dict[str, int] = {}  # filter without wildcards -> its open fences
        self._wild: dict[str, dict[str, int]] = {}  # first level ("" for + and #) -> wildcard filter -> open fences
        self._changed: trio.Event | None = None  # made by the first waiter

    @property
    def fenced(self) -> bool:
        """An activation read earlier is not applied yet: an append read now must wait (:meth:`mark`)."""
        return bool(self._open)

    def fences(self, topic: str) -> bool:
        """An activation read earlier of a filter matching ``topic`` is not applied yet: an append of ``topic``
        read now must wait (:meth:`mark`). Costs a lookup, plus a match per open wildcard filter of the topic's
        first level (or starting with a wildcard)."""
        if not self._open:
            return False
        if topic in self._exact:
            return True
        wild = self._wild
        first = topic.split("/", 1)[0]
        return any(matches(f, topic) for bucket in (wild.get(first), wild.get("")) if bucket for f in bucket)

    def mark(self) -> int:
        """The mark of an append read now: :meth:`wait` with it returns once the fences open now are closed."""
        return self._next

    def open(self, filters: Iterable[str]) -> int:
        """An activation of (valid) ``filters`` was read: returns its fence, to :meth:`close` once the store has
        applied it."""
        fence = self._next
        self._next += 1
        self._open[fence] = held = tuple(filters)
        exact = self._exact
        for filter in held:
            counts = self._wildcards(filter) if is_wildcard(filter) else exact
            counts[filter] = counts.get(filter, 0) + 1
        return fence

    def close(self, fence: int) -> None:
        """The activation is applied (or abandoned). Idempotent."""
        held = self._open.pop(fence, None)
        if held is not None:
            exact = self._exact
            for filter in held:
                counts = self._wildcards(filter) if is_wildcard(filter) else exact
                if counts[filter] > 1:
                    counts[filter] -= 1
                    continue
                del counts[filter]
                if not counts and counts is not exact:
                    del self._wild[self._first(filter)]
            changed = self._changed
            if changed is not None:
                self._changed = None
                changed.set()

    def _wildcards(self, filter: str) -> dict[str, int]:
        """The open-fence counts a wildcard ``filter`` is kept in, its first level's (made if missing); an exact
        filter's are ``_exact``, looked up by the caller (no call for half the filters of a storm, issue 31)."""
        first = self._first(filter)
        counts = self._wild.get(first)
        if counts is None:  # not ``setdefault``: its default dict was made on every call, twice a filter
            counts = self._wild[first] = {}
        return counts

    @staticmethod
    def _first(filter: str) -> str:
        first = filter.split("/", 1)[0]
        return "" if first in ("+", "#") else first

    def passed(self, mark: int) -> bool:
        """Every fence opened before ``mark`` is closed."""
        return not self._open or next(iter(self._open)) >= mark

    async def wait(self, mark: int) -> None:
        """Return once every fence opened before ``mark`` is closed."""
        while not self.passed(mark):
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()
