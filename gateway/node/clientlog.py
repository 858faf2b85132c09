"""The client log: one line per accepted CONNECT and one per closed connection, in the text and JSON formats alike.

Operators follow a client by these lines (grep its client id): who connected, from where and how (protocol level,
keep alive, clean start), and why the connection ended. The node calls ``connected`` where it accepts a CONNECT;
a connection calls ``closed`` where it executes its channel's ``Close`` (every way a connection ends goes through
one, refusals and protocol errors included). docs/operations.md, "Client log".
"""

from __future__ import annotations

import logging
from typing import Protocol

from gateway.mqtt.actions import Close
from gateway.mqtt.channel import Channel

__all__ = ["LoggedConnection", "closed", "connected"]

LOGGER = logging.getLogger(__name__)

PROTOCOLS = {3: "3.1", 4: "3.1.1", 5: "5.0"}
"""CONNECT's protocol level -> the MQTT version operators know it by (as the admin API shows it)."""


class LoggedConnection(Protocol):
    """What the client log reads of a connection: ``gateway.node.connection.Connection``, which calls ``closed``
    (so this module names what it reads, and does not import it back)."""

    channel: Channel
    peer: str
    username: str | None

    @property
    def client_id(self) -> str:
        """The client identifier (empty before CONNECT)."""


def connected(connection: LoggedConnection, clean_start: bool, session_present: bool) -> None:
    """Log the CONNECT the node just accepted (its CONNACK is on its way)."""
    channel = connection.channel
    level = channel.protocol_level
    LOGGER.info("client connected", extra={"ctx": {
        "client_id": channel.client_id, "username": connection.username, "peer": connection.peer,
        "protocol": PROTOCOLS.get(level, str(level)), "protocol_level": level, "keep_alive_s": channel.keep_alive,
        "clean_start": clean_start, "session_present": session_present}})


def closed(connection: LoggedConnection, close: Close) -> None:
    """Log why ``connection`` closes: ``close.log`` says it in words, ``reason`` is the MQTT reason code's name."""
    LOGGER.info("closing connection: %s", close.log, extra={"ctx": {
        "client_id": connection.client_id, "username": connection.username, "peer": connection.peer,
        "reason": close.reason.name}})
