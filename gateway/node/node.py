"""The gateway node: executes what its connections' channels ask, through one table of actions.

``GatewayNode`` is the ``Backend`` of every connection (gateway/node/connection.py). It holds the node's parts
and hands each channel action to the one that does it:

| action | part |
|---|---|
| ``OpenSession``, ``SaveSession``, ``PatchSession``, ``CloseSession`` | ``Sessions`` (gateway/node/sessions.py), with the ``Registry`` of connections and the ``Guard`` (authentication, ACL) |
| ``Append`` | ``Appends`` (gateway/node/appends.py): batched per connection, or in the read round |
| ``Activate``, ``Release``, ``CommitOffsets``, ``Pull`` | ``Subscriptions`` (gateway/node/subscriptions.py), the ``QueueCache``, the ``CommitBatcher`` |
| ``PublishWill`` | ``Wills`` (gateway/node/wills.py) |
| ``ReleaseInbound`` | the store, batched |
| ``AfterReads`` | the ``ReadOrder`` (gateway/node/order.py) |
| ``LimitHit`` | the limit counters |
| ``Denied`` | the ACL's denial count and log line (gateway/node/guard.py) |

The store is any ``StoreApi`` (store/api.py): the store node in this process or one over the RPC; the node
never asks which. It owns every session's lifecycle (where its client is, its will, its expiry), so nothing of a
client outlives its connection here. Notify: the node watches the queues its connections read; a consumer task
has the ``QueueCache`` read the news once, then feeds ``QueueAdvanced`` to the connections on each queue; the news of
a read round's own appends, when the store took them in the round's step, are fed in that step (``news_now``).
Clients that are not this node's any more (connected elsewhere, or the node's store lease ended) are closed as
taken over (``consume_moved``). ``$SYS`` statistics are published by ``SysTopics`` (gateway/node/system.py).

Operators read the node (gateway/ops/): the node never imports them. Which store it runs over, and which tasks,
is the composition roots' business (gateway/app/).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, final

import trio

from gateway.auth.acl import Access
from gateway.mqtt.actions import (Action, Activate, AfterReads, Append, CloseSession, CommitOffsets, ConnectionLost,
                                  Denied, InboundReleased, LimitHit, OpenSession, PatchSession, PublishWill, Pull,
                                  Pulled, Release, ReleaseInbound, SaveSession)
from gateway.mqtt.channel import ChannelConfig
from gateway.mqtt.limits import LimitCounters
from gateway.node.appends import Appends
from gateway.node.cache import QueueCache
from gateway.node.commits import CommitBatcher
from gateway.node.connection import Connection, Traffic
from gateway.node.guard import Guard
from gateway.node.order import ReadOrder
from gateway.node.owed import OwedWrites
from gateway.node.poller import Poller, ReadRound
from gateway.node.registry import Registry
from gateway.node.sessions import Sessions
from gateway.node.subscriptions import Subscriptions
from gateway.node.system import SysTopics
from gateway.node.timers import Timers
from gateway.node.wills import Wills
from store.api import Flow, StoreApi

__all__ = ["GatewayNode"]

LOGGER = logging.getLogger(__name__)

Handler = Callable[["GatewayNode", Connection, Any], Awaitable[None]]
"""What executes one kind of action (its second argument is the action, of the kind it is registered for)."""


@final
class GatewayNode:
    """Executes the node actions of all connections of one node (see the module docstring).

    Args:
        store: the store, in this process or remote.
        nursery: where work that outlives a connection runs (owed writes, commits, log lines).
        channel_config: what every channel offers its client.
        connect_timeout_s: close connections that send no CONNECT within this.
        guard: authentication and ACL checks.

    Resource handling: owns no resources; its composition root (gateway/app/) opens the store and the nursery,
    runs the node's tasks (``timers.run``, ``reads.run``, ``consume_events``, ``consume_moved``) and closes them.
    """

    def __init__(self, store: StoreApi, nursery: trio.Nursery, channel_config: ChannelConfig,
                 connect_timeout_s: float, *, guard: Guard) -> None:
        self.store = store
        self.nursery = nursery
        self.channel_config = channel_config
        self.connect_timeout_s = connect_timeout_s
        self.guard = guard
        self.traffic = Traffic()
        self.limit_counters = LimitCounters()
        self.timers = Timers()
        self.order = ReadOrder()  # activations are applied before the appends read after them
        self.appends = Appends(store, self.order)
        self.reads = Poller(self._round_end)
        self.cache = QueueCache(store)
        self.owed = OwedWrites(nursery)  # store writes a full data disk refused, done once it has room
        self.commits = CommitBatcher(store, nursery, self.owed)
        self.registry = Registry()
        self.subscriptions = Subscriptions(store, self.cache, self.commits, self.owed, self.order, nursery,
                                           invisible_s=channel_config.shared_invisible_s)
        self.sessions = Sessions(store, self.registry, self.subscriptions, self.commits, self.owed, guard, nursery)
        self.wills = Wills(self.appends)
        self.system = SysTopics(store, self.appends, self.traffic, self.registry, self.sessions)
        self._stopping = False  # shutdown() runs: the store keeps the clients as the node's, as when a node dies

    # --- Backend: what connections ask -----------------------------------------------------

    async def perform(self, connection: Connection, actions: list[Action]) -> None:
        """Execute node actions in order; consecutive appends (and QoS 2 releases) go to the store as one batch.

        When the store cannot be reached, the connection is closed as lost (the store client logs the outage,
        the connection the close): no traceback per connection. The actions after the failed one are still done
        in their turn (requeued): a session close among them is tried, so the store hears it if it is back, and a
        remote store's client forgets the client either way and does not register it again as connected when it
        reconnects (its session would never expire).
        """
        index = end = 0
        try:
            while index < len(actions):
                action = actions[index]
                kind = type(action)
                end = index + 1
                batched = _BATCHED.get(kind)
                if batched is not None:
                    while end < len(actions) and type(actions[end]) is kind:
                        end += 1
                    await batched(self, connection, actions[index:end])
                    index = end
                    continue
                handler = _ACTIONS.get(kind)
                if handler is None:
                    raise TypeError(f"not a node action: {action!r}")
                await handler(self, connection, action)
                index = end
        except ConnectionError as exc:  # StoreUnavailable, or LeaseLost: the client is not this node's any more
            connection.feed(ConnectionLost(f"the store is not reachable: {exc}"))
            # The actions after the failed ones go back to the worker: each is answered (or fails) in its turn,
            # so the closing channel waits for no answer that would never come.
            connection.requeue(actions[end:])

    def append_now(self, connection: Connection, action: Append) -> bool:
        """Append without a worker task when the store can without waiting (gateway/node/appends.py)."""
        return self.appends.now(connection, action, self.reads.round is not None)

    def append_mark(self) -> int | None:
        return self.appends.mark()

    def activation_read(self, connection: Connection, action: Activate) -> None:
        self.subscriptions.activation_read(connection, action)

    def pull_cached(self, connection: Connection, action: Pull) -> Pulled | None:
        return self.subscriptions.pull_cached(action)

    def commit_now(self, connection: Connection, action: CommitOffsets) -> bool:
        return self.subscriptions.commit_now(action)

    def connection_closed(self, connection: Connection) -> None:
        """Forget the connection."""
        self.subscriptions.connection_closed(connection)
        self.sessions.connection_closed(connection)
        self.registry.closed(connection)

    # --- the action table --------------------------------------------------------------------

    async def _append(self, connection: Connection, appends: list[Append]) -> None:
        await self.appends.perform(connection, appends)

    async def _release_inbound(self, connection: Connection, releases: list[ReleaseInbound]) -> None:
        """Record the releases of inbound QoS 2 flows durably, in one store write; then their PUBCOMPs may go.

        Raises:
            ConnectionError: the store is unreachable; the releases are answered as not recorded first, so the
                channel waits for none of them.
        """
        try:
            await self.store.release_awaiting([Flow(r.client_id, r.packet_id, r.position) for r in releases])
        except ConnectionError:
            connection.feed_all([InboundReleased(r.ref, ok=False) for r in releases])
            raise
        connection.feed_all([InboundReleased(r.ref) for r in releases])

    async def _after_reads(self, connection: Connection, action: AfterReads) -> None:
        await self.order.wait(action.mark)

    async def _open_session(self, connection: Connection, action: OpenSession) -> None:
        await self.sessions.open(connection, action)

    async def _save_session(self, connection: Connection, action: SaveSession) -> None:
        await self.sessions.save(connection, action)

    async def _patch_session(self, connection: Connection, action: PatchSession) -> None:
        await self.sessions.patch(connection, action)

    async def _close_session(self, connection: Connection, action: CloseSession) -> None:
        if self._stopping:  # the store keeps the client as this node's until its lease ends, as for a node that dies
            await self.subscriptions.leave_groups(connection)
            return
        await self.sessions.close(connection, action)

    async def _activate(self, connection: Connection, actions: list[Activate]) -> None:
        await self.subscriptions.activate(connection, actions)

    async def _release(self, connection: Connection, action: Release) -> None:
        await self.subscriptions.release(connection, action)

    async def _commit(self, connection: Connection, action: CommitOffsets) -> None:
        await self.subscriptions.commit(connection, action)

    async def _pull(self, connection: Connection, action: Pull) -> None:
        await self.subscriptions.pull(connection, action)

    async def _publish_will(self, connection: Connection, action: PublishWill) -> None:
        await self.wills.publish(action)

    async def _denied(self, connection: Connection, denied: Denied) -> None:
        """Count and log an ACL refusal the channel answered."""
        self.guard.denied(connection, Access(denied.access), denied.topic, denied.why)

    async def _limit_hit(self, connection: Connection, hit: LimitHit) -> None:
        """Count a client's limit hit; log it with the client id when the channel says a line is due."""
        total = self.limit_counters.add(hit.limit, hit.count)
        if hit.log is not None:
            LOGGER.warning("limit %s hit: %s", hit.limit.value, hit.log,
                           extra={"ctx": {"client_id": connection.client_id, "peer": connection.peer,
                                          "limit": hit.limit.value, "total": total}})

    # --- news -------------------------------------------------------------------------------

    def _round_end(self, read_round: ReadRound) -> None:
        """A read round ended (the poller's ``round_done``): its appends go to the store in one call, and when the
        store took them in this step (it runs in this process and dispatched them in it), their news go to the
        subscribers in it too (:meth:`news_now`).

        Without that, a QoS 1 fan-in message waited for the event loop's rounds between its append and its
        delivery, each as long as a read round (hundreds of PUBLISHes): one for dispatch, one for the task that
        consumes the news, and in each its subscriber's acknowledgements waited for their read."""
        if self.appends.round_end(read_round):
            self.news_now()

    def news_now(self) -> None:
        """Feed the news already routed to this node (``StoreApi.events_nowait``) to its sessions in this step, the
        cache filled first; when the store cannot read them without waiting, a task does (:meth:`_news`)."""
        try:
            events = self.store.events_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return
        try:
            filled = self.cache.fill_nowait(events)
        except Exception as exc:
            _fill_failed(exc, events)
            filled = True
        if filled:
            self.subscriptions.feed_news(events)
        else:
            self.nursery.start_soon(self._news, events)

    async def _news(self, events: dict[str, int]) -> None:
        """Have the cache read the news, then feed ``QueueAdvanced`` to the local connections on each queue."""
        try:
            await self.cache.fill(events)
        except Exception as exc:
            _fill_failed(exc, events)
        self.subscriptions.feed_news(events)

    # --- tasks -------------------------------------------------------------------------------

    async def consume_events(self) -> None:
        """Have the cache read the news, then feed ``QueueAdvanced`` to the local connections on each queue.

        Runs until the store client's events end.
        """
        while True:
            try:
                events = await self.store.events()
            except trio.EndOfChannel:
                return
            await self._news(events)

    async def consume_moved(self) -> None:
        """Close the clients that are not this node's any more: they connected to another node, or the node's store
        lease ended (a takeover, MQTT 5 reason 0x8E). Runs until the store client's notices end."""
        while True:
            try:
                moved = await self.store.moved()
            except trio.EndOfChannel:
                return
            self.registry.moved(moved)

    async def shutdown(self) -> None:
        """Stop serving clients (SIGTERM): each connected client is told (MQTT 5: DISCONNECT 0x8B, Server shutting
        down) and its session saved as at any close; returns once they are closed or ``SHUTDOWN_S`` passed.

        The store keeps the clients as this node's (wills held, sessions not expiring) until the node's lease ends,
        as when a node dies (docs/cluster.md).
        """
        self._stopping = True
        await self.registry.shutdown()


def _fill_failed(exc: Exception, events: dict[str, int]) -> None:
    """Log a fill of the queue cache that failed: the sessions then read the news themselves (their reads meet
    the failure, not the node)."""
    if isinstance(exc, ConnectionError):  # the store went away mid-read
        LOGGER.warning("queue cache not filled: %r", exc, extra={"ctx": {"queues": len(events)}})
    else:
        LOGGER.error("queue cache not filled: %r", exc, extra={"ctx": {"queues": len(events)}})


_BATCHED: dict[type, Handler] = {Append: GatewayNode._append, ReleaseInbound: GatewayNode._release_inbound,
                                 Activate: GatewayNode._activate}
"""Actions that go to the store together when a connection asks several in a row."""

_ACTIONS: dict[type, Handler] = {
    AfterReads: GatewayNode._after_reads,
    OpenSession: GatewayNode._open_session,
    SaveSession: GatewayNode._save_session,
    PatchSession: GatewayNode._patch_session,
    CloseSession: GatewayNode._close_session,
    Release: GatewayNode._release,
    CommitOffsets: GatewayNode._commit,
    Pull: GatewayNode._pull,
    PublishWill: GatewayNode._publish_will,
    LimitHit: GatewayNode._limit_hit,
    Denied: GatewayNode._denied,
}
"""One handler per node action the channel asks for (gateway/mqtt/actions.py); the connection does the others."""
