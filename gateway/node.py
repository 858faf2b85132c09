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
- Shared subscriptions: one ``SharedGroup`` per (share name, queue) holds the
  queue and owns its offset in the store; it hands each pulled batch to the
  member that pulled and takes back what a leaving member left unacknowledged.
- ``$SYS/broker/...``: statistics appended every ``mqtt.sys_interval_s``
  through the normal path (wildcards starting with ``+``/``#`` do not match them).
- Resuming after a crash: the offsets the light queues committed (WAL) win
  over an older saved session blob, so acknowledged messages are not replayed.
- Retained messages: the dispatcher keeps them (retain/); ``Activate`` answers
  with the matches of each new subscription that wants them.
- Authentication and ACLs (docs/security.md): a CONNECT is authenticated
  before it can take a session over; PUBLISHes and SUBSCRIBEs are checked
  against the ACL before they are stored or activated; a resumed session keeps
  only the subscriptions its new connection may make. Delivery is not checked
  again: the subscribe-time check is the model.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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
    Subscription,
    TakenOver,
)
from gateway.acl import Access, Acl, AclError
from gateway.authn import AuthDecision, Authenticator, ReloadError, WatchedFile
from gateway.channel import ChannelConfig
from gateway.passwords import PasswordFileError
from gateway.properties import PacketType, decode_properties, encode_properties
from gateway.reasons import ReasonCode
from gateway.server import Connection, Traffic, serve_mqtt
from gateway.session import SessionState
from lightqueue.topics import TopicError, parse_shared
from notify import EventMailbox, NotifyRouter
from store.commitlog import CommitLogConfig
from store.node import StoreNode, open_store, until_signalled
from store.record import Record, RecordTooLarge, decode_record

__all__ = ["GatewayNode", "SharedGroup", "merge_committed", "run_gateway_node", "serve_gateway"]

LOGGER = logging.getLogger(__name__)

NODE_NAME = "local"
"""The one gateway node of the embedded deployment, as the notify router knows it."""

TAKEOVER_TIMEOUT_S = 15.0
"""How long a new connection waits for the one it takes over to hand its session over."""

SHARE_OWNER_PREFIX = "$share/"
"""Light-queue holder and offset owner name of a shared subscription group: ``$share/<group>``.
Client ids are opaque, so the prefix keeps groups apart from sessions in practice, as EMQX does."""

SYS_PREFIX = "$SYS/broker/"
"""Where the node's statistics are published (Mosquitto's names, so existing dashboards find them)."""

AUTH_RECHECK_S = 1.0
"""The password and ACL files are looked at (one ``stat`` each) at most this often, when a CONNECT, PUBLISH or
SUBSCRIBE needs them: an edit takes effect within a second without a ``stat`` per message."""

AUTH_THREADS = 4
"""argon2 verifications running at once: each takes one core and 19 MiB, so a CONNECT storm on a 2-core machine
gains nothing from more, and queued CONNECTs wait without holding memory."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SessionState)


def encode_session(state: SessionState) -> bytes:
    """The session as the blob the store keeps (msgpack: no pickle, readable by any version that knows the fields)."""
    return _ENCODER.encode(state)


def decode_session(blob: bytes) -> SessionState:
    """Raises msgspec.DecodeError (a ValueError) on a blob that is not a session."""
    return _DECODER.decode(blob)


def merge_committed(state: SessionState, committed: Mapping[str, int]) -> SessionState:
    """The session with the queues' committed offsets (queue -> offset) where they are ahead of its own.

    A blob is saved on subscription changes and disconnects, offsets are
    committed on acknowledgements: after a crash the blob can be older than
    the commits, and replaying from it would resend acknowledged messages.
    Shared subscriptions are skipped: their group owns the offset.
    """
    offsets = dict(state.offsets)
    cursors = dict(state.cursors)
    for sub in state.subscriptions:
        offset = committed.get(sub.queue)
        if sub.group is None and offset is not None and offset > offsets.get(sub.filter, 0):
            offsets[sub.filter] = offset
            cursors[sub.filter] = max(cursors.get(sub.filter, offset), offset)
    if offsets == state.offsets:
        return state
    return replace(state, offsets=offsets, cursors=cursors)


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

    def acknowledged_below(self, member: Connection, offset: int) -> None:
        """The member acknowledged everything it was handed below ``offset`` (its session's committed offset)."""
        held = self.held.get(member)
        if held:
            held.difference_update([o for o in held if o < offset])

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


@dataclass(slots=True)
class AuthCounters:
    """Refusals since the node started, for operators (``$SYS`` may publish them later)."""

    auth_failures: int = 0  # CONNECTs refused: bad credentials, anonymous access off, a will it may not publish
    acl_denials: int = 0  # PUBLISHes dropped and subscriptions refused (or revoked on resume) by the ACL


@final
class GatewayNode:
    """Executes the node actions of all connections of one embedded node.

    Args:
        store: the open store node.
        nursery: where timers that outlive a connection (wills, session expiry) and the notify consumer run.
        channel_config: what every channel offers its client.
        connect_timeout_s: close connections that send no CONNECT within this.
        authenticator: decides CONNECTs (password file, anonymous access, brute-force delay).
        acl: the watched ACL file, or None when every client may publish and subscribe anywhere.

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
        *,
        authenticator: Authenticator,
        acl: WatchedFile[Acl] | None = None,
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
        self._groups: dict[tuple[str, str], SharedGroup] = {}  # (share name, queue) -> group
        self._started = time.monotonic()
        self.traffic = Traffic()
        self.auth_counters = AuthCounters()
        self._authenticator = authenticator
        self._acl = acl
        self._auth_checked = time.monotonic()  # the files were loaded just now
        self._auth_threads = trio.CapacityLimiter(AUTH_THREADS)

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
        for group in tuple(self._groups.values()):
            if connection in group.held:
                self._leave(group, connection)
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
        decision = await self._authenticate(connection, action)
        if not decision.accepted:  # before the takeover: a refused client must not push an accepted one off
            connection.feed(SessionOpened(False, reason=decision.reason))
            return
        connection.username = decision.username
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
            committed = await trio.to_thread.run_sync(self.store.queues.get_offsets, client_id)
            state = await self._revoke_unauthorised(connection, merge_committed(state, committed))
            for sub in state.subscriptions:
                if sub.group is not None:
                    await self._join(connection, sub, None)
                self._subscribe_local(connection, sub.queue)
        connection.feed(SessionOpened(state is not None, state))

    async def _authenticate(self, connection: Connection, action: OpenSession) -> AuthDecision:
        """Decide the CONNECT; a refusal is counted, logged (never with the password) and delayed (brute force).

        The delay sleeps in this connection's worker, so it holds back only this client.
        """
        self._refresh_auth_files()
        authenticator = self._authenticator
        if action.username is not None and authenticator.passwords is not None:  # argon2: ~50 ms of CPU
            decision = await trio.to_thread.run_sync(authenticator.authenticate, action.username, action.password,
                                                     connection.host, limiter=self._auth_threads)
        else:
            decision = authenticator.authenticate(action.username, action.password, connection.host)
        acl = self._acl.value if self._acl is not None else None
        will = action.will_topic
        if decision.accepted and will is not None and acl is not None \
                and not acl.check(decision.username, action.client_id, Access.PUBLISH, will):
            decision = AuthDecision(False, ReasonCode.NOT_AUTHORIZED, decision.username,
                                    why=f"the will topic {will!r} is not allowed by the ACL")
        if decision.accepted:
            return decision
        self.auth_counters.auth_failures += 1
        LOGGER.warning("connection refused: %s", decision.why,
                       extra={"ctx": {"client_id": action.client_id, "peer": connection.peer,
                                      "reason": decision.reason.name, "delay_s": decision.delay_s,
                                      "auth_failures": self.auth_counters.auth_failures}})
        await trio.sleep(decision.delay_s)
        return decision

    def _refresh_auth_files(self) -> None:
        """Reload the password and ACL files if they changed, looking at most every ``AUTH_RECHECK_S``.

        A broken edit is logged once and the version loaded before stays in effect.
        """
        now = time.monotonic()
        if now - self._auth_checked < AUTH_RECHECK_S:
            return
        self._auth_checked = now
        for watched in (self._authenticator.passwords, self._acl):
            if watched is None:
                continue
            try:
                if watched.refresh():
                    LOGGER.info("reloaded %s", watched.path)
            except ReloadError as exc:  # the message names the file (and line)
                LOGGER.error("not reloaded: %s", exc)

    def _current_acl(self) -> Acl | None:
        """The ACL in effect (None: no restrictions), reloaded first if its file changed."""
        if self._acl is None:
            return None
        self._refresh_auth_files()
        return self._acl.value

    def _denied(self, connection: Connection, access: Access, topic: str, why: str) -> None:
        self.auth_counters.acl_denials += 1
        LOGGER.warning("%s denied by the ACL: %s", access.value, why,
                       extra={"ctx": {"client_id": connection.client_id, "username": connection.username,
                                      "topic": topic, "acl_denials": self.auth_counters.acl_denials}})

    async def _revoke_unauthorised(self, connection: Connection, state: SessionState) -> SessionState:
        """The resumed session without the subscriptions this connection may not make.

        The client id may now log in as another user, or the ACL may have changed while it was away;
        subscriptions are the model of what a client may receive, so they are checked again here.
        """
        acl = self._current_acl()
        if acl is None:
            return state
        user = connection.username
        denied = tuple(sub.filter for sub in state.subscriptions
                       if not acl.check(user, state.client_id, Access.SUBSCRIBE, sub.filter))
        if not denied:
            return state
        for filter in denied:
            self._denied(connection, Access.SUBSCRIBE, filter, "subscription of the resumed session removed")
        await self._release(connection, state.client_id, denied)
        gone = set(denied)
        return replace(
            state,
            subscriptions=tuple(sub for sub in state.subscriptions if sub.filter not in gone),
            offsets={f: o for f, o in state.offsets.items() if f not in gone},
            cursors={f: o for f, o in state.cursors.items() if f not in gone},
            inflight=tuple(i for i in state.inflight if i.filter not in gone),
        )

    async def _save(self, state: SessionState) -> None:
        self._sessions[state.client_id] = state
        if state.expiry_s > 0:
            blob = encode_session(state)
            await trio.to_thread.run_sync(self.store.save_session, state.client_id, blob)

    async def drop_session(self, client_id: str) -> None:
        """End a session: its state, its stored blob, its filters and offsets go."""
        self._sessions.pop(client_id, None)
        self._cancel(self._expiries, client_id)
        for group in tuple(self._groups.values()):
            if client_id in group.subscribers:
                await self._unsubscribe_group(group, client_id)
        await trio.to_thread.run_sync(self.store.drop_session, client_id)
        await trio.to_thread.run_sync(self.store.queues.delete_owner, client_id)

    def _start_expiry(self, client_id: str, expiry_s: int) -> None:
        async def expire(scope: trio.CancelScope) -> None:
            with scope:
                await trio.sleep(expiry_s)
                del self._expiries[client_id]
                with trio.CancelScope(shield=True):  # a half-dropped session would keep its filters held
                    await self.drop_session(client_id)
                LOGGER.info("session expired", extra={"ctx": {"client_id": client_id}})

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
        await self._store(connection, appends, self._publish_allowed(connection, appends))

    def _publish_allowed(self, connection: Connection, appends: list[Append]) -> list[bool]:
        """Per append, may the client publish it (every message of it; the channel sends one per append)?"""
        acl = self._current_acl()
        if acl is None:
            return [True] * len(appends)
        user = connection.username
        client_id = connection.client_id
        allowed = []
        for append in appends:
            ok = True
            for message in append.messages:
                if not acl.check(user, client_id, Access.PUBLISH, message.topic):
                    self._denied(connection, Access.PUBLISH, message.topic, f"QoS {message.qos} message dropped")
                    ok = False
            allowed.append(ok)
        return allowed

    async def _store(self, connection: Connection, appends: list[Append], allowed: list[bool]) -> None:
        """Append the allowed messages as one batch; answer every append with a ref, in order."""
        messages = [m for append, ok in zip(appends, allowed) if ok for m in append.messages]
        reason = await self.append_messages(messages) if messages else None
        if reason is not None and allowed.count(True) > 1:
            # One bad message must not fail its neighbours: retry one by one so each gets its own answer.
            for append, ok in zip(appends, allowed):
                await self._store(connection, [append], [ok])
            return
        for append, ok in zip(appends, allowed):
            if append.ref is None:
                continue
            if not ok:
                connection.feed(Appended(append.ref, False, ReasonCode.NOT_AUTHORIZED))
            else:
                connection.feed(Appended(append.ref, reason is None, reason or ReasonCode.SUCCESS))

    async def _pull(self, connection: Connection, action: Pull) -> None:
        if action.group is not None:
            await self._pull_shared(connection, action)
            return
        result = await self.store.pull(action.queue, action.from_offset, action.max_count)
        messages = tuple(_message(record, action.queue, offset) for offset, record in result.messages)
        connection.feed(Pulled(action.filter, messages, result.next_offset))

    async def _pull_shared(self, connection: Connection, action: Pull) -> None:
        """Answer a member's pull with what its group assigns it: handed-back offsets first, then its share."""
        group = self._groups.get((action.group, action.queue))  # type: ignore[arg-type]
        if group is None or connection not in group.held:
            connection.feed(Pulled(action.filter, (), action.from_offset))  # left or unsubscribed meanwhile
            return
        queue = group.queue
        taken: list[tuple[int, Record]] = []
        async with group.lock:
            while group.returned and len(taken) < action.max_count:
                offset = heapq.heappop(group.returned)
                result = await self.store.pull(queue, offset, 1)
                if result.messages and result.messages[0][0] == offset:
                    taken.append(result.messages[0])  # else gone with retention: nothing to redeliver
            room = action.max_count - len(taken)
            if room > 0:
                backlog = self.store.queues.max_offset(queue) - group.cursor
                share = -(-backlog // max(1, len(group.held)))
                result = await self.store.pull(queue, group.cursor, min(room, max(1, share)))
                taken += result.messages
                group.cursor = max(group.cursor, result.next_offset)
            held = group.held.get(connection)
            if held is None:  # the member left during the reads: the messages go back
                for offset, _ in taken:
                    heapq.heappush(group.returned, offset)
                if taken:
                    self._poke(group)
                taken = []
            else:
                held.update(offset for offset, _ in taken)
        taken.sort(key=lambda pair: pair[0])
        messages = tuple(_message(record, queue, offset) for offset, record in taken)
        connection.feed(Pulled(action.filter, messages, group.cursor))

    async def _join(self, connection: Connection, sub: Subscription, start: int | None) -> None:
        """Make the connection a member of its shared subscription's group (created, with its offset, on first use).

        ``start`` is where a new group starts when the store has no offset for it (None: the queue's head).
        """
        key = (sub.group, sub.queue)
        group = self._groups.get(key)  # type: ignore[arg-type]
        if group is None:
            owner = SHARE_OWNER_PREFIX + sub.group  # type: ignore[operator]
            committed = (await trio.to_thread.run_sync(self.store.queues.get_offsets, owner)).get(sub.queue)
            if committed is None:
                committed = start if start is not None else self.store.queues.max_offset(sub.queue)
                await trio.to_thread.run_sync(self.store.queues.commit_offsets, owner, {sub.queue: committed})
            group = self._groups.setdefault(key, SharedGroup(sub.group, sub.queue, committed))  # type: ignore[arg-type]
        group.subscribers.add(connection.client_id)
        group.held.setdefault(connection, set())

    def _leave(self, group: SharedGroup, connection: Connection) -> None:
        """Hand back what the leaving member did not acknowledge and make the other members pull it."""
        session = connection.channel.session
        if session is not None:
            for filter, offset in session.committed_offsets().items():
                if parse_shared(filter) == (group.name, group.queue):
                    group.acknowledged_below(connection, offset)
        if group.leave(connection):
            self._poke(group)

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
        await self.store.dispatcher.release(group.queue, group.owner)

    async def _commit_group(self, group: SharedGroup) -> None:
        offset = group.committed_offset()
        if offset != group.committed:
            group.committed = offset
            await trio.to_thread.run_sync(self.store.queues.commit_offsets, group.owner, {group.queue: offset})

    # --- subscriptions ------------------------------------------------------------------

    def _retained_for(self, action: Activate, starts: Mapping[str, int]) -> tuple[tuple[str, Message], ...]:
        """The retained messages for the new subscriptions that want them now.

        The channel already applied MQTT 5 retain handling (``action.retained``);
        shared subscriptions never get retained messages (MQTT 5.0, section 4.8.2).
        """
        wanted = set(action.retained)
        return tuple(
            (sub.filter, _message(decode_record(r.record, 0, r.log_offset), None, None))
            for sub in action.subscriptions
            if sub.filter in wanted and sub.filter in starts and sub.group is None
            for r in self.store.retained.lookup(sub.queue)
        )

    async def _activate(self, connection: Connection, action: Activate) -> None:
        starts: dict[str, int] = {}
        reasons: dict[str, ReasonCode] = {}
        acl = self._current_acl()
        for sub in action.subscriptions:
            if acl is not None and not acl.check(connection.username, action.client_id, Access.SUBSCRIBE, sub.filter):
                self._denied(connection, Access.SUBSCRIBE, sub.filter, "filter refused")
                reasons[sub.filter] = ReasonCode.NOT_AUTHORIZED
                continue
            holder = action.client_id if sub.group is None else SHARE_OWNER_PREFIX + sub.group
            try:
                starts[sub.filter] = await self.store.dispatcher.activate(sub.queue, holder)
                if sub.group is not None:
                    await self._join(connection, sub, starts[sub.filter])
            except TopicError as exc:
                LOGGER.warning("subscription refused: %s", exc, extra={"ctx": {"client_id": action.client_id}})
                reasons[sub.filter] = ReasonCode.TOPIC_FILTER_INVALID
            except ValueError as exc:
                LOGGER.error("subscription failed: %s", exc, extra={"ctx": {"client_id": action.client_id}})
                reasons[sub.filter] = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        retained = await trio.to_thread.run_sync(self._retained_for, action, starts)
        connection.feed(Activated(action.ref, starts, retained, reasons or None))
        for sub in action.subscriptions:
            if sub.filter in starts:
                self._subscribe_local(connection, sub.queue)

    async def _release(self, connection: Connection, client_id: str, filters: tuple[str, ...]) -> None:
        for filter in filters:
            shared = parse_shared(filter)
            if shared is None:
                await self.store.dispatcher.release(filter, client_id)
                self._unsubscribe_local(connection, filter)
                continue
            self._unsubscribe_local(connection, shared[1])
            group = self._groups.get(shared)
            if group is not None:
                if connection in group.held:
                    self._leave(group, connection)
                await self._unsubscribe_group(group, client_id)

    async def _commit(self, connection: Connection, action: CommitOffsets) -> None:
        offsets: dict[str, int] = {}
        for filter, offset in action.offsets.items():
            shared = parse_shared(filter)
            if shared is None:
                offsets[filter] = offset
                continue
            group = self._groups.get(shared)
            if group is not None:
                group.acknowledged_below(connection, offset)
                await self._commit_group(group)
        if offsets:
            await trio.to_thread.run_sync(self.store.queues.commit_offsets, action.client_id, offsets)
        LOGGER.debug("offsets committed", extra={"ctx": {"client_id": action.client_id, "offsets": action.offsets}})

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

    # --- $SYS ---------------------------------------------------------------------------

    def sys_messages(self) -> list[Message]:
        """The node's statistics as retained QoS 0 messages under ``$SYS/broker/``."""
        traffic = self.traffic
        figures = {
            "uptime": int(time.monotonic() - self._started),
            "clients/connected": len(self._connections),
            "messages/received": traffic.messages_in,
            "messages/sent": traffic.messages_out,
            "bytes/received": traffic.bytes_in,
            "bytes/sent": traffic.bytes_out,
        }
        now_ms = int(time.time() * 1000)
        return [Message(SYS_PREFIX + name, str(value).encode(), 0, True, born_ms=now_ms)
                for name, value in figures.items()]

    async def publish_sys(self, interval_s: float) -> None:
        """Append the statistics now and every ``interval_s`` until cancelled."""
        while True:
            reason = await self.append_messages(self.sys_messages())
            if reason is not None:
                LOGGER.error("$SYS statistics not published: %s", reason.name)
            await trio.sleep(interval_s)

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


def _record_fields(message: Message) -> Mapping[str, Any]:
    return {
        "client_id": message.client_id,
        "qos": message.qos,
        "retain": message.retain,
        "properties": encode_properties(message.properties, PacketType.PUBLISH),
        "born_ms": message.born_ms or None,
    }


def _message(record: Record, queue: str | None, offset: int | None) -> Message:
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
        max_keepalive=settings["mqtt.max_keepalive"] or None,
        reason_strings=True,
    )


async def serve_gateway(
    settings: Mapping[str, Any],
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the embedded node until cancelled: store, notify, MQTT listener.

    ``task_status.started`` receives the (host, port) listened on (port 0 picks a free one).

    Raises:
        PasswordFileError, AclError: the configured password or ACL file is missing or malformed
            (checked before the store opens).
    """
    data = Path(settings["node.data"])
    router = NotifyRouter()
    mailbox = EventMailbox()
    listener_box: list[GatewayNode] = []

    def listener(events: dict[str, int]) -> None:
        if listener_box:
            listener_box[0].on_dispatched(events)

    authenticator = Authenticator.from_config(settings)  # type: ignore[arg-type]  # any mapping of the options
    acl = WatchedFile(settings["auth.acl_file"], Acl.load) if settings["auth.acl_file"] else None
    LOGGER.info("authentication ready", extra={"ctx": {
        "password_file": settings["auth.password_file"] or None, "acl_file": settings["auth.acl_file"] or None,
        "allow_anonymous": authenticator.allow_anonymous}})
    async with open_store(data, CommitLogConfig.from_settings(settings), listener) as store:
        LOGGER.info("store node ready", extra={"ctx": {"data": str(data),
                                                       "written_offset": store.log.log.written_offset}})
        async with trio.open_nursery() as nursery:
            node = GatewayNode(store, nursery, _channel_config(settings), settings["mqtt.connect_timeout_s"],
                               router, mailbox, authenticator=authenticator, acl=acl)
            listener_box.append(node)
            nursery.start_soon(node.consume_events)
            if settings["mqtt.sys_interval_s"] > 0:
                nursery.start_soon(node.publish_sys, settings["mqtt.sys_interval_s"])
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
    except* (PasswordFileError, AclError) as group:  # the message names the file and line
        LOGGER.error("gateway node not started: %s", "; ".join(str(exc) for exc in group.exceptions))
        failed = True
    return 1 if failed else 0
