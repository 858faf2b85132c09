"""The dequeue step: each second, the due messages of the wheel go to their real topics.

A cursor moves one second at a time through the wheel (store/timer/wheel.py). At each second it reads the slot's
chain: the entries due in that second or before are fired in due order once due, in batches at most every
``TICK_MS`` (never early: a batch takes what is due when it starts), the others (placed there because they were
due beyond the window, or a later revolution of the ring) are rolled. Firing re-appends each message to its real
topic (normal dispatch, notify and delivery from there), ``CHUNK`` messages per write (those of one topic in due
order, as batch records when the topics have runs of ``MIN_RUN``) with a ``TimersFired`` record naming their
entries, so the log itself says what was dequeued: after a crash the entries whose ``TimersFired`` reached the log
are done, the others fire again, and none fires twice. Each write waits until dispatch has applied the previous
one. A second's slot is read and sorted in slices, a step of the event loop each, and merged as it fires; reading
and decoding a batch's ``Delayed`` records runs in a worker thread: the event loop, which undelayed traffic
shares, only ever holds one slice's or one chunk's work at a time. A batch fires under ``lock``, which a
cancellation holds while it writes its ``TimerCancelled`` (store/timer/pending.py): a batch read before a
cancellation fires only the entries still pending, so a cancelled message is never delivered. After a restart the
cursor starts at the earliest pending second, so the messages that fell due while the node was down go at once, in
due order.
"""

from __future__ import annotations

import heapq
import logging
from typing import Awaitable, Callable, Sequence, final

import trio

from store.api import NewMessage, by_topic
from store.control import Control, ControlError, Delayed, TimersFired, TimersRolled, decode_control
from store.log.aio import LatencyBuckets
from store.log.commitlog import CommitLog
from store.log.record import CorruptRecord, decode_record, now_ms
from store.timer.applier import TimerApplier
from store.timer.timerlog import TimerEntry

__all__ = ["BATCH", "CHUNK", "LATENESS_BOUNDS", "MIN_RUN", "SLICE", "Dequeue"]

LOGGER = logging.getLogger(__name__)

BATCH = 1024
"""Messages fired per batch (all that fell due in a tick, under the lock) at most."""

CHUNK = 256
"""Messages per write (and per wait for dispatch) while firing: dispatch indexes a small write in one step of the
event loop (store/dispatch.py), which undelayed messages appended meanwhile wait for, so a batch of 1,024 (firing
behind, or after a restart) goes in 4 writes. Not fewer: each write costs about 1 ms more (its record, its wait
for dispatch), and with writes of 32 or 64 messages the step fired half as many messages a second on this
machine; at 10,000 due a second a tick's 200 messages are one write."""

TICK_MS = 20
"""A batch fires at most this often: the messages falling due meanwhile go together (200 at 10,000 a second), not
one write, one ``TimersFired`` record and one wait for dispatch each (firing as each fell due made most batches
of a message or two)."""

RETRY_S = 1.0
"""After a failed append (a full disk), the step tries again this much later: nothing is dropped."""

Append = Callable[[Sequence[Control], Sequence[NewMessage], bool], Awaitable[int]]
"""``append(controls, messages, batch)``: the messages, then the control records, in one CommitLog write; with
``batch``, each run of same-topic messages as batch records (the step passes them grouped by topic, each topic in
due order); returns once dispatch applied them (``StoreNode.append_control``)."""

MIN_RUN = 4
"""A fired write's messages go as batch records when its topics average at least this many messages each: a record
and an index entry per run, not per message, in the step of the event loop where dispatch indexes the write. Not
for fewer: a batch record of two messages saves little indexing, and a compressed one (``batch_compression``)
costs a zstd attempt (with 100 topics and 200 messages a tick, batching every pair made the step's CPU grow)."""

SLICE = 1024
"""TimerLog entries a second's read takes per step of the event loop (1 to 2 ms of CPU, as much as indexing a
fired write of 200 messages): undelayed messages appended meanwhile wait for one slice at most. Smaller slices
(256) made more steps for no clear gain in the probe's p99 on a loaded machine."""

LATENESS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 60.0)
"""Buckets (seconds) of how late fired messages went out: the goal is p99 under 0.2 s, the promise under 1 s."""


@final
class Dequeue:
    """The dequeue step of ``timers``, appending with ``append`` and reading the Delayed records from ``log``;
    ``lock``: held while a batch fires (shared with the cancellations)."""

    def __init__(self, timers: TimerApplier, log: CommitLog, append: Append, lock: trio.Lock) -> None:
        self._timers = timers
        self._log = log
        self._append = append
        self._lock = lock
        self.lateness = LatencyBuckets(LATENESS_BOUNDS)  # how late each fired message went out (metrics)
        self._cursor: int | None = None  # the next second to dequeue; None: nothing was ever pending
        self._failing = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Dequeue until cancelled (start it once dispatch has applied the log: ``open_store`` recovers first)."""
        task_status.started()
        while True:
            try:
                await self._turn()
            except OSError as exc:  # the disk is full, or an fsync failed: the entries wait, they are not dropped
                if not self._failing:
                    self._failing = True
                    LOGGER.error("delayed messages not dequeued; retrying every %s s: %r", RETRY_S, exc)
                await trio.sleep(RETRY_S)
                continue
            if self._failing:
                self._failing = False
                LOGGER.warning("delayed messages dequeued again")

    async def _turn(self) -> None:
        """Dequeue the cursor's second if it has come (or jump to the next second that has something), else sleep
        until the next second begins."""
        low = self._timers.take_low()
        if low is not None:
            self._cursor = low if self._cursor is None else min(self._cursor, low)
        now = now_ms()
        now_s = now // 1000
        if self._cursor is None or self._cursor > now_s:
            await trio.sleep((1000 - now % 1000) / 1000)
            return
        found = await trio.to_thread.run_sync(self._timers.next_due, self._cursor, now_s)
        if found is None:
            self._cursor = now_s + 1
            return
        await self._second(found)
        self._cursor = found + 1

    async def _second(self, second: int) -> None:
        """Roll the entries of ``second``'s slot that are not due in it, fire the others as they fall due."""
        cancelled = self._timers.cancelled
        roll, runs = await self._split(second)
        if roll:
            await self._append([TimersRolled([_ref(item) for item in roll])], [], False)
        fire = heapq.merge(*runs, key=_due_order)  # each tick takes its batch from the runs: no step sorts them all
        head = next(fire, None)
        fired_at = 0
        while head is not None:
            wait_ms = max(head[1].due_ms, fired_at + TICK_MS) - now_ms()
            if wait_ms > 0:
                await trio.sleep(wait_ms / 1000)
            now = fired_at = now_ms()
            batch = []
            while head is not None and len(batch) < BATCH and head[1].due_ms <= now:
                batch.append(head)
                head = next(fire, None)
            await self._fire(batch, cancelled)

    async def _split(self, second: int) -> tuple[list[tuple[int, TimerEntry]], list[list[tuple[int, TimerEntry]]]]:
        """The pending entries of ``second``'s slot to roll (due after it), and those to fire (due in it or before)
        as runs each in due order; read ``SLICE`` at a time, a step of the event loop each. Not in a worker thread:
        the 10,000 entries of a second took 20 ms of the GIL there, and the event loop, back from any I/O call,
        waited up to the interpreter's switch interval (5 ms) for it each time; undelayed messages waited too."""
        roll: list[tuple[int, TimerEntry]] = []
        runs = []
        for found in self._timers.due_slices(second, SLICE):
            roll += [item for item in found if item[1].due_ms // 1000 > second]
            runs.append(sorted((item for item in found if item[1].due_ms // 1000 <= second), key=_due_order))
            await trio.sleep(0)
        return roll, runs

    async def _fire(self, batch: list[tuple[int, TimerEntry]], cancelled: int) -> None:
        """Append the messages of ``batch`` to their real topics, with the ``TimersFired`` record that ends them;
        ``cancelled``: the timer's count of cancellations when the batch was read (what changed since is not fired)."""
        async with self._lock:
            if self._timers.cancelled != cancelled:
                batch = await trio.to_thread.run_sync(self._timers.still_pending, batch)
            if batch:
                await self._fire_now(batch)

    async def _fire_now(self, batch: list[tuple[int, TimerEntry]]) -> None:
        """:meth:`_fire` of the entries found still pending, under the lock: ``CHUNK`` of them per write, in order
        (a crash between two writes fires the rest again, and only the rest)."""
        messages = await trio.to_thread.run_sync(self._messages, batch)
        for start in range(0, len(batch), CHUNK):
            chunk = batch[start:start + CHUNK]
            fired = [message for message in messages[start:start + CHUNK] if message is not None]
            runs = by_topic(fired)
            await self._append([TimersFired([_ref(item) for item in chunk])],
                               [fired[i] for run in runs for i in run], len(runs) * MIN_RUN <= len(fired))
            now = now_ms()
            for _, entry in chunk:
                self.lateness.observe(max(0, now - entry.due_ms) / 1000)

    def _messages(self, batch: list[tuple[int, TimerEntry]]) -> list[NewMessage | None]:
        """The message of each entry of ``batch``, read from its ``Delayed`` record (None: unreadable, logged); in a
        worker thread."""
        by_offset = sorted(batch, key=lambda item: item[1].offset_real)
        raws = self._log.read_many([(entry.offset_real, entry.size_real) for _, entry in by_offset])
        found = {entry.offset_real: raw for (_, entry), raw in zip(by_offset, raws)}
        messages: list[NewMessage | None] = []
        for _, entry in batch:
            delayed = _delayed(entry, found[entry.offset_real])
            messages.append(None if delayed is None else NewMessage(
                delayed.topic, delayed.payload, delayed.client, delayed.qos, delayed.retain, delayed.properties,
                delayed.born_ms))
        return messages


def _due_order(item: tuple[int, TimerEntry]) -> tuple[int, int]:
    """Due order; same due time: log order."""
    return item[1].due_ms, item[1].offset_real


def _ref(item: tuple[int, TimerEntry]) -> tuple[int, int, int]:
    pos, entry = item
    return entry.offset_real, pos, entry.due_ms


def _delayed(entry: TimerEntry, raw: bytes | None) -> Delayed | None:
    """The Delayed control at ``entry``'s CommitLog location; None (logged) when it cannot be read: its entry
    ends all the same, or the wheel would stall on it."""
    try:
        if not raw:  # None: retention deleted it (the guard forbids it); b"": corrupt (the log reported it)
            raise CorruptRecord(f"the record at {entry.offset_real} is gone or corrupt")
        control = decode_control(decode_record(raw, 0, entry.offset_real))
        if not isinstance(control, Delayed):
            raise ControlError(f"the record at {entry.offset_real} is not a delayed message")
    except (CorruptRecord, ControlError) as exc:
        LOGGER.error("a delayed message cannot be delivered: %s", exc, extra={"ctx": {"due_ms": entry.due_ms}})
        return None
    return control
