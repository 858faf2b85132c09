"""The composition root of ``lightgate gateway``: a gateway node over a store node process.

The node is the embedded one over a ``RemoteStore`` (store/rpc/client.py); its MQTT listeners set SO_REUSEPORT,
so several gateway processes can share a port (``gateway.workers``, gateway/app/workers.py). The store may start
later or restart: the client retries until it connects. ``gateway.store`` may list the replicas of a replicated
store (``HOST:PORT,HOST:PORT,...``): the client finds the leader and follows it (store/rpc/connection.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import trio

from gateway.app.serve import NodeFront, Running, run_node, serve_node
from store.rpc.client import RemoteStore
from store.rpc.connection import Addresses

__all__ = ["run_cluster_gateway", "serve_cluster_gateway"]

LOGGER = logging.getLogger(__name__)


async def serve_cluster_gateway(
    settings: Mapping[str, Any],
    *,
    running: Running | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a cluster gateway node until cancelled: ``serve_node`` over the store node at ``gateway.store``.

    ``task_status.started`` receives the (host, port) of the plain TCP listener.

    Raises:
        PasswordFileError, AclError, ListenerError: as ``serve_gateway`` (before connecting).
        ValueError: ``gateway.store`` is not a list of HOST:PORT.
    """
    front = NodeFront.from_settings(settings)
    front = replace(front, specs=[replace(spec, reuse_port=True) for spec in front.specs])
    addresses = Addresses.parse(settings["gateway.store"])
    async with RemoteStore.connect(resolver=addresses, timeout_s=None, token=settings.get("store.token", ""),
                                   failover_wait_s=settings.get("store.failover_wait_s", 0.0)) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.log_statistics)
            bound = await nursery.start(functools.partial(serve_node, settings, client, front, running=running))
            task_status.started(bound)


def run_cluster_gateway(conf: Any) -> int:
    """Entry point for one ``lightgate gateway`` process: returns the process exit status."""
    try:
        Addresses.parse(conf["gateway.store"])
    except ValueError as exc:
        LOGGER.error("gateway node not started: gateway.store: %s", exc)
        return 1
    if conf["store.failover_wait_s"] < 0:
        LOGGER.error("gateway node not started: store.failover_wait_s must not be negative")
        return 1
    return run_node(conf, serve_cluster_gateway)
