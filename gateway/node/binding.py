"""Listening sockets that cannot be opened say where and what to change: one line, no traceback.

An operator who starts a second node on a host (docs/cluster.md, "Two gateways
on one host") and forgets a port sees ``cannot listen on 127.0.0.1:18083 (admin
API): [Errno 98] Address already in use; change admin.port (--admin-port)``
rather than a bare errno: the address, the listener and the option to change.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BindError", "LISTENER_OPTIONS", "naming_the_address"]

LISTENER_OPTIONS = {
    "tcp": ("MQTT listener", "node.port (--port)", "node.host (--host)"),
    "tls": ("TLS listener", "tls.port (--tls-port)", "tls.host (--tls-host)"),
    "ws": ("WebSocket listener", "ws.port (--ws-port)", "ws.host (--ws-host)"),
    "wss": ("secure WebSocket listener", "wss.port (--wss-port)", "wss.host (--wss-host)"),
    "admin": ("admin API", "admin.port (--admin-port)", "admin.host (--admin-host)"),
    "store_metrics": ("store replica metrics", "store.metrics_port (--store-metrics-port)",
                      "store.listen (--listen)"),
}
"""Listener kind -> (what it is, in the error line; the option that sets its port; the one that sets its host)."""

HOST_ERRNOS = frozenset({errno.EADDRNOTAVAIL})
"""The host is not an address of this machine: the host option is the one to change, not the port."""


class BindError(OSError):
    """A listener could not bind; the message names the address and the option to change (an ``OSError``, so
    the node's start-up failure handling logs it as one line)."""


@contextmanager
def naming_the_address(kind: str, host: str, port: int) -> Iterator[None]:
    """Turn an ``OSError`` of opening listener ``kind`` on ``host:port`` into a ``BindError`` that names them.

    Raises:
        BindError: the address is taken, not local, or not allowed.
    """
    try:
        yield
    except OSError as exc:
        what, port_option, host_option = LISTENER_OPTIONS[kind]
        option = host_option if exc.errno in HOST_ERRNOS else port_option
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise BindError(f"cannot listen on {address} ({what}): {exc.strerror or exc}; change {option}") from exc
