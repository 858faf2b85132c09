"""One timer task for every connection of a node, instead of a trio task per armed timer.

Each connection arms a keepalive timer, a commit timer and a CONNECT deadline;
with a task each, 5,000 idle devices would hold 10,000 sleeping tasks (about
2 KiB apiece). Here one task serves two kinds of deadline:

- a wheel for the deadlines every idle device has, its CONNECT deadline and
  then its keep alive: one slot per ``TICK_S``, a deadline is its owner in a
  slot (no handle, no callback object: a handle and its closure were two
  objects per device), and an owner has at most one (:meth:`Timers.arm` moves
  it). Such deadlines are coarse by nature and come due at most a tick late;
- a heap of handles for the others (a commit timer, while acknowledgements
  wait): a timer costs a small handle. Cancelled handles stay in the heap until they come due
and are skipped then (cheap: a connection re-arms a timer only when it fires
or changes, not per packet); a cancelled handle lets go of its callback at
once, so it never keeps a closed connection (and its buffers) alive, and the
heap is swept of cancelled handles whenever it has doubled since the last
sweep (connections that come and go with long keep alives).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from typing import Protocol, final

import trio

__all__ = ["Expiring", "TICK_S", "Timer", "Timers"]

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


class Expiring(Protocol):
    """An owner of a wheel deadline (a connection)."""

    def expired(self) -> None:
        """Its deadline came (armed with :meth:`Timers.arm`); it is no longer armed."""
        ...


TICK_S = 0.25
"""The wheel's slot: a CONNECT deadline or a keep alive (1.5 x a client's, seconds at least) comes due at most this
late, and a node wakes at most this often for them."""


SWEEP_FROM = 1024
"""The heap is swept of cancelled handles only above this size: below it, sweeping costs more than it frees."""


@final
class Timers:
    """Calls callbacks at trio-clock deadlines from one task (:meth:`run`).

    A callback runs in the timer task, so it must not block. An exception it
    raises is logged and the other timers go on: one connection's bug must not
    stop every connection's keepalive.
    """

    __slots__ = ("_heap", "_wakeup", "_sweep_at", "_wheel", "_sleep_until")

    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._wakeup = trio.Event()
        self._sweep_at = SWEEP_FROM
        self._wheel: dict[int, dict[Expiring, None]] = {}  # tick -> the owners due then, in the order they armed
        self._sleep_until = math.inf  # when the task wakes next, unless woken

    def arm(self, owner: Expiring, delay_s: float, tick: int | None) -> int:
        """Call ``owner.expired()`` once ``delay_s`` passed (at most ``TICK_S`` later), instead of at ``tick`` (what
        an earlier :meth:`arm` of it returned, None: none); returns the tick to give :meth:`disarm` or :meth:`arm`
        next."""
        self.disarm(owner, tick)
        due = math.ceil((trio.current_time() + delay_s) / TICK_S)
        slot = self._wheel.get(due)
        if slot is None:
            slot = self._wheel[due] = {}
        slot[owner] = None
        if due * TICK_S < self._sleep_until:
            self._wakeup.set()
        return due

    def disarm(self, owner: Expiring, tick: int | None) -> None:
        """``owner``'s deadline at ``tick`` (what :meth:`arm` returned) never comes; None: nothing armed."""
        if tick is None:
            return
        slot = self._wheel.get(tick)
        if slot is not None:
            slot.pop(owner, None)
            if not slot:
                del self._wheel[tick]

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
        """Timers in the heap, cancelled ones not yet due included, and deadlines in the wheel."""
        return len(self._heap) + sum(len(slot) for slot in self._wheel.values())

    async def run(self) -> None:
        """Serve the deadlines until cancelled."""
        heap = self._heap
        wheel = self._wheel
        while True:
            now = trio.current_time()
            while heap and heap[0].deadline <= now:
                timer = heapq.heappop(heap)
                if not timer.cancelled:
                    try:
                        timer.callback()
                    except Exception as exc:
                        LOGGER.error("timer callback failed: %r", exc, exc_info=exc)
            for tick in sorted(tick for tick in wheel if tick * TICK_S <= now):
                for owner in wheel.pop(tick, {}):  # an owner re-armed from expired() goes into another slot
                    try:
                        owner.expired()
                    except Exception as exc:
                        LOGGER.error("timer callback failed: %r", exc, exc_info=exc)
            self._wakeup = trio.Event()
            self._sleep_until = min(heap[0].deadline if heap else math.inf, min(wheel, default=math.inf) * TICK_S)
            with trio.move_on_at(self._sleep_until):
                await self._wakeup.wait()
            self._sleep_until = -math.inf  # awake: arm() need not wake it
