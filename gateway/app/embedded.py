"""The composition root of ``lightgate serve``: the gateway node and its store node in one process.

The gateway runs over a ``LocalStore`` (store/local.py) that holds one lease for the life of the process:
store calls are function calls, events travel in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from gateway.app.serve import NodeFront, Running, run_node, serve_node
from gateway.mqtt.session import clamp_session_blob, session_blob_expiry
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.node import open_store

__all__ = ["run_gateway_node", "serve_gateway"]

LOGGER = logging.getLogger(__name__)


async def serve_gateway(
    settings: Mapping[str, Any],
    *,
    running: Running | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the embedded node until cancelled: store, notify, MQTT listener.

    ``task_status.started`` receives the (host, port) listened on (port 0 picks a free one); ``running``, if given,
    the node first.

    Raises:
        PasswordFileError, AclError: the configured password or ACL file is missing or malformed
            (checked before the store opens).
        ListenerError: a TLS certificate, key or CA file is missing or unreadable (also before the store opens).
    """
    front = NodeFront.from_settings(settings)
    data = Path(settings["node.data"])
    async with open_store(data, CommitLogConfig.from_settings(settings), tier=settings,
                          fix_session=clamp_session_blob, session_expiry=session_blob_expiry,
                          timer_max_pending=settings["delayed.max_pending_per_client"]) as store:
        LOGGER.info("store node ready", extra={"ctx": {"data": str(data),
                                                       "written_offset": store.log.log.written_offset}})
        local = LocalStore(store, lease=True)
        try:
            await serve_node(settings, local, front, flush_latency=store.log.flush_latency, running=running,
                             task_status=task_status)
        finally:
            local.close()


def run_gateway_node(conf: Any) -> int:
    """Entry point for ``lightgate serve``: returns the process exit status."""
    return run_node(conf, serve_gateway)
