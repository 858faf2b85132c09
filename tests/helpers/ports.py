"""Ports for test processes to bind, chosen below the ephemeral range, where no connection takes them meanwhile.

Binding to port 0 gets a port from the ephemeral range (``net.ipv4.ip_local_port_range``), the range every
outgoing connection on the machine takes its local port from too. A test closes its probe socket and a process
binds the port later (a node starting, or restarted on the same port after a SIGKILL, seconds after): on a machine
running other suites (about 5,400 sockets in TIME-WAIT counted, so some 90 new connections a second) one of them
may take the port meanwhile, and a restarted store exited on it under load. Below the range only an explicit bind
takes a port.
"""

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
LOWEST = 10_000  # above the well-known and registered ports services here listen on
_RANDOM = random.SystemRandom()  # independent of any seeding a test does: workers must not draw alike


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = HOST) -> int:
    """A port of ``host`` nothing is bound to now (nor lingering in TIME-WAIT), below the ephemeral range; drawn at
    random, so that parallel test processes rarely try the same one."""
    end = _ephemeral_start()
    if end - LOWEST < 1000:  # an unusual range: fall back on the kernel's choice
        with socket.socket() as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    while True:
        port = _RANDOM.randrange(LOWEST, end)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
