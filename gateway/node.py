"""The embedded gateway node: store, notify and the MQTT listener in one process.

``GatewayNode`` is the ``Backend`` of every connection (gateway/server.py):
it executes the channel actions that need the store or other connections.

- Registry: client id -> its live connection, for takeovers.
- Sessions: the state of disconnected persistent sessions (and of sessions
  being handed over) in memory, and as msgspec blobs in the store
  (``StoreNode.save_session``), so they survive a restart.
- Notify: the dispatcher's listener routes ``{queue: max offset}`` through a
  ``NotifyRouter`` to this node's ``EventMailbox`` (one node, ``"local"``);
  a consumer task turns each event into ``QueueAdvanced`` for the local
  connections subscribed to that queue.
- Timers that outlive a connection: delayed wills and session expiry.

Not done here (yet): retained messages (``Activated.retained`` is always
empty), shared subscriptions (refused in the SUBACK, ``shared_available``
is False) and authentication (every CONNECT is accepted).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, final

import msgspec
import trio

from gateway.actions import (
    Action,
    Activate,
    Activated,
    Append,
    Appended,
    CommitOffsets,
    DropSession,
    Message,
    OpenSession,
    PublishWill,
    Pull,
    Pulled,
    QueueAdvanced,
    Release,
    SaveSession,
    SessionOpened,
    TakenOver,
)
from gateway.channel import ChannelConfig
from gateway.properties import PacketType, decode_properties, encode_properties
from gateway.reasons import ReasonCode
from gateway.server import Connection, serve_mqtt
from gateway.session import SessionState
from lightqueue.topics import TopicError
from notify import EventMailbox, NotifyRouter
from store.commitlog import CommitLogConfig
from store.node import StoreNode, open_store, until_signalled
from store.record import Record, RecordTooLarge

__all__ = ["GatewayNode", "run_gateway_node", "serve_gateway"]

LOGGER = logging.getLogger(__name__)

NODE_NAME = "local"
"""The one gateway node of the embedded deployment, as the notify router knows it."""

TAKEOVER_TIMEOUT_S = 15.0
"""How long a new connection waits for the one it takes over to hand its session over."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SessionState)


def encode_session(state: SessionState) -> bytes:
    """The session as the blob the store keeps (msgpack: no pickle, readable by any version that knows the fields)."""
    return _ENCODER.encode(state)


def decode_session(blob: bytes) -> SessionState:
    """Raises msgspec.DecodeError (a ValueError) on a blob that is not a session."""
    return _DECODER.decode(blob)


@final
class GatewayNode:
    """Executes the node actions of all connections of one embedded node.

    Args:
        store: the open store node.
        nursery: where timers that outlive a connection (wills, session expiry) and the notify consumer run.
        channel_config: what every channel offers its client.
        connect_timeout_s: close connections that send no CONNECT within this.

    Resource handling: owns no resources; ``serve_gateway`` opens the store and
    the nursery and closes them.
    """

    def __init__(
        self,
        store: StoreNode,
        nursery: trio.Nursery,
        channel_config: ChannelConfig,
        connect_timeout_s: float,
        router: NotifyRouter,
        mailbox: EventMailbox,
    ) -> None:
        self.store = store
        self.channel_config = channel_config
        self.connect_timeout_s = connect_timeout_s
        self._nursery = nursery
        self._router = router
        self._mailbox = mailbox
        self._connections: dict[str, Connection] = {}
        self._sessions: dict[str, SessionState] = {}  # latest saved or handed-over state per client id
        self._local: dict[str, set[Connection]] = {}  # queue -> connections with a subscription on it
        self._held: dict[Connection, set[str]] = {}  # connection -> its queues in _local
        self._wills: dict[str, trio.CancelScope] = {}  # client id -> pending delayed will
        self._expiries: dict[str, trio.CancelScope] = {}  # client id -> pending session expiry

    # --- Backend ------------------------------------------------------------------------

    async def perform(self, connection: Connection, actions: list[Action]) -> None:
        """Execute node actions in order; consecutive appends go to the store as one batch."""
        index = 0
        while index < len(actions):
            action = actions[index]
            if type(action) is Append:
                end = index + 1
                while end < len(actions) and type(actions[end]) is Append:
                    end += 1
                await self._append(connection, actions[index:end])  # type: ignore[arg-type]
                index = end
                continue
            index += 1
            kind = type(action)
            if kind is OpenSession:
                await self._open_session(connection, action)  # type: ignore[arg-type]
            elif kind is Activate:
                await self._activate(connection, action)  # type: ignore[arg-type]
            elif kind is Pull:
                await self._pull(connection, action)  # type: ignore[arg-type]
            elif kind is Release:
                await self._release(connection, action.client_id, action.filters)  # type: ignore[union-attr]
            elif kind is CommitOffsets:
                await self._commit(connection, action)  # type: ignore[arg-type]
            elif kind is SaveSession:
                await self._save(action.state)  # type: ignore[union-attr]
            elif kind is DropSession:
                await self.drop_session(action.client_id)  # type: ignore[union-attr]
            elif kind is PublishWill:
                self._publish_will(action)  # type: ignore[arg-type]
            else:
                raise TypeError(f"not a node action: {action!r}")

    def connection_closed(self, connection: Connection) -> None:
        """Forget the connection; start the expiry of its session if it stays stored."""
        for queue in self._held.pop(connection, ()):
            self._unsubscribe_local(connection, queue)
        client_id = connection.client_id
        if not client_id or self._connections.get(client_id) is not connection:
            return
        del self._connections[client_id]
        state = self._sessions.get(client_id)
        if state is not None and state.expiry_s > 0:
            self._start_expiry(client_id, state.expiry_s)

    # --- sessions -----------------------------------------------------------------------

    async def _open_session(self, connection: Connection, action: OpenSession) -> None:
        client_id = action.client_id
        old = self._connections.get(client_id)
        if old is not None and old is not connection:
            old.feed(TakenOver())
            with trio.move_on_after(TAKEOVER_TIMEOUT_S) as waited:
                await old.finished.wait()
            if waited.cancelled_caught:
                LOGGER.warning("takeover: the old connection did not close in time",
                               extra={"ctx": {"client_id": client_id}})
        self._connections[client_id] = connection
        self._cancel(self._wills, client_id)
        self._cancel(self._expiries, client_id)
        if action.clean_start:
            await self.drop_session(client_id)
            connection.feed(SessionOpened(False))
            return
        state = self._sessions.get(client_id)
        if state is None:
            blob = self.store.load_session(client_id)
            if blob is not None:
                try:
                    state = decode_session(blob)
                except msgspec.DecodeError as exc:
                    LOGGER.error("stored session is unreadable; starting a new one: %s", exc,
                                 extra={"ctx": {"client_id": client_id}})
        if state is not None:
            for sub in state.subscriptions:
                self._subscribe_local(connection, sub.queue)
        connection.feed(SessionOpened(state is not None, state))

    async def _save(self, state: SessionState) -> None:
        self._sessions[state.client_id] = state
        if state.expiry_s > 0:
            blob = encode_session(state)
            await trio.to_thread.run_sync(self.store.save_session, state.client_id, blob)

    async def drop_session(self, client_id: str) -> None:
        """End a session: its state, its stored blob, its filters and offsets go."""
        self._sessions.pop(client_id, None)
        self._cancel(self._expiries, client_id)
        await trio.to_thread.run_sync(self.store.drop_session, client_id)
        await trio.to_thread.run_sync(self.store.queues.delete_owner, client_id)

    def _start_expiry(self, client_id: str, expiry_s: int) -> None:
        async def expire(scope: trio.CancelScope) -> None:
            with scope:
                await trio.sleep(expiry_s)
                del self._expiries[client_id]
                LOGGER.info("session expired", extra={"ctx": {"client_id": client_id}})
                await self.drop_session(client_id)

        self._later(self._expiries, client_id, expire)

    def _later(self, table: dict[str, trio.CancelScope], client_id: str, job: Any) -> None:
        self._cancel(table, client_id)
        scope = trio.CancelScope()
        table[client_id] = scope
        self._nursery.start_soon(job, scope)

    @staticmethod
    def _cancel(table: dict[str, trio.CancelScope], client_id: str) -> None:
        scope = table.pop(client_id, None)
        if scope is not None:
            scope.cancel()

    # --- wills --------------------------------------------------------------------------

    def _publish_will(self, action: PublishWill) -> None:
        async def publish(scope: trio.CancelScope) -> None:
            with scope:
                await trio.sleep(action.delay_s)
                del self._wills[action.client_id]
                reason = await self.append_messages([action.message])
                if reason is not None:
                    LOGGER.error("will not published: %s", reason.name, extra={"ctx": {"client_id": action.client_id}})

        self._later(self._wills, action.client_id, publish)

    # --- messages -----------------------------------------------------------------------

    async def append_messages(self, messages: Sequence[Message]) -> ReasonCode | None:
        """Append messages through the store (durable under the sync flush policy); None or why it failed."""
        batch = [(m.topic, m.payload, _record_fields(m)) for m in messages]
        try:
            await self.store.append_many(batch)
        except RecordTooLarge as exc:
            LOGGER.warning("append refused: %s", exc)
            return ReasonCode.PACKET_TOO_LARGE
        except (OSError, ValueError) as exc:  # LogFullError is an OSError
            LOGGER.error("append failed: %r", exc)
            return ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        return None

    async def _append(self, connection: Connection, appends: list[Append]) -> None:
        messages = [m for append in appends for m in append.messages]
        reason = await self.append_messages(messages)
        if reason is not None and len(appends) > 1:
            # One bad message must not fail its neighbours: retry one by one so each gets its own answer.
            for append in appends:
                await self._append(connection, [append])
            return
        for append in appends:
            if append.ref is not None:
                connection.feed(Appended(append.ref, reason is None, reason or ReasonCode.SUCCESS))

    async def _pull(self, connection: Connection, action: Pull) -> None:
        result = await self.store.pull(action.queue, action.from_offset, action.max_count)
        messages = tuple(_message(record, action.queue, offset) for offset, record in result.messages)
        connection.feed(Pulled(action.filter, messages, result.next_offset))

    # --- subscriptions ------------------------------------------------------------------

    async def _activate(self, connection: Connection, action: Activate) -> None:
        starts: dict[str, int] = {}
        reasons: dict[str, ReasonCode] = {}
        for sub in action.subscriptions:
            try:
                starts[sub.filter] = await self.store.dispatcher.activate(sub.queue, action.client_id)
            except TopicError as exc:
                LOGGER.warning("subscription refused: %s", exc, extra={"ctx": {"client_id": action.client_id}})
                reasons[sub.filter] = ReasonCode.TOPIC_FILTER_INVALID
            except ValueError as exc:
                LOGGER.error("subscription failed: %s", exc, extra={"ctx": {"client_id": action.client_id}})
                reasons[sub.filter] = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        connection.feed(Activated(action.ref, starts, (), reasons or None))
        for sub in action.subscriptions:
            if sub.filter in starts:
                self._subscribe_local(connection, sub.queue)

    async def _release(self, connection: Connection, client_id: str, filters: tuple[str, ...]) -> None:
        for filter in filters:
            queue = _queue_of(connection, filter)
            await self.store.dispatcher.release(queue, client_id)
            self._unsubscribe_local(connection, queue)

    async def _commit(self, connection: Connection, action: CommitOffsets) -> None:
        offsets = {_queue_of(connection, f): offset for f, offset in action.offsets.items()}
        await trio.to_thread.run_sync(self.store.queues.commit_offsets, action.client_id, offsets)

    def _subscribe_local(self, connection: Connection, queue: str) -> None:
        held = self._held.setdefault(connection, set())
        if queue in held:
            return
        held.add(queue)
        self._local.setdefault(queue, set()).add(connection)
        self._router.register(NODE_NAME, queue)

    def _unsubscribe_local(self, connection: Connection, queue: str) -> None:
        held = self._held.get(connection)
        if held is not None:
            held.discard(queue)
        local = self._local.get(queue)
        if local is None or connection not in local:
            return
        local.discard(connection)
        if not local:
            del self._local[queue]
        self._router.unregister(NODE_NAME, queue)

    # --- notify -------------------------------------------------------------------------

    def on_dispatched(self, events: dict[str, int]) -> None:
        """The dispatcher's listener (trio thread): route the batch's events to this node's mailbox."""
        for node, mine in self._router.route(events).items():
            if node == NODE_NAME:
                self._mailbox.post(mine)

    async def consume_events(self) -> None:
        """Turn mailbox events into ``QueueAdvanced`` for the local connections on each queue; runs until closed."""
        while True:
            try:
                events = await self._mailbox.get()
            except trio.EndOfChannel:
                return
            for queue, max_offset in events.items():
                for connection in tuple(self._local.get(queue, ())):
                    connection.feed(QueueAdvanced(queue, max_offset))


def _queue_of(connection: Connection, filter: str) -> str:
    """The light queue a subscription filter reads (the filter itself unless it is shared)."""
    session = connection.channel.session
    sub = session.subscriptions.get(filter) if session is not None else None
    return sub.queue if sub is not None else filter


def _record_fields(message: Message) -> Mapping[str, Any]:
    return {
        "client_id": message.client_id,
        "qos": message.qos,
        "retain": message.retain,
        "properties": encode_properties(message.properties, PacketType.PUBLISH),
        "born_ms": message.born_ms or None,
    }


def _message(record: Record, queue: str, offset: int) -> Message:
    props = record.properties
    return Message(
        record.topic, record.payload, record.qos, record.retain,
        decode_properties(props, 0, len(props), PacketType.PUBLISH), record.client_id,
        record.born_ms, record.store_ms, queue, offset,
    )


def _channel_config(settings: Mapping[str, Any]) -> ChannelConfig:
    return ChannelConfig(
        max_packet_size=settings["mqtt.max_packet_size"],
        receive_maximum=settings["mqtt.receive_maximum"],
        shared_available=False,
    )


async def serve_gateway(
    settings: Mapping[str, Any],
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the embedded node until cancelled: store, notify, MQTT listener.

    ``task_status.started`` receives the (host, port) listened on (port 0 picks a free one).
    """
    data = Path(settings["node.data"])
    router = NotifyRouter()
    mailbox = EventMailbox()
    listener_box: list[GatewayNode] = []

    def listener(events: dict[str, int]) -> None:
        if listener_box:
            listener_box[0].on_dispatched(events)

    async with open_store(data, CommitLogConfig.from_settings(settings), listener) as store:
        LOGGER.info("store node ready", extra={"ctx": {"data": str(data),
                                                       "written_offset": store.log.log.written_offset}})
        async with trio.open_nursery() as nursery:
            node = GatewayNode(store, nursery, _channel_config(settings), settings["mqtt.connect_timeout_s"],
                               router, mailbox)
            listener_box.append(node)
            nursery.start_soon(node.consume_events)
            listeners = await nursery.start(serve_mqtt, node, settings["node.host"], settings["node.port"])
            host, port = listeners[0].socket.getsockname()[:2]
            LOGGER.info("gateway node ready", extra={"ctx": {"host": host, "port": port}})
            task_status.started((host, port))


async def _serve_until_signalled(settings: Mapping[str, Any]) -> None:
    async with trio.open_nursery() as nursery:

        async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
            await until_signalled(task_status=task_status)
            nursery.cancel_scope.cancel()

        await nursery.start(stop_on_signal)  # signals are caught before "ready" is logged
        await nursery.start(serve_gateway, settings)
    LOGGER.info("gateway node stopped")


def run_gateway_node(conf: Any) -> int:
    """Entry point for ``lightgate serve``: returns the process exit status."""
    failed = False
    try:
        trio.run(_serve_until_signalled, conf.values)
    except* OSError as group:  # e.g. the port is taken; nurseries may wrap it in a group
        LOGGER.error("gateway node failed: %s", "; ".join(str(exc) for exc in group.exceptions))
        failed = True
    return 1 if failed else 0
