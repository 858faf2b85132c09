"""The gateway node: executes what its connections' channels ask of the store and of each other.

``GatewayNode`` is the ``Backend`` of every connection (gateway/node/connection.py):
it executes the channel actions that need the store or other connections.

- Registry: client id -> its live connection, for takeovers.
- Sessions: the state of disconnected persistent sessions (and of sessions
  being handed over) in memory, and as msgspec blobs in the store
  (``StoreNode.save_session``), so they survive a restart.
- The store is a ``StoreClient`` (store/local.py): the ``StoreNode`` in this
  process (``LocalStoreClient``) or a store node over the RPC; the node works
  the same with either.
- Notify and the queue cache: the node ``watch``es the queues of its local
  sessions; the store routes ``{queue: max offset}`` events for them here; a
  consumer task has the ``QueueCache`` (gateway/node/cache.py) read the news once
  and then feeds ``QueueAdvanced`` to the local connections on each queue,
  whose pulls the cache answers from memory.
- Offset commits of all connections are written together (``CommitBatcher``).
- Timers that outlive a connection: delayed wills and session expiry.
- Shared subscriptions: ``SharedGroups`` (gateway/node/shared.py) arbitrates each
  group's queue among its connected members.
- ``$SYS/broker/...``: statistics appended every ``mqtt.sys_interval_s``
  through the normal path (wildcards starting with ``+``/``#`` do not match them).
- Resuming after a crash: the offsets the light queues committed (WAL) win
  over an older saved session blob, so acknowledged messages are not replayed;
  the inbound QoS 2 flows awaiting PUBREL come from the store, which derives
  them from the CommitLog (store/awaiting.py), never from a blob.
- Retained messages: the dispatcher keeps them (retain/); ``Activate`` answers
  with the matches of each new subscription that wants them.
- Cluster mode (docs/cluster.md): every store write made for a client names
  the lease epoch its connection was accepted under; when the node learns
  that its lease ended (it was frozen or cut off longer than the lease), it
  closes the connections of the ended lease without writing anything for them
  (``consume_fences``). While the store is unreachable a CONNECT is answered
  Server unavailable. The admin calls about one client (details, session,
  disconnect, delete) reach the node it is connected to through the store.
- Authentication and ACLs (docs/security.md): a CONNECT is authenticated
  before it can take a session over; PUBLISHes and SUBSCRIBEs are checked
  against the ACL before they are stored or activated; a resumed session
  suspends the subscriptions its new connection may not make (kept for a user
  who may). With an ACL, each connection's session gets the ACL's delivery
  check (``ReadCheck``), so a wildcard granted over a deny rule never delivers
  a denied topic (queued, retained or resent).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, final

import msgspec
import trio

from gateway.mqtt.actions import (
    Action,
    Activate,
    Activated,
    AdminDisconnect,
    AfterReads,
    Append,
    Appended,
    CommitOffsets,
    ConnectionLost,
    DropSession,
    Event,
    InboundReleased,
    LimitHit,
    Message,
    OpenSession,
    PublishWill,
    Pull,
    Pulled,
    QueueAdvanced,
    Release,
    ReleaseInbound,
    SaveSession,
    ServerShutdown,
    SessionOpened,
    SessionSaved,
    TakenOver,
)
from gateway.auth.acl import Access, Acl, AclError, ReadCheck
from gateway.ops.clusterlists import LIST_OPS, list_here
from gateway.ops.admin import (
    RECENT_AUTH_FAILURES,
    AdminApi,
    AuthFailure,
    ClientInfo,
    QueueInfo,
    SessionInfo,
    SubscriptionLag,
    serve_admin,
)
from gateway.node.admission import Admission
from gateway.auth.authn import AuthDecision, Authenticator, ReloadError, WatchedFile
from gateway.node import clientlog
from gateway.node.cache import QueueCache
from gateway.mqtt.channel import ChannelConfig
from gateway.node.commits import CommitBatcher
from gateway.app.config import Config
from gateway.mqtt.limits import LimitCounters
from gateway.ops.metrics import NodeMetrics
from gateway.node.owed import OwedWrites, Write
from gateway.node.listeners import ListenerSpec, TlsContext, listener_specs
from gateway.app.logs import leaves
from gateway.node.messages import from_record, to_new_message
from gateway.node.order import ReadOrder
from gateway.node.system import SysFigures, SysTree
from gateway.mqtt.packets import MQTT_5
from gateway.mqtt.properties import EMPTY_PROPERTIES, Properties
from gateway.auth.passwords import PasswordFileError
from gateway.node.poller import Poller
from gateway.app.reload import Reloader
from gateway.mqtt.reasons import ReasonCode
from gateway.app.sdnotify import notify
from gateway.node.connection import Connection, Traffic, serve_mqtt
from gateway.mqtt.session import (SessionState, clamp_session_blob, clamp_to_heads, decode_session, encode_session,
                             merge_committed)
from gateway.node.shared import SHARE_OWNER_PREFIX, GroupArbiter, SharedGroups
from gateway.node.timers import Timers
from lightqueue.topics import TopicError, TopicLimits, parse_shared, validate_filter, validate_topic
from store.log.aio import LatencyBuckets
from store.local import LocalStoreClient, StoreClient
from store.log.commitlog import CommitLogConfig
from store.log.errors import LogFullError, StartupError
from store.node import on_hangup, open_store, until_signalled
from store.process import freeze_startup_objects, return_freed_buffers, trim_freed_memory
from store.log.record import Record, RecordTooLarge
from store.space import FULL_RETRY_S
from store.rpc.wire import AdminOp, parse_address

__all__ = ["GatewayNode", "NodeFront", "run_cluster_gateway", "run_gateway_node",
           "serve_cluster_gateway", "serve_gateway", "serve_node"]

LOGGER = logging.getLogger(__name__)

TAKEOVER_TIMEOUT_S = 15.0
"""How long a new connection waits for the one it takes over to hand its session over."""

HTTP_CLIENT_ID = "$http"
"""The publisher client id of messages published over HTTP (``POST /api/v1/publish``); ``$`` marks server-side
names (``$SYS``, ``$share``), which devices do not use, so No Local does not drop them for a device."""

ADMIN_CLIENT_ID = "$admin"
"""The publisher client id of the empty retained messages that delete retained messages (admin API)."""

AUTH_RECHECK_S = 1.0
"""The password and ACL files are looked at (one ``stat`` each) at most this often, when a CONNECT, PUBLISH or
SUBSCRIBE needs them: an edit takes effect within a second without a ``stat`` per message."""

SHUTDOWN_S = 5.0
"""How long a stopping node (SIGTERM) waits for its connections to be told (MQTT 5: DISCONNECT 0x8B), to save their
sessions and to close, before it cancels what is left."""

AUTH_THREADS = 4
"""argon2 verifications running at once: each takes one core and 19 MiB, so a CONNECT storm on a 2-core machine
gains nothing from more, and queued CONNECTs wait without holding memory."""

@dataclass(slots=True)
class AuthCounters:
    """Refusals since the node started, for operators (``$SYS`` may publish them later)."""

    auth_failures: int = 0  # CONNECTs refused: bad credentials, anonymous access off, a will it may not publish
    acl_denials: int = 0  # PUBLISHes dropped and subscriptions refused (or suspended on resume) by the ACL
    recent: deque[AuthFailure] = field(default_factory=lambda: deque(maxlen=RECENT_AUTH_FAILURES))  # newest last

    def refused(self, client_id: str | None, peer: str, username: str | None, reason: ReasonCode) -> None:
        """Count a refused CONNECT or HTTP publish and keep it among the recent ones (the dashboard's)."""
        self.auth_failures += 1
        self.recent.append(AuthFailure(int(time.time() * 1000), client_id, peer, username, reason.name))


@dataclass(slots=True)
class _DelayedWill:
    """A will waiting for its delay (section 3.1.3.2.2); cancelled when the session resumes in time."""

    message: Message
    epoch: int | None  # the store lease of the connection it belongs to
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def cancel(self) -> None:
        self.scope.cancel()


@final
class GatewayNode:
    """Executes the node actions of all connections of one embedded node.

    Args:
        store: the store, embedded or remote.
        nursery: where timers that outlive a connection (wills, session expiry) and the notify consumer run.
        channel_config: what every channel offers its client.
        connect_timeout_s: close connections that send no CONNECT within this.
        authenticator: decides CONNECTs (password file, anonymous access, brute-force delay).
        acl: the watched ACL file, or None when every client may publish and subscribe anywhere.
        identity_as_username: the CN of a connection's verified client certificate is its user name
            (``auth.use_identity_as_username``); connections without one are refused.

    Resource handling: owns no resources; ``serve_gateway`` opens the store and
    the nursery and closes them.
    """

    def __init__(
        self,
        store: StoreClient,
        nursery: trio.Nursery,
        channel_config: ChannelConfig,
        connect_timeout_s: float,
        *,
        authenticator: Authenticator,
        acl: WatchedFile[Acl] | None = None,
        identity_as_username: bool = False,
    ) -> None:
        self.store = store
        self.channel_config = channel_config
        self.connect_timeout_s = connect_timeout_s
        self.nursery = nursery
        self.timers = Timers()
        self.reads = Poller(self._end_round)
        self._round: list[tuple[Connection, Append]] = []  # the appends of the read round in progress
        self.order = ReadOrder()  # activations are applied before the appends read after them
        self._fences: dict[Connection, dict[int, int]] = {}  # connection -> Activate ref -> its open fence
        self.cache = QueueCache(store, from_record)
        self.owed = OwedWrites(nursery)  # store writes a full data disk refused, done once it has room
        self.commits = CommitBatcher(store, nursery, self.owed)
        # A cluster node's store client is a GroupArbiter: the store arbitrates groups with members on several nodes.
        self.groups = SharedGroups(store, self.cache, self.commits, nursery=nursery, convert=from_record,
                                   arbiter=store if isinstance(store, GroupArbiter) else None)
        self._connections: dict[str, Connection] = {}
        self._epochs: dict[Connection, int] = {}  # connection -> the store lease epoch it was accepted under
        self._unavailable = 0  # CONNECTs refused since the store became unreachable (0: it is reachable)
        self._sessions: dict[str, SessionState] = {}  # latest saved or handed-over state per client id
        # client id -> the connections' saves waiting for their write (``SessionSaved``): a full disk delays it
        self._save_waiters: dict[str, list[tuple[Connection, int]]] = {}
        self._suspended: dict[str, SessionState] = {}  # client id -> what its connection's user may not resume
        self._local: dict[str, set[Connection]] = {}  # queue -> connections with a subscription on it
        self._held: dict[Connection, set[str]] = {}  # connection -> its queues in _local
        self._wills: dict[str, _DelayedWill] = {}  # client id -> pending delayed will
        self._expiries: dict[str, trio.CancelScope] = {}  # client id -> pending session expiry
        self._started = time.monotonic()
        self._sys_tree = SysTree(self._started)
        self._peak_connections = 0  # the most clients connected at once ($SYS clients/maximum)
        self.traffic = Traffic()
        self.refused_by_qos = [0, 0, 0]  # messages the store did not take (a full disk...), index = QoS
        self.auth_counters = AuthCounters()
        self.limit_counters = LimitCounters()
        self._authenticator = authenticator
        self._acl = acl
        self._identity_as_username = identity_as_username
        self._auth_checked = time.monotonic()  # the files were loaded just now
        self._auth_threads = trio.CapacityLimiter(AUTH_THREADS)
        self._stopping = False  # shutdown() runs: wills stay with the store, as when a node dies

    # --- Backend ------------------------------------------------------------------------

    async def perform(self, connection: Connection, actions: list[Action]) -> None:
        """Execute node actions in order; consecutive appends (and QoS 2 releases) go to the store as one batch.

        The actions of a connection of an ended lease are dropped (appends answered as not stored): its client
        is no longer this node's, the store would refuse them (``consume_fences`` closes it). When the store
        cannot be reached, the connection is closed as lost (the store client logs the outage, the server the
        close): no traceback per connection.
        """
        try:
            await self._perform(connection, actions)
        except ConnectionError as exc:  # StoreUnavailable, or LeaseLost in a race with the fence
            if not self._fenced(connection):
                connection.feed(ConnectionLost(f"the store is not reachable: {exc}"))

    async def _perform(self, connection: Connection, actions: list[Action]) -> None:
        index = 0
        while index < len(actions):
            if self._fenced(connection):
                self._drop_fenced(connection, actions[index:])
                return
            action = actions[index]
            if type(action) in (Append, ReleaseInbound):
                end = index + 1
                while end < len(actions) and type(actions[end]) is type(action):
                    end += 1
                if type(action) is Append:
                    await self._append(connection, actions[index:end])  # type: ignore[arg-type]
                else:
                    await self._release_inbound(connection, actions[index:end])  # type: ignore[arg-type]
                index = end
                continue
            index += 1
            kind = type(action)
            if kind is AfterReads:
                await self.order.wait(action.mark)  # type: ignore[union-attr]
            elif kind is OpenSession:
                await self._open_session(connection, action)  # type: ignore[arg-type]
            elif kind is Activate:
                try:
                    await self._activate(connection, action)  # type: ignore[arg-type]
                finally:  # failed or cancelled: its fence must not hold every append of the node
                    self._activation_applied(connection, action)  # type: ignore[arg-type]
            elif kind is Pull:
                await self._pull(connection, action)  # type: ignore[arg-type]
            elif kind is Release:
                await self._release(connection, action.client_id, action.filters)  # type: ignore[union-attr]
            elif kind is CommitOffsets:
                await self._commit(connection, action)  # type: ignore[arg-type]
            elif kind is SaveSession:
                if action.ref is not None:  # type: ignore[union-attr]  # answered once written (or owed, then)
                    self._save_waiters.setdefault(action.state.client_id, []).append(  # type: ignore[union-attr]
                        (connection, action.ref))  # type: ignore[union-attr]
                await self._save(action.state, self._epochs.get(connection))  # type: ignore[union-attr]
            elif kind is DropSession:
                await self._drop_when_room(action.client_id, epoch=self._epochs.get(connection))  # type: ignore[union-attr]
            elif kind is PublishWill:
                await self._publish_will(action, self._epochs.get(connection))  # type: ignore[arg-type]
            elif kind is LimitHit:
                self._limit_hit(connection, action)  # type: ignore[arg-type]
            else:
                raise TypeError(f"not a node action: {action!r}")

    def connection_closed(self, connection: Connection) -> None:
        """Forget the connection; start the expiry of its session if it stays stored."""
        for fence in self._fences.pop(connection, {}).values():  # activations it will never apply
            self.order.close(fence)
        for queue in self._held.pop(connection, ()):
            self._unsubscribe_local(connection, queue)
        self.groups.connection_gone(connection)
        epoch = self._epochs.pop(connection, None)
        client_id = connection.client_id
        waiters = self._save_waiters.get(client_id)
        if waiters:  # its saves' answers are not awaited any more (``Session.detach``)
            waiters[:] = [w for w in waiters if w[0] is not connection]
        if not client_id or self._connections.get(client_id) is not connection:
            return
        del self._connections[client_id]
        if epoch != self.store.epoch:  # of an ended lease: its will and its session are not this node's any more
            return
        if client_id not in self._wills and not self._stopping:  # closed without a will to publish: the store
            self.nursery.start_soon(self._drop_will, client_id, epoch)  # must not publish it either
        state = self._sessions.get(client_id)
        if state is not None and state.expiry_s > 0:
            self._start_expiry(client_id, state.expiry_s, epoch)

    def _fenced(self, connection: Connection) -> bool:
        """Whether ``connection`` was accepted under a store lease that has ended since."""
        epoch = self._epochs.get(connection)
        return epoch is not None and epoch != self.store.epoch

    @staticmethod
    def _drop_fenced(connection: Connection, actions: Sequence[Action]) -> None:
        """Drop the actions of a connection of an ended lease; its appends are answered as not stored."""
        refused = [Appended(a.ref, False, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR) for a in actions
                   if type(a) is Append and a.ref is not None]  # type: ignore[union-attr]
        if refused:
            connection.feed_all(refused)

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
                await old.wait_finished()
            if waited.cancelled_caught:
                LOGGER.warning("takeover: the old connection did not close in time",
                               extra={"ctx": {"client_id": client_id}})
        self._connections[client_id] = connection
        self._peak_connections = max(self._peak_connections, len(self._connections))
        epoch = self._epochs[connection] = self.store.epoch
        try:
            state = await self._resume(connection, action, epoch)
        except ConnectionError as exc:  # StoreUnavailable, LeaseLost: nothing to resume from
            self._refuse_unavailable(connection, exc)
            return
        except LogFullError:  # nothing was deleted; the store logged the full disk once
            connection.feed(SessionOpened(False, reason=ReasonCode.QUOTA_EXCEEDED))
            return
        may_read = None if self._acl is None else ReadCheck(self._read_acl, decision.username, client_id)
        connection.feed(SessionOpened(state is not None, state, may_read=may_read))
        clientlog.connected(connection, action.clean_start, state is not None)

    async def _resume(self, connection: Connection, action: OpenSession, epoch: int) -> SessionState | None:
        """The session an accepted CONNECT resumes (None: a new one), after the store heard of the connection.

        Raises:
            ConnectionError: the store is not reachable, or ``epoch`` ended meanwhile.
            LogFullError: the data disk is full and the CONNECT needs a write (a clean start of a stored session,
                a session whose deletion is owed, a shared group's first offset): nothing was deleted.
        """
        client_id = action.client_id
        self.store.present(client_id, epoch=epoch)  # a connection of it on another node is taken over there
        if action.clean_start or self.owed.owes(client_id, DropSession):  # an ended session must not resume
            await self.owed.settle(client_id)
        state = None if action.clean_start else await self._stored_session(client_id)
        if state is None:
            await self.drop_session(client_id, epoch)  # whatever a session that is gone left: offsets, QoS 2 flows
        delayed = self._wills.pop(client_id, None)
        if delayed is not None:  # resumed in time: off [MQTT-3.1.3-9]; a clean start ends the session: due now
            delayed.cancel()
            if action.clean_start:
                await self._will_now(client_id, delayed.message, delayed.epoch)
        self._cancel(self._expiries, client_id)
        await self._hold_will(client_id, action, epoch)
        if state is None:
            if action.expiry_s > 0:  # the session exists from now on: Session Present says so after a crash too
                await self._save(SessionState(client_id, action.expiry_s, detached=True), epoch)
            return None
        awaiting = await self.store.awaiting_release(client_id)
        state = self._suspend_unauthorised(connection, replace(await self._resumed(state, log=True), awaiting=awaiting))
        for sub in state.subscriptions:
            if sub.group is not None:
                await self.groups.join(connection, sub, None)  # LogFullError: a new group's offset is stored first
            self._subscribe_local(connection, sub.queue)
        return state

    async def _stored_session(self, client_id: str) -> SessionState | None:
        """The client's session: handed over or saved on this node, else as the store keeps it."""
        state = self._sessions.get(client_id)
        if state is None:
            blob = await self.store.load_session(client_id)
            if blob is not None:
                try:
                    state = decode_session(blob)
                except msgspec.DecodeError as exc:
                    LOGGER.error("stored session is unreadable; starting a new one: %s", exc,
                                 extra={"ctx": {"client_id": client_id}})
        return state

    def _read_acl(self) -> Acl:
        """The ACL in effect, for delivery checks (per message: no file look; CONNECTs, PUBLISHes, SUBSCRIBEs and
        SIGHUP reload it)."""
        return self._acl.value  # type: ignore[union-attr]

    async def _resumed(self, state: SessionState, *, log: bool = False) -> SessionState:
        """The session as it resumes: the offsets the light queues committed where they are ahead of its own
        (a blob can be older than the commits), none past its queues' heads (the store lost records it had
        acknowledged: a power loss under the async flush policy, docs/storage.md)."""
        state = merge_committed(state, await self.store.get_offsets(state.client_id))
        state, moved = clamp_to_heads(state, await self._heads(sub.queue for sub in state.subscriptions))
        if moved and log:
            LOGGER.warning("session offsets past the end of their queues were pulled back (records lost in a"
                           " power loss under the async flush policy)",
                           extra={"ctx": {"client_id": state.client_id, "moved": moved}})
        return state

    def _refuse_unavailable(self, connection: Connection, exc: ConnectionError) -> None:
        """Answer a CONNECT the store cannot serve now with Server unavailable (MQTT 5: 0x88, 3.1.1: return code 3).

        The outage is logged once, and its end once (by ``_log_outage_end``): not a line per CONNECT.
        """
        self._unavailable += 1
        if self._unavailable == 1:
            LOGGER.warning("store unavailable: CONNECTs are answered Server unavailable until it is back: %s", exc)
            self.nursery.start_soon(self._log_outage_end)
        connection.feed(SessionOpened(False, reason=ReasonCode.SERVER_UNAVAILABLE))

    async def _log_outage_end(self) -> None:
        await self.store.wait_available()
        LOGGER.info("store available again: CONNECTs are accepted", extra={"ctx": {"refused": self._unavailable}})
        self._unavailable = 0

    async def _authenticate(self, connection: Connection, action: OpenSession) -> AuthDecision:
        """Decide the CONNECT; a refusal is counted, logged (never with the password) and delayed (brute force).

        The delay sleeps in this connection's worker, so it holds back only this client.
        """
        self._refresh_auth_files()
        authenticator = self._authenticator
        if self._identity_as_username:  # mTLS: the verified certificate is the credential, nothing to guess
            identity = connection.cert_identity
            decision = AuthDecision(True, ReasonCode.SUCCESS, identity) if identity else AuthDecision(
                False, ReasonCode.NOT_AUTHORIZED, None, why="no verified client certificate with a CN")
        elif action.username is not None and authenticator.passwords is not None:  # argon2: ~50 ms of CPU
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
        self.auth_counters.refused(action.client_id, connection.peer, action.username, decision.reason)
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

    def _limit_hit(self, connection: Connection, hit: LimitHit) -> None:
        """Count a client's limit hit; log it with the client id when the channel says a line is due."""
        total = self.limit_counters.add(hit.limit, hit.count)
        if hit.log is not None:
            LOGGER.warning("limit %s hit: %s", hit.limit.value, hit.log,
                           extra={"ctx": {"client_id": connection.client_id, "peer": connection.peer,
                                          "limit": hit.limit.value, "total": total}})

    def _denied(self, connection: Connection, access: Access, topic: str, why: str) -> None:
        self.auth_counters.acl_denials += 1
        LOGGER.warning("%s denied by the ACL: %s", access.value, why,
                       extra={"ctx": {"client_id": connection.client_id, "username": connection.username,
                                      "topic": topic, "acl_denials": self.auth_counters.acl_denials}})

    def _suspend_unauthorised(self, connection: Connection, state: SessionState) -> SessionState:
        """The resumed session without the subscriptions this connection may not make (docs/security.md).

        The client id may now log in as another user, or the ACL may have changed while it was away;
        subscriptions are the model of what a client may receive, so they are checked again here. The ones
        refused are suspended, not removed: they stay held in the store with their offsets, and every save of
        the session while this connection has it puts them back (``_save``), so a later connection of a user who
        may make them resumes them with what was published meanwhile.
        """
        self._suspended.pop(state.client_id, None)
        acl = self._current_acl()
        if acl is None:
            return state
        user = connection.username
        denied = {sub.filter for sub in state.subscriptions
                  if not acl.check(user, state.client_id, Access.SUBSCRIBE, sub.filter)}
        if not denied:
            return state
        for filter in sorted(denied):
            self._denied(connection, Access.SUBSCRIBE, filter, "subscription of the resumed session suspended")
        kept, self._suspended[state.client_id] = _split(state, denied)
        return kept

    def _whole(self, state: SessionState) -> SessionState:
        """A connection's session state with the subscriptions suspended for its user put back."""
        suspended = self._suspended.get(state.client_id)
        return state if suspended is None else _rejoin(state, suspended)

    async def _save(self, state: SessionState, epoch: int | None = None) -> None:
        state = self._whole(state)
        self._sessions[state.client_id] = state
        if state.expiry_s > 0:  # on a full disk the save waits for room (owed): it then stores the latest state
            await self.owed.attempt(state.client_id, functools.partial(self._store_session, state.client_id, epoch),
                                    key=SaveSession)
        else:
            self._answer_saves(state.client_id)

    async def _store_session(self, client_id: str, epoch: int | None) -> None:
        """Store the session's latest state (if it is still a persistent one of this node), then answer the saves
        waiting for it: the latest state covers each of them."""
        state = self._sessions.get(client_id)
        if state is not None and state.expiry_s > 0:
            await self.store.save_session(client_id, encode_session(state), epoch=epoch)
        self._answer_saves(client_id)

    def _answer_saves(self, client_id: str) -> None:
        for connection, ref in self._save_waiters.pop(client_id, ()):
            connection.feed(SessionSaved(ref))

    async def drop_session(self, client_id: str, epoch: int | None = None) -> None:
        """End a session: its state, its stored blob, its filters and offsets go.

        ``epoch``: the store lease the decision was made under (None: now); the store refuses it once ended.

        Raises:
            LogFullError: the data disk is full: nothing was deleted (a full disk that starts midway leaves the
                rest for a second call).
        """
        await self.store.drop_session(client_id, epoch=epoch)  # first: on a full disk the session stays whole
        self._sessions.pop(client_id, None)
        self._suspended.pop(client_id, None)
        self._cancel(self._expiries, client_id)
        await self.groups.drop_subscriber(client_id)
        await self.commits.forget(client_id)  # an offset written after the delete would keep its queues referenced
        await self.store.delete_owner(client_id, epoch=epoch)

    async def _drop_when_room(self, client_id: str, drop: Write | None = None, *, epoch: int | None = None) -> bool:
        """``drop`` (default: :meth:`drop_session`) now, or once the full data disk has room; the session cannot
        resume meanwhile (``_open_session``). True if it was done now."""
        return await self.owed.attempt(client_id, drop or functools.partial(self.drop_session, client_id, epoch),
                                       key=DropSession)

    def _start_expiry(self, client_id: str, expiry_s: int, epoch: int) -> None:
        async def expire(scope: trio.CancelScope) -> None:
            with scope:
                await trio.sleep(expiry_s)
                del self._expiries[client_id]
                if epoch != self.store.epoch:  # the session may live on another node since the lease ended
                    return
                with trio.CancelScope(shield=True):  # a half-dropped session would keep its filters held
                    if not await self._drop_when_room(client_id, functools.partial(self._expire, client_id, epoch)):
                        LOGGER.info("session expiry waits for room on the data disk: the session cannot resume "
                                    "meanwhile", extra={"ctx": {"client_id": client_id}})

        self._later(self._expiries, client_id, expire)

    async def _expire(self, client_id: str, epoch: int | None) -> None:
        await self.drop_session(client_id, epoch)
        LOGGER.info("session expired", extra={"ctx": {"client_id": client_id}})

    def _later(self, table: dict[str, trio.CancelScope], client_id: str, job: Any) -> None:
        self._cancel(table, client_id)
        scope = trio.CancelScope()
        table[client_id] = scope
        self.nursery.start_soon(job, scope)

    @staticmethod
    def _cancel(table: dict[str, trio.CancelScope] | dict[str, _DelayedWill], client_id: str) -> None:
        scope = table.pop(client_id, None)
        if scope is not None:
            scope.cancel()

    # --- wills --------------------------------------------------------------------------

    async def _hold_will(self, client_id: str, action: OpenSession, epoch: int) -> None:
        """Have the store hold the new connection's will (a cluster store publishes it if this node dies), or
        drop the one it holds for the client: the session resumed, so an earlier connection's delayed will is off."""
        if action.will is not None:
            await self.store.hold_will(client_id, to_new_message(action.will), action.will_delay_s, epoch=epoch)
        else:
            await self.store.drop_will(client_id, epoch=epoch)

    async def _drop_will(self, client_id: str, epoch: int | None) -> None:
        if client_id not in self._connections and client_id not in self._wills:  # else a newer connection's
            self.store.absent(client_id, epoch=epoch)
            await self.store.drop_will(client_id, epoch=epoch)

    async def _publish_will(self, action: PublishWill, epoch: int | None) -> None:
        """Publish a will without delay at once, in the closing connection's worker: a takeover waits for that
        connection to finish, so the will is out before the new connection's session opens [MQTT-3.1.2-8].
        A delayed will waits in a task, cancelled if the session resumes first."""
        client_id = action.client_id
        if action.delay_s <= 0:
            await self._will_now(client_id, action.message, epoch)
            return
        self._cancel(self._wills, client_id)
        delayed = self._wills[client_id] = _DelayedWill(action.message, epoch)

        async def publish() -> None:
            with delayed.scope:
                await trio.sleep(action.delay_s)
                del self._wills[client_id]
                await self._will_now(client_id, action.message, epoch)

        self.nursery.start_soon(publish)

    async def _will_now(self, client_id: str, message: Message, epoch: int | None) -> None:
        if epoch is not None and epoch != self.store.epoch:  # the lease ended: the store published the will it
            return  # held, or the client resumed elsewhere
        reason = await self.append_messages([message], epoch)
        while reason is ReasonCode.QUOTA_EXCEEDED:  # a full disk: the will, due now [MQTT-3.1.2-8], waits for room
            await trio.sleep(FULL_RETRY_S)  # (a session resuming meanwhile does not cancel it)
            reason = await self.append_messages([message], epoch, count=False)
        if reason is not None:
            LOGGER.error("will not published: %s", reason.name, extra={"ctx": {"client_id": client_id}})
        else:
            await self._drop_will(client_id, epoch)  # published here: the store must not publish it again

    # --- messages -----------------------------------------------------------------------

    async def append_messages(self, messages: Sequence[Message], epoch: int | None = None, *,
                              count: bool = True) -> ReasonCode | None:
        """Append the node's own messages (wills, ``$SYS``, HTTP publish) through the store (durable under the sync
        flush policy), after the activations read before this call (gateway/node/order.py); None or why it failed."""
        await self.order.wait(self.order.mark())
        offsets = await self._append_batch(messages, epoch, count=count)
        return offsets if isinstance(offsets, ReasonCode) else None

    async def _append_batch(self, messages: Sequence[Message], epoch: int | None = None, *,
                            count: bool = True) -> list[int] | ReasonCode:
        """The messages' CommitLog offsets once appended, or why the append failed (a connection's appends were
        ordered when read: ``AfterReads``).

        ``epoch``: the store lease of the connection they come from (None: now); refused once it ended.
        A failure counts the messages in ``refused_by_qos`` (unless ``count`` is False: a retry). A full disk is
        QUOTA_EXCEEDED and not logged here: the store logs the episode once (store/space.py), not once per publish.
        """
        batch = [to_new_message(m) for m in messages]
        try:
            return await self.store.append(batch, epoch=epoch)
        except RecordTooLarge as exc:
            LOGGER.warning("append refused: %s", exc)
            reason = ReasonCode.PACKET_TOO_LARGE
        except LogFullError:
            reason = ReasonCode.QUOTA_EXCEEDED
        except ConnectionError:  # the store is unreachable (its client logs that once) or the lease ended
            reason = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        except (OSError, ValueError) as exc:
            LOGGER.error("append failed: %r", exc)
            reason = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        for message in messages if count else ():
            self.refused_by_qos[message.qos] += 1
        return reason

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
        offsets = await self._append_batch(messages, self._epochs.get(connection)) if messages else []
        if isinstance(offsets, ReasonCode) and allowed.count(True) > 1:
            # One bad message must not fail its neighbours: retry one by one so each gets its own answer.
            for append, ok in zip(appends, allowed):
                await self._store(connection, [append], [ok])
            return
        connection.feed_all(_answers(appends, allowed, offsets))

    def append_now(self, connection: Connection, action: Append) -> bool:
        """Append without a worker task when the store can without waiting (embedded, async flush: see
        ``StoreClient.append_now``) and no ACL applies; False leaves the append, and any error, to ``perform``.

        During a read round (gateway/node/poller.py) the append joins the round's batch: :meth:`_end_round` writes
        the appends of all the round's connections in one store call, before any other task runs. The round's
        first append asks the ACL and the store for all of them (per message, that was 3% of a fan-in's CPU).
        """
        if self.order.fenced:  # an activation read before it is not applied yet: ``perform`` waits for it
            return False
        if self._round:
            self._round.append((connection, action))
            return True
        if self._current_acl() is not None or not self.store.can_append_now():
            return False
        if self.reads.in_round:
            self._round.append((connection, action))
            return True
        return self._append_now([(connection, action)])

    def _end_round(self) -> None:
        """The end of a read round: its appends in one batch, or, if the store cannot take them now, each
        connection's back to the head of its queue of node actions (``perform`` answers them)."""
        appends = self._round
        if appends:
            self._round = []
            if not self._append_now(appends):
                for connection, actions in _by_connection(appends).items():
                    connection.requeue(actions)

    def _append_now(self, appends: list[tuple[Connection, Append]]) -> bool:
        """Append now and acknowledge, one write per connection; False: nothing was appended."""
        try:
            offsets = self.store.append_now([to_new_message(m) for _, append in appends for m in append.messages])
        except (OSError, ValueError):
            return False  # nothing was appended: ``perform`` tries again and answers with the reason
        if offsets is None:
            return False
        acknowledged: dict[Connection, list[Event]] = {}  # QoS 0 appends (no ref) wait for no answer
        position = 0
        for connection, append in appends:
            if append.ref is not None:
                acknowledged.setdefault(connection, []).append(
                    Appended(append.ref, True, ReasonCode.SUCCESS, offsets[position]))
            position += len(append.messages)
        for connection, events in acknowledged.items():
            connection.feed_all(events)
        return True

    async def _release_inbound(self, connection: Connection, releases: list[ReleaseInbound]) -> None:
        """Record the releases of inbound QoS 2 flows durably, in one store write; then their PUBCOMPs may go."""
        await self.store.release_awaiting([(r.client_id, r.packet_id, r.offset) for r in releases])
        connection.feed_all([InboundReleased(r.ref) for r in releases])

    def append_mark(self) -> int | None:
        """The read-order mark for an append read now and left to ``perform``; None when nothing waits."""
        return self.order.mark() if self.order.fenced else None

    def activation_read(self, connection: Connection, action: Activate) -> None:
        """Open the activation's fence: appends read from now on are written after ``_activate`` applied it."""
        self._fences.setdefault(connection, {})[action.ref] = self.order.open()

    def _activation_applied(self, connection: Connection, action: Activate) -> None:
        """Close the activation's fence (idempotent)."""
        fences = self._fences.get(connection)
        fence = fences.pop(action.ref, None) if fences is not None else None
        if fence is not None:
            self.order.close(fence)

    def pull_cached(self, connection: Connection, action: Pull) -> Pulled | None:
        """A pull at the head of an unshared queue, answered from the queue cache; None if it must wait or read."""
        if action.group is not None:
            return None
        hit = self.cache.get(action.queue, action.from_offset, action.max_count)
        return None if hit is None else Pulled(action.filter, tuple(hit[0]), hit[1])

    async def _pull(self, connection: Connection, action: Pull) -> None:
        if action.group is not None:
            await self.groups.pull(connection, action)
            return
        messages, next_offset, _ = await self.cache.read(action.queue, action.from_offset, action.max_count)
        connection.feed(Pulled(action.filter, tuple(messages), next_offset))

    # --- subscriptions ------------------------------------------------------------------

    async def _retained_for(self, action: Activate, starts: Mapping[str, int]) -> tuple[tuple[str, Message], ...]:
        """The retained messages for the new subscriptions that want them now.

        The channel already applied MQTT 5 retain handling (``action.retained``);
        shared subscriptions never get retained messages (MQTT 5.0, section 4.8.2).
        """
        wanted = set(action.retained)
        found: list[tuple[str, Message]] = []
        for sub in action.subscriptions:
            if sub.filter in wanted and sub.filter in starts and sub.group is None:
                found += ((sub.filter, from_record(record, None, None)) for record in await self.store.retained(sub.queue))
        return tuple(found)

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
                await self.owed.settle(holder)  # a release owed by an earlier UNSUBSCRIBE must not undo this one
                start = await self.store.activate(sub.queue, holder)
                if sub.group is not None:
                    await self.groups.join(connection, sub, start)
                starts[sub.filter] = start
            except TopicError as exc:
                LOGGER.warning("subscription refused: %s", exc, extra={"ctx": {"client_id": action.client_id}})
                reasons[sub.filter] = ReasonCode.TOPIC_FILTER_INVALID
            except ValueError as exc:
                LOGGER.error("subscription failed: %s", exc, extra={"ctx": {"client_id": action.client_id}})
                reasons[sub.filter] = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
            except LogFullError:  # the store logged the full disk once
                reasons[sub.filter] = ReasonCode.QUOTA_EXCEEDED
        self._activation_applied(connection, action)  # the starts are fixed: the appends read after it may go
        retained = await self._retained_for(action, starts)
        connection.feed(Activated(action.ref, starts, retained, reasons or None))
        for sub in action.subscriptions:
            if sub.filter in starts:
                self._subscribe_local(connection, sub.queue)

    async def _release(self, connection: Connection, client_id: str, filters: tuple[str, ...]) -> None:
        """The session no longer has these subscriptions; on a full disk the store's releases wait for room."""
        for filter in filters:
            shared = parse_shared(filter)
            if shared is None:
                await self.owed.attempt(client_id, functools.partial(self.store.release, filter, client_id,
                                                                     epoch=self._epochs.get(connection)))
                self._unsubscribe_local(connection, filter)
                continue
            self._unsubscribe_local(connection, shared[1])
            await self.groups.unsubscribe(connection, client_id, shared)

    async def _commit(self, connection: Connection, action: CommitOffsets) -> None:
        offsets: dict[str, int] = {}
        for filter, offset in action.offsets.items():
            shared = parse_shared(filter)
            if shared is None:
                offsets[filter] = offset
                continue
            try:
                await self.groups.acknowledged(connection, shared, offset)
            except LogFullError:  # the group's offset stays behind; a later acknowledgement moves it
                pass
        if offsets:
            self.commits.post(action.client_id, offsets, self._epochs.get(connection))
        LOGGER.debug("offsets committed", extra={"ctx": {"client_id": action.client_id, "offsets": action.offsets}})

    def _subscribe_local(self, connection: Connection, queue: str) -> None:
        held = self._held.setdefault(connection, set())
        if queue in held:
            return
        held.add(queue)
        self._local.setdefault(queue, set()).add(connection)
        self.store.watch(queue)
        self.cache.watch(queue)

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
        self.store.unwatch(queue)
        self.cache.unwatch(queue)

    # --- $SYS ---------------------------------------------------------------------------

    async def sys_messages(self) -> list[Message]:
        """The node's ``$SYS/broker/`` tree (gateway/node/system.py) as retained QoS 0 messages."""
        traffic = self.traffic
        statistics = await self.store.statistics()
        online, offline = self.session_counts()
        figures = SysFigures(
            uptime_s=self.uptime_s(), connected=online, disconnected=offline, maximum=self._peak_connections,
            subscriptions=self._subscription_count(),
            retained=statistics.retained, store_bytes=statistics.log_bytes,
            messages_received=traffic.messages_in, messages_sent=traffic.messages_out,
            bytes_received=traffic.bytes_in, bytes_sent=traffic.bytes_out)
        now_ms = int(time.time() * 1000)
        return [Message(topic, payload, 0, True, born_ms=now_ms)
                for topic, payload in self._sys_tree.topics(figures, time.monotonic()).items()]

    def _subscription_count(self) -> int:
        """The subscriptions of the clients connected here and of the persistent sessions saved here."""
        connected = self._connections
        live = sum(session.subscription_count for connection in connected.values()
                   if (session := connection.channel.session) is not None)
        return live + sum(len(state.subscriptions) for client_id, state in self._sessions.items()
                          if client_id not in connected)

    async def publish_sys(self, interval_s: float) -> None:
        """Append the statistics now and every ``interval_s`` until cancelled."""
        while True:
            try:
                reason = await self.append_messages(await self.sys_messages())
            except ConnectionError:  # the store is unreachable: its client logs the outage once
                reason = None
            if reason is not None and reason is not ReasonCode.QUOTA_EXCEEDED:  # a full disk: logged by the store
                LOGGER.error("$SYS statistics not published: %s", reason.name)
            await trio.sleep(interval_s)

    # --- administration -----------------------------------------------------------------

    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    def session_counts(self) -> tuple[int, int]:
        """(online, offline): connected clients, and the persistent sessions saved here that wait for theirs."""
        offline = sum(1 for client_id, state in self._sessions.items()
                      if state.expiry_s > 0 and client_id not in self._connections)
        return len(self._connections), offline

    def clients(self) -> list[ClientInfo]:
        """The connected clients."""
        return [_client_info(connection) for connection in self._connections.values()]

    async def client_info(self, client_id: str) -> ClientInfo | dict[str, Any] | None:
        """The connected client, here or on another node (its answer, as JSON); None when it is not connected.

        Raises:
            OSError: the store, or the node the client is connected to, did not answer.
        """
        connection = self._connections.get(client_id)
        if connection is not None:
            return _client_info(connection)
        return await self._ask_owner(client_id, AdminOp.CLIENT)

    async def _ask_owner(self, client_id: str, op: AdminOp) -> Any:
        """The answer of the node ``client_id`` is connected to (through the store's presence), decoded from JSON;
        None when it is connected to no other node."""
        answer = await self.store.admin_call(client_id, op.value)
        return None if answer is None else msgspec.json.decode(answer)

    async def answer_admin_asks(self) -> None:
        """Answer the admin calls other nodes make about clients connected here, until the store client closes."""
        while True:
            try:
                ask_id, client_id, op, query = await self.store.admin_asks()
            except trio.EndOfChannel:
                return
            self.nursery.start_soon(self._answer_admin, ask_id, client_id, AdminOp(op), query)

    async def _answer_admin(self, ask_id: int, client_id: str, op: AdminOp, query: bytes = b"") -> None:
        """One admin call of another node: answered from this node only (never forwarded again); None when the
        client is not connected here (it moved since). A list call (gateway/ops/clusterlists.py) lists this node."""
        answer: Any = None
        try:
            connection = self._connections.get(client_id)
            if op in LIST_OPS:
                answer = await list_here(self, op, query)
            elif connection is not None and op is AdminOp.CLIENT:
                answer = _client_info(connection)
            elif connection is not None and op is AdminOp.SESSION:
                state = self._session_state(client_id)
                if state is not None:
                    answer = self._session_info(state, await self._heads(sub.queue for sub in state.subscriptions))
            elif op is AdminOp.DISCONNECT:
                answer = await self._disconnect_here(client_id) or None
            elif op is AdminOp.DELETE_SESSION and connection is not None:
                answer = await self._delete_here(client_id)
        except Exception as exc:  # the asking node gets "not here"; this node goes on
            LOGGER.error("admin call of another node failed: %r", exc, exc_info=exc,
                         extra={"ctx": {"client_id": client_id, "op": op.value}})
            answer = None
        self.store.admin_answer(ask_id, None if answer is None else msgspec.json.encode(answer))

    async def shutdown(self) -> None:
        """Stop serving clients (SIGTERM): each connected client is told (MQTT 5: DISCONNECT 0x8B, Server shutting
        down) and its session saved as at any close; returns once they are closed or ``SHUTDOWN_S`` passed.

        Wills are not published here: the store keeps the ones it holds, as when a node dies (docs/cluster.md).
        """
        self._stopping = True
        connections = list(self._connections.values())
        LOGGER.info("disconnecting clients: the server is shutting down", extra={"ctx": {"clients": len(connections)}})
        for connection in connections:
            connection.feed(ServerShutdown())
        with trio.move_on_after(SHUTDOWN_S):
            for connection in connections:
                await connection.wait_finished()

    async def disconnect(self, client_id: str) -> bool:
        """Close the client's connection as an administrative action (MQTT 5: DISCONNECT 0x98), on whichever node
        it is connected to.

        As for any close the client did not ask for, its will is published and
        a persistent session stays. Returns once the connection is gone; False
        when the client is not connected.

        Raises:
            OSError: the store, or the node the client is connected to, did not answer.
        """
        if client_id in self._connections:
            return await self._disconnect_here(client_id)
        return await self._ask_owner(client_id, AdminOp.DISCONNECT) is not None

    async def _disconnect_here(self, client_id: str) -> bool:
        connection = self._connections.get(client_id)
        if connection is None:
            return False
        LOGGER.info("disconnecting a client (admin API)", extra={"ctx": {"client_id": client_id}})
        connection.feed(AdminDisconnect())
        with trio.move_on_after(TAKEOVER_TIMEOUT_S):
            await connection.wait_finished()
        return True

    async def sessions(self) -> list[SessionInfo]:
        """The sessions this node knows (connected, and persistent ones saved here), with their lags."""
        states = [state for client_id in {*self._connections, *self._sessions}
                  if (state := self._session_state(client_id)) is not None]
        heads = await self._heads(sub.queue for state in states for sub in state.subscriptions)
        return [self._session_info(state, heads) for state in states]

    async def session_info(self, client_id: str) -> SessionInfo | dict[str, Any] | None:
        """One session: live on the node its client is connected to (this one or another: its answer, as JSON),
        else as this node or the store keeps it (saved by another node, or before a restart).

        Raises:
            msgspec.DecodeError: the stored session is unreadable.
            OSError: the store, or the node the client is connected to, did not answer.
        """
        if client_id not in self._connections:
            live = await self._ask_owner(client_id, AdminOp.SESSION)
            if live is not None:
                return live
        state = self._session_state(client_id)
        if state is None:
            blob = await self.store.load_session(client_id)
            if blob is None:
                return None
            state = await self._resumed(decode_session(blob))
        return self._session_info(state, await self._heads(sub.queue for sub in state.subscriptions))

    async def delete_session(self, client_id: str) -> bool:
        """End a session now, its client disconnected first (on whichever node it is connected to); False when
        there is no such session.

        Raises:
            OSError: the store, or the node the client is connected to, did not answer.
        """
        if client_id not in self._connections and await self._ask_owner(client_id, AdminOp.DELETE_SESSION):
            return True  # that node disconnected it and ended the session
        known = client_id in self._connections or client_id in self._sessions \
            or await self.store.load_session(client_id) is not None
        return await self._delete_here(client_id) if known else False

    async def _delete_here(self, client_id: str) -> bool:
        await self._disconnect_here(client_id)
        done = await self._drop_when_room(client_id)
        LOGGER.info("session deleted (admin API)", extra={"ctx": {"client_id": client_id, "waits_for_room": not done}})
        return True

    async def queues(self) -> list[QueueInfo]:
        """The queues this node's sessions and shared groups read, with the slowest consumer's lag."""
        committed: dict[str, list[int]] = {}
        for client_id in {*self._connections, *self._sessions}:
            state = self._session_state(client_id)
            for sub in state.subscriptions if state is not None else ():
                if sub.group is None:  # a shared subscription's offset is its group's, counted below
                    committed.setdefault(sub.queue, []).append(state.offsets.get(sub.filter, 0))
        for group in self.groups:
            committed.setdefault(group.queue, []).append(group.committed_offset())
        heads = await self._heads(committed)
        return [QueueInfo(queue, heads[queue], len(offsets), min(offsets), max(0, heads[queue] - min(offsets)))
                for queue, offsets in sorted(committed.items())]

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
        reason = await self.append_messages([Message(topic, b"", 0, True, client_id=ADMIN_CLIENT_ID,
                                                     born_ms=int(time.time() * 1000))])
        if reason is not None:
            raise OSError(f"the empty retained message was not stored: {reason.name}")
        LOGGER.info("retained message deleted (admin API)", extra={"ctx": {"topic": topic}})
        return True

    async def authenticate_http(self, username: str | None, password: bytes | None, source: str) -> AuthDecision:
        """Decide the credentials of an HTTP publish as a CONNECT's: counted, logged and delayed when refused."""
        self._refresh_auth_files()
        authenticator = self._authenticator
        if username is not None and authenticator.passwords is not None:  # argon2: ~50 ms of CPU
            decision = await trio.to_thread.run_sync(authenticator.authenticate, username, password, source,
                                                     limiter=self._auth_threads)
        else:
            decision = authenticator.authenticate(username, password, source)
        if decision.accepted:
            return decision
        self.auth_counters.refused(None, source, username, decision.reason)
        LOGGER.warning("HTTP publish refused: %s", decision.why,
                       extra={"ctx": {"peer": source, "reason": decision.reason.name, "delay_s": decision.delay_s,
                                      "auth_failures": self.auth_counters.auth_failures}})
        await trio.sleep(decision.delay_s)
        return decision

    async def publish(self, topic: str, payload: bytes, qos: int, retain: bool, username: str | None,
                      source: str, properties: Properties = EMPTY_PROPERTIES) -> ReasonCode | None:
        """Publish for an HTTP client (``username`` authenticated, None: anonymous) through the normal path.

        The ACL's publish rules apply as to an MQTT client of that user; HTTP
        publishers have no client id, so ``client`` rules and ``%c`` patterns
        never match them. Returns None when stored, NOT_AUTHORIZED, or the
        append's failure (PACKET_TOO_LARGE, ...).

        Raises:
            TopicError: not a valid topic name, or beyond the topic limits.
        """
        config = self.channel_config
        validate_topic(topic, TopicLimits(config.max_topic_length, config.max_topic_levels))
        acl = self._current_acl()
        if acl is not None and not acl.check(username, None, Access.PUBLISH, topic):
            self.auth_counters.acl_denials += 1
            LOGGER.warning("publish denied by the ACL: HTTP publish refused",
                           extra={"ctx": {"peer": source, "username": username, "topic": topic,
                                          "acl_denials": self.auth_counters.acl_denials}})
            return ReasonCode.NOT_AUTHORIZED
        message = Message(topic, payload, qos, retain, properties, client_id=HTTP_CLIENT_ID,
                          born_ms=int(time.time() * 1000))
        reason = await self.append_messages([message])
        if reason is None:
            self.traffic.messages_in += 1
            self.traffic.messages_in_by_qos[qos] += 1
        return reason

    def _session_state(self, client_id: str) -> SessionState | None:
        """The session as it stands: live for a connected client, else the persistent state saved here."""
        connection = self._connections.get(client_id)
        session = connection.channel.session if connection is not None else None
        if session is not None:
            return self._whole(session.state())
        state = self._sessions.get(client_id)
        return state if state is not None and state.expiry_s > 0 else None

    def _session_info(self, state: SessionState, heads: Mapping[str, int]) -> SessionInfo:
        subscriptions = []
        for sub in state.subscriptions:
            group = self.groups.get(sub.group, sub.queue) if sub.group is not None else None
            offset = group.committed_offset() if group is not None else state.offsets.get(sub.filter, 0)
            head = heads[sub.queue]
            subscriptions.append(SubscriptionLag(sub.filter, sub.queue, sub.options.qos, sub.group, offset, head,
                                                 max(0, head - offset)))
        return SessionInfo(state.client_id, state.client_id in self._connections, state.expiry_s,
                           len(state.inflight), sum(s.lag for s in subscriptions), tuple(subscriptions))

    async def _heads(self, queues: Iterable[str]) -> dict[str, int]:
        """``{queue: max offset}``, in one store call."""
        names = sorted(set(queues))
        return dict(zip(names, await self.store.max_offsets(names))) if names else {}

    # --- notify -------------------------------------------------------------------------

    async def consume_events(self) -> None:
        """Have the cache read the news, then feed ``QueueAdvanced`` to the local connections on each queue.

        Runs until the store client's events end.
        """
        while True:
            try:
                events = await self.store.events()
            except trio.EndOfChannel:
                return
            try:
                await self.cache.fill(events)
            except ConnectionError as exc:  # the store went away mid-read: sessions read the news themselves
                LOGGER.warning("queue cache not filled: %r", exc, extra={"ctx": {"queues": len(events)}})
            except Exception as exc:  # the store failed the read: the sessions' own reads meet it, not the node
                LOGGER.error("queue cache not filled: %r", exc, extra={"ctx": {"queues": len(events)}})
            for queue, max_offset in events.items():
                for connection in tuple(self._local.get(queue, ())):
                    connection.feed(QueueAdvanced(queue, max_offset))

    async def consume_moves(self) -> None:
        """Clients of this node that connected to another node: close them here (a takeover, MQTT 5 reason
        0x8E) and cancel the delayed wills waiting here for them (their sessions resumed there).

        Runs until the store client's notices end.
        """
        while True:
            try:
                moved = await self.store.moved()
            except trio.EndOfChannel:
                return
            for client_id in moved:
                self._cancel(self._wills, client_id)
                connection = self._connections.get(client_id)
                if connection is not None:
                    connection.feed(TakenOver(elsewhere=True))

    async def consume_fences(self) -> None:
        """When the store says this node's lease ended (it was frozen or cut off longer than the lease): close the
        connections accepted under the ended lease as taken over (MQTT 5: DISCONNECT 0x8E), writing nothing for
        them (``perform`` drops their actions: no will, no append, no commit, no session write), and forget the
        sessions kept in memory, which other nodes may have changed since.

        The newest connection wins: the clients' wills were published by the store when the lease ended, or
        cancelled when they connected to another node. Runs until the store client's notices end.
        """
        while True:
            try:
                ended = await self.store.fenced()
            except trio.EndOfChannel:
                return
            current = self.store.epoch
            stale = [c for c in self._connections.values() if self._epochs.get(c) != current]
            live = {client_id for client_id, c in self._connections.items() if self._epochs.get(c) == current}
            for client_id in [c for c in self._sessions if c not in live]:
                del self._sessions[client_id]
            LOGGER.warning("store lease lost: closing the connections of the ended lease without a will or a write",
                           extra={"ctx": {"ended_epoch": ended, "epoch": current, "connections": len(stale)}})
            for connection in stale:
                connection.feed(TakenOver(elsewhere=True))


def _split(state: SessionState, filters: set[str]) -> tuple[SessionState, SessionState]:
    """``state`` without the subscriptions of ``filters``, and those subscriptions with their offsets, cursors
    and messages in flight."""
    def part(inside: bool) -> SessionState:
        return replace(
            state,
            subscriptions=tuple(sub for sub in state.subscriptions if (sub.filter in filters) is inside),
            offsets={f: o for f, o in state.offsets.items() if (f in filters) is inside},
            cursors={f: o for f, o in state.cursors.items() if (f in filters) is inside},
            inflight=tuple(i for i in state.inflight if (i.filter in filters) is inside),
            lanes={f: lane for f, lane in state.lanes.items() if (f in filters) is inside},
        )

    return part(False), part(True)


def _rejoin(state: SessionState, suspended: SessionState) -> SessionState:
    """A connection's session state with its suspended subscriptions (``_split``) put back.

    A subscription the connection made meanwhile on the same filter wins. A message in flight on a suspended
    subscription whose packet id the connection has reused (after 65,535 others) is dropped from the flight
    and its subscription's cursor moved back to it: it is delivered again rather than lost. A suspended
    subscription's lane of packet ids comes back unless the connection gave it to another subscription.
    """
    live = {sub.filter for sub in state.subscriptions}
    subscriptions = tuple(sub for sub in suspended.subscriptions if sub.filter not in live)
    if not subscriptions:
        return state
    back = {sub.filter for sub in subscriptions}
    cursors = {f: o for f, o in suspended.cursors.items() if f in back}
    used = {entry.packet_id for entry in state.inflight}
    inflight = []
    for entry in suspended.inflight:
        if entry.filter not in back:
            continue
        if entry.packet_id in used:
            cursors[entry.filter] = min(cursors.get(entry.filter, entry.offset), entry.offset)
            continue
        inflight.append(entry)
    return replace(
        state,
        subscriptions=state.subscriptions + subscriptions,
        offsets={**state.offsets, **{f: o for f, o in suspended.offsets.items() if f in back}},
        cursors={**state.cursors, **cursors},
        inflight=state.inflight + tuple(inflight),
        lanes={**state.lanes, **{f: lane for f, lane in suspended.lanes.items()
                                 if f in back and lane not in state.lanes.values()}},
    )


def _by_connection(appends: list[tuple[Connection, Append]]) -> dict[Connection, list[Append]]:
    """The appends of each connection, in their order."""
    grouped: dict[Connection, list[Append]] = {}
    for connection, append in appends:
        grouped.setdefault(connection, []).append(append)
    return grouped


def _answers(appends: Sequence[Append], allowed: Sequence[bool], offsets: list[int] | ReasonCode) -> list[Event]:
    """``Appended`` for each append with a ref: where the store put it, or why it did not."""
    answers: list[Event] = []
    index = 0
    for append, ok in zip(appends, allowed):
        count = len(append.messages) if ok else 0
        if append.ref is not None:
            if not ok:
                answers.append(Appended(append.ref, False, ReasonCode.NOT_AUTHORIZED))
            elif isinstance(offsets, ReasonCode):
                answers.append(Appended(append.ref, False, offsets))
            else:
                answers.append(Appended(append.ref, True, ReasonCode.SUCCESS, offsets[index] if count else -1))
        index += count
    return answers


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


def _channel_config(settings: Mapping[str, Any]) -> ChannelConfig:
    return ChannelConfig(
        max_packet_size=settings["mqtt.max_packet_size"],
        max_connect_size=min(settings["mqtt.max_connect_size"], settings["mqtt.max_packet_size"]),
        receive_maximum=settings["mqtt.receive_maximum"],
        default_receive_maximum=settings["mqtt.inflight_311"],
        max_keepalive=settings["mqtt.max_keepalive"] or None,
        reason_strings=True,
        max_topic_length=settings["limits.max_topic_length"],
        max_topic_levels=settings["limits.max_topic_levels"],
        max_subscriptions=settings["limits.max_subscriptions"],
        max_user_properties=settings["limits.max_user_properties"],
        max_user_property_bytes=settings["limits.max_user_property_bytes"],
        publish_rate=settings["limits.publish_rate"],
        publish_burst=settings["limits.publish_burst"],
        publish_bytes_rate=settings["limits.publish_bytes_rate"],
        qos0_queue_bytes=settings["limits.qos0_queue_bytes"],
    )


@dataclass
class Running:
    """The node a ``serve_*`` call runs, filled in before it reports ready: what signals act on."""

    node: GatewayNode | None = None
    front: NodeFront | None = None


async def serve_gateway(
    settings: Mapping[str, Any],
    *,
    running: Running | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the embedded node until cancelled: store, notify, MQTT listener.

    ``task_status.started`` receives the (host, port) listened on (port 0 picks a free one); ``running``, if given,
    the node first.

    Raises:
        PasswordFileError, AclError: the configured password or ACL file is missing or malformed
            (checked before the store opens).
        ListenerError: a TLS certificate, key or CA file is missing or unreadable (also before the store opens).
    """
    front = NodeFront.from_settings(settings)
    data = Path(settings["node.data"])
    async with open_store(data, CommitLogConfig.from_settings(settings), tier=settings,
                          fix_session=clamp_session_blob) as store:
        LOGGER.info("store node ready", extra={"ctx": {"data": str(data),
                                                       "written_offset": store.log.log.written_offset}})
        client = LocalStoreClient(store)
        try:
            await serve_node(settings, client, front, flush_latency=store.log.flush_latency, running=running,
                             task_status=task_status)
        finally:
            client.close()


@dataclass(frozen=True)
class NodeFront:
    """What a gateway node loads from its settings before it opens or connects to the store.

    Loaded first so that a broken password, ACL or certificate file stops the
    node before it touches the store.
    """

    authenticator: Authenticator
    acl: WatchedFile[Acl] | None
    specs: list[ListenerSpec]
    admission: Admission

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> NodeFront:
        """Raises PasswordFileError, AclError or ListenerError (each names the file)."""
        authenticator = Authenticator.from_config(settings)  # type: ignore[arg-type]  # any mapping of the options
        load = functools.partial(Acl.load, wildcard_mode=settings["auth.acl_wildcard_mode"])
        acl = WatchedFile(settings["auth.acl_file"], load) if settings["auth.acl_file"] else None
        LOGGER.info("authentication ready", extra={"ctx": {
            "password_file": settings["auth.password_file"] or None, "acl_file": settings["auth.acl_file"] or None,
            "allow_anonymous": authenticator.allow_anonymous}})
        return cls(authenticator, acl, listener_specs(settings), Admission.from_config(settings))


async def serve_node(
    settings: Mapping[str, Any],
    store: StoreClient,
    front: NodeFront,
    *,
    flush_latency: LatencyBuckets | None = None,
    running: Running | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a gateway node over ``store`` (embedded or remote) until cancelled: listeners, notify, timers, ``$SYS``,
    and the admin HTTP endpoint (metrics, health, admin API, dashboard; gateway/ops/admin.py) unless ``admin.port`` is 0.

    ``task_status.started`` receives the (host, port) of the plain TCP listener. ``flush_latency`` is the
    CommitLog's flush histogram when the store runs in this process (exported with the node's metrics).
    ``running`` receives the node and its front before "ready".
    """
    async with trio.open_nursery() as nursery:
        node = GatewayNode(store, nursery, _channel_config(settings), settings["mqtt.connect_timeout_s"],
                           authenticator=front.authenticator, acl=front.acl,
                           identity_as_username=settings["auth.use_identity_as_username"])
        nursery.start_soon(node.timers.run)
        nursery.start_soon(node.reads.run)
        nursery.start_soon(node.consume_events)
        nursery.start_soon(node.consume_moves)
        nursery.start_soon(node.consume_fences)
        nursery.start_soon(node.answer_admin_asks)
        nursery.start_soon(trim_freed_memory)
        if settings["mqtt.sys_interval_s"] > 0:
            nursery.start_soon(node.publish_sys, settings["mqtt.sys_interval_s"])
        admin = None
        if settings["admin.port"]:
            metrics = NodeMetrics(node, flush_latency=flush_latency, admission=front.admission, cache=node.cache)
            admin = AdminApi(node, metrics, token=settings["admin.token"])
            admin_port = 0 if settings["node.port"] == 0 else settings["admin.port"]  # several nodes on one machine
            max_body = 2 * settings["mqtt.max_packet_size"]  # room for a payload as base64 in JSON
            listeners = await nursery.start(functools.partial(
                serve_admin, admin, settings["admin.host"], admin_port, max_body=max_body,
                max_connections=settings["admin.max_connections"]))
            admin_host, admin_port = listeners[0].socket.getsockname()[:2]
            LOGGER.info("admin API ready", extra={"ctx": {"host": admin_host, "port": admin_port,
                                                          "token": bool(settings["admin.token"])}})
        bound = await nursery.start(functools.partial(serve_mqtt, node, front.specs, admission=front.admission))
        if admin is not None:
            admin.mqtt_ready = True
        host, port = bound[0].host, bound[0].port  # the plain TCP listener comes first
        if running is not None:
            running.node, running.front = node, front
        LOGGER.info("gateway node ready", extra={"ctx": {"host": host, "port": port,
                                                         **{f"{b.kind}_port": b.port for b in bound[1:]}}})
        task_status.started((host, port))


async def serve_cluster_gateway(
    settings: Mapping[str, Any],
    *,
    running: Running | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a cluster gateway node until cancelled: ``serve_node`` over the store node at ``gateway.store``.

    The node is the embedded one with a ``RemoteStoreClient`` (store/rpc/client.py)
    for its store; its MQTT listeners set SO_REUSEPORT, so several gateway
    processes can share a port (``gateway.workers``, gateway/app/workers.py). The
    store may start later or restart: the client retries until it connects.
    ``task_status.started`` receives the (host, port) of the plain TCP listener.

    Raises:
        PasswordFileError, AclError, ListenerError: as ``serve_gateway`` (before connecting).
        ValueError: ``gateway.store`` is not HOST:PORT.
    """
    from store.rpc.client import RemoteStoreClient  # only cluster gateways need the RPC client

    front = NodeFront.from_settings(settings)
    front = replace(front, specs=[replace(spec, reuse_port=True) for spec in front.specs])
    host, port = parse_address(settings["gateway.store"])
    async with RemoteStoreClient.connect(host, port, timeout_s=None, token=settings.get("store.token", "")) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.log_statistics)
            bound = await nursery.start(functools.partial(serve_node, settings, client, front, running=running))
            task_status.started(bound)


async def _serve_until_signalled(conf: Config, serve: Any = serve_gateway) -> None:
    """Run ``serve`` until SIGINT or SIGTERM (clients told first: ``GatewayNode.shutdown``); reload on SIGHUP."""
    running = Running()
    reloader = Reloader(conf)

    def reload() -> None:
        if running.front is None:
            LOGGER.info("SIGHUP before the node is ready: nothing reloaded", extra={"ctx": {"signal": "SIGHUP"}})
            return
        reloader.passwords = running.front.authenticator.passwords
        reloader.acl = running.front.acl
        reloader.tls = next((spec.ssl_context for spec in running.front.specs
                             if isinstance(spec.ssl_context, TlsContext)), None)
        reloader.node, reloader.admission = running.node, running.front.admission
        reloader.reload()

    async with trio.open_nursery() as nursery:

        async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
            await until_signalled(task_status=task_status)
            if running.node is not None:
                await running.node.shutdown()
            nursery.cancel_scope.cancel()

        await nursery.start(stop_on_signal)  # signals are caught before "ready" is logged
        await nursery.start(on_hangup, reload)
        await nursery.start(functools.partial(serve, conf.values, running=running))
        notify("READY=1")  # a systemd Type=notify service (packaging/lightgate.service) is started now
    LOGGER.info("gateway node stopped")


def run_cluster_gateway(conf: Any) -> int:
    """Entry point for one ``lightgate gateway`` process: returns the process exit status."""
    try:
        parse_address(conf["gateway.store"])
    except ValueError as exc:
        LOGGER.error("gateway node not started: gateway.store: %s", exc)
        return 1
    return run_gateway_node(conf, serve_cluster_gateway)


def run_gateway_node(conf: Any, serve: Any = serve_gateway) -> int:
    """Entry point for ``lightgate serve`` (and, with ``serve_cluster_gateway``, ``lightgate gateway``):
    returns the process exit status."""
    freeze_startup_objects()
    return_freed_buffers()
    failed = False
    try:
        trio.run(_serve_until_signalled, conf, serve)
    except* OSError as group:  # e.g. the port is taken; nurseries may wrap it in a group
        failures = leaves(group)
        LOGGER.error("gateway node failed: %s", "; ".join(f"{type(exc).__name__}: {exc}" for exc in failures))
        LOGGER.debug("gateway node failure", exc_info=failures[0])  # the traceback, for a crash
        failed = True
    except* (PasswordFileError, AclError) as group:  # the message names the file and line
        LOGGER.error("gateway node not started: %s", "; ".join(str(exc) for exc in leaves(group)))
        failed = True
    except* StartupError as group:  # the store's data cannot be opened: what happened and what to do
        LOGGER.error("%s", "; ".join(str(exc) for exc in leaves(group)))
        failed = True
    return 1 if failed else 0
