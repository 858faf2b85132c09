"""A gateway node's mailbox of topic events: merged while they wait, taken all at once.

An event only says "queue Q has messages up to offset N"; the consumer then
reads the index. So a later event for Q replaces an earlier one (the higher
offset wins), and a consumer that falls behind finds one merged dict instead
of a backlog: the mailbox holds at most one entry per queue however many
batches were posted. Posting never blocks the dispatcher.

Trio: :meth:`EventMailbox.post` and :meth:`EventMailbox.close` must be called
from the trio thread (they wake a waiting :meth:`EventMailbox.get`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, final

import trio

__all__ = ["EventMailbox", "EventMailboxStatistics"]


@dataclass(frozen=True, slots=True)
class EventMailboxStatistics:
    pending: int  # queues with an event waiting
    posts: int
    events_posted: int
    events_merged: int  # posted events folded into one already waiting for the same queue
    takes: int  # successful get() / get_nowait() calls
    closed: bool


@final
class EventMailbox:
    """One node's pending topic events, ``{queue: max offset}``, for one consumer task.

    Resource handling: whoever drops the node calls :meth:`close`; the
    consumer's :meth:`get` then returns what is left and raises
    ``trio.EndOfChannel``.
    """

    __slots__ = ("_pending", "_wakeup", "_closed", "_posts", "_posted", "_merged", "_takes")

    def __init__(self) -> None:
        self._pending: dict[str, int] = {}
        self._wakeup = trio.Event()  # set while something is pending or the mailbox is closed
        self._closed = False
        self._posts = 0
        self._posted = 0
        self._merged = 0
        self._takes = 0

    def post(self, events: Mapping[str, int]) -> None:
        """Merge ``events`` into the pending ones (the higher offset wins) and wake the consumer.

        Raises:
            trio.ClosedResourceError: the mailbox was closed (its node was dropped).
        """
        if self._closed:
            raise trio.ClosedResourceError("the mailbox is closed: its node was dropped")
        pending = self._pending
        merged = 0
        for queue, offset in events.items():
            current = pending.get(queue)
            if current is None:
                pending[queue] = offset
            else:
                merged += 1
                if offset > current:
                    pending[queue] = offset
        self._posts += 1
        self._posted += len(events)
        self._merged += merged
        if pending:
            self._wakeup.set()

    def get_nowait(self) -> dict[str, int]:
        """Take every pending event at once.

        Raises:
            trio.WouldBlock: nothing is pending.
            trio.EndOfChannel: nothing is pending and the mailbox is closed.
        """
        if not self._pending:
            if self._closed:
                raise trio.EndOfChannel
            raise trio.WouldBlock
        events = self._pending
        self._pending = {}
        if not self._closed:
            self._wakeup = trio.Event()
        self._takes += 1
        return events

    async def get(self) -> dict[str, int]:
        """Wait for events, then take every pending one at once.

        Cancellation loses nothing: events stay pending unless this returns them.

        Raises:
            trio.EndOfChannel: the mailbox is closed and everything was taken.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while not self._pending and not self._closed:
            await self._wakeup.wait()
            waited = True
        events = self.get_nowait()
        if not waited:  # a call that found events pending still yields once; one that waited has yielded
            await trio.lowlevel.cancel_shielded_checkpoint()
        return events

    def close(self) -> None:
        """Refuse further posts and wake the consumer; what is pending can still be taken. Idempotent."""
        self._closed = True
        self._wakeup.set()

    def statistics(self) -> EventMailboxStatistics:
        return EventMailboxStatistics(
            pending=len(self._pending),
            posts=self._posts,
            events_posted=self._posted,
            events_merged=self._merged,
            takes=self._takes,
            closed=self._closed,
        )
