"""One timer task for every connection of a node, instead of a trio task per armed timer.

Each connection arms a keepalive timer, a commit timer and a CONNECT deadline;
with a task each, 5,000 idle devices would hold 10,000 sleeping tasks (about
2 KiB apiece). Here a heap of deadlines is served by one task, and a timer
costs a small handle. Cancelled handles stay in the heap until they come due
and are skipped then (cheap: a connection re-arms a timer only when it fires
or changes, not per packet); a cancelled handle lets go of its callback at
once, so it never keeps a closed connection (and its buffers) alive, and the
heap is swept of cancelled handles whenever it has doubled since the last
sweep (connections that come and go with long keep alives).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import final

import trio

__all__ = ["Timer", "Timers"]

LOGGER = logging.getLogger(__name__)


@final
class Timer:
    """An armed timer; :meth:`cancel` makes sure its callback never runs."""

    __slots__ = ("deadline", "callback", "cancelled")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.callback = _nothing  # the handle waits in the heap until its deadline: it must not keep its owner alive

    def __lt__(self, other: Timer) -> bool:
        return self.deadline < other.deadline


def _nothing() -> None:
    """The callback of a cancelled timer."""


SWEEP_FROM = 1024
"""The heap is swept of cancelled handles only above this size: below it, sweeping costs more than it frees."""


@final
class Timers:
    """Calls callbacks at trio-clock deadlines from one task (:meth:`run`).

    A callback runs in the timer task, so it must not block. An exception it
    raises is logged and the other timers go on: one connection's bug must not
    stop every connection's keepalive.
    """

    __slots__ = ("_heap", "_wakeup", "_sweep_at")

    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._wakeup = trio.Event()
        self._sweep_at = SWEEP_FROM

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback()`` after ``delay_s`` seconds unless the returned timer is cancelled first."""
        if len(self._heap) >= self._sweep_at:
            self._sweep()
        timer = Timer(trio.current_time() + delay_s, callback)
        heapq.heappush(self._heap, timer)
        if self._heap[0] is timer:
            self._wakeup.set()
        return timer

    def _sweep(self) -> None:
        """Drop the cancelled handles; the next sweep comes when the heap has doubled (amortised O(1) a timer)."""
        heap = self._heap
        heap[:] = [timer for timer in heap if not timer.cancelled]
        heapq.heapify(heap)
        self._sweep_at = max(SWEEP_FROM, 2 * len(heap))

    def __len__(self) -> int:
        """Timers in the heap, cancelled ones not yet due included."""
        return len(self._heap)

    async def run(self) -> None:
        """Serve the deadlines until cancelled."""
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0].deadline <= now:
                timer = heapq.heappop(heap)
                if not timer.cancelled:
                    try:
                        timer.callback()
                    except Exception as exc:
                        LOGGER.error("timer callback failed: %r", exc, exc_info=exc)
            self._wakeup = trio.Event()
            with trio.move_on_at(heap[0].deadline if heap else float("inf")):
                await self._wakeup.wait()
