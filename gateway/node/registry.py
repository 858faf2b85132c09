"""Which connection has which client id on this node: takeovers, moves to other nodes, shutdown.

A client id has at most one connection on a node; a new one takes the old one over (MQTT 5 reason 0x8E): the
old connection is told (``TakenOver``), hands its session over and finishes before the new one opens its
session. A client that connected to another node (or whose node's store lease ended) is closed here as taken
over elsewhere: that node has the session now, and nothing more is written for it from here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, final

import trio

from gateway.mqtt.actions import AdminDisconnect, ServerShutdown, TakenOver

if TYPE_CHECKING:
    from gateway.node.connection import Connection

__all__ = ["Registry", "SHUTDOWN_S", "TAKEOVER_TIMEOUT_S"]

LOGGER = logging.getLogger(__name__)

TAKEOVER_TIMEOUT_S = 15.0
"""How long a new connection waits for the one it takes over to hand its session over."""

SHUTDOWN_S = 5.0
"""How long a stopping node (SIGTERM) waits for its connections to be told (MQTT 5: DISCONNECT 0x8B), to save their
sessions and to close, before it cancels what is left."""


@final
class Registry:
    """The connections of one node by client id."""

    def __init__(self) -> None:
        self._connections: dict[str, Connection] = {}
        self.peak = 0  # the most clients connected at once ($SYS clients/maximum)

    def __len__(self) -> int:
        return len(self._connections)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._connections

    def __iter__(self) -> Iterator[Connection]:
        return iter(tuple(self._connections.values()))

    def get(self, client_id: str) -> Connection | None:
        return self._connections.get(client_id)

    async def take(self, connection: Connection, client_id: str) -> None:
        """Register ``connection`` for ``client_id``, after any other connection of it closed (taken over)."""
        old = self._connections.get(client_id)
        if old is not None and old is not connection:
            old.feed(TakenOver())
            with trio.move_on_after(TAKEOVER_TIMEOUT_S) as waited:
                await old.wait_finished()
            if waited.cancelled_caught:
                LOGGER.warning("takeover: the old connection did not close in time",
                               extra={"ctx": {"client_id": client_id}})
        self._connections[client_id] = connection
        self.peak = max(self.peak, len(self._connections))

    def closed(self, connection: Connection) -> bool:
        """Forget a closed connection; False if it was not the one registered for its client id."""
        client_id = connection.client_id
        if not client_id or self._connections.get(client_id) is not connection:
            return False
        del self._connections[client_id]
        return True

    def moved(self, client_ids: Iterable[str]) -> None:
        """These clients are not this node's any more (they connected to another node, or the node's store lease
        ended): close their connections as taken over elsewhere (MQTT 5 reason 0x8E)."""
        for client_id in client_ids:
            connection = self._connections.get(client_id)
            if connection is not None:
                connection.feed(TakenOver(elsewhere=True))

    async def disconnect(self, client_id: str) -> bool:
        """Close the client's connection as an administrative action (MQTT 5: DISCONNECT 0x98); returns once it is
        gone, False when the client is not connected here."""
        connection = self._connections.get(client_id)
        if connection is None:
            return False
        LOGGER.info("disconnecting a client (admin API)", extra={"ctx": {"client_id": client_id}})
        connection.feed(AdminDisconnect())
        with trio.move_on_after(TAKEOVER_TIMEOUT_S):
            await connection.wait_finished()
        return True

    async def shutdown(self) -> None:
        """Tell every connected client the server is shutting down (MQTT 5: DISCONNECT 0x8B) and wait for their
        connections to close, at most ``SHUTDOWN_S``."""
        connections = list(self._connections.values())
        LOGGER.info("disconnecting clients: the server is shutting down", extra={"ctx": {"clients": len(connections)}})
        for connection in connections:
            connection.feed(ServerShutdown())
        with trio.move_on_after(SHUTDOWN_S):
            for connection in connections:
                await connection.wait_finished()
