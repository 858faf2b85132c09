"""The pending delayed messages as an operator sees them: a page of them, and the cancellation of one.

A page walks the TimerLog from where the last one ended, a bounded stretch (``PAGE_WALK`` entries, filtered by
the topic and client hashes the entries carry), then reads the ``Delayed`` records of the page's entries from
the CommitLog and keeps those whose topic and client are the ones asked for (a hash may collide): memory and
time per page are bounded however many messages wait.

A message's id is its ``Delayed`` record's position (``Position.id``). A cancellation reads that record (its due
time says which wheel slot holds the entry) and appends a ``TimerCancelled`` record naming the entry, which the
timer applies as it applies ``TimersFired`` (store/timer/applier.py): the log says the message was cancelled, so
a restart, a rebuild or a replica never delivers it either. It holds the dequeue step's lock while it looks and
writes (store/timer/dequeue.py), so an entry is either fired or cancelled, never both.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Sequence, final

import trio

from store.api import MAIN_LOG, DelayedMessage, DelayedPage, Position
from store.control import Control, ControlError, Delayed, TimerCancelled, decode_control
from store.log.commitlog import CommitLog
from store.log.errors import InvalidOffset, OffsetExpired
from store.log.record import CorruptRecord, Record, decode_record
from store.timer.applier import TimerApplier, client_hash, topic_hash

__all__ = ["MAX_PAGE", "PendingDelayed"]

LOGGER = logging.getLogger(__name__)

MAX_PAGE = 1000
"""Messages one page holds at most, whatever the caller asks: their records are read, and sent, at once."""

AppendControl = Callable[[Sequence[Control]], Awaitable[int]]
"""``append(controls)``: stored as the flush policy says, and applied by dispatch, on return
(``StoreNode.append_control``)."""

Applied = Callable[[int], Awaitable[None]]
"""``applied(offset)``: returns once dispatch has applied the log below ``offset`` (``Dispatcher.wait_dispatched``)."""


@final
class PendingDelayed:
    """Lists and cancels the pending entries of ``timers``, reading their records from ``log`` and appending the
    cancellations with ``append``; both first wait until dispatch ``applied`` the log they are asked after (a
    message listed or cancelled right after its publish is in the timer)."""

    def __init__(self, timers: TimerApplier, log: CommitLog, append: AppendControl, applied: Applied) -> None:
        self._timers = timers
        self._log = log
        self._append = append
        self._applied = applied
        self.lock = trio.Lock()  # the dequeue step's too: held while a batch fires or a cancellation is written

    async def page(self, topic: str, client_id: str, after: int, limit: int) -> DelayedPage:
        """``StoreApi.delayed_list``.

        Raises:
            ValueError: ``limit`` below 1, or ``after`` negative.
        """
        if limit < 1 or after < 0:
            raise ValueError(f"a page needs a limit of at least 1 and a start of at least 0, not {limit}, {after}")
        await self._applied(self._log.written_offset)
        entries, next_after = await trio.to_thread.run_sync(
            self._timers.pending_page, after, topic_hash(topic) if topic else None,
            client_hash(client_id) if client_id else None, min(limit, MAX_PAGE))
        by_offset = sorted({entry.offset_real: entry for entry in entries}.values(), key=lambda e: e.offset_real)
        raws = await trio.to_thread.run_sync(self._log.read_many, [(e.offset_real, e.size_real) for e in by_offset])
        found = {entry.offset_real: raw for entry, raw in zip(by_offset, raws)}
        messages = []
        for entry in entries:
            delayed = _delayed(found[entry.offset_real], entry.offset_real)
            if delayed is not None and topic in ("", delayed.topic) and client_id in ("", delayed.client):
                messages.append(DelayedMessage(Position(MAIN_LOG, entry.offset_real), delayed.topic, delayed.client,
                                               delayed.due_ms, delayed.qos, delayed.retain, len(delayed.payload)))
        return DelayedPage(messages, next_after)

    async def cancel(self, offset: int, check: Callable[[str], None] | None = None) -> bool:
        """``StoreApi.delayed_cancel`` of the message whose Delayed record is at ``offset``; ``check(topic)``
        raises when the caller may not cancel a message of that real topic (a back-end client's ACL).

        Raises:
            OSError: the write failed (``LogFullError``); nothing was cancelled.
        """
        found = await trio.to_thread.run_sync(self._record, offset)
        if found is None:
            return False
        record, delayed = found
        if check is not None:
            check(delayed.topic)
        await self._applied(offset + record.size)
        async with self.lock:
            entry = await trio.to_thread.run_sync(self._timers.locate, offset, delayed.due_ms, record.store_ms)
            if entry is None:
                return False
            pos, pending = entry
            await self._append([TimerCancelled([(offset, pos, pending.due_ms)])])
        LOGGER.info("delayed message cancelled", extra={"ctx": {"id": Position(MAIN_LOG, offset).id,
                                                                "topic": delayed.topic, "client_id": delayed.client}})
        return True

    def _record(self, offset: int) -> tuple[Record, Delayed] | None:
        """The Delayed record at ``offset`` and what it says; None when no such record is there (blocking)."""
        try:
            record = self._log.read(offset)
        except (OffsetExpired, InvalidOffset, CorruptRecord):
            return None
        delayed = _delayed_of(record)
        return None if delayed is None else (record, delayed)


def _delayed(raw: bytes | None, offset: int) -> Delayed | None:
    """The Delayed control of a record read from the log; None when it is gone (retention), corrupt (the log
    reported it) or not a Delayed record."""
    if not raw:
        return None
    try:
        return _delayed_of(decode_record(raw, 0, offset))
    except CorruptRecord:
        return None


def _delayed_of(record: Record) -> Delayed | None:
    if not record.control:
        return None
    try:
        control = decode_control(record)
    except ControlError:
        return None
    return control if isinstance(control, Delayed) else None
