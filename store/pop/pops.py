"""POP consumption at the store node: pops, acks, changes of invisible time, and the revive step.

Any number of members pop one group's queue at once; the balancing is per message (RocketMQ 5's POP, SQS's
visibility timeout). Each pop is one ``PopCheckpoint`` record (its CommitLog offset is in every handle it gives),
each ack batch one ``PopAcked``, each revive round one ``PopRevived`` (with the dead letters before it, in the same
write): the state they make is store/pop/state.py's, applied by dispatch (store/pop/applier.py), and every call
returns once its record is applied. One lock per group orders its writers (pop, ack, change, revive), so each one
decides from the state every earlier record made, and its answer (acknowledged or stale) is what its record did.
The group's committed offset (owner ``$pop/<group>``, a ``Committed`` record in the same write) moves only past
messages acknowledged, dead-lettered or lost to retention.

Revive: a task of the store node (:meth:`PopCoordinator.run_revive`) wakes at the earliest deadline (at least every
``REVIVE_TICK_S``) and writes, per group, the messages whose invisible time passed: visible again for their next
attempt, or, at ``max_attempts``, appended to ``$dlq/<group>`` with the original topic, client id, attempt count,
group and queue offset as MQTT 5 user properties (``dlq-*``), the original properties kept before them. Retries
stay in the group's own state rather than going through the timer (store/timer/): a timer message is re-appended
to its *topic*, which every subscriber of it would get again, while a retry concerns one group, and the state
already says which message and when; the revive step is the group's own small timer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, final

import trio

from lightqueue.topics import validate_topic
from store.api import NewMessage, PopStatistics, Record, dlq_topic, pop_owner
from store.control import Committed, Control, PopAcked, PopCheckpoint, PopRevived
from store.groups import DECODED, START_KINDS, Form, GroupStore, entry_offsets, read_offsets, start_offset
from store.log.record import now_ms
from store.pop.applier import PopApplier
from store.pop.handles import Handle, decode_handle, encode_handle
from store.pop.state import MAX_INFLIGHT, PopBook, PopGroup

__all__ = ["MAX_POP_BYTES", "REVIVE_TICK_S", "PopCoordinator", "dead_letter"]

LOGGER = logging.getLogger(__name__)

T = TypeVar("T")


class PopStore(GroupStore, Protocol):
    """What the POP coordinator uses of the store node that owns it (``store.node.StoreNode``, which makes it): a
    consumer group's parts, and control records written with their offsets. A Protocol, so that this module does
    not import the node back."""

    async def write_controls(self, controls: Sequence[Control], *, durable: bool | None = None,
                             applied: bool = True, messages: Sequence[NewMessage] = ()) -> list[int]:
        """Append ``controls`` after ``messages`` in one write; the offset of each record, then the end."""

REVIVE_TICK_S = 1.0
"""The revive step looks at the deadlines at least this often (one it was not woken for: a change of invisible
time by another path, a restart's restored state)."""

MAX_POP_BYTES = 16 * 1024 * 1024
"""A pop's byte budget is capped at this, so its answer stays far below the RPC frame limit."""

REVIVE_BATCH = 1000
"""Messages one revive record names at most (per group and round): the record stays small; the rest are next."""

DEAD_BATCH = 64
"""Dead letters appended in one revive write at most: their records are copies of the messages."""

USER_PROPERTY = 0x26


@dataclass(eq=False)
class _Queue:
    """One POP group's queue while this process serves it: its writers' lock, its waiters' event."""

    group: str
    queue: str
    committed: int  # the Committed offset last written
    lock: trio.Lock = field(default_factory=trio.Lock)
    news: trio.Event = field(default_factory=trio.Event)  # set when the queue grew or messages were revived

    def wake(self) -> None:
        self.news.set()
        self.news = trio.Event()


@final
class PopCoordinator:
    """The POP groups of one store node (see the module docstring).

    Args:
        store: the open store node (its queues, log and writes).
        book: the applier that holds the groups' state.
        poke: ``poke(queue)`` tells the nodes with sessions on ``queue`` and the pops waiting on it that messages
            came back (revived: no append makes news of them).
    """

    def __init__(self, store: PopStore, book: PopApplier, poke: Callable[[str], None]) -> None:
        self._store = store
        self._book = book
        self._poke = poke
        self._queues: dict[tuple[str, str], _Queue] = {}
        self._by_queue: dict[str, list[_Queue]] = {}
        self._loading = trio.Lock()
        self._revive_news = trio.Event()

    def wake(self, events: Iterable[str]) -> None:
        """Queues got messages (a dispatch batch): wake the pops waiting on them."""
        for queue in events:
            for loaded in self._by_queue.get(queue, ()):
                loaded.wake()

    def statistics(self) -> PopStatistics:
        """The groups' figures now (``StoreStatistics.pops``)."""
        return self._book.read(PopBook.statistics)

    # --- loading ------------------------------------------------------------------------------------------

    async def _loaded(self, group: str, queue: str, start: str = "latest", at: int = 0) -> _Queue:
        key = (group, queue)
        async with self._loading:
            loaded = self._queues.get(key)
            if loaded is None:
                loaded = self._queues[key] = await self._load(group, queue, start, at)
                self._by_queue.setdefault(queue, []).append(loaded)
        return loaded

    async def _load(self, group: str, queue: str, start: str, at: int) -> _Queue:
        """Hold the queue's filter for the group (a wildcard's queue is indexed from now on, also while nobody
        pops) and find its committed offset, placing a new group at ``start``."""
        store = self._store
        owner = pop_owner(group)
        latest = await store.activate(queue, owner)
        committed = (await trio.to_thread.run_sync(store.queues.get_offsets, owner)).get(queue)
        if committed is None:
            committed = await start_offset(store, queue, start, at, latest)
            await store.commit_offsets({owner: {queue: committed}})
        return _Queue(group, queue, committed)

    async def _existing(self, key: tuple[str, str]) -> _Queue | None:
        """The group of an ack or a change: None when the store has no state for it (every handle is stale)."""
        loaded = self._queues.get(key)
        if loaded is None and self._group(key) is not None:
            loaded = await self._loaded(*key)
        return loaded

    def _group(self, key: tuple[str, str]) -> PopGroup | None:
        """The group's state. Its writers hold its lock, and only their records change it: what is read stays
        true until the caller's own write is applied."""
        return self._book.read(lambda book: book.groups.get(key))

    async def _write(self, loaded: _Queue, controls: list[Control], committed: int,
                     messages: Sequence[NewMessage] = ()) -> list[int]:
        """Append ``controls`` (after ``messages``) with the group's ``Committed`` offset when it moved, in one
        write, and return once applied: the offsets of the records, as ``StoreNode.write_controls``."""
        if committed > loaded.committed:
            controls = [*controls, Committed(pop_owner(loaded.group), {loaded.queue: committed})]
        offsets = await self._store.write_controls(controls, messages=messages)
        loaded.committed = max(loaded.committed, committed)
        return offsets[len(messages):]

    # --- pop, ack, change -----------------------------------------------------------------------------------

    async def pop(self, member: str, group: str, queue: str, max_count: int, invisible_s: float, wait_s: float,
                  max_attempts: int, max_bytes: int, start: str, at: int,
                  form: Form[T]) -> tuple[list[tuple[int, T]], list[tuple[str, int]]]:
        """``StoreApi.pop``: the messages as ``(queue offset, value in form)`` (in the ``whole`` form a batch record's
        value stands for several), and per message, in order, its ``(receipt handle, attempt)``.

        Raises:
            ValueError, TopicError: a bad group name, count, time or start.
        """
        if not group or max_count < 1 or max_bytes < 1 or invisible_s <= 0 or max_attempts < 1:
            raise ValueError(f"a POP needs a group name and positive count, bytes, invisible time and attempts, not "
                             f"{group!r}, {max_count}, {max_bytes}, {invisible_s}, {max_attempts}")
        if start not in START_KINDS:
            raise ValueError(f"start must be one of {', '.join(START_KINDS)}, not {start!r}")
        validate_topic(dlq_topic(group))  # its dead letters' topic: no wildcard, no empty name
        loaded = await self._loaded(group, queue, start, at)
        deadline = trio.current_time() + max(0.0, wait_s)
        invisible_ms = max(1, int(invisible_s * 1000))
        while True:
            news = loaded.news
            async with loaded.lock:
                taken = await self._take(loaded, member, max_count, invisible_ms, max_attempts,
                                         min(max_bytes, MAX_POP_BYTES), form)
            if taken[0] or trio.current_time() >= deadline:
                return taken
            with trio.move_on_at(deadline):
                await news.wait()

    async def _take(self, loaded: _Queue, member: str, max_count: int, invisible_ms: int, max_attempts: int,
                    max_bytes: int, form: Form[T]) -> tuple[list[tuple[int, T]], list[tuple[str, int]]]:
        key = (loaded.group, loaded.queue)
        state = self._group(key)
        retries: list[int] = []
        attempts: dict[int, int] = {}  # the attempt each retry is handed out with (new messages: 1)
        if state is None:
            fresh, cursor = min(max_count, MAX_INFLIGHT), loaded.committed
        else:
            retries, fresh = state.plan(max_count)
            cursor, attempts = state.cursor, {offset: state.retry[offset] for offset in retries}
        if not retries and fresh and self._store.queues.max_offset(loaded.queue) <= cursor:
            fresh = 0  # nothing new: no read, no record
        if not retries and not fresh:
            return [], []
        entries, unread, next_cursor = await trio.to_thread.run_sync(
            read_offsets, self._store, loaded.queue, retries, cursor, fresh, max_bytes, form)
        offsets = entry_offsets(entries, form)
        taken = set(offsets) | set(unread)
        gone = [offset for offset in retries if offset not in taken]  # retention deleted them: done, lost
        if not entries and not gone and next_cursor == cursor:
            return [], []
        checkpoint = PopCheckpoint(loaded.group, loaded.queue, member, offsets, [attempts.get(o, 1) for o in offsets],
                                   now_ms(), invisible_ms, next_cursor, max_attempts, gone)
        low = state.committed(frozenset(gone), next_cursor) if state is not None else next_cursor
        (ck, *_) = await self._write(loaded, [checkpoint], min([low, *offsets]))
        self._revive_news.set()
        return entries, [(encode_handle(Handle(loaded.group, loaded.queue, offset, ck)), attempts.get(offset, 1))
                         for offset in offsets]

    async def ack(self, handles: Sequence[str]) -> list[bool]:
        """``StoreApi.pop_ack``.

        Raises:
            ValueError: a text that is not a receipt handle (nothing was acknowledged).
        """
        parsed = [decode_handle(text) for text in handles]
        done = [False] * len(parsed)
        by_group: dict[tuple[str, str], list[int]] = {}
        for index, handle in enumerate(parsed):
            by_group.setdefault((handle.group, handle.queue), []).append(index)
        for key, indexes in by_group.items():
            loaded = await self._existing(key)
            if loaded is None:
                continue
            async with loaded.lock:
                state = self._group(key)
                if state is None:
                    continue
                acks: dict[int, int] = {}
                for index in indexes:
                    handle = parsed[index]
                    if handle.offset not in acks and state.held_by(handle.offset, handle.ck) is not None:
                        acks[handle.offset] = handle.ck
                        done[index] = True
                if acks:
                    await self._write(loaded, [PopAcked(*key, list(acks.items()))],
                                      state.committed(frozenset(acks)))
        return done

    async def change_invisible(self, text: str, invisible_s: float) -> str | None:
        """``StoreApi.change_invisible``.

        Raises:
            ValueError: not a receipt handle, or a negative time.
        """
        handle = decode_handle(text)
        if invisible_s < 0:
            raise ValueError(f"an invisible time must not be negative, not {invisible_s}")
        key = (handle.group, handle.queue)
        loaded = await self._existing(key)
        if loaded is None:
            return None
        async with loaded.lock:
            state = self._group(key)
            held = state.held_by(handle.offset, handle.ck) if state is not None else None
            if state is None or held is None:
                return None
            checkpoint = PopCheckpoint(handle.group, handle.queue, held.member, [handle.offset], [held.attempt],
                                       now_ms(), int(invisible_s * 1000), state.cursor, state.max_attempts)
            (ck, *_) = await self._write(loaded, [checkpoint], state.committed())
        self._revive_news.set()
        return encode_handle(handle._replace(ck=ck))

    # --- revive -------------------------------------------------------------------------------------------

    async def run_revive(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The revive step, for the life of the node (see the module docstring)."""
        task_status.started()
        while True:
            news = self._revive_news = trio.Event()
            next_ms = await self.revive_due()
            delay = REVIVE_TICK_S if next_ms is None else min(REVIVE_TICK_S, max(0.0, (next_ms - now_ms()) / 1000))
            with trio.move_on_after(delay):
                await news.wait()

    async def revive_due(self) -> int | None:
        """Revive what is due now in every group; returns the earliest deadline left (ms), None if none."""
        now = now_ms()
        for key in self._book.read(lambda book: _due_groups(book, now)):
            loaded = await self._loaded(*key)
            async with loaded.lock:
                await self._revive(loaded, now_ms())
        return self._book.read(_next_deadline)

    async def _revive(self, loaded: _Queue, now: int) -> None:
        state = self._group((loaded.group, loaded.queue))
        if state is None:
            return
        due = sorted(state.due(now))[:REVIVE_BATCH]
        retries = [(offset, held.ck) for offset, held in due if held.attempt < state.max_attempts]
        dead = [(offset, held) for offset, held in due if held.attempt >= state.max_attempts][:DEAD_BATCH]
        if not retries and not dead:
            return
        messages: list[NewMessage] = []
        if dead:
            entries, _, _ = await trio.to_thread.run_sync(
                read_offsets, self._store, loaded.queue, [offset for offset, _ in dead], 0, 0, MAX_POP_BYTES,
                DECODED)
            records = dict(entries)
            messages = [dead_letter(loaded.group, loaded.queue, offset, held.attempt, records[offset])
                        for offset, held in dead if offset in records]
        revived = PopRevived(loaded.group, loaded.queue, retries, [(offset, held.ck) for offset, held in dead])
        committed = state.committed(frozenset(offset for offset, _ in dead))
        try:
            await self._write(loaded, [revived], committed, messages)
        except ValueError as exc:  # a dead letter over the record limit: dead without its copy, said once
            LOGGER.error("dead letters not appended to %s: %s", dlq_topic(loaded.group), exc,
                         extra={"ctx": {"group": loaded.group, "queue": loaded.queue, "messages": len(messages)}})
            await self._write(loaded, [revived], committed)
        if dead:
            LOGGER.info("messages dead-lettered after their last attempt",
                        extra={"ctx": {"group": loaded.group, "queue": loaded.queue, "messages": len(dead)}})
        if retries:
            self._poke(loaded.queue)


def _due_groups(book: PopBook, now: int) -> list[tuple[str, str]]:
    return [key for key, group in book.groups.items() if any(True for _ in group.due(now))]


def _next_deadline(book: PopBook) -> int | None:
    return min((due for group in book.groups.values() if (due := group.next_deadline()) is not None), default=None)


def _user_property(name: str, value: str) -> bytes:
    encoded = b""
    for text in (name, value):
        raw = text.encode()
        encoded += len(raw).to_bytes(2, "big") + raw
    return bytes([USER_PROPERTY]) + encoded


def dead_letter(group: str, queue: str, offset: int, attempt: int, record: Record) -> NewMessage:
    """The copy of ``record`` appended to ``$dlq/<group>``: its payload, QoS, client id and properties, with where
    it came from as user properties (``dlq-topic``, ``dlq-client``, ``dlq-attempts``, ``dlq-group``, ``dlq-queue``,
    ``dlq-offset``): what an operator inspects, and what a re-drive appends back to."""
    origin = (("dlq-topic", record.topic), ("dlq-client", record.client_id), ("dlq-attempts", str(attempt)),
              ("dlq-group", group), ("dlq-queue", queue), ("dlq-offset", str(offset)))
    properties = record.properties + b"".join(_user_property(name, value) for name, value in origin)
    return NewMessage(dlq_topic(group), record.payload, record.client_id, record.qos, False, properties,
                      record.born_ms)
