"""Gateway node leases, and the wills a lease holds: how a killed gateway's clients still get their wills.

In cluster mode a gateway node publishes the wills of its clients itself,
like the embedded node. If the gateway process dies, nobody would: so while
a client with a will is connected, its gateway tells the store (``hold``),
and the store keeps the will under the node's lease. The lease is the node's
RPC connection: it is renewed by every frame (heartbeats arrive five times
per lease) and ends ``LEASE_S`` after the last frame once the node has
no connection left. When a lease ends the store appends each held will after
its will delay, unless the client's session resumes first (any node holds or
drops a will for the same client id) -- MQTT's will delay, measured from the
end of the lease.

The bound: a will of a gateway that died fires at most ``LEASE_S`` plus its
will delay after the gateway's last frame (the connection's close is not
enough to end a lease: a gateway that reconnects within ``LEASE_S`` keeps its
clients' wills held, as its clients are still connected).

Fencing: each lease has an epoch; a node's epochs never repeat within a store
process. A node that reconnects names the lease it held; if that lease ended
meanwhile (the node was frozen or cut off for longer than ``LEASE_S``), it gets
a new lease and is told so (``rpc.Welcome.resumed``): its wills were
published, its clients may have connected elsewhere, so every write it still
makes under the old epoch is refused (``LeaseLost``) and it closes the old
connections. A lease of an earlier store process (the store restarted) is
adopted with its epoch: nothing of this store's ended, the node's clients stay.

Resource handling: the timers run in the nursery given to ``NodeLeases``;
they end with it (a store that shuts down fires nothing more). Held wills
live in memory: after a store restart each gateway holds its wills again
when it reconnects (store/rpc/client.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import final

import trio

from store.local import NewMessage
from store.log.errors import LogFullError
from store.space import FULL_RETRY_S

__all__ = ["LeaseLost", "LeaseStatistics", "NodeLeases"]

LOGGER = logging.getLogger(__name__)


class LeaseLost(ConnectionError):
    """A write names a lease of its node that has ended: the client it is for is no longer that node's.

    A ``ConnectionError``, as ``store.rpc.client.StoreUnavailable``: nothing is acknowledged for it.
    """


@dataclass(frozen=True, slots=True)
class _Held:
    node: str
    message: NewMessage
    delay_s: float


@dataclass(slots=True)
class _Lease:
    epoch: int
    connections: int = 0
    last_seen: float = 0.0
    ending: trio.CancelScope | None = None  # the timer that ends the lease once the node has no connection


@dataclass(frozen=True, slots=True)
class LeaseStatistics:
    nodes: int  # nodes with a lease (connected, or within LEASE_S of their last frame)
    wills_held: int
    wills_pending: int  # of nodes whose lease ended: waiting for their will delay
    wills_fired: int  # appended since the store started
    leases_ended: int


@final
class NodeLeases:
    """The leases of the gateway nodes connected to one store, and the wills they hold.

    Args:
        append: how a will is stored (``StoreNode.append_many``).
        nursery: where the lease and will-delay timers run.
        lease_s: how long a lease outlives the node's last frame.
    """

    def __init__(
        self,
        append: Callable[[Sequence[NewMessage]], Awaitable[object]],
        nursery: trio.Nursery,
        lease_s: float,
    ) -> None:
        self._append = append
        self._nursery = nursery
        self._lease_s = lease_s
        self._leases: dict[str, _Lease] = {}
        self._held: dict[str, _Held] = {}  # client id -> its will, held under its node's lease
        self._pending: dict[str, trio.CancelScope] = {}  # client id -> the delay timer of a will that will fire
        self._fired = 0
        self._ended = 0
        self._next_epoch = 1  # 0 means "no lease" on the wire

    def connected(self, node: str, epoch: int = 0, *, adopt: bool = False) -> tuple[int, bool]:
        """A connection of ``node`` completed its handshake: the lease is renewed and will not end meanwhile.

        ``epoch`` is the lease the node says it held (0: none); ``adopt``: it
        was a lease of an earlier store process, which this one takes over if
        the node has none here. Returns the lease's epoch and whether it is
        the one the node named (False: it ended, and this is a new one).
        """
        lease = self._leases.get(node)
        if lease is not None and lease.ending is not None and trio.current_time() >= lease.ending.deadline:
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
        """Seconds since the last frame of ``node``."""
        lease = self._leases.get(node)
        return trio.current_time() - lease.last_seen if lease is not None else 0.0

    def disconnected(self, node: str) -> None:
        """A connection of ``node`` ended; with its last one gone, the lease ends ``lease_s`` after its last frame."""
        lease = self._leases.get(node)
        if lease is None:
            return
        lease.connections -= 1
        if lease.connections > 0:
            return
        scope = lease.ending = trio.CancelScope(deadline=lease.last_seen + self._lease_s)
        self._nursery.start_soon(self._end_when_due, node, scope)

    def hold(self, node: str, client_id: str, message: NewMessage, delay_s: float) -> None:
        """``node`` has ``client_id`` connected with this will (it replaces any will held for the client)."""
        self._cancel_pending(client_id)
        self._held[client_id] = _Held(node, message, delay_s)

    def drop(self, node: str, client_id: str) -> None:
        """The will of ``client_id`` must not fire (normal disconnect, or published by ``node`` itself).

        A will held by another node stays: that node has the client now. A will
        waiting for its delay after a lease ended is cancelled: the client is back.
        """
        self._cancel_pending(client_id)
        held = self._held.get(client_id)
        if held is not None and held.node == node:
            del self._held[client_id]

    def resumed_on(self, node: str, client_id: str) -> None:
        """``client_id`` connected to ``node``: a will another node holds for it, or one waiting for its delay
        after a lease ended, must not fire (its session resumed; that node publishes a takeover's will itself
        if it is alive to hear of the move)."""
        self._cancel_pending(client_id)
        held = self._held.get(client_id)
        if held is not None and held.node != node:
            del self._held[client_id]

    def statistics(self) -> LeaseStatistics:
        return LeaseStatistics(len(self._leases), len(self._held), len(self._pending), self._fired, self._ended)

    async def _end_when_due(self, node: str, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep_forever()  # until the deadline: the scope's deadline is the lease's end
        lease = self._leases.get(node)
        if scope.cancelled_caught and lease is not None and lease.ending is scope:  # else renewed, or ended already
            self._end(node)

    def _end(self, node: str) -> None:
        """The lease of ``node`` ends: its wills go to their delay timers."""
        lease = self._leases.pop(node)
        self._ended += 1
        wills = [(client_id, held) for client_id, held in self._held.items() if held.node == node]
        for client_id, held in wills:
            del self._held[client_id]
            pending = self._pending[client_id] = trio.CancelScope()
            self._nursery.start_soon(self._fire, client_id, held, pending)
        LOGGER.warning("gateway node lease ended", extra={"ctx": {"node": node, "epoch": lease.epoch,
                                                                  "wills": len(wills)}})

    async def _fire(self, client_id: str, held: _Held, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(held.delay_s)
            del self._pending[client_id]
            while True:
                with trio.CancelScope(shield=True):  # once due, the will is appended even if the client returns now
                    try:
                        await self._append([held.message])
                        break
                    except LogFullError:  # logged once by the store: the will waits for room
                        pass
                    except (OSError, ValueError) as exc:
                        LOGGER.error("will of a lost gateway node not published: %r", exc,
                                     extra={"ctx": {"client_id": client_id, "node": held.node}})
                        return
                await trio.sleep(FULL_RETRY_S)
            self._fired += 1
            LOGGER.info("will published for a lost gateway node", extra={"ctx": {"client_id": client_id,
                                                                                 "node": held.node}})

    def _cancel_pending(self, client_id: str) -> None:
        scope = self._pending.pop(client_id, None)
        if scope is not None:
            scope.cancel()
