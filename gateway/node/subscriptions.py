"""Subscriptions of a node's connections: activations, releases, offset commits, pulls, and who reads which queue.

- Activate: each new subscription's queue is held at the store (its holder: the client id), and its start
  offset fixed; a shared subscription (``$share/<group>/<filter>``) reads the store's POP group ``$share/<group>``
  instead (store/pop/: the group holds the queue and owns its offset, and hands each message to one member of
  any node, per message), whose queue is held for the group (its start places a new group). The retained
  messages of the new subscriptions that want them come with the answer. Read order (gateway/node/order.py): the
  activation holds a fence from the moment its SUBSCRIBE was read until the store applied it, so appends read
  after it are written after it.
- Release, commit: the store's holders and offsets; a shared subscription's messages are acknowledged to its
  group by receipt handle (``CommitOffsets.acks``), and what its session held is given back when it closes.
- Pull: at the head of an unshared queue from the queue cache (gateway/node/cache.py), else from the store; a
  shared subscription's member pops from its group, each message invisible to the others for
  ``invisible_s`` (not acknowledged by then, it goes to another member: docs/consumer-groups.md).
- Notify: the node watches at the store the queues its connections read (reference counted), and feeds the
  news to the connections on each queue (``QueueAdvanced``); a group's messages that come back (their invisible
  time passed, or a member gave them back) are news too: the store's revive step routes an event for the queue.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, final

import trio

from gateway.mqtt.actions import (Activate, Activated, CommitOffsets, Message, Pull, Pulled,
                                  QueueAdvanced, Release, Subscription)
from gateway.mqtt.reasons import ReasonCode
from gateway.node.cache import QueueCache, from_record
from gateway.node.commits import CommitBatcher
from gateway.node.order import ReadOrder
from gateway.node.owed import OwedWrites
from lightqueue.topics import TopicError, parse_shared
from store.api import SHARE_PREFIX, LogFullError, StoreApi, pop_owner

if TYPE_CHECKING:
    from gateway.node.connection import Connection

__all__ = ["POP_BYTES", "Subscriptions"]

LOGGER = logging.getLogger(__name__)

POP_BYTES = 1 << 20
"""A shared subscription's pop's byte budget at the store, as a pull's: at least one message, at most about this
much."""


@final
class Subscriptions:
    """The subscriptions of one node's connections (see the module docstring)."""

    def __init__(self, store: StoreApi, cache: QueueCache, commits: CommitBatcher, owed: OwedWrites,
                 order: ReadOrder, nursery: trio.Nursery, *, invisible_s: float = 30.0) -> None:
        self._store = store
        self._cache = cache
        self._commits = commits
        self._owed = owed
        self._order = order
        self._nursery = nursery
        self._invisible_s = invisible_s
        # queue -> the connection with a subscription on it, a set when several have one: most queues have one
        # reader, and a set each was one more object for the garbage collector to walk (issue 31: 50,000).
        self._local: dict[str, Connection | set[Connection]] = {}
        self._held: dict[Connection, set[str]] = {}  # connection -> its queues in _local
        self._members: set[Connection] = set()  # connections with shared subscriptions, until they leave
        self._fences: dict[Connection, dict[int, int]] = {}  # connection -> Activate ref -> its open fence

    # --- activations ----------------------------------------------------------------------

    def activation_read(self, connection: Connection, action: Activate) -> None:
        """Open the activation's fence: appends read from now on to topics its filters match are written after
        :meth:`activate` applied it."""
        fence = self._order.open([sub.queue for sub in action.subscriptions])
        self._fences.setdefault(connection, {})[action.ref] = fence

    def _applied(self, connection: Connection, action: Activate) -> None:
        """Close the activation's fence (idempotent)."""
        fences = self._fences.get(connection)
        fence = fences.pop(action.ref, None) if fences is not None else None
        if fence is not None:
            self._order.close(fence)

    async def activate(self, connection: Connection, actions: list[Activate]) -> None:
        """Hold each new subscription's queue (or join its group) of one connection's consecutive activations (its
        SUBSCRIBEs read together: one store write for all of them); answer ``Activated`` to each, in order. The
        fences close once the starts are fixed, and in any case when this returns (failed or cancelled: they must
        not hold every append of the node)."""
        try:
            answers, unshared, shared = await self._start(connection, actions)
            for action in actions:
                self._applied(connection, action)  # the starts are fixed: the appends read after them may go
            retained = await self._retained_for(actions, answers)
        finally:
            for action in actions:
                self._applied(connection, action)
        self._subscribe_local(connection, [sub.queue for sub, _ in unshared])
        if shared:
            self._subscribe_local(connection, shared)
        at_head = self._at_head(unshared)
        connection.feed_all([Activated(action.ref, starts, found, reasons or None, at_head)  # SUBACKs in one write
                             for action, (starts, reasons), found in zip(actions, answers, retained)])

    def _at_head(self, started: list[tuple[Subscription, int]]) -> frozenset[str]:
        """The new unshared subscriptions whose start is their queue's head, watched now (news of any later
        message comes to the connection): their sessions need no first pull, and their cache entries start there.
        None are when the store cannot say without waiting (a remote store): each pulls once to find its head."""
        try:
            heads = self._store.max_offsets_nowait([sub.queue for sub, _ in started])
        except trio.WouldBlock:
            return frozenset()
        at_head = []
        cache_at_head = self._cache.at_head
        for (sub, start), head in zip(started, heads):
            if head <= start:
                cache_at_head(sub.queue, start)
                at_head.append(sub.filter)
        return frozenset(at_head)

    async def _start(self, connection: Connection, actions: list[Activate]
                     ) -> tuple[list[tuple[dict[str, int], dict[str, ReasonCode]]], list[tuple[Subscription, int]],
                                list[str]]:
        """Each activation's starts and refusals; the unshared subscriptions of all of them held in one store call,
        those held with their starts, and the queues of the shared ones joined."""
        answers: list[tuple[dict[str, int], dict[str, ReasonCode]]] = [({}, {}) for _ in actions]
        client_id = actions[0].client_id
        unshared = [(n, sub) for n, action in enumerate(actions) for sub in action.subscriptions if sub.group is None]
        started: list[tuple[Subscription, int]] = []
        if unshared:  # the channel asked the ACL already
            held: list[int | ValueError] | list[LogFullError]
            try:
                await self._owed.settle(client_id)  # a release owed by an earlier UNSUBSCRIBE must not undo it
                held = await self._store.activate_all([sub.queue for _, sub in unshared], client_id)
            except LogFullError as exc:  # the store logged the full disk once
                held = [exc] * len(unshared)
            for (n, sub), start in zip(unshared, held):
                if isinstance(start, int):
                    answers[n][0][sub.filter] = start
                    started.append((sub, start))
                else:
                    answers[n][1][sub.filter] = self._refusal(client_id, start)
        joined: list[str] = []
        if len(unshared) < sum(len(action.subscriptions) for action in actions):
            for (starts, reasons), action in zip(answers, actions):
                for sub in action.subscriptions:
                    if sub.group is not None:
                        try:
                            starts[sub.filter] = await self._join(connection, sub)
                            joined.append(sub.queue)
                        except (ValueError, LogFullError) as exc:
                            reasons[sub.filter] = self._refusal(client_id, exc)
        return answers, started, joined

    @staticmethod
    def _refusal(client_id: str, exc: Exception) -> ReasonCode:
        """The reason code of a subscription the store refused (logged here, but a full disk: the store logged it)."""
        if isinstance(exc, TopicError):
            LOGGER.warning("subscription refused: %s", exc, extra={"ctx": {"client_id": client_id}})
            return ReasonCode.TOPIC_FILTER_INVALID
        if isinstance(exc, LogFullError):
            return ReasonCode.QUOTA_EXCEEDED
        LOGGER.error("subscription failed: %s", exc, extra={"ctx": {"client_id": client_id}})
        return ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR

    async def _join(self, connection: Connection, sub: Subscription) -> int:
        """The connection's session pops its shared subscription's group from now on; the group holds the queue
        (a wildcard's is indexed from here). Returns where a new group starts: the queue's head now (the first
        pop places a group that has no offset there; an existing group keeps its own)."""
        assert sub.group is not None
        start = await self._store.activate(sub.queue, pop_owner(SHARE_PREFIX + sub.group))
        self._members.add(connection)
        return start

    async def resume(self, connection: Connection, subscriptions: tuple[Subscription, ...]) -> None:
        """A resumed session's subscriptions: all are read here, its shared ones pop their groups again."""
        for sub in subscriptions:
            if sub.group is not None:
                self._members.add(connection)
        self._subscribe_local(connection, [sub.queue for sub in subscriptions])

    async def _retained_for(self, actions: list[Activate], answers: list[tuple[dict[str, int], dict[str, ReasonCode]]]
                            ) -> list[tuple[tuple[str, Message], ...]]:
        """The retained messages for each activation's new subscriptions that want them now, looked up together.

        The channel already applied MQTT 5 retain handling (``action.retained``);
        shared subscriptions never get retained messages (MQTT 5.0, section 4.8.2).
        """
        wanted: list[tuple[int, Subscription]] = []
        for n, (action, (starts, _)) in enumerate(zip(actions, answers)):
            if not action.retained:
                continue
            keep = set(action.retained)
            for sub in action.subscriptions:  # a loop, not a generator per action (issue 31: 50,000 of them)
                if sub.group is None and sub.filter in keep and sub.filter in starts:
                    wanted.append((n, sub))
        found: list[list[tuple[str, Message]]] = [[] for _ in actions]
        if wanted:
            records = await self._store.retained_all([sub.queue for _, sub in wanted])
            for (n, sub), each in zip(wanted, records):
                if each:  # most find none: no generator for them
                    found[n] += ((sub.filter, from_record(record, None, None)) for record in each)
        return [tuple(each) for each in found]

    # --- releases and commits ---------------------------------------------------------------

    async def release(self, connection: Connection, action: Release) -> None:
        """The session no longer has these subscriptions; on a full disk the store's releases wait for room."""
        client_id = action.client_id
        for filter in action.filters:
            shared = parse_shared(filter)
            if shared is None:
                await self._owed.attempt(client_id, functools.partial(self._store.release, filter, client_id))
                self._unsubscribe_local(connection, filter)
                continue
            # Its group stays (a POP group has no members to count): what the session buffered goes back to it
            # with the next commit (``CommitOffsets.releases``), what it has in flight is acknowledged as it ends.
            self._unsubscribe_local(connection, shared[1])

    async def commit(self, connection: Connection, action: CommitOffsets) -> None:
        """Commit the session's offsets (batched with other connections'); acknowledge its shared subscriptions'
        messages to their groups, and give back those it will not deliver."""
        await self._settle_receipts(action.acks, action.releases)
        self._post(action)

    def commit_now(self, action: CommitOffsets) -> bool:
        """:meth:`commit` in this step when it has no receipts to settle (store calls); False: it has."""
        if action.acks or action.releases:
            return False
        self._post(action)
        return True

    def _post(self, action: CommitOffsets) -> None:
        if action.offsets:
            self._commits.post(action.client_id, action.offsets)
        LOGGER.debug("offsets committed", extra={"ctx": {"client_id": action.client_id, "offsets": action.offsets}})

    async def _settle_receipts(self, acks: Sequence[str], releases: Sequence[str]) -> None:
        """Acknowledge ``acks`` to their groups and make ``releases`` visible again at once. A failure is not
        retried: the group hands those messages out again when their invisible time passes (at least once)."""
        with contextlib.suppress(LogFullError):  # the store logged the full disk once
            if acks:
                await self._store.pop_ack(acks)
            for handle in releases:
                await self._store.change_invisible(handle, 0)

    # --- pulls ------------------------------------------------------------------------------

    def pull_cached(self, action: Pull) -> Pulled | None:
        """A pull at the head of an unshared queue, answered from the queue cache; None if it must wait or read."""
        if action.group is not None:
            return None
        hit = self._cache.get(action.queue, action.from_offset, action.max_count)
        return None if hit is None else Pulled(action.filter, tuple(hit[0]), hit[1])

    async def pull(self, connection: Connection, action: Pull) -> None:
        if action.group is None:
            messages, next_offset, _ = await self._cache.read(action.queue, action.from_offset, action.max_count)
            connection.feed(Pulled(action.filter, tuple(messages), next_offset))
            return
        if connection not in self._members:
            connection.feed(Pulled(action.filter, (), action.from_offset))  # closed meanwhile
            return
        queue = action.queue
        popped = await self._store.pop(SHARE_PREFIX + action.group, queue, connection.client_id, action.max_count,
                                       invisible_s=self._invisible_s, max_bytes=POP_BYTES, start="offset",
                                       at=action.from_offset)
        session = connection.channel.session
        if connection not in self._members or session is None or not session.holds(action.filter):
            await self._settle_receipts((), [p.handle for p in popped])  # closed or unsubscribed meanwhile
            popped = []
        handed = tuple(from_record(p.record, queue, p.offset) for p in popped)
        connection.feed(Pulled(action.filter, handed, action.from_offset, tuple(p.handle for p in popped)))

    # --- the queues the connections read ------------------------------------------------------

    def _subscribe_local(self, connection: Connection, queues: list[str]) -> None:
        """The connection reads ``queues`` (a run's, in one call; no container for a connection that reads none: an
        idle connection's session resumes with no subscription)."""
        if not queues:
            return
        held = self._held.get(connection)
        if held is None:
            held = self._held[connection] = set()
        local, store_watch, cache_watch = self._local, self._store.watch, self._cache.watch
        for queue in queues:
            if queue in held:
                continue
            held.add(queue)
            readers = local.get(queue)
            if readers is None:
                local[queue] = connection
            elif isinstance(readers, set):
                readers.add(connection)
            else:
                local[queue] = {readers, connection}
            store_watch(queue)
            cache_watch(queue)

    def _unsubscribe_local(self, connection: Connection, queue: str) -> None:
        held = self._held.get(connection)
        if held is not None:
            held.discard(queue)
        local = self._local.get(queue)
        if local is connection:
            del self._local[queue]
        elif isinstance(local, set) and connection in local:
            local.discard(connection)
            if len(local) == 1:
                self._local[queue] = local.pop()
        else:
            return
        self._store.unwatch(queue)
        self._cache.unwatch(queue)

    def feed_news(self, events: Mapping[str, int]) -> None:
        """Tell the connections on each queue of ``events`` that it has news (``QueueAdvanced``)."""
        local = self._local
        for queue, max_offset in events.items():
            readers = local.get(queue)
            if readers is None:
                continue
            if not isinstance(readers, set):
                readers.feed(QueueAdvanced(queue, max_offset))
                continue
            for connection in tuple(readers):
                connection.feed(QueueAdvanced(queue, max_offset))

    async def leave_groups(self, connection: Connection) -> None:
        """The connection closes: what its session's shared subscriptions were handed and did not finish goes
        back to their groups now, for the other members (a QoS 2 message before its PUBREC too, which departs from
        [MQTT-4.8.2-4]: see docs/consumer-groups.md). What the session finished and has not committed yet is
        acknowledged first: it counts as delivered."""
        if connection not in self._members:
            return
        self._members.discard(connection)
        session = connection.channel.session
        if session is None:
            return
        acks, held = session.receipts()
        try:
            await self._settle_receipts(acks, held)
        except OSError as exc:  # the store is gone: the messages come back after their invisible time
            LOGGER.warning("shared subscriptions' messages not given back: %r", exc,
                           extra={"ctx": {"client_id": connection.client_id, "messages": len(held)}})

    def connection_closed(self, connection: Connection) -> None:
        """Forget the connection: the activations it will never apply, the queues it read, its groups."""
        for fence in self._fences.pop(connection, {}).values():
            self._order.close(fence)
        for queue in self._held.pop(connection, ()):
            self._unsubscribe_local(connection, queue)
        if connection in self._members:  # not left at its close (the channel never settled): leave now
            self._nursery.start_soon(self.leave_groups, connection)
