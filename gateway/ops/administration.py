"""What an operator asks of a node (the admin API, the dashboard, the metrics), answered by reading the node.

The node never imports this: ``Administration`` reads its registry, sessions, subscriptions and store, and
writes through its publish path (an HTTP publish, the empty retained message that deletes one). The calls about
one client (details, session, disconnect, delete) reach the node it is connected to through the store
(``StoreApi.admin_call``); ``answer_asks`` answers the ones other nodes make about clients connected here.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, final

import msgspec
import trio

from gateway.auth.authn import AuthDecision
from gateway.mqtt.packets import MQTT_5
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.session import SessionState
from gateway.node.connection import Connection
from gateway.node.node import GatewayNode
from gateway.ops.clusterlists import LIST_OPS, list_here
from gateway.mqtt.properties import PacketType, decode_properties
from gateway.mqtt.reasons import RemoteProtocolError
from gateway.ops.records import ClientInfo, DeadLetter, QueueInfo, SessionInfo, SubscriptionLag
from lightqueue.topics import TopicError, TopicLimits, validate_filter, validate_topic
from store.api import SHARE_PREFIX, AdminOp, NewMessage, Position, PullRequest, Record, dlq_topic

__all__ = ["ADMIN_CLIENT_ID", "Administration", "HTTP_CLIENT_ID", "HttpPublish"]

LOGGER = logging.getLogger(__name__)

HTTP_CLIENT_ID = "$http"
"""The publisher client id of messages published over HTTP (``POST /api/v1/publish``); ``$`` marks server-side
names (``$SYS``, ``$share``), which devices do not use, so No Local does not drop them for a device."""

ADMIN_CLIENT_ID = "$admin"
"""The publisher client id of the empty retained messages that delete retained messages (admin API)."""


@dataclass(frozen=True, slots=True)
class HttpPublish:
    """One message an HTTP client publishes: ``properties`` as a record keeps them, ``deliver_at_ms`` (ms since the
    epoch, 0: now) makes it a delayed message (store/timer/)."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: bytes = b""
    deliver_at_ms: int = 0


DLQ_PAGE = 1000
"""Dead letters one admin call lists or re-drives at most."""


def redrive_owner(group: str) -> str:
    """The offsets owner that records how far the dead letters of POP group ``group`` were re-driven."""
    return "$redrive/" + group


def dead_letter(offset: int, record: Record) -> DeadLetter:
    """The admin view of the dead letter ``record`` at ``offset`` (fields it lacks are empty)."""
    try:
        users = dict(decode_properties(record.properties, 0, len(record.properties), PacketType.PUBLISH)
                     .user_properties)
    except RemoteProtocolError:
        users = {}
    try:
        payload, encoding = record.payload.decode(), "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(record.payload).decode(), "base64"
    return DeadLetter(offset, users.get("dlq-topic", ""), users.get("dlq-client", ""),
                      _int(users.get("dlq-attempts", "")), users.get("dlq-queue", ""),
                      _int(users.get("dlq-offset", "")), record.qos, payload, encoding, record.store_ms)


def _int(text: str) -> int:
    return int(text) if text.isdigit() else 0


@final
class Administration:
    """The operator's view of one node (see the module docstring)."""

    def __init__(self, node: GatewayNode) -> None:
        self.node = node
        self.store = node.store

    # --- figures ------------------------------------------------------------------------------

    def uptime_s(self) -> float:
        return self.node.system.uptime_s()

    async def session_counts(self) -> tuple[int, int]:
        """(online, offline): the clients connected here, and the stored sessions whose clients are not."""
        registry = self.node.registry
        stored = await self.store.sessions()
        return len(registry), sum(1 for client_id in stored if client_id not in registry)

    def clients(self) -> list[ClientInfo]:
        """The connected clients."""
        return [_client_info(connection) for connection in self.node.registry]

    # --- one client, wherever it is connected -----------------------------------------------

    async def client_info(self, client_id: str) -> ClientInfo | dict[str, Any] | None:
        """The connected client, here or on another node (its answer, as JSON); None when it is not connected.

        Raises:
            OSError: the store, or the node the client is connected to, did not answer.
        """
        connection = self.node.registry.get(client_id)
        if connection is not None:
            return _client_info(connection)
        return await self._ask_owner(client_id, AdminOp.CLIENT)

    async def _ask_owner(self, client_id: str, op: AdminOp) -> Any:
        """The answer of the node ``client_id`` is connected to (through the store's presence), decoded from JSON;
        None when it is connected to no other node."""
        answer = await self.store.admin_call(client_id, op)
        return None if answer is None else msgspec.json.decode(answer)

    async def disconnect(self, client_id: str) -> bool:
        """Close the client's connection as an administrative action (MQTT 5: DISCONNECT 0x98), on whichever node
        it is connected to. As for any close the client did not ask for, its will is published and a persistent
        session stays. Returns once the connection is gone; False when the client is not connected.

        Raises:
            OSError: the store, or the node the client is connected to, did not answer.
        """
        if client_id in self.node.registry:
            return await self.node.registry.disconnect(client_id)
        return await self._ask_owner(client_id, AdminOp.DISCONNECT) is not None

    async def session_info(self, client_id: str) -> SessionInfo | dict[str, Any] | None:
        """One session: live on the node its client is connected to (this one or another: its answer, as JSON),
        else as the store keeps it.

        Raises:
            msgspec.DecodeError: the stored session is unreadable.
            OSError: the store, or the node the client is connected to, did not answer.
        """
        sessions = self.node.sessions
        state = sessions.live(client_id)
        if state is None:
            live = await self._ask_owner(client_id, AdminOp.SESSION)
            if live is not None:
                return live
            state = await sessions.stored(client_id)
            if state is None:
                return None
        return self._session_info(state, await sessions.heads(sub.queue for sub in state.subscriptions))

    async def delete_session(self, client_id: str) -> bool:
        """End a session now, its client disconnected first (on whichever node it is connected to); False when
        there is no such session.

        Raises:
            OSError: the store, or the node the client is connected to, did not answer.
        """
        if client_id not in self.node.registry and await self._ask_owner(client_id, AdminOp.DELETE_SESSION):
            return True  # that node disconnected it and ended the session
        return await self._delete_here(client_id)

    async def _delete_here(self, client_id: str) -> bool:
        """A connected client's session counts even when the store keeps none (Clean Start: it lives only as
        long as the connection, which this closes)."""
        connected = await self.node.registry.disconnect(client_id)
        ended = await self.store.end_session(client_id)
        if connected or ended:
            LOGGER.info("session deleted (admin API)", extra={"ctx": {"client_id": client_id}})
        return connected or ended

    # --- all sessions and queues ----------------------------------------------------------------

    async def _states(self) -> list[SessionState]:
        """The sessions of the clients connected here (live), and the stored sessions of the others."""
        sessions = self.node.sessions
        states = [state for connection in self.node.registry
                  if (state := sessions.live(connection.client_id)) is not None]
        connected = {state.client_id for state in states}
        for client_id in await self.store.sessions():
            if client_id not in connected:
                try:
                    state = await sessions.stored(client_id)
                except msgspec.DecodeError:
                    continue
                if state is not None:
                    states.append(state)
        return states

    async def sessions(self) -> list[SessionInfo]:
        """The sessions of the clients connected here, and the stored sessions of clients connected nowhere."""
        states = await self._states()
        heads = await self.node.sessions.heads(sub.queue for state in states for sub in state.subscriptions)
        return [self._session_info(state, heads) for state in states]

    async def queues(self) -> list[QueueInfo]:
        """The queues the sessions read, with the slowest consumer's lag (a shared subscription's offset is its
        group's)."""
        committed: dict[str, list[int]] = {}
        groups: set[tuple[str, str]] = set()
        for state in await self._states():
            for sub in state.subscriptions:
                if sub.group is None:
                    committed.setdefault(sub.queue, []).append(state.offsets.get(sub.filter, 0))
                else:
                    groups.add((SHARE_PREFIX + sub.group, sub.queue))
        for owner, queue in sorted(groups):
            committed.setdefault(queue, []).append((await self.store.get_offsets(owner)).get(queue, 0))
        heads = await self.node.sessions.heads(committed)
        return [QueueInfo(queue, heads[queue], len(offsets), min(offsets), max(0, heads[queue] - min(offsets)))
                for queue, offsets in sorted(committed.items())]

    def _session_info(self, state: SessionState, heads: Mapping[str, int]) -> SessionInfo:
        subscriptions = []
        for sub in state.subscriptions:
            offset = state.offsets.get(sub.filter, 0)
            head = heads[sub.queue]
            subscriptions.append(SubscriptionLag(sub.filter, sub.queue, sub.options.qos, sub.group, offset, head,
                                                 max(0, head - offset)))
        return SessionInfo(state.client_id, state.client_id in self.node.registry, state.expiry_s,
                           len(state.inflight), sum(s.lag for s in subscriptions), tuple(subscriptions))

    # --- retained messages -----------------------------------------------------------------------

    async def retained(self, filter: str) -> list[Record]:
        """The retained messages matching ``filter``.

        Raises:
            TopicError: not a valid topic filter.
        """
        validate_filter(filter)
        return await self.store.retained(filter)

    async def delete_retained(self, topic: str) -> bool:
        """Delete the retained message of ``topic`` as MQTT does: an empty retained message through the normal path.

        It is gone once dispatched (milliseconds). Returns False when there is none.

        Raises:
            TopicError: not a valid topic name.
            OSError: the store did not take the message.
        """
        validate_topic(topic)
        if not any(record.topic == topic for record in await self.store.retained(topic)):
            return False
        reason = await self.node.appends.own([NewMessage(topic, b"", ADMIN_CLIENT_ID, retain=True,
                                                         born_ms=int(time.time() * 1000))])
        if reason is not None:
            raise OSError(f"the empty retained message was not stored: {reason.name}")
        LOGGER.info("retained message deleted (admin API)", extra={"ctx": {"topic": topic}})
        return True

    # --- dead letters of POP groups (store/pop/) -------------------------------------------------

    async def dead_letters(self, group: str, from_offset: int, limit: int) -> tuple[list[DeadLetter], int, int]:
        """The messages of ``$dlq/<group>`` from queue offset ``from_offset`` (at most ``limit``): each with where it
        came from; and the queue offset after them, and the one below which they were re-driven.

        Raises:
            TopicError: ``group`` makes no valid topic.
        """
        topic = dlq_topic(group)
        validate_topic(topic)
        (result,) = await self.store.pull([PullRequest(topic, max(0, from_offset), max(1, min(limit, DLQ_PAGE)))])
        redriven = (await self.store.get_offsets(redrive_owner(group))).get(topic, 0)
        return [dead_letter(offset, record) for offset, record in result.messages], result.next_offset, redriven

    async def redrive(self, group: str, limit: int) -> tuple[int, int]:
        """Append the dead letters of ``group`` not re-driven yet (at most ``limit``) back to their original topics,
        then record how far re-driving went (a committed offset of ``$redrive/<group>`` on ``$dlq/<group>``):
        (messages re-driven, the offset re-driven below).

        Raises:
            TopicError: ``group`` makes no valid topic.
            OSError: the store did not take the messages (nothing is recorded: a retry re-drives them again).
        """
        topic = dlq_topic(group)
        validate_topic(topic)
        owner = redrive_owner(group)
        start = (await self.store.get_offsets(owner)).get(topic, 0)
        (result,) = await self.store.pull([PullRequest(topic, start, max(1, min(limit, DLQ_PAGE)))])
        letters = [dead_letter(offset, record) for offset, record in result.messages]
        messages = [NewMessage(letter.origin_topic, record.payload, record.client_id, record.qos, False,
                               record.properties, record.born_ms)
                    for letter, (_, record) in zip(letters, result.messages) if letter.origin_topic]
        if messages:
            reason = await self.node.appends.own(messages)
            if reason is not None:
                raise OSError(f"the re-driven messages were not stored: {reason.name}")
        if result.next_offset > start:
            await self.store.commit_offsets({owner: {topic: result.next_offset}})
        LOGGER.info("dead letters re-driven (admin API)", extra={"ctx": {"group": group, "messages": len(messages),
                                                                        "below": result.next_offset}})
        return len(messages), result.next_offset

    # --- HTTP publish ----------------------------------------------------------------------------

    async def authenticate_http(self, username: str | None, password: bytes | None, source: str) -> AuthDecision:
        """Decide the credentials of an HTTP publish as a CONNECT's: counted, logged and delayed when refused."""
        return await self.node.guard.http(username, password, source)

    async def publish(self, publishes: Sequence[HttpPublish], username: str | None, source: str
                      ) -> list[Position | ReasonCode | TopicError]:
        """Publish for an HTTP client (``username`` authenticated, None: anonymous) through the normal path, all
        the messages allowed in one append (one CommitLog write, one flush under the sync policy), its same-topic
        runs as batch records (``Appends.own_each``: each topic in the order given).

        The ACL's publish rules apply as to an MQTT client of that user; HTTP
        publishers have no client id, so ``client`` rules and ``%c`` patterns
        never match them. Returns, per message: its position when stored (a delayed message's id is its ``id``), its
        TopicError (not a valid topic name, or
        beyond the topic limits), NOT_AUTHORIZED, or the append's failure (PACKET_TOO_LARGE, QUOTA_EXCEEDED: the
        HTTP publishers' cap of pending delayed messages, or a full disk...).
        """
        node = self.node
        config = node.channel_config
        limits = TopicLimits(config.max_topic_length, config.max_topic_levels)
        outcomes: list[Position | ReasonCode | TopicError] = []
        allowed: list[tuple[int, NewMessage]] = []  # (index in publishes, message)
        now = int(time.time() * 1000)
        for index, publish in enumerate(publishes):
            try:
                validate_topic(publish.topic, limits)
            except TopicError as exc:
                outcomes.append(exc)
                continue
            if not node.guard.may_publish_http(username, publish.topic, source):
                outcomes.append(ReasonCode.NOT_AUTHORIZED)
                continue
            outcomes.append(ReasonCode.UNSPECIFIED_ERROR)  # replaced by the append's outcome below
            allowed.append((index, NewMessage(publish.topic, publish.payload, HTTP_CLIENT_ID, publish.qos,
                                              publish.retain, publish.properties, now,
                                              deliver_at_ms=publish.deliver_at_ms)))
        if not allowed:
            return outcomes
        stored = await node.appends.own_each([message for _, message in allowed])  # grouped by topic there
        for (index, message), outcome in zip(allowed, stored):
            outcomes[index] = outcome
            if isinstance(outcome, Position):
                node.traffic.messages_in += 1
                node.traffic.messages_in_by_qos[message.qos] += 1
        return outcomes

    # --- other nodes' asks -----------------------------------------------------------------------

    async def answer_asks(self) -> None:
        """Answer the admin calls other nodes make about clients connected here, until the store client closes."""
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    ask_id, client_id, op, query = await self.store.admin_asks()
                except trio.EndOfChannel:
                    return
                nursery.start_soon(self._answer, ask_id, client_id, op, query)

    async def _answer(self, ask_id: int, client_id: str, op: AdminOp, query: bytes) -> None:
        """One admin call of another node: answered from this node only (never forwarded again); None when the
        client is not connected here (it moved since). A list call (gateway/ops/clusterlists.py) lists this node."""
        answer: Any = None
        node = self.node
        try:
            connection = node.registry.get(client_id)
            if op in LIST_OPS:
                answer = await list_here(self, op, query)
            elif connection is not None and op is AdminOp.CLIENT:
                answer = _client_info(connection)
            elif connection is not None and op is AdminOp.SESSION:
                state = node.sessions.live(client_id)
                if state is not None:
                    answer = self._session_info(state, await node.sessions.heads(
                        sub.queue for sub in state.subscriptions))
            elif op is AdminOp.DISCONNECT:
                answer = await node.registry.disconnect(client_id) or None
            elif op is AdminOp.DELETE_SESSION and connection is not None:
                answer = await self._delete_here(client_id)
        except Exception as exc:  # the asking node gets "not here"; this node goes on
            LOGGER.error("admin call of another node failed: %r", exc, exc_info=exc,
                         extra={"ctx": {"client_id": client_id, "op": op.value}})
            answer = None
        self.store.admin_answer(ask_id, None if answer is None else msgspec.json.encode(answer))


def _client_info(connection: Connection) -> ClientInfo:
    channel = connection.channel
    session = channel.session
    return ClientInfo(
        connection.client_id, connection.username, connection.peer,
        "5.0" if channel.protocol_level == MQTT_5 else "3.1.1", channel.keep_alive,
        session.expiry_s if session is not None else 0,
        session.subscription_count if session is not None else 0,
        len(session.inflight) if session is not None else 0,
    )
