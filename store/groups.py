"""Consumer groups (claim/ack): members that share one queue, at least once, from a committed offset.

Back-end consumers (store/clients/consumer.py) go through the store node's ``GroupCoordinator``, so a group's
members may sit on any number of connections. MQTT shared subscriptions pop instead (store/pop/,
docs/consumer-groups.md); so may back-end consumers.

A group (its name is the offsets owner and the filter holder: ``$group/<name>`` for back-end consumers) reads one
light queue. A *member* is one connected consumer (named within its connection). Hand-out (:class:`GroupState`,
no I/O): a member's claim gets the offsets other members handed back first (lowest first), then a fair share
of the backlog from the group's cursor (the backlog divided by the members, so one large claim does not starve
the others). Offsets stay the member's until it acknowledges them (kept and acknowledged as ``(base, count)``
ranges, store/offsetranges.py: a batch record's messages are one); when it leaves (its connection closed, its
node went away: ``leave_node``) what it did not acknowledge goes back to the group, and the claims waiting on
the group are woken. The group's committed offset is the
lowest offset not acknowledged (handed back, held, or the cursor), written under the group's name, so a group
loaded again from it loses nothing (what was acknowledged above it is delivered again: at least once).

The group holds its filter (``activate`` with its name as holder), so a wildcard filter's queue is indexed
from the first join on, also while no member is connected. A group without a committed offset starts at ``earliest`` (the queue's first offset still stored),
``latest`` (the first message appended after the join), an ``offset`` or a ``time`` (the first message
stored at or after it, ``LightQueues.offset_at_time``); later joins resume from the committed offset.

Waiting: a claim long-polls; the store node wakes the claims waiting on a queue after each dispatch batch
(``wake``) and when offsets are handed back.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, final

import trio

from lightqueue.queues import LightQueues
from lightqueue.results import PullResult
from store.log.aio import AsyncCommitLog
from store.log.recent import RecentRecords
from store.log.record import Record, batch_part, decode_record
from store.offsetranges import OffsetRanges, Range, ranges_of

__all__ = ["DECODED", "WHOLE", "Form", "GroupCoordinator", "GroupState", "GroupStatistics", "GroupStore", "Member",
           "START_KINDS", "Stored", "entry_offsets", "entry_ranges", "messages_of", "read_offsets", "served",
           "start_offset", "stored"]

LOGGER = logging.getLogger(__name__)


START_KINDS = ("earliest", "latest", "offset", "time")
"""Where a group without a committed offset starts (``time``: ms since the epoch)."""

MAX_UNACKED = 65_536
"""Offsets one member may hold unacknowledged per group: a consumer that claims and never acknowledges stops
getting more, so the group's held ranges (and what a leave hands back) stay bounded. Counted in messages, held
in ranges (a claim of whole batch records is a few): room for several claims of a 1 MiB batch record of small
messages (about 11,000 of 64 B) in flight, so that a member over the RPC claims the next while it acknowledges
the last."""

MAX_CLAIM_BYTES = 16 * 1024 * 1024
"""A claim's byte budget is capped at this, so its answer stays far below the RPC frame limit."""

T = TypeVar("T")


@final
@dataclass(frozen=True, slots=True)
class Form(Generic[T]):
    """What a consumer read (:func:`read_offsets`) hands out, as ``LightQueues.pull`` makes it: ``decode(raw,
    log_offset)`` of a record as stored, and of a batch record either ``unpack(value)``, its messages from one
    decode of the record (neither re-encoded nor decoded again per message: most of a claim's cost when batches
    came), or ``whole(value, first, stop)``: its messages ``first`` to ``stop - 1`` as one value, undecoded (the
    RPC's form: its client decodes the record once). ``cached``: the records kept decoded in memory
    (``RecentRecords``) serve as they are, not read and decoded again."""

    decode: Callable[[bytes, int], T]
    size: Callable[[T], int]
    """What a value costs of a read's byte budget."""
    unpack: Callable[[T], Sequence[T]] | None = None
    whole: Callable[[T, int, int], T] | None = None
    count: Callable[[T], int] = lambda _: 1
    """The messages a value stands for (more than 1: a batch record's, in the ``whole`` form)."""
    cached: bool = False


Stored = tuple[int, bytes, int, int]
"""A record as stored, in the RPC's form: ``(log offset, bytes, first, stop)``; a batch record's messages ``first`` to
``stop - 1`` are served (the record whole), a single record has ``first == stop == 0``."""


def stored(raw: bytes, log_offset: int) -> Stored:
    """A record as stored (``LightQueues.pull``'s ``decode`` for the RPC)."""
    return log_offset, raw, 0, 0


def served(record: Stored, first: int, stop: int) -> Stored:
    """A batch record whose messages ``first`` to ``stop - 1`` are served (``LightQueues.pull``'s ``whole``): the
    record whole, or, when they are fewer than half of its messages, a batch record of those only
    (``batch_part``), at the position of the first."""
    part = batch_part(record[1], first, stop)
    if part is None:
        return record[0], record[1], first, stop
    return record[0] + first, part, 0, stop - first


def messages_of(record: Record) -> tuple[Record, ...]:
    """The messages of a decoded batch record (``LightQueues.pull``'s ``unpack``)."""
    return record.messages


DECODED: Form[Record] = Form(lambda raw, offset: decode_record(raw, 0, offset), lambda record: record.size,
                             messages_of, cached=True)
"""Each message as a ``Record`` (a store in this process)."""

WHOLE: Form[Stored] = Form(stored, lambda value: len(value[1]), whole=served,
                           count=lambda value: value[3] - value[2] or 1)
"""Each record as stored (``Stored``), a batch record whole (claims, POPs and pulls over the RPC: their client
decodes)."""

Member = tuple[str, str]
"""A group member: (the node it is connected to, its name there: "" for a back-end client's connection, which is
its own node)."""


@final
class GroupState:
    """Who holds which offsets of one group's queue, and what is left to hand out. No I/O.

    Args:
        cursor: the next queue offset never handed out (the committed offset when the group is loaded).
    """

    __slots__ = ("cursor", "returned", "held")

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor
        self.returned: list[int] = []  # heap of offsets handed back by members that left
        self.held: dict[Hashable, OffsetRanges] = {}  # member -> offsets handed to it and not acknowledged

    @property
    def members(self) -> int:
        return len(self.held)

    def join(self, member: Hashable) -> None:
        if member not in self.held:
            self.held[member] = OffsetRanges()

    def leave(self, member: Hashable) -> int:
        """The member is gone: what it holds goes back to the group. Returns how many offsets did."""
        held = self.held.pop(member, OffsetRanges())
        for offset in held:
            heapq.heappush(self.returned, offset)
        return len(held)

    def plan(self, member: Hashable, max_count: int, head: int) -> tuple[list[int], int]:
        """What ``member`` gets next: handed-back offsets (taken now) and how many to read from the cursor.

        Args:
            max_count: the most offsets the member asks for.
            head: the queue's next offset (its max offset): the backlog is ``head - cursor``.

        Raises:
            KeyError: ``member`` has not joined.
        """
        room = min(max_count, MAX_UNACKED - len(self.held[member]))
        if room <= 0:
            return [], 0
        returned = self.returned
        taken = [heapq.heappop(returned) for _ in range(min(room, len(returned)))]
        backlog = head - self.cursor
        if backlog <= 0:
            return taken, 0
        share = -(-backlog // len(self.held))  # ceiling: the last member's share is never 0
        return taken, min(room - len(taken), share)

    def hand_out(self, member: Hashable, ranges: Iterable[Range]) -> None:
        """The ``(base, count)`` ranges were read for ``member``; if it left meanwhile they go back to the group."""
        held = self.held.get(member)
        if held is not None:
            for base, count in ranges:
                held.add(base, count)
        else:
            for base, count in ranges:
                for offset in range(base, base + count):
                    heapq.heappush(self.returned, offset)

    def give_back(self, offsets: list[int]) -> None:
        """Offsets taken by :meth:`plan` but not read (the claim's byte budget ran out)."""
        for offset in offsets:
            heapq.heappush(self.returned, offset)

    def advance(self, next_offset: int) -> None:
        """Everything below ``next_offset`` was read from the cursor (handed out, or expired)."""
        if next_offset > self.cursor:
            self.cursor = next_offset

    def ack(self, member: Hashable, ranges: Iterable[Range], below: int = 0) -> int:
        """``member`` processed the ``(base, count)`` ranges and every offset it holds below ``below``; returns how
        many of them it held (others were handed back meanwhile)."""
        held = self.held.get(member)
        if not held:
            return 0
        done = held.remove_below(below) if below else 0
        for base, count in ranges:
            done += held.remove(base, count)
        return done

    def committed(self) -> int:
        """The group's offset: the lowest offset handed back, held, or never handed out."""
        low = self.cursor
        if self.returned:
            low = min(low, self.returned[0])
        for held in self.held.values():
            first = held.low()
            if first is not None and first < low:
                low = first
        return low

    def unacked(self) -> int:
        return sum(len(held) for held in self.held.values()) + len(self.returned)


@dataclass(eq=False)
class _Group:
    """One group's queue as the coordinator keeps it while members are joined."""

    name: str
    queue: str
    state: GroupState
    committed: int  # the offset last written to the store
    lock: trio.Lock = field(default_factory=trio.Lock)  # one claim at a time: reads between plan and advance
    commit_lock: trio.Lock = field(default_factory=trio.Lock)  # commits in order: the newest offset lands last
    news: trio.Event = field(default_factory=trio.Event)  # set when the queue grew or offsets were handed back

    def wake(self) -> None:
        self.news.set()
        self.news = trio.Event()


@dataclass(frozen=True, slots=True)
class GroupStatistics:
    """One loaded group's figures (the store logs them with its RPC figures)."""

    group: str
    queue: str
    members: int
    cursor: int
    committed: int
    unacked: int  # held by members or handed back


class GroupStore(Protocol):
    """What the coordinator uses of the store node that owns it (``store.node.StoreNode``, which makes it: this
    Protocol names those parts, so this module does not import it back)."""

    queues: LightQueues
    log: AsyncCommitLog
    recent: RecentRecords

    async def activate(self, queue: str, holder: str) -> int:
        """Hold filter ``queue`` for ``holder``; returns the queue offset the hold starts at."""

    async def release(self, queue: str, holder: str) -> bool:
        """``holder`` no longer holds ``queue``."""

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]], *, applied: bool = True) -> None:
        """``{owner: {queue: next offset}}``, durable on return (applied too, unless ``applied`` is False)."""

    async def caught_up(self) -> None:
        """Return once every offset commit written so far is applied (readable with ``queues.get_offsets``)."""

    def in_memory(self, queue: str, from_offset: int) -> bool:
        """Whether the records of ``queue`` from ``from_offset`` on are recent ones (kept in memory)."""


@final
class GroupCoordinator:
    """The consumer groups of one store node (see the module docstring).

    Args:
        store: the open store node: its light queues, log, activations, releases and offset commits.
    """

    def __init__(self, store: GroupStore) -> None:
        self._store = store
        self._groups: dict[tuple[str, str], _Group] = {}
        self._by_queue: dict[str, list[_Group]] = {}
        self._memberships: dict[Member, set[tuple[str, str]]] = {}  # member -> the groups it joined
        self._joining = trio.Lock()  # loading a group (activate, offsets) happens once, whoever joins first

    def wake(self, events: Iterable[str]) -> None:
        """Queues got messages (a dispatch batch): wake the claims waiting on them."""
        by_queue = self._by_queue
        for queue in events:
            for group in by_queue.get(queue, ()):
                group.wake()

    # --- membership -------------------------------------------------------------------

    async def join(self, member: Member, group: str, queue: str, start: str = "latest", at: int = 0) -> int:
        """``member`` joins ``group`` on ``queue``; returns the group's committed offset.

        Args:
            start, at: where a group with no committed offset on the queue
                starts (``START_KINDS``; ``at`` is the offset or the ms timestamp).

        Raises:
            ValueError: an empty group name or an unknown start.
            lightqueue.topics.TopicError: ``queue`` is not a valid topic filter.
            LogFullError: the group's first offset could not be stored.
        """
        if not group:
            raise ValueError("the consumer group name must not be empty")
        if start not in START_KINDS:
            raise ValueError(f"start must be one of {', '.join(START_KINDS)}, not {start!r}")
        loaded = await self._loaded(group, queue, start, at)
        loaded.state.join(member)
        self._memberships.setdefault(member, set()).add((group, queue))
        LOGGER.debug("member joined a group", extra={"ctx": {"member": member, "group": group, "queue": queue,
                                                             "members": loaded.state.members}})
        return loaded.committed

    async def _loaded(self, group: str, queue: str, start: str, at: int) -> _Group:
        key = (group, queue)
        async with self._joining:
            loaded = self._groups.get(key)
            if loaded is None:
                loaded = await self._load(group, queue, start, at)
                self._groups[key] = loaded
                self._by_queue.setdefault(queue, []).append(loaded)
        return loaded

    async def _load(self, group: str, queue: str, start: str, at: int) -> _Group:
        """Hold the queue's filter for the group and find its offset: the committed one, else the start's."""
        store = self._store
        queues = store.queues
        latest = await store.activate(queue, group)
        await store.caught_up()  # the group's last acknowledgements (stored, maybe not applied yet: ``ack``)
        committed = (await trio.to_thread.run_sync(queues.get_offsets, group)).get(queue)
        if committed is None:
            committed = await start_offset(store, queue, start, at, latest)
            await self._commit(group, queue, committed)
        return _Group(group, queue, GroupState(committed), committed)

    async def _commit(self, group: str, queue: str, offset: int, applied: bool = True) -> None:
        await self._store.commit_offsets({group: {queue: offset}}, applied=applied)

    async def leave(self, member: Member, group: str, queue: str) -> None:
        """``member`` leaves: what it holds goes back to the group (a no-op if it was not a member)."""
        key = (group, queue)
        keys = self._memberships.get(member)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._memberships[member]
        self._leave(key, member)

    def leave_node(self, node: str) -> None:
        """``node`` went away (its connection to the store closed): its members leave every group they joined."""
        for member in [m for m in self._memberships if m[0] == node]:
            for key in self._memberships.pop(member):
                self._leave(key, member)

    def _leave(self, key: tuple[str, str], member: Member) -> None:
        loaded = self._groups.get(key)
        if loaded is None or member not in loaded.state.held:
            return
        handed_back = loaded.state.leave(member)
        loaded.wake()
        LOGGER.debug("member left a group", extra={"ctx": {"member": member, "group": key[0], "queue": key[1],
                                                           "handed_back": handed_back,
                                                           "members": loaded.state.members}})
        self._unload_if_idle(loaded)

    def _unload_if_idle(self, loaded: _Group) -> None:
        """A group without members is forgotten: the store keeps its committed offset."""
        if not loaded.state.members:
            self._unload(loaded)

    def _unload(self, loaded: _Group) -> None:
        if self._groups.get((loaded.name, loaded.queue)) is not loaded:
            return
        del self._groups[(loaded.name, loaded.queue)]
        siblings = self._by_queue[loaded.queue]
        siblings.remove(loaded)
        if not siblings:
            del self._by_queue[loaded.queue]

    def _member_group(self, member: Member, group: str, queue: str) -> _Group:
        loaded = self._groups.get((group, queue))
        if loaded is None or member not in loaded.state.held:
            raise ValueError(f"not a member of consumer group {group!r} on {queue!r}: join first")
        return loaded

    # --- claims and acknowledgements ----------------------------------------------------

    async def claim(self, member: Member, group: str, queue: str, max_count: int, max_bytes: int, wait_s: float,
                    form: Form[T]) -> PullResult[T]:
        """Messages for ``member``, now its until it acknowledges them; waits up to ``wait_s`` for some.

        Each message in ``form`` (``next_offset`` is the group's cursor). Empty when
        nothing came within ``wait_s`` or the member left meanwhile (it is then not an error: a member that
        leaves while its claim waits gets nothing).

        Raises:
            ValueError: ``member`` has not joined the group, or a count or budget is not positive.
        """
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"max_count and max_bytes must be positive, not {max_count} and {max_bytes}")
        loaded = self._member_group(member, group, queue)
        deadline = trio.current_time() + max(0.0, wait_s)
        while True:
            news = loaded.news
            async with loaded.lock:
                entries = await self._take(loaded, member, max_count, min(max_bytes, MAX_CLAIM_BYTES), form)
            if entries or trio.current_time() >= deadline or member not in loaded.state.held:
                return PullResult(entries, loaded.state.cursor, False)
            with trio.move_on_at(deadline):
                await news.wait()

    async def _take(self, loaded: _Group, member: Member, max_count: int, max_bytes: int,
                    form: Form[T]) -> list[tuple[int, T]]:
        state = loaded.state
        if member not in state.held:
            return []
        returned, fresh = state.plan(member, max_count, self._store.queues.max_offset(loaded.queue))
        if not returned and not fresh:
            return []
        store = self._store
        if store.in_memory(loaded.queue, min(returned, default=state.cursor)):
            # Recent records (in the page cache): a worker thread would take nothing off the loop (Python holds
            # the GIL) and add two hand-offs per claim, which a loaded process waits for behind its producers.
            await trio.lowlevel.checkpoint()
            entries, unread, next_offset = read_offsets(store, loaded.queue, returned, state.cursor, fresh,
                                                        max_bytes, form)
        else:
            entries, unread, next_offset = await trio.to_thread.run_sync(
                read_offsets, store, loaded.queue, returned, state.cursor, fresh, max_bytes, form)
        state.give_back(unread)
        state.hand_out(member, entry_ranges(entries, form))
        if fresh:
            state.advance(next_offset)
        return entries

    async def ack(self, member: Member, group: str, queue: str, offsets: Sequence[int] = (), below: int = 0,
                  ranges: Sequence[Range] = ()) -> int:
        """``member`` processed ``offsets``, the ``(base, count)`` ``ranges`` (a claim's runs: one per batch record)
        and every offset it holds below ``below``; returns the group's committed offset, stored on return as the
        flush policy promises (a ``Committed`` control record).

        Offsets the member does not hold (handed to another member since) are ignored.

        Raises:
            ValueError: ``member`` has not joined the group.
        """
        loaded = self._member_group(member, group, queue)
        state = loaded.state
        if state.ack(member, [*ranges_of(offsets), *ranges], below):
            loaded.wake()  # room under MAX_UNACKED: a claim of this member's that waits for it goes on now
        async with loaded.commit_lock:
            committed = state.committed()
            if committed != loaded.committed:  # stored, not awaited applied: this coordinator holds it, and a load
                await self._commit(group, queue, committed, applied=False)  # waits until it is applied
                loaded.committed = committed
        return loaded.committed

    def groups(self) -> Mapping[tuple[str, str], _Group]:
        """The groups loaded now, by (name, queue)."""
        return self._groups

    def statistics(self) -> list[GroupStatistics]:
        """The groups loaded now (those with a member or a subscriber)."""
        return [GroupStatistics(g.name, g.queue, g.state.members, g.state.cursor, g.committed, g.state.unacked())
                for g in self._groups.values()]


async def start_offset(store: GroupStore, queue: str, start: str, at: int, latest: int) -> int:
    """Where a group without a committed offset on ``queue`` starts (``START_KINDS``; ``latest``: the queue offset
    its activation returned)."""
    queues = store.queues
    if start == "latest":
        return latest
    if start == "time":
        return await trio.to_thread.run_sync(queues.offset_at_time, queue, at)
    low = queues.min_offset(queue)
    return low if start == "earliest" else min(max(at, low), queues.max_offset(queue))


def read_offsets(store: GroupStore, queue: str, returned: list[int], cursor: int, fresh: int, max_bytes: int,
                 form: Form[T]) -> tuple[list[tuple[int, T]], list[int], int]:
    """(worker thread) The messages of ``returned`` offsets and of ``fresh`` offsets from ``cursor`` (a group's claim,
    a POP: store/pop/), each in ``form`` at its queue offset (a value of ``form.count`` messages from there).

    Returns the entries, the handed-back offsets not read (the byte budget
    ran out: they go back), and where the cursor moves. An offset whose
    record retention deleted is neither returned nor given back: it is gone.
    """
    log = store.log.log
    cached = store.recent.get if form.cached else None

    def pull(from_offset: int, max_count: int, budget: int) -> PullResult[T]:
        return store.queues.pull(queue, from_offset, max_count, budget, log, form.decode, cached, form.unpack,
                                 form.whole)

    entries: list[tuple[int, T]] = []
    budget = max_bytes
    runs = _runs(returned)
    size = form.size
    for index, run in enumerate(runs):
        unread = run if budget <= 0 else []
        if not unread:
            result = pull(run[0], len(run), budget)  # a run of consecutive offsets: it reads nothing else
            entries += result.messages
            budget -= sum(size(value) for _, value in result.messages)
            unread = [o for o in run if o >= result.next_offset]
        if unread:
            return entries, unread + [o for later in runs[index + 1:] for o in later], cursor
    if fresh <= 0 or budget <= 0:
        return entries, [], cursor
    result = pull(cursor, fresh, budget)
    entries += result.messages
    return entries, [], result.next_offset


def entry_ranges(entries: Sequence[tuple[int, T]], form: Form[T]) -> list[Range]:
    """The queue offsets of the messages of ``entries`` (:func:`read_offsets`') as ``(base, count)`` runs, in order:
    in the ``whole`` form a value stands for ``form.count(value)`` messages from its offset."""
    if form.whole is None:  # a value per message: their offsets, mostly one run
        return ranges_of(qoff for qoff, _ in entries)
    count = form.count
    ranges: list[Range] = []
    for qoff, value in entries:
        n = count(value)
        if ranges and sum(ranges[-1]) == qoff:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
        else:
            ranges.append((qoff, n))
    return ranges


def entry_offsets(entries: Sequence[tuple[int, T]], form: Form[T]) -> list[int]:
    """The queue offset of each message of ``entries`` (:func:`read_offsets`'), in order."""
    return [o for base, n in entry_ranges(entries, form) for o in range(base, base + n)]


def _runs(offsets: list[int]) -> list[list[int]]:
    """Offsets in runs of consecutive ones, in order: each run is one queue read."""
    return [list(range(base, base + count)) for base, count in ranges_of(offsets)]
