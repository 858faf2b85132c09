"""Topic-event routing: which gateway nodes hear that a queue has news.

After each dispatch batch the store has ``{queue: new max offset}``. Each
event goes only to the nodes with at least one session on that queue, not to
every node (RocketMQ-MQTT's notify storm). The router knows this because the
nodes register their sessions' queues; registrations are reference counted
per ``(node, queue)``, one per local session, so a node stays registered until
its last session on the queue goes.

Sans-IO: :meth:`NotifyRouter.route` returns each node's events and delivers
nothing. Events that a node has not consumed yet are merged where they wait,
in the node's mailbox (``notify.channel``), so memory stays bounded by queues,
not events. Not thread-safe: call it from one thread (the trio thread in the
store node), like the mailboxes it feeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, final

from lightqueue.topics import validate_filter

__all__ = ["NotifyRouter", "NotifyRouterStatistics"]


@dataclass(frozen=True, slots=True)
class NotifyRouterStatistics:
    nodes: int  # nodes known to the router (registered at least once, not dropped)
    registrations: int  # (node, queue) pairs with at least one session
    sent: dict[str, int]  # node -> events routed to it
    suppressed: int  # node-events not sent because the node has no session on the queue (saved versus broadcast)
    unrouted: int  # events for queues on which no node has a session


@final
class NotifyRouter:
    """Routes ``{queue: max offset}`` events to the gateway nodes with sessions on those queues."""

    __slots__ = ("_refs", "_holders", "_alone", "_sent", "_suppressed", "_unrouted")

    def __init__(self) -> None:
        self._refs: dict[str, dict[str, int]] = {}  # node -> queue -> sessions on it
        # queue -> nodes with a session on it. Tuples, not sets: a node holds a queue per filter its sessions hold
        # (50,000 for 50 sessions of 1,000), and a tuple of names is left out of the garbage collector's walks
        # (a set never is) and is 48 B with one name (a set 216 B); there are few nodes.
        self._holders: dict[str, tuple[str, ...]] = {}
        self._alone: dict[str, tuple[str]] = {}  # node -> (node,): the holders of every queue it alone has, shared
        self._sent: dict[str, int] = {}  # node -> events sent; its keys are the known nodes
        self._suppressed = 0
        self._unrouted = 0

    def register(self, node: str, queue: str) -> int:
        """A session on ``node`` reads ``queue``.

        Returns:
            the node's session count on the queue, this one included.

        Raises:
            ValueError: the node name is empty.
            TopicError: the queue is neither a topic nor a topic filter.
        """
        if not node:
            raise ValueError("node must be a non-empty name")
        validate_filter(queue)
        refs = self._refs.get(node)
        if refs is None:  # a node's first (a dict per call made by ``setdefault`` was one per filter subscribed)
            refs = self._refs[node] = {}
            self._sent.setdefault(node, 0)
            self._alone[node] = (node,)
        count = refs.get(queue, 0) + 1
        refs[queue] = count
        if count == 1:
            holders = self._holders.get(queue)
            # most queues have one node: its one tuple for all of them (issue 31: 50,000 of 48 B each)
            self._holders[queue] = self._alone[node] if holders is None else (*holders, node)
        return count

    def unregister(self, node: str, queue: str) -> int | None:
        """A session on ``node`` no longer reads ``queue``.

        Returns:
            the node's session count on the queue left, or None if it had none
            (a late unregister after :meth:`drop_node` is harmless).
        """
        refs = self._refs.get(node)
        if refs is None or queue not in refs:
            return None
        count = refs[queue] - 1
        if count:
            refs[queue] = count
            return count
        del refs[queue]
        self._leave(queue, node)
        return 0

    def drop_node(self, node: str) -> int:
        """A node went away: forget its registrations and its counters.

        Returns:
            the number of queues it was registered on.
        """
        refs = self._refs.pop(node, {})
        for queue in refs:
            self._leave(queue, node)
        self._sent.pop(node, None)
        self._alone.pop(node, None)
        return len(refs)

    def _leave(self, queue: str, node: str) -> None:
        """``node`` no longer has a session on ``queue``."""
        rest = tuple(name for name in self._holders[queue] if name != node)
        if len(rest) == 1:
            self._holders[queue] = self._alone.get(rest[0], rest)
        elif rest:
            self._holders[queue] = rest
        else:
            del self._holders[queue]

    def queues(self, node: str) -> dict[str, int]:
        """``{queue: session count}`` registered by ``node``."""
        return dict(self._refs.get(node, {}))

    def route(self, events: Mapping[str, int]) -> dict[str, dict[str, int]]:
        """Split one dispatch batch's ``{queue: new max offset}`` between the nodes that want them.

        Returns:
            ``{node: {queue: max offset}}`` for the nodes with at least one
            event; each node gets its own dict.
        """
        holders_of = self._holders.get
        routed: dict[str, dict[str, int]] = {}
        known = len(self._sent)
        suppressed = 0
        unrouted = 0
        for queue, offset in events.items():
            holders = holders_of(queue)
            if not holders:
                unrouted += 1
                suppressed += known
                continue
            suppressed += known - len(holders)
            for node in holders:
                mine = routed.get(node)
                if mine is None:
                    mine = routed[node] = {}
                mine[queue] = offset
        sent = self._sent
        for node, mine in routed.items():
            sent[node] += len(mine)
        self._suppressed += suppressed
        self._unrouted += unrouted
        return routed

    def statistics(self) -> NotifyRouterStatistics:
        return NotifyRouterStatistics(
            nodes=len(self._sent),
            registrations=sum(len(refs) for refs in self._refs.values()),
            sent=dict(self._sent),
            suppressed=self._suppressed,
            unrouted=self._unrouted,
        )
