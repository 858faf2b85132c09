"""Consumer groups: back-end consumers that share one queue, at least once, from a committed offset.

A consumer group reads one light queue (a topic filter such as ``tele/#``, or
a topic) as a classic topic: several consumers of the group share the work,
each message is handed to one member at a time, and the group's position
survives restarts. The consumers are separate processes, so the group lives in
the store node (the embedded gateway's ``SharedGroup`` is the same idea
inside one process). The members are RPC connections (store/rpc/server.py): one
member per connection that joined.

Hand-out (:class:`GroupState`, no I/O): a member's claim gets the offsets that
other members handed back first (lowest first), then a fair share of the
backlog from the group's cursor (the backlog divided by the members, so one
large claim does not starve the others). Offsets stay the member's until it
acknowledges them; when its connection closes (a consumer killed, or silent for
the lease, store/rpc/server.py) or it leaves, the offsets it has not acknowledged
go back to the group. The group's committed offset is the lowest offset not
acknowledged (handed back, held, or the cursor); it is written through
``LightQueues.commit_offsets`` under the owner ``$group/<name>``, so a group
restarted from it loses nothing (what was acknowledged above it is delivered
again: at least once).

The group holds its filter (``activate`` with the owner as holder), so the
queue of a wildcard filter is indexed from the first join on, also while no
member is connected. A group without a committed offset starts at
``earliest`` (the queue's first offset still stored), ``latest`` (the first
message appended after the join), an ``offset`` or a ``time`` (the first
message stored at or after it, ``LightQueues.offset_at_time``); later joins
resume from the committed offset and ignore their start.

Waiting: a claim long-polls. The coordinator watches each group's queue
through the store's notify (it is attached like a gateway node) and wakes the
claims waiting on a queue when it gets messages or offsets are handed back.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import final

import trio

from store.local import LocalStoreClient
from store.node import StoreNode

__all__ = ["GroupCoordinator", "GroupState", "GroupStatistics", "OWNER_PREFIX", "START_KINDS", "group_owner"]

LOGGER = logging.getLogger(__name__)

OWNER_PREFIX = "$group/"
"""Owner and holder names of consumer groups: apart from sessions (client ids) and the gateway's ``$share/``."""

START_KINDS = ("earliest", "latest", "offset", "time")
"""Where a group without a committed offset starts (``time``: ms since the epoch)."""

MAX_UNACKED = 10_000
"""Offsets one member may hold unacknowledged per group: a consumer that claims and never acknowledges stops
getting more, so the group's held sets (and the cost of computing its committed offset) stay bounded."""

MAX_CLAIM_BYTES = 16 * 1024 * 1024
"""A claim's byte budget is capped at this, so its answer stays far below the RPC frame limit."""

Entry = tuple[int, int, bytes]
"""A claimed message: (queue offset, CommitLog offset, record bytes as stored)."""

_coordinators = itertools.count(1)


def group_owner(group: str) -> str:
    """The owner name (offsets) and holder name (filter activation) of consumer group ``group``."""
    return OWNER_PREFIX + group


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
        self.held: dict[str, set[int]] = {}  # member -> offsets handed to it and not acknowledged

    @property
    def members(self) -> int:
        return len(self.held)

    def join(self, member: str) -> None:
        self.held.setdefault(member, set())

    def leave(self, member: str) -> int:
        """The member is gone: what it holds goes back to the group. Returns how many offsets did."""
        held = self.held.pop(member, set())
        for offset in held:
            heapq.heappush(self.returned, offset)
        return len(held)

    def plan(self, member: str, max_count: int, head: int) -> tuple[list[int], int]:
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

    def hand_out(self, member: str, offsets: list[int]) -> None:
        """The offsets were read for ``member``; if it left meanwhile they go back to the group."""
        held = self.held.get(member)
        if held is not None:
            held.update(offsets)
        else:
            for offset in offsets:
                heapq.heappush(self.returned, offset)

    def give_back(self, offsets: list[int]) -> None:
        """Offsets taken by :meth:`plan` but not read (the claim's byte budget ran out)."""
        for offset in offsets:
            heapq.heappush(self.returned, offset)

    def advance(self, next_offset: int) -> None:
        """Everything below ``next_offset`` was read from the cursor (handed out, or expired)."""
        if next_offset > self.cursor:
            self.cursor = next_offset

    def ack(self, member: str, offsets: list[int]) -> int:
        """``member`` processed these offsets; returns how many it held (others were handed back meanwhile)."""
        held = self.held.get(member)
        if not held:
            return 0
        before = len(held)
        held.difference_update(offsets)
        return before - len(held)

    def committed(self) -> int:
        """The group's offset: the lowest offset handed back, held, or never handed out."""
        low = self.cursor
        if self.returned:
            low = min(low, self.returned[0])
        for held in self.held.values():
            if held:
                low = min(low, min(held))
        return low

    def unacked(self) -> int:
        return sum(len(held) for held in self.held.values()) + len(self.returned)


@dataclass(eq=False)
class _Group:
    """One group's queue as the coordinator keeps it while members are joined."""

    name: str
    queue: str
    owner: str
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


@final
class GroupCoordinator:
    """The consumer groups of one store node (see the module docstring).

    Args:
        store: the open store node.

    Resource handling: attaches itself to the store's notify on creation
    (a node named ``$groups-<n>``); :meth:`run` consumes its events and
    detaches it when cancelled.
    """

    def __init__(self, store: StoreNode) -> None:
        self._store = store
        self._client = LocalStoreClient(store, node=f"$groups-{next(_coordinators)}")
        self._groups: dict[tuple[str, str], _Group] = {}
        self._by_queue: dict[str, list[_Group]] = {}
        self._memberships: dict[str, set[tuple[str, str]]] = {}  # member -> the groups it joined
        self._joining = trio.Lock()  # loading a group (activate, offsets) happens once, whoever joins first

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wake the claims waiting on queues that got messages, until cancelled; then detach from notify."""
        try:
            task_status.started()
            while True:
                try:
                    events = await self._client.events()
                except trio.EndOfChannel:
                    return
                for queue in events:
                    for group in self._by_queue.get(queue, ()):
                        group.wake()
        finally:
            self._client.close()

    # --- membership -------------------------------------------------------------------

    async def join(self, member: str, group: str, queue: str, start: str = "earliest", at: int = 0) -> int:
        """``member`` joins ``group`` on ``queue``; returns the group's committed offset.

        Args:
            start, at: where a group with no committed offset on the queue
                starts (``START_KINDS``; ``at`` is the offset or the ms timestamp).

        Raises:
            ValueError: an empty group name or an unknown start.
            lightqueue.topics.TopicError: ``queue`` is not a valid topic filter.
        """
        if not group:
            raise ValueError("the consumer group name must not be empty")
        if start not in START_KINDS:
            raise ValueError(f"start must be one of {', '.join(START_KINDS)}, not {start!r}")
        key = (group, queue)
        async with self._joining:
            loaded = self._groups.get(key)
            if loaded is None:
                loaded = await self._load(group, queue, start, at)
                self._groups[key] = loaded
                self._by_queue.setdefault(queue, []).append(loaded)
                self._client.watch(queue)
            loaded.state.join(member)
            self._memberships.setdefault(member, set()).add(key)
        LOGGER.info("consumer joined a group", extra={"ctx": {"member": member, "group": group, "queue": queue,
                                                              "members": loaded.state.members}})
        return loaded.committed

    async def _load(self, group: str, queue: str, start: str, at: int) -> _Group:
        """Hold the queue's filter for the group and find its offset: the committed one, else the start's."""
        owner = group_owner(group)
        client = self._client
        latest = await client.activate(queue, owner)
        committed = (await client.get_offsets(owner)).get(queue)
        if committed is None:
            queues = self._store.queues
            if start == "latest":
                committed = latest
            elif start == "time":
                committed = await trio.to_thread.run_sync(queues.offset_at_time, queue, at)
            else:
                low = queues.min_offset(queue)
                committed = low if start == "earliest" else min(max(at, low), queues.max_offset(queue))
            await client.commit_offsets({owner: {queue: committed}})
        return _Group(group, queue, owner, GroupState(committed), committed)

    def leave(self, member: str, group: str, queue: str) -> None:
        """``member`` leaves: what it holds goes back to the group (a no-op if it was not a member)."""
        key = (group, queue)
        keys = self._memberships.get(member)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._memberships[member]
        self._leave(key, member)

    def leave_all(self, member: str) -> None:
        """``member``'s connection closed: it leaves every group it joined."""
        for key in self._memberships.pop(member, ()):
            self._leave(key, member)

    def _leave(self, key: tuple[str, str], member: str) -> None:
        loaded = self._groups.get(key)
        if loaded is None or member not in loaded.state.held:
            return
        handed_back = loaded.state.leave(member)
        loaded.wake()
        LOGGER.info("consumer left a group", extra={"ctx": {"member": member, "group": key[0], "queue": key[1],
                                                            "handed_back": handed_back,
                                                            "members": loaded.state.members}})
        if not loaded.state.members:  # the store keeps its committed offset; the next join loads it again
            del self._groups[key]
            siblings = self._by_queue[loaded.queue]
            siblings.remove(loaded)
            if not siblings:
                del self._by_queue[loaded.queue]
            self._client.unwatch(loaded.queue)

    def _member_group(self, member: str, group: str, queue: str) -> _Group:
        loaded = self._groups.get((group, queue))
        if loaded is None or member not in loaded.state.held:
            raise ValueError(f"not a member of consumer group {group!r} on {queue!r}: join first")
        return loaded

    # --- claims and acknowledgements ----------------------------------------------------

    async def claim(self, member: str, group: str, queue: str, max_count: int, max_bytes: int,
                    wait_s: float) -> list[Entry]:
        """Messages for ``member``, now its until it acknowledges them; waits up to ``wait_s`` for some.

        Returns an empty list when nothing came within ``wait_s`` (or the member left meanwhile).

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
                entries = await self._take(loaded, member, max_count, min(max_bytes, MAX_CLAIM_BYTES))
            if entries or trio.current_time() >= deadline or member not in loaded.state.held:
                return entries
            with trio.move_on_at(deadline):
                await news.wait()

    async def _take(self, loaded: _Group, member: str, max_count: int, max_bytes: int) -> list[Entry]:
        state = loaded.state
        if member not in state.held:
            return []
        returned, fresh = state.plan(member, max_count, self._store.queues.max_offset(loaded.queue))
        if not returned and not fresh:
            return []
        entries, unread, next_offset = await trio.to_thread.run_sync(
            self._read, loaded.queue, returned, state.cursor, fresh, max_bytes)
        state.give_back(unread)
        state.hand_out(member, [entry[0] for entry in entries])
        if fresh:
            state.advance(next_offset)
        return entries

    def _read(self, queue: str, returned: list[int], cursor: int, fresh: int,
              max_bytes: int) -> tuple[list[Entry], list[int], int]:
        """(worker thread) The records of ``returned`` and of ``fresh`` offsets from ``cursor``.

        Returns the entries, the handed-back offsets not read (the byte budget
        ran out: they go back), and where the cursor moves. An offset whose
        record retention deleted is neither returned nor given back: it is gone.
        """
        store = self._store
        pull = store.queues.pull
        log = store.log.log
        entries: list[Entry] = []
        budget = max_bytes
        runs = _runs(returned)
        for index, run in enumerate(runs):
            unread = run if budget <= 0 else []
            if not unread:
                wanted = set(run)
                result = pull(queue, run[0], len(run), budget, log, _raw)
                for qoff, (log_offset, raw) in result.messages:
                    if qoff in wanted:
                        entries.append((qoff, log_offset, raw))
                        budget -= len(raw)
                unread = [o for o in run if o >= result.next_offset]
            if unread:
                return entries, unread + [o for later in runs[index + 1:] for o in later], cursor
        if fresh <= 0 or budget <= 0:
            return entries, [], cursor
        result = pull(queue, cursor, fresh, budget, log, _raw)
        entries.extend((qoff, log_offset, raw) for qoff, (log_offset, raw) in result.messages)
        return entries, [], result.next_offset

    async def ack(self, member: str, group: str, queue: str, offsets: list[int]) -> int:
        """``member`` processed these offsets; returns the group's committed offset, durable on return.

        Offsets the member does not hold (handed to another member since) are ignored.

        Raises:
            ValueError: ``member`` has not joined the group.
        """
        loaded = self._member_group(member, group, queue)
        loaded.state.ack(member, offsets)
        async with loaded.commit_lock:
            committed = loaded.state.committed()
            if committed != loaded.committed:
                await self._client.commit_offsets({loaded.owner: {queue: committed}})
                loaded.committed = committed
        return loaded.committed

    def statistics(self) -> list[GroupStatistics]:
        """The groups loaded now (those with at least one member)."""
        return [GroupStatistics(g.name, g.queue, g.state.members, g.state.cursor, g.committed, g.state.unacked())
                for g in self._groups.values()]


def _runs(offsets: list[int]) -> list[list[int]]:
    """Sorted offsets in runs of consecutive ones: each run is one queue read."""
    runs: list[list[int]] = []
    for offset in sorted(offsets):
        if runs and runs[-1][-1] + 1 == offset:
            runs[-1].append(offset)
        else:
            runs.append([offset])
    return runs


def _raw(raw: bytes, log_offset: int) -> tuple[int, bytes]:
    return log_offset, raw
