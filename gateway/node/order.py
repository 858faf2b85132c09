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
"""

from __future__ import annotations

from typing import final

import trio

__all__ = ["ReadOrder"]


@final
class ReadOrder:
    """The fences of one node: activations read and not yet applied, in the order they were read.

    Fences are numbered in read order; a mark is the number the next fence
    would get, so an append marked ``m`` waits for the fences below ``m``.
    """

    __slots__ = ("_next", "_open", "_changed")

    def __init__(self) -> None:
        self._next = 0
        self._open: dict[int, None] = {}  # open fences, oldest first (dicts keep insertion order)
        self._changed: trio.Event | None = None  # made by the first waiter

    @property
    def fenced(self) -> bool:
        """An activation read earlier is not applied yet: an append read now must wait (:meth:`mark`)."""
        return bool(self._open)

    def mark(self) -> int:
        """The mark of an append read now: :meth:`wait` with it returns once the fences open now are closed."""
        return self._next

    def open(self) -> int:
        """An activation was read: returns its fence, to :meth:`close` once the store has applied it."""
        fence = self._next
        self._next += 1
        self._open[fence] = None
        return fence

    def close(self, fence: int) -> None:
        """The activation is applied (or abandoned). Idempotent."""
        if self._open.pop(fence, 0) is None:
            changed = self._changed
            if changed is not None:
                self._changed = None
                changed.set()

    def passed(self, mark: int) -> bool:
        """Every fence opened before ``mark`` is closed."""
        return not self._open or next(iter(self._open)) >= mark

    async def wait(self, mark: int) -> None:
        """Return once every fence opened before ``mark`` is closed."""
        while not self.passed(mark):
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()
