"""Sessions of a node's connections: opened at the store, resumed, saved, closed.

The store owns every session (store/leases.py): where its client is connected, its will, its expiry, its blob.
A node keeps no session of a client that is not connected to it:

- Open: the store places the client here (a connection of it on another node is closed there), holds the
  will of the new connection, and returns the stored session (none with a clean start: the store ends the old
  one). The session resumes from the offsets the light queues committed where they are ahead of its own (a
  blob can be older than the commits), none past its queues' heads (records lost in a power loss under the
  async flush policy), with the inbound QoS 2 flows the store derives from the CommitLog (store/awaiting.py).
  Subscriptions the connection's user may not make are suspended (kept, not resumed: docs/security.md).
- Save: a persistent session's state is written to the store (WAL); a save the channel waits for is answered
  ``SessionSaved`` once written. A SUBSCRIBE or UNSUBSCRIBE writes its own filters only (``PatchSession``), kept
  beside the state until the next save writes it whole; a client's saves and patches are written in the order
  they come (the store drops a client's parts when it applies a save: the save holds them). On a full data disk
  the write is owed (gateway/node/owed.py): the latest state is written once the disk has room, and a CONNECT of the client meanwhile is refused for lack of space.
- Close: the store hears that the connection closed: the session expires from then (0: it ends now), and the
  will is published after its delay unless the session resumes first.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, final

import msgspec
import trio

from gateway.mqtt.actions import (CloseSession, OpenSession, PatchSession, SavedSubscription, SaveSession,
                                  SessionOpened, SessionSaved)
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.session import (SessionState, clamp_to_heads, decode_session, encode_parts, encode_session,
                                  merge_committed)
from gateway.node import clientlog
from gateway.node.commits import CommitBatcher
from gateway.node.guard import Guard
from gateway.node.owed import OwedWrites
from gateway.node.registry import Registry
from gateway.node.subscriptions import Subscriptions
from store.api import LogFullError, StoreApi

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gateway.node.connection import Connection

__all__ = ["Sessions"]

LOGGER = logging.getLogger(__name__)


@final
class Sessions:
    """The sessions of one node's connections (see the module docstring)."""

    def __init__(self, store: StoreApi, registry: Registry, subscriptions: Subscriptions, commits: CommitBatcher,
                 owed: OwedWrites, guard: Guard, nursery: trio.Nursery) -> None:
        self._store = store
        self._registry = registry
        self._subscriptions = subscriptions
        self._commits = commits
        self._owed = owed
        self._guard = guard
        self._nursery = nursery
        # client id -> what is not written yet, in order: a state (it holds everything before it) then parts
        self._unwritten: dict[str, list[SessionState | dict[str, SavedSubscription | None]]] = {}
        self._waiters: dict[str, list[tuple[Connection, int]]] = {}  # client id -> saves waiting for their write
        self._suspended: dict[str, SessionState] = {}  # client id -> what its connection's user may not resume
        self._unavailable = 0  # CONNECTs refused since the store became unreachable (0: it is reachable)
        self.saved_subscriptions: dict[str, int] = {}  # client id -> subscriptions in its last save here ($SYS)

    # --- open -------------------------------------------------------------------------------

    async def open(self, connection: Connection, action: OpenSession) -> None:
        """Authenticate, take over any connection of the client here, open its session; answer ``SessionOpened``."""
        client_id = action.client_id
        decision = await self._guard.connect(connection, action)
        if not decision.accepted:  # before the takeover: a refused client must not push an accepted one off
            connection.feed(SessionOpened(False, reason=decision.reason))
            return
        connection.username = decision.username
        await self._registry.take(connection, client_id)
        try:
            state = await self._resume(connection, action)
        except ConnectionError as exc:  # StoreUnavailable: nothing to resume from
            self._refuse_unavailable(connection, exc)
            return
        except LogFullError:  # nothing was deleted; the store logged the full disk once
            connection.feed(SessionOpened(False, reason=ReasonCode.QUOTA_EXCEEDED))
            return
        connection.feed(SessionOpened(state is not None, state,
                                      authorizer=self._guard.client_acl(decision.username, client_id)))
        clientlog.connected(connection, action.clean_start, state is not None)

    async def _resume(self, connection: Connection, action: OpenSession) -> SessionState | None:
        """The session an accepted CONNECT resumes (None: a new one), once the store placed the client here.

        Raises:
            ConnectionError: the store is not reachable.
            LogFullError: the data disk is full and the CONNECT needs a write (a clean start of a stored session,
                a write of the client's still owed, a shared group's first offset): nothing was deleted.
        """
        client_id = action.client_id
        await self._owed.settle(client_id)  # its owed writes first: an ended session must not resume
        blob = await self._store.open_session(client_id, clean_start=action.clean_start, expiry_s=action.expiry_s,
                                              will=action.will, will_delay_s=action.will_delay_s)
        state = _decoded(client_id, blob)
        if state is None:
            if action.expiry_s > 0:  # the session exists from now on: Session Present says so after a crash too
                await self._save(SessionState(client_id, action.expiry_s, detached=True))
            return None
        awaiting = await self._store.awaiting_release(client_id)
        state = self._suspend_unauthorised(connection, replace(await self.resumed(state, log=True),
                                                               awaiting=awaiting))
        await self._subscriptions.resume(connection, state.subscriptions)
        return state

    async def resumed(self, state: SessionState, *, log: bool = False) -> SessionState:
        """The session as it resumes: the offsets the light queues committed where they are ahead of its own
        (a blob can be older than the commits), none past its queues' heads (the store lost records it had
        acknowledged: a power loss under the async flush policy, docs/storage.md)."""
        state = merge_committed(state, await self._store.get_offsets(state.client_id))
        state, moved = clamp_to_heads(state, await self.heads(sub.queue for sub in state.subscriptions))
        if moved and log:
            LOGGER.warning("session offsets past the end of their queues were pulled back (records lost in a"
                           " power loss under the async flush policy)",
                           extra={"ctx": {"client_id": state.client_id, "moved": moved}})
        return state

    async def heads(self, queues: Iterable[str]) -> dict[str, int]:
        """``{queue: max offset}``, in one store call."""
        names = sorted(set(queues))
        return dict(zip(names, await self._store.max_offsets(names))) if names else {}

    def _refuse_unavailable(self, connection: Connection, exc: ConnectionError) -> None:
        """Answer a CONNECT the store cannot serve now with Server unavailable (MQTT 5: 0x88, 3.1.1: return code 3).

        The outage is logged once, and its end once: not a line per CONNECT.
        """
        self._unavailable += 1
        if self._unavailable == 1:
            LOGGER.warning("store unavailable: CONNECTs are answered Server unavailable until it is back: %s", exc)
            self._nursery.start_soon(self._log_outage_end)
        connection.feed(SessionOpened(False, reason=ReasonCode.SERVER_UNAVAILABLE))

    async def _log_outage_end(self) -> None:
        await self._store.wait_available()
        LOGGER.info("store available again: CONNECTs are accepted", extra={"ctx": {"refused": self._unavailable}})
        self._unavailable = 0

    # --- suspended subscriptions --------------------------------------------------------------

    def _suspend_unauthorised(self, connection: Connection, state: SessionState) -> SessionState:
        """The resumed session without the subscriptions this connection may not make (docs/security.md).

        The client id may now log in as another user, or the ACL may have changed while it was away;
        subscriptions are the model of what a client may receive, so they are checked again here. The ones
        refused are suspended, not removed: they stay held in the store with their offsets, and every save of
        the session while this connection has it puts them back (:meth:`whole`), so a later connection of a user
        who may make them resumes them with what was published meanwhile.
        """
        self._suspended.pop(state.client_id, None)
        denied = {sub.filter for sub in state.subscriptions if not self._guard.may_subscribe(
            connection, state.client_id, sub.filter, "subscription of the resumed session suspended")}
        if not denied:
            return state
        kept, self._suspended[state.client_id] = split(state, denied)
        return kept

    def whole(self, state: SessionState) -> SessionState:
        """A connection's session state with the subscriptions suspended for its user put back."""
        suspended = self._suspended.get(state.client_id)
        return state if suspended is None else rejoin(state, suspended)

    # --- save -------------------------------------------------------------------------------

    async def save(self, connection: Connection, action: SaveSession) -> None:
        """Write the session (a persistent one); a save with a ``ref`` is answered once written (or owed, then)."""
        if action.ref is not None:
            self._waiters.setdefault(action.state.client_id, []).append((connection, action.ref))
        await self._save(action.state)

    async def _save(self, state: SessionState) -> None:
        state = self.whole(state)
        client_id = state.client_id
        if state.expiry_s <= 0:
            self._answer(client_id)
            return
        self.saved_subscriptions[client_id] = len(state.subscriptions)
        self._unwritten[client_id] = [state]  # on a full disk the save waits for room (owed): it then writes the latest
        await self._owed.attempt(client_id, functools.partial(self._write, client_id), key=SaveSession)

    async def patch(self, connection: Connection, action: PatchSession) -> None:
        """Write a persistent session's changed subscriptions (after what is unwritten of it, merged with the
        parts waiting last)."""
        client_id = action.client_id
        if action.ref is not None:
            self._waiters.setdefault(client_id, []).append((connection, action.ref))
        pending = self._unwritten.setdefault(client_id, [])
        if pending and isinstance(pending[-1], dict):
            pending[-1] = {**pending[-1], **action.parts}  # a new dict: a write in progress keeps its own
        else:
            pending.append(action.parts)
        self.saved_subscriptions[client_id] = action.subscriptions
        await self._owed.attempt(client_id, functools.partial(self._write, client_id), key=SaveSession)

    async def _write(self, client_id: str) -> None:
        """Write what is unwritten of the client's session, in order (its latest state, then parts), then answer
        the saves waiting for it: it covers each."""
        pending = self._unwritten.get(client_id)
        while pending:
            head = pending[0]
            if isinstance(head, dict):
                await self._store.patch_session(client_id, encode_parts(head))
            else:
                await self._store.save_session(client_id, encode_session(head))
            if pending and pending[0] is head:  # else a save replaced it meanwhile, or parts merged into it
                del pending[0]
            pending = self._unwritten.get(client_id)
        self._unwritten.pop(client_id, None)
        self._answer(client_id)

    def _answer(self, client_id: str) -> None:
        for connection, ref in self._waiters.pop(client_id, ()):
            connection.feed(SessionSaved(ref))

    # --- close ------------------------------------------------------------------------------

    async def close(self, connection: Connection, action: CloseSession) -> None:
        """The connection's session is settled: its shared subscriptions leave their groups, and the store hears
        that it closed (expiry, will); a session that ends now has its unwritten commits dropped first (an offset
        written after the end would keep its queues referenced)."""
        client_id = action.client_id
        self._suspended.pop(client_id, None)
        await self._subscriptions.leave_groups(connection)
        if not action.expiry_s:
            await self._commits.forget(client_id)
        # Not behind the client's owed writes: the expiry (or the end) starts now; the store retries an end
        # a full disk refuses, and a save owed past the session's end writes nothing (StoreNode.save_session).
        await self._store.close_session(client_id, expiry_s=action.expiry_s, will_delay_s=action.will_delay_s)

    def connection_closed(self, connection: Connection) -> None:
        """Forget the closed connection's saves waiting for an answer (``Session.detach``)."""
        waiters = self._waiters.get(connection.client_id)
        if waiters:
            waiters[:] = [w for w in waiters if w[0] is not connection]

    # --- administration -------------------------------------------------------------------

    def live(self, client_id: str) -> SessionState | None:
        """The live session of a client connected here (suspended subscriptions included), else None."""
        connection = self._registry.get(client_id)
        session = connection.channel.session if connection is not None else None
        return self.whole(session.state()) if session is not None else None

    async def stored(self, client_id: str) -> SessionState | None:
        """The session as the store keeps it (resumed as a connection would), or None.

        Raises:
            msgspec.DecodeError: the stored session is unreadable.
        """
        blob = await self._store.load_session(client_id)
        return None if blob is None else await self.resumed(decode_session(blob))


def _decoded(client_id: str, blob: bytes | None) -> SessionState | None:
    if blob is None:
        return None
    try:
        return decode_session(blob)
    except msgspec.DecodeError as exc:
        LOGGER.error("stored session is unreadable; starting a new one: %s", exc, extra={"ctx": {"client_id": client_id}})
        return None


def split(state: SessionState, filters: set[str]) -> tuple[SessionState, SessionState]:
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


def rejoin(state: SessionState, suspended: SessionState) -> SessionState:
    """A connection's session state with its suspended subscriptions (``split``) put back.

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
