"""systemd's readiness protocol: a node run as a ``Type=notify`` service says ``READY=1`` once it listens.

systemd names a unix datagram socket in ``$NOTIFY_SOCKET`` (a path, or ``@name``
in the abstract namespace); the message is one datagram of ``KEY=value`` lines
(sd_notify(3)). Outside systemd the variable is unset and nothing is sent.
gateway/app/lightgate.service (``lightgate systemd-unit``) runs ``lightgate serve`` this way.
"""

from __future__ import annotations

import logging
import os
import socket

LOGGER = logging.getLogger("lightgate.sdnotify")


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to ``$NOTIFY_SOCKET``; True if sent.

    A socket that cannot be reached is logged, never raised: the node serves
    all the same, and systemd times the start out on its own.
    """
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        LOGGER.warning("systemd notification not sent", extra={"ctx": {"socket": address, "error": str(exc)}})
        return False
    return True
