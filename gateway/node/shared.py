"""Shared subscriptions (``$share/<group>/<filter>``): the node's groups and how they hand out messages.

A group reads the one queue of its filter; the group (``$share/<group>``) is
the queue's holder and owns its offset in the store. The node arbitrates among
the group's connected members: a member's pull gets the offsets members that
left handed back first, then its fair share of the backlog (the backlog
divided among the connected members), so each message goes to one connected
member at a time. What a member leaves unacknowledged (disconnect,
unsubscribe) goes back to the others: delivery to a group is at least once.
The group's committed offset is the lowest offset handed out and not
acknowledged; the last subscriber out releases the queue.

Cluster mode (docs/cluster.md): a group may have members on several gateway
nodes, so no node can hand out offsets alone. With an ``arbiter`` (the
``RemoteStoreClient``) the store's consumer group of the same name
(store/groups.py) does: the node is one member of it, claims fresh offsets
for its members' pulls, acknowledges what they acknowledged, and leaves when
its last local member goes (the store then hands what the node held to the
other nodes). Among its own members the node arbitrates as above.
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, final, runtime_checkable

import trio

from gateway.mqtt.actions import Message, Pull, Pulled, QueueAdvanced, Subscription
from gateway.node.cache import QueueCache
from gateway.node.commits import CommitBatcher
from gateway.node.connection import Connection
from lightqueue.topics import parse_shared
from store.local import StoreClient
from store.log.record import Record

__all__ = ["SHARE_OWNER_PREFIX", "GroupArbiter", "SharedGroup", "SharedGroups"]

LOGGER = logging.getLogger(__name__)

CLAIM_BYTES = 1 << 20
"""A claim's byte budget at the store, as a pull's: at least one message, at most about this much."""

SHARE_OWNER_PREFIX = "$share/"
"""Light-queue holder and offset owner name of a shared subscription group: ``$share/<group>``.
Client ids are opaque, so the prefix keeps groups apart from sessions in practice, as EMQX does."""


@final
class SharedGroup:
    """One shared subscription group on one queue: which member holds which offsets, and the group's offset.

    Offsets are handed out at most once at a time: each pull takes back-handed
    offsets first, then new ones from ``cursor`` (a fair share of the backlog
    among connected members, so one pull batch does not starve the others).
    The group's committed offset is the lowest offset handed out and not
    acknowledged (or handed back), else ``cursor``.
    """

    def __init__(self, name: str, queue: str, cursor: int) -> None:
        self.name = name
        self.queue = queue
        self.owner = SHARE_OWNER_PREFIX + name
        self.cursor = cursor  # next queue offset never handed out
        self.committed = cursor  # the offset last written to the store
        self.returned: list[int] = []  # heap of offsets handed back by members that left
        self.held: dict[Connection, set[int]] = {}  # connected member -> offsets handed to it, not acknowledged
        self.subscribers: set[str] = set()  # client ids whose sessions hold the subscription, connected or not
        self.lock = trio.Lock()  # one pull at a time: a pull reads the store between taking and moving the cursor
        self.joined = False  # cluster mode: this node is a member of the store's group

    def acknowledged_below(self, member: Connection, offset: int) -> list[int]:
        """The member acknowledged everything it was handed below ``offset`` (its session's committed offset).

        Returns those offsets.
        """
        held = self.held.get(member)
        if not held:
            return []
        acked = [o for o in held if o < offset]
        held.difference_update(acked)
        return acked

    def leave(self, member: Connection) -> bool:
        """The member is gone: what it holds goes back to the group. Returns whether anything did."""
        held = self.held.pop(member, set())
        for offset in held:
            heapq.heappush(self.returned, offset)
        return bool(held)

    def committed_offset(self) -> int:
        low = min(self.cursor, self.returned[0]) if self.returned else self.cursor
        for held in self.held.values():
            if held:
                low = min(low, min(held))
        return low



@runtime_checkable
class GroupArbiter(Protocol):
    """The store's consumer groups, as a cluster node's groups use them (``store.rpc.client.RemoteStoreClient``)."""

    async def join(self, group: str, filter: str, start: str = "earliest", at: int = 0) -> int: ...

    async def claim(self, group: str, filter: str, max_count: int, max_bytes: int, wait_s: float
                    ) -> list[tuple[int, Record]]: ...

    async def ack(self, group: str, filter: str, offsets: Sequence[int]) -> int: ...

    async def leave(self, group: str, filter: str) -> None: ...


@final
class SharedGroups:
    """The shared subscription groups of one gateway node, by (share name, queue).

    Args:
        arbiter: in cluster mode, the store's consumer groups (see the module docstring); None: this node
            arbitrates alone (embedded).
        convert: ``convert(record, queue, offset)`` -> the ``Message`` delivered (for claimed records).
        nursery: where the node leaves the store's group when its last local member goes.
    """

    def __init__(self, store: StoreClient, cache: QueueCache, commits: CommitBatcher, *,
                 arbiter: GroupArbiter | None = None, convert: Callable[[Record, str, int], Message] | None = None,
                 nursery: trio.Nursery | None = None) -> None:
        self.store = store
        self.cache = cache
        self.commits = commits
        self._arbiter = arbiter
        self._convert = convert
        self._nursery = nursery
        self._groups: dict[tuple[str, str], SharedGroup] = {}

    def __iter__(self) -> Iterator[SharedGroup]:
        return iter(tuple(self._groups.values()))

    def get(self, name: str, queue: str) -> SharedGroup | None:
        return self._groups.get((name, queue))

    def connection_gone(self, connection: Connection) -> None:
        """The member's connection closed: what it held goes back to its groups."""
        for group in tuple(self._groups.values()):
            if connection in group.held:
                self.leave(group, connection)

    async def drop_subscriber(self, client_id: str) -> None:
        """The session ended: it no longer holds any group's subscription."""
        for group in tuple(self._groups.values()):
            if client_id in group.subscribers:
                await self._unsubscribe_group(group, client_id)

    async def unsubscribe(self, connection: Connection, client_id: str, shared: tuple[str, str]) -> None:
        """The session unsubscribed from the group ``shared`` = (share name, queue)."""
        group = self._groups.get(shared)
        if group is not None:
            if connection in group.held:
                self.leave(group, connection)
            await self._unsubscribe_group(group, client_id)

    async def acknowledged(self, connection: Connection, shared: tuple[str, str], offset: int) -> None:
        """The member's session committed ``offset`` on the group's queue: move the group's offset if it can."""
        group = self._groups.get(shared)
        if group is None:
            return
        acked = group.acknowledged_below(connection, offset)
        if self._arbiter is None:
            await self._commit_group(group)
        elif acked and group.joined:
            group.committed = await self._arbiter.ack(group.owner, group.queue, acked)

    async def pull(self, connection: Connection, action: Pull) -> None:
        """Answer a member's pull with what its group assigns it: handed-back offsets first, then its share."""
        group = self._groups.get((action.group, action.queue))  # type: ignore[arg-type]
        if group is None or connection not in group.held:
            connection.feed(Pulled(action.filter, (), action.from_offset))  # left or unsubscribed meanwhile
            return
        queue = group.queue
        taken: list[Message] = []
        async with group.lock:
            while group.returned and len(taken) < action.max_count:
                offset = heapq.heappop(group.returned)
                found, _, _ = await self.cache.read(queue, offset, 1)
                if found and found[0].offset == offset:
                    taken.append(found[0])  # else gone with retention: nothing to redeliver
            room = action.max_count - len(taken)
            if room > 0 and self._arbiter is not None:
                taken += await self._claim(group, room)
            elif room > 0:
                (head,) = await self.store.max_offsets([queue])
                share = -(-(head - group.cursor) // max(1, len(group.held)))
                found, next_offset, _ = await self.cache.read(queue, group.cursor, min(room, max(1, share)))
                taken += found
                group.cursor = max(group.cursor, next_offset)
            held = group.held.get(connection)
            if held is None:  # the member left during the reads: the messages go back
                for message in taken:
                    heapq.heappush(group.returned, message.offset)  # type: ignore[arg-type]
                if taken:
                    self._poke(group)
                taken = []
            else:
                held.update(message.offset for message in taken)  # type: ignore[misc]
        taken.sort(key=lambda message: message.offset)  # type: ignore[arg-type, return-value]
        connection.feed(Pulled(action.filter, tuple(taken), group.cursor))

    async def _claim(self, group: SharedGroup, room: int) -> list[Message]:
        """Fresh offsets for a member from the store's group; the cursor goes to the head when no more came."""
        claimed = await self._arbiter.claim(group.owner, group.queue, room, CLAIM_BYTES, 0.0)  # type: ignore[union-attr]
        if len(claimed) < room:  # the rest is other nodes' (or not there): nothing more to pull for now
            (head,) = await self.store.max_offsets([group.queue])
            group.cursor = max(group.cursor, head)
        else:
            group.cursor = max(group.cursor, claimed[-1][0] + 1)
        convert = self._convert
        return [convert(record, group.queue, offset) for offset, record in claimed]  # type: ignore[misc]

    async def join(self, connection: Connection, sub: Subscription, start: int | None) -> None:
        """Make the connection a member of its shared subscription's group (created, with its offset, on first use).

        ``start`` is where a new group starts when the store has no offset for it (None: the queue's head).
        """
        key = (sub.group, sub.queue)
        group = self._groups.get(key)  # type: ignore[arg-type]
        if self._arbiter is not None:
            if group is None or not group.joined:  # the node joins the store's group for its first local member
                owner = SHARE_OWNER_PREFIX + sub.group  # type: ignore[operator]
                committed = await self._arbiter.join(owner, sub.queue, "latest" if start is None else "offset",
                                                     start or 0)
                group = self._groups.setdefault(key, SharedGroup(sub.group, sub.queue, committed))  # type: ignore[arg-type]
                group.joined = True
        elif group is None:
            owner = SHARE_OWNER_PREFIX + sub.group  # type: ignore[operator]
            committed = (await self.store.get_offsets(owner)).get(sub.queue)
            if committed is None:
                committed = start if start is not None else (await self.store.max_offsets([sub.queue]))[0]
                await self.commits.commit(owner, {sub.queue: committed})
            group = self._groups.setdefault(key, SharedGroup(sub.group, sub.queue, committed))  # type: ignore[arg-type]
        group.subscribers.add(connection.client_id)
        group.held.setdefault(connection, set())

    def leave(self, group: SharedGroup, connection: Connection) -> None:
        """Hand back what the leaving member did not acknowledge and make the other members pull it."""
        session = connection.channel.session
        if session is not None:
            for filter, offset in session.committed_offsets().items():
                if parse_shared(filter) == (group.name, group.queue):
                    group.acknowledged_below(connection, offset)
        if group.leave(connection):
            self._poke(group)
        if self._arbiter is not None and group.joined and not group.held:
            group.joined = False  # no member here: the store hands what this node held to the other nodes
            group.returned.clear()
            self._nursery.start_soon(self._leave_store, group)  # type: ignore[union-attr]

    async def _leave_store(self, group: SharedGroup) -> None:
        try:
            await self._arbiter.leave(group.owner, group.queue)  # type: ignore[union-attr]
        except OSError as exc:  # the store is gone: it dropped this node's memberships with its connection
            LOGGER.warning("shared group not left at the store: %r", exc,
                           extra={"ctx": {"group": group.name, "queue": group.queue}})

    @staticmethod
    def _poke(group: SharedGroup) -> None:
        """Offsets were handed back: make the connected members pull them."""
        for member in tuple(group.held):
            member.feed(QueueAdvanced(group.queue, group.cursor))

    async def _unsubscribe_group(self, group: SharedGroup, client_id: str) -> None:
        """The session no longer holds the subscription; the last one out releases the group's queue and offset."""
        group.subscribers.discard(client_id)
        if group.subscribers:
            return
        del self._groups[(group.name, group.queue)]
        # On a full disk the release waits for room (gateway/node/owed.py), before the group's next activation.
        await self.commits.owed.attempt(group.owner, functools.partial(self.store.release, group.queue, group.owner))
        if self._arbiter is not None and group.joined:
            group.joined = False
            await self._leave_store(group)

    async def _commit_group(self, group: SharedGroup) -> None:
        offset = group.committed_offset()
        if offset != group.committed:
            await self.commits.commit(group.owner, {group.queue: offset})
            group.committed = offset  # after the write: one a full disk refused is tried again
