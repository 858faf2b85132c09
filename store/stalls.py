"""A process's own stalls: time its event loop did not run, so silence it must not hold against its peers.

A store process can stop running for seconds while its peers go on: a long GC or swap stall, a paused VM, an
fsync that blocks the loop, a SIGSTOP. The frames its gateways sent meanwhile wait unread in its sockets, so
measured across the stall they look silent for all of it. ``StallWatch`` is a monotonic-clock watchdog: a task
that ticks every ``TICK_S`` and, when a tick comes much later than asked, knows the loop stalled. Silence is
then counted from the moment the store runs again (:meth:`StallWatch.awake_since`): a peer gets a whole lease
to speak after the stall before anything is held against it (store/leases.py). A gateway's store client watches
its own stalls the other way round: after one longer than its lease, what the store sent before may be stale
(store/rpc/client.py).

Resource handling: :meth:`StallWatch.run` is the watchdog task, run by the owner (the RPC server, whose
connections' leases can end; each link of the RPC client), or owners (RPC servers over one store); until one runs
the watch sees no stall.
"""

from __future__ import annotations

import logging
import math
from typing import final

import trio

__all__ = ["STALL_S", "TICK_S", "StallWatch"]

LOGGER = logging.getLogger(__name__)

TICK_S = 0.1
"""How often the watchdog looks at the clock: a few wake-ups a second, nothing next to a serving store."""

STALL_S = 1.0
"""A tick this much later than asked is a stall of the store's loop: far above the scheduling noise of a busy
machine (a loop step of tens of milliseconds), and well within a lease (5 s by default), whose heartbeats go
every lease / 5."""


@final
class StallWatch:
    """Knows when this process's event loop last stalled, so that leases measure only silence the store saw.

    ``process`` names the process in the one line a stall logs: the store's watch, or a gateway node's link.
    """

    def __init__(self, process: str = "store") -> None:
        self.process = process
        self._ticked: float | None = None  # the watchdog's last tick (None: it does not run)
        self._awake_since = -math.inf  # the end of the last stall
        self._runs = 0  # the watchdog tasks running (:meth:`run`)
        self.stalls = 0

    def awake_since(self) -> float:
        """Since when (trio clock) the store has run without a stall: a peer's silence before it does not count.

        Also right while the store resumes, before the watchdog's late tick: a watchdog that has not ticked for
        ``STALL_S`` means that the loop is only now running again, so the answer is now.
        """
        now = trio.current_time()
        if self._ticked is not None and now - self._ticked - TICK_S > STALL_S:
            return now
        return self._awake_since

    async def run(self) -> None:
        """Tick every ``TICK_S``; a late tick ends a stall (logged once, with its length). Runs until cancelled.

        Several owners may run it at once (two RPC servers over one store): each measures its own ticks, the watch
        holds the latest, and it stops looking at the clock when the last of them stops."""
        ticked = self._ticked = trio.current_time()
        self._runs += 1
        try:
            while True:
                await trio.sleep(TICK_S)
                now = trio.current_time()
                stalled = now - ticked - TICK_S
                if stalled > STALL_S and self._awake_since <= ticked:  # a stall another run saw end is one
                    self._awake_since = now
                    self.stalls += 1
                    LOGGER.warning("%s stalled for %.1f s: silence before now is not held against its peers",
                                   self.process, stalled, extra={"ctx": {"stalled_s": round(stalled, 3)}})
                ticked = self._ticked = now
        finally:
            self._runs -= 1
            if not self._runs:
                self._ticked = None
