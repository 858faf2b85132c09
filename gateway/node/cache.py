"""The per-node queue cache: a queue's new messages are read from the store once, for all local sessions.

design.md, "Pull and push": when a dispatch event says queue Q has news, the
node's cache reads Q's new entries from the store (one batched pull for every
queue in the event batch: one thread hand-off embedded, one round trip in a
cluster) before the local sessions on Q are told; their pulls at the head are
then answered from memory. A session behind the cached window (resumed after
being offline, or slow) reads the store itself; reads that continue the cached
run at its tail extend it, so the first session to read a queue seeds its cache.

Bounded memory: at most ``max_messages`` per queue (the oldest go first) and
``max_bytes`` in all (the queues written to longest ago go first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import final

import msgspec
import trio

from gateway.mqtt.actions import Message
from gateway.mqtt.properties import EMPTY_PROPERTIES, PacketType, Properties, decode_properties
from store.api import FLAG_RETAIN, QOS_MASK, PullRequest, PullResult, Record, StoreApi

__all__ = ["QueueCache", "QueueCacheStatistics", "from_record"]

MESSAGE_OVERHEAD = 300
"""Bytes a cached ``Message`` costs beyond its topic and payload (object, list slot, and the ``PublishTemplate`` its
first delivery makes: a struct sharing the payload, and a short topic's encoding shared by its messages), for the
budget."""

PROPERTIES_OVERHEAD = 200
USER_PROPERTY_OVERHEAD = 160
"""What decoded MQTT 5 properties cost beyond their text: the ``Properties`` object, and a tuple and two strings
per User Property; their text is counted twice, decoded and encoded once more in the message's template. Counted
so that messages carrying 32 User Properties each (~5 KB decoded) do not make the byte budget hold 25 times what it
says."""


@dataclass(frozen=True, slots=True)
class QueueCacheStatistics:
    queues: int  # queues with cached messages
    messages: int
    bytes: int  # estimated
    hits: int  # session reads answered from memory
    store_reads: int  # session reads that went to the store (behind the cache, or ahead of it)
    fills: int  # queue reads by the cache itself, after dispatch events


class _Cached(msgspec.Struct, gc=False, eq=False):
    """A watched queue's cached run: ``base`` is the queue offset of ``messages[0]`` (None until the first read seeds
    it). Untracked by the garbage collector (``gc=False``): it refers to its list of messages, which never refer back,
    so no cycle runs through it; one per subscribed queue (50,000 in issue 31's attack) was one more object for
    every full collection to walk, and a ``__slots__`` instance each took a Python ``__init__``."""

    base: int | None = None
    # A list from the first read that brings messages: most watched queues get none (issue 31: 50,000
    # subscriptions made 50,000 empty lists, each one more object for every full garbage collection).
    messages: list[Message] | tuple[()] = ()
    bytes: int = 0
    watchers: int = 0

    @property
    def tail(self) -> int | None:
        return None if self.base is None else self.base + len(self.messages)


@final
class QueueCache:
    """Recent messages of the queues local sessions read, shared by those sessions.

    Each record becomes the ``Message`` sessions deliver once (``from_record``), shared by them, and so is the
    PUBLISH template the first of them makes (``Message.template``).

    Args:
        store: where misses and fills read.
        max_messages: per queue.
        max_bytes: for all queues together (estimated).
    """

    def __init__(self, store: StoreApi, *, max_messages: int = 16384, max_bytes: int = 64 << 20) -> None:
        self._store = store
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        self._queues: dict[str, _Cached] = {}  # insertion order = least recently extended first
        self._bytes = 0
        self._hits = 0
        self._store_reads = 0
        self._fills = 0

    def watch(self, queue: str) -> None:
        """One more local session reads ``queue``."""
        entry = self._queues.get(queue)
        if entry is None:
            entry = self._queues[queue] = _Cached()
        entry.watchers += 1

    def at_head(self, queue: str, head: int) -> None:
        """A watched queue has nothing from ``head`` on (the store said so after the watch began): an empty run
        there, as an empty read at the head seeds, so that its news fills the cache."""
        entry = self._queues.get(queue)
        if entry is not None and entry.base is None:
            entry.base = head

    def unwatch(self, queue: str) -> None:
        """One local session fewer reads ``queue``; the last one out drops its messages."""
        entry = self._queues.get(queue)
        if entry is None:
            return
        entry.watchers -= 1
        if entry.watchers <= 0:
            del self._queues[queue]
            self._bytes -= entry.bytes

    def get(self, queue: str, from_offset: int, max_count: int) -> tuple[list[Message], int] | None:
        """The cached messages from ``from_offset`` (at most ``max_count``) and the next offset; None on a miss."""
        entry = self._queues.get(queue)
        if entry is None or entry.base is None or not entry.base <= from_offset < entry.base + len(entry.messages):
            return None  # an empty run included: its messages are a list when this passes
        start = from_offset - entry.base
        taken = entry.messages[start:start + max_count]
        self._hits += 1
        return taken, from_offset + len(taken)  # type: ignore[return-value]  # a list: the run is not empty

    async def read(self, queue: str, from_offset: int, max_count: int) -> tuple[list[Message], int, bool]:
        """Up to ``max_count`` messages of ``queue`` from ``from_offset``: (messages, next offset, expired).

        ``expired``: retention deleted messages at ``from_offset``; the answer starts after them.
        """
        hit = self.get(queue, from_offset, max_count)
        if hit is not None:
            return hit[0], hit[1], False
        self._store_reads += 1
        (result,) = await self._store.pull([PullRequest(queue, from_offset, max_count)])
        messages = [from_record(record, queue, offset) for offset, record in result.messages]
        self._extend(queue, from_offset, result, messages)
        return messages, result.next_offset, result.expired

    async def fill(self, events: Mapping[str, int]) -> None:
        """Read the news of the cached queues in ``events`` (``{queue: max offset}``), all in one store call."""
        requests = self._fill_requests(events)
        if not requests:
            return
        try:
            results = self._store.pull_nowait(requests)
        except trio.WouldBlock:
            results = await self._store.pull(requests)
        self._filled(requests, results)

    def fill_nowait(self, events: Mapping[str, int]) -> bool:
        """:meth:`fill` if the store can read the news without waiting (they are in its memory); False: nothing
        was read."""
        requests = self._fill_requests(events)
        if requests:
            try:
                results = self._store.pull_nowait(requests)
            except trio.WouldBlock:
                return False
            self._filled(requests, results)
        return True

    def _fill_requests(self, events: Mapping[str, int]) -> list[PullRequest]:
        """The reads of a fill: each cached queue of ``events`` from its tail to its news."""
        requests = []
        for queue, head in events.items():
            entry = self._queues.get(queue)
            tail = entry.tail if entry is not None else None
            if tail is not None and tail < head:
                requests.append(PullRequest(queue, tail, min(head - tail, self._max_messages)))
        return requests

    def _filled(self, requests: list[PullRequest], results: list[PullResult[Record]]) -> None:
        self._fills += len(requests)
        for request, result in zip(requests, results):
            queue = request.queue
            messages = [from_record(record, queue, offset) for offset, record in result.messages]
            self._extend(queue, request.from_offset, result, messages)

    def _extend(self, queue: str, from_offset: int, result: PullResult[Record], messages: list[Message]) -> None:
        """Append a read's messages if they continue the cached run; a read ahead of the run starts a new one."""
        entry = self._queues.get(queue)
        if entry is None or result.expired or result.next_offset != from_offset + len(messages):
            return  # not cached, or a gap (retention): the run must stay contiguous
        tail = entry.tail
        if not messages:
            if tail is None:
                entry.base = from_offset  # an empty read at the head seeds an empty run: the next event fills it
            return
        if tail is None or from_offset > tail:  # seed, or restart ahead of a run that fell behind the head
            self._bytes -= entry.bytes
            entry.base, entry.messages, entry.bytes = from_offset, (), 0
        elif from_offset < tail:
            return  # behind the run, or a concurrent read extended it already: keep the run
        size = _bytes(messages)
        if entry.messages:
            entry.messages += messages
        else:  # the run's first messages: its own list (the caller keeps ``messages``)
            entry.messages = list(messages)
        entry.bytes += size
        self._bytes += size
        excess = len(entry.messages) - self._max_messages
        if excess > 0:
            dropped = entry.messages[:excess]
            del entry.messages[:excess]
            entry.base = (entry.base or 0) + excess  # set: the run holds messages
            freed = _bytes(dropped)
            entry.bytes -= freed
            self._bytes -= freed
        del self._queues[queue]  # most recently extended: evicted last
        self._queues[queue] = entry
        self._evict()

    def _evict(self) -> None:
        for entry in self._queues.values():
            if self._bytes <= self._max_bytes:
                return
            self._bytes -= entry.bytes
            entry.base, entry.messages, entry.bytes = None, (), 0

    def statistics(self) -> QueueCacheStatistics:
        cached = [e for e in self._queues.values() if e.messages]
        return QueueCacheStatistics(
            queues=len(cached), messages=sum(len(e.messages) for e in cached), bytes=self._bytes,
            hits=self._hits, store_reads=self._store_reads, fills=self._fills,
        )


def _bytes(messages: list[Message]) -> int:
    """The estimated memory of ``messages`` in the cache (the budget's unit)."""
    empty = EMPTY_PROPERTIES
    return sum([len(m.payload) + len(m.topic) + (0 if m.properties is empty else _properties_bytes(m.properties))
                for m in messages]) + MESSAGE_OVERHEAD * len(messages)


def _properties_bytes(properties: Properties) -> int:
    pairs = properties.user_properties
    text = sum([len(k) + len(v) for k, v in pairs]) + len(properties.correlation_data or b"") \
        + len(properties.response_topic or "")
    return PROPERTIES_OVERHEAD + 2 * text + USER_PROPERTY_OVERHEAD * len(pairs)


def from_record(record: Record, queue: str | None, offset: int | None) -> Message:
    """The message a record holds, as read from ``queue`` at ``offset`` (None, None: a retained copy): its MQTT 5
    property block decoded once, for every local session that delivers it."""
    props = record.properties
    flags = record.flags  # not the qos/retain properties: this runs once per message and queue
    return Message(
        record.topic, record.payload, flags & QOS_MASK, flags & FLAG_RETAIN != 0,  # not bool(): no call
        decode_properties(props, 0, len(props), PacketType.PUBLISH) if props else EMPTY_PROPERTIES,
        record.client_id, record.born_ms, record.store_ms, queue, offset,
    )
