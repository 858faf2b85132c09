"""``lightgate gateway --workers N``: N cluster gateway processes sharing one MQTT port.

Python runs one core per process; a cluster gateway keeps no state of its own
that others need (the store node has it), so the way to use more cores is more
gateway processes. Each one is a plain ``lightgate gateway`` process (its own
store connection and node name) whose listeners set SO_REUSEPORT; the kernel
spreads new connections over them.

This parent only starts the workers, forwards SIGINT/SIGTERM to them (as
SIGTERM) and SIGHUP (as SIGHUP: each worker reloads), and waits for them all; it does not restart a worker that dies (the devices of a dead
worker reconnect and land on the others; a service manager restarts the whole
group). Worker ``i`` serves its admin API on ``admin.port + i`` so each can be
scraped (with ``admin.port`` 0 every worker has none).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

__all__ = ["run_workers"]

LOGGER = logging.getLogger(__name__)


def run_workers(argv: Sequence[str], conf: Any) -> int:
    """Run ``conf["gateway.workers"]`` gateway processes with the command line ``argv``; return 0 if all ended well.

    ``node.port`` 0 is replaced by one free port that every worker shares.
    """
    workers = conf["gateway.workers"]
    port = conf["node.port"] or _free_port(conf["node.host"])
    admin_port = conf["admin.port"]
    children: dict[int, subprocess.Popen[bytes]] = {}
    for index in range(workers):
        command = [sys.executable, "-m", "gateway.app.cli", *argv, "--workers", "1", "--port", str(port),
                   "--admin-port", str(admin_port + index if admin_port else 0)]
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        children[child.pid] = child
    LOGGER.info("gateway workers started", extra={"ctx": {"workers": workers, "port": port,
                                                          "pids": sorted(children)}})

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGHUP if signum == signal.SIGHUP else signal.SIGTERM)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    failed = 0
    try:
        while children:
            pid, status = os.wait()  # signals run ``forward`` and the wait resumes (PEP 475)
            child = children.pop(pid, None)
            if child is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            child.returncode = code
            if code != 0:
                failed += 1
                LOGGER.error("gateway worker exited", extra={"ctx": {"pid": pid, "status": code}})
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 1 if failed else 0


def _free_port(host: str) -> int:
    """A port nobody listens on now, for the workers to share (the kernel picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
