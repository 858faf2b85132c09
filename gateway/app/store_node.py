"""The composition root of ``lightgate store``: a store node serving remote nodes over the RPC, alone or as a replica
of a replicated group (``replication.group``: store/replica/role.py runs its roles, store/controller/ its etcd)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import trio

from gateway.app.logs import leaves
from gateway.app.process import return_freed_buffers, set_collection_policy
from gateway.app.signals import on_hangup, until_signalled
from store.api import StartupError
from store.controller.group import ReplicaNameTaken
from store.log.commitlog import CommitLogConfig
from store.node import SessionExpiry, SessionFixer, open_store
from store.rpc.access import StoreAccess
from store.rpc.server import serve_rpc
from store.rpc.wire import parse_address

__all__ = ["STORE_SWITCH_INTERVAL_S", "run_store_node", "serve_replica", "serve_store"]

LOGGER = logging.getLogger(__name__)

STORE_SWITCH_INTERVAL_S = 0.0005
"""The GIL switch interval of a store node process (Python's default: 5 ms). Its pull threads release the GIL
around every CommitLog read and must get it back while the dispatcher thread runs Python: at 5 ms per hand-back
a gateway's pull of 256 messages waited milliseconds, at 0.5 ms the backlog drains ~10% faster (bench fanin)."""


async def serve_store(settings: Mapping[str, Any], access: StoreAccess | None = None,
                      reload: Callable[[], None] | None = None, fix_session: SessionFixer | None = None,
                      session_expiry: SessionExpiry | None = None) -> None:
    """Run a store node, serving gateway nodes over the RPC on ``store.listen``, until SIGINT or SIGTERM.

    ``access`` (store/rpc/access.py, built by the command line from ``auth.*`` and ``store.token``)
    decides who may connect; None: everyone. ``reload`` runs on each SIGHUP (``on_hangup``);
    ``fix_session``, ``session_expiry``: see ``store.node.open_store``.

    Raises:
        ValueError: ``store.listen`` is not HOST:PORT (checked before the store opens).
        OSError: the RPC port cannot be bound.
    """
    sys.setswitchinterval(STORE_SWITCH_INTERVAL_S)
    host, port = parse_address(settings["store.listen"])
    data = Path(settings["node.data"])
    async with open_store(data, CommitLogConfig.from_settings(settings), tier=settings, fix_session=fix_session,
                          session_expiry=session_expiry, lease_s=settings["store.lease_s"],
                          timer_max_pending=settings["delayed.max_pending_per_client"]) as node:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
                await until_signalled(task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(stop_on_signal)  # signals are caught before "ready" is logged
            await nursery.start(on_hangup, reload)
            listeners = await nursery.start(partial(serve_rpc, node, host, port, access=access))
            bound_host, bound_port = listeners[0].socket.getsockname()[:2]
            LOGGER.info(
                "store node ready",
                extra={"ctx": {"data": str(data), "written_offset": node.log.log.written_offset,
                               "dispatched_offset": node.dispatcher.dispatched_offset,
                               "host": bound_host, "port": bound_port}},
            )
    LOGGER.info("store node stopped")


async def serve_replica(settings: Mapping[str, Any], access: StoreAccess | None = None,
                        reload: Callable[[], None] | None = None, fix_session: SessionFixer | None = None,
                        session_expiry: SessionExpiry | None = None) -> None:
    """Run one replica of the store group ``replication.group`` until SIGINT or SIGTERM: its RPC listener on
    ``store.listen`` (registered in etcd as its address), following or leading as the controller decides.

    Raises:
        ValueError: ``store.listen`` is not HOST:PORT, or the replication settings disagree (no name, a lease
            shorter than the leader lease).
        OSError: the RPC port cannot be bound.
    """
    from gateway.ops.admin import serve_admin
    from gateway.ops.replica import ReplicaEndpoint
    from store.controller.group import GroupConfig
    from store.replica.figures import RoleFigures
    from store.replica.role import ReplicaConfig, run_replica
    from store.rpc.front import RpcFront
    from store.rpc.server import RpcServer

    sys.setswitchinterval(STORE_SWITCH_INTERVAL_S)
    host, port = parse_address(settings["store.listen"])
    name = settings["replication.name"]
    front = RpcFront(access)  # its refusing phases admit log readers as the leader does
    async with trio.open_nursery() as nursery:

        async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
            await until_signalled(task_status=task_status)
            nursery.cancel_scope.cancel()

        await nursery.start(stop_on_signal)
        await nursery.start(on_hangup, reload)
        listeners = await nursery.start(front.serve, host, port)
        bound_host, bound_port = listeners[0].socket.getsockname()[:2]
        figures = RoleFigures(settings["replication.group"], name)
        metrics_address = ""
        if settings["store.metrics_port"]:
            metrics = await nursery.start(partial(serve_admin, ReplicaEndpoint(figures.statistics), host,
                                                  settings["store.metrics_port"], max_body=0, kind="store_metrics"))
            metrics_address = "{}:{}".format(*metrics[0].socket.getsockname()[:2])
        group = GroupConfig(
            endpoints=tuple(settings["replication.etcd"]), group=settings["replication.group"], name=name,
            address=f"{bound_host}:{bound_port}", replicas=tuple(settings["replication.replicas"]) or (name,),
            lease_s=settings["replication.lease_s"], leader_lease_s=settings["replication.leader_lease_s"],
            unclean_election=settings["replication.unclean_election"], metrics_address=metrics_address)
        config = ReplicaConfig(
            data=Path(settings["node.data"]), log_config=CommitLogConfig.from_settings(settings), group=group,
            acks=settings["replication.acks"], max_lag_s=settings["replication.max_lag_s"],
            token=settings.get("store.token", ""),
            store_options={"tier": settings, "fix_session": fix_session, "session_expiry": session_expiry,
                           "lease_s": settings["store.lease_s"],
                           "timer_max_pending": settings["delayed.max_pending_per_client"]})
        await nursery.start(partial(run_replica, config, front, lambda node: RpcServer(node, access=access),
                                    figures=figures))
        LOGGER.info("store replica ready", extra={"ctx": {
            "group": group.group, "name": name, "data": str(config.data), "host": bound_host, "port": bound_port,
            "acks": config.acks, "metrics": metrics_address}})
    LOGGER.info("store replica stopped")


def run_store_node(conf: Any, access: StoreAccess | None = None, reload: Callable[[], None] | None = None,
                   fix_session: SessionFixer | None = None, session_expiry: SessionExpiry | None = None) -> int:
    """Entry point for ``lightgate store``: returns the process exit status.

    ``access``, ``reload``, ``fix_session``, ``session_expiry``: see ``serve_store``.
    """
    try:
        parse_address(conf.values["store.listen"])
    except ValueError as exc:
        LOGGER.error("store node not started: store.listen: %s", exc)
        return 1
    replicated = bool(conf.values["replication.group"])
    if replicated and not conf.values["replication.name"]:
        LOGGER.error("store node not started: replication.group is set without replication.name (this replica's"
                     " name in the group)")
        return 1
    if replicated and not 0 < conf.values["replication.leader_lease_s"] < conf.values["replication.lease_s"]:
        LOGGER.error("store node not started: replication.leader_lease_s must be above 0 and below "
                     "replication.lease_s (an old leader stops acknowledging before its etcd lease ends)")
        return 1
    if conf.values["store.lease_s"] <= 0:
        LOGGER.error("store node not started: store.lease_s must be more than 0 (heartbeats go every lease / 5)")
        return 1
    set_collection_policy()
    return_freed_buffers()
    failed = False
    try:
        trio.run(serve_replica if replicated else serve_store, conf.values, access, reload, fix_session,
                 session_expiry)
    except* OSError as group:  # e.g. the RPC port is taken; nurseries may wrap it in a group
        LOGGER.error("store node failed: %s", "; ".join(f"{type(exc).__name__}: {exc}" for exc in leaves(group)))
        failed = True
    except* ReplicaNameTaken as group:  # another live replica of the group has this name
        LOGGER.error("store replica not started: %s", "; ".join(str(exc) for exc in leaves(group)))
        failed = True
    except* StartupError as group:  # the data cannot be opened: what happened and what to do
        LOGGER.error("%s", "; ".join(str(exc) for exc in leaves(group)))
        failed = True
    return 1 if failed else 0
