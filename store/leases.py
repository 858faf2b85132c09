"""Node leases, and what the store keeps for the clients of each node: where they are, their wills, their expiry.

The store owns the lifecycle of every MQTT session, in both deployment shapes, so that it never depends on the
memory or the timers of one gateway node:

- **Leases.** Each gateway node attached to the store holds a lease. A cluster gateway's lease is its RPC
  connection: renewed by every frame, it ends ``lease_s`` after the last one once the node has no connection
  left. The embedded gateway is one node in the store's process: its lease lasts as long as the process
  (it is never disconnected; a stopping process fires nothing). Epochs never repeat within a store process;
  a node that comes back after its lease ended gets a new one and is told (``rpc.Welcome.resumed``), and
  writes made for clients of the ended lease are refused (``store.api.LeaseLost``). A lease of an earlier
  store process (the store restarted) is adopted: nothing of this store's ended. Silence counts only while the
  store runs: after a stall of the store itself (store/stalls.py), every node has ``lease_s`` from the store's
  resumption to speak again before its lease ends.
- **Presence.** A client is *present* on the node it connected to last (``open``): the newest connection
  wins, and the node it was present on before is told that it moved (``on_moved``), so it closes its
  connection (a takeover across nodes) and writes nothing more for it.
- **Wills.** While a client is connected, the store holds its will. When its connection closes the node says
  whether the will is due (``close``): then it waits for its delay and is appended unless the session
  resumes first (any node connects the client); a clean start ends the session, so a will waiting then is
  published at once. When a node's lease ends, the wills of its present clients go to their delay timers:
  a client's will never depends on its gateway surviving.
- **Expiry.** When a client's connection closes (or its node's lease ends) its session expires after its
  expiry interval unless it resumes first; 0 ends it at once. Expiry ends the session in the store
  (``end_session``: state, offsets, held filters, QoS 2 flows, shared-group subscriptions).

Resource handling: the timers run in the nursery given to ``Leases``; they end with it (a store that shuts down
fires nothing more). Presence, held wills and pending timers live in memory: after a store restart each gateway
registers its clients and their wills again when it reconnects (``reattach``, store/rpc/client.py).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import final

import trio

from store.api import NewMessage
from store.log.errors import LogFullError
from store.space import FULL_RETRY_S
from store.stalls import StallWatch

__all__ = ["LEASE_S", "NEVER_EXPIRES", "LeaseStatistics", "Leases"]

LOGGER = logging.getLogger(__name__)

LEASE_S = 5.0
"""A cluster gateway node's lease lasts this long after the last frame the store got from it (the store's default,
``store.lease_s``; it tells each node its own in the RPC's Welcome); the node gives up on a store silent for
several (``store.rpc.client.STALLED_LEASES``)."""

NEVER_EXPIRES = 0xFFFF_FFFF
"""A Session Expiry Interval of 0xFFFFFFFF means the session never expires (MQTT 5.0, section 3.1.2.11.2)."""


@dataclass(slots=True)
class _Client:
    """A client present on a node: what the store does if its node's lease ends while it is there."""

    node: str
    expiry_s: int
    will: NewMessage | None
    will_delay_s: int


@dataclass(slots=True)
class _Pending:
    """A will waiting for its delay."""

    will: NewMessage
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass(slots=True)
class _Lease:
    epoch: int
    connections: int = 0
    last_seen: float = 0.0
    ending: trio.CancelScope | None = None  # the timer that ends the lease once the node has no connection
    clients: set[str] = field(default_factory=set)  # present here


@dataclass(frozen=True, slots=True)
class LeaseStatistics:
    nodes: int  # nodes with a lease (connected, or within the lease of their last frame)
    clients: int  # clients present on a node
    wills_held: int
    wills_pending: int  # waiting for their delay
    wills_fired: int  # appended since the store started
    expiries_pending: int  # sessions of disconnected clients waiting to expire
    sessions_expired: int
    leases_ended: int


@final
class Leases:
    """The leases of the nodes attached to one store, and the presence, wills and expiry of their clients.

    Args:
        nursery: where the lease, will and expiry timers run.
        lease_s: how long a cluster node's lease outlives its last frame.
        append: how a will is stored (``StoreNode.append``); raises ``LogFullError`` while the disk is full.
        end_session: how a session ends in the store (``StoreNode.end_session``); same.
        on_moved: ``on_moved(node, client_id)``: the client is not ``node``'s any more (it connected elsewhere).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        lease_s: float,
        *,
        append: Callable[[Sequence[NewMessage]], Awaitable[object]],
        end_session: Callable[[str], Awaitable[object]],
        on_moved: Callable[[str, str], None],
    ) -> None:
        self._nursery = nursery
        self.lease_s = lease_s
        self._append = append
        self._end_session = end_session
        self._on_moved = on_moved
        self.stalls = StallWatch()  # run by the RPC server: a stall of the store is not its nodes' silence
        self._leases: dict[str, _Lease] = {}
        self._clients: dict[str, _Client] = {}  # client id -> where it is present and its will
        self._wills: dict[str, _Pending] = {}  # client id -> a will waiting for its delay
        self._expiries: dict[str, trio.CancelScope] = {}  # client id -> the timer that ends its session
        self._ending: set[str] = set()  # expired sessions whose end waits for room on the data disk
        self._next_epoch = 1  # 0 means "no lease" on the wire
        self._fired = 0
        self._expired = 0
        self._ended = 0

    # --- leases ---------------------------------------------------------------------------

    def connected(self, node: str, epoch: int = 0, *, adopt: bool = False) -> tuple[int, bool]:
        """A connection of ``node`` completed its handshake: the lease is renewed and will not end meanwhile.

        ``epoch`` is the lease the node says it held (0: none); ``adopt``: a lease of an earlier store process,
        which this one takes over if the node has none here. Returns the lease's epoch and whether it is the one
        the node named (False: that one ended, and this is a new one).
        """
        lease = self._leases.get(node)
        if lease is not None and lease.ending is not None and trio.current_time() >= self._due(lease):
            self._end(node)  # due, its timer has not run yet: it ended all the same
            lease = None
        if lease is None:
            new_epoch = epoch if adopt and epoch else self._next_epoch
            self._next_epoch = max(self._next_epoch, new_epoch) + 1  # never again for this node (nor any other)
            lease = self._leases[node] = _Lease(new_epoch)
        resumed = epoch == lease.epoch
        lease.connections += 1
        lease.last_seen = trio.current_time()
        if lease.ending is not None:
            lease.ending.cancel()
            lease.ending = None
        return lease.epoch, resumed

    def epoch(self, node: str) -> int:
        """The epoch of the lease ``node`` holds now (0: none)."""
        lease = self._leases.get(node)
        return lease.epoch if lease is not None else 0

    def seen(self, node: str) -> None:
        """A frame of ``node`` arrived: the lease runs from now."""
        lease = self._leases.get(node)
        if lease is not None:
            lease.last_seen = trio.current_time()

    def silent_for(self, node: str) -> float:
        """Seconds ``node`` has been silent while the store ran: since its last frame, or since the end of a later
        stall of the store (store/stalls.py), which did not read the frames the node sent meanwhile."""
        lease = self._leases.get(node)
        return trio.current_time() - self._heard(lease) if lease is not None else 0.0

    def _heard(self, lease: _Lease) -> float:
        return max(lease.last_seen, self.stalls.awake_since())

    def _due(self, lease: _Lease) -> float:
        """When the lease of a node without a connection ends: ``lease_s`` of silence while the store ran."""
        return self._heard(lease) + self.lease_s

    def disconnected(self, node: str) -> None:
        """A connection of ``node`` ended; with its last one gone, the lease ends ``lease_s`` after its last frame."""
        lease = self._leases.get(node)
        if lease is None:
            return
        lease.connections -= 1
        if lease.connections > 0:
            return
        scope = lease.ending = trio.CancelScope(deadline=lease.last_seen + self.lease_s)
        self._nursery.start_soon(self._end_when_due, node, scope)

    async def _end_when_due(self, node: str, scope: trio.CancelScope) -> None:
        while True:
            with scope:
                await trio.sleep_forever()  # until the deadline: the scope's deadline is the lease's end
            lease = self._leases.get(node)
            if not (scope.cancelled_caught and lease is not None and lease.ending is scope):
                return  # renewed, or ended already
            due = self._due(lease)
            if due <= trio.current_time():
                break
            lease.ending = scope = trio.CancelScope(deadline=due)  # the store stalled: a lease from its resumption
        self._end(node)

    def _end(self, node: str) -> None:
        """The lease of ``node`` ends: its clients are gone as if their connections had closed abnormally."""
        lease = self._leases.pop(node)
        self._ended += 1
        wills = 0
        for client_id in sorted(lease.clients):
            client = self._clients.pop(client_id)
            if client.will is not None:
                wills += 1
                self._will_after(client_id, client.will, node, client.will_delay_s)
            self._expire_after(client_id, client.expiry_s)
        LOGGER.warning("gateway node lease ended", extra={"ctx": {"node": node, "epoch": lease.epoch,
                                                                  "clients": len(lease.clients), "wills": wills}})

    # --- clients ----------------------------------------------------------------------------

    def nodes_with_clients(self) -> set[str]:
        """The nodes some client is present on (those a cluster-wide admin list asks)."""
        return {client.node for client in self._clients.values()}

    def where(self, client_id: str) -> str | None:
        """The node ``client_id`` is present on, or None."""
        client = self._clients.get(client_id)
        return client.node if client is not None else None

    def open(self, node: str, client_id: str, *, expiry_s: int, will: NewMessage | None, will_delay_s: int,
             clean_start: bool) -> NewMessage | None:
        """``client_id`` connected to ``node``: it is present there from now on, with this will held.

        The node it was present on before (if another) is told it moved; its session's expiry stops; a will
        waiting for its delay is cancelled, or, with ``clean_start`` (the session ends), returned: due now.

        Raises:
            LogFullError: the session expired and its end waits for room on the data disk: it cannot resume.
        """
        if client_id in self._ending and not clean_start:
            raise LogFullError(errno.ENOSPC, f"the session of {client_id!r} expired and waits for room to end")
        previous = self._clients.get(client_id)
        if previous is not None:
            self._leave(client_id, previous)
            if previous.node != node:
                self._on_moved(previous.node, client_id)
        self._cancel(self._expiries, client_id)
        pending = self._wills.pop(client_id, None)
        if pending is not None:
            pending.scope.cancel()
        self._present(node, client_id, _Client(node, expiry_s, will, will_delay_s))
        return pending.will if pending is not None and clean_start else None

    def reattach(self, node: str, client_id: str, *, expiry_s: int, will: NewMessage | None,
                 will_delay_s: int) -> None:
        """``node`` still has ``client_id`` connected (it says so again after reconnecting to the store, which may
        have restarted). A client present on another node meanwhile is that node's (its connection is newer):
        ``node`` is told that it moved."""
        previous = self._clients.get(client_id)
        if previous is not None and previous.node != node:
            self._on_moved(node, client_id)
            return
        if previous is not None:
            self._leave(client_id, previous)
        self._present(node, client_id, _Client(node, expiry_s, will, will_delay_s))

    def close(self, node: str, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> bool:
        """The client's connection on ``node`` closed: start its will's delay (None: drop the will) and its
        session's expiry (0: the caller ends it now). False, and nothing done, when the client is not present on
        ``node`` (it connected to another node since)."""
        client = self._clients.get(client_id)
        if client is None or client.node != node:
            return False
        del self._clients[client_id]
        self._leave(client_id, client)
        if will_delay_s is not None and client.will is not None:
            self._will_after(client_id, client.will, node, will_delay_s)
        if expiry_s:
            self._expire_after(client_id, expiry_s)
        return True

    def ended(self, client_id: str) -> NewMessage | None:
        """The client's session is ending now (an operator's delete): its expiry stops, and a will waiting for
        its delay is returned, due now."""
        self._cancel(self._expiries, client_id)
        pending = self._wills.pop(client_id, None)
        if pending is None:
            return None
        pending.scope.cancel()
        return pending.will

    def statistics(self) -> LeaseStatistics:
        return LeaseStatistics(len(self._leases), len(self._clients),
                               sum(1 for c in self._clients.values() if c.will is not None), len(self._wills),
                               self._fired, len(self._expiries), self._expired, self._ended)

    def _present(self, node: str, client_id: str, client: _Client) -> None:
        self._clients[client_id] = client
        lease = self._leases.get(node)
        if lease is not None:
            lease.clients.add(client_id)

    def _leave(self, client_id: str, client: _Client) -> None:
        self._clients.pop(client_id, None)
        lease = self._leases.get(client.node)
        if lease is not None:
            lease.clients.discard(client_id)

    # --- timers -----------------------------------------------------------------------------

    def _will_after(self, client_id: str, will: NewMessage, node: str, delay_s: int) -> None:
        old = self._wills.pop(client_id, None)
        if old is not None:
            old.scope.cancel()
        pending = self._wills[client_id] = _Pending(will)
        self._nursery.start_soon(self._fire, client_id, pending, node, delay_s)

    async def _fire(self, client_id: str, pending: _Pending, node: str, delay_s: float) -> None:
        with pending.scope:
            await trio.sleep(delay_s)
            if self._wills.get(client_id) is pending:
                del self._wills[client_id]
            with trio.CancelScope(shield=True):  # once due, the will is appended even if the client returns now
                if await self._retried(self._append, [pending.will], "will not published", client_id):
                    self._fired += 1
                    LOGGER.info("will published", extra={"ctx": {"client_id": client_id, "node": node}})

    def _expire_after(self, client_id: str, expiry_s: int) -> None:
        if expiry_s >= NEVER_EXPIRES:
            return
        self._cancel(self._expiries, client_id)
        scope = self._expiries[client_id] = trio.CancelScope()
        self._nursery.start_soon(self._expire, client_id, expiry_s, scope)

    async def _expire(self, client_id: str, expiry_s: int, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(expiry_s)
            if self._expiries.get(client_id) is scope:
                del self._expiries[client_id]
            self._ending.add(client_id)
            if await self._end_when_room(client_id, "session expiry"):
                self._expired += 1
                LOGGER.info("session expired", extra={"ctx": {"client_id": client_id}})

    def end_when_room(self, client_id: str) -> None:
        """The end of a closed session (Session Expiry 0) was refused by a full data disk: it ends once there is
        room, and cannot resume meanwhile (``open`` refuses it)."""
        self._ending.add(client_id)
        self._nursery.start_soon(self._end_when_room, client_id, "session end")

    async def _end_when_room(self, client_id: str, what: str) -> bool:
        """End the session (marked ``_ending`` by the caller), retried while the data disk is full."""
        with trio.CancelScope(shield=True):  # a half-ended session would keep its filters held
            try:
                return await self._retried(self._end_session, client_id, f"{what} failed", client_id,
                                           waiting=f"{what} waits for room on the data disk: the session cannot"
                                                   " resume until it is deleted")
            finally:
                self._ending.discard(client_id)

    @staticmethod
    async def _retried(write: Callable[[object], Awaitable[object]], arg: object, failure: str,
                       client_id: str, *, waiting: str | None = None) -> bool:
        """``write(arg)``, retried every ``FULL_RETRY_S`` while the data disk is full (``waiting`` logged at the
        first refusal); False if it failed otherwise."""
        full = False
        while True:
            try:
                await write(arg)
                return True
            except LogFullError:  # the full disk is logged once by the store: it waits for room
                if waiting is not None and not full:
                    LOGGER.info(waiting, extra={"ctx": {"client_id": client_id}})
                full = True
            except (OSError, ValueError) as exc:
                LOGGER.error("%s: %r", failure, exc, extra={"ctx": {"client_id": client_id}})
                return False
            await trio.sleep(FULL_RETRY_S)

    @staticmethod
    def _cancel(table: dict[str, trio.CancelScope], client_id: str) -> None:
        scope = table.pop(client_id, None)
        if scope is not None:
            scope.cancel()
