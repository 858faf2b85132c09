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

- **Restarts.** Each step of a client's lifecycle is also appended as a control record of the store's client
  ledger (store/ledger.py) before it is acknowledged (the CONNACK waits for ``written``), and ``restore`` re-arms
  everything from it when the store starts: a closed session expires at its close + its expiry (at once if that
  passed while the store was down), a pending will fires at its close + its delay (at once if past), and a session
  resumed before either cancelled them for good. A client the ledger says was connected when the store stopped
  is placed on a *restored* lease of its node: a cluster gateway that kept running adopts it and registers its
  clients again (``reattach``); any other start of that node (the embedded gateway of a restarted ``lightgate
  serve``, a gateway process that restarted) ends it at once, and it ends ``lease_s`` after the start if the
  node does not come back. Its clients are then gone as at any lease end: their wills go to their delays and
  their sessions expire from that moment. That moment stands for their disconnection: the store cannot know
  when their network connections closed during its outage, the specification starts the expiry when the
  connection closes [MQTT-3.1.2-23] (section 3.1.2.11.2), and a later start than the true one never ends a session
  before its client could expect, whereas the time of the connect would.

Resource handling: the timers run in the nursery given to ``Leases``; they end with it (a store that shuts down
fires nothing more: the ledger keeps what is pending). Presence, held wills and pending timers live in memory;
after a store restart each gateway registers its clients and their wills again when it reconnects (``reattach``,
store/rpc/client.py).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import final

import trio
from msgspec.structs import replace

from store.api import NewMessage
from store.control import ClientForgotten, Control, WillPublished
from store.ledger import ClientEntry, entry_control
from store.log.errors import LogFullError
from store.log.record import now_ms
from store.space import FULL_RETRY_S
from store.stalls import StallWatch

__all__ = ["LEASE_S", "NEVER_EXPIRES", "LeaseStatistics", "Leases"]

LOGGER = logging.getLogger(__name__)

LEASE_S = 5.0
"""A cluster gateway node's lease lasts this long after the last frame the store got from it (the store's default,
``store.lease_s``; it tells each node its own in the RPC's Welcome); the node gives up on a store silent for
several (``store.rpc.connection.STALLED_LEASES``)."""

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
    restored: bool = False  # made from the ledger at start: the node's clients when the store stopped
    unclaimed: set[str] = field(default_factory=set)  # restored clients its node has not registered again


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
        write: how the client ledger's control records are appended (``StoreNode.append_control``; None: nothing
            outlives the process); a write the disk refuses is logged and skipped (store/ledger.py).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        lease_s: float,
        *,
        append: Callable[[Sequence[NewMessage]], Awaitable[object]],
        end_session: Callable[[str], Awaitable[object]],
        on_moved: Callable[[str, str], None],
        write: Callable[[Sequence[Control]], Awaitable[object]] | None = None,
    ) -> None:
        self._nursery = nursery
        self.lease_s = lease_s
        self._append = append
        self._end_session = end_session
        self._on_moved = on_moved
        self._write = write
        self._unwritten: list[Control] = []  # ledger records not appended yet (``written``)
        self._writing = trio.Lock()  # one append at a time, in the order the records were made
        self._made = 0  # ledger records made so far
        self._done = 0  # of them, those an append took (appended, or skipped when it failed)
        self._wrote = trio.lowlevel.ParkingLot()  # callers of ``written`` waiting for an append in progress
        self._write_failing = False  # an append failed and none succeeded since: logged once
        self._closed: dict[str, ClientEntry] = {}  # client id -> its ledger entry, closed and not ended yet
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
        if lease is not None and lease.restored:
            if adopt and epoch:  # the node kept running while the store was down: its clients are still its
                lease.epoch, lease.restored, lease.unclaimed = epoch, False, set(lease.clients)
                self._next_epoch = max(self._next_epoch, epoch + 1)
                self._nursery.start_soon(self._drop_unclaimed, node, lease)
            else:  # a new process of the node: the clients it had when the store stopped are gone
                self._end(node)
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
        self._end_later(node, lease)

    def _end_later(self, node: str, lease: _Lease) -> None:
        """Arm the timer that ends the lease ``lease_s`` after the node's last frame."""
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
            wills += self._gone(client_id, self._clients.pop(client_id))
        ctx = {"node": node, "epoch": lease.epoch, "clients": len(lease.clients), "wills": wills}
        if lease.restored:
            LOGGER.info("clients connected when the store stopped are gone: their wills and expiry run from now",
                        extra={"ctx": ctx})
        else:
            LOGGER.warning("gateway node lease ended", extra={"ctx": ctx})
        self._write_soon()

    async def _drop_unclaimed(self, node: str, lease: _Lease) -> None:
        """The restored clients an adopting node has not registered again ``lease_s`` after its Hello (it sends
        them at once) closed while the store was down, and their close never reached it: they are gone now."""
        start = trio.current_time()
        while (due := max(start, self.stalls.awake_since()) + self.lease_s) > trio.current_time():
            await trio.sleep_until(due)  # a stall of the store in between: the node has its lease_s after it
        if self._leases.get(node) is not lease or not lease.unclaimed:  # ended meanwhile: they went with it
            return
        gone = sorted(lease.unclaimed)
        wills = 0
        for client_id in gone:
            self._leave(client_id, client := self._clients[client_id])
            wills += self._gone(client_id, client)
        LOGGER.info("clients not registered again by their gateway are gone: their wills and expiry run from now",
                    extra={"ctx": {"node": node, "clients": len(gone), "wills": wills}})
        await self.written()

    def _gone(self, client_id: str, client: _Client) -> bool:
        """A client's connection is gone without a close the store heard (its node's lease ended): its will goes
        after its delay and its session expires from now. Whether it had a will."""
        self._keep_closed(client_id, client, client.will_delay_s)
        if client.will is not None:
            self._will_after(client_id, client.will, client.node, client.will_delay_s)
        self._expire_after(client_id, client.expiry_s)
        return client.will is not None

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
        pending = self._resumed(client_id)
        self._present(node, client_id, self._keep_connected(client_id, _Client(node, expiry_s, will, will_delay_s)))
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
        self._resumed(client_id)  # an expiry armed at the start (its entry said closed) is off: it is connected
        self._present(node, client_id, self._keep_connected(client_id, _Client(node, expiry_s, will, will_delay_s)))
        self._write_soon()

    def close(self, node: str, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> bool:
        """The client's connection on ``node`` closed: start its will's delay (None: drop the will) and its
        session's expiry (0: the caller ends it now). False, and nothing done, when the client is not present on
        ``node`` (it connected to another node since)."""
        client = self._clients.get(client_id)
        if client is None or client.node != node:
            return False
        del self._clients[client_id]
        self._leave(client_id, client)
        if expiry_s or will_delay_s is not None:  # else the caller ends the session, then says so (``session_ended``)
            self._keep_closed(client_id, _Client(node, expiry_s, client.will, client.will_delay_s), will_delay_s)
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
        self.session_ended(client_id)
        if pending is None:
            return None
        pending.scope.cancel()
        return pending.will

    def session_ended(self, client_id: str) -> None:
        """The client's session ended in the store: its ledger entry goes (kept for its will alone while that waits
        for its delay), unless the client connected again meanwhile."""
        entry = self._closed.pop(client_id, None)
        if client_id in self._clients:
            return
        if entry is not None and entry.will is not None and client_id in self._wills:
            self._closed[client_id] = entry = replace(entry, expiry_s=0)
            self._put(client_id, entry)
        else:
            self._forget(client_id)

    def restore(self, entries: Mapping[str, ClientEntry]) -> None:
        """At the store's start, re-arm what the ledger says is pending (see the module docstring): expiries and
        wills of closed sessions for the time they have left, and the clients connected when the store stopped on
        restored leases of their nodes."""
        now, wall_ms = trio.current_time(), now_ms()
        for client_id, entry in entries.items():
            if not entry.closed_ms:
                lease = self._leases.get(entry.node)
                if lease is None:
                    lease = self._leases[entry.node] = _Lease(0, last_seen=now, restored=True)
                    self._end_later(entry.node, lease)
                self._present(entry.node, client_id, _Client(entry.node, entry.expiry_s, entry.will,
                                                             entry.will_delay_s))
                continue
            self._closed[client_id] = entry
            if entry.will is not None:
                self._will_after(client_id, entry.will, entry.node, _left(entry.closed_ms, entry.will_delay_s, wall_ms))
            if 0 < entry.expiry_s < NEVER_EXPIRES:  # 0: the session ended already, only its will waited
                self._expire_after(client_id, _left(entry.closed_ms, entry.expiry_s, wall_ms))

    def statistics(self) -> LeaseStatistics:
        return LeaseStatistics(len(self._leases), len(self._clients),
                               sum(1 for c in self._clients.values() if c.will is not None), len(self._wills),
                               self._fired, len(self._expiries), self._expired, self._ended)

    def _resumed(self, client_id: str) -> _Pending | None:
        """The client is connected again: its session's expiry stops, and its will waiting for a delay is off
        (returned)."""
        self._cancel(self._expiries, client_id)
        self._closed.pop(client_id, None)
        pending = self._wills.pop(client_id, None)
        if pending is not None:
            pending.scope.cancel()
        return pending

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
            lease.unclaimed.discard(client_id)

    # --- the ledger -------------------------------------------------------------------------

    def _keep_connected(self, client_id: str, client: _Client) -> _Client:
        """Write that ``client`` is connected (before its CONNACK: its expiry and will must outlive a crash)."""
        self._put(client_id, ClientEntry(client.node, client.expiry_s, client.will, client.will_delay_s))
        return client

    def _keep_closed(self, client_id: str, client: _Client, will_delay_s: int | None) -> None:
        """Write that the client's connection closed now, with its will pending unless ``will_delay_s`` is None."""
        will = client.will if will_delay_s is not None else None
        entry = self._closed[client_id] = ClientEntry(client.node, client.expiry_s, will, will_delay_s or 0, now_ms())
        self._put(client_id, entry)

    def _will_done(self, client_id: str, will: NewMessage) -> None:
        """The pending will of a closed session was published: a restart must not publish it again."""
        entry = self._closed.get(client_id)
        if entry is None or entry.will is not will:  # the client connected again since, or another close
            return
        if entry.expiry_s:
            self._closed[client_id] = replace(entry, will=None)
        else:
            del self._closed[client_id]
        self._record(WillPublished(client_id))  # the ledger makes the same choice (store/ledger.py)

    def _put(self, client_id: str, entry: ClientEntry) -> None:
        self._record(entry_control(client_id, entry))

    def _forget(self, client_id: str) -> None:
        self._record(ClientForgotten(client_id))

    def _record(self, control: Control) -> None:
        """Queue a ledger record for the next :meth:`written`: each path that makes records ends with one (the
        caller's, for ``open``, ``close``, ``ended`` and ``session_ended``: the CONNACK waits for it), or with
        :meth:`_write_soon`."""
        if self._write is not None:
            self._unwritten.append(control)
            self._made += 1

    def _write_soon(self) -> None:
        """Append the queued ledger records in a task of their own (a path that cannot wait for them)."""
        if self._unwritten:
            self._nursery.start_soon(self.written)

    async def written(self) -> None:
        """Return once every ledger record made so far is appended (and durable as the flush policy promises):
        the CONNACK of a client waits for this after ``open``. A refused append is logged once and skipped.

        One append takes every record made until it starts; the callers whose records it took all return when it
        ends. They waited for the lock in turn: each took it in a turn of the event loop of its own to find nothing
        left, so under a subscribe storm (turns of ~10 ms) the 50th of 50 clients connecting at once had its
        CONNACK 0.5 s after the first, and its SUBSCRIBEs finished that much later (issue 31)."""
        if self._write is None:
            await trio.lowlevel.checkpoint()
            return
        write, made = self._write, self._made
        while self._done < made:
            if self._writing.locked():  # the append in progress may have taken them: look again once it ends
                await self._wrote.park()
                continue
            async with self._writing:
                await self._append_records(write)

    async def _append_records(self, write: Callable[[Sequence[Control]], Awaitable[object]]) -> None:
        """Append the records made so far with ``write`` (hold ``_writing``); wake the callers of :meth:`written`
        waiting."""
        controls, self._unwritten = self._unwritten, []
        taken = self._made
        try:
            if controls:
                await write(controls)
        except (OSError, ValueError) as exc:  # a full disk included: nothing else is refused for it
            if not self._write_failing:  # a full disk is logged as an error once by the store already
                LOGGER.log(logging.WARNING if isinstance(exc, LogFullError) else logging.ERROR,
                           "client ledger write failed: sessions may outlive their expiry across a restart: "
                           "%r", exc, extra={"ctx": {"records": len(controls)}})
            self._write_failing = True
            return
        finally:
            self._done = taken
            self._wrote.unpark_all()
        if self._write_failing and controls:
            LOGGER.info("client ledger writes succeed again")
            self._write_failing = False

    # --- timers -----------------------------------------------------------------------------

    def _will_after(self, client_id: str, will: NewMessage, node: str, delay_s: float) -> None:
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
                    self._will_done(client_id, pending.will)
                    self._fired += 1
                    LOGGER.info("will published", extra={"ctx": {"client_id": client_id, "node": node}})
                    await self.written()

    def _expire_after(self, client_id: str, expiry_s: float) -> None:
        if expiry_s >= NEVER_EXPIRES:
            return
        self._cancel(self._expiries, client_id)
        scope = self._expiries[client_id] = trio.CancelScope()
        self._nursery.start_soon(self._expire, client_id, expiry_s, scope)

    async def _expire(self, client_id: str, expiry_s: float, scope: trio.CancelScope) -> None:
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
                ended = await self._retried(self._end_session, client_id, f"{what} failed", client_id,
                                            waiting=f"{what} waits for room on the data disk: the session cannot"
                                                    " resume until it is deleted")
                if ended:
                    self.session_ended(client_id)
                    await self.written()
                return ended
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


def _left(since_ms: int, seconds: int, now: int) -> float:
    """Seconds left at wall-clock ``now`` (ms) of a period of ``seconds`` that started at ``since_ms`` (0 if past)."""
    return max(0.0, (since_ms + seconds * 1000 - now) / 1000)
